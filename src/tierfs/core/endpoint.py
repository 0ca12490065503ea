"""An HTTP endpoint for Prometheus and operators: ``/metrics`` and a few plain pages.

A daemon and the CSI plugin each serve one. It runs in threads of its own (wsgiref's
threading server, as prometheus_client's own ``start_http_server``), so a slow scraper
never holds up FUSE requests or CSI calls, and belongs to whoever made it: :meth:`close`
stops its threads and frees the port. The exposition itself (formats, gzip, OpenMetrics
negotiation) is prometheus_client's.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from tierfs.core.errors import UserError

log = logging.getLogger(__name__)

# A page: (HTTP status, JSON-able body), made on each request.
Page = Callable[[], tuple[int, object]]


class _Quiet(WSGIRequestHandler):
    timeout = 10  # seconds: a scraper that stops reading lets its thread go

    # One line per scrape would bury the log. (``format``: the name wsgiref's signature gives it.)
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


class _Server(ThreadingWSGIServer):
    # A successor binds the port while its predecessor still serves it (a daemon's upgrade,
    # the plugin's rolling update beside the old pod): both answer until the old one goes.
    # Only sockets of the same user that ask for it share a port; anything else still collides.
    allow_reuse_port = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class Endpoint:
    """``/metrics`` from ``registry``, and ``pages`` (path -> :data:`Page`) as JSON."""

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        pages: dict[str, Page] | None = None,
        what: str = "--metrics",
    ):
        metrics: WSGIApplication = make_wsgi_app(registry)  # typed by prometheus_client as a bare Callable
        self.pages = dict(pages or {})

        def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
            path = environ.get("PATH_INFO") or "/"
            if path in self.pages:
                return self._page(path, start_response)
            if path not in ("/", "/metrics"):
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"not found: /metrics" + b"".join(f", {p}".encode() for p in self.pages) + b"\n"]
            try:
                return metrics(environ, start_response)
            except Exception as e:  # noqa: BLE001 (a daemon on its way out, say: a failed scrape, not a traceback)
                log.debug("metrics not served: %s", e)
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [f"metrics unavailable: {e}\n".encode()]

        host, port = address
        try:
            self.server = make_server(
                host, port, app, server_class=_Server6 if ":" in host else _Server, handler_class=_Quiet
            )
        except OSError as e:
            raise UserError(
                f"cannot serve metrics on {host}:{port} ({e.strerror or e}): pick a free {what} address"
            ) from None
        self.address = (host, self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, name="metrics-endpoint", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    def _page(self, path: str, start_response: StartResponse) -> list[bytes]:
        try:
            code, body = self.pages[path]()
        except Exception as e:  # noqa: BLE001 (a page must not take the endpoint down; say why instead)
            log.warning("%s failed: %s", path, e)
            code, body = 500, {"error": str(e)}
        start_response(f"{code} {'OK' if code == 200 else 'Error'}", [("Content-Type", "application/json")])
        return [json.dumps(body, indent=1).encode() + b"\n"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()
