"""The random generators a step draws from, kept at each step's start so that a step redone
after a failure draws the same numbers as its first attempt (dropout masks, random crops,
sampled batches): a redo that continued from generators the aborted attempt had advanced
would train on other numbers than the uninterrupted run.

Kept: torch's CPU generator, every CUDA device's (when CUDA is in use), Python's ``random``
and NumPy's global generator (when the script imported NumPy). A generator the script made
itself (``torch.Generator()``) is the script's: seed it from the step (the examples do).
Cost: one copy of each state per step (torch's CPU state is 5 KB).
"""
from __future__ import annotations

import random
import sys

import torch


def snapshot() -> tuple:
    cuda = torch.cuda.get_rng_state_all() \
        if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    numpy = sys.modules.get("numpy")
    return (torch.get_rng_state(), cuda, random.getstate(),
            numpy.random.get_state() if numpy is not None else None)


def restore(saved: tuple) -> None:
    cpu, cuda, py, np_state = saved
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    if np_state is not None:
        sys.modules["numpy"].random.set_state(np_state)
