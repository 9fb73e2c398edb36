"""Shared test helpers: random inputs, the float64 oracle, and error-bound comparisons."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from txl_kernels.reference import rel_attention_reference

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Device the fused kernels are tested on: the GPU when there is one, else CPU tensors under the
# Triton interpreter.
FUSED_DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# bf16 tl.dot is wrong in the Triton interpreter (triton-lang/triton#11584); the kernels upcast
# bf16 operands when interpreting, so bf16 is covered there too, but the GPU run is what counts.
FUSED_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(B, Lq, Lk, H, D, R=None, dtype=torch.float32, device="cpu", layout="bshd",
                seed=0, requires_grad=False, scale=1.0):
    """Random q, k, v, r, u, vb. layout "bshd": batch-first contiguous; "sbhd": seq-first
    contiguous storage passed as .transpose(0, 1) views (stride(-1) == 1, not contiguous)."""
    R = Lk if R is None else R
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    if layout == "bshd":
        q, k, v = rnd(B, Lq, H, D), rnd(B, Lk, H, D), rnd(B, Lk, H, D)
    elif layout == "sbhd":
        q = rnd(Lq, B, H, D).transpose(0, 1)
        k = rnd(Lk, B, H, D).transpose(0, 1)
        v = rnd(Lk, B, H, D).transpose(0, 1)
    else:
        raise ValueError(layout)
    r, u, vb = rnd(R, H, D), rnd(H, D), rnd(H, D)
    ts = [q, k, v, r, u, vb]
    if requires_grad:
        ts = [t.detach().requires_grad_(True) for t in ts]
    return ts


def oracle(q, k, v, r, u, vb, softmax_scale, wl, wr, kpm=None, mask=None):
    """Reference math in float64 on the given (possibly low-precision) inputs."""
    up = [t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v, r, u, vb)]
    return up, rel_attention_reference(*up, softmax_scale, wl, wr, kpm, mask)


def _floor(dtype, truth):
    mag = max(1.0, float(truth.detach().abs().max()))
    return {torch.float32: 2e-5, torch.float64: 1e-10}.get(dtype, 1e-4) * mag


def assert_within(name, got, same_prec, truth, factor=2.0):
    """got (fused) must be as close to the float64 truth as PyTorch's same math in the same
    precision (same_prec), within ``factor``, plus a small floor."""
    floor = _floor(got.dtype, truth)
    got, same_prec, truth = got.double(), same_prec.double(), truth.double()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got - truth).abs().max().item()
    base = (same_prec - truth).abs().max().item()
    bound = factor * base + floor
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (torch same-precision error {base:.3e})"


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a spawned gloo group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int):
    """One spawned rank of a CPU gloo group on 127.0.0.1:``port``, one intra-op thread: the
    process group lives for the block; after a clean exit the process leaves through
    ``os._exit`` (gloo's threads can abort interpreter finalisation:
    examples/train_lm.end_process), after an exception it raises as usual."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        yield dist
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def require_onnx_parakeet() -> None:
    """Skip, saying which extra is missing, unless ONNX Runtime (the export extra) and HF's
    Parakeet encoder (transformers >= 5, the hf5 extra) import: the encoder benchmarks' runs."""
    pytest.importorskip("onnxruntime", reason="the export extra (pip install -e '.[export]')")
    pytest.importorskip("transformers.models.parakeet",
                        reason="the Parakeet encoder needs transformers >= 5 (the hf5 extra)")


def run_python(code: str, *args: str, timeout: float = 300,
               **env) -> subprocess.CompletedProcess:
    """``code`` (dedented) with ``args`` in a fresh interpreter: this checkout's txl_kernels,
    the same extension cache, ``env`` added to the environment, ``timeout`` seconds;
    txl_kernels is not imported unless the code does it."""
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT,
                          env=full, capture_output=True, text=True, timeout=timeout)
