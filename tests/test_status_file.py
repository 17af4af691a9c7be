"""The controller's ``status.json``: what it holds, how a reader judges it fresh, and how it
tells a live process from a dead one. No job is run: the state is built as the controller's
snapshot holds it."""
import dataclasses
import json
import math
import os
import random
import time
from types import SimpleNamespace as NS

from trainmover.control.processes import ProcView
from trainmover.control.status import status_from_state, status_perf
from trainmover.control.status_file import (STATUS_MAX_INTERVAL_S, read_status_file,
                                            status_columns, status_from_columns,
                                            write_status_file)
from trainmover.core import protocol as P
from trainmover.core.decisions import StandbyState

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
    data = status_columns(_state({"w0": os.getpid()}), perf, os.getpid(), 12,
                          source="controller", recorded=True)
    data["interval_s"] = 1.0
    write_status_file(run_dir, data)
    with open(os.path.join(run_dir, "status.json")) as f:
        raw = json.load(f)
    # columns: the times in whole microseconds, none of the history kept for the straggler
    # detector
    assert raw["workers"]["name"] == ["w0"] and raw["workers"]["perf"]["step_s"] == [200000]
    assert raw["workers"]["perf"]["wait_s"] == {"dp": [10000]}
    assert "recent" not in raw["workers"]["perf"]
    back = read_status_file(run_dir, 3.0)
    assert back == status_from_columns(data) and back.source == "controller"
    # every field of the newest window, as the worker's measurements said
    whole = dataclasses.asdict(_perf())
    assert whole["recent"] and back.workers[0].perf == \
        {k: v for k, v in whole.items() if k != "recent"}


def test_many_workers_round_trip_row_by_row(tmp_path):
    """Columns back to rows: each worker's own name, PID, host, role, liveness and
    measurements (some with none, some of another role, wait kinds differing), and the
    standbys' states."""
    rng = random.Random(5)
    n = 300
    state = _state({f"w{i}": os.getpid() if i % 7 else None for i in range(n)},
                   codes={"w3": 1})
    state["ctx"]["membership"].standbys = {"s0": StandbyState.WARM, "s1": StandbyState.COLD}
    state["ctx"]["procs"].procs["s0"] = ProcView(False, 1, 1, os.getpid(), None)
    perf, expected = {}, {}
    for i in range(n):
        w, role = f"w{i}", f"dp{i}.pp0.tp0"
        if i % 5 == 0:
            continue                       # nothing measured yet
        wait = {k: rng.randrange(10 ** 6) / 1e6 for k in ("dp", "tp", "pp_next")
                if rng.random() < 0.6}
        p = dataclasses.replace(_perf(), role=role if i % 11 else "dp9999.pp0.tp0",
                                last_step=i, step_s=rng.randrange(10 ** 7) / 1e6,
                                compute_s=rng.randrange(10 ** 7) / 1e6, wait_s=wait,
                                load1=rng.random(), steal=None)
        perf[w] = status_perf(p)
        if i % 11:                         # another role's measurements are not shown
            expected[w] = perf[w]
    data = status_columns(state, perf, os.getpid(), 3, source="controller", recorded=True)
    write_status_file(str(tmp_path), data)
    back = read_status_file(str(tmp_path), 3.0)
    assert [w.name for w in back.workers] == sorted(state["ctx"]["membership"].workers)
    for w in back.workers:
        view = state["ctx"]["procs"].procs[w.name]
        assert (w.pid, w.node, w.role) == (view.pid, view.node,
                                           state["ctx"]["membership"].workers[w.name].name)
        assert w.alive == (view.pid is not None and w.name != "w3")
        assert w.perf == expected.get(w.name), w.name
    assert [(s.name, s.state, s.alive) for s in back.standbys] == \
        [("s0", "warm", True), ("s1", "cold", False)]


def test_a_time_that_is_no_number_is_shown_unknown_and_another_layout_is_not_read(tmp_path):
    """A measurement the job cannot encode (NaN, infinite) does not stop the write; a file of
    another layout (an older version's) is not read: the store is."""
    run_dir = str(tmp_path)
    bad = status_perf(dataclasses.replace(_perf(), step_s=math.inf,
                                          wait_s={"dp": math.nan}))
    data = status_columns(_state({"w0": os.getpid()}), {"w0": bad}, os.getpid(),
                          recorded=True)
    write_status_file(run_dir, data)
    back = read_status_file(run_dir, 3.0)
    assert back.workers[0].perf["step_s"] is None and back.workers[0].perf["wait_s"] == {}
    assert back.workers[0].perf["compute_s"] == 0.19
    data["format"] = 1
    write_status_file(run_dir, data)
    assert read_status_file(run_dir, 3.0) is None
    with open(os.path.join(run_dir, "status.json"), "w") as f:   # rows, as before
        json.dump({**data, "format": None, "workers": [{"name": "w0"}]}, f)
    assert read_status_file(run_dir, 3.0) is None


def test_a_file_written_less_often_than_configured_stays_fresh_for_its_own_interval(tmp_path):
    """A controller of many workers writes status.json less often than
    controller.status_interval_s (its encoding is O(N)) and says how often: a reader waits
    three of those intervals before it calls the file stale."""
    run_dir = str(tmp_path)
    data = status_columns(_state({"w0": os.getpid()}), {}, os.getpid(), recorded=True)
    st = status_from_columns(data)
    data["as_of"] = time.time() - 10
    write_status_file(run_dir, data)
    assert read_status_file(run_dir, 3.0) is None           # configured interval 1 s
    data["interval_s"] = 5.0
    write_status_file(run_dir, data)
    assert read_status_file(run_dir, 3.0).workers == st.workers     # 10 s < 3 x 5 s
    data["as_of"] = time.time() - 20
    write_status_file(run_dir, data)
    assert read_status_file(run_dir, 3.0) is None
    # whatever interval a file claims, it is stale after 3 x STATUS_MAX_INTERVAL_S
    data["interval_s"], data["as_of"] = 1e9, time.time() - 3 * STATUS_MAX_INTERVAL_S - 1
    write_status_file(run_dir, data)
    assert read_status_file(run_dir, 3.0) is None
