"""torch.library registrations (opcheck), torch.compile(fullgraph=True) and autocast through the
fused op. On CPU tensors the op's CPU key (the C++ kernel) runs what opcheck calls and what a
compiled graph calls, rel_attention(backend="triton") eagerly runs the Triton kernels under the
interpreter; compile uses the aot_eager backend there (tracing, fake tensors and autograd
without graph breaks) and inductor on CUDA."""
import pytest
import torch

from txl_kernels import FusedRelAttention, rel_attention

from helpers import FUSED_DEVICE, HAS_CUDA, make_inputs, requires_cuda


def _op_args(window=(-1, 0), masks=False, layout="bshd"):
    B, Lq, Lk, H, D = 1, 5, 9, 2, 16
    q, k, v, r, u, vb = make_inputs(B, Lq, Lk, H, D, device=FUSED_DEVICE, layout=layout,
                                    requires_grad=True)
    kpm = mask = None
    if masks:
        kpm = torch.zeros(B, Lk, dtype=torch.bool, device=FUSED_DEVICE)
        kpm[0, 1] = True
        mask = (torch.rand(Lq, Lk, device=FUSED_DEVICE) < 0.2).expand(B, H, Lq, Lk)
    return (q, k, v, r, u, vb, D ** -0.5, window[0], window[1], kpm, mask)


@pytest.mark.parametrize("masks", [False, True])
def test_opcheck_forward(masks):
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_fwd.default, _op_args(masks=masks))


def test_opcheck_forward_seq_first_window():
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_fwd.default,
                          _op_args(window=(3, 0), layout="sbhd"))


def test_opcheck_backward():
    args = _op_args(masks=True)
    with torch.no_grad():
        out, lse = torch.ops.txl_kernels.rel_attn_fwd(*args)
    do = torch.randn_like(out)
    q, k, v, r, u, vb, scale, wl, wr, kpm, mask = args
    bargs = (do, q.detach(), k.detach(), v.detach(), r.detach(), u.detach(), vb.detach(), out,
             lse, scale, wl, wr, kpm, mask)
    torch.library.opcheck(torch.ops.txl_kernels.rel_attn_bwd.default, bargs)


class _TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = FusedRelAttention(2, 32, 16, 0.0, untie_r=True, mask_mode="causal",
                                      backend="triton")

    def forward(self, w, r, mems):
        return self.attn(w, r, mems=mems).square().mean()


def _model_inputs(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 2, 32, generator=g).to(device, dtype)
    mems = torch.randn(4, 2, 32, generator=g).to(device, dtype)
    r = torch.randn(10, 1, 32, generator=g).to(device, dtype)
    return w, r, mems


def test_compile_fullgraph_module():
    device = FUSED_DEVICE
    model = _TinyModel().to(device)
    w, r, mems = _model_inputs(device)
    eager_loss = model(w, r, mems)
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    backend = "inductor" if HAS_CUDA else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    loss = compiled(w, r, mems)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


def test_compile_fullgraph_functional():
    args = make_inputs(2, 7, 11, 2, 16, device=FUSED_DEVICE)

    def f(q, k, v, r, u, vb):
        return rel_attention(q, k, v, r, u, vb, window_size=(5, 0), backend="triton") * 2

    backend = "inductor" if HAS_CUDA else "aot_eager"
    got = torch.compile(f, fullgraph=True, backend=backend)(*args)
    torch.testing.assert_close(got, f(*args), rtol=1e-5, atol=1e-6)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_cuda(dtype):
    q, k, v, r, u, vb = make_inputs(2, 16, 24, 2, 32, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=dtype):
        out = rel_attention(q, k, v, r, u, vb, backend="triton")
    assert out.dtype == dtype
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32
    want = rel_attention(*(t.detach().to(dtype) for t in (q, k, v, r, u, vb)),
                         backend="reference")
    torch.testing.assert_close(out.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_autocast_cpu_casts_inputs():
    q, k, v, r, u, vb = make_inputs(1, 5, 7, 1, 16, device=FUSED_DEVICE)
    with torch.autocast(FUSED_DEVICE, dtype=torch.bfloat16):
        out = rel_attention(q, k, v, r, u, vb, backend="triton")
    assert out.dtype == torch.bfloat16


def test_forward_op_does_not_take_deterministic(monkeypatch):
    """Only the backward uses ``deterministic``: the forward op's schema does not carry it,
    and the caller's choice still reaches the backward op (kept on the autograd context)."""
    import txl_kernels.ops.rel_attn_bwd as launcher

    assert "deterministic" not in str(torch.ops.txl_kernels.rel_attn_fwd.default._schema)
    assert "deterministic" in str(torch.ops.txl_kernels.rel_attn_bwd.default._schema)
    seen = []
    real = launcher.rel_attn_bwd
    monkeypatch.setattr(launcher, "rel_attn_bwd",
                        lambda *a, **kw: seen.append(kw["deterministic"]) or real(*a, **kw))
    grads = []
    for det in (True, False):
        ts = make_inputs(1, 5, 9, 2, 16, device=FUSED_DEVICE, requires_grad=True, seed=4)
        rel_attention(*ts, backend="triton", deterministic=det).sum().backward()
        grads.append([t.grad for t in ts])
    assert seen == [True, False]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_double_backward_raises_clearly():
    """Differentiating the fused op's gradients (the second backward after create_graph=True)
    fails naming double backward, rather than treating the gradients as constants; the
    first backward with create_graph=True gives the gradients (torch.func's vjp and grad
    run it that way)."""
    ts = make_inputs(1, 5, 9, 2, 16, device=FUSED_DEVICE, requires_grad=True, seed=5)
    out = rel_attention(*ts, backend="triton")
    g, = torch.autograd.grad(out.square().sum(), ts[0], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward.*backend='reference'"):
        g.square().sum().backward()
    args = _op_args()  # the op called directly: its own autograd registration
    raw = torch.ops.txl_kernels.rel_attn_fwd(*args)[0]
    g, = torch.autograd.grad(raw.square().sum(), args[0], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(g.sum(), args[1])
    # a plain backward still works, and the reference path supports double backward
    rel_attention(*ts, backend="triton").sum().backward()
    ref = [t.detach().requires_grad_(True) for t in ts]
    g, = torch.autograd.grad(rel_attention(*ref, backend="reference").square().sum(), ref[0],
                             create_graph=True)
    g.sum().backward()
    assert ref[1].grad is not None


@pytest.mark.parametrize("R", [3, 9, 13, 20])
def test_rel_shift_compiles_fullgraph(R):
    """The reference path's rel_shift traces with fullgraph (no storage_offset() or other
    untraceable call) and equals the original pad/reshape shift on the pairs that one covers."""
    from txl_kernels.reference import rel_shift, rel_shift_pad_reshape

    bdt = torch.randn(2, 3, 5, R)
    got = torch.compile(rel_shift, fullgraph=True, backend="aot_eager")(bdt, 9)
    torch.testing.assert_close(got, rel_shift(bdt, 9), rtol=0, atol=0)
    if R == 9:  # R == Lk: the original's layout; equal on the causal pairs (j <= i + mlen)
        allowed = torch.ones(5, 9, dtype=torch.bool).tril(4)
        torch.testing.assert_close(got[..., allowed], rel_shift_pad_reshape(bdt)[..., allowed])


def test_compile_fullgraph_module_with_dropout():
    """FusedRelAttention(dropatt=0.1).train() runs the fused kernels with dropout (backend
    "auto"): it compiles with fullgraph=True, forward and backward, and matches eager with the
    same RNG seed (the kernels' Philox seed is drawn by torch.randint, traced like any op)."""
    torch.manual_seed(0)
    model = FusedRelAttention(2, 32, 16, 0.0, dropatt=0.1, untie_r=True).train()
    w, r, mems = _model_inputs("cpu")
    mask = torch.triu(torch.ones(6, 10, dtype=torch.uint8), 5)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (model, compiled):
        model.zero_grad()
        torch.manual_seed(1)
        loss = fn(w, r, attn_mask=mask, mems=mems).square().mean()
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_same_dtype_on_both_backends(dtype):
    """Under autocast both backends return the autocast dtype (as SDPA does), with fp32
    gradients for fp32 leaves, and agree."""
    outs = []
    for backend in ("reference", "triton"):
        ts = make_inputs(1, 5, 9, 2, 16, device=FUSED_DEVICE, requires_grad=True, seed=7)
        with torch.autocast(FUSED_DEVICE, dtype=dtype):
            out = rel_attention(*ts, backend=backend)
        assert out.dtype == dtype, backend
        out.float().sum().backward()
        assert all(t.grad.dtype == torch.float32 for t in ts)
        outs.append(out.float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------ the C++ extension's ops
# csrc/ registers them with torch.library (schemas, CPU / CUDA kernels); their fake
# implementations are in txl_kernels/_cpp_ops.py.

def _decode_case(B=2, H=2, D=8, lc=5, m=0, qdtype=torch.int8, seed=0):
    """rel_attn_decode's arguments: q [B, 1, H, D], k / v [B, Lc, H, D] (strided views of the
    cache's seq-first [Lc, B, H * D] rows), r [M + Lc, H, D], u / vb [H, D], window_left 2 (of
    the keys the window keeps), an optional 8-bit memory of M rows [B, M, ...]."""
    from txl_kernels import quantize_kv

    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    kv = rnd(lc, B, 2 * H * D)
    k, v = kv[..., :H * D].view(lc, B, H, D), kv[..., H * D:].view(lc, B, H, D)
    args = [rnd(B, 1, H, D), k.transpose(0, 1), v.transpose(0, 1), rnd(m + lc, H, D),
            rnd(H, D), rnd(H, D), D ** -0.5, 2]
    if m:
        args += list(quantize_kv(rnd(B, m, H, D), rnd(B, m, H, D), qdtype, torch.float16))
    return tuple(args)


def _decode_layer_case(pre_lnorm=False, m=0, seed=0):
    from txl_kernels import quantize_kv

    B, dm, H, D, di, lc = 2, 12, 2, 4, 20, 5
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    args = [rnd(B, dm), rnd(3 * H * D, dm), rnd(dm, H * D), rnd(dm), rnd(dm), 1e-5, rnd(di, dm),
            rnd(di), rnd(dm, di), rnd(dm), rnd(dm), rnd(dm), 1e-5, pre_lnorm,
            rnd(lc, B, H * D), rnd(lc, B, H * D), rnd(m + lc, H, D), rnd(H, D), rnd(H, D),
            0.5, 0]
    if m:
        mem = quantize_kv(rnd(B, m, H, D), rnd(B, m, H, D), torch.float8_e4m3fn)
        args += [t.transpose(0, 1) for t in mem]
    return tuple(args)


def _cpp_op_cases():
    g = torch.Generator().manual_seed(0)
    hids = [torch.randn(5, 3, 7, generator=g), torch.randn(5, 3, 6, generator=g)[..., ::2],
            torch.randn(3, 5, 9, generator=g).transpose(0, 1)]  # any strides
    mems = [torch.randn(4, 3, 7, generator=g), torch.empty(0), torch.randn(1, 3, 9, generator=g)]
    bufs = [torch.randn(9, 2, 6, generator=g), torch.randint(-9, 9, (9, 2, 3), generator=g,
                                                             dtype=torch.int8)]
    srcs = [torch.randn(3, 2, 16, generator=g), torch.randn(2, 3, 16, generator=g).transpose(0, 1)]
    return {
        "update_mems": ("update_mems", (hids, mems, 6, 1)),
        "update_mems_no_memory": ("update_mems", (hids, [], 4, 0)),
        "kv_cache_compact": ("kv_cache_compact", (bufs, 5, 3)),
        "kv_cache_quantize_append_int8": ("kv_cache_quantize_append", (
            srcs, [torch.zeros(6, 2, 16, dtype=torch.int8) for _ in srcs],
            [torch.zeros(6, 2, 4) for _ in srcs], 2, 4)),
        "kv_cache_quantize_append_fp8": ("kv_cache_quantize_append", (
            srcs[:1], [torch.zeros(4, 2, 16, dtype=torch.float8_e4m3fn)],
            [torch.zeros(4, 2, 2, dtype=torch.float16)], 1, 2)),
        "rel_attn_decode": ("rel_attn_decode", _decode_case()),
        "rel_attn_decode_8bit_memory": ("rel_attn_decode", _decode_case(m=4)),
        "rel_attn_decode_fp64": ("rel_attn_decode",
                                  tuple(a.double() if isinstance(a, torch.Tensor) else a
                                        for a in _decode_case(D=5))),
        "decode_layer": ("decode_layer", _decode_layer_case()),
        "decode_layer_pre_lnorm_8bit_memory": ("decode_layer",
                                               _decode_layer_case(pre_lnorm=True, m=3)),
    }


@pytest.mark.parametrize("case", list(_cpp_op_cases()))
def test_opcheck_cpp_ops(extension, case):
    """Every C++ op through torch.library.opcheck: its schema (mutated buffers declared), the
    fake implementation against the real output (shapes, dtypes, strides) under static and
    dynamic shapes, and functionalization (aot_dispatch)."""
    name, args = _cpp_op_cases()[case]
    utils = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn
           for a in args for t in (a if isinstance(a, (list, tuple)) else [a])):
        # torch's SchemaCheckMode compares inputs with ops that have no float8 kernel on CPUs;
        # the int8 cases check these ops' schemas
        utils = tuple(u for u in utils if u != "test_schema")
    torch.library.opcheck(getattr(torch.ops.txl_kernels, name).default, args, test_utils=utils)


def test_cpp_ops_are_registered_with_their_schemas(extension):
    """The five ops are in the txl_kernels namespace, with a CPU kernel and a Meta (fake)
    kernel each; the buffers the cache ops and the decode layer write are marked mutable."""
    for name in ("update_mems", "kv_cache_compact", "kv_cache_quantize_append",
                 "rel_attn_decode", "decode_layer"):
        op = getattr(torch.ops.txl_kernels, name).default
        for key in ("CPU", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), (name, key)
    schema = lambda n: str(getattr(torch.ops.txl_kernels, n).default._schema)  # noqa: E731
    assert "Tensor(a!)[] bufs" in schema("kv_cache_compact")
    assert "Tensor(a!)[] data_bufs" in schema("kv_cache_quantize_append")
    assert "Tensor(a!) keys" in schema("decode_layer")
    assert "!" not in schema("update_mems") and "!" not in schema("rel_attn_decode")


@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_compile_fullgraph_lm_cpu_decode_step(extension, cache_dtype):
    """The LM's decoding step on a CPU (one token, every layer through the C++ decode_layer op,
    the cache's K/V rows written by it) under torch.compile(fullgraph=True): no graph break,
    the op in the graph, and the same hidden states and cache contents as eager, step after
    step (the window moving through the cache)."""
    import copy

    from torch._dynamo.backends.registry import lookup_backend

    from txl_kernels.models import MemTransformerLM

    torch.manual_seed(0)
    model = MemTransformerLM(40, 2, 2, 16, 8, 32, 0.0, 0.0, tgt_len=4, mem_len=6,
                             attn_backend="cpu").eval()
    prompt = torch.randint(0, 40, (4, 2))
    cache = model.new_cache(2, ext_len=0, dtype=cache_dtype)
    model._forward_cached(prompt, cache)

    def decode_step(model, x, tables, cache):
        for i, layer in enumerate(model.layers):
            x = layer.forward_cached(x, tables[i], model.r_w_bias, model.r_r_bias, cache, i,
                                     (-1, 0))
        return x

    targets = []

    def backend(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(decode_step, fullgraph=True, backend=backend)
    eager_cache = copy.deepcopy(cache)
    tok = torch.randint(0, 40, (1, 2))
    with torch.no_grad():
        for _ in range(3):  # the cache's bookkeeping (room, window) stays outside, eagerly
            outs = []
            for fn, c in ((decode_step, eager_cache), (compiled, cache)):
                c._make_room(1)
                tables = model._projected_pos(c.mlen + 1, c)
                outs.append(fn(model, model.word_emb(tok), tables, c))
                if c.quantized:
                    c._append(1)
                c._advance(1)
            torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
            for a, b in zip(eager_cache._buffers(), cache._buffers()):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            tok = model.crit.greedy(outs[0][-1])[None]
    assert any("txl_kernels.decode_layer" in str(t) for t in targets), targets


# ------------------------------------------------------- symbolic scales, windows, torch.func

def _backend_device(request, backend):
    """The device a backend runs on here; "cpu" builds the C++ extension first."""
    if backend == "cpu":
        request.getfixturevalue("extension")
        return "cpu"
    return "cpu" if backend == "reference" else FUSED_DEVICE


def _attend(backend):
    """A fresh function of (inputs, window, scale); dynamo's cache is reset, since its
    graphs are kept per code object, shared by every backend's function."""
    torch._dynamo.reset()

    def f(q, k, v, r, u, vb, w, s):
        return rel_attention(q, k, v, r, u, vb, causal=False, window_size=(w, 1),
                             softmax_scale=s, backend=backend)
    return f


def _same_with_grads(fn, want_fn, ts, *args):
    ts = [t.detach().requires_grad_(True) for t in ts]
    got, want = fn(*ts, *args), want_fn(*ts, *args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g_got = torch.autograd.grad(got.square().sum(), ts)
    g_want = torch.autograd.grad(want.square().sum(), ts)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", [  # "auto" takes one of the others' paths here
    "reference", "cpu", "triton", pytest.param("auto", marks=pytest.mark.slow)])
def test_compile_dynamic_shapes_default_scale_window_argument(request, backend):
    """dynamic=True, fullgraph=True: the default scale D ** -0.5 of a symbolic D, a window
    passed as an argument (a SymInt) and then scales passed as arguments (SymFloats) compile
    and give eager's outputs and gradients. New lengths reuse the graph; new windows and
    scales do too on the reference path (the fused ops take a concrete float, and the C++
    op concrete ints: PyTorch specialises them there, one graph per value, as it does for
    scaled_dot_product_attention's scale)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    device = _backend_device(request, backend)
    f = _attend(backend)
    cnt = CompileCounterWithBackend("aot_eager")
    cf = torch.compile(f, fullgraph=True, dynamic=True, backend=cnt)
    counts = []
    for lq, lk, w, s in [(4, 6, 2, None), (5, 8, 2, None), (4, 6, 3, 0.3), (5, 7, 1, -0.5)]:
        ts = make_inputs(1, lq, lk, 2, 16, R=lk + lq - 1, device=device, seed=lq + lk)
        _same_with_grads(cf, f, ts, w, s)
        counts.append(cnt.frame_count)
    assert counts[1] == counts[0]  # other lengths: no recompile
    if backend == "reference":
        assert counts[3] == counts[2]  # another window and scale: no recompile


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_compile_static_then_another_scale(request, backend):
    """A static compile whose second call passes another Python float scale (dynamo then
    makes the float symbolic) compiles and matches eager."""
    device = _backend_device(request, backend)
    f = _attend(backend)
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    ts = make_inputs(1, 4, 6, 2, 16, R=9, device=device, seed=3)
    for s in (0.5, 0.25, 0.125):
        _same_with_grads(cf, f, ts, 2, s)


def test_compile_symbolic_scale_still_checked():
    """A symbolic scale is still checked: a compiled call with inf (a graph check, run with
    the call) or NaN (dynamo specialises NaN, so the eager check runs while tracing) raises
    naming softmax_scale."""
    f = _attend("reference")
    cf = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    ts = make_inputs(1, 4, 6, 2, 16, R=9, seed=4)
    _same_with_grads(cf, f, ts, 2, 0.5)
    for bad in (float("inf"), -float("inf"), float("nan")):
        with pytest.raises(Exception, match="softmax_scale must be a finite float"):
            cf(*ts, 2, bad)
        with pytest.raises(ValueError, match="softmax_scale must be a finite float"):
            f(*ts, 2, bad)


def _dropin(name):
    from txl_kernels.modules import (ESPnetRelPositionMultiHeadedAttention,
                                     NeMoRelPositionMultiHeadAttention)

    F = 32
    if name == "espnet":
        mod = ESPnetRelPositionMultiHeadedAttention(2, F, 0.0)
        return mod, lambda x, p: (x, x, x, p)
    if name == "nemo":
        mod = NeMoRelPositionMultiHeadAttention(2, F, 0.0, None, None)
        with torch.no_grad():
            mod.pos_bias_u.normal_()
            mod.pos_bias_v.normal_()
        return mod, lambda x, p: (x, x, x, None, p)
    if name == "speechbrain":
        from txl_kernels.modules import SpeechBrainRelPosMHAXL

        return SpeechBrainRelPosMHAXL(F, 2), lambda x, p: (x, x, x, p)
    if name == "icefall":
        from txl_kernels.modules import IcefallRelPositionMultiheadAttention

        mod = IcefallRelPositionMultiheadAttention(F, 2)
        return mod, lambda x, p: (x.transpose(0, 1),) * 3 + (p,)  # seq-first
    if name == "transformer_xl":
        return (FusedRelAttention(2, F, 16, 0.0, untie_r=True),
                lambda x, p: (x.transpose(0, 1), p[0, :x.shape[1], None]))
    pytest.importorskip("transformers")
    from transformers.models.parakeet.configuration_parakeet import ParakeetEncoderConfig

    from txl_kernels.modules import ParakeetEncoderAttention

    cfg = ParakeetEncoderConfig(hidden_size=F, num_attention_heads=2, intermediate_size=32,
                                num_hidden_layers=1, attention_dropout=0.0)
    mod = ParakeetEncoderAttention(cfg, 0)
    return mod, lambda x, p: (x, p)


@pytest.mark.parametrize("name", ["espnet", "nemo", "parakeet", "speechbrain", "icefall",
                                  "transformer_xl"])
def test_compile_dynamic_dropins(name):
    """The drop-ins (backend "auto": the fused kernel) under torch.compile(dynamic=True,
    fullgraph=True): their scale (a module float, symbolic there) and every length compile;
    two lengths give eager's outputs and gradients with one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    mod, call_args = _dropin(name)
    mod = mod.to(FUSED_DEVICE).eval()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mod, fullgraph=True, dynamic=True, backend=cnt)
    counts = []
    for T in (5, 7):
        _compiled_matches_eager(mod, compiled, call_args, (T,))
        counts.append(cnt.frame_count)
    assert counts[1] == counts[0]  # the second length reuses the graph


def _compiled_matches_eager(mod, compiled, call_args, lengths=(5, 7)):
    """``compiled`` gives ``mod``'s outputs and parameter gradients at each length (batch 2,
    32 features, a ``2T - 1`` row position table)."""
    for T in lengths:
        x = torch.randn(2, T, 32, device=FUSED_DEVICE)
        p = torch.randn(1, 2 * T - 1, 32, device=FUSED_DEVICE)
        results = []
        for fn in (mod, compiled):
            mod.zero_grad()
            out = fn(*call_args(x, p))
            out = out[0] if isinstance(out, tuple) else out
            out.square().sum().backward()
            results.append([out.detach()] + [q.grad.clone() for q in mod.parameters()])
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["nemo", "parakeet"])
def test_compile_dynamic_window_projects_only_the_rows_it_reads(name):
    """A windowed drop-in (NeMo's att_context_size [3, 2], the transformers drop-in's
    window_size (3, 2)) under torch.compile(dynamic=True, fullgraph=True): one graph for two
    lengths, eager's outputs and gradients, and the position projection's input is the
    window's 3 + 2 + 1 rows (symbolic bounds), not the table's 2T - 1."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mod, call_args = _dropin(name)
    if name == "nemo":
        mod.att_context_size = [3, 2]
    else:
        mod.window_size = (3, 2)
    mod = mod.to(FUSED_DEVICE).eval()
    linear_rows, graphs = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is torch._C._nn.linear:
                rows = n.args[0].meta["example_value"].shape[1]
                linear_rows.append(rows.node.hint if isinstance(rows, torch.SymInt) else rows)
        return gm.forward

    compiled = torch.compile(mod, fullgraph=True, dynamic=True, backend=backend)
    _compiled_matches_eager(mod, compiled, call_args)
    assert len(graphs) == 1
    # traced at T = 5: q / k / v / out project 5 rows, the position table 6 rows (not 9)
    assert sorted(linear_rows) == [5, 5, 5, 5, 6], linear_rows


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_func_grad_vjp_vmap(request, backend):
    """torch.func.grad, vjp and vmap through every backend: the gradients of all six inputs
    equal the reference's, and vmap over an extra leading batch dim of q, k and v equals a
    loop over it."""
    device = _backend_device(request, backend)
    ts = make_inputs(2, 4, 6, 2, 16, device=device, seed=6)
    cot = torch.randn_like(ts[0])

    def attend(b):
        return lambda *a: rel_attention(*a, causal=True, backend=b)

    grads = {b: torch.func.grad(lambda *a: attend(b)(*a).square().sum(),
                                argnums=tuple(range(6)))(*ts) for b in (backend, "reference")}
    for a, b in zip(grads[backend], grads["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    vjps = {}
    for b in (backend, "reference"):
        out, fn = torch.func.vjp(attend(b), *ts)
        vjps[b] = (out,) + fn(cot)
    for a, b in zip(vjps[backend], vjps["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    g = torch.Generator().manual_seed(7)
    qkv = [torch.randn(3, *t.shape, generator=g).to(device) for t in ts[:3]]
    got = torch.func.vmap(lambda q, k, v: attend(backend)(q, k, v, *ts[3:]))(*qkv)
    loop = torch.stack([attend(backend)(q, k, v, *ts[3:]) for q, k, v in zip(*qkv)])
    ref = torch.stack([attend("reference")(q, k, v, *ts[3:]) for q, k, v in zip(*qkv)])
    # the fused ops have no batching rule: vmap loops over them, bit for bit; the reference's
    # einsums are batched, and the BLAS may round a batched product differently from one
    # product (MKL on an AMD EPYC: 4.8e-7 in fp32)
    exact = backend != "reference"
    torch.testing.assert_close(got, loop, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_func_second_derivative_raises(request, backend):
    """The fused backward has no derivative: torch.func.grad of torch.func.grad raises
    naming double backward (it does not differentiate the gradients as constants)."""
    device = _backend_device(request, backend)
    q, k, v, r, u, vb = make_inputs(1, 4, 6, 2, 16, device=device, seed=8)

    def loss(q):
        return rel_attention(q, k, v, r, u, vb, backend=backend).square().sum()

    with pytest.raises(RuntimeError, match="double backward.*backend='reference'"):
        torch.func.grad(lambda q: torch.func.grad(loss)(q).square().sum())(q)


_COMPILE_FIRST = """
import os, sys
import torch
import txl_kernels

assert "txl_kernels.ops" not in sys.modules
device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \\
    else "cpu"
g = torch.Generator().manual_seed(0)
q, k, v, r, u, vb = (torch.randn(*s, generator=g).to(device)
                     for s in ((1, 4, 2, 16), (1, 6, 2, 16), (1, 6, 2, 16), (9, 2, 16),
                               (2, 16), (2, 16)))

def f(q, k, v, r, u, vb, s):
    return txl_kernels.rel_attention(q, k, v, r, u, vb, causal=False, softmax_scale=s,
                                     backend="triton")

got = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")(q, k, v, r, u, vb,
                                                                          0.5)
torch.testing.assert_close(got, f(q, k, v, r, u, vb, 0.5), rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_compile_fused_call_before_the_kernels_are_imported():
    """A fresh process compiles a fused call before txl_kernels.ops is imported: the trace
    imports it, and dynamo restarts the trace (to specialise the scale for the op); the
    restarted trace takes the same path (fused_available is a constant to dynamo, not a
    traced walk over sys.modules, which the import changed)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FIRST], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
