"""8-bit memory API (txl_kernels.quant, rel_attention(memory=...)): quantisation, the
reference oracle, argument checks. The fused kernels' 8-bit paths: test_quant_kernels.py;
the model's 8-bit cache: test_quant_cache.py."""
import pytest
import torch

from txl_kernels import QuantizedKV, quantize_kv, rel_attention
from txl_kernels.quant import dequantize_per_token, quantize_per_token

QDTYPES = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_quantize_per_token_error_bound_and_zero_rows(qdtype, scale_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 2, 41, generator=g) * torch.logspace(-3, 2, 7)[None, :, None, None]
    x[1, 2, 0] = 0.0  # a row of zeros: scale 0, data 0, no NaN
    data, scale = quantize_per_token(x, qdtype, scale_dtype)
    assert data.dtype == qdtype and data.shape == x.shape
    assert scale.dtype == scale_dtype and scale.shape == x.shape[:-1]
    y = dequantize_per_token(data, scale, torch.float32)
    assert torch.isfinite(y).all()
    assert scale[1, 2, 0] == 0 and (y[1, 2, 0] == 0).all()
    amax = x.abs().amax(-1, keepdim=True)
    err = (y - x).abs() / amax.clamp_min(1e-30)
    # int8: half a step of amax / 127; e4m3: 3 mantissa bits, half an ulp relative to the
    # value (<= 2**-4 of amax) -- plus the fp16 scale's rounding.
    bound = (0.5 / 127 if qdtype == torch.int8 else 2.0 ** -4) + (2e-3 if scale_dtype ==
                                                                   torch.float16 else 1e-6)
    assert err.max() <= bound, err.max()
    # The absmax entry of each row hits the format's largest value.
    qmax = 127 if qdtype == torch.int8 else 448
    top = data.float().abs().amax(-1)
    nz = amax[..., 0] > 0
    assert torch.allclose(top[nz], torch.full_like(top[nz], qmax), rtol=1e-2)


def test_quantize_rejects_bad_arguments():
    x = torch.randn(2, 3, 1, 16)
    with pytest.raises(TypeError, match="dtype must be torch.int8 or torch.float8_e4m3fn"):
        quantize_per_token(x, torch.float16)
    with pytest.raises(TypeError, match="scale_dtype"):
        quantize_per_token(x, torch.int8, torch.bfloat16)
    with pytest.raises(TypeError, match="floating tensor"):
        quantize_per_token(x.to(torch.int32), torch.int8)


def _inputs(B=2, Lq=5, M=9, H=2, D=41, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    q, k, v = rnd(B, Lq, H, D), rnd(B, Lq, H, D), rnd(B, Lq, H, D)
    r = rnd(M + Lq, H, D)
    u, vb = rnd(H, D), rnd(H, D)
    mem = quantize_kv(rnd(B, M, H, D) * 3, rnd(B, M, H, D), torch.int8)
    return q, k, v, r, u, vb, mem


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_with_memory_is_dequantise_then_attend(qdtype, dtype):
    q, k, v, r, u, vb, _ = _inputs(dtype=dtype)
    g = torch.Generator().manual_seed(1)
    mem = quantize_kv(torch.randn(2, 9, 2, 41, generator=g),
                      torch.randn(2, 9, 2, 41, generator=g), qdtype)
    kpm = torch.zeros(2, 14, dtype=torch.bool)
    kpm[0, 3] = True
    out = rel_attention(q, k, v, r, u, vb, memory=mem, key_padding_mask=kpm,
                        window_size=(10, 0), backend="reference")
    mk, mv = mem.dequantize(dtype)
    want = rel_attention(q, torch.cat([mk, k], 1), torch.cat([mv, v], 1), r, u, vb,
                         key_padding_mask=kpm, window_size=(10, 0), backend="reference")
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # and the memory matters: attending to the undequantised zeros would differ
    zero = QuantizedKV(torch.zeros_like(mem.k), mem.k_scale, mem.v, mem.v_scale)
    other = rel_attention(q, k, v, r, u, vb, memory=zero, window_size=(10, 0),
                          key_padding_mask=kpm, backend="reference")
    assert (other - out).abs().max() > 1e-3


def test_reference_with_memory_differentiates_current_segment():
    q, k, v, r, u, vb, mem = _inputs()
    for t in (q, k, v, r, u, vb):
        t.requires_grad_(True)
    out = rel_attention(q, k, v, r, u, vb, memory=mem, backend="auto")
    out.square().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v, r, u, vb))
    with pytest.raises(ValueError, match="forward only"):
        rel_attention(q, k, v, r, u, vb, memory=mem, backend="triton")


def test_memory_argument_checks():
    q, k, v, r, u, vb, mem = _inputs()

    def call(m):
        return rel_attention(q, k, v, r, u, vb, memory=m, backend="reference")
    with pytest.raises(TypeError, match="memory must be a txl_kernels.quant.QuantizedKV"):
        call((mem.k, mem.k_scale, mem.v, mem.v_scale))
    with pytest.raises(TypeError, match=r"memory.k must be torch.int8"):
        call(mem._replace(k=mem.k.float()))
    with pytest.raises(ValueError, match=r"memory.v must have memory.k's shape and dtype"):
        call(mem._replace(v=mem.v[:, :-1]))
    with pytest.raises(ValueError, match=r"memory.k must be \[B, M, H, D\] = \[2, M, 2, 41\]"):
        call(QuantizedKV(mem.k[:1], mem.k_scale[:1], mem.v[:1], mem.v_scale[:1]))
    with pytest.raises(ValueError, match=r"memory.v_scale must be a float32 / float16 tensor"):
        call(mem._replace(v_scale=mem.v_scale.double()))
    with pytest.raises(ValueError, match=r"memory.k_scale must be .* \[B, M, H\]"):
        call(mem._replace(k_scale=mem.k_scale[:, :-1]))
    # r must cover the memory's rows too (Lk = M + Lc)
    with pytest.raises(ValueError, match="r has 5 rows"):
        rel_attention(q, k, v, r[:5], u, vb, memory=mem, backend="reference")


def _extreme_rows(qdtype):
    """Rows [6, 32] whose largest |value| spans float16's scale range: far below it, at its
    subnormal end (1.4 ulp of 2**-24 per qmax: round-to-nearest would clip), inside, above."""
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 32, generator=g)
    x = x / x.abs().amax(-1, keepdim=True)  # each row's largest |value| is 1
    amax = torch.tensor([1e-7, 1e-6, 1.4 * 2.0 ** -24 * qmax, 1.0, 1e7, 1e8])
    return x * amax[:, None], amax, qmax


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_fp16_scales_never_underflow_or_overflow(qdtype):
    """Regression: with scale_dtype=float16, rows whose largest value is below ~7.6e-6 (int8)
    quantised to all zeros (scale 0) and values near 1e7 gave inf scales. The scale is clamped
    into [2**-24, 65504] and rounded up: small rows keep their values on the step 2**-24,
    large ones saturate at 65504 * qmax, no scale is 0 or inf."""
    x, amax, qmax = _extreme_rows(qdtype)
    data, scale = quantize_per_token(x, qdtype, torch.float16)
    assert torch.isfinite(scale).all() and (scale > 0).all(), scale
    s = scale.double()
    # the scale is the smallest float16 >= amax / qmax within the clamp
    want = (amax.double() / qmax).clamp(2.0 ** -24, 65504.0)
    assert (s >= want).all() and (s.half().double() == s).all()
    y = dequantize_per_token(data, scale, torch.float64)
    err = (y - x.double()).abs().amax(-1)
    inside = amax <= 65504.0 * qmax
    if qdtype == torch.int8:  # half a step
        bound = 0.5 * s * (1 + 1e-6)
    else:  # e4m3: half an ulp relative to the value (2**-4 of amax) or half its subnormal step
        bound = torch.maximum(2.0 ** -4 * amax.double(), 2.0 ** -10 * s) * (1 + 1e-6)
    assert (err[inside] <= bound[inside]).all(), (err, bound)
    assert (data[:2].float() != 0).any(-1).all()  # rows below 7.6e-6 are not all zeros
    # beyond 65504 * qmax: saturated at that value, finite, sign kept
    top = 65504.0 * qmax
    sat = y[~inside]
    assert torch.isfinite(sat).all() and sat.abs().max() == top
    big = x[~inside].abs() >= top
    assert torch.equal(sat[big], top * x[~inside][big].sign().double())
    # float32 scales are unchanged: absmax / qmax
    _, s32 = quantize_per_token(x, qdtype, torch.float32)
    torch.testing.assert_close(s32, amax / qmax, rtol=1e-6, atol=0)


def test_fp16_scale_keeps_non_finite_rows_non_finite():
    x = torch.ones(2, 8)
    x[0, 3] = float("inf")
    x[1, 2] = float("nan")
    _, scale = quantize_per_token(x, torch.int8, torch.float16)
    assert torch.isinf(scale[0]) and torch.isnan(scale[1])
