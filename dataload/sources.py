"""Where samples come from: token files and JSON-lines text, local or through fsspec.

A source knows its fixed sample shape, how many samples it makes, how to write them all into an
array (what the cache builder calls), and a fingerprint: a hash of everything that determines the
bytes (kind, location, size and modification time or ETag, sequence length, dtype, tokenizer), so a
cache built from anything else is never used for it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

import numpy as np


def _open(path: str, mode: str = "rb") -> IO[Any]:
    if "://" in path:
        try:
            import fsspec
        except ImportError:
            raise ValueError(f"{path} is a URL: install fsspec (pip install fsspec)") from None
        opened: IO[Any] = fsspec.open(path, mode).open()
        return opened
    return open(path, mode)


def _stat(path: str) -> str:
    if "://" in path:
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        info = fs.info(p)
        return f"{info.get('size')}:{info.get('ETag') or info.get('mtime') or ''}"
    import os

    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}"


def _fingerprint(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()


@dataclass(frozen=True)
class TokenFileSource:
    """A flat file of token ids (``.npy`` or raw binary), cut into sequences of ``seq_len``."""

    path: str
    seq_len: int
    dtype: str = "int32"
    """Dtype of a raw binary file (``.npy`` files carry their own)."""

    def _tokens(self) -> np.ndarray:
        with _open(self.path) as f:
            if self.path.endswith(".npy"):
                tokens: np.ndarray = np.load(f).reshape(-1)
                return tokens
            return np.frombuffer(f.read(), dtype=self.dtype)

    @property
    def fingerprint(self) -> str:
        """Hash of the file's identity and the cutting parameters."""
        return _fingerprint("tokens", self.path, _stat(self.path), self.seq_len, self.dtype)

    def build(self) -> tuple[str, tuple[int, ...], int, Callable[[np.ndarray], None]]:
        """``(dtype, sample shape, count, fill)`` for the cache builder."""
        tokens = self._tokens()
        count = len(tokens) // self.seq_len

        def fill(out: np.ndarray) -> None:
            out[:] = tokens[: count * self.seq_len].reshape(count, self.seq_len)

        return str(tokens.dtype), (self.seq_len,), count, fill


@dataclass(frozen=True)
class JsonlTextSource:
    """JSON-lines documents, tokenised by a user function and packed into ``seq_len`` sequences.

    Documents are concatenated, each followed by ``eos_id``, and cut into full sequences (the
    tail shorter than one sequence is dropped).
    """

    path: str
    seq_len: int
    tokenize: Callable[[str], Iterable[int]]
    tokenizer_id: str
    """Names the tokenizer and its version: part of the fingerprint."""
    field: str = "text"
    eos_id: int = 0
    dtype: str = "int32"

    @property
    def fingerprint(self) -> str:
        """Hash of the file's identity, the tokenizer and the packing parameters."""
        return _fingerprint(
            "jsonl",
            self.path,
            _stat(self.path),
            self.seq_len,
            self.tokenizer_id,
            self.field,
            self.eos_id,
            self.dtype,
        )

    def tokens(self) -> np.ndarray:
        """Every token of the file, in order (the expensive part a cache saves)."""
        out: list[int] = []
        with _open(self.path, "rb") as f:
            for line in f:
                if line.strip():
                    out.extend(self.tokenize(json.loads(line)[self.field]))
                    out.append(self.eos_id)
        return np.asarray(out, dtype=self.dtype)

    def build(self) -> tuple[str, tuple[int, ...], int, Callable[[np.ndarray], None]]:
        """``(dtype, sample shape, count, fill)`` for the cache builder."""
        tokens = self.tokens()
        count = len(tokens) // self.seq_len

        def fill(out: np.ndarray) -> None:
            out[:] = tokens[: count * self.seq_len].reshape(count, self.seq_len)

        return self.dtype, (self.seq_len,), count, fill
