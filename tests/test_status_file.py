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


def test_the_status_is_written_off_the_round_newest_first_and_a_write_error_is_reported(
        tmp_path):
    """The controller's round hands its status to a writer thread (encoding it was 0.2 s of
    a round at 16K workers): what it hands over last is what the file holds once drained,
    a status handed over while another is written replaces the one waiting, and a write
    that fails is reported, not raised into the job."""
    import threading

    from trainmover.control import saving
    from trainmover.control.saving import StatusWriter

    run_dir = str(tmp_path)
    errors, gate, written = [], threading.Event(), []
    real = saving.write_status_file

    def slow_write(where, status):
        gate.wait(10)                      # the first write holds until the test lets it
        if status.committed_step == 99:
            raise OSError(28, "no space left on device")
        written.append(status.committed_step)
        real(where, status)

    saving.write_status_file = slow_write
    try:
        writer = StatusWriter(run_dir, errors.append)
        for step in range(3):
            st = status_from_state(_state({"w0": os.getpid()}), {}, os.getpid(),
                                   recorded=True)
            st.committed_step = step
            writer.put(st)
            time.sleep(0.1)
        assert not writer.drain(0.2)       # the first write is still held
        gate.set()
        assert writer.drain(10)
        # step 0 was being written when 1 and 2 came: 1 was replaced by 2 before its turn
        assert written == [0, 2]
        assert read_status_file(run_dir, 3.0).committed_step == 2
        st.committed_step = 99             # (the test's write of it fails: a full disk)
        writer.put(st)
        assert writer.drain(10)
        assert [type(e) for e in errors] == [OSError] and "no space" in str(errors[0])
        assert read_status_file(run_dir, 3.0).committed_step == 2
    finally:
        saving.write_status_file = real
