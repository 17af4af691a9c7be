"""Users' own training scripts under `trainmover launch`: the examples survive a planned
migration, a crash and a hang with the weights of their own uninterrupted run; their standbys
warm up by replay; misuse of the API is refused with a clear error."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainmover.core.events import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
DDP = ROOT / "examples" / "ddp_gpt.py"
DDP_PLAIN = ROOT / "examples" / "ddp_gpt_plain.py"
PIPE = ROOT / "examples" / "pipeline_tp_gpt.py"


def launch(run_dir, layout, script, script_args=(), extra=(), timeout=300):
    """`trainmover launch` as a user runs it; one intra-op thread per worker in every run,
    so runs with different process counts use the same kernels (bit-identical results)."""
    cmd = [sys.executable, "-m", "trainmover", "launch", *layout, "--threads", "1",
           "--run-dir", str(run_dir), "--quiet", *extra, "--", sys.executable, str(script),
           *script_args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    summary_path = Path(run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return res, summary


def events(run_dir, name):
    return [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == name]


def changed_lines(plain: Path, resilient: Path) -> list[str]:
    """The lines a diff from ``plain`` to ``resilient`` adds or removes."""
    import difflib

    return [line for line in difflib.unified_diff(plain.read_text().splitlines(),
                                                  resilient.read_text().splitlines(),
                                                  lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_ddp_example_is_the_plain_script_with_at_most_15_changed_lines():
    changed = changed_lines(DDP_PLAIN, DDP)
    assert 0 < len(changed) <= 15, changed
    assert any("trainmover.init()" in line for line in changed)


STEPS = 40
DDP_ARGS = ("--steps", str(STEPS))


@pytest.fixture(scope="module")
def ddp_base(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp") / "base"
    res, summary = launch(run_dir, ["--nproc", "2"], DDP, DDP_ARGS)
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary["steps"] == STEPS
    return summary


@pytest.mark.timeout(400)
def test_ddp_example_migration_and_crash_are_bit_identical_and_its_standby_warmed_by_replay(
        tmp_path, ddp_base):
    """A planned migration of w1 early, then a crash of w0 late (one job: the suite's time is
    mostly jobs starting; the crash comes once the migration is over)."""
    run_dir = tmp_path / "run"
    res, summary = launch(run_dir, ["--nproc", "2"], DDP, DDP_ARGS,
                          ["--standbys", "2", "--inject", "migrate@3:w1",
                           "--inject", "crash@33:w0"])
    assert res.returncode == 0, res.stderr[-3000:]
    (m,) = summary["migrations"]
    assert m["status"] == "done", m
    (pair,) = m["pairs"]
    assert pair["leaver"] == "w1" and pair["role"] == "dp1.pp0.tp0", m
    assert m["transfer_bytes"] > 0
    (r,) = summary["recoveries"]
    assert r["failures"] == {"w0": "crash"}
    # the crashed role came back from its replica, the migration's joiner, losing nothing
    assert r["lost_steps"] == 0 and r["sources"] == {"dp0.pp0.tp0": "replica:" + pair["joiner"]}
    assert summary["weights_sha256"] == ddp_base["weights_sha256"]
    assert summary["steps"] == STEPS
    assert sorted(summary["membership"].values()) == ["dp0.pp0.tp0", "dp1.pp0.tp0"]
    assert summary["membership"][pair["joiner"]] == "dp1.pp0.tp0"
    assert "w0" not in summary["membership"] and "w1" not in summary["membership"]
    # the representative role recorded step 0; the standbys ran shadow steps of the script
    assert [e["structure"] for e in events(run_dir, "recorded")] == ["only"]
    warmed = [e for e in events(run_dir, "warmed") if e["worker"] == pair["joiner"]]
    assert warmed and all(len(e["shadow_step_s"]) >= 1 for e in warmed), warmed


@pytest.mark.slow    # the migration and the crash run in one job above
@pytest.mark.timeout(400)
def test_ddp_example_migration_alone_is_bit_identical(tmp_path, ddp_base):
    run_dir = tmp_path / "moved"
    res, summary = launch(run_dir, ["--nproc", "2"], DDP, DDP_ARGS,
                          ["--standbys", "1", "--inject", "migrate@3:w1"])
    assert res.returncode == 0, res.stderr[-3000:]
    (m,) = summary["migrations"]
    assert m["status"] == "done", m
    assert m["pairs"] == [{"leaver": "w1", "joiner": "s0", "role": "dp1.pp0.tp0"}]
    assert summary["weights_sha256"] == ddp_base["weights_sha256"]
    assert summary["membership"] == {"w0": "dp0.pp0.tp0", "s0": "dp1.pp0.tp0"}


@pytest.mark.slow    # the crash runs with a migration above; the hang is a longer detection
@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", ["crash@9:w0", "hang@9:w1"])
def test_ddp_example_recovers_from_a_crash_and_a_hang_bit_identically(
        tmp_path, ddp_base, fault):
    run_dir = tmp_path / "run"
    res, summary = launch(run_dir, ["--nproc", "2"], DDP, DDP_ARGS,
                          ["--standbys", "1", "--inject", fault])
    assert res.returncode == 0, res.stderr[-3000:]
    (r,) = summary["recoveries"]
    assert r["failures"] == {fault.split(":")[1]: fault.split("@")[0]}
    assert r["lost_steps"] == 0 and r["sources"] == {r["pairs"][0]["role"]: "replica:" +
                                                      ({"w0": "w1", "w1": "w0"}[r["pairs"][0]["failed"]])}
    assert summary["weights_sha256"] == ddp_base["weights_sha256"]
    assert summary["steps"] == STEPS


PIPE_LAYOUT = ["--dp", "2", "--pp", "2", "--tp", "1"]
PIPE_TP_LAYOUT = ["--dp", "1", "--pp", "2", "--tp", "2"]
PIPE_ARGS = ("--steps", "24")


@pytest.fixture(scope="module")
def pipe_base(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pipe") / "base"
    res, summary = launch(run_dir, PIPE_LAYOUT, PIPE, PIPE_ARGS)
    assert res.returncode == 0, res.stderr[-3000:]
    return summary


@pytest.mark.timeout(400)
def test_pipeline_tp_example_runs_tensor_parallel(tmp_path):
    res, summary = launch(tmp_path / "tp", PIPE_TP_LAYOUT, PIPE, ("--steps", "6"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary["layout"] == {"dp": 1, "pp": 2, "tp": 2} and summary["steps"] == 6


@pytest.mark.timeout(500)
# the hang case is the same recovery after a longer detection: on demand (make test-slow)
@pytest.mark.parametrize("events_", [["migrate@3:w1", "crash@14:w2"],
                                     pytest.param(["hang@8:w3"], marks=pytest.mark.slow)])
def test_pipeline_example_survives_migration_crash_and_hang(tmp_path, pipe_base, events_):
    extra = ["--standbys", "2"]
    for e in events_:
        extra += ["--inject", e]
    res, summary = launch(tmp_path / "run", PIPE_LAYOUT, PIPE, PIPE_ARGS, extra)
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary["weights_sha256"] == pipe_base["weights_sha256"]
    if any(e.startswith("migrate") for e in events_):
        assert [m["status"] for m in summary["migrations"]] == ["done"], summary["migrations"]
    kinds = sorted(k for r in summary["recoveries"] for k in r["failures"].values())
    assert kinds == sorted(e.split("@")[0] for e in events_ if not e.startswith("migrate"))


# --- misuse -----------------------------------------------------------------------------------

MISUSE = {
    "unregistered": ("""
        rt = trainmover.init()
        for step in rt.steps(5):
            rt.commit()
        """, "register the training state"),
    # (with the optimizer registered, its step() would be the commit point)
    "no_commit": ("""
        rt = trainmover.init()
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rt.register(model=model)
        for step in rt.steps(5):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        """, "skipped the commit point"),
    "stateful_data": ("""
        rt = trainmover.init()
        model = rt.data_parallel(torch.nn.Linear(4, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rt.register(model=model, optimizer=opt)
        def stream():
            g = torch.Generator().manual_seed(0)
            while True:
                yield torch.randn(2, 4, generator=g)
        batches = stream()
        for step in rt.steps(100000):  # stopped long before: by the standby's check
            model(next(batches)).sum().backward()   # the batch is the iterator's, not the step's
            if rt.commit():
                opt.step()
            opt.zero_grad()
        """, "data must be a pure function of the step"),
}
# the same script in a job without a standby: stopped at the rehearsal of step 1
MISUSE["stateful_data_no_standby"] = (MISUSE["stateful_data"][0],
                                      "differs between two attempts of the step")
# and through torch's own DDP (fingerprinted by a forward pre-hook of the registered model)
MISUSE["stateful_data_torch_ddp"] = (MISUSE["stateful_data"][0].replace(
    "model = rt.data_parallel(torch.nn.Linear(4, 4))",
    "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))"),
    "Likely cause: batches taken from an iterator's position")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_is_refused_with_a_clear_error(tmp_path, case):
    body, message = MISUSE[case]
    script = tmp_path / f"{case}.py"
    script.write_text("import torch\nimport trainmover\n" + textwrap.dedent(body))
    extra = ["--standbys", "1"] if case == "stateful_data" else ["--standbys", "0"]
    res, summary = launch(tmp_path / "run", ["--nproc", "1"], script, (), extra)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert message in res.stderr, res.stderr[-3000:]
    assert summary is None


@pytest.mark.timeout(300)
def test_a_script_imports_its_neighbours_wherever_it_is_launched_from(tmp_path):
    """As ``python SCRIPT`` does: the script's folder is first on sys.path (the launch runs
    from the repository root, the script and its module live elsewhere)."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "model.py").write_text("import torch\n\ndef build():\n"
                                     "    return torch.nn.Linear(4, 4)\n")
    script = folder / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        import trainmover
        from model import build
        rt = trainmover.init()
        model = rt.data_parallel(build())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rt.register(model=model, optimizer=opt)
        for step in rt.steps(3):
            model(torch.ones(2, 4)).sum().backward()
            if rt.commit():
                opt.step()
            opt.zero_grad()
        """))
    res, summary = launch(tmp_path / "run", ["--nproc", "2"], script)
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary["steps"] == 3


@pytest.mark.timeout(300)
def test_a_script_that_fails_before_init_ends_the_job_at_once_naming_the_error(tmp_path):
    """Not a machine's failure to recover from: every replacement would fail the same way.
    The job stops on the first such exit, with the exception and where its traceback is."""
    script = tmp_path / "train.py"
    script.write_text("import trainmover\nfrom no_such_module import GPT\n")
    res, summary = launch(tmp_path / "run", ["--nproc", "2"], script, (), ["--standbys", "1"])
    assert res.returncode == 1 and summary is None
    assert "failed before trainmover.init(): ModuleNotFoundError: No module named " \
           "'no_such_module'" in res.stderr, res.stderr[-3000:]
    assert "logs/w" in res.stderr and "cannot recover" not in res.stderr
    (first, *_) = events(tmp_path / "run", "script_error")
    assert "ModuleNotFoundError" in first["error"]
    assert not events(tmp_path / "run", "recovery_started")
    # and the ended job's status says how it ended
    res = subprocess.run([sys.executable, "-m", "trainmover", "status", "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "is not running and left no summary" in res.stdout
    assert "job_failed" in res.stdout and "ModuleNotFoundError" in res.stdout, res.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command, message", [
    ([], "no training command after '--'"),
    (["bash", "train.sh"], "must start with a Python interpreter"),
    ([sys.executable, "/no/such/script.py"], "'/no/such/script.py' does not exist"),
    ([sys.executable, "-c", "print(1)"], "interpreter option '-c' is not supported"),
])
def test_launch_refuses_a_bad_command_before_starting_anything(tmp_path, command, message):
    cmd = [sys.executable, "-m", "trainmover", "launch", "--nproc", "2", "--run-dir",
           str(tmp_path / "run"), "--", *command]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not (tmp_path / "run").exists()


# A script that changes its parameters outside the optimizer (a clamp after every step):
# what a pre-copy's replay cannot follow, caught by the joiner's check
CLAMPING = '''
import torch
import trainmover

rt = trainmover.init()
torch.manual_seed(0)
model = rt.data_parallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                             torch.nn.Linear(32, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
rt.register(model=model, optimizer=opt)
# enough steps for the migration to switch before the end however long the standby takes
# to warm up on a loaded machine (at 30, one suite run finished first: no switch, no check)
for step in rt.steps(150):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rt.dp_rank))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)
'''


@pytest.mark.timeout(400)
def test_a_precopy_the_script_outruns_is_caught_and_the_role_recovered(tmp_path):
    script = tmp_path / "clamping.py"
    script.write_text(CLAMPING)
    base, base_summary = launch(tmp_path / "base", ["--nproc", "2"], script)
    assert base.returncode == 0, base.stderr[-3000:]
    res, summary = launch(tmp_path / "run", ["--nproc", "2"], script, (),
                          ["--standbys", "2", "--precopy", "--inject", "migrate@3:w1"])
    assert res.returncode == 0, res.stderr[-3000:]
    (diverged,) = events(tmp_path / "run", "precopy_diverged")
    assert diverged["entry"].startswith("model/") and not events(tmp_path / "run",
                                                                 "precopy_verified")
    # the joiner failed before applying anything of its own; its role came back from the
    # replica, and the job ends where the uninterrupted one does
    (r,) = summary["recoveries"]
    assert r["failures"] == {diverged["worker"]: "crash"}, r
    assert summary["weights_sha256"] == base_summary["weights_sha256"]
