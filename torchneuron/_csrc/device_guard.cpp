// Device switching, streams and events for `neuron`. Kernels execute in stream
// order when they are launched, so synchronization never has to wait; what streams
// and events carry is the simulated device clock: each stream's clock advances by
// the device time of the work queued on it, an event remembers its stream's clock,
// and waiting on an event moves the waiting stream's clock forward to it.
#include "neuron.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <map>
#include <mutex>

namespace torchneuron {
namespace {

thread_local c10::DeviceIndex tls_device = 0;
// Current stream id per device, per thread (0 is the default stream).
thread_local std::vector<c10::StreamId> tls_streams;

std::mutex g_clock_mutex;
std::map<std::pair<c10::DeviceIndex, c10::StreamId>, int64_t> g_clocks;
std::vector<c10::StreamId> g_next_stream;  // next fresh stream id per device

struct NeuronEvent {
  c10::DeviceIndex device = -1;
  c10::StreamId stream = 0;
  int64_t time_ns = 0;
  bool recorded = false;
  bool timing = false;
};

c10::StreamId& tls_stream(c10::DeviceIndex d) {
  if (tls_streams.size() < size_t(device_count())) tls_streams.resize(device_count(), 0);
  return tls_streams.at(d);
}

// An unindexed device ("neuron") means the current one.
c10::DeviceIndex resolve(c10::Device d) { return d.has_index() ? d.index() : current_device(); }

c10::Stream make_stream(c10::DeviceIndex d, c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNeuron, d), id);
}

struct NeuronGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNeuron; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kNeuron, current_device()); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.is_privateuseone(), "expected a neuron device, got ", d);
    set_current_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count()) tls_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    c10::DeviceIndex i = resolve(d);
    check_device_index(i);
    return make_stream(i, tls_stream(i));
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return make_stream(resolve(d), 0); }
  c10::Stream getNewStream(c10::Device device, int) const override {
    c10::Device d(kNeuron, resolve(device));
    check_device_index(d.index());
    std::lock_guard<std::mutex> lock(g_clock_mutex);
    if (g_next_stream.size() < size_t(device_count())) g_next_stream.resize(device_count(), 1);
    c10::StreamId id = g_next_stream[d.index()]++;
    // A new stream starts at the device's present time: the latest clock of any stream.
    int64_t now = 0;
    for (auto& [key, t] : g_clocks) if (key.first == d.index()) now = std::max(now, t);
    g_clocks[{d.index(), id}] = now;
    return make_stream(d.index(), id);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    check_device_index(s.device_index());
    c10::StreamId& cur = tls_stream(s.device_index());
    c10::Stream old = make_stream(s.device_index(), cur);
    cur = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }

  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<NeuronEvent*>(event);
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                "Event device index ", int(device_index), " does not match recording stream's device index ",
                int(stream.device_index()), ".");
    auto* e = static_cast<NeuronEvent*>(*event);
    if (e == nullptr) {
      e = new NeuronEvent();
      e->timing = flag == c10::EventFlag::BACKEND_DEFAULT;
      *event = e;
    }
    e->device = stream.device_index();
    e->stream = stream.id();
    e->time_ns = stream_clock(stream.device_index(), stream.id());
    e->recorded = true;
  }
  void block(void* event, const c10::Stream& stream) const override {
    auto* e = static_cast<NeuronEvent*>(event);
    if (e == nullptr || !e->recorded) return;  // like CUDA: waiting on an unrecorded event is a no-op
    int64_t now = stream_clock(stream.device_index(), stream.id());
    if (e->time_ns > now) advance_stream_clock(stream.device_index(), stream.id(), e->time_ns - now);
  }
  bool queryEvent(void*) const override { return true; }  // work completes at launch
  void synchronizeEvent(void*) const override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeDevice(const c10::DeviceIndex index) const override { check_device_index(index); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    auto* a = static_cast<NeuronEvent*>(start);
    auto* b = static_cast<NeuronEvent*>(end);
    TORCH_CHECK(a && b && a->recorded && b->recorded,
                "Both events must be recorded before calculating elapsed time.");
    TORCH_CHECK(a->timing && b->timing,
                "Both events must be created with argument 'enable_timing=True'.");
    return double(b->time_ns - a->time_ns) / 1e6;  // milliseconds, like CUDA
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuardImpl);

}  // namespace

void check_device_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count(), "Invalid device index neuron:", int(index),
              ": this process has ", int(device_count()),
              " neuron device(s) (set TORCHNEURON_NUM_DEVICES to change the count)");
}

c10::DeviceIndex current_device() { return tls_device; }

void set_current_device(c10::DeviceIndex index) {
  check_device_index(index);
  tls_device = index;
}

int64_t stream_clock(c10::DeviceIndex device, c10::StreamId stream) {
  std::lock_guard<std::mutex> lock(g_clock_mutex);
  auto it = g_clocks.find({device, stream});
  return it == g_clocks.end() ? 0 : it->second;
}

void advance_stream_clock(c10::DeviceIndex device, c10::StreamId stream, int64_t ns) {
  check_device_index(device);
  TORCH_CHECK(ns >= 0, "a device clock cannot go backwards (got ", ns, " ns)");
  std::lock_guard<std::mutex> lock(g_clock_mutex);
  g_clocks[{device, stream}] += ns;
}

}  // namespace torchneuron
