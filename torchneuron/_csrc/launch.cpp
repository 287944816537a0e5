// The host side of an eager kernel launch in one call: torchneuron._C._SlotLayout.
//
// A launch binds each neuron tensor of a program's argument slots as host memory the simulated core reads and
// writes (a CPU tensor over the same bytes), and allocates the output slots the caller left unbound. Done from
// Python that is a torch.empty per output and an alias per slot, ~0.4-1 us each in argument parsing and
// wrapping; a layout made once per program (and per element-wise plan) does it in one call. Each slot is
// aliased at the slot's own shape, so a contiguous tensor of another shape with the same element count (an
// element-wise operand that the kernel reads as [R, C]) needs no view first.
#include "neuron.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

namespace py = pybind11;

namespace torchneuron {
namespace {

// A CPU tensor over a contiguous neuron tensor's bytes, with the contiguous shape `sizes` (same element count).
at::Tensor alias_shaped(const at::Tensor& t, c10::IntArrayRef sizes) {
  TORCH_CHECK(t.is_privateuseone(), "a launch binds neuron tensors, got one on ", t.device());
  TORCH_CHECK(t.is_contiguous(), "a launch binds contiguous tensors, got strides ", t.strides());
  TORCH_CHECK(t.numel() == c10::multiply_integers(sizes), "a launch slot of shape ", sizes,
              " cannot hold a tensor of shape ", t.sizes());
  auto options = at::TensorOptions().dtype(t.dtype()).device(at::kCPU);
  const c10::Storage& storage = t.storage();
  if (storage.data() == nullptr) return at::empty(sizes, options);
  char* base = static_cast<char*>(storage.mutable_data());
  return at::for_blob(base, sizes)
      .storage_offset(t.storage_offset())
      .deleter([storage](void*) {})  // keeps the device storage alive
      .options(options)
      .target_device(at::Device(at::kCPU))
      .make_tensor();
}

class SlotLayout {
 public:
  // shapes: each slot's shape; allocate: per slot, the dtype an unbound output is allocated in (None: a slot
  // left unbound stays unbound, as scratch does); allocate_shapes: the shape it is allocated as (the slot's
  // element count: the shape the caller hands on, aliased at the slot's shape).
  SlotLayout(std::vector<std::vector<int64_t>> shapes, std::vector<std::optional<at::ScalarType>> allocate,
             std::vector<std::vector<int64_t>> allocate_shapes)
      : shapes_(std::move(shapes)), allocate_(std::move(allocate)), allocate_shapes_(std::move(allocate_shapes)) {
    TORCH_CHECK(allocate_.size() == shapes_.size() && allocate_shapes_.size() == shapes_.size(),
                "one dtype (or None) and one allocation shape per slot");
    for (size_t i = 0; i < shapes_.size(); ++i) {
      TORCH_CHECK(c10::multiply_integers(shapes_[i]) == c10::multiply_integers(allocate_shapes_[i]),
                  "slot ", i, " is allocated with another element count than its shape's");
    }
  }

  // Allocate `tensors`' unbound outputs on neuron:`device` (written into the list) and return every slot's
  // host alias (None for an unbound slot).
  py::list bind(py::list tensors, int device) const {
    const size_t n = shapes_.size();
    TORCH_CHECK(tensors.size() == n, "expected one tensor (or None) per slot: ", n, ", got ", tensors.size());
    py::list host(n);
    for (size_t i = 0; i < n; ++i) {
      py::handle item = tensors[i];
      if (item.is_none()) {
        if (!allocate_[i].has_value()) {
          host[i] = py::none();
          continue;
        }
        at::Tensor t = at::empty(allocate_shapes_[i], at::TensorOptions()
                                                          .dtype(*allocate_[i])
                                                          .device(c10::DeviceType::PrivateUse1, device));
        host[i] = py::cast(alias_shaped(t, shapes_[i]));
        tensors[i] = py::cast(std::move(t));
      } else {
        TORCH_CHECK(THPVariable_Check(item.ptr()), "slot ", i, " expects a tensor or None");
        host[i] = py::cast(alias_shaped(THPVariable_Unpack(item.ptr()), shapes_[i]));
      }
    }
    return host;
  }

 private:
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<std::optional<at::ScalarType>> allocate_;
  std::vector<std::vector<int64_t>> allocate_shapes_;
};

}  // namespace

void bind_launch(py::module_& m) {
  py::class_<SlotLayout>(m, "_SlotLayout", "How a launch binds a program's argument slots (see launch.cpp).")
      .def(py::init<std::vector<std::vector<int64_t>>, std::vector<std::optional<at::ScalarType>>,
                    std::vector<std::vector<int64_t>>>())
      .def("bind", &SlotLayout::bind, "Allocate the unbound outputs; return each slot's host alias.");
}

}  // namespace torchneuron
