"""Pieces shared by the forward, backward and decode kernels: interpreter detection, operand
rounding, the window / mask helpers (``key_range``, ``pair_mask``, ``interior_tiles``), 8-bit
memory dequantisation (forward and decode), fp32 product precision, stride normalisation, the
autotuning switch and length buckets, and the dropout RNG."""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._arch import config_family
from .._variant import variant_of
from .._utils import draw_dropout_seed, interpreting, last_dim_contiguous  # noqa: F401

# TRITON_INTERPRET is read once, as triton itself does when it decorates the kernels.
INTERPRET = interpreting()

# exp(x) = exp2(x * LOG2E): the kernels' scores are in log2 units (qk_scale = scale * LOG2E);
# launchers read LOG2E.value
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


def length_bucket(n: int) -> int:
    """A sequence length's bucket in the kernels' autotune keys: the next power of two, at
    least 64, capped at 16384 (every longer length shares the largest bucket's config)."""
    return min(16384, max(64, triton.next_power_of_2(int(n))))


@triton.jit
def round_bf16(x):
    """fp32 -> fp32 holding the nearest bfloat16 (ties to even). Used only under the
    interpreter, whose fp32 -> bf16 conversion truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


_INTERP = tl.constexpr(INTERPRET)


# ---- the kernels' tuple arguments, read by field name
#
# Triton takes NamedTuples as kernel arguments (flattened in field order, like plain tuples)
# and its jit code reads their fields by name and builds them by name. The strides of a
# tensor travel as one of the stride tuples below; what several kernels share (masks,
# dropout, the 8-bit memory, the allowed-pair pattern) is built here, by one builder each.

class RowStrides(NamedTuple):
    """The (batch, row, head) strides of a ``[B, L, H, D]`` (or ``[B, L, H]``) tensor."""
    batch: int
    row: int
    head: int


def row_strides(t: torch.Tensor) -> RowStrides:
    return RowStrides(t.stride(0), t.stride(1), t.stride(2))


class HeadStrides(NamedTuple):
    """The (row, head) strides of an ``[R, H, D]`` tensor (r, dr)."""
    row: int
    head: int


def head_strides(t: torch.Tensor) -> HeadStrides:
    return HeadStrides(t.stride(0), t.stride(1))


class BiasStrides(NamedTuple):
    """The head strides of the two ``[H, D]`` biases u (r_w_bias) and vb (r_r_bias)."""
    u: int
    vb: int


def bias_strides(u: torch.Tensor, vb: torch.Tensor) -> BiasStrides:
    return BiasStrides(u.stride(0), vb.stride(0))


class WorkStrides(NamedTuple):
    """The (batch * head, row) strides of an ``operand_workspace``."""
    bh: int
    row: int


class KpmStrides(NamedTuple):
    """The (batch, key) strides of the key padding mask ``[B, Lk]``."""
    batch: int
    key: int


class MaskStrides(NamedTuple):
    """The (batch, head, row, key) strides of the dense mask ``[B, H, Lq, Lk]``."""
    batch: int
    head: int
    row: int
    key: int


class MaskArgs(NamedTuple):
    """The backward kernels' ``masks`` argument (``mask_args``; the forward's adds two
    fields): the window (-1 = unbounded side, or as the launcher widened it), the key padding
    mask and the dense mask (uint8 views) with their strides, and the device-side band
    (``apply_mask_band``)."""
    window_left: int
    window_right: int
    kpm: torch.Tensor
    kpm_strides: KpmStrides
    mask: torch.Tensor
    mask_strides: MaskStrides
    band: torch.Tensor


class Pattern(NamedTuple):
    """What ``pair_mask`` masks with, set up once per program by the kernels'
    ``_program_setup``: the batch and head, the lengths, the window (narrowed by a band),
    ``band_on`` (the band replaces the dense mask) and ``MaskArgs``' masks."""
    b: object
    h: object
    Lq: object
    Lk: object
    window_left: object
    window_right: object
    band_on: object
    kpm: object
    kpm_strides: KpmStrides
    mask: object
    mask_strides: MaskStrides


class DropoutArgs(NamedTuple):
    """The kernels' ``dropout`` argument (``dropout_args``): the (seed, offset) tensor, the
    keep-mask's threshold (``dropout_threshold``) and the kept values' scale
    (``dropout_keep_scale``)."""
    seed: torch.Tensor
    threshold: int
    keep_scale: float


class MemoryArgs(NamedTuple):
    """The forward and decode kernels' ``memory`` argument (``memory_launch_args``): the 8-bit
    keys / values and their per-row scales with their (batch, row, head) strides, and the
    memory's rows ``M``."""
    kq: torch.Tensor
    ks: torch.Tensor
    vq: torch.Tensor
    vs: torch.Tensor
    kq_strides: RowStrides
    ks_strides: RowStrides
    vq_strides: RowStrides
    vs_strides: RowStrides
    M: int


class QuantRows(NamedTuple):
    """One side (keys or values) of the 8-bit memory of one (batch, head) (``memory_bases``):
    the data's base pointer, the int32 offsets of a ``[BN, BD]`` tile's rows, the scales' base
    pointer and the data's and the scales' row strides."""
    data: object
    offsets: object
    scale: object
    data_stride: object
    scale_stride: object


# ---- the tensor-core operands (q + u) and (q + vb)

@triton.jit
def to_operand(x, IN_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """Round x to the input dtype, the precision of the tensor-core operands. UPCAST
    (interpreter, bf16): the rounded value is kept in fp32 for tl.dot."""
    if UPCAST:
        y = round_bf16(x)
    else:
        y = x.to(IN_DTYPE)
    return y


@triton.jit
def bias_operands(q, u, vb, IN_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """(q + u, q + vb) rounded once to the input dtype, the operands of the AC and BD products
    in every kernel (q [BLOCK, BLOCK_D], the biases [BLOCK_D]; both in fp32, or both in the
    16-bit input dtype: the exact sum of two 16-bit values rounds the same either way)."""
    return (to_operand(q + u[None, :], IN_DTYPE, UPCAST),
            to_operand(q + vb[None, :], IN_DTYPE, UPCAST))


@triton.jit
def load_bias_operands(Q_bh, U_h, VB_h, rows, offs_d, d_ok, msk, stride_qm,
                       UPCAST: tl.constexpr):
    """``bias_operands`` of rows ``rows`` ([BLOCK, 1], int64) of one (batch, head), loaded
    from q (``Q_bh``, row stride stride_qm; ``msk`` the rows and columns in range) and this
    head's biases ``U_h`` / ``VB_h``."""
    q = tl.load(Q_bh + rows * stride_qm + offs_d[None, :], mask=msk, other=0.0).to(tl.float32)
    u = tl.load(U_h + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    vb = tl.load(VB_h + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    return bias_operands(q, u, vb, Q_bh.dtype.element_ty, UPCAST)


@triton.jit
def store_bias_operands(Q_bh, U_h, VB_h, A_bh, QV_bh, rows, offs_d, d_ok, msk, stride_qm,
                        stride_wm, UPCAST: tl.constexpr):
    """``load_bias_operands`` stored into the workspaces A_bh / QV_bh (row stride stride_wm;
    ``operand_workspace``)."""
    a_op, qv_op = load_bias_operands(Q_bh, U_h, VB_h, rows, offs_d, d_ok, msk, stride_qm,
                                     UPCAST)
    w_off = rows * stride_wm + offs_d[None, :]
    tl.store(A_bh + w_off, a_op, mask=msk)
    tl.store(QV_bh + w_off, qv_op, mask=msk)


def operand_workspace(B: int, H: int, Lq: int, D: int, dtype: torch.dtype, upcast: bool,
                      device) -> torch.Tensor:
    """One ``[B * H, Lq, D]`` workspace for ``store_bias_operands`` (fp32 under ``upcast``),
    its rows padded to 16 bytes so that it can always be a TMA descriptor's base."""
    op_dtype = torch.float32 if upcast else dtype
    per16 = 16 // torch.empty(0, dtype=op_dtype).element_size()
    d_pad = (D + per16 - 1) // per16 * per16
    return torch.empty((B * H, Lq, d_pad), device=device, dtype=op_dtype)[..., :D]


@triton.jit
def interior_tiles(i_first, i_last, BLOCK_N: tl.constexpr, t_begin, t_end, Lk, mlen,
                   window_left, window_right, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """The key tiles ``[t_in, t_out)`` of ``[t_begin, t_end)`` that query rows
    ``[i_first, i_last]`` see with no mask: every key < Lk, ``j0 + BLOCK_N - 1 <= i_first +
    mlen + window_right`` (HAS_WR) and ``j0 >= i_last + mlen - window_left`` (HAS_WL). The
    forward's and the backward dq kernel's interior run (``tile_run`` 1); the caller leaves it
    empty under a padding or dense mask."""
    t_out = tl.minimum(t_end, Lk // BLOCK_N)
    if HAS_WR:
        t_out = tl.minimum(t_out, tl.maximum(i_first + mlen + window_right + 1, 0) // BLOCK_N)
    t_in = t_begin
    if HAS_WL:
        t_in = tl.maximum(t_begin,
                          (tl.maximum(i_last + mlen - window_left, 0) + BLOCK_N - 1) // BLOCK_N)
        t_in = tl.minimum(t_in, t_end)
    return t_in, tl.maximum(t_out, t_in)


@triton.jit
def tile_run(run: tl.constexpr, first, interior, after, stop):
    """The tile range of run ``run`` (a ``tl.static_range(3)`` index) of a loop that the
    kernels split in three: 0 the left band edge ``[first, interior)`` (masked), 1 the
    interior ``[interior, after)`` (mask-free), 2 the right edge and tail ``[after, stop)``
    (masked). The callers pass ``MASKED = run != 1`` to their tile function."""
    if run == 0:
        lo, hi = first, interior
    elif run == 1:
        lo, hi = interior, after
    else:
        lo, hi = after, stop
    return lo, hi


@triton.jit
def key_range(rows, Lq, Lk, window_left, window_right, HAS_WL: tl.constexpr,
              HAS_WR: tl.constexpr):
    """``(j_min, j_max)``: the keys that query row(s) ``rows`` may see, the window (bottom-right
    aligned: distance ``d = i + Lk - Lq - j`` in ``[-window_right, window_left]``; a side
    without HAS_WL / HAS_WR is unbounded) cut to ``[0, Lk)``; a row >= Lq sees none
    (``j_max = -1``). ``rows`` a scalar or a [BM] tensor. The forward's and the decode
    kernel's key ranges; ``pair_mask`` (forward and backward) tests the same bounds relative to
    a tile's first key."""
    key0 = rows + (Lk - Lq)  # the key at distance 0
    j_min = key0 * 0
    if HAS_WL:
        j_min = tl.maximum(key0 - window_left, 0)
    j_max = key0 * 0 + (Lk - 1)
    if HAS_WR:
        j_max = tl.minimum(key0 + window_right, Lk - 1)
    return j_min, tl.where(rows < Lq, j_max, -1)


@triton.jit
def pair_mask(offs_i, j0, BLOCK_N: tl.constexpr, pattern, HAS_WL: tl.constexpr,
              HAS_WR: tl.constexpr, HAS_KPM: tl.constexpr, HAS_MASK: tl.constexpr,
              HAS_BAND: tl.constexpr):
    """The allowed pairs [BM, BN] of query rows ``offs_i`` and keys ``j0 + [0, BLOCK_N)``:
    inside ``key_range`` (the window, key < Lk, row < Lq), not padded (HAS_KPM), not masked by
    the dense mask (HAS_MASK; read inside [0, Lq) x [0, Lk), and not at all when a mask band
    replaces it, HAS_BAND). The key range is compared as column offsets against per-row
    bounds relative to j0 (immediates per column, no index tensor). ``pattern``: a ``Pattern``,
    set up once per program by the kernels' ``_program_setup``."""
    Lq, Lk = pattern.Lq, pattern.Lk
    window_left, window_right = pattern.window_left, pattern.window_right
    cols = tl.arange(0, BLOCK_N)
    # key_range relative to j0 (its clamp of j_min at 0 left out: no column is below -j0)
    c0 = offs_i + (Lk - Lq - j0)  # the column at distance 0
    c_max = Lk - 1 - j0
    if HAS_WR:
        c_max = tl.minimum(c0 + window_right, c_max)
    ok = cols[None, :] <= tl.where(offs_i < Lq, c_max, -1)[:, None]
    if HAS_WL:
        ok = ok & (cols[None, :] >= (c0 - window_left)[:, None])
    offs_j = j0 + cols
    if HAS_KPM:
        kp = tl.load(pattern.kpm + pattern.b * pattern.kpm_strides.batch
                     + offs_j.to(tl.int64) * pattern.kpm_strides.key, mask=offs_j < Lk, other=1)
        ok = ok & (kp == 0)[None, :]
    if HAS_MASK:
        # (rows < Lq and keys < Lk as two broadcast vectors: fewer registers than ``ok``)
        am_msk = (offs_i < Lq)[:, None] & (offs_j < Lk)[None, :]
        if HAS_BAND:  # the mask is its band (applied as the window): nothing to load
            am_msk = am_msk & (pattern.band_on == 0)
        stride_m = pattern.mask_strides
        am = tl.load(pattern.mask + pattern.b * stride_m.batch + pattern.h * stride_m.head
                     + offs_i.to(tl.int64)[:, None] * stride_m.row
                     + offs_j.to(tl.int64)[None, :] * stride_m.key, mask=am_msk, other=0)
        ok = ok & (am == 0)
    return ok


@triton.jit
def load_8bit(ptrs, msk):
    """fp32 values of 8-bit memory data (int8 / float8_e4m3fn) at ``ptrs``, 0 where not
    ``msk``. (int8 by I2F: in the static model of the decode loop (tools/decode_static.py)
    the integer trick 2^23 + (x + 128) as fp32 bits minus 2^23 + 128 costs more issue slots
    than the conversion pipe, which stays below the issue bound.)"""
    if ptrs.dtype.element_ty == tl.int8:
        return tl.load(ptrs, mask=msk, other=0).to(tl.float32)
    elif _INTERP:  # the interpreter cannot cast an `other` to fp8
        return tl.where(msk, tl.load(ptrs, mask=msk).to(tl.float32), 0.0)
    else:
        return tl.load(ptrs, mask=msk, other=0.0).to(tl.float32)


@triton.jit
def load_dequant(ptrs, s_ptrs, row_ok, msk, OUT_TY: tl.constexpr, UPCAST: tl.constexpr):
    """Rows of an 8-bit memory (int8 / float8_e4m3fn) dequantised in registers, by the
    contract of ``txl_kernels.quant``: ``data.float() * scale.float()`` rounded to ``OUT_TY``
    (UPCAST: an fp32 tensor holding the nearest bf16, as the interpreter needs). ``ptrs``:
    ``[BN, BD]`` data pointers; ``s_ptrs``: ``[BN]`` per-row scale pointers, loaded where
    ``row_ok``; ``msk`` (broadcastable to ``[BN, BD]``): the entries to load, the others
    come back 0."""
    s = tl.load(s_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    y = load_8bit(ptrs, msk) * s[:, None]
    if UPCAST:
        return round_bf16(y)
    return y.to(OUT_TY)


@triton.jit
def _quant_rows(X, S, stride_x, stride_s, b, h, offs_n0, offs_d):
    """``QuantRows`` of data X / scales S (strides: ``RowStrides``) for batch b, head h."""
    return QuantRows(X + b * stride_x.batch + h * stride_x.head,
                     offs_n0[:, None] * stride_x.row + offs_d[None, :],
                     S + b * stride_s.batch + h * stride_s.head, stride_x.row, stride_s.row)


@triton.jit
def memory_bases(memory, b, h, offs_n0, offs_d):
    """The 8-bit memory of batch b, head h, from the kernels' ``memory`` argument
    (``MemoryArgs``): ``(keys, values, M)``, keys / values each a ``QuantRows`` (tiles of
    rows offs_n0, columns offs_d)."""
    keys = _quant_rows(memory.kq, memory.ks, memory.kq_strides, memory.ks_strides, b, h,
                       offs_n0, offs_d)
    values = _quant_rows(memory.vq, memory.vs, memory.vq_strides, memory.vs_strides, b, h,
                         offs_n0, offs_d)
    return keys, values, memory.M


def memory_launch_args(memory, k: torch.Tensor, v: torch.Tensor) -> MemoryArgs:
    """The ``memory`` argument (``MemoryArgs``) of the forward and decode kernels, the data
    with a contiguous last dim. ``memory`` None or of length 0: placeholders (k, v, zero
    strides, ``M`` 0; the kernels' QUANT_MEM variant is then off and reads none of
    them)."""
    if memory is None or memory.k.shape[1] == 0:
        z = RowStrides(0, 0, 0)
        return MemoryArgs(k, k, v, v, z, z, z, z, 0)
    kq, vq = (last_dim_contiguous(t) for t in (memory.k, memory.v))
    ks, vs = memory.k_scale, memory.v_scale
    B, M, H, D = kq.shape
    assert kq.dtype == vq.dtype and kq.element_size() == 1 \
        and (k.shape[0], *k.shape[2:]) == (B, H, D) and tuple(vq.shape) == (B, M, H, D) \
        and tuple(ks.shape) == (B, M, H) == tuple(vs.shape), f"memory {memory!r:.200}"
    return MemoryArgs(kq, ks, vq, vs, row_strides(kq), row_strides(ks), row_strides(vq),
                      row_strides(vs), M)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input_precision: fp32 inputs follow torch.get_float32_matmul_precision()
    ("highest" -> exact IEEE fp32 products, otherwise TF32); fp16 / bf16 products are exact."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def variant_flags(q: torch.Tensor, window_left: int, window_right: int, key_padding_mask,
                  attn_mask, attn_mask_band, dropout_p: float, memory, r_first_distance,
                  deterministic: bool = False) -> dict:
    """The constexpr flags a launch takes from its call's variant (``_variant.variant_of``,
    the self-check's key, so that what is checked is what is compiled): HAS_WL / HAS_WR (a
    window side; a mask band compiles both in), HAS_KPM, HAS_MASK, HAS_BAND (a band with its
    dense mask), DROPOUT, QUANT_MEM (an 8-bit memory with rows). Each launcher passes the
    ones its kernels declare."""
    v = variant_of(q, window_left, window_right, key_padding_mask, attn_mask, attn_mask_band,
                   dropout_p, memory, True, deterministic, r_first_distance)
    band = v.band and v.attn_mask
    return dict(HAS_WL=v.window_left or band, HAS_WR=v.window_right or band,
                HAS_KPM=v.key_padding, HAS_MASK=v.attn_mask, HAS_BAND=band, DROPOUT=v.dropout,
                QUANT_MEM=bool(v.memory))


def excludes_pairs(window_left: int, window_right: int, key_padding_mask, attn_mask) -> bool:
    """Whether any mask or window can exclude a pair (the launchers' test for cleaning the
    operands of non-finite rows: only then can an exact 0 of P or dS meet one)."""
    return (window_left >= 0 or window_right >= 0 or key_padding_mask is not None
            or attn_mask is not None)


def mask_args(window_left: int, window_right: int, key_padding_mask, attn_mask, band,
              placeholder: torch.Tensor, full_shape) -> MaskArgs:
    """The kernels' ``masks`` argument: the window as given, the key padding mask ``[B, Lk]``
    and the dense mask (expanded to ``full_shape`` ``[B, H, Lq, Lk]``, any strides) as uint8
    views with their strides, and the band (None: none); ``placeholder`` and zero strides
    stand in for an absent one (unread: HAS_KPM / HAS_MASK / HAS_BAND off)."""
    if key_padding_mask is not None:
        kpm = key_padding_mask.view(torch.uint8)
        kpm_strides = KpmStrides(kpm.stride(0), kpm.stride(1))
    else:
        kpm, kpm_strides = placeholder, KpmStrides(0, 0)
    if attn_mask is not None:
        am = attn_mask.expand(*full_shape).view(torch.uint8)
        am_strides = MaskStrides(*am.stride())
    else:
        am, am_strides = placeholder, MaskStrides(0, 0, 0, 0)
    return MaskArgs(window_left, window_right, kpm, kpm_strides, am, am_strides,
                    placeholder if band is None else band)


def autotune_enabled() -> bool:
    """GPU block sizes are autotuned unless TXL_KERNELS_AUTOTUNE=0 (read at each call) or
    the calling thread is inside ``default_configs()``."""
    if getattr(_DEFAULTS_ONLY, "depth", 0):
        return False
    return os.environ.get("TXL_KERNELS_AUTOTUNE", "1") != "0"


_DEFAULTS_ONLY = threading.local()


@contextmanager
def default_configs():
    """Within the block, this thread's launches use each kernel's default config, as with
    TXL_KERNELS_AUTOTUNE=0 (the first-use self-check: one compile per kernel, no tuning)."""
    _DEFAULTS_ONLY.depth = getattr(_DEFAULTS_ONLY, "depth", 0) + 1
    try:
        yield
    finally:
        _DEFAULTS_ONLY.depth -= 1


@triton.jit
def apply_mask_band(BAND, window_left, window_right):
    """Read ``[is_band, left, right]`` (``functional.mask_to_band``) from device memory.

    ``window_left`` / ``window_right`` are the call's window (-1 = unbounded side); the band's
    ``left`` / ``right`` are plain bounds (``-right <= d <= left``, either may be negative).
    Returns the window narrowed by the band and whether the band replaces the dense mask. It
    does only when both narrowed bounds are >= 0, i.e. representable in the window convention the
    kernels share (a negative bound would read as "unbounded"); any other band (one that
    leaves out the diagonal side it bounds, or allows nothing) keeps the window as it was and
    returns False, so the kernels read the dense mask, which holds the same pairs."""
    on = tl.load(BAND) != 0
    bl = tl.load(BAND + 1)
    br = tl.load(BAND + 2)
    nl = tl.where(window_left < 0, bl, tl.minimum(window_left, bl))
    nr = tl.where(window_right < 0, br, tl.minimum(window_right, br))
    use = on & (nl >= 0) & (nr >= 0)
    return tl.where(use, nl, window_left), tl.where(use, nr, window_right), use


# ---- per-row rotation (the relative shift's skew) without tl.gather's layout round trip
#
# tl.gather along a [BM, BN] accumulator converts it to a row-per-warp layout and back through
# shared memory (2 x 2 x BM x BN x 4 bytes per tile) and issues two shuffles per element. The
# rotation below touches only what must cross lanes. In the sm_90 wgmma accumulator layout a
# column index c = 8 g + 2 q + b0 has g and b0 in registers and q in lane bits 0-1, and a row
# index a has bits 0-2 in lane bits 2-4, bit 3 in a register and a // 16 in the warp. So a
# rotation by s = 8 s_hi + 2 s1 + s0 is done as: groups of 8 columns rotated by s_hi (a barrel
# of register moves + one select per element per bit), the b0 halves swapped by s0 (select),
# the carry into the next group pre-selected at the source, and one tl.gather along q alone
# (4 wide, one shuffle per element), reshaped so that Triton's gather layout is the accumulator
# layout itself (no conversion). Any layout gives the same values: only the cost depends on it.

@triton.jit
def _roll_groups(x, M: tl.constexpr, A: tl.constexpr, G: tl.constexpr, C: tl.constexpr):
    """y[:, g, :] = x[:, (g + M) % G, :] for x [A, G, C]; M a power of two < G (or G == 1)."""
    if G == 1:
        return x
    elif M * 2 == G:  # swap the two halves
        lo, hi = tl.split(tl.permute(tl.reshape(x, [A, 2, M, C]), (0, 2, 3, 1)))
        return tl.reshape(tl.permute(tl.join(hi, lo), (0, 3, 1, 2)), [A, G, C])
    else:  # g = (h, bit, low): bit 0 <- bit 1 of the same h; bit 1 <- bit 0 of h + 1
        H: tl.constexpr = G // (2 * M)
        e, o = tl.split(tl.permute(tl.reshape(x, [A, H, 2, M * C]), (0, 1, 3, 2)))
        e = _roll_groups(e, 1, A, H, M * C)
        return tl.reshape(tl.permute(tl.join(o, e), (0, 1, 3, 2)), [A, G, C])


@triton.jit
def _rotate_lanes(f, d, BM: tl.constexpr, NG: tl.constexpr):
    """y[a, g, q] = f[a, g, (q + d[a]) % 4] for f [BM, NG, 4] (BM >= 16). The gather runs on a
    [BM * NG, 4] view whose rows put a's bits 0-2, then a // 16, lowest: Triton's gather layout
    for it (4 lanes along q, 8 along those row bits, warps next) is the accumulator layout."""
    q = tl.arange(0, 4)
    idx = tl.broadcast_to(((q[None, :] + d[:, None]) % 4)[:, None, :], [BM, NG, 4])
    f2 = tl.reshape(tl.permute(tl.reshape(f, [BM // 16, 2, 8, NG, 4]), (3, 1, 0, 2, 4)),
                    [BM * NG, 4])
    i2 = tl.reshape(tl.permute(tl.reshape(idx, [BM // 16, 2, 8, NG, 4]), (3, 1, 0, 2, 4)),
                    [BM * NG, 4])
    g2 = tl.gather(f2, i2, 1)
    return tl.reshape(tl.permute(tl.reshape(g2, [NG, 2, BM // 16, 8, 4]), (2, 1, 3, 0, 4)),
                      [BM, NG, 4])


@triton.jit
def rotate_rows(m, sh, BM: tl.constexpr, BN: tl.constexpr):
    """out[a, c] = m[a, (c + sh[a]) % BN] for m [BM, BN] (BM >= 16, BN >= 8, powers of two) and
    0 <= sh < BN. Exact (pure data movement) in any dtype."""
    NG: tl.constexpr = BN // 8
    y = tl.reshape(m, [BM, NG, 8])
    s_hi = sh // 8
    for i in tl.static_range(5):  # groups of 8 columns, one barrel stage per bit of s_hi
        if (1 << i) < NG:
            y = tl.where(((s_hi & (1 << i)) != 0)[:, None, None],
                         _roll_groups(y, 1 << i, BM, NG, 8), y)
    # the rest, s_lo = 2 s1 + s0 < 8: output column (g, q, b0) reads (g, q, b0) + s_lo, i.e.
    # b0' = b0 ^ s0 and q' = q + s1 (+ 1 when b0 = s0 = 1), carrying into group g + 1
    y0, y1 = tl.split(tl.reshape(y, [BM, NG, 4, 2]))
    odd = ((sh & 1) != 0)[:, None, None]
    e0 = tl.where(odd, y1, y0)
    e1 = tl.where(odd, y0, y1)
    d0 = (sh // 2) % 4
    d1 = d0 + (sh & 1)  # <= 4
    q = tl.arange(0, 4)[None, None, :]
    # a source lane q' < d is read by an output in the previous group: pre-select group g + 1
    f0 = tl.where(q < d0[:, None, None], _roll_groups(e0, 1, BM, NG, 4), e0)
    f1 = tl.where(q < d1[:, None, None], _roll_groups(e1, 1, BM, NG, 4), e1)
    return tl.reshape(tl.join(_rotate_lanes(f0, d0, BM, NG), _rotate_lanes(f1, d1, BM, NG)),
                      [BM, BN])


# ---- attention dropout: a counter-based keep-mask (Philox), a function of (b, h, i, j) only
#
# One Philox-4x32-10 call serves 16 elements, 8 bits each (FlashAttention-2's budget): the rows
# i = 16 x + 8 t + y (t in {0, 1}, y < 8) and keys j = 32 h + 16 u + 8 g + 2 q + e (u, g, e in
# {0, 1}, q < 4) take byte 2 g + e of word 2 t + u of the call at the 128-bit counter
# (4 h + q, pair mod 2^32, offset mod 2^32, (offset >> 32) + (pair >> 32)), pair = (b * H + h)
# * 8 ceil(Lq / 16) + 8 x + y, keyed by the 64-bit seed. The call's 16 elements, rows
# {16 x + y, 16 x + y + 8} by keys 32 h + 2 q + {0, 1, 8, 9, 16, 17, 24, 25}, are ones that one
# thread holds in the sm_90 wgmma accumulator layout (row bits 0-2 and column bits 1-2 are lane
# bits, row bit 3 and the other column bits register bits), so the words reach their scores
# without a layout conversion; the Philox rounds are a sixteenth of a call per element. For
# one (seed, offset) every element has its own (counter, byte), whatever the tiling (split-K,
# block sizes: query and key tiles start at multiples of 16; a 16-key tile takes its half of
# the calls), so the forward and every backward kernel regenerate the same mask.
#
# The drop rate resolves p to 2^-23 with those 128 bits (a dithered threshold): p is rounded to
# theta / 2^23 (``dropout_threshold``: theta = round(p 2^23), at least 1 for p > 0 so every
# p > 0 drops, at most 2^23 - 1), theta = 2^16 T + F. Each byte's low 7 bits are its element's
# value b; the top bits of the call's 16 bytes form one 16-bit number s (bit 7 of byte k of
# word m is bit 4 k + m of s). An element is dropped when b < T + [s < F]: with b uniform on
# [0, 128) and s on [0, 2^16) independent of it, the drop probability is T / 128 + (F / 2^16)
# / 128 = theta / 2^23 exactly, and kept values are scaled by 1 / (1 - theta / 2^23)
# (``dropout_keep_scale``), so E[out] is the undropped output for every p. The shared s makes
# the 16 elements of one call weakly dependent (they see the same threshold, T or T + 1); each
# element's own drop probability is exact, and elements of different calls are independent.
#
# Two forms of the same mask, both from the flag words of ``_keep_flags``: each byte's bit 7
# is (b >= the call's threshold), the four bytes of a word compared at once with an ``and`` and
# an addition. ``dropout_keep`` reads each flag on its own (a shift and a compare per element,
# the mask a predicate per element): the backward kernels and the forward above head dim 128
# use it, whose register budgets it suits best (the other form spills more there), and
# ``dropout_keep_mask``. The forward up to head dim 128 uses ``dropout_flags`` and
# ``dropout_apply``: on the GPU the mask is applied to the rounded P operand with one PTX
# ``prmt`` (each flag's sign spread over its element) and one ``and`` per register (a pair of
# bf16 / fp16 elements), with no per-element compare, predicate or select; its Philox rounds
# use ``mul.wide.u32`` (one instruction for the high and low words of a product). Under the
# interpreter (``ASM`` False) the same functions run as plain tl code (``tl.philox``, a
# select).

# (low, high) of the 64-bit product by the Philox round multipliers, one mul.wide.u32 each
_MUL_ROUND_A = tl.constexpr("{ .reg .b64 p;\nmul.wide.u32 p, $2, 3528531795;\n"
                            "mov.b64 {$0, $1}, p; }")
_MUL_ROUND_B = tl.constexpr("{ .reg .b64 p;\nmul.wide.u32 p, $2, 3449720151;\n"
                            "mov.b64 {$0, $1}, p; }")
_KEY_A = tl.constexpr(0x9E3779B9)
_KEY_B = tl.constexpr(0xBB67AE85)
# a pair of 16-bit elements (x_a low, x_b high) with their flag words and selectors: the
# selector of a's flag byte (sign-replicated) for the low half, b's (bytes 4-7) for the high
# half; ptxas folds the selector arithmetic on the constants S
_APPLY_PAIR_PTX = tl.constexpr(
    "{ .reg .b32 s, t, m;\n"
    "or.b32 t, $5, 0x44;\nshl.b32 t, t, 8;\nor.b32 s, $4, t;\n"
    "prmt.b32 m, $2, $3, s;\nand.b32 $0, $1, m; }")
# one 32-bit element: its flag byte's sign spread over all four bytes
_APPLY_ONE_PTX = tl.constexpr(
    "{ .reg .b32 s, m;\n"
    "shl.b32 s, $3, 8;\nor.b32 s, s, $3;\n"
    "prmt.b32 m, $2, 0, s;\nand.b32 $0, $1, m; }")


# the drop rate's resolution: theta / 2^23 (a 7-bit value per element and a 16-bit dither)
DROPOUT_RESOLUTION = 1 << 23


def dropout_threshold(p: float) -> int:
    """The keep-mask's threshold theta for dropout probability ``p`` in [0, 1): the kernels drop
    with probability ``theta / 2^23`` (``dropout_rate``), theta = round(p 2^23), at least 1
    for any p > 0 (so every p > 0 drops) and at most 2^23 - 1; 0 (nothing dropped) for p = 0.
    The C++ CPU kernel computes the same integer (csrc/rel_attention_cpu.cpp)."""
    if p <= 0.0:
        return 0
    return min(max(int(p * DROPOUT_RESOLUTION + 0.5), 1), DROPOUT_RESOLUTION - 1)


def dropout_rate(p: float) -> float:
    """The probability with which the fused kernels drop an element for ``dropout_p = p``:
    p rounded to a multiple of 2^-23 (``dropout_threshold``), never 0 for p > 0."""
    return dropout_threshold(p) / DROPOUT_RESOLUTION


def dropout_keep_scale(p: float) -> float:
    """The factor of the kept probabilities for ``dropout_p = p``: 1 / (1 - the rate actually
    used, ``dropout_rate(p)``), so that the expected output is the undropped one."""
    return DROPOUT_RESOLUTION / (DROPOUT_RESOLUTION - dropout_threshold(p))


def dropout_args(dropout_p: float, seed, placeholder: torch.Tensor) -> DropoutArgs:
    """The kernels' ``dropout`` argument for ``dropout_p`` (``placeholder`` stands in for the
    seed tensor without dropout: unread, DROPOUT off)."""
    return DropoutArgs(seed if dropout_p > 0.0 else placeholder, dropout_threshold(dropout_p),
                       dropout_keep_scale(dropout_p))


@triton.jit
def load_dropout_seed(SEED):
    """(seed, offset) from the int64 ``[2]`` device tensor (rel_attn_fwd.draw_dropout_seed)."""
    return tl.load(SEED), tl.load(SEED + 1)


@triton.jit
def _mul_wide(a, PTX: tl.constexpr):
    """(low, high) words of the 64-bit product of the uint32 ``a`` and a round multiplier
    (``PTX``: _MUL_ROUND_A / _B): one ``mul.wide.u32`` where ``tl.umulhi`` and ``*`` are two
    multiplies."""
    return tl.inline_asm_elementwise(PTX, "=r,=r,r", [a], (tl.uint32, tl.uint32), is_pure=True,
                                     pack=1)


@triton.jit
def _philox(seed, c0, c1, c2, c3, ASM: tl.constexpr):
    """Philox-4x32-10 of the uint32 counters (c0, c1, c2, c3) (same shape) keyed by the 64-bit
    ``seed``: ``tl.philox`` (ASM False) or the same rounds with ``_mul_wide``."""
    if ASM:
        seed = seed.to(tl.uint64)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        for _ in tl.static_range(10):
            lo_a, hi_a = _mul_wide(c0, _MUL_ROUND_A)
            lo_b, hi_b = _mul_wide(c2, _MUL_ROUND_B)
            c0 = hi_b ^ c1 ^ k0
            c2 = hi_a ^ c3 ^ k1
            c1 = lo_b
            c3 = lo_a
            k0 = tl.add(k0, _KEY_A, sanitize_overflow=False)
            k1 = tl.add(k1, _KEY_B, sanitize_overflow=False)
        return c0, c1, c2, c3
    else:
        return tl.philox(seed, c0, c1, c2, c3)


@triton.jit
def _call_threshold(r0, r1, r2, r3, threshold):
    """Each call's 7-bit threshold t = T + [s < F] (theta = ``threshold`` = 2^16 T + F, s the
    top bits of the call's words r0..r3: bit 7 of byte k of word m is bit 4 k + m of s), as the
    addend 128 - t in each of the four bytes (``_keep_flags``). s is compared in a spread form
    (bit 4 k + m at bit 8 k + 4 + m, zeros between), with F spread the same way: the spreading
    keeps the order. 128 - T per byte is per program (uniform): a compare and a multiply-
    subtract per call."""
    t = tl.to_tensor(threshold).to(tl.uint32)
    f = t & 0xFFFF
    f = ((f & 0xF) << 4) | ((f & 0xF0) << 8) | ((f & 0xF00) << 12) | ((f & 0xF000) << 16)
    keep_t = 0x80808080 - (t >> 16) * 0x01010101  # 128 - T per byte
    s = ((r3 & 0x80808080) | ((r2 >> 1) & 0x40404040) | ((r1 >> 2) & 0x20202020)
         | ((r0 >> 3) & 0x10101010))
    return keep_t - (s < f).to(tl.uint32) * 0x01010101


@triton.jit
def _keep_flags(w, c):
    """Bit 7 of each byte of the uint32 words ``w``: that byte's low 7 bits >= its call's
    threshold t (0..128), given as the addend ``c`` = 128 - t in each byte
    (``_call_threshold``), the four bytes compared at once: each byte of
    ``(w & 0x7F7F7F7F) + c`` is its low 7 bits + 128 - t <= 255, so the sum cannot carry into
    the next byte and has bit 7 set exactly when the low 7 bits are >= t."""
    return (w & 0x7F7F7F7F) + c


@triton.jit
def _dropout_words(seed, offset, bh, i0, j0, Lq, threshold, BM: tl.constexpr,
                   BN: tl.constexpr, ASM: tl.constexpr):
    """The keep-flag words (``_keep_flags``) of (batch * H + head) ``bh``, query rows
    i0 + [0, BM) and keys j0 + [0, BN) (BM and BN powers of two >= 16, i0 a multiple of 16, j0
    of min(BN, 32)), ``threshold`` = ``dropout_threshold(p)``: [BM / 16, y, BN / 32, q, u, t]
    (a 16-key tile: [BM / 16, y, 1, q, t])."""
    tl.static_assert(BM >= 16 and BN >= 16, "dropout: tiles of at least 16 x 16")
    NX: tl.constexpr = BM // 16
    NH: tl.constexpr = (BN + 31) // 32
    # row pairs (x, y): rows 16 x + y and 16 x + y + 8, numbered 8 x + y per (batch, head)
    pair = (bh.to(tl.int64) * ((Lq + 15) // 16) * 8 + (i0 // 16) * 8
            + (tl.arange(0, NX) * 8)[:, None] + tl.arange(0, 8)[None, :])
    c1 = pair.to(tl.uint32)[:, :, None, None]
    c3 = ((offset >> 32) + (pair >> 32)).to(tl.uint32)[:, :, None, None]
    # call (h, q) serves the keys 32 h + 2 q + {0, 1, 8, 9, 16, 17, 24, 25}
    c0 = (((j0 // 32) + tl.arange(0, NH)) * 4)[:, None] + tl.arange(0, 4)[None, :]
    c0 = c0.to(tl.uint32)[None, None, :, :]
    zero = c0 * c1 * 0  # [NX, 8, NH, 4]
    r0, r1, r2, r3 = _philox(seed, c0 + zero, c1 + zero, offset.to(tl.uint32) + zero,
                             c3 + zero, ASM)
    c = _call_threshold(r0, r1, r2, r3, threshold)  # the whole call's, before a half is taken
    if BN >= 32:
        w = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [NX, y, NH, q, u, t]
        c = c[:, :, :, :, None, None]
    else:  # a 16-key tile: the words of its half u of the calls
        odd = (j0 // 16) % 2 == 1
        w = tl.join(tl.where(odd, r1, r0), tl.where(odd, r3, r2))  # [NX, y, 1, q, t]
        c = c[:, :, :, :, None]
    return _keep_flags(w, c)


@triton.jit
def _to_tile(r, BM: tl.constexpr, BN: tl.constexpr):
    """[..., e, g] per word of ``_dropout_words`` (byte 2 g + e) -> the [BM, BN] tile."""
    if BN >= 32:  # [NX, y, NH, q, u, t, e, g] -> rows (NX, t, y), keys (NH, u, g, q, e)
        r = tl.reshape(tl.permute(r, (0, 5, 1, 2, 4, 7, 3, 6)), [BM, BN])
    else:  # [NX, y, 1, q, t, e, g] -> rows (NX, t, y), keys (1, g, q, e)
        r = tl.reshape(tl.permute(r, (0, 4, 1, 2, 6, 3, 5)), [BM, BN])
    return r


@triton.jit
def dropout_keep(seed, offset, bh, i0, j0, Lq, threshold, BM: tl.constexpr,
                 BN: tl.constexpr):
    """Keep-mask [BM, BN] of (batch * H + head) ``bh``, query rows i0 + [0, BM) and keys
    j0 + [0, BN) (see ``_dropout_words``): each element's flag read on its own, ``tl.philox``
    (the backward kernels, whose register budget this form suits, and
    ``dropout_keep_mask``)."""
    f = _dropout_words(seed, offset, bh, i0, j0, Lq, threshold, BM, BN, False)
    # flag 2 g + e of each word at bit 31 (a sign test then reads that flag alone)
    r = _to_tile(tl.join(tl.join(f << 24, f << 16), tl.join(f << 8, f)), BM, BN)
    return r.to(tl.int32, bitcast=True) < 0


@triton.jit
def dropout_flags(seed, offset, bh, i0, j0, Lq, threshold, BM: tl.constexpr, BN: tl.constexpr,
                  ASM: tl.constexpr = not INTERPRET):
    """``dropout_keep``'s mask as two uint32 [BM, BN] tensors for ``dropout_apply`` /
    ``flags_keep``: each element's flag word (bit 8 k + 7 = element k of its word kept,
    ``_keep_flags``) and its selector (8 + k) * 0x11, k its byte (a constant per register: no
    instruction)."""
    f = _dropout_words(seed, offset, bh, i0, j0, Lq, threshold, BM, BN, ASM)
    z = f * 0
    f = _to_tile(tl.join(tl.join(f, f), tl.join(f, f)), BM, BN)
    s = _to_tile(tl.join(tl.join(z + 0x88, z + 0x99), tl.join(z + 0xAA, z + 0xBB)), BM, BN)
    return f, s


@triton.jit
def flags_keep(flags, sel):
    """The boolean keep-mask of ``dropout_flags``' (flags, selectors)."""
    return ((flags >> ((sel & 3) * 8 + 7)) & 1) != 0


@triton.jit
def dropout_apply(x, flags, sel, ASM: tl.constexpr = not INTERPRET):
    """``x`` (fp32, fp16 or bf16, the shape of ``dropout_flags``' tensors) with its dropped
    elements set to +0: in PTX a ``prmt`` (the flag spread over the element's bits, a pair of
    16-bit elements at once) and an ``and`` per register; a select under the interpreter."""
    if ASM:
        if x.dtype.primitive_bitwidth == 16:
            y = tl.inline_asm_elementwise(_APPLY_PAIR_PTX, "=r,r,r,r,r,r",
                                          [x.to(tl.uint16, bitcast=True), flags, sel],
                                          tl.uint16, is_pure=True, pack=2)
        else:
            y = tl.inline_asm_elementwise(_APPLY_ONE_PTX, "=r,r,r,r",
                                          [x.to(tl.uint32, bitcast=True), flags, sel],
                                          tl.uint32, is_pure=True, pack=1)
        y = y.to(x.dtype, bitcast=True)
    else:
        y = tl.where(flags_keep(flags, sel), x, 0.0).to(x.dtype)
    return y


# ---- the (seed, offset) state, and the keep-mask for testing (re-exported by rel_attn_fwd)

def dropout_keep_mask(seed: torch.Tensor, B: int, H: int, Lq: int, Lk: int,
                      dropout_p: float) -> torch.Tensor:
    """The keep-mask ``[B, H, Lq, Lk]`` (bool, True = kept) that the fused kernels use for the
    (seed, offset) tensor ``seed`` (int64 ``[2]``, ``draw_dropout_seed``) and probability
    ``dropout_p``: computed by the kernels' own jit helper (``dropout_keep``), on its own tiles,
    since the mask is a function of (b, h, i, j) and the seed alone. Debug / testing entry
    point (like flash-attention's ``return_attn_probs``): it materialises Lq x Lk."""
    return dropout_keep_block(seed, B, H, Lq, Lk, dropout_p, rows=(0, Lq), cols=(0, Lk))


@triton.jit
def _dropout_block_kernel(SEED, Keep, H, Lq, I0, J0, A, Bk, drop_thresh,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # tiles of the global mask that start at multiples of BLOCK_M / BLOCK_N (as the kernels'
    # tiles do) and cover rows [I0, I0 + A), keys [J0, J0 + Bk); only those are stored
    pid_bh = tl.program_id(0)
    i0 = (I0 // BLOCK_M + tl.program_id(1)) * BLOCK_M
    j0 = (J0 // BLOCK_N + tl.program_id(2)) * BLOCK_N
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_n = j0 + tl.arange(0, BLOCK_N)
    seed, off = load_dropout_seed(SEED)
    keep = dropout_keep(seed, off, pid_bh, i0, j0, Lq, drop_thresh, BLOCK_M, BLOCK_N)
    li = offs_m - I0
    lj = offs_n - J0
    ptrs = (Keep + pid_bh.to(tl.int64) * A * Bk + li.to(tl.int64)[:, None] * Bk + lj[None, :])
    tl.store(ptrs, keep.to(tl.int8),
             mask=((li >= 0) & (li < A))[:, None] & ((lj >= 0) & (lj < Bk))[None, :])


def dropout_keep_block(seed: torch.Tensor, B: int, H: int, Lq: int, Lk: int, dropout_p: float,
                       rows: tuple, cols: tuple) -> torch.Tensor:
    """The block ``[B, H, A, Bk]`` of ``dropout_keep_mask(seed, B, H, Lq, Lk, dropout_p)`` at
    query rows ``rows = (i0, A)`` and keys ``cols = (j0, Bk)`` (global indices), computed by
    the kernels' jit helper on the global mask's own tiles (starting at multiples of 64) and
    storing only the requested part: a context-parallel rank regenerates its block pair's
    share of the one-process mask without materialising ``Lq x Lk``."""
    (i0, A), (j0, Bk) = rows, cols
    for nm, (o, n), total in (("rows", rows, Lq), ("cols", cols, Lk)):
        if not (0 <= o and n >= 0 and o + n <= total):
            raise ValueError(f"dropout_keep_block: {nm} must be (start, length) inside "
                             f"[0, {total}), got {(o, n)}")
    keep = torch.empty((B, H, A, Bk), dtype=torch.int8, device=seed.device)
    if keep.numel() == 0:
        return keep.bool()
    bm = bn = 64
    grid = (B * H, (i0 + A - 1) // bm - i0 // bm + 1, (j0 + Bk - 1) // bn - j0 // bn + 1)
    with torch.cuda.device(seed.device) if seed.device.type == "cuda" else nullcontext():
        _dropout_block_kernel[grid](seed, keep, H, Lq, i0, j0, A, Bk,
                                    dropout_threshold(dropout_p), BLOCK_M=bm, BLOCK_N=bn)
    return keep.bool()


def descriptors_ok(*ts: torch.Tensor) -> bool:
    """Tiles load through TMA descriptors (made in the kernel: the forward's K / V / R, the
    backward's K / V / R and query-side operands) when the device has TMA (sm_90 and newer;
    the interpreter emulates it; ``_arch.config_family``) and every base address and row
    stride is 16-byte aligned, as TMA requires; otherwise through pointers."""
    if not config_family(ts[0].device)[1]:
        return False
    return all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0
                                             for st in t.stride()[:-1]) for t in ts)


def _scratch(size: int, alignment: int, stream):
    """Triton's global scratch (the kernel writes its TMA descriptors there)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Kernels that make TMA descriptors need Triton's global-scratch allocator: set one that
    allocates through torch (CUDA graph and caching-allocator aware), unless the caller has
    set their own."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        if not isinstance(_allocator.get(), NullAllocator):
            return
    except ImportError:  # other Triton versions: set ours
        pass
    triton.set_allocator(_scratch)
