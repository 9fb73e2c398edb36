"""``python -m txl_kernels``: environment report, extension build, and a self-check.

Like DeepSpeed's ``ds_report``: prints the environment (torch, triton, CUDA toolkit, device)
and which backends are usable here and why not; builds the segment-memory extension (saying
so: a first build takes a minute or more); then runs a Transformer-XL-base-shaped layer
(10 heads of 41, d_model 410), scaled to run in seconds on a CPU, through every usable
backend, forward and backward, and prints each one's max difference from the reference, its
time and its memory; last, a small Transformer-XL language model evaluated with its K/V cache
and on the mems path, and greedy generation both ways, which must agree. Exits 1 if a usable
backend or the two LM paths disagree, 2 on a bad ``--device``. (The full build report:
``python -m tools.build_check`` in a source checkout.)

On ``--device cpu`` the fused Triton kernels can only run under the Triton interpreter: unless
``--no-interpret`` is given, this command sets ``TRITON_INTERPRET=1`` before the kernels are
created and says so. Importing this module changes nothing.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import List

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


# The LM section's model: small, so the whole command stays quick on a CPU (the realistic
# sizes, and HF TransfoXL on the same weights: ``python -m benchmarks.test_bench_lm`` in a
# source checkout).
LM_SIZE = dict(n_token=2000, n_layer=4, n_head=4, d_model=128, d_head=32, d_inner=512,
               cutoffs=[500, 1000], div_val=1, same_length=True, clamp_len=400, untie_r=True)
LM_EVAL = dict(tgt_len=16, mem_len=160, bsz=2)
LM_GEN = dict(prompt=64, new=32, tgt_len=16, mem_len=64)
LM_TOLERANCE = 1e-4  # fp32 losses, K/V cache against the mems path (nats)


def _median_time(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _lm_greedy_on_mems(model, prompt: torch.Tensor, new: int, seg: int) -> torch.Tensor:
    """Greedy continuation on the mems path: the prompt in segments, then one token at a
    time, each with the memories the previous call returned."""
    mems, seq = [], [prompt]
    data = prompt.t()
    for s in range(0, data.shape[0], seg):
        logp, *mems = model.log_probs(data[s:s + seg], *mems)
    for t in range(new):
        tok = logp[-1].argmax(-1)
        seq.append(tok[:, None])
        if t + 1 < new:
            logp, *mems = model.log_probs(tok[None], *mems)
    return torch.cat(seq, 1)


def _lm_report(device: torch.device, attn_backend: str) -> bool:
    """A small Transformer-XL LM (``txl_kernels.models.MemTransformerLM``, :data:`LM_SIZE`,
    random weights, fp32, ``attn_backend``) evaluated segment by segment with the K/V cache
    and on the mems path (losses must agree), and greedy generation with the cache against a
    greedy loop on the mems path (tokens must agree); prints each one's time. Returns False
    on a disagreement."""
    from txl_kernels.models import MemTransformerLM

    ev, gen = LM_EVAL, LM_GEN
    print(f"\nTransformer-XL LM (txl_kernels.models.MemTransformerLM): {LM_SIZE['n_layer']} "
          f"layers, d_model {LM_SIZE['d_model']}, vocabulary {LM_SIZE['n_token']}, fp32, "
          f"random weights, {device}")

    def model(tgt_len, mem_len):
        c = dict(LM_SIZE, attn_backend=attn_backend)
        torch.manual_seed(0)
        return MemTransformerLM(c.pop("n_token"), c.pop("n_layer"), c.pop("n_head"),
                                c.pop("d_model"), c.pop("d_head"), c.pop("d_inner"), 0.0, 0.0,
                                tgt_len=tgt_len, mem_len=mem_len, **c).to(device).eval()

    ok = True
    g = torch.Generator().manual_seed(5)
    tgt_len, bsz = ev["tgt_len"], ev["bsz"]
    n_seg = ev["mem_len"] // tgt_len + 1
    lm = model(tgt_len, ev["mem_len"])
    data = torch.randint(LM_SIZE["n_token"], (n_seg * tgt_len + 1, bsz), generator=g).to(device)
    segs = [(data[s:s + tgt_len], data[s + 1:s + 1 + tgt_len])
            for s in range(0, n_seg * tgt_len, tgt_len)]
    with torch.no_grad():
        cache, mems, diff = lm.new_cache(bsz), [], 0.0
        for x, y in segs:  # fills the memory; the last segment sees a full one
            loss_c = lm(x, y, cache=cache)[0]
            loss_m, *mems = lm(x, y, *mems)
            diff = max(diff, (loss_c - loss_m).abs().max().item())
        x, y = segs[-1]
        t_cache = _median_time(lambda: lm(x, y, cache=cache))
        t_mems = _median_time(lambda: lm(x, y, *mems))
    same = diff <= LM_TOLERANCE
    ok &= same
    _row("sizes", f"eval tgt_len {tgt_len} / mem_len {ev['mem_len']}, bsz {bsz}; generate "
                  f"{gen['new']} tokens after {gen['prompt']}, mem_len {gen['mem_len']}")
    _row("losses, cache vs mems path", f"max |diff| {diff:.1e} over {n_seg} segments: "
                                       + ("agree" if same else f"DISAGREE (> {LM_TOLERANCE})"))
    _row("eval, K/V cache", f"{t_cache * 1e3:8.1f} ms per segment "
                            f"({t_mems / t_cache:.2f}x the mems path)")
    _row("eval, mems path", f"{t_mems * 1e3:8.1f} ms per segment")

    lm = model(gen["tgt_len"], gen["mem_len"])
    prompt = torch.randint(LM_SIZE["n_token"], (1, gen["prompt"]), generator=g).to(device)
    with torch.no_grad():
        out = {}
        t_gen = _median_time(lambda: out.update(cache=lm.generate(prompt, gen["new"])), 1)
        t_loop = _median_time(lambda: out.update(
            mems=_lm_greedy_on_mems(lm, prompt, gen["new"], gen["tgt_len"])), 1)
    same = torch.equal(out["cache"], out["mems"])
    ok &= same
    _row("generate (greedy), cache", f"{t_gen * 1e3:8.1f} ms ({t_loop / t_gen:.2f}x the "
                                     f"mems-path loop)")
    _row("generate, mems-path loop", f"{t_loop * 1e3:8.1f} ms: "
                                     + ("same tokens" if same else "DIFFERENT TOKENS"))
    return ok


def build_parser() -> argparse.ArgumentParser:
    """The command line; its description is this module's docstring as plain text."""
    ap = argparse.ArgumentParser(prog="python -m txl_kernels",
                                 description=re.sub(r"``(.+?)``", r"\1", __doc__).strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the self-check runs: cpu, cuda or cuda:N (default: cuda when "
                         "a CUDA device is visible, else cpu)")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                    help="the attention layer's dtype (default: float16 on CUDA, float32 on "
                         "CPU)")
    ap.add_argument("--no-build", action="store_true",
                    help="do not build or load the C++ extension; update_mems uses torch")
    ap.add_argument("--no-interpret", action="store_true",
                    help="on CPU, do not set TRITON_INTERPRET=1 (the fused path is then skipped)")
    return ap


def _environment(device: torch.device, interpret: bool) -> None:
    """The environment rows: versions, device, interpreter, CUDA toolkit."""
    print(f"txl_kernels {txl_kernels.__version__}: environment")
    interp = _interpreter(device, interpret)
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


def _extension_report(device: torch.device, no_build: bool, failures: list) -> bool:
    """Builds (or loads) the C++ extension, checks ``update_mems`` against its formula and, on
    CPUs, reports the attention kernel; True where that kernel is built."""
    print("\nsegment-memory extension (update_mems)")
    if no_build:
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
    new = update_mems(hids, mems, mem_len=6, ext_len=1, backend="torch" if no_build else "auto")
    want = [torch.cat([m, h])[max(0, 7 + 4 - 6):7 + 4] for m, h in zip(mems, hids)]
    same = all(torch.equal(a, b) for a, b in zip(new, want))
    _row("update_mems == formula", "yes" if same else "NO")
    if not same:
        failures.append("update_mems")
    if device.type != "cpu":
        return False
    from .cpu_kernel import cpu_kernel_available  # the fused C++ kernel (docs/cpu.md)
    cpu_ok, why = (False, "--no-build") if no_build else cpu_kernel_available()
    _row("cpu attention kernel", ("built: " if cpu_ok else "not built: ") + why)
    if cpu_ok:  # its row loops' ISA variant follows ATen's choice (docs/cpu.md)
        aten = torch.backends.cpu.get_cpu_capability()
        _row("cpu kernel ISA variant",
             f"{torch.ops.txl_kernels.cpu_isa()} (ATen's CPU capability: {aten})")
        route = torch.ops.txl_kernels.cpu_lowp_route  # the forward's GEMMs (docs/cpu.md)
        _row("cpu kernel bf16 / fp16",
             f"bf16: {route(torch.bfloat16)}, fp16: {route(torch.float16)}")
        _row("cpu kernel fp32 GEMMs",
             f"{route(torch.float32)} (library: {torch.ops.txl_kernels.cpu_fp32_gemm()})")
    return cpu_ok


def _layer_inputs(device: torch.device, dtype: torch.dtype, qlen: int, mlen: int, bsz: int):
    """(w, r, mem, mask) of the Transformer-XL layer check (sinusoid position table)."""
    g = torch.Generator().manual_seed(1)
    klen = qlen + mlen
    w = torch.randn(qlen, bsz, BASE["d_model"], generator=g).to(device, dtype)
    mem = torch.randn(mlen, bsz, BASE["d_model"], generator=g).to(device, dtype)
    pos = torch.arange(klen - 1, -1, -1.0)
    inv_freq = 1 / (10000 ** (torch.arange(0.0, BASE["d_model"], 2.0) / BASE["d_model"]))
    r = torch.cat([torch.outer(pos, inv_freq).sin(), torch.outer(pos, inv_freq).cos()], -1)
    r = r[:, None, :].to(device, dtype)
    mask = torch.triu(torch.ones(qlen, klen, dtype=torch.uint8, device=device), 1 + mlen)[..., None]
    return w, r, mem, mask


def _layer_report(device: torch.device, dtype: torch.dtype, backends: List[str],
                  failures: list) -> None:
    """One Transformer-XL layer, forward + backward, on every usable backend against the
    reference's output and gradients (and their time and memory)."""
    shape = SHAPES["cuda" if device.type == "cuda" else "cpu"]
    qlen, mlen, bsz = shape["qlen"], shape["mlen"], shape["bsz"]
    print(f"\nTransformer-XL layer: n_head {BASE['n_head']}, d_head {BASE['d_head']}, d_model "
          f"{BASE['d_model']}, qlen {qlen}, mem {mlen}, bsz {bsz}, {dtype}, {device}, "
          f"forward + backward")
    torch.manual_seed(0)
    layers = {}
    for name in backends:
        layers[name] = FusedRelAttention(**BASE, dropout=0.0, untie_r=True, backend=name).to(
            device=device, dtype=dtype)
        layers[name].load_state_dict(layers["reference"].state_dict())
    inputs = _layer_inputs(device, dtype, qlen, mlen, bsz)
    ref_out = ref_grads = None
    print(f"  {'backend':<12} {'max |diff| out':>15} {'max |diff| grads':>17} {'time':>10}"
          f"   memory")
    for name in backends:
        if device.type == "cuda":  # warm-up: compiles and autotunes (nothing to compile on CPU)
            _run_layer(layers[name], inputs, device)
        out, grads, elapsed, memstr = _run_layer(layers[name], inputs, device)
        if name == "reference":
            ref_out, ref_grads = out, grads
            d_out = d_grad = 0.0
        else:
            d_out = (out.float() - ref_out.float()).abs().max().item()
            d_grad = max(((a.float() - b.float()).abs().max() / max(1.0, b.float().abs().max()))
                         .item() for a, b in zip(grads, ref_grads))
            size = max(1.0, ref_out.float().abs().max().item())
            if not (d_out / size <= TOLERANCE[dtype] and d_grad <= TOLERANCE[dtype]):
                failures.append(name)
        print(f"  {name:<12} {d_out:>15.3e} {d_grad:>17.3e} {elapsed * 1e3:>8.1f} ms   {memstr}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        device = _device(args.device)
    except ValueError as exc:
        print(f"python -m txl_kernels: error: {exc}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.float16 if device.type == "cuda" else torch.float32)
    failures: List[str] = []
    _environment(device, not args.no_interpret)
    print("\nbackends")
    _row("reference", "usable (einsum path, any device)")
    fused_ok, why = fused_available(device)
    _row(f"triton on {device.type}", ("usable: " if fused_ok else "not usable: ") + why)
    cpu_ok = _extension_report(device, args.no_build, failures)
    backends = ["reference"] + (["triton"] if fused_ok else []) + (["cpu"] if cpu_ok else [])
    _layer_report(device, dtype, backends, failures)
    if fused_ok and device.type == "cpu":
        print("  (the triton row ran under the Triton interpreter: a correctness check, not a "
              "speed measurement)")
    # on CPUs the C++ kernels where built (the Triton interpreter is a test tool, not a path
    # to time), else the reference
    lm_backend = "auto" if device.type != "cpu" else ("cpu" if cpu_ok else "reference")
    if not _lm_report(device, lm_backend):
        failures.append("MemTransformerLM (K/V cache against the mems path)")
    if failures:
        print(f"\nFAILED: {', '.join(failures)}: does not agree with the reference")
        return 1
    print("\nOK: every usable backend agrees with the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
