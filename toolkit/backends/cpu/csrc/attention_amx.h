// Attention on AMX tiles, bf16 (attention.cpp's flash requests and cascades' shared parts): up to 32
// query vectors of one kv head against that head's positions [0, len), causal or not.
//
// K and V are packed once per kv head (pack_head), in the tiles' orders, and every block of queries
// reads them from there:
// - scores as S = Q K^T: A is 16 query vectors' 32 dims as they lie, B is 16 positions' K transposed
//   into AMX's pair order (pack_keys), so row j of a C tile is query j's scores at 16 positions. Two
//   query tiles by two position tiles, four C tiles, so each tile load feeds one product.
// - the softmax along each query's row of S: its max, then P = e^(scale (s - max)) rounded to bf16 and
//   written over the row's own scores (P's row is its A tile of pass 2 as it lies: positions are the
//   pairs' dimension), and P's float32 sum.
// - values as O = P V: B is 32 positions' V rows interleaved in pairs (pack_values), 16 dims a tile; four
//   C tiles hold 64 dims of 16 outputs.
// The softmax takes the largest share of the time (more than either pass's products), so it walks
// each row twice with nothing transposed or gathered. The outputs come back normalized with each
// query's log-sum-exp, for a cascade's merge.

#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "amx_tiles.h"

namespace {

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr bool ATTENTION_AMX = true;
#else
constexpr bool ATTENTION_AMX = false;
#endif

constexpr int AMX_ALIGN = 32;       // positions per pass-2 step (one A tile of P): packed lengths are multiples of it
constexpr int AMX_QUERIES = 32;     // query vectors per call (two A tiles)

inline int64_t amx_padded(int64_t len) { return (len + AMX_ALIGN - 1) / AMX_ALIGN * AMX_ALIGN; }

// attend_amx's scratch rows (floats): a query's scores, one cache line more than the positions, so that
// a tile's 16 rows never lie a multiple of 4 KiB apart (they would share one set of the L1 cache).
inline int64_t amx_scratch_row(int64_t len) { return len + 16; }

// Whether the tiles serve attention of these shapes (bf16, head_dim a multiple of 64, AMX).
inline bool attention_on_amx(bool bf16, int64_t head_dim) {
    return ATTENTION_AMX && bf16 && head_dim % 64 == 0 && amx_ready();
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
// 2^t for t <= 0: a degree-3 polynomial of f = t - floor(t) in [0, 1) (reduce), times 2^floor(t)
// (scalef takes t's floor itself), within 7.5e-5 relative, fitted for the least largest error: P is
// rounded to bf16 after (up to 3.9e-3), so a closer polynomial would only cost FMAs. The softmax is
// bound by its vector instructions: this form takes 5 a vector where rounding t to the nearest integer,
// its remainder and a degree-5 polynomial took 8. libm's vector expf took most of the softmax's time.
inline __m512 exp2_nonpositive(__m512 t) {
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(7.8024477e-2f);
    for (float c : {0.22606723f, 0.6958335f, 0.9999252f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    return _mm512_scalef_ps(p, t);
}

// A 16 x 16 matrix of 32-bit words, row i in r[i], transposed in place.
inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int k = 0; k < 8; ++k)
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]), t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    for (int k = 0; k < 4; ++k) {
        u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int k = 0; k < 2; ++k)
        for (int m = 0; m < 4; ++m) {
            t[8 * k + m] = _mm512_shuffle_i32x4(u[8 * k + m], u[8 * k + 4 + m], 0x88);
            t[8 * k + 4 + m] = _mm512_shuffle_i32x4(u[8 * k + m], u[8 * k + 4 + m], 0xdd);
        }
    for (int m = 0; m < 8; ++m) {
        r[m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0x88);
        r[8 + m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0xdd);
    }
}

// Every tile 16 rows of 64 bytes.
inline void configure_attention_tiles() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

// K's rows of positions [p0, p0 + 16) (k: p0's row, the others `row` elements apart), as pass 1's B
// tiles, one per 32 dims: row i of a tile is dims 2i and 2i + 1 of each of the 16 positions (a 32-bit
// word each), that is the 16 rows' words transposed. Tile (p0 / 16, c) lies at ((p0 / 16) * d / 32 + c)
// * 256 words.
inline void pack_keys(const uint16_t* k, int64_t row, int64_t p0, int d, uint32_t* kb) {
    for (int c = 0; c < d / 32; ++c) {
        __m512i w[16];
        for (int i = 0; i < 16; ++i) w[i] = _mm512_loadu_si512(k + i * row + 32 * c);
        transpose16(w);
        uint32_t* to = kb + (size_t(p0 / 16) * (d / 32) + c) * 256;
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(to + 16 * i, w[i]);
    }
}

// V's rows [p0, p0 + 32), dims [g, g + 64), as pass 2's four B tiles (512 elements each, 16 dims a
// tile): row i of a tile is positions p0 + 2i and + 1 interleaved. They lie at packed_values(len, p0, g)
// in a head's packed V of `len` positions.
inline size_t packed_values(int64_t len, int64_t p0, int g) {
    return (size_t(g / 64) * size_t(len / 32) + size_t(p0 / 32)) * 2048;
}

// v[h] is the row of position p0 + 16h (h = 0, 1), the first of 16 rows `row` elements apart.
inline void pack_values(const uint16_t* const v[2], int64_t row, int g, uint16_t* vb) {
    int16_t lo[32], hi[32];
    for (int t = 0; t < 16; ++t) lo[2 * t] = int16_t(t), lo[2 * t + 1] = int16_t(32 + t),
                                 hi[2 * t] = int16_t(16 + t), hi[2 * t + 1] = int16_t(48 + t);
    const __m512i lo_idx = _mm512_loadu_si512(lo), hi_idx = _mm512_loadu_si512(hi);
    for (int i = 0; i < 16; ++i) {
        const uint16_t* a = v[i / 8] + (2 * i % 16) * row + g;
        for (int c = 0; c < 2; ++c) {
            const __m512i x = _mm512_loadu_si512(a + 32 * c), y = _mm512_loadu_si512(a + row + 32 * c);
            _mm512_storeu_si512(vb + size_t(2 * c) * 512 + i * 32, _mm512_permutex2var_epi16(x, lo_idx, y));
            _mm512_storeu_si512(vb + size_t(2 * c + 1) * 512 + i * 32, _mm512_permutex2var_epi16(x, hi_idx, y));
        }
    }
}

// Positions [p0, p0 + 32) of one kv head into its packed K (kb) and V (vb) of `len` positions (a multiple
// of AMX_ALIGN; each is len * d elements). k[h] and v[h] are the rows of positions p0 + 16h (h = 0, 1),
// each the first of 16 rows `row` elements apart: 16 positions from a multiple of 16 lie in one cache
// block of a multiple of 16 positions, so the tiles pack straight from the blocks.
inline void pack_head(const uint16_t* const k[2], const uint16_t* const v[2], int64_t row, int64_t p0, int d,
                      int64_t len, uint32_t* kb, uint16_t* vb) {
    pack_keys(k[0], row, p0, d, kb);
    pack_keys(k[1], row, p0 + 16, d, kb);
    for (int g = 0; g < d; g += 64) pack_values(v, row, g, vb + packed_values(len, p0, g));
}

// The bits of a 16-position vector from p0 that lie before `limit`.
inline __mmask16 before(int64_t p0, int64_t limit) {
    const int64_t n = limit - p0;
    return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// Row j of S (`span` scores, a multiple of 32) becomes P in bf16 over the row's own first half; scores at
// and past `limit` are left out (P 0). Returns the row's max score and writes the sum of its P.
inline float softmax_row(float* s, int64_t span, int64_t limit, float scale, float* sum) {
    // Four running maxima, so the loop does not wait out vmaxps's latency at every 16 scores.
    const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
    __m512 top[4] = {lowest, lowest, lowest, lowest};
    const int64_t whole = limit / 16 * 16, fours = limit / 64 * 64;
    for (int64_t p = 0; p < fours; p += 64)
        for (int i = 0; i < 4; ++i) top[i] = _mm512_max_ps(top[i], _mm512_loadu_ps(s + p + 16 * i));
    for (int64_t p = fours; p < whole; p += 16) top[0] = _mm512_max_ps(top[0], _mm512_loadu_ps(s + p));
    if (whole < limit) top[1] = _mm512_mask_max_ps(top[1], before(whole, limit), top[1], _mm512_loadu_ps(s + whole));
    const float max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]),
                                                          _mm512_max_ps(top[2], top[3])));
    const __m512 c = _mm512_set1_ps(scale * 1.44269504f), shift = _mm512_set1_ps(max * scale * 1.44269504f);
    __m512 total = _mm512_setzero_ps();
    uint16_t* p16 = reinterpret_cast<uint16_t*>(s);
    // P's 32 positions from p (64 bytes) go where the scores of 0.5p.. lay: behind what is still to read.
    for (int64_t p = 0; p < span; p += 32) {
        __m512 lo = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + p), c, shift));
        __m512 hi = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + p + 16), c, shift));
        if (p + 32 > limit) {
            lo = _mm512_maskz_mov_ps(before(p, limit), lo);
            hi = _mm512_maskz_mov_ps(before(p + 16, limit), hi);
        }
        total = _mm512_add_ps(total, _mm512_add_ps(lo, hi));
        _mm512_storeu_si512(p16 + p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    *sum = _mm512_reduce_add_ps(total);
    return max;
}

// n (<= 32) query vectors q ([n, d], contiguous bf16) of one kv head against its packed K (kb) and V (vb)
// of `len` positions (a multiple of AMX_ALIGN). Query j sees the positions before limit_j = min(seen,
// causal_from + j + 1) (causal_from INT64_MAX / 2: all `seen`; seen <= len). s: scratch of
// AMX_QUERIES * amx_scratch_row(len) floats. out: [n, d] float, normalized; lse: [n]. The tiles must be
// configured on this thread (configure_attention_tiles).
inline void attend_amx(const uint16_t* q, int n, const uint32_t* kb, const uint16_t* vb, int64_t len, int64_t seen,
                       int d, float scale, int64_t causal_from, float* s, float* out, float* lse) {
    const int chunks = d / 32;
    const bool two = n > 16;
    auto limit = [&](int64_t j) { return std::min(seen, causal_from + j + 1); };
    const int64_t span = amx_padded(limit(n - 1));
    const int64_t ld = amx_scratch_row(len), bytes = ld * int64_t(sizeof(float)), qbytes = d * int64_t(sizeof(uint16_t));
    // Pass 1: S for 32 positions a step; C tiles 0, 1 (the first 16 queries), 2, 3 (the next 16).
    for (int64_t p0 = 0; p0 < span; p0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
        const uint32_t* k0 = kb + size_t(p0 / 16) * chunks * 256;
        for (int c = 0; c < chunks; ++c) {
            _tile_loadd(4, q + 32 * c, qbytes);
            _tile_loadd(6, k0 + c * 256, 64);
            _tile_loadd(7, k0 + (chunks + c) * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, q + 16 * d + 32 * c, qbytes);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, s + p0, bytes);
        _tile_stored(1, s + p0 + 16, bytes);
        if (two) {
            _tile_stored(2, s + 16 * ld + p0, bytes);
            _tile_stored(3, s + 16 * ld + p0 + 16, bytes);
        }
    }
    float max[AMX_QUERIES], sum[AMX_QUERIES];
    for (int j = 0; j < n; ++j) max[j] = softmax_row(s + j * ld, span, limit(j), scale, &sum[j]);
    // Pass 2: per 16 queries (rows of P past n hold anything: a C tile's row reads only its A row).
    for (int t = 0; t < (two ? 2 : 1); ++t) {
        const uint16_t* pa = reinterpret_cast<const uint16_t*>(s + 16 * t * ld);
        const int rows = std::min(16, n - 16 * t);
        const int64_t end = amx_padded(limit(16 * t + rows - 1));
        for (int g = 0; g < d; g += 64) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t p0 = 0; p0 < end; p0 += 32) {
                const uint16_t* b = vb + packed_values(len, p0, g);
                _tile_loadd(4, pa + p0, bytes);
                _tile_loadd(5, b, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, b + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(7, b + 1024, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, b + 1536, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
            alignas(64) float o[16][64];
            _tile_stored(0, &o[0][0], 256);
            _tile_stored(1, &o[0][16], 256);
            _tile_stored(2, &o[0][32], 256);
            _tile_stored(3, &o[0][48], 256);
            for (int j = 0; j < rows; ++j) {
                const float inv = 1.f / sum[16 * t + j];
                for (int e = 0; e < 64; ++e) out[(16 * t + j) * d + g + e] = o[j][e] * inv;
            }
        }
    }
    for (int j = 0; j < n; ++j) lse[j] = max[j] * scale + std::log(sum[j]);
}
#else
inline void configure_attention_tiles() {}
inline void pack_head(const uint16_t* const[2], const uint16_t* const[2], int64_t, int64_t, int, int64_t, uint32_t*,
                      uint16_t*) {}
inline void attend_amx(const uint16_t*, int, const uint32_t*, const uint16_t*, int64_t, int64_t, int, float, int64_t,
                       float*, float*, float*) {}
#endif

}  // namespace
