// Products of bfloat16 rows with int8 weights on the CPU, one symmetric scale per output channel
// (workers/models/native.py compiles this file and says when it is used): y = (x W^T) * scale.
//
// Each output is one row's dot product with one channel's weights, widened to float32, in LANES
// lanes over the inputs from the first (a fused multiply-add each, where the CPU has them), summed
// pairwise, multiplied by the channel's scale and rounded to bfloat16 once. The same code computes
// it whichever rows and channels a call holds and whichever thread takes them, so a row has the
// same bits alone or among any others. A tile of CHANNELS channels by ROWS rows shares each load:
// a channel's weights are widened once for ROWS rows, a row's inputs read once for CHANNELS
// channels. Each thread fetches the weights PREFETCH_CHANNELS channels ahead of those it multiplies:
// without it, a 576 x 49152 head (SmolLM2's, 28 MB) read 6 GB/s on one thread of an AMD EPYC and
// 12-15 on two, as torch's `_weight_int8pack_mm` does (7 and 13-16), where the machine reads 26 and
// 33; with it 18 and 37 (16 channels ahead; 4 and 32 were slower).
#include <cstdint>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vectors.h"

namespace {

constexpr int64_t CHANNELS = 4;  // output channels of a tile
constexpr int64_t ROWS = 4;  // rows of a tile
constexpr int64_t PREFETCH_CHANNELS = 16;  // how far ahead a thread fetches the weights it reads next
constexpr int64_t PARALLEL_WEIGHTS = 1 << 16;  // smaller products run on the calling thread alone

using ByteLanes = int8_t __attribute__((vector_size(LANES)));

inline Lanes widen(const int8_t* p) {  // LANES int8 weights as floats
#if defined(__AVX2__)  // one instruction where GCC's conversions below take one per weight
  return Lanes(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  ByteLanes bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(__builtin_convertvector(bytes, IntLanes), Lanes);
#endif
}

// channels [c, c + C) of rows [r, r + R): x [rows, width] float32, w [channels, width] int8
template <int64_t C, int64_t R>
void tile(const float* x, const int8_t* w, const BFloat16* scales, BFloat16* out, int64_t c, int64_t r,
          int64_t width, int64_t channels) {
  Lanes sums[R][C] = {};
  for (int64_t j = 0; j < width; j += LANES) {
    Lanes weights[C];
    // the last tiles fetch past the weights' end: a prefetch is a hint, which never faults
    for (int64_t i = 0; i < C; ++i) __builtin_prefetch(w + (c + i + PREFETCH_CHANNELS) * width + j);
    for (int64_t i = 0; i < C; ++i) weights[i] = widen(w + (c + i) * width + j);
    for (int64_t k = 0; k < R; ++k) {
      const Lanes inputs = load_lanes(x + (r + k) * width + j);
      for (int64_t i = 0; i < C; ++i) sums[k][i] += weights[i] * inputs;
    }
  }
  for (int64_t k = 0; k < R; ++k)
    for (int64_t i = 0; i < C; ++i)
      out[(r + k) * channels + c + i] = BFloat16::store(sum_lanes(sums[k][i]) * scales[c + i].load());
}

template <int64_t C>
void channel_tile(const float* x, const int8_t* w, const BFloat16* scales, BFloat16* out, int64_t c,
                  int64_t rows, int64_t width, int64_t channels) {
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) tile<C, ROWS>(x, w, scales, out, c, r, width, channels);
  for (; r < rows; ++r) tile<C, 1>(x, w, scales, out, c, r, width, channels);
}

}  // namespace

// x: [rows, width] bfloat16, contiguous, width a multiple of LANES; weight: [channels, width] int8;
// scales: [channels] bfloat16; out: [rows, channels] bfloat16
extern "C" void int8_linear_bfloat16(const void* x, const void* weight, const void* scales, void* out,
                                     int64_t rows, int64_t width, int64_t channels, int threads) {
  std::vector<float> wide(rows * width);  // the rows widened once, not once per channel
  const BFloat16* inputs = static_cast<const BFloat16*>(x);
  for (int64_t i = 0; i < rows * width; ++i) wide[i] = inputs[i].load();
  const auto* w = static_cast<const int8_t*>(weight);
  const auto* s = static_cast<const BFloat16*>(scales);
  auto* y = static_cast<BFloat16*>(out);
  const int64_t tiles = channels / CHANNELS;
#pragma omp parallel for num_threads(threads) schedule(static) if (channels * width >= PARALLEL_WEIGHTS)
  for (int64_t t = 0; t < tiles; ++t) channel_tile<CHANNELS>(wide.data(), w, s, y, t * CHANNELS, rows, width, channels);
  for (int64_t c = tiles * CHANNELS; c < channels; ++c) channel_tile<1>(wide.data(), w, s, y, c, rows, width, channels);
}
