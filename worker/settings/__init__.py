"""Settings: the schema, where values come from, the refused librdkafka keys, the rendered reference."""
