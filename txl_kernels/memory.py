"""Transformer-XL segment-memory update: ``update_mems``.

The original ``MemTransformerLM._update_mems`` computes, per layer l,
``cat([mems[l], hids[l]], dim=0)[beg:end].detach()`` with ``end = mlen + max(0, qlen - ext_len)``
and ``beg = max(0, end - mem_len)``, but calls ``_update_mems(hids, mems, qlen, mlen)`` against
the signature ``(hids, mems, mlen, qlen)``: mlen and qlen swapped, which is wrong whenever they
differ and ext_len > 0. Here mlen is the memory length and qlen the segment length, per layer.

The work is done by the C++ extension (``csrc/``, built on first use by
:mod:`txl_kernels._build`): a parallel row copy on CPU, and on CUDA a single kernel launch for
all layers. Where the extension cannot be built (no ninja, no C++ compiler, no CUDA toolkit for
CUDA tensors) a pure-torch implementation is used and a warning saying why is issued once per
device type. Both give the formula's values bit for bit (they only copy).

The same extension serves the LM's K/V cache: ``kv_cache_compact`` (the window moved back to
row 0) and ``kv_cache_quantize_append`` (the 8-bit cache's per-(token, head) quantisation of a
segment's keys and values), each one launch for every buffer on CUDA, with the same fallback.

The new memories are fresh contiguous tensors that never alias ``hids`` or ``mems`` (the
original's are views into the concatenation, which keeps the whole ``cat`` alive).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ._cpp_ops import check_extension_backend, use_extension
from ._utils import as_len, check_same, describe
from .quant import SCALE_DTYPES, check_quant_dtype, quantize_per_token

__all__ = ["update_mems", "kv_cache_compact", "kv_cache_quantize_append"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _is_placeholder(m: torch.Tensor) -> bool:
    """The original code's ``torch.empty(0)`` 'no memory yet' placeholder."""
    return m.dim() == 1 and m.numel() == 0


def _as_list(who: str, name: str, value, what: str) -> list:
    """``value`` (a list or tuple) as a list; a TypeError naming ``who`` and ``name``
    otherwise (a tensor included: it iterates, but as rows, not as a list of tensors)."""
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{who}: {name} must be {what}, got {type(value).__name__}")
    return list(value)


def _check(hids, mems, mem_len, ext_len):
    mem_len = as_len("mem_len", mem_len, "update_mems")
    ext_len = as_len("ext_len", ext_len, "update_mems")
    hids = _as_list("update_mems", "hids", hids, "a list or tuple of per-layer tensors "
                    "[qlen, bsz, d]")
    for l, h in enumerate(hids):
        if not isinstance(h, torch.Tensor):
            raise TypeError(f"update_mems: hids[{l}] must be a torch.Tensor [qlen, bsz, d], "
                            f"got {type(h).__name__}")
        if h.dim() != 3:
            raise ValueError(f"update_mems: hids[{l}] must be 3-D [qlen, bsz, d] (seq-first), "
                             f"got {describe(h)}")
        if h.dtype not in _DTYPES:
            raise TypeError(f"update_mems: hids[{l}] must be float32, float16, bfloat16 or "
                            f"float64, got {h.dtype}")
        if h.dtype != hids[0].dtype:
            raise TypeError(f"update_mems: all hids must have one dtype; hids[0] is "
                            f"{hids[0].dtype}, hids[{l}] is {h.dtype}")
        if h.device != hids[0].device:
            raise ValueError(f"update_mems: all hids must be on one device; hids[0] is on "
                             f"{hids[0].device}, hids[{l}] is on {h.device}")
    mems = [] if mems is None else _as_list(
        "update_mems", "mems", mems, "None or a list or tuple with one tensor [mlen, bsz, d] per "
        "layer")
    if mems and len(mems) != len(hids):
        raise ValueError(f"update_mems: mems has {len(mems)} layers but hids has {len(hids)}; "
                         f"pass one memory per layer (or None / [] for no memory)")
    for l, m in enumerate(mems):
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"update_mems: mems[{l}] must be a torch.Tensor [mlen, bsz, d], "
                            f"got {type(m).__name__}")
        if _is_placeholder(m):
            continue  # no memory for this layer yet; its dtype and device do not matter
        h = hids[l]
        if m.dim() != 3:
            raise ValueError(f"update_mems: mems[{l}] must be 3-D [mlen, bsz, d] or an empty "
                             f"tensor, got {describe(m)}")
        if m.shape[1] != h.shape[1]:
            raise ValueError(f"update_mems: mems[{l}] has batch size (bsz) {m.shape[1]} but "
                             f"hids[{l}] has {h.shape[1]}")
        if m.shape[2] != h.shape[2]:
            raise ValueError(f"update_mems: mems[{l}] has feature size (d) {m.shape[2]} but "
                             f"hids[{l}] has {h.shape[2]}")
        check_same("update_mems", f"mems[{l}]", m, f"hids[{l}]", h)
    return hids, mems, mem_len, ext_len


def _update_mems_torch(hids: List[torch.Tensor], mems: List[torch.Tensor], mem_len: int,
                       ext_len: int) -> List[torch.Tensor]:
    """Pure-torch implementation (the fallback): the same rows, copied with ``copy_``."""
    out = []
    with torch.no_grad():
        for l, h in enumerate(hids):
            m = mems[l] if mems and not _is_placeholder(mems[l]) else None
            mlen = m.shape[0] if m is not None else 0
            qlen, bsz, d = h.shape
            end = mlen + max(0, qlen - ext_len)
            beg = max(0, end - mem_len)
            new = torch.empty((end - beg, bsz, d), dtype=h.dtype, device=h.device)
            from_mem = max(0, min(end, mlen) - beg)  # rows taken from the memory
            if from_mem:
                new[:from_mem].copy_(m[beg:beg + from_mem])
            if end - beg > from_mem:
                hb = max(0, beg - mlen)
                new[from_mem:].copy_(h[hb:end - mlen])
            out.append(new)
    return out


def update_mems(hids: Sequence[torch.Tensor], mems: Optional[Sequence[torch.Tensor]],
                mem_len: int, ext_len: int = 0, *, backend: str = "auto") -> List[torch.Tensor]:
    """New Transformer-XL memories: per layer ``cat([mems[l], hids[l]], 0)[beg:end].detach()``.

    Args:
        hids: list/tuple of L tensors ``[qlen, bsz, d]`` (seq-first), one dtype and device.
        mems: None, ``[]``, or L tensors ``[mlen, bsz, d]`` (same bsz, d, dtype, device as the
            layer's hids); an empty 1-D tensor (``torch.empty(0)``, the original code's
            placeholder) means no memory for that layer.
        mem_len: memory length to keep (>= 0). 0 gives empty ``[0, bsz, d]`` memories.
        ext_len: extended-context length (>= 0): the last ``ext_len`` positions of the segment
            are not put into the memory.
        backend: "auto" (the C++/CUDA extension, else the torch fallback with a one-time
            warning), "extension" (raise RuntimeError if it is unavailable) or "torch".

    Returns:
        A list of L fresh contiguous tensors ``[end - beg, bsz, d]`` that do not require grad,
        where ``end = mlen + max(0, qlen - ext_len)`` and ``beg = max(0, end - mem_len)``. Any
        strides are accepted.
    """
    check_extension_backend("update_mems", "backend", backend)
    hids, mems, mem_len, ext_len = _check(hids, mems, mem_len, ext_len)
    if not hids:
        return []
    if backend == "torch":
        return _update_mems_torch(hids, mems, mem_len, ext_len)
    if not use_extension("update_mems", hids[0].device, backend):
        return _update_mems_torch(hids, mems, mem_len, ext_len)
    return list(torch.ops.txl_kernels.update_mems([h.detach() for h in hids],
                                                  [m.detach() for m in mems], mem_len, ext_len))


def _kv_cache_compact_torch(bufs: List[torch.Tensor], src: int, n: int) -> None:
    with torch.no_grad():
        for b in bufs:
            b[:n].copy_(b[src:src + n])


def kv_cache_compact(bufs: Sequence[torch.Tensor], src: int, n: int, *,
                     backend: str = "auto") -> None:
    """Move rows ``[src, src + n)`` of every K/V-cache buffer to rows ``[0, n)``, in place.

    The truncation step of the LM's K/V cache (``txl_kernels.models``): each buffer is a
    contiguous ``[cap, bsz, d]`` tensor (one per layer for keys and one for values; an 8-bit
    cache adds its ``[cap, bsz, n_head]`` scales) whose live memory window is moved back to
    the start. With the C++/CUDA extension it is one copy per buffer on CPU and ONE kernel
    launch for all buffers on CUDA (a byte copy, so the buffers may differ in dtype); else a
    torch copy per buffer (with the same one-time warning as :func:`update_mems`).

    Args:
        bufs: list of contiguous 3-D tensors on one device (any dtypes), each with at least
            ``src + n`` rows.
        src, n: the window ``[src, src + n)``; it must not overlap ``[0, n)`` (``src >= n``).
        backend: "auto", "extension" or "torch", as for :func:`update_mems`.
    """
    check_extension_backend("kv_cache_compact", "backend", backend)
    src = as_len("src", src, "kv_cache_compact")
    n = as_len("n", n, "kv_cache_compact")
    bufs = _as_list("kv_cache_compact", "bufs", bufs, "a list of tensors [cap, bsz, d]")
    for l, b in enumerate(bufs):
        if not isinstance(b, torch.Tensor) or b.dim() != 3 or not b.is_contiguous():
            raise ValueError(f"kv_cache_compact: bufs[{l}] must be a contiguous 3-D tensor "
                             f"[cap, bsz, d], got {describe(b) if isinstance(b, torch.Tensor) else type(b).__name__}")
        if b.device != bufs[0].device:
            raise ValueError(f"kv_cache_compact: bufs[{l}] is on {b.device}, bufs[0] is on "
                             f"{bufs[0].device}")
        if src + n > b.shape[0]:
            raise ValueError(f"kv_cache_compact: rows [{src}, {src + n}) exceed bufs[{l}] "
                             f"with {b.shape[0]} rows")
    if n and src < n:
        raise ValueError(f"kv_cache_compact: rows [{src}, {src + n}) overlap their "
                         f"destination [0, {n}); need src >= n")
    if not bufs or n == 0 or src == 0:
        return
    if not use_extension("kv_cache_compact", bufs[0].device, backend):
        return _kv_cache_compact_torch(bufs, src, n)
    torch.ops.txl_kernels.kv_cache_compact(bufs, src, n)


def _quantize_append_torch(srcs, data_bufs, scale_bufs, dst_row: int, n_head: int) -> None:
    with torch.no_grad():
        for x, q, s in zip(srcs, data_bufs, scale_bufs):
            n = x.shape[0]
            data, scale = quantize_per_token(x.unflatten(-1, (n_head, -1)), q.dtype, s.dtype)
            q[dst_row:dst_row + n].copy_(data.flatten(-2))
            s[dst_row:dst_row + n].copy_(scale)


def kv_cache_quantize_append(srcs: Sequence[torch.Tensor], data_bufs: Sequence[torch.Tensor],
                             scale_bufs: Sequence[torch.Tensor], dst_row: int, n_head: int, *,
                             backend: str = "auto") -> None:
    """Quantise new K/V rows into an 8-bit cache's buffers, in place: the append step of the
    LM's 8-bit K/V cache (``new_cache(bsz, dtype=torch.int8)``), once per segment.

    For every ``i``: ``srcs[i]`` ``[n, bsz, n_head * d]`` (a layer's new keys or values in the
    compute dtype, any strides) is quantised per (row, batch entry, head) as
    :func:`txl_kernels.quant.quantize_per_token` does (bit for bit) into rows
    ``[dst_row, dst_row + n)`` of ``data_bufs[i]`` (contiguous ``[cap, bsz, n_head * d]``,
    int8 or float8_e4m3fn) and ``scale_bufs[i]`` (contiguous ``[cap, bsz, n_head]``, float32
    or float16). With the C++/CUDA extension: one parallel loop per buffer on CPU, ONE kernel
    launch for all buffers (every layer's keys and values) on CUDA; else ``quantize_per_token``
    per buffer (with the one-time warning of :func:`update_mems`).

    Args:
        srcs: list of 3-D floating tensors, one dtype and device.
        data_bufs / scale_bufs: one per source; all data buffers one dtype, all scale buffers
            one dtype, on the sources' device.
        dst_row: first row written (``dst_row + n <= cap``).
        n_head: heads per row (``width = n_head * d``).
        backend: "auto", "extension" or "torch", as for :func:`update_mems`.
    """
    who = "kv_cache_quantize_append"
    check_extension_backend(who, "backend", backend)
    dst_row = as_len("dst_row", dst_row, who)
    n_head = as_len("n_head", n_head, who, 1)
    lists = []
    for name, value in (("srcs", srcs), ("data_bufs", data_bufs), ("scale_bufs", scale_bufs)):
        value = _as_list(who, name, value, "a list of tensors")
        if not all(isinstance(t, torch.Tensor) for t in value):
            raise TypeError(f"{who}: {name} must hold only tensors")
        lists.append(value)
    srcs, data_bufs, scale_bufs = lists
    if not len(srcs) == len(data_bufs) == len(scale_bufs):
        raise ValueError(f"{who}: srcs, data_bufs and scale_bufs must have one length, got "
                         f"{len(srcs)}, {len(data_bufs)}, {len(scale_bufs)}")
    if not srcs:
        return
    for i, (x, q, s) in enumerate(zip(srcs, data_bufs, scale_bufs)):
        if x.dim() != 3 or x.dtype not in _DTYPES or x.dtype != srcs[0].dtype:
            raise TypeError(f"{who}: srcs[{i}] must be a 3-D float tensor [n, bsz, width] of "
                            f"srcs[0]'s dtype ({srcs[0].dtype}), got {describe(x)}")
        n, bsz, width = x.shape
        if width % n_head:
            raise ValueError(f"{who}: srcs[{i}] width {width} is not a multiple of "
                             f"n_head={n_head}")
        check_quant_dtype(who, f"data_bufs[{i}].dtype", q.dtype)
        if q.dtype != data_bufs[0].dtype:
            raise TypeError(f"{who}: data_bufs[{i}] is {q.dtype}, data_bufs[0] is "
                            f"{data_bufs[0].dtype}")
        if s.dtype not in SCALE_DTYPES or s.dtype != scale_bufs[0].dtype:
            raise TypeError(f"{who}: scale_bufs[{i}] must be float32 or float16 (one dtype for "
                            f"all), got {describe(s)}")
        if q.dim() != 3 or not q.is_contiguous() or tuple(q.shape[1:]) != (bsz, width):
            raise ValueError(f"{who}: data_bufs[{i}] must be a contiguous [cap, {bsz}, "
                             f"{width}] tensor, got {describe(q)}")
        if s.dim() != 3 or not s.is_contiguous() or tuple(s.shape) != (q.shape[0], bsz, n_head):
            raise ValueError(f"{who}: scale_bufs[{i}] must be a contiguous [{q.shape[0]}, {bsz}, "
                             f"{n_head}] tensor, got {describe(s)}")
        if dst_row + n > q.shape[0]:
            raise ValueError(f"{who}: rows [{dst_row}, {dst_row + n}) exceed data_bufs[{i}] "
                             f"with {q.shape[0]} rows")
        for name, t in ((f"data_bufs[{i}]", q), (f"scale_bufs[{i}]", s), (f"srcs[{i}]", x)):
            check_same(who, name, t, "srcs[0]", srcs[0], dtype=False)
    if not use_extension(who, srcs[0].device, backend):
        return _quantize_append_torch(srcs, data_bufs, scale_bufs, dst_row, n_head)
    torch.ops.txl_kernels.kv_cache_quantize_append([x.detach() for x in srcs], data_bufs,
                                                   scale_bufs, dst_row, n_head)
