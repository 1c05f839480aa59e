// One decoder layer of a small decode step, in one call: the same kernels as the per-op path
// (engine/models/llama.py with the C++ layer ops), in the same order, so the result is bit-identical (dense
// projections: up to DENSE_GEMV_MAX_M rows; the fused layer takes up to FUSED_DENSE_MAX_M, where the per-op
// path has handed the projections to oneDNN, whose roundings differ).
//
// Why: at batch 1 a SmolLM2 step is a dozen small op calls in each of its 30 layers besides the projections'
// bytes, and every call from Python pays a fixed cost before it does anything (argument parsing, dispatcher,
// output tensor, the module tree around it): a sizeable share of a bf16 step, and more of an int8/int4 one,
// whose weights stream in half or a quarter of the time. Called from C++ the same kernels cost what they
// compute (benchmarks/kernels/bench_fused_decode.py; figures in docs/performance.md).
//
// Each projection comes as a list of tensors, its kernel told by the first one's dtype:
//   float (bf16/fp16/fp32) [weight] or [weight, bias]           -> dense_linear
//   int8 or uint8          [panel codes, scale, bias, scale_d, bias_d] (+ bias)  -> int8_linear, or int4_linear /
//                          int6_linear (uint8 codes: 8 or 12 bytes per panel per input feature)
// (the group values as the panel ops take them, an empty tensor where one is absent; then the layer's own bias)
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <optional>

#include "ops.h"

namespace {

at::Tensor project(const at::Tensor& x, at::TensorList w) {
  const auto type = w[0].scalar_type();
  if (type != at::kChar && type != at::kByte)
    return pagedserve::dense_linear(x, w[0], w.size() > 1 ? std::optional<at::Tensor>(w[1]) : std::nullopt);
  TORCH_CHECK(w.size() >= 5, "decode_layer: a quantized projection takes 5 operands");
  auto op = type == at::kChar ? pagedserve::int8_linear
            : w[0].size(1) == 12 * x.size(1) ? pagedserve::int6_linear : pagedserve::int4_linear;
  auto y = op(x, w[0], w[1], w[2], w[3], w[4]);
  if (w.size() > 5) y.add_(w[5]);  // a quantized projection's own bias, as QuantLinear adds it
  return y;
}

// h [T, hidden] is updated in place: h += attention(norm(h)); h += mlp(norm(h)). cos/sin [T, D] in h's dtype;
// slots [T] int64 cache slots; the caches [blocks, block_size, Hkv, D] contiguous; the rest as paged_attention.
void decode_layer(at::Tensor& h, const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                  at::TensorList qkv, at::TensorList o, at::TensorList gate_up, at::TensorList down,
                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const at::Tensor& query_start_loc, int64_t num_heads, double scale, int64_t query_tile,
                  int64_t splits) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decode_layer: h [T, hidden], contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == h.scalar_type() && v_cache.scalar_type() == h.scalar_type(),
              "decode_layer: contiguous K/V caches in h's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == h.size(0), "decode_layer: one int64 slot a token");
  const int64_t T = h.size(0), hkv = k_cache.size(2), D = k_cache.size(3);
  const int64_t slots_total = k_cache.size(0) * k_cache.size(1);
  auto x = pagedserve::rms_norm(h, input_norm, eps);
  auto qkv_out = project(x, qkv).view({T, num_heads + 2 * hkv, D});
  auto qk = qkv_out.narrow(1, 0, num_heads + hkv);
  pagedserve::rope_(qk, cos, sin);
  // the new K/V rows into their slots (index_copy_, without its checks and allocations)
  const auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t row = hkv * D * h.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* src = static_cast<const char*>(qkv_out.data_ptr());
  const int64_t src_row = qkv_out.stride(0) * h.element_size(), head = D * h.element_size();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < slots_total, "decode_layer: cache slot ", sp[t], " out of range");
    std::memcpy(kc + sp[t] * row, src + t * src_row + num_heads * head, row);
    std::memcpy(vc + sp[t] * row, src + t * src_row + (num_heads + hkv) * head, row);
  }
  auto attn = pagedserve::paged_attention(qk.narrow(1, 0, num_heads), k_cache, v_cache, block_tables, seq_lens,
                                          query_start_loc, scale, query_tile, splits);
  auto a = project(attn.view({T, num_heads * D}), o);
  auto x2 = pagedserve::add_rms_norm(a, h, post_norm, eps);  // h += a
  h.add_(project(pagedserve::silu_and_mul(project(x2, gate_up)), down));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("decode_layer(Tensor(a!) h, Tensor input_norm, Tensor post_norm, float eps, Tensor[] qkv, Tensor[] o, "
        "Tensor[] gate_up, Tensor[] down, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slots, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int num_heads, float scale, "
        "int query_tile, int splits) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("decode_layer", &decode_layer); }
