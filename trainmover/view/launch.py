"""Starting the operator view beside a job: checks done before the job launches (the optional
packages are there, the port is free), then the server once the controller is up."""
from __future__ import annotations

import errno
import os
import socket
import sys
import threading

from trainmover.core.config import DashboardConfig

EXTRA_HINT = "pip install 'trainmover[dashboard]' (starlette, uvicorn, prometheus-client)"


def check_dashboard(cfg: DashboardConfig) -> None:
    """Raise ValueError, naming the problem, if the dashboard asked for cannot start: before
    anything is launched."""
    if cfg.port is None:
        return
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--dashboard needs packages that are not installed ({exc.name}): "
                         f"{EXTRA_HINT}") from None
    if cfg.port == 0:
        return
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((cfg.host, cfg.port))
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else str(exc)
            raise ValueError(f"--dashboard {cfg.port}: cannot listen on {cfg.host}:{cfg.port} "
                             f"({why})") from None


def announce(board, run_dir: str) -> str:
    """The line that tells the operator where the dashboard is: the sign-in link on a
    terminal; elsewhere (CI logs, files) only where to find it, since the link is a
    credential."""
    if sys.stdout.isatty():
        return f"dashboard: {board.login_url}"
    return (f"dashboard: {board.url} (sign-in link in "
            f"{os.path.join(run_dir, 'dashboard.json')})")


def serve_when_started(started: threading.Event, run_dir: str, cfg: DashboardConfig,
                       say=print) -> list:
    """Start the dashboard once ``started`` is set (the controller is up: the run dir, its
    secret and the store exist), from a daemon thread. Returns a list that will hold the
    ``Dashboard``."""
    holder: list = []
    if cfg.port is None:
        return holder

    def target():
        started.wait()
        if not os.path.exists(os.path.join(run_dir, "control.json")):
            return   # the job failed before it ran
        try:
            from trainmover.view.server import start_dashboard
            holder.append(start_dashboard(run_dir, cfg))
        except Exception as exc:  # noqa: BLE001 - the job goes on without its dashboard
            say(f"trainmover: dashboard not started: {exc}")
            return
        say(f"trainmover: {announce(holder[0], run_dir)}")

    threading.Thread(target=target, daemon=True, name="dashboard-start").start()
    return holder
