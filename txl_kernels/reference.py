"""Reference path: the original Transformer-XL algorithm (einsum for AC and BD, the relative
shift, mask, softmax, P @ V), generalised to the ``rel_attention`` contract.

It is the fallback on every device and the oracle the fused kernels are tested against. It
materialises the full ``[B, H, Lq, Lk]`` score tensors, exactly as the original code does.

All functions here take already-validated arguments (see ``txl_kernels.functional``).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
from torch import Tensor
import torch.nn.functional as F


__all__ = ["rel_shift", "rel_shift_pad_reshape", "rel_attention_reference", "allowed_pairs",
           "pair_distance", "in_window", "in_band", "autocast_dtype", "finite_or_zero",
           "row_poison", "relative_scores", "weighted_values", "extra_scores"]


def rel_shift_pad_reshape(x: torch.Tensor) -> torch.Tensor:
    """The original Transformer-XL ``_rel_shift`` (pad a zero column, view as
    ``[klen + 1, qlen]``, drop the first row, view back), on ``[..., qlen, klen]`` tensors.

    Only valid when the position axis has ``klen`` rows (R == Lk). On allowed pairs it equals
    :func:`rel_shift`; outside them it produces wrap-around values that the mask hides.
    """
    *lead, qlen, klen = x.shape
    zero_pad = x.new_zeros(*lead, qlen, 1)
    x_padded = torch.cat([zero_pad, x], dim=-1)
    x_padded = x_padded.view(*lead, klen + 1, qlen)
    return x_padded[..., 1:, :].reshape(*lead, qlen, klen)


def rel_shift(bdt: torch.Tensor, klen: int, first_distance: Optional[int] = None) -> torch.Tensor:
    """Generalised relative shift: ``BD[..., i, j] = bdt[..., i, j - i + c]`` with the row
    constant ``c = first_distance - klen + Lq`` (``c = Lq - 1`` for ``first_distance=None``,
    i.e. ``klen - 1``: the table whose row 0 holds distance ``klen - 1``).

    ``bdt`` is ``[..., Lq, R]`` (``(q + v) @ r^T``, row ``p`` of r holding distance
    ``first_distance - p``); positions outside ``[0, R)`` give 0. This is the pad/reshape
    trick: the position axis is zero-padded (or cropped) to a width ``W`` that covers every
    index, with ``a = klen - 1 - first_distance`` columns on the left, so that column
    ``j - i + Lq - 1`` of the padded axis is row ``j - i + c`` of r; the last two dims are
    flattened, and reading ``Lq`` rows of ``W - 1`` from flat offset ``Lq - 1`` starts row
    ``i`` ``i`` columns further left (flat index ``i * W + (j - i + Lq - 1)``). Only slicing
    and reshapes, so torch.compile traces it.
    """
    # Shapes as lists (no starred unpacking): torch.jit.script compiles this function too.
    lead, qlen, rlen = list(bdt.shape[:-2]), bdt.shape[-2], bdt.shape[-1]
    # W = klen + qlen: >= klen + qlen - 1 columns (every j - i + Lq - 1 a pair can use) and
    # W - 1 >= klen. A negative pad is a crop of columns no pair reads (R > W on the right,
    # or a first_distance above klen - 1 on the left): one expression for every R, without
    # max(), so torch.export and the ONNX exporters keep the lengths symbolic (no guard on R
    # against Lq + Lk).
    width = klen + qlen
    if first_distance is None:
        flat = F.pad(bdt, [0, width - rlen])
    else:
        left = klen - 1 - first_distance
        flat = F.pad(bdt, [left, width - left - rlen])
    flat = flat.reshape(lead + [qlen * width])
    rows = flat[..., qlen - 1:qlen - 1 + qlen * (width - 1)]
    return rows.reshape(lead + [qlen, width - 1])[..., :klen]


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its NaN / +-inf entries replaced by 0 (the gradient passes where x is
    finite, 0 elsewhere): the operands of the products in which excluded pairs take part with
    an exact 0 (``P @ V``, ``dS @ K``, ``dS @ R``), so that 0 * NaN cannot leak into allowed
    results. One pass and one allocation of x's size (no boolean temporaries)."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def row_poison(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[...]`` of ``dtype`` for ``x`` ``[..., D]``: 0 where the row ``x[..., :]`` is all
    finite, NaN where it holds a NaN or +-inf. Added to the scores of the pairs that use the
    row, it makes an allowed pair with a non-finite operand poison its query row (as the
    product with the raw operand would), while ``finite_or_zero`` keeps the row out of every
    pair the mask excludes (whose score the mask then replaces by -inf)."""
    # x * 0 is 0 where x is finite and NaN where it is not, so its row sum is 0 or NaN and
    # never overflows (a sum of x itself could, on large finite values); outside autograd (a
    # constant). Two vectorised passes: several times faster on CPUs than an inf-norm
    # reduction, which ATen does not vectorise.
    return (x.detach() * 0).sum(-1).to(dtype)


def pair_distance(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    """``d[i, j] = (i + Lk - Lq) - j`` ([Lq, Lk], int64): the distance of every pair, memory
    first (bottom-right aligned)."""
    return (torch.arange(lq, device=device)[:, None] + (lk - lq)) - torch.arange(lk, device=device)


def in_window(d: torch.Tensor, left, right) -> torch.Tensor:
    """``(left < 0 or d <= left) and (right < 0 or -d <= right)``; -1 = unbounded side.
    ``left`` / ``right`` may be ints or 0-d tensors (read on the device, no host sync).
    A Python int side is resolved here (no ``bool | Tensor`` in the graph, which
    TorchScript's tracer and the ONNX exporter cannot represent)."""
    allowed = None
    for dist, bound in ((d, left), (-d, right)):
        if isinstance(bound, int):
            if bound < 0:
                continue
            side = dist <= bound
        else:
            side = (bound < 0) | (dist <= bound)
        allowed = side if allowed is None else allowed & side
    return torch.ones_like(d, dtype=torch.bool) if allowed is None else allowed


def in_band(d: torch.Tensor, left, right) -> torch.Tensor:
    """``-right <= d <= left`` with plain bounds (no sentinel; either may be negative): the
    pairs of a band descriptor ``[is_band, left, right]`` (``functional.mask_to_band``)."""
    return (d <= left) & (-d <= right)


def allowed_pairs(
    lq: int,
    lk: int,
    window_left: int,
    window_right: int,
    key_padding_mask: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    device: torch.device,
    attn_mask_band: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Boolean tensor broadcastable to ``[B, H, Lq, Lk]``: True where query i may attend key j.

    ``d = (i + Lk - Lq) - j``; allowed iff ``(window_left < 0 or d <= window_left)`` and
    ``(window_right < 0 or -d <= window_right)``, the key is not padded and ``attn_mask`` is
    False there. Causal is ``window_right == 0``. With ``attn_mask_band`` (see
    ``functional.mask_to_band``), attn_mask is replaced by its band when the band's flag is
    set, selected on the device (``torch.where``, no host sync).
    """
    d = pair_distance(lq, lk, device)
    allowed = in_window(d, window_left, window_right)[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    if attn_mask is not None:
        masked = attn_mask
        if attn_mask_band is not None:
            on, bl, br = attn_mask_band.long().unbind()
            masked = torch.where(on != 0, ~in_band(d, bl, br), attn_mask)
        allowed = allowed & ~masked
    return allowed


def relative_scores(q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor,
                    r_r_bias: Tensor, softmax_scale: float,
                    r_first_distance: Optional[int] = None) -> Tensor:
    """The scaled scores ``(AC + BD) * softmax_scale`` ``[B, H, Lq, Lk]``, unmasked, of q
    ``[B, Lq, H, D]`` against k ``[B, Lk, H, D]`` and the position table r ``[R, H, D]``
    (row ``p`` holds distance ``r_first_distance - p``; None: ``Lk - 1 - p``), in the
    accumulation dtype (fp32; fp64 for fp64 inputs). ``q + bias`` is rounded to the input
    dtype, as in the original and the fused kernels; the products are accumulated and held
    in fp32, so a ``|q . k|`` past the input dtype's range (65504 in fp16) stays finite.

    Non-finite rows of k, v (the pair's value row, read here only for that) and r are zeroed
    in the products (``finite_or_zero``) and add NaN to the scores of the pairs that use them
    (``row_poison``): a mask that excludes the pair hides it, an allowed pair poisons its
    query row. The one definition of the two products: the reference, the TorchScript form
    (``scripting.py``) and the context-parallel ring's block math all call it."""
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    rw_head_q = (q + r_w_bias).to(acc_dtype)  # [B, Lq, H, D]
    rr_head_q = (q + r_r_bias).to(acc_dtype)
    # in place: no second score tensor (+ 0 on finite rows)
    ac = torch.einsum("bihd,bjhd->bhij", rw_head_q, finite_or_zero(k).to(acc_dtype))
    ac += (row_poison(k, acc_dtype) + row_poison(v, acc_dtype)).transpose(1, 2)[:, :, None]
    bdt = torch.einsum("bihd,phd->bhip", rr_head_q, finite_or_zero(r).to(acc_dtype))
    bdt += row_poison(r, acc_dtype).t()[None, :, None]  # [B, H, Lq, R]
    return (ac + rel_shift(bdt, k.shape[1], r_first_distance)) * softmax_scale


def weighted_values(prob: Tensor, v: Tensor) -> Tensor:
    """``P @ V``: ``[B, Lq, H, D]`` from probabilities ``[B, H, Lq, Lk]`` and v
    ``[B, Lk, H, D]`` (its non-finite entries as 0, in prob's dtype), so a key whose
    probability is 0 contributes exactly 0."""
    return torch.einsum("bhij,bjhd->bihd", prob, finite_or_zero(v).to(prob.dtype))


def extra_scores(extra_q: Tensor, extra_k: Tensor, softmax_scale: float,
                 acc_dtype: torch.dtype) -> Tensor:
    """The extra keys' scores ``softmax_scale * extra_q_i . extra_k_g``, ``[B, H, Lq, G]`` in
    ``acc_dtype``, from extra_q ``[B, Lq, H, D]`` and extra_k ``[B, G, H, D]`` (a batched GEMM
    on strided views: no copy of extra_q); the reference and the kernels' extra-keys merge
    (``_extra_keys.py``) both score them here."""
    return torch.matmul(extra_q.to(acc_dtype).transpose(1, 2),
                        extra_k.to(acc_dtype).permute(0, 2, 3, 1)) * softmax_scale


def rel_attention_reference(q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor,
                            r_r_bias: Tensor, softmax_scale: float, window_left: int,
                            window_right: int, key_padding_mask: Optional[Tensor] = None,
                            attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                            return_lse: bool = False, attn_mask_band: Optional[Tensor] = None,
                            dropout_mask: Optional[Tensor] = None,
                            r_first_distance: Optional[int] = None,
                            extra: Optional[Tuple[Tensor, Tensor, Tensor]] = None):
    """Einsum relative attention. q ``[B, Lq, H, D]``, k/v ``[B, Lk, H, D]``, r ``[R, H, D]``
    (row ``p`` holds distance ``r_first_distance - p``; None: ``Lk - 1 - p``, see
    :func:`rel_shift`), biases ``[H, D]``; masks already normalised (causal folded into
    ``window_right = 0``, ``attn_mask`` bool broadcastable to ``[B, H, Lq, Lk]``, True =
    masked).

    The AC and BD products are accumulated in fp32 for fp16/bf16 inputs (from fp32 copies of
    ``q + bias``, ``k`` and ``r``), and the scores, softmax and log-sum-exp are held in fp32
    (fp64 inputs stay fp64). What the masks exclude never reaches a result, even where the
    excluded k / v / r rows hold NaN or inf: the products use their finite parts
    (``finite_or_zero``) and a pair whose k, v or r row is not finite gets a NaN score
    (``row_poison``), which the mask hides on excluded pairs and which poisons the query row
    of an allowed one. Returns ``[B, Lq, H, D]`` in q's dtype, and with ``return_lse`` also the
    natural-log row log-sum-exp ``[B, H, Lq]`` (fp32 or fp64; ``+inf`` for rows with no
    allowed key), the quantity the fused forward saves for its backward.

    Dropout (``dropout_p > 0``) acts on the normalised probabilities (the lse is that of the
    undropped scores); kept ones are scaled by ``1 / (1 - dropout_p)``. ``dropout_mask``: an
    explicit keep-mask (bool, True = kept, broadcastable to ``[B, H, Lq, Lk]``, e.g. the fused
    kernels' ``ops.rel_attn_fwd.dropout_keep_mask``) instead of ``F.dropout``'s random one.

    ``extra``: optional ``(extra_q, extra_k, extra_v)`` (``[B, Lq, H, D]``, ``[B, G, H, D]``,
    ``[B, G, H, D]``): ``G`` more keys that every query attends, scored ``softmax_scale *
    extra_q_i . extra_k_g`` (no bias, no position term, no mask) as ``G`` more columns of the
    same softmax, their probabilities weighting ``extra_v``. The lse then covers them too.
    """
    # Autocast, if on, was applied by the caller (functional.rel_attention); here it would
    # turn the fp32 accumulation below back into the low-precision dtype.
    with _no_autocast(q.device.type):
        return _rel_attention_reference(q, k, v, r, r_w_bias, r_r_bias, softmax_scale,
                                        window_left, window_right, key_padding_mask,
                                        attn_mask, dropout_p, return_lse, attn_mask_band,
                                        dropout_mask, r_first_distance, extra)


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype when autocast is on for ``device_type``, else None."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know
        pass
    return None


def _no_autocast(device_type: str):
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def _rel_attention_reference(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left,
                             window_right, key_padding_mask, attn_mask, dropout_p, return_lse,
                             attn_mask_band, dropout_mask=None, r_first_distance=None,
                             extra=None):
    lq, lk = q.shape[1], k.shape[1]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = relative_scores(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, r_first_distance)
    allowed = allowed_pairs(lq, lk, window_left, window_right, key_padding_mask, attn_mask,
                            q.device, attn_mask_band)
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_has_key = allowed.any(dim=-1, keepdim=True)
    if extra is not None:
        # The extra keys: more columns of the same softmax (every row then has a key).
        extra_q, extra_k, extra_v = extra
        scores = torch.cat([scores, extra_scores(extra_q, extra_k, softmax_scale, acc_dtype)],
                           dim=-1)
        row_has_key = torch.ones_like(row_has_key)
        v = torch.cat([v, extra_v], dim=1)
    # Rows without any allowed key: softmax over zeros, then multiplied by 0, so the output
    # and every gradient are exactly 0 (no NaN from -inf - -inf).
    scores = torch.where(row_has_key, scores, scores.new_zeros(()))
    prob = torch.softmax(scores, dim=-1) * row_has_key
    if dropout_p > 0.0 and dropout_mask is not None:
        prob = prob * dropout_mask / (1.0 - dropout_p)
    elif dropout_p > 0.0:
        prob = F.dropout(prob, p=dropout_p, training=True)
    out = weighted_values(prob.to(v.dtype), v).to(q.dtype)
    if not return_lse:
        return out
    lse = torch.logsumexp(scores.detach(), dim=-1)
    lse = torch.where(row_has_key.squeeze(-1), lse, torch.full_like(lse, float("inf")))
    return out, lse
