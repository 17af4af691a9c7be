"""Suite-wide settings.

Property tests draw the same examples on every run (``derandomize``), so a CI run
cannot fail by the luck of the draw; ``HYPOTHESIS_PROFILE=explore`` draws fresh
random examples (more of them) to hunt for new failures locally."""
import os

from hypothesis import settings

settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def pytest_runtest_logreport(report):
    """With ``TRAINMOVER_TEST_TIMES=FILE``, each test's outcome and seconds (set-up, call and
    tear-down summed per phase) are appended to FILE as they finish: a run cut short still
    says where the suite spends its time (``make test`` budgets, the ``slow`` marks)."""
    path = os.environ.get("TRAINMOVER_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")
