// PyTorch's CPU normal_ and uniform_ (aten/src/ATen/native/cpu/DistributionTemplates.h:
// normal_fill with NormalFill16<float>, uniform_kernel) for float32, bfloat16 and float16,
// written again without their per-draw overheads: the same MT19937 draws
// (ATen/core/MT19937RNGEngine.h), the same uniforms, the same Box-Muller of each block of 16,
// the same roundings, so the same bits and the same generator state after. Compiled on first use by core/rng/native_fill.py, which trusts it only
// after comparing it with torch's own kernel in the process (values and generator state).
//
// JMI_AVX2: torch's AVX2 kernel (log256_ps/sincos256_ps from torch's own avx_mathfun.h, an FMA
// at the end); otherwise its scalar one (std::log/cos/sin/sqrt/fma on floats), which is what
// torch runs where its CPU capability is not AVX2.
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef JMI_AVX2
#define CPU_CAPABILITY_AVX2
#include <ATen/native/cpu/avx_mathfun.h>
#include <immintrin.h>
#endif

namespace {

constexpr int kN = 624;
constexpr int kM = 397;
// Byte offsets in CPUGeneratorImplState (torch.Generator().get_state(): 5056 bytes).
constexpr int kLeft = 8;
constexpr int kNext = 16;
constexpr int kWords = 24;

struct Engine {
  uint32_t s[kN];
  int32_t left;
  uint64_t next;

  void load(const uint8_t *state) {
    std::memcpy(&left, state + kLeft, 4);
    std::memcpy(&next, state + kNext, 8);
    for (int i = 0; i < kN; i++) {
      uint64_t w;
      std::memcpy(&w, state + kWords + 8 * i, 8);
      s[i] = (uint32_t)w;
    }
  }
  void store(uint8_t *state) const {
    std::memcpy(state + kLeft, &left, 4);
    std::memcpy(state + kNext, &next, 8);
    for (int i = 0; i < kN; i++) {
      uint64_t w = s[i];
      std::memcpy(state + kWords + 8 * i, &w, 8);
    }
  }
  static uint32_t twist(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
  }
  void next_state() {
    uint32_t *p = s;
    left = kN;
    next = 0;
    for (int j = kN - kM + 1; --j; p++) *p = p[kM] ^ twist(p[0], p[1]);
    for (int j = kM; --j; p++) *p = p[kM - kN] ^ twist(p[0], p[1]);
    *p = p[kM - kN] ^ twist(p[0], s[0]);
  }
  // n draws, as n calls of the engine (``if (--left == 0) next_state(); temper(s[next++])``).
  void draws(uint32_t *out, int64_t n) {
    int64_t k = 0;
    while (k < n) {
      if (left == 1) {  // the next draw would twist: twist now
        next_state();
        left = kN + 1;
      }
      const int64_t ready = left - 1;
      const int64_t take = n - k < ready ? n - k : ready;
      const uint32_t *src = s + next;
      for (int64_t j = 0; j < take; j++) {
        uint32_t y = src[j];
        y ^= (y >> 11);
        y ^= (y << 7) & 0x9d2c5680u;
        y ^= (y << 15) & 0xefc60000u;
        y ^= (y >> 18);
        out[k + j] = y;
      }
      next += take;
      left -= (int32_t)take;
      k += take;
    }
  }
};

// at::uniform_real_distribution<float>(0, 1): 24 bits of a draw, times 2^-24.
inline void uniforms(Engine &e, uint32_t *raw, float *out, int64_t n) {
  e.draws(raw, n);
  for (int64_t j = 0; j < n; j++) out[j] = (float)(raw[j] & 0xffffffu) * (1.0f / 16777216.0f);
}

#ifdef JMI_AVX2
inline void fill16(float *d, float mean, float sd) {
  const __m256 u1 = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_loadu_ps(d));
  const __m256 u2 = _mm256_loadu_ps(d + 8);
  const __m256 radius = _mm256_sqrt_ps(_mm256_mul_ps(_mm256_set1_ps(-2.0f), log256_ps(u1)));
  const __m256 theta = _mm256_mul_ps(_mm256_set1_ps(2.0f * 3.14159265358979323846), u2);
  __m256 sintheta, costheta;
  sincos256_ps(theta, &sintheta, &costheta);
  const __m256 n1 = _mm256_mul_ps(radius, costheta);
  const __m256 n2 = _mm256_mul_ps(radius, sintheta);
  _mm256_storeu_ps(d, _mm256_fmadd_ps(n1, _mm256_set1_ps(sd), _mm256_set1_ps(mean)));
  _mm256_storeu_ps(d + 8, _mm256_fmadd_ps(n2, _mm256_set1_ps(sd), _mm256_set1_ps(mean)));
}
#else
inline void fill16(float *d, float mean, float sd) {
  for (int j = 0; j < 8; j++) {
    const float u1 = 1 - d[j];
    const float u2 = d[j + 8];
    const float radius = std::sqrt(-2 * std::log(u1));
    const float theta = 2.0f * 3.14159265358979323846 * u2;
    d[j] = std::fma(radius * std::cos(theta), sd, mean);
    d[j + 8] = std::fma(radius * std::sin(theta), sd, mean);
  }
}
#endif

// c10::BFloat16(float): round to nearest even (NaN: 0x7fc0).
inline uint16_t to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (uint16_t)((u + (((u >> 16) & 1u) + 0x7fffu)) >> 16);
}

// c10::Half(float) (c10::detail::fp16_ieee_from_fp32_value): round to nearest even.
inline uint16_t to_f16(float f) {
#ifdef JMI_AVX2
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);  // F16C: the same rounding, one instruction
#endif
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  uint32_t w;
  std::memcpy(&w, &f, 4);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
  float bias_f;
  std::memcpy(&bias_f, &bias_bits, 4);
  base = bias_f + base;
  uint32_t bits;
  std::memcpy(&bits, &base, 4);
  const uint32_t exp_bits = (bits >> 13) & 0x00007c00u;
  const uint32_t mantissa_bits = bits & 0x00000fffu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

constexpr int64_t kTile = 1024;  // a multiple of 16

template <int kDtype>
inline void store(void *out, int64_t at, const float *v, int64_t n) {
  if (kDtype == 0) {
    std::memcpy((float *)out + at, v, 4 * n);
  } else if (kDtype == 1) {
    uint16_t *o = (uint16_t *)out + at;
    for (int64_t j = 0; j < n; j++) o[j] = to_bf16(v[j]);
  } else {
    uint16_t *o = (uint16_t *)out + at;
    int64_t j = 0;
#ifdef JMI_AVX2
    // F16C rounds to nearest even as c10::Half does (the same bits for every finite float)
    for (; j + 8 <= n; j += 8)
      _mm_storeu_si128((__m128i *)(o + j), _mm256_cvtps_ph(_mm256_loadu_ps(v + j), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; j < n; j++) o[j] = to_f16(v[j]);
  }
}

template <int kDtype>
void normal_fill(void *out, int64_t size, float mean, float sd, Engine &e) {
  alignas(64) uint32_t raw[kTile];
  alignas(64) float tile[kTile];
  const int64_t full = size / 16 * 16;
  for (int64_t i = 0; i < full; i += kTile) {
    const int64_t n = full - i < kTile ? full - i : kTile;
    uniforms(e, raw, tile, n);
    for (int64_t j = 0; j < n; j += 16) fill16(tile + j, mean, sd);
    store<kDtype>(out, i, tile, n);
  }
  if (size % 16 != 0) {
    // float32 draws a uniform for every element first (the last ones are overwritten below);
    // bfloat16/float16 draw per block of 16. Then the last 16 are drawn and made again.
    if (kDtype == 0) e.draws(raw, size - full);
    uniforms(e, raw, tile, 16);
    fill16(tile, mean, sd);
    store<kDtype>(out, size - 16, tile, 16);
  }
}

// uniform_kernel: each element one draw, ``x * (to - from) + from`` in float (written as torch
// writes it, so the compiler contracts it where torch's build does), cast to the dtype; a value
// the cast rounds up to ``to`` becomes ``from``.
inline float dtype_value(uint16_t bits, int kind) {
  uint32_t u;
  if (kind == 1) {
    u = (uint32_t)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
#ifdef JMI_AVX2
  return _cvtsh_ss(bits);
#else
  // c10::detail::fp16_ieee_to_fp32_value for the finite values a uniform_ makes
  const uint32_t sign = (uint32_t)(bits & 0x8000u) << 16;
  uint32_t exp = (bits >> 10) & 0x1fu, man = bits & 0x3ffu;
  if (exp == 0) {
    float f = (float)man * 0x1.0p-24f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

template <int kDtype>
void uniform_fill(void *out, int64_t size, float from, float to, float from_s, float to_s, Engine &e) {
  alignas(64) uint32_t raw[kTile];
  for (int64_t i = 0; i < size; i += kTile) {
    const int64_t n = size - i < kTile ? size - i : kTile;
    e.draws(raw, n);
    for (int64_t j = 0; j < n; j++) {
      const float x = (float)(raw[j] & 0xffffffu) * (1.0f / 16777216.0f);
      const float v = (x * (to - from) + from);
      if (kDtype == 0) {
        ((float *)out)[i + j] = v == to_s ? from_s : v;
      } else {
        const uint16_t b = kDtype == 1 ? to_bf16(v) : to_f16(v);
        ((uint16_t *)out)[i + j] =
            dtype_value(b, kDtype) == to_s ? (kDtype == 1 ? to_bf16(from_s) : to_f16(from_s)) : b;
      }
    }
  }
}

}  // namespace

// uniform_(from, to) of ``size`` contiguous elements at ``out`` (dtype as below), drawing from
// ``state`` (updated in place).
extern "C" int jmi_uniform_fill(void *out, int dtype, int64_t size, double from, double to,
                                uint8_t *state) {
  if (size < 1 || dtype < 0 || dtype > 2) return -1;
  Engine e;
  e.load(state);
  if (e.left < 1 || e.next + (uint64_t)e.left > (uint64_t)kN + 1) return -1;
  const float f = (float)from, t = (float)to;
  // from/to as the dtype holds them (static_cast<scalar_t>(double): through float)
  const float fs = dtype == 0 ? f : dtype_value(dtype == 1 ? to_bf16(f) : to_f16(f), dtype);
  const float ts = dtype == 0 ? t : dtype_value(dtype == 1 ? to_bf16(t) : to_f16(t), dtype);
  if (dtype == 0) uniform_fill<0>(out, size, f, t, fs, ts, e);
  else if (dtype == 1) uniform_fill<1>(out, size, f, t, fs, ts, e);
  else uniform_fill<2>(out, size, f, t, fs, ts, e);
  e.store(state);
  return 0;
}

// normal_(mean, std) of ``size`` (>= 16) contiguous elements at ``out`` (dtype 0: float32,
// 1: bfloat16, 2: float16), drawing from the generator state ``state`` (its 5056 bytes, updated
// in place). Returns 0, or -1 for arguments torch's kernel would not take this way.
extern "C" int jmi_normal_fill(void *out, int dtype, int64_t size, double mean, double sd,
                               uint8_t *state) {
  if (size < 16 || dtype < 0 || dtype > 2) return -1;
  Engine e;
  e.load(state);
  if (e.left < 1 || e.next + (uint64_t)e.left > (uint64_t)kN + 1) return -1;  // not a state torch makes
  const float m = (float)mean, s = (float)sd;
  if (dtype == 0) normal_fill<0>(out, size, m, s, e);
  else if (dtype == 1) normal_fill<1>(out, size, m, s, e);
  else normal_fill<2>(out, size, m, s, e);
  e.store(state);
  return 0;
}
