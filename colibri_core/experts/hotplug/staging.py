"""Security checks on the watched folder and its files, and the private staging copy.

Rules (each refusal is an ExpertSecurityError naming the path and the rule):
- the watched folder and each expert file: not a symlink, not writable by group or others,
  owned by the engine's user or by root;
- each expert file: a regular file;
- what is loaded is never the file in the watched folder but a copy in a private staging
  folder (mode 0700, owned by the engine's user), named by the sha256 of its bytes,
  written once (temp name + fsync + rename) and never rewritten: dlopen() caches libraries
  by path and inode, so a path must always mean the same bytes. The sha256 checked against
  the allowlist is the one of that copy, computed while copying.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass

from .errors import ExpertSecurityError, HotplugStateError

COPY_CHUNK = 1 << 20


class FileChanged(Exception):
    """The source changed while it was being copied: check it again once it settles."""


@dataclass(frozen=True)
class FileSig:
    """What 'the file did not change' means: same inode, size, times, mode and owner."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    mode: int
    uid: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileSig":
        return cls(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode,
                   st.st_uid)


def trusted_uids() -> set[int]:
    return {os.geteuid(), 0}


def check_owner_and_mode(path: str, st: os.stat_result, what: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise ExpertSecurityError(f"{path}: {what} is a symlink, expected a real {what}"
                                  " (symlinks are refused)", reason="symlink", path=path)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "group and others" if st.st_mode & stat.S_IWGRP and st.st_mode & stat.S_IWOTH \
            else "group" if st.st_mode & stat.S_IWGRP else "others"
        raise ExpertSecurityError(f"{path}: {what} is writable by {who} (mode"
                                  f" {stat.S_IMODE(st.st_mode):04o}), expected no group/other"
                                  " write permission (chmod go-w)", reason="writable",
                                  path=path)
    if st.st_uid not in trusted_uids():
        raise ExpertSecurityError(f"{path}: {what} is owned by uid {st.st_uid}, expected the"
                                  f" engine's user (uid {os.geteuid()}) or root",
                                  reason="owner", path=path)


def check_folder(path: str) -> None:
    """Refuse a watched folder that is a symlink, group/world-writable or foreign-owned."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise ExpertSecurityError(f"{path}: cannot stat the experts folder: {e.strerror}",
                                  reason="folder", path=path) from None
    check_owner_and_mode(path, st, "folder")
    if not stat.S_ISDIR(st.st_mode):
        raise ExpertSecurityError(f"{path}: not a folder, expected the experts folder",
                                  reason="folder", path=path)


def check_file(path: str, st: os.stat_result) -> None:
    check_owner_and_mode(path, st, "file")
    if not stat.S_ISREG(st.st_mode):
        raise ExpertSecurityError(f"{path}: not a regular file, expected an ELF .so",
                                  reason="not-regular", path=path)


def ensure_private_dir(path: str) -> None:
    """Create `path` (and parents) with mode 0700; refuse one that others can reach."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:        # e.g. an experts folder of mode 000
        raise HotplugStateError(f"{path}: cannot create the private folder: {e.strerror}; "
                                f"expected a folder the engine can write", path=path) from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise HotplugStateError(f"{path}: staging folder is a symlink or not a folder,"
                                " expected a private folder", path=path)
    if st.st_uid != os.geteuid():
        raise HotplugStateError(f"{path}: staging folder is owned by uid {st.st_uid},"
                                f" expected the engine's user (uid {os.geteuid()})", path=path)
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def open_source(src: str, expect: FileSig | None = None) -> int:
    """Open an expert file for reading and check it on the descriptor; return the fd.

    O_NOFOLLOW | O_NONBLOCK, then fstat: a symlink swapped in is not followed (FileChanged:
    checked again), and a FIFO or device never blocks the caller (it is refused as not a
    regular file). Then owner, mode, regular file, and `expect` when given (FileChanged).
    """
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:             # became a symlink since its lstat
            raise FileChanged(src) from None
        raise
    try:
        st = os.fstat(fd)
        check_file(src, st)
        if expect is not None and FileSig.of(st) != expect:
            raise FileChanged(src)
    except BaseException:
        os.close(fd)
        raise
    return fd


def stage_file(src: str, staging_dir: str, expect: FileSig | None = None, *,
               fd: int | None = None) -> tuple[str, str]:
    """Copy `src` into `staging_dir` as `<sha256>.so`; return (sha256, staged path).

    The source is opened with open_source (not following symlinks, checked on the open
    descriptor), or `fd` is such a descriptor, already open (it is read from offset 0 and
    left open); a source that changes during the copy raises FileChanged. An existing
    staged file of the same hash is reused as is.
    """
    own = fd is None
    if own:
        fd = open_source(src, expect)
    try:
        st = os.fstat(fd)
        check_file(src, st)
        if expect is not None and FileSig.of(st) != expect:
            raise FileChanged(src)
        os.lseek(fd, 0, os.SEEK_SET)
        h = hashlib.sha256()
        tmp = os.path.join(staging_dir, f".stage-{os.getpid()}-{st.st_ino}.tmp")
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                      0o600)
        try:
            while chunk := os.read(fd, COPY_CHUNK):
                h.update(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
            os.fsync(out)
        finally:
            os.close(out)
        after = os.fstat(fd)
        if FileSig.of(after) != FileSig.of(st):
            os.unlink(tmp)
            raise FileChanged(src)
    finally:
        if own:
            os.close(fd)
    sha = h.hexdigest()
    staged = os.path.join(staging_dir, f"{sha}.so")
    if os.path.exists(staged):
        os.unlink(tmp)
    else:
        os.chmod(tmp, 0o400)
        os.replace(tmp, staged)
    return sha, staged
