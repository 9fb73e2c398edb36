"""rel_attention(..., out=): the result written into a given tensor (inference). On the CPU kernel
``out`` may be q itself (each query block's rows are read before they are written): the result
is bit-identical to the call without ``out``, on every mask kind, dtype and the band tiles.
Elsewhere (reference, non-contiguous out, out sharing memory with k / v) the result is copied
in. Bad ``out`` arguments raise errors that name it."""
import pytest
import torch

from txl_kernels import rel_attention

from helpers import make_inputs


@pytest.fixture(scope="module", autouse=True)
def cpu_kernel(extension):
    from txl_kernels.cpu_kernel import cpu_kernel_available

    ok, why = cpu_kernel_available()
    assert ok, why


def _inputs(B, L, H, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, L, H, D, generator=g).to(dtype) for _ in range(3))
    r = torch.randn(2 * L - 1, H, D, generator=g).to(dtype)
    u, vb = (torch.randn(H, D, generator=g).to(dtype) * 0.5 for _ in range(2))
    return q, k, v, r, u, vb


CASES = {  # name: (B, L, H, D, rel_attention keywords)
    "causal": (2, 37, 3, 41, dict(causal=True)),
    "full_padding": (2, 37, 2, 16, dict(causal=False,
                                        key_padding_mask=torch.arange(37)[None].expand(2, 37)
                                        >= torch.tensor([[37], [20]]))),
    "window": (1, 37, 2, 41, dict(causal=False, window_size=(5, 3))),
    "one_query": (2, 1, 2, 8, dict(causal=False)),
    # band tiles (window W <= 1024, Lk >= 4 W): query blocks in chunks, k / v rows copied
    "band_tiles": (1, 700, 2, 16, dict(causal=False, window_size=(20, 20))),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_out_is_q_matches_the_plain_call(case, dtype):
    B, L, H, D, kw = CASES[case]
    q, k, v, r, u, vb = _inputs(B, L, H, D, dtype)
    with torch.no_grad():
        want = rel_attention(q, k, v, r, u, vb, backend="cpu", **kw)
        qq = q.clone()
        got = rel_attention(qq, k, v, r, u, vb, backend="cpu", out=qq, **kw)
        assert got is qq
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        sep = torch.empty_like(q)
        got = rel_attention(q, k, v, r, u, vb, backend="cpu", out=sep, **kw)
        assert got is sep
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_out_with_extra_keys_scored_by_q():
    """Extra keys scored by q (extra_q defaults to q): their scores are taken before the
    kernel overwrites q; global keys as slices of k / v."""
    q, k, v, r, u, vb = _inputs(2, 37, 2, 16, torch.float64)
    kw = dict(causal=False, window_size=(4, 4), backend="cpu")
    with torch.no_grad():
        want = rel_attention(q, k, v, r, u, vb, extra_k=k[:, 0:6:3], extra_v=v[:, 0:6:3], **kw)
        qq = q.clone()
        got = rel_attention(qq, k, v, r, u, vb, extra_k=k[:, 0:6:3], extra_v=v[:, 0:6:3],
                            out=qq, **kw)
    assert got is qq
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_out_copied_where_it_cannot_be_written_in_place():
    q, k, v, r, u, vb = _inputs(2, 13, 2, 8)
    kw = dict(causal=False)
    with torch.no_grad():
        want = rel_attention(q, k, v, r, u, vb, backend="cpu", **kw)
        # not contiguous
        strided = torch.empty(13, 2, 2, 8).transpose(0, 1)
        got = rel_attention(q, k, v, r, u, vb, backend="cpu", out=strided, **kw)
        assert got is strided
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        # out is k: the kernel reads k for every query block, so the result is copied in
        kk = k.clone()
        got = rel_attention(q, kk, v, r, u, vb, backend="cpu", out=kk, **kw)
        assert got is kk
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        # the reference backend
        want_ref = rel_attention(q, k, v, r, u, vb, backend="reference", **kw)
        buf = torch.empty_like(q)
        got = rel_attention(q, k, v, r, u, vb, backend="reference", out=buf, **kw)
        assert got is buf
        torch.testing.assert_close(got, want_ref, rtol=0, atol=0)


def test_out_bad_arguments_raise_clear_errors():
    q, k, v, r, u, vb = _inputs(2, 13, 2, 8)
    with pytest.raises(TypeError, match="out must be a tensor"):
        rel_attention(q, k, v, r, u, vb, backend="cpu", out=[1])
    with pytest.raises(ValueError, match=r"out must be torch.float32 \[2, 13, 2, 8\]"):
        rel_attention(q, k, v, r, u, vb, backend="cpu", out=torch.empty(2, 13, 2, 9))
    with pytest.raises(ValueError, match="out must be torch.float32"):
        rel_attention(q, k, v, r, u, vb, backend="cpu", out=torch.empty_like(q).double())
    qg = q.clone().requires_grad_()
    with pytest.raises(ValueError, match="out is for inference"):
        rel_attention(qg, k, v, r, u, vb, backend="cpu", out=torch.empty_like(q))


def test_opcheck_forward_out():
    q, k, v, r, u, vb = make_inputs(2, 9, 13, 2, 16, R=21, layout="bshd")
    kpm = torch.rand(2, 13) < 0.2
    args = (q, k, v, r, u, vb, 0.25, 5, -1, kpm, None, None, 0.0, None, None, None, None, None)
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_fwd.out, args,
                          {"out": torch.empty_like(q)})
    want, _ = torch.ops.txl_kernels.rel_attn_fwd(*args)
    qq = q.clone()
    lse = torch.ops.txl_kernels.rel_attn_fwd(qq, *args[1:], out=qq)
    torch.testing.assert_close(qq, want, rtol=0, atol=0)
    assert lse.shape == (2, 2, 9)
    with pytest.raises(RuntimeError, match="out must be a contiguous"):
        torch.ops.txl_kernels.rel_attn_fwd(*args, out=torch.empty(2, 9, 2, 15))
    kv = torch.randn(2, 9, 2, 16)  # keys of q's shape: out may not be one of them
    with pytest.raises(RuntimeError, match="single memory location|overlap"):
        torch.ops.txl_kernels.rel_attn_fwd(q, kv, kv, *args[3:], out=kv)


def test_compile_fullgraph_in_inference_with_and_without_out():
    """torch.compile(fullgraph=True) of the CPU kernel under no_grad (the op is called
    directly there: the autograd.Function cannot be traced without a graph), with out= copied
    into (no storage to compare while tracing)."""
    q, k, v, r, u, vb = _inputs(1, 16, 2, 8)

    def f(q, k, v, r, u, vb, out=None):
        return rel_attention(q, k, v, r, u, vb, causal=False, backend="cpu", out=out)

    with torch.no_grad():
        want = f(q, k, v, r, u, vb)
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(q, k, v, r, u, vb), want, rtol=0, atol=0)
        buf = torch.empty_like(q)
        got = compiled(q, k, v, r, u, vb, buf)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(buf, want, rtol=0, atol=0)
