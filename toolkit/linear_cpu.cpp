// y = x W^T (+ b) for CPU, with W kept in column panels of float32 or bfloat16.
//
// Why hand-written: a decode step multiplies a few dozen rows by every weight, where oneDNN's
// packed fp32 kernel reached ~7 GFLOP/s at M=1 and ~90-110 at M=64 on this AVX2 host, and its bf16
// path is emulated (no AVX-512 BF16 here). This is the classic register-blocked GEMM micro-kernel
// (6 rows x 16 columns, 12 vector accumulators) streaming W once per call. bf16 weights are widened
// to float32 in registers: half the bytes of a memory-bound decode step, float32 FMAs throughout.
// Measured against oneDNN in one process (docs/benchmarks.md): 1.5x (fp32 W) and 2.6x (bf16 W) at
// M=1, 1.1-1.3x at M=64, about equal at M=2048.
//
// Layout: W [N, K] becomes panels [ceil(N / 16), K, 16], zero-padded past N, so a panel's 16
// columns for one k are one 64-byte (fp32) or 32-byte (bf16, fp16) run and a panel is read front to
// back. In a bf16 panel, 32-bit lane j holds column j in its low half and column j + 8 in its high
// half, so one load gives both vectors: a shift widens the low halves, a mask the high ones. fp16
// panels keep the plain order: F16C's vcvtph2ps widens 8 halves at once.
// x and out are float32, bfloat16 or float16 (then x is widened once per call and out rounded to
// nearest even on store: two fewer tensor passes per call than converting around the op).
// Built by attention/cpp_build.py with -O3 -march=native -ffast-math -fopenmp.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include <omp.h>

#include "half_float.h"  // f16, to_float, put
#ifdef __F16C__
#include <immintrin.h>
#endif

namespace {

typedef float vec8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

constexpr int NR = 16;       // columns per panel: two 8-float vectors
constexpr int MR = 6;        // rows per tile: 12 accumulators + 2 weight vectors + 1 broadcast = 15 registers
constexpr int64_t MC = 192;  // rows per pass over W: their x (<= 1.5 MB at K = 2048) stays in L2/L3

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

// R rows x 16 columns over all of K. Each accumulator is a chain of dependent FMAs; with few rows,
// U interleaved partial sums over k keep >= 8 chains in flight (2 FMA pipes x 4 cycles of latency):
// at M=1 that alone took the kernel from ~16 to ~19 GB/s.
template <int R, int U, typename W, typename O>
void tile(const float* __restrict x, int64_t x_stride, const W* __restrict panel, int64_t K,
          const float* __restrict bias, O* __restrict out, int64_t out_stride, int cols) {
    vec8 acc[U][R][2] = {};
    // Half panels read by 1-2 rows stream fastest: a prefetch 32 k-steps (1 KB) ahead, one per 64-byte
    // line, gained 5-14% there (M=1-2, bf16 and fp16, alternated in one process); fp32 panels and
    // more rows lost with it.
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
    float b[NR] = {};
    if (bias) std::memcpy(b, bias, cols * sizeof(float));
    for (int r = 0; r < R; ++r) {
        float row[NR];
        for (int u = 1; u < U; ++u) acc[0][r][0] += acc[u][r][0], acc[0][r][1] += acc[u][r][1];
        std::memcpy(row, &acc[0][r][0], sizeof(vec8));
        std::memcpy(row + 8, &acc[0][r][1], sizeof(vec8));
        for (int j = 0; j < cols; ++j) put(out + r * out_stride + j, row[j] + b[j]);
    }
}

template <typename W, typename O>
void panel_rows(const float* x, int64_t x_stride, const W* panel, int64_t K, const float* bias, O* out,
                int64_t out_stride, int64_t M, int cols) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR)
        tile<MR, 1>(x + m * x_stride, x_stride, panel, K, bias, out + m * out_stride, out_stride, cols);
    x += m * x_stride, out += m * out_stride;
    switch (M - m) {
        case 1: tile<1, 4>(x, x_stride, panel, K, bias, out, out_stride, cols); break;
        case 2: tile<2, 2>(x, x_stride, panel, K, bias, out, out_stride, cols); break;
        case 3: tile<3, 2>(x, x_stride, panel, K, bias, out, out_stride, cols); break;
        case 4: tile<4, 1>(x, x_stride, panel, K, bias, out, out_stride, cols); break;
        case 5: tile<5, 1>(x, x_stride, panel, K, bias, out, out_stride, cols); break;
    }
}

// Threads split the panels, so W is read once per MC rows and each thread streams its own range.
template <typename W, typename O>
void linear(const float* x, int64_t x_stride, const W* panels, const float* bias, O* out, int64_t M,
            int64_t N, int64_t K) {
    const int64_t P = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t rows = std::min(MC, M - m0);
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < P; ++p) {
            const int cols = (int)std::min<int64_t>(NR, N - p * NR);
            panel_rows(x + m0 * x_stride, x_stride, panels + p * K * NR, K, bias ? bias + p * NR : nullptr,
                       out + m0 * N + p * NR, N, rows, cols);
        }
    }
}

// Where column j of a panel row is stored (see the layout above).
inline int slot(float*, int j) { return j; }
inline int slot(f16*, int j) { return j; }
inline int slot(uint16_t*, int j) { return (j % 8) * 2 + j / 8; }

template <typename W>
void pack(const W* w, int64_t N, int64_t K, W* panels) {
    const int64_t P = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; ++p)
        for (int64_t k = 0; k < K; ++k)
            for (int j = 0; j < NR; ++j) {
                const int64_t n = p * NR + j;
                panels[(p * K + k) * NR + slot(panels, j)] = n < N ? w[n * K + k] : W{};
            }
}

// Element kinds of x and out, as the Python side passes them.
enum Kind { F32 = 0, BF16 = 1, F16 = 2 };


// x [M, K] (rows x_stride apart) widened to a contiguous float32 copy.
template <typename H>
std::unique_ptr<float[]> widen_rows(const H* x, int64_t x_stride, int64_t M, int64_t K) {
    std::unique_ptr<float[]> out(new float[M * K]);  // not zero-filled: every element is written
    // A decode step's few rows are not worth waking the other threads for.
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) out[m * K + k] = to_float(x[m * x_stride + k]);
    return out;
}

// The out types a W is built for: float32, or W's own half type. (Every combination would more than
// double the build, paid at a cold start; the op converts around the kernel for the rest.)
template <typename W> struct Half { typedef float type; };
template <> struct Half<uint16_t> { typedef uint16_t type; };
template <> struct Half<f16> { typedef f16 type; };

// out [M, N] (contiguous) = x [M, K] (rows x_stride apart) @ W^T + bias (nullable, float32 [N]);
// x is of x_kind, out float32 or (out_kind != F32) W's own half type: the op passes F32 for float
// panels, so a float32 out is never written into a half buffer.
template <typename W>
void run(const void* x, int x_kind, int64_t x_stride, const W* panels, const float* bias, void* out, int out_kind,
         int64_t M, int64_t N, int64_t K) {
    std::unique_ptr<float[]> widened;
    const float* xf = static_cast<const float*>(x);
    if (x_kind == BF16) widened = widen_rows(static_cast<const uint16_t*>(x), x_stride, M, K);
    if (x_kind == F16) widened = widen_rows(static_cast<const f16*>(x), x_stride, M, K);
    if (widened) xf = widened.get(), x_stride = K;
    if (out_kind == F32)
        linear(xf, x_stride, panels, bias, static_cast<float*>(out), M, N, K);
    else
        linear(xf, x_stride, panels, bias, static_cast<typename Half<W>::type*>(out), M, N, K);
}

}  // namespace

extern "C" {

// w [N, K] row-major -> panels [ceil(N / 16), K, 16].
void pack_f32(const float* w, int64_t N, int64_t K, float* panels) { pack(w, N, K, panels); }
void pack_bf16(const uint16_t* w, int64_t N, int64_t K, uint16_t* panels) { pack(w, N, K, panels); }
void pack_f16(const f16* w, int64_t N, int64_t K, f16* panels) { pack(w, N, K, panels); }

void linear_f32(const void* x, int x_kind, int64_t x_stride, const float* panels, const float* bias, void* out,
                int out_kind, int64_t M, int64_t N, int64_t K) {
    run(x, x_kind, x_stride, panels, bias, out, out_kind, M, N, K);
}
void linear_bf16(const void* x, int x_kind, int64_t x_stride, const uint16_t* panels, const float* bias, void* out,
                 int out_kind, int64_t M, int64_t N, int64_t K) {
    run(x, x_kind, x_stride, panels, bias, out, out_kind, M, N, K);
}
void linear_f16(const void* x, int x_kind, int64_t x_stride, const f16* panels, const float* bias, void* out,
                int out_kind, int64_t M, int64_t N, int64_t K) {
    run(x, x_kind, x_stride, panels, bias, out, out_kind, M, N, K);
}
}
