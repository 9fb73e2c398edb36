"""Drop-ins for the GTrXL attention of reinforcement-learning libraries, computed by
``txl_kernels.rel_attention``: exact Transformer-XL attention with memory.

- RLlib ``ray.rllib.models.torch.modules.relative_multi_head_attention.RelativeMultiHeadAttention``:
  ``[B, T, in_dim]`` batch-first, memory ``[B, Tau, in_dim]`` concatenated in front (detached),
  optional input LayerNorm over memory and input, no u/v projection bias, causal mask
  ``j <= i + Tau`` (``sequence_mask``), scale ``head_dim ** -0.5``, output ``SlimFC`` with an
  optional activation. The table is ``RelativePositionEmbedding(Tau + T)`` (distances
  ``Tau + T - 1`` down to 0, sin then cos halves), projected by ``_pos_proj``.
- DI-engine ``ding.torch_utils.network.gtrxl.AttentionXL``: seq-first ``(cur_seq, bs, dim)``,
  ``full_input`` = memory + input, u / v passed to ``forward``, a ``(cur_seq, full_seq, 1)`` bool
  mask (True = masked; the model's is ``triu(ones, 1 + prev_seq)``), dropout on the
  probabilities and on the output.

Both shifts read row ``j - i + T - 1`` of a table of ``Tau + T`` rows: ``rel_attention``'s row,
causal, the projected table passed as a view.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .._export import onnx_exporting
from .._utils import describe
from ..functional import BACKENDS, mask_to_band, rel_attention
from ._dropin import adopt

__all__ = ["RLlibRelativeMultiHeadAttention", "DIEngineAttentionXL"]

_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "elu": nn.ELU, "swish": nn.SiLU,
                "silu": nn.SiLU}


def _check_backend(name: str, backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend must be one of {BACKENDS}, got {backend!r}")


class _SlimFC(nn.Module):
    """RLlib ``SlimFC`` parameters: ``_model = Sequential(Linear[, activation])``."""

    def __init__(self, in_size: int, out_size: int, use_bias: bool = True,
                 activation_fn: Union[str, Callable, None] = None):
        super().__init__()
        linear = nn.Linear(in_size, out_size, bias=use_bias)
        nn.init.xavier_uniform_(linear.weight)
        if use_bias:
            nn.init.zeros_(linear.bias)
        layers = [linear]
        if isinstance(activation_fn, str):
            if activation_fn == "linear":
                activation_fn = None
            elif activation_fn in _ACTIVATIONS:
                activation_fn = _ACTIVATIONS[activation_fn]
            else:
                raise ValueError(f"unknown activation {activation_fn!r}; use one of "
                                 f"{sorted(_ACTIVATIONS)}, 'linear', None or a module class")
        if activation_fn is not None:
            layers.append(activation_fn())
        self._model = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self._model(x)


class _RLlibPositionEmbedding(nn.Module):
    """RLlib ``RelativePositionEmbedding``: buffer ``inverse_freq``; rows for distances
    ``seq_length - 1`` down to 0, ``cat(sin, cos)``, shape ``[L, 1, out_dim]``."""

    def __init__(self, out_dim: int):
        super().__init__()
        self.out_dim = out_dim
        self.register_buffer("inverse_freq",
                             1 / (10000 ** (torch.arange(0, out_dim, 2.0) / out_dim)))

    def forward(self, seq_length: int) -> Tensor:
        # (the original builds float32 positions; the buffer's dtype equals it there, and keeps
        # a float64 module usable)
        pos = torch.arange(seq_length - 1, -1, -1.0, dtype=self.inverse_freq.dtype,
                           device=self.inverse_freq.device)
        x = torch.outer(pos, self.inverse_freq)
        return torch.cat([torch.sin(x), torch.cos(x)], dim=-1)[:, None, :]


class RLlibRelativeMultiHeadAttention(nn.Module):
    """Drop-in for RLlib's ``RelativeMultiHeadAttention(in_dim, out_dim, num_heads, head_dim,
    input_layernorm=False, output_activation=None)``.

    Parameters / buffers (state dict keys) as the original: ``_qkv_layer._model.0.weight``,
    ``_linear_layer._model.0.weight``, ``_uvar``, ``_vvar``, ``_pos_proj._model.0.weight``,
    ``_rel_pos_embedding.inverse_freq``, ``_input_layernorm.*``.

    ``forward(inputs, memory=None)``: inputs ``[B, T, in_dim]``, memory ``[B, Tau, in_dim]``
    (None: no memory; the original requires a tensor). Returns ``[B, T, out_dim]``. Causal
    attention over memory + inputs, passed as ``causal=True`` (no mask tensor).
    """

    _NAME = "RLlibRelativeMultiHeadAttention"

    def __init__(self, in_dim: int, out_dim: int, num_heads: int, head_dim: int,
                 input_layernorm: bool = False,
                 output_activation: Union[str, Callable, None] = None, backend: str = "auto",
                 **kwargs):
        super().__init__(**kwargs)
        _check_backend(self._NAME, backend)
        self._num_heads, self._head_dim = num_heads, head_dim
        self.in_dim, self.out_dim, self.backend = in_dim, out_dim, backend
        self._qkv_layer = _SlimFC(in_dim, 3 * num_heads * head_dim, use_bias=False)
        self._linear_layer = _SlimFC(num_heads * head_dim, out_dim, use_bias=False,
                                     activation_fn=output_activation)
        self._uvar = nn.Parameter(torch.zeros(num_heads, head_dim))
        self._vvar = nn.Parameter(torch.zeros(num_heads, head_dim))
        nn.init.xavier_uniform_(self._uvar)
        nn.init.xavier_uniform_(self._vvar)
        self._pos_proj = _SlimFC(in_dim, num_heads * head_dim, use_bias=False)
        self._rel_pos_embedding = _RLlibPositionEmbedding(out_dim)
        self._input_layernorm = nn.LayerNorm(in_dim) if input_layernorm else None

    def forward(self, inputs: Tensor, memory: Optional[Tensor] = None) -> Tensor:
        if not isinstance(inputs, Tensor) or inputs.dim() != 3 or inputs.shape[-1] != self.in_dim:
            raise ValueError(f"{self._NAME}: inputs must be [B, T, in_dim={self.in_dim}], got "
                             f"{describe(inputs)}")
        B, T = inputs.shape[0], inputs.shape[1]
        if memory is not None:
            if not isinstance(memory, Tensor) or memory.dim() != 3 or memory.shape[0] != B \
                    or memory.shape[-1] != self.in_dim:
                raise ValueError(f"{self._NAME}: memory must be [B={B}, Tau, in_dim="
                                 f"{self.in_dim}], got {describe(memory)}")
            inputs = torch.cat((memory.detach(), inputs), dim=1)
        K = inputs.shape[1]
        if self._input_layernorm is not None:
            inputs = self._input_layernorm(inputs)
        H, d = self._num_heads, self._head_dim
        q, k, v = self._qkv_layer(inputs).chunk(3, dim=-1)      # views
        q = q[:, K - T:].reshape(B, T, H, d)                      # a view
        k, v = k.reshape(B, K, H, d), v.reshape(B, K, H, d)
        table = self._rel_pos_embedding(K).to(inputs.dtype)
        if table.shape[-1] != self.in_dim:
            raise ValueError(f"{self._NAME}: the position table has out_dim={self.out_dim} "
                             f"features but _pos_proj takes in_dim={self.in_dim} (the original "
                             f"needs out_dim == in_dim too)")
        r = self._pos_proj(table).view(K, H, d)
        out = rel_attention(q, k, v, r, self._uvar.to(q.dtype), self._vvar.to(q.dtype),
                            causal=True, softmax_scale=d ** -0.5, backend=self.backend)
        return self._linear_layer(out.reshape(B, T, H * d))

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "RLlibRelativeMultiHeadAttention":
        """Wrap an RLlib ``RelativeMultiHeadAttention``: shares its layers and parameters (same
        objects). ``kwargs``: ``backend``."""
        lin = module._linear_layer._model[0]
        with torch.device("meta"):
            new = cls(module._qkv_layer._model[0].in_features, lin.out_features,
                      module._num_heads, module._head_dim,
                      input_layernorm=module._input_layernorm is not None, **kwargs)
        return adopt(new, module, ("_qkv_layer", "_linear_layer", "_uvar", "_vvar", "_pos_proj",
                                   "_rel_pos_embedding", "_input_layernorm"))


class DIEngineAttentionXL(nn.Module):
    """Drop-in for DI-engine's ``AttentionXL(input_dim, head_dim, head_num, dropout)``
    (``dropout`` is an ``nn.Module``, applied to the probabilities and to the output).

    Parameters (state dict keys) as the original: ``attention_kv.0``, ``attention_q.0``,
    ``project.0``, ``project_pos.0`` (Linear with bias).

    ``forward(inputs, pos_embedding, full_input, u, v, mask=None)``: inputs ``(cur_seq, bs,
    input_dim)``, full_input ``(full_seq, bs, input_dim)`` (memory then inputs), pos_embedding
    ``(full_seq, 1, input_dim)`` (distances ``full_seq - 1`` down to 0), u / v ``[head_num,
    head_dim]``, mask ``(cur_seq, full_seq, 1)`` bool, True = masked. The mask must mask every
    key after its query (the model's causal ``triu(ones, 1 + prev_seq)``; checked, one host
    sync, as the original's ``mask.any().item()``; not while ``torch.onnx.export`` traces,
    where the mask is a graph input): for such keys the original reads wrapped-around
    position scores, which have no meaning. The mask reaches the kernel with its band
    descriptor (the causal mask is a band: no mask is read).
    """

    _NAME = "DIEngineAttentionXL"

    def __init__(self, input_dim: int, head_dim: int, head_num: int, dropout: nn.Module,
                 backend: str = "auto"):
        super().__init__()
        _check_backend(self._NAME, backend)
        if not isinstance(dropout, nn.Module):
            raise TypeError(f"{self._NAME}: dropout must be an nn.Module (e.g. nn.Dropout(p)), "
                            f"got {type(dropout).__name__}")
        self.head_num, self.head_dim, self.dropout = head_num, head_dim, dropout
        self.input_dim, self.backend = input_dim, backend
        self.attention_kv = nn.Sequential(nn.Linear(input_dim, head_dim * head_num * 2))
        self.attention_q = nn.Sequential(nn.Linear(input_dim, head_dim * head_num))
        self.project = nn.Sequential(nn.Linear(head_dim * head_num, input_dim))
        self.project_pos = nn.Sequential(nn.Linear(input_dim, head_dim * head_num))
        self.scale = 1 / (head_dim ** 0.5)

    def _seq(self, name: str, t, batch: Optional[int] = None) -> None:
        if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != self.input_dim \
                or (batch is not None and t.shape[1] != batch):
            raise ValueError(f"{self._NAME}: {name} must be (seq, bs, input_dim="
                             f"{self.input_dim}) seq-first, got {describe(t)}")

    def forward(self, inputs: Tensor, pos_embedding: Tensor, full_input: Tensor, u: Tensor,
                v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        self._seq("inputs", inputs)
        cur, bs = inputs.shape[0], inputs.shape[1]
        self._seq("full_input", full_input, bs)
        full = full_input.shape[0]
        if full < cur:
            raise ValueError(f"{self._NAME}: full_input ({full} steps) must hold memory + the "
                             f"{cur} input steps")
        if not isinstance(pos_embedding, Tensor) or tuple(pos_embedding.shape) != (
                full, 1, self.input_dim):
            raise ValueError(f"{self._NAME}: pos_embedding must be (full_seq={full}, 1, "
                             f"{self.input_dim}), got {describe(pos_embedding)}")
        H, D = self.head_num, self.head_dim
        for name, t in (("u", u), ("v", v)):
            if not isinstance(t, Tensor) or tuple(t.shape) != (H, D):
                raise ValueError(f"{self._NAME}: {name} must be [head_num, head_dim] = "
                                 f"[{H}, {D}], got {describe(t)}")
        prev = full - cur
        am = band = None
        if mask is not None:
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool \
                    or tuple(mask.shape) != (cur, full, 1):
                raise ValueError(f"{self._NAME}: mask must be a bool tensor (cur_seq, full_seq,"
                                 f" 1) = ({cur}, {full}, 1), True = masked; got "
                                 f"{describe(mask)}")
            am = mask[..., 0]
        # A check of the mask's values, skipped while torch.onnx.export traces: there the mask
        # is a graph input, and a check of the example mask would hold for that one alone.
        future = None if onnx_exporting() else torch.ones(
            cur, full, dtype=torch.bool, device=inputs.device).triu(1 + prev)
        if future is not None and bool((future if am is None else future & ~am).any()):
            raise ValueError(f"{self._NAME}: the mask lets queries attend keys after them (or "
                             f"mask is None with cur_seq > 1), where the original reads "
                             f"wrapped-around position scores; pass the causal mask "
                             f"triu(ones(cur_seq, full_seq), 1 + prev_seq)")
        if am is not None:
            band = mask_to_band(am)
            am = am[None, None]
        k, vv = self.attention_kv(full_input).chunk(2, dim=-1)
        q = self.attention_q(inputs).view(cur, bs, H, D).transpose(0, 1)
        k = k.view(full, bs, H, D).transpose(0, 1)
        vv = vv.view(full, bs, H, D).transpose(0, 1)
        r = self.project_pos(pos_embedding).view(full, H, D)
        drop = self.dropout.p if self.training and isinstance(self.dropout, nn.Dropout) else 0.0
        if self.training and not isinstance(self.dropout, (nn.Dropout, nn.Identity)):
            raise NotImplementedError(f"{self._NAME}: only nn.Dropout / nn.Identity can be "
                                      f"applied to the attention probabilities in training, "
                                      f"got {type(self.dropout).__name__}")
        out = rel_attention(q, k, vv, r, u.to(q.dtype), v.to(q.dtype), causal=True,
                            attn_mask=am, attn_mask_band=band, softmax_scale=self.scale,
                            dropout_p=drop, backend=self.backend)
        out = out.transpose(0, 1).reshape(cur, bs, H * D)
        return self.dropout(self.project(out))

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "DIEngineAttentionXL":
        """Wrap a DI-engine ``AttentionXL``: shares its layers and dropout module (same
        objects). ``kwargs``: ``backend``."""
        with torch.device("meta"):
            new = cls(module.attention_q[0].in_features, module.head_dim, module.head_num,
                      module.dropout, **kwargs)
        return adopt(new, module, ("attention_kv", "attention_q", "project", "project_pos"))
