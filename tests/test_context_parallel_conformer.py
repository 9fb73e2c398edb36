"""The NeMo Conformer drop-in under context parallelism (``module.cp_group``): each of 2 gloo
ranks holds a contiguous slice of the frames; the gathered output and the gradients equal the
unsharded module's (bidirectional, R = 2T - 1), with uneven key padding and a local
att_context_size window."""

import pytest
import torch
import torch.multiprocessing as mp

from helpers import free_port, gloo_rank
from txl_kernels.distributed import shard_sequence, unshard_sequence
from txl_kernels.modules import NeMoRelPositionMultiHeadAttention

B, T, F, H = 2, 13, 16, 2
CASES = {"full": None, "window": [4, 3]}


def _setup(context):
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    m = NeMoRelPositionMultiHeadAttention(H, F, 0.0, backend="reference").double()
    with torch.no_grad():
        m.pos_bias_u.normal_(generator=g)
        m.pos_bias_v.normal_(generator=g)
    m.att_context_size = context
    x = torch.randn(B, T, F, generator=g, dtype=torch.float64)
    pos = torch.randn(1, 2 * T - 1, F, generator=g, dtype=torch.float64)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, T - 5:] = True  # the last rank's frames of sequence 0 all padded
    pad[1, :2] = True
    dout = torch.randn(B, T, F, generator=g, dtype=torch.float64)
    return m, x, pos, pad, dout


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _worker(rank, world, port, path):
    with gloo_rank(rank, world, port) as dist:
        res = {}
        for name, context in CASES.items():
            m, x, pos, pad, dout = _setup(context)
            m.cp_group = dist.group.WORLD
            xl = shard_sequence(x, 1, rank, world).requires_grad_()
            out = m(xl, xl, xl, shard_sequence(pad, 1, rank, world), pos)
            out.backward(shard_sequence(dout, 1, rank, world))
            res[name] = dict(out=out.detach(), dx=xl.grad, grads=_grads(m))
        torch.save(res, f"{path}.{rank}")


@pytest.mark.slow
def test_nemo_module_sharded_over_frames_equals_unsharded(tmp_path):
    world = 2
    path = str(tmp_path / "res")
    mp.spawn(_worker, args=(world, free_port(), path), nprocs=world, join=True)
    ranks = [torch.load(f"{path}.{i}", weights_only=False) for i in range(world)]
    for name, context in CASES.items():
        m, x, pos, pad, dout = _setup(context)
        x = x.requires_grad_()
        ref = m(x, x, x, pad, pos)
        ref.backward(dout)
        got = unshard_sequence([r[name]["out"] for r in ranks], 1)
        torch.testing.assert_close(got, ref.detach(), rtol=0, atol=1e-10, msg=name)
        dx = unshard_sequence([r[name]["dx"] for r in ranks], 1)
        torch.testing.assert_close(dx, x.grad, rtol=0, atol=1e-10, msg=name)
        for n, g in _grads(m).items():  # parameters: the ranks' partial sums
            torch.testing.assert_close(sum(r[name]["grads"][n] for r in ranks), g, rtol=0,
                                       atol=1e-10, msg=f"{name} {n}")
