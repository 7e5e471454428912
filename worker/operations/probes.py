"""The probe server: /metrics, /healthz and /readyz over HTTP, on threads of its own.

Thread ownership: `MetricsServer` runs `serve_forever` on "kwe-metrics-http" and one short-lived
thread per request (daemon threads, so a hung scraper cannot keep the process alive). Request
threads only read: the registry (`Metrics.render`), the liveness and the readiness checks, all
owned elsewhere and safe to call from any thread.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

from worker.errors import WorkerError
from worker.operations.health import LiveCheck, ReadyCheck, always_alive


class MetricsPortError(WorkerError):
    """The probe server cannot bind its address (a port in use, an address not on this host)."""


class Exposition(Protocol):
    """What /metrics serves: a worker's `Metrics`, or the supervisor's merge of its processes'."""

    def render(self) -> bytes: ...

    def watch_liveness(self, live: LiveCheck) -> None: ...


def readiness_body(ready: bool, detail: Mapping[str, bool] | str) -> dict[str, object]:
    """The /readyz JSON: `ready`, `reason` (one line) and, for named checks, `checks`."""
    body: dict[str, object] = {"ready": bool(ready)}
    if isinstance(detail, str):
        body["reason"] = detail or ("ready" if ready else "not ready")
        return body
    checks = {str(k): bool(v) for k, v in detail.items()}
    failing = sorted(k for k, ok in checks.items() if not ok)
    body["checks"] = checks
    if ready:
        body["reason"] = "ready"
    else:
        body["reason"] = ("not ready: " + ", ".join(failing) + " false") if failing else "not ready"
    return body


class _Server(ThreadingHTTPServer):
    # Request threads must not keep the process alive if a scraper hangs mid-request.
    daemon_threads = True

    def __init__(self, address: tuple[str, int], metrics: Exposition, ready: ReadyCheck, live: LiveCheck,
                 sock: socket.socket | None = None) -> None:
        self.metrics = metrics
        self.ready = ready
        self.live = live
        if sock is None:
            super().__init__(address, _Handler)
            return
        # A socket bound by someone else (the supervisor, for one of its processes): listen on it.
        super().__init__(address, _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.server_address = sock.getsockname()
        try:
            self.server_activate()
        except BaseException:
            self.server_close()
            raise


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # Keep-alive connections from scrapers idle between scrapes; bound how long a handler
    # thread waits on one so threads do not pile up behind dead clients.
    timeout = 30
    # Set per request: HEAD sends the headers of the GET answer without its body.
    _head = False

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._route(head=False)

    def do_HEAD(self) -> None:  # noqa: N802 (some load balancers probe with HEAD)
        self._route(head=True)

    def _route(self, head: bool) -> None:
        self._head = head
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(HTTPStatus.OK, self.server.metrics.render(), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._healthz()
        elif path == "/readyz":
            self._readyz()
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")

    def _healthz(self) -> None:
        try:
            alive, reason = self.server.live()
        except Exception as exc:  # a failing check is a failing worker, never a dropped connection
            alive, reason = False, f"liveness check failed: {type(exc).__name__}: {exc}"
        status = HTTPStatus.OK if alive else HTTPStatus.SERVICE_UNAVAILABLE
        self._send(status, reason.encode() + b"\n", "text/plain; charset=utf-8")

    def _readyz(self) -> None:
        body: dict[str, object]
        try:
            ready, detail = self.server.ready()
            body = readiness_body(ready, detail)
        except Exception as exc:  # a failing check means "not ready", never a dropped connection
            ready = False
            body = {"ready": False, "reason": f"readiness check failed: {type(exc).__name__}: {exc}"}
        status = HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE
        self._send(status, json.dumps(body, sort_keys=True).encode() + b"\n", "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not self._head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        # Probes and scrapes arrive every few seconds; access lines on stderr would drown the
        # worker's own logs.
        pass


class MetricsServer:
    """Serves /metrics, /healthz and /readyz on its own thread until `stop()`.

    `port=0` binds an ephemeral port (read it back from `.port` after `start()`); the
    setting metrics_port=0 meaning "disabled" is the caller's decision, not this class's. `sock`:
    an already bound socket to listen on instead of binding (host and port are then its own).
    """

    def __init__(self, metrics: Exposition, host: str, port: int, ready: ReadyCheck,
                 live: LiveCheck = always_alive, sock: socket.socket | None = None) -> None:
        self._metrics = metrics
        metrics.watch_liveness(live)
        self._host = host
        self._requested_port = port
        self._ready = ready
        self._live = live
        self._sock = sock
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            return self._requested_port
        return int(self._server.server_address[1])

    def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("metrics server already started")
        # Binding here, not in a background thread, so a port in use fails start() loudly.
        try:
            self._server = _Server((self._host, self._requested_port), self._metrics, self._ready, self._live,
                                   self._sock)
        except OSError as exc:
            raise MetricsPortError(f"cannot serve metrics on {self._host}:{self._requested_port}: "
                                   f"{exc.strerror or exc}") from None
        # Not a daemon: the owner must call stop(), which keeps shutdown ordering explicit.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="kwe-metrics-http")
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout_s)
        self._server = self._thread = None

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_served(pipeline: Any, metrics: Exposition, host: str, port: int, *, log: Any,
               ready: ReadyCheck | None = None, sock: socket.socket | None = None) -> int:
    """`pipeline.run()` with the probe server up around it when `port` is set (0: no server): the
    worker's and the backfill's run. Before it, the garbage collector is set for the steady state
    (worker/operations/gc_tuning.py): start-up is done once the pipeline is built. `ready`: the
    readiness check (the pipeline's own when None); `sock`: a bound socket to serve on."""
    from worker.operations.gc_tuning import settle_for_steady_state

    settle_for_steady_state()
    server = None
    if port:
        server = MetricsServer(metrics, host, port, ready or pipeline.ready, pipeline.liveness, sock)
        server.start()
        log.info("metrics served", url=f"http://{host}:{server.port}/metrics")
    try:
        return int(pipeline.run())
    finally:
        if server is not None:
            server.stop()
