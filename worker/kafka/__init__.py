"""Thin wrappers over confluent-kafka: configs, the delivery loop, offsets and message formats."""
