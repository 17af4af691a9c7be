"""Named recipes: each is a function returning a complete ``JobConfig``. The CLI picks one by
name and overrides only a few fields (layout, steps, seed)."""
from __future__ import annotations

from typing import Callable

from trainmover.core.config import JobConfig, ModelConfig, ProcessConfig, TrainConfig
from trainmover.core.topology import Layout


def tiny() -> JobConfig:
    """Seconds-long jobs for tests: 4 blocks of width 64, 8 sequences of 32 tokens per step."""
    return JobConfig(
        name="tiny", layout=Layout(1, 1, 1),
        model=ModelConfig(n_layers=4, d_model=64, n_heads=4, seq_len=32),
        train=TrainConfig(steps=8, global_batch=8, num_microbatches=2, lr=3e-3, min_lr=3e-4,
                          warmup_steps=2))


def demo() -> JobConfig:
    """The README's main job: DP2 x PP2 on the built-in corpus, a minute on a laptop core."""
    return JobConfig(
        name="demo", layout=Layout(2, 2, 1),
        model=ModelConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64),
        train=TrainConfig(steps=40, global_batch=16, num_microbatches=4, lr=3e-3, min_lr=3e-4,
                          warmup_steps=5))


def small() -> JobConfig:
    """A 6-block, width-256 model: big enough that communication is not the whole step."""
    return JobConfig(
        name="small", layout=Layout(2, 1, 1),
        model=ModelConfig(n_layers=6, d_model=256, n_heads=8, seq_len=128),
        train=TrainConfig(steps=50, global_batch=32, num_microbatches=4, lr=1e-3, min_lr=1e-4,
                          warmup_steps=10))


def bench_step() -> JobConfig:
    """The step benchmark's model (engine vs DistributedDataParallel, DP only)."""
    return JobConfig(
        name="bench_step", layout=Layout(2, 1, 1),
        model=ModelConfig(n_layers=4, d_model=256, n_heads=8, seq_len=128),
        train=TrainConfig(steps=30, global_batch=16, num_microbatches=2, lr=1e-3, min_lr=1e-4,
                          warmup_steps=5))


def bench_downtime() -> JobConfig:
    """The downtime benchmark's job: compiled (cold start costs what it costs users), every
    process with its own compiler caches as if on its own machine."""
    return JobConfig(
        name="bench_downtime", layout=Layout(2, 2, 1),
        model=ModelConfig(n_layers=4, d_model=128, n_heads=4, seq_len=64),
        train=TrainConfig(steps=24, global_batch=16, num_microbatches=2, lr=1e-3, min_lr=1e-4,
                          warmup_steps=4, compile=True, threads_per_worker=1),
        process=ProcessConfig(isolate_caches=True))


RECIPES: dict[str, Callable[[], JobConfig]] = {
    "tiny": tiny, "demo": demo, "small": small, "bench_step": bench_step,
    "bench_downtime": bench_downtime,
}


def get_recipe(name: str) -> JobConfig:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}")
    return RECIPES[name]()
