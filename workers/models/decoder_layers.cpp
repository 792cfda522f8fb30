// A served bfloat16 forward's decoder layers in one call, where each layer's four products take
// one of reflow's kernels: all paired (paired_linear.cpp) or all int8 (int8_linear.cpp, a weight-only
// copy's). workers/models/native.py compiles this file; workers/models/served_forward.py says when
// it is used. Per layer, x += o(attention(qkv(norm(x)))), then x += down(silu(gate) * up) of
// gate_up(norm(x)).
//
// The same kernels as the served forward's calls of them, on the same values in the same order
// (rms_norm.cpp, paired_linear.cpp or int8_linear.cpp, paged_attention.cpp), so the same bits; what
// was torch's is computed as torch computes it in bfloat16: a residual sum, an int8 product's bias
// and the product of silu(gate) and up each in float32 from the two bfloat16 values, rounded to
// bfloat16 once, and silu(gate) read from `silu`, torch's own silu of every bfloat16 value
// (native.silu_table). Called from Python a layer was 14 kernel and operator calls, each taking the
// interpreter's lock back; in one call SmolLM2's bfloat16 token at one stream took 9.6-9.9 ms in
// process where it took 11.7 (2 cores of an AMD EPYC with AVX-512 BF16; docs/benchmarks.md). The
// residual sums and silu(gate) * up of more than PARALLEL_ELEMENTS values are split between the
// threads, as rms_norm.cpp splits rows.
#include <cstdint>
#include <vector>

#include "vectors.h"

extern "C" void rms_norm_bfloat16(const void* x, const void* weight, void* out, int64_t rows, int64_t width,
                                  float eps, int threads);
extern "C" void paired_linear_bfloat16(const void* x, const void* weight, const void* bias, void* out, int64_t rows,
                                       int64_t width, int64_t channels, int threads);
extern "C" void int8_linear_bfloat16(const void* x, const void* weight, const void* scales, void* out,
                                     int64_t rows, int64_t width, int64_t channels, int threads);
extern "C" void paged_attention_bfloat16(const void* q, const void* k, const void* v, const void* rope,
                                         void* k_pool, void* v_pool, const int64_t* write, const int64_t* table,
                                         const int64_t* positions, const int64_t* starts, void* out,
                                         const int64_t* dims, float scale, int threads);

namespace {

// a layer's pointers, in this order (native.LAYER_POINTERS): a product's weights, then its scales and
// its bias (null where it has none)
enum Pointer {
  INPUT_NORM, QKV, QKV_SCALES, QKV_BIAS, O, O_SCALES, O_BIAS, POST_NORM, GATE_UP, GATE_UP_SCALES, GATE_UP_BIAS,
  DOWN, DOWN_SCALES, DOWN_BIAS, POINTERS
};
constexpr int SCALES = 1, BIAS = 2;  // a product's scales and bias, after its weights
constexpr int64_t PARALLEL_ELEMENTS = 1 << 15;  // fewer elements run on the calling thread alone

void add_into(BFloat16* x, const BFloat16* y, int64_t count, int threads) {  // x += y, as torch adds bfloat16
#pragma omp parallel for num_threads(threads) if (count >= PARALLEL_ELEMENTS)
  for (int64_t i = 0; i < count; ++i) x[i] = BFloat16::store(x[i].load() + y[i].load());
}

// out [rows, channels] += bias [channels], as torch adds bfloat16
void add_bias(BFloat16* out, const BFloat16* bias, int64_t rows, int64_t channels, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * channels >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < channels; ++c)
      out[r * channels + c] = BFloat16::store(out[r * channels + c].load() + bias[c].load());
}

// hidden [rows, width] = silu(gate) * up of gate_up [rows, 2 * width] (gate, then up), as torch
// multiplies bfloat16, silu(gate) read from `silu` by gate's bits
void gate_into(BFloat16* hidden, const BFloat16* gate_up, const BFloat16* silu, int64_t rows, int64_t width,
               int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r) {
    const BFloat16* gate = gate_up + r * 2 * width;
    for (int64_t j = 0; j < width; ++j)
      hidden[r * width + j] = BFloat16::store(silu[gate[j].bits].load() * gate[width + j].load());
  }
}

// a product's weights, scales and bias as each kernel takes them: out [rows, channels] = x W^T + b
struct Paired {
  static void apply(const void* x, const void* const* product, void* out, int64_t rows, int64_t width,
                    int64_t channels, int threads) {
    paired_linear_bfloat16(x, product[0], product[BIAS], out, rows, width, channels, threads);
  }
};

struct Int8 {  // the bias added to the rounded product, as WeightOnlyLinear adds it (precision.py)
  static void apply(const void* x, const void* const* product, void* out, int64_t rows, int64_t width,
                    int64_t channels, int threads) {
    int8_linear_bfloat16(x, product[0], product[SCALES], out, rows, width, channels, threads);
    if (product[BIAS] != nullptr)
      add_bias(static_cast<BFloat16*>(out), static_cast<const BFloat16*>(product[BIAS]), rows, channels, threads);
  }
};

template <class Product>
void decoder_layers(void* x, const void* const* layers, int64_t count, void* k_pools, void* v_pools,
                    int64_t pool_stride, const int64_t* write, const int64_t* table, const int64_t* positions,
                    const int64_t* starts, const void* rope, const int64_t* attention_dims, float scale,
                    const int64_t* sizes, float eps, const void* silu, int threads) {
  const int64_t rows = attention_dims[1], dim = sizes[0], q_width = sizes[1], kv_width = sizes[2];
  const int64_t width = sizes[3], qkv_width = q_width + 2 * kv_width;
  std::vector<BFloat16> normed(rows * dim), qkv(rows * qkv_width), attended(rows * q_width), added(rows * dim),
      gate_up(rows * 2 * width), hidden(rows * width);
  auto* residual = static_cast<BFloat16*>(x);
  const auto* silu_of = static_cast<const BFloat16*>(silu);
  for (int64_t i = 0; i < count; ++i) {
    const void* const* layer = layers + i * POINTERS;
    rms_norm_bfloat16(residual, layer[INPUT_NORM], normed.data(), rows, dim, eps, threads);
    Product::apply(normed.data(), layer + QKV, qkv.data(), rows, dim, qkv_width, threads);
    BFloat16* q = qkv.data();
    paged_attention_bfloat16(q, q + q_width, q + q_width + kv_width, rope,
                             static_cast<BFloat16*>(k_pools) + i * pool_stride,
                             static_cast<BFloat16*>(v_pools) + i * pool_stride, write, table, positions, starts,
                             attended.data(), attention_dims, scale, threads);
    Product::apply(attended.data(), layer + O, added.data(), rows, q_width, dim, threads);
    add_into(residual, added.data(), rows * dim, threads);
    rms_norm_bfloat16(residual, layer[POST_NORM], normed.data(), rows, dim, eps, threads);
    Product::apply(normed.data(), layer + GATE_UP, gate_up.data(), rows, dim, 2 * width, threads);
    gate_into(hidden.data(), gate_up.data(), silu_of, rows, width, threads);
    Product::apply(hidden.data(), layer + DOWN, added.data(), rows, width, dim, threads);
    add_into(residual, added.data(), rows * dim, threads);
  }
}

}  // namespace

// x: [rows, dim] bfloat16, contiguous, updated in place. layers: POINTERS a layer, the products'
// weights laid out for their kernel (native.pairs_of, native.blocks_of). k_pools, v_pools: [layers,
// slots, kv_heads, head] bfloat16, `pool_stride` elements a layer. write ... attention_dims: the
// forward's bound attention (native.bind_attention, its token strides those of q, k and v in the
// qkv product's rows). sizes: dim, q_width, kv_width, intermediate width. silu: 65,536 bfloat16,
// silu of each value by its bits. int8: whether the products are int8 (else paired).
extern "C" void decoder_layers_bfloat16(void* x, const void* const* layers, int64_t count, void* k_pools,
                                        void* v_pools, int64_t pool_stride, const int64_t* write,
                                        const int64_t* table, const int64_t* positions, const int64_t* starts,
                                        const void* rope, const int64_t* attention_dims, float scale,
                                        const int64_t* sizes, float eps, const void* silu, int int8, int threads) {
  auto* layers_with = int8 ? decoder_layers<Int8> : decoder_layers<Paired>;
  layers_with(x, layers, count, k_pools, v_pools, pool_stride, write, table, positions, starts, rope, attention_dims,
              scale, sizes, eps, silu, threads);
}
