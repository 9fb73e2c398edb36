"""txl_kernels: fused Transformer-XL relative attention.

Public API:
    rel_attention      functional relative attention (reference or fused Triton backend)
    FusedRelAttention  drop-in for Transformer-XL's RelPartialLearnableMultiHeadAttn
    NeMoRelPositionMultiHeadAttention, NeMoRelPositionMultiHeadAttentionLongformer (local
    attention with global tokens), ESPnetRelPositionMultiHeadedAttention: Conformer drop-ins
    ParakeetEncoderAttention, Wav2Vec2ConformerSelfAttention, FastSpeech2ConformerAttention
    (HF transformers 5.x), IcefallRelPositionMultiheadAttention,
    SpeechBrainRelPosMHAXL, RLlibRelativeMultiHeadAttention, DIEngineAttentionXL: more drop-ins
    swap_rel_pos_attention, SWAP_TABLE: replace the originals inside a model
    update_mems        segment-memory update (JIT-built C++/CUDA extension, torch fallback)
    ExportUnsupported  raised by an export route (ONNX, TorchScript, torch.export) for what it
                       cannot record (docs/export.md)
    load_library       load that extension now (its ops are loaded on first use), e.g. before
                       loading an AOTInductor package that calls the CPU kernel
    QuantizedKV, quantize_kv: 8-bit (int8 / float8_e4m3fn) attention memory
    rel_attention_reference, mask_to_band, fused_available, BACKENDS: the einsum reference,
    the band form of a mask, whether the fused kernels run on a device, the backend names

The test oracles' internals (``rel_shift``, ``rel_shift_pad_reshape``, ``allowed_pairs``) stay
in :mod:`txl_kernels.reference`; the language model is in :mod:`txl_kernels.models`.
"""
from ._export import ExportUnsupported
from .cpu_kernel import load_library
from .functional import BACKENDS, fused_available, mask_to_band, rel_attention
from .modules import (SWAP_TABLE, DIEngineAttentionXL, ESPnetRelPositionMultiHeadedAttention,
                      FastSpeech2ConformerAttention, FusedRelAttention,
                      IcefallRelPositionMultiheadAttention, Wav2Vec2ConformerSelfAttention,
                      NeMoRelPositionMultiHeadAttention,
                      NeMoRelPositionMultiHeadAttentionLongformer, ParakeetEncoderAttention,
                      RLlibRelativeMultiHeadAttention, SpeechBrainRelPosMHAXL,
                      swap_rel_pos_attention)
from .memory import update_mems
from .quant import QuantizedKV, quantize_kv
from .reference import rel_attention_reference

__version__ = "0.1.0"

__all__ = ["rel_attention", "FusedRelAttention", "NeMoRelPositionMultiHeadAttention",
           "NeMoRelPositionMultiHeadAttentionLongformer",
           "ESPnetRelPositionMultiHeadedAttention", "ParakeetEncoderAttention",
           "IcefallRelPositionMultiheadAttention", "SpeechBrainRelPosMHAXL",
           "RLlibRelativeMultiHeadAttention", "DIEngineAttentionXL",
           "Wav2Vec2ConformerSelfAttention", "FastSpeech2ConformerAttention",
           "swap_rel_pos_attention", "SWAP_TABLE", "update_mems", "mask_to_band",
           "fused_available", "BACKENDS", "rel_attention_reference", "QuantizedKV",
           "quantize_kv", "load_library", "ExportUnsupported", "__version__"]
