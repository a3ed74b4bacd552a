// torch operators megatron_paging::stash / megatron_paging::reload (CUDA implementations).
//
// The Python wrapper (kernels/cuda_ops.py) passes byte views ([rows, row_bytes] uint8) of the
// user buffer and the pool tiers, the pool's int64 ring metadata, the record's device tensors and
// its static segment table as int[] arguments. Everything here is a host-side shape/dtype check;
// no device value is read, so the ops are CUDA-graph capturable.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

namespace megatron_paging {

// Defined in paging_kernels.cu.
int max_segments();
cudaError_t launch_copy(bool reload, uint8_t* user, uint8_t* cuda_pages, uint8_t* host_pages,
                        int64_t num_cuda_pages, int64_t num_host_pages,
                        const int64_t* live_rows, int64_t* free_list_cuda,
                        int64_t* free_list_host, int64_t* free_list_head,
                        int64_t* free_list_tail, const int64_t* free_list_capacity,
                        int64_t* page_record, int64_t record_slots, int64_t* spilled_to_host,
                        int64_t* flags, unsigned int* done_counter,
                        const int64_t* segment_starts, const int64_t* segment_rows,
                        const int64_t* slot_offsets, int num_segments, int64_t page_size,
                        int64_t row_bytes, int max_ctas, cudaStream_t stream);

namespace {

void check_on(const at::Tensor& t, const char* name, const at::Device& device,
              at::ScalarType dtype) {
  TORCH_CHECK(t.device() == device, "megatron_paging: ", name, " is on ", t.device(),
              " but the pool is on ", device);
  TORCH_CHECK(t.scalar_type() == dtype, "megatron_paging: ", name, " must be ",
              c10::toString(dtype), ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "megatron_paging: ", name, " must be contiguous");
}

void check_rows(const at::Tensor& t, const char* name, int64_t row_bytes, int64_t page_size) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == row_bytes, "megatron_paging: ", name,
              " must be [rows, ", row_bytes, "] bytes, got ", t.sizes());
  TORCH_CHECK(page_size > 0 && t.size(0) % page_size == 0, "megatron_paging: ", name, " has ",
              t.size(0), " rows, not a multiple of page_size ", page_size);
}

// The device address of pinned host memory, or null for a pool without a host tier. Outside
// capture it is asked of the runtime (which also proves the memory is pinned); during capture no
// pointer query is made: with unified addressing, torch's pinned allocations (cudaHostAlloc) are
// addressed by the device at their host address.
uint8_t* mapped_host_pages(const at::Tensor& host_pages, cudaStream_t stream) {
  if (host_pages.numel() == 0) return nullptr;
  TORCH_CHECK(host_pages.device().is_cpu(), "megatron_paging: host_pages must be a CPU tensor");
  void* ptr = host_pages.data_ptr();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TORCH_CHECK(cudaStreamIsCapturing(stream, &capture) == cudaSuccess,
              "megatron_paging: cudaStreamIsCapturing failed");
  if (capture == cudaStreamCaptureStatusNone) {
    cudaPointerAttributes attr{};
    const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
    TORCH_CHECK(err == cudaSuccess && attr.type == cudaMemoryTypeHost && attr.devicePointer,
                "megatron_paging: host_pages must be pinned host memory mapped into the device "
                "address space (allocate it with pin_memory=True); cudaPointerGetAttributes: ",
                cudaGetErrorString(err));
    return static_cast<uint8_t*>(attr.devicePointer);
  }
  int device = 0;
  int unified = 0;
  TORCH_CHECK(cudaGetDevice(&device) == cudaSuccess &&
                  cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device) ==
                      cudaSuccess &&
                  unified == 1,
              "megatron_paging: a host tier under CUDA-graph capture needs unified addressing");
  return static_cast<uint8_t*>(ptr);
}

struct Common {
  int64_t num_cuda_pages;
  int64_t num_host_pages;
  int num_segments;
};

// Checks shared by stash and reload; `user` is the [capacity_rows, row_bytes] byte view.
Common check_common(const at::Tensor& user, const at::Tensor& cuda_pages,
                    const at::Tensor& host_pages, const at::Tensor& live_rows,
                    const at::Tensor& free_list_cuda, const at::Tensor& free_list_host,
                    const at::Tensor& free_list_head, const at::Tensor& free_list_tail,
                    const at::Tensor& free_list_capacity, const at::Tensor& page_record,
                    const at::Tensor& spilled_to_host, const at::Tensor& flags,
                    const at::Tensor& done_counter, at::IntArrayRef segment_starts,
                    at::IntArrayRef segment_rows, at::IntArrayRef slot_offsets,
                    int64_t page_size, int64_t row_bytes, int64_t max_ctas) {
  TORCH_CHECK(cuda_pages.is_cuda(), "megatron_paging: cuda_pages must be a CUDA tensor");
  const at::Device device = cuda_pages.device();
  TORCH_CHECK(row_bytes > 0, "megatron_paging: row_bytes must be positive, got ", row_bytes);
  TORCH_CHECK(page_size > 0, "megatron_paging: page_size must be positive, got ", page_size);
  TORCH_CHECK(max_ctas > 0 && max_ctas <= INT32_MAX,
              "megatron_paging: max_ctas must be a positive int32, got ", max_ctas);
  check_on(user, "the user buffer", device, at::kByte);
  check_on(cuda_pages, "cuda_pages", device, at::kByte);
  check_rows(user, "the user buffer", row_bytes, 1);
  check_rows(cuda_pages, "cuda_pages", row_bytes, page_size);
  TORCH_CHECK(host_pages.scalar_type() == at::kByte && host_pages.is_contiguous(),
              "megatron_paging: host_pages must be a contiguous uint8 tensor");
  check_rows(host_pages, "host_pages", row_bytes, page_size);
  check_on(live_rows, "live_rows", device, at::kLong);
  check_on(free_list_cuda, "free_list_cuda", device, at::kLong);
  check_on(free_list_host, "free_list_host", device, at::kLong);
  check_on(free_list_head, "free_list_head", device, at::kLong);
  check_on(free_list_tail, "free_list_tail", device, at::kLong);
  check_on(free_list_capacity, "free_list_capacity", device, at::kLong);
  check_on(page_record, "page_record", device, at::kLong);
  check_on(spilled_to_host, "spilled_to_host", device, at::kLong);
  check_on(flags, "flags", device, at::kLong);
  check_on(done_counter, "done_counter", device, at::kInt);
  TORCH_CHECK(free_list_head.numel() == 2 && free_list_tail.numel() == 2 &&
                  free_list_capacity.numel() == 2,
              "megatron_paging: free_list_head/tail/capacity must hold 2 entries (device, host)");
  TORCH_CHECK(spilled_to_host.numel() == 1, "megatron_paging: spilled_to_host must hold 1 entry");
  TORCH_CHECK(flags.numel() == 3,
              "megatron_paging: flags must hold 3 entries (overflow, host_spill, invalid_live)");
  TORCH_CHECK(done_counter.numel() >= 1, "megatron_paging: done_counter must hold 1 entry");

  const Common c{cuda_pages.size(0) / page_size, host_pages.size(0) / page_size,
                 static_cast<int>(segment_rows.size())};
  TORCH_CHECK(free_list_cuda.numel() >= c.num_cuda_pages, "megatron_paging: free_list_cuda has ",
              free_list_cuda.numel(), " entries for ", c.num_cuda_pages, " pages");
  TORCH_CHECK(free_list_host.numel() >= c.num_host_pages, "megatron_paging: free_list_host has ",
              free_list_host.numel(), " entries for ", c.num_host_pages, " pages");
  TORCH_CHECK(c.num_segments >= 1 && c.num_segments <= max_segments(),
              "megatron_paging: a record needs 1 to ", max_segments(), " segments, got ",
              segment_rows.size());
  TORCH_CHECK(segment_starts.size() == segment_rows.size() &&
                  slot_offsets.size() == segment_rows.size(),
              "megatron_paging: segment_starts, segment_rows and slot_offsets differ in length");
  TORCH_CHECK(live_rows.numel() == c.num_segments, "megatron_paging: live_rows has ",
              live_rows.numel(), " entries for ", c.num_segments, " segments");
  int64_t end = 0;
  int64_t slots = 0;
  for (int s = 0; s < c.num_segments; ++s) {
    TORCH_CHECK(segment_starts[s] >= end && segment_rows[s] >= 0,
                "megatron_paging: segments must be sorted and disjoint (segment ", s, ")");
    TORCH_CHECK(slot_offsets[s] == slots, "megatron_paging: slot_offsets[", s, "] is ",
                slot_offsets[s], ", expected ", slots);
    end = segment_starts[s] + segment_rows[s];
    slots += (segment_rows[s] + page_size - 1) / page_size;
  }
  TORCH_CHECK(end <= user.size(0), "megatron_paging: segments end at row ", end,
              " but the user buffer has ", user.size(0), " rows");
  TORCH_CHECK(page_record.numel() >= slots, "megatron_paging: page_record has ",
              page_record.numel(), " slots, the segments need ", slots);
  return c;
}

// Stash and reload share every check and argument; `kReload` picks the direction.
template <bool kReload>
void copy_cuda(const at::Tensor& user, const at::Tensor& cuda_pages, const at::Tensor& host_pages,
                const at::Tensor& live_rows, const at::Tensor& free_list_cuda,
                const at::Tensor& free_list_host, const at::Tensor& free_list_head,
                const at::Tensor& free_list_tail, const at::Tensor& free_list_capacity,
                const at::Tensor& page_record, const at::Tensor& spilled_to_host,
                const at::Tensor& flags, const at::Tensor& done_counter,
                at::IntArrayRef segment_starts, at::IntArrayRef segment_rows,
                at::IntArrayRef slot_offsets, int64_t page_size, int64_t row_bytes,
                int64_t max_ctas) {
  const Common c = check_common(user, cuda_pages, host_pages, live_rows, free_list_cuda,
                                free_list_host, free_list_head, free_list_tail,
                                free_list_capacity, page_record, spilled_to_host, flags,
                                done_counter, segment_starts, segment_rows, slot_offsets,
                                page_size, row_bytes, max_ctas);
  const c10::cuda::CUDAGuard guard(cuda_pages.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = launch_copy(
      kReload, user.data_ptr<uint8_t>(), cuda_pages.data_ptr<uint8_t>(),
      mapped_host_pages(host_pages, stream),
      c.num_cuda_pages, c.num_host_pages, live_rows.data_ptr<int64_t>(),
      free_list_cuda.data_ptr<int64_t>(), free_list_host.data_ptr<int64_t>(),
      free_list_head.data_ptr<int64_t>(), free_list_tail.data_ptr<int64_t>(),
      free_list_capacity.data_ptr<int64_t>(), page_record.data_ptr<int64_t>(),
      page_record.numel(), spilled_to_host.data_ptr<int64_t>(), flags.data_ptr<int64_t>(),
      reinterpret_cast<unsigned int*>(done_counter.data_ptr<int32_t>()), segment_starts.data(),
      segment_rows.data(), slot_offsets.data(), c.num_segments, page_size, row_bytes,
      static_cast<int>(max_ctas), stream);
  TORCH_CHECK(err == cudaSuccess, "megatron_paging: ", kReload ? "reload" : "stash",
              " launch failed: ", cudaGetErrorString(err));
}

void stash_cuda(const at::Tensor& src, const at::Tensor& cuda_pages, const at::Tensor& host_pages,
                const at::Tensor& live_rows, const at::Tensor& free_list_cuda,
                const at::Tensor& free_list_host, const at::Tensor& free_list_head,
                const at::Tensor& free_list_tail, const at::Tensor& free_list_capacity,
                const at::Tensor& page_record, const at::Tensor& spilled_to_host,
                const at::Tensor& flags, const at::Tensor& done_counter,
                at::IntArrayRef segment_starts, at::IntArrayRef segment_rows,
                at::IntArrayRef slot_offsets, int64_t page_size, int64_t row_bytes,
                int64_t max_ctas) {
  copy_cuda<false>(src, cuda_pages, host_pages, live_rows, free_list_cuda, free_list_host,
                       free_list_head, free_list_tail, free_list_capacity, page_record,
                       spilled_to_host, flags, done_counter, segment_starts, segment_rows,
                       slot_offsets, page_size, row_bytes, max_ctas);
}

void reload_cuda(const at::Tensor& dst, const at::Tensor& cuda_pages, const at::Tensor& host_pages,
                const at::Tensor& live_rows, const at::Tensor& free_list_cuda,
                const at::Tensor& free_list_host, const at::Tensor& free_list_head,
                const at::Tensor& free_list_tail, const at::Tensor& free_list_capacity,
                const at::Tensor& page_record, const at::Tensor& spilled_to_host,
                const at::Tensor& flags, const at::Tensor& done_counter,
                at::IntArrayRef segment_starts, at::IntArrayRef segment_rows,
                at::IntArrayRef slot_offsets, int64_t page_size, int64_t row_bytes,
                int64_t max_ctas) {
  copy_cuda<true>(dst, cuda_pages, host_pages, live_rows, free_list_cuda, free_list_host,
                       free_list_head, free_list_tail, free_list_capacity, page_record,
                       spilled_to_host, flags, done_counter, segment_starts, segment_rows,
                       slot_offsets, page_size, row_bytes, max_ctas);
}

}  // namespace

// Mutated arguments carry (x!) so that functionalization and graph tooling see the writes.
TORCH_LIBRARY(megatron_paging, m) {
  m.def(
      "stash(Tensor src, Tensor(a!) cuda_pages, Tensor(b!) host_pages, Tensor live_rows, "
      "Tensor free_list_cuda, Tensor free_list_host, Tensor(c!) free_list_head, "
      "Tensor free_list_tail, Tensor free_list_capacity, Tensor(d!) page_record, "
      "Tensor(e!) spilled_to_host, Tensor(f!) flags, Tensor(g!) done_counter, "
      "int[] segment_starts, int[] segment_rows, int[] slot_offsets, int page_size, "
      "int row_bytes, int max_ctas) -> ()");
  m.def(
      "reload(Tensor(a!) dst, Tensor cuda_pages, Tensor host_pages, Tensor live_rows, "
      "Tensor(b!) free_list_cuda, Tensor(c!) free_list_host, Tensor free_list_head, "
      "Tensor(d!) free_list_tail, Tensor free_list_capacity, Tensor page_record, "
      "Tensor spilled_to_host, Tensor flags, Tensor(e!) done_counter, "
      "int[] segment_starts, int[] segment_rows, int[] slot_offsets, int page_size, "
      "int row_bytes, int max_ctas) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_paging, CUDA, m) {
  m.impl("stash", &stash_cuda);
  m.impl("reload", &reload_cuda);
}

}  // namespace megatron_paging
