"""A worker's step measurements for the straggler detector (``core/stragglers.py``), and the
injected slowdowns that tests and benchmarks use to make a straggler.

Per committed step: the step's wall time, the time this worker spent blocked in each of its
groups' operations (``Group.wait_s``) and in the commit vote (waiting for the others' votes),
and its compute time: on a GPU the difference (kernels run while the host thread waits),
on CPU the main thread's CPU time (``straggler.measure``), which a process descheduled by
its neighbours does not inflate: with more processes than cores, wall-clock compute is
mostly scheduling noise. Every ``straggler.window`` steps the medians go to the host's agent
on the worker's channel (``P.StepPerf``; the agent writes one key for its host:
``agent/perfs.py``), with the host's load and CPU steal where Linux tells them, and on a GPU its SM clock and
temperature where torch can read them (NVML's Python binding installed; no new dependency:
without it they are left out).
"""
from __future__ import annotations

import os
import time
from statistics import median
from typing import Callable

from trainmover.comm.groups import CommGroups
from trainmover.core import protocol as P


def _cpu_times() -> tuple[int, int] | None:
    """(total, steal) jiffies of the host, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    values = [int(x) for x in fields]
    return sum(values), values[7] if len(values) > 7 else 0


def _gpu_signals(index: int) -> tuple[float | None, float | None]:
    """(SM clock in MHz, temperature in C) of GPU ``index``, through torch.cuda, which reads
    them from NVML where its Python binding is installed; raises where it is not."""
    import torch

    return float(torch.cuda.clock_rate(index)), float(torch.cuda.temperature(index))


class StepMeter:
    def __init__(self, send: Callable[[bytes], None] | None, name: str, role_name: str,
                 tenure_start: int, window: int, slowdowns: dict[str, tuple[int, float]],
                 publish: bool, cpu_time: bool, gpu: int | None = None):
        """``send``: onto the worker's channel to its agent (None: not started by an agent,
        nothing published)."""
        self.send, self.name, self.role_name = send, name, role_name
        self.cpu_time = cpu_time       # compute = the main thread's CPU time (else wall)
        self._cpu_at = time.thread_time()
        self.tenure_start, self.window = tenure_start, window
        self.publish = publish and send is not None
        self.slow = slowdowns.get("slow")
        self.slowlink = slowdowns.get("slowlink")
        self._waits_at: dict[str, float] = {}
        self._vote_s = self._vote_cpu_s = 0.0
        self._after_vote_cpu: float | None = None
        self._rows: list[tuple[int, float, float, dict[str, float]]] = []
        self._recent: list[P.PerfWindow] = []
        self._cpu = _cpu_times()
        self.gpu = gpu      # the device index whose clock and temperature go with each window

    def _active(self, fault: tuple[int, float] | None, step: int) -> float:
        return fault[1] if fault is not None and step >= fault[0] else 1.0

    def begin(self, step: int, groups: CommGroups) -> None:
        link = self._active(self.slowlink, step)
        self._waits_at, self._vote_s, self._vote_cpu_s = {}, 0.0, 0.0
        self._after_vote_cpu = None
        self._cpu_at = time.thread_time()
        for slot, g in groups.slots().items():
            g.slow_factor = link
            self._waits_at[slot] = g.wait_s

    def _waited(self, groups: CommGroups) -> dict[str, float]:
        out = {slot: g.wait_s - self._waits_at.get(slot, g.wait_s)
               for slot, g in groups.slots().items()}
        if self._vote_s:
            out["vote"] = self._vote_s   # waiting for the other workers' commit votes
        return out

    def voted(self, seconds: float, cpu_s: float) -> None:
        """The commit vote took ``seconds`` (waiting for the others), ``cpu_s`` of it this
        thread's CPU (polling the store): not compute, or the peers that wait longest for a
        straggler's vote would look busier than it."""
        self._vote_s, self._vote_cpu_s = seconds, cpu_s
        self._after_vote_cpu = time.thread_time()

    def before_vote(self, step: int, t_start: float, groups: CommGroups) -> None:
        """An injected compute slowdown: the step's compute so far, stretched (before the
        commit point, so the peers wait for it as they would for a slow machine); the rest
        of the step (the optimizer) is stretched in ``end``."""
        self._stretch(step, self._cpu_at)
        self._after_vote_cpu = time.thread_time()   # reset by voted() when there is a vote

    def _stretch(self, step: int, since_cpu: float) -> None:
        factor = self._active(self.slow, step)
        if factor > 1.0:
            # a slower processor: the computation since ``since_cpu``, once more (factor - 1)
            # times over, as CPU work (it shows in wall time and in CPU time alike)
            target = time.thread_time() + (factor - 1.0) * (time.thread_time() - since_cpu)
            while time.thread_time() < target:
                pass

    def end(self, step: int, step_s: float, groups: CommGroups) -> None:
        if self._after_vote_cpu is not None:
            # a slower processor is slower at the optimizer step too
            self._stretch(step, self._after_vote_cpu)
        if not self.publish:
            return
        waits = self._waited(groups)
        compute = time.thread_time() - self._cpu_at - self._vote_cpu_s if self.cpu_time else \
            step_s - sum(waits.values())
        self._rows.append((step, step_s, compute, waits))
        if len(self._rows) < self.window:
            return
        rows, self._rows = self._rows, []
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        cpu, steal = _cpu_times(), None
        if cpu is not None and self._cpu is not None and cpu[0] > self._cpu[0]:
            steal = round((cpu[1] - self._cpu[1]) / (cpu[0] - self._cpu[0]), 4)
        self._cpu = cpu
        clock = temp = None
        if self.gpu is not None:
            try:
                clock, temp = _gpu_signals(self.gpu)
            except Exception:  # noqa: BLE001 - no NVML binding or no reading: stop asking
                self.gpu = None
        slots = sorted({s for r in rows for s in r[3]})
        compute_s = round(median(r[2] for r in rows), 6)
        self._recent = (self._recent + [P.PerfWindow(rows[0][0], rows[-1][0], compute_s)]
                        )[-P.PERF_HISTORY:]
        try:
            self.send(P.perf_message(P.StepPerf(
                self.role_name, rows[0][0], rows[-1][0], self.tenure_start,
                round(median(r[1] for r in rows), 6), compute_s,
                {s: round(median(r[3].get(s, 0.0) for r in rows), 6) for s in slots},
                None if load is None else round(load, 2), steal, list(self._recent),
                gpu_clock_mhz=clock, gpu_temp_c=temp)))
        except OSError:
            self.publish = False     # the agent is gone: so is the job
