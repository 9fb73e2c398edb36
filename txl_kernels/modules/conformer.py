"""Conformer drop-ins: NeMo's ``RelPositionMultiHeadAttention`` and
``RelPositionMultiHeadAttentionLongformer`` (local attention with global tokens) and ESPnet's
(current, not legacy) ``RelPositionMultiHeadedAttention``, computed by
``txl_kernels.rel_attention``.

Same constructors, forward signatures, parameter names (state_dict keys) and return values as
the originals, so checkpoints load with ``strict=True`` and the modules can replace the
originals inside a Conformer encoder (see :func:`swap_rel_pos_attention`).

Position table -> ``r``. Both frameworks pass ``pos_emb`` with ``2K - 1`` rows, row ``m``
holding relative distance ``(K - 1) - m`` (``K`` = number of keys, cache included), and apply
the same pad/reshape ``rel_shift``, which reads column ``m = j - i + Lq - 1`` of
``(q + v) @ p^T`` for query ``i`` and key ``j`` (``Lq`` = number of queries). That is exactly
``rel_attention``'s row index ``p = j - i + Lq - 1``, so the projected table passes with row
offset 0: ``r = linear_pos(pos_emb).view(..., H, D)[0, :Lk + Lq - 1]`` (a view; rows past
``Lk + Lq - 2`` are never read). Check: row ``p`` holds distance ``K - 1 - p = (i + Lk - Lq)
- j``, the distance of query ``i`` (absolute position ``i + C`` after a cache of ``C``
frames) to key ``j``. With a cache, ``Lq = T``, ``Lk = C + T`` and NeMo's ``pos_emb`` has
``2(C + T) - 1`` rows, so the offset is still 0. With a window (``att_context_size``, the
transformers drop-ins' ``window_size``) the allowed pairs read only the rows of distances
``left`` down to ``-right``: only those rows go through ``linear_pos`` (passed with
``r_first_distance``), so local attention over long audio projects ``left + right + 1`` rows,
not ``2K - 1`` (eager and torch.compile, where the bounds are symbolic); a graph exported or
traced for other lengths (torch.export, ONNX, torch.jit.trace) projects the whole table, since
the bounds, functions of the lengths, would be fixed or guarded there.

Masks. Dense masks (``(B, T, K)``) pass through ``attn_mask`` and stay exact. A mask that is
key padding by its shape (``(B, 1, K)``), the optional ``key_padding_mask`` / ``lengths``
arguments and NeMo's limited context (``att_context_size``, a band) reach the kernel as
``key_padding_mask`` / ``window_size``, so no ``[B, T, K]`` mask is read. Nothing here reads a
tensor value on the host (no ``.item()``, no data-dependent branches).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .._export import onnx_exporting, refuse_context_parallel
from .._utils import describe
from ..functional import BACKENDS, allowed_distances, rel_attention
from ._dropin import adopt, check_key_padding_mask

__all__ = ["NeMoRelPositionMultiHeadAttention", "NeMoRelPositionMultiHeadAttentionLongformer",
           "ESPnetRelPositionMultiHeadedAttention"]


class RelPosAttentionBase(nn.Module):
    """Shared plumbing: projections, position table, mask checks, the rel_attention call."""

    _NAME = "RelPosAttentionBase"
    # Context parallelism (docs/distributed.md): a torch.distributed group, set on the module
    # (``module.cp_group = group``); each rank then passes its contiguous slice of the frames.
    cp_group = None

    def _global_len(self, n: int, device) -> int:
        """The sum of ``n`` over ``cp_group`` (all-gathered)."""
        import torch.distributed as dist

        refuse_context_parallel(self._NAME)  # the first collective of the ring's callers

        t = torch.tensor([n], dtype=torch.int64,
                         device=device if dist.get_backend(self.cp_group) == "nccl" else "cpu")
        dist.all_reduce(t, group=self.cp_group)
        return int(t)

    def _check_global_pos_emb(self, pos_emb, batch: int, qlen: int, device) -> None:
        """Under ``cp_group``: ``pos_emb`` must span the frames of every rank."""
        k_all = self._global_len(qlen, device)
        self._check_pos_emb(pos_emb, batch, k_all, f" (K = {k_all}, the frames of every rank)")

    def _init_common(self, n_head: int, n_feat: int, dropout_rate: float, use_bias: bool,
                     backend: str) -> None:
        if not isinstance(n_head, int) or not isinstance(n_feat, int) or n_head < 1 \
                or n_feat < 1 or n_feat % n_head != 0:
            raise ValueError(f"{self._NAME}: n_feat must be a positive multiple of n_head, "
                             f"got n_head={n_head!r}, n_feat={n_feat!r}")
        if backend not in BACKENDS:
            raise ValueError(f"{self._NAME}: backend must be one of {BACKENDS}, got {backend!r}")
        self.d_k = n_feat // n_head
        self.s_d_k = self.d_k ** 0.5
        self.h = n_head
        self.n_feat = n_feat
        self.backend = backend
        self.linear_q = nn.Linear(n_feat, n_feat, bias=use_bias)
        self.linear_k = nn.Linear(n_feat, n_feat, bias=use_bias)
        self.linear_v = nn.Linear(n_feat, n_feat, bias=use_bias)
        self.linear_out = nn.Linear(n_feat, n_feat, bias=use_bias)
        self.dropout = nn.Dropout(p=dropout_rate)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)

    def _init_nemo(self, n_head: int, n_feat: int, dropout_rate: float, pos_bias_u, pos_bias_v,
                   max_cache_len: int, use_bias: bool, backend: str) -> None:
        """NeMo's attributes and parameters (``MultiHeadAttention``'s and
        ``RelPositionMultiHeadAttention``'s constructors): the biases are the shared ``[H,
        D]`` parameters given, or zero-initialised own ones when either is None."""
        self._init_common(n_head, n_feat, dropout_rate, use_bias, backend)
        self.use_bias = use_bias
        self.dropout_rate = dropout_rate
        self._max_cache_len = max_cache_len
        self.cache_drop_size = 0
        if pos_bias_u is None or pos_bias_v is None:
            self.pos_bias_u = nn.Parameter(torch.zeros(self.h, self.d_k))
            self.pos_bias_v = nn.Parameter(torch.zeros(self.h, self.d_k))
            return
        for name, t in (("pos_bias_u", pos_bias_u), ("pos_bias_v", pos_bias_v)):
            if tuple(t.shape) != (self.h, self.d_k):
                raise ValueError(f"{self._NAME}: {name} must be [n_head, d_k] = "
                                 f"[{self.h}, {self.d_k}], got {list(t.shape)}")
        self.pos_bias_u = pos_bias_u
        self.pos_bias_v = pos_bias_v

    # -- checks --------------------------------------------------------------------------
    def _check_seq(self, name: str, t, batch: Optional[int] = None) -> None:
        if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != self.n_feat \
                or (batch is not None and t.shape[0] != batch):
            b = "B" if batch is None else f"B={batch}"
            raise ValueError(f"{self._NAME}: {name} must be ({b}, time, n_feat={self.n_feat}), "
                             f"got {describe(t)}")

    def _check_pos_emb(self, pos_emb, batch: int, klen: int, hint: str) -> None:
        if not isinstance(pos_emb, Tensor) or pos_emb.dim() != 3:
            raise ValueError(f"{self._NAME}: pos_emb must be (1 or B, 2K - 1, n_feat), "
                             f"got {describe(pos_emb)}")
        want = (2 * klen - 1, self.n_feat)
        if pos_emb.shape[0] not in (1, batch) or tuple(pos_emb.shape[1:]) != want:
            raise ValueError(
                f"{self._NAME}: pos_emb must be (1 or B={batch}, 2K - 1 = {want[0]}, "
                f"n_feat={self.n_feat}) for K={klen} keys{hint}, ordered from distance K - 1 "
                f"down to -(K - 1); got {list(pos_emb.shape)}")

    def _update_cache(self, query: Tensor, key: Tensor, value: Tensor, cache: Optional[Tensor]):
        """NeMo's ``update_cache`` (value / cache checked): with a cache, keys and values are
        both ``cat(cache, key)`` and the next cache is ``cat(cache[:, keep:], query[:,
        :keep])``, ``keep = T - cache_drop_size``. Returns (key, value, next cache or None)."""
        B, T = query.shape[0], query.shape[1]
        if cache is None:
            self._check_seq("value", value, B)
            return key, value, None
        self._check_seq("cache", cache, B)
        key = value = torch.cat([cache, key], dim=1)
        keep = T - self.cache_drop_size
        return key, value, torch.cat([cache[:, keep:, :], query[:, :keep, :]], dim=1)

    def _padding_args(self, key_padding_mask, lengths, batch: int, qlen: int, klen: int,
                      device) -> Optional[Tensor]:
        """key_padding_mask ([B, K] bool, True = padded) or lengths ([B] valid frames of the
        current segment; cached keys count as valid) -> [B, K] bool, or None."""
        if key_padding_mask is not None and lengths is not None:
            raise ValueError(f"{self._NAME}: pass key_padding_mask or lengths, not both")
        if key_padding_mask is not None:
            check_key_padding_mask(self._NAME, key_padding_mask, "(B, K)", (batch, klen))
            return key_padding_mask
        if lengths is not None:
            if not isinstance(lengths, Tensor) or lengths.dim() != 1 \
                    or lengths.shape[0] != batch or lengths.is_floating_point() \
                    or lengths.dtype == torch.bool:
                raise ValueError(f"{self._NAME}: lengths must be an integer tensor (B={batch},) "
                                 f"of valid frames per sequence; got {describe(lengths)}")
            lengths = lengths.to(device=device)
            # Checked on the device (no host sync): on CPU this raises here, on CUDA as a
            # device-side assertion at the next synchronisation.
            torch._assert_async(((lengths >= 0) & (lengths <= qlen)).all(),
                                f"{self._NAME}: lengths must be in [0, {qlen}] (valid frames of "
                                f"the {qlen} current frames); got a negative value or one "
                                f"> {qlen}")
            pos = torch.arange(klen, device=device)
            return pos[None, :] >= (lengths[:, None] + (klen - qlen))
        return None

    # -- the attention -------------------------------------------------------------------
    def _project(self, linear: nn.Linear, x: Tensor) -> Tensor:
        y = linear(x)  # [B, L, H*D]
        return y.view(*y.shape[:-1], self.h, self.d_k)  # a view: [B, L, H, D]

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, pos_emb: Tensor,
                kpm: Optional[Tensor], attn_mask: Optional[Tensor],
                window: Tuple[int, int], zero_triu: bool = False,
                attn_mask_band: Optional[Tensor] = None) -> Tensor:
        """Projections + rel_attention. Returns [B, Lq, H, D]. attn_mask_band: optional
        mask_to_band(attn_mask) of the whole mask (also right for each sequence's slice)."""
        Lq, Lk = query.shape[1], key.shape[1]
        q = self._project(self.linear_q, query)
        k = self._project(self.linear_k, key)
        v = self._project(self.linear_v, value)
        if pos_emb.shape[0] > 1 and pos_emb.stride(0) == 0:
            pos_emb = pos_emb[:1]  # an expanded table: project one copy
        rows = None if zero_triu or self.cp_group is not None or _fixed_graph() \
            else window_position_rows(Lq, Lk, window)
        if rows is not None:
            # a window reads a band of the table: project only those rows (local attention
            # over long audio would otherwise project all 2Lk - 1 of them)
            lo, hi = rows
            p = self._project(self.linear_pos, pos_emb[:, lo:hi + 1])
            return self._rel_attention(q, k, v, p, kpm, attn_mask, window, attn_mask_band,
                                       r_first_distance=Lk - 1 - lo)
        p = self._project(self.linear_pos, pos_emb)  # [1 or B, 2Lk - 1, H, D]
        if zero_triu:
            # ESPnet's zero_triu zeroes BD for j - i > Lk - Lq, i.e. rows p >= Lk: the one
            # layout that needs a (small, [2Lk - 1, H, D]) copy.
            r = torch.cat([p[:, :Lk], p.new_zeros(p.shape[0], Lq - 1, self.h, self.d_k)], 1)
        else:
            r = p[:, :Lk + Lq - 1]  # row offset 0 (module docstring); a strided view
        if self.cp_group is not None:
            u = self.pos_bias_u.to(q.dtype)
            vb = self.pos_bias_v.to(q.dtype)
            drop = self.dropout.p if self.training else 0.0
            return self._attend_context_parallel(q, k, v, p, u, vb, kpm, attn_mask, window,
                                                 zero_triu, drop)
        return self._rel_attention(q, k, v, r, kpm, attn_mask, window, attn_mask_band)

    def _rel_attention(self, q: Tensor, k: Tensor, v: Tensor, r: Tensor, kpm: Optional[Tensor],
                       attn_mask: Optional[Tensor], window: Tuple[int, int],
                       attn_mask_band: Optional[Tensor] = None, **extra) -> Tensor:
        """rel_attention on projected q / k / v ``[B, L, H, D]`` and ``r`` ``[1 or B, R, H,
        D]`` with the module's biases, scale, dropout and backend; ``extra``: more keyword
        arguments of rel_attention (tensors with a batch axis first)."""
        u = self.pos_bias_u.to(q.dtype)
        vb = self.pos_bias_v.to(q.dtype)
        drop = self.dropout.p if self.training else 0.0

        def call(qq, kk, vv, rr, kp, am, bu=u, bv=vb, band=attn_mask_band, **kw):
            return rel_attention(qq, kk, vv, rr, bu, bv, causal=False, window_size=window,
                                 key_padding_mask=kp, attn_mask=am,
                                 attn_mask_band=None if am is None else band,
                                 softmax_scale=1.0 / self.s_d_k, dropout_p=drop,
                                 backend=self.backend, **kw)

        if r.shape[0] == 1:
            return call(q, k, v, r[0], kpm, attn_mask, **extra)
        if not extra and (onnx_exporting() or (torch.compiler.is_exporting()
                                               and isinstance(r.shape[0], torch.SymInt))):
            # One table per sequence in a graph whose batch size is dynamic (an ONNX export,
            # torch.export with a dynamic batch), where the loop below would pin the batch
            # size: the batch folded into the heads, one call (the same pairs and sums).
            return self._attend_folded(q, k, v, r, u, vb, kpm, attn_mask, call)
        # One position table per sequence: r has no batch axis, so run sequence by sequence.
        outs = []
        for b in range(q.shape[0]):
            am = attn_mask
            if am is not None and am.shape[0] != 1:
                am = am[b:b + 1]
            kw = {n: t[b:b + 1] if isinstance(t, Tensor) else t for n, t in extra.items()}
            outs.append(call(q[b:b + 1], k[b:b + 1], v[b:b + 1], r[b],
                             None if kpm is None else kpm[b:b + 1], am, **kw))
        return torch.cat(outs, 0)

    def _attend_folded(self, q, k, v, r, u, vb, kpm, attn_mask, call) -> Tensor:
        """``call`` on ``[1, L, B * H, D]`` tensors, r ``[B, R, H, D]`` as ``[R, B * H, D]``,
        the biases repeated per sequence and the masks as one ``[1, B * H, Lq | 1, Lk]``
        mask; back to ``[B, Lq, H, D]``."""
        B, Lq, H, D = q.shape
        Lk = k.shape[1]

        def fold(t):
            return t.transpose(0, 1).reshape(1, t.shape[1], B * H, D)

        masked = None if kpm is None else kpm[:, None, None, :]
        if attn_mask is not None:
            masked = attn_mask if masked is None else masked | attn_mask
        if masked is not None:
            masked = masked.expand(B, H, masked.shape[2], Lk).reshape(1, B * H, -1, Lk)
        out = call(fold(q), fold(k), fold(v), r.transpose(0, 1).reshape(-1, B * H, D), None,
                   masked, u.repeat(B, 1), vb.repeat(B, 1), None)
        return out.reshape(Lq, B, H, D).transpose(0, 1)

    def _attend_context_parallel(self, q, k, v, p, u, vb, kpm, attn_mask, window, zero_triu,
                                 drop) -> Tensor:
        """The ring over ``cp_group``: q / k / v this rank's frames, ``p`` the projected table
        of the global ``2T - 1`` distances (bidirectional, no cache)."""
        from ..distributed import context_parallel_rel_attention

        if attn_mask is not None or zero_triu or p.shape[0] != 1:
            raise ValueError(f"{self._NAME}: with cp_group only key padding and "
                             f"att_context_size masks, one position table for the batch and "
                             f"no zero_triu are supported")
        return context_parallel_rel_attention(
            q, k, v, p[0], u, vb, group=self.cp_group, layout="contiguous", causal=False,
            window_size=window, key_padding_mask=kpm, softmax_scale=1.0 / self.s_d_k,
            dropout_p=drop, backend=self.backend)

    def _finish(self, out: Tensor, query_pad: Optional[Tensor],
                spare: Optional[Tensor] = None, owned: bool = False) -> Tensor:
        """``linear_out`` of the attention output ``[B, Lq, H, D]`` with the rows of padded
        queries (``query_pad``) zeroed first. ``spare``: a ``[B, Lq, n_feat]`` tensor no
        longer needed (a freed projection) that receives the result in inference, where a
        fresh one would cost its page faults. ``owned``: out is a view of the module's own
        buffer (the query projection the attention wrote over), zeroed in place too."""
        B, Lq = out.shape[0], out.shape[1]
        if query_pad is not None:
            tracing = _tracing()
            if not tracing and query_pad.device.type == "cpu" and not bool(query_pad.any()):
                pass  # no padded query row: no pass over out (a CPU check, no device sync)
            elif out.requires_grad or (out._base is not None and not owned) or tracing:
                out = out.masked_fill(query_pad[:, :, None, None], 0.0)
            else:  # the attention's own output and no graph (inference): no [B, T, H, D] copy
                out.masked_fill_(query_pad[:, :, None, None], 0.0)
        x = out.reshape(B, Lq, self.n_feat)
        lin = self.linear_out
        if (spare is None or torch.is_grad_enabled() or _tracing() or spare.shape != x.shape
                or spare.dtype != x.dtype or not spare.is_contiguous()
                or lin.weight.dtype != x.dtype):
            return lin(x)
        y = spare.view(B * Lq, self.n_feat)
        if lin.bias is None:
            torch.mm(x.view(B * Lq, -1), lin.weight.t(), out=y)
        else:
            torch.addmm(lin.bias, x.view(B * Lq, -1), lin.weight.t(), out=y)
        return spare

    def extra_repr(self) -> str:
        return f"n_head={self.h}, n_feat={self.n_feat}, backend={self.backend!r}"


def window_position_rows(lq: int, lk: int,
                         window: Tuple[int, int]) -> Optional[Tuple[int, int]]:
    """The rows ``(lo, hi)`` of a ``2Lk - 1`` row table (row ``m`` = distance ``Lk - 1 - m``)
    that the pairs allowed by ``window`` = ``(left, right)`` read, when fewer than the
    ``Lk + Lq - 1`` the whole square reads; else None (no window, or no pair allowed)."""
    d_min, d_max = allowed_distances(lq, lk, *window)
    if d_min > d_max or d_max - d_min + 1 >= lk + lq - 1:
        return None
    return lk - 1 - d_max, lk - 1 - d_min


def _fixed_graph() -> bool:
    """Whether a graph meant for other lengths is being recorded from this call's values (ONNX,
    torch.jit.trace, torch.export): no branch or slice bound may then follow the lengths.
    torch.compile is not one: it guards on what the code reads and recompiles when that
    changes."""
    return onnx_exporting() or torch.jit.is_tracing() or torch.compiler.is_exporting()


def _tracing() -> bool:
    """Whether a graph is being recorded (ONNX, torch.jit.trace, torch.export, torch.compile):
    then no in-place updates of the attention's output."""
    return _fixed_graph() or torch.compiler.is_compiling()


class NeMoRelPositionMultiHeadAttention(RelPosAttentionBase):
    """Drop-in for NeMo's ``RelPositionMultiHeadAttention`` (Conformer / FastConformer
    ``self_attention_model="rel_pos"``), computed by ``txl_kernels.rel_attention``.

    Args:
        n_head, n_feat, dropout_rate: as in NeMo (dropout on the attention probabilities).
        pos_bias_u, pos_bias_v: shared ``[H, D]`` parameters (the encoder's, with
            ``untie_biases=False``), or None: the module then owns zero-initialised ones.
        max_cache_len: kept as ``_max_cache_len``, as in NeMo.
        use_bias: bias on linear_q/k/v/out (no bias keys in the state dict when False).
        use_pytorch_sdpa, use_pytorch_sdpa_backends: accepted for signature compatibility and
            ignored (the attention always runs through ``rel_attention``).
        att_context_size: optional ``[left, right]`` limited context (NeMo's
            ``att_context_size``, -1 = unlimited): passed to the kernel as ``window_size``, so
            the band needs no dense mask. Applied on top of any mask given to ``forward``.
            Can be changed later through the ``att_context_size`` attribute.
        att_context_style: ``"regular"`` (a band). ``"chunked_limited"`` is a band only when
            the right context is -1; otherwise it is not a window, so leave
            ``att_context_size`` None and pass the encoder's dense mask.
        backend: ``rel_attention`` backend: ``"auto"``, ``"reference"`` or ``"triton"``.

    ``forward(query, key, value, mask, pos_emb, cache=None, *, key_padding_mask=None,
    lengths=None)``:
        query ``[B, T, n_feat]``, key / value ``[B, K, n_feat]``.
        mask: bool, True = masked, one of
            - ``(B, T, K)`` (also ``(1, T, K)``): NeMo's dense mask, applied as ``attn_mask``;
            - ``(B, 1, K)``: key padding by shape: passed as ``key_padding_mask``;
            - ``(B, K)``: key padding of the whole sequence, as NeMo's encoder builds it: keys
              are masked and so are the queries of padded frames (query ``i`` is key
              ``K - T + i``), whose rows give 0 like in NeMo's dense mask;
            - None.
        pos_emb: ``(1 or B, 2K - 1, n_feat)``, from distance ``K - 1`` down to ``-(K - 1)``
            (NeMo's ``RelPositionalEncoding(x, cache_len)``). A ``B``-row table that is not an
            expanded view runs the sequences one by one (under ``torch.export`` with a
            dynamic batch: the first table for all, checked equal to the others when the
            program runs).
        cache: optional ``[B, C, n_feat]``; then, as in NeMo's ``update_cache``, keys and
            values are both ``cat(cache, key)`` (``value`` is not used), ``K = C + T``, and the
            return value is ``(out, new_cache)`` with ``new_cache = cat(cache[:, keep:],
            query[:, :keep])``, ``keep = T - cache_drop_size``.
        key_padding_mask: optional bool ``[B, K]`` (True = padded), or lengths: optional
            integer ``[B]`` valid frames of the current segment (cached keys count as valid).
            Same meaning as a ``(B, K)`` mask (padded queries give 0); combined with ``mask``.
            Pass ``mask=None`` with these and ``att_context_size`` to read no dense mask.

    Rows whose keys are all masked give 0 before ``linear_out`` (NeMo sets masked
    probabilities to 0). ``self.cache_drop_size`` defaults to 0; NeMo's
    ``setup_streaming_params`` sets it on its own classes only, so set it on this module too
    (:func:`swap_rel_pos_attention` copies it). Under fp16 autocast NeMo runs its attention
    in bf16 (fp32 where bf16 is unsupported); this module computes in the autocast dtype, fp16
    included (the scores accumulate in fp32).
    """

    _NAME = "NeMoRelPositionMultiHeadAttention"

    def __init__(self, n_head: int, n_feat: int, dropout_rate: float,
                 pos_bias_u: Optional[nn.Parameter] = None,
                 pos_bias_v: Optional[nn.Parameter] = None, max_cache_len: int = 0,
                 use_bias: bool = True, use_pytorch_sdpa: bool = False,
                 use_pytorch_sdpa_backends=None, att_context_size: Optional[Sequence[int]] = None,
                 att_context_style: str = "regular", backend: str = "auto"):
        super().__init__()
        self._init_nemo(n_head, n_feat, dropout_rate, pos_bias_u, pos_bias_v, max_cache_len,
                        use_bias, backend)
        if att_context_style not in ("regular", "chunked_limited"):
            raise ValueError(f"{self._NAME}: att_context_style must be 'regular' or "
                             f"'chunked_limited', got {att_context_style!r}")
        self.att_context_style = att_context_style
        self.att_context_size = att_context_size

    @property
    def att_context_size(self) -> Optional[List[int]]:
        return None if self._window == (-1, -1) else list(self._window)

    @att_context_size.setter
    def att_context_size(self, value) -> None:
        if value is None:
            self._window = (-1, -1)
            return
        ok = (isinstance(value, (list, tuple)) and len(value) == 2
              and all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in value))
        if not ok:
            raise ValueError(f"{self._NAME}: att_context_size must be [left, right] ints >= -1 "
                             f"(-1 = unlimited), got {value!r}")
        if self.att_context_style == "chunked_limited" and value[1] != -1:
            raise ValueError(
                f"{self._NAME}: att_context_style='chunked_limited' with right context "
                f"{value[1]} is not a band; leave att_context_size None and pass the encoder's "
                f"dense mask instead")
        self._window = (int(value[0]), int(value[1]))

    def _mask_args(self, mask, batch: int, qlen: int, klen: int):
        """-> (key padding [B, K] or None, dense [B|1, 1, T, K] or None, query padding or None)."""
        if mask is None:
            return None, None, None
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = f"dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"{self._NAME}: mask must be a bool tensor (True = masked), got {got}")
        shape = tuple(mask.shape)
        if mask.dim() == 2 and shape == (batch, klen):
            return mask, None, mask[:, klen - qlen:]
        if mask.dim() == 3 and shape[0] in (1, batch) and shape[2] == klen:
            if shape[1] == 1:
                return mask[:, 0].expand(batch, klen), None, None
            if shape[1] == qlen:
                return None, mask.unsqueeze(1), None
        raise ValueError(f"{self._NAME}: mask must be (B, T, K) = ({batch}, {qlen}, {klen}), "
                         f"(B, 1, K) or (B, K) with True = masked (K = keys, cache included); "
                         f"got {list(shape)}")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor],
                pos_emb: Tensor, cache: Optional[Tensor] = None, *,
                key_padding_mask: Optional[Tensor] = None, lengths: Optional[Tensor] = None):
        self._check_seq("query", query)
        B, T = query.shape[0], query.shape[1]
        self._check_seq("key", key, B)
        key, value, new_cache = self._update_cache(query, key, value, cache)
        if cache is None:
            if value.shape[1] != key.shape[1]:
                raise ValueError(f"{self._NAME}: value must have key's length {key.shape[1]}, "
                                 f"got {list(value.shape)}")
        K = key.shape[1]
        if K < T:
            raise ValueError(f"{self._NAME}: need at least as many keys as queries, got "
                             f"query {list(query.shape)} and keys {list(key.shape)}")
        hint = (f" (K = cache {cache.shape[1]} + time {T})" if cache is not None else "")
        if self.cp_group is not None:
            if cache is not None or lengths is not None or K != T:
                raise ValueError(f"{self._NAME}: with cp_group each rank passes its slice of "
                                 f"the frames as query, key and value, with no cache and no "
                                 f"lengths (pass its slice of a (B, T) padding mask)")
            self._check_global_pos_emb(pos_emb, B, T, query.device)
        else:
            self._check_pos_emb(pos_emb, B, K, hint)
        kpm, dense, qpad = self._mask_args(mask, B, T, K)
        extra = self._padding_args(key_padding_mask, lengths, B, T, K, query.device)
        if extra is not None:
            kpm = extra if kpm is None else kpm | extra
            extra_q = extra[:, K - T:]
            qpad = extra_q if qpad is None else qpad | extra_q
        out = self._attend(query, key, value, pos_emb, kpm, dense, self._window)
        out = self._finish(out, qpad)
        return out if cache is None else (out, new_cache)

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "NeMoRelPositionMultiHeadAttention":
        """Wrap a NeMo ``RelPositionMultiHeadAttention``: the new module shares its linear
        layers and biases (same Parameter objects, nothing copied) and copies
        ``_max_cache_len``, ``cache_drop_size``, dropout and training mode. ``kwargs`` go to
        the constructor (``backend``, ``att_context_size``, ...)."""
        n_feat = module.linear_q.in_features
        with torch.device("meta"):
            new = cls(module.h, n_feat, module.dropout.p, module.pos_bias_u, module.pos_bias_v,
                      max_cache_len=getattr(module, "_max_cache_len", 0),
                      use_bias=module.linear_q.bias is not None, **kwargs)
        new.cache_drop_size = getattr(module, "cache_drop_size", None) or 0
        return adopt(new, module, ("linear_q", "linear_k", "linear_v", "linear_out",
                                   "linear_pos"))


def nemo_local_position_rows(left: int, right: int) -> List[Optional[int]]:
    """Which row of the ``left + right + 1``-row position table (distances ``left`` down to
    ``-right``, NeMo's ``LocalAttRelPositionalEncoding``) NeMo's
    ``RelPositionMultiHeadAttentionLongformer`` adds to the scores of each distance ``d =
    left, left - 1, ..., -right`` (None: no position term).

    NeMo's band has ``2w + 1`` columns, ``w = max(left, right)``, column ``c`` holding distance
    ``w - c``; it adds table rows ``0 .. left - 1`` to columns ``0 .. left - 1`` and rows
    ``left .. left + right`` to the last ``right + 1`` columns. That is row ``left - d`` for
    every ``d`` when ``left == right``; otherwise the columns are offset by ``w - left`` or
    ``w - right``, so some distances read another distance's row and some none.
    """
    w = max(left, right)
    rows: List[Optional[int]] = []
    for d in range(left, -right - 1, -1):
        c = w - d
        if c < left:
            rows.append(c)
        elif c >= 2 * w - right:
            rows.append(left + c - (2 * w - right))
        else:
            rows.append(None)
    return rows


class NeMoRelPositionMultiHeadAttentionLongformer(RelPosAttentionBase):
    """Drop-in for NeMo's ``RelPositionMultiHeadAttentionLongformer`` (Conformer /
    FastConformer ``self_attention_model="rel_pos_local_attn"``, also after
    ``change_attention_model("rel_pos_local_attn", [left, right])``): local attention over
    ``att_context_size = [left, right]`` with global tokens, computed by
    ``txl_kernels.rel_attention`` in O(T x (left + right + G)) time and memory.

    Args:
        n_head, n_feat, dropout_rate, pos_bias_u, pos_bias_v, max_cache_len, use_bias: as in
            :class:`NeMoRelPositionMultiHeadAttention`.
        att_context_size: ``[left, right]``, ints >= 0, not both 0 (NeMo's local context;
            ``-1`` is not allowed here, as in NeMo). Passed to the kernel as ``window_size``.
        global_tokens, global_tokens_spacing: the frames ``0, s, 2s, ...`` of the first
            ``global_tokens * s`` are global (``s`` = spacing): every query also attends
            them, and they attend every frame.
        global_attn_separate: separate ``global_q`` / ``global_k`` / ``global_v`` projections
            (state dict keys as in NeMo) for the global scores and the global rows.
        use_pytorch_sdpa, use_pytorch_sdpa_backends: accepted and ignored (NeMo's class
            refuses ``use_pytorch_sdpa=True``).
        backend: ``rel_attention`` backend.

    ``forward(query, key, value, pad_mask, pos_emb, cache=None)``:
        query / key / value ``[B, T, n_feat]`` (one length). pad_mask: bool ``(B, T)``, True =
        padded (NeMo's encoder passes it), or None. pos_emb: ``(1 or B, left + right + 1,
        n_feat)``, distances ``left`` down to ``-right`` (``LocalAttRelPositionalEncoding``).
        cache: as in NeMo only an empty ``(B, 0, n_feat)`` one runs (NeMo asserts equal query
        and key lengths); then keys and values are ``key`` and the return value is
        ``(out, query[:, :T - cache_drop_size])``.

    What it computes, as NeMo's class does: the relative scores with both biases over the
    window ``-right <= i - j <= left`` and unpadded keys; the position term as NeMo places it
    (:func:`nemo_local_position_rows`: each distance its own row only when ``left ==
    right``); the global keys scored ``global_q_i . global_k_g / sqrt(d_k)`` (no bias, no
    position term, padded ones included) in the same softmax, with the values of ``v``
    (``linear_v``, also with ``global_attn_separate``), passed as ``rel_attention``'s extra
    keys; padded query rows 0; then the rows of the global frames (padded ones too) replaced
    by a softmax over every unpadded key of ``global_q . global_k / sqrt(d_k)`` weighting
    ``global_v``. NeMo pads T to a multiple of ``2 max(left, right)`` and forms ``(B, H, T,
    2w + 1)`` scores; this module does neither.
    """

    _NAME = "NeMoRelPositionMultiHeadAttentionLongformer"

    def __init__(self, n_head: int, n_feat: int, dropout_rate: float,
                 pos_bias_u: Optional[nn.Parameter], pos_bias_v: Optional[nn.Parameter],
                 att_context_size: Sequence[int], max_cache_len: int = 0,
                 global_tokens: int = 0, global_tokens_spacing: int = 1,
                 global_attn_separate: bool = False, use_bias: bool = True,
                 use_pytorch_sdpa: bool = False, use_pytorch_sdpa_backends=None,
                 backend: str = "auto"):
        super().__init__()
        self._init_nemo(n_head, n_feat, dropout_rate, pos_bias_u, pos_bias_v, max_cache_len,
                        use_bias, backend)
        self.att_context_size = att_context_size
        for name, value, low in (("global_tokens", global_tokens, 0),
                                 ("global_tokens_spacing", global_tokens_spacing, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{self._NAME}: {name} must be an int >= {low}, got {value!r}")
        self.global_tokens = global_tokens
        self.global_tokens_spacing = global_tokens_spacing
        self.global_attn_separate = bool(global_attn_separate)
        if self.global_attn_separate:
            self.global_q = nn.Linear(n_feat, n_feat, bias=use_bias)
            self.global_k = nn.Linear(n_feat, n_feat, bias=use_bias)
            self.global_v = nn.Linear(n_feat, n_feat, bias=use_bias)

    @property
    def att_context_size(self) -> List[int]:
        return list(self._window)

    @att_context_size.setter
    def att_context_size(self, value) -> None:
        ok = (isinstance(value, (list, tuple)) and len(value) == 2
              and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
              and max(value) > 0)
        if not ok:
            raise ValueError(f"{self._NAME}: att_context_size must be [left, right], ints >= 0 "
                             f"and not both 0 (a window of left + right + 1 > 1 frames), got "
                             f"{value!r}")
        self._window = (int(value[0]), int(value[1]))

    def _global_slice(self, T: int) -> slice:
        """The global frames ``0, s, 2s, ...`` of the first ``global_tokens * s``, as a slice."""
        s = self.global_tokens_spacing
        return slice(0, min(self.global_tokens * s, T), s)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, pad_mask: Optional[Tensor],
                pos_emb: Tensor, cache: Optional[Tensor] = None):
        self._check_seq("query", query)
        B, T = query.shape[0], query.shape[1]
        self._check_seq("key", key, B)
        if cache is not None and (not isinstance(cache, Tensor) or cache.dim() != 3
                                  or cache.shape[1] != 0):
            raise ValueError(
                f"{self._NAME}: cache must be empty, (B, 0, n_feat): NeMo's "
                f"RelPositionMultiHeadAttentionLongformer attends within the current frames "
                f"only (it asserts equal query and key lengths); got {describe(cache)}")
        key, value, new_cache = self._update_cache(query, key, value, cache)
        for name, t in (("key", key), ("value", value)):
            if t.shape[1] != T:
                raise ValueError(f"{self._NAME}: {name} must have the query's length T={T} "
                                 f"(local attention within one sequence), got {list(t.shape)}")
        if self.cp_group is not None:
            raise ValueError(f"{self._NAME}: context parallelism (cp_group) is not supported")
        left, right = self._window
        if pad_mask is not None and (not isinstance(pad_mask, Tensor)
                                     or pad_mask.dtype != torch.bool
                                     or tuple(pad_mask.shape) != (B, T)):
            raise ValueError(f"{self._NAME}: pad_mask must be a bool tensor (B, T) = ({B}, {T}), "
                             f"True = padded frame, or None; got {describe(pad_mask)}")
        n_pos = left + right + 1
        if not isinstance(pos_emb, Tensor) or pos_emb.dim() != 3 \
                or pos_emb.shape[0] not in (1, B) or tuple(pos_emb.shape[1:]) != (n_pos,
                                                                                   self.n_feat):
            raise ValueError(
                f"{self._NAME}: pos_emb must be (1 or B={B}, left + right + 1 = {n_pos}, "
                f"n_feat={self.n_feat}) for att_context_size [{left}, {right}], distances "
                f"{left} down to {-right} (LocalAttRelPositionalEncoding); got "
                f"{describe(pos_emb)}")
        out, qpad, glob_rows, spare, owned = self._local_attention(query, key, value, pad_mask,
                                                                   pos_emb)
        out = self._finish(out, qpad, spare, owned)
        del spare
        if glob_rows is not None:
            # the global frames' rows replace theirs after linear_out (it works row by row):
            # in place on linear_out's result, which no backward keeps, rather than on the
            # attention output, which the kernel's and linear_out's backward both keep
            rows, grows = glob_rows
            grows = self.linear_out(grows.reshape(*grows.shape[:2], self.n_feat))
            if _tracing():
                out = out.index_copy(1, rows, grows)
            else:
                out.index_copy_(1, rows, grows)
        return out if cache is None else (out, new_cache)

    def _local_attention(self, query: Tensor, key: Tensor, value: Tensor,
                         pad_mask: Optional[Tensor], pos_emb: Tensor):
        """The attention output ``[B, T, H, D]`` before ``linear_out``, the query rows to
        zero, the global frames' ``(rows, [B, G, H, D] rows)`` (or None), in inference the
        key projection ``[B, T, n_feat]`` as ``_finish``'s spare (else None), and whether the
        output was written over the query projection (inference). A method of its own so
        that the other projections are freed on return, before ``linear_out`` runs
        (inference keeps 4, not 6, ``[B, T, n_feat]`` tensors at its peak)."""
        T = query.shape[1]
        left, right = self._window
        tracing = _tracing()
        if (pad_mask is not None and not tracing and pad_mask.device.type == "cpu"
                and not bool(pad_mask.any())):
            pad_mask = None  # no padded frame (a CPU check): no padding masks, no rows to zero
        q = self._project(self.linear_q, query)
        k = self._project(self.linear_k, key)
        v = self._project(self.linear_v, value)
        if pos_emb.shape[0] > 1 and pos_emb.stride(0) == 0:
            pos_emb = pos_emb[:1]  # an expanded table: project one copy
        r = self._position_table(self._project(self.linear_pos, pos_emb))
        extra = {}
        glob = self._global_slice(T)
        if glob.stop > 0:
            if self.global_attn_separate:
                gq = self._project(self.global_q, query)
                gk = self._project(self.global_k, key)
                gv = self._project(self.global_v, value)
            else:
                gq, gk, gv = q, k, v
            extra = dict(extra_q=gq, extra_k=gk[:, glob], extra_v=v[:, glob])
        qpad, glob_rows = pad_mask, None
        if glob.stop > 0:
            # before the kernel: the backward (latest first) then runs the kernel's first,
            # and these rows' k / v / q-sized gradients join its dq / dk / dv after it, rather
            # than waiting through its peak
            rows = torch.arange(glob.start, glob.stop, glob.step, device=q.device)
            glob_rows = (rows, self._global_rows(gq[:, glob], gk, gv, pad_mask))
            if qpad is not None:
                qpad = qpad.index_fill(1, rows, 0)  # global rows stay, padded or not (0: False)
        inference = not torch.is_grad_enabled() and not tracing
        if inference and q.is_contiguous() and r.shape[0] == 1:
            extra["out"] = q  # the attention's rows written over q's (its buffer: owned)
        out = self._rel_attention(q, k, v, r, pad_mask, None, (left, right),
                                  r_first_distance=left, **extra)
        spare = k.view(*k.shape[:2], self.n_feat) if inference and k.is_contiguous() else None
        return out, qpad, glob_rows, spare, "out" in extra

    def _position_table(self, p: Tensor) -> Tensor:
        """The rows of the projected table ``p`` ``[1 or B, left + right + 1, H, D]`` that NeMo
        adds for distances ``left .. -right`` (:func:`nemo_local_position_rows`; zero where
        it adds none): ``p`` itself when ``left == right``."""
        rows = nemo_local_position_rows(*self._window)
        if rows == list(range(len(rows))):
            return p
        zero = p.shape[1]
        index = torch.tensor([zero if i is None else i for i in rows], device=p.device)
        return torch.cat([p, p.new_zeros(p[:, :1].shape)], 1).index_select(1, index)

    def _global_rows(self, gq: Tensor, gk: Tensor, gv: Tensor,
                     pad_mask: Optional[Tensor]) -> Tensor:
        """The global frames' rows ``[B, G, H, D]``: softmax over the unpadded keys of
        ``global_q . global_k / sqrt(d_k)``, weighting ``global_v`` (NeMo fills padded keys
        with the dtype's lowest value, so a sequence with no unpadded key averages them all).

        The queries are laid out as NeMo lays them out: it views the ``[B, G, H, D]`` global
        queries as ``transpose(0, 1).reshape(B * H, G, D)`` against keys ``[B * H, T, D]``,
        so for ``G > 1`` the row of global frame ``g`` in head ``h`` is scored with another
        (frame, head)'s query vector. Reproduced here (the identity for ``G = 1``)."""
        B, G, H, D = gq.shape
        gq = gq.transpose(0, 1).reshape(B, H, G, D).transpose(1, 2)
        s = torch.einsum("bghd,bjhd->bhgj", gq / self.s_d_k, gk)
        if pad_mask is not None:
            s = s.masked_fill(pad_mask[:, None, None, :], torch.finfo(s.dtype).min)
        prob = self.dropout(torch.softmax(s, dim=-1))
        return torch.einsum("bhgj,bjhd->bghd", prob, gv)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, att_context_size={self.att_context_size}, "
                f"global_tokens={self.global_tokens}, "
                f"global_tokens_spacing={self.global_tokens_spacing}, "
                f"global_attn_separate={self.global_attn_separate}")

    @classmethod
    def from_module(cls, module: nn.Module,
                    **kwargs) -> "NeMoRelPositionMultiHeadAttentionLongformer":
        """Wrap a NeMo ``RelPositionMultiHeadAttentionLongformer``: the new module shares its
        linear layers (the global ones too) and biases (same Parameter objects) and copies
        ``att_context_size``, the global-token settings, ``_max_cache_len``,
        ``cache_drop_size``, dropout and training mode. ``kwargs`` go to the constructor
        (``backend``)."""
        n_feat = module.linear_q.in_features
        separate = bool(getattr(module, "global_attn_separate", False))
        with torch.device("meta"):
            new = cls(module.h, n_feat, module.dropout.p, module.pos_bias_u, module.pos_bias_v,
                      list(module.att_context_size),
                      max_cache_len=getattr(module, "_max_cache_len", 0),
                      global_tokens=module.global_tokens,
                      global_tokens_spacing=module.global_tokens_spacing,
                      global_attn_separate=separate,
                      use_bias=module.linear_q.bias is not None, **kwargs)
        new.cache_drop_size = getattr(module, "cache_drop_size", None) or 0
        names = ("linear_q", "linear_k", "linear_v", "linear_out", "linear_pos")
        if separate:
            names += ("global_q", "global_k", "global_v")
        return adopt(new, module, names)


class ESPnetRelPositionMultiHeadedAttention(RelPosAttentionBase):
    """Drop-in for ESPnet's current ``RelPositionMultiHeadedAttention`` (``rel_pos_type=
    "latest"``; not ``LegacyRelPositionMultiHeadedAttention``), computed by
    ``txl_kernels.rel_attention``.

    Args:
        n_head, n_feat, dropout_rate, zero_triu: as in ESPnet (``zero_triu`` zeroes the
            position term of pairs with key after query).
        backend: ``rel_attention`` backend: ``"auto"``, ``"reference"`` or ``"triton"``.

    ``forward(query, key, value, pos_emb, mask=None, *, key_padding_mask=None, lengths=None)``:
        query ``[B, T, n_feat]``, key / value ``[B, K, n_feat]`` with ``K >= T``: the queries
        are the last ``T`` of the ``K`` frames, as in ESPnet, whose rel_shift reads column
        ``j - i + T - 1`` (e.g. its ``EncoderLayer`` cache path calls ``forward(x[:, -1:], x,
        x, pos_emb, mask)``; usually ``K = T``). pos_emb ``(1 or B, 2K - 1, n_feat)`` from
        distance ``K - 1`` down to ``-(K - 1)`` (ESPnet's ``RelPositionalEncoding`` of the
        keys). mask True = keep (bool or integer, as ESPnet's ``mask.eq(0)``): ``(B, 1, K)``
        is key padding (passed as ``key_padding_mask``, no dense mask), ``(B, T, K)`` is
        applied densely; or None. key_padding_mask (bool ``[B, K]``, True = padded) / lengths
        (integer ``[B]``, valid frames of the ``K`` keys) are alternatives to a ``(B, 1, K)``
        mask, with ``rel_attention``'s polarity.

    Rows whose keys are all masked give 0 before ``linear_out``. ``self.attn`` stays None
    (the probabilities are never materialised on the fused path).
    """

    _NAME = "ESPnetRelPositionMultiHeadedAttention"

    def __init__(self, n_head: int, n_feat: int, dropout_rate: float, zero_triu: bool = False,
                 backend: str = "auto"):
        super().__init__()
        self._init_common(n_head, n_feat, dropout_rate, True, backend)
        self.attn = None
        self.zero_triu = zero_triu
        self.pos_bias_u = nn.Parameter(torch.empty(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(self.h, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def _mask_args(self, mask, batch: int, qlen: int, klen: int):
        """-> (key padding [B, K] or None, dense [B|1, 1, T, K] or None), True = masked."""
        if mask is None:
            return None, None
        if not isinstance(mask, Tensor) or mask.is_floating_point() or mask.is_complex():
            got = f"dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"{self._NAME}: mask must be a bool or integer tensor "
                            f"(True / nonzero = keep), got {got}")
        shape = tuple(mask.shape)
        if mask.dim() == 3 and shape[0] in (1, batch) and shape[2] == klen:
            masked = ~mask if mask.dtype == torch.bool else mask.eq(0)
            if shape[1] == 1:
                return masked[:, 0].expand(batch, klen), None
            if shape[1] == qlen:
                return None, masked.unsqueeze(1)
        raise ValueError(f"{self._NAME}: mask must be (B, 1, K) or (B, T, K) with B={batch}, "
                         f"T={qlen} queries, K={klen} keys, True = keep; got {list(shape)}")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, pos_emb: Tensor,
                mask: Optional[Tensor] = None, *, key_padding_mask: Optional[Tensor] = None,
                lengths: Optional[Tensor] = None) -> Tensor:
        self._check_seq("query", query)
        B, T = query.shape[0], query.shape[1]
        self._check_seq("key", key, B)
        self._check_seq("value", value, B)
        K = key.shape[1]
        if value.shape[1] != K or K < T:
            raise ValueError(f"{self._NAME}: key and value must have one length K >= the "
                             f"query's T={T} (the last T of the K frames are the queries), "
                             f"got key {list(key.shape)}, value {list(value.shape)}")
        self._check_pos_emb(pos_emb, B, K, "")
        kpm, dense = self._mask_args(mask, B, T, K)
        # lengths count valid frames of the K keys (the (B, 1, K) mask's meaning)
        extra = self._padding_args(key_padding_mask, lengths, B, K, K, query.device)
        if extra is not None:
            kpm = extra if kpm is None else kpm | extra
        out = self._attend(query, key, value, pos_emb, kpm, dense, (-1, -1),
                           zero_triu=self.zero_triu)
        return self._finish(out, None)

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "ESPnetRelPositionMultiHeadedAttention":
        """Wrap an ESPnet ``RelPositionMultiHeadedAttention``: the new module shares its
        parameters (same Parameter objects) and copies zero_triu, dropout and training mode.
        ``kwargs`` go to the constructor (``backend``)."""
        n_feat = module.linear_q.in_features
        with torch.device("meta"):
            new = cls(module.h, n_feat, module.dropout.p,
                      zero_triu=getattr(module, "zero_triu", False), **kwargs)
        return adopt(new, module, ("linear_q", "linear_k", "linear_v", "linear_out",
                                   "linear_pos", "pos_bias_u", "pos_bias_v"))

