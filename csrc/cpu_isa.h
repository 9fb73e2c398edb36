// Which ISA variant of the vectorised CPU row code runs (docs/cpu.md, "ISA variants"): ATen's
// own choice, at::get_cpu_capability() (the string form of at::native::get_cpu_capability(),
// which honours ATEN_CPU_CAPABILITY and the CPU's features), so the kernels use the ISA that
// ATen's own kernels (SDPA included) use. Read once per process, on first use; the test-only
// op txl_kernels::cpu_isa_override forces another variant the CPU can run.
#pragma once

#include <atomic>

namespace txl_kernels {

enum class CpuIsa : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

// The variant in use, as an int (-1 until the first call of cpu_isa()).
extern std::atomic<int> g_cpu_isa;
int init_cpu_isa();  // ATen's choice, limited to what the CPU and this build can run

inline CpuIsa cpu_isa() {
  const int i = g_cpu_isa.load(std::memory_order_relaxed);
  return static_cast<CpuIsa>(i >= 0 ? i : init_cpu_isa());
}

}  // namespace txl_kernels
