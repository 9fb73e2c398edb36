"""The transformers drop-ins (HF Parakeet, Wav2Vec2-Conformer) under context parallelism
(``module.cp_group``): each of 2 gloo ranks holds a contiguous slice of the frames and the
whole position table; the gathered output, the input gradient and the parameters' gradients
(summed over the ranks) equal the unsharded module's, with no mask, and with a flat per-frame
mask whose padded frames (one sequence wholly padded) take the original's fully masked rows
(the mean of v over every rank's keys)."""
import pytest
import torch
import torch.multiprocessing as mp

from helpers import free_port, gloo_rank
from txl_kernels.distributed import shard_sequence, unshard_sequence

pytest.importorskip("transformers", minversion="5.0",
                    reason="transformers >= 5 is not installed (pip install 'txl_kernels[hf5]')")

B, T, HIDDEN, HEADS = 3, 13, 32, 2
# (module, mask kind, backend); T = 13 frames: ranks hold 7 and 6
CASES = [("parakeet", "none", "auto"), ("parakeet", "flat", "auto"),
         ("parakeet", "flat", "reference"), ("wav2vec2", "flat", "auto")]


def _module(kind, backend):
    from txl_kernels.modules import ParakeetEncoderAttention, Wav2Vec2ConformerSelfAttention

    torch.manual_seed(11)
    if kind == "parakeet":
        from transformers.models.parakeet.configuration_parakeet import ParakeetEncoderConfig

        cfg = ParakeetEncoderConfig(hidden_size=HIDDEN, num_attention_heads=HEADS,
                                    intermediate_size=32, num_hidden_layers=1,
                                    attention_dropout=0.0, attention_bias=True)
        m = ParakeetEncoderAttention(cfg, 0, backend=backend)
        biases = (m.bias_u, m.bias_v)
    else:
        from transformers.models.wav2vec2_conformer.configuration_wav2vec2_conformer import \
            Wav2Vec2ConformerConfig

        cfg = Wav2Vec2ConformerConfig(hidden_size=HIDDEN, num_attention_heads=HEADS,
                                      intermediate_size=32, num_hidden_layers=1,
                                      position_embeddings_type="relative",
                                      attention_dropout=0.0)
        m = Wav2Vec2ConformerSelfAttention(cfg, backend=backend)
        biases = (m.pos_bias_u, m.pos_bias_v)
    m = m.double().eval()
    with torch.no_grad():
        for p in biases:
            p.normal_(0.0, 0.5)
    return m


def _inputs(mask_kind):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, T, HIDDEN, generator=g, dtype=torch.float64)
    pos = torch.randn(1, 2 * T - 1, HIDDEN, generator=g, dtype=torch.float64)
    dout = torch.randn(B, T, HIDDEN, generator=g, dtype=torch.float64)
    mask = None
    if mask_kind == "flat":  # True = valid frame: full, the second rank's frames padded, none
        lengths = torch.tensor([T, 5, 0])
        mask = torch.arange(T)[None] < lengths[:, None]
    return x, pos, mask, dout


def _call(m, kind, x, pos, mask):
    if kind == "parakeet":
        return m(x, pos, mask)[0]
    return m(x, attention_mask=mask, relative_position_embeddings=pos)[0]


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _worker(rank, world, port, path):
    with gloo_rank(rank, world, port) as dist:
        res = {}
        for kind, mask_kind, backend in CASES:
            m = _module(kind, backend)
            m.cp_group = dist.group.WORLD
            x, pos, mask, dout = _inputs(mask_kind)
            xl = shard_sequence(x, 1, rank, world).requires_grad_()
            ml = None if mask is None else shard_sequence(mask, 1, rank, world)
            out = _call(m, kind, xl, pos, ml)
            out.backward(shard_sequence(dout, 1, rank, world))
            res[(kind, mask_kind, backend)] = dict(out=out.detach(), dx=xl.grad,
                                                   grads=_grads(m))
        torch.save(res, f"{path}.{rank}")


@pytest.mark.slow
def test_hf_dropins_sharded_over_frames_equal_unsharded(tmp_path, extension):
    from txl_kernels.cpu_kernel import cpu_kernel_available

    ok, why = cpu_kernel_available()  # built here once; backend "auto" takes it on the ranks
    assert ok, why
    world = 2
    path = str(tmp_path / "res")
    mp.spawn(_worker, args=(world, free_port(), path), nprocs=world, join=True)
    ranks = [torch.load(f"{path}.{i}", weights_only=False) for i in range(world)]
    for case in CASES:
        kind, mask_kind, backend = case
        m = _module(kind, "reference")
        x, pos, mask, dout = _inputs(mask_kind)
        x = x.requires_grad_()
        out = _call(m, kind, x, pos, mask)
        out.backward(dout)
        got_out = unshard_sequence([r[case]["out"] for r in ranks], 1)
        got_dx = unshard_sequence([r[case]["dx"] for r in ranks], 1)
        for name, got, want in (("out", got_out, out.detach()), ("dx", got_dx, x.grad)):
            err = (got - want).abs().max().item()
            assert err <= 1e-10 * max(1.0, want.abs().max().item()), (case, name, err)
        for n, p in m.named_parameters():
            got = sum(r[case]["grads"][n] for r in ranks)
            err = (got - p.grad).abs().max().item()
            assert err <= 1e-10 * max(1.0, p.grad.abs().max().item()), (case, n, err)


def test_hf_dropin_with_cp_group_refuses_a_square_mask():
    """Under context parallelism a rank holds a slice of the frames: only a flat per-frame
    mask says what its keys and queries are."""
    m = _module("parakeet", "reference")
    m.cp_group = object()  # never reached: the mask is refused first
    x, pos, _, _ = _inputs("none")
    with pytest.raises(ValueError, match="flat \\(B, T\\) per-frame mask"):
        _call(m, "parakeet", x, pos, torch.ones(B, 1, T, T, dtype=torch.bool))
