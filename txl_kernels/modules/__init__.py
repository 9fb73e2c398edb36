"""Drop-in attention modules built on ``txl_kernels.rel_attention``."""
from .transformer_xl import FusedRelAttention, band_window_of_mask

__all__ = ["FusedRelAttention", "band_window_of_mask"]
