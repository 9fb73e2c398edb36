"""First-use self-check of the fused kernels: no silent wrong answer on untried hardware.

The first time a process runs a fused-kernel *variant* through ``rel_attention`` (backend
``"auto"`` or ``"triton"``) -- a (device, dtype, head dim, fp32 product precision, window sides,
key padding, dense mask, mask band, dropout, 8-bit memory, gradients recorded, deterministic mode,
a position table with r_first_distance) combination, each of which compiles its own kernels --
a tiny random problem of that variant runs on the fused path and on the reference path
(forward, and the backward of all six inputs when the call records gradients) and the two are
compared with a float64 reference run as the judge.
The verdict is kept for the process. On a mismatch (or an exception from the fused path) one
warning names the variant and the error; ``"auto"`` then takes the reference path for that
variant, ``"triton"`` raises.

Cost: once per variant and process, one fused call (+ backward) at B 1, H 2, Lq 72, Lk 128 on a
GPU, with each kernel's default config (no autotuning for the check), and the reference path in
the dtype and in float64: milliseconds on the GPU, plus the compile of those kernels
(seconds, which the call's own launch shares when it uses the default config). The check draws
its inputs from a private generator: PyTorch's random state is untouched.

``TXL_KERNELS_SELFCHECK=0`` turns it off (read at each call). Under ``torch.compile`` the check
runs while the graph is traced (``torch.compiler.assume_constant_result``: the verdict is a
constant of the graph, the check itself is not in it). Under CUDA graph capture it never runs
(it would launch and synchronise inside the capture): a variant first met inside a capture is
used unverified, with one warning; run the model once before capturing (as CUDA graphs
need anyway) to have it checked.
"""
from __future__ import annotations

import math
import os
import threading
import warnings
from typing import Dict, Optional, Tuple

import torch

from ._utils import assume_constant_result
from ._variant import Variant, variant_of  # noqa: F401  (part of this module's API)

__all__ = ["ENV", "enabled", "Variant", "variant_of", "fused_ok", "failure", "verdicts",
           "clear"]

ENV = "TXL_KERNELS_SELFCHECK"


def enabled() -> bool:
    """Whether the first-use check runs (``TXL_KERNELS_SELFCHECK`` unset or not 0 / false /
    off / no; read at each call)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


_LOCK = threading.RLock()
_VERDICTS: Dict[Variant, Optional[str]] = {}   # None: passed; str: what went wrong
_UNVERIFIED: Dict[Variant, bool] = {}           # first met inside a CUDA graph capture


def verdicts() -> Dict[Variant, Optional[str]]:
    """A copy of this process's verdicts (None = the variant passed)."""
    with _LOCK:
        return dict(_VERDICTS)


def clear() -> None:
    """Forget every verdict (the next call of each variant checks again)."""
    with _LOCK:
        _VERDICTS.clear()
        _UNVERIFIED.clear()


def _variant(key: Tuple) -> Variant:
    """``Variant(*key)``, its fp32 product precision filled in from
    ``torch.get_float32_matmul_precision()`` (read here: torch.compile runs this function
    rather than tracing it, and cannot trace that call)."""
    variant = Variant(*key)
    if variant.dtype == "float32" and not variant.products:
        from .ops._common import dot_precision
        variant = variant._replace(products=dot_precision(torch.float32))
    return variant


@assume_constant_result
def fused_ok(key: Tuple) -> bool:
    """Whether variant ``key`` (``Variant``'s fields, in order; ``products`` may be left "")
    may take the fused path: its check passed (run now if this is the variant's first call),
    or it cannot be checked now (inside a CUDA graph capture; warned once). A failed check
    warns once."""
    variant = _variant(key)
    with _LOCK:
        if variant in _VERDICTS:
            return _VERDICTS[variant] is None
        if _capturing(variant.device):
            if not _UNVERIFIED.get(variant):
                _UNVERIFIED[variant] = True
                warnings.warn(
                    f"txl_kernels: the fused kernel variant [{variant.describe()}] is first "
                    "used inside a CUDA graph capture, where its first-use self-check cannot "
                    "run; it runs unverified. Call the model once before capturing to have it "
                    f"checked ({ENV}=0 turns the check off).", RuntimeWarning, stacklevel=3)
            return True
        error = _check(variant)
        _VERDICTS[variant] = error
    if error is not None:
        warnings.warn(failure(key), RuntimeWarning, stacklevel=3)
    return error is None


@assume_constant_result
def failure(key: Tuple) -> str:
    """The message of a failed check of variant ``key`` ('' if it did not fail)."""
    variant = _variant(key)
    error = _VERDICTS.get(variant)
    if error is None:
        return ""
    return (f"txl_kernels: the fused kernel failed its first-use self-check for "
            f"[{variant.describe()}]: {error}. backend='auto' uses the reference path for this "
            f"variant in this process; backend='triton' raises. Please report it with the GPU "
            f"model and the versions of torch and triton ({ENV}=0 turns the check off).")


def _capturing(device: str) -> bool:
    return device.startswith("cuda") and torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------------------------
# The check

# The sizes of the check: on a GPU two or more query and key tiles at the default block sizes
# (32-64), under the interpreter (16 x 16 tiles) a few tiles of a smaller problem.
_SIZES = {"cuda": (72, 56), "cpu": (20, 12)}   # (Lq, memory / extra keys before the segment)
_DROPOUT_P = 0.25
# unit roundoff of the products / storage: the tolerance's absolute floor is a few of these
_EPS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "tf32": 2.0 ** -11, "ieee": 2.0 ** -24}


def _check(variant: Variant) -> Optional[str]:
    """Run the tiny problem of ``variant``; None when the fused path matches, else a
    description of the mismatch (or of the exception the fused path raised)."""
    from .ops._common import default_configs
    dev = torch.device(variant.device)
    try:
        with torch.autocast(dev.type, enabled=False), default_configs(), \
                (torch.enable_grad() if variant.grad else torch.no_grad()):
            return _compare(variant, dev)
    except Exception as exc:  # the fused path could not run: as wrong as a wrong result
        return f"the fused path raised {type(exc).__name__}: {str(exc)[:300]}"


def _inputs(variant: Variant, dev: torch.device):
    gen = torch.Generator().manual_seed(20240917)
    dtype = getattr(torch, variant.dtype)
    lq, extra = _SIZES["cuda" if dev.type == "cuda" else "cpu"]
    B, H, D = 1, 2, variant.head_dim
    lk = lq + extra
    mlen = extra if variant.memory else 0  # 8-bit memory rows in front of the segment

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    q = rand(B, lq, H, D)
    k, v = rand(B, lk - mlen, H, D), rand(B, lk - mlen, H, D)
    # r_first_distance (row_shift): a table two rows longer at the top and three at the bottom
    # than the default one (row 0 at distance lk + 1), so the rows' shift is not 0
    r = rand(lk + lq - 1 + (5 if variant.row_shift else 0), H, D)
    u, vb = rand(H, D, scale=0.5), rand(H, D, scale=0.5)
    memory = None
    if variant.memory:
        from .quant import quantize_kv
        memory = quantize_kv(rand(B, mlen, H, D), rand(B, mlen, H, D),
                             dtype=getattr(torch, variant.memory))
    wl = lk // 2 if variant.window_left else -1
    wr = 0 if variant.window_right else -1
    kpm = None
    if variant.key_padding:
        kpm = torch.rand(B, lk, generator=gen) < 0.2
        kpm[:, -1] = False  # the last query row keeps a key
        kpm = kpm.to(dev)
    mask = band = None
    if variant.attn_mask:
        if variant.band:  # a band (causal): the kernels take it as a window
            mask = torch.ones(lq, lk, dtype=torch.bool).triu(1 + lk - lq).to(dev)
            # its descriptor [is_band, left, right] (functional.mask_to_band): 0 <= d <= lk - 1
            band = torch.tensor([1, lk - 1, 0], dtype=torch.int32, device=dev)
        else:
            mask = (torch.rand(B, H, lq, lk, generator=gen) < 0.2).to(dev)
        mask = mask.expand(B, H, lq, lk)
    seed = None
    if variant.dropout:
        seed = torch.tensor([int(torch.randint(0, 2 ** 62, (1,), generator=gen)), 0],
                            dtype=torch.int64, device=dev)
    dout = rand(B, lq, H, D)
    first = lk + 1 if variant.row_shift else None
    return (q, k, v, r, u, vb), memory, wl, wr, kpm, mask, band, seed, dout, first


def _compare(variant: Variant, dev: torch.device) -> Optional[str]:
    from ._op import rel_attn_func
    from .ops._common import dropout_keep_mask
    from .reference import rel_attention_reference

    ts, memory, wl, wr, kpm, mask, band, seed, dout, first = _inputs(variant, dev)
    q = ts[0]
    B, lq, H, D = q.shape
    softmax_scale = D ** -0.5
    p = _DROPOUT_P if variant.dropout else 0.0
    keys = [ts[1], ts[2]] if memory is None else list(memory.in_front_of(ts[1], ts[2]))
    lk = keys[0].shape[1]
    keep = None
    if variant.dropout:
        keep = dropout_keep_mask(seed, B, H, lq, lk, p)
        kept = keep.float().mean().item()
        if abs(kept - (1 - p)) > 0.05:
            return (f"the dropout keep-mask keeps {kept:.3f} of the elements at p = {p} "
                    f"(expected about {1 - p:.3f})")

    def reference(xs, ks):
        return rel_attention_reference(xs[0], ks[0], ks[1], xs[3], xs[4], xs[5], softmax_scale,
                                       wl, wr, kpm, mask, p, attn_mask_band=band,
                                       dropout_mask=keep, r_first_distance=first)

    leaves = [t.detach().requires_grad_(variant.grad) for t in ts]
    fused = rel_attn_func(*leaves, softmax_scale, wl, wr, kpm, mask, band,
                          variant.deterministic, p, dropout_seed=seed, memory=memory,
                          r_first_distance=first, interpreter=dev.type == "cpu")
    outs = {"output": fused}
    if variant.grad:
        for name, g in zip(("dq", "dk", "dv", "dr", "dr_w_bias", "dr_r_bias"),
                           torch.autograd.grad(fused, leaves, dout)):
            outs[name] = g
    # the same problem on the reference path, in the dtype and in float64
    runs = {}
    for kind in ("low", "f64"):
        conv = (lambda t: t) if kind == "low" else (lambda t: t.double())
        xs = [conv(t.detach()).requires_grad_(variant.grad) for t in ts]
        if memory is not None:
            ks = [conv(t) for t in keys]
        else:
            ks = [xs[1], xs[2]]
        out = reference(xs, ks)
        res = {"output": out}
        if variant.grad:
            for name, g in zip(("dq", "dk", "dv", "dr", "dr_w_bias", "dr_r_bias"),
                               torch.autograd.grad(out, xs, conv(dout))):
                res[name] = g
        runs[kind] = res
    eps = _EPS[variant.products or variant.dtype]
    for name, got in outs.items():
        gold, low = runs["f64"][name], runs["low"][name]
        err = _max_err(got, gold)
        ref_err = _max_err(low, gold)
        tol = 4.0 * ref_err + 16.0 * eps * max(1.0, gold.abs().max().item())
        if not err <= tol:  # NaN fails too
            return (f"{name}: max abs error {err:.3g} against float64 (the reference path in "
                    f"{variant.dtype}: {ref_err:.3g}; tolerance {tol:.3g})")
    return None


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.double() - b).abs()
    if diff.numel() == 0:
        return 0.0
    m = diff.max().item()
    return math.inf if math.isnan(m) else m
