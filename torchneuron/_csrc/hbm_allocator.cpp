// HbmAllocator: a caching allocator over host memory that plays the role of each
// NeuronCore's HBM. Capacity comes from the chip spec (set from Python); going
// beyond it raises torch.OutOfMemoryError and leaves every count unchanged.
#include "neuron.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

namespace torchneuron {
namespace {

using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingAllocator::StatType;

constexpr size_t kRound = 512;               // every block is a multiple of 512 bytes
constexpr size_t kSmallBlock = 1 << 20;      // blocks up to 1 MiB form the small pool
constexpr size_t kAlignment = 64;

size_t round_size(size_t n) { return n == 0 ? 0 : ((n + kRound - 1) / kRound) * kRound; }

using Traceback = std::shared_ptr<torch::CapturedTraceback>;

struct Block {
  c10::DeviceIndex device;
  size_t size;       // rounded size, what the block occupies
  size_t requested;  // what the caller asked for
  Traceback context; // where it was allocated (while memory history records stacks)
};

struct DeviceState {
  int64_t capacity = 0;
  int64_t reserved = 0;                        // bytes held from the host (in use + cached)
  std::multimap<size_t, void*> cached;          // free blocks by size
  DeviceStats stats;
  std::vector<HbmTraceEntry> trace;             // memory history: a ring of the latest entries
  size_t trace_next = 0;                        // where the next entry goes once the ring is full
};

std::string format_bytes(int64_t b) {
  char buf[64];
  if (b >= (int64_t(1) << 30)) snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(1 << 30));
  else if (b >= (1 << 20)) snprintf(buf, sizeof buf, "%.2f MiB", double(b) / double(1 << 20));
  else snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(b));
  return buf;
}

void update_stat(c10::CachingAllocator::StatArray& arr, size_t size, int64_t amount) {
  size_t pool = size <= kSmallBlock ? size_t(StatType::SMALL_POOL) : size_t(StatType::LARGE_POOL);
  for (size_t i : {size_t(StatType::AGGREGATE), pool}) {
    if (amount >= 0) arr[i].increase(size_t(amount));
    else arr[i].decrease(size_t(-amount));
  }
}

class HbmAllocator final : public c10::DeviceAllocator {
 public:
  void configure(int n, int64_t capacity) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    TORCH_CHECK(live_.empty(), "neuron devices cannot be reconfigured while tensors are alive");
    devices_.assign(n, DeviceState{});
    for (auto& d : devices_) d.capacity = capacity;
  }
  int count() const { return int(devices_.size()); }
  int64_t capacity(c10::DeviceIndex i) const { return devices_.at(i).capacity; }

  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex dev = current_device();
    check_device_index(dev);
    c10::Device device(kNeuron, dev);
    if (nbytes == 0) return {nullptr, nullptr, &raw_delete, device};
    void* ptr = malloc_block(dev, nbytes, gather(history_.context_state));
    return {ptr, ptr, &raw_delete, device};
  }

  void record_history(const HbmHistoryConfig& config) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (config.clear || !config.trace) {
      for (auto& d : devices_) {
        d.trace.clear();
        d.trace_next = 0;
      }
    }
    history_ = config;
  }

  HbmSnapshot snapshot() {
    Traceback context = gather(history_.context_alloc);
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    HbmSnapshot snap;
    for (const auto& [ptr, b] : live_)
      snap.blocks.push_back({b.device, reinterpret_cast<uintptr_t>(ptr), b.size, b.requested, true, b.context});
    for (size_t i = 0; i < devices_.size(); ++i)
      for (const auto& [size, ptr] : devices_[i].cached)
        snap.blocks.push_back({c10::DeviceIndex(i), reinterpret_cast<uintptr_t>(ptr), size, 0, false, nullptr});
    std::sort(snap.blocks.begin(), snap.blocks.end(),
              [](const HbmBlockInfo& a, const HbmBlockInfo& b) { return a.address < b.address; });
    for (size_t i = 0; i < devices_.size(); ++i) {
      // a snapshot taken while recording is itself an entry, to line snapshots up with the trace
      trace(devices_[i], "snapshot", 0, 0, context);
      const auto& ring = devices_[i].trace;
      size_t next = devices_[i].trace_next;
      std::vector<HbmTraceEntry> ordered(ring.begin() + next, ring.end());
      ordered.insert(ordered.end(), ring.begin(), ring.begin() + next);
      snap.traces.push_back(std::move(ordered));
    }
    return snap;
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete; }
  void copy_data(void* dst, const void* src, size_t count) const override { std::memcpy(dst, src, count); }

  bool initialized() override { return !devices_.empty(); }
  void emptyCache(c10::MempoolId_t) override {
    Traceback context = gather(history_.context_alloc);
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    for (size_t i = 0; i < devices_.size(); ++i) release_cached(devices_[i], context);
  }
  void recordStream(const c10::DataPtr&, c10::Stream) override {}  // execution is in stream order
  DeviceStats getDeviceStats(c10::DeviceIndex dev) override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    check_device_index(dev);
    return devices_[dev].stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex dev) override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    check_device_index(dev);
    auto& s = devices_[dev].stats;
    for (auto* arr : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                      &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes})
      for (auto& st : *arr) st.reset_accumulated();
    s.num_alloc_retries = s.num_ooms = s.num_device_alloc = s.num_device_free = 0;
  }
  void resetPeakStats(c10::DeviceIndex dev) override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    check_device_index(dev);
    auto& s = devices_[dev].stats;
    for (auto* arr : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                      &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes})
      for (auto& st : *arr) st.reset_peak();
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex dev) override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    check_device_index(dev);
    auto& d = devices_[dev];
    return {size_t(d.capacity - d.reserved), size_t(d.capacity)};
  }

  c10::DeviceIndex owner(const void* p) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    auto it = live_.upper_bound(p);
    if (it == live_.begin()) return -1;
    --it;
    const char* start = static_cast<const char*>(it->first);
    if (static_cast<const char*>(p) < start + it->second.size) return it->second.device;
    return -1;
  }

 private:
  static void raw_delete(void* ptr);

  // The Python (and with stacks="all", C++) stack of the caller, when memory history asks for
  // it. Gathered before the allocator's lock is taken: gathering Python frames takes the GIL,
  // and a thread holding the GIL may be waiting for this lock.
  Traceback gather(bool wanted) const {
    if (!wanted) return nullptr;
    return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/history_.cpp_stacks);
  }

  void trace(DeviceState& d, const char* action, uintptr_t addr, size_t size, const Traceback& context,
             int64_t device_free = 0) {
    if (!history_.trace) return;
    HbmTraceEntry e{action, addr, size, c10::getTime() / 1000, device_free, context};
    if (d.trace.size() < history_.max_entries) {
      d.trace.push_back(std::move(e));
    } else if (history_.max_entries > 0) {
      d.trace[d.trace_next] = std::move(e);
      d.trace_next = (d.trace_next + 1) % history_.max_entries;
    }
  }

  void* malloc_block(c10::DeviceIndex dev, size_t nbytes, const Traceback& context) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    auto& d = devices_[dev];
    size_t size = round_size(nbytes);
    void* ptr = nullptr;
    // Reuse a cached block that is not much larger than the request.
    auto it = d.cached.lower_bound(size);
    if (it != d.cached.end() && it->first <= size + size / 4) {
      size = it->first;
      ptr = it->second;
      d.cached.erase(it);
    } else {
      // Release the cache only when that makes the request fit: a hopeless request
      // must fail without changing anything.
      if (d.reserved + int64_t(size) > d.capacity && d.reserved - cached_bytes(d) + int64_t(size) <= d.capacity) {
        d.stats.num_alloc_retries += 1;
        release_cached(d, context);
      }
      if (d.reserved + int64_t(size) > d.capacity) {
        d.stats.num_ooms += 1;
        trace(d, "oom", 0, nbytes, context, d.capacity - d.reserved);
        int64_t allocated = d.stats.allocated_bytes[0].current;
        TORCH_CHECK_WITH(OutOfMemoryError, false,
            "neuron out of memory. Tried to allocate ", format_bytes(int64_t(nbytes)), " on neuron:", int(dev),
            ". The NeuronCore has ", format_bytes(d.capacity), " of HBM in total; ",
            format_bytes(allocated), " is allocated by PyTorch and ", format_bytes(d.reserved),
            " is reserved (allocated + cached), leaving ", format_bytes(d.capacity - d.reserved), " free.");
      }
      ptr = std::aligned_alloc(kAlignment, size);
      TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "neuron out of memory: the host could not provide ",
                       format_bytes(int64_t(size)), " for neuron:", int(dev));
      d.reserved += int64_t(size);
      d.stats.num_device_alloc += 1;
      update_stat(d.stats.segment, size, 1);
      update_stat(d.stats.reserved_bytes, size, int64_t(size));
      trace(d, "segment_alloc", reinterpret_cast<uintptr_t>(ptr), size, context);
    }
    trace(d, "alloc", reinterpret_cast<uintptr_t>(ptr), size, history_.context_alloc ? context : nullptr);
    live_[ptr] = Block{dev, size, nbytes, history_.context_state ? context : nullptr};
    update_stat(d.stats.allocation, size, 1);
    update_stat(d.stats.active, size, 1);
    update_stat(d.stats.allocated_bytes, size, int64_t(size));
    update_stat(d.stats.active_bytes, size, int64_t(size));
    update_stat(d.stats.requested_bytes, size, int64_t(nbytes));
    return ptr;
  }

 public:
  void free_block(void* ptr) {
    Traceback context = gather(history_.context_free);
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    auto it = live_.find(ptr);
    TORCH_INTERNAL_ASSERT(it != live_.end(), "neuron allocator: freeing an unknown pointer");
    Block b = it->second;
    live_.erase(it);
    auto& d = devices_[b.device];
    update_stat(d.stats.allocation, b.size, -1);
    update_stat(d.stats.active, b.size, -1);
    update_stat(d.stats.allocated_bytes, b.size, -int64_t(b.size));
    update_stat(d.stats.active_bytes, b.size, -int64_t(b.size));
    update_stat(d.stats.requested_bytes, b.size, -int64_t(b.requested));
    d.cached.emplace(b.size, ptr);
    // execution is in stream order, so a freed block is reusable at once
    trace(d, "free_requested", reinterpret_cast<uintptr_t>(ptr), b.size, context);
    trace(d, "free_completed", reinterpret_cast<uintptr_t>(ptr), b.size, context);
  }

 private:
  static int64_t cached_bytes(const DeviceState& d) {
    int64_t total = 0;
    for (const auto& entry : d.cached) total += int64_t(entry.first);
    return total;
  }

  void release_cached(DeviceState& d, const Traceback& context) {
    for (auto& [size, ptr] : d.cached) {
      trace(d, "segment_free", reinterpret_cast<uintptr_t>(ptr), size, context);
      std::free(ptr);
      d.reserved -= int64_t(size);
      d.stats.num_device_free += 1;
      update_stat(d.stats.segment, size, -1);
      update_stat(d.stats.reserved_bytes, size, -int64_t(size));
    }
    d.cached.clear();
  }

  std::recursive_mutex mutex_;
  std::vector<DeviceState> devices_;
  std::map<const void*, Block> live_;
  HbmHistoryConfig history_;
};

HbmAllocator g_hbm;

void HbmAllocator::raw_delete(void* ptr) {
  if (ptr != nullptr) g_hbm.free_block(ptr);
}

// Pinned host memory: ordinary host memory whose ranges are remembered.
class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &raw_delete, c10::Device(c10::DeviceType::CPU)};
    void* p = std::aligned_alloc(kAlignment, round_size(n));
    TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr, "could not allocate ", n, " bytes of pinned memory");
    {
      std::lock_guard<std::mutex> lock(mutex());
      ranges()[p] = n;
    }
    return {p, p, &raw_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete; }
  void copy_data(void* dst, const void* src, size_t n) const override { std::memcpy(dst, src, n); }

  static bool contains(const void* p) {
    std::lock_guard<std::mutex> lock(mutex());
    auto it = ranges().upper_bound(p);
    if (it == ranges().begin()) return false;
    --it;
    return static_cast<const char*>(p) < static_cast<const char*>(it->first) + it->second;
  }

 private:
  static std::mutex& mutex() { static std::mutex m; return m; }
  static std::map<const void*, size_t>& ranges() { static std::map<const void*, size_t> r; return r; }
  static void raw_delete(void* p) {
    if (p == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mutex());
      ranges().erase(p);
    }
    std::free(p);
  }
};

PinnedAllocator g_pinned;

}  // namespace

void configure(int num_devices, int64_t hbm_bytes_per_device) { g_hbm.configure(num_devices, hbm_bytes_per_device); }
c10::DeviceIndex device_count() noexcept { return static_cast<c10::DeviceIndex>(g_hbm.count()); }
int64_t hbm_capacity(c10::DeviceIndex index) { check_device_index(index); return g_hbm.capacity(index); }
c10::Allocator* hbm_allocator() { return &g_hbm; }
c10::DeviceIndex device_of_pointer(const void* ptr) { return g_hbm.owner(ptr); }
void hbm_record_history(const HbmHistoryConfig& config) { g_hbm.record_history(config); }
HbmSnapshot hbm_snapshot() { return g_hbm.snapshot(); }
c10::Allocator* pinned_allocator() { return &g_pinned; }
bool is_pinned_pointer(const void* ptr) { return PinnedAllocator::contains(ptr); }

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_hbm);

}  // namespace torchneuron
