// Host side of a launch, shared by both copy paths (paging_tile.cu, paging_bulk.cu): the kernel
// parameter blocks, the grid, the occupancy query it is bounded by, and the launch itself.

#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "paging.h"
#include "paging_device.cuh"

namespace megatron_paging {
namespace device {

// One answer per device to a question asked of CUDA once (an occupancy, an attribute): 0 means
// not asked yet. Held in a function's static (zero-initialised); relaxed atomics, since two
// threads racing at most both ask and store the same answer. Devices past kDevices ask every time.
class PerDeviceCache {
 public:
  static constexpr int kDevices = 64;
  int64_t get(int device) const {
    return cacheable(device) ? slots_[device].load(std::memory_order_relaxed) : 0;
  }
  void put(int device, int64_t answer) {
    if (cacheable(device)) slots_[device].store(answer, std::memory_order_relaxed);
  }

 private:
  static bool cacheable(int device) { return device >= 0 && device < kDevices; }
  std::atomic<int64_t> slots_[kDevices];
};

inline PagingArgs make_args(const CopyLaunch& launch, int64_t tile_bytes) {
  PagingArgs args{};
  args.user = launch.user;
  args.live_rows = launch.live_rows;
  args.page_record = launch.page_record;
  args.record_slots = launch.record_slots;
  args.max_slots = launch.layout.max_slots;
  args.spilled_to_host = launch.spilled_to_host;
  args.record_state = launch.record_state;
  args.pool = launch.pool;
  const int64_t page_bytes = launch.pool.page_size * launch.pool.row_bytes;
  args.tile_bytes = std::min(tile_bytes, page_bytes);
  args.tiles_per_page = (page_bytes + args.tile_bytes - 1) / args.tile_bytes;
  args.num_segments = launch.layout.num_segments;
  return args;
}

template <int N>
Segments<N> make_segments(const LayoutView& layout) {
  Segments<N> seg{};
  for (int s = 0; s < layout.num_segments; ++s) {
    seg.start[s] = layout.start[s];
    seg.rows[s] = layout.rows[s];
    seg.slot_offset[s] = layout.slot_offset[s];
  }
  return seg;
}

// CTAs that fit on the device at once for kKernel (cached per kernel and device: the occupancy
// query costs microseconds and every launch needs it). Keyed on the kernel itself, not its type:
// every kernel of both paths has the same type. A persistent grid: more CTAs would only queue
// behind the resident ones.
template <auto kKernel>
cudaError_t resident_ctas(int threads, size_t smem, int64_t* out) {
  static PerDeviceCache cache;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if ((*out = cache.get(device)) > 0) return cudaSuccess;
  int sms = 0;
  int per_sm = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, smem);
  }
  if (err != cudaSuccess) return err;
  *out = std::max<int64_t>(int64_t{sms} * per_sm, 1);
  cache.put(device, *out);
  return cudaSuccess;
}

// The grid never exceeds max_ctas, the tiles a full record could need (or, for a stash, the
// blocks that zero its page record), or what fits on the device at once.
inline int64_t grid_size(const CopyLaunch& launch, const PagingArgs& args, int threads,
                         int64_t resident) {
  const int64_t zero_blocks = launch.reload ? 0 : (args.record_slots + threads - 1) / threads;
  const int64_t work = std::max(args.max_slots * args.tiles_per_page, zero_blocks);
  return std::max<int64_t>(1, std::min({int64_t{launch.max_ctas}, work, resident}));
}

// Whether kKernel as loaded on `device` may be launched as a programmatic dependent: its code
// must have been compiled for sm_90 or newer (a build for an older arch leaves
// wait_for_previous_kernel empty, and its kernels must then wait the ordinary way) and run on
// such a device. Cached per kernel and device, like resident_ctas.
template <auto kKernel>
cudaError_t programmatic_launch_ok(int device, bool* out) {
  static PerDeviceCache cache;  // 1: no, 2: yes
  if (const int64_t answer = cache.get(device)) {
    *out = answer == 2;
    return cudaSuccess;
  }
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, kKernel);
  if (err != cudaSuccess) return err;
  *out = attr.ptxVersion >= 90 && attr.binaryVersion >= 90;
  cache.put(device, *out ? 2 : 1);
  return cudaSuccess;
}

// kKernel<<<grid, threads, smem, stream>>>(params...), as a programmatic dependent of the
// previous kernel on the stream (see wait_for_previous_kernel). A kernel that does not trigger
// its dependents early (none of ours does) lets them launch once all its CTAs have exited: the
// overlap is the launch and start of our CTAs against that kernel's completion (its memory flush
// and the launch latency between two kernels). Under stream capture the dependency becomes a
// programmatic graph edge (sm90, CUDA 12.3+), so a replay overlaps the same way.
template <auto kKernel, typename... Params>
cudaError_t launch_after_previous(int64_t grid, int threads, size_t smem, cudaStream_t stream,
                                  const Params&... params) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  bool programmatic = false;
  err = programmatic_launch_ok<kKernel>(device, &programmatic);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned int>(grid));
  config.blockDim = dim3(static_cast<unsigned int>(threads));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = programmatic ? 1 : 0;
  err = cudaLaunchKernelEx(&config, kKernel, params...);
  // Also clears what a failed launch recorded, so that the next launch's check reports that one.
  const cudaError_t last = cudaGetLastError();
  return err != cudaSuccess ? err : last;
}

}  // namespace device
}  // namespace megatron_paging
