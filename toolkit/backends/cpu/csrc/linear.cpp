// y = x W^T (+ b) for CPU: the torch op toolkit::linear_cpu, which the compiled step calls.
//
// Two implementations behind one op, chosen per call by the row count M (the shape class):
// - M <= small_m (or no oneDNN weight): the panel kernel (panel_kernel.h). A decode step multiplies a
//   few rows by every weight, so it is a stream over W; this is the classic register-blocked
//   micro-kernel (6 rows x 16 columns in 8-wide vectors, 8 rows in 16-wide ones where AVX-512 exists)
//   reading W once per call, half weights widened to float32 in registers (half the bytes, float32
//   FMAs): memory speed with or without bf16 units.
// - M > small_m (or no panels), where a oneDNN weight was packed: oneDNN's linear (torch's mkldnn
//   _linear_pointwise), which uses the CPU's native bf16 units (AVX-512 BF16, AMX) where it has them.
// small_m is measured at engine start on the model's shapes (toolkit/backends/cpu/linear.py).
//
// The panel layout and kernel: panel_kernel.h.
//
// Weight-only int8 (toolkit::linear_int8_cpu, toolkit/quantization.py): int8 panels in the plain order,
// one float32 scale per output column applied to the float32 sums, any x dtype (out in x's): a quarter
// of float32's bytes and half of bf16's for the same stream. Above small_m rows (where oneDNN has native
// units for x's dtype) the weight is widened to x's dtype for oneDNN instead.

#include "panel_kernel.h"

namespace {

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

// Float32 x over half weights with M > small_m: oneDNN's native half units on x rounded to the weights'
// dtype, its output widened; then the entries of each row near its maximum recomputed in float32 from x
// and the panels, so the tokens that compete for the argmax keep float32's values and order at bf16
// matmul speed (every entry in float32 would run at the float32 FMA rate, a quarter of the bf16 units'
// on AVX-512 BF16). "Near" is within BAND_REL of the maximum's magnitude (plus BAND_ABS): eight times
// the spread that rounding the output and x to bf16 can put between two entries. At most EXACT_MAX
// entries per row are recomputed, the largest; the rest keep oneDNN's rounding.
constexpr float BAND_REL = 1.f / 32, BAND_ABS = 0.05f;
constexpr int64_t EXACT_MAX = 16;

// Row m's entries `near` set to their float32 values: each panel holding one of them computed once for
// this row by the panel kernel's float32 path (the values the exact path gives a single row), a
// contiguous read of the panel, instead of each column's K scattered loads.
template <typename W>
void recompute_near(const float* x, const W* panels, const W* bias, int64_t N, int64_t K, std::vector<int64_t>& near,
                    float* row) {
    std::sort(near.begin(), near.end());
    float sums[NR];
    for (size_t i = 0; i < near.size();) {
        const int64_t p = near[i] / NR;
        const int cols = int(std::min<int64_t>(NR, N - p * NR));
        panel_rows(x, K, panels + p * K * NR, K, bias ? bias + p * NR : nullptr, (const float*)nullptr, sums, NR, 1,
                   cols);
        for (; i < near.size() && near[i] / NR == p; ++i) row[near[i]] = sums[near[i] % NR];
    }
}

// out = y (logits from x rounded to the half type; null: out holds them already) widened, with each
// row's entries near its maximum recomputed in float32 from x and the panels. A row is widened while its
// chunks' maxima are taken, and only the chunks that reach the band are searched for its entries (a
// scalar test of every entry was the largest cost beside the matmul).
template <typename W, typename Y>
void refine_near_top(const float* xf, int64_t xs, const W* panels, const W* bias, const Y* y, float* out, int64_t M,
                     int64_t N, int64_t K) {
    constexpr int64_t CHUNK = 64;
    const int64_t chunks = (N + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
        float* __restrict row = out + m * N;
        const Y* __restrict from = y ? y + m * N : nullptr;
        std::vector<float> chunk_top(chunks);
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t n0 = c * CHUNK, n1 = std::min(N, n0 + CHUNK);
            float t = -std::numeric_limits<float>::infinity();
            if (from)
                for (int64_t n = n0; n < n1; ++n) {
                    const float v = to_float(from[n]);
                    row[n] = v, t = std::max(t, v);
                }
            else
                for (int64_t n = n0; n < n1; ++n) t = std::max(t, row[n]);
            chunk_top[c] = t, top = std::max(top, t);
        }
        const float floor = top - (std::fabs(top) * BAND_REL + BAND_ABS);
        std::vector<int64_t> near;
        for (int64_t c = 0; c < chunks; ++c)
            if (chunk_top[c] >= floor)
                for (int64_t n = c * CHUNK; n < std::min(N, (c + 1) * CHUNK); ++n)
                    if (row[n] >= floor) near.push_back(n);
        if (int64_t(near.size()) > EXACT_MAX)  // a flat row: the largest EXACT_MAX
            std::nth_element(near.begin(), near.begin() + EXACT_MAX - 1, near.end(),
                             [row](int64_t a, int64_t c) { return row[a] > row[c]; }),
                near.resize(EXACT_MAX);
        recompute_near(xf + m * xs, panels, bias, N, K, near, row);
    }
}

// Float32 x rounded to the weights' half type, row major, in the first M of `rows` rows (the rest zero:
// oneDNN's padded row count, so onednn_linear need not copy it again).
template <typename W>
Tensor rounded_x(const Tensor& x, const Tensor& panels, int64_t M, int64_t K, int64_t rows) {
    Tensor xh = empty_as(panels, {rows, K});
    W* h = static_cast<W*>(xh.data_ptr());
    const float* xf = static_cast<const float*>(x.data_ptr());
    const int64_t xs = x.stride(0);
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) put(h + m * K + k, xf[m * xs + k]);
    std::memset(h + M * K, 0, (rows - M) * K * sizeof(W));
    return xh;
}

template <typename W>
Tensor float32_io_onednn(const Tensor& x, const Tensor& panels, const Tensor& weight, const std::optional<Tensor>& bias,
                         int64_t M, int64_t N, int64_t K) {
    Tensor yh = onednn_linear(rounded_x<W>(x, panels, M, K, onednn_rows(M)), weight, bias);  // M rows used
    Tensor out = empty_as(x, {M, N});
    const W* y = static_cast<const W*>(yh.data_ptr());
    const W* b = bias ? static_cast<const W*>(bias->data_ptr()) : nullptr;
    refine_near_top(static_cast<const float*>(x.data_ptr()), x.stride(0), static_cast<const W*>(panels.data_ptr()), b,
                    y, static_cast<float*>(out.data_ptr()), M, N, K);
    return out;
}

#if PAIRED_BF16
// Float32 x over paired bf16 panels on the bf16 units: x rounded to bf16, through AMX's tiles or, where
// their tiles are not granted (Zen 4), AVX-512 BF16's dot products (panel_linear), which both write
// float32 sums (no rounding of the output); then the near-top entries recomputed. On AMX one block of
// the tiles' rows (AMX_ROWS) reads each panel once, and above it oneDNN's bf16 matmul is the faster
// (docs/benchmarks.md); the dot products keep up with oneDNN at the row counts a step's logits have.
constexpr int64_t AMX_ROWS = 32;

// Not below AMX_K (the FMA path, as for bf16 x), nor for so few panels (an MoE router's) that the
// near-top entries' panels are all of them: the recomputation would be the FMA path over again.
bool float32_io_on_bf16_units(int64_t M, int64_t N, int64_t K) {
    if (K < AMX_K || N <= EXACT_MAX * NR) return false;
#if AMX_PANELS
    if (amx_ready()) return M <= AMX_ROWS;
#endif
    return true;
}

Tensor float32_io_paired(const Tensor& x, const Tensor& panels, const std::optional<Tensor>& bias, int64_t M,
                         int64_t N, int64_t K) {
    Tensor xh = rounded_x<uint16_t>(x, panels, M, K, M);
    Tensor out = empty_as(x, {M, N});
    float* o = static_cast<float*>(out.data_ptr());
    const uint16_t* pw = static_cast<const uint16_t*>(panels.data_ptr());
    const uint16_t* b = bias ? static_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
    panel_linear<uint16_t>(xh.data_ptr(), K, pw, b, nullptr, o, M, N, K);
    refine_near_top(static_cast<const float*>(x.data_ptr()), x.stride(0), pw, b, (const float*)nullptr, o, M, N, K);
    return out;
}
#endif

Tensor linear_cpu(Tensor x, std::optional<Tensor> panels, std::optional<Tensor> onednn_weight,
                  std::optional<Tensor> bias, int64_t out_features, int64_t small_m) {
    check_cpu(x, "x");
    STD_TORCH_CHECK(panels || onednn_weight, "linear_cpu: give panels, a oneDNN weight, or both");
    STD_TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_cpu: x must be [M, K] with unit stride in K, got ", shape(x));
    const int64_t M = x.size(0), K = x.size(1);
    const ScalarType w_type = (panels ? *panels : *onednn_weight).scalar_type();
    // float32 x with half panels: float32 out, from the panel kernel up to small_m rows, above from the
    // bf16 units (float32_io_paired: AMX's tiles, AVX-512 BF16's dot products) or oneDNN
    // (float32_io_onednn) with each row's entries near its maximum recomputed in float32.
    const bool float32_io = x.scalar_type() == ScalarType::Float && w_type != ScalarType::Float;
    STD_TORCH_CHECK(x.scalar_type() == w_type || (float32_io && panels),
                    "linear_cpu: x must be in the weights' dtype, or float32 with half panels");
    STD_TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                              bias->scalar_type() == w_type),
                    "linear_cpu: bias must be a contiguous [out_features] tensor in the weights' dtype");
    if (onednn_weight && !float32_io && (M > small_m || !panels)) return onednn_linear(x, *onednn_weight, bias);
    const Kind kind = kind_of(*panels, "panels");
    STD_TORCH_CHECK(panels->dim() == 3 && panels->size(1) == K && panels->size(2) == NR && panels->is_contiguous() &&
                        0 < out_features && out_features <= panels->size(0) * NR,
                    "linear_cpu: x ", shape(x), " and out_features ", out_features, " do not fit panels ",
                    shape(*panels), " (contiguous [ceil(N / 16), K, 16])");
#if PAIRED_BF16
    if (float32_io && M > small_m && kind == BF16 && float32_io_on_bf16_units(M, out_features, K))
        return float32_io_paired(x, *panels, bias, M, out_features, K);
#endif
    if (onednn_weight && float32_io && M > small_m) {
        return kind == BF16 ? float32_io_onednn<uint16_t>(x, *panels, *onednn_weight, bias, M, out_features, K)
                            : float32_io_onednn<f16>(x, *panels, *onednn_weight, bias, M, out_features, K);
    }
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
