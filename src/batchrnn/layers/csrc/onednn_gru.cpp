// One direction of torch's GRU over a padded batch on the CPU, forward and backward, through oneDNN's lbr_gru
// ("linear before reset": n = tanh(W_n x + b_in + r * (U_n h + b_hn)), which is exactly torch's GRU). oneDNN runs
// the whole time loop of a direction in one call, forward and backward, with the weight gradients as large
// GEMMs: what torch does for its LSTM (lstm_mkldnn_stub) and not for its GRU.
//
// Layouts. torch: x (T, N, D); w_ih (3H, D) and w_hh (3H, H) with gates (r, z, n); b_ih, b_hh (3H).
// oneDNN: gates (u, r, n) with u = torch's z; weights {L, D, I, G, O}, here given as ldgoi (torch's row-major
// (G*O, I)); bias {L, D, G + 1, O} = [b_z_ih + b_z_hh, b_r_ih + b_r_hh, b_in, b_hn]. The initial state is 0, as
// the layers use it. float32 only (oneDNN's RNNs have no float64); batchrnn.layers.cpu_gru routes the rest to torch.
#include <torch/extension.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// torch (r, z, n) <-> oneDNN (u, r, n): swapping the first two gate blocks is its own inverse.
torch::Tensor swap_rz(const torch::Tensor& w) {
  auto g = w.view({3, -1});
  return torch::cat({g[1], g[0], g[2]}).view(w.sizes()).contiguous();
}

memory wrap(const memory::desc& md, const torch::Tensor& t) {
  return memory(md, cpu_engine(), t.data_ptr());
}

struct Shapes {
  int64_t T, N, D, H;
  memory::desc src, dst, w_layer, w_iter, bias, w_layer_any, w_iter_any;
  Shapes(int64_t T, int64_t N, int64_t D, int64_t H)
      : T(T), N(N), D(D), H(H),
        src({T, N, D}, dt::f32, tag::tnc), dst({T, N, H}, dt::f32, tag::tnc),
        w_layer({1, 1, D, 3, H}, dt::f32, tag::ldgoi), w_iter({1, 1, H, 3, H}, dt::f32, tag::ldgoi),
        bias({1, 1, 4, H}, dt::f32, tag::ldgo),
        w_layer_any({1, 1, D, 3, H}, dt::f32, tag::any), w_iter_any({1, 1, H, 3, H}, dt::f32, tag::any) {}

  dnnl::lbr_gru_forward::primitive_desc forward_pd(dnnl::prop_kind kind) const {
    return dnnl::lbr_gru_forward::primitive_desc(
        cpu_engine(), kind, dnnl::rnn_direction::unidirectional_left2right, src, memory::desc(), w_layer_any,
        w_iter_any, bias, dst, memory::desc());
  }

  // Through the C API: the C++ one offers no flags, and diff_weights_overwrite spares zeroing the gradients
  // oneDNN would otherwise accumulate into.
  dnnl::lbr_gru_backward::primitive_desc backward_pd(const dnnl::lbr_gru_forward::primitive_desc& hint) const {
    dnnl_primitive_desc_t pd = nullptr;
    memory::desc none;
    dnnl::error::wrap_c_api(
        dnnl_lbr_gru_backward_primitive_desc_create(
            &pd, cpu_engine().get(), dnnl_backward, dnnl_unidirectional_left2right, src.get(), none.get(),
            w_layer_any.get(), w_iter_any.get(), bias.get(), dst.get(), none.get(), src.get(), none.get(),
            w_layer_any.get(), w_iter_any.get(), bias.get(), dst.get(), none.get(),
            dnnl_rnn_flags_diff_weights_overwrite, hint.get(), dnnl::primitive_attr().get()),
        "could not create an lbr_gru backward primitive descriptor");
    return dnnl::lbr_gru_backward::primitive_desc(pd);
  }
};

// A reorder between two layouts, or none where they are the same.
struct Reorder {
  memory::desc from, to;
  std::optional<dnnl::reorder> primitive;
  Reorder(const memory::desc& from, const memory::desc& to) : from(from), to(to) {
    if (from != to) primitive.emplace(dnnl::reorder::primitive_desc(cpu_engine(), from, cpu_engine(), to));
  }
  // t (in `from`'s layout) as `to` wants it: t itself, or a new buffer holding the reordered copy.
  torch::Tensor operator()(const torch::Tensor& t, dnnl::stream& s) const {
    if (!primitive) return t;
    auto out = torch::empty({static_cast<int64_t>(to.get_size() / sizeof(float))}, t.options());
    into(t, out, s);
    return out;
  }
  void into(const torch::Tensor& t, const torch::Tensor& out, dnnl::stream& s) const {
    auto a = wrap(from, t), b = wrap(to, out);
    if (primitive) primitive->execute(s, {{DNNL_ARG_FROM, a}, {DNNL_ARG_TO, b}});
    else out.copy_(t.view(out.sizes()));
  }
};

// A shape's primitives, made once: descriptors and reorders cost a noticeable share of a call at the
// an4_cpu shape. Lengths vary per batch, so the cache holds a few hundred entries.
struct Primitives {
  Shapes sh;
  dnnl::lbr_gru_forward::primitive_desc train_pd, infer_pd;
  dnnl::lbr_gru_backward::primitive_desc backward_pd;
  dnnl::lbr_gru_forward train, infer;
  dnnl::lbr_gru_backward backward;
  Reorder w_layer, w_iter, infer_w_layer, infer_w_iter, bwd_w_layer, bwd_w_iter, dw_layer, dw_iter;
  explicit Primitives(const Shapes& shapes)
      : sh(shapes), train_pd(sh.forward_pd(dnnl::prop_kind::forward_training)),
        infer_pd(sh.forward_pd(dnnl::prop_kind::forward_inference)), backward_pd(sh.backward_pd(train_pd)),
        train(train_pd), infer(infer_pd), backward(backward_pd),
        w_layer(sh.w_layer, train_pd.weights_layer_desc()), w_iter(sh.w_iter, train_pd.weights_iter_desc()),
        infer_w_layer(sh.w_layer, infer_pd.weights_layer_desc()), infer_w_iter(sh.w_iter, infer_pd.weights_iter_desc()),
        bwd_w_layer(sh.w_layer, backward_pd.weights_layer_desc()),
        bwd_w_iter(sh.w_iter, backward_pd.weights_iter_desc()),
        dw_layer(backward_pd.diff_weights_layer_desc(), sh.w_layer),
        dw_iter(backward_pd.diff_weights_iter_desc(), sh.w_iter) {}
};

const Primitives& primitives(int64_t T, int64_t N, int64_t D, int64_t H) {
  static std::mutex lock;
  static std::map<std::array<int64_t, 4>, std::unique_ptr<Primitives>> cache;
  std::array<int64_t, 4> key{T, N, D, H};
  std::lock_guard<std::mutex> guard(lock);
  auto& entry = cache[key];
  if (!entry) entry = std::make_unique<Primitives>(Shapes(key[0], key[1], key[2], key[3]));
  return *entry;
}

torch::Tensor onednn_bias(const torch::Tensor& b_ih, const torch::Tensor& b_hh) {
  auto i = b_ih.view({3, -1}), h = b_hh.view({3, -1});
  return torch::stack({i[1] + h[1], i[0] + h[0], i[2], h[2]}).contiguous();
}

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32,
              "onednn_gru: ", name, " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

}  // namespace

// Returns (y (T, N, H), workspace); the workspace is empty unless training. A given spare workspace (uint8) is
// used when it is large enough: fresh ones of tens of MB each step come from the OS page by page.
std::vector<torch::Tensor> forward(torch::Tensor x, torch::Tensor w_ih, torch::Tensor w_hh, torch::Tensor b_ih,
                                   torch::Tensor b_hh, bool training,
                                   std::optional<torch::Tensor> spare) {
  for (auto& [t, n] : {std::pair{x, "x"}, {w_ih, "w_ih"}, {w_hh, "w_hh"}, {b_ih, "b_ih"}, {b_hh, "b_hh"}}) check(t, n);
  x = x.contiguous();
  const Primitives& p = primitives(x.size(0), x.size(1), x.size(2), w_hh.size(1));
  const Shapes& sh = p.sh;
  const auto& pd = training ? p.train_pd : p.infer_pd;
  dnnl::stream s(cpu_engine());
  auto wl = (training ? p.w_layer : p.infer_w_layer)(swap_rz(w_ih), s);
  auto wi = (training ? p.w_iter : p.infer_w_iter)(swap_rz(w_hh), s);
  auto bias = onednn_bias(b_ih, b_hh);
  auto y = torch::empty({sh.T, sh.N, sh.H}, x.options());
  auto ws_bytes = training ? static_cast<int64_t>(pd.workspace_desc().get_size()) : 0;
  auto ws = spare && spare->numel() >= ws_bytes ? *spare : torch::empty({ws_bytes}, x.options().dtype(torch::kUInt8));
  std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC_LAYER, wrap(sh.src, x)}, {DNNL_ARG_WEIGHTS_LAYER, wrap(pd.weights_layer_desc(), wl)},
      {DNNL_ARG_WEIGHTS_ITER, wrap(pd.weights_iter_desc(), wi)}, {DNNL_ARG_BIAS, wrap(sh.bias, bias)},
      {DNNL_ARG_DST_LAYER, wrap(sh.dst, y)}};
  if (training) args.insert({DNNL_ARG_WORKSPACE, wrap(pd.workspace_desc(), ws)});
  (training ? p.train : p.infer).execute(s, args);
  s.wait();
  return {y, ws};
}

// Returns the gradients of (x, w_ih, w_hh, b_ih, b_hh) in torch's layouts.
std::vector<torch::Tensor> backward(torch::Tensor dy, torch::Tensor x, torch::Tensor w_ih, torch::Tensor w_hh,
                                    torch::Tensor b_ih, torch::Tensor b_hh, torch::Tensor y, torch::Tensor ws) {
  dy = dy.contiguous();
  check(dy, "grad_output");
  const Primitives& p = primitives(x.size(0), x.size(1), x.size(2), w_hh.size(1));
  const Shapes& sh = p.sh;
  const auto& pd = p.backward_pd;
  dnnl::stream s(cpu_engine());
  auto wl = p.bwd_w_layer(swap_rz(w_ih), s), wi = p.bwd_w_iter(swap_rz(w_hh), s);
  auto bias = onednn_bias(b_ih, b_hh);
  auto f32 = x.options();
  auto dx = torch::empty_like(x);
  auto dwl = torch::empty({static_cast<int64_t>(pd.diff_weights_layer_desc().get_size() / sizeof(float))}, f32);
  auto dwi = torch::empty({static_cast<int64_t>(pd.diff_weights_iter_desc().get_size() / sizeof(float))}, f32);
  auto dbias = torch::empty({4, sh.H}, f32);
  p.backward.execute(
      s, {{DNNL_ARG_SRC_LAYER, wrap(sh.src, x)}, {DNNL_ARG_WEIGHTS_LAYER, wrap(pd.weights_layer_desc(), wl)},
          {DNNL_ARG_WEIGHTS_ITER, wrap(pd.weights_iter_desc(), wi)}, {DNNL_ARG_BIAS, wrap(sh.bias, bias)},
          {DNNL_ARG_DST_LAYER, wrap(sh.dst, y)}, {DNNL_ARG_DIFF_DST_LAYER, wrap(sh.dst, dy)},
          {DNNL_ARG_WORKSPACE, wrap(p.train_pd.workspace_desc(), ws)}, {DNNL_ARG_DIFF_SRC_LAYER, wrap(sh.src, dx)},
          {DNNL_ARG_DIFF_WEIGHTS_LAYER, wrap(pd.diff_weights_layer_desc(), dwl)},
          {DNNL_ARG_DIFF_WEIGHTS_ITER, wrap(pd.diff_weights_iter_desc(), dwi)},
          {DNNL_ARG_DIFF_BIAS, wrap(sh.bias, dbias)}});
  // Back to torch's layout and gate order.
  auto dw_ih = torch::empty({3 * sh.H, sh.D}, f32), dw_hh = torch::empty({3 * sh.H, sh.H}, f32);
  p.dw_layer.into(dwl, dw_ih, s);
  p.dw_iter.into(dwi, dw_hh, s);
  s.wait();
  auto db_ih = torch::cat({dbias[1], dbias[0], dbias[2]});
  auto db_hh = torch::cat({dbias[1], dbias[0], dbias[3]});
  return {dx, swap_rz(dw_ih), swap_rz(dw_hh), db_ih, db_hh};
}

// Bytes of the training workspace for x (T, N, D) and hidden size H.
int64_t workspace_bytes(int64_t T, int64_t N, int64_t D, int64_t H) {
  return static_cast<int64_t>(primitives(T, N, D, H).train_pd.workspace_desc().get_size());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("workspace_bytes", &workspace_bytes, "bytes of the training workspace for (T, N, D) and H");
  m.def("forward", &forward, "lbr_gru forward over (T, N, D), h0 = 0");
  m.def("backward", &backward, "lbr_gru backward: grads of x, w_ih, w_hh, b_ih, b_hh");
  m.def("version", [] {
    auto v = dnnl::version();
    return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
  });
}
