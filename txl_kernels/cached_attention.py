"""Attention against a K/V cache: the routes of ``MemTransformerLM``'s cache path, and the one
function that picks among them, :func:`cached_attention`.

The cache hands a segment's queries ``[B, Lq, H, D]`` and its keys / values as strided
``[B, L, H, D]`` views of seq-first buffers (no copy), causal (bottom-right) with an optional
left window. The kernel follows ``rel_attention``'s policy for the backend
(:func:`txl_kernels.functional.choose_backend_for`); for one query row without dropout the
decode step's op ``txl_kernels::rel_attn_decode`` replaces the segment kernel (one row has no
relative shift):

- ``"triton_decode"``: that op's Triton kernel (the split-K ``txl_kernels.ops.rel_attn_decode``);
- ``"cpu_decode"``: that op's C++ CPU kernel (fp32 / fp64);
- ``"rel_attention"``: :func:`txl_kernels.functional.rel_attention` (the fused Triton kernel,
  the C++ CPU kernel or the reference).

With an 8-bit memory (``memory``, a :class:`~txl_kernels.quant.QuantizedKV` of the cache's
buffers) the keys / values are the memory's rows followed by ``k`` / ``v``'s. No triton import
here: the decode kernel's module is imported where that route runs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._cpp_ops import use_extension
from ._op import DECODE, op_kernel
from .functional import choose_backend_for, rel_attention
from .quant import QuantizedKV

__all__ = ["cached_attention", "cached_attention_route", "use_decode_layer_op",
           "decode_extension_args", "ROUTES"]

ROUTES = ("triton_decode", "cpu_decode", "rel_attention")
_CPU_DECODE_DTYPES = (torch.float32, torch.float64)  # the C++ decode ops'


def cached_attention_route(qlen: int, dtype: torch.dtype, device: torch.device, head_dim: int,
                           *, backend: str = "auto", dropout_p: float = 0.0) -> str:
    """Which route :func:`cached_attention` takes for ``qlen`` query rows of ``dtype`` and
    ``head_dim`` on ``device`` (one of :data:`ROUTES`). The kernel is ``rel_attention``'s
    choice for ``backend`` (:func:`~txl_kernels.functional.choose_backend_for`: ``"auto"`` is
    the fused Triton kernels where they run and take the dtype and head dim, else the C++ CPU
    kernel on CPU tensors, else the reference); then:

    - ``"triton_decode"``: one query row, no attention dropout, the kernel is Triton: the
      split-K decode kernel (parallel over the keys) replaces the segment kernel, whose
      tiles would be almost empty.
    - ``"cpu_decode"``: one query row, no dropout, the kernel is the C++ CPU kernel and the
      dtype fp32 / fp64: the streaming C++ decode kernel (one pass over the cached rows per
      product, no key-sized temporary).
    - ``"rel_attention"``: everything else, through ``rel_attention(..., backend=backend)``,
      whose plan (``functional.plan_call``) makes the same choice of kernel and runs the
      first-use self-check of the segment kernel that then runs.
    """
    kernel = choose_backend_for(backend, device, dtype, head_dim, "cached_attention")
    if qlen == 1 and dropout_p == 0:
        if kernel == "triton":
            return "triton_decode"
        if kernel == "cpu" and dtype in _CPU_DECODE_DTYPES:
            return "cpu_decode"
    return "rel_attention"


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor,
                     r_w_bias: torch.Tensor, r_r_bias: torch.Tensor, softmax_scale: float,
                     window_size: Tuple[int, int], *, memory: Optional[QuantizedKV] = None,
                     backend: str = "auto", dropout_p: float = 0.0) -> torch.Tensor:
    """Causal relative attention of ``q`` ``[B, Lq, H, D]`` against cached keys / values
    ``[B, L, H, D]`` (``r`` ``[Lk, H, D]``, row ``t`` serving distance ``Lk - 1 - t``, ``Lk``
    the key count, memory included), by the route :func:`cached_attention_route` picks.
    Returns ``[B, Lq, H, D]``; the same function as ``rel_attention(..., causal=True,
    window_size=window_size)`` on every route.

    ``memory``: an 8-bit memory in front of ``k`` / ``v`` (every route reads it in 8 bits,
    the reference dequantises it). ``backend``: ``rel_attention``'s. ``dropout_p``: attention
    dropout (0 in eval).
    """
    route = cached_attention_route(q.shape[1], q.dtype, q.device, q.shape[-1], backend=backend,
                                   dropout_p=dropout_p)
    if route != "rel_attention":  # the decode op's Triton kernel (the interpreter on CPU) or C++
        mem = () if memory is None else tuple(memory)
        kernel = op_kernel(DECODE, route == "triton_decode" and q.device.type == "cpu")
        return kernel(q, k, v, r, r_w_bias, r_r_bias, float(softmax_scale), window_size[0],
                      *mem)
    return rel_attention(q, k, v, r, r_w_bias, r_r_bias, causal=True, window_size=window_size,
                         softmax_scale=softmax_scale, dropout_p=dropout_p, backend=backend,
                         memory=memory)


def use_decode_layer_op(x: torch.Tensor, extension_backend: str) -> bool:
    """Whether a decoding step on ``x`` may run a whole layer as the C++ extension's
    ``decode_layer`` op: CPU fp32 / fp64 tensors, ``extension_backend`` not "torch" and the
    op available (``use_extension``: "auto" warns once where it is not, "extension"
    raises)."""
    return (extension_backend != "torch" and x.device.type == "cpu"
            and x.dtype in _CPU_DECODE_DTYPES
            and use_extension("decode_layer", x.device, extension_backend))


def decode_extension_args(memory: Optional[QuantizedKV], n_rows: int, window_left: int):
    """(lo, 8-bit memory arguments) of the C++ ``decode_layer`` op for ``n_rows`` cached rows
    after an optional 8-bit ``memory``: the first key the left window keeps (0 without a window) and
    the memory's four tensors seq-first ``[M, B, ...]`` (none without one)."""
    lk = (0 if memory is None else memory.mlen) + n_rows
    lo = 0 if window_left < 0 else max(0, lk - 1 - window_left)
    return lo, (() if memory is None else tuple(t.transpose(0, 1) for t in memory))
