// The fused prob-weighted SwiGLU of the experts (weighted_swiglu.cu), shared by its ATen side
// (weighted_swiglu_ops.cpp) and its device side. No ATen here, so the .cu compiles without
// torch headers.
//
// fc1 is [rows, 2 * cols] (gate half, then linear half, as torch.chunk splits it), probs [rows].
// Math: fp32 throughout from the stored inputs, one rounding per output (the semantics of
// Megatron-Core's fused weighted_bias_swiglu, without its bias):
//   s = g / (1 + exp(-g)),  a = s * l,  inter = a * p
//   dg = d * p * l * sig * (1 + g * (1 - sig)),  dl = d * p * s,  dprobs = sum_j d_j * a_j
// with sig = 1 / (1 + exp(-g)) and d = dinter. Each row's dprobs sums in a fixed order (per
// thread in column order, then a fixed tree), so results do not depend on the run.

#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megatron_paging {

enum class ActDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct SwigluLaunch {
  ActDtype fc1_dtype;    // fc1, dinter, dfc1 and inter share it
  ActDtype probs_dtype;  // probs and dprobs share it
  const void* fc1;
  const void* probs;
  const void* dinter;    // backward only
  void* out;             // forward: inter [rows, cols]; backward: dfc1 [rows, 2 * cols]
  void* inter;           // backward: inter as well (for fc2's weight gradient), or null
  void* dprobs;          // backward only
  int64_t rows;
  int64_t cols;
};

// dfc1 may be fc1 itself and inter dinter itself (each element is read before it is written,
// by the same thread).
cudaError_t launch_weighted_swiglu(const SwigluLaunch& launch, bool backward,
                                   cudaStream_t stream);

}  // namespace megatron_paging
