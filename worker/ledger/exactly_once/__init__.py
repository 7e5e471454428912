"""Exactly once: the transaction loop, the state machine, the gated producer, take-over."""
