"""Context parallelism (txl_kernels.distributed): the sharded ring computation against
rel_attention on the whole sequence, on 2 and 4 gloo processes on CPU, with the ring's
blocks on the einsum block math (backend "reference"; test_context_parallel_kernels.py runs
them on the kernels).

One spawn per world size runs every case (starting the ranks costs more than the tiny
problems); every rank saves its output shard, its input gradients and its ring schedule, and
the test process compares them with one process's reference result."""
import zlib

import pytest
import torch
import torch.multiprocessing as mp

from helpers import free_port, gloo_rank
from txl_kernels import rel_attention
from txl_kernels.distributed import (context_parallel_rel_attention, layout_chunks,
                                     shard_sequence, unshard_sequence)
from txl_kernels.reference import rel_attention_reference
from txl_kernels.ops._common import (draw_dropout_seed, dropout_keep_block, dropout_keep_mask,
                                    dropout_rate)

# (name, layout, causal, window_size, B, H, D, Lq, M, R (None: enough rows), padding, dtype)
CASES = [
    ("txl_memory_causal", "contiguous", True, (-1, -1), 2, 2, 8, 13, 7, None, False,
     torch.float64),
    ("txl_memory_causal_zigzag", "zigzag", True, (-1, -1), 1, 2, 8, 17, 9, None, False,
     torch.float64),
    ("conformer_bidirectional_padded", "zigzag", False, (-1, -1), 2, 2, 8, 19, 0, None, True,
     torch.float64),
    ("local_window", "zigzag", False, (3, 2), 1, 2, 8, 24, 0, None, False, torch.float64),
    ("conformer_fp32", "contiguous", False, (-1, -1), 2, 2, 16, 21, 0, None, True,
     torch.float32),
]

# attention dropout: Transformer-XL causal + memory, zigzag (chunk pairs at unaligned offsets);
# rank r seeds its generator with DROPOUT_SEED + r, so only the broadcast of rank 0's
# (seed, offset) makes the ranks agree with one process seeded DROPOUT_SEED
DROPOUT_CASE = ("dropout_txl_zigzag", "zigzag", True, (-1, -1), 2, 2, 8, 21, 11, None, False,
                torch.float64)
DROPOUT_P, DROPOUT_SEED = 0.3, 1234


def _inputs(case):
    name, layout, causal, window, B, H, D, Lq, M, R, padding, dtype = case
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    Lk = M + Lq
    R = R or (Lk if causal else Lk + Lq - 1)
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = t(B, Lq, H, D), t(B, Lk, H, D), t(B, Lk, H, D)
    r, u, vb = t(R, H, D), t(H, D) * 0.5, t(H, D) * 0.5
    kpm = None
    if padding:  # uneven: each sequence padded at a different place, some ranks all padded
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[0, Lk - Lk // 3:] = True
        if B > 1:
            kpm[1, : Lk // 4] = True
    dout = t(B, Lq, H, D)
    return q, k, v, r, u, vb, kpm, dout


def _shard_keys(x, M, rank, world, layout):
    """A rank's keys: its memory shard, then its segment shard."""
    mem = shard_sequence(x[:, :M], 1, rank, world, layout)
    return torch.cat([mem, shard_sequence(x[:, M:], 1, rank, world, layout)], 1)


def ring_case(case, rank, world, schedule, **kw):
    """Run ``case`` on this rank's shards (``kw`` to context_parallel_rel_attention): its
    output shard, the gradients of its inputs, and its forward / backward ring events."""
    name, layout, causal, window, B, H, D, Lq, M = case[:9]
    q, k, v, r, u, vb, kpm, dout = _inputs(case)
    ql = shard_sequence(q, 1, rank, world, layout).requires_grad_()
    kl = _shard_keys(k, M, rank, world, layout).requires_grad_()
    vl = _shard_keys(v, M, rank, world, layout).requires_grad_()
    kpml = None if kpm is None else _shard_keys(kpm, M, rank, world, layout)
    rr, uu, vv = (t.clone().requires_grad_() for t in (r, u, vb))
    out = context_parallel_rel_attention(
        ql, kl, vl, rr, uu, vv, mlen=kl.shape[1] - ql.shape[1], layout=layout,
        causal=causal, window_size=window, key_padding_mask=kpml, schedule=schedule, **kw)
    fwd_schedule = list(schedule)
    out.backward(shard_sequence(dout, 1, rank, world, layout))
    return dict(out=out.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad, dr=rr.grad, du=uu.grad,
                dvb=vv.grad, fwd=fwd_schedule, bwd=schedule[len(fwd_schedule):])


def _worker(rank, world, port, path):
    with gloo_rank(rank, world, port) as dist:
        # the einsum block math (test_context_parallel_kernels.py runs the kernels)
        results = {case[0]: ring_case(case, rank, world, [], backend="reference")
                   for case in CASES}
        # rank r seeds DROPOUT_SEED + r: only rank 0's broadcast (seed, offset) makes them agree
        torch.manual_seed(DROPOUT_SEED + rank)
        results[DROPOUT_CASE[0]] = ring_case(DROPOUT_CASE, rank, world, [],
                                             dropout_p=DROPOUT_P)
        torch.save(results, f"{path}.{rank}")


@pytest.fixture(scope="module", params=[2, 4])
def ring_results(request, tmp_path_factory):
    world = request.param
    path = str(tmp_path_factory.mktemp(f"cp{world}") / "res")
    mp.spawn(_worker, args=(world, free_port(), path), nprocs=world, join=True)
    return world, [torch.load(f"{path}.{i}", weights_only=False) for i in range(world)]


def _unshard_keys(shards, M, world, layout):
    """Inverse of _shard_keys over every rank's tensor."""
    mem_lens = [sum(n for _, n, _ in layout_chunks(M, i, world, layout)) for i in range(world)]
    mem = unshard_sequence([s[:, :m] for s, m in zip(shards, mem_lens)], 1, layout)
    seg = unshard_sequence([s[:, m:] for s, m in zip(shards, mem_lens)], 1, layout)
    return torch.cat([mem, seg], 1)


def gathered(results, case, world):
    """The whole problem's output and gradients from every rank's ``ring_case`` result."""
    name, layout, M = case[0], case[1], case[8]
    per_rank = [res[name] for res in results]
    return {
        "out": unshard_sequence([p["out"] for p in per_rank], 1, layout),
        "dq": unshard_sequence([p["dq"] for p in per_rank], 1, layout),
        "dk": _unshard_keys([p["dk"] for p in per_rank], M, world, layout),
        "dv": _unshard_keys([p["dv"] for p in per_rank], M, world, layout),
        # shared tensors: each rank's partial gradient, summed over the group (in float64,
        # so that the sum adds no rounding of its own)
        **{g: sum(p[g].double() for p in per_rank).to(per_rank[0][g].dtype)
           for g in ("dr", "du", "dvb")},
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES + [DROPOUT_CASE], ids=[c[0] for c in CASES]
                         + [DROPOUT_CASE[0]])
def test_sharded_ring_equals_one_process(ring_results, case):
    world, results = ring_results
    name, layout, causal, window, B, H, D, Lq, M = case[:9]
    dtype = case[-1]
    q, k, v, r, u, vb, kpm, dout = _inputs(case)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, r, u, vb)]
    if case is DROPOUT_CASE:  # the one-process mask of the seed rank 0 draws
        torch.manual_seed(DROPOUT_SEED)
        mask = dropout_keep_mask(draw_dropout_seed("cpu"), B, H, Lq, M + Lq, DROPOUT_P)
        assert 0 < mask.sum() < mask.numel()
        # the kernels' rate (DROPOUT_P to within 2^-24): kept values scaled as the ring does
        ref = rel_attention_reference(*leaves, D ** -0.5, -1, 0,
                                      dropout_p=dropout_rate(DROPOUT_P), dropout_mask=mask)
    else:
        ref = rel_attention(*leaves, causal=causal, window_size=window, key_padding_mask=kpm,
                            backend="reference")
    ref.backward(dout)
    got = gathered(results, case, world)
    want = dict(out=ref, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad,
                dr=leaves[3].grad, du=leaves[4].grad, dvb=leaves[5].grad)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for key in want:
        err = (got[key].double() - want[key].double()).abs().max().item()
        scale = want[key].double().abs().max().item() + 1e-30
        assert err <= tol * max(1.0, scale), f"{name} {key}: max error {err:.3g} (world {world})"


@pytest.mark.slow
def test_receive_is_posted_before_the_block_it_overlaps(ring_results):
    world, results = ring_results
    for res in results:
        for name, r in res.items():
            for events in (r["fwd"], r["bwd"]):
                for step in range(world - 1):
                    posted = events.index(("recv_posted", step + 1))
                    begin = events.index(("compute_begin", step))
                    assert posted < begin, f"{name}: step {step + 1}'s receive posted late"


@pytest.mark.slow
def test_local_window_skips_chunk_pairs_outside_it(ring_results):
    world, results = ring_results
    case = next(c for c in CASES if c[0] == "local_window")
    _, layout, causal, (wl, wr), _, _, _, Lq, M = case[:9]
    skipped = computed = 0
    for res in results:
        ev = res["local_window"]["fwd"]
        skipped += sum(e[0] == "skip" for e in ev)
        computed += sum(e[0] == "block" for e in ev)
    # every chunk pair of the global problem is visited once, and only those within the
    # window are computed
    chunks = [c for i in range(world) for c in layout_chunks(Lq, i, world, layout)]
    may = sum(1 for a0, A, _ in chunks for b0, B, _ in chunks
              if not ((a0 - (b0 + B - 1)) > wl or (a0 + A - 1 - b0) < -wr))
    assert computed == may and skipped == len(chunks) ** 2 - may and skipped > 0


def test_shard_and_unshard_are_inverse():
    x = torch.arange(2 * 23).view(2, 23)
    for world in (1, 2, 3, 4):
        for layout in ("contiguous", "zigzag"):
            shards = [shard_sequence(x, 1, i, world, layout) for i in range(world)]
            assert sum(s.shape[1] for s in shards) == 23
            assert torch.equal(unshard_sequence(shards, 1, layout), x)


def test_zigzag_balances_causal_work():
    """Rank i holds chunks i and 2P - 1 - i: every rank gets the same causal pair count
    (up to the rounding of the chunk sizes)."""
    L, world = 64, 4
    pairs = []
    for i in range(world):
        pairs.append(sum(sum(range(a0 + 1, a0 + n + 1))  # query a0 + t sees a0 + t + 1 keys
                         for a0, n, _ in layout_chunks(L, i, world, "zigzag")))
    assert max(pairs) == min(pairs)


def test_requires_an_initialised_process_group():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="not initialised"):
        context_parallel_rel_attention(q, q, q, torch.randn(4, 2, 8), torch.zeros(2, 8),
                                       torch.zeros(2, 8))


def test_memory_len_is_a_deprecated_alias_of_mlen():
    """The ring's former keyword ``memory_len`` reaches ``mlen`` (here: its check, before any
    communication) with a DeprecationWarning; both at once raise TypeError."""
    q = torch.randn(1, 4, 2, 8)
    r, b = torch.randn(4, 2, 8), torch.zeros(2, 8)
    with pytest.warns(DeprecationWarning, match="memory_len= is deprecated.*mlen="), \
            pytest.raises(ValueError, match="mlen must be an int >= 0, got -1"):
        context_parallel_rel_attention(q, q, q, r, b, b, memory_len=-1)
    with pytest.raises(TypeError, match="got both mlen= and memory_len="):
        context_parallel_rel_attention(q, q, q, r, b, b, memory_len=0, mlen=0)


# (keyword, value): arguments rel_attention rejects with a ValueError / TypeError naming them
BAD_ARGS = [("softmax_scale", float("nan")), ("softmax_scale", float("inf")),
            ("softmax_scale", -float("inf")), ("softmax_scale", "0.1"),
            ("window_size", (10 ** 30, -1)), ("window_size", (-1, 10 ** 30)),
            ("window_size", (-2, 3)), ("window_size", (1.5, 0)), ("causal", 1),
            ("dropout_p", 1.0), ("dropout_p", True), ("deterministic", None),
            ("key_padding_mask", torch.zeros(1, 4)),
            ("key_padding_mask", torch.zeros(1, 3, dtype=torch.bool))]


def _rel_attention_error(kw, value):
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    r = torch.randn(7, 2, 8, dtype=torch.float64)
    b = torch.zeros(2, 8, dtype=torch.float64)
    with pytest.raises((TypeError, ValueError)) as exc:
        rel_attention(q, q, q, r, b, b, backend="reference", **{kw: value})
    return q, r, b, exc


@pytest.mark.parametrize("kw,value", BAD_ARGS, ids=[f"{k}={v!r:.20}" for k, v in BAD_ARGS])
def test_ring_rejects_what_rel_attention_rejects_before_communicating(kw, value):
    """The ring runs rel_attention's checks before any communication (here: before it even
    looks for a process group), with the same exception type and message (its own name)."""
    q, r, b, want = _rel_attention_error(kw, value)
    prefix = "rel_attention: "
    assert str(want.value).startswith(prefix) and kw in str(want.value)
    with pytest.raises(want.type) as got:
        context_parallel_rel_attention(q, q, q, r, b, b, backend="reference", **{kw: value})
    # the one difference: the ring's keys are this rank's memory shard and segment shard
    want_msg = str(want.value)[len(prefix):].replace("[B, Lk]", "[B, mlen + Lq_rank]")
    assert str(got.value) == "context_parallel_rel_attention: " + want_msg


def test_huge_window_raises_value_error_naming_window_size():
    """Not an OverflowError from the int64 arithmetic of the reference path."""
    for window in ((10 ** 30, -1), (-1, 10 ** 30)):
        exc = _rel_attention_error("window_size", window)[3]
        assert exc.type is ValueError
        assert str(exc.value) == (f"rel_attention: window_size entries must fit in int64 "
                                  f"(<= 2**63 - 1; -1 = unbounded), got {window}")


def _bad_call_worker(rank, world, port, path):
    """Bad calls (the same on every rank, then on rank 0 only), each followed by the check
    that the group still works: every rank records what each call raised, then runs a valid
    ring call."""
    with gloo_rank(rank, world, port):
        case = CASES[0]
        q, k, v, r, u, vb = _inputs(case)[:6]
        M, layout = case[8], case[1]
        ql = shard_sequence(q, 1, rank, world, layout)
        kl, vl = (_shard_keys(t, M, rank, world, layout) for t in (k, v))
        errors = []
        for kw, value in [("softmax_scale", float("nan")), ("softmax_scale", float("inf")),
                          ("window_size", (10 ** 30, -1)), ("rank0_scale", float("nan"))]:
            if kw == "rank0_scale":
                kw, value = "softmax_scale", (value if rank == 0 else None)
            try:
                context_parallel_rel_attention(
                    ql, kl, vl, r, u, vb, mlen=kl.shape[1] - ql.shape[1], layout=layout,
                    backend="reference", **{kw: value})
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - the test compares them
                errors.append((type(exc).__name__, str(exc)))
        out = context_parallel_rel_attention(ql, kl, vl, r, u, vb,
                                             mlen=kl.shape[1] - ql.shape[1],
                                             layout=layout, backend="reference")
        torch.save(dict(errors=errors, out=out), f"{path}.{rank}")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_bad_call_raises_on_every_rank_and_the_group_stays_usable(world, tmp_path):
    """softmax_scale NaN / inf and window_size (10**30, -1) raise rel_attention's ValueError on
    every rank, before the ring posts an exchange; a call that only rank 0 gets wrong raises
    on every rank too; the valid call after them completes (no hang) and is right."""
    import time

    path = str(tmp_path / "res")
    ctx = mp.spawn(_bad_call_worker, args=(world, free_port(), path), nprocs=world,
                   join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"world {world}: the ranks hung (a bad call left the group unusable)")
    res = [torch.load(f"{path}.{i}", weights_only=False) for i in range(world)]
    case = CASES[0]
    q, k, v, r, u, vb = _inputs(case)[:6]
    for kw, value, i in (("softmax_scale", float("nan"), 0), ("softmax_scale", float("inf"), 1),
                         ("window_size", (10 ** 30, -1), 2)):
        want = _rel_attention_error(kw, value)[3].value
        msg = "context_parallel_rel_attention: " + str(want).removeprefix("rel_attention: ")
        assert [x["errors"][i] for x in res] == [("ValueError", msg)] * world, (kw, value)
    # only rank 0 passed NaN: it raises its own error, the others name it
    assert res[0]["errors"][3] == ("ValueError", "context_parallel_rel_attention: "
                                   "softmax_scale must be a finite float, got nan")
    for x in res[1:]:
        assert x["errors"][3][0] == "ValueError" and "rank(s) [0]" in x["errors"][3][1]
    out = unshard_sequence([x["out"] for x in res], 1, case[1])
    ref = rel_attention(q, k, v, r, u, vb, causal=case[2], backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_dropout_block_is_the_one_process_mask_restricted():
    """dropout_keep_block at any (unaligned) offset equals that block of the full mask."""
    torch.manual_seed(3)
    seed = draw_dropout_seed("cpu")
    B, H, Lq, Lk = 1, 2, 70, 131
    full = dropout_keep_mask(seed, B, H, Lq, Lk, 0.4)
    for (i0, A), (j0, Bk) in [((0, 70), (0, 131)), ((5, 13), (37, 70)), ((63, 7), (64, 1)),
                              ((69, 1), (100, 31)), ((10, 0), (3, 4))]:
        blk = dropout_keep_block(seed, B, H, Lq, Lk, 0.4, (i0, A), (j0, Bk))
        assert torch.equal(blk, full[:, :, i0:i0 + A, j0:j0 + Bk]), (i0, A, j0, Bk)
    with pytest.raises(ValueError, match="cols must be"):
        dropout_keep_block(seed, B, H, Lq, Lk, 0.4, (0, 4), (130, 2))


def test_memory_per_rank_falls_as_one_over_p():
    """The per-rank buffers of the ring, from its chunk geometry (_Problem: what
    _ring_forward allocates): the local shard and the received key block hold ~1/P of the
    rows, the largest chunk pair's score tensor [B, H, A, Bk] ~1/P^2 of the whole problem's
    (1/(4 P^2) in the zigzag layout)."""
    from txl_kernels.distributed import _Problem

    L, M = 45_000, 0  # the long-audio shape: an hour of encoder frames
    for layout, pair_div in (("contiguous", 1), ("zigzag", 4)):
        rows, scores = {}, {}
        for P in (1, 2, 4, 8):
            q_lens = [sum(n for _, n, _ in layout_chunks(L, i, P, layout)) for i in range(P)]
            m_lens = [sum(n for _, n, _ in layout_chunks(M, i, P, layout)) for i in range(P)]
            prob = _Problem(q_lens, m_lens, layout, 0)
            rows[P] = rows_p = max(prob.k_lens)
            scores[P] = max(A * Bk for i in range(P) for _, A, _ in prob.q_chunks[i]
                            for j in range(P) for _, Bk, _ in prob.k_chunks[j])
            assert rows_p == -(-L // P)  # the local shard / received block: ceil(L / P)
            # zigzag: 2P chunks, so even one rank's pairs are a quarter of the whole
            assert scores[P] == (-(-L // (P * (2 if layout == "zigzag" else 1)))) ** 2
            assert abs(scores[P] * P * P * pair_div / (L * L) - 1) < 1e-3
        for P in (2, 4, 8):
            assert rows[P] * P <= rows[1] + P
