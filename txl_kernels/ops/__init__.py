"""The fused Triton kernels and their launchers (importing this package imports triton): the
CUDA dispatch key's kernels of ``txl_kernels::rel_attn_fwd`` / ``rel_attn_bwd`` (``_op.py``)
and the decoding step."""
