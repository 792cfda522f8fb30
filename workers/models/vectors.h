// The element types and float32 lanes reflow's C++ kernels compute with (paged_attention.cpp,
// rms_norm.cpp; workers/models/native.py compiles them): each type loads to float32 and stores
// back rounded as torch rounds, and `Lanes` are GCC's vector types, which compile to the CPU's own
// vector instructions (-march=native), fused multiply-adds included where it has them.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t LANES = 8;  // floats a vector holds: a dot product's running sums, a softmax's

struct BFloat16 {
  uint16_t bits;
  float load() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static BFloat16 store(float f) {  // round to nearest even, as torch rounds
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return {uint16_t(u >> 16)};
  }
};

struct Float16 {
  _Float16 value;
  float load() const { return float(value); }
  static Float16 store(float f) {
    Float16 h{_Float16(f)};
    // rounded here, in memory: g++ may otherwise carry a _Float16 in float's precision into the
    // arithmetic that loads it (its excess precision, which C++ cannot turn off in GCC 12)
    asm("" : "+m"(h.value));
    return h;
  }
};

struct Float32 {
  float value;
  float load() const { return value; }
  static Float32 store(float f) {
    Float32 x{f};
    // in memory here, so that g++ never fuses a product stored this way into the sum that loads it
    // (a fused multiply-add rounds once where torch's float32 operators round twice)
    asm("" : "+m"(x.value));
    return x;
  }
};

using Lanes = float __attribute__((vector_size(LANES * sizeof(float))));
using IntLanes = int32_t __attribute__((vector_size(LANES * sizeof(int32_t))));
using HalfLanes = float __attribute__((vector_size(LANES / 2 * sizeof(float))));
using QuarterLanes = float __attribute__((vector_size(LANES / 4 * sizeof(float))));

inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_lanes(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }

inline float sum_lanes(Lanes v) {  // pairwise: lanes 0-3 plus 4-7, then 0-1 plus 2-3, then 0 plus 1
  const HalfLanes half = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  const QuarterLanes quarter = __builtin_shufflevector(half, half, 0, 1) + __builtin_shufflevector(half, half, 2, 3);
  return quarter[0] + quarter[1];
}

}  // namespace
