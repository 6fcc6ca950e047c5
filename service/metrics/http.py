"""The metrics HTTP endpoint: `/metrics` for Prometheus, `/layout.png` for people.

A small `ThreadingHTTPServer` on its own port (127.0.0.1 unless told otherwise), started
and stopped explicitly: `MetricsServer(metrics, port=9400).start()` ... `.stop()`.
`/metrics` is the registry in text format 0.0.4; `/layout.png` the newest step's picture,
rendered on first request and cached (404 before one exists, 501 without matplotlib), for
a Grafana text panel's `<img>`; `/healthz` says the endpoint is up (readiness is the gRPC
health service's).
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST
from rlfeed.service.metrics.recorder import SidecarMetrics

log = logging.getLogger(__name__)

_INDEX = (
    b"<html><body><h1>rlfeed sidecar</h1><ul>"
    b'<li><a href="/metrics">/metrics</a></li>'
    b'<li><a href="/layout.png">/layout.png</a> (newest step)</li>'
    b"</ul></body></html>"
)


def _handler_for(metrics: SidecarMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "rlfeed-metrics"

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, metrics.exposition())
            elif path == "/layout.png":
                self._layout()
            elif path == "/healthz":
                self._reply(200, "text/plain; charset=utf-8", b"ok\n")
            elif path == "/":
                self._reply(200, "text/html; charset=utf-8", _INDEX)
            else:
                self._reply(404, "text/plain; charset=utf-8", b"not found\n")

        def _layout(self) -> None:
            try:
                latest = metrics.latest_layout_png()
            except ImportError:
                body = b"matplotlib is not installed: pip install 'rlfeed[plot]'\n"
                self._reply(501, "text/plain; charset=utf-8", body)
                return
            except Exception:  # a broken picture must not take the endpoint down
                log.exception("rendering /layout.png failed")
                self._reply(500, "text/plain; charset=utf-8", b"layout rendering failed\n")
                return
            if latest is None:
                self._reply(404, "text/plain; charset=utf-8", b"no step assembled yet\n")
                return
            step, png = latest
            self._reply(200, "image/png", png, {"X-Rlfeed-Step": str(step)})

        def _reply(
            self, status: int, content_type: str, body: bytes, headers: dict | None = None
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # scrapes would flood stderr
            log.debug("%s - %s", self.address_string(), format % args)

    return Handler


class MetricsServer:
    """Serves one SidecarMetrics over HTTP on (host, port); port 0 picks a free one."""

    def __init__(self, metrics: SidecarMetrics, *, host: str = "127.0.0.1", port: int = 0):
        self.metrics = metrics
        self.host = host
        self.requested_port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        if self._server is not None:
            raise RuntimeError("MetricsServer already started")
        server = ThreadingHTTPServer((self.host, self.requested_port), _handler_for(self.metrics))
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="rlfeed-metrics-http", daemon=True
        )
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("MetricsServer not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket; safe to call twice."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> MetricsServer:
        return self.start() if self._server is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
