"""The agent's fork server (``agent/forkserver.py``): workers forked from a process that
imported torch once train exactly as workers started anew, stay the agent's children, and a
dead fork server costs no running worker (later processes start anew)."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from trainmover.control.coordinator import run_job

from mp_harness import wait_for
from test_failover import events, start_controller, summary_of
from test_failures import job, with_faults
from trainmover.core.faults import parse_inject


def crash_job(fork_server: bool):
    # no standby: the crash is recovered by a replacement the agent spawns mid-job
    return with_faults(job(dp=2, pp=1, steps=32, standbys=0, agent_fork_server=fork_server),
                       parse_inject("crash@24:w1"))


@pytest.fixture(scope="module")
def started_anew(tmp_path_factory):
    """The job with every process started anew (the fork server off)."""
    run_dir = str(tmp_path_factory.mktemp("anew") / "run")
    summary = run_job(crash_job(False), run_dir, quiet=True, timeout_s=240)
    started = events(run_dir, "process_started")
    assert started and not any(e["forked"] for e in started), started
    return summary


@pytest.mark.timeout(300)
def test_forked_workers_and_replacements_train_as_processes_started_anew(tmp_path,
                                                                          started_anew):
    run_dir = str(tmp_path / "run")
    summary = run_job(crash_job(True), run_dir, quiet=True, timeout_s=240)
    started = events(run_dir, "process_started")
    # w0, w1 and the replacement spawned for the crash, every one forked
    assert len(started) == 3 and all(e["forked"] for e in started), started
    (server,) = events(run_dir, "fork_server_started")
    assert server["pid"] not in {e["pid"] for e in started}
    assert not events(run_dir, "fork_server_failed")
    (rec,) = summary["recoveries"]
    assert rec["status"] == "done"
    assert summary["weights_sha256"] == started_anew["weights_sha256"]


# Their dispositions in a forked worker are those of a process started anew: python ignores
# SIGPIPE (a write to a dead peer's socket fails with EPIPE rather than killing the worker).
SHOW_SIGNALS = ("print('signals', [str(signal.getsignal(s)) for s in (signal.SIGPIPE, "
                "signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)], flush=True)")

PRINTS = textwrap.dedent("""
    import os
    import signal
    import sys
    import torch
    import trainmover

    rt = trainmover.init()
    print(f"out of {rt.name} {os.environ['TRAINMOVER_MARK']} {sys.argv[1:]}", flush=True)
    SHOW_SIGNALS
    print(f"err of {rt.name}", file=sys.stderr, flush=True)
    model = rt.data_parallel(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.register(model=model, optimizer=opt)
    for step in rt.steps(2):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
""").replace("SHOW_SIGNALS", SHOW_SIGNALS)


@pytest.mark.timeout(300)
def test_a_forked_worker_has_its_own_environment_arguments_log_and_signals(tmp_path, monkeypatch):
    from test_examples import launch

    script = tmp_path / "prints.py"
    script.write_text(PRINTS)
    monkeypatch.setenv("TRAINMOVER_MARK", "set-after-the-server-started")
    run_dir = tmp_path / "run"
    res, summary = launch(run_dir, ["--nproc", "2"], script, ["a", "b"], ["--standbys", "0"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert all(e["forked"] for e in events(str(run_dir), "process_started"))
    # a process the agent starts anew: `trainmover launch` handles SIGINT itself, so the
    # agent and its children begin with the default (whatever this test runner ignores)
    fresh = subprocess.run([sys.executable, "-c", f"import signal; {SHOW_SIGNALS}"],
                           capture_output=True, text=True, check=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
                           ).stdout.strip()
    for name in ("w0", "w1"):
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert fresh in log.splitlines(), (fresh, log)
        assert f"out of {name} set-after-the-server-started ['a', 'b']" in log, log
        assert f"err of {name}" in log, log


@pytest.mark.timeout(300)
def test_a_dead_fork_server_costs_no_running_worker(tmp_path, started_anew):
    """Killed once the workers are forked: they train on (they are the agent's children,
    not the server's); the replacement for the crash is started anew."""
    run_dir = str(tmp_path / "run")
    proc = start_controller(crash_job(True), run_dir)
    try:
        wait_for(lambda: len(events(run_dir, "process_started")) >= 2, 120, "w0 and w1 forked")
        (server,) = events(run_dir, "fork_server_started")
        os.kill(server["pid"], 9)
        summary = summary_of(run_dir)
    finally:
        proc.kill()
        proc.wait()
    started = events(run_dir, "process_started")
    assert [e["forked"] for e in started] == [True, True, False], started
    (failed,) = events(run_dir, "fork_server_failed")
    assert failed["time"] < started[-1]["time"]
    assert summary["recoveries"][0]["status"] == "done"
    assert summary["weights_sha256"] == started_anew["weights_sha256"]


REAPER = textwrap.dedent("""
    import os, subprocess, sys, time
    from trainmover.agent.forkserver import become_subreaper, reap_orphans

    assert become_subreaper()
    # a child that leaves an orphan behind (as a dead worker's data loader workers do)
    parent = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'pass']); "
        "print(p.pid, flush=True)"], stdout=subprocess.PIPE, text=True)
    orphan = int(parent.stdout.readline())
    known = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])
    assert parent.wait() == 0
    deadline = time.monotonic() + 60
    reaped = []
    while orphan not in reaped and time.monotonic() < deadline:
        reaped += reap_orphans({known.pid})
        time.sleep(0.01)
    time.sleep(0.5)                       # the known child has exited by now, unreaped
    reap_orphans({known.pid})
    print(orphan in reaped, known.wait())
""")


@pytest.mark.timeout(120)
def test_the_agent_reaps_orphans_and_leaves_its_own_childrens_exit_codes():
    res = subprocess.run([sys.executable, "-c", REAPER], capture_output=True, text=True,
                         timeout=100)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "7"], res.stdout
