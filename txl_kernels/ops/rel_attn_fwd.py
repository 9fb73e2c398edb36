"""Fused Transformer-XL relative attention, forward (Triton): ``rel_attn_fwd``.

Contract. Per batch b and head h, with the row constant c = Lq - 1 + s (s = ``r_shift1 - 1``,
the shift of r's rows against the default table: 0 for it, ``r_first_distance - (Lk - 1)``
when r's row 0 holds that distance; rows outside [0, R) read as 0):
``S[i, j] = scale * ((q_i + u) . k_j + (q_i + vb) . r[j - i + c])``, ``out = softmax(S) v`` over
the allowed pairs. q ``[B, Lq, H, D]``, k / v ``[B, Lk, H, D]`` (Lk >= Lq), r ``[R, H, D]``,
u / vb ``[H, D]``, one dtype among fp16 / bf16 / fp32, head dim 16..256. Any strides with
``stride(-1) == 1`` (other tensors are copied first); all offsets int64. Masks: the window
``(window_left, window_right)`` bottom-right aligned (causal is window_right = 0), bool
key_padding_mask ``[B, Lk]`` and attn_mask broadcastable to ``[B, H, Lq, Lk]`` (True = masked,
any strides), or a device-side band. Returns out ``[B, Lq, H, D]`` (q's dtype) and lse
``[B, H, Lq]`` (fp32, natural log). Optional 8-bit memory (``QUANT_MEM``): int8 /
float8_e4m3fn keys / values ``[B, M, H, D]`` with scales ``[B, M, H]`` (fp32 / fp16) in front of
k / v (``Lk = M + Lc`` everywhere above), loaded in 8 bits and dequantised in registers by the
``txl_kernels.quant`` contract (fp32 product rounded to the compute dtype); forward only.

Invariants. No Lq x Lk tensor in global memory; fp32 accumulation; q + u and q + vb summed in
fp32 and rounded once (the backward relies on the same rounding); rows with no allowed key give
out 0 and lse = +inf; what a mask excludes never reaches a result, NaN / inf included
(``masked_value_operands``); r rows outside [0, R) are never read; BLOCK_M <= 2 BLOCK_N.
Arguments are validated by ``rel_attention``; the launcher only asserts.

Derivations: docs/DESIGN.md, sections "The skew" (window chunks, ``_common.rotate_rows``),
"Window reuse", "Masking and tile skipping" (mask-free interior tiles), "Split-K (forward)",
"Forward: tiles, online softmax" (the 8-bit memory),
"Precision" and "Limits and resources".
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .._arch import config_family
from .._utils import describe
from ..quant import QuantizedKV, dequantize_per_token
from ..reference import finite_or_zero, row_poison
from ._common import (INTERPRET, LOG2E, BiasStrides, HeadStrides, MaskArgs,
                      Pattern, RowStrides, WorkStrides,
                      apply_mask_band, autotune_enabled, bias_strides, descriptors_ok,
                      dot_precision, draw_dropout_seed, dropout_apply, dropout_args,
                      dropout_flags, dropout_keep, dropout_keep_mask, dropout_keep_scale,
                      dropout_rate, ensure_scratch_allocator, excludes_pairs, head_strides,
                      interior_tiles, key_range, last_dim_contiguous, length_bucket,
                      load_bias_operands, load_dequant, load_dropout_seed, mask_args,
                      memory_bases, memory_launch_args, operand_workspace, pair_mask,
                      rotate_rows, round_bf16, row_strides, store_bias_operands, tile_run,
                      to_operand, variant_flags)

__all__ = ["rel_attn_fwd", "choose_num_splits", "autotune_enabled", "draw_dropout_seed",
           "dropout_keep_mask", "dropout_rate", "dropout_keep_scale"]

# Fixed small config under the interpreter: 16 x 16 tiles, so that odd lengths span several
# tiles and every loop / mask path runs on tiny shapes.
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


@triton.jit
def _window_chunk(qv, rel, row0, offs_n0, d_ok, EVEN_D: tl.constexpr, UPCAST: tl.constexpr,
                  DOT_PREC: tl.constexpr, USE_DESC: tl.constexpr):
    """T_c = qv @ r[row0 : row0 + BLOCK_N]^T ([BM, BN], fp32); rows outside [0, R) read as 0.
    ``rel`` (``_program_setup``'s ``_Rel``)."""
    if USE_DESC:  # rows outside [0, R) and columns >= D arrive as zeros
        rc = rel.base.load([row0, 0])
    else:
        offs_p = row0 + offs_n0
        p_ok = (offs_p >= 0) & (offs_p < rel.rows)
        if EVEN_D:
            msk = p_ok[:, None]
        else:
            msk = p_ok[:, None] & d_ok[None, :]
        rc = tl.load(rel.base + row0.to(tl.int64) * rel.stride + rel.offsets, mask=msk,
                     other=0.0)
    if UPCAST:
        rc = rc.to(tl.float32)
    return tl.dot(qv, tl.trans(rc), input_precision=DOT_PREC)


@triton.jit
def _load_kv(src, j0, n_ok, d_ok, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
             USE_DESC: tl.constexpr):
    """A [BN, BLOCK_D] key / value tile from row j0 of ``src`` (``_Rows``): masked only where
    it can leave the tensor (a descriptor zero-fills by itself)."""
    if USE_DESC:
        x = src.base.load([j0, 0])
    else:
        ptrs = src.base + j0.to(tl.int64) * src.stride + src.offsets
        if MASKED:
            if EVEN_D:
                x = tl.load(ptrs, mask=n_ok[:, None], other=0.0)
            else:
                x = tl.load(ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return x


@triton.jit
def _mem_rows(qsrc, j0, offs_n, in_mem, mm, OUT_TY: tl.constexpr, UPCAST: tl.constexpr):
    """Rows j0.. of the 8-bit memory source ``qsrc`` (``memory_bases``' ``QuantRows``),
    dequantised."""
    return load_dequant(qsrc.data + j0.to(tl.int64) * qsrc.data_stride + qsrc.offsets,
                        qsrc.scale + offs_n.to(tl.int64) * qsrc.scale_stride, in_mem, mm,
                        OUT_TY, UPCAST)


@triton.jit
def _cur_rows(src, j0, M, cm, OUT_TY: tl.constexpr):
    """Rows j0 - M.. of the current segment's source ``src`` (``_Rows``)."""
    return tl.load(src.base + (j0 - M).to(tl.int64) * src.stride + src.offsets, mask=cm,
                   other=0.0).to(OUT_TY)


@triton.jit
def _load_kv_mem(qsrc, src, j0, M, offs_n, n_ok, d_ok, EVEN_D: tl.constexpr,
                 UPCAST: tl.constexpr, mem_ok=None):
    """QUANT_MEM: the [BN, BLOCK_D] key / value tile of rows j0.. of [memory; current]: rows
    j < M are the 8-bit memory's, dequantised in registers (``load_dequant``), rows
    j >= M the current segment's row j - M (compute dtype). A tile across j = M
    takes two masked loads, merged by row. 16-bit compute: one branch per case (tile in the
    memory / in the current rows / across), so that only the tile across holds both loads
    (sm_90, bf16 / fp16 D 64: no spills, against 100-150 B with both loads on every tile);
    fp32: one path for all tiles (with the branches, ptxas gave the exact-fp32 config a
    4.4 KB stack frame, against 0.7 KB). ``mem_ok``: the memory rows to load (default: all;
    the others come back 0)."""
    in_mem = offs_n < M
    cur = n_ok & (offs_n >= M)
    if mem_ok is None:
        mem_ok = in_mem
    if EVEN_D:
        mm = mem_ok[:, None]
        cm = cur[:, None]
    else:
        mm = mem_ok[:, None] & d_ok[None, :]
        cm = cur[:, None] & d_ok[None, :]
    X_ELT: tl.constexpr = src.base.dtype.element_ty
    OUT_TY: tl.constexpr = tl.float32 if UPCAST else X_ELT
    BN: tl.constexpr = offs_n.shape[0]
    if X_ELT == tl.float32:
        x = tl.where(in_mem[:, None], _mem_rows(qsrc, j0, offs_n, mem_ok, mm, OUT_TY, UPCAST),
                     _cur_rows(src, j0, M, cm, OUT_TY))
    elif j0 + BN <= M:
        x = _mem_rows(qsrc, j0, offs_n, mem_ok, mm, OUT_TY, UPCAST)
    elif j0 >= M:
        x = _cur_rows(src, j0, M, cm, OUT_TY)
    else:
        x = tl.where(in_mem[:, None], _mem_rows(qsrc, j0, offs_n, mem_ok, mm, OUT_TY, UPCAST),
                     _cur_rows(src, j0, M, cm, OUT_TY))
    return x


@triton.jit
def _key_value_tile(src, qsrc, j0, M, offs_n, n_ok, d_ok, MASKED: tl.constexpr,
                    EVEN_D: tl.constexpr, UPCAST: tl.constexpr, USE_DESC: tl.constexpr,
                    QUANT_MEM: tl.constexpr):
    """The key (or value) tile of rows j0.. as a dot operand: ``_load_kv`` from ``src``, or
    with an 8-bit memory ``_load_kv_mem`` from ``qsrc`` and ``src``; fp32 under UPCAST (the
    interpreter's bf16)."""
    if QUANT_MEM:
        x = _load_kv_mem(qsrc, src, j0, M, offs_n, n_ok, d_ok, EVEN_D, UPCAST)
    else:
        x = _load_kv(src, j0, n_ok, d_ok, MASKED, EVEN_D, USE_DESC)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _window_bd(t0, t1, qv, rel, tile, j0, Lq, EVEN_D: tl.constexpr, UPCAST: tl.constexpr,
               DOT_PREC: tl.constexpr, USE_DESC: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """BD of key tile j0 (``_QueryTile`` ``tile``), and the window carried to the next tile:
    (bd, t0, t1). One new window chunk per key tile (rotated by tile.rot once, here), the
    others carried over from the last tile already rotated; then one merge."""
    base = j0 - tile.i0 - (BLOCK_M - 1) + Lq - 1 + (rel.shift1 - 1)  # (rel_attn_bwd._ROW_SHIFT)
    take_first, first_is_0 = tile.take_first, tile.first_is_0
    if BLOCK_M > BLOCK_N:
        t2 = rotate_rows(_window_chunk(qv, rel, base + 2 * BLOCK_N, tile.offs_n0, tile.d_ok,
                                       EVEN_D, UPCAST, DOT_PREC, USE_DESC), tile.rot, BLOCK_M,
                         BLOCK_N)
        bd = tl.where(take_first, tl.where(first_is_0, t0, t1), tl.where(first_is_0, t1, t2))
        t0 = t1
        t1 = t2
    else:
        tn = rotate_rows(_window_chunk(qv, rel, base + BLOCK_N, tile.offs_n0, tile.d_ok, EVEN_D,
                                       UPCAST, DOT_PREC, USE_DESC), tile.rot, BLOCK_M, BLOCK_N)
        bd = tl.where(take_first, t0, tn)
        t0 = tn
    return bd, t0, t1


@triton.jit
def _masked_scores(s, KEY_BIAS, offs_m, j0, offs_n, n_ok, pattern, HAS_WL: tl.constexpr,
                   HAS_WR: tl.constexpr, HAS_KPM: tl.constexpr, HAS_MASK: tl.constexpr,
                   HAS_BAND: tl.constexpr, MASKED: tl.constexpr, POISON: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """The scores s of key tile j0 with the masked pairs at -inf (MASKED), and the tile's key
    bias (POISON; 0 otherwise): (s, kb). With any mask (POISON) the key bias
    (``masked_value_operands``, this (batch, head)'s row ``KEY_BIAS``) takes the key padding's
    place: -inf on padded keys, NaN on the allowed pairs of a key whose value row is not
    finite (V's tile holds it as 0, a non-finite K / r row already scores NaN), 0 elsewhere."""
    kb = 0.0
    if MASKED and POISON:
        kb = tl.load(KEY_BIAS + offs_n, mask=n_ok, other=float("-inf"))
        ok = pair_mask(offs_m, j0, BLOCK_N, pattern, HAS_WL, HAS_WR, False, HAS_MASK, HAS_BAND)
        if HAS_KPM:
            ok = ok & (kb != float("-inf"))[None, :]
        s = tl.where(ok, s + kb[None, :], float("-inf"))
    elif MASKED:
        s = tl.where(pair_mask(offs_m, j0, BLOCK_N, pattern, HAS_WL, HAS_WR, HAS_KPM, HAS_MASK,
                               HAS_BAND), s, float("-inf"))
    return s, kb


@triton.jit
def _attend_tile(acc, m_i, l_i, t0, t1, t, qu, qv, tile, kv, rel, pattern, drop,
                 HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_KPM: tl.constexpr,
                 HAS_MASK: tl.constexpr, HAS_BAND: tl.constexpr, MASKED: tl.constexpr,
                 EVEN_D: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                 USE_DESC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DROPOUT: tl.constexpr, QUANT_MEM: tl.constexpr):
    """One key tile [t * BN, t * BN + BN) of the online softmax: (acc, m_i, l_i, t0, t1) ->
    the same after it. ``tile``: the query tile's loop invariants (``_QueryTile``); ``kv``,
    ``rel``, ``pattern``: ``_program_setup``'s; ``drop``: a ``_Drop``. MASKED = False: an
    interior tile (every pair allowed, every key < Lk, no padding / dense mask): no mask work
    at all. DROPOUT: P is dropped after the normaliser l_i took it (the 1 / (1 - p) rescale
    is applied to the output once, by the caller). QUANT_MEM: keys / values from
    ``_load_kv_mem``. With any mask (POISON) the masked tiles add the key bias of
    ``masked_value_operands`` (row ``kv.key_bias``) to the allowed pairs' scores in place of
    the key padding mask, and load the 8-bit memory's rows of a NaN bias as 0."""
    i0, offs_m, offs_n0, d_ok = tile.i0, tile.offs_m, tile.offs_n0, tile.d_ok
    M = kv.M
    POISON: tl.constexpr = HAS_WL or HAS_WR or HAS_KPM or HAS_MASK or HAS_BAND  # (any mask)
    Lq = pattern.Lq
    Lk = pattern.Lk
    j0 = t * BLOCK_N
    offs_n = j0 + offs_n0
    n_ok = offs_n < Lk
    bd, t0, t1 = _window_bd(t0, t1, qv, rel, tile, j0, Lq, EVEN_D, UPCAST, DOT_PREC, USE_DESC,
                            BLOCK_M, BLOCK_N)
    k = _key_value_tile(kv.k, kv.kq, j0, M, offs_n, n_ok, d_ok, MASKED, EVEN_D, UPCAST,
                        USE_DESC, QUANT_MEM)
    # AC + BD (Triton folds the add into the wgmma's accumulator); scale * log2(e) is applied
    # in the exponent's FMA below
    s = tl.dot(qu, tl.trans(k), input_precision=DOT_PREC) + bd
    s, kb = _masked_scores(s, kv.key_bias, offs_m, j0, offs_n, n_ok, pattern, HAS_WL, HAS_WR,
                           HAS_KPM, HAS_MASK, HAS_BAND, MASKED, POISON, BLOCK_N)

    # ---- online softmax (log2 domain)
    qk_scale = tile.qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:  # every row has a finite score here
        m_safe = m_new
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # dropout: head dims <= 128 take the word-at-a-time mask on the rounded operand (a pair of
    # 16-bit values per mask instruction), applied before V's tile is loaded (loaded first, it
    # stays live across the mask: sm_90's D 128 tile spills 8 B); D 256 the per-byte compare,
    # which spills less in its register budget
    WORD_MASK: tl.constexpr = DROPOUT and acc.shape[1] <= 128
    if DROPOUT and not WORD_MASK:
        p = tl.where(dropout_keep(drop.seed, drop.offset, drop.bh, i0, j0, Lq, drop.threshold,
                                  BLOCK_M, BLOCK_N), p, 0.0)
    if WORD_MASK:
        flags, sel = dropout_flags(drop.seed, drop.offset, drop.bh, i0, j0, Lq, drop.threshold,
                                   BLOCK_M, BLOCK_N)
        pv = dropout_apply(to_operand(p, qu.dtype, UPCAST), flags, sel)
    if QUANT_MEM and MASKED and POISON:
        # the memory's rows of a NaN key bias as 0 (the launcher zeroed v's, not the memory's:
        # the kernel reads it in place)
        v = _load_kv_mem(kv.vq, kv.v, j0, M, offs_n, n_ok, d_ok, EVEN_D, UPCAST,
                         (offs_n < M) & (kb == 0.0))
        if UPCAST:
            v = v.to(tl.float32)
    else:
        v = _key_value_tile(kv.v, kv.vq, j0, M, offs_n, n_ok, d_ok, MASKED, EVEN_D,
                            UPCAST, USE_DESC, QUANT_MEM)
    if not WORD_MASK:  # (rounded after V's load: before it, sm_100's 8-bit memory spills)
        pv = to_operand(p, v.dtype, UPCAST)
    if acc.shape[1] <= 64:
        # P @ V in a fresh accumulator: with acc * alpha as the wgmma's accumulator input,
        # ptxas serialises every wgmma of the kernel (C7515)
        acc = tl.fma(acc, alpha[:, None], tl.dot(pv, v, input_precision=DOT_PREC))
    else:  # (head dims > 64: a second fp32 [BM, BLOCK_D] tile live spills more than it saves)
        acc = tl.dot(pv, v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i, t0, t1


@triton.jit
def _store_rows(Out, Lse, o, m2, den, b, h, pid_bh, offs_m, offs_d, m_ok, d_ok, Lq, stride_o,
                UPCAST: tl.constexpr):
    """The final rows of a query tile: out = o (normalised), and lse = (m2 + log2 den) ln 2
    (natural log; m2 the row max in log2 units), +inf for rows with no allowed key (den 0).
    stride_o: Out's ``RowStrides``."""
    if UPCAST:
        o = round_bf16(o)
    o_ptrs = (Out + b * stride_o.batch + h * stride_o.head
              + offs_m.to(tl.int64)[:, None] * stride_o.row + offs_d[None, :])
    tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    has_key = den != 0.0  # (den >= 0; NaN, from a non-finite allowed pair, keeps lse NaN)
    lse = tl.where(has_key, (m2 + tl.math.log2(tl.where(has_key, den, 1.0)))
                   * 0.6931471805599453, float("inf"))
    tl.store(Lse + pid_bh.to(tl.int64) * Lq + offs_m, lse, mask=m_ok)


@triton.jit
def _operand_tile(W, pid_bh, stride_w, i0, Lq, D, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Rows i0.. of one ``_rel_attn_fwd_operands_kernel`` workspace for this (batch, head),
    through a TMA descriptor (rows past Lq and columns past D read as 0)."""
    W_bh = tl.make_tensor_descriptor(W + pid_bh.to(tl.int64) * stride_w.bh, shape=[Lq, D],
                                     strides=[stride_w.row, 1], block_shape=[BLOCK_M, BLOCK_D])
    return W_bh.load([i0, 0])


@triton.jit
def _rel_attn_fwd_operands_kernel(Q, U, VB, A_OP, QV_OP, stride_q, stride_bias, stride_w, H,
                                  Lq, D, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_D: tl.constexpr):
    """(q + u) and (q + vb) for the forward's OP_TILES launches, rounded once
    (``_common.store_bias_operands``), into [B * H, Lq, D] workspaces: one program per
    (batch * head, BLOCK_M rows)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    store_bias_operands(Q + b * stride_q.batch + h * stride_q.head, U + h * stride_bias.u,
                        VB + h * stride_bias.vb, A_OP + pid_bh * stride_w.bh,
                        QV_OP + pid_bh * stride_w.bh, offs_m.to(tl.int64)[:, None], offs_d,
                        d_ok, (offs_m < Lq)[:, None] & d_ok[None, :], stride_q.row,
                        stride_w.row, UPCAST)


# The forward kernel's inputs, in the backward kernels' layout: the pointers, their strides as
# one ``FwdStrides`` ``strides``, the sizes, the masks as ``FwdMaskArgs`` ``masks``, the
# dropout as ``_common.DropoutArgs`` ``dropout`` and the 8-bit memory as ``_common.MemoryArgs``
# ``memory``; _program_setup turns them into per-(batch, head) NamedTuples (``_Rows``,
# ``_KeyValues``, ``_Rel``, ``_common.Pattern``) that the tile helpers read by field name.
# LQ_BUCKET / LK_BUCKET are autotune keys only.

class FwdStrides(NamedTuple):
    """The forward kernel's ``strides``: q's, k's, v's and out's ``RowStrides``, r's
    ``HeadStrides`` and the biases' ``BiasStrides``."""
    q: RowStrides
    k: RowStrides
    v: RowStrides
    r: HeadStrides
    bias: BiasStrides
    out: RowStrides


# The forward kernel's ``masks``: ``_common.MaskArgs``' fields, then ``masked_value_operands``'
# key bias and key count (read when any mask is on).
FwdMaskArgs = NamedTuple("FwdMaskArgs", [*MaskArgs.__annotations__.items(),
                                         ("key_bias", torch.Tensor),
                                         ("key_count", torch.Tensor)])


class FwdOperands(NamedTuple):
    """The forward kernel's ``operands``: the biases, and with OP_TILES the
    ``_rel_attn_fwd_operands_kernel`` workspaces of (q + u) and (q + vb) with their
    ``WorkStrides``."""
    u: torch.Tensor
    vb: torch.Tensor
    a_op: torch.Tensor
    qv_op: torch.Tensor
    stride_w: WorkStrides


class _Rows(NamedTuple):
    """A key / value source of one (batch, head): base pointer (or TMA descriptor), the int32
    offsets of a tile's rows offs_n0, the row stride."""
    base: object
    offsets: object
    stride: object


class _KeyValues(NamedTuple):
    """What ``_key_value_tile`` reads (``_program_setup``): the K / V ``_Rows``, the 8-bit
    memory's ``QuantRows``, its rows ``M``, and this (batch, head)'s key bias row."""
    k: _Rows
    v: _Rows
    kq: object
    vq: object
    M: object
    key_bias: object


class _Rel(NamedTuple):
    """What ``_window_chunk`` reads (``_program_setup``): this head's r (pointer or
    descriptor), the int32 offsets of rows offs_n0, r's row stride, its rows R and
    ``shift1`` (the pair (i, j) reads row j - i + Lq - 1 + (shift1 - 1), see
    rel_attn_bwd._ROW_SHIFT)."""
    base: object
    offsets: object
    stride: object
    rows: object
    shift1: object


class _QueryTile(NamedTuple):
    """A query tile's loop invariants (``_attend_tile``): its first row, rows, the key
    offsets of a tile, the columns in range, the skew's per-row rotation and merge selectors
    (see the kernel), and scale * log2(e)."""
    i0: object
    offs_m: object
    offs_n0: object
    d_ok: object
    rot: object
    take_first: object
    first_is_0: object
    qk_scale: object


class _Drop(NamedTuple):
    """The dropout state of a program (``_attend_tile``): batch * head, the (seed, offset)
    pair loaded from the seed tensor, the keep-mask's threshold."""
    bh: object
    seed: object
    offset: object
    threshold: object


@triton.jit
def _program_setup(K, V, R, strides, masks, memory, H, Lq, Lk, R_rows, r_shift1, D,
                   HAS_BAND: tl.constexpr, USE_DESC: tl.constexpr, QUANT_MEM: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Every forward program's prologue: its batch and head (grid axis 0 is batch * head),
    the window narrowed by a mask band (band_on: the band replaces the dense mask, nothing to
    load) and the per-(batch, head) base pointers, computed once; with USE_DESC the
    [BLOCK_N, BLOCK_D] tiles of r, and of K / V without an 8-bit memory, come through TMA
    descriptors made here (zero fill past the rows / D: no pointer math, no masks). Returns
    (b, h, window_left, window_right, kv, rel, pattern), the backward's shape: kv
    (``_KeyValues``) what _key_value_tile reads, rel (``_Rel``) what _window_chunk reads,
    pattern (``Pattern``) what ``pair_mask`` masks with."""
    stride_k, stride_v, stride_r = strides.k, strides.v, strides.r
    window_left, window_right = masks.window_left, masks.window_right
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    band_on = 0
    if HAS_BAND:  # the launcher then sets HAS_WL = HAS_WR = True (unbounded = Lk + Lq)
        window_left, window_right, band_on = apply_mask_band(masks.band, window_left,
                                                             window_right)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # base pointers of this (b, h), offset once; tiles add j0 * stride and int32 offsets
    if USE_DESC and not QUANT_MEM:  # TMA: no pointer math, zero fill replaces row / col masks
        K_bh = tl.make_tensor_descriptor(K + b * stride_k.batch + h * stride_k.head,
                                         shape=[Lk, D], strides=[stride_k.row, 1],
                                         block_shape=[BLOCK_N, BLOCK_D])
        V_bh = tl.make_tensor_descriptor(V + b * stride_v.batch + h * stride_v.head,
                                         shape=[Lk, D], strides=[stride_v.row, 1],
                                         block_shape=[BLOCK_N, BLOCK_D])
    else:  # (QUANT_MEM: the current segment's rows, by pointers, and the 8-bit memory's)
        K_bh = K + b * stride_k.batch + h * stride_k.head
        V_bh = V + b * stride_v.batch + h * stride_v.head
    if USE_DESC:
        R_h = tl.make_tensor_descriptor(R + h * stride_r.head, shape=[R_rows, D],
                                        strides=[stride_r.row, 1],
                                        block_shape=[BLOCK_N, BLOCK_D])
    else:
        R_h = R + h * stride_r.head
    kq_src, vq_src, M = memory_bases(memory, b, h, offs_n0, offs_d)
    kv = _KeyValues(k=_Rows(K_bh, offs_n0[:, None] * stride_k.row + offs_d[None, :],
                            stride_k.row),
                    v=_Rows(V_bh, offs_n0[:, None] * stride_v.row + offs_d[None, :],
                            stride_v.row),
                    kq=kq_src, vq=vq_src, M=M,
                    key_bias=masks.key_bias + pid_bh.to(tl.int64) * Lk)
    rel = _Rel(base=R_h, offsets=offs_n0[:, None] * stride_r.row + offs_d[None, :],
               stride=stride_r.row, rows=R_rows, shift1=r_shift1)
    pattern = Pattern(b=b, h=h, Lq=Lq, Lk=Lk, window_left=window_left,
                      window_right=window_right, band_on=band_on, kpm=masks.kpm,
                      kpm_strides=masks.kpm_strides, mask=masks.mask,
                      mask_strides=masks.mask_strides)
    return b, h, window_left, window_right, kv, rel, pattern


@triton.jit
def _query_operands(Q, operands, strides, pid_bh, b, h, i0, offs_m, offs_d, m_ok, d_ok, Lq, D,
                    UPCAST: tl.constexpr, OP_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """The query tile's operands: (q + u) for AC and (q + vb) for BD, rounded to the input
    dtype (sums in fp32, rounded once: also sidesteps the interpreter's bf16 arithmetic)."""
    if OP_TILES:  # TMA tiles of the workspaces: the products read them from shared memory
        qu = _operand_tile(operands.a_op, pid_bh, operands.stride_w, i0, Lq, D, BLOCK_M,
                           BLOCK_D)
        qv = _operand_tile(operands.qv_op, pid_bh, operands.stride_w, i0, Lq, D, BLOCK_M,
                           BLOCK_D)
    else:  # formed in registers
        stride_q, stride_bias = strides.q, strides.bias
        qu, qv = load_bias_operands(Q + b * stride_q.batch + h * stride_q.head,
                                    operands.u + h * stride_bias.u,
                                    operands.vb + h * stride_bias.vb,
                                    offs_m.to(tl.int64)[:, None], offs_d, d_ok,
                                    m_ok[:, None] & d_ok[None, :], stride_q.row, UPCAST)
    return qu, qv


@triton.jit
def _split_tiles(i0, pid_s, num_splits, Lq, Lk, window_left, window_right,
                 HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """``[t_begin, t_end)``: the key tiles of split ``pid_s`` (of ``num_splits``) of those
    that the query tile at row i0 may see (window / causal), as whole key tiles."""
    i_last = tl.minimum(i0 + BLOCK_M, Lq) - 1
    lo, _ = key_range(i0, Lq, Lk, window_left, window_right, HAS_WL, HAS_WR)
    _, hi = key_range(i_last, Lq, Lk, window_left, window_right, HAS_WL, HAS_WR)
    t_lo = lo // BLOCK_N
    t_hi = tl.maximum((hi + BLOCK_N) // BLOCK_N, t_lo)
    per_split = (t_hi - t_lo + num_splits - 1) // num_splits
    t_begin = t_lo + pid_s * per_split
    t_end = tl.minimum(t_begin + per_split, t_hi)
    return t_begin, t_end


@triton.jit
def _prime_window(qv, rel, t_begin, i0, Lq, offs_n0, d_ok, EVEN_D: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, USE_DESC: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The skew's per-row rotation and merge selectors, and the window primed for key tile
    t_begin: (rot, take_first, first_is_0, t0, t1).

    Skew. Tile element (a, c) needs window column w = c + sh_a, sh_a = BM - 1 - a, i.e.
    chunk w // BN at column w % BN. Row a reads chunk c0_a = sh_a // BN at columns >= s_a =
    sh_a % BN and chunk c0_a + 1 at columns < s_a: the two never collide, so the skew is a
    merge and one row rotation by s_a. Each chunk is rotated once, when computed, and carried
    rotated; after the rotation, row a takes its first chunk at c < BN - s_a. Priming
    computes chunks 0 .. C-2 of the first tile (t1 = t0 when C == 2)."""
    sh = (BLOCK_M - 1) - tl.arange(0, BLOCK_M)
    rot = sh % BLOCK_N
    take_first = offs_n0[None, :] < (BLOCK_N - rot)[:, None]
    first_is_0 = (sh < BLOCK_N)[:, None]
    base0 = t_begin * BLOCK_N - i0 - (BLOCK_M - 1) + Lq - 1 + (rel.shift1 - 1)
    t0 = rotate_rows(_window_chunk(qv, rel, base0, offs_n0, d_ok, EVEN_D, UPCAST, DOT_PREC,
                                   USE_DESC), rot, BLOCK_M, BLOCK_N)
    t1 = t0
    if BLOCK_M > BLOCK_N:  # C == 3
        t1 = rotate_rows(_window_chunk(qv, rel, base0 + BLOCK_N, offs_n0, d_ok, EVEN_D, UPCAST,
                                       DOT_PREC, USE_DESC), rot, BLOCK_M, BLOCK_N)
    return rot, take_first, first_is_0, t0, t1


@triton.jit
def _interior_run(l_i, i0, t_begin, t_end, Lk, mlen, window_left, window_right, KEY_COUNT,
                  pid_bh, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_KPM: tl.constexpr,
                  HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The interior key tiles [t_in, t_out) of [t_begin, t_end): every pair allowed by the
    window, every key < Lk and no padding / dense mask, so they run mask-free; the rest (the
    band edges) masked. Returns (t_in, t_out, l_i), l_i NaN in the rows that an interior
    key with a non-finite value row reaches."""
    t_in = t_begin
    t_out = t_begin
    if not (HAS_KPM or HAS_MASK):
        t_in, t_out = interior_tiles(i0, i0 + BLOCK_M - 1, BLOCK_N, t_begin, t_end, Lk, mlen,
                                     window_left, window_right, HAS_WL, HAS_WR)
        if HAS_WL or HAS_WR:
            # a key of the interior tiles whose value row is not finite (v's row zeroed by the
            # launcher, and these tiles add no key bias): every row of this tile may see it,
            # so each starts with a NaN sum (NaN * alpha + ... stays NaN). The launcher's
            # ``masked_value_operands`` count of such keys before each j (KEY_COUNT) says.
            KCOUNT = KEY_COUNT + pid_bh.to(tl.int64) * (Lk + 1)
            has_in = t_out > t_in
            n_bad = (tl.load(KCOUNT + t_out * BLOCK_N, mask=has_in, other=0)
                     - tl.load(KCOUNT + t_in * BLOCK_N, mask=has_in, other=0))
            l_i += tl.where(n_bad == 0, 0.0, float("nan"))
    return t_in, t_out, l_i


@triton.jit
def _finish_rows(acc, m_i, l_i, Out, Lse, OPart, LPart, b, h, pid_bh, pid_s, num_splits,
                 offs_m, offs_d, m_ok, d_ok, Lq, D, stride_o, keep_scale,
                 DROPOUT: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    """The query tile's rows after its last key tile: normalised (DROPOUT: with the kept
    probabilities' 1 / (1 - p), ``keep_scale``) and stored by ``_store_rows``, or (SPLIT) a
    normalised partial and its log2-sum-exp for the combine kernel."""
    has_key = l_i != 0.0  # (as in _store_rows: a NaN l_i stays NaN)
    l_safe = tl.where(has_key, l_i, 1.0)
    if DROPOUT:
        o = acc * (keep_scale / l_safe)[:, None]
    else:
        o = acc / l_safe[:, None]
    if SPLIT:
        # partial: normalised output and log2-sum-exp (-inf when this slice saw no key)
        row = (pid_bh.to(tl.int64) * num_splits + pid_s) * Lq + offs_m.to(tl.int64)
        tl.store(OPart + row[:, None] * D + offs_d[None, :], o,
                 mask=m_ok[:, None] & d_ok[None, :])
        tl.store(LPart + row, tl.where(has_key, m_i + tl.math.log2(l_safe), float("-inf")),
                 mask=m_ok)
    else:
        _store_rows(Out, Lse, o, m_i, l_i, b, h, pid_bh, offs_m, offs_d, m_ok, d_ok, Lq,
                    stride_o, UPCAST)


@triton.jit
def _rel_attn_fwd_kernel(
    Q, K, V, R, operands, Out, Lse, OPart, LPart, strides, H, Lq, Lk, R_rows, r_shift1, D,
    qk_scale, num_splits, masks, dropout, memory, LQ_BUCKET, LK_BUCKET,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_KPM: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BAND: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    EVEN_D: tl.constexpr, USE_DESC: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DROPOUT: tl.constexpr = False,
    QUANT_MEM: tl.constexpr = False, OP_TILES: tl.constexpr = False,
):
    """One program per (batch * head, query tile, key split): the online softmax over the
    key tiles of the split that the window lets the query tile see; the output rows and lse
    (SPLIT: a normalised partial and its log2-sum-exp, merged by the combine kernel).
    ``operands``: ``FwdOperands``."""
    pid_bh = tl.program_id(0)
    b, h, window_left, window_right, kv, rel, pattern = _program_setup(
        K, V, R, strides, masks, memory, H, Lq, Lk, R_rows, r_shift1, D, HAS_BAND, USE_DESC,
        QUANT_MEM, BLOCK_N, BLOCK_D)
    # Heaviest query tiles (largest i0 under causal masks) first.
    m_tile = tl.num_programs(1) - 1 - tl.program_id(1)
    pid_s = tl.program_id(2)
    mlen = Lk - Lq
    i0 = m_tile * BLOCK_M

    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    m_ok = offs_m < Lq
    d_ok = offs_d < D

    qu, qv = _query_operands(Q, operands, strides, pid_bh, b, h, i0, offs_m, offs_d, m_ok, d_ok,
                             Lq, D, UPCAST, OP_TILES, BLOCK_M, BLOCK_D)
    t_begin, t_end = _split_tiles(i0, pid_s, num_splits, Lq, Lk, window_left, window_right,
                                  HAS_WL, HAS_WR, BLOCK_M, BLOCK_N)
    rot, take_first, first_is_0, t0, t1 = _prime_window(qv, rel, t_begin, i0, Lq, offs_n0, d_ok,
                                                        EVEN_D, UPCAST, DOT_PREC, USE_DESC,
                                                        BLOCK_M, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    drop_seed = 0
    drop_off = 0
    if DROPOUT:
        drop_seed, drop_off = load_dropout_seed(dropout.seed)
    drop = _Drop(bh=pid_bh, seed=drop_seed, offset=drop_off, threshold=dropout.threshold)
    tile = _QueryTile(i0=i0, offs_m=offs_m, offs_n0=offs_n0, d_ok=d_ok, rot=rot,
                      take_first=take_first, first_is_0=first_is_0, qk_scale=qk_scale)

    t_in, t_out, l_i = _interior_run(l_i, i0, t_begin, t_end, Lk, mlen, window_left,
                                     window_right, masks.key_count, pid_bh, HAS_WL, HAS_WR,
                                     HAS_KPM, HAS_MASK, BLOCK_M, BLOCK_N)
    # three runs of tiles: [t_begin, t_in) the left band edge (masked), [t_in, t_out) the
    # interior (mask-free), [t_out, t_end) the right edge and padding (masked); only the last
    # exists with a padding or dense mask, the first only with a left window
    for run in tl.static_range(3):
        t_first, t_stop = tile_run(run, t_begin, t_in, t_out, t_end)
        if run == 2 or (not (HAS_KPM or HAS_MASK) and (run == 1 or HAS_WL)):
            for t in range(t_first, t_stop):
                acc, m_i, l_i, t0, t1 = _attend_tile(
                    acc, m_i, l_i, t0, t1, t, qu, qv, tile, kv, rel, pattern, drop,
                    HAS_WL, HAS_WR, HAS_KPM, HAS_MASK, HAS_BAND, run != 1, EVEN_D, UPCAST,
                    DOT_PREC, USE_DESC, BLOCK_M, BLOCK_N, DROPOUT, QUANT_MEM)
    _finish_rows(acc, m_i, l_i, Out, Lse, OPart, LPart, b, h, pid_bh, pid_s, num_splits,
                 offs_m, offs_d, m_ok, d_ok, Lq, D, strides.out, dropout.keep_scale, DROPOUT,
                 SPLIT, UPCAST)


@triton.jit
def _rel_attn_fwd_combine_kernel(
    OPart, LPart, Out, Lse, stride_o, H, Lq, D, num_splits,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge split-K partials: out = sum_s 2^(l_s - L) o_s, L = log2 sum_s 2^l_s."""
    pid_bh = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Lq
    d_ok = offs_d < D
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    row0 = pid_bh.to(tl.int64) * num_splits * Lq + offs_m.to(tl.int64)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(num_splits):
        ls = tl.load(LPart + row0 + s * Lq, mask=m_ok, other=float("-inf"))
        m = tl.maximum(m, ls)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(num_splits):
        row = row0 + s * Lq
        ls = tl.load(LPart + row, mask=m_ok, other=float("-inf"))
        w = tl.math.exp2(ls - m_safe)
        os_ = tl.load(OPart + row[:, None] * D + offs_d[None, :],
                      mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        acc += w[:, None] * os_
        den += w
    o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    _store_rows(Out, Lse, o, m_safe, den, b, h, pid_bh, offs_m, offs_d, m_ok, d_ok, Lq,
                stride_o, UPCAST)


# --------------------------------------------------------------------------------------------
# Autotuning (GPU only)

# (BLOCK_M, BLOCK_N, num_warps, num_stages). Chosen from sm_90 compiles (register use and
# spills, shared memory): the carried window chunk, the AC / BD accumulators and the output
# accumulator make this kernel register-heavy, so BLOCK_N 128 is only offered for D <= 64.
# The BLOCK_M 32 configs with 4 warps serve exact fp32 ("ieee" products run on the FMA
# units); 64 x 32 with 8 warps is sm_90's / sm_100's default at D 128 with a dense mask.
_CONFIG_TABLE = (
    (64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2),
    (64, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3),
    (32, 16, 4, 2), (32, 32, 4, 2), (64, 32, 8, 2),
)
# 32-row tiles with 8 warps (each warp 16 x 16 or 16 x 32 of the scores): the 16-bit defaults
# of the families whose tensor-core products (mma.sync) keep every operand in registers
# (sm_80, sm_86 / sm_89, sm_120), where larger tiles spill (docs/gpu-support.md).
_REGISTER_MMA_ROWS = ((32, 32, 8, 2), (32, 64, 8, 2))


def _config_ok(bm, bn, nw, ns, block_d, exact_fp32, wide=False):
    if bm > 2 * bn:  # the window is held in at most three BN-row chunks
        return False
    if exact_fp32:
        return bm <= 64 and bn <= 32 and ns <= 2
    if bm < 64 and (wide or bm < 32 or nw < 8):  # 32 rows: 16-bit, 8 warps only
        return False
    if block_d >= 128 and bn > 64:
        return False
    if block_d >= 256:  # BN 64 needs 272 KiB of shared memory (sm_90 blocks: 227 KiB)
        return bm == 64 and bn <= 32 and ns <= 2
    if wide and (bn > 64 or (block_d >= 128 and bm == 64 and bn == 64)):
        return False  # TF32: these tiles need 272..368 KiB of shared memory
    return True


def _prune_configs(configs, named_args, **kwargs):
    block_d = kwargs["BLOCK_D"]
    wide = named_args["Q"].dtype == torch.float32
    exact_fp32 = wide and kwargs["DOT_PREC"] == "ieee"
    family = config_family(named_args["Q"].device)[0]
    table = _family_table(family)
    out = [c for c in configs
           if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in table
           and _config_ok(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages,
                          block_d, exact_fp32, wide)]
    default = _default_config(block_d, exact_fp32, wide, family, dense_mask=kwargs["HAS_MASK"],
                              operand_tiles=kwargs["OP_TILES"])
    if kwargs["SPLIT"]:  # num_splits was chosen for the default config's BLOCK_M
        out = [c for c in out if c.kwargs["BLOCK_M"] == default["BLOCK_M"]]
    if not out:
        cfg = dict(default)
        nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
        out = [triton.Config(cfg, num_warps=nw, num_stages=ns)]
    return out


def _operand_tiles(family: str, block_d: int, dtype: torch.dtype, use_desc: bool = True,
                   dense_mask: bool = False, quant_mem: bool = False) -> bool:
    """Whether a launch reads (q + u) and (q + vb) as TMA tiles of workspaces (OP_TILES)
    rather than forming them in registers: on sm_90 at fp16 / bf16, head dims 65..128, where
    the two wgmma A operands in registers (64 per thread at D 128, 8 warps) are what keeps
    128-row query tiles from compiling without spills (sm_90 static model: forward 3.00 ->
    1.48 of the plain kernel at D 128). At D 64 the registers fit either way, and the model
    gives the same time (1.79 / 1.80), so the workspaces' extra pass is not taken; nor with a
    dense mask, whose 64 x 32 tiles keep their operands in registers (from shared memory the
    8 warps' N-split products read them once per warp: 3.84 against 3.00 at 64 x 64), nor
    with an 8-bit memory, whose dequantisation in registers spills 176 B at 128 rows."""
    return (family == "sm90" and block_d == 128 and dtype != torch.float32 and use_desc
            and not dense_mask and not quant_mem)


def _default_config(block_d: int, exact_fp32: bool, wide: bool = False,
                    family: str = "sm90", *, dense_mask: bool = False,
                    operand_tiles: Optional[bool] = None) -> dict:
    """The config used on GPU when autotuning is off (TXL_KERNELS_AUTOTUNE=0), for config
    family ``family`` (``_arch.config_family``); ``dense_mask``: the launch loads a dense
    attn_mask (HAS_MASK); ``operand_tiles``: the launch's OP_TILES (default: as
    ``_operand_tiles`` decides for a launch with TMA descriptors).
    Each 16-bit default at D 64 / 128 compiles without spills for every
    variant (masks, split-K, dropout, the 8-bit memory) on its family's targets
    (``tools/aot_check --spill-budget``; BENCHMARKS.md, "Per-architecture compile table")."""
    if exact_fp32:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if block_d >= 256 or (wide and block_d >= 128):
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if wide:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    if family not in ("sm90", "sm100"):
        # mma.sync keeps q + u, q + vb, the K / V / r operands and every accumulator in
        # registers: 32-row tiles over 8 warps (larger ones spill 0.1-5 KB)
        bn = 64 if block_d <= 64 else 32
        return {"BLOCK_M": 32, "BLOCK_N": bn, "num_warps": 8, "num_stages": 2}
    # sm_90 / sm_100 (wgmma / tcgen05). With a dense mask, its tile of loads on top of the
    # larger tiles spills: smaller ones then
    if operand_tiles is None:
        operand_tiles = _operand_tiles(family, block_d,
                                       torch.float32 if wide else torch.bfloat16,
                                       dense_mask=dense_mask)
    if block_d > 64:
        if operand_tiles:
            # 128 query rows share each K / V / r tile (global traffic per pair halves), with
            # (q + u) and (q + vb) in shared memory (in registers the tile spills 144 B)
            return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
        # two warpgroups split the [64, 128] output accumulator (with 4 warps it spills 1.3-2.2 KB)
        bn = 32 if dense_mask else 64
        return {"BLOCK_M": 64, "BLOCK_N": bn, "num_warps": 8, "num_stages": 2}
    if family == "sm90" and not dense_mask:
        # 128 query rows (two warpgroups) share each K / V / r tile: 3 bytes of global traffic
        # per (query, key) pair at D 64 against 6 with 64 rows (sm_90 static model, L2 bound)
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8 if family == "sm100" else 4,
            "num_stages": 2}


_AUTOTUNE_KEYS = ["LQ_BUCKET", "LK_BUCKET", "BLOCK_D", "num_splits", "HAS_WL", "HAS_WR",
                  "HAS_KPM", "HAS_MASK", "HAS_BAND", "SPLIT", "DOT_PREC", "EVEN_D", "USE_DESC",
                  "DROPOUT", "QUANT_MEM", "OP_TILES"]

# Per-architecture tables (txl_kernels._arch config families): sm_90, sm_100 (same 227 KiB
# blocks) and sm_80 (163 KiB: the autotuner skips a config that does not fit) take the whole
# table; the 99 KiB blocks of sm_86 / sm_89 / sm_120 its two-stage configs. The mma.sync
# families (sm_80, sm_86, sm_120) add the 32-row configs their defaults use.
_SMALL_SMEM_TABLE = tuple(row for row in _CONFIG_TABLE if row[3] <= 2) + _REGISTER_MMA_ROWS
_ARCH_CONFIG_TABLES = {
    "sm90": _CONFIG_TABLE,
    "sm100": _CONFIG_TABLE,
    "sm80": _CONFIG_TABLE + _REGISTER_MMA_ROWS,
    "sm86": _SMALL_SMEM_TABLE,
    "sm120": _SMALL_SMEM_TABLE,
}


def _family_table(family: str):
    return _ARCH_CONFIG_TABLES.get(family, _CONFIG_TABLE)


def _all_configs():
    """The autotuner's configs: every family's table (each launch prunes to its own)."""
    rows = []
    for table in _ARCH_CONFIG_TABLES.values():
        rows += [row for row in table if row not in rows]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=nw, num_stages=ns)
            for bm, bn, nw, ns in rows]


_rel_attn_fwd_kernel_tuned = triton.autotune(
    configs=_all_configs(), key=_AUTOTUNE_KEYS,
    prune_configs_by={"early_config_prune": _prune_configs},
)(_rel_attn_fwd_kernel)


# --------------------------------------------------------------------------------------------
# Launcher

@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(B: int, H: int, Lq: int, Lk: int, window_left: int, window_right: int,
                      num_sms: int, block_m: int = 64) -> int:
    """Split the keys when the (b, h, query tile) programs cannot fill ``num_sms`` SMs.

    ``block_m``: the BLOCK_M the forward launches with (the launcher passes it; with the
    autotuner on, split launches only try configs of that BLOCK_M). Aims at about four programs
    per SM, with at least 256 keys (the span a query tile may see under the window) per split so
    that priming the window stays a small overhead.
    """
    base = B * H * triton.cdiv(Lq, block_m)
    if base >= 2 * num_sms:
        return 1
    span = Lk
    if window_left >= 0 and window_right >= 0:
        span = min(Lk, window_left + window_right + 64)
    elif window_left >= 0:
        span = min(Lk, window_left + 64 + Lq)
    elif window_right >= 0:
        span = min(Lk, Lk - Lq + window_right + 64)
    by_keys = max(1, span // 256)
    return int(max(1, min(triton.cdiv(4 * num_sms, base), by_keys, 64)))


def masked_value_operands(v: torch.Tensor, memory: Optional[QuantizedKV],
                          key_padding_mask: Optional[torch.Tensor], dtype: torch.dtype):
    """``(v, key_bias, key_count)`` for a forward launch in which a mask or window can
    exclude pairs. ``v`` with its non-finite entries set to 0, so that ``P = 0`` on an
    excluded pair adds exactly 0 to ``P @ V``; ``key_bias`` ``[B, H, Lk]`` fp32: -inf for a
    padded key, NaN for a key whose value row is not finite (v's row, or the 8-bit memory's
    row dequantised to ``dtype``: data and scale), else 0. The masked tiles add it to the
    allowed pairs' scores, so that such a key still makes every query row allowed to see it
    NaN, and load the memory's rows of a NaN bias as 0 (the memory is read in place).
    ``key_count`` ``[B, H, Lk + 1]`` int32: the number of NaN-biased keys before each j, from
    which a program starts its rows' softmax sums at NaN when its mask-free interior tiles
    (which add no bias) hold one. A few elementwise passes over v and the memory's values:
    the same selects in the kernel's tiles spill on sm_90."""
    bad = row_poison(v, torch.float32)  # [B, Lc, H]: NaN where the row is not finite
    v = finite_or_zero(v)
    if memory is not None and memory.v.shape[1] > 0:
        mem_bad = row_poison(dequantize_per_token(memory.v, memory.v_scale, dtype),
                             torch.float32)
        bad = torch.cat([mem_bad, bad], dim=1)
    key_bias = bad.transpose(1, 2)
    if key_padding_mask is not None:
        key_bias = key_bias.masked_fill(key_padding_mask[:, None, :], float("-inf"))
    key_bias = key_bias.contiguous()
    key_count = torch.nn.functional.pad(key_bias.isnan().cumsum(-1, dtype=torch.int32), (1, 0))
    return v, key_bias, key_count


def _check_fwd_args(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, memory) -> None:
    """rel_attn_fwd's invariants (rel_attention validated the user's arguments with clear
    errors); a scale the online softmax cannot take raises."""
    B, Lq, H, D = q.shape
    M = 0 if memory is None else memory.k.shape[1]
    Lk, dtype = M + k.shape[1], q.dtype
    assert dtype in (torch.float16, torch.bfloat16, torch.float32), f"q: {describe(q)}"
    assert all(t.dtype == dtype for t in (k, v, r, r_w_bias, r_r_bias)), \
        f"dtypes differ: q {describe(q)}, k {describe(k)}, r {describe(r)}"
    Lc = Lk - M
    assert tuple(k.shape) == (B, Lc, H, D) and tuple(v.shape) == (B, Lc, H, D) and Lk >= Lq, \
        f"q {describe(q)}, k {describe(k)}, v {describe(v)}, memory length {M}"
    assert tuple(r.shape[1:]) == (H, D) and tuple(r_w_bias.shape) == (H, D) \
        and tuple(r_r_bias.shape) == (H, D), \
        f"r {describe(r)}, r_w_bias {describe(r_w_bias)}, r_r_bias {describe(r_r_bias)}"
    assert 16 <= D <= 256, f"head dim {D}"
    if not 0.0 < float(softmax_scale) < float("inf"):
        # the online softmax scales the running maximum of the raw scores: only right for a
        # positive scale (rel_attention folds the sign of other scales into q and the biases)
        raise ValueError(f"rel_attn_fwd: softmax_scale must be finite and > 0, "
                         f"got {softmax_scale!r}")


def _fwd_launch(q, Lk: int, block_d: int, dot_prec: str, use_desc: bool, quant: bool,
                has_mask: bool, window_left: int, window_right: int, operand_tiles, config,
                num_splits):
    """(operand_tiles, config, num_splits) of a forward launch: the caller's, else the
    architecture's choice (the config None where the autotuner picks it)."""
    B, Lq, H, _ = q.shape
    dtype = q.dtype
    family = config_family(q.device)[0]
    if operand_tiles is None:
        operand_tiles = _operand_tiles(family, block_d, dtype, use_desc, has_mask, quant)
    elif operand_tiles and not use_desc:
        raise ValueError("rel_attn_fwd: operand_tiles=True needs TMA descriptors (sm_90 or "
                         "newer, 16-byte aligned tensors); this launch loads through pointers")
    exact_fp32 = dtype == torch.float32 and dot_prec == "ieee"
    default = _default_config(block_d, exact_fp32, dtype == torch.float32, family,
                              dense_mask=has_mask, operand_tiles=operand_tiles)
    if config is None and INTERPRET:
        config = INTERPRET_CONFIG
    elif config is None and not autotune_enabled():
        config = default
    # the BLOCK_M this call launches with (autotuned split launches keep the default's)
    block_m = (config or default)["BLOCK_M"]
    if num_splits is None:
        if q.device.type == "cuda" and not INTERPRET:
            num_splits = choose_num_splits(B, H, Lq, Lk, window_left, window_right,
                                           _sm_count(q.device.index or 0), block_m)
        else:
            num_splits = 1
    return operand_tiles, config, max(1, int(num_splits))


def rel_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor,
    r_w_bias: torch.Tensor, r_r_bias: torch.Tensor, softmax_scale: float,
    window_left: int, window_right: int,
    key_padding_mask: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    *, attn_mask_band: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0, dropout_seed: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None, config: Optional[dict] = None,
    memory: Optional[QuantizedKV] = None, operand_tiles: Optional[bool] = None,
    r_first_distance: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fused forward. Returns ``out [B, Lq, H, D]`` (q's dtype, contiguous) and
    ``lse [B, H, Lq]`` (fp32, natural log, ``+inf`` for rows with no allowed key).

    q ``[B, Lq, H, D]``, k / v ``[B, Lk, H, D]``, r ``[R, H, D]``, biases ``[H, D]``, any
    strides; masks as normalised by ``rel_attention`` (bool, True = masked; ``attn_mask``
    broadcastable to ``[B, H, Lq, Lk]``). ``attn_mask_band``: int32 ``[is_band, left,
    right]`` on the device (``functional.mask_to_band(attn_mask)``): when ``is_band``, the
    mask is applied as that window (tiles outside skipped, nothing loaded), else densely.

    ``dropout_p`` in [0, 1): dropout on the attention probabilities, after the softmax
    normaliser (lse is that of the undropped scores): elements are dropped with probability
    ``dropout_rate(dropout_p)`` (p to within 2^-24, never 0 for p > 0) and kept ones scaled by
    ``dropout_keep_scale(dropout_p)``, 1 / (1 - that rate), so E[out] is the undropped output.
    The keep-mask is ``dropout_keep_mask(dropout_seed, B, H, Lq, Lk, dropout_p)``: ``dropout_seed``
    is the int64 ``[2]`` (seed, offset) tensor on q's device (default: a fresh
    ``draw_dropout_seed(q.device)``, from PyTorch's default generator); the backward needs
    the same tensor.

    Keywords (testing / tuning): ``num_splits`` forces the split-K factor (1 = no split;
    default: chosen from the SM count on GPU, 1 under the interpreter); ``config`` =
    ``{"BLOCK_M": .., "BLOCK_N": .., "num_warps": .., "num_stages": ..}`` bypasses the
    autotuner (BLOCK_M <= 2 * BLOCK_N, powers of two >= 16); ``operand_tiles`` forces
    (True, needs TMA descriptors) or stops the (q + u) / (q + vb) workspaces that the kernel
    then reads as TMA tiles (default ``_operand_tiles``: sm_90, fp16 / bf16, head dims 65..128).

    ``memory``: an 8-bit memory (``txl_kernels.quant.QuantizedKV``, k / v ``[B, M, H, D]``
    int8 or float8_e4m3fn, scales ``[B, M, H]`` fp32 / fp16, any strides with a contiguous
    last dim). The keys / values are then its ``M`` rows followed by k / v's (the current
    segment), ``Lk = M + k.shape[1]`` everywhere above; the kernel reads the 8-bit tiles and
    their scales and dequantises in registers (QUANT_MEM), never a full-precision copy.

    ``r_first_distance``: the distance held by r's row 0 (None: ``Lk - 1``); the kernel
    reads row ``j - i + c``, ``c = r_first_distance - Lk + Lq`` (``Lq - 1`` for None), a
    runtime int (``rel_attention`` clamps it so that c stays within int32).
    """
    _check_fwd_args(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, memory)
    B, Lq, H, D = q.shape
    M = 0 if memory is None else memory.k.shape[1]
    Lk = M + k.shape[1]
    R_rows = r.shape[0]
    dtype = q.dtype
    # the call's variant: what the self-check checks is what is compiled
    flags = variant_flags(q, window_left, window_right, key_padding_mask, attn_mask,
                          attn_mask_band, dropout_p, memory, r_first_distance)
    quant, has_band = flags["QUANT_MEM"], flags["HAS_BAND"]
    q, k, v, r, u, vb = (last_dim_contiguous(t) for t in (q, k, v, r, r_w_bias, r_r_bias))

    out = torch.empty((B, Lq, H, D), dtype=dtype, device=q.device)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)

    dot_prec = dot_precision(dtype)
    block_d = max(16, triton.next_power_of_2(D))
    use_desc = descriptors_ok(r) if quant else descriptors_ok(k, v, r)
    operand_tiles, config, num_splits = _fwd_launch(q, Lk, block_d, dot_prec, use_desc, quant,
                                                    flags["HAS_MASK"], window_left,
                                                    window_right, operand_tiles, config,
                                                    num_splits)
    split = num_splits > 1
    if split:  # the splits' partials (else unused: lse stands in)
        o_part = torch.empty((B * H, num_splits, Lq, D), dtype=torch.float32, device=q.device)
        l_part = torch.empty((B * H, num_splits, Lq), dtype=torch.float32, device=q.device)
    else:
        o_part, l_part = lse, lse

    # With a band the window checks are compiled in; an unbounded side becomes Lk + Lq.
    wl_arg = int(window_left) if window_left >= 0 or not has_band else Lk + Lq
    wr_arg = int(window_right) if window_right >= 0 or not has_band else Lk + Lq
    upcast = INTERPRET and dtype == torch.bfloat16
    if flags["DROPOUT"] and dropout_seed is None:
        dropout_seed = draw_dropout_seed(q.device)

    v, strides, masks, mem_arg, operands = _fwd_tuples(
        q, k, v, r, u, vb, out, lse, memory, key_padding_mask, attn_mask,
        attn_mask_band if has_band else None, (wl_arg, wr_arg), window_left, window_right,
        operand_tiles, upcast)
    dropout_arg = dropout_args(dropout_p, dropout_seed, lse)
    # 1 + the rows' shift against the default table (1 for it: rel_attn_bwd._ROW_SHIFT)
    r_shift1 = 1 if r_first_distance is None else int(r_first_distance) - (Lk - 1) + 1
    args = (q, k, v, r, operands, out, lse, o_part, l_part, strides, H, Lq, Lk, R_rows,
            r_shift1, D,
            float(softmax_scale) * LOG2E.value, num_splits, masks, dropout_arg, mem_arg,
            length_bucket(Lq), length_bucket(Lk))
    meta = dict(flags, SPLIT=split, UPCAST=upcast, DOT_PREC=dot_prec, EVEN_D=D == block_d,
                USE_DESC=use_desc, BLOCK_D=block_d, OP_TILES=operand_tiles)

    _run_fwd(args, meta, operands, strides, config, num_splits, o_part, l_part, out, lse)
    return out, lse


def _fwd_tuples(q, k, v, r, u, vb, out, lse, memory, key_padding_mask, attn_mask, band,
                window_args, window_left: int, window_right: int, operand_tiles: bool,
                upcast: bool):
    """The forward kernel's tuple arguments but the dropout: (v, strides, masks, memory,
    operands). ``window_args``: the window as the kernel takes it; where a mask or window can
    exclude pairs, v with its non-finite rows zeroed and the key bias and count
    (``masked_value_operands``); with ``operand_tiles`` the (q + u) / (q + vb) workspaces.
    ``lse`` stands in for every absent tensor (unread)."""
    B, Lq, H, D = q.shape
    if excludes_pairs(window_left, window_right, key_padding_mask, attn_mask):  # (POISON)
        v, key_bias, key_count = masked_value_operands(v, memory, key_padding_mask, q.dtype)
    else:  # no pair is excluded: V as given, no bias (unused placeholders)
        key_bias, key_count = lse, lse
    mem_arg = memory_launch_args(memory, k, v)
    Lk = k.shape[1] + mem_arg.M
    strides = FwdStrides(q=row_strides(q), k=row_strides(k), v=row_strides(v),
                         r=head_strides(r), bias=bias_strides(u, vb), out=row_strides(out))
    masks = FwdMaskArgs(*mask_args(*window_args, key_padding_mask, attn_mask, band, lse,
                                   (B, H, Lq, Lk)),
                        key_bias=key_bias, key_count=key_count)
    if operand_tiles:
        a_op, qv_op = (operand_workspace(B, H, Lq, D, q.dtype, upcast, q.device)
                       for _ in range(2))
        stride_w = WorkStrides(a_op.stride(0), a_op.stride(1))
    else:
        a_op, qv_op, stride_w = q, q, WorkStrides(0, 0)  # unused
    operands = FwdOperands(u=u, vb=vb, a_op=a_op, qv_op=qv_op, stride_w=stride_w)
    return v, strides, masks, mem_arg, operands


def _run_fwd(args, meta, operands, strides, config, num_splits, o_part, l_part, out, lse):
    """Launch the forward: the operands kernel (OP_TILES), the main kernel with ``config`` (or
    its autotuner when None) and the combine kernel (SPLIT)."""
    B, Lq, H, D = out.shape
    q = args[0]
    upcast, block_d = meta["UPCAST"], meta["BLOCK_D"]

    def grid(META):
        return (B * H, triton.cdiv(Lq, META["BLOCK_M"]), num_splits)

    if meta["USE_DESC"] and q.device.type == "cuda" and not INTERPRET:
        ensure_scratch_allocator()
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        if meta["OP_TILES"]:
            bm_o = 16 if INTERPRET else 64
            _rel_attn_fwd_operands_kernel[(B * H, triton.cdiv(Lq, bm_o))](
                q, operands.u, operands.vb, operands.a_op, operands.qv_op, strides.q,
                strides.bias, operands.stride_w, H, Lq, D, UPCAST=upcast, BLOCK_M=bm_o,
                BLOCK_D=block_d, num_warps=4)
        if config is not None:
            cfg = dict(config)
            bm, bn = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
            if bm > 2 * bn:
                raise ValueError("rel_attn_fwd: config needs BLOCK_M <= 2 * BLOCK_N")
            cfg.setdefault("num_warps", 4)
            cfg.setdefault("num_stages", 1 if INTERPRET else 2)
            _rel_attn_fwd_kernel[grid(dict(BLOCK_M=bm))](*args, BLOCK_M=bm, BLOCK_N=bn, **meta,
                                                        **cfg)
        else:
            _rel_attn_fwd_kernel_tuned[grid](*args, **meta)
        if meta["SPLIT"]:
            bm_c = 16 if INTERPRET else 64
            _rel_attn_fwd_combine_kernel[(B * H, triton.cdiv(Lq, bm_c))](
                o_part, l_part, out, lse, strides.out, H, Lq, D, num_splits, UPCAST=upcast,
                BLOCK_M=bm_c, BLOCK_D=block_d, num_warps=4)


