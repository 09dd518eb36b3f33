// A decode-only step on CPU in one call, token ids to logits: the model's Python-free fast path.
//
// Why: at batch 1 a layer's kernels read ~12.6 MB of weights (125M model, bf16) in ~0.55 ms at
// this host's ~23 GB/s, and running them one op at a time from Python (a compiled graph's wrapper,
// four linear ops, the attention op, their checks and allocations) added ~0.4-0.6 ms a layer on
// top: ~40% of a batch-1 step. Here the same kernels run back to back: the panel linear
// (toolkit/linear_cpu.cpp) and decode attention (attention/paged_decode_cpu.cpp), passed in as
// function pointers from their own libraries, and the small steps between them written out.
//
// The math is the dense family's model (toolkit/models/llama.py), which stays the reference:
//   x = embed(ids); per layer:
//     h = rmsnorm(x); q, k, v = split(h Wqkv^T + b); [q, k = rmsnorm per head (Qwen3)]; rope(q, k);
//     write k, v to the paged cache; a = attention(q); x = x + a Wo^T + b;
//     h = rmsnorm(x); g, u = split(h Wgu^T + b); x = x + (silu(g) * u) Wd^T + b;
//   logits = rmsnorm(x) Wlm^T, for the rows that sample.
// Intermediates are float32 rounded to the model's dtype where the reference stores a tensor of
// that dtype (each linear's output, normalized rows, q/k/v, the residual sums); like Inductor's
// fused kernels, a chain of elementwise steps is computed in float32 and rounded once. In float32
// every rounding is the identity.
//
// Rows are one decode token each. Trailing rows with slot -1 are the runner's padding: they are
// not computed (a batch-1 step's linears then read W for one row, not two).
// Built by attention/cpp_build.py with -O3 -march=native -ffast-math -fopenmp.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <omp.h>

#include "half_float.h"  // f16, to_float, put

namespace {

// v as the nearest value of type T holds (what storing it in a T tensor and reading it back gives).
template <typename T>
inline float rounded(float v) {
    T t;
    put(&t, v);
    return to_float(t);
}

// The kernels' C entry points (linear_<dtype> and paged_decode_<dtype>), with the weight and cache
// pointers untyped: the layer passes its own dtype's.
typedef void (*LinearFn)(const void* x, int x_kind, int64_t x_stride, const void* panels, const float* bias,
                         void* out, int out_kind, int64_t M, int64_t N, int64_t K);
typedef int (*AttentionFn)(const float* q, const void* k, const void* v, const int32_t* seq_lens,
                           const int32_t* tables, float* out, int rows, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int table_width, int num_blocks, float scale);
constexpr int F32 = 0;  // linear_cpu.cpp's Kind of float32 x and out

}  // namespace

extern "C" {

// What the Python side (decode_step_cpu.py) fills in once per layer; field order is its
// ctypes.Structure's.
struct Layer {
    const void* input_norm;  // [hidden], model dtype
    const void* post_norm;
    const void* q_norm;  // [head_dim] or null (no q/k norm)
    const void* k_norm;
    const void* qkv;  // panels of the merged q/k/v weight, model dtype
    const float* qkv_bias;  // float32 [(Hq + 2 Hkv) D] or null
    const void* o;
    const float* o_bias;
    const void* gate_up;  // panels of the merged gate/up weight
    const float* gate_up_bias;
    const void* down;
    const float* down_bias;
};

struct Shape {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, num_blocks, num_layers, vocab,
        max_positions;
    float eps, qk_eps, scale;
    void* linear;  // LinearFn for the model dtype
    void* attention;  // AttentionFn for the model dtype
};

struct Model {
    const Layer* layers;  // [num_layers]
    void* const* kv_caches;  // [num_layers] of [2, num_blocks, block_size, Hkv, D], model dtype
    const void* embedding;  // [vocab, hidden], model dtype
    const float* cos;  // rotary tables [max_positions, head_dim], float32
    const float* sin;
    const void* final_norm;  // [hidden]
    const void* lm_head;  // panels of [vocab, hidden]
};

}  // extern "C"

namespace {

// out[r] = rounded(weight * rounded(x[r] / rms(x[r]))) over rows of n: llama.py's RMSNorm.
template <typename T, typename X>
void rmsnorm(const X* x, const T* weight, float eps, float* out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
        const X* xr = x + r * n;
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) sum += to_float(xr[i]) * to_float(xr[i]);
        const float inv = 1.f / std::sqrt(sum / float(n) + eps);
        for (int64_t i = 0; i < n; ++i)
            out[r * n + i] = rounded<T>(to_float(weight[i]) * rounded<T>(to_float(xr[i]) * inv));
    }
}

template <typename T>
void round_all(float* v, int64_t n) {
    if (sizeof(T) == sizeof(float)) return;
    for (int64_t i = 0; i < n; ++i) v[i] = rounded<T>(v[i]);
}

// x [heads, D] rotated in place by one position's cos/sin [D]: x * cos + rotate_half(x) * sin.
template <typename T>
void rope(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; ++h) {
        float* xh = x + h * d;
        for (int64_t i = 0; i < half; ++i) {
            const float a = xh[i], b = xh[i + half];
            xh[i] = rounded<T>(a * cos[i] - b * sin[i]);
            xh[i + half] = rounded<T>(b * cos[i + half] + a * sin[i + half]);
        }
    }
}

// Scratch kept per thread between calls, so steps reuse it instead of allocating.
float* scratch(int64_t floats) {
    thread_local std::vector<float> buffer;
    if ((int64_t)buffer.size() < floats) buffer.resize(floats);
    return buffer.data();
}

// The step's inputs every layer reads.
template <typename T>
struct Step {
    int64_t rows;  // real rows only: the runner's padding is dropped before the layers
    const float* cos;  // [rows, D], rounded to T as the reference's tables
    const float* sin;
    const int64_t* slots;
    const int32_t* seq_lens;
    const int32_t* tables;
    int64_t table_width;
};

// One layer, x [m, H] -> out [m, H] (the model dtype), k/v written into kv_cache at the slots.
template <typename T>
int layer(const Shape& s, const Layer& w, const Step<T>& st, const T* x, T* out, T* kv_cache, float* work) {
    const LinearFn linear = reinterpret_cast<LinearFn>(s.linear);
    const AttentionFn attention = reinterpret_cast<AttentionFn>(s.attention);
    const int64_t m = st.rows, H = s.hidden, D = s.head_dim, Hq = s.num_heads, Hkv = s.num_kv_heads;
    const int64_t I = s.intermediate, q_n = Hq * D, kv_n = Hkv * D, qkv_n = q_n + 2 * kv_n;
    float* h = work;  // normalized rows | q k v | q | attention | gate up
    float* qkv = h + m * H;
    float* q_dense = qkv + m * qkv_n;  // q [m, Hq, D] as the attention kernel reads it
    float* att = q_dense + m * q_n;
    float* gu = att + m * q_n;

    rmsnorm(x, static_cast<const T*>(w.input_norm), s.eps, h, m, H);
    linear(h, F32, H, w.qkv, w.qkv_bias, qkv, F32, m, qkv_n, H);
    round_all<T>(qkv, m * qkv_n);
    T* k_cache = kv_cache;  // [2, num_blocks, block_size, Hkv, D]: keys, then values
    T* v_cache = kv_cache + s.num_blocks * s.block_size * kv_n;
    for (int64_t r = 0; r < m; ++r) {
        float* q = qkv + r * qkv_n;
        float* k = q + q_n;
        const float* v = k + kv_n;
        if (w.q_norm) {
            rmsnorm(q, static_cast<const T*>(w.q_norm), s.qk_eps, q, Hq, D);
            rmsnorm(k, static_cast<const T*>(w.k_norm), s.qk_eps, k, Hkv, D);
        }
        rope<T>(q, Hq, D, st.cos + r * D, st.sin + r * D);
        rope<T>(k, Hkv, D, st.cos + r * D, st.sin + r * D);
        // slot = block * block_size + offset, so the slot's cache row is slot * Hkv * D (checked above).
        T* k_row = k_cache + st.slots[r] * kv_n;
        T* v_row = v_cache + st.slots[r] * kv_n;
        for (int64_t i = 0; i < kv_n; ++i) put(k_row + i, k[i]), put(v_row + i, v[i]);
        std::memcpy(q_dense + r * q_n, q, q_n * sizeof(float));
    }
    const int bad = attention(q_dense, k_cache, v_cache, st.seq_lens, st.tables, att, (int)m, (int)Hq, (int)Hkv,
                              (int)D, (int)s.block_size, (int)st.table_width, (int)s.num_blocks, s.scale);
    if (bad) return bad;
    round_all<T>(att, m * q_n);

    float* o = qkv;  // q/k/v are spent
    linear(att, F32, q_n, w.o, w.o_bias, o, F32, m, H, q_n);
    for (int64_t i = 0; i < m * H; ++i) put(out + i, to_float(x[i]) + rounded<T>(o[i]));

    rmsnorm(out, static_cast<const T*>(w.post_norm), s.eps, h, m, H);
    linear(h, F32, H, w.gate_up, w.gate_up_bias, gu, F32, m, 2 * I, H);
    float* act = gu;  // row r's activation overwrites the front of its own gate half, read first
#pragma omp parallel for schedule(static) if (m * I >= (1 << 15))
    for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < I; ++i) {
            const float g = rounded<T>(gu[r * 2 * I + i]), u = rounded<T>(gu[r * 2 * I + I + i]);
            act[r * 2 * I + i] = rounded<T>(g / (1.f + std::exp(-g)) * u);
        }
    float* d = qkv;
    linear(act, F32, 2 * I, w.down, w.down_bias, d, F32, m, H, I);
    for (int64_t i = 0; i < m * H; ++i) put(out + i, to_float(out[i]) + rounded<T>(d[i]));
    return 0;
}

// The model the runner calls (llama.py's LlamaForCausalLM): embedding, rotary tables, the layers, the
// final norm, then the lm_head over the rows that sample, as float32 logits [num_logits, vocab].
template <typename T>
int64_t step(const Shape& s, const Model& w, const int64_t* input_ids, const int64_t* positions,
             const int64_t* slots, const int32_t* seq_lens, const int32_t* tables, int64_t table_width, int64_t rows,
             const int64_t* logits_indices, int64_t num_logits, float* logits) {
    const int64_t H = s.hidden, D = s.head_dim;
    int64_t m = rows;  // padding rows (slot -1) trail the real ones; they are not computed
    while (m > 0 && slots[m - 1] < 0) --m;
    for (int64_t r = 0; r < m; ++r)
        if (input_ids[r] < 0 || input_ids[r] >= s.vocab || positions[r] < 0 || positions[r] >= s.max_positions ||
            slots[r] < 0 || slots[r] >= s.num_blocks * s.block_size)
            return -1 - r;
    for (int64_t i = 0; i < num_logits; ++i)
        if (logits_indices[i] < 0 || logits_indices[i] >= m) return -1 - rows - i;
    if (m == 0) return 0;
    const int64_t q_n = s.num_heads * D, qkv_n = q_n + 2 * s.num_kv_heads * D;
    const int64_t work_n = m * (H + qkv_n + 2 * q_n + 2 * s.intermediate);
    const int64_t t_n = (m * H * sizeof(T) + sizeof(float) - 1) / sizeof(float);  // one [m, H] T buffer, in floats
    float* cos = scratch(2 * m * D + work_n + 2 * t_n + num_logits * H);
    float* sin = cos + m * D;
    float* work = sin + m * D;
    T* from = reinterpret_cast<T*>(work + work_n);  // a layer reads one [m, H] buffer and writes the other
    T* to = reinterpret_cast<T*>(work + work_n + t_n);
    float* head_in = work + work_n + 2 * t_n;
    const T* embedding = static_cast<const T*>(w.embedding);
    for (int64_t r = 0; r < m; ++r) {
        std::memcpy(from + r * H, embedding + input_ids[r] * H, H * sizeof(T));
        for (int64_t i = 0; i < D; ++i) {
            cos[r * D + i] = rounded<T>(w.cos[positions[r] * D + i]);
            sin[r * D + i] = rounded<T>(w.sin[positions[r] * D + i]);
        }
    }
    const Step<T> st{m, cos, sin, slots, seq_lens, tables, table_width};
    for (int64_t l = 0; l < s.num_layers; ++l) {
        const int bad = layer(s, w.layers[l], st, from, to, static_cast<T*>(w.kv_caches[l]), work);
        if (bad) return bad;
        std::swap(from, to);
    }
    if (num_logits == 0) return 0;
    // The final norm of the sampled rows only: the others' hidden states are never read.
    for (int64_t i = 0; i < num_logits; ++i)
        rmsnorm(from + logits_indices[i] * H, static_cast<const T*>(w.final_norm), s.eps, head_in + i * H, 1, H);
    reinterpret_cast<LinearFn>(s.linear)(head_in, F32, H, w.lm_head, nullptr, logits, F32, num_logits, s.vocab, H);
    round_all<T>(logits, num_logits * s.vocab);  // the reference's logits are the model dtype's, widened
    return 0;
}

}  // namespace

extern "C" {

// Float32 logits [num_logits, vocab] of a decode step, one token per row, k/v of every layer written
// into its KV cache at `slots`. seq_lens and tables (int32, [rows] and [rows, table_width]) are
// AttentionMetadata's; logits_indices picks the rows that sample. Returns 0; or -1 - r where row r has
// a token id, position or slot out of range (a slot of -1 only in trailing padding rows); or -1 - rows - i where logits_indices[i] is not a computed
// row; or the attention kernel's count of rows refused for a bad length or block id. Then logits is
// not complete.
#define STEP(suffix, T)                                                                                       \
    int64_t decode_step_##suffix(const Shape* s, const Model* w, const int64_t* input_ids,                    \
                                 const int64_t* positions, const int64_t* slots, const int32_t* seq_lens,     \
                                 const int32_t* tables, int64_t table_width, int64_t rows,                    \
                                 const int64_t* logits_indices, int64_t num_logits, float* logits) {          \
        return step<T>(*s, *w, input_ids, positions, slots, seq_lens, tables, table_width, rows,              \
                       logits_indices, num_logits, logits);                                                   \
    }
STEP(f32, float)
STEP(bf16, uint16_t)
STEP(f16, f16)
}
