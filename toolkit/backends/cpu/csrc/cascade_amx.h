// The shared part of a cascade (attention.cpp's run_cascade) on AMX tiles: up to 16 bf16 query vectors
// of one kv head against the shared positions' K and V, read in place. At a decode cascade's shape (a
// few queries, a long prefix) ATen's flash kernel spends most of its time outside its GEMMs
// (docs/benchmarks.md); a cascade's chunks, with their hundreds of rows, keep it. With a causal mask
// the same function takes a flash request's attention (attention.cpp's flash_on_amx): 16 consecutive
// tokens of one query head over the positions the last of them sees.
//
// Two passes, so no running max rescales the accumulators:
// - scores as S^T = K Q^T: A is 16 positions' K rows as they lie (32 dims a tile), B the query vectors
//   packed once in AMX's pair order, so row p of the C tile is position p's scores for the 16 queries;
//   every score goes to a buffer. A query's max then runs down the rows, vectorized across queries.
// - values as O = P V: a query's P (its scores, exponentiated, in bf16: what ATen's bf16 flash kernel
//   multiplies too) is one row of A, 32 positions a tile, read out of the score buffer by a gather; B is
//   32 positions' V rows interleaved in pairs (AMX's order), 16 dims a tile; four C tiles hold 64 dims
//   of the 16 outputs.
// The sums of P are float32, the outputs normalized by them; each query's log-sum-exp comes back for
// the cascade's merge.

#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "amx_tiles.h"

namespace {

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr bool CASCADE_AMX = true;
#else
constexpr bool CASCADE_AMX = false;
#endif

constexpr int CASCADE_ALIGN = 32;  // shared positions per pass-2 step (one A tile of P): the AMX part's multiple

// Whether shared_amx serves a cascade of these shapes (it needs bf16, head_dim a multiple of 64, AMX).
inline bool cascade_on_amx(bool bf16, int64_t head_dim) {
    return CASCADE_AMX && bf16 && head_dim % 64 == 0 && amx_ready();
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
// e^x for the softmax's x <= 0: 2^(x log2 e) as 2^n (scalef) times a degree-5 polynomial of the rest
// f in [-0.5, 0.5], within 3e-6 relative (P is rounded to bf16 after, 4e-3). A decode cascade's shared
// part makes 16 exponentials per query vector and 16 positions, as many as its tiles' products take
// instructions; libm's vector expf took most of the time.
inline __m512 exp_nonpositive(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    for (float c : {9.6181291e-3f, 5.5504109e-2f, 0.24022651f, 0.69314718f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    return _mm512_scalef_ps(p, n);
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
inline void configure_cascade_tiles() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

// V's rows [p0, p0 + 32) (position p's row at p * row elements), dims [g, g + 64), as pass 2's four B
// tiles (512 elements each, 16 dims a tile): row i of a tile is positions p0 + 2i and + 1 interleaved.
inline void pack_values(const uint16_t* v, int64_t row, int64_t p0, int g, uint16_t* vb) {
    int16_t lo[32], hi[32];
    for (int t = 0; t < 16; ++t) lo[2 * t] = int16_t(t), lo[2 * t + 1] = int16_t(32 + t),
                                 hi[2 * t] = int16_t(16 + t), hi[2 * t + 1] = int16_t(48 + t);
    const __m512i lo_idx = _mm512_loadu_si512(lo), hi_idx = _mm512_loadu_si512(hi);
    for (int i = 0; i < 16; ++i) {
        const uint16_t* a = v + (p0 + 2 * i) * row + g;
        for (int c = 0; c < 2; ++c) {
            const __m512i x = _mm512_loadu_si512(a + 32 * c), y = _mm512_loadu_si512(a + row + 32 * c);
            _mm512_storeu_si512(vb + size_t(2 * c) * 512 + i * 32, _mm512_permutex2var_epi16(x, lo_idx, y));
            _mm512_storeu_si512(vb + size_t(2 * c + 1) * 512 + i * 32, _mm512_permutex2var_epi16(x, hi_idx, y));
        }
    }
}

// Where pack_values put positions [p0, p0 + 32) and dims [g, g + 64) in a whole packed V of `len` positions.
inline size_t packed_offset(int64_t len, int64_t p0, int g) {
    return (size_t(g / 64) * size_t(len / 32) + size_t(p0 / 32)) * 2048;
}

// Bits of the query vectors j that see position p: all, or (causal) those with p <= causal_from + j.
inline __mmask16 visible(int64_t p, int64_t causal_from) {
    const int64_t ahead = p - causal_from;
    return ahead <= 0 ? __mmask16(0xFFFF) : ahead > 15 ? __mmask16(0) : __mmask16((0xFFFF << ahead) & 0xFFFF);
}

// n (<= 16) query vectors q ([n, d], contiguous) of one kv head against positions [0, len) (len a multiple
// of CASCADE_ALIGN) of that head's K and V (k, v: position p's row at p * row elements). Query j sees
// position p only where p <= causal_from + j (a chunk's 16 consecutive tokens of one head, causal_from
// the first one's position; INT64_MAX: every position). `packed`: V already in pass 2's order
// (pack_values over `packed_len` positions), or null to pack it here. out: [n, d] float, normalized; lse:
// [n]. The tiles must be configured (configure_cascade_tiles) on this thread.
inline void shared_amx(const uint16_t* q, int n, const uint16_t* k, const uint16_t* v, int64_t row, int64_t len, int d,
                       float scale, float* out, float* lse, int64_t causal_from = INT64_MAX,
                       const uint16_t* packed = nullptr, int64_t packed_len = 0) {
    const int chunks = d / 32;
    // B of pass 1: chunk c's tile, row i = dims 32c + 2i and + 1 of each query vector (a 32-bit word each).
    std::vector<uint32_t> qb(size_t(chunks) * 256, 0u);
    for (int j = 0; j < n; ++j)
        for (int c = 0; c < chunks; ++c)
            for (int i = 0; i < 16; ++i) std::memcpy(&qb[size_t(c) * 256 + i * 16 + j], q + j * d + 32 * c + 2 * i, 4);
    std::vector<float> scores(size_t(len) * 16);
    const int64_t stride = row * int64_t(sizeof(uint16_t));
    // 32 positions a step, as two independent C tiles (0, 3), so one's products wait less on the other's.
    for (int64_t p0 = 0; p0 < len; p0 += 32) {
        _tile_zero(0);
        _tile_zero(3);
        for (int c = 0; c < chunks; ++c) {
            _tile_loadd(2, &qb[size_t(c) * 256], 64);
            _tile_loadd(1, k + p0 * row + 32 * c, stride);
            _tile_dpbf16ps(0, 1, 2);
            _tile_loadd(4, k + (p0 + 16) * row + 32 * c, stride);
            _tile_dpbf16ps(3, 4, 2);
        }
        _tile_stored(0, &scores[size_t(p0) * 16], 64);
        _tile_stored(3, &scores[size_t(p0 + 16) * 16], 64);
    }
    __m512 top = _mm512_set1_ps(-FLT_MAX);
    for (int64_t p = 0; p < len; ++p)
        top = _mm512_mask_max_ps(top, visible(p, causal_from), top, _mm512_loadu_ps(&scores[size_t(p) * 16]));
    float max[16], sum[16];
    _mm512_storeu_ps(max, top);
    // P in place, down the rows (16 queries a vector), and its sums.
    const __m512 shift = _mm512_mul_ps(top, _mm512_set1_ps(scale));
    __m512 total = _mm512_setzero_ps();
    for (int64_t p = 0; p < len; ++p) {
        float* e = &scores[size_t(p) * 16];
        // A hidden position's score may be anything: it is not exponentiated, and its P is 0.
        const __m512 x = _mm512_maskz_mov_ps(visible(p, causal_from), exp_nonpositive(_mm512_sub_ps(
            _mm512_mul_ps(_mm512_loadu_ps(e), _mm512_set1_ps(scale)), shift)));
        _mm512_storeu_ps(e, x);
        total = _mm512_add_ps(total, x);
    }
    _mm512_storeu_ps(sum, total);
    // A of pass 2: query j's row of P over all positions, bf16. Per 32 positions, two rows of the buffer
    // (positions 2i and 2i + 1, 16 queries each) become one vector of 16 words, query j's pair of P in
    // word j; the 16 x 16 words transposed are the 16 queries' rows (the rows past n are never read).
    std::vector<uint16_t> pa(size_t(16) * len);
    int16_t pairs[32];
    for (int j = 0; j < 16; ++j) pairs[2 * j] = int16_t(j), pairs[2 * j + 1] = int16_t(16 + j);
    const __m512i interleave = _mm512_loadu_si512(pairs);
    for (int64_t p0 = 0; p0 < len; p0 += 32) {
        __m512i w[16];
        for (int i = 0; i < 16; ++i) {
            const float* two = &scores[size_t(p0 + 2 * i) * 16];
            const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(two + 16), _mm512_loadu_ps(two));
            w[i] = _mm512_permutexvar_epi16(interleave, (__m512i)h);
        }
        transpose16(w);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(&pa[size_t(j) * len + p0], w[j]);
    }
    // B of pass 2: for 32 positions, 16 rows (pairs of positions) x 16 dims, one tile per 16 dims.
    std::vector<uint16_t> own(packed ? 0 : 2048);
    for (int g = 0; g < d; g += 64) {  // 64 dims of the outputs in C tiles 0-3
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t p0 = 0; p0 < len; p0 += 32) {
            const uint16_t* vb = packed ? packed + packed_offset(packed_len, p0, g) : own.data();
            if (!packed) pack_values(v, row, p0, g, own.data());
            _tile_loadd(4, &pa[size_t(p0)], len * int64_t(sizeof(uint16_t)));
            _tile_loadd(5, vb, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, vb + 512, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, vb + 1024, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, vb + 1536, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
        float o[16][64];
        _tile_stored(0, &o[0][0], 256);
        _tile_stored(1, &o[0][16], 256);
        _tile_stored(2, &o[0][32], 256);
        _tile_stored(3, &o[0][48], 256);
        for (int j = 0; j < n; ++j)
            for (int e = 0; e < 64; ++e) out[j * d + g + e] = o[j][e] / sum[j];
    }
    for (int j = 0; j < n; ++j) lse[j] = max[j] * scale + std::log(sum[j]);
}
#else
inline void configure_cascade_tiles() {}
inline void shared_amx(const uint16_t*, int, const uint16_t*, const uint16_t*, int64_t, int64_t, int, float, float*,
                       float*, int64_t = 0, const uint16_t* = nullptr, int64_t = 0) {}
inline void pack_values(const uint16_t*, int64_t, int64_t, int, uint16_t*) {}
inline size_t packed_offset(int64_t, int64_t, int) { return 0; }
#endif

}  // namespace
