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

#include <algorithm>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

// A run of consecutive same-dtype copies of one program (dma_copy / tensor_copy between HBM and SBUF, or within
// SBUF), executed in program order in one call: _CopyBatch. From Python each copy is a view (as_strided of the
// run's HBM tensor, ~1.2 us) and a copy_ (~2-4 us of dispatch for a small tile); here it is a strided byte copy.
// The caller (torchneuron/sim/copies.py) admits only copies that torch's copy_ would do bit for bit: equal
// dtypes and shapes, no destination element written twice, source and destination disjoint. On-chip sides are
// views of the core's SBUF kept with the batch; HBM sides are (slot, byte offset, byte strides) of the run's
// bound tensors, whose byte lengths are checked against the furthest byte the batch reaches in each.
class CopyBatch {
 public:
  // copies: per copy (sizes, itemsize, dst side, src side); a side is a tensor (an on-chip view) or a tuple
  // (slot index, byte offset, byte strides).
  explicit CopyBatch(py::list copies) {
    for (py::handle c : copies) {
      auto t = c.cast<py::tuple>();
      Copy copy;
      auto sizes = t[0].cast<std::vector<int64_t>>();
      copy.itemsize = t[1].cast<int64_t>();
      TORCH_CHECK(copy.itemsize == 1 || copy.itemsize == 2 || copy.itemsize == 4 || copy.itemsize == 8,
                  "a copy of ", copy.itemsize, "-byte elements");
      Side dst = side(t[2], sizes.size(), copy.itemsize, sizes), src = side(t[3], sizes.size(), copy.itemsize, sizes);
      // drop size-1 dims, then merge dims that are contiguous on both sides (fewer, longer inner runs)
      std::vector<int64_t> sz, ds, ss;
      for (size_t d = 0; d < sizes.size(); ++d) {
        if (sizes[d] == 1) continue;
        if (!sz.empty() && ds.back() == dst.strides[d] * sizes[d] && ss.back() == src.strides[d] * sizes[d]) {
          sz.back() *= sizes[d];
          ds.back() = dst.strides[d];
          ss.back() = src.strides[d];
          continue;
        }
        sz.push_back(sizes[d]);
        ds.push_back(dst.strides[d]);
        ss.push_back(src.strides[d]);
      }
      if (sz.empty()) {  // one element
        sz = {1};
        ds = {copy.itemsize};
        ss = {copy.itemsize};
      }
      copy.sizes = sz;
      copy.transposed = transposing(sz, ds, ss, copy.itemsize);
      dst.strides = ds;
      src.strides = ss;
      copy.dst = std::move(dst);
      copy.src = std::move(src);
      copies_.push_back(std::move(copy));
    }
  }

  // Run the copies in order on the run's bound HBM tensors (`tensors`, slot order).
  void run(py::sequence tensors) const {
    std::vector<char*> base(need_.size(), nullptr);
    for (size_t k = 0; k < need_.size(); ++k) {
      if (need_[k] < 0) continue;
      py::handle item = tensors[k];
      TORCH_CHECK(THPVariable_Check(item.ptr()), "slot ", k, " is not bound to a tensor");
      const at::Tensor& t = THPVariable_Unpack(item.ptr());
      TORCH_CHECK(t.is_cpu() && t.is_contiguous() && static_cast<int64_t>(t.nbytes()) >= need_[k], "slot ", k,
                  " is bound to ", t.nbytes(), " bytes; its copies reach byte ", need_[k]);
      base[k] = static_cast<char*>(t.data_ptr());
    }
    for (const Copy& c : copies_) {
      char* dst = c.dst.slot >= 0 ? base[c.dst.slot] + c.dst.offset : c.dst.ptr;
      const char* src = c.src.slot >= 0 ? base[c.src.slot] + c.src.offset : c.src.ptr;
      copy_strided(c, dst, src);
    }
  }

 private:
  struct Side {
    int64_t slot = -1;         // HBM slot index, or -1: an on-chip view
    at::Tensor view;           // the on-chip view (kept: its storage is the core's memory)
    char* ptr = nullptr;       // the on-chip view's first byte
    int64_t offset = 0;        // HBM: byte offset in the slot's tensor
    std::vector<int64_t> strides;  // byte strides
  };
  struct Copy {
    std::vector<int64_t> sizes;
    int64_t itemsize = 0;
    bool transposed = false;  // the last two dims are a transpose (see transposing)
    Side dst, src;
  };

  // A transpose in the last two dims of 2- or 4-byte elements: one side dense along the last dim, the other along
  // the one before it. Row by row that reads (or writes) one element per row of the other side, 9 us for a
  // [128, 128] fp32 tile out of SBUF; as register transposes of square tiles, 2.3 us (copy_transposed).
  static bool transposing(const std::vector<int64_t>& sizes, const std::vector<int64_t>& ds,
                          const std::vector<int64_t>& ss, int64_t w) {
#if defined(__SSE2__)
    const size_t n = sizes.size();
    if (n < 2 || (w != 2 && w != 4) || sizes[n - 1] < 16 / w || sizes[n - 2] < 16 / w) return false;
    return (ds[n - 1] == w && ss[n - 2] == w && ss[n - 1] != w) || (ss[n - 1] == w && ds[n - 2] == w && ds[n - 1] != w);
#else
    return false;
#endif
  }

  Side side(py::handle h, size_t dims, int64_t itemsize, const std::vector<int64_t>& sizes) {
    Side s;
    if (THPVariable_Check(h.ptr())) {
      s.view = THPVariable_Unpack(h.ptr());
      TORCH_CHECK(s.view.is_cpu() && static_cast<size_t>(s.view.dim()) == dims &&
                      s.view.element_size() == itemsize && s.view.sizes().vec() == sizes,
                  "an on-chip side must be a CPU view of the copy's shape and element size");
      s.ptr = static_cast<char*>(s.view.data_ptr());
      for (int64_t st : s.view.strides()) s.strides.push_back(st * itemsize);
      return s;
    }
    auto t = h.cast<py::tuple>();
    s.slot = t[0].cast<int64_t>();
    s.offset = t[1].cast<int64_t>();
    s.strides = t[2].cast<std::vector<int64_t>>();
    TORCH_CHECK(s.slot >= 0 && s.offset >= 0 && s.strides.size() == dims, "an HBM side needs a slot, an offset "
                "and one stride per dim");
    int64_t end = s.offset + itemsize;  // one past the furthest byte reached
    for (size_t d = 0; d < dims; ++d) {
      TORCH_CHECK(s.strides[d] >= 0, "negative HBM stride");
      end += (sizes[d] - 1) * s.strides[d];
    }
    if (need_.size() <= static_cast<size_t>(s.slot)) need_.resize(s.slot + 1, -1);
    need_[s.slot] = std::max(need_[s.slot], end);
    return s;
  }

  template <typename T>
  static void copy_elems(char* dst, const char* src, int64_t n, int64_t ds, int64_t ss) {
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(dst + i * ds, src + i * ss, sizeof(T));
    }
  }

  // innermost dim: one memcpy where both sides are dense, else element by element
  static void copy_row(const Copy& c, char* dst, const char* src) {
    const size_t d = c.sizes.size() - 1;
    const int64_t n = c.sizes[d], ds = c.dst.strides[d], ss = c.src.strides[d], w = c.itemsize;
    if (ds == w && ss == w) {
      std::memcpy(dst, src, n * w);
      return;
    }
    switch (w) {
      case 1: copy_elems<uint8_t>(dst, src, n, ds, ss); break;
      case 2: copy_elems<uint16_t>(dst, src, n, ds, ss); break;
      case 4: copy_elems<uint32_t>(dst, src, n, ds, ss); break;
      default: copy_elems<uint64_t>(dst, src, n, ds, ss); break;
    }
  }

#if defined(__SSE2__)
  // One 128-bit tile: 4x4 elements of 4 bytes or 8x8 of 2 bytes, read as one vector per source row (dense along
  // the destination's rows) and written as one vector per destination row. Unpacks move bits only (no float
  // arithmetic: NaN payloads and signed zeros pass unchanged).
  static void transpose_tile4(char* d, const char* s, int64_t dr, int64_t sc) {
    const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + sc));
    const __m128i a2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * sc));
    const __m128i a3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 3 * sc));
    const __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpacklo_epi32(a2, a3);
    const __m128i t2 = _mm_unpackhi_epi32(a0, a1), t3 = _mm_unpackhi_epi32(a2, a3);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm_unpacklo_epi64(t0, t1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + dr), _mm_unpackhi_epi64(t0, t1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * dr), _mm_unpacklo_epi64(t2, t3));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 3 * dr), _mm_unpackhi_epi64(t2, t3));
  }

  static void transpose_tile2(char* d, const char* s, int64_t dr, int64_t sc) {
    __m128i a[8], t[8], u[8];
    for (int k = 0; k < 8; ++k) a[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k * sc));
    for (int k = 0; k < 4; ++k) {  // pairs of source rows interleaved
      t[2 * k] = _mm_unpacklo_epi16(a[2 * k], a[2 * k + 1]);
      t[2 * k + 1] = _mm_unpackhi_epi16(a[2 * k], a[2 * k + 1]);
    }
    for (int k = 0; k < 2; ++k) {  // then quads: rows 0-3 from t[0..3], rows 4-7 from t[4..7]
      u[4 * k] = _mm_unpacklo_epi32(t[4 * k], t[4 * k + 2]);
      u[4 * k + 1] = _mm_unpackhi_epi32(t[4 * k], t[4 * k + 2]);
      u[4 * k + 2] = _mm_unpacklo_epi32(t[4 * k + 1], t[4 * k + 3]);
      u[4 * k + 3] = _mm_unpackhi_epi32(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int k = 0; k < 4; ++k) {  // and the two halves of each destination row
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * k * dr), _mm_unpacklo_epi64(u[k], u[k + 4]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + (2 * k + 1) * dr), _mm_unpackhi_epi64(u[k], u[k + 4]));
    }
  }

  // dst[r, c] = src[r, c] for a [rows, cols] pattern with dst dense along c and src dense along r: whole tiles in
  // registers, the ragged edges element by element. Each element is written once and no source byte is a
  // destination byte (the caller's admission), so the order moves the same bits.
  template <typename T>
  static void copy_transposed_of(char* dst, const char* src, int64_t rows, int64_t cols, int64_t dr, int64_t sc) {
    constexpr int64_t w = sizeof(T), k = 16 / w;
    const int64_t rows_k = rows - rows % k, cols_k = cols - cols % k;
    for (int64_t r = 0; r < rows_k; r += k) {
      for (int64_t c = 0; c < cols_k; c += k) {
        if constexpr (w == 4) {
          transpose_tile4(dst + r * dr + c * w, src + r * w + c * sc, dr, sc);
        } else {
          transpose_tile2(dst + r * dr + c * w, src + r * w + c * sc, dr, sc);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {  // the ragged edges: the last columns of tiled rows, whole untiled rows
      const int64_t c0 = r < rows_k ? cols_k : 0;
      copy_elems<T>(dst + r * dr + c0 * w, src + r * w + c0 * sc, cols - c0, w, sc);
    }
  }
#endif

  // the last two dims of a transpose (see transposing), oriented so that dst is dense along the columns
  static void copy_transposed(const Copy& c, char* dst, const char* src) {
#if defined(__SSE2__)
    const size_t n = c.sizes.size();
    const int64_t w = c.itemsize;
    int64_t rows = c.sizes[n - 2], cols = c.sizes[n - 1], dr = c.dst.strides[n - 2], sc = c.src.strides[n - 1];
    if (c.dst.strides[n - 1] != w) {  // dst dense along the rows: the same copy with the two dims swapped
      std::swap(rows, cols);
      dr = c.dst.strides[n - 1];
      sc = c.src.strides[n - 2];
    }
    if (w == 4) {
      copy_transposed_of<uint32_t>(dst, src, rows, cols, dr, sc);
    } else {
      copy_transposed_of<uint16_t>(dst, src, rows, cols, dr, sc);
    }
#else
    TORCH_CHECK(false, "a transposed copy needs SSE2");
#endif
  }

  // the innermost dim (or, for a transpose, the last two) at one position of the others
  static void copy_inner(const Copy& c, char* dst, const char* src) {
    if (c.transposed) {
      copy_transposed(c, dst, src);
    } else {
      copy_row(c, dst, src);
    }
  }

  static void copy_strided(const Copy& c, char* dst, const char* src) {
    const size_t outer = c.sizes.size() - (c.transposed ? 2 : 1);
    if (outer == 0) {
      copy_inner(c, dst, src);
      return;
    }
    std::vector<int64_t> idx(outer, 0);
    while (true) {
      copy_inner(c, dst, src);
      size_t d = outer;
      while (d > 0) {  // advance the outer index, last dim fastest
        --d;
        dst += c.dst.strides[d];
        src += c.src.strides[d];
        if (++idx[d] < c.sizes[d]) break;
        dst -= c.dst.strides[d] * c.sizes[d];
        src -= c.src.strides[d] * c.sizes[d];
        idx[d] = 0;
        if (d == 0) return;
      }
    }
  }

  std::vector<Copy> copies_;
  std::vector<int64_t> need_;  // per slot: the bytes the batch reaches in it (-1: not used)
};

}  // namespace

void bind_launch(py::module_& m) {
  py::class_<SlotLayout>(m, "_SlotLayout", "How a launch binds a program's argument slots (see launch.cpp).")
      .def(py::init<std::vector<std::vector<int64_t>>, std::vector<std::optional<at::ScalarType>>,
                    std::vector<std::vector<int64_t>>>())
      .def("bind", &SlotLayout::bind, "Allocate the unbound outputs; return each slot's host alias.");
  py::class_<CopyBatch>(m, "_CopyBatch", "Consecutive same-dtype copies of a program, run in one call (see launch.cpp).")
      .def(py::init<py::list>())
      .def("run", &CopyBatch::run, "Run the copies in order on the run's bound HBM tensors (slot order).");
}

}  // namespace torchneuron
