"""txl_kernels.cached_attention: the LM cache path's attention dispatch. Each route is picked
where its docstring says (rel_attention's kernel policy, then the decode op for one row), and
every route gives the einsum reference's causal attention over the cache's strided seq-first
keys / values, with and without an 8-bit memory."""
from __future__ import annotations

import pytest
import torch

from txl_kernels.cached_attention import ROUTES, cached_attention, cached_attention_route
from txl_kernels.quant import QuantizedKV, quantize_kv
from txl_kernels.reference import rel_attention_reference

from helpers import FUSED_DEVICE

F32, F64, F16 = torch.float32, torch.float64, torch.float16


@pytest.mark.parametrize("qlen,dtype,backend,dropout_p,fused,route", [
    (1, F32, "auto", 0.0, True, "triton_decode"),
    (1, F16, "triton", 0.0, True, "triton_decode"),
    (1, F32, "cpu", 0.0, True, "cpu_decode"),          # the C++ kernel, asked for by name
    (1, F32, "auto", 0.0, False, "cpu_decode"),        # no fused kernel: "auto" is the C++ one
    (1, F64, "auto", 0.0, False, "cpu_decode"),
    (1, F64, "auto", 0.0, True, "rel_attention"),      # no fused fp64: "auto" is the reference
    (1, F32, "reference", 0.0, True, "rel_attention"),
    (1, F16, "cpu", 0.0, False, "rel_attention"),      # the C++ decode kernel: fp32 / fp64
    (1, F32, "auto", 0.1, True, "rel_attention"),      # dropout: rel_attention's own kernels
    (5, F32, "auto", 0.0, True, "rel_attention"),
    (5, F64, "cpu", 0.0, False, "rel_attention"),
    (5, F32, "reference", 0.0, False, "rel_attention"),
])
def test_route_is_picked_by_its_documented_reasons(qlen, dtype, backend, dropout_p, fused, route,
                                                   monkeypatch):
    import txl_kernels.functional as functional

    monkeypatch.setattr(functional, "fused_available",
                        lambda device: (fused, "" if fused else "no fused kernel (test)"))
    assert route in ROUTES
    assert cached_attention_route(qlen, dtype, torch.device("cpu"), 16, backend=backend,
                                  dropout_p=dropout_p) == route


def test_route_head_dim_outside_the_fused_kernels():
    """A head dim the Triton kernels do not take: "auto" follows rel_attention to the
    reference (one row included), "triton" raises naming the head dim."""
    from txl_kernels import fused_available

    if not fused_available(torch.device(FUSED_DEVICE))[0]:
        pytest.skip("the fused kernels do not run here")
    assert cached_attention_route(1, F32, torch.device(FUSED_DEVICE), 300) == "rel_attention"
    with pytest.raises(ValueError, match="D=300"):
        cached_attention_route(1, F32, torch.device(FUSED_DEVICE), 300, backend="triton")


def _inputs(lq, lc, m, dtype, seed):
    """q [B, Lq, H, D]; the cache's rows as [B, L, H, D] views of seq-first buffers; with
    m > 0 an 8-bit memory of m rows in front of them (then k / v hold the lc current rows)."""
    g = torch.Generator().manual_seed(seed)
    B, H, D = 2, 3, 16
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)
    q = rnd(lq + 2, B, H, D)[:lq].transpose(0, 1)
    k = rnd(lc + 3, B, H, D)[:lc].transpose(0, 1)
    v = rnd(lc + 3, B, H, D)[:lc].transpose(0, 1)
    r, u, vb = rnd(m + lc, H, D), rnd(H, D), rnd(H, D)
    mem = quantize_kv(rnd(B, m, H, D), rnd(B, m, H, D), torch.int8) if m else None
    full = (k, v)
    if mem is not None:
        mk, mv = mem.dequantize(dtype)
        full = (torch.cat([mk, k], 1), torch.cat([mv, v], 1))
    return q, k, v, r, u, vb, mem, full


@pytest.mark.parametrize("lq,lc,m,dtype,backend,wl,route", [
    (1, 9, 0, F64, "cpu", -1, "cpu_decode"),
    (1, 4, 7, F32, "cpu", 5, "cpu_decode"),           # 8-bit memory
    (4, 11, 0, F64, "cpu", 6, "rel_attention"),       # the C++ segment kernel
    (3, 3, 6, F32, "cpu", -1, "rel_attention"),       # the C++ segment kernel, 8-bit memory
    (3, 3, 6, F32, "reference", 2, "rel_attention"),  # the reference dequantises the memory
    (1, 5, 4, F64, "reference", -1, "rel_attention"),
    (1, 7, 5, F32, "auto", -1, "triton_decode"),      # where the fused kernels run
    (4, 9, 0, F32, "auto", 3, "rel_attention"),       # the fused segment kernel there
])
def test_every_route_matches_reference(lq, lc, m, dtype, backend, wl, route):
    q, k, v, r, u, vb, mem, full = _inputs(lq, lc, m, dtype, seed=lq * 10 + lc + m)
    if FUSED_DEVICE == "cuda" and backend != "cpu":
        q, k, v, r, u, vb = (t.cuda() for t in (q, k, v, r, u, vb))
        full = tuple(t.cuda() for t in full)
        mem = None if mem is None else QuantizedKV(*(t.cuda() for t in mem))
    assert cached_attention_route(lq, dtype, q.device, q.shape[-1], backend=backend) == route
    got = cached_attention(q, k, v, r, u, vb, 0.25, (wl, 0), memory=mem, backend=backend)
    want = rel_attention_reference(*(t.double() for t in (q, *full, r, u, vb)), 0.25, wl, 0)
    assert got.shape == q.shape and got.dtype == dtype
    tol = 1e-5 if dtype == F32 else 1e-10
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
