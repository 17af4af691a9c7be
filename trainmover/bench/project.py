"""``trainmover project``: what the costs measured here mean for a job of 1K to 128K GPUs.

A model, not a measurement: it takes the per-event costs measured by ``trainmover bench
downtime`` (detection, the group switch and first step, a cold joiner's start, a planned
migration) and cluster parameters (failure rate, checkpoint interval and write time, the
restart overhead, standby pool), and reports the effective training time ratio (ETTR: the
share of wall time spent on training that is kept) and the GPU-hours lost per week.

Checkpoint-restart (Kokolis et al., "Revisiting reliability in large-scale machine learning
research clusters", HPCA '25): with ``N`` hosts failing at ``r`` per host-hour, restart
overhead ``u0``, checkpoint interval ``dt`` and blocking write time ``w``,

    ETTR = (1 - N*r*(u0 + dt/2)) / (1 + w/dt)

(a failure loses half an interval of work on average, plus the restart). Planned events
(maintenance, a slow host taken out) cost a restart too, without lost work: a checkpoint is
taken just before.

trainmover: an unplanned event costs detection + the state transfer (the role's state over
one link) + the group switch and first step + half a step in flight redone; a planned one
its measured migration downtime. Either needs a free standby. The pool (``S`` standby
hosts, each used one replaced after ``T`` hours) is an Erlang loss system: an event finds
no free standby with probability ``ErlangB(S, lambda*T)``, and then a cold replacement
process joins (the measured cold-join cost added). The same checkpoint overhead ``w/dt`` is
charged (a job keeps checkpoints for what no standby can fix). The standby hosts' GPUs are
idle capacity, reported beside the loss rather than hidden in it.

The control plane (``--control``, a ``trainmover bench control`` result; bench/scaling.py):
its per-step overhead ``v(N)`` and crash control path ``c(N)`` are fitted against the number
of workers. trainmover's ETTR is then multiplied by ``step / (step + v(N))`` (every step
pays the vote), each failure costs ``c(N) - c(n)`` more than measured at the ``n`` workers of
the per-event costs, and where the fitted CPU share of the root store or the controller (one
thread each) reaches a whole core the row is out of range. Rows beyond the largest size the
control plane was measured at are marked with how far the fit extrapolates. Without
``--control`` the control plane is counted at its small-job cost, and the table says so.
With ``--vote-hosts`` (a ``benchmarks/vote_hosts.py`` result, or ``vote_groups.py``'s: the
vote through vote groups) one more column charges each step only the vote measured alone,
at up to 12,500 hosts, instead of the simulator's whole step overhead: the simulator runs every host on this machine's two
cores and is an upper bound, this the other bound (each host's own part of the vote, a
channel hop and a thread, left out as if free).

All of it is first order in the event rate: where ``N*r*cost`` reaches 1 the job cannot
make progress and the ETTR is shown as 0. Torch-free (it only reads result files).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field

from trainmover.bench.report import git_commit, read_result
from trainmover.bench.scaling import ControlScaling, fit_words
from trainmover.core.accounting import downtime_value, fmt_seconds, within_noise

HOURS_PER_WEEK = 168.0

# TrainMover (OSDI '26) measured 11.5-21 s per event at up to 1,024 GPUs: the upper figure
# is the at-scale cost shown beside ours (one host here cannot measure NCCL set-up at scale)
PAPER_EVENT_S = 21.0


@dataclass
class Cluster:
    """Cluster parameters. Defaults: Meta's RSC-1 failure rate (6.50 per 1,000 node-days;
    RSC-2 had 2.34), the low end of its 5-20 min restart overhead; the rest are stated
    assumptions, to be set from one's own cluster."""
    gpus: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536, 131072])
    gpus_per_host: int = 8
    failures_per_1000_node_days: float = 6.50
    planned_per_unplanned: float = 1.0      # maintenance / slow-host events per failure
    checkpoint_every_min: float = 30.0
    checkpoint_write_s: float = 10.0        # the blocking part of a checkpoint
    restart_overhead_min: float = 5.0       # detection, rescheduling, start-up, reload
    standby_share: float = 0.01             # standby hosts per training host (at least 1)
    standby_replace_min: float = 60.0       # bringing a fresh standby into the pool
    state_gb_per_gpu: float = 17.5          # 70B params x 16 B (mixed-precision Adam) / 64
    link_gb_per_s: float = 50.0             # one 400 Gb/s NIC
    step_s: float = 5.0                     # a step of a large job (half is redone)

    def validate(self) -> None:
        if not self.gpus:
            raise ValueError("--gpus: give at least one cluster size")
        for n in self.gpus:
            if n < self.gpus_per_host or n % self.gpus_per_host:
                raise ValueError(f"--gpus {n}: must be a multiple of --gpus-per-host "
                                 f"{self.gpus_per_host}")
        positive = {"--gpus-per-host": self.gpus_per_host,
                    "--checkpoint-every-min": self.checkpoint_every_min,
                    "--link-gb-per-s": self.link_gb_per_s}
        for flag, v in positive.items():
            if not v > 0:
                raise ValueError(f"{flag} {v}: must be > 0")
        non_negative = {"--failures-per-1000-node-days": self.failures_per_1000_node_days,
                        "--planned-per-unplanned": self.planned_per_unplanned,
                        "--checkpoint-write-s": self.checkpoint_write_s,
                        "--restart-overhead-min": self.restart_overhead_min,
                        "--standby-share": self.standby_share,
                        "--standby-replace-min": self.standby_replace_min,
                        "--state-gb-per-gpu": self.state_gb_per_gpu, "--step-s": self.step_s}
        for flag, v in non_negative.items():
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{flag} {v}: must be a finite number >= 0")


@dataclass
class EventCosts:
    """trainmover's per-event costs in seconds, from ``bench downtime`` results."""
    detect_s: float            # failure to detection (the heartbeat-bound path: a hang)
    switch_s: float            # collect + rebuild the groups + first step, after detection
    planned_s: float           # a planned migration's downtime (never below 0: see below)
    cold_join_s: float         # a joiner started cold (no standby ready): naive migration
    restart_here_s: float | None = None     # a restart of the bench job on this machine
    source: dict = field(default_factory=dict)
    # the planned migrations' step noise, where measured: a median downtime inside it is no
    # measurable stall (core/accounting.py), and the noise stands in as its cost (an upper
    # bound), never the measured number (which may be below zero)
    planned_noise_s: float | None = None
    planned_measured_s: float | None = None


def restart_ettr(hosts: int, failures_per_host_h: float, u0_h: float, dt_h: float,
                 w_h: float, planned_per_h: float = 0.0) -> float:
    """Checkpoint-restart (module doc), before clamping."""
    lost = hosts * failures_per_host_h * (u0_h + dt_h / 2) + planned_per_h * (u0_h + w_h)
    return (1.0 - lost) / (1.0 + w_h / dt_h)


def erlang_b(servers: int, load: float) -> float:
    """Probability that an arrival finds all ``servers`` busy (Erlang's loss formula), for an
    offered ``load`` = arrival rate x holding time."""
    if servers < 0 or load < 0:
        raise ValueError(f"erlang_b({servers}, {load}): both must be >= 0")
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


@dataclass
class Projection:
    gpus: int
    hosts: int
    standby_hosts: int
    unplanned_per_h: float
    planned_per_h: float
    no_standby_p: float              # an event finds the standby pool empty
    ettr: dict                       # strategy -> ETTR (clamped to [0, 1])
    out_of_range: list               # strategies whose first-order loss reached 1
    wasted_gpu_h_per_week: dict      # strategy -> GPU-hours lost per week
    standby_gpu_h_per_week: float    # idle standby capacity
    # the control plane at this size, where fitted (--control): step overhead (s), the
    # crash control path's growth over the measured per-event cost (s), how far beyond the
    # largest measured size (None: inside), the components saturated
    control: dict | None = None


STRATEGIES = ("restart", "trainmover", "trainmover_no_standby", "trainmover_paper_cost")
# with --control: trainmover's figure as it would be if the control plane cost what it
# costs at the small jobs the per-event costs were measured at
FLAT = "trainmover_flat_control"
# with --vote-hosts: each step charged the vote measured alone (the store's share of it, or
# the whole vote through vote groups)
STORE_VOTE = "trainmover_store_vote"
LABELS = {"restart": "checkpoint-restart",
          "trainmover": "trainmover (costs measured here)",
          FLAT: "trainmover, control plane at its small-job cost",
          STORE_VOTE: "trainmover, each step charged the vote measured alone",
          "trainmover_no_standby": "trainmover, no free standby (every event joins cold)",
          "trainmover_paper_cost": f"trainmover at {PAPER_EVENT_S:.0f} s per event (paper, "
                                   f"1,024 GPUs)"}


def strategies(control: ControlScaling | None) -> tuple[str, ...]:
    if control is None:
        return STRATEGIES
    return STRATEGIES + (FLAT,) + ((STORE_VOTE,) if control.store_vote_s is not None else ())


def project(cluster: Cluster, costs: EventCosts,
            control: ControlScaling | None = None) -> list[Projection]:
    cluster.validate()
    dt_h = cluster.checkpoint_every_min / 60
    w_h = cluster.checkpoint_write_s / 3600
    u0_h = cluster.restart_overhead_min / 60
    per_host_h = cluster.failures_per_1000_node_days / 1000 / 24
    transfer_s = cluster.state_gb_per_gpu / cluster.link_gb_per_s
    unplanned_s = costs.detect_s + transfer_s + costs.switch_s + cluster.step_s / 2
    out = []
    for gpus in cluster.gpus:
        hosts = gpus // cluster.gpus_per_host
        lam_u = hosts * per_host_h
        lam_p = lam_u * cluster.planned_per_unplanned
        standbys = max(1, math.ceil(hosts * cluster.standby_share))
        blocked = erlang_b(standbys, (lam_u + lam_p) * cluster.standby_replace_min / 60)
        cold = costs.cold_join_s

        def tm(u_s: float, p_s: float, blocked_p: float) -> float:
            lost_h = (lam_u * (u_s + blocked_p * cold) + lam_p * (p_s + blocked_p * cold)) / 3600
            return (1.0 - lost_h) / (1.0 + w_h / dt_h)

        raw = {"restart": restart_ettr(hosts, per_host_h, u0_h, dt_h, w_h, lam_p),
               "trainmover": tm(unplanned_s, costs.planned_s, blocked),
               "trainmover_no_standby": tm(unplanned_s, costs.planned_s, 1.0),
               "trainmover_paper_cost": tm(PAPER_EVENT_S, PAPER_EVENT_S, blocked)}
        at_scale = None
        if control is not None:
            raw[FLAT] = raw["trainmover"]
            at_scale = _control_at(control, gpus, costs, cluster.step_s)
            extra, keep = at_scale["crash_control_extra_s"], at_scale["step_kept"]
            raw["trainmover"] = tm(unplanned_s + extra, costs.planned_s, blocked) * keep
            raw["trainmover_no_standby"] = tm(unplanned_s + extra, costs.planned_s, 1.0) * keep
            if control.store_vote_s is not None:
                raw[STORE_VOTE] = tm(unplanned_s + extra, costs.planned_s, blocked) * \
                    at_scale["store_vote_kept"]
        saturated = at_scale["saturated"] if at_scale else []
        out_of_range = [k for k, v in raw.items() if v <= 0.0 or
                        (saturated and k in ("trainmover", "trainmover_no_standby"))]
        ettr = {k: 0.0 if k in out_of_range else min(1.0, v) for k, v in raw.items()}
        out.append(Projection(
            gpus=gpus, hosts=hosts, standby_hosts=standbys, unplanned_per_h=lam_u,
            planned_per_h=lam_p, no_standby_p=blocked, ettr=ettr,
            out_of_range=out_of_range,
            wasted_gpu_h_per_week={k: gpus * HOURS_PER_WEEK * (1 - v) for k, v in ettr.items()},
            standby_gpu_h_per_week=standbys * cluster.gpus_per_host * HOURS_PER_WEEK,
            control=at_scale))
    return out


def _control_at(control: ControlScaling, gpus: int, costs: EventCosts,
                step_s: float) -> dict:
    """The control plane's fitted costs at ``gpus`` workers (one per GPU)."""
    overhead = control.step_overhead_s(gpus)
    # the per-event costs already hold the control path of the job they were measured on
    measured_at = costs.source.get("workers", {}).get("switch") or control.crash_control_s.n_min
    extra = max(0.0, control.crash_control_s(gpus) - control.crash_control_s(measured_at))
    out = {"step_overhead_s": overhead,
           "step_kept": step_s / (step_s + overhead) if step_s + overhead > 0 else 1.0,
           "crash_control_extra_s": extra, "crash_measured_at": measured_at,
           "extrapolated_x": control.beyond(gpus), "saturated": control.saturated(gpus)}
    fit = control.store_vote_s
    if fit is not None:
        vote = fit(gpus)
        out.update(store_vote_s=vote, store_vote_kept=step_s / (step_s + vote),
                   store_vote_extrapolated_x=gpus / fit.n_max if gpus > fit.n_max else None)
    return out


def costs_from_bench(paths: list[str]) -> EventCosts:
    """Medians over the rows of ``bench downtime`` results (planned and failure scenarios;
    ``bench quick`` writes one too), at the largest worker count each was measured with.
    Needed: a planned migration and a crash recovery (trainmover). A cold join is the naive
    migration's downtime; a file without one (``bench quick``, the compiled results) uses a
    restart of the whole job here instead: an upper bound, said so in the projection.
    Raises ``ValueError`` naming what the files lack."""
    rows = []
    for path in paths:
        data = read_result(path, "--bench", "downtime")
        rows += [r for r in data.get("results", []) if r.get("downtime_s") is not None]

    def pick(scenario: str, strategy: str) -> list[dict]:
        mine = [r for r in rows if r["scenario"] == scenario and r["strategy"] == strategy]
        if not mine:
            return []
        most = max(r["workers"] for r in mine)
        return [r for r in mine if r["workers"] == most]

    def need(scenario: str, strategy: str, *instead: tuple[str, str]) -> list[dict]:
        for sc, st in ((scenario, strategy), *instead):
            if got := pick(sc, st):
                return got
        raise ValueError(f"--bench {', '.join(paths)}: no {scenario} result for {strategy}"
                         + "".join(f" nor {sc} for {st}" for sc, st in instead) +
                         " (run `trainmover bench downtime` or `bench quick` with it)")

    def median(rs: list[dict], fn) -> float:
        return statistics.median(fn(r) for r in rs)

    hang, crash = pick("hang", "trainmover"), need("crash", "trainmover")
    planned_rows = need("planned", "trainmover")
    measured = median(planned_rows, lambda r: r["downtime_s"])
    noises = [r["downtime_noise_s"] for r in planned_rows
              if isinstance(r.get("downtime_noise_s"), (int, float))]
    noise = statistics.median(noises) if noises else None
    planned_s = (noise or 0.0) if within_noise(measured, noise) else measured
    detect_rows = hang or crash
    planned = planned_rows
    naive = need("planned", "naive", ("planned", "restart"), ("crash", "restart"))
    restart = pick("crash", "restart") or pick("planned", "restart")
    return EventCosts(
        detect_s=median(detect_rows, lambda r: r["phases"]["detect_s"]),
        switch_s=median(crash, lambda r: r["phases"]["collect_s"] +
                        r["phases"]["rebuild_and_first_step_s"]),
        planned_s=planned_s, planned_noise_s=noise, planned_measured_s=measured,
        cold_join_s=median(naive, lambda r: r["downtime_s"]),
        restart_here_s=median(restart, lambda r: r["downtime_s"]) if restart else None,
        source={"files": list(paths), "workers": {
            "detect": detect_rows[0]["workers"], "switch": crash[0]["workers"],
            "planned": planned[0]["workers"], "cold_join": naive[0]["workers"]},
            "detect_from": "hang" if hang else "crash",
            "cold_join_from": f"{naive[0]['scenario']} {naive[0]['strategy']}",
            "restart_from": f"{restart[0]['scenario']} restart" if restart else None,
            "repeats": {"detect": len(detect_rows), "switch": len(crash),
                        "planned": len(planned), "cold_join": len(naive)}})


def write_projection(cluster: Cluster, costs: EventCosts, out_dir: str,
                     name: str = "projection", control: ControlScaling | None = None) -> dict:
    rows = project(cluster, costs, control)
    result = {"benchmark": "projection", "commit": git_commit(),
              "cluster": asdict(cluster), "costs": asdict(costs),
              "control": asdict(control) if control is not None else None,
              "strategies": list(strategies(control)),
              "transfer_s": cluster.state_gb_per_gpu / cluster.link_gb_per_s,
              "rows": [asdict(r) for r in rows]}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    table = _table(result)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table)
    result["plot"] = _plot(result, os.path.join(out_dir, f"{name}.png"))
    print(table)
    return result


def _table(r: dict) -> str:
    c, k = r["cluster"], r["costs"]
    # a result written before --control has neither
    strats, fitted = r.get("strategies", STRATEGIES), r.get("control") is not None
    lines = [
        "# Projection to cluster scale (a model, from measured per-event costs)", "",
        f"commit {r['commit']}; `trainmover project` (module doc of trainmover/bench/"
        f"project.py: the model and its assumptions).", "",
        f"Per-event costs measured here (`trainmover bench downtime`, medians, "
        f"files {', '.join(k['source'].get('files', []))}): detection {k['detect_s']:.2f} s "
        f"({k['source'].get('detect_from', '?')} path), group switch and first step "
        f"{k['switch_s']:.2f} s, planned migration {_planned(k)}, cold join "
        f"{k['cold_join_s']:.1f} s" + _cold_join_note(k["source"]) +
        (f"; a restart of the same job here {k['restart_here_s']:.1f} s" if k["restart_here_s"]
         else "") + ".",
        f"Cluster: {c['gpus_per_host']} GPUs per host, {c['failures_per_1000_node_days']} "
        f"failures per 1,000 node-days, {c['planned_per_unplanned']} planned events per "
        f"failure, checkpoint every {c['checkpoint_every_min']:g} min "
        f"({c['checkpoint_write_s']:g} s blocking), restart overhead "
        f"{c['restart_overhead_min']:g} min, standby hosts {c['standby_share']:.1%} of the "
        f"job's (at least 1), replaced after {c['standby_replace_min']:g} min; state "
        f"{c['state_gb_per_gpu']:g} GB per GPU over {c['link_gb_per_s']:g} GB/s "
        f"({r['transfer_s']:.2f} s), half of a {c['step_s']:g} s step redone per failure.", "",
        *_control_words(r), "",
        "| GPUs | events / h (unplanned + planned) | no free standby | " +
        " | ".join(f"ETTR {LABELS[s]}" for s in strats) +
        " | GPU-h lost / week: restart | trainmover | idle standby GPU-h / week |" +
        (" control plane at this size |" if fitted else ""),
        "|---|---|---|" + "---|" * len(strats) + "---|---|---|" + ("---|" if fitted else "")]
    for row in r["rows"]:
        cells = []
        for s in strats:
            v = row["ettr"][s]
            cells.append(f"{v:.4f}" + (" (out of range)" if s in row["out_of_range"] else ""))
        lost = row["wasted_gpu_h_per_week"]
        lines.append(
            f"| {row['gpus']:,} | {row['unplanned_per_h']:.2f} + {row['planned_per_h']:.2f} | "
            f"{row['no_standby_p']:.1%} | " + " | ".join(cells) +
            f" | {lost['restart']:,.0f} | {lost['trainmover']:,.0f} | "
            f"{row['standby_gpu_h_per_week']:,.0f} |" +
            (f" {_control_cell(row['control'])} |" if fitted else ""))
    lines += ["", "First order in the event rate; \"out of range\": the model's loss reached "
              "the whole of the time (the job would not make progress)" +
              (", or a single-threaded part of the control plane is past a whole core"
               if fitted else "") + "; shown as 0. The idle standby GPUs are capacity "
              "held back, not counted in the loss."]
    return "\n".join(lines) + "\n"


def _control_words(r: dict) -> list[str]:
    k = r.get("control")
    if k is None:
        return ["The control plane is counted at its cost in the small jobs above, whatever "
                "the size: no vote overhead per step, no growth of the recovery's control "
                "path with N. An upper bound on ETTR at scale; give `--control` (a `trainmover "
                "bench control` result) to count them."]
    src = k["source"]
    step = ("its mean" if k["step_overhead_from"] == "mean" else
            "its median: the result predates the mean, which a long tail puts higher")
    lines = [f"Control plane (`trainmover bench control`, {src.get('file')}, commit "
             f"{src.get('commit')}, per-size medians over {src.get('repeats')} repeats; fits "
             f"y = a x N^b, bench/scaling.py):",
             f"- step overhead (the control plane's time per step, {step}; charged on every "
             f"step): "
             + fit_words(k["step_overhead_s"], "ms", 1000, 1) + ";",
             f"- crash to all survivors resumed (its growth over the per-event costs' "
             f"{r['rows'][0]['control']['crash_measured_at']} workers "
             f"added to each failure): " + fit_words(k["crash_control_s"], "s") + ";"]
    for key, what in (("store_cpu", "root store"), ("controller_cpu", "controller")):
        if k[key]:
            lines.append(f"- {what} CPU share (one thread; at 1 it is saturated and the row "
                         f"is out of range): " + fit_words(k[key], "core(s)") + ";")
    if src.get("cores") and src.get("sim_cpu_share"):
        n, sim = src["sim_cpu_share"][-1]
        lines.append(f"- measured on {src['cores']} cores that run the store, the controller and "
                     f"every simulated host at once (the simulator's own CPU {sim:.2f} cores at "
                     f"{n:,} workers): the hosts' work competes with the store and the "
                     f"controller, so the fits are upper bounds on the same code with a CPU "
                     f"per host;")
    lines.append(f"- measured up to {max(p[0] for p in k['step_overhead_s']['points']):,} "
                 f"workers: larger sizes are extrapolated (marked in the last column); the "
                 f"planned migration's control path is not simulated, so its growth is not "
                 f"counted.")
    if k.get("store_vote_s"):
        v = k["store_vote_source"]
        what = ("a step's vote through vote groups (`benchmarks/vote_groups.py`, one group "
                "real, the others' leaders at the job's store" if
                v.get("benchmark") == "vote_groups" else
                "the store's share of a step's vote (`benchmarks/vote_hosts.py`")
        lines.append(
            f"- {what}, {v['file']}, "
            f"commit {v['commit']}, {', '.join(f'{h:,}' for h in v['hosts'])} hosts of "
            f"{v['voters_per_host']} workers, every vote sent at once, to every host "
            f"holding the decision): " + fit_words(k["store_vote_s"], "ms", 1000, 1) +
            "; its column charges each step that alone (the crash path as above): the "
            "simulator's step overhead is one bound, this the other.")
    return lines


def _control_cell(c: dict) -> str:
    words = (f"{1000 * c['step_overhead_s']:.0f} ms/step, +{c['crash_control_extra_s']:.1f} s "
             f"per failure")
    if c["extrapolated_x"]:
        words += f"; extrapolated x{c['extrapolated_x']:.0f}"
    if c["saturated"]:
        words += f"; {' and '.join(c['saturated'])} saturated"
    if c.get("store_vote_s") is not None:
        words += f"; the vote alone {1000 * c['store_vote_s']:.0f} ms/step"
        if c.get("store_vote_extrapolated_x"):
            words += f" (extrapolated x{c['store_vote_extrapolated_x']:.1f})"
    return words


def _planned(k: dict) -> str:
    """The planned migration's cost as every place words a downtime (core/accounting.py)."""
    measured = k.get("planned_measured_s")
    if measured is None or not within_noise(measured, k.get("planned_noise_s")):
        return fmt_seconds(k["planned_s"])
    words = downtime_value(measured, k.get("planned_noise_s"))     # "...(within ...)"
    return words[:-1] + f"; counted as {fmt_seconds(k['planned_s'])}, an upper bound)"


def _cold_join_note(source: dict) -> str:
    """Where the cold join's cost came from, when it is not a naive migration's."""
    came = source.get("cold_join_from", "planned naive")
    if came == "planned naive":
        return ""
    return (f" (no naive migration in the files: the {came} of the whole job stands in, an "
            f"upper bound, so the \"no free standby\" column is pessimistic)")


def _plot(r: dict, path: str) -> str | None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None   # the table is the result; the image needs the report extra
    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.add_subplot()
    gpus = [row["gpus"] for row in r["rows"]]
    for s in r.get("strategies", STRATEGIES):
        ax.plot(gpus, [row["ettr"][s] for row in r["rows"]], marker="o", label=LABELS[s])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("ETTR")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    return path
