"""txl_kernels.models.MemTransformerLM: the Transformer-XL LM.

- strict loading both ways with the original's layout (tests/txl_original_lm.py, a
  transcription of kimiyoung's code) and equal losses / memories over several segments;
- the K/V cache equals the mems path over several segments (ext_len, same_length, clamp_len,
  the cache's compaction), the position table is reused until the weights change;
- generation: greedy equals a token-by-token loop over the mems path; sampling options;
- HF TransfoXL (transformers 4.x, optional: skipped with the reason when absent): from_hf loads
  strictly, per-token log-probabilities equal HF's over consecutive segments, greedy tokens
  equal HF's greedy loop;
- the fused Triton path (interpreter on CPU) at tiny sizes;
- bad input.
Attention runs on the reference backend except in the fused test (the interpreter is slow).
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import txl_original_lm as orig
from txl_kernels.memory import kv_cache_compact
from txl_kernels.models import MemTransformerLM, TransfoXLCache

from helpers import FUSED_DEVICE

CONFIGS = {
    # name: constructor kwargs (n_token, n_layer, n_head, d_model, d_head, d_inner given below)
    "plain": dict(cutoffs=[], div_val=1, tie_weight=True, tie_projs=[False]),
    "adaptive2": dict(cutoffs=[10, 30], div_val=2, d_embed=16, tie_projs=[False, True, True],
                      same_length=True, clamp_len=5),
    "proj_prelnorm": dict(cutoffs=[20], div_val=1, d_embed=12, tie_projs=[False, True],
                          pre_lnorm=True, tie_weight=False),
}
N_TOKEN, N_LAYER, N_HEAD, D_MODEL, D_HEAD, D_INNER = 50, 2, 2, 16, 8, 24


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is faster (no OpenMP wake-ups) on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_model(cfg="adaptive2", tgt_len=5, mem_len=7, ext_len=0, seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(CONFIGS[cfg])
    args.update(kw)
    args.setdefault("attn_backend", "reference")
    return MemTransformerLM(N_TOKEN, N_LAYER, N_HEAD, D_MODEL, D_HEAD, D_INNER, 0.0, 0.0,
                            tgt_len=tgt_len, ext_len=ext_len, mem_len=mem_len, **args).eval()


def tokens(qlen, bsz, seed=1, n_token=N_TOKEN):
    return torch.randint(0, n_token, (qlen, bsz), generator=torch.Generator().manual_seed(seed))


def segments(data, tgt_len):
    """(inp, target) pairs like the original's LMOrderedIterator over data [len, bsz]."""
    for s in range(0, data.shape[0] - 1, tgt_len):
        n = min(tgt_len, data.shape[0] - 1 - s)
        yield data[s:s + n], data[s + 1:s + 1 + n]


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- original layout

def randomize(module, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_original_layout_loads_strictly_both_ways(cfg):
    """kimiyoung's state_dict loads into ours with strict=True and ours into kimiyoung's; the
    two give the same per-token losses and memories over several segments."""
    args = dict(CONFIGS[cfg])
    tgt_len, mem_len = 5, 7
    torch.manual_seed(0)
    ref = orig.MemTransformerLM(N_TOKEN, N_LAYER, N_HEAD, D_MODEL, D_HEAD, D_INNER, 0.0, 0.0,
                                tgt_len=tgt_len, ext_len=0, mem_len=mem_len, **args).eval()
    randomize(ref)
    ref.crit.keep_order = True  # per-token order (ours always keeps it)
    ours = make_model(cfg, tgt_len, mem_len, seed=5)
    assert set(ours.state_dict()) == set(ref.state_dict())
    ours.load_state_dict(ref.state_dict(), strict=True)
    # and back: a fresh original takes our weights strictly
    back = orig.MemTransformerLM(N_TOKEN, N_LAYER, N_HEAD, D_MODEL, D_HEAD, D_INNER, 0.0, 0.0,
                                 tgt_len=tgt_len, ext_len=0, mem_len=mem_len, **args).eval()
    back.load_state_dict(ours.state_dict(), strict=True)
    for k, v in back.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k

    data = tokens(4 * tgt_len + 1, 3)
    mems_ref, mems_ours = [], []
    for inp, tgt in segments(data, tgt_len):
        out_ref = ref(inp, tgt, *mems_ref)
        out_ours = ours(inp, tgt, *mems_ours)
        assert len(out_ours) == len(out_ref) == N_LAYER + 2
        close(out_ours[0], out_ref[0])
        for a, b in zip(out_ours[1:], out_ref[1:]):
            close(a, b)
        mems_ref, mems_ours = out_ref[1:], out_ours[1:]


def test_untie_r_layout_and_no_memory():
    ours = make_model("plain", untie_r=True)
    keys = set(ours.state_dict())
    assert "r_w_bias" not in keys and "layers.1.dec_attn.r_r_bias" in keys
    no_mem = make_model("plain", mem_len=0)
    out = no_mem(tokens(5, 2), tokens(5, 2, seed=2))
    assert len(out) == 1 and out[0].shape == (5, 2)


# ----------------------------------------------------------------------------- K/V cache

@pytest.mark.parametrize("cfg,ext_len,mem_len", [("adaptive2", 0, 7), ("proj_prelnorm", 2, 6),
                                                 ("plain", 0, 3)])
def test_cache_equals_mems_path(cfg, ext_len, mem_len):
    tgt_len, bsz = 5, 3
    model = make_model(cfg, tgt_len, mem_len, ext_len)
    cache = model.new_cache(bsz)
    assert cache.nbytes == 2 * N_LAYER * (2 * mem_len + tgt_len + ext_len) * bsz \
        * N_HEAD * D_HEAD * 4
    data = tokens(40, bsz, seed=4)
    mems = []
    compacted = False
    for s in range(0, 36, tgt_len):  # overlapping segments of tgt_len + ext_len tokens
        inp, tgt = data[s:s + tgt_len + ext_len], data[s + 1:s + 1 + tgt_len + ext_len]
        start = cache.start
        out = model(inp, tgt, *mems)
        mems = out[1:]
        (loss,) = model(inp, tgt, cache=cache)
        compacted |= cache.start < start
        close(loss, out[0])
        assert cache.mlen == mems[0].shape[0]
    assert compacted  # the window moved back to row 0 at least once
    # log-probabilities too
    lp, *mems = model.log_probs(data[36:39], *mems)
    (lp_c,) = model.log_probs(data[36:39], cache=cache)
    close(lp_c, lp)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3, bsz))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cache_equals_mems_path_half(dtype):
    """fp16 / bf16 models: the cache path and the mems path agree to the dtype's precision
    (they round differently: keys are projected per segment, the position table once)."""
    model = make_model("adaptive2", 5, 7).to(dtype)
    cache = model.new_cache(2)
    assert cache.k[0].dtype == dtype
    data = tokens(21, 2, seed=13)
    mems = []
    for inp, tgt in segments(data, 5):
        out = model(inp, tgt, *mems)
        mems = out[1:]
        (loss,) = model(inp, tgt, cache=cache)
        assert loss.dtype == dtype and mems[0].dtype == dtype
        torch.testing.assert_close(loss.float(), out[0].float(), rtol=3e-2, atol=3e-2)


def test_position_table_built_once_per_cache():
    """The cache builds the projected position table at its first segment and reuses it;
    reset() drops it with the memory."""
    model = make_model("adaptive2")
    cache = model.new_cache(2)
    data = tokens(15, 2)
    model(data[:5], data[1:6], cache=cache)
    table = cache._pos_tables[0]
    model(data[5:10], data[6:11], cache=cache)
    assert cache._pos_tables[0] is table  # same tensor: computed once
    cache.reset()
    model(data[:5], data[1:6], cache=cache)
    assert cache._pos_tables[0] is not table


def _write_through_data(model, what):
    """Change weights the way an EMA swap or a manual copy does: through ``.data``, which
    torch's version counters do not see."""
    g = torch.Generator().manual_seed(21)
    if what == "r_net":
        for layer in model.layers:
            w = layer.dec_attn.r_net.weight
            w.data.copy_(torch.randn(w.shape, generator=g) * 0.5)
    elif what == "inv_freq":
        model.pos_emb.inv_freq.data.mul_(1.7)
    else:  # the adaptive softmax head: shortlist rows and cluster logits
        model.crit.out_layers[0].weight.data.copy_(
            torch.randn(model.crit.out_layers[0].weight.shape, generator=g))
        model.crit.cluster_weight.data.copy_(
            torch.randn(model.crit.cluster_weight.shape, generator=g))


@pytest.mark.parametrize("what", ["r_net", "inv_freq", "crit_head"])
def test_weights_written_through_data_are_seen(what):
    """After weights change through ``.data``, a new cache (or a reset one) and the no-grad
    paths (log_probs, generate) use the new weights: the same losses, log-probabilities and
    tokens as a fresh model built with them."""
    model = make_model("adaptive2", tgt_len=5, mem_len=7)
    data = tokens(16, 2, seed=20)
    prompt = data[:6].t().contiguous()
    cache = model.new_cache(2)
    with torch.no_grad():  # fill every cached derivative of the old weights
        for inp, tgt in segments(data[:11], 5):
            model(inp, tgt, cache=cache)
        model.log_probs(data[:5])
        model.generate(prompt, 3)
    _write_through_data(model, what)
    fresh = make_model("adaptive2", tgt_len=5, mem_len=7, seed=9)
    fresh.load_state_dict(model.state_dict())  # inv_freq included (a persistent buffer)
    with torch.no_grad():
        new = model.new_cache(2)
        cache.reset()
        mems = []
        for inp, tgt in segments(data, 5):
            want, *mems = fresh(inp, tgt, *mems)
            close(model(inp, tgt, cache=new)[0], want)
            close(model(inp, tgt, cache=cache)[0], want)
        close(model.log_probs(data[:5])[0], fresh.log_probs(data[:5])[0])
        assert torch.equal(model.generate(prompt, 5), fresh.generate(prompt, 5))


def test_kv_cache_compact_extension_and_fallback():
    g = torch.Generator().manual_seed(0)
    for backend in ("extension", "torch"):
        bufs = [torch.randn(11, 2, 6, generator=g) for _ in range(4)]
        before = [b.clone() for b in bufs]
        kv_cache_compact(bufs, 6, 4, backend=backend)
        for b, r in zip(bufs, before):
            assert torch.equal(b[:4], r[6:10]) and torch.equal(b[4:], r[4:])
    with pytest.raises(ValueError, match="overlap"):
        kv_cache_compact([torch.zeros(8, 1, 2)], 2, 3)
    with pytest.raises(ValueError, match="exceed"):
        kv_cache_compact([torch.zeros(8, 1, 2)], 6, 3)
    with pytest.raises(ValueError, match="contiguous"):
        kv_cache_compact([torch.zeros(8, 2, 2).transpose(0, 1)], 4, 1)


# ----------------------------------------------------------------------------- generation

def greedy_loop_mems(model, prompt, n_new, seg):
    """Greedy decoding over the mems path: the prompt in segments, then token by token."""
    data = prompt.t()
    mems = []
    for s in range(0, data.shape[0], seg):
        lp, *mems = model.log_probs(data[s:s + seg], *mems)
    out = [prompt]
    for _ in range(n_new):
        tok = lp[-1].argmax(-1)
        out.append(tok[:, None])
        lp, *mems = model.log_probs(tok[None], *mems)
    return torch.cat(out, 1)


@pytest.mark.parametrize("cfg,extension_backend", [("adaptive2", "extension"),
                                                 ("proj_prelnorm", "extension"),
                                                 ("adaptive2", "torch")])
def test_generate_greedy_equals_mems_loop(cfg, extension_backend):
    """Greedy generation on the cache (CPU decoding steps by rel_attn_decode's C++ kernel or
    decode_layer, or by the torch fallback) equals the mems path's token-by-token loop."""
    model = make_model(cfg, tgt_len=4, mem_len=6, extension_backend=extension_backend)
    prompt = tokens(11, 3, seed=7).t().contiguous()  # [bsz=3, len=11]
    got = model.generate(prompt, 9)
    assert got.shape == (3, 20) and torch.equal(got[:, :11], prompt)
    assert torch.equal(got, greedy_loop_mems(model, prompt, 9, 4))
    # continuing from a cache: same as one call
    cache = model.new_cache(3, ext_len=0)
    first = model.generate(prompt, 4, cache=cache)
    more = model.generate(first[:, -1:], 5, cache=cache)
    assert torch.equal(torch.cat([first, more[:, 1:]], 1), got)


def test_generate_sampling():
    model = make_model("adaptive2", tgt_len=4, mem_len=6)
    prompt = tokens(5, 2, seed=8).t().contiguous()
    a = model.generate(prompt, 6, do_sample=True, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 6, do_sample=True, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (2, 11)
    greedy = model.generate(prompt, 6)
    top1 = model.generate(prompt, 6, do_sample=True, top_k=1,
                          generator=torch.Generator().manual_seed(2))
    assert torch.equal(top1, greedy)  # top_k=1 leaves only the argmax
    tiny_p = model.generate(prompt, 6, do_sample=True, top_p=1e-6,
                            generator=torch.Generator().manual_seed(3))
    assert torch.equal(tiny_p, greedy)  # the smallest nucleus is the argmax
    assert int(a.max()) < N_TOKEN and int(a.min()) >= 0


# ----------------------------------------------------------------------------- fused path

@pytest.mark.parametrize("same_length", [False, True])
def test_fused_path_tiny(same_length):
    """attn_backend='triton' (the Triton interpreter on CPU here) equals the reference backend
    on the mems path, the cache path and a decode step."""
    torch.manual_seed(0)
    kw = dict(cutoffs=[8], div_val=1, tie_projs=[False, False], same_length=same_length)
    ref = MemTransformerLM(20, 1, 1, 16, 16, 16, 0.0, 0.0, tgt_len=3, mem_len=4,
                           attn_backend="reference", **kw).eval()
    fused = MemTransformerLM(20, 1, 1, 16, 16, 16, 0.0, 0.0, tgt_len=3, mem_len=4,
                             attn_backend="triton", **kw).eval()
    fused.load_state_dict(ref.state_dict())
    ref, fused = ref.to(FUSED_DEVICE), fused.to(FUSED_DEVICE)
    data = tokens(7, 2, n_token=20).to(FUSED_DEVICE)
    out_r = ref(data[:3], data[1:4])
    out_f = fused(data[:3], data[1:4])
    close(out_f[0], out_r[0], 1e-4)
    out_r = ref(data[3:6], data[4:7], *out_r[1:])
    out_f = fused(data[3:6], data[4:7], *out_f[1:])
    close(out_f[0], out_r[0], 1e-4)
    cache = fused.new_cache(2)
    fused(data[:3], data[1:4], cache=cache)
    (loss,) = fused(data[3:6], data[4:7], cache=cache)
    close(loss, out_r[0], 1e-4)
    (lp_f,) = fused.log_probs(data[6:7], cache=cache)  # qlen 1 against the cache
    lp_r, *_ = ref.log_probs(data[6:7], *out_r[1:])
    close(lp_f, lp_r, 1e-4)


# ----------------------------------------------------------------------------- bad input

def test_extension_backend_is_checked_where_it_is_set():
    """An unknown extension_backend raises naming the argument, at construction and when a
    cache is made from a changed attribute (the cache path would otherwise take it as
    "auto")."""
    with pytest.raises(ValueError, match=r"MemTransformerLM: extension_backend must be one of "
                                         r"\('auto', 'extension', 'torch'\), got 'cuda'"):
        make_model("plain", extension_backend="cuda")
    model = make_model("plain", extension_backend="torch")
    model.extension_backend = "cpp"
    with pytest.raises(ValueError, match="new_cache: extension_backend must be one of"):
        model.new_cache(2)


def test_memory_backend_is_the_deprecated_name_of_extension_backend():
    """MemTransformerLM(memory_backend=...) and TransfoXLCache(memory_backend=...), the names
    extension_backend had before, still work with a DeprecationWarning naming the new one
    (as keywords and as attributes); both names at once raise TypeError; the new name warns
    nothing."""
    with pytest.warns(DeprecationWarning, match=r"MemTransformerLM: memory_backend= is "
                                                r"deprecated.*extension_backend="):
        model = make_model("plain", memory_backend="torch")
    assert model.extension_backend == "torch"
    assert model.new_cache(2).extension_backend == "torch"
    with pytest.raises(TypeError, match="got both extension_backend= and memory_backend="):
        make_model("plain", memory_backend="torch", extension_backend="torch")
    # the old name is checked as the new one is
    with pytest.warns(DeprecationWarning), \
            pytest.raises(ValueError, match="extension_backend must be one of"):
        make_model("plain", memory_backend="cuda")
    args = (1, 2, 3, 0, 4, 8, torch.float32, "cpu")
    with pytest.warns(DeprecationWarning, match=r"TransfoXLCache: memory_backend= is "
                                                r"deprecated.*extension_backend="):
        cache = TransfoXLCache(*args, memory_backend="torch")
    assert cache.extension_backend == "torch"
    for both in (dict(extension_backend="auto"), {}):  # by keyword, by position
        pos = () if both else ("auto",)
        with pytest.raises(TypeError, match="TransfoXLCache: got both extension_backend="):
            TransfoXLCache(*args, *pos, memory_backend="torch", **both)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_model("plain", extension_backend="torch").extension_backend == "torch"
        assert TransfoXLCache(*args, "torch").extension_backend == "torch"
    # the attribute too: writing the old name must not set an attribute nothing reads
    for obj, who in ((model, "MemTransformerLM"), (cache, "TransfoXLCache")):
        with pytest.warns(DeprecationWarning, match=rf"{who}.memory_backend is deprecated"):
            obj.memory_backend = "auto"
        assert obj.extension_backend == "auto"
        with pytest.warns(DeprecationWarning, match="renamed extension_backend"):
            assert obj.memory_backend == "auto"


@pytest.mark.parametrize("train", [False, True])
def test_cache_path_records_no_partial_gradients(train):
    """The cache path runs without a graph: with gradients enabled its loss / log-probs
    raise on backward (no parameter gets a gradient, where a partial graph used to fill the
    embedding and the softmax bias only); under no_grad they are plain tensors; the values
    are the same either way."""
    m = MemTransformerLM(50, 2, 2, 12, 6, 16, 0., 0., tgt_len=4, mem_len=5).train(train)
    d = tokens(4, 2)
    (loss,) = m(d, d, cache=m.new_cache(2))
    with pytest.raises(RuntimeError, match=r"cache path \(cache=\.\.\.\) records no "
                                           r"gradients.*mems path"):
        loss.sum().backward()
    assert all(p.grad is None for p in m.parameters())
    (logp,) = m.log_probs(d, cache=m.new_cache(2))
    with pytest.raises(RuntimeError, match="records no gradients"):
        torch.autograd.grad(logp.sum(), list(m.parameters()))
    with torch.no_grad():
        (loss_ng,) = m(d, d, cache=m.new_cache(2))
    assert not loss_ng.requires_grad
    if not train:  # no dropout: the same values
        assert torch.equal(loss.detach(), loss_ng)
    # the mems path still trains every parameter
    m.zero_grad()
    m(d, d)[0].sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_bad_inputs():
    model = make_model("adaptive2")
    data, tgt = tokens(5, 2), tokens(5, 2, seed=2)
    with pytest.raises(ValueError, match=r"token ids in \[.*n_token=50"):
        model(data + 50, tgt)
    with pytest.raises(ValueError, match="target.*vocabulary"):
        model(data, tgt - 100)
    with pytest.raises(TypeError, match="integer token ids"):
        model(data.float(), tgt)
    with pytest.raises(ValueError, match=r"2-D tensor of token ids \[qlen, bsz\]"):
        model(data[:, 0], tgt)
    with pytest.raises(ValueError, match=r"target must be \[tgt_len <= qlen=5, bsz=2\]"):
        model(data, tokens(6, 2))
    out = model(data, tgt)
    mems = out[1:]
    with pytest.raises(ValueError, match=r"n_layer \+ 1 = 3 memories"):
        model(data, tgt, *mems[:2])
    with pytest.raises(ValueError, match=r"mems\[1\] must be \[mlen, bsz=2, d_model=16\]"):
        model(data, tgt, mems[0], mems[1][:, :1], mems[2])
    with pytest.raises(TypeError, match=r"mems\[0\] has dtype torch.float64"):
        model(data, tgt, *[m.double() for m in mems])
    with pytest.raises(ValueError, match="one length"):
        model(data, tgt, mems[0], mems[1][:2], mems[2])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"mems\[0\] is on cuda"):
            model(data, tgt, *[m.cuda() for m in mems])
    meta = [torch.empty(m.shape, device="meta") for m in mems]
    with pytest.raises(ValueError, match=r"mems\[0\] is on meta"):
        model(data, tgt, *meta)
    cache = model.new_cache(2)
    with pytest.raises(ValueError, match="either mems or cache"):
        model(data, tgt, *mems, cache=cache)
    with pytest.raises(ValueError, match="batch size 2, data has bsz=3"):
        model(tokens(5, 3), tokens(5, 3), cache=cache)
    with pytest.raises(ValueError, match="longer than the cache allows"):
        model(tokens(9, 2), tokens(9, 2), cache=cache)
    with pytest.raises(TypeError, match="new_cache"):
        model(data, tgt, cache=object())
    model.reset_length(5, 0, 4)
    with pytest.raises(ValueError, match="made for mem_len=7; the model now has mem_len=4"):
        model(data, tgt, cache=cache)
    model.reset_length(5, 0, 7)
    # generate
    prompt = data.t().contiguous()
    model.train()
    with pytest.raises(RuntimeError, match="training mode"):
        model.generate(prompt, 2)
    model.eval()
    with pytest.raises(ValueError, match="input_ids.*outside the vocabulary"):
        model.generate(prompt + 60, 2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        model.generate(prompt, -1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(prompt, 2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="ext_len=0"):
        model.generate(prompt, 2, cache=model.new_cache(2, ext_len=1))
    with pytest.raises(ValueError, match="input_ids is empty"):
        model.generate(prompt[:, :0], 2)
    with pytest.raises(ValueError, match="only attn_type=0"):
        MemTransformerLM(10, 1, 1, 8, 8, 8, 0.0, 0.0, tgt_len=2, mem_len=2, attn_type=2)
    with pytest.raises(ValueError, match="cutoffs must be increasing"):
        MemTransformerLM(10, 1, 1, 8, 8, 8, 0.0, 0.0, tgt_len=2, mem_len=2, cutoffs=[12])


def test_cache_belongs_to_its_model_and_configuration():
    """A cache raises, naming both sides, when used with another model (even one with the
    same configuration and weights) or after reset_length / attribute changes it depends on."""
    model = make_model("adaptive2", tgt_len=5, mem_len=7)
    twin = make_model("adaptive2", tgt_len=5, mem_len=7)
    twin.load_state_dict(model.state_dict())
    data, tgt = tokens(5, 2), tokens(5, 2, seed=2)
    cache = model.new_cache(2)
    model(data, tgt, cache=cache)
    with pytest.raises(ValueError, match=r"made for another model, MemTransformerLM at 0x"
                                         r"[0-9a-f]+; this is MemTransformerLM at 0x"):
        twin(data, tgt, cache=cache)
    with pytest.raises(ValueError, match="another model"):
        twin.generate(data.t().contiguous(), 2, cache=model.new_cache(2, ext_len=0))
    for change, msg in [
            (lambda: model.reset_length(5, 2, 7), "made for ext_len=0; the model now has "
                                                  "ext_len=2"),
            (lambda: model.reset_length(5, 0, 3), "made for mem_len=7; the model now has "
                                                  "mem_len=3"),
            (lambda: setattr(model, "same_length", False), "same_length=True; the model now "
                                                           "has same_length=False"),
            (lambda: setattr(model, "clamp_len", 2), "clamp_len=5; the model now has "
                                                     "clamp_len=2")]:
        change()
        with pytest.raises(ValueError, match=msg):
            model(data, tgt, cache=cache)
        model.reset_length(5, 0, 7)
        model.same_length, model.clamp_len = True, 5
        model(data, tgt, cache=cache)  # the configuration it was made for: accepted again
    direct = TransfoXLCache(N_LAYER, 2, 7, 0, 5, N_HEAD * D_HEAD, torch.float32, "cpu",
                            n_head=N_HEAD)
    with pytest.raises(ValueError, match=r"made for no model \(not made by new_cache\)"):
        model(data, tgt, cache=direct)


def test_same_length_without_memory_raises_on_both_paths():
    """same_length=True with mem_len=0: kimiyoung's mask leaves a query no key (the original
    returns NaN); the mems path, the cache path and generate raise alike. With mem_len >= 1
    both paths follow the original's mask (the last mem_len keys)."""
    model = make_model("plain", tgt_len=4, mem_len=0, same_length=True)
    data, tgt = tokens(4, 2), tokens(4, 2, seed=2)

    def original(mem_len):
        ref = orig.MemTransformerLM(N_TOKEN, N_LAYER, N_HEAD, D_MODEL, D_HEAD, D_INNER, 0.0,
                                    0.0, tgt_len=4, ext_len=0, mem_len=mem_len,
                                    same_length=True, **CONFIGS["plain"]).eval()
        ref.load_state_dict(model.state_dict())
        ref.crit.keep_order = True
        return ref

    ref = original(0)
    with torch.no_grad():
        assert torch.isnan(ref(data, tgt)[0]).all()
    msg = "same_length=True with mem_len=0"
    with pytest.raises(ValueError, match=msg):
        model(data, tgt)
    with pytest.raises(ValueError, match=msg):
        model(data, tgt, cache=model.new_cache(2))
    with pytest.raises(ValueError, match=msg):
        model.log_probs(data)
    with pytest.raises(ValueError, match=msg):
        model.generate(data.t().contiguous(), 2)
    for mem_len in (1, 2):
        model.reset_length(4, 0, mem_len)
        ref = original(mem_len)
        cache = model.new_cache(2)
        mems, mems_ref = [], []
        for inp, t in segments(tokens(13, 2, seed=3), 4):
            want, *mems_ref = ref(inp, t, *mems_ref)
            got, *mems = model(inp, t, *mems)
            close(got, want)
            close(model(inp, t, cache=cache)[0], want)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8,
                                   torch.uint16, torch.uint32])
def test_narrow_integer_token_ids(dtype):
    """Token ids of any integer dtype up to 32 bits give the int64 results."""
    model = make_model("adaptive2")
    data, tgt = tokens(5, 2), tokens(5, 2, seed=2)
    want, *_ = model(data, tgt)
    close(model(data.to(dtype), tgt.to(dtype))[0], want)
    close(model.log_probs(data.to(dtype))[0], model.log_probs(data)[0])
    prompt = data.t().contiguous()
    assert torch.equal(model.generate(prompt.to(dtype), 3), model.generate(prompt, 3))
    (c,) = model(data.to(dtype), tgt, cache=model.new_cache(2))
    close(c, want)


def test_unsupported_token_id_dtype_is_named():
    model = make_model("adaptive2")
    data, tgt = tokens(5, 2), tokens(5, 2, seed=2)
    with pytest.raises(TypeError, match="data must hold integer token ids.*uint64"):
        model(data.to(torch.uint64), tgt)
    with pytest.raises(TypeError, match="target must hold integer token ids.*bool"):
        model(data, tgt.bool())
    with pytest.raises(TypeError, match="input_ids must hold integer token ids.*float32"):
        model.generate(data.t().float(), 2)


def test_oversized_cache_is_refused_before_allocating(monkeypatch):
    """A cache larger than the device's available memory raises MemoryError naming mem_len
    and the bytes it needs, from new_cache and from generate (which makes one)."""
    model = make_model("adaptive2", tgt_len=5, mem_len=7)
    model.reset_length(5, 0, 10 ** 9)
    need = 2 * N_LAYER * (2 * 10 ** 9 + 5) * 2 * N_HEAD * D_HEAD * 4
    msg = f"mem_len=1000000000 needs a cache of {need} bytes on cpu"
    with pytest.raises(MemoryError, match=msg):
        model.new_cache(2)
    with pytest.raises(MemoryError, match=msg):
        model.generate(tokens(3, 2).t().contiguous(), 2)
    # the check runs before the allocation: a small cache against a tiny budget
    import txl_kernels.models.cache as cache_mod

    model.reset_length(5, 0, 7)
    monkeypatch.setattr(cache_mod, "_available_bytes", lambda device: 1000)
    need = 2 * N_LAYER * 19 * 2 * N_HEAD * D_HEAD * 1 + 2 * N_LAYER * 19 * 2 * N_HEAD * 2
    with pytest.raises(MemoryError, match=rf"mem_len=7 needs a cache of {need} bytes.*"
                                          rf"torch.float16 scales.*1000 bytes available"):
        model.new_cache(2, dtype=torch.int8, scale_dtype=torch.float16)


# ----------------------------------------------------------------------------- HF TransfoXL

def hf_transfo_xl():
    """(TransfoXLConfig, TransfoXLLMHeadModel) from transformers 4.x, or skip with the reason
    (fail instead when TXL_REQUIRE_HF4=1, as CI sets it where it installed the hf4 extra)."""
    skip = pytest.fail if os.environ.get("TXL_REQUIRE_HF4") == "1" else pytest.skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformers
            from transformers import TransfoXLConfig, TransfoXLLMHeadModel
    except Exception as e:  # not installed, or a release without TransfoXL
        skip(f"needs transformers 4.x with TransfoXL (the 'hf4' extra: "
                    f"transformers==4.34.1): {type(e).__name__}: {e}")
    if not transformers.__version__.startswith("4."):
        skip(f"needs transformers 4.x, found {transformers.__version__}")
    return TransfoXLConfig, TransfoXLLMHeadModel


def make_hf(untie_r, div_val=2, cutoffs=(10, 30), d_embed=16, mem_len=6, seed=0):
    Config, LMHead = hf_transfo_xl()
    torch.manual_seed(seed)
    cfg = Config(vocab_size=N_TOKEN, cutoffs=list(cutoffs), d_model=D_MODEL, d_embed=d_embed,
                 n_head=N_HEAD, d_head=D_HEAD, d_inner=D_INNER, div_val=div_val, n_layer=N_LAYER,
                 mem_len=mem_len, clamp_len=5, same_length=True, untie_r=untie_r, dropout=0.0,
                 dropatt=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = LMHead(cfg).eval()
    randomize(hf, seed=seed + 1)  # cluster and bias parameters are zero at HF's init
    hf.tie_weights()
    return hf


def hf_empty_mems(bsz):
    return [torch.empty(0, bsz, D_MODEL) for _ in range(N_LAYER)]


@pytest.mark.parametrize("untie_r,div_val,cutoffs,d_embed", [
    (True, 2, (10, 30), 16), (False, 1, (20,), 12), (True, 1, (), 16)])
def test_from_hf_log_probs_over_segments(untie_r, div_val, cutoffs, d_embed):
    hf = make_hf(untie_r, div_val, cutoffs, d_embed)
    model = MemTransformerLM.from_hf(hf, tgt_len=4, attn_backend="reference")
    assert not model.training and model.untie_r == untie_r
    bsz = 2
    data = tokens(17, bsz, seed=9)  # segments of 4, 4, 4, 4, 1
    hf_mems, mems = hf_empty_mems(bsz), []
    cache = model.new_cache(bsz)
    for s in range(0, 17, 4):
        seg = data[s:s + 4]
        with torch.no_grad():
            out = hf(seg.t(), mems=hf_mems)
        hf_mems = out.mems
        want = out.prediction_scores.transpose(0, 1)  # [qlen, bsz, n_token]
        got, *mems = model.log_probs(seg, *mems)
        close(got, want)
        (got_c,) = model.log_probs(seg, cache=cache)
        close(got_c, want)
        for a, b in zip(mems, hf_mems):  # ours has one more (the last layer's output)
            close(a, b)


def test_from_hf_default_zero_memory():
    """HF starts from mem_len zero vectors when mems is None; the same memories passed to
    ours give the same log-probabilities."""
    hf = make_hf(True)
    model = MemTransformerLM.from_hf(hf, tgt_len=4, attn_backend="reference")
    data = tokens(5, 2, seed=10)
    with torch.no_grad():
        out = hf(data.t())
    zeros = [torch.zeros(6, 2, D_MODEL) for _ in range(N_LAYER + 1)]
    got, *_ = model.log_probs(data, *zeros)
    close(got, out.prediction_scores.transpose(0, 1))


@pytest.mark.parametrize("untie_r", [True, False])
def test_generate_equals_hf_greedy_loop(untie_r):
    hf = make_hf(untie_r, mem_len=5)
    seg = 4
    model = MemTransformerLM.from_hf(hf, tgt_len=seg, attn_backend="reference")
    prompt = tokens(10, 2, seed=11).t().contiguous()
    # HF's greedy loop: the prompt in segments with mems, then the last token fed with mems
    mems = hf_empty_mems(2)
    with torch.no_grad():
        for s in range(0, prompt.shape[1], seg):
            out = hf(prompt[:, s:s + seg], mems=mems)
            mems = out.mems
        seq = [prompt]
        for _ in range(12):
            tok = out.prediction_scores[:, -1].argmax(-1, keepdim=True)
            seq.append(tok)
            out = hf(tok, mems=mems)
            mems = out.mems
    want = torch.cat(seq, 1)
    assert torch.equal(model.generate(prompt, 12), want)


def test_from_hf_rejects_other_models():
    hf_transfo_xl()
    with pytest.raises(TypeError, match="TransfoXLLMHeadModel"):
        MemTransformerLM.from_hf(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- decode kernel

@pytest.mark.parametrize("lk,d,wl,splits,dtype", [
    (1, 16, -1, 0, torch.float32), (37, 41, -1, 3, torch.float32), (130, 16, 20, 2, torch.float32),
    (70, 32, 0, 0, torch.float32), (45, 16, -1, 2, torch.float16),
    (33, 24, 7, 2, torch.bfloat16)])
def test_decode_matches_reference(lk, d, wl, splits, dtype):
    """The split-K decode kernel (Triton interpreter on CPU here) against the einsum
    reference at Lq = 1, seq-first strided keys and values as the cache
    passes them."""
    from txl_kernels.ops.rel_attn_decode import rel_attn_decode
    from txl_kernels.reference import rel_attention_reference

    g = torch.Generator().manual_seed(lk)
    B, H = 2, 3
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(FUSED_DEVICE)
    q = rnd(B, 1, H, d)
    k = rnd(lk + 5, B, H, d)[:lk].transpose(0, 1)  # [B, Lk, H, D] view of a seq-first buffer
    v = rnd(lk + 5, B, H, d)[:lk].transpose(0, 1)
    r, u, vb = rnd(lk, H, d), rnd(H, d), rnd(H, d)
    scale = d ** -0.5
    got = rel_attn_decode(q, k, v, r, u, vb, scale, wl, num_splits=splits)
    want = rel_attention_reference(*(t.double() for t in (q, k, v, r, u, vb)), scale, wl, 0)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("lk,d,wl,B,dtype", [
    (1, 16, -1, 2, torch.float32), (37, 41, -1, 2, torch.float32), (130, 16, 20, 3, torch.float32),
    (70, 32, 0, 1, torch.float32), (45, 41, 7, 2, torch.float64), (19, 8, -1, 1, torch.float64)])
def test_decode_extension_matches_reference(lk, d, wl, B, dtype, cpu_isa):
    """The C++ CPU kernel of the decode op ``txl_kernels::rel_attn_decode`` against the
    einsum reference at Lq = 1, with the cache's seq-first strided keys / values and a
    strided position table."""
    from txl_kernels.reference import rel_attention_reference

    g = torch.Generator().manual_seed(lk + d)
    H = 3
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    q = rnd(B, 1, H, d)
    k = rnd(lk + 5, B, H, d)[2:lk + 2].transpose(0, 1)  # [B, Lk, H, D] views
    v = rnd(lk + 5, B, H, d)[:lk].transpose(0, 1)
    r = rnd(lk + 4, H, d)[4:]
    u, vb = rnd(H, d), rnd(H, d)
    scale = d ** -0.5
    assert _has_cpu_kernel("rel_attn_decode")
    got = torch.ops.txl_kernels.rel_attn_decode(q, k, v, r, u, vb, scale, wl)
    assert got.shape == (B, 1, H, d) and got.dtype == dtype
    want = rel_attention_reference(*(t.double() for t in (q, k, v, r, u, vb)), scale, wl, 0)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def _has_cpu_kernel(op: str) -> bool:
    """Whether the C++ extension registered ``txl_kernels::op``'s CPU kernel (so a call runs
    it, not the reference fallback)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"txl_kernels::{op}", "CPU")


@pytest.mark.parametrize("qdtype,sdtype,dtype,m,lc,wl", [
    (torch.int8, torch.float32, torch.float32, 37, 1, -1),
    (torch.float8_e4m3fn, torch.float32, torch.float32, 20, 3, 9),
    (torch.int8, torch.float16, torch.float64, 9, 1, 30),
    (torch.float8_e4m3fn, torch.float16, torch.float32, 1, 1, -1)])
def test_decode_extension_8bit_memory(qdtype, sdtype, dtype, m, lc, wl, cpu_isa):
    """The C++ decode step with an 8-bit memory (read in 8 bits, dequantised in registers)
    against the dequantise-then-attend oracle (``QuantizedKV.dequantize`` + the einsum
    reference): only the arithmetic order may differ."""
    from txl_kernels.quant import quantize_kv
    from txl_kernels.reference import rel_attention_reference

    g = torch.Generator().manual_seed(m + lc)
    B, H, d = 2, 3, 41
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    q = rnd(B, 1, H, d)
    mem = quantize_kv(rnd(B, m, H, d) * 3, rnd(B, m, H, d), qdtype, sdtype)
    k = rnd(lc + 2, B, H, d)[:lc].transpose(0, 1)  # the current rows, [B, Lc, H, D] views
    v = rnd(lc + 2, B, H, d)[:lc].transpose(0, 1)
    r, u, vb = rnd(m + lc, H, d), rnd(H, d), rnd(H, d)
    mk, mv = mem.dequantize(dtype)
    full = (torch.cat([mk, k], 1), torch.cat([mv, v], 1))
    assert _has_cpu_kernel("rel_attn_decode")
    got = torch.ops.txl_kernels.rel_attn_decode(q, k, v, r, u, vb, 0.2, wl, *mem)
    want = rel_attention_reference(*(t.double() for t in (q, *full, r, u, vb)), 0.2, wl, 0)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_decode_extension_rejects_bad_input():
    """The C++ op's own checks (direct callers): shapes, dtypes, devices, layout, name the
    argument."""
    from txl_kernels import _build
    ext = _build.load_extension()
    assert ext is not None, _build.extension_status()["reason"]
    attend = torch.ops.txl_kernels.rel_attn_decode
    q, k, r, u = torch.randn(1, 1, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(5, 2, 8), \
        torch.randn(2, 8)
    attend(q, k, k, r, u, u, 0.3)  # fine
    with pytest.raises(ValueError, match="q must be \\[B, 1, H, D\\]"):
        attend(q.expand(1, 2, 2, 8), k, k, r, u, u, 0.3)
    with pytest.raises(ValueError, match="r has 4 rows"):
        attend(q, k, k, r[:4], u, u, 0.3)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        attend(q.half(), k.half(), k.half(), r.half(), u.half(), u.half(), 0.3)
    with pytest.raises(RuntimeError, match="every tensor"):
        attend(q, k.double(), k, r, u, u, 0.3)
    with pytest.raises(RuntimeError, match="last dimension"):
        attend(q, k, k.transpose(2, 3).contiguous().transpose(2, 3), r, u, u, 0.3)
    km, ks = torch.zeros(1, 4, 2, 8, dtype=torch.int8), torch.ones(1, 4, 2)
    r9 = torch.randn(9, 2, 8)
    attend(q, k, k, r9, u, u, 0.3, -1, km, ks, km, ks)  # fine: 4 + 5 keys
    with pytest.raises(RuntimeError, match="all of k_mem"):
        attend(q, k, k, r9, u, u, 0.3, -1, km, ks)
    with pytest.raises(RuntimeError, match="int8 or float8_e4m3fn"):
        attend(q, k, k, r9, u, u, 0.3, -1, km.float(), ks, km.float(), ks)
    with pytest.raises(RuntimeError, match="v_scale must be"):
        attend(q, k, k, r9, u, u, 0.3, -1, km, ks, km, ks[:, :3])
    with pytest.raises(ValueError, match="r has 5 rows"):
        attend(q, k, k, r, u, u, 0.3, -1, km, ks, km, ks)


@pytest.mark.parametrize("cfg,dtype,cache_dtype,untie_r", [
    ("adaptive2", torch.float32, None, False), ("proj_prelnorm", torch.float64, None, True),
    ("adaptive2", torch.float32, torch.int8, True),
    ("plain", torch.float64, torch.float8_e4m3fn, False)])
def test_decode_layer_equals_op_by_op(cfg, dtype, cache_dtype, untie_r, monkeypatch):
    """The C++ decode_layer (a whole layer per call at qlen 1 on CPUs) gives the op-by-op
    layer's log-probabilities and cache contents bit for bit, over decoding steps that cross
    the cache's compaction (same_length's window in "adaptive2", pre_lnorm, untied biases,
    fp64, an 8-bit memory); and it is the route taken for every layer of every step."""
    from txl_kernels.models import mem_transformer as mt

    model = make_model(cfg, tgt_len=4, mem_len=6, extension_backend="extension",
                       untie_r=untie_r, attn_backend="cpu").to(dtype)
    data = tokens(21, 3, seed=5)
    real = mt.RelPartialLearnableDecoderLayer._decode_layer_cpu
    routes = []

    def spy(self, *args):
        out = real(self, *args)
        routes.append(out is not None)
        return out

    def run(fused):
        monkeypatch.setattr(mt.RelPartialLearnableDecoderLayer, "_decode_layer_cpu",
                            spy if fused else (lambda self, *args: None))
        cache = model.new_cache(3, ext_len=0, dtype=cache_dtype)
        outs = [model.log_probs(data[s:s + 4], cache=cache)[0] for s in (0, 4)]
        outs += [model.log_probs(data[t:t + 1], cache=cache)[0] for t in range(8, 21)]
        return outs, cache

    (want, cache_w), (got, cache_g) = run(False), run(True)
    assert routes.count(True) == 13 * N_LAYER and routes.count(False) == 2 * N_LAYER
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert (cache_g.start, cache_g.mlen) == (cache_w.start, cache_w.mlen)
    rows = slice(cache_g.start, cache_g.start + cache_g.mlen)
    for a, b in zip(cache_g._buffers(), cache_w._buffers()):
        assert torch.equal(a[rows], b[rows])


def test_decode_layer_skipped_for_hooked_or_replaced_modules():
    """A forward hook on a sub-module, or a sub-module of another type, sends the decoding
    step op by op (the C++ layer would skip them), with the same tokens."""
    model = make_model("adaptive2", tgt_len=4, mem_len=6, extension_backend="extension",
                       attn_backend="cpu")
    prompt = tokens(6, 2, seed=3).t().contiguous()
    want = model.generate(prompt, 5)
    seen = []
    handle = model.layers[1].pos_ff.CoreNet[0].register_forward_hook(
        lambda mod, inp, out: seen.append(inp[0].shape[0]))
    try:
        assert torch.equal(model.generate(prompt, 5), want)
    finally:
        handle.remove()
    assert seen.count(1) == 4  # the four decoding steps ran this linear op by op

    class Linear(torch.nn.Linear):
        pass

    old = model.layers[0].dec_attn.o_net
    new = Linear(old.in_features, old.out_features, bias=False)
    new.load_state_dict(old.state_dict())
    model.layers[0].dec_attn.o_net = new
    seen.clear()
    new.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[0]))
    assert torch.equal(model.generate(prompt, 5), want)
    assert seen.count(1) == 4


def test_decode_layer_rejects_bad_input():
    """The C++ decode_layer's own checks (direct callers) name the argument."""
    from txl_kernels import _build
    ext = _build.load_extension()
    assert ext is not None, _build.extension_status()["reason"]
    B, dm, H, D, di, lk = 2, 12, 2, 4, 20, 5
    rnd = torch.randn
    x, qkv, o = rnd(B, dm), rnd(3 * H * D, dm), rnd(dm, H * D)
    ln_w, ln_b, f1, b1, f2, b2 = rnd(dm), rnd(dm), rnd(di, dm), rnd(di), rnd(dm, di), rnd(dm)
    kv, r, u = rnd(lk, B, H * D), rnd(lk, H, D), rnd(H, D)

    def call(**kw):
        a = dict(x=x, qkv_w=qkv, o_w=o, ln1_w=ln_w, ln1_b=ln_b, eps1=1e-5, ff1_w=f1, ff1_b=b1,
                 ff2_w=f2, ff2_b=b2, ln2_w=ln_w, ln2_b=ln_b, eps2=1e-5, pre_lnorm=False,
                 keys=kv.clone(), values=kv.clone(), r=r, u=u, vb=u, softmax_scale=0.5, lo=0)
        a.update(kw)
        return torch.ops.txl_kernels.decode_layer(**a)

    assert call().shape == (B, dm)  # fine
    with pytest.raises(RuntimeError, match=r"qkv_w must be \[24, 12\]"):
        call(qkv_w=qkv[1:])
    with pytest.raises(RuntimeError, match="ff2_b must be"):
        call(ff2_b=b2[:3])
    with pytest.raises(RuntimeError, match="o_w must be a CPU Float"):
        call(o_w=o.double())
    with pytest.raises(RuntimeError, match="x must be a float32 or float64"):
        call(x=x.half())
    with pytest.raises(RuntimeError, match="values must be"):
        call(values=kv[:, :1].clone())
    with pytest.raises(RuntimeError, match="keys must be .*contiguous last dimension"):
        call(keys=kv.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(RuntimeError, match="r must be"):
        call(r=r[1:])


@pytest.mark.parametrize("cfg", ["adaptive2", "proj_prelnorm", "plain"])
def test_greedy_skips_tail_clusters_exactly(cfg):
    """crit.greedy (what generate uses) is log_prob(...).argmax(-1) whether the argmax is in
    the shortlist, in a tail cluster (cluster logits raised so the tails win) or a tie; and the
    kept head weight follows in-place changes of the weights."""
    model = make_model(cfg)
    randomize(model)
    crit = model.crit
    h = torch.randn(64, D_MODEL, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(crit.greedy(h), crit.log_prob(h).argmax(-1))
        if crit.n_clusters == 0:
            return
        for shift, tails_win in ((-30.0, False), (60.0, True)):
            crit.cluster_bias.add_(shift)  # in place: the kept head weight must follow
            got, want = crit.greedy(h), crit.log_prob(h).argmax(-1)
            assert torch.equal(got, want)
            assert bool((want >= crit.cutoffs[0]).any()) == tails_win
        # A tie between the best shortlist token and a tail token: the lower id wins.
        crit.cluster_bias.zero_()
        crit.cluster_weight.zero_()
        lp = crit.log_prob(h[:1])
        assert torch.equal(crit.greedy(h[:1]), lp.argmax(-1))


def test_training_gradients_equal_original():
    """The mems path trains: the gradients of every parameter equal the original's on a
    segment with memory."""
    args = dict(CONFIGS["adaptive2"])
    torch.manual_seed(0)
    ref = orig.MemTransformerLM(N_TOKEN, N_LAYER, N_HEAD, D_MODEL, D_HEAD, D_INNER, 0.0, 0.0,
                                tgt_len=5, ext_len=0, mem_len=7, **args)
    randomize(ref)
    ours = make_model("adaptive2", 5, 7).train()
    ours.load_state_dict(ref.state_dict(), strict=True)
    data = tokens(11, 2, seed=12)
    mems_ref = ref(data[:5], data[1:6])[1:]
    mems_ours = ours(data[:5], data[1:6])[1:]
    ref(data[5:10], data[6:11], *mems_ref)[0].mean().backward()
    ours(data[5:10], data[6:11], *mems_ours)[0].mean().backward()
    grads_ref = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads_ref[name].grad, rtol=1e-4, atol=1e-5,
                                   msg=name)
