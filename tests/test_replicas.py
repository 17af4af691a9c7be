"""Replica agreement: data-parallel replicas' state digests are compared at the end and,
with --verify-every, periodically; a replica that diverged is named, and the summary says
``replicas_agree``."""
import json
import sys
import textwrap

import pytest

from test_examples import events, launch

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import trainmover

    diverge_at = int(sys.argv[1])
    rt = trainmover.init()
    torch.manual_seed(0)
    model = rt.data_parallel(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.register(model=model, optimizer=opt)
    for step in rt.steps(12):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 8, generator=g)[rt.dp_rank * 2:(rt.dp_rank + 1) * 2]
        loss = model(x).pow(2).mean()
        loss.backward()
        if rt.commit(loss=loss.item()):
            opt.step()
        opt.zero_grad()
        if step == diverge_at and rt.dp_rank == 1 and not rt.sandbox:
            with torch.no_grad():   # a change outside the gradient all-reduce: a divergence
                model.module.weight[0, 0] += 1e-3
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("diverge_at", [-1, 5], ids=["agree", "diverged"])
def test_replicas_are_compared_and_a_diverged_one_is_named(tmp_path, diverge_at):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    res, summary = launch(run_dir, ["--nproc", "2", "--steps", "12"], script,
                          [str(diverge_at)], extra=["--verify-every", "4", "--standbys", "0"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary["replica_checks"] == [4, 8, 12]
    found = events(run_dir, "replicas_disagree")
    if diverge_at < 0:
        assert summary["replicas_agree"] is True and found == []
    else:
        assert summary["replicas_agree"] is False
        # diverged after step 5: the check before step 4 agreed, those before 8 and 12 not
        assert [e["step"] for e in found] == [8, 12]
        replicas = found[0]["replicas"]
        assert {r: v["worker"] for r, v in replicas.items()} == \
            {"dp0.pp0.tp0": "w0", "dp1.pp0.tp0": "w1"}
        assert replicas["dp0.pp0.tp0"]["digest"] != replicas["dp1.pp0.tp0"]["digest"]
