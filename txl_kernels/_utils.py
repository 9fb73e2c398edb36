"""Small helpers shared by every layer of the package (no triton import here).

One place for: describing a tensor in error messages, whether Triton runs interpreted, and the
dtypes / head dims the fused kernels support.
"""
from __future__ import annotations

import os

import torch

__all__ = ["describe", "interpreting", "FUSED_DTYPES", "REF_DTYPES", "FUSED_MIN_HEADDIM",
           "FUSED_MAX_HEADDIM"]

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REF_DTYPES = FUSED_DTYPES + (torch.float64,)
FUSED_MIN_HEADDIM, FUSED_MAX_HEADDIM = 16, 256


def describe(t) -> str:
    """``shape [..], dtype .., device .., strides (..)`` for a tensor, the type name otherwise."""
    if not isinstance(t, torch.Tensor):
        return f"{type(t).__name__} {t!r:.60}"
    return (f"shape {list(t.shape)}, dtype {t.dtype}, device {t.device}, "
            f"strides {tuple(t.stride())}")


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton interpreter (read at each call)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false",
                                                                            "off", "no")
