"""Structured JSONL logs: ``events.jsonl`` (what happened, with durations) and
``metrics.jsonl`` (one record per committed step). Records are single ``write`` calls on a file
opened with O_APPEND, so several processes can append to one file without interleaving."""
from __future__ import annotations

import json
import os
import time
from typing import Any

from trainmover.core import rundir


class JsonlWriter:
    def __init__(self, path: str, **fixed: Any):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.fixed = fixed
        # a symlink planted in place of the log is refused, not appended through
        self._fd = rundir.open_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict) -> dict:
        rec = {"time": round(time.time(), 6), **self.fixed, **record}
        os.write(self._fd, (json.dumps(rec, sort_keys=False) + "\n").encode())
        return rec

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EventLog(JsonlWriter):
    """``emit("groups_built", step=3, duration_s=0.004)`` → one JSON line."""

    def emit(self, event: str, **fields: Any) -> dict:
        return self.write({"event": event, **fields})


def read_jsonl(path: str) -> list[dict]:
    """All complete records of a JSONL file (a torn last line, from a crash, is skipped)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                out.append(json.loads(line))
    return out
