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
// 0-7 and 8-15 without a shuffle. On a CPU with AVX-512 a weight may instead be packed into
// 32-column panels [ceil(N/32), K, 32] in natural order (one 64-byte line per k-row), read by
// `micro_wide`: the same fp32 FMA chain per output column, so the same bits, in half the
// instructions (a tree's extra rows cost arithmetic, not weight reads).
//
// Ops (namespace entmtp_cpu):
//   bf16_pack_panels(Tensor w, int cols=16, bool pairs=False, bool tiles=False) -> Tensor  w [N, K] bf16;
//       cols 16 or 32 (AVX-512); pairs: 32 columns in k-pairs for AVX512-BF16's vdpbf16ps; tiles: the
//       k-pair panels as AMX tiles [P, K2p/16, 16, 64]
//   bf16_panels_linear(Tensor x, Tensor panels, int n, Tensor? bias, bool out_float) -> Tensor
//       x [..., K] bf16 or fp32 -> [..., n] (bf16, or fp32 when out_float: the sums before rounding)
//   f32_pack_panels(Tensor w, int cols=16) -> Tensor  w [N, K] fp32 -> panels [ceil(N/cols), K, cols]
//       (natural column order; cols 16 for AVX2, 32 for AVX-512)
//   f32_panels_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor
//       x [..., K] fp32 -> [..., n] fp32: a float32 model's linears, each output column one chain
//       of fp32 FMAs over k in order (the same bits for any row count and either panel width)
//   i8_pack_panels(Tensor w, int cols=16) -> Tensor  w [N, K] int8 -> panels [ceil(N/cols), K, cols]
//   i8_panels_linear(Tensor x, Tensor panels, Tensor scales, int n) -> Tensor
//       x [..., K] bf16 or fp32 -> [..., n] fp32: (x . int8 panel columns) * scales, for drafting
//       (a draft head's lm_head slice at one byte a weight)
//   bf16_rms_norm(Tensor x, Tensor w, float eps) -> Tensor
//       x [..., H] bf16, w [H] bf16 -> w * bf16(x * rsqrt(mean(x^2) + eps)), in fp32 like
//       transformers' Llama-style RMSNorm, one op instead of eight
//   silu_mul(Tensor gu) -> Tensor
//       gu [..., 2I] fp32 (gate | up) -> silu(gate) * up [..., I] fp32 (a gated MLP's middle)
//   rope_split(Tensor qkv, Tensor cos, Tensor sin, int H, int Hkv) -> Tensor[]
//       qkv [B, q, (H + 2 Hkv) d] fp32 (one q|k|v projection), cos/sin [B, q, d] -> q [B, H, q, d],
//       k and v [B, Hkv, q, d] fp32, the rotary embedding applied to q and k in fp32
//   attend(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale) -> Tensor
//       fp32 attention, q [B, H, Q, D], k/v [B, Hkv, L, D] -> [B, Q, H, D], each row's result
//       independent of the rest of the call (see the note above the function)
//   keep_rows(Tensor[] caches, int[] src, int dst) -> ()
//       in place, in every cache tensor [B, heads, L, D]: rows src[i] of dim 2 (ascending, src[i] >= dst + i)
//       moved to dst + i -- the accepted tree path's keys and values, all layers in one call
//
// Decoding a 135M model, each op call costs ~10 us of dispatch on a small VM: the fused ops
// are there to remove calls, not flops.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int kCols = 16;
constexpr int kWideCols = 32;  // AVX-512 panels: one 64-byte line per k-row, two zmm of fp32
constexpr int kPrefetchBytes = 2048;  // 64 k-rows ahead (measured best of 1-2 KB on a Zen 3 VM)
// column j of a panel goes to slot kSlot[j] of each packed k-row (see the layout note above)
constexpr int kSlot[kCols] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

at::Tensor pack_pairs(const at::Tensor& w);
at::Tensor pack_tiles(const at::Tensor& w);

// W [N, K] (contiguous, elements stored as T) -> panels [ceil(N/cols), K, cols], zero-padded; column j
// of a panel goes to slot slot(j) of each k-row
template <typename T, typename Slot>
at::Tensor pack_columns(const at::Tensor& w, int64_t cols, Slot slot) {
  const int64_t N = w.size(0), K = w.size(1), P = (N + cols - 1) / cols;
  at::Tensor out = at::zeros({P, K, cols}, w.options());
  const T* src = static_cast<const T*>(w.data_ptr());
  T* dst = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < cols && p * cols + j < N; ++j) {
        const int64_t to = slot(j);
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * cols + to] = src[(p * cols + j) * K + k];
      }
  });
  return out;
}

at::Tensor bf16_pack_panels(const at::Tensor& w_, int64_t cols, bool pairs, bool tiles) {
  TORCH_CHECK(w_.dim() == 2 && w_.scalar_type() == at::kBFloat16 && w_.device().is_cpu(),
              "bf16_pack_panels: w must be a 2-D bfloat16 CPU tensor");
  TORCH_CHECK(cols == kCols || cols == kWideCols, "bf16_pack_panels: cols must be 16 (AVX2) or 32 (AVX-512)");
  TORCH_CHECK(!pairs || cols == kWideCols, "bf16_pack_panels: k-pair panels have 32 columns");
  TORCH_CHECK(!tiles || pairs, "bf16_pack_panels: AMX tiles are k-pair panels");
  if (tiles) return pack_tiles(w_.contiguous());
  if (pairs) return pack_pairs(w_.contiguous());
  // 16 columns permuted for the unpack widening; wide panels in natural order
  return pack_columns<uint16_t>(w_.contiguous(), cols, [cols](int64_t j) -> int64_t { return cols == kCols ? kSlot[j] : j; });
}

// 8 fp32 -> 8 bf16, rounded to nearest even as at::BFloat16(float) rounds (NaN -> 0x7FC0)
inline __m128i bf16_round8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// 8 bf16 -> 8 fp32 (exact)
inline __m256 bf16_widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// y [M, n] fp32 -> bf16 in one pass, the same bits as y.to(bfloat16) for every non-NaN value
// (aten's conversion is a separate op: an allocation and a dispatch a linear, ~5 us at 8 rows)
at::Tensor round_bf16(const at::Tensor& y) {
  at::Tensor out = at::empty(y.sizes(), y.options().dtype(at::kBFloat16));
  const float* src = y.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, y.numel(), 65536, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bf16_round8(_mm256_loadu_ps(src + i)));
    for (; i < i1; ++i) dst[i] = at::BFloat16(src[i]).x;
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

// one fp32 k-row of a 16-column float32 panel (natural order) -> columns 0-7 and 8-15
inline void widen(const float* row, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(row);
  hi = _mm256_loadu_ps(row + 8);
}

// one k-row of a 16-column int8 panel (natural order) -> columns 0-7 and 8-15 as fp32 (exact)
inline void widen(const int8_t* row, __m256& lo, __m256& hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

// Weights stream from DRAM once per call; the hardware prefetcher alone leaves the micro-kernels
// waiting on them (a 4-6 row product of the lm_head took 1.3-1.6x a 1-row one, 1.0-1.1x with
// this). One prefetch per 64-byte line of k-row k of a C-column panel of T, kPrefetchBytes of bf16
// ahead (twice that of fp32: the same k-rows ahead) -- past a panel's end that is the next panel,
// which this thread reads next; a prefetch never faults.
template <typename T, int C>
inline void prefetch_row(const T* panel, int64_t k) {
  constexpr int64_t kRow = sizeof(T) * C;
  const char* ahead = reinterpret_cast<const char*>(panel + k * C) + kPrefetchBytes * sizeof(T) / 2;
  if constexpr (kRow < 64) {
    if ((k * kRow) % 64 == 0) _mm_prefetch(ahead, _MM_HINT_T0);
  } else {
    for (int64_t b = 0; b < kRow; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
  }
}

// y[m, 0:ncols] = x[m, :] . panel columns, for MB rows of x [MB, K] fp32; the panel holds bf16
// (widened in registers) or fp32 weights, 16 columns. Each output column is one chain of fp32
// FMAs over k in order. MB <= 6 keeps 2*MB accumulators + 2 weights + 1 broadcast within AVX2's
// 16 registers; the unroll pragmas keep the accumulators in registers (gcc otherwise spills them
// every k).
template <int MB, typename T>
inline void micro(const float* x, int64_t K, const T* panel, float* y, int64_t ldy, int ncols) {
  __m256 acc[MB][2];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
    acc[m][0] = _mm256_setzero_ps();
    acc[m][1] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    prefetch_row<T, kCols>(panel, k);
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

// y[m, 0:ncols] = the 32 accumulated columns of each of MB rows (a panel's tail keeps only ncols)
template <int MB>
__attribute__((target("avx512f"))) inline void store_wide(const __m512 (&acc)[MB][2], float* y, int64_t ldy, int ncols) {
  if (ncols == kWideCols) {
    _Pragma("GCC unroll 12") for (int m = 0; m < MB; ++m) {
      _mm512_storeu_ps(y + m * ldy, acc[m][0]);
      _mm512_storeu_ps(y + m * ldy + 16, acc[m][1]);
    }
  } else {
    alignas(64) float tmp[kWideCols];
    _Pragma("GCC unroll 12") for (int m = 0; m < MB; ++m) {
      _mm512_store_ps(tmp, acc[m][0]);
      _mm512_store_ps(tmp + 16, acc[m][1]);
      for (int j = 0; j < ncols; ++j) y[m * ldy + j] = tmp[j];
    }
  }
}

// one k-row of a 32-column panel (natural order) -> columns 0-15 and 16-31 as fp32
__attribute__((target("avx512f"))) inline void widen_wide(const uint16_t* row, __m512& lo, __m512& hi) {
  const __m512i v0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
  const __m512i v1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16)));
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
  hi = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
}

__attribute__((target("avx512f"))) inline void widen_wide(const float* row, __m512& lo, __m512& hi) {
  lo = _mm512_loadu_ps(row);
  hi = _mm512_loadu_ps(row + 16);
}

__attribute__((target("avx512f"))) inline void widen_wide(const int8_t* row, __m512& lo, __m512& hi) {
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
}

// The AVX-512 twin of `micro`, on 32-column panels: y[m, 0:ncols] = x[m, :] . panel columns for MB
// rows. Each output column is the same chain of fp32 FMAs over k as in `micro` (one accumulator
// lane per column, k in order), so both kernels give bit-identical results; this one issues half
// the instructions and holds up to 12 rows (24 accumulators) in AVX-512's 32 registers.
template <int MB, typename T>
__attribute__((target("avx512f"))) inline void micro_wide(const float* x, int64_t K, const T* panel, float* y,
                                                          int64_t ldy, int ncols) {
  __m512 acc[MB][2];
  _Pragma("GCC unroll 12") for (int m = 0; m < MB; ++m) {
    acc[m][0] = _mm512_setzero_ps();
    acc[m][1] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    prefetch_row<T, kWideCols>(panel, k);
    __m512 w0, w1;
    widen_wide(panel + k * kWideCols, w0, w1);
    _Pragma("GCC unroll 12") for (int m = 0; m < MB; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
  store_wide<MB>(acc, y, ldy, ncols);
}

constexpr int kWideRows = 12;

template <int MB, typename T>
__attribute__((target("avx512f"))) void rows_wide(const float* x, int64_t K, const T* panel, float* y,
                                                  int64_t ldy, int ncols, int rows) {
  if constexpr (MB > 1) {
    if (rows < MB) return rows_wide<MB - 1, T>(x, K, panel, y, ldy, ncols, rows);
  }
  micro_wide<MB, T>(x, K, panel, y, ldy, ncols);
}

// all M rows against one 32-column panel, 12 rows at a time
template <typename T>
__attribute__((target("avx512f"))) void panel_wide(const float* xp, int64_t M, int64_t K, const T* panel,
                                                   float* yb, int64_t n, int nc) {
  int64_t m = 0;
  for (; m + kWideRows <= M; m += kWideRows) micro_wide<kWideRows, T>(xp + m * K, K, panel, yb + m * n, n, nc);
  if (m < M) rows_wide<kWideRows - 1, T>(xp + m * K, K, panel, yb + m * n, n, nc, static_cast<int>(M - m));
}

constexpr int kRows = 6;  // rows of a 16-column micro-kernel call (AVX2's 16 registers)

template <int MB, typename T>
void rows_narrow(const float* x, int64_t K, const T* panel, float* y, int64_t ldy, int ncols, int rows) {
  if constexpr (MB > 1) {
    if (rows < MB) return rows_narrow<MB - 1, T>(x, K, panel, y, ldy, ncols, rows);
  }
  micro<MB, T>(x, K, panel, y, ldy, ncols);
}

// all M rows against one 16-column panel, 6 rows at a time
template <typename T>
void panel_narrow(const float* xp, int64_t M, int64_t K, const T* panel, float* yb, int64_t n, int nc) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) micro<kRows, T>(xp + m * K, K, panel, yb + m * n, n, nc);
  if (m < M) rows_narrow<kRows - 1, T>(xp + m * K, K, panel, yb + m * n, n, nc, static_cast<int>(M - m));
}

// y [M, n] = x [M, K] fp32 . the P panels of T at wp (16 or 32 columns, FMA layout), split over the panels
template <typename T>
void fma_panels_product(const float* xp, int64_t M, int64_t K, const T* wp, int64_t P, int64_t cols, float* yp,
                        int64_t n) {
  at::parallel_for(0, P, cols == kWideCols ? 2 : 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int nc = static_cast<int>(std::min<int64_t>(cols, n - p * cols));
      if (cols == kWideCols)
        panel_wide(xp, M, K, wp + p * K * cols, yp + p * cols, n, nc);
      else
        panel_narrow(xp, M, K, wp + p * K * cols, yp + p * cols, n, nc);
    }
  });
}

// k-pair panels for CPUs with AVX512-BF16: W [N, K] -> [ceil(N/32), ceil(K/2), 64], each k-pair row
// holding, for columns 0-15 then 16-31, the two weights (k = 2i, 2i + 1) of each column side by
// side -- the operand layout of vdpbf16ps, which multiplies bf16 pairs exactly and adds both
// products into an fp32 lane. Odd K is zero-padded.
at::Tensor pack_pairs(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), P = (N + kWideCols - 1) / kWideCols, K2 = (K + 1) / 2;
  at::Tensor out = at::zeros({P, K2, 2 * kWideCols}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kWideCols && p * kWideCols + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K2 + k / 2) * 2 * kWideCols + 2 * j + (k & 1)] = src[(p * kWideCols + j) * K + k];
  });
  return out;
}

// y[m, 0:ncols] = x[m, :] . panel columns for MB rows, x as bf16 k-pairs [MB, K2] (one uint32 each).
// Each output lane is one chain of vdpbf16ps over k-pairs in order: the same bits whatever the
// row count or the rows beside it (row invariance), at twice the products per instruction of
// fp32 FMAs and with no widening of the weights.
template <int MB>
__attribute__((target("avx512f,avx512bf16"))) inline void micro_pairs(const uint32_t* x, int64_t K2,
                                                                      const uint16_t* panel, float* y, int64_t ldy,
                                                                      int ncols) {
  __m512 acc[MB][2];
  _Pragma("GCC unroll 12") for (int m = 0; m < MB; ++m) {
    acc[m][0] = _mm512_setzero_ps();
    acc[m][1] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* row = panel + k * 2 * kWideCols;
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes + 64, _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + kWideCols);
    _Pragma("GCC unroll 12") for (int m = 0; m < MB; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * K2 + k]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
    }
  }
  store_wide<MB>(acc, y, ldy, ncols);
}

template <int MB>
__attribute__((target("avx512f,avx512bf16"))) void rows_pairs(const uint32_t* x, int64_t K2, const uint16_t* panel,
                                                              float* y, int64_t ldy, int ncols, int rows) {
  if constexpr (MB > 1) {
    if (rows < MB) return rows_pairs<MB - 1>(x, K2, panel, y, ldy, ncols, rows);
  }
  micro_pairs<MB>(x, K2, panel, y, ldy, ncols);
}

__attribute__((target("avx512f,avx512bf16"))) void panel_pairs(const uint32_t* xp, int64_t M, int64_t K2,
                                                               const uint16_t* panel, float* yb, int64_t n, int nc) {
  int64_t m = 0;
  for (; m + kWideRows <= M; m += kWideRows) micro_pairs<kWideRows>(xp + m * K2, K2, panel, yb + m * n, n, nc);
  if (m < M) rows_pairs<kWideRows - 1>(xp + m * K2, K2, panel, yb + m * n, n, nc, static_cast<int>(M - m));
}

// x [M, K] (bf16, or fp32 rounded to bf16 as a bf16 layer's input is) -> [M, K2] bf16 k-pairs, zero-padded
at::Tensor pair_rows(const at::Tensor& x, int64_t K2) {
  at::Tensor xb = x.to(at::kBFloat16);
  if (xb.size(1) != 2 * K2) xb = at::constant_pad_nd(xb, {0, 2 * K2 - xb.size(1)});
  return xb.contiguous();
}


// ---- AMX (Intel Sapphire Rapids and later): the k-pair panels as tiles --------------------------
//
// TDPBF16PS multiplies a tile of 16 rows x 16 k-pairs (bf16) by one of 16 k-pairs x 16 columns and
// adds each output element's 32 products into its fp32 lane: each element depends only on its own
// row of x and column of W, in a fixed order (k-chunks in order), so rows are computed alone as in
// every other layout -- a tree row is bitwise its one-row step, at ~8x vdpbf16ps's products per
// instruction, so the extra rows of a tree cost little more than reading the weights once.
//
// Layout: the k-pair panels with K2 zero-padded to a multiple of 16, viewed as [P, K2p/16, 16, 64]:
// a k-chunk of a 32-column panel is 16 k-pair rows of 128 bytes; its two B tiles (columns 0-15 and
// 16-31) are the two 64-byte halves, loaded with a 128-byte stride. x is zero-padded to whole
// 16-row tiles. A float32 x (an attention output, a gated MLP's middle) is split into
// hi = bf16(x) and lo = bf16(x - hi), both multiplied: ~16 significant bits instead of bf16's 8.

constexpr int kTileRows = 16;   // rows of an A or C tile
constexpr int kTilePairs = 16;  // k-pairs of an A tile (64 bytes a row) and rows of a B tile

at::Tensor pack_tiles(const at::Tensor& w) {
  at::Tensor pairs = pack_pairs(w);
  const int64_t P = pairs.size(0), K2 = pairs.size(1), K2p = (K2 + kTilePairs - 1) / kTilePairs * kTilePairs;
  if (K2p != K2) pairs = at::constant_pad_nd(pairs, {0, 0, 0, K2p - K2});
  return pairs.contiguous().view({P, K2p / kTilePairs, kTilePairs, 2 * kWideCols});
}

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d & (1u << 22)) && (d & (1u << 24));  // AMX-BF16, AMX-TILE
}

#ifdef ENTMTP_EMULATE_AMX
// A test build (ENTMTP_AMX_EMULATION=1, `entmtp.kernels`): the tile instructions below run as
// scalar C++ with the semantics of Intel's pseudo-code (TDPBF16PS: per output element, for each
// k-pair in order, two fp32 multiply-adds of bf16 values widened exactly; denormals are not
// flushed here), so the AMX branch -- packing, tile strides, padding, the hi/lo split, row
// invariance -- runs and is tested on a CPU with AVX512-BF16 but no AMX. Slow; for tests only.
namespace amx_emu {
struct Tile {
  int rows = 0, colsb = 0;
  alignas(64) uint8_t data[16][64];
};
thread_local Tile tiles[8];

inline void configure(const uint8_t* rows, const uint16_t* colsb) {
  for (int t = 0; t < 8; ++t) tiles[t].rows = rows[t], tiles[t].colsb = colsb[t];
}
inline void zero(int t) { std::fill(&tiles[t].data[0][0], &tiles[t].data[0][0] + sizeof(tiles[t].data), uint8_t(0)); }
inline void load(int t, const void* base, int64_t stride) {
  for (int r = 0; r < tiles[t].rows; ++r)
    std::copy_n(static_cast<const uint8_t*>(base) + r * stride, tiles[t].colsb, tiles[t].data[r]);
}
inline void store(int t, void* base, int64_t stride) {
  for (int r = 0; r < tiles[t].rows; ++r) std::copy_n(tiles[t].data[r], tiles[t].colsb, static_cast<uint8_t*>(base) + r * stride);
}
inline float widen(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// C[m][n] += A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1], k in order (C: fp32 lanes, A and B: bf16 pairs)
inline void dpbf16ps(int c, int a, int b) {
  Tile &C = tiles[c], &A = tiles[a], &B = tiles[b];
  for (int m = 0; m < C.rows; ++m) {
    float* cr = reinterpret_cast<float*>(C.data[m]);
    const uint16_t* ar = reinterpret_cast<const uint16_t*>(A.data[m]);
    for (int k = 0; k < A.colsb / 4; ++k) {
      const float a0 = widen(ar[2 * k]), a1 = widen(ar[2 * k + 1]);
      const uint16_t* br = reinterpret_cast<const uint16_t*>(B.data[k]);
      for (int n = 0; n < C.colsb / 4; ++n) {
        cr[n] = std::fma(a0, widen(br[2 * n]), cr[n]);
        cr[n] = std::fma(a1, widen(br[2 * n + 1]), cr[n]);
      }
    }
  }
}
}  // namespace amx_emu
#define AMX_TARGET
#define TILE_LOADCONFIG(cfg) amx_emu::configure((cfg)->rows, (cfg)->colsb)
#define TILE_ZERO(t) amx_emu::zero(t)
#define TILE_LOADD(t, p, s) amx_emu::load(t, p, s)
#define TILE_STORED(t, p, s) amx_emu::store(t, p, s)
#define TILE_DPBF16PS(c, a, b) amx_emu::dpbf16ps(c, a, b)
#define TILE_RELEASE() ((void)0)
bool amx_permitted() { return true; }
#else
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define TILE_LOADCONFIG(cfg) _tile_loadconfig(cfg)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOADD(t, p, s) _tile_loadd(t, p, s)
#define TILE_STORED(t, p, s) _tile_stored(t, p, s)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_RELEASE() _tile_release()
// Linux hands a process AMX's 8 KB tile state only on request, once per process.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return cpu_has_amx_bf16() && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#endif

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0, 1: C (16 rows x 16 fp32 columns: a 32-column panel); 2, 3: A (hi, lo); 4, 5: B (the panel's halves)
// rows: of the A and C tiles (16, or fewer when x has fewer: less to load and multiply)
AMX_TARGET void tiles_configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    cfg.rows[t] = t < 4 ? rows : kTilePairs;
    cfg.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // the builtin does not tell gcc it reads cfg: keep the stores
  TILE_LOADCONFIG(&cfg);
}

// y[16 rows, 32 columns] (row stride ldy floats) = x tile rows . one panel, over K2p / 16 k-chunks
AMX_TARGET inline void tile_panel(const uint32_t* xhi, const uint32_t* xlo,
                                                                     int64_t K2p, const uint16_t* panel, float* y,
                                                                     int64_t ldy) {
  TILE_ZERO(0);
  TILE_ZERO(1);
  const int64_t xstride = K2p * 4;
  for (int64_t c = 0; c < K2p / kTilePairs; ++c) {
    const uint16_t* b = panel + c * kTilePairs * 2 * kWideCols;
    for (int l = 0; l < 32; ++l)  // the next k-chunk (2 KB, 32 lines): the weights stream from memory
      _mm_prefetch(reinterpret_cast<const char*>(b) + kPrefetchBytes + 64 * l, _MM_HINT_T0);
    TILE_LOADD(4, b, 128);
    TILE_LOADD(5, b + kWideCols, 128);
    TILE_LOADD(2, xhi + c * kTilePairs, xstride);
    TILE_DPBF16PS(0, 2, 4);
    TILE_DPBF16PS(1, 2, 5);
    if (xlo != nullptr) {
      TILE_LOADD(3, xlo + c * kTilePairs, xstride);
      TILE_DPBF16PS(0, 3, 4);
      TILE_DPBF16PS(1, 3, 5);
    }
  }
  TILE_STORED(0, y, ldy * 4);
  TILE_STORED(1, y + 16, ldy * 4);
}

AMX_TARGET void tiles_release() { TILE_RELEASE(); }

// x [n] fp32 -> hi = bf16(x), lo = bf16(x - hi), each rounded to nearest even (as .to(bfloat16))
// (every AMX CPU has AVX512-BF16, and so has every CPU the tiles are emulated on)
__attribute__((target("avx512f,avx512bf16"))) void split_bf16(const float* x, int64_t n, uint16_t* hi, uint16_t* lo) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    const __m256bh h = _mm512_cvtneps_pbh(v);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + k), (__m256i)h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + k), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
  }
  for (; k < n; ++k) {
    const at::BFloat16 h(x[k]);
    hi[k] = h.x;
    lo[k] = at::BFloat16(x[k] - static_cast<float>(h)).x;
  }
}

// x [M, K] bf16 or fp32 -> y [M, n] fp32 through AMX tiles; panels [P, K2p/16, 16, 64]
at::Tensor tiles_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  TORCH_CHECK(amx_permitted(), "bf16_panels_linear: AMX tiles need a CPU with AMX-BF16 and a kernel that grants them");
  const int64_t P = panels.size(0), K2p = panels.size(1) * kTilePairs;
  const int64_t M = x.size(0), Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  // x -> hi (and lo for fp32) as [Mp, K2p] k-pairs, zero-padded, in one pass into buffers the calling
  // thread keeps (an aten allocation and zero-fill per call cost more than a one-row product's
  // arithmetic: ~0.4 ms a decoding step); only the padding is zeroed
  const bool split = x.scalar_type() == at::kFloat;
  const at::Tensor xc = x.contiguous();
  const int64_t K = xc.size(1), W = 2 * K2p;
  constexpr int64_t kKeptElems = int64_t(1) << 20;  // larger inputs (a long prompt) get buffers of their own
  thread_local std::vector<uint16_t> kept_hi, kept_lo;
  std::vector<uint16_t> own_hi, own_lo;
  std::vector<uint16_t>& hbuf = Mp * W <= kKeptElems ? kept_hi : own_hi;
  std::vector<uint16_t>& lbuf = Mp * W <= kKeptElems ? kept_lo : own_lo;
  if (static_cast<int64_t>(hbuf.size()) < Mp * W) hbuf.resize(Mp * W);
  if (split && static_cast<int64_t>(lbuf.size()) < Mp * W) lbuf.resize(Mp * W);
  uint16_t* hw = hbuf.data();
  uint16_t* lw = split ? lbuf.data() : nullptr;
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* hr = hw + m * W;
    if (split) {
      split_bf16(xc.data_ptr<float>() + m * K, K, hr, lw + m * W);
      std::fill(lw + m * W + K, lw + (m + 1) * W, uint16_t(0));
    } else {
      const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
      std::copy(xb + m * K, xb + (m + 1) * K, hr);
    }
    std::fill(hr + K, hr + W, uint16_t(0));
  }
  std::fill(hw + M * W, hw + Mp * W, uint16_t(0));
  if (split) std::fill(lw + M * W, lw + Mp * W, uint16_t(0));
  // whole panels write straight into y; the last (narrow) panel and padded rows go through a scratch
  const int64_t nw = n / kWideCols * kWideCols;
  at::Tensor y = at::empty({Mp, std::max<int64_t>(n, 1)}, x.options().dtype(at::kFloat));
  const uint32_t* hp = reinterpret_cast<const uint32_t*>(hw);
  const uint32_t* lp = split ? reinterpret_cast<const uint32_t*>(lw) : nullptr;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 2, [&](int64_t p0, int64_t p1) {
    tiles_configure(static_cast<int>(std::min<int64_t>(M, kTileRows)));
    alignas(64) float scratch[kTileRows * kWideCols];
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* panel = wp + p * K2p * 2 * kWideCols;
      for (int64_t m = 0; m < Mp; m += kTileRows) {
        const uint32_t* xh = hp + m * K2p;
        const uint32_t* xl = lp ? lp + m * K2p : nullptr;
        if (p * kWideCols + kWideCols <= nw) {
          tile_panel(xh, xl, K2p, panel, yp + m * n + p * kWideCols, n);
        } else {
          tile_panel(xh, xl, K2p, panel, scratch, kWideCols);
          for (int64_t r = 0; r < kTileRows; ++r)
            for (int64_t j = p * kWideCols; j < n; ++j) yp[(m + r) * n + j] = scratch[r * kWideCols + j - p * kWideCols];
        }
      }
    }
    tiles_release();
  });
  return y.narrow(0, 0, M);
}

at::Tensor bf16_panels_linear(const at::Tensor& x_, const at::Tensor& panels, int64_t n,
                              const c10::optional<at::Tensor>& bias, bool out_float) {
  TORCH_CHECK(x_.dim() >= 1 && (x_.scalar_type() == at::kBFloat16 || x_.scalar_type() == at::kFloat) &&
                  x_.device().is_cpu(),
              "bf16_panels_linear: x must be a bfloat16 or float32 CPU tensor");
  if (panels.dim() == 4) {  // AMX tiles
    TORCH_CHECK(panels.size(2) == kTilePairs && panels.size(3) == 2 * kWideCols &&
                    panels.size(1) * kTilePairs >= (x_.size(-1) + 1) / 2 &&
                    panels.size(1) * kTilePairs < (x_.size(-1) + 1) / 2 + kTilePairs &&
                    panels.scalar_type() == at::kBFloat16 && panels.is_contiguous(),
                "bf16_panels_linear: panels must come from bf16_pack_panels for this input width");
    TORCH_CHECK(n > (panels.size(0) - 1) * kWideCols && n <= panels.size(0) * kWideCols,
                "bf16_panels_linear: n does not match the panels");
    std::vector<int64_t> shape = x_.sizes().vec();
    shape.back() = n;
    at::Tensor y = tiles_linear(x_.reshape({-1, x_.size(-1)}), panels, n);
    if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
    return (out_float ? y : round_bf16(y)).view(shape);
  }
  const bool pairs = panels.dim() == 3 && panels.size(2) == 2 * kWideCols;
  TORCH_CHECK(panels.dim() == 3 && (panels.size(2) == kCols || panels.size(2) == kWideCols || pairs) &&
                  (pairs ? panels.size(1) == (x_.size(-1) + 1) / 2 : panels.size(1) == x_.size(-1)) &&
                  panels.scalar_type() == at::kBFloat16 && panels.is_contiguous(),
              "bf16_panels_linear: panels must come from bf16_pack_panels for this input width");
  const int64_t cols = pairs ? kWideCols : panels.size(2);
  TORCH_CHECK(n > (panels.size(0) - 1) * cols && n <= panels.size(0) * cols,
              "bf16_panels_linear: n does not match the panels");
  TORCH_CHECK(cols == kCols || __builtin_cpu_supports("avx512f"),
              "bf16_panels_linear: 32-column panels need a CPU with AVX-512");
  TORCH_CHECK(!pairs || __builtin_cpu_supports("avx512bf16"),
              "bf16_panels_linear: k-pair panels need a CPU with AVX512-BF16");
  if (pairs) {
    const int64_t K2 = panels.size(1), P = panels.size(0);
    const at::Tensor xr = pair_rows(x_.reshape({-1, x_.size(-1)}), K2);
    const int64_t M = xr.size(0);
    std::vector<int64_t> shape = x_.sizes().vec();
    shape.back() = n;
    at::Tensor y = at::empty({M, n}, x_.options().dtype(at::kFloat));
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(xr.data_ptr<at::BFloat16>());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, P, 2, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        panel_pairs(xp, M, K2, wp + p * K2 * 2 * kWideCols, yp + p * kWideCols, n,
                    static_cast<int>(std::min<int64_t>(kWideCols, n - p * kWideCols)));
    });
    if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
    return (out_float ? y : round_bf16(y)).view(shape);
  }
  const at::Tensor x = x_.reshape({-1, x_.size(-1)}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  std::vector<int64_t> out_shape = x_.sizes().vec();
  out_shape.back() = n;
  at::Tensor y = at::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  fma_panels_product(xp, M, K, wp, P, cols, yp, n);
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return (out_float ? y : round_bf16(y)).view(out_shape);
}

// ---- float32 weights: the same panels without the widening ----------------------------------
// A float32 model's decode step reads 4 bytes a weight, and MKL's sgemm, which torch uses for 2+
// rows, costs several one-row steps for a 4-8 row tree. Here a weight W [N, K] fp32 is repacked once
// into panels [ceil(N/cols), K, cols] (natural column order); each output column is one chain of
// fp32 FMAs over k in order whatever the rows beside it (row invariance) and whichever width, so a
// tree's extra rows cost arithmetic on weights already loaded, not weight reads. The micro-kernels are
// those of the bf16 panels (`micro`, `micro_wide`): their `widen` overloads take fp32 k-rows as they are.

at::Tensor f32_pack_panels(const at::Tensor& w_, int64_t cols) {
  TORCH_CHECK(w_.dim() == 2 && w_.scalar_type() == at::kFloat && w_.device().is_cpu(),
              "f32_pack_panels: w must be a 2-D float32 CPU tensor");
  TORCH_CHECK(cols == kCols || cols == kWideCols, "f32_pack_panels: cols must be 16 (AVX2) or 32 (AVX-512)");
  return pack_columns<float>(w_.contiguous(), cols, [](int64_t j) { return j; });
}

at::Tensor f32_panels_linear(const at::Tensor& x_, const at::Tensor& panels, int64_t n,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_.dim() >= 1 && x_.scalar_type() == at::kFloat && x_.device().is_cpu(),
              "f32_panels_linear: x must be a float32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && (panels.size(2) == kCols || panels.size(2) == kWideCols) &&
                  panels.size(1) == x_.size(-1) && panels.scalar_type() == at::kFloat && panels.is_contiguous(),
              "f32_panels_linear: panels must come from f32_pack_panels for this input width");
  const int64_t cols = panels.size(2);
  TORCH_CHECK(n > (panels.size(0) - 1) * cols && n <= panels.size(0) * cols,
              "f32_panels_linear: n does not match the panels");
  TORCH_CHECK(cols == kCols || __builtin_cpu_supports("avx512f"),
              "f32_panels_linear: 32-column panels need a CPU with AVX-512");
  const at::Tensor x = x_.reshape({-1, x_.size(-1)}).contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  std::vector<int64_t> out_shape = x_.sizes().vec();
  out_shape.back() = n;
  at::Tensor y = at::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  fma_panels_product(xp, M, K, wp, P, cols, yp, n);
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y.view(out_shape);
}

// ---- int8 weights with a scale per output column: drafting only -------------------------------
// Draft heads score their tokens through a slice of the base's lm_head (8192 x 576 for SmolLM2-135M,
// 9.4 MB of bf16 read every level of a draft). Drafts are verified, so their logits need not be
// exact; one byte a weight halves what a level streams. W [N, K] int8 (W ~ q * scale[n]) is
// repacked once into panels [ceil(N/cols), K, cols] (natural column order) and read by the same
// micro-kernels as the bf16 and fp32 panels (`widen` of int8 is exact), so a row's sums do not
// depend on the rows beside it; each column's sum is then multiplied by its scale.

at::Tensor i8_pack_panels(const at::Tensor& w_, int64_t cols) {
  TORCH_CHECK(w_.dim() == 2 && w_.scalar_type() == at::kChar && w_.device().is_cpu(),
              "i8_pack_panels: w must be a 2-D int8 CPU tensor");
  TORCH_CHECK(cols == kCols || cols == kWideCols, "i8_pack_panels: cols must be 16 (AVX2) or 32 (AVX-512)");
  return pack_columns<int8_t>(w_.contiguous(), cols, [](int64_t j) { return j; });
}

at::Tensor i8_panels_linear(const at::Tensor& x_, const at::Tensor& panels, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(x_.dim() >= 1 && (x_.scalar_type() == at::kBFloat16 || x_.scalar_type() == at::kFloat) &&
                  x_.device().is_cpu(),
              "i8_panels_linear: x must be a bfloat16 or float32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && (panels.size(2) == kCols || panels.size(2) == kWideCols) &&
                  panels.size(1) == x_.size(-1) && panels.scalar_type() == at::kChar && panels.is_contiguous(),
              "i8_panels_linear: panels must come from i8_pack_panels for this input width");
  const int64_t cols = panels.size(2);
  TORCH_CHECK(n > (panels.size(0) - 1) * cols && n <= panels.size(0) * cols,
              "i8_panels_linear: n does not match the panels");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n && scales.scalar_type() == at::kFloat,
              "i8_panels_linear: scales must be float32 [n]");
  TORCH_CHECK(cols == kCols || __builtin_cpu_supports("avx512f"),
              "i8_panels_linear: 32-column panels need a CPU with AVX-512");
  const at::Tensor x = x_.reshape({-1, x_.size(-1)}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  std::vector<int64_t> out_shape = x_.sizes().vec();
  out_shape.back() = n;
  at::Tensor y = at::empty({M, n}, x.options());
  fma_panels_product(x.data_ptr<float>(), M, K, panels.data_ptr<int8_t>(), P, cols, y.data_ptr<float>(), n);
  y.mul_(scales.unsqueeze(0));
  return y.view(out_shape);
}

// sum of squares of n bf16 values, in fp32 (8 lanes, then the lanes in order)
inline float sum_squares(const at::BFloat16* x, int64_t n) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(x);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + j))), 16));
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float ss = 0.f;
  for (int l = 0; l < 8; ++l) ss += lanes[l];
  for (; j < n; ++j) {
    const float v = static_cast<float>(x[j]);
    ss += v * v;
  }
  return ss;
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
  // A decoding step normalises a few rows of a few hundred values: threads cost more than that.
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(H, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const at::BFloat16* xr = xp + m * H;
      const float r = 1.f / std::sqrt(sum_squares(xr, H) / static_cast<float>(H) + feps);
      at::BFloat16* yr = yp + m * H;
      for (int64_t j = 0; j < H; ++j) {
        const float normed = static_cast<float>(at::BFloat16(static_cast<float>(xr[j]) * r));
        yr[j] = at::BFloat16(static_cast<float>(wp[j]) * normed);
      }
    }
  });
  return y;
}

// exp(x) for 8 floats (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~1 ulp),
// clamped to +-88.37 so that it stays finite
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
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
  // work items: (row, block of 512 columns); a thread only pays for itself past ~8 of them
  constexpr int64_t kBlock = 512;
  const int64_t nb = (I + kBlock - 1) / kBlock;
  at::parallel_for(0, M * nb, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = t / nb, j0 = (t % nb) * kBlock, j1 = std::min(I, j0 + kBlock);
      const float* g = gp + m * 2 * I;
      const float* u = g + I;
      float* yr = yp + m * I;
      int64_t j = j0;
      for (; j + 8 <= j1; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + j)));
      }
      for (; j < j1; ++j) yr[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
  });
  return y;
}

// 8 values of a row (cos, sin, logits) as fp32 (bf16 widened exactly)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) { return bf16_widen8(reinterpret_cast<const uint16_t*>(p)); }

// one row's q and k heads rotated and split, v copied. The arithmetic is what gcc made of
//   out[i] = x[i] c[i] - x[i+D2] s[i],  out[i+D2] = x[i+D2] c[i+D2] + x[i] s[i+D2]
// (the second product rounded, the first fused into it), 8 lanes at a time where d/2 allows
template <typename T>
void rope_row(const float* x, const T* cr, const T* sr, int64_t H, int64_t Hkv, int64_t D, int64_t Q, int64_t t,
              float* qp, float* kp, float* vp) {
  const int64_t D2 = D / 2;
  for (int64_t h = 0; h < H + Hkv; ++h) {
    const float* xh = x + h * D;
    float* out = h < H ? qp + (h * Q + t) * D : kp + ((h - H) * Q + t) * D;
    int64_t i = 0;
    if (D2 % 8 == 0) {
      for (; i < D2; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(xh + i), x2 = _mm256_loadu_ps(xh + i + D2);
        _mm256_storeu_ps(out + i, _mm256_fmsub_ps(x1, load8(cr + i), _mm256_mul_ps(x2, load8(sr + i))));
        _mm256_storeu_ps(out + i + D2, _mm256_fmadd_ps(x2, load8(cr + i + D2), _mm256_mul_ps(x1, load8(sr + i + D2))));
      }
    }
    for (; i < D2; ++i) {
      const float c1 = static_cast<float>(cr[i]), s1 = static_cast<float>(sr[i]);
      const float c2 = static_cast<float>(cr[i + D2]), s2 = static_cast<float>(sr[i + D2]);
      out[i] = std::fma(xh[i], c1, -(xh[i + D2] * s1));
      out[i + D2] = std::fma(xh[i + D2], c2, xh[i] * s2);
    }
  }
  for (int64_t h = 0; h < Hkv; ++h) std::copy_n(x + (H + Hkv + h) * D, D, vp + (h * Q + t) * D);
}

// q, k, v [B, heads, q, d] fp32 from one fused projection qkv [B, q, (H + 2 Hkv) d] fp32, with the
// rotary embedding (rotate-half convention: x * cos + rotate_half(x) * sin) applied to q and k;
// cos and sin [B, q, d] bf16 or fp32, read as they are (a bf16 model's come in bf16)
std::vector<at::Tensor> rope_split(const at::Tensor& qkv_, const at::Tensor& cos_, const at::Tensor& sin_,
                                   int64_t H, int64_t Hkv) {
  TORCH_CHECK(qkv_.dim() == 3 && qkv_.scalar_type() == at::kFloat && qkv_.device().is_cpu() && H > 0 && Hkv > 0 &&
                  qkv_.size(2) % (H + 2 * Hkv) == 0 && (qkv_.size(2) / (H + 2 * Hkv)) % 2 == 0,
              "rope_split: qkv must be a float32 CPU tensor [B, q, (H + 2 Hkv) d] with an even d");
  const int64_t B = qkv_.size(0), Q = qkv_.size(1), D = qkv_.size(2) / (H + 2 * Hkv);
  TORCH_CHECK(cos_.dim() == 3 && cos_.sizes() == sin_.sizes() && cos_.size(0) == B && cos_.size(1) == Q &&
                  cos_.size(2) == D,
              "rope_split: cos and sin must be [B, q, d] like the projection");
  const at::Tensor qkv = qkv_.contiguous();
  const bool bf16 = cos_.scalar_type() == at::kBFloat16 && sin_.scalar_type() == at::kBFloat16;
  const at::Tensor c = bf16 ? cos_.contiguous() : cos_.to(at::kFloat).contiguous();
  const at::Tensor s = bf16 ? sin_.contiguous() : sin_.to(at::kFloat).contiguous();
  at::Tensor q = at::empty({B, H, Q, D}, qkv.options());
  at::Tensor k = at::empty({B, Hkv, Q, D}, qkv.options());
  at::Tensor v = at::empty({B, Hkv, Q, D}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Q; ++t) {
      const float* x = xp + (b * Q + t) * (H + 2 * Hkv) * D;
      float *qb = qp + b * H * Q * D, *kb = kp + b * Hkv * Q * D, *vb = vp + b * Hkv * Q * D;
      const int64_t row = (b * Q + t) * D;
      if (bf16)
        rope_row(x, c.data_ptr<at::BFloat16>() + row, s.data_ptr<at::BFloat16>() + row, H, Hkv, D, Q, t, qb, kb, vb);
      else
        rope_row(x, c.data_ptr<float>() + row, s.data_ptr<float>() + row, H, Hkv, D, Q, t, qb, kb, vb);
    }
  return {q, k, v};
}

// across the 8 lanes of v in a fixed order
inline float lanes_sum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
inline float lanes_max(__m256 v) {
  const __m128 s4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_max_ss(s2, _mm_movehdup_ps(s2)));
}

// s[g][m] = scale * (q_g . k[idx[m]]) + bias[m] for GB query heads that share their keys
// (grouped-query attention), four keys at a time, each key's k-row loaded once for the GB heads.
// Every (head, key) pair accumulates its 8-float blocks in d order in its own register (independent
// FMA chains), then one transpose-reduction sums its lanes as ((0+1)+(2+3))+((4+5)+(6+7)) -- the same
// in every slot, so a score has the same bits whichever heads and keys share the pass.
//   qr[g], s[g]: head g's query row and scores; n a multiple of 4 (idx and bias padded by the caller)
template <int GB>
inline void group_key_scores(const float* const* qr, const float* kb, int64_t stride, const int64_t* idx,
                             const float* bias, int64_t n, int64_t D, float scale, float* const* s) {
  const __m128 sv = _mm_set1_ps(scale);
  for (int64_t m = 0; m < n; m += 4) {
    const float* kr[4];
    __m256 a[GB][4];
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) kr[j] = kb + idx[m + j] * stride;
    _Pragma("GCC unroll 4") for (int g = 0; g < GB; ++g)
      _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 qv[GB];
      _Pragma("GCC unroll 4") for (int g = 0; g < GB; ++g) qv[g] = _mm256_loadu_ps(qr[g] + d);
      _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
        const __m256 kv = _mm256_loadu_ps(kr[j] + d);
        _Pragma("GCC unroll 4") for (int g = 0; g < GB; ++g) a[g][j] = _mm256_fmadd_ps(qv[g], kv, a[g][j]);
      }
    }
    _Pragma("GCC unroll 4") for (int g = 0; g < GB; ++g) {
      const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
      const __m128 dot = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
      _mm_storeu_ps(s[g] + m, _mm_add_ps(_mm_mul_ps(dot, sv), _mm_loadu_ps(bias + m)));
    }
  }
}

// o[g][d0 : d0 + 8 DB] = inv[g] * sum_m p[g][m] v[idx[m]] (rows of v `stride` apart) for GB heads, each
// value block loaded once for the GB heads; every element summed sequentially in key order from zero,
// then one multiply -- the same bits whichever heads share the pass
template <int GB, int DB>
inline void group_weighted_rows(const float* const* p, const int64_t* idx, int64_t n, const float* v, int64_t stride,
                                const float* inv, float* const* o, int64_t d0) {
  __m256 acc[GB][DB];
  _Pragma("GCC unroll 4") for (int g = 0; g < GB; ++g)
    _Pragma("GCC unroll 4") for (int d = 0; d < DB; ++d) acc[g][d] = _mm256_setzero_ps();
  for (int64_t m = 0; m < n; ++m) {
    __m256 pm[GB];
    _Pragma("GCC unroll 4") for (int g = 0; g < GB; ++g) pm[g] = _mm256_set1_ps(p[g][m]);
    const float* vr = v + idx[m] * stride + d0;
    _Pragma("GCC unroll 4") for (int d = 0; d < DB; ++d) {
      const __m256 vv = _mm256_loadu_ps(vr + 8 * d);
      _Pragma("GCC unroll 4") for (int g = 0; g < GB; ++g) acc[g][d] = _mm256_fmadd_ps(pm[g], vv, acc[g][d]);
    }
  }
  _Pragma("GCC unroll 4") for (int g = 0; g < GB; ++g) {
    const __m256 iv = _mm256_set1_ps(inv[g]);
    _Pragma("GCC unroll 4") for (int d = 0; d < DB; ++d) _mm256_storeu_ps(o[g] + d0 + 8 * d, _mm256_mul_ps(acc[g][d], iv));
  }
}

// group_weighted_rows over any D % 8 == 0, in chunks of at most 32 columns (GB x 4 accumulators)
template <int GB>
inline void group_weighted_sum(const float* const* p, const int64_t* idx, int64_t n, const float* v, int64_t stride,
                               const float* inv, float* const* o, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    switch (std::min<int64_t>(4, (D - d0) / 8)) {
      case 4: group_weighted_rows<GB, 4>(p, idx, n, v, stride, inv, o, d0); break;
      case 3: group_weighted_rows<GB, 3>(p, idx, n, v, stride, inv, o, d0); break;
      case 2: group_weighted_rows<GB, 2>(p, idx, n, v, stride, inv, o, d0); break;
      default: group_weighted_rows<GB, 1>(p, idx, n, v, stride, inv, o, d0); break;
    }
  }
}

// softmax of scores s[0:n8) in place (padding slots -inf -> 0), returning their sum: max and sum over
// eight lanes, then across lanes in a fixed order (vs one serial chain)
inline float softmax_in_place(float* s, int64_t n8) {
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  for (int64_t m = 0; m < n8; m += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(s + m));
  const __m256 mxv = _mm256_set1_ps(lanes_max(mx8));
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t m = 0; m < n8; m += 8) {
    const __m256 x = _mm256_loadu_ps(s + m);  // padding: exactly 0 (exp8 clamps -inf to e^-88)
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, mxv)), _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_GT_OQ));
    _mm256_storeu_ps(s + m, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  return lanes_sum(sum8);
}

// GB heads (1-3) of one query row against its gathered keys: scores, softmax, weighted values
template <int GB>
inline void attend_heads(const float* const* qr, const float* kb, int64_t ks, const float* vb, int64_t vs,
                         const int64_t* idx, const float* bias, int64_t n, int64_t n8, int64_t D, float scale,
                         float* const* sc, float* const* o) {
  group_key_scores<GB>(qr, kb, ks, idx, bias, n8, D, scale, sc);
  float inv[GB];
  for (int g = 0; g < GB; ++g) {
    for (int64_t m = n; m < n8; ++m) sc[g][m] = -INFINITY;  // padding slots: no weight
    inv[g] = 1.f / softmax_in_place(sc[g], n8);
  }
  // o = sum_m p_m v_m / total, each output element summed sequentially in key order
  group_weighted_sum<GB>(sc, idx, n, vb, vs, inv, o, D);
}

// Attention in fp32 whose every output row is a function of that row's query and the keys it sees
// only -- the same bits whatever else is in the call (other rows, masked keys, where in the cache
// the visible keys lie): the visible keys are gathered in cache order first, and scores, softmax
// and the weighted sum of values run over that list with a fixed summation order. So a draft tree
// verified in one call yields exactly the numbers a one-token step would (a greedy tree step then
// accepts exactly the tokens plain decoding emits), which torch's sdpa, blocking by call shape,
// does not promise.
//   q [B, H, Q, D], k/v [B, Hkv, L, D] (last dim contiguous; H a multiple of Hkv; D % 8 == 0),
//   mask: additive float [B or 1, 1, Q, L] (entries <= -1e30 hide a key) or bool (true = visible),
//   or undefined with causal (row i sees keys <= L - Q + i) or not (every key)
//   -> out [B, Q, H, D] fp32 (o_proj's input layout)
at::Tensor attend(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask_,
                  bool causal, double scale) {
  TORCH_CHECK(q_.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q_.scalar_type() == at::kFloat &&
                  k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && q_.device().is_cpu(),
              "attend: q, k, v must be float32 CPU tensors [B, heads, len, D]");
  const at::Tensor q = q_.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(D % 8 == 0 && k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == L && k.size(3) == D &&
                  v.size(3) == D && Hkv > 0 && H % Hkv == 0 && k.stride(3) == 1 && v.stride(3) == 1,
              "attend: shapes do not match (D a multiple of 8, H a multiple of Hkv, last dims contiguous)");
  at::Tensor mask;
  const bool has_mask = mask_.has_value() && mask_->defined();
  if (has_mask) {
    TORCH_CHECK(mask_->dim() == 4 && (mask_->size(0) == 1 || mask_->size(0) == B) && mask_->size(1) == 1 &&
                    mask_->size(2) == Q && mask_->size(3) == L,
                "attend: mask must be [B or 1, 1, Q, L]");
    mask = mask_->scalar_type() == at::kBool ? mask_->contiguous() : mask_->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({B, Q, H, D}, q.options());
  const int64_t G = H / Hkv;
  const float fscale = static_cast<float>(scale);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // plain pointers and strides: tensor accessors cost a call each, far too much in these loops
  const bool* mbool = has_mask && mask.scalar_type() == at::kBool ? mask.data_ptr<bool>() : nullptr;
  const float* mfloat = has_mask && !mbool ? mask.data_ptr<float>() : nullptr;
  const int64_t mask_b = has_mask && mask.size(0) != 1 ? Q * L : 0;
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  // one task per (batch, kv head, query row): the row's visible keys, then its G heads
  at::parallel_for(0, B * Hkv * Q, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> idx(L + 8);
    std::vector<float> bias(L + 8), sc(3 * (L + 8));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (Hkv * Q), hk = (t / Q) % Hkv, i = t % Q;
      const int64_t last = causal ? L - Q + i : L - 1;
      int64_t n = 0;
      if (mbool) {
        const bool* mr = mbool + b * mask_b + i * L;
        for (int64_t j = 0; j <= last; ++j)
          if (mr[j]) {
            idx[n] = j;
            bias[n++] = 0.f;
          }
      } else if (mfloat) {
        const float* mr = mfloat + b * mask_b + i * L;
        for (int64_t j = 0; j <= last; ++j)
          if (mr[j] > -1e30f) {
            idx[n] = j;
            bias[n++] = mr[j];
          }
      } else {
        for (int64_t j = 0; j <= last; ++j) {
          idx[n] = j;
          bias[n++] = 0.f;
        }
      }
      const int64_t n8 = (n + 7) / 8 * 8;
      for (int64_t m = n; m < n8; ++m) {  // padding slots: a visible key, scores unused
        idx[m] = idx[0];
        bias[m] = 0.f;
      }
      const float* kb = kp + b * ks0 + hk * ks1;
      const float* vb = vp + b * vs0 + hk * vs1;
      if (n == 0) {  // nothing visible: zeros (sdpa would give NaN)
        for (int64_t g = 0; g < G; ++g) std::fill_n(op + ((b * Q + i) * H + hk * G + g) * D, D, 0.f);
        continue;
      }
      // the kv head's G query heads in passes of up to 3 sharing each key and value load
      for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int gb = static_cast<int>(std::min<int64_t>(3, G - g0));
        const float* qr[3];
        float* o[3];
        float* s[3];
        for (int g = 0; g < gb; ++g) {
          const int64_t h = hk * G + g0 + g;
          qr[g] = qp + ((b * H + h) * Q + i) * D;
          o[g] = op + ((b * Q + i) * H + h) * D;
          s[g] = sc.data() + g * (L + 8);
        }
        if (gb == 3) attend_heads<3>(qr, kb, ks2, vb, vs2, idx.data(), bias.data(), n, n8, D, fscale, s, o);
        else if (gb == 2) attend_heads<2>(qr, kb, ks2, vb, vs2, idx.data(), bias.data(), n, n8, D, fscale, s, o);
        else attend_heads<1>(qr, kb, ks2, vb, vs2, idx.data(), bias.data(), n, n8, D, fscale, s, o);
      }
    }
  });
  return out;
}

// Each row's first maximum, as torch.argmax gives it (a NaN counts as the maximum: the first NaN),
// for greedy acceptance: aten's argmax does not vectorise (~68 us for one row of 49152 logits on a
// Xeon, against ~6 us for amax), which is most of a tree step's acceptance. bf16 logits are read in
// place (widening is exact), not through a converted fp32 copy of every tree row's logits.
//   x [R, V] float32 or bfloat16 -> [R] int64
inline float value(const float* p, int64_t t) { return p[t]; }
inline float value(const at::BFloat16* p, int64_t t) { return static_cast<float>(p[t]); }

template <typename T>
void first_argmax_rows(const T* xp, int64_t R, int64_t V, int64_t* op) {
  at::parallel_for(0, R, 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xp + r * V;
      // four independent maxima (a single chain waits on max's latency every 8 values)
      __m256 mx[4], unordered = _mm256_setzero_ps();
      for (int a = 0; a < 4; ++a) mx[a] = _mm256_set1_ps(-INFINITY);
      int64_t j = 0;
      for (; j + 32 <= V; j += 32)
        _Pragma("GCC unroll 4") for (int a = 0; a < 4; ++a) {
          const __m256 v = load8(row + j + 8 * a);
          unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
          mx[a] = _mm256_max_ps(mx[a], v);
        }
      for (; j + 8 <= V; j += 8) {
        const __m256 v = load8(row + j);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx[0] = _mm256_max_ps(mx[0], v);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3])));
      float m = lanes[0];
      bool nan = _mm256_movemask_ps(unordered) != 0;
      for (int l = 1; l < 8; ++l) m = std::max(m, lanes[l]);
      for (int64_t t = j; t < V; ++t) {
        nan = nan || std::isnan(value(row, t));
        m = std::max(m, value(row, t));
      }
      int64_t at = 0;
      if (nan) {
        while (!std::isnan(value(row, at))) ++at;
      } else {
        const __m256 mv = _mm256_set1_ps(m);
        int64_t t = 0;
        int bits = 0;
        for (; t + 8 <= V; t += 8)
          if ((bits = _mm256_movemask_ps(_mm256_cmp_ps(load8(row + t), mv, _CMP_EQ_OQ))) != 0) break;
        if (bits != 0) {
          at = t + __builtin_ctz(bits);
        } else {
          at = t;
          while (value(row, at) != m) ++at;
        }
      }
      op[r] = at;
    }
  });
}

at::Tensor first_argmax(const at::Tensor& x_) {
  TORCH_CHECK(x_.dim() == 2 && (x_.scalar_type() == at::kFloat || x_.scalar_type() == at::kBFloat16) &&
                  x_.device().is_cpu() && x_.size(1) > 0,
              "first_argmax: x must be a float32 or bfloat16 CPU tensor [rows, V] with V > 0");
  const at::Tensor x = x_.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) first_argmax_rows(x.data_ptr<float>(), R, V, out.data_ptr<int64_t>());
  else first_argmax_rows(x.data_ptr<at::BFloat16>(), R, V, out.data_ptr<int64_t>());
  return out;
}

// After a tree step the cache keeps the accepted nodes' rows: one call for every layer's keys and
// values instead of two indexing ops and two copies per layer (~0.5 ms a step on a 30-layer model).
// Rows move to lower or equal positions in ascending order, so no source is overwritten before it is read.
void keep_rows(at::TensorList caches, at::IntArrayRef src, int64_t dst) {
  for (const at::Tensor& t : caches) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 4 && t.stride(3) == 1, "keep_rows: caches must be CPU tensors [B, heads, L, D] with a contiguous last dim");
    for (size_t i = 0; i < src.size(); ++i)
      TORCH_CHECK(src[i] >= dst + static_cast<int64_t>(i) && src[i] < t.size(2) && (i == 0 || src[i] > src[i - 1]),
                  "keep_rows: src must ascend with src[i] >= dst + i, inside the cache");
  }
  for (const at::Tensor& t : caches) {
    const int64_t B = t.size(0), H = t.size(1), rb = t.size(3) * t.element_size();
    char* base = static_cast<char*>(t.data_ptr());
    const int64_t s0 = t.stride(0) * t.element_size(), s1 = t.stride(1) * t.element_size(), s2 = t.stride(2) * t.element_size();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        char* p = base + b * s0 + h * s1;
        for (size_t i = 0; i < src.size(); ++i)
          if (src[i] != dst + static_cast<int64_t>(i)) std::memcpy(p + (dst + i) * s2, p + src[i] * s2, rb);
      }
  }
}

}  // namespace

TORCH_LIBRARY(entmtp_cpu, m) {
  m.def("bf16_pack_panels(Tensor w, int cols=16, bool pairs=False, bool tiles=False) -> Tensor");
  m.def("bf16_panels_linear(Tensor x, Tensor panels, int n, Tensor? bias, bool out_float) -> Tensor");
  m.def("f32_pack_panels(Tensor w, int cols=16) -> Tensor");
  m.def("f32_panels_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("i8_pack_panels(Tensor w, int cols=16) -> Tensor");
  m.def("i8_panels_linear(Tensor x, Tensor panels, Tensor scales, int n) -> Tensor");
  m.def("bf16_rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("keep_rows(Tensor(a!)[] caches, int[] src, int dst) -> ()");
  m.def("first_argmax(Tensor x) -> Tensor");
  m.def("rope_split(Tensor qkv, Tensor cos, Tensor sin, int H, int Hkv) -> Tensor[]");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(entmtp_cpu, CPU, m) {
  m.impl("bf16_pack_panels", &bf16_pack_panels);
  m.impl("bf16_panels_linear", &bf16_panels_linear);
  m.impl("f32_pack_panels", &f32_pack_panels);
  m.impl("f32_panels_linear", &f32_panels_linear);
  m.impl("i8_pack_panels", &i8_pack_panels);
  m.impl("i8_panels_linear", &i8_panels_linear);
  m.impl("bf16_rms_norm", &bf16_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_split", &rope_split);
  m.impl("attend", &attend);
  m.impl("keep_rows", &keep_rows);
  m.impl("first_argmax", &first_argmax);
}
