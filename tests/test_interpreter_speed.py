"""The suite's Triton-interpreter hook (tests/_interpreter_speed.py, installed by conftest):
installed on this Triton, a launch's helper calls skip the language patching pass, and the
results are the interpreter's without the hook."""
import inspect
import os

import pytest
import torch
import triton
import triton.language as tl

import _interpreter_speed as speed

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
