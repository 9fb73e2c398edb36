"""Fused Triton forward (txl_kernels/ops/rel_attn_fwd.py) against the reference.

Runs on CPU tensors under TRITON_INTERPRET=1 (conftest sets it when there is no GPU) with the
kernel's fixed 16 x 16 interpreter tiles, and the same tests on CUDA when a GPU is present.
Each case checks the output (and, at the launcher, the log-sum-exp the backward relies on)
against the float64 oracle, within 2x the error of PyTorch's same math in the same precision.
"""
from __future__ import annotations

import pytest
import torch

import txl_kernels
from txl_kernels import quantize_kv
from txl_kernels.reference import allowed_pairs, rel_attention_reference

from helpers import (FUSED_DEVICE, FUSED_DTYPES, INTERPRET, assert_within, make_inputs, oracle,
                     requires_cuda)

import txl_kernels.ops.rel_attn_fwd as fwd_mod
from txl_kernels.ops._common import descriptors_ok

rel_attn_fwd = fwd_mod.rel_attn_fwd
DEV = FUSED_DEVICE
ON_GPU = DEV == "cuda"
# Forced block configs; the interpreter and the GPU both accept these (BLOCK_M <= 2 BLOCK_N).
CONFIGS = [{"BLOCK_M": 32, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 32},
           {"BLOCK_M": 32, "BLOCK_N": 32}]
if ON_GPU:
    CONFIGS += [{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
                {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8},
                {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8}]


@pytest.fixture(autouse=True)
def _one_config_on_gpu(monkeypatch):
    """On GPU, run the default config rather than autotuning every shape bucket of the grid
    (test_autotuned_gpu covers the autotuner)."""
    monkeypatch.setenv("TXL_KERNELS_AUTOTUNE", "0")


def _dtype_id(dt):
    return str(dt).replace("torch.", "")


def _expand_mask(mask, B, H, Lq, Lk):
    return None if mask is None else mask.expand(B, H, Lq, Lk)


def _check_launcher(q, k, v, r, u, vb, wl, wr, kpm=None, mask=None, scale=None, name="",
                    **kw):
    """Run the launcher; check out and lse against the oracle (and the contract's layout)."""
    B, Lq, H, D = q.shape
    Lk = k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    am = _expand_mask(mask, B, H, Lq, Lk)
    out, lse = rel_attn_fwd(q, k, v, r, u, vb, scale, wl, wr, kpm, am, **kw)
    assert out.shape == (B, Lq, H, D) and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (B, H, Lq) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert out.device == q.device and lse.device == q.device

    truth, t_lse = rel_attention_reference(*[t.detach().double() for t in (q, k, v, r, u, vb)],
                                           scale, wl, wr, kpm, mask, return_lse=True)
    same, s_lse = rel_attention_reference(q, k, v, r, u, vb, scale, wl, wr, kpm, mask,
                                          return_lse=True)
    # rows with no allowed key: exactly 0 and +inf
    has = allowed_pairs(Lq, Lk, wl, wr, kpm, mask, q.device).expand(B, H, Lq, Lk).any(-1)
    empty = ~has  # [B, H, Lq]
    if empty.any():
        assert torch.all(out.permute(0, 2, 1, 3)[empty] == 0), f"{name}: masked rows not 0"
        assert torch.all(torch.isposinf(lse[empty])), f"{name}: masked rows' lse not +inf"
    assert_within(f"{name} out", out, same, truth)
    if has.any():
        assert torch.isfinite(lse[has]).all(), f"{name}: non-finite lse on a live row"
        assert_within(f"{name} lse", lse[has], s_lse[has].float(), t_lse[has])
    return out, lse


def _kpm(B, Lk, n_pad, device):
    m = torch.zeros(B, Lk, dtype=torch.bool)
    for b in range(B):
        m[b, Lk - n_pad * (b + 1):] = True  # different padding per batch
    return m.to(device)


# --------------------------------------------------------------------------------------------
# through the public API: rel_attention(..., backend="triton")

# name: (B, Lq, Lk, H, D, R, layout, kwargs builder)
API_CASES = {
    "causal_mlen0": (2, 37, 37, 2, 16, None, "bshd", lambda B, Lq, Lk, H, d: {}),
    "causal_mlen_lt_lq": (2, 37, 50, 2, 41, None, "sbhd", lambda B, Lq, Lk, H, d: {}),
    "causal_mlen_gt_lq": (1, 37, 120, 2, 64, None, "bshd", lambda B, Lq, Lk, H, d: {}),
    "q1": (2, 1, 40, 2, 16, None, "sbhd", lambda B, Lq, Lk, H, d: {}),
    "q64": (1, 64, 200, 1, 16, None, "bshd", lambda B, Lq, Lk, H, d: {}),
    "window_same_length": (1, 37, 100, 2, 16, None, "sbhd",
                           lambda B, Lq, Lk, H, d: {"window_size": (20, 0)}),
    "window_two_sided": (1, 37, 60, 2, 16, 60 + 36, "bshd",
                         lambda B, Lq, Lk, H, d: {"causal": False, "window_size": (9, 5)}),
    "key_padding": (2, 37, 60, 2, 16, None, "bshd",
                    lambda B, Lq, Lk, H, d: {"key_padding_mask": _kpm(B, Lk, 7, d)}),
    "dense_mask_full": (2, 37, 50, 2, 16, None, "sbhd", lambda B, Lq, Lk, H, d: {
        "attn_mask": torch.rand(B, H, Lq, Lk, generator=torch.Generator().manual_seed(1))
        .lt(0.3).to(d)}),
    "dense_mask_lq_lk": (2, 37, 50, 2, 16, None, "bshd", lambda B, Lq, Lk, H, d: {
        "attn_mask": torch.rand(Lq, Lk, generator=torch.Generator().manual_seed(2))
        .lt(0.3).to(d)}),
    "conformer": (2, 37, 37, 2, 16, 2 * 37 - 1, "sbhd",
                  lambda B, Lq, Lk, H, d: {"causal": False}),
}


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("case", list(API_CASES))
def test_rel_attention_triton(case, dtype):
    B, Lq, Lk, H, D, R, layout, build = API_CASES[case]
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, R=R, dtype=dtype, device=DEV,
                                    layout=layout, seed=sum(map(ord, case)))
    kw = build(B, Lq, Lk, H, DEV)
    out = txl_kernels.rel_attention(q, k, v, r, u, vb, backend="triton", **kw)
    same = txl_kernels.rel_attention(q, k, v, r, u, vb, backend="reference", **kw)
    causal = kw.get("causal", True)
    wl, wr = kw.get("window_size", (-1, -1))
    wr = 0 if causal else wr
    mask = kw.get("attn_mask")
    _, truth = oracle(q, k, v, r, u, vb, D ** -0.5, wl, wr, kw.get("key_padding_mask"), mask)
    assert out.shape == (B, Lq, H, D) and out.dtype == dtype
    assert_within(case, out, same, truth)


def test_rel_attention_auto_uses_fused_path():
    """backend="auto" takes the fused kernel where it can run (CUDA, or CPU when interpreting):
    its output is bit-identical to backend="triton"."""
    q, k, v, r, u, vb = make_inputs(1, 20, 30, 2, 16, device=DEV)
    a = txl_kernels.rel_attention(q, k, v, r, u, vb, backend="auto")
    t = txl_kernels.rel_attention(q, k, v, r, u, vb, backend="triton")
    assert torch.equal(a, t)


# --------------------------------------------------------------------------------------------
# launcher: out and lse over the causal grid, all dtypes

LAUNCH_GRID = [  # (B, Lq, Lk, H, D)
    (2, 37, 37, 2, 16),    # mlen 0
    (1, 37, 53, 2, 41),    # mlen < Lq
    (1, 37, 130, 1, 64),   # mlen > Lq
    (2, 1, 1, 2, 16),      # a single pair
    (1, 1, 70, 2, 16),     # one query against memory
    (1, 64, 200, 1, 16),   # several query tiles, long memory
]


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("shape", LAUNCH_GRID, ids=lambda s: "B{}_Lq{}_Lk{}_H{}_D{}".format(*s))
def test_launcher_causal_grid(shape, dtype):
    B, Lq, Lk, H, D = shape
    layout = "sbhd" if Lq % 2 else "bshd"
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, dtype=dtype, device=DEV, layout=layout,
                                    seed=Lq * 7 + Lk)
    _check_launcher(q, k, v, r, u, vb, -1, 0, name=f"{shape}")


@pytest.mark.parametrize("D", [16, 41, 64, 80, 96, 256])
def test_launcher_head_dims(D):
    dtype = torch.float16
    q, k, v, r, u, vb = make_inputs(1, 19, 40, 1, D, dtype=dtype, device=DEV, seed=D)
    _check_launcher(q, k, v, r, u, vb, -1, 0, name=f"D{D}")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "BM{BLOCK_M}_BN{BLOCK_N}".format(**c))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_launcher_block_configs(config, causal):
    """Window chunks C = 2 (BM <= BN) and C = 3 (BN < BM <= 2 BN), with tile edges that do not
    line up with Lq or Lk."""
    Lq, Lk = 37, 90
    R = Lk if causal else Lk + Lq - 1
    q, k, v, r, u, vb = make_inputs(1, Lq, Lk, 2, 32, R=R, device=DEV, seed=5)
    _check_launcher(q, k, v, r, u, vb, -1, 0 if causal else -1, config=config,
                    name=str(config))


def test_launcher_rejects_bad_config():
    q, k, v, r, u, vb = make_inputs(1, 8, 8, 1, 16, device=DEV)
    with pytest.raises(ValueError, match="BLOCK_M <= 2"):
        rel_attn_fwd(q, k, v, r, u, vb, 0.25, -1, 0, None, None,
                     config={"BLOCK_M": 64, "BLOCK_N": 16})


# --------------------------------------------------------------------------------------------
# split-K (scaled-down evaluation shapes: few queries, long memory)

@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_eval_shape(num_splits, dtype):
    B, Lq, Lk, H, D = 2, 16, 150, 2, 64
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, dtype=dtype, device=DEV, layout="sbhd",
                                    seed=num_splits)
    out, lse = _check_launcher(q, k, v, r, u, vb, -1, 0, name=f"split{num_splits}",
                               num_splits=num_splits)
    ref_out, ref_lse = rel_attn_fwd(q, k, v, r, u, vb, D ** -0.5, -1, 0, None, None,
                                    num_splits=1)
    # same tiles, different summation order: close to the unsplit kernel
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_split_with_window_padding_and_empty_splits():
    """More splits than key tiles (empty slices write -inf partials), a window that skips
    most tiles, key padding, and a dense mask that empties a few rows."""
    B, Lq, Lk, H, D = 2, 20, 150, 2, 16
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, device=DEV, seed=11)
    kpm = _kpm(B, Lk, 9, DEV)
    mask = torch.zeros(B, H, Lq, Lk, dtype=torch.bool)
    mask[0, 1, 3] = True
    mask[1, :, 17] = True
    mask = mask.to(DEV)
    for splits in (4, 12):
        _check_launcher(q, k, v, r, u, vb, 40, 0, kpm, mask, name=f"window split{splits}",
                        num_splits=splits)
        _check_launcher(q, k, v, r, u, vb, -1, 0, kpm, mask, name=f"split{splits}",
                        num_splits=splits)


def test_choose_num_splits():
    sms = 132
    # Transformer-XL evaluation: Lq 64 against Lk 3900, B 16, H 8 -> split
    s = fwd_mod.choose_num_splits(16, 8, 64, 3900, -1, 0, sms)
    assert 2 <= s <= 16
    assert 16 * 8 * s >= 2 * sms
    # plenty of programs already -> no split
    assert fwd_mod.choose_num_splits(16, 8, 2048, 2048, -1, 0, sms) == 1
    # short key ranges are not split into slivers
    assert fwd_mod.choose_num_splits(1, 1, 16, 300, -1, 0, sms) == 1
    assert fwd_mod.choose_num_splits(1, 1, 16, 100000, 100, 0, sms) == 1


# --------------------------------------------------------------------------------------------
# masks and edge cases

@pytest.mark.parametrize("num_splits", [1, 3])
def test_fully_masked_rows(num_splits):
    """Rows with no allowed key give exactly 0 and lse = +inf, other rows are unaffected."""
    B, Lq, Lk, H, D = 2, 21, 40, 2, 16
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, device=DEV, seed=3)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[1] = True  # batch 1: every key padded
    mask = torch.zeros(Lq, Lk, dtype=torch.bool)
    mask[[0, 5, 20]] = True  # a few rows fully masked in every batch and head
    kpm, mask = kpm.to(DEV), mask.to(DEV)
    out, lse = _check_launcher(q, k, v, r, u, vb, -1, 0, kpm, mask, name="masked rows",
                               num_splits=num_splits)
    assert torch.all(out[1] == 0) and torch.all(torch.isposinf(lse[1]))
    assert torch.all(out[0, [0, 5, 20]] == 0)
    assert torch.isfinite(lse[0, :, 1]).all()


def test_window_excludes_whole_query_tiles():
    """Narrow windows: most key tiles of each query tile lie outside the band and are skipped
    by the loop bounds (the diagonal only, a two-sided band, causal plus a short lookahead)."""
    B, Lq, Lk, H, D = 1, 33, 100, 2, 16
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, R=Lk + Lq - 1, device=DEV, seed=4)
    _check_launcher(q, k, v, r, u, vb, 0, 0, name="diagonal only")
    _check_launcher(q, k, v, r, u, vb, 5, 3, name="band")
    _check_launcher(q, k, v, r, u, vb, -1, 2, name="causal + lookahead 2")


@pytest.mark.parametrize("case", ["causal", "conformer", "window"])
def test_r_rows_outside_never_read(case):
    """r is a narrow slice of a NaN-filled table: a read outside [0, R) would leak NaN."""
    B, Lq, H, D = 2, 29, 2, 16
    Lk = 29 if case == "conformer" else 70
    R = {"causal": Lk, "conformer": 2 * Lq - 1, "window": Lk}[case]
    wl, wr = {"causal": (-1, 0), "conformer": (-1, -1), "window": (12, 0)}[case]
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, R=R, device=DEV, seed=8)
    big = torch.full((R + 64, H, D), float("nan"), dtype=r.dtype, device=DEV)
    big[32:32 + R] = r
    r_view = big[32:32 + R]
    for splits in (1, 2):
        out, lse = _check_launcher(q, k, v, r_view, u, vb, wl, wr, name=case,
                                   num_splits=splits)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()


def test_descriptor_and_pointer_loads_agree():
    """K / V / R load through TMA descriptors when every base and row stride is 16-byte
    aligned, through pointers otherwise: the same inputs, moved to an address one element off,
    take the pointer path and give the same output and lse, bit for bit."""
    B, Lq, Lk, H, D = 2, 21, 37, 2, 16
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, device=DEV, seed=12)

    def shifted(t):  # the same values at an address 1 element past a 16-byte boundary
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        return view

    k2, v2, r2 = shifted(k), shifted(v), shifted(r)
    assert descriptors_ok(k, v, r) and not descriptors_ok(k2, v2, r2)
    for wl, wr in ((-1, 0), (9, 3)):
        out, lse = _check_launcher(q, k, v, r, u, vb, wl, wr, name="descriptors")
        out2, lse2 = _check_launcher(q, k2, v2, r2, u, vb, wl, wr, name="pointers")
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


OPERAND_TILE_CASES = [  # (B, Lq, Lk, H, D, window_left, window_right, extra)
    (1, 1, 1, 2, 48, -1, 0, None),          # a single pair
    (2, 37, 37, 2, 48, -1, 0, None),        # odd length, causal
    (1, 37, 70, 1, 96, 20, 3, "kpm"),       # D 96 (BLOCK_D 128), memory, window, padding
    (1, 37, 53, 2, 128, -1, -1, "split"),   # D 128, no mask, split-K
    (2, 19, 40, 2, 128, -1, 0, "dropout"),
    (1, 21, 45, 2, 64, -1, 0, "mem8"),      # 8-bit memory in front of k / v
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_dtype_id)
@pytest.mark.parametrize("case", OPERAND_TILE_CASES, ids=lambda c: "_".join(map(str, c)))
def test_operand_tiles_match_registers(case, dtype):
    """OP_TILES (``operand_tiles=True``): (q + u) and (q + vb) made once by the operands
    kernel and read back as TMA tiles give the same output and lse as the operands formed in
    registers, bit for bit (the same rounding of the same sums), and match the oracle."""
    B, Lq, Lk, H, D, wl, wr, extra = case
    layout = "sbhd" if Lq % 2 else "bshd"  # (the operands kernel reads q through its strides)
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, dtype=dtype, device=DEV, seed=Lk + D,
                                    layout=layout)
    kw = {}
    kpm = None
    if extra == "kpm":
        kpm = _kpm(B, Lk, 5, DEV)
    elif extra == "split":
        kw["num_splits"] = 3
    elif extra == "dropout":
        kw.update(dropout_p=0.2, dropout_seed=torch.tensor([7, 11], device=DEV))
    elif extra == "mem8":
        mk, mv = k[:, :24], v[:, :24]
        kw["memory"] = quantize_kv(mk, mv, torch.int8, torch.float32)
        k, v = k[:, 24:].contiguous(), v[:, 24:].contiguous()
    got = rel_attn_fwd(q, k, v, r, u, vb, D ** -0.5, wl, wr, kpm, None, operand_tiles=True,
                       **kw)
    regs = rel_attn_fwd(q, k, v, r, u, vb, D ** -0.5, wl, wr, kpm, None, operand_tiles=False,
                        **kw)
    assert torch.equal(got[0], regs[0]) and torch.equal(got[1], regs[1])
    if extra not in ("dropout", "mem8"):  # (those two: their own tests check the math)
        _check_launcher(q, k, v, r, u, vb, wl, wr, kpm, operand_tiles=True, name="op tiles",
                        **kw)


def test_operand_tiles_default_and_bad_request():
    """The launch takes OP_TILES where ``_operand_tiles`` says (sm_90 family, 16-bit, head
    dims 65..128, TMA descriptors, no dense mask, no 8-bit memory), and forcing it where tiles
    load through pointers is a clear error, not a wrong answer."""
    assert fwd_mod._operand_tiles("sm90", 128, torch.bfloat16, True)
    assert not fwd_mod._operand_tiles("sm90", 64, torch.bfloat16, True)
    assert not fwd_mod._operand_tiles("sm90", 128, torch.float32, True)
    assert not fwd_mod._operand_tiles("sm90", 128, torch.float16, False)
    assert not fwd_mod._operand_tiles("sm90", 128, torch.float16, True, dense_mask=True)
    assert not fwd_mod._operand_tiles("sm90", 128, torch.float16, True, quant_mem=True)
    assert not fwd_mod._operand_tiles("sm80", 128, torch.float16, True)
    assert fwd_mod._default_config(128, False)["BLOCK_M"] == 128
    assert fwd_mod._default_config(128, False, operand_tiles=False)["BLOCK_M"] == 64
    q, k, v, r, u, vb = make_inputs(1, 5, 9, 1, 41, dtype=torch.float16, device=DEV)
    assert not descriptors_ok(k, v, r)  # D 41: rows are not 16-byte multiples
    with pytest.raises(ValueError, match="operand_tiles=True needs TMA descriptors"):
        rel_attn_fwd(q, k, v, r, u, vb, 41 ** -0.5, -1, 0, operand_tiles=True)


def test_strided_inputs_and_masks():
    """Non-contiguous views everywhere: q whose last dim is strided (copied), seq-first k / v,
    r and biases sliced from larger tensors, a transposed key_padding_mask and a dense mask
    viewed through a transpose."""
    B, Lq, Lk, H, D = 2, 23, 45, 2, 16
    g = torch.Generator().manual_seed(9)
    qbig = torch.randn(B, Lq, H, 2 * D, generator=g)
    q = qbig[..., ::2]  # stride(-1) == 2
    k = torch.randn(Lk, B, H, D, generator=g).transpose(0, 1)
    v = torch.randn(Lk, B, H, D, generator=g).transpose(0, 1)
    r = torch.randn(Lk, H + 1, D, generator=g)[:, 1:]
    u = torch.randn(H, 3 * D, generator=g)[:, D:2 * D]
    vb = torch.randn(H, 3 * D, generator=g)[:, :D]
    kpm = (torch.rand(Lk, B, generator=g) < 0.2).t()
    mask = (torch.rand(B, H, Lk, Lq, generator=g) < 0.2).transpose(-1, -2)
    ts = [t.to(DEV) for t in (q, k, v, r, u, vb, kpm, mask)]
    assert ts[0].stride(-1) == 2 and not ts[6].is_contiguous() and not ts[7].is_contiguous()
    _check_launcher(*ts[:6], -1, 0, ts[6], ts[7], name="strided")


def test_softmax_scale_and_large_scores():
    """A non-default scale and inputs large enough that an unstabilised softmax overflows."""
    q, k, v, r, u, vb = make_inputs(1, 17, 40, 2, 16, device=DEV, seed=6, scale=6.0)
    _check_launcher(q, k, v, r, u, vb, -1, 0, scale=0.7, name="large scores")


# --------------------------------------------------------------------------------------------
# GPU only

@requires_cuda
@pytest.mark.skipif(INTERPRET, reason="GPU autotuner")
def test_autotuned_gpu(monkeypatch):
    monkeypatch.setenv("TXL_KERNELS_AUTOTUNE", "1")
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, r, u, vb = make_inputs(2, 200, 700, 4, 64, dtype=dtype, device="cuda")
        _check_launcher(q, k, v, r, u, vb, -1, 0, name="autotuned")


@requires_cuda
@pytest.mark.skipif(INTERPRET, reason="GPU shape")
def test_eval_shape_gpu_auto_split():
    """The Transformer-XL evaluation shape: the automatic split keeps the GPU busy and matches
    the reference."""
    B, Lq, Lk, H, D = 16, 64, 3900, 8, 64
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert fwd_mod.choose_num_splits(B, H, Lq, Lk, -1, 0, sms) > 1
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, dtype=torch.bfloat16, device="cuda",
                                    layout="sbhd")
    _check_launcher(q, k, v, r, u, vb, -1, 0, name="eval shape")


@requires_cuda
@pytest.mark.skipif(INTERPRET, reason="GPU memory")
def test_int64_offsets_gpu():
    """k, v and r with more than 2^31 elements; a window keeps the work on the last keys,
    whose offsets only fit in int64."""
    H, D, Lq = 1, 64, 16
    Lk = 2 ** 31 // (H * D) + 4096
    try:
        k = torch.randn(1, Lk, H, D, dtype=torch.float16, device="cuda")
        v = torch.randn(1, Lk, H, D, dtype=torch.float16, device="cuda")
        r = torch.randn(Lk, H, D, dtype=torch.float16, device="cuda")
    except torch.OutOfMemoryError:  # pragma: no cover
        pytest.skip("not enough GPU memory")
    assert k.numel() > 2 ** 31
    q, _, _, _, u, vb = make_inputs(1, Lq, Lq, H, D, dtype=torch.float16, device="cuda")
    wl = 100
    out, lse = rel_attn_fwd(q, k, v, r, u, vb, D ** -0.5, wl, 0, None, None)
    # same pairs on the last 200 keys: j' = j - (Lk - 200), r rows shift by the same amount
    n = 200
    ks, vs, rs = k[:, -n:], v[:, -n:], r[Lk - n:]
    same = rel_attention_reference(q, ks, vs, rs, u, vb, D ** -0.5, wl, 0)
    truth = rel_attention_reference(*[t.double() for t in (q, ks, vs, rs, u, vb)], D ** -0.5,
                                    wl, 0)
    assert_within("int64", out, same, truth)


def test_default_config_is_tunable():
    """TXL_KERNELS_AUTOTUNE=0 runs one fixed config that the autotuner also offers (and keeps
    after pruning) for every head-dim bucket and precision."""
    table = {(bm, bn, nw, ns) for bm, bn, nw, ns in fwd_mod._CONFIG_TABLE}
    for block_d in (16, 32, 64, 128, 256):
        for exact_fp32, wide in ((False, False), (False, True), (True, True)):
            c = fwd_mod._default_config(block_d, exact_fp32, wide)
            key = (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"])
            assert key in table, (block_d, exact_fp32, wide, key)
            assert fwd_mod._config_ok(*key, block_d, exact_fp32, wide), (block_d, key)


def test_choose_num_splits_reads_block_m():
    """The split decision counts query tiles of the BLOCK_M the launch uses."""
    sms = 132
    # 5 heads x 4096 queries (no window): 320 tiles of 64 fill the GPU, 160 tiles of 128 do not
    assert fwd_mod.choose_num_splits(1, 5, 4096, 4096, -1, -1, sms, 64) == 1
    assert fwd_mod.choose_num_splits(1, 5, 4096, 4096, -1, -1, sms, 128) > 1
