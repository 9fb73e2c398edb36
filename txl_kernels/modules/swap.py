"""``swap_rel_pos_attention``: replace the relative-attention modules of a model by the drop-ins.

Originals are matched by the *full module path* of their class (``type(m).__module__ + "." +
type(m).__qualname__``), never by class name alone: several frameworks reuse a name for a class
with another API (espnet2's transducer ``RelPositionMultiHeadedAttention`` takes ``num_heads``
and a (B, T) padding mask; ESPnet's legacy class has another rel_shift). Subclasses of an
original are not matched either (they may override ``forward``).

Every candidate is converted (and so validated) before any is put in place: if one cannot be,
the model is left exactly as it was and the error names the submodule.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch.nn as nn

from .conformer import (ESPnetRelPositionMultiHeadedAttention, NeMoRelPositionMultiHeadAttention,
                        NeMoRelPositionMultiHeadAttentionLongformer)
from .gtrxl import DIEngineAttentionXL, RLlibRelativeMultiHeadAttention
from .icefall import IcefallRelPositionMultiheadAttention
from .parakeet import (FastSpeech2ConformerAttention, ParakeetEncoderAttention,
                       Wav2Vec2ConformerSelfAttention)
from .speechbrain import SpeechBrainRelPosMHAXL

__all__ = ["swap_rel_pos_attention", "SWAP_TABLE", "class_path"]


class _Entry(NamedTuple):
    dropin: type
    # original attributes the drop-in's from_module reads: checked before anything is replaced
    needs: Tuple[str, ...]
    # which of swap_rel_pos_attention's options the drop-in's from_module takes
    options: Tuple[str, ...] = ("backend",)
    # for paths that several APIs share (icefall recipes import ``conformer`` as a top-level
    # module): a module failing this is not a match (left alone); None = every module matches
    accepts: Optional[Callable[[nn.Module], bool]] = None


_CONFORMER_NEEDS = ("h", "linear_q", "linear_k", "linear_v", "linear_out", "linear_pos",
                    "pos_bias_u", "pos_bias_v", "dropout")

#: full module path of the original class -> the drop-in (a class with ``from_module``)
SWAP_TABLE: Dict[str, _Entry] = {
    "nemo.collections.asr.parts.submodules.multi_head_attention.RelPositionMultiHeadAttention":
        _Entry(NeMoRelPositionMultiHeadAttention, _CONFORMER_NEEDS,
               ("backend", "att_context_size")),
    "nemo.collections.asr.parts.submodules.multi_head_attention."
    "RelPositionMultiHeadAttentionLongformer":
        _Entry(NeMoRelPositionMultiHeadAttentionLongformer,
               _CONFORMER_NEEDS + ("att_context_size", "global_tokens", "global_tokens_spacing")),
    "espnet.nets.pytorch_backend.transformer.attention.RelPositionMultiHeadedAttention":
        _Entry(ESPnetRelPositionMultiHeadedAttention, _CONFORMER_NEEDS),
    # icefall runs recipes from their folder: the class lives in a top-level ``conformer``
    # module. pruned_transducer_stateless{2..7} have the ScaledLinear API; conformer_ctc's
    # class of the same path has plain Linear layers and no scales: not a match.
    "conformer.RelPositionMultiheadAttention":
        _Entry(IcefallRelPositionMultiheadAttention,
               ("embed_dim", "num_heads", "dropout", "in_proj", "out_proj", "linear_pos",
                "pos_bias_u", "pos_bias_v", "pos_bias_u_scale", "pos_bias_v_scale"),
               accepts=lambda m: all(hasattr(m, a) for a in (
                   "pos_bias_u_scale", "pos_bias_v_scale")) and all(
                   hasattr(getattr(m, n, None), "get_weight")
                   for n in ("in_proj", "out_proj", "linear_pos"))),
    "speechbrain.nnet.attention.RelPosMHAXL":
        _Entry(SpeechBrainRelPosMHAXL, ("embed_dim", "num_heads", "dropout", "vbias", "vdim",
                                        "mask_pos_future", "_qkv_same_embed_dim", "out_proj",
                                        "linear_pos", "pos_bias_u", "pos_bias_v")),
    "ray.rllib.models.torch.modules.relative_multi_head_attention.RelativeMultiHeadAttention":
        _Entry(RLlibRelativeMultiHeadAttention, ("_num_heads", "_head_dim", "_qkv_layer",
                                                 "_linear_layer", "_uvar", "_vvar",
                                                 "_pos_proj", "_rel_pos_embedding",
                                                 "_input_layernorm")),
    "ding.torch_utils.network.gtrxl.AttentionXL":
        _Entry(DIEngineAttentionXL, ("head_num", "head_dim", "dropout", "attention_kv",
                                     "attention_q", "project", "project_pos")),
    "transformers.models.wav2vec2_conformer.modeling_wav2vec2_conformer."
    "Wav2Vec2ConformerSelfAttention":
        _Entry(Wav2Vec2ConformerSelfAttention, _CONFORMER_NEEDS[1:] + ("config",),
               accepts=lambda m: getattr(m, "position_embeddings_type", None) == "relative"),
    "transformers.models.fastspeech2_conformer.modeling_fastspeech2_conformer."
    "FastSpeech2ConformerAttention":
        _Entry(FastSpeech2ConformerAttention, _CONFORMER_NEEDS[1:] + ("num_heads",
                                                                      "hidden_size")),
    "transformers.models.parakeet.modeling_parakeet.ParakeetEncoderAttention":
        _Entry(ParakeetEncoderAttention, ("config", "layer_idx", "q_proj", "k_proj", "v_proj",
                                          "o_proj", "relative_k_proj", "bias_u", "bias_v",
                                          "attention_dropout")),
}


def class_path(module: nn.Module) -> str:
    """The key :data:`SWAP_TABLE` is looked up by: the class's module and qualified name."""
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _convert(name: str, child: nn.Module, entry: _Entry, options: dict) -> nn.Module:
    missing = [a for a in entry.needs if not hasattr(child, a)]
    if missing:
        raise TypeError(
            f"swap_rel_pos_attention: {name or '<model>'} ({class_path(child)}) lacks "
            f"{', '.join(missing)}: not the API {entry.dropin.__name__} replaces; nothing was "
            f"replaced")
    kwargs = {k: v for k, v in options.items() if k in entry.options}
    try:
        return entry.dropin.from_module(child, **kwargs)
    except Exception as exc:
        raise type(exc)(f"swap_rel_pos_attention: cannot convert {name or '<model>'} "
                        f"({class_path(child)}) to {entry.dropin.__name__}: {exc}; nothing was "
                        f"replaced") from exc


def swap_rel_pos_attention(model: nn.Module, backend: str = "auto",
                           att_context_size: Optional[Sequence[int]] = None) -> int:
    """Replace, inside ``model``, every module whose class is a key of :data:`SWAP_TABLE`
    (NeMo ``RelPositionMultiHeadAttention`` and ``RelPositionMultiHeadAttentionLongformer``,
    ESPnet ``RelPositionMultiHeadedAttention``, ...)
    by its drop-in, sharing the original's parameters (the drop-in's ``from_module``).

    Args:
        model: the model; modules are matched by full class path (module docstring).
        backend: ``rel_attention`` backend for every drop-in.
        att_context_size: NeMo's ``RelPositionMultiHeadAttention`` only: the window, e.g.
            ``encoder.att_context_size`` for a ``"regular"`` style encoder (the Longformer
            drop-in keeps its original's ``att_context_size``).

    Every match is converted before any is replaced, so an error leaves the model untouched.
    A module reached under several names (shared between parents, or held twice by one:
    ``m.b = m.a``, ``nn.Sequential(x, x)``, ``nn.ModuleList([layer] * n)``) is converted
    once, and every reference to it gets that same drop-in, so shared weights stay shared.

    Returns the number of original modules swapped (distinct objects), not the number of
    references replaced: ``nn.ModuleList([layer] * 6)`` counts 1. The Parameter objects stay
    the same, so it can be called before or after building the optimizer.

    Raises ValueError when ``model`` itself is an original (it has no parent to put the
    drop-in in: use the drop-in's ``from_module``).
    """
    options = {"backend": backend, "att_context_size": att_context_size}
    root = SWAP_TABLE.get(class_path(model))
    if root is not None and (root.accepts is None or root.accepts(model)):
        raise ValueError(f"swap_rel_pos_attention: the model itself is a {class_path(model)}; "
                         f"use {root.dropin.__name__}.from_module(model) instead")
    # pass 1: find and convert every candidate (nothing is modified). Every parent is read
    # once, through its _modules dict: named_children() yields a module held under several
    # names of one parent (m.b = m.a, nn.Sequential(x, x)) under the first name only.
    new_by_id: Dict[int, nn.Module] = {}
    sites: List[Tuple[nn.Module, str, int]] = []
    for parent_name, parent in model.named_modules():
        for name, child in parent._modules.items():
            if child is None:
                continue
            entry = SWAP_TABLE.get(class_path(child))
            if entry is None or (entry.accepts is not None and not entry.accepts(child)):
                continue
            if id(child) not in new_by_id:
                full = f"{parent_name}.{name}" if parent_name else name
                new_by_id[id(child)] = _convert(full, child, entry, options)
            sites.append((parent, name, id(child)))
    # pass 2: put them in place
    for parent, name, key in sites:
        setattr(parent, name, new_by_id[key])
    return len(new_by_id)
