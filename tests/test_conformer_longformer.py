"""NeMoRelPositionMultiHeadAttentionLongformer against the transcription of NeMo's
RelPositionMultiHeadAttentionLongformer (tests/originals_nemo_longformer.py): outputs and every
gradient in float64 and float32, symmetric and asymmetric contexts, T not a multiple of 2w and
T < w, padding, global tokens (0, 1, several with spacing, separate projections or not),
eval and train, the cache path, state dicts, swapping (also after NeMo's
change_attention_model) and the argument checks."""
import copy

import pytest
import torch
import torch.nn as nn

import originals_nemo_longformer as nemo
from txl_kernels.modules import (NeMoRelPositionMultiHeadAttention,
                                 NeMoRelPositionMultiHeadAttentionLongformer,
                                 swap_rel_pos_attention)

from helpers import FUSED_DEVICE
from test_conformer import N_FEAT, N_HEAD, compare, rnd, spy  # noqa: F401 (spy: a fixture)
from test_dropins_swap import NEMO_PATH, NeMoFake, fake

Longformer = NeMoRelPositionMultiHeadAttentionLongformer
LongformerFake = fake(nemo.RelPositionMultiHeadAttentionLongformer,
                      "RelPositionMultiHeadAttentionLongformer", NEMO_PATH)

# (left, right): symmetric; left > 2 right; right < left < 2 right; and the mirror images
CONTEXTS = [[3, 3], [4, 1], [3, 2], [1, 3], [2, 3], [4, 0], [0, 2]]
# (global_tokens, global_tokens_spacing, global_attn_separate)
GLOBALS = [(0, 1, False), (1, 1, False), (3, 2, True), (2, 3, False)]


def pair(ctx, g=0, spacing=1, separate=False, use_bias=True, backend="reference", seed=0):
    """(original, ours) with the same random weights (position biases non-zero)."""
    torch.manual_seed(seed)
    orig = nemo.RelPositionMultiHeadAttentionLongformer(
        N_HEAD, N_FEAT, 0.0, None, None, ctx, global_tokens=g, global_tokens_spacing=spacing,
        global_attn_separate=separate, use_bias=use_bias).eval()
    with torch.no_grad():
        orig.pos_bias_u.normal_(0.0, 0.5)
        orig.pos_bias_v.normal_(0.0, 0.5)
    ours = Longformer(N_HEAD, N_FEAT, 0.0, None, None, ctx, global_tokens=g,
                      global_tokens_spacing=spacing, global_attn_separate=separate,
                      use_bias=use_bias, backend=backend).eval()
    ours.load_state_dict(orig.state_dict(), strict=True)
    return orig, ours


def local_pos_emb(ctx, dtype=torch.float32):
    """NeMo's LocalAttRelPositionalEncoding table: (1, left + right + 1, n_feat)."""
    enc = nemo.LocalAttRelPositionalEncoding(ctx, d_model=N_FEAT, dropout_rate=0.0)
    enc.extend_pe(1, "cpu", dtype)
    return enc(torch.zeros(1, 1, N_FEAT, dtype=dtype))[1]


def pad_mask(lengths, T):
    return torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]


def check(orig, ours, ctx, T, lengths, dtype, device="cpu", cache=None, grads=True):
    x = rnd(len(lengths), T, N_FEAT, seed=5)
    pe = local_pos_emb(ctx)
    pad = pad_mask(lengths, T)

    def run(mod, dt, dev):
        xx = x.to(device=dev, dtype=dt).requires_grad_()
        args = (xx, xx, xx, pad.to(dev), pe.to(dev, dt))
        if cache is None:
            return (mod(*args),), (xx,)
        return mod(*args, cache=cache.to(dev, dt)), (xx,)

    compare(orig, ours, run, run, dtype, device=device, grads=grads,
            name=f"longformer {ctx} T={T}")


@pytest.mark.parametrize("glob", GLOBALS)
@pytest.mark.parametrize("T,lengths", [(13, [13, 9]), (2, [2, 1])])
@pytest.mark.parametrize("ctx", CONTEXTS)
def test_matches_nemo_float64(ctx, T, lengths, glob):
    """T = 13: not a multiple of 2w (NeMo pads it); T = 2 < w."""
    orig, ours = pair(ctx, *glob)
    check(orig, ours, ctx, T, lengths, torch.float64)


@pytest.mark.parametrize("glob", GLOBALS)
@pytest.mark.parametrize("ctx", [[3, 3], [3, 2]])
def test_matches_nemo_float64_no_time_padding(ctx, glob):
    """T = 12, a multiple of 2w = 6 (NeMo pads nothing), no padded frame."""
    orig, ours = pair(ctx, *glob)
    check(orig, ours, ctx, 12, [12, 12], torch.float64)


@pytest.mark.parametrize("glob", [GLOBALS[0], GLOBALS[2], GLOBALS[3]])
@pytest.mark.parametrize("ctx", [[3, 3], [4, 1], [2, 3]])
def test_matches_nemo_float32(ctx, glob):
    orig, ours = pair(ctx, *glob, use_bias=False)
    check(orig, ours, ctx, 11, [11, 6], torch.float32)


@pytest.mark.parametrize("glob", [GLOBALS[0], GLOBALS[2]])
@pytest.mark.parametrize("ctx", [[3, 3], [4, 1]])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_nemo_cpu_kernel(ctx, glob, dtype):
    orig, ours = pair(ctx, *glob, backend="cpu")
    check(orig, ours, ctx, 13, [13, 8], dtype)


@pytest.mark.parametrize("glob", [GLOBALS[0], GLOBALS[3]])
@pytest.mark.parametrize("ctx", [[3, 3], [1, 3]])
def test_matches_nemo_triton(ctx, glob):
    orig, ours = pair(ctx, *glob, backend="triton")
    check(orig, ours, ctx, 13, [13, 8], torch.float32, device=FUSED_DEVICE)


@pytest.mark.parametrize("glob", [GLOBALS[0], GLOBALS[2]])
def test_train_mode_dropout_zero(glob):
    """Training mode with dropout_rate 0: the same outputs and gradients. NeMo's class takes
    the global rows' softmax in float32 while training (with float64 inputs its next bmm
    raises), so this runs in float32 against the original in float32."""
    orig, ours = pair([3, 2], *glob)
    orig.train()
    ours.train()
    x = rnd(2, 13, N_FEAT, seed=6)
    pe, pad = local_pos_emb([3, 2]), pad_mask([13, 7], 13)
    outs, grads = [], []
    for mod in (orig, ours):
        xx = x.clone().requires_grad_()
        out = mod(xx, xx, xx, pad, pe)
        outs.append(out)
        dout = rnd(*out.shape, seed=8)
        grads.append(torch.autograd.grad((out * dout).sum(), [xx] + list(mod.parameters())))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if glob[0] == 0:  # no global rows: float64 runs in NeMo's class too
        check(orig, ours, [3, 2], 13, [13, 7], torch.float64)


@pytest.mark.parametrize("glob", [GLOBALS[0], GLOBALS[3]])
def test_cache_path_matches_nemo(glob):
    """NeMo's class runs with an empty cache only (it asserts equal query and key lengths):
    keys and values are then ``key`` (``value`` is not used), and the next cache is the first
    T - cache_drop_size frames of the query."""
    orig, ours = pair([3, 1], *glob)
    orig.cache_drop_size = ours.cache_drop_size = 3
    check(orig, ours, [3, 1], 10, [10, 7], torch.float64, cache=torch.zeros(2, 0, N_FEAT))
    x, other = rnd(2, 10, N_FEAT, seed=1), rnd(2, 10, N_FEAT, seed=2)
    pe, pad = local_pos_emb([3, 1]), pad_mask([10, 7], 10)
    out, new_cache = ours(x, x, other, pad, pe, cache=torch.zeros(2, 0, N_FEAT))
    torch.testing.assert_close(out, ours(x, x, x, pad, pe))
    torch.testing.assert_close(new_cache, x[:, :7])
    with pytest.raises(AssertionError):  # what NeMo's class does with a non-empty cache
        orig(x, x, x, pad, pe, cache=rnd(2, 4, N_FEAT))
    with pytest.raises(ValueError, match=r"cache must be empty, \(B, 0, n_feat\)"):
        ours(x, x, x, pad, pe, cache=rnd(2, 4, N_FEAT))


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("use_bias", [True, False])
def test_state_dict_strict_both_ways(separate, use_bias):
    orig, ours = pair([2, 2], 2, 1, separate, use_bias=use_bias)
    assert list(ours.state_dict()) == list(orig.state_dict())
    assert ("global_q.weight" in ours.state_dict()) == separate
    assert ("linear_q.bias" in ours.state_dict()) == use_bias
    orig.load_state_dict(ours.state_dict(), strict=True)


def test_from_module_and_swap_share_parameters():
    """swap_rel_pos_attention replaces NeMo's Longformer class (matched by its full class
    path) by the drop-in, sharing its parameters, settings and cache_drop_size."""
    torch.manual_seed(0)
    orig = LongformerFake(N_HEAD, N_FEAT, 0.0, None, None, [4, 1], global_tokens=2,
                          global_tokens_spacing=3, global_attn_separate=True).eval()
    orig.cache_drop_size = 2
    model = nn.ModuleDict({"attn": orig})
    ref = copy.deepcopy(model)
    assert swap_rel_pos_attention(model, backend="reference") == 1
    new = model["attn"]
    assert isinstance(new, Longformer) and not new.training
    assert new.global_q.weight is orig.global_q.weight and new.linear_pos is orig.linear_pos
    assert new.pos_bias_u is orig.pos_bias_u and new.cache_drop_size == 2
    assert (new.att_context_size, new.global_tokens, new.global_tokens_spacing) == ([4, 1], 2, 3)
    x, pe, pad = rnd(2, 11, N_FEAT), local_pos_emb([4, 1]), pad_mask([11, 5], 11)
    torch.testing.assert_close(model["attn"](x, x, x, pad, pe), ref["attn"](x, x, x, pad, pe))


def test_encoder_switched_by_change_attention_model_swaps_again(monkeypatch):
    """A stack swapped to the rel_pos drop-in, switched by NeMo's change_attention_model to
    rel_pos_local_attn (which loads each layer's state dict into a new Longformer), swaps
    again, and computes what the unswapped stack switched the same way computes."""
    monkeypatch.setattr(nemo, "RelPositionMultiHeadAttentionLongformer", LongformerFake)
    torch.manual_seed(0)
    enc = nemo.ConformerEncoder(N_FEAT, N_HEAD, 2, "rel_pos", [-1, -1], rel_pos_cls=NeMoFake)
    for layer in enc.layers:
        with torch.no_grad():
            layer.self_attn.pos_bias_u.normal_()
            layer.self_attn.pos_bias_v.normal_()
    ref = copy.deepcopy(enc)
    assert swap_rel_pos_attention(enc, backend="reference") == 2
    assert all(isinstance(m.self_attn, NeMoRelPositionMultiHeadAttention) for m in enc.layers)
    for e in (enc, ref):
        e.change_attention_model("rel_pos_local_attn", [3, 2])
    assert all(type(m.self_attn) is LongformerFake for m in enc.layers)
    assert swap_rel_pos_attention(enc, backend="reference") == 2
    assert all(isinstance(m.self_attn, Longformer) for m in enc.layers)
    x, lengths = rnd(2, 12, N_FEAT, seed=3), torch.tensor([12, 8])
    torch.testing.assert_close(enc(x, lengths), ref(x, lengths))


def test_bad_inputs_raise_clear_errors():
    _, ours = pair([3, 1])
    x, pe, pad = rnd(2, 7, N_FEAT), local_pos_emb([3, 1]), pad_mask([7, 5], 7)
    for bad in ([0, 0], [-1, 3], [3], [2.0, 1], (True, 1), None):
        with pytest.raises(ValueError, match="att_context_size must be"):
            Longformer(N_HEAD, N_FEAT, 0.0, None, None, bad)
        with pytest.raises(ValueError, match="att_context_size must be"):
            ours.att_context_size = bad
    with pytest.raises(ValueError, match=r"pos_emb must be \(1 or B=2, left \+ right \+ 1 = 5"):
        ours(x, x, x, pad, local_pos_emb([3, 2]))
    with pytest.raises(ValueError, match="pos_emb must be"):
        ours(x, x, x, pad, pe[0])
    with pytest.raises(ValueError, match=r"pad_mask must be a bool tensor \(B, T\) = \(2, 7\)"):
        ours(x, x, x, pad[:, :6], pe)
    with pytest.raises(ValueError, match="pad_mask must be a bool tensor"):
        ours(x, x, x, pad.long(), pe)
    with pytest.raises(ValueError, match="key must have the query's length T=7"):
        ours(x, x[:, :6], x[:, :6], pad, pe)
    for name, value in (("global_tokens", -1), ("global_tokens_spacing", 0)):
        with pytest.raises(ValueError, match=f"{name} must be an int"):
            Longformer(N_HEAD, N_FEAT, 0.0, None, None, [2, 2], **{name: value})


def test_no_padding_mask_and_expanded_pos_emb():
    """pad_mask None is no padding; a (B, n, n_feat) pos_emb (expanded or not) gives the
    result of the (1, n, n_feat) one."""
    orig, ours = pair([2, 3], 2, 2, False)
    x = rnd(2, 9, N_FEAT)
    pe = local_pos_emb([2, 3])
    want = orig(x, x, x, torch.zeros(2, 9, dtype=torch.bool), pe)
    torch.testing.assert_close(ours(x, x, x, None, pe), want)
    torch.testing.assert_close(ours(x, x, x, None, pe.expand(2, -1, -1)), want)
    torch.testing.assert_close(ours(x, x, x, None, pe.repeat(2, 1, 1)), want)


def test_kernel_reads_short_table_and_global_keys_only(spy):
    """rel_attention gets the left + right + 1 projected rows with r_first_distance=left (no
    table as long as the sequence), the window, the padding as key_padding_mask and the
    global frames as G extra keys (strided views of the projections)."""
    _, ours = pair([4, 1], 3, 2, False)
    x, pe, pad = rnd(2, 40, N_FEAT), local_pos_emb([4, 1]), pad_mask([40, 31], 40)
    ours(x, x, x, pad, pe)
    (args, kwargs), = spy
    q, k, v, r = args[:4]
    assert tuple(r.shape) == (6, N_HEAD, N_FEAT // N_HEAD) and kwargs["r_first_distance"] == 4
    assert kwargs["window_size"] == (4, 1) and kwargs["key_padding_mask"] is pad
    assert kwargs["attn_mask"] is None and kwargs["extra_q"] is q
    assert tuple(kwargs["extra_k"].shape) == (2, 3, N_HEAD, N_FEAT // N_HEAD)
    assert kwargs["extra_k"].data_ptr() == k.data_ptr() and kwargs["extra_k"].stride(1) == \
        2 * k.stride(1)


@pytest.mark.parametrize("backend", ["cpu"])
def test_training_with_dropout_and_global_tokens_stays_fused(monkeypatch, backend):
    """dropout_rate > 0 with global tokens in training: the fused kernels run it (the
    reference, which forms (B, H, T, T) scores, is never called), forward and backward."""
    import txl_kernels.reference as reference_mod

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference path ran")

    monkeypatch.setattr(reference_mod, "_rel_attention_reference", no_reference)
    torch.manual_seed(0)
    ours = Longformer(N_HEAD, N_FEAT, 0.3, None, None, [3, 2], global_tokens=2,
                      backend=backend).train().to(FUSED_DEVICE if backend == "triton" else "cpu")
    x = rnd(2, 13, N_FEAT, requires_grad=True).to(ours.linear_q.weight.device)
    out = ours(x, x, x, pad_mask([13, 9], 13).to(x.device), local_pos_emb([3, 2]).to(x.device))
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all()
                                             for p in ours.parameters() if p.grad is not None)


@pytest.mark.parametrize("g", [0, 1])
def test_inference_frees_the_projections_before_linear_out(g):
    """Without a graph the attention writes its rows over the query projection and
    linear_out writes into the key projection's buffer (no fresh [B, T, n_feat] tensor to
    fault in); the k and v projections are gone when linear_out runs (inference peaks at 4,
    not 6, [B, T, n_feat] tensors); the output is unchanged (padded rows zeroed, global rows
    written, in place)."""
    import weakref
    orig, ours = pair([4, 3], g=g, backend="cpu")
    T = 23
    x = rnd(2, T, N_FEAT, seed=3)
    pos, mask = local_pos_emb([4, 3]), pad_mask([T, 15], T)
    refs, alive, buffers, attention = [], [], {}, []
    project, finish = ours._project, ours._finish

    def tracked(linear, inp):  # the [B, T, H, D] projections of k and v, tracked
        out = project(linear, inp)
        if linear in (ours.linear_k, ours.linear_v):
            refs.append(weakref.ref(out))
        buffers[linear] = out.data_ptr()
        return out

    def finishing(out, *args):
        alive.extend(r() is not None for r in refs)
        attention.append(out.data_ptr())
        return finish(out, *args)

    ours._project, ours._finish = tracked, finishing
    with torch.no_grad():
        got = ours(x, x, x, mask, pos)
        want = orig(x, x, x, mask, pos)
    assert len(alive) == 2 and not any(alive)
    assert attention[0] == buffers[ours.linear_q]
    assert got.data_ptr() == buffers[ours.linear_k]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.enable_grad():  # with a graph: fresh outputs, the projections left alone
        got = ours(x, x, x, mask, pos)
    assert got.data_ptr() != buffers[ours.linear_k]
    assert attention[-1] != buffers[ours.linear_q]
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)
