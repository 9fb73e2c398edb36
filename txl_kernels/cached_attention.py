"""Attention against a K/V cache: the routes of ``MemTransformerLM``'s cache path, and the one
function that picks among them, :func:`cached_attention`.

The cache hands a segment's queries ``[B, Lq, H, D]`` and its keys / values as strided
``[B, L, H, D]`` views of seq-first buffers (no copy), causal (bottom-right) with an optional
left window. Besides :func:`txl_kernels.functional.rel_attention` (the fused Triton kernel or
the reference) the routes are:

- the op ``txl_kernels::rel_attn_decode`` on its Triton kernel (the split-K
  ``txl_kernels.ops.rel_attn_decode``) for one query row;
- :func:`decode_attention_cpu`: one query row on CPUs, the same op on its C++ kernel, else
  :func:`decode_attention_torch`;
- :func:`segment_attention_torch`: a segment of query rows in torch (CPUs, fp32 / fp64).

With an 8-bit memory (``memory``, a :class:`~txl_kernels.quant.QuantizedKV` of the cache's
buffers) the keys / values are the memory's rows followed by ``k`` / ``v``'s. No triton import
here: the decode kernel's module is imported where that route runs.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ._cpp_ops import use_extension
from ._op import DECODE, op_kernel
from ._utils import FUSED_DTYPES
from .functional import fused_available, rel_attention
from .quant import QuantizedKV
from .reference import finite_or_zero, row_poison

__all__ = ["cached_attention", "cached_attention_route", "use_cpu_decode_op",
           "decode_extension_args", "decode_attention_cpu", "decode_attention_torch",
           "segment_attention_torch", "ROUTES"]

ROUTES = ("triton_decode", "cpu_decode", "torch_segment", "rel_attention")
_TORCH_DTYPES = (torch.float32, torch.float64)  # the torch routes and the C++ decode ops


def cached_attention_route(qlen: int, dtype: torch.dtype, device: torch.device, *,
                           backend: str = "auto", dropout_p: float = 0.0) -> str:
    """Which route :func:`cached_attention` takes for ``qlen`` query rows of ``dtype`` on
    ``device`` (one of :data:`ROUTES`), and why:

    - ``"triton_decode"``: one query row where the fused backend runs (``backend`` not
      "reference", a fused dtype, :func:`fused_available`) and no attention dropout. One row
      has no relative shift, so the split-K kernel (parallel over the keys) replaces the
      segment kernel, whose tiles would be almost empty.
    - ``"cpu_decode"``: one query row otherwise, without dropout: the streaming C++ op on
      CPUs, else torch on any device (:func:`decode_attention_cpu`).
    - ``"torch_segment"``: several rows in fp32 / fp64 without dropout where the fused kernel
      does not run (CPUs) or ``backend="reference"``: :func:`segment_attention_torch` reads the
      cache in place with fewer passes over the scores than the reference.
    - ``"rel_attention"``: everything else (the fused kernel; dropout in training; fp16 /
      bf16 without it), through ``rel_attention(..., backend=backend)``.
    """
    if qlen == 1 and dropout_p == 0 and backend != "reference" and dtype in FUSED_DTYPES \
            and fused_available(device)[0]:
        return "triton_decode"
    if qlen == 1 and dropout_p == 0:
        return "cpu_decode"
    if dropout_p == 0 and dtype in _TORCH_DTYPES and (
            backend == "reference" or dtype not in FUSED_DTYPES
            or not fused_available(device)[0]):
        return "torch_segment"
    return "rel_attention"


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor,
                     r_w_bias: torch.Tensor, r_r_bias: torch.Tensor, softmax_scale: float,
                     window_size: Tuple[int, int], *, memory: Optional[QuantizedKV] = None,
                     full_kv: Optional[Callable] = None, backend: str = "auto",
                     dropout_p: float = 0.0, extension_backend: str = "auto",
                     work: Optional[Callable] = None) -> torch.Tensor:
    """Causal relative attention of ``q`` ``[B, Lq, H, D]`` against cached keys / values
    ``[B, L, H, D]`` (``r`` ``[Lk, H, D]``, row ``t`` serving distance ``Lk - 1 - t``, ``Lk``
    the key count, memory included), by the route :func:`cached_attention_route` picks.
    Returns ``[B, Lq, H, D]``; the same function as ``rel_attention(..., causal=True,
    window_size=window_size)`` on every route.

    ``memory``: an 8-bit memory in front of ``k`` / ``v``; the fused routes read it in 8 bits,
    the torch routes take every key / value row in the compute dtype from ``full_kv()``
    (required then). ``backend``: ``rel_attention``'s. ``dropout_p``: attention dropout (0 in
    eval). ``extension_backend``: whether the CPU decode route runs the C++ op ("auto",
    "extension", "torch", as for :func:`txl_kernels.memory.update_mems`). ``work``: a
    ``work(slot, numel)`` buffer lender (the cache's) for the torch routes' large
    temporaries, or None.
    """
    route = cached_attention_route(q.shape[1], q.dtype, q.device, backend=backend,
                                   dropout_p=dropout_p)
    rest = (r, r_w_bias, r_r_bias, softmax_scale)
    if route == "triton_decode":  # the op's Triton kernel (under the interpreter on CPU)
        mem = () if memory is None else tuple(memory)
        return op_kernel(DECODE, q.device.type == "cpu")(q, k, v, *rest, window_size[0], *mem)
    if route == "cpu_decode":
        return decode_attention_cpu(q, k, v, *rest, window_size[0], work, extension_backend,
                                    memory=memory, full_kv=full_kv)
    if route == "torch_segment":
        keys, values = (k, v) if memory is None else _full_kv(full_kv)
        return segment_attention_torch(q, keys, values, *rest, window_size[0], work)
    return rel_attention(q, k, v, r, r_w_bias, r_r_bias, causal=True, window_size=window_size,
                         softmax_scale=softmax_scale, dropout_p=dropout_p, backend=backend,
                         memory=memory)


def _full_kv(full_kv: Optional[Callable]):
    if full_kv is None:
        raise ValueError("cached_attention: the torch routes need full_kv (every key / value "
                         "row in the compute dtype) with an 8-bit memory")
    return full_kv()


def use_cpu_decode_op(op: str, x: torch.Tensor, extension_backend: str) -> bool:
    """Whether the CPU decode step runs the C++ extension's ``op`` ("rel_attn_decode", or
    "decode_layer", a whole layer) for ``x``: CPU fp32 / fp64 tensors, ``extension_backend``
    not "torch" and the op available (``use_extension``: "auto" warns once where it is not,
    "extension" raises)."""
    return (extension_backend != "torch" and x.device.type == "cpu" and x.dtype in _TORCH_DTYPES
            and use_extension(op, x.device, extension_backend))


def decode_extension_args(memory: Optional[QuantizedKV], n_rows: int, window_left: int):
    """(lo, 8-bit memory arguments) of the C++ ``decode_layer`` op for ``n_rows`` cached rows
    after an optional 8-bit ``memory``: the first key the left window keeps (0 without a window) and
    the memory's four tensors seq-first ``[M, B, ...]`` (none without one)."""
    lk = (0 if memory is None else memory.mlen) + n_rows
    lo = 0 if window_left < 0 else max(0, lk - 1 - window_left)
    return lo, (() if memory is None else tuple(t.transpose(0, 1) for t in memory))


def decode_attention_cpu(q, k, v, r, r_w_bias, r_r_bias, softmax_scale: float,
                         window_left: int = -1, work=None, extension_backend: str = "auto",
                         memory: Optional[QuantizedKV] = None, full_kv=None):
    """:func:`decode_attention_torch`'s contract, for CPUs: the C++ kernel of
    ``txl_kernels::rel_attn_decode`` (one pass over the cached rows per product, no key-sized
    temporary; fp32 / fp64 CPU tensors) where :func:`use_cpu_decode_op` allows it, else
    :func:`decode_attention_torch` with ``work(0, n)`` as its scratch.

    ``memory``: an 8-bit memory (``QuantizedKV``, ``[B, M, H, D]``) in front of ``k`` / ``v``
    (then ``r`` has ``M + Lk`` rows): the extension reads its 8-bit rows and scales and
    dequantises them in registers; the torch fallback takes the full keys / values
    ``[B, M + Lk, H, D]`` from ``full_kv()`` (the cache dequantises into its work buffers)."""
    lk = (0 if memory is None else memory.mlen) + k.shape[1]
    if lk > 0 and use_cpu_decode_op("rel_attn_decode", q, extension_backend):
        mem = () if memory is None else tuple(memory)
        return DECODE(q, k, v, r, r_w_bias, r_r_bias, float(softmax_scale), window_left, *mem)
    if memory is not None:
        k, v = _full_kv(full_kv)
    scratch = None if work is None else work(0, k.numel())
    return decode_attention_torch(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left,
                                  scratch)


def decode_attention_torch(q, k, v, r, r_w_bias, r_r_bias, softmax_scale: float,
                           window_left: int = -1,
                           scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One query row (``q`` ``[B, 1, H, D]``) against ``k`` / ``v`` ``[B, Lk, H, D]`` in
    torch, for CPUs (the split-K kernel's contract, see ``ops/rel_attn_decode.py``): no
    relative shift (key ``j`` uses position row ``j``) and no mask (the left window only
    drops the keys before ``Lk - 1 - window_left``). ``scratch``: optional buffer of at least
    ``Lk * B * H * D`` elements of k's dtype for the products (the K/V cache lends one, so a
    decoding step allocates no key-sized temporary)."""
    lk = k.shape[1]
    lo = 0 if window_left < 0 else max(0, lk - 1 - window_left)
    q0 = q[:, 0]  # [B, H, D]
    # In the cache's own layout [Lk, B, H, D] (rows of the K/V buffers), read in place:
    # products and sums over contiguous rows (on CPUs, batched GEMVs with D ~ 64 are slower).
    kj, vj = k[:, lo:].transpose(0, 1), v[:, lo:].transpose(0, 1)
    n = kj.numel()
    tmp = (scratch.reshape(-1)[:n].view(kj.shape) if scratch is not None and
           scratch.numel() >= n and scratch.dtype == k.dtype and scratch.device == k.device
           else None)
    scores = torch.mul(kj, q0 + r_w_bias, out=tmp).sum(-1)  # [Lk, B, H]
    scores += torch.mul(r[lo:lk, None], q0 + r_r_bias, out=tmp).sum(-1)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    prob = torch.softmax(scores.to(acc) * softmax_scale, dim=0).to(v.dtype)
    return torch.mul(prob[..., None], vj, out=tmp).sum(0)[:, None]


def segment_attention_torch(q, k, v, r, r_w_bias, r_r_bias, softmax_scale: float,
                            window_left: int = -1, work=None) -> torch.Tensor:
    """A segment of ``Lq`` query rows (``q`` ``[B, Lq, H, D]``) against the cached keys /
    values ``[B, Lk, H, D]`` (seq-first buffers, read in place), causal (bottom-right) with an
    optional left window, ``r`` ``[Lk, H, D]`` (row ``t`` serves distance ``Lk - 1 - t``), in
    torch: the path the cached model takes where the fused kernel does not run (CPUs),
    fp32 / fp64. The same function as ``rel_attention(..., causal=True)`` with fewer passes
    over the ``[B, H, Lq, Lk]`` scores than the reference: ``(q + vb) r^T`` once into a
    buffer, the relative shift as a strided view of it (no pad, no copy), ``(q + u) k^T`` and
    the scale in one ``baddbmm``, the mask in place, the softmax into the first buffer.
    ``work``: the cache's ``work(slot, numel)`` to reuse those two buffers (no allocation per
    layer), or None."""
    B, Lq, H, D = q.shape
    Lk = k.shape[1]
    n = B * H * Lq * Lk

    def buf(slot):
        return (torch.empty(n, dtype=q.dtype, device=q.device) if work is None
                else work(slot, n))

    qu = (q + r_w_bias).transpose(1, 2).reshape(B * H, Lq, D)
    qv = (q + r_r_bias).transpose(1, 2)  # [B, H, Lq, D]
    pos = buf(1).view(B, H, Lq, Lk)
    r_t = r.permute(1, 2, 0)  # [H, D, Lk] (a broadcast matmul over B would copy it B times)
    for b in range(B):
        torch.bmm(qv[b], r_t, out=pos[b])  # [H, Lq, Lk]: every position row
    # Query i reads row Lq - 1 - i + j for key j: a view with row stride Lk - 1 (entries
    # past the causal edge read neighbouring values; they are masked below).
    bd = pos.as_strided((B * H, Lq, Lk), (Lq * Lk, Lk - 1, 1), pos.storage_offset() + Lq - 1)
    scores = buf(2).view(B * H, Lq, Lk)
    torch.baddbmm(bd, qu, k.permute(0, 2, 3, 1).reshape(B * H, D, Lk), beta=softmax_scale,
                  alpha=softmax_scale, out=scores)
    i = torch.arange(Lq, device=q.device)[:, None] + (Lk - Lq)
    j = torch.arange(Lk, device=q.device)[None, :]
    masked = j > i
    if window_left >= 0:
        masked |= j < i - window_left
    # a non-finite v row: NaN on its keys' scores (the rows that may see it stay non-finite)
    # and 0 in P V (the rows that may not add P = 0 times it: exactly 0)
    scores += row_poison(v, scores.dtype).permute(0, 2, 1).reshape(B * H, 1, Lk)
    scores.masked_fill_(masked, float("-inf"))
    prob = pos.view(B * H, Lq, Lk)
    torch._softmax(scores, -1, False, out=prob)
    out = torch.bmm(prob, finite_or_zero(v.permute(0, 2, 1, 3)).reshape(B * H, Lk, D))
    return out.view(B, H, Lq, D).transpose(1, 2)
