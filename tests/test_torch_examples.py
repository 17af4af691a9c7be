"""The user's own torch.distributed code under `trainmover launch`: DistributedDataParallel
itself (not trainmover's wrapper) on trainmover's process groups survives a planned
migration, a crash and a hang with the weights of its own uninterrupted run.

The reference of each example is its plain script under torchrun: the default suite checks
that a run under trainmover *with* a migration and a crash ends on the plain script's
weights (one claim for both: trainmover changes nothing, faults change nothing); the slow
suite also runs each example uninterrupted under trainmover and compares the two apart.
The 2-D and pipeline examples (four processes each) compare with their own uninterrupted
run under trainmover in the default suite, with torchrun in the slow one."""
import json
import os
import subprocess
import sys

import pytest

from trainmover.core.faults import parse_inject

from test_examples import DDP_PLAIN, ROOT, STEPS, changed_lines, events, launch

TORCH_DDP = ROOT / "examples" / "torch_ddp.py"
TORCH_FSDP = ROOT / "examples" / "torch_fsdp.py"
TORCH_FSDP_PLAIN = ROOT / "examples" / "torch_fsdp_plain.py"
TORCH_FSDP_TP = ROOT / "examples" / "torch_fsdp_tp.py"
TORCH_FSDP_TP_PLAIN = ROOT / "examples" / "torch_fsdp_tp_plain.py"
TORCH_PIPELINE = ROOT / "examples" / "torch_pipeline.py"
TORCH_PIPELINE_PLAIN = ROOT / "examples" / "torch_pipeline_plain.py"
NANOGPT = ROOT / "examples" / "nanogpt.py"
NANOGPT_PLAIN = ROOT / "examples" / "nanogpt_plain.py"
PAIR = ("--nproc", "2")
GRID = ("--dp", "2", "--tp", "2")      # the 2-D example: w0 dp0.tp0 ... w3 dp1.tp1
PIPE = ("--dp", "2", "--pp", "2")      # the pipeline: w0 dp0.pp0, w1 dp0.pp1, w2 dp1.pp0 ...
ARGS = ("--steps", str(STEPS))
# the default suite runs a middle role's migration and, in the same job, a first role's crash
# of each example (one job instead of two: the suite's time is mostly jobs starting);
# `make test-slow` runs each alone, the other migration and the hang
# (the crash comes late: a crash while the migration is still under way aborts it)
BOTH = "migrate@3:w1+crash@33:w0"
FAULTS = [BOTH, *(pytest.param(f, marks=pytest.mark.slow)
                  for f in ("migrate@3:w1", "migrate@5:w0", "crash@9:w0", "hang@9:w1"))]
# FSDP2 shards the state over dp: a crash rolls every role back to the newest checkpoint
FSDP_FLAGS = ["--dp-sharded", "--checkpoint-every", "5"]


def _base(tmp_path_factory, name, script, flags=(), layout=PAIR, save=False, args=ARGS):
    """The uninterrupted run; with ``save``, the script's final DCP checkpoint goes to
    ``summary["dcp"]``."""
    run_dir = tmp_path_factory.mktemp(name) / "base"
    steps = int(args[args.index("--steps") + 1])
    args = args + (("--save", str(run_dir.parent / "dcp")) if save else ())
    res, summary = launch(run_dir, list(layout), script, args, list(flags))
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary["steps"] == steps
    if save:
        summary["dcp"] = run_dir.parent / "dcp"
    return summary


def _injects(fault: str):
    """The events of ``fault`` (joined by ``+``), parsed as the CLI parses them."""
    return [parse_inject(f) for f in fault.split("+")]


def _torchrun(tmp_path_factory, name, plain_script, nproc=2, args=ARGS) -> str:
    """The plain script's weights under torchrun: the reference of every run of it."""
    return _torchrun_weights(tmp_path_factory.mktemp(name), plain_script, nproc, args)


def _with_fault(tmp_path, script, flags, fault, layout=PAIR, args=ARGS):
    """The script launched with ``fault`` (events joined by ``+``) and a standby for each;
    checks every event was handled and the job ran to the end. Returns the run dir, the
    summary and the kinds of the events ({kind: worker})."""
    run_dir = tmp_path / "run"
    faults = fault.split("+")
    res, summary = launch(run_dir, list(layout), script, args,
                          list(flags) + ["--standbys", str(len(faults))] +
                          [a for f in faults for a in ("--inject", f)])
    assert res.returncode == 0, res.stderr[-3000:]
    kinds = {i.kind: i.target for i in _injects(fault)}
    if "migrate" in kinds:
        (m,) = summary["migrations"]
        assert m["status"] == "done" and m["pairs"][0]["leaver"] == kinds["migrate"], m
    failures = {w: k for k, w in kinds.items() if k != "migrate"}
    if failures:
        (r,) = summary["recoveries"]
        assert r["failures"] == failures, r
        # measured from the resume step's commit after the failure (a rollback's resume step
        # was committed once before it too)
        assert r["downtime_s"] is not None and r["downtime_s"] > 0, r
    else:
        assert not summary["recoveries"], summary["recoveries"]
    assert summary["steps"] == int(args[args.index("--steps") + 1])
    # the job recorded its torch operations for the standby, whose replay (as far as it got
    # before the event: a warm-up may be cut short) kept its place: an operation unlike the
    # recorded one would say replay_diverged
    recorded = events(run_dir, "recorded")
    assert recorded and all(e["torch_ops"] > 0 for e in recorded), recorded
    assert not events(run_dir, "replay_diverged") and not events(run_dir, "warmup_skipped")
    return run_dir, summary, kinds


def newest_checkpoint_before(fault: str) -> int:
    """The step a crash of ``fault`` rolls back to with ``FSDP_FLAGS`` (every 5 steps): the
    newest checkpoint before the crashed step."""
    (crash,) = [i for i in _injects(fault) if i.kind != "migrate"]
    return (crash.step - 1) // 5 * 5


def _torchrun_weights(tmp_path, plain_script, nproc=2, args=ARGS) -> str:
    """``weights_sha256`` of the plain script under torchrun (tests/data/torchrun_weights.py)."""
    out = tmp_path / "torchrun.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", str(nproc), str(ROOT / "tests" / "data" /
                                                       "torchrun_weights.py"),
                          str(out), str(plain_script), *args],
                         capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())["weights_sha256"]


def test_torch_ddp_example_is_the_plain_torchrun_script_with_at_most_10_changed_lines():
    changed = changed_lines(DDP_PLAIN, TORCH_DDP)
    assert 0 < len(changed) <= 10, changed
    # torch's own data parallelism stays: the script still builds DistributedDataParallel
    assert "    model = DDP(model)" in TORCH_DDP.read_text().splitlines()
    assert not any("data_parallel" in line for line in changed)


@pytest.fixture(scope="module")
def torch_ddp_base(tmp_path_factory):
    return _base(tmp_path_factory, "torch-ddp", TORCH_DDP)


@pytest.fixture(scope="module")
def torch_ddp_torchrun(tmp_path_factory):
    return _torchrun(tmp_path_factory, "torch-ddp-torchrun", DDP_PLAIN)


# torch's own DDP under the same events runs in the default suite as nanoGPT (DDP with
# accumulation, dropout and a stateful loader): this plainer script is slow-suite
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", FAULTS)
def test_torch_ddp_survives_migration_crash_and_hang_bit_identically(
        tmp_path, torch_ddp_torchrun, fault):
    run_dir, summary, _ = _with_fault(tmp_path, TORCH_DDP, (), fault)
    for r in summary["recoveries"]:
        assert r["lost_steps"] == 0, r
    # no step failed after the event was handled (a late end of an abandoned operation
    # must not doom a later step)
    last_event = max(i.step for i in _injects(fault))
    failed = [e for e in events(run_dir, "step_failed") if e["step"] > last_event]
    assert not failed, failed
    assert summary["weights_sha256"] == torch_ddp_torchrun


@pytest.mark.slow   # the default suite compares a run with faults to torchrun directly
@pytest.mark.timeout(300)
def test_torch_ddp_under_trainmover_ends_with_the_weights_of_the_plain_script_under_torchrun(
        torch_ddp_torchrun, torch_ddp_base):
    assert torch_ddp_torchrun == torch_ddp_base["weights_sha256"]


def test_torch_fsdp_example_is_the_plain_torchrun_script_with_at_most_10_changed_lines():
    changed = changed_lines(TORCH_FSDP_PLAIN, TORCH_FSDP)
    assert 0 < len(changed) <= 10, changed
    # torch's own mesh and FSDP2 stay as they were
    resilient = TORCH_FSDP.read_text().splitlines()
    assert any("init_device_mesh(" in line for line in resilient)
    assert any("fully_shard(model, mesh=mesh)" in line for line in resilient)


@pytest.fixture(scope="module")
def torch_fsdp_base(tmp_path_factory):
    return _base(tmp_path_factory, "torch-fsdp", TORCH_FSDP, FSDP_FLAGS)


@pytest.fixture(scope="module")
def torch_fsdp_torchrun(tmp_path_factory):
    return _torchrun(tmp_path_factory, "torch-fsdp-torchrun", TORCH_FSDP_PLAIN)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", FAULTS)
def test_torch_fsdp_survives_migration_crash_and_hang_bit_identically(
        tmp_path, torch_fsdp_torchrun, fault):
    _, summary, kinds = _with_fault(tmp_path, TORCH_FSDP, FSDP_FLAGS, fault)
    if "migrate" in kinds:
        # shard for shard: the leaver's share only (about half the state)
        assert 0 < summary["migrations"][0]["transfer_bytes"]
    for r in summary["recoveries"]:
        # no dp role holds a copy of another's shard: everyone went back to the newest
        # checkpoint and redid the committed steps after it (and nothing else)
        assert set(r["sources"].values()) == {"checkpoint"} and \
            r["rollback_step"] == newest_checkpoint_before(fault), r
        assert r["lost_steps"] == r["last_committed_step"] + 1 - r["rollback_step"], r
    assert summary["weights_sha256"] == torch_fsdp_torchrun


@pytest.mark.slow   # the default suite compares a run with faults to torchrun directly
@pytest.mark.timeout(300)
def test_torch_fsdp_under_trainmover_ends_with_the_weights_of_the_plain_script_under_torchrun(
        torch_fsdp_torchrun, torch_fsdp_base):
    assert torch_fsdp_torchrun == torch_fsdp_base["weights_sha256"]


def test_fsdp_state_without_dp_sharded_is_refused_with_the_flag_to_use(tmp_path):
    res, summary = launch(tmp_path / "run", ["--nproc", "2"], TORCH_FSDP, ("--steps", "3"))
    assert res.returncode != 0
    assert "sharded over the data-parallel axis" in res.stderr
    assert "launch with --dp-sharded" in res.stderr


def test_torch_fsdp_tp_example_is_the_plain_torchrun_script_with_at_most_10_changed_lines():
    changed = changed_lines(TORCH_FSDP_TP_PLAIN, TORCH_FSDP_TP)
    assert 0 < len(changed) <= 10, changed
    resilient = TORCH_FSDP_TP.read_text().splitlines()
    assert any("parallelize_module(block, mesh[\"tp\"]" in line for line in resilient)
    assert any("fully_shard(model, mesh=mesh[\"dp\"])" in line for line in resilient)


# the 2-D example's steps are the slowest (four processes, DTensor): as many as its events need
FSDP_TP_ARGS = ("--steps", "20")


@pytest.fixture(scope="module")
def torch_fsdp_tp_base(tmp_path_factory):
    return _base(tmp_path_factory, "torch-fsdp-tp", TORCH_FSDP_TP, FSDP_FLAGS, GRID, save=True,
                 args=FSDP_TP_ARGS)


def _dcp_tensors(folder) -> dict:
    """A DCP checkpoint read back offline (no process group), as full tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch

    out = folder.parent / (folder.name + ".pt")
    dcp_to_torch_save(str(folder), str(out))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


@pytest.mark.timeout(500)
@pytest.mark.parametrize("fault", ["migrate@3:w1",
                                   # the sharded rollback is in the default suite with FSDP2
                                   # alone and with pipelining
                                   pytest.param("crash@9:w0", marks=pytest.mark.slow),
                                   pytest.param("hang@9:w3", marks=pytest.mark.slow)])
def test_torch_fsdp_tp_survives_migration_crash_and_hang_bit_identically(
        tmp_path, torch_fsdp_tp_base, fault):
    """A first, a middle and a last role of the 2-D mesh; a migration of w1 rebuilds its dp
    and its tp group (the mesh's two dimensions) under the script's DeviceMesh. The script
    ends with a DCP checkpoint on the default group (composed from the dp and tp groups),
    which holds the uninterrupted run's tensors."""
    ckpt = tmp_path / "dcp"
    run_dir, summary, kinds = _with_fault(tmp_path, TORCH_FSDP_TP, FSDP_FLAGS, fault, GRID,
                                          FSDP_TP_ARGS + ("--save", str(ckpt)))
    # the joiner took over its warm-up's sharding decisions, rebound to its own meshes (the
    # weights below are bit-identical only if every rebound mesh has the joiner's
    # coordinates and groups)
    (rebound,) = events(run_dir, "meshes_rebound")
    assert rebound["meshes"] > 0
    if "migrate" in kinds:
        assert set(summary["migrations"][0]["affected_groups"]) == {"dp.pp0.tp1",
                                                                    "tp.dp0.pp0"}
    for r in summary["recoveries"]:
        assert set(r["sources"].values()) == {"checkpoint"} and \
            r["rollback_step"] == newest_checkpoint_before(fault), r
    assert summary["weights_sha256"] == torch_fsdp_tp_base["weights_sha256"]
    import torch

    got, want = _dcp_tensors(ckpt), _dcp_tensors(torch_fsdp_tp_base["dcp"])
    assert sorted(got) == sorted(want) and any(k.startswith("optim.state.") for k in got)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_fsdp_tp_under_trainmover_ends_with_the_weights_of_the_plain_script_under_torchrun(
        tmp_path, torch_fsdp_tp_base):
    assert _torchrun_weights(tmp_path, TORCH_FSDP_TP_PLAIN, nproc=4, args=FSDP_TP_ARGS) == \
        torch_fsdp_tp_base["weights_sha256"]


def test_torch_pipeline_example_is_the_plain_torchrun_script_with_at_most_10_changed_lines():
    changed = changed_lines(TORCH_PIPELINE_PLAIN, TORCH_PIPELINE)
    assert 0 < len(changed) <= 10, changed
    resilient = TORCH_PIPELINE.read_text().splitlines()
    assert any("PipelineStage(model, stage_index" in line for line in resilient)
    assert any("ScheduleGPipe(stage" in line for line in resilient)


@pytest.fixture(scope="module")
def torch_pipeline_base(tmp_path_factory):
    return _base(tmp_path_factory, "torch-pipeline", TORCH_PIPELINE, FSDP_FLAGS, PIPE)


@pytest.fixture(scope="module")
def torch_pipeline_torchrun(tmp_path_factory):
    return _torchrun(tmp_path_factory, "torch-pipeline-torchrun", TORCH_PIPELINE_PLAIN, 4)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("fault", [BOTH, *(pytest.param(f, marks=pytest.mark.slow) for f in
                                           ("migrate@3:w1", "crash@9:w0", "migrate@5:w2",
                                            "hang@9:w3"))])
def test_torch_pipeline_survives_migration_crash_and_hang_bit_identically(
        tmp_path, torch_pipeline_base, fault):
    """torch.distributed.pipelining (a GPipe schedule, FSDP2 per stage): the joiner's new
    schedule initialises its stage from the recording (the stayers initialised theirs at
    step 0 and send activations): no stayer takes part, nothing differs."""
    run_dir, summary, kinds = _with_fault(tmp_path, TORCH_PIPELINE, FSDP_FLAGS, fault, PIPE)
    replayed = events(run_dir, "stage_initialisation_replayed")
    assert len(replayed) == len(kinds), replayed      # one per joiner
    for rep in replayed:
        # the stage's vote and shape exchange on its pipeline group, the inference pass's
        # FSDP all-gathers on its data-parallel group (the groups of the script's
        # init_device_mesh: the second forwarder of each axis)
        ops = rep["operations"]
        assert ops.get("pp.1", 0) > 0 and ops.get("dp.1", 0) > 0, rep
    for r in summary["recoveries"]:
        assert set(r["sources"].values()) == {"checkpoint"} and \
            r["rollback_step"] == newest_checkpoint_before(fault), r
    # against the script's own uninterrupted run under trainmover (four torchrun processes
    # importing torch cost the suite twice as much; the slow suite compares that run with
    # torchrun's, and the other examples compare with torchrun directly)
    assert summary["weights_sha256"] == torch_pipeline_base["weights_sha256"]


@pytest.mark.slow   # the default suite compares a run with faults to this one
@pytest.mark.timeout(300)
def test_torch_pipeline_under_trainmover_ends_with_the_weights_of_the_plain_script_under_torchrun(
        torch_pipeline_torchrun, torch_pipeline_base):
    assert torch_pipeline_torchrun == torch_pipeline_base["weights_sha256"]



# --- a nanoGPT-style script: dropout, accumulation, a GradScaler, a StatefulDataLoader ------

def test_nanogpt_example_is_the_plain_script_with_at_most_10_changed_lines():
    changed = changed_lines(NANOGPT_PLAIN, NANOGPT)
    assert 0 < len(changed) <= 10, changed
    # what makes it a real script stays as it was: DDP, the DDP accumulation idiom, the
    # scaler's own step and update (the optimizer's step is the commit point: no
    # rt.commit), worker processes reading a stateful loader, dropout
    text = NANOGPT.read_text()
    for kept in ("    model = DDP(model)", "model.require_backward_grad_sync = ",
                 "        scaler.step(optimizer)", "        scaler.update()",
                 "num_workers=2", "nn.Dropout(dropout)"):
        assert kept in text, kept
    assert "rt.commit" not in text
    assert "master_process = rt.is_main" in text


@pytest.fixture(scope="module")
def nanogpt_base(tmp_path_factory):
    pytest.importorskip("torchdata.stateful_dataloader")
    return _base(tmp_path_factory, "nanogpt", NANOGPT)


@pytest.fixture(scope="module")
def nanogpt_torchrun(tmp_path_factory):
    pytest.importorskip("torchdata.stateful_dataloader")
    return _torchrun(tmp_path_factory, "nanogpt-torchrun", NANOGPT_PLAIN)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", FAULTS)
def test_nanogpt_survives_migration_crash_and_hang_bit_identically(tmp_path, nanogpt_torchrun,
                                                                   fault):
    """Its dropout draws from the global generator in every micro-step and its batches are
    the loader's position: a joiner continues both exactly where the leaver (or, after a
    failure, the step's first attempt) was."""
    _, summary, _ = _with_fault(tmp_path, NANOGPT, (), fault)
    for r in summary["recoveries"]:
        assert r["lost_steps"] == 0, r
    assert summary["weights_sha256"] == nanogpt_torchrun


@pytest.mark.timeout(400)
def test_nanogpt_precopied_migration_ends_on_the_torchrun_weights(tmp_path, nanogpt_torchrun):
    """A pre-copy (migration.precopy) through the public API, over several steps (chunks
    of 0.25 MB of the 3.35 MB of parameters: one a step, 29 steps, once started the
    migration at step 8 on a loaded machine and left too few of the 40 steps for the
    switch): the optimizer stepped through a GradScaler (which may skip a step), torch's
    DDP, the script's learning-rate schedule written into the param groups each step,
    dropout and a stateful loader (state the switch moves, not the replay)."""
    run_dir, summary, _ = _with_fault(tmp_path, NANOGPT, (
        "--precopy", "--migration.precopy_chunk_mb=0.25"), "migrate@3:w1")
    assert summary["weights_sha256"] == nanogpt_torchrun
    (sent,) = events(run_dir, "precopy_sent")
    assert not events(run_dir, "precopy_abandoned") and not events(run_dir, "precopy_refused")
    assert events(run_dir, "precopy_verified")
    (leaver,) = [e for e in events(run_dir, "migration_switched") if e["part"] == "leaver"]
    assert leaver["precopy_steps"] > 0 and leaver["transfer_bytes"] < sent["bytes"] / 2


@pytest.mark.slow   # the default suite compares a run with faults to torchrun directly
@pytest.mark.timeout(300)
def test_nanogpt_under_trainmover_ends_with_the_weights_of_the_plain_script_under_torchrun(
        nanogpt_torchrun, nanogpt_base):
    assert nanogpt_torchrun == nanogpt_base["weights_sha256"]
