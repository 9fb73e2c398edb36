"""txl_kernels.cached_attention: the LM cache path's attention dispatch. Each route is picked
where its docstring says, and every route gives the einsum reference's causal attention over
the cache's strided seq-first keys / values, with and without an 8-bit memory."""
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
    (1, F32, "reference", 0.0, True, "cpu_decode"),   # the reference backend: no Triton kernel
    (1, F64, "auto", 0.0, True, "cpu_decode"),        # no fused fp64
    (1, F32, "auto", 0.0, False, "cpu_decode"),       # no fused kernel on the device
    (1, F32, "auto", 0.1, True, "rel_attention"),     # dropout: rel_attention's own kernels
    (5, F64, "auto", 0.0, True, "torch_segment"),
    (5, F32, "reference", 0.0, True, "torch_segment"),
    (5, F32, "auto", 0.0, False, "torch_segment"),
    (5, F32, "auto", 0.0, True, "rel_attention"),
    (5, F16, "reference", 0.0, False, "rel_attention"),  # no torch route in half precision
    (5, F64, "reference", 0.1, False, "rel_attention"),
])
def test_route_is_picked_by_its_documented_reasons(qlen, dtype, backend, dropout_p, fused, route,
                                                   monkeypatch):
    import txl_kernels.cached_attention as ca

    monkeypatch.setattr(ca, "fused_available",
                        lambda device: (fused, "" if fused else "no fused kernel (test)"))
    assert route in ROUTES
    assert cached_attention_route(qlen, dtype, torch.device("cpu"), backend=backend,
                                  dropout_p=dropout_p) == route


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


@pytest.mark.parametrize("lq,lc,m,dtype,backend,wl", [  # routes where the fused kernels run
    (1, 9, 0, F64, "auto", -1),         # cpu_decode
    (1, 4, 7, F64, "auto", 5),          # cpu_decode, 8-bit memory
    (4, 11, 0, F64, "auto", 6),         # torch_segment
    (3, 3, 6, F32, "reference", -1),    # torch_segment, 8-bit memory
    (1, 7, 5, F32, "auto", -1),         # triton_decode where the fused kernels run
    (4, 9, 0, F32, "auto", 3),          # rel_attention (fused) where they run
])
@pytest.mark.parametrize("extension_backend", ["auto", "torch"])
def test_every_route_matches_reference(lq, lc, m, dtype, backend, wl, extension_backend):
    q, k, v, r, u, vb, mem, full = _inputs(lq, lc, m, dtype, seed=lq * 10 + lc + m)
    if FUSED_DEVICE == "cuda":
        q, k, v, r, u, vb = (t.cuda() for t in (q, k, v, r, u, vb))
        full = tuple(t.cuda() for t in full)
        mem = None if mem is None else QuantizedKV(*(t.cuda() for t in mem))
    got = cached_attention(q, k, v, r, u, vb, 0.25, (wl, 0), memory=mem, full_kv=lambda: full,
                           backend=backend, extension_backend=extension_backend)
    want = rel_attention_reference(*(t.double() for t in (q, *full, r, u, vb)), 0.25, wl, 0)
    assert got.shape == q.shape and got.dtype == dtype
    tol = 1e-5 if dtype == F32 else 1e-10
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("lq", [1, 4])
def test_torch_routes_need_full_kv_with_8bit_memory(lq):
    q, k, v, r, u, vb, mem, _ = _inputs(lq, 3, 4, F64, seed=1)
    with pytest.raises(ValueError, match="full_kv"):
        cached_attention(q, k, v, r, u, vb, 0.25, (-1, 0), memory=mem,
                         extension_backend="torch")
