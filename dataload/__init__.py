"""Node-local memory-mapped sample cache and the exactly-once, resize-aware sampler."""
