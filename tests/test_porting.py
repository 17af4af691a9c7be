"""What a ported script may rely on (issue: "a real training script ported in ten lines"):
a step redone after a failure draws the same random numbers as its first attempt, and
``rt.is_main`` names one process, never a standby's warm-up."""
import json
import textwrap

import pytest

from test_examples import events, launch

from trainmover.core.events import read_jsonl

DROPOUT = textwrap.dedent("""
    import json
    import sys
    import torch
    import trainmover

    rt = trainmover.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                              torch.nn.Linear(64, 1))
    model = rt.data_parallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rt.register(model=model, optimizer=opt)
    with open(f"{sys.argv[1]}.{rt.name}.{'shadow' if rt.sandbox else 'run'}", "a") as f:
        f.write(json.dumps({"is_main": rt.is_main, "role": rt.role.name}) + "\\n")
    for step in rt.steps(20):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=g)[rt.dp_rank * 4:(rt.dp_rank + 1) * 4]
        loss = model(x).pow(2).mean()      # the dropout draws from torch's global generator
        loss.backward()
        if rt.commit(loss=loss.item()):
            opt.step()
        opt.zero_grad()
""")


@pytest.fixture(scope="module")
def dropout_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("dropout")
    script = root / "train.py"
    script.write_text(DROPOUT)
    res, summary = launch(root / "run", ["--nproc", "2"], script, [str(root / "marks")],
                          ["--standbys", "0"])
    assert res.returncode == 0, res.stderr[-3000:]
    return summary


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["crash@8:w1:allreduce",
                                   pytest.param("hang@8:w0:allreduce", marks=pytest.mark.slow)])
def test_a_step_redone_after_a_failure_draws_the_random_numbers_of_its_first_attempt(
        tmp_path, dropout_base, fault):
    """Both replicas drew step 8's dropout masks before the failure; the survivor redoes the
    step from its generators at the step's start, and the joiner from the survivor's, so
    the job ends with the uninterrupted run's weights."""
    script = tmp_path / "train.py"
    script.write_text(DROPOUT)
    marks = tmp_path / "marks"
    res, summary = launch(tmp_path / "run", ["--nproc", "2"], script, [str(marks)],
                          ["--standbys", "1", "--inject", fault])
    assert res.returncode == 0, res.stderr[-3000:]
    (r,) = summary["recoveries"]
    assert r["status"] == "done" and r["lost_steps"] == 0, r
    assert summary["weights_sha256"] == dropout_base["weights_sha256"]
    # is_main: one of the job's processes at a time (w0 holds dp0, the reporter's role, until
    # it fails; then its joiner), never a standby's rehearsal
    seen = {p.name: [json.loads(line) for line in p.read_text().splitlines()]
            for p in tmp_path.glob("marks.*")}
    shadows = [m for name, ms in seen.items() if name.endswith(".shadow") for m in ms]
    assert shadows and not any(m["is_main"] for m in shadows), seen
    runs = {name: ms for name, ms in seen.items() if name.endswith(".run")}
    assert [m["role"] for ms in runs.values() for m in ms if m["is_main"]] == \
        ["dp0.pp0.tp0"] * (2 if fault.endswith("w0:allreduce") else 1), runs


SCALER = textwrap.dedent("""
    import torch
    import trainmover

    rt = trainmover.init()
    torch.manual_seed(0)
    model = rt.data_parallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    rt.register(model=model, optimizer=opt, extra={"scaler": scaler})
    for step in rt.steps(16):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=g)[rt.dp_rank * 4:(rt.dp_rank + 1) * 4]
        if step == 4:
            x[0, 0] = float("inf")         # an overflow: the scaler skips this step
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.unscale_(opt)               # before the commit point, to clip
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if rt.commit():
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
""")


@pytest.mark.timeout(300)
def test_an_amp_grad_scaler_registered_as_state_survives_a_redone_step(tmp_path):
    """A step redone after a failure unscales its gradients again: the scaler forgets the
    abandoned attempt (unscale_() would refuse), keeps its scale, and the job ends with the
    uninterrupted run's weights, the skipped overflow step included."""
    script = tmp_path / "train.py"
    script.write_text(SCALER)
    res, base = launch(tmp_path / "base", ["--nproc", "2"], script, (), ["--standbys", "0"])
    assert res.returncode == 0, res.stderr[-3000:]
    res, summary = launch(tmp_path / "run", ["--nproc", "2"], script, (),
                          ["--standbys", "1", "--inject", "crash@8:w1:allreduce"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary["recoveries"][0]["status"] == "done"
    assert summary["weights_sha256"] == base["weights_sha256"]


STATEFUL = textwrap.dedent("""
    import torch
    import trainmover
    from torch.utils.data import DistributedSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    rt = trainmover.init()
    torch.manual_seed(0)
    model = rt.data_parallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(2048, 16, generator=g))   # 128 steps a replica
    # a shuffled shard per replica, read by two worker processes with prefetching: the
    # batch of a step is the loader's position, not a function of the step
    sampler = DistributedSampler(data, num_replicas=rt.dp_size, rank=rt.dp_rank, seed=3)
    loader = StatefulDataLoader(data, batch_size=4, sampler=sampler, num_workers=2,
                                prefetch_factor=2)
    rt.register(model=model, optimizer=opt, data=loader)
    batches = rt.batches()
    for step in rt.steps(60):
        for micro in range(2):
            (x,) = next(batches)
            model.require_backward_grad_sync = micro == 1
            model(x).pow(2).mean().backward()
        if rt.commit():
            opt.step()
        opt.zero_grad()
""")


@pytest.fixture(scope="module")
def stateful_base(tmp_path_factory):
    pytest.importorskip("torchdata.stateful_dataloader")
    root = tmp_path_factory.mktemp("stateful")
    script = root / "train.py"
    script.write_text(STATEFUL)
    res, summary = launch(root / "run", ["--nproc", "2"], script, (), ["--standbys", "0"])
    assert res.returncode == 0, res.stderr[-3000:]
    return summary


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", [
    # (with 24 steps, 1 run in 8 ended before the switch step: the standby was still warming)
    "migrate@6:w1", "crash@10:w1:allreduce",
    pytest.param("hang@10:w0:allreduce", marks=pytest.mark.slow)])
def test_a_registered_stateful_loader_moves_with_its_role_and_a_redo_gets_its_batches(
        tmp_path, stateful_base, fault):
    """torchdata's StatefulDataLoader (2 workers, prefetching, a shuffled shard per
    replica), registered as rt.register(data=...): a joiner continues from the leaver's (or
    the replica's) position, a redone step is handed the batches its first attempt drew,
    and the job ends with the uninterrupted run's weights."""
    script = tmp_path / "train.py"
    script.write_text(STATEFUL)
    res, summary = launch(tmp_path / "run", ["--nproc", "2"], script, (),
                          ["--standbys", "1", "--inject", fault])
    assert res.returncode == 0, res.stderr[-3000:]
    if fault.startswith("migrate"):
        assert [m["status"] for m in summary["migrations"]] == ["done"]
    else:
        (r,) = summary["recoveries"]
        assert r["status"] == "done" and r["lost_steps"] == 0, r
    assert summary["weights_sha256"] == stateful_base["weights_sha256"]


def test_data_that_cannot_be_resumed_is_refused_at_register(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        import trainmover
        rt = trainmover.init()
        model = torch.nn.Linear(2, 2)
        rt.register(model=model, data=iter([torch.ones(2)]))
    """))
    res, _ = launch(tmp_path / "run", ["--nproc", "1"], script)
    assert res.returncode == 1
    assert "rt.register(data=...): list_iterator has no state_dict, load_state_dict" in \
        res.stderr, res.stderr[-2000:]


# no rt.commit(): the registered optimizer's step() is the commit point; a GradScaler skips
# every overflow step (no optimizer step: the step votes at its end) and calls update() in
# every attempt, so a redone step must get back its scale from the step's start
IMPLICIT = textwrap.dedent("""
    import json
    import sys
    import torch
    import trainmover

    rt = trainmover.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                              torch.nn.Linear(64, 1))
    model = rt.data_parallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    rt.register(model=model, optimizer=opt, extra={"scaler": scaler})
    for step in rt.steps(40):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=g)[rt.dp_rank * 4:(rt.dp_rank + 1) * 4]
        if step % 7 == 4:
            x[0, 0] = float("inf")
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    if rt.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump({"scale": scaler.get_scale(),
                       "growth": int(scaler._get_growth_tracker())}, f)
""")


@pytest.fixture(scope="module")
def implicit_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("implicit")
    script = root / "train.py"
    script.write_text(IMPLICIT)
    res, summary = launch(root / "run", ["--nproc", "2"], script, [str(root / "scale.json")],
                          ["--standbys", "0"])
    assert res.returncode == 0, res.stderr[-3000:]
    return summary, json.loads((root / "scale.json").read_text())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", [
    "crash@8:w1:allreduce",                   # a step that applies its update
    "crash@11:w0:allreduce",                  # an overflow step: it votes at its end
    pytest.param("hang@9:w1:allreduce", marks=pytest.mark.slow)])
def test_a_script_without_rt_commit_commits_at_the_optimizer_step_and_redoes_exactly(
        tmp_path, implicit_base, fault):
    """The failed attempt's optimizer.step() did nothing (its gradients were dropped), its
    scaler.update() is undone with the redo, and the job ends with the uninterrupted run's
    weights and scale."""
    base, base_scale = implicit_base
    script = tmp_path / "train.py"
    script.write_text(IMPLICIT)
    res, summary = launch(tmp_path / "run", ["--nproc", "2"], script,
                          [str(tmp_path / "scale.json")], ["--standbys", "1", "--inject", fault])
    assert res.returncode == 0, res.stderr[-3000:]
    (r,) = summary["recoveries"]
    assert r["status"] == "done" and r["lost_steps"] == 0, r
    assert summary["weights_sha256"] == base["weights_sha256"]
    assert json.loads((tmp_path / "scale.json").read_text()) == base_scale
    assert summary["steps"] == 40


# --- the rehearsal of step 1 in a job no standby checks (DataConfig.rehearse) ----------------

STALE = textwrap.dedent("""
    import torch
    import trainmover

    rt = trainmover.init()
    torch.manual_seed(0)
    model = rt.data_parallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rt.register(model=model, optimizer=opt)
    for step in rt.steps(12):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=g)[rt.dp_rank * 4:(rt.dp_rank + 1) * 4]
        model(x).pow(2).mean().backward()
        if rt.commit():
            opt.step()
            opt.zero_grad()     # only after an applied step: a redo starts with old gradients
""")


@pytest.fixture(scope="module")
def stale_base(tmp_path_factory):
    """The uninterrupted run, not rehearsed (a standby checks the data instead)."""
    root = tmp_path_factory.mktemp("stale")
    script = root / "train.py"
    script.write_text(STALE)
    res, summary = launch(root / "run", ["--nproc", "2"], script, (), ["--standbys", "1"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert not events(root / "run", "data_rehearsed")
    return summary


@pytest.mark.timeout(300)
# the crash case checks the rehearsal and the weights too, and a replacement's redo
@pytest.mark.parametrize("fault", [pytest.param(None, marks=pytest.mark.slow),
                                   "crash@6:w1:allreduce"])
def test_a_job_without_standbys_rehearses_step_1_and_ends_with_the_same_weights(
        tmp_path, stale_base, fault):
    """Step 1 runs twice, the first attempt not applied, and the job ends with the weights of
    the job that was not rehearsed: the second attempt starts without the first's gradients
    (the script zeroes them only after an applied step), and a replacement started without
    a standby redoes a step as exactly."""
    script = tmp_path / "train.py"
    script.write_text(STALE)
    extra = ["--standbys", "0"] + (["--inject", fault] if fault else [])
    res, summary = launch(tmp_path / "run", ["--nproc", "2"], script, (), extra)
    assert res.returncode == 0, res.stderr[-3000:]
    rehearsed = events(tmp_path / "run", "data_rehearsed")
    assert sorted(e["worker"] for e in rehearsed) == ["w0", "w1"], rehearsed
    assert all(e["equal"] and e["step"] == 1 for e in rehearsed), rehearsed
    assert len(summary["recoveries"]) == (1 if fault else 0)
    assert summary["weights_sha256"] == stale_base["weights_sha256"]


HASHED = textwrap.dedent("""
    import os
    import sys
    import torch
    import trainmover

    rt = trainmover.init()
    with open(os.path.join(sys.argv[1], f"{rt.name}.{os.getpid()}"), "w") as f:
        f.write(str(hash("a seed")))
    torch.manual_seed(0)
    model = rt.data_parallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rt.register(model=model, optimizer=opt)
    for step in rt.steps(10):
        seed = (hash("a seed") + step) % 2**31     # Python's salted hash() of a string
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed + rt.dp_rank))
        model(x).pow(2).mean().backward()
        if rt.commit():
            opt.step()
        opt.zero_grad()
""")


@pytest.mark.timeout(300)
def test_every_process_of_a_job_hashes_strings_alike(tmp_path):
    """``PYTHONHASHSEED`` is the job's (core/jobfile.py): a replacement seeded by ``hash()``
    gets the numbers of the process it replaces, so the rehearsal and the redo agree."""
    script = tmp_path / "train.py"
    script.write_text(HASHED)
    marks = tmp_path / "marks"
    marks.mkdir()
    res, summary = launch(tmp_path / "run", ["--nproc", "2"], script, [str(marks)],
                          ["--standbys", "0", "--inject", "crash@5:w1:allreduce"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary["recoveries"][0]["status"] == "done"
    seen = {p.name: p.read_text() for p in marks.iterdir()}
    assert len(seen) == 3 and len(set(seen.values())) == 1, seen   # w0, w1 and w1's joiner
    # the registered model's size, as the controller shows it (a script's first record)
    sized = [r for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl")) if "model_params" in r]
    assert sized and sized[0]["model_params"] == 17 and sized[0]["model_params_of"] == "the model"


# --- a migration waits for a joiner still warming up (standby.join_wait_s) -------------------

SLOW_WARMUP = textwrap.dedent("""
    import time
    import torch
    import trainmover

    rt = trainmover.init()
    torch.manual_seed(0)
    model = rt.data_parallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rt.register(model=model, optimizer=opt)
    for step in rt.steps(100):
        if rt.sandbox:
            time.sleep(2.0)     # a standby's warm-up step compiling
        time.sleep(0.08)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step * 2 + rt.dp_rank))
        model(x).pow(2).mean().backward()
        if rt.commit():
            opt.step()
        opt.zero_grad()
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wait_s", [120.0, 1.0])
def test_a_migration_waits_for_its_joiner_to_finish_warming_up(tmp_path, wait_s):
    """Requested at step 2, while the standby is still starting and warming up: the orders
    wait until it is warm (it warms fully, then joins), or until ``standby.join_wait_s``
    passes (reported, and the migration still completes)."""
    from trainmover.control.coordinator import run_job
    from trainmover.core.config import JobConfig
    from trainmover.core.faults import parse_inject
    from trainmover.core.topology import Layout

    script = tmp_path / "train.py"
    script.write_text(SLOW_WARMUP)
    cfg = JobConfig(name="slow")
    cfg.layout = Layout(2, 1, 1)
    cfg.process.command = [str(script)]
    cfg.train.threads_per_worker = 1
    cfg.override(standby_count=1, standby_join_wait_s=wait_s).validate()
    run_dir = tmp_path / "run"
    summary = run_job(cfg, str(run_dir), quiet=True, timeout_s=240,
                      injects=[parse_inject("migrate@2:w1")])
    (m,) = summary["migrations"]
    assert m["status"] == "done", m
    (waiting,) = events(run_dir, "migration_waiting")
    assert waiting["joiners"] == ["s0"], waiting
    (waited,) = events(run_dir, "migration_waited")
    warmed = [e for e in events(run_dir, "warmed") if e["worker"] == "s0"]
    if wait_s > 1.0:
        assert not waited["timed_out"] and waited["states"] == {"s0": "warm"}, waited
        assert warmed and warmed[0]["time"] <= waited["time"], (warmed, waited)
        assert m["warmup_wait_s"] >= 2.0, m
    else:
        assert waited["timed_out"] and 1.0 <= m["warmup_wait_s"] < 5.0, (waited, m)
