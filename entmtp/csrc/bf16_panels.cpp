// bfloat16 linear layers for CPUs with AVX2 + FMA but no bf16 instructions (entmtp.kernels).
//
// There, torch's bf16 matmul for 2..~1000 rows falls back to a scalar-ish loop: a 5-row draft
// tree costs 2.7x and a 9-row one 4.3x a 1-row decode step of SmolLM2-135M, so no tree pays.
// This kernel reads each weight once per call, as bf16, widens it to fp32 in registers (a bf16
// value is the top half of an fp32 one) and multiplies with fp32 accumulation -- the same exact
// products torch's bf16 kernels sum, in another order.
//
// Layout: a weight W [N, K] is repacked once into panels [ceil(N/16), K, 16] of 16 output
// columns each (zero-padded), so the inner loop reads 32 contiguous bytes per k. The 16 slots
// of a k-row are permuted so that unpacklo/unpackhi (which work per 128-bit lane) yield columns
// 0-7 and 8-15 without a shuffle.
//
// Ops (namespace entmtp_cpu):
//   bf16_pack_panels(Tensor w) -> Tensor                                 w [N, K] bf16
//   bf16_panels_linear(Tensor x, Tensor panels, int n, Tensor? bias, bool out_float) -> Tensor
//       x [..., K] bf16 or fp32 -> [..., n] (bf16, or fp32 when out_float: the sums before rounding)
//   bf16_rms_norm(Tensor x, Tensor w, float eps) -> Tensor
//       x [..., H] bf16, w [H] bf16 -> w * bf16(x * rsqrt(mean(x^2) + eps)), in fp32 like
//       transformers' Llama-style RMSNorm, one op instead of eight
//   silu_mul(Tensor gu) -> Tensor
//       gu [..., 2I] fp32 (gate | up) -> silu(gate) * up [..., I] fp32 (a gated MLP's middle)
//
// Decoding a 135M model, each op call costs ~10 us of dispatch on a small VM: the fused ops
// are there to remove calls, not flops.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

constexpr int kCols = 16;
// column j of a panel goes to slot kSlot[j] of each packed k-row (see the layout note above)
constexpr int kSlot[kCols] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

at::Tensor bf16_pack_panels(const at::Tensor& w_) {
  TORCH_CHECK(w_.dim() == 2 && w_.scalar_type() == at::kBFloat16 && w_.device().is_cpu(),
              "bf16_pack_panels: w must be a 2-D bfloat16 CPU tensor");
  const at::Tensor w = w_.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kCols - 1) / kCols;
  at::Tensor out = at::zeros({P, K, kCols}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kCols && p * kCols + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kCols + kSlot[j]] = src[(p * kCols + j) * K + k];
  });
  return out;
}

// one packed k-row (16 bf16) -> columns 0-7 and 8-15 as fp32
inline void widen(const uint16_t* row, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  const __m256i z = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}

// y[m, 0:ncols] = x[m, :] . panel columns, for MB rows of x [MB, K] fp32.
// MB <= 6 keeps 2*MB accumulators + 2 weights + 1 broadcast within AVX2's 16 registers;
// the unroll pragmas keep the accumulators in registers (gcc otherwise spills them every k).
template <int MB>
inline void micro(const float* x, int64_t K, const uint16_t* panel, float* y, int64_t ldy, int ncols) {
  __m256 acc[MB][2];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
    acc[m][0] = _mm256_setzero_ps();
    acc[m][1] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    widen(panel + k * kCols, w0, w1);
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
  if (ncols == kCols) {
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
      _mm256_storeu_ps(y + m * ldy, acc[m][0]);
      _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
    }
  } else {
    alignas(32) float tmp[kCols];
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
      _mm256_store_ps(tmp, acc[m][0]);
      _mm256_store_ps(tmp + 8, acc[m][1]);
      for (int j = 0; j < ncols; ++j) y[m * ldy + j] = tmp[j];
    }
  }
}

at::Tensor bf16_panels_linear(const at::Tensor& x_, const at::Tensor& panels, int64_t n,
                              const c10::optional<at::Tensor>& bias, bool out_float) {
  TORCH_CHECK(x_.dim() >= 1 && (x_.scalar_type() == at::kBFloat16 || x_.scalar_type() == at::kFloat) &&
                  x_.device().is_cpu(),
              "bf16_panels_linear: x must be a bfloat16 or float32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kCols && panels.size(1) == x_.size(-1) &&
                  panels.scalar_type() == at::kBFloat16 && panels.is_contiguous(),
              "bf16_panels_linear: panels must come from bf16_pack_panels for this input width");
  TORCH_CHECK(n > (panels.size(0) - 1) * kCols && n <= panels.size(0) * kCols,
              "bf16_panels_linear: n does not match the panels");
  const at::Tensor x = x_.reshape({-1, x_.size(-1)}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  std::vector<int64_t> out_shape = x_.sizes().vec();
  out_shape.back() = n;
  at::Tensor y = at::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* panel = wp + p * K * kCols;
      const int nc = static_cast<int>(std::min<int64_t>(kCols, n - p * kCols));
      float* yb = yp + p * kCols;
      int64_t m = 0;
      for (; m + 6 <= M; m += 6) micro<6>(xp + m * K, K, panel, yb + m * n, n, nc);
      const float* xr = xp + m * K;
      float* yr = yb + m * n;
      switch (M - m) {
        case 5: micro<5>(xr, K, panel, yr, n, nc); break;
        case 4: micro<4>(xr, K, panel, yr, n, nc); break;
        case 3: micro<3>(xr, K, panel, yr, n, nc); break;
        case 2: micro<2>(xr, K, panel, yr, n, nc); break;
        case 1: micro<1>(xr, K, panel, yr, n, nc); break;
        default: break;
      }
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return (out_float ? y : y.to(at::kBFloat16)).view(out_shape);
}

at::Tensor bf16_rms_norm(const at::Tensor& x_, const at::Tensor& w_, double eps) {
  TORCH_CHECK(x_.dim() >= 1 && x_.scalar_type() == at::kBFloat16 && x_.device().is_cpu(),
              "bf16_rms_norm: x must be a bfloat16 CPU tensor");
  TORCH_CHECK(w_.dim() == 1 && w_.size(0) == x_.size(-1) && w_.scalar_type() == at::kBFloat16,
              "bf16_rms_norm: w must be a bfloat16 vector of x's width");
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  const int64_t H = x.size(-1), M = H ? x.numel() / H : 0;
  at::Tensor y = at::empty_like(x);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const at::BFloat16* xr = xp + m * H;
      float ss = 0.f;
      for (int64_t j = 0; j < H; ++j) {
        const float v = static_cast<float>(xr[j]);
        ss += v * v;
      }
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
      at::BFloat16* yr = yp + m * H;
      for (int64_t j = 0; j < H; ++j) {
        const float normed = static_cast<float>(at::BFloat16(static_cast<float>(xr[j]) * r));
        yr[j] = at::BFloat16(static_cast<float>(wp[j]) * normed);
      }
    }
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& gu_) {
  TORCH_CHECK(gu_.dim() >= 1 && gu_.scalar_type() == at::kFloat && gu_.size(-1) % 2 == 0 && gu_.device().is_cpu(),
              "silu_mul: gu must be a float32 CPU tensor [..., 2I]");
  const at::Tensor gu = gu_.contiguous();
  const int64_t I = gu.size(-1) / 2, M = I ? gu.numel() / (2 * I) : 0;
  std::vector<int64_t> shape = gu.sizes().vec();
  shape.back() = I;
  at::Tensor y = at::empty(shape, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t j = 0; j < I; ++j) {
        const float g = gp[m * 2 * I + j];
        yp[m * I + j] = g / (1.f + std::exp(-g)) * gp[m * 2 * I + I + j];
      }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(entmtp_cpu, m) {
  m.def("bf16_pack_panels(Tensor w) -> Tensor");
  m.def("bf16_panels_linear(Tensor x, Tensor panels, int n, Tensor? bias, bool out_float) -> Tensor");
  m.def("bf16_rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
}

TORCH_LIBRARY_IMPL(entmtp_cpu, CPU, m) {
  m.impl("bf16_pack_panels", &bf16_pack_panels);
  m.impl("bf16_panels_linear", &bf16_panels_linear);
  m.impl("bf16_rms_norm", &bf16_rms_norm);
  m.impl("silu_mul", &silu_mul);
}
