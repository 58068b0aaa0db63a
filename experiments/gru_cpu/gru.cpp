// One direction of torch's GRU (gate order r, u, n; linear before reset) over a padded batch, forward and
// backward, with the time loop in C++: per step one GEMM (addmm into a preallocated buffer) and one fused
// gate loop. W x and the weight gradients are single GEMMs over all steps. h0 = 0, as the layers use it.
#include <torch/extension.h>
#include <cmath>

namespace {

template <typename T>
inline T sigmoid(T x) { return T(1) / (T(1) + std::exp(-x)); }

// gi, gh: (N, 3H) rows of this step; hprev, h: (N, H); ws: (N, 4H) holding r, u, n, gh_n for backward.
template <typename T>
void gates_forward(const T* gi, const T* gh, const T* hprev, T* h, T* ws, int64_t n, int64_t hs) {
  for (int64_t b = 0; b < n; ++b) {
    const T* gib = gi + b * 3 * hs;
    const T* ghb = gh + b * 3 * hs;
    const T* hp = hprev + b * hs;
    T* hb = h + b * hs;
    T* wb = ws + b * 4 * hs;
#pragma omp simd
    for (int64_t j = 0; j < hs; ++j) {
      T r = sigmoid(gib[j] + ghb[j]);
      T u = sigmoid(gib[hs + j] + ghb[hs + j]);
      T ghn = ghb[2 * hs + j];
      T nn = std::tanh(gib[2 * hs + j] + r * ghn);
      hb[j] = nn + u * (hp[j] - nn);
      wb[j] = r; wb[hs + j] = u; wb[2 * hs + j] = nn; wb[3 * hs + j] = ghn;
    }
  }
}

// dh: (N, H) the gradient reaching h_t; writes dgi, dgh (N, 3H) of this step and dh_direct = dh * u.
template <typename T>
void gates_backward(const T* dh, const T* hprev, const T* ws, T* dgi, T* dgh, T* dh_direct, int64_t n, int64_t hs) {
  for (int64_t b = 0; b < n; ++b) {
    const T* d = dh + b * hs;
    const T* hp = hprev + b * hs;
    const T* wb = ws + b * 4 * hs;
    T* gi = dgi + b * 3 * hs;
    T* gh = dgh + b * 3 * hs;
    T* dd = dh_direct + b * hs;
#pragma omp simd
    for (int64_t j = 0; j < hs; ++j) {
      T r = wb[j], u = wb[hs + j], nn = wb[2 * hs + j], ghn = wb[3 * hs + j];
      T dan = d[j] * (T(1) - u) * (T(1) - nn * nn);
      T dau = d[j] * (hp[j] - nn) * u * (T(1) - u);
      T dar = dan * ghn * r * (T(1) - r);
      gi[j] = dar; gi[hs + j] = dau; gi[2 * hs + j] = dan;
      gh[j] = dar; gh[hs + j] = dau; gh[2 * hs + j] = dan * r;
      dd[j] = d[j] * u;
    }
  }
}

}  // namespace

// x (T, N, D), w_ih (3H, D), b_ih (3H), w_hh (3H, H), b_hh (3H) -> out (T, N, H), ws (T, N, 4H)
std::vector<torch::Tensor> forward(torch::Tensor x, torch::Tensor w_ih, torch::Tensor b_ih, torch::Tensor w_hh,
                                   torch::Tensor b_hh) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu(), "gru_cpu.forward: x must be a (T, N, D) CPU tensor");
  x = x.contiguous();
  const int64_t steps = x.size(0), n = x.size(1), hs = w_hh.size(1);
  auto gi = at::addmm(b_ih, x.view({steps * n, x.size(2)}), w_ih.t()).view({steps, n, 3 * hs});
  auto out = at::empty({steps, n, hs}, x.options());
  auto ws = at::empty({steps, n, 4 * hs}, x.options());
  auto gh = at::empty({n, 3 * hs}, x.options());
  auto h0 = at::zeros({n, hs}, x.options());
  auto w_hh_t = w_hh.t();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gru_cpu_forward", [&] {
    for (int64_t t = 0; t < steps; ++t) {
      auto hprev = t == 0 ? h0 : out[t - 1];
      at::addmm_out(gh, b_hh, hprev, w_hh_t);
      gates_forward<scalar_t>(gi[t].data_ptr<scalar_t>(), gh.data_ptr<scalar_t>(), hprev.data_ptr<scalar_t>(),
                              out[t].data_ptr<scalar_t>(), ws[t].data_ptr<scalar_t>(), n, hs);
    }
  });
  return {out, ws};
}

// grad_out (T, N, H) -> dx, dw_ih, db_ih, dw_hh, db_hh
std::vector<torch::Tensor> backward(torch::Tensor grad_out, torch::Tensor x, torch::Tensor w_ih, torch::Tensor w_hh,
                                    torch::Tensor out, torch::Tensor ws) {
  grad_out = grad_out.contiguous();
  x = x.contiguous();
  const int64_t steps = x.size(0), n = x.size(1), hs = w_hh.size(1);
  auto dgi = at::empty({steps, n, 3 * hs}, x.options());
  auto dgh = at::empty({steps, n, 3 * hs}, x.options());
  auto dh = at::empty({n, hs}, x.options());
  auto dh_direct = at::empty({n, hs}, x.options());
  auto h0 = at::zeros({n, hs}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gru_cpu_backward", [&] {
    dh.copy_(grad_out[steps - 1]);
    for (int64_t t = steps - 1; t >= 0; --t) {
      auto hprev = t == 0 ? h0 : out[t - 1];
      gates_backward<scalar_t>(dh.data_ptr<scalar_t>(), hprev.data_ptr<scalar_t>(), ws[t].data_ptr<scalar_t>(),
                               dgi[t].data_ptr<scalar_t>(), dgh[t].data_ptr<scalar_t>(),
                               dh_direct.data_ptr<scalar_t>(), n, hs);
      if (t > 0) {  // dh_{t-1} = dh_t * u + dgh_t U + the output's own gradient
        at::addmm_out(dh, dh_direct, dgh[t], w_hh);
        dh.add_(grad_out[t - 1]);
      }
    }
  });
  auto rows = steps * n;
  auto dgi2 = dgi.view({rows, 3 * hs});
  auto dgh2 = dgh.view({rows, 3 * hs});
  auto dx = at::mm(dgi2, w_ih).view({steps, n, x.size(2)});
  auto dw_ih = at::mm(dgi2.t(), x.view({rows, x.size(2)}));
  auto hprev_all = at::cat({h0.unsqueeze(0), out.narrow(0, 0, steps - 1)}, 0).view({rows, hs});
  auto dw_hh = at::mm(dgh2.t(), hprev_all);
  return {dx, dw_ih, dgi2.sum(0), dw_hh, dgh2.sum(0)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "GRU direction forward (CPU)");
  m.def("backward", &backward, "GRU direction backward (CPU)");
}
