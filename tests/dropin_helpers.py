"""Helpers shared by the drop-in tests (tests/test_dropins_*.py)."""
import pytest


def spy_on(module_name):
    """A fixture that records every rel_attention call made through ``module_name``."""

    @pytest.fixture
    def spy(monkeypatch):
        import importlib
        mod = importlib.import_module(module_name)
        calls = []
        real = mod.rel_attention

        def wrapper(*args, **kwargs):
            calls.append((args, kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(mod, "rel_attention", wrapper)
        return calls

    return spy


def run_qkv_pos(x, pos, key_padding_mask=None, attn_mask=None, grad_pos=False):
    """``compare`` runner for ``forward(query, key, value, pos, key_padding_mask=...,
    attn_mask=...)`` self-attention modules (icefall, SpeechBrain); returns the first output."""

    def run(mod, dtype, device):
        xx = x.to(device=device, dtype=dtype).requires_grad_()
        p = pos.to(device=device, dtype=dtype).requires_grad_(grad_pos)
        kpm = None if key_padding_mask is None else key_padding_mask.to(device)
        am = None if attn_mask is None else attn_mask.to(device)
        out = mod(xx, xx, xx, p, key_padding_mask=kpm, attn_mask=am)[0]
        return (out,), ((xx, p) if grad_pos else (xx,))

    return run
