"""``MemTransformerLM.from_nvidia``: a :class:`MemTransformerLM` with the configuration and
weights of NVIDIA DeepLearningExamples' Transformer-XL (``PyTorch/LanguageModeling/Transformer-XL/pytorch``,
``attn_type=0``), from its model, its training checkpoints (``{"model_config": ...,
"model_state": ...}``, as ``train.py`` saves them) or a bare state_dict with its config.

Parameter names: the same as here except in the adaptive softmax (``crit``):

=========================================  ===============================================
NVIDIA                                     here
=========================================  ===============================================
``crit.out_layers_weights.i``              ``crit.out_layers.i.weight``; with
                                           ``tie_weight`` NVIDIA has no such key and
                                           ``word_emb.emb_layers.i.weight`` fills it (tied)
``crit.out_layers_biases.i``               ``crit.out_layers.i.bias``
``crit.out_projs.i`` (untied projections)  ``crit.out_projs.i``
(tied projections: no key)                 ``crit.out_projs.i``, tied to
                                           ``word_emb.emb_projs.j`` (j = 0 with
                                           ``div_val=1``, else i)
``crit.shared_out_projs.i`` (a second      dropped
name of ``word_emb.emb_projs.i``)
=========================================  ===============================================

then the renamed state_dict loads with ``strict=True``.

Semantics, checked against a transcription of NVIDIA's code (tests/originals_nvidia_txl.py:
per-token losses and new memories over several segments):

- ``same_length``: NVIDIA's mask lets a query see ``mem_len + 1`` keys, kimiyoung's
  ``mem_len``; ``from_nvidia`` builds the model with ``same_length_style="nvidia"`` (pass
  ``same_length_style="kimiyoung"`` to get kimiyoung's mask).
- Memories: NVIDIA's ``forward(data, target, mems)`` returns ``(loss, new_mems)`` with the
  memories as one tensor ``[n_layer, mlen, bsz, d_model]`` (the layers' inputs); this model's
  ``forward(data, target, *mems)`` returns ``[loss, *new_mems]`` with ``n_layer + 1`` tensors,
  the same ``n_layer`` followed by the last layer's output: ``torch.stack(new_mems[:-1])`` is
  NVIDIA's. The memory update is the same (NVIDIA, like this model, orders ``mlen`` and
  ``qlen`` right when ``ext_len > 0``).
- The per-token loss comes in token order (NVIDIA's default groups it by vocabulary cluster).
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

import torch

__all__ = ["build_from_nvidia", "nvidia_state_dict"]

_CRIT_OUT = re.compile(r"crit\.out_layers_(weights|biases)\.(\d+)")


def nvidia_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict:
    """NVIDIA's state_dict under this model's names (see the module's table): the
    ``crit.out_layers_weights`` / ``crit.out_layers_biases`` entries renamed, the
    ``crit.shared_out_projs`` entries dropped. The keys NVIDIA does not store for tied
    parameters are filled by :func:`build_from_nvidia` from the model's ties."""
    sd = {}
    for key, value in state_dict.items():
        if key.startswith("crit.shared_out_projs."):
            continue
        m = _CRIT_OUT.fullmatch(key)
        if m:
            key = f"crit.out_layers.{m[2]}.{'weight' if m[1] == 'weights' else 'bias'}"
        sd[key] = value
    return sd


def _config_of_model(model) -> dict:
    """NVIDIA's constructor arguments, read back from one of its models."""
    layer = model.layers[0] if len(model.layers) else None
    if layer is None:
        raise ValueError("from_nvidia: the NVIDIA model has no layers")
    return dict(
        n_token=model.n_token, n_layer=model.n_layer, n_head=model.n_head,
        d_model=model.d_model, d_head=model.d_head,
        d_inner=layer.pos_ff.CoreNet[0].out_features,
        dropout=model.drop.p, dropatt=layer.dec_attn.dropatt.p, tie_weight=model.tie_weight,
        d_embed=model.d_embed, div_val=model.div_val, tie_projs=list(model.tie_projs),
        pre_lnorm=layer.dec_attn.pre_lnorm, tgt_len=model.tgt_len, ext_len=model.ext_len,
        mem_len=model.mem_len, cutoffs=list(model.word_emb.cutoffs[:-1]),
        same_length=model.same_length, attn_type=model.attn_type, clamp_len=model.clamp_len,
        sample_softmax=model.sample_softmax)


def build_from_nvidia(cls, source, config: Optional[Mapping] = None, **kwargs):
    """A ``cls`` (``MemTransformerLM`` or a subclass) from NVIDIA DeepLearningExamples'
    Transformer-XL.

    ``source``: NVIDIA's ``MemTransformerLM`` (then the result is on its device and dtype, in
    its train / eval mode; otherwise on the weights' device and dtype, in training mode as a
    new module is), a checkpoint dict with ``"model_config"`` and ``"model_state"``
    (as NVIDIA's ``train.py`` saves it; load it with ``torch.load``), or a state_dict, which
    needs ``config`` (NVIDIA's ``model_config`` dict: its constructor arguments). Keyword
    arguments override the configuration (e.g. ``tgt_len=64, mem_len=640, same_length=True,
    clamp_len=400`` as NVIDIA's ``eval.py`` does) or go to the constructor (e.g.
    ``attn_backend``); ``same_length_style`` defaults to ``"nvidia"`` (see the module). The
    weights are renamed (:func:`nvidia_state_dict`) and loaded with ``strict=True``."""
    module = source if isinstance(source, torch.nn.Module) else None
    if module is not None:
        if not hasattr(getattr(module, "crit", None), "out_layers_biases"):
            raise TypeError(f"from_nvidia: expected NVIDIA's MemTransformerLM (an adaptive "
                            f"softmax with out_layers_biases), got {type(module).__name__}")
        cfg, state = _config_of_model(module), module.state_dict()
    elif isinstance(source, Mapping) and "model_state" in source:
        if "model_config" not in source and config is None:
            raise ValueError("from_nvidia: the checkpoint has no 'model_config'; pass config")
        cfg = dict(source["model_config"] if config is None else config)
        state = source["model_state"]
    elif isinstance(source, Mapping):
        if config is None:
            raise ValueError("from_nvidia: a bare state_dict needs config (NVIDIA's "
                             "model_config: its constructor arguments)")
        cfg, state = dict(config), source
    else:
        raise TypeError(f"from_nvidia: source must be NVIDIA's MemTransformerLM, a checkpoint "
                        f"dict or a state_dict, got {type(source).__name__}")
    cfg.pop("dtype", None)  # NVIDIA's inference-only argument; the weights carry the dtype
    cfg["same_length_style"] = "nvidia"
    cfg.update(kwargs)
    model = cls(**cfg)
    sd = nvidia_state_dict(state)
    # keys NVIDIA leaves out for tied parameters: the same tensor under its other name here
    params = dict(model.named_parameters(remove_duplicate=False))
    names = {}
    for name, p in params.items():
        names.setdefault(id(p), []).append(name)
    for key in model.state_dict():
        if key not in sd and key in params:
            twins = [n for n in names[id(params[key])] if n in sd]
            if twins:
                sd[key] = sd[twins[0]]
    ref = sd.get("r_w_bias")
    if module is not None:
        p = next(module.parameters())
        model = model.to(device=p.device, dtype=p.dtype)
    elif isinstance(ref, torch.Tensor):
        model = model.to(device=ref.device, dtype=ref.dtype)
    model.load_state_dict(sd, strict=True)
    if module is not None:
        model.train(module.training)
    return model
