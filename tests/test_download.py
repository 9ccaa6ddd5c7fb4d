"""`fetch` against a real HTTP server on 127.0.0.1 with injected faults (tests/fault_server.py)."""
import hashlib
import re
import threading

import pytest
from fault_server import Corrupt, Drop, FaultServer, IgnoreRange, Status

from bppsa.data.download import DownloadError, fetch

DATA = bytes(range(256)) * 1200  # 307,200 bytes
MD5 = hashlib.md5(DATA).hexdigest()


@pytest.fixture
def server():
    with FaultServer({"/f.bin": DATA}) as srv:
        yield srv


def _fetch(srv, dest, **kw):
    return fetch(srv.url("/f.bin"), dest, kw.pop("md5", MD5), backoff=0.01, **kw)


def test_plain_download_shows_the_total(server, tmp_path, capsys):
    out = _fetch(server, tmp_path / "f.bin")
    assert out.read_bytes() == DATA and not (tmp_path / "f.bin.part").exists()
    assert server.log == [("/f.bin", None, 200)]
    assert "/307k" in capsys.readouterr().err


def test_dropped_connection_then_503_resume_in_one_call(server, tmp_path, capsys):
    server.faults += [Drop(0.4), Status(503)]
    out = _fetch(server, tmp_path / "f.bin")
    assert out.read_bytes() == DATA
    cut = int(len(DATA) * 0.4)
    assert server.log == [("/f.bin", None, 200), ("/f.bin", f"bytes={cut}-", 503), ("/f.bin", f"bytes={cut}-", 206)]
    err = capsys.readouterr().err
    assert "HTTP 503" in err and f"resuming from {cut} bytes" in err
    bars = [line for line in re.split(r"[\r\n]", err) if line.startswith("f.bin:")]
    assert len(bars) >= 2 and all("/307k" in b for b in bars)  # the resumed bar shows the whole size too


def test_complete_part_left_behind_is_finished_on_416(server, tmp_path):
    (tmp_path / "f.bin.part").write_bytes(DATA)
    out = _fetch(server, tmp_path / "f.bin")
    assert out.read_bytes() == DATA
    assert server.log == [("/f.bin", f"bytes={len(DATA)}-", 416)]


def test_complete_part_with_wrong_bytes_starts_over(server, tmp_path):
    (tmp_path / "f.bin.part").write_bytes(b"x" * len(DATA))
    out = _fetch(server, tmp_path / "f.bin")
    assert out.read_bytes() == DATA
    assert server.log == [("/f.bin", f"bytes={len(DATA)}-", 416), ("/f.bin", None, 200)]


def test_server_that_ignores_range_is_read_from_the_start(server, tmp_path):
    (tmp_path / "f.bin.part").write_bytes(DATA[:1000])
    server.faults.append(IgnoreRange())
    out = _fetch(server, tmp_path / "f.bin")
    assert out.read_bytes() == DATA  # not the first 1000 bytes twice
    assert server.log == [("/f.bin", "bytes=1000-", 200)]


def test_wrong_bytes_are_removed_and_named(server, tmp_path):
    server.faults.append(Corrupt())
    with pytest.raises(DownloadError, match=f"MD5 .* is not the expected {MD5}.*removed"):
        _fetch(server, tmp_path / "f.bin")
    assert not (tmp_path / "f.bin").exists() and not (tmp_path / "f.bin.part").exists()
    assert _fetch(server, tmp_path / "f.bin").read_bytes() == DATA  # the next run starts clean


def test_retries_run_out_and_keep_the_part(server, tmp_path):
    server.faults += [Drop(0.5)] + [Status(503)] * 3
    with pytest.raises(DownloadError, match="failed after 3 attempts.*HTTP 503.*next run resumes"):
        _fetch(server, tmp_path / "f.bin", retries=2)
    assert (tmp_path / "f.bin.part").stat().st_size == len(DATA) // 2
    assert _fetch(server, tmp_path / "f.bin").read_bytes() == DATA
    assert server.log[-1] == ("/f.bin", f"bytes={len(DATA) // 2}-", 206)


def test_not_found_is_not_retried(server, tmp_path):
    with pytest.raises(DownloadError, match="HTTP 404"):
        fetch(server.url("/missing.bin"), tmp_path / "m.bin", MD5, backoff=0.01)
    assert len(server.log) == 1


def test_unreachable_host_is_retried_then_named(tmp_path):
    with FaultServer({}) as srv:
        url = srv.url("/f.bin")
    with pytest.raises(DownloadError, match=r"127\.0\.0\.1.*failed after 2 attempts"):
        fetch(url, tmp_path / "f.bin", MD5, backoff=0.01, retries=1, timeout=2)


def test_existing_file_with_the_wrong_md5_is_downloaded_again(server, tmp_path):
    (tmp_path / "f.bin").write_bytes(b"old mirror's file")
    assert _fetch(server, tmp_path / "f.bin").read_bytes() == DATA
    assert _fetch(server, tmp_path / "f.bin").read_bytes() == DATA and len(server.log) == 1  # then it is kept


def test_two_fetches_of_one_file_take_turns(server, tmp_path):
    server.faults.append(Drop(0.3))
    errors, outs = [], []

    def run():
        try:
            outs.append(_fetch(server, tmp_path / "f.bin", progress=False).read_bytes())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and outs == [DATA] * 3
    assert len(server.log) == 2  # one download (and its resume); the others found the verified file
