// The one host interface of the paging kernels, shared by paging_ops.cpp (ATen side) and the
// .cu files (device side). No ATen here, so the .cu files compile without torch headers.
//
// A launch is described by three blocks that change at different rates:
//   PoolView     - a pool's device pointers and sizes (fixed for the pool's life),
//   LayoutView   - a record's static segment table (fixed per record layout),
//   CopyLaunch   - one stash or reload: the user buffer, the record's device tensors, the grid.
// Semantics of a launch: kernels/reference.py (the executable specification).

#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megatron_paging {

// Segment tables travel by value as kernel parameters (no host->device copy, graph safe). Two
// table sizes keep the common few-segment launch small; 1024 x 24 bytes stays under the 32 KiB
// kernel-parameter limit.
constexpr int kFewSegments = 8;
constexpr int kMaxSegments = 1024;

// Which copy engine moves the payload. Both paths share the plan, the page-id resolution, the
// record/recycle writes and the commit; only the byte movement differs.
enum class CopyPath : int {
  kTile = 0,  // CTA-cooperative 16-byte vector loads/stores; any alignment, any tier
  kBulk = 1,  // sm90 cp.async.bulk global->shared->global pipeline; 16-byte aligned rows
  // The bulk pipeline in other tile/stage configurations (the kernel benchmark compares them;
  // kBulk is the default they are measured against, see docs/kernels.md).
  kBulkSmallTiles = 2,
  kBulkTinyTiles = 3,
  // The default pipeline with other tile-to-CTA assignments or more bytes in flight (benchmark
  // variants, docs/kernels.md "Tuning attempts"): tiles interleaved across CTAs, tiles taken
  // from a shared ticket in small batches, and 7 stages with 5 loads ahead (few segments only).
  kBulkInterleaved = 4,
  kBulkDynamic = 5,
  kBulkDeep = 6,
  // The default pipeline with every CTA on one contiguous range of tiles, whatever its grid
  // (the default before kBulk chose the order per launch, docs/kernels.md "Tile order").
  kBulkContiguous = 7,
  // kBulk with host-tier pages through the pipeline too (a measurement variant).
  kBulkHostTier = 8,
  // kBulk's order on other rings, for the full-grid gap to copy_ (docs/kernels.md "Full-grid
  // gap"): half the ring (96 KiB, so two CTAs share an SM: twice the issuing threads and plans
  // at the same bytes in flight per SM), and 64 KiB tiles (half as many bulk operations).
  kBulkTwoPerSm = 9,
  kBulkLargeTiles = 10,
};

struct PoolView {
  uint8_t* pages[2];         // page storage per tier (the host tier through its device address)
  int64_t num_pages[2];      // pages per tier
  int64_t* ring[2];          // freelist ring per tier
  int64_t* head;             // [2], monotonically increasing pop counters
  int64_t* tail;             // [2], monotonically increasing push counters
  const int64_t* capacity;   // [2], ring capacity per tier
  int64_t* flags;            // [3]: overflow, host_spill, invalid_live (shared by every pool)
  unsigned int* done_counter;  // [1], 0 between launches (the last CTA resets it)
  unsigned int* tile_ticket;   // [1] or null: next tile a CTA takes (kBulkDynamic), 0 between launches
  int64_t page_size;
  int64_t row_bytes;
};

struct LayoutView {
  int num_segments;
  const int64_t* start;        // host arrays of num_segments entries
  const int64_t* rows;
  const int64_t* slot_offset;
  int64_t max_slots;           // sum over segments of ceil(rows / page_size)
};

struct CopyLaunch {
  bool reload;                 // false: stash (user -> pages); true: reload (pages -> user)
  CopyPath path;
  uint8_t* user;               // stash: the source buffer; reload: the destination buffer
  const int64_t* live_rows;    // [num_segments]
  int64_t* page_record;        // [record_slots]
  int64_t record_slots;        // page_record.numel() (>= max_slots)
  int64_t* spilled_to_host;    // [1]
  PoolView pool;
  LayoutView layout;
  int max_ctas;                // grid bound; never bounds capacity or copied rows
};

// Enqueue one launch on `stream`. Returns the CUDA error of the launch (cudaSuccess on success);
// cudaErrorInvalidValue for a table with no or too many segments or a non-positive max_ctas.
cudaError_t launch_copy(const CopyLaunch& launch, cudaStream_t stream);

// The two paths (launch_copy dispatches on launch.path).
cudaError_t launch_tile(const CopyLaunch& launch, cudaStream_t stream);
cudaError_t launch_bulk(const CopyLaunch& launch, cudaStream_t stream);

// Whether launch_bulk can run on `device` (compute capability 9.0 or newer).
bool bulk_supported(int device);

}  // namespace megatron_paging
