"""Drop-in for Hugging Face transformers 5.x ``ParakeetEncoderAttention``
(``transformers.models.parakeet.modeling_parakeet``; NVIDIA Parakeet CTC / TDT / RNNT),
computed by ``txl_kernels.rel_attention``.

The original is NeMo's relative attention (R = 2T - 1 rows from distance T - 1 down to
-(T - 1), ``bias_u`` / ``bias_v`` [H, D], scale ``head_dim ** -0.5``), but it builds the shifted
position term in full and hands it to the attention interface as a float ``attention_mask``
(``finfo.min`` at masked pairs). Here the position term stays inside the kernel, and the
encoder's boolean mask is split, on the device and without a host sync, into key padding (a
key no query may attend), query padding (a query that may attend no key) and what remains
(``attn_mask``, with a :func:`~txl_kernels.mask_to_band` descriptor): for the encoder's
padding-only mask what remains is empty, so the fused kernel reads no ``[T, T]`` mask. A flat
``(B, T)`` mask (True = valid frame) skips even that and reaches the kernel as
``key_padding_mask`` alone.

Fully masked query rows (padded frames): the original adds ``finfo.min`` to every score of the
row, which absorbs the content term in fp32 / fp64, so its softmax is uniform over all keys and
the row is the mean of the values, and its gradient (the softmax's at the uniform point) still
reaches q, k and ``bias_u``; the drop-in reproduces both without a [T, T] tensor. In fp16 / bf16
the original's padded rows are not exactly uniform; they never reach a valid frame.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from ..functional import BACKENDS, mask_to_band
from ._dropin import adopt
from .conformer import _RelPosAttention, _shape

__all__ = ["ParakeetEncoderAttention"]


class ParakeetEncoderAttention(_RelPosAttention):
    """Drop-in for transformers' ``ParakeetEncoderAttention(config, layer_idx)``.

    Args:
        config: the encoder config (``ParakeetEncoderConfig`` or any object with
            ``hidden_size``, ``num_attention_heads``, ``attention_bias``,
            ``attention_dropout``; ``num_key_value_heads`` and ``head_dim`` optional).
        layer_idx: kept as ``self.layer_idx``.
        backend: ``rel_attention`` backend: ``"auto"``, ``"reference"`` or ``"triton"``.

    Parameters and state dict keys as the original: ``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj`` (bias when ``config.attention_bias``), ``relative_k_proj`` (no bias),
    ``bias_u``, ``bias_v`` ([H, D]).

    ``forward(hidden_states, position_embeddings, attention_mask=None, **kwargs)`` returns
    ``(attn_output, None)``:
        hidden_states ``[B, T, hidden]``; position_embeddings ``(1 or B, 2T - 1, hidden)``
        (``ParakeetEncoderRelPositionalEncoding``; its ``B`` copies run one sequence at a time
        unless passed as an expanded view or with one row). attention_mask (True / nonzero =
        attend): the encoder's ``(B, 1, T, T)``, or ``(B, T, T)``, ``(B, 1, 1, T)`` (keys
        only), or a flat ``(B, T)`` per-frame mask meaning what the encoder builds from it
        (``m[:, None, :] & m[:, :, None]``). Other keyword arguments of the attention
        interface are accepted and ignored. The attention probabilities are not returned.
    """

    _NAME = "ParakeetEncoderAttention"

    def __init__(self, config, layer_idx: Optional[int] = None, backend: str = "auto"):
        nn.Module.__init__(self)
        self.config = config
        self.layer_idx = layer_idx
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // max(heads, 1)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if kv_heads != heads:
            raise ValueError(f"{self._NAME}: num_key_value_heads must equal num_attention_heads "
                             f"({heads}) as in Parakeet, got {kv_heads}")
        if heads < 1 or hidden % heads or self.head_dim * heads != hidden:
            raise ValueError(f"{self._NAME}: hidden_size must be num_attention_heads * head_dim, "
                             f"got hidden_size={hidden}, num_attention_heads={heads}, "
                             f"head_dim={self.head_dim}")
        if backend not in BACKENDS:
            raise ValueError(f"{self._NAME}: backend must be one of {BACKENDS}, got {backend!r}")
        self.num_key_value_groups = 1
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        # what the shared base reads
        self.h, self.d_k, self.n_feat, self.backend = heads, self.head_dim, hidden, backend
        self.s_d_k = self.head_dim ** 0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=bias)
        self.relative_k_proj = nn.Linear(hidden, hidden, bias=False)
        self.bias_u = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.bias_v = nn.Parameter(torch.zeros(heads, self.head_dim))

    # The shared base's names for the original's layers (no state dict keys of their own).
    linear_q = property(lambda self: self.q_proj)
    linear_k = property(lambda self: self.k_proj)
    linear_v = property(lambda self: self.v_proj)
    linear_out = property(lambda self: self.o_proj)
    linear_pos = property(lambda self: self.relative_k_proj)
    pos_bias_u = property(lambda self: self.bias_u)
    pos_bias_v = property(lambda self: self.bias_v)
    dropout = property(lambda self: SimpleNamespace(p=self.attention_dropout))

    def _split_mask(self, mask, batch: int, qlen: int):
        """-> (key padding [B, K], query padding [B, T], residual [B|1, 1, T, K] True = masked,
        its band descriptor); any may be None."""
        if mask is None:
            return None, None, None, None
        if not isinstance(mask, Tensor) or mask.is_floating_point() or mask.is_complex():
            got = f"dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"{self._NAME}: attention_mask must be a bool or integer tensor "
                            f"(True / nonzero = attend), got {got}")
        keep = mask if mask.dtype == torch.bool else mask.ne(0)
        shape = tuple(keep.shape)
        if keep.dim() == 2 and shape == (batch, qlen):
            return ~keep, ~keep, None, None
        if keep.dim() == 3 and shape[0] in (1, batch) and shape[1:] == (qlen, qlen):
            keep = keep.unsqueeze(1)
            shape = tuple(keep.shape)
        if keep.dim() == 4 and shape[0] in (1, batch) and shape[1] == 1 \
                and shape[2] in (1, qlen) and shape[3] == qlen:
            k_valid = keep.any(dim=2)[:, 0].expand(batch, qlen)     # some query attends it
            q_valid = keep.any(dim=3)[:, 0].expand(batch, qlen)     # it attends some key
            if shape[2] == 1:  # the same keys for every query: key padding says it all
                return ~k_valid, ~q_valid, None, None
            rest = ~keep & q_valid[:, None, :, None] & k_valid[:, None, None, :]
            return ~k_valid, ~q_valid, rest, mask_to_band(rest)
        raise ValueError(f"{self._NAME}: attention_mask must be (B, 1, T, T), (B, T, T), "
                         f"(B, 1, 1, T) or (B, T) with B={batch}, T={qlen}; got {list(shape)}")

    def forward(self, hidden_states: Tensor, position_embeddings: Optional[Tensor],
                attention_mask: Optional[Tensor] = None, **kwargs):
        self._check_seq("hidden_states", hidden_states)
        B, T = hidden_states.shape[0], hidden_states.shape[1]
        if position_embeddings is None:
            raise ValueError(f"{self._NAME}: position_embeddings are required "
                             f"(ParakeetEncoderRelPositionalEncoding's output)")
        self._check_pos_emb(position_embeddings, B, T, "")
        kpm, qpad, rest, band = self._split_mask(attention_mask, B, T)
        self._grab = {} if qpad is not None else None
        try:
            out = self._attend(hidden_states, hidden_states, hidden_states, position_embeddings,
                               kpm, rest, (-1, -1), attn_mask_band=band)
            grabbed, self._grab = self._grab, None
        finally:
            self._grab = None
        if qpad is not None:
            q, k, v = (grabbed[m] for m in (self.q_proj, self.k_proj, self.v_proj))
            out = torch.where(qpad[:, :, None, None], self._masked_rows(q, k, v).to(out.dtype), out)
        return self._finish(out, None), None

    _grab = None

    def _project(self, linear: nn.Linear, x: Tensor) -> Tensor:
        y = super()._project(linear, x)
        if self._grab is not None:
            self._grab[linear] = y  # the forward's q / k / v, for the fully masked rows
        return y

    def _masked_rows(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """What the original gives a fully masked row: softmax over all keys of scores that are
        all equal (``finfo.min`` absorbs them), so the mean of v; its gradient is the softmax's
        at the uniform point, which still reaches q, k and bias_u through the content term
        ``x_ij = scale (q_i + u) . k_j``: ``dx_ij = (dO_i . v_j - mean_j dO_i . v_j) / T``.
        That is exactly the gradient of ``f_i = (1/T) sum_j (x_ij - mean_j x_ij) v_j`` (v held
        constant), added as ``f - f.detach()`` (value 0); computed through ``[D, D]`` products,
        no [T, T] tensor. [B, T, H, D]."""
        T = k.shape[1]
        qu = q + self.bias_u.to(q.dtype)
        vd = v.detach()
        kv = torch.einsum("bjhd,bjhe->bhde", k, vd)
        x_mean = torch.einsum("bihd,bhd->bih", qu, k.mean(dim=1))
        f = (torch.einsum("bihd,bhde->bihe", qu, kv)
             - x_mean[..., None] * vd.sum(dim=1)[:, None]) * (self.scaling / T)
        return v.mean(dim=1, keepdim=True) + (f - f.detach())

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "ParakeetEncoderAttention":
        """Wrap a transformers ``ParakeetEncoderAttention``: shares its layers and biases (same
        Parameter objects), copies ``attention_dropout`` and the training mode. ``kwargs`` go to
        the constructor (``backend``)."""
        with torch.device("meta"):
            new = cls(module.config, module.layer_idx, **kwargs)
        new.attention_dropout = module.attention_dropout
        return adopt(new, module, ("q_proj", "k_proj", "v_proj", "o_proj", "relative_k_proj",
                                   "bias_u", "bias_v"))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.n_feat}, num_heads={self.h}, head_dim={self.d_k}, "
                f"backend={self.backend!r}")
