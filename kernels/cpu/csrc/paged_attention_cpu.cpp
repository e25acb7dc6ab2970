// Paged decode attention on the CPU: a compiled twin of the torch reference
// `paged_decode_attention` in kernels/paged_attention.py, which tests/kernels/cpu/test_paged_attention_cpu.py
// compares it with. kernels/cpu/paged_attention.py builds this file and calls it as
// torch.ops.graphrt.paged_decode_attention. The prefill attention and the KV cache writes follow
// in their own sections below.
//
// One task is one sequence with all its KV heads (one KV head where the batch is too short to
// spread otherwise) and serves every query head of those GQA groups, so each K/V row is read once,
// straight from the cache through the block table: the reference gathers the blocks into a new
// tensor first, copying every K/V byte once more. A task scores the whole context into scratch
// rows, takes the softmax, then sums V weighted by it: two passes, K token row by token row across
// the task's heads, V block by block. Arithmetic is in float (double for float64 inputs), as in
// the reference.
//
// Vector code is ATen's Vectorized<T>, the type torch's own CPU kernels and inductor's generated
// C++ use, rather than intrinsics: one source for AVX2 and AVX-512, a vector exp (exp_u20, as in
// torch's CPU flash attention) and bfloat16 loads come with it. The build defines the
// CPU_CAPABILITY_* macro of the capability torch picked for its own kernels (AVX512 or AVX2, with
// the matching -m flags; the loader refuses other CPUs, where ATen's scalar fallback measured
// 10-20x slower). The one intrinsic function, sum_lanes_of_rows, is AVX-512 with a fallback.
//
// Threads: torch's intra-op pool (torch.set_num_threads), whose threads take tasks from a shared
// counter inside one at::parallel_for (the prefill section's tasks likewise). With
// torch's OpenMP backend, parallel_for is an inline `#pragma omp parallel` (ATen/ParallelOpenMP.h),
// so the build passes -fopenmp to the compiler (without it the pragma is dropped and everything
// runs on one thread) but not to the linker: the GOMP_* calls stay undefined in this library and
// resolve, at load, to the OpenMP runtime libtorch_cpu already loaded (torch/lib/libgomp.so.1),
// so the process never holds a second OpenMP runtime with its own threads.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using at::vec::Vectorized;

// The type a task computes in: float for float32 and bfloat16 inputs, double for float64.
template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// `Vectorized<Acc>::size()` elements from `src`, widened to Acc (bfloat16 -> float on load).
template <typename Acc, typename scalar_t>
inline Vectorized<Acc> load_as(const scalar_t* src) {
  if constexpr (std::is_same_v<scalar_t, Acc>) {
    return Vectorized<Acc>::loadu(src);
  } else {
    Vectorized<float> out;
    at::vec::load_to_float(src, out);
    return out;
  }
}

template <typename Acc>
inline Acc sum_lanes(const Vectorized<Acc>& v) {
  return at::vec::vec_reduce_all<Acc>([](Vectorized<Acc>& a, Vectorized<Acc>& b) { return a + b; }, v);
}

template <typename Acc>
inline Acc max_lanes(const Vectorized<Acc>& v) {
  return at::vec::vec_reduce_all<Acc>(
      [](Vectorized<Acc>& a, Vectorized<Acc>& b) { return at::vec::maximum(a, b); }, v);
}

// sums[r] = the sum of acc[r]'s lanes, for kRows <= 4 vectors. The score pass needs one such sum
// per token and query head, and one at a time they were half its time in bfloat16; with AVX-512
// one shuffle tree halves four vectors together (14 instructions where four sums take 32).
template <int kRows, typename Acc>
inline void sum_lanes_of_rows(const Vectorized<Acc> (&acc)[kRows], Acc* sums) {
  static_assert(kRows >= 1 && kRows <= 4);
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<Acc, float> && kRows > 1) {
    __m512 v[4];
    for (int r = 0; r < 4; ++r) {
      v[r] = r < kRows ? __m512(acc[r]) : _mm512_setzero_ps();
    }
    // 128-bit lanes: [a0+a2, a1+a3, b0+b2, b1+b3] and the same for c, d.
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(3, 2, 3, 2)));
    // One 128-bit lane per row: four partial sums of a, of b, of c, of d.
    __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));  // every float: its lane's sum
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, x);
    for (int r = 0; r < kRows; ++r) {
      sums[r] = lanes[4 * r];
    }
    return;
  }
#endif
  for (int r = 0; r < kRows; ++r) {
    sums[r] = sum_lanes(acc[r]);
  }
}

// Where a task's data lives, in elements. K and V caches share one layout with a unit-stride
// head_dim; block_tables rows are `table_stride` apart, unit stride within a row.
struct Layout {
  int64_t group_size, head_dim, block_size;
  int64_t q_batch_stride, q_head_stride;
  int64_t cache_block_stride, cache_token_stride, cache_head_stride;
  int64_t table_stride;
};

// One task's context: the first `length` tokens of one sequence, `num_kv_heads` consecutive KV
// heads of each (all of them where the batch gives every thread several sequences, one otherwise).
struct Context {
  const int64_t* block_ids;  // the sequence's block table row
  int64_t length;
  int64_t head_offset;  // elements from the start of a cache row (one token) to the first KV head
  int64_t num_kv_heads;
};

// Calls visit(rows, start, tokens, next_rows) for each block of the context in order: `rows`
// points at the block's first token (at the context's first KV head, rows `cache_token_stride`
// apart), `tokens` of them from context position `start`; `next_rows` the same for the next
// block, or nullptr. Blocks are scattered through the cache, so the hardware prefetcher, which
// extrapolates addresses, can't find the next one: visitors prefetch it themselves.
template <typename scalar_t, typename Visit>
inline void for_each_block(const scalar_t* cache, const Context& context, const Layout& layout, Visit&& visit) {
  const int64_t num_blocks = (context.length + layout.block_size - 1) / layout.block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const scalar_t* rows = cache + context.block_ids[b] * layout.cache_block_stride + context.head_offset;
    const scalar_t* next_rows = b + 1 < num_blocks
                                    ? cache + context.block_ids[b + 1] * layout.cache_block_stride + context.head_offset
                                    : nullptr;
    const int64_t start = b * layout.block_size;
    visit(rows, start, std::min(layout.block_size, context.length - start), next_rows);
  }
}

// Prefetches the cache lines holding elements [first, first + count) of `row` (a no-op for nullptr).
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t first, int64_t count) {
  constexpr int64_t kCacheLine = 64;
  if (row == nullptr) {
    return;
  }
  const uintptr_t begin = reinterpret_cast<uintptr_t>(row + first) & ~static_cast<uintptr_t>(kCacheLine - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(row + first + count);
  for (uintptr_t line = begin; line < end; line += kCacheLine) {
    __builtin_prefetch(reinterpret_cast<const void*>(line));
  }
}

// Query heads are taken kMaxRows at a time, and V's head_dim kValueChunks vectors at a time, so
// that a tile's accumulators stay in registers (4 x 4 of the 32 zmm registers with AVX-512,
// 4 x 2 of the 16 ymm ones otherwise). A GQA group wider than kMaxRows reads its K/V once per
// tile; the second time it comes from L1.
constexpr int64_t kMaxRows = 4;
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kValueChunks = 4;
#else
constexpr int kValueChunks = 2;
#endif

// Calls f(std::integral_constant<int, rows>{}) for rows in 1..kMaxRows, so f can size register
// tiles by it.
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// scores[r * score_stride] = queries[r] . key for kRows query heads and one key (head_dim,): the
// key is loaded (and widened) once for all kRows heads. queries: (kRows, head_dim), already scaled.
template <int kRows, typename scalar_t, typename Acc>
inline void score_key(const Acc* queries, const scalar_t* key, int64_t head_dim, Acc* scores, int64_t score_stride) {
  using Vec = Vectorized<Acc>;
  const int64_t vector_end = head_dim - head_dim % Vec::size();
  Vec acc[kRows];
  for (int r = 0; r < kRows; ++r) {
    acc[r] = Vec(Acc(0));
  }
  for (int64_t d = 0; d < vector_end; d += Vec::size()) {
    const Vec k = load_as<Acc>(key + d);
    for (int r = 0; r < kRows; ++r) {
      acc[r] = at::vec::fmadd(Vec::loadu(queries + r * head_dim + d), k, acc[r]);
    }
  }
  Acc sums[kRows];
  sum_lanes_of_rows<kRows>(acc, sums);
  for (int r = 0; r < kRows; ++r) {
    for (int64_t d = vector_end; d < head_dim; ++d) {
      sums[r] += queries[r * head_dim + d] * static_cast<Acc>(key[d]);
    }
    scores[r * score_stride] = sums[r];
  }
}

// scores[(h * group + g) * score_stride + t] = query (h, g) . key_t of KV head h, for every query
// head of the context's KV heads and every token t. Token by token, each token's keys of all the
// task's heads are read at once: one contiguous run of the cache row, so a sequence whose blocks
// follow each other in the cache is one stream the hardware prefetcher follows; the next block is
// prefetched a token row at a time besides. queries: (heads x group, head_dim), already scaled.
template <typename scalar_t, typename Acc>
void score_context(const Acc* queries, const scalar_t* k_cache, const Context& context, const Layout& layout,
                   Acc* scores, int64_t score_stride) {
  const int64_t group_size = layout.group_size, head_dim = layout.head_dim;
  const int64_t row_span = (context.num_kv_heads - 1) * layout.cache_head_stride + head_dim;
  for_each_block(k_cache, context, layout, [&](const scalar_t* rows, int64_t start, int64_t tokens, const scalar_t* next_rows) {
    for (int64_t i = 0; i < tokens; ++i) {
      prefetch_row(next_rows == nullptr ? nullptr : next_rows + i * layout.cache_token_stride, 0, row_span);
      const scalar_t* row = rows + i * layout.cache_token_stride;
      for (int64_t h = 0; h < context.num_kv_heads; ++h) {
        for (int64_t g = 0; g < group_size; g += kMaxRows) {
          const int64_t query = h * group_size + g;
          with_rows(std::min(kMaxRows, group_size - g), [&](auto r) {
            score_key<r.value>(queries + query * head_dim, row + h * layout.cache_head_stride, head_dim,
                               scores + query * score_stride + start + i, score_stride);
          });
        }
      }
    }
  });
}

// outputs[r, first : first + kChunks vectors] += the sum over one block's `tokens` tokens t of
// weights[r * weight_stride + t] * value_t, for kRows query heads: values (tokens, head_dim) rows
// `token_stride` apart; the same slice of next_values (the next block's) is prefetched meanwhile.
// The accumulators live in registers for the block and in `outputs` (L1) between blocks.
template <int kRows, int kChunks, typename scalar_t, typename Acc>
inline void sum_value_block(const Acc* weights, int64_t weight_stride, const scalar_t* values, int64_t tokens,
                            int64_t token_stride, const scalar_t* next_values, int64_t first, int64_t head_dim,
                            Acc* outputs) {
  using Vec = Vectorized<Acc>;
  Vec acc[kRows][kChunks];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kChunks; ++c) {
      acc[r][c] = Vec::loadu(outputs + r * head_dim + first + c * Vec::size());
    }
  }
  for (int64_t t = 0; t < tokens; ++t) {
    prefetch_row(next_values == nullptr ? nullptr : next_values + t * token_stride, first, kChunks * Vec::size());
    const scalar_t* value = values + t * token_stride;
    Vec v[kChunks];
    for (int c = 0; c < kChunks; ++c) {
      v[c] = load_as<Acc>(value + first + c * Vec::size());
    }
    for (int r = 0; r < kRows; ++r) {
      const Vec weight(weights[r * weight_stride + t]);
      for (int c = 0; c < kChunks; ++c) {
        acc[r][c] = at::vec::fmadd(weight, v[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kChunks; ++c) {
      acc[r][c].store(outputs + r * head_dim + first + c * Vec::size());
    }
  }
}

// outputs[r] += the sum over one block's tokens t of weights[r * weight_stride + t] * value_t for
// kRows query heads, all of head_dim: kValueChunks vectors at a time, then single vectors, then the
// dims that are not a whole vector one at a time. outputs: (kRows, head_dim).
template <int kRows, typename scalar_t, typename Acc>
void sum_values_of_block(const Acc* weights, int64_t weight_stride, const scalar_t* values, int64_t tokens,
                         int64_t token_stride, const scalar_t* next_values, int64_t head_dim, Acc* outputs) {
  using Vec = Vectorized<Acc>;
  const int64_t vector_end = head_dim - head_dim % Vec::size();
  int64_t first = 0;
  for (; first + kValueChunks * Vec::size() <= vector_end; first += kValueChunks * Vec::size()) {
    sum_value_block<kRows, kValueChunks>(weights, weight_stride, values, tokens, token_stride, next_values, first,
                                         head_dim, outputs);
  }
  for (; first < vector_end; first += Vec::size()) {
    sum_value_block<kRows, 1>(weights, weight_stride, values, tokens, token_stride, next_values, first, head_dim,
                              outputs);
  }
  if (vector_end == head_dim) {
    return;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    prefetch_row(next_values == nullptr ? nullptr : next_values + t * token_stride, vector_end, head_dim - vector_end);
    for (int r = 0; r < kRows; ++r) {
      for (int64_t d = vector_end; d < head_dim; ++d) {
        outputs[r * head_dim + d] += weights[r * weight_stride + t] * static_cast<Acc>(values[t * token_stride + d]);
      }
    }
  }
}

// outputs[(h * group + g)] = the sum over the context's tokens t of weights[(h * group + g) *
// weight_stride + t] * value_t of KV head h. Block by block, and within a block head by head: the
// block's rows of all the task's heads are one contiguous run of the cache. outputs: (heads x
// group, head_dim), zeroed here.
template <typename scalar_t, typename Acc>
void sum_values(const Acc* weights, int64_t weight_stride, const scalar_t* v_cache, const Context& context,
                const Layout& layout, Acc* outputs) {
  const int64_t group_size = layout.group_size, head_dim = layout.head_dim;
  std::fill(outputs, outputs + context.num_kv_heads * group_size * head_dim, Acc(0));
  for_each_block(v_cache, context, layout, [&](const scalar_t* rows, int64_t start, int64_t tokens, const scalar_t* next_rows) {
    for (int64_t h = 0; h < context.num_kv_heads; ++h) {
      const scalar_t* values = rows + h * layout.cache_head_stride;
      const scalar_t* next_values = next_rows == nullptr ? nullptr : next_rows + h * layout.cache_head_stride;
      for (int64_t g = 0; g < group_size; g += kMaxRows) {
        const int64_t query = h * group_size + g;
        with_rows(std::min(kMaxRows, group_size - g), [&](auto r) {
          sum_values_of_block<r.value>(weights + query * weight_stride + start, weight_stride, values, tokens,
                                       layout.cache_token_stride, g == 0 ? next_values : nullptr, head_dim,
                                       outputs + query * head_dim);
        });
      }
    }
  });
}

// Softmax in place over one row of scores, padded with -inf to whole vectors (exp takes those to
// 0); returns the sum of the weights, which the caller divides by at the end.
template <typename Acc>
inline Acc softmax_unnormalized(Acc* row, int64_t padded_length) {
  using Vec = Vectorized<Acc>;
  Vec running_max(-std::numeric_limits<Acc>::infinity());
  for (int64_t t = 0; t < padded_length; t += Vec::size()) {
    running_max = at::vec::maximum(running_max, Vec::loadu(row + t));
  }
  const Vec row_max(max_lanes(running_max));  // finite: every row has at least one real score
  Vec running_sum(Acc(0));
  for (int64_t t = 0; t < padded_length; t += Vec::size()) {
    const Vec weight = (Vec::loadu(row + t) - row_max).exp_u20();
    weight.store(row + t);
    running_sum = running_sum + weight;
  }
  return sum_lanes(running_sum);
}

// One thread's working memory, sized for the longest context in the batch and the most query
// heads a task takes, and reused across that thread's tasks.
template <typename Acc>
struct Scratch {
  int64_t score_stride;      // the longest context padded to whole vectors
  std::vector<Acc> queries;  // (query heads, head_dim), scaled
  std::vector<Acc> scores;   // (query heads, score_stride): scores, then softmax weights
  std::vector<Acc> outputs;  // (query heads, head_dim): the unnormalized weighted sums of V
  std::vector<Acc> weight_sums;  // (query heads,)

  Scratch(int64_t num_query_heads, int64_t head_dim, int64_t max_context)
      : score_stride(round_up(max_context, Vectorized<Acc>::size())),
        queries(num_query_heads * head_dim),
        scores(num_query_heads * score_stride),
        outputs(num_query_heads * head_dim),
        weight_sums(num_query_heads) {}

  static int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }
};

// Attention of one sequence's query heads of the context's KV heads over its context: two passes,
// K for the scores, then the softmax, then V weighted by it.
// q_heads: (heads x group, head_dim), rows `q_head_stride` apart; out_heads: the same, contiguous.
template <typename scalar_t>
void attend(const scalar_t* q_heads, const scalar_t* k_cache, const scalar_t* v_cache, const Context& context,
            acc_type<scalar_t> scale, const Layout& layout, Scratch<acc_type<scalar_t>>& scratch, scalar_t* out_heads) {
  using Acc = acc_type<scalar_t>;
  const int64_t num_query_heads = context.num_kv_heads * layout.group_size, head_dim = layout.head_dim;
  const int64_t score_stride = scratch.score_stride;
  const int64_t padded_length = Scratch<Acc>::round_up(context.length, Vectorized<Acc>::size());
  Acc* queries = scratch.queries.data();
  Acc* scores = scratch.scores.data();
  Acc* outputs = scratch.outputs.data();

  for (int64_t i = 0; i < num_query_heads; ++i) {
    for (int64_t d = 0; d < head_dim; ++d) {
      queries[i * head_dim + d] = static_cast<Acc>(q_heads[i * layout.q_head_stride + d]) * scale;
    }
    std::fill(scores + i * score_stride + context.length, scores + i * score_stride + padded_length,
              -std::numeric_limits<Acc>::infinity());
  }
  score_context(queries, k_cache, context, layout, scores, score_stride);
  for (int64_t i = 0; i < num_query_heads; ++i) {
    scratch.weight_sums[i] = softmax_unnormalized(scores + i * score_stride, padded_length);
  }
  sum_values(scores, score_stride, v_cache, context, layout, outputs);
  for (int64_t i = 0; i < num_query_heads; ++i) {
    const Acc inverse_sum = Acc(1) / scratch.weight_sums[i];
    for (int64_t d = 0; d < head_dim; ++d) {
      out_heads[i * head_dim + d] = static_cast<scalar_t>(outputs[i * head_dim + d] * inverse_sum);
    }
  }
}

// Checks that q and the caches are what `op`'s kernel reads: q (tokens, heads, head_dim), the
// caches (num_blocks, block_size, kv_heads, head_dim) of one shape, layout and dtype with q,
// unit-stride head_dim, and heads a multiple of kv_heads.
void check_q_and_caches(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), op,
              ": q must be (tokens, heads, head_dim) and the caches (num_blocks, block_size, kv_heads, head_dim), "
              "both of one shape");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), op,
              ": q and the caches must have one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && k_cache.strides() == v_cache.strides(), op,
              ": needs unit-stride head_dim and k, v caches of one layout");
  const int64_t num_heads = q.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == q.size(2) && num_kv_heads > 0 && num_heads % num_kv_heads == 0, op,
              ": head_dim differs between q and the caches, or heads (", num_heads, ") is not a multiple of kv_heads (",
              num_kv_heads, ")");
}

// Checks that row `row` of the block table names only blocks that exist for its first `context`
// tokens (so a bad row raises instead of reading outside the cache).
void check_block_ids(const char* op, const at::Tensor& block_tables, int64_t row, int64_t context, int64_t block_size,
                     int64_t num_blocks) {
  const int64_t* ids = block_tables.data_ptr<int64_t>() + row * block_tables.stride(0);
  for (int64_t b = 0; b < (context + block_size - 1) / block_size; ++b) {
    TORCH_CHECK(ids[b] >= 0 && ids[b] < num_blocks, op, ": block_tables[", row, ", ", b, "] is ", ids[b],
                ", not a block of the ", num_blocks, "-block cache");
  }
}

// Checks what the Python wrapper can't see without reading every row: each context fits its
// block table and names only blocks that exist. Returns the longest context.
int64_t check_rows(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                   int64_t num_blocks) {
  const int64_t batch = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t row = 0; row < batch; ++row) {
    const int64_t context = lens[row];
    TORCH_CHECK(context >= 1 && context <= max_blocks * block_size, "paged_decode_attention: seq_lens[", row,
                "] is ", context, "; it must be between 1 and the block table's ", max_blocks, " blocks x ",
                block_size, " tokens");
    check_block_ids("paged_decode_attention", block_tables, row, context, block_size, num_blocks);
    longest = std::max(longest, context);
  }
  return longest;
}

// q: (batch, heads, head_dim); k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim);
// block_tables: (batch, max_blocks) int; seq_lens: (batch,) int. Returns (batch, heads, head_dim).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in, double scale) {
  check_q_and_caches("paged_decode_attention", q, k_cache, v_cache);
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(block_tables_in.dim() == 2 && block_tables_in.size(0) == batch && seq_lens_in.dim() == 1 &&
                  seq_lens_in.size(0) == batch,
              "paged_decode_attention: block_tables must be (batch, max_blocks) and seq_lens (batch,)");
  // The engine hands int64 tables and lengths, for which these are no-ops.
  const at::Tensor block_tables = block_tables_in.to(at::kLong);
  const at::Tensor seq_lens = seq_lens_in.to(at::kLong).contiguous();
  TORCH_CHECK(block_tables.stride(1) == 1, "paged_decode_attention: block_tables rows must be unit-stride");

  const int64_t max_context = check_rows(block_tables, seq_lens, block_size, num_blocks);
  const Layout layout{num_heads / num_kv_heads, head_dim,          block_size,        q.stride(0),
                      q.stride(1),              k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                      block_tables.stride(0)};
  at::Tensor out = at::empty({batch, num_heads, head_dim}, q.options());  // (batch, heads, head_dim)
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();

  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    using Acc = acc_type<scalar_t>;
    const scalar_t* q_data = q.const_data_ptr<scalar_t>();
    const scalar_t* k_data = k_cache.const_data_ptr<scalar_t>();
    const scalar_t* v_data = v_cache.const_data_ptr<scalar_t>();
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    // A task is one sequence with all its KV heads where the batch gives each thread at least
    // kTasksPerThread of them (a block's rows of all the heads, one run of the cache, are then
    // fetched together), else one (sequence, KV head), so that a short batch still spreads over
    // the threads. Either way a
    // query head's arithmetic is the same, so results don't depend on the split. Tasks differ in
    // context length: each thread takes the next from a shared counter.
    // A task's scores stay within kScoreBytes (L2), so very long contexts go per KV head.
    constexpr int64_t kTasksPerThread = 8, kScoreBytes = 512 << 10;
    const int64_t num_threads = at::get_num_threads();
    const int64_t all_scores_bytes = num_heads * Scratch<Acc>::round_up(max_context, Vectorized<Acc>::size()) *
                                     static_cast<int64_t>(sizeof(Acc));
    const int64_t heads_per_task =
        batch >= kTasksPerThread * num_threads && all_scores_bytes <= kScoreBytes ? num_kv_heads : 1;
    const int64_t tasks_per_row = num_kv_heads / heads_per_task, num_tasks = batch * tasks_per_row;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min(num_threads, num_tasks), 1, [&](int64_t, int64_t) {
      Scratch<Acc> scratch(heads_per_task * layout.group_size, head_dim, max_context);
      for (int64_t task = next++; task < num_tasks; task = next++) {
        const int64_t row = task / tasks_per_row, first_kv_head = task % tasks_per_row * heads_per_task;
        const int64_t first_head = first_kv_head * layout.group_size;
        const Context context{tables + row * layout.table_stride, lens[row], first_kv_head * layout.cache_head_stride,
                              heads_per_task};
        attend<scalar_t>(q_data + row * layout.q_batch_stride + first_head * layout.q_head_stride, k_data, v_data,
                         context, static_cast<Acc>(scale), layout, scratch,
                         out_data + (row * num_heads + first_head) * head_dim);
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Prefill: causal attention of prompt chunks over their paged context, the compiled twin of the
// per-sequence part of the reference `paged_prefill_attention` (there one
// F.scaled_dot_product_attention call per sequence, after gathering its context out of the cache);
// called as torch.ops.graphrt.paged_prefill_attention by kernels/cpu/paged_attention.py.
//
// One task is a block of up to kQueryBlock query tokens of one sequence and one KV head, with
// every query head of that GQA group: kQueryBlock x group rows share each K/V row read. A task
// scores its rows against the context up to its last query's position, takes each row's softmax
// over the tokens that row may see (its own position and before), then sums V weighted by it.
// Scores are a small matrix product: a tile of Vec::size() keys is transposed into scratch
// (head_dim x tile, widened), and each row's scores for the whole tile come from head_dim FMAs of
// its query values broadcast, with no sum across a vector (the decode path's cost per score, which
// one query per sequence leaves nothing to amortize a transpose over).

constexpr int64_t kQueryBlock = 16;  // query tokens per task
constexpr int kScoreRows = 8;        // rows scored against a tile of keys at once (independent FMA chains)

// A task: queries [first_query, first_query + num_queries) of sequence `row`, whose first query
// token is q token `q_offset` and whose first chunk position is `first_position` (context before it).
struct PrefillTask {
  int64_t row, kv_head, q_offset, first_query, num_queries, first_position;
};

template <typename Acc>
struct PrefillScratch {
  int64_t score_stride;      // the longest context of any task, padded to whole vectors
  std::vector<Acc> queries;  // (rows, head_dim), scaled
  std::vector<Acc> key_rows;  // (Vec::size(), head_dim): one tile of keys, widened
  std::vector<Acc> keys_t;    // (head_dim, Vec::size()): the same, transposed
  std::vector<Acc> scores;   // (rows, score_stride): scores, then softmax weights
  std::vector<Acc> outputs;  // (rows, head_dim)
  std::vector<Acc> weight_sums;
  std::vector<int64_t> row_offsets;  // (max_context,): each context token's row in the caches

  PrefillScratch(const Layout& layout, int64_t max_context)
      : score_stride(Scratch<Acc>::round_up(max_context, Vectorized<Acc>::size())),
        queries(kQueryBlock * layout.group_size * layout.head_dim),
        key_rows(layout.head_dim * Vectorized<Acc>::size()),
        keys_t(layout.head_dim * Vectorized<Acc>::size()),
        scores(kQueryBlock * layout.group_size * score_stride),
        outputs(kQueryBlock * layout.group_size * layout.head_dim),
        weight_sums(kQueryBlock * layout.group_size),
        row_offsets(max_context) {}
};

// Calls f(std::integral_constant<int, count>{}) for a count in 1..kMax, so f can size register
// tiles by it (a tile sized at run time lives on the stack, not in registers).
template <int kMax, typename F>
inline void with_count(int64_t count, F&& f) {
  if constexpr (kMax > 1) {
    if (count < kMax) {
      with_count<kMax - 1>(count, f);
      return;
    }
  }
  f(std::integral_constant<int, kMax>{});
}

// scores[r * stride + j] = queries[r] . key j for kRows rows and a tile of Vec::size() keys, given
// transposed: keys_t (head_dim, Vec::size()).
template <int kRows, typename Acc>
inline void score_tile(const Acc* queries, int64_t head_dim, const Acc* keys_t, Acc* scores, int64_t stride) {
  using Vec = Vectorized<Acc>;
  Vec acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = Vec(Acc(0));
  for (int64_t d = 0; d < head_dim; ++d) {
    const Vec k = Vec::loadu(keys_t + d * Vec::size());
    for (int r = 0; r < kRows; ++r) acc[r] = at::vec::fmadd(Vec(queries[r * head_dim + d]), k, acc[r]);
  }
  for (int r = 0; r < kRows; ++r) acc[r].store(scores + r * stride);
}

// outputs[r, first : first + kChunks vectors] = the sum over t < seen of weights[r * stride + t]
// times V row t (at v_cache + row_offsets[t]), for kRows rows.
template <int kRows, int kChunks, typename scalar_t, typename Acc>
inline void value_tile(const Acc* weights, int64_t stride, const scalar_t* v_cache, const int64_t* row_offsets,
                       int64_t seen, int64_t first, Acc* outputs, int64_t head_dim) {
  using Vec = Vectorized<Acc>;
  Vec acc[kRows][kChunks];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChunks; ++c) acc[r][c] = Vec(Acc(0));
  for (int64_t t = 0; t < seen; ++t) {
    const scalar_t* value = v_cache + row_offsets[t] + first;
    Vec v[kChunks];
    for (int c = 0; c < kChunks; ++c) v[c] = load_as<Acc>(value + c * Vec::size());
    for (int r = 0; r < kRows; ++r) {
      const Vec weight(weights[r * stride + t]);
      for (int c = 0; c < kChunks; ++c) acc[r][c] = at::vec::fmadd(weight, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChunks; ++c) acc[r][c].store(outputs + r * head_dim + first + c * Vec::size());
}

// Attention of one task's rows; out: (tokens, heads, head_dim), tokens `out_token_stride` apart.
template <typename scalar_t>
void attend_query_block(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* block_ids,
                        const PrefillTask& task, acc_type<scalar_t> scale, const Layout& layout,
                        PrefillScratch<acc_type<scalar_t>>& scratch, scalar_t* out, int64_t out_token_stride) {
  using Acc = acc_type<scalar_t>;
  using Vec = Vectorized<Acc>;
  constexpr int64_t kTile = Vec::size();
  const int64_t group = layout.group_size, head_dim = layout.head_dim;
  const int64_t num_rows = task.num_queries * group;  // row i: query i / group, head i % group
  const int64_t first_head = task.kv_head * group;
  const int64_t head_offset = task.kv_head * layout.cache_head_stride;
  // Row i sees positions [0, position(i / group)]; the task's context ends after its last query.
  auto visible = [&](int64_t i) { return task.first_position + task.first_query + i / group + 1; };
  const int64_t context = visible(num_rows - 1);
  // Where each context token's K/V row of this head starts: found once per task, as the hot loops
  // below would otherwise spend most of their time dividing by the block size.
  int64_t* row_offsets = scratch.row_offsets.data();
  for (int64_t t = 0; t < context; ++t) {
    row_offsets[t] = block_ids[t / layout.block_size] * layout.cache_block_stride +
                     (t % layout.block_size) * layout.cache_token_stride + head_offset;
  }
  auto cache_row = [&](const scalar_t* cache, int64_t t) { return cache + row_offsets[t]; };
  Acc* queries = scratch.queries.data();
  Acc* key_rows = scratch.key_rows.data();
  Acc* keys_t = scratch.keys_t.data();
  const int64_t vector_end = head_dim - head_dim % kTile;
  Acc* scores = scratch.scores.data();
  Acc* outputs = scratch.outputs.data();
  const int64_t stride = scratch.score_stride;

  for (int64_t i = 0; i < num_rows; ++i) {
    const scalar_t* src = q + (task.q_offset + task.first_query + i / group) * layout.q_batch_stride +
                          (first_head + i % group) * layout.q_head_stride;
    for (int64_t d = 0; d < head_dim; ++d) {
      queries[i * head_dim + d] = static_cast<Acc>(src[d]) * scale;
    }
  }

  // Scores, a tile of kTile keys at a time.
  for (int64_t t0 = 0; t0 < context; t0 += kTile) {
    // The tile's keys widened into rows (zeros past the context), then transposed.
    const int64_t tile = std::min(kTile, context - t0);
    for (int64_t j = 0; j < kTile; ++j) {
      Acc* dst = key_rows + j * head_dim;
      if (j >= tile) {
        std::fill(dst, dst + head_dim, Acc(0));
        continue;
      }
      const scalar_t* key = cache_row(k_cache, t0 + j);
      int64_t d = 0;
      for (; d < vector_end; d += kTile) load_as<Acc>(key + d).store(dst + d);
      for (; d < head_dim; ++d) dst[d] = static_cast<Acc>(key[d]);
    }
    at::vec::transpose_mxn<Acc>(key_rows, head_dim, keys_t, kTile, kTile, head_dim);
    for (int64_t i0 = 0; i0 < num_rows; i0 += kScoreRows) {
      with_count<kScoreRows>(std::min<int64_t>(kScoreRows, num_rows - i0), [&](auto rows) {
        score_tile<rows.value>(queries + i0 * head_dim, head_dim, keys_t, scores + i0 * stride + t0, stride);
      });
    }
  }

  // Softmax of each row over what it may see; the rest of its row (to the padded end) weighs 0.
  const int64_t padded = (context + kTile - 1) / kTile * kTile;
  for (int64_t i = 0; i < num_rows; ++i) {
    Acc* row = scores + i * stride;
    std::fill(row + visible(i), row + padded, -std::numeric_limits<Acc>::infinity());
    scratch.weight_sums[i] = softmax_unnormalized(row, padded);
    if constexpr (!std::is_same_v<scalar_t, Acc>) {
      // The reference (torch's CPU flash attention) multiplies V by the weights rounded to q's
      // dtype, summed before rounding; so does this kernel, to give the reference's result.
      for (int64_t t = 0; t < padded; ++t) row[t] = static_cast<Acc>(static_cast<scalar_t>(row[t]));
    }
  }

  // Weighted sums of V: kMaxRows rows by up to kValueChunks vectors of head_dim at a time, each
  // V slice loaded once for those rows.
  for (int64_t i0 = 0; i0 < num_rows; i0 += kMaxRows) {
    const int64_t rows = std::min<int64_t>(kMaxRows, num_rows - i0);
    const int64_t seen = visible(i0 + rows - 1);  // the widest of these rows
    for (int64_t d0 = 0; d0 < vector_end; d0 += kValueChunks * kTile) {
      with_count<kMaxRows>(rows, [&](auto r) {
        with_count<kValueChunks>(std::min<int64_t>(kValueChunks, (vector_end - d0) / kTile), [&](auto c) {
          value_tile<r.value, c.value>(scores + i0 * stride, stride, v_cache, row_offsets, seen, d0,
                                       outputs + i0 * head_dim, head_dim);
        });
      });
    }
    for (int64_t d = vector_end; d < head_dim; ++d) {  // head_dim not a whole number of vectors
      for (int r = 0; r < rows; ++r) {
        Acc sum = 0;
        for (int64_t t = 0; t < seen; ++t) sum += scores[(i0 + r) * stride + t] * static_cast<Acc>(cache_row(v_cache, t)[d]);
        outputs[(i0 + r) * head_dim + d] = sum;
      }
    }
  }

  for (int64_t i = 0; i < num_rows; ++i) {
    const Acc inverse_sum = Acc(1) / scratch.weight_sums[i];
    scalar_t* dst = out + (task.q_offset + task.first_query + i / group) * out_token_stride + (first_head + i % group) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      dst[d] = static_cast<scalar_t>(outputs[i * head_dim + d] * inverse_sum);
    }
  }
}

// q: (tokens, heads, head_dim), each sequence's query tokens back to back; k_cache, v_cache:
// (num_blocks, block_size, kv_heads, head_dim); block_tables: (rows, max_blocks) int64; query_lens,
// seq_lens: (rows,) int64, sequence i's queries being the last query_lens[i] of its seq_lens[i]
// context tokens (already in the cache). Returns (tokens, heads, head_dim).
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_lens_in,
                                   const at::Tensor& seq_lens_in, double scale) {
  check_q_and_caches("paged_prefill_attention", q, k_cache, v_cache);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.stride(1) == 1 &&
                  query_lens_in.dim() == 1 && seq_lens_in.dim() == 1 &&
                  query_lens_in.size(0) == block_tables.size(0) && seq_lens_in.size(0) == block_tables.size(0),
              "paged_prefill_attention: block_tables must be (rows, max_blocks) int64 with unit-stride rows, "
              "query_lens and seq_lens (rows,)");
  const at::Tensor query_lens = query_lens_in.to(at::kLong).contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kLong).contiguous();
  const int64_t* q_lens = query_lens.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t num_seqs = block_tables.size(0), max_blocks = block_tables.size(1);

  // Check every row on the host (so a bad one raises instead of reading outside the cache) and
  // cut the queries into tasks.
  std::vector<PrefillTask> tasks;
  int64_t q_offset = 0, max_context = 1;
  for (int64_t row = 0; row < num_seqs; ++row) {
    const int64_t query_len = q_lens[row], context = lens[row];
    TORCH_CHECK(query_len >= 1 && query_len <= context && context <= max_blocks * block_size,
                "paged_prefill_attention: row ", row, " has query_len ", query_len, " and seq_len ", context,
                "; it needs 1 <= query_len <= seq_len <= the block table's ", max_blocks, " blocks x ", block_size,
                " tokens");
    check_block_ids("paged_prefill_attention", block_tables, row, context, block_size, num_blocks);
    for (int64_t first = 0; first < query_len; first += kQueryBlock) {
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        tasks.push_back({row, kv_head, q_offset, first, std::min(kQueryBlock, query_len - first), context - query_len});
      }
    }
    q_offset += query_len;
    max_context = std::max(max_context, context);
  }
  TORCH_CHECK(q_offset == q.size(0), "paged_prefill_attention: query_lens add up to ", q_offset, " but q has ",
              q.size(0), " tokens");

  const Layout layout{num_heads / num_kv_heads, head_dim,          block_size,        q.stride(0),
                      q.stride(1),              k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                      block_tables.stride(0)};
  at::Tensor out = at::empty({q.size(0), num_heads, head_dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_prefill_attention", [&] {
    using Acc = acc_type<scalar_t>;
    const scalar_t* q_data = q.const_data_ptr<scalar_t>();
    const scalar_t* k_data = k_cache.const_data_ptr<scalar_t>();
    const scalar_t* v_data = v_cache.const_data_ptr<scalar_t>();
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    // Tasks differ in size (a query block sees everything before it: the last of a 512-token
    // prompt does 32x the first's work), so a static split left one of two threads idle most of
    // the time. Instead each thread takes the next task from a shared counter, longest first.
    std::stable_sort(tasks.begin(), tasks.end(), [](const PrefillTask& a, const PrefillTask& b) {
      return a.first_position + a.first_query + a.num_queries > b.first_position + b.first_query + b.num_queries;
    });
    std::atomic<int64_t> next{0};
    const int64_t num_tasks = static_cast<int64_t>(tasks.size());
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
      PrefillScratch<Acc> scratch(layout, max_context);
      for (int64_t index = next++; index < num_tasks; index = next++) {
        const PrefillTask& task = tasks[index];
        attend_query_block<scalar_t>(q_data, k_data, v_data, tables + task.row * layout.table_stride, task,
                                     static_cast<Acc>(scale), layout, scratch, out_data, num_heads * head_dim);
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// KV writes: each token's K and V rows into the cache slots `slot_mapping` names (a slot is
// block * block_size + offset), the compiled twin of the reference `write_kv` (index_copy_ into
// the caches seen as (slots, kv_heads, head_dim)). A decode step writes a few KB per layer, for
// which index_copy_'s setup cost about as much as the copying; here they are plain memcpy of head
// rows, on the calling thread. Every slot is checked before anything is written, so a bad one
// raises and leaves the caches as they were.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping_in) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "write_kv: k and v must be (tokens, kv_heads, head_dim) and the caches (num_blocks, block_size, "
              "kv_heads, head_dim), each pair of one shape");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "write_kv: k is ", k.sizes(),
              " but the cache holds ", k_cache.size(2), " heads of ", k_cache.size(3));
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: k, v and the caches must have one dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "write_kv: needs unit-stride head_dim");
  TORCH_CHECK(slot_mapping_in.dim() == 1 && slot_mapping_in.size(0) == k.size(0) &&
                  (slot_mapping_in.scalar_type() == at::kLong || slot_mapping_in.scalar_type() == at::kInt),
              "write_kv: slot_mapping must be (tokens,) int64 or int32");
  const at::Tensor slot_mapping = slot_mapping_in.to(at::kLong).contiguous();
  const int64_t tokens = k.size(0), heads = k.size(1), block_size = k_cache.size(1);
  const int64_t num_slots = k_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_INDEX(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot_mapping[", t, "] is ", slots[t],
                      ", not a slot of the ", num_slots, "-slot cache");
  }
  const int64_t item = k.element_size(), row_bytes = k.size(2) * item;
  // Where token t's head h goes in `cache`.
  auto row = [&](at::Tensor& cache, int64_t t, int64_t h) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    return static_cast<char*>(cache.mutable_data_ptr()) +
           (block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2)) * item;
  };
  auto copy = [&](const at::Tensor& src, at::Tensor& cache) {
    const char* src_data = static_cast<const char*>(src.const_data_ptr());
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(row(cache, t, h), src_data + (t * src.stride(0) + h * src.stride(1)) * item, row_bytes);
      }
    }
  };
  copy(k, k_cache);
  copy(v, v_cache);
}

}  // namespace

// A fragment, not TORCH_LIBRARY: the `graphrt` op namespace may gain ops from other files.
TORCH_LIBRARY_FRAGMENT(graphrt, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale) -> Tensor");
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_lens, Tensor seq_lens, float scale) -> Tensor");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("write_kv", &write_kv);
}
