"""The deployment recipes in docs/ stay consistent with the command line: every trainmover
command in them parses, the launch builds a valid job, each agent's settings match it, and
the Kubernetes objects agree with the commands (pods = hosts, GPUs >= processes per host)."""
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

from trainmover.cli import agent_settings, build_launch_config, make_parser, python_command

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "ddp_gpt.py")   # stands in for the user's train.py

# values a launcher would give the variables the recipes use
ENV = {"RUN_DIR": "/shared/runs/job", "PORT": "29500", "HEAD_ADDR": "10.0.0.1",
       "SLURM_NNODES": "3", "SLURM_PROCID": "1", "POD_IP": "10.0.0.2",
       "JOB_COMPLETION_INDEX": "2"}


def commands(text: str) -> list[list[str]]:
    """Each ``trainmover ...`` command of a shell text: continuations joined, variables and
    arithmetic filled in, the shell's own words (exec, &, quotes) removed."""
    text = text.replace("\\\n", " ")
    text = re.sub(r"\$\(\(\s*SLURM_PROCID \+ 1\s*\)\)", str(int(ENV["SLURM_PROCID"]) + 1), text)
    text = re.sub(r"\$\(hostname -i[^)]*\)", "10.0.0.3", text)
    for name, value in ENV.items():
        text = text.replace("${" + name + "}", value).replace("$" + name, value)
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        m = re.search(r"\btrainmover (launch|agent)\b.*", line)
        if m:
            words = shlex.split(m.group(0).rstrip("&' "))
            out.append(words[1:])
    return out


def check(argv: list[str]) -> dict:
    parser = make_parser()
    if argv[0] == "launch":
        cut = argv.index("--")
        args = parser.parse_args(argv[:cut])
        script = argv[cut + 1:]
        script[1] = EXAMPLE           # the user's script; its own arguments are its business
        cfg = build_launch_config(args, python_command(script[:2]))
        return {"cfg": cfg}
    args = parser.parse_args(argv)
    assert os.path.isabs(args.run_dir)
    return {"agent": agent_settings(args), "address": args.address}


def test_the_slurm_script_matches_the_command_line():
    text = (ROOT / "docs" / "slurm.sbatch").read_text()
    launch, agent = [check(c) for c in commands(text)]
    cfg = launch["cfg"]
    assert cfg.hosts.nnodes == int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
    assert cfg.process.store_host == ENV["HEAD_ADDR"] and cfg.process.device == "cuda"
    s = agent["agent"]
    assert s["node"] == 2 and s["endpoint"] == f"{ENV['HEAD_ADDR']}:{ENV['PORT']}"
    assert s["nnodes"] == cfg.hosts.nnodes
    assert s["nproc_per_node"] == cfg.hosts.per_node(cfg.layout.num_roles)
    gpus = int(re.search(r"#SBATCH --gpus-per-node=(\d+)", text).group(1))
    assert busiest_host(cfg) <= gpus                   # NCCL: a GPU per process
    assert "export RUN_DIR PORT HEAD_ADDR" in text     # the agents' srun sees them


def test_the_kubernetes_manifest_matches_the_command_line():
    docs = list(yaml.safe_load_all((ROOT / "docs" / "kubernetes.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    script = kinds["ConfigMap"]["data"]["entrypoint.sh"]
    launch, agent = [check(c) for c in commands(script)]
    cfg = launch["cfg"]
    job = kinds["Job"]["spec"]
    assert job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"] == cfg.hosts.nnodes
    pod = job["template"]["spec"]
    assert pod["subdomain"] == kinds["Service"]["metadata"]["name"]
    s = agent["agent"]
    service_host = f"{kinds['Job']['metadata']['name']}-0.{pod['subdomain']}"
    assert s["endpoint"] == f"{service_host}:{kinds['Service']['spec']['ports'][0]['port']}"
    assert s["node"] == int(ENV["JOB_COMPLETION_INDEX"]) and s["nnodes"] == cfg.hosts.nnodes
    (container,) = pod["containers"]
    assert busiest_host(cfg) <= container["resources"]["limits"]["nvidia.com/gpu"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert s and cfg and "/runs/trainmover".startswith(mounts["runs"])


def busiest_host(cfg) -> int:
    per_node = cfg.hosts.per_node(cfg.layout.num_roles)
    hosts = [i // per_node for i in range(cfg.layout.num_roles)] + \
            [i % cfg.hosts.nnodes for i in range(cfg.standby.count)]
    return max(hosts.count(h) for h in set(hosts))


def test_agent_settings_fall_back_to_the_launchers_variables(monkeypatch):
    args = make_parser().parse_args(["agent", "--run-dir", "/r"])
    for k in ("PET_NODE_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_NODEID", "PET_RDZV_ENDPOINT",
              "MASTER_ADDR", "MASTER_PORT", "PET_NNODES", "PET_NPROC_PER_NODE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="no node rank"):
        agent_settings(args)
    monkeypatch.setenv("PET_NODE_RANK", "3")
    monkeypatch.setenv("MASTER_ADDR", "head")
    monkeypatch.setenv("MASTER_PORT", "23456")
    monkeypatch.setenv("PET_NNODES", "4")
    assert agent_settings(args) == {"node": 3, "endpoint": "head:23456", "nnodes": 4,
                                    "nproc_per_node": None}
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "rdzv:1")
    assert agent_settings(args)["endpoint"] == "rdzv:1"
    monkeypatch.setenv("PET_NODE_RANK", "x")
    with pytest.raises(ValueError, match="PET_NODE_RANK='x'"):
        agent_settings(args)
