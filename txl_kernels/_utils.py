"""Small helpers shared by every layer of the package (no triton import here).

One place for: describing a tensor in error messages, whether Triton runs interpreted, and the
dtypes / head dims the fused kernels support.
"""
from __future__ import annotations

import os
import sys

import torch

__all__ = ["describe", "check_same", "interpreting", "interpret_requested", "no_interpreter_reason",
           "FUSED_DTYPES", "REF_DTYPES", "FUSED_MIN_HEADDIM", "FUSED_MAX_HEADDIM"]

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REF_DTYPES = FUSED_DTYPES + (torch.float64,)
FUSED_MIN_HEADDIM, FUSED_MAX_HEADDIM = 16, 256


def describe(t) -> str:
    """``shape [..], dtype .., device .., strides (..)`` for a tensor, the type name otherwise."""
    if not isinstance(t, torch.Tensor):
        return f"{type(t).__name__} {t!r:.60}"
    return (f"shape {list(t.shape)}, dtype {t.dtype}, device {t.device}, "
            f"strides {tuple(t.stride())}")


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton interpreter now (read at each call)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false",
                                                                            "off", "no")


def interpreting() -> bool:
    """Whether our Triton kernels run under the interpreter. ``@triton.jit`` reads
    ``TRITON_INTERPRET`` once, when it creates a kernel (when ``txl_kernels.ops`` is imported):
    after that, what it created decides (an ``InterpretedFunction`` or a compiled
    ``JITFunction``), whatever the variable says now; before, the variable now.
    Cheap after the first kernel is found (the answer is kept with the module that holds it:
    the model layers ask on every call)."""
    global _FOUND
    if _FOUND is not None and sys.modules.get(_FOUND[0].__name__) is _FOUND[0]:
        return _FOUND[1]
    if "txl_kernels.ops" not in sys.modules:  # no kernel created yet
        return interpret_requested()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("txl_kernels.ops.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            for _ in range(3):  # triton.autotune / triton.heuristics wrap the kernel as .fn
                kind = type(obj).__name__
                if kind in ("InterpretedFunction", "JITFunction"):
                    _FOUND = (mod, kind == "InterpretedFunction")
                    return _FOUND[1]
                obj = getattr(obj, "fn", None)
    return interpret_requested()


_FOUND = None  # (the ops module whose kernel interpreting() found, the answer)


def no_interpreter_reason() -> str:
    """Why CPU tensors cannot take the fused kernels (when :func:`interpreting` is False)."""
    if interpret_requested():
        return ("TRITON_INTERPRET=1 was set after the Triton kernels were created (when "
                "txl_kernels.ops was first used), so they are compiled GPU kernels; set it "
                "before the first fused call (e.g. in the shell)")
    return ("CPU tensors need TRITON_INTERPRET=1 set before triton is imported (the Triton "
            "interpreter); there is no compiled CPU kernel")


def check_same(who: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, *,
               dtype: bool = True, device: bool = True) -> None:
    """Raise, naming both tensors, if ``t``'s dtype (TypeError) or device (ValueError) is not
    ``ref``'s."""
    if dtype and t.dtype != ref.dtype:
        raise TypeError(f"{who}: {name} has dtype {t.dtype}, {ref_name} has {ref.dtype}")
    if device and t.device != ref.device:
        raise ValueError(f"{who}: {name} is on {t.device}, {ref_name} is on {ref.device}")
