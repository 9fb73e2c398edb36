"""Conformer drop-ins against transcriptions of NeMo's and ESPnet's original algorithms.

The transcriptions below follow the frameworks' code line by line (projections, the pad/reshape
rel_shift, masking with a large negative fill, softmax, probabilities of masked pairs set to 0,
dropout, linear_out); NeMo's mask builder (ConformerEncoder._create_masks) and cache update are
transcribed too, so the masks are the ones the encoders really pass.
"""
import copy
import math

import pytest
import torch
import torch.nn as nn

import txl_kernels.modules.conformer as conf_mod
from txl_kernels.modules.conformer import (ESPnetRelPositionMultiHeadedAttention,
                                           NeMoRelPositionMultiHeadAttention)
from txl_kernels.modules.swap import swap_rel_pos_attention

from helpers import FUSED_DEVICE, assert_within, requires_cuda

N_HEAD, N_FEAT = 4, 64


# ---------------------------------------------------------------------------------------------
# Transcriptions of the originals
# ---------------------------------------------------------------------------------------------
class NeMoOriginal(nn.Module):
    """NeMo ``RelPositionMultiHeadAttention`` (with its ``MultiHeadAttention`` base), transcribed
    from nemo/collections/asr/parts/submodules/multi_head_attention.py (non-SDPA path)."""

    def __init__(self, n_head, n_feat, dropout_rate, pos_bias_u, pos_bias_v, max_cache_len=0,
                 use_bias=True):
        super().__init__()
        self.cache_drop_size = None
        self.use_bias = use_bias
        self.dropout_rate = dropout_rate
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.s_d_k = math.sqrt(self.d_k)
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat, bias=use_bias)
        self.linear_k = nn.Linear(n_feat, n_feat, bias=use_bias)
        self.linear_v = nn.Linear(n_feat, n_feat, bias=use_bias)
        self.linear_out = nn.Linear(n_feat, n_feat, bias=use_bias)
        self.dropout = nn.Dropout(p=dropout_rate)
        self._max_cache_len = max_cache_len
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        if pos_bias_u is None or pos_bias_v is None:
            self.pos_bias_u = nn.Parameter(torch.FloatTensor(self.h, self.d_k))
            self.pos_bias_v = nn.Parameter(torch.FloatTensor(self.h, self.d_k))
            nn.init.zeros_(self.pos_bias_u)
            nn.init.zeros_(self.pos_bias_v)
        else:
            self.pos_bias_u = pos_bias_u
            self.pos_bias_v = pos_bias_v

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1)  # (batch, 1, time1, time2)
            scores = scores.masked_fill(mask, -10000.0)
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(attn)
        x = torch.matmul(p_attn, value)
        x = x.transpose(1, 2).reshape(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def update_cache(self, key, value, query, cache):
        if cache is not None:
            key = value = torch.cat([cache, key], dim=1)
            q_keep_size = query.shape[1] - self.cache_drop_size
            cache = torch.cat([cache[:, q_keep_size:, :], query[:, :q_keep_size, :]], dim=1)
        return key, value, query, cache

    def rel_shift(self, x):
        b, h, qlen, pos_len = x.size()
        x = torch.nn.functional.pad(x, pad=(1, 0))
        x = x.view(b, h, -1, qlen)
        x = x[:, :, 1:].view(b, h, qlen, pos_len)
        return x

    def forward(self, query, key, value, mask, pos_emb, cache=None):
        key, value, query, cache = self.update_cache(key=key, value=value, query=query,
                                                     cache=cache)
        q, k, v = self.forward_qkv(query, key, value)
        q = q.transpose(1, 2)
        n_batch_pos = pos_emb.size(0)
        p = self.linear_pos(pos_emb).view(n_batch_pos, -1, self.h, self.d_k)
        p = p.transpose(1, 2)
        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_bd = torch.matmul(q_with_bias_v, p.transpose(-2, -1))
        matrix_bd = self.rel_shift(matrix_bd)
        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-2, -1))
        matrix_bd = matrix_bd[:, :, :, : matrix_ac.size(-1)]
        scores = (matrix_ac + matrix_bd) / self.s_d_k
        out = self.forward_attention(v, scores, mask)
        if cache is None:
            return out
        return out, cache


def nemo_create_masks(att_context_size, att_context_style, padding_length, max_audio_length,
                      offset=None):
    """NeMo ``ConformerEncoder._create_masks`` (self_attention_model="rel_pos"), transcribed.
    Returns (pad_mask [B, K], att_mask [B, K, K]), True = masked."""
    att_mask = torch.ones(1, max_audio_length, max_audio_length, dtype=torch.bool)
    if att_context_style == "regular":
        if att_context_size[0] >= 0:
            att_mask = att_mask.triu(diagonal=-att_context_size[0])
        if att_context_size[1] >= 0:
            att_mask = att_mask.tril(diagonal=att_context_size[1])
    elif att_context_style == "chunked_limited":
        if att_context_size[1] == -1:
            if att_context_size[0] >= 0:
                att_mask = att_mask.triu(diagonal=-att_context_size[0])
        else:
            chunk_size = att_context_size[1] + 1
            if att_context_size[0] >= 0:
                left_chunks_num = att_context_size[0] // chunk_size
            else:
                left_chunks_num = 10000
            chunk_idx = torch.arange(0, max_audio_length, dtype=torch.int)
            chunk_idx = torch.div(chunk_idx, chunk_size, rounding_mode="trunc")
            diff_chunks = chunk_idx.unsqueeze(1) - chunk_idx.unsqueeze(0)
            chunked_limited_mask = torch.logical_and(torch.le(diff_chunks, left_chunks_num),
                                                     torch.ge(diff_chunks, 0))
            att_mask = torch.logical_and(att_mask, chunked_limited_mask.unsqueeze(0))
    pad_mask = torch.arange(0, max_audio_length).expand(
        padding_length.size(0), -1) < padding_length.unsqueeze(-1)
    if offset is not None:
        pad_mask_off = torch.arange(0, max_audio_length).expand(
            padding_length.size(0), -1) >= offset.unsqueeze(-1)
        pad_mask = pad_mask_off.logical_and(pad_mask)
    pad_mask_for_att_mask = pad_mask.unsqueeze(1).repeat([1, max_audio_length, 1])
    pad_mask_for_att_mask = torch.logical_and(pad_mask_for_att_mask,
                                              pad_mask_for_att_mask.transpose(1, 2))
    att_mask = att_mask[:, :max_audio_length, :max_audio_length]
    att_mask = torch.logical_and(pad_mask_for_att_mask, att_mask)
    return ~pad_mask, ~att_mask


def nemo_step_masks(att_context_size, style, length, T, cache_len=0, cache_valid=None):
    """The masks NeMo's ``forward_internal`` passes to the layers for a step of T frames after
    a cache of cache_len frames (cache_valid: valid cached frames per sequence). Returns the
    key padding over all K = cache_len + T keys and the (B, T, K) attention mask."""
    if cache_len:
        offset = torch.neg(cache_valid) + cache_len
        pad, att = nemo_create_masks(att_context_size, style, length + cache_len, T + cache_len,
                                     offset)
        return pad, att[:, cache_len:]
    return nemo_create_masks(att_context_size, style, length, T)


def nemo_rel_pos_emb(d_model, length):
    """NeMo ``RelPositionalEncoding``'s table for ``length`` keys: distances ``length - 1``
    down to ``-(length - 1)``."""
    positions = torch.arange(length - 1, -length, -1, dtype=torch.float32).unsqueeze(1)
    pe = torch.zeros(positions.size(0), d_model)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32)
                         * -(math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(positions * div_term)
    pe[:, 1::2] = torch.cos(positions * div_term)
    return pe.unsqueeze(0)


class ESPnetOriginal(nn.Module):
    """ESPnet ``RelPositionMultiHeadedAttention`` (with its ``MultiHeadedAttention`` base),
    transcribed from espnet/nets/pytorch_backend/transformer/attention.py."""

    def __init__(self, n_head, n_feat, dropout_rate, zero_triu=False):
        super().__init__()
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout_rate)
        self.zero_triu = zero_triu
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.Tensor(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.Tensor(self.h, self.d_k))
        torch.nn.init.xavier_uniform_(self.pos_bias_u)
        torch.nn.init.xavier_uniform_(self.pos_bias_v)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            self.attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            self.attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(self.attn)
        x = torch.matmul(p_attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def rel_shift(self, x):
        zero_pad = torch.zeros((*x.size()[:3], 1), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=-1)
        x_padded = x_padded.view(*x.size()[:2], x.size(3) + 1, x.size(2))
        x = x_padded[:, :, 1:].view_as(x)[:, :, :, : x.size(-1) // 2 + 1]
        if self.zero_triu:
            ones = torch.ones((x.size(2), x.size(3)), device=x.device)
            x = x * torch.tril(ones, x.size(3) - x.size(2))[None, None, :, :]
        return x

    def forward(self, query, key, value, pos_emb, mask):
        q, k, v = self.forward_qkv(query, key, value)
        q = q.transpose(1, 2)
        n_batch_pos = pos_emb.size(0)
        p = self.linear_pos(pos_emb).view(n_batch_pos, -1, self.h, self.d_k)
        p = p.transpose(1, 2)
        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-2, -1))
        matrix_bd = torch.matmul(q_with_bias_v, p.transpose(-2, -1))
        matrix_bd = self.rel_shift(matrix_bd)
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def nemo_pair(backend="reference", use_bias=True, n_head=N_HEAD, n_feat=N_FEAT, seed=0, **kw):
    """(original, ours) in float32 with the same random weights (biases non-zero)."""
    torch.manual_seed(seed)
    orig = NeMoOriginal(n_head, n_feat, 0.0, None, None, use_bias=use_bias).eval()
    with torch.no_grad():
        orig.pos_bias_u.normal_(0.0, 0.5)
        orig.pos_bias_v.normal_(0.0, 0.5)
    ours = NeMoRelPositionMultiHeadAttention(n_head, n_feat, 0.0, None, None, use_bias=use_bias,
                                             backend=backend, **kw).eval()
    ours.load_state_dict(orig.state_dict(), strict=True)
    return orig, ours


def espnet_pair(backend="reference", zero_triu=False, n_head=N_HEAD, n_feat=N_FEAT, seed=0):
    torch.manual_seed(seed)
    orig = ESPnetOriginal(n_head, n_feat, 0.0, zero_triu=zero_triu).eval()
    ours = ESPnetRelPositionMultiHeadedAttention(n_head, n_feat, 0.0, zero_triu=zero_triu,
                                                 backend=backend).eval()
    ours.load_state_dict(orig.state_dict(), strict=True)
    return orig, ours


def rnd(*shape, seed=0, dtype=torch.float32, device="cpu", requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(dtype=dtype, device=device)
    return t.requires_grad_(requires_grad)


def compare(orig, ours, run_orig, run_ours, dtype, device="cpu", grads=False, name="out"):
    """Run ours and the original in ``dtype`` (and the original in float64 as the truth) on
    the same weights. float64: tight equality; lower precisions: assert_within (ours must be
    as close to the truth as the original in the same precision). ``run_*(module, dtype,
    device)`` return a tuple of (output tensors, inputs that need gradients)."""
    o_lp = copy.deepcopy(orig).to(device=device, dtype=dtype)
    m_lp = copy.deepcopy(ours).to(device=device, dtype=dtype)
    truth_mod = copy.deepcopy(orig).to(device="cpu", dtype=torch.float64)
    # Weights rounded to dtype, then upcast: the truth runs on exactly the low-precision weights.
    truth_mod.load_state_dict({k: v.double().cpu() for k, v in o_lp.state_dict().items()})
    got, got_in = run_ours(m_lp, dtype, device)
    same, same_in = run_orig(o_lp, dtype, device)
    truth, truth_in = run_orig(truth_mod, torch.float64, "cpu")

    def check(label, a, b, c):
        if dtype == torch.float64:
            torch.testing.assert_close(a.detach(), c.detach(), rtol=1e-9, atol=1e-10,
                                       msg=lambda m: f"{label}: {m}")
        else:
            assert_within(label, a.detach().cpu(), b.detach().cpu(), c.detach())

    for i, (a, b, c) in enumerate(zip(got, same, truth)):
        check(f"{name}[{i}]", a, b, c)
    if not grads:
        return
    g = torch.Generator().manual_seed(123)
    douts = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in truth]
    grads = []
    for outs, mod, ins in ((got, m_lp, got_in), (same, o_lp, same_in),
                           (truth, truth_mod, truth_in)):
        loss = sum((o.double().cpu() * d).sum() for o, d in zip(outs, douts)
                   if o.requires_grad)
        grads.append(torch.autograd.grad(loss, list(ins) + list(mod.parameters()),
                                         allow_unused=True))
    names = [f"input{i}" for i in range(len(got_in))] + [n for n, _ in m_lp.named_parameters()]
    assert names[len(got_in):] == [n for n, _ in truth_mod.named_parameters()]
    for label, a, b, c in zip(names, *grads):
        if c is None:
            assert a is None or not a.abs().any(), f"grad {label}: expected none"
            continue
        assert a is not None, f"grad {label} missing"
        check(f"grad {label}", a, b, c)


@pytest.fixture
def spy(monkeypatch):
    """Records every rel_attention call made by the modules."""
    calls = []
    real = conf_mod.rel_attention

    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(conf_mod, "rel_attention", wrapper)
    return calls


# ---------------------------------------------------------------------------------------------
# Parameters and state dicts
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_bias", [True, False])
def test_nemo_state_dict_strict_both_ways(use_bias):
    orig, ours = nemo_pair(use_bias=use_bias)
    assert list(ours.state_dict()) == list(orig.state_dict())
    keys = set(ours.state_dict())
    assert {"linear_pos.weight", "pos_bias_u", "pos_bias_v"} <= keys
    assert "linear_pos.bias" not in keys
    assert all(f"linear_{n}.bias" in keys for n in "qkv") == use_bias
    assert ("linear_out.bias" in keys) == use_bias
    fresh = NeMoOriginal(N_HEAD, N_FEAT, 0.0, None, None, use_bias=use_bias)
    fresh.load_state_dict(ours.state_dict(), strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, orig.state_dict()[k]), k
    # the other way: wrong use_bias must not load strictly
    other = NeMoRelPositionMultiHeadAttention(N_HEAD, N_FEAT, 0.0, None, None,
                                              use_bias=not use_bias)
    with pytest.raises(RuntimeError):
        other.load_state_dict(orig.state_dict(), strict=True)


def test_nemo_shared_and_owned_pos_biases():
    u = nn.Parameter(torch.randn(N_HEAD, N_FEAT // N_HEAD))
    v = nn.Parameter(torch.randn(N_HEAD, N_FEAT // N_HEAD))
    a = NeMoRelPositionMultiHeadAttention(N_HEAD, N_FEAT, 0.1, u, v)
    b = NeMoRelPositionMultiHeadAttention(n_head=N_HEAD, n_feat=N_FEAT, dropout_rate=0.1,
                                          pos_bias_u=u, pos_bias_v=v, max_cache_len=7)
    assert a.pos_bias_u is u and b.pos_bias_u is u and b.pos_bias_v is v
    assert b._max_cache_len == 7 and b.cache_drop_size == 0
    owned = NeMoRelPositionMultiHeadAttention(N_HEAD, N_FEAT, 0.1, None, None)
    assert isinstance(owned.pos_bias_u, nn.Parameter)
    assert owned.pos_bias_u.shape == (N_HEAD, N_FEAT // N_HEAD)
    assert not owned.pos_bias_u.any() and not owned.pos_bias_v.any()
    with pytest.raises(ValueError, match="pos_bias_u"):
        NeMoRelPositionMultiHeadAttention(N_HEAD, N_FEAT, 0.1, torch.zeros(3, 3), v)


def test_espnet_state_dict_strict_both_ways():
    orig, ours = espnet_pair()
    assert list(ours.state_dict()) == list(orig.state_dict())
    fresh = ESPnetOriginal(N_HEAD, N_FEAT, 0.0)
    fresh.load_state_dict(ours.state_dict(), strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, orig.state_dict()[k]), k
    assert ours.pos_bias_u.abs().sum() > 0  # xavier-initialised like ESPnet, not zeros


# ---------------------------------------------------------------------------------------------
# NeMo: outputs against the original (reference path, float64)
# ---------------------------------------------------------------------------------------------
NEMO_MASKS = {
    # name: (att_context_size, style, lengths as a fraction of T; 0 -> fully masked sequence)
    "none": None,
    "padded": ([-1, -1], "regular", (1.0, 0.6, 0.3)),
    "regular_ctx": ([5, 2], "regular", (1.0, 0.7, 0.5)),
    "causal_ctx": ([4, 0], "regular", (0.8, 1.0, 1.0)),
    "chunked_limited": ([6, 2], "chunked_limited", (1.0, 0.5, 0.9)),
    "fully_masked_seq": ([-1, -1], "regular", (1.0, 0.0, 0.5)),
}


def _lengths(fracs, T):
    return torch.tensor([int(round(f * T)) for f in fracs], dtype=torch.long)


@pytest.mark.parametrize("T", [1, 23, 37])
@pytest.mark.parametrize("kind", list(NEMO_MASKS))
def test_nemo_dense_masks_match_original(kind, T):
    B = 3
    orig, ours = nemo_pair()
    x = rnd(B, T, N_FEAT, seed=T)
    pe = rnd(1, 2 * T - 1, N_FEAT, seed=T + 1)
    mask = None
    if NEMO_MASKS[kind] is not None:
        ctx, style, fracs = NEMO_MASKS[kind]
        _, mask = nemo_step_masks(ctx, style, _lengths(fracs, T), T)

    def run(mod, dtype, device):
        xx = x.to(dtype).requires_grad_()
        return (mod(query=xx, key=xx, value=xx, mask=mask, pos_emb=pe.to(dtype)),), (xx,)

    compare(orig, ours, run, run, torch.float64)


@pytest.mark.parametrize("ctx", [[-1, -1], [5, 2], [3, 0], [0, 4]])
@pytest.mark.parametrize("how", ["lengths", "key_padding_mask", "mask2d"])
def test_nemo_padding_and_window_reach_kernel_without_dense_mask(spy, ctx, how):
    """NeMo's encoder mask (padding x padding x band) == key padding + query rows + window."""
    B, T = 3, 29
    orig, ours = nemo_pair(att_context_size=ctx)
    lengths = _lengths((1.0, 0.55, 0.0), T)
    pad, dense = nemo_step_masks(ctx, "regular", lengths, T)
    x = rnd(B, T, N_FEAT, seed=2)
    pe = rnd(1, 2 * T - 1, N_FEAT, seed=3)
    o64, m64 = orig.double(), ours.double()
    want = o64(query=x.double(), key=x.double(), value=x.double(), mask=dense, pos_emb=pe.double())
    kw = {"lengths": {"lengths": lengths}, "key_padding_mask": {"key_padding_mask": pad},
          "mask2d": {}}[how]
    got = m64(query=x.double(), key=x.double(), value=x.double(),
              mask=pad if how == "mask2d" else None, pos_emb=pe.double(), **kw)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    (args, kwargs), = spy
    assert kwargs["attn_mask"] is None
    assert kwargs["window_size"] == tuple(ctx) and kwargs["causal"] is False
    assert torch.equal(kwargs["key_padding_mask"], pad)


def run_rows_and_grads(module, args: dict, monkeypatch, whole: bool, **kwargs):
    """fp64 forward + backward of ``module(**args, **kwargs)`` -> (rows of the table that went
    through linear_pos, output, gradients of the inputs and the table); ``whole``: with the
    window's row selection switched off (every row projected)."""
    if whole:
        monkeypatch.setattr(conf_mod, "window_position_rows", lambda *a: None)
    rows = []
    hook = module.linear_pos.register_forward_hook(lambda m, a, out: rows.append(a[0].shape[1]))
    args = {n: t.detach().double().requires_grad_() for n, t in args.items()}
    try:
        out = module.double()(**args, **kwargs)
    finally:
        hook.remove()
        monkeypatch.undo()
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, list(args.values()), torch.ones_like(out))
    return rows, out, grads


@pytest.mark.parametrize("ctx,C", [([5, 2], 0), ([3, 0], 0), ([0, 4], 0), ([4, -1], 0),
                                   ([6, 2], 9), ([40, 40], 0)])
def test_nemo_window_projects_only_the_rows_it_reads(monkeypatch, ctx, C):
    """With att_context_size only the table rows of distances left .. -right go through
    linear_pos (a cache too: Lq < Lk); output and every gradient (query / key / value /
    pos_emb) equal the whole table's. A window wider than the lengths projects the whole
    table."""
    T = 23
    _, ours = nemo_pair(att_context_size=ctx)
    x, kv = rnd(2, T, N_FEAT, seed=1), rnd(2, C + T, N_FEAT, seed=2)
    args = dict(query=x, key=kv, value=kv, pos_emb=nemo_rel_pos_emb(N_FEAT, C + T))
    rows, out, grads = run_rows_and_grads(ours, args, monkeypatch, False, mask=None)
    rows_all, want, want_grads = run_rows_and_grads(ours, args, monkeypatch, True, mask=None)
    left, right = ctx
    d_max = min(C + T - 1, left) if left >= 0 else C + T - 1
    d_min = max(-(T - 1), -right) if right >= 0 else -(T - 1)
    assert rows_all == [2 * (C + T) - 1]
    assert rows == [d_max - d_min + 1]
    assert (rows[0] < C + 2 * T - 1) == (ctx != [40, 40])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cache_drop_size", [0, 3])
@pytest.mark.parametrize("how", ["dense", "padding_window", "lengths_window"])
def test_nemo_cache_matches_original(how, cache_drop_size):
    """A cache-aware streaming step: keys = cat(cache, x), pos_emb of 2(C + T) - 1 rows,
    masks as NeMo's forward_internal builds them (partly filled cache, padded batch)."""
    B, T, C = 3, 12, 20
    ctx = [C, 3]
    orig, ours = nemo_pair(att_context_size=None if how == "dense" else ctx)
    orig.cache_drop_size = ours.cache_drop_size = cache_drop_size
    lengths = torch.tensor([12, 7, 10])
    # lengths count the current segment only: the cache must be full for that variant
    cache_valid = torch.tensor([20, 20, 20] if how == "lengths_window" else [20, 5, 0])
    pad, dense = nemo_step_masks(ctx, "regular", lengths, T, C, cache_valid)
    x = rnd(B, T, N_FEAT, seed=5)
    cache = rnd(B, C, N_FEAT, seed=6)
    pe = nemo_rel_pos_emb(N_FEAT, C + T)
    assert pe.shape[1] == 2 * (C + T) - 1

    def run_orig(mod, dtype, device):
        xx, cc = x.to(dtype).requires_grad_(), cache.to(dtype).requires_grad_()
        out, new = mod(query=xx, key=xx, value=xx, mask=dense, pos_emb=pe.to(dtype), cache=cc)
        return (out, new), (xx, cc)

    def run_ours(mod, dtype, device):
        xx, cc = x.to(dtype).requires_grad_(), cache.to(dtype).requires_grad_()
        if how == "dense":
            out, new = mod(query=xx, key=xx, value=xx, mask=dense, pos_emb=pe.to(dtype),
                           cache=cc)
        elif how == "padding_window":
            out, new = mod(query=xx, key=xx, value=xx, mask=None, pos_emb=pe.to(dtype),
                           cache=cc, key_padding_mask=pad)
        else:
            out, new = mod(query=xx, key=xx, value=xx, mask=None, pos_emb=pe.to(dtype),
                           cache=cc, lengths=lengths)
        return (out, new), (xx, cc)

    compare(orig, ours, run_orig, run_ours, torch.float64, grads=True)


def test_nemo_cache_semantics_value_ignored_like_nemo():
    """As NeMo's update_cache: keys and values are both cat(cache, key)."""
    orig, ours = nemo_pair()
    ours.cache_drop_size = orig.cache_drop_size = 1
    B, T, C = 2, 5, 4
    x, other, cache = rnd(B, T, N_FEAT, seed=1), rnd(B, T, N_FEAT, seed=2), rnd(B, C, N_FEAT)
    pe = rnd(1, 2 * (C + T) - 1, N_FEAT, seed=3)
    out, new = ours(query=x, key=x, value=other, mask=None, pos_emb=pe, cache=cache)
    want, want_new = orig(query=x, key=x, value=other, mask=None, pos_emb=pe, cache=cache)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    assert torch.equal(new, want_new)
    assert torch.equal(new, torch.cat([cache[:, T - 1:], x[:, :T - 1]], 1))


def test_nemo_use_bias_false_and_odd_head_dim():
    B, T = 2, 19
    orig, ours = nemo_pair(use_bias=False, n_head=2, n_feat=82)  # d_k = 41
    x = rnd(B, T, 82)
    pe = rnd(1, 2 * T - 1, 82, seed=4)
    _, mask = nemo_step_masks([6, 6], "regular", torch.tensor([19, 11]), T)

    def run(mod, dtype, device):
        xx = x.to(dtype).requires_grad_()
        return (mod(query=xx, key=xx, value=xx, mask=mask, pos_emb=pe.to(dtype)),), (xx,)

    compare(orig, ours, run, run, torch.float64, grads=True)


def test_nemo_per_sequence_and_expanded_pos_emb(spy):
    B, T = 3, 9
    orig, ours = nemo_pair()
    o64, m64 = orig.double(), ours.double()
    x = rnd(B, T, N_FEAT, dtype=torch.float64)
    pe_b = rnd(B, 2 * T - 1, N_FEAT, seed=8, dtype=torch.float64)  # one table per sequence
    _, mask = nemo_step_masks([-1, -1], "regular", torch.tensor([9, 6, 4]), T)
    torch.testing.assert_close(m64(query=x, key=x, value=x, mask=mask, pos_emb=pe_b),
                               o64(query=x, key=x, value=x, mask=mask, pos_emb=pe_b),
                               rtol=1e-9, atol=1e-10)
    assert len(spy) == B
    spy.clear()
    pe_x = pe_b[:1].expand(B, -1, -1)  # an expanded view: one projection, one call
    torch.testing.assert_close(m64(query=x, key=x, value=x, mask=mask, pos_emb=pe_x),
                               o64(query=x, key=x, value=x, mask=mask, pos_emb=pe_x),
                               rtol=1e-9, atol=1e-10)
    assert len(spy) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nemo_reference_path_low_precision(dtype):
    B, T = 3, 31
    orig, ours = nemo_pair()
    x = rnd(B, T, N_FEAT, seed=11)
    pe = nemo_rel_pos_emb(N_FEAT, T)
    _, mask = nemo_step_masks([8, 8], "regular", torch.tensor([31, 20, 0]), T)

    def run(mod, dt, device):
        xx = x.to(dt).requires_grad_()
        return (mod(query=xx, key=xx, value=xx, mask=mask, pos_emb=pe.to(dt)),), (xx,)

    compare(orig, ours, run, run, dtype, grads=dtype == torch.float32)


def test_nemo_under_autocast_runs_in_autocast_dtype():
    """Under autocast the projections come out in bf16 and the fp32 pos_bias parameters are
    cast to match (rel_attention wants one dtype)."""
    B, T = 2, 15
    orig, ours = nemo_pair()
    x, pe = rnd(B, T, N_FEAT, seed=4), rnd(1, 2 * T - 1, N_FEAT, seed=5)
    _, mask = nemo_step_masks([4, 4], "regular", torch.tensor([15, 9]), T)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ours(query=x, key=x, value=x, mask=mask, pos_emb=pe)
        same = orig(query=x, key=x, value=x, mask=mask, pos_emb=pe)
    truth = copy.deepcopy(orig).double()(query=x.double(), key=x.double(), value=x.double(),
                                         mask=mask, pos_emb=pe.double())
    assert got.dtype == torch.bfloat16
    assert_within("autocast out", got.detach(), same.detach(), truth.detach())


def test_nemo_dropout_only_in_training(spy):
    B, T = 2, 6
    ours = NeMoRelPositionMultiHeadAttention(N_HEAD, N_FEAT, 0.25, None, None,
                                             backend="reference")
    x, pe = rnd(B, T, N_FEAT), rnd(1, 2 * T - 1, N_FEAT)
    ours.train()
    torch.manual_seed(0)
    a = ours(query=x, key=x, value=x, mask=None, pos_emb=pe)
    ours.eval()
    b = ours(query=x, key=x, value=x, mask=None, pos_emb=pe)
    c = ours(query=x, key=x, value=x, mask=None, pos_emb=pe)
    assert [kw["dropout_p"] for _, kw in spy] == [0.25, 0.0, 0.0]
    assert torch.equal(b, c) and not torch.allclose(a, b)


# ---------------------------------------------------------------------------------------------
# ESPnet: outputs against the original
# ---------------------------------------------------------------------------------------------
def _espnet_mask(kind, B, T, seed=0):
    lengths = torch.tensor([T, max(1, T // 2), max(1, T - 3)])[:B]
    keep = torch.arange(T)[None, :] < lengths[:, None]  # (B, T), True = valid
    if kind == "none":
        return None
    if kind == "pad":  # ESPnet's ~make_pad_mask(lengths)[:, None, :]
        return keep[:, None, :]
    if kind == "pad_uint8":
        return keep[:, None, :].to(torch.uint8)
    if kind == "dense":  # padding of keys and a random dense pattern, one row fully masked
        g = torch.Generator().manual_seed(seed)
        m = keep[:, None, :] & (torch.rand(B, T, T, generator=g) > 0.3)
        m[0, min(2, T - 1)] = False
        return m
    raise ValueError(kind)


@pytest.mark.parametrize("zero_triu", [False, True])
@pytest.mark.parametrize("kind", ["none", "pad", "pad_uint8", "dense"])
@pytest.mark.parametrize("T", [1, 24, 37])
def test_espnet_matches_original(kind, zero_triu, T):
    B = 3
    orig, ours = espnet_pair(zero_triu=zero_triu)
    x = rnd(B, T, N_FEAT, seed=T)
    pe = rnd(1, 2 * T - 1, N_FEAT, seed=T + 1)
    mask = _espnet_mask(kind, B, T)

    def run(mod, dtype, device):
        xx = x.to(dtype).requires_grad_()
        return (mod(xx, xx, xx, pe.to(dtype), mask),), (xx,)

    compare(orig, ours, run, run, torch.float64, grads=True)


@pytest.mark.parametrize("kind", ["none", "pad", "dense"])
@pytest.mark.parametrize("zero_triu", [False, True])
@pytest.mark.parametrize("T,K", [(1, 9), (4, 11)])
def test_espnet_fewer_queries_than_keys_match_original(kind, zero_triu, T, K):
    """Regression: ESPnet's EncoderLayer cache path calls ``forward(x[:, -T:], x, x, pos_emb,
    mask)`` (its mask ``mask[:, -T:, :]``); ours raised. The result is the last T rows of
    full attention, forward and gradients, like the original."""
    B = 3
    orig, ours = espnet_pair(zero_triu=zero_triu)
    x = rnd(B, K, N_FEAT, seed=K)
    pe = rnd(1, 2 * K - 1, N_FEAT, seed=K + 1)
    mask = _espnet_mask(kind, B, K)
    if mask is not None and kind == "dense":
        mask = mask[:, -T:, :]

    def run(mod, dtype, device):
        xx = x.to(dtype).requires_grad_()
        return (mod(xx[:, -T:], xx, xx, pe.to(dtype), mask),), (xx,)

    compare(orig, ours, run, run, torch.float64, grads=True)
    if kind == "none":  # the last T rows of full self-attention
        torch.testing.assert_close(ours(x[:, -T:], x, x, pe, None), ours(x, x, x, pe, None)[:, -T:],
                                   rtol=1e-5, atol=1e-5)


def test_espnet_padding_mask_reaches_kernel_as_key_padding(spy):
    B, T = 3, 17
    orig, ours = espnet_pair()
    x, pe = rnd(B, T, N_FEAT), rnd(1, 2 * T - 1, N_FEAT, seed=1)
    mask = _espnet_mask("pad", B, T)
    got = ours(x, x, x, pe, mask)
    torch.testing.assert_close(got, orig(x, x, x, pe, mask), rtol=2e-5, atol=2e-5)
    (_, kwargs), = spy
    assert kwargs["attn_mask"] is None and kwargs["window_size"] == (-1, -1)
    assert torch.equal(kwargs["key_padding_mask"], ~mask[:, 0])
    # the keyword alternatives give the same result
    lengths = mask[:, 0].sum(-1)
    torch.testing.assert_close(ours(x, x, x, pe, None, lengths=lengths), got)
    torch.testing.assert_close(ours(x, x, x, pe, None, key_padding_mask=~mask[:, 0]), got)
    assert all(kw["attn_mask"] is None for _, kw in spy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_espnet_reference_path_low_precision(dtype):
    B, T = 3, 33
    orig, ours = espnet_pair()
    x, pe = rnd(B, T, N_FEAT, seed=3), rnd(1, 2 * T - 1, N_FEAT, seed=4)
    mask = _espnet_mask("pad", B, T)

    def run(mod, dt, device):
        xx = x.to(dt).requires_grad_()
        return (mod(xx, xx, xx, pe.to(dt), mask),), (xx,)

    compare(orig, ours, run, run, dtype, grads=dtype == torch.float32)


# ---------------------------------------------------------------------------------------------
# Layout: projections and the position table reach rel_attention as views
# ---------------------------------------------------------------------------------------------
def _record_outputs(module):
    outs = {}
    for name in ("linear_q", "linear_k", "linear_v", "linear_pos"):
        getattr(module, name).register_forward_hook(
            lambda mod, inp, out, name=name: outs.__setitem__(name, out))
    return outs


@pytest.mark.parametrize("framework", ["nemo", "nemo_cache", "espnet"])
def test_projections_and_position_table_are_views(spy, framework):
    B, T, C = 2, 11, 6
    if framework == "espnet":
        _, ours = espnet_pair()
    else:
        _, ours = nemo_pair()
    outs = _record_outputs(ours)
    x = rnd(B, T, N_FEAT)
    K = T + (C if framework == "nemo_cache" else 0)
    pe = rnd(1, 2 * K - 1, N_FEAT, seed=1)
    if framework == "espnet":
        ours(x, x, x, pe, None)
    elif framework == "nemo":
        ours(query=x, key=x, value=x, mask=None, pos_emb=pe)
    else:
        ours(query=x, key=x, value=x, mask=None, pos_emb=pe, cache=rnd(B, C, N_FEAT, seed=2))
    (args, _), = spy
    q, k, v, r = args[:4]
    H, D = N_HEAD, N_FEAT // N_HEAD
    def root(t):
        return t if t._base is None else t._base

    for t, name, L in ((q, "linear_q", T), (k, "linear_k", K), (v, "linear_v", K)):
        assert t.shape == (B, L, H, D)
        assert t._base is not None and root(t) is root(outs[name]), f"{name}: not a view"
        assert t.data_ptr() == outs[name].data_ptr()
        assert t.stride() == (L * H * D, H * D, D, 1)
    # r: row offset 0 into the projected table, K + T - 1 rows, a strided view
    assert r.shape == (K + T - 1, H, D)
    assert r._base is not None and root(r) is root(outs["linear_pos"])
    assert r.data_ptr() == outs["linear_pos"].data_ptr()
    assert r.stride() == (H * D, D, 1)


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------
def test_nemo_bad_inputs_raise_clear_errors():
    B, T, C = 2, 8, 5
    ours = NeMoRelPositionMultiHeadAttention(N_HEAD, N_FEAT, 0.0, None, None)
    x, pe = rnd(B, T, N_FEAT), rnd(1, 2 * T - 1, N_FEAT)
    with pytest.raises(ValueError, match=r"pos_emb must be .*2K - 1 = 15.*got \[1, 14, 64\]"):
        ours(query=x, key=x, value=x, mask=None, pos_emb=pe[:, 1:])
    with pytest.raises(ValueError, match=r"pos_emb.*2K - 1 = 25.*cache 5 \+ time 8"):
        ours(query=x, key=x, value=x, mask=None, pos_emb=pe, cache=rnd(B, C, N_FEAT))
    with pytest.raises(ValueError, match=r"pos_emb.*n_feat=64"):
        ours(query=x, key=x, value=x, mask=None, pos_emb=rnd(1, 2 * T - 1, 32))
    with pytest.raises(ValueError, match=r"pos_emb must be \(1 or B=2"):
        ours(query=x, key=x, value=x, mask=None, pos_emb=rnd(3, 2 * T - 1, N_FEAT))
    with pytest.raises(ValueError,
                       match=r"mask must be \(B, T, K\) = \(2, 8, 8\).*got \[2, 8, 9\]"):
        ours(query=x, key=x, value=x, mask=torch.zeros(B, T, T + 1, dtype=torch.bool),
             pos_emb=pe)
    with pytest.raises(ValueError, match=r"mask must be.*got \[2, 9\]"):
        ours(query=x, key=x, value=x, mask=torch.zeros(B, T + 1, dtype=torch.bool), pos_emb=pe)
    with pytest.raises(TypeError, match=r"mask must be a bool tensor.*float32"):
        ours(query=x, key=x, value=x, mask=torch.zeros(B, T, T), pos_emb=pe)
    with pytest.raises(ValueError,
                       match=r"key_padding_mask must be a bool tensor \(B, K\) = \(2, 8\)"):
        ours(query=x, key=x, value=x, mask=None, pos_emb=pe,
             key_padding_mask=torch.zeros(B, T - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"lengths must be an integer tensor"):
        ours(query=x, key=x, value=x, mask=None, pos_emb=pe, lengths=torch.ones(B))
    with pytest.raises(ValueError, match="not both"):
        ours(query=x, key=x, value=x, mask=None, pos_emb=pe, lengths=torch.ones(B).long(),
             key_padding_mask=torch.zeros(B, T, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"query must be \(B, time, n_feat=64\), got shape \[2, 8, 32\]"):
        ours(query=rnd(B, T, 32), key=x, value=x, mask=None, pos_emb=pe)
    with pytest.raises(ValueError, match=r"cache must be \(B=2, time, n_feat=64\)"):
        ours(query=x, key=x, value=x, mask=None, pos_emb=pe, cache=rnd(B + 1, C, N_FEAT))
    with pytest.raises(ValueError, match="n_feat must be a positive multiple of n_head"):
        NeMoRelPositionMultiHeadAttention(3, N_FEAT, 0.0, None, None)
    with pytest.raises(ValueError, match="att_context_size"):
        NeMoRelPositionMultiHeadAttention(N_HEAD, N_FEAT, 0.0, None, None,
                                          att_context_size=[4])
    with pytest.raises(ValueError, match="chunked_limited.*not a band"):
        NeMoRelPositionMultiHeadAttention(N_HEAD, N_FEAT, 0.0, None, None,
                                          att_context_size=[8, 2],
                                          att_context_style="chunked_limited")
    with pytest.raises(ValueError, match="backend"):
        NeMoRelPositionMultiHeadAttention(N_HEAD, N_FEAT, 0.0, None, None, backend="cuda")


@pytest.mark.parametrize("framework", ["nemo", "nemo_cache", "espnet"])
@pytest.mark.parametrize("bad", [-1, 9])
def test_lengths_out_of_range_raise(framework, bad):
    """Regression: lengths > T or < 0 were accepted silently (a negative length also masked
    cached frames)."""
    B, T, C = 2, 8, 3
    if framework == "espnet":
        _, ours = espnet_pair()
        x, pe = rnd(B, T, N_FEAT), rnd(1, 2 * T - 1, N_FEAT)

        def call(lengths):
            return ours(x, x, x, pe, None, lengths=lengths)
    else:
        _, ours = nemo_pair()
        x = rnd(B, T, N_FEAT)
        cache = rnd(B, C, N_FEAT) if framework == "nemo_cache" else None
        K = T + (C if cache is not None else 0)
        pe = rnd(1, 2 * K - 1, N_FEAT)

        def call(lengths):
            return ours(query=x, key=x, value=x, mask=None, pos_emb=pe, cache=cache,
                        lengths=lengths)
    call(torch.tensor([T, 0]))  # the bounds themselves are fine
    with pytest.raises(RuntimeError, match=rf"lengths must be in \[0, {T}\]"):
        call(torch.tensor([T, bad]))


def test_espnet_bad_inputs_raise_clear_errors():
    B, T = 2, 8
    _, ours = espnet_pair()
    x, pe = rnd(B, T, N_FEAT), rnd(1, 2 * T - 1, N_FEAT)
    with pytest.raises(ValueError, match=r"pos_emb must be .*2K - 1 = 15.*got \[1, 17, 64\]"):
        ours(x, x, x, rnd(1, 2 * T + 1, N_FEAT), None)
    with pytest.raises(ValueError, match=r"mask must be \(B, 1, K\) or \(B, T, K\).*got \[2, 8\]"):
        ours(x, x, x, pe, torch.ones(B, T, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must be.*got \[2, 1, 9\]"):
        ours(x, x, x, pe, torch.ones(B, 1, T + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a bool or integer tensor"):
        ours(x, x, x, pe, torch.ones(B, 1, T))
    with pytest.raises(ValueError, match=r"key and value must have one length K >= the query's"):
        ours(x, rnd(B, T + 2, N_FEAT), rnd(B, T + 1, N_FEAT), pe, None)
    with pytest.raises(ValueError, match=r"key and value must have one length K >= the query's"):
        ours(x, x[:, :-1], x[:, :-1], pe, None)


# ---------------------------------------------------------------------------------------------
# Swapping into a model
# ---------------------------------------------------------------------------------------------
def test_swap_rel_pos_attention_shares_parameters_and_matches():
    nemo_cls = type("RelPositionMultiHeadAttention", (NeMoOriginal,),
                    {"__module__": "nemo.collections.asr.parts.submodules.multi_head_attention"})
    esp_cls = type("RelPositionMultiHeadedAttention", (ESPnetOriginal,),
                   {"__module__": "espnet.nets.pytorch_backend.transformer.attention"})
    legacy_cls = type("LegacyRelPositionMultiHeadedAttention", (ESPnetOriginal,),
                      {"__module__": "espnet.nets.pytorch_backend.transformer.attention"})
    other_cls = type("RelPositionMultiHeadedAttention", (ESPnetOriginal,),
                     {"__module__": "wenet.transformer.attention"})
    torch.manual_seed(0)
    u = nn.Parameter(torch.randn(N_HEAD, N_FEAT // N_HEAD))
    v = nn.Parameter(torch.randn(N_HEAD, N_FEAT // N_HEAD))
    layer = nn.Module()
    layer.self_attn = nemo_cls(N_HEAD, N_FEAT, 0.0, u, v, max_cache_len=4)
    layer.self_attn.cache_drop_size = 2
    model = nn.ModuleDict({"nemo": nn.ModuleList([layer]), "esp": esp_cls(N_HEAD, N_FEAT, 0.0),
                           "legacy": legacy_cls(N_HEAD, N_FEAT, 0.0),
                           "other": other_cls(N_HEAD, N_FEAT, 0.0)})
    model.eval()
    before = copy.deepcopy(model)
    params = {id(p) for p in model.parameters()}
    assert swap_rel_pos_attention(model, backend="reference", att_context_size=[3, 1]) == 2
    new_nemo, new_esp = model["nemo"][0].self_attn, model["esp"]
    assert isinstance(new_nemo, NeMoRelPositionMultiHeadAttention)
    assert isinstance(new_esp, ESPnetRelPositionMultiHeadedAttention)
    assert type(model["legacy"]) is legacy_cls and type(model["other"]) is other_cls
    assert {id(p) for p in model.parameters()} == params  # same Parameter objects
    assert new_nemo.pos_bias_u is u and new_nemo.att_context_size == [3, 1]
    assert new_nemo.cache_drop_size == 2 and new_nemo._max_cache_len == 4
    assert not new_nemo.training and not any(p.is_meta for p in model.parameters())
    B, T = 2, 10
    x, pe = rnd(B, T, N_FEAT), rnd(1, 2 * T - 1, N_FEAT, seed=1)
    _, dense = nemo_step_masks([3, 1], "regular", torch.tensor([10, 6]), T)
    want = before["nemo"][0].self_attn(query=x, key=x, value=x, mask=dense, pos_emb=pe)
    got = new_nemo(query=x, key=x, value=x, mask=None, pos_emb=pe, lengths=torch.tensor([10, 6]))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(new_esp(x, x, x, pe, None), before["esp"](x, x, x, pe, None),
                               rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Fused path: interpreter on CPU (TRITON_INTERPRET=1), the GPU when there is one
# ---------------------------------------------------------------------------------------------
FUSED_NEMO_CASES = ["padding_window", "dense_cache", "odd_head_dim"]


def _fused_nemo_case(case, dtype, device):
    n_head, n_feat = (2, 82) if case == "odd_head_dim" else (N_HEAD, N_FEAT)
    orig, ours = nemo_pair(backend="triton", n_head=n_head, n_feat=n_feat,
                           att_context_size=[6, 2] if case == "padding_window" else None)
    B, T, C = 2, (21 if case != "dense_cache" else 13), (9 if case == "dense_cache" else 0)
    lengths = torch.tensor([T, T - 6])
    x = rnd(B, T, n_feat, seed=21)
    pe = nemo_rel_pos_emb(n_feat, C + T)
    if case == "dense_cache":
        orig.cache_drop_size = ours.cache_drop_size = 2
        cache = rnd(B, C, n_feat, seed=22)
        pad, dense = nemo_step_masks([-1, -1], "regular", lengths, T, C, torch.tensor([9, 4]))
    else:
        cache = None
        pad, dense = nemo_step_masks([6, 2] if case == "padding_window" else [-1, -1],
                                     "regular", lengths, T)

    def run_orig(mod, dt, dev):
        xx = x.to(device=dev, dtype=dt).requires_grad_()
        args = dict(query=xx, key=xx, value=xx, mask=dense.to(dev), pos_emb=pe.to(dev, dt))
        if cache is None:
            return (mod(**args),), (xx,)
        cc = cache.to(dev, dt).requires_grad_()
        return mod(**args, cache=cc), (xx, cc)

    def run_ours(mod, dt, dev):
        xx = x.to(device=dev, dtype=dt).requires_grad_()
        args = dict(query=xx, key=xx, value=xx, pos_emb=pe.to(dev, dt))
        if case == "padding_window":
            return (mod(**args, mask=None, key_padding_mask=pad.to(dev)),), (xx,)
        if cache is None:
            return (mod(**args, mask=dense.to(dev)),), (xx,)
        cc = cache.to(dev, dt).requires_grad_()
        return mod(**args, mask=dense.to(dev), cache=cc), (xx, cc)

    compare(orig, ours, run_orig, run_ours, dtype, device=device,
            grads=dtype != torch.float16, name=f"nemo {case}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", FUSED_NEMO_CASES)
def test_nemo_fused_path(case, dtype):
    _fused_nemo_case(case, dtype, FUSED_DEVICE)


def _fused_espnet_case(kind, dtype, device):
    orig, ours = espnet_pair(backend="triton")
    B, T = 2, 26
    x, pe = rnd(B, T, N_FEAT, seed=31), rnd(1, 2 * T - 1, N_FEAT, seed=32)
    mask = _espnet_mask(kind, B, T, seed=3)

    def run(mod, dt, dev):
        xx = x.to(device=dev, dtype=dt).requires_grad_()
        return (mod(xx, xx, xx, pe.to(dev, dt), None if mask is None else mask.to(dev)),), (xx,)

    compare(orig, ours, run, run, dtype, device=device, grads=dtype != torch.float16,
            name=f"espnet {kind}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["pad", "dense"])
def test_espnet_fused_path(kind, dtype):
    _fused_espnet_case(kind, dtype, FUSED_DEVICE)


@requires_cuda
@pytest.mark.parametrize("case", FUSED_NEMO_CASES)
def test_nemo_fused_bf16_gpu(case):
    _fused_nemo_case(case, torch.bfloat16, "cuda")


@requires_cuda
@pytest.mark.parametrize("kind", ["pad", "dense"])
def test_espnet_fused_bf16_gpu(kind):
    _fused_espnet_case(kind, torch.bfloat16, "cuda")


@requires_cuda
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_no_host_sync_per_call_gpu(backend):
    """The modules' own code never synchronises with the device (padding, window, cache)."""
    B, T, C = 2, 64, 32
    _, nemo = nemo_pair(backend=backend, att_context_size=[32, 4])
    _, esp = espnet_pair(backend=backend)
    nemo, esp = nemo.cuda(), esp.cuda()
    x = rnd(B, T, N_FEAT, device="cuda")
    cache = rnd(B, C, N_FEAT, device="cuda")
    lengths = torch.tensor([T, T - 9], device="cuda")
    pe = nemo_rel_pos_emb(N_FEAT, T).cuda()
    pe_c = nemo_rel_pos_emb(N_FEAT, C + T).cuda()
    keep = (torch.arange(T, device="cuda")[None] < lengths[:, None])[:, None]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        nemo(query=x, key=x, value=x, mask=None, pos_emb=pe, lengths=lengths)
        nemo(query=x, key=x, value=x, mask=None, pos_emb=pe_c, cache=cache)
        esp(x, x, x, pe, keep)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
