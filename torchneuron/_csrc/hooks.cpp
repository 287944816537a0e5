// PrivateUse1 hooks: availability, generators, pinned memory, pointer lookup and
// storage resize (FSDP2 resizes parameter storages in place).
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/GeneratorImpl.h>

#include <cstring>
#include <mutex>

namespace torchneuron {
namespace {

// The neuron generator wraps a CPU generator: kernels that draw random numbers on
// the host take the wrapped one, so the stream of numbers belongs to the device,
// independent of torch's CPU generator.
class NeuronGeneratorImpl final : public c10::GeneratorImpl {
 public:
  explicit NeuronGeneratorImpl(c10::DeviceIndex index, uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(c10::Device(kNeuron, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

  void set_current_seed(uint64_t seed) override { cpu_.set_current_seed(seed); }
  // A Mersenne Twister has no Philox offset: its position lives in the state, which
  // pickling and get/set_rng_state carry. Offset 0 keeps Generator pickling working.
  void set_offset(uint64_t offset) override {
    TORCH_CHECK(offset == 0, "neuron generators have no offset (their position is in get_state()); got ", offset);
  }
  uint64_t get_offset() const override { return 0; }
  uint64_t current_seed() const override { return cpu_.current_seed(); }
  uint64_t seed() override { return cpu_.seed(); }
  void set_state(const c10::TensorImpl& state) override { cpu_.unsafeGetGeneratorImpl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override { return cpu_.unsafeGetGeneratorImpl()->get_state(); }
  static c10::DeviceType device_type() { return kNeuron; }
  const at::Generator& cpu() const { return cpu_; }

 private:
  NeuronGeneratorImpl* clone_impl() const override {
    auto* g = new NeuronGeneratorImpl(device().index());
    g->cpu_ = cpu_.clone();
    return g;
  }
  at::Generator cpu_;
};

std::mutex g_gen_mutex;
std::vector<at::Generator> g_default_generators;

const at::Generator& default_generator_ref(c10::DeviceIndex index) {
  if (index == -1) index = current_device();
  check_device_index(index);
  std::lock_guard<std::mutex> lock(g_gen_mutex);
  if (g_default_generators.size() < size_t(device_count())) {
    for (c10::DeviceIndex i = c10::DeviceIndex(g_default_generators.size()); i < device_count(); ++i) {
      g_default_generators.push_back(at::make_generator<NeuronGeneratorImpl>(i));
    }
  }
  return g_default_generators[index];
}

struct NeuronHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex index) const override { return index >= 0 && index < device_count(); }
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex d) const override { set_current_device(d); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    c10::DeviceIndex old = current_device();
    set_current_device(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_generator_ref(index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    if (index == -1) index = current_device();
    check_device_index(index);
    return at::make_generator<NeuronGeneratorImpl>(index);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    c10::DeviceIndex d = device_of_pointer(data);
    TORCH_CHECK(d >= 0, "pointer ", data, " is not in neuron device memory");
    return at::Device(kNeuron, d);
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned_pointer(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    TORCH_CHECK(storage.resizable(), "Trying to resize storage that is not resizable");
    c10::DeviceIndex dev = storage.device().index();
    c10::DeviceIndex saved = current_device();
    set_current_device(dev);
    c10::DataPtr fresh;
    try {
      fresh = hbm_allocator()->allocate(newsize);
    } catch (...) {
      set_current_device(saved);
      throw;
    }
    set_current_device(saved);
    size_t keep = std::min(newsize, storage.nbytes());
    if (keep > 0 && storage.data() != nullptr) std::memcpy(fresh.get(), storage.data(), keep);
    storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(fresh));
    storage.unsafeGetStorageImpl()->set_nbytes(newsize);
  }
};

NeuronHooks g_hooks;

struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(&g_hooks); }
} g_register_hooks;

}  // namespace

at::Generator default_neuron_generator(c10::DeviceIndex index) { return default_generator_ref(index); }

at::Generator cpu_generator_of(const at::Generator& g) {
  auto* impl = dynamic_cast<NeuronGeneratorImpl*>(g.unsafeGetGeneratorImpl());
  TORCH_CHECK(impl != nullptr, "expected a neuron generator, got one for ", g.device());
  return impl->cpu();
}

}  // namespace torchneuron
