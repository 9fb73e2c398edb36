"""Drop-in attention modules built on ``txl_kernels.rel_attention``."""
from .conformer import (ESPnetRelPositionMultiHeadedAttention, NeMoRelPositionMultiHeadAttention,
                        swap_rel_pos_attention)
from .transformer_xl import FusedRelAttention

__all__ = ["FusedRelAttention", "NeMoRelPositionMultiHeadAttention",
           "ESPnetRelPositionMultiHeadedAttention", "swap_rel_pos_attention"]
