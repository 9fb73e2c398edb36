"""Models built on txl_kernels: the Transformer-XL language model with a K/V cache and
generation (``MemTransformerLM``; ``MemTransformerLM.from_hf`` / ``from_nvidia`` load HF /
NVIDIA checkpoints)."""
from .adaptive import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from .cache import TransfoXLCache
from .mem_transformer import (MemTransformerLM, PositionalEmbedding, PositionwiseFF,
                              RelPartialLearnableDecoderLayer)

__all__ = ["MemTransformerLM", "TransfoXLCache", "AdaptiveEmbedding",
           "ProjectedAdaptiveLogSoftmax", "PositionalEmbedding", "PositionwiseFF",
           "RelPartialLearnableDecoderLayer"]
