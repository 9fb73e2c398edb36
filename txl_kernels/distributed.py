"""Context parallelism: relative attention over a sequence split across ranks.

Each rank of a process group holds a shard of the sequence (its queries, their keys and values,
and its shard of a Transformer-XL memory) and gets its shard of the output, equal to
:func:`txl_kernels.rel_attention` on the whole sequence. Keys and values travel around the ring
of ranks (``torch.distributed`` point-to-point ops, posted before the current block is computed
so that the transfer overlaps it); partial outputs merge through the row log-sum-exp, as
split-K does. The backward sends the keys and values around the ring once more, together with
their gradient accumulators, which arrive back at their owner after the last step
(ring-flash-attn's scheme).

The position term needs no global table per block pair: for a query chunk starting at global
query ``a0`` and a key chunk starting at global key ``b0`` (memory first), the rows of ``r``
the pair reads are the contiguous window ``[b0 - (a0 + A - 1) + Lq - 1, ... + A + B - 1)``,
a function of the two offsets only; the masks use the global distance
``d = (a0 + i + M) - (b0 + j)`` (``M`` the global memory length).

Each chunk pair runs on a backend's block ops (docs/distributed.md): the fused Triton
kernels' or the C++ CPU kernel's registered forward (out, lse) and backward (given the
merged global out and lse), one call per box of the pair (:func:`_kernel_boxes`, with the
box's own window and rows of ``r``), or the einsum block math (``backend="reference"``, and
always with dropout).

Layouts (:func:`shard_sequence`): ``"contiguous"`` (rank ``i`` holds one contiguous slice; the
ranks' lengths may differ) and ``"zigzag"`` (the sequence in ``2P`` chunks, rank ``i`` holding
chunks ``i`` and ``2P - 1 - i``), which balances causal work across ranks.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._export import refuse_context_parallel
from ._block_ops import KernelOps, merge_block
from ._utils import (check_same, draw_dropout_seed, interpreting, last_dim_contiguous,
                     no_interpreter_reason, renamed_keywords)
from .functional import (check_deterministic, check_dropout_p, check_padding_mask,
                         check_position_rows, check_softmax_scale, check_tensor, check_window,
                         clamp_window, plan_call, scale_sign)
from .reference import finite_or_zero, in_window, relative_scores, weighted_values

__all__ = ["context_parallel_rel_attention", "shard_sequence", "unshard_sequence",
           "layout_chunks", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")
Chunk = Tuple[int, int, int]  # (global start, length, offset in the rank's local tensor)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def layout_chunks(total: int, rank: int, world_size: int, layout: str,
                  lengths: Optional[Sequence[int]] = None) -> List[Chunk]:
    """The chunks of a sequence of ``total`` rows that ``rank`` holds, as ``(global start,
    length, local offset)``. ``"zigzag"``: ``torch.tensor_split`` into ``2 * world_size``
    chunks (sizes differ by at most one), rank ``i`` holding chunks ``i`` and
    ``2 world_size - 1 - i``. ``"contiguous"``: ``lengths`` gives every rank's row count
    (default: ``torch.tensor_split`` into ``world_size`` slices)."""
    _check_layout(layout)
    if layout == "zigzag":
        n = 2 * world_size
        sizes = [total // n + (1 if c < total % n else 0) for c in range(n)]
        starts = [sum(sizes[:c]) for c in range(n)]
        picked = (rank, n - 1 - rank)
    else:
        if lengths is None:
            lengths = [total // world_size + (1 if c < total % world_size else 0)
                       for c in range(world_size)]
        sizes, starts, picked = list(lengths), [sum(lengths[:c]) for c in range(world_size)], (rank,)
    out, off = [], 0
    for c in picked:
        if sizes[c]:
            out.append((starts[c], sizes[c], off))
        off += sizes[c]
    return out


def shard_sequence(x: Tensor, dim: int, rank: int, world_size: int,
                   layout: str = "contiguous") -> Tensor:
    """The shard of ``x`` (the whole sequence along ``dim``) that ``rank`` holds in ``layout``."""
    parts = [x.narrow(dim, s, n) for s, n, _ in layout_chunks(x.shape[dim], rank, world_size,
                                                               layout)]
    if not parts:
        return x.narrow(dim, 0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard_sequence(shards: Sequence[Tensor], dim: int, layout: str = "contiguous") -> Tensor:
    """The whole sequence from every rank's shard (in rank order), inverse of
    :func:`shard_sequence`."""
    _check_layout(layout)
    if layout == "contiguous":
        return torch.cat(list(shards), dim)
    world = len(shards)
    total = sum(s.shape[dim] for s in shards)
    pieces = {}
    for rank, s in enumerate(shards):
        for start, n, off in layout_chunks(total, rank, world, layout):
            pieces[start] = s.narrow(dim, off, n)
    if not pieces:
        return shards[0].narrow(dim, 0, 0)
    return torch.cat([pieces[k] for k in sorted(pieces)], dim)


class _Problem:
    """The global geometry every rank agrees on: query and key chunks per rank."""

    def __init__(self, q_lens: List[int], m_lens: List[int], layout: str, rank: int,
                 has_kpm: bool = False):
        world = len(q_lens)
        self.world, self.rank, self.has_kpm = world, rank, has_kpm
        self.lq, self.mem = sum(q_lens), sum(m_lens)
        self.q_chunks = [layout_chunks(self.lq, i, world, layout, q_lens) for i in range(world)]
        # A rank's keys: its memory chunks (global key = memory row), then its segment chunks
        # (global key = M + query row), in the order its k / v hold them.
        self.k_chunks = []
        for i in range(world):
            mc = layout_chunks(self.mem, i, world, layout, m_lens)
            sc = [(self.mem + s, n, m_lens[i] + off) for s, n, off in self.q_chunks[i]]
            self.k_chunks.append(mc + sc)
        self.k_lens = [q + m for q, m in zip(q_lens, m_lens)]


def _pair_may_attend(a0: int, A: int, b0: int, Bk: int, mem: int, wl: int, wr: int) -> bool:
    """Whether any pair of the query chunk [a0, a0 + A) and the key chunk [b0, b0 + Bk) lies
    inside the window (causal: wr == 0); skipped pairs cost no compute."""
    d_min, d_max = a0 + mem - (b0 + Bk - 1), a0 + A - 1 + mem - b0
    return not ((wl >= 0 and d_min > wl) or (wr >= 0 and d_max < -wr))


def _window(a0: int, A: int, b0: int, Bk: int, prob: _Problem, R: int):
    """The rows of ``r`` a chunk pair reads: window start ``p0`` (``A + Bk - 1`` rows), the
    part ``[lo, hi)`` that exists, and the zero rows to pad above and below it."""
    W = A + Bk - 1
    p0 = b0 - (a0 + A - 1) + prob.lq - 1
    lo = min(max(p0, 0), R)
    hi = max(min(p0 + W, R), lo)
    top = min(max(lo - p0, 0), W)
    return lo, hi, top, W - top - (hi - lo)


def _block_scores(qc, kc, vc, r_rows, pad, u, vb, softmax_scale, a0, b0, prob: _Problem, wl, wr,
                  kpm_c):
    """Scaled scores ``[B, H, A, Bk]`` of one chunk pair (masked pairs at -inf), in the
    accumulation dtype, from the rows of ``r`` its window reads (zero rows padded around).
    As in the reference, the products take the finite part of k / r and a pair whose k, v
    (``vc``) or r row is not finite scores NaN (hidden by the mask where it is excluded)."""
    A, Bk = qc.shape[1], kc.shape[1]
    r_win = torch.nn.functional.pad(r_rows, (0, 0, 0, 0) + pad)
    s = relative_scores(qc, kc, vc, r_win, u, vb, softmax_scale)
    i = torch.arange(A, device=qc.device)[:, None] + (a0 + prob.mem)
    j = torch.arange(Bk, device=qc.device)[None, :] + b0
    allowed = in_window(i - j, wl, wr)[None, None] & ~kpm_c[:, None, None, :]
    return s.masked_fill(~allowed, float("-inf"))


class _Dropout:
    """Attention dropout with the one-process keep-mask: the fused kernels' mask is a function
    of global (b, h, i, j) and the (seed, offset) pair, so each chunk pair regenerates its
    block of it (``dropout_keep_block``), in the forward and again in the backward."""

    def __init__(self, p: float, seed: Optional[Tensor], B: int, H: int, lq: int, lk: int):
        self.p, self.seed, self.shape = p, seed, (B, H, lq, lk)

    def factor(self, a0: int, A: int, b0: int, Bk: int, dtype) -> Optional[Tensor]:
        """``keep`` times the kernels' scale (``dropout_keep_scale``, 1 / (1 - the rate they
        drop with)) for queries ``[a0, a0 + A)`` and keys ``[b0, b0 + Bk)``, or None without
        dropout."""
        if self.p == 0.0:
            return None
        from .ops._common import dropout_keep_block, dropout_keep_scale
        keep = dropout_keep_block(self.seed, *self.shape, self.p, (a0, A), (b0, Bk))
        return keep.to(dtype) * dropout_keep_scale(self.p)


def _kernel_boxes(a0: int, A: int, b0: int, Bk: int, mem: int, wl: int, wr: int):
    """The kernel calls of the chunk pair (queries ``[a0, a0 + A)``, keys ``[b0, b0 + Bk)``
    global, memory first): sub-rectangles ``(i_lo, i_hi, j_lo, j_hi)`` in the chunks' local
    rows / keys that together hold every pair the window allows, each the tight bounding box
    of its allowed pairs with no more rows than keys (the kernels need ``Lk >= Lq``).

    Tightness puts the box's bottom-right pair inside the window, so the box's own
    bottom-right aligned window bounds (:func:`_kernel_window`) are ``>= 0``: a negative bound
    would read as the kernels' unbounded sentinel. Query rows with no allowed key in the
    chunk are trimmed; a box with more rows than keys is split into boxes of at most as many
    rows as it has keys, each tightened again."""
    work, boxes = [(0, A)], []
    while work:
        i_lo, i_hi = work.pop()
        # query row i, at gi = a0 + i + mem in distance terms, sees keys [gi - wl, gi + wr]
        if wr >= 0:
            i_lo = max(i_lo, b0 - wr - a0 - mem)
        if wl >= 0:
            i_hi = min(i_hi, b0 + Bk + wl - a0 - mem)
        if i_lo >= i_hi:
            continue
        j_lo = 0 if wl < 0 else max(0, a0 + i_lo + mem - wl - b0)
        j_hi = Bk if wr < 0 else min(Bk, a0 + i_hi - 1 + mem + wr - b0 + 1)
        rows, keys = i_hi - i_lo, j_hi - j_lo
        if rows > keys:
            work.extend((s, min(s + keys, i_hi)) for s in range(i_lo, i_hi, keys))
        else:
            boxes.append((i_lo, i_hi, j_lo, j_hi))
    return sorted(boxes)


def _kernel_window(ga: int, n_i: int, gb: int, n_j: int, mem: int, wl: int, wr: int):
    """The kernels' (window_left, window_right) for global queries ``[ga, ga + n_i)`` and
    keys ``[gb, gb + n_j)``: their distance ``i + (n_j - n_i) - j`` is the global one less
    ``delta``. A bound that covers the whole box becomes -1 (unbounded: no checks)."""
    delta = (ga + mem) - gb - (n_j - n_i)
    kwl = -1 if wl < 0 or wl - delta >= n_j - 1 else wl - delta
    kwr = -1 if wr < 0 or wr + delta >= n_i - 1 else wr + delta
    assert (wl < 0 or wl - delta >= 0) and (wr < 0 or wr + delta >= 0), \
        (ga, n_i, gb, n_j, mem, wl, wr)  # _kernel_boxes' boxes keep both bounds >= 0
    return kwl, kwr


def _kernel_r(r: Tensor, ga: int, n_i: int, gb: int, n_j: int, lq: int):
    """The rows of ``r`` a kernel call reads, as the table it indexes from 0 (row
    ``j - i + n_i - 1``): global row ``s + p`` with ``s = gb - ga + lq - n_i``, zero rows
    padded above where ``s < 0`` (those serve no allowed pair). Returns (table, lo, top):
    the table's row ``top + t`` is ``r[lo + t]``, ``lo = max(s, 0)``."""
    s = gb - ga + lq - n_i
    lo, hi = max(s, 0), min(s + n_i + n_j - 1, r.shape[0])
    assert lo < hi, (ga, n_i, gb, n_j, lq, r.shape[0])
    top = lo - s
    rows = r[lo:hi]
    if top:
        rows = torch.cat([rows.new_zeros((top,) + tuple(r.shape[1:])), rows])
    return rows, lo, top


class _Ring:
    """Point-to-point exchange with the ring neighbours, recording the schedule if asked."""

    def __init__(self, group, schedule: Optional[list]):
        group = group if group is not None else dist.group.WORLD
        self.group, self.schedule = group, schedule
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def log(self, *event) -> None:
        if self.schedule is not None:
            self.schedule.append(event)

    def post(self, step: int, send: List[Tensor], recv_like: List[Tensor]):
        """Send ``send`` to the next rank and receive tensors shaped like ``recv_like`` from
        the previous one, asynchronously; ``wait`` on the result returns the received ones."""
        recv = [torch.empty_like(t) for t in recv_like]
        send = [t.contiguous() for t in send]  # kept alive until the sends complete
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        works = dist.batch_isend_irecv(ops)
        self.log("recv_posted", step)
        return works, recv, send

    def wait(self, step: int, pending) -> List[Tensor]:
        works, recv, _ = pending
        for w in works:
            w.wait()
        self.log("recv_done", step)
        return recv


def _like(t: Tensor, rows: int) -> Tensor:
    return t.new_empty((t.shape[0], rows) + tuple(t.shape[2:]))


def _step_pairs(prob: "_Problem", ring: "_Ring", step: int, src: int, wl: int, wr: int):
    """(a0, A, qoff, b0, Bk, koff) of every (query chunk, key chunk) pair of ring step ``step``
    (keys of rank ``src``) that the window / causal range lets attend; each pair is logged
    as a ``block`` or a ``skip`` (the schedule the tests read)."""
    for a0, A, qoff in prob.q_chunks[ring.rank]:
        for b0, Bk, koff in prob.k_chunks[src]:
            if not _pair_may_attend(a0, A, b0, Bk, prob.mem, wl, wr):
                ring.log("skip", step)
                continue
            ring.log("block", step)
            yield a0, A, qoff, b0, Bk, koff


def _boxes(a0: int, A: int, b0: int, Bk: int, prob: "_Problem", wl: int, wr: int):
    """The kernel calls of one chunk pair: (i_lo, i_hi, j_lo, j_hi) in the chunks, the global
    (first row, rows, first key, keys) and the kernel's (window_left, window_right)."""
    for i_lo, i_hi, j_lo, j_hi in _kernel_boxes(a0, A, b0, Bk, prob.mem, wl, wr):
        ga, n_i, gb, n_j = a0 + i_lo, i_hi - i_lo, b0 + j_lo, j_hi - j_lo
        yield (i_lo, i_hi, j_lo, j_hi), (ga, n_i, gb, n_j), _kernel_window(ga, n_i, gb, n_j,
                                                                             prob.mem, wl, wr)


def _ring_forward(q, k, v, kpm, r, u, vb, softmax_scale, wl, wr, prob: _Problem, ring: _Ring,
                  drop: _Dropout, ops: Optional[KernelOps]):
    B, Lq, H, D = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_zeros((B, Lq, H, D), dtype=acc)
    lse = q.new_full((B, H, Lq), float("-inf"), dtype=acc)
    cur = [k, v, kpm]
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        pending = None
        if step + 1 < ring.world:
            rows = prob.k_lens[(src - 1) % ring.world]
            pending = ring.post(step + 1, cur, [_like(k, rows), _like(v, rows),
                                                kpm.new_empty((B, rows))])
        ring.log("compute_begin", step)
        kb, vb_, kpmb = cur
        for a0, A, qoff, b0, Bk, koff in _step_pairs(prob, ring, step, src, wl, wr):
            qc = q[:, qoff:qoff + A]
            if ops is not None:
                for (i_lo, i_hi, j_lo, j_hi), (ga, n_i, gb, n_j), (kwl, kwr) in _boxes(
                        a0, A, b0, Bk, prob, wl, wr):
                    ks = slice(koff + j_lo, koff + j_hi)
                    rk = _kernel_r(r, ga, n_i, gb, n_j, prob.lq)[0]
                    o, blk_lse = ops.fwd(qc[:, i_lo:i_hi], kb[:, ks], vb_[:, ks], rk, u, vb,
                                         softmax_scale, kwl, kwr,
                                         kpmb[:, ks] if prob.has_kpm else None)
                    blk_lse = blk_lse.to(acc)  # rows with no key: +inf -> -inf here
                    blk_lse = blk_lse.masked_fill(blk_lse == float("inf"), float("-inf"))
                    merge_block(out, lse, qoff + i_lo, n_i, o.to(acc), blk_lse)
                continue
            lo, hi, top, bottom = _window(a0, A, b0, Bk, prob, r.shape[0])
            s = _block_scores(qc, kb[:, koff:koff + Bk], vb_[:, koff:koff + Bk], r[lo:hi],
                              (top, bottom), u, vb, softmax_scale, a0, b0, prob, wl, wr,
                              kpmb[:, koff:koff + Bk])
            blk_lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - finite_or_zero(blk_lse)[..., None])
            z = drop.factor(a0, A, b0, Bk, p.dtype)
            if z is not None:  # the lse stays that of the undropped scores
                p = p * z
            blk = weighted_values(p, vb_[:, koff:koff + Bk])
            merge_block(out, lse, qoff, A, blk, blk_lse)
        ring.log("compute_end", step)
        if pending is not None:
            cur = ring.wait(step + 1, pending)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, kpm, r, u, vb, out, lse, softmax_scale, wl, wr, prob: _Problem,
                   ring: _Ring, drop: _Dropout, ops: Optional[KernelOps]):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if ops is not None:
        # the kernels' backward from the global row lse and out (+inf: a row with no key)
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        lse_k = lse.masked_fill(~torch.isfinite(lse), float("inf")).to(ops.lse_dtype(q.dtype))
    else:
        dout_a = dout.to(acc)
        delta = (dout_a * out.to(acc)).sum(-1).transpose(1, 2)  # [B, H, Lq]
        lse_safe = finite_or_zero(lse)
    dq = torch.zeros_like(q, dtype=acc)
    dr = torch.zeros_like(r, dtype=acc)
    du = torch.zeros_like(u, dtype=acc)
    dvb = torch.zeros_like(vb, dtype=acc)
    keys = [k, v, kpm]
    # The keys' gradient accumulators travel with them and reach their owner after the last
    # step: at step s this rank holds the block of rank (rank - s).
    grads = [torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)]
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        rows = prob.k_lens[(src - 1) % ring.world]
        pending = None
        if step + 1 < ring.world:
            pending = ring.post(step + 1, keys, [_like(k, rows), _like(v, rows),
                                                 kpm.new_empty((k.shape[0], rows))])
        ring.log("compute_begin", step)
        kb, vblk, kpmb = keys
        dkb, dvblk = grads
        for a0, A, qoff, b0, Bk, koff in _step_pairs(prob, ring, step, src, wl, wr):
            if ops is not None:
                for (i_lo, i_hi, j_lo, j_hi), (ga, n_i, gb, n_j), (kwl, kwr) in _boxes(
                        a0, A, b0, Bk, prob, wl, wr):
                    qs = slice(qoff + i_lo, qoff + i_hi)
                    ks = slice(koff + j_lo, koff + j_hi)
                    rk, r_lo, top = _kernel_r(r, ga, n_i, gb, n_j, prob.lq)
                    gq, gk, gv, gr, gu, gvb = ops.bwd(
                        dout[:, qs], q[:, qs], kb[:, ks], vblk[:, ks], rk, u, vb,
                        out[:, qs], lse_k[:, :, qs], softmax_scale, kwl, kwr,
                        kpmb[:, ks] if prob.has_kpm else None)
                    dq[:, qs] += gq
                    dkb[:, ks] += gk
                    dvblk[:, ks] += gv
                    dr[r_lo:r_lo + gr.shape[0] - top] += gr[top:]
                    du += gu
                    dvb += gvb
                continue
            gq, gk, gv, gr, lo, hi, gu, gvb = _block_grads(
                q[:, qoff:qoff + A], kb[:, koff:koff + Bk], vblk[:, koff:koff + Bk], r, u,
                vb, softmax_scale, a0, b0, prob, wl, wr, kpmb[:, koff:koff + Bk],
                lse_safe[:, :, qoff:qoff + A], delta[:, :, qoff:qoff + A],
                dout_a[:, qoff:qoff + A], drop.factor(a0, A, b0, Bk, acc))
            dq[:, qoff:qoff + A] += gq
            dkb[:, koff:koff + Bk] += gk
            dvblk[:, koff:koff + Bk] += gv
            dr[lo:hi] += gr
            du += gu
            dvb += gvb
        ring.log("compute_end", step)
        if ring.world > 1:
            grads = ring.wait(step + 1, ring.post(step + 1, grads, [_like(dkb, rows),
                                                                    _like(dvblk, rows)]))
        if pending is not None:
            keys = ring.wait(step + 1, pending)
    dk, dv = grads
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dr.to(r.dtype), du.to(u.dtype),
            dvb.to(vb.dtype))


def _block_grads(qc, kc, vc, r, u, vb, softmax_scale, a0, b0, prob, wl, wr, kpm_c, lse_c, delta_c,
                 dout_c, z=None):
    """Gradients of one chunk pair's share of the output, given the final row log-sum-exp:
    ``dS = P * (Z * dO V^T - rowsum(dO * O))``, as autograd of the surrogate
    ``sum(dO * ((Z P) V)) - sum(delta * rowsum(P))`` with ``P = exp(S - lse)`` (lse, delta
    fixed) and ``Z`` the dropout factor ``keep / (1 - p)`` (1 without dropout): ``O`` is the
    dropped output, so ``rowsum(P * Z * dO V^T) = rowsum(dO * O)`` as without dropout.
    The gradient of ``r`` is returned for its rows ``[lo, hi)``."""
    lo, hi, top, bottom = _window(a0, qc.shape[1], b0, kc.shape[1], prob, r.shape[0])
    acc = torch.float64 if qc.dtype == torch.float64 else torch.float32
    with torch.enable_grad():
        leaves = [t.detach().to(acc).requires_grad_() for t in (qc, kc, vc, r[lo:hi], u, vb)]
        q_, k_, v_, rw_, u_, vb_ = leaves
        s = _block_scores(q_, k_, v_, rw_, (top, bottom), u_, vb_, softmax_scale, a0, b0, prob, wl,
                          wr, kpm_c)
        p = torch.exp(s - lse_c[..., None])
        pz = p if z is None else p * z
        o = weighted_values(pz, v_)
        loss = (dout_c * o).sum() - (delta_c * p.sum(-1)).sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    gq, gk, gv, gr, gu, gvb = (torch.zeros_like(t) if g is None else g
                               for g, t in zip(grads, leaves))
    return gq, gk, gv, gr, lo, hi, gu, gvb


class _ContextParallelRelAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, r, u, vb, kpm, softmax_scale, wl, wr, prob, ring, drop, ops):
        out, lse = _ring_forward(q, k, v, kpm, r, u, vb, softmax_scale, wl, wr, prob, ring, drop,
                                 ops)
        ctx.save_for_backward(q, k, v, kpm, r, u, vb, out, lse)
        ctx.args = (softmax_scale, wl, wr, prob, ring, drop, ops)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, kpm, r, u, vb, out, lse = ctx.saved_tensors
        grads = _ring_backward(dout, q, k, v, kpm, r, u, vb, out, lse, *ctx.args)
        return grads + (None,) * 8


def _check_args(name, q, k, v, r, r_w_bias, r_r_bias, mlen, layout, causal,
                window_size, key_padding_mask, softmax_scale, dropout_p, dropout_seed, backend,
                deterministic, r_first_distance=None):
    """Every check of :func:`context_parallel_rel_attention` that needs no communication:
    ``rel_attention``'s own (functional.py) for the tensors, softmax_scale, window, padding mask,
    dropout and flags, with this function's name, and the ring's shapes. Returns (window_left,
    window_right (causal folded in, not clamped to the global shapes), softmax_scale,
    dropout_p, kpm, the backend that computes the blocks)."""
    _check_layout(layout)
    if r_first_distance is not None:
        raise NotImplementedError(f"{name}: r_first_distance is not supported by the ring (its "
                                  f"blocks index the full table, row p = j - i + Lq - 1); pass "
                                  f"r_first_distance=None with that table, or use "
                                  f"rel_attention")
    for nm, t, nd, lay in (("q", q, 4, "[B, Lq_rank, H, D]"),
                           ("k", k, 4, "[B, mlen + Lq_rank, H, D]"),
                           ("v", v, 4, "[B, mlen + Lq_rank, H, D]"),
                           ("r", r, 3, "[R, H, D]"), ("r_w_bias", r_w_bias, 2, "[H, D]"),
                           ("r_r_bias", r_r_bias, 2, "[H, D]")):
        check_tensor(nm, t, nd, lay, name)
    for nm, t in (("k", k), ("v", v), ("r", r), ("r_w_bias", r_w_bias),
                  ("r_r_bias", r_r_bias)):
        check_same(name, nm, t, "q", q)
    check_deterministic(deterministic, name)
    B, Lq, H, D = q.shape
    if isinstance(mlen, bool) or not isinstance(mlen, int) or mlen < 0:
        raise ValueError(f"{name}: mlen must be an int >= 0, got {mlen!r}")
    want = (B, mlen + Lq, H, D)
    for nm, t in (("k", k), ("v", v)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: {nm} must be [B, mlen + Lq_rank, H, D] = "
                             f"{list(want)}, got {list(t.shape)}")
    if tuple(r.shape[1:]) != (H, D) or r.shape[0] < 1:
        raise ValueError(f"{name}: r must be [R, H, D] = [R, {H}, {D}] with R >= 1, "
                         f"got {list(r.shape)}")
    for nm, t in (("r_w_bias", r_w_bias), ("r_r_bias", r_r_bias)):
        if tuple(t.shape) != (H, D):
            raise ValueError(f"{name}: {nm} must be [H, D] = [{H}, {D}], got {list(t.shape)}")
    if key_padding_mask is not None:
        check_padding_mask(key_padding_mask, q, want[1], name,
                                "[B, mlen + Lq_rank]")
        kpm = key_padding_mask
    else:
        kpm = torch.zeros(want[:2], dtype=torch.bool, device=q.device)
    wl, wr = check_window(causal, window_size, name)
    softmax_scale = check_softmax_scale(softmax_scale, D, name)
    dropout_p = check_dropout_p(dropout_p, name)
    if dropout_p > 0.0 and q.device.type == "cpu" and not interpreting():
        raise RuntimeError(f"{name}: dropout_p > 0 on CPU makes the keep-mask with the Triton "
                           f"kernels' helper: {no_interpreter_reason()}")
    if dropout_p > 0.0 and dropout_seed is not None and (
            not isinstance(dropout_seed, Tensor) or dropout_seed.dtype != torch.int64
            or tuple(dropout_seed.shape) != (2,) or dropout_seed.device != q.device):
        raise ValueError(f"{name}: dropout_seed must be an int64 [2] tensor on "
                         f"{q.device}, got {dropout_seed!r}")
    # rel_attention's plan, with dropout on the einsum block math (kernel_dropout=False) and
    # no self-check: the blocks run kernel calls of their own windows, not this call's variant
    chosen = plan_call(backend, (q, k, v, r, r_w_bias, r_r_bias), wl, wr, key_padding_mask,
                       None, None, dropout_p, None, deterministic, None, name,
                       kernel_dropout=False, self_check=False).kernel
    return wl, wr, softmax_scale, dropout_p, kpm, chosen


def _gather_lengths(name: str, ring: _Ring, err, lq: int, mlen: int, layout: str):
    """Every rank's (segment rows, memory rows), gathered in one all_gather with whether its
    arguments passed (``err``: this rank's exception or None, raised here after the gather,
    so every rank takes part); raises on every rank where any rejected its arguments, or
    where the shards do not follow ``layout``. Returns (q_lens, m_lens) in rank order."""
    ok = err is None
    lens = torch.tensor([int(ok), lq if ok else 0, mlen if ok else 0], dtype=torch.int64)
    gathered = [torch.empty_like(lens) for _ in range(ring.world)]
    dist.all_gather(gathered, lens, group=ring.group)
    if err is not None:
        raise err
    bad = [i for i, t in enumerate(gathered) if not int(t[0])]
    if bad:
        raise ValueError(f"{name}: rank(s) {bad} of the group rejected their arguments (see "
                         f"their error); every rank must pass valid ones, nothing was computed")
    q_lens = [int(t[1]) for t in gathered]
    m_lens = [int(t[2]) for t in gathered]
    if layout == "zigzag":
        for i in range(ring.world):
            for total, mine, what in ((sum(q_lens), q_lens[i], "segment"),
                                      (sum(m_lens), m_lens[i], "memory")):
                exp = sum(n for _, n, _ in layout_chunks(total, i, ring.world, layout))
                if exp != mine:
                    raise ValueError(f"{name}: rank {i} holds {mine} {what} rows, but the "
                                     f"zigzag layout of {total} rows gives it {exp} "
                                     "(shard with shard_sequence)")
    return q_lens, m_lens


@renamed_keywords("context_parallel_rel_attention", memory_len="mlen")
def context_parallel_rel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    r: Tensor,
    r_w_bias: Tensor,
    r_r_bias: Tensor,
    *,
    group=None,
    mlen: int = 0,
    layout: str = "contiguous",
    causal: bool = True,
    window_size: Tuple[int, int] = (-1, -1),
    key_padding_mask: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
    backend: str = "auto",
    deterministic: bool = False,
    schedule: Optional[list] = None,
    r_first_distance: Optional[int] = None,
) -> Tensor:
    """Relative attention over a sequence sharded across the ranks of ``group``.

    Every rank calls it with its shard; the result is its shard of
    ``rel_attention(q_all, k_all, v_all, r, r_w_bias, r_r_bias, ...)`` on the whole sequence.

    Arguments:
        q: ``[B, Lq_rank, H, D]``: this rank's queries (its chunks of the current segment in
            ``layout``, see :func:`shard_sequence`).
        k, v: ``[B, mlen + Lq_rank, H, D]``: this rank's memory shard (its chunks of the
            global memory in ``layout``), then the keys / values of its queries.
        r: ``[R, H, D]``, the whole projected position table (every rank the same); row ``p``
            serves global query ``i`` and global key ``j`` at ``p = j - i + Lq - 1``, ``Lq``
            the global segment length, keys memory first, as in ``rel_attention``.
        r_w_bias, r_r_bias: ``[H, D]``.
        group: the process group (default: the world).
        mlen: the rows of ``k`` / ``v`` that are this rank's memory shard (``mlen`` as
            everywhere in the package; its former name ``memory_len`` still works, with a
            DeprecationWarning).
        layout: ``"contiguous"`` (rank order; lengths may differ between ranks) or
            ``"zigzag"`` (rank ``i`` holds chunks ``i`` and ``2P - 1 - i`` of ``2P``: causal
            work balanced); the segment and the memory are both sharded in it.
        causal, window_size, softmax_scale: as in ``rel_attention``, on global positions.
        key_padding_mask: ``[B, mlen + Lq_rank]`` bool, True = padded, this rank's keys.
        dropout_p: attention dropout probability, with the keep-mask one process would use:
            that of the fused kernels (``ops.rel_attn_fwd.dropout_keep_mask``), a function of
            global (b, h, i, j) and ``dropout_seed``; each chunk pair regenerates its block of
            it with the kernels' Triton helper (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        dropout_seed: int64 ``[2]`` (seed, offset) on q's device; default: every rank draws
            one (``draw_dropout_seed``, so the ranks' generators advance alike) and rank 0's
            is broadcast to the group. The backward regenerates the same mask.
        backend: what computes each ring step's blocks (docs/distributed.md):
            ``"triton"`` (the ops ``txl_kernels::rel_attn_fwd`` / ``rel_attn_bwd`` on their
            Triton kernels: CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"cpu"`` (the same
            ops' C++ CPU kernel), ``"reference"`` (the
            einsum block math) or ``"auto"``: ``rel_attention``'s policy
            (``functional.choose_backend``: Triton where the fused kernels run for the dtype
            and head dim, the CPU kernel on CPU tensors once the extension is built, else the
            einsum path); with ``dropout_p > 0`` always the einsum path (the kernels
            draw their keep-mask in their own block's coordinates; an explicit ``"triton"`` /
            ``"cpu"`` then raises).
        deterministic: the Triton backward's dr reduction, as in ``rel_attention``.
        r_first_distance: ``rel_attention``'s argument is not supported here: anything but
            None raises NotImplementedError (on every rank, as the other checks).
        schedule: optional list; each rank appends its ring events (``("recv_posted", step)``,
            ``("compute_begin", step)``, ``("block", step)`` per chunk pair computed,
            ``("skip", step)`` per chunk pair outside the window, ...) to it.

    Every argument is checked before anything is communicated, with ``rel_attention``'s
    checks and messages (named after this function); a call that any rank rejects raises on
    every rank (a ``ValueError`` naming the rank on the others) before the ring starts, so
    the group stays usable.

    Gradients flow to every input. Those of ``r`` and the two biases are this rank's partial
    sums: like the gradients of any parameter shared across the ranks' shards, they add up
    over the group (the all-reduce of the data-parallel wrapper, or ``dist.all_reduce``).
    Memory per rank: the local shard plus one received key / value block; the kernels keep
    their tiles on chip, the einsum path materialises one chunk pair's ``[B, H, A, Bk]``
    scores at a time.
    """
    name = "context_parallel_rel_attention"
    refuse_context_parallel(name)
    # Every argument is checked on this rank before anything is communicated, with
    # rel_attention's checks; the verdicts travel with the first collective (the lengths'
    # all_gather), so a call that one rank rejects raises on every rank and leaves no
    # exchange posted: the next call on the group starts clean.
    err = None
    try:
        wl, wr, softmax_scale, dropout_p, kpm, chosen = _check_args(
            name, q, k, v, r, r_w_bias, r_r_bias, mlen, layout, causal, window_size,
            key_padding_mask, softmax_scale, dropout_p, dropout_seed, backend, deterministic,
            r_first_distance)
    except (TypeError, ValueError, RuntimeError) as exc:  # NotImplementedError included
        err = exc
    if not dist.is_available() or not dist.is_initialized():
        if err is not None:
            raise err
        raise RuntimeError(f"{name}: torch.distributed is not initialised "
                           "(call dist.init_process_group first)")
    ring = _Ring(group, schedule)
    q_lens, m_lens = _gather_lengths(name, ring, err, q.shape[1], mlen, layout)
    B, _, H, _ = q.shape
    prob = _Problem(q_lens, m_lens, layout, ring.rank, key_padding_mask is not None)
    wl, wr = clamp_window(wl, wr, prob.lq, prob.mem + prob.lq)  # the global shapes
    check_position_rows(prob.lq, prob.mem + prob.lq, r.shape[0], wl, wr)
    seed = None
    if dropout_p > 0.0:
        if dropout_seed is None:
            seed = draw_dropout_seed(q.device)
            dist.broadcast(seed, src=dist.get_global_rank(ring.group, 0), group=ring.group)
        else:
            seed = dropout_seed
    drop = _Dropout(dropout_p, seed, B, H, prob.lq, prob.mem + prob.lq)
    ops = None if chosen == "reference" else KernelOps(chosen, deterministic)
    if ops is not None:  # the kernels read tensors whose last dimension is contiguous
        q, k, v, r, r_w_bias, r_r_bias = (last_dim_contiguous(t)
                                          for t in (q, k, v, r, r_w_bias, r_r_bias))
    if chosen == "triton" and softmax_scale <= 0.0:
        sign, softmax_scale = scale_sign(softmax_scale)
        q, r_w_bias, r_r_bias = (t * sign for t in (q, r_w_bias, r_r_bias))
    return _ContextParallelRelAttn.apply(q, k, v, r, r_w_bias, r_r_bias, kpm, softmax_scale, wl,
                                         wr, prob, ring, drop, ops)
