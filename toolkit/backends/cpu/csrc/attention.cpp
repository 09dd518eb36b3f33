// Paged attention for CPU: every query token of a step (prefill chunks and decodes alike) against
// its request's paged K/V, causal, in one pass per token; and the write of a step's new K/V into
// the cache. Registered as the torch ops toolkit::paged_attention_cpu and toolkit::write_kv_cpu,
// which the compiled step calls like any other op.
//
// Each query token is one task (or, with too few tokens to keep every thread busy, one task per
// (token, kv head)) that walks only its own request's blocks, up to its own causal length, with an
// online softmax (flash-decoding's recurrence), so K/V are read once, in place. A prefill chunk's
// tokens instead go in tiles of 12-24 consecutive tokens per kv head, as tile x G query vectors of
// one kv head with their own causal lengths: each block's K/V is then read from memory once per
// tile rather than once per token (a chunk over a long cached prefix was bound by those reads). Scores are computed
// 8 cache rows at a time with one shuffle tree for their 8 sums (one horizontal sum per dot product
// made the loop latency-bound), for as many query heads of a kv head as the registers hold, which
// then share every key and value load. The next block is prefetched while the current one is computed.
//
// Layout (attention/kv_cache.py): keys and values are [num_blocks, block_size, num_kv_heads, head_dim]
// each; q and out are [tokens, num_heads, head_dim]; query head h uses kv head h / G, so a kv head's G
// query heads are adjacent. Request i's q_len_i tokens are rows [qsl[i], qsl[i+1]) and are the last
// q_len_i of its seq_len_i positions. Rows past qsl[B] (padding) are zeros. Built with -ffast-math,
// which lets the exp loops vectorize (glibc's libmvec), so no infinities are used: the running max
// starts at -FLT_MAX.
//
// With flash_min > 0, a request with at least flash_min new tokens goes instead to ATen's CPU flash
// attention on its gathered K/V (flash_prefill.h): GEMM-shaped, faster than the tiles on some CPUs and
// slower on others, so the engine measures where it starts to pay (toolkit/backends/cpu/attention_plan.py).
// In bf16 on AMX they go to the tile unit instead (flash_on_amx, attention_amx.h), causal, up to
// FLASH_AMX_MAX_LEN positions.
// Likewise requests that begin with the same blocks (a shared prompt prefix), decodes and such chunks,
// with flash_min or more new tokens between them, attend to those blocks together, as one chunk of that
// many rows (cascade attention, run_cascade below).

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <omp.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "attention_amx.h"
#include "flash_prefill.h"
#include "stable_args.h"

namespace {

// GCC/Clang vector extensions: 8 floats, one AVX2 register, lowered portably elsewhere.
typedef float vec8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
    vec8 r;
    std::memcpy(&r, p, sizeof r);
    return r;
}

inline vec8 load8(const uint16_t* p) {  // bfloat16 is the high half of a float32
#if defined(__AVX2__)
    // One vpmovzxwd: gcc 12 lowers the portable form below to two 128-bit halves and an insert.
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return vec8(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16)));
#else
    u16x8 half;
    std::memcpy(&half, p, sizeof half);
    u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
    vec8 r;
    std::memcpy(&r, &bits, sizeof r);
    return r;
#endif
}

inline vec8 load8(const f16* p) {
#if defined(__F16C__)
    __m128i halves;
    std::memcpy(&halves, p, sizeof halves);
    return vec8(_mm256_cvtph_ps(halves));
#else  // gcc 12 compiles its portable vector conversion to scalar ones: correct, slow
    vec8 r;
    for (int j = 0; j < 8; ++j) r[j] = float(p[j]);
    return r;
#endif
}

inline void store8(float* p, vec8 x) { std::memcpy(p, &x, sizeof x); }

inline vec8 pair_sums(vec8 a, vec8 b) {  // lanes (a0+a1, b0+b1, a2+a3, b2+b3, ...)
    return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}

// The 8 horizontal sums of x[0..7] as one vector: a transpose-and-add tree, 12 shuffles for 8 sums.
inline vec8 horizontal_sums(const vec8* x) {
    vec8 t0 = pair_sums(x[0], x[1]), t1 = pair_sums(x[2], x[3]);
    vec8 t2 = pair_sums(x[4], x[5]), t3 = pair_sums(x[6], x[7]);
    vec8 u0 = __builtin_shufflevector(t0, t1, 0, 1, 8, 9, 4, 5, 12, 13) +
              __builtin_shufflevector(t0, t1, 2, 3, 10, 11, 6, 7, 14, 15);
    vec8 u1 = __builtin_shufflevector(t2, t3, 0, 1, 8, 9, 4, 5, 12, 13) +
              __builtin_shufflevector(t2, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// scores[h][0..7] = scale * (q_h . key row j) for H query heads that share the 8 key rows: each key
// vector is loaded (and widened) once for all H heads.
template <int H, typename T>
inline void scores8_heads(const float* q, int64_t q_stride, const T* key, int64_t row_stride, int head_dim, float scale,
                          float* p, int64_t p_stride) {
    vec8 acc[H][8] = {};
    for (int d = 0; d < head_dim; d += 8) {
        vec8 kd[8];
        for (int j = 0; j < 8; ++j) kd[j] = load8(key + j * row_stride + d);
        for (int h = 0; h < H; ++h) {
            const vec8 qd = load8(q + h * q_stride + d);
            for (int j = 0; j < 8; ++j) acc[h][j] += qd * kd[j];
        }
    }
    for (int h = 0; h < H; ++h) store8(p + h * p_stride, horizontal_sums(acc[h]) * scale);
}

#ifdef __AVX512BF16__
// scores8_heads for bf16 q and keys with AVX-512 BF16's dot-product instruction: 32 products of a key
// row and a query head per instruction, over pairs of adjacent dims, accumulated in float32 (each
// bf16 product is exact in float32, so this is the widened computation in another summation order).
template <int H>
inline void scores8_heads_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* key, int64_t row_stride,
                               int head_dim, float scale, float* p, int64_t p_stride) {
    __m512 acc[H][8];
    for (int h = 0; h < H; ++h)
        for (int j = 0; j < 8; ++j) acc[h][j] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += 32) {
        __m512bh qd[H];
        for (int h = 0; h < H; ++h) qd[h] = (__m512bh)_mm512_loadu_si512(q + h * q_stride + d);
        for (int j = 0; j < 8; ++j) {
            const __m512bh kd = (__m512bh)_mm512_loadu_si512(key + j * row_stride + d);
            for (int h = 0; h < H; ++h) acc[h][j] = _mm512_dpbf16_ps(acc[h][j], kd, qd[h]);
        }
    }
    for (int h = 0; h < H; ++h) {
        vec8 halves[8];
        for (int j = 0; j < 8; ++j)
            halves[j] = vec8(_mm512_castps512_ps256(acc[h][j]) + _mm512_extractf32x8_ps(acc[h][j], 1));
        store8(p + h * p_stride, horizontal_sums(halves) * scale);
    }
}
#endif

// Share `share` of `shares` of a block's K and V cache lines that a task reads: `width` elements at
// the start of each of the block's rows. Issued all at a block's start, prefetches gave nothing (the
// core stalls once its miss buffers are full); spread over the block's work they pay. The division
// per line spaces a share's own prefetches too: counted along instead, they went out back to back and
// the engine lost throughput (docs/benchmarks.md).
template <typename T>
inline void prefetch_share(const T* k, const T* v, int share, int shares, int64_t width, int block_size,
                           int64_t row_stride) {
    const int64_t row_lines = (width * int64_t(sizeof(T)) + 63) / 64, lines = block_size * row_lines;
    for (int64_t l = share * lines / shares; l < (share + 1) * lines / shares; ++l) {
        const int64_t row = (l / row_lines) * row_stride, byte = 64 * (l % row_lines);
        __builtin_prefetch(reinterpret_cast<const char*>(k + row) + byte, 0, 1);
        __builtin_prefetch(reinterpret_cast<const char*>(v + row) + byte, 0, 1);
    }
}

// acc_h[0..W) = acc_h * correction_h + sum over the block's n rows of p_h[i] * value row i, for H query
// heads sharing the value rows: each value vector is loaded (and widened) once for all H, and the
// W-float tiles of the outputs stay in registers (W a constant, so the loops unroll, nothing spills).
template <int H, int W, typename T>
inline void value_tile_heads(float* acc, int64_t acc_stride, const T* value, const float* p, int64_t p_stride, int n,
                             int64_t row_stride, const float* correction) {
    vec8 tile[H][W / 8];
    for (int h = 0; h < H; ++h)
        for (int c = 0; c < W / 8; ++c) tile[h][c] = load8(acc + h * acc_stride + 8 * c) * correction[h];
    for (int i = 0; i < n; ++i) {
        float w[H];
        for (int h = 0; h < H; ++h) w[h] = p[h * p_stride + i];
        for (int c = 0; c < W / 8; ++c) {
            const vec8 x = load8(value + i * row_stride + 8 * c);
            for (int h = 0; h < H; ++h) tile[h][c] += w[h] * x;
        }
    }
    for (int h = 0; h < H; ++h)
        for (int c = 0; c < W / 8; ++c) store8(acc + h * acc_stride + 8 * c, tile[h][c]);
}

// H query heads (adjacent, sharing one kv head) against the block's n rows: their scores into p
// (rows block_size apart), then the value rows weighted into acc (rows head_dim apart).
template <int H, typename T>
inline void head_scores(const float* q, const T* q_raw, const T* key, int n, int head_dim, int64_t row_stride,
                        int block_size, float scale, float* p) {
#ifdef __AVX512BF16__
    if constexpr (std::is_same<T, uint16_t>::value) {
        if (head_dim % 32 == 0) {
            for (int i = 0; i < n; i += 8)
                scores8_heads_bf16<H>(q_raw, head_dim, key + i * row_stride, row_stride, head_dim, scale, p + i,
                                      block_size);
            return;
        }
    }
#endif
    for (int i = 0; i < n; i += 8)
        scores8_heads<H>(q, head_dim, key + i * row_stride, row_stride, head_dim, scale, p + i, block_size);
}

// Whether attend's accumulators hold each 32 dims of a head as its 16 even dims then its 16 odd ones
// (value_chunks_bf16), put back in order when the task ends.
template <typename T>
inline bool values_paired(int head_dim) {
#ifdef __AVX512F__
    return std::is_same<T, uint16_t>::value && head_dim % 32 == 0;
#else
    return false;
#endif
}

#ifdef __AVX512F__
// value_tile_heads for bfloat16 values on AVX-512, C chunks of 32 dims: a chunk of a value row widens
// to two float vectors, its even dims (the 32-bit lane shifted left 16) and its odd ones (the lane's
// low half masked off), one instruction each and no unpacking across lanes, so the accumulators hold
// the dims in that order (values_paired). Widening 8 dims at a time cost more than the products.
template <int H, int C>
inline void value_chunks_bf16(float* acc, int64_t acc_stride, const uint16_t* value, const float* p, int64_t p_stride,
                              int n, int64_t row_stride, const float* correction) {
    __m512 tile[H][2 * C];
    for (int h = 0; h < H; ++h)
        for (int c = 0; c < 2 * C; ++c)
            tile[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * acc_stride + 16 * c), _mm512_set1_ps(correction[h]));
    const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
    for (int i = 0; i < n; ++i) {
        __m512 w[H];
        for (int h = 0; h < H; ++h) w[h] = _mm512_set1_ps(p[h * p_stride + i]);
        for (int c = 0; c < C; ++c) {
            const __m512i x = _mm512_loadu_si512(value + i * row_stride + 32 * c);
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(x, high));
            for (int h = 0; h < H; ++h) {
                tile[h][2 * c] = _mm512_fmadd_ps(w[h], even, tile[h][2 * c]);
                tile[h][2 * c + 1] = _mm512_fmadd_ps(w[h], odd, tile[h][2 * c + 1]);
            }
        }
    }
    for (int h = 0; h < H; ++h)
        for (int c = 0; c < 2 * C; ++c) _mm512_storeu_ps(acc + h * acc_stride + 16 * c, tile[h][c]);
}
#endif

template <int H, typename T>
inline void head_values(float* acc, const T* value, const float* p, int n, int head_dim, int64_t row_stride,
                        int block_size, const float* correction) {
#ifdef __AVX512F__
    if constexpr (std::is_same<T, uint16_t>::value) {
        if (values_paired<T>(head_dim)) {
            int d0 = 0;
            for (; d0 + 64 <= head_dim; d0 += 64)
                value_chunks_bf16<H, 2>(acc + d0, head_dim, value + d0, p, block_size, n, row_stride, correction);
            if (d0 < head_dim)
                value_chunks_bf16<H, 1>(acc + d0, head_dim, value + d0, p, block_size, n, row_stride, correction);
            return;
        }
    }
#endif
    int d0 = 0;
    for (; d0 + 64 <= head_dim; d0 += 64)
        value_tile_heads<H, 64>(acc + d0, head_dim, value + d0, p, block_size, n, row_stride, correction);
    for (; d0 < head_dim; d0 += 8)
        value_tile_heads<H, 8>(acc + d0, head_dim, value + d0, p, block_size, n, row_stride, correction);
}

// Up to three query heads of a kv head at a time where the registers hold their accumulators
// (AVX-512's 32); one at a time with AVX2's 16.
#ifdef __AVX512F__
constexpr int HEADS = 3;
#else
constexpr int HEADS = 1;
#endif

// One task: num_heads query heads of one token (all of them, or the group of one kv head), over the
// first `len` positions of its request's blocks. q and out are float32 [num_heads, head_dim]; k and v
// point at the task's first kv head; a cache row (one position, all kv heads) is row_stride elements.
// `lens` (or null: all `len`) are the query vectors' own causal lengths, at most `len`: a vector's
// scores past its length are left out of its softmax.
template <typename T>
void attend(const float* q, const T* q_raw, const T* k, const T* v, const int32_t* table, int len, float* out,
            int num_heads, int group, int head_dim, int block_size, int64_t row_stride, float scale,
            const int32_t* lens = nullptr, float* lse = nullptr) {
    float running_max[num_heads], denom[num_heads], acc[num_heads * head_dim], p[num_heads * block_size];
    for (int h = 0; h < num_heads; ++h) { running_max[h] = -FLT_MAX; denom[h] = 0.f; }
    std::fill(acc, acc + num_heads * head_dim, 0.f);

    // Heads of a kv head in threes where they divide into them (GQA 3:1), else in pairs.
    const bool triples = HEADS >= 3 && group % 3 == 0;
    for (int start = 0; start < len; start += block_size) {
        const int n = std::min(block_size, len - start);
        const int64_t base = int64_t(table[start / block_size]) * block_size * row_stride;
        // Scores in groups of 8 rows. Rows past n in the last block exist (whole blocks are allocated);
        // their scores are computed and never read.
        for (int g = 0; g < num_heads / group; ++g) {
            const T* key = k + base + g * head_dim;
            int h = g * group;
            for (; h + 3 <= (g + 1) * group && triples; h += 3)
                head_scores<3>(q + h * head_dim, q_raw + h * head_dim, key, n, head_dim, row_stride, block_size, scale,
                               p + h * block_size);
            for (; h + 2 <= (g + 1) * group && HEADS >= 2; h += 2)
                head_scores<2>(q + h * head_dim, q_raw + h * head_dim, key, n, head_dim, row_stride, block_size, scale,
                               p + h * block_size);
            for (; h < (g + 1) * group; ++h)
                head_scores<1>(q + h * head_dim, q_raw + h * head_dim, key, n, head_dim, row_stride, block_size, scale,
                               p + h * block_size);
        }
        const bool has_next = start + block_size < len;
        const int64_t next = has_next ? int64_t(table[start / block_size + 1]) * block_size * row_stride : 0;
        float correction[num_heads];
        for (int h = 0; h < num_heads; ++h) {
            if (has_next) prefetch_share(k + next, v + next, h, num_heads, (num_heads / group) * head_dim, block_size, row_stride);
            float* ph = p + h * block_size;
            const int nh = lens ? std::max(0, std::min(n, lens[h] - start)) : n;
            float block_max = running_max[h];
            for (int i = 0; i < nh; ++i) block_max = std::max(block_max, ph[i]);
            correction[h] = std::exp(running_max[h] - block_max);
            running_max[h] = block_max;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < nh; ++i) {
                ph[i] = std::exp(ph[i] - block_max);
                sum += ph[i];
            }
            for (int i = nh; i < n; ++i) ph[i] = 0.f;  // past this vector's causal length
            denom[h] = denom[h] * correction[h] + sum;
        }
        for (int g = 0; g < num_heads / group; ++g) {
            const T* value = v + base + g * head_dim;
            int h = g * group;
            for (; h + 3 <= (g + 1) * group && triples; h += 3)
                head_values<3>(acc + h * head_dim, value, p + h * block_size, n, head_dim, row_stride, block_size,
                               correction + h);
            for (; h + 2 <= (g + 1) * group && HEADS >= 2; h += 2)
                head_values<2>(acc + h * head_dim, value, p + h * block_size, n, head_dim, row_stride, block_size,
                               correction + h);
            for (; h < (g + 1) * group; ++h)
                head_values<1>(acc + h * head_dim, value, p + h * block_size, n, head_dim, row_stride, block_size,
                               correction + h);
        }
    }
    const bool paired = values_paired<T>(head_dim);
    for (int h = 0; h < num_heads; ++h) {
        const float inv = denom[h] > 0.f ? 1.f / denom[h] : 0.f;  // a length of 0 gives zeros
        const float* a = acc + h * head_dim;
        for (int d = 0; d < head_dim; ++d)  // paired: dim d of its 32-dim chunk is the chunk's (d % 2) * 16 + d / 2
            out[h * head_dim + d] = (paired ? a[(d & ~31) + ((d & 1) << 4) + ((d & 31) >> 1)] : a[d]) * inv;
        if (lse) lse[h] = running_max[h] + std::log(denom[h]);  // the scores' log-sum-exp, for merging
    }
}

// A request whose length overruns its block-table row, or whose table names a block outside the cache.
inline bool request_is_bad(const int32_t* table, int64_t len, int64_t table_width, int block_size, int64_t num_blocks) {
    if (len < 0 || len > table_width * block_size) return true;
    for (int64_t b = 0; b * block_size < len; ++b)
        if (table[b] < 0 || table[b] >= num_blocks) return true;
    return false;
}

struct Step {  // one call's shapes and pointers
    const void* q;
    int64_t q_token_stride, q_head_stride;
    const void* k;
    const void* v;
    const int32_t* qsl;
    const int32_t* seq_lens;
    const int32_t* tables;
    void* out;
    int64_t tokens, requests, num_heads, num_kv_heads, head_dim, block_size, table_width, num_blocks;
    float scale;
    int64_t flash_min;  // requests with at least this many new tokens go to flash_prefill.h (0: none)
};

inline bool is_flash(const Step& s, int64_t r) {
    return s.flash_min > 0 && s.qsl[r + 1] - s.qsl[r] >= s.flash_min;
}

// Per token: its request (-1 for padding past the last request) and its causal length. Returns the
// number of requests refused (bad lengths or block ids, or query counts past their length).
inline int64_t plan_tokens(const Step& s, std::vector<int32_t>& request, std::vector<int32_t>& length) {
    int64_t bad = 0;
    std::fill(request.begin(), request.end(), -1);
    for (int64_t r = 0; r < s.requests; ++r) {
        const int64_t begin = s.qsl[r], end = s.qsl[r + 1], len = s.seq_lens[r];
        if (begin < 0 || end < begin || end > s.tokens || end - begin > len ||
            request_is_bad(s.tables + r * s.table_width, len, s.table_width, s.block_size, s.num_blocks)) {
            ++bad;
            continue;
        }
        for (int64_t t = begin; t < end; ++t) {
            request[t] = int32_t(r);
            length[t] = int32_t(len - (end - t) + 1);  // causal: the token's own position and all before it
        }
    }
    return bad;
}

// Tokens of a prefill chunk per tile: a multiple of 3 and 2 (the heads of attend's register groups),
// and at most 48 query vectors, so a task's buffers stay small.
inline int64_t tile_tokens(int64_t group) { return group <= 2 ? 24 : 12; }

// The tiles of every request with at least a tile of query tokens: (request, first token, tokens).
inline std::vector<std::array<int64_t, 3>> plan_tiles(const Step& s) {
    const int64_t size = tile_tokens(s.num_heads / s.num_kv_heads);
    std::vector<std::array<int64_t, 3>> tiles;
    for (int64_t r = 0; r < s.requests; ++r)
        if (s.qsl[r + 1] - s.qsl[r] >= size && !is_flash(s, r))
            for (int64_t t = s.qsl[r]; t < s.qsl[r + 1]; t += size)
                tiles.push_back({r, t, std::min<int64_t>(size, s.qsl[r + 1] - t)});
    return tiles;
}

// One tile's tokens, one kv head: tile x G query vectors of that kv head.
template <typename T>
void attend_tile(const Step& s, const std::array<int64_t, 3>& tile, int64_t kv_head, const std::vector<int32_t>& length) {
    const int group = int(s.num_heads / s.num_kv_heads);
    const int64_t row_stride = s.num_kv_heads * s.head_dim, d = s.head_dim;
    const int64_t t0 = tile[1], n = tile[2], vectors = n * group;
    const T* q = static_cast<const T*>(s.q);
    T* out = static_cast<T*>(s.out);
    float q32[vectors * d], o32[vectors * d];
    T q_raw[vectors * d];
    int32_t lens[vectors];
    for (int64_t t = 0; t < n; ++t)
        for (int64_t h = 0; h < group; ++h) {
            const int64_t vec = t * group + h, head = kv_head * group + h;
            lens[vec] = length[t0 + t];
            for (int64_t i = 0; i < d; ++i) {
                q_raw[vec * d + i] = q[(t0 + t) * s.q_token_stride + head * s.q_head_stride + i];
                q32[vec * d + i] = to_float(q_raw[vec * d + i]);
            }
        }
    attend(q32, q_raw, static_cast<const T*>(s.k) + kv_head * d, static_cast<const T*>(s.v) + kv_head * d,
           s.tables + tile[0] * s.table_width, length[t0 + n - 1], o32, int(vectors), int(vectors), int(d),
           int(s.block_size), row_stride, s.scale, lens);
    for (int64_t t = 0; t < n; ++t)
        for (int64_t h = 0; h < group; ++h)
            for (int64_t i = 0; i < d; ++i)
                put(out + ((t0 + t) * s.num_heads + kv_head * group + h) * d + i, o32[(t * group + h) * d + i]);
}

// Where the tiles pack a request's K and V from (attention_amx.h's pack_head): the cache's blocks in
// place, except positions from `staged_from` on, which are rows of staged_k / staged_v (from their first
// row): a flash request's last, partial 32 positions with zero rows after, or every position where the
// block size is not a multiple of 16 (pack_head reads 16 positions of one block at a time).
struct PackSource {
    const uint16_t *k, *v;  // the cache's K and V
    const int32_t* table;   // the request's blocks
    int64_t block_size, row;
    int64_t staged_from;
    const uint16_t *staged_k, *staged_v;

    int64_t in_cache(int64_t p) const { return (table[p / block_size] * block_size + p % block_size) * row; }

    // Positions [p0, p0 + 32) of kv head h into that head's packed K (kb) and V (vb) of len positions.
    void pack(int64_t h, int d, int64_t p0, int64_t len, uint32_t* kb, uint16_t* vb) const {
        const uint16_t *ks[2], *vs[2];
        for (int i = 0; i < 2; ++i) {
            const int64_t p = p0 + 16 * i;
            const bool staged = p >= staged_from;
            const int64_t at = staged ? (p - staged_from) * row : in_cache(p);
            ks[i] = (staged ? staged_k : k) + at + h * d;
            vs[i] = (staged ? staged_v : v) + at + h * d;
        }
        pack_head(ks, vs, row, p0, d, len, kb, vb);
    }
};

// Positions [0, len) of the request whose blocks are `table`, up to `padded` (a multiple of AMX_ALIGN)
// with zero rows: a hidden position's P is 0, but 0 times a NaN is not, so the rows past len must hold
// numbers. `staged` keeps the rows copied out.
inline PackSource pack_source(const Step& s, const int32_t* table, int64_t len, int64_t padded,
                              std::unique_ptr<uint16_t[]>& staged) {
    const uint16_t* k = static_cast<const uint16_t*>(s.k);
    const uint16_t* v = static_cast<const uint16_t*>(s.v);
    const int64_t row = s.num_kv_heads * s.head_dim;
    const int64_t from = s.block_size % 16 ? 0 : len / AMX_ALIGN * AMX_ALIGN, rows = padded - from;
    staged.reset(rows ? new uint16_t[2 * rows * row] : nullptr);
    uint16_t *staged_k = staged.get(), *staged_v = staged_k + rows * row;
    for (auto [cache, to] : {std::pair{k, staged_k}, std::pair{v, staged_v}}) {
        if (!rows) break;
        gather_rows(cache, table, from, len, s.block_size, row, to);
        std::memset(to + (len - from) * row, 0, (padded - len) * row * sizeof(uint16_t));
    }
    return {k, v, table, s.block_size, row, from, staged_k, staged_v};
}

// Every kv head's K and V, positions [0, len) (a multiple of AMX_ALIGN), packed for the tiles into kb and
// vb (len * d elements each per kv head), across the threads.
inline void pack_heads(const PackSource& source, int64_t kv_heads, int64_t d, int64_t len, uint32_t* kb, uint16_t* vb) {
    const int64_t steps = len / AMX_ALIGN;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < kv_heads * steps; ++task) {
        const int64_t h = task / steps, p0 = task % steps * AMX_ALIGN;
        source.pack(h, int(d), p0, len, kb + h * len * d / 2, vb + h * len * d);
    }
}

// A flash request on AMX's tiles (attention_amx.h), bf16: its K/V rows [0, len) packed once per kv head
// straight from the blocks (zero rows past len, up to a multiple of AMX_ALIGN), then a task per query
// head and 32 consecutive tokens: a block of tokens reads only the positions its last one sees (ATen's
// kernel computes whole 512-position blocks of a short prompt and masks them).
inline void flash_on_amx(const Step& s, int64_t r, uint16_t* out) {
    const int64_t begin = s.qsl[r], n = s.qsl[r + 1] - begin, len = s.seq_lens[r], from = len - n;
    const int64_t d = s.head_dim, group = s.num_heads / s.num_kv_heads;
    const int64_t padded = amx_padded(len), blocks = (n + AMX_QUERIES - 1) / AMX_QUERIES;
    std::unique_ptr<uint16_t[]> staged;
    TileBuffer<uint16_t> vb = tile_buffer<uint16_t>(s.num_kv_heads * padded * d);
    TileBuffer<uint32_t> kb = tile_buffer<uint32_t>(s.num_kv_heads * padded * d / 2);
    pack_heads(pack_source(s, s.tables + r * s.table_width, len, padded, staged), s.num_kv_heads, d, padded, kb.get(),
               vb.get());
    const uint16_t* q = static_cast<const uint16_t*>(s.q);
#pragma omp parallel
    {
        configure_attention_tiles();
        TileBuffer<float> scratch = tile_buffer<float>(AMX_QUERIES * amx_scratch_row(padded));
        TileBuffer<float> o = tile_buffer<float>(AMX_QUERIES * d);
        TileBuffer<uint16_t> qt = tile_buffer<uint16_t>(AMX_QUERIES * d);
        float lse[AMX_QUERIES];
        // The longest blocks (the last tokens') first, so the short ones fill in at the end.
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < s.num_heads * blocks; ++task) {
            const int64_t head = task % s.num_heads, first = (blocks - 1 - task / s.num_heads) * AMX_QUERIES;
            const int64_t m = std::min<int64_t>(AMX_QUERIES, n - first), h = head / group;
            for (int64_t j = 0; j < m; ++j)
                std::memcpy(&qt[j * d], q + (begin + first + j) * s.q_token_stride + head * s.q_head_stride,
                            d * sizeof(uint16_t));
            attend_amx(qt.get(), int(m), kb.get() + h * padded * d / 2, vb.get() + h * padded * d, padded, len, int(d),
                       s.scale, from + first, scratch.get(), o.get(), lse);
            for (int64_t j = 0; j < m; ++j)
                for (int64_t i = 0; i < d; ++i)
                    put(out + ((begin + first + j) * s.num_heads + head) * d + i, o[j * d + i]);
        }
    }
}

// The tiles take flash requests of up to this many positions, the longest measured against ATen's kernel
// (docs/benchmarks.md), which keeps the longer ones.
constexpr int64_t FLASH_AMX_MAX_LEN = 8192;

// The flash requests one after another (the flash kernel spreads each over the threads itself), but
// those a cascade computed. In bf16 on AMX they go to the tiles (flash_on_amx), up to FLASH_AMX_MAX_LEN.
template <typename T>
void run_flash(const Step& s, ScalarType dtype, std::vector<int32_t>& request) {
    auto pending = [&](int64_t r) { return is_flash(s, r) && request[s.qsl[r]] != -2; };
    if constexpr (std::is_same<T, uint16_t>::value) {
        if (attention_on_amx(true, s.head_dim)) {  // uint16_t elements are bf16
            for (int64_t r = 0; r < s.requests; ++r) {
                if (!pending(r) || s.seq_lens[r] > FLASH_AMX_MAX_LEN) continue;
                flash_on_amx(s, r, static_cast<uint16_t*>(s.out));
                for (int64_t t = s.qsl[r]; t < s.qsl[r + 1]; ++t) request[t] = -2;
            }
        }
    }
    int64_t longest = 0;
    for (int64_t r = 0; r < s.requests; ++r)
        if (pending(r)) longest = std::max<int64_t>(longest, s.seq_lens[r]);
    if (longest == 0) return;
    std::unique_ptr<T[]> buffer(new T[2 * longest * s.num_kv_heads * s.head_dim]);
    const T* k = static_cast<const T*>(s.k);
    const T* v = static_cast<const T*>(s.v);
    for (int64_t r = 0; r < s.requests; ++r) {
        if (!pending(r)) continue;
        const int64_t begin = s.qsl[r], n = s.qsl[r + 1] - begin;
        flash_prefill(static_cast<const T*>(s.q), s.q_token_stride, s.q_head_stride, dtype, k, v,
                      s.tables + r * s.table_width, begin, n, int64_t(s.seq_lens[r]), s.num_heads, s.num_kv_heads,
                      s.head_dim, s.block_size, s.scale, buffer.get(), static_cast<T*>(s.out));
        for (int64_t t = begin; t < begin + n; ++t) request[t] = -2;  // done: the tasks below leave it alone
    }
}

// Cascade attention for requests that share a prefix (many requests over one system prompt or
// document): where requests that begin with the same whole blocks bring max(flash_min, 2) or more new
// tokens between them, each of them a decode or a flash request (flash_min+ new tokens), all their
// queries attend to those blocks together, as one chunk of that many rows to ATen's flash kernel (the
// shared K/V read in place where consecutive), or in bf16 on AMX to the tiles (packed from the blocks; a
// multiple of AMX_ALIGN positions, the rest going with each member's own), and each request to its own
// remaining positions alone: a decode with `attend`, a chunk with flash_span. The parts are merged by
// their log-sum-exps. On the tiles every cascade of the step shares one parallel loop for the shared
// parts and one for the decodes' own parts (few tasks each per cascade: a loop apiece left threads idle
// at its end).
// Without it each request reads the shared blocks on its own, and a chunk's flash calls are small.
struct Cascade {
    std::vector<int64_t> requests;
    int64_t shared;  // positions [0, shared) common to all, whole blocks, before each one's first new token
};

inline int64_t new_tokens(const Step& s, int64_t r) { return s.qsl[r + 1] - s.qsl[r]; }

// `align` (positions): the shared part is a multiple of it (the tiles' AMX_ALIGN where they serve it).
inline std::vector<Cascade> plan_cascades(const Step& s, int64_t align) {
    std::vector<Cascade> cascades;
    const int64_t least = std::max<int64_t>(s.flash_min, 2);
    if (s.flash_min <= 0) return cascades;
    std::vector<int64_t> members;
    for (int64_t r = 0; r < s.requests; ++r) {
        const int64_t n = new_tokens(s, r);
        if ((n == 1 || is_flash(s, r)) && s.seq_lens[r] - n >= s.block_size) members.push_back(r);
    }
    // Grouped by first block: sorted by it, then runs of equal ones.
    auto first = [&](int64_t r) { return s.tables[r * s.table_width]; };
    std::stable_sort(members.begin(), members.end(), [&](int64_t a, int64_t b) { return first(a) < first(b); });
    for (size_t i = 0; i < members.size();) {
        size_t j = i;
        int64_t rows = 0;
        for (; j < members.size() && first(members[j]) == first(members[i]); ++j) rows += new_tokens(s, members[j]);
        if (j - i >= 2 && rows >= least) {
            const int32_t* lead = s.tables + members[i] * s.table_width;
            int64_t blocks = s.table_width;
            for (size_t m = i; m < j; ++m) {
                const int64_t r = members[m];
                const int32_t* table = s.tables + r * s.table_width;
                int64_t b = 0;
                const int64_t limit = std::min(blocks, (int64_t(s.seq_lens[r]) - new_tokens(s, r)) / s.block_size);
                while (b < limit && table[b] == lead[b]) ++b;
                blocks = b;
            }
            while (blocks > 0 && blocks * s.block_size % align) --blocks;
            if (blocks > 0)
                cascades.push_back({{members.begin() + i, members.begin() + j}, blocks * s.block_size});
        }
        i = j;
    }
    return cascades;
}

// A cascade's queries, gathered: member i's rows [offset[i], offset[i + 1]) of rows [m, heads, d].
template <typename T>
struct CascadeQueries {
    std::vector<int64_t> offset;
    std::unique_ptr<T[]> rows;
    int64_t m;
};

template <typename T>
CascadeQueries<T> gather_queries(const Step& s, const Cascade& c) {
    const int64_t members = int64_t(c.requests.size()), heads = s.num_heads, d = s.head_dim;
    CascadeQueries<T> g{std::vector<int64_t>(members + 1, 0), nullptr, 0};
    for (int64_t i = 0; i < members; ++i) g.offset[i + 1] = g.offset[i] + new_tokens(s, c.requests[i]);
    g.m = g.offset[members];
    g.rows.reset(new T[g.m * heads * d]);
    const T* q = static_cast<const T*>(s.q);
    for (int64_t i = 0; i < members; ++i)
        for (int64_t t = 0; t < g.offset[i + 1] - g.offset[i]; ++t)
            for (int64_t h = 0; h < heads; ++h)
                std::memcpy(g.rows.get() + ((g.offset[i] + t) * heads + h) * d,
                            q + (s.qsl[c.requests[i]] + t) * s.q_token_stride + h * s.q_head_stride, d * sizeof(T));
    return g;
}

// One cascade's shared part for the tiles: its m query rows against positions [0, shared) of `source`,
// into common [m, heads, d] and its log-sum-exps lse [m, heads].
struct AmxShared {
    const uint16_t* queries;
    int64_t m;
    PackSource source;
    int64_t shared;
    float* common;
    float* lse;
};

// Every cascade's shared part on AMX (attention_amx.h), in one parallel loop: a task is query vectors of
// one kv head of one cascade (a kv head's vectors are the group's rows times its query heads). With many
// (a cascade of chunks), that cascade's K and V are packed first for every kv head, and a task takes 32
// vectors; with few (a cascade of decodes), a task takes all of one kv head's and packs its K and V
// itself, so one head's packing, which reads the shared blocks from memory, overlaps another's products.
inline void shared_on_amx(const Step& s, const std::vector<AmxShared>& parts) {
    const int64_t heads = s.num_heads, d = s.head_dim, group = heads / s.num_kv_heads;
    struct Task {
        int64_t part, g, begin, end;
    };
    std::vector<Task> tasks;
    std::vector<TileBuffer<uint32_t>> kb(parts.size());  // packed before the loop (not own_pack)
    std::vector<TileBuffer<uint16_t>> vb(parts.size());
    int64_t longest = 0, longest_own = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
        const AmxShared& part = parts[i];
        const int64_t vectors = part.m * group;
        const bool own_pack = vectors <= 2 * AMX_QUERIES;
        const int64_t per_task = own_pack ? vectors : AMX_QUERIES;
        for (int64_t g = 0; g < s.num_kv_heads; ++g)
            for (int64_t begin = 0; begin < vectors; begin += per_task)
                tasks.push_back({int64_t(i), g, begin, std::min(begin + per_task, vectors)});
        longest = std::max(longest, part.shared);
        if (own_pack) {
            longest_own = std::max(longest_own, part.shared);
            continue;
        }
        kb[i] = tile_buffer<uint32_t>(s.num_kv_heads * part.shared * d / 2);
        vb[i] = tile_buffer<uint16_t>(s.num_kv_heads * part.shared * d);
        pack_heads(part.source, s.num_kv_heads, d, part.shared, kb[i].get(), vb[i].get());
    }
#pragma omp parallel
    {
        configure_attention_tiles();
        TileBuffer<float> scratch = tile_buffer<float>(AMX_QUERIES * amx_scratch_row(longest));
        TileBuffer<float> o = tile_buffer<float>(AMX_QUERIES * d);
        TileBuffer<uint16_t> qt = tile_buffer<uint16_t>(AMX_QUERIES * d), vt = tile_buffer<uint16_t>(longest_own * d);
        TileBuffer<uint32_t> kt = tile_buffer<uint32_t>(longest_own * d / 2);
        float l[AMX_QUERIES];
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < tasks.size(); ++i) {
            const Task& task = tasks[i];
            const AmxShared& part = parts[task.part];
            const int64_t g = task.g, shared = part.shared;
            const bool own_pack = !kb[task.part];
            if (own_pack)
                for (int64_t p0 = 0; p0 < shared; p0 += AMX_ALIGN)
                    part.source.pack(g, int(d), p0, shared, kt.get(), vt.get());
            const uint32_t* k = own_pack ? kt.get() : kb[task.part].get() + g * shared * d / 2;
            const uint16_t* v = own_pack ? vt.get() : vb[task.part].get() + g * shared * d;
            for (int64_t first = task.begin; first < task.end; first += AMX_QUERIES) {
                const int64_t n = std::min<int64_t>(AMX_QUERIES, task.end - first);
                auto head_row = [&](int64_t j) {  // vector first + j: (row among the group's, query head) flattened
                    const int64_t vec = first + j;
                    return (vec / group) * heads + g * group + vec % group;
                };
                for (int64_t j = 0; j < n; ++j)
                    std::memcpy(&qt[j * d], part.queries + head_row(j) * d, d * sizeof(uint16_t));
                attend_amx(qt.get(), int(n), k, v, shared, shared, int(d), s.scale, INT64_MAX / 2, scratch.get(), o.get(), l);
                for (int64_t j = 0; j < n; ++j) {
                    std::memcpy(part.common + head_row(j) * d, &o[j * d], d * sizeof(float));
                    part.lse[head_row(j)] = l[j];
                }
            }
        }
    }
}

// A cascade's shared part as computed, for its members' merges: out (C: its element type) and lse, with
// oh/ot and lh/lt their strides per head and row.
template <typename T, typename C>
struct SharedResult {
    const Cascade* cascade;
    const CascadeQueries<T>* queries;
    const C* out;
    int64_t oh, ot;
    const float* lse;
    int64_t lh, lt;
};

// The chunks' own positions, one chunk after another (the flash kernel spreads each over the threads),
// merged with their rows of the shared part.
template <typename T, typename C>
void finish_chunks(const Step& s, ScalarType dtype, const SharedResult<T, C>& shared) {
    const Cascade& c = *shared.cascade;
    const std::vector<int64_t>& offset = shared.queries->offset;
    const int64_t heads = s.num_heads, d = s.head_dim, row = s.num_kv_heads * d, width = heads * d;
    T* out = static_cast<T*>(s.out);
    for (size_t i = 0; i < c.requests.size(); ++i) {
        const int64_t r = c.requests[i], n = offset[i + 1] - offset[i], len = s.seq_lens[r];
        if (n == 1) continue;
        std::unique_ptr<T[]> rows(new T[2 * len * row]);
        std::unique_ptr<float[]> own(new float[n * width]), lse(new float[n * heads]);
        flash_span(heads_view(shared.queries->rows.get() + offset[i] * width, dtype, heads, n, d, width, d), dtype,
                   static_cast<const T*>(s.k), static_cast<const T*>(s.v), s.tables + r * s.table_width, c.shared, n,
                   len, heads, s.num_kv_heads, d, s.block_size, s.scale, rows.get(), own.get(), lse.get());
#pragma omp parallel for schedule(static) if (n * width >= (1 << 15))
        for (int64_t t = 0; t < n; ++t)
            for (int64_t h = 0; h < heads; ++h)
                merge_row(out + ((s.qsl[r] + t) * heads + h) * d,
                          shared.out + h * shared.oh + (offset[i] + t) * shared.ot,
                          shared.lse[h * shared.lh + (offset[i] + t) * shared.lt], own.get() + (t * heads + h) * d,
                          lse[t * heads + h], d);
    }
}

// The decodes' own positions, merged with their rows of the shared parts: every cascade's decodes in one
// parallel loop, a task each.
template <typename T, typename C>
void finish_decodes(const Step& s, const std::vector<SharedResult<T, C>>& results) {
    const int64_t heads = s.num_heads, d = s.head_dim, row = s.num_kv_heads * d, width = heads * d;
    std::vector<std::pair<const SharedResult<T, C>*, int64_t>> decodes;  // (cascade, member)
    for (const auto& result : results) {
        const std::vector<int64_t>& offset = result.queries->offset;
        for (size_t i = 0; i < result.cascade->requests.size(); ++i)
            if (offset[i + 1] - offset[i] == 1) decodes.push_back({&result, int64_t(i)});
    }
    T* out = static_cast<T*>(s.out);
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t task = 0; task < decodes.size(); ++task) {
        const SharedResult<T, C>& shared = *decodes[task].first;
        const int64_t i = decodes[task].second, r = shared.cascade->requests[i], t = s.qsl[r];
        const int64_t at = shared.queries->offset[i], from = shared.cascade->shared;
        float q32[width], o32[width], lse[heads];
        const T* q_raw = shared.queries->rows.get() + at * width;
        for (int64_t e = 0; e < width; ++e) q32[e] = to_float(q_raw[e]);
        attend(q32, q_raw, static_cast<const T*>(s.k), static_cast<const T*>(s.v),
               s.tables + r * s.table_width + from / s.block_size, int(s.seq_lens[r] - from), o32, int(heads),
               int(heads / s.num_kv_heads), int(d), int(s.block_size), row, s.scale, nullptr, lse);
        for (int64_t h = 0; h < heads; ++h)
            merge_row(out + (t * heads + h) * d, shared.out + h * shared.oh + at * shared.ot,
                      shared.lse[h * shared.lh + at * shared.lt], o32 + h * d, lse[h], d);
    }
}

// Every cascade of the step: on AMX (bf16) all their shared parts in one parallel loop and all their
// decodes' own parts in another; else each cascade's shared part as one call to ATen's flash kernel.
template <typename T>
void run_cascades(const Step& s, ScalarType dtype, const std::vector<Cascade>& cascades, bool on_amx,
                  std::vector<int32_t>& request) {
    const int64_t heads = s.num_heads, d = s.head_dim, row = s.num_kv_heads * d, width = heads * d;
    std::vector<CascadeQueries<T>> queries;
    for (const Cascade& c : cascades) queries.push_back(gather_queries<T>(s, c));
    auto lead = [&](const Cascade& c) { return s.tables + c.requests[0] * s.table_width; };
    bool done = false;
    if constexpr (std::is_same<T, uint16_t>::value) {
        if (on_amx) {
            std::vector<std::unique_ptr<float[]>> common, lse;
            std::vector<std::unique_ptr<uint16_t[]>> staged(cascades.size());
            std::vector<AmxShared> parts;
            std::vector<SharedResult<T, float>> results;
            for (size_t i = 0; i < cascades.size(); ++i) {
                const Cascade& c = cascades[i];
                const int64_t m = queries[i].m;
                common.emplace_back(new float[m * width]);
                lse.emplace_back(new float[m * heads]);
                parts.push_back({queries[i].rows.get(), m, pack_source(s, lead(c), c.shared, c.shared, staged[i]),
                                 c.shared, common[i].get(), lse[i].get()});
                results.push_back({&c, &queries[i], common[i].get(), d, width, lse[i].get(), 1, heads});
            }
            shared_on_amx(s, parts);
            for (const auto& result : results) finish_chunks(s, dtype, result);
            finish_decodes(s, results);
            done = true;
        }
    }
    for (size_t i = 0; i < cascades.size() && !done; ++i) {
        const Cascade& c = cascades[i];
        std::unique_ptr<T[]> buffer(new T[2 * c.shared * row]);
        const T* keys = span_rows(static_cast<const T*>(s.k), lead(c), 0, c.shared, s.block_size, row, buffer.get());
        const T* values = span_rows(static_cast<const T*>(s.v), lead(c), 0, c.shared, s.block_size, row,
                                    buffer.get() + c.shared * row);
        auto kv = [&](const T* rows) {
            return heads_view(const_cast<T*>(rows), dtype, s.num_kv_heads, c.shared, d, row, d);
        };
        const Tensor q = heads_view(queries[i].rows.get(), dtype, heads, queries[i].m, d, width, d);
        const FlashResult common = flash_attention(q, kv(keys), kv(values), false, s.scale);
        const SharedResult<T, T> result{&c, &queries[i], static_cast<const T*>(common.out.data_ptr()),
                                        common.out.stride(1), common.out.stride(2),
                                        static_cast<const float*>(common.lse.data_ptr()), common.lse.stride(1),
                                        common.lse.stride(2)};
        finish_chunks(s, dtype, result);
        finish_decodes<T, T>(s, {result});
    }
    for (const Cascade& c : cascades)
        for (int64_t r : c.requests)
            for (int64_t t = s.qsl[r]; t < s.qsl[r + 1]; ++t) request[t] = -2;
}

// q, the cache and out are all of one element type T.
template <typename T>
void run(const Step& s, ScalarType dtype, std::vector<int32_t>& request, const std::vector<int32_t>& length) {
    const bool on_amx = attention_on_amx(std::is_same<T, uint16_t>::value, s.head_dim);
    run_cascades<T>(s, dtype, plan_cascades(s, on_amx ? AMX_ALIGN : 1), on_amx, request);
    run_flash<T>(s, dtype, request);
    const auto tiles = plan_tiles(s);
    for (const auto& tile : tiles)  // the per-token tasks below leave the tiled tokens alone
        for (int64_t t = tile[1]; t < tile[1] + tile[2]; ++t) request[t] = -2;
    const int64_t tile_tasks = int64_t(tiles.size()) * s.num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < tile_tasks; ++task)
        attend_tile<T>(s, tiles[task / s.num_kv_heads], task % s.num_kv_heads, length);
    const int group = int(s.num_heads / s.num_kv_heads);
    const int64_t row_stride = s.num_kv_heads * s.head_dim;
    // A task per token reads each block as one contiguous run (per-kv-head tasks were slower on a
    // 64-row decode); with few tokens (a batch-1 decode) the kv heads are split so every thread works.
    const int64_t splits = s.tokens < 4 * omp_get_max_threads() ? s.num_kv_heads : 1;
    const int64_t heads = s.num_heads / splits, width = heads * s.head_dim;
    const T* q = static_cast<const T*>(s.q);
    T* out = static_cast<T*>(s.out);
    // Tokens differ in length, so tasks are handed out dynamically rather than split evenly.
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t t = 0; t < s.tokens; ++t) {
        for (int64_t split = 0; split < splits; ++split) {
            const int64_t h0 = split * heads;
            T* o = out + (t * s.num_heads + h0) * s.head_dim;
            if (request[t] == -2) continue;  // in a tile, a flash request or a cascade
            if (request[t] < 0) {
                for (int64_t i = 0; i < width; ++i) put(o + i, 0.f);
                continue;
            }
            float q32[width], o32[width];
            T q_raw[width];  // the task's heads of q, contiguous, as stored (bf16 dot products read them)
            for (int64_t h = 0; h < heads; ++h)
                for (int64_t d = 0; d < s.head_dim; ++d) {
                    q_raw[h * s.head_dim + d] = q[t * s.q_token_stride + (h0 + h) * s.q_head_stride + d];
                    q32[h * s.head_dim + d] = to_float(q_raw[h * s.head_dim + d]);
                }
            const int64_t kv_offset = (h0 / group) * s.head_dim;
            attend(q32, q_raw, static_cast<const T*>(s.k) + kv_offset, static_cast<const T*>(s.v) + kv_offset,
                   s.tables + int64_t(request[t]) * s.table_width, length[t], o32, int(heads), group,
                   int(s.head_dim), int(s.block_size), row_stride, s.scale);
            for (int64_t i = 0; i < width; ++i) put(o + i, o32[i]);
        }
    }
}

Tensor paged_attention_cpu(Tensor q, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables,
                           double scale, int64_t flash_min) {
    check_cpu(q, "q");
    check_cpu(kv_cache, "kv_cache");
    check_int32(query_start_loc, "query_start_loc", 1);
    check_int32(seq_lens, "seq_lens", 1);
    check_int32(block_tables, "block_tables", 2);
    STD_TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim] with unit stride in "
                    "head_dim, got ", shape(q));
    STD_TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
                    "kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim] tensor, got ", shape(kv_cache));
    const Kind kind = kind_of(kv_cache, "kv_cache");
    STD_TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q must be in the kv_cache's dtype");
    Step s;
    s.tokens = q.size(0), s.num_heads = q.size(1), s.head_dim = q.size(2);
    s.num_blocks = kv_cache.size(1), s.block_size = kv_cache.size(2), s.num_kv_heads = kv_cache.size(3);
    s.requests = seq_lens.size(0), s.table_width = block_tables.size(1);
    STD_TORCH_CHECK(kv_cache.size(4) == s.head_dim && s.num_heads % s.num_kv_heads == 0,
                    "q ", shape(q), " does not fit kv_cache ", shape(kv_cache), " (heads must be a multiple of kv heads)");
    STD_TORCH_CHECK(s.head_dim % 8 == 0 && s.block_size % 8 == 0, "head_dim ", s.head_dim, " and block_size ",
                    s.block_size, " must be multiples of 8 (the kernel reads whole 8-float vectors)");
    STD_TORCH_CHECK(query_start_loc.size(0) == s.requests + 1 && block_tables.size(0) == s.requests,
                    "query_start_loc ", shape(query_start_loc), ", seq_lens ", shape(seq_lens), " and block_tables ",
                    shape(block_tables), " disagree on the number of requests");
    s.q = q.data_ptr(), s.q_token_stride = q.stride(0), s.q_head_stride = q.stride(1);
    const int64_t half = s.num_blocks * s.block_size * s.num_kv_heads * s.head_dim;
    const char* cache = static_cast<const char*>(kv_cache.data_ptr());
    s.k = cache, s.v = cache + half * int64_t(kv_cache.element_size());
    s.qsl = static_cast<const int32_t*>(query_start_loc.data_ptr());
    s.seq_lens = static_cast<const int32_t*>(seq_lens.data_ptr());
    s.tables = static_cast<const int32_t*>(block_tables.data_ptr());
    s.scale = float(scale);
    s.flash_min = flash_min;

    std::vector<int32_t> request(s.tokens), length(s.tokens);
    const int64_t bad = plan_tokens(s, request, length);
    STD_TORCH_CHECK(bad == 0, "paged_attention_cpu: ", bad, " request(s) with a length past their block table, a "
                    "block id outside [0, ", s.num_blocks, "), or query tokens outside the step or past their length");
    Tensor out = empty_as(q, {s.tokens, s.num_heads, s.head_dim});
    s.out = out.data_ptr();
    switch (kind) {
        case F32: run<float>(s, q.scalar_type(), request, length); break;
        case BF16: run<uint16_t>(s, q.scalar_type(), request, length); break;
        case F16: run<f16>(s, q.scalar_type(), request, length); break;
    }
    return out;
}

// k and v [tokens, kv_heads, head_dim] into the cache rows slot_mapping names (-1: not written).
template <typename T>
void write_rows(const Tensor& k, const Tensor& v, T* keys, T* values, const int64_t* slots, int64_t tokens,
                int64_t row) {
    const T* kp = static_cast<const T*>(k.data_ptr());
    const T* vp = static_cast<const T*>(v.data_ptr());
    const int64_t k_stride = k.stride(0), v_stride = v.stride(0), k_head = k.stride(1), v_head = v.stride(1);
    const int64_t heads = k.size(1), head_dim = k.size(2);
    for (int64_t t = 0; t < tokens; ++t) {
        if (slots[t] < 0) continue;
        for (int64_t h = 0; h < heads; ++h) {
            std::memcpy(keys + slots[t] * row + h * head_dim, kp + t * k_stride + h * k_head, head_dim * sizeof(T));
            std::memcpy(values + slots[t] * row + h * head_dim, vp + t * v_stride + h * v_head, head_dim * sizeof(T));
        }
    }
}

void write_kv_cpu(Tensor k, Tensor v, Tensor kv_cache, Tensor slot_mapping) {
    check_cpu(k, "k");
    check_cpu(v, "v");
    check_cpu(slot_mapping, "slot_mapping");
    STD_TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
                    "kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim] tensor, got ", shape(kv_cache));
    const int64_t tokens = slot_mapping.size(0), heads = kv_cache.size(3), head_dim = kv_cache.size(4);
    const int64_t slots_total = kv_cache.size(1) * kv_cache.size(2);
    STD_TORCH_CHECK(slot_mapping.scalar_type() == ScalarType::Long && slot_mapping.dim() == 1 &&
                        slot_mapping.is_contiguous(), "slot_mapping must be a contiguous int64 [tokens] tensor");
    for (const Tensor* t : {&k, &v})
        STD_TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == heads && t->size(2) == head_dim &&
                            t->stride(2) == 1 && t->scalar_type() == kv_cache.scalar_type(),
                        "k and v must be [tokens, kv_heads, head_dim] in the cache's dtype, unit stride in head_dim; got ",
                        shape(*t), " for cache ", shape(kv_cache));
    const int64_t* slots = static_cast<const int64_t*>(slot_mapping.data_ptr());
    for (int64_t t = 0; t < tokens; ++t)
        STD_TORCH_CHECK(slots[t] >= -1 && slots[t] < slots_total, "write_kv_cpu: slot ", slots[t], " of token ", t,
                        " is outside the cache's ", slots_total, " slots");
    const int64_t row = heads * head_dim;
    char* base = static_cast<char*>(kv_cache.data_ptr());
    const int64_t half = slots_total * row * int64_t(kv_cache.element_size());
    switch (kind_of(kv_cache, "kv_cache")) {
        case F32: write_rows(k, v, reinterpret_cast<float*>(base), reinterpret_cast<float*>(base + half), slots, tokens, row); break;
        case BF16:
            write_rows(k, v, reinterpret_cast<uint16_t*>(base), reinterpret_cast<uint16_t*>(base + half), slots, tokens, row);
            break;
        case F16: write_rows(k, v, reinterpret_cast<f16*>(base), reinterpret_cast<f16*>(base + half), slots, tokens, row); break;
    }
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(toolkit, m) {
    m.def("paged_attention_cpu(Tensor q, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
          "Tensor block_tables, float scale, int flash_min=0) -> Tensor");
    m.def("write_kv_cpu(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(toolkit, CPU, m) {
    m.impl("paged_attention_cpu", TORCH_BOX(&paged_attention_cpu));
    m.impl("write_kv_cpu", TORCH_BOX(&write_kv_cpu));
}
