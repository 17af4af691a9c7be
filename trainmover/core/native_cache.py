"""Where the forwarding backend (``comm/native``) is built, told without importing torch.

The controller asks ``looks_built`` before a launch: answering it by importing torch in a
child (what a build needs) would add seconds before the job's first process starts. The
build itself and its safety checks are ``comm/native``'s.
"""
from __future__ import annotations

import hashlib
import os
from importlib import metadata

SOURCE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "comm", "native")
# the files the module is built from: translation units, then the headers they share
UNITS = ("forwarding.cpp", "world.cpp")
FILES = UNITS + ("world.h",)
NAME = "trainmover_forwarding"


def source_digest() -> str:
    digest = hashlib.sha256()
    for name in FILES:
        with open(os.path.join(SOURCE_DIR, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> str:
    explicit = os.environ.get("TRAINMOVER_EXT_DIR")
    if explicit:
        return os.path.abspath(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "trainmover", "ext")


def build_dir(torch_version: str) -> str:
    """One folder per (torch version, source digest)."""
    return os.path.join(cache_root(), f"{NAME}-{torch_version.replace('+', '_')}-"
                                      f"{source_digest()}")


def looks_built() -> bool:
    """Whether a build of these sources for the installed torch is in the cache. Only a
    shortcut: every process that loads the module checks it and, if need be, builds it
    under the build lock (``comm.native.load``)."""
    try:
        path = build_dir(metadata.version("torch"))
    except metadata.PackageNotFoundError:
        return False
    if not os.path.isfile(os.path.join(path, NAME + ".so")):
        return False
    for name in FILES:
        try:
            with open(os.path.join(path, name), "rb") as built, \
                    open(os.path.join(SOURCE_DIR, name), "rb") as source:
                if built.read() != source.read():
                    return False
        except OSError:
            return False
    return True
