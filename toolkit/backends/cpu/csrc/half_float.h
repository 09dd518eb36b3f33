// Scalar conversions between float32 and the half types the CPU kernels store, as torch does them:
// bfloat16 (kept as uint16_t: the high half of a float32) and IEEE half (gcc's _Float16, a distinct
// type). Float -> half rounds to nearest even and keeps NaN and inf. Included by the kernels beside it;
// toolkit/backends/cpu/build.py keys each build on the local headers a source includes.

#pragma once

#include <cstdint>
#include <cstring>

namespace {

typedef _Float16 f16;

inline float to_float(float v) { return v; }
inline float to_float(f16 h) { return float(h); }
inline float to_float(uint16_t bf16) {
    const uint32_t bits = uint32_t(bf16) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
}

inline void put(float* p, float v) { *p = v; }
inline void put(f16* p, float v) { *p = f16(v); }
inline void put(uint16_t* p, float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN stays a (quiet) NaN
        *p = uint16_t((bits >> 16) | 0x40);
        return;
    }
    *p = uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace
