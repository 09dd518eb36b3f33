// y = x W^T (+ b) for CPU: the torch op toolkit::linear_cpu, which the compiled step calls.
//
// Two implementations behind one op, chosen per call by the row count M (the shape class):
// - M <= small_m (or no oneDNN weight): the panel kernel below. A decode step multiplies a few rows
//   by every weight, so it is a stream over W; this is the classic register-blocked micro-kernel
//   (6 rows x 16 columns, 12 vector accumulators) reading W once per call, half weights widened to
//   float32 in registers (half the bytes, float32 FMAs): memory speed with or without bf16 units.
// - M > small_m (or no panels), where a oneDNN weight was packed: oneDNN's linear (torch's mkldnn
//   _linear_pointwise), which uses the CPU's native bf16 units (AVX-512 BF16, AMX) where it has them.
// small_m is measured at engine start on the model's shapes (toolkit/backends/cpu/linear.py).
//
// Panel layout: W [N, K] becomes panels [ceil(N / 16), K, 16], zero-padded past N, so a panel's 16
// columns for one k are one 64-byte (fp32) or 32-byte (bf16, fp16) run and a panel is read front to
// back. In a bf16 panel, 32-bit lane j holds column j in its low half and column j + 8 in its high
// half, so one load gives both vectors: a shift widens the low halves, a mask the high ones. fp16
// panels keep the plain order: F16C's vcvtph2ps widens 8 halves at once. x and out share W's dtype
// (x is widened once per call, out rounded to nearest even on store), or, with half weights, both are
// float32: the lm_head's float32 logits (toolkit/models/logits.py), computed in float32 by the panel
// kernel, or above small_m by oneDNN with each row's entries near its maximum recomputed in float32.
//
// Weight-only int8 (toolkit::linear_int8_cpu, toolkit/quantization.py): int8 panels in the plain order,
// one float32 scale per output column applied to the float32 sums, any x dtype (out in x's): a quarter
// of float32's bytes and half of bf16's for the same stream. Above small_m rows (where oneDNN has native
// units for x's dtype) the weight is widened to x's dtype for oneDNN instead.

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

#include "stable_args.h"

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

// R rows x 16 columns over all of K. Each accumulator is a chain of dependent FMAs; with few rows,
// U interleaved partial sums over k keep >= 8 chains in flight (2 FMA pipes x 4 cycles of latency).
template <int R, int U, typename W, typename B, typename O>
void tile(const float* __restrict x, int64_t x_stride, const W* __restrict panel, int64_t K,
          const B* __restrict bias, const float* __restrict scale, O* __restrict out, int64_t out_stride, int cols) {
    vec8 acc[U][R][2] = {};
    // On AVX2-only CPUs, half panels read by 1-2 rows stream fastest with a prefetch 32 k-steps (1 KB)
    // ahead, one per 64-byte line (fp32 panels and more rows lost with it); on AVX-512 (Zen 4) the
    // same prefetch made a batch-1 chain of linears slower, so it is left to the hardware there
    // (docs/benchmarks.md).
#ifdef __AVX512F__
    constexpr bool prefetch = false;
#else
    constexpr bool prefetch = R <= 2 && sizeof(W) == 2;
#endif
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

template <typename W, typename B, typename O>
void panel_rows(const float* x, int64_t x_stride, const W* panel, int64_t K, const B* bias, const float* scale,
                O* out, int64_t out_stride, int64_t M, int cols) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR)
        tile<MR, 1>(x + m * x_stride, x_stride, panel, K, bias, scale, out + m * out_stride, out_stride, cols);
    x += m * x_stride, out += m * out_stride;
    switch (M - m) {
        case 1: tile<1, 4>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
        case 2: tile<2, 2>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
        case 3: tile<3, 2>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
        case 4: tile<4, 1>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
        case 5: tile<5, 1>(x, x_stride, panel, K, bias, scale, out, out_stride, cols); break;
    }
}

// Threads split the panels, so W is read once per MC rows and each thread streams its own range.
template <typename W, typename B, typename O>
void linear(const float* x, int64_t x_stride, const W* panels, const B* bias, const float* scale, O* out, int64_t M,
            int64_t N, int64_t K) {
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

// Where column j of a panel row is stored (see the layout above).
inline int slot(float*, int j) { return j; }
inline int slot(f16*, int j) { return j; }
inline int slot(uint16_t*, int j) { return (j % 8) * 2 + j / 8; }
inline int slot(int8_t*, int j) { return j; }

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

// out [M, N] = (x [M, K] (rows x_stride apart, of type X) @ W^T) * scale + bias, out of type O; a half x
// is widened to float32 first.
template <typename X, typename W, typename B, typename O>
void panel_linear(const void* x, int64_t x_stride, const W* panels, const B* bias, const float* scale, O* out,
                  int64_t M, int64_t N, int64_t K) {
    if (std::is_same<X, float>::value) {
        linear(static_cast<const float*>(x), x_stride, panels, bias, scale, out, M, N, K);
        return;
    }
    std::unique_ptr<float[]> wide(new float[M * K]);  // every element is written
    const X* xh = static_cast<const X*>(x);
    // A decode step's few rows are not worth waking the other threads for.
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) wide[m * K + k] = to_float(xh[m * x_stride + k]);
    linear(wide.get(), K, panels, bias, scale, out, M, N, K);
}

template <typename W>
void dispatch(const Tensor& x, const Tensor& panels, const std::optional<Tensor>& bias, Tensor& out, int64_t M,
              int64_t N, int64_t K) {
    const W* b = bias ? static_cast<const W*>(bias->data_ptr()) : nullptr;
    if (x.scalar_type() == ScalarType::Float)
        panel_linear<float>(x.data_ptr(), x.stride(0), static_cast<const W*>(panels.data_ptr()), b, nullptr,
                            static_cast<float*>(out.data_ptr()), M, N, K);
    else
        panel_linear<W>(x.data_ptr(), x.stride(0), static_cast<const W*>(panels.data_ptr()), b, nullptr,
                        static_cast<W*>(out.data_ptr()), M, N, K);
}

Tensor onednn_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
#if !AT_MKLDNN_ENABLED()
    STD_TORCH_CHECK(false, "linear_cpu: this torch has no oneDNN, so no oneDNN weight can be passed");
    return x;
#else
    Tensor xc = x.is_contiguous() ? x : torch::stable::contiguous(x);
    AtenTensorHandle b = bias ? bias->get() : nullptr, ret;
    STD_TORCH_CHECK(aoti_torch_cpu__linear_pointwise(xc.get(), weight.get(), bias ? &b : nullptr, "none", nullptr, 0,
                                                     nullptr, &ret) == AOTI_TORCH_SUCCESS,
                    "linear_cpu: oneDNN's linear failed");
    return Tensor(ret);
#endif
}

// Float32 x over half weights with M > small_m: oneDNN's native half units on x rounded to the weights'
// dtype, its output widened; then the entries of each row near its maximum recomputed in float32 from x
// and the panels, so the tokens that compete for the argmax keep float32's values and order at bf16
// matmul speed (every entry in float32 would run at the float32 FMA rate, a quarter of the bf16 units'
// on AVX-512 BF16). "Near" is within BAND_REL of the maximum's magnitude (plus BAND_ABS): eight times
// the spread that rounding the output and x to bf16 can put between two entries. At most EXACT_MAX
// entries per row are recomputed, the largest; the rest keep oneDNN's rounding.
constexpr float BAND_REL = 1.f / 32, BAND_ABS = 0.05f;
constexpr int64_t EXACT_MAX = 16;

template <typename W>
float column_dot(const float* x, const W* panels, int64_t K, int64_t n, const W* bias) {
    const W* col = panels + (n / NR) * K * NR + slot((W*)nullptr, int(n % NR));
    float acc = bias ? to_float(bias[n]) : 0.f;
    for (int64_t k = 0; k < K; ++k) acc += x[k] * to_float(col[k * NR]);
    return acc;
}

template <typename W>
Tensor float32_io_onednn(const Tensor& x, const Tensor& panels, const Tensor& weight, const std::optional<Tensor>& bias,
                         int64_t M, int64_t N, int64_t K) {
    Tensor xh = empty_as(panels, {M, K});
    W* h = static_cast<W*>(xh.data_ptr());
    const float* xf = static_cast<const float*>(x.data_ptr());
    const int64_t xs = x.stride(0);
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) put(h + m * K + k, xf[m * xs + k]);
    Tensor yh = onednn_linear(xh, weight, bias);
    Tensor out = empty_as(x, {M, N});
    const W* y = static_cast<const W*>(yh.data_ptr());
    float* o = static_cast<float*>(out.data_ptr());
    const W* pw = static_cast<const W*>(panels.data_ptr());
    const W* b = bias ? static_cast<const W*>(bias->data_ptr()) : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
        float* row = o + m * N;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t n = 0; n < N; ++n) row[n] = to_float(y[m * N + n]), top = std::max(top, row[n]);
        const float floor = top - (std::fabs(top) * BAND_REL + BAND_ABS);
        std::vector<int64_t> near;
        for (int64_t n = 0; n < N; ++n)
            if (row[n] >= floor) near.push_back(n);
        if (int64_t(near.size()) > EXACT_MAX)  // a flat row: the largest EXACT_MAX
            std::nth_element(near.begin(), near.begin() + EXACT_MAX - 1, near.end(),
                             [row](int64_t a, int64_t c) { return row[a] > row[c]; }),
                near.resize(EXACT_MAX);
        for (int64_t n : near) row[n] = column_dot(xf + m * xs, pw, K, n, b);
    }
    return out;
}

Tensor linear_cpu(Tensor x, std::optional<Tensor> panels, std::optional<Tensor> onednn_weight,
                  std::optional<Tensor> bias, int64_t out_features, int64_t small_m) {
    check_cpu(x, "x");
    STD_TORCH_CHECK(panels || onednn_weight, "linear_cpu: give panels, a oneDNN weight, or both");
    STD_TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_cpu: x must be [M, K] with unit stride in K, got ", shape(x));
    const int64_t M = x.size(0), K = x.size(1);
    const ScalarType w_type = (panels ? *panels : *onednn_weight).scalar_type();
    // float32 x with half panels: float32 out, from the panel kernel up to small_m rows, above from oneDNN
    // with each row's entries near its maximum recomputed in float32 (float32_io_onednn).
    const bool float32_io = x.scalar_type() == ScalarType::Float && w_type != ScalarType::Float;
    STD_TORCH_CHECK(x.scalar_type() == w_type || (float32_io && panels),
                    "linear_cpu: x must be in the weights' dtype, or float32 with half panels");
    STD_TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                              bias->scalar_type() == w_type),
                    "linear_cpu: bias must be a contiguous [out_features] tensor in the weights' dtype");
    if (onednn_weight && !float32_io && (M > small_m || !panels)) return onednn_linear(x, *onednn_weight, bias);
    const Kind kind = kind_of(*panels, "panels");
    if (onednn_weight && float32_io && M > small_m) {
        STD_TORCH_CHECK(panels->size(0) * NR >= out_features && panels->size(1) == K, "linear_cpu: panels ",
                        shape(*panels), " do not fit x ", shape(x));
        return kind == BF16 ? float32_io_onednn<uint16_t>(x, *panels, *onednn_weight, bias, M, out_features, K)
                            : float32_io_onednn<f16>(x, *panels, *onednn_weight, bias, M, out_features, K);
    }
    STD_TORCH_CHECK(panels->dim() == 3 && panels->size(1) == K && panels->size(2) == NR && panels->is_contiguous() &&
                        0 < out_features && out_features <= panels->size(0) * NR,
                    "linear_cpu: x ", shape(x), " and out_features ", out_features, " do not fit panels ",
                    shape(*panels), " (contiguous [ceil(N / 16), K, 16])");
    Tensor out = empty_as(x, {M, out_features});
    switch (kind) {
        case F32: dispatch<float>(x, *panels, bias, out, M, out_features, K); break;
        case BF16: dispatch<uint16_t>(x, *panels, bias, out, M, out_features, K); break;
        case F16: dispatch<f16>(x, *panels, bias, out, M, out_features, K); break;
    }
    return out;
}

// Above small_m rows a matmul is compute-bound: the int8 weight is widened to x's dtype, row major, for
// oneDNN's native units, and the bias added after.
template <typename X>
Tensor int8_onednn(const Tensor& x, const Tensor& panels, const float* s, const float* b, int64_t M, int64_t N,
                   int64_t K) {
    Tensor w = empty_as(x, {N, K});
    X* wd = static_cast<X*>(w.data_ptr());
    const int8_t* q = static_cast<const int8_t*>(panels.data_ptr());
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const int8_t* col = q + (n / NR) * K * NR + n % NR;
        for (int64_t k = 0; k < K; ++k) put(wd + n * K + k, float(col[k * NR]) * s[n]);
    }
    Tensor out = onednn_linear(x, w, std::nullopt);
    if (b) {
        X* o = static_cast<X*>(out.data_ptr());
#pragma omp parallel for schedule(static) if (M * N >= (1 << 16))
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) put(o + m * N + n, to_float(o[m * N + n]) + b[n]);
    }
    return out;
}

// out [M, N] (x's dtype) = (x @ Q^T) * scales + bias over int8 panels Q; scales and bias float32 [N]. Up
// to small_m rows the panel kernel streams Q; above, oneDNN computes with Q widened (int8_onednn).
Tensor linear_int8_cpu(Tensor x, Tensor panels, Tensor scales, std::optional<Tensor> bias, int64_t out_features,
                       int64_t small_m) {
    check_cpu(x, "x");
    STD_TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_int8_cpu: x must be [M, K] with unit stride in K, got ",
                    shape(x));
    const int64_t M = x.size(0), K = x.size(1), N = out_features;
    STD_TORCH_CHECK(panels.scalar_type() == ScalarType::Char && panels.dim() == 3 && panels.size(1) == K &&
                        panels.size(2) == NR && panels.is_contiguous() && 0 < N && N <= panels.size(0) * NR,
                    "linear_int8_cpu: x ", shape(x), " and out_features ", N, " do not fit int8 panels ",
                    shape(panels), " (contiguous [ceil(N / 16), K, 16])");
    auto per_column = [N](const Tensor& t) {
        return t.scalar_type() == ScalarType::Float && t.dim() == 1 && t.size(0) == N && t.is_contiguous();
    };
    STD_TORCH_CHECK(per_column(scales) && (!bias || per_column(*bias)),
                    "linear_int8_cpu: scales and bias must be contiguous float32 [out_features] tensors");
    const int8_t* q = static_cast<const int8_t*>(panels.data_ptr());
    const float* s = static_cast<const float*>(scales.data_ptr());
    const float* b = bias ? static_cast<const float*>(bias->data_ptr()) : nullptr;
    const Kind kind = kind_of(x, "x");
    if (M > small_m) {
        Tensor xc = x.is_contiguous() ? x : torch::stable::contiguous(x);
        switch (kind) {
            case F32: return int8_onednn<float>(xc, panels, s, b, M, N, K);
            case BF16: return int8_onednn<uint16_t>(xc, panels, s, b, M, N, K);
            case F16: return int8_onednn<f16>(xc, panels, s, b, M, N, K);
        }
    }
    Tensor out = empty_as(x, {M, N});
    switch (kind) {
        case F32: panel_linear<float>(x.data_ptr(), x.stride(0), q, b, s, static_cast<float*>(out.data_ptr()), M, N, K); break;
        case BF16:
            panel_linear<uint16_t>(x.data_ptr(), x.stride(0), q, b, s, static_cast<uint16_t*>(out.data_ptr()), M, N, K);
            break;
        case F16: panel_linear<f16>(x.data_ptr(), x.stride(0), q, b, s, static_cast<f16*>(out.data_ptr()), M, N, K); break;
    }
    return out;
}

void pack_panels(Tensor weight, Tensor panels) {
    check_cpu(weight, "weight");
    STD_TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "pack_panels: weight must be a contiguous [N, K] tensor");
    const int64_t N = weight.size(0), K = weight.size(1);
    STD_TORCH_CHECK(panels.dim() == 3 && panels.size(0) == (N + NR - 1) / NR && panels.size(1) == K &&
                        panels.size(2) == NR && panels.is_contiguous() && panels.scalar_type() == weight.scalar_type(),
                    "pack_panels: panels must be a contiguous [ceil(N / 16), K, 16] tensor in the weight's dtype");
    if (weight.scalar_type() == ScalarType::Char) {
        pack(static_cast<const int8_t*>(weight.data_ptr()), N, K, static_cast<int8_t*>(panels.data_ptr()));
        return;
    }
    switch (kind_of(weight, "weight")) {
        case F32: pack(static_cast<const float*>(weight.data_ptr()), N, K, static_cast<float*>(panels.data_ptr())); break;
        case BF16:
            pack(static_cast<const uint16_t*>(weight.data_ptr()), N, K, static_cast<uint16_t*>(panels.data_ptr()));
            break;
        case F16: pack(static_cast<const f16*>(weight.data_ptr()), N, K, static_cast<f16*>(panels.data_ptr())); break;
    }
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(toolkit, m) {
    m.def("linear_cpu(Tensor x, Tensor? panels, Tensor? onednn_weight, Tensor? bias, int out_features, int small_m) "
          "-> Tensor");
    m.def("linear_int8_cpu(Tensor x, Tensor panels, Tensor scales, Tensor? bias, int out_features, int small_m) "
          "-> Tensor");
    m.def("pack_panels(Tensor weight, Tensor(a!) panels) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(toolkit, CPU, m) {
    m.impl("linear_cpu", TORCH_BOX(&linear_cpu));
    m.impl("linear_int8_cpu", TORCH_BOX(&linear_int8_cpu));
    m.impl("pack_panels", TORCH_BOX(&pack_panels));
}

// The oneDNN weight is an MkldnnCPU tensor, so a call that passes one dispatches on that key.
STABLE_TORCH_LIBRARY_IMPL(toolkit, MkldnnCPU, m) { m.impl("linear_cpu", TORCH_BOX(&linear_cpu)); }
