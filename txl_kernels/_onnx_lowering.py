"""The ONNX lowering of ``rel_attention``: what it computes while ``torch.onnx.export`` traces
(either exporter; txl_kernels/_export.py says why a route and not a per-op translation)."""
from __future__ import annotations

import torch

from .reference import allowed_pairs, rel_shift

__all__ = ["onnx_rel_attention"]


def onnx_rel_attention(q, k, v, r, r_w_bias, r_r_bias, softmax_scale: float, window_left: int,
                       window_right: int, key_padding_mask=None, attn_mask=None,
                       attn_mask_band=None, r_first_distance=None):
    """The reference's forward (``rel_attention_reference`` without dropout), in the form
    ONNX Runtime runs as fast as the original Conformers' exported attention
    (benchmarks/onnx_encoder.py): arguments as normalised by ``rel_attention``.

    * The products are MatMuls on ``[B, H, T, D]`` views: ONNX Runtime's Einsum is slower on
      the ``[B, H, Lq, R]`` position term than its MatMul.
    * Non-finite k / v / r rows as in the reference (an allowed pair that uses one gets a NaN
      score, which poisons its query row; an excluded pair reaches nothing), computed on the
      rows, not on the scores: ``z = x * 0`` is 0 on finite entries and NaN elsewhere, so
      ``x + z.sum(-1)`` is ``x`` on finite rows and NaN across a non-finite one, and the
      products give a NaN score exactly where the reference adds its NaN; v enters ``P @ V``
      with its non-finite entries zeroed (``where(z == 0, v, 0)``), so a probability of 0
      times an inf value cannot leak. No ``nan_to_num`` (its ONNX form casts to fp64) and no
      pass over the ``Lq x Lk`` scores.
    * The scale multiplies ``q + bias`` ([B, Lq, H, D]) rather than the scores.
    * The masks take one pass over the scores (a Where; the rows without an allowed key are
      zeroed on the ``[B, H, Lq, D]`` output), written only when there is a mask or a
      window; without one the scores see the sum of the products and the Softmax only.
    """
    lq, lk = q.shape[1], k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    zk, zv, zr = k * 0, v * 0, r * 0
    k_rows = (k + (zk.sum(dim=-1, keepdim=True) + zv.sum(dim=-1, keepdim=True))).to(acc)
    r_rows = (r + zr.sum(dim=-1, keepdim=True)).to(acc)
    qu = ((q + r_w_bias).to(acc) * softmax_scale).transpose(1, 2)    # [B, H, Lq, D]
    qv = ((q + r_r_bias).to(acc) * softmax_scale).transpose(1, 2)
    scores = torch.matmul(qu, k_rows.permute(0, 2, 3, 1)) \
        + rel_shift(torch.matmul(qv, r_rows.permute(1, 2, 0)), lk, r_first_distance)
    if window_left >= 0 or window_right >= 0 or key_padding_mask is not None \
            or attn_mask is not None:
        allowed = allowed_pairs(lq, lk, window_left, window_right, key_padding_mask, attn_mask,
                                q.device, attn_mask_band)
        row_has_key = allowed.any(dim=-1, keepdim=True)                # [B|1, 1|H, Lq, 1]
        # one pass over the scores: excluded pairs at -inf, and every pair of a row without
        # an allowed key at 0 (its softmax is then finite, and its output row is multiplied
        # by 0 below: exactly 0, as the reference)
        fill = torch.where(row_has_key, scores.new_full((), float("-inf")),
                           scores.new_zeros(()))
        scores = torch.where(allowed, scores, fill)
    else:
        row_has_key = None
    v_finite = torch.where(zv == 0, v, zv.new_zeros(())).transpose(1, 2)
    prob = torch.softmax(scores, dim=-1)
    if prob.dtype != v.dtype:  # a traced .to() is a Cast node even to the same dtype
        prob = prob.to(v.dtype)
    out = torch.matmul(prob, v_finite)                                 # [B, H, Lq, D]
    if row_has_key is not None:
        out = out * row_has_key
    return out.transpose(1, 2).to(q.dtype)
