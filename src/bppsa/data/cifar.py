"""CIFAR-10 (the python version: download, verify, parse) and its offline stand-in.

``source`` is ``download`` (fetch the canonical tarball, MD5-checked and resumable), ``standin``
(scikit-learn's bundled 8x8 digits scaled to 32x32x3 -- no network needed, always labelled
"stand-in") or a path to an existing ``cifar-10-python.tar.gz`` or extracted
``cifar-10-batches-py`` folder.
"""
from __future__ import annotations

import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .download import fetch, md5sum

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MD5 = "c58f30108f718f92721af3b95e74349a"
TARBALL = "cifar-10-python.tar.gz"
FOLDER = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
STANDIN_LABEL = "stand-in (sklearn digits 8x8 -> 32x32x3)"


class CorruptFile(ValueError):
    pass


@dataclass
class ImageData:
    x_train: torch.Tensor  # [N, 3, 32, 32] float32, normalised per channel with the training statistics
    y_train: torch.Tensor  # [N] int64
    x_test: torch.Tensor
    y_test: torch.Tensor
    name: str  # "CIFAR-10" or the stand-in label
    standin: bool


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch: 10000 x 3072 uint8 images and their labels 0..9; any defect names the file."""
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - unpickling garbage raises many kinds
        raise CorruptFile(f"{path}: not a readable CIFAR-10 batch ({type(exc).__name__}: {exc})") from exc
    if data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (data.shape[0],):
        raise CorruptFile(f"{path}: expected N x 3072 images and N labels, got {data.shape} and {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise CorruptFile(f"{path}: labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def _extract(tarball: Path, dest: Path) -> Path:
    got = md5sum(tarball)
    if got != MD5:
        raise CorruptFile(f"{tarball}: MD5 {got} does not match CIFAR-10's {MD5}")
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CorruptFile(f"{tarball}: cannot be extracted ({exc})") from exc
    return dest / FOLDER


def load_cifar10_arrays(folder: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    folder = Path(folder)
    missing = [n for n in TRAIN_BATCHES + (TEST_BATCH,) if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: missing CIFAR-10 batch file(s) {', '.join(missing)}")
    parts = [_read_batch(folder / n) for n in TRAIN_BATCHES]
    xt, yt = _read_batch(folder / TEST_BATCH)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), xt, yt


def _normalise(x_train: np.ndarray, x_test: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    xtr = torch.from_numpy(x_train).float() / 255.0
    xte = torch.from_numpy(x_test).float() / 255.0
    mean = xtr.mean(dim=(0, 2, 3), keepdim=True)
    std = xtr.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return (xtr - mean) / std, (xte - mean) / std


def standin(test_fraction: float = 0.2, seed: int = 0) -> ImageData:
    """scikit-learn's 1797 bundled 8x8 digit images, bilinearly scaled to 32x32 and repeated over 3
    channels, split train/test with a fixed seed.  A shape-compatible placeholder, not CIFAR-10."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
    x = torch.nn.functional.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    x = (x.clamp(0, 1) * 255).round().to(torch.uint8).repeat(1, 3, 1, 1).numpy()
    y = digits.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    te, tr = perm[:n_test], perm[n_test:]
    xtr, xte = _normalise(x[tr], x[te])
    return ImageData(xtr, torch.from_numpy(y[tr]), xte, torch.from_numpy(y[te]), STANDIN_LABEL, True)


def load(source: str, root: str | Path = "data/cifar10", seed: int = 0) -> ImageData:
    """CIFAR-10 by ``source`` (``download`` | ``standin`` | a path); see the module docstring."""
    if source == "standin":
        return standin(seed=seed)
    root = Path(root)
    if source == "download":
        folder = root / FOLDER
        if not folder.is_dir():
            tarball = fetch(URL, root / TARBALL, MD5)
            folder = _extract(tarball, root)
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"cifar10.source: {path} does not exist (use download, standin or a path)")
        if path.is_file():
            folder = _extract(path, root)
        else:
            folder = path / FOLDER if (path / FOLDER).is_dir() else path
    xtr, ytr, xte, yte = load_cifar10_arrays(folder)
    xtr_t, xte_t = _normalise(xtr, xte)
    return ImageData(xtr_t, torch.from_numpy(ytr), xte_t, torch.from_numpy(yte), "CIFAR-10", False)
