"""Drop-ins for Hugging Face transformers 5.x relative attention, computed by
``txl_kernels.rel_attention``: ``ParakeetEncoderAttention``
(``transformers.models.parakeet.modeling_parakeet``; NVIDIA Parakeet CTC / TDT / RNNT),
``Wav2Vec2ConformerSelfAttention`` (``position_embeddings_type="relative"``) and
``FastSpeech2ConformerAttention`` (both ESPnet's semantics; see their classes). Parakeet:

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

Weight initialisation. transformers initialises parameters by ``isinstance`` dispatch in each
model's ``_init_weights`` (``bias_u`` / ``bias_v``, ``pos_bias_u`` / ``pos_bias_v`` here), on
the meta-device path of ``from_pretrained`` (missing keys), ``initialize_weights()`` and
re-initialisation. So ``from_module`` (and so ``swap_rel_pos_attention``) gives the drop-in a
class derived from both the drop-in and the original transformers class (``<drop-in>`` first,
so every method is the drop-in's): the models' own init, output recorders and other
``isinstance`` checks see it as the original. That class lives in this module under the name
``<drop-in name>AsOriginal`` (built on first use, so pickles of swapped models load).
"""
from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .._export import onnx_exporting
from .._utils import check_values
from ..functional import BACKENDS, check_window, mask_to_band
from ..reference import in_window, pair_distance, rel_shift
from ._dropin import adopt
from .conformer import ESPnetRelPositionMultiHeadedAttention, RelPosAttentionBase

__all__ = ["ParakeetEncoderAttention", "Wav2Vec2ConformerSelfAttention",
           "FastSpeech2ConformerAttention"]

# drop-in class name -> (module, name) of the transformers class it replaces
_ORIGINALS = {
    "ParakeetEncoderAttention": ("transformers.models.parakeet.modeling_parakeet",
                                 "ParakeetEncoderAttention"),
    "Wav2Vec2ConformerSelfAttention": (
        "transformers.models.wav2vec2_conformer.modeling_wav2vec2_conformer",
        "Wav2Vec2ConformerSelfAttention"),
    "FastSpeech2ConformerAttention": (
        "transformers.models.fastspeech2_conformer.modeling_fastspeech2_conformer",
        "FastSpeech2ConformerAttention"),
}
_SUFFIX = "AsOriginal"
_AS_ORIGINAL: Dict[str, type] = {}


def _as_original_class(name: str) -> type:
    """The class ``<name>AsOriginal``: (drop-in ``name``, the transformers original), built
    once; importing the original needs transformers."""
    cls = _AS_ORIGINAL.get(name)
    if cls is None:
        dropin = globals()[name]
        module, attr = _ORIGINALS[name]
        original = getattr(importlib.import_module(module), attr)
        cls = type(name, (dropin, original), {
            "__module__": __name__, "__qualname__": name + _SUFFIX,
            "__doc__": f"{name} (the drop-in) that is also an instance of transformers' "
                       f"{attr}, for the models' isinstance checks (module docstring)."})
        _AS_ORIGINAL[name] = cls
    return cls


def _as_original(new: nn.Module, original: nn.Module) -> nn.Module:
    """Make ``new`` (a drop-in) an instance of ``<drop-in>AsOriginal`` when ``original``'s
    class is the transformers class the drop-in replaces (look-alikes, subclasses of the
    original and subclasses of the drop-in keep their classes)."""
    name = type(new).__name__
    if name not in _ORIGINALS or type(new) is not globals()[name]:
        return new  # a subclass of the drop-in keeps its class
    module, attr = _ORIGINALS[name]
    if type(original).__module__ == module and type(original).__qualname__ == attr:
        new.__class__ = _as_original_class(name)
    return new


def __getattr__(attr: str):
    """``<drop-in>AsOriginal`` on first use (how pickle finds the class of a swapped module)."""
    name = attr[:-len(_SUFFIX)] if attr.endswith(_SUFFIX) else None
    if name in _ORIGINALS:
        return _as_original_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def _attentions_requested(kwargs) -> bool:
    """Whether the caller asked for the attention probabilities: ``output_attentions=True``
    passed down to the layer, or a transformers model collecting ``attentions`` for this
    forward (its ``capture_outputs`` hooks read the layer's second output; the flag may come
    from the config and then never reaches the layer). transformers is not imported here:
    when it is not loaded, no model can be collecting."""
    if kwargs.get("output_attentions"):
        return True
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    collected = collector.get() if collector is not None else None
    return isinstance(collected, dict) and "attentions" in collected


def _eager_terms(module: "RelPosAttentionBase", x: Tensor, pos_emb: Tensor):
    """The originals' score terms, materialised (the reference math of the eager modules):
    ``(q, k, v)`` as ``[B, H, T, D]``, ``ac = (q + u) @ k^T`` and the shifted position term
    ``bd[..., i, j] = ((q + v_bias) @ p^T)[..., i, j - i + T - 1]``, both ``[B, H, T, T]`` and
    unscaled. ``pos_emb``: ``(1 or B, 2T - 1, hidden)``."""
    q, k, v = (module._project(lin, x).transpose(1, 2)
               for lin in (module.linear_q, module.linear_k, module.linear_v))
    p = module._project(module.linear_pos, pos_emb).permute(0, 2, 3, 1)  # [1|B, H, D, 2T-1]
    ac = torch.matmul(q + module.pos_bias_u[None, :, None], k.transpose(2, 3))
    bd = rel_shift(torch.matmul(q + module.pos_bias_v[None, :, None], p), x.shape[1])
    return v, ac, bd


def _outside_window(window: Tuple[int, int], T: int, device) -> Tensor:
    """``[1, 1, T, T]`` True where key ``j`` is outside query ``i``'s ``window`` (``(left,
    right)``, -1 = unbounded), as ``rel_attention`` reads ``window_size``."""
    return ~in_window(pair_distance(T, T, device), *window)[None, None]


def _eager_output(module: "RelPosAttentionBase", probs: Tensor, v: Tensor):
    """The originals' dropout on the probabilities (training only) and ``probs @ v`` ->
    (``[B, T, H, D]``, the probabilities as returned)."""
    probs = F.dropout(probs, p=module.dropout.p, training=module.training)
    return torch.matmul(probs, v).transpose(1, 2), probs


# the submodules and parameters an ESPnet-style original shares with its drop-in
_ESPNET_NAMES = ("linear_q", "linear_k", "linear_v", "linear_out", "dropout", "linear_pos",
                 "pos_bias_u", "pos_bias_v")


class _HFRelPosAttention(RelPosAttentionBase):
    """What the transformers drop-ins share: the boolean / additive mask split on the device
    (key padding, query padding, a rest with its band descriptor) and the original's fully
    masked rows (module docstring)."""

    _FLOAT_MASKS = False  # whether transformers hands this module additive float masks

    def _split_mask(self, mask, batch: int, qlen: int):
        """-> (key padding [B, K], query padding [B, T], residual [B|1, 1, T, K] True = masked,
        its band descriptor); any may be None."""
        if mask is None:
            return None, None, None, None
        if not isinstance(mask, Tensor) or mask.is_complex() \
                or (mask.is_floating_point() and not self._FLOAT_MASKS):
            got = f"dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"{self._NAME}: attention_mask must be a bool or integer tensor "
                            f"(True / nonzero = attend), got {got}")
        if mask.is_floating_point():  # transformers' additive mask: 0 or finfo.min
            keep = mask == 0
            check_values((keep | (mask == torch.finfo(mask.dtype).min)).all(), ValueError,
                         f"{self._NAME}: a float attention_mask must hold only 0 and "
                         f"torch.finfo({mask.dtype}).min (transformers' padding mask); other "
                         f"additive values are not supported")
        else:
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

    def _hf_attend(self, hidden_states: Tensor, pos_emb: Optional[Tensor], mask,
                   pos_name: str, kwargs, window: Tuple[int, int] = (-1, -1)):
        """-> (attn_output, the attention probabilities or None): the fused path, or the
        original's eager math when the caller asks for the probabilities (``kwargs``).
        ``window``: ``rel_attention``'s ``window_size`` (local attention; the eager math
        masks the pairs outside it)."""
        self._check_seq("hidden_states", hidden_states)
        B, T = hidden_states.shape[0], hidden_states.shape[1]
        if pos_emb is None:
            raise ValueError(f"{self._NAME}: {pos_name} are required (the encoder's relative "
                             f"positional encoding)")
        if self.cp_group is not None:
            if mask is not None and (not isinstance(mask, Tensor) or mask.dim() != 2):
                raise ValueError(f"{self._NAME}: with cp_group attention_mask must be None or "
                                 f"this rank's slice of a flat (B, T) per-frame mask, got "
                                 f"{mask.shape if isinstance(mask, Tensor) else mask!r}")
            self._check_global_pos_emb(pos_emb, B, T, hidden_states.device)
        else:
            self._check_pos_emb(pos_emb, B, T, "")
        kpm, qpad, rest, band = self._split_mask(mask, B, T)
        if _attentions_requested(kwargs):
            if self.cp_group is not None:
                raise ValueError(f"{self._NAME}: output_attentions=True is not supported with "
                                 f"cp_group (each rank holds a slice of the keys)")
            masked = None
            if kpm is not None:
                masked = kpm[:, None, None, :] | qpad[:, None, :, None]
                if rest is not None:
                    masked = masked | rest
            if window != (-1, -1):
                outside = _outside_window(window, T, hidden_states.device)
                masked = outside if masked is None else masked | outside
            v, ac, bd = _eager_terms(self, hidden_states, pos_emb)
            out, probs = _eager_output(self, self._eager_probs(ac, bd, masked), v)
            return self._finish(out, None), probs
        self._grab = {} if qpad is not None else None
        try:
            out = self._attend(hidden_states, hidden_states, hidden_states, pos_emb, kpm, rest,
                               window, attn_mask_band=band)
            grabbed = self._grab
        finally:
            self._grab = None
        if qpad is not None:
            q, k, v = (grabbed[m] for m in (self.linear_q, self.linear_k, self.linear_v))
            out = torch.where(qpad[:, :, None, None], self._masked_rows(q, k, v).to(out.dtype), out)
        return self._finish(out, None), None

    def _eager_probs(self, ac: Tensor, bd: Tensor, masked: Optional[Tensor]) -> Tensor:
        """The original eager module's softmax of the scores (``masked``: [B, 1, T, T] True =
        masked, or None)."""
        raise NotImplementedError

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
        no [T, T] tensor. [B, T, H, D]. With ``cp_group`` the sums over the keys run over
        every rank's keys (a differentiable all-reduce: every rank takes this path)."""
        T = k.shape[1]
        if self.cp_group is None and (onnx_exporting() or not torch.is_grad_enabled() or not any(
                t.requires_grad for t in (q, k, v, self.pos_bias_u))):
            # No gradient recorded (inference, or an ONNX graph, which has none): the value
            # alone, without the [D, D] products that only carry the gradient.
            return (v.sum(dim=1) / T)[:, None]
        qu = q + self.pos_bias_u.to(q.dtype)
        sums = [torch.einsum("bjhd,bjhe->bhde", k, v.detach()), k.sum(dim=1), v.sum(dim=1)]
        if self.cp_group is not None:
            from torch.distributed.nn.functional import all_reduce

            sums = [all_reduce(t, group=self.cp_group) for t in sums]
            T = self._global_len(T, k.device)
        kv, k_sum, v_sum = sums
        x_mean = torch.einsum("bihd,bhd->bih", qu, k_sum / T)
        f = (torch.einsum("bihd,bhde->bihe", qu, kv)
             - x_mean[..., None] * v_sum.detach()[:, None]) * (1.0 / (self.s_d_k * T))
        return (v_sum / T)[:, None] + (f - f.detach())


class ParakeetEncoderAttention(_HFRelPosAttention):
    """Drop-in for transformers' ``ParakeetEncoderAttention(config, layer_idx)``.

    Args:
        config: the encoder config (``ParakeetEncoderConfig`` or any object with
            ``hidden_size``, ``num_attention_heads``, ``attention_bias``,
            ``attention_dropout``; ``num_key_value_heads`` and ``head_dim`` optional).
        layer_idx: kept as ``self.layer_idx``.
        backend: ``rel_attention`` backend: ``"auto"``, ``"reference"``, ``"triton"`` or
            ``"cpu"``.
        window_size: ``(left, right)`` local attention, ``rel_attention``'s ``window_size``:
            query ``i`` attends key ``j`` only if ``i - left <= j <= i + right`` (``-1`` =
            unbounded on that side); ``(-1, -1)`` (default) is the original's full attention.
            The same as passing the original an ``attention_mask`` that also masks the pairs
            outside that band, without a ``[T, T]`` mask (time and memory O(T x (left + right
            + 1)) with the fused kernels). Can be changed later through the ``window_size``
            attribute (e.g. on every module after ``swap_rel_pos_attention``).

    Context parallelism (docs/distributed.md): with ``module.cp_group = group`` each rank
    passes its contiguous slice of the frames, the whole ``2T - 1`` position table and its
    slice of a flat ``(B, T)`` mask (or none, on every rank).

    Parameters and state dict keys as the original: ``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj`` (bias when ``config.attention_bias``), ``relative_k_proj`` (no bias),
    ``bias_u``, ``bias_v`` ([H, D]).

    ``forward(hidden_states, position_embeddings, attention_mask=None, **kwargs)`` returns
    ``(attn_output, attn_weights)``, ``attn_weights`` None unless asked for (below):
        hidden_states ``[B, T, hidden]``; position_embeddings ``(1 or B, 2T - 1, hidden)``
        (``ParakeetEncoderRelPositionalEncoding``; its ``B`` copies run one sequence at a time
        unless passed as an expanded view or with one row; under ``torch.export`` with a
        dynamic batch the first is used, checked equal to the others when the program
        runs). attention_mask (True / nonzero = attend): the encoder's ``(B, 1, T, T)``, or
        ``(B, T, T)``, ``(B, 1, 1, T)`` (keys only), or a flat ``(B, T)`` per-frame mask
        meaning what the encoder builds from it (``m[:, None, :] & m[:, :, None]``). Other
        keyword arguments of the attention interface are accepted and ignored.

    Attention probabilities: when the caller asks for them (``output_attentions=True`` passed
    down, or a transformers model collecting ``attentions``, e.g. ``output_attentions`` in its
    config), that call runs the original's eager math instead of the fused kernel and
    returns its ``[B, H, T, T]`` probabilities (softmax in fp32, cast to the input dtype;
    dropout applied in training, as the original) with the output computed from them.
    """

    _NAME = "ParakeetEncoderAttention"

    def __init__(self, config, layer_idx: Optional[int] = None, backend: str = "auto",
                 window_size: Sequence[int] = (-1, -1)):
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
        self.window_size = window_size

    @property
    def window_size(self) -> Tuple[int, int]:
        return self._window

    @window_size.setter
    def window_size(self, value) -> None:
        self._window = check_window(False, value, f"{self._NAME}")

    # The shared base's names for the original's layers (no state dict keys of their own).
    linear_q = property(lambda self: self.q_proj)
    linear_k = property(lambda self: self.k_proj)
    linear_v = property(lambda self: self.v_proj)
    linear_out = property(lambda self: self.o_proj)
    linear_pos = property(lambda self: self.relative_k_proj)
    pos_bias_u = property(lambda self: self.bias_u)
    pos_bias_v = property(lambda self: self.bias_v)
    dropout = property(lambda self: SimpleNamespace(p=self.attention_dropout))

    def forward(self, hidden_states: Tensor, position_embeddings: Optional[Tensor],
                attention_mask: Optional[Tensor] = None, **kwargs):
        return self._hf_attend(hidden_states, position_embeddings, attention_mask,
                               "position_embeddings", kwargs, self._window)

    def _eager_probs(self, ac: Tensor, bd: Tensor, masked: Optional[Tensor]) -> Tensor:
        # the original: the masked position term (finfo.min) is the eager interface's additive
        # mask; softmax in fp32, cast back to the input dtype
        bd = bd * self.scaling
        if masked is not None:
            bd = bd.masked_fill(masked, torch.finfo(bd.dtype).min)
        scores = ac * self.scaling + bd
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(ac.dtype)

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "ParakeetEncoderAttention":
        """Wrap a transformers ``ParakeetEncoderAttention``: shares its layers and biases (same
        Parameter objects), copies ``attention_dropout`` and the training mode, and is also an
        instance of the original class (module docstring). ``kwargs`` go to the constructor
        (``backend``, ``window_size``)."""
        with torch.device("meta"):
            new = cls(module.config, module.layer_idx, **kwargs)
        new.attention_dropout = module.attention_dropout
        return _as_original(adopt(new, module, ("q_proj", "k_proj", "v_proj", "o_proj",
                                                "relative_k_proj", "bias_u", "bias_v")), module)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.n_feat}, num_heads={self.h}, head_dim={self.d_k}, "
                f"backend={self.backend!r}"
                + ("" if self._window == (-1, -1) else f", window_size={self._window}"))


class Wav2Vec2ConformerSelfAttention(_HFRelPosAttention):
    """Drop-in for transformers' ``Wav2Vec2ConformerSelfAttention(config)`` with
    ``config.position_embeddings_type == "relative"`` (fairseq's rel-pos wav2vec2-conformer):
    ESPnet semantics, parameter names ``linear_q/k/v/out``, ``linear_pos``, ``pos_bias_u/v``.

    ``forward(hidden_states, attention_mask=None, relative_position_embeddings=None, **kwargs)``
    returns ``(attn_output, attn_weights)``. relative_position_embeddings ``(1, 2T - 1, hidden)``
    (``Wav2Vec2ConformerRelPositionalEmbedding``). attention_mask: what
    ``create_bidirectional_mask`` gives the layer: None, a bool ``(B, 1, T, T)`` (True = attend,
    sdpa / flex-free configs) or an additive float one (0 / ``finfo.min``, eager; its values are
    checked with one host sync), or a flat ``(B, T)``; its key padding reaches the kernel as
    ``key_padding_mask`` as for Parakeet. A sequence with no valid frame gives the original's
    output (the mean of the values); its gradient through the position term is not reproduced.
    ``module.cp_group``: context parallelism, as for Parakeet. ``attn_weights``: None, or,
    when asked for as for Parakeet, the eager original's ``[B, H, T, T]`` probabilities
    (softmax in the input dtype, dropout in training) from the eager math for that call.
    """

    _NAME = "Wav2Vec2ConformerSelfAttention"
    _FLOAT_MASKS = True

    def __init__(self, config, backend: str = "auto"):
        super().__init__()
        kind = getattr(config, "position_embeddings_type", None)
        if kind != "relative":
            raise ValueError(f"{self._NAME}: only position_embeddings_type='relative' has "
                             f"relative attention to replace, got {kind!r}")
        self._init_common(config.num_attention_heads, config.hidden_size,
                          config.attention_dropout, True, backend)
        self.config = config
        self.head_size, self.num_heads = self.d_k, self.h
        self.position_embeddings_type = kind
        self.is_causal = False
        self.scaling = self.head_size ** -0.5
        self.pos_bias_u = nn.Parameter(torch.zeros(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(self.h, self.d_k))

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None,
                relative_position_embeddings: Optional[Tensor] = None, **kwargs):
        return self._hf_attend(hidden_states, relative_position_embeddings, attention_mask,
                               "relative_position_embeddings", kwargs)

    def _eager_probs(self, ac: Tensor, bd: Tensor, masked: Optional[Tensor]) -> Tensor:
        # the original's eager interface: scaled terms plus the additive (0 / finfo.min) mask,
        # softmax in the input dtype
        scores = ac * self.scaling + bd * self.scaling
        if masked is not None:
            scores = scores + torch.zeros((), dtype=scores.dtype, device=scores.device) \
                .masked_fill(masked, torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1)

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "Wav2Vec2ConformerSelfAttention":
        """Wrap a transformers ``Wav2Vec2ConformerSelfAttention`` (relative): shares its layers
        and biases, and is also an instance of the original class (module docstring).
        ``kwargs``: ``backend``."""
        with torch.device("meta"):
            new = cls(module.config, **kwargs)
        return _as_original(adopt(new, module, _ESPNET_NAMES), module)


class FastSpeech2ConformerAttention(ESPnetRelPositionMultiHeadedAttention):
    """Drop-in for transformers' ``FastSpeech2ConformerAttention(config, module_config)``: ESPnet's
    ``RelPositionMultiHeadedAttention`` under transformers' names (same parameters).

    ``forward(hidden_states, attention_mask=None, pos_emb=None, output_attentions=False)``
    returns ``(attn_output, attn_weights)``; attention_mask ``(B, 1, T)`` (reaches the kernel as key
    padding) of any real dtype, read as the original reads it (``mask.eq(0)`` = masked): 0 =
    masked, any other value = keep. ``FastSpeech2ConformerModel`` hands its layers a float
    mask of ones and zeros (``torch.ones(input_ids.shape)`` when no mask is given), its
    decoder an integer one. ``attn_weights`` is None, or with ``output_attentions=True`` the
    original's ``[B, H, T, T]`` probabilities (0 at masked keys, dropout in training): that
    call runs the original's eager math instead of the fused kernel.
    """

    _NAME = "FastSpeech2ConformerAttention"

    def __init__(self, config, module_config, backend: str = "auto"):
        super().__init__(module_config["num_attention_heads"], config.hidden_size,
                         module_config["attention_dropout_rate"], backend=backend)
        self.num_heads, self.hidden_size = self.h, self.n_feat
        self.dim_key = self.head_dim = self.d_k

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None,
                pos_emb: Optional[Tensor] = None, output_attentions: bool = False):
        if isinstance(attention_mask, Tensor) and attention_mask.is_floating_point():
            attention_mask = attention_mask != 0  # the original's mask.eq(0) = masked
        if not output_attentions:
            out = super().forward(hidden_states, hidden_states, hidden_states, pos_emb,
                                  attention_mask)
            return out, None
        # the probabilities: the original's eager math for this call
        self._check_seq("hidden_states", hidden_states)
        B, T = hidden_states.shape[0], hidden_states.shape[1]
        self._check_pos_emb(pos_emb, B, T, "")
        kpm, dense = self._mask_args(attention_mask, B, T, T)
        masked = dense if kpm is None else kpm[:, None, None, :]
        v, ac, bd = _eager_terms(self, hidden_states, pos_emb)
        scores = (ac + bd) / self.s_d_k
        if masked is not None:  # as the original: masked scores at finfo.min, then 0
            scores = scores.masked_fill(masked, float(torch.finfo(scores.dtype).min))
            probs = torch.softmax(scores, dim=-1).masked_fill(masked, 0.0)
        else:
            probs = torch.softmax(scores, dim=-1)
        out, probs = _eager_output(self, probs, v)
        return self._finish(out, None), probs

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "FastSpeech2ConformerAttention":
        """Wrap a transformers ``FastSpeech2ConformerAttention``: shares its layers and biases,
        and is also an instance of the original class (module docstring). ``kwargs``:
        ``backend``."""
        module_config = {"num_attention_heads": module.num_heads,
                         "attention_dropout_rate": module.dropout.p}
        with torch.device("meta"):
            new = cls(SimpleNamespace(hidden_size=module.hidden_size), module_config, **kwargs)
        return _as_original(adopt(new, module, _ESPNET_NAMES), module)
