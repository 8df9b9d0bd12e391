// The CPU ops' one translation unit (built by kernels/cpu_ops.py): the captured decode step
// (StepLinear, DecodeStep) and the Python bindings of all the ops, whose kernels are in
// attention.h (decode attention) and rms_norm.h (the residual add fused with RMSNorm).
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>

#include "amx_matmul.h"
#include "attention.h"
#include "elementwise.h"
#include "q8_matmul.h"
#include "quant_matmul.h"
#include "rms_norm.h"

#include <memory>
#include <string>
#include <vector>

// The whole decode step of a LLaMA model in one call: the same ops, in the same order and
// dtypes, as DecoderModel.forward (plugins/models/decoder.py) runs them from Python for a
// pure decode batch, so the output is bit-identical; what goes is Python's ~10 us per op
// (about 250 ops a step). Qwen2's q/k/v bias and Qwen3's per-head q/k RMSNorm are mirrored
// too (DecodeStep::project_qkv), by the very ATen ops DecoderLayer.attend calls.

// The current step's rows per adapter (core/weights.py LowRankStep, mirrored): set before a
// step whose rows run under low-rank adapters, cleared after it. Shared by every matmul.
struct LoraStep {
  enum Mode : int64_t { GATHER = 0, SINGLE = 1, BLOCKS = 2 };
  bool active = false;
  int64_t mode = GATHER;
  bool all = false;       // every resident slot present, in order: no index_select of the buffers
  at::Tensor slots;       // [n] resident slot of each adapter present (SINGLE: its one slot)
  at::Tensor gather;      // GATHER: [n * width] rows, padded with T (the zero row)
  at::Tensor scatter;     // GATHER: [n * width] rows to add into (pads: row 0, adding zeros)
  int64_t n = 0, width = 0, start = 0, slot = 0;

  void set(int64_t mode_, bool all_slots, at::Tensor s, at::Tensor g, at::Tensor sc, int64_t n_, int64_t width_,
           int64_t start_, int64_t slot_) {
    mode = mode_; all = all_slots; slots = std::move(s); gather = std::move(g); scatter = std::move(sc);
    n = n_; width = width_; start = start_; slot = slot_; active = true;
  }
  void clear() { active = false; }
};

// One matmul as the backend packed it (backends/torch_linear.py), mirrored kind by kind.
struct StepLinear {
  enum Kind : int64_t { DENSE = 0, INT4 = 1, INT8 = 2, FP32_PACKED = 3, QMM4 = 4, QMM8 = 8, AMX4 = 14, AMX8 = 18, Q8W4 = 24, Q8W8 = 28 };
  int64_t kind;
  at::Tensor a, b;  // DENSE: weight; INT4: packed, scales_zeros; INT8: weight, scales;
                    // FP32_PACKED: [in, out] copy for MKL (or undefined), oneDNN-packed (or undefined);
                    // QMM4 / QMM8, AMX4 / AMX8: quant_matmul's codes and scales; Q8W4 / Q8W8: q8_matmul's
  int64_t group;     // the group size of INT4, QMM4 / QMM8, AMX4 / AMX8, Q8W4 / Q8W8 (0 for dense kinds)
  int64_t max_rows;  // quantised: their kernel up to this many rows, `dense` above; FP32: MKL up to, oneDNN above
  std::shared_ptr<StepLinear> dense;

  StepLinear(int64_t kind, at::Tensor a, at::Tensor b, int64_t group, int64_t max_rows,
             std::shared_ptr<StepLinear> dense)
      : kind(kind), a(std::move(a)), b(std::move(b)), group(group), max_rows(max_rows), dense(std::move(dense)) {
    if (this->a.numel() == 0) this->a = at::Tensor();  // an empty tensor from Python: "absent"
    if (this->b.numel() == 0) this->b = at::Tensor();
  }

  // low-rank updates (plugins/adapters/lora.py's LoraLinear, the same ops): A [slots, in, R],
  // B [slots, R, out] (scale folded in), and the shared step state; absent without adapters
  at::Tensor lora_a, lora_b;
  std::shared_ptr<LoraStep> lora;
  bool lora_used = false;  // some resident adapter updates this matmul (else its buffers are zeros)

  void set_lora(at::Tensor a, at::Tensor b, std::shared_ptr<LoraStep> step) {
    lora_a = std::move(a); lora_b = std::move(b); lora = std::move(step);
  }
  void set_lora_used(bool used) { lora_used = used; }

  // floor: the step's row count up to which a quantised kind keeps its kernel whatever
  // max_rows (one sequence's rows: backends/torch_linear.py StepRows)
  at::Tensor apply(const at::Tensor& x, int64_t floor = 0) const {
    at::Tensor y = apply_base(x, floor);
    if (lora && lora_used && lora->active) add_lora(x, y);
    return y;
  }

  // the same ops as plugins/adapters/lora.py LoraLinear.apply, mode by mode
  void add_lora(const at::Tensor& x, at::Tensor& y) const {
    const LoraStep& st = *lora;
    if (st.mode == LoraStep::SINGLE) {  // one adapter, rows [start, start + width)
      const at::Tensor xs = x.narrow(0, st.start, st.width);
      at::Tensor ys = y.narrow(0, st.start, st.width);
      ys.add_(at::mm(at::mm(xs, lora_a.select(0, st.slot)), lora_b.select(0, st.slot)).to(y.scalar_type()));
      return;
    }
    const at::Tensor a = st.all ? lora_a : lora_a.index_select(0, st.slots);
    const at::Tensor b = st.all ? lora_b : lora_b.index_select(0, st.slots);
    if (st.mode == LoraStep::BLOCKS) {  // n adapters, width rows each, one after another from start
      const at::Tensor xs = x.narrow(0, st.start, st.n * st.width).view({st.n, st.width, x.size(1)});
      at::Tensor ys = y.narrow(0, st.start, st.n * st.width).view({st.n, st.width, y.size(1)});
      ys.add_(at::bmm(at::bmm(xs, a), b).to(y.scalar_type()));
      return;
    }
    const at::Tensor xz = at::cat({x, x.new_zeros({1, x.size(1)})});
    const at::Tensor u = at::bmm(xz.index_select(0, st.gather).view({st.n, st.width, x.size(1)}), a);
    const at::Tensor d = at::bmm(u, b);
    y.index_add_(0, st.scatter, d.view({-1, d.size(2)}).to(y.scalar_type()));
  }

  at::Tensor apply_base(const at::Tensor& x, int64_t floor) const {
    const int64_t rows = x.size(0);
    if (kind == DENSE) return at::linear(x, a);
    if (kind == Q8W4 || kind == Q8W8) return q8_matmul(x, a, b, kind - 20, group);
    if (kind == FP32_PACKED) {
      if (!b.defined() || (a.defined() && rows <= max_rows)) return at::mm(x, a);
      return onednn_linear(x, b);
    }
    if (dense && rows > max_rows && rows > floor) return dense->apply(x);
    if (kind == QMM4 || kind == QMM8) return quant_matmul(x, a, b, kind, group);
    if (kind == AMX4 || kind == AMX8) return amx_matmul(x, a, b, kind - 10, group);
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const at::Tensor xb = bf16 ? x : x.to(at::kBFloat16);
    at::Tensor y = kind == INT4 ? at::_weight_int4pack_mm_for_cpu(xb, a, group, b) : at::_weight_int8pack_mm(xb, a, b);
    return bf16 ? y : y.to(x.scalar_type());
  }

  static at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, w, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                            std::string("")};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
};

struct DecodeStep {
  at::Tensor embed, cos, sin;  // embed [V, d] in the model dtype; cos, sin [max_len, D] float32
  std::vector<at::Tensor> input_norm, post_norm;
  std::vector<std::shared_ptr<StepLinear>> qkv, o, gate_up, down;
  // per layer, absent (nullopt) where the model has none: the q/k/v bias [q + 2 kv] in the
  // model dtype; the per-head q and k RMSNorm weights [head_dim] float32 (both or neither)
  std::vector<c10::optional<at::Tensor>> qkv_bias, q_norm, k_norm;
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  at::ScalarType dtype;
  std::vector<at::Tensor> k_caches, v_caches;
  std::vector<c10::optional<at::Tensor>> k_scales, v_scales;  // per layer: an 8-bit pool's scales, or none

  DecodeStep(at::Tensor embed, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> input_norm,
             std::vector<at::Tensor> post_norm, std::vector<std::shared_ptr<StepLinear>> qkv,
             std::vector<std::shared_ptr<StepLinear>> o, std::vector<std::shared_ptr<StepLinear>> gate_up,
             std::vector<std::shared_ptr<StepLinear>> down, std::vector<c10::optional<at::Tensor>> qkv_bias,
             std::vector<c10::optional<at::Tensor>> q_norm, std::vector<c10::optional<at::Tensor>> k_norm,
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
             at::ScalarType dtype)
      : embed(std::move(embed)), cos(std::move(cos)), sin(std::move(sin)), input_norm(std::move(input_norm)),
        post_norm(std::move(post_norm)), qkv(std::move(qkv)), o(std::move(o)), gate_up(std::move(gate_up)),
        down(std::move(down)), qkv_bias(std::move(qkv_bias)), q_norm(std::move(q_norm)), k_norm(std::move(k_norm)),
        num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), eps(eps), scale(scale), dtype(dtype) {
    const size_t n = this->input_norm.size();
    TORCH_CHECK(this->post_norm.size() == n && this->qkv.size() == n && this->o.size() == n &&
                this->gate_up.size() == n && this->down.size() == n && this->qkv_bias.size() == n &&
                this->q_norm.size() == n && this->k_norm.size() == n, "one of each weight per layer");
    const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
    for (size_t l = 0; l < n; ++l) {
      const auto& b = this->qkv_bias[l];
      TORCH_CHECK(!b || (b->dim() == 1 && b->size(0) == width), "qkv_bias: [(heads + 2 kv_heads) head_dim]");
      TORCH_CHECK(this->q_norm[l].has_value() == this->k_norm[l].has_value(), "q_norm and k_norm: both or neither");
      for (const auto* w : {&this->q_norm[l], &this->k_norm[l]})
        TORCH_CHECK(!*w || ((*w)->dim() == 1 && (*w)->size(0) == head_dim), "q_norm, k_norm: [head_dim]");
    }
  }

  // The KV pools, one K and V per layer: plain (in the model dtype) with no scales, or 8-bit
  // (int8 / float8_e4m3fn) with one bfloat16 scale tensor [KVH, NB, BS] each.
  void bind(std::vector<at::Tensor> k, std::vector<at::Tensor> v, std::vector<at::Tensor> ks,
            std::vector<at::Tensor> vs) {
    const size_t n = input_norm.size();
    TORCH_CHECK(k.size() == n && v.size() == n, "one K and V pool per layer");
    TORCH_CHECK((ks.empty() && vs.empty()) || (ks.size() == n && vs.size() == n), "scales: none, or one per pool");
    k_caches = std::move(k);
    v_caches = std::move(v);
    k_scales.assign(n, c10::nullopt);
    v_scales.assign(n, c10::nullopt);
    for (size_t l = 0; l < ks.size(); ++l) {
      k_scales[l] = ks[l];
      v_scales[l] = vs[l];
    }
  }

  // Layer l's fused q/k/v of the normed input x [T, d], as DecoderLayer.attend makes it before
  // the fused attention: the projection; + the bias (in the model dtype); each head of q and k
  // RMS-normed in float32 (x.float() then F.rms_norm: at::rms_norm, the op itself, so the
  // rounding is its own), concatenated with v in float32 and cast back to the model dtype.
  at::Tensor project_qkv(size_t l, const at::Tensor& x, int64_t floor) const {
    at::Tensor out = qkv[l]->apply(x, floor);
    if (qkv_bias[l]) out = at::add(out, *qkv_bias[l]);
    if (q_norm[l]) {
      const int64_t T = out.size(0), q = num_heads * head_dim, kv = num_kv_heads * head_dim;
      const auto parts = out.split_with_sizes({q, kv, kv}, -1);
      const at::Tensor qn = at::rms_norm(parts[0].reshape({T, num_heads, head_dim}).to(at::kFloat), {head_dim},
                                         *q_norm[l], eps);
      const at::Tensor kn = at::rms_norm(parts[1].reshape({T, num_kv_heads, head_dim}).to(at::kFloat), {head_dim},
                                         *k_norm[l], eps);
      out = at::cat({qn.reshape({T, -1}), kn.reshape({T, -1}), parts[2].to(at::kFloat)}, -1).to(dtype);
    }
    return out;
  }

  // ids, positions, slots [B] int64; tables [B, MB]; lens [B] -> hidden [B, d] float32 (before the final norm)
  // floor: StepLinear::apply's (the rows of one sequence keep the quantised kernels)
  at::Tensor run(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& slots,
                 const at::Tensor& tables, const at::Tensor& lens, int64_t floor) {
    TORCH_CHECK(!k_caches.empty(), "bind the KV pools first");
    c10::InferenceMode inference;
    RECORD_FUNCTION("tokenloom::decode_step", std::vector<c10::IValue>());  // its self time: the glue between ops
    // (index_select: the rows Python's embed[ids] gives, without advanced indexing's set-up)
    at::Tensor h = embed.index_select(0, ids).to(at::kFloat);
    const at::Tensor c = cos.index_select(0, positions), s = sin.index_select(0, positions);
    c10::optional<at::Tensor> delta;
    for (size_t l = 0; l < input_norm.size(); ++l) {
      at::Tensor x = add_rms_norm(h, delta, input_norm[l], eps, dtype);
      const at::Tensor attn = decode_layer_attention(project_qkv(l, x, floor), c, s, k_caches[l], v_caches[l], slots,
                                                     tables, lens, num_heads, scale, k_scales[l], v_scales[l]);
      x = add_rms_norm(h, o[l]->apply(attn, floor), post_norm[l], eps, dtype);
      const auto gu = gate_up[l]->apply(x, floor).chunk(2, -1);
      delta = down[l]->apply(at::mul(at::silu(gu[0]), gu[1]), floor);
    }
    return at::add(h, *delta);
  }
};

// Which hand-vectorised paths this build has ("avx512", else "generic": what the compiler makes of the plain loops).
std::string simd_path() {
#if defined(__AVX512F__)
  return "avx512";
#else
  return "generic";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("simd_path", &simd_path);
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("decode_layer_attention", &decode_layer_attention, py::arg("qkv"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("num_heads"), py::arg("scale"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("add_rms_norm", &add_rms_norm);
  m.def("slot_attention", &slot_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_rows"), py::arg("q_row"), py::arg("q_len"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("silu_mul", &silu_mul);
  m.def("rope_rows", &rope_rows);
  m.def("argmax_rows", &argmax_rows);
  m.def("amx_ready", &amx::ready);
  m.def("amx_matmul", &amx_matmul, py::arg("x"), py::arg("codes"), py::arg("sm"), py::arg("bits"), py::arg("group"),
        py::arg("float_out") = false);
  m.def("q8_ready", &q8::ready);
  m.def("q8_matmul", &q8_matmul, py::arg("x"), py::arg("codes"), py::arg("sm"), py::arg("bits"),
        py::arg("group"));
  m.def("quant_matmul", &quant_matmul, py::arg("x"), py::arg("codes"), py::arg("sm"), py::arg("bits"),
        py::arg("group"));
  py::class_<LoraStep, std::shared_ptr<LoraStep>>(m, "LoraStep")
      .def(py::init<>())
      .def("set", &LoraStep::set)
      .def("clear", &LoraStep::clear);
  py::class_<StepLinear, std::shared_ptr<StepLinear>>(m, "StepLinear")
      .def(py::init<int64_t, at::Tensor, at::Tensor, int64_t, int64_t, std::shared_ptr<StepLinear>>())
      .def("set_lora", &StepLinear::set_lora)
      .def("set_lora_used", &StepLinear::set_lora_used);
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<std::shared_ptr<StepLinear>>, std::vector<std::shared_ptr<StepLinear>>,
                    std::vector<std::shared_ptr<StepLinear>>, std::vector<std::shared_ptr<StepLinear>>,
                    std::vector<c10::optional<at::Tensor>>, std::vector<c10::optional<at::Tensor>>,
                    std::vector<c10::optional<at::Tensor>>, int64_t, int64_t, int64_t, double, double,
                    at::ScalarType>())
      .def("bind", &DecodeStep::bind)
      .def("run", &DecodeStep::run, py::arg("ids"), py::arg("positions"), py::arg("slots"), py::arg("tables"),
           py::arg("lens"), py::arg("floor") = 0, py::call_guard<py::gil_scoped_release>());
}
