"""Formats: decoding and encoding records (JSON, raw, the Schema Registry formats), headers, keyword files."""
