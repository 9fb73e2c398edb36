"""Every ```python block of README.md and docs/*.md runs, so the examples cannot rot.

One test per block. A block runs in a fresh namespace after the earlier blocks of its file
whose names it uses (in file order: later blocks build on earlier ones). What an example takes
from the reader's own program (their model, encoder, data: names no block defines) is made
here, small, by the block's entry in ``SETUPS``; an entry whose block is gone fails the test,
so the table follows the documents. A block is skipped, with the reason, when it imports a
framework that is not installed or builds on a block that is skipped. Blocks that take tens of
seconds (``SLOW``) run with the slow tests. The examples choose the
GPU when there is one and the CPU otherwise; on the CPU they run as on a reader's machine,
without the test suite's Triton interpreter (the C++ kernel, or the reference path).
"""
from __future__ import annotations

import ast
import glob
import importlib.util
import os
import re
import socket
import textwrap
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import pytest
import torch

from txl_kernels import functional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


class Block(NamedTuple):
    path: str     # relative to the repository root
    line: int     # of the opening fence, 1-based
    code: str     # dedented to the fence's indentation

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def python_blocks(path: str) -> List[Block]:
    """The ```python blocks of ``path`` (fences may be indented, e.g. inside a list item)."""
    blocks, lines = [], open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m.group(2):
            i += 1
            continue
        start, lang, body = i, m.group(2), []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        if lang == "python":
            blocks.append(Block(path, start + 1, textwrap.dedent("\n".join(body)) + "\n"))
    return blocks


def _names(tree: ast.AST) -> Tuple[set, set, List[str]]:
    """(names the code binds, names it reads, top-level modules it imports)."""
    bound, read, modules = set(), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else read).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                bound.add(a.asname or a.name.split(".")[0])
                modules.append(a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            bound.update(a.asname or a.name for a in node.names)
            modules.append(node.module.split(".")[0])
    return bound, read, modules


# --------------------------------------------------------------- what the readers' programs hold

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_process_group(ns, ctx):
    """A gloo group of this one process (the examples' ``torchrun`` environment, world 1)."""
    import torch.distributed as dist

    mp = ctx["monkeypatch"]
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())),
                       ("RANK", "0"), ("WORLD_SIZE", "1")):
        mp.setenv(key, value)
    ctx["cleanup"].append(lambda: dist.is_initialized() and dist.destroy_process_group())


def _tiny_parakeet():
    transformers = pytest.importorskip(
        "transformers", minversion="5.0",
        reason="the stand-in encoder is transformers' Parakeet (transformers >= 5)")
    cfg = transformers.ParakeetCTCConfig(vocab_size=12, encoder_config=dict(
        hidden_size=32, num_attention_heads=2, intermediate_size=32, num_hidden_layers=2,
        subsampling_conv_channels=8, num_mel_bins=16, subsampling_factor=4,
        conv_kernel_size=3))
    return transformers.ParakeetForCTC(cfg).eval()


def _original_txl(ns, ctx):
    from txl_original_lm import MemTransformerLM  # kimiyoung's model, transcribed

    ns["model"] = MemTransformerLM(50, 2, 2, 16, 8, 32, 0.0, 0.0, tgt_len=4, ext_len=0,
                                   mem_len=4)


def _check_txl_swapped(ns):
    from txl_kernels import FusedRelAttention

    assert all(isinstance(layer.dec_attn, FusedRelAttention) for layer in ns["model"].layers)


def _encoder(ns, ctx):
    ns["encoder"] = _tiny_parakeet().encoder


def _lm_data(ns, ctx):
    g = torch.Generator().manual_seed(0)
    ns["n_token"], ns["bsz"] = 100, 2
    stream = torch.randint(0, 100, (33, 2), generator=g)
    ns["segments"] = [(stream[i:i + 16], stream[i + 1:i + 17]) for i in (0, 16)]
    ns["prompt_ids"] = torch.randint(0, 100, (2, 5), generator=g)


def _check_lm(ns):
    assert ns["out"].shape == (2, 5 + 16)


def _nvidia_checkpoint(ns, ctx):
    """NVIDIA's checkpoint file, state_dict, config and model (tests/originals_nvidia_txl.py)."""
    from test_models_nvidia import nvidia_model, random_config

    cfg = random_config(0)
    ref = nvidia_model(cfg)
    ctx["monkeypatch"].chdir(ctx["tmp_path"])
    torch.save({"model_config": dict(cfg), "model_state": ref.state_dict()},
               "checkpoint_best.pt")
    ns.update(state_dict=ref.state_dict(), model_config=dict(cfg), nvidia_model=ref)


def _mems_data(ns, ctx):
    ns.update(hids=[torch.randn(4, 2, 8) for _ in range(3)],
              mems=[torch.randn(6, 2, 8) for _ in range(3)], mem_len=6, ext_len=1)


def _cp_tensors(ns, ctx):
    _one_process_group(ns, ctx)
    g = torch.Generator().manual_seed(0)
    B, Lq, mlen, H, D = 2, 8, 4, 2, 16
    ns.update(q=torch.randn(B, Lq, H, D, generator=g), k=torch.randn(B, Lq, H, D, generator=g),
              v=torch.randn(B, Lq, H, D, generator=g),
              mem_k=torch.randn(B, mlen, H, D, generator=g),
              mem_v=torch.randn(B, mlen, H, D, generator=g),
              r=torch.randn(mlen + Lq, H, D, generator=g),
              r_w_bias=torch.randn(H, D, generator=g), r_r_bias=torch.randn(H, D, generator=g))


def _cp_parakeet(ns, ctx):
    import torch.distributed as dist

    from txl_kernels import swap_rel_pos_attention

    model = _tiny_parakeet()
    swap_rel_pos_attention(model, backend="reference")
    _one_process_group(ns, ctx)
    dist.init_process_group("gloo")
    T = 6
    ns.update(model=model, i=0, group=dist.group.WORLD, x_local=torch.randn(2, T, 32),
              pos_emb_global=model.encoder.encode_positions(torch.randn(2, T, 32))[:1],
              valid_local=torch.arange(T)[None] < torch.tensor([[T], [4]]))


def _check_cp_parakeet(ns):
    assert ns["out_local"].shape == (2, 6, 32)


# (file, a line of the block) -> (makes the reader's names, checks the result or None)
SETUPS: Dict[Tuple[str, str], Tuple[Callable, Optional[Callable]]] = {
    ("README.md", "for layer in model.layers:"): (_original_txl, _check_txl_swapped),
    ("README.md", "n = swap_rel_pos_attention(encoder)"): (
        _encoder, lambda ns: ns["n"] == 2 or pytest.fail(f"replaced {ns['n']}, not 2")),
    ("README.md", "cache = model.new_cache(bsz)"): (_lm_data, _check_lm),
    ("docs/transformer-xl.md", "for layer in model.layers:"): (_original_txl,
                                                               _check_txl_swapped),
    ("docs/transformer-xl.md", "new_mems = update_mems("): (
        _mems_data, lambda ns: [m.shape for m in ns["new_mems"]] == [(6, 2, 8)] * 3
        or pytest.fail(str([m.shape for m in ns["new_mems"]]))),
    ("docs/transformer-xl.md", "cache = model.new_cache(bsz)"): (_lm_data, _check_lm),
    ("docs/lm.md", "MemTransformerLM.from_nvidia(ckpt)"): (_nvidia_checkpoint, None),
    ("docs/distributed.md", "context_parallel_rel_attention("): (_cp_tensors, None),
    ("docs/distributed.md", "attn.cp_group = group"): (_cp_parakeet, _check_cp_parakeet),
}

# (file, a line of the block): blocks that take tens of seconds (an AOTInductor compile) or ten
# (the dynamo ONNX exporter), marked slow (run with `pytest -m slow`)
SLOW = {("docs/export.md", "aoti_compile_and_package("),
        ("docs/export.md", "onnx_program = torch.onnx.export(")}

BLOCKS = [b for path in FILES for b in python_blocks(path)]


def _setup_of(block: Block):
    hits = [v for (path, needle), v in SETUPS.items()
            if path == block.path and needle in block.code]
    assert len(hits) <= 1, f"{block.where}: several SETUPS entries match"
    return hits[0] if hits else (None, None)


def test_every_setup_matches_one_block():
    for table, entries in (("SETUPS", SETUPS), ("SLOW", SLOW)):
        for path, needle in entries:
            n = sum(b.path == path and needle in b.code for b in BLOCKS)
            assert n == 1, f"{table} entry ({path!r}, {needle!r}) matches {n} blocks, not 1"


def _param(block: Block):
    slow = any(path == block.path and needle in block.code for path, needle in SLOW)
    return pytest.param(block, id=block.where, marks=[pytest.mark.slow] if slow else [])


def _skip_reason(block: Block, chain: List[Block]) -> Optional[str]:
    for b in chain:
        _, _, modules = _names(ast.parse(b.code))
        missing = sorted({m for m in modules if importlib.util.find_spec(m) is None})
        if missing:
            if b is block:
                return f"{block.where} needs {', '.join(missing)}, which is not installed"
            return (f"{block.where} builds on the block at {b.where}, which needs "
                    f"{', '.join(missing)} (not installed)")
    return None


def _chain(block: Block) -> List[Block]:
    """The earlier blocks of ``block``'s file that it builds on (their names it reads,
    transitively), in file order, then ``block``."""
    earlier = [b for b in BLOCKS if b.path == block.path and b.line < block.line]
    needed, chain = set(_names(ast.parse(block.code))[1]), [block]
    for b in reversed(earlier):
        bound, read, _ = _names(ast.parse(b.code))
        if bound & needed:
            chain.insert(0, b)
            needed |= read
    return chain


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_example_runs(block, monkeypatch, tmp_path):
    chain = _chain(block)
    reason = _skip_reason(block, chain)
    if reason:
        pytest.skip(reason)
    fused_available = functional.fused_available
    monkeypatch.setattr(functional, "fused_available", lambda device: (
        (False, "a CPU without the Triton interpreter (the reader's)")
        if torch.device(device).type == "cpu" else fused_available(device)))
    ns: dict = {"__name__": "__doc_example__"}
    ctx = {"monkeypatch": monkeypatch, "tmp_path": tmp_path, "cleanup": []}
    try:
        for b in chain:
            setup, check = _setup_of(b)
            if setup is not None:
                setup(ns, ctx)
            exec(compile(b.code, b.where, "exec"), ns)
            if check is not None and b is block:
                check(ns)
    finally:
        for fn in reversed(ctx["cleanup"]):
            fn()
