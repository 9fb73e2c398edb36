"""``rel_attention``: the one contract. Argument checks and backend dispatch live here, once.

Data flows one way: modules -> ``rel_attention`` (checks, mask normalisation, backend choice)
-> ``reference.rel_attention_reference``, the fused Triton op (``txl_kernels.ops``) or the
fused CPU op (``txl_kernels.cpu_kernel``).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from ._arch import arch_info, capability_of, unsupported_reason
from ._utils import (FUSED_DTYPES, FUSED_MAX_HEADDIM, FUSED_MIN_HEADDIM, REF_DTYPES,
                     assume_constant_result, check_same, describe, interpreting,
                     no_interpreter_reason)
from .quant import QUANT_DTYPES, SCALE_DTYPES, QuantizedKV
from . import _op
from . import selfcheck
from ._export import check_jit_recordable, check_onnx_exportable, export_route, onnx_exporting
from ._onnx_lowering import onnx_rel_attention
from .reference import autocast_dtype, in_band, pair_distance, rel_attention_reference

__all__ = ["rel_attention", "fused_available", "mask_to_band", "BACKENDS"]

BACKENDS = ("auto", "reference", "triton", "cpu")
_INT64_MAX = 2 ** 63 - 1


# rel_attention's argument checks, shared with context_parallel_rel_attention (``who`` names
# the function in the message).
def check_tensor(name: str, t, ndim: int, layout: str, who: str = "rel_attention") -> None:
    """A floating tensor (float16 / bfloat16 / float32 / float64) with ``ndim`` dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a torch.Tensor of layout {layout}, "
                        f"got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{who}: {name} must be {ndim}-D {layout}, got {describe(t)}")
    if t.dtype not in REF_DTYPES:
        raise TypeError(f"{who}: {name} must be float16, bfloat16, float32 or float64, "
                        f"got {t.dtype}")


def check_softmax_scale(softmax_scale, head_dim, who: str = "rel_attention"):
    """``softmax_scale`` checked (a finite float; None -> ``head_dim ** -0.5``) and returned
    as a float.

    Under ``torch.compile`` it can be symbolic: a ``torch.SymFloat`` (a float argument or
    module attribute dynamo does not specialise, e.g. under ``dynamic=True`` or after a
    second call with another scale, or ``head_dim ** -0.5`` with a dynamic head dim) or a
    ``torch.SymInt``. It stays symbolic, and a symbolic float's finiteness is checked in the
    graph: a RuntimeError with this message when the compiled call runs (PyTorch has no
    traced check that raises ValueError without specialising the float to one value).
    """
    if softmax_scale is None:
        return head_dim ** -0.5  # finite: head_dim >= 1
    if isinstance(softmax_scale, bool) or not isinstance(
            softmax_scale, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"{who}: softmax_scale must be a float or None, "
                        f"got {type(softmax_scale).__name__}")
    if isinstance(softmax_scale, (int, torch.SymInt)):
        return torch.sym_float(softmax_scale)  # an int is finite
    if type(softmax_scale).__module__ == "numpy":
        softmax_scale = float(softmax_scale)  # numpy.float64: its comparisons give numpy.bool_
    # The comparisons trace (math.isfinite does not): NaN fails both, +-inf one. On a Python
    # float they give a bool; on a SymFloat a symbolic bool (neither True nor False).
    finite = (softmax_scale > -math.inf) & (softmax_scale < math.inf)
    if finite is False:
        raise ValueError(f"{who}: softmax_scale must be a finite float, "
                         f"got {softmax_scale!r}")
    if finite is True:
        return float(softmax_scale)
    # A guard on the symbolic bool would not hold for inf, and torch._check specialises the
    # float: the check is an op on a host scalar in float64 (as the float), raising when it
    # runs.
    torch._assert_async(torch.zeros((), dtype=torch.float64).add(softmax_scale).isfinite(),
                        f"{who}: softmax_scale must be a finite float, got NaN or +-inf")
    return softmax_scale


def check_dropout_p(dropout_p, who: str = "rel_attention") -> float:
    """``dropout_p`` as a float in [0, 1)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) \
            or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{who}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def check_deterministic(deterministic, who: str = "rel_attention") -> None:
    """``deterministic`` is a bool."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"{who}: deterministic must be a bool, "
                        f"got {type(deterministic).__name__}")


def _check_memory(memory, q: torch.Tensor) -> int:
    """Check an 8-bit ``memory`` against q ``[B, Lq, H, D]``; return its length M."""
    if not isinstance(memory, QuantizedKV):
        raise TypeError(f"rel_attention: memory must be a txl_kernels.quant.QuantizedKV "
                        f"(k, k_scale, v, v_scale), got {type(memory).__name__}")
    B, _, H, D = q.shape
    for name in ("k", "v"):
        data = getattr(memory, name)
        scale = getattr(memory, name + "_scale")
        if not isinstance(data, torch.Tensor) or data.dim() != 4:
            raise ValueError(f"rel_attention: memory.{name} must be a 4-D tensor [B, M, H, D], "
                             f"got {describe(data)}")
        if data.dtype not in QUANT_DTYPES:
            raise TypeError(f"rel_attention: memory.{name} must be torch.int8 or "
                            f"torch.float8_e4m3fn, got {describe(data)}")
        if data.dtype != memory.k.dtype or tuple(data.shape) != tuple(memory.k.shape):
            raise ValueError(f"rel_attention: memory.v must have memory.k's shape and dtype "
                             f"({describe(memory.k)}), got {describe(data)}")
        if data.shape[0] != B or data.shape[2:] != (H, D):
            raise ValueError(f"rel_attention: memory.{name} must be [B, M, H, D] = [{B}, M, {H}, "
                             f"{D}] to match q {list(q.shape)}, got {describe(data)}")
        if not isinstance(scale, torch.Tensor) or scale.dtype not in SCALE_DTYPES \
                or tuple(scale.shape) != tuple(data.shape[:3]):
            raise ValueError(f"rel_attention: memory.{name}_scale must be a float32 / float16 "
                             f"tensor [B, M, H] = {list(data.shape[:3])}, got {describe(scale)}")
        check_same("rel_attention", f"memory.{name}", data, "q", q, dtype=False)
        check_same("rel_attention", f"memory.{name}_scale", scale, "q", q, dtype=False)
    return memory.k.shape[1]


@assume_constant_result
def fused_available(device: torch.device) -> Tuple[bool, str]:
    """Whether the fused Triton path can run on ``device``, and why not if it cannot: CUDA
    devices of compute capability 8.0 (Ampere) and newer, CPU tensors under the Triton
    interpreter. A constant to ``torch.compile`` (run, not traced): what it reads (loaded
    modules, the environment) can change while dynamo traces, e.g. when the trace imports
    ``txl_kernels.ops``, and a restarted trace must take the same path."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - triton is a dependency
        return False, f"triton cannot be imported ({exc})"
    if device.type == "cuda":
        if interpreting():
            return False, "TRITON_INTERPRET=1 is set, which runs kernels on CPU tensors only"
        cap = capability_of(device)
        why = unsupported_reason(cap)
        if why is not None:
            return False, why
        return True, f"CUDA device sm_{cap} ({arch_info(cap).family} configs)"
    if device.type == "cpu":
        if interpreting():
            return True, "TRITON_INTERPRET=1 (Triton interpreter on CPU; slow, for testing)"
        return False, no_interpreter_reason()
    return False, f"no fused kernel for device type {device.type!r}"


def _check_bool_mask(name: str, t, layout: str, meaning: str, q: torch.Tensor,
                     who: str = "rel_attention") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a bool tensor {layout}, "
                        f"got {type(t).__name__}")
    if t.dtype != torch.bool:
        raise TypeError(f"{who}: {name} must have dtype torch.bool ({meaning}), "
                        f"got {t.dtype}")
    check_same(who, name, t, "q", q, dtype=False)


def check_padding_mask(key_padding_mask, q: torch.Tensor, Lk: int,
                            who: str = "rel_attention", layout: str = "[B, Lk]") -> None:
    """A bool ``[B, Lk]`` mask on q's device (``layout`` names the key dimension)."""
    B = q.shape[0]
    _check_bool_mask("key_padding_mask", key_padding_mask, layout, "True = padded key", q, who)
    if tuple(key_padding_mask.shape) != (B, Lk):
        raise ValueError(f"{who}: key_padding_mask must have shape {layout} = "
                         f"{[B, Lk]}, got {list(key_padding_mask.shape)}")


def check_window(causal, window_size, who: str = "rel_attention") -> Tuple[int, int]:
    """Check ``causal`` and ``window_size``; return (window_left, window_right) with causal
    folded into window_right = 0, not yet clamped to the shapes (:func:`clamp_window`)."""
    if type(causal).__module__ == "numpy" and type(causal).__name__ in ("bool", "bool_"):
        causal = bool(causal)  # numpy.bool_ (numpy.bool in numpy 2)
    if not isinstance(causal, bool):
        kind = type(causal)
        raise TypeError(f"{who}: causal must be a bool (or numpy.bool_), got "
                        f"{kind.__module__}.{kind.__qualname__} {causal!r:.40}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"{who}: window_size must be a (left, right) pair of ints, "
                        f"got {window_size!r}")
    wl, wr = int(window_size[0]), int(window_size[1])
    if wl < -1 or wr < -1:
        raise ValueError(f"{who}: window_size entries must be >= -1 (-1 = unbounded), "
                         f"got {tuple(window_size)}")
    if max(wl, wr) > _INT64_MAX:
        raise ValueError(f"{who}: window_size entries must fit in int64 (<= 2**63 - 1; "
                         f"-1 = unbounded), got {tuple(window_size)}")
    if causal:
        wr = 0
    return wl, wr


def clamp_window(wl: int, wr: int, Lq: int, Lk: int) -> Tuple[int, int]:
    """Clamp the window to the distances the shapes hold (d in [-(Lq - 1), Lk - 1]): same
    pairs, and neither the kernels' int32 index arithmetic nor the reference's int64 tensors
    can overflow. While an export route records the call (``_export.export_route``: the
    window then becomes a constant of a graph that runs at other lengths) the bound is
    :data:`EXPORT_MAX_LEN` instead of the shapes: the same pairs at every length up to it."""
    if export_route() is not None:
        Lq = Lk = EXPORT_MAX_LEN + 1
    if wl >= 0:
        wl = min(wl, Lk - 1)
    if wr >= 0:
        wr = min(wr, Lq - 1)
    return wl, wr


# The longest sequence a graph recorded by an export route serves with the window it recorded
# (clamp_window); 2**30 keeps the kernels' int32 index sums (a position plus a window side)
# from overflowing.
EXPORT_MAX_LEN = 2 ** 30


def _normalize_masks(q, Lk, causal, window_size, key_padding_mask, attn_mask):
    """Check the masks and turn them into (window_left, window_right, kpm, attn_mask).

    causal is folded into window_right = 0. attn_mask comes back as a bool view expanded to
    [B, H, Lq, Lk] (broadcast dimensions have stride 0; nothing is copied).
    """
    B, Lq, H, _ = q.shape
    wl, wr = clamp_window(*check_window(causal, window_size), Lq, Lk)
    if key_padding_mask is not None:
        check_padding_mask(key_padding_mask, q, Lk)
    if attn_mask is not None:
        _check_bool_mask("attn_mask", attn_mask, "broadcastable to [B, H, Lq, Lk]",
                         "True = masked", q)
        target = (B, H, Lq, Lk)
        shape = tuple(attn_mask.shape)
        ok = attn_mask.dim() <= 4 and all(
            s in (1, t) for s, t in zip(shape[::-1], target[::-1]))
        if not ok:
            raise ValueError(f"rel_attention: attn_mask must be broadcastable to [B, H, Lq, Lk] "
                             f"= {list(target)}, got {list(shape)}")
        attn_mask = attn_mask.expand(target)
    return wl, wr, key_padding_mask, attn_mask


def mask_to_band(attn_mask: torch.Tensor) -> torch.Tensor:
    """Describe a bool mask (True = masked, broadcastable to ``[B, H, Lq, Lk]``, last two
    dims ``[Lq, Lk]``) as a band, on its device and without a host sync.

    Returns an int32 tensor ``[is_band, left, right]`` on the mask's device. ``is_band`` is 1
    when the mask allows exactly the pairs with ``-right <= d <= left`` (``d = (i + Lk - Lq) -
    j``) for every batch and head, else 0. ``left`` and ``right`` are plain bounds, never
    sentinels: either may be negative (a band that leaves out the diagonal, e.g. ``right =
    -1`` when every allowed pair has ``d >= 1``), and they are clamped to what the shapes
    hold (``-Lq <= left <= Lk - 1``, ``-Lk <= right <= Lq - 1``), so a side without a bound
    reads ``Lk - 1`` / ``Lq - 1``. A mask that allows nothing (or has no elements) is the band
    ``[1, -Lq, -Lk]``, which allows no pair.

    Pass it as ``rel_attention(..., attn_mask=mask, attn_mask_band=mask_to_band(mask))``:
    when it is a band that contains the diagonal side it bounds (``left >= 0`` and ``right >=
    0``, e.g. every causal / same_length / sliding-window mask), the fused kernel reads no
    mask and skips the tiles outside the band; otherwise it reads the mask densely, decided on
    the device. The result is the same either way. Transformer-XL's causal mask ``triu(ones(
    Lq, Lk), 1 + mlen)`` gives ``[1, Lk - 1, 0]``, its same_length mask ``[1, mem_len - 1,
    0]``.
    """
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
        got = attn_mask.dtype if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
        raise TypeError(f"mask_to_band: attn_mask must be a bool tensor (True = masked), "
                        f"got {got}")
    if attn_mask.dim() < 2:
        raise ValueError(f"mask_to_band: attn_mask must have at least 2 dims [..., Lq, Lk], "
                         f"got {list(attn_mask.shape)}")
    lq, lk = attn_mask.shape[-2:]
    if attn_mask.numel() == 0:  # no pair at all: the band that allows nothing
        return torch.tensor([1, -lq, -lk], dtype=torch.int32, device=attn_mask.device)
    d = pair_distance(lq, lk, attn_mask.device)
    allowed = ~attn_mask
    big = lk + lq
    # max() / min() over all dims (aten.max.default): the dynamo=True ONNX exporter has no
    # translation of amax / amin without dims
    d_max = torch.where(allowed, d, -big).max()   # -big when nothing is allowed
    d_min = torch.where(allowed, d, big).min()    # +big when nothing is allowed
    left = d_max.clamp(-lq, lk - 1)
    right = (-d_min).clamp(-lk, lq - 1)
    is_band = (allowed == in_band(d, left, right)).all()
    return torch.stack([is_band.to(torch.int32), left.to(torch.int32), right.to(torch.int32)])


def _self_checked(variant: "selfcheck.Variant", backend: str) -> bool:
    """The first-use self-check's verdict on ``variant`` (``selfcheck``): True to take the
    fused path; False (backend "auto") to take the reference path after a failed check;
    raises for backend "triton" after a failed check."""
    key = tuple(variant)  # a plain tuple: what torch.compile passes to a constant function
    if selfcheck.fused_ok(key):
        return True
    if backend == "triton":
        raise RuntimeError(selfcheck.failure(key))
    return False


def _records_grad(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a call on ``tensors`` records gradients (grad mode on, one of them requires
    grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class Plan(NamedTuple):
    """A call's decisions, made once (:func:`plan_call`) from its validated, normalised
    arguments: ``kernel``, what runs ("triton", "cpu" or "reference"), and ``variant``, the
    ``selfcheck.Variant`` of the call (what selects the Triton kernels' compiled code; the
    self-check's key, as the launchers' constexpr flags are derived from it), made where the
    kernel is Triton (None otherwise: nothing is compiled per variant)."""
    kernel: str
    variant: Optional["selfcheck.Variant"]


def plan_call(backend: str, tensors: Sequence[torch.Tensor], window_left: int,
              window_right: int, key_padding_mask, attn_mask, attn_mask_band,
              dropout_p: float, memory, deterministic: bool, r_first_distance: Optional[int],
              who: str = "rel_attention", *, kernel_dropout: bool = True,
              self_check: bool = True) -> Plan:
    """The plan of a call on ``tensors`` (q, k, v, r and the biases) with ``backend`` and
    these normalised arguments, for ``rel_attention`` (and so the K/V cache's segments) and
    the context-parallel ring: the kernel is :func:`choose_backend`'s policy, except that an 8-bit
    memory with gradients recorded takes the reference ("auto"; another backend raises: the
    kernels read the memory forward only), and that dropout takes the reference where the
    caller's kernels cannot draw its keep-mask (``kernel_dropout=False``, the ring: its
    mask is a function of global positions); a Triton kernel whose variant failed its
    first-use self-check (``self_check``) takes the reference ("auto") or raises."""
    q = tensors[0]
    memory_grads = memory is not None and _records_grad(tensors)
    if not kernel_dropout and dropout_p > 0.0:
        if backend in ("triton", "cpu"):
            raise ValueError(f"{who}: dropout_p > 0 runs the ring on the einsum block math (the "
                             f"one-process keep-mask is a function of global positions, the "
                             f"kernels draw theirs in their block's); use backend='auto' or "
                             f"'reference', got backend={backend!r}")
        if backend not in BACKENDS:
            raise ValueError(f"{who}: backend must be one of {BACKENDS}, got {backend!r}")
        return Plan("reference", None)
    if memory_grads and backend == "auto":
        kernel = "reference"  # the kernels read an 8-bit memory forward only
    else:
        kernel = choose_backend(backend, q, who)
    if memory_grads and kernel != "reference":
        raise ValueError(f"{who}: backend={backend!r} with an 8-bit memory is forward "
                         f"only (inference); inputs require grad: use backend='reference' "
                         f"or torch.no_grad()")
    if kernel != "triton":
        return Plan(kernel, None)
    grads = memory_grads if memory is not None else _records_grad(tensors)
    variant = selfcheck.variant_of(q, window_left, window_right, key_padding_mask, attn_mask,
                                   attn_mask_band, dropout_p, memory, grads, deterministic,
                                   r_first_distance)
    if self_check and selfcheck.enabled() and not _self_checked(variant, backend):
        return Plan("reference", variant)
    return Plan(kernel, variant)


def check_r_first_distance(r_first_distance, who: str = "rel_attention") -> Optional[int]:
    """``r_first_distance`` is None or an int (not a bool); returned as a Python int."""
    if r_first_distance is None:
        return None
    if isinstance(r_first_distance, bool) or not isinstance(r_first_distance, int):
        raise TypeError(f"{who}: r_first_distance must be an int (the distance d held by r's "
                        f"row 0) or None, got {type(r_first_distance).__name__} "
                        f"{r_first_distance!r:.40}")
    return int(r_first_distance)


def clamp_first_distance(lq: int, lk: int, rlen: int, r_first_distance: int) -> int:
    """``r_first_distance`` clamped to ``[-Lq, R + Lk - 1]``: past those bounds every pair's
    row (``r_first_distance - d``, ``d`` in ``[-(Lq - 1), Lk - 1]``) is outside ``[0, R)``
    either way, so all read as zero; the clamp keeps the kernels' int32 row arithmetic and the
    reference's pad widths in range."""
    return min(max(r_first_distance, -lq), rlen + lk - 1)


def allowed_distances(lq: int, lk: int, wl: int, wr: int) -> Tuple[int, int]:
    """``(d_min, d_max)``: the distances ``d = (i + Lk - Lq) - j`` of the pairs a window
    ``(wl, wr)`` allows (``-1`` = unbounded side). Over all pairs ``d`` spans
    ``[-(Lq - 1), Lk - 1]``; the window clips it (``d_min > d_max``: no pair allowed)."""
    d_min, d_max = -(lq - 1), lk - 1
    if wr >= 0:
        d_min = max(d_min, -wr)
    if wl >= 0:
        d_max = min(d_max, wl)
    return d_min, d_max


def check_position_rows(lq: int, lk: int, rlen: int, wl: int, wr: int,
                        r_first_distance: Optional[int] = None) -> None:
    """Raise if an allowed pair (by causal / window structure) needs an r row outside [0, R).
    Row 0 of r holds distance ``r_first_distance`` (None: ``Lk - 1``)."""
    # row p = first - d (= j - i + Lq - 1 for first = Lk - 1)
    first = lk - 1 if r_first_distance is None else r_first_distance
    d_min, d_max = allowed_distances(lq, lk, wl, wr)
    if d_min > d_max:
        return  # no pair is allowed at all
    p_lo, p_hi = first - d_max, first - d_min
    # With the default table d_max <= lk - 1, so p_lo >= 0 and only p_hi is tested: testing
    # p_lo too would, on symbolic lengths under torch.export, add a guard such as
    # lk - 1 - min(wl, lk - 1) >= 0 that the solver cannot prove.
    if (r_first_distance is not None and p_lo < 0) or p_hi >= rlen:
        if r_first_distance is None:
            raise ValueError(
                f"rel_attention: r has {rlen} rows, but the allowed pairs (Lq={lq}, Lk={lk}, "
                f"window_left={wl}, window_right={wr}) need rows {p_lo}..{p_hi} "
                f"(row p = j - i + Lq - 1); pass r with at least {p_hi + 1} rows, or restrict "
                f"the pairs with causal / window_size")
        raise ValueError(
            f"rel_attention: r has {rlen} rows and r_first_distance={r_first_distance} (row p "
            f"holds distance {r_first_distance} - p), but the allowed pairs (Lq={lq}, Lk={lk}, "
            f"window_left={wl}, window_right={wr}) have distances {d_min}..{d_max} and need "
            f"rows {p_lo}..{p_hi}; pass r rows for distances {d_max} down to {d_min} with "
            f"r_first_distance={d_max}, or restrict the pairs with causal / window_size")


def rel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: torch.Tensor,
    r_w_bias: torch.Tensor,
    r_r_bias: torch.Tensor,
    *,
    causal: bool = True,
    window_size: Tuple[int, int] = (-1, -1),
    key_padding_mask: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    attn_mask_band: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    deterministic: bool = False,
    memory: Optional[QuantizedKV] = None,
    r_first_distance: Optional[int] = None,
    extra_k: Optional[torch.Tensor] = None,
    extra_v: Optional[torch.Tensor] = None,
    extra_q: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Transformer-XL relative multi-head attention.

    ``S[i, j] = softmax_scale * ((q_i + r_w_bias) . k_j + (q_i + r_r_bias) . r[j - i + c])``
    with ``c = Lq - 1`` (default) or ``c = r_first_distance - Lk + Lq``
    ``out_i = sum_j softmax_j(S[i, :] over allowed j) * v_j``

    Arguments:
        q: ``[B, Lq, H, D]`` queries (batch-first). Seq-first ``[Lq, B, H, D]`` tensors pass as
            ``q.transpose(0, 1)`` views: any strides are accepted, and tensors whose last
            dimension is contiguous (``stride(-1) == 1``) reach the fused kernel without a copy.
        k, v: ``[B, Lk, H, D]`` with ``Lk >= Lq``. The first ``mlen = Lk - Lq`` keys are the
            cached memory, the last ``Lq`` keys the current segment.
        r: ``[R, H, D]`` projected relative position table (``r_net(pos_emb)``); row ``p``
            serves query ``i`` and key ``j`` at ``p = j - i + Lq - 1``. In the Transformer-XL
            ordering (``pos_seq = arange(Lk - 1, -1, -1)``) row ``p`` holds distance
            ``Lk - 1 - p``; ``R = Lk`` suffices for causal attention, ``R = Lk + Lq - 1`` for
            full (non-causal) attention, e.g. ``2T - 1`` for a Conformer.
        r_w_bias, r_r_bias: ``[H, D]`` content (u) and position (v) biases.
        causal: allow a pair only if ``d >= 0``, with ``d = (i + Lk - Lq) - j`` (bottom-right
            aligned: the last query sees every key). Default True.
        window_size: ``(left, right)``: allow a pair only if ``d <= left`` and ``-d <= right``;
            -1 means unbounded (flash-attention's convention). Transformer-XL's same_length
            mask is ``window_size=(mem_len - 1, 0)``.
        key_padding_mask: optional bool ``[B, Lk]``, True = padded key (never attended).
        attn_mask: optional bool tensor broadcastable to ``[B, H, Lq, Lk]``, True = masked
            (Transformer-XL's polarity). Combined with the masks above.
        attn_mask_band: optional int32 ``[3]`` tensor from :func:`mask_to_band` (attn_mask),
            on q's device. Decided on the device, without a host sync: when it says the mask
            is a band, the fused kernel reads no mask and skips the tiles outside the band;
            otherwise it reads attn_mask densely. The result is the same either way.
            attn_mask's last two dims must then be ``[Lq, Lk]`` (not broadcast). Rows of r
            that only pairs outside causal / window_size could need are then not checked on
            the host: rows outside ``[0, R)`` count as zero (the band, when it is one, excludes
            them).
        softmax_scale: defaults to ``D ** -0.5``. Any finite float, on every backend: 0
            gives uniform weights over the allowed keys, a negative scale favours the
            lowest scores (the fused kernels get ``|scale|`` with q and both biases negated,
            which gives the same scores). NaN / inf raise ValueError. Under
            ``torch.compile`` it may be symbolic (``dynamic=True``, or another scale at a
            second call): the reference keeps one graph for all scales, the fused ops
            specialise it (one graph per scale); a symbolic inf raises RuntimeError from a
            check in the graph (docs/api.md).
        dropout_p: dropout on the attention probabilities, after the softmax normaliser (kept
            ones scaled by ``1 / (1 - p)``), on both backends. Pass 0.0 at evaluation. The
            fused kernels drop with p rounded to a multiple of 2^-23 (``dropout_rate(p)`` in
            ``ops.rel_attn_fwd``: within 2^-24 of p, never 0 for p > 0, so every p in (0, 1)
            drops) and scale the kept ones by 1 / (1 - that rate), so the expected output is
            the undropped one for every p. They draw their keep-mask from a counter-based RNG
            (Philox) keyed by a (seed, offset) pair that one ``torch.randint`` draws, on q's
            device, from PyTorch's default generator (the CUDA generator of that device; the
            CPU one under the interpreter): ``torch.manual_seed`` makes a call reproducible,
            consecutive calls differ, CUDA graph capture records it like any random op. The
            backward regenerates the same mask (nothing Lq x Lk is stored). The reference
            backend uses ``F.dropout`` (a different mask for the same seed).
        backend: ``"reference"`` (einsum path, any device), ``"triton"`` (fused kernel; CUDA
            tensors, or CPU tensors under ``TRITON_INTERPRET=1``), ``"cpu"`` (the fused C++
            kernel for CPU tensors, docs/cpu.md: any dtype and head dim, deterministic; built
            with the extension on first use) or ``"auto"`` (the Triton kernel where it can
            run; else, on CPU tensors, the C++ kernel, or the reference with a one-time
            warning when the extension cannot be built; else the reference). While
            ``torch.onnx.export`` traces (either exporter), every backend runs the reference's
            math in its ONNX form (``_onnx_lowering.onnx_rel_attention``); dropout, an 8-bit
            memory and context parallelism then raise ``ExportUnsupported``.
        deterministic: fused backward only. False (default, as in FlashAttention): the
            gradient of r (and, for fp16 / bf16 on sm_80 .. sm_90, of q) is accumulated with
            fp32 atomics in whatever order they arrive (run-to-run bit differences). True:
            two backward passes give bitwise-equal gradients; for fp16 / bf16 on sm_80 ..
            sm_90 the same atomics are taken in a fixed order (each key tile's program
            waits for the next one's, as FlashAttention-3's deterministic mode does;
            about the atomic backward's time in the static sm_90 model, which does not
            charge the waits), elsewhere a separate pass reduces them in a fixed order
            (about 1.3x the atomic backward's time in the model).
        memory: optional 8-bit memory, a :class:`txl_kernels.quant.QuantizedKV` (int8 or
            float8_e4m3fn keys / values ``[B, M, H, D]`` with one scale per (token, head),
            ``[B, M, H]``). The keys and values are then the memory's ``M`` rows followed by
            ``k`` / ``v`` (the current segment, ``[B, Lc, H, D]`` in the compute dtype), so
            ``Lk = M + Lc`` in everything above (masks, r rows, windows). The fused kernels
            read the 8-bit tiles and dequantise them in registers (no full-precision copy);
            the reference dequantises first (``(data.float() * scale) -> q's dtype``).
            Forward only on the fused backend: gradients (of q, k, v, r, the biases; the
            memory has none) need ``backend="reference"``, which ``"auto"`` picks when they
            are recorded.
        r_first_distance: the distance ``d`` held by r's row 0 (an int, any sign), so that row
            ``p`` holds distance ``r_first_distance - p`` and a pair reads row
            ``p = r_first_distance - d = j - i + c`` with ``c = r_first_distance - Lk + Lq``.
            None (default) is ``Lk - 1``, the Transformer-XL table above. With
            ``window_size=(left, right)`` a table of ``left + right + 1`` rows for distances
            ``left`` down to ``-right`` with ``r_first_distance=left`` serves every allowed
            pair (NeMo's local-attention position table), so a windowed call needs no table
            as long as the sequence, and the fused kernels read only that short table.
            Every backend, forward and backward (the gradient of r has its R rows), and
            with ``memory`` (``Lk = M + Lc`` above).
        extra_k, extra_v: optional ``[B, G, H, D]`` extra keys and values that every query
            attends besides ``k`` / ``v`` (e.g. Longformer's global tokens), in the same softmax:
            query ``i`` scores extra key ``g`` ``softmax_scale * extra_q_i . extra_k_g``, a plain
            dot product (no bias, no position term, no mask; a key that is also in ``k`` counts
            twice). O(Lq x G) more work and memory. The fused kernels compute the relative part
            and its row log-sum-exp, the extra part is merged in torch, and the backward is the
            kernels' own given the merged output and log-sum-exp. With ``dropout_p > 0`` the
            fused path drops the extra part with a ``torch.rand`` mask of its own (drawn after
            the kernels' seed). Not with ``memory``.
        extra_q: ``[B, Lq, H, D]``, the queries that score the extra keys (default ``q``).
        out: optional ``[B, Lq, H, D]`` tensor of the result's dtype on q's device that
            receives the result, which is then returned (inference only: no gradient may be
            recorded). It may be ``q`` itself: the CPU kernel reads each query block's rows
            before it writes them, so a contiguous ``q`` that is no longer needed takes the
            result in place (no new ``[B, Lq, H, D]`` buffer, none of its page faults);
            other backends compute the result and copy it into ``out``.

    Rows whose keys are all masked give output 0 and zero gradients.
    Raises ValueError if an allowed pair needs a row of r outside ``[0, R)`` (the message
    names the rows needed); rows outside ``[0, R)`` that no allowed pair reads count as zero.

    Under ``torch.autocast`` (as for ``scaled_dot_product_attention``) the float16 / bfloat16 /
    float32 inputs are cast to the autocast dtype first, on both backends; the scores are
    still accumulated in fp32 and the result is in the autocast dtype.

    Returns:
        ``[B, Lq, H, D]`` in q's dtype (the autocast dtype under autocast), differentiable
        w.r.t. q, k, v, r, r_w_bias, r_r_bias.
    """
    check_tensor("q", q, 4, "[B, Lq, H, D]")
    check_tensor("k", k, 4, "[B, Lk, H, D]")
    check_tensor("v", v, 4, "[B, Lk, H, D]")
    check_tensor("r", r, 3, "[R, H, D]")
    check_tensor("r_w_bias", r_w_bias, 2, "[H, D]")
    check_tensor("r_r_bias", r_r_bias, 2, "[H, D]")
    amp = autocast_dtype(q.device.type)
    if amp is not None:
        # As autocast does for matmul-like ops (and SDPA): floating inputs other than fp64 run
        # in the autocast dtype, on both backends, so the result is in that dtype.
        q, k, v, r, r_w_bias, r_r_bias = (t.to(amp) if t.dtype in FUSED_DTYPES else t
                                          for t in (q, k, v, r, r_w_bias, r_r_bias))
    extra = _check_extra_keys(q, extra_q, extra_k, extra_v, memory, amp)
    Lq, D = q.shape[1], q.shape[3]
    Lk = _validate_shapes(q, k, v, r, r_w_bias, r_r_bias, memory)
    softmax_scale = check_softmax_scale(softmax_scale, D)
    check_dropout_p(dropout_p)
    check_deterministic(deterministic)
    if backend not in BACKENDS:
        raise ValueError(f"rel_attention: backend must be one of {BACKENDS}, got {backend!r}")
    r_first_distance = check_r_first_distance(r_first_distance)

    wl, wr, kpm, mask = _normalize_masks(q, Lk, causal, window_size, key_padding_mask, attn_mask)
    if attn_mask_band is not None:
        _validate_band(attn_mask_band, attn_mask, mask, q, Lk)
    else:
        check_position_rows(Lq, Lk, r.shape[0], wl, wr, r_first_distance)
    if r_first_distance is not None:
        r_first_distance = clamp_first_distance(Lq, Lk, r.shape[0], r_first_distance)
    if out is None:
        return _dispatch(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, wl, wr, kpm, mask,
                         attn_mask, attn_mask_band, dropout_p, backend, deterministic, memory,
                         r_first_distance, extra)
    inputs = (q, k, v, r, r_w_bias, r_r_bias) + (() if extra is None else tuple(extra))
    _check_out(out, q, inputs)
    res = _dispatch(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, wl, wr, kpm, mask,
                    attn_mask, attn_mask_band, dropout_p, backend, deterministic, memory,
                    r_first_distance, extra, out=_in_place_out(out, q, inputs))
    if res is not out:
        out.copy_(res)
    return out


def _validate_shapes(q, k, v, r, r_w_bias, r_r_bias, memory) -> int:
    """rel_attention's tensors checked against q's ``[B, Lq, H, D]`` (one dtype and device,
    no empty dimension, ``Lk >= Lq``); returns ``Lk`` (memory rows included)."""
    B, Lq, H, D = q.shape
    mlen = 0 if memory is None else _check_memory(memory, q)
    Lk = mlen + k.shape[1]
    for name, t in (("k", k), ("v", v), ("r", r), ("r_w_bias", r_w_bias),
                    ("r_r_bias", r_r_bias)):
        check_same("rel_attention", name, t, "q", q)  # one dtype, one device for all inputs
    if Lq < 1 or k.shape[1] < 1 or B < 1 or H < 1 or D < 1:
        raise ValueError(f"rel_attention: empty dimension in q {list(q.shape)} / "
                         f"k {list(k.shape)}")
    if k.shape[0] != B or k.shape[2:] != (H, D):
        raise ValueError(f"rel_attention: k must be [B, Lk, H, D] = [{B}, Lk, {H}, {D}] to "
                         f"match q {list(q.shape)}, got {list(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"rel_attention: v must have k's shape {list(k.shape)}, "
                         f"got {list(v.shape)}")
    if Lk < Lq:
        raise ValueError(f"rel_attention: need Lk >= Lq (keys = memory + current segment), "
                         f"got Lq={Lq} (q {list(q.shape)}) and Lk={Lk} (k {list(k.shape)})")
    if r.shape[1:] != (H, D) or r.shape[0] < 1:
        raise ValueError(f"rel_attention: r must be [R, H, D] = [R, {H}, {D}] with R >= 1, "
                         f"got {list(r.shape)}")
    for name, t in (("r_w_bias", r_w_bias), ("r_r_bias", r_r_bias)):
        if tuple(t.shape) != (H, D):
            raise ValueError(f"rel_attention: {name} must be [H, D] = [{H}, {D}], "
                             f"got {list(t.shape)}")
    return Lk


def _validate_band(attn_mask_band, attn_mask, mask, q, Lk: int) -> None:
    """rel_attention's ``attn_mask_band``: the int32 ``[3]`` of ``mask_to_band(attn_mask)`` on
    q's device, with an ``attn_mask`` whose last two dims are ``[Lq, Lk]``."""
    Lq = q.shape[1]
    if mask is None:
        raise ValueError("rel_attention: attn_mask_band needs attn_mask")
    if not isinstance(attn_mask_band, torch.Tensor) or attn_mask_band.dtype != torch.int32 \
            or tuple(attn_mask_band.shape) != (3,):
        raise TypeError(f"rel_attention: attn_mask_band must be the int32 [3] tensor of "
                        f"mask_to_band(attn_mask), got {attn_mask_band!r:.80}")
    check_same("rel_attention", "attn_mask_band", attn_mask_band, "q", q, dtype=False)
    # mask_to_band reads the mask's last two dims as [Lq, Lk]: a mask broadcast over the
    # queries or keys would give the band of other distances (a different result).
    if attn_mask.dim() < 2 or tuple(attn_mask.shape[-2:]) != (Lq, Lk):
        raise ValueError(f"rel_attention: attn_mask_band needs an attn_mask whose last two "
                         f"dims are [Lq, Lk] = {[Lq, Lk]} (mask_to_band reads them as "
                         f"query and key positions), got attn_mask "
                         f"{list(attn_mask.shape)}; pass that mask without attn_mask_band")


def _check_out(out, q: torch.Tensor, inputs) -> None:
    """rel_attention's ``out``: a tensor of q's shape, dtype and device, and no graph."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"rel_attention: out must be a tensor [B, Lq, H, D] or None, got "
                        f"{type(out).__name__}")
    if onnx_exporting():
        raise ValueError("rel_attention: out is not supported in an ONNX export (the graph "
                         "returns the result); leave out=None")
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"rel_attention: out must be {q.dtype} {list(q.shape)} on {q.device} "
                         f"(q's shape, the result's dtype, q's device), got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    if torch.is_grad_enabled() and (out.requires_grad
                                    or any(t.requires_grad for t in inputs)):
        raise ValueError("rel_attention: out is for inference (the result is written without "
                         "a graph): inputs or out require grad; call it under torch.no_grad() "
                         "/ torch.inference_mode(), or leave out=None")


def _in_place_out(out: torch.Tensor, q: torch.Tensor, inputs) -> Optional[torch.Tensor]:
    """``out`` where the CPU kernel may write it directly: contiguous, and either q itself
    (the same view) or sharing no memory with any input; else None (copied into), also
    while torch.compile / torch.export trace (no storage to compare)."""
    if not out.is_contiguous() or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None
    mem = out.untyped_storage().data_ptr()
    for i, t in enumerate(inputs):
        if t.untyped_storage().data_ptr() != mem:
            continue
        # only q (inputs[0]) or extra_q (inputs[6], read before the kernel runs) may be out
        same_view = (t.data_ptr() == out.data_ptr() and t.stride() == out.stride()
                     and t.shape == out.shape)
        if i not in (0, 6) or not same_view:
            return None
    return out


def _dispatch(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, wl, wr, kpm, mask, attn_mask,
              attn_mask_band, dropout_p, backend, deterministic, memory, r_first_distance,
              extra, out=None):
    """rel_attention's route on its validated, normalised arguments (``out``: where the CPU
    kernel may write the result, see :func:`_in_place_out`; other routes ignore it)."""
    if onnx_exporting():
        # torch.onnx.export (either exporter) traces the reference's math in its ONNX form:
        # the lowering of every backend (txl_kernels/_export.py). The window is clamped to
        # EXPORT_MAX_LEN, not to the traced lengths (clamp_window), so the graph allows the
        # same pairs at every length. attn_mask_band only lets the fused kernels skip reading
        # the mask (same result): the graph reads attn_mask, as given (checked above;
        # broadcast where it is used, so no [B, H, Lq, Lk] copy of a mask shared by the heads).
        check_onnx_exportable(dropout_p, memory)
        if extra is not None:  # the extra keys' columns: the reference's form
            return _reference(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, wl, wr, kpm, mask,
                              None, 0.0, None, r_first_distance, extra)
        return onnx_rel_attention(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, wl, wr, kpm,
                                  attn_mask, None, r_first_distance)

    chosen = plan_call(backend, (q, k, v, r, r_w_bias, r_r_bias), wl, wr, kpm, mask,
                       attn_mask_band, dropout_p, memory, deterministic, r_first_distance).kernel
    if chosen == "reference":
        return _reference(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, wl, wr, kpm, mask,
                          attn_mask_band, float(dropout_p), memory, r_first_distance, extra)
    check_jit_recordable("rel_attention", dropout_p)
    if chosen == "triton" and softmax_scale <= 0.0:
        sign, softmax_scale = scale_sign(softmax_scale)
        if extra is not None:  # its scores are linear in extra_q
            extra = (extra[0] * sign,) + extra[1:]
        q, r_w_bias, r_r_bias = (t * sign for t in (q, r_w_bias, r_r_bias))
    out = out if chosen == "cpu" else None  # only the CPU kernel writes into out
    if extra is not None:
        from ._extra_keys import rel_attention_extra_keys

        merge_in_place = out is not None and q.dtype in (torch.float32, torch.float64)
        return rel_attention_extra_keys(chosen, q, k, v, r, r_w_bias, r_r_bias, extra,
                                        softmax_scale, wl, wr, kpm, mask, attn_mask_band,
                                        r_first_distance, float(dropout_p), deterministic,
                                        out=out if merge_in_place else None)
    return _op.rel_attn_func(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, wl, wr, kpm, mask,
                             attn_mask_band, deterministic, float(dropout_p), memory=memory,
                             r_first_distance=r_first_distance, out=out,
                             interpreter=chosen == "triton" and q.device.type == "cpu")


def scale_sign(softmax_scale: float) -> Tuple[float, float]:
    """``(sign, |softmax_scale|)`` for the Triton forward, whose online softmax scales the
    running maximum of the raw scores and so needs a softmax scale > 0: the scores are linear
    in (q, r_w_bias, r_r_bias), so ``softmax_scale * S(q, u, vb) = |softmax_scale| * S(sign q,
    sign u, sign vb)`` (and ``0 * S = 1 * S(0, 0, 0)``); the caller multiplies those three
    inputs by ``sign`` (autograd carries it to their gradients)."""
    if softmax_scale > 0.0:
        return 1.0, softmax_scale
    if softmax_scale < 0.0:
        return -1.0, -softmax_scale
    return 0.0, 1.0


def choose_backend(backend: str, q: torch.Tensor, who: str = "rel_attention") -> str:
    """The kernel a call with ``backend`` runs for q's device, dtype and head dim
    (:func:`choose_backend_for` on them)."""
    return choose_backend_for(backend, q.device, q.dtype, q.shape[-1], who)


def choose_backend_for(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                       who: str = "rel_attention") -> str:
    """The kernel a call with ``backend`` runs for queries on ``device`` of ``dtype`` and
    ``head_dim``: one policy for ``rel_attention``, the context-parallel ring and the K/V
    cache's routes (``cached_attention_route``). ``"triton"``: the fused Triton
    kernels where they run (CUDA sm_80 and newer, CPU tensors under ``TRITON_INTERPRET=1``;
    float16 / bfloat16 / float32, head dims 16..256), else raises; ``"cpu"``: the C++ CPU
    kernel on CPU tensors (any dtype and head dim), else raises; ``"reference"``. ``"auto"``:
    ``"triton"`` where the fused kernels run on the device (the reference for a dtype or head
    dim they do not take), else ``"cpu"`` on CPU tensors once the extension loads (the
    reference after its one-time warning where it cannot be built), else the reference."""
    if backend not in BACKENDS:
        raise ValueError(f"{who}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return "reference"
    if backend == "cpu" or (backend == "auto" and device.type == "cpu"
                            and not fused_available(device)[0]):
        from ._cpp_ops import warn_fallback
        from .cpu_kernel import cpu_kernel_available

        if backend == "cpu" and device.type != "cpu":
            raise ValueError(f"{who}: backend='cpu' needs CPU tensors, got q on {device}")
        ok, why = cpu_kernel_available()
        if ok:
            return "cpu"
        if backend == "cpu":
            raise RuntimeError(f"{who}: backend='cpu' cannot run here: {why}")
        warn_fallback("cpu", why)
        return "reference"
    ok, why = fused_available(device)
    D = head_dim
    shape_ok = dtype in FUSED_DTYPES and FUSED_MIN_HEADDIM <= D <= FUSED_MAX_HEADDIM
    if backend == "triton":
        if not ok:
            raise RuntimeError(f"{who}: backend='triton' cannot run here: {why}")
        if not shape_ok:
            raise ValueError(
                f"{who}: backend='triton' supports dtypes float16, bfloat16, float32 and head "
                f"dims {FUSED_MIN_HEADDIM}..{FUSED_MAX_HEADDIM}; got dtype {dtype}, D={D}")
    return "triton" if ok and shape_ok else "reference"


def _check_extra_keys(q, extra_q, extra_k, extra_v, memory, amp):
    """``rel_attention``'s extra keys checked (and cast to the autocast dtype ``amp``):
    None, or the tuple ``(extra_q, extra_k, extra_v)`` with ``extra_q`` defaulting to ``q``."""
    if extra_k is None and extra_v is None:
        if extra_q is not None:
            raise ValueError("rel_attention: extra_q scores the extra keys: pass it with "
                             "extra_k and extra_v")
        return None
    if extra_k is None or extra_v is None:
        raise ValueError(f"rel_attention: extra_k and extra_v must be given together, got "
                         f"extra_k={describe(extra_k)}, extra_v={describe(extra_v)}")
    if memory is not None:
        raise ValueError("rel_attention: extra_k / extra_v are not supported with memory")
    extra_q = q if extra_q is None else extra_q
    check_tensor("extra_k", extra_k, 4, "[B, G, H, D]")
    check_tensor("extra_v", extra_v, 4, "[B, G, H, D]")
    check_tensor("extra_q", extra_q, 4, "[B, Lq, H, D]")
    if amp is not None:
        extra_q, extra_k, extra_v = (t.to(amp) if t.dtype in FUSED_DTYPES else t
                                     for t in (extra_q, extra_k, extra_v))
    B, Lq, H, D = q.shape
    if extra_k.shape[0] != B or extra_k.shape[1] < 1 or extra_k.shape[2:] != (H, D):
        raise ValueError(f"rel_attention: extra_k must be [B, G, H, D] = [{B}, G, {H}, {D}] "
                         f"with G >= 1 to match q {list(q.shape)}, got {list(extra_k.shape)}")
    if tuple(extra_v.shape) != tuple(extra_k.shape):
        raise ValueError(f"rel_attention: extra_v must have extra_k's shape "
                         f"{list(extra_k.shape)}, got {list(extra_v.shape)}")
    if tuple(extra_q.shape) != tuple(q.shape):
        raise ValueError(f"rel_attention: extra_q must have q's shape {list(q.shape)}, "
                         f"got {list(extra_q.shape)}")
    for name, t in (("extra_q", extra_q), ("extra_k", extra_k), ("extra_v", extra_v)):
        check_same("rel_attention", name, t, "q", q)
    return extra_q, extra_k, extra_v


def _reference(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, wl, wr, kpm, mask,
               attn_mask_band, dropout_p, memory, r_first_distance=None, extra=None):
    if memory is not None:  # the oracle: attend over [memory, dequantised; current segment]
        k, v = memory.in_front_of(k, v)
    return rel_attention_reference(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, wl, wr,
                                   kpm, mask, dropout_p, attn_mask_band=attn_mask_band,
                                   r_first_distance=r_first_distance, extra=extra)
