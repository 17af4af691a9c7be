"""What a ported script may rely on (issue: "a real training script ported in ten lines"):
a step redone after a failure draws the same random numbers as its first attempt, and
``rt.is_main`` names one process, never a standby's warm-up."""
import json
import textwrap

import pytest

from test_examples import launch

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
@pytest.mark.parametrize("fault", ["crash@8:w1:allreduce", "hang@8:w0:allreduce"])
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
