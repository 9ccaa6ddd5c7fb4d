"""CIFAR-10 (the python version: download, verify, parse) and its offline stand-in.

``source`` is ``download`` (fetch the canonical tarball, MD5-checked and resumable), ``standin``
(scikit-learn's bundled 8x8 digits scaled to 32x32x3 -- no network needed, always labelled
"stand-in") or a path to an existing ``cifar-10-python.tar.gz`` or extracted
``cifar-10-batches-py`` folder.  ``prepare`` resolves the source once (the workflow's ``cifar10_make``
rule, which runs where the network is) into a manifest; training and analysis read the manifest.

The batches are pickles, and a pickle can run code when it is loaded.  They are read with an
unpickler that admits only what the format holds (a dict of bytes, ints, lists and uint8 arrays) and
refuses anything else, naming the file.
"""
from __future__ import annotations

import codecs
import json
import os
import pickle
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..io import atomic_path
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


class UnsafePickle(CorruptFile):
    pass


# What CIFAR-10's python batches reference (pickled by numpy 1.x, or re-pickled by numpy 2.x), and
# nothing more: an array is rebuilt from its dtype and raw bytes, never by calling arbitrary code.
_NP_CORE = np._core if hasattr(np, "_core") else np.core  # numpy 2 renamed numpy.core
_ALLOWED = {
    (f"numpy.{core}.{mod}", name): getattr(getattr(_NP_CORE, mod), name)
    for core in ("core", "_core") for mod, name in (("multiarray", "_reconstruct"), ("numeric", "_frombuffer"))
} | {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,
}


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickle(f"refusing to load {module}.{name}: a CIFAR-10 batch holds only a dict of "
                               "arrays, lists and bytes") from None


def safe_load(f) -> object:
    """``pickle.load(f, encoding="bytes")`` that admits only the types a CIFAR-10 batch holds."""
    return _BatchUnpickler(f, encoding="bytes").load()


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch: 10000 x 3072 uint8 images and their labels 0..9; any defect names the file."""
    try:
        with open(path, "rb") as f:
            d = safe_load(f)
        if not isinstance(d, dict):
            raise TypeError(f"a {type(d).__name__}, not a dict")
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except FileNotFoundError:
        raise
    except UnsafePickle as exc:
        raise UnsafePickle(f"{path}: {exc}; the file was not loaded") from None
    except Exception as exc:  # noqa: BLE001 - unpickling garbage raises many kinds
        raise CorruptFile(f"{path}: not a readable CIFAR-10 batch ({type(exc).__name__}: {exc})") from exc
    if data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (data.shape[0],):
        raise CorruptFile(f"{path}: expected N x 3072 images and N labels, got {data.shape} and {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise CorruptFile(f"{path}: labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def _extract(tarball: Path, dest: Path, md5: str = MD5) -> Path:
    """Unpack into a temporary folder beside ``dest/cifar-10-batches-py`` and rename it into place, so
    a half-unpacked folder never sits under the final name.  Members that would land outside the
    folder (absolute paths, ``..``, links out) are refused by tarfile's ``data`` filter."""
    got = md5sum(tarball)
    if got != md5:
        raise CorruptFile(f"{tarball}: MD5 {got} does not match the expected {md5} (config key cifar10.md5)")
    dest.mkdir(parents=True, exist_ok=True)
    final = dest / FOLDER
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest))
    try:
        try:
            with tarfile.open(tarball, "r:gz") as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise CorruptFile(f"{tarball}: cannot be extracted ({exc})") from exc
        if not (tmp / FOLDER).is_dir():
            raise CorruptFile(f"{tarball} holds no {FOLDER}/ folder")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp / FOLDER, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


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


def resolve(source: str, root: str | Path = "data/cifar10", url: str = URL, md5: str = MD5) -> Path | None:
    """The ``cifar-10-batches-py`` folder of ``source`` (downloading and unpacking it if needed), or
    None for the stand-in.  The only step that may touch the network."""
    if source == "standin":
        return None
    root = Path(root)
    if source == "download":
        folder = root / FOLDER
        unpacked_from = root / f"{FOLDER}.md5"  # the MD5 of the tarball the folder came from
        if not (folder.is_dir() and unpacked_from.is_file() and unpacked_from.read_text().strip() == md5):
            tarball = fetch(url, root / TARBALL, md5)
            folder = _extract(tarball, root, md5)
            unpacked_from.write_text(md5 + "\n")
        return folder
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"cifar10.source: {path} does not exist (use download, standin or a path)")
    if path.is_file():
        return _extract(path, root, md5)
    return path / FOLDER if (path / FOLDER).is_dir() else path


def _from_folder(folder: Path | None, seed: int) -> ImageData:
    if folder is None:
        return standin(seed=seed)
    xtr, ytr, xte, yte = load_cifar10_arrays(folder)
    xtr_t, xte_t = _normalise(xtr, xte)
    return ImageData(xtr_t, torch.from_numpy(ytr), xte_t, torch.from_numpy(yte), "CIFAR-10", False)


def load(source: str, root: str | Path = "data/cifar10", seed: int = 0, url: str = URL, md5: str = MD5) -> ImageData:
    """CIFAR-10 by ``source`` (``download`` | ``standin`` | a path); see the module docstring."""
    return _from_folder(resolve(source, root, url, md5), seed)


def prepare(source: str, root: str | Path, out: str | Path, url: str = URL, md5: str = MD5) -> dict:
    """Resolve ``source`` and check every batch, then write the manifest ``out`` that training reads."""
    folder = resolve(source, root, url, md5)
    if folder is not None:
        load_cifar10_arrays(folder)  # refuse a corrupt or unsafe folder here, before any training job
    manifest = {"source": "standin" if folder is None else "CIFAR-10", "config_source": source,
                "folder": None if folder is None else str(folder), "url": url, "md5": md5}
    with atomic_path(out, suffix=".json") as tmp:
        Path(tmp).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def from_manifest(path: str | Path, seed: int = 0) -> ImageData:
    """The data a manifest written by ``prepare`` (``bppsa make-cifar10``) names."""
    path = Path(path)
    try:
        manifest = json.loads(path.read_text())
        folder = manifest["folder"]
    except FileNotFoundError:
        raise FileNotFoundError(f"CIFAR-10 manifest {path} does not exist (run `bppsa make-cifar10` first)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a manifest written by `bppsa make-cifar10` ({exc})") from exc
    return _from_folder(None if folder is None else Path(folder), seed)
