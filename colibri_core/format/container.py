"""The container format's fixed parts (docs/FORMAT.md): the magic, the versions, the
alignment, the dtypes, the section table's caps, the names of expert files, 2 MB pages and
the page cache, the sha256 of a file. The writer is writer.py, the reader modelfile.py.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
from pathlib import Path
from typing import Iterable, Union

import numpy as np

from .filemap import FileMapping
from ..memstat import resident_bytes
from ..files import open_regular
from .mxfp4 import MXFP4Tensor
from .q5 import Q5Tensor
from .quant import Q4Tensor, Q6Tensor, Q8Tensor

# 2 MB pages for the weights. Decode streams ~100 MB of weights a token, with a page
# walk per 4 KB page. With madvise(2) HUGEPAGE on a file's mapping (residency.py's
# preload), a page that is not cached yet is read in a 2 MB folio (file systems with
# large folios: ext4 from Linux 6.16, xfs) and the mapping maps it whole. A 2 MB range
# that already holds a small cached page cannot become one, so: the header's pages read
# with pread are dropped again (unless the file is cached past them already: then the drop
# gains nothing and costs a read at the next load), and write_container leaves what it
# wrote out of the page cache.
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
HUGE_PAGE = 2 << 20


def _drop_cached(fd: int, length: int) -> None:
    """Drop the file's pages in its first `length` bytes (0: all) from the page cache:
    clean, unmapped ones only (the kernel keeps what another mapping uses; a partial page
    stays). Best effort."""
    try:
        os.posix_fadvise(fd, 0, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass

def _cached_after(mm: FileMapping, start: int) -> bool:
    """Whether the file's first 2 MB hold cached pages past its header's: the file is warm
    (often one 2 MB folio, which dropping the header would throw away), so dropping the
    header's pages cannot make a 2 MB folio and would only cost a read at the next load
    (6,144 of them for Qwen3-30B-A3B's experts). Two pages are asked, the first after the
    header and the last of the 2 MB (a warm file holds both: its first tensor starts right
    after the header and a 2 MB folio holds them all): mincore over the whole range looks
    up 511 pages a file (opening Qwen3-30B-A3B's 6,144 warm files: 0.41 s CPU, 0.29 s
    with two)."""
    end = min(HUGE_PAGE, mm.size) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return False
    last = end - mmap.PAGESIZE
    return (resident_bytes(mm.address + start, mmap.PAGESIZE) > 0
            or (last > start and resident_bytes(mm.address + last, mmap.PAGESIZE) > 0))


MAGIC = b"COLIBRI\x00"
FORMAT_MAJOR = 1
FORMAT_MINOR = 3        # the newest minor version this Colibri reads and writes (1.1: q6,
                        # 1.2: mxfp4, 1.3: q5)
# The minor version a file is written with: the lowest that describes its sections, so a
# file without q6 sections stays 1.0 (byte for byte what an older Colibri wrote and reads).
DTYPE_MINOR = {"q6": 1, "mxfp4": 2, "q5": 3}
ALIGN = 4096
_PREFIX = struct.Struct("<8sHHI")  # magic, major, minor, table_len
# The largest section table a reader parses (docs/FORMAT.md): a parsed table costs about
# 18 times its size in memory for the file's life. The biggest supported model's model.bin
# (DeepSeek-V3: 61 layers, up to 20 sections each) needs an estimated 0.25 MiB; an expert
# file holds at most six sections (under 1 KiB), and a model has thousands of them.
MAX_TABLE_BYTES = 1 << 20
MAX_EXPERT_TABLE_BYTES = 64 << 10

PLAIN_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
QUANT_DTYPES = ("q4", "q5", "q6", "q8", "mxfp4")
ALL_DTYPES = set(PLAIN_DTYPES) | set(QUANT_DTYPES)
_DTYPE_NAMES = {d: d for d in ALL_DTYPES}   # one shared string per dtype, not one per section

Tensor = Union[np.ndarray, Q4Tensor, Q5Tensor, Q6Tensor, Q8Tensor, MXFP4Tensor]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def expert_name(layer: int, idx: int) -> str:
    """The name of expert `idx` of global layer `layer`, everywhere: files, traces, hooks."""
    return f"expert_{layer}_{idx}"


def expert_file_name(layer: int, idx: int) -> str:
    return expert_name(layer, idx) + ".bin"


def minor_for(dtypes: Iterable[str]) -> int:
    """The format minor version a file holding sections of these dtypes is written with."""
    return max((DTYPE_MINOR.get(d, 0) for d in dtypes), default=0)


def sha256_file(path: Union[str, Path], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes (model checksums, hot-plug allowlists)."""
    h = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()
