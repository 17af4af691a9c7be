"""The built-in trainer: a GPT with 1F1B pipeline, Megatron-style tensor parallelism and
bucketed data parallelism (``engine.py``), driven by the same public API any training
script uses (``trainmover.init``, ``register``, ``steps``, ``commit``). ``trainmover run``
launches this module; its settings come from the job's configuration."""
from __future__ import annotations

import trainmover
from trainmover.train.data import BatchSource, load_tokens
from trainmover.train.engine import Engine


def main() -> None:
    rt = trainmover.init()
    cfg = rt.config
    data = load_tokens(cfg.data)
    rt.declare_data(data.sha256, data.description)
    batches = BatchSource(data, cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed,
                          cfg.model.vocab_size)
    engine = Engine(cfg, rt.role, rt.comm_groups, batches, rt.device)
    engine.on_point = rt.fault_point
    engine.on_batch = rt.fingerprint
    rt.register(model=engine.model, optimizer=engine.optimizer, buckets=engine.grads)
    rt.tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    for step in rt.steps(cfg.train.steps):
        engine.train_step(step, commit=rt.commit)


if __name__ == "__main__":
    main()
