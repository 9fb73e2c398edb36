"""``rel_attention`` in TorchScript, for the drop-ins that ``torch.jit.script`` compiles (those
whose originals script: icefall's, whose export flow is torch.jit.script, and DI-engine's).

``rel_attention`` itself is Python (argument checks, backend dispatch, the Triton launcher), so
a scripted drop-in calls one of the two functions below instead, chosen when
``torch.jit.script`` prepares the module (:func:`script_uses_cpu_op`, from the module's
``__prepare_scriptable__``). A graph names the C++ op only when it was chosen (it then
holds the reference math too, for tensors on other devices), so a graph scripted without it
loads where the extension is absent.

- :func:`rel_attention_cpu_op`: the fused C++ CPU kernel, ``torch.ops.txl_kernels.
  rel_attn_fwd``, whose CPU kernel (and, without Python, whose schema) the op library
  registers in C++, so a C++ process that loaded it (:func:`txl_kernels.load_library` names
  it) runs the graph. Forward only.
- :func:`rel_attention_torch`: the reference's math (``reference.rel_attention_reference``:
  the same ops, so the same results) with a window, key padding and a dense mask, in
  TorchScript-compatible torch.

Both take arguments the scripted module has already checked: q ``[B, Lq, H, D]``, k / v
``[B, Lk, H, D]``, r ``[R, H, D]`` holding every row an allowed pair reads (row ``p = j - i +
Lq - 1``, as in ``rel_attention``), biases ``[H, D]``, the window sides of ``rel_attention``
after ``clamp_window`` (-1 = unbounded; causal is a right side of 0), key_padding_mask bool
``[B, Lk]`` (True = padded), attn_mask bool ``[B, H, Lq, Lk]`` (True = masked, possibly a
broadcast view).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._cpp_ops import warn_fallback
from ._utils import last_dim_contiguous
from .cpu_kernel import cpu_kernel_available
from ._export import ExportUnsupported
from .reference import pair_distance, relative_scores, weighted_values

__all__ = ["script_uses_cpu_op", "mark_cpu_op", "rel_attention_cpu_op", "rel_attention_torch"]


def script_uses_cpu_op(who: str, backend: str) -> bool:
    """Whether the graph ``torch.jit.script`` is about to compile for ``who`` (a drop-in with
    ``backend``) calls the C++ CPU op: "cpu" (raises RuntimeError when the extension cannot
    be built or loaded here) and "auto" where the extension loads (else the reference math,
    with the one-time fallback warning); never for "reference". "triton" raises
    :class:`ExportUnsupported`: the Triton kernels are launched from Python."""
    if backend == "triton":
        raise ExportUnsupported(
            f"{who}: backend='triton' cannot be recorded by torch.jit.script (the Triton "
            f"kernels are launched from Python): script the module with backend='auto' or "
            f"'cpu' (the C++ CPU kernel) or 'reference', or use torch.jit.trace")
    if backend == "reference":
        return False
    ok, why = cpu_kernel_available()
    if not ok:
        if backend == "cpu":
            raise RuntimeError(f"{who}: backend='cpu' cannot run here: {why}")
        warn_fallback("cpu", why)
    return ok


def mark_cpu_op(module: torch.nn.Module, who: str) -> None:
    """For a drop-in's ``__prepare_scriptable__``: record :func:`script_uses_cpu_op` (of its
    ``backend``) as the presence of the attribute ``_jit_cpu_op``, which the scripted forward
    tests with ``hasattr``: TorchScript decides that test when it compiles, so a graph
    scripted without the op never names it."""
    if script_uses_cpu_op(who, module.backend):
        module._jit_cpu_op = True
    elif "_jit_cpu_op" in module.__dict__:
        del module._jit_cpu_op


def rel_attention_cpu_op(q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor,
                         r_r_bias: Tensor, softmax_scale: float, window_left: int,
                         window_right: int, key_padding_mask: Optional[Tensor],
                         attn_mask: Optional[Tensor], dropout_p: float, who: str) -> Tensor:
    """The C++ CPU kernel on CPU tensors, as ``rel_attention(backend="cpu")`` calls it.
    Attention dropout (``dropout_p > 0``, a module in training mode) raises: the graph has no
    seed for the kernel's dropout."""
    if dropout_p > 0.0:
        raise RuntimeError(f"{who}: attention dropout (dropout_p={dropout_p}, the module in "
                           f"training mode) in the fused CPU kernel cannot be recorded by "
                           f"torch.jit.script: call eval() on the scripted module, or script "
                           f"it with backend='reference'")
    out, lse = torch.ops.txl_kernels.rel_attn_fwd(
        last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v),
        last_dim_contiguous(r), last_dim_contiguous(r_w_bias), last_dim_contiguous(r_r_bias),
        softmax_scale, window_left, window_right, key_padding_mask, attn_mask, None, 0.0, None,
        None, None, None, None)
    return out


def rel_attention_torch(q: Tensor, k: Tensor, v: Tensor, r: Tensor, r_w_bias: Tensor,
                        r_r_bias: Tensor, softmax_scale: float, window_left: int,
                        window_right: int, key_padding_mask: Optional[Tensor],
                        attn_mask: Optional[Tensor], dropout_p: float) -> Tensor:
    """The reference's math in a form TorchScript compiles (its products are the reference's
    own ``relative_scores`` / ``weighted_values``; the masks with int window sides): scores
    accumulated in fp32 (fp64 for fp64), what the masks exclude never reaching
    the result, rows with no allowed key giving 0, dropout with ``F.dropout``."""
    lq, lk = q.shape[1], k.shape[1]
    scores = relative_scores(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, None)

    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if window_left >= 0 or window_right >= 0:  # reference.in_window, with int sides
        d = pair_distance(lq, lk, q.device)
        if window_left >= 0:
            allowed = allowed & (d <= window_left)
        if window_right >= 0:
            allowed = allowed & (-d <= window_right)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    if attn_mask is not None:
        allowed = allowed & ~attn_mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_has_key = allowed.any(dim=-1, keepdim=True)
    scores = torch.where(row_has_key, scores, scores.new_zeros([]))
    prob = torch.softmax(scores, dim=-1) * row_has_key
    if dropout_p > 0.0:
        prob = F.dropout(prob, p=dropout_p, training=True)
    return weighted_values(prob.to(v.dtype), v).to(q.dtype)
