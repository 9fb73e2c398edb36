"""The first-use self-check (txl_kernels.selfcheck): a fused variant is checked once against the
reference on a tiny problem; a wrong kernel warns once, backend="auto" falls back to the
reference for that variant and backend="triton" raises. The wrong kernel is forced by
replacing the launchers the fused op calls (ops.rel_attn_fwd.rel_attn_fwd / ops.rel_attn_bwd.rel_attn_bwd).

The rest of the suite runs with the check off (conftest sets TXL_KERNELS_SELFCHECK=0); each
test here turns it on and starts from no verdicts."""
import warnings

import pytest
import torch

import txl_kernels.ops.rel_attn_bwd as bwd_mod
import txl_kernels.ops.rel_attn_fwd as fwd_mod
from txl_kernels import rel_attention, selfcheck
from txl_kernels.reference import rel_attention_reference

from helpers import FUSED_DEVICE, make_inputs


@pytest.fixture(autouse=True)
def check_on(monkeypatch):
    monkeypatch.setenv(selfcheck.ENV, "1")
    selfcheck.clear()
    yield
    selfcheck.clear()


@pytest.fixture
def count_checks(monkeypatch):
    """The variants the check ran for, in order."""
    seen = []
    real = selfcheck._check

    def counting(variant):
        seen.append(variant)
        return real(variant)

    monkeypatch.setattr(selfcheck, "_check", counting)
    return seen


def _wrong_forward(monkeypatch):
    real = fwd_mod.rel_attn_fwd

    def wrong(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out + 0.5, lse

    monkeypatch.setattr(fwd_mod, "rel_attn_fwd", wrong)


def _wrong_backward(monkeypatch):
    real = bwd_mod.rel_attn_bwd

    def wrong(*args, **kwargs):
        dq, dk, dv, dr, du, dvb = real(*args, **kwargs)
        return dq, dk * 2, dv, dr, du, dvb

    monkeypatch.setattr(bwd_mod, "rel_attn_bwd", wrong)


def _inputs(requires_grad=False):
    return make_inputs(1, 7, 11, 2, 16, device=FUSED_DEVICE, requires_grad=requires_grad)


def _reference(ts, **kw):
    q, k, v, r, u, vb = (t.detach() for t in ts)
    return rel_attention_reference(q, k, v, r, u, vb, 16 ** -0.5, -1, 0, **kw)


def test_check_runs_once_per_variant_and_passes(count_checks):
    ts = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a passing check warns nothing
        out1 = rel_attention(*ts, backend="triton")
        out2 = rel_attention(*ts, backend="auto")
        kpm = torch.zeros(1, 11, dtype=torch.bool, device=FUSED_DEVICE)
        rel_attention(*ts, key_padding_mask=kpm, backend="auto")
    assert len(count_checks) == 2, count_checks  # the key padding call is a second variant
    assert not count_checks[0].key_padding and count_checks[1].key_padding
    assert all(err is None for err in selfcheck.verdicts().values())
    torch.testing.assert_close(out1, out2)
    torch.testing.assert_close(out1, _reference(ts), atol=1e-5, rtol=1e-5)


def test_wrong_forward_warns_once_and_auto_returns_the_reference(monkeypatch, count_checks):
    _wrong_forward(monkeypatch)
    ts = _inputs()
    with pytest.warns(RuntimeWarning, match=r"self-check.*float32.*head dim 16.*output: max abs"):
        out = rel_attention(*ts, backend="auto")
    torch.testing.assert_close(out, _reference(ts), atol=1e-5, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the verdict is kept
        again = rel_attention(*ts, backend="auto")
    torch.testing.assert_close(again, out)
    assert len(count_checks) == 1
    (variant, error), = selfcheck.verdicts().items()
    assert "output" in error and not variant.grad


def test_wrong_forward_with_backend_triton_raises(monkeypatch):
    _wrong_forward(monkeypatch)
    with pytest.raises(RuntimeError, match=r"self-check.*backend='triton' raises"), \
            pytest.warns(RuntimeWarning):
        rel_attention(*_inputs(), backend="triton")
    with pytest.raises(RuntimeError, match="self-check"):  # and on every later call
        rel_attention(*_inputs(), backend="triton")


def test_wrong_backward_is_caught_when_gradients_are_recorded(monkeypatch, count_checks):
    _wrong_backward(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rel_attention(*_inputs(), backend="auto")  # forward-only variant: passes
    ts = _inputs(requires_grad=True)
    with pytest.warns(RuntimeWarning, match=r"forward \+ backward.*dk: max abs"):
        out = rel_attention(*ts, backend="auto")
    grads = torch.autograd.grad(out.sum(), ts)
    ref_ts = [t.detach().requires_grad_() for t in ts]
    ref = rel_attention_reference(*ref_ts, 16 ** -0.5, -1, 0)
    ref_grads = torch.autograd.grad(ref.sum(), ref_ts)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-5)
    assert [v.grad for v in count_checks] == [False, True]


def test_env_variable_turns_the_check_off(monkeypatch, count_checks):
    monkeypatch.setenv(selfcheck.ENV, "0")
    _wrong_forward(monkeypatch)
    ts = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = rel_attention(*ts, backend="auto")
    # unchecked, the (forced) wrong kernel result goes through
    torch.testing.assert_close(out, _reference(ts) + 0.5, atol=1e-5, rtol=1e-5)
    assert count_checks == []


def test_check_runs_at_trace_time_under_torch_compile(monkeypatch, count_checks):
    _wrong_forward(monkeypatch)
    ts = _inputs()

    def f(*xs):
        return rel_attention(*xs, backend="auto") * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.warns(RuntimeWarning, match="self-check"):
        out = compiled(*ts)
    torch.testing.assert_close(out, 2 * _reference(ts), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled(*ts), out)
    assert len(count_checks) == 1


def test_not_run_inside_cuda_graph_capture(monkeypatch, count_checks):
    capturing = [True]
    monkeypatch.setattr(selfcheck, "_capturing", lambda device: capturing[0])
    ts = _inputs()
    with pytest.warns(RuntimeWarning, match="CUDA graph capture"):
        rel_attention(*ts, backend="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        rel_attention(*ts, backend="auto")
    assert count_checks == []  # never inside a capture
    capturing[0] = False
    rel_attention(*ts, backend="auto")  # outside: checked now
    assert len(count_checks) == 1


def test_capture_detection_reads_the_current_stream():
    assert selfcheck._capturing("cpu") is False
    if torch.cuda.is_available():
        assert selfcheck._capturing("cuda:0") is False


def test_check_leaves_the_global_rng_untouched():
    ts = _inputs(requires_grad=True)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    out = rel_attention(*ts, backend="auto")  # first call: the check runs (with a backward)
    assert selfcheck.verdicts(), "the check did not run"
    assert torch.equal(torch.get_rng_state(), state)
    out.sum().backward()


def test_masks_dropout_and_memory_variants_pass():
    from txl_kernels import quantize_kv
    ts = _inputs()
    q = ts[0]
    kpm = torch.zeros(1, 11, dtype=torch.bool, device=FUSED_DEVICE)
    mask = torch.rand(7, 11, device=FUSED_DEVICE) < 0.2
    rel_attention(*ts, key_padding_mask=kpm, attn_mask=mask, window_size=(5, -1),
                  dropout_p=0.1, backend="triton")
    mem = make_inputs(1, 7, 4, 2, 16, device=FUSED_DEVICE, seed=1)
    rel_attention(q, ts[1], ts[2], torch.randn(15, 2, 16, device=FUSED_DEVICE), ts[4], ts[5],
                  memory=quantize_kv(mem[1], mem[2]), backend="triton")
    verdicts = selfcheck.verdicts()
    assert len(verdicts) == 2 and all(err is None for err in verdicts.values()), verdicts
    kinds = {(v.dropout, v.attn_mask, v.key_padding, v.window_left, v.memory) for v in verdicts}
    assert kinds == {(True, True, True, True, ""), (False, False, False, False, "int8")}


def test_row_shift_is_its_own_variant_and_checked_with_a_shifted_table(monkeypatch,
                                                                       count_checks):
    """A call with r_first_distance runs kernels specialised for a row shift: its own
    variant, whose check runs the fused path with a shifted table (a wrong backward with the
    shift only is caught; the default table's variant passes)."""
    real = bwd_mod.rel_attn_bwd

    def wrong_with_shift(*args, **kwargs):
        dq, dk, dv, dr, du, dvb = real(*args, **kwargs)
        if kwargs.get("r_first_distance") is not None:
            dr = dr * 2
        return dq, dk, dv, dr, du, dvb

    monkeypatch.setattr(bwd_mod, "rel_attn_bwd", wrong_with_shift)
    ts = _inputs(requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rel_attention(*ts, backend="auto")  # the default table: passes
    q, k, v, r, u, vb = ts
    r_win = torch.randn(6, 2, 16, device=FUSED_DEVICE, requires_grad=True)  # window (3, 2)
    with pytest.warns(RuntimeWarning, match=r"r_first_distance.*dr: max abs"):
        rel_attention(q, k, v, r_win, u, vb, causal=False, window_size=(3, 2),
                      r_first_distance=3, backend="auto")
    assert [v.row_shift for v in count_checks] == [False, True]
