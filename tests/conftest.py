"""Suite-wide settings.

Property tests draw the same examples on every run (``derandomize``), so a CI run
cannot fail by the luck of the draw; ``HYPOTHESIS_PROFILE=explore`` draws fresh
random examples (more of them) to hunt for new failures locally."""
import os

from hypothesis import settings

settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))
