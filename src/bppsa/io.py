"""Crash-safe output: everything the harness writes goes to a temporary name first, then is renamed."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds.

    An interrupted or failing writer therefore never leaves a file that looks complete.  ``suffix``
    (default: the target's own) keeps libraries that dispatch on the extension (np.savez,
    matplotlib, soundfile) happy.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tail = ".tmp" + (suffix if suffix is not None else path.suffix)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=tail, dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make outputs private to the writer
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_csv(path: str | os.PathLike, df) -> None:
    """Write a pandas DataFrame atomically."""
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)
