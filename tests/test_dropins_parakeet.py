"""Parakeet drop-in against the real transformers 5.x ParakeetEncoderAttention / ParakeetEncoder.

Needs transformers >= 5 (the ``hf5`` extra; it does not pin torch). The fp64 comparisons run the
original with ``attn_implementation="sdpa"``: its eager path computes the softmax in fp32
whatever the input dtype, so it is no fp64 truth.
"""
import copy

import pytest
import torch
import torch.nn as nn

import txl_kernels
from txl_kernels.modules import ParakeetEncoderAttention, swap_rel_pos_attention

from helpers import FUSED_DEVICE
from test_conformer import (_record_outputs, compare, rnd, run_rows_and_grads,  # noqa: F401
                            spy)  # (spy: fixture)

transformers = pytest.importorskip(
    "transformers", minversion="5.0",
    reason="transformers >= 5 is not installed (pip install 'txl_kernels[hf5]')")
from transformers.models.parakeet import modeling_parakeet as hf  # noqa: E402
from transformers.models.parakeet.configuration_parakeet import ParakeetEncoderConfig  # noqa: E402

HIDDEN, HEADS = 64, 4


def config(impl="sdpa", bias=True, hidden=HIDDEN, heads=HEADS, layers=2):
    cfg = ParakeetEncoderConfig(hidden_size=hidden, num_attention_heads=heads,
                                intermediate_size=32, num_hidden_layers=layers,
                                subsampling_conv_channels=8, num_mel_bins=16,
                                subsampling_factor=4, conv_kernel_size=3, dropout=0.0,
                                layerdrop=0.0, activation_dropout=0.0, attention_dropout=0.0,
                                attention_bias=bias)
    cfg._attn_implementation = impl
    return cfg


def pair(backend="reference", impl="sdpa", seed=0, **kw):
    cfg = config(impl, **kw)
    torch.manual_seed(seed)
    orig = hf.ParakeetEncoderAttention(cfg, 0).eval()
    with torch.no_grad():
        orig.bias_u.normal_(0.0, 0.5)
        orig.bias_v.normal_(0.0, 0.5)
    ours = ParakeetEncoderAttention(cfg, 0, backend=backend).eval()
    ours.load_state_dict(orig.state_dict(), strict=True)
    return cfg, orig, ours


def masks(kind, B, T):
    """The encoder's masks (True = attend) from frame lengths; one sequence fully padded."""
    lengths = torch.tensor([T, max(1, T // 2), 0][:B])
    valid = torch.arange(T)[None] < lengths[:, None]
    if kind == "none":
        return None
    if kind == "encoder":  # ParakeetEncoder.forward's construction
        m = valid.unsqueeze(1).expand(-1, T, -1)
        return (m & m.transpose(1, 2)).unsqueeze(1)
    if kind == "flat":
        return valid
    if kind == "keys":
        return valid[:, None, None, :]
    if kind == "dense":
        g = torch.Generator().manual_seed(1)
        return (torch.rand(B, 1, T, T, generator=g) > 0.3) & valid[:, None, None, :]
    raise ValueError(kind)


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_strict_both_ways(bias):
    cfg, orig, ours = pair(bias=bias)
    assert list(ours.state_dict()) == list(orig.state_dict())
    fresh = hf.ParakeetEncoderAttention(cfg, 0)
    fresh.load_state_dict(ours.state_dict(), strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, orig.state_dict()[k]), k
    other = ParakeetEncoderAttention(config(bias=not bias), 0)
    with pytest.raises(RuntimeError):
        other.load_state_dict(orig.state_dict(), strict=True)


@pytest.mark.parametrize("kind", ["none", "encoder", "flat", "keys", "dense"])
@pytest.mark.parametrize("T", [1, 19])
def test_matches_original_fp64_with_gradients(kind, T):
    B = 3
    cfg, orig, ours = pair()
    x = rnd(B, T, HIDDEN, seed=T)
    pe_mod = hf.ParakeetEncoderRelPositionalEncoding(cfg)
    mask = masks(kind, B, T)
    # the original needs a 4-D mask: a flat one means what the encoder builds from it
    orig_mask = masks("encoder", B, T) if kind == "flat" else mask

    def run(mask_):
        def f(mod, dtype, device):
            xx = x.to(dtype).requires_grad_()
            pe = pe_mod(xx.detach()).requires_grad_()
            return (mod(xx, pe, mask_)[0],), (xx, pe)
        return f

    compare(orig, ours, run(orig_mask), run(mask), torch.float64, grads=True)


@pytest.mark.parametrize("window", [(3, 3), (4, 1), (0, 2), (-1, 2)])
@pytest.mark.parametrize("kind", ["none", "encoder", "flat"])
def test_window_size_matches_original_with_band_mask(kind, window):
    """window_size=(left, right): the original with an attention_mask that also masks the pairs
    outside ``i - left <= j <= i + right``, forward and gradients; with the probabilities
    asked for (the eager math) too."""
    B, T = 3, 19
    cfg, orig, ours = pair()
    ours.window_size = window
    x = rnd(B, T, HIDDEN, seed=5)
    pe_mod = hf.ParakeetEncoderRelPositionalEncoding(cfg)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    band = torch.ones(T, T, dtype=torch.bool)
    if window[0] >= 0:
        band &= j >= i - window[0]
    if window[1] >= 0:
        band &= j <= i + window[1]
    enc = masks("encoder", B, T)
    orig_mask = band.expand(B, 1, T, T) if kind == "none" else enc & band
    mask = masks(kind, B, T)

    def run(mask_, **kw):
        def f(mod, dtype, device):
            xx = x.to(dtype).requires_grad_()
            pe = pe_mod(xx.detach()).requires_grad_()
            return (mod(xx, pe, mask_, **kw)[0],), (xx, pe)
        return f

    compare(orig, ours, run(orig_mask), run(mask), torch.float64, grads=True)
    _, orig, ours = pair(impl="eager")  # the eager original returns its probabilities
    ours.window_size = window
    x = x.float()
    with torch.no_grad():
        want_out, want_p = orig(x, pe_mod(x), orig_mask)
        out, p = ours(x, pe_mod(x), mask, output_attentions=True)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p, want_p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [(4, 4), (0, 3), (-1, 2), (30, 30)])
def test_window_projects_only_the_rows_it_reads(monkeypatch, window):
    """window_size=(left, right): only the table rows of distances left .. -right go through
    relative_k_proj; output and gradients (hidden states, position embeddings) equal the whole
    table's; a window wider than the sequence projects the whole table."""
    B, T = 2, 21
    cfg, _, ours = pair()
    ours.window_size = window
    x = rnd(B, T, HIDDEN, seed=7)
    pe = hf.ParakeetEncoderRelPositionalEncoding(cfg)(x)
    args = dict(hidden_states=x, position_embeddings=pe)
    mask = masks("encoder", B, T)
    rows, out, grads = run_rows_and_grads(ours, args, monkeypatch, False, attention_mask=mask)
    rows_all, want, want_grads = run_rows_and_grads(ours, args, monkeypatch, True,
                                                    attention_mask=mask)
    left, right = (T - 1 if w < 0 else min(w, T - 1) for w in window)
    assert rows_all == [2 * T - 1] and rows == [left + right + 1]
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_window_size_after_swap_and_checked():
    cfg = config()
    torch.manual_seed(0)
    orig = hf.ParakeetEncoderAttention(cfg, 0)
    new = ParakeetEncoderAttention.from_module(orig, backend="reference", window_size=(2, 5))
    assert new.window_size == (2, 5) and "window_size=(2, 5)" in repr(new)
    assert ParakeetEncoderAttention(cfg, 0).window_size == (-1, -1)
    with pytest.raises(ValueError, match=r"ParakeetEncoderAttention: window_size entries must "
                                         r"be >= -1.*\(-2, 3\)"):
        new.window_size = (-2, 3)
    with pytest.raises(TypeError, match=r"ParakeetEncoderAttention: window_size must be a "
                                        r"\(left, right\) pair of ints, got 4"):
        ParakeetEncoderAttention(cfg, 0, window_size=4)


@pytest.mark.parametrize("kind", ["flat", "keys"])
def test_padding_reaches_kernel_as_key_padding_only(spy, kind):
    B, T = 3, 13
    cfg, orig, ours = pair()
    x = rnd(B, T, HIDDEN, dtype=torch.float64)
    pe = hf.ParakeetEncoderRelPositionalEncoding(cfg)(x)[:1].expand(B, -1, -1)  # one call
    o64, m64 = orig.double(), ours.double()
    want = o64(x, pe, masks("encoder" if kind == "flat" else kind, B, T))[0]
    got = m64(x, pe, masks(kind, B, T))[0]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    (_, kw), = spy
    assert kw["attn_mask"] is None and kw["window_size"] == (-1, -1) and kw["causal"] is False
    assert torch.equal(kw["key_padding_mask"], ~masks("flat", B, T))


def test_encoder_padding_mask_is_split_on_device(spy):
    """The encoder's (B, 1, T, T) padding mask: key padding reaches the kernel, and what remains
    is empty, which its band descriptor says on the device (the fused kernel reads no mask)."""
    B, T = 3, 10
    _, orig, ours = pair()
    x = rnd(B, T, HIDDEN)
    pe = hf.ParakeetEncoderRelPositionalEncoding(config())(x)[:1]
    ours(x, pe, masks("encoder", B, T))
    (_, kw), = spy
    assert torch.equal(kw["key_padding_mask"], ~masks("flat", B, T))
    assert not kw["attn_mask"].any()
    assert kw["attn_mask_band"].tolist() == [1, T - 1, T - 1]  # every pair: a band, no mask reads


def test_projections_and_position_table_are_views(spy):
    B, T = 2, 9
    _, _, ours = pair()
    outs = _record_outputs(ours)  # hooks on q_proj, k_proj, v_proj, relative_k_proj
    x = rnd(B, T, HIDDEN)
    pe = hf.ParakeetEncoderRelPositionalEncoding(config())(x)[:1]
    ours(x, pe, None)
    (args, _), = spy
    q, k, v, r = args[:4]
    for t, name in ((q, "linear_q"), (k, "linear_k"), (v, "linear_v"), (r, "linear_pos")):
        assert t._base is not None and t.data_ptr() == outs[name].data_ptr(), name
    assert r.shape == (2 * T - 1, HEADS, HIDDEN // HEADS)


def test_batched_position_table_runs_per_sequence_and_expanded_once(spy):
    """The encoder hands B materialised copies of the table (each could differ under
    dropout_positions): one call per sequence; an expanded view or one row: one call."""
    B, T = 2, 7
    cfg, orig, ours = pair()
    x = rnd(B, T, HIDDEN)
    pe = hf.ParakeetEncoderRelPositionalEncoding(cfg)(x)
    assert pe.shape[0] == B and pe.stride(0) != 0
    torch.testing.assert_close(ours(x, pe)[0], orig(x, pe)[0], rtol=2e-5, atol=2e-5)
    assert len(spy) == B
    spy.clear()
    torch.testing.assert_close(ours(x, pe[:1].expand(B, -1, -1))[0], orig(x, pe)[0],
                               rtol=2e-5, atol=2e-5)
    assert len(spy) == 1


def encoder_inputs(B=3, frames=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(B, frames, 16, generator=g)
    lengths = torch.tensor([frames, frames - 9, 12])[:B]
    return feats, (torch.arange(frames)[None] < lengths[:, None]).long()


def _encoder_outputs(model, dtype):
    """The encoder's output and the gradients of a fixed weighted sum of it w.r.t. the input
    features and every parameter."""
    feats, am = encoder_inputs()
    f = feats.to(dtype).requires_grad_()
    out = model(f, attention_mask=am)
    loss = (out.last_hidden_state * torch.linspace(-1, 1, out.last_hidden_state.numel())
            .view_as(out.last_hidden_state).to(dtype)).sum()
    return [out.last_hidden_state] + list(torch.autograd.grad(loss, [f] + list(model.parameters())))


def test_whole_encoder_after_swap():
    """A real ParakeetEncoder (its own subsampling, position table and mask builder), before
    and after swap_rel_pos_attention: same outputs and gradients. float64: equal to rounding;
    float32: each output / gradient within 2x (+ 1e-7) of the original's own float32 error
    against the float64 original (fp32 reductions differ with the thread count)."""
    torch.manual_seed(0)
    enc = hf.ParakeetEncoder(config()).double().eval()
    with torch.no_grad():
        for layer in enc.layers:
            layer.self_attn.bias_u.normal_(0.0, 0.5)
            layer.self_attn.bias_v.normal_(0.0, 0.5)
    swapped = copy.deepcopy(enc)
    params = {id(p) for p in swapped.parameters()}
    assert swap_rel_pos_attention(swapped, backend="reference") == 2
    assert all(isinstance(layer.self_attn, ParakeetEncoderAttention) for layer in swapped.layers)
    assert {id(p) for p in swapped.parameters()} == params
    truth = _encoder_outputs(enc, torch.float64)
    for a, b in zip(truth, _encoder_outputs(swapped, torch.float64)):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-10)
    orig32 = _encoder_outputs(copy.deepcopy(enc).float(), torch.float32)
    ours32 = _encoder_outputs(copy.deepcopy(swapped).float(), torch.float32)
    for t, a, b in zip(truth, orig32, ours32):
        err_orig = (a.double() - t).abs().max().item()
        err_ours = (b.double() - t).abs().max().item()
        assert err_ours <= 2 * err_orig + 1e-7, (err_ours, err_orig)


@pytest.mark.parametrize("kind", ["encoder", "flat"])
def test_fused_path_fp32(kind):
    B, T = 2, 13
    cfg, orig, ours = pair(backend="triton")
    x = rnd(B, T, HIDDEN, seed=3)
    pe_mod = hf.ParakeetEncoderRelPositionalEncoding(cfg)
    lengths = torch.tensor([T, T - 5])
    valid = torch.arange(T)[None] < lengths[:, None]
    enc_mask = (valid[:, None, :] & valid[:, :, None])[:, None]

    def run(mask):
        def f(mod, dtype, device):
            xx = x.to(device=device, dtype=dtype).requires_grad_()
            pe = pe_mod(xx.detach())[:1].requires_grad_()  # (the original needs B rows)
            return (mod(xx, pe.expand(B, -1, -1), mask.to(device))[0],), (xx, pe)
        return f

    compare(orig, ours, run(enc_mask), run(enc_mask if kind == "encoder" else valid),
            torch.float32, device=FUSED_DEVICE, grads=True, name=f"parakeet {kind}")


def test_bad_inputs_raise_clear_errors():
    B, T = 2, 6
    cfg, _, ours = pair()
    x = rnd(B, T, HIDDEN)
    pe = hf.ParakeetEncoderRelPositionalEncoding(cfg)(x)
    with pytest.raises(TypeError, match=r"attention_mask must be a bool or integer.*float32"):
        ours(x, pe, torch.zeros(B, 1, T, T))
    with pytest.raises(ValueError,
                       match=r"attention_mask must be \(B, 1, T, T\).*got \[2, 1, 6, 5\]"):
        ours(x, pe, torch.ones(B, 1, T, T - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"pos_emb must be .*2K - 1 = 11"):
        ours(x, pe[:, 1:], None)
    with pytest.raises(ValueError, match="position_embeddings are required"):
        ours(x, None)
    with pytest.raises(ValueError, match=r"hidden_states must be \(B, time, n_feat=64\)"):
        ours(rnd(B, T, 32), pe)
    bad = config()
    bad.num_key_value_heads = 2
    with pytest.raises(ValueError, match="num_key_value_heads must equal"):
        ParakeetEncoderAttention(bad, 0)


def test_exported():
    assert txl_kernels.ParakeetEncoderAttention is ParakeetEncoderAttention


# ------------------------------------------------------------- Wav2Vec2-Conformer (relative)
from transformers.models.wav2vec2_conformer import modeling_wav2vec2_conformer as w2v  # noqa: E402
from transformers.models.fastspeech2_conformer import (  # noqa: E402
    modeling_fastspeech2_conformer as fs2)
from txl_kernels.modules import (FastSpeech2ConformerAttention,  # noqa: E402
                                 Wav2Vec2ConformerSelfAttention)


def w2v_config(impl):
    cfg = w2v.Wav2Vec2ConformerConfig(hidden_size=HIDDEN, num_attention_heads=HEADS,
                                      intermediate_size=32, num_hidden_layers=2,
                                      position_embeddings_type="relative",
                                      conv_depthwise_kernel_size=3, hidden_dropout=0.0,
                                      attention_dropout=0.0, activation_dropout=0.0,
                                      layerdrop=0.0)
    cfg._attn_implementation = impl
    return cfg


def test_wav2vec2_conformer_state_dict_and_non_relative_refused():
    torch.manual_seed(0)
    orig = w2v.Wav2Vec2ConformerSelfAttention(w2v_config("sdpa"))
    ours = Wav2Vec2ConformerSelfAttention(w2v_config("sdpa"))
    assert list(ours.state_dict()) == list(orig.state_dict())
    ours.load_state_dict(orig.state_dict(), strict=True)
    orig.load_state_dict(ours.state_dict(), strict=True)
    rotary = w2v_config("sdpa")
    rotary.position_embeddings_type = "rotary"
    with pytest.raises(ValueError, match="only position_embeddings_type='relative'"):
        Wav2Vec2ConformerSelfAttention(rotary)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_wav2vec2_conformer_encoder_after_swap(impl):
    """The real encoder (its position table, create_bidirectional_mask: an additive float mask
    under eager, a bool one under sdpa) before and after the swap: outputs and gradients."""
    torch.manual_seed(0)
    enc = w2v.Wav2Vec2ConformerEncoder(w2v_config(impl)).double().eval()
    with torch.no_grad():
        for layer in enc.layers:
            layer.self_attn.pos_bias_u.normal_(0.0, 0.5)
            layer.self_attn.pos_bias_v.normal_(0.0, 0.5)
    swapped = copy.deepcopy(enc)
    assert swap_rel_pos_attention(swapped, backend="reference") == 2
    assert all(isinstance(layer.self_attn, Wav2Vec2ConformerSelfAttention)
               for layer in swapped.layers)
    B, T = 3, 17
    x = rnd(B, T, HIDDEN, dtype=torch.float64)
    am = torch.arange(T)[None] < torch.tensor([T, 11, 4])[:, None]
    outs = []
    for model in (enc, swapped):
        xx = x.clone().requires_grad_()
        out = model(xx.clone(), attention_mask=am).last_hidden_state
        w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        outs.append([out] + list(torch.autograd.grad((out * w).sum(),
                                                     [xx] + list(model.parameters()),
                                                     allow_unused=True)))
    for a, b in zip(*outs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_wav2vec2_conformer_padding_reaches_kernel_as_key_padding(spy):
    torch.manual_seed(0)
    cfg = w2v_config("eager")
    ours = Wav2Vec2ConformerSelfAttention(cfg, backend="reference")
    B, T = 2, 9
    x = rnd(B, T, HIDDEN)
    pe = w2v.Wav2Vec2ConformerRelPositionalEmbedding(cfg)(x)
    valid = torch.arange(T)[None] < torch.tensor([T, 5])[:, None]
    neg = torch.finfo(torch.float32).min
    additive = torch.zeros(B, 1, T, T).masked_fill(~valid[:, None, None, :], neg)
    ours(x, additive, pe)
    (_, kw), = spy
    assert torch.equal(kw["key_padding_mask"], ~valid)
    assert not kw["attn_mask"].any() and kw["attn_mask_band"].tolist() == [1, T - 1, T - 1]
    with pytest.raises(ValueError, match="only 0 and"):
        ours(x, additive * 0.5, pe)


def test_fastspeech2_conformer_matches_original_fp64():
    cfg = fs2.FastSpeech2ConformerConfig(hidden_size=HIDDEN)
    module_config = {"num_attention_heads": HEADS, "attention_dropout_rate": 0.0}
    torch.manual_seed(0)
    orig = fs2.FastSpeech2ConformerAttention(cfg, module_config).eval()
    with torch.no_grad():
        orig.pos_bias_u.normal_(0.0, 0.5)
        orig.pos_bias_v.normal_(0.0, 0.5)
    ours = FastSpeech2ConformerAttention(cfg, module_config, backend="reference").eval()
    assert list(ours.state_dict()) == list(orig.state_dict())
    ours.load_state_dict(orig.state_dict(), strict=True)
    B, T = 3, 15
    x = rnd(B, T, HIDDEN, seed=2)
    pe = rnd(1, 2 * T - 1, HIDDEN, seed=3)
    mask = (torch.arange(T)[None] < torch.tensor([T, 9, 3])[:, None])[:, None, :]

    def run(mod, dtype, device):
        xx, pp = x.to(dtype).requires_grad_(), pe.to(dtype).requires_grad_()
        return (mod(xx, mask, pp)[0],), (xx, pp)

    compare(orig, ours, run, run, torch.float64, grads=True)

    def run_probs(mod, dtype, device):
        xx, pp = x.to(dtype).requires_grad_(), pe.to(dtype).requires_grad_()
        return mod(xx, mask, pp, output_attentions=True), (xx, pp)

    compare(orig, ours, run_probs, run_probs, torch.float64, grads=True)
    swapped = nn.ModuleList([copy.deepcopy(orig)])
    assert swap_rel_pos_attention(swapped, backend="reference") == 1
    torch.testing.assert_close(swapped[0](x, mask, pe)[0], orig(x, mask, pe)[0],
                               rtol=2e-5, atol=2e-5)
