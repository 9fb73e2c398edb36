"""Drop-in for SpeechBrain's ``speechbrain.nnet.attention.RelPosMHAXL`` (with the position table
of ``RelPosEncXL``), computed by ``txl_kernels.rel_attention``.

SpeechBrain's specifics, kept: both score terms are scaled by ``1 / sqrt(embed_dim)`` (not the
head dim); ``pos_bias_u`` / ``pos_bias_v`` are stored ``(head_dim, num_heads)`` and read through
``.view(num_heads, head_dim)`` (a view here too); the self-attention projection reads
``in_proj_weight`` head-interleaved (``view(B, T, H, 3D).chunk(3)``) while distinct
query / key / value read it in three blocks (``chunk(3, dim=0)``); an optional value bias.
The table has ``2S - 1`` rows (``S`` = keys) from distance ``S - 1`` down; the pad/reshape shift
reads row ``j - i + L - 1``: ``rel_attention``'s row with memory ``S - L``, row offset 0.

``mask_pos_future`` multiplies the shifted position term by ``tril(ones(L, 2S - 1), S - 1 + S -
L)`` *before* the shift's result is cut to ``S`` columns, so for every kept column (``j - i <= S
- 1 <= 2S - 1 - L``) the factor is 1: it changes nothing, and the drop-in keeps the attribute
only (tests check this against the transcription).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .._utils import check_values, describe
from ..functional import BACKENDS, mask_to_band, rel_attention
from ._dropin import adopt, check_key_padding_mask, same_values

__all__ = ["SpeechBrainRelPosMHAXL"]


class SpeechBrainRelPosMHAXL(nn.Module):
    """Drop-in for ``RelPosMHAXL(embed_dim, num_heads, dropout=0.0, vbias=False, vdim=None,
    mask_pos_future=False)``.

    Parameters (state dict keys) as the original: ``in_proj_weight`` (or ``qk_proj_weight`` /
    ``v_proj_weight`` when ``vdim != embed_dim``, which the original's forward does not
    support either), ``value_bias_weight`` (vbias), ``out_proj``, ``linear_pos``,
    ``pos_bias_u``, ``pos_bias_v``.

    ``forward(query, key, value, pos_embs, key_padding_mask=None, attn_mask=None,
    return_attn_weights=True)``:
        query ``(B, L, E)``, key / value ``(B, S, E)`` with ``S >= L`` (``rel_attention`` needs
        at least as many keys as queries); pos_embs ``(1, 2S - 1, E)`` (``RelPosEncXL``).
        key_padding_mask ``(B, S)`` bool, True = padded: reaches the kernel as key padding.
        attn_mask ``(L, S)`` or ``(B * num_heads, L, S)``: bool (True = masked), or
        float holding only 0 and -inf (``get_lookahead_mask``; checked with one host sync);
        a 2-D mask comes with its :func:`~txl_kernels.mask_to_band` descriptor, so the fused
        kernel reads no mask when it is a band (the causal look-ahead mask is one).
        Returns ``(out, None)`` (the attention weights are not computed), or ``out`` when
        ``return_attn_weights=False``.

    Fully masked rows give 0 (as the original does for bool masks; it gives NaN for a float
    -inf mask that masks a whole row).
    """

    _NAME = "SpeechBrainRelPosMHAXL"

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, vbias: bool = False,
                 vdim: Optional[int] = None, mask_pos_future: bool = False,
                 backend: str = "auto"):
        super().__init__()
        vdim = embed_dim if vdim is None else vdim
        if not all(isinstance(n, int) and n > 0 for n in (embed_dim, num_heads, vdim)) \
                or embed_dim % num_heads or vdim % num_heads:
            raise ValueError(f"{self._NAME}: embed_dim and vdim must be positive multiples of "
                             f"num_heads, got embed_dim={embed_dim!r}, vdim={vdim!r}, "
                             f"num_heads={num_heads!r}")
        if backend not in BACKENDS:
            raise ValueError(f"{self._NAME}: backend must be one of {BACKENDS}, got {backend!r}")
        self.embed_dim, self.vdim, self.num_heads = embed_dim, vdim, num_heads
        self._qkv_same_embed_dim = vdim == embed_dim
        self.mask_pos_future = mask_pos_future
        self.dropout = dropout
        self.head_dim, self.vhead_dim = embed_dim // num_heads, vdim // num_heads
        self.backend = backend
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            self.qk_proj_weight = nn.Parameter(torch.empty(2 * embed_dim, embed_dim))
            self.v_proj_weight = nn.Parameter(torch.empty(vdim, embed_dim))
            nn.init.xavier_uniform_(self.qk_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        self.vbias = vbias if vbias else None
        if vbias:
            self.value_bias_weight = nn.Parameter(torch.zeros(vdim))
        self.dropout_att = nn.Dropout(dropout)
        self.out_proj = nn.Linear(vdim, embed_dim)
        self.linear_pos = nn.Linear(embed_dim, embed_dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(self.head_dim, num_heads))
        self.pos_bias_v = nn.Parameter(torch.empty(self.head_dim, num_heads))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)
        self.scale = 1 / math.sqrt(embed_dim)

    def _check(self, name: str, t, batch: Optional[int] = None) -> None:
        if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != self.embed_dim \
                or (batch is not None and t.shape[0] != batch):
            raise ValueError(f"{self._NAME}: {name} must be (batch, time, embed_dim="
                             f"{self.embed_dim}), got {describe(t)}")

    def _attn_mask(self, attn_mask, bsz: int, qlen: int, klen: int):
        """-> (bool mask [1|B, 1|H, L, S] True = masked, band descriptor or None)."""
        if attn_mask is None:
            return None, None
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"{self._NAME}: attn_mask must be a tensor, got "
                            f"{type(attn_mask).__name__}")
        if attn_mask.is_floating_point():
            masked = attn_mask.isneginf()
            check_values(((attn_mask == 0) | masked).all(), ValueError,
                         f"{self._NAME}: a float attn_mask must hold only 0 and -inf "
                         f"(get_lookahead_mask); other additive values are not supported, "
                         f"pass a bool mask")
        elif attn_mask.dtype == torch.bool:
            masked = attn_mask
        else:  # SpeechBrain adds any non-bool mask to the scores (a uint8 1 is +1, not masked)
            raise TypeError(f"{self._NAME}: attn_mask must be bool (True = masked) or a float "
                            f"0 / -inf mask, got {attn_mask.dtype} (SpeechBrain adds it to the "
                            f"scores)")
        if masked.dim() == 2 and tuple(masked.shape) == (qlen, klen):
            return masked[None, None], mask_to_band(masked)
        if masked.dim() == 3 and tuple(masked.shape) == (bsz * self.num_heads, qlen, klen):
            return masked.view(bsz, self.num_heads, qlen, klen), None
        raise ValueError(f"{self._NAME}: attn_mask must be (L, S) = ({qlen}, {klen}) or "
                         f"(B * num_heads, L, S) = ({bsz * self.num_heads}, {qlen}, {klen}), "
                         f"got {list(attn_mask.shape)}")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, pos_embs: Tensor,
                key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                return_attn_weights: bool = True):
        self._check("query", query)
        bsz, qlen = query.shape[0], query.shape[1]
        self._check("key", key, bsz)
        self._check("value", value, bsz)
        klen = key.shape[1]
        if value.shape[1] != klen:
            raise ValueError(f"{self._NAME}: value must have key's length {klen}, got "
                             f"{list(value.shape)}")
        if klen < qlen:
            raise ValueError(f"{self._NAME}: needs at least as many keys as queries (the "
                             f"kernel's memory layout), got L={qlen} queries, S={klen} keys")
        if not isinstance(pos_embs, Tensor) or tuple(pos_embs.shape) != (1, 2 * klen - 1,
                                                                          self.embed_dim):
            raise ValueError(f"{self._NAME}: pos_embs must be (1, 2S - 1 = {2 * klen - 1}, "
                             f"{self.embed_dim}) (RelPosEncXL of the keys), got "
                             f"{describe(pos_embs)}")
        if not self._qkv_same_embed_dim:
            raise NotImplementedError(f"{self._NAME}: vdim != embed_dim is not supported (nor "
                                      f"by SpeechBrain's RelPosMHAXL.forward)")
        kpm = None
        if key_padding_mask is not None:
            check_key_padding_mask(self._NAME, key_padding_mask, "(B, S)", (bsz, klen))
            kpm = key_padding_mask
        am, band = self._attn_mask(attn_mask, bsz, qlen, klen)
        H, D = self.num_heads, self.head_dim
        same_qk, same_kv = same_values(query, key), same_values(key, value)
        if same_qk and same_kv:  # the original's self-attention layout: head-interleaved rows
            q, k, v = F.linear(query, self.in_proj_weight).view(bsz, -1, H, 3 * D).chunk(3, -1)
        else:
            wq, wk, wv = self.in_proj_weight.chunk(3, dim=0)
            q = F.linear(query, wq).view(bsz, -1, H, D)
            k = F.linear(key, wk).view(bsz, -1, H, D)
            v = F.linear(value, wv).view(bsz, -1, H, D)
        if self.vbias is not None:
            v = v + self.value_bias_weight.view(1, 1, H, self.vhead_dim)
        r = self.linear_pos(pos_embs).view(-1, H, D)[:klen + qlen - 1]
        out = rel_attention(q, k, v, r, self.pos_bias_u.view(H, D).to(q.dtype),
                            self.pos_bias_v.view(H, D).to(q.dtype), causal=False,
                            key_padding_mask=kpm, attn_mask=am, attn_mask_band=band,
                            softmax_scale=self.scale,
                            dropout_p=self.dropout if self.training else 0.0,
                            backend=self.backend)
        out = self.out_proj(out.reshape(bsz, qlen, self.vdim))
        return (out, None) if return_attn_weights else out

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "SpeechBrainRelPosMHAXL":
        """Wrap a SpeechBrain ``RelPosMHAXL``: shares its parameters (same objects), copies
        dropout, mask_pos_future and the training mode. ``kwargs``: ``backend``."""
        with torch.device("meta"):
            new = cls(module.embed_dim, module.num_heads, module.dropout,
                      vbias=module.vbias is not None, vdim=module.vdim,
                      mask_pos_future=module.mask_pos_future, **kwargs)
        names = ["out_proj", "linear_pos", "pos_bias_u", "pos_bias_v"]
        names += (["in_proj_weight"] if module._qkv_same_embed_dim
                  else ["qk_proj_weight", "v_proj_weight"])
        names += ["value_bias_weight"] if module.vbias is not None else []
        return adopt(new, module, names)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"backend={self.backend!r}")
