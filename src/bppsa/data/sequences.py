"""One interface over the sequence-classification datasets the recurrent benchmarks read.

* bitstream files (``x_bits``/``y``/``seq_len``, see :mod:`bppsa.data.bitstream`): input size 1;
* MFCC feature files (``X`` float32 ``[N, frames, features]``, ``y``, ``classes``, ``source``; read by
  :func:`bppsa.data.irmas.load_mfcc`).

Any defect raises :class:`bppsa.data.DatasetError` naming the file.
"""
from __future__ import annotations

import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import DatasetError, bitstream, irmas


@dataclass
class SequenceDataset:
    path: Path
    n: int
    seq_len: int
    input_size: int
    classes: int
    source: str
    get_batch: Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]]


def open_dataset(path: str | Path, dtype=torch.float32, device="cpu") -> SequenceDataset:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = set(z.files)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{path}: truncated or corrupt dataset file ({exc})") from exc
    if "x_bits" in keys:
        x_bits, y, T = bitstream.load(path)
        return SequenceDataset(path, len(y), T, 1, bitstream.CLASSES, "bitstream (Eq. 8)",
                               lambda idx: bitstream.batch(x_bits, y, T, idx, dtype, device))
    if "X" in keys:
        d = irmas.load_mfcc(path)
        X, y, classes, source = d["X"], d["y"].astype(np.int64), len(d["classes"]), d["source"]
        Xt = torch.from_numpy(X)
        yt = torch.from_numpy(y)

        def get_batch(idx):
            idx = torch.as_tensor(np.asarray(idx))
            return (Xt[idx].transpose(0, 1).to(device=device, dtype=dtype).contiguous(), yt[idx].to(device))

        return SequenceDataset(path, len(y), X.shape[1], X.shape[2], classes, source, get_batch)
    raise DatasetError(f"{path}: not a sequence dataset (expected x_bits or X arrays, found {sorted(keys)})")
