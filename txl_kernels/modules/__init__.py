"""Drop-in attention modules built on ``txl_kernels.rel_attention``."""
from .conformer import (ESPnetRelPositionMultiHeadedAttention, NeMoRelPositionMultiHeadAttention,
                        NeMoRelPositionMultiHeadAttentionLongformer)
from .gtrxl import DIEngineAttentionXL, RLlibRelativeMultiHeadAttention
from .icefall import IcefallRelPositionMultiheadAttention
from .parakeet import (FastSpeech2ConformerAttention, ParakeetEncoderAttention,
                       Wav2Vec2ConformerSelfAttention)
from .speechbrain import SpeechBrainRelPosMHAXL
from .swap import SWAP_TABLE, swap_rel_pos_attention
from .transformer_xl import FusedRelAttention

__all__ = ["FusedRelAttention", "NeMoRelPositionMultiHeadAttention",
           "NeMoRelPositionMultiHeadAttentionLongformer",
           "ESPnetRelPositionMultiHeadedAttention", "ParakeetEncoderAttention",
           "Wav2Vec2ConformerSelfAttention", "FastSpeech2ConformerAttention",
           "IcefallRelPositionMultiheadAttention", "SpeechBrainRelPosMHAXL",
           "RLlibRelativeMultiHeadAttention", "DIEngineAttentionXL", "swap_rel_pos_attention",
           "SWAP_TABLE"]
