"""``FusedRelAttention``: drop-in for Transformer-XL's ``RelPartialLearnableMultiHeadAttn``.

Same constructor, forward signature, parameters (state_dict keys) and return value as the
original PyTorch code (kimiyoung/transformer-xl, NVIDIA DeepLearningExamples) and HF TransfoXL's
untie_r layers; the attention itself runs through ``txl_kernels.rel_attention`` (fused Triton
kernel where it can run, the einsum reference elsewhere).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..functional import mask_to_band, rel_attention

__all__ = ["FusedRelAttention"]

_MASK_MODES = ("detect", "dense", "causal")


def _dense_mask_and_band(attn_mask: torch.Tensor):
    """attn_mask (uint8 / bool, [qlen, klen] or [qlen, klen, n]) as a bool mask broadcastable
    to [B, H, Lq, Lk], and its band descriptor, computed on the device at every call (a few
    small kernels, no host sync; nothing cached, so a mask changed in place by any means is
    always read as it is now)."""
    mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask.bool()
    if mask.dim() == 2:
        dense = mask  # broadcasts over batch and heads
    else:
        dense = mask.permute(2, 0, 1)[:, None]  # [1 or B, 1, Lq, Lk], a view
    return dense, mask_to_band(dense)


class FusedRelAttention(nn.Module):
    """Transformer-XL relative multi-head attention layer (``RelPartialLearnableMultiHeadAttn``).

    Args:
        n_head, d_model, d_head, dropout, dropatt, tgt_len, ext_len, mem_len, pre_lnorm: as in
            the original (tgt_len, ext_len and mem_len are kept for signature compatibility).
        layer_norm_epsilon: LayerNorm epsilon (1e-5, the original's default).
        untie_r: if True the layer owns ``r_w_bias`` and ``r_r_bias`` parameters ``[H, D]``
            (HF TransfoXL's untie_r layers); biases passed to ``forward`` still take precedence.
        mask_mode: how ``attn_mask`` reaches the kernel.
            ``"detect"`` (default): the mask goes to the kernel with its band descriptor
            (``txl_kernels.mask_to_band``), computed on the device at every forward, with no
            host sync (a few small kernels; nothing is cached, so a mask modified in place is
            never described stale). When the mask
            is Transformer-XL's causal mask ``triu(ones(qlen, klen), 1 + mlen)``, optionally
            with a same_length band, the kernel reads no mask and skips the masked tiles, as
            with ``causal`` / ``window_size``; any other mask is applied densely.
            ``"dense"``: always apply ``attn_mask`` densely.
            ``"causal"``: no check and no host sync (torch.compile friendly): the layer is
            causal, with ``window_size=(mem_len - 1, 0)`` if ``same_length``; ``attn_mask``
            values are not read.
        same_length: with ``mask_mode="causal"``, apply the same_length band (Transformer-XL's
            ``same_length=True``) using ``mem_len``.
        backend: ``rel_attention`` backend ("auto", "triton" or "reference").
        cp_group: a ``torch.distributed`` process group for context parallelism (default
            None: off). Each rank passes its contiguous slice of the segment (``w``) and of the
            memory (``mems``), in rank order, and the whole position table ``r`` (distances
            ``klen - 1 .. 0`` of the global ``klen``); the attention runs through
            ``txl_kernels.distributed.context_parallel_rel_attention`` (contiguous layout).
            The layer is then causal, with the same_length band ``window_size=(mem_len - 1,
            0)`` if ``same_length``; ``attn_mask`` must be None (the masks are global).

    ``forward(w, r, r_w_bias=None, r_r_bias=None, attn_mask=None, mems=None)``:
        w ``[qlen, bsz, d_model]``; r ``[klen, 1, d_model]`` (position embeddings, distances
        ``klen - 1 .. 0``; any other length raises ValueError, as the original's shapes do);
        mems None, empty, or ``[mlen, bsz, d_model]``; attn_mask uint8 or
        bool ``[qlen, klen]`` or ``[qlen, klen, 1 or bsz]``, 1 = masked. Returns
        ``LayerNorm(w + attn_out)`` (or ``w + attn_out`` with ``pre_lnorm``), ``[qlen, bsz,
        d_model]``. Where the mask leaves pairs that need position rows beyond ``klen`` (no
        mask, or a non-causal mask), those rows count as zero (the original reads wrapped-
        around values there).
    """

    def __init__(self, n_head: int, d_model: int, d_head: int, dropout: float,
                 dropatt: float = 0.0, tgt_len=None, ext_len=None, mem_len=None,
                 pre_lnorm: bool = False, layer_norm_epsilon: float = 1e-5,
                 untie_r: bool = False, mask_mode: str = "detect", same_length: bool = False,
                 backend: str = "auto", cp_group=None):
        super().__init__()
        if mask_mode not in _MASK_MODES:
            raise ValueError(f"FusedRelAttention: mask_mode must be one of {_MASK_MODES}, "
                             f"got {mask_mode!r}")
        if same_length and (mem_len is None or mem_len < 1):
            raise ValueError(f"FusedRelAttention: same_length needs mem_len >= 1, "
                             f"got mem_len={mem_len!r}")
        self.n_head, self.d_model, self.d_head = n_head, d_model, d_head
        self.dropout, self.dropatt_p = dropout, dropatt
        self.tgt_len, self.ext_len, self.mem_len = tgt_len, ext_len, mem_len
        self.pre_lnorm = pre_lnorm
        self.scale = 1 / (d_head ** 0.5)
        self.mask_mode, self.same_length, self.backend = mask_mode, same_length, backend
        self.cp_group = cp_group

        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_epsilon)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        if untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(n_head, d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(n_head, d_head))
            nn.init.normal_(self.r_w_bias, 0.0, 0.02)
            nn.init.normal_(self.r_r_bias, 0.0, 0.02)
        else:
            self.r_w_bias = None
            self.r_r_bias = None

    # -- mask handling -------------------------------------------------------------------
    def _mask_args(self, attn_mask, qlen: int, klen: int, bsz: int):
        """(causal, window_size, dense bool mask broadcastable to [B, H, Lq, Lk] or None,
        its band descriptor or None)."""
        if self.mask_mode == "causal":
            wl = self.mem_len - 1 if self.same_length else -1
            return True, (wl, 0), None, None
        if attn_mask is None:
            return False, (-1, -1), None, None
        if attn_mask.dtype not in (torch.bool, torch.uint8):
            raise TypeError(f"FusedRelAttention: attn_mask must be uint8 or bool (1 = masked), "
                            f"got {attn_mask.dtype}")
        ok = (attn_mask.dim() in (2, 3) and tuple(attn_mask.shape[:2]) == (qlen, klen)
              and (attn_mask.dim() == 2 or attn_mask.shape[2] in (1, bsz)))
        if not ok:
            raise ValueError(f"FusedRelAttention: attn_mask must be [qlen, klen] = "
                             f"[{qlen}, {klen}] or [qlen, klen, 1 or bsz={bsz}], "
                             f"got {list(attn_mask.shape)}")
        dense, band = _dense_mask_and_band(attn_mask)
        return False, (-1, -1), dense, band if self.mask_mode == "detect" else None

    # -- forward ---------------------------------------------------------------------------
    def forward(self, w: torch.Tensor, r: torch.Tensor, r_w_bias: Optional[torch.Tensor] = None,
                r_r_bias: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                mems: Optional[torch.Tensor] = None) -> torch.Tensor:
        if w.dim() != 3 or w.shape[-1] != self.d_model:
            raise ValueError(f"FusedRelAttention: w must be [qlen, bsz, d_model={self.d_model}], "
                             f"got {list(w.shape)}")
        if r.dim() != 3 or r.shape[1] != 1 or r.shape[-1] != self.d_model:
            raise ValueError(f"FusedRelAttention: r must be [rlen, 1, d_model={self.d_model}], "
                             f"got {list(r.shape)}")
        r_w_bias = self.r_w_bias if r_w_bias is None else r_w_bias
        r_r_bias = self.r_r_bias if r_r_bias is None else r_r_bias
        if r_w_bias is None or r_r_bias is None:
            raise ValueError("FusedRelAttention: r_w_bias and r_r_bias must be passed to forward "
                             "unless the layer owns them (untie_r=True)")
        qlen, bsz = w.shape[0], w.shape[1]
        H, D = self.n_head, self.d_head

        if mems is not None and mems.numel() > 0:
            if mems.dim() != 3 or mems.shape[1:] != w.shape[1:]:
                raise ValueError(f"FusedRelAttention: mems must be [mlen, bsz={bsz}, "
                                 f"d_model={self.d_model}], got {list(mems.shape)}")
            cat = torch.cat([mems, w], 0)
        else:
            cat = w
        w_heads = self.qkv_net(self.layer_norm(cat) if self.pre_lnorm else cat)
        klen = cat.shape[0]
        w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)
        # Views only: [L, B, H*D] chunk -> [L, B, H, D] -> batch-first [B, L, H, D].
        q = w_head_q[-qlen:].view(qlen, bsz, H, D).transpose(0, 1)
        k = w_head_k.view(klen, bsz, H, D).transpose(0, 1)
        v = w_head_v.view(klen, bsz, H, D).transpose(0, 1)
        rlen = r.shape[0]
        # (with cp_group, klen is this rank's; r covers the global one, checked by the ring)
        if rlen != klen and self.cp_group is None:
            raise ValueError(f"FusedRelAttention: r must have klen = mlen + qlen = {klen} rows "
                             f"(distances klen - 1 .. 0), got {rlen} rows (r "
                             f"{list(r.shape)})")
        r_head_k = self.r_net(r).view(rlen, H, D)

        if self.cp_group is not None:
            attn_vec = self._context_parallel(q, k, v, r_head_k, r_w_bias, r_r_bias, attn_mask,
                                              klen - qlen)
            return self._output(w, attn_vec, qlen, bsz)
        causal, window, dense, band = self._mask_args(attn_mask, qlen, klen, bsz)
        if not causal and band is None:
            # Pairs right of the diagonal need rows klen .. klen + qlen - 2: they count as zero.
            if qlen > 1:
                r_head_k = F.pad(r_head_k, (0, 0, 0, 0, 0, qlen - 1))
        attn_vec = rel_attention(
            q, k, v, r_head_k, r_w_bias.to(q.dtype), r_r_bias.to(q.dtype), causal=causal,
            window_size=window, attn_mask=dense, attn_mask_band=band, softmax_scale=self.scale,
            dropout_p=self.dropatt_p if self.training else 0.0, backend=self.backend)
        return self._output(w, attn_vec, qlen, bsz)

    def _context_parallel(self, q, k, v, r_head_k, r_w_bias, r_r_bias, attn_mask, mlen: int):
        from ..distributed import context_parallel_rel_attention

        if attn_mask is not None:
            raise ValueError("FusedRelAttention: with cp_group the layer is causal (same_length"
                             " as window_size); attn_mask must be None, got a tensor of shape "
                             f"{list(attn_mask.shape)}")
        wl = self.mem_len - 1 if self.same_length else -1
        return context_parallel_rel_attention(
            q, k, v, r_head_k, r_w_bias.to(q.dtype), r_r_bias.to(q.dtype), group=self.cp_group,
            mlen=mlen, layout="contiguous", causal=True, window_size=(wl, 0),
            softmax_scale=self.scale, dropout_p=self.dropatt_p if self.training else 0.0,
            backend=self.backend)

    def _output(self, w, attn_vec, qlen: int, bsz: int):
        # [B, Lq, H, D] -> [Lq, B, H*D]
        attn_vec = attn_vec.transpose(0, 1).reshape(qlen, bsz, self.n_head * self.d_head)
        attn_out = self.drop(self.o_net(attn_vec))
        if self.pre_lnorm:
            return w + attn_out
        return self.layer_norm(w + attn_out)
