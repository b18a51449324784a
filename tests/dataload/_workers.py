"""Per-process functions for the cache tests (run by launcher.local without a process group)."""

from __future__ import annotations

import hashlib
import os

from dataload.cache import CacheConfig, open_or_build


def race_to_build(directory: str, path_npy: str) -> dict:
    """Every process opens the same cache at once; only one may build it."""
    import numpy as np

    tokens = np.load(path_npy)

    def make():
        with open(os.path.join(directory, "builds"), "a") as f:
            f.write(f"{os.getpid()}\n")

        def fill(out):
            out[:] = tokens.reshape(-1, 16)

        return "int32", (16,), len(tokens) // 16, fill

    cache = open_or_build(CacheConfig(directory=directory, segment_samples=64), "fp-1", make)
    digest = hashlib.sha256(np.ascontiguousarray(cache.samples).tobytes()).hexdigest()
    return {"digest": digest, "count": len(cache)}
