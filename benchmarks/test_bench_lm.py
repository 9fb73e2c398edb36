"""Transformer-XL LM (txl_kernels.models.MemTransformerLM) against HF TransfoXL, same weights.

Two workloads (issue 12):
- eval: one segment of tgt_len 64 tokens against a full memory of mem_len 640 (the state of a
  long evaluation), ours with the K/V cache, ours on the mems path, HF with mems;
- generate: 128 new tokens (greedy) after a 512-token prompt, mem_len 512: ours
  ``model.generate`` (prompt in segments on the cache, then one token at a time), HF's loop
  (the prompt in the same segments with mems, then the last token fed with mems).
HF needs transformers 4.x (the ``hf4`` extra, e.g. ``PYTHONPATH=/tmp/hf4``); without it the HF
cases skip with the reason. Sizes are CPU-sized (4 layers, d_model 256); on a GPU the same
cases run on CUDA.

    python -m pytest benchmarks/test_bench_lm.py --benchmark-only
    python -m benchmarks.test_bench_lm          # side-by-side times and ratios
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Dict, Optional

import pytest
import torch

from txl_kernels.models import MemTransformerLM

CONFIG = dict(n_token=2000, n_layer=4, n_head=4, d_model=256, d_head=64, d_inner=1024,
              cutoffs=[500, 1000], div_val=1, same_length=True, clamp_len=1000, untie_r=True)
EVAL = dict(tgt_len=64, mem_len=640, bsz=2)
GEN = dict(prompt=512, new=128, mem_len=512, tgt_len=64, bsz=1)


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


def build(mem_len: int, tgt_len: int, with_hf: bool, device=None):
    """(ours, hf or None) with the same random weights, eval mode, fp32."""
    device = device or _device()
    torch.manual_seed(0)
    classes = hf_classes() if with_hf else None
    if classes is None:
        c = dict(CONFIG)
        ours = MemTransformerLM(c.pop("n_token"), c.pop("n_layer"), c.pop("n_head"),
                                c.pop("d_model"), c.pop("d_head"), c.pop("d_inner"), 0.0, 0.0,
                                tgt_len=tgt_len, mem_len=mem_len, **c)
        return ours.to(device).eval(), None
    Config, LMHead = classes
    c = dict(CONFIG)
    cfg = Config(vocab_size=c.pop("n_token"), d_embed=c["d_model"], mem_len=mem_len,
                 dropout=0.0, dropatt=0.0, **c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = LMHead(cfg).to(device).eval()
    return MemTransformerLM.from_hf(hf, tgt_len=tgt_len), hf


# ----------------------------------------------------------------------------- workloads

def eval_step(provider: str, ours, hf) -> Callable[[], None]:
    """A callable that evaluates the next segment of tgt_len tokens against a full memory."""
    tgt_len, mem_len, bsz = EVAL["tgt_len"], EVAL["mem_len"], EVAL["bsz"]
    device = next(ours.parameters()).device
    g = torch.Generator().manual_seed(1)
    n_seg = mem_len // tgt_len + 1
    data = torch.randint(0, CONFIG["n_token"], (n_seg * tgt_len + 1, bsz), generator=g)
    data = data.to(device)
    warm = [(data[s:s + tgt_len], data[s + 1:s + 1 + tgt_len])
            for s in range(0, (n_seg - 1) * tgt_len, tgt_len)]
    inp, tgt = data[-tgt_len - 1:-1], data[-tgt_len:]
    with torch.no_grad():
        if provider == "txl_kernels":
            cache = ours.new_cache(bsz)
            for x, y in warm:
                ours(x, y, cache=cache)
            return lambda: ours(inp, tgt, cache=cache)
        if provider == "txl_kernels_mems":
            mems = []
            for x, y in warm:
                mems = ours(x, y, *mems)[1:]
            return lambda: ours(inp, tgt, *mems)
        mems = [torch.empty(0, bsz, CONFIG["d_model"], device=device)
                for _ in range(CONFIG["n_layer"])]
        for x, _ in warm:
            mems = hf(x.t(), mems=mems).mems
        x_bf = inp.t().contiguous()
        return lambda: hf(x_bf, labels=x_bf, mems=mems)


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


def generate_step(provider: str, ours, hf) -> Callable[[], torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    device = next(ours.parameters()).device
    prompt = torch.randint(0, CONFIG["n_token"], (GEN["bsz"], GEN["prompt"]), generator=g)
    prompt = prompt.to(device)
    if provider == "txl_kernels":
        return lambda: ours.generate(prompt, GEN["new"])
    return lambda: hf_greedy(hf, prompt, GEN["new"], GEN["tgt_len"])


# ----------------------------------------------------------------------------- pytest cases

_MODELS: Dict[str, tuple] = {}


def _models(kind: str, need_hf: bool):
    if need_hf and hf_classes() is None:
        pytest.skip("HF TransfoXL needs transformers 4.x (the 'hf4' extra, e.g. "
                    "pip install --no-deps --target /tmp/hf4 transformers==4.34.1 ... and "
                    "PYTHONPATH=/tmp/hf4)")
    key = f"{kind}-{need_hf}"
    if key not in _MODELS:
        spec = EVAL if kind == "eval" else GEN
        _MODELS[key] = build(spec["mem_len"], spec["tgt_len"], with_hf=need_hf)
    return _MODELS[key]


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """CPU cases run with one intra-op thread (see compare()); restored afterwards."""
    before = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(benchmark, step, rounds):
    def timed():
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    with torch.no_grad():
        benchmark.pedantic(timed, rounds=rounds, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("provider", ["txl_kernels", "txl_kernels_mems", "hf"])
def test_lm_eval_tgt64_mem640(benchmark, provider):
    ours, hf = _models("eval", provider == "hf")
    benchmark.group = "LM eval: tgt_len 64, mem_len 640, bsz 2"
    _run(benchmark, eval_step(provider, ours, hf), rounds=5)


@pytest.mark.parametrize("provider", ["txl_kernels", "hf"])
def test_lm_generate_128_after_512(benchmark, provider):
    ours, hf = _models("gen", provider == "hf")
    benchmark.group = "LM generate: 128 tokens after a 512-token prompt, mem_len 512"
    _run(benchmark, generate_step(provider, ours, hf), rounds=1)


# ----------------------------------------------------------------------------- side by side

def _median_time(step: Callable, reps: int) -> float:
    times = []
    with torch.no_grad():
        step()  # warm-up
        for _ in range(reps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def compare(eval_reps: int = 5, gen_reps: int = 1, check: bool = True,
            cpu_threads: Optional[int] = 1, gen_bsz: int = 1) -> Optional[dict]:
    """Time both workloads for ours and HF on the same weights; print and return the times
    (HF time / our time is the speedup). With ``check``, greedy tokens must be equal first.
    On CPU both run with ``cpu_threads`` intra-op threads (default 1: on a shared machine
    OpenMP threads that spin-wait make small ops erratic; None keeps torch's setting).
    ``gen_bsz``: batch size of the generation workload. Returns None when transformers 4.x
    is not importable."""
    GEN["bsz"] = gen_bsz
    if hf_classes() is None:
        print("HF TransfoXL not importable (needs transformers 4.x): nothing to compare")
        return None
    device = _device()
    if device.type == "cpu" and cpu_threads:
        torch.set_num_threads(cpu_threads)
    out = {"device": str(device), "threads": torch.get_num_threads()}
    ours, hf = build(EVAL["mem_len"], EVAL["tgt_len"], with_hf=True)
    t = {p: _median_time(eval_step(p, ours, hf), eval_reps)
         for p in ("txl_kernels", "txl_kernels_mems", "hf")}
    out["eval"] = t
    ours, hf = build(GEN["mem_len"], GEN["tgt_len"], with_hf=True)
    if check:
        ours_tokens = generate_step("txl_kernels", ours, hf)()
        with torch.no_grad():
            hf_tokens = generate_step("hf", ours, hf)()
        if not torch.equal(ours_tokens, hf_tokens):
            raise AssertionError("generate: greedy tokens differ from HF's loop")
    g = {p: _median_time(generate_step(p, ours, hf), gen_reps) for p in ("txl_kernels", "hf")}
    out["generate"] = g
    print(f"device: {device} ({torch.get_num_threads()} threads); model {CONFIG}")
    print(f"| workload | HF TransfoXL (s) | txl_kernels (s) | speedup |")
    print(f"|---|---|---|---|")
    print(f"| eval, tgt_len 64 / mem_len 640, bsz 2, per segment (K/V cache) | {t['hf']:.4f} | "
          f"{t['txl_kernels']:.4f} | {t['hf'] / t['txl_kernels']:.2f}x |")
    print(f"| eval, same, mems path | {t['hf']:.4f} | {t['txl_kernels_mems']:.4f} | "
          f"{t['hf'] / t['txl_kernels_mems']:.2f}x |")
    print(f"| generate 128 after a 512 prompt, mem_len 512, bsz {gen_bsz} | {g['hf']:.3f} | "
          f"{g['txl_kernels']:.3f} | {g['hf'] / g['txl_kernels']:.2f}x |")
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gen-bsz", type=int, default=1, help="generation batch size")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU intra-op threads (0 = torch's default)")
    a = parser.parse_args()
    compare(gen_bsz=a.gen_bsz, cpu_threads=a.threads or None)
