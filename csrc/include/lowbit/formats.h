// Encode/decode of the low-precision formats lowbit stores, for host and device.
//
// Every conversion here is integer bit manipulation of the IEEE float32 input, so the result is
// the same on any CPU and GPU whatever the denormal mode (XLA's CPU threads flush denormals;
// CUDA may be built with -ftz). docs/numerics.md is the specification these functions follow.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LOWBIT_HD __host__ __device__ __forceinline__
#else
#define LOWBIT_HD inline
#endif

namespace lowbit {

// A small-float format: sign bit, `exp_bits` exponent bits with `bias`, `man_bits` mantissa bits.
// `max_bits` is the (unsigned) encoding of the largest finite value; `nan_bits` the canonical NaN.
struct SmallFloat {
  int exp_bits, man_bits, bias;
  uint32_t max_bits, nan_bits;
  bool has_nan;
};

// OCP E4M3 ("fn": no Inf, one NaN pattern S.1111.111). Max 448.
constexpr SmallFloat kE4M3{4, 3, 7, 0x7E, 0x7F, true};
// E5M2 (IEEE-like). Max 57344. Inf is never produced: encoding saturates.
constexpr SmallFloat kE5M2{5, 2, 15, 0x7B, 0x7F, true};
// E2M1 (FP4, no Inf/NaN). Max 6. NaN input encodes as +max (the format cannot hold NaN).
constexpr SmallFloat kE2M1{2, 1, 1, 0x7, 0x7, false};

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr float kE2M1Max = 6.0f;

LOWBIT_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

LOWBIT_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

LOWBIT_HD bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }
LOWBIT_HD bool is_finite_bits(uint32_t u) { return (u & 0x7fffffffu) < 0x7f800000u; }

// |x| with NaN mapped to 0, so max-reductions ignore NaN (fmaxf semantics) and stay finite-free.
LOWBIT_HD float abs_ignore_nan(float x) {
  uint32_t a = float_bits(x) & 0x7fffffffu;
  return a > 0x7f800000u ? 0.0f : bits_float(a);
}

// float32 -> small float: round to nearest, ties to even, saturate to +-max (Inf included),
// NaN -> canonical NaN (or +max for formats without NaN). Returns the encoding in the low bits.
LOWBIT_HD uint32_t encode_rne(float x, SmallFloat f) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 31) << (f.exp_bits + f.man_bits);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f.nan_bits;
  const int emin = 1 - f.bias;  // exponent of the smallest normal
  const int e = int(a >> 23) - 127;
  if (e < emin - f.man_bits - 2)
    return sign;  // far below half the smallest subnormal (f32 subnormals too)
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  const int shift = 23 - f.man_bits + (e < emin ? emin - e : 0);
  // Ties to even on the bits shifted out.
  const uint32_t half_minus_one = (1u << (shift - 1)) - 1u;
  const uint32_t rounded = (mant + half_minus_one + ((mant >> shift) & 1u)) >> shift;
  uint32_t bits;
  if (e < emin) {
    bits = rounded;  // subnormal (or rounds up into the smallest normal: same formula)
  } else {
    bits = (uint32_t(e + f.bias) << f.man_bits) + rounded - (1u << f.man_bits);
  }
  if (bits > f.max_bits) bits = f.max_bits;  // saturate (Inf, and values past max)
  return sign | bits;
}

// Small float -> float32 (exact).
LOWBIT_HD float decode(uint32_t bits, SmallFloat f) {
  const int width = 1 + f.exp_bits + f.man_bits;
  const uint32_t sign = (bits >> (width - 1)) & 1u;
  const uint32_t mag = bits & ((1u << (width - 1)) - 1u);
  if (f.has_nan) {
    // E4M3: only S.1111.111 is NaN. E5M2: exponent all ones is Inf/NaN.
    if (f.exp_bits == 4 && mag == 0x7F) return bits_float(0x7fc00000u);
    if (f.exp_bits == 5 && (mag >> 2) == 0x1F)
      return bits_float((mag & 3u) ? 0x7fc00000u : ((sign << 31) | 0x7f800000u));
  }
  const uint32_t e = mag >> f.man_bits;
  const uint32_t m = mag & ((1u << f.man_bits) - 1u);
  float v;
  if (e == 0) {
    // subnormal: m * 2^(1 - bias - man_bits)
    v = float(m) * bits_float(uint32_t(127 + 1 - f.bias - f.man_bits) << 23);
  } else {
    v = bits_float((uint32_t(int(e) - f.bias + 127) << 23) | (m << (23 - f.man_bits)));
  }
  return sign ? -v : v;
}

// E8M0 scale: value 2^(b - 127); 255 is NaN (never produced by lowbit).
LOWBIT_HD float decode_e8m0(uint8_t b) {
  if (b == 255) return bits_float(0x7fc00000u);
  if (b == 0) return bits_float(0x00400000u);  // 2^-127 is a float32 subnormal
  return bits_float(uint32_t(b) << 23);
}

// The E8M0 exponent for an MX block: the smallest power of two s with amax / s <= fmt_max, so
// the block never saturates. Zero blocks get 2^0. Clamped to the E8M0 range [2^-127, 2^127].
// `fmt_max_bits` is the float32 encoding of the element format's maximum (448 or 57344).
LOWBIT_HD uint8_t mx_scale_e8m0(float amax, float fmt_max) {
  const uint32_t a = float_bits(amax);
  if (a == 0u) return 127;
  if (a >= 0x7f800000u) return 254;  // Inf (NaN never reaches here: amax ignores NaN)
  const uint32_t m = float_bits(fmt_max);
  int e;
  if ((a >> 23) == 0) {
    e = -127;  // float32 subnormal amax: smallest scale is plenty
  } else {
    e = int(a >> 23) - int(m >> 23) + ((a & 0x7fffffu) > (m & 0x7fffffu) ? 1 : 0);
  }
  int biased = e + 127;
  if (biased < 0) biased = 0;
  if (biased > 254) biased = 254;
  return uint8_t(biased);
}

// x * 2^(127 - b): maps an MX block onto the element format. Exact (power of two) and never
// multiplies by a subnormal factor, so flush-to-zero modes cannot change the result.
LOWBIT_HD float apply_e8m0_encode(float x, uint8_t b) {
  const int k = 127 - int(b);  // in [-127, 127]
  if (k >= -126) return x * bits_float(uint32_t(k + 127) << 23);
  return (x * bits_float(uint32_t(-63 + 127) << 23)) * bits_float(uint32_t(k + 63 + 127) << 23);
}

// Tensor scale for current scaling and NVFP4: fmt_max / amax, or 1 when amax is 0 or not finite;
// clamped to the largest float so an extremely small amax cannot produce Inf.
LOWBIT_HD float scale_from_amax(float amax, float fmt_max) {
  if (!(amax > 0.0f) || !is_finite_bits(float_bits(amax))) return 1.0f;
  const float s = fmt_max / amax;
  return is_finite_bits(float_bits(s)) ? s : 3.40282347e38f;
}

// ---- the 16-bit input/output types, without relying on compiler half/bfloat16 types ----

LOWBIT_HD float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

// float32 -> bfloat16, round to nearest even; NaN stays (quiet) NaN.
LOWBIT_HD uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if (is_nan_bits(u)) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

constexpr SmallFloat kF16{5, 10, 15, 0x7BFF, 0x7E00, true};

LOWBIT_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return bits_float(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    const float v = float(m) * bits_float(uint32_t(127 - 24) << 23);  // m * 2^-24
    return sign ? -v : v;
  }
  return bits_float(sign | ((e - 15 + 127) << 23) | (m << 13));
}

// float32 -> float16, round to nearest even; overflow gives Inf as an IEEE cast does.
LOWBIT_HD uint16_t float_to_f16(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t a = u & 0x7fffffffu;
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  if (a > 0x7f800000u) return uint16_t(sign | 0x7E00u);
  // 65520 = max + half an ulp: from there on, round to nearest gives Inf.
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7C00u);
  return uint16_t(sign | encode_rne(bits_float(a), kF16));
}

}  // namespace lowbit
