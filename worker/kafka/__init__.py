"""Thin wrappers over confluent-kafka: configs, the group member, the producer and its delivery loop,
the preflight checks. What gets committed is the ledger's (worker/ledger/)."""
