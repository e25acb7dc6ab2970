// A stage's decoder layers for one decode step in one call: the loop of DecoderLayer.forward
// (graphrt/model/llama.py) over every layer, run here rather than in Python. It calls the same compiled
// ops in the same order through the dispatcher (the gate/up matmul ending in silu_and_mul, as the
// loop runs it where both are compiled), so its output is bitwise the Python loop's
// (tests/kernels/cpu/test_decode_layers_cpu.py), without the interpreter's time per op: about 16 ops a layer,
// 500 a step, each 5-8 us of Python on the host thread while torch's other thread waits (8% of the
// host thread's samples in a 32-row float32 step; benchmarks/results.md). The CPU's counterpart of a
// CUDA graph: one launch per micro-batch. The CPU kernel set's decode_layers (kernels/cpu/
// stage_kernels.py) runs it where every op of the layers is the compiled one and every matmul weight
// is in panels; anything else (prefill chunks, torch's reference ops, oneDNN or dense weights) goes
// through Python.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

// Per layer in `weights`, in this order (kernels/cpu/stage_kernels.py's DECODE_LAYER_WEIGHTS).
enum LayerWeight : int64_t { kInputNorm, kQkvProj, kOProj, kPostAttentionNorm, kGateUpProj, kDownProj, kPerLayer };

using RmsNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                   const at::Tensor&, double);
using PanelLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using PanelLinearSiluAndMul = at::Tensor(const at::Tensor&, const at::Tensor&);
using ApplyRotary = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&);
using WriteKv = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);
using DecodeAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, double);

template <typename Signature>
c10::TypedOperatorHandle<Signature> graphrt_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The ops a layer calls, looked up once (the library registers them all when it loads).
struct LayerOps {
  c10::TypedOperatorHandle<RmsNorm> rms_norm = graphrt_op<RmsNorm>("graphrt::rms_norm");
  c10::TypedOperatorHandle<PanelLinear> panel_linear = graphrt_op<PanelLinear>("graphrt::panel_linear");
  c10::TypedOperatorHandle<PanelLinearSiluAndMul> panel_linear_silu_and_mul =
      graphrt_op<PanelLinearSiluAndMul>("graphrt::panel_linear_silu_and_mul");
  c10::TypedOperatorHandle<ApplyRotary> apply_rotary = graphrt_op<ApplyRotary>("graphrt::apply_rotary");
  c10::TypedOperatorHandle<WriteKv> write_kv = graphrt_op<WriteKv>("graphrt::write_kv");
  c10::TypedOperatorHandle<DecodeAttention> decode_attention =
      graphrt_op<DecodeAttention>("graphrt::paged_decode_attention");

  static const LayerOps& get() {
    static const LayerOps ops;
    return ops;
  }
};

// q or k (tokens, heads, head_dim) normalized per head, as the rms_norm wrapper in
// kernels/cpu/elementwise.py runs it on a 3-D tensor.
at::Tensor head_norm(const LayerOps& ops, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  return std::get<0>(ops.rms_norm.call(rows.stride(-1) == 1 ? rows : rows.contiguous(), std::nullopt, weight, eps))
      .view(x.sizes());
}

// The stage's input hidden states (tokens, hidden_size) -> (hidden, residual) after every layer, as
// the Python loop leaves them for the final norm.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& qkv_bias,
    const c10::List<std::optional<at::Tensor>>& q_norm, const c10::List<std::optional<at::Tensor>>& k_norm,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_caches, at::Tensor& v_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
    int64_t num_kv_heads, double eps, double scale) {
  TORCH_CHECK(k_caches.dim() == 5 && v_caches.sizes() == k_caches.sizes() && k_caches.size(0) > 0,
              "decode_layers: the caches must be (layers, num_blocks, block_size, kv_heads, head_dim) both, "
              "for at least one layer");
  const int64_t num_layers = k_caches.size(0), head_dim = k_caches.size(4);
  const auto per_layer = [&](const char* what, int64_t given, int64_t wanted) {
    TORCH_CHECK(given == wanted, "decode_layers: ", wanted, " ", what, " for the caches' ", num_layers, " layers, got ",
                given);
  };
  per_layer("weights (6 a layer)", int64_t(weights.size()), num_layers * kPerLayer);
  per_layer("q/k/v biases (None where absent)", int64_t(qkv_bias.size()), num_layers);
  per_layer("q norms (None where absent)", int64_t(q_norm.size()), num_layers);
  per_layer("k norms (None where absent)", int64_t(k_norm.size()), num_layers);
  TORCH_CHECK(hidden_in.dim() == 2, "decode_layers: hidden must be (tokens, hidden_size)");
  TORCH_CHECK(cos.size(-1) == head_dim, "decode_layers: cos/sin rows of ", cos.size(-1), " for heads of ", head_dim);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const LayerOps& ops = LayerOps::get();
  at::Tensor hidden = hidden_in, normed, summed;
  std::optional<at::Tensor> residual;  // none before the first layer
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* layer_weights = weights.data() + layer * kPerLayer;
    std::tie(normed, summed) = ops.rms_norm.call(hidden, residual, layer_weights[kInputNorm], eps);
    residual = residual.has_value() ? summed : hidden;  // the op returns an empty sum without a residual
    const at::Tensor qkv = ops.panel_linear.call(normed, layer_weights[kQkvProj], qkv_bias.get(layer));
    at::Tensor q = qkv.narrow(1, 0, q_size).view({-1, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({-1, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, num_kv_heads, head_dim});
    const std::optional<at::Tensor> q_weight = q_norm.get(layer), k_weight = k_norm.get(layer);
    TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "decode_layers: layer ", layer,
                " has a norm for q's heads or for k's but not both");
    if (q_weight.has_value()) {
      q = head_norm(ops, q, *q_weight, eps);
      k = head_norm(ops, k, *k_weight, eps);
    }
    std::tie(q, k) = ops.apply_rotary.call(q, k, cos, sin);
    at::Tensor k_cache = k_caches.select(0, layer), v_cache = v_caches.select(0, layer);
    ops.write_kv.call(k, v, k_cache, v_cache, slot_mapping);
    const at::Tensor attn = ops.decode_attention.call(q, k_cache, v_cache, block_tables, seq_lens, scale);
    hidden = ops.panel_linear.call(attn.reshape({-1, q_size}), layer_weights[kOProj], std::nullopt);
    std::tie(normed, summed) = ops.rms_norm.call(hidden, residual, layer_weights[kPostAttentionNorm], eps);
    residual = summed;
    const at::Tensor act = ops.panel_linear_silu_and_mul.call(normed, layer_weights[kGateUpProj]);
    hidden = ops.panel_linear.call(act, layer_weights[kDownProj], std::nullopt);
  }
  return {hidden, *residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(graphrt, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor[] weights, Tensor?[] qkv_bias, Tensor?[] q_norm, Tensor?[] k_norm, "
      "Tensor cos, Tensor sin, Tensor(a!) k_caches, Tensor(b!) v_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens, int num_heads, int num_kv_heads, float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("decode_layers", &decode_layers);
}
