"""The run directory is trusted by every process of a job: ``job.json`` names the command the
agents run, ``secret`` signs the control plane. So another local user must neither plant it
nor swap what is in it. The rules, checked before anything is launched or read:

- **Where it lives**: every existing folder above the run dir is owned by root or by this
  user, and writable by nobody else unless it has the sticky bit (``/tmp``): whoever can
  rename entries in a folder above could swap the run dir for their own.
- **The run dir itself**: a new job's is created by ``mkdir`` (so it is this user's, mode
  0700). One that already exists (made by the user beforehand, or a job to resume) must be a
  directory, not a symlink, owned by this user and writable by nobody else; a new job's is
  then made 0700. Anything else is refused, naming the path and what is wrong.
- **Its files** are opened with ``O_NOFOLLOW`` (a symlink planted in place of one is refused,
  not followed), and the files that say what runs (``job.json``, ``identity.json``,
  ``control.json``) carry an HMAC under the job's secret (``<name>.mac`` beside each),
  checked by every reader before it uses them.

On a filesystem shared by several hosts the same holds on each: the run dir and the folders
above it belong to the job's user (same uid everywhere) and nobody else can write them.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import time

MAC_SUFFIX = ".mac"
# A sealed file read while the controller rewrites it (identity.json gains the data's digest
# once a worker declares it, while standbys start): how often, and how far apart, a MAC
# mismatch is read again before it is refused.
SEALED_READ_ATTEMPTS = 10
SEALED_READ_RETRY_S = 0.02


class UnsafeRunDir(ValueError):
    """A run dir, a folder above it, or a file in it that another user could have planted or
    could swap, or a job file whose MAC does not check."""


def _me() -> int:
    return os.geteuid()


def check_ancestors(path: str) -> None:
    """Every existing folder above ``path`` is root's or ours, and nobody else can rename
    entries in it (not group/other-writable, or sticky)."""
    parent = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            st = None
        if st is not None:
            if st.st_uid not in (0, _me()):
                raise UnsafeRunDir(f"run dir {path!r}: the folder {parent!r} above it belongs "
                                   f"to another user (uid {st.st_uid}), who could replace it")
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
                raise UnsafeRunDir(f"run dir {path!r}: the folder {parent!r} above it is "
                                   f"writable by other users (mode {st.st_mode & 0o7777:o}, no "
                                   f"sticky bit), who could replace it")
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def check_dir(path: str) -> None:
    """An existing run dir that only this user controls (see the module doc)."""
    check_ancestors(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafeRunDir(f"run dir {path!r} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeRunDir(f"run dir {path!r} is a symlink (to {os.readlink(path)!r}): give "
                           f"the real path")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRunDir(f"run dir {path!r} is a file, not a directory")
    if st.st_uid != _me():
        raise UnsafeRunDir(f"run dir {path!r} belongs to another user (uid {st.st_uid}), "
                           f"who could have planted its contents: use a new path")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeRunDir(f"run dir {path!r} is writable by other users (mode "
                           f"{st.st_mode & 0o7777:o}): make it 0700 or use a new path")


def create(path: str) -> None:
    """The run dir of a new job: made here (``mkdir``, 0700), or an empty-of-jobs folder this
    user already made; folders above it that are missing are made 0700 too."""
    path = os.path.abspath(path)
    check_ancestors(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
        check_ancestors(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass                     # made before (by the user, or by someone else: checked now)
    check_dir(path)
    os.chmod(path, 0o700)


def open_file(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that refuses to follow a symlink in place of the file."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafeRunDir(f"{path!r} is a symlink (to {os.readlink(path)!r}): refused") \
                from exc
        raise


def read_bytes(path: str) -> bytes:
    """A regular file of this user's, not followed through a symlink."""
    fd = open_file(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != _me():
            raise UnsafeRunDir(f"{path!r} is not a regular file of this user's (uid "
                               f"{st.st_uid})")
        return f.read()


def _file_mac(secret: bytes, name: str, data: bytes) -> str:
    return hmac.new(secret, b"file:" + name.encode() + b"\0" + data,
                    hashlib.sha256).hexdigest()


def write_atomic(path: str, data: bytes) -> None:
    """Replace the file at ``path`` with ``data``: written to a temporary file beside it
    (opened without following a symlink), then renamed over it, so a reader finds the old
    content or the new, never part of one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_sealed(run_dir: str, name: str, data: bytes, secret: bytes) -> None:
    """Write ``name`` in the run dir and its MAC beside it, each by write-then-rename, the MAC
    first: a reader that finds the file (readers wait for it to appear) finds its MAC."""
    for target, content in ((name + MAC_SUFFIX, _file_mac(secret, name, data).encode()),
                            (name, data)):
        write_atomic(os.path.join(run_dir, target), content)


def read_sealed(run_dir: str, name: str, secret: bytes) -> bytes:
    """The content of ``name`` in the run dir, once its MAC checks under the job's secret.

    A file and its MAC are replaced one after the other (``write_sealed``), so a reader
    between the two renames sees a new MAC beside the old content: a mismatch is read again
    a few times (``SEALED_READ_ATTEMPTS``, a rewrite takes microseconds) before it is taken
    as tampering. Only a pair that checks is ever used."""
    path = os.path.join(run_dir, name)

    def read_mac() -> str:
        try:
            return read_bytes(path + MAC_SUFFIX).decode().strip()
        except FileNotFoundError:
            read_bytes(path)         # the file itself missing: FileNotFoundError, as such
            raise UnsafeRunDir(f"{path!r} has no {MAC_SUFFIX} beside it: it was not written "
                               f"by this job's controller") from None

    for _ in range(SEALED_READ_ATTEMPTS):
        # the MAC before and after the content: the content is the old one (the MAC read
        # before may be its) or the new one (the MAC read after is, unless rewritten again)
        before = read_mac()
        data = read_bytes(path)
        expected = _file_mac(secret, name, data)
        if hmac.compare_digest(before, expected) or hmac.compare_digest(read_mac(), expected):
            return data
        time.sleep(SEALED_READ_RETRY_S)
    raise UnsafeRunDir(f"{path!r} does not match its MAC under the job's secret: it was "
                       f"altered or replaced; nothing it names is run")


def read_sealed_json(run_dir: str, name: str, secret: bytes):
    return json.loads(read_sealed(run_dir, name, secret))
