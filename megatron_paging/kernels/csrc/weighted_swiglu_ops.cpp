// Python bindings of the fused prob-weighted SwiGLU (weighted_swiglu.h): two launches that
// write into tensors the caller allocated. Like paging_ops.cpp, no C++ exception leaves here:
// each returns "" or the problem, and megatron_paging/kernels/weighted_swiglu.py raises it
// (that wrapper also does the user-facing argument checks; these are the last guard).

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <string>

#include "weighted_swiglu.h"

namespace megatron_paging {
namespace {

bool act_dtype(const at::Tensor& t, ActDtype* out) {
  switch (t.scalar_type()) {
    case at::kFloat: *out = ActDtype::kFloat32; return true;
    case at::kBFloat16: *out = ActDtype::kBFloat16; return true;
    case at::kHalf: *out = ActDtype::kFloat16; return true;
    default: return false;
  }
}

// "" when t is a contiguous CUDA tensor on fc1's device with n elements and fc1's dtype (or
// probs' for the probs-shaped ones).
std::string check(const at::Tensor& t, const char* name, const at::Tensor& like, int64_t n) {
  std::string problem;
  if (!t.is_cuda() || t.device() != like.device()) {
    problem = std::string(name) + " must be on fc1's CUDA device";
  } else if (!t.is_contiguous()) {
    problem = std::string(name) + " must be contiguous";
  } else if (t.scalar_type() != like.scalar_type()) {
    problem = std::string(name) + " has the wrong dtype";
  } else if (t.numel() != n) {
    problem = std::string(name) + " has " + std::to_string(t.numel()) + " elements, expected " +
              std::to_string(n);
  }
  return problem;
}

std::string launch(bool backward, const at::Tensor& fc1, const at::Tensor& probs,
                   const at::Tensor* dinter, const at::Tensor& out, const at::Tensor* inter,
                   const at::Tensor* dprobs) {
  SwigluLaunch a{};
  if (!fc1.is_cuda() || fc1.dim() != 2 || fc1.size(1) % 2 != 0 || !fc1.is_contiguous()) {
    return "fc1 must be a contiguous 2-D CUDA tensor with an even number of columns";
  }
  if (!act_dtype(fc1, &a.fc1_dtype)) return "fc1 must be float32, bfloat16 or float16";
  if (!act_dtype(probs, &a.probs_dtype)) return "probs must be float32, bfloat16 or float16";
  a.rows = fc1.size(0);
  a.cols = fc1.size(1) / 2;
  std::string problem = check(probs, "probs", probs, a.rows);
  if (problem.empty() && !(probs.device() == fc1.device())) problem = "probs must be on fc1's device";
  if (problem.empty()) problem = check(out, backward ? "dfc1" : "inter", fc1,
                                       backward ? 2 * a.rows * a.cols : a.rows * a.cols);
  if (problem.empty() && backward) {
    problem = check(*dinter, "dinter", fc1, a.rows * a.cols);
    if (problem.empty() && inter->numel() > 0) {
      problem = check(*inter, "inter", fc1, a.rows * a.cols);
    }
    if (problem.empty()) problem = check(*dprobs, "dprobs", probs, a.rows);
  }
  if (!problem.empty()) return problem;
  a.fc1 = fc1.data_ptr();
  a.probs = probs.data_ptr();
  a.out = out.data_ptr();
  if (backward) {
    a.dinter = dinter->data_ptr();
    a.inter = inter->numel() > 0 ? inter->data_ptr() : nullptr;
    a.dprobs = dprobs->data_ptr();
  }
  const c10::cuda::CUDAGuard guard(fc1.device());
  const cudaError_t err =
      launch_weighted_swiglu(a, backward, c10::cuda::getCurrentCUDAStream().stream());
  if (err != cudaSuccess) {
    return std::string(backward ? "weighted_swiglu backward" : "weighted_swiglu forward") +
           " launch failed: " + cudaGetErrorString(err);
  }
  return {};
}

}  // namespace

void register_weighted_swiglu(pybind11::module& m) {
  m.def(
      "weighted_swiglu_forward",
      [](const at::Tensor& fc1, const at::Tensor& probs, const at::Tensor& inter) {
        return launch(false, fc1, probs, nullptr, inter, nullptr, nullptr);
      },
      "inter = silu(gate) * linear * probs (one launch); '' or the problem.",
      pybind11::arg("fc1"), pybind11::arg("probs"), pybind11::arg("inter"));
  m.def(
      "weighted_swiglu_backward",
      [](const at::Tensor& fc1, const at::Tensor& probs, const at::Tensor& dinter,
         const at::Tensor& dfc1, const at::Tensor& inter, const at::Tensor& dprobs) {
        return launch(true, fc1, probs, &dinter, dfc1, &inter, &dprobs);
      },
      "dfc1 (may be fc1 itself), dprobs and, unless inter is empty, inter (may be dinter "
      "itself) in one launch; '' or the problem.",
      pybind11::arg("fc1"), pybind11::arg("probs"), pybind11::arg("dinter"),
      pybind11::arg("dfc1"), pybind11::arg("inter"), pybind11::arg("dprobs"));
}

}  // namespace megatron_paging
