"""The GPU architectures the fused kernels are configured for (no triton import here).

Per compute capability: the shared memory one block may have (the opt-in maximum of the CUDA
programming guide's per-capability table), the residency limits the compile check's occupancy
estimate uses, whether the hardware has TMA (the kernels' tensor-descriptor path: sm_90 and
newer; older GPUs take pointer loads) and the config family whose tables the kernel modules
keep (``rel_attn_fwd`` / ``rel_attn_bwd``: ``sm80``, ``sm86``, ``sm90``, ``sm100``, ``sm120``).

The launchers ask :func:`launch_arch` for the arch of their tensors' device. For tensors on
the ``meta`` device (``tools/aot_check`` drives the launchers with them to compile for a
target without a GPU) it is the target set by :func:`compile_target`, sm_90 otherwise.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Iterator, Optional, Tuple

import torch

__all__ = ["ArchInfo", "ARCHS", "MIN_CAPABILITY", "arch_info", "launch_arch", "compile_target",
           "capability_of", "unsupported_reason", "config_family"]

MIN_CAPABILITY = 80  # bf16 tensor-core products and cp.async: Ampere and newer


@dataclasses.dataclass(frozen=True)
class ArchInfo:
    capability: int          # 10 * major + minor, e.g. 89
    family: str              # the config tables' key
    max_shared: int          # bytes of shared memory one block may use (opt-in maximum)
    shared_per_sm: int       # bytes of shared memory per SM
    max_warps_per_sm: int
    max_blocks_per_sm: int
    tma: bool                # tensor memory accelerator (TMA descriptors)
    regs_per_sm: int = 65536

    @property
    def name(self) -> str:
        return f"sm_{self.capability}"


_KB = 1024
ARCHS: Dict[int, ArchInfo] = {a.capability: a for a in (
    ArchInfo(80, "sm80", 163 * _KB, 164 * _KB, 64, 32, False),    # A100, A30
    ArchInfo(86, "sm86", 99 * _KB, 100 * _KB, 48, 16, False),     # RTX 30xx, A10, A40
    ArchInfo(87, "sm80", 163 * _KB, 164 * _KB, 48, 16, False),    # Jetson Orin
    ArchInfo(89, "sm86", 99 * _KB, 100 * _KB, 48, 24, False),     # L4, L40, RTX 40xx
    ArchInfo(90, "sm90", 227 * _KB, 228 * _KB, 64, 32, True),     # H100, H200, GH200
    ArchInfo(100, "sm100", 227 * _KB, 228 * _KB, 64, 32, True),   # B200, GB200
    ArchInfo(103, "sm100", 227 * _KB, 228 * _KB, 64, 32, True),   # B300
    ArchInfo(120, "sm120", 99 * _KB, 100 * _KB, 48, 32, True),    # RTX 50xx, RTX PRO 6000
    ArchInfo(121, "sm120", 99 * _KB, 100 * _KB, 48, 32, True),    # DGX Spark
)}


def arch_info(capability: int) -> ArchInfo:
    """The entry of ``capability`` (e.g. 89), or for one not in :data:`ARCHS` (>= 80) the
    nearest known capability below it, with its limits. Raises ValueError below sm_80."""
    capability = int(capability)
    if capability < MIN_CAPABILITY:
        raise ValueError(f"no fused-kernel configs for sm_{capability}: "
                         + unsupported_reason(capability))
    if capability in ARCHS:
        return ARCHS[capability]
    return ARCHS[max(c for c in ARCHS if c <= capability)]


def unsupported_reason(capability: int) -> Optional[str]:
    """Why the fused kernels do not run on sm_``capability``, or None when they do."""
    if capability >= MIN_CAPABILITY:
        return None
    major, minor = divmod(capability, 10)
    return (f"compute capability {major}.{minor} (sm_{capability}) is below 8.0: the fused "
            "kernels need Ampere or newer (bf16 tensor-core products, asynchronous copies); "
            "backend='reference' runs on it")


def capability_of(device: torch.device) -> int:
    """10 * major + minor of a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


_TARGET: Optional[int] = None  # compile_target's capability for meta tensors


@contextlib.contextmanager
def compile_target(capability: int) -> Iterator[ArchInfo]:
    """Within the block, launchers called on ``meta`` tensors configure for sm_``capability``
    (tools/aot_check compiles for that target)."""
    global _TARGET
    info = arch_info(capability)
    old, _TARGET = _TARGET, int(capability)
    try:
        yield info
    finally:
        _TARGET = old


def launch_arch(device: torch.device) -> Optional[ArchInfo]:
    """The arch a launch on ``device`` configures for: the CUDA device's, the compile target
    for ``meta`` tensors (sm_90 by default), None for CPU tensors (the Triton interpreter,
    which has its own fixed configs and emulates TMA descriptors)."""
    if device.type == "cuda":
        return _cuda_arch(device.index if device.index is not None
                          else torch.cuda.current_device())
    if device.type == "meta":
        return arch_info(90 if _TARGET is None else _TARGET)
    return None


_CUDA_ARCH: Dict[int, ArchInfo] = {}


def _cuda_arch(index: int) -> ArchInfo:
    info = _CUDA_ARCH.get(index)
    if info is None:
        info = _CUDA_ARCH[index] = arch_info(capability_of(torch.device("cuda", index)))
    return info


def config_family(device: torch.device) -> Tuple[str, bool]:
    """(config family, TMA) of a launch on ``device``; ("sm90", True) for the interpreter."""
    info = launch_arch(device)
    return ("sm90", True) if info is None else (info.family, info.tma)
