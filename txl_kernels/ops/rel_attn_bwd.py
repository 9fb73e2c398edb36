"""Fused Triton backward of Transformer-XL relative attention: ``rel_attn_bwd``.

Contract. Given the forward's inputs (layouts as in rel_attn_fwd.py: q / do / out
``[B, Lq, H, D]``, k / v ``[B, Lk, H, D]``, r ``[R, H, D]``, u / vb ``[H, D]``, one dtype among
fp16 / bf16 / fp32, head dim 16..256, Lk >= Lq), its out and lse (``[B, H, Lq]`` fp32, natural
log, +inf for empty rows) and the same masks, returns dq, dk, dv, dr, du, dvb, each with its
input's shape and dtype, contiguous. Any strides with ``stride(-1) == 1`` (others copied);
int64 batch / head offsets (the atomics' offsets within a head are int32, where they fit).
Kernels: preprocess (delta = dO . O, and q + u / q + vb rounded once per row into workspaces,
unless Q_ONLY), dk/dv (+ du partials; ATOMIC: + dq and dr by fp32 atomics, no dq kernel;
ORDERED: those adds in key-tile order; Q_ONLY: one q tile per pair, see _q_only), dq (+ its
row sums for dvb; + atomic dr on the families without ATOMIC), dr (deterministic mode without
ATOMIC).

Invariants. P is recomputed from lse, never stored; the recomputed S uses exactly the
forward's rounded operands; skew and unskew are one per-row rotation each (the forward's
register rotation; a same-shape ``tl.gather`` for fp32 inputs); r rows outside [0, R) are never
read or written. ``deterministic=True`` gives bitwise-equal gradients across calls (where
_fused_dq, the atomics in key-tile order; elsewhere no atomics); ``deterministic=False``
(``rel_attention``'s default) reduces dr (and, where _fused_dq, dq) with fp32 atomics in any
order. Without autotuning each kernel runs its fixed ``_default_config``.

Derivations: docs/DESIGN.md, sections "Backward", "Window reuse in the backward",
"dr: atomic (the default) or deterministic", "Masks and memory in the backward", "Precision".
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .._arch import config_family
from .._utils import describe
from ..reference import finite_or_zero
from ._common import (INTERPRET, LOG2E, BiasStrides, HeadStrides, Pattern, RowStrides,
                      WorkStrides, apply_mask_band, autotune_enabled, bias_operands,
                      bias_strides, descriptors_ok, dot_precision, dropout_args, dropout_keep,
                      ensure_scratch_allocator, excludes_pairs, head_strides, interior_tiles,
                      last_dim_contiguous, length_bucket, load_dropout_seed, mask_args,
                      operand_workspace, pair_mask, rotate_rows, round_bf16, row_strides,
                      store_bias_operands, tile_run, to_operand, variant_flags)

__all__ = ["rel_attn_bwd"]

_MIN_BLOCK = 16  # smallest BLOCK of any config; sizes the du / dq row-sum partial buffers
# The inline PTX below (atomic adds, ORDERED's spin and barrier) runs on the GPU only: the
# interpreter runs tl.atomic_add and no spin (see _turn_wait)
_PTX = tl.constexpr(not INTERPRET)


# ----------------------------------------------------------------------------------------------
# Tile helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _output(x, OUT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 -> output dtype, rounding to nearest also under the interpreter."""
    if UPCAST:
        y = round_bf16(x).to(OUT_DTYPE)
    else:
        y = x.to(OUT_DTYPE)
    return y


@triton.jit
def _rotate_rows(x, sh, BLOCK: tl.constexpr, SKEW_GATHER: tl.constexpr):
    """out[a, c] = x[a, (c + sh[a]) % BLOCK] (0 <= sh < BLOCK): the per-row rotation of the
    relative shift, by the forward's register rotation (``_common.rotate_rows``), or with
    SKEW_GATHER by one same-shape tl.gather: the launcher sets it for fp32 inputs, where
    rotate_rows crashes Triton 3.8's TritonGPUOptimizeDotOperands pass on sm_90 (atomic dq
    kernel, fp32 / TF32 products)."""
    if SKEW_GATHER:
        y = tl.gather(x, (tl.arange(0, BLOCK)[None, :] + sh[:, None]) & (BLOCK - 1), 1)
    else:
        y = rotate_rows(x, sh, BLOCK, BLOCK)
    return y


@triton.jit
def _skew(t_lo, t_hi, BLOCK: tl.constexpr, SKEW_GATHER: tl.constexpr):
    """BD[a, b] = T[a, b - a + BLOCK - 1] over the window T = [t_lo | t_hi] ([BLOCK, 2 BLOCK]).

    Row a reads t_lo at columns x >= BLOCK - 1 - a (pairs b <= a) and t_hi at the other
    columns (b > a), so the two chunks merge elementwise and one rotation per row by
    BLOCK - 1 - a aligns them."""
    a = tl.arange(0, BLOCK)
    merged = tl.where(_lo_part(BLOCK), t_lo, t_hi)
    return _rotate_rows(merged, BLOCK - 1 - a, BLOCK, SKEW_GATHER)


@triton.jit
def _unskew(ds, BLOCK: tl.constexpr, SKEW_GATHER: tl.constexpr):
    """G[a, w] = ds[a, (w + a + 1) mod BLOCK]; the lo window chunk is G where
    w + a >= BLOCK - 1 (see _lo_part), the hi chunk is G elsewhere."""
    return _rotate_rows(ds, (tl.arange(0, BLOCK) + 1) & (BLOCK - 1), BLOCK, SKEW_GATHER)


@triton.jit
def _lo_part(BLOCK: tl.constexpr):
    a = tl.arange(0, BLOCK)[:, None]
    w = tl.arange(0, BLOCK)[None, :]
    return (w + a) >= (BLOCK - 1)


@triton.jit
def _load_rows(PTR, rows, n_rows, stride_row, offs_d, D, DOT_DTYPE: tl.constexpr):
    """Rows ``rows`` ([BLOCK] int) of a [n_rows, D] slice (stride(-1) == 1); rows outside
    [0, n_rows) and columns >= D read as 0."""
    ptrs = PTR + rows.to(tl.int64)[:, None] * stride_row + offs_d[None, :]
    msk = ((rows >= 0) & (rows < n_rows))[:, None] & (offs_d < D)[None, :]
    return tl.load(ptrs, mask=msk, other=0.0).to(DOT_DTYPE)


# On the GPU: one fp32 atomic add per element as inline PTX (relaxed, gpu scope: what
# tl.atomic_add emits). An asm operand keeps the layout it has, so the adds read the dot's
# accumulator registers as they are, as FlashAttention-2 adds its dQ; tl.atomic_add first
# moves the tile through shared memory into a coalesced layout (16 + 16 KB of shared-memory
# traffic per tile at BLOCK 64, D 64, and a CTA barrier). The sectors touched are the same.
_ATOMIC_ADD_PTX = tl.constexpr("{ .reg .pred p;\n.reg .b32 o;\n.reg .b64 a;\n"
                               "setp.ne.b32 p, $4, 0;\nsetp.ne.and.b32 p, $5, 0, p;\n"
                               "add.s32 o, $1, $2;\nmad.wide.s32 a, o, 4, $6;\n"
                               "mov.b32 $0, 0f00000000;\n"
                               "@p atom.relaxed.gpu.global.add.f32 $0, [a], $3; }")


@triton.jit
def _atomic_add(BASE, row_off, cols, x, row_ok, col_ok):
    """BASE[row_off[a] + cols[c]] += x[a, c] where row_ok[a] and col_ok[c] (x [BLOCK, BLOCK_D]
    fp32; int32 offsets), relaxed, in any order. The row and column parts enter the asm
    separately, as broadcasts (no offset or mask per element held in registers). Under the
    interpreter, tl.atomic_add."""
    if _PTX:
        tl.inline_asm_elementwise(_ATOMIC_ADD_PTX, "=f,r,r,f,r,r,l",
                                  [row_off[:, None], cols[None, :], x,
                                   row_ok.to(tl.int32)[:, None], col_ok.to(tl.int32)[None, :],
                                   BASE.to(tl.int64, bitcast=True)],
                                  dtype=tl.float32, is_pure=False, pack=1)
    else:
        tl.atomic_add(BASE + (row_off[:, None] + cols[None, :]), x,
                      mask=row_ok[:, None] & col_ok[None, :], sem="relaxed")


@triton.jit
def _dr_add(DR_h, x, rows, R_rows, stride_drp, offs_d, d_ok, softmax_scale):
    """dr[rows] += softmax_scale * x ([BLOCK, D], from products dT^T Qv) with fp32 atomics; rows
    outside [0, R) are skipped. The offsets within the head are int32 (64-bit ones cost a loop
    ~60 integer instructions per tile): the launcher takes the atomic paths only while every
    row's offset fits (_atomic_offsets_fit). [BLOCK, D] rather than its transpose: the atomics'
    D-contiguous rows come straight from the accumulator, where the transposed form keeps a
    transposed pointer tile live (sm_80, bf16 D 128, BLOCK 32, 8 warps: 8.7 KB of spills
    against 176 B in the dq kernel)."""
    row_ok = (rows >= 0) & (rows < R_rows)
    _atomic_add(DR_h, rows * stride_drp, offs_d, x * softmax_scale, row_ok, d_ok)


@triton.jit
def _probs(ac, bd, lse2, offs_i, j0, qk_scale, pattern, HAS_KPM: tl.constexpr,
           HAS_MASK: tl.constexpr, HAS_BAND: tl.constexpr, MASKED: tl.constexpr = True):
    """P = exp(S - lse) on the tile of rows offs_i and keys j0 + [0, BLOCK), 0 on the pairs
    ``_common.pair_mask`` masks and rows whose lse is +inf (no allowed key). ``pattern``
    (``_program_setup``) holds the window (window_left / window_right are >= 0 here: the
    launcher turns unbounded into Lq + Lk) and the padding / dense masks.
    MASKED False: an interior tile (``interior_tiles``: every pair inside the window, every
    key < Lk, no padding / dense mask), nothing to mask (rows past Lq have lse = +inf: P = 0)."""
    if not MASKED:
        return tl.exp2((ac + bd) * qk_scale - lse2[:, None])
    valid = pair_mask(offs_i, j0, ac.shape[1], pattern, True, True, HAS_KPM, HAS_MASK, HAS_BAND)
    s = tl.where(valid, (ac + bd) * qk_scale, float("-inf"))
    return tl.exp2(s - lse2[:, None])


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
# The three main kernels take the same inputs: the pointers A_OP, QV_OP, K, V, R, DO, LSE,
# DELTA, their strides as one ``BwdStrides`` ``strides``, the masks as ``_common.MaskArgs``
# ``masks`` and the dropout as ``_common.DropoutArgs`` ``dropout``; the dk/dv and dr kernels
# also ``q_args`` (``QArgs``, see _program_setup). _program_setup turns them into
# per-(batch, head) NamedTuples (``_Query``, ``_Keys``, ``_Rel``, ``_common.Pattern``,
# ``_Drop``) that the tile helpers read by field name.
# LQ_BUCKET / LK_BUCKET are autotune keys only. The parameter order (pointers, strides,
# sizes, masks, dropout) matters: LLVM ranks arguments by position when it reassociates
# index arithmetic, and with the window ahead of Lq / Lk the dk/dv kernel spills 8 B more on
# sm_90 (the static sm_90 model's --bwd report, sass_profile.py).


class LseStrides(NamedTuple):
    """The (batch, head, row) strides of lse / delta ``[B, H, Lq]``."""
    batch: int
    head: int
    row: int


class BwdStrides(NamedTuple):
    """The main backward kernels' ``strides``: the operand workspaces' ``WorkStrides``, k's,
    v's and dO's ``RowStrides``, r's ``HeadStrides``, lse's (and delta's) ``LseStrides``."""
    work: WorkStrides
    k: RowStrides
    v: RowStrides
    r: HeadStrides
    do: RowStrides
    lse: LseStrides


class QArgs(NamedTuple):
    """q and the biases, for the kernels that form q + u and q + vb themselves (Q_ONLY,
    FROM_Q): q, u, vb, q's ``RowStrides``, the biases' ``BiasStrides``."""
    q: torch.Tensor
    u: torch.Tensor
    vb: torch.Tensor
    stride_q: RowStrides
    stride_bias: BiasStrides


class DkdvOuts(NamedTuple):
    """The dk/dv kernel's ``outs``: dk, dv, the du partials, dk's (and dv's) ``RowStrides``
    and the partials' (b, key tile, h) ``RowStrides``."""
    dk: torch.Tensor
    dv: torch.Tensor
    du_part: torch.Tensor
    stride_dk: RowStrides
    stride_part: RowStrides


class AtomicArgs(NamedTuple):
    """The dk/dv kernel's ``atomics`` (ATOMIC): the fp32 dq accumulator and its
    ``RowStrides``, the fp32 dr accumulator and its (batch, row, head) ``RowStrides`` (batch
    0 unless ORDERED), ORDERED's progress slots and their row per batch * head."""
    dq: torch.Tensor
    stride_dq: RowStrides
    dr: torch.Tensor
    stride_dr: RowStrides
    sems: torch.Tensor
    sem_row: int


class ZStrides(NamedTuple):
    """The (chunk, batch, row, head) strides of the dr kernel's ``[2, B, R, H, D]`` Z."""
    chunk: int
    batch: int
    row: int
    head: int


class _Query(NamedTuple):
    """What ``_load_query_tile`` reads (``_program_setup``): the (q + u) and (q + vb) sources
    (pointers or descriptors of this (batch, head); FROM_Q: q for both), dO's, lse's and
    delta's, the operands', dO's and lse's row strides, and (FROM_Q) the biases in fp32."""
    a: object
    qv: object
    do: object
    lse: object
    delta: object
    stride_w: object
    stride_do: object
    stride_lse: object
    u: object
    vb: object


class _Keys(NamedTuple):
    """What ``_load_kv_tile`` reads: K's and V's sources of this (batch, head), their row
    strides."""
    k: object
    v: object
    stride_k: object
    stride_v: object


class _Rel(NamedTuple):
    """What ``_load_r`` reads: this head's r (pointer or descriptor), its row stride, its rows
    R."""
    base: object
    stride: object
    rows: object


class _Drop(NamedTuple):
    """The dropout of a program (``_recompute_p_ds``): batch * head, Lq, the (seed, offset)
    tensor, the keep-mask's threshold and the kept values' scale."""
    bh: object
    Lq: object
    seed: object
    threshold: object
    keep_scale: object


@triton.jit
def _program_setup(A_OP, QV_OP, K, V, R, DO, LSE, DELTA, strides, masks, dropout, H, Lq, Lk,
                   R_rows, D, HAS_BAND: tl.constexpr, USE_DESC: tl.constexpr,
                   BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, q_args=0,
                   FROM_Q: tl.constexpr = False):
    """Every backward program's prologue: its batch and head (grid axis 0 is batch * head),
    the window narrowed by a mask band (band_on: the band replaces the dense mask, nothing to
    load) and the per-(batch, head) base pointers, computed once; with USE_DESC the [BLOCK,
    BLOCK_D] tiles of (q + u), (q + vb), dO, K, V and r come through TMA descriptors made here
    (zero fill past the rows / D: no pointer math, no masks). FROM_Q: the query tiles are q
    itself (one tile for both operands) and the head's biases u and vb, loaded here in fp32,
    from ``q_args`` (``QArgs``); _load_query_tile forms the operands. Returns (b, h,
    window_left, window_right, query, keys, rel, pattern, drop): query / keys / rel
    (``_Query``, ``_Keys``, ``_Rel``) are what _load_query_tile / _load_kv_tile / _load_r
    read, pattern (``Pattern``) what _probs masks with, drop (``_Drop``) the dropout's."""
    stride_wm = strides.work.row
    stride_k, stride_v, stride_r, stride_do = strides.k, strides.v, strides.r, strides.do
    window_left, window_right = masks.window_left, masks.window_right
    pid_bh = tl.program_id(0).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    band_on = False
    if HAS_BAND:
        window_left, window_right, band_on = apply_mask_band(masks.band, window_left,
                                                             window_right)
    if FROM_Q:
        stride_q = q_args.stride_q
        A_bh = q_args.q + b * stride_q.batch + h * stride_q.head
        QV_bh = A_bh
        stride_wm = stride_q.row
    else:
        A_bh = A_OP + pid_bh * strides.work.bh
        QV_bh = QV_OP + pid_bh * strides.work.bh
    DO_bh = DO + b * stride_do.batch + h * stride_do.head
    K_bh = K + b * stride_k.batch + h * stride_k.head
    V_bh = V + b * stride_v.batch + h * stride_v.head
    R_h = R + h * stride_r.head
    if USE_DESC:
        A_bh = tl.make_tensor_descriptor(A_bh, shape=[Lq, D], strides=[stride_wm, 1],
                                         block_shape=[BLOCK, BLOCK_D])
        if not FROM_Q:
            QV_bh = tl.make_tensor_descriptor(QV_bh, shape=[Lq, D], strides=[stride_wm, 1],
                                              block_shape=[BLOCK, BLOCK_D])
        DO_bh = tl.make_tensor_descriptor(DO_bh, shape=[Lq, D], strides=[stride_do.row, 1],
                                          block_shape=[BLOCK, BLOCK_D])
        K_bh = tl.make_tensor_descriptor(K_bh, shape=[Lk, D], strides=[stride_k.row, 1],
                                         block_shape=[BLOCK, BLOCK_D])
        V_bh = tl.make_tensor_descriptor(V_bh, shape=[Lk, D], strides=[stride_v.row, 1],
                                         block_shape=[BLOCK, BLOCK_D])
        R_h = tl.make_tensor_descriptor(R_h, shape=[R_rows, D], strides=[stride_r.row, 1],
                                        block_shape=[BLOCK, BLOCK_D])
    u = 0.0
    vb = 0.0
    if FROM_Q:
        offs_d = tl.arange(0, BLOCK_D)
        u = tl.load(q_args.u + h * q_args.stride_bias.u + offs_d, mask=offs_d < D,
                         other=0.0).to(tl.float32)
        vb = tl.load(q_args.vb + h * q_args.stride_bias.vb + offs_d, mask=offs_d < D,
                         other=0.0).to(tl.float32)
    stride_l = strides.lse
    query = _Query(a=A_bh, qv=QV_bh, do=DO_bh, lse=LSE + b * stride_l.batch + h * stride_l.head,
                   delta=DELTA + b * stride_l.batch + h * stride_l.head, stride_w=stride_wm,
                   stride_do=stride_do.row, stride_lse=stride_l.row, u=u,
                   vb=vb)
    keys = _Keys(k=K_bh, v=V_bh, stride_k=stride_k.row, stride_v=stride_v.row)
    rel = _Rel(base=R_h, stride=stride_r.row, rows=R_rows)
    pattern = Pattern(b=b, h=h, Lq=Lq, Lk=Lk, window_left=window_left,
                      window_right=window_right, band_on=band_on, kpm=masks.kpm,
                      kpm_strides=masks.kpm_strides, mask=masks.mask,
                      mask_strides=masks.mask_strides)
    drop = _Drop(bh=pid_bh, Lq=Lq, seed=dropout.seed, threshold=dropout.threshold,
                 keep_scale=dropout.keep_scale)
    return b, h, window_left, window_right, query, keys, rel, pattern, drop


@triton.jit
def _load_kv_tile(keys, j0, offs_j, Lk, offs_d, D, DOT_DTYPE: tl.constexpr,
                  USE_DESC: tl.constexpr):
    """The K and V rows j0 + [0, BLOCK) of one key tile (zero past Lk and past D)."""
    if USE_DESC:
        k_t = keys.k.load([j0, 0]).to(DOT_DTYPE)
        v_t = keys.v.load([j0, 0]).to(DOT_DTYPE)
    else:
        k_t = _load_rows(keys.k, offs_j, Lk, keys.stride_k, offs_d, D, DOT_DTYPE)
        v_t = _load_rows(keys.v, offs_j, Lk, keys.stride_v, offs_d, D, DOT_DTYPE)
    return k_t, v_t


@triton.jit
def _load_r(rel, row0, w, offs_d, D, DOT_DTYPE: tl.constexpr, USE_DESC: tl.constexpr):
    """Rows row0 + w (w = [0, BLOCK)) of r (zero outside [0, R) and past D)."""
    if USE_DESC:
        rows = rel.base.load([row0, 0]).to(DOT_DTYPE)
    else:
        rows = _load_rows(rel.base, row0 + w, rel.rows, rel.stride, offs_d, D, DOT_DTYPE)
    return rows


@triton.jit
def _chunks_t(qv_t, r_lo, r_hi, DOT_PREC: tl.constexpr):
    """(T_lo, T_hi) = (q + vb) @ r_lo^T, (q + vb) @ r_hi^T: the window as two [BLOCK] tiles."""
    return (tl.dot(qv_t, tl.trans(r_lo), input_precision=DOT_PREC),
            tl.dot(qv_t, tl.trans(r_hi), input_precision=DOT_PREC))


@triton.jit
def _load_query_tile(query, i0, offs_i, offs_d, Lq, D, DOT_DTYPE: tl.constexpr,
                     USE_DESC: tl.constexpr, FROM_Q: tl.constexpr = False,
                     IN_DTYPE: tl.constexpr = None, UPCAST: tl.constexpr = False,
                     ROUND: tl.constexpr = True):
    """One query tile's operands (rows i0 + [0, BLOCK); pointers or descriptors pre-offset to
    the batch and head): (q + u) and (q + vb) as the preprocess kernel rounded them (FROM_Q:
    formed here from one q tile the same way, in fp32 then rounded to IN_DTYPE: one tile load
    instead of two; with ROUND False both are the q tile itself, for the caller to form), dO,
    the log-sum-exp in log2 units (+inf past Lq) and delta."""
    in_i = offs_i < Lq
    if USE_DESC:
        a_t = query.a.load([i0, 0])
        if FROM_Q:
            qv_t = a_t
        else:
            qv_t = query.qv.load([i0, 0])
        do = query.do.load([i0, 0]).to(DOT_DTYPE)
    else:
        rows_i = offs_i.to(tl.int64)[:, None]
        q_msk = in_i[:, None] & (offs_d < D)[None, :]
        a_t = tl.load(query.a + rows_i * query.stride_w + offs_d[None, :], mask=q_msk,
                      other=0.0)
        if FROM_Q:
            qv_t = a_t
        else:
            qv_t = tl.load(query.qv + rows_i * query.stride_w + offs_d[None, :], mask=q_msk,
                           other=0.0)
        do = tl.load(query.do + rows_i * query.stride_do + offs_d[None, :], mask=q_msk,
                     other=0.0).to(DOT_DTYPE)
    if FROM_Q and ROUND:
        a_t, qv_t = bias_operands(a_t.to(tl.float32), query.u, query.vb, IN_DTYPE,
                                  UPCAST)
    elif FROM_Q:
        a_t = a_t.to(DOT_DTYPE)
        qv_t = a_t
    l_off = offs_i.to(tl.int64) * query.stride_lse
    lse2 = tl.load(query.lse + l_off, mask=in_i, other=float("inf")) * LOG2E
    delta = tl.load(query.delta + l_off, mask=in_i, other=0.0)
    return a_t, qv_t, do, lse2, delta


@triton.jit
def _recompute_p_ds(a_t, do, k_t, v_t, t_lo, t_hi, lse2, delta, i0, j0, offs_i, qk_scale,
                    pattern, drop, HAS_KPM: tl.constexpr, HAS_MASK: tl.constexpr,
                    HAS_BAND: tl.constexpr, DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
                    SKEW_GATHER: tl.constexpr, BLOCK: tl.constexpr, IN_DTYPE: tl.constexpr,
                    UPCAST: tl.constexpr, MASKED: tl.constexpr = True):
    """P and dS = P (dP - delta), dP = dO V^T, on one tile (MASKED: as in _probs), computed in
    fp32; BD is the skew of the two window chunks [T_lo | T_hi] = (q + vb) @ [R_lo | R_hi]^T
    (``_chunks_t``; both recomputed per tile: carrying one would keep another
    fp32 tile live). Returns (Pv, dS): Pv rounded to the operand dtype (IN_DTYPE) for the dV
    product, dS in fp32 (the callers round it, and its unskewed copy: rotating fp32 values is
    plain selects, where 16-bit ones packed two to a register need byte permutes). Pv is P as
    the forward applied it to V (for dV) up to its scale: P itself (recomputed from lse, 0 where
    masked), or with DROPOUT P Z, Z the forward's keep-mask regenerated from the same Philox
    counters (the caller scales dV by 1 / (1 - p) once); dP then becomes dO V^T Z / (1 - p),
    the gradient w.r.t. the undropped P, and
    dS = P (dP - delta) holds as without dropout (delta = rowsum(dO O) = rowsum(P dP)).
    i0 / j0: the tile's first query row and key (offs_i starts at i0); ``drop``: see
    _program_setup."""
    bd = _skew(t_lo, t_hi, BLOCK, SKEW_GATHER)
    ac = tl.dot(a_t, tl.trans(k_t), input_precision=DOT_PREC)
    p = _probs(ac, bd, lse2, offs_i, j0, qk_scale, pattern, HAS_KPM, HAS_MASK, HAS_BAND,
               MASKED)
    dp = tl.dot(do, tl.trans(v_t), input_precision=DOT_PREC)
    pv = p
    if DROPOUT:
        drop_seed, drop_off = load_dropout_seed(drop.seed)
        keep = dropout_keep(drop_seed, drop_off, drop.bh, i0, j0, drop.Lq, drop.threshold,
                            BLOCK, BLOCK)
        pv = tl.where(keep, p, 0.0)  # (dV takes the 1 / (1 - p) once, in the dk/dv kernel)
        ds = p * (tl.where(keep, dp, 0.0) * drop.keep_scale - delta[:, None])
    else:
        ds = p * (dp - delta[:, None])
    return to_operand(pv, IN_DTYPE, UPCAST), ds


@triton.jit
def _rel_attn_bwd_preprocess_kernel(
    O, DO, Q, U, VB, DELTA, A_OP, QV_OP,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    stride_qb, stride_qm, stride_qh,
    stride_uh, stride_vbh,
    stride_lb, stride_lh, stride_lm,
    stride_wbh, stride_wm,
    H, Lq, D,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    OPERANDS: tl.constexpr = True,
):
    """Per query row, once: delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] in fp32, and
    (OPERANDS) the tensor-core operands (q + u) and (q + vb) rounded to the input dtype exactly
    as the forward rounds them, into [B * H, Lq, D] workspaces (the later kernels load them as
    is)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    msk = (offs_m < Lq)[:, None] & d_ok[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(O + b * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :],
                mask=msk, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows * stride_dom + offs_d[None, :],
                 mask=msk, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    tl.store(DELTA + b * stride_lb + h * stride_lh + offs_m.to(tl.int64) * stride_lm, delta,
             mask=offs_m < Lq)
    if OPERANDS:
        store_bias_operands(Q + b * stride_qb + h * stride_qh, U + h * stride_uh,
                            VB + h * stride_vbh, A_OP + pid_bh * stride_wbh,
                            QV_OP + pid_bh * stride_wbh, rows, offs_d, d_ok, msk, stride_qm,
                            stride_wm, UPCAST)


# ORDERED: the progress a program has published once its adds are all done
_DONE = tl.constexpr(1 << 30)


# Spin until the int32 at $1 is >= $2, with acquire loads (each thread, so that its own adds
# come after): one asm block, not a loop in the kernel's IR, which would stop Triton from
# pipelining the loop around it (only innermost loops are pipelined). The label is local to the
# braces (CUTLASS's barrier waits have the same shape).
_SPIN_PTX = tl.constexpr("{ .reg .pred p;\n.reg .b32 v;\nTXL_SPIN:\n"
                         "ld.acquire.gpu.global.b32 v, [$1];\nsetp.lt.s32 p, v, $2;\n"
                         "@p bra TXL_SPIN;\nmov.b32 $0, v; }")


@triton.jit
def _turn_wait(PROG, target, last):
    """ORDERED: wait until the program of the key tile after this one (PROG + 1; none for the
    ``last``) has published progress >= target. (The interpreter runs the programs one after
    another, in grid order, which ORDERED maps to descending key tiles: there it always
    has.)"""
    if _PTX:
        nxt = tl.where(last, PROG, PROG + 1)
        target = tl.where(last, 0, target)
        tl.inline_asm_elementwise(_SPIN_PTX, "=r,l,r", [nxt.to(tl.int64, bitcast=True), target],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _turn_pass(PROG, progress):
    """ORDERED: once every thread's adds are issued (a CTA barrier, as asm: Triton does not
    pipeline a loop around its own barrier op), publish ``progress`` (one thread, release)."""
    if _PTX:
        tl.inline_asm_elementwise("bar.sync 0;\nmov.b32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
    tl.atomic_xchg(PROG, progress, sem="release")


class _DrSums(NamedTuple):
    """Q_ONLY's dr sums of one window chunk (``_dr_product``): dt^T q, and dt^T e0, whose
    column 0 holds dt's column sums."""
    q_term: object
    col_sums: object


class _VTerm(NamedTuple):
    """Q_ONLY's bias operands of the dr sums (``_dr_product``, ``_dr_value``): e0 = [1, 0,
    ..., 0] per row ([BLOCK, 16]) and v16 = [vb; 0; ...] ([16, BLOCK_D])."""
    e0: object
    v16: object


class _Order(NamedTuple):
    """ORDERED's turn of one query tile (``_dq_dr_atomics``): this program's progress slot,
    whether it is the last key tile, the progress this query tile publishes."""
    prog: object
    last: object
    progress: object


@triton.jit
def _dr_product(dt, qv_b, pend, e0, Q_ONLY: tl.constexpr, DOT_PREC: tl.constexpr):
    """dt^T (q + vb) for the r rows of one window chunk (dt: its part of the unskewed dS),
    accumulated onto ``pend`` (None: a new sum). Q_ONLY: qv_b is the q tile itself and the
    result a ``_DrSums`` (dt^T q, dt^T e0), whose col_sums' column 0 holds dt's column sums:
    the vb term, added by _dr_value."""
    if Q_ONLY:
        if pend is None:
            out = _DrSums(tl.dot(tl.trans(dt), qv_b, input_precision=DOT_PREC),
                          tl.dot(tl.trans(dt), e0, input_precision=DOT_PREC))
        else:
            out = _DrSums(tl.dot(tl.trans(dt), qv_b, pend.q_term, input_precision=DOT_PREC),
                          tl.dot(tl.trans(dt), e0, pend.col_sums, input_precision=DOT_PREC))
    else:
        out = tl.dot(tl.trans(dt), qv_b, pend, input_precision=DOT_PREC)
    return out


@triton.jit
def _dr_value(part, v16, Q_ONLY: tl.constexpr, DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr,
              DOT_PREC: tl.constexpr):
    """The [BLOCK, D] dr rows of a _dr_product sum. Q_ONLY: dt^T q + (column sums) vb^T,
    the outer product as two narrow products with v16 (row 0: vb), the sums split into a
    rounded head and its remainder (fp32 precision)."""
    if Q_ONLY:
        x, c = part.q_term, part.col_sums
        c_hi = to_operand(c, DOT_DTYPE, UPCAST)
        x = tl.dot(c_hi, v16, x, input_precision=DOT_PREC)
        x = tl.dot((c - c_hi.to(tl.float32)).to(DOT_DTYPE), v16, x, input_precision=DOT_PREC)
    else:
        x = part
    return x


@triton.jit
def _dq_dr_atomics(ds_op, ds, k_t, r_lo, r_hi, qv_t, q_t, dr_pend, at, m, p_lo, w, offs_i,
                   Lq, R_rows, offs_d, d_ok, softmax_scale, vterm, DOT_DTYPE: tl.constexpr,
                   UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, SKEW_GATHER: tl.constexpr,
                   BLOCK: tl.constexpr, IN_DTYPE: tl.constexpr, ORDERED: tl.constexpr,
                   Q_ONLY: tl.constexpr):
    """The dk/dv kernel's ATOMIC part for one query tile: its dq terms, dA + dQv = dS K
    + [G_lo | G_hi] [r_lo; r_hi] (G the unskewed dS, split into its window chunks), added unscaled
    to the dq accumulator (fp32 atomics; the launcher scales), and dr: the hi chunk's rows ``rows``
    get dr_pend (the previous query tile's lo-chunk part: the same rows) plus this tile's G_hi^T
    Qv; returns this tile's G_lo^T Qv, pending for the next tile. ORDERED (the query tiles go
    down): the same with lo and hi swapped, and ``order`` (an ``_Order``): the adds wait for the
    next key tile's program to get as far, then publish it. ``at``: the ``_AtomicTile``; the
    query tile m's window starts at r row p_lo (its rows p_lo + w and p_lo + BLOCK + w).
    Q_ONLY: the dr products take the q tile ``q_t`` in place of ``qv_t`` and the dr sums carry
    the vb term apart (_dr_product, _dr_value; ``vterm``: a ``_VTerm``)."""
    order = 0
    rows = p_lo + BLOCK + w  # the hi chunk's rows (ORDERED: the lo chunk's)
    if ORDERED:
        order = _Order(prog=at.prog, last=at.last, progress=at.mq - m)
        rows = p_lo + w
    if Q_ONLY:
        qv_t = q_t
    lo_part = at.lo_part
    g = to_operand(_unskew(ds, BLOCK, SKEW_GATHER), IN_DTYPE, UPCAST)
    dt_lo = tl.where(lo_part, g, 0.0).to(DOT_DTYPE)
    dt_hi = tl.where(lo_part, 0.0, g).to(DOT_DTYPE)
    dq = tl.dot(ds_op, k_t, input_precision=DOT_PREC)
    dq = tl.dot(dt_lo, r_lo, dq, input_precision=DOT_PREC)
    dq = tl.dot(dt_hi, r_hi, dq, input_precision=DOT_PREC)
    if ORDERED:  # query tiles going down: flush the lo chunk's rows, carry the hi chunk's
        _turn_wait(order.prog, order.progress, order.last)
        flush, carry = dt_lo, dt_hi
    else:
        flush, carry = dt_hi, dt_lo
    _atomic_add(at.dq, offs_i * at.stride_dq, offs_d, dq, offs_i < Lq, d_ok)
    x = _dr_value(_dr_product(flush, qv_t, dr_pend, vterm.e0, Q_ONLY, DOT_PREC), vterm.v16,
                  Q_ONLY, DOT_DTYPE, UPCAST, DOT_PREC)
    _dr_add(at.dr, x, rows, R_rows, at.stride_dr, offs_d, d_ok, softmax_scale)
    if ORDERED:
        _turn_pass(order.prog, order.progress)
    return _dr_product(carry, qv_t, None, vterm.e0, Q_ONLY, DOT_PREC)


class _AtomicTile(NamedTuple):
    """The dk/dv kernel's ATOMIC invariants (``_atomic_setup``): this (batch, head)'s dq and
    dr accumulators and their row strides, the lo-chunk selector, and ORDERED's number of
    query tiles, whether this is the last key tile, and this program's progress slot."""
    dq: object
    dr: object
    stride_dq: object
    stride_dr: object
    lo_part: object
    mq: object
    last: object
    prog: object


@triton.jit
def _atomic_setup(atomics, b, h, n, H, Lq, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                  Q_ONLY: tl.constexpr):
    """The dk/dv kernel's ATOMIC invariants (an ``_AtomicTile``) and its first pending dr sum
    (zeros; Q_ONLY: a ``_DrSums``), from ``atomics`` (``AtomicArgs``).

    The pending sum is the dr of the current tile's hi window chunk, pending its lo-chunk part
    from the previous query tile (the same r rows). ORDERED: the query tiles go down, m =
    m_hi - 1 .. m_lo, and key tile n publishes in PROG[n] how far it has got (Mq - m once
    query tile m's adds are issued, Mq = cdiv(Lq, BLOCK); _DONE after the last flush). Query
    tile m's adds (dq tile m, dr block rows from p_lo) wait until PROG[n + 1] >= Mq - m, the
    last flush until it is _DONE. By induction down from the last key tile, every key tile
    after n then has made all its adds to those rows (dq tile m at its query tile m, the dr
    rows at query tile m + 1: the tile ranges only move up with n), so every row takes its
    adds in key-tile order (descending). Where the query range ends at the same tile for n and
    n + 1 (causal, or no left window), n + 1 reaches dq tile m at the same step and the dr
    rows a step earlier, so n hardly waits (docs/DESIGN.md: the other directions make each
    level of the chain a step later)."""
    stride_dqa, stride_dr = atomics.stride_dq, atomics.stride_dr
    DQ_bh = atomics.dq + b * stride_dqa.batch + h * stride_dqa.head
    DR_h = atomics.dr + b * stride_dr.batch + h * stride_dr.head
    lo_part = _lo_part(BLOCK)
    dr_pend = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    if Q_ONLY:
        dr_pend = _DrSums(dr_pend, tl.zeros([BLOCK, 16], dtype=tl.float32))
    Mq = tl.cdiv(Lq, BLOCK)
    last = n == tl.num_programs(1) - 1
    PROG = atomics.sems + (b * H + h) * atomics.sem_row + n
    at = _AtomicTile(dq=DQ_bh, dr=DR_h, stride_dq=stride_dqa.row, stride_dr=stride_dr.row,
                     lo_part=lo_part, mq=Mq, last=last, prog=PROG)
    return at, dr_pend


@triton.jit
def _atomic_flush(at, dr_pend, vterm, j0, m_lo, m_hi, r_c1, w, R_rows, offs_d, d_ok, softmax_scale,
                  DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                  BLOCK: tl.constexpr, ORDERED: tl.constexpr, Q_ONLY: tl.constexpr):
    """ATOMIC, after the last query tile: the pending dr sum, of the last tile's lo chunk
    (ORDERED: the hi chunk of tile m_lo, in turn, then this program's progress published as
    _DONE)."""
    rows = j0 - m_hi * BLOCK + r_c1 + w
    if ORDERED:
        rows = j0 - m_lo * BLOCK + r_c1 + w
        _turn_wait(at.prog, _DONE, at.last)
    _dr_add(at.dr, _dr_value(dr_pend, vterm.v16, Q_ONLY, DOT_DTYPE, UPCAST, DOT_PREC), rows,
            R_rows, at.stride_dr, offs_d, d_ok, softmax_scale)
    if ORDERED:
        _turn_pass(at.prog, _DONE)


@triton.jit
def _query_tiles(j0, mlen, window_left, window_right, Lq, BLOCK: tl.constexpr):
    """``[m_lo, m_hi)``: the query tiles with rows that may see a key of the key tile at j0:
    d = i + mlen - j in [-window_right, window_left] (both >= 0 here)."""
    i_lo = tl.maximum(j0 - mlen - window_right, 0)
    i_hi = tl.minimum(j0 + BLOCK - 1 + window_left - mlen, Lq - 1)
    m_lo = i_lo // BLOCK
    m_hi = (tl.maximum(i_hi, -1) + BLOCK) // BLOCK
    return m_lo, m_hi


@triton.jit
def _key_tile(ORDERED: tl.constexpr):
    """The dk/dv program's key tile: grid axis 1, or (ORDERED) in reverse grid order (n + 1,
    which n waits for, starts first)."""
    n = tl.program_id(1)
    if ORDERED:
        n = tl.num_programs(1) - 1 - n
    return n


@triton.jit
def _du_operand(BLOCK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """e0 = [1, 0, ..., 0] per row ([BLOCK, 16]), the dk/dv kernel's operand for the column
    sums of dS.

    du: DU_DOT, the column sums of the rounded dS (the dK product's operand) as one narrow
    product ds^T @ e0 (column 0 holds the sums, the others 0): 8 registers a thread at BLOCK
    64 where a carried [BLOCK, BLOCK] fp32 tile takes 32 (sm_90, D <= 64); else the fp32 dS
    tiles summed elementwise: fewer spills on the small-tile families' mma.sync / tcgen05
    layouts (_DU_DOT_FAMILIES), and at D 128 on sm_90 fewer spills without flags and a faster
    loop in the static model."""
    e0 = (tl.arange(0, 16)[None, :] == 0) & (tl.arange(0, BLOCK)[:, None] >= 0)
    return e0.to(DOT_DTYPE)


@triton.jit
def _q_only_biases(query, e0, DOT_DTYPE: tl.constexpr, Q_ONLY: tl.constexpr):
    """(u, vb, vterm). Q_ONLY: the biases in the operand dtype (exact: they are
    stored in the input dtype), and the ``_VTerm`` of the dr sums (v16 = [vb; 0; ...]); else
    0, 0 and a ``_VTerm`` with v16 0."""
    u = 0
    vb = 0
    vterm = _VTerm(e0=e0, v16=0)
    if Q_ONLY:
        u, vb = query.u.to(DOT_DTYPE), query.vb.to(DOT_DTYPE)
        vterm = _VTerm(e0=e0, v16=tl.where(tl.arange(0, 16)[:, None] == 0, vb[None, :],
                                           0.0).to(DOT_DTYPE))
    return u, vb, vterm


@triton.jit
def _dkdv_query_tile(query, m, u, vb, offs_d, Lq, D, DOT_DTYPE: tl.constexpr,
                     USE_DESC: tl.constexpr, Q_ONLY: tl.constexpr, IN_DTYPE: tl.constexpr,
                     UPCAST: tl.constexpr, BLOCK: tl.constexpr):
    """Query tile m of the dk/dv kernel: (i0, offs_i, a_t, qv_t, q_t, do, lse2, delta), q_t
    the operand of the dK product (``_load_query_tile``'s (q + u); Q_ONLY: q itself, with
    (q + u) and (q + vb) summed here in the operand dtype: fewer registers than fp32
    sums)."""
    i0 = m * BLOCK
    offs_i = i0 + tl.arange(0, BLOCK)
    a_t, qv_t, do, lse2, delta = _load_query_tile(query, i0, offs_i, offs_d, Lq, D, DOT_DTYPE,
                                                  USE_DESC, Q_ONLY, IN_DTYPE, UPCAST, False)
    q_t = a_t
    if Q_ONLY:
        a_t, qv_t = bias_operands(q_t, u, vb, IN_DTYPE, UPCAST)
    return i0, offs_i, a_t, qv_t, q_t, do, lse2, delta


@triton.jit
def _store_dkdv(dk, dv, ds_cols, ds_sum, k_t, outs, q_args, b, h, n, offs_j, offs_d, d_ok,
                kv_msk, softmax_scale, keep_scale, DU_DOT: tl.constexpr, Q_ONLY: tl.constexpr,
                DROPOUT: tl.constexpr, UPCAST: tl.constexpr):
    """The key tile's results into ``outs`` (``DkdvOuts``): its du part, softmax_scale *
    (column sums of dS) . K, once (the sum over ds_cols' columns adds zeros to column 0:
    exact), and dk, dv (DROPOUT: dv with the kept probabilities' 1 / (1 - p), ``keep_scale``)."""
    stride_part = outs.stride_part
    part_off = (b * stride_part.batch + n.to(tl.int64) * stride_part.row
                + h * stride_part.head + offs_d)
    if DU_DOT:
        col_sums = tl.sum(ds_cols, axis=1)
    else:
        col_sums = tl.sum(ds_sum, axis=0)
    tl.store(outs.du_part + part_off,
             tl.sum(col_sums[:, None] * k_t.to(tl.float32), axis=0) * softmax_scale, mask=d_ok)
    if Q_ONLY:  # dS^T (q + u) = dS^T q + (column sums of dS) u; u loaded again here (held
        # through the loop, its fp32 copy would take registers from it)
        dk += col_sums[:, None] * tl.load(q_args.u + h * q_args.stride_bias.u + offs_d,
                                          mask=d_ok, other=0.0).to(tl.float32)[None, :]
    dk = dk * softmax_scale
    if DROPOUT:  # (_recompute_p_ds)
        dv = dv * keep_scale
    stride_dk = outs.stride_dk
    out_off = (b * stride_dk.batch + h * stride_dk.head
               + offs_j.to(tl.int64)[:, None] * stride_dk.row + offs_d[None, :])
    tl.store(outs.dk + out_off, _output(dk, outs.dk.dtype.element_ty, UPCAST), mask=kv_msk)
    tl.store(outs.dv + out_off, _output(dv, outs.dv.dtype.element_ty, UPCAST), mask=kv_msk)


@triton.jit
def _rel_attn_bwd_dkdv_kernel(
    A_OP, QV_OP, K, V, R, DO, LSE, DELTA, outs, strides, atomics, q_args, H, Lq, Lk, R_rows,
    r_shift1, D, softmax_scale, qk_scale, masks, dropout, LQ_BUCKET, LK_BUCKET,
    HAS_KPM: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BAND: tl.constexpr,
    DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    SKEW_GATHER: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    DROPOUT: tl.constexpr = False, USE_DESC: tl.constexpr = False,
    DU_DOT: tl.constexpr = True, ATOMIC: tl.constexpr = False, ORDERED: tl.constexpr = False,
    Q_ONLY: tl.constexpr = False,
):
    """One program per (batch * head, key tile): dk and dv of the tile, looping over the query
    tiles that the window lets see it, and the tile's part of du (softmax_scale * column sums
    of dS . K: the row sums of dA = softmax_scale dS K) in the du partials of ``outs``
    (``DkdvOuts``) at [b, key tile, h]. ATOMIC: also dq and dr, added to ``atomics``
    (``AtomicArgs``); ORDERED: every dq and dr row takes the key tiles' adds in key-tile order
    (the progress slots: each program's progress), so the sums are the same from run to run.
    Q_ONLY (with ATOMIC): one q tile per query tile instead of the two preprocessed operands
    (``q_args`` as in _program_setup): (q + u) and (q + vb) are rounded here as the forward
    rounds them, for the products that recompute S, and the gradient products take q itself
    plus the bias terms in fp32: dK = dS^T q + (column sums of dS) u, dr = G^T q + (column
    sums of G) vb."""
    n = _key_tile(ORDERED)
    j0 = n * BLOCK
    offs_j = j0 + tl.arange(0, BLOCK)
    mlen = Lk - Lq
    r_c1 = Lq + (r_shift1 - 1)  # the pairs read r rows j - i + r_c1 - 1 (_ROW_SHIFT)
    b, h, window_left, window_right, query, keys, rel, pattern, drop = _program_setup(
        A_OP, QV_OP, K, V, R, DO, LSE, DELTA, strides, masks, dropout, H, Lq, Lk, R_rows, D,
        HAS_BAND, USE_DESC, BLOCK, BLOCK_D, q_args, Q_ONLY)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_msk = (offs_j < Lk)[:, None] & d_ok[None, :]
    k_t, v_t = _load_kv_tile(keys, j0, offs_j, Lk, offs_d, D, DOT_DTYPE, USE_DESC)
    m_lo, m_hi = _query_tiles(j0, mlen, window_left, window_right, Lq, BLOCK)
    dk = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    e0 = _du_operand(BLOCK, DOT_DTYPE)  # (DU_DOT; else the dS tiles summed in ds_sum)
    ds_cols = tl.zeros([BLOCK, 16], dtype=tl.float32)
    ds_sum = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    # The window of query tile m is r rows j0 - i0 + r_c1 - BLOCK + [0, 2 BLOCK) (the pairs
    # read rows j - i + r_c1 - 1): its hi chunk is the previous tile's lo chunk, carried, so
    # one r tile is loaded per query tile. (ORDERED walks the query tiles down: its lo chunk
    # is the previous tile's hi chunk.)
    w = tl.arange(0, BLOCK)
    if ORDERED:
        r_lo = _load_r(rel, j0 - m_hi * BLOCK + r_c1, w, offs_d, D, DOT_DTYPE, USE_DESC)
    else:
        r_hi = _load_r(rel, j0 - m_lo * BLOCK + r_c1, w, offs_d, D, DOT_DTYPE, USE_DESC)
    u, vb, vterm = _q_only_biases(query, e0, DOT_DTYPE, Q_ONLY)
    if ATOMIC:  # (the pending dr sum and ORDERED's turns: _atomic_setup)
        at, dr_pend = _atomic_setup(atomics, b, h, n, H, Lq, BLOCK, BLOCK_D, Q_ONLY)
    m_first, m_stop, m_step = m_lo, m_hi, 1
    if ORDERED:  # (the query tiles going down)
        m_first, m_stop, m_step = m_hi - 1, m_lo - 1, -1
    for m in range(m_first, m_stop, m_step):
        i0, offs_i, a_t, qv_t, q_t, do, lse2, delta = _dkdv_query_tile(
            query, m, u, vb, offs_d, Lq, D, DOT_DTYPE, USE_DESC, Q_ONLY,
            K.dtype.element_ty, UPCAST, BLOCK)
        p_lo = j0 - i0 + r_c1 - BLOCK
        if ORDERED:
            r_hi = _load_r(rel, p_lo + BLOCK, w, offs_d, D, DOT_DTYPE, USE_DESC)
        else:
            r_lo = _load_r(rel, p_lo, w, offs_d, D, DOT_DTYPE, USE_DESC)
        t_lo, t_hi = _chunks_t(qv_t, r_lo, r_hi, DOT_PREC)
        p, ds = _recompute_p_ds(a_t, do, k_t, v_t, t_lo, t_hi, lse2, delta, i0, j0, offs_i,
                                qk_scale, pattern, drop, HAS_KPM, HAS_MASK, HAS_BAND,
                                DROPOUT, DOT_PREC, SKEW_GATHER, BLOCK, K.dtype.element_ty, UPCAST)
        dv = tl.dot(tl.trans(p), do, dv, input_precision=DOT_PREC)
        ds_op = to_operand(ds, K.dtype.element_ty, UPCAST)
        ds_t = tl.trans(ds_op)
        dk = tl.dot(ds_t, q_t, dk, input_precision=DOT_PREC)  # (+ column sums x u below)
        if DU_DOT:
            ds_cols = tl.dot(ds_t, e0, ds_cols, input_precision=DOT_PREC)
        else:
            ds_sum += ds
        if ATOMIC:
            dr_pend = _dq_dr_atomics(ds_op, ds, k_t, r_lo, r_hi, qv_t, q_t, dr_pend, at, m,
                                     p_lo, w, offs_i, Lq, R_rows, offs_d, d_ok, softmax_scale,
                                     vterm, DOT_DTYPE, UPCAST, DOT_PREC, SKEW_GATHER, BLOCK,
                                     K.dtype.element_ty, ORDERED, Q_ONLY)
        if ORDERED:
            r_lo = r_hi
        else:
            r_hi = r_lo
    if ATOMIC:
        _atomic_flush(at, dr_pend, vterm, j0, m_lo, m_hi, r_c1, w, R_rows, offs_d, d_ok,
                      softmax_scale, DOT_DTYPE, UPCAST, DOT_PREC, BLOCK, ORDERED, Q_ONLY)
    _store_dkdv(dk, dv, ds_cols, ds_sum, k_t, outs, q_args, b, h, n, offs_j, offs_d, d_ok,
                kv_msk, softmax_scale, drop.keep_scale, DU_DOT, Q_ONLY, DROPOUT, UPCAST)


class _QueryRows(NamedTuple):
    """One query tile as ``_load_query_tile`` returns it, with its rows: the (q + u) and
    (q + vb) operands, dO, lse in log2 units, delta, the first row i0 and the rows offs_i."""
    a: object
    qv: object
    do: object
    lse2: object
    delta: object
    i0: object
    offs_i: object


class _DqTile(NamedTuple):
    """The dq kernel's loop invariants (``_dq_tile``): its ``_QueryRows``, the columns and
    those in range, the lo-chunk selector, the window offsets w, _program_setup's keys / rel
    / pattern / drop, the dr rows of this head and their row stride (ATOMIC_DR), Lk, R, D
    and the two scales."""
    rows: _QueryRows
    offs_d: object
    d_ok: object
    lo_part: object
    w: object
    keys: object
    rel: object
    dr: object
    stride_dr: object
    pattern: object
    drop: object
    Lk: object
    R_rows: object
    D: object
    softmax_scale: object
    qk_scale: object


@triton.jit
def _dq_tile(carry, n, tile, HAS_KPM: tl.constexpr, HAS_MASK: tl.constexpr,
             HAS_BAND: tl.constexpr, ATOMIC_DR: tl.constexpr, DOT_DTYPE: tl.constexpr,
             UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, SKEW_GATHER: tl.constexpr,
             BLOCK: tl.constexpr, DROPOUT: tl.constexpr, USE_DESC: tl.constexpr,
             MASKED: tl.constexpr, IN_DTYPE: tl.constexpr):
    """One key tile n of the dq kernel's loop: carry (dq, g_prev, p_lo, r_lo) -> the
    same after it; ``tile`` the query tile's loop invariants (``_DqTile``). The window's lo
    chunk of r is the last tile's hi chunk, carried: one r tile loaded per key tile."""
    dq, g_prev, p_lo, r_lo = carry
    q = tile.rows
    offs_d, w = tile.offs_d, tile.w
    j0 = n * BLOCK
    offs_j = j0 + tl.arange(0, BLOCK)
    k_t, v_t = _load_kv_tile(tile.keys, j0, offs_j, tile.Lk, offs_d, tile.D, DOT_DTYPE,
                             USE_DESC)
    r_hi = _load_r(tile.rel, p_lo + BLOCK, w, offs_d, tile.D, DOT_DTYPE, USE_DESC)
    t_lo, t_hi = _chunks_t(q.qv, r_lo, r_hi, DOT_PREC)
    p, ds = _recompute_p_ds(q.a, q.do, k_t, v_t, t_lo, t_hi, q.lse2, q.delta, q.i0, j0,
                            q.offs_i, tile.qk_scale, tile.pattern, tile.drop, HAS_KPM,
                            HAS_MASK, HAS_BAND, DROPOUT, DOT_PREC, SKEW_GATHER, BLOCK, IN_DTYPE,
                            UPCAST, MASKED)
    dq = tl.dot(to_operand(ds, IN_DTYPE, UPCAST), k_t, dq, input_precision=DOT_PREC)  # dA
    # rows p_lo ..: the lo part of this tile's unskewed dS and the hi part of the previous
    # tile's have disjoint supports: one merge, one product with the shared rows.
    g = _unskew(ds, BLOCK, SKEW_GATHER)
    dt = to_operand(tl.where(tile.lo_part, g, g_prev), IN_DTYPE, UPCAST)
    dq = tl.dot(dt, r_lo, dq, input_precision=DOT_PREC)  # dQv
    if ATOMIC_DR:
        _dr_add(tile.dr, tl.dot(tl.trans(dt), q.qv, input_precision=DOT_PREC), p_lo + w,
                tile.R_rows, tile.stride_dr, offs_d, tile.d_ok, tile.softmax_scale)
    return dq, g, p_lo + BLOCK, r_hi


@triton.jit
def _rel_attn_bwd_dq_kernel(
    A_OP, QV_OP, K, V, R, DO, LSE, DELTA, DQ, DQ_PART, DR_ACC,
    strides, stride_dq, stride_part, stride_dr,
    H, Lq, Lk, R_rows, r_shift1, D, softmax_scale, qk_scale, masks, dropout, LQ_BUCKET, LK_BUCKET,
    HAS_KPM: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BAND: tl.constexpr,
    ATOMIC_DR: tl.constexpr,
    DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    SKEW_GATHER: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    DROPOUT: tl.constexpr = False, USE_DESC: tl.constexpr = False,
):
    """One program per (batch * head, query tile): dq of the tile (dA + dQv, in one
    accumulator) and its row sum (DQ_PART: dvb = sum(dq) - du, du from the dk/dv kernel),
    looping over the key tiles of the window in increasing order with the window chunk carried
    from tile to tile. With ATOMIC_DR also dr (atomics). Strides: stride_dq and stride_part
    (DQ_PART's) ``RowStrides``, stride_dr ``HeadStrides``."""
    num_m = tl.cdiv(Lq, BLOCK)
    m = num_m - 1 - tl.program_id(1)  # longest rows (causal) first
    mlen = Lk - Lq
    r_c1 = Lq + (r_shift1 - 1)  # the pairs read r rows j - i + r_c1 - 1 (_ROW_SHIFT)
    b, h, window_left, window_right, query, keys, rel, pattern, drop = _program_setup(
        A_OP, QV_OP, K, V, R, DO, LSE, DELTA, strides, masks, dropout, H, Lq, Lk, R_rows, D,
        HAS_BAND, USE_DESC, BLOCK, BLOCK_D)

    i0 = m * BLOCK
    offs_i = i0 + tl.arange(0, BLOCK)
    in_i = offs_i < Lq
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    rows_i = offs_i.to(tl.int64)[:, None]
    q_msk = in_i[:, None] & d_ok[None, :]
    a_t, qv_t, do, lse2, delta = _load_query_tile(query, i0, offs_i, offs_d, Lq, D, DOT_DTYPE,
                                                  USE_DESC)

    # Keys this query tile may see: d = i + mlen - j in [-window_right, window_left].
    j_lo = tl.maximum(i0 + mlen - window_left, 0)
    j_hi = tl.minimum(i0 + BLOCK - 1 + mlen + window_right, Lk - 1)
    n_lo = j_lo // BLOCK
    n_hi = (tl.maximum(j_hi, -1) + BLOCK) // BLOCK

    w = tl.arange(0, BLOCK)
    DR_h = DR_ACC + h * stride_dr.head
    # Columns w of an unskewed dS tile with w + a >= BLOCK - 1 (row a) are its lo window chunk,
    # the others its hi chunk.
    lo_part = _lo_part(BLOCK)
    # first r row of the lo chunk of the current tile (pairs read rows j - i + r_c1 - 1)
    p_lo = n_lo * BLOCK - i0 + r_c1 - BLOCK
    g_prev = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)  # its hi part is pending
    dq = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    carry = (dq, g_prev, p_lo, _load_r(rel, p_lo, w, offs_d, D, DOT_DTYPE, USE_DESC))
    tile = _DqTile(rows=_QueryRows(a=a_t, qv=qv_t, do=do, lse2=lse2, delta=delta, i0=i0,
                                   offs_i=offs_i),
                   offs_d=offs_d, d_ok=d_ok, lo_part=lo_part, w=w, keys=keys, rel=rel, dr=DR_h,
                   stride_dr=stride_dr.row, pattern=pattern, drop=drop, Lk=Lk, R_rows=R_rows,
                   D=D, softmax_scale=softmax_scale, qk_scale=qk_scale)
    # three runs of key tiles, in order (the window chunk is carried), as in the forward:
    # [n_lo, n_a) the left band edge (masked), [n_a, n_b) the interior (mask-free,
    # interior_tiles), [n_b, n_hi) the right edge and the Lk tail (masked); with a padding or
    # dense mask only the last
    n_a = n_lo
    n_b = n_lo
    if not (HAS_KPM or HAS_MASK):  # rows past Lq have lse +inf: only the rows < Lq count
        n_a, n_b = interior_tiles(i0, tl.minimum(i0 + BLOCK, Lq) - 1, BLOCK, n_lo, n_hi, Lk,
                                  mlen, window_left, window_right, True, True)
    for run in tl.static_range(3):
        n_first, n_stop = tile_run(run, n_lo, n_a, n_b, n_hi)
        if run == 2 or not (HAS_KPM or HAS_MASK):
            for n in range(n_first, n_stop):
                carry = _dq_tile(carry, n, tile, HAS_KPM, HAS_MASK, HAS_BAND, ATOMIC_DR,
                                 DOT_DTYPE, UPCAST, DOT_PREC, SKEW_GATHER, BLOCK, DROPOUT,
                                 USE_DESC, run != 1, K.dtype.element_ty)
    dq, g_prev, p_lo, r_lo = carry
    # flush the hi part of the last tile (rows p_lo ..: its hi r chunk)
    dt = to_operand(tl.where(lo_part, 0.0, g_prev), K.dtype.element_ty, UPCAST)
    dq = tl.dot(dt, r_lo, dq, input_precision=DOT_PREC)
    if ATOMIC_DR:
        _dr_add(DR_h, tl.dot(tl.trans(dt), qv_t, input_precision=DOT_PREC), p_lo + w, R_rows,
                stride_dr.row, offs_d, d_ok, softmax_scale)

    dq = dq * softmax_scale
    tl.store(DQ + b * stride_dq.batch + h * stride_dq.head + rows_i * stride_dq.row
             + offs_d[None, :], _output(dq, DQ.dtype.element_ty, UPCAST), mask=q_msk)
    part_off = (b * stride_part.batch + m.to(tl.int64) * stride_part.row
                + h * stride_part.head + offs_d)
    tl.store(DQ_PART + part_off, tl.sum(dq, axis=0), mask=d_ok)


class _DrTile(NamedTuple):
    """The dr kernel's loop invariants (``_dr_tile``): _program_setup's query / keys, the
    diagonal's two r chunks, the columns, the lo-chunk selector, _program_setup's pattern /
    drop, Lq, Lk, D, softmax_scale * log2(e) and the diagonal t."""
    query: object
    keys: object
    r_lo: object
    r_hi: object
    offs_d: object
    lo_part: object
    pattern: object
    drop: object
    Lq: object
    Lk: object
    D: object
    qk_scale: object
    t: object


@triton.jit
def _dr_tile(carry, m, tile, HAS_KPM: tl.constexpr, HAS_MASK: tl.constexpr,
             HAS_BAND: tl.constexpr, DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr,
             DOT_PREC: tl.constexpr, SKEW_GATHER: tl.constexpr, BLOCK: tl.constexpr,
             DROPOUT: tl.constexpr, USE_DESC: tl.constexpr, MASKED: tl.constexpr,
             IN_DTYPE: tl.constexpr, FROM_Q: tl.constexpr):
    """One tile pair (m, m + t) of the dr kernel's diagonal: carry (dr_lo, dr_hi) -> the same
    after it; ``tile`` the diagonal's loop invariants (``_DrTile``)."""
    dr_lo, dr_hi = carry
    offs_d, D = tile.offs_d, tile.D
    i0 = m * BLOCK
    j0 = i0 + tile.t * BLOCK
    offs_i = i0 + tl.arange(0, BLOCK)
    offs_j = j0 + tl.arange(0, BLOCK)
    a_t, qv_t, do, lse2, delta = _load_query_tile(tile.query, i0, offs_i, offs_d, tile.Lq, D,
                                                  DOT_DTYPE, USE_DESC, FROM_Q, IN_DTYPE,
                                                  UPCAST)
    k_t, v_t = _load_kv_tile(tile.keys, j0, offs_j, tile.Lk, offs_d, D, DOT_DTYPE, USE_DESC)
    t_lo, t_hi = _chunks_t(qv_t, tile.r_lo, tile.r_hi, DOT_PREC)
    p, ds = _recompute_p_ds(a_t, do, k_t, v_t, t_lo, t_hi, lse2, delta, i0, j0, offs_i,
                            tile.qk_scale, tile.pattern, tile.drop, HAS_KPM, HAS_MASK,
                            HAS_BAND, DROPOUT, DOT_PREC, SKEW_GATHER, BLOCK, IN_DTYPE, UPCAST,
                            MASKED)
    g = to_operand(_unskew(ds, BLOCK, SKEW_GATHER), IN_DTYPE, UPCAST)
    dt_lo = tl.where(tile.lo_part, g, 0.0).to(DOT_DTYPE)
    dt_hi = tl.where(tile.lo_part, 0.0, g).to(DOT_DTYPE)
    dr_lo = tl.dot(tl.trans(dt_lo), qv_t, dr_lo, input_precision=DOT_PREC)
    dr_hi = tl.dot(tl.trans(dt_hi), qv_t, dr_hi, input_precision=DOT_PREC)
    return dr_lo, dr_hi


@triton.jit
def _rel_attn_bwd_dr_kernel(
    A_OP, QV_OP, K, V, R, DO, LSE, DELTA, Z, strides, stride_z, q_args,
    H, Lq, Lk, R_rows, r_shift1, D, softmax_scale, qk_scale, masks, dropout, LQ_BUCKET, LK_BUCKET,
    HAS_KPM: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BAND: tl.constexpr,
    DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    SKEW_GATHER: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    DROPOUT: tl.constexpr = False, USE_DESC: tl.constexpr = False,
    FROM_Q: tl.constexpr = False,
):
    """One program per (batch * head, block diagonal t = n - m): the dr contributions of the
    tile pairs (m, m + t) of one batch and head, reduced in registers in a fixed order, written
    to Z[0] (lo chunk rows) and Z[1] (hi chunk rows). No two programs write the same row of Z[c].
    stride_z: ``ZStrides``. FROM_Q: (q + u) and (q + vb) formed from one q tile per pair
    (_load_query_tile), a quarter less global traffic per pair (_dr_from_q says where)."""
    num_m = tl.cdiv(Lq, BLOCK)
    num_n = tl.cdiv(Lk, BLOCK)
    t = num_n - 1 - tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    mlen = Lk - Lq
    r_c1 = Lq + (r_shift1 - 1)  # the pairs read r rows j - i + r_c1 - 1 (_ROW_SHIFT)
    b, h, window_left, window_right, query, keys, rel, pattern, drop = _program_setup(
        A_OP, QV_OP, K, V, R, DO, LSE, DELTA, strides, masks, dropout, H, Lq, Lk, R_rows, D,
        HAS_BAND, USE_DESC, BLOCK, BLOCK_D, q_args, FROM_Q)
    w = tl.arange(0, BLOCK)
    p_lo = t * BLOCK + r_c1 - BLOCK  # (pairs read rows j - i + r_c1 - 1)
    p_hi = p_lo + BLOCK
    r_lo = _load_r(rel, p_lo, w, offs_d, D, DOT_DTYPE, USE_DESC)
    r_hi = _load_r(rel, p_hi, w, offs_d, D, DOT_DTYPE, USE_DESC)

    # Tile pairs (m, m + t) inside both sequences.
    m_lo = tl.maximum(-t, 0)
    m_hi = tl.minimum(num_m, num_n - t)
    # Every pair of the diagonal has d = i + mlen - j in [mlen - tB - (B-1), mlen - tB + (B-1)]:
    # skip the diagonal when that range misses the window, or when it has no row in [0, R).
    d_min = mlen - t * BLOCK - (BLOCK - 1)
    d_max = mlen - t * BLOCK + (BLOCK - 1)
    skip = (d_max < -window_right) | (d_min > window_left)
    skip = skip | (p_hi + BLOCK - 1 < 0) | (p_lo >= R_rows)
    m_hi = tl.where(skip, m_lo, m_hi)

    lo_part = _lo_part(BLOCK)
    dr_lo = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dr_hi = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    # The diagonal needs no mask where every pair of a full tile is inside the window
    # (tB >= B - 1 + mlen - window_left, tB + B - 1 <= mlen + window_right) and the key tile
    # is whole (m + t < Lk // B); no padding / dense mask. Those tiles first (ascending m, as
    # before), the masked rest after: the same order of accumulation.
    inside = (t * BLOCK >= BLOCK - 1 + mlen - window_left) & \
        (t * BLOCK + BLOCK - 1 <= mlen + window_right)
    m_b = tl.where(inside, tl.minimum(tl.maximum(Lk // BLOCK - t, m_lo), m_hi), m_lo)
    if HAS_KPM or HAS_MASK:
        m_b = m_lo
    carry = (dr_lo, dr_hi)
    tile = _DrTile(query=query, keys=keys, r_lo=r_lo, r_hi=r_hi, offs_d=offs_d, lo_part=lo_part,
                   pattern=pattern, drop=drop, Lq=Lq, Lk=Lk, D=D, qk_scale=qk_scale, t=t)
    # runs 1 and 2 of tile_run: [m_lo, m_b) mask-free, [m_b, m_hi) masked (no left edge: the
    # whole diagonal has one distance range)
    for run in tl.static_range(1, 3):
        m_first, m_stop = tile_run(run, m_lo, m_lo, m_b, m_hi)
        if run == 2 or not (HAS_KPM or HAS_MASK):
            for m in range(m_first, m_stop):
                carry = _dr_tile(carry, m, tile, HAS_KPM, HAS_MASK, HAS_BAND, DOT_DTYPE,
                                 UPCAST, DOT_PREC, SKEW_GATHER, BLOCK, DROPOUT, USE_DESC,
                                 run != 1, K.dtype.element_ty, FROM_Q)
    dr_lo, dr_hi = carry

    Z_bh = Z + b * stride_z.batch + h * stride_z.head + offs_d[None, :]
    rows = p_lo + w
    tl.store(Z_bh + rows.to(tl.int64)[:, None] * stride_z.row, dr_lo * softmax_scale,
             mask=((rows >= 0) & (rows < R_rows))[:, None] & d_ok[None, :])
    rows = p_hi + w
    tl.store(Z_bh + stride_z.chunk + rows.to(tl.int64)[:, None] * stride_z.row,
             dr_hi * softmax_scale, mask=((rows >= 0) & (rows < R_rows))[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Configs: autotuned on GPU, one fixed default when TXL_KERNELS_AUTOTUNE=0, one under the
# interpreter
# ----------------------------------------------------------------------------------------------

INTERPRET_CONFIG = {"BLOCK": 16, "num_warps": 4, "num_stages": 1}


def _configs():
    if INTERPRET:
        cfg = dict(INTERPRET_CONFIG)
        nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
        return [triton.Config(cfg, num_warps=nw, num_stages=ns)]
    return [triton.Config({"BLOCK": blk}, num_warps=nw, num_stages=ns)
            for blk in (16, 32, 64)
            for nw in (4, 8)
            for ns in (1, 2)]


def _max_block(block_d: int, wide: bool, extra_tiles: bool, lq: int = 1 << 30,
               lk: int = 1 << 30) -> int:
    """The largest BLOCK whose tiles fit in shared memory / registers (from sm_90 compiles:
    fp32 needs twice the bytes, and the dr kernel holds two more [BLOCK, BLOCK_D] tiles), and
    none far larger than the sequences. (BLOCK 128 is not offered: an iteration keeps about
    six fp32 [BLOCK, BLOCK] tiles live, 384 KB at 128, more than an SM's register file.)"""
    if not wide:
        max_block = 64 if block_d <= 128 else 32
    else:
        max_block = 64 if block_d <= 64 else 32
        if extra_tiles and block_d > 128:
            max_block = 16
    return min(max_block, max(32, triton.next_power_of_2(max(lq, lk))))


def _make_prune(extra_tiles: bool):
    """Keep the blocks up to _max_block, BLOCK 16 only where nothing larger fits or it is the
    family's default (_SMALL_TILE_DEFAULTS); at least one config."""

    def prune(configs, named_args, **kwargs):
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 64))
        q = named_args.get("K")
        wide = q is not None and q.element_size() == 4
        family = config_family(q.device)[0] if q is not None else "sm90"
        max_block = _max_block(block_d, wide, extra_tiles, named_args.get("Lq", 1 << 30),
                               named_args.get("Lk", 1 << 30))
        keep = [cfg for cfg in configs
                if cfg.kwargs["BLOCK"] <= max_block
                and (cfg.kwargs["BLOCK"] > 16 or max_block == 16
                     or (family in _SMALL_TILE_FAMILIES
                         and _small_tile_default(family, block_d)[0] == 16))
                and _family_keeps(family, extra_tiles, cfg, block_d, wide)]
        if keep:
            return keep
        cfg = dict(_default_config(block_d, False, wide, family, extra_tiles=extra_tiles,
                                   lq=named_args.get("Lq", 1 << 30),
                                   lk=named_args.get("Lk", 1 << 30)))
        return [triton.Config({"BLOCK": cfg["BLOCK"]}, num_warps=cfg["num_warps"],
                              num_stages=cfg["num_stages"])]

    return prune


def _default_config(block_d: int, exact_fp32: bool, wide: bool = False,
                    family: str = "sm90", *, extra_tiles: bool = False, lq: int = 1 << 30,
                    lk: int = 1 << 30) -> dict:
    """The config a backward kernel uses on GPU when autotuning is off (TXL_KERNELS_AUTOTUNE=0),
    for config family ``family`` (``_arch.config_family``). sm_90: the largest kept BLOCK (64
    for fp16 / bf16 up to D 128: wgmma-sized tiles), 4 warps, 2 stages; exact fp32 products run
    on the FMA units: BLOCK 32 at most. The small-tile families: _SMALL_TILE_DEFAULTS' warps
    and stages, its BLOCK at most theirs. Always one of _configs() that _make_prune keeps
    (extra_tiles: the dr kernel)."""
    block = _max_block(block_d, wide, extra_tiles, lq, lk)
    if exact_fp32:
        block = min(block, 32)
    if family in _SMALL_TILE_FAMILIES:
        small, warps, stages = _small_tile_default(family, block_d)
        return {"BLOCK": min(block, small), "num_warps": warps, "num_stages": stages}
    return {"BLOCK": block, "num_warps": 4, "num_stages": 2}


# Per-architecture choices (txl_kernels._arch config families). sm_90 takes _configs(),
# _make_prune's rule and the first branch of _default_config above. The other families take
# smaller tiles and the tl.gather skew, with the default (BLOCK, num_warps, num_stages) of
# _SMALL_TILE_DEFAULTS per head-dim class (up to 64, above), from compiles for their targets
# (tools/aot_check --target; BENCHMARKS.md, "Per-architecture compile table"; bf16, every mask /
# dropout flag on). On sm_80 (mma.sync) at D 128 BLOCK 64 spills 2.3-27 KB per kernel; BLOCK 32
# with 4 warps and 2 stages 0.1-10 KB (ptxas settles some kernels at 32 registers and spills
# everything), with 8 warps and 1 stage 0-176 B (the atomic dq kernel); BLOCK 16 with 4 warps
# none. At D 64, BLOCK 32 with 8 warps and 1 stage spills nothing there. sm_100 (tcgen05) at D
# 128: BLOCK 16 with 4 warps spills 92 B in the dk/dv kernel with 1 stage, 24 B with 2; its dk/dv
# kernel at BLOCK 64 would need 257 KiB of shared memory (over 227 KiB). The gather skew spills
# less than the register rotation, which is laid out for the wgmma accumulator. These tiles also
# fit the 99 KiB blocks of sm_86 / sm_89 / sm_120.
_SMALL_TILE_DEFAULTS = {  # family: ((BLOCK, warps, stages) for D <= 64, the same for D > 64)
    "sm80": ((32, 8, 1), (16, 4, 1)),
    "sm86": ((32, 8, 1), (16, 4, 1)),
    "sm100": ((32, 8, 1), (16, 4, 2)),
    "sm120": ((32, 8, 1), (16, 4, 1)),
}
_SMALL_TILE_FAMILIES = tuple(_SMALL_TILE_DEFAULTS)
# deterministic=False: the families whose dk/dv kernel also takes dq and dr by fp32 atomics
# (ATOMIC: one recompute of P and dS per tile pair instead of two, no dq kernel). Their default
# configs stay within the spill budget, or (sm_90) the static model prefers it despite the
# spills: bf16 D 64 causal, 2.12x the tutorial's backward against 2.62 with the two kernels
# (with Q_ONLY; its loop bound by shared memory, L2 next). sm_100 / sm_120 at their small tiles
# spill 96-372 B with ATOMIC (bf16, flags on): they keep the dq kernel and its atomic dr.
_FUSED_DQ_FAMILIES = ("sm90", "sm80", "sm86")
_GATHER_SKEW_FAMILIES = _SMALL_TILE_FAMILIES
_DU_DOT_FAMILIES = ("sm90",)  # dk/dv kernel: du's column sums as a product (DU_DOT)


def _fused_dq(family: str, wide: bool) -> bool:
    """Whether deterministic=False takes dq and dr in the dk/dv kernel (ATOMIC): on the
    _FUSED_DQ_FAMILIES, for fp16 / bf16 inputs. fp32 inputs keep the two kernels: on sm_90
    ATOMIC spills 2.1 KB (TF32, D 64) and 12.5 KB (D 128) with every flag on, against 0.7 +
    1.5 KB and 7.7 + 1.2 KB for the dk/dv and dq kernels."""
    return family in _FUSED_DQ_FAMILIES and not wide


def _small_tile_default(family: str, block_d: int) -> Tuple[int, int, int]:
    return _SMALL_TILE_DEFAULTS[family][block_d > 64]


def _family_keeps(family: str, extra_tiles: bool, cfg, block_d: int, wide: bool) -> bool:
    """Whether the autotuner tries ``cfg`` on config family ``family`` (beyond the BLOCK
    bound every family shares): BLOCK <= 32 on the small-tile families."""
    return family not in _SMALL_TILE_FAMILIES or cfg.kwargs["BLOCK"] <= 32


def _zero_atomics(nargs, reset_only=False):
    """The dk/dv autotuner's hook, before each trial and before the chosen config's run:
    ATOMIC adds into the dq and dr buffers of its ``atomics`` (``AtomicArgs``, or a tuple of
    its fields in order) and ORDERED publishes progress in its slots, so each run starts them
    from zero (a slot left at _DONE would let the next run's adds go out of order;
    reset_to_zero takes only top-level tensors)."""
    if nargs.get("ATOMIC"):
        atomics = AtomicArgs._make(nargs["atomics"])
        atomics.dq.zero_()
        atomics.dr.zero_()
        if nargs.get("ORDERED"):
            atomics.sems.zero_()


_KEY = ["BLOCK_D", "LQ_BUCKET", "LK_BUCKET", "HAS_KPM", "HAS_MASK", "HAS_BAND", "DOT_PREC",
        "DROPOUT", "USE_DESC"]

_dkdv_kernel = triton.autotune(configs=_configs(), key=_KEY + ["ATOMIC", "ORDERED", "Q_ONLY"],
                               prune_configs_by={"early_config_prune": _make_prune(False)},
                               pre_hook=_zero_atomics)(
    _rel_attn_bwd_dkdv_kernel)
_dq_kernel = triton.autotune(configs=_configs(), key=_KEY + ["ATOMIC_DR"],
                             prune_configs_by={"early_config_prune": _make_prune(False)},
                             reset_to_zero=["DQ_PART", "DR_ACC"])(
    _rel_attn_bwd_dq_kernel)
_dr_kernel = triton.autotune(configs=_configs(), key=_KEY,
                             prune_configs_by={"early_config_prune": _make_prune(True)},
                             reset_to_zero=["Z"])(_rel_attn_bwd_dr_kernel)


def _q_only(family: str, block_d: int) -> bool:
    """Whether the dk/dv kernel with ATOMIC (fp16 / bf16) takes Q_ONLY: one q tile per pair
    instead of the preprocessed (q + u) and (q + vb), and no workspaces. On sm_90 up to D 64,
    where the static sm_90 model puts its loop at the L2 bound (bf16 D 64, causal: 2923 cycles
    per tile, 65 KB, against 2204 of shared memory): 57 KB per tile, 2564 cycles of L2, 2784 of
    shared memory (the rounded operands and the bias terms' narrow products). At D 128 the loop
    is shared-memory bound already; the other families are not modelled."""
    return family == "sm90" and block_d <= 64


def _dr_from_q(block_d: int, meta: dict) -> bool:
    """Whether the dr kernel forms (q + u) and (q + vb) from q tiles (FROM_Q) rather than
    loading both preprocessed operands: one [BLOCK, BLOCK_D] tile load per pair fewer (its
    loop is bound by global traffic in the static sm_90 model, 1844 -> 1484 cycles at bf16
    D 64), but the two operands are then register values. Only up to D 64 without masks or
    dropout, where that costs 56 B of spills (sm_90 bf16, within the backward's 64 B budget);
    with every flag on, or at D 128, it spills about 3x more than the loaded operands."""
    return block_d <= 64 and not (meta["HAS_KPM"] or meta["HAS_MASK"] or meta["HAS_BAND"]
                                  or meta["DROPOUT"])


# _ROW_SHIFT. The kernels take r_shift1 = 1 + the shift of r's rows against the default table
# (r_first_distance - (Lk - 1); 0 for the default): the pair (i, j) reads row
# j - i + Lq - 1 + (r_shift1 - 1). Triton specialises an int argument equal to 1 to a
# constant, so the default table's kernels compile exactly as without the argument (no extra
# live value; the static sm_90 model unchanged), and another table gets its own variant.


def _atomic_offsets_fit(R_rows: int, Lq: int, Lk: int, H: int, D: int,
                        r_shift: Optional[int] = None) -> bool:
    """Whether the atomics' int32 offsets (_dr_add, and the dq atomics of _dq_dr_atomics)
    reach every row they compute: in the [R, H, D] dr buffer a tile's window rows lie within a
    few BLOCKs of the pair rows j - i + c (c = r_shift, default Lq - 1), which are in
    (c - Lq + 1 - BLOCK, c + Lk + BLOCK); in the [B, Lq, H, D] dq buffer (per batch) the rows
    are below Lq + BLOCK. Otherwise the deterministic kernels run instead."""
    c = Lq - 1 if r_shift is None else r_shift
    return (max(R_rows, Lq + Lk, c + Lk, Lq - c) + 4 * 64) * H * D < 2 ** 31


def _launch(tuned, raw, grid, args, meta, config):
    """Launch ``raw`` with ``config`` (BLOCK, num_warps, num_stages), or ``tuned`` (its
    autotuner) when config is None; ``grid`` maps the BLOCK to the launch grid."""
    if config is None:
        tuned[lambda m: grid(m["BLOCK"])](*args, **meta)
    else:
        raw[grid(config["BLOCK"])](*args, **meta, **config)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _check_bwd_args(do, q, k, v, r, r_w_bias, r_r_bias, out, lse, key_padding_mask,
                    attn_mask, dropout_p, dropout_seed) -> None:
    """rel_attn_bwd's invariants (rel_attention validated the user's arguments)."""
    B, Lq, H, D = q.shape
    Lk, R_rows, dev = k.shape[1], r.shape[0], q.device
    assert q.dtype in _TL_DTYPES and 16 <= D <= 256 and Lk >= Lq, f"rel_attn_bwd: q {describe(q)}"
    for name, t, shape, dtype in (
            ("do", do, (B, Lq, H, D), q.dtype), ("k", k, (B, Lk, H, D), q.dtype),
            ("v", v, (B, Lk, H, D), q.dtype), ("r", r, (R_rows, H, D), q.dtype),
            ("r_w_bias", r_w_bias, (H, D), q.dtype), ("r_r_bias", r_r_bias, (H, D), q.dtype),
            ("out", out, (B, Lq, H, D), q.dtype), ("lse", lse, (B, H, Lq), torch.float32),
            ("key_padding_mask", key_padding_mask, (B, Lk), torch.bool),
            ("attn_mask", attn_mask, (B, H, Lq, Lk), torch.bool)):
        assert t is None and name in ("key_padding_mask", "attn_mask") or (
            tuple(t.shape) == shape and t.dtype == dtype and t.device == dev), \
            f"rel_attn_bwd: {name} must be {list(shape)} {dtype} on {dev}, got {describe(t)}"
    assert R_rows >= 1, f"rel_attn_bwd: r {describe(r)}"
    assert dropout_p <= 0.0 or (dropout_seed is not None and dropout_seed.dtype == torch.int64
                                and dropout_seed.numel() == 2 and dropout_seed.device == dev), \
        f"rel_attn_bwd: dropout_seed must be int64 [2] on {dev}, got {describe(dropout_seed)}"


def _bwd_configs(dtype, precision: str, block_d: int, Lq: int, Lk: int, family: str):
    """The (dk/dv, dq, dr) kernels' launch configs: the interpreter's, the defaults (autotune
    off), or None each (autotuned)."""
    if INTERPRET:
        return (INTERPRET_CONFIG,) * 3
    if autotune_enabled():
        return (None,) * 3
    wide = dtype == torch.float32
    exact = wide and precision == "ieee"
    return tuple(_default_config(block_d, exact, wide, family, extra_tiles=extra, lq=Lq, lk=Lk)
                 for extra in (False, False, True))


def _bwd_preprocess(do, q, r_w_bias, r_r_bias, out, q_only: bool, upcast: bool, block_d: int):
    """delta = rowsum(dO * O) and the operands q + u and q + vb, rounded once (``q_only``: the
    dk/dv kernel forms them from q tiles: no workspaces, q stands in). Returns (delta, a_op,
    qv_op, the operands' ``WorkStrides``)."""
    B, Lq, H, D = q.shape
    delta = torch.empty((B, H, Lq), device=q.device, dtype=torch.float32)
    if q_only:
        a_op = qv_op = q
        w_strides = WorkStrides(0, q.stride(1))
    else:
        a_op, qv_op = (operand_workspace(B, H, Lq, D, q.dtype, upcast, q.device)
                       for _ in range(2))
        w_strides = WorkStrides(a_op.stride(0), a_op.stride(1))
    pre_block = 16 if INTERPRET else 64
    _rel_attn_bwd_preprocess_kernel[(B * H, triton.cdiv(Lq, pre_block))](
        out, do, q, r_w_bias, r_r_bias, delta, a_op, qv_op,
        out.stride(0), out.stride(1), out.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        q.stride(0), q.stride(1), q.stride(2),
        r_w_bias.stride(0), r_r_bias.stride(0),
        delta.stride(0), delta.stride(1), delta.stride(2),
        *w_strides, H, Lq, D, UPCAST=upcast, BLOCK_M=pre_block, BLOCK_D=block_d,
        OPERANDS=not q_only)
    return delta, a_op, qv_op, w_strides


def _atomic_buffers(q, Lk: int, R_rows: int, fused_dq: bool, ordered: bool,
                    deterministic: bool):
    """The fp32 accumulators the kernels add into with atomics: dr (fused dq, or not
    deterministic; ``ordered``: one per batch, a fixed order per batch * head, summed by the
    caller), dq (fused dq) and the dk/dv kernel's ``AtomicArgs`` (0 without fused dq).
    Returns (dr_acc, dq_acc, atomics); None for a buffer not used."""
    B, Lq, H, D = q.shape
    dev = q.device
    dr_acc = dq_acc = None
    if fused_dq or not deterministic:
        dr_acc = torch.zeros((B if ordered else 1, R_rows, H, D), device=dev,
                             dtype=torch.float32)
    if not fused_dq:
        return dr_acc, dq_acc, 0  # ATOMIC off: the tuple is unused
    dq_acc = torch.zeros((B, Lq, H, D), device=dev, dtype=torch.float32)
    # ordered: each key tile's progress, per batch * head (sized for the smallest BLOCK);
    # else unused (dq_acc stands in: no allocation on the default path)
    sem_row = triton.cdiv(Lk, _MIN_BLOCK)
    sems = (torch.zeros(B * H * sem_row, device=dev, dtype=torch.int32) if ordered
            else dq_acc)
    atomics = AtomicArgs(dq=dq_acc, stride_dq=row_strides(dq_acc), dr=dr_acc,
                         stride_dr=RowStrides(dr_acc.stride(0) if ordered else 0,
                                              dr_acc.stride(1), dr_acc.stride(2)),
                         sems=sems, sem_row=sem_row)
    return dr_acc, dq_acc, atomics


def rel_attn_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor,
    r_w_bias: torch.Tensor, r_r_bias: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    softmax_scale: float, window_left: int, window_right: int,
    key_padding_mask: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
    attn_mask_band: Optional[torch.Tensor] = None, deterministic: bool = True,
    dropout_p: float = 0.0, dropout_seed: Optional[torch.Tensor] = None,
    r_first_distance: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv, dr, du, dvb) of the fused relative attention, each with its
    input's shape and dtype, contiguous.

    ``out`` and ``lse`` are the forward's outputs (``lse`` [B, H, Lq] fp32, natural log, +inf
    for rows with no allowed key). Masks as in ``rel_attn_fwd``: causal folded into
    ``window_right = 0``, ``key_padding_mask`` bool [B, Lk] or None, ``attn_mask`` bool
    [B, H, Lq, Lk] (any strides) or None, True = masked. ``deterministic=False`` reduces dr
    (and, where _fused_dq, dq, in the dk/dv kernel) with fp32 atomics (faster; not bitwise
    reproducible); ``deterministic=True`` takes the same atomics in key-tile order where
    _fused_dq (ORDERED), else the dq and dr kernels; both need the atomics' int32 row offsets
    to fit (dr near 2**31 elements: _atomic_offsets_fit), else the dq and dr kernels run.
    ``dropout_p`` > 0:
    the forward's dropout, with the same (seed, offset) tensor ``dropout_seed`` (the keep-mask
    is regenerated, never stored). ``r_first_distance``: the distance held by r's row 0
    (None: ``Lk - 1``), as in ``rel_attn_fwd``; dr has r's R rows. The arguments are
    validated by ``rel_attention``; here they are only asserted.
    """
    _check_bwd_args(do, q, k, v, r, r_w_bias, r_r_bias, out, lse, key_padding_mask,
                    attn_mask, dropout_p, dropout_seed)
    B, Lq, H, D = q.shape
    Lk = k.shape[1]
    R_rows = r.shape[0]
    family = config_family(q.device)[0]
    block_d = max(16, triton.next_power_of_2(D))
    r_shift = Lq - 1 if r_first_distance is None else int(r_first_distance) - Lk + Lq
    fits = _atomic_offsets_fit(R_rows, Lq, Lk, H, D, r_shift)
    # ATOMIC: dq and dr in the dk/dv kernel; deterministic, with their adds in a fixed order
    fused_dq = fits and _fused_dq(family, q.dtype == torch.float32)
    ordered = fused_dq and deterministic
    q_only = fused_dq and _q_only(family, block_d)
    deterministic = deterministic or not fits
    q, k, v, r, do, out, r_w_bias, r_r_bias, lse = _bwd_inputs(
        q, k, v, r, do, out, r_w_bias, r_r_bias, lse,
        excludes_pairs(window_left, window_right, key_padding_mask, attn_mask))
    softmax_scale = float(softmax_scale)
    # The interpreter's bf16 dot is wrong (triton#11584): bf16 operands are rounded to bf16
    # (round to nearest) but kept in fp32 for tl.dot.
    upcast = q.dtype == torch.bfloat16 and INTERPRET
    dot_dtype = tl.float32 if upcast else _TL_DTYPES[q.dtype]
    precision = dot_precision(q.dtype)
    configs = _bwd_configs(q.dtype, precision, block_d, Lq, Lk, family)
    delta, a_op, qv_op, w_strides = _bwd_preprocess(do, q, r_w_bias, r_r_bias, out, q_only,
                                                    upcast, block_d)
    # The main kernels' shared arguments (see "Kernels" above for the tuples' layouts).
    inputs = (a_op, qv_op, k, v, r, do, lse, delta)
    drop = dropout_args(dropout_p, dropout_seed, delta)  # (delta: the placeholder seed)
    # the call's variant (the window is a runtime bound here, not a flag)
    flags = variant_flags(q, window_left, window_right, key_padding_mask, attn_mask,
                          attn_mask_band, dropout_p, None, r_first_distance, deterministic)
    meta = dict({f: flags[f] for f in ("HAS_KPM", "HAS_MASK", "HAS_BAND", "DROPOUT")},
                DOT_DTYPE=dot_dtype, UPCAST=upcast, DOT_PREC=precision,
                SKEW_GATHER=q.dtype == torch.float32 or family in _GATHER_SKEW_FAMILIES,
                BLOCK_D=block_d, USE_DESC=descriptors_ok(a_op, qv_op, q, do, k, v, r))
    strides, masks = _bwd_tuples(inputs, w_strides, window_left, window_right,
                                 key_padding_mask, attn_mask,
                                 attn_mask_band if meta["HAS_BAND"] else None)
    if meta["USE_DESC"] and q.device.type == "cuda" and not INTERPRET:
        ensure_scratch_allocator()
    sizes = (H, Lq, Lk, R_rows, r_shift - (Lq - 1) + 1, D, softmax_scale,
             softmax_scale * LOG2E.value)
    # q and the biases, for the kernels that form q + u and q + vb themselves (FROM_Q, Q_ONLY)
    q_args = QArgs(q=q, u=r_w_bias, vb=r_r_bias, stride_q=row_strides(q),
                   stride_bias=bias_strides(r_w_bias, r_r_bias))
    buckets = (length_bucket(Lq), length_bucket(Lk))  # autotune keys only
    # du and dvb: the dk/dv kernel writes softmax_scale (column sums of dS) . K of each key tile
    # (its part of du = sum of dA over the rows); dvb = sum(dq) - du, all in fp32 (the dq kernel
    # writes the row sums of each dq tile, summed in a fixed order; with ATOMIC they are summed
    # from the fp32 dq)
    dr_acc, dq_acc, atomics = _atomic_buffers(q, Lk, R_rows, fused_dq, ordered, deterministic)
    launch = (inputs, strides, sizes, masks, drop, buckets, meta)
    dk, dv, du32 = _run_dkdv(q, Lk, launch, atomics, q_args,
                             dict(DU_DOT=family in _DU_DOT_FAMILIES and block_d <= 64,
                                  ATOMIC=fused_dq, ORDERED=ordered, Q_ONLY=q_only), configs[0])
    du = du32.to(q.dtype)

    if fused_dq:
        dq32 = dq_acc.mul_(softmax_scale)
        dq = dq32.to(q.dtype)
        dvb = (dq32.sum(dim=(0, 1)) - du32).to(q.dtype)
    else:
        dq, dvb = _run_dq(q, launch, du32, None if deterministic else dr_acc[0], configs[1])

    if fused_dq:
        dr = (dr_acc.sum(dim=0) if ordered else dr_acc[0]).to(q.dtype)
    elif deterministic:
        dr = _run_dr(q, Lk, R_rows, launch, q_args, configs[2])
    else:
        dr = dr_acc[0].to(q.dtype)
    return dq, dk, dv, dr, du, dvb


def _bwd_tuples(inputs, w_strides: WorkStrides, window_left: int, window_right: int,
                key_padding_mask, attn_mask, attn_mask_band):
    """The main backward kernels' ``strides`` (``BwdStrides``) and ``masks`` (``MaskArgs``)
    for their pointer ``inputs`` (a_op, qv_op, k, v, r, do, lse, delta). Unbounded window
    sides become Lq + Lk (wider than any pair distance), so the kernels test every side
    without a flag; ``attn_mask_band`` (None unless the launch's HAS_BAND) narrows them on the
    device. delta stands in for an absent mask or band (unread)."""
    _, _, k, v, r, do, lse, delta = inputs
    B, H, Lq = lse.shape
    Lk = k.shape[1]
    strides = BwdStrides(work=w_strides, k=row_strides(k), v=row_strides(v), r=head_strides(r),
                         do=row_strides(do), lse=LseStrides(*lse.stride()))
    wl = int(window_left) if window_left >= 0 else Lq + Lk
    wr = int(window_right) if window_right >= 0 else Lq + Lk
    masks = mask_args(wl, wr, key_padding_mask, attn_mask, attn_mask_band, delta,
                      (B, H, Lq, Lk))
    return strides, masks


def _bwd_inputs(q, k, v, r, do, out, r_w_bias, r_r_bias, lse, excludes: bool):
    """The backward's tensors as the kernels take them: non-finite entries of r, and of k / v
    where a mask can exclude a pair (``excludes``), as 0, and every tensor with a contiguous
    last dim (lse contiguous). Excluded pairs take part with exact zeros of P and dS in
    dP = dO V^T, dS K and dS r (and every 2 BLOCK window of r holds a row none of its tile's
    pairs use, on mask-free tiles too); an allowed pair with a non-finite row has a NaN lse
    from the forward, which keeps its rows' P and dS NaN. Done here, one elementwise pass per
    tensor, rather than in the kernels, where it costs registers on every tile (sm_90:
    50-200 B more spills per kernel)."""
    r = finite_or_zero(r)
    if excludes:
        k, v = finite_or_zero(k), finite_or_zero(v)
    q, k, v, r, do, out = (last_dim_contiguous(t) for t in (q, k, v, r, do, out))
    r_w_bias, r_r_bias = last_dim_contiguous(r_w_bias), last_dim_contiguous(r_r_bias)
    return q, k, v, r, do, out, r_w_bias, r_r_bias, lse.contiguous()


def _run_dkdv(q, Lk: int, launch, atomics, q_args, flags: dict, config):
    """The dk/dv kernel (+ du partials; ATOMIC: + dq and dr by fp32 atomics into
    ``atomics``' buffers): one program per key tile. ``launch`` as in ``_run_dq``; ``flags``
    its own constexprs (DU_DOT, ATOMIC, ORDERED, Q_ONLY). Returns (dk, dv, du in fp32)."""
    inputs, strides, sizes, masks, drop, buckets, meta = launch
    B, Lq, H, D = q.shape
    du_part = torch.zeros((B, triton.cdiv(Lk, _MIN_BLOCK), H, D), device=q.device,
                          dtype=torch.float32)
    dk = torch.empty((B, Lk, H, D), device=q.device, dtype=q.dtype)
    dv = torch.empty((B, Lk, H, D), device=q.device, dtype=q.dtype)
    _launch(_dkdv_kernel, _rel_attn_bwd_dkdv_kernel,
            lambda blk: (B * H, triton.cdiv(Lk, blk)),
            (*inputs, DkdvOuts(dk=dk, dv=dv, du_part=du_part, stride_dk=row_strides(dk),
                               stride_part=row_strides(du_part)), strides, atomics, q_args,
             *sizes, masks, drop, *buckets),
            dict(meta, **flags), config)
    return dk, dv, du_part.sum(dim=(0, 1))


def _run_dq(q, launch, du32, dr_acc, config):
    """The dq kernel (+ its row sums; + dr with atomics into ``dr_acc`` [R, H, D] unless it is
    None, the deterministic mode): one program per query tile. ``launch``: the main kernels'
    shared (inputs, strides, sizes, masks, drop, buckets, meta). Returns (dq, dvb), dvb =
    sum(dq) - du (fp32 ``du32``)."""
    inputs, strides, sizes, masks, drop, buckets, meta = launch
    B, Lq, H, D = q.shape
    dq = torch.empty((B, Lq, H, D), device=q.device, dtype=q.dtype)
    dq_part = torch.zeros((B, triton.cdiv(Lq, _MIN_BLOCK), H, D), device=q.device,
                          dtype=torch.float32)
    dr_arg = dq_part if dr_acc is None else dr_acc  # dq_part: unused (ATOMIC_DR=False)
    _launch(_dq_kernel, _rel_attn_bwd_dq_kernel,
            lambda blk: (B * H, triton.cdiv(Lq, blk)),
            (*inputs, dq, dq_part, dr_arg, strides, row_strides(dq), row_strides(dq_part),
             head_strides(dr_arg), *sizes, masks, drop, *buckets),
            dict(meta, ATOMIC_DR=dr_acc is not None), config)
    return dq, (dq_part.sum(dim=(0, 1)) - du32).to(q.dtype)


def _run_dr(q, Lk: int, R_rows: int, launch, q_args, config):
    """The deterministic dr kernel: one program per block diagonal; Z[0] holds the lo chunks,
    Z[1] the hi chunks, summed here. ``launch`` as in ``_run_dq``."""
    inputs, strides, sizes, masks, drop, buckets, meta = launch
    B, Lq, H, D = q.shape
    z = torch.zeros((2, B, R_rows, H, D), device=q.device, dtype=torch.float32)
    _launch(_dr_kernel, _rel_attn_bwd_dr_kernel,
            lambda blk: (B * H, triton.cdiv(Lq, blk) + triton.cdiv(Lk, blk) - 1),
            (*inputs, z, strides, ZStrides(*z.stride()[:4]), q_args, *sizes, masks, drop,
             *buckets),
            dict(meta, FROM_Q=_dr_from_q(meta["BLOCK_D"], meta)), config)
    return z.sum(dim=(0, 1)).to(q.dtype)
