"""A small Transformer-XL-like model (2 layers, memory carried across segments with
update_mems) trained for 20 optimizer steps on the fused and the reference paths from the same
initialisation: the losses must agree step by step."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from txl_kernels import FusedRelAttention, update_mems

from helpers import FUSED_DEVICE


class TinyTXL(nn.Module):
    def __init__(self, backend, vocab=37, d_model=32, n_head=2, d_head=16, n_layer=2,
                 mem_len=8):
        super().__init__()
        self.d_model, self.mem_len = d_model, mem_len
        self.emb = nn.Embedding(vocab, d_model)
        self.attn = nn.ModuleList(
            FusedRelAttention(n_head, d_model, d_head, 0.0, mem_len=mem_len, untie_r=True,
                              backend=backend) for _ in range(n_layer))
        self.ff = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, 64), nn.ReLU(), nn.Linear(64, d_model))
            for _ in range(n_layer))
        self.ln = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layer))
        self.out = nn.Linear(d_model, vocab)
        inv_freq = 1 / (10000 ** (torch.arange(0.0, d_model, 2.0) / d_model))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, tokens, target, mems):
        qlen, _ = tokens.shape
        mlen = mems[0].size(0) if mems else 0
        klen = qlen + mlen
        pos = torch.arange(klen - 1, -1, -1.0, device=tokens.device)
        sinusoid = torch.outer(pos, self.inv_freq)
        r = torch.cat([sinusoid.sin(), sinusoid.cos()], -1)[:, None, :]
        mask = torch.triu(torch.ones(qlen, klen, dtype=torch.uint8, device=tokens.device),
                          1 + mlen)[:, :, None]
        h = self.emb(tokens) * math.sqrt(self.d_model)
        hids = [h]
        for i, (attn, ff, ln) in enumerate(zip(self.attn, self.ff, self.ln)):
            h = attn(h, r, attn_mask=mask, mems=mems[i] if mems else None)
            h = ln(h + ff(h))
            hids.append(h)
        new_mems = update_mems(hids, mems, self.mem_len)
        loss = F.cross_entropy(self.out(h).flatten(0, 1), target.flatten())
        return loss, new_mems


def _train(backend, steps=20, qlen=6, bsz=2):
    torch.manual_seed(0)
    model = TinyTXL(backend).to(FUSED_DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    # A periodic sequence (period 5): learnable, and the memory carries the context across
    # segment boundaries.
    period = torch.randint(0, 37, (5, bsz), generator=g)
    data = period.repeat(steps * qlen // 5 + 1, 1)[:steps * qlen + 1].to(FUSED_DEVICE)
    mems, losses = [], []
    for s in range(steps):
        x, y = data[s * qlen:(s + 1) * qlen], data[s * qlen + 1:(s + 1) * qlen + 1]
        loss, mems = model(x, y, mems)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, mems


@pytest.mark.slow  # trains two models, the fused one under the Triton interpreter on CPU
def test_fused_and_reference_train_identically():
    fused, mems_f = _train("triton")
    ref, mems_r = _train("reference")
    assert ref[-1] < ref[0], "the model should learn something in 20 steps"
    for step, (a, b) in enumerate(zip(fused, ref)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"step {step}: fused {a} vs reference {b}"
    assert len(mems_f) == 3 and mems_f[0].shape == (8, 2, 32)
    for a, b in zip(mems_f, mems_r):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
