"""Ahead-of-time compile of the fused Triton kernels for Hopper (sm_90), no GPU needed.

The interpreter tests never run Triton's GPU compiler (layouts, tl.gather lowering, wgmma,
register allocation, ptxas); these tests run ``python -m tools.aot_check --quick`` (a developer tool of the source tree)
(with TRITON_INTERPRET unset, in a subprocess) and check that it compiles every kernel of the
kernel modules (forward, backward, decode; 16-bit and 8-bit memory), and that the checker reports a broken kernel as FAIL.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILES = {
    "txl_kernels.ops.rel_attn_fwd": ROOT / "txl_kernels" / "ops" / "rel_attn_fwd.py",
    "txl_kernels.ops.rel_attn_bwd": ROOT / "txl_kernels" / "ops" / "rel_attn_bwd.py",
    "txl_kernels.ops.rel_attn_decode": ROOT / "txl_kernels" / "ops" / "rel_attn_decode.py",
}


def _no_sm90_toolchain_reason():
    """Why sm_90 compiles cannot run here (None when they can): Triton without its NVIDIA
    backend, or without the ptxas it bundles."""
    try:
        from triton.backends import backends
    except Exception as exc:  # pragma: no cover - triton is a dependency
        return f"cannot import triton's backends: {exc}"
    if "nvidia" not in backends:
        return "this Triton build has no NVIDIA backend"
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path
    except Exception as exc:
        return f"Triton's NVIDIA backend has no usable ptxas: {exc}"
    if not ptxas or not os.access(ptxas, os.X_OK):
        return f"ptxas not found or not executable: {ptxas!r}"
    return None


_REASON = _no_sm90_toolchain_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"sm_90 AOT compile: {_REASON}")


def _compile_env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _is_triton_jit(dec) -> bool:
    node = dec.func if isinstance(dec, ast.Call) else dec
    return (isinstance(node, ast.Attribute) and node.attr == "jit"
            and isinstance(node.value, ast.Name) and node.value.id == "triton")


def _kernel_names(path: Path):
    """@triton.jit functions of a source file named ``*_kernel`` that return nothing (the
    launched kernels; helpers are inlined into them), read from the source independently of
    the checker."""
    tree = ast.parse(path.read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") \
                and any(map(_is_triton_jit, node.decorator_list)):
            if not any(isinstance(n, ast.Return) and n.value is not None
                       for n in ast.walk(node)):
                names.append(node.name)
    return names


def test_kernel_sources_define_kernels():
    # guards the name scan below: both modules have kernels to look for
    assert len(_kernel_names(KERNEL_FILES["txl_kernels.ops.rel_attn_fwd"])) >= 2
    assert len(_kernel_names(KERNEL_FILES["txl_kernels.ops.rel_attn_bwd"])) >= 4
    assert len(_kernel_names(KERNEL_FILES["txl_kernels.ops.rel_attn_decode"])) >= 2


# kernels launched for some dtypes only: the forward's OP_TILES (its operand workspaces) is
# fp16 / bf16 only (rel_attn_fwd._operand_tiles)
_KERNEL_DTYPES = {"_rel_attn_fwd_operands_kernel": ("fp16", "bf16")}


@pytest.mark.slow  # compiles kernels for sm_90 in a new process
def test_quick_aot_check_compiles_every_kernel(tmp_path):
    report_path = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.aot_check", "--quick", "--json",
         str(report_path)],
        cwd=ROOT, env=_compile_env(), capture_output=True, text=True, timeout=1200)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"aot_check --quick failed (exit {proc.returncode}):\n{tail}"
    report = json.loads(report_path.read_text())
    assert report["ok"] is True and not report["errors"], tail
    results = report["results"]
    for module, path in KERNEL_FILES.items():
        expected = _kernel_names(path)
        assert sorted(report["kernels"][module]) == sorted(expected), (
            f"{module}: checker found kernels {report['kernels'][module]}, source has "
            f"{expected}")
        for name in expected:
            rows = [r for r in results if r["module"] == module and r["kernel"] == name]
            ok_rows = [r for r in rows if r["status"] == "OK"]
            assert ok_rows, f"{module}.{name} was not compiled OK for sm_90:\n{tail}"
            assert not [r for r in rows if r["status"] == "FAIL"], tail
            # each kernel at least once per dtype it runs in
            cases = " ".join(c for r in ok_rows for c in r["cases"])
            for dtype in _KERNEL_DTYPES.get(name, ("fp16", "bf16", "fp32")):
                assert dtype in cases, f"{name}: no {dtype} case compiled OK ({cases})"
            # the ptxas report was read (registers are what the tuning report is about)
            assert all(isinstance(r["regs"], int) and r["regs"] > 0 for r in ok_rows), rows
    # the attention kernels' tl.dot products run on tensor cores (wgmma, or mma.sync for
    # tiles too small for a warpgroup) in 16-bit dtypes
    for r in results:
        if r["status"] == "OK" and r.get("has_dot") and all(
                c.startswith(("fp16", "bf16")) for c in r["cases"]):
            assert r["wgmma"] + r["mma_sync"] > 0, \
                f"{r['kernel']} {r['config']} {r['cases']}: no tensor-core instruction"


_BAD_MODULE = textwrap.dedent('''
    import triton
    import triton.language as tl


    @triton.jit
    def double_kernel(X, Y, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < N) * 2, mask=offs < N)


    @triton.jit
    def bad_dot_kernel(X, Y, BLOCK: tl.constexpr):
        a = tl.arange(0, BLOCK)
        x = tl.load(X + a[:, None] * BLOCK + a[None, :])
        y = tl.dot(x, tl.load(X + a))  # 2-D @ 1-D: rejected by the compiler
        tl.store(Y + a[:, None] * BLOCK + a[None, :], y)


    @triton.jit
    def transpose_kernel(X, Y, BLOCK: tl.constexpr):
        # fine under the interpreter at any size; on sm_90 the transpose goes through shared
        # memory: BLOCK 256 fp32 needs 256 KiB, more than a block can have
        a = tl.arange(0, BLOCK)
        x = tl.load(X + a[:, None] * BLOCK + a[None, :])
        tl.store(Y + a[:, None] * BLOCK + a[None, :], tl.trans(x))
''')

_BAD_DRIVER = textwrap.dedent('''
    import json, sys
    from tools.aot_check import compile_kernel, format_result
    import bad_kernels as m
    sig2 = {"X": "*fp32", "Y": "*fp32", "BLOCK": "constexpr"}
    cases = [
        ("double", m.double_kernel, {"X": "*fp32", "Y": "*fp32", "N": "i32",
                                     "BLOCK": "constexpr"}, {"BLOCK": 128}, 4),
        ("bad_dot", m.bad_dot_kernel, {"X": "*fp16", "Y": "*fp32", "BLOCK": "constexpr"},
         {"BLOCK": 32}, 4),
        ("transpose64", m.transpose_kernel, sig2, {"BLOCK": 64}, 4),
        ("transpose256", m.transpose_kernel, sig2, {"BLOCK": 256}, 8),
    ]
    out = {}
    for name, fn, sig, consts, warps in cases:
        res = compile_kernel(fn, sig, consts, num_warps=warps, num_stages=2)
        res["line"] = format_result(dict(res, config=name, cases=[]))
        out[name] = res
    print("RESULTS " + json.dumps(out, default=str))
''')


@pytest.mark.slow  # compiles kernels for sm_90 in a new process
def test_checker_reports_broken_kernels_as_fail(tmp_path):
    (tmp_path / "bad_kernels.py").write_text(_BAD_MODULE)
    env = _compile_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, "-c", _BAD_DRIVER], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    res = json.loads(line[len("RESULTS "):])

    # controls: the same function compiles good kernels
    for name in ("double", "transpose64"):
        assert res[name]["status"] == "OK", res[name]
        assert res[name]["regs"] and res[name]["line"].startswith("OK")
    # a compile error
    assert res["bad_dot"]["status"] == "FAIL"
    assert "rank" in res["bad_dot"]["error"] or "dot" in res["bad_dot"]["error"]
    assert res["bad_dot"]["line"].startswith("FAIL")
    # a kernel that compiles but could not launch on sm_90 (shared memory)
    assert res["transpose256"]["status"] == "FAIL"
    assert res["transpose256"]["shared"] > 232448
    assert "shared memory" in res["transpose256"]["error"]


def test_summary_fails_on_uncovered_kernel_and_unfittable_launch():
    from tools import aot_check as A  # stdlib-only at import: fine in this process

    ok_row = {"module": "m", "kernel": "k1", "status": "OK", "regs": 100, "shared": 1024,
              "spill_stores": 0, "config": "c1", "cases": ["bf16 D64 flags-on"], "key": "a"}
    oor_row = dict(ok_row, status="OOR", key="b", config="c2", shared=300000)
    lines, ok = A._summary([ok_row, oor_row], {"m": ["k1"]}, [], {"g": ["a", "b"]})
    assert ok, lines  # one config of the launch fits: the autotuner skips the other
    lines, ok = A._summary([ok_row, oor_row], {"m": ["k1"]}, [], {"g": ["a", "b"]},
                           strict=True)
    assert not ok
    lines, ok = A._summary([oor_row], {"m": ["k1"]}, [], {"g": ["b"]})
    assert not ok and any("none of its" in ln for ln in lines)
    lines, ok = A._summary([ok_row], {"m": ["k1", "k2"]}, [], {})
    assert not ok and any("k2: not launched" in ln for ln in lines)
    lines, ok = A._summary([ok_row], {"m": ["k1"]}, ["m: launcher failed"], {})
    assert not ok


# The drivers compile the dk/dv kernel for sm_90 as rel_attn_bwd launches it (bf16, D 64,
# causal), in a new process without TRITON_INTERPRET, and print "RESULTS <json>".
_DKDV_PRELUDE = textwrap.dedent('''
    import json, re, torch, triton
    from triton.compiler import ASTSource, make_backend
    from tools import aot_check as A
    from txl_kernels.ops import rel_attn_bwd as rb

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    def compile_dkdv(det):
        B, L, H, D = 1, 1024, 2, 64
        log = []
        with A._recording(rb, log):
            rb.rel_attn_bwd(t(B, L, H, D), t(B, L, H, D), t(B, L, H, D), t(B, L, H, D),
                            t(L, H, D), t(H, D), t(H, D), t(B, L, H, D),
                            t(B, H, L, dtype=torch.float32), D ** -0.5, -1, 0,
                            deterministic=det)
        (launch,) = [x for x in log if "dkdv" in getattr(x.obj, "__name__", "")]
        job = A.jobs_from_launch(make_backend(A._target(90)), rb.__name__, launch)[0]
        k = triton.compile(ASTSource(rb._rel_attn_bwd_dkdv_kernel, job.signature,
                                     job.constexprs, job.attrs), target=A._target(90),
                           options=dict(num_warps=job.num_warps, num_stages=job.num_stages))
        return k, job
''')


def _run_driver(body: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _DKDV_PRELUDE + textwrap.dedent(body)],
                          cwd=ROOT, env=dict(_compile_env(), TXL_KERNELS_AUTOTUNE="0"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads([ln for ln in proc.stdout.splitlines()
                       if ln.startswith("RESULTS ")][-1][len("RESULTS "):])


_ORDERED_DRIVER = '''
    out = {}
    for det in (False, True):
        k, job = compile_dkdv(det)
        ops = [m.group(0) for m in re.finditer(
            r"ld\\.acquire\\.gpu\\.global\\.b32|atom\\.relaxed\\.gpu\\.global\\.add\\.f32"
            r"|bar\\.sync 0;|atom\\.global\\.gpu\\.release\\.exch\\.b32", k.asm["ptx"])]
        out[str(det)] = dict(shared=k.metadata.shared, ops=ops,
                             ordered=job.constexprs.get(
                                 (list(job.signature).index("ORDERED"),)))
    print("RESULTS " + json.dumps(out))
'''


@pytest.mark.slow  # compiles the dk/dv kernel for sm_90 twice in a new process
def test_ordered_backward_waits_adds_then_publishes_and_stays_pipelined():
    """deterministic=True (ORDERED, bf16 sm_90): in the compiled PTX each wait (acquire
    loads) comes before the dq / dr atomics it orders, and a CTA barrier and one release
    exchange after them; and the loop keeps the unordered kernel's multi-buffered tile loads
    (the same shared memory: a loop or a barrier op in the kernel's IR would stop Triton's
    pipelining)."""
    res = _run_driver(_ORDERED_DRIVER)
    free, ordered = res["False"], res["True"]
    assert free["ordered"] is False and ordered["ordered"] is True
    assert ordered["shared"] == free["shared"], (ordered["shared"], free["shared"])
    assert not any("acquire" in op or "release" in op for op in free["ops"])
    # in the loop and after it: wait, adds, barrier, publish
    ops = [{"ld.acquire.gpu.global.b32": "wait", "bar.sync 0;": "bar",
            "atom.global.gpu.release.exch.b32": "pass"}.get(op, "add") for op in ordered["ops"]]
    seq = [op for i, op in enumerate(ops) if op != "bar" or (i + 1 < len(ops)
                                                             and ops[i + 1] == "pass")]
    seq = [op for i, op in enumerate(seq) if op != "add" or i == 0 or seq[i - 1] != "add"]
    waits = [i for i, op in enumerate(seq) if op == "wait"]
    assert len(waits) == 2, seq
    for w in waits:
        assert seq[w:w + 4] == ["wait", "add", "bar", "pass"], seq


_ATOMICS_DRIVER = '''
    k, job = compile_dkdv(False)
    defs, values = {}, []
    for ln in k.asm["ptx"].splitlines():
        m = re.match(r"(?:@%?\\w+\\s+)?([a-z][\\w.:]*)\\s+(.*?);", ln.strip())
        if not m:
            continue
        op, args = m.groups()
        if op.startswith("atom") and ".add" in op and op.endswith("f32"):
            values += re.findall(r"%\\w+", args[args.index("]"):])
        elif args.startswith("{"):
            defs.update(dict.fromkeys(re.findall(r"%\\w+", args[:args.index("}")]), op))
        elif not op.startswith(("st.", "red")):
            defs.update(dict.fromkeys(re.findall(r"%\\w+", args.split(",")[0]), op))
    print("RESULTS " + json.dumps(dict(values=len(values),
                                       defs=sorted({defs.get(v, "?") for v in values}))))
'''


@pytest.mark.slow  # compiles the dk/dv kernel for sm_90 in a new process
def test_atomic_adds_read_the_accumulators_in_registers():
    """deterministic=False (ATOMIC, bf16 D 64, sm_90): each fp32 atomic add of dq and dr
    takes its value straight from the products' registers (the wgmma accumulator, or its
    product with the scale), not from a shared-memory round trip into another layout, which
    tl.atomic_add makes (16 + 16 KB of shared-memory traffic and a barrier per tile); one add
    per element of the loop's two [64, 64] tiles and of the last dr flush, 32 per thread
    each."""
    res = _run_driver(_ATOMICS_DRIVER)
    assert res["values"] == 3 * 32, res
    assert res["defs"] and not any(d.startswith(("ld.shared", "ld.local", "?"))
                                   for d in res["defs"]), res
