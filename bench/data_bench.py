"""``p2p-bench data``: how fast a replacement rank gets its first batch, cache vs. source.

The bench writes a JSON-lines corpus of ``--size-mb`` (text it generates itself) into a temporary
directory and measures, in one run:

- from the source: what a restarted job does (read the file, tokenise every document, pack
  sequences, position the sampler) until the first batch of step ``--resume-step`` is ready;
- from the cache: what a replacement rank does (map the node's cache, verify it, position the
  sampler in O(1)) until the same batch is ready (asserted equal);
- sustained samples/s reading batches from each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from bench.bench_reports import DataReport
from bench.errors import UsageError
from bench.flags import count, positive
from bench.report_dir import add_out_dir, command_line, finish_with_table

_WORDS = [f"w{i:04d}" for i in range(4096)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench data``."""
    p.add_argument("--size-mb", type=positive, default=300.0, help="corpus size (default 300)")
    p.add_argument("--seq-len", type=count(2), default=512, help="tokens per sample")
    p.add_argument("--global-batch", type=count(1), default=64, help="samples per step, all ranks")
    p.add_argument("--world-size", type=count(1), default=8, help="ranks sharing the global batch")
    p.add_argument(
        "--resume-step", type=count(0), default=100, help="step the replacement resumes at"
    )
    p.add_argument(
        "--batches", type=count(1), default=200, help="batches for the throughput figure"
    )
    p.add_argument(
        "--dir",
        default=None,
        help="where to put corpus and cache (default: a temp "
        "dir; the cache goes to /dev/shm when it exists)",
    )
    add_out_dir(p, "data")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _tokenize(text: str) -> list[int]:
    # A word-level tokenizer over the generated vocabulary (what a real tokenizer costs is
    # at least this: one pass over every document in Python).
    return [int(w[1:]) + 1 for w in text.split()]


def _write_corpus(path: Path, size_bytes: int) -> int:
    import numpy as np

    rng = np.random.default_rng(0)
    written = docs = 0
    with open(path, "w") as f:
        while written < size_bytes:
            words = rng.integers(0, len(_WORDS), 200)
            line = json.dumps({"text": " ".join(_WORDS[i] for i in words)}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def measure(args: argparse.Namespace) -> DataReport:
    """Run the benchmark; returns its report."""
    import numpy as np

    from dataload.cache import CacheConfig, open_source
    from dataload.loader import ResumableLoader
    from dataload.sampler import rank_ids, state_at_step
    from dataload.sources import JsonlTextSource

    with tempfile.TemporaryDirectory(prefix="p2p-data-bench-", dir=args.dir) as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        docs = _write_corpus(corpus, int(args.size_mb * 2**20))
        source = JsonlTextSource(
            str(corpus), seq_len=args.seq_len, tokenize=_tokenize, tokenizer_id="bench-words-v1"
        )
        shm = Path("/dev/shm")
        cache_root = tempfile.mkdtemp(prefix="p2p-data-bench-", dir=shm if shm.is_dir() else tmp)
        cfg = CacheConfig(directory=cache_root, name="corpus", segment_samples=8192)
        try:
            # The node's cache is built once, before any fault (not part of either figure).
            t = time.perf_counter()
            open_source(cfg, source)
            build_s = time.perf_counter() - t

            # A restarted job: re-read and re-tokenise, then position the sampler.
            t = time.perf_counter()
            tokens = source.tokens()
            count = len(tokens) // args.seq_len
            samples = tokens[: count * args.seq_len].reshape(count, args.seq_len)
            state = state_at_step(0, args.resume_step, count, args.global_batch)
            ids = rank_ids(state, count, args.global_batch, args.world_size, 0)
            from_source = samples[ids]
            source_first_s = time.perf_counter() - t

            # A replacement rank: map and verify the node's cache, position in O(1).
            t = time.perf_counter()
            cache = open_source(cfg, source)
            loader = ResumableLoader(
                cache, global_batch=args.global_batch, world_size=args.world_size, rank=0
            )
            loader.seek(args.resume_step)
            from_cache = loader.next_batch()
            cache_first_s = time.perf_counter() - t
            assert np.array_equal(from_cache.numpy(), from_source), "cache and source disagree"

            n = min(args.batches, count // args.global_batch)
            t = time.perf_counter()
            loader.seek(0)
            for _ in range(n):
                loader.next_batch()
            cache_rate = n * len(from_cache) / (time.perf_counter() - t)
            loader.close()
            # Sustained rate from the source: tokenising is the bottleneck; measured on the
            # whole pass above (samples produced per second of tokenising).
            source_rate = count / source_first_s
        finally:
            shutil.rmtree(cache_root, ignore_errors=True)
    return DataReport(
        corpus_mb=args.size_mb,
        documents=docs,
        samples=count,
        seq_len=args.seq_len,
        cache_build_s=build_s,
        first_batch_from_source_s=source_first_s,
        first_batch_from_cache_s=cache_first_s,
        samples_per_s_cache=cache_rate,
        samples_per_s_source=source_rate,
        command=command_line(args),
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``p2p-bench data``."""
    if args.global_batch < args.world_size:
        raise UsageError(
            f"--global-batch {args.global_batch} is smaller than --world-size "
            f"{args.world_size}: every rank reads at least one sample a step"
        )
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)  # bench.cli checked it can be
    r = measure(args)
    table = "\n".join(
        [
            f"corpus {r.corpus_mb:.0f} MB, {r.samples} samples of {r.seq_len} tokens",
            f"first batch, re-read + re-tokenise: {r.first_batch_from_source_s * 1e3:10.1f} ms",
            f"first batch, node cache:            {r.first_batch_from_cache_s * 1e3:10.1f} ms",
            f"  speedup                           {r.first_batch_speedup:10.0f} x",
            f"samples/s from the cache:           {r.samples_per_s_cache:10.0f}",
            f"samples/s from the source:          {r.samples_per_s_source:10.0f}",
        ]
    )
    finish_with_table(args, r.to_json(), table)
    return 0
