"""torch.library registration and autograd for the fused relative-attention kernels.

Chain (Liger-Kernel style): ``_rel_attn_fwd_kernel`` (rel_attn_fwd.py, @triton.jit) ->
``rel_attn_fwd()`` (launcher) -> ``txl_kernels::rel_attn_fwd`` (custom op, with a fake
implementation and an autograd registration whose backward is the ``txl_kernels::rel_attn_bwd``
custom op) -> ``rel_attn_func()`` -> ``txl_kernels.rel_attention()`` (public, functional.py)
-> ``FusedRelAttention``.

8-bit memory (``txl_kernels.quant.QuantizedKV``): the forward op takes its four tensors as
optional arguments (``mem_k``, ``mem_k_scale``, ``mem_v``, ``mem_v_scale``), so compile and
opcheck see them; it is forward only (its autograd raises: ``rel_attention`` sends calls that
record gradients to the reference).

Registering the kernels as custom ops lets ``torch.compile(fullgraph=True)`` trace through
them without graph breaks (the fake implementations give output shapes), and
``torch.library.opcheck`` validate the registrations.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._export import register_onnx_symbolics
from .._utils import no_second_derivative
from ..quant import QuantizedKV
from .rel_attn_bwd import rel_attn_bwd
from .rel_attn_fwd import draw_dropout_seed, rel_attn_fwd

__all__ = ["rel_attn_func"]


@torch.library.custom_op("txl_kernels::rel_attn_fwd", mutates_args=())
def _rel_attn_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor, r_r_bias: Tensor,
    softmax_scale: float, window_left: int, window_right: int,
    key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
    attn_mask_band: Optional[Tensor] = None, dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None, mem_k: Optional[Tensor] = None,
    mem_k_scale: Optional[Tensor] = None, mem_v: Optional[Tensor] = None,
    mem_v_scale: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    if dropout_p > 0.0 and dropout_seed is None:
        raise ValueError("txl_kernels::rel_attn_fwd: dropout_p > 0 needs dropout_seed (int64 [2] "
                         "(seed, offset) on q's device, e.g. ops.rel_attn_fwd.draw_dropout_seed)")
    return rel_attn_fwd(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left,
                        window_right, key_padding_mask, attn_mask,
                        attn_mask_band=attn_mask_band, dropout_p=dropout_p,
                        dropout_seed=dropout_seed,
                        memory=_memory(mem_k, mem_k_scale, mem_v, mem_v_scale))


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


@_rel_attn_fwd_op.register_fake
def _(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
      key_padding_mask, attn_mask, attn_mask_band=None, dropout_p=0.0, dropout_seed=None,
      mem_k=None, mem_k_scale=None, mem_v=None, mem_v_scale=None):
    B, Lq, H, D = q.shape
    out = q.new_empty((B, Lq, H, D))
    lse = q.new_empty((B, H, Lq), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("txl_kernels::rel_attn_bwd", mutates_args=())
def _rel_attn_bwd_op(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor, r_r_bias: Tensor,
    out: Tensor, lse: Tensor, softmax_scale: float, window_left: int, window_right: int,
    key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
    attn_mask_band: Optional[Tensor] = None, deterministic: bool = True,
    dropout_p: float = 0.0, dropout_seed: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return rel_attn_bwd(do, q, k, v, r, r_w_bias, r_r_bias, out, lse, softmax_scale,
                        window_left, window_right, key_padding_mask, attn_mask,
                        attn_mask_band=attn_mask_band, deterministic=deterministic,
                        dropout_p=dropout_p, dropout_seed=dropout_seed)


@_rel_attn_bwd_op.register_fake
def _(do, q, k, v, r, r_w_bias, r_r_bias, out, lse, softmax_scale, window_left, window_right,
      key_padding_mask, attn_mask, attn_mask_band=None, deterministic=True, dropout_p=0.0,
      dropout_seed=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            torch.empty_like(r, memory_format=torch.contiguous_format),
            torch.empty_like(r_w_bias, memory_format=torch.contiguous_format),
            torch.empty_like(r_r_bias, memory_format=torch.contiguous_format))


def _save(ctx, inputs, out, lse) -> None:
    (q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
     key_padding_mask, attn_mask, attn_mask_band, dropout_p, dropout_seed) = inputs[:14]
    ctx.has_memory = any(t is not None for t in inputs[14:])
    if ctx.has_memory:  # forward only: nothing to save (backward raises)
        return
    ctx.save_for_backward(q, k, v, r, r_w_bias, r_r_bias, out, lse, key_padding_mask,
                          attn_mask, attn_mask_band, dropout_seed)
    ctx.softmax_scale = softmax_scale
    ctx.dropout_p = dropout_p
    ctx.window = (window_left, window_right)


def _grads(ctx, dout, deterministic: bool):
    if ctx.has_memory:
        raise RuntimeError(
            "txl_kernels.rel_attention: the fused kernel with an 8-bit memory "
            "(memory=QuantizedKV) is forward only (inference); for gradients use "
            "backend='reference' (backend='auto' does when inputs require grad)")
    (q, k, v, r, r_w_bias, r_r_bias, out, lse, key_padding_mask, attn_mask,
     attn_mask_band, dropout_seed) = ctx.saved_tensors
    with torch.no_grad():  # the backward op has no derivative: no_second_derivative says so
        grads = _rel_attn_bwd_op(
            dout, q, k, v, r, r_w_bias, r_r_bias, out, lse, ctx.softmax_scale, ctx.window[0],
            ctx.window[1], key_padding_mask, attn_mask, attn_mask_band, deterministic,
            ctx.dropout_p, dropout_seed)
    return no_second_derivative(
        grads, (dout, q, k, v, r, r_w_bias, r_r_bias),
        "txl_kernels.rel_attention: double backward (differentiating the gradients, e.g. "
        "after create_graph=True for a gradient penalty, or torch.func.grad of "
        "torch.func.grad) is not supported by the fused kernel; use backend='reference' "
        "for it")


# The op's own autograd (for direct callers of torch.ops.txl_kernels.rel_attn_fwd): the
# deterministic backward. rel_attn_func below carries the caller's choice instead.
def _setup_context(ctx, inputs, output):
    inputs = tuple(inputs) + (None,) * (18 - len(inputs))  # defaults of the trailing arguments
    _save(ctx, inputs[:12] + (inputs[12] or 0.0,) + inputs[13:], *output)


def _backward(ctx, dout, dlse):
    return (*_grads(ctx, dout, True), *(None,) * 12)


_rel_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)
register_onnx_symbolics()  # the op called directly, exported by dynamo=False


class _RelAttnFunction(torch.autograd.Function):
    """Autograd for rel_attn_func: the forward op does not take ``deterministic`` (only the
    backward uses it); it is kept on the context, as flash-attention does. A separate
    ``setup_context`` and a generated vmap rule make torch.func's grad / vjp / vmap work (vmap
    runs the op once per element of the mapped dim: PyTorch's loop for ops without a
    batching rule)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
                key_padding_mask, attn_mask, attn_mask_band, dropout_p, dropout_seed,
                mem_k, mem_k_scale, mem_v, mem_v_scale, deterministic):
        return _rel_attn_fwd_op(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left,
                                window_right, key_padding_mask, attn_mask, attn_mask_band,
                                dropout_p, dropout_seed, mem_k, mem_k_scale, mem_v,
                                mem_v_scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save(ctx, inputs[:-1], *output)
        ctx.deterministic = inputs[-1]
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_grads(ctx, dout, ctx.deterministic), *(None,) * 13)


def rel_attn_func(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
                  key_padding_mask=None, attn_mask=None, attn_mask_band=None,
                  deterministic=True, dropout_p=0.0, dropout_seed=None,
                  memory: Optional[QuantizedKV] = None) -> Tensor:
    """Fused relative attention on validated, normalised arguments (see functional.py).
    Double backward is not supported: differentiating the gradients (after
    ``create_graph=True``, or torch.func.grad of torch.func.grad) raises; one backward with
    ``create_graph=True`` and torch.func's grad / vjp / vmap work. Autocast is applied by the
    caller (``rel_attention``).

    ``dropout_p`` > 0: attention dropout in the kernels; ``dropout_seed`` (int64 ``[2]``
    (seed, offset) on q's device) defaults to ``draw_dropout_seed(q.device)``, one
    ``torch.randint`` on PyTorch's default generator of that device (reproducible under
    ``torch.manual_seed``). It is kept for the backward, which regenerates the same mask.

    ``memory``: an 8-bit memory (``QuantizedKV``) read by the kernel in front of k / v
    (forward only: a backward through it raises)."""
    if dropout_p > 0.0 and dropout_seed is None:
        dropout_seed = draw_dropout_seed(q.device)
    mem = (None,) * 4 if memory is None else tuple(memory)
    out, _ = _RelAttnFunction.apply(q, k, v, r, r_w_bias, r_r_bias, softmax_scale,
                                    window_left, window_right, key_padding_mask, attn_mask,
                                    attn_mask_band, float(dropout_p), dropout_seed, *mem,
                                    deterministic)
    return out
