"""Job files (``--config job.toml``), ``--section.field=value`` overrides and ``trainmover
config`` (``core/config_file.py``, ``docs/config-files.md``). Unit tests, no jobs, but the
last one (a 3-step run whose model and optimizer come from a job file)."""
import dataclasses
import json
import re
import subprocess
import sys

import pytest

from trainmover.cli import build_config, build_launch_config, main, parse_command_line
from trainmover.core.config import JobConfig
from trainmover.core.config_file import (apply_overrides, apply_table, field_docs,
                                         split_overrides, to_toml, tomllib)
from trainmover.core.topology import Layout
from trainmover.recipes import RECIPES, get_recipe


def run_cfg(*argv) -> JobConfig:
    """The configuration `trainmover run ARGV` would launch."""
    return build_config(parse_command_line(["run", *argv]))


def write(tmp_path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# one field per section, each different from the demo recipe and from the defaults
EVERY_SECTION = """
name = "from-file"
faults = [{ worker = "w1", point = "backward", step = 3 }]

[layout]
dp = 1
pp = 2
tp = 2

[model]
n_layers = 6
d_model = 96
n_heads = 6
dropout = 0.1

[train]
steps = 12
lr = 1e-3
min_lr = 1e-4
global_batch = 8
num_microbatches = 2
compile = true
bucket_mb = 10     # an int where a float is expected: fine

[data]
rehearse = false

[process]
deterministic = false
command = ["-m", "trainmover.gpt_trainer"]

[hosts]
nproc_per_node = 4

[comm]
backend = "gloo"

[standby]
count = 2
recording_dir = "/tmp/rec"

[migration]
precopy = true
precopy_chunk_mb = 16

[health]
heartbeat_timeout_s = 5.0

[recovery]
max_attempts = 2

[checkpoint]
every = 7

[snapshot]
every = 3

[straggler]
policy = "migrate"

[maintenance]
rebalance_every_s = 30.0

[dashboard]
port = 0

[controller]
restart = "manual"

[agent]
shutdown_ack_s = 2.5

[baseline]
restart_on_failure = true
"""


def test_a_job_file_sets_fields_of_every_section(tmp_path):
    table = tomllib.loads(EVERY_SECTION)
    sections = [f.name for f in dataclasses.fields(JobConfig)]
    assert sorted(table) == sorted(sections)      # the file above covers every section
    cfg = run_cfg("--config", write(tmp_path, EVERY_SECTION))
    assert cfg.name == "from-file"
    assert cfg.faults == [{"worker": "w1", "point": "backward", "step": 3, "kind": "crash",
                           "factor": None}]
    assert cfg.layout == Layout(1, 2, 2)
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads, cfg.model.dropout) == \
        (6, 96, 6, 0.1)
    assert (cfg.train.steps, cfg.train.lr, cfg.train.min_lr, cfg.train.global_batch,
            cfg.train.compile) == (12, 1e-3, 1e-4, 8, True)
    assert cfg.train.bucket_mb == 10.0 and isinstance(cfg.train.bucket_mb, float)
    assert cfg.data.rehearse is False and cfg.process.deterministic is False
    assert cfg.hosts.nproc_per_node == 4 and cfg.comm.backend == "gloo"
    assert cfg.standby.count == 2 and cfg.standby.recording_dir == "/tmp/rec"
    assert cfg.migration.precopy is True and cfg.migration.precopy_chunk_mb == 16.0
    assert cfg.health.heartbeat_timeout_s == 5.0 and cfg.recovery.max_attempts == 2
    assert cfg.checkpoint.every == 7 and cfg.snapshot.every == 3
    assert cfg.straggler.policy == "migrate" and cfg.maintenance.rebalance_every_s == 30.0
    assert cfg.dashboard.port == 0 and cfg.controller.restart == "manual"
    assert cfg.agent.shutdown_ack_s == 2.5 and cfg.baseline.restart_on_failure is True
    # fields the file leaves out keep the recipe's values
    demo = get_recipe("demo")
    assert cfg.model.seq_len == demo.model.seq_len and cfg.train.seed == demo.train.seed


def test_none_unsets_an_optional_field(tmp_path):
    path = write(tmp_path, '[dashboard]\nport = "none"\n[hosts]\nnproc_per_node = "None"\n')
    cfg = run_cfg("--dashboard", "8000", "--config", path)   # the flag beats the file
    assert cfg.dashboard.port == 8000 and cfg.hosts.nproc_per_node is None
    assert run_cfg("--config", path).dashboard.port is None


@pytest.mark.parametrize("text, message", [
    ("[training]\nsteps = 3\n",
     r"job file '.*job.toml': unknown section 'training' \(did you mean 'train'\?\); "
     r"known: name, faults, layout, model, train"),
    ("[train]\nstpes = 3\n",
     r"job file '.*': unknown field train.stpes \(did you mean 'train.steps'\?\); "
     r"fields of \[train\]: steps, global_batch"),
    ("[train]\nvocab_size = 512\n", r"unknown field train.vocab_size \(did you mean "
                                    r"'model.vocab_size'\?\)"),
    ("[layout]\ndp_shard = true\n",
     r"unknown field layout.dp_shard \(did you mean 'layout.dp_sharded'\?\)"),
    ('[train]\nsteps = "10"\n', r"job file '.*': train.steps must be an int, got '10'$"),
    ("[train]\nsteps = 1.5\n", r"train.steps must be an int, got 1.5$"),
    ('[train]\ncompile = "yes"\n', r"train.compile must be true or false, got 'yes'$"),
    ("[train]\nlr = true\n", r"train.lr must be a number \(float\), got True$"),
    ("[dashboard]\nport = 1.5\n", r'dashboard.port must be an int or "none", got 1.5$'),
    ("[process]\ncommand = \"train.py\"\n", r"process.command must be a list, got 'train.py'"),
    ("model = 3\n", r"model must be a table \(\[model\]\), got 3"),
    ("[layout]\ndp = 0\n", r"layout axis dp must be a positive integer, got 0"),
    ("faults = [{ worker = \"w1\", pont = \"forward\" }]\n",
     r"unknown field faults\[0\].pont \(did you mean 'point'\?\)"),
    ("faults = [{ worker = \"w1\" }]\n", r"faults\[0\] needs point"),
    ("faults = [{ worker = \"w1\", point = \"lunch\" }]\n", r"unknown fault point 'lunch'"),
    ("[train\nsteps = 3\n", r"job file '.*job.toml' is not valid TOML: "),
])
def test_job_file_errors_name_the_problem(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        run_cfg("--config", write(tmp_path, text))


def test_job_file_values_are_validated(tmp_path):
    with pytest.raises(ValueError, match=r"model.d_model=128 is not divisible by "
                                         r"model.n_heads=3"):
        run_cfg("--config", write(tmp_path, "[model]\nn_heads = 3\n"))
    with pytest.raises(ValueError, match=r"job file '/nonexistent/job.toml': No such file"):
        run_cfg("--config", "/nonexistent/job.toml")


# --- overrides -------------------------------------------------------------------------------
def test_split_overrides_takes_only_section_field_settings():
    argv = ["run", "--train.lr=1e-3", "--model.n_layers", "8", "--data", "a.b.txt",
            "--run-dir=runs/x.y", "--train.compile", "--steps", "3", "--dashboard.port", "none",
            "--process.command=-m,pkg.mod", "--train.warmup-steps", "-1", "--train.compile"]
    rest, found = split_overrides(argv)
    assert rest == ["run", "--data", "a.b.txt", "--run-dir=runs/x.y", "--steps", "3"]
    assert found == [("train.lr", "1e-3"), ("model.n_layers", "8"), ("train.compile", None),
                     ("dashboard.port", "none"), ("process.command", "-m,pkg.mod"),
                     ("train.warmup-steps", "-1"), ("train.compile", None)]


def test_overrides_are_converted_by_the_fields_types():
    cfg = run_cfg("--recipe", "tiny", "--train.lr=1e-2", "--model.n_layers", "2",
                  "--train.compile", "--data.rehearse=no", "--health.recover", "0",
                  "--process.deterministic=YES", "--standby.replenish=1",
                  "--comm.backend=gloo", "--dashboard.port=0", "--dashboard.port", "none",
                  "--hosts.nproc_per_node=2", "--train.warmup-steps=1", "--layout.dp=2",
                  "--layout.dp_sharded=false", "--train.bucket_mb=5")
    assert cfg.train.lr == 1e-2 and isinstance(cfg.train.lr, float)
    assert cfg.model.n_layers == 2 and cfg.train.compile is True
    assert cfg.data.rehearse is False and cfg.health.recover is False
    assert cfg.process.deterministic is True and cfg.standby.replenish is True
    assert cfg.comm.backend == "gloo" and cfg.dashboard.port is None     # the last one wins
    assert cfg.hosts.nproc_per_node == 2 and cfg.train.warmup_steps == 1
    assert cfg.layout == Layout(2, 1, 1) and cfg.train.bucket_mb == 5.0


def test_list_overrides_take_toml_or_commas(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = JobConfig()
    apply_overrides(cfg, [("process.command", f'["{script}", "--lr", "0.1"]')])
    assert cfg.process.command == [str(script), "--lr", "0.1"]
    apply_overrides(cfg, [("process.command", f"{script}, --epochs,3")])
    assert cfg.process.command == [str(script), "--epochs", "3"]
    with pytest.raises(ValueError, match=r"--process.command=\[1,: process.command must be "
                                         r"a list, as TOML"):
        apply_overrides(cfg, [("process.command", "[1,")])


@pytest.mark.parametrize("argv, message", [
    (["--trian.lr=0.1"], r"^--trian.lr=0.1: unknown section 'trian' \(did you mean "
                         r"'train'\?\); known: layout, model, train, data"),
    (["--job.name=x"], r"^--job.name=x: unknown section 'job'; known: layout"),
    (["--train.stpes", "3"], r"^--train.stpes=3: unknown field train.stpes \(did you mean "
                             r"'train.steps'\?\); fields of \[train\]: steps"),
    (["--train.n_layers=2"], r"unknown field train.n_layers \(did you mean "
                             r"'model.n_layers'\?\)"),
    (["--train.lr.x=1"], r"unknown field train.lr.x"),
    (["--train.steps=ten"], r"^--train.steps=ten: train.steps must be an int, got 'ten'$"),
    (["--train.steps=2.5"], r"train.steps must be an int, got '2.5'$"),
    (["--train.lr=fast"], r"^--train.lr=fast: train.lr must be a number \(float\), "
                          r"got 'fast'$"),
    (["--train.compile=maybe"], r"^--train.compile=maybe: train.compile must be true or false "
                                r"\(or 1/0, yes/no\), got 'maybe'$"),
    (["--dashboard.port=http"], r'dashboard.port must be an int or "none", got \'http\'$'),
    (["--train.lr"], r"^--train.lr: needs a value: --train.lr=VALUE or --train.lr VALUE$"),
    (["--layout.tp=0"], r"^--layout.tp=0: layout axis tp must be a positive integer, got 0"),
    (["--train.lr=-1"], r"train.lr=-1.0, train.min_lr=0.0003: need 0 <= min_lr <= lr"),
    (["--model.n_heads=3"], r"model.d_model=128 is not divisible by model.n_heads=3"),
    (["--comm.backend=mpi"], r"comm.backend must be 'auto', 'nccl' or 'gloo', got 'mpi'"),
])
def test_bad_overrides_name_the_problem(argv, message):
    with pytest.raises(ValueError, match=message):
        run_cfg(*argv)


def test_a_bad_override_exits_2_before_anything_starts(capsys, monkeypatch):
    import trainmover.control.coordinator as coordinator

    def no_job(*args, **kwargs):
        raise AssertionError("a job was started")

    monkeypatch.setattr(coordinator, "Coordinator", no_job)
    assert main(["run", "--recipe", "tiny", "--train.stpes=3"]) == 2
    assert "trainmover: error: --train.stpes=3: unknown field train.stpes (did you mean " \
           "'train.steps'?)" in capsys.readouterr().err
    assert main(["launch", "--nproc", "1", "--train.steps=x", "--", "python", __file__]) == 2
    assert "train.steps must be an int, got 'x'" in capsys.readouterr().err


def test_overrides_are_not_taken_by_other_commands():
    with pytest.raises(SystemExit):      # argparse: unrecognized arguments
        parse_command_line(["status", "--run-dir", "r", "--train.lr=1"])


# --- precedence ------------------------------------------------------------------------------
def test_recipe_then_file_then_flags_then_overrides(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 7\nseed = 5\nlr = 2e-3\n"
                           "[layout]\ndp = 1\npp = 2\n[standby]\ncount = 1\n"
                           "[checkpoint]\nevery = 4\n")
    tiny = get_recipe("tiny")
    cfg = run_cfg("--recipe", "tiny", "--config", path)
    assert (cfg.train.steps, cfg.train.seed, cfg.train.lr) == (7, 5, 2e-3)    # file > recipe
    assert cfg.model == tiny.model and cfg.name == "tiny"                      # the recipe's
    assert cfg.layout == Layout(1, 2, 1) and cfg.standby.count == 1
    cfg = run_cfg("--recipe", "tiny", "--config", path, "--steps", "9", "--seed", "6",
                  "--dp", "2", "--standbys", "2", "--checkpoint-every", "3")
    assert (cfg.train.steps, cfg.train.seed, cfg.layout, cfg.standby.count,
            cfg.checkpoint.every) == (9, 6, Layout(2, 2, 1), 2, 3)          # flags > file
    assert cfg.train.lr == 2e-3
    cfg = run_cfg("--recipe", "tiny", "--train.steps=11", "--config", path, "--steps", "9",
                  "--standby.count=0", "--standbys", "2", "--layout.dp=1", "--dp", "2")
    assert (cfg.train.steps, cfg.standby.count, cfg.layout) == (11, 0, Layout(1, 2, 1))


def test_dedicated_flags_still_work_without_a_file():
    cfg = run_cfg("--recipe", "tiny", "--steps", "3", "--dp", "2", "--pp", "2", "--seed", "9",
                  "--standbys", "1", "--checkpoint-every", "2", "--stragglers", "off",
                  "--device", "cpu", "--compile", "--verify-every", "1")
    assert (cfg.train.steps, cfg.layout, cfg.train.seed, cfg.standby.count,
            cfg.checkpoint.every, cfg.straggler.policy, cfg.train.compile,
            cfg.health.verify_every) == (3, Layout(2, 2, 1), 9, 1, 2, "off", True, 1)
    assert run_cfg() == get_recipe("demo").validate()


def test_launch_takes_a_job_file_and_overrides(tmp_path):
    script = str(tmp_path / "train.py")
    write(tmp_path, "", "train.py")
    path = write(tmp_path, 'name = "mine"\n[layout]\ndp = 2\ndp_sharded = true\n'
                           "[train]\nsteps = 30\nlr = 0.5\n[standby]\ncount = 1\n")

    def launch_cfg(*argv):
        args = parse_command_line(["launch", *argv, "--", "python", script])
        return build_launch_config(args, [script])

    cfg = launch_cfg()                       # as before: the defaults, no step count
    assert (cfg.name, cfg.layout, cfg.train.steps) == ("train", Layout(1, 1, 1), 0)
    cfg = launch_cfg("--config", path)
    assert (cfg.name, cfg.layout, cfg.train.steps, cfg.train.lr, cfg.standby.count) == \
        ("mine", Layout(2, 1, 1, dp_sharded=True), 30, 0.5, 1)
    assert cfg.process.command == [script]   # the command after '--'
    cfg = launch_cfg("--config", path, "--nproc", "4", "--steps", "8", "--standby.count=0")
    assert (cfg.layout, cfg.train.steps, cfg.standby.count) == \
        (Layout(4, 1, 1, dp_sharded=True), 8, 0)


def test_resume_refuses_a_job_file_and_overrides(tmp_path):
    from trainmover.cli.jobs import _resume_coordinator

    args = parse_command_line(["run", "--resume", str(tmp_path), "--config", "j.toml",
                               "--train.lr=1"])
    with pytest.raises(ValueError, match=r"own settings \(job.json\): drop --config, "
                                         r"--train.lr$"):
        _resume_coordinator(args)


# --- writing job files -----------------------------------------------------------------------
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_config_prints_a_complete_job_file_that_round_trips(recipe, tmp_path, capsys):
    assert main(["config", "--recipe", recipe]) == 0
    text = capsys.readouterr().out
    table = tomllib.loads(text)
    for f in dataclasses.fields(JobConfig):       # every section and every field
        assert f.name in table
        value = getattr(JobConfig(), f.name)
        if dataclasses.is_dataclass(value):
            assert sorted(table[f.name]) == sorted(x.name for x in dataclasses.fields(value))
    path = write(tmp_path, text)
    other = "tiny" if recipe != "tiny" else "small"      # the file alone decides
    assert run_cfg("--recipe", other, "--config", path) == get_recipe(recipe)
    assert run_cfg("--config", path) == get_recipe(recipe)


def test_config_applies_a_file_and_overrides(tmp_path, capsys):
    path = write(tmp_path, "[train]\nsteps = 5\n")
    assert main(["config", "--recipe", "tiny", "--config", path, "--model.n_layers=2"]) == 0
    table = tomllib.loads(capsys.readouterr().out)
    assert table["train"]["steps"] == 5 and table["model"]["n_layers"] == 2
    assert main(["config", "--recipe", "nope"]) == 2
    assert "unknown recipe 'nope'" in capsys.readouterr().err


def test_unusual_values_round_trip():
    cfg = JobConfig(name='a "quoted"\\name\twith\nlines \x01 and ünïcode')
    cfg.layout = Layout(2, 1, 2, dp_sharded=True)
    cfg.process.command = ["-m", "pkg.train", "--flag=\"x\""]
    cfg.dashboard.port = 0
    cfg.hosts.nproc_per_node = 4
    cfg.standby.recording_dir = "/data/rec"
    cfg.baseline.restart_at_step = 5
    cfg.train.lr = 1 / 3
    cfg.train.eps = 1e-20
    cfg.faults = [{"worker": "w0", "point": "forward", "step": 2, "kind": "slow",
                   "factor": 1.3},
                  {"worker": "joiner", "point": "joiner_start", "step": None, "kind": "crash",
                   "factor": None}]
    back = apply_table(JobConfig(), tomllib.loads(to_toml(cfg)))
    assert back == cfg


def test_the_job_file_carries_the_fields_docs():
    header, docs = field_docs(JobConfig().process.__class__)
    assert docs["store_host"] == "the address the job's store listens on"      # trailing
    assert docs["deterministic"].startswith("On CUDA, run torch's deterministic kernels")
    assert header.startswith("What each worker and standby process runs")
    _, docs = field_docs(JobConfig().data.__class__)                        # docstring entries
    assert docs["source"].startswith("``builtin`` (byte-level tokens")
    assert docs["format"].startswith("``text`` (bytes as tokens")
    _, docs = field_docs(JobConfig().dashboard.__class__)                   # continued
    assert docs["refresh_s"] == ("the page's poll period; the server reads the logs at most "
                                 "this often, however many pages are open")
    text = to_toml(get_recipe("demo"))
    assert re.search(r"# Failure handling on: heartbeats, .*\n(# .*\n)*recover = true\n", text)
    assert "# `builtin` (byte-level tokens" in text and "[straggler]\n# `off` (not" in text


def test_job_files_need_no_torch():
    code = ("import sys, trainmover.core.config_file, trainmover.cli.config; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- the one job -----------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_the_built_in_trainer_uses_the_files_model_and_optimizer(tmp_path, capsys):
    """A 3-step run of the built-in trainer: its final weights have the job file's model
    shape and its steps the file's learning-rate schedule."""
    from trainmover.core.events import read_jsonl
    from trainmover.train.checkpoint import load_canonical
    from trainmover.train.engine import lr_at

    path = write(tmp_path, "[model]\nn_layers = 2\nd_model = 32\nn_heads = 2\nseq_len = 16\n"
                           "[train]\nsteps = 8\nglobal_batch = 4\nnum_microbatches = 1\n"
                           "lr = 0.02\nmin_lr = 0.002\nwarmup_steps = 1\n"
                           "[checkpoint]\nevery = 0\n")
    run_dir = str(tmp_path / "run")
    assert main(["run", "--recipe", "tiny", "--config", path, "--dp", "1", "--pp", "1",
                 "--train.steps=3", "--run-dir", run_dir, "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    state = load_canonical(summary["checkpoint"])
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    assert (256, 32) in shapes.values() and (16, 32) in shapes.values()   # vocab, positions
    assert (128, 32) in shapes.values()                        # the MLP: 4 x d_model
    assert max(int(m) for name in shapes for m in re.findall(r"blocks\.(\d+)\.", name)) == 1
    metrics = [m for m in read_jsonl(f"{run_dir}/metrics.jsonl") if "lr" in m]
    assert sorted({m["step"] for m in metrics}) == [0, 1, 2]
    for m in metrics:
        assert m["lr"] == pytest.approx(lr_at(m["step"], 0.02, 0.002, 1, 3))
