"""Suite-wide settings.

Property tests draw the same examples on every run (``derandomize``), so a CI run
cannot fail by the luck of the draw; ``HYPOTHESIS_PROFILE=explore`` draws fresh
random examples (more of them) to hunt for new failures locally."""
import os

import pytest
from hypothesis import settings

settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def pytest_runtest_logreport(report):
    """With ``TRAINMOVER_TEST_TIMES=FILE``, each test's outcome and seconds (set-up, call and
    tear-down summed per phase) are appended to FILE as they finish: a run cut short still
    says where the suite spends its time (``make test`` budgets, the ``slow`` marks)."""
    path = os.environ.get("TRAINMOVER_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")


# --- uninterrupted runs shared by the whole session --------------------------------------

# The sections of a job's config that decide its final weights; the rest (standbys, health,
# recovery, stragglers, timeouts, the controller's and agent's settings) may change when and
# where the work runs, never its result: the very claim the tests comparing a run with faults
# to its uninterrupted run check.
_RESULT_SECTIONS = ("layout", "model", "train", "data", "baseline")
_RESULT_FIELDS = {"process": ("command", "device", "deterministic"),
                  "comm": ("backend", "torch_groups")}


def result_key(cfg) -> str:
    import json

    d = cfg.to_dict()
    assert not d["faults"], "a reference run has no faults"
    key = {s: d[s] for s in _RESULT_SECTIONS}
    key.update({s: {f: d[s][f] for f in fields} for s, fields in _RESULT_FIELDS.items()})
    return json.dumps(key, sort_keys=True)


@pytest.fixture(scope="session")
def reference_weights(tmp_path_factory):
    """``reference_weights(cfg)``: ``weights_sha256`` of the built-in trainer's uninterrupted
    run of ``cfg``, run once per session for every config with the same result sections
    (test modules comparing against the same job no longer each run it)."""
    from trainmover.control.coordinator import run_job

    cache: dict[str, str] = {}

    def get(cfg) -> str:
        key = result_key(cfg)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp("reference") / "run"
            cache[key] = run_job(cfg, str(run_dir), quiet=True,
                                 timeout_s=300)["weights_sha256"]
        return cache[key]

    return get


# --- what a failed job test left behind ----------------------------------------------------

# Events worth seeing when a job test fails: what went wrong and what the controller decided.
_DIAGNOSTIC_EVENTS = {"failure_detected", "failure_during_recovery", "step_failed",
                      "recovery_planned", "recovery_done", "recovery_abandoned",
                      "fault_injected", "fenced", "job_failed", "failure_after_last_step",
                      "host_lost", "standby_died", "straggler_detected"}
_DIAGNOSTIC_LINES = 60


def _diagnostics(tmp_path) -> str:
    """The failure-related events of every run dir under ``tmp_path`` and the last lines of
    each worker log that holds a traceback: a CI failure that cannot be reproduced locally
    (load, timing) must say from its output alone which process failed and how."""
    import json
    from pathlib import Path

    out = []
    for events in sorted(Path(tmp_path).rglob("events.jsonl"))[:4]:
        out.append(f"== {events}")
        kept = []
        with open(events, errors="replace") as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("event") in _DIAGNOSTIC_EVENTS or e.get("level") in ("error",
                                                                                "warning"):
                    e.pop("stack", None)
                    kept.append(json.dumps(e)[:600])
        out += kept[-_DIAGNOSTIC_LINES:]
        for log in sorted((events.parent / "logs").glob("*.log")):
            text = log.read_text(errors="replace")
            if "Traceback" in text or "Error" in text:
                out.append(f"-- {log.name} (last lines)")
                out += text.splitlines()[-25:]
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and tmp_path is not None:
        try:
            text = _diagnostics(tmp_path)
        except OSError as exc:
            text = f"(no diagnostics: {exc})"
        if text:
            report.sections.append(("run dirs of the failed test", text))
