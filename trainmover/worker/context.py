"""A worker process's context: what it keeps for its whole life, across the runs of the
training script it hosts (a standby runs the script once per warm-up structure, then for
real), and what the next run is to be.

Created once by the process entry point (``trainmover.worker.main``); ``trainmover.init()``
finds it with ``current()``. It is the one process-level value of the runtime, like the
interpreter's own ``sys.argv``: everything else is passed explicitly.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from trainmover.core.auth import load_secret
from trainmover.comm.groups import AbortSignal, GroupBuilder, StoreAddress, StoreClients
from trainmover.core import faults, jobfile
from trainmover.core import protocol as P
from trainmover.core.events import EventLog
from trainmover.core.topology import Role
from trainmover.worker.liveness import (AbortWatcher, Heartbeat, Inbox, MainProgress,
                                        agent_channel)
from trainmover.worker.commands import CommandChannel


# --- what the next run of the script is ------------------------------------------------------

@dataclass
class Start:
    """An active worker from the job's start (or a restarted one: from a checkpoint)."""

    resume_step: int = 0
    generation: int = 0


@dataclass
class Shadow:
    """A standby's warm-up: one representative role of a stage structure, in the sandbox.
    The run starts before the job has recorded that role's step 0 (imports and the model
    build need no recording); its steps wait for the recording at ``path``."""

    structure: str
    role: Role
    path: str
    manifest: dict


@dataclass
class Join:
    """A standby promoted by a migration or a recovery (the controller's assign command)."""

    command: P.AssignMigration | P.AssignRecovery


Launch = Start | Shadow | Join


class WorkerContext:
    def __init__(self, run_dir: str, name: str, store_addr: StoreAddress, standby: bool,
                 epoch: int = 0, t_start: float | None = None):
        self.t_imported = time.perf_counter()
        self.t_start = t_start if t_start is not None else self.t_imported
        self.run_dir, self.name, self.standby = run_dir, name, standby
        secret = load_secret(run_dir)
        self.cfg = cfg = jobfile.read_job(run_dir, secret)
        torch.set_num_threads(cfg.threads_per_worker())
        # the group timeout, not the store's: the commit vote and every group rendezvous
        # block on these clients, and wait as long as a collective may
        self.stores = StoreClients(store_addr, timeout_s=cfg.comm.group_timeout_s,
                                   run_key=jobfile.run_key(run_dir, secret))
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"), worker=name)
        self.stores.on_reject = lambda key, exc: self.events.emit(
            "message_rejected", key=key, error=str(exc))
        self.store = self.stores.get()
        self.device = self._device()
        self.abort = AbortSignal()
        self.epoch = epoch
        self.builder = GroupBuilder(self.stores, self.device, cfg.comm.group_timeout_s,
                                    abort_signal=self.abort if cfg.health.recover else None,
                                    backend=cfg.comm.backend,
                                    check_devices=cfg.comm.check_devices)
        self.progress = MainProgress(self.abort)
        # beats go to the host's agent, which relays them (one store key a host); a process
        # not started by an agent never beats, and is fenced as it would be if it hung
        self.channel = channel = agent_channel()     # its votes go there too (loop.py)
        self.heartbeat = Heartbeat(channel, name, cfg.health.heartbeat_interval_s,
                                   self.progress, cfg.health.main_stall_s, self.events) \
            if cfg.health.recover and channel is not None else None
        # the steps' decisions and the controller's aborts come back on it
        self.inbox = Inbox(channel, self.stores) if channel is not None else None
        self.commands = CommandChannel(self.stores, self.inbox, name,
                                       on_wait=self.progress.tick)
        self.launch: Launch | None = None
        self.runtime = None          # the Runtime of the script run in progress
        self.shadow_times: list[float] = []   # the current shadow run's step times
        self.shadow_wait_s = 0.0                # how long it waited for its recording
        self.replay_mismatch: str | None = None  # where the last shadow run's replay diverged
        self.events.emit("worker_started", pid=os.getpid(),
                         **({"cuda_device": self.device.index} if self.device.type == "cuda"
                            else {}),
                         gloo_host=self.builder.gloo_host,
                         import_s=round(self.t_imported - self.t_start, 4))

    def _device(self) -> torch.device:
        if self.cfg.process.device != "cuda":
            return torch.device("cpu")
        # the controller gives each process a GPU of the host in LOCAL_RANK (torchrun's
        # variable); processes share a GPU only where the job runs gloo (``comm.backend``)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        if self.cfg.process.deterministic:
            # strict: an operation without a deterministic kernel raises (naming itself)
            # rather than silently making runs differ
            torch.use_deterministic_algorithms(True)
        return torch.device("cuda", torch.cuda.current_device())

    def watch_abort(self, epoch: int) -> None:
        """Fire ``abort`` when the controller aborts ``epoch``: heard through the host's
        agent (one wait a host in the store), or in the store by a worker no agent
        started."""
        if self.inbox is not None:
            self.inbox.watch_abort(self.abort, epoch)
        else:
            AbortWatcher(self.stores, self.abort, epoch)

    def fault(self, point: str, step: int | None = None, on_commerr=None) -> None:
        """A named point where tests and chaos runs inject faults (``core.faults``)."""
        faults.hit(self.cfg.faults, self.name, point, step, self.events,
                   on_commerr=on_commerr, store=self.store)

    def set_standby_state(self, state: str, warm_for: list[str] = (), reason: str = "") -> None:
        self.store.set(P.standby_state_key(self.name),
                       P.write_message(P.StandbyReport(state, list(warm_for), reason)))


_CURRENT: WorkerContext | None = None


def current() -> WorkerContext | None:
    return _CURRENT


def install(ctx: WorkerContext) -> None:
    global _CURRENT
    _CURRENT = ctx
