// The experts' prob-weighted SwiGLU, forward and backward, each one pass over its tensors
// (semantics: weighted_swiglu.h). Unfused, torch runs this as about a dozen elementwise
// kernels with fp32 temporaries the size of the capacity buffer (the prob-weighted product is
// fp32); here the only tensors are the inputs and the outputs.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "weighted_swiglu.h"

namespace megatron_paging {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kWarp = 32;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// kElems values of T moved as one 16-byte access (kElems = 16 / sizeof(T)) or one at a time.
template <typename T, int kElems>
struct alignas(sizeof(T) * kElems) Pack {
  T v[kElems];
};

template <typename T, int kElems>
__device__ __forceinline__ Pack<T, kElems> load(const T* p) {
  return *reinterpret_cast<const Pack<T, kElems>*>(p);
}

template <typename T, int kElems>
__device__ __forceinline__ void store(T* p, const Pack<T, kElems>& pack) {
  *reinterpret_cast<Pack<T, kElems>*>(p) = pack;
}

// Both kernels compute s and a the same way, so the backward's inter is the forward's.
__device__ __forceinline__ float silu_of(float g, float e) { return g / (1.0f + e); }

template <typename T, typename P, int kElems>
__global__ void __launch_bounds__(kMaxThreads)
    swiglu_forward_kernel(const T* __restrict__ fc1, const P* __restrict__ probs,
                          T* __restrict__ inter, int64_t rows, int64_t cols) {
  const int64_t packs = cols / kElems;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float p = to_float(probs[row]);
    const T* gate = fc1 + row * 2 * cols;
    const T* linear = gate + cols;
    T* out = inter + row * cols;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const Pack<T, kElems> g = load<T, kElems>(gate + i * kElems);
      const Pack<T, kElems> l = load<T, kElems>(linear + i * kElems);
      Pack<T, kElems> o;
#pragma unroll
      for (int k = 0; k < kElems; ++k) {
        const float gf = to_float(g.v[k]);
        const float a = silu_of(gf, expf(-gf)) * to_float(l.v[k]);
        o.v[k] = from_float<T>(a * p);
      }
      store<T, kElems>(out + i * kElems, o);
    }
  }
}

// One CTA per row at a time: the row's dprobs is a CTA reduction in a fixed order. dfc1 may
// be fc1 and inter may be dinter (no __restrict__ on those four).
template <typename T, typename P, int kElems>
__global__ void __launch_bounds__(kMaxThreads)
    swiglu_backward_kernel(const T* fc1, const P* __restrict__ probs, const T* dinter, T* dfc1,
                           T* inter, P* __restrict__ dprobs, int64_t rows, int64_t cols) {
  __shared__ float warp_sums[kMaxThreads / kWarp];
  const int64_t packs = cols / kElems;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float p = to_float(probs[row]);
    const T* gate = fc1 + row * 2 * cols;
    const T* linear = gate + cols;
    const T* d_row = dinter + row * cols;
    T* dgate = dfc1 + row * 2 * cols;
    T* dlinear = dgate + cols;
    float dp = 0.0f;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      // All loads before any store: dfc1 may be fc1, inter may be dinter.
      const Pack<T, kElems> g = load<T, kElems>(gate + i * kElems);
      const Pack<T, kElems> l = load<T, kElems>(linear + i * kElems);
      const Pack<T, kElems> d = load<T, kElems>(d_row + i * kElems);
      Pack<T, kElems> dg, dl, o;
#pragma unroll
      for (int k = 0; k < kElems; ++k) {
        const float gf = to_float(g.v[k]);
        const float lf = to_float(l.v[k]);
        const float df = to_float(d.v[k]);
        const float e = expf(-gf);
        const float sig = 1.0f / (1.0f + e);
        const float s = silu_of(gf, e);
        const float a = s * lf;
        const float dpa = df * p;
        dp += df * a;
        dg.v[k] = from_float<T>(dpa * lf * (sig * (1.0f + gf * (1.0f - sig))));
        dl.v[k] = from_float<T>(dpa * s);
        o.v[k] = from_float<T>(a * p);
      }
      store<T, kElems>(dgate + i * kElems, dg);
      store<T, kElems>(dlinear + i * kElems, dl);
      if (inter != nullptr) store<T, kElems>(inter + row * cols + i * kElems, o);
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      dp += __shfl_xor_sync(0xffffffffu, dp, offset);
    }
    if (lane == 0) warp_sums[warp] = dp;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.0f;
      for (int w = 0; w < static_cast<int>(blockDim.x) / kWarp; ++w) total += warp_sums[w];
      dprobs[row] = from_float<P>(total);
    }
    __syncthreads();  // warp_sums is reused by the next row
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T, typename P, int kElems>
cudaError_t launch_typed(const SwigluLaunch& a, bool backward, cudaStream_t stream) {
  const int64_t packs = a.cols / kElems;
  // A whole number of warps (the reduction needs full warps), at most kMaxThreads.
  const int64_t threads = std::min<int64_t>(kMaxThreads, (packs + kWarp - 1) / kWarp * kWarp);
  const int64_t grid = std::min<int64_t>(a.rows, int64_t{1} << 30);
  const auto fc1 = static_cast<const T*>(a.fc1);
  const auto probs = static_cast<const P*>(a.probs);
  if (backward) {
    swiglu_backward_kernel<T, P, kElems><<<grid, threads, 0, stream>>>(
        fc1, probs, static_cast<const T*>(a.dinter), static_cast<T*>(a.out),
        static_cast<T*>(a.inter), static_cast<P*>(a.dprobs), a.rows, a.cols);
  } else {
    swiglu_forward_kernel<T, P, kElems><<<grid, threads, 0, stream>>>(
        fc1, probs, static_cast<T*>(a.out), a.rows, a.cols);
  }
  return cudaGetLastError();
}

template <typename T, typename P>
cudaError_t launch_vectorized(const SwigluLaunch& a, bool backward, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  // Rows start on 16-byte boundaries when cols is a multiple of kVec and the buffers are.
  const bool vec = a.cols % kVec == 0 && aligned16(a.fc1) && aligned16(a.out) &&
                   (!backward || (aligned16(a.dinter) && (a.inter == nullptr || aligned16(a.inter))));
  return vec ? launch_typed<T, P, kVec>(a, backward, stream)
             : launch_typed<T, P, 1>(a, backward, stream);
}

template <typename T>
cudaError_t launch_probs(const SwigluLaunch& a, bool backward, cudaStream_t stream) {
  switch (a.probs_dtype) {
    case ActDtype::kFloat32: return launch_vectorized<T, float>(a, backward, stream);
    case ActDtype::kBFloat16: return launch_vectorized<T, __nv_bfloat16>(a, backward, stream);
    case ActDtype::kFloat16: return launch_vectorized<T, __half>(a, backward, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_weighted_swiglu(const SwigluLaunch& launch, bool backward,
                                   cudaStream_t stream) {
  if (launch.rows == 0 || launch.cols == 0) return cudaSuccess;
  switch (launch.fc1_dtype) {
    case ActDtype::kFloat32: return launch_probs<float>(launch, backward, stream);
    case ActDtype::kBFloat16: return launch_probs<__nv_bfloat16>(launch, backward, stream);
    case ActDtype::kFloat16: return launch_probs<__half>(launch, backward, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace megatron_paging
