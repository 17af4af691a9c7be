"""Facts about processes read from the operating system (Linux /proc), no torch."""
from __future__ import annotations

import os

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36

# One fork-server request or reply (agent <-> ``worker/forkserver.py``): JSON, a few KB (a
# worker's environment); bounded so that a broken peer cannot make the other side allocate
# without limit.
FORK_MESSAGE_MAX = 1 << 20


def exit_now(code: int):
    """End this process with ``code`` once its standard streams are flushed, skipping the
    interpreter's teardown: freeing torch's and torch._dynamo's modules took 0.5-1 s of CPU
    (seconds on a loaded host), and a process group's destructor can wait on a dead peer's
    socket. For processes whose every output is written by then (no buffered file, no
    ``atexit`` work of their own)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def prctl(option: int, arg) -> bool:
    """Linux's ``prctl(option, arg)``; False where it fails or does not exist."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped by its parent, is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)


def rss_mb() -> dict:
    """Current and peak resident set size of this process, in MiB (Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out["rss_mb" if key == "VmRSS" else "peak_rss_mb"] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return out


def raise_open_files(at_least: int = 0) -> int:
    """Let this process open as many descriptors as its hard limit allows (the soft limit
    is often 1024, and the job's store holds a few connections a worker: a job of 300
    workers would reach it), or ``at_least`` where a privileged process may raise the hard
    limit too (the control-plane benchmark's tens of thousands of connections). Returns the
    limit in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in ([at_least] if at_least > hard else []) + [hard]:
        if want == resource.RLIM_INFINITY or want <= soft:
            return soft
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
            return want
        except (ValueError, OSError):
            continue
    return soft
