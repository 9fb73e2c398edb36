"""``rel_attention``'s extra keys (``extra_q`` / ``extra_k`` / ``extra_v``) on the fused kernels.

The ``G`` extra keys join the relative-attention keys in one softmax. The fused kernel computes
the relative part as usual and returns its normalised rows and row log-sum-exp; the
``[B, H, Lq, G]`` extra part (with its own dropout mask) is computed here in torch and folded in by a log-sum-exp merge
(``_block_ops.merge_block``, as the context-parallel ring merges its blocks). The backward is the kernel's own, given the *merged*
output and log-sum-exp (as the context-parallel ring calls it): with those its probabilities
are the joint softmax's, and ``rowsum(dO * O)`` is the joint one, so its gradients are exact;
the extra part's gradient is added here. Nothing of size ``Lq x Lk`` is formed.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._block_ops import KernelOps, merge_block
from .cpu_kernel import draw_cpu_dropout_seed, last_dim_contiguous


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _extra_scores(extra_q: Tensor, extra_k: Tensor, scale: float, acc) -> Tensor:
    """``scale * extra_q_i . extra_k_g``, ``[B, H, Lq, G]`` in ``acc``."""
    return torch.einsum("bihd,bghd->bhig", extra_q.to(acc), extra_k.to(acc)) * scale


class _ExtraKeysAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, r, u, vb, extra_q, extra_k, extra_v, kpm, attn_mask,
                attn_mask_band, scale, wl, wr, r_first_distance, dropout_p, dropout_seed,
                extra_keep, ops):
        acc = _acc(q.dtype)
        drop = dict(dropout_p=dropout_p, dropout_seed=dropout_seed)
        out_b, lse_b = ops.fwd(q, k, v, r, u, vb, scale, wl, wr, kpm, attn_mask, attn_mask_band,
                               r_first_distance, **drop)
        lse = lse_b.to(acc)  # rows with no relative key: +inf -> -inf (no mass) here
        lse = lse.masked_fill(lse == float("inf"), float("-inf"))
        out = out_b.to(acc)
        s = _extra_scores(extra_q, extra_k, scale, acc)
        s_lse = torch.logsumexp(s, dim=-1)
        s_prob = torch.exp(s - s_lse[..., None])
        z = _dropout_factor(extra_keep, dropout_p, acc)
        if z is not None:  # the lse stays that of the undropped scores, as in the kernels
            s_prob = s_prob * z
        s_out = torch.einsum("bhig,bghd->bihd", s_prob, extra_v.to(acc))
        merge_block(out, lse, 0, q.shape[1], s_out, s_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, r, u, vb, extra_q, extra_k, extra_v, kpm, attn_mask,
                              attn_mask_band, out, lse, dropout_seed, extra_keep)
        ctx.args = (scale, wl, wr, r_first_distance, dropout_p, ops)
        return out

    @staticmethod
    def backward(ctx, dout):
        (q, k, v, r, u, vb, extra_q, extra_k, extra_v, kpm, attn_mask, attn_mask_band, out,
         lse, dropout_seed, extra_keep) = ctx.saved_tensors
        scale, wl, wr, r_first_distance, dropout_p, ops = ctx.args
        acc = _acc(q.dtype)
        dout = last_dim_contiguous(dout)
        # the kernel's backward from the merged out and lse (+inf: a row with no key at all)
        lse_k = lse.masked_fill(~torch.isfinite(lse), float("inf")).to(ops.lse_dtype(q.dtype))
        grads = ops.bwd(dout, q, k, v, r, u, vb, out, lse_k, scale, wl, wr, kpm, attn_mask,
                        attn_mask_band, r_first_distance, dropout_p=dropout_p,
                        dropout_seed=dropout_seed)
        # the extra part: dS = P * (Z * dO . v_g - rowsum(dO * O)), P the joint softmax's
        # columns, Z the dropout factor (1 without dropout); O is the dropped output, so
        # rowsum(dO * O) is the joint rowsum of P * Z * dP, as in the kernels' backward
        dout_a = dout.to(acc)
        p = torch.exp(_extra_scores(extra_q, extra_k, scale, acc) - lse[..., None])
        z = _dropout_factor(extra_keep, dropout_p, acc)
        pz = p if z is None else p * z
        dp = torch.einsum("bihd,bghd->bhig", dout_a, extra_v.to(acc))
        delta = (dout_a * out.to(acc)).sum(-1).transpose(1, 2)  # [B, H, Lq]
        ds = (pz * dp) - p * delta[..., None]
        d_eq = torch.einsum("bhig,bghd->bihd", ds, extra_k.to(acc)) * scale
        d_ek = torch.einsum("bhig,bihd->bghd", ds, extra_q.to(acc)) * scale
        d_ev = torch.einsum("bhig,bihd->bghd", pz, dout_a)
        return (*grads, d_eq.to(extra_q.dtype), d_ek.to(extra_k.dtype), d_ev.to(extra_v.dtype),
                *(None,) * 11)


def _dropout_factor(keep, dropout_p: float, acc):
    """``keep / (1 - dropout_p)`` in ``acc``, or None without dropout."""
    if dropout_p == 0.0:
        return None
    return keep.to(acc) / (1.0 - dropout_p)


def rel_attention_extra_keys(backend: str, q, k, v, r, r_w_bias, r_r_bias, extra, softmax_scale,
                             wl, wr, kpm, attn_mask, attn_mask_band, r_first_distance=None,
                             dropout_p: float = 0.0, deterministic=False):
    """The fused kernels of ``backend`` (``"triton"`` or ``"cpu"``) with ``extra = (extra_q,
    extra_k, extra_v)`` on arguments ``rel_attention`` validated and normalised (no memory;
    ``r_first_distance`` as the ops take it).

    ``dropout_p > 0``: the kernels drop the relative part with their keep-mask, from a
    (seed, offset) pair drawn first (as ``rel_attention`` draws it for the backend); the
    ``[B, H, Lq, G]`` extra part is dropped with ``torch.rand(...) >= dropout_p``, drawn next
    from the default generator of q's device, kept ones scaled by ``1 / (1 - dropout_p)``;
    both masks are kept for the backward."""
    ts = [last_dim_contiguous(t) for t in (q, k, v, r, r_w_bias, r_r_bias) + tuple(extra)]
    seed = keep = None
    if dropout_p > 0.0:
        if backend == "triton":
            from .ops.rel_attn_fwd import draw_dropout_seed

            seed = draw_dropout_seed(q.device)
        else:
            seed = draw_cpu_dropout_seed()
        B, Lq, H, _ = q.shape
        keep = torch.rand((B, H, Lq, extra[1].shape[1]), device=q.device) >= dropout_p
    return _ExtraKeysAttn.apply(*ts, kpm, attn_mask, attn_mask_band, softmax_scale, wl, wr,
                                r_first_distance, float(dropout_p), seed, keep,
                                KernelOps(backend, deterministic))
