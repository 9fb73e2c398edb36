"""The fused kernels' 8-bit memory paths: the forward (QUANT_MEM variant of
ops/rel_attn_fwd.py, split-K included) and the decode kernel (ops/rel_attn_decode.py) read
int8 / float8_e4m3fn keys and values plus one scale per (token, head) and dequantise in
registers. Oracle: ``rel_attention(..., backend="reference", memory=mem)`` (dequantise, then
attend), and its float64 counterpart on the same dequantised values: the fused result must be
within 2x the error of PyTorch's same-precision oracle (the tolerance of
test_fused_forward.py's fused-vs-reference checks), i.e. the only difference is arithmetic
order. Tiny shapes under TRITON_INTERPRET=1 (16 x 16 interpreter tiles: memory lengths that
are not multiples of 16 put a key tile across j = M)."""
from __future__ import annotations

import pytest
import torch

import txl_kernels.ops.rel_attn_decode as dec_mod
import txl_kernels.ops.rel_attn_fwd as fwd_mod
from txl_kernels import QuantizedKV, quant, quantize_kv, rel_attention
from txl_kernels._op import rel_attn_func

from helpers import FUSED_DEVICE, HAS_CUDA, assert_within

DEV = FUSED_DEVICE
QDTYPES = [torch.int8, torch.float8_e4m3fn]


def _id(dt):
    return str(dt).replace("torch.", "")


def _inputs(B, Lq, Lc, M, H, D, dtype, qdtype, seed=0, seq_first=False, R=None,
            scale_dtype=torch.float32):
    """q [B, Lq, H, D], current k / v [B, Lc, H, D], r [R, H, D] (default M + Lc + Lq - 1
    rows: enough for any window),
    biases, and an 8-bit memory of M tokens. seq_first: [L, B, H, D] buffers passed as
    .transpose(0, 1) views (stride(-1) == 1, not contiguous), as the LM cache passes them."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s

    def bshd(L, s=1.0):
        x = rnd(L, B, H, D, s=s).transpose(0, 1) if seq_first else rnd(B, L, H, D, s=s)
        return x

    q, k, v = (bshd(L).to(dtype).to(DEV) for L in (Lq, Lc, Lc))
    R = M + Lc + Lq - 1 if R is None else R
    r, u, vb = rnd(R, H, D).to(dtype).to(DEV), rnd(H, D).to(dtype).to(DEV), \
        rnd(H, D).to(dtype).to(DEV)
    # per-token magnitudes that differ (what per-token scales are for)
    mag = torch.logspace(-1, 0.7, M)[None, :, None, None]
    mk = (bshd(M) * mag).to(DEV)
    mv = (bshd(M) * 2).to(DEV)
    mem = quantize_kv(mk, mv, qdtype, scale_dtype)
    if seq_first and M:  # quantize_kv returns contiguous data: make seq-first views again
        mem = QuantizedKV(*(t.transpose(0, 1).contiguous().transpose(0, 1) for t in mem))
    return q, k, v, r, u, vb, mem


def _truth_and_same(q, k, v, r, u, vb, mem, rounded=True, **kw):
    """(float64 attention over the dequantised memory, the same-precision oracle).
    rounded: the memory's values as the contract gives them (``data * scale`` rounded to q's
    dtype: what the fused forward's tensor-core operands hold); False: ``data * scale``
    exactly (what the fp32 decode kernel computes with)."""
    mk, mv = mem.dequantize(q.dtype if rounded else torch.float64)
    kf, vf = torch.cat([mk, k], 1), torch.cat([mv, v], 1)
    truth = rel_attention(*(t.double() for t in (q, kf, vf, r, u, vb)), backend="reference",
                          **kw)
    same = rel_attention(q, k, v, r, u, vb, memory=mem, backend="reference", **kw)
    return truth, same


# ------------------------------------------------------------------------ fused forward

@pytest.mark.parametrize("qdtype", QDTYPES, ids=_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=_id)
def test_forward_memory_matches_oracle(dtype, qdtype):
    """D 41, M 21 (a key tile across j = M), Lq = Lc 19, causal."""
    q, k, v, r, u, vb, mem = _inputs(2, 19, 19, 21, 2, 41, dtype, qdtype)
    with torch.no_grad():
        got = rel_attention(q, k, v, r, u, vb, memory=mem, backend="triton")
    truth, same = _truth_and_same(q, k, v, r, u, vb, mem)
    assert got.dtype == dtype and got.shape == q.shape
    assert_within(f"fwd {dtype} {qdtype}", got, same, truth)


CASES = {
    # (B, Lq, Lc, M, H, D, kwargs)
    "same_length_window": (1, 19, 19, 21, 2, 41, dict(window_size=(20, 0))),
    "lc1": (2, 1, 1, 37, 1, 16, {}),
    "lc37_m16_padding": (2, 37, 37, 16, 1, 24, "kpm"),
    "noncausal_seq_first": (2, 7, 9, 13, 2, 16, dict(causal=False)),
    "lq_lt_lc_m5": (1, 3, 11, 5, 2, 16, dict(window_size=(6, 0))),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("qdtype,dtype", [(torch.int8, torch.float16),
                                          (torch.float8_e4m3fn, torch.float32)],
                         ids=["int8-fp16", "fp8-fp32"])
def test_forward_memory_cases(case, qdtype, dtype):
    B, Lq, Lc, M, H, D, kw = CASES[case]
    seq_first = "seq_first" in case
    q, k, v, r, u, vb, mem = _inputs(B, Lq, Lc, M, H, D, dtype, qdtype, seed=len(case),
                                     seq_first=seq_first)
    if kw == "kpm":  # padded keys in the memory, across j = M and in the current segment
        kpm = torch.zeros(B, M + Lc, dtype=torch.bool, device=DEV)
        kpm[0, 3:19] = True
        kpm[1, -5:] = True
        kw = dict(key_padding_mask=kpm)
    if seq_first:
        assert not mem.k.is_contiguous() and mem.k.stride(-1) == 1
    with torch.no_grad():
        got = rel_attention(q, k, v, r, u, vb, memory=mem, backend="triton", **kw)
    truth, same = _truth_and_same(q, k, v, r, u, vb, mem, **kw)
    assert_within(f"fwd {case}", got, same, truth)


@pytest.mark.parametrize("qdtype", QDTYPES, ids=_id)
def test_forward_memory_split_k_and_fp16_scales(qdtype):
    """The split-K path (forced; the combine kernel merges the splits) with fp16 scales, at
    the launcher: out and lse against the oracle."""
    q, k, v, r, u, vb, mem = _inputs(1, 9, 9, 43, 2, 16, torch.float16, qdtype,
                                     scale_dtype=torch.float16)
    assert mem.k_scale.dtype == torch.float16
    scale = 16 ** -0.5
    out, lse = fwd_mod.rel_attn_fwd(q, k, v, r, u, vb, scale, 40, 0, num_splits=3,
                                    memory=mem)
    truth, same = _truth_and_same(q, k, v, r, u, vb, mem, window_size=(40, 0))
    assert_within("split-K out", out, same, truth)
    mk, mv = mem.dequantize(torch.float16)
    from txl_kernels.reference import rel_attention_reference
    _, t_lse = rel_attention_reference(
        *(t.double() for t in (q, torch.cat([mk, k], 1), torch.cat([mv, v], 1), r, u, vb)),
        scale, 40, 0, return_lse=True)
    torch.testing.assert_close(lse.double(), t_lse, rtol=1e-3, atol=1e-3)


def test_forward_memory_of_length_zero_is_plain_attention():
    q, k, v, r, u, vb, mem = _inputs(1, 5, 9, 0, 2, 16, torch.float32, torch.int8)
    assert mem.mlen == 0
    with torch.no_grad():
        got = rel_attention(q, k, v, r, u, vb, memory=mem, backend="triton")
        want = rel_attention(q, k, v, r, u, vb, backend="triton")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _spy_on(monkeypatch, module, name):
    """Record the launches of module.name (launching them), with every full-precision
    dequantisation of an 8-bit memory made to fail."""
    spy = _Spy(getattr(module, name))
    monkeypatch.setattr(module, name, spy)
    _no_dequantize(monkeypatch)
    return spy


class _Spy:
    """Stands in for a @triton.jit kernel: records each launch's arguments, then launches."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((args, kw))
            return self.kernel[grid](*args, **kw)
        return launch


def _no_dequantize(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a full-precision copy of the memory was made")
    monkeypatch.setattr(quant, "dequantize_per_token", boom)
    monkeypatch.setattr(QuantizedKV, "dequantize", boom)


def _check_reads_storage(args, mem, Lc):
    """The launch got the memory's 8-bit tensors and scales themselves (same storage, same
    dtype), and no key / value tensor of Lk = M + Lc rows (no dequantise-then-concat). The
    kernels take some tensors inside tuple arguments: those count too."""
    def flat(xs):
        for x in xs:
            yield from flat(x) if isinstance(x, tuple) else (x,)
    tensors = [a for a in flat(args) if isinstance(a, torch.Tensor)]
    for name, t in zip(("k", "k_scale", "v", "v_scale"), mem):
        assert any(a.data_ptr() == t.data_ptr() and a.dtype == t.dtype for a in tensors), name
    M = mem.mlen
    assert not any(a.dim() == 4 and a.shape[1] == M + Lc and a.is_floating_point()
                   and a.dtype not in quant.QUANT_DTYPES for a in tensors)


def test_forward_reads_the_8bit_memory_itself(monkeypatch):
    q, k, v, r, u, vb, mem = _inputs(1, 5, 5, 19, 2, 16, torch.float16, torch.int8)
    want = rel_attention(q, k, v, r, u, vb, memory=mem, backend="reference")
    spy = _spy_on(monkeypatch, fwd_mod, "_rel_attn_fwd_kernel")
    with torch.no_grad():
        got = rel_attention(q, k, v, r, u, vb, memory=mem, backend="triton")
    assert len(spy.calls) == 1
    args, kw = spy.calls[0]
    assert kw["QUANT_MEM"] is True
    _check_reads_storage(args, mem, 5)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_forward_uses_the_scales(which):
    """Doubling one side's scales changes the fused output, as it changes the oracle's."""
    q, k, v, r, u, vb, mem = _inputs(1, 5, 5, 19, 2, 16, torch.float32, torch.int8)
    mem2 = mem._replace(**{which: getattr(mem, which) * 2})
    with torch.no_grad():
        a = rel_attention(q, k, v, r, u, vb, memory=mem, backend="triton")
        b = rel_attention(q, k, v, r, u, vb, memory=mem2, backend="triton")
    truth, same = _truth_and_same(q, k, v, r, u, vb, mem2)
    assert_within(f"doubled {which}", b, same, truth)
    assert (a - b).abs().max() > 1e-2


def test_forward_with_memory_has_no_backward():
    q, k, v, r, u, vb, mem = _inputs(1, 5, 5, 7, 1, 16, torch.float32, torch.int8)
    q.requires_grad_(True)
    out = rel_attn_func(q, k, v, r, u, vb, 0.25, -1, 0, memory=mem, interpreter=DEV == "cpu")
    with pytest.raises(RuntimeError, match="8-bit memory.*forward only"):
        out.sum().backward()
    out, _ = torch.ops.txl_kernels.rel_attn_fwd(q, k, v, r, u, vb, 0.25, -1, 0, None, None,
                                                None, 0.0, None, *mem)
    with pytest.raises(RuntimeError, match="8-bit memory.*forward only"):
        out.sum().backward()
    with pytest.raises(ValueError, match="must be given together"):
        torch.ops.txl_kernels.rel_attn_fwd(q.detach(), k, v, r, u, vb, 0.25, -1, 0, None,
                                           None, None, 0.0, None, mem.k, mem.k_scale)


# ------------------------------------------------------------------------ custom op

def test_opcheck_forward_with_memory():
    q, k, v, r, u, vb, mem = _inputs(1, 5, 4, 9, 2, 16, torch.float32, torch.int8,
                                     seq_first=True)
    kpm = torch.zeros(1, 13, dtype=torch.bool, device=DEV)
    kpm[0, 2] = True
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_fwd.default,
                          (q, k, v, r, u, vb, 0.25, 6, 0, kpm, None, None, 0.0, None, *mem))


def test_compile_fullgraph_with_memory(request):
    """The compiled graph holds the op, whose tensors' device picks its kernel at run time:
    the Triton kernel on CUDA; on CPU tensors the op's CPU kernel (the C++ one), which eager
    runs for backend="cpu" (eager backend="triton" runs the Triton kernels under the
    interpreter instead)."""
    if not HAS_CUDA:
        request.getfixturevalue("extension")
    q, k, v, r, u, vb, mem = _inputs(1, 5, 5, 9, 2, 16, torch.float16, torch.float8_e4m3fn,
                                     scale_dtype=torch.float16)

    def f(q, k, v, mk, ks, mv, vs, backend="triton"):
        return rel_attention(q, k, v, r, u, vb, memory=QuantizedKV(mk, ks, mv, vs),
                             window_size=(8, 0), backend=backend)
    with torch.no_grad():
        eager = f(q, k, v, *mem, backend="triton" if HAS_CUDA else "cpu")
        got = torch.compile(f, fullgraph=True,
                            backend="inductor" if HAS_CUDA else "aot_eager")(q, k, v, *mem)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


# ------------------------------------------------------------------------ decode kernel

DECODE = [  # (dtype, qdtype, M, Lc, window_left, num_splits)
    (torch.float32, torch.int8, 45, 1, -1, 3),
    (torch.float16, torch.int8, 37, 3, 30, 2),
    (torch.float16, torch.float8_e4m3fn, 45, 1, -1, 0),
    (torch.float32, torch.float8_e4m3fn, 21, 2, 9, 2),
    (torch.bfloat16, torch.int8, 19, 1, 12, 2),
]


@pytest.mark.parametrize("dtype,qdtype,M,Lc,wl,splits", DECODE,
                         ids=[f"{_id(a)}-{_id(b)}-M{m}-Lc{c}-w{w}" for a, b, m, c, w, _ in DECODE])
def test_decode_memory_matches_oracle(dtype, qdtype, M, Lc, wl, splits):
    """Seq-first strided current rows and memory (as the LM cache passes them), D 41, odd
    M (a tile across j = M, splits across it), windows. The kernel computes in fp32 with the
    memory's exact ``data * scale`` (see _decode_split_kernel's docstring): the float64 truth
    is the attention over those values, and the bound 2x the error of the same-precision
    oracle (the reference with the same memory, which rounds it to q's dtype)."""
    q, k, v, r, u, vb, mem = _inputs(2, 1, Lc, M, 3, 41, dtype, qdtype, seed=M,
                                     seq_first=True)
    assert mem.k.stride(-1) == 1 and not mem.k.is_contiguous()
    got = dec_mod.rel_attn_decode(q, k, v, r, u, vb, 41 ** -0.5, wl, num_splits=splits,
                                  memory=mem)
    truth, same = _truth_and_same(q, k, v, r, u, vb, mem, rounded=False,
                                  window_size=(wl, 0))
    assert got.dtype == dtype and got.shape == q.shape
    assert_within(f"decode {dtype} {qdtype}", got, same, truth)


def test_decode_reads_the_8bit_memory_itself(monkeypatch):
    q, k, v, r, u, vb, mem = _inputs(1, 1, 2, 33, 2, 16, torch.float32, torch.int8)
    want = rel_attention(q, k, v, r, u, vb, memory=mem, backend="reference")
    spy = _spy_on(monkeypatch, dec_mod, "_decode_split_kernel")
    got = dec_mod.rel_attn_decode(q, k, v, r, u, vb, 0.25, memory=mem)
    args, kw = spy.calls[0]
    assert kw["QUANT_MEM"] is True
    _check_reads_storage(args, mem, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and the scales are used: doubled value scales, a different output (the oracle's)
    mem2 = mem._replace(v_scale=mem.v_scale * 2)
    got2 = dec_mod.rel_attn_decode(q, k, v, r, u, vb, 0.25, memory=mem2)
    assert (got2 - got).abs().max() > 1e-2
    monkeypatch.undo()
    want2 = rel_attention(q, k, v, r, u, vb, memory=mem2, backend="reference")
    torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-5)
