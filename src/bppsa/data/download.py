"""Resumable, checksum-verified downloads.  A partial download lives in ``<file>.part`` (resumed with
an HTTP Range request); only a file whose MD5 matches is renamed to its final name."""
from __future__ import annotations

import hashlib
import urllib.request
from pathlib import Path

from tqdm import tqdm


class DownloadError(RuntimeError):
    pass


def md5sum(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fetch(url: str, dest: str | Path, md5: str, timeout: float = 60.0) -> Path:
    """Download ``url`` to ``dest`` (resuming ``dest.part``) and verify its MD5; return ``dest``."""
    dest = Path(dest)
    if dest.exists():
        if md5sum(dest) == md5:
            return dest
        raise DownloadError(f"{dest} exists but its MD5 is not {md5}; delete it to download again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if have and resp.status != 206:  # server ignored the range: start over
                have = 0
            length = getattr(resp, "length", None)  # file:// responses have none
            total = length + have if length is not None else None
            with open(part, "ab" if have else "wb") as f, tqdm(
                total=total, initial=have, unit="B", unit_scale=True, desc=dest.name
            ) as bar:
                while block := resp.read(1 << 20):
                    f.write(block)
                    bar.update(len(block))
    except OSError as exc:  # URLError, HTTPError, timeouts, connection resets
        raise DownloadError(f"downloading {url} failed ({exc}); the partial file {part} is kept for resuming") from exc
    got = md5sum(part)
    if got != md5:
        part.unlink()
        raise DownloadError(f"{url}: MD5 {got} does not match the expected {md5}; the download was removed")
    part.rename(dest)
    return dest
