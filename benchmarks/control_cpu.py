"""CPU used by a job's controller and agent processes, per wall second, while 2 workers train
(bench_step recipe, DP2, 60 steps; window: steps 5-60): two source trees (e.g. `git worktree`
checkouts of two commits), interleaved. Results: benchmarks/results/control_cpu.md.

    python benchmarks/control_cpu.py OLD_TREE NEW_TREE REPEATS"""
import json, os, subprocess, sys, tempfile, time

HZ = os.sysconf("SC_CLK_TCK")

def cpu(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / HZ
    except OSError:
        return None

def run(tree):
    d = tempfile.mkdtemp(prefix="probe-")
    env = dict(os.environ, PYTHONPATH=tree)
    p = subprocess.Popen([sys.executable, "-m", "trainmover", "run", "--recipe", "bench_step",
                          "--dp", "2", "--steps", "60", "--quiet", "--run-dir", d + "/run"],
                         env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    agent = None
    samples = []
    while p.poll() is None:
        if agent is None and os.path.exists(d + "/run/control.json"):
            try:
                agent = json.load(open(d + "/run/control.json"))["agent_pid"]
            except ValueError:
                pass
        m = d + "/run/metrics.jsonl"
        steps = sum(1 for _ in open(m)) if os.path.exists(m) else 0
        a, c = (cpu(agent) if agent else None), cpu(p.pid)
        samples.append((time.time(), steps, a, c))
        time.sleep(0.25)
    # steady window: from step 5 to the last sample with steps < 60
    win = [s for s in samples if 5 <= s[1] < 60 and s[2] is not None and s[3] is not None]
    t0, t1 = win[0], win[-1]
    wall = t1[0] - t0[0]
    return {"agent_cores": (t1[2] - t0[2]) / wall, "controller_cores": (t1[3] - t0[3]) / wall,
            "steps": t1[1] - t0[1], "wall_s": wall}

old, new, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {"old": [], "new": []}
for r in range(reps):
    for name, tree in (("old", old), ("new", new)):
        res = run(tree)
        out[name].append(res)
        print(name, json.dumps({k: round(v, 4) for k, v in res.items()}), flush=True)
print(json.dumps(out))
