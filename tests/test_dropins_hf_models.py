"""The transformers drop-ins inside the real transformers 5.x models (FastSpeech2ConformerModel,
ParakeetForCTC, Wav2Vec2ConformerModel with relative positions), small random configs:

- ``swap_rel_pos_attention`` then the model's own ``forward`` (its own mask builders: float,
  integer and bool masks) gives the unswapped model's outputs (and gradients);
- the models' own weight initialisation (``from_pretrained`` of an empty state dict, the path
  of transformers' ``test_can_init_all_missing_weights``; ``initialize_weights`` after a
  meta-device build) reaches the drop-ins' ``pos_bias_u`` / ``pos_bias_v`` / ``bias_u`` /
  ``bias_v``, because a swapped module is also an instance of the original class;
- swapped models pickle.

Needs transformers >= 5 (the ``hf5`` extra).
"""
import copy
import io

import pytest
import torch

from txl_kernels.modules import swap_rel_pos_attention
import txl_kernels.modules.parakeet as hf_dropins

from test_conformer import spy  # noqa: F401  (fixture: records the rel_attention calls)

transformers = pytest.importorskip(
    "transformers", minversion="5.0",
    reason="transformers >= 5 is not installed (pip install 'txl_kernels[hf5]')")
from transformers import (FastSpeech2ConformerConfig, FastSpeech2ConformerModel,  # noqa: E402
                          ParakeetCTCConfig, ParakeetForCTC, Wav2Vec2ConformerConfig,
                          Wav2Vec2ConformerModel)
from transformers.models.fastspeech2_conformer import (  # noqa: E402
    modeling_fastspeech2_conformer as fs2)
from transformers.models.parakeet import modeling_parakeet as pk  # noqa: E402
from transformers.models.wav2vec2_conformer import (  # noqa: E402
    modeling_wav2vec2_conformer as w2v)
from transformers.utils import logging as hf_logging  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_transformers():
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # from_pretrained's report of the missing weights
    yield
    hf_logging.set_verbosity(level)


def fs2_config():
    return FastSpeech2ConformerConfig(
        hidden_size=24, vocab_size=20, num_mel_bins=8, encoder_layers=2, decoder_layers=1,
        encoder_linear_units=32, decoder_linear_units=32, speech_decoder_postnet_layers=2,
        speech_decoder_postnet_units=16, duration_predictor_channels=16,
        energy_predictor_channels=16, pitch_predictor_channels=16, pitch_predictor_layers=2,
        encoder_kernel_size=3, decoder_kernel_size=3, encoder_dropout_rate=0.0,
        encoder_positional_dropout_rate=0.0, encoder_attention_dropout_rate=0.0,
        decoder_dropout_rate=0.0, decoder_positional_dropout_rate=0.0,
        decoder_attention_dropout_rate=0.0, duration_predictor_dropout_rate=0.0,
        energy_predictor_dropout=0.0, pitch_predictor_dropout=0.0,
        speech_decoder_postnet_dropout=0.0)


def parakeet_config():
    return ParakeetCTCConfig(vocab_size=12, pad_token_id=0, encoder_config=dict(
        hidden_size=32, num_attention_heads=2, intermediate_size=32, num_hidden_layers=2,
        subsampling_conv_channels=8, num_mel_bins=16, subsampling_factor=4, conv_kernel_size=3,
        dropout=0.0, layerdrop=0.0, activation_dropout=0.0, attention_dropout=0.0))


def w2v_config(impl="eager"):
    cfg = Wav2Vec2ConformerConfig(
        hidden_size=32, num_attention_heads=2, intermediate_size=32, num_hidden_layers=2,
        position_embeddings_type="relative", conv_depthwise_kernel_size=3,
        conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_feat_extract_layers=2,
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0)
    cfg._attn_implementation = impl
    return cfg


# model class, config, the original attention class, its bias names, attention layers
MODELS = {
    "fastspeech2": (FastSpeech2ConformerModel, fs2_config, fs2.FastSpeech2ConformerAttention,
                    ("pos_bias_u", "pos_bias_v"), 3),
    "parakeet": (ParakeetForCTC, parakeet_config, pk.ParakeetEncoderAttention,
                 ("bias_u", "bias_v"), 2),
    "wav2vec2_conformer": (Wav2Vec2ConformerModel, w2v_config,
                           w2v.Wav2Vec2ConformerSelfAttention, ("pos_bias_u", "pos_bias_v"), 2),
}


def _swapped(model):
    new = copy.deepcopy(model)
    assert swap_rel_pos_attention(new, backend="reference") == MODELS[_kind(model)][4]
    return new


def _kind(model):
    return next(k for k, m in MODELS.items() if isinstance(model, m[0]))


def _randomize_biases(model, names):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.rsplit(".", 1)[-1] in names:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _assert_close_tree(a, b, rtol, atol):
    for key in a.keys():
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(y, x, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


# ----------------------------------------------------------------------- forward of the models

def test_fastspeech2_model_forward_with_its_own_masks():
    """Regression: FastSpeech2ConformerModel hands its attention layers a float mask
    (torch.ones(input_ids.shape) when none is given), which the drop-in refused with a
    TypeError. Inference (the default float mask; integer, float and bool masks with
    padding) and training with labels (the decoder's integer mask), outputs and gradients,
    against the unswapped model."""
    torch.manual_seed(0)
    model = FastSpeech2ConformerModel(fs2_config()).eval()
    _randomize_biases(model, ("pos_bias_u", "pos_bias_v"))
    swapped = _swapped(model)
    ids = torch.randint(1, 20, (2, 7), generator=torch.Generator().manual_seed(1))
    padded = torch.ones(2, 7, dtype=torch.long)
    padded[1, 5:] = 0
    for mask in (None, padded, padded.float(), padded.bool()):
        want = model(ids, attention_mask=mask, return_dict=True)
        got = swapped(ids, attention_mask=mask, return_dict=True)
        assert got.spectrogram.shape == want.spectrogram.shape
        _assert_close_tree(want, got, rtol=1e-4, atol=1e-5)
    # training: ground-truth durations; the decoder gets an int mask from the labels
    g = torch.Generator().manual_seed(2)
    durations = torch.randint(1, 4, (2, 7), generator=g)
    durations[1, 5:] = 0
    frames = int(durations.sum(1).max())
    spec = torch.randn(2, frames, 8, generator=g)
    spec[1, int(durations[1].sum()):] = -100.0
    labels = dict(spectrogram_labels=spec, duration_labels=durations,
                  pitch_labels=torch.randn(2, 7, 1, generator=g),
                  energy_labels=torch.randn(2, 7, 1, generator=g))
    results = []
    for m in (model, swapped):
        m.train()
        out = m(ids, attention_mask=padded, return_dict=True, **labels)
        grads = torch.autograd.grad(out.loss, list(m.parameters()))
        results.append((out, grads))
    (want, want_g), (got, got_g) = results
    _assert_close_tree(want, got, rtol=1e-4, atol=1e-5)
    for (name, _), a, b in zip(model.named_parameters(), want_g, got_g):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_parakeet_for_ctc_forward_after_swap():
    torch.manual_seed(0)
    model = ParakeetForCTC(parakeet_config()).double().eval()
    _randomize_biases(model, ("bias_u", "bias_v"))
    swapped = _swapped(model)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(3, 40, 16, generator=g, dtype=torch.float64)
    mask = torch.arange(40)[None] < torch.tensor([40, 29, 13])[:, None]
    labels = torch.randint(1, 12, (3, 4), generator=g)
    for kw in ({}, {"attention_mask": mask}, {"attention_mask": mask, "labels": labels}):
        want = model(feats, return_dict=True, **kw)
        got = swapped(feats, return_dict=True, **kw)
        _assert_close_tree(want, got, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_wav2vec2_conformer_model_forward_after_swap(impl):
    torch.manual_seed(0)
    model = Wav2Vec2ConformerModel(w2v_config(impl)).double().eval()
    _randomize_biases(model, ("pos_bias_u", "pos_bias_v"))
    swapped = _swapped(model)
    audio = torch.randn(3, 400, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = (torch.arange(400)[None] < torch.tensor([400, 300, 120])[:, None]).long()
    for kw in ({}, {"attention_mask": mask}):
        want = model(audio, return_dict=True, **kw)
        got = swapped(audio, return_dict=True, **kw)
        _assert_close_tree(want, got, rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------- the models' weight init

@pytest.mark.parametrize("kind", list(MODELS))
def test_hf_init_reaches_dropin_parameters(kind, monkeypatch):
    """Regression: transformers' _init_weights picks modules by isinstance, so after a swap
    the biases of the drop-ins were left unset by from_pretrained's initialisation of missing
    weights (transformers' test_can_init_all_missing_weights: "not properly handled in
    _init_weights()") and by initialize_weights() after a meta-device build."""
    model_cls, config, original, biases, n = MODELS[kind]
    torch.manual_seed(0)
    want = model_cls.from_pretrained(None, config=config(), state_dict={})
    torch.manual_seed(0)
    again = model_cls.from_pretrained(None, config=config(), state_dict={}).state_dict()
    # Wav2Vec2-Conformer's weight-normed position conv is left uninitialised by transformers
    # (its _init_weights writes to the computed weight, not to the parametrization's
    # originals), so those tensors hold whatever memory they got: they differ from run to run,
    # or happen to match. They are left out of every comparison, whether or not they differ
    # in this run; anything else that differs between two unswapped builds fails the test.
    unstable = {k for k in want.state_dict() if ".parametrizations." in k}
    changed = {k for k, v in want.state_dict().items() if not torch.equal(v, again[k])}
    assert changed <= unstable, changed - unstable
    post_init = model_cls.post_init

    def swapping_post_init(self):  # the swap applied to every model built
        post_init(self)
        assert swap_rel_pos_attention(self, backend="reference") == n

    # (patched on the class, not a subclass: transformers initialises classes from outside
    # its package as remote code, which skips modules without parameters of their own)
    monkeypatch.setattr(model_cls, "post_init", swapping_post_init)
    torch.manual_seed(0)
    got = model_cls.from_pretrained(None, config=config(), state_dict={})
    monkeypatch.undo()
    attn = [m for m in got.modules() if isinstance(m, original)]
    assert len(attn) == n and all(type(m).__module__ == hf_dropins.__name__ for m in attn)
    want_sd, got_sd = want.state_dict(), got.state_dict()
    assert list(want_sd) == list(got_sd)
    different = [k for k in want_sd
                 if k not in unstable and not torch.equal(want_sd[k], got_sd[k])]
    assert not different, different

    # a meta-device build, swapped, materialised with NaNs: the init sets every parameter
    with torch.device("meta"):
        meta = model_cls(config())
    swap_rel_pos_attention(meta, backend="reference")
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for p in meta.parameters():
            p.fill_(float("nan"))
    meta.initialize_weights()
    unset = [name for name, p in meta.named_parameters()
             if name not in unstable and torch.isnan(p).any()]  # (not set there either)
    assert not unset, unset
    assert all(not (getattr(m, b) == 0).all() for m in meta.modules()
               if isinstance(m, original) for b in biases)


def test_swapped_model_pickles_and_is_not_swapped_twice():
    torch.manual_seed(0)
    model = FastSpeech2ConformerModel(fs2_config()).eval()
    swapped = _swapped(model)
    attn = swapped.encoder.conformer_layers[0].self_attn
    name = type(attn).__qualname__
    assert name == "FastSpeech2ConformerAttentionAsOriginal"
    assert getattr(hf_dropins, name) is type(attn)  # how pickle finds the class
    buf = io.BytesIO()
    torch.save(swapped, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ids = torch.randint(1, 20, (1, 6))
    torch.testing.assert_close(loaded(ids).spectrogram, swapped(ids).spectrogram)
    assert swap_rel_pos_attention(swapped) == 0


# ------------------------------------------------------------- output_attentions (probabilities)

def _attention_outputs(out):
    """The attention probabilities a model output carries (FastSpeech2: encoder's, decoder's)."""
    if hasattr(out, "encoder_attentions"):
        return tuple(out.encoder_attentions or ()) + tuple(out.decoder_attentions or ())
    return tuple(out.attentions) if out.attentions is not None else ()


def _model_inputs(kind):
    g = torch.Generator().manual_seed(1)
    if kind == "fastspeech2":
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, 5:] = 0
        return (torch.randint(1, 20, (2, 7), generator=g),), {"attention_mask": mask}
    if kind == "parakeet":
        mask = torch.arange(40)[None] < torch.tensor([40, 29, 13])[:, None]
        return (torch.randn(3, 40, 16, generator=g),), {"attention_mask": mask}
    mask = (torch.arange(400)[None] < torch.tensor([400, 300, 120])[:, None]).long()
    return (torch.randn(3, 400, generator=g),), {"attention_mask": mask}


def _eager_model(kind):
    model_cls, config, _, biases, _ = MODELS[kind]
    cfg = config()
    cfg._attn_implementation = "eager"  # the original returns its probabilities only in eager
    if kind == "parakeet":
        cfg.encoder_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    _randomize_biases(model, biases)
    return model


@pytest.mark.parametrize("how", ["argument", "config"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_output_attentions_match_the_eager_original(kind, how, spy):
    """Regression: with output_attentions=True the Parakeet and Wav2Vec2-Conformer drop-ins
    returned no probabilities and FastSpeech2's raised NotImplementedError. Asked by argument
    or by the config, a swapped model returns the eager original's probabilities (count,
    shape, dtype, values) and outputs, and they are in the graph (their gradient exists);
    without the request the fused path runs and returns none."""
    model = _eager_model(kind)
    swapped = _swapped(model)
    args, kw = _model_inputs(kind)
    kw = dict(kw, return_dict=True)
    if how == "argument":
        kw["output_attentions"] = True
    else:
        for m in (model, swapped):
            for mod in m.modules():
                if hasattr(mod, "config") and hasattr(mod.config, "output_attentions"):
                    mod.config.output_attentions = True
    want = model(*args, **kw)
    spy.clear()
    got = swapped(*args, **kw)
    assert not spy  # the probabilities' call runs the eager math, not rel_attention
    want_p, got_p = _attention_outputs(want), _attention_outputs(got)
    assert len(want_p) == MODELS[kind][4] and len(got_p) == len(want_p)
    for a, b in zip(want_p, got_p):
        assert b.shape == a.shape and b.dtype == a.dtype
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    _assert_close_tree(want, got, rtol=1e-4, atol=1e-5)
    got_p[0].retain_grad()
    first = got[0] if kind != "fastspeech2" else got.spectrogram
    first.flatten()[0].backward()
    assert got_p[0].grad is not None

    # not asked for: the fused path, no probabilities
    for m in (model, swapped):
        for mod in m.modules():
            if hasattr(mod, "config") and hasattr(mod.config, "output_attentions"):
                mod.config.output_attentions = False
    kw.pop("output_attentions", None)
    with torch.no_grad():
        want, got = model(*args, **kw), swapped(*args, **kw)
    assert len(spy) >= MODELS[kind][4] and not _attention_outputs(got)
    _assert_close_tree(want, got, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", list(MODELS))
def test_output_attentions_dropout_as_the_original_in_training(kind):
    """The probabilities of a training call carry the original's attention dropout (same
    random draws for the same seed), and the output is computed from them."""
    _, _, original, biases, _ = MODELS[kind]
    model = _eager_model(kind)
    attn = next(m for m in model.modules() if isinstance(m, original))
    if kind == "parakeet":
        attn.attention_dropout = 0.4
    else:
        attn.dropout.p = 0.4
    holder = torch.nn.ModuleList([attn]).train()
    swapped = copy.deepcopy(holder)
    assert swap_rel_pos_attention(swapped, backend="reference") == 1
    g = torch.Generator().manual_seed(5)
    hidden = attn.config.hidden_size if kind != "fastspeech2" else attn.hidden_size
    B, T = 2, 9
    x = torch.randn(B, T, hidden, generator=g)
    pe = torch.randn(1, 2 * T - 1, hidden, generator=g)
    if kind == "fastspeech2":
        mask = (torch.arange(T)[None] < torch.tensor([T, 6])[:, None])[:, None]
        call = {"hidden_states": x, "attention_mask": mask, "pos_emb": pe,
                "output_attentions": True}
    else:
        valid = torch.arange(T)[None] < torch.tensor([T, 6])[:, None]
        mask = (valid[:, None, :] & valid[:, :, None])[:, None]
        if kind == "wav2vec2_conformer":  # the eager original's additive mask
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
            call = {"hidden_states": x, "attention_mask": mask,
                    "relative_position_embeddings": pe, "output_attentions": True}
        else:
            call = {"hidden_states": x, "position_embeddings": pe.expand(B, -1, -1),
                    "attention_mask": mask, "output_attentions": True}
    torch.manual_seed(7)
    want_out, want_p = holder[0](**call)
    torch.manual_seed(7)
    got_out, got_p = swapped[0](**call)
    assert (want_p == 0).any() and ((want_p == 0) == (got_p == 0)).all()
    torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
