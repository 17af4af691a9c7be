"""A process's channel to its host's agent: its datagrams, built and read."""
from __future__ import annotations

from trainmover.core.protocol.codec import MessageError, write_message
from trainmover.core.protocol.messages import FailureReport, StepPerf

AGENT_CHANNEL_ENV = "TRAINMOVER_AGENT_FD"
"""The descriptor of a process's channel to its host's agent (one end of a Unix socket pair
the agent made for it and passed at its start): its heartbeat beats there, and it votes on
each step there and hears the step's decision back (``agent/votes.py``).

The channel's messages, one datagram each (no signature: only the process and its agent
hold the pair): ``b"b"`` a beat; ``v <epoch> <step> <voter>`` a vote to commit the step;
``d <epoch> <step> <commit|abort>`` the step's decision, agent to process; ``w <epoch>`` the
process asks to hear of the epoch's abort, and ``a <epoch> <reason>`` is that abort, agent
to process (``agent/aborts.py``); ``c <command>`` a command of the controller's, agent to
process (``agent/commands.py``); ``p <StepPerf>`` a window's step measurements, process to
agent (``agent/perfs.py``)."""

CHANNEL_BEAT = b"b"
CHANNEL_MAX = 4096           # what a process sends its agent (a StepPerf at most)


def perf_message(perf: StepPerf) -> bytes:
    """A ``p <StepPerf>`` message; ``MessageError`` if it is over ``CHANNEL_MAX``."""
    raw = b"p " + write_message(perf).encode()
    if len(raw) > CHANNEL_MAX:
        raise MessageError(f"StepPerf: {len(raw)} bytes, over the channel's {CHANNEL_MAX}")
    return raw


def read_perf_message(raw: bytes) -> bytes | None:
    """The StepPerf of a ``p <StepPerf>`` message (undecoded), None for anything else."""
    return raw[2:] if raw[:2] == b"p " else None


def report_message(epoch: int, report: FailureReport) -> bytes:
    """An ``f <epoch> <FailureReport>`` message; ``MessageError`` if over ``CHANNEL_MAX``."""
    raw = b"f %d " % epoch + write_message(report).encode()
    if len(raw) > CHANNEL_MAX:
        raise MessageError(f"FailureReport: {len(raw)} bytes, over the channel's "
                           f"{CHANNEL_MAX}")
    return raw


def read_report_message(raw: bytes) -> tuple[int, bytes] | None:
    """``(epoch, FailureReport undecoded)`` of an ``f`` message, None for anything else."""
    if raw[:2] != b"f ":
        return None
    head, sep, payload = raw[2:].partition(b" ")
    if not sep or not head.isdigit() or len(head) > 18:
        return None
    return int(head), payload


def recovered_message(recovery_id: int) -> bytes:
    return b"r %d" % recovery_id


def read_recovered_message(raw: bytes) -> int | None:
    """The recovery id of an ``r <recovery id>`` message, None for anything else."""
    kind, _, rid = raw.partition(b" ")
    if kind != b"r" or not rid.isdigit() or len(rid) > 18:
        return None
    return int(rid)




def command_message(command: str) -> bytes:
    return b"c " + command.encode()


def read_command_message(raw: bytes) -> bytes | None:
    """The command of a ``c <command>`` message, None for anything else."""
    return raw[2:] if raw[:2] == b"c " else None
ABORT_REASON_MAX = 200       # an abort's reason, cut to fit a channel message


def watch_message(epoch: int) -> bytes:
    return f"w {epoch}".encode()


def read_watch_message(raw: bytes) -> int | None:
    """The epoch of a ``w <epoch>`` message, None for anything else."""
    kind, _, epoch = raw.partition(b" ")
    if kind != b"w" or not epoch.isdigit():
        return None
    return int(epoch)


def abort_message(epoch: int, reason: str) -> bytes:
    return f"a {epoch} ".encode() + reason.encode()[:ABORT_REASON_MAX]


def read_abort_message(raw: bytes) -> tuple[int, str] | None:
    """``(epoch, reason)`` of an ``a <epoch> <reason>`` message, None for anything else."""
    parts = raw.split(b" ", 2)
    if len(parts) != 3 or parts[0] != b"a" or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[2].decode(errors="replace")


def vote_message(epoch: int, step: int, voter: str) -> bytes:
    return f"v {epoch} {step} {voter}".encode()


def decision_message(epoch: int, step: int, decision: bytes) -> bytes:
    return f"d {epoch} {step} ".encode() + decision


def read_channel_message(raw: bytes) -> tuple[str, int, int, str] | None:
    """A vote or a decision as ``(kind, epoch, step, voter or decision)``, None for
    anything else (a beat, junk)."""
    parts = raw.split(b" ")
    if len(parts) != 4 or parts[0] not in (b"v", b"d"):
        return None
    try:
        return parts[0].decode(), int(parts[1]), int(parts[2]), parts[3].decode()
    except (ValueError, UnicodeDecodeError):
        return None
