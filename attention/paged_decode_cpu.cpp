// Paged decode attention for CPU: one query token per row against its paged K/V, in one pass.
//
// Why hand-written: Inductor's code for the traced version (decode_torch.py) computes each score as
// one 64-wide dot product ending in a horizontal sum, a dependent chain the core waits on, and it
// computes the masked padding positions of short rows too. Here each row is one task that walks only
// its own blocks with an online softmax (flash-decoding's recurrence), so its K/V are read once, in
// place, and scores are computed 8 rows at a time with one shuffle tree for their 8 sums. Measured
// on a 64-request decode it is memory-bound in a step (see docs/benchmarks.md), so the next block
// is prefetched while the current one is computed.
//
// Layout (attention/kv_cache.py): keys and values are [num_blocks, block_size, num_kv_heads, head_dim]
// each; q and out are [rows, num_heads, head_dim] float32; query head h uses kv head h / G, so a kv
// head's G query heads are adjacent rows of q. Built by decode_cpu.py with -O3 -march=native
// -ffast-math -fopenmp; fast-math lets the exp loops vectorize (glibc's libmvec), so no infinities
// are used: the running max starts at -FLT_MAX.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// GCC/Clang vector extensions: 8 floats, one AVX2 register here, lowered portably elsewhere.
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

typedef _Float16 f16;  // IEEE half (gcc's type: distinct from the bf16 storage above)

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

// The 8 horizontal sums of x[0..7] as one vector: a transpose-and-add tree, 12 shuffles for 8 dot
// products, where one horizontal sum per dot product made the score loop latency-bound.
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

// scores[0..7] = scale * (q . key row j) for 8 consecutive cache rows starting at key.
template <typename T>
inline vec8 scores8(const float* q, const T* key, int64_t row_stride, int head_dim, float scale) {
    vec8 acc[8] = {};
    for (int d = 0; d < head_dim; d += 8) {
        const vec8 qd = load8(q + d);
        for (int j = 0; j < 8; ++j) acc[j] += qd * load8(key + j * row_stride + d);
    }
    return horizontal_sums(acc) * scale;
}

// Share `share` of `shares` of a block's K and V cache lines that a task reads: `width` elements
// at the start of each of the block's rows. Issued all at a block's start, the prefetches gave
// nothing (the core stalls once its miss buffers are full); spread over the block's work, a cold
// 64-row decode ran ~25% faster.
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

// One task: num_heads query heads of one row (all of them, or the group of one kv head when there
// are too few rows to keep every thread busy). q, k, v and out point at the task's first head; a
// cache row (one position, all kv heads) is row_stride elements.
template <typename T>
void decode_row(const float* q, const T* k, const T* v, const int32_t* table, int len, float* out, int num_heads,
                int group, int head_dim, int block_size, int64_t row_stride, float scale) {
    float running_max[num_heads], denom[num_heads], acc[num_heads * head_dim], p[num_heads * block_size];
    for (int h = 0; h < num_heads; ++h) { running_max[h] = -FLT_MAX; denom[h] = 0.f; }
    std::fill(acc, acc + num_heads * head_dim, 0.f);

    for (int start = 0; start < len; start += block_size) {
        const int n = std::min(block_size, len - start);
        const int64_t base = int64_t(table[start / block_size]) * block_size * row_stride;
        // Scores in groups of 8 rows. Rows past n in the last block exist (whole blocks are
        // allocated); their scores are computed and never read.
        for (int h = 0; h < num_heads; ++h) {
            const T* key = k + base + (h / group) * head_dim;
            for (int i = 0; i < n; i += 8)
                store8(p + h * block_size + i, scores8(q + h * head_dim, key + i * row_stride, row_stride, head_dim, scale));
        }
        // The next block is elsewhere in memory: ask for it now, a share per head, so the requests
        // overlap the arithmetic (see prefetch_share).
        const bool has_next = start + block_size < len;
        const int64_t next = has_next ? int64_t(table[start / block_size + 1]) * block_size * row_stride : 0;
        for (int h = 0; h < num_heads; ++h) {
            if (has_next) prefetch_share(k + next, v + next, h, num_heads, (num_heads / group) * head_dim, block_size, row_stride);
            float* ph = p + h * block_size;
            float block_max = running_max[h];
            for (int i = 0; i < n; ++i) block_max = std::max(block_max, ph[i]);
            const float correction = std::exp(running_max[h] - block_max);
            running_max[h] = block_max;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < n; ++i) {
                ph[i] = std::exp(ph[i] - block_max);
                sum += ph[i];
            }
            denom[h] = denom[h] * correction + sum;
            float* ah = acc + h * head_dim;
            for (int d0 = 0; d0 < head_dim; d0 += 64) {  // a 64-float tile of the output in registers
                const int width = std::min(64, head_dim - d0);
                vec8 tile[8];
                for (int c = 0; c < width / 8; ++c) tile[c] = load8(ah + d0 + 8 * c) * correction;
                const T* value = v + base + (h / group) * head_dim + d0;
                for (int i = 0; i < n; ++i) {
                    const float w = ph[i];
                    for (int c = 0; c < width / 8; ++c) tile[c] += w * load8(value + i * row_stride + 8 * c);
                }
                for (int c = 0; c < width / 8; ++c) store8(ah + d0 + 8 * c, tile[c]);
            }
        }
    }
    for (int h = 0; h < num_heads; ++h) {
        const float inv = denom[h] > 0.f ? 1.f / denom[h] : 0.f;  // a row of length 0 gives zeros
        for (int d = 0; d < head_dim; ++d) out[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
}

// A row whose length overruns its block-table row, or whose table names a block outside the cache.
inline bool row_is_bad(const int32_t* table, int len, int table_width, int block_size, int num_blocks) {
    if (len < 0 || len > int64_t(table_width) * block_size) return true;
    for (int b = 0; b * block_size < len; ++b)
        if (table[b] < 0 || table[b] >= num_blocks) return true;
    return false;
}

// Returns how many rows were refused for bad lengths or block ids (their output is left unwritten).
template <typename T>
int decode(const float* q, const T* k, const T* v, const int32_t* seq_lens, const int32_t* tables, float* out,
           int rows, int num_heads, int num_kv_heads, int head_dim, int block_size, int table_width, int num_blocks,
           float scale) {
    const int group = num_heads / num_kv_heads;
    const int64_t row_stride = int64_t(num_kv_heads) * head_dim;
    // A task per row reads each block as one contiguous run (per-kv-head tasks were ~2x slower on a
    // 64-row decode); with few rows (a batch-1 decode) the kv heads are split so every thread works.
    const int splits = rows < 4 * omp_get_max_threads() ? num_kv_heads : 1;
    const int kv_per_task = num_kv_heads / splits;
    int bad = 0;
    // Rows differ in length, so tasks are handed out dynamically rather than split evenly.
#pragma omp parallel for collapse(2) schedule(dynamic, 1) reduction(+ : bad)
    for (int r = 0; r < rows; ++r) {
        for (int s = 0; s < splits; ++s) {
            const int32_t* table = tables + int64_t(r) * table_width;
            if (row_is_bad(table, seq_lens[r], table_width, block_size, num_blocks)) {
                bad += s == 0;
                continue;
            }
            const int64_t kv_off = int64_t(s) * kv_per_task * head_dim;
            const int64_t off = (int64_t(r) * num_heads + int64_t(s) * kv_per_task * group) * head_dim;
            decode_row(q + off, k + kv_off, v + kv_off, table, seq_lens[r], out + off, kv_per_task * group, group,
                       head_dim, block_size, row_stride, scale);
        }
    }
    return bad;
}

}  // namespace

extern "C" {

int paged_decode_f32(const float* q, const float* k, const float* v, const int32_t* seq_lens, const int32_t* tables,
                     float* out, int rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                     int table_width, int num_blocks, float scale) {
    return decode(q, k, v, seq_lens, tables, out, rows, num_heads, num_kv_heads, head_dim, block_size, table_width,
                  num_blocks, scale);
}

int paged_decode_bf16(const float* q, const uint16_t* k, const uint16_t* v, const int32_t* seq_lens,
                      const int32_t* tables, float* out, int rows, int num_heads, int num_kv_heads, int head_dim,
                      int block_size, int table_width, int num_blocks, float scale) {
    return decode(q, k, v, seq_lens, tables, out, rows, num_heads, num_kv_heads, head_dim, block_size, table_width,
                  num_blocks, scale);
}

int paged_decode_f16(const float* q, const f16* k, const f16* v, const int32_t* seq_lens, const int32_t* tables,
                     float* out, int rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                     int table_width, int num_blocks, float scale) {
    return decode(q, k, v, seq_lens, tables, out, rows, num_heads, num_kv_heads, head_dim, block_size, table_width,
                  num_blocks, scale);
}

}
