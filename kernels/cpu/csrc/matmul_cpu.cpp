// Matmuls against weights packed once into column panels, for a decode step's skinny shapes
// (1 to 32 rows) and prefill chunks alike. kernels/cpu/linear.py packs the weights (`pack_panels`) and
// calls this file's op as torch.ops.graphrt.panel_linear; `F.linear` on the dense weight is its
// reference (tests/kernels/cpu/test_matmul_cpu.py). A sparse layer's routed experts run in one op,
// `panel_experts` (kernels/cpu/moe.py), bitwise the loop over them (tests/kernels/cpu/test_moe_cpu.py).
//
// Layout: the weight (out_features, in_features) is cut into panels of 16 output columns, one
// AVX-512 register wide. A panel stores its columns interleaved along k, a step at a time:
// (panels, in_features / k_step, 16, k_step), k_step = 2 for bfloat16 (the pair one vdpbf16ps
// multiplies and sums: AVX512-BF16), 1 for float32 (one FMA). So every register load is one
// step of k for 16 columns, and a whole panel is one sequential stream.
//
// A tile is MR rows of x by NR panels: MR * NR accumulators held in registers for all of k, each
// step loading NR panel vectors and broadcasting MR values (pairs) of x. Tiles are 8x2, 4x4, 2x8
// or 1x8 (16 or 8 accumulators of the 32 registers). Up to 15 rows go 8 at a time (each panel
// read once, straight from memory, for all 8), then 4, 2, 1; 16 rows or more go 4 at a time on 4
// panels, which then come from L2 (a chunk of 128 rows at a time keeps x there too).
//
// Arithmetic: float32 accumulators; bfloat16 products of pairs as the instruction computes them
// (as oneDNN's bfloat16 matmul does on these CPUs); the bias is added in float32; the result is
// rounded to the dtype once, to nearest even.
//
// The MLP's gate/up matmul can end in silu_and_mul (`panel_linear_silu_and_mul`): its tiles take
// gate panels and their up partners from the weight's second half together, and each tile's
// products, rounded as above, go through silu_and_mul's own row function (silu_and_mul.h) before
// they are stored, so the (rows, 2 * intermediate) product is never written out and read back, and
// the result is bitwise the two ops'. A prefill chunk spent 4% of its time in that pass.
//
// Threads: at::parallel_for gives each thread an even share of the panels; see
// paged_attention_cpu.cpp on OpenMP. Each output is one thread's sum in one order, so the result
// does not depend on the number of threads or on the other rows.
//
// The bfloat16 code needs a compiler that knows AVX512-BF16 (g++ 10, clang 11); an older one
// builds the file without it, and the op then refuses bfloat16 (kernels/cpu/linear.py checks for that
// before offering the path), so the other kernels in the library still build.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "silu_and_mul.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#if (defined(__clang__) && __clang_major__ >= 11) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10)
#define GRAPHRT_PANEL_BF16 1
#endif
#endif

namespace {

constexpr int64_t kPanel = 16;      // output columns per panel: one register of float32
constexpr int64_t kRowChunk = 128;  // rows of x per pass over a group of panels

#if defined(CPU_CAPABILITY_AVX512)

// How far ahead a bfloat16 tile asks for each of its panels. With one to eight rows the panels come
// from memory, and with the hardware prefetcher alone 8-row tiles waited on it (30 GB/s where one
// row streamed 60); 1 KB ahead brought 8 and 32 rows up to oneDNN's rate or past it on the AMD
// EPYC we measured. (Past a panel's end it asks for the next panel's start: harmless, as a
// prefetch never faults.) float32 tiles, which were already at oneDNN's rate or past it, don't.
constexpr int64_t kPrefetchBytes = 1024;

inline void prefetch_ahead(const void* src) {
  _mm_prefetch(static_cast<const char*>(src) + kPrefetchBytes, _MM_HINT_T0);
}

// Bytes still to be brought into L2 ahead of use: the next group of panels, asked for a cache line
// per step of k by the tiles that read the current group from L2 (see rows_by_panels). Two ranges,
// for the gate/up matmul whose group is gate panels and the up panels that pair with them.
struct L2Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  const char* up_next = nullptr;  // the up panels that pair with the gate panels above
  const char* up_end = nullptr;

  inline void step() {
    if (next < end) {
      _mm_prefetch(next, _MM_HINT_T1);
      next += 64;
    } else if (up_next < up_end) {
      _mm_prefetch(up_next, _MM_HINT_T1);
      up_next += 64;
    }
  }
};

// Where a tile's panel p (of NR) starts, in elements after its first: panels follow each other
// `panel_stride` apart, except that in a gate/up tile (kGateUp) the second half, the up panels, starts
// `up_offset` after the first half's gate panels.
template <int NR, bool kGateUp>
inline int64_t panel_offset(int p, int64_t panel_stride, int64_t up_offset) {
  return kGateUp && p >= NR / 2 ? up_offset + (p - NR / 2) * panel_stride : p * panel_stride;
}

// out[m, p * 16 + c] for m < MR, p < NR panels, c < 16 = sum over k of x[m, k] * w[p][k][c].
// `w` points at the first panel; the others are where panel_offset says.
template <int MR, int NR, bool kGateUp>
void tile_f32(const float* x, int64_t ldx, const float* w, int64_t panel_stride, int64_t up_offset, int64_t k_size,
              const float* bias, float* out, int64_t ldo, L2Prefetch& l2) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NR; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    l2.step();
    __m512 wv[NR];
    for (int p = 0; p < NR; ++p) {
      wv[p] = _mm512_loadu_ps(w + panel_offset<NR, kGateUp>(p, panel_stride, up_offset) + k * kPanel);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      for (int p = 0; p < NR; ++p) acc[m][p] = _mm512_fmadd_ps(xb, wv[p], acc[m][p]);
    }
  }
  for (int p = 0; p < NR; ++p) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + p * kPanel) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * ldo + p * kPanel, _mm512_add_ps(acc[m][p], b));
  }
}

#if defined(GRAPHRT_PANEL_BF16)

__attribute__((target("avx512bf16"))) inline __m512 load_bf16_as_f32(const at::BFloat16* src) {
  // bfloat16 is the high half of a float32: widen each to 32 bits and shift it up.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// As tile_f32, for bfloat16: each step of k is a pair, x's pair broadcast as one 32-bit value.
template <int MR, int NR, bool kGateUp>
__attribute__((target("avx512bf16"))) void tile_bf16(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w,
                                                      int64_t panel_stride, int64_t up_offset, int64_t k_size,
                                                      const at::BFloat16* bias, at::BFloat16* out, int64_t ldo,
                                                      L2Prefetch& l2) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NR; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; k += 2) {
    l2.step();
    __m512bh wv[NR];
    for (int p = 0; p < NR; ++p) {
      const at::BFloat16* src = w + panel_offset<NR, kGateUp>(p, panel_stride, up_offset) + k * kPanel;
      prefetch_ahead(src);
      wv[p] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(src));
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + k, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < NR; ++p) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], xb, wv[p]);
    }
  }
  for (int p = 0; p < NR; ++p) {
    const __m512 b = bias != nullptr ? load_bf16_as_f32(bias + p * kPanel) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][p], b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo + p * kPanel), (__m256i)rounded);
    }
  }
}

bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

#endif  // GRAPHRT_PANEL_BF16

template <typename T, int MR, int NR, bool kGateUp>
inline void tile(const T* x, int64_t ldx, const T* w, int64_t panel_stride, int64_t up_offset, int64_t k_size,
                 const T* bias, T* out, int64_t ldo, L2Prefetch& l2) {
  if constexpr (std::is_same_v<T, float>) {
    tile_f32<MR, NR, kGateUp>(x, ldx, w, panel_stride, up_offset, k_size, bias, out, ldo, l2);
  } else {
#if defined(GRAPHRT_PANEL_BF16)
    tile_bf16<MR, NR, kGateUp>(x, ldx, w, panel_stride, up_offset, k_size, bias, out, ldo, l2);
#endif
  }
}

// MR rows by `num_panels` panels (at most NR) in one tile. A gate/up tile (kGateUp: NR / 2 gate
// panels, then their up partners) computes both halves as the plain matmul would, rounded to T, and
// writes silu(gate) * up, NR / 2 panels wide, as the silu_and_mul op computes it from them.
template <typename T, int MR, int NR, bool kGateUp>
void row_block(const T* x, int64_t ldx, const T* w, int64_t panel_stride, int64_t up_offset, int64_t k_size,
               const T* bias, int64_t num_panels, T* out, int64_t ldo, L2Prefetch& l2) {
  constexpr int kStep = kGateUp ? 2 : 1;  // panels per output panel
  static_assert(NR >= kStep && NR <= 8 && NR % kStep == 0);
  if (num_panels == NR) {
    if constexpr (kGateUp) {
      constexpr int64_t kWidth = NR * kPanel, kHalf = kWidth / 2;
      alignas(64) T both[MR * kWidth];
      tile<T, MR, NR, true>(x, ldx, w, panel_stride, up_offset, k_size, nullptr, both, kWidth, l2);
      for (int m = 0; m < MR; ++m) {
        graphrt_cpu::silu_and_mul_row<T>(both + m * kWidth, both + m * kWidth + kHalf, kHalf, out + m * ldo);
      }
    } else {
      tile<T, MR, NR, false>(x, ldx, w, panel_stride, up_offset, k_size, bias, out, ldo, l2);
    }
  } else if constexpr (NR > kStep) {
    row_block<T, MR, NR - kStep, kGateUp>(x, ldx, w, panel_stride, up_offset, k_size, bias, num_panels, out, ldo, l2);
  }
}

// Rows [0, num_rows) of x against `num_panels` panels (at most 8) starting at `w` (with kGateUp,
// num_panels / 2 gate panels and their up partners). The first row block reads the panels from
// memory; the blocks after it find them in L2 and, as they compute, ask for `next` (the group of
// panels that comes after this one) to be brought into L2 too, so the next group's first block
// does not wait on memory with the FMA units idle.
template <typename T, bool kGateUp>
void rows_by_panels(const T* x, int64_t ldx, int64_t num_rows, const T* w, int64_t panel_stride, int64_t up_offset,
                    int64_t k_size, const T* bias, int64_t num_panels, T* out, int64_t ldo, L2Prefetch next) {
  constexpr int kStep = kGateUp ? 2 : 1;
  int64_t m = 0;
  L2Prefetch none;
  auto run = [&](auto mr, auto nr) {
    constexpr int MR = decltype(mr)::value, NR = decltype(nr)::value;
    L2Prefetch& l2 = m == 0 ? none : next;
    for (int64_t p = 0; p < num_panels; p += NR) {
      const int64_t column = p / kStep * kPanel;  // of the output, whose panel p / kStep this tile starts
      row_block<T, MR, NR, kGateUp>(x + m * ldx, ldx, w + p / kStep * panel_stride, panel_stride, up_offset, k_size,
                                 bias != nullptr ? bias + column : nullptr, std::min<int64_t>(NR, num_panels - p),
                                 out + m * ldo + column, ldo, l2);
    }
  };
  if (num_rows >= 16) {  // panels from L2 after the first tile: 4 loads and 4 broadcasts per 16 products
    for (; m + 4 <= num_rows; m += 4) run(std::integral_constant<int, 4>{}, std::integral_constant<int, 4>{});
  }
  for (; m + 8 <= num_rows; m += 8) run(std::integral_constant<int, 8>{}, std::integral_constant<int, 2>{});
  if (m + 4 <= num_rows) { run(std::integral_constant<int, 4>{}, std::integral_constant<int, 4>{}); m += 4; }
  if (m + 2 <= num_rows) { run(std::integral_constant<int, 2>{}, std::integral_constant<int, 8>{}); m += 2; }
  if (m + 1 <= num_rows) { run(std::integral_constant<int, 1>{}, std::integral_constant<int, 8>{}); m += 1; }
}

// One matmul of x against a weight in panels (with kGateUp: a gate/up weight, ending in
// silu_and_mul), cut into units (a panel; for kGateUp a gate panel with its up partner, the second
// half of the weight: up_offset = half its panels) that threads share.
template <typename T, bool kGateUp>
struct PanelMatmul {
  static constexpr int64_t kStep = kGateUp ? 2 : 1;
  const T* x;
  int64_t ldx, num_rows, k_size;
  const T* w;
  int64_t num_units, panel_stride, up_offset;
  const T* bias;
  T* out;
  int64_t ldo;
  int64_t group;     // units a thread runs together, chunk of rows by chunk of rows
  bool fetch_ahead;  // whether a group and the next fit L2 together

  // x: (rows, in_features); w: (units * kStep, in_features / k_step, 16, k_step); out: (rows, units * 16).
  // A group and the next one, which is brought in while it is used, must both fit L2 (1-2 MB on the
  // CPUs we run on): 8 panels (128 columns) where k is short, down to 4 (one 4x4 tile's panels)
  // where it is long; where even 4 panels are more than a group's share of L2 (k over 1536 in
  // float32), nothing is fetched ahead.
  PanelMatmul(const T* x, int64_t ldx, int64_t num_rows, const at::Tensor& w, const T* bias, T* out, int64_t ldo)
      : x(x), ldx(ldx), num_rows(num_rows), k_size(w.size(1) * w.size(3)), w(w.const_data_ptr<T>()),
        num_units(w.size(0) / kStep), panel_stride(w.stride(0)), up_offset(kGateUp ? num_units * panel_stride : 0),
        bias(bias), out(out), ldo(ldo) {
    constexpr int64_t kGroupBytes = 384 << 10;
    const int64_t unit_bytes = kStep * panel_stride * int64_t(sizeof(T));
    group = std::clamp<int64_t>(kGroupBytes / unit_bytes, 4 / kStep, 8 / kStep);
    fetch_ahead = group * unit_bytes <= kGroupBytes;
  }

  // Threads' grain: units enough for about 64K multiply-adds of 8 rows.
  int64_t grain() const {
    return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, kStep * kPanel * k_size * std::min<int64_t>(num_rows, 8)));
  }

  // Units [begin, end), one thread's share, in groups, chunk of rows by chunk, so shapes of few
  // panels still split evenly.
  void run_units(int64_t begin, int64_t end) const {
    // The group this thread runs after [u0, u0 + group) of rows [r0, r0 + kRowChunk): the next
    // group of its share, or the first one again for the next chunk of rows.
    auto group_after = [&](int64_t r0, int64_t u0) {
      const int64_t next = u0 + group < end ? u0 + group : (r0 + kRowChunk < num_rows ? begin : end);
      if (!fetch_ahead || next == end) {
        return L2Prefetch{};
      }
      const char* start = reinterpret_cast<const char*>(w + next * panel_stride);
      const int64_t bytes = std::min(group, end - next) * panel_stride * int64_t(sizeof(T));
      if (!kGateUp) {
        return L2Prefetch{start, start + bytes};
      }
      const char* up = start + up_offset * int64_t(sizeof(T));
      return L2Prefetch{start, start + bytes, up, up + bytes};
    };
    for (int64_t r0 = 0; r0 < num_rows; r0 += kRowChunk) {
      const int64_t chunk_rows = std::min(kRowChunk, num_rows - r0);
      for (int64_t u0 = begin; u0 < end; u0 += group) {
        rows_by_panels<T, kGateUp>(x + r0 * ldx, ldx, chunk_rows, w + u0 * panel_stride, panel_stride, up_offset,
                                k_size, bias != nullptr ? bias + u0 * kPanel : nullptr,
                                kStep * std::min(group, end - u0), out + r0 * ldo + u0 * kPanel, ldo,
                                group_after(r0, u0));
      }
    }
  }
};

// A thread takes an even share of the weight's units (PanelMatmul::run_units).
template <typename T, bool kGateUp>
void panel_linear_impl(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias, at::Tensor& out) {
  const PanelMatmul<T, kGateUp> matmul(x.const_data_ptr<T>(), x.stride(0), x.size(0), w,
                                       bias != nullptr ? bias->const_data_ptr<T>() : nullptr,
                                       out.mutable_data_ptr<T>(), out.stride(0));
  at::parallel_for(0, matmul.num_units, matmul.grain(), [&](int64_t begin, int64_t end) { matmul.run_units(begin, end); });
}

// Several matmuls, one after the other, as one range of units that threads share evenly: a
// thread's share may end inside one matmul and go on into the next. Every output is computed as
// the matmul alone computes it (run_units on its own units), so the result is bitwise the same.
template <typename T, bool kGateUp>
void run_matmuls(const std::vector<PanelMatmul<T, kGateUp>>& matmuls) {
  std::vector<int64_t> first_unit{0};  // matmul i's units are [first_unit[i], first_unit[i + 1])
  int64_t grain = 1;
  for (const auto& matmul : matmuls) {
    first_unit.push_back(first_unit.back() + matmul.num_units);
    grain = std::max(grain, matmul.grain());
  }
  at::parallel_for(0, first_unit.back(), grain, [&](int64_t begin, int64_t end) {
    auto i = std::upper_bound(first_unit.begin(), first_unit.end(), begin) - first_unit.begin() - 1;
    for (; begin < end; ++i) {
      const int64_t stop = std::min(end, first_unit[i + 1]);
      matmuls[i].run_units(begin - first_unit[i], stop - first_unit[i]);
      begin = stop;
    }
  });
}

// A sparse layer's experts on their rows (see panel_experts): every expert's gate/up matmul in one
// range of units, then every expert's down matmul in another.
template <typename T>
void panel_experts_impl(const at::Tensor& rows, at::IntArrayRef counts, at::TensorList gate_up, at::TensorList down,
                        at::Tensor& mid, at::Tensor& out) {
  const int64_t hidden = rows.size(1), inter = mid.size(1);
  std::vector<PanelMatmul<T, true>> gate_ups;
  std::vector<PanelMatmul<T, false>> downs;
  int64_t start = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] == 0) {
      continue;  // no row chose it: its weights are never read
    }
    T* expert_mid = mid.mutable_data_ptr<T>() + start * inter;
    gate_ups.emplace_back(rows.const_data_ptr<T>() + start * hidden, hidden, counts[e], gate_up[e], nullptr, expert_mid, inter);
    downs.emplace_back(expert_mid, inter, counts[e], down[e], nullptr, out.mutable_data_ptr<T>() + start * hidden, hidden);
    start += counts[e];
  }
  run_matmuls(gate_ups);
  run_matmuls(downs);
}

#endif  // CPU_CAPABILITY_AVX512

// x: (rows, in_features) with unit-stride rows; w: (out_features / 16, in_features / k_step, 16,
// k_step) as kernels/cpu/linear.py packs it; bias: (out_features,) or None. Returns (rows, out_features),
// or with kGateUp (the gate/up weight, gate first, no bias) (rows, out_features / 2): silu(gate) * up.
template <bool kGateUp>
at::Tensor panel_matmul(const char* op, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be (rows, in_features) with unit-stride rows");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == kPanel && w.is_contiguous(),
              op, ": the weight must be packed by graphrt.kernels.cpu.linear.pack_panels "
              "(panels, in_features / k_step, 16, k_step), contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), op, ": x is ", x.scalar_type(), " but the weight is ",
              w.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              op, ": float32 and bfloat16 only, not ", x.scalar_type());
  const int64_t k_step = x.scalar_type() == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(w.size(3) == k_step && w.size(1) * k_step == x.size(1), op, ": x has ", x.size(1),
              " features but the weight was packed for ", w.size(1) * w.size(3));
  const int64_t out_features = w.size(0) * kPanel;
  TORCH_CHECK(!kGateUp || w.size(0) % 2 == 0, op, ": the gate/up weight must have as many up columns as gate columns, ",
              "each half whole panels of 16; got ", out_features, " columns");
  TORCH_CHECK(!kGateUp || !bias.has_value(), op, ": takes no bias");  // the tiles would add the wrong columns
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                op, ": bias must be a contiguous (", out_features, ",) tensor of x's dtype");
  }
  at::Tensor out = at::empty({x.size(0), kGateUp ? out_features / 2 : out_features}, x.options());
  const at::Tensor* bias_or_null = bias.has_value() ? &*bias : nullptr;
#if defined(CPU_CAPABILITY_AVX512)
  if (x.scalar_type() == at::kBFloat16) {
#if defined(GRAPHRT_PANEL_BF16)
    TORCH_CHECK(cpu_has_avx512_bf16(), op, ": bfloat16 needs a CPU with AVX512-BF16; use F.linear");
    panel_linear_impl<at::BFloat16, kGateUp>(x, w, bias_or_null, out);
#else
    TORCH_CHECK(false, op, ": built by a compiler without AVX512-BF16 support (g++ 10 or clang 11 "
                "have it), so no bfloat16; use F.linear");
#endif
  } else {
    panel_linear_impl<float, kGateUp>(x, w, bias_or_null, out);
  }
#else
  TORCH_CHECK(false, op, ": built without AVX-512 (torch's CPU capability here is AVX2); use F.linear");
#endif
  return out;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return panel_matmul<false>("panel_linear", x, w, bias);
}

// silu_and_mul(panel_linear(x, w)) in one pass, bitwise: each tile ends in silu_and_mul's own row
// function (silu_and_mul.h), so the (rows, 2 * size) product is never written out and read back.
at::Tensor panel_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& w) {
  return panel_matmul<true>("panel_linear_silu_and_mul", x, w, std::nullopt);
}

// A sparse layer's routed experts, every weight in panels (kernels/cpu/moe.py fused_moe_by_expert):
// rows (num_run, hidden) grouped by expert, counts[e] of them for expert e, whose gate/up weight
// (gate first, each half whole panels) is gate_up[e] and whose down weight is down[e]. Returns
// (num_run, hidden): each row's down(silu(gate) * up) of its expert, bitwise what
// panel_linear_silu_and_mul and then panel_linear give expert by expert, in two parallel regions
// in all instead of two per expert, and with no call from Python per expert.
at::Tensor panel_experts(const at::Tensor& rows, at::IntArrayRef counts, at::TensorList gate_up, at::TensorList down) {
  const char* op = "panel_experts";
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous(), op, ": rows must be a contiguous (rows, hidden) tensor");
  TORCH_CHECK(rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16,
              op, ": float32 and bfloat16 only, not ", rows.scalar_type());
  TORCH_CHECK(gate_up.size() == counts.size() && down.size() == counts.size(), op, ": ", counts.size(),
              " counts but ", gate_up.size(), " gate/up and ", down.size(), " down weights; one of each per expert");
  const int64_t k_step = rows.scalar_type() == at::kBFloat16 ? 2 : 1, hidden = rows.size(1);
  int64_t num_run = 0, inter = -1;
  for (size_t e = 0; e < counts.size(); ++e) {
    TORCH_CHECK(counts[e] >= 0, op, ": expert ", e, " has a negative count");
    num_run += counts[e];
    const at::Tensor& w1 = gate_up[e];
    const at::Tensor& w2 = down[e];
    for (const at::Tensor* w : {&w1, &w2}) {
      TORCH_CHECK(w->dim() == 4 && w->size(2) == kPanel && w->size(3) == k_step && w->is_contiguous() &&
                      w->scalar_type() == rows.scalar_type(),
                  op, ": expert ", e, "'s weights must be packed by graphrt.kernels.cpu.linear.pack_panels, ",
                  "contiguous, in the rows' dtype");
    }
    TORCH_CHECK(w1.size(1) * k_step == hidden && w1.size(0) % 2 == 0, op, ": expert ", e, "'s gate/up weight must take ",
                hidden, " features and have two halves of whole panels");
    const int64_t expert_inter = w1.size(0) / 2 * kPanel;
    TORCH_CHECK(inter < 0 || expert_inter == inter, op, ": the experts' intermediate sizes differ");
    inter = expert_inter;
    TORCH_CHECK(w2.size(1) * k_step == inter && w2.size(0) * kPanel == hidden, op, ": expert ", e,
                "'s down weight must take ", inter, " features to ", hidden);
  }
  TORCH_CHECK(num_run == rows.size(0), op, ": the counts sum to ", num_run, " but there are ", rows.size(0), " rows");
  at::Tensor out = at::empty({num_run, hidden}, rows.options());
  if (num_run == 0) {
    return out;
  }
  at::Tensor mid = at::empty({num_run, inter}, rows.options());
#if defined(CPU_CAPABILITY_AVX512)
  if (rows.scalar_type() == at::kBFloat16) {
#if defined(GRAPHRT_PANEL_BF16)
    TORCH_CHECK(cpu_has_avx512_bf16(), op, ": bfloat16 needs a CPU with AVX512-BF16");
    panel_experts_impl<at::BFloat16>(rows, counts, gate_up, down, mid, out);
#else
    TORCH_CHECK(false, op, ": built by a compiler without AVX512-BF16 support, so no bfloat16");
#endif
  } else {
    panel_experts_impl<float>(rows, counts, gate_up, down, mid, out);
  }
#else
  TORCH_CHECK(false, op, ": built without AVX-512 (torch's CPU capability here is AVX2)");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(graphrt, m) {
  m.def("panel_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("panel_linear_silu_and_mul(Tensor x, Tensor w) -> Tensor");
  m.def("panel_experts(Tensor rows, int[] counts, Tensor[] gate_up, Tensor[] down) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_linear_silu_and_mul", &panel_linear_silu_and_mul);
  m.impl("panel_experts", &panel_experts);
}
