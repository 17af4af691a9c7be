"""``trainmover bench state-size``: how a planned migration's downtime (and a crash recovery's
from a data-parallel replica) grows with the state a worker holds.

For each size (``--sizes``, MB of state per worker: parameters and AdamW's two moments, fp32,
12 bytes per parameter) the built-in trainer's model is sized through the config's model
section (``size_model``: width and depth; vocabulary, sequence and MLP ratio fixed) and run
as a DP2 job with one warm standby, on a small batch so that steps stay short on a few CPU
cores. Per size, in order:

1. a check that the size fits this machine's free memory (``memory_needed``, an estimate
   from the processes' copies of the state); a size that does not fit is reported as such,
   with both figures, and not run;
2. a calibration job (stopped once its standby is warm): at which step the standby is warm
   and how long a step takes; it sizes the measured jobs' step count ``steps``, so that
   every measured job trains exactly ``steps`` steps and ends on its own, with a final
   weights digest;
3. ``--repeats`` rounds of every scenario, each a fresh job: ``planned`` (w1's role moved to
   the warm standby: ``bench downtime``'s ``_downtime_run``, strategy ``trainmover``) and
   ``crash`` (w1 SIGKILLed from outside once the standby is warm, its role recovered into
   the standby from w0, its data-parallel replica: ``_failure_run``);
4. the same job uninterrupted (no standby, no event), whose final weights every measured
   run's must equal (``weights_equal``);
5. the point-to-point time of the measured state's bytes over a gloo pair on this machine
   (``p2p_seconds``, after the jobs: they do not share the cores with it).

Two strategies of a planned migration (``--strategies``): ``stop_and_copy`` moves the whole
state at the switch (bytes before the switch: 0); ``precopy`` (``migration.precopy``,
``train/precopy.py``) moves parameters and moments during phase 1 and keeps them current by
replaying the leaver's optimizer, so the switch moves the rest (bytes before the switch:
the state and each replayed step's gradients). Its rows come beside the stop-and-copy rows of
the same size, divided by them (``downtime_over_stop_and_copy``). A crash's recovery is the
same with either, so it runs with stop-and-copy only. Every measured job trains the same
steps, so that phase 1 of a pre-copy (a chunk of the state per step) fits.

While a job runs, a sampler reads every worker's and standby's peak resident memory
(``VmHWM`` of ``/proc/<pid>/status``, PIDs from the run's ``process_started`` events) every
``RSS_POLL_S``; a process's growth in its last moments before it exits may be missed.
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import threading
import time

from trainmover.bench.report import (BenchLine, fmt_spread, git_commit, machine_description,
                                     spread, write_result)
from trainmover.core.accounting import downtime_value, within_noise
from trainmover.core.config import JobConfig, ModelConfig
from trainmover.core.events import read_jsonl
from trainmover.core.topology import Layout

SIZES_MB = (10, 100, 500, 2000)
SCENARIOS = ("planned", "crash")
STRATEGIES = ("stop_and_copy", "precopy")
# the strategy's name in bench/downtime.py's runs (pre-copy: with migration.precopy on)
RUN_STRATEGY = {"stop_and_copy": "trainmover", "precopy": "trainmover"}
BYTES_PER_PARAM = 12          # fp32 parameter + AdamW's exp_avg and exp_avg_sq
MB = 1_000_000
VOCAB, SEQ_LEN, MLP_RATIO, HEAD_DIM = 256, 32, 4, 64
LEAVER = "w1"                 # dp rank 1: its replica w0 is the only stayer (and reporter)
EVENT_STEP = 6
# steps a measured job trains after the calibration's warm step (times WARM_FACTOR, plus
# WARM_SLACK), enough for the switch margin, the accounting's steps after the switch, a
# recovery and its steps after: a standby warm later than in the calibration still leaves
# room before the job's end
STEPS_AFTER_EVENT = 14
WARM_FACTOR, WARM_SLACK = 1.5, 3
RSS_POLL_S = 0.1
# memory: each of the three processes (two workers, the standby) holds the parameters,
# their gradients and AdamW's two moments (16 bytes a parameter) with transfer and recovery
# staging beside them (20 in all); at the job's end w0 also loads its final shard and
# assembles the canonical state (two more copies of the 12 bytes); plus the processes' own
# runtime and the controller
MEM_BYTES_PER_PARAM = 3 * 20 + 2 * BYTES_PER_PARAM
MEM_OVERHEAD = int(1.5 * 2**30)


# --- sizing ---------------------------------------------------------------------------------------

def model_for(d_model: int, n_layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, n_layers=n_layers, d_model=d_model,
                       n_heads=max(1, d_model // HEAD_DIM), seq_len=SEQ_LEN,
                       mlp_ratio=MLP_RATIO)


def state_bytes_of(model: ModelConfig) -> int:
    """Parameters and AdamW's two moments, fp32, of one whole model (a DP worker's state)."""
    return BYTES_PER_PARAM * model.num_params()


def size_model(size_mb: float, target_layers: int = 8, tolerance: float = 0.05) -> ModelConfig:
    """A model whose state is about ``size_mb`` MB (10**6 bytes): widths a multiple of 64
    (heads of 64), depth from 1 to 48; of the shapes within ``tolerance`` of the size, the
    one nearest ``target_layers`` deep, else the nearest in size. Computed from
    ``ModelConfig.num_params``, without building the model."""
    if not size_mb > 0:
        raise ValueError(f"a state size must be positive, got {size_mb!r} MB")
    target = size_mb * MB
    shapes = []
    for d in range(64, 8192 + 1, 64):
        one, two = state_bytes_of(model_for(d, 1)), state_bytes_of(model_for(d, 2))
        per_block, rest = two - one, one - (two - one)
        layers = min(48, max(1, round((target - rest) / per_block)))
        err = abs(state_bytes_of(model_for(d, layers)) - target) / target
        shapes.append((err, abs(layers - target_layers), d, layers))
    close = [s for s in shapes if s[0] <= tolerance]
    _, _, d, layers = min(close, key=lambda s: (s[1], s[0])) if close else min(shapes)
    return model_for(d, layers)


def job_config(model: ModelConfig) -> JobConfig:
    """The measured job: DP2 of the built-in trainer, eager, one sequence per replica and
    step, one thread per worker."""
    from trainmover.recipes import get_recipe

    cfg = get_recipe("bench_downtime")
    cfg.name = "bench_state_size"
    cfg.layout = Layout(2, 1, 1)
    cfg.model = model
    cfg.train.global_batch, cfg.train.num_microbatches = 2, 1
    cfg.train.compile = False
    # the crash is recovered from the data-parallel replica: no periodic checkpoint (a
    # disk copy of the whole state in the middle of the measured steps)
    cfg.checkpoint.every = 0
    # big states on shared cores: a heartbeat thread can wait seconds for a core while
    # gigabytes are copied; a crash (SIGKILL) is seen by its exit, not by heartbeats
    cfg.health.heartbeat_timeout_s, cfg.health.startup_timeout_s = 10.0, 120.0
    # the bench stops the calibration job: its agent must not restart a controller for it
    cfg.controller.restart, cfg.controller.grace_s = "manual", 30.0
    return cfg.validate()


def memory_needed(model: ModelConfig) -> int:
    return MEM_BYTES_PER_PARAM * model.num_params() + MEM_OVERHEAD


def memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def precopy_steps(model: ModelConfig, cfg: JobConfig) -> int:
    """Step boundaries a pre-copy of this model's state takes (a chunk each)."""
    return math.ceil(state_bytes_of(model) / (cfg.migration.precopy_chunk_mb * 2**20))


def steps_for(warm_step: int, event_step: int = EVENT_STEP) -> int:
    """A measured job's steps, from the step its calibration's standby was warm at."""
    warm = math.ceil(max(event_step, warm_step) * WARM_FACTOR)
    return warm + WARM_SLACK + STEPS_AFTER_EVENT


# --- measuring one job ------------------------------------------------------------------------------

def _vm_hwm_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class PeakRss:
    """Samples the peak RSS (VmHWM, MiB) of every process the run's agent started, by name,
    from a thread, while the job runs (``with PeakRss(run_dir) as rss: ...; rss.peak``)."""

    def __init__(self, run_dir: str, poll_s: float = RSS_POLL_S):
        self.path = os.path.join(run_dir, "events.jsonl")
        self.poll_s = poll_s
        self.peak: dict[str, float] = {}
        self.pids: dict[str, int] = {}
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _new_processes(self) -> None:
        import json

        try:
            with open(self.path) as f:
                f.seek(self._offset)
                for line in f:
                    if not line.endswith("\n"):
                        break       # a line being written: read it next time
                    self._offset += len(line.encode())
                    if '"process_started"' in line:
                        rec = json.loads(line)
                        self.pids[rec["name"]] = rec["pid"]
        except OSError:
            pass

    def sample(self) -> None:
        self._new_processes()
        for name, pid in self.pids.items():
            hwm = _vm_hwm_mb(pid)
            if hwm is not None:
                self.peak[name] = max(self.peak.get(name, 0.0), hwm)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.sample()
        self.sample()


def roles_of(events: list[dict], scenario: str) -> dict:
    """Who left (or crashed), who joined and who stayed, from the run's events."""
    kind = "migration_done" if scenario == "planned" else "recovery_done"
    done = [e for e in events if e["event"] == kind and e.get("status") == "done"]
    if not done:
        return {"leaver": [], "joiner": [], "stayers": []}
    pairs = done[0]["pairs"]
    leavers = [p.get("leaver") or p.get("failed") for p in pairs]
    joiners = [p["joiner"] for p in pairs]
    started = [e["name"] for e in events if e["event"] == "process_started"
               and not e.get("standby")]
    stayers = done[0].get("stayers") or sorted(set(started) - set(leavers) - set(joiners))
    return {"leaver": leavers, "joiner": joiners, "stayers": stayers}


def phase_one_steps(events: list[dict], records: list[dict], switch_step: int,
                    baseline: int = 5) -> dict | None:
    """The stayers' own step times (the reporter's, ``metrics.jsonl``'s step_time_s: in a DP2
    job moving w1 the reporter w0 is the only stayer) during phase 1 (steps from the one a
    stayer began preparing at up to the switch) against the ``baseline`` steps before it."""
    prepared = [e["time"] for e in events if e["event"] == "migration_prepare"
                and e.get("part") == "stayer"]
    if not prepared:
        return None
    t0 = min(prepared)
    steps = {r["step"]: r for r in records if "step_time_s" in r}
    after = sorted(s for s, r in steps.items() if r["time"] > t0)
    if not after:
        return None
    first = after[0]
    normal = [steps[s]["step_time_s"] for s in range(max(1, first - baseline), first)
              if s in steps]
    during = [steps[s]["step_time_s"] for s in range(first, switch_step) if s in steps]
    if not normal or not during:
        return None
    n, p = statistics.median(normal), statistics.median(during)
    return {"prepare_step": first, "steps": len(during), "normal_step_s": n,
            "phase1_step_s": p, "ratio": p / n if n > 0 else None}


def _summarise_run(scenario: str, res: dict, run_dir: str, rss: dict[str, float]) -> dict:
    """One measured job's figures for the table, from what ``_downtime_run`` /
    ``_failure_run`` returned and the run's logs."""
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    roles = roles_of(events, scenario)
    phases = res.get("phases") or {}
    out = {"downtime_s": res["downtime_s"], "downtime_noise_s": res.get("downtime_noise_s"),
           "normal_step_s": res.get("normal_step_s"),
           "weights_sha256": res.get("weights_sha256"), "roles": roles, "phases": phases,
           "peak_rss_mb": {part: _max_or_none([rss.get(w) for w in names])
                           for part, names in roles.items()},
           "rss_by_process": rss}
    if scenario == "planned":
        records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        leaver = [e for e in events if e["event"] == "migration_switched"
                  and e.get("part") == "leaver"]
        pre = (leaver[0].get("precopy_bytes") or 0) + (leaver[0].get("precopy_grad_bytes") or 0) \
            if leaver else 0
        held = (leaver[0].get("precopy_bytes") or 0) if leaver else 0
        joined = [e for e in events if e["event"] == "joiner_started" and "migration_id" in e]
        out.update(state_bytes=(res.get("transfer_bytes") or 0) + held or None,
                   joiner_switch_recv_s=joined[0].get("switch_recv_s") if joined else None,
                   precopy_slack_s=joined[0].get("precopy_slack_s") if joined else None,
                   switch_bytes=res.get("transfer_bytes"), pre_switch_bytes=pre,
                   precopy_steps=leaver[0].get("precopy_steps") if leaver else None,
                   precopy_abandoned=any(e["event"] == "precopy_abandoned" for e in events),
                   transfer_s=phases.get("transfer_s"), joiner_recv_s=phases.get("joiner_recv_s"),
                   phase1_slowdown_s=phases.get("phase1_slowdown_s"),
                   phase1=phase_one_steps(events, records, res.get("event_step") or 0),
                   stayer_peak_rss_growth=res.get("stayer_peak_rss_growth"))
    else:
        # the survivor's "recovered" event: the bytes it sent the joiner (its send time is
        # not reported apart from the whole of its part of the recovery, kept as such)
        sent = [e for e in events if e["event"] == "recovered" and e.get("sent_bytes")]
        # the joiner's side likewise: from its start as the replacement to the state restored
        joined = [e for e in events if e["event"] == "joiner_started" and "recovery_id" in e]
        out.update(state_bytes=sent[0]["sent_bytes"] if sent else None,
                   switch_bytes=sent[0]["sent_bytes"] if sent else None,
                   transfer_s=None, joiner_recv_s=None, phase1=None, phase1_slowdown_s=None,
                   survivor_recovery_s=sent[0].get("duration_s") if sent else None,
                   joiner_restore_s=joined[0].get("prepare_s") if joined else None,
                   detection_latency_s=res.get("detection_latency_s"))
    out.setdefault("pre_switch_bytes", 0)   # a recovery moves nothing ahead of the switch
    return out


def _drop_final(run_dir: str) -> None:
    """The final checkpoint of a measured job (a copy of its whole state: gigabytes at the
    large sizes): its digest is what the bench keeps."""
    shutil.rmtree(os.path.join(run_dir, "final"), ignore_errors=True)


def measure(strategy: str, scenario: str, cfg: JobConfig, steps: int, run_dir: str) -> dict:
    from trainmover.bench.downtime import _downtime_run, _failure_run

    if strategy == "precopy":
        cfg = JobConfig.from_dict(cfg.to_dict())
        cfg.migration.precopy = True
    with PeakRss(run_dir) as rss:
        if scenario == "planned":
            res = _downtime_run(RUN_STRATEGY[strategy], cfg, EVENT_STEP, LEAVER, run_dir,
                                steps=steps)
        else:
            res = _failure_run(RUN_STRATEGY[strategy], scenario, cfg, EVENT_STEP, LEAVER,
                               run_dir, steps=steps)
    out = _summarise_run(scenario, res, run_dir, dict(rss.peak))
    _drop_final(run_dir)
    return out


def calibrate(cfg: JobConfig, run_dir: str) -> dict:
    """A job with a standby, run until the standby is warm and a few steps past
    ``EVENT_STEP``, then stopped: the step the standby was warm at, the normal step."""
    from trainmover.api import Job
    from trainmover.bench.downtime import _reach_event, normal_gap_before, wait_for

    cfg = JobConfig.from_dict(cfg.to_dict())
    cfg.train.steps = 100_000
    cfg.standby.count = 1
    t0 = time.monotonic()
    with PeakRss(run_dir) as rss:
        job = Job(cfg, run_dir, timeout_s=3600).start()
        coord = job.coordinator
        try:
            _reach_event(job, 0, warm_standby=True)
            warm_step = coord.progress.last_step + 1
            wait_for(lambda: coord.progress.last_step >= max(warm_step, EVENT_STEP) + 5, job,
                     "steps after the standby was warm")
        finally:
            coord.stop()
        job.wait(600)
    return {"warm_step": warm_step, "normal_step_s": normal_gap_before(run_dir, time.time()),
            "wall_s": time.monotonic() - t0, "peak_rss_mb": dict(rss.peak)}


def uninterrupted(cfg: JobConfig, steps: int, run_dir: str) -> dict:
    """The same job, ``steps`` steps, no standby, no event: its final weights digest."""
    from trainmover.api import Job

    cfg = JobConfig.from_dict(cfg.to_dict())
    cfg.train.steps = steps
    cfg.standby.count = 0
    with PeakRss(run_dir) as rss:
        summary = Job(cfg, run_dir, timeout_s=3600).start().wait(3600)
    _drop_final(run_dir)
    return {"weights_sha256": summary.get("weights_sha256"), "peak_rss_mb": dict(rss.peak)}


# --- the rows -------------------------------------------------------------------------------------

def _values(runs: list[dict], key: str) -> list[float]:
    return [r[key] for r in runs if isinstance(r.get(key), (int, float))]


def _spread_of(values: list[float]) -> dict | None:
    return spread(values) if values else None


def _max_or_none(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return max(values) if values else None


def size_rows(size: dict, runs: list[dict], baseline: str | None,
              p2p: dict | None, context: dict) -> list[dict]:
    """The rows of one size: one per (scenario, strategy) that ran, from its runs' figures
    (``_summarise_run``'s, each with ``scenario``, ``strategy`` and, for a failed run,
    ``error``), the uninterrupted run's digest, the point-to-point measurement
    (``{"bytes", "seconds"}``) and ``context`` (command, commit, machine: in every row)."""
    rows = []
    keys = sorted({(r["scenario"], r["strategy"]) for r in runs},
                  key=lambda k: (SCENARIOS.index(k[0]) if k[0] in SCENARIOS else 99, k[1]))
    for scenario, strategy in keys:
        mine = [r for r in runs if (r["scenario"], r["strategy"]) == (scenario, strategy)]
        ok = [r for r in mine if "error" not in r and r.get("downtime_s") is not None]
        down = _values(ok, "downtime_s")
        noise = _values(ok, "downtime_noise_s")
        state = _values(ok, "state_bytes")
        digests = [r.get("weights_sha256") for r in ok]
        row = {"size_mb": size["size_mb"], "model": size["model"],
               "params": size["params"], "predicted_state_bytes": size["predicted_state_bytes"],
               "steps": size.get("steps"), "scenario": scenario, "strategy": strategy,
               "runs": len(mine), "failed": len(mine) - len(ok),
               "errors": [r["error"] for r in mine if "error" in r],
               "state_bytes": int(statistics.median(state)) if state else None,
               "downtime_s": _spread_of(down),
               "downtime_noise_s": statistics.median(noise) if noise else None,
               "weights_equal": all(d == baseline for d in digests)
               if baseline and digests else None,
               "weights_compared": f"{sum(d == baseline for d in digests)}/{len(digests)}"
               if baseline and digests else None,
               "switch_bytes": int(statistics.median(_values(ok, "switch_bytes")))
               if _values(ok, "switch_bytes") else None,
               "pre_switch_bytes": int(statistics.median(_values(ok, "pre_switch_bytes")))
               if _values(ok, "pre_switch_bytes") else 0,
               "p2p_bytes": p2p["bytes"] if p2p else None,
               "p2p_s": p2p["seconds"] if p2p else None,
               "p2p_gb_per_s": p2p["bytes"] / p2p["seconds"] / 1e9 if p2p else None,
               "downtime_over_p2p": _spread_of([d / p2p["seconds"] for d in down])
               if p2p and p2p["seconds"] > 0 else None,
               "transfer_s": _spread_of(_values(ok, "transfer_s")),
               "joiner_recv_s": _spread_of(_values(ok, "joiner_recv_s")),
               "joiner_switch_recv_s": _spread_of(_values(ok, "joiner_switch_recv_s")),
               "precopy_slack_s": _spread_of(_values(ok, "precopy_slack_s")),
               "normal_step_s": _spread_of(_values(ok, "normal_step_s")),
               "phase1_step_ratio": _spread_of([r["phase1"]["ratio"] for r in ok
                                                if r.get("phase1") and
                                                r["phase1"].get("ratio") is not None]),
               "phase1_slowdown_s": _spread_of(_values(ok, "phase1_slowdown_s")),
               "peak_rss_mb": {part: _max_or_none([(r.get("peak_rss_mb") or {}).get(part)
                                                   for r in ok])
                               for part in ("leaver", "joiner", "stayers")},
               **context}
        row["within_noise"] = bool(down) and within_noise(statistics.median(down),
                                                          row["downtime_noise_s"])
        rows.append(row)
    # each strategy over stop-and-copy, same size and scenario (ratio of medians per run)
    for row in rows:
        base = next((b for b in rows if b["scenario"] == row["scenario"] and
                     b["strategy"] == "stop_and_copy" and b["downtime_s"]), None)
        if row["strategy"] == "stop_and_copy":
            row["downtime_over_stop_and_copy"] = 1.0 if row["downtime_s"] else None
        elif base and row["downtime_s"] and base["downtime_s"]["median"] > 0:
            m = base["downtime_s"]["median"]
            row["downtime_over_stop_and_copy"] = {k: v / m for k, v in row["downtime_s"].items()}
        else:
            row["downtime_over_stop_and_copy"] = None
    return rows


def skipped_rows(size: dict, scenarios, strategies, why: str, context: dict) -> list[dict]:
    """A size that could not run: one row per cell, saying why (where the bench stopped)."""
    return [{"size_mb": size["size_mb"], "model": size["model"], "params": size["params"],
             "predicted_state_bytes": size["predicted_state_bytes"], "steps": None,
             "scenario": sc, "strategy": st, "runs": 0, "failed": 0, "errors": [why],
             "skipped": why, "state_bytes": None, "downtime_s": None,
             "downtime_over_stop_and_copy": None, "weights_equal": None, **context}
            for sc in scenarios for st in strategies]


def size_info(size_mb: float) -> dict:
    model = size_model(size_mb)
    return {"size_mb": size_mb, "params": model.num_params(),
            "predicted_state_bytes": state_bytes_of(model),
            "model": {"d_model": model.d_model, "n_layers": model.n_layers,
                      "n_heads": model.n_heads, "vocab_size": model.vocab_size,
                      "seq_len": model.seq_len, "mlp_ratio": model.mlp_ratio}}


# --- the benchmark --------------------------------------------------------------------------------

def bench_state_size(sizes: list[float] = SIZES_MB, repeats: int = 3, scenarios=SCENARIOS,
                     out_dir: str = "benchmarks/results", name: str = "state_size",
                     command: str | None = None, strategies=STRATEGIES,
                     scratch: str | None = None) -> dict:
    import tempfile

    from trainmover.bench.downtime import p2p_seconds

    if repeats < 1:
        raise ValueError(f"--repeats {repeats}: must be >= 1")
    for sc in scenarios:
        if sc not in SCENARIOS:
            raise ValueError(f"--scenarios: unknown scenario {sc!r} (known: "
                             f"{', '.join(SCENARIOS)})")
    for st in strategies:
        if st not in RUN_STRATEGY:
            raise ValueError(f"unknown strategy {st!r} (known: {', '.join(RUN_STRATEGY)})")
    infos = [size_info(s) for s in sizes]      # refuses a bad size before any job runs
    scratch = scratch or tempfile.mkdtemp(prefix="tm-bench-state-size-")
    context = {"command": command, "commit": git_commit(), "machine": machine_description()}
    t_start = time.monotonic()
    result = {"benchmark": "state_size", "sizes_mb": list(sizes), "repeats": repeats,
              "scenarios": list(scenarios), "strategies": list(strategies),
              "layout": "DP2 x PP1 x TP1, one standby", "event_step": EVENT_STEP,
              "leaver": LEAVER, "bytes_per_param": BYTES_PER_PARAM, "scratch": scratch,
              "calibrations": {}, "baselines": {}, "stopped_at": None, "rows": [],
              "runs": [], **context}
    # per size: the calibration, the runs, the uninterrupted run, the bandwidth
    runs_per_size = repeats * sum(1 for sc in scenarios for st in strategies
                                  if sc == "planned" or st == "stop_and_copy")
    line = BenchLine("bench state-size", len(sizes) * (3 + runs_per_size))

    def save() -> None:
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        write_result(out_dir, name, result, state_size_table(result))

    for info in infos:
        size_mb, cfg = info["size_mb"], job_config(size_model(info["size_mb"]))
        tag = f"{size_mb:g} MB"
        need, have = memory_needed(cfg.model), memory_available()
        info["memory_needed_bytes"], info["memory_available_bytes"] = need, have
        if have is not None and need > have:
            why = (f"does not fit: needs about {need / 2**30:.1f} GiB (estimate: "
                   f"{MEM_BYTES_PER_PARAM} bytes per parameter + "
                   f"{MEM_OVERHEAD / 2**30:.1f} GiB), {have / 2**30:.1f} GiB available")
            result["stopped_at"] = result["stopped_at"] or {"size_mb": size_mb, "why": why}
            result["rows"] += skipped_rows(info, scenarios, strategies, why, context)
            line.finish(f"  {tag}: skipped: {why}")
            save()
            continue
        line.start(f"{tag}: calibration")
        try:
            cal = calibrate(cfg, os.path.join(scratch, f"{size_mb:g}-calibration"))
        except Exception as exc:  # noqa: BLE001 - reported: where the bench stopped
            why = f"the calibration job failed: {type(exc).__name__}: {str(exc)[:300]}"
            result["stopped_at"] = result["stopped_at"] or {"size_mb": size_mb, "why": why}
            result["rows"] += skipped_rows(info, scenarios, strategies, why, context)
            line.finish(f"  {tag}: {why}")
            save()
            continue
        info["steps"] = steps = steps_for(cal["warm_step"]) + (
            precopy_steps(cfg.model, cfg) if "precopy" in strategies else 0)
        result["calibrations"][f"{size_mb:g}"] = {**cal, "steps": steps}
        line.finish(f"  {tag}: {info['params'] / 1e6:.1f} M parameters, standby warm at step "
                    f"{cal['warm_step']}, normal step {cal['normal_step_s'] or 0:.3f} s: "
                    f"{steps} steps a job")
        runs = []
        for rep in range(repeats):
            for scenario in scenarios:
                for strategy in strategies:
                    if scenario != "planned" and strategy != "stop_and_copy":
                        continue     # a recovery is the same with either strategy
                    line.start(f"{tag}, {scenario}, {strategy}, round {rep + 1}")
                    run_dir = os.path.join(scratch, f"{size_mb:g}-{scenario}-{strategy}-r{rep}")
                    t0 = time.perf_counter()
                    try:
                        res = measure(strategy, scenario, cfg, steps, run_dir)
                    except Exception as exc:  # noqa: BLE001
                        # one failed run is a result too, not the end of the others
                        res = {"downtime_s": None,
                               "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
                    res.update(size_mb=size_mb, scenario=scenario, strategy=strategy,
                               repeat=rep, bench_wall_s=time.perf_counter() - t0)
                    runs.append(res)
                    result["runs"].append(res)
                    line.finish(f"  {tag} round {rep + 1}/{repeats} {scenario:>7} {strategy}: "
                                + (f"FAILED: {res['error']}" if "error" in res else
                                   downtime_value(res["downtime_s"],
                                                  res.get("downtime_noise_s"))))
                    save()
        line.start(f"{tag}: uninterrupted run")
        try:
            base = uninterrupted(cfg, steps, os.path.join(scratch, f"{size_mb:g}-uninterrupted"))
        except Exception as exc:  # noqa: BLE001 - the rows then say "-"
            base = {"weights_sha256": None, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        result["baselines"][f"{size_mb:g}"] = base
        line.finish(f"  {tag}: uninterrupted run: weights "
                    f"{(base.get('weights_sha256') or 'none')[:12]}")
        measured = _values([r for r in runs if "error" not in r], "state_bytes")
        p2p = None
        if measured:
            nbytes = int(statistics.median(measured))
            line.start(f"{tag}: point-to-point bandwidth")
            try:
                p2p = {"bytes": nbytes,
                       "seconds": p2p_seconds(nbytes, repeats=5 if nbytes < 10**9 else 3,
                                              timeout_s=600.0)}
            except Exception as exc:  # noqa: BLE001 - the rows then say "-"
                result.setdefault("p2p_errors", {})[f"{size_mb:g}"] = str(exc)[:300]
            line.finish(f"  {tag}: point-to-point: " + (
                f"{nbytes / 1e6:.1f} MB in {p2p['seconds']:.4f} s" if p2p else "failed"))
        result["rows"] += size_rows(info, runs, base.get("weights_sha256"), p2p, context)
        save()
    line.close()
    save()
    return result


# --- the table ------------------------------------------------------------------------------------

def _mb(v) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


def _f(s: dict | None, digits: int = 3) -> str:
    return fmt_spread(s, digits)


def _rss(peak: dict | None) -> str:
    peak = peak or {}
    return " / ".join("-" if peak.get(k) is None else f"{peak[k]:.0f}"
                      for k in ("leaver", "joiner", "stayers"))


def state_size_table(r: dict) -> str:
    m = r["machine"]
    lines = [f"# bench state-size: downtime against the state a worker holds "
             f"({r['layout']}, {r['repeats']} repeats, median (min-max))", "",
             f"command: `{r.get('command') or 'trainmover bench state-size'}`; commit "
             f"{r.get('commit')}; machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}"
             + (f"; took {r['wall_s'] / 60:.1f} min" if r.get("wall_s") else ""), "",
             "| state (MB, measured) | model | scenario | strategy | downtime (s) | over "
             "stop-and-copy | weights equal | MB at switch / before | point-to-point (s, "
             "GB/s) | downtime / point-to-point | leaver transfer (s) | joiner receive (s) | "
             "pre-copy: joiner at the switch (s) / waited for it | "
             "stayer step in phase 1 / normal | peak RSS MiB leaver / joiner / stayer | "
             "runs (failed) |", "|" + "---|" * 16]
    for row in r["rows"]:
        mod = row["model"]
        model = f"d{mod['d_model']} x {mod['n_layers']} ({row['params'] / 1e6:.1f} M)"
        state = (f"{_mb(row['state_bytes'])}" if row.get("state_bytes")
                 else f"~{_mb(row['predicted_state_bytes'])}")
        head = f"| {state} | {model} | {row['scenario']} | {row['strategy']} |"
        if row.get("skipped") or not row.get("downtime_s"):
            why = row.get("skipped") or "; ".join(row.get("errors") or []) or "no result"
            lines.append(head + f" not measured: {why} |" + " |" * 10 +
                         f" {row['runs']} ({row['failed']}) |")
            continue
        noisy = row.get("within_noise")
        down = (downtime_value(row["downtime_s"]["median"], row.get("downtime_noise_s"))
                if noisy else _f(row["downtime_s"]))
        over = row.get("downtime_over_stop_and_copy")
        over = (f"{over:.2f}" if isinstance(over, float) else _f(over, 2) if over else "-")
        weights = {True: "yes", False: "NO", None: "-"}[row.get("weights_equal")]
        if row.get("weights_compared"):
            weights += f" ({row['weights_compared']})"
        p2p = (f"{row['p2p_s']:.3f} ({row['p2p_gb_per_s']:.2f})" if row.get("p2p_s") else "-")
        ratio = ("within noise" if noisy else _f(row.get("downtime_over_p2p"), 1))
        phase1 = _f(row.get("phase1_step_ratio"), 2)
        switch = (f"{_f(row.get('joiner_switch_recv_s'))} / {_f(row.get('precopy_slack_s'))}"
                  if row.get("joiner_switch_recv_s") else "-")
        lines.append(head + f" {down} | {over} | {weights} | "
                     f"{_mb(row.get('switch_bytes'))} / {_mb(row.get('pre_switch_bytes'))} | "
                     f"{p2p} | {ratio} | {_f(row.get('transfer_s'))} | "
                     f"{_f(row.get('joiner_recv_s'))} | {switch} | {phase1} | "
                     f"{_rss(row.get('peak_rss_mb'))} | {row['runs']} ({row['failed']}) |")
    lines += ["", "How to read it: state is the bytes the leaver sent (planned) or the "
              "replica sent the joiner (crash), measured; the model is width x depth "
              f"(vocabulary {VOCAB}, sequence {SEQ_LEN}, MLP ratio {MLP_RATIO}, one sequence "
              "per replica and step, eager). A planned downtime is the slowest stayer's stall "
              "(core/accounting.py), a crash's runs from the SIGKILL to the first step "
              "committed after it (detection included). Point-to-point: the same bytes as one "
              "buffer over a gloo pair on this machine, after the jobs (round trip with a "
              "one-byte acknowledgement). The joiner's receive time runs from its receive "
              "call, made once it is ready, so it includes waiting for the leaver to reach the "
              "switch boundary (with pre-copy: the whole background phase); a recovery "
              "reports neither side's transfer time. Pre-copy, the joiner at the switch: its "
              "receive from the leaver's switch header to the state complete, and how long it "
              "had waited for that header after replaying the last step (positive: the "
              "replay was off the switch's critical path). Phase 1: "
              "the stayer's own step times from the request to the switch over its normal "
              "steps before. Peak RSS: VmHWM sampled every "
              f"{RSS_POLL_S:g} s (stayer: the largest of the stayers; crash: the crashed "
              "worker as leaver). Weights equal: each run's final weights sha256 against the "
              "same job run uninterrupted for the same steps (equal / compared)."]
    cal = r.get("calibrations") or {}
    if cal:
        lines += ["", "Per size: the calibration (standby warm at step; normal step) and the "
                  "steps every measured job trains:", ""]
        lines += [f"- {k} MB: warm at step {c['warm_step']}, normal step "
                  f"{(c.get('normal_step_s') or 0):.3f} s, {c['steps']} steps a job"
                  for k, c in cal.items()]
    if r.get("stopped_at"):
        s = r["stopped_at"]
        lines += ["", f"Stopped at {s['size_mb']:g} MB: {s['why']}"]
    return "\n".join(lines) + "\n"
