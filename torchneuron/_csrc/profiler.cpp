// Kernel launches as device activity in torch.profiler: a Kineto activity profiler for the
// PrivateUse1 device, registered through PyTorch's PrivateUse1 profiler registry (and, at the
// end, the profiler stubs the legacy autograd profiler times ops with).
//
// The runtime (Python) reports each launch made while a session records: the correlation id
// of the op that launched it (the innermost profiled op of the launching thread, pushed by
// the profiler into the session), the host time of the launch, and the launch's simulated
// device times. When the session ends, each launch becomes one kernel activity on its
// device's stream row, linked to that op, lasting exactly the kernel's simulated device
// time. The device clock is simulated, so the kernel is placed on the host timeline at its
// launch, or when the previous kernel of its stream ends if that is later (a stream runs
// its kernels in order).

// The registry and Kineto's plugin interface are only declared when Kineto is in the build;
// torch's wheels ship with it (torch.autograd.kineto_available()).
#ifndef USE_KINETO
#define USE_KINETO 1
#endif
// GenericTraceActivity formats its metadata with fmt, whose compiled part torch does not export.
#define FMT_HEADER_ONLY 1

#include "neuron.h"

#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>
#include <torch/csrc/profiler/stubs/base.h>
#include <torch/extension.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <c10/util/ApproximateClock.h>
#include <libkineto.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torchneuron {
namespace {

struct Launch {
  std::string name;
  std::string op;
  int device;
  int64_t stream;
  uint64_t correlation;
  int64_t host_ns;         // host time when the launch was queued (the profiler's clock)
  int64_t start_ns;        // stream clock (simulated) at the launch
  int64_t end_ns;
  double overhead_ns;      // runtime overhead before the kernel starts
  double device_time_ns;   // the kernel's simulated time
  int64_t flops;
  int64_t bytes_read;
  int64_t bytes_written;
  int64_t instructions;
};

std::atomic<bool> g_recording{false};
std::mutex g_mutex;
std::vector<Launch> g_launches;  // of the recording session
// The correlation ids the profiler pushed on this thread (innermost last).
thread_local std::vector<uint64_t> t_correlation;

class NeuronSession final : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_launches.clear();
    }
    start_ns_ = c10::getTime();
    g_recording = true;
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    g_recording = false;
    end_ns_ = c10::getTime();
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override { return {}; }

  void processTrace(libkineto::ActivityLogger& logger) override {
    processTrace(logger, nullptr, 0, 0);
  }

  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked,
                    int64_t /*start*/, int64_t /*end*/) override {
    std::vector<Launch> launches;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      launches.swap(g_launches);
    }
    buffer_ = std::make_unique<libkineto::CpuTraceBuffer>();
    buffer_->span = libkineto::TraceSpan(start_ns_, end_ns_, "neuron");
    std::map<std::pair<int, int64_t>, int64_t> stream_free;  // (device, stream) -> host ns it is free
    for (const Launch& l : launches) {
      auto key = std::make_pair(l.device, l.stream);
      auto it = stream_free.find(key);
      int64_t start = l.host_ns;
      if (it != stream_free.end()) start = std::max(start, it->second);
      int64_t end = start + std::llround(l.device_time_ns);
      stream_free[key] = end;
      streams_.insert(key);

      auto act = std::make_unique<libkineto::GenericTraceActivity>(
          buffer_->span, libkineto::ActivityType::CONCURRENT_KERNEL, l.name);
      act->startTime = start;
      act->endTime = end;
      act->id = static_cast<int32_t>(l.correlation);
      act->device = l.device;
      act->resource = static_cast<int32_t>(l.stream);
      if (linked && l.correlation != 0) act->linked = linked(static_cast<int32_t>(l.correlation));
      act->addMetadata("device", l.device);  // the device index, as CUDA kernels carry it (TensorBoard reads it)
      act->addMetadata("stream", l.stream);
      act->addMetadata("correlation", l.correlation);
      if (!l.op.empty()) act->addMetadataQuoted("op", l.op);
      act->addMetadata("device time ns", l.device_time_ns);
      act->addMetadata("launch overhead ns", l.overhead_ns);
      act->addMetadata("stream clock start ns", l.start_ns);
      act->addMetadata("stream clock end ns", l.end_ns);
      act->addMetadata("flops", l.flops);
      act->addMetadata("hbm bytes read", l.bytes_read);
      act->addMetadata("hbm bytes written", l.bytes_written);
      act->addMetadata("instructions", l.instructions);
      buffer_->activities.push_back(std::move(act));
    }
    // Kineto takes a plugin's activities from its logger; the buffer keeps them alive.
    for (const auto& act : buffer_->activities) act->log(logger);
    buffer_->gpuOpCount = static_cast<int>(buffer_->activities.size());
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    int device = streams_.empty() ? 0 : streams_.begin()->first;
    return std::make_unique<libkineto::DeviceInfo>(
        libkineto::DeviceInfo{device, device, "neuron:" + std::to_string(device), "NeuronCore (simulated)"});
  }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    std::vector<libkineto::ResourceInfo> rows;
    for (const auto& [device, stream] : streams_) {
      rows.push_back(libkineto::ResourceInfo{stream, stream, device, "stream " + std::to_string(stream)});
    }
    return rows;
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return std::move(buffer_); }

  void pushCorrelationId(uint64_t id) override { t_correlation.push_back(id); }
  void popCorrelationId() override {
    if (!t_correlation.empty()) t_correlation.pop_back();
  }

 private:
  int64_t start_ns_ = 0;
  int64_t end_ns_ = 0;
  std::unique_ptr<libkineto::CpuTraceBuffer> buffer_;
  std::set<std::pair<int, int64_t>> streams_;
};

class NeuronActivityProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<libkineto::ActivityType>& availableActivities() const override { return activities_; }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config& /*config*/) override {
    if (!types.count(libkineto::ActivityType::CONCURRENT_KERNEL)) return nullptr;
    return std::make_unique<NeuronSession>();
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t /*ts_ms*/, int64_t /*duration_ms*/,
                                                                 const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_{"neuron"};
  std::set<libkineto::ActivityType> activities_{libkineto::ActivityType::CONCURRENT_KERNEL};
};

REGISTER_PRIVATEUSE1_PROFILER(NeuronActivityProfiler);

// The legacy autograd profiler (torch.autograd.profiler.profile(use_device="neuron")) times each
// op with device events: here an event is the current stream's device clock, so an op's device
// time is how far its launches advanced the clock (kernels plus launch overheads).
class NeuronProfilerStubs final : public torch::profiler::impl::ProfilerStubs {
 public:
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    c10::DeviceIndex index = current_device();
    if (device) *device = index;
    c10::Stream stream = c10::impl::getDeviceGuardImpl(kNeuron)->getStream(c10::Device(kNeuron, index));
    auto* clock = new int64_t(stream_clock(index, stream.id()));
    *event = std::shared_ptr<void>(clock, [](void* p) { delete static_cast<int64_t*>(p); });
    if (cpu_ns) *cpu_ns = c10::getTime();
  }
  // microseconds, as the CUDA stub returns
  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* start,
                const torch::profiler::impl::ProfilerVoidEventStub* end) const override {
    return float(*static_cast<const int64_t*>(end->get()) - *static_cast<const int64_t*>(start->get())) / 1000.0f;
  }
  void mark(const char* /*name*/) const override {}
  void rangePush(const char* /*name*/) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }
  void onEachDevice(std::function<void(int)> op) const override {
    c10::DeviceIndex before = current_device();
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      set_current_device(i);
      op(i);
    }
    set_current_device(before);
  }
  void synchronize() const override {}  // work runs when launched, in stream order
};

NeuronProfilerStubs g_stubs;
struct RegisterStubs {
  RegisterStubs() { torch::profiler::impl::registerPrivateUse1Methods(&g_stubs); }
} g_register_stubs;

}  // namespace

void bind_profiler(py::module_& m) {
  m.def("_profiler_recording", []() { return g_recording.load(std::memory_order_relaxed); },
        "Whether a torch.profiler session records neuron kernel activity.");
  m.def("_profiler_add_launch",
        [](std::string name, std::string op, int device, int64_t stream, int64_t start_ns, int64_t end_ns,
           double overhead_ns, double device_time_ns, int64_t flops, int64_t bytes_read, int64_t bytes_written,
           int64_t instructions) {
          if (!g_recording.load()) return;
          // the launching op: the innermost op of this thread (the profiler pushes no id for
          // record_function ranges, so the launch's own neuron::<kernel> range is not on the stack)
          uint64_t corr = t_correlation.empty() ? 0 : t_correlation.back();
          int64_t host_ns = c10::getTime();
          std::lock_guard<std::mutex> lock(g_mutex);
          g_launches.push_back(Launch{std::move(name), std::move(op), device, stream, corr, host_ns, start_ns,
                                      end_ns, overhead_ns, device_time_ns, flops, bytes_read, bytes_written,
                                      instructions});
        },
        "Record a kernel launch for the recording torch.profiler session.");
}

}  // namespace torchneuron
