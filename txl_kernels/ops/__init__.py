"""Fused Triton kernels (importing this package imports triton)."""
from .rel_attn_op import rel_attn_func

__all__ = ["rel_attn_func"]
