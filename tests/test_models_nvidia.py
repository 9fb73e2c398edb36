"""MemTransformerLM.from_nvidia against NVIDIA DeepLearningExamples' Transformer-XL
(tests/originals_nvidia_txl.py, a transcription of its mem_transformer.py and
proj_adaptive_softmax.py): NVIDIA's state_dict names load after the documented mapping, and on
random configurations the per-token losses (mems path and K/V cache path) and the new memories
equal NVIDIA's over several segments, NVIDIA's same_length mask included."""
from __future__ import annotations

import random

import pytest
import torch

import originals_nvidia_txl as nv
from txl_kernels.models import MemTransformerLM


def random_config(seed):
    """NVIDIA's model_config for a tiny random model. NVIDIA's adaptive softmax cannot run
    div_val=1 with d_embed == d_model and an untied tail projection (it indexes a projection
    list of one entry), so those configurations tie the tail projections."""
    rng = random.Random(seed)
    div_val = rng.choice([1, 2])
    cutoffs = rng.choice([[], [10], [10, 20]])
    d_model = rng.choice([12, 16])
    d_embed = rng.choice([d_model, 8]) if div_val == 1 else 16
    no_proj = div_val == 1 and d_embed == d_model
    return dict(
        n_token=rng.choice([30, 50]), n_layer=rng.randint(1, 3), n_head=rng.randint(1, 3),
        d_model=d_model, d_head=rng.choice([5, 8]), d_inner=rng.choice([7, 24]), dropout=0.0,
        dropatt=0.0, dtype=None, tie_weight=rng.random() < 0.5, d_embed=d_embed,
        div_val=div_val, tie_projs=[False] + [no_proj or rng.random() < 0.5 for _ in cutoffs],
        pre_lnorm=rng.random() < 0.5, tgt_len=rng.randint(1, 6), ext_len=rng.choice([0, 0, 2]),
        mem_len=rng.choice([0, 1, 4, 7]), cutoffs=cutoffs, same_length=rng.random() < 0.6,
        attn_type=0, clamp_len=rng.choice([-1, 3]), sample_softmax=-1)


def nvidia_model(cfg, seed=0):
    torch.manual_seed(seed)
    ref = nv.MemTransformerLM(**cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # NVIDIA initialises most parameters to zero
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return ref


def compare_over_segments(ref, ours, cfg, n_seg=5, bsz=2, seed=0):
    """Per-token losses of ours (mems path and cache path) and its new memories against
    NVIDIA's over n_seg segments of tgt_len + ext_len tokens."""
    T, E = cfg["tgt_len"], cfg["ext_len"]
    g = torch.Generator().manual_seed(seed + 7)
    data = torch.randint(0, cfg["n_token"], ((n_seg + 1) * T + E + 1, bsz), generator=g)
    ref.crit.keep_order = True  # per-token order (NVIDIA's default groups by cluster)
    mems_ref, mems = None, []
    cache = ours.new_cache(bsz)
    for s in range(0, n_seg * T, T):
        inp, tgt = data[s:s + T + E], data[s + 1:s + 1 + T + E]
        with torch.no_grad():
            want, mems_ref = ref(inp, tgt, mems_ref)
        got, *mems = ours(inp, tgt, *mems)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        (got_c,) = ours(inp, tgt, cache=cache)
        torch.testing.assert_close(got_c, want, rtol=1e-5, atol=1e-5)
        if mems_ref is None:
            assert not mems and cfg["mem_len"] == 0
        else:  # NVIDIA keeps the n_layer layer inputs; ours also the last layer's output
            assert len(mems) == cfg["n_layer"] + 1
            torch.testing.assert_close(torch.stack(mems[:-1]), mems_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(12))
def test_from_nvidia_checkpoint_equals_nvidia_on_random_configs(seed):
    cfg = random_config(seed)
    ref = nvidia_model(cfg, seed)
    ckpt = {"model_config": dict(cfg), "model_state": ref.state_dict()}
    ours = MemTransformerLM.from_nvidia(ckpt, attn_backend="reference").eval()
    assert ours.same_length_style == "nvidia"
    compare_over_segments(ref, ours, cfg, seed=seed)


def test_same_length_nvidia_mask_sees_mem_len_plus_one_keys():
    """same_length with NVIDIA's mask, mem_len 0 (each query sees itself) and 3, on both paths;
    kimiyoung's mask (one key fewer) gives other losses on the same weights."""
    for mem_len in (0, 3):
        cfg = random_config(1)
        cfg.update(same_length=True, mem_len=mem_len, tgt_len=5, ext_len=0, n_layer=2)
        ref = nvidia_model(cfg, 3)
        ours = MemTransformerLM.from_nvidia(ref, attn_backend="reference")
        compare_over_segments(ref, ours, cfg, n_seg=3)
    kimi = MemTransformerLM.from_nvidia(ref, attn_backend="reference",
                                        same_length_style="kimiyoung")
    data = torch.randint(0, cfg["n_token"], (6, 2), generator=torch.Generator().manual_seed(0))
    out = kimi(data[:5], data[1:])
    out = kimi(data[:5], data[1:], *out[1:])
    with torch.no_grad():
        want, mems = ref(data[:5], data[1:], None)
        want, _ = ref(data[:5], data[1:], mems)
    assert not torch.allclose(out[0], want, atol=1e-3)


def test_nvidia_names_need_the_mapping_and_every_source_form_loads():
    """NVIDIA's state_dict does not load into MemTransformerLM as it is (its adaptive softmax
    names differ); from_nvidia takes NVIDIA's model, a checkpoint dict or a state_dict with
    its config, and gives the same model (the model form: on its device, in its mode)."""
    cfg = dict(random_config(0), cutoffs=[10, 20], div_val=2, d_embed=16, tie_weight=True,
               tie_projs=[False, True, False])
    ref = nvidia_model(cfg, 5)
    sd = ref.state_dict()
    assert any(k.startswith("crit.out_layers_biases.") for k in sd)
    assert any(k.startswith("crit.shared_out_projs.") for k in sd)
    args = {k: v for k, v in cfg.items() if k != "dtype"}
    plain = MemTransformerLM(**args)
    with pytest.raises(RuntimeError, match="out_layers_biases"):
        plain.load_state_dict(sd, strict=True)
    a = MemTransformerLM.from_nvidia(ref)
    b = MemTransformerLM.from_nvidia({"model_config": cfg, "model_state": sd})
    c = MemTransformerLM.from_nvidia(sd, config=cfg, mem_len=9)
    assert not a.training and b.training and c.mem_len == 9
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]) and torch.equal(v, c.state_dict()[k]), k
    # the ties hold after loading: the output layer is the embedding, projection 1 shared
    assert a.crit.out_layers[1].weight is a.word_emb.emb_layers[1].weight
    assert a.crit.out_projs[1] is a.word_emb.emb_projs[1]
    assert torch.equal(a.crit.out_projs[2], sd["crit.out_projs.2"])


def test_from_nvidia_rejects_what_it_cannot_read():
    cfg = random_config(0)
    sd = nvidia_model(cfg).state_dict()
    with pytest.raises(ValueError, match="needs config"):
        MemTransformerLM.from_nvidia(sd)
    with pytest.raises(TypeError, match="NVIDIA's MemTransformerLM"):
        MemTransformerLM.from_nvidia(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="source must be"):
        MemTransformerLM.from_nvidia([1, 2])
    with pytest.raises(ValueError, match="attn_type=0"):
        MemTransformerLM.from_nvidia(sd, config=dict(cfg, attn_type=2))
