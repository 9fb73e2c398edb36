"""Block ops shared by the context-parallel ring (``distributed``) and ``rel_attention``'s extra
keys (``_extra_keys``): a backend's fused forward (out, lse) / backward-from-(out, lse) ops,
and the log-sum-exp merge of a block's normalised rows into running ones."""
from __future__ import annotations

import torch
from torch import Tensor

from ._op import BWD, FWD, FWD_OUT, op_kernel
from .reference import finite_or_zero


def merge_block(out: Tensor, lse: Tensor, i0: int, n: int, blk: Tensor, blk_lse: Tensor) -> None:
    """Fold a block's normalised rows ``blk`` ``[B, n, H, D]`` and their log-sum-exp
    ``blk_lse`` ``[B, H, n]`` (-inf: no key) into rows ``[i0, i0 + n)`` of the running
    ``out`` / ``lse``."""
    old = lse[:, :, i0:i0 + n]
    new = torch.logaddexp(old, blk_lse)
    safe = finite_or_zero(new)
    w_old = torch.exp(old - safe).transpose(1, 2)[..., None]
    w_blk = torch.exp(blk_lse - safe).transpose(1, 2)[..., None]
    out[:, i0:i0 + n] = out[:, i0:i0 + n] * w_old + blk * w_blk
    lse[:, :, i0:i0 + n] = new


class KernelOps:
    """One backend's block ops: ``fwd(q, k, v, r, u, vb, softmax_scale, wl, wr, kpm) -> (out,
    lse)`` (``lse`` natural log, +inf for rows with no allowed key) and ``bwd(dout, q, k, v, r, u,
    vb, out, lse, softmax_scale, wl, wr, kpm) -> (dq, dk, dv, dr, du, dvb)`` (both also take an
    optional ``attn_mask``, its ``attn_mask_band``, ``r_first_distance`` (the distance held
    by ``r``'s row 0 as the ops take it) and the kernels' dropout, ``dropout_p`` with its
    ``dropout_seed``): the ops ``txl_kernels::rel_attn_fwd`` / ``rel_attn_bwd`` (``_op.py``),
    whose device's kernel runs; ``"triton"`` on CPU tensors runs the Triton kernels under the
    interpreter instead (``_op.op_kernel``). ``lse_dtype``: what the backward takes (the
    kernels' accumulation dtype: fp64 for fp64, else fp32)."""

    def __init__(self, name: str, deterministic: bool = False):
        self.name, self.deterministic = name, deterministic

    @staticmethod
    def lse_dtype(dtype):
        return torch.float64 if dtype == torch.float64 else torch.float32

    def _interpreter(self, q: Tensor) -> bool:
        return self.name == "triton" and q.device.type == "cpu"

    def fwd(self, q, k, v, r, u, vb, softmax_scale, wl, wr, kpm, attn_mask=None,
            attn_mask_band=None, r_first_distance=None, dropout_p=0.0, dropout_seed=None,
            out=None):
        """``out``: the CPU kernel, no autograd: the result written there (it may be q;
        ``rel_attn_fwd.out``), returned as ``(out, lse)``."""
        args = (q, k, v, r, u, vb, softmax_scale, wl, wr, kpm, attn_mask, attn_mask_band,
                dropout_p, dropout_seed, None, None, None, None, r_first_distance)
        if out is not None:
            return out, FWD_OUT(*args, out=out)
        return op_kernel(FWD, self._interpreter(q))(*args)

    def bwd(self, dout, q, k, v, r, u, vb, out, lse, softmax_scale, wl, wr, kpm, attn_mask=None,
            attn_mask_band=None, r_first_distance=None, dropout_p=0.0, dropout_seed=None):
        return op_kernel(BWD, self._interpreter(q))(dout, q, k, v, r, u, vb, out, lse,
                                                    softmax_scale, wl, wr, kpm, attn_mask,
                                                    attn_mask_band, self.deterministic,
                                                    dropout_p, dropout_seed, r_first_distance)
