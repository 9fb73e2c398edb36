"""The end-to-end examples, in shortened quick modes: the long-range dependency
test's verdict, the byte-level LM's bits per character falling, activation checkpointing's
gradients, and DDP / FSDP2 on 2 gloo ranks equal to one process with the whole batch."""
import importlib.util
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"examples_{name}",
                                                  os.path.join(ROOT, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


long_range = _load("long_range_test")
train_lm = _load("train_lm")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- long-range dependency test -------------------------------------------------------------
@pytest.mark.slow  # trains a model for 150 steps (~10 s on two cores)
def test_long_range_memory_recalls_beyond_the_segment(tmp_path, one_thread):
    out = tmp_path / "lr.json"
    png = tmp_path / "lr.png"
    # two segments per example: gaps 1..31, the in-segment and the memory band
    rc = long_range.main(["--quick", "--n-seg", "2", "--steps", "150", "--eval-batch", "32",
                          "--json", str(out), "--plot", str(png), "--attn-backend",
                          "reference"])
    res = json.loads(out.read_text())
    with_mem, without = res["band_means"]["mem_len=16"], res["band_means"]["mem_len=0"]
    assert rc == 0 and res["pass"], res["band_means"]
    assert with_mem[0] > 0.9 and without[0] > 0.9  # both recall inside the segment
    assert with_mem[1] > 0.9  # memory band: recalled through the memory ...
    assert without[1] < 0.35  # ... and near chance (1/8) without it
    assert png.stat().st_size > 0


def test_long_range_verdict_fails_for_untrained_models(tmp_path, one_thread):
    out = tmp_path / "lr.json"
    rc = long_range.main(["--quick", "--n-seg", "2", "--steps", "0", "--eval-batch", "16",
                          "--json", str(out)])
    assert rc == 1 and not json.loads(out.read_text())["pass"]


def test_long_range_batch_layout():
    g = torch.Generator().manual_seed(0)
    gaps = torch.tensor([1, 5, 20])
    data, keys = long_range.make_batch(3, gaps, 2, 16, 8, 8, g)
    assert data.shape == (32, 3)
    assert (data[-1] == 16).all()  # the query token at the last position
    for j, gap in enumerate(gaps.tolist()):
        is_key = data[:, j] < 8
        assert is_key.sum() == 1 and data[31 - gap, j] == keys[j]


# ---- byte-level LM ------------------------------------------------------------------------
def test_train_lm_quick_bpc_falls(tmp_path, one_thread):
    out = tmp_path / "run"
    rc = train_lm.main(["--quick", "--steps", "80", "--eval-every", "80", "--train-bytes",
                        "60000", "--eval-bytes", "3000", "--no-progress", "--out", str(out)])
    assert rc == 0
    m = json.loads((out / "metrics.json").read_text())
    (s0, v0), (s1, v1) = m["valid_bpc"]
    assert (s0, s1) == (0, 80)
    assert v0 > 7.0  # untrained: near uniform over 256 bytes (8 bits)
    assert v1 < v0 - 2.0, m["valid_bpc"]
    assert m["test_bpc"] < v0 - 2.0
    assert m["train_bpc"][-1][1] < m["train_bpc"][0][1]
    assert (out / "curve.png").stat().st_size > 0
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    args = train_lm.parse_args(["--quick"])
    args.attn_backend, args.extension_backend = "reference", "torch"
    model = train_lm.build_model(args, torch.device("cpu"))
    model.load_state_dict(ckpt["model"], strict=True)
    # the checkpoint reproduces the reported test bpc (cache path)
    test = train_lm.load_bytes(train_lm.split_files(train_lm.stdlib_files())["test"], 3000)
    bpc = train_lm.evaluate(model, train_lm.batchify(test, args.eval_bsz), args.tgt_len)
    assert bpc == pytest.approx(m["test_bpc"], rel=1e-5)


def test_stdlib_split_is_by_file():
    files = train_lm.stdlib_files()
    split = train_lm.split_files(files)
    assert len(files) > 100
    assert sum(len(v) for v in split.values()) == len(files)
    assert not set(split["train"]) & (set(split["valid"]) | set(split["test"]))
    assert not set(split["valid"]) & set(split["test"])
    assert not any(os.sep + "test" + os.sep in f for f in files)


def _tiny_args(**kw):
    args = train_lm.parse_args(["--quick", "--n-layer", "2", "--d-model", "16", "--n-head", "2",
                                "--d-head", "16", "--d-inner", "32", "--tgt-len", "5",
                                "--mem-len", "7", "--attn-backend", "reference",
                                "--extension-backend", "torch"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def _fused_args(**kw):
    """The smallest model on the fused kernels (the Triton interpreter on CPU here): 1 layer,
    2 heads of 16, segments of 4 with 4 memory rows."""
    args = _tiny_args(n_layer=1, d_inner=16, tgt_len=4, mem_len=4, attn_backend="triton")
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def _args(backend, **kw):
    return _fused_args(**kw) if backend == "triton" else _tiny_args(**kw)


def _count_fused_calls():
    """Wrap ``txl_kernels._op.rel_attn_func`` (``rel_attention`` looks it up at every call) to
    count the calls that reach the fused kernels; returns the counter (a one-item list)."""
    import txl_kernels._op as ops

    calls, plain = [0], ops.rel_attn_func

    def counted(*a, **kw):
        calls[0] += 1
        return plain(*a, **kw)

    ops.rel_attn_func = counted
    return calls


def _fused_cpu():
    from txl_kernels.functional import fused_available

    return fused_available(torch.device("cpu"))[0]


def _skip_without_fused(backend):
    if backend == "triton" and not _fused_cpu():
        pytest.skip("the fused path on CPU needs TRITON_INTERPRET=1 (tests/conftest.py)")


def _run(args, cols, steps, net_fn=lambda m: m, opt=True):
    """Per step: (global mean loss, full grads); a fresh model seeded by args.seed."""
    model = train_lm.build_model(args, torch.device("cpu"))
    net = net_fn(model)
    optim = torch.optim.SGD(net.parameters(), lr=0.5) if opt else None
    mems, out = [], []
    batches = train_lm.epochs(cols, args.tgt_len)
    for _ in range(steps):
        data, target, _ = next(batches)
        torch.manual_seed(1234)  # the same dropout masks in both runs
        loss, mems = train_lm.train_step(net, data, target, mems, optim)
        out.append((loss, train_lm.full_grads(net)))
    return out


def _assert_same(a, b, tol=1e-5):
    assert len(a) == len(b)
    for (la, ga), (lb, gb) in zip(a, b):
        torch.testing.assert_close(la, lb, rtol=tol, atol=tol)
        assert ga.keys() == gb.keys()
        for k in ga:
            torch.testing.assert_close(ga[k], gb[k], rtol=tol, atol=tol, msg=k)


def _differs(a, b, tol=1e-5):
    try:
        _assert_same(a, b, tol)
    except AssertionError:
        return True
    return False


# ---- activation checkpointing (MemTransformerLM(..., checkpoint=True)) ----------------------
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_checkpoint_same_losses_and_gradients(one_thread, monkeypatch, backend):
    """Two segments (memories carried, an SGD step between them) with dropout: the model's
    ``checkpoint=True`` gives the plain run's losses and every parameter's gradient, and each
    layer really runs twice (forward, then recomputed in the backward)."""
    _skip_without_fused(backend)
    import txl_kernels._op as ops

    monkeypatch.setattr(ops, "rel_attn_func", ops.rel_attn_func)  # restored after the test
    fused_calls = _count_fused_calls()
    steps = 2
    # attention dropout too: the fused kernels draw their seed from the default generator,
    # whose state checkpoint restores for the recomputation (the same keep-mask)
    kw = dict(dropout=0.1, dropatt=0.1)
    torch.manual_seed(0)
    cols = torch.randint(0, 256, (40, 2))
    layer_calls = []

    def count_layers(model):
        for layer in model.layers:
            layer.register_forward_pre_hook(lambda *_: layer_calls.append(1))
        return model

    plain = _run(_args(backend, **kw), cols, steps, count_layers)
    n_plain, n_fused_plain = len(layer_calls), fused_calls[0]
    layer_calls.clear()
    ckpt = _run(_args(backend, checkpoint=True, **kw), cols, steps, count_layers)
    _assert_same(plain, ckpt, tol=1e-6)
    n_layer = _args(backend).n_layer
    assert n_plain == steps * n_layer and len(layer_calls) == 2 * steps * n_layer
    if backend == "triton":  # the fused kernels ran, recomputation included
        assert n_fused_plain == steps * n_layer
        assert fused_calls[0] - n_fused_plain == 2 * steps * n_layer
        return
    # the dropout masks matter: no dropout, or a recomputation without the saved RNG state,
    # changes the gradients (so the equality above is not that of a model without dropout)
    assert _differs(plain, _run(_args(backend), cols, steps))
    plain_ckpt = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda *a, **k: plain_ckpt(*a, preserve_rng_state=False, **k))
    assert _differs(plain, _run(_args(backend, checkpoint=True, **kw), cols, steps))


def test_checkpoint_option_keeps_the_state_dict_and_the_eval_path():
    from txl_kernels.models import MemTransformerLM

    args = _tiny_args()
    plain = train_lm.build_model(args, torch.device("cpu"))
    args.checkpoint = True
    ckpt = train_lm.build_model(args, torch.device("cpu"))
    assert ckpt.checkpoint and not plain.checkpoint
    assert ckpt.state_dict().keys() == plain.state_dict().keys()
    ckpt.load_state_dict(plain.state_dict(), strict=True)
    # kimiyoung's positional constructor still works; checkpoint is a keyword, default False
    m = MemTransformerLM(256, 1, 2, 16, 8, 32, 0.0, 0.0, True, None, 1, (False,), False, 4, 0, 4)
    assert m.checkpoint is False and m.mem_len == 4
    with pytest.raises(TypeError, match="checkpoint must be a bool"):
        MemTransformerLM(256, 1, 2, 16, 8, 32, 0.0, 0.0, checkpoint="yes")
    # without gradients (evaluation) the layers run once: no checkpoint
    calls = []
    ckpt.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    data = torch.randint(0, 256, (5, 2))
    with torch.no_grad():
        ckpt.eval()(data, data)
    assert len(calls) == 1


def test_forward_loss_is_not_a_view():
    """FSDP2 warns about forward outputs that are views (an in-place op on one would skip its
    pre-backward hook): the loss is its own tensor, [tgt_len, bsz], the per-token NLL."""
    model = train_lm.build_model(_tiny_args(), torch.device("cpu"))
    data = torch.randint(0, 256, (5, 3))
    target = torch.randint(0, 256, (4, 3))
    loss = model(data, target)[0]
    assert not loss._is_view() and loss.shape == (4, 3)
    hidden = model._forward(data, model.init_mems())[0][-4:]
    nll = -torch.log_softmax(model.crit._logit(hidden, *model.crit._cluster(0)), -1)
    torch.testing.assert_close(loss, nll.gather(2, target[..., None])[..., 0])


# ---- DDP / FSDP2 on 2 gloo ranks ------------------------------------------------------------
# per rank: batch B (global 2B) and the wrappers (FSDP2 with checkpoint=True on the reference
# path: the fused path's checkpointing is tested in one process above)
STEPS = 2
B = {"reference": 2, "triton": 1}
MODES = {"reference": ("ddp", "fsdp", "fsdp+checkpoint"), "triton": ("ddp", "fsdp")}


def _global_loss(per_step, world):
    import torch.distributed as dist

    out = []
    for loss, grads in per_step:
        loss = loss.clone()
        dist.all_reduce(loss)
        out.append((loss / world, grads))
    return out


def _worker(rank, world, port, cols, result_path):
    import warnings

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        results = {}
        fused_calls = _count_fused_calls()
        for backend, b in B.items():
            if backend == "triton" and not _fused_cpu():
                continue
            shard = cols[:, rank * b:(rank + 1) * b]
            for mode in MODES[backend]:
                args = _args(backend, checkpoint=mode.endswith("+checkpoint"))
                before = fused_calls[0]
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    per_step = _run(args, shard, STEPS,
                                    lambda m: train_lm.wrap(m, mode.split("+")[0],
                                                            torch.device("cpu")))
                results[f"{backend}/{mode}"] = _global_loss(per_step, world)
                results[f"{backend}/{mode}/fused_calls"] = fused_calls[0] - before
                results[f"{backend}/{mode}/warnings"] = [str(w.message) for w in caught]
        if rank == 0:
            torch.save(results, result_path)
    finally:
        dist.destroy_process_group()
    train_lm.end_process(0)  # past here gloo's threads can abort the interpreter's exit


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    """One spawn of 2 gloo ranks runs every backend and mode (starting the ranks costs more
    than the tiny models): DDP, FSDP2 and FSDP2 with checkpoint=True, on the reference path and
    (under the Triton interpreter) the fused one."""
    torch.manual_seed(0)
    cols = torch.randint(0, 256, (40, 2 * max(B.values())))
    path = str(tmp_path_factory.mktemp("dist") / "dist.pt")
    mp.spawn(_worker, args=(2, _free_port(), cols, path), nprocs=2, join=True)
    return cols, torch.load(path, weights_only=False)


@pytest.mark.slow  # spawns two ranks
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ddp_and_fsdp_equal_one_process_with_the_whole_batch(one_thread, dist_results,
                                                            backend):
    _skip_without_fused(backend)
    cols, results = dist_results
    single = _run(_args(backend), cols[:, :2 * B[backend]], STEPS)
    n_layer = _args(backend).n_layer
    for mode in MODES[backend]:
        _assert_same(results[f"{backend}/{mode}"], single)
        recompute = 2 if mode.endswith("+checkpoint") else 1
        expect = STEPS * n_layer * recompute if backend == "triton" else 0
        assert results[f"{backend}/{mode}/fused_calls"] == expect, mode


@pytest.mark.slow  # spawns two ranks
def test_fsdp_emits_no_view_warning(dist_results):
    _, results = dist_results
    for mode in MODES["reference"]:
        caught = results[f"reference/{mode}/warnings"]
        assert not [w for w in caught if "view" in w], caught
