"""The job's Prometheus metrics, computed when scraped from what the operator view already
reads (the run dir's logs and the job's status): nothing is counted on the training path, so
a scrape costs the workers nothing. Names follow Prometheus conventions: the ``trainmover_``
prefix, base units (seconds), ``_total`` counters, bounded labels (interruption kinds and
states are fixed sets; ``worker`` labels are the job's own processes)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from trainmover.view.runlog import INTERRUPTION_KINDS, RunLog

# Interruption downtimes span a planned migration (tens of ms) to a checkpoint restart
# (minutes).
DOWNTIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
DETECTION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# a standby's states (core.decisions.StandbyState, less "dead": a dead one is no standby);
# "reserved" is busy: picked as the joiner of a migration in flight
STANDBY_STATES = ("starting", "cold", "warming", "warm", "reserved")


def _histogram(name: str, doc: str, samples: dict[str, list[float]], label: str,
               buckets: tuple[float, ...]) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=[label])
    for value, xs in samples.items():
        counts = [sum(1 for x in xs if x <= b) for b in buckets]
        h.add_metric([value], [(repr(b), c) for b, c in zip(buckets, counts)]
                     + [("+Inf", len(xs))], sum(xs))
    return h


class JobCollector:
    """A Prometheus collector over ``state()``, which returns (RunLog, JobStatus or None)."""

    def __init__(self, state):
        self.state = state

    def describe(self):
        return []   # computed per scrape: nothing to register up front

    def collect(self):
        log, status = self.state()
        yield from self._training(log, status)
        yield from self._interruptions(log)
        if status is not None:
            yield from self._processes(status)

    def _training(self, log: RunLog, status):
        step = status.committed_step if status is not None else \
            (log.last.step + 1 if log.last is not None else 0)
        yield GaugeMetricFamily("trainmover_step", "Steps committed by the job.", value=step)
        last = log.last
        for name, doc, value in (
                ("trainmover_tokens_per_second", "Training throughput at the newest step.",
                 last and last.tokens_per_s),
                ("trainmover_loss", "Loss at the newest committed step.", last and last.loss),
                ("trainmover_step_duration_seconds", "Wall time of the newest committed step.",
                 last and last.step_time_s)):
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("trainmover_job_running", "1 while the job runs.",
                                value=0 if log.ended is not None else 1)

    def _interruptions(self, log: RunLog):
        for what, plural in (("migration", "migrations"), ("recovery", "recoveries")):
            c = CounterMetricFamily(f"trainmover_{plural}", f"Finished {plural} by outcome.",
                                    labels=["status"])
            for status, n in sorted(log.by_status(what).items()):
                c.add_metric([status], n)
            yield c
        c = CounterMetricFamily("trainmover_failures", "Worker failures detected, by kind.",
                                labels=["kind"])
        for kind, n in sorted(log.failures.items()):
            c.add_metric([kind], n)
        yield c
        yield CounterMetricFamily("trainmover_stragglers_detected",
                                  "Straggler episodes reported.", value=len(log.stragglers))
        downtimes = {k: [] for k in INTERRUPTION_KINDS}
        latencies: dict[str, list[float]] = {}
        for it in log.interruptions:
            if it.status == "done" and it.downtime_s is not None:
                downtimes[it.kind].append(float(it.downtime_s))
            if it.what == "recovery":
                kinds = it.record.get("failures") or {}
                for w, lat in (it.record.get("detection_latency_s") or {}).items():
                    latencies.setdefault(kinds.get(w, "crash"), []).append(float(lat))
        yield _histogram("trainmover_interruption_downtime_seconds",
                         "Time training stood still per interruption, by kind.",
                         downtimes, "kind", DOWNTIME_BUCKETS)
        yield _histogram("trainmover_detection_latency_seconds",
                         "From a worker's failure to its detection, by failure kind.",
                         latencies, "kind", DETECTION_BUCKETS)

    def _processes(self, status):
        yield GaugeMetricFamily("trainmover_workers", "Workers holding a role.",
                                value=len(status.workers))
        g = GaugeMetricFamily("trainmover_standbys", "Standby processes by state.",
                              labels=["state"])
        for state in STANDBY_STATES:
            g.add_metric([state], sum(1 for s in status.standbys if s.state == state))
        yield g
        step = GaugeMetricFamily("trainmover_worker_step_seconds",
                                 "Median step time over the worker's newest window.",
                                 labels=["worker"])
        compute = GaugeMetricFamily("trainmover_worker_compute_seconds",
                                    "Median compute time (step minus waits) over the newest "
                                    "window.", labels=["worker"])
        for w in status.workers:
            if w.perf:
                step.add_metric([w.name], w.perf["step_s"])
                compute.add_metric([w.name], w.perf["compute_s"])
        yield step
        yield compute
        yield GaugeMetricFamily("trainmover_controller_up", "1 while the controller runs.",
                                value=1 if status.controller_alive else 0)
        if status.store_keys is not None:
            yield GaugeMetricFamily("trainmover_store_keys", "Keys in the job's store.",
                                    value=status.store_keys)


def render(state) -> bytes:
    """The Prometheus text exposition of ``state()``'s job."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(state))
    return generate_latest(registry)
