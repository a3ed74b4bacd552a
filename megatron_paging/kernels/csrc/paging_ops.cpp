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
//
// No C++ exception leaves this file: every check returns its message ("" = fine) and the Python
// wrapper raises it. (A C++ exception unwinding through this extension crashed the process on
// the lent GPU machine's toolchain, while the same build passed on the development machine.)

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "paging.h"

namespace megatron_paging {
void register_weighted_swiglu(pybind11::module& m);  // weighted_swiglu_ops.cpp
}  // namespace megatron_paging

namespace megatron_paging {
namespace {

// Messages are built by plain std::string appends, not std::ostringstream (c10::str): on the
// lent GPU machine, where the extension is compiled by another GCC than torch's, formatting
// through a stream inside the extension crashed the process, while the same build worked here.
inline void append(std::string& out, const char* text) { out += text; }
inline void append(std::string& out, const std::string& text) { out += text; }
inline void append(std::string& out, const c10::Device& device) { out += device.str(); }
inline void append(std::string& out, at::ScalarType dtype) { out += c10::toString(dtype); }
inline void append(std::string& out, c10::IntArrayRef sizes) {
  out += "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(sizes[i]);
  }
  out += "]";
}
template <typename Int, typename = std::enable_if_t<std::is_integral_v<Int>>>
inline void append(std::string& out, Int value) {
  out += std::to_string(value);
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string out = "megatron_paging: ";
  (append(out, parts), ...);
  return out;
}

// Return the message (never throw) when a requirement does not hold.
#define PAGING_REQUIRE(cond, ...) \
  do {                            \
    if (!(cond)) return message(__VA_ARGS__); \
  } while (0)
#define PAGING_FORWARD(expr)              \
  do {                                    \
    std::string paging_error_ = (expr);   \
    if (!paging_error_.empty()) return paging_error_; \
  } while (0)

std::string check_on(const at::Tensor& t, const char* name, const at::Device& device,
                     at::ScalarType dtype) {
  PAGING_REQUIRE(t.device() == device, name, " is on ", t.device(), " but the pool is on ",
                 device);
  PAGING_REQUIRE(t.scalar_type() == dtype, name, " must be ", c10::toString(dtype), ", got ",
                 t.scalar_type());
  PAGING_REQUIRE(t.is_contiguous(), name, " must be contiguous");
  return {};
}

std::string check_rows(const at::Tensor& t, const char* name, int64_t row_bytes,
                       int64_t page_size) {
  PAGING_REQUIRE(t.dim() == 2 && t.size(1) == row_bytes, name, " must be [rows, ", row_bytes,
                 "] bytes, got ", t.sizes());
  PAGING_REQUIRE(t.size(0) % page_size == 0, name, " has ", t.size(0),
                 " rows, not a multiple of page_size ", page_size);
  return {};
}

// The device address of pinned host memory (null for a pool without a host tier). Asked of the
// runtime once per pool, which also proves the memory is pinned and mapped.
std::string mapped_host_pages(const at::Tensor& host_pages, uint8_t** out) {
  *out = nullptr;
  if (host_pages.numel() == 0) return {};
  PAGING_REQUIRE(host_pages.device().is_cpu(), "host_pages must be a CPU tensor");
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, host_pages.data_ptr());
  if (err != cudaSuccess) (void)cudaGetLastError();  // not a launch error: do not leave it set
  PAGING_REQUIRE(err == cudaSuccess && attr.type == cudaMemoryTypeHost && attr.devicePointer,
                 "host_pages must be pinned host memory mapped into the device address space "
                 "(allocate it with pin_memory=True); cudaPointerGetAttributes: ",
                 cudaGetErrorString(err));
  *out = static_cast<uint8_t*>(attr.devicePointer);
  return {};
}

struct Pool {
  // Held so the pointers in `view` stay valid for the handle's life.
  std::vector<at::Tensor> tensors;
  at::Device device{at::kCPU};
  PoolView view{};

  // Checks the tensors and fills the handle; returns the first problem ("" = fine).
  std::string init(at::Tensor cuda_pages, at::Tensor host_pages, at::Tensor free_list_cuda,
                   at::Tensor free_list_host, at::Tensor head, at::Tensor tail,
                   at::Tensor capacity, at::Tensor flags, at::Tensor stashes_after_overflow,
                   at::Tensor done_counter, int64_t page_size, int64_t row_bytes) {
    PAGING_REQUIRE(cuda_pages.is_cuda(), "cuda_pages must be a CUDA tensor");
    device = cuda_pages.device();
    PAGING_REQUIRE(row_bytes > 0, "row_bytes must be positive, got ", row_bytes);
    PAGING_REQUIRE(page_size > 0, "page_size must be positive, got ", page_size);
    PAGING_FORWARD(check_on(cuda_pages, "cuda_pages", device, at::kByte));
    PAGING_FORWARD(check_rows(cuda_pages, "cuda_pages", row_bytes, page_size));
    PAGING_REQUIRE(host_pages.scalar_type() == at::kByte && host_pages.is_contiguous(),
                   "host_pages must be a contiguous uint8 tensor");
    PAGING_FORWARD(check_rows(host_pages, "host_pages", row_bytes, page_size));
    PAGING_FORWARD(check_on(free_list_cuda, "free_list_cuda", device, at::kLong));
    PAGING_FORWARD(check_on(free_list_host, "free_list_host", device, at::kLong));
    PAGING_FORWARD(check_on(head, "free_list_head", device, at::kLong));
    PAGING_FORWARD(check_on(tail, "free_list_tail", device, at::kLong));
    PAGING_FORWARD(check_on(capacity, "free_list_capacity", device, at::kLong));
    PAGING_FORWARD(check_on(flags, "flags", device, at::kLong));
    PAGING_FORWARD(check_on(stashes_after_overflow, "stashes_after_overflow", device, at::kLong));
    PAGING_FORWARD(check_on(done_counter, "done_counter", device, at::kInt));
    PAGING_REQUIRE(head.numel() == 2 && tail.numel() == 2 && capacity.numel() == 2,
                   "free_list_head/tail/capacity must hold 2 entries (device, host)");
    PAGING_REQUIRE(flags.numel() == 3,
                   "flags must hold 3 entries (overflow, host_spill, invalid_live)");
    PAGING_REQUIRE(stashes_after_overflow.numel() >= 1,
                   "stashes_after_overflow must hold 1 entry");
    PAGING_REQUIRE(done_counter.numel() >= 1, "done_counter must hold 1 entry");
    // A second entry, when there is one, is the bulk path's tile ticket.
    view.num_pages[0] = cuda_pages.size(0) / page_size;
    view.num_pages[1] = host_pages.size(0) / page_size;
    PAGING_REQUIRE(free_list_cuda.numel() >= view.num_pages[0], "free_list_cuda has ",
                   free_list_cuda.numel(), " entries for ", view.num_pages[0], " pages");
    PAGING_REQUIRE(free_list_host.numel() >= view.num_pages[1], "free_list_host has ",
                   free_list_host.numel(), " entries for ", view.num_pages[1], " pages");
    const c10::cuda::CUDAGuard guard(device);
    PAGING_FORWARD(mapped_host_pages(host_pages, &view.pages[1]));
    view.pages[0] = cuda_pages.data_ptr<uint8_t>();
    view.ring[0] = free_list_cuda.data_ptr<int64_t>();
    view.ring[1] = free_list_host.data_ptr<int64_t>();
    view.head = head.data_ptr<int64_t>();
    view.tail = tail.data_ptr<int64_t>();
    view.capacity = capacity.data_ptr<int64_t>();
    view.flags = flags.data_ptr<int64_t>();
    view.stashes_after_overflow = stashes_after_overflow.data_ptr<int64_t>();
    view.done_counter = reinterpret_cast<unsigned int*>(done_counter.data_ptr<int32_t>());
    view.tile_ticket = done_counter.numel() >= 2 ? view.done_counter + 1 : nullptr;
    view.page_size = page_size;
    view.row_bytes = row_bytes;
    tensors = {cuda_pages, host_pages, free_list_cuda,         free_list_host, head,
               tail,       capacity,   flags, stashes_after_overflow, done_counter};
    return {};
  }
};

struct Layout {
  int64_t capacity_rows = 0;
  int64_t row_bytes = 0;
  int64_t page_size = 0;
  std::vector<int64_t> start;
  std::vector<int64_t> rows;
  std::vector<int64_t> slot_offset;
  int64_t max_slots = 0;

  // Checks the segment table and fills the handle; returns the first problem ("" = fine).
  std::string init(int64_t capacity, int64_t row_size, int64_t page, std::vector<int64_t> starts,
                   std::vector<int64_t> segment_rows, std::vector<int64_t> slot_offsets) {
    const int64_t n = static_cast<int64_t>(segment_rows.size());
    PAGING_REQUIRE(capacity > 0 && row_size > 0 && page > 0,
                   "capacity_rows, row_bytes and page_size must be positive");
    PAGING_REQUIRE(n >= 1 && n <= kMaxSegments, "a record needs 1 to ", kMaxSegments,
                   " segments, got ", n);
    PAGING_REQUIRE(static_cast<int64_t>(starts.size()) == n &&
                       static_cast<int64_t>(slot_offsets.size()) == n,
                   "segment_starts, segment_rows and slot_offsets differ in length");
    int64_t end = 0;
    int64_t slots = 0;
    for (int64_t s = 0; s < n; ++s) {
      PAGING_REQUIRE(starts[s] >= end && segment_rows[s] >= 0,
                     "segments must be sorted and disjoint (segment ", s, ")");
      PAGING_REQUIRE(slot_offsets[s] == slots, "slot_offsets[", s, "] is ", slot_offsets[s],
                     ", expected ", slots);
      end = starts[s] + segment_rows[s];
      slots += (segment_rows[s] + page - 1) / page;
    }
    PAGING_REQUIRE(end <= capacity, "segments end at row ", end, " but the buffer has ",
                   capacity, " rows");
    capacity_rows = capacity;
    row_bytes = row_size;
    page_size = page;
    start = std::move(starts);
    rows = std::move(segment_rows);
    slot_offset = std::move(slot_offsets);
    max_slots = slots;
    return {};
  }

  LayoutView view() const {
    return LayoutView{static_cast<int>(rows.size()), start.data(), rows.data(),
                      slot_offset.data(), max_slots};
  }
};

std::string copy(bool reload, const at::Tensor& user, const Pool& pool, const Layout& layout,
                 const at::Tensor& live_rows, const at::Tensor& page_record,
                 const at::Tensor& spilled_to_host, const at::Tensor& record_state,
                 int64_t path, int64_t max_ctas) {
  const at::Device& device = pool.device;
  PAGING_REQUIRE(layout.row_bytes == pool.view.row_bytes && layout.page_size == pool.view.page_size,
                 "the record's layout (row_bytes ", layout.row_bytes, ", page_size ",
                 layout.page_size, ") does not match the pool's (", pool.view.row_bytes, ", ",
                 pool.view.page_size, ")");
  PAGING_REQUIRE(user.device() == device, "the user buffer is on ", user.device(),
                 " but the pool is on ", device);
  PAGING_REQUIRE(user.is_contiguous(), "the user buffer must be contiguous");
  PAGING_REQUIRE(static_cast<int64_t>(user.nbytes()) == layout.capacity_rows * layout.row_bytes,
                 "the user buffer holds ", user.nbytes(), " bytes, the record ",
                 layout.capacity_rows * layout.row_bytes);
  PAGING_FORWARD(check_on(live_rows, "live_rows", device, at::kLong));
  PAGING_FORWARD(check_on(page_record, "page_record", device, at::kLong));
  PAGING_FORWARD(check_on(spilled_to_host, "spilled_to_host", device, at::kLong));
  PAGING_FORWARD(check_on(record_state, "record_state", device, at::kLong));
  PAGING_REQUIRE(live_rows.numel() == static_cast<int64_t>(layout.rows.size()), "live_rows has ",
                 live_rows.numel(), " entries for ", layout.rows.size(), " segments");
  PAGING_REQUIRE(page_record.numel() >= layout.max_slots, "page_record has ",
                 page_record.numel(), " slots, the segments need ", layout.max_slots);
  PAGING_REQUIRE(spilled_to_host.numel() == 1, "spilled_to_host must hold 1 entry");
  PAGING_REQUIRE(record_state.numel() == 1, "record_state must hold 1 entry");
  PAGING_REQUIRE(path == static_cast<int64_t>(CopyPath::kTile) ||
                     path == static_cast<int64_t>(CopyPath::kBulk),
                 "path must be 0 (tile) or 1 (bulk), got ", path);

  const c10::cuda::CUDAGuard guard(device);
  CopyLaunch launch{};
  launch.reload = reload;
  launch.path = static_cast<CopyPath>(path);
  launch.user = static_cast<uint8_t*>(user.data_ptr());
  launch.live_rows = live_rows.data_ptr<int64_t>();
  launch.page_record = page_record.data_ptr<int64_t>();
  launch.record_slots = page_record.numel();
  launch.spilled_to_host = spilled_to_host.data_ptr<int64_t>();
  launch.record_state = record_state.data_ptr<int64_t>();
  launch.pool = pool.view;
  launch.layout = layout.view();
  launch.max_ctas = static_cast<int>(max_ctas);
  const cudaError_t err = launch_copy(launch, c10::cuda::getCurrentCUDAStream().stream());
  PAGING_REQUIRE(err == cudaSuccess, reload ? "reload" : "stash", " launch failed: ",
                 cudaGetErrorString(err));
  return {};
}

// A handle and "" when the arguments pass its checks, else None and the message.
template <typename Handle, typename... Args>
pybind11::tuple make_handle(Args&&... args) {
  Handle handle;
  std::string error = handle.init(std::forward<Args>(args)...);
  if (!error.empty()) return pybind11::make_tuple(pybind11::none(), error);
  return pybind11::make_tuple(pybind11::cast(std::move(handle)), std::string());
}

}  // namespace
}  // namespace megatron_paging

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using megatron_paging::Layout;
  using megatron_paging::Pool;
  m.doc() =
      "megatron-paging stash/reload kernels (megatron_paging/kernels/cuda_ops.py) and the "
      "experts' fused weighted SwiGLU (megatron_paging/kernels/weighted_swiglu.py)";
  pybind11::class_<Pool>(m, "Pool");
  pybind11::class_<Layout>(m, "Layout");
  m.def("make_pool",
        [](at::Tensor cuda_pages, at::Tensor host_pages, at::Tensor free_list_cuda,
           at::Tensor free_list_host, at::Tensor head, at::Tensor tail, at::Tensor capacity,
           at::Tensor flags, at::Tensor stashes_after_overflow, at::Tensor done_counter,
           int64_t page_size, int64_t row_bytes) {
          return megatron_paging::make_handle<Pool>(
              cuda_pages, host_pages, free_list_cuda, free_list_host, head, tail, capacity, flags,
              stashes_after_overflow, done_counter, page_size, row_bytes);
        },
        "(Pool, '') for a pool's tensors, or (None, the problem).");
  m.def("make_layout",
        [](int64_t capacity_rows, int64_t row_bytes, int64_t page_size,
           std::vector<int64_t> starts, std::vector<int64_t> rows,
           std::vector<int64_t> slot_offsets) {
          return megatron_paging::make_handle<Layout>(capacity_rows, row_bytes, page_size,
                                                      std::move(starts), std::move(rows),
                                                      std::move(slot_offsets));
        },
        "(Layout, '') for a segment table, or (None, the problem).");
  m.def("copy", &megatron_paging::copy,
        "One stash (reload=False) or reload of one record (one launch); '' or the problem.",
        pybind11::arg("reload"), pybind11::arg("user"), pybind11::arg("pool"),
        pybind11::arg("layout"), pybind11::arg("live_rows"), pybind11::arg("page_record"),
        pybind11::arg("spilled_to_host"), pybind11::arg("record_state"), pybind11::arg("path"),
        pybind11::arg("max_ctas"));
  m.def("bulk_supported", [](int device) { return megatron_paging::bulk_supported(device); },
        "Whether the bulk path runs on CUDA device `device` (sm90+, enough shared memory).");
  // The values the Python side mirrors (cuda_ops.py, record.py, pool.py): a test compares them.
  m.def("constants", []() {
    pybind11::dict out;
    out["tile"] = static_cast<int>(megatron_paging::CopyPath::kTile);
    out["bulk"] = static_cast<int>(megatron_paging::CopyPath::kBulk);
    out["record_empty"] = megatron_paging::kRecordEmpty;
    out["record_stashed"] = megatron_paging::kRecordStashed;
    out["record_reloaded"] = megatron_paging::kRecordReloaded;
    out["invalid_live_count"] = megatron_paging::kInvalidLiveCount;
    out["invalid_reload"] = megatron_paging::kInvalidReload;
    out["max_segments"] = megatron_paging::kMaxSegments;
    return out;
  });
  megatron_paging::register_weighted_swiglu(m);
}
