"""The fused CPU kernel of ``rel_attention`` (``csrc/rel_attention_cpu.cpp``, see docs/cpu.md).

The C++ extension defines the ops ``txl_kernels::rel_attn_cpu_fwd`` (-> out, lse),
``txl_kernels::rel_attn_cpu_fwd_out`` (the same into a given ``out``, which may be q; -> lse)
and ``txl_kernels::rel_attn_cpu_bwd`` (-> dq, dk, dv, dr, dr_w_bias, dr_r_bias) with
``TORCH_LIBRARY_FRAGMENT``; this module adds their fake implementations (output shapes, for
``torch.compile`` and ``opcheck``) and the forward op's autograd, once the extension is loaded
(:func:`cpu_kernel_available`). ``rel_attention(backend="cpu")`` (and ``"auto"`` on CPU
tensors) calls :func:`rel_attn_cpu`. No triton import here.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _build
from ._utils import assume_constant_result, no_second_derivative
from ._cpp_ops import unavailable
from .quant import QuantizedKV

__all__ = ["cpu_kernel_available", "rel_attn_cpu", "draw_cpu_dropout_seed", "load_library",
           "last_dim_contiguous"]

_STATE: Optional[Tuple[bool, str]] = None


@assume_constant_result
def cpu_kernel_available() -> Tuple[bool, str]:
    """(True, where it was loaded from) once the C++ extension with the CPU kernel is loaded
    (built on the first call, like the rest of the extension), else (False, why not)."""
    global _STATE
    if _STATE is not None:
        return _STATE
    why = unavailable("rel_attn_cpu_fwd", "cpu")
    if why:
        _STATE = (False, why)
    else:
        _register()
        _STATE = (True, str(_build.extension_status()["reason"]))
    return _STATE


def load_library() -> str:
    """Load the C++ extension now (built on the first call, as on the first use of any of its
    ops), so that its ops (``txl_kernels::rel_attn_cpu_fwd``, ``update_mems``, ...) are in
    PyTorch's dispatcher with their fake implementations; return the path of its shared
    library. Raises RuntimeError saying why when it cannot be built or loaded.

    ``import txl_kernels`` does not load it (the ops load on first use). A program that
    AOTInductor compiled (``torch._inductor.aoti_compile_and_package``) from a model whose
    attention runs on the CPU kernel calls ``txl_kernels::rel_attn_cpu_fwd``, which PyTorch
    looks up when the package is loaded: a deployment process calls this before
    ``torch._inductor.aoti_load_package`` (without it, loading fails: "Could not find
    schema for txl_kernels::rel_attn_cpu_fwd"), or, in C++, loads the returned library
    (``dlopen(path, RTLD_NOW | RTLD_GLOBAL)``) before ``AOTIModelPackageLoader``. The same
    holds for a model saved by ``torch.jit.save`` (traced or scripted with the CPU kernel)
    before ``torch.jit.load`` / ``torch::jit::load``; a process without txl_kernels can
    load the returned path with ``torch.ops.load_library(path)``."""
    ok, why = cpu_kernel_available()
    if not ok:
        raise RuntimeError(f"txl_kernels.load_library: the C++ extension cannot be loaded: "
                           f"{why}")
    return _build.load_extension().__file__


def draw_cpu_dropout_seed() -> Tensor:
    """A fresh int64 ``[2]`` (seed, offset) from PyTorch's default CPU generator
    (``torch.manual_seed`` makes it reproducible, consecutive calls differ). For one seed the
    CPU kernel's keep-mask is the Triton kernels' (the same Philox counters)."""
    return torch.randint(0, 2 ** 62, (2,), dtype=torch.int64)


def _fwd_fake(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
              key_padding_mask, attn_mask, attn_mask_band, dropout_p, dropout_seed, mem_k,
              mem_k_scale, mem_v, mem_v_scale, r_first_distance=None):
    B, Lq, H, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((B, H, Lq), dtype=acc))


def _fwd_out_fake(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
                  key_padding_mask, attn_mask, attn_mask_band, dropout_p, dropout_seed, mem_k,
                  mem_k_scale, mem_v, mem_v_scale, r_first_distance=None, *, out):
    B, Lq, H, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((B, H, Lq), dtype=acc)


def _bwd_fake(dout, q, k, v, r, r_w_bias, r_r_bias, out, lse, softmax_scale, window_left,
              window_right, key_padding_mask, attn_mask, attn_mask_band, dropout_p,
              dropout_seed, r_first_distance=None):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (q, k, v, r, r_w_bias, r_r_bias))


def _setup_context(ctx, inputs, output):
    (q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
     key_padding_mask, attn_mask, attn_mask_band, dropout_p, dropout_seed) = inputs[:14]
    ctx.has_memory = any(t is not None for t in inputs[14:18])
    ctx.n_inputs = len(inputs)
    out, lse = output
    ctx.save_for_backward(q, k, v, r, r_w_bias, r_r_bias, out, lse, key_padding_mask,
                          attn_mask, attn_mask_band, dropout_seed)
    r_first_distance = inputs[18] if len(inputs) > 18 else None
    ctx.args = (softmax_scale, window_left, window_right, dropout_p, r_first_distance)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    if ctx.has_memory:
        raise RuntimeError(
            "txl_kernels.rel_attention: the CPU kernel with an 8-bit memory "
            "(memory=QuantizedKV) is forward only (inference); for gradients use "
            "backend='reference' (backend='auto' does when inputs require grad)")
    (q, k, v, r, r_w_bias, r_r_bias, out, lse, key_padding_mask, attn_mask, attn_mask_band,
     dropout_seed) = ctx.saved_tensors
    softmax_scale, window_left, window_right, dropout_p, r_first_distance = ctx.args
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    with torch.no_grad():  # the backward op has no derivative: no_second_derivative says so
        grads = torch.ops.txl_kernels.rel_attn_cpu_bwd(
            dout, q, k, v, r, r_w_bias, r_r_bias, out, lse, softmax_scale, window_left,
            window_right, key_padding_mask, attn_mask, attn_mask_band, dropout_p, dropout_seed,
            r_first_distance)
    grads = no_second_derivative(
        grads, (dout, q, k, v, r, r_w_bias, r_r_bias),
        "txl_kernels.rel_attention: double backward (differentiating the gradients, e.g. "
        "after create_graph=True or torch.func.grad of torch.func.grad) is not supported by "
        "the CPU kernel; use backend='reference' for it")
    return (*grads, *(None,) * (ctx.n_inputs - 6))


class _RelAttnCpuFunction(torch.autograd.Function):
    """The forward op's autograd for :func:`rel_attn_cpu`, as an autograd.Function with a
    separate ``setup_context``: the form torch.func transforms (grad, vjp, vmap) need, which
    the op's ``register_autograd`` (for direct callers of the op) does not give. vmap runs
    the op once per element of the mapped dim (no batching rule: PyTorch's fallback loop)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*inputs):
        return torch.ops.txl_kernels.rel_attn_cpu_fwd(*inputs)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


def _register() -> None:
    torch.library.register_fake("txl_kernels::rel_attn_cpu_fwd")(_fwd_fake)
    torch.library.register_fake("txl_kernels::rel_attn_cpu_bwd")(_bwd_fake)
    torch.library.register_fake("txl_kernels::rel_attn_cpu_fwd_out")(_fwd_out_fake)
    torch.library.register_autograd("txl_kernels::rel_attn_cpu_fwd", _backward,
                                    setup_context=_setup_context)


def last_dim_contiguous(t: Tensor) -> Tensor:
    """``t``, copied only when its last dimension is not contiguous (what the kernel reads
    in place); TorchScript compiles it too (the scripted drop-ins)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def rel_attn_cpu(q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor,
                 r_r_bias: Tensor, softmax_scale: float, window_left: int, window_right: int,
                 key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                 attn_mask_band: Optional[Tensor] = None, dropout_p: float = 0.0,
                 dropout_seed: Optional[Tensor] = None,
                 memory: Optional[QuantizedKV] = None,
                 r_first_distance: Optional[int] = None, out: Optional[Tensor] = None) -> Tensor:
    """The CPU kernel on arguments validated and normalised by ``rel_attention``
    (``cpu_kernel_available()`` must have said True). Tensors whose last dimension is not
    contiguous are copied; others are read in place through their strides. ``dropout_p > 0``
    draws ``dropout_seed`` with :func:`draw_cpu_dropout_seed` unless one is given.
    ``r_first_distance``: the distance held by r's row 0 (None: ``Lk - 1``). ``out``: a
    contiguous tensor of q's shape and dtype that receives the result, possibly q itself
    (``txl_kernels::rel_attn_cpu_fwd_out``; no autograd)."""
    if dropout_p > 0.0 and dropout_seed is None:
        dropout_seed = draw_cpu_dropout_seed()
    q, k, v, r, r_w_bias, r_r_bias = (last_dim_contiguous(t)
                                      for t in (q, k, v, r, r_w_bias, r_r_bias))
    mem = (None,) * 4 if memory is None else tuple(memory)
    mem = tuple(None if t is None else last_dim_contiguous(t) for t in mem)
    args = (q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
            key_padding_mask, attn_mask, attn_mask_band, float(dropout_p), dropout_seed, *mem,
            r_first_distance)
    if out is not None:
        torch.ops.txl_kernels.rel_attn_cpu_fwd_out(*args, out=out)
        return out
    if not torch.is_grad_enabled() or torch.jit.is_tracing():
        # The op itself (with its registered autograd). Without grad mode there is no graph
        # to record (and torch.compile cannot trace the autograd.Function there: its
        # setup_context has no proxy); torch.jit.trace records it as a
        # txl_kernels::rel_attn_cpu_fwd node, which torch.jit.save writes and a C++ process
        # runs once the op library is loaded, where the autograd.Function would be a Python op.
        out, _ = torch.ops.txl_kernels.rel_attn_cpu_fwd(*args)
    else:
        out, _ = _RelAttnCpuFunction.apply(*args)
    return out
