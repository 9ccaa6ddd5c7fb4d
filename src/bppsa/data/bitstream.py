"""Synthetic bitstream classification (Eq. 8): class c ~ U{0..9}, x_t ~ Bernoulli(0.05 + 0.1 c).

Stored bit-packed along time (``np.packbits``), so the paper's T = 30,000 set of 32,000 samples is
120 MB on disk.  Generation is chunked over samples to bound memory, and deterministic given the
seed (the chunk size is part of the recipe, so it is fixed).
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..io import atomic_path
from . import DatasetError

CLASSES = 10
_CHUNK = 1024  # samples per generation chunk: part of the deterministic recipe


def class_probability(c: np.ndarray) -> np.ndarray:
    return 0.05 + 0.1 * np.asarray(c, dtype=np.float64)


def generate(seq_len: int, samples: int, seed: int = 0, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Return ``x_bits`` (uint8 [N, ceil(T/8)], packed along time) and ``y`` (uint8 [N])."""
    if seq_len < 1 or samples < 1:
        raise ValueError(f"seq_len and samples must be >= 1 (got {seq_len}, {samples})")
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=samples, dtype=np.uint8)
    x_bits = np.empty((samples, (seq_len + 7) // 8), dtype=np.uint8)
    starts = range(0, samples, _CHUNK)
    for s in tqdm(starts, desc=f"bitstream T={seq_len}", disable=not progress or len(starts) < 4):
        e = min(s + _CHUNK, samples)
        p = class_probability(y[s:e]).astype(np.float32)[:, None]
        # float32 uniforms halve the memory traffic of the dominant step; the bias is < 2^-24
        x_bits[s:e] = np.packbits(rng.random((e - s, seq_len), dtype=np.float32) < p, axis=1)
    return x_bits, y


def write(path: str | Path, seq_len: int, samples: int, seed: int = 0) -> Path:
    x_bits, y = generate(seq_len, samples, seed)
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, x_bits=x_bits, y=y, seq_len=np.int64(seq_len), seed=np.int64(seed))
    return Path(path)


def load(path: str | Path) -> tuple[np.ndarray, np.ndarray, int]:
    """Read and validate a bitstream file; any defect raises DatasetError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file (run the bitstream_make rule)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = {"x_bits", "y", "seq_len"} - set(z.files)
            if missing:
                raise DatasetError(f"{path}: corrupt bitstream file, missing {sorted(missing)}")
            x_bits, y, seq_len = z["x_bits"], z["y"], int(z["seq_len"])
    except DatasetError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{path}: truncated or corrupt bitstream file ({exc})") from exc
    if x_bits.dtype != np.uint8 or x_bits.ndim != 2 or x_bits.shape[1] != (seq_len + 7) // 8:
        raise DatasetError(f"{path}: x_bits has shape {x_bits.shape}/{x_bits.dtype}, "
                           f"expected [N, {(seq_len + 7) // 8}] uint8")
    if y.shape != (x_bits.shape[0],) or (y.size and int(y.max()) >= CLASSES):
        raise DatasetError(f"{path}: labels y are inconsistent with x_bits ({y.shape} vs {x_bits.shape[0]} samples)")
    return x_bits, y, seq_len


def batch(x_bits: np.ndarray, y: np.ndarray, seq_len: int, idx: np.ndarray, dtype=None, device="cpu"):
    """Unpack samples ``idx`` into the model's time-major input ``[T, B, 1]`` (``dtype``, default float32)
    and labels ``[B]``, as torch tensors (torch imported here: generating a set does not need it)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    bits = np.unpackbits(x_bits[idx], axis=1, count=seq_len)  # [B, T]
    x = torch.from_numpy(np.ascontiguousarray(bits.T)).to(device=device, dtype=dtype).unsqueeze(-1)
    return x, torch.from_numpy(y[idx].astype(np.int64)).to(device)
