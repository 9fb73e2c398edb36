"""Benchmark providers: the same relative attention computed by this library and by what users
run today, on the same inputs and with the same semantics.

Attention-level providers take an :class:`AttnInputs` (q ``[B, Lq, H, D]``, k/v
``[B, Lk, H, D]``, r ``[R, H, D]``, u/vb ``[H, D]``, ``causal`` (bottom-right aligned),
``key_padding_mask`` ``[B, Lk]`` with True = padded) and return ``[B, Lq, H, D]``:

``fused``       ``txl_kernels.rel_attention(..., backend="triton")``: BD computed in the kernel.
``reference``   ``rel_attention(..., backend="reference")``: the einsum path with the rel_shift.
``sdpa_bias``   what wenet and NeMo ship: BD = (q + v) r^T built in full, shifted with the
                pad/view rel_shift, scaled, the causal / padding mask folded in as -inf, and
                passed to ``F.scaled_dot_product_attention`` as a float ``attn_mask``; AC comes
                from SDPA on ``q + u``.
``flex``        FlexAttention (compiled with ``torch.compile`` on CUDA) with a ``score_mod``
                reading the same precomputed, scaled BD table ``[B, H, Lq, Lk]``; causal and
                padding as a ``BlockMask`` (bottom-right causal), built once per input set, as a
                model builds it once per batch for all its layers.
``sdpa_plain``  SDPA with no position term (causal via ``causal_lower_right``): the floor, what
                attention costs without any relative term. Not the same function (it ignores r,
                u and vb); it equals the others when those are zero.
``cpu_fused``   ``rel_attention(..., backend="cpu")``: the fused CPU kernel of the C++
                extension (kind ``cpu_attention`` only).
``nemo_eager``  NeMo's ``RelPositionMultiHeadAttention`` without ``use_pytorch_sdpa``: AC and BD
                by ``torch.matmul`` in the inputs' dtype, the pad/view rel_shift, ``(AC + BD) /
                sqrt(d_k)``, masked scores filled with -10000, softmax, masked probabilities
                zeroed, ``attn @ v`` (kind ``cpu_attention`` only).

All imports of optional or in-progress pieces (the fused op, the Conformer modules,
``txl_kernels.memory``) happen inside the provider functions, so this module always imports.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from txl_kernels._utils import interpreting

from .shapes import FWD_BWD, PROVIDER_ORDER

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp64": torch.float64}


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass
class AttnInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    r: torch.Tensor
    u: torch.Tensor
    vb: torch.Tensor
    causal: bool
    key_padding_mask: Optional[torch.Tensor] = None
    softmax_scale: Optional[float] = None
    # Per-input-set artefacts a model builds once and shares across layers (flex BlockMask).
    cache: Dict[str, object] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5 if self.softmax_scale is None else self.softmax_scale

    def tensors(self) -> List[torch.Tensor]:
        return [self.q, self.k, self.v, self.r, self.u, self.vb]


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=torch.float32, generator=gen) * scale).to(dtype)


def make_attn_inputs(shape, dtype, device, requires_grad: bool = False, seed: int = 0) -> AttnInputs:
    """Random inputs for a :class:`shapes.AttnShape` (batch-first, contiguous); key padding at
    the end of each row, lengths from ``shape.lengths()``."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    B, Lq, Lk, H, D, R = shape.B, shape.Lq, shape.Lk, shape.H, shape.D, shape.R
    q = _randn((B, Lq, H, D), dtype, device, gen)
    k = _randn((B, Lk, H, D), dtype, device, gen)
    v = _randn((B, Lk, H, D), dtype, device, gen)
    r = _randn((R, H, D), dtype, device, gen)
    u = _randn((H, D), dtype, device, gen, 0.5)
    vb = _randn((H, D), dtype, device, gen, 0.5)
    kpm = None
    if shape.key_padding:
        lengths = torch.tensor(shape.lengths(), device=device)
        kpm = torch.arange(Lk, device=device)[None, :] >= lengths[:, None]
    ts = [q, k, v, r, u, vb]
    if requires_grad:
        ts = [t.requires_grad_(True) for t in ts]
    return AttnInputs(*ts, causal=shape.causal, key_padding_mask=kpm)


# ---------------------------------------------------------------------------------------------
# Shared pieces of the baselines


def nemo_rel_shift(x: torch.Tensor) -> torch.Tensor:
    """The rel_shift of NeMo / wenet / ESPnet: pad a zero column on the left, view as
    ``[..., pos_len + 1, qlen]``, drop the first row, view back as ``[..., qlen, pos_len]``.

    Gives ``out[..., i, j] = x[..., i, j - i + qlen - 1]`` wherever that index lies in
    ``[0, pos_len)``; elsewhere wrap-around values that the mask hides.
    """
    b, h, qlen, pos_len = x.shape
    x = F.pad(x, (1, 0))
    x = x.view(b, h, pos_len + 1, qlen)
    return x[:, :, 1:].view(b, h, qlen, pos_len)


def shifted_bd(inp: AttnInputs) -> torch.Tensor:
    """``softmax_scale * BD`` as ``[B, H, Lq, Lk]`` in the inputs' dtype, built in full the way
    wenet and NeMo do: ``(q + v) @ r^T`` then the pad/view rel_shift, sliced to Lk keys."""
    Lk, R = inp.k.shape[1], inp.r.shape[0]
    if R < Lk:
        raise ValueError(f"sdpa_bias/flex: the pad/view rel_shift needs R >= Lk, got R={R}, Lk={Lk}")
    q_v = (inp.q + inp.vb).transpose(1, 2)                  # [B, H, Lq, D]
    bdt = torch.matmul(q_v, inp.r.permute(1, 2, 0))        # [B, H, Lq, R]
    return nemo_rel_shift(bdt)[..., :Lk] * inp.scale


def allowed_mask(inp: AttnInputs) -> Optional[torch.Tensor]:
    """Bool ``[B or 1, 1, Lq, Lk]``, True where query i may attend key j; None if every pair is
    allowed."""
    Lq, Lk = inp.q.shape[1], inp.k.shape[1]
    dev = inp.q.device
    allowed = None
    if inp.causal:
        allowed = torch.ones(Lq, Lk, dtype=torch.bool, device=dev).tril_(Lk - Lq)[None, None]
    if inp.key_padding_mask is not None:
        keep = ~inp.key_padding_mask[:, None, None, :]
        allowed = keep if allowed is None else allowed & keep
    return allowed


def _zero_rows_without_keys(out: torch.Tensor, inp: AttnInputs) -> torch.Tensor:
    """out ``[B, Lq, H, D]``: rows whose keys are all padded give 0 (NeMo zeroes them after
    SDPA); with bottom-right causal alone no row is empty."""
    if inp.key_padding_mask is None:
        return out
    empty = inp.key_padding_mask.all(dim=-1)[:, None, None, None]
    return out.masked_fill(empty, 0.0)


# ---------------------------------------------------------------------------------------------
# Attention-level providers


def fused(inp: AttnInputs) -> torch.Tensor:
    from txl_kernels import rel_attention

    return rel_attention(inp.q, inp.k, inp.v, inp.r, inp.u, inp.vb, causal=inp.causal,
                         key_padding_mask=inp.key_padding_mask, softmax_scale=inp.scale,
                         backend="triton")


def fused_deterministic(inp: AttnInputs) -> torch.Tensor:
    from txl_kernels import rel_attention

    return rel_attention(inp.q, inp.k, inp.v, inp.r, inp.u, inp.vb, causal=inp.causal,
                         key_padding_mask=inp.key_padding_mask, softmax_scale=inp.scale,
                         backend="triton", deterministic=True)


def reference(inp: AttnInputs) -> torch.Tensor:
    from txl_kernels import rel_attention

    return rel_attention(inp.q, inp.k, inp.v, inp.r, inp.u, inp.vb, causal=inp.causal,
                         key_padding_mask=inp.key_padding_mask, softmax_scale=inp.scale,
                         backend="reference")


def sdpa_bias(inp: AttnInputs) -> torch.Tensor:
    bias = shifted_bd(inp)
    allowed = allowed_mask(inp)
    if allowed is not None:
        bias = bias.masked_fill_(~allowed, float("-inf"))
    q_u = (inp.q + inp.u).transpose(1, 2)
    out = F.scaled_dot_product_attention(q_u, inp.k.transpose(1, 2), inp.v.transpose(1, 2),
                                         attn_mask=bias, scale=inp.scale)
    return _zero_rows_without_keys(out.transpose(1, 2), inp)


def sdpa_plain(inp: AttnInputs) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    Lq, Lk = inp.q.shape[1], inp.k.shape[1]
    if inp.key_padding_mask is None:
        mask = causal_lower_right(Lq, Lk) if inp.causal else None
    else:
        mask = allowed_mask(inp)  # bool, True = attend (SDPA's polarity)
    out = F.scaled_dot_product_attention(inp.q.transpose(1, 2), inp.k.transpose(1, 2),
                                         inp.v.transpose(1, 2), attn_mask=mask, scale=inp.scale)
    return _zero_rows_without_keys(out.transpose(1, 2), inp)


def _flex_with_table(q, k, v, bd, block_mask, scale):
    from torch.nn.attention.flex_attention import flex_attention

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bd[b, h, q_idx, kv_idx]

    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)


_FLEX_COMPILED: Dict[str, Callable] = {}
# torch.compile's ``dynamic`` for the flex provider. None (the default, automatic dynamic
# shapes): the first length of a (dtype, mode, mask kind) compiles a static graph, the next one
# a graph with symbolic lengths that the remaining lengths reuse, so the matrix does not pay a
# compile per length. False: one static graph per shape (set by ``report.py --flex-static``).
FLEX_DYNAMIC: Optional[bool] = None


def _flex_callable(device: torch.device, compiled: Optional[bool]) -> Callable:
    """FlexAttention is fast only compiled; on CUDA the provider compiles (the recompile limit
    is raised for the whole matrix). Eager mode (CPU, tests) runs FlexAttention's reference
    implementation."""
    if compiled is None:
        compiled = device.type == "cuda"
    if not compiled:
        return _flex_with_table
    key = f"dynamic={FLEX_DYNAMIC}"
    if key not in _FLEX_COMPILED:
        import torch._dynamo.config as dcfg

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dcfg, name):
                setattr(dcfg, name, max(getattr(dcfg, name), 256))
        _FLEX_COMPILED[key] = torch.compile(_flex_with_table, dynamic=FLEX_DYNAMIC)
    return _FLEX_COMPILED[key]


def flex_block_mask(inp: AttnInputs):
    """BlockMask for causal (bottom-right) and key padding, or None when every pair is allowed.
    Built once per input set and cached in ``inp.cache``."""
    if "flex_block_mask" in inp.cache:
        return inp.cache["flex_block_mask"]
    from torch.nn.attention.flex_attention import create_block_mask

    B, Lq = inp.q.shape[:2]
    Lk = inp.k.shape[1]
    mlen = Lk - Lq
    kpm = inp.key_padding_mask
    if inp.causal and kpm is not None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx + mlen >= kv_idx) & ~kpm[b, kv_idx]
    elif inp.causal:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx + mlen >= kv_idx
    elif kpm is not None:
        def mask_mod(b, h, q_idx, kv_idx):
            return ~kpm[b, kv_idx]
    else:
        mask_mod = None
    bm = None
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, B if kpm is not None else None, None, Lq, Lk,
                               device=inp.q.device)
    inp.cache["flex_block_mask"] = bm
    return bm


def flex(inp: AttnInputs, compiled: Optional[bool] = None) -> torch.Tensor:
    fn = _flex_callable(inp.q.device, compiled)
    bm = flex_block_mask(inp)
    bd = shifted_bd(inp)
    q_u = (inp.q + inp.u).transpose(1, 2)
    out = fn(q_u, inp.k.transpose(1, 2), inp.v.transpose(1, 2), bd, bm, inp.scale)
    return out.transpose(1, 2)


def nemo_eager(inp: AttnInputs) -> torch.Tensor:
    Lk, R = inp.k.shape[1], inp.r.shape[0]
    if R < Lk:
        raise ValueError(f"nemo_eager: the pad/view rel_shift needs R >= Lk, got R={R}, Lk={Lk}")
    q_u = (inp.q + inp.u).transpose(1, 2)                   # [B, H, Lq, D]
    q_v = (inp.q + inp.vb).transpose(1, 2)
    matrix_ac = torch.matmul(q_u, inp.k.permute(0, 2, 3, 1))            # [B, H, Lq, Lk]
    matrix_bd = torch.matmul(q_v, inp.r.permute(1, 2, 0))               # [B, H, Lq, R]
    matrix_bd = nemo_rel_shift(matrix_bd)[..., :Lk]
    scores = (matrix_ac + matrix_bd) / (1.0 / inp.scale)  # NeMo divides by s_d_k
    allowed = allowed_mask(inp)
    if allowed is None:
        attn = torch.softmax(scores, dim=-1)
    else:
        masked = ~allowed
        attn = torch.softmax(scores.masked_fill(masked, -10000.0), dim=-1).masked_fill(masked, 0.0)
    return torch.matmul(attn, inp.v.transpose(1, 2)).transpose(1, 2)


#: the ``rel_attention`` backend that ``cpu_fused`` times. Another name (``reference``) runs the
#: whole CPU suite end to end where the CPU kernel is not built; its rows are then that backend's
#: times, and the summary says so.
CPU_BACKEND_ENV = "TXL_BENCH_CPU_BACKEND"


def cpu_fused_backend() -> str:
    return os.environ.get(CPU_BACKEND_ENV) or "cpu"


def cpu_fused(inp: AttnInputs) -> torch.Tensor:
    from txl_kernels import rel_attention

    return rel_attention(inp.q, inp.k, inp.v, inp.r, inp.u, inp.vb, causal=inp.causal,
                         key_padding_mask=inp.key_padding_mask, softmax_scale=inp.scale,
                         backend=cpu_fused_backend())


_CPU_FUSED_STATUS: Dict[str, Optional[str]] = {}


def cpu_fused_unavailable() -> Optional[str]:
    """Why ``cpu_fused`` cannot be timed here (None: it can). The first call runs the backend
    once on a tiny input, which builds or loads the C++ extension, so no timed call pays for
    it; the answer is kept for the process."""
    backend = cpu_fused_backend()
    if backend in _CPU_FUSED_STATUS:
        return _CPU_FUSED_STATUS[backend]
    from txl_kernels import functional

    reason = None
    if backend not in functional.BACKENDS:
        reason = (f"rel_attention has no backend={backend!r} in this txl_kernels (backends: "
                  f"{', '.join(functional.BACKENDS)}): the fused CPU kernel is not built in")
    else:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 5, 2, 16, generator=gen) for _ in range(3))
        r = torch.randn(9, 2, 16, generator=gen)
        u, vb = torch.zeros(2, 16), torch.zeros(2, 16)
        try:
            cpu_fused(AttnInputs(q, k, v, r, u, vb, causal=False))
        except Exception as exc:  # noqa: BLE001 - the reason is what is reported
            reason = (f"rel_attention(backend={backend!r}) cannot run here: "
                      f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    _CPU_FUSED_STATUS[backend] = reason
    return reason


@dataclass(frozen=True)
class Provider:
    name: str
    fn: Callable
    cuda_only: bool
    cuda_only_reason: str = ""
    description: str = ""
    modes: tuple = ()  # the modes it is timed in (empty: all)


ATTN_PROVIDERS: Dict[str, Provider] = {
    p.name: p for p in (
        Provider("fused", fused, True,
                 "the fused Triton path is timed only on CUDA, never under the Triton "
                 "interpreter", "txl_kernels.rel_attention(backend='triton')"),
        Provider("fused_deterministic", fused_deterministic, True,
                 "the fused Triton path is timed only on CUDA, never under the Triton "
                 "interpreter", "the same with deterministic=True (bitwise-reproducible "
                 "gradients: the backward's atomics in key-tile order); forward + backward "
                 "only, its forward is the fused one", modes=(FWD_BWD,)),
        Provider("reference", reference, False, "",
                 "txl_kernels.rel_attention(backend='reference'): einsum + rel_shift"),
        Provider("sdpa_bias", sdpa_bias, False, "",
                 "full shifted BD as a float attn_mask to SDPA (wenet / NeMo)"),
        Provider("flex", flex, True,
                 "FlexAttention is timed compiled on CUDA only (on CPU it has no backward "
                 "and its eager path is a reference implementation)",
                 "FlexAttention, score_mod reading a precomputed BD table"),
        Provider("sdpa_plain", sdpa_plain, False, "",
                 "SDPA without a position term (the floor)"),
    )
}


def skip_reason(provider: Provider, device) -> Optional[str]:
    """Why ``provider`` is not timed on ``device`` (None: it is)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return "needs a CUDA device (none here)"
    if provider.cuda_only and device.type != "cuda":
        return provider.cuda_only_reason
    if provider.name in ("fused", "fused_deterministic", "nemo_fused",
                         "espnet_fused") and interpreting():
        return "TRITON_INTERPRET=1 is set: the fused path is never timed under the interpreter"
    if provider.name == "cpu_fused":
        if device.type != "cpu":
            return "the fused CPU kernel runs on CPU tensors"
        return cpu_fused_unavailable()
    return None


# ---------------------------------------------------------------------------------------------
# Conformer module level (projections included)


@dataclass
class ModuleInputs:
    module: torch.nn.Module
    x: torch.Tensor              # [B, T, n_feat]; query = key = value (self-attention)
    pos_emb: torch.Tensor        # (1, 2T - 1, n_feat), distance T-1 down to -(T-1)
    key_padding_mask: Optional[torch.Tensor]  # [B, T], True = padded
    mask: Optional[torch.Tensor]              # (B, T, T), True = masked (NeMo's polarity):
    # padded keys and padded queries, as NeMo's encoder builds it. The modules are given the
    # [B, T] key_padding_mask instead when their forward takes one (the same semantics: padded
    # query rows come out 0), so no dense mask reaches the kernel.
    H: int
    cache: Dict[str, object] = field(default_factory=dict)
    # the forward's keyword arguments, chosen once here (no signature inspection in timed code)
    forward_kwargs: Dict[str, object] = field(default_factory=dict)

    def grad_inputs(self) -> List[torch.Tensor]:
        return [self.x] + [p for p in self.module.parameters() if p.requires_grad]


def make_nemo_module(n_head: int, n_feat: int, backend: str, dtype, device,
                     seed: int = 0, family: str = "nemo") -> torch.nn.Module:
    """The library's NeMo-compatible (or, with ``family="espnet"``, ESPnet-compatible) module
    (``txl_kernels.modules.conformer``) on ``backend``.

    The backend is passed to the constructor when it takes one, else set as the ``backend``
    attribute; if neither exists the module cannot be pinned to a backend and this raises.
    """
    from txl_kernels.modules import conformer

    if family == "espnet":
        M = conformer.ESPnetRelPositionMultiHeadedAttention
        kw = dict(n_head=n_head, n_feat=n_feat, dropout_rate=0.0)
    else:
        M = conformer.NeMoRelPositionMultiHeadAttention
        kw = dict(n_head=n_head, n_feat=n_feat, dropout_rate=0.0, pos_bias_u=None,
                  pos_bias_v=None)
    params = inspect.signature(M.__init__).parameters
    with torch.random.fork_rng(devices=[]):  # same weights for every provider, global RNG kept
        torch.manual_seed(seed)
        mod = M(**kw, backend=backend) if "backend" in params else M(**kw)
    if "backend" not in params:
        if not hasattr(mod, "backend"):
            raise RuntimeError("NeMoRelPositionMultiHeadAttention takes no backend argument and "
                               "has no backend attribute: cannot pin reference vs fused")
        mod.backend = backend
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    mod = mod.to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # the module owns zero-initialised biases: make them matter
        g = torch.Generator().manual_seed(1)
        for name in ("pos_bias_u", "pos_bias_v"):
            p = getattr(mod, name)
            p.copy_((torch.randn(p.shape, generator=g) * 0.5).to(p.dtype))
    return mod


def make_module_inputs(shape, dtype, device, backend: str, requires_grad: bool = False,
                       seed: int = 0, module: Optional[torch.nn.Module] = None,
                       family: str = "nemo") -> ModuleInputs:
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    device = torch.device(device)
    mod = module if module is not None else make_nemo_module(shape.H, shape.n_feat, backend,
                                                             dtype, device, seed, family)
    for p in mod.parameters():
        p.requires_grad_(requires_grad)
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, nf = shape.B, shape.T, shape.n_feat
    x = _randn((B, T, nf), dtype, device, gen)
    pos = _randn((1, 2 * T - 1, nf), dtype, device, gen)
    kpm = mask = None
    if shape.key_padding:
        lengths = torch.tensor(shape.lengths(), device=device)
        kpm = torch.arange(T, device=device)[None, :] >= lengths[:, None]
        mask = kpm[:, None, :] | kpm[:, :, None]  # NeMo's encoder mask: padded keys and queries
    if requires_grad:
        x.requires_grad_(True)
    kw = dict(query=x, key=x, value=x, pos_emb=pos)
    if kpm is not None and "key_padding_mask" in inspect.signature(mod.forward).parameters:
        # A key-padding argument reaches the kernel as key_padding_mask: no dense mask read.
        kw.update(mask=None, key_padding_mask=kpm)
    else:
        kw.update(mask=mask)
    return ModuleInputs(mod, x, pos, kpm, mask, shape.H, forward_kwargs=kw)


def _module_forward(inp: ModuleInputs) -> torch.Tensor:
    """The drop-in module's forward, called by keyword as NeMo does."""
    return inp.module(**inp.forward_kwargs)


def nemo_fused(inp: ModuleInputs) -> torch.Tensor:
    return _module_forward(inp)


def nemo_reference(inp: ModuleInputs) -> torch.Tensor:
    return _module_forward(inp)


def _espnet_forward(inp: ModuleInputs) -> torch.Tensor:
    """The ESPnet drop-in's forward: its (B, 1, T) keep-mask (True = keep) is key padding by
    its shape, so it reaches the kernel as key_padding_mask (no dense mask)."""
    keep = None if inp.key_padding_mask is None else ~inp.key_padding_mask[:, None, :]
    return inp.module(inp.x, inp.x, inp.x, inp.pos_emb, keep)


def espnet_fused(inp: ModuleInputs) -> torch.Tensor:
    return _espnet_forward(inp)


def espnet_reference(inp: ModuleInputs) -> torch.Tensor:
    return _espnet_forward(inp)


def nemo_sdpa_bias(inp: ModuleInputs) -> torch.Tensor:
    """NeMo's own algorithm on its SDPA path, with the module's weights: the projections,
    ``sdpa_bias`` for the attention (BD in full as a float mask), padded query rows zeroed,
    the output projection."""
    m = inp.module
    B, T, nf = inp.x.shape
    H = inp.H
    D = nf // H
    q = m.linear_q(inp.x).view(B, T, H, D)
    k = m.linear_k(inp.x).view(B, T, H, D)
    v = m.linear_v(inp.x).view(B, T, H, D)
    p = m.linear_pos(inp.pos_emb).view(-1, H, D)   # (2T - 1, H, D)
    att = AttnInputs(q, k, v, p, m.pos_bias_u, m.pos_bias_v, causal=False,
                     key_padding_mask=inp.key_padding_mask)
    out = sdpa_bias(att)
    if inp.key_padding_mask is not None:
        # NeMo's encoder masks padded queries too (its mask is pad_q | pad_k), so their rows
        # are fully masked and NeMo zeroes them after SDPA.
        out = out.masked_fill(inp.key_padding_mask[:, :, None, None], 0.0)
    return m.linear_out(out.reshape(B, T, nf))


MODULE_PROVIDERS: Dict[str, Provider] = {
    p.name: p for p in (
        Provider("nemo_fused", nemo_fused, True,
                 "the fused Triton path is timed only on CUDA, never under the Triton "
                 "interpreter", "NeMoRelPositionMultiHeadAttention, backend='triton'"),
        Provider("nemo_reference", nemo_reference, False, "",
                 "NeMoRelPositionMultiHeadAttention, backend='reference'"),
        Provider("nemo_sdpa_bias", nemo_sdpa_bias, False, "",
                 "NeMo's algorithm on its SDPA path (BD as a float mask), same weights"),
        Provider("espnet_fused", espnet_fused, True,
                 "the fused Triton path is timed only on CUDA, never under the Triton "
                 "interpreter", "ESPnetRelPositionMultiHeadedAttention, backend='triton'"),
        Provider("espnet_reference", espnet_reference, False, "",
                 "ESPnetRelPositionMultiHeadedAttention, backend='reference' (ESPnet's "
                 "algorithm: full AC + BD, rel_shift, softmax)"),
    )
}
MODULE_BACKEND = {"nemo_fused": "triton", "nemo_reference": "reference",
                  "nemo_sdpa_bias": "reference", "espnet_fused": "triton",
                  "espnet_reference": "reference"}
MODULE_FAMILY = {name: name.split("_")[0] for name in MODULE_BACKEND}


# ---------------------------------------------------------------------------------------------
# update_mems


@dataclass
class MemsInputs:
    hids: List[torch.Tensor]
    mems: List[torch.Tensor]
    mem_len: int
    ext_len: int = 0
    cache: Dict[str, object] = field(default_factory=dict)


def make_mems_inputs(shape, dtype, device, seed: int = 0) -> MemsInputs:
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    hids = [_randn((shape.qlen, shape.bsz, shape.d_model), dtype, device, gen)
            for _ in range(shape.layers)]
    mems = [_randn((shape.mem_len, shape.bsz, shape.d_model), dtype, device, gen)
            for _ in range(shape.layers)]
    return MemsInputs(hids, mems, shape.mem_len, shape.ext_len)


def torch_cat_mems(inp: MemsInputs) -> List[torch.Tensor]:
    """The original Transformer-XL ``_update_mems`` loop (with mlen and qlen in the right
    order): per layer ``cat([mems[l], hids[l]])[beg:end].detach()``."""
    mlen = inp.mems[0].shape[0] if inp.mems else 0
    qlen = inp.hids[0].shape[0]
    end = mlen + max(0, qlen - inp.ext_len)
    beg = max(0, end - inp.mem_len)
    with torch.no_grad():
        return [torch.cat([m, h], dim=0)[beg:end].detach() for m, h in zip(inp.mems, inp.hids)]


def library_update_mems(inp: MemsInputs) -> List[torch.Tensor]:
    from txl_kernels.memory import update_mems

    return update_mems(inp.hids, inp.mems, inp.mem_len, ext_len=inp.ext_len)


MEMS_PROVIDERS: Dict[str, Provider] = {
    p.name: p for p in (
        Provider("update_mems", library_update_mems, False, "",
                 "txl_kernels.update_mems (C++ / CUDA op, one launch for all layers)"),
        Provider("torch_cat", torch_cat_mems, False, "",
                 "per-layer torch.cat + slice (the original loop)"),
    )
}

# ---------------------------------------------------------------------------------------------
# The fused CPU kernel against what CPU users run (kind ``cpu_attention``; the same inputs as the
# attention level)

CPU_ATTN_PROVIDERS: Dict[str, Provider] = {
    p.name: p for p in (
        Provider("cpu_fused", cpu_fused, False, "",
                 "txl_kernels.rel_attention(backend='cpu'): the fused CPU kernel"),
        ATTN_PROVIDERS["reference"],
        ATTN_PROVIDERS["sdpa_bias"],
        Provider("nemo_eager", nemo_eager, False, "",
                 "NeMo's eager path: AC and BD by torch.matmul, rel_shift, masked softmax"),
        ATTN_PROVIDERS["sdpa_plain"],
    )
}

PROVIDERS_BY_KIND = {"attention": ATTN_PROVIDERS, "conformer_module": MODULE_PROVIDERS,
                     "update_mems": MEMS_PROVIDERS, "cpu_attention": CPU_ATTN_PROVIDERS}
for _kind, _table in PROVIDERS_BY_KIND.items():
    assert tuple(_table) == PROVIDER_ORDER[_kind], (_kind, tuple(_table))
