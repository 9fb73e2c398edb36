"""Parakeet drop-in against a transcription of transformers' ParakeetEncoderAttention
(tests/originals_parakeet.py): runs without transformers (test_dropins_parakeet.py uses the
real module when it is installed)."""
import pytest
import torch

from txl_kernels.modules import ParakeetEncoderAttention

import originals_parakeet as op
from helpers import FUSED_DEVICE
from test_conformer import compare, rnd

HIDDEN, HEADS = 64, 4


def pair(backend="reference", bias=True):
    cfg = op.Config(HIDDEN, HEADS, attention_bias=bias)
    torch.manual_seed(0)
    orig = op.ParakeetEncoderAttention(cfg).eval()
    with torch.no_grad():
        orig.bias_u.normal_(0.0, 0.5)
        orig.bias_v.normal_(0.0, 0.5)
    ours = ParakeetEncoderAttention(cfg, 0, backend=backend).eval()
    ours.load_state_dict(orig.state_dict(), strict=True)
    orig.load_state_dict(ours.state_dict(), strict=True)
    return orig, ours


@pytest.mark.parametrize("kind, bias", [("none", True), ("encoder", True), ("flat", False)])
def test_matches_transcription_fp64(kind, bias):
    B, T = 3, 16
    orig, ours = pair(bias=bias)
    x = rnd(B, T, HIDDEN, seed=1)
    valid = torch.arange(T)[None] < torch.tensor([T, 9, 0])[:, None]  # one empty sequence
    enc_mask = op.encoder_attention_mask(valid, T)

    def run(mask):
        def f(mod, dtype, device):
            xx = x.to(device=device, dtype=dtype).requires_grad_()
            pe = op.rel_positional_encoding(xx.detach(), HIDDEN)[:1].requires_grad_()
            m = None if mask is None else mask.to(device)
            return (mod(xx, pe.expand(B, -1, -1), m)[0],), (xx, pe)
        return f

    orig_mask = None if kind == "none" else enc_mask
    ours_mask = {"none": None, "encoder": enc_mask, "flat": valid}[kind]
    compare(orig, ours, run(orig_mask), run(ours_mask), torch.float64, grads=True)


def test_fused_path_fp32():
    B, T = 2, 11
    orig, ours = pair(backend="triton")
    x = rnd(B, T, HIDDEN, seed=2)
    valid = torch.arange(T)[None] < torch.tensor([T, 6])[:, None]

    def run(mask):
        def f(mod, dtype, device):
            xx = x.to(device=device, dtype=dtype).requires_grad_()
            pe = op.rel_positional_encoding(xx.detach(), HIDDEN)[:1]
            return (mod(xx, pe.expand(B, -1, -1), mask.to(device))[0],), (xx,)
        return f

    compare(orig, ours, run(op.encoder_attention_mask(valid, T)), run(valid), torch.float32,
            device=FUSED_DEVICE, grads=True, name="parakeet oracle")
