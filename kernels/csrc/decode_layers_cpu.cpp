// A stage's decoder layers for one decode step in one call: the loop of DecoderLayer.forward
// (graphrt/model.py) over every layer, run here rather than in Python. It calls the same compiled
// ops in the same order through the dispatcher (the gate/up matmul ending in silu_and_mul, as the
// loop runs it where both are compiled), so its output is bitwise the Python loop's
// (tests/test_decode_layers_cpu.py), without the interpreter's time per op: about 16 ops a layer,
// 500 a step, which on a 2-core CPU cost a few percent of a decode step, time the other thread spends
// waiting. The CPU's counterpart of a CUDA graph: one launch per micro-batch. Stage.forward takes it
// where every op of the layers is the compiled one and every matmul weight is in panels; anything
// else (prefill chunks, torch's reference ops, oneDNN or dense weights) goes through Python.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

// Per layer in `weights`, in this order.
enum LayerWeight : int64_t { kInputNorm, kQkvProj, kOProj, kPostAttentionNorm, kGateUpProj, kDownProj, kPerLayer };

template <typename Signature>
c10::TypedOperatorHandle<Signature> graphrt_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Ops {
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                              const at::Tensor&, double)>
      rms_norm = graphrt_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                               const at::Tensor&, double)>("graphrt::rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>
      panel_linear = graphrt_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>(
          "graphrt::panel_linear");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&)>
      apply_rotary = graphrt_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, const at::Tensor&)>(
          "graphrt::apply_rotary");
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&)>
      write_kv = graphrt_op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&)>(
          "graphrt::write_kv");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double)>
      decode_attention = graphrt_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, double)>(
          "graphrt::paged_decode_attention");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)> panel_linear_silu_and_mul =
      graphrt_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("graphrt::panel_linear_silu_and_mul");
};

const Ops& ops() {
  static const Ops handles;  // looked up once: the ops are registered when the library loads
  return handles;
}

// q or k (tokens, heads, head_dim) normalized per head, as the rms_norm wrapper in
// kernels/elementwise_cpu.py runs it on a 3-D tensor.
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  return std::get<0>(ops().rms_norm.call(rows.stride(-1) == 1 ? rows : rows.contiguous(), std::nullopt, weight, eps))
      .view(x.sizes());
}

// hidden (tokens, hidden_size) and the residual stream (None before the stage's first layer) ->
// both after every layer, as DecoderLayer.forward returns them.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, const std::optional<at::Tensor>& residual_in, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& qkv_bias, const c10::List<std::optional<at::Tensor>>& q_norm,
    const c10::List<std::optional<at::Tensor>>& k_norm, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor& k_caches, at::Tensor& v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  TORCH_CHECK(k_caches.dim() == 5 && v_caches.sizes() == k_caches.sizes(),
              "decode_layers: the caches must be (layers, num_blocks, block_size, kv_heads, head_dim) both");
  const int64_t num_layers = k_caches.size(0);
  TORCH_CHECK(int64_t(weights.size()) == num_layers * kPerLayer &&
                  int64_t(qkv_bias.size()) == num_layers && int64_t(q_norm.size()) == num_layers &&
                  int64_t(k_norm.size()) == num_layers,
              "decode_layers: ", kPerLayer, " weights, a bias and two head norms per layer of the caches; got ",
              weights.size(), " weights for ", num_layers, " layers");
  TORCH_CHECK(hidden_in.dim() == 2, "decode_layers: hidden must be (tokens, hidden_size)");
  const int64_t head_dim = cos.size(-1), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const Ops& op = ops();
  at::Tensor hidden = hidden_in, normed, summed;
  std::optional<at::Tensor> residual = residual_in;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kPerLayer;
    std::tie(normed, summed) = op.rms_norm.call(hidden, residual, w[kInputNorm], eps);
    residual = residual.has_value() ? summed : hidden;  // the op returns an empty sum without a residual
    const at::Tensor qkv = op.panel_linear.call(normed, w[kQkvProj], qkv_bias.get(layer));
    at::Tensor q = qkv.narrow(1, 0, q_size).view({-1, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({-1, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, num_kv_heads, head_dim});
    if (const std::optional<at::Tensor> q_weight = q_norm.get(layer); q_weight.has_value()) {
      q = head_norm(q, *q_weight, eps);
      k = head_norm(k, *k_norm.get(layer), eps);
    }
    std::tie(q, k) = op.apply_rotary.call(q, k, cos, sin);
    at::Tensor k_cache = k_caches.select(0, layer), v_cache = v_caches.select(0, layer);
    op.write_kv.call(k, v, k_cache, v_cache, slot_mapping);
    const at::Tensor attn = op.decode_attention.call(q, k_cache, v_cache, block_tables, seq_lens, scale);
    hidden = op.panel_linear.call(attn.reshape({-1, q_size}), w[kOProj], std::nullopt);
    std::tie(normed, summed) = op.rms_norm.call(hidden, residual, w[kPostAttentionNorm], eps);
    residual = summed;
    const at::Tensor act = op.panel_linear_silu_and_mul.call(normed, w[kGateUpProj]);
    hidden = op.panel_linear.call(act, w[kDownProj], std::nullopt);
  }
  return {hidden, *residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(graphrt, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor? residual, Tensor[] weights, Tensor?[] qkv_bias, Tensor?[] q_norm, "
      "Tensor?[] k_norm, Tensor cos, Tensor sin, Tensor(a!) k_caches, Tensor(b!) v_caches, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, float eps, float scale) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("decode_layers", &decode_layers);
}
