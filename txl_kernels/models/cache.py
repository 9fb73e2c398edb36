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

8-bit memory (``new_cache(bsz, dtype=torch.int8)`` or ``torch.float8_e4m3fn``): the buffers
hold the memory's keys and values in 8 bits, with one scale per (token, head) in
``[cap, bsz, n_head]`` buffers (fp32, or fp16 with ``scale_dtype``; why this granularity:
:mod:`txl_kernels.quant`). A segment's own keys and values stay in the compute dtype (the
model's) while it is attended; after the last layer they are quantised into the buffers,
every layer's keys and values in ONE :func:`txl_kernels.memory.kv_cache_quantize_append`
call (one launch on CUDA), and never again. The attention reads the memory as
:class:`txl_kernels.quant.QuantizedKV` views of the buffers (``[bsz, mlen, H, D]``, no copy);
the fused kernels dequantise its rows in registers, the reference route as a whole. Compaction
moves the scales with the data (the same single launch).
"""
from __future__ import annotations

import os
import weakref
from typing import List, Optional

import torch

from .._cpp_ops import check_extension_backend
from .._utils import renamed_attribute, renamed_keywords
from ..memory import kv_cache_compact, kv_cache_quantize_append
from ..quant import QUANT_DTYPES, SCALE_DTYPES, QuantizedKV

__all__ = ["TransfoXLCache"]


def _available_bytes(device: torch.device) -> Optional[int]:
    """Bytes a new allocation can take on ``device`` now: CUDA, the driver's free memory plus
    what torch's allocator holds unused; CPU, the kernel's ``MemAvailable`` (Linux) or the
    free physical pages; None where unknown (other devices and systems)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


class TransfoXLCache:
    """Per-layer projected keys and values of the Transformer-XL memory.

    Made by ``MemTransformerLM.new_cache(bsz, max_qlen=None, ext_len=None, dtype=None,
    scale_dtype=torch.float32)``; pass it as ``model(data, target, cache=cache)`` or
    ``model.generate(..., cache=cache)``; it is updated in place. Attributes: ``bsz``,
    ``mem_len``, ``ext_len``, ``max_qlen`` (the longest segment it accepts), ``mlen`` (rows of
    memory held now), ``dtype`` (of the stored keys / values: the model's, or int8 /
    float8_e4m3fn), ``compute_dtype`` (the model's), ``quantized``, ``nbytes`` (bytes of its
    buffers, scales included), ``fingerprint`` (the model configuration it was made for).
    Built directly, it takes ``extension_backend`` (the model's, through ``new_cache``); its
    former name ``memory_backend`` still works, as a keyword and an attribute, with a
    DeprecationWarning.

    A cache belongs to the model that made it, in the configuration it had then (lengths,
    ``same_length``, ``clamp_len``, dtype, device): the model raises when it is handed another
    model's cache or after ``reset_length`` changed ``mem_len`` / ``ext_len``. Its contents
    (the memory's keys and values and the projected position table, built at the first segment)
    come from the weights of the time they were computed: after changing the weights (a
    ``load_state_dict``, an EMA swap, writes through ``.data``), call :meth:`reset` or make a
    new cache.

    The buffers' size is checked before they are allocated: a cache larger than the available
    device memory raises ``MemoryError``, naming ``mem_len`` and the bytes needed.
    """

    memory_backend = renamed_attribute("TransfoXLCache", "memory_backend", "extension_backend")

    @renamed_keywords("TransfoXLCache", memory_backend="extension_backend")
    def __init__(self, n_layer: int, bsz: int, mem_len: int, ext_len: int, max_qlen: int,
                 width: int, dtype: torch.dtype, device: torch.device,
                 extension_backend: str = "auto", *, n_head: int = 1,
                 quant_dtype: Optional[torch.dtype] = None,
                 scale_dtype: torch.dtype = torch.float32, model=None,
                 fingerprint: Optional[dict] = None):
        for name, value, low in (("bsz", bsz, 1), ("max_qlen", max_qlen, 1),
                                 ("mem_len", mem_len, 0), ("ext_len", ext_len, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"new_cache: {name} must be an int >= {low}, got {value!r}")
        if quant_dtype is not None and quant_dtype not in QUANT_DTYPES:
            raise TypeError(f"new_cache: dtype must be None (the model's dtype), torch.int8 or "
                            f"torch.float8_e4m3fn (8-bit memory), got {quant_dtype!r}")
        if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head < 1 \
                or width % n_head:
            raise ValueError(f"new_cache: n_head must be an int >= 1 dividing width={width}, "
                             f"got {n_head!r}")
        if scale_dtype not in SCALE_DTYPES:
            raise TypeError(f"new_cache: scale_dtype must be torch.float32 or torch.float16, "
                            f"got {scale_dtype!r}")
        self.n_layer, self.bsz, self.width, self.n_head = n_layer, bsz, width, n_head
        self.mem_len, self.ext_len, self.max_qlen = mem_len, ext_len, max_qlen
        self.compute_dtype, self.device = dtype, torch.device(device)
        self.quantized = quant_dtype is not None
        self.dtype = quant_dtype if self.quantized else dtype
        check_extension_backend("new_cache", "extension_backend", extension_backend)
        self.extension_backend = extension_backend
        self.capacity = 2 * mem_len + max_qlen
        self._model = None if model is None else weakref.ref(model)
        self.fingerprint = dict(fingerprint or {})
        shape = (self.capacity, bsz, width)
        sshape = (self.capacity, bsz, n_head)
        self._check_size(shape, sshape, scale_dtype)
        self.k_scale: List[torch.Tensor] = []
        self.v_scale: List[torch.Tensor] = []
        try:
            self.k = [torch.zeros(shape, dtype=self.dtype, device=device)
                      for _ in range(n_layer)]
            self.v = [torch.zeros(shape, dtype=self.dtype, device=device)
                      for _ in range(n_layer)]
            if self.quantized:
                self.k_scale = [torch.zeros(sshape, dtype=scale_dtype, device=device)
                                for _ in range(n_layer)]
                self.v_scale = [torch.zeros(sshape, dtype=scale_dtype, device=device)
                                for _ in range(n_layer)]
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if isinstance(e, torch.OutOfMemoryError) or "memory" in str(e):
                self.k = self.v = self.k_scale = self.v_scale = []
                raise MemoryError(self._size_message(shape, sshape, scale_dtype, None)) from e
            raise
        self._pos_tables: dict = {}  # per layer: the projected position table
        self._pending: List[torch.Tensor] = []  # 8-bit: this segment's keys, values per layer
        self.start = 0
        self.mlen = 0

    def _needed_bytes(self, shape, sshape, scale_dtype) -> int:
        n = 2 * self.n_layer * shape[0] * shape[1] * shape[2] * self.dtype.itemsize
        if self.quantized:
            n += 2 * self.n_layer * sshape[0] * sshape[1] * sshape[2] * scale_dtype.itemsize
        return n

    def _size_message(self, shape, sshape, scale_dtype, available: Optional[int]) -> str:
        scales = (f" plus {scale_dtype} scales [{sshape[0]}, {sshape[1]}, {sshape[2]}]"
                  if self.quantized else "")
        have = ("more than the device allows" if available is None
                else f"more than the {available} bytes available")
        return (f"new_cache: mem_len={self.mem_len} needs a cache of "
                f"{self._needed_bytes(shape, sshape, scale_dtype)} bytes on {self.device} "
                f"(keys and values of n_layer={self.n_layer} layers, [2 * mem_len + max_qlen = "
                f"{shape[0]}, bsz={shape[1]}, {shape[2]}] {self.dtype} each{scales}), {have}; "
                f"lower mem_len (model.reset_length), max_qlen or bsz")

    def _check_size(self, shape, sshape, scale_dtype) -> None:
        """Raise MemoryError before allocating buffers larger than the available device
        memory (an allocator's own failure would not say which length asked for it)."""
        available = _available_bytes(self.device)
        if available is not None and \
                self._needed_bytes(shape, sshape, scale_dtype) > available:
            raise MemoryError(self._size_message(shape, sshape, scale_dtype, available))

    def _buffers(self) -> List[torch.Tensor]:
        return self.k + self.v + self.k_scale + self.v_scale

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers())

    def reset(self) -> None:
        """Forget the memory and the projected position table (the buffers are kept): the
        next segment starts with no memory, with the model's current weights."""
        self.start = 0
        self.mlen = 0
        self._pos_tables = {}

    def __repr__(self) -> str:
        scales = f", scale_dtype={self.k_scale[0].dtype}" if self.k_scale else ""
        return (f"TransfoXLCache(n_layer={self.n_layer}, bsz={self.bsz}, mem_len={self.mem_len}, "
                f"ext_len={self.ext_len}, max_qlen={self.max_qlen}, mlen={self.mlen}, "
                f"dtype={self.dtype}{scales}, compute_dtype={self.compute_dtype}, "
                f"device={self.device}, nbytes={self.nbytes})")

    # -- used by MemTransformerLM -----------------------------------------------------------
    def _make_room(self, qlen: int) -> None:
        """Ensure rows ``[start + mlen, start + mlen + qlen)`` are inside the buffers (the
        first step of a segment: also drops rows a failed segment left pending)."""
        self._pending = []
        if self.start + self.mlen + qlen <= self.capacity:
            return
        kv_cache_compact(self._buffers(), self.start, self.mlen, backend=self.extension_backend)
        self.start = 0

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Take the segment's keys and values ``[qlen, bsz, width]`` of ``layer``; return
        ``(keys, values, memory)`` for its attention, as :meth:`_slots` with ``k`` / ``v``
        written into the slots."""
        keys, values, memory = self._slots(layer, k.shape[0])
        keys[keys.shape[0] - k.shape[0]:].copy_(k)
        values[values.shape[0] - v.shape[0]:].copy_(v)
        return keys, values, memory

    def _slots(self, layer: int, qlen: int):
        """``(keys, values, memory)`` for the attention of ``layer`` over a segment of ``qlen``
        rows, whose keys / values the caller writes into the LAST ``qlen`` rows of ``keys`` /
        ``values``. Full-precision cache: ``keys`` / ``values`` are the buffer rows
        ``[mlen + qlen, bsz, width]`` (views: the concatenation happens in place), ``memory``
        None. 8-bit cache: they are new ``[qlen, bsz, width]`` tensors in the compute dtype,
        kept for :meth:`_append`, with the memory as a :class:`QuantizedKV` of buffer views
        ``[bsz, mlen, H, D]`` (None while empty)."""
        lo, mid = self.start, self.start + self.mlen
        if not self.quantized:
            return self.k[layer][lo:mid + qlen], self.v[layer][lo:mid + qlen], None
        k = torch.empty(qlen, self.bsz, self.width, dtype=self.compute_dtype, device=self.device)
        v = torch.empty_like(k)
        self._pending += [k, v]
        if self.mlen == 0:
            return k, v, None
        H, M, B = self.n_head, self.mlen, self.bsz
        data = [buf[lo:mid].view(M, B, H, self.width // H).transpose(0, 1)
                for buf in (self.k[layer], self.v[layer])]
        scales = [buf[lo:mid].transpose(0, 1) for buf in (self.k_scale[layer],
                                                          self.v_scale[layer])]
        return k, v, QuantizedKV(data[0], scales[0], data[1], scales[1])

    def _append(self, qlen: int) -> None:
        """8-bit cache, after the last layer: quantise the rows of the segment that the
        window keeps (every layer's keys and values in one call) right after the memory."""
        pending, self._pending = self._pending, []
        end = self.mlen + max(0, qlen - self.ext_len)
        lo = max(0, end - self.mem_len - self.mlen)  # first segment row kept
        hi = end - self.mlen
        if hi > lo:
            kv_cache_quantize_append([t[lo:hi] for t in pending], self._interleaved(self.k, self.v),
                                     self._interleaved(self.k_scale, self.v_scale),
                                     self.start + self.mlen + lo, self.n_head,
                                     backend=self.extension_backend)

    @staticmethod
    def _interleaved(a: List[torch.Tensor], b: List[torch.Tensor]) -> List[torch.Tensor]:
        return [t for pair in zip(a, b) for t in pair]

    def _advance(self, qlen: int) -> None:
        end = self.mlen + max(0, qlen - self.ext_len)
        beg = max(0, end - self.mem_len)
        self.start += beg
        self.mlen = end - beg
