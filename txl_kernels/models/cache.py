"""``TransfoXLCache``: the K/V cache of ``MemTransformerLM`` (``model.new_cache(bsz)``).

Instead of the memory's hidden states (what ``mems`` hold), the cache keeps, per layer, the
keys and values the layer projected from them, so a segment only projects its own tokens.

Layout: per layer one key and one value buffer, contiguous ``[cap, bsz, n_head * d_head]``
(seq-first; the attention reads ``buf[start : start + mlen + qlen]`` as a strided
``[bsz, klen, H, D]`` view, no copy). The live memory is rows ``[start, start + mlen)``. A
segment writes its new keys / values right after the memory (the concatenation, done in place
by each layer), then the window advances by the Transformer-XL rule
``end = mlen + max(0, qlen - ext_len)``, ``beg = max(0, end - mem_len)`` (the truncation, which
only moves ``start``). When the next segment would not fit, the window moves back to row 0:
one :func:`txl_kernels.memory.kv_cache_compact` call, a single launch for every buffer of every
layer on CUDA. ``cap = 2 * mem_len + max_qlen`` guarantees that this move never overlaps itself
and happens at most once every ``mem_len + 1`` tokens.
"""
from __future__ import annotations

import torch

from ..memory import kv_cache_compact

__all__ = ["TransfoXLCache"]


class TransfoXLCache:
    """Per-layer projected keys and values of the Transformer-XL memory.

    Made by ``MemTransformerLM.new_cache(bsz, max_qlen=None, ext_len=None)``; pass it as
    ``model(data, target, cache=cache)`` or ``model.generate(..., cache=cache)``; it is updated
    in place. Attributes: ``bsz``, ``mem_len``, ``ext_len``, ``max_qlen`` (the longest segment
    it accepts), ``mlen`` (rows of memory held now), ``nbytes`` (bytes of its buffers).
    """

    def __init__(self, n_layer: int, bsz: int, mem_len: int, ext_len: int, max_qlen: int,
                 width: int, dtype: torch.dtype, device: torch.device,
                 memory_backend: str = "auto"):
        for name, value, low in (("bsz", bsz, 1), ("max_qlen", max_qlen, 1),
                                 ("mem_len", mem_len, 0), ("ext_len", ext_len, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"new_cache: {name} must be an int >= {low}, got {value!r}")
        self.n_layer, self.bsz, self.width = n_layer, bsz, width
        self.mem_len, self.ext_len, self.max_qlen = mem_len, ext_len, max_qlen
        self.dtype, self.device = dtype, torch.device(device)
        self.memory_backend = memory_backend
        self.capacity = 2 * mem_len + max_qlen
        shape = (self.capacity, bsz, width)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self._work = {}
        self.start = 0
        self.mlen = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self) -> None:
        """Forget the memory (the buffers are kept)."""
        self.start = 0
        self.mlen = 0

    def __repr__(self) -> str:
        return (f"TransfoXLCache(n_layer={self.n_layer}, bsz={self.bsz}, mem_len={self.mem_len}, "
                f"ext_len={self.ext_len}, max_qlen={self.max_qlen}, mlen={self.mlen}, "
                f"dtype={self.dtype}, device={self.device}, nbytes={self.nbytes})")

    # -- used by MemTransformerLM -----------------------------------------------------------
    def _make_room(self, qlen: int) -> None:
        """Ensure rows ``[start + mlen, start + mlen + qlen)`` are inside the buffers."""
        if self.start + self.mlen + qlen <= self.capacity:
            return
        kv_cache_compact(self.k + self.v, self.start, self.mlen, backend=self.memory_backend)
        self.start = 0

    def _keys_values(self, layer: int, qlen: int):
        """(key rows, value rows) ``[mlen + qlen, bsz, width]`` of ``layer``: the memory
        followed by the rows the segment writes (views into the buffers)."""
        lo, hi = self.start, self.start + self.mlen + qlen
        return self.k[layer][lo:hi], self.v[layer][lo:hi]

    def work(self, slot: int, numel: int) -> torch.Tensor:
        """A flat buffer of ``numel`` elements (cache dtype and device) for the torch
        attention paths' large temporaries (scores, products with every key row), kept and
        reused by every layer and step: on CPUs a fresh allocation of megabytes per layer
        costs its page faults every time. Not part of the memory (not in ``nbytes``)."""
        buf = self._work.get(slot)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=self.dtype, device=self.device)
            self._work[slot] = buf
        return buf[:numel]

    def _advance(self, qlen: int) -> None:
        end = self.mlen + max(0, qlen - self.ext_len)
        beg = max(0, end - self.mem_len)
        self.start += beg
        self.mlen = end - beg
