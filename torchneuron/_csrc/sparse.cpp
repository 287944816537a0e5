// Sparse tensors on the neuron device: COO (SparsePrivateUse1) and compressed layouts
// (SparseCsrPrivateUse1: CSR, CSC, BSR, BSC).
//
// A sparse neuron tensor is ATen's own sparse tensor whose indices and values are
// dense neuron tensors; the constructors and metadata accessors below are ATen's
// layout-generic kernels. No sparse op runs on the device: every other sparse op
// takes a counted CPU fallback of its own, which moves the tensors to the CPU through
// those accessors, dispatches the op again (so the CPU kernel of each tensor's layout
// runs; the dense fallback would force the strided CPU kernel), and moves the results back.
#include "neuron.h"

#include <ATen/ops/_coalesced_native.h>
#include <ATen/ops/_indices_native.h>
#include <ATen/ops/_nnz_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_native.h>
#include <ATen/ops/_values_native.h>
#include <ATen/ops/ccol_indices_native.h>
#include <ATen/ops/col_indices_native.h>
#include <ATen/ops/crow_indices_native.h>
#include <ATen/ops/dense_dim_native.h>
#include <ATen/ops/empty_native.h>
#include <ATen/ops/indices_native.h>
#include <ATen/ops/is_coalesced_native.h>
#include <ATen/ops/row_indices_native.h>
#include <ATen/ops/sparse_dim_native.h>
#include <ATen/ops/values_native.h>
#include <torch/library.h>

namespace torchneuron {
namespace {

c10::IValue to_device(const c10::IValue& v, std::optional<c10::Device>* device, bool to_cpu) {
  auto move = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined()) return t;
    if (to_cpu) {
      if (!t.is_privateuseone()) return t;
      if (!device->has_value()) *device = t.device();
      return t.cpu();
    }
    return t.is_cpu() ? t.to(device->value()) : t;
  };
  if (v.isTensor()) return move(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> moved;
    for (const at::Tensor& t : v.toTensorList()) moved.push_back(move(t));
    return moved;
  }
  if (v.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> moved;
    for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
      moved.push_back(t.has_value() ? std::optional<at::Tensor>(move(*t)) : std::nullopt);
    }
    return moved;
  }
  return v;
}

void sparse_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& name = schema.operator_name();
  std::string full = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
  for (const auto& arg : schema.arguments()) {
    TORCH_CHECK_NOT_IMPLEMENTED(arg.alias_info() == nullptr || !arg.alias_info()->isWrite(), full,
                                ": in-place and out= variants of sparse ops are not supported on neuron; "
                                "use the out-of-place op");
  }
  record_fallback(full);
  size_t n = schema.arguments().size();
  std::optional<c10::Device> device;
  for (auto it = stack->end() - n; it != stack->end(); ++it) *it = to_device(*it, &device, true);
  op.callBoxed(stack);
  if (!device.has_value()) return;
  size_t r = schema.returns().size();
  for (auto it = stack->end() - r; it != stack->end(); ++it) *it = to_device(*it, &device, false);
}

TORCH_LIBRARY_IMPL(aten, SparsePrivateUse1, m) {
  m.impl("_sparse_coo_tensor_with_dims_and_tensors", TORCH_FN(at::native::new_with_dims_and_tensor_sparse_symint));
  m.impl("_sparse_coo_tensor_with_dims", TORCH_FN(at::native::new_with_dims_sparse));
  m.impl("empty.memory_format", TORCH_FN(at::native::empty_sparse_symint));
  m.impl("_indices", TORCH_FN(at::native::_indices_sparse));
  m.impl("_values", TORCH_FN(at::native::_values_sparse));
  m.impl("indices", TORCH_FN(at::native::indices_sparse));
  m.impl("values", TORCH_FN(at::native::values_sparse));
  m.impl("_nnz", TORCH_FN(at::native::_nnz_sparse));
  m.impl("sparse_dim", TORCH_FN(at::native::sparse_dim_sparse));
  m.impl("dense_dim", TORCH_FN(at::native::dense_dim_sparse));
  m.impl("_dimI", TORCH_FN(at::native::sparse_dim_sparse));
  m.impl("_dimV", TORCH_FN(at::native::dense_dim_sparse));
  m.impl("is_coalesced", TORCH_FN(at::native::is_coalesced_sparse));
  m.impl("_coalesced_", TORCH_FN(at::native::_coalesced_sparse_));
}

TORCH_LIBRARY_IMPL(aten, SparseCsrPrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(at::native::empty_sparse_compressed_symint));
  m.impl("crow_indices", TORCH_FN(at::native::crow_indices_sparse_csr));
  m.impl("col_indices", TORCH_FN(at::native::col_indices_sparse_csr));
  m.impl("ccol_indices", TORCH_FN(at::native::ccol_indices_sparse_csr));
  m.impl("row_indices", TORCH_FN(at::native::row_indices_sparse_csr));
  m.impl("values", TORCH_FN(at::native::values_sparse_csr));
  m.impl("_nnz", TORCH_FN(at::native::_nnz_sparse_csr));
  m.impl("sparse_dim", TORCH_FN(at::native::sparse_dim_sparse_csr));
  m.impl("dense_dim", TORCH_FN(at::native::dense_dim_sparse_csr));
}

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_fallback>());
}

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_fallback>());
}

}  // namespace
}  // namespace torchneuron
