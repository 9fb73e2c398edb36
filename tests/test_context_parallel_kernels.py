"""The context-parallel ring on the kernels: each ring step's block pairs computed by the C++
CPU kernel (``backend="cpu"``) and by the fused Triton kernels under the interpreter
(``backend="triton"``, CPU tensors, ``TRITON_INTERPRET=1`` inherited by the spawned ranks),
on 2 and 4 gloo processes, against one process's ``rel_attention`` on the whole sequence.

Every rank counts the kernel calls it makes (by wrapping the backend's block ops) per ring
step; the test checks them against the chunk geometry: steps whose key blocks lie outside the
window make no call."""

import pytest
import torch
import torch.multiprocessing as mp

from helpers import assert_within, free_port, gloo_rank
from test_distributed import _inputs, gathered, ring_case
from txl_kernels import rel_attention
from txl_kernels.distributed import (_kernel_boxes, _kernel_window, _pair_may_attend,
                                     layout_chunks)
from txl_kernels.reference import in_window

# (name, layout, causal, window_size, B, H, D, Lq, M, R (None: enough rows), padding, dtype),
# as in test_distributed; the name's first word is the backend. No length is a multiple of
# the world size or of twice it.
CASES = [
    ("cpu_txl_memory_causal", "zigzag", True, (-1, -1), 2, 2, 8, 13, 7, None, False,
     torch.float64),
    ("cpu_same_length_memory", "contiguous", True, (5, -1), 1, 2, 16, 11, 6, None, True,
     torch.float32),
    ("cpu_bidirectional_padded", "contiguous", False, (-1, -1), 2, 2, 8, 19, 0, None, True,
     torch.float64),
    ("cpu_local_window", "contiguous", False, (3, 2), 1, 2, 8, 23, 0, None, True,
     torch.float64),
    ("cpu_bf16_bidirectional_padded", "contiguous", False, (-1, -1), 2, 2, 32, 37, 0, None,
     True, torch.bfloat16),
    ("cpu_fp16_txl_memory_causal", "zigzag", True, (-1, -1), 1, 2, 32, 37, 11, None, False,
     torch.float16),
    ("triton_txl_memory_causal", "contiguous", True, (-1, -1), 1, 2, 16, 13, 5, None, False,
     torch.float32),
    ("triton_bidirectional_padded", "contiguous", False, (-1, -1), 2, 1, 16, 11, 0, None,
     True, torch.float32),
    ("triton_local_window", "contiguous", False, (2, 3), 1, 1, 16, 17, 0, None, False,
     torch.float32),
]


def _backend(case):
    return case[0].split("_")[0]


def _worker(rank, world, port, path):
    from txl_kernels import distributed as D

    with gloo_rank(rank, world, port) as dist:
        events = []
        fwd, bwd = D.KernelOps.fwd, D.KernelOps.bwd
        D.KernelOps.fwd = lambda self, *a: (events.append(("fwd", self.name)), fwd(self, *a))[1]
        D.KernelOps.bwd = lambda self, *a: (events.append(("bwd", self.name)), bwd(self, *a))[1]
        results = {}
        for case in CASES:
            events.clear()
            results[case[0]] = ring_case(case, rank, world, events, backend=_backend(case))
            results[case[0]]["events"] = list(events)
        torch.save(results, f"{path}.{rank}")


@pytest.fixture(scope="module", params=[2, 4])
def ring_results(request, tmp_path_factory, extension):
    from txl_kernels.cpu_kernel import cpu_kernel_available

    ok, why = cpu_kernel_available()  # the extension built once here, loaded by the ranks
    assert ok, why
    world = request.param
    path = str(tmp_path_factory.mktemp(f"cpk{world}") / "res")
    mp.spawn(_worker, args=(world, free_port(), path), nprocs=world, join=True)
    return world, [torch.load(f"{path}.{i}", weights_only=False) for i in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ring_on_kernels_equals_one_process(ring_results, case):
    world, results = ring_results
    name, layout, causal, window, B, H, D, Lq, M, R, padding, dtype = case
    q, k, v, r, u, vb, kpm, dout = _inputs(case)
    got = gathered(results, case, world)

    def run(cast):
        leaves = [x.detach().to(cast, copy=True).requires_grad_() for x in (q, k, v, r, u, vb)]
        out = rel_attention(*leaves, causal=causal, window_size=window, key_padding_mask=kpm,
                            backend="reference")
        out.backward(dout.to(cast))
        return dict(zip(got, [out.detach()] + [x.grad for x in leaves]))

    truth = run(torch.float64)
    same = run(dtype)
    for key in got:
        assert got[key].dtype == dtype, (name, key, got[key].dtype)
        if dtype == torch.float64:
            err = (got[key] - truth[key]).abs().max().item()
            assert err <= 1e-10 * max(1.0, truth[key].abs().max().item()), (name, key, err)
        else:
            # fp16 / bf16: each kernel call rounds its box's gradients to the input dtype and
            # the shared tensors' (r, both biases) add up one partial per box over every rank,
            # one rounding each (docs/distributed.md)
            shared = dtype != torch.float32 and key in ("dr", "du", "dvb")
            assert_within(f"{name} {key} (world {world})", got[key], same[key], truth[key],
                          factor=3.0 if shared else 2.0)


def _expected_calls(case, world, rank):
    """Per ring step, the kernel calls rank ``rank`` makes (forward or backward): one per box
    of every chunk pair that the window reaches."""
    name, layout, causal, window, B, H, D, Lq, M = case[:9]
    wl, wr = window[0], 0 if causal else window[1]
    q_lens = [sum(n for _, n, _ in layout_chunks(Lq, i, world, layout)) for i in range(world)]
    m_lens = [sum(n for _, n, _ in layout_chunks(M, i, world, layout)) for i in range(world)]
    q_chunks = layout_chunks(Lq, rank, world, layout, q_lens)
    calls = []
    for step in range(world):
        src = (rank - step) % world
        k_chunks = (layout_chunks(M, src, world, layout, m_lens)
                    + [(M + s, n, 0) for s, n, _ in layout_chunks(Lq, src, world, layout,
                                                                   q_lens)])
        calls.append(sum(len(_kernel_boxes(a0, A, b0, Bk, M, wl, wr))
                         for a0, A, _ in q_chunks for b0, Bk, _ in k_chunks
                         if _pair_may_attend(a0, A, b0, Bk, M, wl, wr)))
    return calls


def _calls_per_step(events, kind, world):
    """Kernel calls of ``kind`` ("fwd" / "bwd") per ring step, from one rank's event list
    (the calls between ("compute_begin", s) and ("compute_end", s) of the forward's ring,
    then of the backward's)."""
    counts = [[0] * world, [0] * world]
    step, phase = None, -1
    for e in events:
        if e[0] == "compute_begin":
            step = e[1]
            phase += step == 0
        elif e[0] == "compute_end":
            step = None
        elif e[0] in ("fwd", "bwd"):
            assert step is not None and e[0] == ("fwd", "bwd")[phase], events
            counts[phase][step] += 1
    assert phase == 1, events
    return counts[("fwd", "bwd").index(kind)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ring_makes_one_kernel_call_per_box_and_none_outside_the_window(ring_results, case):
    world, results = ring_results
    name, backend = case[0], _backend(case)
    for rank, res in enumerate(results):
        events = res[name]["events"]
        assert {e[1] for e in events if e[0] in ("fwd", "bwd")} == {backend}
        want = _expected_calls(case, world, rank)
        for kind in ("fwd", "bwd"):
            got = _calls_per_step(events, kind, world)
            assert got == want, (name, rank, kind, got, want)
    if name.endswith("local_window") and world == 4:
        # contiguous quarters of 17 / 23 rows, window a few rows wide: each rank's queries
        # reach only its neighbours' keys, so whole ring steps make no kernel call
        assert any(0 in _expected_calls(case, world, i) for i in range(world))


def test_kernel_boxes_cover_each_allowed_pair_once_with_kernel_windows():
    """Every allowed pair of a chunk pair lies in exactly one box; each box has no more rows
    than keys, and its bottom-right aligned window (bounds >= 0, or -1 = unbounded) allows
    exactly the globally allowed pairs in it."""
    import random

    rng = random.Random(0)
    boxes_seen = 0
    for _ in range(3000):
        A, Bk = rng.randint(1, 9), rng.randint(1, 9)
        a0, b0, mem = rng.randint(0, 20), rng.randint(0, 30), rng.randint(0, 10)
        wl, wr = rng.choice([-1, 0, 1, 2, 3, 5, 8, 20]), rng.choice([-1, 0, 1, 2, 4, 9])
        i = torch.arange(A)[:, None] + a0 + mem
        j = torch.arange(Bk)[None, :] + b0
        allowed = in_window(i - j, wl, wr)
        cover = torch.zeros(A, Bk, dtype=torch.int64)
        for i_lo, i_hi, j_lo, j_hi in _kernel_boxes(a0, A, b0, Bk, mem, wl, wr):
            n_i, n_j = i_hi - i_lo, j_hi - j_lo
            assert 1 <= n_i <= n_j
            kwl, kwr = _kernel_window(a0 + i_lo, n_i, b0 + j_lo, n_j, mem, wl, wr)
            assert kwl >= -1 and kwr >= -1
            d = torch.arange(n_i)[:, None] + (n_j - n_i) - torch.arange(n_j)[None, :]
            box_allowed = in_window(d, kwl, kwr)
            assert torch.equal(box_allowed, allowed[i_lo:i_hi, j_lo:j_hi])
            cover[i_lo:i_hi, j_lo:j_hi] += box_allowed
            boxes_seen += 1
        assert torch.equal(cover, allowed.long()), (A, Bk, a0, b0, mem, wl, wr)
        assert _pair_may_attend(a0, A, b0, Bk, mem, wl, wr) == bool(allowed.any())
    assert boxes_seen > 1000


def test_explicit_kernel_backend_with_dropout_raises():
    """The ring's plan (``plan_call(kernel_dropout=False)``): dropout runs on the einsum
    block math, an explicit kernel backend with dropout raises, a bad backend raises."""
    from txl_kernels.functional import plan_call

    q = torch.randn(1, 4, 2, 16)
    ts = (q, q, q, q[0], q[0, 0], q[0, 0])

    def plan(backend, p):
        return plan_call(backend, ts, -1, -1, None, None, None, p, None, False, None,
                         "context_parallel_rel_attention", kernel_dropout=False,
                         self_check=False).kernel
    for backend in ("cpu", "triton"):
        with pytest.raises(ValueError, match="dropout_p > 0 runs the ring on the einsum"):
            plan(backend, 0.1)
    assert plan("auto", 0.1) == "reference"
    for p in (0.0, 0.1):
        with pytest.raises(ValueError, match="backend must be one of"):
            plan("cuda", p)
