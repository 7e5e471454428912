"""Intake: consumed records tokenized and submitted (or dead-lettered); flow control."""
