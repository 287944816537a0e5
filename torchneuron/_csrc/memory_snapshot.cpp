// The HBM allocator's memory history and snapshot as Python objects, in the layout of
// torch.cuda.memory._snapshot() (segments with blocks, device_traces, frames), which
// PyTorch's memory visualizer (torch.cuda._memory_viz, pytorch.org/memory_viz) reads.
#include "neuron.h"

#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/extension.h>

#include <unordered_map>

namespace py = pybind11;

// torch/csrc/profiler/python/combined_traceback.h declares it, but includes a JSON header torch
// does not ship: each stack as a list of {"filename", "line", "name"} frames.
namespace torch {
TORCH_API std::vector<pybind11::object> py_symbolize(std::vector<CapturedTraceback*>& to_symbolize);
}

namespace torchneuron {
namespace {

constexpr size_t kSmallSegment = 1 << 20;  // the allocator's small pool, as CUDA's

py::dict snapshot_dict() {
  HbmSnapshot snap = hbm_snapshot();
  // symbolize every stack at once: frames shared between stacks are built once
  std::vector<torch::CapturedTraceback*> stacks;
  std::unordered_map<const c10::GatheredContext*, size_t> index;
  auto want = [&](const std::shared_ptr<c10::GatheredContext>& ctx) {
    if (ctx && !index.count(ctx.get())) {
      index[ctx.get()] = stacks.size();
      stacks.push_back(static_cast<torch::CapturedTraceback*>(ctx.get()));
    }
  };
  for (const auto& b : snap.blocks) want(b.context);
  for (const auto& device : snap.traces)
    for (const auto& e : device) want(e.context);
  std::vector<py::object> symbolized = torch::py_symbolize(stacks);
  auto frames = [&](const std::shared_ptr<c10::GatheredContext>& ctx) -> py::object {
    return ctx ? symbolized.at(index.at(ctx.get())) : py::list();
  };

  py::list segments;
  for (const auto& b : snap.blocks) {
    size_t used = b.allocated ? b.size : 0;
    py::dict block;
    block["address"] = b.address;
    block["size"] = b.size;
    block["requested_size"] = b.allocated ? b.requested : 0;
    block["state"] = b.allocated ? "active_allocated" : "inactive";
    block["frames"] = frames(b.context);
    py::dict seg;
    seg["device"] = int(b.device);
    seg["address"] = b.address;
    seg["total_size"] = b.size;
    seg["allocated_size"] = used;
    seg["active_size"] = used;
    seg["requested_size"] = b.allocated ? b.requested : 0;
    seg["stream"] = 0;
    seg["segment_type"] = b.size <= kSmallSegment ? "small" : "large";
    seg["segment_pool_id"] = py::make_tuple(0, 0);
    seg["is_expandable"] = false;
    seg["frames"] = frames(b.context);
    py::list blocks;
    blocks.append(block);
    seg["blocks"] = blocks;
    segments.append(seg);
  }
  py::list traces;
  for (const auto& device : snap.traces) {
    py::list entries;
    for (const auto& e : device) {
      py::dict entry;
      entry["action"] = e.action;
      entry["addr"] = e.addr;
      entry["size"] = e.size;
      entry["stream"] = 0;
      entry["time_us"] = e.time_us;
      entry["frames"] = frames(e.context);
      if (std::string(e.action) == "oom") entry["device_free"] = e.device_free;
      entries.append(entry);
    }
    traces.append(entries);
  }
  py::dict out;
  out["segments"] = segments;
  out["device_traces"] = traces;
  return out;
}

}  // namespace

void bind_memory_history(py::module_& m) {
  m.def("_record_memory_history",
        [](bool trace, bool context_state, bool context_alloc, bool context_free, bool cpp_stacks, bool clear,
           size_t max_entries) {
          hbm_record_history(HbmHistoryConfig{trace, context_state, context_alloc, context_free, cpp_stacks, clear,
                                              max_entries});
        },
        "Configure what the HBM allocator records (see torchneuron.neuron.memory._record_memory_history).");
  m.def("_memory_snapshot", &snapshot_dict, "The HBM allocator's segments, blocks and history.");
}

}  // namespace torchneuron
