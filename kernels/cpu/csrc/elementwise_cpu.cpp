// The elementwise ops of a decoder layer on the CPU, one pass each: compiled twins of the torch
// references rms_norm (kernels/rmsnorm.py), apply_rotary (kernels/rotary.py) and silu_and_mul
// (kernels/activation.py), which tests/kernels/cpu/test_elementwise_cpu.py compares them with; and the
// sampler's greedy argmax (graphrt/runtime/sampler.py), compared with torch.argmax there too.
// kernels/cpu/elementwise.py calls them as torch.ops.graphrt.<name>.
//
// Each reference is several torch ops (RMSNorm with its residual add is nine), each a pass over
// the activations and a trip through the dispatcher and Python; at decode sizes the trips cost more
// than the arithmetic. Here each is one call and one pass. The roundings are the reference's: where
// it rounds an intermediate to the input dtype (bfloat16), so does this code, by doing that step's
// arithmetic in Vectorized<scalar_t> exactly as torch's own elementwise kernels do; the build turns
// off FMA contraction so float32 products are rounded before they are added, as in torch.
//
// Threads: at::parallel_for over rows, with a grain that keeps a small batch on one thread (waking
// the pool costs about as much as a decode batch's norm). See paged_attention_cpu.cpp on OpenMP.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "silu_and_mul.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using at::vec::Vectorized;

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Elements per parallel task: below this a task's work is about what waking a thread costs.
constexpr int64_t kGrainElements = 16384;

int64_t grain_rows(int64_t row_size) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_size)); }

// out = weight * round(s * rsqrt(mean(s^2) + eps)), with s = x + residual rounded to the dtype
// (stored as the new residual) or x itself. The statistics are in Acc, as in the reference.
template <typename scalar_t>
void rms_norm_row(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, double eps, int64_t size,
                  scalar_t* out, scalar_t* summed) {
  using Acc = acc_type<scalar_t>;
  using Vec = Vectorized<scalar_t>;
  using AccVec = Vectorized<Acc>;
  constexpr int64_t kStep = Vec::size();
  constexpr bool kReduced = !std::is_same_v<scalar_t, Acc>;
  const scalar_t* s = x;
  if (residual != nullptr) {
    for (int64_t i = 0; i < size; i += kStep) {
      const int64_t count = std::min(kStep, size - i);
      (Vec::loadu(x + i, count) + Vec::loadu(residual + i, count)).store(summed + i, count);
    }
    s = summed;
  }
  AccVec squares(0);  // a partial load fills the rest with zeros, which add nothing
  for (int64_t i = 0; i < size; i += kStep) {
    const Vec v = Vec::loadu(s + i, std::min(kStep, size - i));
    if constexpr (kReduced) {
      auto [low, high] = at::vec::convert_to_float<scalar_t>(v);
      squares = at::vec::fmadd(high, high, at::vec::fmadd(low, low, squares));
    } else {
      squares = at::vec::fmadd(v, v, squares);
    }
  }
  const Acc total = at::vec::vec_reduce_all<Acc>([](AccVec& a, AccVec& b) { return a + b; }, squares);
  const AccVec inv_rms(Acc(1) / std::sqrt(total / static_cast<Acc>(size) + static_cast<Acc>(eps)));
  for (int64_t i = 0; i < size; i += kStep) {
    const int64_t count = std::min(kStep, size - i);
    // Rounded to the dtype before the weight, as transformers' Llama (and the reference) does.
    Vec normed;
    if constexpr (kReduced) {
      auto [low, high] = at::vec::convert_to_float<scalar_t>(Vec::loadu(s + i, count));
      normed = at::vec::convert_from_float<scalar_t>(low * inv_rms, high * inv_rms);
    } else {
      normed = Vec::loadu(s + i, count) * inv_rms;
    }
    (Vec::loadu(weight + i, count) * normed).store(out + i, count);
  }
}

// Returns (out, x + residual); without a residual the second is empty (the sum is x itself).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be (rows, size) with unit-stride rows");
  const int64_t rows = x.size(0), size = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous (", size, ",) tensor of x's dtype");
  const bool has_residual = residual.has_value();
  if (has_residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must match x in shape and dtype, with unit-stride rows");
  }
  at::Tensor out = at::empty({rows, size}, x.options());
  at::Tensor summed = at::empty({has_residual ? rows : 0, size}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* x_data = x.const_data_ptr<scalar_t>();
    const scalar_t* residual_data = has_residual ? residual->const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* weight_data = weight.const_data_ptr<scalar_t>();
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    scalar_t* summed_data = has_residual ? summed.mutable_data_ptr<scalar_t>() : nullptr;
    const int64_t x_stride = x.stride(0), residual_stride = has_residual ? residual->stride(0) : 0;
    at::parallel_for(0, rows, grain_rows(size), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        rms_norm_row<scalar_t>(x_data + row * x_stride, has_residual ? residual_data + row * residual_stride : nullptr,
                               weight_data, eps, size, out_data + row * size,
                               has_residual ? summed_data + row * size : nullptr);
      }
    });
  });
  return {out, summed};
}

// The neox rotation of one head: out[i] = x[i] cos[i] - x[i + half] sin[i] and
// out[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half], with cos and sin already in the
// dtype and each product and sum rounded to it, as the reference's q * cos + rotate_half(q) * sin.
template <typename scalar_t>
inline void rotate_head(const scalar_t* x, const scalar_t* cos, const scalar_t* sin, int64_t half, scalar_t* out) {
  using Vec = Vectorized<scalar_t>;
  constexpr int64_t kStep = Vec::size();
  for (int64_t i = 0; i < half; i += kStep) {
    const int64_t count = std::min(kStep, half - i);
    const Vec low = Vec::loadu(x + i, count), high = Vec::loadu(x + half + i, count);
    const Vec new_low = low * Vec::loadu(cos + i, count) + high.neg() * Vec::loadu(sin + i, count);
    const Vec new_high = high * Vec::loadu(cos + half + i, count) + low * Vec::loadu(sin + half + i, count);
    new_low.store(out + i, count);
    new_high.store(out + half + i, count);
  }
}

// x: (tokens, heads, head_dim) with unit-stride heads, rotated into out (contiguous).
template <typename scalar_t>
void rotate_token(const scalar_t* x, int64_t head_stride, int64_t heads, const scalar_t* cos, const scalar_t* sin,
                  int64_t head_dim, scalar_t* out) {
  for (int64_t h = 0; h < heads; ++h) {
    rotate_head<scalar_t>(x + h * head_stride, cos, sin, head_dim / 2, out + h * head_dim);
  }
}

std::tuple<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "apply_rotary: q and k must be (tokens, heads, head_dim) with the same tokens and head_dim");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "apply_rotary: q and k must have unit-stride heads");
  TORCH_CHECK(q.size(2) % 2 == 0, "apply_rotary: head_dim must be even, got ", q.size(2));
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "apply_rotary: q and k must share a dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) &&
                  cos.size(1) == q.size(2),
              "apply_rotary: cos and sin must be contiguous float32 (tokens, head_dim)");
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  const int64_t q_heads = q.size(1), k_heads = k.size(1);
  at::Tensor q_out = at::empty({tokens, q_heads, head_dim}, q.options());
  at::Tensor k_out = at::empty({tokens, k_heads, head_dim}, k.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "apply_rotary", [&] {
    const scalar_t* q_data = q.const_data_ptr<scalar_t>();
    const scalar_t* k_data = k.const_data_ptr<scalar_t>();
    const float* cos_data = cos.const_data_ptr<float>();
    const float* sin_data = sin.const_data_ptr<float>();
    scalar_t* q_out_data = q_out.mutable_data_ptr<scalar_t>();
    scalar_t* k_out_data = k_out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain_rows((q_heads + k_heads) * head_dim), [&](int64_t begin, int64_t end) {
      // The token's cos and sin in the dtype (rounded as the reference's cos.to(q.dtype)).
      std::vector<scalar_t> token_cos(head_dim), token_sin(head_dim);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t d = 0; d < head_dim; ++d) {
          token_cos[d] = static_cast<scalar_t>(cos_data[t * head_dim + d]);
          token_sin[d] = static_cast<scalar_t>(sin_data[t * head_dim + d]);
        }
        rotate_token<scalar_t>(q_data + t * q.stride(0), q.stride(1), q_heads, token_cos.data(), token_sin.data(),
                               head_dim, q_out_data + t * q_heads * head_dim);
        rotate_token<scalar_t>(k_data + t * k.stride(0), k.stride(1), k_heads, token_cos.data(), token_sin.data(),
                               head_dim, k_out_data + t * k_heads * head_dim);
      }
    });
  });
  return {q_out, k_out};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be (rows, 2 * size) with unit-stride rows");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, size}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in_data = gate_up.const_data_ptr<scalar_t>();
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    const int64_t in_stride = gate_up.stride(0);
    at::parallel_for(0, rows, grain_rows(2 * size), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* gate = in_data + row * in_stride;
        graphrt_cpu::silu_and_mul_row<scalar_t>(gate, gate + size, size, out_data + row * size);
      }
    });
  });
  return out;
}

// Greedy sampling: each row's index of its largest value, the first of several equal ones, or of
// its first NaN where it has one (torch.argmax counts NaN as the largest). torch's argmax keeps an
// index beside every compared element, about 1 ms for a decode step's 32 rows of a 49k-token
// vocabulary; here one vector pass finds the row's maximum and a second the first place it holds
// (a row of that size stays in L2 between the two).
int64_t argmax_row(const float* x, int64_t size) {
  using Vec = Vectorized<float>;
  const int64_t vector_end = size - size % Vec::size();
  Vec running(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < vector_end; i += Vec::size()) {
    running = at::vec::maximum(running, Vec::loadu(x + i));  // NaN wins, as it does in torch
  }
  float largest = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, running);
  for (int64_t i = vector_end; i < size; ++i) {
    largest = std::isnan(x[i]) || std::isnan(largest) ? std::numeric_limits<float>::quiet_NaN() : std::max(largest, x[i]);
  }
  if (std::isnan(largest)) {
    return std::find_if(x, x + size, [](float value) { return std::isnan(value); }) - x;
  }
  const Vec target(largest);
  for (int64_t i = 0; i < vector_end; i += Vec::size()) {
    const int not_equal = (Vec::loadu(x + i) == target).zero_mask();  // a bit per lane that differs
    const int equal = ~not_equal & ((1 << Vec::size()) - 1);
    if (equal != 0) {
      return i + __builtin_ctz(equal);
    }
  }
  return std::find(x + vector_end, x + size, largest) - x;
}

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "greedy_argmax: logits must be (rows, vocab) float32 with unit-stride rows and vocab >= 1");
  const int64_t rows = logits.size(0), size = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* data = logits.const_data_ptr<float>();
  int64_t* ids = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(size), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      ids[row] = argmax_row(data + row * stride, size);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(graphrt, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("apply_rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("greedy_argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("apply_rotary", &apply_rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("greedy_argmax", &greedy_argmax);
}
