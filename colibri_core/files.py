"""Opening the files a user hands us -- configs, model files, tokenizers, plugin modules,
checkpoints -- as regular files only; and writing a file whole or not at all
(`atomic_write`, `write_atomic`).

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

Every file Colibri writes in place of another -- model files, the hot-plug state, the
fleet's state, uploaded experts, a replica's slots -- goes through `atomic_write`: a
temporary file in the same folder, dotted so that a watched folder ignores it, renamed over
the target only once it is complete, so a reader (or a crash) sees the old file or the new
one, never a part.
"""
from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from typing import BinaryIO, Callable, Iterator, Union

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


def read_json_lines(path: PathLike, bad_line: Callable[[int], Exception]) -> list:
    """The JSON values of a JSON-lines file, blank lines skipped; a line that is not JSON
    raises bad_line(its number, from 1). Opening errors (OSError) are the caller's."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    raise bad_line(n) from None
    return rows


@contextlib.contextmanager
def atomic_write(path: PathLike, mode: int = 0o644, durable: bool = True,
                 suffix: str = ".tmp") -> Iterator[BinaryIO]:
    """Write `path` whole or not at all: yields a binary file (read and write) on a
    temporary file in `path`'s folder, named `.<name>.<random><suffix>`. When the block ends
    without an error the file is flushed, fsync'ed (`durable`), given `mode` and renamed
    over `path`, then the folder is fsync'ed (`durable`: the rename survives a crash). When
    it raises, the temporary file is removed and `path` is left as it was."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=suffix, dir=folder)
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def write_atomic(path: PathLike, data: Union[bytes, str], mode: int = 0o644,
                 durable: bool = True, suffix: str = ".tmp") -> None:
    """`data` (str: as UTF-8) as the whole content of `path`, through `atomic_write`."""
    with atomic_write(path, mode, durable, suffix) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
