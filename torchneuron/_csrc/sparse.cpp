// Sparse tensors on the neuron device: COO (SparsePrivateUse1) and compressed layouts
// (SparseCsrPrivateUse1: CSR, CSC, BSR, BSC).
//
// A sparse neuron tensor is ATen's own sparse tensor whose indices and values are
// dense neuron tensors; the constructors and metadata accessors below are ATen's
// layout-generic kernels. No sparse op runs on the device: every other sparse op
// takes a counted CPU fallback of its own, which moves the tensors to the CPU through
// those accessors, dispatches the op again (so the CPU kernel of each tensor's layout
// runs; the dense fallback would force the strided CPU kernel), and moves the results back.
// In-place and out= variants (SparseAdam's dense.add_(sparse)) write their CPU results back
// into the caller's neuron tensors and return those tensors: a dense target by copy_, a COO
// one by re-pointing it at device copies of the result's indices and values (a sparse copy_
// would come back to this fallback); writes into compressed layouts are refused.
#include "neuron.h"

#include <ATen/native/SparseTensorUtils.h>

#include <ATen/ops/_coalesced_native.h>
#include <ATen/ops/_indices_native.h>
#include <ATen/ops/_nnz_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_native.h>
#include <ATen/ops/_values_native.h>
#include <ATen/ops/ccol_indices_native.h>
#include <ATen/ops/clone_native.h>
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
      // the copy keeps the input's requires_grad: CPU kernels read it to decide what to save for the
      // backward (sparse.mm's amax/amin reduction returns its argmax only then; its backward indexes it)
      at::Tensor moved = t.cpu();
      if (t.requires_grad() && moved.is_floating_point()) moved.requires_grad_(true);
      return moved;
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

// ``target`` (a neuron tensor an op wrote on the CPU) takes the CPU ``result``'s value.
void write_back(const at::Tensor& target, const at::Tensor& result) {
  c10::Device device = target.device();
  TORCH_CHECK(target.layout() == result.layout(), "sparse fallback: the op changed the layout of its output");
  if (target.layout() == at::kStrided) {
    if (target.sizes() != result.sizes()) target.resize_(result.sizes());
    target.copy_(result);
  } else if (target.layout() == at::kSparse) {
    at::sparse::get_sparse_impl(target)->resize_(result.sparse_dim(), result.dense_dim(), result.sizes());
    at::sparse::alias_into_sparse(target, result._indices().to(device), result._values().to(device));
    at::sparse::get_sparse_impl(target)->set_coalesced(result.is_coalesced());
  } else {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "in-place and out= variants of sparse ops writing a ", target.layout(),
                                " tensor are not supported on neuron; use the out-of-place op");
  }
}

// ``_copy_from(src, dst)``, which ``copy_`` calls for a sparse tensor of another device: a copy on
// the CPU, written back into a neuron ``dst`` (a transfer, not a fallback: not counted).
void sparse_copy_from(torch::jit::Stack* stack) {
  bool non_blocking = stack->back().toBool();
  at::Tensor dst = (*stack)[stack->size() - 2].toTensor();
  at::Tensor src = (*stack)[stack->size() - 3].toTensor();
  at::Tensor result = dst.is_privateuseone() ? dst.cpu() : dst;
  result.copy_(src.is_privateuseone() ? src.cpu() : src, non_blocking);
  if (dst.is_privateuseone()) write_back(dst, result);
  torch::jit::drop(*stack, 3);
  torch::jit::push(*stack, dst);
}

void sparse_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& name = schema.operator_name();
  if (name.name == "aten::_copy_from" && name.overload_name.empty()) return sparse_copy_from(stack);
  std::string full = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
  const auto& args = schema.arguments();
  size_t n = args.size();
  // (neuron target, its CPU stand-in) of every argument the op writes
  std::vector<std::pair<at::Tensor, at::Tensor>> written;
  for (size_t i = 0; i < n; ++i) {
    bool writes = args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
    const c10::IValue& v = (*stack)[stack->size() - n + i];
    TORCH_CHECK_NOT_IMPLEMENTED(!writes || v.isTensor() || v.isNone(), full,
                                ": out= variants writing a list of sparse tensors are not supported on neuron");
    TORCH_CHECK_NOT_IMPLEMENTED(!writes || !v.isTensor() || v.toTensor().layout() == at::kStrided ||
                                    v.toTensor().layout() == at::kSparse,
                                full, ": in-place and out= variants of sparse ops writing a ",
                                v.toTensor().layout(), " tensor are not supported on neuron; use the out-of-place op");
    if (writes && v.isTensor() && v.toTensor().is_privateuseone()) written.emplace_back(v.toTensor(), at::Tensor());
  }
  record_fallback(full);
  std::optional<c10::Device> device;
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    auto it = stack->end() - n + i;
    bool writes = args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
    bool on_device = it->isTensor() && it->toTensor().is_privateuseone();
    *it = to_device(*it, &device, true);
    if (writes && on_device) written[k++].second = it->toTensor();
  }
  op.callBoxed(stack);
  for (auto& [target, result] : written) write_back(target, result);
  if (!device.has_value()) return;
  const auto& returns = schema.returns();
  size_t r = returns.size();
  for (size_t i = 0; i < r; ++i) {
    auto it = stack->end() - r + i;
    const c10::IValue& v = *it;
    bool aliased = returns[i].alias_info() != nullptr && returns[i].alias_info()->isWrite() && v.isTensor();
    auto same = aliased ? std::find_if(written.begin(), written.end(),
                                       [&](const auto& w) { return w.second.is_same(v.toTensor()); })
                        : written.end();
    *it = same != written.end() ? c10::IValue(same->first) : to_device(v, &device, false);
  }
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
  m.impl("clone", TORCH_FN(at::native::clone_sparse));
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
  m.impl("clone", TORCH_FN(at::native::clone_sparse_compressed));
}

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_fallback>());
}

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_fallback>());
}

}  // namespace
}  // namespace torchneuron
