// The `neuron` c10d backend: a c10d::Backend whose collectives are implemented in Python.
//
// PyTorch's process group holds one c10d::Backend per device type, and Python cannot
// subclass c10d::Backend (its binding has no constructor). This class is the smallest
// C++ piece that lets it: every collective is forwarded, with the arguments c10d hands
// it, to a Python object (torchneuron.distributed.backend.NeuronBackend) that has the
// method names and signatures of torch's Backend binding. That object moves the bytes
// with Gloo and accounts the simulated interconnect time; nothing else lives here.
#include "neuron.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <chrono>
#include <thread>

namespace py = pybind11;

namespace torchneuron {
namespace {

class ProcessGroupNeuron final : public c10d::Backend {
 public:
  ProcessGroupNeuron(int rank, int size, py::object impl) : Backend(rank, size), impl_(std::move(impl)) {}

  ~ProcessGroupNeuron() override {
    // The last reference may go away on a thread without the GIL, or after the
    // interpreter has shut down; only then is the Python object deliberately leaked.
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      py::gil_scoped_acquire gil;
      impl_ = py::object();
    } else {
      impl_.release();
    }
  }

  const std::string getBackendName() const override { return "neuron"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    return call("broadcast", tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    return call("allreduce", tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    return call("allreduce_coalesced", tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    return call("reduce", tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    return call("allgather", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    return call("_allgather_base", output, input, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    return call("allgather_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    return call("allgather_into_tensor_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    return call("gather", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    return call("scatter", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    return call("reduce_scatter", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    return call("_reduce_scatter_base", output, input, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    return call("reduce_scatter_tensor_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override {
    return call("alltoall_base", output, input, output_split_sizes, input_split_sizes, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    return call("alltoall", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return call("send", tensors, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return call("recv", tensors, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return call("recv_anysource", tensors, tag);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return call("barrier", opts);
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    py::gil_scoped_acquire gil;
    impl_.attr("monitored_barrier")(opts, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override {
    py::gil_scoped_acquire gil;
    return impl_.attr("sequence_number")().cast<uint64_t>();
  }
  void setTimeout(std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    impl_.attr("set_timeout")(timeout.count());
  }
  void abort() override {
    py::gil_scoped_acquire gil;
    impl_.attr("abort")();
  }
  void shutdown() override {
    py::gil_scoped_acquire gil;
    impl_.attr("shutdown")();
  }

  // The Python object, for tests and the cost model's bookkeeping.
  py::object impl() const { return impl_; }

 private:
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> call(const char* method, Args&... args) {
    py::gil_scoped_acquire gil;
    return impl_.attr(method)(args...).template cast<c10::intrusive_ptr<c10d::Work>>();
  }

  py::object impl_;
};

// Waits for a Gloo work, then for the Gloo worker thread that ran it to drop its references to it.
//
// A work holds the tensors of its collective, and the neuron backend's tensors were made in Python
// (the CPU aliases, the metadata), so whoever destroys the work releases Python objects and needs the
// GIL. Gloo's worker drops its references just after marking the work complete: if the caller has
// let go of it by then, the worker destroys it and takes the GIL. At interpreter exit, with the
// interpreter finalizing, taking the GIL ends the thread (pthread_exit), and the unwinding through
// the work's noexcept destructor calls std::terminate ("terminate called without an active
// exception"). Waiting here, without the GIL, until the caller's reference is the only one left
// makes the caller's thread, holding the GIL, the one that destroys the work.
void wait_work(py::handle handle) {
  auto* work = handle.cast<c10d::Work*>();  // no holder copy: the Python object's is the one left
  py::gil_scoped_release no_gil;
  work->wait();
  // The worker lets go within microseconds of completing the work; a reference held elsewhere (none
  // is known) must not hang the caller, so the wait is bounded.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (c10::raw::intrusive_ptr::use_count(work) > 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
}

}  // namespace

void bind_process_group(py::module_& m) {
  // Registered as a subclass of torch's Backend binding, so that c10d accepts it from a
  // creator registered with torch.distributed.Backend.register_backend.
  py::module_::import("torch._C._distributed_c10d");
  py::class_<ProcessGroupNeuron, c10d::Backend, c10::intrusive_ptr<ProcessGroupNeuron>>(m, "_ProcessGroupNeuron")
      .def(py::init<int, int, py::object>(), py::arg("rank"), py::arg("size"), py::arg("impl"))
      .def_property_readonly("impl", &ProcessGroupNeuron::impl);
  m.def("_wait_work", &wait_work, py::arg("work"),
        "Wait for a Gloo work and for its worker thread to let go of it (see process_group.cpp).");
}

}  // namespace torchneuron
