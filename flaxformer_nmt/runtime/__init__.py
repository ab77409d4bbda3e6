"""Sharding, multi-host set-up, FLOP accounting, host memory, profiling, caches and flag parsing."""
