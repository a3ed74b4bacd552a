// The bulk-copy path (sm90+): one thread per CTA moves each tile with the copy engine,
// global -> shared (cp.async.bulk, completing on an mbarrier) then shared -> global (a bulk_group
// store), through a ring of shared-memory stages. Same plan, tile resolution, record/recycle
// writes and commit as the tile path (paging_tile.cu), so the same bytes land in the same places;
// semantics: kernels/reference.py.
//
// Why: the tile path needs 4 CTAs x 256 threads per SM issuing 16-byte loads to keep enough
// bytes in flight; here one thread keeps kLoadsAhead tiles of loads in flight, so one CTA
// per SM reaches the copy rate, and the other 255 threads only help with the plan (and, for a
// stash, the zeroing of unfilled record slots) and then exit, leaving
// issue slots to whatever compute kernel shares the SM.
//
// Tiles the copy engine may not take go through the cooperative copy of the tile path instead,
// decided per tile and uniformly across the CTA: host-tier pages (the PTX ISA promises nothing
// for bulk copies to mapped pinned memory, and the link, not the issue rate, bounds them), the
// zero fill of a reload that moves no pages, and any tile whose addresses or size are not
// multiples of 16 bytes (the host dispatch should never send one).

#include <cuda_runtime.h>

#include <cstdint>

#include "paging.h"
#include "paging_bulk_pipe.cuh"
#include "paging_device.cuh"
#include "paging_launch.cuh"

namespace megatron_paging {
namespace {

// The pipeline: 32 KiB tiles x 6 shared-memory stages (192 KiB of dynamic shared memory, + at
// most ~16.5 KiB static for the 1024-segment plan, under the 227 KiB a block may opt into: one
// CTA per SM), 4 loads in flight ahead of the oldest store (128 KiB per CTA). A 64-row page of a
// bf16 h7168 activation (896 KiB) is exactly 28 tiles. Smaller tiles with more stages, a deeper
// ring, a half-size ring and 64 KiB tiles measured no better across the regimes
// (docs/kernels.md).
struct BulkConfig {
  static constexpr int64_t kTileBytes = int64_t{32} * 1024;
  static constexpr int kStages = 6;
  // Loads issued ahead of the oldest store. The remaining stages give each store time to finish
  // reading shared memory before its stage is refilled.
  static constexpr int kLoadsAhead = 4;
  // Store groups that may still be reading shared memory when a stage is refilled: with
  // kLoadsAhead loads pending, the store of the tile that last used the stage is followed by
  // exactly this many younger stores (see BulkPipe::push).
  static constexpr int kStoresReading = kStages - kLoadsAhead - 1;
  static constexpr size_t kSmemBytes = size_t{kStages} * kTileBytes;
  static_assert(kLoadsAhead >= 1 && kLoadsAhead <= kStages - 1,
                "a stage must be free for the next load while kLoadsAhead loads are pending");
  static_assert(kStoresReading >= 0, "the stage count covers the loads ahead");
  static_assert(kTileBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
  static_assert(kTileBytes < (1 << 20), "an mbarrier transaction count is below 2^20 bytes");
};

// How a CTA finds its tiles, chosen per launch from its grid (adaptive_order): one contiguous
// range per CTA (consecutive tiles share a page id and both sides move in long runs), tiles
// interleaved across CTAs (tile t -> CTA t % grid: at any moment all CTAs work on neighbouring
// addresses, as a plain copy kernel's blocks do), or batches taken from a shared ticket (a CTA
// on a slower SM simply takes fewer, so all CTAs finish together).
enum class TileOrder { kContiguous, kInterleaved, kDynamic };

// Tiles a dynamic CTA takes per ticket: small enough that the last batches even out the CTAs'
// finishing times (4 x 32 KiB is ~5 us of one CTA's copy rate), large enough that consecutive
// tiles still share a page id load.
constexpr int kTicketTiles = 4;

// Measured per order (docs/kernels.md "Tile order"): with a few tiles per CTA the contiguous
// split is best (a ticket per batch costs more than it evens out: 224-byte rows); on up to 32
// CTAs the interleaved order (each batch's resolution is exposed at ~95 GB/s per CTA, the
// ticket loses there); otherwise the ticket.
constexpr int64_t kAdaptiveMinTilesPerCta = 8;
constexpr unsigned int kAdaptiveMaxInterleavedCtas = 32;

__device__ __forceinline__ TileOrder adaptive_order(int64_t tiles, bool has_ticket) {
  const int64_t per_cta = (tiles + gridDim.x - 1) / gridDim.x;
  if (per_cta < kAdaptiveMinTilesPerCta) return TileOrder::kContiguous;
  if (gridDim.x <= kAdaptiveMaxInterleavedCtas) return TileOrder::kInterleaved;
  return has_ticket ? TileOrder::kDynamic : TileOrder::kContiguous;
}

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // the cooperative fallback's loads in flight per thread

static_assert(kThreads >= device::kPlanThreads, "the plan needs kPlanThreads threads");

// The single-thread pipeline (paging_bulk_pipe.cuh).
using bulk::aligned16;
using Pipe = bulk::BulkPipe<BulkConfig>;
using Ring = bulk::BulkRing<BulkConfig>;

// A stash's tiles through warp 0: the user-side bytes are known from the plan alone, only the
// destination waits for the page id popped from the ring. So each batch's first kLoadsAhead
// loads go out before any page id is waited for, and each tile's destination is named
// kLoadsAhead loads later (just before the load that stores it): the page-id round trip overlaps
// the loads instead of preceding them. The page records are written last, since a store of a
// loaded id waits for it.
template <int N>
__device__ void walk_stash_tiles(const PagingArgs& a, const Segments<N>& seg, const Plan<N>& plan,
                                 const Decision& d, Pipe& pipe, int64_t begin, int64_t end,
                                 int64_t stride, int batch) {
  constexpr int kLag = BulkConfig::kLoadsAhead;
  const int lane = threadIdx.x & 31;
  for (int64_t base = begin; base < end; base += batch * stride) {
    const int64_t t = base + lane * stride;
    const bool mine = lane < batch && t < end;
    device::TilePlace place{0, 1, 0, 0, 0, nullptr};  // k = 1: writes no record
    int64_t page_id = 0;
    if (mine) {
      place = device::place_tile(a, seg, plan, t);
      page_id = device::popped_page(a, d, place.g);  // in flight until first named below
    }
    const int64_t left = (end - base + stride - 1) / stride;
    const int count = left < batch ? static_cast<int>(left) : batch;
    const auto my_user = reinterpret_cast<unsigned long long>(place.user);
    const auto my_bytes = static_cast<long long>(place.bytes);
    unsigned long long my_paged = 0;
    int named = 0;  // tiles of the batch whose destination is named (uniform across the warp)
    auto name_next = [&]() {
      if (named == 0) {
        // The first use of the page id: ordered after the loads issued so far. An unusable
        // id drops its tile after the load (nullptr: no store).
        const int64_t id = bulk::after_issue(page_id);
        my_paged = device::usable_page(a, d, id)
                       ? reinterpret_cast<unsigned long long>(
                             device::paged_address(a, d, id, place.lo))
                       : 0ull;
      }
      const unsigned long long paged = __shfl_sync(0xffffffffu, my_paged, named);
      const long long bytes = __shfl_sync(0xffffffffu, my_bytes, named);
      if (lane == 0 && bytes != 0) pipe.set_next_dst(reinterpret_cast<uint8_t*>(paged));
      ++named;
    };
    for (int j = 0; j < count; ++j) {
      if (j >= kLag) name_next();  // tile j - kLag: the load below may store it
      const unsigned long long user = __shfl_sync(0xffffffffu, my_user, j);
      const long long bytes = __shfl_sync(0xffffffffu, my_bytes, j);
      if (lane == 0 && bytes != 0) {
        pipe.load(reinterpret_cast<const uint8_t*>(user), static_cast<uint32_t>(bytes));
      }
    }
    while (named < count) name_next();
    if (mine && place.k == 0) a.page_record[place.slot] = page_id;
  }
}

// Warp 0 alone walks the CTA's tiles when every tile may use the copy engine: its 32 lanes
// resolve up to 32 tiles at once (their page-id loads in flight together, each lane writing its
// tile's page record / recycling its page), then lane 0 issues their bulk copies. Tiles are
// begin, begin + stride, ... below end; with stride 1 consecutive tiles mostly share a page, so
// the page-id loads of a batch mostly hit one address.
template <bool kReload, int N>
__device__ void walk_tiles_solo(const PagingArgs& a, const Segments<N>& seg, const Plan<N>& plan,
                                const Decision& d, Pipe& pipe, int64_t begin, int64_t end,
                                int64_t stride, int batch = 32) {
  if constexpr (!kReload) {
    walk_stash_tiles(a, seg, plan, d, pipe, begin, end, stride, batch);
    return;
  }
  const int lane = threadIdx.x & 31;
  for (int64_t base = begin; base < end; base += batch * stride) {
    device::Tile tile{nullptr, nullptr, 0};
    const int64_t t = base + lane * stride;
    if (lane < batch && t < end) {
      tile = device::resolve_tile<kReload>(a, seg, plan, d, t, true);
    }
    const int64_t left = (end - base + stride - 1) / stride;
    const int count = left < batch ? static_cast<int>(left) : batch;
    const auto my_user = reinterpret_cast<unsigned long long>(tile.user);
    const auto my_paged = reinterpret_cast<unsigned long long>(tile.paged);
    const auto my_bytes = static_cast<long long>(tile.bytes);
    for (int j = 0; j < count; ++j) {
      const unsigned long long user = __shfl_sync(0xffffffffu, my_user, j);
      const unsigned long long paged = __shfl_sync(0xffffffffu, my_paged, j);
      const long long bytes = __shfl_sync(0xffffffffu, my_bytes, j);
      if (lane != 0 || bytes == 0) continue;
      uint8_t* const u = reinterpret_cast<uint8_t*>(user);
      uint8_t* const p = reinterpret_cast<uint8_t*>(paged);
      pipe.push(kReload ? u : p, kReload ? p : u, static_cast<uint32_t>(bytes));
    }
  }
}

// The dynamic order: warp 0 takes kTicketTiles tiles at a time from the shared ticket, asking
// for the next batch before issuing the current one so the atomic's round trip overlaps the
// copies in flight. Every tile index is taken by exactly one CTA, so each page record is still
// written / each page recycled exactly once.
template <bool kReload, int N>
__device__ void walk_tiles_dynamic(const PagingArgs& a, const Segments<N>& seg,
                                   const Plan<N>& plan, const Decision& d, Pipe& pipe,
                                   int64_t tiles) {
  const int lane = threadIdx.x & 31;
  unsigned int* const ticket = a.pool.tile_ticket;
  // Every CTA takes tickets until one is past the last tile, so the launch takes exactly
  // ceil(tiles / kTicketTiles) + gridDim.x tickets. The CTA holding the last of them is the
  // last to read the ticket: it resets it to 0 for the next launch, with no wait on the others.
  const unsigned int last_ticket = static_cast<unsigned int>(
      ((tiles + kTicketTiles - 1) / kTicketTiles + gridDim.x - 1) * kTicketTiles);
  auto take = [&]() -> int64_t {
    unsigned int got = 0;
    if (lane == 0) {
      got = atomicAdd(ticket, static_cast<unsigned int>(kTicketTiles));
      if (got == last_ticket) *ticket = 0u;
    }
    return static_cast<int64_t>(__shfl_sync(0xffffffffu, got, 0));
  };
  int64_t next = take();
  while (next < tiles) {
    const int64_t base = next;
    next = take();
    const int64_t end = min(tiles, base + kTicketTiles);
    walk_tiles_solo<kReload>(a, seg, plan, d, pipe, base, end, 1, kTicketTiles);
  }
}

template <bool kReload, int N>
__global__ void __launch_bounds__(kThreads, 1)
    bulk_kernel(const __grid_constant__ PagingArgs a, const __grid_constant__ Segments<N> seg) {
  __shared__ Plan<N> plan;
  __shared__ Ring bulk_ring;
  extern __shared__ __align__(128) uint8_t bulk_stages[];

  const bool issuer = threadIdx.x == 0;
  Pipe pipe;
  // Before the plan: the barrier inside make_plan is not needed for the mbarriers (only this
  // thread uses them). Shared memory only, so it also goes before the wait for the previous
  // kernel, and overlaps that kernel's completion.
  if (issuer) pipe.init(&bulk_ring, bulk_stages);
  device::wait_for_previous_kernel();
  const device::RingState state = device::read_state<kReload>(a);

  device::make_plan(a, seg, plan);
  const Decision d = device::decide<kReload>(a, plan, state);

  // Uniform across the CTA (d is): whether tiles may use the copy engine at all. The stage base
  // is 128-byte aligned by declaration; checking it costs nothing and keeps a surprise there
  // from becoming a faulting bulk copy.
  const bool bulk_tier =
      MEGATRON_PAGING_BULK_ARCH && d.active && d.tier == 0 && aligned16(bulk_stages);
  // Launch-wide alignment implies every tile's alignment: a tile starts at user + row * rb + lo
  // and at pages + page_id * page_size * rb + lo, with lo a multiple of tile_bytes, and ends at
  // min(lo + tile_bytes, rows * rb); all multiples of 16 when the bases, rb and tile_bytes are.
  // Then warp 0 alone walks the tiles and the other threads skip straight to the stash's slot
  // zeroing and exit.
  const bool solo = bulk_tier && aligned16(a.user) && aligned16(a.pool.pages[d.tier]) &&
                    (a.pool.row_bytes & 15) == 0 && (a.tile_bytes & 15) == 0 &&
                    a.tile_bytes <= BulkConfig::kTileBytes;
  const int64_t tiles = plan.total_pages * a.tiles_per_page;
  // Arrive now, so that the arrival's round trip overlaps the copies (paging_device.cuh).
  const unsigned int arrived = device::arrive(a);

  if (solo) {
    // Uniform across the CTA: a pool whose counter has no ticket entry never takes the ticket.
    const bool has_ticket = a.pool.tile_ticket != nullptr && tiles < (int64_t{1} << 31);
    const TileOrder order = adaptive_order(tiles, has_ticket);
    if (threadIdx.x >= 32) {
      // Nothing to walk: straight to the slot zeroing.
    } else if (order == TileOrder::kInterleaved) {
      walk_tiles_solo<kReload>(a, seg, plan, d, pipe, blockIdx.x, tiles, gridDim.x);
    } else if (order == TileOrder::kDynamic) {
      walk_tiles_dynamic<kReload>(a, seg, plan, d, pipe, tiles);
    } else {
      // A contiguous range of tiles per CTA: consecutive tiles share pages (one page-id load
      // per page) and both sides are read and written in long sequential runs.
      const int64_t per_cta = (tiles + gridDim.x - 1) / gridDim.x;
      const int64_t begin = min(tiles, int64_t{blockIdx.x} * per_cta);
      walk_tiles_solo<kReload>(a, seg, plan, d, pipe, begin, min(tiles, begin + per_cta), 1);
    }
  } else if (d.active || d.zero_fill) {
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      // Every tile of this CTA goes through here exactly once per thread, so thread 0 writes
      // each page record / recycles each page exactly once, whatever moves the bytes.
      const device::Tile tile = device::resolve_tile<kReload>(a, seg, plan, d, t, issuer);
      if (tile.bytes == 0) continue;
      uint8_t* const dst = kReload ? tile.user : tile.paged;
      const uint8_t* const src = kReload ? tile.paged : tile.user;
      const bool bulk_ok = bulk_tier && aligned16(tile.user) && aligned16(tile.paged) &&
                           (tile.bytes & 15) == 0 && tile.bytes <= BulkConfig::kTileBytes;
      if (bulk_ok) {
        if (issuer) pipe.push(dst, src, static_cast<uint32_t>(tile.bytes));
        continue;
      }
      // Host tier, reload zero fill, unaligned tile: the whole CTA cooperates, exactly as the
      // tile path does. No CTA barrier is involved, so thread 0 being behind in its pipeline
      // only delays its own share.
      const int n = static_cast<int>(tile.bytes);
      if (kReload && !d.active) {
        device::zero_range(tile.user, n);
      } else {
        device::copy_range<kThreads, kUnroll>(dst, src, n);
      }
    }
  }
  if (issuer) pipe.drain();
  // The slot zeroing overlaps the last stores' writes; it touches only page_record.
  if constexpr (!kReload) device::zero_unfilled_slots(a, seg, plan, d);
  if (issuer) pipe.release();
  device::publish<kReload>(a, d, arrived);
}

// Raise the kernel's dynamic shared-memory limit once per device (the attribute belongs to the
// kernel's per-device module). Not a stream operation, so also legal under graph capture.
template <bool kReload, int N>
cudaError_t allow_bulk_smem(int device) {
  static device::PerDeviceCache done;  // 1: raised
  if (done.get(device)) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(
      bulk_kernel<kReload, N>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(BulkConfig::kSmemBytes));
  if (err == cudaSuccess) done.put(device, 1);
  return err;
}

template <bool kReload, int N>
cudaError_t launch_bulk_with(const CopyLaunch& launch, cudaStream_t stream) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (!bulk_supported(device)) return cudaErrorNotSupported;
  // Before the occupancy query: without the raised limit it would count 0 CTAs per SM.
  err = allow_bulk_smem<kReload, N>(device);
  if (err != cudaSuccess) return err;
  const PagingArgs args = device::make_args(launch, BulkConfig::kTileBytes);
  const Segments<N> seg = device::make_segments<N>(launch.layout);
  int64_t resident = 0;
  err = device::resident_ctas<bulk_kernel<kReload, N>>(kThreads, BulkConfig::kSmemBytes,
                                                       &resident);
  if (err != cudaSuccess) return err;
  const int64_t grid = device::grid_size(launch, args, kThreads, resident);
  return device::launch_after_previous<bulk_kernel<kReload, N>>(
      grid, kThreads, BulkConfig::kSmemBytes, stream, args, seg);
}

template <int N>
cudaError_t launch_bulk_n(const CopyLaunch& launch, cudaStream_t stream) {
  return launch.reload ? launch_bulk_with<true, N>(launch, stream)
                       : launch_bulk_with<false, N>(launch, stream);
}

}  // namespace

cudaError_t launch_bulk(const CopyLaunch& launch, cudaStream_t stream) {
  if (launch.layout.num_segments <= kFewSegments) {
    return launch_bulk_n<kFewSegments>(launch, stream);
  }
  return launch_bulk_n<kMaxSegments>(launch, stream);
}

bool bulk_supported(int device) {
  static device::PerDeviceCache cache;  // 1: no, 2: yes
  if (const int64_t answer = cache.get(device)) return answer == 2;
  // Compute capability alone is not enough: some sm_12x parts (and future small ones) let a
  // block opt into only ~99 KiB of shared memory, less than the stage ring needs; there the
  // answer is no and the caller keeps the tile path.
  int major = 0;
  int optin = 0;
  cudaFuncAttributes attr{};
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  // The largest static shared memory of the four instantiations (the 1024-segment plan).
  if (err == cudaSuccess) {
    err = cudaFuncGetAttributes(&attr, bulk_kernel<false, kMaxSegments>);
  }
  if (err != cudaSuccess) {
    // Not cached (the device may be usable later), and the error the query recorded is cleared
    // so that the next launch's cudaGetLastError, which reports that launch, does not return it.
    (void)cudaGetLastError();
    return false;
  }
  const bool ok =
      major >= 9 && attr.sharedSizeBytes + BulkConfig::kSmemBytes <= static_cast<size_t>(optin);
  cache.put(device, ok ? 2 : 1);
  return ok;
}

}  // namespace megatron_paging

#undef MEGATRON_PAGING_BULK_ARCH
