// The panel kernel: y = x W^T over W packed in 16-column panels, memory speed for few rows
// (toolkit::linear_cpu in linear.cpp, toolkit::experts_cpu in experts.cpp); and oneDNN's linear.
//
// Panel layout: W [N, K] becomes panels [ceil(N / 16), K, 16], zero-padded past N, so a panel's 16
// columns for one k are one 64-byte (fp32) or 32-byte (bf16, fp16) run and a panel is read front to
// back. In a bf16 panel, 32-bit lane j holds column j in its low half and column j + 8 in its high
// half, so one load gives both vectors: a shift widens the low halves, a mask the high ones. Where the
// CPU has AVX-512 BF16 (PAIRED_BF16: Zen 4, every AMX Xeon), a bf16 panel instead holds k in pairs: 64
// bytes per pair of k, lane j = column j at k (low half) and at k + 1 (high half), the order that
// vdpbf16ps (dp_linear) and AMX's tiles (amx_rows) take, and an odd K's last k in plain order
// (panel_offset). fp16 panels keep the plain order: F16C's vcvtph2ps
// widens 8 halves at once. x and out share W's dtype
// (x is widened once per call, out rounded to nearest even on store), or, with half weights, both are
// float32: the lm_head's float32 logits (toolkit/models/logits.py), computed in float32 by the panel
// kernel, or above small_m by a bf16 matmul (AMX tiles or oneDNN, linear.cpp) with each row's entries
// near its maximum recomputed in float32.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <torch/csrc/inductor/aoti_torch/c/shim_cpu.h>  // oneDNN's linear, when torch has oneDNN

#include "amx_tiles.h"
#include "stable_args.h"

namespace {

typedef float vec8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

constexpr int NR = 16;       // columns per panel: two 8-float vectors
#ifdef __AVX512F__
constexpr int MR = 8;        // rows per tile: 8 one-register accumulators (of 32) keep both FMA pipes busy
#else
constexpr int MR = 6;        // rows per tile: 12 accumulators + 2 weight vectors + 1 broadcast = 15 registers
#endif
constexpr int64_t MC = 192;  // rows per pass over W: their x (<= 1.5 MB at K = 2048) stays in L2/L3

// AMX tiles (the tile path below lives beside the AVX-512 FMA path, which reads the same layout).
#if defined(__AMX_BF16__) && defined(__AVX512F__)
#define AMX_PANELS 1
#else
#define AMX_PANELS 0
#endif
// Paired bf16 panels wherever AVX-512 BF16's dot product exists (Zen 4, and every AMX Xeon): the layout
// its pairs of k take, as AMX's tiles do (dp_linear; AMX's where the tiles are granted).
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAIRED_BF16 1
#else
#define PAIRED_BF16 0
#endif
constexpr int AMX_K = 32;  // k per AMX B tile (16 pairs); below it the dot-product paths leave K to the FMAs

// Whether panels of W hold k in pairs (the layout above).
template <typename W>
constexpr bool paired() { return PAIRED_BF16 && std::is_same<W, uint16_t>::value; }

inline void widen(const float* __restrict p, vec8& lo, vec8& hi) {
    std::memcpy(&lo, p, sizeof lo);
    std::memcpy(&hi, p + 8, sizeof hi);
}

inline void widen(const f16* __restrict p, vec8& lo, vec8& hi) {
#ifdef __F16C__
    __m128i a, b;
    std::memcpy(&a, p, sizeof a);
    std::memcpy(&b, p + 8, sizeof b);
    const __m256 l = _mm256_cvtph_ps(a), h = _mm256_cvtph_ps(b);
    std::memcpy(&lo, &l, sizeof lo);
    std::memcpy(&hi, &h, sizeof hi);
#else  // gcc 12 compiles its portable vector conversion to scalar ones: correct, slow
    for (int j = 0; j < 8; ++j) lo[j] = float(p[j]), hi[j] = float(p[j + 8]);
#endif
}

inline void widen(const uint16_t* __restrict p, vec8& lo, vec8& hi) {
    u32x8 v;
    std::memcpy(&v, p, sizeof v);
    const u32x8 a = v << 16, b = v & 0xFFFF0000u;
    std::memcpy(&lo, &a, sizeof lo);
    std::memcpy(&hi, &b, sizeof hi);
}

inline void widen(const int8_t* __restrict p, vec8& lo, vec8& hi) {
#ifdef __AVX2__
    // Two 8-byte loads, each folded into its sign extension (vpmovsxbd ymm, m64).
    const __m256 l = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    const __m256 h = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
    std::memcpy(&lo, &l, sizeof lo);
    std::memcpy(&hi, &h, sizeof hi);
#else
    for (int j = 0; j < 8; ++j) lo[j] = float(p[j]), hi[j] = float(p[j + 8]);
#endif
}

inline float to_float(int8_t v) { return float(v); }

#ifdef __AVX512F__
// With AVX-512 a panel row's 16 columns are one register: one FMA per row and k instead of two, which
// halves the FMAs of a tile of several rows (expert and verify rows are compute-bound in 8-wide vectors),
// and a tile holds 8 rows. The prefetch of the AVX2 path is left out: on AVX-512 hosts (Zen 4) it made
// a batch-1 chain of linears slower (docs/benchmarks.md).
typedef float vec16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline vec16 as_vec16(__m512 v) {
    vec16 r;
    std::memcpy(&r, &v, sizeof r);
    return r;
}

inline vec16 widen16(const float* __restrict p) {
    vec16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline vec16 widen16(const f16* __restrict p) {
    __m256i h;
    std::memcpy(&h, p, sizeof h);
    return as_vec16(_mm512_cvtph_ps(h));
}

// A bf16 panel row in memory order is columns 0, 8, 1, 9, ... (the layout above): widened as it lies,
// lane 2j holds column j and lane 2j + 1 column j + 8 (`lane`).
inline vec16 widen16(const uint16_t* __restrict p) {
    __m256i h;
    std::memcpy(&h, p, sizeof h);
    return as_vec16(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
}

inline vec16 widen16(const int8_t* __restrict p) {
    __m128i b;
    std::memcpy(&b, p, sizeof b);
    return as_vec16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
}

// One half of a paired bf16 row pair: k (half 0, the low halves) or k + 1 (half 1), in column order.
inline vec16 widen16(const uint16_t* __restrict p, int half) {
    u32x16 v;
    std::memcpy(&v, p, sizeof v);
    const u32x16 w = half ? (v & 0xFFFF0000u) : (v << 16);
    vec16 r;
    std::memcpy(&r, &w, sizeof r);
    return r;
}

// A row's 16 sums in column order (a widened interleaved bf16 panel row holds column j in lane
// (j % 8) * 2 + j / 8).
template <typename W>
inline vec16 in_order(vec16 v) {
    if constexpr (std::is_same<W, uint16_t>::value && !PAIRED_BF16) {
        const __m512i from = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        __m512 m;
        std::memcpy(&m, &v, sizeof m);
        return as_vec16(_mm512_permutexvar_ps(from, m));
    }
    return v;
}

// 16 values stored as O, rounded as put() rounds each (bf16: to nearest even, NaN kept quiet).
inline void put16(float* p, vec16 v) { std::memcpy(p, &v, sizeof v); }

inline void put16(uint16_t* p, vec16 v) {
    u32x16 bits;
    std::memcpy(&bits, &v, sizeof bits);
    const u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const u32x16 half = (bits & 0x7FFFFFFFu) > 0x7F800000u ? ((bits >> 16) | 0x40u) : rounded;
    __m512i h;
    std::memcpy(&h, &half, sizeof h);
    const __m256i narrow = _mm512_cvtepi32_epi16(h);
    std::memcpy(p, &narrow, sizeof narrow);
}

inline void put16(f16* p, vec16 v) {
    float row[NR];
    std::memcpy(row, &v, sizeof row);
    for (int j = 0; j < NR; ++j) put(p + j, row[j]);
}

// A tile's first `rows` of R rows of sums (U partial sums each) scaled, biased and stored as O; whole
// rows of 16 columns in vectors (a scalar store per value would cost a 32-row AMX block more than its
// products).
template <int R, int U, typename W, typename B, typename O>
void store(vec16 (&acc)[U][R], const B* __restrict bias, const float* __restrict scale, O* __restrict out,
           int64_t out_stride, int cols, int rows = R) {
    float b[NR] = {}, s[NR];
    for (int j = 0; j < NR; ++j) s[j] = 1.f;
    if (bias)
        for (int j = 0; j < cols; ++j) b[j] = to_float(bias[j]);
    if (scale)
        for (int j = 0; j < cols; ++j) s[j] = scale[j];
    vec16 bv, sv;
    std::memcpy(&bv, b, sizeof bv);
    std::memcpy(&sv, s, sizeof sv);
    for (int r = 0; r < rows; ++r) {
        for (int u = 1; u < U; ++u) acc[0][r] += acc[u][r];
        const vec16 v = in_order<W>(acc[0][r]) * sv + bv;
        if (cols == NR) {
            put16(out + r * out_stride, v);
        } else {
            float row[NR];
            std::memcpy(row, &v, sizeof row);
            for (int j = 0; j < cols; ++j) put(out + r * out_stride + j, row[j]);
        }
    }
}

inline vec16 broadcast(float v) { return vec16{} + v; }

// Partial sums per row for a tile of R rows: enough FMA chains in flight to fill the pipes.
template <int R>
constexpr int sums_for() { return R == 1 ? 8 : R == 2 ? 4 : R == 3 ? 3 : R < 7 ? 2 : 1; }

// R rows of x against Q adjacent panels at once (tile below is one panel): with fewer rows than a full
// tile (a decode step's, a verify step's), Q independent streams of weights per thread keep more
// cache-line misses in flight than one panel's stream, which on an AMX Xeon read int8 panels at one
// row well below the memory's speed (docs/benchmarks.md). U partial sums per panel and row. The last
// panel has `cols` columns.
template <int Q, int U, int R, typename W, typename B, typename O>
void panels_tile(const float* __restrict x, int64_t x_stride, const W* __restrict panel, int64_t K,
                 const B* __restrict bias, const float* __restrict scale, O* __restrict out, int64_t out_stride,
                 int cols) {
    vec16 acc[Q][U][R] = {};
    int64_t k = 0;
    if constexpr (paired<W>()) {  // one 64-byte load holds k (low halves) and k + 1 (high halves)
        for (; k + 2 * U <= (K & ~int64_t(1)); k += 2 * U)
            for (int u = 0; u < U; ++u)
                for (int q = 0; q < Q; ++q) {
                    u32x16 v;
                    std::memcpy(&v, panel + q * K * NR + (k + 2 * u) * NR, sizeof v);
                    const u32x16 lo = v << 16, hi = v & 0xFFFF0000u;
                    vec16 w0, w1;
                    std::memcpy(&w0, &lo, sizeof w0);
                    std::memcpy(&w1, &hi, sizeof w1);
                    for (int r = 0; r < R; ++r) {
                        acc[q][u][r] += broadcast(x[r * x_stride + k + 2 * u]) * w0;
                        acc[q][u][r] += broadcast(x[r * x_stride + k + 2 * u + 1]) * w1;
                    }
                }
        for (; k + 2 <= (K & ~int64_t(1)); k += 2)
            for (int q = 0; q < Q; ++q) {
                const vec16 w0 = widen16(panel + q * K * NR + k * NR, 0), w1 = widen16(panel + q * K * NR + k * NR, 1);
                for (int r = 0; r < R; ++r) {
                    acc[q][0][r] += broadcast(x[r * x_stride + k]) * w0;
                    acc[q][0][r] += broadcast(x[r * x_stride + k + 1]) * w1;
                }
            }
    } else {
        for (; k + U <= K; k += U)
            for (int u = 0; u < U; ++u)
                for (int q = 0; q < Q; ++q) {
                    const vec16 w = widen16(panel + q * K * NR + (k + u) * NR);
                    for (int r = 0; r < R; ++r) acc[q][u][r] += broadcast(x[r * x_stride + k + u]) * w;
                }
    }
    for (; k < K; ++k)  // the k past the partial sums' steps (paired: an odd K's last, in plain order)
        for (int q = 0; q < Q; ++q) {
            const vec16 w = widen16(panel + q * K * NR + k * NR);
            for (int r = 0; r < R; ++r) acc[q][0][r] += broadcast(x[r * x_stride + k]) * w;
        }
    for (int q = 0; q < Q; ++q)
        store<R, U, W>(acc[q], bias ? bias + q * NR : nullptr, scale ? scale + q * NR : nullptr, out + q * NR,
                       out_stride, q + 1 == Q ? cols : NR);
}

// R rows x 16 columns (one panel) over all of K. Each accumulator is a chain of dependent FMAs; with
// few rows, U interleaved partial sums over k keep >= 8 chains in flight (2 FMA pipes x 4 cycles of
// latency).
template <int R, int U, typename W, typename B, typename O>
void tile(const float* __restrict x, int64_t x_stride, const W* __restrict panel, int64_t K,
          const B* __restrict bias, const float* __restrict scale, O* __restrict out, int64_t out_stride, int cols) {
    panels_tile<1, U, R>(x, x_stride, panel, K, bias, scale, out, out_stride, cols);
}

// R rows of x against every panel: each thread takes an even share of the panels (a fixed grouping
// would leave one thread with a group more) and streams several at a time, as many as the registers
// hold accumulators for (8 panels for 1-2 rows, 4 for up to 6, 2 for 7), then the rest one by one.
template <int R, typename W, typename B, typename O>
void few_rows(const float* x, int64_t x_stride, const W* panels, const B* bias, const float* scale, O* out,
              int64_t N, int64_t K) {
    constexpr int Q = R <= 2 ? 8 : R <= 6 ? 4 : 2, U = R == 1 ? 2 : 1;
    const int64_t P = (N + NR - 1) / NR;
#pragma omp parallel if (P > 1)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num(), end = P * (t + 1) / threads;
        int64_t p = P * t / threads;
        for (; p + Q <= end; p += Q)
            panels_tile<Q, U, R>(x, x_stride, panels + p * K * NR, K, bias ? bias + p * NR : nullptr,
                                 scale ? scale + p * NR : nullptr, out + p * NR, N,
                                 int(std::min<int64_t>(NR, N - (p + Q - 1) * NR)));
        for (; p < end; ++p)
            tile<R, sums_for<R>()>(x, x_stride, panels + p * K * NR, K, bias ? bias + p * NR : nullptr,
                                   scale ? scale + p * NR : nullptr, out + p * NR, N,
                                   int(std::min<int64_t>(NR, N - p * NR)));
    }
}

#if AMX_PANELS
// AMX: bf16 x over paired bf16 panels through the tile unit. A 16-column panel's k in blocks of 32 is
// one B tile as it lies (16 rows of a pair of k, 64 bytes each: the layout above is AMX's VNNI order);
// up to 16 rows of x are the A tile; tdpbf16ps adds their products into a 16 x 16 float32 C tile. A
// tile multiplies 16 times more per instruction than the 16-wide FMA path does, so every row count
// streams the weights at memory speed where the FMA path is compute-bound from a few rows on. The
// products of bf16 values are exact in float32; AMX treats float32 subnormals as zero (a K below 32,
// or the k past the last whole block of 32, takes the FMA path and rounds as torch does).

// The tiles for up to 32 rows of x (two halves h of up to 16) times two panels q: C (tile 2q + h: rows
// x 16 float32), A_h (tile 4 + h: rows x 32 bf16) and B_q (tile 6 + q: 16 pairs x 16 columns), all 8.
// Each B tile serves both halves of the rows and each A tile both panels: half the loads per product of
// one panel at a time. Loaded before every block of rows: oneDNN configures the same tile registers for
// its own kernels between ours.
inline void configure_tiles(int rows0, int rows1) {
    TileConfig c;
    for (int t : {0, 2, 4}) c.rows[t] = uint8_t(rows0), c.colsb[t] = 64;
    for (int t : {1, 3, 5}) c.rows[t] = uint8_t(rows1), c.colsb[t] = rows1 ? 64 : 0;
    c.rows[6] = c.rows[7] = 16, c.colsb[6] = c.colsb[7] = 64;
    _tile_loadconfig(&c);
}

// Up to 32 rows of bf16 x (x_stride elements apart) times one or two paired panels (the second K * 16
// elements after the first), the tiles configured for these rows: the whole blocks of 32 k through the
// tiles, the rest of k through the FMA path. Panel q writes out + 16q, with bias and scale from 16q on;
// cols is the last panel's column count.
template <typename B, typename O>
void amx_block(const uint16_t* __restrict x, int64_t x_stride, const uint16_t* __restrict panel, int64_t K,
               const B* __restrict bias, const float* __restrict scale, O* __restrict out, int64_t out_stride,
               int rows, int panels, int cols) {
    const int rows1 = rows - std::min(rows, 16);
    const int64_t blocks = K / AMX_K, stride = x_stride * int64_t(sizeof(uint16_t));
    const uint16_t *x1 = x + 16 * x_stride, *panel1 = panel + K * NR;
    _tile_zero(0);
    _tile_zero(2);
    if (rows1) {
        _tile_zero(1);
        _tile_zero(3);
    }
    for (int64_t b = 0; b < blocks; ++b) {
        _tile_loadd(6, panel + b * AMX_K * NR, 64);
        _tile_loadd(4, x + b * AMX_K, stride);
        _tile_dpbf16ps(0, 4, 6);
        if (panels == 2) {
            _tile_loadd(7, panel1 + b * AMX_K * NR, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (rows1) {
            _tile_loadd(5, x1 + b * AMX_K, stride);
            _tile_dpbf16ps(1, 5, 6);
            if (panels == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
    vec16 acc[2][1][32];  // [panel][1][row]: store's layout of U = 1 partial sums
    _tile_stored(0, acc[0][0], 64);
    if (rows1) _tile_stored(1, acc[0][0] + 16, 64);
    if (panels == 2) {
        _tile_stored(2, acc[1][0], 64);
        if (rows1) _tile_stored(3, acc[1][0] + 16, 64);
    }
    for (int q = 0; q < panels; ++q) {
        const uint16_t* pq = panel + q * K * NR;
        for (int64_t k = blocks * AMX_K; k < K; ++k) {  // paired up to an odd K's last k, which is plain
            const bool pair = k < (K & ~int64_t(1));
            const vec16 w = pair ? widen16(pq + (k & ~int64_t(1)) * NR, int(k & 1)) : widen16(pq + k * NR);
            for (int r = 0; r < rows; ++r) acc[q][0][r] += broadcast(to_float(x[r * x_stride + k])) * w;
        }
        store<32, 1, uint16_t>(acc[q], bias ? bias + q * NR : nullptr, scale ? scale + q * NR : nullptr,
                               out + q * NR, out_stride, q + 1 == panels ? cols : NR, rows);
    }
}

// Up to 16 rows (one A tile) against up to four panels: C (tile q: rows x 16 float32 of panel q), A
// (tile 4) and B (tiles 5-7, the fourth panel's reusing 5). With one A tile there is room for four
// panels, so a decode step's few rows stream four panels' weights at once per thread instead of two,
// which reads them nearer the memory's speed (docs/benchmarks.md).
constexpr int AMX_ROW_PANELS = 4;

inline void configure_row_tiles(int rows) {
    TileConfig c;
    for (int t = 0; t < 5; ++t) c.rows[t] = uint8_t(rows), c.colsb[t] = 64;
    for (int t = 5; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

template <typename B, typename O>
void amx_row_block(const uint16_t* __restrict x, int64_t x_stride, const uint16_t* __restrict panel, int64_t K,
                   const B* __restrict bias, O* __restrict out, int64_t out_stride, int rows, int panels, int cols) {
    const int64_t blocks = K / AMX_K, stride = x_stride * int64_t(sizeof(uint16_t)), step = K * NR;
    _tile_zero(0);
    if (panels > 1) _tile_zero(1);
    if (panels > 2) _tile_zero(2);
    if (panels > 3) _tile_zero(3);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* w = panel + b * AMX_K * NR;
        _tile_loadd(4, x + b * AMX_K, stride);
        _tile_loadd(5, w, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (panels > 1) {
            _tile_loadd(6, w + step, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (panels > 2) {
            _tile_loadd(7, w + 2 * step, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (panels > 3) {
            _tile_loadd(5, w + 3 * step, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    vec16 acc[AMX_ROW_PANELS][1][32];  // [panel][1][row]: store's layout of U = 1 partial sums
    _tile_stored(0, acc[0][0], 64);
    if (panels > 1) _tile_stored(1, acc[1][0], 64);
    if (panels > 2) _tile_stored(2, acc[2][0], 64);
    if (panels > 3) _tile_stored(3, acc[3][0], 64);
    for (int q = 0; q < panels; ++q) {
        const uint16_t* pq = panel + q * step;
        for (int64_t k = blocks * AMX_K; k < K; ++k) {  // paired up to an odd K's last k, which is plain
            const bool pair = k < (K & ~int64_t(1));
            const vec16 w = pair ? widen16(pq + (k & ~int64_t(1)) * NR, int(k & 1)) : widen16(pq + k * NR);
            for (int r = 0; r < rows; ++r) acc[q][0][r] += broadcast(to_float(x[r * x_stride + k])) * w;
        }
        store<32, 1, uint16_t>(acc[q], bias ? bias + q * NR : nullptr, (const float*)nullptr, out + q * NR,
                               out_stride, q + 1 == panels ? cols : NR, rows);
    }
}

// Up to 16 rows of bf16 x times every panel: each thread takes an even share of the panels, four at a
// time (the last group of a share fewer), with the tiles configured once per thread.
template <typename B, typename O>
void linear_amx_rows(const uint16_t* x, int64_t x_stride, const uint16_t* panels, const B* bias, O* out, int64_t M,
                     int64_t N, int64_t K) {
    const int64_t P = (N + NR - 1) / NR;
#pragma omp parallel if (P > 1)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num(), end = P * (t + 1) / threads;
        configure_row_tiles(int(M));
        for (int64_t p = P * t / threads; p < end; p += AMX_ROW_PANELS) {
            const int here = int(std::min<int64_t>(AMX_ROW_PANELS, end - p));
            const int cols = int(std::min<int64_t>(NR, N - (p + here - 1) * NR));
            amx_row_block(x, x_stride, panels + p * K * NR, K, bias ? bias + p * NR : nullptr, out + p * NR, N, int(M),
                          here, cols);
        }
    }
}

// M rows of bf16 x times the panels [p, p + panels) (one or two) of W [N, K], 32 rows at a time.
template <typename B, typename O>
void amx_panels(const uint16_t* x, int64_t x_stride, const uint16_t* panels, int64_t p, int panels_here, int64_t N,
                int64_t K, const B* bias, const float* scale, O* out, int64_t out_stride, int64_t M) {
    const int cols = int(std::min<int64_t>(NR, N - (p + panels_here - 1) * NR));
    for (int64_t m = 0; m < M; m += 32) {
        const int rows = int(std::min<int64_t>(32, M - m)), rows0 = std::min(rows, 16);
        configure_tiles(rows0, rows - rows0);
        amx_block(x + m * x_stride, x_stride, panels + p * K * NR, K, bias ? bias + p * NR : nullptr,
                  scale ? scale + p * NR : nullptr, out + m * out_stride + p * NR, out_stride, rows, panels_here, cols);
    }
}
#endif

#else
// R rows x 16 columns over all of K. Each accumulator is a chain of dependent FMAs; with few rows,
// U interleaved partial sums over k keep >= 8 chains in flight (2 FMA pipes x 4 cycles of latency).
template <int R, int U, typename W, typename B, typename O>
void tile(const float* __restrict x, int64_t x_stride, const W* __restrict panel, int64_t K,
          const B* __restrict bias, const float* __restrict scale, O* __restrict out, int64_t out_stride, int cols) {
    vec8 acc[U][R][2] = {};
    // On AVX2-only CPUs, half panels read by 1-2 rows stream fastest with a prefetch 32 k-steps (1 KB)
    // ahead, one per 64-byte line (fp32 panels and more rows lost with it) (docs/benchmarks.md).
    constexpr bool prefetch = R <= 2 && sizeof(W) == 2;
    int64_t k = 0;
    for (; k + U <= K; k += U) {
        if (prefetch)
            for (int u = 0; u < U; u += 2) __builtin_prefetch(panel + (k + u + 32) * NR, 0, 3);
        for (int u = 0; u < U; ++u) {
            vec8 w0, w1;
            widen(panel + (k + u) * NR, w0, w1);
            for (int r = 0; r < R; ++r) {
                const vec8 xb = vec8{} + x[r * x_stride + k + u];
                acc[u][r][0] += xb * w0;
                acc[u][r][1] += xb * w1;
            }
        }
    }
    for (; k < K; ++k) {
        vec8 w0, w1;
        widen(panel + k * NR, w0, w1);
        for (int r = 0; r < R; ++r) {
            const vec8 xb = vec8{} + x[r * x_stride + k];
            acc[0][r][0] += xb * w0;
            acc[0][r][1] += xb * w1;
        }
    }
    float b[NR] = {}, s[NR];
    if (bias)
        for (int j = 0; j < cols; ++j) b[j] = to_float(bias[j]);
    for (int j = 0; j < cols; ++j) s[j] = scale ? scale[j] : 1.f;
    for (int r = 0; r < R; ++r) {
        float row[NR];
        for (int u = 1; u < U; ++u) acc[0][r][0] += acc[u][r][0], acc[0][r][1] += acc[u][r][1];
        std::memcpy(row, &acc[0][r][0], sizeof(vec8));
        std::memcpy(row + 8, &acc[0][r][1], sizeof(vec8));
        for (int j = 0; j < cols; ++j) put(out + r * out_stride + j, row[j] * s[j] + b[j]);
    }
}

// Partial sums per row for a tile of R rows: enough FMA chains in flight to fill the pipes.
template <int R>
constexpr int sums_for() { return R == 1 ? 4 : R < 4 ? 2 : 1; }
#endif

template <int R, typename W, typename B, typename O>
void tail_tile(const float* x, int64_t x_stride, const W* panel, int64_t K, const B* bias, const float* scale,
               O* out, int64_t out_stride, int cols) {
    if constexpr (R < MR) tile<R, sums_for<R>()>(x, x_stride, panel, K, bias, scale, out, out_stride, cols);
}

// The rows left after whole tiles (fewer than MR).
template <typename W, typename B, typename O>
void tail_rows(const float* x, int64_t x_stride, const W* panel, int64_t K, const B* bias, const float* scale,
               O* out, int64_t out_stride, int64_t rows, int cols) {
    switch (rows) {
        case 1: tail_tile<1>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
        case 2: tail_tile<2>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
        case 3: tail_tile<3>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
        case 4: tail_tile<4>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
        case 5: tail_tile<5>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
        case 6: tail_tile<6>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
        case 7: tail_tile<7>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
    }
}

template <typename W, typename B, typename O>
void panel_rows(const float* x, int64_t x_stride, const W* panel, int64_t K, const B* bias, const float* scale,
                O* out, int64_t out_stride, int64_t M, int cols) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR)
        tile<MR, 1>(x + m * x_stride, x_stride, panel, K, bias, scale, out + m * out_stride, out_stride, cols);
    if (m < M)
        tail_rows(x + m * x_stride, x_stride, panel, K, bias, scale, out + m * out_stride, out_stride, M - m, cols);
}

// Threads split the panels, so W is read once per MC rows and each thread streams its own range.
template <typename W, typename B, typename O>
void linear(const float* x, int64_t x_stride, const W* panels, const B* bias, const float* scale, O* out, int64_t M,
            int64_t N, int64_t K) {
#ifdef __AVX512F__
    switch (M) {  // fewer rows than a tile: several panels at a time per thread
        case 1: return few_rows<1>(x, x_stride, panels, bias, scale, out, N, K);
        case 2: return few_rows<2>(x, x_stride, panels, bias, scale, out, N, K);
        case 3: return few_rows<3>(x, x_stride, panels, bias, scale, out, N, K);
        case 4: return few_rows<4>(x, x_stride, panels, bias, scale, out, N, K);
        case 5: return few_rows<5>(x, x_stride, panels, bias, scale, out, N, K);
        case 6: return few_rows<6>(x, x_stride, panels, bias, scale, out, N, K);
        case 7: return few_rows<7>(x, x_stride, panels, bias, scale, out, N, K);
    }
#endif
    const int64_t P = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t rows = std::min(MC, M - m0);
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < P; ++p) {
            const int cols = (int)std::min<int64_t>(NR, N - p * NR);
            panel_rows(x + m0 * x_stride, x_stride, panels + p * K * NR, K, bias ? bias + p * NR : nullptr,
                       scale ? scale + p * NR : nullptr, out + m0 * N + p * NR, N, rows, cols);
        }
    }
}

#if PAIRED_BF16
// bf16 x over paired bf16 panels with AVX-512 BF16's dot product (no AMX, or its tiles not granted):
// one vdpbf16ps adds a pair of k's products for 16 columns and one row, with nothing widened; a row's
// pair of x values is one 32-bit broadcast. Twice the products of a float32 FMA per instruction, which
// matters where rows make the panels compute-bound (a verify step, a decode batch below oneDNN's
// crossover). Each product of bf16 values is exact in float32; the instruction adds a pair's two in
// float32, flushing subnormals to zero as AMX does. Q panels by R rows of accumulators; an odd K's last
// k (plain order) is widened.
template <int Q, int R, typename B, typename O>
void dp_tile(const uint16_t* __restrict x, int64_t x_stride, const uint16_t* __restrict panel, int64_t K,
             const B* __restrict bias, O* __restrict out, int64_t out_stride, int cols) {
    vec16 acc[Q][1][R] = {};
    const int64_t pairs_end = K & ~int64_t(1);
    for (int64_t k = 0; k < pairs_end; k += 2)
        for (int q = 0; q < Q; ++q) {
            const __m512i w = _mm512_loadu_si512(panel + q * K * NR + k * NR);
            for (int r = 0; r < R; ++r) {
                uint32_t pair;
                std::memcpy(&pair, x + r * x_stride + k, sizeof pair);
                acc[q][0][r] = as_vec16(_mm512_dpbf16_ps(__m512(acc[q][0][r]), __m512bh(w),
                                                         __m512bh(_mm512_set1_epi32(int32_t(pair)))));
            }
        }
    if (pairs_end < K)
        for (int q = 0; q < Q; ++q) {
            const vec16 w = widen16(panel + q * K * NR + pairs_end * NR);
            for (int r = 0; r < R; ++r) acc[q][0][r] += broadcast(to_float(x[r * x_stride + pairs_end])) * w;
        }
    for (int q = 0; q < Q; ++q)
        store<R, 1, uint16_t>(acc[q], bias ? bias + q * NR : nullptr, nullptr, out + q * NR, out_stride,
                              q + 1 == Q ? cols : NR);
}

// Fewer than MR rows: each thread an even share of the panels, Q at a time (as few_rows), then the rest
// one by one.
template <int R, typename B, typename O>
void dp_few(const uint16_t* x, int64_t x_stride, const uint16_t* panels, const B* bias, O* out, int64_t N,
            int64_t K) {
    constexpr int Q = R <= 2 ? 8 : R <= 6 ? 4 : 2;
    const int64_t P = (N + NR - 1) / NR;
#pragma omp parallel if (P > 1)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num(), end = P * (t + 1) / threads;
        int64_t p = P * t / threads;
        for (; p + Q <= end; p += Q)
            dp_tile<Q, R>(x, x_stride, panels + p * K * NR, K, bias ? bias + p * NR : nullptr, out + p * NR, N,
                          int(std::min<int64_t>(NR, N - (p + Q - 1) * NR)));
        for (; p < end; ++p)
            dp_tile<1, R>(x, x_stride, panels + p * K * NR, K, bias ? bias + p * NR : nullptr, out + p * NR, N,
                          int(std::min<int64_t>(NR, N - p * NR)));
    }
}

// Q panels by the last rows of a sweep (fewer than MR).
template <int Q, typename B, typename O>
void dp_tail(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t K, const B* bias, O* out,
             int64_t out_stride, int64_t rows, int cols) {
    switch (rows) {
        case 1: return dp_tile<Q, 1>(x, x_stride, panel, K, bias, out, out_stride, cols);
        case 2: return dp_tile<Q, 2>(x, x_stride, panel, K, bias, out, out_stride, cols);
        case 3: return dp_tile<Q, 3>(x, x_stride, panel, K, bias, out, out_stride, cols);
        case 4: return dp_tile<Q, 4>(x, x_stride, panel, K, bias, out, out_stride, cols);
        case 5: return dp_tile<Q, 5>(x, x_stride, panel, K, bias, out, out_stride, cols);
        case 6: return dp_tile<Q, 6>(x, x_stride, panel, K, bias, out, out_stride, cols);
        default: return dp_tile<Q, 7>(x, x_stride, panel, K, bias, out, out_stride, cols);
    }
}

// Q panels swept by MR rows at a time, then the rows left.
template <int Q, typename B, typename O>
void dp_sweep(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t K, const B* bias, O* out,
              int64_t out_stride, int64_t rows, int cols) {
    int64_t m = 0;
    for (; m + MR <= rows; m += MR)
        dp_tile<Q, MR>(x + m * x_stride, x_stride, panel, K, bias, out + m * out_stride, out_stride, cols);
    if (m < rows) dp_tail<Q>(x + m * x_stride, x_stride, panel, K, bias, out + m * out_stride, out_stride, rows - m, cols);
}

// bf16 x over paired panels: few rows as few_rows splits them; more, threads split the panels two at a
// time, each pair swept by MR rows (x's MC rows stay in L2 while the pair streams once).
template <typename B, typename O>
void dp_linear(const uint16_t* x, int64_t x_stride, const uint16_t* panels, const B* bias, O* out, int64_t M,
               int64_t N, int64_t K) {
    switch (M) {
        case 1: return dp_few<1>(x, x_stride, panels, bias, out, N, K);
        case 2: return dp_few<2>(x, x_stride, panels, bias, out, N, K);
        case 3: return dp_few<3>(x, x_stride, panels, bias, out, N, K);
        case 4: return dp_few<4>(x, x_stride, panels, bias, out, N, K);
        case 5: return dp_few<5>(x, x_stride, panels, bias, out, N, K);
        case 6: return dp_few<6>(x, x_stride, panels, bias, out, N, K);
        case 7: return dp_few<7>(x, x_stride, panels, bias, out, N, K);
    }
    const int64_t P = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t rows = std::min(MC, M - m0);
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < P; p += 2) {
            const uint16_t* xm = x + m0 * x_stride;
            const B* b = bias ? bias + p * NR : nullptr;
            O* o = out + m0 * N + p * NR;
            if (p + 2 <= P)
                dp_sweep<2>(xm, x_stride, panels + p * K * NR, K, b, o, N, rows, int(std::min<int64_t>(NR, N - (p + 1) * NR)));
            else
                dp_sweep<1>(xm, x_stride, panels + p * K * NR, K, b, o, N, rows, int(std::min<int64_t>(NR, N - p * NR)));
        }
    }
}
#endif

#if AMX_PANELS
// bf16 x over paired panels through the tiles: threads split the panels two at a time.
template <typename B, typename O>
void linear_amx(const uint16_t* x, int64_t x_stride, const uint16_t* panels, const B* bias, O* out, int64_t M,
                int64_t N, int64_t K) {
    if (M <= 16) return linear_amx_rows(x, x_stride, panels, bias, out, M, N, K);
    const int64_t P = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t rows = std::min(MC, M - m0);
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < P; p += 2)
            amx_panels(x + m0 * x_stride, x_stride, panels, p, int(std::min<int64_t>(2, P - p)), N, K, bias,
                       (const float*)nullptr, out + m0 * N, N, rows);
    }
}
#endif

// Where column j of a panel row is stored (see the layout above).
inline int slot(float*, int j) { return j; }
inline int slot(f16*, int j) { return j; }
inline int slot(uint16_t*, int j) { return (j % 8) * 2 + j / 8; }
inline int slot(int8_t*, int j) { return j; }

// Where W[j, k] of a panel with K rows is stored, from the panel's start.
template <typename W>
inline int64_t panel_offset(int64_t k, int j, int64_t K) {
    if (paired<W>() && k < (K & ~int64_t(1))) return (k & ~int64_t(1)) * NR + 2 * j + (k & 1);
    if (paired<W>()) return k * NR + j;
    return k * NR + slot((W*)nullptr, j);
}

template <typename W>
void pack(const W* w, int64_t N, int64_t K, W* panels) {
    const int64_t P = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; ++p)
        for (int64_t k = 0; k < K; ++k)
            for (int j = 0; j < NR; ++j) {
                const int64_t n = p * NR + j;
                panels[p * K * NR + panel_offset<W>(k, j, K)] = n < N ? w[n * K + k] : W{};
            }
}

// out [M, N] = (x [M, K] (rows x_stride apart, of type X) @ W^T) * scale + bias, out of type O; a half x
// is widened to float32 first, except bf16 x over paired bf16 panels where AMX runs (amx_rows).
template <typename X, typename W, typename B, typename O>
void panel_linear(const void* x, int64_t x_stride, const W* panels, const B* bias, const float* scale, O* out,
                  int64_t M, int64_t N, int64_t K) {
    if constexpr (std::is_same<X, float>::value) {
        linear(static_cast<const float*>(x), x_stride, panels, bias, scale, out, M, N, K);
        return;
    }
#if PAIRED_BF16
    if constexpr (paired<W>() && std::is_same<X, uint16_t>::value)
        if (!scale) {
#if AMX_PANELS
            if (amx_ready()) return linear_amx(static_cast<const uint16_t*>(x), x_stride, panels, bias, out, M, N, K);
#endif
            // As on AMX, a K below 32 takes the FMA path, which rounds subnormals as torch does.
            if (K >= AMX_K) return dp_linear(static_cast<const uint16_t*>(x), x_stride, panels, bias, out, M, N, K);
        }
#endif
    std::unique_ptr<float[]> wide(new float[M * K]);  // every element is written
    const X* xh = static_cast<const X*>(x);
    // A decode step's few rows are not worth waking the other threads for.
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) wide[m * K + k] = to_float(xh[m * x_stride + k]);
    linear(wide.get(), K, panels, bias, scale, out, M, N, K);
}

// The row count oneDNN is called with for M rows. oneDNN generates a kernel for every new row count
// it sees (its primitive cache keeps them), which costs several times a matmul of a few hundred rows
// (docs/benchmarks.md): a workload's batch sizes and per-expert row counts would each pay it once per
// process. Rounded up to 16 sizes per octave, at most a sixteenth more rows are computed, and at most
// 128 kernels per weight shape serve every row count up to 2,048, well within the 4,096 the toolkit
// has oneDNN keep (envs.set_process_defaults).
inline int64_t onednn_rows(int64_t M) {
    if (M <= 32) return M;
    const int64_t step = int64_t(1) << (63 - __builtin_clzll(uint64_t(M)) - 4);
    return (M + step - 1) / step * step;
}

// x [M, K] (unit stride in K) copied into the first rows of a [rows, K] tensor, the rest zeroed.
inline Tensor padded_rows(const Tensor& x, int64_t rows) {
    const int64_t M = x.size(0), K = x.size(1), bytes = K * (kind_of(x, "x") == F32 ? 4 : 2);
    Tensor out = empty_as(x, {rows, K});
    char* o = static_cast<char*>(out.data_ptr());
    const char* in = static_cast<const char*>(x.data_ptr());
    const int64_t in_stride = x.stride(0) * (bytes / K);
#pragma omp parallel for schedule(static) if (M * bytes >= (1 << 20))
    for (int64_t m = 0; m < M; ++m) std::memcpy(o + m * bytes, in + m * in_stride, bytes);
    std::memset(o + M * bytes, 0, (rows - M) * bytes);
    return out;
}

// x [M, K] @ weight^T + bias through oneDNN (weight packed for it, or a plain [N, K] tensor); out
// [M, N], contiguous: the first M rows of a [onednn_rows(M), N] tensor where M was padded.
Tensor onednn_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
#if !AT_MKLDNN_ENABLED()
    STD_TORCH_CHECK(false, "linear_cpu: this torch has no oneDNN, so no oneDNN weight can be passed");
    return x;
#else
    const int64_t M = x.size(0), rows = onednn_rows(M);
    Tensor xc = rows != M ? padded_rows(x, rows) : x.is_contiguous() ? x : torch::stable::contiguous(x);
    AtenTensorHandle b = bias ? bias->get() : nullptr, ret;
    STD_TORCH_CHECK(aoti_torch_cpu__linear_pointwise(xc.get(), weight.get(), bias ? &b : nullptr, "none", nullptr, 0,
                                                     nullptr, &ret) == AOTI_TORCH_SUCCESS,
                    "linear_cpu: oneDNN's linear failed");
    Tensor out(ret);
    return rows != M ? torch::stable::narrow(out, 0, 0, M) : out;
#endif
}

}  // namespace
