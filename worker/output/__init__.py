"""Output: finished batches become output records (the output stage), failed records dead letters,
and each batch a span."""
