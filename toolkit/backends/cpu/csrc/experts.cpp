// The routed experts of one MoE layer in one call: the torch op toolkit::experts_cpu, which the CPU
// implementation of toolkit::moe_experts (toolkit/backends/cpu/experts.py) calls.
//
//   out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),   e = topk_ids[t, j]
//
// over the local experts [first_expert, first_expert + E): toolkit/moe/ops.py's contract, with the
// weights in the linear kernel's layouts (stacked panels, and/or one oneDNN weight per expert).
//
// A decode step gives each expert a few rows, so each expert's matmuls are streams over its weights,
// and a call per expert from Python costs more than the stream (a dozen ops per expert and layer).
// Here the grouping, both matmuls, the activation and the weighted sum are one call: the experts with
// at most small_m rows (or all, without oneDNN weights) run the panel kernel together, both threads
// splitting every such expert's panels in one parallel loop per matmul, float32 sums from the gathered
// rows to the weighted sum (the rows and the activation in bf16 where AMX's tiles or AVX-512 BF16's
// dot products take them, float32 otherwise); an expert with more rows (a prefill's) is compute-bound
// and runs oneDNN's native units on its own rows, in x's dtype as its matmuls in the reference.

#include "panel_kernel.h"

namespace {

inline float silu(float gate) { return gate / (1.f + std::exp(-gate)); }

struct Groups {
    std::vector<int64_t> offset;  // [E + 1]: expert e's pairs are pairs[offset[e], offset[e + 1])
    std::vector<int64_t> pairs;   // flat (token, slot) indices, by expert, in index order within one
};

Groups group(const int64_t* ids, int64_t pairs, int64_t first, int64_t E) {
    Groups g;
    g.offset.assign(E + 1, 0);
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t e = ids[p] - first;
        if (0 <= e && e < E) ++g.offset[e + 1];
    }
    for (int64_t e = 0; e < E; ++e) g.offset[e + 1] += g.offset[e];
    g.pairs.resize(g.offset[E]);
    std::vector<int64_t> next(g.offset.begin(), g.offset.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t e = ids[p] - first;
        if (0 <= e && e < E) g.pairs[next[e]++] = p;
    }
    return g;
}

// One matmul of every expert in `experts` over its rows: out rows [row0[i], row0[i] + rows[i]) of
// [*, N] from x rows alike of [*, K], panels of expert e at panels + e * P * K * NR. One parallel loop
// over (expert, panel) splits every expert's weights between the threads; AMX takes four panels a task:
// one block of four where the expert's rows fit one A tile (a decode step's few rows per expert then
// stream four panels at once), else two blocks of two. The tiles are configured again only when the
// row count changes.
template <typename XT, typename W>
void panel_matmuls(const std::vector<int64_t>& experts, const std::vector<int64_t>& row0,
                   const std::vector<int64_t>& rows, const XT* x, const W* panels, float* out, int64_t N,
                   int64_t K) {
    const int64_t P = (N + NR - 1) / NR;
#if AMX_PANELS
    if constexpr (std::is_same<XT, uint16_t>::value) if (amx_ready()) {
        const int64_t quads = (P + 3) / 4, tasks = int64_t(experts.size()) * quads;
#pragma omp parallel
        {
            int configured = -1;
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < tasks; ++t) {
                const int64_t i = t / quads, p = 4 * (t % quads);
                const uint16_t* w = panels + experts[i] * P * K * NR;
                if (rows[i] <= 16) {
                    const int here = int(std::min<int64_t>(AMX_ROW_PANELS, P - p));
                    if (configured != int(rows[i])) configure_row_tiles(int(rows[i])), configured = int(rows[i]);
                    amx_row_block(x + row0[i] * K, K, w + p * K * NR, K, (const float*)nullptr, out + row0[i] * N + p * NR,
                                  N, int(rows[i]), here, int(std::min<int64_t>(NR, N - (p + here - 1) * NR)));
                    continue;
                }
                configured = -1;
                for (int64_t q = p; q < std::min(P, p + 4); q += 2)
                    amx_panels(x + row0[i] * K, K, w, q, int(std::min<int64_t>(2, P - q)), N, K, (const float*)nullptr,
                               (const float*)nullptr, out + row0[i] * N, N, rows[i]);
            }
        }
        return;
    }
#endif
#if PAIRED_BF16
    if constexpr (std::is_same<XT, uint16_t>::value) {  // AVX-512 BF16's dot products, two panels a task
        const int64_t pairs = (P + 1) / 2, tasks = int64_t(experts.size()) * pairs;
#pragma omp parallel for schedule(dynamic, 2)
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t i = t / pairs, p = 2 * (t % pairs);
            const uint16_t* w = panels + (experts[i] * P + p) * K * NR;
            float* o = out + row0[i] * N + p * NR;
            if (p + 2 <= P)
                dp_sweep<2>(x + row0[i] * K, K, w, K, (const float*)nullptr, o, N, rows[i],
                            int(std::min<int64_t>(NR, N - (p + 1) * NR)));
            else
                dp_sweep<1>(x + row0[i] * K, K, w, K, (const float*)nullptr, o, N, rows[i],
                            int(std::min<int64_t>(NR, N - p * NR)));
        }
        return;
    }
#endif
    if constexpr (std::is_same<XT, float>::value) {
        const int64_t tasks = int64_t(experts.size()) * P;
#pragma omp parallel for schedule(dynamic, 4)
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t i = t / P, p = t % P;
            const int cols = (int)std::min<int64_t>(NR, N - p * NR);
            panel_rows(x + row0[i] * K, K, panels + (experts[i] * P + p) * K * NR, K, (const float*)nullptr,
                       (const float*)nullptr, out + row0[i] * N + p * NR, N, rows[i], cols);
        }
    }
}

// out32 [T, H] += weight of each pair * its row of y [pairs, H], pairs listed by `pair` (flat (token,
// slot) indices). Threads split H, so two slots of one token never add to the same entry at once.
template <typename Y>
void weighted_add(float* out32, const Y* y, const int64_t* pair, int64_t n, const float* topk_weights, int64_t k,
                  int64_t H) {
#pragma omp parallel for schedule(static) if (n * H >= (1 << 15))
    for (int64_t h0 = 0; h0 < H; h0 += 64)
        for (int64_t i = 0; i < n; ++i) {
            const float w = topk_weights[pair[i]];
            float* o = out32 + (pair[i] / k) * H;
            for (int64_t h = h0; h < std::min(H, h0 + 64); ++h) o[h] += w * to_float(y[i * H + h]);
        }
}

// The experts listed, through the panels, with their rows of x and the activation held as XT: float32,
// or bf16 where the panels run on AMX or AVX-512 BF16's dot products (which take bf16 rows; the
// activation is rounded to bf16 there, as the reference rounds it).
template <typename XT, typename X>
void panel_experts_as(const X* x, const Groups& g, const std::vector<int64_t>& experts, const X* w13, const X* w2,
                      const float* topk_weights, int64_t k, int64_t H, int64_t I, float* out32) {
    std::vector<int64_t> row0, rows, pair;
    for (int64_t e : experts) {
        row0.push_back(int64_t(pair.size()));
        rows.push_back(g.offset[e + 1] - g.offset[e]);
        pair.insert(pair.end(), g.pairs.begin() + g.offset[e], g.pairs.begin() + g.offset[e + 1]);
    }
    const int64_t n = int64_t(pair.size());
    TileBuffer<XT> xs = tile_buffer<XT>(n * H), act = tile_buffer<XT>(n * I);  // AMX's A tiles where XT is bf16
    std::unique_ptr<float[]> h(new float[n * 2 * I]), y(new float[n * H]);
#pragma omp parallel for schedule(static) if (n * H >= (1 << 15))
    for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < H; ++c) put(&xs[i * H + c], to_float(x[(pair[i] / k) * H + c]));
    panel_matmuls(experts, row0, rows, xs.get(), w13, h.get(), 2 * I, H);
#pragma omp parallel for schedule(static) if (n * I >= (1 << 15))
    for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < I; ++c) put(&act[i * I + c], silu(h[i * 2 * I + c]) * h[i * 2 * I + I + c]);
    panel_matmuls(experts, row0, rows, act.get(), w2, y.get(), H, I);
    weighted_add(out32, y.get(), pair.data(), n, topk_weights, k, H);
}

template <typename X>
void panel_experts(const X* x, const Groups& g, const std::vector<int64_t>& experts, const X* w13, const X* w2,
                   const float* topk_weights, int64_t k, int64_t H, int64_t I, float* out32) {
#if PAIRED_BF16
    // bf16 rows through AMX's tiles where granted, else AVX-512 BF16's dot products, which flush
    // subnormals: below K = 32 the float32 FMAs keep torch's rounding.
    if constexpr (paired<X>())
        if (amx_ready() || (H >= AMX_K && I >= AMX_K))
            return panel_experts_as<uint16_t>(x, g, experts, w13, w2, topk_weights, k, H, I, out32);
#endif
    panel_experts_as<float>(x, g, experts, w13, w2, topk_weights, k, H, I, out32);
}

template <typename X>
void onednn_expert(const Tensor& x, const X* xd, const Groups& g, int64_t e, const Tensor& w13, const Tensor& w2,
                   const float* topk_weights, int64_t k, int64_t H, int64_t I, float* out32) {
    const int64_t* pair = g.pairs.data() + g.offset[e];
    const int64_t n = g.offset[e + 1] - g.offset[e], padded = onednn_rows(n);
    // Gathered straight into oneDNN's padded row count (zero rows past n), so no second copy pads it.
    Tensor rows = empty_as(x, {padded, H});
    X* r = static_cast<X*>(rows.data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(r + i * H, xd + (pair[i] / k) * H, H * sizeof(X));
    std::memset(r + n * H, 0, (padded - n) * H * sizeof(X));
    Tensor h = onednn_linear(rows, w13, std::nullopt);
    Tensor act = empty_as(x, {padded, I});
    const X* hd = static_cast<const X*>(h.data_ptr());
    X* a = static_cast<X*>(act.data_ptr());
    // The reference rounds silu(gate) to x's dtype before the product: so does this. The padding rows'
    // h is zero, so their activation is too.
#pragma omp parallel for schedule(static) if (padded * I >= (1 << 15))
    for (int64_t i = 0; i < padded; ++i)
        for (int64_t c = 0; c < I; ++c) {
            X s;
            put(&s, silu(to_float(hd[i * 2 * I + c])));
            put(a + i * I + c, to_float(s) * to_float(hd[i * 2 * I + I + c]));
        }
    Tensor y = onednn_linear(act, w2, std::nullopt);
    weighted_add(out32, static_cast<const X*>(y.data_ptr()), pair, n, topk_weights, k, H);
}

template <typename X>
Tensor run(const Tensor& x, const Groups& g, const std::optional<Tensor>& w13, const std::optional<Tensor>& w2,
           const std::vector<Tensor>& w13_onednn, const std::vector<Tensor>& w2_onednn, const float* topk_weights,
           int64_t k, int64_t E, int64_t H, int64_t I, int64_t small_m) {
    const int64_t T = x.size(0);
    const X* xd = static_cast<const X*>(x.data_ptr());
    std::vector<float> out32(T * H, 0.f);
    std::vector<int64_t> small;
    for (int64_t e = 0; e < E; ++e) {
        const int64_t n = g.offset[e + 1] - g.offset[e];
        if (n == 0) continue;
        if (w13 && (n <= small_m || w13_onednn.empty()))
            small.push_back(e);
        else
            onednn_expert<X>(x, xd, g, e, w13_onednn[e], w2_onednn[e], topk_weights, k, H, I, out32.data());
    }
    if (!small.empty())
        panel_experts(xd, g, small, static_cast<const X*>(w13->data_ptr()), static_cast<const X*>(w2->data_ptr()),
                      topk_weights, k, H, I, out32.data());
    Tensor out = empty_as(x, {T, H});
    X* o = static_cast<X*>(out.data_ptr());
#pragma omp parallel for schedule(static) if (T * H >= (1 << 16))
    for (int64_t i = 0; i < T * H; ++i) put(o + i, out32[i]);
    return out;
}

// x [T, H]; topk_weights [T, k] float32; topk_ids [T, k] int64 (global ids); w13_panels [E, ceil(2I / 16),
// H, 16] and w2_panels [E, ceil(H / 16), I, 16] in x's dtype, or none (every expert through oneDNN);
// w13_onednn / w2_onednn: E oneDNN weights each, or none (every expert through the panels). An expert with
// at most small_m rows runs the panels where there are some. tokens_per_expert (int64, global E), when
// given, gets each local expert's pair count added (toolkit/moe/ops.py's load statistics).
Tensor experts_cpu(Tensor x, Tensor topk_weights, Tensor topk_ids, int64_t first_expert, std::optional<Tensor> w13_panels,
                   std::optional<Tensor> w2_panels, std::vector<Tensor> w13_onednn, std::vector<Tensor> w2_onednn,
                   int64_t small_m, std::optional<Tensor> tokens_per_expert) {
    check_cpu(x, "x");
    STD_TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "experts_cpu: x must be a contiguous [T, H] tensor, got ", shape(x));
    const int64_t T = x.size(0), H = x.size(1);
    STD_TORCH_CHECK(topk_ids.scalar_type() == ScalarType::Long && topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                        topk_ids.is_contiguous(),
                    "experts_cpu: topk_ids must be a contiguous int64 [T, k] tensor, got ", shape(topk_ids));
    const int64_t k = topk_ids.size(1);
    STD_TORCH_CHECK(topk_weights.scalar_type() == ScalarType::Float && topk_weights.dim() == 2 &&
                        topk_weights.size(0) == T && topk_weights.size(1) == k && topk_weights.is_contiguous(),
                    "experts_cpu: topk_weights must be a contiguous float32 [T, k] tensor like topk_ids");
    STD_TORCH_CHECK(bool(w13_panels) == bool(w2_panels) && w13_onednn.size() == w2_onednn.size() &&
                        (w13_panels || !w13_onednn.empty()),
                    "experts_cpu: give both panels, or both oneDNN lists, or all four");
    int64_t E = int64_t(w13_onednn.size()), I = 0;
    if (w13_panels) {
        const Tensor &a = *w13_panels, &b = *w2_panels;
        STD_TORCH_CHECK(a.dim() == 4 && b.dim() == 4 && a.is_contiguous() && b.is_contiguous() && a.size(2) == H &&
                            a.size(3) == NR && b.size(3) == NR && a.size(0) == b.size(0) &&
                            b.size(1) == (H + NR - 1) / NR && a.scalar_type() == x.scalar_type() &&
                            b.scalar_type() == x.scalar_type() && (E == 0 || E == a.size(0)),
                        "experts_cpu: panels ", shape(a), " and ", shape(b),
                        " must be contiguous [E, ceil(2I / 16), H, 16] and [E, ceil(H / 16), I, 16] in x's dtype, for x ",
                        shape(x));
        E = a.size(0), I = b.size(2);
        STD_TORCH_CHECK(a.size(1) == (2 * I + NR - 1) / NR, "experts_cpu: w13 panels ", shape(a),
                        " do not hold 2I = ", 2 * I, " columns");
    } else {
        I = w2_onednn[0].size(1);
    }
    const Groups g = group(static_cast<const int64_t*>(topk_ids.data_ptr()), T * k, first_expert, E);
    if (tokens_per_expert) {
        const Tensor& c = *tokens_per_expert;
        check_cpu(c, "tokens_per_expert");
        STD_TORCH_CHECK(c.scalar_type() == ScalarType::Long && c.dim() == 1 && c.is_contiguous() &&
                            first_expert >= 0 && first_expert + E <= c.size(0),
                        "experts_cpu: tokens_per_expert must be a contiguous int64 [E] tensor over the global experts, "
                        "holding [first_expert, first_expert + ", E, "), got ", shape(c));
        int64_t* counts = static_cast<int64_t*>(c.data_ptr()) + first_expert;
        for (int64_t e = 0; e < E; ++e) counts[e] += g.offset[e + 1] - g.offset[e];
    }
    const float* w = static_cast<const float*>(topk_weights.data_ptr());
    switch (kind_of(x, "x")) {
        case F32: return run<float>(x, g, w13_panels, w2_panels, w13_onednn, w2_onednn, w, k, E, H, I, small_m);
        case BF16: return run<uint16_t>(x, g, w13_panels, w2_panels, w13_onednn, w2_onednn, w, k, E, H, I, small_m);
        case F16: return run<f16>(x, g, w13_panels, w2_panels, w13_onednn, w2_onednn, w, k, E, H, I, small_m);
    }
    return x;
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(toolkit, m) {
    m.def("experts_cpu(Tensor x, Tensor topk_weights, Tensor topk_ids, int first_expert, Tensor? w13_panels, "
          "Tensor? w2_panels, Tensor[] w13_onednn, Tensor[] w2_onednn, int small_m, Tensor(a!)? tokens_per_expert=None) "
          "-> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(toolkit, CPU, m) { m.impl("experts_cpu", TORCH_BOX(&experts_cpu)); }

// The oneDNN weights are MkldnnCPU tensors, so a call that passes them dispatches on that key.
STABLE_TORCH_LIBRARY_IMPL(toolkit, MkldnnCPU, m) { m.impl("experts_cpu", TORCH_BOX(&experts_cpu)); }
