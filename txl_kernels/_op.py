"""The attention operators: one schema per direction, a kernel per dispatch key, one autograd.

``txl_kernels::rel_attn_fwd`` (-> out, lse), its ``.out`` overload (the result written into a
given tensor, which may be q; -> lse), ``txl_kernels::rel_attn_bwd`` (-> dq, dk, dv, dr,
dr_w_bias, dr_r_bias) and the decoding step ``txl_kernels::rel_attn_decode`` (one query row
against cached keys, inference), defined here on import (and by the C++ extension where a
process loads it without this package), each with a kernel per dispatch key, as PyTorch's own
ops:

- ``CPU``: the C++ kernels (``csrc/rel_attention_cpu.cpp``, ``csrc/decode_attention.cpp``),
  registered by the extension when it loads (it is built on first use);
- ``CUDA``: the Triton kernels (``ops/rel_attn_fwd.py``, ``ops/rel_attn_bwd.py``,
  ``ops/rel_attn_decode.py``);
- ``CompositeExplicitAutograd``: what runs where neither is registered yet: on CPU tensors it
  loads the extension and runs its kernel, or, where the extension cannot be built, the
  reference (``reference.py``) after the extension's one-time warning; on other devices the
  reference;
- ``Meta``: the fake implementations (output shapes, for ``torch.compile``, ``torch.export`` and
  ``opcheck``);
- ``Autograd``: one registration (the forward's), whose backward is ``rel_attn_bwd``
  (deterministic).

:func:`rel_attn_func` is the call ``rel_attention`` makes on validated, normalised arguments
(Liger-Kernel's chain: ``_rel_attn_fwd_kernel`` -> ``rel_attn_fwd()`` launcher -> this op ->
:func:`rel_attn_func` -> ``txl_kernels.rel_attention()`` -> ``FusedRelAttention``). Its
``interpreter=True`` runs the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1`` (the
kernels' tests): the op with a dispatch mode that sends it to the CUDA key's functions
(:func:`op_kernel`), through the same autograd.

8-bit memory (``txl_kernels.quant.QuantizedKV``): the forward takes its four tensors as
optional arguments (``mem_k``, ``mem_k_scale``, ``mem_v``, ``mem_v_scale``), so compile and
opcheck see them; it is forward only (the backward raises: ``rel_attention`` sends calls that
record gradients to the reference). No triton import here.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ._utils import draw_dropout_seed, last_dim_contiguous, no_second_derivative
from .quant import QuantizedKV

__all__ = ["rel_attn_func", "op_kernel", "FWD", "FWD_OUT", "BWD", "DECODE"]

_ARGS = ("Tensor q, Tensor k, Tensor v, Tensor r, Tensor r_w_bias, Tensor r_r_bias, "
         "float softmax_scale, int window_left, int window_right, "
         "Tensor? key_padding_mask=None, Tensor? attn_mask=None, Tensor? attn_mask_band=None, "
         "float dropout_p=0., Tensor? dropout_seed=None, Tensor? mem_k=None, "
         "Tensor? mem_k_scale=None, Tensor? mem_v=None, Tensor? mem_v_scale=None, "
         "int? r_first_distance=None")
# The schemas (csrc/rel_attention_cpu.cpp spells them too, for processes without Python).
SCHEMAS = {
    "rel_attn_fwd": f"({_ARGS}) -> (Tensor, Tensor)",
    "rel_attn_fwd.out": f"({_ARGS}, *, Tensor(a!) out) -> Tensor",
    "rel_attn_bwd": ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor r, Tensor r_w_bias, "
                     "Tensor r_r_bias, Tensor out, Tensor lse, float softmax_scale, "
                     "int window_left, int window_right, Tensor? key_padding_mask=None, "
                     "Tensor? attn_mask=None, Tensor? attn_mask_band=None, "
                     "bool deterministic=True, float dropout_p=0., Tensor? dropout_seed=None, "
                     "int? r_first_distance=None) "
                     "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"),
    "rel_attn_decode": ("(Tensor q, Tensor k, Tensor v, Tensor r, Tensor r_w_bias, "
                        "Tensor r_r_bias, float softmax_scale, int window_left=-1, "
                        "Tensor? mem_k=None, Tensor? mem_k_scale=None, Tensor? mem_v=None, "
                        "Tensor? mem_v_scale=None, int? r_first_distance=None) -> Tensor"),
}
_N_FWD_ARGS = 19

_LIB = torch.library.Library("txl_kernels", "FRAGMENT")


def _defined(name: str) -> bool:
    op, _, overload = name.partition(".")
    try:
        torch._C._get_schema(f"txl_kernels::{op}", overload)
    except RuntimeError:
        return False
    return True


for _name, _schema in SCHEMAS.items():
    if not _defined(_name):  # the extension, loaded first, defined it (the same text)
        _LIB.define(_name + _schema)

FWD = torch.ops.txl_kernels.rel_attn_fwd.default
FWD_OUT = torch.ops.txl_kernels.rel_attn_fwd.out
BWD = torch.ops.txl_kernels.rel_attn_bwd.default
DECODE = torch.ops.txl_kernels.rel_attn_decode.default


# ------------------------------------------------------------------------- helpers

def _memory(mem_k, mem_k_scale, mem_v, mem_v_scale) -> Optional[QuantizedKV]:
    """The op's four optional memory tensors as a QuantizedKV (all or none)."""
    parts = (mem_k, mem_k_scale, mem_v, mem_v_scale)
    if all(t is None for t in parts):
        return None
    if any(t is None for t in parts):
        raise ValueError("txl_kernels::rel_attn_fwd: mem_k, mem_k_scale, mem_v and mem_v_scale "
                         "must be given together (an 8-bit memory) or not at all; got "
                         + ", ".join("None" if t is None else "a tensor" for t in parts))
    return QuantizedKV(*parts)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------- CUDA: the Triton kernels

def _triton_fwd(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
                key_padding_mask=None, attn_mask=None, attn_mask_band=None, dropout_p=0.0,
                dropout_seed=None, mem_k=None, mem_k_scale=None, mem_v=None, mem_v_scale=None,
                r_first_distance=None):
    from ._export import register_onnx_symbolics
    from .ops.rel_attn_fwd import rel_attn_fwd  # imports triton

    register_onnx_symbolics()  # the op called directly, exported by dynamo=False
    if dropout_p > 0.0 and dropout_seed is None:
        raise ValueError("txl_kernels::rel_attn_fwd: dropout_p > 0 needs dropout_seed (int64 "
                         "[2] (seed, offset) on q's device, e.g. txl_kernels._op."
                         "draw_dropout_seed)")
    return rel_attn_fwd(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left,
                        window_right, key_padding_mask, attn_mask,
                        attn_mask_band=attn_mask_band, dropout_p=dropout_p,
                        dropout_seed=dropout_seed,
                        memory=_memory(mem_k, mem_k_scale, mem_v, mem_v_scale),
                        r_first_distance=r_first_distance)


def _triton_bwd(dout, q, k, v, r, r_w_bias, r_r_bias, out, lse, softmax_scale, window_left,
                window_right, key_padding_mask=None, attn_mask=None, attn_mask_band=None,
                deterministic=True, dropout_p=0.0, dropout_seed=None, r_first_distance=None):
    from .ops.rel_attn_bwd import rel_attn_bwd  # imports triton

    return rel_attn_bwd(dout, q, k, v, r, r_w_bias, r_r_bias, out, lse, softmax_scale,
                        window_left, window_right, key_padding_mask, attn_mask,
                        attn_mask_band=attn_mask_band, deterministic=deterministic,
                        dropout_p=dropout_p, dropout_seed=dropout_seed,
                        r_first_distance=r_first_distance)


_LIB.impl("rel_attn_fwd", _triton_fwd, "CUDA")
_LIB.impl("rel_attn_bwd", _triton_bwd, "CUDA")


def _triton_fwd_out(*args, out):
    got, lse = _triton_fwd(*args)
    out.copy_(got)
    return lse


_LIB.impl("rel_attn_fwd.out", _triton_fwd_out, "CUDA")


def _triton_decode(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left=-1, mem_k=None,
                   mem_k_scale=None, mem_v=None, mem_v_scale=None, r_first_distance=None):
    from .ops.rel_attn_decode import rel_attn_decode  # imports triton

    return rel_attn_decode(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left,
                           memory=_memory(mem_k, mem_k_scale, mem_v, mem_v_scale),
                           r_first_distance=r_first_distance)


_LIB.impl("rel_attn_decode", _triton_decode, "CUDA")


# ---------------------- CompositeExplicitAutograd: load the C++ kernel, or the reference

def _cpu_kernel_ready(name: str, q: Tensor) -> bool:
    """On CPU tensors: load the extension (built on first use) and say whether its CPU kernel
    of ``txl_kernels::<name>`` is now registered; else warn once and say False."""
    if q.device.type != "cpu":
        return False
    from ._cpp_ops import warn_fallback
    from .cpu_kernel import cpu_kernel_available

    ok, why = cpu_kernel_available()
    if ok and torch._C._dispatch_has_kernel_for_dispatch_key(f"txl_kernels::{name}", "CPU"):
        return True
    warn_fallback("cpu", why if not ok else "its CPU kernel is not registered")
    return False


def _no_reference_dropout(name: str, dropout_p: float) -> None:
    if dropout_p > 0.0:
        raise NotImplementedError(
            f"txl_kernels::{name}: dropout_p={dropout_p} needs a fused kernel (the keep-mask "
            f"is the kernels' Philox function of dropout_seed); none runs here (the C++ "
            f"extension cannot be loaded and the tensors are not on a CUDA device): call "
            f"txl_kernels.rel_attention, whose reference route draws its own mask")


def _reference_fwd(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
                   key_padding_mask=None, attn_mask=None, attn_mask_band=None, dropout_p=0.0,
                   dropout_seed=None, mem_k=None, mem_k_scale=None, mem_v=None,
                   mem_v_scale=None, r_first_distance=None):
    from .reference import rel_attention_reference

    _no_reference_dropout("rel_attn_fwd", dropout_p)
    memory = _memory(mem_k, mem_k_scale, mem_v, mem_v_scale)
    if memory is not None:
        k, v = memory.in_front_of(k, v)
    out, lse = rel_attention_reference(q, k, v, r, r_w_bias, r_r_bias, softmax_scale,
                                       window_left, window_right, key_padding_mask, attn_mask,
                                       return_lse=True, attn_mask_band=attn_mask_band,
                                       r_first_distance=r_first_distance)
    return out.contiguous(), lse


def _fallback_fwd(*args, **kwargs):
    if _cpu_kernel_ready("rel_attn_fwd", args[0]):
        return FWD(*args, **kwargs)
    return _reference_fwd(*args, **kwargs)


def _fallback_fwd_out(*args, out, **kwargs):
    if _cpu_kernel_ready("rel_attn_fwd.out", args[0]):
        return FWD_OUT(*args, out=out, **kwargs)
    got, lse = _reference_fwd(*args, **kwargs)
    out.copy_(got)
    return lse


def _fallback_bwd(dout, q, k, v, r, r_w_bias, r_r_bias, out, lse, softmax_scale, window_left,
                  window_right, key_padding_mask=None, attn_mask=None, attn_mask_band=None,
                  deterministic=True, dropout_p=0.0, dropout_seed=None, r_first_distance=None):
    args = (dout, q, k, v, r, r_w_bias, r_r_bias, out, lse, softmax_scale, window_left,
            window_right, key_padding_mask, attn_mask, attn_mask_band, deterministic,
            dropout_p, dropout_seed, r_first_distance)
    if _cpu_kernel_ready("rel_attn_bwd", q):
        return BWD(*args)
    from .reference import rel_attention_reference

    _no_reference_dropout("rel_attn_bwd", dropout_p)
    with torch.enable_grad():  # the reference's gradients, from its recomputed forward
        leaves = [t.detach().requires_grad_() for t in (q, k, v, r, r_w_bias, r_r_bias)]
        got = rel_attention_reference(*leaves, softmax_scale, window_left, window_right,
                                      key_padding_mask, attn_mask, attn_mask_band=attn_mask_band,
                                      r_first_distance=r_first_distance)
        grads = torch.autograd.grad(got, leaves, dout)
    return tuple(g.contiguous() for g in grads)


def _fallback_decode(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left=-1,
                     mem_k=None, mem_k_scale=None, mem_v=None, mem_v_scale=None,
                     r_first_distance=None):
    args = (q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, mem_k, mem_k_scale,
            mem_v, mem_v_scale, r_first_distance)
    if _cpu_kernel_ready("rel_attn_decode", q):
        return DECODE(*args)
    # the reference's causal attention of the one row (row j of r serves key j by default)
    out, _ = _reference_fwd(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, 0,
                            mem_k=mem_k, mem_k_scale=mem_k_scale, mem_v=mem_v,
                            mem_v_scale=mem_v_scale, r_first_distance=r_first_distance)
    return out


_LIB.impl("rel_attn_decode", _fallback_decode, "CompositeExplicitAutograd")
_LIB.impl("rel_attn_fwd", _fallback_fwd, "CompositeExplicitAutograd")
_LIB.impl("rel_attn_fwd.out", _fallback_fwd_out, "CompositeExplicitAutograd")
_LIB.impl("rel_attn_bwd", _fallback_bwd, "CompositeExplicitAutograd")


# ----------------------------------------------------------------------- Meta: the fakes

@torch.library.register_fake("txl_kernels::rel_attn_fwd", lib=_LIB)
def _fwd_fake(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
              key_padding_mask=None, attn_mask=None, attn_mask_band=None, dropout_p=0.0,
              dropout_seed=None, mem_k=None, mem_k_scale=None, mem_v=None, mem_v_scale=None,
              r_first_distance=None):
    B, Lq, H, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((B, H, Lq), dtype=_lse_dtype(q)))


@torch.library.register_fake("txl_kernels::rel_attn_fwd.out", lib=_LIB)
def _fwd_out_fake(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
                  key_padding_mask=None, attn_mask=None, attn_mask_band=None, dropout_p=0.0,
                  dropout_seed=None, mem_k=None, mem_k_scale=None, mem_v=None,
                  mem_v_scale=None, r_first_distance=None, *, out):
    B, Lq, H, _ = q.shape
    return q.new_empty((B, H, Lq), dtype=_lse_dtype(q))


@torch.library.register_fake("txl_kernels::rel_attn_bwd", lib=_LIB)
def _bwd_fake(dout, q, k, v, r, r_w_bias, r_r_bias, out, lse, softmax_scale, window_left,
              window_right, key_padding_mask=None, attn_mask=None, attn_mask_band=None,
              deterministic=True, dropout_p=0.0, dropout_seed=None, r_first_distance=None):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (q, k, v, r, r_w_bias, r_r_bias))


@torch.library.register_fake("txl_kernels::rel_attn_decode", lib=_LIB)
def _decode_fake(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left=-1, mem_k=None,
                 mem_k_scale=None, mem_v=None, mem_v_scale=None, r_first_distance=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------- Autograd: one definition

class _TritonInterpreter(TorchDispatchMode):
    """While active, the ops run the Triton kernels (their CUDA key's functions) whatever the
    tensors' device: under ``TRITON_INTERPRET=1`` on CPU tensors, where the CPU key is the C++
    kernel. A dispatch mode acts at the Python key, below autograd and torch.func's
    transforms, so the kernels get plain tensors as the CUDA key's would."""

    KERNELS = {FWD: "_triton_fwd", FWD_OUT: "_triton_fwd_out", BWD: "_triton_bwd",
               DECODE: "_triton_decode"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = self.KERNELS.get(func)
        if name is None or not _real(args):  # tracing (torch.export): the op's fake
            return func(*args, **(kwargs or {}))
        return globals()[name](*args, **(kwargs or {}))


def _real(args) -> bool:
    """No fake / functional / meta tensor among ``args`` (a trace is not recording)."""
    from torch._subclasses.fake_tensor import is_fake

    return not any(isinstance(a, Tensor) and (is_fake(a) or a.is_meta
                                              or torch._is_functional_tensor(a))
                   for a in args)


def _interpreted(op):
    def run(*args, **kwargs):
        with _TritonInterpreter():
            return op(*args, **kwargs)
    return run


def op_kernel(op, interpreter: bool = False):
    """What to call for ``op`` (``FWD``, ``FWD_OUT``, ``BWD`` or ``DECODE``): the op, whose
    tensors' device picks the kernel, or with ``interpreter`` the op with the Triton kernels
    on CPU tensors (``TRITON_INTERPRET=1``; :class:`_TritonInterpreter`). Inside a
    ``torch.compile`` trace always the plain op (opaque to dynamo; at run time its CPU key
    runs)."""
    if interpreter and not torch.compiler.is_dynamo_compiling():
        return _interpreted(op)
    return op


def _save(ctx, inputs, out, lse, deterministic: bool, interpreter: bool) -> None:
    (q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
     key_padding_mask, attn_mask, attn_mask_band, dropout_p, dropout_seed) = inputs[:14]
    ctx.has_memory = any(t is not None for t in inputs[14:18])
    ctx.args = (softmax_scale, window_left, window_right, deterministic, dropout_p or 0.0,
                inputs[18])
    ctx.interpreter = interpreter
    if ctx.has_memory:  # forward only: nothing to save (the backward raises)
        return
    ctx.save_for_backward(q, k, v, r, r_w_bias, r_r_bias, out, lse, key_padding_mask,
                          attn_mask, attn_mask_band, dropout_seed)


def _grads(ctx, dout):
    if ctx.has_memory:
        raise RuntimeError(
            "txl_kernels.rel_attention: the fused kernels with an 8-bit memory "
            "(memory=QuantizedKV) are forward only (inference); for gradients use "
            "backend='reference' (backend='auto' does when inputs require grad)")
    (q, k, v, r, r_w_bias, r_r_bias, out, lse, key_padding_mask, attn_mask, attn_mask_band,
     dropout_seed) = ctx.saved_tensors
    softmax_scale, window_left, window_right, deterministic, dropout_p, r_first_distance = \
        ctx.args
    with torch.no_grad():  # the backward has no derivative: no_second_derivative says so
        grads = op_kernel(BWD, ctx.interpreter)(
            last_dim_contiguous(dout), q, k, v, r, r_w_bias, r_r_bias, out, lse, softmax_scale,
            window_left, window_right, key_padding_mask, attn_mask, attn_mask_band,
            deterministic, dropout_p, dropout_seed, r_first_distance)
    return no_second_derivative(
        grads, (dout, q, k, v, r, r_w_bias, r_r_bias),
        "txl_kernels.rel_attention: double backward (differentiating the gradients, e.g. "
        "after create_graph=True for a gradient penalty, or torch.func.grad of "
        "torch.func.grad) is not supported by the fused kernels; use backend='reference' "
        "for it")


def _setup_context(ctx, inputs, output):
    inputs = tuple(inputs) + (None,) * (_N_FWD_ARGS - len(inputs))  # trailing defaults
    _save(ctx, inputs, *output, deterministic=True, interpreter=False)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, dlse):
    return (*_grads(ctx, dout), *(None,) * (_N_FWD_ARGS - 6))


# The op's autograd (direct callers of torch.ops.txl_kernels.rel_attn_fwd): the deterministic
# backward. rel_attn_func's autograd.Function below shares it and carries the caller's choice.
torch.library.register_autograd("txl_kernels::rel_attn_fwd", _backward,
                                setup_context=_setup_context, lib=_LIB)


class _RelAttnFunction(torch.autograd.Function):
    """:func:`rel_attn_func`'s autograd, the op's own (``_save`` / ``_grads``) with two more
    arguments: ``deterministic`` (only the backward uses it: kept on the context, as
    flash-attention does) and ``interpreter`` (:func:`op_kernel`). A separate
    ``setup_context`` and a generated vmap rule make torch.func's grad / vjp / vmap work (vmap
    runs the op once per element of the mapped dim: PyTorch's loop for ops without a batching
    rule)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
                key_padding_mask, attn_mask, attn_mask_band, dropout_p, dropout_seed, mem_k,
                mem_k_scale, mem_v, mem_v_scale, r_first_distance, deterministic, interpreter):
        return op_kernel(FWD, interpreter)(q, k, v, r, r_w_bias, r_r_bias, softmax_scale,
                                           window_left, window_right, key_padding_mask,
                                           attn_mask, attn_mask_band, dropout_p, dropout_seed,
                                           mem_k, mem_k_scale, mem_v, mem_v_scale,
                                           r_first_distance)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save(ctx, inputs, *output, deterministic=inputs[-2], interpreter=inputs[-1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_grads(ctx, dout), *(None,) * (_N_FWD_ARGS + 2 - 6))


class _RelAttnFunctionEager(_RelAttnFunction):
    """:class:`_RelAttnFunction` with a variadic forward, for eager calls: ``apply`` binds the
    forward's signature with ``inspect`` on every call, which costs ~35 us for 21 named
    arguments (as much as the CPU kernel at small shapes) and nothing for ``*inputs``; dynamo
    reads a variadic forward as the old ``forward(ctx, *args)`` form, so traced calls take the
    named one."""

    @staticmethod
    def forward(*inputs):
        return op_kernel(FWD, inputs[-1])(*inputs[:_N_FWD_ARGS])


def rel_attn_func(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
                  key_padding_mask=None, attn_mask=None, attn_mask_band=None,
                  deterministic=True, dropout_p=0.0, dropout_seed=None,
                  memory: Optional[QuantizedKV] = None,
                  r_first_distance: Optional[int] = None, out: Optional[Tensor] = None,
                  interpreter: bool = False) -> Tensor:
    """The fused kernels on arguments validated and normalised by ``rel_attention`` (the CPU
    kernel on CPU tensors, the Triton kernels on CUDA ones; ``interpreter``: the Triton
    kernels on CPU tensors under ``TRITON_INTERPRET=1``). Tensors whose last dimension is not
    contiguous are copied; others are read in place through their strides. Autocast is
    applied by the caller.

    Double backward is not supported: differentiating the gradients (after
    ``create_graph=True``, or torch.func.grad of torch.func.grad) raises; one backward with
    ``create_graph=True`` and torch.func's grad / vjp / vmap work.

    ``dropout_p`` > 0: attention dropout in the kernels; ``dropout_seed`` (int64 ``[2]``
    (seed, offset) on q's device) defaults to :func:`draw_dropout_seed`. It is kept for the
    backward, which regenerates the same mask.

    ``memory``: an 8-bit memory (``QuantizedKV``) read by the kernel in front of k / v
    (forward only: a backward through it raises). ``r_first_distance``: the distance held by
    r's row 0 (None: ``Lk - 1``). ``out``: a contiguous tensor of q's shape and dtype that
    receives the result, possibly q itself (``txl_kernels::rel_attn_fwd.out``; no autograd)."""
    if dropout_p > 0.0 and dropout_seed is None:
        dropout_seed = draw_dropout_seed(q.device)
    q, k, v, r, r_w_bias, r_r_bias = (last_dim_contiguous(t)
                                      for t in (q, k, v, r, r_w_bias, r_r_bias))
    mem = (None,) * 4 if memory is None else tuple(last_dim_contiguous(t) for t in memory)
    args = (q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
            key_padding_mask, attn_mask, attn_mask_band, float(dropout_p), dropout_seed, *mem,
            r_first_distance)
    if out is not None:
        op_kernel(FWD_OUT, interpreter)(*args, out=out)
        return out
    if torch.jit.is_tracing() or (not torch.is_grad_enabled() and not interpreter):
        # The op itself (with its registered autograd). Without grad mode there is no graph
        # to record (and torch.compile cannot trace the autograd.Function there: its
        # setup_context has no proxy); torch.jit.trace records a txl_kernels::rel_attn_fwd
        # node, which torch.jit.save writes and a C++ process runs once the op library is
        # loaded, where the autograd.Function would be a Python op.
        return FWD(*args)[0]
    fn = _RelAttnFunction if torch.compiler.is_dynamo_compiling() else _RelAttnFunctionEager
    return fn.apply(*args, deterministic, interpreter)[0]
