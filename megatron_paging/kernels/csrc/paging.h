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
};

// A record's state word (PageRecord.state, record.py), written by every stash and reload and read
// by reload: a reload of a record that holds no pages (reloaded already, or never stashed) must
// not hand pages back to the ring twice. The stashed value is distinctive rather than 1: the
// save path leaves the word uninitialized (no fill kernel), and a stray int64 1 there must not
// pass for a stash.
constexpr int64_t kRecordEmpty = 0;                   // holds no pages: its stash took none
constexpr int64_t kRecordStashed = 0x53544153484544;  // holds pages ("STASHED" in ASCII)
constexpr int64_t kRecordReloaded = 2;                // its pages went back to the ring

// Bits of the invalid_live flag (flags[2], pool.py), so that the host can name what happened.
constexpr int64_t kInvalidLiveCount = 1;  // a stash saw a live count outside its segment
constexpr int64_t kInvalidReload = 2;     // a reload found its record holding no pages

struct PoolView {
  uint8_t* pages[2];         // page storage per tier (the host tier through its device address)
  int64_t num_pages[2];      // pages per tier
  int64_t* ring[2];          // freelist ring per tier
  int64_t* head;             // [2], monotonically increasing pop counters
  int64_t* tail;             // [2], monotonically increasing push counters
  const int64_t* capacity;   // [2], ring capacity per tier
  int64_t* flags;            // [3]: overflow, host_spill, invalid_live bits (shared by every pool)
  int64_t* stashes_after_overflow;  // [1]: this pool's stashes that found or set the overflow
                                    // flag (overflow/demand.py's report reads it)
  unsigned int* done_counter;  // [1], 0 between launches (the last CTA resets it)
  unsigned int* tile_ticket;   // [1] or null: the bulk path's ticket order, 0 between launches
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
  int64_t* record_state;       // [1]: kRecordEmpty / kRecordStashed / kRecordReloaded
  PoolView pool;
  LayoutView layout;
  int max_ctas;                // grid bound, checked in Python; never bounds the copied rows
};

// Enqueue one launch on `stream`. Returns the CUDA error of the launch (cudaSuccess on success);
// cudaErrorInvalidValue for a table with no or too many segments.
cudaError_t launch_copy(const CopyLaunch& launch, cudaStream_t stream);

// The two paths (launch_copy dispatches on launch.path).
cudaError_t launch_tile(const CopyLaunch& launch, cudaStream_t stream);
cudaError_t launch_bulk(const CopyLaunch& launch, cudaStream_t stream);

// Whether launch_bulk can run on `device` (compute capability 9.0 or newer).
bool bulk_supported(int device);

}  // namespace megatron_paging
