"""Configuration dataclasses, one per component, each validated with errors that quote the
bad value. A whole job is a ``JobConfig``; named recipes (``recipes.py``) produce them."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from trainmover.core import storeaddr
from trainmover.core.topology import Layout, split_layers


def _positive(owner: str, **values) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{owner}.{name} must be a positive integer, got {v!r}")


def _seconds(owner: str, **values) -> None:
    for name, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"{owner}.{name} must be > 0, got {v!r}")


def _non_negative(owner: str, **values) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{owner}.{name} must be an integer >= 0, got {v!r}")


@dataclass
class ModelConfig:
    """A decoder-only GPT (pre-norm blocks, learned positions, untied head)."""

    # Token ids 0..vocab_size-1: the embedding's rows and the head's outputs (at least 256
    # for text data, whose tokens are bytes; divisible by tp, which splits the head).
    vocab_size: int = 256
    # Transformer blocks, split over the pipeline stages in contiguous runs (at least one
    # per stage; earlier stages take the remainder).
    n_layers: int = 4
    # Width of the residual stream: embeddings, attention and block outputs.
    d_model: int = 128
    # Attention heads per block, each d_model / n_heads wide; divisible by tp (each
    # tensor-parallel rank computes n_heads / tp of them).
    n_heads: int = 4
    # Tokens per training sequence, and the learned positions: the model's longest context.
    seq_len: int = 64
    # Dropout probability in [0, 1) on the embeddings, attention weights and residual
    # branches (0: none); its random stream comes from train.seed, the step and the
    # micro-batch, so a redone step drops the same units.
    dropout: float = 0.0
    # The MLP's hidden width as a multiple of d_model (d_model x mlp_ratio, divisible by tp).
    mlp_ratio: int = 4

    def validate(self) -> None:
        _positive("model", vocab_size=self.vocab_size, n_layers=self.n_layers,
                  d_model=self.d_model, n_heads=self.n_heads, seq_len=self.seq_len,
                  mlp_ratio=self.mlp_ratio)
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by "
                             f"model.n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout!r}")

    def validate_layout(self, layout: Layout) -> None:
        if self.n_heads % layout.tp:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by tp={layout.tp}")
        if self.vocab_size % layout.tp:
            raise ValueError(f"model.vocab_size={self.vocab_size} is not divisible by "
                             f"tp={layout.tp} (the head is split over tensor-parallel ranks)")
        if (self.d_model * self.mlp_ratio) % layout.tp:
            raise ValueError(f"MLP width {self.d_model * self.mlp_ratio} is not divisible by "
                             f"tp={layout.tp}")
        split_layers(self.n_layers, layout.pp)  # raises naming n_layers and pp

    def num_params(self) -> int:
        d, v, t, h = self.d_model, self.vocab_size, self.seq_len, self.d_model * self.mlp_ratio
        per_block = 4 * d * d + 3 * d + 2 * d * h + h + d + 4 * d  # no key bias
        return v * d + t * d + self.n_layers * per_block + 2 * d + d * v


@dataclass
class TrainConfig:
    """Optimisation. ``global_batch`` sequences per step are split over ``dp`` replicas and
    each replica's share into ``num_microbatches`` micro-batches, so any two layouts train on
    exactly the same tokens."""

    # Optimizer steps of the job (the learning-rate schedule ends at the last one); for a
    # script's job, its step count if the launcher was told it (--steps), else 0: unknown.
    steps: int = 20
    # Sequences (of seq_len tokens) per optimizer step over the whole job, whatever the
    # layout: divisible by dp x num_microbatches; each data-parallel rank takes
    # global_batch / dp of them.
    global_batch: int = 16
    # Micro-batches each data-parallel rank's share of a step is split into: gradients
    # accumulate over them, and the pipeline's 1F1B schedule overlaps its stages across
    # them (more: smaller micro-batches, a pipeline kept busier).
    num_microbatches: int = 2
    # AdamW's peak learning rate, reached at the end of the warm-up.
    lr: float = 3e-3
    # The learning rate the cosine decay after the warm-up falls to by the end of steps.
    min_lr: float = 3e-4
    # Steps of linear warm-up, from lr / warmup_steps at step 0 to lr (0: none).
    warmup_steps: int = 5
    # AdamW's decoupled weight decay, on parameters of 2 or more dimensions (weight
    # matrices, embeddings); none on biases and norms.
    weight_decay: float = 0.1
    # AdamW's beta1: decay rate of its running mean of the gradient.
    beta1: float = 0.9
    # AdamW's beta2: decay rate of its running mean of the squared gradient.
    beta2: float = 0.95
    # AdamW's epsilon, added to the denominator for numerical stability.
    eps: float = 1e-8
    # The gradients' global L2 norm (over every stage and tensor-parallel shard) is clipped
    # to this; 0: no clipping.
    grad_clip: float = 1.0
    # Seed of the initial weights, of the data windows each step samples and of dropout:
    # with the same seed and settings, any layout trains on the same tokens.
    seed: int = 1234
    # torch.compile each stage's module (each process compiles at its start; a standby in
    # its warm-up). As --compile.
    compile: bool = False
    # Size (MiB) of the gradient buckets of the data-parallel all-reduce: each is sent as
    # soon as the step's last backward has filled it, overlapping the rest of the backward.
    bucket_mb: float = 25.0
    threads_per_worker: int = 0  # 0: cores // workers, at least 1

    def validate(self) -> None:
        _positive("train", steps=self.steps, global_batch=self.global_batch,
                  num_microbatches=self.num_microbatches)
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"train.lr={self.lr!r}, train.min_lr={self.min_lr!r}: need "
                             f"0 <= min_lr <= lr and lr > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if self.grad_clip < 0:
            raise ValueError(f"train.grad_clip must be >= 0 (0 disables), got {self.grad_clip!r}")
        if self.bucket_mb <= 0:
            raise ValueError(f"train.bucket_mb must be > 0, got {self.bucket_mb!r}")
        if self.threads_per_worker < 0:
            raise ValueError(f"train.threads_per_worker must be >= 0, got "
                             f"{self.threads_per_worker!r}")

    def validate_layout(self, layout: Layout) -> None:
        per = layout.dp * self.num_microbatches
        if self.global_batch % per:
            raise ValueError(f"train.global_batch={self.global_batch} is not divisible by "
                             f"dp={layout.dp} x num_microbatches={self.num_microbatches}")

    def micro_batch_size(self, layout: Layout) -> int:
        return self.global_batch // (layout.dp * self.num_microbatches)


@dataclass
class DataConfig:
    """``source``: ``builtin`` (byte-level tokens of the Python standard library's sources,
    present on every Python install), or a path. ``format``: ``text`` (bytes as tokens, vocab
    256) or ``uint16`` (a flat little-endian token file).

    ``rehearse``: in a script's job that no standby checks (``checks_data_by_standby``),
    step 1 runs twice, the first attempt not committed, and the first stage's batches of
    the two attempts must be equal: a script whose data is an iterator's position (which a
    redo or a joiner would not see again) is stopped there, before any fault, naming the
    cause. It costs one step per job."""

    source: str = "builtin"
    format: str = "text"
    # With source "builtin": the corpus is the first this many bytes of the standard
    # library's sources (files in a fixed order).
    builtin_max_bytes: int = 4_000_000
    rehearse: bool = True

    def validate(self) -> None:
        if self.format not in ("text", "uint16"):
            raise ValueError(f"data.format must be 'text' or 'uint16', got {self.format!r}")
        if self.source == "builtin":
            if self.format != "text":
                raise ValueError("data.source='builtin' is text; data.format must be 'text'")
            return
        if not os.path.isfile(self.source):
            raise ValueError(f"data file {self.source!r} does not exist or is not a file")
        if not os.access(self.source, os.R_OK):
            raise ValueError(f"data file {self.source!r} is not readable")
        size = os.path.getsize(self.source)
        if size == 0:
            raise ValueError(f"data file {self.source!r} is empty")
        if self.format == "uint16" and size % 2:
            raise ValueError(f"data file {self.source!r} has odd size {size}: not uint16 tokens")


BUILTIN_TRAINER = ["-m", "trainmover.gpt_trainer"]


@dataclass
class ProcessConfig:
    """What each worker and standby process runs, and where: a Python training script that
    uses the runtime's API, as ``[SCRIPT, ARGS...]`` or ``["-m", MODULE, ARGS...]`` (what
    follows ``python`` on its command line). The default is the built-in GPT trainer."""

    # The training program, as what follows `python`: [SCRIPT, ARGS...] or ["-m", MODULE,
    # ARGS...] (`trainmover launch` sets it from its command after `--`).
    command: list = field(default_factory=lambda: list(BUILTIN_TRAINER))
    device: str = "cpu"                # "cpu" or "cuda" (each process on its slot's GPU)
    # On CUDA, run torch's deterministic kernels only (``torch.use_deterministic_algorithms``:
    # an operation that has none raises), so that a run with migrations and failures ends
    # with the uninterrupted run's weights on the same hardware, as on the CPU. Off: faster
    # kernels, results equal only within float tolerance.
    deterministic: bool = True
    store_host: str = "127.0.0.1"      # the address the job's store listens on
    store_port: int = 0                # its port (0: any free one, named in control.json)
    # The job's store on an etcd cluster instead: etcd://HOST:PORT,...?ca=FILE&cert=FILE&
    # key=FILE (mutual TLS; empty: the built-in store, served by host 0's agent). Three
    # members on three hosts keep the store through the loss of any one (docs/failures.md).
    # Host 0's processes still bind ``store_host`` for their communication.
    etcd: str = ""
    # Listening (store, dashboard) on an address other than loopback must be asked for: the
    # store's values are signed, but whoever reaches it can flood or delete its keys, and
    # the workers' gloo/NCCL connections are not authenticated at all (docs/security.md).
    allow_remote: bool = False
    # Give every process its own compiler cache directories, as if each ran on its own
    # machine (benchmarks: a joiner on a new machine starts with no cache).
    isolate_caches: bool = False

    @property
    def builtin(self) -> bool:
        return list(self.command) == BUILTIN_TRAINER

    def validate(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"process.device must be 'cpu' or 'cuda', got {self.device!r}")
        if not isinstance(self.allow_remote, bool):
            raise ValueError(f"process.allow_remote must be true or false, got "
                             f"{self.allow_remote!r}")
        cmd = self.command
        if not cmd or not all(isinstance(a, str) for a in cmd):
            raise ValueError(f"process.command must be a non-empty list of strings, got "
                             f"{cmd!r}")
        if cmd[0] == "-m":
            if len(cmd) < 2 or not cmd[1] or cmd[1].startswith("-"):
                raise ValueError(f"process.command {cmd!r}: '-m' must be followed by a "
                                 f"module name")
            return
        if cmd[0].startswith("-"):
            raise ValueError(f"process.command {cmd!r}: expected SCRIPT [ARGS] or -m MODULE "
                             f"[ARGS] (the part after 'python'), got option {cmd[0]!r}")
        if not os.path.isfile(cmd[0]):
            raise ValueError(f"training script {cmd[0]!r} does not exist or is not a file")


def is_loopback(addr: str) -> bool:
    """An address only this machine reaches (names other than localhost count as remote)."""
    import ipaddress

    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


MAX_STANDBYS_SMALL_JOB = 16
"""A job never needs more standbys than worker roles (each replaces one role) to survive one
event; a small job may keep more to ride out repeated failures or to move one worker after
another without replenishing (rolling maintenance: one standby per move). Beyond that, a
count is a typo that would start hundreds of processes."""

# From this many hosts the commit vote goes through groups of hosts by default
# (``AgentConfig.vote_group_hosts``): below it, a group's extra hop costs more than the one
# store's per-host requests save (benchmarks/results/vote_groups.md). On etcd from far
# fewer: there H hosts' racing writes take H rounds (8 hosts: 67 ms, 16: 130 ms), which
# groups cut to about sqrt(H) writers for a hop of ~1 ms (benchmarks/results/
# etcd_vote_small.md).
VOTE_GROUPS_FROM_HOSTS = 64
VOTE_GROUPS_FROM_HOSTS_ETCD = 4


@dataclass
class HostsConfig:
    """The hosts of the job: one agent per host (host 0's started by the controller, the
    others by `trainmover agent` on their hosts), the run dir on a filesystem they share.
    Worker ``w<i>`` runs on host ``i // nproc_per_node`` (tensor-parallel groups stay inside
    a host when ``nproc_per_node`` is a multiple of the layout's ``tp``); standby ``s<i>``
    on host ``i % nnodes``, so standbys spread over every host, spare hosts included."""

    # Hosts of the job: host 0 runs the controller (and its agent), each other one runs
    # `trainmover agent`; more than 1 needs a process.store_host the others can reach.
    nnodes: int = 1
    nproc_per_node: int | None = None  # worker slots per host; default: as few hosts as fit

    def per_node(self, num_roles: int) -> int:
        return self.nproc_per_node or -(-num_roles // self.nnodes)

    def validate(self, num_roles: int, tp: int) -> None:
        _positive("hosts", nnodes=self.nnodes)
        if self.nproc_per_node is not None:
            _positive("hosts", nproc_per_node=self.nproc_per_node)
            if self.nproc_per_node * self.nnodes < num_roles:
                raise ValueError(f"hosts: {self.nnodes} host(s) x nproc_per_node="
                                 f"{self.nproc_per_node} slots cannot hold {num_roles} workers")
        if self.nnodes > 1 and self.per_node(num_roles) % tp:
            raise ValueError(f"hosts.nproc_per_node={self.per_node(num_roles)} is not a "
                             f"multiple of tp={tp}: a tensor-parallel group would span hosts")


@dataclass
class CommConfig:
    """Timeouts of the job's communication: last resorts, since failures are detected
    (``HealthConfig``) and every wait aborted long before they expire."""

    # A collective, point-to-point operation or group rendezvous gives up after this. A
    # worker's store clients wait as long: its commit vote and group rendezvous block on them.
    group_timeout_s: float = 120.0
    # Store operations of the store's host (the agent), of the controller and of benchmark
    # and test harnesses.
    store_timeout_s: float = 60.0
    # `trainmover migrate` connecting to a job's store: short, since a job that ended leaves
    # nobody listening and the command should say so promptly.
    client_connect_timeout_s: float = 10.0
    # The job's store answers only clients that prove they hold the run's key: a connection
    # that has not done so within this is closed, and at most `store_max_pending` such
    # connections are kept (the oldest closed first), so that strangers at the port cost
    # the store nothing.
    store_handshake_timeout_s: float = 10.0
    store_max_pending: int = 64
    # A host's processes reach the built-in store through their agent (core/kvproxy.py):
    # every connection they make is a stream of the agent's one connection, so the store
    # holds a connection a host, not a few a process (~200K at 100K GPUs). False: each
    # process connects to the store itself. (With the store on etcd they always do.)
    store_proxy: bool = True
    # The communication backend: "auto" is NCCL on CUDA when every process of the job can
    # have a GPU of its own (NCCL refuses two ranks on one device), gloo otherwise; "gloo"
    # with CUDA stages every operation through host memory (workers sharing GPUs: for
    # tests and small machines, not for speed).
    backend: str = "auto"
    # Refuse any tensor handed to a group that is not on the group's device (an error naming
    # the group, the operation and both devices). For tests and debugging on a GPU: gloo
    # through host memory accepts a host tensor that NCCL would reject.
    check_devices: bool = False
    # torch.distributed process groups over the job's groups (a default group and one per
    # axis, for the script's own DDP, FSDP2, DTensor, dist.* calls; comm/torch_groups.py):
    # "auto" gives them to every script but the built-in trainer (which has no use for
    # them); "on", "off". They need the forwarding backend, compiled once per machine.
    torch_groups: str = "auto"
    # the one-time build of that backend, done by the launcher before any process starts
    build_timeout_s: float = 600.0

    def validate(self) -> None:
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"comm.backend must be 'auto', 'nccl' or 'gloo', got "
                             f"{self.backend!r}")
        if self.torch_groups not in ("auto", "on", "off"):
            raise ValueError(f"comm.torch_groups must be 'auto', 'on' or 'off', got "
                             f"{self.torch_groups!r}")
        _seconds("comm", group_timeout_s=self.group_timeout_s,
                 build_timeout_s=self.build_timeout_s,
                 store_timeout_s=self.store_timeout_s,
                 client_connect_timeout_s=self.client_connect_timeout_s,
                 store_handshake_timeout_s=self.store_handshake_timeout_s)
        if not isinstance(self.store_max_pending, int) or self.store_max_pending < 1:
            raise ValueError(f"comm.store_max_pending must be a positive integer, got "
                             f"{self.store_max_pending!r}")


@dataclass
class StandbyConfig:
    """Standby processes and their sandboxed warm-up: representative roles record their
    first step (when the job has standbys); standbys replay it for ``warmup_iterations``
    shadow steps per stage structure."""

    count: int = 0                     # standby processes started with the job
    # In a job with standbys that starts at step 0, the representative worker of each stage
    # structure records its step 0's communication: what the standbys' warm-up replays.
    record: bool = True
    # Standbys warm up before they are needed: shadow steps of each stage structure, from
    # the recordings (``record``), compile and fill caches and check the job's data. Off:
    # standbys wait cold, and a joiner compiles inside its switch.
    warmup: bool = True
    # Shadow steps (steps 1, 2, ...) a standby runs per stage structure in its warm-up; an
    # assignment that arrives ends the warm-up early.
    warmup_iterations: int = 2
    recording_dir: str | None = None   # default: <run dir>/recordings
    # A script's torch operations are recorded with their outputs, except an output larger
    # than this (an FSDP all-gather of a whole layer): its shape only, answered locally in
    # the replay. What steers code (sizes, pickled objects, norms, votes) is small.
    record_max_mb: float = 4.0
    # How often a standby looks for a structure's recording that is not written yet.
    recording_poll_s: float = 0.05
    # How long a standby's shadow step waits for the job's fingerprint of the same step's
    # batch (published by the job's worker of that role when it runs the step) before it
    # skips the check, with an event.
    fingerprint_wait_s: float = 30.0
    # Keep ``count`` standbys in the pool: start a new standby process whenever one dies, is
    # fenced as hung, or is consumed by a migration or recovery (on a cluster: the host's
    # agent starts it in the freed slot), at most ``replenish_max`` over the job (a standby
    # that dies at every start must not become a crash loop).
    replenish: bool = False
    # The most standbys started over the whole job to refill the pool (0: none).
    replenish_max: int = 16
    # A planned migration whose joiner is still starting or warming up (compiling) waits
    # this long for it to finish before ordering it in anyway (reported): ordered at once, it
    # would drop its warm-up and compile inside the switch, every stayer waiting. 0: never
    # waits. Recovery never waits (a replacement is needed now).
    join_wait_s: float = 120.0

    def validate(self) -> None:
        _non_negative("standby", count=self.count, replenish_max=self.replenish_max)
        if not isinstance(self.join_wait_s, (int, float)) or isinstance(self.join_wait_s, bool) \
                or self.join_wait_s < 0:
            raise ValueError(f"standby.join_wait_s must be >= 0, got {self.join_wait_s!r}")
        _positive("standby", warmup_iterations=self.warmup_iterations)
        _seconds("standby", record_max_mb=self.record_max_mb)   # (a positive number)
        _seconds("standby", recording_poll_s=self.recording_poll_s,
                 fingerprint_wait_s=self.fingerprint_wait_s)


@dataclass
class MigrationConfig:
    """How a planned migration moves the leaver's state to the joiner.

    Stop-and-copy (the default): at the switch the leaver sends its whole state, so the
    switch takes (state bytes / bandwidth) on top of a step. With ``precopy``, the leaver
    sends its parameters and optimizer state during phase 1, ``precopy_chunk_mb`` at each
    step boundary while training goes on, and after each step the gradients its optimizer
    applied to what was already sent; the joiner replays those updates on its copy. At the
    switch only what the replay does not keep current moves: buffers, extra state, the
    generators' states, settings, and the last step's gradients (replayed by the joiner).
    The result is bit-identical for a script whose parameters and optimizer state change
    only through the registered optimizer's ``step()`` (torch's optimizers, with or without
    a GradScaler or an LR scheduler, on the same kind of device); otherwise, and for
    DTensor (FSDP2) state or an optimizer stepped with arguments, the switch copies the
    whole state (event ``precopy_refused``/``precopy_abandoned``)."""

    # Copy the state in the background during phase 1 and keep it current by replaying the
    # optimizer (see above). As --precopy.
    precopy: bool = False
    # Bytes of parameters and optimizer state (MiB) sent at each step boundary of phase 1:
    # sent while the step's forward and backward run, and waited for before its optimizer
    # step. Larger: a shorter phase 1, more load on the link during it.
    precopy_chunk_mb: float = 64.0
    # The longest the leaver waits, at a step boundary or before its optimizer step, for
    # the joiner to have taken what was sent, as a fraction of the step's time; a joiner
    # that lags this much for PRECOPY_LAG_STEPS steps in a row makes the leaver give the
    # pre-copy up (the switch then copies the whole state): the job never waits long for it.
    precopy_max_wait: float = 0.25
    # The joiner checks its replayed copy against the leaver's (per-entry checksums the
    # leaver writes to the store after the switch) before it votes on its first step: a
    # script that changed registered state outside the optimizer is caught there (the
    # joiner fails, the step is aborted and the role recovered, event ``precopy_diverged``). How long it waits for the
    # leaver's checksums before it trains on unverified (event ``precopy_unverified``).
    precopy_verify_timeout_s: float = 10.0

    def validate(self) -> None:
        if not isinstance(self.precopy, bool):
            raise ValueError(f"migration.precopy must be true or false, got {self.precopy!r}")
        _seconds("migration", precopy_chunk_mb=self.precopy_chunk_mb,
                 precopy_max_wait=self.precopy_max_wait,
                 precopy_verify_timeout_s=self.precopy_verify_timeout_s)


@dataclass
class HealthConfig:
    """Failure detection: workers beat every interval; one silent for the timeout is hung
    and fenced. A step is applied only after every worker voted (commit protocol)."""

    # Failure handling on: heartbeats, the commit vote, abortable waits, detection and
    # recovery. Off: any worker failure ends the job.
    recover: bool = True
    # How often (seconds) each worker beats to its host's agent, and each agent writes its
    # host's beat to the store (less often past host_beats_per_s x this many hosts); below
    # heartbeat_timeout_s.
    heartbeat_interval_s: float = 0.25
    # A worker whose heartbeat has not moved for this long (seconds) is hung and fenced (an
    # agent's: its host is lost), once the job committed a step since it last started or
    # changed; before that, startup_timeout_s applies.
    heartbeat_timeout_s: float = 3.0
    # Until the job commits its first step after a start, restart, promotion or switch, a
    # heartbeat may pause this long (many processes compiling at once starve each other of
    # CPU for seconds): the start-up probe, to the heartbeat timeout's liveness probe.
    startup_timeout_s: float = 30.0
    # Step watchdog: once no step was committed for max(stall_floor_s, stall_factor x the
    # recent step time), a worker whose heartbeat is silent (``silence_s``) while the others
    # beat is the hung one, fenced without waiting for heartbeat_timeout_s.
    stall_factor: float = 3.0
    # The step watchdog's stall limit is never below this many seconds (with short steps, a
    # pause of a few is scheduling noise, not a stall).
    stall_floor_s: float = 0.5
    # The watchdog calls a worker's heartbeat silent after this many heartbeat intervals
    # without a beat (silence_s = max(silence_floor_s, silence_beats x heartbeat_interval_s)).
    silence_beats: int = 4
    # The least time (seconds) before the watchdog calls a heartbeat silent, whatever
    # silence_beats gives (one late beat is scheduling noise).
    silence_floor_s: float = 1.0
    # The most host beats a second the job's store is given: each host's agent writes one
    # key a beat, every heartbeat_interval_s up to host_beats_per_s x heartbeat_interval_s
    # hosts (1,000 by default), every hosts / host_beats_per_s seconds beyond (12,500 hosts:
    # 3.1 s), and the host rules wait as many of those beats (``host_beat_interval_s``):
    # a store's one thread serves ~50K requests a second, which 12,500 hosts beating four
    # times a second would take whole. Higher: a lost host found sooner at that scale.
    host_beats_per_s: float = 4000.0
    # The most hosts the watchdog's silence rule (and a silent agent's while other hosts are
    # heard) fences in one check. A silence wider than that is waited out to
    # heartbeat_timeout_s: independent hangs on that many hosts within one silence interval
    # are unlikely, load or a network or store hiccup is not (a recovery at 2,048 simulated
    # workers once fenced the 40 workers of 5 hosts whose beats lagged 1 s under load, and
    # the job failed in cascade).
    silence_max_hosts: int = 2
    # How often the controller reads heartbeats and failure reports from the store (process
    # exits are seen every supervision round): detection latency against store load.
    check_interval_s: float = 0.05
    # Every this many steps (0: only at the end) each role posts its state's digest and the
    # controller compares the data-parallel replicas' (a mismatch is an error event and
    # ``replicas_agree: false`` in the summary). Hashing the whole state costs a pass over
    # it: off by default between the ends.
    verify_every: int = 0
    # Replicas that end with different states fail the job (exit code 1; the summary and
    # final state are still written): its weights would depend on which replica is read.
    replicas_must_agree: bool = True
    # A worker whose main thread shows no progress for this long while it trains (no step
    # started, no wait polled: wedged in a deadlock or a stuck data loader) stops beating,
    # so it is fenced as hung, and reports where that thread is stuck. Must exceed the
    # longest stretch between steps without a runtime wait (a first step's compilation, an
    # evaluation). 0: not judged.
    main_stall_s: float = 600.0

    def host_beat_interval_s(self, hosts: int) -> float:
        """How often each of ``hosts`` agents writes its host's beat (``host_beats_per_s``)."""
        return max(self.heartbeat_interval_s, hosts / self.host_beats_per_s)

    def silence_s(self, hosts: int = 1) -> float:
        """How long a heartbeat may pause before the step watchdog may call it silent: a few
        missed beats, never under the floor (one late beat is scheduling noise). The
        controller hears a worker through its host's beats: in a job of ``hosts``, a few of
        those."""
        return max(self.silence_floor_s, self.silence_beats * self.host_beat_interval_s(hosts))

    def timeout_s(self, hosts: int = 1) -> float:
        """``heartbeat_timeout_s`` as applied in a job of ``hosts``, whose host beats may
        come seconds apart: never under twice ``silence_beats`` of them."""
        return max(self.heartbeat_timeout_s,
                   2 * self.silence_beats * self.host_beat_interval_s(hosts))

    def startup_s(self, hosts: int = 1) -> float:
        """``startup_timeout_s`` as applied in a job of ``hosts``: never under ``timeout_s``."""
        return max(self.startup_timeout_s, self.timeout_s(hosts))

    def quiet_listed_s(self) -> float:
        """After how long without a beat an agent lists a process in its host's beat
        (``P.HostBeat.quiet``): one and a half heartbeat intervals (a process on time is
        never listed), and never after the controller could judge the silence."""
        return min(1.5 * self.heartbeat_interval_s, self.silence_s(),
                   self.heartbeat_timeout_s)

    def validate(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(f"health.heartbeat_interval_s={self.heartbeat_interval_s!r} must "
                             f"be > 0 and below heartbeat_timeout_s={self.heartbeat_timeout_s!r}")
        if self.startup_timeout_s < self.heartbeat_timeout_s:
            raise ValueError(f"health.startup_timeout_s={self.startup_timeout_s!r} must be >= "
                             f"heartbeat_timeout_s={self.heartbeat_timeout_s!r}")
        if self.stall_factor < 1 or self.stall_floor_s <= 0:
            raise ValueError(f"health.stall_factor must be >= 1 and stall_floor_s > 0, got "
                             f"{self.stall_factor!r} and {self.stall_floor_s!r}")
        _positive("health", silence_beats=self.silence_beats,
                  silence_max_hosts=self.silence_max_hosts)
        _seconds("health", host_beats_per_s=self.host_beats_per_s)    # any number > 0
        _non_negative("health", verify_every=self.verify_every)
        if self.main_stall_s and self.main_stall_s < 2.0:
            # a survivor waiting for its recovery plan shows progress once a second
            raise ValueError(f"health.main_stall_s={self.main_stall_s!r} must be 0 (off) or "
                             f">= 2 s")
        _seconds("health", silence_floor_s=self.silence_floor_s,
                 check_interval_s=self.check_interval_s)


@dataclass
class RecoveryConfig:
    """What the controller does once a failure is detected."""

    # After aborting the step in flight, how long the survivors have to report: a survivor
    # that beats but has not reported this long after the abort reached its host is named
    # silent by its agent and fenced as hung (one whose agent said nothing: twice this after
    # the abort or the last report that came in). While reports keep coming (a large job's,
    # queued at the store), or while fencing the silent would cost the job more than its
    # free standbys or a role's last copy, it waits on, up to ``report_wait_max_s``.
    report_timeout_s: float = 6.0
    report_wait_max_s: float = 120.0
    # A failure with no free standby: start a replacement process (a new standby, promoted
    # as soon as it runs; the job waits for it, "degraded") instead of stopping the job.
    replace_without_standby: bool = True
    # Plans for one failure given up in a row (a joiner or survivor failed while carrying it
    # out) before the job stops, resumable, instead of trying again: a joiner that fails the
    # same way every time (a script that cannot load the state) must not loop for ever.
    max_attempts: int = 5
    # A failed role restored from live data-parallel replicas takes its state from up to
    # this many of them at once, an equal share from each (striped: each link carries 1/k
    # of the bytes); 1: from one replica.
    stripe_sources: int = 4

    def validate(self) -> None:
        _seconds("recovery", report_timeout_s=self.report_timeout_s,
                 report_wait_max_s=self.report_wait_max_s)
        if self.report_wait_max_s < self.report_timeout_s:
            raise ValueError(f"recovery.report_wait_max_s={self.report_wait_max_s} is less "
                             f"than recovery.report_timeout_s={self.report_timeout_s}")
        _positive("recovery", stripe_sources=self.stripe_sources)
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"recovery.max_attempts must be a positive integer, got "
                             f"{self.max_attempts!r}")


@dataclass
class CheckpointConfig:
    """Asynchronous per-role checkpoints every ``every`` steps (0: off) and of the initial
    state: a copy to host memory at the step boundary, written in the background, each file
    listed with its size and sha256 in the checkpoint's manifest. And the final checkpoint.
    On by default: a role without a live data-parallel replica is recovered from the newest
    one (``trainmover bench checkpoint`` measures the cost of an interval)."""

    # Steps between periodic checkpoints (one after every N-th committed step; 0: none):
    # the newest is what a role with no live data-parallel replica and no snapshot is
    # recovered from, and where `run --resume` continues. As --checkpoint-every.
    every: int = 50
    keep: int = 2      # complete checkpoints kept on disk (older ones are deleted)
    # At the end, the holder of role dp0.pp0.tp0 waits this long for every other
    # data-parallel-rank-0 role's final state before assembling the canonical checkpoint.
    final_timeout_s: float = 300.0

    def validate(self) -> None:
        _non_negative("checkpoint", every=self.every)
        _positive("checkpoint", keep=self.keep)
        _seconds("checkpoint", final_timeout_s=self.final_timeout_s)


@dataclass
class SnapshotConfig:
    """In-memory peer snapshots of a job whose roles have no data-parallel replica (``dp``
    of 1): every ``every`` steps (0: off) each worker copies its state to host memory at the
    step boundary and sends it, in the background, to the snapshot holder of the next host
    (the agent there; with one host, this host's agent). A failure then rolls the job back
    at most ``every`` steps, from memory; disk checkpoints are the fallback when the holder
    is gone. A job with replicas recovers from them and takes none."""

    # Steps between peer snapshots (one after every N-th committed step) in a job with dp
    # 1: a failure replays at most this many steps; 0: none (recovery then falls back to
    # checkpoints). As --snapshot-every.
    every: int = 10
    keep: int = 2      # snapshot steps each holder keeps per role (older ones are dropped)
    # Reaching a holder gives up after this (seconds); the controller lists the holders
    # when it plans a recovery (a holder that does not answer in time is passed over).
    connect_timeout_s: float = 2.0
    # Each socket read or write of a snapshot transfer to or from a holder (on either end)
    # gives up after this (seconds).
    io_timeout_s: float = 60.0

    def validate(self) -> None:
        _non_negative("snapshot", every=self.every)
        _positive("snapshot", keep=self.keep)
        _seconds("snapshot", connect_timeout_s=self.connect_timeout_s,
                 io_timeout_s=self.io_timeout_s)


@dataclass
class StragglerConfig:
    """Slow workers (``core/stragglers.py``): each worker publishes the median compute time
    (its CPU time, or step time minus time blocked in its groups: ``measure``) of every
    ``window`` steps; the controller compares it with the worker's data-parallel peers of the
    same stage and shard (without peers: with its own baseline) and calls a worker a
    straggler when it was at least ``1 + min_shift`` times slower in the median of its last
    ``min_windows`` windows. ``policy``: ``off`` (not measured), ``alert`` (an event and a
    line), ``migrate`` (also hand its role to a warm standby when
    staying slow to the end would cost more than ``migration_cost_s``, or the measured cost
    of this job's migrations; the slow process leaves the job)."""

    policy: str = "alert"
    # Steps per measurement window: each worker publishes the median compute time of each
    # window (longer: steadier medians, a later verdict).
    window: int = 8
    # How much slower counts: a straggler's compute is at least 1 + min_shift times its
    # reference (its peers' median, else its own baseline); it stays one until the ratio
    # falls below 1 + min_shift / 2.
    min_shift: float = 0.15
    # The verdict is on the median of a worker's last min_windows windows (more: one noisy
    # window weighs less, a straggler is found later).
    min_windows: int = 5
    settle_windows: int = 2        # a worker's first windows in a role are not judged
    baseline_windows: int = 3      # without peers: the windows that make the own baseline
    # after a straggler's migration, no other one for this many steps (the job settles)
    cooldown_steps: int = 50
    migration_cost_s: float = 1.0  # assumed until a migration of this job was measured
    check_interval_s: float = 0.5  # how often the controller reads the measurements
    # compute is measured as "cpu" (the main thread's CPU time: immune to descheduling, for
    # CPU jobs), "wall" (step time minus waits: GPU kernels) or "auto" (cpu on CPU devices)
    measure: str = "auto"

    def cpu_measure(self, device_type: str) -> bool:
        return self.measure == "cpu" or (self.measure == "auto" and device_type == "cpu")

    def validate(self) -> None:
        if self.measure not in ("auto", "cpu", "wall"):
            raise ValueError(f"straggler.measure={self.measure!r}: expected auto, cpu or wall")
        if self.policy not in ("off", "alert", "migrate"):
            raise ValueError(f"straggler.policy={self.policy!r}: expected off, alert or "
                             f"migrate")
        _positive("straggler", window=self.window, min_windows=self.min_windows,
                  baseline_windows=self.baseline_windows)
        _non_negative("straggler", settle_windows=self.settle_windows,
                      cooldown_steps=self.cooldown_steps)
        if not 0 < self.min_shift < 10:
            raise ValueError(f"straggler.min_shift={self.min_shift!r} must be in (0, 10)")
        _seconds("straggler", migration_cost_s=self.migration_cost_s,
                 check_interval_s=self.check_interval_s)


@dataclass
class MaintenanceConfig:
    """Rolling maintenance: every ``rebalance_every_s`` seconds (0: never) the next worker in
    a rotation over the roles is moved onto a warm standby (``control/rebalance.py``)."""

    # Seconds between two rolling-maintenance moves (counted from the last one; a move waits
    # for a warm standby and for no migration in flight); 0: never. As --rebalance-every.
    rebalance_every_s: float = 0.0

    def validate(self) -> None:
        if self.rebalance_every_s < 0:
            raise ValueError(f"maintenance.rebalance_every_s={self.rebalance_every_s!r} must "
                             f"be >= 0")


@dataclass
class DashboardConfig:
    """The operator view the controller serves (``view/server.py``): a live page and a
    Prometheus ``/metrics``, behind a token derived from the job's secret."""

    port: int | None = None        # None: no dashboard; 0: any free port
    host: str = "127.0.0.1"        # loopback: only this machine's users (who need the token)
    refresh_s: float = 1.0         # the page's poll period; the server reads the logs at most
                                   # this often, however many pages are open
    history: int = 300             # step measurements kept per worker for the page's chart

    def validate(self) -> None:
        if self.port is not None and not (isinstance(self.port, int) and 0 <= self.port < 65536):
            raise ValueError(f"dashboard.port={self.port!r} must be a TCP port (0: any free)")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"dashboard.host={self.host!r} must be an address to listen on")
        if not self.refresh_s > 0:
            raise ValueError(f"dashboard.refresh_s={self.refresh_s!r} must be > 0")
        if not (isinstance(self.history, int) and self.history >= 10):
            raise ValueError(f"dashboard.history={self.history!r} must be >= 10")


@dataclass
class ControllerConfig:
    """The controller process: its supervision rounds, how it stops processes, and what
    happens when it dies. It may die without stopping training (the agent hosts the store and
    the processes)."""

    # "auto": the agent starts a new controller, which resumes from the store, at most
    # ``max_restarts`` times per job (one that keeps dying has a cause a restart will not
    # fix); "manual": the agent waits ``grace_s`` for `trainmover controller --resume`, then
    # stops the job.
    restart: str = "auto"
    # After the controller dies, how long (seconds) the agent waits for a new one to take
    # over (the one it started, with "auto"; `trainmover controller --resume`, with
    # "manual") before it stops the job. With the store on etcd, every agent stops once no
    # controller has beaten for this long (after takeovers failed).
    grace_s: float = 300.0
    # With "auto": the most controllers the agent starts for the job; the controller's death
    # after that many stops the job (0: its first death does).
    max_restarts: int = 3
    # The supervision round: steps and exits are seen within this.
    poll_s: float = 0.02
    # How often migration requests from outside the job (`trainmover migrate`) are looked
    # for: a person is waiting, and one store read per round would cost the job's store host.
    request_poll_s: float = 0.1
    # A request number taken from the (unsigned) request counter but not written after this
    # long is passed over: a forged bump must not hold up the requests behind it.
    request_hole_timeout_s: float = 10.0
    # Every this many committed steps, the store keys of decided steps are deleted (0: never):
    # a weeks-long job's store stays the size of a short one's (``control/retention.py``).
    gc_every_steps: int = 100
    # While nothing is in flight, the controller's snapshot is saved at most this often
    # (whatever is in flight, and every order sent, is saved before it goes out).
    snapshot_interval_s: float = 1.0
    # A table of the snapshot (the membership, the processes, ...) whose JSON is at least this
    # many bytes is kept as parts, each under its own key and file, and a save writes only
    # the parts that changed (0: every table; from a few hundred workers with the default).
    snapshot_part_min_bytes: int = 64 * 1024
    # How often <run dir>/status.json (what `trainmover status` reads) is rewritten; it is
    # taken from a snapshot, so no more often than those are computed, and less often where
    # writing it would take over 5% of the controller's time (thousands of workers: the file
    # says how often, and its readers wait for that).
    status_interval_s: float = 1.0
    # How often the standbys' readiness (cold, warming, warm) is read: it changes in seconds.
    standby_poll_s: float = 0.25
    # How often the controller checks that no newer controller took over (it then steps
    # down): two controllers act at once for at most this long.
    incarnation_check_s: float = 0.25
    # A migration's downtime is measured from every stayer's step-end times; a stayer that
    # has not posted them this long after the job passed the steps they span is left out.
    downtime_report_timeout_s: float = 10.0
    # A process told to stop gets SIGTERM, then SIGKILL after this (also at the job's end).
    stop_grace_s: float = 3.0
    # At the job's end, how long the controller waits for the agent to stop every process
    # and exit before killing it.
    agent_exit_timeout_s: float = 30.0
    # With the store on etcd (process.etcd), the controller beats this often in the store,
    # and when its beat has been still for ``takeover_after_s`` the agent of the next host
    # (of ``successors`` hosts after the controller's, each a further ``takeover_after_s``
    # later than the one before it) starts a new controller on its own host: the job
    # outlives the controller's host. Longer than a restart on the controller's own host
    # takes (its agent restarts it first).
    beat_interval_s: float = 1.0
    takeover_after_s: float = 10.0
    successors: int = 2

    def validate(self) -> None:
        if self.restart not in ("auto", "manual"):
            raise ValueError(f"controller.restart must be 'auto' or 'manual', got "
                             f"{self.restart!r}")
        _non_negative("controller", max_restarts=self.max_restarts,
                      gc_every_steps=self.gc_every_steps,
                      snapshot_part_min_bytes=self.snapshot_part_min_bytes)
        _seconds("controller", grace_s=self.grace_s, poll_s=self.poll_s,
                 request_poll_s=self.request_poll_s, standby_poll_s=self.standby_poll_s,
                 request_hole_timeout_s=self.request_hole_timeout_s,
                 snapshot_interval_s=self.snapshot_interval_s,
                 status_interval_s=self.status_interval_s,
                 incarnation_check_s=self.incarnation_check_s, stop_grace_s=self.stop_grace_s,
                 agent_exit_timeout_s=self.agent_exit_timeout_s,
                 downtime_report_timeout_s=self.downtime_report_timeout_s,
                 beat_interval_s=self.beat_interval_s, takeover_after_s=self.takeover_after_s)
        _non_negative("controller", successors=self.successors)
        if self.takeover_after_s <= 2 * self.beat_interval_s:
            raise ValueError(f"controller.takeover_after_s={self.takeover_after_s} must exceed "
                             f"two beats (controller.beat_interval_s={self.beat_interval_s}): "
                             f"a controller that is alive would be taken over")


@dataclass
class AgentConfig:
    """The agent: the job's store host and process supervisor (``agent/main.py``). It reads
    these, and ``ControllerConfig``'s restart policy, from the run dir's ``job.json``."""

    # The loop's shortest sleep, and how often it looks for the exit of a process it cannot
    # wait for (a kernel without pidfds). Requests, its fencing and process exits wake it
    # at once (it waits for them; none is polled through the store, which thousands of
    # hosts would load); a signal's TERM-then-KILL deadline and its other timers are
    # slept until.
    poll_s: float = 0.02
    # The loop's longest sleep with nothing due: how soon a helper thread's error (the
    # store lost) is acted on. Waking every poll_s instead cost a host's agent fifty
    # wake-ups a second for nothing (18% of the control-plane simulator's CPU at 4K
    # workers).
    idle_wake_s: float = 1.0
    # Host 0's agent: how often it checks that the controller's process is alive.
    controller_check_s: float = 0.1
    # While it waits for the controller's next request, how often it looks for a hole in
    # its request queue (an index a controller took and died before writing): each look is
    # a store request; the request itself is seen as soon as it is written.
    request_recheck_s: float = 1.0
    # How long the agent holds its processes' votes on a step, once one came, before it
    # casts the host's ballot with the votes it has, when a process that voted before has
    # not voted yet (a leaver past its switch, until it exits; votes after the ballot went
    # go in one more ballot this long after it, or with the last of them). In the steady
    # state the ballot goes with the last vote.
    # The same for its processes' failure reports of an epoch (agent/reports.py): written
    # as one value once every running worker reported, else this long after the first.
    vote_coalesce_s: float = 0.005
    # The commit vote aggregated per group of this many hosts (``agent/groupvote.py``): each
    # group's last host serves a small store its members cast their ballots into, casts one
    # ballot for the group at the job's store and hands the decision back the same way. The
    # job's store then serves a few requests a group a step instead of three a host (its one
    # thread: ~85 ms a step at 2,048 hosts, flat). 0: automatic (flat below
    # ``VOTE_GROUPS_FROM_HOSTS`` hosts, 64, or ``VOTE_GROUPS_FROM_HOSTS_ETCD``, 4, with the
    # store on etcd; else groups of about sqrt(hosts)); 1: flat.
    vote_group_hosts: int = 0
    # A member host's requests to its group's store give up after this (the leader's host
    # silent): the member then votes at the job's store as a host of no group. A leader
    # declared lost (fenced) or whose store closed is left at once.
    vote_group_timeout_s: float = 5.0
    # After stopping every process, how long it keeps the store up for the controller to
    # read that it did (then it exits regardless).
    shutdown_ack_s: float = 5.0
    # Start workers and standbys by forking them from a process that has imported torch
    # once (``agent/forkserver.py``): a start in milliseconds instead of seconds of imports
    # per process. Off, or where Linux's subreaper is not available, each is a new process.
    fork_server: bool = True
    # How long a spawn waits for the fork server (its first one: the server's own imports)
    # before the agent gives it up and starts that process, and every later one, anew.
    fork_server_timeout_s: float = 120.0
    # Host 0's agent says when the store refused connections (nobody with the run's key:
    # someone probing the port), at most once per this interval, with the count so far.
    refusal_report_s: float = 10.0

    def validate(self) -> None:
        _seconds("agent", poll_s=self.poll_s, idle_wake_s=self.idle_wake_s,
                 controller_check_s=self.controller_check_s,
                 request_recheck_s=self.request_recheck_s, vote_coalesce_s=self.vote_coalesce_s,
                 vote_group_timeout_s=self.vote_group_timeout_s,
                 shutdown_ack_s=self.shutdown_ack_s,
                 fork_server_timeout_s=self.fork_server_timeout_s,
                 refusal_report_s=self.refusal_report_s)
        if not isinstance(self.fork_server, bool):
            raise ValueError(f"agent.fork_server must be true or false, got "
                             f"{self.fork_server!r}")
        if isinstance(self.vote_group_hosts, bool) or not isinstance(self.vote_group_hosts, int) \
                or self.vote_group_hosts < 0:
            raise ValueError(f"agent.vote_group_hosts must be an integer >= 0 (0: automatic, "
                             f"1: no groups), got {self.vote_group_hosts!r}")

    def vote_group_size(self, nnodes: int, etcd: bool = False) -> int:
        """Hosts a vote group (1: every host votes at the job's store itself); ``etcd``:
        the job's store is on etcd."""
        if self.vote_group_hosts:
            return min(self.vote_group_hosts, nnodes)
        if nnodes < (VOTE_GROUPS_FROM_HOSTS_ETCD if etcd else VOTE_GROUPS_FROM_HOSTS):
            return 1
        return math.isqrt(nnodes - 1) + 1          # ceil(sqrt(nnodes))


@dataclass
class BaselineConfig:
    """The restart baselines that benchmarks compare against, each set in restart's favour."""

    # At this step every worker stops, fresh processes start, rebuild every group and reload
    # the checkpoint. Known in advance, and checkpoints every step (``checkpoint.every=1``).
    restart_at_step: int | None = None
    # On a failure, restart every process from the newest complete checkpoint instead of
    # recovering into a standby.
    restart_on_failure: bool = False

    def validate(self, checkpoint: CheckpointConfig) -> None:
        if self.restart_at_step is not None and checkpoint.every != 1:
            raise ValueError("baseline.restart_at_step needs checkpoint.every=1 "
                             f"(got {checkpoint.every!r})")


@dataclass
class JobConfig:
    """A whole job: the model and its training, then one section per part of the runtime.
    Every timeout, supervision interval and retry count of the runtime is a field of a
    section. Left as named constants in code: poll intervals of waits inside one process
    (they cost only milliseconds of latency when a wait is cut short) and the re-arm period
    of idle store waits (not timeouts: those waits loop)."""

    # The job's name: its default run dir is runs/<name>-<time>; named in its progress
    # lines and summary (`trainmover launch`: the script's name).
    name: str = "job"
    layout: Layout = field(default_factory=Layout)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    process: ProcessConfig = field(default_factory=ProcessConfig)
    hosts: HostsConfig = field(default_factory=HostsConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    standby: StandbyConfig = field(default_factory=StandbyConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    maintenance: MaintenanceConfig = field(default_factory=MaintenanceConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    faults: list = field(default_factory=list)  # faults.WorkerFault as dicts (tests, chaos)

    def has_torch_groups(self) -> bool:
        """Whether the script's workers get torch process groups (``CommConfig.torch_groups``)."""
        if self.comm.torch_groups == "auto":
            return not self.process.builtin
        return self.comm.torch_groups == "on"

    def checks_data_by_standby(self) -> bool:
        """Whether standbys check the job's batches in their warm-up (``StandbyConfig``)."""
        return self.standby.count > 0 and self.standby.record and self.standby.warmup

    def rehearses_data(self) -> bool:
        """Whether step 1 is rehearsed to check the script's data (``DataConfig``)."""
        return self.data.rehearse and not self.process.builtin and \
            not self.checks_data_by_standby()

    def takes_snapshots(self) -> bool:
        """Whether workers send peer snapshots (``SnapshotConfig``): only roles without a
        data-parallel replica need them."""
        return self.snapshot.every > 0 and self.layout.dp == 1

    def validate(self) -> "JobConfig":
        for section in (self.process, self.comm, self.standby, self.migration, self.health,
                        self.recovery, self.checkpoint, self.snapshot, self.straggler,
                        self.maintenance, self.dashboard, self.controller, self.agent):
            section.validate()
        self.baseline.validate(self.checkpoint)
        self.hosts.validate(self.layout.num_roles, self.layout.tp)
        most = max(self.layout.num_roles, MAX_STANDBYS_SMALL_JOB)
        if self.standby.count > most:
            raise ValueError(f"standby.count={self.standby.count} is more standbys than the "
                             f"job can use (at most one per worker role, or "
                             f"{MAX_STANDBYS_SMALL_JOB} for a smaller job: {most} here)")
        if self.process.etcd:
            storeaddr.parse_etcd(self.process.etcd)      # names what is wrong with it
            ctl = self.controller
            if ctl.grace_s <= ctl.successors * ctl.takeover_after_s:
                raise ValueError(f"controller.grace_s={ctl.grace_s} must exceed the last "
                                 f"successor's takeover (controller.successors="
                                 f"{ctl.successors} x controller.takeover_after_s="
                                 f"{ctl.takeover_after_s}) with the store on etcd")
        if self.hosts.nnodes > 1 and self.process.store_host.startswith("127."):
            raise ValueError(f"process.store_host={self.process.store_host!r} is loopback, "
                             f"which the other {self.hosts.nnodes - 1} host(s) cannot reach: "
                             f"give the address of this host on the cluster's network")
        for what, addr in (("process.store_host", self.process.store_host),
                           ("dashboard.host", self.dashboard.host if self.dashboard.port
                            is not None else "127.0.0.1")):
            if not is_loopback(addr) and not self.process.allow_remote:
                raise ValueError(f"{what}={addr!r} is not a loopback address: anyone who "
                                 f"reaches it can flood the job's store (or try the "
                                 f"dashboard), and the workers' gloo/NCCL ports are "
                                 f"unauthenticated; on a private cluster network, say so with "
                                 f"--allow-remote (process.allow_remote)")
        if not self.process.builtin:
            # a script of the user's: the model, data and optimizer are its own; train.steps
            # is the step count if the launcher was told it (progress and injects), else 0
            if not isinstance(self.train.steps, int) or self.train.steps < 0:
                raise ValueError(f"train.steps must be >= 0, got {self.train.steps!r}")
            return self
        self.model.validate()
        self.train.validate()
        self.data.validate()
        self.model.validate_layout(self.layout)
        self.train.validate_layout(self.layout)
        if self.data.format == "text" and self.model.vocab_size < 256:
            raise ValueError(f"model.vocab_size={self.model.vocab_size} is below 256, but text "
                             f"data uses byte tokens 0..255")
        return self

    def override(self, **settings) -> "JobConfig":
        """Set fields by name: a top-level field (``faults=[...]``) or ``<section>_<field>``
        (``checkpoint_every=2``, ``health_heartbeat_timeout_s=2.0``). An unknown name raises
        ``ValueError``; values are checked by ``validate``."""
        for key, value in settings.items():
            if key in self.__dataclass_fields__:
                setattr(self, key, value)
                continue
            section, _, name = key.partition("_")
            target = getattr(self, section) if section in self.__dataclass_fields__ else None
            if not (dataclasses.is_dataclass(target) and name in target.__dataclass_fields__):
                raise ValueError(f"unknown setting {key!r}: expected a field of JobConfig or "
                                 f"<section>_<field>, e.g. 'checkpoint_every'")
            setattr(target, name, value)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "JobConfig":
        """The inverse of ``to_dict`` (a run dir's ``job.json``); absent sections take their
        defaults."""
        sections = {f.name: f.default_factory for f in dataclasses.fields(cls)
                    if dataclasses.is_dataclass(f.default_factory)}
        return cls(**{k: sections[k](**v) if k in sections else v for k, v in d.items()})

    def threads_per_worker(self) -> int:
        if self.train.threads_per_worker:
            return self.train.threads_per_worker
        workers = self.layout.num_roles + self.standby.count
        return max(1, (os.cpu_count() or 1) // workers)
