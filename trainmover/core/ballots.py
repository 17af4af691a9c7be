"""What a step's ballots say, once their lines were found genuine (``core/auth.py`` checks
each line's MAC): the lines' format and the count of distinct voters they hold.

A host's ballot line, as its agent casts it (``AuthStore.cast_host_ballot``)::

    host:<node>:<voter>,<voter>...|<member>:<voter>,...|<member>:<voter>,...

its own processes' voters, then, from a vote group's leader (``agent/groupvote.py``), each
member host's voters under the member's node. A process's voter name is its process name,
and every process name lives on one host (``HostsConfig``: ``w<i>`` on host ``i //
nproc_per_node``, ``s<i>`` on host ``i % nnodes``), so the voters of different hosts are
distinct. That is what lets the count go by host: the names of a host found in one line
only are counted (commas, in C), and only a host found in several lines (a late vote's
second ballot, a member that left its group casting again at the job's store) has its
names gathered into a set. Reading every voter's name into one set was O(workers) Python
work a step in the deciding agent: ~1.4 ms at 16,384 workers, ~9 ms at 100,000.

A single voter's line (``AuthStore.cast_ballot``: a process with no agent, ``worker/
liveness.CommitVote``) is its voter's name alone; it counts as a "host" of one.
"""
from __future__ import annotations

import collections
import re

HOST = b"host:"
_MEMBER = re.compile(rb"\|(\d+):")
_FORBIDDEN = (",", "|", ":", "\n")


def payload(node: int, voters: list[str], members: dict[int, list[str]] | None = None) -> str:
    """A host's ballot line's content (before it is signed). ``ValueError`` for an empty
    voter's name or one holding a separator (it would count as other voters)."""
    parts = [(None, voters)] + [(m, names) for m, names in sorted((members or {}).items())
                                if names]
    every = [name for _, names in parts for name in names]
    joined = ",".join(every)
    if "" in every or joined.count(",") != max(0, len(every) - 1) or \
            any(c in joined for c in "|:\n"):
        bad = [v for v in every if not v or any(c in v for c in _FORBIDDEN)]
        raise ValueError(f"a voter's name may be neither empty nor hold any of "
                         f"{', '.join(map(repr, _FORBIDDEN))}: {bad[:3]!r}")
    return f"{HOST.decode()}{node}:" + ",".join(voters) + "".join(
        f"|{m}:" + ",".join(names) for m, names in parts[1:])


def segments(signer: bytes, names: bytes) -> list[tuple[bytes, bytes]]:
    """(host, voters) of each part of a genuine line: ``signer`` (``host:<node>`` or a
    single voter's name) and what follows its ``:``."""
    if not signer.startswith(HOST):
        return [(b"=" + signer, names)]
    parts = names.split(b"|")
    out = [(signer[len(HOST):], parts[0])] if parts[0] else []
    for part in parts[1:]:
        node, sep, voters = part.partition(b":")
        if sep and voters:
            out.append((node, voters))
    return out


def voters(lines: list[tuple[bytes, bytes]]) -> set[str]:
    """Every distinct voter named by the genuine lines (signer, names)."""
    out: set[str] = set()
    for signer, names in lines:
        for _, part in segments(signer, names):
            out.update(part.decode(errors="replace").split(","))
    out.discard("")
    return out


def tally(lines: list[tuple[bytes, bytes]], hosts: set[int]) -> tuple[int, set[str]]:
    """How many distinct voters the genuine lines (signer, names) name, and which of them
    are on ``hosts`` (the deciding relay's own and its members': the names it cast)."""
    total, parts, counted = 0, 0, collections.Counter()
    parsed = []
    for signer, names in lines:
        if signer.startswith(HOST):
            on = _MEMBER.findall(names)
            if names and not names.startswith(b"|"):
                on.append(signer[len(HOST):])
            total += names.count(b",") + len(on)
        else:
            on = [b"=" + signer]
            total += 1
        parsed.append((signer, names, on))
        counted.update(on)
        parts += len(on)
    # a host in more than one line: its names counted once each (the common case: none)
    twice = {h for h, n in counted.items() if n > 1} if len(counted) < parts else set()
    wanted = twice | {str(h).encode() for h in hosts}
    names_of: dict[bytes, set[bytes]] = collections.defaultdict(set)
    summed: collections.Counter = collections.Counter()
    for signer, names, on in parsed:
        if wanted.isdisjoint(on):
            continue
        for host, part in segments(signer, names):
            if host in wanted:
                got = part.split(b",")
                names_of[host].update(got)
                summed[host] += len(got)
    for host in twice:
        total -= summed[host] - len(names_of[host])
    mine = {name.decode(errors="replace") for h in hosts
            for name in names_of.get(str(h).encode(), ())}
    return total, mine
