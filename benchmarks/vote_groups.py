"""One commit vote through vote groups (``agent/groupvote.py``) against the same vote with
every host at the job's store (``vote_hosts.py``), in one run: what a step's vote costs
the job's store and how long its critical path is, at sizes this machine cannot simulate
whole.

Grouped: hosts in groups of G (``agent.vote_group_hosts``; by default ceil(sqrt(hosts)),
the agent's automatic size, also below the host count where the agent starts grouping). One group is real: its leader is the agent's own code (``GroupLeader`` serving the
group's store, ``VoteRelay``, with its own voters) in a process of its own; its G-1
members are connections of the client process, sending what a member's relay sends (its
signed ballot, an append that waits for no answer, into the group's store, then a ``get``
that waits for the decision there). Every other group is its leader alone, at the job's store, sending
what a leader sends (one signed ballot naming its group's voters with their count, the
wait for the decision; the one whose count completes the job's reads and checks the
ballots and writes ``commit``). In a job each group is on hosts of its own, in parallel:
the real group stands for the slowest one. Its members vote last (the other groups'
leaders have cast), so a round's path is a member's ballot -> the leader's store -> the
leader's ballot at the job's store -> the decision -> the leader -> the group's store ->
every member.

Reported for each size: the time from the last vote sent to every host holding the
decision (the real group's members and every other leader), and the CPU a round of the
job's store, of the real leader and of the client; the flat vote (``vote_hosts.run``)
beside it, measured in the same run. Medians with min/max over the repeats (each a fresh
store and leader), p99 over every round.

    python benchmarks/vote_groups.py [--hosts 64,128,512,2048,12500] [--group-hosts 0]
        [--voters-per-host 8] [--rounds 30] [--repeats 3] [--out DIR --name NAME]
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import selectors
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vote_hosts  # noqa: E402
from trainmover.agent import groupvote  # noqa: E402
from trainmover.bench.report import fmt_spread, spread, write_script_result  # noqa: E402
from trainmover.core import ballots, kvstore  # noqa: E402
from trainmover.core import protocol as P  # noqa: E402
from trainmover.core.auth import AuthStore, seal, unseal  # noqa: E402
from trainmover.core.config import AgentConfig  # noqa: E402
from trainmover.core.kvstore import NO_REPLY, Op, encode_request  # noqa: E402

KEY = os.urandom(32)       # the run's key: the stores' handshake and the values' MACs
WAIT_MS = 60_000


def _leader(key: bytes, root_port: int, nnodes: int, size: int, voters_per_host: int,
            conn) -> None:
    """The real group's leader: the agent's code, its own voters' votes cast on command."""
    from types import SimpleNamespace

    from trainmover.agent.main import SWITCH_INTERVAL_S
    from trainmover.agent.votes import VoteRelay
    from trainmover.core import storeaddr

    sys.setswitchinterval(SWITCH_INTERVAL_S)       # as the agent runs

    def client():
        return AuthStore(storeaddr.connect(f"127.0.0.1:{root_port}", key, 60), key)

    members = groupvote.group_of(0, nnodes, size)
    node = members[-1]
    relay = VoteRelay(client(), client(), node, voters_per_host * nnodes,
                      AgentConfig.vote_coalesce_s, hosts=-(-nnodes // size), root_index=0)
    leader = groupvote.GroupLeader(key, "127.0.0.1", node, members, relay,
                                   kvstore.StoreLimits(), 60)
    children = []
    for i in range(voters_per_host):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        theirs.setblocking(False)
        child = SimpleNamespace(name=f"w{node * voters_per_host + i}", channel=mine)
        relay.expect(child.name)
        children.append((child, theirs))
    conn.send(leader.server.port)
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        for child, theirs in children:
            try:
                while theirs.recv(4096):      # the decisions told to its voters
                    pass
            except BlockingIOError:
                pass
            relay.vote(child, *msg, child.name)
    leader.close()


class Voter:
    __slots__ = ("sock", "node", "names", "member", "buf", "state", "done_at")

    def __init__(self, sock, node: int, names: tuple, member: bool):
        self.sock, self.node, self.names, self.member = sock, node, names, member
        self.buf, self.state, self.done_at = bytearray(), "", 0.0


def _connect(port: int, node: int, names: tuple, member: bool, sel) -> Voter:
    """``names``: (its own voters, {member node: voters}) as its ballot names them."""
    sock = kvstore.connect_socket("127.0.0.1", port, kvstore.store_key(KEY), 60)
    sock.setblocking(True)
    sock.settimeout(None)
    v = Voter(sock, node, names, member)
    sel.register(sock, selectors.EVENT_READ, v)
    return v


def _round(others: list[Voter], members: list[Voter], leader_conn, sel, step: int,
           num_voters: int, spread_s: float = 0.0) -> dict:
    epoch = 1
    ballots_key = P.commit_key(epoch, step, "ballots")
    wait = encode_request(Op.GET, [P.commit_key(epoch, step, "decision").encode()], 0, WAIT_MS)
    votes_key = P.commit_key(epoch, step, "votes")
    decision_key = P.commit_key(epoch, step, "decision")
    first = {}
    for v in others + members:
        # a leader's line names its members' voters under their hosts (core/ballots.py)
        line = b"\n" + seal(KEY, f"{ballots_key}#host:{v.node}",
                            ballots.payload(v.node, *v.names)) + b"\n"
        count = len(v.names[0]) + sum(len(n) for n in v.names[1].values())
        # a member's relay appends its ballot (no answer) and waits for the decision; a
        # leader's sends its ballot and count in one write
        first[v] = encode_request(Op.APPEND | NO_REPLY, [ballots_key.encode(), line]) + (
            wait if v.member else encode_request(Op.ADD, [votes_key.encode()], count))
    get_ballots = encode_request(Op.GET, [ballots_key.encode()], 0, WAIT_MS)
    cas = encode_request(Op.COMPARE_SET, [decision_key.encode(), b"",
                                          seal(KEY, decision_key, "commit")])
    checker = AuthStore(None, KEY)
    rview = memoryview(bytearray(1 << 21))
    pending = len(others) + len(members)

    for v in others:                          # the other groups' leaders cast first
        v.state = "add"
        v.sock.sendall(first[v])
    leader_conn.send((epoch, step))           # the real leader's own voters
    t0 = time.perf_counter()
    for i, v in enumerate(members):           # its members last (over spread_s)
        if spread_s:
            due = t0 + spread_s * (i + 1) / len(members)
            while time.perf_counter() < due:
                pass
        v.state = "wait"
        v.sock.sendall(first[v])
    last_sent = time.perf_counter()
    while pending:
        for v, number, fields in vote_hosts.answers(sel, rview):
            if v.state == "add":
                if not v.member and number >= num_voters:
                    v.state = "ballots"
                    v.sock.sendall(get_ballots)
                else:
                    v.state = "wait"
                    v.sock.sendall(wait)
            elif v.state == "ballots":
                checker.raw = vote_hosts._Ballots(fields[0])
                if checker.ballot_tally(ballots_key, {v.node})[0] >= num_voters:
                    v.state = "cas"
                    v.sock.sendall(cas)
                else:                     # the real group's ballot is not in yet
                    v.state = "wait"
                    v.sock.sendall(wait)
            elif v.state == "cas":
                v.state = "wait"
                v.sock.sendall(wait)
            else:
                if unseal(KEY, decision_key, fields[0]) != b"commit":
                    raise SystemExit(f"host {v.node}: not the decision")
                v.state, v.done_at = "done", time.perf_counter()
                pending -= 1
    members_at = max((v.done_at for v in members), default=last_sent)
    others_at = max((v.done_at for v in others), default=last_sent)
    return {"all_ms": (max(members_at, others_at) - last_sent) * 1e3,
            "members_ms": (members_at - last_sent) * 1e3,
            "leaders_ms": (others_at - last_sent) * 1e3}


def run_grouped(nnodes: int, size: int, voters_per_host: int, rounds: int,
                spread_ms: float = 0.0) -> dict:
    ctx = mp.get_context("spawn")
    store_ours, store_theirs = ctx.Pipe()
    server = ctx.Process(target=vote_hosts._serve, args=(KEY, store_theirs), daemon=True)
    server.start()
    root_port = store_ours.recv()
    lead_ours, lead_theirs = ctx.Pipe()
    leader = ctx.Process(target=_leader, args=(KEY, root_port, nnodes, size,
                                               voters_per_host, lead_theirs), daemon=True)
    leader.start()
    group_port = lead_ours.recv()
    sel = selectors.DefaultSelector()

    def names(node: int) -> list[str]:
        return [f"w{node * voters_per_host + i}" for i in range(voters_per_host)]

    members, others = [], []
    try:
        for node in groupvote.group_of(0, nnodes, size)[:-1]:
            members.append(_connect(group_port, node, (names(node), {}), True, sel))
        for first in range(size, nnodes, size):
            nodes = groupvote.group_of(first, nnodes, size)
            others.append(_connect(root_port, nodes[-1], (names(nodes[-1]), {
                n: names(n) for n in nodes[:-1]}), False, sel))
        root = kvstore.connect("127.0.0.1", root_port, KEY, 60)   # read after each round
        mine = b":host:%d:" % groupvote.group_of(0, nnodes, size)[-1]
        rows, warm = [], 3
        for step in range(warm + rounds):
            if step == warm:
                cpu0 = (vote_hosts._cpu_s(server.pid), vote_hosts._cpu_s(leader.pid),
                        time.process_time())
            row = _round(others, members, lead_ours, sel, step, voters_per_host * nnodes,
                         spread_ms / 1e3)
            # the real leader's ballots at the job's store this step (its group's in one
            # line, or more where its members' votes came further apart than its coalescing)
            row["leader_lines"] = root.get(P.commit_key(1, step, "ballots")).count(mine)
            if step >= warm:
                rows.append(row)
        cpu1 = (vote_hosts._cpu_s(server.pid), vote_hosts._cpu_s(leader.pid),
                time.process_time())
    finally:
        for v in members + others:
            v.sock.close()
        lead_ours.send("stop")
        store_ours.send("stop")
        leader.join(10)
        server.join(10)
    store_cpu, leader_cpu, client_cpu = ((b - a) / rounds * 1e3 for a, b in zip(cpu0, cpu1))
    return {"rounds": rows, "store_cpu_ms": store_cpu, "leader_cpu_ms": leader_cpu,
            "client_cpu_ms": client_cpu}


def _row(reps: list[dict], keys: tuple[str, ...]) -> dict:
    row = {}
    for k in keys:
        if k.endswith("cpu_ms"):
            row[k] = spread([rep[k] for rep in reps])
        else:
            row[k] = spread([statistics.median(r[k] for r in rep["rounds"]) for rep in reps])
            p99 = k[:-3] + "_p99_ms" if k.endswith("_ms") else k + "_p99"
            row[p99] = vote_hosts._p99([r[k] for rep in reps for r in rep["rounds"]])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="64,128,512,2048,12500")
    ap.add_argument("--group-hosts", type=int, default=0,
                    help="hosts a group (0: ceil(sqrt(hosts)), at least 2)")
    ap.add_argument("--voters-per-host", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spread-ms", type=float, default=0.0,
                    help="the real group's members vote evenly over this many ms (the "
                         "grouped vote; the flat one's votes go at once)")
    ap.add_argument("--no-flat", action="store_true",
                    help="the grouped vote only (to compare two trees' grouped votes)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="vote_groups")
    args = ap.parse_args()
    if args.group_hosts < 0 or args.group_hosts == 1:
        ap.error(f"--group-hosts {args.group_hosts}: 0 (automatic) or at least 2")
    results = []
    for n in [int(h) for h in args.hosts.split(",")]:
        # (the agent's automatic size, ceil(sqrt(hosts)), below its threshold too)
        size = min(n, args.group_hosts or max(2, math.isqrt(n - 1) + 1))
        grouped, flat = [], []
        for _ in range(args.repeats):      # alternately: the same machine state for both
            grouped.append(run_grouped(n, size, args.voters_per_host, args.rounds,
                                       args.spread_ms))
            if not args.no_flat:
                flat.append(vote_hosts.run(n, args.voters_per_host, 0.0, args.rounds, False))
        row = {"hosts": n, "workers": n * args.voters_per_host, "group_hosts": size,
               "groups": -(-n // size),
               "spread_ms": args.spread_ms,
               "grouped": _row(grouped, ("all_ms", "members_ms", "leaders_ms", "store_cpu_ms",
                                         "leader_cpu_ms", "client_cpu_ms", "leader_lines"))}
        if flat:
            row["flat"] = _row(flat, ("all_ms", "store_cpu_ms", "client_cpu_ms"))
        results.append(row)
        print(json.dumps(row), flush=True)
    head = ("| hosts (workers) | group (groups) | every host has it, grouped (ms) | p99 | "
            "flat (ms) | p99 | store CPU a round, grouped (ms) | flat (ms) | "
            "leader CPU a round (ms) | client CPU, grouped / flat (ms) | "
            "leader's ballots a step (p99) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        g = r["grouped"]
        f = r.get("flat")

        def flat(k: str, digits: int) -> str:
            return "-" if f is None else fmt_spread(f[k], digits)

        flat_p99 = "-" if f is None else f"{f['all_p99_ms']:.2f}"

        lines.append(f"| {r['hosts']} ({r['workers']}) | {r['group_hosts']} ({r['groups']}) | "
                     f"{fmt_spread(g['all_ms'], 2)} | {g['all_p99_ms']:.2f} | "
                     f"{flat('all_ms', 2)} | {flat_p99} | "
                     f"{fmt_spread(g['store_cpu_ms'], 2)} | {flat('store_cpu_ms', 2)} | "
                     f"{fmt_spread(g['leader_cpu_ms'], 2)} | "
                     f"{fmt_spread(g['client_cpu_ms'], 1)} / {flat('client_cpu_ms', 1)} | "
                     f"{g['leader_lines']['median']:g} ({g['leader_lines_p99']:g}) |")
    table = "\n".join(lines)
    if not args.out:
        print(table)
        return
    write_script_result(args.out, args.name, "vote_groups", table,
                        voters_per_host=args.voters_per_host, rows=results)


if __name__ == "__main__":
    main()
