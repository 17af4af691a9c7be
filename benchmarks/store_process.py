"""The job's store (``core/kvserver.py``, one thread, as host 0's agent serves it) in a
process of its own for the benchmark scripts here, and that process's CPU time: what a
script measures the store's side of a workload with."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

SERVER = """
import sys
from trainmover.core import kvserver
from trainmover.core.proc import raise_open_files
raise_open_files(1 << 20)
s = kvserver.serve(bytes.fromhex(sys.argv[1]))
print(s.port, flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def store_process(key: bytes):
    """Yield ``(process, port)`` of a store answering clients that hold ``key``; it is
    killed on the way out."""
    server = subprocess.Popen([sys.executable, "-c", SERVER, key.hex()],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield server, int(server.stdout.readline())
    finally:
        server.kill()
        server.wait()


def cpu_s(pid: int) -> float:
    """The process's user and system CPU seconds so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
