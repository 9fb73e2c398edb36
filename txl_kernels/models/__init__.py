"""Models built on txl_kernels: the Transformer-XL language model with a K/V cache and
generation (``MemTransformerLM``)."""
from .adaptive import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from .cache import TransfoXLCache
from .hf import from_hf
from .mem_transformer import (MemTransformerLM, PositionalEmbedding, PositionwiseFF,
                              RelPartialLearnableDecoderLayer)
from .nvidia import from_nvidia

__all__ = ["MemTransformerLM", "TransfoXLCache", "AdaptiveEmbedding",
           "ProjectedAdaptiveLogSoftmax", "PositionalEmbedding", "PositionwiseFF",
           "RelPartialLearnableDecoderLayer", "from_hf", "from_nvidia"]
