"""``rel_attention``'s extra keys (``extra_q`` / ``extra_k`` / ``extra_v``) on the fused kernels.

The ``G`` extra keys join the relative-attention keys in one softmax. The fused kernel computes
the relative part as usual and returns its normalised rows and row log-sum-exp; the
``[B, H, Lq, G]`` extra part (with its own dropout mask) is computed here in torch and folded
in by a log-sum-exp merge (the arithmetic of ``_block_ops.merge_block``, with which the
context-parallel ring merges its blocks), in place on the kernel's output. The backward is
the kernel's own, given the *merged* output and log-sum-exp (as the context-parallel ring
calls it): with those its probabilities are the joint softmax's, and ``rowsum(dO * O)`` is
the joint one, so its gradients are exact; the extra part's gradient is added here. Nothing of size ``Lq x Lk`` is formed.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._block_ops import KernelOps
from ._utils import draw_dropout_seed, last_dim_contiguous
from .reference import extra_scores, finite_or_zero


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _add_weighted(out: Tensor, w: Tensor, x: Tensor) -> None:
    """``out[b, i, h] += sum_g w[b, h, i, g] x[b, g, h]`` in place (out ``[B, Lq, H, D]``, w
    ``[B, H, Lq, G]``, x ``[B, G, H, D]``): one pass over out per extra key, no ``[B, Lq, H,
    D]`` temporary, for a few keys; a batched GEMM for many."""
    if w.shape[-1] <= 8:
        for g in range(w.shape[-1]):
            out.addcmul_(w[..., g].transpose(1, 2)[..., None], x[:, g, None])
    else:
        out.add_(torch.matmul(w, x.transpose(1, 2)).transpose(1, 2))


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """``sum_d a[b, i, h, d] b[b, i, h, d]`` as ``[B, H, Lq]`` (batched dot products: no
    ``[B, Lq, H, D]`` product)."""
    return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1))[..., 0, 0].transpose(1, 2)


def _rows_of(t: Tensor, base: Tensor):
    """``(start, step)`` when ``t`` is ``base[:, start::step]`` for autograd (its grad_fn a
    slice of dim 1 of ``base``), else None: then its gradient can be added into base's in
    place rather than through a ``base``-sized slice gradient."""
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "SliceBackward0" or not base.requires_grad:
        return None
    src = fn.next_functions[0][0] if fn.next_functions else None
    if base.grad_fn is not None:
        ok = src is base.grad_fn
    else:  # a leaf: its AccumulateGrad node
        ok = src is not None and getattr(src, "variable", None) is base
    if not ok or fn._saved_dim != 1 or fn._saved_step < 1:
        return None
    start, step = fn._saved_start, fn._saved_step  # a negative start reads as a huge one
    if start is None or t.shape[1] < 1 or start + step * (t.shape[1] - 1) >= base.shape[1]:
        return None
    return int(start), int(step)


def _merged_forward(q, k, v, r, u, vb, extra_q, extra_k, extra_v, kpm, attn_mask,
                    attn_mask_band, softmax_scale, wl, wr, r_first_distance, dropout_p,
                    dropout_seed, extra_keep, ops, out=None):
    """-> (out, lse): the kernel's rows merged with the extra keys' (``out``: the kernel
    writes there and the merge is in place, fp32 / fp64 only; no autograd)."""
    acc = _acc(q.dtype)
    drop = dict(dropout_p=dropout_p, dropout_seed=dropout_seed)
    s = extra_scores(extra_q, extra_k, softmax_scale, acc)  # first: out may be q, also extra_q
    out_b, lse_b = ops.fwd(q, k, v, r, u, vb, softmax_scale, wl, wr, kpm, attn_mask,
                           attn_mask_band, r_first_distance, out=out, **drop)
    lse_b = lse_b.to(acc)  # rows with no relative key: +inf -> -inf (no mass) here
    lse_b = lse_b.masked_fill(lse_b == float("inf"), float("-inf"))
    # the log-sum-exp merge of the kernel's rows with the extra keys' (merge_block's
    # arithmetic, in place on the kernel's fresh output): out = out_b exp(lse_b - lse) +
    # sum_g exp(s_g - lse) Z_g v_g, lse = logaddexp(lse_b, logsumexp_g s_g)
    out = out_b.to(acc)
    lse = torch.logaddexp(lse_b, torch.logsumexp(s, dim=-1))
    safe = finite_or_zero(lse)
    p = torch.exp(s - safe[..., None])
    z = _dropout_factor(extra_keep, dropout_p, acc)
    if z is not None:  # the lse stays that of the undropped scores, as in the kernels
        p = p * z
    out.mul_(torch.exp(lse_b - safe).transpose(1, 2)[..., None])
    _add_weighted(out, p, extra_v.to(acc))
    out = out.to(q.dtype)
    return out, lse


class _ExtraKeysAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, r, u, vb, extra_q, extra_k, extra_v, kpm, attn_mask,
                attn_mask_band, softmax_scale, wl, wr, r_first_distance, dropout_p, dropout_seed,
                extra_keep, ops, k_rows, v_rows):
        out, lse = _merged_forward(q, k, v, r, u, vb, extra_q, extra_k, extra_v, kpm,
                                   attn_mask, attn_mask_band, softmax_scale, wl, wr,
                                   r_first_distance, dropout_p, dropout_seed, extra_keep, ops)
        ctx.save_for_backward(q, k, v, r, u, vb, extra_q, extra_k, extra_v, kpm, attn_mask,
                              attn_mask_band, out, lse, dropout_seed, extra_keep)
        ctx.args = (softmax_scale, wl, wr, r_first_distance, dropout_p, ops)
        ctx.q_is_extra_q = extra_q is q  # then d(extra_q) goes into dq, in place
        ctx.rows = (k_rows, v_rows)  # extra_k / extra_v as row slices of k / v, or None
        return out

    @staticmethod
    def backward(ctx, dout):
        (q, k, v, r, u, vb, extra_q, extra_k, extra_v, kpm, attn_mask, attn_mask_band, out,
         lse, dropout_seed, extra_keep) = ctx.saved_tensors
        softmax_scale, wl, wr, r_first_distance, dropout_p, ops = ctx.args
        acc = _acc(q.dtype)
        dout = last_dim_contiguous(dout)
        # the kernel's backward from the merged out and lse (+inf: a row with no key at all)
        lse_k = lse.masked_fill(~torch.isfinite(lse), float("inf")).to(ops.lse_dtype(q.dtype))
        dq, *grads = ops.bwd(dout, q, k, v, r, u, vb, out, lse_k, softmax_scale, wl, wr, kpm,
                             attn_mask, attn_mask_band, r_first_distance, dropout_p=dropout_p,
                             dropout_seed=dropout_seed)
        # the extra part: dS = P * (Z * dO . v_g - rowsum(dO * O)), P the joint softmax's
        # columns, Z the dropout factor (1 without dropout); O is the dropped output, so
        # rowsum(dO * O) is the joint rowsum of P * Z * dP, as in the kernels' backward
        dout_a = dout.to(acc)
        p = torch.exp(extra_scores(extra_q, extra_k, softmax_scale, acc) - lse[..., None])
        z = _dropout_factor(extra_keep, dropout_p, acc)
        pz = p if z is None else p * z
        ev, ek = extra_v.to(acc), extra_k.to(acc)
        dp = torch.matmul(dout_a.transpose(1, 2), ev.permute(0, 2, 3, 1))  # [B, H, Lq, G]
        delta = _row_dot(dout_a, out.to(acc))  # [B, H, Lq]
        ds = (pz * dp - p * delta[..., None]) * softmax_scale
        d_ek = torch.matmul(ds.transpose(-1, -2), extra_q.to(acc).transpose(1, 2))
        d_ev = torch.matmul(pz.transpose(-1, -2), dout_a.transpose(1, 2))
        if ctx.q_is_extra_q and dq.dtype == acc:
            _add_weighted(dq, ds, ek)  # d(extra_q) is dq's: one gradient, no second tensor
            d_eq = None
        else:
            d_eq = torch.zeros(extra_q.shape, dtype=acc, device=dq.device)
            _add_weighted(d_eq, ds, ek)
            d_eq = d_eq.to(extra_q.dtype)
        d_ek, d_ev = d_ek.transpose(1, 2), d_ev.transpose(1, 2)
        extra_grads = []
        for i, (d_e, rows, e) in enumerate(zip((d_ek, d_ev), ctx.rows, (extra_k, extra_v))):
            g = grads[i]  # dk, dv
            if rows is not None and g is not None and g.dtype == acc:
                # a slice of k / v: its gradient joins dk / dv in place (no k-sized slice
                # gradient for autograd to allocate and add)
                start, step = rows
                g[:, start:start + step * (e.shape[1] - 1) + 1:step].add_(d_e)
                extra_grads.append(None)
            else:
                extra_grads.append(d_e.to(e.dtype))
        return (dq, *grads, d_eq, *extra_grads, *(None,) * 13)


def _dropout_factor(keep, dropout_p: float, acc):
    """``keep / (1 - dropout_p)`` in ``acc``, or None without dropout."""
    if dropout_p == 0.0:
        return None
    return keep.to(acc) / (1.0 - dropout_p)


def rel_attention_extra_keys(backend: str, q, k, v, r, r_w_bias, r_r_bias, extra, softmax_scale,
                             wl, wr, kpm, attn_mask, attn_mask_band, r_first_distance=None,
                             dropout_p: float = 0.0, deterministic=False, out=None):
    """The fused kernels of ``backend`` (``"triton"`` or ``"cpu"``) with ``extra = (extra_q,
    extra_k, extra_v)`` on arguments ``rel_attention`` validated and normalised (no memory;
    ``r_first_distance`` as the ops take it).

    ``dropout_p > 0``: the kernels drop the relative part with their keep-mask, from a
    (seed, offset) pair drawn first (as ``rel_attention`` draws it for the backend); the
    ``[B, H, Lq, G]`` extra part is dropped with ``torch.rand(...) >= dropout_p``, drawn next
    from the default generator of q's device, kept ones scaled by ``1 / (1 - dropout_p)``;
    both masks are kept for the backward.

    ``out`` (CPU kernel, fp32 / fp64, no autograd; may be q): the result is written there,
    the kernel's rows first and the merge in place."""
    ts = [last_dim_contiguous(t) for t in (q, k, v, r, r_w_bias, r_r_bias) + tuple(extra)]
    seed = keep = None
    if dropout_p > 0.0:
        seed = draw_dropout_seed(q.device)
        B, Lq, H, _ = q.shape
        keep = torch.rand((B, H, Lq, extra[1].shape[1]), device=q.device) >= dropout_p
    if out is not None:
        return _merged_forward(*ts, kpm, attn_mask, attn_mask_band, softmax_scale, wl, wr,
                               r_first_distance, float(dropout_p), seed, keep,
                               KernelOps(backend, deterministic), out=out)[0]
    rows = [_rows_of(e, base) if e is e2 and base is b2 else None
            for e, base, e2, b2 in ((extra[1], k, ts[7], ts[1]), (extra[2], v, ts[8], ts[2]))]
    return _ExtraKeysAttn.apply(*ts, kpm, attn_mask, attn_mask_band, softmax_scale, wl, wr,
                                r_first_distance, float(dropout_p), seed, keep,
                                KernelOps(backend, deterministic), *rows)
