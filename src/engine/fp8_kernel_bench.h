// FP8 kernel figures for `relay bench --mode kernels`: the cuBLASLt FP8 ceiling, the block-scaled
// grouped GEMM at prefill (TFLOP/s) and decode (GB/s of weight bytes) shapes, the dense FP8 GEMM
// and the activation quantisers.
//
// Results are returned as JSON objects in the kernel mode's format ("mode": "kernel", "kernel",
// "shape", "variant", "ms", "tflops" / "gbps" and the matching "fraction_of_*"); the caller adds
// the run's device and ceilings and prints them. No CUDA types here.
#pragma once

#include <nlohmann/json.hpp>

#include <vector>

namespace relay {

// cuBLASLt e4m3 x e4m3 GEMM, 8192^3, per-tensor scales, bf16 output: the FP8 dense ceiling,
// TFLOP/s.
double measure_fp8_gemm_peak_tflops();

// copy_gbps: the run's device copy bandwidth (read + write); fp8_peak_tflops: the value of
// measure_fp8_gemm_peak_tflops(). quick: fewer shapes and repetitions.
std::vector<nlohmann::json> run_fp8_kernel_bench(double copy_gbps, double fp8_peak_tflops,
                                                 bool quick = false);

}  // namespace relay
