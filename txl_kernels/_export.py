"""What ``rel_attention`` does while ``torch.onnx.export`` traces a model (both exporters).

The ONNX lowering is the reference path (``reference.rel_attention_reference``): two MatMuls
for the content and position scores, the relative shift as Pad / Reshape / Slice, the masks
as comparisons of index ranges and Where, Softmax, a MatMul with the values. While an ONNX
export traces (:func:`onnx_exporting`), ``rel_attention`` runs that path whatever its
``backend``, so neither fused op (``txl_kernels::rel_attn_cpu_fwd``, ``txl_kernels::rel_attn_fwd``)
reaches the graph and the exporter writes the reference's aten ops as standard ONNX
operators. The user passes nothing: ``torch.onnx.export(model, args)`` works with
``dynamo=False`` (the TorchScript exporter, e.g. NeMo's export at opset 17) and ``dynamo=True``
(torch.export, then onnxscript's torchlib). One definition of the math serves both exporters,
and every shape in it is computed from the inputs' (symbolic) shapes: dynamic batch and time
axes, no position table or ``Lq x Lk`` constant fixed at export.

Why a route and not a per-op translation: the ``dynamo=True`` exporter reads translations of
custom ops only from its ``custom_translation_table`` argument (torch 2.14 has no public
global registry; ``torch.onnx.ops`` only emits custom-domain nodes), so a translation would
need an argument from every user. ``torch.onnx.is_in_onnx_export()`` is True while either
exporter traces, which is where this route is taken.

Features without an ONNX form raise :class:`OnnxExportUnsupported` (a ``RuntimeError``)
naming the feature and the route: attention dropout in training, an 8-bit memory
(``memory=QuantizedKV``) and context parallelism.
"""
from __future__ import annotations

import sys

import torch

from ._utils import assume_constant_result

__all__ = ["onnx_exporting", "OnnxExportUnsupported", "check_onnx_exportable",
           "refuse_context_parallel"]

ROUTE = "torch.onnx.export"


class OnnxExportUnsupported(RuntimeError):
    """A feature of ``rel_attention`` that has no ONNX form, met while ``torch.onnx.export``
    traces the model."""


@assume_constant_result
def onnx_exporting() -> bool:
    """True while ``torch.onnx.export`` traces (either exporter). ``torch.onnx`` is imported
    by every export, so until it is loaded nothing is exporting (and ``import torch.onnx`` is
    not paid by calls outside an export). A constant to dynamo (run, not traced): the
    ``dynamo=True`` exporter's strict capture then sees the flag as it is."""
    return "torch.onnx" in sys.modules and torch.onnx.is_in_onnx_export()


def _unsupported(feature: str, instead: str) -> OnnxExportUnsupported:
    return OnnxExportUnsupported(f"{feature} cannot be exported by {ROUTE} (it has no ONNX "
                                 f"form): {instead}")


def refuse_context_parallel(who: str) -> None:
    """Raise :class:`OnnxExportUnsupported` when an ONNX export traces context parallelism
    (``who``: the function or module that runs the ring): its collectives have no ONNX
    form."""
    if onnx_exporting():
        raise _unsupported(
            f"{who}: context parallelism (a cp_group / context_parallel_rel_attention, whose "
            f"ranks exchange keys and values with torch.distributed)",
            "export the model in one process with cp_group = None (each call then holds the "
            "whole sequence)")


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
