"""Replica agreement: data-parallel replicas' state digests are compared at the end and,
with --verify-every, periodically; a replica that diverged is named, and the summary says
``replicas_agree``."""
import json
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
    assert summary["replica_checks"] == [4, 8, 12]
    found = events(run_dir, "replicas_disagree")
    if diverge_at < 0:
        assert res.returncode == 0, res.stderr[-3000:]
        assert summary["replicas_agree"] is True and found == []
    else:
        # the summary and final state are written, and the job fails: which replica is
        # "the" model is undefined
        assert res.returncode == 1 and "replicas hold different states at the end" in \
            res.stderr, res.stderr[-3000:]
        assert summary["replicas_agree"] is False
        # diverged after step 5: the check before step 4 agreed, those before 8 and 12 not
        assert [e["step"] for e in found] == [8, 12]
        replicas = found[0]["replicas"]
        assert {r: v["worker"] for r, v in replicas.items()} == \
            {"dp0.pp0.tp0": "w0", "dp1.pp0.tp0": "w1"}
        assert replicas["dp0.pp0.tp0"]["digest"] != replicas["dp1.pp0.tp0"]["digest"]


@pytest.mark.timeout(300)
def test_a_disagreement_the_user_allowed_ends_with_exit_code_0(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    res, summary = launch(tmp_path / "run", ["--nproc", "2", "--steps", "12"], script, ["5"],
                          extra=["--standbys", "0", "--allow-replica-disagreement"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary["replicas_agree"] is False


SEEDED_PER_RANK = textwrap.dedent("""
    import json
    import sys
    import torch
    import trainmover

    rt = trainmover.init()
    torch.manual_seed(1337 + rt.dp_rank)      # each rank its own initial weights
    model = rt.data_parallel(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.register(model=model, optimizer=opt)
    syncs = []
    for step in rt.steps(4):
        for micro in range(2):            # gradient accumulation, the DDP way
            model.require_backward_grad_sync = micro == 1
            g = torch.Generator().manual_seed(10 * step + micro)
            x = torch.randn(4, 8, generator=g)[rt.dp_rank * 2:(rt.dp_rank + 1) * 2]
            before = rt.groups.dp.group.accounting()["coll"]
            model(x).pow(2).mean().backward()
            syncs.append(rt.groups.dp.group.accounting()["coll"] - before)
        if rt.commit():
            opt.step()
        opt.zero_grad()
    if not rt.sandbox:
        with open(sys.argv[1] + f".{rt.dp_rank}", "w") as f:
            json.dump(syncs, f)
""")


@pytest.mark.timeout(300)
def test_replicas_seeded_differently_start_from_the_first_ones_weights_as_under_ddp(tmp_path):
    """rt.data_parallel aligns the replicas at construction (DDP broadcasts rank 0's
    parameters and buffers); and require_backward_grad_sync = False, DDP's accumulation
    idiom, skips the all-reduce of that backward."""
    script = tmp_path / "train.py"
    script.write_text(SEEDED_PER_RANK)
    out = tmp_path / "syncs"
    res, summary = launch(tmp_path / "run", ["--nproc", "2"], script, [str(out)],
                          extra=["--standbys", "0"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary["replicas_agree"] is True
    for rank in (0, 1):
        syncs = json.loads((tmp_path / f"syncs.{rank}").read_text())
        # per step: the first micro-step's backward all-reduces nothing, the second does
        # (4 steps, and step 1 twice: a job without a standby rehearses it, data.rehearse)
        assert len(syncs) == 2 * 5, syncs
        assert syncs[0::2] == [0] * 5 and all(n > 0 for n in syncs[1::2]), syncs
