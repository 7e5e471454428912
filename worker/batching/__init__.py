"""Batching: the bucketer, the flush decision, what a call costs, padding, the embedding cache."""
