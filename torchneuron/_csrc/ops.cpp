// The ATen ops PyTorch needs from any device (creation, views, copies, scalars),
// the catch-all CPU fallback, the convolution entry points, and autocast.
// All of them reuse at::native; device kernels are registered from Python.
#include "neuron.h"

#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace torchneuron {
namespace {

c10::DeviceIndex index_or_current(std::optional<c10::Device> device) {
  if (device.has_value() && device->has_index()) return device->index();
  return current_device();
}

// Under torch.use_deterministic_algorithms(True) (with torch.utils.deterministic.fill_uninitialized_memory,
// the default), new memory is filled as on the CPU and CUDA: NaN for floats, the largest value for integers.
// The fill is a device op; allocations it makes itself are not filled again.
thread_local bool filling_empty = false;

at::Tensor fill_if_deterministic(at::Tensor t) {
  if (C10_UNLIKELY(!filling_empty && at::globalContext().deterministicAlgorithms() &&
                   at::globalContext().deterministicFillUninitializedMemory() && t.numel() > 0)) {
    filling_empty = true;
    try {
      at::native::fill_empty_deterministic_(t);
    } catch (...) {
      filling_empty = false;
      throw;
    }
    filling_empty = false;
  }
  return t;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  c10::ScalarType st = c10::dtype_or_default(dtype);
  c10::DeviceIndex index = index_or_current(device);
  check_device_index(index);
  c10::DeviceGuard guard(c10::Device(kNeuron, index));
  return fill_if_deterministic(at::detail::empty_generic(
      size, hbm_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), st, memory_format));
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  c10::ScalarType st = c10::dtype_or_default(dtype);
  c10::DeviceIndex index = index_or_current(device);
  check_device_index(index);
  c10::DeviceGuard guard(c10::Device(kNeuron, index));
  return fill_if_deterministic(at::detail::empty_strided_generic(
      size, stride, hbm_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), st));
}

// Device memory is host memory, so the CPU resize path applies: it grows the storage
// through the storage's own allocator (ours) on the current device, which the guard
// makes the tensor's device.
const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(self.device());
  auto* impl = self.unsafeGetTensorImpl();
  at::native::resize_impl_cpu_(impl, size, std::nullopt, /*resize_storage=*/true);
  if (memory_format.has_value()) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve, "Unsupported memory format", *memory_format);
    impl->empty_tensor_restride(*memory_format);
  }
  return self;
}

// A CPU alias of a neuron tensor that keeps its lazy conjugate and negative bits (a.conj(),
// a.conj().imag), so that a copy or a scalar read through it sees the values the tensor means.
at::Tensor host_values(const at::Tensor& t) {
  at::Tensor host = alias_as_cpu(t);
  if (t.is_conj()) host._set_conj(true);
  if (t.is_neg()) host._set_neg(true);
  return host;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.defined() && dst.defined(), "copy: undefined tensor");
  at::Tensor src_host = self.is_privateuseone() ? host_values(self) : self;
  at::Tensor dst_host = dst.is_privateuseone() ? host_values(dst) : dst;
  dst_host.copy_(src_host, non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) { return at::_local_scalar_dense(host_values(self)); }

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  int64_t new_size = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return self.set_(source, 0, new_size, {});
}

at::Tensor& set_source_storage_offset(at::Tensor& self, at::Storage source, int64_t offset, c10::IntArrayRef size,
                                      c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset, size, stride);
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) { return at::native::set_tensor_(self, source); }

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, hbm_allocator(), /*resizable=*/true);
  return self.set_(storage, 0, {0}, {});
}

// ---- CPU fallback -------------------------------------------------------

std::atomic<bool> g_strict{false};
std::mutex g_counts_mutex;
std::unordered_map<std::string, int64_t> g_counts;

std::string op_name(const c10::OperatorHandle& op) {
  const auto& n = op.schema().operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

// PyTorch's rule: tensors of one op live on one device, except CPU scalars (0-dim),
// and index tensors, which may stay on the CPU.
void check_same_device(const std::string& name, const torch::jit::Stack& args) {
  std::optional<c10::Device> neuron_device, other;
  bool allow_cpu_lists = name.rfind("aten::index", 0) == 0 || name.rfind("aten::_index_put", 0) == 0;
  auto visit = [&](const at::Tensor& t, bool in_list) {
    if (!t.defined()) return;
    if (t.is_privateuseone()) {
      if (!neuron_device) neuron_device = t.device();
      else if (*neuron_device != t.device()) other = t.device();
    } else if (t.is_cpu()) {
      if (t.dim() == 0 || (in_list && allow_cpu_lists)) return;
      if (!other) other = t.device();
    }
  };
  for (const auto& v : args) {
    if (v.isTensor()) visit(v.toTensor(), false);
    else if (v.isTensorList()) for (const at::Tensor& t : v.toTensorList()) visit(t, true);
    else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) if (e.isTensor()) visit(e.toTensor(), true);
    }
  }
  if (neuron_device && other) {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ",
                *neuron_device, " and ", *other, "! (when checking arguments for ", name, ")");
  }
}

// The neuron device an op runs on: its first neuron tensor or device argument.
std::optional<c10::DeviceIndex> device_of_args(const torch::jit::Stack& args) {
  for (const auto& v : args) {
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_privateuseone()) return v.toTensor().device().index();
    if (v.isDevice() && v.toDevice().is_privateuseone()) {
      return v.toDevice().has_index() ? v.toDevice().index() : current_device();
    }
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) if (t.defined() && t.is_privateuseone()) return t.device().index();
    }
  }
  return std::nullopt;
}

// The fallback hands each argument to the CPU kernel as a separate host copy, which
// hides aliasing from the CPU kernel's own check; so check here what CPU refuses: an
// output that partially overlaps an input (full overlap, i.e. in place, is fine).
void check_no_partial_overlap(const c10::FunctionSchema& schema, const torch::jit::Stack& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = schema.arguments()[i].alias_info();
    if (alias == nullptr || !alias->isWrite() || !args[i].isTensor()) continue;
    const at::Tensor& written = args[i].toTensor();
    if (!written.defined() || written.layout() != c10::kStrided) continue;
    auto strided = [](const at::Tensor& t) { return t.defined() && t.layout() == c10::kStrided; };
    for (size_t j = 0; j < args.size(); ++j) {
      if (j == i) continue;
      if (args[j].isTensor() && strided(args[j].toTensor())) {
        at::assert_no_partial_overlap(written, args[j].toTensor());
      } else if (args[j].isTensorList()) {
        for (const at::Tensor& t : args[j].toTensorList()) if (strided(t)) at::assert_no_partial_overlap(written, t);
      }
    }
  }
}

void neuron_cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  std::string name = op_name(op);
  size_t n = schema.arguments().size();
  auto first = stack->end() - n;
  torch::jit::Stack args(first, stack->end());
  check_same_device(name, args);
  check_no_partial_overlap(schema, args);
  std::optional<c10::DeviceIndex> device = device_of_args(args);
  // A conjugate or negative view the op reads (a.conj(), a.conj().imag) is resolved here, into a new device
  // tensor by a host copy: the generic fallback's transfer to the CPU would resolve it by a device copy_,
  // whose own fallback would come back here with the same view.
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = *(first + i);
    const c10::AliasInfo* alias = schema.arguments()[i].alias_info();
    if (!v.isTensor() || (alias != nullptr && alias->isWrite())) continue;
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.is_privateuseone() && t.layout() == c10::kStrided && (t.is_conj() || t.is_neg())) {
      at::Tensor resolved = at::empty(t.sizes(), t.options());
      copy_from(t, resolved, false);
      v = c10::IValue(resolved);
    }
  }
  // Random ops draw from the neuron generator: a neuron generator argument is
  // replaced by the CPU generator it wraps, and a missing one by the default
  // generator of the op's device. Generators of another device are refused, as CUDA does.
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = *(first + i);
    const auto& type = schema.arguments()[i].type();
    bool generator_arg = type->kind() == c10::TypeKind::GeneratorType ||
                         (type->kind() == c10::TypeKind::OptionalType &&
                          type->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::GeneratorType);
    if (!generator_arg) continue;
    if (v.isGenerator()) {
      at::Generator g = v.toGenerator();
      TORCH_CHECK(device.has_value() || !g.device().is_privateuseone(),
                  "Expected a 'cpu' device type for generator but found '", g.device().type(), "'");
      TORCH_CHECK(g.device().is_privateuseone(), "Expected a 'neuron' device type for generator but found '",
                  g.device().type(), "'");
      v = c10::IValue(cpu_generator_of(g));
    } else if (v.isNone()) {
      v = c10::IValue(cpu_generator_of(default_neuron_generator(device.value_or(current_device()))));
    }
  }
  record_fallback(name);
  at::native::cpu_fallback(op, stack);
}

// native_dropout has no generator argument, so it would draw from the CPU generator
// if it fell back as is: draw the mask from the neuron generator instead.
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  record_fallback("aten::native_dropout");
  if (!train.has_value() || *train) {
    double keep = 1.0 - p;
    double scale = keep == 0.0 ? 0.0 : 1.0 / keep;
    at::Tensor host = alias_as_cpu(input);
    at::Tensor mask = at::empty(input.sizes(), host.options());
    mask.bernoulli_(keep, cpu_generator_of(default_neuron_generator(input.device().index())));
    at::Tensor out = host.mul(mask).mul_(scale);
    return {out.to(input.device()), mask.to(at::kBool).to(input.device())};
  }
  return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
}

// native_batch_norm updates running_mean / running_var in place, but its schema does
// not mark them as written, so the generic fallback would update host copies and drop
// the result. Run the CPU kernel over aliases of the device memory instead.
std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps) {
  torch::jit::Stack args{input, weight, bias, running_mean, running_var};
  check_same_device("aten::native_batch_norm", args);
  record_fallback("aten::native_batch_norm");
  auto host = [](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (!t.has_value() || !t->defined()) return std::nullopt;
    return t->is_privateuseone() ? alias_as_cpu(*t) : *t;
  };
  auto [out, mean, invstd] = at::native_batch_norm(alias_as_cpu(input), host(weight), host(bias), host(running_mean),
                                                   host(running_var), training, momentum, eps);
  return {out.to(input.device()), mean.to(input.device()), invstd.to(input.device())};
}

// Convolution reaches a backend only through these two ops, whose default kernels
// raise, so the catch-all fallback never sees them.
at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
                                    c10::IntArrayRef output_padding, int64_t groups) {
  record_fallback("aten::convolution_overrideable");
  std::optional<at::Tensor> bias_cpu;
  if (bias.has_value() && bias->defined()) bias_cpu = bias->cpu();
  at::Tensor out = at::convolution(input.cpu(), weight.cpu(), bias_cpu, stride, padding, dilation, transposed,
                                   output_padding, groups);
  return out.to(input.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed, c10::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> output_mask) {
  record_fallback("aten::convolution_backward_overrideable");
  int64_t out_channels = transposed ? weight.size(1) * groups : weight.size(0);
  std::vector<int64_t> bias_sizes{out_channels};
  auto [gi, gw, gb] = at::convolution_backward(grad_output.cpu(), input.cpu(), weight.cpu(),
                                               at::OptionalIntArrayRef(bias_sizes), stride, padding, dilation,
                                               transposed, output_padding, groups, output_mask);
  auto back = [&](const at::Tensor& t) { return t.defined() ? t.to(input.device()) : t; };
  return {back(gi), back(gw), back(gb)};
}

}  // namespace

void run_cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { neuron_cpu_fallback(op, stack); }

// The CPU routes of the ops whose kernels are Python lowerings (torchneuron/ops) but whose
// fallback needs more than the generic one: the lowering calls these for inputs it does not run.
std::tuple<at::Tensor, at::Tensor> fallback_native_dropout(const at::Tensor& input, double p,
                                                           std::optional<bool> train) {
  return torchneuron::native_dropout(input, p, train);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fallback_native_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps) {
  return torchneuron::native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps);
}

at::Tensor fallback_convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                std::vector<int64_t> stride, std::vector<int64_t> padding,
                                std::vector<int64_t> dilation, bool transposed, std::vector<int64_t> output_padding,
                                int64_t groups) {
  return torchneuron::convolution_overrideable(input, weight, bias, stride, padding, dilation, transposed,
                                               output_padding, groups);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fallback_convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, std::vector<int64_t> stride,
    std::vector<int64_t> padding, std::vector<int64_t> dilation, bool transposed,
    std::vector<int64_t> output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  return torchneuron::convolution_backward_overrideable(grad_output, input, weight, stride, padding, dilation, transposed,
                                           output_padding, groups, output_mask);
}

void set_strict(bool s) { g_strict = s; }
bool strict() { return g_strict; }

void record_fallback(const std::string& name) {
  TORCH_CHECK_NOT_IMPLEMENTED(!g_strict, "The operator '", name,
                              "' has no neuron kernel and TORCHNEURON_STRICT=1 forbids the CPU fallback.");
  bool first;
  {
    std::lock_guard<std::mutex> lock(g_counts_mutex);
    first = g_counts[name]++ == 0;
  }
  if (first) {
    // Reported at the user's line; the C++ location is named relative to the repository.
    c10::warn(c10::Warning(c10::Warning::UserWarning(),
                           c10::SourceLocation{__func__, "torchneuron/_csrc/ops.cpp", __LINE__},
                           "The operator '" + name + "' has no neuron kernel yet; it ran on the CPU "
                           "(shown once per operator; see torchneuron.fallback_counts()).",
                           /*verbatim=*/false));
  }
}

std::vector<std::pair<std::string, int64_t>> fallback_counts() {
  std::lock_guard<std::mutex> lock(g_counts_mutex);
  return {g_counts.begin(), g_counts.end()};
}

void reset_fallback_counts() {
  std::lock_guard<std::mutex> lock(g_counts_mutex);
  g_counts.clear();
}

at::Tensor alias_as_cpu(const at::Tensor& t) {
  TORCH_CHECK(t.is_privateuseone(), "alias_as_cpu expects a neuron tensor, got ", t.device());
  auto options = at::TensorOptions().dtype(t.dtype()).device(at::kCPU);
  const c10::Storage& storage = t.storage();
  if (storage.data() == nullptr) return at::empty_strided(t.sizes(), t.strides(), options);
  char* base = static_cast<char*>(storage.mutable_data());
  return at::for_blob(base, t.sizes())
      .strides(t.strides())
      .storage_offset(t.storage_offset())
      .deleter([storage](void*) {})  // keeps the device storage alive
      .options(options)
      .target_device(at::Device(at::kCPU))
      .make_tensor();
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  m.impl("set_.source_Storage", TORCH_FN(set_source_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_source_storage_offset));
  m.impl("set_.source_Tensor", TORCH_FN(set_source_tensor));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
  // native_layer_norm and its backward are lowered to device kernels in Python (torchneuron/ops).
}

// A copy between the host and the device resolves lazy conjugate and negative bits itself (host_values):
// the generic Conjugate/Negative fallbacks would materialize them by a device copy that falls back to the
// CPU, whose host transfer is this same op again. Only backends implement _copy_from, so this reaches ours.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&neuron_cpu_fallback>());
}

}  // namespace torchneuron
