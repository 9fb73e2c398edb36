"""``rel_attention``'s extra keys (``extra_q`` / ``extra_k`` / ``extra_v``) on the fused kernels.

The ``G`` extra keys join the relative-attention keys in one softmax. The fused kernel computes
the relative part as usual and returns its normalised rows and row log-sum-exp; the
``[B, H, Lq, G]`` extra part is computed here in torch and folded in by a log-sum-exp merge
(``_block_ops.merge_block``, as the context-parallel ring merges its blocks). The backward is the kernel's own, given the *merged*
output and log-sum-exp (as the context-parallel ring calls it): with those its probabilities
are the joint softmax's, and ``rowsum(dO * O)`` is the joint one, so its gradients are exact;
the extra part's gradient is added here. Nothing of size ``Lq x Lk`` is formed.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._block_ops import KernelOps, merge_block


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _extra_scores(extra_q: Tensor, extra_k: Tensor, scale: float, acc) -> Tensor:
    """``scale * extra_q_i . extra_k_g``, ``[B, H, Lq, G]`` in ``acc``."""
    return torch.einsum("bihd,bghd->bhig", extra_q.to(acc), extra_k.to(acc)) * scale


def _contiguous_last(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


class _ExtraKeysAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, r, u, vb, extra_q, extra_k, extra_v, kpm, attn_mask,
                attn_mask_band, scale, wl, wr, r_first_distance, ops):
        acc = _acc(q.dtype)
        out_b, lse_b = ops.fwd(q, k, v, r, u, vb, scale, wl, wr, kpm, attn_mask, attn_mask_band,
                               r_first_distance)
        lse = lse_b.to(acc)  # rows with no relative key: +inf -> -inf (no mass) here
        lse = lse.masked_fill(lse == float("inf"), float("-inf"))
        out = out_b.to(acc)
        s = _extra_scores(extra_q, extra_k, scale, acc)
        s_lse = torch.logsumexp(s, dim=-1)
        s_out = torch.einsum("bhig,bghd->bihd", torch.exp(s - s_lse[..., None]),
                             extra_v.to(acc))
        merge_block(out, lse, 0, q.shape[1], s_out, s_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, r, u, vb, extra_q, extra_k, extra_v, kpm, attn_mask,
                              attn_mask_band, out, lse)
        ctx.args = (scale, wl, wr, r_first_distance, ops)
        return out

    @staticmethod
    def backward(ctx, dout):
        (q, k, v, r, u, vb, extra_q, extra_k, extra_v, kpm, attn_mask, attn_mask_band, out,
         lse) = ctx.saved_tensors
        scale, wl, wr, r_first_distance, ops = ctx.args
        acc = _acc(q.dtype)
        dout = _contiguous_last(dout)
        # the kernel's backward from the merged out and lse (+inf: a row with no key at all)
        lse_k = lse.masked_fill(~torch.isfinite(lse), float("inf")).to(ops.lse_dtype(q.dtype))
        grads = ops.bwd(dout, q, k, v, r, u, vb, out, lse_k, scale, wl, wr, kpm, attn_mask,
                        attn_mask_band, r_first_distance)
        # the extra part: dS = P * (dO . v_g - rowsum(dO * O)), P the joint softmax's columns
        dout_a = dout.to(acc)
        p = torch.exp(_extra_scores(extra_q, extra_k, scale, acc) - lse[..., None])
        delta = (dout_a * out.to(acc)).sum(-1).transpose(1, 2)  # [B, H, Lq]
        ds = p * (torch.einsum("bihd,bghd->bhig", dout_a, extra_v.to(acc)) - delta[..., None])
        d_eq = torch.einsum("bhig,bghd->bihd", ds, extra_k.to(acc)) * scale
        d_ek = torch.einsum("bhig,bihd->bghd", ds, extra_q.to(acc)) * scale
        d_ev = torch.einsum("bhig,bihd->bghd", p, dout_a)
        return (*grads, d_eq.to(extra_q.dtype), d_ek.to(extra_k.dtype), d_ev.to(extra_v.dtype),
                *(None,) * 8)


def rel_attention_extra_keys(backend: str, q, k, v, r, r_w_bias, r_r_bias, extra, softmax_scale,
                             wl, wr, kpm, attn_mask, attn_mask_band, r_first_distance=None,
                             deterministic=False):
    """The fused kernels of ``backend`` (``"triton"`` or ``"cpu"``) with ``extra = (extra_q,
    extra_k, extra_v)`` on arguments ``rel_attention`` validated and normalised (no dropout,
    no memory; ``r_first_distance`` as the ops take it)."""
    ts = [_contiguous_last(t) for t in (q, k, v, r, r_w_bias, r_r_bias) + tuple(extra)]
    return _ExtraKeysAttn.apply(*ts, kpm, attn_mask, attn_mask_band, softmax_scale, wl, wr,
                                r_first_distance, KernelOps(backend, deterministic))
