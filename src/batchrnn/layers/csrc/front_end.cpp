// The conv front end's training BatchNorm over valid positions, then Hardtanh(lo, hi) and the padding mask, over
// x (N, C, F, T) and its mask (N, T): batchrnn.layers.folds.MaskedBNHardtanh's stages, each one loop over the tensor
// where torch's operations take a pass each. The sums per channel run in double (for float32 x as for float64), one
// channel at a time, so they do not depend on the thread count. On x86-64 each row loop is compiled for AVX-512, AVX2
// and the baseline, the CPU's best picked when the library loads (target_clones).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace batchrnn_front_end {

#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

// v where keep, else +0: hardtanh_backward's select, as a bitwise and, which gcc vectorises (a select it did not).
// A non-finite v where keep is false gives 0, as the select does.
template <typename S, typename U>
inline S keep_if(bool keep, S v) {
  static_assert(sizeof(S) == sizeof(U), "same width");
  U bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits &= U(0) - U(keep);
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline float keep_if(bool keep, float v) { return keep_if<float, uint32_t>(keep, v); }
inline double keep_if(bool keep, double v) { return keep_if<double, uint64_t>(keep, v); }

#define ROWS(S)                                                                                                       \
  CLONES double row_sum(const S* x, const S* m, int64_t T) {                                                          \
    double acc = 0;                                                                                                   \
    _Pragma("omp simd reduction(+ : acc)") for (int64_t t = 0; t < T; ++t) acc += static_cast<double>(x[t] * m[t]);   \
    return acc;                                                                                                       \
  }                                                                                                                   \
  CLONES double row_centred_square(const S* x, const S* m, S mu, int64_t T) {                                         \
    double acc = 0;                                                                                                   \
    _Pragma("omp simd reduction(+ : acc)") for (int64_t t = 0; t < T; ++t) {                                          \
      const S d = (x[t] - mu) * m[t];                                                                                 \
      acc += static_cast<double>(d * d);                                                                              \
    }                                                                                                                 \
    return acc;                                                                                                       \
  }                                                                                                                   \
  CLONES void row_forward(const S* x, const S* m, S* y, S scale, S shift, S lo, S hi, int64_t T) {                    \
    _Pragma("omp simd") for (int64_t t = 0; t < T; ++t) {                                                             \
      const S v = x[t] * scale + shift;                                                                               \
      y[t] = (v < lo ? lo : (v > hi ? hi : v)) * m[t];                                                                \
    }                                                                                                                 \
  }                                                                                                                   \
  /* g: the gradient reaching BN(x): dy * m where lo < y < hi, else 0 (hardtanh_backward's rule) */                   \
  CLONES void row_backward_sums(const S* dy, const S* y, const S* x, const S* m, S mu, S lo, S hi, int64_t T,         \
                                double& sum_g, double& sum_gc) {                                                      \
    double a = 0, b = 0;                                                                                              \
    _Pragma("omp simd reduction(+ : a, b)") for (int64_t t = 0; t < T; ++t) {                                         \
      const S g = keep_if((y[t] > lo) & (y[t] < hi), dy[t] * m[t]);                                                   \
      a += static_cast<double>(g);                                                                                    \
      b += static_cast<double>(g * ((x[t] - mu) * m[t]));                                                             \
    }                                                                                                                 \
    sum_g += a;                                                                                                       \
    sum_gc += b;                                                                                                      \
  }                                                                                                                   \
  CLONES void row_backward_x(const S* dy, const S* y, const S* x, const S* m, S* dx, S mu, S scale, S on_mask,        \
                             S on_centred, S lo, S hi, int64_t T) {                                                   \
    _Pragma("omp simd") for (int64_t t = 0; t < T; ++t) {                                                             \
      const S g = keep_if((y[t] > lo) & (y[t] < hi), dy[t] * m[t]);                                                   \
      dx[t] = g * scale + m[t] * on_mask + ((x[t] - mu) * m[t]) * on_centred;                                         \
    }                                                                                                                 \
  }
ROWS(float)
ROWS(double)
#undef ROWS
#undef CLONES

struct Shape {
  int64_t N, C, F, T;
  explicit Shape(const torch::Tensor& x) : N(x.size(0)), C(x.size(1)), F(x.size(2)), T(x.size(3)) {}
  int64_t row(int64_t n, int64_t c, int64_t f) const { return ((n * C + c) * F + f) * T; }
};

void check(const torch::Tensor& x, const torch::Tensor& mask, std::initializer_list<torch::Tensor> like_x,
           std::initializer_list<torch::Tensor> per_channel) {
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous() && x.device().is_cpu() &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble),
              "x: a contiguous float32 or float64 CPU tensor (N, C, F, T)");
  TORCH_CHECK(mask.dim() == 2 && mask.is_contiguous() && mask.size(0) == x.size(0) && mask.size(1) == x.size(3) &&
                  mask.scalar_type() == x.scalar_type(), "mask: contiguous (N, T), x's dtype");
  for (const auto& t : like_x)
    TORCH_CHECK(t.sizes() == x.sizes() && t.is_contiguous() && t.scalar_type() == x.scalar_type(),
                "every (N, C, F, T) operand contiguous, x's shape and dtype");
  int64_t i = 0;
  for (const auto& t : per_channel) {
    TORCH_CHECK(t.dim() == 1 && t.numel() == x.size(1) && t.is_contiguous() && t.scalar_type() == x.scalar_type(),
                "every per-channel operand contiguous (C,), x's dtype; per-channel operand ", i, " is not (sizes ",
                t.sizes(), ", strides ", t.strides(), ", ", t.scalar_type(), ")");
    ++i;
  }
}

// For each channel, K sums over its rows (n, f), each row adding to them through row(offset, n, c, acc), in double
// (kept so until the ranks' sums are summed): the channels split over torch's threads.
template <int K, typename Row>
std::vector<torch::Tensor> per_channel(const torch::Tensor& x, Row row) {
  const Shape s(x);
  std::vector<torch::Tensor> out;
  std::vector<double*> o;
  for (int k = 0; k < K; ++k) {
    out.push_back(torch::empty({s.C}, x.options().dtype(torch::kDouble)));
    o.push_back(out.back().data_ptr<double>());
  }
  at::parallel_for(0, s.C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      double acc[K] = {};
      for (int64_t n = 0; n < s.N; ++n)
        for (int64_t f = 0; f < s.F; ++f) row(s.row(n, c, f), n, c, acc);
      for (int k = 0; k < K; ++k) o[k][c] = acc[k];
    }
  });
  return out;
}

// Each row of each channel through row(offset, n, c), the channels split over torch's threads.
template <typename Row>
void each_row(const torch::Tensor& x, Row row) {
  const Shape s(x);
  at::parallel_for(0, s.C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      for (int64_t n = 0; n < s.N; ++n)
        for (int64_t f = 0; f < s.F; ++f) row(s.row(n, c, f), n, c);
  });
}

// The sum over valid positions of each channel: sum of x * mask (double).
torch::Tensor masked_sums(const torch::Tensor& x, const torch::Tensor& mask) {
  check(x, mask, {}, {});
  return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "masked_sums", [&] {
    const scalar_t *px = x.data_ptr<scalar_t>(), *pm = mask.data_ptr<scalar_t>();
    const int64_t T = x.size(3);
    return per_channel<1>(x, [&](int64_t o, int64_t n, int64_t, double* acc) {
      acc[0] += row_sum(px + o, pm + n * T, T);
    })[0];
  });
}

// The sum over valid positions of each channel's ((x - mean) * mask)^2 (double).
torch::Tensor centred_square_sums(const torch::Tensor& x, const torch::Tensor& mask, const torch::Tensor& mean) {
  check(x, mask, {}, {mean});
  return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "centred_square_sums", [&] {
    const scalar_t *px = x.data_ptr<scalar_t>(), *pm = mask.data_ptr<scalar_t>();
    const scalar_t* pmu = mean.data_ptr<scalar_t>();
    const int64_t T = x.size(3);
    return per_channel<1>(x, [&](int64_t o, int64_t n, int64_t c, double* acc) {
      acc[0] += row_centred_square(px + o, pm + n * T, pmu[c], T);
    })[0];
  });
}

// Hardtanh(lo, hi) of x * scale + shift, times the mask.
torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask, const torch::Tensor& scale,
                      const torch::Tensor& shift, double lo, double hi) {
  check(x, mask, {}, {scale, shift});
  auto y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "masked_bn_hardtanh", [&] {
    const scalar_t *px = x.data_ptr<scalar_t>(), *pm = mask.data_ptr<scalar_t>();
    const scalar_t *ps = scale.data_ptr<scalar_t>(), *pb = shift.data_ptr<scalar_t>();
    scalar_t* py = y.data_ptr<scalar_t>();
    const int64_t T = x.size(3);
    each_row(x, [&](int64_t o, int64_t n, int64_t c) {
      row_forward(px + o, pm + n * T, py + o, ps[c], pb[c], scalar_t(lo), scalar_t(hi), T);
    });
  });
  return y;
}

// Per channel, the sums of g and of g * (x - mean) * mask over valid positions, g = dy where lo < y < hi (double).
std::vector<torch::Tensor> backward_sums(const torch::Tensor& dy, const torch::Tensor& y, const torch::Tensor& x,
                                         const torch::Tensor& mask, const torch::Tensor& mean, double lo, double hi) {
  check(x, mask, {dy, y}, {mean});
  return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "masked_bn_hardtanh_backward_sums", [&] {
    const scalar_t *pd = dy.data_ptr<scalar_t>(), *py = y.data_ptr<scalar_t>(), *px = x.data_ptr<scalar_t>();
    const scalar_t *pm = mask.data_ptr<scalar_t>(), *pmu = mean.data_ptr<scalar_t>();
    const int64_t T = x.size(3);
    return per_channel<2>(x, [&](int64_t o, int64_t n, int64_t c, double* acc) {
      row_backward_sums(pd + o, py + o, px + o, pm + n * T, pmu[c], scalar_t(lo), scalar_t(hi), T, acc[0], acc[1]);
    });
  });
}

// x's gradient: g * scale + mask * on_mask + (x - mean) * mask * on_centred, per channel coefficients.
torch::Tensor backward_x(const torch::Tensor& dy, const torch::Tensor& y, const torch::Tensor& x,
                         const torch::Tensor& mask, const torch::Tensor& mean, const torch::Tensor& scale,
                         const torch::Tensor& on_mask, const torch::Tensor& on_centred, double lo, double hi) {
  check(x, mask, {dy, y}, {mean, scale, on_mask, on_centred});
  auto dx = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "masked_bn_hardtanh_backward_x", [&] {
    const scalar_t *pd = dy.data_ptr<scalar_t>(), *py = y.data_ptr<scalar_t>(), *px = x.data_ptr<scalar_t>();
    const scalar_t* pm = mask.data_ptr<scalar_t>();
    const scalar_t *pmu = mean.data_ptr<scalar_t>(), *ps = scale.data_ptr<scalar_t>();
    const scalar_t *pa = on_mask.data_ptr<scalar_t>(), *pb = on_centred.data_ptr<scalar_t>();
    scalar_t* pdx = dx.data_ptr<scalar_t>();
    const int64_t T = x.size(3);
    each_row(x, [&](int64_t o, int64_t n, int64_t c) {
      row_backward_x(pd + o, py + o, px + o, pm + n * T, pdx + o, pmu[c], ps[c], pa[c], pb[c], scalar_t(lo),
                     scalar_t(hi), T);
    });
  });
  return dx;
}

}  // namespace batchrnn_front_end

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace k = batchrnn_front_end;
  m.def("masked_sums", &k::masked_sums);
  m.def("centred_square_sums", &k::centred_square_sums);
  m.def("forward", &k::forward);
  m.def("backward_sums", &k::backward_sums);
  m.def("backward_x", &k::backward_x);
}
