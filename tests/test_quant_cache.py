"""The LM's 8-bit K/V cache: ``new_cache(bsz, dtype=torch.int8 /
torch.float8_e4m3fn)``.

- ``kv_cache_quantize_append`` (C++ extension and torch fallback) gives
  ``quant.quantize_per_token``'s values bit for bit (random rows, zero rows, ties, strided
  sources, every source / data / scale dtype); ``kv_cache_compact`` moves data and scales
  (mixed dtypes) together;
- layout and ``nbytes`` (<= 0.55x the 16-bit cache at d_head 64, scales included); bad
  arguments;
- the cached model with an 8-bit cache equals the dequantise-then-attend oracle: a
  full-precision cache whose memory rows hold the dequantised values (fp64: bit for bit on the
  torch paths; fp32 on the route to ``rel_attention(..., memory=QuantizedKV)``), over
  segments with compaction, ext_len, same_length, decoding and generation;
- end to end: per-token NLL within 0.02 nats of the full-precision cache over several
  segments, while a 3-bit memory and a zeroed memory (controls) are not.
"""
from __future__ import annotations

import pytest
import torch

from txl_kernels.memory import kv_cache_compact, kv_cache_quantize_append
from txl_kernels.models import MemTransformerLM
from txl_kernels.quant import dequantize_per_token, quantize_per_token

from test_models import _one_thread, make_model, tokens  # noqa: F401 (autouse fixture)

QDTYPES = [torch.int8, torch.float8_e4m3fn]


@pytest.fixture(params=["extension", "torch"])
def backend(request):
    if request.param == "extension":
        request.getfixturevalue("extension")  # builds it, or skips saying why it cannot
    return request.param


# ----------------------------------------------------------------------------- the append op

def _source(n, bsz, H, D, dtype, qdtype, seed):
    """[n, bsz, H * D] rows (a strided view, as the model's key chunk) with a zero head, a
    head of exact ties for qdtype (scale exactly 1) and random heads."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, bsz, 3 * H * D, generator=g, dtype=torch.float64) * 2)[..., H * D:2 * H * D]
    x[0, 0, :D] = 0.0
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    # scale = qmax / qmax = 1: int8 ties at k + 0.5 (to even), fp8 ties between e4m3 values
    # (1.0625 between 1 and 1.125, 17 between 16 and 18, 0.5 + 1/32 + 1/64 ...)
    ties = torch.tensor([qmax, 0.5, 1.5, 2.5, -0.5, -3.5, 1.0625, 17.0, -9.5, 0.546875],
                        dtype=torch.float64)
    row = torch.zeros(D, dtype=torch.float64)
    row[:min(D, ties.numel())] = ties[:D]
    x[-1, -1, (H - 1) * D:] = row
    return x.to(dtype)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float64, torch.bfloat16,
                                       torch.float16])
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_quantize_append_bit_identical_to_quantize_per_token(backend, src_dtype, qdtype,
                                                             scale_dtype):
    n, bsz, H, D, cap, dst = 4, 3, 2, 37, 9, 3
    srcs = [_source(n, bsz, H, D, src_dtype, qdtype, seed) for seed in range(3)]
    data = [torch.full((cap, bsz, H * D), 7, dtype=torch.int8).view(qdtype) for _ in srcs]
    scales = [torch.full((cap, bsz, H), -1.0, dtype=scale_dtype) for _ in srcs]
    kv_cache_quantize_append(srcs, data, scales, dst, H, backend=backend)
    for x, q, s in zip(srcs, data, scales):
        want_q, want_s = quantize_per_token(x.unflatten(-1, (H, D)), qdtype, scale_dtype)
        assert torch.equal(q[dst:dst + n].view(torch.int8), want_q.flatten(-2).view(torch.int8))
        assert torch.equal(s[dst:dst + n], want_s)
        # rows outside [dst, dst + n) untouched
        assert (q[:dst].view(torch.int8) == 7).all() and (q[dst + n:].view(torch.int8) == 7).all()
        assert (s[:dst] == -1).all() and (s[dst + n:] == -1).all()
    # the tie row: int8 rounds half to even, fp8 to the even e4m3 neighbour
    tie = data[0][dst + n - 1, -1, (H - 1) * D:(H - 1) * D + 10].float()
    if qdtype == torch.int8:
        assert tie[1:6].tolist() == [0.0, 2.0, 2.0, 0.0, -4.0] and tie[8] == -10.0
    else:
        assert tie[6:8].tolist() == [1.0, 16.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_quantize_append_cuda_bit_identical(extension, src_dtype, qdtype, scale_dtype):
    """The CUDA kernel (one launch for every buffer) against quantize_per_token on CUDA."""
    n, bsz, H, D, cap, dst = 5, 3, 4, 41, 12, 2
    srcs = [_source(n, bsz, H, D, src_dtype, qdtype, seed).cuda() for seed in range(4)]
    data = [torch.zeros(cap, bsz, H * D, dtype=qdtype, device="cuda") for _ in srcs]
    scales = [torch.zeros(cap, bsz, H, dtype=scale_dtype, device="cuda") for _ in srcs]
    kv_cache_quantize_append(srcs, data, scales, dst, H, backend="extension")
    for x, q, s in zip(srcs, data, scales):
        want_q, want_s = quantize_per_token(x.unflatten(-1, (H, D)), qdtype, scale_dtype)
        assert torch.equal(q[dst:dst + n].view(torch.int8), want_q.flatten(-2).view(torch.int8))
        assert torch.equal(s[dst:dst + n], want_s)


def test_quantize_append_bad_arguments(backend):
    x = torch.randn(2, 1, 8)
    q, s = torch.zeros(5, 1, 8, dtype=torch.int8), torch.zeros(5, 1, 2)
    with pytest.raises(ValueError, match="exceed"):
        kv_cache_quantize_append([x], [q], [s], 4, 2, backend=backend)
    with pytest.raises(TypeError, match=r"data_bufs\[0\]"):
        kv_cache_quantize_append([x], [q.float()], [s], 0, 2, backend=backend)
    with pytest.raises(TypeError, match=r"scale_bufs\[0\]"):
        kv_cache_quantize_append([x], [q], [s.double()], 0, 2, backend=backend)
    with pytest.raises(ValueError, match="n_head"):
        kv_cache_quantize_append([x], [q], [s], 0, 3, backend=backend)
    with pytest.raises(ValueError, match=r"scale_bufs\[0\] must be a contiguous \[5, 1, 2\]"):
        kv_cache_quantize_append([x], [q], [torch.zeros(5, 1, 4)], 0, 2, backend=backend)
    with pytest.raises(ValueError, match="one length"):
        kv_cache_quantize_append([x, x], [q], [s], 0, 2, backend=backend)
    with pytest.raises(TypeError, match="srcs"):
        kv_cache_quantize_append(x, [q], [s], 0, 2, backend=backend)


def test_quantize_append_without_extension(monkeypatch):
    """No extension: "auto" warns once and quantises with the torch fallback (same values),
    "extension" raises naming the op and the reason."""
    from txl_kernels import _cpp_ops

    monkeypatch.setattr(_cpp_ops, "unavailable", lambda op, device_type: "no compiler here")
    monkeypatch.setattr(_cpp_ops, "_WARNED", set())
    x = _source(3, 2, 2, 8, torch.float32, torch.int8, 0)
    q, s = torch.zeros(4, 2, 16, dtype=torch.int8), torch.zeros(4, 2, 2)
    with pytest.warns(RuntimeWarning, match="pure-torch fallback.*no compiler here"):
        kv_cache_quantize_append([x], [q], [s], 1, 2)
    want_q, want_s = quantize_per_token(x.unflatten(-1, (2, 8)), torch.int8)
    assert torch.equal(q[1:], want_q.flatten(-2)) and torch.equal(s[1:], want_s)
    with pytest.raises(RuntimeError, match="kv_cache_quantize_append: backend='extension' is "
                                           "not available.*no compiler here"):
        kv_cache_quantize_append([x], [q], [s], 1, 2, backend="extension")


def test_compact_moves_data_and_scales_together(backend):
    g = torch.Generator().manual_seed(0)
    bufs = [torch.randint(-127, 127, (11, 2, 6), generator=g, dtype=torch.int8),
            torch.randn(11, 2, 6, generator=g).to(torch.float8_e4m3fn),
            torch.randn(11, 2, 3, generator=g), torch.randn(11, 2, 3, generator=g).half()]
    before = [b.clone() for b in bufs]
    kv_cache_compact(bufs, 6, 4, backend=backend)
    for b, r in zip(bufs, before):
        b, r = b.view(torch.uint8) if b.element_size() == 1 else b, \
            r.view(torch.uint8) if r.element_size() == 1 else r
        assert torch.equal(b[:4], r[6:10]) and torch.equal(b[4:], r[4:])


# ----------------------------------------------------------------------------- the cache

@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_cache_layout_and_nbytes(model_dtype, qdtype):
    torch.manual_seed(0)
    model = MemTransformerLM(40, 2, 2, 128, 64, 64, 0.0, 0.0, tgt_len=4, mem_len=8,
                             attn_backend="reference").to(model_dtype).eval()
    full = model.new_cache(3)
    for scale_dtype, bound in ((torch.float32, 0.55), (torch.float16, 0.52)):
        c8 = model.new_cache(3, dtype=qdtype, scale_dtype=scale_dtype)
        assert c8.quantized and c8.dtype == qdtype and c8.compute_dtype == model_dtype
        assert c8.k[0].shape == full.k[0].shape == (2 * 8 + 4, 3, 128)
        assert c8.k_scale[1].shape == c8.v_scale[0].shape == (2 * 8 + 4, 3, 2)
        assert c8.k_scale[0].dtype == scale_dtype
        # data + scales: (D + 4) / (2 D) = 0.53 (fp32 scales), (D + 2) / (2 D) (fp16)
        assert c8.nbytes == 2 * 2 * 20 * 3 * (128 + 2 * scale_dtype.itemsize)
        assert c8.nbytes <= bound * full.nbytes
    (loss,) = model(tokens(4, 3, n_token=40), tokens(4, 3, seed=2, n_token=40), cache=c8)
    assert loss.dtype == model_dtype and torch.isfinite(loss).all()
    assert "scale_dtype=torch.float16" in repr(c8)


def test_bad_cache_dtype_names_the_argument():
    model = make_model("plain")
    for bad in (torch.float16, torch.uint8, "int8"):
        with pytest.raises(TypeError, match="new_cache: dtype must be None"):
            model.new_cache(2, dtype=bad)
    with pytest.raises(TypeError, match="scale_dtype"):
        model.new_cache(2, dtype=torch.int8, scale_dtype=torch.bfloat16)


def _oracle_requantize(cache, qlen, qdtype, scale_dtype):
    """After a segment on a full-precision cache: replace the rows it appended to the memory
    by their quantised-dequantised values (what an 8-bit cache holds)."""
    new = min(cache.mlen, max(0, qlen - cache.ext_len))
    if new == 0:
        return
    hi = cache.start + cache.mlen
    for buf in cache.k + cache.v:
        rows = buf[hi - new:hi].view(new, cache.bsz, cache.n_head, -1)
        data, scale = quantize_per_token(rows, qdtype, scale_dtype)
        rows.copy_(dequantize_per_token(data, scale, rows.dtype))


def _run_both(model, c8, cfull, x, y, qdtype, scale_dtype):
    (got,) = model.log_probs(x, cache=c8) if y is None else model(x, y, cache=c8)
    (want,) = model.log_probs(x, cache=cfull) if y is None else model(x, y, cache=cfull)
    _oracle_requantize(cfull, x.shape[0], qdtype, scale_dtype)
    assert (c8.start, c8.mlen) == (cfull.start, cfull.mlen)
    return got, want


def _assert_same(got, want, step):
    """fp32: bit for bit; fp64: within 1e-13 (the BLAS's rounding, see below)."""
    if got.dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13, msg=f"step {step}")
    else:
        assert torch.equal(got, want), (step, (got - want).abs().max())


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("model_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cfg,ext_len,scale_dtype", [("adaptive2", 0, torch.float32),
                                                     ("proj_prelnorm", 2, torch.float16)])
def test_8bit_cache_equals_dequantised_oracle_torch_paths(qdtype, model_dtype, cfg, ext_len,
                                                          scale_dtype):
    """fp64 / fp32 model on the torch paths (attn_backend "reference": segments and single
    tokens): bit for bit, but for the BLAS's rounding in fp64: MKL's dgemm may round the same
    product differently for the 8-bit path's dequantised copy than for the cache's strided rows
    (up to 9e-16 on an AMD EPYC), far below any quantisation difference (~1e-3)."""
    model = make_model(cfg, 5, 7, ext_len).to(model_dtype)
    bsz = 2
    c8 = model.new_cache(bsz, dtype=qdtype, scale_dtype=scale_dtype)
    cfull = model.new_cache(bsz)
    data = tokens(40, bsz, seed=4)
    compacted = False
    for s in range(0, 30, 5):
        x, y = data[s:s + 5 + ext_len], data[s + 1:s + 6 + ext_len]
        start = c8.start
        got, want = _run_both(model, c8, cfull, x, y, qdtype, scale_dtype)
        compacted |= c8.start < start
        _assert_same(got, want, s)
    assert compacted
    for t in range(30, 34):  # single tokens (the decode path)
        got, want = _run_both(model, c8, cfull, data[t:t + 1], None, qdtype, scale_dtype)
        _assert_same(got, want, t)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_8bit_cache_fused_route_matches_oracle_fp32(qdtype):
    """fp32 model on the fused route (attn_backend "auto"; the Triton interpreter here): the
    segments go to rel_attention(..., memory=QuantizedKV views of the cache), single tokens
    to the decode path; the oracle dequantises then attends. Tight tolerance (arithmetic
    order only)."""
    model = make_model("adaptive2", 4, 6, attn_backend="auto")
    c8 = model.new_cache(2, dtype=qdtype)
    cfull = model.new_cache(2)
    data = tokens(20, 2, seed=9)
    for s in range(0, 12, 4):
        got, want = _run_both(model, c8, cfull, data[s:s + 4], data[s + 1:s + 5], qdtype,
                              torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    got, want = _run_both(model, c8, cfull, data[12:13], None, qdtype, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_generate_with_8bit_cache_equals_oracle_greedy(qdtype):
    model = make_model("plain", tgt_len=4, mem_len=6).double()
    prompt = tokens(9, 2, seed=7).t().contiguous()
    cache = model.new_cache(2, ext_len=0, dtype=qdtype)
    got = model.generate(prompt, 7, cache=cache)
    assert got.shape == (2, 16) and torch.equal(got[:, :9], prompt)
    # the oracle: the same greedy loop on a full-precision cache holding dequantised rows
    cfull = model.new_cache(2, ext_len=0)
    data = prompt.t()
    for s in range(0, 9, 4):
        (lp,) = model.log_probs(data[s:s + 4], cache=cfull)
        _oracle_requantize(cfull, data[s:s + 4].shape[0], qdtype, torch.float32)
    out = [prompt]
    for _ in range(7):
        tok = lp[-1].argmax(-1)
        out.append(tok[:, None])
        (lp,) = model.log_probs(tok[None], cache=cfull)
        _oracle_requantize(cfull, 1, qdtype, torch.float32)
    assert torch.equal(got, torch.cat(out, 1))


# ----------------------------------------------------------------------------- end to end NLL

def _sensitive_model():
    """A tiny LM whose predictions depend on its memory: embeddings of std 0.2 (tied output:
    logits of a few nats) and query / key / value projections scaled by 2 (peaked
    attention). With zeroed memory its per-token NLL moves by ~0.4 nats."""
    torch.manual_seed(0)
    model = MemTransformerLM(64, 2, 2, 32, 32, 64, 0.0, 0.0, tgt_len=8, mem_len=16,
                             attn_backend="reference").eval()
    with torch.no_grad():
        model.word_emb.emb_layers[0].weight.normal_(0.0, 0.2)
        for layer in model.layers:
            layer.dec_attn.qkv_net.weight.mul_(2.0)
    return model


def _nll(model, data, dtype=None, coarse=None):
    """Per-token NLL over the segments; coarse = qmax of a coarser quantisation of the memory
    (the control) applied to a full-precision cache, 0 = zeroed memory."""
    cache = model.new_cache(data.shape[1], dtype=dtype)
    out = []
    for s in range(0, data.shape[0] - 1, 8):
        (loss,) = model(data[s:s + 8], data[s + 1:s + 9], cache=cache)
        out.append(loss)
        if coarse is not None:
            n, hi = min(cache.mlen, 8), cache.start + cache.mlen
            for buf in cache.k + cache.v:
                rows = buf[hi - n:hi].view(n, cache.bsz, cache.n_head, -1)
                scale = rows.abs().amax(-1, keepdim=True) / max(coarse, 1)
                q = (rows / scale.clamp_min(1e-30)).round().clamp(-coarse, coarse) * scale
                rows.copy_(q if coarse else torch.zeros_like(rows))
    return torch.cat(out)


def test_8bit_nll_within_002_nats_and_controls_exceed_it():
    model = _sensitive_model()
    data = tokens(8 * 8 + 1, 4, seed=1, n_token=64)  # 8 segments: the memory fills, rolls
    full = _nll(model, data)
    for qdtype in QDTYPES:
        diff = (_nll(model, data, qdtype) - full).abs().mean().item()
        assert 0 < diff < 0.02, (qdtype, diff)
    # controls: the same measurement sees a coarse (3-bit) or missing memory
    assert (_nll(model, data, coarse=3) - full).abs().mean().item() > 0.05
    assert (_nll(model, data, coarse=0) - full).abs().mean().item() > 0.2


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_quantize_append_fp16_scales_at_both_ends(backend, src_dtype, qdtype):
    """The append op (C++ and torch) clamps and rounds float16 scales as quantize_per_token
    does (bit for bit): rows far below float16's scale range are not all zeros, rows above it
    give finite scales."""
    from test_quant_api import _extreme_rows
    x, _, _ = _extreme_rows(qdtype)
    H, D = 2, 16
    src = x[:, None].to(src_dtype)  # [n, bsz, H * D]: each row's halves are two heads
    data = [torch.zeros(8, 1, H * D, dtype=qdtype)]
    scales = [torch.full((8, 1, H), -1.0, dtype=torch.float16)]
    kv_cache_quantize_append([src], data, scales, 1, H, backend=backend)
    want_q, want_s = quantize_per_token(src.unflatten(-1, (H, D)), qdtype, torch.float16)
    assert torch.equal(scales[0][1:7], want_s)
    assert torch.equal(data[0][1:7].view(torch.int8), want_q.flatten(-2).view(torch.int8))
    assert torch.isfinite(want_s).all() and (want_s > 0).all()
