"""Configuration dataclasses, one per component, each validated with errors that quote the
bad value. A whole job is a ``JobConfig``; named recipes (``recipes.py``) produce them."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from trainmover.core.topology import Layout, split_layers


def _positive(owner: str, **values) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{owner}.{name} must be a positive integer, got {v!r}")


@dataclass
class ModelConfig:
    """A decoder-only GPT (pre-norm blocks, learned positions, untied head)."""

    vocab_size: int = 256
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    seq_len: int = 64
    dropout: float = 0.0
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

    steps: int = 20
    global_batch: int = 16
    num_microbatches: int = 2
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    compile: bool = False
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
    256) or ``uint16`` (a flat little-endian token file)."""

    source: str = "builtin"
    format: str = "text"
    builtin_max_bytes: int = 4_000_000

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
    """What each worker and standby process runs: a Python training script that uses the
    runtime's API, as ``[SCRIPT, ARGS...]`` or ``["-m", MODULE, ARGS...]`` (what follows
    ``python`` on its command line). The default is the built-in GPT trainer."""

    command: list = field(default_factory=lambda: list(BUILTIN_TRAINER))

    @property
    def builtin(self) -> bool:
        return list(self.command) == BUILTIN_TRAINER

    def validate(self) -> None:
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


@dataclass
class RuntimeConfig:
    """Process-level settings of a job (not of the model)."""

    device: str = "cpu"
    group_timeout_s: float = 120.0
    store_host: str = "127.0.0.1"
    standbys: int = 0
    faults: list = field(default_factory=list)  # faults.WorkerFault as dicts (tests, chaos)
    # Asynchronous per-role checkpoint every N steps (0: off): a copy to host memory at the
    # step boundary, written in the background. The restart baseline saves every step, the
    # most favourable case for restart.
    checkpoint_every: int = 0
    # The restart baseline: at this step every worker stops, fresh processes start, rebuild
    # every group and reload the checkpoint. Known in advance, again in restart's favour.
    restart_at_step: int | None = None
    # Give every process its own compiler cache directories, as if each ran on its own
    # machine (benchmarks: a joiner on a new machine starts with no cache).
    isolate_caches: bool = False
    # Sandboxed warm-up: representative roles record their first step (when the job has
    # standbys); standbys replay it for ``warmup_iterations`` shadow steps per stage kind.
    record: bool = True
    warmup: bool = True
    warmup_iterations: int = 2
    recording_dir: str | None = None   # default: <run dir>/recordings
    # How often a standby looks for a structure's recording that is not written yet.
    recording_poll_s: float = 0.05
    # How long a standby's shadow step waits for the job's fingerprint of the same step's
    # batch (published by the job's worker of that role when it runs the step) before it
    # skips the check, with an event.
    fingerprint_wait_s: float = 30.0
    # At the end, the holder of role dp0.pp0.tp0 waits this long for every other
    # data-parallel-rank-0 role's final state before assembling the canonical checkpoint.
    final_timeout_s: float = 300.0
    # Failure handling: workers beat every interval; one silent for the timeout is fenced.
    # A step is applied only after every worker voted (commit protocol).
    recover: bool = True
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 3.0
    # Step watchdog: once no step was committed for max(stall_floor_s, stall_factor x the
    # recent step time), a worker whose heartbeat has been silent for 4 intervals (>= 1 s) while
    # the others beat is the hung one, fenced without waiting for heartbeat_timeout_s.
    stall_factor: float = 3.0
    stall_floor_s: float = 0.5
    # Until the job commits its first step after a start, restart, promotion or switch, a
    # heartbeat may pause this long (many processes compiling at once starve each other of
    # CPU for seconds): the start-up probe, to the heartbeat timeout's liveness probe.
    startup_timeout_s: float = 30.0
    # The restart baseline for failures: on a failure, restart every process from the newest
    # complete checkpoint instead of recovering into a standby.
    restart_on_failure: bool = False
    # A failure with no free standby: start a replacement process (a new standby, promoted
    # as soon as it runs; the job waits for it, "degraded") instead of stopping the job.
    replace_without_standby: bool = True
    # The controller may die without stopping training (the agent hosts the store and the
    # processes). "auto": the agent starts a new one, which resumes from the store; "manual":
    # it waits ``controller_grace_s`` for `trainmover controller --resume`, then stops the job.
    controller_restart: str = "auto"
    controller_grace_s: float = 300.0

    def validate(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"runtime.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.group_timeout_s <= 0:
            raise ValueError(f"runtime.group_timeout_s must be > 0, got {self.group_timeout_s!r}")
        if not isinstance(self.standbys, int) or self.standbys < 0:
            raise ValueError(f"runtime.standbys must be >= 0, got {self.standbys!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"runtime.checkpoint_every must be >= 0, got "
                             f"{self.checkpoint_every!r}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(f"runtime.heartbeat_interval_s={self.heartbeat_interval_s!r} must "
                             f"be > 0 and below heartbeat_timeout_s={self.heartbeat_timeout_s!r}")
        if self.startup_timeout_s < self.heartbeat_timeout_s:
            raise ValueError(f"runtime.startup_timeout_s={self.startup_timeout_s!r} must be >= "
                             f"heartbeat_timeout_s={self.heartbeat_timeout_s!r}")
        if self.stall_factor < 1 or self.stall_floor_s <= 0:
            raise ValueError(f"runtime.stall_factor must be >= 1 and stall_floor_s > 0, got "
                             f"{self.stall_factor!r} and {self.stall_floor_s!r}")
        if self.warmup_iterations < 1:
            raise ValueError(f"runtime.warmup_iterations must be >= 1, got "
                             f"{self.warmup_iterations!r}")
        if self.controller_restart not in ("auto", "manual"):
            raise ValueError(f"runtime.controller_restart must be 'auto' or 'manual', got "
                             f"{self.controller_restart!r}")
        if self.controller_grace_s <= 0:
            raise ValueError(f"runtime.controller_grace_s must be > 0, got "
                             f"{self.controller_grace_s!r}")
        if self.restart_at_step is not None and self.checkpoint_every != 1:
            raise ValueError("runtime.restart_at_step needs runtime.checkpoint_every=1 "
                             f"(got {self.checkpoint_every!r})")


@dataclass
class JobConfig:
    name: str = "job"
    layout: Layout = field(default_factory=Layout)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    process: ProcessConfig = field(default_factory=ProcessConfig)

    def validate(self) -> "JobConfig":
        self.runtime.validate()
        self.process.validate()
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "JobConfig":
        return JobConfig(
            name=d["name"], layout=Layout(**d["layout"]), model=ModelConfig(**d["model"]),
            train=TrainConfig(**d["train"]), data=DataConfig(**d["data"]),
            runtime=RuntimeConfig(**d["runtime"]),
            process=ProcessConfig(**d.get("process", {})))

    def threads_per_worker(self) -> int:
        if self.train.threads_per_worker:
            return self.train.threads_per_worker
        workers = self.layout.num_roles + self.runtime.standbys
        return max(1, (os.cpu_count() or 1) // workers)
