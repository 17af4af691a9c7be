"""Python API: start a job, act on it while it runs, wait for its summary.

    job = Job(cfg, "runs/x").start()
    result = job.migrate(["w3"])          # blocks until the migration is done or refused
    summary = job.wait()
"""
from __future__ import annotations

import threading

from trainmover.core.config import JobConfig
from trainmover.control.coordinator import Coordinator
from trainmover.core.faults import Inject


class Job:
    def __init__(self, cfg: JobConfig, run_dir: str, quiet: bool = True,
                 injects: list[Inject] | None = None, timeout_s: float | None = None):
        self.coordinator = Coordinator(cfg.validate(), run_dir, quiet, injects, timeout_s)
        self._thread: threading.Thread | None = None
        self._summary: dict | None = None
        self._error: BaseException | None = None
        self.dashboard = None        # view.server.Dashboard when cfg.dashboard.port is set

    def start(self) -> "Job":
        def target():
            try:
                self._summary = self.coordinator.run()
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                self._error = exc

        dashboard = self.coordinator.cfg.dashboard
        if dashboard.port is not None:
            from trainmover.view.launch import check_dashboard
            check_dashboard(dashboard)
        self._thread = threading.Thread(target=target, name="coordinator", daemon=True)
        self._thread.start()
        self.coordinator.started.wait()
        if dashboard.port is not None and self._error is None:
            from trainmover.view.server import start_dashboard
            self.dashboard = start_dashboard(self.coordinator.run_dir, dashboard)
        return self

    def migrate(self, workers: list[str], to: list[str] | None = None,
                timeout_s: float | None = 300) -> dict:
        """Hand the roles of ``workers`` to standbys (``to`` names them, one-to-one)."""
        future = self.coordinator.request_migration(workers, to)
        return future.result(timeout=timeout_s)

    def stop(self, reason: str = "api") -> None:
        """Stop gracefully: every worker checkpoints a few steps ahead and exits; ``wait()``
        returns a summary with ``stopped`` and ``resume_step``; ``Job.resume(run_dir)``
        continues it."""
        self.coordinator.request_stop(reason)

    @classmethod
    def resume(cls, run_dir: str, quiet: bool = True, timeout_s: float | None = None) -> "Job":
        """A job for a stopped run dir, continuing from its newest intact checkpoint
        (``start()`` it)."""
        from trainmover.control.coordinator import resumable

        cfg, step = resumable(run_dir)
        job = cls.__new__(cls)
        job.coordinator = Coordinator(cfg, run_dir, quiet, None, timeout_s, resume_from=step)
        job._thread, job._summary, job._error, job.dashboard = None, None, None, None
        return job

    def running(self) -> bool:
        """Started and not ended (finished, stopped or failed)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> dict:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"job still running after {timeout_s} s")
        if self.dashboard is not None:
            self.dashboard.stop()
        if self._error is not None:
            raise self._error
        return self._summary
