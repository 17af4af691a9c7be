"""The forwarding backend (``forwarding.cpp``), compiled once per torch build and machine.

Why compiled here and not shipped: a c10d ``Backend`` subclass links against the exact torch
it runs in (CPU or CUDA build, version), which is the user's. ``trainmover launch``/``run``
build it before any worker starts (``ensure_built``), so workers only load it; the build
takes about a minute on two cores, once.

Where it lives: a per-user cache folder (``$TRAINMOVER_EXT_DIR``, else
``$XDG_CACHE_HOME/trainmover/ext``, else ``~/.cache/trainmover/ext``), one subfolder per
(torch version, source digest). Loading a shared object runs its code, so the folder and
every folder above the cache root must belong to this user (or root) and not be writable
by others, and a symlinked folder is refused: a path another local user created first
(``/tmp/torch_extensions`` is torch's default) is never loaded from.
"""
from __future__ import annotations

import fcntl
import functools
import os
import stat

from trainmover.core.native_cache import FILES, NAME, SOURCE_DIR as HERE, UNITS, cache_root
from trainmover.core.native_cache import build_dir as _build_dir


class NativeUnavailable(RuntimeError):
    """The forwarding backend cannot be built here (no C++ compiler, unsafe cache folder)."""


def _private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) or accept it only if it is a real folder of this user that
    nobody else can write; refuse otherwise, naming the path and what is wrong."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise NativeUnavailable(f"cannot create the extension folder {path}: {exc}") from exc
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NativeUnavailable(f"extension folder {path} is not a plain folder (a symlink?); "
                                f"refusing to load code from it")
    if st.st_uid != os.getuid():
        raise NativeUnavailable(f"extension folder {path} belongs to uid {st.st_uid}, not "
                                f"this user ({os.getuid()}); refusing to load code from it")
    if st.st_mode & 0o022:
        os.chmod(path, st.st_mode & ~0o022 & 0o7777)


def _check_parents(path: str) -> None:
    """Every folder above ``path`` must not be writable by other users unless sticky (as
    /tmp is) and owned by this user or root: otherwise another user could swap the tree."""
    parent = os.path.dirname(path)
    while True:
        st = os.stat(parent)
        if st.st_uid not in (0, os.getuid()):
            raise NativeUnavailable(f"{parent} (above the extension folder) belongs to uid "
                                    f"{st.st_uid}; set TRAINMOVER_EXT_DIR to a private folder")
        if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            raise NativeUnavailable(f"{parent} (above the extension folder) is writable by "
                                    f"everyone; set TRAINMOVER_EXT_DIR to a private folder")
        nxt = os.path.dirname(parent)
        if nxt == parent:
            return
        parent = nxt


def build_dir() -> str:
    import torch

    return _build_dir(torch.__version__)


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module (built first if needed; concurrent builders wait on one lock)."""
    import torch.utils.cpp_extension as ext

    root = cache_root()
    _private_dir(root)
    _check_parents(root)
    path = build_dir()
    _private_dir(path)
    with open(os.path.join(path, "build.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # Build from a copy inside the folder: the folder is keyed by the source's digest,
            # so two checkouts of the same source share one build instead of rebuilding each
            # other's (ninja tracks the source by path).
            for name in FILES:
                source = os.path.join(path, name)
                with open(os.path.join(HERE, name), "rb") as f:
                    text = f.read()
                if not os.path.exists(source) or open(source, "rb").read() != text:
                    with open(source + ".tmp", "wb") as f:
                        f.write(text)
                    os.replace(source + ".tmp", source)
            # torch's own build baton: one left by a builder that was killed would make every
            # later load wait for ever; under this lock no other builder of ours is running
            baton = os.path.join(path, "lock")
            if os.path.exists(baton):
                os.remove(baton)
            return ext.load(NAME, [os.path.join(path, n) for n in UNITS], build_directory=path,
                            extra_cflags=["-O2"], verbose=False)
        except (OSError, RuntimeError, ImportError) as exc:
            raise NativeUnavailable(
                f"could not build trainmover's forwarding backend in {path} (needs a C++ "
                f"compiler and ninja; torch process groups for user code depend on it): "
                f"{exc}") from exc
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_built() -> None:
    """Build before workers start (the launcher calls it), so none of them compiles."""
    load()

