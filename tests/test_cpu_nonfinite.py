"""What the masks exclude never reaches the CPU kernels' results (issue #42, item 1): NaN / inf
in the k, v, r rows (or 8-bit scales) of keys that key_padding_mask, causal, window_size or
attn_mask exclude leave every output and gradient as the reference gives them with those
entries 0; a row with no allowed key gives 0 and zero gradients; an allowed pair that uses a
non-finite operand still gives a non-finite result. The C++ decode ops likewise never read the
cache slots that their left window excludes."""
import pytest
import torch

from txl_kernels import QuantizedKV, rel_attention

POISONS = [float("nan"), float("inf"), float("-inf")]
NAMES = ("q", "k", "v", "r", "r_w_bias", "r_r_bias")


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


def _check_like_reference(ts, where, value, rows=slice(None), **kw):
    """The CPU kernel on the poisoned inputs equals the reference on the zeroed ones: the output
    (query rows ``rows``) and, when ``rows`` is every row, every gradient."""
    bad, zero = _poisoned(ts, where, value)
    out, grads = _run("cpu", bad, **kw)
    want, wgrads = _run("reference", zero, **kw)
    torch.testing.assert_close(out[:, rows], want[:, rows], rtol=1e-10, atol=1e-12)
    if rows == slice(None):
        for name, g, w in zip(NAMES, grads, wgrads):
            assert torch.isfinite(g).all(), f"d{name} has non-finite entries"
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"d{name}")
    return out, grads


@pytest.mark.parametrize("value", POISONS)
@pytest.mark.parametrize("which", [1, 2], ids=["k", "v"])
def test_padded_key_reaches_nothing(which, value):
    """Key 2 padded (kpm[0, 2]) with a non-finite k or v: every output and gradient as with
    that row 0."""
    ts = _inputs(4, 6, 9, seed=which)
    kpm = torch.zeros(1, 6, dtype=torch.bool)
    kpm[0, 2] = True
    _check_like_reference(ts, [(which, (0, 2))], value, causal=False, key_padding_mask=kpm)


@pytest.mark.parametrize("value", POISONS)
def test_causal_future_value_reaches_only_the_row_that_sees_it(value):
    """Lk 600 (several query blocks and key tiles): key 599 is allowed only for query 599."""
    ts = _inputs(600, 600, 600, seed=2)
    out, grads = _check_like_reference(ts, [(2, (0, 599))], value, rows=slice(0, 599),
                                       causal=True)
    assert not torch.isfinite(out[0, 599]).all()  # the allowed pair stays poisoned
    _, wgrads = _run("reference", _poisoned(ts, [(2, (0, 599))], value)[1], causal=True)
    torch.testing.assert_close(grads[0][:, :599], wgrads[0][:, :599], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("value", POISONS)
def test_position_rows_of_excluded_pairs_reach_nothing(value):
    """Causal Lq 4, Lk 8: rows r[8:] serve only pairs j > i + 4, which causal excludes."""
    ts = _inputs(4, 8, 11, seed=3)
    _check_like_reference(ts, [(3, (slice(8, None),))], value, causal=True)


@pytest.mark.parametrize("value", POISONS)
def test_window_and_dense_mask_exclusions_reach_nothing(value):
    """Keys outside a window and a key masked by attn_mask for every row: neither k, v nor
    the r rows of their pairs reach anything."""
    ts = _inputs(5, 9, 13, seed=4)
    mask = torch.zeros(5, 9, dtype=torch.bool)
    mask[:, 6] = True
    _check_like_reference(ts, [(1, (0, 6)), (2, (0, 6)), (2, (0, 0)), (1, (0, 0))], value,
                          causal=False, window_size=(3, 1), attn_mask=mask)


@pytest.mark.parametrize("value", POISONS)
def test_rows_without_an_allowed_key_give_zero(value):
    ts = _inputs(4, 6, 9, seed=5)
    kpm = torch.zeros(1, 6, dtype=torch.bool)
    kpm[0, 3] = True
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[1] = True  # query 1 has no allowed key
    out, grads = _check_like_reference(ts, [(2, (0, 3)), (1, (0, 3))], value, causal=False,
                                       key_padding_mask=kpm, attn_mask=mask)
    assert (out[0, 1] == 0).all() and (grads[0][0, 1] == 0).all()
    # every key padded: all rows 0, all gradients 0
    out, grads = _check_like_reference(ts, [(2, (0, 3)), (1, (0, 1))], value, causal=False,
                                       key_padding_mask=torch.ones(1, 6, dtype=torch.bool))
    assert (out == 0).all() and all((g == 0).all() for g in grads)


def test_allowed_pair_with_a_nonfinite_value_stays_nonfinite():
    """An allowed key whose v is NaN poisons the rows that attend it, even where its
    probability underflows to 0 (0 * NaN), as the reference does."""
    ts = _inputs(4, 6, 9, seed=6)
    kpm = torch.zeros(1, 6, dtype=torch.bool)
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
def test_decode_attention_never_reads_slots_before_its_window(value, dtype):
    (q, k, v, r, u, vb), mem = _decode_inputs(7, M=4, dtype=dtype)
    lo = 6  # keys 0..5 excluded: memory rows 0..3 and cache rows 0..1
    attend = torch.ops.txl_kernels.decode_attention
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
            keys=keys, values=values, r=r, u=u, vb=u, scale=0.5, lo=lo)

    want = call(kv.clone(), kv.clone(), r)
    kb, vb_, rb = kv.clone(), kv.clone(), r.clone()
    kb[:lo], vb_[:lo], rb[:lo] = value, value, value
    got = call(kb, vb_, rb)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
