"""Drop-in for icefall's Conformer ``RelPositionMultiheadAttention``
(``egs/librispeech/ASR/pruned_transducer_stateless5/conformer.py`` and the recipes that copy it),
computed by ``txl_kernels.rel_attention``.

icefall scales q by ``d ** -0.5`` *before* adding the position biases, which are themselves
``pos_bias_u * exp(pos_bias_u_scale)`` (ScaledLinear-style): scores are
``(q d^-1/2 + u e^su) . k + (q d^-1/2 + v e^sv) . p``, i.e. ``rel_attention`` with
``softmax_scale = d ** -0.5`` and biases ``u e^su sqrt(d)``, ``v e^sv sqrt(d)``. Its
``rel_shift`` (an ``as_strided`` view) reads row ``j - i + T - 1`` of a table of
``left_context + 2T - 1`` rows, with ``left_context`` cached keys in front of the ``T`` current
ones: exactly ``rel_attention``'s row ``p = j - i + Lq - 1`` with Transformer-XL memory, so the
projected table passes as a view with row offset 0.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .._utils import describe
from ..functional import BACKENDS, rel_attention
from ..scripting import mark_cpu_op, rel_attention_cpu_op, rel_attention_torch
from ._dropin import adopt, check_key_padding_mask, same_values

__all__ = ["IcefallRelPositionMultiheadAttention", "ScaledLinear"]


class ScaledLinear(nn.Linear):
    """icefall's ``ScaledLinear`` parameters: ``weight``, ``bias``, and log-scales
    ``weight_scale`` / ``bias_scale`` (effective weight ``weight * exp(weight_scale)``)."""

    def __init__(self, *args, initial_scale: float = 1.0, initial_speed: float = 1.0,
                 **kwargs):
        super().__init__(*args, **kwargs)
        log_scale = torch.tensor(float(initial_scale)).log()
        self.weight_scale = nn.Parameter(log_scale.clone())
        if self.bias is not None:
            self.bias_scale = nn.Parameter(log_scale.clone())
        else:
            self.register_parameter("bias_scale", None)
        # icefall's initialisation: small uniform weights, the fan-in scale in weight_scale
        std = 0.1 / initial_speed
        with torch.no_grad():
            nn.init.uniform_(self.weight, -(3 ** 0.5) * std, (3 ** 0.5) * std)
            if self.bias is not None:
                self.bias.zero_()
            self.weight_scale += math.log(self.weight.shape[1] ** -0.5 / std)

    def get_weight(self) -> Tensor:
        return self.weight * self.weight_scale.exp()

    def get_bias(self) -> Optional[Tensor]:
        if self.bias is None or self.bias_scale is None:
            return None
        return self.bias * self.bias_scale.exp()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.get_weight(), self.get_bias())


def _scripted_masks(name: str, key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
                    bsz: int, H: int, tgt: int, src: int
                    ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The TorchScript forward's masks, checked as the eager forward checks them: the key
    padding mask (N, S) and the attention mask (L, S) or (N * num_heads, L, S), bool or uint8
    (True = masked), as bool, the attention mask as [1 or N, 1 or H, L, S]."""
    kpm: Optional[Tensor] = None
    if key_padding_mask is not None:
        if (key_padding_mask.dtype != torch.bool and key_padding_mask.dtype != torch.uint8) \
                or key_padding_mask.dim() != 2 or key_padding_mask.shape[0] != bsz \
                or key_padding_mask.shape[1] != src:
            raise ValueError(f"{name}: key_padding_mask must be a bool or uint8 tensor "
                             f"(N, S) = ({bsz}, {src}), True = padded; got shape "
                             f"{key_padding_mask.shape}")
        kpm = key_padding_mask.to(torch.bool)
    am: Optional[Tensor] = None
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and attn_mask.dtype != torch.uint8:
            raise TypeError(f"{name}: attn_mask must be a bool or uint8 tensor (True = "
                            f"masked); additive float masks are not supported")
        am = attn_mask.to(torch.bool)
        if am.dim() == 2 and am.shape[0] == tgt and am.shape[1] == src:
            am = am[None, None]
        elif am.dim() == 3 and am.shape[0] == bsz * H and am.shape[1] == tgt \
                and am.shape[2] == src:
            am = am.view(bsz, H, tgt, src)
        else:
            raise ValueError(f"{name}: attn_mask must be (L, S) = ({tgt}, {src}) or "
                             f"(N * num_heads, L, S) = ({bsz * H}, {tgt}, {src}), got "
                             f"shape {attn_mask.shape}")
    return kpm, am


class IcefallRelPositionMultiheadAttention(nn.Module):
    """Drop-in for icefall's ``RelPositionMultiheadAttention(embed_dim, num_heads, dropout)``.

    Parameters (state dict keys) as the original: ``in_proj`` / ``out_proj`` / ``linear_pos``
    (ScaledLinear: ``weight``, ``bias``, ``weight_scale``, ``bias_scale``), ``pos_bias_u``,
    ``pos_bias_v``, ``pos_bias_u_scale``, ``pos_bias_v_scale``.

    ``forward(query, key, value, pos_emb, key_padding_mask=None, need_weights=True,
    attn_mask=None, left_context=0)`` -> ``(attn_output, None)``:
        query ``(L, N, E)``; key / value ``(S, N, E)`` with ``S = left_context + L`` (the cached
        keys first, as the encoder's ``chunk_forward`` passes them); pos_emb ``(1 or N,
        left_context + 2L - 1, E)`` (icefall's ``RelPositionalEncoding(x, left_context)``).
        key_padding_mask ``(N, S)`` bool / uint8, True = padded: reaches the kernel as key
        padding. attn_mask bool / uint8 ``(L, S)`` or ``(N * num_heads, L, S)``, True = masked.
        Float (additive) attn_mask is not supported. The averaged attention weights are not
        computed: the second value is always None (icefall's encoder discards it).
        As in icefall, inputs with equal values share one projection (``torch.equal``: the
        input projected is ``query``, or ``key`` for key / value), so distinct tensors with
        equal values get icefall's per-input gradients. Comparing distinct tensors of one
        shape costs a pass over them and a host sync (none when one object is passed, as
        icefall's encoder does). Under ``torch.export`` only one object counts as equal
        (values are unknown while tracing; the outputs are the same either way).

    Fully masked query rows give 0 (icefall gives 0 when both masks are given, NaN otherwise).

    ``torch.jit.script`` (icefall's export) compiles it: the scripted forward computes the same
    outputs with the C++ CPU op or the reference math in TorchScript (docs/dropins.md,
    TorchScript); ``backend="triton"`` does not script.
    """

    _NAME = "IcefallRelPositionMultiheadAttention"

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0,
                 backend: str = "auto"):
        super().__init__()
        if not isinstance(embed_dim, int) or not isinstance(num_heads, int) or num_heads < 1 \
                or embed_dim < 1 or embed_dim % num_heads:
            raise ValueError(f"{self._NAME}: embed_dim must be a positive multiple of num_heads, "
                             f"got embed_dim={embed_dim!r}, num_heads={num_heads!r}")
        if backend not in BACKENDS:
            raise ValueError(f"{self._NAME}: backend must be one of {BACKENDS}, got {backend!r}")
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.head_dim = embed_dim // num_heads
        self.backend = backend
        self.in_proj = ScaledLinear(embed_dim, 3 * embed_dim, bias=True)
        self.out_proj = ScaledLinear(embed_dim, embed_dim, bias=True, initial_scale=0.25)
        self.linear_pos = ScaledLinear(embed_dim, embed_dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(num_heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.empty(num_heads, self.head_dim))
        self.pos_bias_u_scale = nn.Parameter(torch.zeros(()))
        self.pos_bias_v_scale = nn.Parameter(torch.zeros(()))
        nn.init.normal_(self.pos_bias_u, std=0.01)
        nn.init.normal_(self.pos_bias_v, std=0.01)

    def _heads(self, y: Tensor) -> Tensor:
        """(L, N, H*D) -> [N, L, H, D], a view."""
        return y.view(*y.shape[:2], self.num_heads, self.head_dim).transpose(0, 1)

    def _check(self, name: str, t, length: Optional[int] = None, batch: Optional[int] = None):
        if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != self.embed_dim \
                or (length is not None and t.shape[0] != length) \
                or (batch is not None and t.shape[1] != batch):
            raise ValueError(f"{self._NAME}: {name} must be (time, batch, embed_dim="
                             f"{self.embed_dim}) seq-first, got {describe(t)}")

    def _masks(self, key_padding_mask, attn_mask, bsz: int, tgt: int, src: int):
        kpm = None
        if key_padding_mask is not None:
            check_key_padding_mask(self._NAME, key_padding_mask, "(N, S)", (bsz, src),
                                   (torch.bool, torch.uint8))
            kpm = key_padding_mask.to(torch.bool)
        am = None
        if attn_mask is not None:
            if not isinstance(attn_mask, Tensor) or attn_mask.dtype not in (torch.bool,
                                                                            torch.uint8):
                got = getattr(attn_mask, "dtype", describe(attn_mask))
                raise TypeError(f"{self._NAME}: attn_mask must be a bool or uint8 tensor "
                                f"(True = masked); got {got} (additive float masks are not "
                                f"supported)")
            am = attn_mask.to(torch.bool)
            if am.dim() == 2 and tuple(am.shape) == (tgt, src):
                am = am[None, None]
            elif am.dim() == 3 and tuple(am.shape) == (bsz * self.num_heads, tgt, src):
                am = am.view(bsz, self.num_heads, tgt, src)
            else:
                raise ValueError(f"{self._NAME}: attn_mask must be (L, S) = ({tgt}, {src}) or "
                                 f"(N * num_heads, L, S) = ({bsz * self.num_heads}, {tgt}, {src}),"
                                 f" got {list(attn_mask.shape)}")
        return kpm, am

    def forward(self, query: Tensor, key: Tensor, value: Tensor, pos_emb: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None,
                left_context: int = 0) -> Tuple[Tensor, Optional[Tensor]]:
        if torch.jit.is_scripting():
            return self._forward_scripted(query, key, value, pos_emb, key_padding_mask,
                                          attn_mask, left_context)
        return self._forward_eager(query, key, value, pos_emb, key_padding_mask, attn_mask,
                                   left_context)

    @torch.jit.unused
    def _forward_eager(self, query: Tensor, key: Tensor, value: Tensor, pos_emb: Tensor,
                       key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
                       left_context: int) -> Tuple[Tensor, Optional[Tensor]]:
        self._check("query", query)
        tgt, bsz = query.shape[0], query.shape[1]
        if isinstance(left_context, bool) or not isinstance(left_context, int) \
                or left_context < 0:
            raise ValueError(f"{self._NAME}: left_context must be an int >= 0, "
                             f"got {left_context!r}")
        src = tgt + left_context
        self._check("key", key, src, bsz)
        self._check("value", value, src, bsz)
        rows = left_context + 2 * tgt - 1
        if not isinstance(pos_emb, Tensor) or pos_emb.dim() != 3 \
                or pos_emb.shape[0] not in (1, bsz) \
                or tuple(pos_emb.shape[1:]) != (rows, self.embed_dim):
            raise ValueError(f"{self._NAME}: pos_emb must be (1 or N={bsz}, left_context + 2L - 1"
                             f" = {rows}, {self.embed_dim}) for L={tgt}, left_context="
                             f"{left_context}; got {describe(pos_emb)}")
        kpm, am = self._masks(key_padding_mask, attn_mask, bsz, tgt, src)
        E = self.embed_dim
        w, b = self.in_proj.get_weight(), self.in_proj.get_bias()
        # icefall dispatches on values (torch.equal), not identity: equal inputs share one
        # projection, so the gradients reach query (self-attention) or key (key = value) only
        if same_values(query, key) and same_values(key, value):  # self-attention: one matmul
            q, k, v = (self._heads(t) for t in F.linear(query, w, b).chunk(3, dim=-1))
        else:
            q = self._heads(F.linear(query, w[:E], b[:E]))
            if same_values(key, value):
                k, v = (self._heads(t) for t in F.linear(key, w[E:], b[E:]).chunk(2, dim=-1))
            else:
                k = self._heads(F.linear(key, w[E:2 * E], b[E:2 * E]))
                v = self._heads(F.linear(value, w[2 * E:], b[2 * E:]))
        if pos_emb.shape[0] > 1 and pos_emb.stride(0) == 0:
            pos_emb = pos_emb[:1]
        p = self.linear_pos(pos_emb)
        p = p.view(*p.shape[:2], self.num_heads, self.head_dim)  # [1 or N, R, H, D]
        root_d = math.sqrt(self.head_dim)
        u = (self.pos_bias_u * self.pos_bias_u_scale.exp() * root_d).to(q.dtype)
        vb = (self.pos_bias_v * self.pos_bias_v_scale.exp() * root_d).to(q.dtype)
        drop = self.dropout if self.training else 0.0

        def call(sl: slice, r: Tensor) -> Tensor:
            return rel_attention(q[sl], k[sl], v[sl], r, u, vb, causal=False,
                                 key_padding_mask=None if kpm is None else kpm[sl],
                                 attn_mask=am if am is None or am.shape[0] == 1 else am[sl],
                                 softmax_scale=1.0 / root_d, dropout_p=drop,
                                 backend=self.backend)

        if p.shape[0] == 1:
            out = call(slice(None), p[0])
        else:  # one table per sequence: r has no batch axis
            out = torch.cat([call(slice(i, i + 1), p[i]) for i in range(bsz)], 0)
        out = out.reshape(bsz, tgt, E).transpose(0, 1)  # (L, N, E)
        return self.out_proj(out), None

    # -- torch.jit.script (icefall's export) ---------------------------------------------
    def __prepare_scriptable__(self) -> "IcefallRelPositionMultiheadAttention":
        """Called by ``torch.jit.script`` before it compiles the module: whether the graph
        calls the C++ CPU op (``scripting.mark_cpu_op``)."""
        mark_cpu_op(self, self._NAME)
        return self

    def _forward_scripted(self, query: Tensor, key: Tensor, value: Tensor, pos_emb: Tensor,
                          key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
                          left_context: int) -> Tuple[Tensor, Optional[Tensor]]:
        """The forward in TorchScript: the eager forward's checks, projections and masks, then
        ``scripting.rel_attention_cpu_op`` or ``scripting.rel_attention_torch``."""
        name = "IcefallRelPositionMultiheadAttention"
        E, H, D = self.embed_dim, self.num_heads, self.head_dim
        if query.dim() != 3 or query.shape[-1] != E:
            raise ValueError(f"{name}: query must be (time, batch, embed_dim={E}) seq-first, "
                             f"got shape {query.shape}")
        tgt, bsz = query.shape[0], query.shape[1]
        if left_context < 0:
            raise ValueError(f"{name}: left_context must be an int >= 0, got {left_context}")
        src = tgt + left_context
        for what, t in (("key", key), ("value", value)):
            if t.dim() != 3 or t.shape[0] != src or t.shape[1] != bsz or t.shape[2] != E:
                raise ValueError(f"{name}: {what} must be (time, batch, embed_dim={E}) "
                                 f"seq-first with time = left_context + L = {src} and batch "
                                 f"{bsz}, got shape {t.shape}")
        rows = left_context + 2 * tgt - 1
        if pos_emb.dim() != 3 or (pos_emb.shape[0] != 1 and pos_emb.shape[0] != bsz) \
                or pos_emb.shape[1] != rows or pos_emb.shape[2] != E:
            raise ValueError(f"{name}: pos_emb must be (1 or N={bsz}, left_context + 2L - 1 = "
                             f"{rows}, {E}) for L={tgt}, left_context={left_context}; got "
                             f"shape {pos_emb.shape}")
        kpm, am = _scripted_masks(name, key_padding_mask, attn_mask, bsz, H, tgt, src)
        w, b = self.in_proj.get_weight(), self.in_proj.get_bias()
        assert b is not None  # in_proj has a bias (constructed with bias=True)
        # As eager (and icefall): equal inputs share one projection
        if torch.equal(query, key) and torch.equal(key, value):
            q, k, v = F.linear(query, w, b).chunk(3, dim=-1)
        else:
            q = F.linear(query, w[:E], b[:E])
            if torch.equal(key, value):
                k, v = F.linear(key, w[E:], b[E:]).chunk(2, dim=-1)
            else:
                k = F.linear(key, w[E:2 * E], b[E:2 * E])
                v = F.linear(value, w[2 * E:], b[2 * E:])
        q = q.view(tgt, bsz, H, D).transpose(0, 1)  # [N, L, H, D] views, as _heads
        k = k.view(src, bsz, H, D).transpose(0, 1)
        v = v.view(src, bsz, H, D).transpose(0, 1)
        if pos_emb.shape[0] > 1 and pos_emb.stride(0) == 0:
            pos_emb = pos_emb[:1]
        p = self.linear_pos(pos_emb)
        p = p.view(p.shape[0], p.shape[1], H, D)  # [1 or N, R, H, D]
        root_d = math.sqrt(D)
        u = (self.pos_bias_u * self.pos_bias_u_scale.exp() * root_d).to(q.dtype)
        vb = (self.pos_bias_v * self.pos_bias_v_scale.exp() * root_d).to(q.dtype)
        drop = self.dropout if self.training else 0.0
        if self.backend == "cpu" and query.device.type != "cpu":
            raise ValueError(f"{name}: backend='cpu' needs CPU tensors, got query on "
                             f"{query.device}")
        outs: List[Tensor] = []
        n = 1 if p.shape[0] == 1 else bsz  # one table per sequence: r has no batch axis
        for i in range(n):
            lo, hi = (0, bsz) if n == 1 else (i, i + 1)
            kp = None if kpm is None else kpm[lo:hi]
            m: Optional[Tensor] = None
            if am is not None:
                m = (am if am.shape[0] == 1 else am[lo:hi]).expand(hi - lo, H, tgt, src)
            if hasattr(self, "_jit_cpu_op") and query.device.type == "cpu":
                outs.append(rel_attention_cpu_op(q[lo:hi], k[lo:hi], v[lo:hi], p[i], u, vb,
                                                 1.0 / root_d, -1, -1, kp, m, drop, name))
            else:
                outs.append(rel_attention_torch(q[lo:hi], k[lo:hi], v[lo:hi], p[i], u, vb,
                                                1.0 / root_d, -1, -1, kp, m, drop))
        out = outs[0] if n == 1 else torch.cat(outs, 0)
        out = out.reshape(bsz, tgt, E).transpose(0, 1)  # (L, N, E)
        return self.out_proj(out), None

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "IcefallRelPositionMultiheadAttention":
        """Wrap an icefall ``RelPositionMultiheadAttention``: shares its layers and parameters
        (same objects), copies dropout and the training mode. ``kwargs``: ``backend``."""
        with torch.device("meta"):
            new = cls(module.embed_dim, module.num_heads, module.dropout, **kwargs)
        return adopt(new, module, ("in_proj", "out_proj", "linear_pos", "pos_bias_u",
                                   "pos_bias_v", "pos_bias_u_scale", "pos_bias_v_scale"))

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"backend={self.backend!r}")
