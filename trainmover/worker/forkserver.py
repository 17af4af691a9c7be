"""The fork server: a process that imports what every worker imports once, then forks
workers on the agent's requests (why, and the protocol: ``agent/forkserver.py``).

It runs worker code (each fork becomes ``worker/main.py``), so it lives with the worker.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

from trainmover.core.protocol import AGENT_CHANNEL_ENV
from trainmover.core.proc import (FORK_MESSAGE_MAX, PR_SET_NAME, PR_SET_PDEATHSIG,
                                  prctl)

# How long a forked worker waits to be re-parented to the agent (the middle process exits
# right after the fork: microseconds, unless the machine is overloaded).
REPARENT_WAIT_S = 10.0


def _run_worker(request: dict, log_fd: int, channel_fd: int | None, go_fd: int,
                agent_pid: int, sock) -> None:
    """In the forked worker: wait to be the agent's, then become the worker. Never returns."""
    code = 1
    try:
        t_start = time.perf_counter()
        sock.close()
        deadline = time.monotonic() + REPARENT_WAIT_S
        while os.getppid() != agent_pid:
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(0.0005)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != agent_pid:       # the agent died before the signal was set
            os._exit(1)
        if os.read(go_fd, 1) != b"g":       # the agent gave up on this spawn
            os._exit(1)
        os.close(go_fd)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.environ.clear()
        os.environ.update(request["env"])
        if channel_fd is not None:     # its channel to the agent, at its number here
            os.environ[AGENT_CHANNEL_ENV] = str(channel_fd)
        prctl(PR_SET_NAME, f"tm-{request['name']}"[:15].encode())
        # the dispositions a worker started anew has (``python`` itself ignores SIGPIPE):
        # with SIGPIPE at its default, a gloo write to a peer that just died killed this
        # worker (exit -13) instead of failing the collective, and a replica's crash then
        # took the role's last copy with it. SIGINT stays as the server had it from its own
        # start: as the agent's launcher left it (ignored under nohup), as a new process's
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        import tempfile

        tempfile.tempdir = None              # TMPDIR is this worker's (agent._env)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()   # as a fresh process: from the OS
        sys.argv = ["trainmover.worker", *request["args"]]
        from trainmover.worker.main import main

        code = main(request["args"], t_start=t_start)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:                    # noqa: BLE001 - reported in the worker's log
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _fork_worker(request: dict, log_fd: int, channel_fd: int | None, agent_pid: int,
                 sock) -> tuple[int, int]:
    """Fork twice (the worker is re-parented to the agent): (the worker's PID, the write end
    of its go pipe)."""
    go_r, go_w = os.pipe()
    pid_r, pid_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(go_w)
            os.close(pid_r)
            worker = os.fork()
            if worker == 0:
                os.close(pid_w)
                _run_worker(request, log_fd, channel_fd, go_r, agent_pid, sock)
            os.write(pid_w, str(worker).encode())
        finally:
            os._exit(0)
    os.close(go_r)
    os.close(pid_w)
    os.waitpid(middle, 0)
    with os.fdopen(pid_r, "rb") as f:
        raw = f.read(32)
    if not raw:
        os.close(go_w)
        raise OSError("the fork failed")
    return int(raw), go_w


def serve(fd: int, agent_pid: int) -> int:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != agent_pid:
        return 1
    sock = socket.socket(fileno=fd)
    t0 = time.perf_counter()
    # what every worker imports: paid once, here (see the module doc)
    import threading

    import torch._dynamo  # noqa: F401
    import torch.optim  # noqa: F401

    import trainmover.worker.main  # noqa: F401

    # what each worker started anew would pay (a restart's processes do): in every reply
    import_s = round(time.perf_counter() - t0, 4)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    refusal = None
    if threading.active_count() > 1:
        refusal = f"{threading.active_count()} Python threads after the imports: not forking"
    elif threads > 2:        # the main thread, and one that torch's import leaves idle
        refusal = f"{threads} threads after the imports: not forking"
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, FORK_MESSAGE_MAX, 2)
        except OSError:
            return 1
        if not msg:
            return 0          # the agent is gone
        log_fd = fds[0] if fds else None
        channel_fd = fds[1] if len(fds) > 1 else None    # to the agent (heartbeats)
        try:
            request = json.loads(msg)
            if refusal is not None:
                raise OSError(refusal)
            if request.get("op") != "spawn" or log_fd is None:
                raise OSError(f"not a spawn request: {request.get('op')!r}")
            pid, go_w = _fork_worker(request, log_fd, channel_fd, agent_pid, sock)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            sock.sendall(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
            continue
        finally:
            for fd in (log_fd, channel_fd):
                if fd is not None:
                    os.close(fd)
        sock.sendall(json.dumps({"pid": pid, "import_s": import_s}).encode())
        try:
            ack = json.loads(sock.recv(FORK_MESSAGE_MAX) or b"null")
        except (OSError, ValueError):
            ack = None
        if isinstance(ack, dict) and ack.get("op") == "go" and ack.get("pid") == pid:
            os.write(go_w, b"g")
        os.close(go_w)
        if ack is None:
            return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainmover.worker.forkserver")
    p.add_argument("--fd", type=int, required=True, help="the socket to the agent")
    p.add_argument("--agent-pid", type=int, required=True)
    args = p.parse_args(argv)
    return serve(args.fd, args.agent_pid)


if __name__ == "__main__":
    sys.exit(main())
