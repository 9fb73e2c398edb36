"""attn_mask_band: a dense mask described as a band on the device (mask_to_band), so the fused
kernel skips tiles and reads no mask when it is one, without a host sync. Same results as the
dense mask, forward and gradients, on the reference and fused paths."""
import pytest
import torch

from txl_kernels import mask_to_band, rel_attention

from helpers import FUSED_DEVICE, make_inputs


def _causal(lq, lk):
    return torch.triu(torch.ones(lq, lk, dtype=torch.bool), 1 + lk - lq)


def _same_length(lq, lk, mem_len):
    ones = torch.ones(lq, lk)
    mask_len = lk - mem_len
    shift = lq - mask_len if mask_len > 0 else lq
    return (torch.triu(ones, 1 + lk - lq) + torch.tril(ones, -shift)).bool()


@pytest.mark.parametrize("lq,lk,mem_len,want", [
    (5, 8, None, [1, 7, 0]),          # unbounded left side: Lk - 1 (no sentinel)
    (4, 4, None, [1, 3, 0]),
    (1, 7, None, [1, 6, 0]),          # one query sees every key: the shapes' whole range
    (6, 12, 6, [1, 5, 0]),            # same_length: d <= mem_len - 1
    (6, 9, 6, [1, 5, 0]),
])
def test_mask_to_band_values(lq, lk, mem_len, want):
    mask = _causal(lq, lk) if mem_len is None else _same_length(lq, lk, mem_len)
    assert mask_to_band(mask).tolist() == want
    assert mask_to_band(mask.expand(2, 3, lq, lk)).tolist() == want
    assert mask_to_band(mask).dtype == torch.int32


def test_mask_to_band_rejects_non_bands():
    g = torch.Generator().manual_seed(0)
    rnd = torch.rand(5, 9, generator=g) < 0.3
    assert mask_to_band(rnd)[0] == 0
    causal = _causal(5, 9)
    per_batch = torch.stack([causal, causal.clone()])
    per_batch[1, 0, 0] = True  # batch 1 differs: not one band for all
    assert mask_to_band(per_batch[:, None])[0] == 0
    with pytest.raises(TypeError, match="bool"):
        mask_to_band(causal.to(torch.uint8))


def test_mask_to_band_any_sign_and_empty():
    """Bands that leave out the diagonal are plain bounds of either sign (never read as
    "unbounded"); a mask that allows nothing is the band that allows nothing."""
    strictly_causal = torch.triu(torch.ones(4, 4, dtype=torch.bool))  # allowed: d >= 1
    assert mask_to_band(strictly_causal).tolist() == [1, 3, -1]
    future_only = torch.tril(torch.ones(4, 7, dtype=torch.bool), 3)   # allowed: d <= -1
    assert mask_to_band(future_only).tolist() == [1, -1, 3]
    d = torch.arange(5)[:, None] + 3 - torch.arange(8)
    assert mask_to_band((d < 2) | (d > 5)).tolist() == [1, 5, -2]      # 2 <= d <= 5
    assert mask_to_band(torch.ones(3, 5, dtype=torch.bool)).tolist() == [1, -3, -5]
    assert mask_to_band(torch.ones(0, 2, 3, 5, dtype=torch.bool)).tolist() == [1, -3, -5]
    assert mask_to_band(torch.ones(3, 0, dtype=torch.bool)).tolist() == [1, -3, 0]


def _signed_masks(lq, lk):
    d = torch.arange(lq)[:, None] + (lk - lq) - torch.arange(lk)
    return {
        "strictly_causal": torch.triu(torch.ones(lq, lk, dtype=torch.bool), lk - lq),
        "future_only": d >= 0,
        "distance_2_to_5": (d < 2) | (d > 5),
        "distance_-6_to_-1": (d < -6) | (d > -1),
        "nothing": torch.ones(lq, lk, dtype=torch.bool),
    }


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name", ["strictly_causal", "future_only", "distance_2_to_5",
                                  "distance_-6_to_-1", "nothing"])
def test_band_of_any_sign_equals_dense_mask(backend, name):
    """Regression: a band without the diagonal was read as unbounded (row 0 of a strictly
    causal mask attended). Forward and every gradient equal the dense mask's."""
    B, Lq, Lk, H, D = 1, 9, 13, 2, 16
    mask = _signed_masks(Lq, Lk)[name].to(FUSED_DEVICE)
    results = []
    for band in (None, mask_to_band(mask)):
        ts = make_inputs(B, Lq, Lk, H, D, R=Lk + Lq - 1, device=FUSED_DEVICE,
                         requires_grad=True, seed=6)
        out = rel_attention(*ts, causal=False, attn_mask=mask, attn_mask_band=band,
                            backend=backend)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
                     .to(out.device))
        results.append([out.detach()] + [t.grad for t in ts])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    empty_rows = mask.all(-1)
    assert (results[1][0][:, empty_rows] == 0).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_strictly_causal_band_row_zero_attends_nothing(backend):
    """No self-attention and no memory: row 0 has no key, so its output is 0."""
    m = torch.triu(torch.ones(4, 4, dtype=torch.bool)).to(FUSED_DEVICE)
    ts = make_inputs(1, 4, 4, 2, 16, R=7, device=FUSED_DEVICE, seed=1)
    out = rel_attention(*ts, causal=False, attn_mask=m, attn_mask_band=mask_to_band(m),
                        backend=backend)
    assert (out[:, 0] == 0).all() and (out[:, 1:] != 0).any()


def _masks(lq, lk):
    g = torch.Generator().manual_seed(3)
    causal = _causal(lq, lk)
    return {
        "causal": causal,
        "same_length": _same_length(lq, lk, lk - lq + 2),
        "causal_plus_random": causal | (torch.rand(lq, lk, generator=g) < 0.25),
        "per_head": (torch.rand(2, 1, lq, lk, generator=g) < 0.3) | causal,
    }


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name", ["causal", "same_length", "causal_plus_random", "per_head"])
def test_band_path_equals_dense_mask(backend, name):
    B, Lq, Lk, H, D = 2, 19, 37, 2, 16
    mask = _masks(Lq, Lk)[name].to(FUSED_DEVICE)
    kpm = torch.zeros(B, Lk, dtype=torch.bool, device=FUSED_DEVICE)
    kpm[1, 3] = True
    results = []
    for band in (None, mask_to_band(mask)):
        ts = make_inputs(B, Lq, Lk, H, D, R=Lk + Lq - 1, device=FUSED_DEVICE,
                         requires_grad=True, seed=5)
        out = rel_attention(*ts, causal=False, attn_mask=mask, attn_mask_band=band,
                            key_padding_mask=kpm, backend=backend)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
                     .to(out.device))
        results.append([out.detach()] + [t.grad for t in ts])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_band_flag_decides_on_device(backend):
    """With the flag set the mask is not read (a band that disagrees with the mask wins);
    with it cleared the mask is applied densely and the band's window is ignored."""
    B, Lq, Lk, H, D = 1, 9, 21, 2, 16
    ts = make_inputs(B, Lq, Lk, H, D, R=Lk + Lq - 1, device=FUSED_DEVICE, seed=8)
    g = torch.Generator().manual_seed(2)
    noise = (torch.rand(Lq, Lk, generator=g) < 0.3).to(FUSED_DEVICE) | _causal(Lq, Lk).to(FUSED_DEVICE)
    lying = torch.tensor([1, 4, 0], dtype=torch.int32, device=FUSED_DEVICE)
    got = rel_attention(*ts, causal=False, attn_mask=noise, attn_mask_band=lying,
                        backend=backend)
    want = rel_attention(*ts, causal=False, window_size=(4, 0), backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    off = torch.tensor([0, 4, 0], dtype=torch.int32, device=FUSED_DEVICE)
    got = rel_attention(*ts, causal=False, attn_mask=noise, attn_mask_band=off, backend=backend)
    want = rel_attention(*ts, causal=False, attn_mask=noise, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_band_keeps_r_a_view_of_klen_rows(backend):
    """Transformer-XL passes klen rows of r: with a band descriptor no rows are demanded on the
    host for pairs the band excludes, and the result equals the causal call."""
    B, Lq, Lk, H, D = 2, 10, 23, 2, 16
    ts = make_inputs(B, Lq, Lk, H, D, R=Lk, device=FUSED_DEVICE, seed=4)
    mask = _causal(Lq, Lk).to(FUSED_DEVICE)
    got = rel_attention(*ts, causal=False, attn_mask=mask, attn_mask_band=mask_to_band(mask),
                        backend=backend)
    want = rel_attention(*ts, causal=True, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_band_combines_with_window_args():
    B, Lq, Lk, H, D = 1, 12, 30, 2, 16
    ts = make_inputs(B, Lq, Lk, H, D, device=FUSED_DEVICE, seed=9)
    mask = _causal(Lq, Lk).to(FUSED_DEVICE)
    band = mask_to_band(mask)
    got = rel_attention(*ts, causal=False, window_size=(7, -1), attn_mask=mask,
                        attn_mask_band=band, backend="triton")
    want = rel_attention(*ts, causal=True, window_size=(7, -1), backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_band_argument_checks():
    ts = make_inputs(1, 4, 6, 1, 16)
    mask = _causal(4, 6)
    with pytest.raises(ValueError, match="attn_mask_band needs attn_mask"):
        rel_attention(*ts, attn_mask_band=mask_to_band(mask), backend="reference")
    with pytest.raises(TypeError, match="attn_mask_band must be the int32"):
        rel_attention(*ts, attn_mask=mask, attn_mask_band=torch.zeros(3), backend="reference")


@pytest.mark.parametrize("shape", [(1, 6), (4, 1), (1, 1, 1, 6), (1, 1)])
def test_band_of_a_mask_broadcast_over_queries_or_keys_is_rejected(shape):
    """mask_to_band reads a mask's last two dims as [Lq, Lk]; one broadcast over them (here
    masking nothing) would describe other distances and change the result, so the pair is
    refused instead of answering for a different mask."""
    ts = make_inputs(1, 4, 6, 1, 16, R=9)
    mask = torch.zeros(shape, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"attn_mask_band needs an attn_mask whose last two "
                                         r"dims are \[Lq, Lk\] = \[4, 6\]"):
        rel_attention(*ts, causal=False, attn_mask=mask, attn_mask_band=mask_to_band(mask),
                      backend="reference")
    # without the band the broadcast mask is fine
    got = rel_attention(*ts, causal=False, attn_mask=mask, backend="reference")
    torch.testing.assert_close(got, rel_attention(*ts, causal=False, backend="reference"))
