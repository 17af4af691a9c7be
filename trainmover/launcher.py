"""The coordinator of a local job: hosts the store, writes the membership table, starts one
process per worker, shows progress, and assembles the final canonical state.

Every process it starts is tracked by PID and stopped by PID on any exit path.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch

from .comm import start_store_server
from .config import JobConfig
from .events import EventLog, read_jsonl
from .state import assemble, state_digest


class JobFailed(RuntimeError):
    pass


def worker_names(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


@dataclass
class WorkerProcess:
    name: str
    proc: subprocess.Popen
    log_path: str

    def tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Progress:
    """Prints one line per committed step from metrics.jsonl (tailing the file)."""

    path: str
    total_steps: int
    enabled: bool = True
    _offset: int = 0
    _buf: str = ""
    last: dict = field(default_factory=dict)

    def poll(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            if not line:
                continue
            rec = json.loads(line)
            self.last = rec
            if self.enabled:
                print(f"step {rec['step'] + 1:>5}/{self.total_steps}  loss {rec['loss']:.4f}  "
                      f"{rec['step_time_s'] * 1000:8.1f} ms/step  "
                      f"{rec['tokens_per_s']:>10.0f} tok/s", flush=True)


def _stop_all(workers: list[WorkerProcess], grace_s: float = 3.0) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def prepare_run_dir(run_dir: str) -> None:
    if os.path.exists(os.path.join(run_dir, "job.json")):
        raise ValueError(f"run dir {run_dir!r} already holds a job; choose a new --run-dir")
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)


def run_job(cfg: JobConfig, run_dir: str, quiet: bool = False,
            timeout_s: float | None = None) -> dict:
    """Run a job to completion and return its summary (also written to summary.json).
    ``cfg`` must already be validated: nothing here should fail on user input."""
    run_dir = os.path.abspath(run_dir)
    prepare_run_dir(run_dir)
    with open(os.path.join(run_dir, "job.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
    events = EventLog(os.path.join(run_dir, "events.jsonl"), worker="coordinator")
    t0 = time.perf_counter()
    store = start_store_server(cfg.runtime.store_host)
    names = worker_names(cfg.layout.num_roles)
    for name, role in zip(names, cfg.layout.roles()):
        store.set(f"membership/worker/{name}", role.name)
        store.set(f"membership/role/{role.name}", name)
    events.emit("job_started", layout=cfg.layout.as_dict(), workers=len(names),
                store_port=store.port)
    if not quiet:
        print(f"trainmover: job {cfg.name!r} {cfg.layout} on {len(names)} workers, "
              f"{cfg.model.num_params() / 1e6:.2f}M parameters, run dir {run_dir}", flush=True)

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(cfg.threads_per_worker()))
    env["PYTHONUNBUFFERED"] = "1"
    workers: list[WorkerProcess] = []
    progress = Progress(os.path.join(run_dir, "metrics.jsonl"), cfg.train.steps, not quiet)
    try:
        for name in names:
            log_path = os.path.join(run_dir, "logs", f"{name}.log")
            log = open(log_path, "wb")
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainmover.worker", "--run-dir", run_dir,
                 "--name", name, "--store", f"{cfg.runtime.store_host}:{store.port}"],
                stdout=log, stderr=subprocess.STDOUT, env=env)
            log.close()
            workers.append(WorkerProcess(name, proc, log_path))
        _supervise(workers, progress, timeout_s, t0)
    except BaseException:
        _stop_all(workers)
        raise
    progress.poll()
    wall = time.perf_counter() - t0
    summary = _finish(cfg, run_dir, progress, wall)
    events.emit("job_done", wall_s=round(wall, 3), weights_sha256=summary["weights_sha256"])
    return summary


def _supervise(workers: list[WorkerProcess], progress: Progress, timeout_s: float | None,
               t0: float) -> None:
    while True:
        progress.poll()
        codes = [w.proc.poll() for w in workers]
        failed = [(w, c) for w, c in zip(workers, codes) if c not in (None, 0)]
        if failed:
            w, code = failed[0]
            _stop_all(workers)
            raise JobFailed(f"worker {w.name} exited with code {code}; last log lines:\n"
                            f"{w.tail()}")
        if all(c == 0 for c in codes):
            return
        if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
            _stop_all(workers)
            raise JobFailed(f"job exceeded its timeout of {timeout_s} s")
        time.sleep(0.05)


def _finish(cfg: JobConfig, run_dir: str, progress: Progress, wall_s: float) -> dict:
    shard_dir = os.path.join(run_dir, "final", "shards")
    shards = {}
    for role in cfg.layout.roles():
        if role.dp == 0:
            blob = torch.load(os.path.join(shard_dir, f"{role.name}.pt"), weights_only=True)
            shards[role] = (blob["tensors"], blob["dims"])
    canonical = assemble(shards, cfg.layout)
    digest = state_digest(canonical)
    ckpt_dir = os.path.join(run_dir, "final", "checkpoint")
    save_canonical_checkpoint(canonical, ckpt_dir)
    shutil.rmtree(shard_dir)
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    summary = {
        "name": cfg.name,
        "steps": len(metrics),
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "layout": cfg.layout.as_dict(),
        "workers": cfg.layout.num_roles,
        "weights_sha256": digest,
        "checkpoint": ckpt_dir,
        "wall_s": round(wall_s, 3),
        "mean_step_time_s": (sum(m["step_time_s"] for m in metrics[1:]) / (len(metrics) - 1)
                             if len(metrics) > 1 else None),
        "migrations": [],
    }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def save_canonical_checkpoint(state: dict[str, torch.Tensor], path: str) -> None:
    """The canonical state as a ``torch.distributed.checkpoint`` directory (loadable into any
    layout with ``dcp.load``, or into one file with ``dcp_to_torch_save``). Written to a
    temporary directory and renamed, so a crash never leaves a half-written checkpoint."""
    import torch.distributed.checkpoint as dcp

    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():  # "assuming ... single process" is exactly the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def load_canonical_checkpoint(path: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(path, "..", f".{os.path.basename(path)}.pt")
    dcp_to_torch_save(path, out)
    state = torch.load(out, weights_only=True)
    os.remove(out)
    return state
