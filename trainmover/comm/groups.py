"""The communication layer: one communicator per group and generation, built directly on a
shared store (``comm/store.py``), never through ``init_process_group``.

Why not ``init_process_group`` + ``new_group``: they tie every group to one global world whose
membership cannot change. Here each group is an independent process-group object created
under a store prefix ``groups/<group name>/gen<generation>/``; replacing a worker means
building the next generation of only the groups that contain it, while every other group
object keeps serving training untouched.

Contract of every ``Group`` (real, trivial, and later the warm-up sandbox): it is built for
one generation; it runs collectives and point-to-point ops; it records the first error it
saw; it can be aborted and shut down. Rank and size are properties of the group object and
are never assumed static by callers.

Ordering rules measured on this platform (torch 2.13, gloo, loopback):
- Group construction is a rendezvous of all members. Every process builds its groups in
  one global order (sorted by group name), which makes concurrent builds deadlock-free.
- One store client per thread: threads sharing a client stall each other's requests.
- Store clients are kept for the life of the process (new connections do a reverse-DNS
  lookup that occasionally stalls for seconds).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from trainmover.comm import store as job_store
from trainmover.core import kvserver, storeaddr
from trainmover.core.auth import AuthStore, PlainStore
from trainmover.core.config import CommConfig
from trainmover.core.topology import GroupSpec, Layout, Role

SUM = dist.ReduceOp.SUM
MAX = dist.ReduceOp.MAX

# How a wait on an operation watches the abort signal (``Work``, ``_Waiter``). Constants, not
# settings: they only bound how late an aborted wait notices the abort (a completed operation
# returns at once), and they sit on the training hot path, in objects that carry no config.
SPIN_POLLS = 32            # checks without sleeping: most operations complete within them
SHORT_SLEEP_S = 5e-5       # then sleeps of ~50 us ...
SHORT_SLEEP_POLLS = 232    # ... up to this many checks (about 10 ms), then
LONG_SLEEP_S = 1e-3        # sleeps of 1 ms for long waits
WAITER_POLL_S = 0.002      # a point-to-point wait (a helper thread blocks in it)


class StepAborted(RuntimeError):
    """The job is abandoning the current step (a failure somewhere): raised out of any wait,
    so a survivor never sits in a collective that a dead peer will never finish."""


class AbortSignal:
    """Set by a worker's watcher thread when the controller aborts the step in flight, or by
    the worker itself when one of its operations failed; every wait on a group of that
    worker then ends within about a millisecond.

    How it ends depends on ``in_step``. Inside a training step (the runtime sets ``in_step``
    while the user's step body runs) the step is *doomed*: operations return at once without
    touching the network, leaving their output tensors as they are, so user code runs on to
    the commit point, which answers "not committed" and the runtime recovers. No exception
    crosses the user's code: a loop body cannot be resumed after one. Outside a step (group
    builds, state transfers, recovery) a failure raises ``StepAborted`` / ``CommError`` as
    usual, since silently skipping a transfer would hand a joiner garbage."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""
        self._in_step = False
        # the forwarding backends' copy of this signal (``comm/torch_groups.py``): torch's own
        # code paths wait in C++, where they watch it instead of this object
        self.native = None
        # Every wait of the thread that owns the signal (the worker's main thread) polls it:
        # when it last did is a sign that thread is alive though blocked (``MainProgress``).
        self._owner = threading.get_ident()
        self.polled_at = time.monotonic()

    @property
    def in_step(self) -> bool:
        return self._in_step

    @in_step.setter
    def in_step(self, value: bool) -> None:
        self._in_step = value
        if self.native is not None:
            self.native.in_step = value

    def attach(self, native) -> None:
        """Mirror this signal into the forwarding backends' ``Signal`` from now on."""
        self.native = native
        native.in_step = self._in_step
        if self._event.is_set():
            native.set(self.reason)

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
        self._event.set()
        if self.native is not None:
            self.native.set(reason)

    def wait(self, timeout_s: float) -> bool:
        """Block until the signal is set or ``timeout_s`` passed; whether it is set (the
        control-plane simulator's stand-in for a step's compute, cut short by an abort)."""
        return self._event.wait(timeout_s)

    def clear(self) -> None:
        self.reason = ""
        self._event.clear()
        if self.native is not None:
            self.native.clear()

    def is_set(self) -> bool:
        if threading.get_ident() == self._owner:
            self.polled_at = time.monotonic()
        if not self._event.is_set() and self.native is not None and self.native.is_set():
            # an operation issued by torch's code failed and doomed the step in C++
            self.reason = self.native.reason()
            self._event.set()
        return self._event.is_set()

    def doom(self, error: BaseException) -> bool:
        """An operation failed: inside a step, doom the step (True: the caller returns as if
        the operation completed); outside one, False (the caller raises)."""
        if not self.in_step:
            return False
        self.set(f"{type(error).__name__}: {error}")
        return True


class CommError(RuntimeError):
    """A collective or point-to-point operation failed (peer gone, timeout, aborted group)."""

    def __init__(self, group: str, generation: int, op: str, cause: BaseException | str):
        self.group, self.generation, self.op = group, generation, op
        self.cause = cause
        super().__init__(f"{op} on group {group} gen{generation} failed: {cause}")


class DeviceMismatch(ValueError):
    """A tensor handed to a group lives on another device than the group's (``comm.
    check_devices``): NCCL would reject it, and gloo through host memory would hide it."""

    def __init__(self, group: str, op: str, tensor: torch.device, declared: torch.device):
        super().__init__(f"{op} on group {group}: a tensor on {tensor}, but the group's "
                         f"device is {declared}")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Same kind and, where both name one, the same index: a device given without an index
    (``cuda``, the current one) is not compared by index."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


# --- store ------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoreAddress:
    """Where the job's store listens, and (``run_key``, never printed) the key its clients
    prove they hold: both are needed to reach it. ``etcd``: the ``etcd://`` address of a
    store on an etcd cluster (``core/storeaddr.py``; ``host`` and ``port`` then unused)."""
    host: str
    port: int
    run_key: bytes | None = field(default=None, repr=False, compare=False)
    etcd: str = ""

    def __str__(self) -> str:
        return self.etcd or f"{self.host}:{self.port}"

    @staticmethod
    def parse(text: str) -> "StoreAddress":
        if storeaddr.is_etcd(text):
            storeaddr.parse_etcd(text, check_files=False)
            return StoreAddress("", 0, etcd=text)
        host, _, port = text.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"store address must be HOST:PORT or etcd://..., got {text!r}")
        return StoreAddress(host, int(port))


class LocalStore:
    """A store server in this process and the run key its clients need (tests and
    benchmarks; a job's store is hosted by its agent)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = CommConfig.store_timeout_s, run_key: bytes | None = None):
        self.run_key = os.urandom(32) if run_key is None else run_key
        self.server = kvserver.serve(self.run_key, host, port)
        self.address = StoreAddress(host, self.server.port, self.run_key)
        self.timeout_s = timeout_s

    @property
    def port(self) -> int:
        return self.address.port

    def client(self) -> job_store.KVStore:
        """A client that signs nothing (a test's stand-in for whoever got past the
        handshake, a benchmark's plain client)."""
        return job_store.connect(str(self.address), self.run_key,
                                 timeout=timedelta(seconds=self.timeout_s))

    def close(self) -> None:
        self.server.close()


def start_store_server(host: str = "127.0.0.1", port: int = 0,
                       timeout_s: float = CommConfig.store_timeout_s,
                       run_key: bytes | None = None) -> LocalStore:
    """A store server in this process for ``run_key`` (random by default); port 0 picks a
    free port."""
    return LocalStore(host, port, timeout_s, run_key)


class StoreClients:
    """Hands each thread its own long-lived client of the job's store (one client per thread:
    a client shared between threads serialises a blocking ``get`` in front of other threads'
    work), authenticated with the run's key ``run_key`` (``comm/store.py``). ``get`` gives
    clients that also sign and check every value (``core/auth.py``; plain ones with
    ``signed=False``, for tests and benchmarks); ``raw`` gives the unsigning one, for the
    backends' own rendezvous."""

    def __init__(self, address: StoreAddress, timeout_s: float = CommConfig.store_timeout_s,
                 run_key: bytes | None = None, signed: bool = True):
        run_key = address.run_key if run_key is None else run_key
        if run_key is None:
            raise ValueError("StoreClients needs the run's key: the store answers no one else")
        self.address = address
        self.timeout = timedelta(seconds=timeout_s)
        self.run_key = run_key
        self.signed = signed
        self.on_reject = None     # hears of forged values the signed clients meet
        self._local = threading.local()

    def raw(self) -> dist.Store:
        client = getattr(self._local, "client", None)
        if client is None:
            client = job_store.connect(str(self.address), self.run_key,
                                       self.timeout)
            self._local.client = client
        return client

    def get(self):
        signed = getattr(self._local, "signed", None)
        if signed is None:
            signed = self._local.signed = PlainStore(self.raw()) if not self.signed else \
                AuthStore(self.raw(), self.run_key, lambda key, exc: self.on_reject and
                          self.on_reject(key, exc))
        return signed


# --- groups -----------------------------------------------------------------------------

class _DoneWork:
    """The Work of an operation that completed synchronously (trivial groups)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Work:
    """Wraps a backend Work: a failure is reported on the group and raised as ``CommError``
    naming the group, generation and operation; an abort of the step raises ``StepAborted``.

    Why the wait polls: a gloo operation cannot be cancelled in torch 2.13 and a blocking
    ``wait`` would hold the thread until the group's timeout if a peer died or hung. Polling
    ``is_completed`` (a short spin, then sleeps of ~50 us, growing to 1 ms on long waits)
    keeps the thread answerable to the abort signal at a cost of tens of microseconds."""

    __slots__ = ("_work", "_group", "_op", "_done", "_after")

    def __init__(self, work, group: "Group", op: str, after: Callable[[], None] | None = None):
        self._work, self._group, self._op = work, group, op
        self._done = False
        self._after = after    # host staging: copy the result back to the device

    def wait(self) -> None:
        if self._done:
            return
        work, signal = self._work, self._group.abort_signal
        t0 = time.perf_counter()
        try:
            if signal is not None and self._op in ("send", "recv"):
                # gloo's point-to-point works only complete inside wait(): a helper thread of
                # this group waits, and this thread watches both it and the abort signal
                self._group._waiter().wait(work, self._op, signal, self._group)
            else:
                if signal is not None:
                    polls = 0
                    while not work.is_completed():
                        self._check_abort(signal)
                        polls += 1
                        if polls > SPIN_POLLS:
                            time.sleep(SHORT_SLEEP_S if polls < SHORT_SLEEP_POLLS
                                       else LONG_SLEEP_S)
                try:
                    work.wait()
                except Exception as exc:  # noqa: BLE001 - backend errors have no common type
                    raise self._group._fail(self._op, exc) from exc
        except (StepAborted, CommError) as exc:
            # a doomed step abandons the wait; the operation stays pending, which marks the
            # group dirty for the recovery (its members no longer agree on the sequence)
            if signal is None or not signal.doom(exc):
                raise
            self._done = True
            return
        group = self._group
        waited = time.perf_counter() - t0
        if group.slow_factor > 1.0:
            # an injected slow link (``slowlink``): this member's operations take longer
            time.sleep((group.slow_factor - 1.0) * waited)
            waited *= group.slow_factor
        group.wait_s += waited
        self._done = True
        group.pending -= 1
        if self._after is not None:
            self._after()

    def _check_abort(self, signal: "AbortSignal") -> None:
        if signal.is_set():
            raise StepAborted(f"{self._op} on {self._group.name} gen{self._group.generation} "
                              f"abandoned: {signal.reason}")


class _Waiter:
    """One daemon thread per group that blocks in point-to-point waits on behalf of the
    training thread. A wait abandoned on abort leaves this thread stuck until gloo's timeout,
    but the group is then dirty (an operation is pending) and replaced, waiter and all."""

    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name=f"wait-{name}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            work, done, box = self._queue.get()
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                box.append(exc)
            done.set()

    def wait(self, work, op: str, signal: "AbortSignal", group: "Group") -> None:
        done, box = threading.Event(), []
        self._queue.put((work, done, box))
        while not done.wait(WAITER_POLL_S):
            if signal.is_set():
                raise StepAborted(f"{op} on {group.name} gen{group.generation} abandoned: "
                                  f"{signal.reason}")
        if box:
            raise group._fail(op, box[0]) from box[0]


class Group:
    """One communicator of one generation. ``pg`` is None for a trivial (single-member) group,
    whose collectives are identities and which never touches the network."""

    def __init__(self, spec: GroupSpec, generation: int, rank: int, pg=None,
                 device: torch.device | None = None, sandbox: bool = False,
                 stage: bool = False, check_devices: bool = False):
        self.spec = spec
        self.generation = generation
        self.rank = rank
        self.size = spec.size
        self.device = device or torch.device("cpu")
        # gloo over device tensors (several workers share a GPU, where NCCL refuses two ranks
        # on one device): each operation goes through a host copy of its tensor
        self.stage = stage
        # every operation's tensor must be on ``device`` (comm.check_devices)
        self.check_devices = check_devices
        self.error: CommError | None = None
        self.closed = False
        self._pg = pg
        self.abort_signal: AbortSignal | None = None
        # Operation accounting since construction, to tell after an aborted step whether
        # every member still agrees on the sequence of operations (a clean group is kept).
        self.issued = {"coll": 0, "sent": 0, "recv": 0}
        self.pending = 0
        # seconds this member spent blocked in the group's operations (the straggler
        # detector's "wait"; compute is the step's time minus it), and an injected slowdown
        self.wait_s = 0.0
        self.slow_factor = 1.0
        self._waiter_thread: _Waiter | None = None
        # the operations torch's code issued on this communicator through a forwarding
        # backend (``comm/torch_groups.py``), counted there; and what is told when the
        # communicator is released
        self.forwarded_counts: Callable[[], dict] | None = None
        self.on_release: list[Callable[["Group"], None]] = []
        if pg is None and spec.size != 1 and not sandbox:
            raise ValueError(f"group {spec.name} has {spec.size} members but no communicator")

    @property
    def name(self) -> str:
        return self.spec.name

    def __repr__(self) -> str:
        return f"Group({self.name} gen{self.generation} rank {self.rank}/{self.size})"

    # -- errors --
    def _fail(self, op: str, cause: BaseException | str) -> CommError:
        err = CommError(self.name, self.generation, op, cause)
        if self.error is None:
            self.error = err
        return err

    def _check(self, op: str) -> None:
        if self.closed:
            raise self._fail(op, "group is shut down")
        if self.error is not None:
            # after one failure a gloo group is unusable for every later op
            raise CommError(self.name, self.generation, op, f"group already failed: {self.error}")

    def _run(self, op: str, fn: Callable[[], object], async_op: bool,
             after: Callable[[], None] | None = None):
        signal = self.abort_signal
        try:
            self._check(op)
            if signal is not None and signal.is_set():
                raise StepAborted(f"{op} on {self.name}: {signal.reason}")
            try:
                work = fn()
            except Exception as exc:  # noqa: BLE001
                raise self._fail(op, exc) from exc
        except (StepAborted, CommError) as exc:
            if signal is None or not signal.doom(exc):
                raise
            return _DoneWork() if async_op else None   # doomed step: nothing is issued
        self.issued["sent" if op == "send" else "recv" if op == "recv" else "coll"] += 1
        self.pending += 1
        wrapped = Work(work, self, op, after)
        if async_op:
            return wrapped
        wrapped.wait()
        return None

    # -- collectives --
    # A multi-member group whose communicator was released (aborted or shut down) goes
    # through ``_run`` like any other operation: it fails there, which dooms a step in flight
    # instead of raising into the training code.
    def _trivial(self) -> bool:
        return self._pg is None and self.spec.size == 1

    def _placed(self, tensor: torch.Tensor, op: str) -> None:
        if self.check_devices and not same_device(tensor.device, self.device):
            raise DeviceMismatch(self.name, op, tensor.device, self.device)

    def allreduce(self, tensor: torch.Tensor, op=SUM, async_op: bool = False):
        self._placed(tensor, "allreduce")
        if self._trivial():
            self._check("allreduce")
            return _DoneWork() if async_op else None
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        host, after = self._staged(tensor, copy_in=True)
        return self._run("allreduce", lambda: self._pg.allreduce([host], opts), async_op, after)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        self._placed(tensor, "broadcast")
        if self._trivial():
            self._check("broadcast")
            return _DoneWork() if async_op else None
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        host, after = self._staged(tensor, copy_in=True)
        return self._run("broadcast", lambda: self._pg.broadcast([host], opts), async_op, after)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._placed(tensor, "allgather")
        if self._trivial():
            self._check("allgather")
            return [tensor.clone()]
        host, _ = self._staged(tensor, copy_in=True)
        outs = [torch.empty_like(host) for _ in range(self.size)]
        self._run("allgather", lambda: self._pg.allgather([outs], [host]), False)
        return [o.to(tensor.device) for o in outs] if self.stage else outs

    def barrier(self) -> None:
        if self._trivial():
            return
        t = torch.zeros(1, device=self.device)
        self.allreduce(t)

    # -- point to point (peer is a rank in this group) --
    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Work:
        self._placed(tensor, "send")
        if self.spec.size == 1:
            raise self._fail("send", "send on a single-member group")
        host, _ = self._staged(tensor, copy_in=True)
        return self._run("send", lambda: self._pg.send([host], peer, tag), True)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Work:
        self._placed(tensor, "recv")
        if self.spec.size == 1:
            raise self._fail("recv", "recv on a single-member group")
        host, after = self._staged(tensor, copy_in=False)
        return self._run("recv", lambda: self._pg.recv([host], peer, tag), True, after)

    def _staged(self, tensor: torch.Tensor, copy_in: bool
                ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """The tensor the backend works on, and what copies its result back (host staging
        only; otherwise the tensor itself)."""
        if not self.stage:
            return tensor, None
        host = tensor.to("cpu", copy=True) if copy_in else \
            torch.empty(tensor.shape, dtype=tensor.dtype)
        return host, lambda: tensor.copy_(host)

    def _waiter(self) -> "_Waiter":
        if self._waiter_thread is None:
            self._waiter_thread = _Waiter(self.name)
        return self._waiter_thread

    def accounting(self) -> dict:
        """Operations issued and still pending on this group (see ``controller.dirty_groups``),
        the runtime's and torch's together: both go over the same communicator."""
        out = {**self.issued, "pending": self.pending}
        if self.forwarded_counts is not None:
            for key, value in self.forwarded_counts().items():
                out[key] += value
        return {**out, "generation": self.generation, "rank": self.rank}

    @property
    def backend(self):
        """The c10d backend of this generation (None when trivial or released)."""
        return self._pg

    # -- lifecycle --
    def abort(self) -> None:
        """Mark the group failed and release it. In torch 2.13 gloo's own ``abort()`` cancels
        nothing; dropping the backend object closes its sockets, which makes peers blocked on
        this group raise instead of waiting for the timeout."""
        self._fail("abort", "aborted")
        self._release()

    def shutdown(self) -> None:
        self.closed = True
        self._release()

    def _release(self) -> None:
        for hook in self.on_release:
            hook(self)
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort, the object is dropped anyway
                pass
            del pg
        # A released group keeps its trivial-looking state: mark it so ops fail loudly.
        if self.spec.size > 1:
            self.closed = True


def group_prefix(name: str, generation: int) -> str:
    return f"groups/{name}/gen{generation}/"


def backend_for(device: torch.device, backend: str = "auto") -> str:
    """``comm.backend``: "auto" is NCCL for CUDA devices and gloo otherwise; "gloo" on CUDA
    stages every operation through host memory (several workers sharing one GPU)."""
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


class GroupBuilder:
    """Creates communicators for (group spec, generation) on the job's store."""

    def __init__(self, stores: StoreClients, device: torch.device, timeout_s: float,
                 gloo_host: str | None = None, abort_signal: AbortSignal | None = None,
                 backend: str = "auto", check_devices: bool = False):
        self.stores = stores
        self.check_devices = check_devices
        self.abort_signal = abort_signal
        self.device = device
        self.backend = backend_for(device, backend)
        # host staging: gloo over device tensors (settable, so CPU tests exercise it)
        self.stage = self.backend == "gloo" and device.type != "cpu"
        self.timeout = timedelta(seconds=timeout_s)
        # Bind gloo to the address the store is reached on unless told otherwise: on one host
        # that is loopback, and it spares a hostname lookup per group.
        self.gloo_host = gloo_host or os.environ.get("TRAINMOVER_GLOO_HOST") or \
            stores.address.host or "127.0.0.1"

    def build(self, spec: GroupSpec, role: Role, generation: int) -> Group:
        return self.build_ranked(spec, spec.rank_of(role), generation)

    def build_ranked(self, spec: GroupSpec, rank: int, generation: int,
                     abortable: bool = True) -> Group:
        """Build with an explicit group rank (a transfer channel's two members hold the same
        role, so the role cannot name the rank). A group that is not ``abortable`` ignores
        the abort signal: its operations end by completing or by a failure of a member."""
        if spec.trivial:
            return Group(spec, generation, rank, None, self.device,
                         check_devices=self.check_devices)
        group = self._build_pg(spec, rank, generation)
        group.abort_signal = self.abort_signal if abortable else None
        return group

    def _build_pg(self, spec: GroupSpec, rank: int, generation: int) -> Group:
        store = dist.PrefixStore(group_prefix(spec.name, generation), self.stores.raw())
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            pg = dist.ProcessGroupNCCL(store, rank, spec.size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.gloo_host)]
            opts._timeout = self.timeout
            pg = dist.ProcessGroupGloo(store, rank, spec.size, opts)
        return Group(spec, generation, rank, pg, self.device, stage=self.stage,
                     check_devices=self.check_devices)

    def build_many(self, specs: Iterable[GroupSpec], role: Role,
                   generations: dict[str, int]) -> tuple[dict[str, Group], dict[str, float]]:
        """Build in sorted name order (deadlock-free across processes, see module doc).
        Returns the groups by name and the seconds each build took."""
        groups, times = {}, {}
        for spec in sorted(specs, key=lambda s: s.name):
            t0 = time.perf_counter()
            groups[spec.name] = self.build(spec, role, generations.get(spec.name, 0))
            times[spec.name] = time.perf_counter() - t0
        return groups, times


SLOTS = ("tp", "dp", "pp", "p2p_prev", "p2p_next")


@dataclass
class CommGroups:
    """The one holder of a worker's groups, passed to the model, engine and state transfer.
    Holders keep this object and read a slot at the moment they communicate, so a switch to a
    new generation (``install``) is seen by everyone at once and no stale handle survives."""

    role: Role
    tp: Group
    dp: Group
    pp: Group
    p2p_prev: Group | None = None
    p2p_next: Group | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # told after every install (the torch process groups follow the new generation)
    listeners: list = field(default_factory=list, repr=False, compare=False)

    def slots(self) -> dict[str, Group]:
        return {s: g for s in SLOTS if (g := getattr(self, s)) is not None}

    def generations(self) -> dict[str, int]:
        return {g.name: g.generation for g in self.slots().values()}

    def install(self, new_groups: dict[str, Group]) -> list[Group]:
        """Swap in groups (keyed by group name) of a new generation; returns the groups they
        replace, for the caller to shut down once no operation on them can be pending."""
        replaced = []
        with self.lock:
            for slot, old in self.slots().items():
                new = new_groups.get(old.name)
                if new is not None and new is not old:
                    setattr(self, slot, new)
                    replaced.append(old)
        for listener in self.listeners:
            listener(self)
        return replaced

    def shutdown(self) -> None:
        for g in self.slots().values():
            g.shutdown()

    @staticmethod
    def from_groups(role: Role, layout: Layout, groups: dict[str, Group]) -> "CommGroups":
        slots = {slot: groups[spec.name] for slot, spec in layout.groups_of(role).items()}
        return CommGroups(role=role, **slots)


def build_comm_groups(builder: GroupBuilder, layout: Layout, role: Role,
                      generations: dict[str, int] | None = None
                      ) -> tuple[CommGroups, dict[str, float]]:
    """All groups of one role, first generation or the generations given."""
    specs = list(layout.groups_of(role).values())
    groups, times = builder.build_many(specs, role, generations or {})
    return CommGroups.from_groups(role, layout, groups), times
