"""The suite's Triton-interpreter hook (tests/_interpreter_speed.py, installed by conftest):
installed on this Triton, a launch's helper calls skip the language patching pass, and the
results are the interpreter's without the hook."""
import inspect
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import _interpreter_speed as speed
from helpers import ROOT

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="a hook of the Triton interpreter (TRITON_INTERPRET=1, "
                                       "set by conftest where there is no GPU)")


@triton.jit
def _step(x, k):
    return x * 2 + tl.cdiv(k, 2)  # tl.cdiv: a helper of Triton's own (tl.core as `core`)


@triton.jit
def _steps_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    for k in range(5):
        x = _step(x, k)
    tl.store(Y + offs, x)


def _run(monkeypatch):
    """(output, inspect.getmembers calls) of one launch."""
    calls = []
    real = inspect.getmembers
    monkeypatch.setattr(inspect, "getmembers", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = torch.arange(8, dtype=torch.float32)
    y = torch.empty_like(x)
    _steps_kernel[(1,)](x, y, N=8)
    monkeypatch.undo()
    return y, len(calls)


def test_helpers_skip_the_patching_pass_with_the_same_results(monkeypatch):
    from triton.runtime import interpreter as interp

    assert speed.install(), ("tests/_interpreter_speed.py does not recognise this Triton's "
                             "interpreter: the suite runs, slower; update the hook")
    want = torch.arange(8, dtype=torch.float32)
    for k in range(5):
        want = want * 2 + (k + 1) // 2
    got, hooked = _run(monkeypatch)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the same launch through the interpreter's own patching (the hook's original)
    monkeypatch.setattr(interp, "_patch_lang", interp._patch_lang.original)
    plain, unhooked = _run(monkeypatch)
    torch.testing.assert_close(plain, want, rtol=0, atol=0)
    assert hooked < unhooked, (hooked, unhooked)


@triton.jit
def _square_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(Y + offs, x * x)


def test_overflow_sanitizer_is_off_in_the_suite_unless_asked_and_catches_overflow():
    """conftest turns the interpreter's int32 overflow check off (on with
    TXL_TESTS_SANITIZE_OVERFLOW=1); on, an int32 product past 2^31 raises naming the overflow;
    off, it wraps as in a compiled kernel; the interpreter's default (the check without
    ``debug``) computes the check and raises nothing."""
    from triton.runtime import interpreter as interp

    options = interp.interpreter_builder.options
    on = os.environ.get(speed.SANITIZE_OVERFLOW_ENV) == "1"
    assert (options.sanitize_overflow, options.debug) == (on, on)
    x = torch.tensor([3, 2 ** 16], dtype=torch.int32)
    y = torch.empty_like(x)
    try:
        assert speed.sanitize_overflow(True)
        with pytest.raises(Exception, match="int32 overflow detected"):
            _square_kernel[(1,)](x, y, N=2)
        assert speed.sanitize_overflow(False)
        _square_kernel[(1,)](x, y, N=2)
        assert y.tolist() == [9, 0]  # 2^32 wraps to 0
        interp.interpreter_builder.options = type(options)()  # the interpreter's default
        _square_kernel[(1,)](x, y, N=2)
        assert interp.interpreter_builder.options.sanitize_overflow and y.tolist() == [9, 0]
    finally:
        interp.interpreter_builder.options = options


# The kernel tests run again under the sanitizer: every Triton kernel (forward, its operand-tile
# and split-K combine variants, the backward's four, dropout's mask, decode's split and merge,
# the int8 memory) over masks, windows, position offsets and huge window bounds.
SANITIZED = [
    "tests/test_fused_forward.py::test_rel_attention_triton",
    "tests/test_fused_forward.py::test_split_with_window_padding_and_empty_splits",
    "tests/test_fused_forward.py::test_operand_tiles_match_registers",
    "tests/test_fused_backward.py::test_atomic_modes_match",
    "tests/test_fused_backward.py::test_end_to_end_triton_backend",
    "tests/test_dropout.py::test_forward_and_grads_equal_reference_with_kernel_mask",
    "tests/test_cached_attention.py::test_every_route_matches_reference",
    "tests/test_quant_kernels.py",
    "tests/test_position_offset.py::test_window_table_matches_full_table",
    "tests/test_mask_band.py::test_band_path_equals_dense_mask",
    "tests/test_functional.py::test_huge_windows_are_clamped_to_the_shapes",
]


@pytest.mark.slow  # the kernel tests again, about 1.5x slower with the check: ~3 min on 2 cores
def test_kernel_tests_pass_under_the_overflow_sanitizer():
    """The kernels' int32 index arithmetic never overflows on the suite's kernel tests (the
    Philox counter's intended wrap-around opts out with sanitize_overflow=False)."""
    env = dict(os.environ, **{speed.SANITIZE_OVERFLOW_ENV: "1"})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *SANITIZED, "-m", "not slow", "-q", "-n", "auto",
         "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1800)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "no tests ran" not in tail, tail
