// silu(gate) * up over one row, shared by the silu_and_mul op (elementwise_cpu.cpp) and the
// gate/up matmul that ends in it (matmul_cpu.cpp), so the two round alike: the fused matmul's
// output is bitwise the matmul's followed by the op.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace graphrt_cpu {

// One row of silu(gate) * up, each step rounded to the dtype as F.silu(gate) * up is.
template <typename scalar_t>
inline void silu_and_mul_row(const scalar_t* gate, const scalar_t* up, int64_t size, scalar_t* out) {
  using Vec = at::vec::Vectorized<scalar_t>;
  constexpr int64_t kStep = Vec::size();
  for (int64_t i = 0; i < size; i += kStep) {
    const int64_t count = std::min(kStep, size - i);
    Vec silu;
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
      const Vec g = Vec::loadu(gate + i, count);
      silu = g / (Vec(1) + g.neg().exp());
    } else {  // torch's silu kernel for reduced floats: in float, then rounded
      auto [low, high] = at::vec::convert_to_float<scalar_t>(Vec::loadu(gate + i, count));
      const at::vec::Vectorized<float> one(1);
      silu = at::vec::convert_from_float<scalar_t>(low / (one + low.neg().exp()), high / (one + high.neg().exp()));
    }
    (silu * Vec::loadu(up + i, count)).store(out + i, count);
  }
}

}  // namespace graphrt_cpu
