"""The node-local cache: one builder, no torn reads, bad caches rebuilt, peers fetched, verified."""

from __future__ import annotations

import hashlib
import logging
import threading

import numpy as np
import pytest
import torch
import zmq

from dataload.cache import CacheConfig, open_source, validate
from dataload.loader import ResumableLoader
from dataload.peer_fetch import (
    PeerFetchError,
    SegmentServer,
    fetch_cache,
    pack_reply,
    unpack_request,
)
from dataload.sources import JsonlTextSource, TokenFileSource
from launcher.local import WorkerGroupConfig, run_local
from tests.dataload import _workers

SECRET = b"s" * 32


@pytest.fixture
def tokens_file(tmp_path):
    tokens = np.arange(64 * 200, dtype=np.int32) * 3 % 50_000
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    return str(path), tokens


def _cfg(tmp_path, name="c"):
    return CacheConfig(directory=str(tmp_path / name), name="ds", segment_samples=32)


def test_racing_ranks_build_once_and_read_the_same_bytes(tmp_path, tokens_file):
    path, tokens = tokens_file
    cache_dir = str(tmp_path / "shm")
    results = run_local(
        _workers.race_to_build,
        WorkerGroupConfig(world_size=4, backend="none", timeout_s=120),
        (cache_dir, path),
    )
    builds = (tmp_path / "shm" / "builds").read_text().split()
    assert len(builds) == 1, "exactly one rank of the node builds"
    expected = hashlib.sha256(tokens.reshape(-1, 16).tobytes()).hexdigest()
    assert {r["digest"] for r in results} == {expected}, "no reader saw a torn file"


def test_truncated_corrupt_or_foreign_caches_are_rebuilt_never_read(tmp_path, tokens_file, caplog):
    path, tokens = tokens_file
    cfg = _cfg(tmp_path)
    source = TokenFileSource(path, seq_len=64)
    cache = open_source(cfg, source)
    assert np.array_equal(cache.samples, tokens.reshape(-1, 64))
    good = cfg.path.read_bytes()

    cfg.path.write_bytes(good[:-100])  # truncated
    with caplog.at_level(logging.WARNING):
        cache = open_source(cfg, source)
    assert "truncated" in caplog.text and np.array_equal(cache.samples, tokens.reshape(-1, 64))

    corrupt = bytearray(good)
    corrupt[-5000] ^= 0xFF  # one flipped byte in the data
    cfg.path.write_bytes(bytes(corrupt))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cache = open_source(cfg, source)
    assert "checksum mismatch" in caplog.text
    assert np.array_equal(cache.samples, tokens.reshape(-1, 64))

    other = TokenFileSource(path, seq_len=32)  # another processing of the same file
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cache = open_source(cfg, other)
    assert "another source" in caplog.text and cache.header.shape == (32,)
    validate(cfg.path, other.fingerprint)


def test_jsonl_text_is_tokenised_and_packed(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(f'{{"text": "{"ab" * (i + 1)}"}}' for i in range(50)))
    src = JsonlTextSource(
        str(docs),
        seq_len=8,
        tokenize=lambda t: [ord(c) for c in t],
        tokenizer_id="bytes-v1",
        eos_id=0,
    )
    cache = open_source(_cfg(tmp_path), src)
    flat = np.asarray(cache.samples).reshape(-1)
    assert list(flat[:5]) == [97, 98, 0, 97, 98]
    assert len(cache) == len(src.tokens()) // 8


def test_peer_fetch_copies_and_verifies_every_segment(tmp_path, tokens_file):
    path, _tokens = tokens_file
    source = TokenFileSource(path, seq_len=64)
    cache = open_source(_cfg(tmp_path, "node0"), source)
    server = SegmentServer(cache, SECRET)
    try:
        fetched = fetch_cache(_cfg(tmp_path, "node1"), server.address, SECRET, source.fingerprint)
    finally:
        server.close()
    assert np.array_equal(fetched.samples, cache.samples)
    validate(fetched.path, source.fingerprint)


class _FlakyServer:
    """Serves a cache but corrupts segment 1 on its first ``bad`` replies."""

    def __init__(self, cache, bad: int) -> None:
        self.cache, self.bad = cache, bad
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, _, *frames = self.sock.recv_multipart()
            req = unpack_request(SECRET, frames, self.cache.header.num_segments)
            if req.get("what") == "header":
                reply = pack_reply(SECRET, {"what": "header"}, self.cache.header.encode())
            else:
                i = req["segment"]
                data = bytearray(self.cache.segment_bytes(i))
                if i == 1 and self.bad > 0:
                    self.bad -= 1
                    data[3] ^= 0x10
                reply = pack_reply(SECRET, {"what": "segment", "segment": i}, bytes(data))
            self.sock.send_multipart([ident, b"", *reply])

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


def test_a_corrupted_transfer_is_retried_and_never_used(tmp_path, tokens_file, caplog):
    path, _ = tokens_file
    source = TokenFileSource(path, seq_len=64)
    cache = open_source(_cfg(tmp_path, "node0"), source)
    flaky = _FlakyServer(cache, bad=1)
    try:
        with caplog.at_level(logging.WARNING):
            fetched = fetch_cache(
                _cfg(tmp_path, "n1"), f"tcp://127.0.0.1:{flaky.port}", SECRET, source.fingerprint
            )
    finally:
        flaky.close()
    assert "segment 1" in caplog.text and "corrupt" in caplog.text
    assert np.array_equal(fetched.samples, cache.samples)

    always_bad = _FlakyServer(cache, bad=10)
    try:
        with pytest.raises(PeerFetchError, match="corrupt after 3 tries"):
            fetch_cache(
                _cfg(tmp_path, "n2"),
                f"tcp://127.0.0.1:{always_bad.port}",
                SECRET,
                source.fingerprint,
            )
    finally:
        always_bad.close()
    assert not _cfg(tmp_path, "n2").path.exists(), "nothing corrupt is ever published"


def test_peer_with_another_dataset_or_secret_is_refused(tmp_path, tokens_file):
    path, _ = tokens_file
    source = TokenFileSource(path, seq_len=64)
    server = SegmentServer(open_source(_cfg(tmp_path, "node0"), source), SECRET)
    try:
        with pytest.raises(PeerFetchError, match="another dataset"):
            fetch_cache(_cfg(tmp_path, "x"), server.address, SECRET, "other-fingerprint")
        with pytest.raises(PeerFetchError, match="no answer"):
            fetch_cache(
                _cfg(tmp_path, "y"), server.address, b"wrong", source.fingerprint, timeout_s=1
            )
        assert server.dropped == 1, "the server refused the request signed with another secret"
    finally:
        server.close()


def test_loader_resumes_and_resizes_in_o1(tmp_path, tokens_file):
    path, _tokens = tokens_file
    cache = open_source(_cfg(tmp_path), TokenFileSource(path, seq_len=64))
    loaders = [
        ResumableLoader(cache, global_batch=12, world_size=3, rank=r, seed=5) for r in range(3)
    ]
    first = [torch.cat([ld.next_batch() for ld in loaders]) for _ in range(4)]
    for batch in first:
        assert batch.shape == (12, 64)
    saved = loaders[0].state_dict()
    after = torch.cat([ld.next_batch() for ld in loaders])
    # A replacement rank restores the position from the replicated integers ...
    fresh = ResumableLoader(cache, global_batch=12, world_size=3, rank=0, seed=5)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.next_batch(), after[:4])
    # ... and after a shrink to 2 ranks the same global batch continues where it was.
    two = [ResumableLoader(cache, global_batch=12, world_size=3, rank=r, seed=5) for r in range(2)]
    for ld, r in zip(two, range(2)):
        ld.seek(4)
        ld.set_world(2, r)
    assert torch.equal(torch.cat([ld.next_batch() for ld in two]), after)
    for ld in loaders + two + [fresh]:
        ld.close()
