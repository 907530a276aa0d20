"""FFI calls of the cuDNN fused attention (csrc/ffi/attention.cc): forward and backward, CUDA
only. Optional operands are zero-length; the FP8 scales and amaxes are (rows, ATTN_SCALE_STRIDE)
float32 with the value in column 0 (each row 16-byte aligned for cuDNN)."""

from __future__ import annotations

import ctypes
import glob
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import _native, abi

CAUSAL, PADDING, RAGGED = abi.ATTN_CAUSAL, abi.ATTN_PADDING, abi.ATTN_RAGGED
DROPOUT, SINK, FP8, DETERMINISTIC = abi.ATTN_DROPOUT, abi.ATTN_SINK, abi.ATTN_FP8, abi.ATTN_DETERMINISTIC
SCALE_STRIDE = abi.ATTN_SCALE_STRIDE
FWD_SCALES, BWD_SCALES = abi.ATTN_FP8_FWD_SCALES, abi.ATTN_FP8_BWD_SCALES
FWD_AMAXES, BWD_AMAXES = abi.ATTN_FP8_FWD_AMAXES, abi.ATTN_FP8_BWD_AMAXES

_lock = threading.Lock()
_loaded: dict = {}


def _wheel_library(pattern: str) -> str | None:
    """The first file matching `pattern` under the nvidia wheels' folders (jax[cuda] installs them)."""
    try:
        import nvidia  # type: ignore
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        found = sorted(glob.glob(os.path.join(root, pattern)))
        if found:
            return found[0]
    return None


def cudnn_status() -> tuple[bool, str]:
    """(usable, reason): loads libcudnn into the CUDA library once (the nvidia-cudnn wheel's copy,
    else the loader's path, or $LOWBIT_CUDNN_LIBRARY) and says why not where it cannot."""
    with _lock:
        if _loaded:
            return _loaded["ok"], _loaded["reason"]
        lib = _native.cuda_library()
        if lib is None or not hasattr(lib, "lowbit_attention_load_cudnn"):
            ok, reason = False, "lowbit's CUDA library is not loaded or has no cuDNN attention"
        else:
            # The frontend dlopens libcudart by soname: name the wheel's copy when one is there.
            cudart = _wheel_library("*/lib/libcudart.so.1[0-9]")
            if cudart and "CUDNN_FRONTEND_CUDART_LIB_NAME" not in os.environ:
                os.environ["CUDNN_FRONTEND_CUDART_LIB_NAME"] = cudart
            path = _wheel_library("cudnn/lib/libcudnn.so.9") or _wheel_library("*/lib/libcudnn.so.9")
            err = ctypes.create_string_buffer(2048)
            fn = lib.lowbit_attention_load_cudnn
            fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
            rc = fn(path.encode() if path else None, err, len(err))
            ok, reason = rc == 0, err.value.decode(errors="replace")
        _loaded.update(ok=ok, reason=reason)
        return ok, reason


def cudnn_version() -> int:
    """The loaded cuDNN's version (e.g. 91900), 0 where none is usable."""
    if not cudnn_status()[0]:
        return 0
    fn = _native.cuda_library().lowbit_attention_cudnn_version
    fn.restype = ctypes.c_int64
    return int(fn())


def _optionals(bias, seqlens_q, seqlens_kv, ragged, seed, offset, sink, fp8_scales) -> tuple:
    """The optional operands both handlers take, in order; absent ones as (0,) stand-ins."""
    ints = (seqlens_q, seqlens_kv, ragged, seed, offset)
    return (
        _native.EMPTY_F32 if bias is None else bias,
        *(_native.EMPTY_U32 if x is None else x for x in ints),
        *(_native.EMPTY_F32 if x is None else x for x in (sink, fp8_scales)),
    )


def attention_fwd(
    q,
    k,
    v,
    bias,
    seqlens_q,
    seqlens_kv,
    ragged,
    seed,
    offset,
    sink,
    fp8_scales,
    *,
    flags: int,
    scale: float,
    dropout_rate: float,
    max_sq: int,
    max_skv: int,
    o_dtype,
    dv: int,
):
    """-> (o like q with head_dim dv and dtype o_dtype, stats (b, h, sq) f32, amax (2, 4) or (0,)).

    BSHD: q (b, sq, h, d); ragged: q (tq, h, d), b = len(seqlens_q), sq = max_sq."""
    b = seqlens_q.shape[0] if flags & RAGGED else q.shape[0]
    sq = max_sq if flags & RAGGED else q.shape[1]
    h = q.shape[-2]
    amax = (FWD_AMAXES, SCALE_STRIDE) if flags & FP8 else (0,)
    return _native.ffi_call(
        "attention_fwd",
        (
            jax.ShapeDtypeStruct(q.shape[:-1] + (dv,), o_dtype),
            jax.ShapeDtypeStruct((b, h, sq), jnp.float32),
            jax.ShapeDtypeStruct(amax, jnp.float32),
        ),
        q, k, v, *_optionals(bias, seqlens_q, seqlens_kv, ragged, seed, offset, sink, fp8_scales),
        **_attrs(flags, scale, dropout_rate, max_sq, max_skv),
    )  # fmt: skip


def attention_bwd(
    q,
    k,
    v,
    o,
    do,
    stats,
    bias,
    seqlens_q,
    seqlens_kv,
    ragged,
    seed,
    offset,
    sink,
    fp8_scales,
    *,
    flags: int,
    scale: float,
    dropout_rate: float,
    max_sq: int,
    max_skv: int,
    grad_dtype,
    want_dbias: bool,
    want_dsink: bool,
):
    """-> (dq, dk, dv in grad_dtype, dbias (bias's shape and dtype) or (0,), dsink (h,) f32 or
    (0,), amax (4, 4) f32 or (0,))."""
    h = q.shape[-2]
    amax = (BWD_AMAXES, SCALE_STRIDE) if flags & FP8 else (0,)
    dbias = jax.ShapeDtypeStruct(bias.shape, bias.dtype) if want_dbias else _native.NO_RESULT_F32
    return _native.ffi_call(
        "attention_bwd",
        (
            jax.ShapeDtypeStruct(q.shape, grad_dtype),
            jax.ShapeDtypeStruct(k.shape, grad_dtype),
            jax.ShapeDtypeStruct(v.shape, grad_dtype),
            dbias,
            jax.ShapeDtypeStruct((h,) if want_dsink else (0,), jnp.float32),
            jax.ShapeDtypeStruct(amax, jnp.float32),
        ),
        q, k, v, o, do, stats,
        *_optionals(bias, seqlens_q, seqlens_kv, ragged, seed, offset, sink, fp8_scales),
        **_attrs(flags, scale, dropout_rate, max_sq, max_skv),
    )  # fmt: skip


def _attrs(flags, scale, dropout_rate, max_sq, max_skv) -> dict:
    return dict(
        flags=np.int32(flags),
        scale=np.float32(scale),
        dropout_rate=np.float32(dropout_rate),
        max_sq=np.int64(max_sq),
        max_skv=np.int64(max_skv),
    )
