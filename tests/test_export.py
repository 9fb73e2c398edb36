"""Deployment routes of ``rel_attention``: torch.export with dynamic lengths (docs/export.md;
TorchScript: tests/test_torchscript.py)."""
import pytest
import torch

from txl_kernels import rel_attention


class _Attn(torch.nn.Module):
    def __init__(self, backend, H=2, D=8):
        super().__init__()
        self.backend = backend
        self.u = torch.nn.Parameter(torch.randn(H, D))
        self.vb = torch.nn.Parameter(torch.randn(H, D))

    def forward(self, q, k, v, r, kpm):
        return rel_attention(q, k, v, r, self.u, self.vb, causal=False, key_padding_mask=kpm,
                             backend=self.backend)


def _inputs(T, B=2, H=2, D=8):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    r = torch.randn(2 * T - 1, H, D, generator=g)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, -2:] = True
    return q, k, v, r, kpm


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_torch_export_dynamic_length(backend):
    """The rel_shift's shape arithmetic raises no guard on T: one program for every length."""
    m = _Attn(backend).eval()
    T = torch.export.Dim("T", min=2, max=4096)
    ep = torch.export.export(m, _inputs(8),
                             dynamic_shapes=({1: T}, {1: T}, {1: T}, {0: 2 * T - 1}, {1: T}))
    for t in (5, 13):
        x = _inputs(t)
        torch.testing.assert_close(ep.module()(*x), m(*x), rtol=0, atol=0)


# --------------------------------------------- torch.export with dynamic batch, length, memory
# Each case is exported once at one shape and run at two shapes not used at export (another
# batch size too); the program must give eager's output bit for bit. Memories are separate
# inputs (their length is a Dim of its own), position tables are computed in the module from
# the lengths (as the models do), so every dim is an independent torch.export.Dim.

import math  # noqa: E402

import torch.nn as nn  # noqa: E402
from torch.export import Dim  # noqa: E402

import txl_kernels as tk  # noqa: E402

F_ = 32  # model width of the drop-in cases
# the op an exported graph calls for each backend (the reference has none: plain aten ops)
FUSED_OPS = {"cpu": "txl_kernels.rel_attn_fwd", "triton": "txl_kernels.rel_attn_fwd"}  # one op


def _backend(request, backend):
    """Skip / build what a backend needs: "cpu" the C++ extension, "triton" the interpreter
    (CPU tensors; tests/conftest.py sets it where there is no GPU)."""
    if backend == "cpu":
        request.getfixturevalue("extension")
    if backend == "triton" and not tk.fused_available(torch.device("cpu"))[0]:
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    return backend


def _dims():
    return (Dim("B", min=1, max=64), Dim("T", min=2, max=4096), Dim("M", min=0, max=4096))


def _call_targets(ep):
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _export_matches_eager(model, make, dynamic_shapes, at, unseen, backend=None, tol=0.0):
    """Export ``model`` on ``make(*at)``; the program calls the backend's fused op (none for
    the reference) and equals eager on ``make(*u)`` for every ``u`` in ``unseen`` (bit for
    bit unless ``tol``). On CPU tensors the program's op runs its CPU kernel (the C++ one)
    where eager ``"triton"`` runs the Triton kernels under the interpreter: fp32 rounding
    apart there."""
    if backend == "triton" and not torch.cuda.is_available():
        tol = max(tol, 1e-5)
    ep = torch.export.export(model, make(*at), dynamic_shapes=dynamic_shapes)
    targets = _call_targets(ep)
    ours = {t for t in targets if "txl_kernels" in t}
    if backend in FUSED_OPS:
        assert any(FUSED_OPS[backend] in t for t in ours), targets
    elif backend == "reference":
        assert not ours, ours
    for u in unseen:
        x = make(*u)
        torch.testing.assert_close(_first(ep.module()(*x)), _first(model(*x)), rtol=tol,
                                   atol=tol, msg=lambda m: f"at {u}: {m}")
    return ep


def _sinusoid(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """A sinusoid table of the (float) positions ``pos``: ``[len(pos), dim]``."""
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(1e4) / dim))
    ang = pos[:, None] * inv
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class _MemAttn(nn.Module):
    """rel_attention over [memory; segment] with key padding and a position table projected
    from the distances ``Lk - 1`` down, as Transformer-XL / Conformer layers compute it."""

    def __init__(self, backend, causal, window, H=2, D=16):
        super().__init__()
        self.backend, self.causal, self.window, self.H, self.D = backend, causal, window, H, D
        self.u = nn.Parameter(torch.randn(H, D))
        self.vb = nn.Parameter(torch.randn(H, D))
        self.r_net = nn.Linear(F_, H * D, bias=False)

    def forward(self, q, k, v, mem_k, mem_v, kpm):
        kpm = torch.cat([kpm.new_zeros(mem_k.shape[:2]), kpm], 1)
        k, v = torch.cat([mem_k, k], 1), torch.cat([mem_v, v], 1)
        lq, lk = q.shape[1], k.shape[1]
        rows = lk if self.causal else lk + lq - 1
        dist = torch.arange(rows, dtype=torch.float32).flip(0) - (rows - lk)
        r = self.r_net(_sinusoid(dist, F_)).view(rows, self.H, self.D)
        return rel_attention(q, k, v, r, self.u, self.vb, causal=self.causal,
                             window_size=self.window, key_padding_mask=kpm,
                             backend=self.backend)


def _mem_inputs(B, T, M, H=2, D=16):
    g = torch.Generator().manual_seed(100 * B + 10 * T + M)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    mk, mv = (torch.randn(B, M, H, D, generator=g) for _ in range(2))
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[-1, T - 2:] = True
    return q, k, v, mk, mv, kpm


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (3, 1))],
                         ids=["causal", "full", "window"])
def test_export_rel_attention_dynamic_batch_length_memory(request, backend, causal, window):
    """rel_attention with memory: dynamic B, T and M (the fused ops' fake implementations
    take the symbolic shapes; the C++ op gets the window as given, which allows the same
    pairs, instead of one clamped to the symbolic lengths, which would pin them)."""
    _backend(request, backend)
    B, T, M = _dims()
    shapes = ({0: B, 1: T}, {0: B, 1: T}, {0: B, 1: T}, {0: B, 1: M}, {0: B, 1: M},
              {0: B, 1: T})
    torch.manual_seed(0)
    m = _MemAttn(backend, causal, window).eval()
    _export_matches_eager(m, _mem_inputs, shapes, (2, 6, 3), [(3, 3, 0), (1, 9, 5)], backend)


# ------------------------------------------------------------------------------ the drop-ins

class _Call(nn.Module):
    """A drop-in and how a model calls it; returns the attention output."""

    def __init__(self, module, call):
        super().__init__()
        self.m, self.call = module, call

    def forward(self, *args):
        return _first(self.call(self.m, *args))


def _hf_config(kind):
    pytest.importorskip("transformers", reason="the HF drop-ins need transformers (hf5 extra)")
    if kind == "parakeet":
        from transformers.models.parakeet.configuration_parakeet import ParakeetEncoderConfig

        return ParakeetEncoderConfig(hidden_size=F_, num_attention_heads=2, intermediate_size=32,
                                     num_hidden_layers=1, attention_dropout=0.0)
    from transformers import Wav2Vec2ConformerConfig

    return Wav2Vec2ConformerConfig(hidden_size=F_, num_attention_heads=2, attention_dropout=0.0,
                                   position_embeddings_type="relative")


def _additive(keep):
    """transformers' eager mask: 0 where attended, finfo.min elsewhere."""
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


def _pos_causal(L, dim=F_):
    """The position embeddings of distances L - 1 .. 0, (L, 1, dim) (Transformer-XL's and
    DI-engine's layout)."""
    return _sinusoid(torch.arange(L - 1, -1, -1, dtype=torch.float32), dim)[:, None]


def _di_call(m, x, mem):
    full, cur = torch.cat([mem, x], 1).transpose(0, 1), x.transpose(0, 1)
    L, T = full.shape[0], cur.shape[0]
    mask = torch.ones(T, L, dtype=torch.bool).triu(1 + L - T)[..., None]
    return m(cur, _pos_causal(L), full, m.u_, m.v_, mask)


def _di_make(backend):
    m = tk.DIEngineAttentionXL(F_, 16, 2, nn.Dropout(0.0), backend=backend)
    m.u_, m.v_ = nn.Parameter(torch.randn(2, 16)), nn.Parameter(torch.randn(2, 16))
    return m


def _txl_call(mask_mode):
    def call(m, x, mem):
        w, mems = x.transpose(0, 1), mem.transpose(0, 1)
        T, L = w.shape[0], w.shape[0] + mems.shape[0]
        mask = torch.ones(T, L, dtype=torch.bool).triu(1 + L - T)
        return m(w, _pos_causal(L), attn_mask=None if mask_mode == "causal" else mask,
                 mems=mems)
    return call


# name -> (factory(backend), call(module, *inputs), "pos" (x, pos_emb, kpm) or "mem" (x, mem))
DROPINS = {
    "nemo": (lambda b: tk.NeMoRelPositionMultiHeadAttention(2, F_, 0.0, backend=b),
             lambda m, x, p, kpm: m(x, x, x, kpm, p), "pos"),
    "nemo_att_context": (
        lambda b: tk.NeMoRelPositionMultiHeadAttention(2, F_, 0.0, att_context_size=[3, 1],
                                                       backend=b),
        lambda m, x, p, kpm: m(x, x, x, None, p, key_padding_mask=kpm), "pos"),
    "espnet": (lambda b: tk.ESPnetRelPositionMultiHeadedAttention(2, F_, 0.0, backend=b),
               lambda m, x, p, kpm: m(x, x, x, p, ~kpm[:, None, :]), "pos"),
    # distinct query / key / value objects: icefall compares their values (torch.equal)
    "icefall": (lambda b: tk.IcefallRelPositionMultiheadAttention(F_, 2, backend=b),
                lambda m, x, p, kpm: m(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1),
                                       p, key_padding_mask=kpm), "pos"),
    "speechbrain": (lambda b: tk.SpeechBrainRelPosMHAXL(F_, 2, backend=b),
                    lambda m, x, p, kpm: m(x, x, x, p, key_padding_mask=kpm), "pos"),
    # SpeechBrain's get_lookahead_mask: a float 0 / -inf mask (checked in the program)
    "speechbrain_float_mask": (
        lambda b: tk.SpeechBrainRelPosMHAXL(F_, 2, backend=b),
        lambda m, x, p, kpm: m(x, x, x, p, key_padding_mask=kpm, attn_mask=torch.zeros(
            x.shape[1], x.shape[1]).masked_fill(
                torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1), -math.inf)),
        "pos"),
    "parakeet": (lambda b: tk.ParakeetEncoderAttention(_hf_config("parakeet"), 0, backend=b),
                 lambda m, x, p, kpm: m(x, p, ~kpm), "pos"),
    # the (B, 2T - 1, F) table of Parakeet's encoder: one copy per sequence, made contiguous
    "parakeet_batch_table": (
        lambda b: tk.ParakeetEncoderAttention(_hf_config("parakeet"), 0, backend=b),
        lambda m, x, p, kpm: m(x, p.expand(x.shape[0], -1, -1).contiguous(), ~kpm), "pos"),
    "wav2vec2_conformer": (
        lambda b: tk.Wav2Vec2ConformerSelfAttention(_hf_config("w2v"), backend=b),
        lambda m, x, p, kpm: m(x, (~kpm)[:, None, None, :].expand(-1, 1, x.shape[1], -1),
                               relative_position_embeddings=p), "pos"),
    # the eager attention interface's additive float mask (its values checked in the program)
    "wav2vec2_conformer_float_mask": (
        lambda b: tk.Wav2Vec2ConformerSelfAttention(_hf_config("w2v"), backend=b),
        lambda m, x, p, kpm: m(x, _additive((~kpm)[:, None, None, :].expand(
            -1, 1, x.shape[1], -1)), relative_position_embeddings=p), "pos"),
    "fastspeech2": (  # its config: any object with hidden_size (no transformers needed)
        lambda b: tk.FastSpeech2ConformerAttention(
            type("Cfg", (), {"hidden_size": F_})(),
            {"num_attention_heads": 2, "attention_dropout_rate": 0.0}, backend=b),
        lambda m, x, p, kpm: m(x, (~kpm).float()[:, None, :], p), "pos"),
    "rllib": (lambda b: tk.RLlibRelativeMultiHeadAttention(F_, F_, 2, 16, backend=b),
              lambda m, x, mem: m(x, mem), "mem"),
    "diengine": (_di_make, _di_call, "mem"),
    "transformer_xl": (lambda b: tk.FusedRelAttention(2, F_, 16, 0.0, untie_r=True, backend=b),
                       _txl_call("detect"), "mem"),
    "transformer_xl_causal": (
        lambda b: tk.FusedRelAttention(2, F_, 16, 0.0, untie_r=True, mask_mode="causal",
                                       same_length=True, mem_len=3, backend=b),
        _txl_call("causal"), "mem"),
}


def _dropin_inputs(kind):
    def make(B, T, M):
        g = torch.Generator().manual_seed(100 * B + 10 * T + M)
        x = torch.randn(B, T, F_, generator=g)
        if kind == "mem":
            return x, torch.randn(B, M, F_, generator=g)
        kpm = torch.zeros(B, T, dtype=torch.bool)
        kpm[-1, T - 2:] = True
        return x, torch.randn(1, 2 * T - 1, F_, generator=g), kpm
    return make


def _dropin(name, backend):
    make, call, kind = DROPINS[name]
    torch.manual_seed(0)
    m = _Call(make(backend), call).eval()
    with torch.no_grad():  # non-zero biases everywhere
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m, kind


@pytest.mark.parametrize("backend", ["cpu"])  # the reference: the functional test above
@pytest.mark.parametrize("name", list(DROPINS))
def test_export_dropins_dynamic(request, name, backend):
    """Every drop-in, as its framework calls it, exports with dynamic batch and length (and
    memory length for the Transformer-XL ones) and equals eager at two other shapes.
    Regressions: icefall's torch.equal of distinct inputs, the float masks' value checks
    (SpeechBrain, Wav2Vec2-Conformer) and DI-engine's causality check read tensor values
    while tracing (now checks in the program); Parakeet's per-sequence tables and NeMo's
    att_context_size window raised guards on B / T."""
    _backend(request, backend)
    m, kind = _dropin(name, backend)
    B, T, M = _dims()
    M = Dim("M", min=1, max=4096)
    shapes = ((({0: B, 1: T}, {1: 2 * T - 1}, {0: B, 1: T}) if kind == "pos"
               else ({0: B, 1: T}, {0: B, 1: M})),)
    # one table per sequence: eager attends sequence by sequence, the program (a dynamic
    # batch) the whole batch with the first table (checked equal): the same sums, blocked
    # differently. A window: eager projects only the table rows it reads, the program every
    # row (the same dot products in a GEMM of another size)
    tol = 1e-6 if name in ("parakeet_batch_table", "nemo_att_context") else 0.0
    _export_matches_eager(m, _dropin_inputs(kind), shapes, (2, 6, 3), [(3, 3, 2), (1, 9, 4)],
                          backend, tol)


def test_export_dropin_triton_op_on_fake_tensors(request):
    """backend="triton": the Triton custom op is in the exported graph (traced on fake
    tensors through its fake implementation, symbolic shapes included) and runs (here under
    the interpreter) with eager's output at other shapes."""
    _backend(request, "triton")
    m, kind = _dropin("nemo", "triton")
    B, T, _ = _dims()
    _export_matches_eager(m, _dropin_inputs(kind), (({0: B, 1: T}, {1: 2 * T - 1},
                                                     {0: B, 1: T}),),
                          (2, 6, 3), [(3, 3, 0), (1, 9, 0)], "triton")


def _value_check_case(name):
    """(module, dynamic shapes, inputs at export, inputs that fail the check, message)."""
    B, T, _ = _dims()
    make = _dropin_inputs("pos")
    if name == "diengine":
        def call(m, x, mem, future):  # future: True where a query may see a later key
            full, cur = torch.cat([mem, x], 1).transpose(0, 1), x.transpose(0, 1)
            L, n = full.shape[0], cur.shape[0]
            mask = torch.ones(n, L, dtype=torch.bool).triu(1 + L - n) & ~future[:, None]
            return m(cur, _pos_causal(L), full, m.u_, m.v_, mask[..., None])

        M = Dim("M", min=1, max=4096)
        shapes = ({0: B, 1: T}, {0: B, 1: M}, {0: T})
        x, mem = _dropin_inputs("mem")(2, 6, 3)
        good = (x, mem, torch.zeros(6, dtype=torch.bool))
        x, mem = _dropin_inputs("mem")(3, 5, 2)
        future = torch.zeros(5, dtype=torch.bool)
        future[1] = True
        return (_di_make("reference"), call, shapes, good, (x, mem, future),
                "lets queries attend keys after them")
    if name == "parakeet_tables":
        def call(m, x, tables, kpm):  # tables: (B, 2T - 1, F), one per sequence
            return m(x, tables, ~kpm)

        x, p, kpm = make(2, 6, 0)
        good = (x, p.expand(2, -1, -1).contiguous(), kpm)
        x, p, kpm = make(3, 5, 0)
        bad = p.expand(3, -1, -1).clone()
        bad[1, 0, 0] += 1.0  # another table for the second sequence
        return (tk.ParakeetEncoderAttention(_hf_config("parakeet"), 0, backend="reference"),
                call, ({0: B, 1: T}, {0: B, 1: 2 * T - 1}, {0: B, 1: T}), good, (x, bad, kpm),
                "every sequence's position table")

    def call(m, x, p, mask):  # mask: transformers' additive (B, T) key mask
        return m(x, mask[:, None, None, :].expand(-1, 1, x.shape[1], -1),
                 relative_position_embeddings=p)

    x, p, kpm = make(2, 6, 0)
    good = (x, p, _additive(~kpm))
    x, p, kpm = make(3, 5, 0)
    bad = _additive(~kpm)
    bad[0, 0] = -0.5  # an additive value other than 0 / finfo.min
    return (tk.Wav2Vec2ConformerSelfAttention(_hf_config("w2v"), backend="reference"), call,
            ({0: B, 1: T}, {1: 2 * T - 1}, {0: B, 1: T}), good, (x, p, bad),
            "float attention_mask must hold only 0")


@pytest.mark.parametrize("name", ["wav2vec2_conformer_float_mask", "diengine"])
def test_export_value_checks_run_in_the_program(name):
    """The checks of tensor values that eager mode makes on the host are in the exported
    program: inputs that fail them raise when it runs, with eager's message (eager raises
    ValueError)."""
    module, call, shapes, good, bad, match = _value_check_case(name)
    m = _Call(module, call).eval()
    ep = torch.export.export(m, good, dynamic_shapes=(shapes,))
    with pytest.raises(RuntimeError, match=match):
        ep.module()(*bad)
    with pytest.raises(ValueError, match=match):
        m(*bad)


def test_export_per_sequence_tables_with_a_dynamic_batch():
    """One position table per sequence (HF Parakeet's (B, 2T - 1, F)) under a dynamic
    batch: the program folds the batch into the heads (one call, where eager loops over the
    sequences), so distinct tables per sequence give eager's output at another batch size."""
    module, call, shapes, good, distinct, _ = _value_check_case("parakeet_tables")
    m = _Call(module, call).eval()
    ep = torch.export.export(m, good, dynamic_shapes=(shapes,))
    torch.testing.assert_close(ep.module()(*distinct), m(*distinct), rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------- models after the swap, the LM

class _NeMoLayer(nn.Module):
    """A Conformer-shaped layer (NeMo's order, convolution left out) around the transcribed
    NeMo attention (claiming NeMo's class path, so swap_rel_pos_attention replaces it)."""

    def __init__(self, d, h):
        super().__init__()
        from test_dropins_swap import NeMoFake

        self.norm_ff1, self.norm_att, self.norm_ff2 = (nn.LayerNorm(d) for _ in range(3))
        self.ff1, self.ff2 = (nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))
                              for _ in range(2))
        self.self_attn = NeMoFake(h, d, 0.0, None, None)
        with torch.no_grad():
            self.self_attn.pos_bias_u.normal_(0.0, 0.5)
            self.self_attn.pos_bias_v.normal_(0.0, 0.5)

    def forward(self, x, att_mask, pos_emb):
        x = x + 0.5 * self.ff1(self.norm_ff1(x))
        y = self.norm_att(x)
        x = x + self.self_attn(y, y, y, att_mask, pos_emb)
        return x + 0.5 * self.ff2(self.norm_ff2(x))


class NeMoEncoder(nn.Module):
    """A small NeMo-shaped encoder: features [B, T, d] and lengths [B] in; its relative
    position table (distances T - 1 .. -(T - 1)) and NeMo's dense (B, T, T) padding mask are
    computed from T, so the time axis is free."""

    def __init__(self, d=32, h=2, n_layers=2):
        super().__init__()
        self.d = d
        self.layers = nn.ModuleList(_NeMoLayer(d, h) for _ in range(n_layers))

    def forward(self, x, lengths):
        T = x.shape[1]
        pos_emb = _sinusoid(torch.arange(T - 1, -T, -1, dtype=torch.float32), self.d)[None]
        pad = torch.arange(T)[None, :] >= lengths[:, None]
        att_mask = pad[:, None, :] | pad[:, :, None]
        for layer in self.layers:
            x = layer(x, att_mask, pos_emb)
        return x.masked_fill(pad[..., None], 0.0)


def nemo_encoder_inputs(B, T, M=0, d=32):
    g = torch.Generator().manual_seed(10 * B + T)
    return torch.randn(B, T, d, generator=g), T - torch.arange(B) % 3


def swapped_nemo_encoder(backend):
    torch.manual_seed(0)
    enc = NeMoEncoder().eval()
    assert tk.swap_rel_pos_attention(enc, backend=backend) == 2
    return enc


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_export_swapped_nemo_encoder(request, backend):
    """A NeMo-shaped encoder after swap_rel_pos_attention: dynamic batch and time."""
    _backend(request, backend)
    B, T, _ = _dims()
    _export_matches_eager(swapped_nemo_encoder(backend), nemo_encoder_inputs,
                          ({0: B, 1: T}, {0: B}), (2, 12), [(3, 7), (1, 20)], backend)


class _HFEncoder(nn.Module):
    """An HF model's encoder after the swap, returning its last hidden state."""

    def __init__(self, kind):
        super().__init__()
        from test_dropins_hf_models import fs2_config, parakeet_config, w2v_config
        from transformers import (FastSpeech2ConformerModel, ParakeetForCTC,
                                  Wav2Vec2ConformerModel)

        self.kind = kind
        torch.manual_seed(0)
        if kind == "parakeet":
            self.enc = ParakeetForCTC(parakeet_config()).encoder
        elif kind == "wav2vec2_conformer":
            self.enc = Wav2Vec2ConformerModel(w2v_config())
        else:
            self.enc = FastSpeech2ConformerModel(fs2_config()).encoder
        self.eval()
        with torch.no_grad():  # the position biases are zero-initialised: make them count
            for n, p in self.named_parameters():
                if n.rsplit(".", 1)[-1] in ("bias_u", "bias_v", "pos_bias_u", "pos_bias_v"):
                    p.normal_(0.0, 0.5)

    def forward(self, x, mask):
        if self.kind == "fastspeech2":
            return self.enc(x, attention_mask=mask)[0]
        return self.enc(x, attention_mask=mask).last_hidden_state


def _hf_inputs(kind):
    def make(B, T, M=0):
        g = torch.Generator().manual_seed(10 * B + T)
        valid = T - torch.arange(B)[:, None] * (T // 6)
        if kind == "fastspeech2":  # token ids, FastSpeech2's float (B, 1, T) mask of 1 / 0
            mask = (torch.arange(T)[None] < valid).float()[:, None, :]
            return torch.randint(1, 20, (B, T), generator=g), mask
        if kind == "parakeet":  # mel features, a bool frame mask
            return torch.randn(B, T, 16, generator=g), torch.arange(T)[None] < valid
        return torch.randn(B, T, generator=g), (torch.arange(T)[None] < valid).long()  # audio
    return make


# kind -> (export shape (B, T), two unseen shapes, the time Dim's stride)
HF_MODELS = {"parakeet": ((2, 40), [(3, 48), (1, 64)], 4),
             "wav2vec2_conformer": ((2, 400), [(3, 480), (1, 640)], 8),
             "fastspeech2": ((2, 12), [(3, 9), (1, 17)], 1)}


@pytest.mark.slow  # about 10 s each
@pytest.mark.parametrize("kind", list(HF_MODELS))
def test_export_swapped_hf_encoders(request, kind):
    """HF Parakeet / Wav2Vec2-Conformer / FastSpeech2 encoders (transformers 5, small random
    configs) after the swap, with the C++ kernel: dynamic batch and time, their own masks."""
    pytest.importorskip("transformers", reason="the HF models need transformers (hf5 extra)")
    _backend(request, "cpu")
    enc = _HFEncoder(kind)
    assert tk.swap_rel_pos_attention(enc, backend="cpu") in (2, 3)
    at, unseen, stride = HF_MODELS[kind]
    B = Dim("B", min=1, max=64)
    T = Dim("T", min=8, max=4096) if stride == 1 else stride * Dim("Ts", min=2, max=1024)
    mask_axis = 2 if kind == "fastspeech2" else 1
    _export_matches_eager(enc, _hf_inputs(kind), ({0: B, 1: T}, {0: B, mask_axis: T}), at,
                          unseen, "cpu")


def _lm(backend, **kw):
    from txl_kernels.models import MemTransformerLM

    torch.manual_seed(0)
    return MemTransformerLM(40, 2, 2, 16, 8, 32, 0.0, 0.0, tgt_len=4, mem_len=6,
                            attn_backend=backend, **kw).eval()


def _lm_inputs(B, T, M):
    g = torch.Generator().manual_seed(100 * B + 10 * T + M)
    data, target = (torch.randint(0, 40, (T, B), generator=g) for _ in range(2))
    return data, target, *(torch.randn(M, B, 16, generator=g) for _ in range(3))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_export_lm_segment_with_mems(request, backend):
    """MemTransformerLM.forward(data, target, *mems): dynamic batch, segment and memory
    lengths; the loss and the new memories (the C++ update_mems op in the graph) equal
    eager's. Regression: the token-id range check read the ids on the host (int()) while
    tracing; it is a check in the program now."""
    request.getfixturevalue("extension")  # update_mems
    _backend(request, backend)
    model = _lm(backend)
    B, M = Dim("B", min=1, max=64), Dim("M", min=1, max=4096)
    T = Dim("T", min=1, max=4096)
    shapes = ({0: T, 1: B}, {0: T, 1: B}, tuple({0: M, 1: B} for _ in range(3)))
    ep = torch.export.export(model, _lm_inputs(2, 4, 6), dynamic_shapes=shapes)
    assert any("txl_kernels.update_mems" in t for t in _call_targets(ep))
    for u in [(3, 5, 6), (1, 7, 3)]:
        x = _lm_inputs(*u)
        for got, want in zip(ep.module()(*x), model(*x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    bad = list(_lm_inputs(3, 5, 6))
    bad[0][0, 0] = 40  # outside the vocabulary: checked in the program
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        ep.module()(*bad)


def test_export_lm_decode_step(request):
    """The decoding step (one token against the memories, the mems path with data [1, bsz]):
    dynamic batch and memory length, equal to eager step after step (the memories the
    program returns fed back, growing to mem_len)."""
    _backend(request, "cpu")
    model = _lm("cpu")
    B, M = Dim("B", min=1, max=64), Dim("M", min=1, max=4096)

    class Step(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, tok, *mems):
            logp, *new = self.lm.log_probs(tok, *mems)
            return logp, *new

    step = Step(model).eval()
    tok = torch.randint(0, 40, (1, 2))
    mems = [torch.randn(3, 2, 16) for _ in range(3)]
    ep = torch.export.export(step, (tok, *mems),
                             dynamic_shapes=({1: B}, tuple({0: M, 1: B} for _ in range(3))))
    for bsz in (3, 1):
        g = torch.Generator().manual_seed(bsz)
        tok = torch.randint(0, 40, (1, bsz), generator=g)
        mems = [torch.randn(2, bsz, 16, generator=g) for _ in range(3)]
        for _ in range(6):  # the memory grows 2 -> 6 rows, then slides
            got, want = ep.module()(tok, *mems), step(tok, *mems)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            mems = list(got[1:])
            tok = got[0][-1].argmax(-1)[None]
        assert mems[0].shape[0] == 6


# -------------------------------------------------- features that cannot go through export

def test_export_dropout_in_training_is_a_random_op(request):
    """dropout_p > 0 (a drop-in in training mode) exports on every backend: the keep-mask's
    seed (fused ops) or the dropout (reference) is drawn in the program from PyTorch's
    default generator, so under one torch.manual_seed the program equals eager."""
    backends = ["reference", "cpu"] + (["triton"] if tk.fused_available(
        torch.device("cpu"))[0] else [])
    request.getfixturevalue("extension")
    B, T, _ = _dims()
    for backend in backends:
        torch.manual_seed(0)
        m = _Call(tk.NeMoRelPositionMultiHeadAttention(2, F_, 0.3, backend=backend),
                  lambda m, x, p: m(x, x, x, None, p)).train()
        make = lambda B, T, M=0: _dropin_inputs("pos")(B, T, M)[:2]  # noqa: E731
        ep = torch.export.export(m, make(2, 6),
                                 dynamic_shapes=(({0: B, 1: T}, {1: 2 * T - 1}),))
        x = make(3, 5)
        outs = []
        for fn, seed in ((ep.module(), 5), (m, 5), (m, 6)):
            torch.manual_seed(seed)
            outs.append(fn(*x))
        # on CPU tensors the program's op runs the C++ kernel, eager "triton" the Triton
        # kernels under the interpreter (the same keep-mask): fp32 rounding apart
        tol = 1e-5 if backend == "triton" and not torch.cuda.is_available() else 0.0
        torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
        assert not torch.equal(outs[1], outs[2])  # it does drop


class _QuantMemAttn(_MemAttn):
    """_MemAttn with its memory as an 8-bit QuantizedKV input."""

    def forward(self, q, k, v, mem_k, mem_k_scale, mem_v, mem_v_scale):
        # four tensors, not a QuantizedKV input: torch 2.14's ExportedProgram.module() writes
        # its input guards for a named tuple with fields k and k_scale as invalid Python
        memory = tk.QuantizedKV(mem_k, mem_k_scale, mem_v, mem_v_scale)
        lk = memory.k.shape[1] + k.shape[1]
        dist = torch.arange(lk, dtype=torch.float32).flip(0)
        r = self.r_net(_sinusoid(dist, F_)).view(lk, self.H, self.D)
        return rel_attention(q, k, v, r, self.u, self.vb, causal=True, memory=memory,
                             backend=self.backend)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_export_8bit_memory(request, backend):
    """An 8-bit memory (QuantizedKV, int8 with per-(token, head) scales) as an input of the
    program, with a dynamic memory length: the fused ops read it (forward only: inference),
    the reference dequantises it, as in eager."""
    _backend(request, backend)
    torch.manual_seed(0)
    m = _QuantMemAttn(backend, True, (-1, -1)).eval()
    B, T, _ = _dims()
    M = Dim("M", min=1, max=4096)

    def make(b, t, mm):
        q, k, v, mk, mv, _ = _mem_inputs(b, t, mm)
        return q, k, v, *tk.quantize_kv(mk, mv, torch.int8)

    qkv, mem = {0: B, 1: T}, {0: B, 1: M}
    with torch.no_grad():
        _export_matches_eager(m, make, (qkv, qkv, qkv, mem, mem, mem, mem),
                              (2, 4, 3), [(3, 5, 2), (1, 3, 6)], backend)


def test_export_refuses_context_parallelism_and_the_kv_cache():
    """What cannot go through torch.export / AOTInductor says so, naming the feature and the
    route, instead of an exporter error from inside: context parallelism (the functional op,
    a drop-in with cp_group, the LM with cp_group: the ring and the global lengths are
    decided at run time by torch.distributed) and the LM's K/V cache (Python state updated
    in place). Checked before any process group is used."""
    from txl_kernels.distributed import context_parallel_rel_attention

    class CP(nn.Module):
        def forward(self, q, k, v, r, u, vb):
            return context_parallel_rel_attention(q, k, v, r, u, vb, causal=True)

    q, k, v, *_ = _mem_inputs(2, 4, 0)
    r, u, vb = torch.randn(4, 2, 16), torch.randn(2, 16), torch.randn(2, 16)
    cases = [(CP(), (q, k, v, r, u, vb), "context_parallel_rel_attention")]
    nemo = tk.NeMoRelPositionMultiHeadAttention(2, F_, 0.0, backend="reference").eval()
    nemo.cp_group = object()  # never used: export stops first
    cases.append((_Call(nemo, lambda m, x, p: m(x, x, x, None, p)),
                  _dropin_inputs("pos")(2, 6, 0)[:2], "NeMoRelPositionMultiHeadAttention"))
    lm = _lm("reference")
    lm.cp_group = object()
    cases.append((lm, _lm_inputs(2, 4, 3), "MemTransformerLM"))
    for model, args, who in cases:
        with pytest.raises(tk.ExportUnsupported,
                           match=f"{who}: context parallelism .* cannot be recorded by "
                                 f"torch.export"):
            torch.export.export(model, args)

    lm = _lm("reference")
    cache = lm.new_cache(2)

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, data, target):
            return self.lm(data, target, cache=cache)[0]

    with pytest.raises(tk.ExportUnsupported, match="MemTransformerLM: the K/V cache .* cannot "
                                                   "be recorded by torch.export"):
        torch.export.export(Cached(), _lm_inputs(2, 1, 0)[:2])


@pytest.mark.parametrize("global_tokens", [0, 1])
def test_export_nemo_longformer_dynamic(request, global_tokens):
    """NeMo's local attention drop-in (band with the left + right + 1 row table, global
    tokens joined in one softmax) exports with dynamic batch and length on the CPU kernel
    and equals eager at other shapes."""
    _backend(request, "cpu")
    torch.manual_seed(0)
    lf = tk.NeMoRelPositionMultiHeadAttentionLongformer(
        2, F_, 0.0, None, None, att_context_size=[3, 2], global_tokens=global_tokens,
        backend="cpu")
    m = _Call(lf, lambda m, x, p, kpm: m(x, x, x, kpm, p)).eval()

    def make(B, T, _):
        g = torch.Generator().manual_seed(10 * B + T)
        kpm = torch.zeros(B, T, dtype=torch.bool)
        kpm[-1, T - 2:] = True
        return torch.randn(B, T, F_, generator=g), torch.randn(1, 6, F_, generator=g), kpm

    B, T, _ = _dims()
    _export_matches_eager(m, make, (({0: B, 1: T}, None, {0: B, 1: T}),), (2, 11, 0),
                          [(3, 5, 0), (1, 17, 0)], "cpu")
