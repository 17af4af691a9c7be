"""The live dashboard and the Prometheus endpoint, served from the controller's process (or
``trainmover dashboard`` beside any job) by Starlette on uvicorn in a background thread.

What it reads: the run dir's logs (``runlog.py``) and the job's status through its store
(``control/status.py``), at most every ``dashboard.refresh_s`` however many pages poll, so
its cost does not grow with viewers; nothing on the training path. What it does: a page's
migration or drain request goes into the job's store as ``trainmover migrate`` and
``trainmover drain`` do (``control/client.py``, ``control/maintenance.py``), signed with the
job's secret: the controller treats it like any other.

Access. Loopback by default. Every route but the static files needs the dashboard token, an
HMAC of the job's secret (only those who can read the run dir's secret can compute it): as
``?token=`` on the sign-in link (which sets a SameSite=Strict, HttpOnly cookie) or as
``Authorization: Bearer`` (Prometheus ``authorization.credentials_file``). A state-changing
request must also carry the ``X-Trainmover`` header, which another site's page cannot add
without a CORS preflight that this server never grants.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import threading
import time
from collections import deque
from dataclasses import asdict

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from trainmover.control import client, maintenance
from trainmover.control.status import read_status
from trainmover.control.status_file import JobStatus, fresh_limit_s, read_status_file
from trainmover.core.accounting import downtime_phrase
from trainmover.core.auth import load_secret
from trainmover.core.config import DashboardConfig
from trainmover.view import metrics
from trainmover.view.runlog import RunLog

STATIC = os.path.join(os.path.dirname(__file__), "static")
COOKIE = "trainmover_dashboard"
INFO_FILE = "dashboard.json"      # in the run dir: where the dashboard listens (mode 0600)
# how long a page's migration request may wait for its answer inside the server: the page
# polls the job's state afterwards anyway
ASK_TIMEOUT_S = 600.0
REQUESTS_KEPT = 50
START_TIMEOUT_S = 10.0     # uvicorn's start in its thread: a bound socket, no imports left
MAX_BODY_BYTES = 65536     # an action's JSON body (workers, host): a few hundred bytes


def dashboard_token(secret: bytes) -> str:
    return hmac.new(secret, b"trainmover dashboard v1", hashlib.sha256).hexdigest()


class View:
    """The data the page and ``/metrics`` show, re-read at most every ``refresh_s``."""

    def __init__(self, run_dir: str, cfg: DashboardConfig):
        self.run_dir, self.cfg = run_dir, cfg
        self.log = RunLog(run_dir)
        self.status: JobStatus | None = None
        self.status_error: str | None = None
        self.perf: dict[str, deque] = {}       # worker -> (last step, step_s, compute_s)
        self.requests: deque = deque(maxlen=REQUESTS_KEPT)   # asked from the page
        self._store = None
        self._fresh_s = fresh_limit_s(run_dir) if os.path.exists(
            os.path.join(run_dir, "job.json")) else 0.0
        self._read_at = 0.0
        self._lock = threading.Lock()

    def state(self) -> tuple[RunLog, JobStatus | None]:
        with self._lock:
            if time.monotonic() - self._read_at >= self.cfg.refresh_s:
                self._read_at = time.monotonic()
                self.log.refresh()
                self._read_status()
            return self.log, self.status

    def _read_status(self) -> None:
        if self.log.ended is not None:
            self.status, self.status_error = None, "the job has ended"
            return
        try:
            self.status = read_status_file(self.run_dir, self._fresh_s)
            if self.status is None:    # the controller is down: the store still answers
                self._store = self._store or client.connect(self.run_dir)
                self.status = read_status(self.run_dir, self._store)
            self.status_error = None
        except Exception as exc:  # noqa: BLE001 - shown on the page; the job goes on
            self.status, self.status_error, self._store = None, str(exc), None
            return
        for w in self.status.workers:
            if w.perf:
                rows = self.perf.setdefault(w.name, deque(maxlen=self.cfg.history))
                if not rows or rows[-1][0] != w.perf["last_step"]:
                    rows.append((w.perf["last_step"], w.perf["step_s"], w.perf["compute_s"]))

    def page_state(self) -> dict:
        """Everything the page draws, as JSON."""
        log, status = self.state()
        t0 = float(log.started["time"]) if log.started else \
            (log.series.points[0].time if log.series.points else time.time())
        return {
            "name": os.path.basename(os.path.normpath(self.run_dir)),
            "started": log.started, "ended": log.ended, "t0": t0, "now": time.time(),
            "refresh_s": self.cfg.refresh_s,
            "status": asdict(status) if status is not None else None,
            "status_error": self.status_error,
            "series": [[p.time - t0, p.step, p.loss, p.tokens_per_s, p.step_time_s]
                       for p in log.series.points],
            "interruptions": [{
                "title": i.title, "what": i.what, "id": i.id, "kind": i.kind,
                "status": i.status, "t": i.time - t0, "step": i.step,
                "downtime_s": i.downtime_s, "workers": i.workers,
                "downtime_noise_s": i.record.get("downtime_noise_s"),
                # as every other place reads it (core/accounting.py): the page shows this
                "downtime_text": downtime_phrase(i.downtime_s,
                                                 i.record.get("downtime_noise_s")),
                "phases": [asdict(p) for p in i.phases],
                "reason": i.record.get("reason")} for i in log.interruptions],
            "stragglers": log.stragglers[-20:],
            "events": [{**e, "t": float(e.get("time", t0)) - t0} for e in list(log.recent)[-60:]],
            "perf": {w: list(rows) for w, rows in self.perf.items()},
            "requests": list(self.requests),
        }

    def ask_migration(self, workers: list[str], to: list[str] | None) -> dict:
        record = {"time": time.time(), "what": "migrate", "workers": workers, "to": to,
                  "status": "asked"}
        self.requests.append(record)
        try:
            result = client.request_migration(self.run_dir, workers, to, wait=True,
                                              timeout_s=ASK_TIMEOUT_S, source="dashboard")
        except Exception as exc:  # noqa: BLE001 - shown on the page
            result = {"status": "failed", "reason": str(exc)}
        record.update(status=result.get("status"), reason=result.get("reason"))
        return result

    def ask_drain(self, workers: list[str], host: int | None) -> dict:
        record = {"time": time.time(), "what": "drain", "workers": workers, "host": host,
                  "status": "asked"}
        self.requests.append(record)
        try:
            result = maintenance.drain(self.run_dir, workers, host, timeout_s=ASK_TIMEOUT_S,
                                       say=lambda line: None)
        except Exception as exc:  # noqa: BLE001 - shown on the page
            result = {"status": "failed", "reason": str(exc)}
        record.update(status=result.get("status"), reason=result.get("reason"),
                      moved=result.get("moved"))
        return result


def make_app(view: View, token: str) -> Starlette:
    def authorized(request: Request) -> bool:
        given = request.cookies.get(COOKIE, "")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return hmac.compare_digest(given.encode(), token.encode())

    def denied() -> Response:
        return JSONResponse({"error": "open the sign-in link (trainmover dashboard --run-dir "
                                      "DIR prints it) or send Authorization: Bearer <token>"},
                            status_code=401)

    async def index(request: Request) -> Response:
        if "token" in request.query_params:
            if not hmac.compare_digest(request.query_params["token"].encode(), token.encode()):
                return denied()
            response = RedirectResponse("/", status_code=303)
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
            return response
        if not authorized(request):
            return denied()
        return FileResponse(os.path.join(STATIC, "index.html"))

    async def api_state(request: Request) -> Response:
        if not authorized(request):
            return denied()
        from starlette.concurrency import run_in_threadpool
        return JSONResponse(await run_in_threadpool(view.page_state))

    async def metrics_endpoint(request: Request) -> Response:
        if not authorized(request):
            return denied()
        from starlette.concurrency import run_in_threadpool
        body = await run_in_threadpool(metrics.render, view.state)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def refused(request: Request) -> Response | None:
        """Why a request that acts is refused, decided before its body is read (so nobody
        without the token makes the server read anything, and nobody sends it megabytes)."""
        if not authorized(request):
            return denied()
        if request.headers.get("x-trainmover") != "1":
            return JSONResponse({"error": "missing X-Trainmover header"}, status_code=403)
        length = request.headers.get("content-length", "")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            return JSONResponse({"error": f"a JSON body of at most {MAX_BODY_BYTES} bytes, "
                                          f"with its Content-Length, is expected"},
                                status_code=413)
        return None

    async def act(request: Request, fn) -> Response:
        why = refused(request)
        if why is not None:
            return why
        try:
            body = await request.json()
            workers = [str(w) for w in body.get("workers") or []]
        except (ValueError, AttributeError, TypeError):
            return JSONResponse({"error": "expected a JSON object"}, status_code=400)
        # the request waits for its answer in a thread of its own: the page is not kept
        # waiting, and the job's state shows the migration's progress meanwhile
        threading.Thread(target=fn, args=(body, workers), daemon=True,
                         name="dashboard-request").start()
        return JSONResponse({"status": "asked", "workers": workers})

    def _migrate(body, workers):
        view.ask_migration(workers, body.get("to") or None)

    def _drain(body, workers):
        host = body.get("host")
        view.ask_drain(workers, None if host in (None, "") else int(host))

    async def api_migrate(request: Request) -> Response:
        return await act(request, _migrate)

    async def api_drain(request: Request) -> Response:
        why = refused(request)
        if why is not None:
            return why
        try:
            host = (await request.json()).get("host") if request.headers.get(
                "content-type", "").startswith("application/json") else None
        except (ValueError, AttributeError, TypeError):
            return JSONResponse({"error": "expected a JSON object"}, status_code=400)
        if host not in (None, "") and not str(host).isdigit():
            return JSONResponse({"error": f"host {host!r} is not a host index"},
                                status_code=400)
        return await act(request, _drain)

    return Starlette(routes=[
        Route("/", index),
        Route("/api/state", api_state),
        Route("/api/migrate", api_migrate, methods=["POST"]),
        Route("/api/drain", api_drain, methods=["POST"]),
        Route("/metrics", metrics_endpoint),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ])


class Dashboard:
    """A running dashboard server (``start_dashboard``)."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, url: str,
                 token: str, view: View):
        self.server, self.thread, self.url, self.token, self.view = \
            server, thread, url, token, view

    @property
    def login_url(self) -> str:
        return f"{self.url}?token={self.token}"

    def stop(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


def start_dashboard(run_dir: str, cfg: DashboardConfig) -> Dashboard:
    """Serve the job in ``run_dir`` on ``cfg.host:cfg.port`` (0: any free port) from a
    daemon thread; writes ``<run dir>/dashboard.json`` (mode 0600) with the sign-in link."""
    token = dashboard_token(load_secret(run_dir))
    view = View(run_dir, cfg)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port or 0))
    except OSError as exc:
        sock.close()
        raise ValueError(f"dashboard: cannot listen on {cfg.host}:{cfg.port}: {exc}") from exc
    sock.listen(64)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(view, token), log_level="warning",
                                           access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="dashboard")
    thread.start()
    host = f"[{cfg.host}]" if family == socket.AF_INET6 else cfg.host
    board = Dashboard(server, thread, f"http://{host}:{port}/", token, view)
    path = os.path.join(run_dir, INFO_FILE)
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": board.url, "login_url": board.login_url, "pid": os.getpid()}, f)
    os.replace(path + ".tmp", path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        board.stop()
        raise ValueError(f"dashboard: the server on {board.url} did not start within "
                         f"{START_TIMEOUT_S} s")
    return board
