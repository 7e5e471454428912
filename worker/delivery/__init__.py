"""Delivery: when an input is finished and how its offset commits: the guarantees (at least once,
exactly once), acknowledgement and the in-flight table."""
