"""AOTInductor: a swapped NeMo-shaped encoder compiled by
``torch._inductor.aoti_compile_and_package`` on the CPU, with dynamic batch and time, runs the
fused C++ kernel (``txl_kernels::rel_attn_fwd``) from inside the package; a process that
loads the package needs the op defined first: ``import txl_kernels`` (which loads the CPU
kernel on the op's first call) or the op library alone (``torch.ops.load_library`` of the path
``txl_kernels.load_library()`` returns); without either, loading fails at once, naming the op
(no silent fallback).

One package for the module (a compile takes about 30 s), run at several lengths.
"""
import sys
import zipfile

import pytest
import torch
from torch.export import Dim

from helpers import run_python
from test_export import FUSED_OPS, nemo_encoder_inputs, swapped_nemo_encoder

UNSEEN = [(3, 7), (1, 20), (2, 33), (4, 5)]  # (batch, time) pairs not used at export


@pytest.fixture(scope="module")
def package(extension, tmp_path_factory):
    """(eager encoder, exported program, path of its AOTInductor package)."""
    enc = swapped_nemo_encoder("cpu")
    B, T = Dim("B", min=1, max=64), Dim("T", min=2, max=4096)
    ep = torch.export.export(enc, nemo_encoder_inputs(2, 12),
                             dynamic_shapes=({0: B, 1: T}, {0: B}))
    path = str(tmp_path_factory.mktemp("aoti") / "nemo_encoder.pt2")
    assert torch._inductor.aoti_compile_and_package(ep, package_path=path) == path
    return enc, ep, path


@pytest.mark.slow  # an AOTInductor compile (about 30 s)
def test_aoti_package_runs_the_fused_cpu_op(package):
    """The exported graph and the compiled package call the C++ kernel's op (no decomposition
    into the reference math), and the loaded package equals eager at lengths and batch sizes
    not used at export (Inductor fuses the layers around the op: fp32 rounding apart)."""
    enc, ep, path = package
    op = FUSED_OPS["cpu"]
    calls = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum(op in c for c in calls) == 2, calls  # one per layer
    with zipfile.ZipFile(path) as z:  # the package's calls of ops outside aten
        extern = b"".join(z.read(n) for n in z.namelist() if n.endswith("wrapper.json"))
    assert b'"target": "txl_kernels::rel_attn_fwd"' in extern
    runner = torch._inductor.aoti_load_package(path)
    for u in UNSEEN:
        x = nemo_encoder_inputs(*u)
        torch.testing.assert_close(runner(*x), enc(*x), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"at (B, T) = {u}: {m}")


@pytest.mark.slow  # the package's compile (shared) and three fresh interpreters
def test_aoti_package_in_a_fresh_process(package, tmp_path):
    """Without the op, loading the package fails at once with PyTorch's error naming it;
    with ``import txl_kernels`` (the op defined, its CPU kernel loaded on first call) or with
    only the op library loaded (no txl_kernels: the library defines the op itself) the
    package loads and gives the outputs of this process's package."""
    enc, _, path = package
    x = nemo_encoder_inputs(3, 7)
    want = torch._inductor.aoti_load_package(path)(*x)
    io = str(tmp_path / "io.pt")
    torch.save({"x": x, "want": want}, io)
    load = """
        import sys, torch
        {before}
        io = torch.load(sys.argv[2])
        runner = torch._inductor.aoti_load_package(sys.argv[1])
        torch.testing.assert_close(runner(*io["x"]), io["want"], rtol=0, atol=0)
        print("ran", "txl_kernels" in sys.modules)
    """
    res = run_python(load.format(before=""), path, io)
    assert res.returncode != 0, res.stdout
    assert "Could not find schema for txl_kernels::rel_attn_fwd" in res.stderr, \
        res.stderr[-2000:]
    res = run_python(load.format(before="import txl_kernels"), path, io)
    assert res.returncode == 0 and "ran True" in res.stdout, res.stderr[-2000:]
    from txl_kernels import load_library

    res = run_python(load.format(before=f"torch.ops.load_library({load_library()!r})"), path, io)
    assert res.returncode == 0 and "ran False" in res.stdout, res.stderr[-2000:]
