"""Small helpers shared by the drop-ins' ``from_module``."""
from __future__ import annotations

from typing import Iterable

import torch.nn as nn


def adopt(new: nn.Module, original: nn.Module, names: Iterable[str]) -> nn.Module:
    """Make ``new`` (built on the meta device) use ``original``'s submodules / parameters /
    buffers ``names`` (the same objects: nothing is copied, optimizers keep working) and its
    training mode. Returns ``new``."""
    for name in names:
        setattr(new, name, getattr(original, name))
    return new.train(original.training)
