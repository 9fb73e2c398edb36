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
