"""examples/train_lm.py --cp: the Transformer-XL LM with every segment split along its length
over a context-parallel group (MemTransformerLM(cp_group=), the memory sharded with its
segment) gives the losses and gradients of one process with the whole segment; with --ddp on
a 2-D data x context mesh, those of one process with the whole batch."""
import importlib.util
import os

import pytest
import torch
import torch.multiprocessing as mp

from helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3  # memories carried over two segment boundaries, an SGD step between segments


def _train_lm():
    spec = importlib.util.spec_from_file_location(
        "examples_train_lm_cp", os.path.join(ROOT, "examples", "train_lm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(train_lm, cp):
    return train_lm.parse_args(["--quick", "--n-layer", "2", "--d-model", "16", "--n-head", "2",
                                "--d-head", "16", "--d-inner", "32", "--tgt-len", "7",
                                "--mem-len", "7", "--attn-backend", "reference",
                                "--extension-backend", "torch", "--cp", str(cp)])


def _run(train_lm, args, cols, cp_group=None, dp_group=None):
    """Per step: (mean loss over the segment and this rank's columns, full gradients)."""
    import torch.distributed as dist

    model = train_lm.build_model(args, torch.device("cpu"), cp_group)
    net = train_lm.wrap(model, "ddp" if dp_group is not None else "none", torch.device("cpu"),
                        dp_group)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    mems, out = [], []
    batches = train_lm.epochs(cols, args.tgt_len, full_only=True)
    for _ in range(STEPS):
        data, target, _ = next(batches)
        if cp_group is not None:
            data = train_lm.cp_slice(data, cp_rank, args.cp)
            target = train_lm.cp_slice(target, cp_rank, args.cp)
        loss, mems = train_lm.train_step(net, data, target, mems, opt, cp_group=cp_group)
        out.append((loss, train_lm.full_grads(net)))
    return out


def _worker(rank, world, port, cols, path):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    train_lm = _train_lm()
    try:
        args = _args(train_lm, 2)
        dp_group, cp_group = train_lm.mesh_groups(2, torch.device("cpu"))
        dp = dist.get_world_size(dp_group)
        b = cols.shape[1] // dp
        d = dist.get_rank(dp_group)
        per_step = _run(train_lm, args, cols[:, d * b:(d + 1) * b], cp_group,
                        dp_group if dp > 1 else None)
        if dp > 1:  # the mean over the data ranks' columns
            for loss, _ in per_step:
                dist.all_reduce(loss, group=dp_group)
                loss /= dp
        torch.save(per_step, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()
    train_lm.end_process(0)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp2_ddp2"])
def test_context_parallel_lm_equals_one_process(tmp_path, world):
    train_lm = _train_lm()
    torch.manual_seed(0)
    bsz = 2 if world == 2 else 4
    cols = torch.randint(0, 256, (4 * 7 + 1, bsz))
    path = str(tmp_path / "res")
    mp.spawn(_worker, args=(world, free_port(), cols, path), nprocs=world, join=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _run(train_lm, _args(train_lm, 1), cols)
    finally:
        torch.set_num_threads(before)
    for rank in range(world):
        got = torch.load(f"{path}.{rank}", weights_only=False)
        assert len(got) == len(single)
        for step, ((lg, gg), (ls, gs)) in enumerate(zip(got, single)):
            torch.testing.assert_close(lg, ls, rtol=1e-5, atol=1e-5,
                                       msg=f"rank {rank} step {step} loss")
            assert gg.keys() == gs.keys()
            for k in gs:
                torch.testing.assert_close(gg[k], gs[k], rtol=1e-5, atol=1e-5,
                                           msg=f"rank {rank} step {step} {k}")


def test_cp_needs_mem_len_equal_to_tgt_len():
    train_lm = _train_lm()
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--quick", "--cp", "2", "--tgt-len", "8", "--mem-len", "4"])
