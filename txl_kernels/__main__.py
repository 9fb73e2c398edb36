"""``python -m txl_kernels``: environment report, extension build, and a self-check.

Like DeepSpeed's ``ds_report``: prints the environment (torch, triton, CUDA toolkit, device)
and which backends are usable here and why not; builds the segment-memory extension (saying
so: a first build takes a minute or more); then runs a Transformer-XL-base-shaped layer
(10 heads of 41, d_model 410), scaled to run in seconds on a CPU, through every usable
backend, forward and backward, and prints each one's max difference from the reference, its
time and its memory. Exits 1 if a usable backend disagrees with the reference, 2 on a bad
``--device``. (The full build report: ``python -m tools.build_check`` in a source checkout.)

On ``--device cpu`` the fused Triton kernels can only run under the Triton interpreter: unless
``--no-interpret`` is given, this command sets ``TRITON_INTERPRET=1`` before the kernels are
created and says so. Importing this module changes nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import txl_kernels
from txl_kernels import FusedRelAttention, _build, _utils, fused_available, update_mems

# Transformer-XL base (WikiText-103): n_head 10, d_model 410, d_head 41, tgt_len 150, mem 150.
BASE = dict(n_head=10, d_model=410, d_head=41)
SHAPES = {
    "cpu": dict(qlen=24, mlen=24, bsz=2),
    "cuda": dict(qlen=150, mlen=150, bsz=16),
}
# A backend disagrees with the reference when its error is above these (max abs, on outputs and
# gradients, relative to the reference's largest magnitude).
TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _row(key: str, value: str) -> None:
    print(f"  {key:<28} {value}")


def _activation_bytes(fn):
    """Run fn() and return (result, bytes of distinct storages saved for backward)."""
    seen = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        except Exception:  # pragma: no cover - tensor subclasses without storage
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _run_layer(layer, inputs, device):
    w, r, mems, mask = inputs
    w = w.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out, saved = _activation_bytes(lambda: layer(w, r, attn_mask=mask, mems=mems))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    out.backward(g)
    if device.type == "cuda":
        torch.cuda.synchronize()
        mem = f"{(torch.cuda.max_memory_allocated() - base) / 2**20:8.1f} MiB peak"
    else:
        mem = f"{saved / 2**20:8.2f} MiB saved for backward"
    elapsed = time.perf_counter() - t0
    grads = [w.grad] + [p.grad for p in layer.parameters()]
    return out.detach(), [x.detach().clone() for x in grads], elapsed, mem


def _device(spec: str) -> torch.device:
    """The --device to run on, or ValueError with a one-line reason."""
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"--device {spec!r} is not a torch device (expected cpu or cuda[:N])") \
            from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec}: the self-check runs on cpu or cuda tensors "
                         f"({device.type} tensors have no kernels or data to compare)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: no CUDA device is visible "
                             f"(torch {torch.__version__}, CUDA build: "
                             f"{torch.version.cuda or 'no'}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: only {torch.cuda.device_count()} CUDA "
                             f"device(s) are visible")
    return device


def _interpreter(device: torch.device, allowed: bool) -> str:
    """Decide whether the fused kernels run under the Triton interpreter; say what was done."""
    if _utils.interpreting():
        return "on (TRITON_INTERPRET=1 was set by the caller)"
    if device.type == "cuda" or not allowed:
        return "off" + ("" if device.type == "cuda" else " (--no-interpret)")
    os.environ["TRITON_INTERPRET"] = "1"
    if not _utils.interpreting():  # the kernels were created before (only in-process callers)
        return "off: TRITON_INTERPRET=1 was set too late, the kernels already exist"
    return ("on: set TRITON_INTERPRET=1 here, because CPU tensors can only run the fused "
            "kernels under the Triton interpreter (--no-interpret: do not)")


def _lm_report(device: torch.device) -> bool:
    """The two LM workloads of ``benchmarks/test_bench_lm.py`` at its small size (4 layers,
    d_model 128, vocabulary 2000; eval tgt_len 16 / mem_len 160, generate 32 tokens after 64),
    so the report stays quick: against HF TransfoXL on the same weights when transformers 4.x
    is importable, else ours with the K/V cache against ours on the mems path. Needs the
    source checkout (the benchmarks package); the realistic sizes: ``python -m
    benchmarks.test_bench_lm``. Returns False when greedy tokens differ from HF's."""
    print("\nTransformer-XL LM (txl_kernels.models), small size, fp32, one CPU thread: "
          "time per call")
    try:
        import benchmarks.test_bench_lm as lm
    except Exception as exc:
        _row("skipped", f"needs the source checkout's benchmarks package ({type(exc).__name__}: "
                        f"{exc}); run from the repository root")
        return True
    threads = torch.get_num_threads()
    try:
        res = lm.compare(lm.SMALL, lm.SMALL_EVAL, lm.SMALL_GEN, min_run_time_s=0.2,
                         log=lambda line: None, device=device)
    except AssertionError as exc:
        _row("generate", f"FAILED: {exc}")
        return False
    finally:
        torch.set_num_threads(threads)
    e, g = res["eval"], res["generate"]
    ev = lm.SMALL_EVAL
    gen = lm.SMALL_GEN
    _row("sizes", f"{lm.SMALL['n_layer']} layers, d_model {lm.SMALL['d_model']}, vocabulary "
                  f"{lm.SMALL['n_token']}; eval tgt_len {ev['tgt_len']} / mem_len "
                  f"{ev['mem_len']}, bsz {ev['bsz']}; generate {gen['new']} after "
                  f"{gen['prompt']}, mem_len {gen['mem_len']}")
    if res["hf"] is None:
        _row("eval, K/V cache", f"{e['txl_kernels'] * 1e3:8.1f} ms   "
                                f"HF {e['hf'] * 1e3:.1f} ms: {e['hf'] / e['txl_kernels']:.2f}x")
        _row("eval, mems path", f"{e['txl_kernels_mems'] * 1e3:8.1f} ms   "
                                f"HF: {e['hf'] / e['txl_kernels_mems']:.2f}x")
        _row("generate (greedy)", f"{g['txl_kernels'] * 1e3:8.1f} ms   HF {g['hf'] * 1e3:.1f}"
                                  f" ms: {g['hf'] / g['txl_kernels']:.2f}x (same tokens)")
    else:
        _row("HF TransfoXL", f"not compared: {res['hf']}")
        _row("eval, K/V cache", f"{e['txl_kernels'] * 1e3:8.1f} ms   "
                                f"{e['txl_kernels_mems'] / e['txl_kernels']:.2f}x the mems path")
        _row("eval, mems path", f"{e['txl_kernels_mems'] * 1e3:8.1f} ms")
        _row("generate (greedy)", f"{g['txl_kernels'] * 1e3:8.1f} ms")
    print("  (small sizes, where per-call overhead weighs most; the full sizes and ratios: "
          "BENCHMARKS.md)")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m txl_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                    help="default: float16 on CUDA, float32 on CPU")
    ap.add_argument("--no-build", action="store_true", help="skip building the extension")
    ap.add_argument("--no-interpret", action="store_true",
                    help="on CPU, do not set TRITON_INTERPRET=1 (the fused path is then skipped)")
    args = ap.parse_args(argv)
    try:
        device = _device(args.device)
    except ValueError as exc:
        print(f"python -m txl_kernels: error: {exc}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.float16 if device.type == "cuda" else torch.float32)
    failures = []

    print(f"txl_kernels {txl_kernels.__version__}: environment")
    interp = _interpreter(device, not args.no_interpret)
    try:
        import triton
        triton_v = triton.__version__
    except Exception as exc:  # pragma: no cover - triton is a dependency
        triton_v = f"not importable ({type(exc).__name__}: {exc})"
    _row("torch", f"{torch.__version__} (CUDA runtime {torch.version.cuda or 'none'})")
    _row("triton", triton_v)
    _row("CUDA device", torch.cuda.get_device_name(device) if device.type == "cuda"
         else ("none visible" if not torch.cuda.is_available() else "available, not used"))
    _row("Triton interpreter", interp)
    _row("CUDA toolkit", _build.cuda_home() or "not found")

    print("\nbackends")
    _row("reference", "usable (einsum path, any device)")
    fused_ok, why = fused_available(device)
    _row(f"triton on {device.type}", ("usable: " if fused_ok else "not usable: ") + why)

    print("\nsegment-memory extension (update_mems)")
    if args.no_build:
        _row("build", "skipped (--no-build)")
    else:
        print("  building/loading the C++ extension (the first build takes a minute or more)...",
              flush=True)
        t0 = time.perf_counter()
        ext = _build.load_extension(verbose=False)
        _row("extension", (f"loaded in {time.perf_counter() - t0:.1f} s" if ext is not None
                           else f"not available: {_build.extension_status()['reason']}"))
    hids = [torch.randn(5, 3, 8, device=device) for _ in range(2)]
    mems = [torch.randn(7, 3, 8, device=device) for _ in range(2)]
    new = update_mems(hids, mems, mem_len=6, ext_len=1,
                      backend="torch" if args.no_build else "auto")
    want = [torch.cat([m, h])[max(0, 7 + 4 - 6):7 + 4] for m, h in zip(mems, hids)]
    same = all(torch.equal(a, b) for a, b in zip(new, want))
    _row("update_mems == formula", "yes" if same else "NO")
    if not same:
        failures.append("update_mems")
    cpu_ok = False
    if device.type == "cpu":  # the fused C++ kernel of rel_attention (docs/cpu.md)
        from .cpu_kernel import cpu_kernel_available
        cpu_ok, why = (False, "--no-build") if args.no_build else cpu_kernel_available()
        _row("cpu attention kernel", ("built: " if cpu_ok else "not built: ") + why)

    shape = SHAPES["cuda" if device.type == "cuda" else "cpu"]
    qlen, mlen, bsz = shape["qlen"], shape["mlen"], shape["bsz"]
    print(f"\nTransformer-XL layer: n_head {BASE['n_head']}, d_head {BASE['d_head']}, d_model "
          f"{BASE['d_model']}, qlen {qlen}, mem {mlen}, bsz {bsz}, {dtype}, {device}, "
          f"forward + backward")
    torch.manual_seed(0)
    layers = {}
    backends = ["reference"] + (["triton"] if fused_ok else []) + (["cpu"] if cpu_ok else [])
    for name in backends:
        layers[name] = FusedRelAttention(**BASE, dropout=0.0, untie_r=True, backend=name).to(
            device=device, dtype=dtype)
        layers[name].load_state_dict(layers["reference"].state_dict())
    g = torch.Generator().manual_seed(1)
    klen = qlen + mlen
    w = torch.randn(qlen, bsz, BASE["d_model"], generator=g).to(device, dtype)
    mem = torch.randn(mlen, bsz, BASE["d_model"], generator=g).to(device, dtype)
    pos = torch.arange(klen - 1, -1, -1.0)
    inv_freq = 1 / (10000 ** (torch.arange(0.0, BASE["d_model"], 2.0) / BASE["d_model"]))
    r = torch.cat([torch.outer(pos, inv_freq).sin(), torch.outer(pos, inv_freq).cos()], -1)
    r = r[:, None, :].to(device, dtype)
    mask = torch.triu(torch.ones(qlen, klen, dtype=torch.uint8, device=device), 1 + mlen)[..., None]

    ref_out = ref_grads = None
    print(f"  {'backend':<12} {'max |diff| out':>15} {'max |diff| grads':>17} {'time':>10}   memory")
    for name in backends:
        if device.type == "cuda":  # warm-up: compiles and autotunes (nothing to compile on CPU)
            _run_layer(layers[name], (w, r, mem, mask), device)
        out, grads, elapsed, memstr = _run_layer(layers[name], (w, r, mem, mask), device)
        if name == "reference":
            ref_out, ref_grads = out, grads
            d_out = d_grad = 0.0
        else:
            d_out = (out.float() - ref_out.float()).abs().max().item()
            d_grad = max(((a.float() - b.float()).abs().max() / max(1.0, b.float().abs().max()))
                         .item() for a, b in zip(grads, ref_grads))
            scale = max(1.0, ref_out.float().abs().max().item())
            if not (d_out / scale <= TOLERANCE[dtype] and d_grad <= TOLERANCE[dtype]):
                failures.append(name)
        print(f"  {name:<12} {d_out:>15.3e} {d_grad:>17.3e} {elapsed * 1e3:>8.1f} ms   {memstr}")

    if fused_ok and device.type == "cpu":
        print("  (the triton row ran under the Triton interpreter: a correctness check, not a "
              "speed measurement)")
    if not _lm_report(device):
        failures.append("MemTransformerLM generate (tokens differ from HF's greedy loop)")
    if failures:
        print(f"\nFAILED: {', '.join(failures)}: does not agree with the reference")
        return 1
    print("\nOK: every usable backend agrees with the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
