"""No host whose loss ends the job: with the store on an etcd cluster (a member on each of
three hosts), every process of the host that holds the etcd leader and the controller (host
0: the controller, its agent, two workers, a standby and the etcd member) is killed at once.
The agent of the next host takes over (it starts a controller there once the controller's
beat has been still for ``controller.takeover_after_s``), host 0 is found lost and fenced,
its roles recover on the other hosts' standbys from their data-parallel replicas; then that
controller is killed and its own host's agent restarts it; the job ends with the weights of
the same job run on one host without interruptions.

Hosts are network namespaces (``bench/netns.py``); here all three job hosts are namespaces
of their own (the root namespace holds only the bridge), so host 0 can be killed whole."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trainmover.bench import netns
from trainmover.bench.hosts import job_config, wait_for
from trainmover.control.status_file import read_status_file
from trainmover.core.events import read_jsonl

from trainmover.bench.etcd_cluster import ETCD, EtcdCluster

WHY_NOT = netns.available()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"no namespaces: {WHY_NOT}"),
              pytest.mark.skipif(ETCD is None and not os.environ.get("TRAINMOVER_REQUIRE_ETCD"),
                                 reason="needs etcd (Debian: etcd-server)")]

STEPS = 160          # as test_multihost: one uninterrupted run serves both modules


@pytest.fixture(scope="module")
def baseline(reference_weights):
    return reference_weights(job_config(steps=STEPS))


def _pids_in(hosts: netns.Hosts, index: int) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", hosts.names[index]], capture_output=True,
                         text=True, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_all_in(hosts: netns.Hosts, index: int) -> int:
    pids = _pids_in(hosts, index)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def _events(run_dir: str, name: str) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    return [e for e in read_jsonl(path) if e["event"] == name] if os.path.exists(path) else []


def _steps(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    return len(read_jsonl(path)) if os.path.exists(path) else 0


def _all_warm(run_dir: str) -> bool:
    status = read_status_file(run_dir, 3600.0)      # its controller running, of any age
    return status is not None and bool(status.standbys) and \
        all(s.state == "warm" for s in status.standbys)


@pytest.mark.timeout(600)
# groups: the hosts vote in vote groups of two (agent/groupvote.py): host 1 leads hosts 0
# and 1, so host 0 dies as a member of host 1's group, and the job's store its leader
# casts the group's ballots at is the etcd cluster
@pytest.mark.parametrize("group_hosts", [1, 2], ids=["flat", "groups"])
def test_the_host_of_the_controller_and_the_etcd_leader_dies_and_the_job_goes_on(
        tmp_path, baseline, group_hosts):
    run_dir = str(tmp_path / "run")
    with netns.Hosts(4) as hosts:
        spaces = [1, 2, 3]                      # namespaces of the etcd members
        cluster = EtcdCluster(tmp_path / "etcd", ips=[hosts.addresses[i] for i in spaces],
                              wrap=lambda i, argv: hosts.command(spaces[i], argv))
        procs: list[subprocess.Popen] = []
        try:
            cluster.start()
            # host 0 is the namespace whose member leads: its loss takes the leader too
            leader = cluster.leader()
            order = [spaces[leader]] + [s for s in spaces if s != spaces[leader]]
            addr = [hosts.addresses[s] for s in order]
            # the heartbeat timeout must cover the store's own failover: writes in flight
            # when the etcd leader dies stall for a try (etcdstore.ATTEMPT_S) and an election;
            # the takeover waits longer than a controller takes to restart on a loaded
            # machine (~2 s in CI), or the next host would take over from the restarted one
            cfg = job_config(addr[0], 3, steps=STEPS, process_etcd=cluster.address(),
                             controller_beat_interval_s=0.5, controller_takeover_after_s=5.0,
                             health_heartbeat_timeout_s=5.0, recovery_report_timeout_s=10.0,
                             agent_vote_group_hosts=group_hosts)
            os.makedirs(run_dir)
            with open(os.path.join(run_dir, "..", "job-config.json"), "w") as f:
                json.dump(cfg.to_dict(), f)
            script = ("import json, sys\n"
                      "from trainmover.core.config import JobConfig\n"
                      "from trainmover.control.coordinator import run_job\n"
                      "cfg = JobConfig.from_dict(json.load(open(sys.argv[1]))).validate()\n"
                      "run_job(cfg, sys.argv[2], quiet=True, timeout_s=900)\n")
            with open(tmp_path / "host0.out", "wb") as log:
                procs.append(hosts.run(order[0], [sys.executable, "-c", script,
                                                  str(tmp_path / "job-config.json"), run_dir],
                                       stdout=log, stderr=subprocess.STDOUT))
            wait_for(lambda: os.path.exists(os.path.join(run_dir, "control.json")), 120,
                     "the job to start")
            for node in (1, 2):
                with open(tmp_path / f"host{node}.out", "wb") as log:
                    procs.append(hosts.run(order[node], [
                        sys.executable, "-m", "trainmover", "agent", "--run-dir", run_dir,
                        "--rdzv-endpoint", cluster.address(), "--node-rank", str(node),
                        "--nnodes", "3", "--address", addr[node]],
                        stdout=log, stderr=subprocess.STDOUT))
            wait_for(lambda: _steps(run_dir) >= 10 and _all_warm(run_dir), 240,
                     "ten steps and warm standbys")
            killed_at = time.time()
            assert _kill_all_in(hosts, order[0]) >= 6   # controller, agent, 3 + etcd
            # then the controller that took over dies too: its own host's agent restarts it
            wait_for(lambda: _events(run_dir, "recovery_done"), 120, "the recovery")
            (taken,) = _events(run_dir, "controller_restarted")
            os.kill(taken["pid"], signal.SIGKILL)
            wait_for(lambda: os.path.exists(os.path.join(run_dir, "summary.json")), 400,
                     "the job to end under the new controller")
            with open(os.path.join(run_dir, "summary.json")) as f:
                summary = json.load(f)
        finally:
            for i in order if "order" in locals() else spaces:
                _kill_all_in(hosts, i)
            for p in procs:
                p.wait(timeout=30)
            cluster.stop()
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    silent = [e for e in events if e["event"] == "controller_silent"]
    assert silent and silent[0]["node"] == 0 and silent[0]["takes_over"], silent
    restarted = [e for e in events if e["event"] == "controller_restarted"]
    assert [(e["node"], e["takeover"]) for e in restarted] == [(1, True), (1, False)]
    (lost,) = [e for e in events if e["event"] == "host_lost"]
    assert lost["node"] == 0 and lost["time"] > killed_at
    assert summary["weights_sha256"] == baseline
    assert summary["steps"] == STEPS
    failed = sorted(w for r in summary["recoveries"] for w in r["failures"])
    assert failed == ["w0", "w1"]
    serving = [e["node"] for e in events if e["event"] == "vote_group_serving"]
    assert serving == ([1] if group_hosts == 2 else [])
