// Python bindings of the paging kernels (the extension module megatron_paging_kernels): two
// classes that hold what never changes per launch, and one function per launch.
//
//   Pool    - a pool's tensors, checked once; their device pointers (the host tier's mapped
//             address too)
//   Layout  - a record layout's segment table, checked once
//   copy    - one stash or reload of one record
//
// A launch then costs one pybind11 call with a few arguments (pybind11 objects and tensors
// convert in a fraction of a microsecond, unlike torch.ops arguments) and a handful of cheap
// checks (device, dtype, size): no pointer queries, no segment validation, no device attribute
// reads (the launcher caches those). No device value is read, so launches are CUDA-graph
// capturable. The kernels write the pool's tensors through the Pool handle and the record's
// through its tensors; nothing here runs under torch.compile.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "paging.h"

namespace megatron_paging {
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
  TORCH_CHECK(t.size(0) % page_size == 0, "megatron_paging: ", name, " has ", t.size(0),
              " rows, not a multiple of page_size ", page_size);
}

// The device address of pinned host memory (null for a pool without a host tier). Asked of the
// runtime once per pool, which also proves the memory is pinned and mapped.
uint8_t* mapped_host_pages(const at::Tensor& host_pages) {
  if (host_pages.numel() == 0) return nullptr;
  TORCH_CHECK(host_pages.device().is_cpu(), "megatron_paging: host_pages must be a CPU tensor");
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, host_pages.data_ptr());
  TORCH_CHECK(err == cudaSuccess && attr.type == cudaMemoryTypeHost && attr.devicePointer,
              "megatron_paging: host_pages must be pinned host memory mapped into the device "
              "address space (allocate it with pin_memory=True); cudaPointerGetAttributes: ",
              cudaGetErrorString(err));
  return static_cast<uint8_t*>(attr.devicePointer);
}

struct Pool {
  // Held so the pointers in `view` stay valid for the handle's life.
  std::vector<at::Tensor> tensors;
  at::Device device;
  PoolView view{};

  Pool(at::Tensor cuda_pages, at::Tensor host_pages, at::Tensor free_list_cuda,
       at::Tensor free_list_host, at::Tensor head, at::Tensor tail, at::Tensor capacity,
       at::Tensor flags, at::Tensor done_counter, int64_t page_size, int64_t row_bytes)
      : device(cuda_pages.device()) {
    TORCH_CHECK(cuda_pages.is_cuda(), "megatron_paging: cuda_pages must be a CUDA tensor");
    TORCH_CHECK(row_bytes > 0, "megatron_paging: row_bytes must be positive, got ", row_bytes);
    TORCH_CHECK(page_size > 0, "megatron_paging: page_size must be positive, got ", page_size);
    check_on(cuda_pages, "cuda_pages", device, at::kByte);
    check_rows(cuda_pages, "cuda_pages", row_bytes, page_size);
    TORCH_CHECK(host_pages.scalar_type() == at::kByte && host_pages.is_contiguous(),
                "megatron_paging: host_pages must be a contiguous uint8 tensor");
    check_rows(host_pages, "host_pages", row_bytes, page_size);
    check_on(free_list_cuda, "free_list_cuda", device, at::kLong);
    check_on(free_list_host, "free_list_host", device, at::kLong);
    check_on(head, "free_list_head", device, at::kLong);
    check_on(tail, "free_list_tail", device, at::kLong);
    check_on(capacity, "free_list_capacity", device, at::kLong);
    check_on(flags, "flags", device, at::kLong);
    check_on(done_counter, "done_counter", device, at::kInt);
    TORCH_CHECK(head.numel() == 2 && tail.numel() == 2 && capacity.numel() == 2,
                "megatron_paging: free_list_head/tail/capacity must hold 2 entries (device, host)");
    TORCH_CHECK(flags.numel() == 3,
                "megatron_paging: flags must hold 3 entries (overflow, host_spill, invalid_live)");
    TORCH_CHECK(done_counter.numel() >= 1, "megatron_paging: done_counter must hold 1 entry");
    view.num_pages[0] = cuda_pages.size(0) / page_size;
    view.num_pages[1] = host_pages.size(0) / page_size;
    TORCH_CHECK(free_list_cuda.numel() >= view.num_pages[0], "megatron_paging: free_list_cuda has ",
                free_list_cuda.numel(), " entries for ", view.num_pages[0], " pages");
    TORCH_CHECK(free_list_host.numel() >= view.num_pages[1], "megatron_paging: free_list_host has ",
                free_list_host.numel(), " entries for ", view.num_pages[1], " pages");
    const c10::cuda::CUDAGuard guard(device);
    view.pages[0] = cuda_pages.data_ptr<uint8_t>();
    view.pages[1] = mapped_host_pages(host_pages);
    view.ring[0] = free_list_cuda.data_ptr<int64_t>();
    view.ring[1] = free_list_host.data_ptr<int64_t>();
    view.head = head.data_ptr<int64_t>();
    view.tail = tail.data_ptr<int64_t>();
    view.capacity = capacity.data_ptr<int64_t>();
    view.flags = flags.data_ptr<int64_t>();
    view.done_counter = reinterpret_cast<unsigned int*>(done_counter.data_ptr<int32_t>());
    view.page_size = page_size;
    view.row_bytes = row_bytes;
    tensors = {cuda_pages, host_pages, free_list_cuda, free_list_host, head,
               tail,       capacity,   flags,          done_counter};
  }
};

struct Layout {
  int64_t capacity_rows;
  int64_t row_bytes;
  int64_t page_size;
  std::vector<int64_t> start;
  std::vector<int64_t> rows;
  std::vector<int64_t> slot_offset;
  int64_t max_slots = 0;

  Layout(int64_t capacity_rows, int64_t row_bytes, int64_t page_size, std::vector<int64_t> start,
         std::vector<int64_t> rows, std::vector<int64_t> slot_offset)
      : capacity_rows(capacity_rows),
        row_bytes(row_bytes),
        page_size(page_size),
        start(std::move(start)),
        rows(std::move(rows)),
        slot_offset(std::move(slot_offset)) {
    const int64_t n = static_cast<int64_t>(this->rows.size());
    TORCH_CHECK(capacity_rows > 0 && row_bytes > 0 && page_size > 0,
                "megatron_paging: capacity_rows, row_bytes and page_size must be positive");
    TORCH_CHECK(n >= 1 && n <= kMaxSegments, "megatron_paging: a record needs 1 to ",
                kMaxSegments, " segments, got ", n);
    TORCH_CHECK(static_cast<int64_t>(this->start.size()) == n &&
                    static_cast<int64_t>(this->slot_offset.size()) == n,
                "megatron_paging: segment_starts, segment_rows and slot_offsets differ in length");
    int64_t end = 0;
    for (int64_t s = 0; s < n; ++s) {
      TORCH_CHECK(this->start[s] >= end && this->rows[s] >= 0,
                  "megatron_paging: segments must be sorted and disjoint (segment ", s, ")");
      TORCH_CHECK(this->slot_offset[s] == max_slots, "megatron_paging: slot_offsets[", s,
                  "] is ", this->slot_offset[s], ", expected ", max_slots);
      end = this->start[s] + this->rows[s];
      max_slots += (this->rows[s] + page_size - 1) / page_size;
    }
    TORCH_CHECK(end <= capacity_rows, "megatron_paging: segments end at row ", end,
                " but the buffer has ", capacity_rows, " rows");
  }

  LayoutView view() const {
    return LayoutView{static_cast<int>(rows.size()), start.data(), rows.data(),
                      slot_offset.data(), max_slots};
  }
};

void copy(bool reload, const at::Tensor& user, const Pool& pool_handle,
          const Layout& layout_handle, const at::Tensor& live_rows, const at::Tensor& page_record,
          const at::Tensor& spilled_to_host, int64_t path, int64_t max_ctas) {
  const Pool* const pool = &pool_handle;
  const Layout* const layout = &layout_handle;
  const at::Device& device = pool->device;
  TORCH_CHECK(layout->row_bytes == pool->view.row_bytes && layout->page_size == pool->view.page_size,
              "megatron_paging: the record's layout (row_bytes ", layout->row_bytes,
              ", page_size ", layout->page_size, ") does not match the pool's (",
              pool->view.row_bytes, ", ", pool->view.page_size, ")");
  TORCH_CHECK(user.device() == device, "megatron_paging: the user buffer is on ", user.device(),
              " but the pool is on ", device);
  TORCH_CHECK(user.is_contiguous(), "megatron_paging: the user buffer must be contiguous");
  TORCH_CHECK(static_cast<int64_t>(user.nbytes()) == layout->capacity_rows * layout->row_bytes,
              "megatron_paging: the user buffer holds ", user.nbytes(), " bytes, the record ",
              layout->capacity_rows * layout->row_bytes);
  check_on(live_rows, "live_rows", device, at::kLong);
  check_on(page_record, "page_record", device, at::kLong);
  check_on(spilled_to_host, "spilled_to_host", device, at::kLong);
  TORCH_CHECK(live_rows.numel() == static_cast<int64_t>(layout->rows.size()),
              "megatron_paging: live_rows has ", live_rows.numel(), " entries for ",
              layout->rows.size(), " segments");
  TORCH_CHECK(page_record.numel() >= layout->max_slots, "megatron_paging: page_record has ",
              page_record.numel(), " slots, the segments need ", layout->max_slots);
  TORCH_CHECK(spilled_to_host.numel() == 1, "megatron_paging: spilled_to_host must hold 1 entry");
  TORCH_CHECK(max_ctas > 0 && max_ctas <= INT32_MAX,
              "megatron_paging: max_ctas must be a positive int32, got ", max_ctas);
  TORCH_CHECK(path >= static_cast<int64_t>(CopyPath::kTile) &&
                  path <= static_cast<int64_t>(CopyPath::kBulkTinyTiles),
              "megatron_paging: path must be 0 (tile), 1 (bulk) or 2-3 (bulk variants), got ",
              path);

  const c10::cuda::CUDAGuard guard(device);
  CopyLaunch launch{};
  launch.reload = reload;
  launch.path = static_cast<CopyPath>(path);
  launch.user = static_cast<uint8_t*>(user.data_ptr());
  launch.live_rows = live_rows.data_ptr<int64_t>();
  launch.page_record = page_record.data_ptr<int64_t>();
  launch.record_slots = page_record.numel();
  launch.spilled_to_host = spilled_to_host.data_ptr<int64_t>();
  launch.pool = pool->view;
  launch.layout = layout->view();
  launch.max_ctas = static_cast<int>(max_ctas);
  const cudaError_t err = launch_copy(launch, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "megatron_paging: ", reload ? "reload" : "stash",
              " launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace megatron_paging

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using megatron_paging::Layout;
  using megatron_paging::Pool;
  m.doc() = "megatron-paging stash/reload kernels (see megatron_paging/kernels/cuda_ops.py)";
  pybind11::class_<Pool>(m, "Pool")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t>());
  pybind11::class_<Layout>(m, "Layout")
      .def(pybind11::init<int64_t, int64_t, int64_t, std::vector<int64_t>, std::vector<int64_t>,
                          std::vector<int64_t>>());
  m.def("copy", &megatron_paging::copy,
        "One stash (reload=False) or reload of one record (one launch).",
        pybind11::arg("reload"), pybind11::arg("user"), pybind11::arg("pool"),
        pybind11::arg("layout"), pybind11::arg("live_rows"), pybind11::arg("page_record"),
        pybind11::arg("spilled_to_host"), pybind11::arg("path"), pybind11::arg("max_ctas"));
  m.def("bulk_supported", [](int device) { return megatron_paging::bulk_supported(device); },
        "Whether the bulk path runs on CUDA device `device` (sm90+, enough shared memory).");
  m.def("max_segments", []() { return megatron_paging::kMaxSegments; });
}
