"""Fakes of external libraries' objects, for pure logic tested in-process (the real broker tests
live next to them in tests/)."""
