"""Developer tools of the txl_kernels source tree (not part of the installed package).

Run from the repository root: ``python -m tools.aot_check``, ``python -m tools.build_check``.
"""
