// RMSNorm of bfloat16 and float16 rows on the CPU, as a served step normalises them
// (workers/models/native.py compiles this file with paged_attention.cpp and says when it is used).
//
// Each row is normalised as transformers' LlamaRMSNorm does it: widened to float32, divided by the
// root of its mean square plus eps (1 / sqrt, each rounded once, as torch's rsqrt), rounded to the
// row's dtype, then scaled by the weight in that dtype (the product rounded once). Only the sum of
// the squares is its own: in LANES lanes over the row's features, summed pairwise, where torch sums
// in its own order. So a row has the same bits alone or among any others, and nearly always
// transformers' bits (one element in 10,000 to 100,000 rounds the other way, more of them in wider
// rows and in float16). One call is one operator, where torch's composite norm is eight, each with
// its own pass and allocation.
#include <cmath>
#include <cstdint>

#include "vectors.h"

namespace {

constexpr int64_t PARALLEL_ELEMENTS = 1 << 15;  // fewer elements run on the calling thread alone

template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t width, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1 && rows * width >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * width;
    Lanes squares{};
    for (int64_t j = 0; j < width; j += LANES) {
      float wide[LANES];
      for (int64_t l = 0; l < LANES; ++l) wide[l] = row[j + l].load();
      const Lanes v = load_lanes(wide);
      squares += v * v;
    }
    const float inverse = 1.0f / std::sqrt(sum_lanes(squares) / float(width) + eps);
    T* normed = out + r * width;
    for (int64_t j = 0; j < width; ++j)
      normed[j] = T::store(weight[j].load() * T::store(row[j].load() * inverse).load());
  }
}

}  // namespace

// x and out: [rows, width] contiguous, width a multiple of LANES; weight: [width]
#define RMS_NORM(NAME, T)                                                                           \
  extern "C" void NAME(const void* x, const void* weight, void* out, int64_t rows, int64_t width,  \
                       float eps, int threads) {                                                   \
    rms_norm(static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<T*>(out), rows, \
             width, eps, threads);                                                                 \
  }

RMS_NORM(rms_norm_bfloat16, BFloat16)
RMS_NORM(rms_norm_float16, Float16)
