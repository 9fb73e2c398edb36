"""Pieces shared by the forward and backward kernels: interpreter detection, operand rounding,
fp32 product precision, stride normalisation and the autotuning switch."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._utils import interpreting

# TRITON_INTERPRET is read once, as triton itself does when it decorates the kernels.
INTERPRET = interpreting()


@triton.jit
def round_bf16(x):
    """fp32 -> fp32 holding the nearest bfloat16 (ties to even). Used only under the
    interpreter, whose fp32 -> bf16 conversion truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input_precision: fp32 inputs follow torch.get_float32_matmul_precision()
    ("highest" -> exact IEEE fp32 products, otherwise TF32); fp16 / bf16 products are exact."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels need stride(-1) == 1 only; anything else is copied (nothing else is)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def autotune_enabled() -> bool:
    """GPU block sizes are autotuned unless TXL_KERNELS_AUTOTUNE=0 (read at each call)."""
    return os.environ.get("TXL_KERNELS_AUTOTUNE", "1") != "0"


@triton.jit
def apply_mask_band(BAND, WL, WR):
    """Read ``[is_band, left, right]`` (``functional.mask_to_band``) from device memory.

    ``WL`` / ``WR`` are the call's window (-1 = unbounded side); the band's ``left`` /
    ``right`` are plain bounds (``-right <= d <= left``, either may be negative). Returns the
    window narrowed by the band and whether the band replaces the dense mask. It does only
    when both narrowed bounds are >= 0, i.e. representable in the window convention the
    kernels share (a negative bound would read as "unbounded"); any other band (one that
    leaves out the diagonal side it bounds, or allows nothing) keeps the window as it was and
    returns False, so the kernels read the dense mask, which holds the same pairs."""
    on = tl.load(BAND) != 0
    bl = tl.load(BAND + 1)
    br = tl.load(BAND + 2)
    nl = tl.where(WL < 0, bl, tl.minimum(WL, bl))
    nr = tl.where(WR < 0, br, tl.minimum(WR, br))
    use = on & (nl >= 0) & (nr >= 0)
    return tl.where(use, nl, WL), tl.where(use, nr, WR), use
