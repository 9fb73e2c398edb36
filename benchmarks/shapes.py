"""The benchmark matrix: one source of truth for shapes, dtypes, modes and the FLOP convention.

Used by the pytest-benchmark suite (``benchmarks/test_bench_*.py``) and by the one-command
report (``benchmarks/report.py``). Nothing here imports torch, so the formatting code and the
tests of the FLOP convention stay cheap.

Cases come in three kinds:

* ``attention``: ``rel_attention``-level inputs (q ``[B, Lq, H, D]``, k/v ``[B, Lk, H, D]``,
  r ``[R, H, D]``, u/v ``[H, D]``, masks), every provider of ``providers.ATTN_PROVIDERS``.
* ``conformer_module``: the NeMo- and ESPnet-compatible Conformer attention modules,
  projections included.
* ``update_mems``: the Transformer-XL memory update, library op against per-layer cat + slice.
* ``cpu_attention``: the fused CPU kernel (``rel_attention(backend="cpu")``) against the
  reference path, NeMo's SDPA and eager paths and SDPA without a position term, at one thread
  and at every core (:func:`cpu_kernel_cases`; ``benchmarks/test_bench_cpu_kernel.py``). Not
  part of :func:`all_cases` (the GPU report does not run it).

Each kind has GPU cases (the real shapes, run only where CUDA is present) and a small CPU
subset (scaled-down shapes, so ``pytest benchmarks/ --benchmark-only`` does something useful on
a machine without a GPU and finishes in a couple of minutes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

FWD = "fwd"
FWD_BWD = "fwd+bwd"
MODES = (FWD, FWD_BWD)

# The FLOP convention, stated once (results.legend() prints this text). As Triton's
# fused-attention tutorial counts: a forward matmul of an (Lq x D) by (D x Lk) block is
# 2 * Lq * Lk * D FLOPs, so plain attention (QK^T and PV) is 4 * Lq * Lk * D per batch element
# and head, and relative attention (AC, BD and PV) 6 * Lq * Lk * D; masked blocks count only their
# allowed (query, key) pairs. The backward is 2.5 x the forward (two matmuls per forward
# matmul plus the recomputed QK^T), so forward + backward is 3.5 x the forward. Each provider is
# credited with its own problem's count: sdpa_plain (no position term) with the plain one.
FLOP_CONVENTION = (
    "TFLOP/s as Triton's fused-attention tutorial counts: forward = 2 * D FLOPs per allowed "
    "(query, key) pair per matmul, i.e. 4 * Lq * Lk * D per batch and head for plain attention "
    "(sdpa_plain) and 6 * Lq * Lk * D for relative attention (AC, BD, PV); backward = 2.5 x "
    "forward, so fwd+bwd = 3.5 x forward. Module rows add the projections' FLOPs.")
FWD_FLOPS_PER_PAIR_PER_DIM = {"relative": 6, "plain": 4}
BWD_FLOP_FACTOR = 2.5
PLAIN_PROVIDERS = ("sdpa_plain",)  # attention without the position term

GPU_DTYPES = ("bf16", "fp16")
CPU_DTYPES = ("bf16", "fp16")


def key_lengths(B: int, Lk: int, key_padding: bool) -> List[int]:
    """Valid keys per batch element; padding sits at the end of each row.

    With ``key_padding`` the lengths fall linearly from ``Lk`` (element 0) to 70% of ``Lk``
    (last element), like a length-sorted speech batch; without it every key is valid.
    """
    if not key_padding or B == 1:
        return [Lk] * B
    return [max(1, Lk - (b * 3 * Lk) // (10 * (B - 1))) for b in range(B)]


def allowed_pairs_count(Lq: int, Lk: int, causal: bool, lengths: Sequence[int]) -> int:
    """Number of allowed (batch, query, key) pairs, summed over the batch (per head).

    Causal is bottom-right aligned: query i sees key j iff ``j <= i + (Lk - Lq)``. Keys at
    or beyond ``lengths[b]`` are padding. Exact, in O(B * Lq).
    """
    mlen = Lk - Lq
    total = 0
    for n in lengths:
        if not causal:
            total += Lq * n
        else:
            # sum over i of min(i + mlen + 1, n): queries i < n - mlen - 1 see i + mlen + 1 keys
            # (an arithmetic series), the rest see all n valid keys.
            cut = max(0, min(Lq, n - mlen - 1))
            total += cut * (mlen + 1) + cut * (cut - 1) // 2 + (Lq - cut) * n
    return total


def mode_factor(mode: str) -> float:
    if mode == FWD:
        return 1.0
    if mode == FWD_BWD:
        return 1.0 + BWD_FLOP_FACTOR
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


@dataclass(frozen=True)
class AttnShape:
    """One attention problem. ``Lk = Lq + mem``; the first ``mem`` keys are the memory."""

    group: str
    B: int
    H: int
    D: int
    Lq: int
    mem: int
    causal: bool
    key_padding: bool
    modes: Tuple[str, ...]
    device: str  # "cuda": the real shape; "cpu": the scaled-down smoke subset

    @property
    def Lk(self) -> int:
        return self.Lq + self.mem

    @property
    def R(self) -> int:
        """Rows of r: Lk for causal attention, Lk + Lq - 1 for full attention (2T - 1 for a
        Conformer), the minimum the contract needs."""
        return self.Lk if self.causal else self.Lk + self.Lq - 1

    @property
    def seqlen(self) -> int:
        """The x axis of the plots: the key length."""
        return self.Lk

    @property
    def label(self) -> str:
        parts = [f"B{self.B}", f"H{self.H}", f"D{self.D}"]
        parts.append(f"T{self.Lq}" if self.mem == 0 else f"q{self.Lq}+m{self.mem}")
        parts.append("causal" if self.causal else "full")
        if self.key_padding:
            parts.append("pad")
        return " ".join(parts)

    def lengths(self) -> List[int]:
        return key_lengths(self.B, self.Lk, self.key_padding)

    def flops(self, mode: str, kind: str = "relative") -> float:
        pairs = allowed_pairs_count(self.Lq, self.Lk, self.causal, self.lengths())
        return FWD_FLOPS_PER_PAIR_PER_DIM[kind] * self.D * self.H * pairs * mode_factor(mode)


@dataclass(frozen=True)
class CpuAttnShape(AttnShape):
    """An :class:`AttnShape` timed on the CPU at a given intra-op thread count
    (``torch.set_num_threads(threads)`` for the run), with its own repeat count: one call at
    T = 16,384 takes seconds, so the long shapes run fewer rounds and no warm-up call (the C++
    extension is built before any timing, see ``providers.cpu_fused_unavailable``)."""

    threads: int = 1
    rounds: int = 3
    warmup: int = 1

    @property
    def label(self) -> str:
        t = f"{self.threads} thread" + ("s" if self.threads > 1 else "")
        return f"{AttnShape.label.fget(self)} {t}"


@dataclass(frozen=True)
class ModuleShape:
    """NeMo-style Conformer self-attention: x ``[B, T, n_feat]``, pos_emb ``(1, 2T-1, n_feat)``,
    key padding, non-causal."""

    group: str
    B: int
    H: int
    D: int
    T: int
    modes: Tuple[str, ...]
    device: str
    key_padding: bool = True

    @property
    def n_feat(self) -> int:
        return self.H * self.D

    @property
    def seqlen(self) -> int:
        return self.T

    @property
    def label(self) -> str:
        return f"B{self.B} H{self.H} D{self.D} T{self.T} full" + (" pad" if self.key_padding else "")

    def lengths(self) -> List[int]:
        return key_lengths(self.B, self.T, self.key_padding)

    def attn_shape(self) -> AttnShape:
        return AttnShape(self.group, self.B, self.H, self.D, self.T, 0, False, self.key_padding,
                         self.modes, self.device)

    def flops(self, mode: str) -> float:
        """Attention FLOPs (the convention above) plus the projections: q, k, v and out
        (``2 * B * T * n_feat^2`` each) and the position projection (``2 * (2T-1) * n_feat^2``),
        all scaled by the same forward+backward factor."""
        nf = self.n_feat
        linear = 4 * 2 * self.B * self.T * nf * nf + 2 * (2 * self.T - 1) * nf * nf
        return self.attn_shape().flops(mode) + linear * mode_factor(mode)


@dataclass(frozen=True)
class MemsShape:
    """update_mems: ``layers`` tensors of hidden states ``[qlen, bsz, d_model]`` and memories
    ``[mem_len, bsz, d_model]``."""

    group: str
    layers: int
    qlen: int
    mem_len: int
    bsz: int
    d_model: int
    device: str
    ext_len: int = 0
    modes: Tuple[str, ...] = (FWD,)

    @property
    def seqlen(self) -> int:
        return self.mem_len

    @property
    def label(self) -> str:
        return (f"{self.layers} layers, qlen {self.qlen}, mem_len {self.mem_len}, "
                f"bsz {self.bsz}, d {self.d_model}")

    def moved_bytes(self, itemsize: int) -> int:
        """The least traffic any implementation needs: read and write each new memory row."""
        end = self.mem_len + max(0, self.qlen - self.ext_len)
        beg = max(0, end - self.mem_len)
        rows = end - beg
        return 2 * rows * self.bsz * self.d_model * itemsize * self.layers


@dataclass(frozen=True)
class Case:
    """One row group of the results: every provider of ``kind`` on the same inputs."""

    kind: str  # "attention", "conformer_module", "update_mems"
    shape: object
    dtype: str
    mode: str

    @property
    def device(self) -> str:
        return self.shape.device

    @property
    def group(self) -> str:
        return self.shape.group

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.shape.device}|{self.shape.group}|{self.shape.label}|{self.dtype}|{self.mode}"

    @property
    def id(self) -> str:
        lab = self.shape.label.replace(" ", "-").replace(",", "")
        return f"{self.shape.device}-{self.shape.group}-{lab}-{self.dtype}-{self.mode}"

    def flops(self, provider: str = "") -> Optional[float]:
        """The FLOP count credited to ``provider`` on this case (the convention above)."""
        if self.kind in ("attention", "cpu_attention"):
            return self.shape.flops(self.mode, "plain" if provider in PLAIN_PROVIDERS
                                    else "relative")
        if self.kind == "conformer_module":
            return self.shape.flops(self.mode)
        return None


# ---------------------------------------------------------------------------------------------
# The shapes

_BOTH = (FWD, FWD_BWD)
_EVAL = (FWD,)  # evaluation runs no backward


def attention_shapes(device: str) -> List[AttnShape]:
    if device == "cuda":
        shapes = [
            # Transformer-XL training: qlen 512 with 512 memory.
            AttnShape("txl_train", 16, 8, 64, 512, 512, True, False, _BOTH, "cuda"),
        ]
        # Transformer-XL evaluation: short segments against long memories, forward only.
        for H in (8, 16):
            for q, m in ((64, 640), (128, 1600), (128, 3800)):
                shapes.append(AttnShape("txl_eval", 16, H, 64, q, m, True, False, _EVAL, "cuda"))
        # Conformer: non-causal, key padding, R = 2T - 1.
        for T in (1024, 4096):
            shapes.append(AttnShape("conformer", 8, 8, 64, T, 0, False, True, _BOTH, "cuda"))
        # Long context: the L x K baselines run out of memory at 64k.
        for T in (16384, 65536):
            shapes.append(AttnShape("long", 1, 8, 64, T, 0, True, False, _BOTH, "cuda"))
        return shapes
    if device == "cpu":
        return [
            AttnShape("txl_train", 2, 2, 32, 64, 64, True, False, _BOTH, "cpu"),
            AttnShape("txl_eval", 2, 2, 32, 16, 160, True, False, _EVAL, "cpu"),
            AttnShape("conformer", 2, 2, 32, 96, 0, False, True, _BOTH, "cpu"),
            AttnShape("long", 1, 2, 32, 384, 0, True, False, _BOTH, "cpu"),
        ]
    raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")


def module_shapes(device: str) -> List[ModuleShape]:
    if device == "cuda":
        return [ModuleShape("conformer_module", 8, 8, 64, T, _BOTH, "cuda") for T in (1024, 4096)]
    if device == "cpu":
        return [ModuleShape("conformer_module", 2, 2, 32, 64, _BOTH, "cpu")]
    raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")


def mems_shapes(device: str) -> List[MemsShape]:
    if device == "cuda":
        return [MemsShape("update_mems", n, 512, 512, 16, 1024, "cuda") for n in (4, 16, 32)]
    if device == "cpu":
        return [MemsShape("update_mems", n, 64, 64, 4, 128, "cpu") for n in (4, 16, 32)]
    raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")


MEMS_DTYPE = {"cuda": "bf16", "cpu": "fp32"}


def dtypes_for(device: str) -> Tuple[str, ...]:
    return GPU_DTYPES if device == "cuda" else CPU_DTYPES


def attention_cases(device: str, dtypes: Optional[Sequence[str]] = None) -> List[Case]:
    dts = tuple(dtypes) if dtypes else dtypes_for(device)
    return [Case("attention", s, dt, m) for dt in dts for s in attention_shapes(device)
            for m in s.modes]


def module_cases(device: str, dtypes: Optional[Sequence[str]] = None) -> List[Case]:
    dts = tuple(dtypes) if dtypes else dtypes_for(device)
    return [Case("conformer_module", s, dt, m) for dt in dts for s in module_shapes(device)
            for m in s.modes]


def mems_cases(device: str) -> List[Case]:
    return [Case("update_mems", s, MEMS_DTYPE[device], FWD) for s in mems_shapes(device)]


def all_cases(device: str, dtypes: Optional[Sequence[str]] = None) -> List[Case]:
    """The whole matrix for ``device`` in priority order (what the report runs first survives a
    tight time budget): every kind in the first dtype, then update_mems, then the other dtypes.
    """
    dts = tuple(dtypes) if dtypes else dtypes_for(device)
    out: List[Case] = []
    for n, dt in enumerate(dts):
        out += attention_cases(device, (dt,))
        out += module_cases(device, (dt,))
        if n == 0:
            out += mems_cases(device)
    if not dts:
        out += mems_cases(device)
    return out


# ---------------------------------------------------------------------------------------------
# The fused CPU kernel's cases (kind ``cpu_attention``)

#: ``small`` (default: the CI run, seconds), ``issue`` (the issue's shapes, sized for about six
#: minutes on two idle cores) or ``full`` (the issue's shapes, every mode at every thread count,
#: three rounds or more everywhere: about half an hour on two cores).
CPU_KERNEL_ENV = "TXL_BENCH_CPU_KERNEL"
CPU_KERNEL_SIZES = ("small", "issue", "full")
#: ``1`` adds bf16 cases on a CPU without native bf16 arithmetic (they are left out there).
CPU_BF16_ENV = "TXL_BENCH_CPU_BF16"
#: the dense baselines: the ``[B, H, Lq, Lk]`` (or wider) score tensors they build make them the
#: slow ones, so the long shapes give them fewer rounds (``CpuAttnShape.rounds`` vs
#: :func:`rounds_for`).
DENSE_PROVIDERS = ("reference", "sdpa_bias", "nemo_eager")


def all_cores() -> int:
    """The cores this process may run on: the "all cores" thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_kernel_size(value: Optional[str] = None) -> str:
    """The preset: ``value``, else the ``TXL_BENCH_CPU_KERNEL`` variable, else ``small``."""
    size = value if value is not None else (os.environ.get(CPU_KERNEL_ENV) or "small")
    if size not in CPU_KERNEL_SIZES:
        raise ValueError(f"{CPU_KERNEL_ENV} must be one of {CPU_KERNEL_SIZES}, got {size!r}")
    return size


def cpu_thread_counts() -> Tuple[int, ...]:
    n = all_cores()
    return (1,) if n == 1 else (1, n)


# (T, warm-up calls, rounds, rounds of the dense baselines) per preset; T = 16,384 forward +
# backward at one thread is left to ``full`` (two minutes a round on two cores). T = 16,384
# takes 3 rounds: only the fused kernel and plain SDPA fit in memory there, and one round of
# each on this 2-core VM swings by up to 2x at two threads.
_CONFORMER_PLAN = {
    "small": ((128, 1, 3, 3),),
    "issue": ((1024, 1, 5, 5), (4096, 0, 3, 1), (16384, 0, 3, 1)),
    "full": ((1024, 1, 7, 7), (4096, 1, 5, 3), (16384, 0, 3, 3)),
}
_TXL_PLAN = {  # (bsz, H, D, ((tgt_len, mem_len), ...), rounds)
    "small": (2, 10, 41, ((16, 160),), 3),
    "issue": (10, 10, 41, ((64, 640), (128, 1600)), 5),
    "full": (10, 10, 41, ((64, 640), (128, 1600)), 9),
}


def cpu_kernel_shapes(size: Optional[str] = None) -> List[CpuAttnShape]:
    """The issue's CPU matrix. Conformer: B 1, H 8, D 64, bidirectional, no padding,
    R = 2T - 1, forward and forward + backward; Transformer-XL: H 10, D 41, causal, memory
    first (tgt_len + mem_len keys, R = Lk), forward. Each at one thread and at all cores.
    ``small`` keeps the head counts and head dims at short lengths, for CI."""
    size = cpu_kernel_size(size)
    out: List[CpuAttnShape] = []
    for threads in cpu_thread_counts():
        for T, warmup, rounds, _dense in _CONFORMER_PLAN[size]:
            modes = _BOTH
            if size == "issue" and T >= 16384 and threads == 1:
                modes = _EVAL
            out.append(CpuAttnShape("cpu_conformer", 1, 8, 64, T, 0, False, False, modes, "cpu",
                                    threads=threads, rounds=rounds, warmup=warmup))
        bsz, H, D, pairs, rounds = _TXL_PLAN[size]
        for q, m in pairs:
            out.append(CpuAttnShape("cpu_txl", bsz, H, D, q, m, True, False, _EVAL, "cpu",
                                    threads=threads, rounds=rounds, warmup=1))
    return out


def rounds_for(shape: CpuAttnShape, provider: str, size: Optional[str] = None) -> int:
    """Timed rounds of ``provider`` on ``shape``: the dense baselines get the plan's smaller
    count on the long Conformer shapes (their calls take ten times the fused kernel's)."""
    if provider in DENSE_PROVIDERS and shape.group == "cpu_conformer":
        for T, _w, rounds, dense in _CONFORMER_PLAN[cpu_kernel_size(size)]:
            if T == shape.Lq:
                return min(rounds, dense)
    return shape.rounds


def cpu_kernel_cases(size: Optional[str] = None,
                     dtypes: Optional[Sequence[str]] = None) -> List[Case]:
    """``cpu_attention`` cases: fp32, plus bf16 when ``dtypes`` asks for it (the pytest file
    adds it where the CPU has native bf16, see ``benchmarks/cpu_suite.py``). Ordered by thread
    count, then shape, so one thread count's rows sit together."""
    dts = tuple(dtypes) if dtypes else ("fp32",)
    return [Case("cpu_attention", s, dt, m) for dt in dts for s in cpu_kernel_shapes(size)
            for m in s.modes]


# ---------------------------------------------------------------------------------------------
# Provider names per kind, in table order (implemented in providers.py, which checks that its
# tables match). The first of each kind is this library (with OURS, its other modes); the
# others are the baselines the tables compare against.

PROVIDER_ORDER = {
    "attention": ("fused", "fused_deterministic", "reference", "sdpa_bias", "flex",
                  "sdpa_plain"),
    "conformer_module": ("nemo_fused", "nemo_reference", "nemo_sdpa_bias", "espnet_fused",
                         "espnet_reference"),
    "update_mems": ("update_mems", "torch_cat"),
    "cpu_attention": ("cpu_fused", "reference", "sdpa_bias", "nemo_eager", "sdpa_plain"),
}
OURS = {"attention": ("fused", "fused_deterministic")}
BASELINES = {kind: tuple(n for n in names if n not in OURS.get(kind, names[:1]))
             for kind, names in PROVIDER_ORDER.items()}
KIND_ORDER = ("attention", "conformer_module", "update_mems")
