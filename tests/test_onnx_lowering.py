"""The ONNX lowering of ``rel_attention`` (txl_kernels/_onnx_lowering.py): a graph ONNX
Runtime runs as fast as the original Conformers' exported attention (benchmarks/onnx_encoder.py)
and the reference's results, non-finite rows included."""
import json

import pytest
import torch

from test_export import _inputs
from txl_kernels import rel_attention
from txl_kernels.reference import rel_attention_reference

onnx = pytest.importorskip("onnx", reason="the export extra (pip install -e '.[export]')")
ort = pytest.importorskip("onnxruntime", reason="the export extra (pip install -e '.[export]')")

H, D = 2, 8


class _Attn(torch.nn.Module):
    def __init__(self, masked):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.masked = masked
        self.u = torch.nn.Parameter(torch.randn(H, D, generator=g))
        self.vb = torch.nn.Parameter(torch.randn(H, D, generator=g))

    def forward(self, q, k, v, r, kpm):
        return rel_attention(q, k, v, r, self.u, self.vb, causal=False,
                             key_padding_mask=kpm if self.masked else None)


def _export(masked, path):
    m = _Attn(masked).eval()
    names = ["q", "k", "v", "r", "kpm"]
    dyn = {"q": {0: "B", 1: "T"}, "k": {0: "B", 1: "T"}, "v": {0: "B", 1: "T"},
           "r": {0: "R"}, "kpm": {0: "B", 1: "T"}, "out": {0: "B", 1: "T"}}
    torch.onnx.export(m, _inputs(6), str(path), dynamo=False, opset_version=17,
                      input_names=names, output_names=["out"], dynamic_axes=dyn)
    return m, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _run(sess, x, masked):
    names = {i.name for i in sess.get_inputs()}
    feeds = dict(zip(["q", "k", "v", "r", "kpm"], (t.numpy() for t in x)))
    return torch.from_numpy(sess.run(None, {n: a for n, a in feeds.items() if n in names})[0])


def _reference(m, x, masked):
    q, k, v, r, kpm = x
    return rel_attention_reference(q, k, v, r, m.u.detach(), m.vb.detach(), D ** -0.5, -1, -1,
                                   kpm if masked else None)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "key_padding"])
def test_graph_has_matmuls_and_no_full_size_cleaning(masked, tmp_path):
    """The products are MatMuls (ONNX Runtime's Einsum is far slower on the [B, H, T, 2T - 1]
    position term), the non-finite handling runs on k / v / r rows with no fp64 Cast and no
    pass over the scores, and without a mask no mask op touches the scores."""
    _export(masked, tmp_path / "a.onnx")
    graph = onnx.load(str(tmp_path / "a.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert "Einsum" not in ops and "IsNaN" not in ops and "IsInf" not in ops, sorted(set(ops))
    assert ops.count("MatMul") == 3, ops
    casts = [a.i for n in graph.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"]
    assert onnx.TensorProto.DOUBLE not in casts
    # the scores' passes: Add (AC + BD), Softmax; with a mask the reference's Where and Mul
    # (without one, the only Where zeroes v's non-finite entries)
    assert ops.count("Softmax") == 1
    assert ops.count("Where") == (3 if masked else 1) and ("Not" in ops) == masked, ops


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "key_padding"])
def test_onnxruntime_matches_the_reference_at_other_lengths(masked, tmp_path):
    m, sess = _export(masked, tmp_path / "a.onnx")
    for T in (5, 11):
        x = _inputs(T)
        torch.testing.assert_close(_run(sess, x, masked), _reference(m, x, masked), rtol=1e-5,
                                   atol=1e-5)


def test_nonfinite_rows_as_the_reference(tmp_path):
    """A NaN / inf in a padded key's k or v row reaches nothing; an inf in a used position row
    poisons exactly the query rows that use it, as the reference does."""
    m, sess = _export(True, tmp_path / "a.onnx")
    q, k, v, r, kpm = _inputs(7)
    k[1, -1, 0, 3] = float("nan")     # padded key of batch 1
    v[1, -2, 1, 0] = float("inf")     # padded key of batch 1
    r[2, 1, 5] = float("-inf")        # distance 4 (j - i = -4): rows 4..6 use it
    x = (q, k, v, r, kpm)
    got, want = _run(sess, x, True), _reference(m, x, True)
    assert want.isnan().any() and not want[:, :4].isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_dynamo_exporter_runs_the_same_lowering(tmp_path):
    """``torch.onnx.export(dynamo=True)`` writes the same operators (no Einsum, no custom op)
    and ONNX Runtime matches the reference at lengths not used at export."""
    m = _Attn(True).eval()
    T = torch.export.Dim("T", min=2, max=4096)
    prog = torch.onnx.export(m, _inputs(6), dynamo=True,
                             dynamic_shapes=({1: T}, {1: T}, {1: T}, {0: 2 * T - 1}, {1: T}))
    prog.save(str(tmp_path / "a.onnx"))
    graph = onnx.load(str(tmp_path / "a.onnx")).graph
    assert {n.domain for n in graph.node} <= {"", "ai.onnx"}
    assert "Einsum" not in {n.op_type for n in graph.node}
    sess = ort.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for t in (5, 11):
        x = _inputs(t)
        got = sess.run(None, dict(zip(names, (a.numpy() for a in x))))[0]
        torch.testing.assert_close(torch.from_numpy(got), _reference(m, x, True), rtol=1e-5,
                                   atol=1e-5)


class _Banded(torch.nn.Module):
    """A [T, T] mask shared by the batch and the heads (built from the length, as encoders
    build limited-context masks)."""

    def __init__(self):
        super().__init__()
        self.inner = _Attn(False)

    def forward(self, q, k, v, r):
        t = torch.arange(q.shape[1])
        far = (t[:, None] - t[None, :]).abs() > 2
        return rel_attention(q, k, v, r, self.inner.u, self.inner.vb, causal=False,
                             attn_mask=far)


def test_a_shared_mask_is_not_copied_per_head(tmp_path):
    """The mask reaches the scores by broadcasting: no Expand of it to [B, H, Lq, Lk] (ONNX
    Runtime would materialise it and run the mask's passes once per head)."""
    m = _Banded().eval()
    dyn = {"q": {1: "T"}, "k": {1: "T"}, "v": {1: "T"}, "r": {0: "R"}}
    torch.onnx.export(m, _inputs(6)[:4], str(tmp_path / "a.onnx"), dynamo=False,
                      opset_version=17, input_names=list(dyn), output_names=["out"],
                      dynamic_axes=dyn)
    assert "Expand" not in {n.op_type for n in onnx.load(str(tmp_path / "a.onnx")).graph.node}
    sess = ort.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"])
    for t in (5, 11):
        q, k, v, r, _ = _inputs(t)
        got = sess.run(None, dict(zip(dyn, (a.numpy() for a in (q, k, v, r)))))[0]
        ti = torch.arange(t)
        want = rel_attention_reference(q, k, v, r, m.inner.u.detach(), m.inner.vb.detach(),
                                       D ** -0.5, -1, -1, None,
                                       (ti[:, None] - ti[None, :]).abs() > 2)
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "key_padding"])
def test_passes_over_the_scores(masked, tmp_path):
    """The nodes ONNX Runtime runs on [B, H, Lq, Lk] tensors (graph optimisations off, so
    the exported graph as it is): AC's MatMul, the rel_shift's last Slice, AC + BD, the
    Softmax and, with a mask, one Where."""
    _export(masked, tmp_path / "a.onnx")
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "profile")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(tmp_path / "a.onnx"), so,
                                providers=["CPUExecutionProvider"])
    _run(sess, _inputs(11), masked)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    full = sorted(e["args"]["op_name"] for e in events
                  if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                  and [2, H, 11, 11] in [list(t.values())[0]
                                         for t in e["args"].get("output_type_shape", [])])
    assert full == ["Add", "MatMul", "Slice", "Softmax"] + (["Where"] if masked else [])
