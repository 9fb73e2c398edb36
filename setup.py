"""Packaging for txl_kernels.

Nothing is compiled at install time: the C++/CUDA sources in csrc/ ship inside the package as
``txl_kernels/csrc`` (wheel and sdist) and are compiled on first use by
``txl_kernels._build`` with ninja (torch.utils.cpp_extension.load). The developer tools in
tools/ (sm_90 AOT check, build report) are not packaged.
"""
from setuptools import setup

setup(
    packages=["txl_kernels", "txl_kernels.ops", "txl_kernels.modules", "txl_kernels.models",
              "txl_kernels.csrc"],
    package_dir={"txl_kernels.csrc": "csrc"},
    package_data={"txl_kernels.csrc": ["*.cpp", "*.cu", "*.h", "*.cuh"]},
    include_package_data=True,
)
