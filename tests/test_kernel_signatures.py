"""Kernel signatures stay readable: every ``@triton.jit`` entry kernel of txl_kernels/ops (a
function whose name ends in ``_kernel``) takes at most MAX_ENTRY_PARAMS parameters, constexprs
included, and every jit helper at most MAX_HELPER_PARAMS; strides, masks, dropout and the
8-bit memory travel as tuple arguments, set up once per program. Read from the source with
``ast`` (no Triton, no compile)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[1] / "txl_kernels" / "ops"
MAX_ENTRY_PARAMS = 40
MAX_HELPER_PARAMS = 30
# kernels the launchers run; the walk must find each of them, so the bounds cannot pass on an
# empty or mis-parsed walk
EXPECTED_ENTRIES = {
    "rel_attn_fwd.py": {"_rel_attn_fwd_kernel", "_rel_attn_fwd_combine_kernel"},
    "rel_attn_bwd.py": {"_rel_attn_bwd_preprocess_kernel", "_rel_attn_bwd_dkdv_kernel",
                        "_rel_attn_bwd_dq_kernel", "_rel_attn_bwd_dr_kernel"},
    "rel_attn_decode.py": {"_decode_split_kernel", "_decode_merge_kernel"},
}


def _is_jit(dec: ast.expr) -> bool:
    """``@triton.jit``, ``@jit``, ``@triton.jit(...)``."""
    if isinstance(dec, ast.Call):
        dec = dec.func
    return (isinstance(dec, ast.Attribute) and dec.attr == "jit") or \
        (isinstance(dec, ast.Name) and dec.id == "jit")


def jit_functions(path: Path):
    """(name, parameter count) of each ``@triton.jit`` function in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
            a = node.args
            n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
            n += (a.vararg is not None) + (a.kwarg is not None)
            out.append((node.name, n))
    return out


def _all():
    return {p.name: jit_functions(p) for p in sorted(OPS.glob("*.py"))}


def test_the_walk_finds_every_kernel():
    found = _all()
    for fname, names in EXPECTED_ENTRIES.items():
        got = {n for n, _ in found.get(fname, [])}
        assert names <= got, f"{fname}: jit functions found {sorted(got)}, expected {names}"
    counts = dict(jit_functions(OPS / "rel_attn_fwd.py"))
    assert counts["_rel_attn_fwd_kernel"] >= 15  # its constexprs alone


def test_jit_functions_counts_parameters(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("import triton\n@triton.jit\ndef a_kernel(x, y, Z: tl.constexpr = 1, *r, "
                    "k=0):\n    pass\n\n@triton.jit(do_not_specialize=[0])\ndef h(a):\n"
                    "    pass\n\ndef plain(a, b):\n    pass\n")
    assert jit_functions(path) == [("a_kernel", 5), ("h", 1)]


@pytest.mark.parametrize("fname", sorted(p.name for p in OPS.glob("*.py")))
def test_entry_kernels_and_helpers_stay_under_the_parameter_bound(fname):
    for name, n in jit_functions(OPS / fname):
        bound = MAX_ENTRY_PARAMS if name.endswith("_kernel") else MAX_HELPER_PARAMS
        assert n <= bound, (f"{fname}: @triton.jit {name} takes {n} parameters (at most "
                            f"{bound}: pass strides / masks / dropout / memory as tuples)")
