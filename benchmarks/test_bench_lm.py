"""Transformer-XL LM (txl_kernels.models.MemTransformerLM) against HF TransfoXL, same weights.

Two workloads, on the model size those settings come from: Transformer-XL base on
WikiText-103 (kimiyoung's ``run_wt103_base.sh``: 16 layers, 10 heads of 41, d_model 410,
d_inner 2100, vocabulary 267,735 with adaptive softmax cutoffs 20000 / 40000 / 200000,
div_val 1, same_length, clamp_len 400; evaluated with tgt_len 64 / mem_len 640), random
weights, fp32:
- eval: one segment of tgt_len 64 tokens against a full memory of mem_len 640, bsz 10 (eval.py's
  default; the state of a long evaluation): ours with the K/V cache (warmed up by the segments
  before), ours on the mems path, HF with mems (memories of random hidden states: the cost
  does not depend on their values);
- generate: 128 new tokens (greedy) after a 512-token prompt, mem_len 512, bsz 1: ours
  ``model.generate`` (prompt in segments of 64 on the cache, then one token at a time), HF's
  loop (the prompt in the same segments with mems, then the last token fed with mems), which
  must give the same tokens.
Token ids are drawn from a Zipf law over the vocabulary (rank r with probability ~ 1/r), as
in text, whose vocabulary the adaptive softmax's clusters are sorted by: about 80% of the
tokens fall in the 20000-token head. (Uniform ids would put 92% in the tail clusters and make
the softmax, the same work in both models, most of the time.)

Times: :func:`benchmarks.runner.measure` (``torch.utils.benchmark.Timer`` on CPU, one thread,
the median of its blocks; ``do_bench`` on CUDA). HF needs transformers 4.x (the ``hf4``
extra, e.g. ``PYTHONPATH=/tmp/hf4``); without it the HF cases skip with the reason.

    python -m benchmarks.test_bench_lm            # side-by-side times and ratios
    python -m benchmarks.test_bench_lm --small    # the same at the small size (seconds)
    python -m pytest benchmarks/test_bench_lm.py --benchmark-only   # small size on CPU

8-bit memory: ``new_cache(bsz, dtype=torch.int8 / torch.float8_e4m3fn)`` against
the full-precision cache (the model's dtype: bf16 on CUDA, fp32 on CPU, where the torch paths
run), at the Transformer-XL evaluation shapes tgt_len 64 / mem_len 640, 128 / 1,600 and
128 / 3,800 (bsz 10; on CPU the small model at a quarter of each length, bsz 2), for the
evaluation of a segment against a full memory and for one decoded token (qlen 1). The cache's
bytes go to the benchmark's ``extra_info``; :func:`footprint_table` gives them at the
Transformer-XL base size without allocating (meta tensors).

    python -m benchmarks.test_bench_lm --quant [--small]   # 8-bit vs full memory, side by side
"""
from __future__ import annotations

import contextlib
import gc
import time
import warnings
from typing import Callable, Dict, Optional, Tuple

import pytest
import torch

from benchmarks.runner import measure, synced
from txl_kernels.models import MemTransformerLM

# Transformer-XL base, WikiText-103 (kimiyoung/transformer-xl pytorch/run_wt103_base.sh).
WT103_BASE = dict(n_token=267735, n_layer=16, n_head=10, d_model=410, d_head=41, d_inner=2100,
                  cutoffs=[20000, 40000, 200000], div_val=1, same_length=True, clamp_len=400,
                  untie_r=True)
EVAL = dict(tgt_len=64, mem_len=640, bsz=10)  # eval.py's default batch size
GEN = dict(prompt=512, new=128, mem_len=512, tgt_len=64, bsz=1)
# The small size: the CPU pytest-benchmark subset, --small.
SMALL = dict(n_token=2000, n_layer=4, n_head=4, d_model=128, d_head=32, d_inner=512,
             cutoffs=[500, 1000], div_val=1, same_length=True, clamp_len=400, untie_r=True)
SMALL_EVAL = dict(tgt_len=16, mem_len=160, bsz=2)
SMALL_GEN = dict(prompt=64, new=32, mem_len=64, tgt_len=16, bsz=1)
# 8-bit memory: the Transformer-XL evaluation shapes, and a quarter of them on CPU (small model)
QUANT_SHAPES = [dict(tgt_len=64, mem_len=640, bsz=10), dict(tgt_len=128, mem_len=1600, bsz=10),
                dict(tgt_len=128, mem_len=3800, bsz=10)]
SMALL_QUANT_SHAPES = [dict(tgt_len=16, mem_len=160, bsz=2), dict(tgt_len=32, mem_len=400, bsz=2),
                      dict(tgt_len=32, mem_len=950, bsz=2)]
CACHE_DTYPES = {"full": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def hf_classes():
    """(TransfoXLConfig, TransfoXLLMHeadModel), or None when transformers 4.x is absent."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformers
            from transformers import TransfoXLConfig, TransfoXLLMHeadModel
    except Exception:
        return None
    if not transformers.__version__.startswith("4."):
        return None
    return TransfoXLConfig, TransfoXLLMHeadModel


HF_MISSING = ("HF TransfoXL needs transformers 4.x (the 'hf4' extra: pip install --target "
              "/tmp/hf4 transformers==4.34.1 and PYTHONPATH=/tmp/hf4)")


def build(config: dict, mem_len: int, tgt_len: int, with_hf: bool, device=None):
    """(ours, hf or None) with the same random weights, eval mode, fp32. On CPU ours uses
    attn_backend "cpu": the C++ kernels that "auto" takes there, also when the Triton
    interpreter is on (as in ``python -m txl_kernels``), which is a test tool, not a path to
    time."""
    device = torch.device(device) if device is not None else _device()
    torch.manual_seed(0)
    classes = hf_classes() if with_hf else None
    c = dict(config, attn_backend="cpu" if device.type == "cpu" else "auto")
    if classes is None:
        ours = MemTransformerLM(c.pop("n_token"), c.pop("n_layer"), c.pop("n_head"),
                                c.pop("d_model"), c.pop("d_head"), c.pop("d_inner"), 0.0, 0.0,
                                tgt_len=tgt_len, mem_len=mem_len, **c)
        return ours.to(device).eval(), None
    Config, LMHead = classes
    backend = c.pop("attn_backend")
    cfg = Config(vocab_size=c.pop("n_token"), d_embed=c["d_model"], mem_len=mem_len,
                 dropout=0.0, dropatt=0.0, **c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = LMHead(cfg).to(device).eval()
    return MemTransformerLM.from_hf(hf, tgt_len=tgt_len, attn_backend=backend), hf


def zipf_ids(n_token: int, shape, seed: int) -> torch.Tensor:
    """Token ids with P(id = r) ~ 1 / (r + 1): text-like frequencies (see the docstring)."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, n_token + 1, dtype=torch.float64)
    n = 1
    for s in shape:
        n *= s
    return torch.multinomial(weights, n, replacement=True, generator=g).view(*shape)


# ----------------------------------------------------------------------------- workloads

def _no_grad(fn: Callable[[], object]) -> Callable[[], None]:
    def step():
        with torch.no_grad():
            fn()
    return step


def eval_step(provider: str, ours, hf, spec: dict) -> Callable[[], None]:
    """A callable that evaluates the next segment of tgt_len tokens against a full memory."""
    tgt_len, mem_len, bsz = spec["tgt_len"], spec["mem_len"], spec["bsz"]
    device = next(ours.parameters()).device
    n_seg = -(-mem_len // tgt_len) + 1
    data = zipf_ids(ours.n_token, (n_seg * tgt_len + 1, bsz), seed=1).to(device)
    warm = [(data[s:s + tgt_len], data[s + 1:s + 1 + tgt_len])
            for s in range(0, (n_seg - 1) * tgt_len, tgt_len)]
    inp, tgt = data[-tgt_len - 1:-1], data[-tgt_len:]
    with torch.no_grad():
        if provider == "txl_kernels":
            cache = ours.new_cache(bsz)
            for x, y in warm:
                ours(x, y, cache=cache)
            return _no_grad(lambda: ours(inp, tgt, cache=cache))
        # The mems paths get memories of random hidden states (their cost does not depend on
        # the values; running the warm-up segments through HF takes minutes at this size).
        g = torch.Generator().manual_seed(3)
        mems = [torch.randn(mem_len, bsz, ours.d_model, generator=g).to(device)
                for _ in range(ours.n_layer + 1)]
        if provider == "txl_kernels_mems":
            return _no_grad(lambda: ours(inp, tgt, *mems))
        mems = mems[:-1]  # HF keeps n_layer memories (the last layer's output is not one)
        x_bf = inp.t().contiguous()
        # HF shifts the labels inside (position t is scored on token t + 1), so it scores
        # tgt_len - 1 tokens of the segment, ours tgt_len: one token less work for HF.
        return _no_grad(lambda: hf(x_bf, labels=x_bf, mems=mems))


def hf_greedy(hf, prompt: torch.Tensor, new: int, seg: int) -> torch.Tensor:
    """HF's per-token greedy loop: the prompt in segments with mems, then the last token."""
    mems = [torch.empty(0, prompt.shape[0], hf.config.d_model, device=prompt.device)
            for _ in range(hf.config.n_layer)]
    seq = [prompt]
    for s in range(0, prompt.shape[1], seg):
        out = hf(prompt[:, s:s + seg], mems=mems)
        mems = out.mems
    for _ in range(new):
        tok = out.prediction_scores[:, -1].argmax(-1, keepdim=True)
        seq.append(tok)
        out = hf(tok, mems=mems)
        mems = out.mems
    return torch.cat(seq, 1)


def generate_step(provider: str, ours, hf, spec: dict, keep: Optional[dict] = None
                  ) -> Callable[[], None]:
    """A callable that generates ``spec['new']`` tokens after a prompt; the tokens of its
    last call go to ``keep[provider]``."""
    device = next(ours.parameters()).device
    prompt = zipf_ids(ours.n_token, (spec["bsz"], spec["prompt"]), seed=2).to(device)
    keep = {} if keep is None else keep

    def step():
        with torch.no_grad():
            if provider == "txl_kernels":
                keep[provider] = ours.generate(prompt, spec["new"])
            else:
                keep[provider] = hf_greedy(hf, prompt, spec["new"], spec["tgt_len"])
    return step


def quant_step(kind: str, ours, spec: dict, cache_dtype) -> Tuple[Callable[[], None], int]:
    """(a callable, the cache's bytes): ``kind`` "eval" evaluates the next segment of tgt_len
    tokens, "decode" feeds one token, against a full memory held by a cache of
    ``cache_dtype`` (None: the model's dtype; int8 / float8_e4m3fn: 8-bit memory). The memory
    slides (stays full) from call to call, as in a long evaluation / generation."""
    tgt_len, mem_len, bsz = spec["tgt_len"], spec["mem_len"], spec["bsz"]
    device = next(ours.parameters()).device
    n_seg = -(-mem_len // tgt_len) + 1
    data = zipf_ids(ours.n_token, (n_seg * tgt_len + 2, bsz), seed=1).to(device)
    cache = ours.new_cache(bsz, max_qlen=tgt_len, ext_len=0, dtype=cache_dtype)
    with torch.no_grad():
        for s in range(0, (n_seg - 1) * tgt_len, tgt_len):
            ours(data[s:s + tgt_len], data[s + 1:s + 1 + tgt_len], cache=cache)
    if kind == "eval":
        inp, tgt = data[-tgt_len - 1:-1], data[-tgt_len:]
    else:
        inp, tgt = data[-2:-1], data[-1:]
    return _no_grad(lambda: ours(inp, tgt, cache=cache)), cache.nbytes


def footprint_table(config: dict = WT103_BASE, shapes=QUANT_SHAPES,
                    dtype: torch.dtype = torch.bfloat16) -> str:
    """Bytes of the K/V cache (all layers, capacity ``2 mem_len + tgt_len`` rows) at each
    shape: ``dtype`` against int8 / fp8 with fp32 and fp16 scales (meta tensors: nothing is
    allocated)."""
    from txl_kernels.models import TransfoXLCache

    width = config["n_head"] * config["d_head"]
    rows = [f"| shape (bsz {shapes[0]['bsz']}) | {dtype} (MB) | 8-bit, fp32 scales (MB) | ratio "
            f"| 8-bit, fp16 scales (MB) | ratio |", "|---|---|---|---|---|---|"]
    for sp in shapes:
        def nbytes(q=None, sdt=torch.float32):
            return TransfoXLCache(config["n_layer"], sp["bsz"], sp["mem_len"], 0, sp["tgt_len"],
                                  width, dtype, "meta", n_head=config["n_head"], quant_dtype=q,
                                  scale_dtype=sdt).nbytes
        full, q32, q16 = nbytes(), nbytes(torch.int8), nbytes(torch.int8, torch.float16)
        rows.append(f"| tgt_len {sp['tgt_len']} / mem_len {sp['mem_len']} | {full / 1e6:.1f} | "
                    f"{q32 / 1e6:.1f} | {q32 / full:.3f} | {q16 / 1e6:.1f} | {q16 / full:.3f} |")
    return "\n".join(rows)


@contextlib.contextmanager
def one_cpu_thread(device: torch.device):
    """On CPU, one intra-op thread (as Timer times; setup and warm-up calls too: on a shared
    machine OpenMP threads that spin-wait make small ops erratic), restored afterwards."""
    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def compare_quant(config: dict = WT103_BASE, shapes=QUANT_SHAPES, min_run_time_s: float = 1.0,
                  log: Callable[[str], None] = print, device=None) -> str:
    """Times of evaluation and of one decoded token with the full-precision and the 8-bit
    caches at each shape (bf16 model on CUDA, fp32 on CPU); returns a markdown table."""
    device = torch.device(device) if device is not None else _device()
    with one_cpu_thread(device):
        return _compare_quant(config, shapes, min_run_time_s, log, device)


def _compare_quant(config, shapes, min_run_time_s, log, device) -> str:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [f"| workload ({device.type}, {str(dtype)[6:]} model) | full cache (ms) | int8 (ms) "
            f"| ratio | fp8 (ms) | ratio | cache bytes 8-bit / full |",
            "|---|---|---|---|---|---|---|"]
    for sp in shapes:
        ours, _ = build(config, sp["mem_len"], sp["tgt_len"], False, device)
        ours = ours.to(dtype)
        for kind in ("eval", "decode"):
            t, nb = {}, {}
            for name, cdt in CACHE_DTYPES.items():
                step, nb[name] = quant_step(kind, ours, sp, cdt)
                times = sorted(measure(synced(step, device), device, min_run_time_s))
                t[name] = times[len(times) // 2]
                log(f"  {kind} tgt {sp['tgt_len']} / mem {sp['mem_len']} {name}: "
                    f"{t[name] * 1e3:.2f} ms")
            what = (f"eval tgt_len {sp['tgt_len']}" if kind == "eval" else "decode 1 token") + \
                f" / mem_len {sp['mem_len']}, bsz {sp['bsz']}"
            rows.append(f"| {what} | {t['full'] * 1e3:.2f} | {t['int8'] * 1e3:.2f} | "
                        f"{t['full'] / t['int8']:.2f}x | {t['fp8'] * 1e3:.2f} | "
                        f"{t['full'] / t['fp8']:.2f}x | {nb['int8'] / nb['full']:.3f} |")
        del ours
        gc.collect()
    return "\n".join(rows)


# ----------------------------------------------------------------------------- side by side

def compare(config: dict = WT103_BASE, eval_spec: dict = EVAL, gen_spec: dict = GEN,
            min_run_time_s: float = 1.0, with_hf: bool = True,
            log: Callable[[str], None] = print, device=None,
            kinds=("eval", "generate")) -> dict:
    """Time both workloads, ours and (when transformers 4.x is importable and ``with_hf``) HF
    on the same weights, with :func:`benchmarks.runner.measure`; greedy tokens must be equal.
    Returns ``{"eval": {provider: s}, "generate": {provider: s}, "hf": reason or None}`` (the
    median seconds per call). Without HF the providers are ours with the K/V cache
    ("txl_kernels") and on the mems path ("txl_kernels_mems", eval only)."""
    device = torch.device(device) if device is not None else _device()
    with one_cpu_thread(device):
        return _compare(config, eval_spec, gen_spec, min_run_time_s, with_hf, log, device,
                        kinds)


def _compare(config, eval_spec, gen_spec, min_run_time_s, with_hf, log, device, kinds) -> dict:
    hf_ok = with_hf and hf_classes() is not None
    out = {"device": str(device), "hf": None if hf_ok else HF_MISSING, "eval": {},
           "generate": {}}

    def timed(step):
        times = sorted(measure(synced(step, device), device, min_run_time_s))
        return times[len(times) // 2]

    if "eval" in kinds:
        ours, hf = build(config, eval_spec["mem_len"], eval_spec["tgt_len"], hf_ok, device)
        for p in ("txl_kernels", "txl_kernels_mems") + (("hf",) if hf_ok else ()):
            out["eval"][p] = timed(eval_step(p, ours, hf, eval_spec))
            log(f"  eval {p}: {out['eval'][p]:.4f} s")
        del ours, hf
        gc.collect()
    if "generate" not in kinds:
        return out
    ours, hf = build(config, gen_spec["mem_len"], gen_spec["tgt_len"], hf_ok, device)
    tokens: Dict[str, torch.Tensor] = {}
    for p in ("txl_kernels",) + (("hf",) if hf_ok else ()):
        out["generate"][p] = timed(generate_step(p, ours, hf, gen_spec, tokens))
        log(f"  generate {p}: {out['generate'][p]:.3f} s")
    if hf_ok and not torch.equal(tokens["txl_kernels"], tokens["hf"]):
        raise AssertionError("generate: greedy tokens differ from HF's loop")
    return out


def table(res: dict, config: dict, eval_spec: dict, gen_spec: dict) -> str:
    e, g = res["eval"], res["generate"]
    rows = ["| workload | HF TransfoXL (s) | txl_kernels (s) | speedup |", "|---|---|---|---|"]
    ev = (f"eval, tgt_len {eval_spec['tgt_len']} / mem_len {eval_spec['mem_len']}, "
          f"bsz {eval_spec['bsz']}, per segment")
    gen = (f"generate {gen_spec['new']} after a {gen_spec['prompt']}-token prompt, mem_len "
           f"{gen_spec['mem_len']}, bsz {gen_spec['bsz']}")
    hf_e, hf_g = e.get("hf"), g.get("hf")

    def fmt(t):
        return "-" if t is None else f"{t:.4f}"

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None else "-"

    if e:
        rows.append(f"| {ev} (K/V cache) | {fmt(hf_e)} | {e['txl_kernels']:.4f} | "
                    f"{ratio(hf_e, e['txl_kernels'])} |")
        rows.append(f"| {ev} (mems path) | {fmt(hf_e)} | {e['txl_kernels_mems']:.4f} | "
                    f"{ratio(hf_e, e['txl_kernels_mems'])} |")
    if g:
        rows.append(f"| {gen} | {fmt(hf_g)} | {g['txl_kernels']:.3f} | "
                    f"{ratio(hf_g, g['txl_kernels'])} |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- pytest cases
# On CPU the small size (the realistic one takes minutes per case there: run the module
# instead); on CUDA the realistic size.

_MODELS: Dict[str, tuple] = {}


def _sizes(kind: str):
    big = torch.cuda.is_available()
    if kind == "eval":
        return (WT103_BASE, EVAL) if big else (SMALL, SMALL_EVAL)
    return (WT103_BASE, GEN) if big else (SMALL, SMALL_GEN)


def _models(kind: str, need_hf: bool):
    if need_hf and hf_classes() is None:
        pytest.skip(HF_MISSING)
    key = f"{kind}-{need_hf}"
    if key not in _MODELS:
        config, spec = _sizes(kind)
        _MODELS[key] = build(config, spec["mem_len"], spec["tgt_len"], with_hf=need_hf)
    return _MODELS[key]


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """CPU cases run with one intra-op thread, as Timer does; restored afterwards."""
    with one_cpu_thread(_device()):
        yield


def _run(benchmark, step, rounds):
    with torch.no_grad():
        benchmark.pedantic(synced(step, _device()), rounds=rounds, iterations=1,
                           warmup_rounds=1)


@pytest.mark.parametrize("provider", ["txl_kernels", "txl_kernels_mems", "hf"])
def test_lm_eval(benchmark, provider):
    ours, hf = _models("eval", provider == "hf")
    config, spec = _sizes("eval")
    benchmark.group = (f"LM eval: tgt_len {spec['tgt_len']}, mem_len {spec['mem_len']}, "
                       f"bsz {spec['bsz']}, d_model {config['d_model']}")
    _run(benchmark, eval_step(provider, ours, hf, spec), rounds=5)


@pytest.mark.parametrize("provider", ["txl_kernels", "hf"])
def test_lm_generate(benchmark, provider):
    ours, hf = _models("gen", provider == "hf")
    config, spec = _sizes("gen")
    benchmark.group = (f"LM generate: {spec['new']} tokens after a {spec['prompt']}-token "
                       f"prompt, mem_len {spec['mem_len']}, d_model {config['d_model']}")
    _run(benchmark, generate_step(provider, ours, hf, spec), rounds=1)


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
@pytest.mark.parametrize("kind", ["eval", "decode"])
@pytest.mark.parametrize("shape", [0, 1, 2])
def test_lm_quant_memory(benchmark, kind, shape, cache):
    """Full-precision vs 8-bit memory: a segment (eval) or one token (decode) against a full
    memory; the cache's bytes in extra_info. CPU: the small model at a quarter of the
    Transformer-XL lengths; CUDA: Transformer-XL base in bf16 at its evaluation shapes."""
    big = torch.cuda.is_available()
    config, spec = (WT103_BASE, QUANT_SHAPES[shape]) if big else (SMALL, SMALL_QUANT_SHAPES[shape])
    key = f"quant-{shape}"
    if key not in _MODELS:
        _MODELS.clear()  # one model at a time (the realistic ones are large)
        ours, _ = build(config, spec["mem_len"], spec["tgt_len"], with_hf=False)
        _MODELS[key] = (ours.to(torch.bfloat16 if big else torch.float32), None)
    step, nbytes = quant_step(kind, _MODELS[key][0], spec, CACHE_DTYPES[cache])
    benchmark.group = (f"LM {kind} with 8-bit memory: tgt_len {spec['tgt_len']}, mem_len "
                       f"{spec['mem_len']}, bsz {spec['bsz']}, d_model {config['d_model']}")
    benchmark.extra_info["cache_bytes"] = nbytes
    _run(benchmark, step, rounds=3 if kind == "eval" else 5)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="the small size (seconds)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the whole comparison N times (median ratios at the end)")
    parser.add_argument("--min-run-time", type=float, default=1.0,
                        help="seconds of calls per timing (Timer.blocked_autorange)")
    parser.add_argument("--quant", action="store_true",
                        help="8-bit memory against the full-precision cache")
    parser.add_argument("--gen-bsz", type=int, default=None,
                        help="generate for this many sequences at once (default: GEN's bsz 1)")
    parser.add_argument("--generate-only", action="store_true",
                        help="only the generation comparison")
    a = parser.parse_args()
    if a.quant:
        print(f"device: {_device()}, torch {torch.__version__}; 8-bit memory")
        print(footprint_table())
        print(compare_quant(SMALL if a.small else WT103_BASE,
                            SMALL_QUANT_SHAPES if a.small else QUANT_SHAPES, a.min_run_time))
        raise SystemExit(0)
    config, ev, gen = (SMALL, SMALL_EVAL, SMALL_GEN) if a.small else (WT103_BASE, EVAL, GEN)
    if a.gen_bsz is not None:
        gen = dict(gen, bsz=a.gen_bsz)
    kinds = ("generate",) if a.generate_only else ("eval", "generate")
    print(f"device: {_device()}, torch {torch.__version__}, 1 thread on CPU (Timer's default); "
          f"model {config}; eval {ev}; generate {gen}")
    runs = []
    for i in range(a.repeat):
        t0 = time.perf_counter()
        res = compare(config, ev, gen, a.min_run_time, kinds=kinds)
        runs.append(res)
        print(f"run {i + 1} ({time.perf_counter() - t0:.0f} s)")
        print(table(res, config, ev, gen))
    if a.repeat > 1 and runs[0]["hf"] is None:
        def med(xs):
            return sorted(xs)[len(xs) // 2]
        for kind, p in (("eval", "txl_kernels"), ("eval", "txl_kernels_mems"),
                        ("generate", "txl_kernels")):
            if kind not in kinds:
                continue
            ratios = [r[kind]["hf"] / r[kind][p] for r in runs]
            print(f"median speedup {kind} {p}: {med(ratios):.2f}x "
                  f"(runs: {', '.join(f'{x:.2f}' for x in ratios)})")
