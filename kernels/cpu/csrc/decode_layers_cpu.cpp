// A stage's decoder layers for one decode step in one call: the loop of DecoderLayer.forward
// (graphrt/model/llama.py) over every layer, run here rather than in Python. It calls the same ops in
// the same order (the compiled ones through the dispatcher, torch's as aten calls; the gate/up matmul
// ending in silu_and_mul, as the loop runs it where both are compiled), so its output is bitwise
// the Python loop's (tests/kernels/cpu/test_decode_layers_cpu.py), without the interpreter's time per
// op: each call 5-8 us of Python on the host thread while torch's other thread waits (8% of the
// host thread's samples in a dense 32-row float32 step; benchmarks/results.md). The CPU's
// counterpart of a CUDA graph: one launch per micro-batch. The CPU kernel set's decode_layers
// (kernels/cpu/stage_kernels.py) runs it where every op of the layers is the compiled one and every
// matmul weight is in panels; anything else (prefill chunks, torch's reference ops, oneDNN or dense
// weights) goes through Python.
//
// Besides attention over keys and values per head, a layer may have DeepSeek-V3's latent attention
// (LatentAttention.forward, graphrt/model/mla.py: the absorbed form over the latent cache), and
// besides the dense gated MLP, a mixture of experts (SparseMoE.forward, graphrt/model/moe.py):
// softmax or grouped sigmoid routing (kernels/moe.py), the count of tokens per expert,
// kernels/cpu/moe.py's fused_moe_by_expert over experts in panels (graphrt::panel_experts) and the
// shared expert. A sparse layer is about 145 op calls; at one row the Python between them was 40%
// of a Qwen3-MoE step (the ops' own time 3.3 ms of 5.4). Expert parallelism's all-reduce stays in
// Python.

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <string_view>
#include <tuple>

namespace {

// Each layer's weights in `weights`, in this order, None where the layer has none
// (kernels/cpu/stage_kernels.py's layer_weights).
enum LayerWeight : int64_t {
  kInputNorm,
  kPostAttentionNorm,
  kOProj,
  // attention over keys and values per head
  kQkvProj,
  kQkvBias,
  kQNorm,
  kKNorm,
  // latent attention
  kQkvAProj,
  kQANorm,
  kQBProj,
  kKvANorm,
  kKvBProj,
  // the dense MLP, or a sparse layer's shared expert
  kGateUpProj,
  kDownProj,
  // a sparse layer's router
  kRouter,
  kRouterBias,  // DeepSeek-V3's e_score_correction_bias
  kSharedGate,  // Qwen2-MoE's gate on its shared expert
  kPerLayer
};

// Each slot's name, as kernels/cpu/stage_kernels.py's LAYER_WEIGHTS lists them (a test checks the two agree).
constexpr const char* kLayerWeightNames[kPerLayer] = {
    "input_norm", "post_attention_norm", "o_proj", "qkv_proj", "qkv_bias", "q_norm", "k_norm", "mla.qkv_a_proj",
    "mla.q_a_norm", "mla.q_b_proj", "mla.kv_a_norm", "mla.kv_b_proj", "mlp.gate_up", "mlp.down", "moe.router",
    "moe.e_score_correction_bias", "moe.shared_expert_gate"};

// latent_dims, for a model with latent attention.
enum LatentDim : int64_t { kQASize, kKvLoraRank, kQkNopeHeadDim, kQkRopeHeadDim, kVHeadDim, kLatentDims };

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

// What every layer of the step shares.
struct Step {
  const LayerOps& ops;
  const at::Tensor &cos, &sin, &slot_mapping, &block_tables, &seq_lens;
  int64_t num_heads, num_kv_heads;
  double eps, scale;
};

// A layer's weights: weight(kQkvProj), or None.
struct Layer {
  const c10::List<std::optional<at::Tensor>>& weights;
  int64_t index;

  std::optional<at::Tensor> get(LayerWeight which) const { return weights.get(index * kPerLayer + which); }
  at::Tensor operator[](LayerWeight which) const {
    const std::optional<at::Tensor> weight = get(which);
    TORCH_CHECK(weight.has_value(), "decode_layers: layer ", index, " lacks its ", kLayerWeightNames[which]);
    return *weight;
  }
};

// x normalized over its last dimension, as the rms_norm wrapper in kernels/cpu/elementwise.py runs
// it (rows of unit stride, without a residual).
at::Tensor norm(const LayerOps& ops, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
  return std::get<0>(ops.rms_norm.call(rows.stride(-1) == 1 ? rows : rows.contiguous(), std::nullopt, weight, eps))
      .view(x.sizes());
}

// kernels/cpu/linear.py's `linear` on a weight in panels.
at::Tensor panel_linear(const LayerOps& ops, const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias = std::nullopt) {
  return ops.panel_linear.call(x.stride(-1) == 1 ? x : x.contiguous(), weight, bias);
}

// The gated MLP on weights in panels: down(silu(gate) * up), gate/up ending in silu_and_mul.
at::Tensor gated_mlp(const LayerOps& ops, const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down) {
  return panel_linear(ops, ops.panel_linear_silu_and_mul.call(x, gate_up), down);
}

// DecoderLayer.forward's attention over keys and values per head: (tokens, num_heads * head_dim).
at::Tensor per_head_attention(const Step& step, const Layer& layer, const at::Tensor& normed, at::Tensor& k_cache,
                              at::Tensor& v_cache) {
  const int64_t head_dim = k_cache.size(3), q_size = step.num_heads * head_dim, kv_size = step.num_kv_heads * head_dim;
  TORCH_CHECK(step.cos.size(-1) == head_dim, "decode_layers: cos/sin rows of ", step.cos.size(-1), " for heads of ",
              head_dim);
  const at::Tensor qkv = panel_linear(step.ops, normed, layer[kQkvProj], layer.get(kQkvBias));
  at::Tensor q = qkv.narrow(1, 0, q_size).view({-1, step.num_heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({-1, step.num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, step.num_kv_heads, head_dim});
  const std::optional<at::Tensor> q_weight = layer.get(kQNorm), k_weight = layer.get(kKNorm);
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "decode_layers: layer ", layer.index,
              " has a norm for q's heads or for k's but not both");
  if (q_weight.has_value()) {
    q = norm(step.ops, q, *q_weight, step.eps);
    k = norm(step.ops, k, *k_weight, step.eps);
  }
  std::tie(q, k) = step.ops.apply_rotary.call(q, k, step.cos, step.sin);
  step.ops.write_kv.call(k, v, k_cache, v_cache, step.slot_mapping);
  const at::Tensor attn =
      step.ops.decode_attention.call(q, k_cache, v_cache, step.block_tables, step.seq_lens, step.scale);
  return attn.reshape({-1, q_size});
}

// LatentAttention.forward, decode: the query into the latent space through W_UK, attention over the
// cached rows (the compiled decode kernel with the cache as keys and values: kernels/cpu/
// paged_attention.py's paged_latent_decode_attention), out through W_UV. (tokens, num_heads * v_head_dim).
at::Tensor latent_attention(const Step& step, const Layer& layer, const at::Tensor& normed, at::Tensor& cache,
                            at::IntArrayRef dims, double latent_eps) {
  const int64_t heads = step.num_heads, q_a_size = dims[kQASize], kv_lora_rank = dims[kKvLoraRank];
  const int64_t nope = dims[kQkNopeHeadDim], rope = dims[kQkRopeHeadDim], v_head_dim = dims[kVHeadDim];
  const at::Tensor qkv_a = panel_linear(step.ops, normed, layer[kQkvAProj]);
  at::Tensor q = qkv_a.narrow(1, 0, q_a_size);
  at::Tensor latent = qkv_a.narrow(1, q_a_size, kv_lora_rank);
  at::Tensor k_rope = qkv_a.narrow(1, q_a_size + kv_lora_rank, rope);
  if (layer.get(kQBProj).has_value()) {
    q = panel_linear(step.ops, norm(step.ops, q, layer[kQANorm], latent_eps), layer[kQBProj]);
  }
  const at::Tensor q_heads = q.reshape({-1, heads, nope + rope});
  const at::Tensor q_nope = q_heads.narrow(-1, 0, nope);
  at::Tensor q_rope = q_heads.narrow(-1, nope, rope);
  latent = norm(step.ops, latent, layer[kKvANorm], latent_eps);
  std::tie(q_rope, k_rope) = step.ops.apply_rotary.call(q_rope, k_rope.reshape({-1, 1, rope}), step.cos, step.sin);
  // kernels/mla.py's write_latent_kv
  const at::Tensor row = at::cat({latent.unsqueeze(1), k_rope}, -1);
  cache.view({-1, row.size(1), row.size(2)}).index_copy_(0, step.slot_mapping, row);
  const at::Tensor w_kv_b = layer[kKvBProj].view({heads, -1, kv_lora_rank});
  const at::Tensor w_uk = w_kv_b.narrow(1, 0, nope), w_uv = w_kv_b.narrow(1, nope, v_head_dim);
  const at::Tensor q_latent = at::bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1);
  const at::Tensor query = at::cat({q_latent, q_rope}, -1);
  const at::Tensor attn =
      step.ops.decode_attention.call(query, cache, cache, step.block_tables, step.seq_lens, step.scale)
          .narrow(-1, 0, kv_lora_rank);
  return at::bmm(attn.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).reshape({-1, heads * v_head_dim});
}

// How a sparse layer routes its tokens (kernels/moe.py: route_topk, route_grouped_topk).
struct Routing {
  std::string_view scoring;  // softmax | sigmoid (grouped, with the router's bias)
  int64_t top_k;
  bool renormalize;
  int64_t n_group, topk_group;
  double routed_scaling_factor;
};

// SparseMoE.route: (topk_weights (tokens, top_k) float32, float64 for a float64 model; topk_ids (tokens, top_k) int64).
std::tuple<at::Tensor, at::Tensor> route(const Layer& layer, const at::Tensor& normed, const Routing& routing) {
  const at::Tensor router = layer[kRouter];
  // float32 at least: float64 stays float64 (kernels/moe.py says why)
  const at::ScalarType wide = at::promote_types(normed.scalar_type(), at::kFloat);
  if (routing.scoring == "softmax") {
    const at::Tensor probs = at::softmax(at::linear(normed, router), -1, wide);
    auto [topk_weights, topk_ids] = at::topk(probs, routing.top_k, -1);
    if (routing.renormalize) {
      topk_weights = topk_weights / topk_weights.sum({-1}, /*keepdim=*/true);
    }
    return {topk_weights, topk_ids};
  }
  // sigmoid: the router multiplies in float32 at least
  const at::Tensor logits = at::linear(normed.to(wide), router.to(wide));
  const int64_t num_tokens = logits.size(0), num_experts = logits.size(1);
  const at::Tensor scores = at::sigmoid(logits);
  at::Tensor biased = scores + layer[kRouterBias].to(wide);
  const at::Tensor per_group = biased.view({num_tokens, routing.n_group, num_experts / routing.n_group});
  const at::Tensor group_scores = std::get<0>(per_group.topk(2, -1)).sum({-1});
  const at::Tensor best_groups = std::get<1>(group_scores.topk(routing.topk_group, -1));
  const at::Tensor group_chosen = at::zeros_like(group_scores).scatter_(1, best_groups, 1.0);
  const at::Tensor eligible = group_chosen.unsqueeze(-1).expand_as(per_group).reshape({num_tokens, num_experts});
  biased = biased.masked_fill(eligible == 0, -std::numeric_limits<double>::infinity());
  const at::Tensor topk_ids = std::get<1>(biased.topk(routing.top_k, -1));
  at::Tensor topk_weights = scores.gather(1, topk_ids);
  if (routing.renormalize) {
    topk_weights = topk_weights / (topk_weights.sum({-1}, /*keepdim=*/true) + 1e-20);
  }
  return {topk_weights * routing.routed_scaling_factor, topk_ids};
}

// SparseMoE.forward over `normed` (tokens, hidden_size): the routing, the tokens per expert (`real`
// marks the rows that are not a graph's padding) and the experts read, fused_moe_by_expert over the routed experts in
// panels (expert e's gate/up weight gate_up[e], its down weight down[e]), then the shared expert if
// the layer has one (gated or not).
at::Tensor sparse_mlp(const Step& step, const Layer& layer, const at::Tensor& normed, at::TensorList gate_up,
                      at::TensorList down, const Routing& routing, const std::optional<at::Tensor>& expert_tokens,
                      const std::optional<at::Tensor>& expert_reads, const at::Tensor& real) {
  const int64_t num_experts = gate_up.size();
  const auto [topk_weights, topk_ids] = route(layer, normed, routing);
  const at::Tensor flat_ids = topk_ids.reshape(-1), flat_weights = topk_weights.reshape(-1);
  if (expert_tokens.has_value()) {
    at::Tensor counted = *expert_tokens;
    counted.index_add_(0, flat_ids, real.to(at::kLong).unsqueeze(1).expand(topk_ids.sizes()).reshape(-1));
    if (expert_reads.has_value()) {  // the distinct experts the rows chose, in a step with a real row
      at::Tensor reads = *expert_reads;
      reads.add_(at::zeros({num_experts}, flat_ids.options()).index_fill_(0, flat_ids, 1).sum() * real.any());
    }
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
    const at::Tensor rows_of = order.div(routing.top_k, "floor");
    const at::Tensor downs = step.ops.panel_experts.call(normed.index_select(0, rows_of), per_expert, gate_up, down);
    const at::Tensor weights = flat_weights.index_select(0, order).to(sum_dtype);
    out.index_add_(0, rows_of, downs.to(sum_dtype) * weights.unsqueeze(1));
  }
  out = out.to(normed.scalar_type());
  if (layer.get(kGateUpProj).has_value()) {
    at::Tensor shared = gated_mlp(step.ops, normed, layer[kGateUpProj], layer[kDownProj]);
    if (const std::optional<at::Tensor> gate = layer.get(kSharedGate)) {
      shared = at::sigmoid(at::linear(normed, *gate)) * shared;
    }
    out = out + shared;
  }
  return out;
}

// The stage's input hidden states (tokens, hidden_size) -> (hidden, residual) after every layer, as
// the Python loop leaves them for the final norm. A layer has latent attention where it has a
// qkv_a_proj (latent_dims then gives its sizes), and is sparse where it has a router; the sparse
// layers' routed experts are `experts`, layer after layer, each layer's num_experts (its router's
// rows) gate/up weights, then as many down weights.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, const c10::List<std::optional<at::Tensor>>& weights, at::TensorList experts,
    const std::optional<at::Tensor>& expert_tokens, const std::optional<at::Tensor>& expert_reads, const at::Tensor& cos,
    const at::Tensor& sin,
    at::Tensor& k_caches, at::Tensor& v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
    at::IntArrayRef latent_dims, double latent_eps, c10::string_view scoring, int64_t top_k, bool renormalize,
    int64_t n_group, int64_t topk_group, double routed_scaling_factor) {
  TORCH_CHECK(k_caches.dim() == 5 && v_caches.dim() == 5 && k_caches.size(0) > 0 &&
                  v_caches.size(0) == k_caches.size(0),
              "decode_layers: the caches must be (layers, num_blocks, block_size, kv_heads, head_dim) both, "
              "for at least one layer");
  const int64_t num_layers = k_caches.size(0);
  TORCH_CHECK(int64_t(weights.size()) == num_layers * kPerLayer, "decode_layers: ", num_layers * kPerLayer,
              " weights (", int64_t(kPerLayer), " a layer, None where absent) for the caches' ", num_layers,
              " layers, got ", weights.size());
  TORCH_CHECK(hidden_in.dim() == 2, "decode_layers: hidden must be (tokens, hidden_size)");
  TORCH_CHECK(scoring == "softmax" || scoring == "sigmoid", "decode_layers: scoring is softmax or sigmoid, not ",
              scoring);
  int64_t num_expert_weights = 0;
  for (int64_t index = 0; index < num_layers; ++index) {
    const Layer layer{weights, index};
    const bool latent = layer.get(kQkvAProj).has_value();
    TORCH_CHECK(latent != layer.get(kQkvProj).has_value(), "decode_layers: layer ", index,
                " needs one attention: a qkv_proj or a qkv_a_proj");
    TORCH_CHECK(!latent || int64_t(latent_dims.size()) == kLatentDims, "decode_layers: layer ", index,
                " has latent attention but latent_dims has ", latent_dims.size(), " sizes, not ", int64_t(kLatentDims));
    TORCH_CHECK(layer.get(kGateUpProj).has_value() == layer.get(kDownProj).has_value(), "decode_layers: layer ",
                index, " has a gate/up weight or a down weight but not both");
    if (const std::optional<at::Tensor> router = layer.get(kRouter)) {
      TORCH_CHECK(router->dim() == 2, "decode_layers: layer ", index, "'s router must be (num_experts, hidden_size)");
      TORCH_CHECK(scoring == "softmax" || layer.get(kRouterBias).has_value(), "decode_layers: layer ", index,
                  " routes by sigmoid scores but has no bias");
      num_expert_weights += 2 * router->size(0);
    } else {
      TORCH_CHECK(layer.get(kGateUpProj).has_value(), "decode_layers: layer ", index,
                  " is dense (no router) but has no MLP weights");
    }
  }
  TORCH_CHECK(int64_t(experts.size()) == num_expert_weights, "decode_layers: the routers name ", num_expert_weights,
              " expert weights (a gate/up and a down per expert), got ", experts.size());
  const Step step{LayerOps::get(), cos, sin, slot_mapping, block_tables, seq_lens, num_heads, num_kv_heads, eps, scale};
  const Routing routing{std::string_view(scoring.data(), scoring.size()), top_k, renormalize, n_group, topk_group,
                        routed_scaling_factor};
  // A graph's padding rows write to the scratch block 0: the tokens per expert count only the others.
  const at::Tensor real = slot_mapping >= k_caches.size(2);
  at::Tensor hidden = hidden_in, normed, summed;
  std::optional<at::Tensor> residual;  // none before the first layer
  int64_t next_expert = 0;
  for (int64_t index = 0; index < num_layers; ++index) {
    const Layer layer{weights, index};
    std::tie(normed, summed) = step.ops.rms_norm.call(hidden, residual, layer[kInputNorm], eps);
    residual = residual.has_value() ? summed : hidden;  // the op returns an empty sum without a residual
    // Latent attention's cache is k alone (its v a view of k's latent columns, never written here).
    at::Tensor k_cache = k_caches.select(0, index), v_cache = v_caches.select(0, index);
    const at::Tensor attn = layer.get(kQkvAProj).has_value()
                                ? latent_attention(step, layer, normed, k_cache, latent_dims, latent_eps)
                                : per_head_attention(step, layer, normed, k_cache, v_cache);
    hidden = panel_linear(step.ops, attn, layer[kOProj]);
    std::tie(normed, summed) = step.ops.rms_norm.call(hidden, residual, layer[kPostAttentionNorm], eps);
    residual = summed;
    if (const std::optional<at::Tensor> router = layer.get(kRouter)) {
      const int64_t num_experts = router->size(0);
      const at::TensorList gate_up = experts.slice(next_expert, num_experts);
      const at::TensorList down = experts.slice(next_expert + num_experts, num_experts);
      next_expert += 2 * num_experts;
      hidden = sparse_mlp(step, layer, normed, gate_up, down, routing, expert_tokens, expert_reads, real);
    } else {
      hidden = gated_mlp(step.ops, normed, layer[kGateUpProj], layer[kDownProj]);
    }
  }
  return {hidden, *residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(graphrt, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor?[] weights, Tensor[] experts, Tensor(c!)? expert_tokens, "
      "Tensor(d!)? expert_reads, Tensor cos, Tensor sin, Tensor(a!) k_caches, Tensor(b!) v_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens, int num_heads, int num_kv_heads, float eps, float scale, int[] latent_dims, float latent_eps, "
      "str scoring, int top_k, bool renormalize, int n_group, int topk_group, float routed_scaling_factor) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("decode_layers", &decode_layers);
}
