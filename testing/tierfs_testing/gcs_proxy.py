"""A byte-counting HTTP proxy in front of the GCS emulator, to measure what a backup costs.

Why. What a backup costs in GCS is the bytes it moves and the requests it makes, and
neither the daemons' own counts (they say what they meant to send) nor the emulator
(it counts nothing) tell that. Put between the daemons and fake-gcs-server
(:mod:`tierfs_testing.gcs_emulator`), this sees every request as GCS would: the request
bodies (up), the response bodies (down) and the requests by method. One proxy per daemon
tells the daemons apart.

It can also hold chunk uploads back after a number of them (:meth:`GcsProxy.hold_chunk_uploads`),
so a test can kill a daemon in the middle of its uploads, at a known point, not after a sleep.

Use::

    with GcsProxy(emulator.url) as proxy:
        env = proxy.environ()        # STORAGE_EMULATOR_HOST for the daemons
        ...
        proxy.counts()               # {"up": ..., "down": ..., "requests": ..., "methods": {...}, ...}
        proxy.reset()

Threaded and buffered: each request is read whole, sent upstream on a connection of its
own, and its answer read whole before it goes back; enough for objects of a chunk's size.
"""

from __future__ import annotations

import http.client
import http.server
import os
import threading
import urllib.parse
from collections import Counter

from tierfs_testing import free_port

HOST = "127.0.0.1"
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
}
_TIMEOUT = 120.0


class GcsProxy:
    """Forwards every request on ``HOST:port`` to ``upstream`` (the emulator's URL) and counts it."""

    def __init__(self, upstream: str, port: int | None = None):
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = upstream.rstrip("/")
        self._target = (parsed.hostname or HOST, parsed.port or 80)
        self.host, self.port = HOST, port or free_port(HOST)
        self._lock = threading.Lock()
        self._up = self._down = 0
        self._methods: Counter[str] = Counter()
        self._chunk_uploads = 0
        self._chunk_upload_bytes = 0
        self._hold_after: int | None = None
        self._drop = False
        self._authorizations: list[str | None] = []  # each request's Authorization header, in order
        self.holding = threading.Event()  # set once a chunk upload is held back
        self._released = threading.Event()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """What STORAGE_EMULATOR_HOST must be set to for requests to go through the proxy."""
        return f"http://{self.host}:{self.port}"

    def environ(self) -> dict[str, str]:
        """Variables that point google-cloud-storage at the proxy, past any proxy the shell sets."""
        no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), self.host]))
        return {"STORAGE_EMULATOR_HOST": self.url, "NO_PROXY": no_proxy, "no_proxy": no_proxy}

    def counts(self) -> dict:
        """Bytes of request bodies (``up``) and response bodies (``down``), requests, and object uploads
        under chunks/."""
        with self._lock:
            return {
                "up": self._up,
                "down": self._down,
                "requests": sum(self._methods.values()),
                "methods": dict(self._methods),
                "chunk_uploads": self._chunk_uploads,
                "chunk_upload_bytes": self._chunk_upload_bytes,
            }

    def authorizations(self) -> list[str | None]:
        """The Authorization header of every request so far (None: sent without one), oldest first."""
        with self._lock:
            return list(self._authorizations)

    def reset(self) -> None:
        with self._lock:
            self._up = self._down = self._chunk_uploads = self._chunk_upload_bytes = 0
            self._methods.clear()
            self._authorizations.clear()

    def hold_chunk_uploads(self, after: int) -> None:
        """Let ``after`` more chunk uploads through, then hold every later one until :meth:`release`."""
        with self._lock:
            self._hold_after = self._chunk_uploads + after
            self._drop = False
        self._released.clear()
        self.holding.clear()

    def release(self, drop: bool = False) -> None:
        """Let held uploads go on; with ``drop``, they end unanswered and never reach the emulator,
        as the uploads of a daemon killed in the middle of them."""
        with self._lock:
            self._hold_after = None
            self._drop = drop
        self._released.set()

    # -- running ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._server is not None:
            return
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = http.server.ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"gcs-proxy-{self.port}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        server, self._server = self._server, None
        self.release()
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> GcsProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"GcsProxy({self.url} -> {self.upstream})"

    # -- what the handler calls -----------------------------------------------------------------

    def _before(self, method: str, path: str, body: bytes, authorization: str | None = None) -> None:
        """Count the request and note its Authorization header; hold it if it is a chunk upload
        past the limit (and maybe drop it then)."""
        chunk_upload = method in ("POST", "PUT") and path.startswith("/upload/") and b"/chunks/" in body[:8192]
        with self._lock:
            self._authorizations.append(authorization)
            self._methods[method] += 1
            self._up += len(body)
            if chunk_upload:
                self._chunk_uploads += 1
                self._chunk_upload_bytes += len(body)
                hold = self._hold_after is not None and self._chunk_uploads > self._hold_after
            else:
                hold = False
        if hold:
            self.holding.set()
            self._released.wait()
            if self._drop:
                raise ConnectionAbortedError("held upload dropped")

    def _after(self, body: bytes) -> None:
        with self._lock:
            self._down += len(body)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    owner: GcsProxy

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self) -> None:
        owner = self.owner
        body = self._body()
        owner._before(self.command, self.path, body, self.headers.get("Authorization"))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        conn = http.client.HTTPConnection(*owner._target, timeout=_TIMEOUT)
        try:
            conn.request(
                self.command,
                self.path,
                body=body if body or self.command in ("POST", "PUT", "PATCH") else None,
                headers=headers,
            )
            response = conn.getresponse()
            data = response.read()
            reply = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
            status, reason = response.status, response.reason
        finally:
            conn.close()
        owner._after(data)
        # Links the emulator hands out (a resumable upload's session) must lead back here.
        reply = [(k, v.replace(owner.upstream, owner.url)) if k.lower() == "location" else (k, v) for k, v in reply]
        self.send_response(status, reason)
        for k, v in reply:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _handle(self) -> None:
        try:
            self._forward()
        except (ConnectionError, OSError):
            self.close_connection = True  # the client went away (killed), or the emulator did

    # http.server dispatches to do_<METHOD>: its names, not ours.
    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle  # noqa: N815
