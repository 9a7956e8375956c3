"""The dashboard's HTTP server: the page, plotly.js, and JSON the page polls.

The standard library's `ThreadingHTTPServer` is enough here: a handful of read-only GET
routes for one person's browser on 127.0.0.1, no templating, no extra dependency in the
agent image. Each request re-reads only what the run directories gained since the last
one (`RunReader`), so polling a live run every two seconds stays cheap.

    GET /                        the page
    GET /static/plotly.min.js    plotly.js as bundled with the installed plotly package
    GET /static/dashboard.js     the page's script
    GET /api/runs                one line per run under the root: status, step, MTTR
    GET /api/runs/<name>         data.build_view of that run
    GET /api/trainjobs           the cluster's TrainJobs (when a kubeconfig was given)
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from keepstep.dashboard.data import build_view
from keepstep.dashboard.reader import RunReader, find_runs
from keepstep.dashboard.trainjobs import TrainJobsError, TrainJobSource, trainjob_rows

KUBE_TIMEOUT_S = 5.0
_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
}


def _plotly_js() -> bytes:
    from plotly.offline import get_plotlyjs

    return str(get_plotlyjs()).encode()


class DashboardApp:
    """What the routes answer; kept apart from HTTP so tests can call it directly."""

    def __init__(
        self,
        root: Path,
        trainjobs: TrainJobSource | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.trainjobs = trainjobs
        self.clock = clock
        self._readers: dict[str, RunReader] = {}
        self._lock = threading.Lock()
        self._plotly: bytes | None = None

    def _reader(self, name: str) -> RunReader | None:
        runs = find_runs(self.root)
        with self._lock:
            if name not in runs:
                return None
            reader = self._readers.get(name)
            if reader is None or reader.run_dir != runs[name]:
                reader = self._readers[name] = RunReader(runs[name])
            return reader

    def runs(self) -> list[dict[str, Any]]:
        out = []
        for name in find_runs(self.root):
            view = self.run(name)
            if view is None:
                continue
            out.append(
                {
                    k: view[k]
                    for k in ("run", "status", "step", "steps_total", "world_size", "mttr_p50_s")
                }
                | {"recoveries": len(view["recoveries"]), "goodput": view["goodput"]["fraction"]}
            )
        return out

    def run(self, name: str) -> dict[str, Any] | None:
        reader = self._reader(name)
        return None if reader is None else build_view(reader.poll(), self.clock())

    def cluster(self) -> dict[str, Any]:
        if self.trainjobs is None:
            return {"enabled": False, "items": [], "error": None}
        try:
            return {
                "enabled": True,
                "items": trainjob_rows(self.trainjobs.list(KUBE_TIMEOUT_S)),
                "error": None,
            }
        except TrainJobsError as error:
            return {"enabled": True, "items": [], "error": str(error)}

    def static(self, path: str) -> tuple[bytes, str] | None:
        if path == "/static/plotly.min.js":
            if self._plotly is None:
                self._plotly = _plotly_js()
            return self._plotly, "text/javascript; charset=utf-8"
        entry = _STATIC.get(path)
        if entry is None:
            return None
        name, ctype = entry
        return resources.files(__package__).joinpath("static", name).read_bytes(), ctype


class _Handler(BaseHTTPRequestHandler):
    app: DashboardApp  # set on the subclass `serve` makes

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if path == "/api/runs":
            return self._json(self.app.runs())
        if path.startswith("/api/runs/"):
            view = self.app.run(unquote(path[len("/api/runs/") :]))
            if view is None:
                return self._send(HTTPStatus.NOT_FOUND, b"no such run\n", "text/plain")
            return self._json(view)
        if path == "/api/trainjobs":
            return self._json(self.app.cluster())
        if path == "/favicon.ico":
            return self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
        static = self.app.static(path)
        if static is None:
            return self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
        self._send(HTTPStatus.OK, *static)

    def _json(self, value: Any) -> None:
        self._send(HTTPStatus.OK, json.dumps(value).encode(), "application/json")

    def _send(self, code: HTTPStatus, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # polling every two seconds would flood the terminal


class DashboardServer:
    """The app served on a thread; `url` is where to point a browser."""

    def __init__(self, app: DashboardApp, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = type("Handler", (_Handler,), {"app": app})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="keepstep-dashboard", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> DashboardServer:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
