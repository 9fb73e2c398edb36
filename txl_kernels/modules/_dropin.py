"""Small helpers shared by the drop-ins: ``from_module``'s adoption of the original's
parameters, and the key padding mask check."""
from __future__ import annotations

from typing import Iterable, Tuple

import torch
import torch.nn as nn

from .._utils import describe


def adopt(new: nn.Module, original: nn.Module, names: Iterable[str]) -> nn.Module:
    """Make ``new`` (built on the meta device) use ``original``'s submodules / parameters /
    buffers ``names`` (the same objects: nothing is copied, optimizers keep working) and its
    training mode. Returns ``new``."""
    for name in names:
        setattr(new, name, getattr(original, name))
    return new.train(original.training)


def check_key_padding_mask(who: str, mask, axes: str, shape: Tuple[int, int],
                           dtypes: Tuple[torch.dtype, ...] = (torch.bool,)) -> None:
    """Raise a ValueError naming ``who`` unless ``mask`` is a tensor of one of ``dtypes`` with
    ``shape`` (True = padded key); ``axes`` names its dimensions in the message, e.g.
    "(B, K)"."""
    if isinstance(mask, torch.Tensor) and mask.dtype in dtypes and tuple(mask.shape) == shape:
        return
    kinds = " or ".join(str(d).rpartition(".")[2] for d in dtypes)
    raise ValueError(f"{who}: key_padding_mask must be a {kinds} tensor {axes} = "
                     f"({shape[0]}, {shape[1]}), True = padded; got {describe(mask)}")


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The originals' ``torch.equal(a, b)`` test (icefall, SpeechBrain: equal inputs share one
    projection), without the comparison (and its host sync) when both are one tensor object
    or their shapes differ. Under ``torch.export`` values are unknown while tracing: one
    object counts as equal, distinct ones as not (their outputs are the same either way; a
    model passes one object for self-attention)."""
    if a is b:
        return True
    if torch.compiler.is_exporting():
        return False
    return a.shape == b.shape and torch.equal(a, b)
