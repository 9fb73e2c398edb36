"""What ``rel_attention`` does while ``torch.onnx.export`` traces a model (both exporters).

The ONNX lowering is ``_onnx_lowering.onnx_rel_attention``: the reference path's math
(``reference.rel_attention_reference``) written for ONNX Runtime, MatMuls for the content and
position scores, the relative shift as Pad / Reshape / Slice (``reference.rel_shift``), the
masks as comparisons of index ranges and Where (``reference.allowed_pairs``), Softmax, a
MatMul with the values. While an ONNX export traces (:func:`onnx_exporting`), ``rel_attention``
runs it whatever its ``backend``, so the fused op (``txl_kernels::rel_attn_fwd``, whichever
kernel runs it) does not reach the graph and the exporter writes standard ONNX
operators. The user passes nothing: ``torch.onnx.export(model, args)`` works with
``dynamo=False`` (the TorchScript exporter, e.g. NeMo's export at opset 17) and ``dynamo=True``
(torch.export, then onnxscript's torchlib). One definition of the math serves both exporters,
and every shape in it is computed from the inputs' (symbolic) shapes: dynamic batch and time
axes, no position table or ``Lq x Lk`` constant fixed at export.

Why a route and not a per-op translation: the ``dynamo=True`` exporter reads translations of
custom ops only from its ``custom_translation_table`` argument (torch 2.14 builds its
registry from torchlib at each export and has no public global registration;
``torch.onnx.ops`` only emits custom-domain nodes), so a translation would need an argument
from every user. ``torch.onnx.is_in_onnx_export()`` is True while either exporter traces,
which is where this route is taken. Where a fused op can still reach a graph (a model that
calls it directly), :func:`register_onnx_symbolics` gives the dynamo=False exporter its
symbolic, the same math in ONNX operators.

Features without an ONNX form raise :class:`ExportUnsupported` naming the feature and the
route: attention dropout in training, an 8-bit memory (``memory=QuantizedKV``) and context
parallelism. The same class serves every export route (:func:`export_route`: ONNX,
TorchScript, torch.export / AOTInductor) for what that route cannot record.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from ._utils import assume_constant_result

__all__ = ["onnx_exporting", "export_route", "ExportUnsupported", "check_onnx_exportable",
           "check_jit_recordable", "refuse_context_parallel", "register_onnx_symbolics"]

ROUTE = "torch.onnx.export"


class ExportUnsupported(NotImplementedError):
    """A feature that an export route (:func:`export_route`) cannot record, met while that
    route records the call; the message names the feature, the route and what to do."""


@assume_constant_result
def onnx_exporting() -> bool:
    """True while ``torch.onnx.export`` traces (either exporter). ``torch.onnx`` is imported
    by every export, so until it is loaded nothing is exporting (and ``import torch.onnx`` is
    not paid by calls outside an export). A constant to dynamo (run, not traced): the
    ``dynamo=True`` exporter's strict capture then sees the flag as it is."""
    return "torch.onnx" in sys.modules and torch.onnx.is_in_onnx_export()


def export_route() -> Optional[str]:
    """The export route recording the current call: ``"torch.onnx.export"`` (either
    exporter; checked first, as its TorchScript exporter also traces and its dynamo exporter
    also runs torch.export), ``"torch.jit.script"``, ``"torch.jit.trace"``,
    ``"torch.export"`` (also AOTInductor, which compiles an exported program), or None."""
    if onnx_exporting():
        return ROUTE
    if torch.jit.is_scripting():
        return "torch.jit.script"
    if torch.jit.is_tracing():
        return "torch.jit.trace"
    if torch.compiler.is_exporting():
        return "torch.export"
    return None


def _unsupported(feature: str, instead: str) -> ExportUnsupported:
    return ExportUnsupported(f"{feature} cannot be exported by {ROUTE} (it has no ONNX "
                             f"form): {instead}")


def refuse_context_parallel(who: str) -> None:
    """Raise :class:`ExportUnsupported` when any export route records context parallelism
    (``who``: the function or module that runs the ring; call it before its first
    collective): the ring's exchanges and the global lengths are decided at run time through
    torch.distributed, which no exported graph holds."""
    route = export_route()
    if route is not None:
        raise ExportUnsupported(
            f"{who}: context parallelism (a cp_group / context_parallel_rel_attention, whose "
            f"ranks exchange keys and values with torch.distributed at run time) cannot be "
            f"recorded by {route}: export the model in one process with cp_group = None (each "
            f"call then holds the whole sequence)")


def check_jit_recordable(who: str, dropout_p: float) -> None:
    """Raise :class:`ExportUnsupported`, naming the feature and the route, for what a fused
    kernel cannot put in a TorchScript graph (call it where the call takes a fused kernel):
    attention dropout. A graph records the module's training mode as a constant (it would
    keep dropping after ``eval()``), and its backward would be the op's own deterministic
    one, not the caller's choice."""
    route = export_route()
    if route in ("torch.jit.trace", "torch.jit.script") and dropout_p > 0.0:
        raise ExportUnsupported(
            f"{who}: attention dropout (dropout_p={dropout_p}, e.g. a module in training mode) "
            f"in the fused kernels cannot be recorded by {route}: call model.eval() first, or "
            f"use backend='reference' (its F.dropout records)")


def check_onnx_exportable(dropout_p: float, memory) -> None:
    """Raise for ``rel_attention``'s features without an ONNX form (call it while an export
    traces)."""
    if dropout_p > 0.0:
        raise _unsupported(
            f"rel_attention: attention dropout (dropout_p={dropout_p}, e.g. a drop-in module "
            f"in training mode)",
            "call model.eval() before exporting (torch.onnx.export(dynamo=False) does by "
            "default, training=TrainingMode.EVAL), or pass dropout_p=0.0")
    if memory is not None:
        raise _unsupported(
            "rel_attention: an 8-bit memory (memory=QuantizedKV)",
            "export with the memory dequantised in front of k / v (memory.dequantize() "
            "concatenated with k and v along the time axis, memory=None)")


# -- the fused ops in a TorchScript exporter graph -----------------------------------------
# A model that calls the fused op itself (``torch.ops.txl_kernels.rel_attn_fwd``, not
# through rel_attention) puts the op in the dynamo=False exporter's graph: there a symbolic
# per op writes the same reference math with ONNX operators, registered for opset 13
# (ReduceMax with an ``axes`` attribute) and 18 (``axes`` an input) by
# :func:`register_onnx_symbolics`, and so for every opset from 13 on.

_FUSED_OPS = ("txl_kernels::rel_attn_fwd",)


class _Onnx:
    """Graph-building helpers of the symbolic: int64 constants, a dimension of a tensor and a
    kept max over the last axis (in ``opset``'s form)."""

    def __init__(self, g, opset: int):
        self.g, self.opset = g, opset

    def i64(self, *vals):
        return self.g.op("Constant", value_t=torch.tensor(vals, dtype=torch.int64))

    def dim(self, x, axis):  # x.shape[axis] as int64 [1]
        return self.g.op("Gather", self.g.op("Shape", x), self.i64(axis), axis_i=0)

    def reduce_max(self, x):  # over the last axis, kept
        if self.opset >= 18:
            return self.g.op("ReduceMax", x, self.i64(-1), keepdims_i=1)
        return self.g.op("ReduceMax", x, axes_i=[-1], keepdims_i=1)


def _onnx_scores(o: _Onnx, q, k, r, r_w_bias, r_r_bias, scale: float):
    """The scaled scores ``(AC + BD) * scale`` ``[B, H, Lq, Lk]``: (q + u) k^T and the
    shifted (q + v) r^T (``reference.rel_shift``: pad the position axis to W = Lk + Lq,
    flatten, read Lq rows of W - 1 from offset Lq - 1, keep Lk columns)."""
    g, i64, dim = o.g, o.i64, o.dim
    qu = g.op("Transpose", g.op("Add", q, r_w_bias), perm_i=[0, 2, 1, 3])
    qv = g.op("Transpose", g.op("Add", q, r_r_bias), perm_i=[0, 2, 1, 3])
    ac = g.op("MatMul", qu, g.op("Transpose", k, perm_i=[0, 2, 3, 1]))
    bdt = g.op("MatMul", qv, g.op("Transpose", r, perm_i=[1, 2, 0]))
    lq, lk, rlen = dim(q, 1), dim(k, 1), dim(r, 0)
    batch, heads = dim(q, 0), dim(q, 2)
    one = i64(1)
    width = g.op("Add", lk, lq)
    pads = g.op("Concat", i64(0, 0, 0, 0, 0, 0, 0), g.op("Sub", width, rlen), axis_i=0)
    flat = g.op("Reshape", g.op("Pad", bdt, pads),
                g.op("Concat", batch, heads, g.op("Mul", lq, width), axis_i=0))
    start = g.op("Sub", lq, one)
    wm1 = g.op("Sub", width, one)
    rows = g.op("Slice", flat, start, g.op("Add", start, g.op("Mul", lq, wm1)), i64(2))
    bd = g.op("Slice", g.op("Reshape", rows, g.op("Concat", batch, heads, lq, wm1,
                                                  axis_i=0)),
              i64(0), lk, i64(3))
    return g.op("Mul", g.op("Add", ac, bd),
                g.op("Constant", value_t=torch.tensor(scale, dtype=torch.float32)))


def _onnx_allowed(o: _Onnx, q, k, scores, wl: int, wr: int, key_padding_mask, attn_mask):
    """The allowed pairs, bool of the scores' shape: d = (i + Lk - Lq) - j within the
    window, the key not padded, the pair not masked (``key_padding_mask`` / ``attn_mask``
    None where not given)."""
    g, i64 = o.g, o.i64
    lq, lk = o.dim(q, 1), o.dim(k, 1)
    zero, one = i64(0), i64(1)
    i = g.op("Unsqueeze", g.op("Range", zero, g.op("Squeeze", lq, zero), one), i64(1))
    j = g.op("Range", zero, g.op("Squeeze", lk, zero), one)
    d = g.op("Sub", g.op("Add", i, g.op("Squeeze", g.op("Sub", lk, lq), zero)), j)
    allowed = g.op("Constant", value_t=torch.tensor(True))
    if wl >= 0:
        allowed = g.op("And", allowed, g.op("LessOrEqual", d, i64(wl)))
    if wr >= 0:
        allowed = g.op("And", allowed, g.op("LessOrEqual", g.op("Neg", d), i64(wr)))
    if key_padding_mask is not None:
        kpm = g.op("Unsqueeze", key_padding_mask, i64(1, 2))
        allowed = g.op("And", allowed, g.op("Not", kpm))
    if attn_mask is not None:
        allowed = g.op("And", allowed, g.op("Not", attn_mask))
    allowed = g.op("And", allowed, g.op("Constant", value_t=torch.ones(
        1, 1, 1, 1, dtype=torch.bool)))
    return g.op("Expand", allowed, g.op("Shape", scores))


def _onnx_softmax_out(o: _Onnx, scores, allowed, v):
    """``(out [B, Lq, H, D], lse [B, H, Lq])`` from the scores and allowed pairs: the masked
    softmax (rows with no allowed key give 0, their lse +inf) times v."""
    g = o.g
    row_has = g.op("Cast", o.reduce_max(g.op("Cast", allowed, to_i=1)), to_i=9)
    ninf = g.op("Constant", value_t=torch.tensor(float("-inf")))
    masked = g.op("Where", allowed, scores, ninf)
    safe = g.op("Where", row_has, masked, g.op("Constant", value_t=torch.tensor(0.0)))
    prob = g.op("Mul", g.op("Softmax", safe, axis_i=-1), g.op("Cast", row_has, to_i=1))
    out = g.op("MatMul", prob, g.op("Transpose", v, perm_i=[0, 2, 1, 3]))
    out = g.op("Transpose", out, perm_i=[0, 2, 1, 3])
    lse = g.op("Add", g.op("Log", g.op("ReduceSum", g.op("Exp", g.op(
        "Sub", safe, o.reduce_max(safe))), o.i64(-1), keepdims_i=1)), o.reduce_max(safe))
    lse = g.op("Where", row_has, lse, g.op("Constant", value_t=torch.tensor(float("inf"))))
    return out, g.op("Squeeze", lse, o.i64(-1))


def _rel_attn_symbolic(opset: int):
    def symbolic(g, q, k, v, r, r_w_bias, r_r_bias, softmax_scale, window_left, window_right,
                 key_padding_mask, attn_mask, attn_mask_band=None, dropout_p=None,
                 dropout_seed=None, mem_k=None, *rest):
        from torch.onnx import symbolic_helper as sh

        def given(x):
            return x is not None and not sh._is_none(x)

        if (given(mem_k) or (given(dropout_p) and sh._maybe_get_const(dropout_p, "f") > 0.0)):
            raise ExportUnsupported(
                "txl_kernels fused op: an 8-bit memory or attention dropout cannot be "
                f"exported by {ROUTE}; trace the model in eval mode without memory=QuantizedKV")
        o = _Onnx(g, opset)
        scale = sh._maybe_get_const(softmax_scale, "f")
        wl = int(sh._maybe_get_const(window_left, "i"))
        wr = int(sh._maybe_get_const(window_right, "i"))
        scores = _onnx_scores(o, q, k, r, r_w_bias, r_r_bias, scale)
        allowed = _onnx_allowed(o, q, k, scores, wl, wr,
                                key_padding_mask if given(key_padding_mask) else None,
                                attn_mask if given(attn_mask) else None)
        # the op's two outputs: the output and the row log-sum-exp (+inf for empty rows)
        return _onnx_softmax_out(o, scores, allowed, v)

    return symbolic


_SYMBOLICS_REGISTERED = False


def register_onnx_symbolics() -> None:
    """Register the fused ops' symbolics with the dynamo=False exporter, once (imports
    ``torch.onnx``; called where the ops are defined: the extension's load, the Triton ops'
    module)."""
    global _SYMBOLICS_REGISTERED
    if _SYMBOLICS_REGISTERED:
        return
    from torch.onnx import register_custom_op_symbolic

    for name in _FUSED_OPS:
        for opset in (13, 18):
            register_custom_op_symbolic(name, _rel_attn_symbolic(opset), opset)
    _SYMBOLICS_REGISTERED = True
