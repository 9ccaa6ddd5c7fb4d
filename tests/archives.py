"""Small archives in the real layouts of the two downloads, for tests that serve them over HTTP.

- ``irmas_zip``: ``IRMAS-TrainingData.zip`` holding ``IRMAS-TrainingData/<instrument>/`` folders of
  16-bit 44.1 kHz stereo clips named as the real set names them (``[cel][cla]0001__1.wav``,
  ``[flu][nod][cla]0402__2.wav``: instrument, optional drums, genre, song, excerpt).
- ``cifar_tarball``: ``cifar-10-python.tar.gz`` holding ``cifar-10-batches-py/`` with
  ``data_batch_1..5``, ``test_batch`` and ``batches.meta``, pickled as the original was (protocol 2,
  numpy arrays and byte-string keys), ``per_batch`` images each.
"""
from __future__ import annotations

import io
import pickle
import tarfile
import zipfile
from pathlib import Path

import numpy as np

from bppsa.data import irmas

# (instrument folder, file name) pairs in the real set's naming; one clip per instrument, and the
# two examples of the naming given in the IRMAS documentation
IRMAS_FILES = [
    ("cel", "[cel][cla]0001__1.wav"),
    ("cla", "[cla][pop_roc]0150__3.wav"),
    ("flu", "[flu][nod][cla]0402__2.wav"),
    ("gac", "[gac][dru][cou_fol]0610__1.wav"),
    ("gel", "[gel][dru][pop_roc]0829__2.wav"),
    ("org", "[org][nod][jaz_blu]1225__1.wav"),
    ("pia", "[pia][nod][cla]1316__3.wav"),
    ("sax", "[sax][jaz_blu]1640__1.wav"),
    ("tru", "[tru][lat_sou]2047__2.wav"),
    ("vio", "[vio][cla]2233__1.wav"),
    ("voi", "[voi][pop_roc]2420__3.wav"),
]


def irmas_zip(path: Path, seed: int = 0) -> bytes:
    import soundfile as sf

    rng = np.random.default_rng(seed)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for inst, name in IRMAS_FILES:
            buf = io.BytesIO()
            sf.write(buf, irmas.synth_clip(inst, rng), irmas.SR, subtype="PCM_16", format="WAV")
            zf.writestr(f"{irmas.CORPUS}/{inst}/{name}", buf.getvalue())
    return path.read_bytes()


def cifar_batch(n: int, rng: np.random.Generator, label: bytes) -> bytes:
    d = {b"batch_label": label, b"labels": [int(v) for v in rng.integers(0, 10, n)],
         b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
         b"filenames": [f"img_{i:05d}.png".encode() for i in range(n)]}
    # the original batches were pickled by Python 2 and numpy 1.x, which name numpy.core
    return pickle.dumps(d, protocol=2).replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")


def cifar_tarball(path: Path, per_batch: int = 12, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    members = {f"data_batch_{i}": cifar_batch(per_batch, rng, f"training batch {i} of 5".encode())
               for i in range(1, 6)}
    members["test_batch"] = cifar_batch(per_batch, rng, b"testing batch 1 of 1")
    members["batches.meta"] = pickle.dumps({b"label_names": [b"airplane", b"automobile", b"bird", b"cat", b"deer",
                                                             b"dog", b"frog", b"horse", b"ship", b"truck"],
                                            b"num_cases_per_batch": per_batch, b"num_vis": 3072}, protocol=2)
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path.read_bytes()
