"""Output and delivery: output records, acknowledgement, the in-flight table, dead letters, the guarantees."""
