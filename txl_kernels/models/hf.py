"""The weights and configuration of an HF ``TransfoXLLMHeadModel`` (transformers 4.x; the model
is deprecated there and 4.34.x is the last release where it runs) for ``MemTransformerLM``:
the one entry point is ``MemTransformerLM.from_hf(hf_model)``, which calls
:func:`build_from_hf`.

The parameter names match once the ``transformer.`` prefix is dropped. One layout differs: HF
orders the tail-cluster logits of the adaptive softmax head the other way round from
kimiyoung's PyTorch code when there are two or more tail clusters (HF's tail cluster ``i``
reads head column ``cutoffs[0] + i - 1``, kimiyoung's reads column ``-i``), so the rows of
``crit.cluster_weight`` / ``crit.cluster_bias`` are reversed on the way in.

HF builds the memory of the first segment from ``mem_len`` zero vectors when ``mems`` is None
(``init_mems``); Transformer-XL (and this model) starts with no memory. Pass HF empty memories
(``[torch.empty(0, bsz, d_model)] * n_layer``) to compare the two from the first segment.
"""
from __future__ import annotations

__all__ = ["build_from_hf", "hf_state_dict"]


def hf_state_dict(hf_model) -> dict:
    """The HF state_dict renamed to this model's keys (cluster rows reordered). With
    ``untie_r=False`` HF registers the model's shared ``r_w_bias`` / ``r_r_bias`` in every
    layer too; those copies are dropped."""
    shared = not getattr(hf_model.config, "untie_r", True)
    sd = {}
    for key, value in hf_model.state_dict().items():
        if key.startswith("transformer."):
            key = key[len("transformer."):]
        if shared and key.startswith("layers.") and key.rsplit(".", 1)[-1] in (
                "r_w_bias", "r_r_bias"):
            continue
        sd[key] = value
    for key in ("crit.cluster_weight", "crit.cluster_bias"):
        if key in sd:
            sd[key] = sd[key].flip(0)
    return sd


def build_from_hf(cls, hf_model, tgt_len=None, **kwargs):
    """A ``cls`` (``MemTransformerLM`` or a subclass) with the configuration and weights of
    ``hf_model``, an HF ``TransfoXLLMHeadModel``, loaded with ``strict=True``, on its device and
    dtype, in its train / eval mode. ``tgt_len`` (HF's config has none; default 128, the published
    checkpoints' segment length) sets the segment length that ``generate`` and ``new_cache``
    use; other keyword arguments go to the constructor (e.g. ``attn_backend``)."""
    cfg = getattr(hf_model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) != "transfo-xl" \
            or not hasattr(hf_model, "crit"):
        raise TypeError(f"from_hf: expected an HF TransfoXLLMHeadModel, got "
                        f"{type(hf_model).__name__}")
    if getattr(cfg, "attn_type", 0) != 0:
        raise ValueError(f"from_hf: only attn_type=0 is supported, got {cfg.attn_type}")
    if getattr(cfg, "sample_softmax", -1) > 0:
        raise ValueError("from_hf: sampled softmax (sample_softmax > 0) is not supported")
    if tgt_len is None:
        tgt_len = getattr(cfg, "tgt_len", None) or 128
    args = dict(
        n_token=cfg.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model,
        d_head=cfg.d_head, d_inner=cfg.d_inner, dropout=cfg.dropout, dropatt=cfg.dropatt,
        tie_weight=bool(getattr(cfg, "tie_word_embeddings", True)), d_embed=cfg.d_embed,
        div_val=cfg.div_val, tie_projs=list(cfg.tie_projs), pre_lnorm=cfg.pre_lnorm,
        tgt_len=tgt_len, ext_len=0, mem_len=cfg.mem_len, cutoffs=list(cfg.cutoffs),
        same_length=cfg.same_length, clamp_len=cfg.clamp_len, untie_r=cfg.untie_r,
        layer_norm_epsilon=cfg.layer_norm_epsilon)
    args.update(kwargs)
    p = next(hf_model.parameters())
    model = cls(**args).to(device=p.device, dtype=p.dtype)
    model.load_state_dict(hf_state_dict(hf_model), strict=True)
    model.train(hf_model.training)
    return model
