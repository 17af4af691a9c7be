"""The recording worker's side of the standbys' warm-up (``comm/record.py``), and where a
joiner finds the recorded pipeline stage initialisations (``comm/pipelining.py``).

What is recorded, by the job's worker of each stage structure's representative role, in a
run that starts at step 0 with standbys to warm:
- trainmover's own groups (the built-in trainer): step 0's operations (``Recorder``);
- a script's torch process groups: steps 0 and 1, each a segment of every forwarder's
  operations with their outputs, and where each pipeline stage initialisation's operations
  fall. Two steps, because torch's first step differs from the next ones (a schedule
  initialises its stages in it, DDP rebuilds its buckets after it): a standby's first shadow
  step replays step 0, its later ones step 1.
The recording is saved once its last step is committed; a step redone is recorded again.
"""
from __future__ import annotations

import time

from trainmover.comm.record import (Recorder, load_recording, manifest_for, recording_dir,
                                    recording_path, save_recording, structure_depths,
                                    structure_key)

TORCH_STEPS = 2      # the steps of a script's torch operations a recording holds


class StepRecorder:
    def __init__(self, rt, key: str, total: int):
        self.rt, self.key, self.total = rt, key, total
        self.torch = rt.torch_groups
        self._groups: Recorder | None = None     # step 0's, once committed
        self._loss = None
        self._tapes: list[dict] = []
        self.saved = False

    def begin(self, step: int) -> Recorder | None:
        """Before step ``step``'s body: returns the Recorder to wrap it with (step 0)."""
        if self.saved:
            return None
        if self.torch is not None:
            if step == 0:
                self._tapes = []
                self.torch.start_recording(int(self.rt.config.standby.record_max_mb * 2**20))
            elif step < TORCH_STEPS:
                self.torch.restart_segment()   # a redo drops its first attempt's operations
        return Recorder(self.rt.comm_groups).__enter__() if step == 0 else None

    def committed(self, step: int, recorder: Recorder | None, loss) -> None:
        if self.saved:
            return
        if recorder is not None:
            self._groups, self._loss = recorder, loss
        last = min(TORCH_STEPS, self.total) - 1 if self.torch is not None else 0
        if self.torch is not None and step <= last:
            self._tapes.append(self.torch.take_recording(keep_going=step < last))
        if step == last and self._groups is not None:
            self._save()

    def _save(self) -> None:
        rt, ctx, cfg = self.rt, self.rt.ctx, self.rt.config
        t0 = time.perf_counter()
        rec = self._groups.recording(manifest_for(cfg, self.key, rt.role))
        if self.torch is not None:
            rec.torch_ops = self._tapes
            rec.torch_inits = self.torch.recorded_inits()
        rec.manifest.update(record_step=0, bytes=rec.nbytes, loss=self._loss)
        path = recording_path(recording_dir(cfg, rt.run_dir), self.key)
        save_s = save_recording(rec, path)
        ctx.events.emit("recorded", structure=self.key, path=path, bytes=rec.nbytes,
                        ops=sum(len(v) for v in rec.ops.values()),
                        torch_ops=sum(len(v) for tape in self._tapes for v in tape.values()),
                        record_s=round(time.perf_counter() - t0, 4), save_s=round(save_s, 4))
        self.saved = True


def stage_initialisations(rt):
    """For a joiner's ``TorchGroups.init_source``: the recording of its stage structure, as
    (segments, initialisations); raises ``RecordingInvalid`` naming what is missing."""
    cfg = rt.config
    key = structure_key(cfg.layout, structure_depths(cfg), rt.role.pp)
    path = recording_path(recording_dir(cfg, rt.run_dir), key)
    rec = load_recording(path, manifest_for(cfg, key, rt.role))
    return rec.torch_ops, rec.torch_inits
