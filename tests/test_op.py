"""The attention operator (txl_kernels/_op.py): one schema per direction, a kernel per dispatch
key (CPU: the C++ kernel; CUDA: the Triton kernels; Meta: the fakes; CompositeExplicitAutograd:
the extension's loader and the reference where it cannot be built), one autograd registration;
the schemas the C++ library defines where it is loaded without the package are the same."""
import warnings

import pytest
import torch

import txl_kernels._cpp_ops as cpp_ops
import txl_kernels.cpu_kernel as ck
from txl_kernels import _op
from txl_kernels.reference import rel_attention_reference

from helpers import make_inputs, run_python

OPS = ("rel_attn_fwd", "rel_attn_fwd.out", "rel_attn_bwd", "rel_attn_decode")


def _schema(name: str) -> str:
    op, _, overload = name.partition(".")
    return str(torch._C._get_schema(f"txl_kernels::{op}", overload))


def test_one_op_per_direction_with_a_kernel_per_dispatch_key(extension):
    for name in OPS:
        qualified = f"txl_kernels::{name}"
        for key in ("CPU", "CUDA", "Meta", "CompositeExplicitAutograd"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key), (name, key)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("txl_kernels::rel_attn_fwd",
                                                          "Autograd")
    assert "deterministic" in _schema("rel_attn_bwd")
    assert "deterministic" not in _schema("rel_attn_fwd")
    assert not hasattr(torch.ops.txl_kernels, "rel_attn_cpu_fwd")  # no second operator


def test_the_library_alone_defines_the_same_schemas(extension):
    """A process that loads the op library without the package (a C++ deployment's case) gets
    the ops from the library, with the package's schemas; importing the package afterwards
    keeps them."""
    from txl_kernels import load_library

    res = run_python(f"""
        import torch
        torch.ops.load_library({load_library()!r})
        names = {OPS!r}
        def schema(n):
            op, _, ov = n.partition(".")
            return str(torch._C._get_schema("txl_kernels::" + op, ov))
        alone = [schema(n) for n in names]
        import txl_kernels._op
        assert [schema(n) for n in names] == alone
        print("\\n".join(alone))
    """, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("\n")[:len(OPS)] == [_schema(n) for n in OPS]


def test_without_the_extension_the_cpu_key_runs_the_reference():
    """Where the extension cannot be built, the op on CPU tensors warns once (the extension's
    fallback warning, naming why) and gives the reference's output, lse and gradients."""
    res = run_python("""
        import warnings, torch, txl_kernels
        from txl_kernels.reference import rel_attention_reference
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 7, 2, 16, generator=g, requires_grad=True) for _ in "qkv")
        r = torch.randn(13, 2, 16, generator=g, requires_grad=True)
        u, vb = (torch.randn(2, 16, generator=g, requires_grad=True) for _ in "uv")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, lse = torch.ops.txl_kernels.rel_attn_fwd(q, k, v, r, u, vb, 0.25, 3, -1)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v, r, u, vb))
        assert any("pure-torch fallback" in str(w.message) and "no C++ compiler" in
                   str(w.message) for w in caught), [str(w.message) for w in caught]
        want, want_lse = rel_attention_reference(q, k, v, r, u, vb, 0.25, 3, -1,
                                                 return_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        for a, b in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v, r, u, vb))):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        print("reference", txl_kernels.cpu_kernel.cpu_kernel_available()[0])
    """, timeout=600, CXX="/nonexistent/g++-42")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "reference False"


@pytest.fixture
def no_extension(monkeypatch):
    """The CPU key's loader told the extension cannot be loaded (its warning re-armed)."""
    monkeypatch.setattr(ck, "cpu_kernel_available", lambda: (False, "no compiler here"))
    monkeypatch.setattr(cpp_ops, "_WARNED", set())


def test_fallback_kernels_equal_the_reference(no_extension):
    q, k, v, r, u, vb = make_inputs(2, 5, 9, 2, 16, R=13, seed=3)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, :2] = True
    args = (q, k, v, r, u, vb, 0.3, 4, 1, kpm)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        out, lse = _op._fallback_fwd(*args)
    want, want_lse = rel_attention_reference(*args, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    into = torch.empty_like(q)
    assert torch.equal(_op._fallback_fwd_out(*args, out=into), want_lse)
    assert torch.equal(into, want)
    dout = torch.randn_like(out)
    grads = _op._fallback_bwd(dout, q, k, v, r, u, vb, out, lse, 0.3, 4, 1, kpm)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, r, u, vb)]
    ref = rel_attention_reference(*leaves, 0.3, 4, 1, kpm)
    for a, b in zip(grads, torch.autograd.grad(ref, leaves, dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fallback_refuses_the_kernels_dropout_naming_it(no_extension):
    q, k, v, r, u, vb = make_inputs(1, 4, 4, 1, 16, seed=4)
    seed = _op.draw_dropout_seed("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(NotImplementedError, match="dropout_p=0.2 needs a fused kernel"):
            _op._fallback_fwd(q, k, v, r, u, vb, 0.25, -1, 0, None, None, None, 0.2, seed)


def test_interpreter_mode_runs_the_triton_kernels_on_cpu_tensors(extension, monkeypatch):
    """``op_kernel(FWD, True)`` sends the op to the Triton kernels (the CUDA key's functions)
    through the dispatcher; plain ``FWD`` on CPU tensors runs the C++ kernel."""
    pytest.importorskip("triton")
    from txl_kernels.functional import fused_available

    if not fused_available(torch.device("cpu"))[0]:
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    seen = []
    real = _op._triton_fwd
    monkeypatch.setattr(_op, "_triton_fwd", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    args = tuple(make_inputs(1, 5, 5, 2, 16, seed=5)) + (0.25, -1, 0)
    tri, _ = _op.op_kernel(_op.FWD, True)(*args)
    assert seen == [1]
    cpp, _ = _op.op_kernel(_op.FWD, False)(*args)
    assert seen == [1]
    torch.testing.assert_close(tri, cpp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window_left", [-1, 3])
@pytest.mark.parametrize("first", [None, "more", "fewer"])
def test_decode_op_equals_the_reference(extension, no_extension, window_left, first):
    """rel_attn_decode's CPU kernel (the C++ one) and its reference fallback give the
    reference's last row, with an 8-bit memory, a left window and r's row 0 at another
    distance (the table has rows above the first key's, or lacks the window's dropped ones)."""
    from txl_kernels import quantize_kv

    g = torch.Generator().manual_seed(6)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    B, lc, M, H, D = 2, 5, 3, 2, 8
    lk = M + lc
    dist = {None: None, "more": lk + 1, "fewer": 3}[first]
    if first == "fewer" and window_left < 0:
        pytest.skip("without a window every key's row must exist")
    rows = lk if dist is None else dist + 1
    q, k, v, r, u, vb = rnd(B, 1, H, D), rnd(B, lc, H, D), rnd(B, lc, H, D), rnd(rows, H, D), \
        rnd(H, D), rnd(H, D)
    mem = quantize_kv(rnd(B, M, H, D), rnd(B, M, H, D), torch.int8, torch.float32)
    args = (q, k, v, r, u, vb, 0.3, window_left, *mem, dist)
    mk, mv = mem.dequantize(torch.float64)
    want = rel_attention_reference(q, torch.cat([mk, k], 1), torch.cat([mv, v], 1), r, u, vb,
                                   0.3, window_left, 0, r_first_distance=dist)
    torch.testing.assert_close(_op.DECODE(*args), want, rtol=1e-12, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        torch.testing.assert_close(_op._fallback_decode(*args), want, rtol=0, atol=0)


def test_meta_key_gives_the_shapes():
    """The fakes serve the Meta key: every op on meta tensors returns its outputs' shapes and
    dtypes (fp64 inputs: an fp64 log-sum-exp, the CPU kernel's accumulation dtype)."""
    for dtype, lse_dtype in ((torch.float16, torch.float32), (torch.float64, torch.float64)):
        q, k, v, r, u, vb = (t.to("meta", dtype) for t in make_inputs(2, 5, 9, 2, 16, R=13))
        out, lse = _op.FWD(q, k, v, r, u, vb, 0.25, -1, -1)
        assert out.shape == q.shape and out.dtype == dtype and out.is_meta
        assert lse.shape == (2, 2, 5) and lse.dtype == lse_dtype
        assert _op.FWD_OUT(q, k, v, r, u, vb, 0.25, -1, -1, out=torch.empty_like(q)).shape \
            == (2, 2, 5)
        grads = _op.BWD(out, q, k, v, r, u, vb, out, lse, 0.25, -1, -1)
        assert [g.shape for g in grads] == [t.shape for t in (q, k, v, r, u, vb)]
        dec = _op.DECODE(q[:, :1], k, v, r[:9], u, vb, 0.25)
        assert dec.shape == (2, 1, 2, 16) and dec.dtype == dtype


def test_decode_op_compiles_fullgraph(extension):
    """torch.compile(fullgraph=True) records the decode op (its CPU kernel at run time): the
    same result as eager, on lengths the graph was not traced with (dynamic)."""
    def step(q, k, v, r, u, vb):
        return _op.DECODE(q, k, v, r, u, vb, 0.25, 4) * 2

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for lc in (6, 9):
        q, k, v, r, u, vb = make_inputs(2, 1, lc, 2, 16, seed=lc)
        torch.testing.assert_close(compiled(q, k, v, r, u, vb), step(q, k, v, r, u, vb),
                                   rtol=0, atol=0)
