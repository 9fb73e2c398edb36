"""Decode kernel: Transformer-XL relative attention for ONE query row per (batch, head), the
generation step of ``MemTransformerLM.generate`` on its K/V cache: ``rel_attn_decode``.

Contract. q ``[B, 1, H, D]``, k / v ``[B, Lk, H, D]``, r ``[R >= Lk, H, D]`` (row j serves key
j; with ``r_first_distance``, row 0 holding that distance, row ``j + r_first_distance - (Lk -
1)``), u / vb ``[H, D]``; returns ``[B, 1, H, D]`` in q's dtype. Causal with an optional left
window (keys ``j >= Lk - 1 - window_left``). Any strides with ``stride(-1) == 1`` (others
copied). Forward only (inference). With ``memory=QuantizedKV`` (8-bit memory, ``M`` rows):
the keys are the memory's rows followed by k / v's (``Lk = M + Lc``); the memory is loaded as
int8 / float8_e4m3fn plus one scale per (token, head) and dequantised in registers, in fp32
(``data * scale``, the scales applied per row; not rounded to q's dtype: see the kernel's
docstring), in a key loop of its own; no full-precision copy is made.

Invariants. Flash-decoding: program (bh, split) writes an fp32 partial (running max, sum of
exponentials, unnormalised output) for its slice of keys; a second kernel merges the splits;
no tensor cores (element-wise products and row sums).

Derivations: docs/DESIGN.md, section "Decode (rel_attn_decode.py)".
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..quant import QuantizedKV
from ._common import (LOG2E, BiasStrides, HeadStrides, RowStrides, bias_strides, head_strides,
                      key_range, last_dim_contiguous, load_8bit, memory_bases,
                      memory_launch_args, row_strides)

__all__ = ["rel_attn_decode", "num_splits_for"]


class BatchHeadStrides(NamedTuple):
    """The (batch, head) strides of a one-row ``[B, 1, H, D]`` tensor (q, the output)."""
    batch: int
    head: int


class DecodeStrides(NamedTuple):
    """The decode split kernel's ``strides``: q's ``BatchHeadStrides``, k's and v's
    ``RowStrides``, r's ``HeadStrides``, the biases' ``BiasStrides``."""
    q: BatchHeadStrides
    k: RowStrides
    v: RowStrides
    r: HeadStrides
    bias: BiasStrides


@triton.jit
def _decode_tile(acc, m_i, l_i, k, r, v, n_ok, qu, qv, qk_scale, k_scale, v_scale,
                 SCALED: tl.constexpr):
    """Online-softmax update with one tile of keys: k / r / v ``[BN, BD]`` fp32. SCALED: k / v
    are 8-bit data, ``k_scale`` / ``v_scale`` ``[BN]`` their rows' scales, applied per row:
    ``(k_j * s_j) . qu = s_j (k_j . qu)`` and ``sum_j p_j (v_j * t_j) = sum_j (p_j t_j) v_j``."""
    ac = tl.sum(k * qu[None, :], axis=1)
    if SCALED:
        ac = ac * k_scale
    s = (ac + tl.sum(r * qv[None, :], axis=1)) * qk_scale
    s = tl.where(n_ok, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    pv = p
    if SCALED:
        pv = p * v_scale
    acc = acc * alpha + tl.sum(pv[:, None] * v, axis=0)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    return acc, m_new, l_i


@triton.jit
def _decode_split_kernel(
    Q, K, V, R, U, VB, M_OUT, L_OUT, ACC_OUT, strides, H, Lk, D, window_left, keys_per_split,
    num_splits, qk_scale, memory, r_shift1,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, QUANT_MEM: tl.constexpr = False,
):
    """Keys j in this split's slice of the row's ``key_range`` (window_left >= 0 here: the
    launcher turns unbounded into Lk). ``strides``: ``DecodeStrides``; ``memory``:
    ``_common.MemoryArgs``. QUANT_MEM: keys
    j < M are the 8-bit memory's (data and per-row scales), in a loop of their own,
    dequantised in registers in fp32 with the scales applied per row (``_decode_tile``);
    keys j >= M are row j - M of K / V. Key j reads r's row j + (r_shift1 - 1):
    ``r_shift1`` is 1 + the rows' shift against the default table (0 for it; Triton
    specialises the 1 to a constant, so that table's code is unchanged), and the launcher
    checks that the allowed keys' rows exist.

    Why fp32, without rounding the dequantised values to q's dtype as the reference does:
    this kernel computes in fp32 throughout (no tensor-core operands to round for), so its
    memory values are ``data * scale`` exactly, the contract's values before their final
    rounding, and the result differs from the exact attention over them only by arithmetic
    order (fp32 reassociation of the per-row scale); rounding would only add the 16-bit
    rounding error the reference has, at two conversion-pipe instructions per value (the
    static model, tools/decode_static.py: they made the 8-bit key loop XU-bound, slower
    than the 16-bit loop). The tests compare with the float64 attention over ``data *
    scale``, within 2x the error of the same-precision reference with the same memory."""
    stride_q, stride_k, stride_v, stride_r = strides.q, strides.k, strides.v, strides.r
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    q = tl.load(Q + b * stride_q.batch + h * stride_q.head + offs_d, mask=d_ok,
                other=0.0).to(tl.float32)
    u = tl.load(U + h * strides.bias.u + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    vb = tl.load(VB + h * strides.bias.vb + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    qu = q + u
    qv = q + vb

    # the one query row is the last (Lq = 1): causal, with the left window
    j_min, j_max = key_range(0, 1, Lk, window_left, 0, True, False)
    j_start = tl.maximum(pid_s * keys_per_split, j_min)
    j_end = tl.minimum((pid_s + 1) * keys_per_split, j_max + 1)
    m_i = tl.full([], -float("inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    k_off = offs_n0[:, None] * stride_k.row + offs_d[None, :]
    v_off = offs_n0[:, None] * stride_v.row + offs_d[None, :]
    r_off = offs_n0[:, None] * stride_r.row + offs_d[None, :]
    K_bh = K + b * stride_k.batch + h * stride_k.head
    V_bh = V + b * stride_v.batch + h * stride_v.head
    R_h = R + h * stride_r.head + tl.cast(r_shift1 - 1, tl.int64) * stride_r.row
    c0 = 0  # key j >= c0 is row j - c0 of K / V
    if QUANT_MEM:
        kq_src, vq_src, M = memory_bases(memory, b, h, offs_n0, offs_d)
        j_mem = tl.minimum(j_end, M)
        for j0 in range(j_start, j_mem, BLOCK_N):  # the 8-bit memory's keys
            offs_n = j0 + offs_n0
            n_ok = offs_n < j_mem
            m2 = n_ok[:, None] & d_ok[None, :]
            jj = tl.cast(j0, tl.int64)
            k = load_8bit(kq_src.data + jj * kq_src.data_stride + kq_src.offsets, m2)
            ks = tl.load(kq_src.scale + offs_n * kq_src.scale_stride, mask=n_ok,
                         other=0.0).to(tl.float32)
            r = tl.load(R_h + jj * stride_r.row + r_off, mask=m2, other=0.0).to(tl.float32)
            v = load_8bit(vq_src.data + jj * vq_src.data_stride + vq_src.offsets, m2)
            vs = tl.load(vq_src.scale + offs_n * vq_src.scale_stride, mask=n_ok,
                         other=0.0).to(tl.float32)
            acc, m_i, l_i = _decode_tile(acc, m_i, l_i, k, r, v, n_ok, qu, qv, qk_scale,
                                         ks, vs, True)
        j_start = tl.maximum(j_start, M)
        c0 = M
    for j0 in range(j_start, j_end, BLOCK_N):
        offs_n = j0 + offs_n0
        n_ok = offs_n < j_end
        m2 = n_ok[:, None] & d_ok[None, :]
        jj = tl.cast(j0, tl.int64)
        jc = tl.cast(j0 - c0, tl.int64)
        k = tl.load(K_bh + jc * stride_k.row + k_off, mask=m2, other=0.0).to(tl.float32)
        r = tl.load(R_h + jj * stride_r.row + r_off, mask=m2, other=0.0).to(tl.float32)
        v = tl.load(V_bh + jc * stride_v.row + v_off, mask=m2, other=0.0).to(tl.float32)
        acc, m_i, l_i = _decode_tile(acc, m_i, l_i, k, r, v, n_ok, qu, qv, qk_scale,
                                     1.0, 1.0, False)
    idx = pid_bh * num_splits + pid_s
    tl.store(M_OUT + idx, m_i)
    tl.store(L_OUT + idx, l_i)
    tl.store(ACC_OUT + idx * BLOCK_D + offs_d, acc)


@triton.jit
def _decode_merge_kernel(M_IN, L_IN, ACC_IN, OUT, stride_o, H, D, num_splits,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the splits' partials of one (batch, head); stride_o: OUT's
    ``BatchHeadStrides``."""
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    m = tl.load(M_IN + pid_bh * num_splits + offs_s, mask=s_ok, other=-float("inf"))
    l = tl.load(L_IN + pid_bh * num_splits + offs_s, mask=s_ok, other=0.0)
    acc = tl.load(ACC_IN + (pid_bh * num_splits + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                  mask=s_ok[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    # Splits without any allowed key have m = -inf: weight 0 (no NaN when every split is
    # empty: the output is then 0, as rel_attention gives for a row with no allowed key).
    w = tl.where(m > -float("inf"), tl.exp2(m - tl.where(m_all > -float("inf"), m_all, 0.0)),
                 0.0)
    den = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(OUT + b * stride_o.batch + h * stride_o.head + offs_d, out.to(OUT.dtype.element_ty),
             mask=offs_d < D)


def _default_config(block_d: int, exact_fp32: bool, wide: bool = False,
                    family: str = "sm90") -> dict:
    """The decode kernel's config, the forward's and backward's ``_default_config`` shape: one
    key tile of 64 rows per step on every family and under the interpreter (a program holds
    one query row: its registers do not grow with the tile; the split count, not the tile,
    adapts the launch to the machine). Triton's default warps and stages."""
    return {"BLOCK_N": 64}


def num_splits_for(bh: int, lk: int, device: torch.device, block_n: int = 64) -> int:
    """Splits so that about two waves of programs cover the machine (flash-decoding's rule),
    at least one tile of keys per split."""
    tiles = triton.cdiv(lk, block_n)
    if device.type != "cuda":
        return max(1, min(tiles, 4))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, triton.cdiv(2 * sms, bh), 128))


def rel_attn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor,
                    r_w_bias: torch.Tensor, r_r_bias: torch.Tensor, softmax_scale: float,
                    window_left: int = -1, num_splits: int = 0,
                    memory: Optional[QuantizedKV] = None,
                    r_first_distance: Optional[int] = None) -> torch.Tensor:
    """Relative attention of one query row: q ``[B, 1, H, D]``, k / v ``[B, Lk, H, D]``, r
    ``[R >= Lk, H, D]`` (row ``j`` serves key ``j``), biases ``[H, D]``; causal, with the
    left window ``window_left`` (-1 = none; same_length is ``mem_len - 1``). Any strides with
    a contiguous last dimension. ``num_splits`` 0 = chosen from the machine. Returns
    ``[B, 1, H, D]`` in q's dtype. Arguments are those ``rel_attention`` validated (the model
    calls it only after the same checks).

    ``memory``: an 8-bit memory (``txl_kernels.quant.QuantizedKV``, k / v ``[B, M, H, D]``
    int8 / float8_e4m3fn, scales ``[B, M, H]``; any strides with a contiguous last dim). The
    keys are then its ``M`` rows followed by k / v's (``Lc >= 1`` current rows): ``Lk = M +
    Lc`` for r and the window; the memory is read in 8 bits and dequantised in registers
    (fp32 ``data * scale``, not rounded to q's dtype).

    ``r_first_distance``: the distance held by r's row 0 (default None: ``Lk - 1``, row ``j``
    serves key ``j``); key ``j`` (distance ``Lk - 1 - j``) then reads row
    ``r_first_distance - (Lk - 1 - j)``, and the rows of the keys the window allows must
    exist (ValueError naming them), e.g. ``window_left + 1`` rows with
    ``r_first_distance=window_left``."""
    B, Lq, H, D = q.shape
    M = 0 if memory is None else memory.k.shape[1]
    Lk = M + k.shape[1]
    if Lq != 1:
        raise ValueError(f"rel_attn_decode: q must have one query row (Lq = 1), got "
                         f"{list(q.shape)}")
    if r_first_distance is None:
        if r.shape[0] < Lk:
            raise ValueError(f"rel_attn_decode: r needs at least Lk={Lk} rows, got "
                             f"{list(r.shape)}")
        shift = 0
    else:
        if isinstance(r_first_distance, bool) or not isinstance(r_first_distance, int):
            raise TypeError(f"rel_attn_decode: r_first_distance must be an int or None, got "
                            f"{type(r_first_distance).__name__}")
        shift = int(r_first_distance) - (Lk - 1)
        j_min = 0 if window_left < 0 else max(0, Lk - 1 - window_left)
        if j_min + shift < 0 or Lk - 1 + shift >= r.shape[0]:
            raise ValueError(
                f"rel_attn_decode: r has {r.shape[0]} rows and r_first_distance="
                f"{r_first_distance}, but the allowed keys (Lk={Lk}, window_left="
                f"{window_left}) have distances 0..{Lk - 1 - j_min} and need rows "
                f"{j_min + shift}..{Lk - 1 + shift}")
    q, k, v, r = (last_dim_contiguous(t) for t in (q, k, v, r))
    mem_arg = memory_launch_args(memory, k, v)
    u, vb = last_dim_contiguous(r_w_bias), last_dim_contiguous(r_r_bias)
    block_d = triton.next_power_of_2(D)
    # the same on every family and precision (see _default_config): none looked up
    block_n = _default_config(block_d, False, q.dtype == torch.float32)["BLOCK_N"]
    splits = num_splits or num_splits_for(B * H, Lk, q.device, block_n)
    per_split = triton.cdiv(triton.cdiv(Lk, splits), block_n) * block_n
    splits = triton.cdiv(Lk, per_split)
    m = torch.empty(B * H * splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(B * H * splits * block_d, device=q.device, dtype=torch.float32)
    strides = DecodeStrides(q=BatchHeadStrides(q.stride(0), q.stride(2)), k=row_strides(k),
                            v=row_strides(v), r=head_strides(r), bias=bias_strides(u, vb))
    _decode_split_kernel[(B * H, splits)](
        q, k, v, r, u, vb, m, l, acc, strides, H, Lk, D,
        int(window_left) if window_left >= 0 else Lk, per_split, splits,
        float(softmax_scale) * LOG2E.value, mem_arg, shift + 1,
        BLOCK_N=block_n, BLOCK_D=block_d, QUANT_MEM=M > 0)
    out = torch.empty((B, 1, H, D), device=q.device, dtype=q.dtype)
    _decode_merge_kernel[(B * H,)](
        m, l, acc, out, BatchHeadStrides(out.stride(0), out.stride(2)), H, D, splits,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    return out
