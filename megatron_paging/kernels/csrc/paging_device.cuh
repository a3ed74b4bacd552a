// Device-side pieces shared by both copy paths (paging_tile.cu, paging_bulk.cu); their host side
// (parameter blocks, grid) is paging_launch.cuh.
//
// A page holds page_size consecutive rows and a segment's live prefix is contiguous in the user
// buffer, so the live rows of one page slot are one contiguous byte range on both sides. A tile is
// (page slot, byte range inside that page): the page id is resolved once per tile and only the
// tile at byte 0 of a page writes the page record (stash) or hands the page back to the ring
// (reload).
//
// One launch does everything: every CTA computes the same plan from read-only state (flags,
// freelist head/tail, live counts, the record's state word), copies its tiles (grid-stride),
// then the last CTA to finish (counted on a per-pool int32 in device memory, which it resets to
// 0) commits head/tail, the record's state word and flags. Nothing a CTA reads is written before
// every CTA has arrived, so no CTA sees a half-committed state, and no host read is needed: the
// launch is CUDA-graph capturable.

#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "paging.h"

namespace megatron_paging {
namespace device {

constexpr int kPlanThreads = 256;  // threads that compute the plan (every kernel has >= this many)

template <int N>
struct Segments {
  int64_t start[N];        // first user-buffer row of each segment
  int64_t rows[N];         // static capacity rows of each segment
  int64_t slot_offset[N];  // first page_record slot of each segment
};

// The kernel parameter block: a CopyLaunch with the host arrays moved into Segments<N>.
struct PagingArgs {
  uint8_t* user;
  const int64_t* live_rows;
  int64_t* page_record;
  int64_t record_slots;
  int64_t max_slots;
  int64_t* spilled_to_host;
  int64_t* record_state;
  PoolView pool;
  int64_t tile_bytes;      // bytes per tile (the path's tile size, at most one page)
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

// What every CTA decided from the plan and the ring/flag state read at launch.
struct Decision {
  int tier;            // 0 = device tier, 1 = host tier
  bool active;         // pages move (stash: a tier has room; reload: the record holds pages)
  bool use_host;       // stash: the record spills to the host tier
  bool new_overflow;   // stash: this launch sets the overflow flag
  bool after_overflow;  // stash: the flag is set once this launch commits (it or one before)
  bool zero_fill;      // reload that moves no pages (overflow, invalid reload): zero live rows
  bool invalid;        // a live count was outside [0, segment rows]
  bool invalid_reload;  // reload without an overflow of a record that holds no pages
  int64_t ring_start;  // first ring position popped (stash) or pushed (reload)
  int64_t ring_pages;  // pages popped or pushed
};

// One tile, resolved: where its bytes are on both sides.
struct Tile {
  uint8_t* user;
  uint8_t* paged;
  int64_t bytes;  // 0: nothing to move for this tile
};

// Every copy kernel is launched as a programmatic dependent of the previous kernel on its stream
// (paging_launch.cuh), so that its CTAs are placed and started while that kernel drains instead of
// after it. Nothing may touch global memory before this returns: it returns once that kernel has
// completed and its writes are visible. Only kernel parameters and shared memory come before it.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <int N>
__device__ void make_plan(const PagingArgs& a, const Segments<N>& seg, Plan<N>& plan) {
  __shared__ int64_t warp_sums[kPlanThreads / 32];
  const int64_t ps = a.pool.page_size;
  const bool planner = threadIdx.x < kPlanThreads;
  const int per_thread = (a.num_segments + kPlanThreads - 1) / kPlanThreads;
  const int first = planner ? threadIdx.x * per_thread : a.num_segments;
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
  // Block-wide exclusive scan of my_pages over the planner threads: warp shuffles, then the
  // warp totals. Threads past kPlanThreads take part in the barriers only.
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int64_t inclusive = my_pages;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (planner && lane == 31) warp_sums[warp] = inclusive;
  const int any_bad = __syncthreads_or(bad);
  if (planner) {
    int64_t before = 0;
    int64_t total = 0;
#pragma unroll
    for (int w = 0; w < kPlanThreads / 32; ++w) {
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
  }
  __syncthreads();
}

// The ring and flag state a launch decides from. Read first thing in every kernel, so that the
// loads' latency overlaps the live-count loads of the plan; nothing writes it before publish().
struct RingState {
  int64_t overflow;
  int64_t head[2];
  int64_t tail[2];
  int64_t spilled;       // reload: the record's spilled_to_host
  int64_t record_state;  // reload: the record's state word
};

template <bool kReload>
__device__ __forceinline__ RingState read_state(const PagingArgs& a) {
  return RingState{a.pool.flags[0],
                   {a.pool.head[0], a.pool.head[1]},
                   {a.pool.tail[0], a.pool.tail[1]},
                   kReload ? a.spilled_to_host[0] : 0,
                   kReload ? a.record_state[0] : kRecordEmpty};
}

// Where the record goes (stash) or comes from (reload), from state read before any write.
template <bool kReload, int N>
__device__ Decision decide(const PagingArgs& a, const Plan<N>& plan, const RingState& r) {
  const int64_t overflow = r.overflow;
  const int64_t* const head = r.head;
  const int64_t* const tail = r.tail;
  const int64_t spilled = r.spilled;
  Decision d{};
  d.invalid = plan.invalid != 0;
  // Pages popped (stash) or pushed (reload): none when a live count is invalid.
  d.ring_pages = d.invalid ? 0 : plan.total_pages;
  const bool has_host = a.pool.num_pages[1] > 0;
  if constexpr (!kReload) {
    const bool ok = overflow == 0 && !d.invalid;
    const bool use_cuda = ok && tail[0] - head[0] >= d.ring_pages;
    d.use_host = ok && !use_cuda && has_host && tail[1] - head[1] >= d.ring_pages;
    d.new_overflow = (overflow == 0 && !use_cuda && !d.use_host) || d.invalid;
    d.after_overflow = overflow != 0 || d.new_overflow;
    d.active = use_cuda || d.use_host;
    d.tier = d.use_host ? 1 : 0;
    d.ring_start = d.use_host ? head[1] : head[0];
  } else {
    const bool from_host = spilled == 1;
    // After an overflow nothing moves and nothing is checked: an overflowed stash took no pages,
    // so its reload is no misuse. Otherwise a record holding no pages gives none back: pushing
    // them again would let a later stash hand one page to two records.
    const bool stashed = r.record_state == kRecordStashed;
    d.invalid_reload = overflow == 0 && !stashed;
    d.active = overflow == 0 && stashed && (!from_host || has_host);
    d.tier = from_host ? 1 : 0;
    d.ring_start = from_host ? tail[1] : tail[0];
    // The step is discarded, but its backward still runs: a reload that moves no pages zeroes
    // its live rows so that uninitialized memory (NaN) never reaches Megatron's gradient NaN
    // check before the host reads the flags.
    d.zero_fill = overflow != 0 || d.invalid_reload;
  }
  return d;
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

// Where tile t of the launch (t < total_pages * tiles_per_page) sits, from the plan alone (no
// global-memory read, so a stash can start loading its user-side bytes before its page id is in).
struct TilePlace {
  int64_t g;      // page index in record order
  int64_t k;      // tile index inside the page: tile 0 writes the page record / recycles the page
  int64_t slot;   // the page's page_record slot
  int64_t lo;     // byte offset of the tile inside the page
  int64_t bytes;  // 0: the page's live rows end before this tile
  uint8_t* user;
};

template <int N>
__device__ __forceinline__ TilePlace place_tile(const PagingArgs& a, const Segments<N>& seg,
                                                const Plan<N>& plan, int64_t t) {
  const int64_t ps = a.pool.page_size;
  const int64_t rb = a.pool.row_bytes;
  TilePlace p;
  p.g = t / a.tiles_per_page;
  p.k = t - p.g * a.tiles_per_page;
  const int s = last_at_or_below(plan.page_prefix, a.num_segments, p.g);
  const int64_t j = p.g - plan.page_prefix[s];
  p.slot = seg.slot_offset[s] + j;
  const int64_t rows_here = min(ps, plan.copy_rows[s] - j * ps);
  p.lo = p.k * a.tile_bytes;
  p.bytes = max(min(p.lo + a.tile_bytes, rows_here * rb) - p.lo, int64_t{0});
  p.user = a.user + (seg.start[s] + j * ps) * rb + p.lo;
  return p;
}

// The stash's page id for page g of the record: the g-th page popped from the ring.
__device__ __forceinline__ int64_t popped_page(const PagingArgs& a, const Decision& d, int64_t g) {
  const int64_t cap = max(a.pool.capacity[d.tier], int64_t{1});
  return a.pool.ring[d.tier][(d.ring_start + g) % cap];
}

// Whether the page id may be used: a corrupt ring or record must not turn into a wild write.
// A launch that moves no pages (a reload's zero fill) reads no id and has nothing to check.
__device__ __forceinline__ bool usable_page(const PagingArgs& a, const Decision& d,
                                            int64_t page_id) {
  return !d.active || (page_id >= 0 && page_id < a.pool.num_pages[d.tier]);
}

__device__ __forceinline__ uint8_t* paged_address(const PagingArgs& a, const Decision& d,
                                                  int64_t page_id, int64_t lo) {
  return a.pool.pages[d.tier] + page_id * a.pool.page_size * a.pool.row_bytes + lo;
}

// Tile t, resolved: its page id, its page record (stash) or recycled page (reload) written by the
// page's first tile, and its byte ranges. `record_writer` is the one thread of the CTA that may
// write metadata.
template <bool kReload, int N>
__device__ __forceinline__ Tile resolve_tile(const PagingArgs& a, const Segments<N>& seg,
                                             const Plan<N>& plan, const Decision& d, int64_t t,
                                             bool record_writer) {
  const TilePlace p = place_tile(a, seg, plan, t);
  int64_t page_id = 0;
  if constexpr (!kReload) {
    page_id = popped_page(a, d, p.g);
    if (p.k == 0 && record_writer) a.page_record[p.slot] = page_id;
  } else if (d.active) {
    page_id = a.page_record[p.slot];
    if (p.k == 0 && record_writer && !d.invalid) {
      const int64_t cap = max(a.pool.capacity[d.tier], int64_t{1});
      a.pool.ring[d.tier][(d.ring_start + p.g) % cap] = page_id;
    }
  }
  if (!usable_page(a, d, page_id) || p.bytes == 0) return Tile{nullptr, nullptr, 0};
  return Tile{p.user, paged_address(a, d, page_id, p.lo), p.bytes};
}

// Stash: page_record slots that received no page hold 0 (the tiles wrote the others).
template <int N>
__device__ void zero_unfilled_slots(const PagingArgs& a, const Segments<N>& seg,
                                    const Plan<N>& plan, const Decision& d) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t q = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; q < a.record_slots;
       q += stride) {
    bool filled = false;
    if (d.active && q < a.max_slots) {
      const int s = last_at_or_below(seg.slot_offset, a.num_segments, q);
      filled = q - seg.slot_offset[s] <
               (plan.copy_rows[s] + a.pool.page_size - 1) / a.pool.page_size;
    }
    if (!filled) a.page_record[q] = 0;
  }
}

// Commit, in two halves. arrive(): thread 0 counts the CTA in on the per-pool counter, as soon as
// the CTA has made its last read of what publish() writes (ring head/tail, flags, the record's
// state word: all read by read_state before make_plan's barriers). The atomic's result is not
// waited for until publish(), so its round trip overlaps the CTA's copies instead of following
// them. publish(): the CTA that arrived last writes the new ring counter, state word and flags
// and resets the counter (the bulk path's tile ticket is reset by its last taker). Within the
// launch the counters may run ahead of the payload; nothing reads them before the launch
// completes (a pool's stashes and reloads are ordered on one stream, and a dependent launch
// waits for the whole grid).
__device__ __forceinline__ unsigned int arrive(const PagingArgs& a) {
  if (threadIdx.x != 0) return 0u;
  __threadfence();
  return atomicAdd(a.pool.done_counter, 1u);
}

template <bool kReload>
__device__ void publish(const PagingArgs& a, const Decision& d, unsigned int arrived) {
  if (threadIdx.x != 0 || arrived != gridDim.x - 1) return;
  // Atomic: the flags are shared by every pool of a paging context.
  auto* flags = reinterpret_cast<unsigned long long*>(a.pool.flags);
  if constexpr (!kReload) {
    if (d.active) a.pool.head[d.tier] = d.ring_start + d.ring_pages;
    a.spilled_to_host[0] = (d.use_host || d.new_overflow) ? 1 : 0;
    a.record_state[0] = d.active ? kRecordStashed : kRecordEmpty;
    if (d.new_overflow) atomicOr(flags + 0, 1ull);
    if (d.use_host) atomicOr(flags + 1, 1ull);
    if (d.invalid) atomicOr(flags + 2, static_cast<unsigned long long>(kInvalidLiveCount));
    // Counted here, not by a kernel queued behind this one: that kernel would wait for this
    // launch and, with one hardware queue, hold every later launch of every stream.
    if (d.after_overflow) {
      atomicAdd(reinterpret_cast<unsigned long long*>(a.pool.stashes_after_overflow), 1ull);
    }
  } else {
    if (d.active) a.pool.tail[d.tier] = d.ring_start + d.ring_pages;
    a.record_state[0] = kRecordReloaded;
    if (d.invalid_reload) atomicOr(flags + 2, static_cast<unsigned long long>(kInvalidReload));
  }
  *a.pool.done_counter = 0u;
}

// ---- CTA-cooperative byte movement (the tile path; the bulk path uses it for the host tier) --

// Indices are 32-bit: a tile is small (the 64-bit part is the tile's base). kThreads must be the
// CTA size.
template <int kThreads, int kUnroll, typename Word>
__device__ __forceinline__ void copy_words(Word* __restrict__ dst, const Word* __restrict__ src,
                                           int n) {
  constexpr int threads = kThreads;
  for (int base = threadIdx.x; base < n; base += kUnroll * threads) {
    Word v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * threads < n) v[u] = src[base + u * threads];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * threads < n) dst[base + u * threads] = v[u];
    }
  }
}

// CTA-cooperative copy of n bytes. The word width is the widest power of two (<= 16) that
// divides the distance between the two pointers; leading bytes up to the destination's word
// alignment and the trailing remainder go byte by byte, so any row byte count and any base
// offset work, and nothing outside [dst, dst + n) is written.
template <int kThreads, int kUnroll>
__device__ __forceinline__ void copy_range(uint8_t* dst, const uint8_t* src, int n) {
  const uintptr_t da = reinterpret_cast<uintptr_t>(dst);
  const unsigned rel = static_cast<unsigned>((reinterpret_cast<uintptr_t>(src) - da) & 15u);
  const int w = rel == 0 ? 16 : (rel & 7u) == 0 ? 8 : (rel & 3u) == 0 ? 4 : (rel & 1u) == 0 ? 2 : 1;
  const int lead = min(n, static_cast<int>((w - (da & (w - 1))) & (w - 1)));
  if (static_cast<int>(threadIdx.x) < lead) dst[threadIdx.x] = src[threadIdx.x];
  const int words = (n - lead) / w;
  uint8_t* dst_body = dst + lead;
  const uint8_t* src_body = src + lead;
  switch (w) {
    case 16:
      copy_words<kThreads, kUnroll>(reinterpret_cast<uint4*>(dst_body),
                          reinterpret_cast<const uint4*>(src_body), words);
      break;
    case 8:
      copy_words<kThreads, kUnroll>(reinterpret_cast<uint2*>(dst_body),
                          reinterpret_cast<const uint2*>(src_body), words);
      break;
    case 4:
      copy_words<kThreads, kUnroll>(reinterpret_cast<uint32_t*>(dst_body),
                          reinterpret_cast<const uint32_t*>(src_body), words);
      break;
    case 2:
      copy_words<kThreads, kUnroll>(reinterpret_cast<uint16_t*>(dst_body),
                          reinterpret_cast<const uint16_t*>(src_body), words);
      break;
    default:
      copy_words<kThreads, kUnroll>(dst_body, src_body, words);
      break;
  }
  const int done = lead + words * w;
  if (static_cast<int>(threadIdx.x) < n - done) dst[done + threadIdx.x] = src[done + threadIdx.x];
}

// CTA-cooperative zeroing of n bytes (16-byte stores between byte-wise edges).
__device__ __forceinline__ void zero_range(uint8_t* dst, int n) {
  const uintptr_t da = reinterpret_cast<uintptr_t>(dst);
  const int lead = min(n, static_cast<int>((16u - (da & 15u)) & 15u));
  if (static_cast<int>(threadIdx.x) < lead) dst[threadIdx.x] = 0;
  const int words = (n - lead) / 16;
  uint4* body = reinterpret_cast<uint4*>(dst + lead);
  for (int i = threadIdx.x; i < words; i += blockDim.x) body[i] = make_uint4(0u, 0u, 0u, 0u);
  const int done = lead + words * 16;
  if (static_cast<int>(threadIdx.x) < n - done) dst[done + threadIdx.x] = 0;
}

}  // namespace device

// Both kernel files name these without the namespace; declared once here so they stay in step.
using device::Decision;
using device::PagingArgs;
using device::Plan;
using device::Segments;

}  // namespace megatron_paging
