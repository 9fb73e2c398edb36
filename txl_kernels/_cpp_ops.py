"""The C++ extension's ops as seen from Python: their fake implementations and whether they run.

``csrc/`` defines the ops in the ``txl_kernels`` namespace with ``torch.library``
(``TORCH_LIBRARY_FRAGMENT`` schemas, CPU kernels, and CUDA kernels in a CUDA build); importing
the extension that :mod:`txl_kernels._build` compiles registers them, and they are called as
``torch.ops.txl_kernels.<op>``:

    update_mems(Tensor[] hids, Tensor[] mems, int mem_len, int ext_len=0) -> Tensor[]
    kv_cache_compact(Tensor(a!)[] bufs, int src, int n) -> ()
    kv_cache_quantize_append(Tensor[] srcs, Tensor(a!)[] data_bufs, Tensor(b!)[] scale_bufs,
                             int dst_row, int n_head) -> ()
    decode_layer(x, weights..., Tensor(a!) keys, Tensor(b!) values, r, u, vb, softmax_scale, lo,
                 k_mem?, k_scale?, v_mem?, v_scale?) -> Tensor                    (CPU only)
    cpu_isa() -> str, cpu_isa_supported() -> str[], cpu_isa_override(str isa) -> str
        the CPU kernels' ISA variant (docs/cpu.md, "ISA variants"); no tensors, no fakes
    cpu_lowp_route(ScalarType dtype) -> str, cpu_brgemm_calls() -> int
        the fused CPU forward's bf16 / fp16 GEMM route (docs/cpu.md, "bf16 / fp16 GEMMs");
        no tensors, no fakes
    cpu_fp32_gemm() -> str, cpu_fp32_gemm_override(str which) -> str
        the CPU kernels' fp32 GEMM library (docs/cpu.md, "fp32 GEMMs"); no tensors, no fakes

The fake (meta) implementations below give their outputs' shapes and dtypes without running
them, so ``torch.compile`` traces through them and ``torch.library.opcheck`` checks them like
the Triton ops (the C++ side names this module with ``m.set_python_module``). Argument checks
with messages that name the argument live in the Python wrappers (:mod:`txl_kernels.memory`,
the LM) and, for direct callers, in the C++ kernels.

:func:`use_extension` decides, per call, between an op and the caller's pure-torch fallback.
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Sequence, Set

import torch

from . import _build
from ._export import register_onnx_symbolics
from ._utils import assume_constant_result

__all__ = ["load_extension", "unavailable", "use_extension", "warn_fallback",
           "check_extension_backend", "EXTENSION_BACKENDS"]

# The values of every ``backend`` that chooses between an op of the extension and its
# pure-torch fallback (``update_mems``, the K/V cache's ops, the LM's ``extension_backend``).
EXTENSION_BACKENDS = ("auto", "extension", "torch")

_WARNED: Set[str] = set()
_FAKES_REGISTERED = False


def load_extension():
    """:func:`txl_kernels._build.load_extension` (the extension module, or None), with the
    ops' fake implementations registered once it is loaded (torch.library registers them
    only for ops that exist)."""
    ext = _build.load_extension()
    if ext is not None and not _FAKES_REGISTERED:
        _register_fakes()
    return ext


@assume_constant_result
def unavailable(op: str, device_type: str) -> str:
    """Why ``torch.ops.txl_kernels.<op>`` cannot run on ``device_type`` tensors ("" when it
    can). Builds and loads the extension on the first call. The answer does not change within
    a process (the extension is loaded at most once), so ``torch.compile`` takes it as a
    constant instead of tracing the loader."""
    if device_type not in ("cpu", "cuda"):
        return f"the C++ extension has no kernel for {device_type} tensors"
    ext = load_extension()
    if ext is None:
        return str(_build.extension_status()["reason"])
    if not hasattr(torch.ops.txl_kernels, op):
        return f"the loaded extension has no op {op}"
    if device_type == "cuda" and not getattr(ext, "with_cuda", False):
        return ("the C++ extension was built without its CUDA kernel: "
                + str(_build.extension_status()["cuda_reason"]))
    return ""


def warn_fallback(device_type: str, reason: str) -> None:
    """Warn once per device type that the extension's ops fall back, and why."""
    if device_type in _WARNED:
        return
    _WARNED.add(device_type)
    warnings.warn(f"txl_kernels: the C++ extension's ops (update_mems, the K/V cache's "
                  f"compaction and 8-bit append, the CPU decoding step, the CPU attention kernel of "
                  f"rel_attention) use their "
                  f"pure-torch fallback for {device_type} "
                  f"tensors because {reason}", RuntimeWarning, stacklevel=4)


def check_extension_backend(who: str, name: str, backend) -> None:
    """Raise ValueError naming ``who`` and the argument ``name`` unless ``backend`` is one of
    :data:`EXTENSION_BACKENDS`."""
    if backend not in EXTENSION_BACKENDS:
        raise ValueError(f"{who}: {name} must be one of {EXTENSION_BACKENDS}, got {backend!r}")


def use_extension(op: str, device: torch.device, backend: str) -> bool:
    """Whether the caller runs ``torch.ops.txl_kernels.<op>`` on ``device`` tensors (else its
    pure-torch fallback). ``backend``: "torch" never; "extension" always, raising a
    RuntimeError that says why when the op cannot run; "auto" when it can, else False after a
    one-time warning (per device type) saying why."""
    if backend == "torch":
        return False
    reason = unavailable(op, device.type)
    if not reason:
        return True
    if backend == "extension":
        raise RuntimeError(f"{op}: backend='extension' is not available for {device.type} "
                           f"tensors: {reason}")
    warn_fallback(device.type, reason)
    return False


# ----------------------------------------------------------------- fake (meta) implementations

def _update_mems_fake(hids: Sequence[torch.Tensor], mems: Sequence[torch.Tensor],
                      mem_len: int, ext_len: int = 0) -> List[torch.Tensor]:
    out = []
    for l, h in enumerate(hids):
        m = mems[l] if len(mems) else None
        # no memory, or the original code's torch.empty(0) placeholder for it
        mlen = 0 if m is None or (m.dim() == 1 and m.numel() == 0) else m.shape[0]
        qlen, bsz, d = h.shape
        end = mlen + torch.sym_max(0, qlen - ext_len)
        # rows end - max(0, end - mem_len), written as a min: on symbolic lengths (torch.export)
        # its bounds follow from theirs, so no guard is needed on its sign or size
        out.append(h.new_empty((torch.sym_min(end, mem_len), bsz, d)))
    return out


def _kv_cache_compact_fake(bufs: Sequence[torch.Tensor], src: int, n: int) -> None:
    return None


def _kv_cache_quantize_append_fake(srcs: Sequence[torch.Tensor],
                                   data_bufs: Sequence[torch.Tensor],
                                   scale_bufs: Sequence[torch.Tensor], dst_row: int,
                                   n_head: int) -> None:
    return None


def _decode_layer_fake(x, qkv_w, o_w, ln1_w, ln1_b, eps1, ff1_w, ff1_b, ff2_w, ff2_b, ln2_w,
                       ln2_b, eps2, pre_lnorm, keys, values, r, u, vb, softmax_scale, lo,
                       k_mem=None, k_scale=None, v_mem=None, v_scale=None) -> torch.Tensor:
    return x.new_empty(x.shape)  # [B, d_model], contiguous


def _register_fakes() -> None:
    global _FAKES_REGISTERED
    for name, fake in (("update_mems", _update_mems_fake),
                       ("kv_cache_compact", _kv_cache_compact_fake),
                       ("kv_cache_quantize_append", _kv_cache_quantize_append_fake),
                       ("decode_layer", _decode_layer_fake)):
        if hasattr(torch.ops.txl_kernels, name):  # a build without the op: nothing to fake
            torch.library.register_fake(f"txl_kernels::{name}", fake)
    register_onnx_symbolics()  # rel_attn_fwd called directly, exported by dynamo=False
    _FAKES_REGISTERED = True
