"""Small helpers shared by every layer of the package (no triton import here).

One place for: describing a tensor in error messages, checking int arguments, whether Triton
runs interpreted, the dtypes / head dims the fused kernels support, the fused backwards'
refusal of a second derivative, and the old names of renamed keywords.
"""
from __future__ import annotations

import functools
import inspect
import operator
import os
import sys
import warnings

import torch

__all__ = ["describe", "check_same", "as_len", "interpreting", "interpret_requested",
           "no_interpreter_reason", "no_second_derivative", "FUSED_DTYPES", "REF_DTYPES",
           "FUSED_MIN_HEADDIM", "FUSED_MAX_HEADDIM", "renamed_keywords", "renamed_attribute",
           "check_values"]

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REF_DTYPES = FUSED_DTYPES + (torch.float64,)
FUSED_MIN_HEADDIM, FUSED_MAX_HEADDIM = 16, 256


def describe(t) -> str:
    """``shape [..], dtype .., device .., strides (..)`` for a tensor, the type name otherwise."""
    if not isinstance(t, torch.Tensor):
        return f"{type(t).__name__} {t!r:.60}"
    return (f"shape {list(t.shape)}, dtype {t.dtype}, device {t.device}, "
            f"strides {tuple(t.stride())}")


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton interpreter now (read at each call)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false",
                                                                            "off", "no")


def interpreting() -> bool:
    """Whether our Triton kernels run under the interpreter. ``@triton.jit`` reads
    ``TRITON_INTERPRET`` once, when it creates a kernel (when ``txl_kernels.ops`` is imported):
    after that, what it created decides (an ``InterpretedFunction`` or a compiled
    ``JITFunction``), whatever the variable says now; before, the variable now.
    Cheap after the first kernel is found (the answer is kept with the module that holds it:
    the model layers ask on every call)."""
    global _FOUND
    if _FOUND is not None and sys.modules.get(_FOUND[0].__name__) is _FOUND[0]:
        return _FOUND[1]
    if "txl_kernels.ops" not in sys.modules:  # no kernel created yet
        return interpret_requested()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("txl_kernels.ops.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            for _ in range(3):  # triton.autotune / triton.heuristics wrap the kernel as .fn
                kind = type(obj).__name__
                if kind in ("InterpretedFunction", "JITFunction"):
                    _FOUND = (mod, kind == "InterpretedFunction")
                    return _FOUND[1]
                obj = getattr(obj, "fn", None)
    return interpret_requested()


_FOUND = None  # (the ops module whose kernel interpreting() found, the answer)


def no_interpreter_reason() -> str:
    """Why CPU tensors cannot take the fused kernels (when :func:`interpreting` is False)."""
    if interpret_requested():
        return ("TRITON_INTERPRET=1 was set after the Triton kernels were created (when "
                "txl_kernels.ops was first used), so they are compiled GPU kernels; set it "
                "before the first fused call (e.g. in the shell)")
    return ("CPU tensors need TRITON_INTERPRET=1 set before triton is imported (the Triton "
            "interpreter); there is no compiled CPU kernel")


def check_same(who: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, *,
               dtype: bool = True, device: bool = True) -> None:
    """Raise, naming both tensors, if ``t``'s dtype (TypeError) or device (ValueError) is not
    ``ref``'s."""
    if dtype and t.dtype != ref.dtype:
        raise TypeError(f"{who}: {name} has dtype {t.dtype}, {ref_name} has {ref.dtype}")
    if device and t.device != ref.device:
        raise ValueError(f"{who}: {name} is on {t.device}, {ref_name} is on {ref.device}")


class _NoSecondDerivative(torch.autograd.Function):
    """Identity on a fused backward's gradients (views), tied to the tensors they depend on;
    its backward raises ``message``. Forward / setup_context / a generated vmap rule: the
    form torch.func transforms need."""

    generate_vmap_rule = True

    @staticmethod
    def forward(message, n, *tensors):
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def no_second_derivative(grads, sources, message: str):
    """The gradients a fused backward computed (without a graph) as it returns them. When a
    graph of them is being recorded (grad mode on in the backward: ``create_graph=True``,
    and torch.func's grad / vjp / jacrev, which always record one so that they compose) and
    a tensor they depend on (``sources``: the incoming gradient, the saved inputs) requires
    grad, they are tied to ``sources`` through a node whose backward raises ``message``: the
    fused kernels have no second derivative, so differentiating their gradients fails
    instead of treating them as constants. A first derivative is unaffected."""
    if not torch.is_grad_enabled() or not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in sources):
        return tuple(grads)
    return _NoSecondDerivative.apply(message, len(grads), *grads,
                                     *(t for t in sources if isinstance(t, torch.Tensor)))


def check_values(ok: torch.Tensor, error: type, message: str) -> None:
    """Raise ``error(message)`` unless the one-element bool tensor ``ok`` is True: a check of
    tensor values, eagerly with one host sync. Under ``torch.export`` (and AOTInductor, which
    compiles an exported program) values are unknown while tracing, so the check goes into
    the program instead (``torch._assert_async``): a RuntimeError with ``message`` when the
    program runs on values that fail it."""
    if torch.compiler.is_exporting():
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise error(message)


def as_len(name: str, value, who: str, low: int = 0) -> int:
    """``value`` (an int, or anything with ``__index__``) as an int in ``[low, 2**63)``; errors
    name ``who`` and ``name``."""
    what = "a non-negative int" if low == 0 else f"an int >= {low}"
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dim() != 0):
        raise TypeError(f"{who}: {name} must be {what}, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{who}: {name} must be {what}, got "
                        f"{type(value).__name__} {value!r}") from None
    if n < low:
        raise ValueError(f"{who}: {name} must be >= {low}, got {n}")
    if n >= 2 ** 63:
        raise ValueError(f"{who}: {name} must fit in int64 (< 2**63), got {n}")
    return n


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo``: the public
    decorator imports it, and with it triton, whose own ``@triton.jit`` helpers then read
    ``TRITON_INTERPRET`` at ``import txl_kernels`` time, before ``python -m txl_kernels`` (or a
    user) can set it. The mark is the attribute that decorator sets; where ``torch._dynamo`` is
    already loaded the decorator itself is used."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


def renamed_keywords(who: str, **renames: str):
    """Decorate a function (or ``__init__``) whose keywords were renamed, ``old="new"``: a
    call that passes ``old=`` still works, with a ``DeprecationWarning`` naming ``new``; a
    call that passes both (``new`` by keyword or by position) raises ``TypeError``. The
    signature the wrapper shows (``inspect.signature``) is the new one."""
    def decorate(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for old, new in renames.items():
                if old not in kwargs:
                    continue
                value = kwargs.pop(old)
                if new in kwargs or new in sig.bind_partial(*args).arguments:
                    raise TypeError(f"{who}: got both {new}= and {old}=, its former name; "
                                    f"pass {new}= only")
                warnings.warn(f"{who}: {old}= is deprecated, it was renamed {new}= (same "
                              f"values); pass {new}= instead", DeprecationWarning,
                              stacklevel=2)
                kwargs[new] = value
            return fn(*args, **kwargs)
        return wrapper
    return decorate


def renamed_attribute(who: str, old: str, new: str) -> property:
    """A class attribute for the former name ``old`` of the attribute ``new``: reading and
    writing it reach ``new``, with a ``DeprecationWarning`` naming it (writing the old name
    would otherwise set an attribute nothing reads)."""
    def warn():
        warnings.warn(f"{who}.{old} is deprecated, it was renamed {new}; use {new}",
                      DeprecationWarning, stacklevel=3)

    def fget(self):
        warn()
        return getattr(self, new)

    def fset(self, value):
        warn()
        setattr(self, new, value)

    return property(fget, fset, doc=f"Deprecated: the former name of ``{new}``.")


def draw_dropout_seed(device) -> torch.Tensor:
    """A fresh int64 ``[2]`` (seed, offset) Philox state on ``device``, drawn with
    ``torch.randint`` from PyTorch's default generator of that device: ``torch.manual_seed``
    makes it reproducible, consecutive calls differ, and it is a device op (no host sync),
    which CUDA graph capture and ``torch.compile`` record like any other random op. For one
    seed the CPU kernel's keep-mask is the Triton kernels' (the same Philox counters)."""
    return torch.randint(0, 2 ** 62, (2,), dtype=torch.int64, device=device)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied only when its last dimension is not contiguous (what the kernels read in
    place); TorchScript compiles it too (the scripted drop-ins)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()
