"""Accuracy of the LM's 8-bit memory: a Transformer-XL LM trained on a task that
needs its memory, evaluated with a full-precision, an int8 and an fp8 K/V cache.

The task: a stream of blocks, each ``PERIOD`` random tokens written ``REPEAT`` times in a row,
so a repeated token is predictable only from the token ``PERIOD`` positions back; with
``PERIOD`` > ``tgt_len`` that token is in the memory (the cache) for most positions. A small
``MemTransformerLM`` (2 layers, 2 heads of 64, d_model 128) is trained on CPU with segment
recurrence (the mems path) for 600 steps (about 40 s on one core), until most of the
repeats are predicted nearly perfectly. Then, over many segments of a held-out stream:

- the mean absolute difference of the per-token NLL between the full-precision cache and the
  8-bit ones (int8 / fp8, fp32 and fp16 scales), the mean NLL of each, and the same for a
  3-bit memory (qmax 3, the control that shows the measurement can see an error);
- the attention output's relative error ``||a8 - a|| / ||a||`` per dtype: every layer's
  attention over [memory; segment] with the memory quantised (``rel_attention(...,
  memory=QuantizedKV)``) against the full-precision memory, on the trained model's own
  queries, keys and values, over the held-out segments.

    python -m benchmarks.lm_quant_accuracy          # prints a table (docs/transformer-xl.md, BENCHMARKS.md)
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List

import torch

from txl_kernels.functional import rel_attention
from txl_kernels.models import MemTransformerLM
from txl_kernels.quant import quantize_kv

VOCAB, PERIOD, REPEAT = 64, 24, 3
TGT_LEN, MEM_LEN, BSZ = 16, 48, 8
DTYPES = {"int8": (torch.int8, torch.float32), "int8, fp16 scales": (torch.int8, torch.float16),
          "fp8 e4m3": (torch.float8_e4m3fn, torch.float32)}


def stream(n_tokens: int, bsz: int, seed: int) -> torch.Tensor:
    """``[n_tokens, bsz]`` columns of blocks of PERIOD random tokens repeated REPEAT times."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-n_tokens // (PERIOD * REPEAT))
    base = torch.randint(0, VOCAB, (blocks, 1, PERIOD, bsz), generator=g)
    return base.expand(blocks, REPEAT, PERIOD, bsz).reshape(-1, bsz)[:n_tokens]


def train(steps: int, log=print) -> MemTransformerLM:
    torch.manual_seed(0)
    model = MemTransformerLM(VOCAB, 2, 2, 128, 64, 256, 0.0, 0.0, tgt_len=TGT_LEN,
                             mem_len=MEM_LEN, attn_backend="reference")
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    data = stream(steps * TGT_LEN + 1, BSZ, seed=1)
    mems: List[torch.Tensor] = []
    t0 = time.perf_counter()
    for s in range(steps):
        x = data[s * TGT_LEN:(s + 1) * TGT_LEN]
        y = data[s * TGT_LEN + 1:(s + 1) * TGT_LEN + 1]
        loss, *mems = model(x, y, *mems)
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
        if (s + 1) % 100 == 0:
            log(f"  step {s + 1}: train NLL {loss.mean().item():.3f} "
                f"({time.perf_counter() - t0:.0f} s)")
    return model.eval()


def _coarse(cache, qmax: int, new_rows: int) -> None:
    """Quantise-dequantise the last ``new_rows`` memory rows of a full-precision cache with
    ``qmax`` levels per sign (the 3-bit control), or zero them (qmax 0: no memory)."""
    lo = cache.start + cache.mlen - new_rows
    for buf in cache.k + cache.v:
        rows = buf[lo:cache.start + cache.mlen].view(new_rows, cache.bsz, cache.n_head, -1)
        if qmax == 0:
            rows.zero_()
            continue
        scale = rows.abs().amax(-1, keepdim=True) / qmax
        safe = torch.where(scale > 0, scale, 1.0)
        rows.copy_(torch.where(scale > 0, (rows / safe).round().clamp(-qmax, qmax) * scale, 0.0))


def nll_per_token(model, data: torch.Tensor, dtype=None, scale_dtype=torch.float32,
                  coarse_qmax=None) -> torch.Tensor:
    cache = model.new_cache(data.shape[1], dtype=dtype, scale_dtype=scale_dtype)
    out = []
    with torch.no_grad():
        for s in range(0, data.shape[0] - 1, TGT_LEN):
            x, y = data[s:s + TGT_LEN], data[s + 1:s + 1 + TGT_LEN]
            (loss,) = model(x, y, cache=cache)
            out.append(loss)
            if coarse_qmax is not None:
                _coarse(cache, coarse_qmax, min(cache.mlen, x.shape[0]))
    return torch.cat(out)


def attention_errors(model, data: torch.Tensor) -> Dict[str, float]:
    """``||a8 - a|| / ||a||`` of every layer's attention output per 8-bit dtype, summed over
    layers and segments, on the full-precision cache's queries / keys / values."""
    cache = model.new_cache(data.shape[1])
    num = {name: 0.0 for name in DTYPES}
    den = 0.0
    seen = []

    def record(layer):
        inner = layer.forward_cached

        def wrapped(w, r, u, vb, c, i, window):
            seen.append((layer, w, r, c.start, c.mlen, i, window))
            return inner(w, r, u, vb, c, i, window)
        return wrapped

    for layer in model.layers:
        layer.forward_cached = record(layer)
    try:
        with torch.no_grad():
            for s in range(0, data.shape[0] - 1, TGT_LEN):
                x, y = data[s:s + TGT_LEN], data[s + 1:s + 1 + TGT_LEN]
                seen.clear()
                model(x, y, cache=cache)
                for layer, w, r, start, mlen, i, window in seen:
                    if mlen == 0:
                        continue
                    att = layer.dec_attn
                    qlen, bsz = w.shape[:2]
                    H, D = att.n_head, att.d_head
                    q = att.qkv_net(w)[..., :H * D].view(qlen, bsz, H, D).transpose(0, 1)
                    k = cache.k[i][start:start + mlen + qlen].view(-1, bsz, H, D).transpose(0, 1)
                    v = cache.v[i][start:start + mlen + qlen].view(-1, bsz, H, D).transpose(0, 1)
                    args = (r, model.r_w_bias, model.r_r_bias)
                    kw = dict(window_size=window, softmax_scale=att.scale, backend="reference")
                    ref = rel_attention(q, k, v, *args, **kw)
                    den += ref.norm().item()
                    for name, (dt, sdt) in DTYPES.items():
                        mem = quantize_kv(k[:, :mlen], v[:, :mlen], dt, sdt)
                        got = rel_attention(q, k[:, mlen:], v[:, mlen:], *args, memory=mem, **kw)
                        num[name] += (got - ref).norm().item()
    finally:
        for layer in model.layers:
            del layer.forward_cached
    return {name: num[name] / den for name in DTYPES}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-tokens", type=int, default=40 * TGT_LEN + 1)
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"train: {a.steps} steps of tgt_len {TGT_LEN}, bsz {BSZ}, mem_len {MEM_LEN}; task: "
          f"blocks of {PERIOD} random tokens (vocabulary {VOCAB}) repeated {REPEAT} times")
    model = train(a.steps)
    data = stream(a.eval_tokens, BSZ, seed=2)
    segs = (a.eval_tokens - 1) // TGT_LEN
    full = nll_per_token(model, data)
    print(f"\nheld-out: {segs} segments x {TGT_LEN} tokens x bsz {BSZ}; full-precision cache "
          f"mean NLL {full.mean():.4f} nats")
    print("| memory | mean NLL (nats) | mean abs NLL diff vs fp32 memory | attention rel. error |")
    print("|---|---|---|---|")
    print(f"| fp32 (reference) | {full.mean():.4f} | 0 | 0 |")
    errors = attention_errors(model, data)
    for name, (dt, sdt) in DTYPES.items():
        got = nll_per_token(model, data, dt, sdt)
        print(f"| {name} | {got.mean():.4f} | {(got - full).abs().mean():.4f} | "
              f"{errors[name]:.2e} |")
    coarse = nll_per_token(model, data, coarse_qmax=3)
    print(f"| 3-bit (qmax 3, control) | {coarse.mean():.4f} | "
          f"{(coarse - full).abs().mean():.4f} | - |")
    zeroed = nll_per_token(model, data, coarse_qmax=0)
    print(f"| memory zeroed (control) | {zeroed.mean():.4f} | "
          f"{(zeroed - full).abs().mean():.4f} | - |")


if __name__ == "__main__":
    main()
