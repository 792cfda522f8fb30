// Products of bfloat16 rows with bfloat16 weights laid out in pairs, on CPUs with AVX-512 BF16
// (workers/models/native.py compiles this file; workers/models/linears.py says when it is used):
// y = x W^T + b.
//
// The weights of each 16 output channels lie in pairs of inputs: [channels / 16][width / 2][16][2],
// one 64-byte vector a pair of inputs, what the dot product of pairs (`vdpbf16ps`) takes. Each
// output is one float32 lane that the products of its row's pairs of inputs are added to, pair
// after pair from the first; the bias is added after the last and the sum rounded to bfloat16
// once. The same instructions in the same order compute it whichever rows and channels a call holds
// and whichever thread takes them, so a row has the same bits alone or among any others. A tile of
// up to ROWS rows by CHANNEL_BLOCKS blocks of 16 channels shares each load: a pair of a block's
// weights is read once for the tile's rows, a row's pair of inputs once for its blocks. Each
// block's weights are fetched PREFETCH_PAIRS pairs ahead of those it multiplies.
//
// Where the compiler targets a CPU without AVX-512 BF16, nothing is built: `paired_linear_built`
// says so, and bfloat16 products stay oneDNN's.
#include <cstdint>
#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

extern "C" int paired_linear_built() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t BLOCK = 16;  // output channels a vector of sums holds
// A tile's sums, weights and input fill 28 of the 32 vector registers. Of the tiles timed on 2 cores
// of an AMD EPYC with AVX-512 BF16 over SmolLM2's layers (rows x blocks: 4 x 4, 6 x 4, 4 x 6, 8 x 2,
// 8 x 3, 10 x 2, 12 x 2, 16 x 1), 8 x 3 was the fastest at 64 rows and within 7% of the fastest
// at 1, 4 and 16 (16 x 1, which is 13% slower at 64); 4 x 4 took 1.09-1.2x its time.
constexpr int64_t CHANNEL_BLOCKS = 3;  // blocks of a tile
constexpr int64_t ROWS = 8;  // rows of a tile
constexpr int64_t PREFETCH_PAIRS = 64;  // 4 KB of a block's weights ahead
constexpr int64_t PARALLEL_WEIGHTS = 1 << 16;  // smaller products run on the calling thread alone

// blocks [b, b + C) of rows [r, r + R)
template <int64_t C, int64_t R>
void tile(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t b, int64_t r,
          int64_t width, int64_t channels) {
  const int64_t pairs = width / 2;
  __m512 sums[R][C];
  for (int64_t k = 0; k < R; ++k)
    for (int64_t i = 0; i < C; ++i) sums[k][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh weights[C];
    for (int64_t i = 0; i < C; ++i) {
      const uint16_t* block = w + ((b + i) * pairs + p) * 2 * BLOCK;
      // the last pairs fetch past the block's end: a prefetch is a hint, which never faults
      _mm_prefetch(reinterpret_cast<const char*>(block + PREFETCH_PAIRS * 2 * BLOCK), _MM_HINT_T0);
      weights[i] = (__m512bh)_mm512_loadu_si512(block);
    }
    for (int64_t k = 0; k < R; ++k) {
      uint32_t pair;
      std::memcpy(&pair, x + (r + k) * width + 2 * p, sizeof pair);
      const __m512bh inputs = (__m512bh)_mm512_set1_epi32(int32_t(pair));
      for (int64_t i = 0; i < C; ++i) sums[k][i] = _mm512_dpbf16_ps(sums[k][i], inputs, weights[i]);
    }
  }
  for (int64_t i = 0; i < C; ++i) {
    const int64_t c = (b + i) * BLOCK;
    const __m512 added = bias == nullptr ? _mm512_setzero_ps()
        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(bias + c))), 16));  // bfloat16 to float32: its bits, shifted
    for (int64_t k = 0; k < R; ++k) {
      const __m512 y = bias == nullptr ? sums[k][i] : _mm512_add_ps(sums[k][i], added);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r + k) * channels + c), (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

template <int64_t C>
void blocks(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t b, int64_t rows,
            int64_t width, int64_t channels) {
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) tile<C, ROWS>(x, w, bias, out, b, r, width, channels);
  switch (rows - r) {  // ROWS - 1 at most
    case 7: tile<C, 7>(x, w, bias, out, b, r, width, channels); break;
    case 6: tile<C, 6>(x, w, bias, out, b, r, width, channels); break;
    case 5: tile<C, 5>(x, w, bias, out, b, r, width, channels); break;
    case 4: tile<C, 4>(x, w, bias, out, b, r, width, channels); break;
    case 3: tile<C, 3>(x, w, bias, out, b, r, width, channels); break;
    case 2: tile<C, 2>(x, w, bias, out, b, r, width, channels); break;
    case 1: tile<C, 1>(x, w, bias, out, b, r, width, channels); break;
    default: break;
  }
}

}  // namespace
#endif

// x: [rows, width] bfloat16, contiguous, width even; weight: [channels / 16, width / 2, 16, 2]
// bfloat16, channels a multiple of 16; bias: [channels] bfloat16 or null; out: [rows, channels]
// bfloat16. Call only where `paired_linear_built()`.
extern "C" void paired_linear_bfloat16(const void* x, const void* weight, const void* bias, void* out, int64_t rows,
                                       int64_t width, int64_t channels, int threads) {
#if defined(__AVX512BF16__)
  const auto* inputs = static_cast<const uint16_t*>(x);
  const auto* w = static_cast<const uint16_t*>(weight);
  const auto* b = static_cast<const uint16_t*>(bias);
  auto* y = static_cast<uint16_t*>(out);
  const int64_t count = channels / BLOCK, groups = (count + CHANNEL_BLOCKS - 1) / CHANNEL_BLOCKS;
#pragma omp parallel for num_threads(threads) schedule(static) if (channels * width >= PARALLEL_WEIGHTS)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * CHANNEL_BLOCKS;
    if (first + CHANNEL_BLOCKS <= count) {
      blocks<CHANNEL_BLOCKS>(inputs, w, b, y, first, rows, width, channels);
    } else {
      for (int64_t i = first; i < count; ++i) blocks<1>(inputs, w, b, y, i, rows, width, channels);
    }
  }
#endif
}
