"""TorchScript routes (docs/dropins.md, TorchScript): ``torch.jit.trace`` of ``rel_attention``
on every backend and of every drop-in, ``torch.jit.script`` of the drop-ins whose originals
script (icefall's, DI-engine's), save / load in this process and in a fresh one, and the clear
errors of what the routes cannot record."""
import contextlib
import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from txl_kernels import FusedRelAttention, quantize_kv, rel_attention
from txl_kernels.distributed import context_parallel_rel_attention
from txl_kernels._export import ExportUnsupported
from txl_kernels._op import _TritonInterpreter
from txl_kernels.modules import (DIEngineAttentionXL, ESPnetRelPositionMultiHeadedAttention,
                                 IcefallRelPositionMultiheadAttention,
                                 NeMoRelPositionMultiHeadAttention,
                                 RLlibRelativeMultiHeadAttention, SpeechBrainRelPosMHAXL)

import originals_gtrxl as og
import originals_icefall as orig_ice
from helpers import FUSED_DEVICE, INTERPRET
from test_conformer import nemo_rel_pos_emb, rnd

E, H = 32, 2  # head dim 16: the Triton kernel's smallest


def _lengths(B, T):
    """Valid frames per sequence: the first full, the others padded."""
    return torch.tensor([T, T - 2, 3][:B])


def _padding(B, T):
    """bool [B, T], True = padded."""
    return torch.arange(T)[None] >= _lengths(B, T)[:, None]


def graph_kernels(backend, device):
    """Where a graph's op runs the kernels eager ``backend`` runs: on CPU tensors eager
    "triton" (and "auto" under the interpreter) runs the Triton kernels under the interpreter,
    a recorded op its CPU key (the C++ kernel) unless the interpreter's dispatch mode is on."""
    if backend in ("triton", "auto") and INTERPRET and torch.device(device).type == "cpu":
        return _TritonInterpreter()
    return contextlib.nullcontext()


def assert_trace_follows_lengths(module, inputs, trace_len=8, other_lens=(5, 13),
                                 backend=None, device="cpu"):
    """Trace ``module`` on ``inputs(trace_len)``; at the other lengths the traced module's
    outputs equal eager's bit for bit (no length, mask or position row count was baked in),
    the graph run on eager ``backend``'s kernels (:func:`graph_kernels`)."""
    module.eval()
    with torch.no_grad():
        traced = torch.jit.trace(module, inputs(trace_len), check_trace=False)
        for t in other_lens:
            x = inputs(t)
            with graph_kernels(backend, device):
                got = traced(*x)
            torch.testing.assert_close(got, module(*x), rtol=0, atol=0)
    return traced


class _First(nn.Module):
    """The first output of a module that returns ``(out, None)`` (torch.jit.trace records
    tensors only), as a model using it would."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)[0]


# ------------------------------------------------------------------------------ rel_attention
class _Attn(nn.Module):
    def __init__(self, backend, H=2, D=16, dropout_p=0.0):
        super().__init__()
        self.backend, self.dropout_p = backend, dropout_p
        self.u = nn.Parameter(torch.randn(H, D))
        self.vb = nn.Parameter(torch.randn(H, D))

    def forward(self, q, k, v, r, kpm):
        return rel_attention(q, k, v, r, self.u, self.vb, causal=False, key_padding_mask=kpm,
                             dropout_p=self.dropout_p if self.training else 0.0,
                             backend=self.backend)


def _attn_inputs(T, B=2, H=2, D=16, device="cpu"):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    r = torch.randn(2 * T - 1, H, D, generator=g)
    return tuple(t.to(device) for t in (q, k, v, r, _padding(B, T)))


def _device_for(backend, request):
    """The device a backend's test runs on: the fused Triton kernel's (the GPU, or CPU tensors
    under the interpreter) for "triton" and "auto"; CPU, with the extension built, for
    "cpu"."""
    if backend == "cpu":
        request.getfixturevalue("extension")
        return "cpu"
    if backend == "triton" and FUSED_DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the Triton kernel needs a GPU or TRITON_INTERPRET=1")
    return FUSED_DEVICE if backend in ("triton", "auto") else "cpu"


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton", "auto"])
def test_jit_trace_rel_attention_runs_other_lengths(backend, request):
    """torch.jit.trace records no ``bool | Tensor`` (an op TorchScript does not have), and the
    traced shapes follow the input's length, on every backend ("triton" and "auto" run the
    Triton kernel under the interpreter here, or on the GPU)."""
    device = _device_for(backend, request)
    assert_trace_follows_lengths(_Attn(backend).to(device),
                                 functools.partial(_attn_inputs, device=device),
                                 backend=backend, device=device)


FUSED_OP = "txl_kernels::rel_attn_fwd"  # the one op, whichever kernel runs it


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_jit_trace_records_the_op_and_saves(backend, request, tmp_path):
    """A traced fused call is the registered op (a graph node torch.jit.save writes), not an
    autograd.Function (a Python op that torch.jit.save refuses); the loaded module gives the
    eager outputs at other lengths."""
    device = _device_for(backend, request)
    inputs = functools.partial(_attn_inputs, device=device)
    m = _Attn(backend).to(device)
    traced = assert_trace_follows_lengths(m, inputs, backend=backend, device=device)
    kinds = {n.kind() for n in traced.graph.nodes()}
    assert "prim::PythonOp" not in kinds
    if backend != "reference":
        assert FUSED_OP in kinds
    path = tmp_path / "attn.pt"
    torch.jit.save(traced, str(path))
    loaded = torch.jit.load(str(path))
    with torch.no_grad():
        for t in (5, 13):
            x = inputs(t)
            with graph_kernels(backend, device):
                got = loaded(*x)
            torch.testing.assert_close(got, m(*x), rtol=0, atol=0)


# ----------------------------------------------------------------------------------- drop-ins
BACKENDS = ["reference", "cpu"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "cpu":
        request.getfixturevalue("extension")
    return request.param


def test_jit_trace_nemo(backend):
    torch.manual_seed(0)
    m = NeMoRelPositionMultiHeadAttention(H, E, 0.0, backend=backend)
    with torch.no_grad():
        m.pos_bias_u.normal_(0.0, 0.5)
        m.pos_bias_v.normal_(0.0, 0.5)

    def inputs(T, B=3):
        x = rnd(B, T, E, seed=T)
        return x, x, x, _padding(B, T), nemo_rel_pos_emb(E, T)  # (B, K) mask: NeMo's encoder

    assert_trace_follows_lengths(m, inputs)


@pytest.mark.parametrize("global_tokens", [0, 1])
def test_jit_trace_nemo_longformer(backend, global_tokens):
    """NeMo's local attention drop-in (the left + right + 1 row table, global tokens)."""
    from txl_kernels import NeMoRelPositionMultiHeadAttentionLongformer

    torch.manual_seed(0)
    m = NeMoRelPositionMultiHeadAttentionLongformer(H, E, 0.0, None, None,
                                                    att_context_size=[3, 2],
                                                    global_tokens=global_tokens,
                                                    backend=backend)

    def inputs(T, B=3):
        x = rnd(B, T, E, seed=T)
        return x, x, x, _padding(B, T), rnd(1, 6, E, seed=T + 1)

    assert_trace_follows_lengths(m, inputs)


def test_jit_trace_keeps_a_window_longer_than_the_traced_length(backend):
    """NeMo's limited context (att_context_size, a window) traced at a length shorter than the
    window: the recorded window is not clamped to that length, so longer inputs keep it."""
    torch.manual_seed(0)
    m = NeMoRelPositionMultiHeadAttention(H, E, 0.0, att_context_size=[10, 2], backend=backend)

    def inputs(T, B=3):
        x = rnd(B, T, E, seed=T)
        return x, x, x, _padding(B, T), nemo_rel_pos_emb(E, T)

    assert_trace_follows_lengths(m, inputs, trace_len=6, other_lens=(4, 13, 17))


def test_jit_trace_espnet(backend):
    torch.manual_seed(0)
    m = ESPnetRelPositionMultiHeadedAttention(H, E, 0.0, backend=backend)

    def inputs(T, B=3):
        x = rnd(B, T, E, seed=T)
        return x, x, x, nemo_rel_pos_emb(E, T), ~_padding(B, T)[:, None]  # True = keep

    assert_trace_follows_lengths(m, inputs)


def _icefall_pair(backend, seed=0):
    """icefall's original (the transcription) and our drop-in with its state dict: non-trivial
    biases and log-scales."""
    torch.manual_seed(seed)
    orig = orig_ice.RelPositionMultiheadAttention(E, H).eval()
    with torch.no_grad():
        for p in (orig.pos_bias_u, orig.pos_bias_v):
            p.normal_(0.0, 0.5)
        orig.pos_bias_u_scale.fill_(0.3)
        orig.pos_bias_v_scale.fill_(-0.2)
        orig.in_proj.bias.normal_(0.0, 0.1)
        orig.out_proj.bias.normal_(0.0, 0.1)
    ours = IcefallRelPositionMultiheadAttention(E, H, backend=backend).eval()
    ours.load_state_dict(orig.state_dict(), strict=True)
    return orig, ours


def _icefall_pos_emb(T, left_context=0):
    return orig_ice.RelPositionalEncoding(E, 0.0)(torch.zeros(1, T, E), left_context)[1]


def test_jit_trace_icefall(backend):
    m = _First(_icefall_pair(backend)[1])

    def inputs(T, B=3):
        x = rnd(T, B, E, seed=T)
        return x, x, x, _icefall_pos_emb(T), _padding(B, T)

    assert_trace_follows_lengths(m, inputs)


def test_jit_trace_speechbrain(backend):
    torch.manual_seed(0)
    import originals_speechbrain as sb

    m = _First(SpeechBrainRelPosMHAXL(E, H, backend=backend))

    def inputs(T, B=3):
        x = rnd(B, T, E, seed=T)
        return x, x, x, sb.RelPosEncXL(E)(torch.zeros(1, T, E)), _padding(B, T)

    assert_trace_follows_lengths(m, inputs)


def test_jit_trace_rllib(backend):
    torch.manual_seed(0)
    m = RLlibRelativeMultiHeadAttention(E, E, H, 16, input_layernorm=True, backend=backend)

    def inputs(T, B=3):
        return rnd(B, T, E, seed=T), rnd(B, T // 2 + 1, E, seed=T + 1)  # inputs, memory

    assert_trace_follows_lengths(m, inputs)


def test_jit_trace_di_engine(backend):
    torch.manual_seed(0)
    m = DIEngineAttentionXL(E, 16, H, nn.Dropout(0.0), backend=backend)

    def inputs(T, B=3):
        prev = T // 2 + 1
        mask, pos_ips = og.gtrxl_mask_and_positions(T, prev)
        full = rnd(T + prev, B, E, seed=T)
        return (full[prev:], og.PositionalEmbedding(E)(pos_ips), full, rnd(H, 16, seed=1),
                rnd(H, 16, seed=2), mask)

    assert_trace_follows_lengths(m, inputs)


@pytest.mark.parametrize("same_length", [False, True])
def test_jit_trace_transformer_xl(backend, same_length):
    """FusedRelAttention with memory and MemTransformerLM's masks: causal and same_length (a
    band found on the device)."""
    from txl_original import PositionalEmbedding, dec_attn_mask

    torch.manual_seed(0)
    m = FusedRelAttention(H, E, 16, 0.0, mem_len=6, backend=backend)

    def inputs(T, B=3):
        mlen = T // 2 + 1
        pos = PositionalEmbedding(E)(torch.arange(T + mlen - 1, -1, -1.0))
        mask = dec_attn_mask(T, mlen, "cpu", same_length=same_length, mem_len=6).bool()
        return (rnd(T, B, E, seed=T), pos, rnd(H, 16, seed=1), rnd(H, 16, seed=2), mask,
                rnd(mlen, B, E, seed=T + 1))

    assert_trace_follows_lengths(m, inputs)


# -------------------------------------------------------------------- transformers drop-ins
@pytest.fixture
def hf_modules():
    pytest.importorskip("transformers", minversion="5.0",
                        reason="transformers >= 5 is not installed (pip install "
                               "'txl_kernels[hf5]')")
    from transformers.models.fastspeech2_conformer import modeling_fastspeech2_conformer
    from transformers.models.parakeet import modeling_parakeet
    from transformers.models.wav2vec2_conformer import modeling_wav2vec2_conformer
    return modeling_parakeet, modeling_wav2vec2_conformer, modeling_fastspeech2_conformer


def _hf_first(module, bias_names):
    torch.manual_seed(0)
    with torch.no_grad():
        for name in bias_names:
            getattr(module, name).normal_(0.0, 0.5)
    return _First(module)


def test_jit_trace_parakeet(backend, hf_modules):
    from txl_kernels.modules import ParakeetEncoderAttention

    pk = hf_modules[0]
    cfg = pk.ParakeetEncoderConfig(hidden_size=E, num_attention_heads=H, intermediate_size=32,
                                   num_hidden_layers=1, attention_dropout=0.0)
    m = _hf_first(ParakeetEncoderAttention(cfg, 0, backend=backend), ("bias_u", "bias_v"))
    pe = pk.ParakeetEncoderRelPositionalEncoding(cfg)

    def inputs(T, B=3):
        x = rnd(B, T, E, seed=T)
        valid = ~_padding(B, T)
        mask = valid[:, None, :] & valid[:, :, None]  # ParakeetEncoder.forward's mask
        return x, pe(x), mask[:, None]

    assert_trace_follows_lengths(m, inputs)


def test_jit_trace_wav2vec2_conformer(backend, hf_modules):
    from txl_kernels.modules import Wav2Vec2ConformerSelfAttention

    w2v = hf_modules[1]
    cfg = w2v.Wav2Vec2ConformerConfig(hidden_size=E, num_attention_heads=H,
                                      intermediate_size=32, num_hidden_layers=1,
                                      position_embeddings_type="relative",
                                      attention_dropout=0.0)
    m = _hf_first(Wav2Vec2ConformerSelfAttention(cfg, backend=backend),
                  ("pos_bias_u", "pos_bias_v"))
    pe = w2v.Wav2Vec2ConformerRelPositionalEmbedding(cfg)

    def inputs(T, B=3):
        x = rnd(B, T, E, seed=T)
        neg = torch.finfo(torch.float32).min  # the eager interface's additive padding mask
        mask = torch.zeros(B, 1, T, T).masked_fill(_padding(B, T)[:, None, None], neg)
        return x, mask, pe(x)

    assert_trace_follows_lengths(m, inputs)


def test_jit_trace_fastspeech2_conformer(backend, hf_modules):
    from txl_kernels.modules import FastSpeech2ConformerAttention

    fs2 = hf_modules[2]
    cfg = fs2.FastSpeech2ConformerConfig(hidden_size=E)
    m = _hf_first(FastSpeech2ConformerAttention(
        cfg, {"num_attention_heads": H, "attention_dropout_rate": 0.0}, backend=backend),
        ("pos_bias_u", "pos_bias_v"))

    def inputs(T, B=3):
        return rnd(B, T, E, seed=T), ~_padding(B, T)[:, None], rnd(1, 2 * T - 1, E, seed=T + 1)

    assert_trace_follows_lengths(m, inputs)


# ------------------------------------------------------------------- a fresh process loads it
_FRESH = """
import sys, torch
saved, inputs, out, how = sys.argv[1:]
if how == "txl_kernels":
    import txl_kernels
    txl_kernels.load_library()
else:  # only torch and the op library, as a C++ process would (dlopen, then torch::jit::load)
    torch.ops.load_library(how)
    assert "txl_kernels" not in sys.modules
m = torch.jit.load(saved)
with torch.no_grad():
    torch.save(m(*torch.load(inputs)), out)
"""


def test_traced_cpu_kernel_runs_in_a_fresh_process(extension, tmp_path):
    """A module traced with the CPU kernel, saved, then loaded and run by another process:
    after ``txl_kernels.load_library()``, or with only ``torch.ops.load_library`` of the
    library it names (what a C++ deployment does), and no txl_kernels import."""
    import txl_kernels

    m = _Attn("cpu")
    traced = assert_trace_follows_lengths(m, _attn_inputs)
    saved, inputs = tmp_path / "attn.pt", tmp_path / "inputs.pt"
    torch.jit.save(traced, str(saved))
    x = _attn_inputs(11)
    torch.save(x, str(inputs))
    with torch.no_grad():
        want = m(*x)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for how in ("txl_kernels", txl_kernels.load_library()):
        out = tmp_path / "out.pt"
        env_how = dict(os.environ) if how == "txl_kernels" else env
        r = subprocess.run([sys.executable, "-c", _FRESH, str(saved), str(inputs), str(out),
                            how], capture_output=True, text=True, env=env_how,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        torch.testing.assert_close(torch.load(str(out)), want, rtol=0, atol=0)


# ---------------------------------------------------------- what a TorchScript graph cannot hold
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_jit_trace_refuses_fused_dropout_naming_it(backend, request):
    """Attention dropout in training mode on a fused kernel: an exception naming the feature and
    the route (not a TorchScript internal assert); the reference backend's F.dropout traces."""
    device = _device_for(backend, request)
    inputs = functools.partial(_attn_inputs, device=device)
    m = _Attn(backend, dropout_p=0.1).to(device).train()
    with pytest.raises(ExportUnsupported,
                       match=r"attention dropout \(dropout_p=0.1.*torch\.jit\.trace"):
        torch.jit.trace(m, inputs(8), check_trace=False)
    torch.jit.trace(_Attn("reference", dropout_p=0.1).to(device).train(), inputs(8),
                    check_trace=False)
    m.eval()  # no dropout: traces
    assert_trace_follows_lengths(m, inputs, backend=backend, device=device)


def test_jit_trace_refuses_context_parallelism_naming_it():
    """Context parallelism (a module's cp_group, or context_parallel_rel_attention): refused
    before the first collective, naming the feature and the route."""
    m = NeMoRelPositionMultiHeadAttention(H, E, 0.0, backend="reference").eval()
    m.cp_group = object()  # refused before the group is used
    x = rnd(2, 6, E)
    with pytest.raises(ExportUnsupported,
                       match=r"NeMoRelPositionMultiHeadAttention: context parallelism .*"
                             r"torch\.jit\.trace"):
        torch.jit.trace(m, (x, x, x, _padding(2, 6), nemo_rel_pos_emb(E, 6)),
                        check_trace=False)

    def ring(q, k, v, r, u, vb):
        return context_parallel_rel_attention(q, k, v, r, u, vb, causal=False)

    q, k, v, r, _ = _attn_inputs(6)
    with pytest.raises(ExportUnsupported,
                       match=r"context_parallel_rel_attention: context parallelism .*"
                             r"torch\.jit\.trace"):
        torch.jit.trace(ring, (q, k, v, r, torch.ones(2, 16), torch.ones(2, 16)),
                        check_trace=False)


class _Memory(nn.Module):
    """rel_attention over an 8-bit memory quantised inside the module."""

    def __init__(self, backend):
        super().__init__()
        self.backend = backend
        self.u = nn.Parameter(torch.randn(2, 16))
        self.vb = nn.Parameter(torch.randn(2, 16))

    def forward(self, q, k, v, r, mem_k, mem_v):
        return rel_attention(q, k, v, r, self.u, self.vb, memory=quantize_kv(mem_k, mem_v),
                             backend=self.backend)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_jit_trace_8bit_memory_follows_both_lengths(backend, request):
    """An 8-bit memory traces (its four tensors are arguments of the recorded op): the memory
    and segment lengths both follow the inputs."""
    if backend == "cpu":
        request.getfixturevalue("extension")

    def inputs(T, B=2):
        g = torch.Generator().manual_seed(T)
        M = 2 * T - 5
        q, k, v = (torch.randn(B, T, 2, 16, generator=g) for _ in range(3))
        mk, mv = (torch.randn(B, M, 2, 16, generator=g) for _ in range(2))
        return q, k, v, torch.randn(M + T, 2, 16, generator=g), mk, mv

    assert_trace_follows_lengths(_Memory(backend), inputs)


# ------------------------------------------------------------- torch.jit.script (icefall's route)
def test_icefall_original_scripts():
    """icefall exports with torch.jit.script; its attention (the transcription, annotated as
    icefall's source is) scripts and gives its eager outputs."""
    orig, _ = _icefall_pair("reference")
    scripted = torch.jit.script(orig)
    x = rnd(7, 3, E, seed=7)
    args = (x, x, x, _icefall_pos_emb(7), _padding(3, 7))
    torch.testing.assert_close(scripted(*args)[0], orig(*args)[0], rtol=0, atol=0)


def _icefall_cases(T, B=3):
    """(query, key, value, pos_emb, key_padding_mask, need_weights, attn_mask, left_context):
    self-attention with padding, a chunk mask per head, a streaming cache, distinct key /
    value and one position table per sequence."""
    x = rnd(T, B, E, seed=T)
    kpm = _padding(B, T)
    chunk = ~orig_ice.subsequent_chunk_mask(T, 4, num_left_chunks=0)
    yield x, x, x, _icefall_pos_emb(T), kpm, False, None, 0
    g = torch.Generator().manual_seed(T)
    dense = torch.rand(B * H, T, T, generator=g) > 0.7
    yield x, x, x, _icefall_pos_emb(T), kpm.to(torch.uint8), False, dense, 0
    yield x, x, x, _icefall_pos_emb(T), None, False, chunk, 0
    left = 4
    cache = torch.cat([rnd(left, B, E, seed=T + 1), x])
    kpm_c = torch.cat([torch.zeros(B, left, dtype=torch.bool), kpm], 1)
    yield x, cache, cache, _icefall_pos_emb(T, left), kpm_c, False, None, left
    kv = rnd(T, B, E, seed=T + 2)
    pos = _icefall_pos_emb(T).expand(B, -1, -1) + rnd(B, 2 * T - 1, E, seed=T + 3) * 0.1
    yield x, kv, rnd(T, B, E, seed=T + 4), pos, kpm, False, None, 0


@pytest.mark.parametrize("backend", ["reference", "cpu", "auto"])
def test_jit_script_icefall_matches_eager_and_original(backend, request):
    """torch.jit.script(IcefallRelPositionMultiheadAttention): outputs equal to the eager
    module's on the same kernel (bit for bit) and to icefall's original; the graph calls the C++
    op for "cpu" / "auto" when the extension is loaded, and the reference math (no op) for
    "reference", with no Python call in either."""
    if backend != "reference":
        request.getfixturevalue("extension")
    orig, ours = _icefall_pair(backend)
    scripted = torch.jit.script(ours)
    graph = str(scripted.inlined_graph)
    assert "prim::PythonOp" not in graph
    assert (FUSED_OP in graph) == (backend != "reference")
    eager_same_kernel = ours if backend != "auto" else _icefall_pair("cpu")[1]
    with torch.no_grad():
        for T in (5, 13):
            for args in _icefall_cases(T):
                got = scripted(*args)
                assert got[1] is None
                torch.testing.assert_close(got[0], eager_same_kernel(*args)[0], rtol=0, atol=0)
                torch.testing.assert_close(got[0], orig(*args)[0], rtol=1e-5, atol=1e-6)


def test_jit_script_icefall_saves_and_runs_in_a_fresh_process(extension, tmp_path):
    """torch.jit.save / torch.jit.load of the scripted module, in this process and in a fresh
    one: with the CPU op after loading only the op library (as a C++ process does), and the
    reference graph with nothing but torch."""
    import txl_kernels

    x = rnd(9, 3, E, seed=9)
    args = (x, x, x, _icefall_pos_emb(9), _padding(3, 9))
    inputs = tmp_path / "inputs.pt"
    torch.save(args, str(inputs))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for backend, how in (("cpu", txl_kernels.load_library()), ("reference", "")):
        _, ours = _icefall_pair(backend)
        with torch.no_grad():
            want = ours(*args)[0]
        saved = tmp_path / f"icefall_{backend}.pt"
        torch.jit.save(torch.jit.script(ours), str(saved))
        loaded = torch.jit.load(str(saved))
        with torch.no_grad():
            torch.testing.assert_close(loaded(*args)[0], want, rtol=0, atol=0)
        out = tmp_path / "out.pt"
        r = subprocess.run([sys.executable, "-c", _FRESH_SCRIPTED, str(saved), str(inputs),
                            str(out), how], capture_output=True, text=True, env=env,
                           cwd=str(tmp_path), timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        torch.testing.assert_close(torch.load(str(out)), want, rtol=0, atol=0)


_FRESH_SCRIPTED = """
import sys, torch
saved, inputs, out, library = sys.argv[1:]
if library:  # what a C++ process does: dlopen the op library, then torch::jit::load
    torch.ops.load_library(library)
m = torch.jit.load(saved)
assert "txl_kernels" not in sys.modules
with torch.no_grad():
    torch.save(m(*torch.load(inputs))[0], out)
"""


def test_jit_script_icefall_clear_errors(extension):
    """What a scripted icefall module cannot do raises naming the feature and the route: the
    Triton backend (Python launchers) when scripting, attention dropout in training on the C++
    op when the scripted module runs; bad inputs name the argument."""
    with pytest.raises(ExportUnsupported,
                       match=r"backend='triton' cannot be recorded by torch\.jit\.script"):
        torch.jit.script(IcefallRelPositionMultiheadAttention(E, H, backend="triton"))
    x = rnd(6, 2, E)
    args = (x, x, x, _icefall_pos_emb(6))
    scripted = torch.jit.script(IcefallRelPositionMultiheadAttention(E, H, 0.1, backend="cpu"))
    with pytest.raises(torch.jit.Error, match=r"attention dropout \(dropout_p=0\.1.*"
                                              r"torch\.jit\.script"):
        scripted.train()(*args)
    scripted.eval()(*args)
    ref = torch.jit.script(IcefallRelPositionMultiheadAttention(E, H, 0.1,
                                                                backend="reference"))
    ref.train()(*args)  # F.dropout records
    with pytest.raises(torch.jit.Error, match=r"query must be \(time, batch, embed_dim=32\)"):
        scripted(rnd(6, 2, E + 1), x, x, args[3])
    with pytest.raises(torch.jit.Error, match=r"key_padding_mask must be a bool or uint8"):
        scripted(*args, torch.zeros(2, 5, dtype=torch.bool))


# ------------------------------------------------------ torch.jit.script of DI-engine's attention
def _ding_pair(backend):
    torch.manual_seed(0)
    orig = og.AttentionXL(E, 16, H, nn.Dropout(0.0)).eval()
    ours = DIEngineAttentionXL(E, 16, H, nn.Dropout(0.0), backend=backend).eval()
    ours.load_state_dict(orig.state_dict(), strict=True)
    return orig, ours


def _ding_inputs(T, prev, B=3):
    mask, pos_ips = og.gtrxl_mask_and_positions(T, prev)
    full = rnd(T + prev, B, E, seed=T)
    return (full[prev:], og.PositionalEmbedding(E)(pos_ips), full, rnd(H, 16, seed=1) * 0.5,
            rnd(H, 16, seed=2) * 0.5, mask)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_jit_script_di_engine_matches_eager_and_original(backend, request):
    """DI-engine's AttentionXL scripts (annotated as in DI-engine); so does the drop-in, with
    the eager module's outputs (same kernel, bit for bit) and the original's, with and without
    memory, and the C++ op in the graph for backend "cpu"."""
    if backend == "cpu":
        request.getfixturevalue("extension")
    orig, ours = _ding_pair(backend)
    scripted_orig = torch.jit.script(orig)
    scripted = torch.jit.script(ours)
    graph = str(scripted.inlined_graph)
    assert "prim::PythonOp" not in graph
    assert (FUSED_OP in graph) == (backend == "cpu")
    with torch.no_grad():
        for T, prev in ((5, 0), (6, 4), (1, 9)):
            args = _ding_inputs(T, prev)
            got = scripted(*args)
            torch.testing.assert_close(got, ours(*args), rtol=0, atol=0)
            torch.testing.assert_close(got, scripted_orig(*args), rtol=1e-5, atol=1e-6)
        args = _ding_inputs(1, 3)[:-1]  # one step, no mask
        torch.testing.assert_close(scripted(*args), ours(*args), rtol=0, atol=0)
        with pytest.raises(torch.jit.Error, match="the mask lets queries attend keys after"):
            scripted(*_ding_inputs(4, 2)[:-1])


def _originals_that_do_not_script():
    import originals_speechbrain as sb
    import txl_original
    from test_conformer import ESPnetOriginal, NeMoOriginal

    yield "nemo", lambda: NeMoOriginal(H, E, 0.0, None, None)
    yield "espnet", lambda: ESPnetOriginal(H, E, 0.0)
    yield "speechbrain", lambda: sb.RelPosMHAXL(E, H)
    yield "rllib", lambda: og.RelativeMultiHeadAttention(E, E, H, 16)
    yield "transformer-xl", lambda: txl_original.RelPartialLearnableMultiHeadAttn(H, E, 16, 0.0)
    try:
        from transformers.models.fastspeech2_conformer import modeling_fastspeech2_conformer
        from transformers.models.parakeet import modeling_parakeet
        from transformers.models.wav2vec2_conformer import modeling_wav2vec2_conformer
    except ImportError:
        return
    yield "parakeet", lambda: modeling_parakeet.ParakeetEncoderAttention(
        modeling_parakeet.ParakeetEncoderConfig(hidden_size=E, num_attention_heads=H,
                                                intermediate_size=32, num_hidden_layers=1), 0)
    yield "wav2vec2-conformer", lambda: modeling_wav2vec2_conformer.Wav2Vec2ConformerSelfAttention(
        modeling_wav2vec2_conformer.Wav2Vec2ConformerConfig(
            hidden_size=E, num_attention_heads=H, intermediate_size=32, num_hidden_layers=1,
            position_embeddings_type="relative"))
    fs2 = modeling_fastspeech2_conformer
    yield "fastspeech2", lambda: fs2.FastSpeech2ConformerAttention(
        fs2.FastSpeech2ConformerConfig(hidden_size=E),
        {"num_attention_heads": H, "attention_dropout_rate": 0.0})


def test_originals_that_do_not_script():
    """The originals docs/dropins.md lists as not scripting (so their drop-ins are traced, not
    scripted): if one starts to script, its drop-in should script too."""
    for name, make in _originals_that_do_not_script():
        with pytest.raises(Exception):
            torch.jit.script(make())
            pytest.fail(f"{name}'s original scripts: make its drop-in script too")
