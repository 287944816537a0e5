// The Python face of the C++ glue: torchneuron._C.
#include "neuron.h"

#include <torch/csrc/Generator.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

namespace py = pybind11;

namespace torchneuron {
void bind_process_group(py::module_& m);  // process_group.cpp: the `neuron` c10d backend
void bind_profiler(py::module_& m);       // profiler.cpp: kernel launches in torch.profiler
void bind_memory_history(py::module_& m); // memory_snapshot.cpp: allocator history and snapshots
void bind_launch(py::module_& m);         // launch.cpp: a launch's slot tensors and their host aliases
void bind_segment_call(py::module_& m);   // segment_call.cpp: a compiled segment's input key and output views
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "TorchNeuron's C++ glue: allocator, device guard, hooks and core ops";
  m.def("_configure", &torchneuron::configure, "Set the number of devices and HBM bytes per device.");
  m.def("_device_count", []() { return int(torchneuron::device_count()); });
  m.def("_current_device", []() { return int(torchneuron::current_device()); });
  m.def("_set_device", [](int i) { torchneuron::set_current_device(c10::DeviceIndex(i)); });
  m.def("_hbm_capacity", [](int i) { return torchneuron::hbm_capacity(c10::DeviceIndex(i)); });
  m.def("_alias_as_cpu", &torchneuron::alias_as_cpu, "A CPU tensor over a neuron tensor's bytes.");
  m.def("_stream_clock", [](int d, int64_t s) { return torchneuron::stream_clock(c10::DeviceIndex(d), s); });
  m.def("_advance_stream_clock",
        [](int d, int64_t s, int64_t ns) { torchneuron::advance_stream_clock(c10::DeviceIndex(d), s, ns); });
  m.def("_set_strict", &torchneuron::set_strict);
  m.def("_strict", &torchneuron::strict);
  m.def("_fallback_counts", &torchneuron::fallback_counts);
  m.def("_reset_fallback_counts", &torchneuron::reset_fallback_counts);
  // Lets a Python kernel (torchneuron/ops) hand inputs it has no device kernel for to the
  // same CPU fallback that unregistered operators take (counted, warned, refused when strict).
  m.def("_cpu_fallback", [](const std::string& name, const std::string& overload, py::args args,
                            const py::kwargs& kwargs) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    torch::jit::Stack stack = torch::jit::createStackForSchema(op.schema(), args, kwargs, std::nullopt);
    {
      py::gil_scoped_release no_gil;
      torchneuron::run_cpu_fallback(op, &stack);
    }
    return torch::jit::createPyObjectForStack(std::move(stack));
  });
  m.def("_fallback_native_dropout", &torchneuron::fallback_native_dropout);
  m.def("_fallback_native_batch_norm", &torchneuron::fallback_native_batch_norm);
  m.def("_fallback_convolution", &torchneuron::fallback_convolution);
  m.def("_fallback_convolution_backward", &torchneuron::fallback_convolution_backward);
  m.def("_default_generator", [](int i) {
    return py::reinterpret_steal<py::object>(
        THPGenerator_initDefaultGenerator(torchneuron::default_neuron_generator(c10::DeviceIndex(i))));
  });
  torchneuron::bind_process_group(m);
  torchneuron::bind_profiler(m);
  torchneuron::bind_memory_history(m);
  torchneuron::bind_launch(m);
  torchneuron::bind_segment_call(m);
}
