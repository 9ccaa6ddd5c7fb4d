"""Downloads that survive the network: resumed, retried, locked and checksum-verified.

``fetch(url, dest, md5)`` keeps the bytes received so far in ``<dest>.part`` and renames it to
``dest`` only once its MD5 matches.  On a connection error, a timeout, a body cut short, or a
408/425/429/5xx answer it waits (exponential backoff, or the server's ``Retry-After``) and resumes
from the bytes already on disk with an HTTP ``Range`` request.  A ``416`` to that request means the
part is already complete: it is verified and finished.  A server that ignores ``Range`` (``200``
instead of ``206``) is read from the start again.  A wrong MD5 removes the part and says so.  Two
processes fetching the same file take turns through a lock file beside it.

The standard library does this in one loop; pooch and urllib3's ``Retry`` retry a request but
start a broken body over, which for a 3 GB archive on a flaky link never finishes.
"""
from __future__ import annotations

import email.utils
import fcntl
import hashlib
import http.client
import os
import random
import re
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
CHUNK = 1 << 20
MAX_WAIT_S = 120.0


class DownloadError(RuntimeError):
    pass


class _Retry(Exception):
    """A failure worth another attempt; ``wait`` overrides the backoff (seconds) when the server asked."""

    def __init__(self, reason: str, wait: float | None = None):
        super().__init__(reason)
        self.wait = wait


def md5sum(path: str | Path, chunk: int = CHUNK) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextmanager
def _locked(path: Path):
    """An exclusive advisory lock on ``path`` (created if needed), held for the ``with`` block."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time()) if when else None


def _content_range(value: str | None) -> tuple[int, int | None] | None:
    """``bytes a-b/total`` -> (a, total or None)."""
    m = re.fullmatch(r"\s*bytes\s+(\d+)-\d+/(\d+|\*)\s*", value or "")
    if not m:
        return None
    return int(m.group(1)), None if m.group(2) == "*" else int(m.group(2))


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _finish(part: Path, dest: Path, url: str, md5: str, log) -> Path:
    got = md5sum(part)
    if got != md5:
        part.unlink()
        raise DownloadError(f"{url}: the downloaded file's MD5 {got} is not the expected {md5}; "
                            f"the bad file {part} was removed (check the url and md5 in the configuration)")
    os.replace(part, dest)
    log(f"{dest}: MD5 {md5} verified")
    return dest


def _attempt(url: str, part: Path, timeout: float, progress: bool, desc: str) -> bool:
    """One request, appending to ``part``.  True when the body arrived whole, False when the server
    says the range is past the end (416: the part is complete); ``_Retry`` for transient failures."""
    have = _size(part)
    req = urllib.request.Request(url, headers={"Range": f"bytes={have}-", "Accept-Encoding": "identity"}
                                 if have else {"Accept-Encoding": "identity"})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:
            return False
        if exc.code in RETRY_STATUS:
            raise _Retry(f"HTTP {exc.code} {exc.reason}", _retry_after(exc.headers.get("Retry-After"))) from exc
        raise DownloadError(f"downloading {url} failed: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _Retry(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}") from exc
    with resp:
        status = resp.status
        length = resp.length  # None for chunked answers and file:// URLs
        start = 0
        total = None
        if have and status == 206:
            cr = _content_range(resp.headers.get("Content-Range"))
            start, total = cr if cr else (have, None)
            if start != have:  # a range we did not ask for: keep nothing we cannot place
                start = 0
        if total is None and length is not None:
            total = start + length
        if have and start != have:
            have = 0
        received = 0
        try:
            with open(part, "r+b" if have else "wb") as f, tqdm(
                total=total, initial=have, unit="B", unit_scale=True, desc=desc, disable=not progress,
                file=sys.stderr, mininterval=1.0,
            ) as bar:
                f.seek(have)
                f.truncate()
                while block := resp.read(CHUNK):
                    f.write(block)
                    received += len(block)
                    bar.update(len(block))
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(f"the connection broke after {have + received} bytes ({type(exc).__name__}: {exc})") from exc
    if length is not None and received < length:
        raise _Retry(f"the body ended after {have + received} of {have + length} bytes")
    return True


def fetch(url: str, dest: str | Path, md5: str, *, retries: int = 8, backoff: float = 2.0,
          timeout: float = 60.0, progress: bool = True, log=None) -> Path:
    """Download ``url`` to ``dest`` and verify its MD5; return ``dest``.

    ``retries`` further attempts follow a transient failure, the k-th after ``backoff * 2**k``
    seconds (with jitter, at most 2 minutes) or the server's ``Retry-After``.  Every attempt resumes
    from ``<dest>.part``.  A file already at ``dest`` is kept if its MD5 matches and replaced if not."""
    dest = Path(dest)
    log = log or (lambda msg: print(msg, file=sys.stderr))
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    with _locked(dest.with_name(dest.name + ".lock")):
        if dest.exists():
            if md5sum(dest) == md5:
                return dest
            log(f"{dest}: its MD5 is not {md5}; downloading it again from {url}")
            dest.unlink()
        for attempt in range(retries + 1):
            try:
                if not _attempt(url, part, timeout, progress, dest.name):
                    log(f"{url}: the server has no bytes past the {part.stat().st_size} on disk (HTTP 416); "
                        "verifying the part as complete")
                    if md5sum(part) != md5:  # not the file we want after all: start it over
                        part.unlink()
                        raise _Retry("the part on disk was complete but its MD5 did not match; starting over", 0.0)
                return _finish(part, dest, url, md5, log)
            except _Retry as exc:
                if attempt == retries:
                    raise DownloadError(f"downloading {url} failed after {retries + 1} attempts (last: {exc}); "
                                        f"the {_size(part)} bytes in {part} "
                                        "are kept, so the next run resumes") from exc
                wait = exc.wait if exc.wait is not None else backoff * 2**attempt * random.uniform(0.75, 1.25)
                wait = min(wait, MAX_WAIT_S)
                log(f"{url}: {exc}; attempt {attempt + 2} of {retries + 1} in {wait:.1f} s, resuming from "
                    f"{_size(part)} bytes")
                time.sleep(wait)
    raise AssertionError("unreachable")
