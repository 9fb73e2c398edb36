#!/usr/bin/env python
"""Static sm_90 model of the decode kernel (ops/rel_attn_decode.py) with 16-bit keys / values
against an 8-bit memory, no GPU needed. A developer script (not packaged):

    python tools/decode_static.py --sass-profile PATH [--B 8] [--H 16] [--D 64]
                                  [--lk 1600 3800] [--hbm-tbps 4.8] [--out DIR]

Run from the repository root. It

1. compiles ``_decode_split_kernel`` for GPUTarget("cuda", 90, 32) in both variants, each as
   the real launcher ``rel_attn_decode`` launches it (recorded on meta tensors through
   ``tools/aot_check.py``'s ``_recording`` / ``jobs_from_launch``; bf16, qlen 1): 16-bit
   (k / v ``[B, Lk, H, D]``) and 8-bit (an int8 ``QuantizedKV`` memory of ``Lk - 1`` tokens +
   one current token);
2. disassembles them and counts, per iteration of the key loop (BLOCK_N keys; for the 8-bit
   variant the memory's loop, where all but one key are read), the SASS instructions per warp
   and the pipe demands, with the machine model of a static sm_90 model (``sass_profile.py``,
   kept outside this repository: per-pipe issue costs of each SASS instruction, ``count_insns``,
   ``DEFAULT_SMS``, ``DEFAULT_CLOCK_GHZ``), imported from the file that ``--sass-profile`` or
   ``$SASS_PROFILE`` names;
3. prints, per key and for the whole decode step at ``B x H`` heads and each ``Lk``, the
   global bytes (unique bytes from HBM: k / v per (b, h), r rows once per head (the B
   programs of a head share them in L2), scales; and the bytes the load instructions request,
   from the SASS), the bandwidth-bound time at ``--hbm-tbps`` (H200: 4.8 TB/s) and the
   issue-bound time (loop iterations x cycles / iteration over 132 SMs at 1.83 GHz), and the
   model's time = the larger of the two, for both variants, and their ratio.

A model, not a measurement: no latency, occupancy, L2 or launch overheads (the merge kernel
is not counted; it is the same in both variants).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's txl_kernels and tools


def _sass_profile(path):
    if not path:
        raise SystemExit("decode_static: pass --sass-profile PATH (or set SASS_PROFILE): the "
                         "static sm_90 model sass_profile.py")
    if not os.path.exists(path):
        raise SystemExit(f"decode_static: sass_profile.py not found at {path} (pass "
                         f"--sass-profile PATH or set SASS_PROFILE)")
    spec = importlib.util.spec_from_file_location("sass_profile", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_decode(sp, quant: bool, B: int, H: int, D: int, Lk: int, splits: int):
    """(compiled kernel, ptxas log, launch kwargs) of _decode_split_kernel as rel_attn_decode
    launches it (bf16; quant: an int8 memory of Lk - 1 tokens and 1 current token)."""
    import torch
    from triton.compiler import make_backend

    from tools import aot_check as ac
    from txl_kernels.ops import rel_attn_decode as rd
    from txl_kernels.quant import QuantizedKV

    def t(*s, dtype=torch.bfloat16):
        return torch.empty(*s, dtype=dtype, device="meta")

    lc = 1 if quant else Lk
    # seq-first cache buffers, passed as [B, L, H, D] views (as the LM cache does)
    q, k, v = t(B, 1, H, D), t(lc, B, H, D).transpose(0, 1), t(lc, B, H, D).transpose(0, 1)
    r, u, vb = t(Lk, H, D), t(H, D), t(H, D)
    mem = None
    if quant:
        m = Lk - 1
        mem = QuantizedKV(t(m, B, H, D, dtype=torch.int8).transpose(0, 1),
                          t(m, B, H, dtype=torch.float32).transpose(0, 1),
                          t(m, B, H, D, dtype=torch.int8).transpose(0, 1),
                          t(m, B, H, dtype=torch.float32).transpose(0, 1))
    log = []
    with ac._recording(rd, log):
        rd.rel_attn_decode(q, k, v, r, u, vb, D ** -0.5, -1, num_splits=splits, memory=mem)
    main = [lg for lg in log if getattr(lg.obj, "__name__", "") == "_decode_split_kernel"]
    if not main:
        raise RuntimeError(f"rel_attn_decode did not launch _decode_split_kernel: {log}")
    backend = make_backend(sp._target())
    job = ac.jobs_from_launch(backend, "txl_kernels.ops.rel_attn_decode", main[0])[0]
    kern, plog, _ = sp._compile(rd._decode_split_kernel, job.signature, job.constexprs,
                                job.attrs, job.num_warps, job.num_stages, job.extra_options)
    return kern, plog, job, main[0].kwargs


def _ldg_bytes_per_lane(opcode: str) -> int:
    mods = opcode.split(".")[1:]
    for m, b in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if m in mods:
            return b
    return 4


def key_loop(sp, kern, workdir: str, stem: str, num_warps: int, first_of: int):
    """Per-iteration counts of the key loop: the first (in address order) innermost loop of
    more than 16 instructions without an EXIT (the memory's loop in the 8-bit variant, the
    only one otherwise); ``first_of`` checks how many such loops the kernel has."""
    sp.save_artifacts(kern, "", workdir, stem)
    sass = sp.disassemble(kern.asm["cubin"], workdir, stem)
    insns, labels = sp.parse_sass(sass)
    loops = [(a, b) for a, b in sp.find_loops(insns, labels)
             if b - a > 16 and not any(insns[i].op == "EXIT" for i in range(a, b + 1))]
    inner = sorted(c for c in loops
                   if not any(o != c and c[0] <= o[0] and o[1] <= c[1] for o in loops))
    if len(inner) != first_of:
        raise RuntimeError(f"{stem}: expected {first_of} key loop(s), found {len(inner)}: "
                           f"{[(insns[a].addr, insns[b].addr) for a, b in inner]}")
    a, b = inner[0]
    body = insns[a:b + 1]
    with open(os.path.join(workdir, f"{stem}.loop.sass"), "w") as f:
        f.write("\n".join(f"{ins.addr:05x}  {ins.text}" for ins in body))
    res = sp.count_insns(body, num_warps)
    # bytes the loads request per iteration (every lane of every warp, masks aside)
    res["ldg_bytes_cta"] = sum(_ldg_bytes_per_lane(ins.opcode) * 32 * num_warps
                               for ins in body if ins.op == "LDG")
    res["ldg"] = [ins.opcode for ins in body if ins.op == "LDG"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass-profile", default=os.environ.get("SASS_PROFILE"),
                    help="path of the static sm_90 model sass_profile.py (default: "
                         "$SASS_PROFILE)")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--lk", type=int, nargs="+", default=[1600, 3800])
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    ap.add_argument("--out", default=None, help="artifacts directory (default: a temp dir)")
    opts = ap.parse_args(argv)
    sp = _sass_profile(opts.sass_profile)
    B, H, D = opts.B, opts.H, opts.D
    workdir = opts.out or tempfile.mkdtemp(prefix="decode_static_")
    os.makedirs(workdir, exist_ok=True)
    sms, ghz = sp.DEFAULT_SMS, sp.DEFAULT_CLOCK_GHZ
    # the launcher's split rule on an H100 / H200 (132 SMs): about two waves
    splits = max(1, min(-(-2 * sms // (B * H)), 128))

    variants = {}
    for name, quant in (("16-bit", False), ("8-bit", True)):
        kern, plog, job, kw = compile_decode(sp, quant, B, H, D, max(opts.lk), splits)
        info = sp.ptxas_info(plog, "_decode_split_kernel")
        lp = key_loop(sp, kern, workdir, "decode_" + name.replace("-", ""), job.num_warps,
                      2 if quant else 1)
        variants[name] = dict(loop=lp, info=info, block_n=kw["BLOCK_N"], warps=job.num_warps)
        c = lp["counts"]
        print(f"{name}: _decode_split_kernel [BLOCK_N {kw['BLOCK_N']}, BLOCK_D {kw['BLOCK_D']}, "
              f"w{job.num_warps} s{job.num_stages}] ptxas {info['regs']} regs, spill "
              f"{info['spill_st']}/{info['spill_ld']} B; key loop: {lp['n_total']} instr / warp"
              f" / iteration (fp32 {c['fp32']}, imad {c['imad']}, alu {c['alu'] + c['other_alu']},"
              f" mufu {c['mufu']}, shfl {c['shfl']}, gmem {c['gmem']}), loads {lp['ldg']}; "
              f"bound {lp['bound']:.0f} cycles / iteration ({lp['bound_pipe']})")

    cache_b = {"16-bit": 2 * D * 2, "8-bit": 2 * (D + 4)}  # k + v (+ fp32 scales) per (b, h, key)
    r_b = D * 2  # one bf16 r row per (h, key), shared by the B programs of the head
    print(f"\nper key and (b, h): HBM bytes 16-bit {cache_b['16-bit']} + r {r_b} / B, 8-bit "
          f"{cache_b['8-bit']} + r {r_b} / B; requested by the loop's loads (SASS): "
          + ", ".join(f"{n} {v['loop']['ldg_bytes_cta'] / v['block_n']:.0f} B"
                      for n, v in variants.items()))
    print(f"model, qlen 1, B {B}, H {H}, D {D}, {splits} splits: time = max(HBM bytes at "
          f"{opts.hbm_tbps} TB/s, issue over {sms} SMs at {ghz} GHz)")
    print(f"{'Lk':>6} {'variant':>8} {'HBM MB':>8} {'bw us':>7} {'issue us':>9} {'model us':>9}"
          f" {'bound':>6}")
    for lk in opts.lk:
        t = {}
        for name, v in variants.items():
            nbytes = B * H * lk * cache_b[name] + H * lk * r_b
            bw = nbytes / (opts.hbm_tbps * 1e12) * 1e6
            iters = B * H * -(-lk // v["block_n"])  # key tiles (split edges aside)
            issue = iters * v["loop"]["bound"] / sms / (ghz * 1e9) * 1e6
            t[name] = max(bw, issue)
            print(f"{lk:>6} {name:>8} {nbytes / 1e6:>8.2f} {bw:>7.2f} {issue:>9.2f} "
                  f"{t[name]:>9.2f} {'bw' if bw >= issue else 'issue':>6}")
        print(f"{lk:>6} 8-bit / 16-bit model time ratio: {t['8-bit'] / t['16-bit']:.2f}")
    print(f"(artifacts: {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
