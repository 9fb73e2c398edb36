"""txl_kernels.update_mems: the segment-memory update.

Every result is compared bit for bit (as integer bit patterns, so NaN, inf and -0.0 count too)
with the Transformer-XL formula ``cat([mems[l], hids[l]], 0)[beg:end]`` (with mlen and qlen in
the right order), through the C++ extension (built once per test session, in the torch
extensions cache) and through the pure-torch fallback. CUDA tests (the single-launch kernel)
skip without a GPU.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from txl_kernels import _build, _cpp_ops
from txl_kernels.memory import update_mems

from helpers import requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16, torch.float64: torch.int64}


# ----------------------------------------------------------------------------- oracle, inputs

def txl_formula(hids, mems, mem_len, ext_len):
    """MemTransformerLM._update_mems of the original code, with mlen (memory length) and qlen
    (segment length) in the right order, per layer."""
    out = []
    for i in range(len(hids)):
        has_mem = bool(mems) and mems[i].dim() == 3
        mlen = mems[i].size(0) if has_mem else 0
        qlen = hids[i].size(0)
        end_idx = mlen + max(0, qlen - ext_len)
        beg_idx = max(0, end_idx - mem_len)
        cat = torch.cat([mems[i], hids[i]], dim=0) if has_mem else hids[i]
        out.append(cat[beg_idx:end_idx].detach())
    return out


def swapped_formula(hids, mems, mem_len, ext_len):
    """The original's bug: _update_mems(hids, mems, qlen, mlen) against (hids, mems, mlen, qlen)."""
    out = []
    for i in range(len(hids)):
        mlen = mems[i].size(0) if mems else 0
        qlen = hids[i].size(0)
        end_idx = qlen + max(0, mlen - ext_len)   # mlen and qlen swapped
        beg_idx = max(0, end_idx - mem_len)
        cat = torch.cat([mems[i], hids[i]], dim=0) if mems else hids[i]
        out.append(cat[beg_idx:end_idx])
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.dtype])


def assert_same_bits(got, want, what=""):
    assert isinstance(got, list), f"{what}: update_mems must return a list, got {type(got)}"
    assert len(got) == len(want), f"{what}: {len(got)} layers returned, expected {len(want)}"
    for l, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what} layer {l}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert g.dtype == w.dtype and g.device == w.device, f"{what} layer {l}: dtype/device"
        assert torch.equal(bits(g), bits(w)), f"{what} layer {l}: values differ from the formula"


def rnd(shape, dtype, gen, special=True):
    """Random values (never all zeros), with NaN, -0.0, +inf and -inf planted."""
    t = torch.randn(*shape, generator=gen).to(dtype)
    if special and t.numel() >= 4:
        flat = t.view(-1)
        flat[0], flat[1], flat[2], flat[3] = float("nan"), -0.0, float("inf"), float("-inf")
    return t


def make_layers(L, qlen, mlen, bsz, d, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    hids = [rnd((qlen, bsz, d), dtype, g).to(device) for _ in range(L)]
    mems = None if mlen is None else [rnd((mlen, bsz, d), dtype, g).to(device) for _ in range(L)]
    return hids, mems


@pytest.fixture(scope="session")
def ext(extension):
    """The compiled extension (conftest's session fixture: one build per test run)."""
    return extension


@pytest.fixture(params=["extension", "torch"])
def backend(request):
    if request.param == "extension":
        request.getfixturevalue("ext")
    return request.param


# (L, qlen, mlen, bsz, d, mem_len, ext_len); mlen None = mems None
CASES = {
    "mem_and_segment": (2, 5, 7, 2, 37, 6, 0),
    "ext_len_mlen_ne_qlen": (3, 37, 4, 3, 41, 16, 3),
    "mlen_below_ext_len": (2, 8, 2, 2, 5, 4, 3),
    "mem_len_above_total": (1, 1, 9, 1, 64, 100, 0),
    "ext_len_above_qlen": (2, 4, 3, 2, 8, 5, 6),
    "first_segment_ext_len": (2, 9, None, 3, 7, 5, 2),
    "parallel_chunks": (2, 64, 16, 4, 256, 48, 0),
}


# ----------------------------------------------------------------------------- CPU: values

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_formula_bit_for_bit(backend, dtype, case):
    L, qlen, mlen, bsz, d, mem_len, ext_len = CASES[case]
    hids, mems = make_layers(L, qlen, mlen, bsz, d, dtype, seed=list(CASES).index(case))
    got = update_mems(hids, mems, mem_len, ext_len, backend=backend)
    assert_same_bits(got, txl_formula(hids, mems, mem_len, ext_len), f"{backend} {case}")
    for g in got:
        assert g.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_swapped_order_bug_not_reproduced(backend, dtype):
    # mlen = 2 < ext_len = 3 < qlen = 8: the right end is mlen + (qlen - ext_len) = 7; the
    # original's swapped call gives qlen + max(0, mlen - ext_len) = 8.
    hids, mems = make_layers(2, 8, 2, 2, 11, dtype, seed=3)
    got = update_mems(hids, mems, 4, 3, backend=backend)
    want = txl_formula(hids, mems, 4, 3)
    buggy = swapped_formula(hids, mems, 4, 3)
    assert_same_bits(got, want, backend)
    for g, w, b in zip(got, want, buggy):
        assert torch.equal(bits(g), bits(w))
        assert not torch.equal(bits(g), bits(b)), "reproduces the original's swapped mlen/qlen"
    # first segment (no memory) with ext_len > 0: the right memory is hids[:qlen - ext_len]
    got = update_mems(hids, None, 10, 3, backend=backend)
    for g, h in zip(got, hids):
        assert torch.equal(bits(g), bits(h[:5]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("kind", ["none", "empty_list", "placeholders", "empty_3d", "mixed"])
def test_no_memory_forms(backend, dtype, kind):
    g = torch.Generator().manual_seed(5)
    hids = [rnd((6, 3, 10), dtype, g) for _ in range(3)]
    mems = {"none": None, "empty_list": [],
            # the original init_mems: torch.empty(0, dtype=param.dtype, device=param.device)
            "placeholders": [torch.empty(0, dtype=dtype) for _ in range(3)],
            "empty_3d": [torch.empty(0, 3, 10, dtype=dtype) for _ in range(3)],
            "mixed": [torch.empty(0, dtype=dtype), rnd((4, 3, 10), dtype, g),
                      torch.empty(0, 3, 10, dtype=dtype)]}[kind]
    got = update_mems(hids, mems, 7, 1, backend=backend)
    assert_same_bits(got, txl_formula(hids, mems, 7, 1), f"{backend} {kind}")
    if kind != "mixed":
        for o, h in zip(got, hids):
            assert torch.equal(bits(o), bits(h[:5]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_mem_len_zero_gives_empty_memories(backend, dtype):
    hids, mems = make_layers(3, 5, 4, 2, 9, dtype)
    for m in (mems, None):
        got = update_mems(hids, m, 0, 0, backend=backend)
        assert len(got) == 3
        for o in got:
            assert o.shape == (0, 2, 9) and o.dtype == dtype and o.device.type == "cpu"
    assert update_mems([], None, 4, backend=backend) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_non_contiguous_inputs(backend, dtype):
    g = torch.Generator().manual_seed(7)
    qlen, mlen, bsz, d = 9, 6, 3, 13
    hids = [
        rnd((bsz, qlen, d), dtype, g).transpose(0, 1),          # batch-first storage
        rnd((qlen, bsz, 2 * d), dtype, g)[:, :, ::2],           # stride(-1) == 2
        rnd((qlen, 1, d), dtype, g).expand(qlen, bsz, d),       # stride 0 over the batch
    ]
    mems = [
        rnd((mlen, bsz, d + 5), dtype, g)[:, :, 2:d + 2],       # offset, padded rows
        rnd((d, bsz, mlen), dtype, g).permute(2, 1, 0),         # d is the slowest dim
        rnd((2 * mlen, bsz, d), dtype, g)[::2],                 # every other row
    ]
    assert not any(t.is_contiguous() for t in hids + mems)
    for mem_len, ext_len in [(10, 0), (4, 2), (20, 5)]:
        got = update_mems(hids, mems, mem_len, ext_len, backend=backend)
        assert_same_bits(got, txl_formula(hids, mems, mem_len, ext_len),
                         f"{backend} mem_len={mem_len} ext_len={ext_len}")


def test_layers_may_differ_in_length(backend):
    g = torch.Generator().manual_seed(11)
    hids = [rnd((q, 2, 6), torch.float32, g) for q in (3, 7, 1, 5)]
    mems = [rnd((m, 2, 6), torch.float32, g) for m in (0, 5, 9)] + [torch.empty(0)]
    got = update_mems(tuple(hids), tuple(mems), 6, 2, backend=backend)
    assert_same_bits(got, txl_formula(hids, mems, 6, 2), backend)


def test_results_are_detached_fresh_tensors(backend):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(5, 2, 8, generator=g, requires_grad=True)
    hids = [w * 2.0, torch.randn(5, 2, 8, generator=g, requires_grad=True)]
    mems = [torch.randn(3, 2, 8, generator=g, requires_grad=True) for _ in range(2)]
    got = update_mems(hids, mems, 6, 0, backend=backend)
    assert_same_bits(got, txl_formula(hids, mems, 6, 0), backend)
    for o in got:
        assert not o.requires_grad and o.grad_fn is None and o.is_leaf
    # no aliasing: writing the new memories leaves the inputs untouched
    before = [t.detach().clone() for t in hids + mems]
    for o in got:
        o.fill_(7.0)
    for t, b in zip(hids + mems, before):
        assert torch.equal(t.detach(), b)
    # the graph of hids is still usable
    hids[0].sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 2.0))


# ----------------------------------------------------------------------------- bad input

def _bad_cases():
    f32 = torch.float32
    h = [torch.randn(4, 2, 6), torch.randn(4, 2, 6)]
    m = [torch.randn(3, 2, 6), torch.randn(3, 2, 6)]
    return {
        "negative_mem_len": ((h, m, -1, 0), ValueError, r"mem_len must be >= 0, got -1"),
        "negative_ext_len": ((h, m, 4, -2), ValueError, r"ext_len must be >= 0, got -2"),
        "float_mem_len": ((h, m, 2.5, 0), TypeError, r"mem_len must be a non-negative int"),
        "bool_mem_len": ((h, m, True, 0), TypeError, r"mem_len must be a non-negative int"),
        "none_ext_len": ((h, m, 4, None), TypeError, r"ext_len must be a non-negative int"),
        "huge_mem_len": ((h, m, 2 ** 63, 0), ValueError, r"mem_len must fit in int64"),
        "huge_ext_len": ((h, m, 4, 2 ** 64), ValueError, r"ext_len must fit in int64"),
        "hids_tensor": ((torch.randn(2, 4, 2, 6), m, 4, 0), TypeError, r"hids must be a list"),
        "hids_not_tensor": (([h[0], "x"], m, 4, 0), TypeError, r"hids\[1\] must be a torch"),
        "hids_2d": (([h[0], torch.randn(4, 6)], m, 4, 0), ValueError, r"hids\[1\] must be 3-D"),
        "hids_int": (([torch.ones(4, 2, 6, dtype=torch.int64)], None, 4, 0), TypeError,
                     r"hids\[0\] must be float32"),
        "hids_mixed_dtype": (([h[0], h[1].half()], None, 4, 0), TypeError,
                             r"hids\[1\] is torch.float16"),
        "hids_mixed_device": (([h[0], h[1].to("meta")], None, 4, 0), ValueError,
                              r"hids\[1\] is on meta"),
        "mems_tensor": ((h, torch.randn(2, 3, 2, 6), 4, 0), TypeError, r"mems must be None or a"),
        "mems_layer_count": ((h, m[:1], 4, 0), ValueError, r"mems has 1 layers but hids has 2"),
        "mems_not_tensor": ((h, [m[0], 3], 4, 0), TypeError, r"mems\[1\] must be a torch"),
        "mems_2d": ((h, [m[0], torch.randn(3, 6)], 4, 0), ValueError, r"mems\[1\] must be 3-D"),
        "mems_bsz": ((h, [torch.randn(3, 5, 6), m[1]], 4, 0), ValueError,
                     r"mems\[0\] has batch size \(bsz\) 5 but hids\[0\] has 2"),
        "mems_d": ((h, [m[0], torch.randn(3, 2, 7)], 4, 0), ValueError,
                   r"mems\[1\] has feature size \(d\) 7 but hids\[1\] has 6"),
        "mems_dtype": ((h, [m[0].to(torch.bfloat16), m[1]], 4, 0), TypeError,
                       r"mems\[0\] has dtype torch.bfloat16, hids\[0\] has torch.float32"),
        "mems_device": ((h, [m[0], m[1].to("meta")], 4, 0), ValueError,
                        r"mems\[1\] is on meta, hids\[1\] is on cpu"),
    }


@pytest.mark.parametrize("name", list(_bad_cases()))
def test_bad_input_raises_naming_the_argument(name):
    args, exc, match = _bad_cases()[name]
    with pytest.raises(exc, match=match):
        update_mems(*args)


def test_bad_backend():
    with pytest.raises(ValueError, match=r"backend must be one of"):
        update_mems([torch.randn(2, 1, 3)], None, 2, backend="cuda")


def test_extension_checks_direct_calls(ext):
    """The C++ entry point guards its own inputs too (for callers that bypass memory.py)."""
    h = [torch.randn(4, 2, 6)]
    with pytest.raises(RuntimeError, match="mem_len must be >= 0"):
        torch.ops.txl_kernels.update_mems(h, [], -1, 0)
    with pytest.raises(RuntimeError, match=r"mems\[0\] must be \[mlen, 2, 6\]"):
        torch.ops.txl_kernels.update_mems(h, [torch.randn(3, 2, 5)], 4, 0)
    with pytest.raises(RuntimeError, match="one tensor per layer"):
        torch.ops.txl_kernels.update_mems(h, [torch.randn(3, 2, 6)] * 2, 4, 0)


# ----------------------------------------------------------------------------- fallback

def _no_ninja(monkeypatch, tmp_path):
    """Simulate a machine where the extension cannot be built: a fresh build state and no
    ninja anywhere."""
    monkeypatch.setattr(_build, "_STATE", _build._State())
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(_cpp_ops, "_WARNED", set())


def test_fallback_warns_once_with_the_reason(monkeypatch, tmp_path):
    _no_ninja(monkeypatch, tmp_path)
    hids, mems = make_layers(2, 5, 3, 2, 9, torch.float16)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        first = update_mems(hids, mems, 6, 1)
        second = update_mems(hids, mems, 4, 0)
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "pure-torch fallback" in msgs[0] and "ninja" in msgs[0], msgs[0]
    assert_same_bits(first, txl_formula(hids, mems, 6, 1), "fallback")
    assert_same_bits(second, txl_formula(hids, mems, 4, 0), "fallback")
    st = _build.extension_status()
    assert st["attempted"] and not st["loaded"] and "ninja" in st["reason"]
    with pytest.raises(RuntimeError, match="backend='extension' is not available.*ninja"):
        update_mems(hids, mems, 6, backend="extension")


def test_extension_is_used_when_built(ext, monkeypatch):
    """backend='auto' takes the extension's op, torch.ops.txl_kernels.update_mems (no
    warning), once it is built."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(_cpp_ops, "_WARNED", set())
    hids, mems = make_layers(2, 5, 3, 2, 9, torch.bfloat16)
    with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CPU]) as prof:
        warnings.simplefilter("error")
        got = update_mems(hids, mems, 6, 1)
    assert [e.name for e in prof.events()].count("txl_kernels::update_mems") == 1
    assert_same_bits(got, txl_formula(hids, mems, 6, 1), "auto")
    assert _build.extension_status()["loaded"]


# ----------------------------------------------------------------------------- CUDA

def _cuda_case(dtype, d, layout, seed=0):
    """Four layers with different memory lengths (one with none) on the GPU. Views are taken
    after the move (``.cuda()`` would make a non-dense view contiguous)."""
    g = torch.Generator().manual_seed(seed)
    qlen, bsz = 37, 3
    hids, mems = [], []
    for mlen in (11, 0, 40, 5):
        if layout == "contiguous":
            h = rnd((qlen, bsz, d), dtype, g).cuda()
            m = rnd((mlen, bsz, d), dtype, g).cuda() if mlen else torch.empty(0, dtype=dtype)
        elif layout == "transposed":  # batch-first storage: rows still 16-byte aligned
            h = rnd((bsz, qlen, d), dtype, g).cuda().transpose(0, 1)
            m = rnd((bsz, mlen, d), dtype, g).cuda().transpose(0, 1)
        else:  # stride(-1) == 2: element copies
            h = rnd((bsz, qlen, 2 * d), dtype, g).cuda().transpose(0, 1)[:, :, ::2]
            m = rnd((mlen, bsz, 2 * d), dtype, g).cuda()[:, :, ::2]
        assert h.is_cuda and (layout == "contiguous") == h.is_contiguous()
        hids.append(h)
        mems.append(m.cuda())
    return hids, mems


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("d,layout", [(64, "contiguous"), (41, "contiguous"),
                                      (64, "transposed"), (64, "strided")],
                         ids=["vec16", "odd_d", "vec16_transposed", "strided"])
def test_cuda_matches_formula_bit_for_bit(ext, dtype, d, layout):
    assert ext.with_cuda, _build.extension_status()["cuda_reason"]
    hids, mems = _cuda_case(dtype, d, layout)
    for mem_len, ext_len in [(16, 0), (30, 4), (100, 40), (0, 0)]:
        got = update_mems(hids, mems, mem_len, ext_len, backend="extension")
        assert_same_bits(got, txl_formula(hids, mems, mem_len, ext_len),
                         f"cuda mem_len={mem_len} ext_len={ext_len}")


@requires_cuda
def test_cuda_all_layers_in_one_launch(ext):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    assert ext.with_cuda, _build.extension_status()["cuda_reason"]
    hids, mems = _cuda_case(torch.float16, 64, "contiguous")
    update_mems(hids, mems, 16, 2, backend="extension")  # warm up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = update_mems(hids, mems, 16, 2, backend="extension")
        torch.cuda.synchronize()
    device_events = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [n for n in device_events if "memcpy" not in n.lower() and "memset" not in n.lower()]
    assert len(kernels) == 1 and "update_mems_kernel" in kernels[0], device_events
    assert_same_bits(got, txl_formula(hids, mems, 16, 2), "cuda single launch")


@requires_cuda
def test_cuda_on_side_stream(ext):
    hids, mems = _cuda_case(torch.bfloat16, 64, "strided", seed=4)
    want = txl_formula(hids, mems, 20, 3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = update_mems(hids, mems, 20, 3, backend="extension")
    s.synchronize()
    assert_same_bits(got, want, "side stream")


@requires_cuda
def test_cuda_without_cuda_build_falls_back_with_warning(monkeypatch):
    """A CUDA-less build (e.g. no nvcc) still serves CUDA tensors through torch, warning once."""
    monkeypatch.setattr(_build, "_STATE", _build._State())
    monkeypatch.setattr(_build, "cuda_build_plan",
                        lambda require_device=True: (False, "no CUDA toolkit (simulated)"))
    monkeypatch.setattr(_cpp_ops, "_WARNED", set())
    hids, mems = _cuda_case(torch.float32, 41, "contiguous")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        got = update_mems(hids, mems, 16, 2)
        update_mems(hids, mems, 16, 2)
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "no CUDA toolkit (simulated)" in msgs[0], msgs
    assert_same_bits(got, txl_formula(hids, mems, 16, 2), "cuda fallback")

