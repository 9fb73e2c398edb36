"""Deployment routes of ``rel_attention``: torch.export with dynamic lengths (docs/export.md;
TorchScript: tests/test_torchscript.py)."""
import pytest
import torch

from txl_kernels import rel_attention


class _Attn(torch.nn.Module):
    def __init__(self, backend, H=2, D=8):
        super().__init__()
        self.backend = backend
        self.u = torch.nn.Parameter(torch.randn(H, D))
        self.vb = torch.nn.Parameter(torch.randn(H, D))

    def forward(self, q, k, v, r, kpm):
        return rel_attention(q, k, v, r, self.u, self.vb, causal=False, key_padding_mask=kpm,
                             backend=self.backend)


def _inputs(T, B=2, H=2, D=8):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    r = torch.randn(2 * T - 1, H, D, generator=g)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, -2:] = True
    return q, k, v, r, kpm


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_torch_export_dynamic_length(backend):
    """The rel_shift's shape arithmetic raises no guard on T: one program for every length."""
    m = _Attn(backend).eval()
    T = torch.export.Dim("T", min=2, max=4096)
    ep = torch.export.export(m, _inputs(8),
                             dynamic_shapes=({1: T}, {1: T}, {1: T}, {0: 2 * T - 1}, {1: T}))
    for t in (5, 13):
        x = _inputs(t)
        torch.testing.assert_close(ep.module()(*x), m(*x), rtol=0, atol=0)

