"""The agent's side of the fork server (the server itself: ``worker/forkserver.py``):
workers and standbys start from a process that has already imported torch, instead of each
importing it anew.

Why: a worker's start-up is mostly imports (torch, and ``torch._dynamo``, which torch's
optimizer constructor pulls in): measured here at 4-5 s of CPU per process, paid by every
worker, standby and replacement at once, on cores the job trains on. A replacement started
without a standby waits for it inside the recovery's downtime. Forked from a process that
holds those modules, a worker starts in milliseconds.

How, and why each part:

- The server (``python -m trainmover.worker.forkserver``) is started by the agent once, imports
  the worker's modules, and then serves spawn requests over a Unix socket pair (one JSON
  message each, with the worker's log file descriptor passed alongside). It starts no
  thread (checked before serving: a fork of a threaded process can inherit held locks), and
  initialises no CUDA context (``PYTORCH_NVML_BASED_CUDA_CHECK``: a CUDA check that goes
  through NVML, not the driver, so forked children can use CUDA).
- **Workers stay the agent's children.** The server forks twice; the middle process exits at
  once, so the worker is re-parented to the agent (``PR_SET_CHILD_SUBREAPER`` on the agent).
  The agent then waits for it, reads its exit code, signals it and kills it exactly as a
  process it started itself (its PID cannot be reused before the agent reaps it), and the
  worker dies with the agent (``PR_SET_PDEATHSIG``, set once it is the agent's). A server
  that dies costs no running worker; later spawns fall back to starting the process anew.
- **No stray worker.** The worker runs nothing until the server writes it a go byte, which
  the server does only once the agent has read the worker's PID (the agent's ``go``): a
  spawn the agent gave up on (``agent.fork_server_timeout_s``) ends with the server, whose
  pipe then reads empty.
- Each worker gets its own environment, argument list and log (its standard output and
  error); its process name (``ps -o comm``) is ``tm-<name>``, its command line the server's.
- Random state: Python's ``random`` reseeds itself in a forked child; NumPy's global
  generator, if imported, is reseeded from the OS as a fresh process would be; torch's
  generators are as at import (a fresh process's default seed).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from trainmover.core.proc import FORK_MESSAGE_MAX, PR_SET_CHILD_SUBREAPER, prctl


class ForkServerError(RuntimeError):
    """The fork server cannot start a process (not started, gone, refused or too slow)."""


def become_subreaper() -> bool:
    """The agent: orphans of its descendants (a forked worker, once its middle process
    exits) become its children. False where Linux does not offer it."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def reap_orphans(known: set[int]) -> list[int]:
    """Reap exited children that are not ``known`` (the agent's own processes, whose exit
    codes their owners read): descendants of a dead worker re-parented to the agent, such as
    a data loader's worker processes. Returns their PIDs. O(children of the agent)."""
    reaped = []
    for pid in _children() - known:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if done:
            reaped.append(pid)
    return reaped


def _children() -> set[int]:
    """This process's children, exited ones included (Linux lists them per thread)."""
    pids: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(pid) for pid in f.read().split())
        except (OSError, ValueError):
            pass
    return pids


class ForkedProcess:
    """A worker forked by the server and re-parented to the agent: what ``subprocess.Popen``
    offers the agent (``pid``, ``returncode``, ``poll``, ``wait``, ``kill``,
    ``send_signal``)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # not (or no longer) ours to wait for: taken as gone, never waited for forever
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:      # not reaped: the PID is still this process's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The agent's side: starts the server, asks it for workers."""

    def __init__(self, env: dict, log_path: str, timeout_s: float, preexec_fn=None):
        self.timeout_s = timeout_s
        self.import_s: float | None = None    # the server's imports, once it has forked
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainmover.worker.forkserver", "--fd", str(theirs.fileno()),
                 "--agent-pid", str(os.getpid())],
                stdout=log, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),),
                env=dict(env, PYTORCH_NVML_BASED_CUDA_CHECK="1"), preexec_fn=preexec_fn)
        theirs.close()

    def spawn(self, args: list[str], env: dict, log_fd: int, name: str,
              channel_fd: int) -> ForkedProcess:
        """A worker running ``python -m trainmover.worker ARGS`` with ``env``, its output to
        ``log_fd``, its channel to the agent ``channel_fd`` (its number in the worker goes in
        its environment). Raises ``ForkServerError`` (and the server is closed) if it
        cannot."""
        try:
            self._sock.settimeout(self.timeout_s)
            request = {"op": "spawn", "args": args, "env": env, "name": name}
            socket.send_fds(self._sock, [json.dumps(request).encode()], [log_fd, channel_fd])
            reply = json.loads(self._sock.recv(FORK_MESSAGE_MAX) or b"null")
            if not isinstance(reply, dict) or not isinstance(reply.get("pid"), int):
                raise ForkServerError(f"fork server: {reply!r}")
            proc = ForkedProcess(reply["pid"])
            if self.import_s is None and isinstance(reply.get("import_s"), (int, float)):
                self.import_s = float(reply["import_s"])
            self._sock.sendall(json.dumps({"op": "go", "pid": proc.pid}).encode())
            return proc
        except (OSError, ValueError) as exc:       # socket.timeout is an OSError
            self.close()
            raise ForkServerError(f"fork server: {type(exc).__name__}: {exc}") from exc
        except ForkServerError:
            self.close()
            raise

    def close(self) -> None:
        """Stop the server (a spawn it did not finish never runs: its go pipe reads empty)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._sock.close()
