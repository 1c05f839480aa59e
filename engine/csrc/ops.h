// The kernels' entry points, for C++ callers in this extension (engine/csrc/decode_layer.cpp): the same
// functions torch.ops.pagedserve.* dispatch to, called directly (no Python, no dispatcher, no boxing).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace pagedserve {

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                       const std::optional<at::Tensor>& bias_d);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                       const std::optional<at::Tensor>& bias_d);
at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                       const std::optional<at::Tensor>& bias_d);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t query_tile, int64_t splits);

}  // namespace pagedserve
