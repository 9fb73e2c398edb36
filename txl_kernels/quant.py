"""8-bit memory: keys and values stored as int8 or float8_e4m3fn with one scale per
(token, head), read directly by the attention.

Granularity. One scale per (token, head), the absmax of that head's ``D`` values, divided by
the format's largest value (127 for int8, 448 for float8_e4m3fn):

- per token, because a token is quantised once, when its segment enters the memory, and never
  again: a scale shared with other tokens would have to be fixed before those tokens exist, or
  re-quantise the old ones when it changes. Keys and values also vary in magnitude from token to
  token (outlier tokens), which one per-tensor scale would pay for with the precision of all the
  others;
- per head, because each head's ``D`` values are one operand of one head's dot products, and
  heads differ in scale by orders of magnitude; a scale per (token, head) is exactly what a
  kernel that loads a ``[tokens, D]`` tile of one head needs (one scale per tile row);
- not finer (per group of channels), because at ``D`` of 64 one fp32 scale per row already
  costs 4 / 64 of a byte per value: an 8-bit memory is ``(D + 4) / (2 D)`` = 0.53x the bytes of
  a 16-bit one (``(D + 2) / (2 D)`` with fp16 scales, for small head dims).

Dequantisation, the contract the kernels and the reference share: ``(data.float() *
scale.float()[..., None]).to(compute dtype)``.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import torch

from ._utils import describe

__all__ = ["QuantizedKV", "QUANT_DTYPES", "SCALE_DTYPES", "quantize_per_token",
           "dequantize_per_token", "quantize_kv", "check_quant_dtype"]

QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
SCALE_DTYPES = (torch.float32, torch.float16)
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_F16_TINY = 2.0 ** -24  # float16's smallest positive (subnormal) value
_F16_MAX = 65504.0      # float16's largest finite value


def check_quant_dtype(who: str, name: str, dtype) -> None:
    """Raise a TypeError naming ``name`` unless ``dtype`` is an 8-bit memory format."""
    if dtype not in QUANT_DTYPES:
        raise TypeError(f"{who}: {name} must be torch.int8 or torch.float8_e4m3fn (8-bit "
                        f"memory), got {dtype}")


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype,
                       scale_dtype: torch.dtype = torch.float32
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` ``[..., D]`` to ``dtype`` (int8 / float8_e4m3fn) with one scale per
    row of ``D`` values (the last dim; for ``[B, M, H, D]`` keys: one per token and head).

    Returns ``(data [..., D] dtype, scale [...] scale_dtype)``. ``scale = absmax / qmax``
    (fp32); ``data = round(x / scale)`` (int8: to nearest even, clamped to +-127; fp8: the
    nearest e4m3 value, clamped to +-448). A row of zeros gets scale 0 and data 0. Computed in
    fp32.

    float16 scales: ``absmax / qmax`` is clamped into ``[2**-24, 65504]`` (float16's smallest
    positive and largest finite values) and rounded *up* to float16, so a stored scale is
    never 0 or inf for a finite nonzero row and no value exceeds ``qmax`` through the scale's
    rounding (in the subnormal range round-to-nearest could lose up to a third of the row's
    largest value). Hence: rows whose largest value is below ``qmax * 2**-24`` (7.6e-6 for
    int8, 2.7e-5 for fp8) are quantised on the step ``2**-24`` (int8 values below ``2**-25``,
    half float16's own smallest step, become 0); rows whose largest value exceeds
    ``65504 * qmax`` (8.3e6 for int8, 2.9e7 for fp8) saturate at that value. Rows holding inf /
    NaN keep a non-finite scale, as with float32 scales. Use float32 scales for data outside
    that range."""
    check_quant_dtype("quantize_per_token", "dtype", dtype)
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"quantize_per_token: scale_dtype must be torch.float32 or "
                        f"torch.float16, got {scale_dtype}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"quantize_per_token: x must be a floating tensor [..., D], "
                        f"got {describe(x)}")
    qmax = _QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / qmax
    if scale_dtype == torch.float16:
        scale = _fp16_scale(scale)
    s = scale.float()[..., None]
    y = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.round(y)
    return y.to(dtype), scale


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales -> float16 as :func:`quantize_per_token` documents: finite positive ones
    clamped into ``[2**-24, 65504]`` and rounded up (the C++ extension's ``head_scale``)."""
    ok = torch.isfinite(scale) & (scale > 0)
    want = torch.where(ok, scale.clamp(_F16_TINY, _F16_MAX), scale)
    half = want.to(torch.float16)
    # rounded down: the next float16 up (its bit pattern + 1; positive and below 65504 here)
    up = (half.view(torch.int16) + 1).view(torch.float16)
    return torch.where(half.float() < want, up, half)


def dequantize_per_token(data: torch.Tensor, scale: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """``(data.float() * scale.float()[..., None]).to(dtype)``: the dequantisation every
    path uses (the reference, the fused kernels in registers, the torch fallbacks)."""
    return (data.float() * scale.float()[..., None]).to(dtype)


class QuantizedKV(NamedTuple):
    """An 8-bit attention memory: the keys and values of ``M`` memory tokens.

    ``k`` / ``v``: ``[B, M, H, D]`` int8 or float8_e4m3fn (both the same), any strides with a
    contiguous last dim (seq-first ``[M, B, H, D]`` buffers pass as ``.transpose(0, 1)`` views).
    ``k_scale`` / ``v_scale``: ``[B, M, H]`` float32 or float16, one per (token, head).
    Pass it as ``rel_attention(q, k, v, ..., memory=QuantizedKV(...))``: the keys are then the
    memory's ``M`` rows followed by ``k``'s (the current segment, in the compute dtype).
    Make one with :func:`quantize_kv`."""
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor

    @property
    def mlen(self) -> int:
        return self.k.shape[1]

    def dequantize(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` ``[B, M, H, D]`` in ``dtype`` (a full-precision copy: for the reference
        path and tests)."""
        return (dequantize_per_token(self.k, self.k_scale, dtype),
                dequantize_per_token(self.v, self.v_scale, dtype))

    def in_front_of(self, k: torch.Tensor,
                    v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``[B, M + Lc, H, D]`` the memory stands for: its rows
        dequantised to k's dtype, then ``k`` / ``v`` ``[B, Lc, H, D]`` (``k`` / ``v`` as given
        for an empty memory; a full-precision copy otherwise: the reference's form)."""
        if self.mlen == 0:
            return k, v
        mk, mv = self.dequantize(k.dtype)
        return torch.cat([mk, k], dim=1), torch.cat([mv, v], dim=1)


def quantize_kv(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype = torch.int8,
                scale_dtype: torch.dtype = torch.float32) -> QuantizedKV:
    """Quantise memory keys / values ``[B, M, H, D]`` per (token, head) into a
    :class:`QuantizedKV`."""
    kq, ks = quantize_per_token(k, dtype, scale_dtype)
    vq, vs = quantize_per_token(v, dtype, scale_dtype)
    return QuantizedKV(kq, ks, vq, vs)
