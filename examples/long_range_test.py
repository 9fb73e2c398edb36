"""Long-range dependency test: does the Transformer-XL memory carry information across segments?

Each example is one stream of ``n_seg * tgt_len`` tokens: random filler tokens, one key token
(drawn from ``n_keys`` values that never occur as filler) at distance ``gap`` before the end,
and a query token ``Q`` at the very last position. The model must answer the key at the query
position. The stream is fed as ``n_seg`` segments of ``tgt_len`` tokens with the memories carried
from segment to segment (``forward(data, target, *mems) -> [loss, *new_mems]``); the loss is
only on the answer (target ``[1, bsz]``: ``MemTransformerLM`` scores the last positions).

The query sits at the last position of its segment, so one attention layer sees distances
``0 .. tgt_len - 1`` inside the segment and ``tgt_len .. tgt_len + mem_len - 1`` through the
memory. The same model is trained twice, with ``mem_len > 0`` and with ``mem_len = 0``, on the
same data; recall accuracy is then measured for every gap and summarised in three bands:

- ``gap < tgt_len``                        (visible to both),
- ``tgt_len <= gap < tgt_len + mem_len``   (visible only through the memory),
- ``gap >= tgt_len + mem_len``             (beyond one layer's reach; deeper layers can relay
                                            a little further, since each memory row itself
                                            attended to the memory before it).

Chance is ``1 / n_keys``. Why this is learnable in a few hundred steps although the memories
are detached (no gradient flows into the previous segments): the memory enters the current
segment as keys and values computed by the current layer's own ``qkv_net`` from the stored
hidden states, so the gradient of the answer's loss trains exactly the projections that
must make the query attend to the key token and copy it (tied input/output embeddings turn
the copied embedding into the answer's logit).

``--quick`` (2 CPU cores, about a minute) exits with status 1 unless the model with memory
beats the one without by ``--margin`` (default 0.3) in the memory-only band.

    python examples/long_range_test.py --quick --plot long_range.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from txl_kernels.models import MemTransformerLM  # noqa: E402


def make_batch(bsz: int, gaps: torch.Tensor, n_seg: int, tgt_len: int, n_keys: int,
               n_filler: int, generator: torch.Generator):
    """(data ``[n_seg * tgt_len, bsz]``, keys ``[bsz]``). Vocabulary: keys ``0 .. n_keys-1``,
    filler ``n_keys .. n_keys + n_filler - 1``, query ``n_keys + n_filler``."""
    total = n_seg * tgt_len
    data = torch.randint(n_keys, n_keys + n_filler, (total, bsz), generator=generator)
    keys = torch.randint(0, n_keys, (bsz,), generator=generator)
    data[total - 1 - gaps, torch.arange(bsz)] = keys
    data[total - 1] = n_keys + n_filler
    return data, keys


def answer_logits(model: MemTransformerLM, data: torch.Tensor, tgt_len: int) -> torch.Tensor:
    """Log-probabilities at the last position after feeding ``data`` segment by segment with
    the memories carried. The earlier segments run without autograd (their memories are
    detached anyway), only the last one records the graph."""
    n_seg = data.shape[0] // tgt_len
    mems = []
    with torch.no_grad():
        for s in range(n_seg - 1):
            out = model.log_probs(data[s * tgt_len:(s + 1) * tgt_len], *mems)
            mems = out[1:]
    return model.log_probs(data[-tgt_len:], *mems)[0][-1]


def build(args, mem_len: int) -> MemTransformerLM:
    torch.manual_seed(args.seed)
    vocab = args.n_keys + args.n_filler + 1
    return MemTransformerLM(vocab, args.n_layer, args.n_head, args.d_model, args.d_head,
                            args.d_inner, dropout=0.0, dropatt=0.0, tie_weight=True,
                            tgt_len=args.tgt_len, mem_len=mem_len, ext_len=0,
                            attn_backend=args.attn_backend,
                            extension_backend=args.extension_backend)


def train(model: MemTransformerLM, args, max_gap: int, label: str) -> list:
    g = torch.Generator().manual_seed(args.seed + 1)  # same data for both models
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    model.train()
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        gaps = torch.randint(1, max_gap + 1, (args.batch_size,), generator=g)
        data, keys = make_batch(args.batch_size, gaps, args.n_seg, args.tgt_len, args.n_keys,
                                args.n_filler, g)
        logp = answer_logits(model, data, args.tgt_len)
        loss = torch.nn.functional.nll_loss(logp, keys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            avg = sum(losses[-args.log_every:]) / len(losses[-args.log_every:])
            print(f"[{label}] step {step + 1:4d}/{args.steps}  answer loss {avg:.3f}  "
                  f"({time.perf_counter() - t0:.1f}s)", flush=True)
    return losses


@torch.no_grad()
def recall_by_gap(model: MemTransformerLM, args, max_gap: int) -> dict:
    model.eval()
    g = torch.Generator().manual_seed(args.seed + 2)
    acc = {}
    for gap in range(1, max_gap + 1):
        gaps = torch.full((args.eval_batch,), gap)
        data, keys = make_batch(args.eval_batch, gaps, args.n_seg, args.tgt_len, args.n_keys,
                                args.n_filler, g)
        pred = answer_logits(model, data, args.tgt_len).argmax(-1)
        acc[gap] = (pred == keys).float().mean().item()
    return acc


def bands(args):
    L, M = args.tgt_len, args.mem_len
    return [(f"gap < {L} (in segment)", lambda d: d < L),
            (f"{L} <= gap < {L + M} (memory)", lambda d: L <= d < L + M),
            (f"gap >= {L + M} (beyond)", lambda d: d >= L + M)]


def band_means(acc: dict, args) -> list:
    out = []
    for _, keep in bands(args):
        vals = [a for d, a in acc.items() if keep(d)]
        out.append(sum(vals) / len(vals) if vals else float("nan"))
    return out


def plot(path: str, accs: dict, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, acc in accs.items():
        ax.plot(list(acc), list(acc.values()), marker=".", label=label)
    ax.axvline(args.tgt_len, color="gray", ls="--", lw=1)
    ax.axvline(args.tgt_len + args.mem_len, color="gray", ls=":", lw=1)
    ax.axhline(1 / args.n_keys, color="red", ls=":", lw=1, label="chance")
    ax.set_xlabel("gap (distance from key to query, tokens)")
    ax.set_ylabel("recall accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"Transformer-XL long-range recall (tgt_len={args.tgt_len}, "
                 f"mem_len={args.mem_len})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small CPU run (about a minute on 2 cores) with a pass/fail verdict")
    p.add_argument("--tgt-len", type=int, default=16)
    p.add_argument("--mem-len", type=int, default=16)
    p.add_argument("--n-seg", type=int, default=3, help="segments per example")
    p.add_argument("--n-keys", type=int, default=8)
    p.add_argument("--n-filler", type=int, default=8)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--d-head", type=int, default=16)
    p.add_argument("--d-inner", type=int, default=64)
    p.add_argument("--steps", type=int, default=None, help="training steps per model")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-batch", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--margin", type=float, default=0.3,
                   help="required accuracy lead of the memory model in the memory band")
    p.add_argument("--attn-backend", default="reference",
                   help='"reference" (default: torch einsum, fast for these tiny CPU models), '
                        '"auto" or "triton" (the fused kernels; on CPU only under '
                        'TRITON_INTERPRET=1, slow)')
    p.add_argument("--extension-backend", default=None,
                   help='the C++ extension ops (memory update, K/V cache, CPU decode step) or '
                        'torch (default "torch" on CPU, else "auto")')
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: these models are too small to "
                        "gain from more, and on a shared machine threads contend)")
    p.add_argument("--plot", default=None, help="PNG path for accuracy against gap")
    p.add_argument("--json", default=None, help="write the accuracies and verdict here")
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 200 if args.quick else 2000
    if args.eval_batch is None:
        args.eval_batch = 64 if args.quick else 256
    if args.extension_backend is None:
        args.extension_backend = "torch"  # the examples run on CPU; the extension is for GPUs
    if args.mem_len <= 0:
        p.error("--mem-len must be > 0 (the comparison model has mem_len 0)")
    if args.n_seg * args.tgt_len < 2:
        p.error("--n-seg * --tgt-len must be >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    max_gap = args.n_seg * args.tgt_len - 1
    print(f"tgt_len={args.tgt_len} mem_len={args.mem_len} segments/example={args.n_seg} "
          f"gaps 1..{max_gap} keys={args.n_keys} (chance {1 / args.n_keys:.3f}) "
          f"steps={args.steps} batch={args.batch_size}", flush=True)
    accs, times = {}, {}
    for label, mem_len in ((f"mem_len={args.mem_len}", args.mem_len), ("mem_len=0", 0)):
        model = build(args, mem_len)
        t0 = time.perf_counter()
        train(model, args, max_gap, label)
        accs[label] = recall_by_gap(model, args, max_gap)
        times[label] = time.perf_counter() - t0
    names = [b[0] for b in bands(args)]
    means = {label: band_means(acc, args) for label, acc in accs.items()}
    w = max(len(n) for n in names) + 2
    print("\nrecall accuracy by gap band")
    print(f"{'':{w}}" + "".join(f"{label:>16}" for label in accs))
    for i, name in enumerate(names):
        print(f"{name:{w}}" + "".join(f"{means[label][i]:>16.3f}" for label in accs))
    print("per gap: " + " ".join(
        f"{d}:{accs[list(accs)[0]][d]:.2f}/{accs[list(accs)[1]][d]:.2f}" for d in accs[list(accs)[0]]))
    print("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))
    with_mem, without = means[list(accs)[0]][1], means[list(accs)[1]][1]
    ok = with_mem - without >= args.margin
    verdict = (f"{'PASS' if ok else 'FAIL'}: in the memory band the model with memory recalls "
               f"{with_mem:.3f}, without {without:.3f} (required lead {args.margin})")
    print(verdict)
    if args.plot:
        plot(args.plot, accs, args)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"accuracy": {k: {str(d): a for d, a in v.items()} for k, v in accs.items()},
                       "bands": names, "band_means": means, "pass": ok, "times_s": times}, f,
                      indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
