"""A real HTTP server on 127.0.0.1 for download tests: byte ranges as RFC 9110 describes them, and
faults injected one request at a time.

    with FaultServer({"/a.zip": data}) as srv:
        srv.faults += [Drop(0.4), Status(503)]     # the next two requests fail, in that order
        fetch(srv.url("/a.zip"), ...)
        srv.log                                    # [(path, Range header or None, status sent), ...]
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Drop:
    """Send the headers of a whole answer, then ``fraction`` of the file, then close the connection."""

    fraction: float


@dataclass
class Status:
    """Answer with this status and no body (e.g. 503), with ``Retry-After: retry_after``."""

    code: int
    retry_after: int | None = 0


@dataclass
class IgnoreRange:
    """Answer 200 with the whole file whatever ``Range`` asked."""


@dataclass
class Corrupt:
    """Serve the file with its bytes flipped (same length)."""


class FaultServer:
    def __init__(self, files: dict[str, bytes]):
        self.files = dict(files)
        self.faults: list = []
        self.log: list[tuple[str, str | None, int]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):  # noqa: N802 - the http.server API
                server._serve(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?", 1)[0]
        rng = h.headers.get("Range")
        with self._lock:
            fault = self.faults.pop(0) if self.faults else None
        data = self.files.get(path)
        if data is None:
            return self._send(h, path, rng, 404, b"", {})
        if isinstance(fault, Status):
            extra = {} if fault.retry_after is None else {"Retry-After": str(fault.retry_after)}
            return self._send(h, path, rng, fault.code, b"", extra)
        if isinstance(fault, Corrupt):
            data = bytes(b ^ 0xFF for b in data)
        start = 0
        m = re.fullmatch(r"bytes=(\d+)-", rng or "")
        if m and not isinstance(fault, IgnoreRange):
            start = int(m.group(1))
            if start >= len(data):
                return self._send(h, path, rng, 416, b"", {"Content-Range": f"bytes */{len(data)}"})
            body, status = data[start:], 206
            headers = {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
        else:
            body, status, headers = data, 200, {}
        cut = len(body)
        if isinstance(fault, Drop):
            cut = int(len(body) * fault.fraction)
            headers["Connection"] = "close"
        self._send(h, path, rng, status, body, headers, cut=cut)

    def _send(self, h, path, rng, status, body, headers, cut=None):
        self.log.append((path, rng, status))
        h.send_response(status)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body[: len(body) if cut is None else cut])
        h.wfile.flush()
        if cut is not None and cut < len(body):
            h.close_connection = True
            try:  # a reset mid-body, as a dropped link looks to the client
                h.connection.shutdown(2)
            except OSError:
                pass
