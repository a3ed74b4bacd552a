// Page-tile stash and reload kernels (DESIGN.md section 4; semantics: kernels/reference.py).
//
// A page holds page_size consecutive rows and a segment's live prefix is contiguous in the user
// buffer, so the live rows of one page slot are one contiguous byte range on both sides. A tile is
// (page slot, kTileBytes-sized byte range inside that page): the page id is resolved once per tile
// and only the tile at byte 0 of a page writes the page record (stash) or hands the page back to
// the ring (reload).
//
// One launch does everything: every CTA computes the same plan from read-only state (flags,
// freelist head/tail, live counts), copies its tiles (grid-stride), then the last CTA to finish
// (counted on a per-pool int32 in device memory, which it resets to 0) commits head/tail and
// flags. Nothing a CTA reads is written before every CTA has arrived, so no CTA sees a half-
// committed state, and no host read is needed: the launch is CUDA-graph capturable.
//
// This file includes no ATen headers so that it compiles quickly; paging_ops.cpp checks the
// tensors and calls the two launchers at the bottom.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace megatron_paging {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread before the stores
constexpr int64_t kTileBytes = int64_t{kThreads} * 16 * kUnroll;  // 16 KiB
// 4 x 256 threads per SM keep 64 KiB of loads in flight per SM, more than HBM3e needs.
constexpr int kMinCtasPerSm = 4;
// Segment tables travel by value as kernel parameters (no host->device copy, graph safe). Two
// sizes keep the common few-segment launch small; 1024 x 24 bytes stays under the 32 KiB limit.
constexpr int kFewSegments = 8;
constexpr int kMaxSegments = 1024;

template <int N>
struct Segments {
  int64_t start[N];        // first user-buffer row of each segment
  int64_t rows[N];         // static capacity rows of each segment
  int64_t slot_offset[N];  // first page_record slot of each segment
};

struct PagingArgs {
  uint8_t* user;          // stash: the source buffer; reload: the destination buffer
  uint8_t* pages[2];      // page storage per tier (the host tier through its mapped pointer)
  int64_t num_pages[2];   // pages per tier
  int64_t* ring[2];       // freelist ring per tier
  int64_t* head;          // [2], monotonically increasing pop counters
  int64_t* tail;          // [2], monotonically increasing push counters
  const int64_t* capacity;  // [2], ring capacity per tier
  const int64_t* live_rows;  // [num_segments]
  int64_t* page_record;   // [record_slots]
  int64_t record_slots;   // page_record.numel() (>= max_slots)
  int64_t max_slots;      // static slots: sum over segments of ceil(rows / page_size)
  int64_t* spilled_to_host;  // [1]
  int64_t* flags;         // [3]: overflow, host_spill, invalid_live
  unsigned int* done_counter;  // [1], 0 between launches
  int64_t page_size;
  int64_t row_bytes;
  int64_t tiles_per_page;
  int num_segments;
};

// Per-CTA copy of the launch plan. copy_rows is the live count clamped to [0, segment rows]:
// stash copies nothing when any count is invalid, while reload (like the reference) copies the
// clamped rows and recycles no pages.
template <int N>
struct Plan {
  int64_t copy_rows[N];
  int64_t page_prefix[N];  // exclusive prefix of ceil(copy_rows / page_size) in record order
  int64_t total_pages;
  int invalid;
};

template <int N>
__device__ void make_plan(const PagingArgs& a, const Segments<N>& seg, Plan<N>& plan) {
  __shared__ int64_t warp_sums[kThreads / 32];
  const int64_t ps = a.page_size;
  const int per_thread = (a.num_segments + kThreads - 1) / kThreads;
  const int first = threadIdx.x * per_thread;
  const int last = min(a.num_segments, first + per_thread);
  int64_t my_pages = 0;
  int bad = 0;
  for (int s = first; s < last; ++s) {
    const int64_t live = a.live_rows[s];
    bad |= (live < 0) | (live > seg.rows[s]);
    const int64_t rows = min(max(live, int64_t{0}), seg.rows[s]);
    plan.copy_rows[s] = rows;
    my_pages += (rows + ps - 1) / ps;
  }
  // Block-wide exclusive scan of my_pages: warp shuffles, then the warp totals.
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int64_t inclusive = my_pages;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  const int any_bad = __syncthreads_or(bad);
  int64_t before = 0;
  int64_t total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    const int64_t v = warp_sums[w];
    before += (w < warp) ? v : 0;
    total += v;
  }
  int64_t running = before + inclusive - my_pages;
  for (int s = first; s < last; ++s) {
    plan.page_prefix[s] = running;
    running += (plan.copy_rows[s] + ps - 1) / ps;
  }
  if (threadIdx.x == 0) {
    plan.total_pages = total;
    plan.invalid = any_bad;
  }
  __syncthreads();
}

// Last index s in [0, n) with keys[s] <= x, for non-decreasing keys with keys[0] <= x. Empty
// segments share their key with the next one, so "last" lands on the segment that owns x.
__device__ __forceinline__ int last_at_or_below(const int64_t* keys, int n, int64_t x) {
  int lo = 0;
  int hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (keys[mid] <= x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Indices are 32-bit: a tile is at most kTileBytes long (the 64-bit part is the tile's base).
template <typename Word>
__device__ __forceinline__ void copy_words(Word* __restrict__ dst, const Word* __restrict__ src,
                                           int n) {
  for (int base = threadIdx.x; base < n; base += kUnroll * kThreads) {
    Word v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kThreads < n) v[u] = src[base + u * kThreads];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kThreads < n) dst[base + u * kThreads] = v[u];
    }
  }
}

// CTA-cooperative copy of n bytes. The word width is the widest power of two (<= 16) that
// divides the distance between the two pointers; leading bytes up to the destination's word
// alignment and the trailing remainder go byte by byte, so any row byte count and any base
// offset work, and nothing outside [dst, dst + n) is written.
__device__ __forceinline__ void copy_range(uint8_t* dst, const uint8_t* src, int n) {
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
  const unsigned rel = static_cast<unsigned>((reinterpret_cast<uintptr_t>(src) - d) & 15u);
  const int w = rel == 0 ? 16 : (rel & 7u) == 0 ? 8 : (rel & 3u) == 0 ? 4 : (rel & 1u) == 0 ? 2 : 1;
  const int lead = min(n, static_cast<int>((w - (d & (w - 1))) & (w - 1)));
  if (static_cast<int>(threadIdx.x) < lead) dst[threadIdx.x] = src[threadIdx.x];
  const int words = (n - lead) / w;
  uint8_t* dst_body = dst + lead;
  const uint8_t* src_body = src + lead;
  switch (w) {
    case 16:
      copy_words(reinterpret_cast<uint4*>(dst_body), reinterpret_cast<const uint4*>(src_body),
                 words);
      break;
    case 8:
      copy_words(reinterpret_cast<uint2*>(dst_body), reinterpret_cast<const uint2*>(src_body),
                 words);
      break;
    case 4:
      copy_words(reinterpret_cast<uint32_t*>(dst_body),
                 reinterpret_cast<const uint32_t*>(src_body), words);
      break;
    case 2:
      copy_words(reinterpret_cast<uint16_t*>(dst_body),
                 reinterpret_cast<const uint16_t*>(src_body), words);
      break;
    default:
      copy_words(dst_body, src_body, words);
      break;
  }
  const int done = lead + words * w;
  if (static_cast<int>(threadIdx.x) < n - done) dst[done + threadIdx.x] = src[done + threadIdx.x];
}

// CTA-cooperative zeroing of n bytes (16-byte stores between byte-wise edges).
__device__ __forceinline__ void zero_range(uint8_t* dst, int n) {
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
  const int lead = min(n, static_cast<int>((16u - (d & 15u)) & 15u));
  if (static_cast<int>(threadIdx.x) < lead) dst[threadIdx.x] = 0;
  const int words = (n - lead) / 16;
  uint4* body = reinterpret_cast<uint4*>(dst + lead);
  for (int i = threadIdx.x; i < words; i += kThreads) body[i] = make_uint4(0u, 0u, 0u, 0u);
  const int done = lead + words * 16;
  if (static_cast<int>(threadIdx.x) < n - done) dst[done + threadIdx.x] = 0;
}

template <bool kReload, int N>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    paging_kernel(const __grid_constant__ PagingArgs a, const __grid_constant__ Segments<N> seg) {
  // Metadata loads go first so that their latency overlaps the live-count loads of the plan.
  const int64_t overflow = a.flags[0];
  const int64_t head0 = a.head[0];
  const int64_t head1 = a.head[1];
  const int64_t tail0 = a.tail[0];
  const int64_t tail1 = a.tail[1];
  const int64_t spilled = kReload ? a.spilled_to_host[0] : 0;

  __shared__ Plan<N> plan;
  make_plan(a, seg, plan);
  const bool invalid = plan.invalid != 0;
  // Pages popped (stash) or pushed (reload): none when a live count is invalid.
  const int64_t ring_pages = invalid ? 0 : plan.total_pages;
  const bool has_host = a.num_pages[1] > 0;

  int tier = 0;
  bool active = false;
  bool use_host = false;
  bool new_overflow = false;
  int64_t ring_start = 0;
  if constexpr (!kReload) {
    const bool ok = overflow == 0 && !invalid;
    const bool use_cuda = ok && tail0 - head0 >= ring_pages;
    use_host = ok && !use_cuda && has_host && tail1 - head1 >= ring_pages;
    new_overflow = (overflow == 0 && !use_cuda && !use_host) || invalid;
    active = use_cuda || use_host;
    tier = use_host ? 1 : 0;
    ring_start = use_host ? head1 : head0;
  } else {
    const bool from_host = spilled == 1;
    active = overflow == 0 && (!from_host || has_host);
    tier = from_host ? 1 : 0;
    ring_start = from_host ? tail1 : tail0;
  }

  // After an overflow the step is discarded, but its backward still runs: a reload zeroes its
  // live rows so that uninitialized memory (NaN) never reaches Megatron's gradient NaN check.
  const bool zero_fill = kReload && overflow != 0;
  if (active || zero_fill) {
    const int64_t ps = a.page_size;
    const int64_t rb = a.row_bytes;
    const int64_t cap = max(a.capacity[tier], int64_t{1});
    const int64_t tiles = plan.total_pages * a.tiles_per_page;
    uint8_t* const pages = a.pages[tier];
    int64_t* const ring = a.ring[tier];
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const int64_t g = t / a.tiles_per_page;  // page index in record order
      const int64_t k = t - g * a.tiles_per_page;
      const int s = last_at_or_below(plan.page_prefix, a.num_segments, g);
      const int64_t j = g - plan.page_prefix[s];
      const int64_t slot = seg.slot_offset[s] + j;
      int64_t page_id = 0;
      if constexpr (!kReload) {
        page_id = ring[(ring_start + g) % cap];
        if (k == 0 && threadIdx.x == 0) a.page_record[slot] = page_id;
      } else if (active) {
        page_id = a.page_record[slot];
        if (k == 0 && threadIdx.x == 0 && !invalid) ring[(ring_start + g) % cap] = page_id;
      }
      // A corrupt ring or record must not turn into a wild write.
      if (active && (page_id < 0 || page_id >= a.num_pages[tier])) continue;
      const int64_t rows_here = min(ps, plan.copy_rows[s] - j * ps);
      const int64_t lo = k * kTileBytes;
      const int64_t hi = min(lo + kTileBytes, rows_here * rb);
      if (lo >= hi) continue;
      uint8_t* user = a.user + (seg.start[s] + j * ps) * rb + lo;
      uint8_t* paged = pages + page_id * ps * rb + lo;
      const int n = static_cast<int>(hi - lo);
      if constexpr (kReload) {
        if (active) {
          copy_range(user, paged, n);
        } else {
          zero_range(user, n);
        }
      } else {
        copy_range(paged, user, n);
      }
    }
  }

  if constexpr (!kReload) {
    // page_record slots that received no page hold 0 (the tiles above wrote the others).
    const int64_t stride = int64_t{gridDim.x} * kThreads;
    for (int64_t q = int64_t{blockIdx.x} * kThreads + threadIdx.x; q < a.record_slots;
         q += stride) {
      bool filled = false;
      if (active && q < a.max_slots) {
        const int s = last_at_or_below(seg.slot_offset, a.num_segments, q);
        filled = q - seg.slot_offset[s] < (plan.copy_rows[s] + a.page_size - 1) / a.page_size;
      }
      if (!filled) a.page_record[q] = 0;
    }
  }

  // Commit: the last CTA to arrive publishes the new ring counter and flags.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned int arrived = atomicAdd(a.done_counter, 1u);
    if (arrived == gridDim.x - 1) {
      if constexpr (!kReload) {
        if (active) a.head[tier] = ring_start + ring_pages;
        a.spilled_to_host[0] = (use_host || new_overflow) ? 1 : 0;
        // Atomic: the flags are shared by every pool of a paging context.
        auto* flags = reinterpret_cast<unsigned long long*>(a.flags);
        if (new_overflow) atomicOr(flags + 0, 1ull);
        if (use_host) atomicOr(flags + 1, 1ull);
        if (invalid) atomicOr(flags + 2, 1ull);
      } else {
        if (active) a.tail[tier] = ring_start + ring_pages;
      }
      *a.done_counter = 0u;
    }
  }
}

template <int N>
cudaError_t launch_with(bool reload, const PagingArgs& args, const int64_t* segment_starts,
                        const int64_t* segment_rows, const int64_t* slot_offsets, int max_ctas,
                        cudaStream_t stream) {
  Segments<N> seg{};
  for (int s = 0; s < args.num_segments; ++s) {
    seg.start[s] = segment_starts[s];
    seg.rows[s] = segment_rows[s];
    seg.slot_offset[s] = slot_offsets[s];
  }
  auto kernel = reload ? paging_kernel<true, N> : paging_kernel<false, N>;
  // The grid never exceeds max_ctas, the tiles a full record could need, or what fits on the
  // device at once (a persistent grid: more CTAs would only queue behind the resident ones).
  int device = 0;
  int sms = 0;
  int per_sm = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  }
  if (err != cudaSuccess) return err;
  const int64_t zero_blocks = reload ? 0 : (args.record_slots + kThreads - 1) / kThreads;
  const int64_t work = std::max(args.max_slots * args.tiles_per_page, zero_blocks);
  const int64_t resident = std::max<int64_t>(int64_t{sms} * per_sm, 1);
  const int64_t grid =
      std::max<int64_t>(1, std::min({int64_t{max_ctas}, work, resident}));
  kernel<<<static_cast<unsigned int>(grid), kThreads, 0, stream>>>(args, seg);
  return cudaGetLastError();
}

cudaError_t launch(bool reload, PagingArgs args, const int64_t* segment_starts,
                   const int64_t* segment_rows, const int64_t* slot_offsets, int max_ctas,
                   cudaStream_t stream) {
  if (args.num_segments < 1 || args.num_segments > kMaxSegments || max_ctas < 1) {
    return cudaErrorInvalidValue;
  }
  const int64_t page_bytes = args.page_size * args.row_bytes;
  args.tiles_per_page = (page_bytes + kTileBytes - 1) / kTileBytes;
  args.max_slots = 0;
  for (int s = 0; s < args.num_segments; ++s) {
    args.max_slots += (segment_rows[s] + args.page_size - 1) / args.page_size;
  }
  if (args.num_segments <= kFewSegments) {
    return launch_with<kFewSegments>(reload, args, segment_starts, segment_rows, slot_offsets,
                                     max_ctas, stream);
  }
  return launch_with<kMaxSegments>(reload, args, segment_starts, segment_rows, slot_offsets,
                                   max_ctas, stream);
}

}  // namespace

int max_segments() { return kMaxSegments; }

// Pointer arguments are device pointers (host_pages: the mapped device pointer of pinned host
// memory, or null without a host tier); segment arrays are host arrays of num_segments entries.
// Stash and reload take the same metadata; only the direction of the payload copy differs
// (stash reads `user` and writes `pages`, reload the reverse; the kernel never writes
// through the side it reads), so one entry point serves both.
cudaError_t launch_copy(bool reload, uint8_t* user, uint8_t* cuda_pages, uint8_t* host_pages,
                        int64_t num_cuda_pages, int64_t num_host_pages,
                        const int64_t* live_rows, int64_t* free_list_cuda,
                        int64_t* free_list_host, int64_t* free_list_head,
                        int64_t* free_list_tail, const int64_t* free_list_capacity,
                        int64_t* page_record, int64_t record_slots, int64_t* spilled_to_host,
                        int64_t* flags, unsigned int* done_counter,
                        const int64_t* segment_starts, const int64_t* segment_rows,
                        const int64_t* slot_offsets, int num_segments, int64_t page_size,
                        int64_t row_bytes, int max_ctas, cudaStream_t stream) {
  PagingArgs args{};
  args.user = user;
  args.pages[0] = cuda_pages;
  args.pages[1] = host_pages;
  args.num_pages[0] = num_cuda_pages;
  args.num_pages[1] = num_host_pages;
  args.ring[0] = free_list_cuda;
  args.ring[1] = free_list_host;
  args.head = free_list_head;
  args.tail = free_list_tail;
  args.capacity = free_list_capacity;
  args.live_rows = live_rows;
  args.page_record = page_record;
  args.record_slots = record_slots;
  args.spilled_to_host = spilled_to_host;
  args.flags = flags;
  args.done_counter = done_counter;
  args.page_size = page_size;
  args.row_bytes = row_bytes;
  args.num_segments = num_segments;
  return launch(reload, args, segment_starts, segment_rows, slot_offsets, max_ctas, stream);
}

}  // namespace megatron_paging
