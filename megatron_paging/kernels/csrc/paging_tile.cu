// The page-tile path: every CTA copies its tiles with 16-byte vector loads and stores (any row
// byte count, any alignment, either tier). The contract every path matches: kernels/reference.py.
// Also holds launch_copy, the one entry point that picks a path.

#include <cuda_runtime.h>

#include <cstdint>

#include "paging.h"
#include "paging_device.cuh"
#include "paging_launch.cuh"

namespace megatron_paging {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread before the stores
constexpr int64_t kTileBytes = int64_t{kThreads} * 16 * kUnroll;  // 16 KiB
// 4 x 256 threads per SM keep 64 KiB of loads in flight per SM.
constexpr int kMinCtasPerSm = 4;
static_assert(kThreads >= device::kPlanThreads, "the plan needs kPlanThreads threads");

template <bool kReload, int N>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    tile_kernel(const __grid_constant__ PagingArgs a, const __grid_constant__ Segments<N> seg) {
  device::wait_for_previous_kernel();
  const device::RingState state = device::read_state<kReload>(a);

  __shared__ Plan<N> plan;
  device::make_plan(a, seg, plan);
  const Decision d = device::decide<kReload>(a, plan, state);
  // Every read of what the commit writes is behind make_plan's barriers: arrive now, so that
  // the ticket's round trip overlaps the copies (paging_device.cuh, arrive()).
  const unsigned int arrived = device::arrive(a);

  if (d.active || d.zero_fill) {
    const int64_t tiles = plan.total_pages * a.tiles_per_page;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const device::Tile tile =
          device::resolve_tile<kReload>(a, seg, plan, d, t, threadIdx.x == 0);
      if (tile.bytes == 0) continue;
      const int n = static_cast<int>(tile.bytes);
      if constexpr (kReload) {
        if (d.active) {
          device::copy_range<kThreads, kUnroll>(tile.user, tile.paged, n);
        } else {
          device::zero_range(tile.user, n);
        }
      } else {
        device::copy_range<kThreads, kUnroll>(tile.paged, tile.user, n);
      }
    }
  }
  if constexpr (!kReload) device::zero_unfilled_slots(a, seg, plan, d);
  device::publish<kReload>(a, d, arrived);
}

template <bool kReload, int N>
cudaError_t launch_tile_with(const CopyLaunch& launch, cudaStream_t stream) {
  const PagingArgs args = device::make_args(launch, kTileBytes);
  const Segments<N> seg = device::make_segments<N>(launch.layout);
  int64_t resident = 0;
  const cudaError_t err = device::resident_ctas<tile_kernel<kReload, N>>(kThreads, 0, &resident);
  if (err != cudaSuccess) return err;
  const int64_t grid = device::grid_size(launch, args, kThreads, resident);
  return device::launch_after_previous<tile_kernel<kReload, N>>(grid, kThreads, 0, stream, args,
                                                                seg);
}

template <int N>
cudaError_t launch_tile_n(const CopyLaunch& launch, cudaStream_t stream) {
  return launch.reload ? launch_tile_with<true, N>(launch, stream)
                       : launch_tile_with<false, N>(launch, stream);
}

}  // namespace

cudaError_t launch_tile(const CopyLaunch& launch, cudaStream_t stream) {
  if (launch.layout.num_segments <= kFewSegments) {
    return launch_tile_n<kFewSegments>(launch, stream);
  }
  return launch_tile_n<kMaxSegments>(launch, stream);
}

cudaError_t launch_copy(const CopyLaunch& launch, cudaStream_t stream) {
  const int segments = launch.layout.num_segments;
  if (segments < 1 || segments > kMaxSegments) {
    return cudaErrorInvalidValue;
  }
  if (launch.path == CopyPath::kTile) return launch_tile(launch, stream);
  return launch_bulk(launch, stream);
}

}  // namespace megatron_paging
