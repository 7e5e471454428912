"""Subcommands of `keyword-embedder`: each module has `configure(parser)` and `main(args) -> int`."""
