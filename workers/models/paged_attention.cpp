// Paged attention for bfloat16, float16 and float32 keys and values on the CPU
// (workers/models/native.py compiles this file on first use and says why it exists).
//
// One call serves one layer of one forward: it turns the forward's queries and keys by their
// positions (rotary embeddings, when given their cos and sin), stores the new keys and values in
// their slots of the pool, then computes each query token's attention over the keys of its own
// sequence, read in place from the sequence's blocks (never gathered into a copy), in float32,
// rounded to the output dtype once. Each query's arithmetic depends on its own inputs only: its
// dot products run in fixed lanes over the head's features (LANES keys at a time from its first,
// summed as one key's are), its softmax and weighted sum over its own keys in order, by the same
// code whatever else the call holds. So a token's attention has the same bits alone, in a batch,
// in a prefill chunk of any length, verifying a draft or packed beside other sequences' tokens;
// sharing each key slot's reads among the queries of a work item (up to QUERY_TOKENS of one
// sequence, through one or all of its key/value heads), and the threads, only decide who computes
// what.
//
// The arithmetic is written in GCC's vector types (`Lanes`, vectors.h), which compile to the CPU's
// own vector instructions (-march=native), fused multiply-adds included where it has them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vectors.h"

namespace {

constexpr int64_t QUERY_TOKENS = 8;  // query tokens of one sequence per work item
// query-key pairs below which a call runs on its own thread: waking the others costs more
constexpr int64_t PARALLEL_PAIRS = 4096;
constexpr int64_t PREFETCH_KEYS = 8;  // keys ahead whose slots are fetched while one is widened
// most floats of a work item's widened keys (and as many values) read slot by slot, all heads: 2 MB
constexpr int64_t WHOLE_SLOT_FLOATS = 1 << 19;

// sum_lanes of each of eight vectors, as the lanes of one: the same sums, added in the same order
inline Lanes sum_lanes8(const Lanes* a) {
  Lanes half[4];  // lanes 0-3 plus 4-7: vectors 2p and 2p + 1 side by side
  for (int p = 0; p < 4; ++p)
    half[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
              __builtin_shufflevector(a[2 * p], a[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  Lanes quarter[2];  // then 0-1 plus 2-3: vectors 4p to 4p + 3 side by side
  for (int p = 0; p < 2; ++p)
    quarter[p] = __builtin_shufflevector(half[2 * p], half[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(half[2 * p], half[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(quarter[0], quarter[1], 0, 2, 4, 6, 8, 10, 12, 14) +  // then 0 plus 1
         __builtin_shufflevector(quarter[0], quarter[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

// e^x of each lane, for x <= 0 (Cephes' expf, ~1 ulp): std::exp's calls cost more than the rest
// of a decode step's softmax
inline Lanes exp_nonpositive(Lanes x) {
  const Lanes floor_ = Lanes{} - 87.0f;  // e^-87 is near float32's smallest normal
  x = x < floor_ ? floor_ : x;
  const Lanes shift = Lanes{} + 12582912.0f;  // 1.5 * 2^23: adding and taking it away rounds
  const Lanes n = (x * 1.44269504088896341f + shift) - shift;  // x / ln 2, rounded
  const Lanes r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln 2, in two parts
  Lanes p = Lanes{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const IntLanes exponent = (__builtin_convertvector(n, IntLanes) + 127) << 23;  // 2^n's bits
  Lanes scale;
  std::memcpy(&scale, &exponent, sizeof scale);
  return p * scale;
}

// A call's tokens lie one after another (q, k, v, rope, write, positions, out); the tokens of
// row b (a sequence's, reading its blocks `table[b]`) are those from starts[b] to starts[b + 1].
struct Shape {
  int64_t rows, tokens, heads, kv_heads, dim, n_read, block_size, window;
  int64_t q_token, k_token, v_token;  // element strides from one token to the next
  float scale;
};

// Feature j of a head x turned by its token's `rope` (cos, then sin signed: 2 * d values), rounded
// as torch's operators in T round `x * cos + rotate_half(x) * sin` (rotary.Rotation): each product
// rounded to T, then their sum. So a key written here has the bits the torch operators give it.
template <typename T>
inline T turned(const T* x, const T* rope, int64_t j, int64_t d) {
  const int64_t half = d / 2;
  const float swapped = x[j < half ? j + half : j - half].load();
  const float along = T::store(x[j].load() * rope[j].load()).load();
  const float across = T::store(swapped * rope[d + j].load()).load();
  return T::store(along + across);
}

// q . k over d features (a multiple of LANES), feature j in lane j % LANES, the lanes summed pairwise
inline float dot(const float* q, const float* k, int64_t d) {
  Lanes sums{};
  for (int64_t j = 0; j < d; j += LANES) sums += load_lanes(q + j) * load_lanes(k + j);
  return sum_lanes(sums);
}

// N * LANES features of the weighted sum of values [from, to] (each `stride` apart), keys in
// order: N sums at once, as each add waits on its last
template <int N>
inline void weigh(const float* weights, const float* values, int64_t stride, int64_t from, int64_t to, float* sum) {
  Lanes sums[N] = {};
  for (int64_t key = from; key <= to; ++key)
    for (int n = 0; n < N; ++n) sums[n] += weights[key] * load_lanes(values + key * stride + n * LANES);
  for (int n = 0; n < N; ++n) store_lanes(sum + n * LANES, sums[n]);
}

// Attention of the call's query tokens [t0, t1), all of row b's, through key/value heads [h0, h1):
// the groups of query heads those heads serve, every token's keys from the first its window allows
// to its own. Each key (and value) slot is read once, its heads side by side, and widened to
// float32 once for all those queries.
template <typename T>
void attend(const T* q, const T* rope, const T* k_pool, const T* v_pool, const int64_t* table,
            const int64_t* positions, T* out, const Shape& s, int64_t b, int64_t h0, int64_t h1, int64_t t0,
            int64_t t1) {
  const int64_t group = s.heads / s.kv_heads, d = s.dim, slot_size = s.kv_heads * d;
  const int64_t per_head = (t1 - t0) * group, n_queries = (h1 - h0) * per_head, width = (h1 - h0) * d;
  // Each thread's buffers, grown to the longest range seen and kept: no allocation per call
  thread_local std::vector<int64_t> first, last, offsets;
  thread_local std::vector<float> queries, keys, values, scores, sums;
  first.resize(n_queries);  // each query's keys: [first, last]
  last.resize(n_queries);
  queries.resize(n_queries * d);
  int64_t lo = INT64_MAX, hi = 0;
  for (int64_t kvh = h0; kvh < h1; ++kvh) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pos = positions[t];
      const int64_t from = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
      lo = std::min(lo, from);
      hi = std::max(hi, pos);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = (kvh - h0) * per_head + (t - t0) * group + g;  // query i: head kvh's first
        first[i] = from;
        last[i] = pos;
        const T* src = q + t * s.q_token + (kvh * group + g) * d;
        float* query = &queries[i * d];
        if (rope != nullptr) {
          const T* angles = rope + t * 2 * d;
          for (int64_t j = 0; j < d; ++j) query[j] = turned(src, angles, j, d).load();
        } else {
          for (int64_t j = 0; j < d; ++j) query[j] = src[j].load();
        }
      }
    }
  }
  const int64_t span = hi - lo + 1;
  offsets.resize(span);  // where key lo + n of head h0 lies in the pools (heads h0 to h1 side by side)
  for (int64_t key = lo, block = lo / s.block_size, at = lo % s.block_size; key <= hi; ++key) {
    offsets[key - lo] = (table[b * s.n_read + block] * s.block_size + at) * slot_size + h0 * d;
    if (++at == s.block_size) at = 0, ++block;
  }
  // The range's keys and values, widened to float32 once for every query, read slot after slot
  // with the slots PREFETCH_KEYS ahead on their way from memory
  keys.resize(span * width);
  values.resize(span * width);
  scores.resize(n_queries * span);
  sums.resize(n_queries * d);
  for (int64_t key = 0; key < span; ++key) {
    if (key + PREFETCH_KEYS < span) {
      const char* k_ahead = reinterpret_cast<const char*>(k_pool + offsets[key + PREFETCH_KEYS]);
      const char* v_ahead = reinterpret_cast<const char*>(v_pool + offsets[key + PREFETCH_KEYS]);
      for (int64_t byte = 0; byte < width * int64_t(sizeof(T)); byte += 64) {
        __builtin_prefetch(k_ahead + byte);
        __builtin_prefetch(v_ahead + byte);
      }
    }
    const T* k_slot = k_pool + offsets[key];
    const T* v_slot = v_pool + offsets[key];
    for (int64_t j = 0; j < width; ++j) keys[key * width + j] = k_slot[j].load();
    for (int64_t j = 0; j < width; ++j) values[key * width + j] = v_slot[j].load();
  }
  for (int64_t i = 0; i < n_queries; ++i) {  // each query's dot products, scaled
    const int64_t head = i / per_head * d;  // its key/value head's features in a widened slot
    const float* query = &queries[i * d];
    int64_t key = first[i];
    for (; key + LANES - 1 <= last[i]; key += LANES) {  // LANES keys at once, each its own dot
      Lanes dots[LANES] = {};
      const float* first_key = &keys[(key - lo) * width + head];
      for (int64_t j = 0; j < d; j += LANES) {
        const Lanes features = load_lanes(query + j);
        for (int64_t n = 0; n < LANES; ++n) dots[n] += features * load_lanes(first_key + n * width + j);
      }
      store_lanes(&scores[i * span + key - lo], sum_lanes8(dots) * s.scale);
    }
    for (; key <= last[i]; ++key)
      scores[i * span + key - lo] = dot(query, &keys[(key - lo) * width + head], d) * s.scale;
  }
  // Softmax over each query's own keys, key l of its range in lane l % LANES
  for (int64_t i = 0; i < n_queries; ++i) {
    float* weights = &scores[i * span + (first[i] - lo)];
    const int64_t n = last[i] - first[i] + 1;
    float top = -INFINITY;
    int64_t l = 0;
    if (n >= LANES) {
      Lanes tops = load_lanes(weights);
      for (l = LANES; l + LANES <= n; l += LANES) {
        const Lanes next = load_lanes(weights + l);
        tops = tops > next ? tops : next;
      }
      for (int64_t lane = 0; lane < LANES; ++lane) top = std::max(top, tops[lane]);
    }
    for (; l < n; ++l) top = std::max(top, weights[l]);
    Lanes total{};
    for (l = 0; l + LANES <= n; l += LANES) {
      const Lanes e = exp_nonpositive(load_lanes(weights + l) - top);
      total += e;
      store_lanes(weights + l, e);
    }
    if (l < n) {
      float chunk[LANES] = {};
      const int64_t width = n - l;
      std::memcpy(chunk, weights + l, width * sizeof(float));
      store_lanes(chunk, exp_nonpositive(load_lanes(chunk) - top));
      std::fill(chunk + width, chunk + LANES, 0.0f);  // past the range: no weight
      total += load_lanes(chunk);
      std::memcpy(weights + l, chunk, width * sizeof(float));
    }
    const float inverse = 1.0f / sum_lanes(total);
    for (l = 0; l < n; ++l) weights[l] *= inverse;
  }
  // The weighted sum of the values, keys in order, LANES features at a time
  for (int64_t i = 0; i < n_queries; ++i) {
    const float* weights = &scores[i * span];  // key lo + n at n
    float* sum = &sums[i * d];
    const int64_t head = i / per_head * d;
    int64_t j = 0;
    for (; j + 8 * LANES <= d; j += 8 * LANES) weigh<8>(weights, &values[head + j], width, first[i] - lo, last[i] - lo, sum + j);
    for (; j + 4 * LANES <= d; j += 4 * LANES) weigh<4>(weights, &values[head + j], width, first[i] - lo, last[i] - lo, sum + j);
    for (; j < d; j += LANES) weigh<1>(weights, &values[head + j], width, first[i] - lo, last[i] - lo, sum + j);
  }
  for (int64_t kvh = h0; kvh < h1; ++kvh) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = (kvh - h0) * per_head + (t - t0) * group + g;
        T* dst = out + (t * s.heads + kvh * group + g) * d;
        for (int64_t j = 0; j < d; ++j) dst[j] = T::store(sums[i * d + j]);
      }
    }
  }
}

template <typename T>
void paged_attention(const T* q, const T* k, const T* v, const T* rope, T* k_pool, T* v_pool,
                     const int64_t* write, const int64_t* table, const int64_t* positions,
                     const int64_t* starts, T* out, const Shape& s, int threads) {
  const int64_t d = s.dim, slot_size = s.kv_heads * d;
  for (int64_t t = 0; t < s.tokens; ++t) {  // the new keys and values first: later tokens read them
    const int64_t to = write[t] * slot_size;
    const T* key = k + t * s.k_token;
    if (rope != nullptr) {
      const T* angles = rope + t * 2 * d;
      for (int64_t h = 0; h < s.kv_heads; ++h)
        for (int64_t j = 0; j < d; ++j) k_pool[to + h * d + j] = turned(key + h * d, angles, j, d);
    } else {
      std::memcpy(k_pool + to, key, slot_size * sizeof(T));
    }
    std::memcpy(v_pool + to, v + t * s.v_token, slot_size * sizeof(T));
  }
  int64_t longest = 0;
  for (int64_t b = 0; b < s.rows; ++b) longest = std::max(longest, starts[b + 1] - starts[b]);
  const int64_t chunks = (longest + QUERY_TOKENS - 1) / QUERY_TOKENS;
  // A work item attends through every key/value head of its slots where the items are enough to
  // keep the threads busy and its widened slots stay small, else through one (a long prompt's few
  // chunks, one sequence's decode, long contexts: each thread keeps its buffers, grown to the
  // longest range it has seen)
  const bool whole_slots =
      s.rows * chunks >= 4 * threads && s.n_read * s.block_size * slot_size <= WHOLE_SLOT_FLOATS;
  const int64_t parts = whole_slots ? 1 : s.kv_heads;
  const int64_t items = s.rows * parts * chunks;
  const int64_t pairs = s.tokens * s.heads * s.n_read * s.block_size;  // at most
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (items > 1 && pairs >= PARALLEL_PAIRS)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t chunk = item % chunks, part = item / chunks % parts, b = item / chunks / parts;
    const int64_t h0 = part * s.kv_heads / parts, h1 = (part + 1) * s.kv_heads / parts;
    const int64_t t0 = starts[b] + chunk * QUERY_TOKENS;
    const int64_t t1 = std::min(starts[b + 1], t0 + QUERY_TOKENS);
    if (t0 < t1) attend(q, rope, k_pool, v_pool, table, positions, out, s, b, h0, h1, t0, t1);
  }
}

}  // namespace

#define PAGED_ATTENTION(NAME, T)                                                                   \
  extern "C" void NAME(const void* q, const void* k, const void* v, const void* rope,             \
                       void* k_pool, void* v_pool, const int64_t* write, const int64_t* table,     \
                       const int64_t* positions, const int64_t* starts, void* out,                 \
                       const int64_t* dims, float scale, int threads) {                            \
    const Shape s{dims[0], dims[1], dims[2], dims[3], dims[4],  dims[5],                           \
                  dims[6], dims[7], dims[8], dims[9], dims[10], scale};                            \
    paged_attention(static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),  \
                    static_cast<const T*>(rope), static_cast<T*>(k_pool), static_cast<T*>(v_pool), \
                    write, table, positions, starts, static_cast<T*>(out), s, threads);            \
  }

PAGED_ATTENTION(paged_attention_bfloat16, BFloat16)
PAGED_ATTENTION(paged_attention_float16, Float16)
PAGED_ATTENTION(paged_attention_float32, Float32)
