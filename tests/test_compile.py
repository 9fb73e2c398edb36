"""torch.library registrations (opcheck), torch.compile(fullgraph=True) and autocast through the
fused op. On CPU the ops run under the Triton interpreter; compile uses the aot_eager backend
there (tracing, fake tensors and autograd without graph breaks) and inductor on CUDA."""
import pytest
import torch

import txl_kernels.ops  # noqa: F401  (registers torch.ops.txl_kernels.*)
from txl_kernels import FusedRelAttention, rel_attention

from helpers import FUSED_DEVICE, HAS_CUDA, make_inputs, requires_cuda


def _op_args(window=(-1, 0), masks=False, layout="bshd"):
    B, Lq, Lk, H, D = 1, 5, 9, 2, 16
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, device=FUSED_DEVICE, layout=layout,
                                    requires_grad=True)
    kpm = mask = None
    if masks:
        kpm = torch.zeros(B, Lk, dtype=torch.bool, device=FUSED_DEVICE)
        kpm[0, 1] = True
        mask = (torch.rand(Lq, Lk, device=FUSED_DEVICE) < 0.2).expand(B, H, Lq, Lk)
    return (q, k, v, r, u, vb, D ** -0.5, window[0], window[1], kpm, mask)


@pytest.mark.parametrize("masks", [False, True])
def test_opcheck_forward(masks):
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_fwd.default, _op_args(masks=masks))


def test_opcheck_forward_seq_first_window():
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_fwd.default,
                          _op_args(window=(3, 0), layout="sbhd"))


def test_opcheck_backward():
    args = _op_args(masks=True)
    with torch.no_grad():
        out, lse = torch.ops.txl_kernels.rel_attn_fwd(*args)
    do = torch.randn_like(out)
    q, k, v, r, u, vb, scale, wl, wr, kpm, mask = args
    bargs = (do, q.detach(), k.detach(), v.detach(), r.detach(), u.detach(), vb.detach(), out,
             lse, scale, wl, wr, kpm, mask)
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_bwd.default, bargs)


class _TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = FusedRelAttention(2, 32, 16, 0.0, untie_r=True, mask_mode="causal",
                                      backend="triton")

    def forward(self, w, r, mems):
        return self.attn(w, r, mems=mems).square().mean()


def _model_inputs(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 2, 32, generator=g).to(device, dtype)
    mems = torch.randn(4, 2, 32, generator=g).to(device, dtype)
    r = torch.randn(10, 1, 32, generator=g).to(device, dtype)
    return w, r, mems


def test_compile_fullgraph_module():
    device = FUSED_DEVICE
    model = _TinyModel().to(device)
    w, r, mems = _model_inputs(device)
    eager_loss = model(w, r, mems)
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    backend = "inductor" if HAS_CUDA else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    loss = compiled(w, r, mems)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


def test_compile_fullgraph_functional():
    args = make_inputs(2, 7, 11, 2, 16, device=FUSED_DEVICE)

    def f(q, k, v, r, u, vb):
        return rel_attention(q, k, v, r, u, vb, window_size=(5, 0), backend="triton") * 2

    backend = "inductor" if HAS_CUDA else "aot_eager"
    got = torch.compile(f, fullgraph=True, backend=backend)(*args)
    torch.testing.assert_close(got, f(*args), rtol=1e-5, atol=1e-6)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_cuda(dtype):
    q, k, v, r, u, vb = make_inputs(2, 16, 24, 2, 32, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=dtype):
        out = rel_attention(q, k, v, r, u, vb, backend="triton")
    assert out.dtype == dtype
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32
    want = rel_attention(*(t.detach().to(dtype) for t in (q, k, v, r, u, vb)),
                         backend="reference")
    torch.testing.assert_close(out.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_autocast_cpu_casts_inputs():
    q, k, v, r, u, vb = make_inputs(1, 5, 7, 1, 16, device=FUSED_DEVICE)
    with torch.autocast(FUSED_DEVICE, dtype=torch.bfloat16):
        out = rel_attention(q, k, v, r, u, vb, backend="triton")
    assert out.dtype == torch.bfloat16


def test_forward_op_does_not_take_deterministic(monkeypatch):
    """Only the backward uses ``deterministic``: the forward op's schema does not carry it,
    and the caller's choice still reaches the backward op (kept on the autograd context)."""
    from txl_kernels.ops import rel_attn_op

    assert "deterministic" not in str(torch.ops.txl_kernels.rel_attn_fwd.default._schema)
    assert "deterministic" in str(torch.ops.txl_kernels.rel_attn_bwd.default._schema)
    seen = []
    real = rel_attn_op._rel_attn_bwd_op
    monkeypatch.setattr(rel_attn_op, "_rel_attn_bwd_op",
                        lambda *a: seen.append(a[15]) or real(*a))  # deterministic
    grads = []
    for det in (True, False):
        ts = make_inputs(1, 5, 9, 2, 16, device=FUSED_DEVICE, requires_grad=True, seed=4)
        rel_attention(*ts, backend="triton", deterministic=det).sum().backward()
        grads.append([t.grad for t in ts])
    assert seen == [True, False]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_double_backward_raises_clearly():
    """create_graph=True through the fused op fails at that first backward, naming double
    backward (it used to succeed and leave PyTorch's generic error for the second one)."""
    ts = make_inputs(1, 5, 9, 2, 16, device=FUSED_DEVICE, requires_grad=True, seed=5)
    out = rel_attention(*ts, backend="triton")
    with pytest.raises(RuntimeError, match="double backward.*backend='reference'"):
        torch.autograd.grad(out.square().sum(), ts[0], create_graph=True)
    args = _op_args()  # the op called directly: its own autograd registration
    raw = torch.ops.txl_kernels.rel_attn_fwd(*args)[0]
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(raw.square().sum(), args[0], create_graph=True)
    # a plain backward still works, and the reference path supports double backward
    rel_attention(*ts, backend="triton").sum().backward()
    ref = [t.detach().requires_grad_(True) for t in ts]
    g, = torch.autograd.grad(rel_attention(*ref, backend="reference").square().sum(), ref[0],
                             create_graph=True)
    g.sum().backward()
    assert ref[1].grad is not None


@pytest.mark.parametrize("R", [3, 9, 13, 20])
def test_rel_shift_compiles_fullgraph(R):
    """The reference path's rel_shift traces with fullgraph (it used storage_offset()) and
    equals the original pad/reshape shift on the pairs that one covers."""
    from txl_kernels.reference import rel_shift, rel_shift_pad_reshape

    bdt = torch.randn(2, 3, 5, R)
    got = torch.compile(rel_shift, fullgraph=True, backend="aot_eager")(bdt, 9)
    torch.testing.assert_close(got, rel_shift(bdt, 9), rtol=0, atol=0)
    if R == 9:  # R == Lk: the original's layout; equal on the causal pairs (j <= i + mlen)
        allowed = torch.ones(5, 9, dtype=torch.bool).tril(4)
        torch.testing.assert_close(got[..., allowed], rel_shift_pad_reshape(bdt)[..., allowed])


def test_compile_fullgraph_module_with_dropout():
    """FusedRelAttention(dropatt=0.1).train() runs the fused kernels with dropout (backend
    "auto"): it compiles with fullgraph=True, forward and backward, and matches eager with the
    same RNG seed (the kernels' Philox seed is drawn by torch.randint, traced like any op)."""
    torch.manual_seed(0)
    model = FusedRelAttention(2, 32, 16, 0.0, dropatt=0.1, untie_r=True).train()
    w, r, mems = _model_inputs("cpu")
    mask = torch.triu(torch.ones(6, 10, dtype=torch.uint8), 5)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (model, compiled):
        model.zero_grad()
        torch.manual_seed(1)
        loss = fn(w, r, attn_mask=mask, mems=mems).square().mean()
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_same_dtype_on_both_backends(dtype):
    """Regression: under autocast the fused path returned the autocast dtype and the
    reference fp32. Both now return the autocast dtype (as SDPA does), with fp32 gradients
    for fp32 leaves, and agree."""
    outs = []
    for backend in ("reference", "triton"):
        ts = make_inputs(1, 5, 9, 2, 16, device=FUSED_DEVICE, requires_grad=True, seed=7)
        with torch.autocast(FUSED_DEVICE, dtype=dtype):
            out = rel_attention(*ts, backend=backend)
        assert out.dtype == dtype, backend
        out.float().sum().backward()
        assert all(t.grad.dtype == torch.float32 for t in ts)
        outs.append(out.float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
