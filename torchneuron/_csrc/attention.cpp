// Which implementation torch.nn.functional.scaled_dot_product_attention runs on neuron.
//
// SDPA asks the device's `_fused_sdp_choice_stub`; a device without one always gets the math path
// (about twenty element-wise and copy ops per call, each a kernel launch). Here the overrideable
// backend is chosen for what torchneuron/ops/attention.py fuses: 4-D floating inputs of one dtype
// with equal batch and head counts, no attention mask, no dropout, no grouped-query heads, and the
// backend left enabled (`torch.nn.attention.sdpa_kernel`). Everything else keeps the math path.
#include "neuron.h"

#include <ATen/Context.h>
#include <ATen/SDPBackend.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>

namespace torchneuron {
namespace {

bool fused_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

int64_t neuron_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& attn_mask, double dropout_p, bool /*is_causal*/,
                          std::optional<double> /*scale*/, bool enable_gqa) {
  const bool shapes = q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == k.size(0) &&
                      q.size(0) == v.size(0) && q.size(1) == k.size(1) && q.size(1) == v.size(1) &&
                      k.size(2) == v.size(2) && q.size(3) == k.size(3) && q.numel() > 0 && k.numel() > 0 &&
                      v.numel() > 0;
  const bool dtypes = fused_dtype(q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
                      v.scalar_type() == q.scalar_type();
  const bool fused = at::globalContext().userEnabledOverrideableSDP() && !attn_mask.has_value() &&
                     dropout_p == 0.0 && !enable_gqa && shapes && dtypes;
  return static_cast<int64_t>(fused ? at::SDPBackend::overrideable : at::SDPBackend::math);
}

}  // namespace
}  // namespace torchneuron

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &torchneuron::neuron_sdp_choice)
}  // namespace at::native
