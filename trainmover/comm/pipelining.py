"""``torch.distributed.pipelining`` schedules through migrations and failures.

A schedule initialises its stages in its first ``step()``: the stages vote on how to infer
the tensors they exchange (``_warmup_p2p``), then, unless the shapes were given, run a
forward (and backward) pass to infer them and exchange what they found as pickled objects
(``_prepare_forward_infra`` / ``_prepare_backward_infra``). Every stage of the pipeline, and
through FSDP every data-parallel replica of each stage, takes part at the same step.

A joiner's script builds a new schedule, whose first ``step()`` would start that exchange
while the stayers, initialised at step 0, send activations: the two would not match. So a
joiner does not run it against the job. It answers it from the recording the job's worker of
its stage made at step 0 (``comm/record.py``: the same stage's operations, with their
outputs), on no network, and then goes live for the rest of the step. What the exchange
yields (shapes, dtypes, the vote) is the same for every replica of a stage.

Hooked in one place, ``_PipelineSchedule._initialize_pp_stages`` (torch 2.13: every schedule
initialises its stages through it), when a run of the script enters its step loop; the
hook asks the process's current ``TorchGroups`` what to do (record, replay or pass).
"""
from __future__ import annotations

import sys

MODULE = "torch.distributed.pipelining.schedules"
_hooked = False


def hook() -> None:
    """Wrap the schedules' stage initialisation, once per process, if the script imported
    torch's pipelining (imported here otherwise it is not: 2 s of start-up for every
    script)."""
    global _hooked
    if _hooked or MODULE not in sys.modules:
        return
    base = getattr(sys.modules[MODULE], "_PipelineSchedule", None)
    original = getattr(base, "_initialize_pp_stages", None)
    if original is None:
        raise RuntimeError(
            "trainmover: this torch's pipelining schedules have no "
            "_PipelineSchedule._initialize_pp_stages (torch 2.13 has): a joiner could not "
            "initialise a schedule without disturbing the stayers; use torch 2.13")

    def _initialize_pp_stages(self, *args, **kwargs):
        from trainmover.comm.torch_groups import current

        groups = current()
        if groups is None:
            return original(self, *args, **kwargs)
        with groups.stage_initialisation():
            return original(self, *args, **kwargs)

    base._initialize_pp_stages = _initialize_pp_stages
    _hooked = True
