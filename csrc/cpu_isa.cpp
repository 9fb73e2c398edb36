// The choice of the CPU row code's ISA variant (cpu_isa.h) and its ops:
//   txl_kernels::cpu_isa() -> str                  "avx512", "avx2" or "default": the variant
//                                                  that runs
//   txl_kernels::cpu_isa_supported() -> str[]      the variants this CPU and build can run
//   txl_kernels::cpu_isa_override(str isa) -> str  tests: force a variant ("" restores ATen's
//                                                  choice); returns the one now in use
#include "cpu_isa.h"

#include <ATen/Version.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include "cpu_simd.h"

#include <string>
#include <vector>

namespace txl_kernels {

std::atomic<int> g_cpu_isa{-1};

namespace {

constexpr const char* kNames[] = {"default", "avx2", "avx512"};

// Whether the CPU has every feature the variant was compiled for (TXL_AVX2_TARGET /
// TXL_AVX512_TARGET). ATen checks fewer (AVX2 + FMA; AVX512 VL, BW, DQ + FMA), which every
// CPU with them also has; this guards the rest.
bool cpu_runs(CpuIsa isa) {
  if (isa == CpuIsa::kDefault) return true;
#if TXL_ISA_VARIANTS
  __builtin_cpu_init();
#if __GNUC__ >= 12
  return isa == CpuIsa::kAvx2 ? __builtin_cpu_supports("x86-64-v3")
                              : __builtin_cpu_supports("x86-64-v4");
#else
  const bool avx2 = __builtin_cpu_supports("avx2");
  return isa == CpuIsa::kAvx2
             ? avx2
             : avx2 && __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#endif
#else
  return false;
#endif
}

// ATen's choice ("DEFAULT", "AVX2", "AVX512"; other CPUs' names map to the baseline), stepped
// down to a variant the CPU runs.
int aten_choice() {
  const std::string cap = at::get_cpu_capability();
  int isa = cap == "AVX512" ? 2 : cap == "AVX2" ? 1 : 0;
  while (isa > 0 && !cpu_runs(static_cast<CpuIsa>(isa))) --isa;
  return isa;
}

int aten_choice_once() {
  static const int choice = aten_choice();  // once per process (thread-safe initialisation)
  return choice;
}

std::string cpu_isa_op() { return kNames[static_cast<int>(cpu_isa())]; }

std::vector<std::string> cpu_isa_supported_op() {
  std::vector<std::string> out;
  for (int i = 0; i < 3; ++i)
    if (cpu_runs(static_cast<CpuIsa>(i))) out.emplace_back(kNames[i]);
  return out;
}

std::string cpu_isa_override_op(const std::string& isa) {
  if (isa.empty()) {
    g_cpu_isa.store(aten_choice_once(), std::memory_order_relaxed);
    return cpu_isa_op();
  }
  int want = -1;
  for (int i = 0; i < 3; ++i)
    if (isa == kNames[i]) want = i;
  TORCH_CHECK_VALUE(want >= 0, "cpu_isa_override: isa must be \"avx512\", \"avx2\", \"default\" "
                    "or \"\" (ATen's choice), got \"", isa, "\"");
  TORCH_CHECK_VALUE(cpu_runs(static_cast<CpuIsa>(want)), "cpu_isa_override: isa \"", isa,
                    "\" cannot run here (this CPU and build run: ",
                    c10::Join(", ", cpu_isa_supported_op()), ")");
  g_cpu_isa.store(want, std::memory_order_relaxed);
  return cpu_isa_op();
}

}  // namespace

int init_cpu_isa() {
  int expected = -1;
  g_cpu_isa.compare_exchange_strong(expected, aten_choice_once(), std::memory_order_relaxed);
  return g_cpu_isa.load(std::memory_order_relaxed);
}

TORCH_LIBRARY_FRAGMENT(txl_kernels, m) {
  m.def("cpu_isa() -> str", &cpu_isa_op);
  m.def("cpu_isa_supported() -> str[]", &cpu_isa_supported_op);
  m.def("cpu_isa_override(str isa) -> str", &cpu_isa_override_op);
}

}  // namespace txl_kernels
