"""The q5 kernels' Python entry (tests, benchmarks): `q5_matmul` runs kernels/c/ck_q5.c's
tiles, the ones the pipeline step runs for q5 matrices (format/q5.py is their reference)."""
from __future__ import annotations

import numpy as np

from ..format.q5 import Q5_BLOCK_BYTES, Q5Tensor
from ..format.quant import check_group, padded_cols
from . import ffi, lib


def q5_matmul(w: Q5Tensor, x: np.ndarray, act: str = "int8") -> np.ndarray:
    """x f32 [N, C] (or [C]) @ W^T -> f32 [N, R] (or [R]) on one thread. act="int8": x
    quantized per group of W, exact integer group dots (format.q5.matvec_q5_q8_ref);
    "float": W dequantized value by value (the parity path)."""
    if not isinstance(w, Q5Tensor):
        raise ValueError(f"w: expected a Q5Tensor, got {type(w).__name__}")
    if act not in ("int8", "float"):
        raise ValueError(f"act must be 'int8' or 'float', got {act!r}")
    check_group(w.group, "w")
    cp = padded_cols(w.cols, w.group)
    ng = cp // w.group
    parts = {"data": (w.data, np.uint8, (w.rows, cp // 64 * Q5_BLOCK_BYTES)),
             "scales": (w.scales, np.float32, (w.rows, ng)),
             "zeros": (w.zeros, np.uint8, (w.rows, ng))}
    for name, (a, dt, shape) in parts.items():
        if not isinstance(a, np.ndarray) or a.dtype != dt or a.shape != shape \
                or not a.flags.c_contiguous:
            raise ValueError(f"w.{name}: expected a C-contiguous {np.dtype(dt)} array of shape "
                             f"{shape}, got {getattr(a, 'dtype', type(a).__name__)} "
                             f"{getattr(a, 'shape', '')}")
    x2 = np.ascontiguousarray(np.atleast_2d(np.asarray(x, np.float32)))
    if x2.ndim != 2 or x2.shape[1] != w.cols:
        raise ValueError(f"x: expected [N, {w.cols}] or [{w.cols}], got {np.shape(x)}")
    out = np.empty((x2.shape[0], w.rows), np.float32)
    m = ffi.new("ck_mat *", {"kind": lib.CK_W_Q5, "data": ffi.from_buffer(w.data),
                             "scales": ffi.cast("float *", ffi.from_buffer(w.scales)),
                             "zeros": ffi.cast("uint8_t *", ffi.from_buffer(w.zeros)),
                             "rows": w.rows, "cols": w.cols, "group": w.group})
    if x2.shape[0] and w.rows:
        rc = lib.ck_q5_matmul(m, ffi.cast("float *", ffi.from_buffer(x2)), x2.shape[0],
                              ffi.cast("float *", ffi.from_buffer(out)), int(act == "int8"))
        if rc:
            raise MemoryError("ck_q5_matmul: could not allocate its activation buffers")
    return out if np.ndim(x) == 2 else out[0]
