"""A call's *variant*: what selects the fused kernels' compiled code (the window sides, the
masks, dropout, an 8-bit memory, the dtype and head dim, ...). One definition, read by the
first-use self-check (``selfcheck``: its key) and by the launchers (``ops._common
.variant_flags``: their constexpr flags), so that what is checked is what compiles. No import
of the package's other modules: the launchers and the self-check both import it."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["Variant", "variant_of"]


class Variant(NamedTuple):
    """What selects the fused kernels a call compiles and runs (a tuple: hashable, and a
    constant that torch.compile folds)."""
    device: str            # "cuda:0"; "cpu" under the Triton interpreter
    dtype: str             # "float16", "bfloat16", "float32"
    head_dim: int
    products: str          # fp32: "tf32" or "ieee" (torch.get_float32_matmul_precision); else ""
    window_left: bool      # a left window bound
    window_right: bool     # a right window bound (causal is window_right = 0)
    key_padding: bool
    attn_mask: bool
    band: bool             # attn_mask_band given
    dropout: bool
    memory: str            # 8-bit memory dtype ("int8", "float8_e4m3fn") or ""
    grad: bool             # the call records gradients: the backward is checked too
    deterministic: bool    # the backward's mode (with grad): reproducible sums or not
    row_shift: bool = False  # r_first_distance given: the kernels' runtime row shift

    def describe(self) -> str:
        parts = [f"{self.device} {self.dtype}" + (f" ({self.products} products)"
                                                   if self.products else ""),
                 f"head dim {self.head_dim}"]
        window = [name for name, on in (("left window", self.window_left),
                                        ("right window / causal", self.window_right)) if on]
        parts.append(" + ".join(window) if window else "no window")
        if self.key_padding:
            parts.append("key padding mask")
        if self.attn_mask:
            parts.append("attn_mask" + (" with band" if self.band else ""))
        if self.dropout:
            parts.append("dropout")
        if self.memory:
            parts.append(f"{self.memory} memory")
        if self.row_shift:
            parts.append("r_first_distance")
        parts.append("forward + backward (" + ("deterministic" if self.deterministic
                                               else "atomic") + ")"
                     if self.grad else "forward")
        return ", ".join(parts)


def variant_of(q: torch.Tensor, window_left: int, window_right: int,
               key_padding_mask: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
               attn_mask_band: Optional[torch.Tensor], dropout_p: float, memory,
               grad: bool, deterministic: bool, r_first_distance: Optional[int]) -> Variant:
    """The variant of a call with these (validated, normalised) arguments: the one definition
    of what selects the fused kernels' compiled code, read by the self-check (its key) and by
    the launchers (their constexpr flags). ``products`` is left "" (filled in where the check
    runs); ``deterministic`` counts only with ``grad``; an 8-bit memory of no rows is none
    (no 8-bit code runs)."""
    return Variant(str(q.device), str(q.dtype).removeprefix("torch."), int(q.shape[-1]), "",
                   window_left >= 0, window_right >= 0, key_padding_mask is not None,
                   attn_mask is not None, attn_mask_band is not None, dropout_p > 0.0,
                   "" if memory is None or memory.k.shape[1] == 0
                   else str(memory.k.dtype).removeprefix("torch."),
                   grad, bool(deterministic) and grad, r_first_distance is not None)
