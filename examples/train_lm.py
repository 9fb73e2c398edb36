"""Train a Transformer-XL language model (``txl_kernels.models.MemTransformerLM``) with segment
recurrence, as a byte-level ("character-level") LM on the Python standard library's sources.

Corpus: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (the running
interpreter's ``Lib/``; ``site-packages`` and the ``test`` / ``tests`` packages are left out),
sorted by path and split by file: file number ``i`` goes to valid if ``i % 20 == 1``, to test
if ``i % 20 == 2``, else to train. Files are UTF-8 bytes joined by a NUL byte; the vocabulary
is the 256 byte values, and the loss is reported in bits per character (per byte: the sources
are nearly all ASCII).

Training follows the original Transformer-XL recipe: the train stream is cut into ``bsz``
columns, each fed as consecutive segments of ``tgt_len`` tokens, the model's memories
(``forward(data, target, *mems) -> [loss, *new_mems]``, updated by ``update_mems`` inside
the model) carried from one segment to the next. Evaluation runs the K/V cache path
(``model.new_cache(bsz)`` / ``model(data, target, cache=cache)``). A checkpoint
(``ckpt.pt``), the learning curve (``curve.png``) and ``metrics.json`` go to ``--out``.

    python examples/train_lm.py --quick                  # 2 CPU cores, a few minutes
    python examples/train_lm.py                          # GPU-sized run: bf16 autocast, fused
    python examples/train_lm.py --compile --checkpoint   # torch.compile, activation checkpoints
    torchrun --standalone --nproc_per_node 2 examples/train_lm.py --quick --ddp
    torchrun --standalone --nproc_per_node 8 examples/train_lm.py --fsdp

Distributed (``--ddp``: DistributedDataParallel; ``--fsdp``: FSDP2 ``fully_shard`` per layer
and on the model): the global batch ``--batch-size`` is split into contiguous column shards,
rank ``r`` trains on columns ``[r * b, (r + 1) * b)`` with ``b = batch / world`` and carries the
memories of its own shard; gloo on CPUs, NCCL on GPUs. Losses and gradients equal those of one
process with the whole batch (tests/test_examples.py checks it).

Context parallelism (``--cp N``): every segment is split along its length over ``N`` ranks
(contiguous slices in rank order, ``MemTransformerLM(..., cp_group=)``; the memory stays with
its slice), the attention runs around the ring of ``txl_kernels.distributed``; the
parameters' gradients are all-reduced over the context group. With ``--ddp`` the ranks form a
2-D ``DeviceMesh`` (data x context, ``world = data * N``): DDP over the data dimension. The
memory is the whole previous segment, so ``--mem-len`` must equal ``--tgt-len``; segments
shorter than ``--tgt-len`` (the end of an epoch) are skipped. Same losses and gradients as
one process (tests/test_examples.py)::

    torchrun --standalone --nproc_per_node 2 examples/train_lm.py --quick --cp 2
    torchrun --standalone --nproc_per_node 4 examples/train_lm.py --quick --cp 2 --ddp

``--checkpoint``: activation checkpointing per decoder layer, the model's own option
``MemTransformerLM(..., checkpoint=True)`` (``torch.utils.checkpoint``, non-reentrant, RNG
state preserved: the same losses and gradients, state_dict keys unchanged).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import sysconfig
import time
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from txl_kernels.models import MemTransformerLM  # noqa: E402

LOG2 = math.log(2.0)


# ---- data ----------------------------------------------------------------------------------
def stdlib_files(root: Optional[str] = None) -> List[str]:
    """Sorted ``*.py`` paths of the standard library (no site-packages, no test packages)."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "test", "tests",
                                          "__pycache__", "idle_test"))
        out.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(out)


def split_files(files: List[str]) -> dict:
    """train / valid / test by file number: ``i % 20 == 1`` valid, ``== 2`` test."""
    split = {"train": [], "valid": [], "test": []}
    for i, f in enumerate(files):
        split["valid" if i % 20 == 1 else "test" if i % 20 == 2 else "train"].append(f)
    return split


def load_bytes(files: List[str], limit: Optional[int] = None) -> torch.Tensor:
    """The files' bytes joined by NUL (``uint8`` -> ``int64``), at most ``limit`` bytes."""
    chunks, n = [], 0
    for f in files:
        with open(f, "rb") as fh:
            b = fh.read() + b"\0"
        chunks.append(b)
        n += len(b)
        if limit is not None and n >= limit:
            break
    data = b"".join(chunks)[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batchify(stream: torch.Tensor, bsz: int) -> torch.Tensor:
    """``[n]`` -> ``[n // bsz, bsz]``: column ``j`` is the ``j``-th contiguous piece."""
    n = stream.numel() // bsz
    if n < 2:
        raise ValueError(f"batchify: {stream.numel()} tokens cannot make {bsz} columns of at "
                         f"least 2 tokens")
    return stream[:n * bsz].view(bsz, n).t().contiguous()


def segments(cols: torch.Tensor, tgt_len: int):
    """(data, target) pairs ``[<= tgt_len, bsz]`` over ``cols`` ``[n, bsz]``, in order."""
    for i in range(0, cols.shape[0] - 1, tgt_len):
        seq = min(tgt_len, cols.shape[0] - 1 - i)
        yield cols[i:i + seq], cols[i + 1:i + 1 + seq]


# ---- model ---------------------------------------------------------------------------------
def build_model(args, device, cp_group=None) -> MemTransformerLM:
    torch.manual_seed(args.seed)
    model = MemTransformerLM(256, args.n_layer, args.n_head, args.d_model, args.d_head,
                             args.d_inner, args.dropout, args.dropatt, tie_weight=True,
                             tgt_len=args.tgt_len, mem_len=args.mem_len, ext_len=0,
                             attn_backend=args.attn_backend,
                             extension_backend=args.extension_backend,
                             checkpoint=args.checkpoint, cp_group=cp_group)
    return model.to(device)


# ---- distributed ---------------------------------------------------------------------------
def dist_info() -> Tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def mesh_groups(cp: int, device):
    """(data group, context group) of a 2-D ``DeviceMesh`` ``(world / cp, cp)`` (data x
    context): ranks ``[d * cp, (d + 1) * cp)`` share one sequence."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % cp:
        raise SystemExit(f"--cp {cp} must divide the world size {world}")
    mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return mesh.get_group("dp"), mesh.get_group("cp")


def wrap(model: nn.Module, mode: str, device, group=None) -> nn.Module:
    """``"ddp"``: DistributedDataParallel (over ``group``, default the world); ``"fsdp"``: FSDP2
    ``fully_shard`` on every decoder layer, then on the model (embedding, tied softmax,
    biases); ``"none"``: as is."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                   process_group=group)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    return model


def end_process(code: int = 0) -> None:
    """Leave a process that ran gloo collectives without interpreter finalisation.

    ``destroy_process_group`` does not free a ``ProcessGroupGloo`` that DDP / FSDP2 still
    reference, so its worker threads outlive ``main``. One of them can still be destroying the
    last collective's work, whose tensors are Python objects, when the interpreter finalises:
    the decref then takes the GIL during finalisation, the thread is unwound and the process
    aborts ("terminate called without an active exception", SIGABRT, after a successful run;
    described in pytorch/pytorch#179291). So flush and ``os._exit`` instead of returning to the
    interpreter.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def unwrap(model: nn.Module) -> MemTransformerLM:
    return model.module if hasattr(model, "module") else model


def full_state_dict(model: nn.Module) -> dict:
    """A plain (unsharded) state_dict on the CPU; a collective under FSDP (all ranks call)."""
    out = {}
    for k, v in unwrap(model).state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


def full_grads(model: nn.Module) -> dict:
    """Gradients by parameter name, unsharded (a collective under FSDP)."""
    out = {}
    for k, p in unwrap(model).named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[k] = None if g is None else g.detach().cpu().clone()
    return out


def train_step(model: nn.Module, data: torch.Tensor, target: torch.Tensor, mems,
               opt: Optional[torch.optim.Optimizer], autocast=None, grad_clip: float = 0.0,
               cp_group=None):
    """One segment: forward with the carried memories, backward, optimizer step (if ``opt``).
    Returns (mean loss of this rank's shard in nats, detached, the new memories).
    ``cp_group``: ``data`` / ``target`` are this rank's slice of the segment; the loss is
    the mean over the whole segment (every rank of the group returns it) and the gradients
    are summed over the group before the step."""
    with (autocast or contextlib.nullcontext)():
        out = model(data, target, *mems)
    if cp_group is None:
        loss = out[0].float().mean()
    else:
        import torch.distributed as dist

        count = torch.tensor(float(out[0].numel()), device=out[0].device)
        dist.all_reduce(count, group=cp_group)
        loss = out[0].float().sum() / count
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    if cp_group is not None:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=cp_group)
        loss = loss.detach()
        dist.all_reduce(loss, group=cp_group)
    if opt is not None:
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
    return loss.detach(), list(out[1:])


def cp_slice(seg: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """Rank ``cp_rank``'s contiguous slice of a segment ``[len, bsz]`` (``tensor_split``)."""
    from txl_kernels.distributed import shard_sequence

    return shard_sequence(seg, 0, cp_rank, cp, "contiguous")


def epochs(cols: torch.Tensor, tgt_len: int, full_only: bool = False):
    """``(data, target, new_epoch)`` forever: the segments of ``cols`` (only those of
    ``tgt_len`` rows if ``full_only``), then again."""
    while True:
        for i, (data, target) in enumerate(segments(cols, tgt_len)):
            if full_only and data.shape[0] < tgt_len:
                continue
            yield data, target, i == 0


@torch.no_grad()
def evaluate(model: MemTransformerLM, cols: torch.Tensor, tgt_len: int, autocast=None,
             max_segments: Optional[int] = None) -> float:
    """Bits per character over ``cols`` ``[n, bsz]`` with the K/V cache (memory carried)."""
    was = model.training
    model.eval()
    autocast = autocast or contextlib.nullcontext
    cache = model.new_cache(cols.shape[1])
    total, count = 0.0, 0
    for i, (data, target) in enumerate(segments(cols, tgt_len)):
        if max_segments is not None and i >= max_segments:
            break
        with autocast():
            loss = model(data, target, cache=cache)[0]
        total += loss.float().sum().item()
        count += loss.numel()
    model.train(was)
    return total / max(count, 1) / LOG2


def plot_curve(path: str, train_pts, valid_pts) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if train_pts:
        ax.plot(*zip(*train_pts), label="train (running mean)")
    if valid_pts:
        ax.plot(*zip(*valid_pts), marker="o", label="valid (K/V cache)")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per character")
    ax.set_title("Transformer-XL byte-level LM on the Python standard library")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- CLI -----------------------------------------------------------------------------------
QUICK = dict(n_layer=2, n_head=2, d_model=64, d_head=32, d_inner=128, tgt_len=32, mem_len=32,
             batch_size=16, steps=1000, eval_every=500, lr=3e-3, warmup=20, eval_bsz=8,
             train_bytes=400_000, eval_bytes=40_000, dropout=0.0, dropatt=0.0)
FULL = dict(n_layer=12, n_head=8, d_model=512, d_head=64, d_inner=2048, tgt_len=256,
            mem_len=256, batch_size=32, steps=20000, eval_every=1000, lr=2.5e-4, warmup=1000,
            eval_bsz=16, train_bytes=None, eval_bytes=None, dropout=0.1, dropatt=0.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small CPU run (a few minutes)")
    for k, v in FULL.items():
        typ = float if isinstance(v, float) else int
        p.add_argument("--" + k.replace("_", "-"), type=typ, default=None,
                       help=f"default {v} (--quick: {QUICK[k]})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-clip", type=float, default=0.25)
    p.add_argument("--device", default=None, help="default cuda if available, else cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="autocast dtype (default bf16 on CUDA, fp32 on CPU; no fp16: it "
                        "would need a GradScaler)")
    p.add_argument("--attn-backend", default=None,
                   help='"auto" (fused on CUDA; default), "triton" or "reference" (CPU default)')
    p.add_argument("--extension-backend", default=None,
                   help='the C++ extension ops (memory update, K/V cache, CPU decode step) or '
                        'torch: default "auto" on CUDA, "torch" on CPU')
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--checkpoint", action="store_true",
                   help="activation checkpointing per decoder layer (the model's checkpoint=True)")
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel (torchrun)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard (torchrun)")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallelism: split each segment over this many ranks "
                        "(torchrun; with --ddp a data x context mesh)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 per process on CPU)")
    p.add_argument("--out", default="runs/train_lm", help="checkpoint, curve and metrics")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.ddp and args.fsdp:
        p.error("--ddp and --fsdp are exclusive")
    if args.cp < 1:
        p.error(f"--cp must be >= 1, got {args.cp}")
    if args.cp > 1 and args.fsdp:
        p.error("--cp combines with --ddp, not --fsdp")
    if args.cp > 1 and args.mem_len != args.tgt_len:
        p.error(f"--cp: the memory is sharded with its segment, so --mem-len must equal "
                f"--tgt-len ({args.tgt_len}), got {args.mem_len}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    mode = "ddp" if args.ddp else "fsdp" if args.fsdp else "none"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if mode != "none" or args.cp > 1:
        if "RANK" not in os.environ:
            raise SystemExit("--ddp / --fsdp / --cp: start with torchrun, e.g. torchrun "
                             "--standalone --nproc_per_node 2 examples/train_lm.py --quick --ddp")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist_info()
    dp_group = cp_group = None
    dp_rank, dp_world, cp_rank = rank, world, 0
    if args.cp > 1:
        dp_group, cp_group = mesh_groups(args.cp, device)
        dp_rank, dp_world = dist.get_rank(dp_group), dist.get_world_size(dp_group)
        cp_rank = dist.get_rank(cp_group)
        if mode == "none" and dp_world > 1:
            raise SystemExit(f"--cp {args.cp} on {world} processes: add --ddp for the data "
                             "dimension")
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    args.attn_backend = args.attn_backend or ("auto" if device.type == "cuda" else "reference")
    args.extension_backend = args.extension_backend or ("auto" if device.type == "cuda"
                                                        else "torch")
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    amp = {"bf16": torch.bfloat16}.get(dtype)
    autocast = (functools.partial(torch.autocast, device.type, dtype=amp) if amp
                else contextlib.nullcontext)
    if args.batch_size % dp_world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the data-"
                         f"parallel size {dp_world}")

    split = split_files(stdlib_files())
    train = load_bytes(split["train"], args.train_bytes)
    valid = load_bytes(split["valid"], args.eval_bytes)
    test = load_bytes(split["test"], args.eval_bytes)
    if rank == 0:
        print(f"stdlib {sysconfig.get_paths()['stdlib']}: {len(split['train'])} train / "
              f"{len(split['valid'])} valid / {len(split['test'])} test files; using "
              f"{train.numel():,} / {valid.numel():,} / {test.numel():,} bytes", flush=True)
    b = args.batch_size // dp_world
    cols = batchify(train, args.batch_size)[:, dp_rank * b:(dp_rank + 1) * b].to(device)
    valid_cols = batchify(valid, args.eval_bsz).to(device)
    test_cols = batchify(test, args.eval_bsz).to(device)

    model = build_model(args, device, cp_group)
    n_params = sum(p.numel() for p in model.parameters())
    net = wrap(model, mode, device, dp_group)
    if args.compile:
        net = torch.compile(net)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(args.warmup, 1))
                                              * 0.5 * (1 + math.cos(math.pi * min(s, args.steps)
                                                                    / args.steps)))
    if rank == 0:
        print(f"model: {n_params:,} parameters, {args.n_layer} layers, d_model {args.d_model}, "
              f"tgt_len {args.tgt_len}, mem_len {args.mem_len}; device {device}, {dtype}, "
              f"attention {args.attn_backend}, {mode} x{world} (context x{args.cp}), "
              f"batch {args.batch_size} ({b} per data rank)", flush=True)
    os.makedirs(args.out, exist_ok=True)

    bar = None
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
        except ImportError:
            print("(tqdm is not installed: no progress bar)")
    train_pts, valid_pts, recent = [], [], []
    t_start = time.perf_counter()
    tokens = 0

    def eval_on_rank0(split_cols) -> Optional[float]:
        state = full_state_dict(net) if mode == "fsdp" else None  # collective
        result = None
        if rank == 0:
            if mode == "fsdp":
                plain = build_model(args, device)
                plain.load_state_dict(state)
            else:
                plain = unwrap(net)
                plain = getattr(plain, "_orig_mod", plain)
            result = evaluate(plain, split_cols, args.tgt_len, autocast)
        if world > 1:
            dist.barrier()
        return result

    def on_step(step, loss, ntok):
        nonlocal tokens
        tokens += ntok * world
        recent.append(loss.item())
        del recent[:-50]
        if bar is not None:
            dt = time.perf_counter() - t_start
            bar.set_postfix(loss=f"{loss.item():.3f}", bpc=f"{loss.item() / LOG2:.3f}",
                            tok_s=f"{tokens / dt:,.0f}")
            bar.update(1)
        if (step + 1) % 10 == 0:
            train_pts.append((step + 1, sum(recent) / len(recent) / LOG2))

    vb = eval_on_rank0(valid_cols)
    if rank == 0:
        valid_pts.append((0, vb))
        (bar.write if bar is not None else print)(f"step 0: valid {vb:.3f} bpc")
    mems, done = [], 0
    batches = epochs(cols, args.tgt_len, full_only=args.cp > 1)
    while done < args.steps:
        for _ in range(min(args.eval_every, args.steps - done)):
            data, target, new_epoch = next(batches)
            if new_epoch:
                mems = []  # an epoch starts without memory
            if cp_group is not None:  # this rank's slice of the segment
                data, target = cp_slice(data, cp_rank, args.cp), cp_slice(target, cp_rank,
                                                                         args.cp)
            loss, mems = train_step(net, data, target, mems, opt, autocast, args.grad_clip,
                                    cp_group)
            sched.step()
            on_step(done, loss, target.numel())
            done += 1
        vb = eval_on_rank0(valid_cols)
        if rank == 0:
            valid_pts.append((done, vb))
            msg = f"step {done}: valid {vb:.3f} bpc"
            (bar.write if bar is not None else print)(msg)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start
    test_bpc = eval_on_rank0(test_cols)
    state = full_state_dict(net)  # collective under FSDP
    if rank == 0:
        torch.save({"model": state, "args": vars(args), "step": done},
                   os.path.join(args.out, "ckpt.pt"))
        plot_curve(os.path.join(args.out, "curve.png"), train_pts, valid_pts)
        metrics = {"train_bpc": train_pts, "valid_bpc": valid_pts, "test_bpc": test_bpc,
                   "tokens_per_s": tokens / elapsed, "seconds": elapsed, "world": world,
                   "mode": mode}
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=1)
        print(f"done: {done} steps in {elapsed:.1f}s ({tokens / elapsed:,.0f} tokens/s); "
              f"valid {valid_pts[-1][1]:.3f} bpc, test {test_bpc:.3f} bpc; wrote "
              f"{args.out}/ckpt.pt, curve.png, metrics.json", flush=True)
    if mode != "none" or args.cp > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    if "RANK" in os.environ:  # started by torchrun: gloo's threads may still run (end_process)
        end_process(status)
    sys.exit(status)
