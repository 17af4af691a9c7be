"""The controller's ``status.json``: what it holds, how a reader judges it fresh, and how it
tells a live process from a dead one. No job is run: the state is built as the controller's
snapshot holds it."""
import dataclasses
import json
import os
import time
from types import SimpleNamespace as NS

from trainmover.control.processes import ProcView
from trainmover.control.status import (STATUS_MAX_INTERVAL_S, read_status_file,
                                       status_from_state, status_perf, write_status_file)
from trainmover.core import protocol as P

DEAD_PID = 2 ** 22 + 1          # above the kernel's pid_max default: no such process


def _state(pids: dict[str, int | None], codes: dict[str, int | None] | None = None) -> dict:
    codes = codes or {}
    procs = NS(procs={w: ProcView(False, 1, i % 2, pid, codes.get(w))
                      for i, (w, pid) in enumerate(pids.items())})
    workers = {w: NS(name=f"dp{i}.pp0.tp0") for i, w in enumerate(pids)}
    return {"ctx": {"procs": procs, "membership": NS(workers=workers, standbys={}),
                    "committed": 7, "epoch": 1},
            "migrations": {"active": None, "finished": []},
            "recovery": {"active": None, "done": []}}


def _perf() -> P.StepPerf:
    return P.StepPerf(role="dp0.pp0.tp0", first_step=1, last_step=10, tenure_start=0,
                      step_s=0.2, compute_s=0.19, wait_s={"dp": 0.01}, load1=1.0, steal=0.0,
                      recent=[P.PerfWindow(1, 5, 0.18), P.PerfWindow(6, 10, 0.19)])


def test_the_controller_judges_liveness_by_its_records_on_every_host(tmp_path):
    """A PID of another host means nothing here: the controller shows a process alive while
    the agents' records say it runs; read back from the store, the PID is also probed."""
    state = _state({"w0": os.getpid(), "w1": DEAD_PID, "w2": os.getpid(), "w3": None},
                   codes={"w2": 9})
    mine = {w.name: w.alive for w in status_from_state(state, {}, 1, recorded=True).workers}
    assert mine == {"w0": True, "w1": True, "w2": False, "w3": False}
    probed = {w.name: w.alive for w in status_from_state(state, {}, 1).workers}
    assert probed == {"w0": True, "w1": False, "w2": False, "w3": False}


def test_the_file_holds_each_workers_newest_window_and_round_trips(tmp_path):
    run_dir = str(tmp_path)
    perf = {"w0": status_perf(_perf())}
    st = status_from_state(_state({"w0": os.getpid()}), perf, os.getpid(), 12,
                           source="controller", recorded=True)
    st.interval_s = 1.0
    write_status_file(run_dir, st)
    with open(os.path.join(run_dir, "status.json")) as f:
        raw = json.load(f)
    # every field of the newest window, none of the history kept for the straggler detector
    whole = dataclasses.asdict(_perf())
    assert raw["workers"][0]["perf"] == {k: v for k, v in whole.items() if k != "recent"}
    assert whole["recent"] and raw["workers"][0]["perf"]["compute_s"] == 0.19
    back = read_status_file(run_dir, 3.0)
    assert back == st


def test_a_file_written_less_often_than_configured_stays_fresh_for_its_own_interval(tmp_path):
    """A controller of many workers writes status.json less often than
    controller.status_interval_s (its encoding is O(N)) and says how often: a reader waits
    three of those intervals before it calls the file stale."""
    run_dir = str(tmp_path)
    st = status_from_state(_state({"w0": os.getpid()}), {}, os.getpid(), recorded=True)
    st.as_of = time.time() - 10
    write_status_file(run_dir, st)
    assert read_status_file(run_dir, 3.0) is None           # configured interval 1 s
    st.interval_s = 5.0
    write_status_file(run_dir, st)
    assert read_status_file(run_dir, 3.0) == st             # 10 s < 3 x 5 s
    st.as_of = time.time() - 20
    write_status_file(run_dir, st)
    assert read_status_file(run_dir, 3.0) is None
    # whatever interval a file claims, it is stale after 3 x STATUS_MAX_INTERVAL_S
    st.interval_s, st.as_of = 1e9, time.time() - 3 * STATUS_MAX_INTERVAL_S - 1
    write_status_file(run_dir, st)
    assert read_status_file(run_dir, 3.0) is None
