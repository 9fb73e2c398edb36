"""txl_kernels benchmark suite: ``pytest benchmarks/ --benchmark-only`` and
``python benchmarks/report.py``. See BENCHMARKS.md."""
