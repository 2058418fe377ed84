"""Opening the files a user hands us -- configs, model files, tokenizers, plugin modules,
checkpoints -- as regular files only.

A FIFO in place of config.json or model.bin would block open() forever (it waits for a
writer; inside the Rust tokenizers library even Ctrl-C is not seen), a device can be read
without end, and a socket or a directory fails later with a confusing message. So every
such file is opened here: O_NONBLOCK makes open() of a FIFO return at once, fstat() on
the descriptor (not on the name, which may be swapped in between) refuses anything that
is not a regular file with one line naming the file and what it is, and only then is the
descriptor put back into blocking mode.

Symlinks are followed, as they always were for these files (a model folder of links into
the Hugging Face cache is normal); what a message says about a file's content is kept to
fixed descriptions (docs/ROBUSTNESS.md, "Files").
Hot-plugged expert .so files have stricter rules of their own (hotplug/staging.py: no
symlinks, owner and mode checks).
"""
from __future__ import annotations

import os
import stat
from typing import Callable, Union

from .errors import ModelFormatError

PathLike = Union[str, "os.PathLike[str]"]
ErrorType = Callable[[str], Exception]     # an error class, or any message -> exception

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def kind_of(mode: int) -> str:
    """What a file of this st_mode is, in words ("a FIFO (named pipe)", "a directory")."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((what for test, what in _KINDS if test(mode)), "a special file")


def check_regular(path: PathLike, st: os.stat_result, error: ErrorType = ModelFormatError) -> None:
    """Raise `error` (one line naming the file and what it is) unless `st` is a regular
    file's."""
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: is {kind_of(st.st_mode)}, expected a regular file")


def open_regular(path: PathLike, error: ErrorType = ModelFormatError, flags: int = 0) -> int:
    """A blocking read-only descriptor of the regular file `path` (close it yourself);
    anything else raises `error` at once, without blocking. `flags` are added to
    O_RDONLY (e.g. O_DIRECT)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | flags)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except OSError as e:
        try:                    # a socket cannot be opened at all (ENXIO): say what it is
            check_regular(path, os.stat(path), error)
        except OSError:
            pass
        raise error(f"{path}: cannot open: {e.strerror}") from None
    try:
        check_regular(path, os.fstat(fd), error)
        os.set_blocking(fd, True)       # no effect on a regular file's reads; cleared anyway
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: PathLike, error: ErrorType = ModelFormatError) -> bytes:
    """The whole content of the regular file `path`."""
    fd = open_regular(path, error)
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read()
    except OSError as e:
        raise error(f"{path}: read error: {e.strerror}") from None


def read_text(path: PathLike, error: ErrorType = ModelFormatError) -> str:
    """The content of the regular file `path` as UTF-8 text. A decoding error names the
    offset only, never the bytes found there (they may be another file's, via a symlink)."""
    data = read_bytes(path, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: cannot read it as UTF-8 text (invalid byte at offset "
                    f"{e.start})") from None
