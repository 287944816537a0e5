// A compiled graph segment's call, in C++ where Python costs microseconds a tensor: torchneuron._C._layout_key
// (its inputs' lookup key) and _SlotViews (its outputs as views of the launch's slots).
//
// Each call of a compiled segment looks its program up by its inputs' signatures (compiler/codegen.py:
// `signatures`): every tensor's shape, strides and dtype, every host scalar's type and bits, and which device
// tensors share a storage (bound as one slot, at their offsets in it). Computed in Python that is ~1.6 us an
// input inside a training step (a GPT step's segments take ~270 inputs). This key holds exactly what those
// signatures are made from, as one bytes object: equal keys give equal signatures, so the graph runner maps a
// key to its bound program and computes the signatures only for a key it has not seen.
#include "neuron.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torchneuron {
namespace {

enum Tag : int64_t { kTensor = 1, kFloat = 2, kBool = 3, kInt = 4, kNone = 5 };

struct PairHash {
  size_t operator()(const std::pair<const void*, int64_t>& p) const {
    return std::hash<const void*>()(p.first) ^ (std::hash<int64_t>()(p.second) * 0x9e3779b97f4a7c15ULL);
  }
};

void put(std::string& out, int64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }

// The key of `values` (a segment's input values in order), or None where one of them is something the key does
// not describe (a scalar of another type, an int beyond 64 bits, a tensor without storage): the caller then takes
// the signatures' path.
// Per tensor: its dtype, device, sizes and strides, the index of the first input sharing its storage and dtype
// (device tensors only; itself if none), and where it shares, its storage offset from the lowest of the inputs it
// shares with (what the signatures' offsets in their slot come from: the same buffer at another place in its
// storage gives the same key). Per scalar: its type and value (a float's bits: 0.0 and -0.0 differ, a NaN
// equals itself).
py::object layout_key(const py::list& values) {
  const size_t n = values.size();
  std::vector<const at::Tensor*> tensors(n, nullptr);
  std::vector<int64_t> first(n, -1), members(n, 0), lowest(n, 0);
  std::unordered_map<std::pair<const void*, int64_t>, int64_t, PairHash> groups;
  for (size_t i = 0; i < n; ++i) {
    PyObject* obj = values[i].ptr();
    if (!THPVariable_Check(obj)) continue;
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.has_storage()) return py::none();  // (a sparse or nested tensor: the signatures' path says what it does)
    tensors[i] = &t;
    if (t.is_cpu()) continue;
    auto key = std::make_pair(static_cast<const void*>(t.storage().data()), static_cast<int64_t>(t.scalar_type()));
    auto [it, added] = groups.emplace(key, static_cast<int64_t>(i));
    first[i] = it->second;
    ++members[it->second];
    lowest[it->second] = added ? t.storage_offset() : std::min(lowest[it->second], t.storage_offset());
  }
  std::string out;
  out.reserve(n * 12 * sizeof(int64_t));
  for (size_t i = 0; i < n; ++i) {
    PyObject* obj = values[i].ptr();
    if (const at::Tensor* t = tensors[i]) {
      put(out, kTensor);
      put(out, static_cast<int64_t>(t->scalar_type()));
      put(out, static_cast<int64_t>(t->device().type()));
      put(out, t->device().index());
      put(out, t->dim());
      for (int64_t s : t->sizes()) put(out, s);
      for (int64_t s : t->strides()) put(out, s);
      put(out, first[i]);
      put(out, first[i] >= 0 && members[first[i]] > 1 ? t->storage_offset() - lowest[first[i]] : -1);
    } else if (obj == Py_None) {
      put(out, kNone);
    } else if (PyBool_Check(obj)) {
      put(out, kBool);
      put(out, obj == Py_True);
    } else if (PyFloat_CheckExact(obj)) {
      double v = PyFloat_AS_DOUBLE(obj);
      int64_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      put(out, kFloat);
      put(out, bits);
    } else if (PyLong_CheckExact(obj)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
      if (overflow != 0) return py::none();
      put(out, kInt);
      put(out, static_cast<int64_t>(v));
    } else {
      return py::none();
    }
  }
  return py::bytes(out);
}

// A segment program's outputs that lie in its argument slots (compiler/codegen.py: OutputLayout), made per call as
// views of the launch's slot tensors: per output its slot's position, sizes, strides and storage offset, and for
// an int64 output in a slot of int32 words, the dtype the slot's elements are viewed as first. Made once per bound
// program; ~0.5 us an output instead of Python's ~3 inside a training step.
class SlotViews {
 public:
  SlotViews(std::vector<int64_t> slots, std::vector<std::vector<int64_t>> sizes,
            std::vector<std::vector<int64_t>> strides, std::vector<int64_t> offsets,
            std::vector<std::optional<at::ScalarType>> dtypes)
      : slots_(std::move(slots)), sizes_(std::move(sizes)), strides_(std::move(strides)),
        offsets_(std::move(offsets)), dtypes_(std::move(dtypes)) {
    const size_t n = slots_.size();
    TORCH_CHECK(sizes_.size() == n && strides_.size() == n && offsets_.size() == n && dtypes_.size() == n,
                "one slot, shape, stride, offset and dtype (or None) per output");
  }

  // The outputs' views of `tensors` (the launch's slot tensors, in slot order).
  py::list operator()(const py::list& tensors) const {
    py::list out(slots_.size());
    for (size_t i = 0; i < slots_.size(); ++i) {
      PyObject* slot = tensors[static_cast<size_t>(slots_[i])].ptr();
      TORCH_CHECK(THPVariable_Check(slot), "slot ", slots_[i], " of a launch holds no tensor");
      at::Tensor t = THPVariable_Unpack(slot);
      if (dtypes_[i]) t = t.reshape({-1}).view(*dtypes_[i]);
      out[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(t.as_strided(sizes_[i], strides_[i], offsets_[i])));
    }
    return out;
  }

 private:
  std::vector<int64_t> slots_;
  std::vector<std::vector<int64_t>> sizes_, strides_;
  std::vector<int64_t> offsets_;
  std::vector<std::optional<at::ScalarType>> dtypes_;
};

}  // namespace

void bind_segment_call(py::module_& m) {
  m.def("_layout_key", &layout_key,
        "What a compiled segment's input signatures are made from, as bytes (None: a value it does not describe).");
  py::class_<SlotViews>(m, "_SlotViews", "A segment program's outputs as views of its launch's slots.")
      .def(py::init<std::vector<int64_t>, std::vector<std::vector<int64_t>>, std::vector<std::vector<int64_t>>,
                    std::vector<int64_t>, std::vector<std::optional<at::ScalarType>>>())
      .def("__call__", &SlotViews::operator(), "The outputs' views of the launch's slot tensors.");
}

}  // namespace torchneuron
