"""The fused CPU kernel of ``rel_attention`` (``csrc/rel_attention_cpu.cpp``, see docs/cpu.md):
the ``CPU`` dispatch key's kernel of ``txl_kernels::rel_attn_fwd`` / ``rel_attn_bwd``, whose
schemas, fakes and autograd live in ``_op.py``. This module loads it (the C++ extension is
built on first use) and says whether it runs. No triton import here.
"""
from __future__ import annotations

from typing import Optional, Tuple

from . import _build
from ._utils import assume_constant_result
from ._cpp_ops import unavailable

__all__ = ["cpu_kernel_available", "load_library"]

_STATE: Optional[Tuple[bool, str]] = None


@assume_constant_result
def cpu_kernel_available() -> Tuple[bool, str]:
    """(True, where it was loaded from) once the C++ extension with the CPU kernel is loaded
    (built on the first call, like the rest of the extension), else (False, why not)."""
    global _STATE
    if _STATE is not None:
        return _STATE
    why = unavailable("rel_attn_cpu_threads", "cpu")
    _STATE = (False, why) if why else (True, str(_build.extension_status()["reason"]))
    return _STATE


def load_library() -> str:
    """Load the C++ extension now (built on the first call, as on the first use of any of its
    ops), so that its kernels (the CPU kernel of ``txl_kernels::rel_attn_fwd`` /
    ``rel_attn_bwd``, ``update_mems``, ...) are in PyTorch's dispatcher; return the path of
    its shared library. Raises RuntimeError saying why when it cannot be built or loaded.

    ``import txl_kernels`` defines the attention ops and loads their CPU kernel on their first
    CPU call. A process that runs a program calling them without importing txl_kernels (an
    AOTInductor package from ``torch._inductor.aoti_compile_and_package``, a model saved by
    ``torch.jit.save``, traced or scripted with the CPU kernel) loads the returned path
    first: ``torch.ops.load_library(path)`` in Python, ``dlopen(path, RTLD_NOW |
    RTLD_GLOBAL)`` in C++ before ``AOTIModelPackageLoader`` / ``torch::jit::load`` (the
    library then defines the ops' schemas itself). Without it, loading fails: "Could not find
    schema for txl_kernels::rel_attn_fwd"."""
    ok, why = cpu_kernel_available()
    if not ok:
        raise RuntimeError(f"txl_kernels.load_library: the C++ extension cannot be loaded: "
                           f"{why}")
    return _build.load_extension().__file__
