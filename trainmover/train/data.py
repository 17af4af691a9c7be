"""Deterministic data: the batch of any (step, dp_rank) is a pure function of the step.

A replacement worker therefore needs no data-loader state to resume: it recomputes the
sample positions of the step it starts at. Every random stream (sample positions, dropout)
is derived from (seed, purpose, coordinates) through ``derive_seed``.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import sysconfig
import warnings
from dataclasses import dataclass

import torch

from trainmover.core.config import DataConfig


def derive_seed(*parts) -> int:
    """A 63-bit seed from any tuple of ints/strings; stable across processes and runs
    (Python's ``hash`` is salted per process, so it is not used)."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)


def generator(*parts) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(*parts))
    return g


def builtin_corpus_files() -> list[str]:
    """The standard library's own sources, in a stable order."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "test", "tests", "__pycache__",
                                          "idlelib", "lib2to3", "turtledemo"))
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return out


def _builtin_bytes(max_bytes: int) -> bytes:
    chunks, total = [], 0
    for path in builtin_corpus_files():
        with open(path, "rb") as f:
            b = f.read()
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


@dataclass
class TokenData:
    tokens: torch.Tensor  # 1-D int64 (text) or int32 (uint16 files), shared read-only
    sha256: str
    description: str

    def __len__(self) -> int:
        return self.tokens.numel()


def load_tokens(cfg: DataConfig) -> TokenData:
    if cfg.source == "builtin":
        raw = _builtin_bytes(cfg.builtin_max_bytes)
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        desc = f"builtin: Python {sysconfig.get_python_version()} stdlib sources, {len(raw)} bytes"
        return TokenData(tokens, hashlib.sha256(raw).hexdigest(), desc)
    with open(cfg.source, "rb") as f:
        if cfg.format == "text":
            raw = f.read()
            tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
            digest = hashlib.sha256(raw).hexdigest()
        else:
            # map the file instead of reading it: token files can be far larger than memory
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            with warnings.catch_warnings():  # read-only on purpose: tokens are never written
                warnings.simplefilter("ignore", UserWarning)
                tokens = torch.frombuffer(mm, dtype=torch.int16)
            digest = _file_digest(cfg.source)
    return TokenData(tokens, digest, f"{cfg.format} file {cfg.source}")


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class BatchSource:
    """Samples ``global_batch`` windows of ``seq_len + 1`` tokens per step, at positions drawn
    from a generator seeded by (seed, step). A dp rank takes its contiguous slice."""

    def __init__(self, data: TokenData, seq_len: int, global_batch: int, seed: int,
                 vocab_size: int):
        if len(data) < seq_len + 2:
            raise ValueError(f"data has {len(data)} tokens, fewer than seq_len+2={seq_len + 2}")
        self.data, self.seq_len, self.global_batch = data, seq_len, global_batch
        self.seed, self.vocab_size = seed, vocab_size

    def positions(self, step: int) -> torch.Tensor:
        g = generator(self.seed, "data", step)
        return torch.randint(0, len(self.data) - self.seq_len - 1, (self.global_batch,),
                             generator=g)

    def batch(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each [global_batch // dp, seq_len], int64."""
        per = self.global_batch // dp
        pos = self.positions(step)[dp_rank * per:(dp_rank + 1) * per]
        offsets = torch.arange(self.seq_len + 1)
        windows = self.data.tokens[(pos[:, None] + offsets[None, :]).reshape(-1)]
        windows = windows.reshape(per, self.seq_len + 1).to(torch.int64)
        if self.data.tokens.dtype == torch.int16:
            windows = windows & 0xFFFF  # stored as int16, meant as uint16
        if int(windows.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(windows.max())} at step {step} is outside "
                             f"vocab_size={self.vocab_size}")
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
