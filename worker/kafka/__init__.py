"""Thin wrappers over confluent-kafka: configs, the group member, the producer and its delivery loop,
offsets and commits."""
