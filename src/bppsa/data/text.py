"""A real text corpus that needs no download: the Python documentation's topics, shipped by CPython itself.

``pydoc_data.topics`` (in the standard library since Python 3.2) holds the text of the Language Reference sections
that ``help('TOPIC')`` prints: English prose with code examples, ~0.5 MB.  It comes with every CPython, so a fresh
clone trains on it offline; its text changes with the Python version, so every result records the version and the
corpus's SHA-256.  Tokens are bytes (a vocabulary of 256).
"""
from __future__ import annotations

import hashlib
import sys

import torch

__all__ = ["VOCAB", "corpus", "split", "train_batch", "val_windows"]

VOCAB = 256


def corpus() -> tuple[torch.Tensor, dict]:
    """The corpus as a uint8 tensor of bytes (topics in sorted order, blank lines between), and what it is."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # a distribution that splits the standard library
        raise RuntimeError("the LBI corpus is CPython's pydoc_data.topics, which this Python lacks "
                           f"({exc}); install the full standard library (e.g. Debian's libpython3-stdlib)") from exc
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    info = {"corpus": "pydoc_data.topics", "python": sys.version.split()[0], "bytes": len(text),
            "sha256": hashlib.sha256(text).hexdigest()}
    return torch.frombuffer(bytearray(text), dtype=torch.uint8), info


def split(data: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``1 - val_fraction`` of the bytes for training, the rest (contiguous) for validation."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:]


def train_batch(data: torch.Tensor, seq: int, batch: int, generator: torch.Generator):
    """``batch`` random windows: inputs ``[batch, seq]`` and their next bytes (int64)."""
    start = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
    idx = start[:, None] + torch.arange(seq + 1)
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]


def val_windows(data: torch.Tensor, seq: int, count: int):
    """``count`` windows evenly spaced over ``data`` (the same every run): inputs and targets."""
    if len(data) < seq + 2:
        raise ValueError(f"validation text of {len(data)} bytes is shorter than a window of {seq + 1}")
    start = torch.linspace(0, len(data) - seq - 1, count).long()
    w = data[start[:, None] + torch.arange(seq + 1)].long()
    return w[:, :-1], w[:, 1:]
