// Products of bfloat16 rows with int8 weights on the CPU, one symmetric scale per GROUP inputs of
// each output channel (workers/models/native.py compiles this file; workers/models/precision.py says
// when it is used): y = sum over groups of scale * (x W^T over the group's inputs).
//
// The weights of each 16 output channels lie together input by input: [channels / 16][width][16],
// the 16 bytes of one input widened to 16 float32 lanes (`vpmovsxbd`, `vcvtdq2ps`: one vector with
// AVX-512, two with AVX2), and their scales likewise, [channels / 16][groups][16] bfloat16. Each
// output is one float32 lane that its row's inputs times its weights are added to, input after
// input from the group's first (a fused multiply-add each, where the CPU has them); each group's
// sum times its scale is added to a second lane, group after group, and that is rounded to bfloat16
// once. The same instructions in the same order compute it whichever rows and channels a call holds
// and whichever thread takes them, so a row has the same bits alone or among any others, and each
// lane's the same with AVX-512 or AVX2. A tile of up to ROWS rows of one block shares each load:
// the block's weights are widened once for the tile's rows. Each block's weights are fetched
// PREFETCH_BYTES ahead of those it multiplies, one cache line at a time. Laid out so, a block's
// weights are one stream read front to back: the earlier kernel of this file read each channel's
// weights as a stream of its own (a layout of [channels][width]) and took SmolLM2's int8 layers at
// one row at 12-17 GB/s on 2 cores of an AMD EPYC that reads 27 (docs/benchmarks.md).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vectors.h"

namespace {

constexpr int64_t BLOCK = 16;  // output channels whose weights lie together
constexpr int64_t GROUP = 32;  // inputs of a scale (native.INT8_GROUP)
#if defined(__AVX512F__)
constexpr int64_t WIDE = 16;  // floats of one of the CPU's vectors: a block's sums are one
// A tile's two sums take 16 of the 32 vector registers. Of the tiles timed on 2 cores of an AMD EPYC
// over SmolLM2's products (rows x blocks: 4 x 3, 6 x 2, 8 x 1, 12 x 1), 8 x 1 was the fastest at 1
// and 16 rows and within the noise of 12 x 1 at 64; 4 x 3 took up to 1.4x its time at 16 and 64.
constexpr int64_t ROWS = 8;  // rows of a tile
#else  // AVX2's 16 registers of 8 floats: a block's sums take two
constexpr int64_t WIDE = 8;
// Of tiles of 2 to 8 rows timed on 2 cores of an AMD EPYC with AVX2 over SmolLM2's products, 4 and 5
// were the fastest at 16 and 64 rows (46-51 and 145-185 ms; 2 rows 74-79 and 207-276)
constexpr int64_t ROWS = 4;
#endif
constexpr int64_t PARTS = BLOCK / WIDE;  // vectors of a block's sums
constexpr int64_t LINE = 64;  // bytes of a cache line: 4 inputs of a block
constexpr int64_t PREFETCH_BYTES = 4096;  // how far ahead in a block a tile fetches its weights
constexpr int64_t PARALLEL_WEIGHTS = 1 << 16;  // smaller products run on the calling thread alone

using Wide = float __attribute__((vector_size(WIDE * sizeof(float))));

// Each converts with the CPU's own instructions, one vector of the CPU's at a time: GCC converts a
// vector wider than the CPU's one element at a time (on an AMD EPYC with AVX2, the int8 copy of
// SmolLM2 took 71-77 ms a step at one row while a block's 16 sums were one vector, 8-13 since).
inline Wide widen(const int8_t* p) {  // WIDE weights of one input, as floats
#if defined(__AVX512F__)
  return Wide(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return Wide(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  using Bytes = int8_t __attribute__((vector_size(WIDE)));
  Bytes bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(bytes, Wide);
#endif
}

inline Wide widen(const BFloat16* p) {  // WIDE scales of one group, as floats: their bits, shifted
#if defined(__AVX512F__)
  return Wide(_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)));
#elif defined(__AVX2__)
  return Wide(_mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16)));
#else
  Wide scales;
  for (int64_t l = 0; l < WIDE; ++l) scales[l] = p[l].load();
  return scales;
#endif
}

// block b of rows [r, r + R): x [rows, width] float32, w [blocks][width][BLOCK] int8, scales
// [blocks][groups][BLOCK]
template <int64_t R>
void tile(const float* x, const int8_t* w, const BFloat16* scales, BFloat16* out, int64_t b, int64_t r,
          int64_t width, int64_t channels) {
  const int64_t groups = (width + GROUP - 1) / GROUP;
  Wide totals[R][PARTS] = {};
  for (int64_t g = 0; g < groups; ++g) {
    Wide sums[R][PARTS] = {};
    for (int64_t j = g * GROUP, end = std::min(width, j + GROUP); j < end; ++j) {
      const int8_t* block = w + (b * width + j) * BLOCK;
      // the last lines fetch past the block's end: a prefetch is a hint, which never faults
      if (j % (LINE / BLOCK) == 0) __builtin_prefetch(block + PREFETCH_BYTES);
      for (int64_t p = 0; p < PARTS; ++p) {
        const Wide weights = widen(block + p * WIDE);
        for (int64_t k = 0; k < R; ++k) sums[k][p] += weights * x[(r + k) * width + j];
      }
    }
    for (int64_t p = 0; p < PARTS; ++p) {
      const Wide scale = widen(scales + (b * groups + g) * BLOCK + p * WIDE);
      for (int64_t k = 0; k < R; ++k) totals[k][p] += sums[k][p] * scale;
    }
  }
  for (int64_t k = 0; k < R; ++k) {
    BFloat16* row = out + (r + k) * channels + b * BLOCK;
    for (int64_t p = 0; p < PARTS; ++p) {
      for (int64_t l = 0; l < WIDE; ++l) row[p * WIDE + l] = BFloat16::store(totals[k][p][l]);
    }
  }
}

template <int64_t R = ROWS>
void block_rows(const float* x, const int8_t* w, const BFloat16* scales, BFloat16* out, int64_t b, int64_t rows,
                int64_t width, int64_t channels) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) tile<R>(x, w, scales, out, b, r, width, channels);
  if constexpr (R > 1) {  // the rest, fewer than R rows: R - 1 of them, then what remains
    if (r < rows) block_rows<R - 1>(x + r * width, w, scales, out + r * channels, b, rows - r, width, channels);
  }
}

}  // namespace

// x: [rows, width] bfloat16, contiguous; weight: [channels / 16, width, 16] int8 and scales:
// [channels / 16, groups, 16] bfloat16 (native.blocks_of), channels a multiple of 16; out: [rows,
// channels] bfloat16
extern "C" void int8_linear_bfloat16(const void* x, const void* weight, const void* scales, void* out,
                                     int64_t rows, int64_t width, int64_t channels, int threads) {
  std::vector<float> wide(rows * width);  // the rows widened once, not once per block
  const BFloat16* inputs = static_cast<const BFloat16*>(x);
  for (int64_t i = 0; i < rows * width; ++i) wide[i] = inputs[i].load();
  const auto* w = static_cast<const int8_t*>(weight);
  const auto* s = static_cast<const BFloat16*>(scales);
  auto* y = static_cast<BFloat16*>(out);
#pragma omp parallel for num_threads(threads) schedule(static) if (channels * width >= PARALLEL_WEIGHTS)
  for (int64_t b = 0; b < channels / BLOCK; ++b) block_rows(wide.data(), w, s, y, b, rows, width, channels);
}
