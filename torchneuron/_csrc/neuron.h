// Shared declarations of the small C++ glue that makes `neuron` a PyTorch device.
// Everything else (kernels, compiler, simulator, runtime) is Python.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <memory>
#include <cstdint>
#include <optional>
#include <tuple>
#include <string>
#include <vector>

namespace torchneuron {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

// Device table, set once from Python (chip spec) before the first tensor exists.
void configure(int num_devices, int64_t hbm_bytes_per_device);
c10::DeviceIndex device_count() noexcept;
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
// Raises the error PyTorch raises for an invalid device ordinal.
void check_device_index(c10::DeviceIndex index);
int64_t hbm_capacity(c10::DeviceIndex index);

// HBM: the caching allocator that owns all device memory.
c10::Allocator* hbm_allocator();
// Which device owns the allocation containing `ptr` (-1 when none does).
c10::DeviceIndex device_of_pointer(const void* ptr);

// Memory history and snapshots of the HBM allocator (torch.neuron.memory._record_memory_history,
// _snapshot): what is recorded, a trace entry, a block, and the snapshot.
struct HbmHistoryConfig {
  bool trace = false;            // keep a history of allocator actions
  bool context_state = false;    // stacks of live allocations
  bool context_alloc = false;    // stacks of alloc (and segment) entries
  bool context_free = false;     // stacks of free entries
  bool cpp_stacks = false;       // C++ frames besides Python's
  bool clear = false;            // drop the history recorded so far
  size_t max_entries = 0;        // per device; older entries are overwritten
};
struct HbmTraceEntry {
  const char* action;            // alloc, free_requested, free_completed, segment_alloc, segment_free, oom, snapshot
  uintptr_t addr;
  size_t size;
  int64_t time_us;
  int64_t device_free;           // oom only: bytes not reserved
  std::shared_ptr<c10::GatheredContext> context;
};
struct HbmBlockInfo {
  c10::DeviceIndex device;
  uintptr_t address;
  size_t size;
  size_t requested;
  bool allocated;                // else cached (inactive)
  std::shared_ptr<c10::GatheredContext> context;
};
struct HbmSnapshot {
  std::vector<HbmBlockInfo> blocks;               // by address; each block is its own segment
  std::vector<std::vector<HbmTraceEntry>> traces; // per device, oldest first
};
void hbm_record_history(const HbmHistoryConfig& config);
HbmSnapshot hbm_snapshot();
// Page-locked host memory (plain host memory here, tracked so is_pinned() is truthful).
c10::Allocator* pinned_allocator();
bool is_pinned_pointer(const void* ptr);

// A CPU tensor over the same bytes as a neuron tensor (same sizes, strides,
// offset). It keeps the neuron storage alive. Used by copies and the CPU fallback.
at::Tensor alias_as_cpu(const at::Tensor& t);

// Device clock of each stream, in simulated nanoseconds.
int64_t stream_clock(c10::DeviceIndex device, c10::StreamId stream);
void advance_stream_clock(c10::DeviceIndex device, c10::StreamId stream, int64_t ns);

// Random numbers: the CPU generator that backs neuron:index's default generator.
at::Generator default_neuron_generator(c10::DeviceIndex index);
at::Generator cpu_generator_of(const at::Generator& neuron_generator);

// CPU fallback accounting.
void set_strict(bool strict);
bool strict();
std::vector<std::pair<std::string, int64_t>> fallback_counts();
void reset_fallback_counts();
void record_fallback(const std::string& op_name);
// The catch-all CPU fallback (boxed): also what a Python kernel calls for inputs it does not handle.
void run_cpu_fallback(const c10::OperatorHandle& op, std::vector<c10::IValue>* stack);
// CPU routes of ops lowered in Python whose fallback needs special care (see ops.cpp).
std::tuple<at::Tensor, at::Tensor> fallback_native_dropout(const at::Tensor& input, double p,
                                                           std::optional<bool> train);
std::tuple<at::Tensor, at::Tensor, at::Tensor> fallback_native_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
    double momentum, double eps);
at::Tensor fallback_convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                std::vector<int64_t> stride, std::vector<int64_t> padding,
                                std::vector<int64_t> dilation, bool transposed, std::vector<int64_t> output_padding,
                                int64_t groups);
std::tuple<at::Tensor, at::Tensor, at::Tensor> fallback_convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, std::vector<int64_t> stride,
    std::vector<int64_t> padding, std::vector<int64_t> dilation, bool transposed,
    std::vector<int64_t> output_padding, int64_t groups, std::array<bool, 3> output_mask);

}  // namespace torchneuron
