"""One commit vote at the job's store with H hosts voting: what the store and the deciding
agent add to a step at sizes this machine cannot simulate whole (``bench control``
saturates two cores from ~2K workers, where each simulated host's agent is Python code
sharing those cores).

The store is the job's (``core/kvserver.py``, in a process of its own, run key and
handshake as in a job). Each host is one connection of one client process, sending the
requests the host's agent sends for a step (``agent/votes.VoteRelay``): its signed ballot
(an append that waits for no answer), the add of its voters to the step's counter (the two
in one write, as the relay sends them since 55a6cfb; ``--two-writes`` as before) and, on
the add's answer, its wait for the decision; the host whose add reaches the job's voter
count reads the ballots, checks them with the agent's own code
(``AuthStore.ballot_tally``) and writes ``commit`` (compare-and-set) first. The requests
are built and signed before the round: in a job each host builds its own, in parallel; here
one process reads every host's answers, so the client's CPU a round is reported beside the
store's (the latency is bounded by the busier of the two).

Reported for each size, over the rounds of every repeat (each repeat a fresh store): the
time from the last host's vote sent to the decision written, and to every host holding it
(checked, as its agent checks it), medians with min/max of the repeats' medians, and the
p99 of all rounds; the store's and the client's CPU a round.

    python benchmarks/vote_hosts.py [--hosts 128,2048,12500] [--voters-per-host 8]
        [--spread-ms 0,20] [--rounds 30] [--repeats 3] [--out DIR --name NAME]

``--spread-ms``: the hosts' votes sent evenly over that many milliseconds (0: all at once),
as a step's hosts finish their backward passes at different times.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import selectors
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainmover.bench.report import fmt_spread, spread, write_script_result  # noqa: E402
from trainmover.core import kvstore  # noqa: E402
from trainmover.core import protocol as P  # noqa: E402
from trainmover.core.auth import AuthStore, seal, unseal  # noqa: E402
from trainmover.core.kvstore import FRAME, NO_REPLY, Op, decode_answer, encode_request  # noqa: E402

RUN_KEY = os.urandom(32)
SECRET = os.urandom(32)
WAIT_MS = 60_000


def _serve(run_key: bytes, conn) -> None:
    from trainmover.core import kvserver

    srv = kvserver.serve(run_key)
    conn.send(srv.port)
    conn.recv()          # told to stop
    srv.close()


def _cpu_s(pid: int) -> float:
    """The process's CPU time so far: its threads' in nanoseconds where Linux says
    (``schedstat``; the clock ticks of ``stat`` are 10 ms, a round's whole cost at small
    sizes), else in ticks."""
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Ballots:
    """The store's ballot value, as ``AuthStore.ballot_tally`` reads it."""

    def __init__(self, value: bytes):
        self.value = value

    def get(self, key: str) -> bytes:
        return self.value


class Host:
    __slots__ = ("sock", "buf", "node", "state", "done_at")

    def __init__(self, sock, node: int):
        self.sock, self.node, self.buf = sock, node, bytearray()
        self.state, self.done_at = "", 0.0


def answers(sel, rview: memoryview):
    """Each answer as it comes, on connections registered with ``sel`` whose data is a
    record with ``sock``, ``buf``, ``node`` and ``state``: (record, number, fields)."""
    for key, _ in sel.select():
        h = key.data
        n = h.sock.recv_into(rview)
        if not n:
            raise SystemExit("a store closed a connection")
        h.buf += rview[:n]
        while len(h.buf) >= 4:
            (size,) = FRAME.unpack_from(h.buf, 0)
            if len(h.buf) < 4 + size:
                break
            status, number, fields = decode_answer(bytes(h.buf[4:4 + size]))
            del h.buf[:4 + size]
            if status != kvstore.Status.OK:
                raise SystemExit(f"host {h.node}: {status!r} in state {h.state}")
            yield h, number, fields


def _round(hosts: list[Host], sel, step: int, voters_per_host: int, spread_s: float,
           wait_get: bool, two_writes: bool = False) -> dict:
    """One step's vote of every host; the times are from the last host's vote sent."""
    epoch, num_voters = 1, voters_per_host * len(hosts)
    ballots_key = P.commit_key(epoch, step, "ballots")
    votes_key = P.commit_key(epoch, step, "votes")
    decision_key = P.commit_key(epoch, step, "decision")
    firsts = []
    for h in hosts:
        names = ",".join(f"w{h.node * voters_per_host + i}" for i in range(voters_per_host))
        payload = f"host:{h.node}:{names}"
        line = b"\n" + seal(SECRET, f"{ballots_key}#host:{h.node}", payload) + b"\n"
        firsts.append((encode_request(Op.APPEND | NO_REPLY, [ballots_key.encode(), line]),
                       encode_request(Op.ADD, [votes_key.encode()], voters_per_host)))
    wait = (encode_request(Op.WAIT, [decision_key.encode()], 0, WAIT_MS) if wait_get else
            encode_request(Op.GET, [decision_key.encode()], 0, WAIT_MS))
    after_wait = encode_request(Op.TRY_GET, [decision_key.encode()])
    get_ballots = encode_request(Op.GET, [ballots_key.encode()], 0, WAIT_MS)
    commit = seal(SECRET, decision_key, "commit")
    cas = encode_request(Op.COMPARE_SET, [decision_key.encode(), b"", commit])
    checker = AuthStore(None, SECRET)
    decided_at, check_s, pending = 0.0, 0.0, len(hosts)
    rbuf = bytearray(1 << 21)      # recv_into: a recv of 1 MB allocates that much each time
    rview = memoryview(rbuf)

    t0 = time.perf_counter()
    for i, h in enumerate(hosts):
        if spread_s:
            due = t0 + spread_s * i / len(hosts)
            while time.perf_counter() < due:
                pass
        h.state = "add"
        if two_writes:
            h.sock.sendall(firsts[i][0])
            h.sock.sendall(firsts[i][1])
        else:
            h.sock.sendall(firsts[i][0] + firsts[i][1])
    last_sent = time.perf_counter()
    while pending:
        for h, number, fields in answers(sel, rview):
            if h.state == "add":
                if number >= num_voters:
                    h.state = "ballots"
                    h.sock.sendall(get_ballots)
                else:
                    h.state = "wait"
                    h.sock.sendall(wait)
            elif h.state == "ballots":
                t = time.perf_counter()
                checker.raw = _Ballots(fields[0])
                if checker.ballot_tally(ballots_key, {h.node})[0] < num_voters:
                    raise SystemExit("the ballots do not hold every voter")
                check_s = time.perf_counter() - t
                h.state = "cas"
                h.sock.sendall(cas)
            elif h.state == "cas":
                decided_at = time.perf_counter()
                h.state = "wait"
                h.sock.sendall(wait)
            elif h.state == "wait" and wait_get:
                h.state = "get"
                h.sock.sendall(after_wait)
            else:
                if unseal(SECRET, decision_key, fields[0]) != b"commit":
                    raise SystemExit(f"host {h.node}: not the decision")
                h.state, h.done_at = "done", time.perf_counter()
                pending -= 1
    done = max(h.done_at for h in hosts)
    return {"decided_ms": (decided_at - last_sent) * 1e3, "all_ms": (done - last_sent) * 1e3,
            "check_ms": check_s * 1e3}


def run(n_hosts: int, voters_per_host: int, spread_ms: float, rounds: int,
        wait_get: bool, two_writes: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(RUN_KEY, theirs), daemon=True)
    server.start()
    port = ours.recv()
    sel = selectors.DefaultSelector()
    hosts = []
    try:
        for node in range(n_hosts):
            sock = kvstore.connect_socket("127.0.0.1", port, kvstore.store_key(RUN_KEY), 60)
            sock.setblocking(True)
            sock.settimeout(None)
            h = Host(sock, node)
            sel.register(sock, selectors.EVENT_READ, h)
            hosts.append(h)
        rows, warm = [], 3
        for step in range(warm + rounds):
            if step == warm:
                cpu0, mine0 = _cpu_s(server.pid), time.process_time()
            row = _round(hosts, sel, step, voters_per_host, spread_ms / 1e3, wait_get,
                         two_writes)
            if step >= warm:
                rows.append(row)
        store_cpu = (_cpu_s(server.pid) - cpu0) / rounds
        client_cpu = (time.process_time() - mine0) / rounds
    finally:
        for h in hosts:
            h.sock.close()
        ours.send("stop")
        server.join(10)
    return {"rounds": rows, "store_cpu_ms": store_cpu * 1e3, "client_cpu_ms": client_cpu * 1e3}


def _p99(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="128,2048,12500")
    ap.add_argument("--voters-per-host", type=int, default=8)
    ap.add_argument("--spread-ms", default="0,20")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--wait-get", action="store_true",
                    help="a host waits for the decision and then reads it (two requests)")
    ap.add_argument("--two-writes", action="store_true",
                    help="a host's ballot and its count sent as two writes (the relay "
                         "before 55a6cfb)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="vote_hosts")
    args = ap.parse_args()
    results = []
    for spread_ms in [float(s) for s in args.spread_ms.split(",")]:
        for n in [int(h) for h in args.hosts.split(",")]:
            reps = [run(n, args.voters_per_host, spread_ms, args.rounds, args.wait_get,
                        args.two_writes) for _ in range(args.repeats)]
            row = {"hosts": n, "workers": n * args.voters_per_host, "spread_ms": spread_ms,
                   "wait_get": args.wait_get, "two_writes": args.two_writes}
            for k in ("decided_ms", "all_ms", "check_ms"):
                row[k] = spread([statistics.median(r[k] for r in rep["rounds"]) for rep in reps])
                row[k.replace("_ms", "_p99_ms")] = _p99([r[k] for rep in reps
                                                         for r in rep["rounds"]])
            for k in ("store_cpu_ms", "client_cpu_ms"):
                row[k] = spread([rep[k] for rep in reps])
            results.append(row)
            print(json.dumps(row), flush=True)
    head = ("| hosts (workers) | spread (ms) | decided (ms) | p99 | every host has it (ms) | "
            "p99 | ballot check (ms) | store CPU a round (ms) | client CPU a round (ms) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(f"| {r['hosts']} ({r['workers']}) | {r['spread_ms']:g} | "
                     f"{fmt_spread(r['decided_ms'], 1)} | {r['decided_p99_ms']:.1f} | "
                     f"{fmt_spread(r['all_ms'], 1)} | {r['all_p99_ms']:.1f} | "
                     f"{fmt_spread(r['check_ms'], 1)} | {fmt_spread(r['store_cpu_ms'], 1)} | "
                     f"{fmt_spread(r['client_cpu_ms'], 1)} |")
    table = "\n".join(lines)
    if not args.out:
        print(table)
        return
    # ``trainmover project --vote-hosts`` reads it (bench/scaling.py)
    write_script_result(args.out, args.name, "vote_hosts", table,
                        voters_per_host=args.voters_per_host, rows=results)


if __name__ == "__main__":
    main()
