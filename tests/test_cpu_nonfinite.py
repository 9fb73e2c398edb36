"""What the masks exclude never reaches the CPU kernels' results, the cases proper to the C++
kernels (tests/test_masked_nonfinite.py runs the shared cases on every backend, "cpu"
included): an allowed pair that uses a non-finite value stays non-finite even where its
probability underflows to 0; non-finite 8-bit memory data and scales of padded rows; the C++
decode ops never read the cache slots that their left window excludes."""
import pytest
import torch

from txl_kernels import QuantizedKV, rel_attention

POISONS = [float("nan"), float("inf"), float("-inf")]


@pytest.fixture(scope="module", autouse=True)
def cpu_kernel(extension):
    from txl_kernels.cpu_kernel import cpu_kernel_available

    ok, why = cpu_kernel_available()
    assert ok, why


def _inputs(Lq, Lk, R, D=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype)
            for s in ((1, Lq, 1, D), (1, Lk, 1, D), (1, Lk, 1, D), (R, 1, D), (1, D), (1, D))]


def _run(backend, ts, **kw):
    ts = [t.clone().requires_grad_() for t in ts]
    out = rel_attention(*ts, backend=backend, **kw)
    out.sum().backward()
    return out.detach(), [t.grad for t in ts]


def _poisoned(ts, where, value):
    """(the inputs with ``value`` at ``where`` = [(tensor index, index)], the same with 0)"""
    bad, zero = [t.clone() for t in ts], [t.clone() for t in ts]
    for w, idx in where:
        bad[w][idx] = value
        zero[w][idx] = 0.0
    return bad, zero


@pytest.mark.parametrize("dtype, Lk", [(torch.float64, 6), (torch.float32, 20)])
def test_allowed_pair_with_a_nonfinite_value_stays_nonfinite(dtype, Lk, cpu_isa):
    """An allowed key whose v is NaN poisons the rows that attend it, even where its
    probability underflows to 0 (0 * NaN), as the reference does. In fp32 on every ISA
    variant of the row code, with rows long enough for its vector loops."""
    ts = _inputs(4, Lk, Lk + 3, seed=6, dtype=dtype)
    kpm = torch.zeros(1, Lk, dtype=torch.bool)
    kpm[0, 2] = True
    bad, _ = _poisoned(ts, [(2, (0, 4))], float("nan"))
    out, grads = _run("cpu", bad, causal=False, key_padding_mask=kpm)
    assert torch.isnan(out).all(dim=-1).all()
    assert torch.isnan(grads[0]).any()
    # a saturated softmax (scale 1e6): key 4's probability is exactly 0 for some rows
    out = rel_attention(*bad, causal=False, key_padding_mask=kpm, softmax_scale=1e6,
                        backend="cpu")
    assert torch.isnan(out).all(dim=-1).all()


@pytest.mark.parametrize("value", POISONS)
def test_band_tiles_keep_excluded_nonfinite_rows_out(value, cpu_isa):
    """Band tiles (a window narrow against the keys: the forward copies each chunk's k / v
    rows and flags its non-finite v rows, the backward copies each head's): the query rows
    whose window holds no poisoned k / v row equal the reference's, finite, in the output and
    dq; the others are not finite. Rows at both ends of the forward's 512-query chunks and
    inside one, two chunks sharing rows."""
    Lq = Lk = 700
    left, right = 5, 3
    ts = _inputs(Lq, Lk, Lq + Lk - 1, D=8, seed=3, dtype=torch.float32)
    keys = (0, 200, 300, 509, 511, 512, 515, 699)
    bad, _ = _poisoned(ts, [(2, (0, j)) for j in keys if j != 200] + [(1, (0, 200))], value)
    out, grads = _run("cpu", bad, causal=False, window_size=(left, right))
    ref, ref_grads = _run("reference", bad, causal=False, window_size=(left, right))
    i = torch.arange(Lq)
    clean = torch.ones(Lq, dtype=torch.bool)
    for j in keys:  # query i sees key j when -right <= i - j <= left
        clean &= ~((i - j <= left) & (i - j >= -right))
    assert 0 < clean.sum() < Lq
    for got, want in ((out, ref), (grads[0], ref_grads[0])):
        torch.testing.assert_close(got[0, clean], want[0, clean], rtol=1e-4, atol=1e-5)
        assert torch.isfinite(got[0, clean]).all()
        assert not torch.isfinite(got[0, ~clean]).all(dim=-1).all(dim=-1).any()


@pytest.mark.parametrize("value", POISONS)
@pytest.mark.parametrize("which", ["v_scale", "k_scale", "v", "k"])
def test_8bit_memory_padded_row_reaches_nothing(value, which):
    B, Lq, M, H, D = 1, 4, 5, 1, 4
    q, k, v, r, u, vb = _inputs(Lq, Lq, M + 2 * Lq - 1, seed=7)
    g = torch.Generator().manual_seed(8)
    mem = QuantizedKV(torch.randint(-127, 128, (B, M, H, D), generator=g, dtype=torch.int8),
                      torch.rand(B, M, H, generator=g) + 0.01,
                      torch.randint(-127, 128, (B, M, H, D), generator=g, dtype=torch.int8),
                      torch.rand(B, M, H, generator=g) + 0.01)
    kpm = torch.zeros(B, M + Lq, dtype=torch.bool)
    kpm[0, 1] = True
    bad = list(mem)
    zero = list(mem)
    if which in ("k_scale", "v_scale"):
        i = 1 if which == "k_scale" else 3
        bad[i], zero[i] = bad[i].clone(), zero[i].clone()
        bad[i][0, 1] = value
        zero[i][0, 1] = 0.0
        kw = dict(causal=False, key_padding_mask=kpm)
        out = rel_attention(q, k, v, r, u, vb, memory=QuantizedKV(*bad), backend="cpu", **kw)
        want = rel_attention(q, k, v, r, u, vb, memory=QuantizedKV(*zero), backend="reference",
                             **kw)
    else:  # a padded row of the current segment (key M + 2)
        kpm[0, M + 2] = True
        t = k if which == "k" else v
        tb, tz = t.clone(), t.clone()
        tb[0, 2], tz[0, 2] = value, 0.0
        kb, vb_ = (tb, v) if which == "k" else (k, tb)
        kz, vz = (tz, v) if which == "k" else (k, tz)
        kw = dict(causal=False, key_padding_mask=kpm, memory=mem)
        out = rel_attention(q, kb, vb_, r, u, vb, backend="cpu", **kw)
        want = rel_attention(q, kz, vz, r, u, vb, backend="reference", **kw)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def _decode_inputs(Lc, M=0, seed=9, dtype=torch.float64):
    B, H, D = 2, 2, 8
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    q, k, v, r, u = rnd(B, H, D), rnd(Lc, B, H, D), rnd(Lc, B, H, D), rnd(M + Lc, H, D), \
        rnd(H, D)
    mem = []
    if M:
        mem = [torch.randint(-127, 128, (M, B, H, D), generator=g, dtype=torch.int8),
               torch.rand(M, B, H, generator=g) + 0.01,
               torch.randint(-127, 128, (M, B, H, D), generator=g, dtype=torch.int8),
               torch.rand(M, B, H, generator=g) + 0.01]
    return [q, k, v, r, u, u.flip(-1)], mem


@pytest.mark.parametrize("value", POISONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_attention_never_reads_slots_before_its_window(value, dtype, cpu_isa):
    (q, k, v, r, u, vb), mem = _decode_inputs(7, M=4, dtype=dtype)
    lo = 6  # keys 0..5 excluded: memory rows 0..3 and cache rows 0..1

    def attend(q, k, v, r, u, vb, scale, lo, *mem):  # in the cache's seq-first layout
        lk = r.shape[0]
        return torch.ops.txl_kernels.rel_attn_decode(
            q[:, None], k.transpose(0, 1), v.transpose(0, 1), r, u, vb, scale, lk - 1 - lo,
            *(t.transpose(0, 1) for t in mem))[:, 0]
    want = attend(q, k, v, r, u, vb, 0.3, lo, *mem)
    kb, vb_, rb = k.clone(), v.clone(), r.clone()
    kb[:2], vb_[:2], rb[:lo] = value, value, value
    memb = [t.clone() for t in mem]
    memb[1][:], memb[3][:] = value, value
    got = attend(q, kb, vb_, rb, u, vb, 0.3, lo, *memb)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isfinite(got).all()
    # an allowed slot with a non-finite value poisons the output
    vb_[2, 0, 0, 0] = float("nan")
    assert torch.isnan(attend(q, kb, vb_, rb, u, vb, 0.3, lo, *memb)[0, 0, 0])


@pytest.mark.parametrize("value", POISONS)
def test_decode_layer_never_reads_slots_before_its_window(value):
    B, dm, H, D, di, Lc = 2, 12, 2, 4, 20, 6
    g = torch.Generator().manual_seed(10)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x, qkv, o = rnd(B, dm), rnd(3 * H * D, dm), rnd(dm, H * D)
    ln_w, ln_b, f1, b1, f2, b2 = rnd(dm), rnd(dm), rnd(di, dm), rnd(di), rnd(dm, di), rnd(dm)
    kv, r, u = rnd(Lc, B, H * D), rnd(Lc, H, D), rnd(H, D)
    lo = 3

    def call(keys, values, r):
        return torch.ops.txl_kernels.decode_layer(
            x=x, qkv_w=qkv, o_w=o, ln1_w=ln_w, ln1_b=ln_b, eps1=1e-5, ff1_w=f1, ff1_b=b1,
            ff2_w=f2, ff2_b=b2, ln2_w=ln_w, ln2_b=ln_b, eps2=1e-5, pre_lnorm=False,
            keys=keys, values=values, r=r, u=u, vb=u, softmax_scale=0.5, lo=lo)

    want = call(kv.clone(), kv.clone(), r)
    kb, vb_, rb = kv.clone(), kv.clone(), r.clone()
    kb[:lo], vb_[:lo], rb[:lo] = value, value, value
    got = call(kb, vb_, rb)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
