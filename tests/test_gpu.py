"""GPU correctness of the same runtime; skipped where CUDA is absent (run by `make test-gpu`
on a GPU machine; needs nothing from the network).

With enough GPUs for every process, each worker and standby gets its own device and the
groups run NCCL; with fewer (one GPU), the processes share the GPUs, compute on CUDA and
communicate over gloo through host memory (``comm.backend``). Either way a planned
migration and a crash end with the uninterrupted run's weights on the same hardware, and the
figures (step time, downtime, transfer bandwidth) are printed for the record
(``TRAINMOVER_GPU_REPORT`` names a file to also write them to)."""
import json
import os

import pytest
import torch

from trainmover.control.coordinator import run_job
from trainmover.core.events import read_jsonl
from trainmover.cli import apply_worker_faults
from trainmover.core.faults import Inject
from trainmover.core.topology import Layout
from trainmover.recipes import get_recipe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 48   # steps take milliseconds here: room for the migration to finish before the crash


def gpu_job(dp: int, pp: int, standbys: int):
    cfg = get_recipe("tiny")
    cfg.layout = Layout(dp, pp, 1)
    cfg.train.steps = STEPS
    cfg.train.threads_per_worker = 1
    cfg.process.device = "cuda"
    # a host tensor handed to a group is an error here too, not only under NCCL (gloo
    # through host memory would accept it)
    cfg.comm.check_devices = True
    cfg.override(standby_count=standbys, health_heartbeat_timeout_s=5.0,
                 recovery_report_timeout_s=10.0)
    return cfg.validate()


def layout_for(gpus: int) -> tuple[int, int, int]:
    """dp, pp, standbys: a DP x PP job (so the crash has a replica and the pipeline's
    point-to-point path is used) with one standby per event."""
    if gpus >= 6:
        return 2, 2, 2       # NCCL: 6 processes, one GPU each
    if gpus >= 4:
        return 2, 1, 2
    return 2, 2, 2           # shared GPUs, gloo through host memory


def plain_run(tmp_path):
    """The job for this machine's GPUs and its uninterrupted run."""
    cfg = gpu_job(*layout_for(torch.cuda.device_count()))
    return cfg, run_job(cfg, str(tmp_path / "plain"), quiet=True, timeout_s=600)


@pytest.mark.timeout(900)
def test_migration_and_crash_on_gpu_match_the_uninterrupted_run(tmp_path):
    gpus = torch.cuda.device_count()
    dp, pp, standbys = layout_for(gpus)
    cfg, plain = plain_run(tmp_path)
    eventful = type(cfg).from_dict(cfg.to_dict())
    apply_worker_faults(eventful, [Inject("crash", 36, "w1", "backward")])
    moved = run_job(eventful, str(tmp_path / "events"), quiet=True, timeout_s=600,
                    injects=[Inject("migrate", 4, "w2")])
    (mig,) = moved["migrations"]
    assert mig["status"] == "done", mig
    (rec,) = moved["recoveries"]
    job = json.load(open(tmp_path / "events" / "job.json"))
    steady = [m["step_time_s"] for m in read_jsonl(str(tmp_path / "plain" / "metrics.jsonl"))[2:]]
    report = {
        "gpus": gpus, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "layout": f"dp{dp} pp{pp}", "standbys": standbys, "backend": job["comm"]["backend"],
        "median_step_s": sorted(steady)[len(steady) // 2],
        "migration_downtime_s": mig["downtime_s"], "migration_phases": mig["phases"],
        "transfer_bytes": mig["transfer_bytes"],
        "transfer_GBps": mig["transfer_bytes"] / mig["phases"]["transfer_s"] / 1e9,
        "recovery_downtime_s": rec["downtime_s"], "recovery_sources": rec["sources"],
        "weights_equal": moved["weights_sha256"] == plain["weights_sha256"],
    }
    print(json.dumps(report, indent=2))
    if os.environ.get("TRAINMOVER_GPU_REPORT"):
        with open(os.environ["TRAINMOVER_GPU_REPORT"], "w") as f:
            json.dump(report, f, indent=2)
    assert mig["status"] == "done" and rec["status"] == "done"
    assert job["comm"]["backend"] == ("nccl" if gpus >= dp * pp + standbys else "gloo")
    assert moved["weights_sha256"] == plain["weights_sha256"]


def _device_of_each_process(run_dir: str) -> dict[str, int]:
    out = {}
    for e in read_jsonl(os.path.join(run_dir, "events.jsonl")):
        if e["event"] == "worker_started" and "cuda_device" in e:
            out[e["worker"]] = e["cuda_device"]
    return out


@pytest.mark.timeout(600)
def test_each_process_is_placed_on_its_own_gpu_where_there_are_enough(tmp_path):
    gpus = torch.cuda.device_count()
    cfg = gpu_job(2, 1, 1)
    cfg.train.steps = 3
    run_job(cfg, str(tmp_path / "run"), quiet=True, timeout_s=300)
    placed = _device_of_each_process(str(tmp_path / "run"))
    assert set(placed) == {"w0", "w1", "s0"}
    if gpus >= 3:
        assert len(set(placed.values())) == 3
    else:
        assert set(placed.values()) <= set(range(gpus))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["adamw", "adamw-fused", "sgd-momentum"])
def test_a_precopy_replayed_on_cuda_is_bit_identical(kind):
    """The joiner's replay of the leaver's optimizer steps on CUDA (torch's default AdamW
    there is the foreach one; the fused one too), over gloo through host memory."""
    from mp_harness import run_processes, values
    from test_state import _precopy_pair, check_precopy_pair

    res = values(run_processes(_precopy_pair, 2, kind, True, 2, None, "cuda"))
    check_precopy_pair(res, None)


@pytest.mark.timeout(900)
def test_a_precopied_migration_on_gpu_matches_the_uninterrupted_run(tmp_path):
    cfg, plain = plain_run(tmp_path)
    moved_cfg = type(cfg).from_dict(cfg.to_dict())
    moved_cfg.override(migration_precopy=True, migration_precopy_chunk_mb=0.1)
    moved = run_job(moved_cfg, str(tmp_path / "moved"), quiet=True, timeout_s=600,
                    injects=[Inject("migrate", 4, "w1")])
    assert [m["status"] for m in moved["migrations"]] == ["done"], moved["migrations"]
    assert moved["weights_sha256"] == plain["weights_sha256"]
    events = read_jsonl(str(tmp_path / "moved" / "events.jsonl"))
    assert [e for e in events if e["event"] == "precopy_sent"]
    assert not [e for e in events if e["event"] in ("precopy_abandoned", "precopy_refused")]
