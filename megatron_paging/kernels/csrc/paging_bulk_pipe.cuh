// The bulk path's single-thread copy pipeline (sm90+): a ring of shared-memory stages, each
// filled by a cp.async.bulk load that completes on the stage's mbarrier and drained by a bulk
// store. Only paging_bulk.cu includes it; the kernel, the tile orders and the configuration
// (BulkConfig: tile bytes, stages, loads ahead) live there.

#pragma once

#include <cuda_runtime.h>

#include <cstdint>

// The copy-engine instructions exist from sm_90 on; for older targets the kernel compiles to the
// cooperative copy alone (correct, just slow), so this file builds for any architecture.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MEGATRON_PAGING_BULK_ARCH 1
#else
#define MEGATRON_PAGING_BULK_ARCH 0
#endif

namespace megatron_paging {
namespace bulk {

// Thread 0's bookkeeping in shared memory: the mbarrier of each stage, and where each loaded
// stage goes once its load has landed. Only thread 0 ever touches it.
template <typename C>
struct BulkRing {
  uint64_t bar[C::kStages];
  uint8_t* dst[C::kStages];
  uint32_t bytes[C::kStages];
};

#if MEGATRON_PAGING_BULK_ARCH
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// v, ordered after every volatile asm before it (the bulk loads): the compiler may not hoist
// the first use of a loaded value, and with it the wait for the load, above those loads.
__device__ __forceinline__ int64_t after_issue(int64_t v) {
  asm volatile("mov.b64 %0, %0;" : "+l"(v));
  return v;
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// The single-thread pipeline. Stages are used round-robin in tile order, loads and stores alike,
// so the stage a store reads is the oldest pending load's, and a stage's mbarrier completes one
// phase per load: its parity flips each time the ring wraps. Everything is in tile order, so no
// per-stage phase array is needed, only the parity of the next stage to be stored.
template <typename C>
struct BulkPipe {
  BulkRing<C>* ring;
  uint8_t* stages;
  int load_stage;      // stage the next load goes to
  int store_stage;     // stage of the oldest load not yet stored
  uint32_t store_parity;  // phase parity that store_stage's current load completes
  int dst_stage;       // stage whose destination is named next (set_next_dst)
  int pending;         // loads issued and not yet stored (<= kLoadsAhead between pushes)
  bool wrapped;        // every stage has held a load, so a refill must wait for the stage's store

  __device__ void init(BulkRing<C>* r, uint8_t* s) {
    ring = r;
    stages = s;
    load_stage = 0;
    store_stage = 0;
    store_parity = 0;
    dst_stage = 0;
    pending = 0;
    wrapped = false;
#if MEGATRON_PAGING_BULK_ARCH
    for (int i = 0; i < C::kStages; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&ring->bar[i]))
                   : "memory");
    }
    // The copy engine (async proxy) updates these barriers: the initialization must be visible
    // to it before the first bulk load names one. Only this thread uses them, so no CTA barrier.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
  }

  // Move one tile: n bytes, 16-byte aligned on both sides, n <= C::kTileBytes.
  __device__ void push(uint8_t* dst, const uint8_t* src, uint32_t n) {
    set_next_dst(dst);
    load(src, n);
  }

  // Name where the oldest loaded (or next loaded) tile without a destination goes; nullptr: the
  // tile is dropped after its load (a corrupt page id). Destinations are named in load order and
  // a tile's must be named before kLoadsAhead younger tiles are loaded (that load stores it), so
  // a stash can issue its user-side loads before its page ids arrive.
  __device__ void set_next_dst(uint8_t* dst) {
    ring->dst[dst_stage] = dst;
    dst_stage = dst_stage + 1 == C::kStages ? 0 : dst_stage + 1;
  }

  // Load one tile into the next stage (n bytes, 16-byte aligned, n <= C::kTileBytes); once more
  // than kLoadsAhead loads are pending, store the oldest.
  __device__ void load(const uint8_t* src, uint32_t n) {
#if MEGATRON_PAGING_BULK_ARCH
    const int s = load_stage;
    if (wrapped) {
      // The stage last held tile b - kStages (b = this tile's bulk index). Its store was
      // issued, and since then exactly kStoresReading younger stores: kLoadsAhead loads are
      // pending between pushes, so stores 0 .. b - kLoadsAhead - 1 have been issued.
      asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(C::kStoresReading) : "memory");
    }
    const uint32_t bar = smem_u32(&ring->bar[s]);
    const uint32_t stage = smem_u32(stages + s * C::kTileBytes);
    ring->bytes[s] = n;
    // The barrier expects one arrival: ours, which carries the n expected bytes in the same
    // instruction, so the phase cannot complete before every byte of this load has landed.
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(stage), "l"(src), "r"(n), "r"(bar)
        : "memory");
    load_stage = s + 1 == C::kStages ? 0 : s + 1;
    wrapped |= load_stage == 0;
    if (++pending > C::kLoadsAhead) store_oldest();
#else
    (void)src;
    (void)n;
#endif
  }

  // Wait for the oldest pending load and send its stage to global memory.
  __device__ void store_oldest() {
#if MEGATRON_PAGING_BULK_ARCH
    const int s = store_stage;
    const uint32_t bar = smem_u32(&ring->bar[s]);
    uint32_t done = 0;
    // try_wait suspends the thread for a while inside the instruction, so this loop does not
    // spin hot; it ends because the load was issued and its bytes always arrive (a faulting
    // address aborts the kernel instead).
    do {
      asm volatile(
          "{\n\t.reg .pred p;\n\t"
          "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
          "selp.b32 %0, 1, 0, p;\n\t}"
          : "=r"(done)
          : "r"(bar), "r"(store_parity)
          : "memory");
    } while (done == 0);
    // The bytes were written by the copy engine and are read by it again, ordered only through
    // this thread's observation of the phase. Completion already implies a proxy fence towards
    // this thread; the explicit fence makes the hand-back to the async proxy explicit too
    // instead of relying on that reading of the memory model (one fence per tile is cheap).
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (ring->dst[s] != nullptr) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(ring->dst[s]), "r"(smem_u32(stages + s * C::kTileBytes)),
                   "r"(ring->bytes[s])
                   : "memory");
    }
    // Committed even when empty: wait_group counts groups, one per stored stage.
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    store_stage = s + 1 == C::kStages ? 0 : s + 1;
    store_parity ^= store_stage == 0 ? 1u : 0u;
    --pending;
#endif
  }

  // Issue the stores of every load still pending (the writes may still be in flight after).
  __device__ void drain() {
    while (pending > 0) store_oldest();
  }

  // Wait until every bulk store has read its shared-memory stage: all a CTA that arrived before
  // its copies needs before it exits (its counters are published already; the payload reaches
  // global memory before the grid completes, which is when the next kernel on the stream reads).
  __device__ void release() {
#if MEGATRON_PAGING_BULK_ARCH
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
  }

};

}  // namespace bulk
}  // namespace megatron_paging
