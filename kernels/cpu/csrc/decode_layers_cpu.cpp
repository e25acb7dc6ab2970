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
//
// A sparse (mixture-of-experts) layer runs SparseMoE.forward's softmax routing (graphrt/model/moe.py,
// kernels/moe.py's route_topk), the count of tokens per expert, kernels/cpu/moe.py's
// fused_moe_by_expert over experts in panels (graphrt::panel_experts) and the shared expert, with
// the same aten ops in the same order: at one row its Python was about 40% of a Qwen3-MoE step
// (about 145 op calls a layer). DeepSeek-V3's grouped sigmoid routing, latent attention and expert
// parallelism's all-reduce stay in Python.

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

// Per layer in `weights`, in this order (kernels/cpu/stage_kernels.py's DECODE_LAYER_WEIGHTS).
enum LayerWeight : int64_t { kInputNorm, kQkvProj, kOProj, kPostAttentionNorm, kPerLayer };
// Per layer in `mlp`: the dense MLP's, or a sparse layer's shared expert (None without one).
enum MlpWeight : int64_t { kGateUpProj, kDownProj, kPerMlp };

using RmsNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                   const at::Tensor&, double);
using PanelLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using PanelLinearSiluAndMul = at::Tensor(const at::Tensor&, const at::Tensor&);
using ApplyRotary = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&);
using WriteKv = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);
using DecodeAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, double);
using PanelExperts = at::Tensor(const at::Tensor&, at::IntArrayRef, at::TensorList, at::TensorList);

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
  c10::TypedOperatorHandle<PanelExperts> panel_experts = graphrt_op<PanelExperts>("graphrt::panel_experts");

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

// The gated MLP on weights in panels: down(silu(gate) * up), gate/up ending in silu_and_mul.
at::Tensor gated_mlp(const LayerOps& ops, const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down) {
  return ops.panel_linear.call(ops.panel_linear_silu_and_mul.call(x, gate_up), down, std::nullopt);
}

// A sparse layer's routed experts, in panels: expert e's gate/up weight is gate_up[e], its down weight down[e].
struct SparseLayer {
  const at::Tensor& router;  // (num_experts, hidden_size), dense
  at::TensorList gate_up, down;
  const std::optional<at::Tensor>& shared_gate;  // Qwen2-MoE's (1, hidden_size) gate on the shared expert
};

// SparseMoE.forward with softmax routing, over `normed` (tokens, hidden_size): route_topk, the
// tokens per expert (`real` marks the rows that are not a graph's padding), fused_moe_by_expert
// over experts in panels, then the shared expert if the layer has one (`mlp`, gated or not).
at::Tensor sparse_mlp(const LayerOps& ops, const at::Tensor& normed, const SparseLayer& layer, const at::Tensor* mlp,
                      const std::optional<at::Tensor>& expert_tokens, const at::Tensor& real, int64_t top_k,
                      bool renormalize) {
  const int64_t num_experts = layer.router.size(0);
  const at::Tensor probs = at::softmax(at::linear(normed, layer.router), -1, at::kFloat);
  auto [topk_weights, topk_ids] = at::topk(probs, top_k, -1);
  if (renormalize) {
    topk_weights = topk_weights / topk_weights.sum({-1}, /*keepdim=*/true);
  }
  const at::Tensor flat_ids = topk_ids.reshape(-1), flat_weights = topk_weights.reshape(-1);
  if (expert_tokens.has_value()) {
    at::Tensor counted = *expert_tokens;
    counted.index_add_(0, flat_ids, real.to(at::kLong).unsqueeze(1).expand(topk_ids.sizes()).reshape(-1));
  }
  // fused_moe_by_expert: the pairs grouped by expert, each chosen expert on its rows, the weighted
  // results summed into their rows in the wider of the two dtypes.
  const at::ScalarType sum_dtype = at::promote_types(normed.scalar_type(), topk_weights.scalar_type());
  const at::Tensor pairs = at::where(flat_weights != 0, flat_ids, num_experts);
  at::Tensor order = at::argsort(pairs, /*stable=*/true);
  const at::Tensor counts = at::bincount(pairs, {}, num_experts + 1).narrow(0, 0, num_experts).contiguous();
  const at::IntArrayRef per_expert(counts.const_data_ptr<int64_t>(), num_experts);
  int64_t num_run = 0;
  for (const int64_t count : per_expert) {
    num_run += count;
  }
  at::Tensor out = at::zeros(normed.sizes(), normed.options().dtype(sum_dtype));
  if (num_run > 0) {
    order = order.narrow(0, 0, num_run);
    const at::Tensor rows_of = order.div(top_k, "floor");
    const at::Tensor downs = ops.panel_experts.call(normed.index_select(0, rows_of), per_expert, layer.gate_up, layer.down);
    const at::Tensor weights = flat_weights.index_select(0, order).to(sum_dtype);
    out.index_add_(0, rows_of, downs.to(sum_dtype) * weights.unsqueeze(1));
  }
  out = out.to(normed.scalar_type());
  if (mlp[kGateUpProj].defined()) {
    at::Tensor shared = gated_mlp(ops, normed, mlp[kGateUpProj], mlp[kDownProj]);
    if (layer.shared_gate.has_value()) {
      shared = at::sigmoid(at::linear(normed, *layer.shared_gate)) * shared;
    }
    out = out + shared;
  }
  return out;
}

// The stage's input hidden states (tokens, hidden_size) -> (hidden, residual) after every layer, as
// the Python loop leaves them for the final norm. `router` names the sparse layers; their experts
// are `experts`, layer after layer, each sparse layer's num_experts gate/up weights then as many down.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& mlp,
    const c10::List<std::optional<at::Tensor>>& qkv_bias, const c10::List<std::optional<at::Tensor>>& q_norm,
    const c10::List<std::optional<at::Tensor>>& k_norm, const c10::List<std::optional<at::Tensor>>& router,
    const c10::List<std::optional<at::Tensor>>& shared_gate, at::TensorList experts,
    const std::optional<at::Tensor>& expert_tokens, int64_t top_k, bool renormalize, const at::Tensor& cos,
    const at::Tensor& sin, at::Tensor& k_caches, at::Tensor& v_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
    double scale) {
  TORCH_CHECK(k_caches.dim() == 5 && v_caches.sizes() == k_caches.sizes() && k_caches.size(0) > 0,
              "decode_layers: the caches must be (layers, num_blocks, block_size, kv_heads, head_dim) both, "
              "for at least one layer");
  const int64_t num_layers = k_caches.size(0), head_dim = k_caches.size(4);
  const auto per_layer = [&](const char* what, int64_t given, int64_t wanted) {
    TORCH_CHECK(given == wanted, "decode_layers: ", wanted, " ", what, " for the caches' ", num_layers, " layers, got ",
                given);
  };
  per_layer("weights (4 a layer)", int64_t(weights.size()), num_layers * kPerLayer);
  per_layer("MLP weights (2 a layer, None where absent)", int64_t(mlp.size()), num_layers * kPerMlp);
  per_layer("q/k/v biases (None where absent)", int64_t(qkv_bias.size()), num_layers);
  per_layer("q norms (None where absent)", int64_t(q_norm.size()), num_layers);
  per_layer("k norms (None where absent)", int64_t(k_norm.size()), num_layers);
  per_layer("routers (None for a dense layer)", int64_t(router.size()), num_layers);
  per_layer("shared expert gates (None where absent)", int64_t(shared_gate.size()), num_layers);
  int64_t num_expert_weights = 0;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const std::optional<at::Tensor> layer_router = router.get(layer);
    const bool has_mlp = mlp.get(layer * kPerMlp + kGateUpProj).has_value();
    TORCH_CHECK(has_mlp == mlp.get(layer * kPerMlp + kDownProj).has_value(), "decode_layers: layer ", layer,
                " has a gate/up weight or a down weight but not both");
    TORCH_CHECK(layer_router.has_value() || has_mlp, "decode_layers: layer ", layer,
                " is dense (no router) but has no MLP weights");
    if (layer_router.has_value()) {
      TORCH_CHECK(layer_router->dim() == 2, "decode_layers: layer ", layer, "'s router must be (num_experts, hidden_size)");
      num_expert_weights += 2 * layer_router->size(0);
    }
  }
  TORCH_CHECK(int64_t(experts.size()) == num_expert_weights, "decode_layers: the routers name ", num_expert_weights,
              " expert weights (a gate/up and a down per expert), got ", experts.size());
  TORCH_CHECK(hidden_in.dim() == 2, "decode_layers: hidden must be (tokens, hidden_size)");
  TORCH_CHECK(cos.size(-1) == head_dim, "decode_layers: cos/sin rows of ", cos.size(-1), " for heads of ", head_dim);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const LayerOps& ops = LayerOps::get();
  // A graph's padding rows write to the scratch block 0: the tokens per expert count only the others.
  const at::Tensor real = slot_mapping >= k_caches.size(2);
  at::Tensor hidden = hidden_in, normed, summed;
  std::optional<at::Tensor> residual;  // none before the first layer
  int64_t next_expert = 0;
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
    const at::Tensor layer_mlp[kPerMlp] = {mlp.get(layer * kPerMlp + kGateUpProj).value_or(at::Tensor()),
                                           mlp.get(layer * kPerMlp + kDownProj).value_or(at::Tensor())};
    const std::optional<at::Tensor> layer_router = router.get(layer);
    if (layer_router.has_value()) {
      const int64_t num_experts = layer_router->size(0);
      const std::optional<at::Tensor> gate = shared_gate.get(layer);
      const SparseLayer sparse{*layer_router, experts.slice(next_expert, num_experts),
                               experts.slice(next_expert + num_experts, num_experts), gate};
      next_expert += 2 * num_experts;
      hidden = sparse_mlp(ops, normed, sparse, layer_mlp, expert_tokens, real, top_k, renormalize);
    } else {
      hidden = gated_mlp(ops, normed, layer_mlp[kGateUpProj], layer_mlp[kDownProj]);
    }
  }
  return {hidden, *residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(graphrt, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor[] weights, Tensor?[] mlp, Tensor?[] qkv_bias, Tensor?[] q_norm, "
      "Tensor?[] k_norm, Tensor?[] router, Tensor?[] shared_gate, Tensor[] experts, Tensor(c!)? expert_tokens, "
      "int top_k, bool renormalize, Tensor cos, Tensor sin, Tensor(a!) k_caches, Tensor(b!) v_caches, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, float eps, "
      "float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("decode_layers", &decode_layers);
}
