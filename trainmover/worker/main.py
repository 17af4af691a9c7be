"""A worker process: hosts one run (or several) of the job's training script.

Started by the job's agent as ``python -m trainmover.worker --run-dir DIR --name w3 --store
HOST:PORT [--standby]``. The script is the job's ``process.command`` (``SCRIPT ARGS`` or
``-m MODULE ARGS``; the built-in GPT trainer by default); it runs in this interpreter, and
its ``trainmover.init()`` finds this process's context.

- An active worker runs the script once. Its role comes from the membership table in the
  store, not from its name.
- A standby runs the script once per stage structure in the sandbox (the warm-up: every
  import, allocation and compilation happens now, against recorded communication), then
  waits for an ``assign`` command and runs it for real in the role it was given. Imports,
  compiled code and data stay warm in this process between runs.
- A leaver's run ends at its switch boundary (``Departed``), a shadow run after its
  iterations (``ShadowDone``).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
import traceback

T_START = time.perf_counter()

from trainmover.comm.groups import StoreAddress  # noqa: E402  (import time is measured)
from trainmover.comm.record import (RecordingInvalid, SandboxMismatch,  # noqa: E402
                                    manifest_for, recording_dir, recording_path,
                                    representative_roles, structure_depths)
from trainmover.core import identity  # noqa: E402
from trainmover.core.auth import load_secret  # noqa: E402
from trainmover.core import protocol as P  # noqa: E402
from trainmover.worker import context as context_mod  # noqa: E402
from trainmover.worker.context import Join, Shadow, Start, WorkerContext  # noqa: E402
from trainmover.worker.loop import Departed  # noqa: E402
from trainmover.worker.runtime import (DataNotDeterministic, ShadowDone,  # noqa: E402
                                       ShadowInterrupted, UsageError)

EXIT_USAGE = P.EXIT_USAGE


class ScriptFailedEarly(Exception):
    """The training script failed before it called ``trainmover.init()`` (an import, its
    arguments, its model): a restart would run the same code into the same error."""


def run_script(ctx: WorkerContext) -> None:
    """One run of the training script in this interpreter, as ``python SCRIPT ARGS`` would
    run it: ``sys.argv`` as given, ``__main__``, and the script's folder (for ``-m``: the
    working folder) first on ``sys.path``, so the script imports its neighbours."""
    command = ctx.cfg.process.command
    ctx.runtime = None
    saved, saved_path = sys.argv, list(sys.path)
    try:
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(command)
            sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
            runpy.run_path(command[0], run_name="__main__")
    except (Exception, SystemExit) as exc:
        if ctx.runtime is not None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            raise
        traceback.print_exc()
        raise ScriptFailedEarly(f"the training script failed before trainmover.init(): "
                                f"{type(exc).__name__}: {exc}") from exc
    finally:
        sys.argv = saved
        sys.path[:] = saved_path
        if ctx.runtime is not None:
            ctx.runtime.close()


def run_active(ctx: WorkerContext, resume_step: int, generation: int) -> int:
    ctx.launch = Start(resume_step, generation)
    try:
        run_script(ctx)
    except Departed:
        return 0
    rt = ctx.runtime
    if rt is None or not rt.finished:
        print(f"trainmover: {ctx.name}: the training script returned before its rt.steps() "
              f"loop finished (did it call trainmover.init() and run every step?)",
              file=sys.stderr, flush=True)
        return EXIT_USAGE
    return 0


def run_standby(ctx: WorkerContext) -> int:
    ctx.set_standby_state("cold")
    ctx.events.emit("standby_registered", state="cold")
    ctx.fault("standby")
    if ctx.cfg.standby.warmup:
        warm_up(ctx)
    cmd = ctx.commands.next()
    if not isinstance(cmd, (P.AssignMigration, P.AssignRecovery)):
        raise RuntimeError(f"standby {ctx.name}: expected an assign command, got {cmd}")
    ctx.launch = Join(cmd)
    try:
        run_script(ctx)
    except Departed:
        return 0
    return 0 if ctx.runtime is not None and ctx.runtime.finished else EXIT_USAGE


def warm_up(ctx: WorkerContext) -> None:
    """General standby: shadow runs of every stage structure (first, last, then middle).
    Stops early when an assignment arrives; a missing, unreadable or stale recording leaves
    that structure cold, with a warning, and nothing else. Data that is not a function of
    the step is an error of the job's script: the standby refuses and exits."""
    cfg = ctx.cfg
    directory = recording_dir(cfg, ctx.run_dir)
    warmed: list[str] = []
    ctx.set_standby_state("warming")
    for key, role in representative_roles(cfg.layout, structure_depths(cfg)).items():
        t0 = time.perf_counter()
        ctx.shadow_times = []
        try:
            ctx.launch = Shadow(key, role, recording_path(directory, key),
                                manifest_for(cfg, key, role))
            run_script(ctx)
            raise UsageError("the training script returned from a shadow run without "
                             "running rt.steps()")
        except ShadowInterrupted:
            ctx.events.emit("warmup_interrupted", structure=key, warmed=warmed)
            break
        except ShadowDone:
            pass
        except (RecordingInvalid, SandboxMismatch) as exc:
            _stays_cold(ctx, key, str(exc))
            continue
        except (DataNotDeterministic, identity.IdentityMismatch) as exc:
            ctx.events.emit("standby_refused", structure=key, reason=str(exc), level="error")
            ctx.set_standby_state("refused", reason=str(exc)[:2000])
            raise
        except Exception as exc:  # noqa: BLE001 - only where the replay had lost its place
            if not ctx.replay_mismatch:
                raise
            # the script failed on local answers after its torch operations left the
            # recording: the replay's fault, not the script's
            _stays_cold(ctx, key, f"{ctx.replay_mismatch}; then {type(exc).__name__}: {exc}")
            continue
        warmed.append(key)
        ctx.set_standby_state("warming", warmed)
        ctx.events.emit("warmed", structure=key, role=role.name,
                        duration_s=round(time.perf_counter() - t0, 4),
                        recording_wait_s=round(ctx.shadow_wait_s, 4),
                        shadow_step_s=[round(t, 4) for t in ctx.shadow_times])
        if not ctx.commands.queue.empty():
            break
    ctx.set_standby_state("warm" if warmed else "cold", warmed)


def _stays_cold(ctx: WorkerContext, key: str, reason: str) -> None:
    ctx.events.emit("warmup_skipped", structure=key, reason=reason, level="warning")
    print(f"warning: {ctx.name} cannot warm {key} ({reason}); it stays cold for it",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None, t_start: float | None = None) -> int:
    """``t_start``: when this process started (``perf_counter``), for one forked by the
    agent's fork server (``agent/forkserver.py``); by default, this module's import."""
    p = argparse.ArgumentParser(prog="trainmover.worker")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--store", required=True, type=StoreAddress.parse)
    p.add_argument("--standby", action="store_true")
    p.add_argument("--resume-step", type=int, default=0)
    p.add_argument("--generation", type=int, default=0)
    p.add_argument("--epoch", type=int, default=0)
    args = p.parse_args(argv)
    ctx = WorkerContext(args.run_dir, args.name, args.store, args.standby, args.epoch,
                        T_START if t_start is None else t_start)
    context_mod.install(ctx)
    try:
        job = identity.read_identity(args.run_dir, load_secret(args.run_dir))
        identity.compare(job, identity.of_job(ctx.cfg.to_dict(), ctx.cfg.process.command),
                         ctx.name)
        if args.standby:
            return run_standby(ctx)
        return run_active(ctx, args.resume_step, args.generation)
    except identity.IdentityMismatch as exc:
        ctx.events.emit("identity_mismatch", error=str(exc), level="error")
        if args.standby:
            ctx.set_standby_state("refused", reason=str(exc)[:2000])
        print(f"trainmover: {ctx.name}: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except UsageError as exc:
        ctx.events.emit("usage_error", error=str(exc), level="error")
        print(f"trainmover: {ctx.name}: {exc}", file=sys.stderr, flush=True)
        traceback.print_exc()
        return EXIT_USAGE
    except ScriptFailedEarly as exc:
        # not a machine's failure: every replacement would fail the same way
        log = os.path.join(args.run_dir, "logs", f"{args.name}.log")
        ctx.events.emit("script_error", error=str(exc), log=log, level="error")
        print(f"trainmover: {ctx.name}: {exc} (full traceback: {log})", file=sys.stderr,
              flush=True)
        return EXIT_USAGE
