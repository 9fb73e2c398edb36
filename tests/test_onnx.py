"""ONNX export of ``rel_attention`` and of every drop-in with both exporters
(``torch.onnx.export(dynamo=False)`` at opset 17, ``dynamo=True`` at its default opset), run
in ONNX Runtime (txl_kernels/_export.py, docs/export.md).

Every model is exported at one length (T_EXPORT) with dynamic batch and time axes and run in
ONNX Runtime at other lengths, one longer than the export's, with padding masks where the
module takes them; the outputs match eager PyTorch with the C++ CPU kernel (what
``backend="auto"`` runs on CPU tensors without the Triton interpreter; the suite sets the
interpreter, so the modules here name ``backend="cpu"``) within 1e-5 of the output's largest
magnitude (fp32). The graphs hold only standard ONNX operators (no ``txl_kernels`` domain),
keep the time axes symbolic and contain no constant sized by the export's length.
"""

import pytest
import torch
import torch.nn as nn

from txl_kernels import (DIEngineAttentionXL, ESPnetRelPositionMultiHeadedAttention,
                         FusedRelAttention, IcefallRelPositionMultiheadAttention,
                         NeMoRelPositionMultiHeadAttention, RLlibRelativeMultiHeadAttention,
                         SpeechBrainRelPosMHAXL, quantize_kv, rel_attention)
from txl_kernels._export import ExportUnsupported

onnx = pytest.importorskip("onnx", reason="the export extra is not installed "
                                          "(pip install 'txl_kernels[export]')")
ort = pytest.importorskip("onnxruntime", reason="the export extra is not installed "
                                                "(pip install 'txl_kernels[export]')")

B, H, D = 2, 2, 8
F = H * D
T_EXPORT, M_EXPORT = 11, 3       # lengths at export: no model dimension equals them
RUN = ((5, 2), (23, 3))          # (T, B) at which ONNX Runtime runs; 23 > every export length
EXPORTERS = ("dynamo_false", "dynamo_true")


@pytest.fixture(autouse=True)
def _cpu_kernel(extension):
    """The C++ CPU kernel the drop-ins' eager outputs come from (``extension`` builds it)."""


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randomize(model, seed=0):
    """Random parameters (the drop-ins start some biases at 0)."""
    g = _gen(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _padding(batch, length):
    """bool [batch, length], True = padded: the second sequence loses its last 3 frames."""
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[1, -3:] = True
    return pad


# --------------------------------------------------------------------------------- exporting

def export(model, args, names, axes, exporter, path, opset=17):
    """Export ``model`` with ``args`` to ``path``; ``axes``: {input name: {axis: name}};
    ``opset``: dynamo=False's (dynamo=True uses its default)."""
    model.eval()
    if exporter == "dynamo_false":
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=opset,
                          input_names=list(names), output_names=["out"], dynamic_axes=axes)
    else:
        pytest.importorskip("onnxscript", reason="the export extra is not installed")
        prog = torch.onnx.export(model, args, dynamo=True, input_names=list(names),
                                 output_names=["out"], dynamic_axes=axes)
        prog.save(str(path))
    return onnx.load(str(path))


def check_graph(proto, axes, names):
    """Standard operators only, symbolic dynamic axes, no constant sized by an export
    length."""
    nodes = list(proto.graph.node)
    for fn in proto.functions:
        nodes += list(fn.node)
    domains = {n.domain for n in nodes}
    assert not any(d.startswith("txl_kernels") for d in domains), domains
    assert domains <= {"", "ai.onnx"}, domains
    inputs = {i.name: i for i in proto.graph.input}
    for name, dims in axes.items():
        shape = inputs[names[name] if isinstance(names, dict) else name].type.tensor_type.shape
        for axis in dims:
            assert shape.dim[axis].dim_param, (name, axis, shape)
    lengths = {T_EXPORT, T_EXPORT + M_EXPORT, 2 * T_EXPORT - 1, 2 * T_EXPORT + M_EXPORT - 1}
    consts = [(i.name, list(i.dims)) for i in proto.graph.initializer]
    for n in nodes:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                consts.append((n.name, list(a.t.dims)))
    baked = [(n, dims) for n, dims in consts if lengths & set(dims)]
    assert not baked, f"constants sized by an export length: {baked}"


def run_ort(path, feeds):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(None, {k: v.numpy() for k, v in feeds.items()})[0])


def assert_parity(got, want, rel=1e-5):
    """|got - want| <= rel * max |want| (fp32)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rel * scale, f"max error {err} > {rel} * {scale}"


def roundtrip(case, exporter, tmp_path, runs=RUN, opset=17):
    """Export ``case`` at T_EXPORT and compare ONNX Runtime with eager at ``runs``."""
    model, make, names, axes = case
    path = tmp_path / "model.onnx"
    proto = export(model, make(T_EXPORT, B), names, axes, exporter, path, opset)
    check_graph(proto, axes, names)
    for t, b in runs:
        args = make(t, b)
        with torch.no_grad():
            want = model(*args)
        assert_parity(run_ort(path, dict(zip(names, args))), want)
    return proto


# ------------------------------------------------------------------------ the functional op

class Functional(nn.Module):
    def __init__(self, causal, window, backend="cpu", d=D):
        super().__init__()
        self.causal, self.window, self.backend = causal, window, backend
        self.u = nn.Parameter(torch.randn(H, d, generator=_gen(1)))
        self.vb = nn.Parameter(torch.randn(H, d, generator=_gen(2)))

    def forward(self, q, k, v, r, key_padding_mask):
        return rel_attention(q, k, v, r, self.u, self.vb, causal=self.causal,
                             window_size=self.window, key_padding_mask=key_padding_mask,
                             backend=self.backend)


FUNCTIONAL = {  # name: (causal, window_size, memory length)
    "bidirectional": (False, (-1, -1), 0),
    "causal_memory": (True, (-1, -1), M_EXPORT),
    "window": (False, (3, 2), 0),
    # wider than the export's lengths, narrower than the longest run's
    "wide_window": (False, (15, 13), 0),
    "causal_window_memory": (True, (4, 0), M_EXPORT),
}


def functional_case(name, backend="cpu", d=D):
    causal, window, mem = FUNCTIONAL[name]

    def make(t, b):
        g = _gen(t * 10 + b)
        m = mem if t == T_EXPORT else mem + 1  # the memory length is dynamic too
        q = torch.randn(b, t, H, d, generator=g)
        k, v = (torch.randn(b, m + t, H, d, generator=g) for _ in range(2))
        r = torch.randn(m + 2 * t - 1, H, d, generator=g)
        return q, k, v, r, _padding(b, m + t)

    names = ("q", "k", "v", "r", "key_padding_mask")
    axes = {"q": {0: "B", 1: "T"}, "k": {0: "B", 1: "K"}, "v": {0: "B", 1: "K"},
            "r": {0: "R"}, "key_padding_mask": {0: "B", 1: "K"}}
    return Functional(causal, window, backend, d).eval(), make, names, axes


def exporter_params(names, dynamo_fast):
    """(name, exporter) parameters for every name and exporter; the dynamo exporter (7-9 s a
    model on two cores) marked slow except on ``dynamo_fast``."""
    return [pytest.param(name, exporter, id=f"{name}-{exporter}",
                         marks=[pytest.mark.slow] if exporter == "dynamo_true"
                         and name not in dynamo_fast else [])
            for name in names for exporter in EXPORTERS]


# the dynamo exporter on two variants in the fast suite (together: causal, window, memory)
@pytest.mark.parametrize("name,exporter",
                         exporter_params(FUNCTIONAL, ("bidirectional", "causal_window_memory")))
def test_functional_onnx_parity(name, exporter, tmp_path):
    """Regression: the CPU backend's custom op had no ONNX form ("unrecognized namespace
    txl_kernels::rel_attn_fwd" with dynamo=False, no ONNX function with dynamo=True).
    The products are MatMuls (ONNX Runtime's Einsum is several times slower)."""
    proto = roundtrip(functional_case(name), exporter, tmp_path)
    ops = {n.op_type for n in proto.graph.node}
    assert "MatMul" in ops and "Einsum" not in ops, ops


@pytest.mark.parametrize("backend", ["auto", "triton", "reference"])
def test_functional_every_backend_exports(backend, tmp_path):
    """Whatever the backend (here "auto" and "triton" are the Triton interpreter, at a head
    dim it takes), the exported graph is the reference math and matches that backend's eager
    output."""
    roundtrip(functional_case("causal_memory", backend, d=16), "dynamo_false", tmp_path,
              runs=((5, 2),))


# ------------------------------------------------------------------------------ the drop-ins

class Adapter(nn.Module):
    """Positional tensors in, the drop-in's attention output out (a forward of fixed arity:
    the dynamo=True exporter maps dynamic_axes onto the forward's parameters)."""

    def __init__(self, module, call):
        super().__init__()
        self.m, self.call = module, call


class Adapter2(Adapter):
    def forward(self, a, b):
        return self.call(self.m, a, b)


class Adapter3(Adapter):
    def forward(self, a, b, c):
        return self.call(self.m, a, b, c)


class Adapter4(Adapter):
    def forward(self, a, b, c, d):
        return self.call(self.m, a, b, c, d)


def _seq_pos_pad(t, b, seed, seq_first=False):
    g = _gen(seed + 100 * t + b)
    x = torch.randn(t, b, F, generator=g) if seq_first else torch.randn(b, t, F, generator=g)
    pos = torch.randn(1, 2 * t - 1, F, generator=g)
    return x, pos, _padding(b, t)


def _conformer_axes(x_axes=(0, 1)):
    return {"x": {x_axes[0]: "B", x_axes[1]: "T"}, "pos_emb": {1: "P"},
            "padding": {0: "B", 1: "T"}}


def nemo_case():
    m = _randomize(NeMoRelPositionMultiHeadAttention(H, F, 0.0, backend="cpu"))
    return (Adapter3(m, lambda m, x, pos, pad: m(x, x, x, pad, pos)).eval(),
            lambda t, b: _seq_pos_pad(t, b, 1), ("x", "pos_emb", "padding"), _conformer_axes())


def nemo_per_sequence_tables_case():
    """A position table per sequence (pos_emb (B, 2T - 1, F), as transformers' Parakeet
    encoder hands its layers): one graph for every batch size."""
    m = _randomize(NeMoRelPositionMultiHeadAttention(H, F, 0.0, backend="cpu"))

    def make(t, b):
        x, _, pad = _seq_pos_pad(t, b, 11)
        return x, torch.randn(b, 2 * t - 1, F, generator=_gen(t + b)), pad

    axes = _conformer_axes()
    axes["pos_emb"] = {0: "B", 1: "P"}
    return (Adapter3(m, lambda m, x, pos, pad: m(x, x, x, pad, pos)).eval(), make,
            ("x", "pos_emb", "padding"), axes)


def espnet_case():
    m = _randomize(ESPnetRelPositionMultiHeadedAttention(H, F, 0.0, backend="cpu"))
    # ESPnet's (B, 1, K) mask, True = keep
    return (Adapter3(m, lambda m, x, pos, pad: m(x, x, x, pos, ~pad[:, None, :])).eval(),
            lambda t, b: _seq_pos_pad(t, b, 2), ("x", "pos_emb", "padding"), _conformer_axes())


def icefall_case():
    m = _randomize(IcefallRelPositionMultiheadAttention(F, H, 0.0, backend="cpu"))
    return (Adapter3(m, lambda m, x, pos, pad: m(x, x, x, pos, key_padding_mask=pad)[0]).eval(),
            lambda t, b: _seq_pos_pad(t, b, 3, seq_first=True), ("x", "pos_emb", "padding"),
            _conformer_axes((1, 0)))


def speechbrain_case():
    m = _randomize(SpeechBrainRelPosMHAXL(F, H, 0.0, backend="cpu"))
    return (Adapter3(m, lambda m, x, pos, pad: m(x, x, x, pos, key_padding_mask=pad)[0]).eval(),
            lambda t, b: _seq_pos_pad(t, b, 4), ("x", "pos_emb", "padding"), _conformer_axes())


def rllib_case():
    m = _randomize(RLlibRelativeMultiHeadAttention(F, F, H, D, backend="cpu"))

    def make(t, b):  # no padding mask in RLlib's API; a memory of its own length
        g = _gen(500 + t)
        return torch.randn(b, t, F, generator=g), torch.randn(b, t // 2 + 1, F, generator=g)

    return (Adapter2(m, lambda m, x, mem: m(x, mem)).eval(), make, ("x", "memory"),
            {"x": {0: "B", 1: "T"}, "memory": {0: "B", 1: "M"}})


def diengine_case():
    m = _randomize(DIEngineAttentionXL(F, D, H, nn.Dropout(0.0), backend="cpu"))
    u, v = (torch.randn(H, D, generator=_gen(s)) for s in (7, 8))

    def make(t, b):  # seq-first; memory of 3 steps; the causal mask of its memory layout
        g = _gen(600 + t)
        full = t + 3
        x = torch.randn(t, b, F, generator=g)
        return (x, torch.randn(full, 1, F, generator=g),
                torch.cat([torch.randn(3, b, F, generator=g), x]),
                torch.ones(t, full, dtype=torch.bool).triu(1 + 3)[..., None])

    return (Adapter4(m, lambda m, x, pos, full, mask: m(x, pos, full, u, v, mask)).eval(), make,
            ("x", "pos_embedding", "full_input", "mask"),
            {"x": {0: "T", 1: "B"}, "pos_embedding": {0: "K"}, "full_input": {0: "K", 1: "B"},
             "mask": {0: "T", 1: "K"}})


def fused_rel_attention_case():
    m = _randomize(FusedRelAttention(H, F, D, 0.0, untie_r=True, backend="cpu"))

    def make(t, b):  # Transformer-XL: seq-first, memory, the dense causal mask (detected)
        g = _gen(700 + t)
        mlen = 3
        klen = mlen + t
        return (torch.randn(t, b, F, generator=g), torch.randn(klen, 1, F, generator=g),
                torch.ones(t, klen, dtype=torch.bool).triu(1 + mlen),
                torch.randn(mlen, b, F, generator=g))

    return (Adapter4(m, lambda m, w, r, mask, mems: m(w, r, attn_mask=mask, mems=mems)).eval(),
            make, ("w", "r", "attn_mask", "mems"),
            {"w": {0: "T", 1: "B"}, "r": {0: "K"}, "attn_mask": {0: "T", 1: "K"},
             "mems": {1: "B"}})


def _hf():
    return pytest.importorskip("transformers", minversion="5.0",
                               reason="transformers >= 5 is not installed "
                                      "(pip install 'txl_kernels[hf5]')")


def parakeet_case():
    _hf()
    from transformers.models.parakeet.configuration_parakeet import ParakeetEncoderConfig
    from txl_kernels import ParakeetEncoderAttention

    cfg = ParakeetEncoderConfig(hidden_size=F, num_attention_heads=H, intermediate_size=32,
                                num_hidden_layers=1, attention_dropout=0.0)
    m = _randomize(ParakeetEncoderAttention(cfg, 0, backend="cpu"))
    # transformers' flat (B, T) mask, True = attend
    return (Adapter3(m, lambda m, x, pos, pad: m(x, pos, ~pad)[0]).eval(),
            lambda t, b: _seq_pos_pad(t, b, 5), ("x", "pos_emb", "padding"), _conformer_axes())


def wav2vec2_conformer_case():
    _hf()
    from transformers.models.wav2vec2_conformer import modeling_wav2vec2_conformer as w2v
    from txl_kernels import Wav2Vec2ConformerSelfAttention

    cfg = w2v.Wav2Vec2ConformerConfig(hidden_size=F, num_attention_heads=H,
                                      intermediate_size=32, num_hidden_layers=1,
                                      position_embeddings_type="relative",
                                      attention_dropout=0.0)
    m = _randomize(Wav2Vec2ConformerSelfAttention(cfg, backend="cpu"))
    # the sdpa-style bool mask (B, 1, 1, T), True = attend
    return (Adapter3(m, lambda m, x, pos, pad: m(x, ~pad[:, None, None, :], pos)[0]).eval(),
            lambda t, b: _seq_pos_pad(t, b, 6), ("x", "pos_emb", "padding"), _conformer_axes())


def fastspeech2_case():
    _hf()
    from transformers.models.fastspeech2_conformer import (
        modeling_fastspeech2_conformer as fs2)
    from txl_kernels import FastSpeech2ConformerAttention

    cfg = fs2.FastSpeech2ConformerConfig(hidden_size=F)
    m = _randomize(FastSpeech2ConformerAttention(
        cfg, {"num_attention_heads": H, "attention_dropout_rate": 0.0}, backend="cpu"))
    # the model's float (B, 1, T) mask of ones and zeros
    return (Adapter3(m, lambda m, x, pos, pad: m(x, (~pad[:, None, :]).float(), pos)[0]).eval(),
            lambda t, b: _seq_pos_pad(t, b, 7), ("x", "pos_emb", "padding"), _conformer_axes())


def nemo_longformer_case(global_tokens=0):
    """NeMo's local attention (att_context_size [3, 2]): a position table of the
    left + right + 1 local offsets (static), global tokens joined in the same softmax."""
    from txl_kernels import NeMoRelPositionMultiHeadAttentionLongformer

    m = _randomize(NeMoRelPositionMultiHeadAttentionLongformer(
        H, F, 0.0, None, None, att_context_size=[3, 2], global_tokens=global_tokens,
        backend="cpu"))

    def make(t, b):
        x, _, pad = _seq_pos_pad(t, b, 13)
        return x, torch.randn(1, 6, F, generator=_gen(t + b)), pad

    axes = _conformer_axes()
    del axes["pos_emb"]
    return (Adapter3(m, lambda m, x, pos, pad: m(x, x, x, pad, pos)).eval(), make,
            ("x", "pos_emb", "padding"), axes)


DROPINS = {
    "nemo": nemo_case, "nemo_per_sequence_tables": nemo_per_sequence_tables_case,
    "espnet": espnet_case, "icefall": icefall_case,
    "speechbrain": speechbrain_case, "rllib": rllib_case, "diengine": diengine_case,
    "fused_rel_attention": fused_rel_attention_case, "parakeet": parakeet_case,
    "wav2vec2_conformer": wav2vec2_conformer_case, "fastspeech2": fastspeech2_case,
}


# the dynamo exporter in the fast suite on the op's own module and the two encoders users
# export most (NeMo's, HF Parakeet's); every drop-in through the TorchScript exporter
@pytest.mark.parametrize("name,exporter",
                         exporter_params(DROPINS, ("fused_rel_attention", "nemo", "parakeet")))
def test_dropin_onnx_parity(name, exporter, tmp_path):
    roundtrip(DROPINS[name](), exporter, tmp_path)


@pytest.mark.parametrize("global_tokens", [0, 1])
def test_nemo_longformer_onnx_parity(global_tokens, tmp_path):
    """NeMo's local attention drop-in (band, short position table, global tokens) through
    both exporters: dynamo=False with dynamic_axes, dynamo=True with dynamic_shapes (its
    local position table is static: left + right + 1 rows at every length)."""
    roundtrip(nemo_longformer_case(global_tokens), "dynamo_false", tmp_path)
    pytest.importorskip("onnxscript", reason="the export extra is not installed")
    model, make, names, axes = nemo_longformer_case(global_tokens)
    Bd, Td = torch.export.Dim("B", min=1, max=64), torch.export.Dim("T", min=2, max=4096)
    prog = torch.onnx.export(model, make(T_EXPORT, B), dynamo=True, input_names=list(names),
                             output_names=["out"],
                             dynamic_shapes=({0: Bd, 1: Td}, None, {0: Bd, 1: Td}))
    path = tmp_path / "dynamo.onnx"
    prog.save(str(path))
    check_graph(onnx.load(str(path)), axes, names)
    for t, b in RUN:
        args = make(t, b)
        with torch.no_grad():
            want = model(*args)
        assert_parity(run_ort(path, dict(zip(names, args))), want)


def test_icefall_onnx_opset13(tmp_path):
    """icefall's export-onnx.py exports at opset 13: the lowering needs nothing later."""
    roundtrip(icefall_case(), "dynamo_false", tmp_path, opset=13)


# ------------------------------------------------------------------------- swapped encoders

class TinyConformer(nn.Module):
    """A NeMo-shaped encoder with the drop-in (what ``swap_rel_pos_attention`` leaves in a
    NeMo model): input projection, the relative position table computed for the input's
    length (no table capped at export), pre-norm layers of self-attention with the frames'
    padding mask and a feed-forward block."""

    def __init__(self, feat=12, layers=2):
        super().__init__()
        self.inp = nn.Linear(feat, F)
        self.norms = nn.ModuleList(nn.LayerNorm(F) for _ in range(layers))
        self.attn = nn.ModuleList(NeMoRelPositionMultiHeadAttention(H, F, 0.0, backend="cpu")
                                  for _ in range(layers))
        self.ff = nn.ModuleList(nn.Sequential(nn.LayerNorm(F), nn.Linear(F, 2 * F), nn.SiLU(),
                                              nn.Linear(2 * F, F)) for _ in range(layers))

    @staticmethod
    def pos_emb(t: int, dtype) -> torch.Tensor:
        """Sinusoids of the distances t - 1 .. -(t - 1): (1, 2t - 1, F)."""
        dist = torch.arange(t - 1, -t, -1, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, F, 2, dtype=torch.float32)
                         * (-torch.log(torch.tensor(10000.0)) / F))
        angle = dist * freq
        return torch.stack([angle.sin(), angle.cos()], -1).flatten(1)[None].to(dtype)

    def forward(self, x, lengths):
        t = x.shape[1]
        pad = torch.arange(t)[None] >= lengths[:, None]
        h = self.inp(x)
        pos = self.pos_emb(t, h.dtype)
        for norm, attn, ff in zip(self.norms, self.attn, self.ff):
            y = norm(h)
            h = h + attn(y, y, y, pad, pos)
            h = h + ff(h)
        return h


def tiny_conformer_case():
    def make(t, b):
        g = _gen(800 + t)
        lengths = torch.full((b,), t, dtype=torch.int64)
        lengths[1] = t - 3
        return torch.randn(b, t, 12, generator=g), lengths

    return (_randomize(TinyConformer()).eval(), make, ("x", "lengths"),
            {"x": {0: "B", 1: "T"}, "lengths": {0: "B"}})


def parakeet_encoder_case():
    """transformers' ParakeetEncoder (tiny config) after swap_rel_pos_attention."""
    _hf()
    from transformers.models.parakeet import modeling_parakeet as pk
    from transformers.models.parakeet.configuration_parakeet import ParakeetEncoderConfig
    from txl_kernels import swap_rel_pos_attention

    cfg = ParakeetEncoderConfig(hidden_size=F, num_attention_heads=H, intermediate_size=32,
                                num_hidden_layers=2, subsampling_conv_channels=8,
                                num_mel_bins=16, subsampling_factor=4, conv_kernel_size=3,
                                dropout=0.0, layerdrop=0.0, activation_dropout=0.0,
                                attention_dropout=0.0)
    torch.manual_seed(0)
    enc = pk.ParakeetEncoder(cfg).eval()
    assert swap_rel_pos_attention(enc, backend="cpu") == 2
    _randomize(enc)

    def make(t, b):  # mel frames: 4x the encoder's
        g = _gen(900 + t)
        mask = torch.ones(b, 4 * t, dtype=torch.bool)
        mask[1, -12:] = False
        return torch.randn(b, 4 * t, 16, generator=g), mask

    return (Adapter2(enc, lambda m, x, am: m(input_features=x, attention_mask=am)
                     .last_hidden_state).eval(),
            make, ("input_features", "attention_mask"),
            {"input_features": {0: "B", 1: "T"}, "attention_mask": {0: "B", 1: "T"}})


ENCODERS = {"tiny_conformer": tiny_conformer_case, "parakeet_encoder": parakeet_encoder_case}


@pytest.mark.parametrize("name", list(ENCODERS))
def test_encoder_onnx_parity_dynamo_false(name, tmp_path):
    roundtrip(ENCODERS[name](), "dynamo_false", tmp_path)


@pytest.mark.slow  # whole encoders through the dynamo exporter: ~15 s each on two cores
@pytest.mark.parametrize("name", ["tiny_conformer", "parakeet_encoder"])
def test_encoder_onnx_parity_dynamo_true(name, tmp_path):
    roundtrip(ENCODERS[name](), "dynamo_true", tmp_path)


@pytest.mark.parametrize("exporter", [  # the dynamo export of the encoder: ~14 s on two cores
    "dynamo_false", pytest.param("dynamo_true", marks=pytest.mark.slow)])
def test_quantize_dynamic_exported_encoder(exporter, tmp_path):
    """sherpa-onnx's int8 step (onnxruntime.quantization.quantize_dynamic, uint8 weights)
    runs on the exported encoder, and the quantized model runs at other lengths. Tolerance:
    8-bit weights and activations (one scale per tensor) round each MatMul input to ~1/255 of
    its range, an error of about 1% per product; measured here, the output is off by about
    1% of its largest magnitude, so 5% passes it with margin while a wrong graph (off by
    ~100%) fails."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model, make, names, axes = tiny_conformer_case()
    path, qpath = tmp_path / "enc.onnx", tmp_path / "enc.int8.onnx"
    export(model, make(T_EXPORT, B), names, axes, exporter, path)
    quantize_dynamic(str(path), str(qpath), weight_type=QuantType.QUInt8)
    ops = {n.op_type for n in onnx.load(str(qpath)).graph.node}
    assert ops & {"MatMulInteger", "DynamicQuantizeLinear", "DynamicQuantizeMatMul"}, ops
    for t, b in RUN:
        args = make(t, b)
        with torch.no_grad():
            want = model(*args)
        assert_parity(run_ort(qpath, dict(zip(names, args))), want, rel=0.05)


# ------------------------------------------------- features without an ONNX form: clear errors

def export_refused(model, args, exporter, tmp_path, what):
    """The export raises, and the error (or one it was raised from) is
    ExportUnsupported naming ``what`` and the route."""
    kw = dict(dynamo=False, opset_version=17) if exporter == "dynamo_false" else dict(
        dynamo=True)
    if exporter == "dynamo_false" and model.training:
        kw["training"] = torch.onnx.TrainingMode.TRAINING  # else the exporter calls eval()
    with pytest.raises(Exception) as info:
        torch.onnx.export(model, args, str(tmp_path / "refused.onnx"), **kw)
    err = info.value
    chain = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    ours = [e for e in chain if isinstance(e, ExportUnsupported)]
    assert ours, f"no ExportUnsupported in {[type(e).__name__ for e in chain]}: {chain[0]}"
    msg = str(ours[0])
    assert what in msg and "torch.onnx.export" in msg, msg
    assert msg in str(info.value)  # what the user reads (dynamo=True: the error's summary)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_training_dropout_refused(exporter, tmp_path):
    m = _randomize(NeMoRelPositionMultiHeadAttention(H, F, 0.1, backend="cpu"))
    model = Adapter3(m, lambda m, x, pos, pad: m(x, x, x, pad, pos)).train()
    export_refused(model, _seq_pos_pad(T_EXPORT, B, 1), exporter, tmp_path,
                   "attention dropout")


class WithQuantizedMemory(nn.Module):
    def forward(self, q, k, v, r, mk, mk_scale, mv, mv_scale):
        from txl_kernels import QuantizedKV

        u = torch.zeros(H, D)
        return rel_attention(q, k, v, r, u, u, memory=QuantizedKV(mk, mk_scale, mv, mv_scale),
                             backend="cpu")


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_quantized_memory_refused(exporter, tmp_path):
    g = _gen(9)
    t, mlen = 4, 3
    q, k, v = (torch.randn(B, t, H, D, generator=g) for _ in range(3))
    mem = quantize_kv(torch.randn(B, mlen, H, D, generator=g),
                      torch.randn(B, mlen, H, D, generator=g), torch.int8)
    r = torch.randn(mlen + t, H, D, generator=g)
    export_refused(WithQuantizedMemory().eval(), (q, k, v, r, *mem), exporter, tmp_path,
                   "8-bit memory")


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_context_parallel_module_refused(exporter, tmp_path):
    """A drop-in with a cp_group: refused at its first collective, before torch.distributed
    is touched (no process group is initialised here)."""
    m = _randomize(NeMoRelPositionMultiHeadAttention(H, F, 0.0, backend="cpu"))
    m.cp_group = object()
    model = Adapter3(m, lambda m, x, pos, pad: m(x, x, x, pad, pos)).eval()
    export_refused(model, _seq_pos_pad(T_EXPORT, B, 1), exporter, tmp_path,
                   "context parallelism")


class ContextParallel(nn.Module):
    def forward(self, q, k, v, r):
        from txl_kernels.distributed import context_parallel_rel_attention

        u = torch.zeros(H, D)
        return context_parallel_rel_attention(q, k, v, r, u, u, backend="reference")


def test_context_parallel_function_refused(tmp_path):
    g = _gen(10)
    q, k, v = (torch.randn(B, 4, H, D, generator=g) for _ in range(3))
    export_refused(ContextParallel().eval(), (q, k, v, torch.randn(4, H, D, generator=g)),
                   "dynamo_false", tmp_path, "context parallelism")


# ----------------------------------------------------------- the fused op called directly

class DirectOp(nn.Module):
    """Calls the CPU kernel's registered op itself (as a user of torch.library ops may): the
    op then reaches the dynamo=False exporter's graph, where its symbolic lowers it."""

    def __init__(self, window):
        super().__init__()
        self.window = window
        self.u = nn.Parameter(torch.randn(H, D, generator=_gen(1)))
        self.vb = nn.Parameter(torch.randn(H, D, generator=_gen(2)))

    def forward(self, q, k, v, r, key_padding_mask):
        return torch.ops.txl_kernels.rel_attn_fwd(
            q, k, v, r, self.u, self.vb, D ** -0.5, self.window[0], self.window[1],
            key_padding_mask, None, None, 0.0, None, None, None, None, None)[0]


@pytest.mark.parametrize("opset", [17, 19])
@pytest.mark.parametrize("name", ["causal_memory", "window", "bidirectional"])
def test_direct_op_symbolic_dynamo_false(name, opset, tmp_path):
    """The registered symbolic of txl_kernels::rel_attn_fwd (opset 13 form: ReduceMax's
    axes an attribute; opset 18 form: an input)."""
    causal, window, _ = FUNCTIONAL[name]
    _, make, names, axes = functional_case(name)
    model = DirectOp((window[0], 0 if causal else window[1])).eval()
    path = tmp_path / "direct.onnx"
    torch.onnx.export(model, make(T_EXPORT, B), str(path), dynamo=False, opset_version=opset,
                      input_names=list(names), output_names=["out"], dynamic_axes=axes)
    check_graph(onnx.load(str(path)), axes, names)
    for t, b in RUN:
        args = make(t, b)
        with torch.no_grad():
            want = model(*args)
        assert_parity(run_ort(path, dict(zip(names, args))), want)
