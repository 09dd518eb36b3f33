// A request's prefill chunk through ATen's CPU flash attention (the kernel torch's
// scaled_dot_product_attention runs on CPU), for toolkit::paged_attention_cpu (attention.cpp).
//
// Why: that kernel computes a block of queries against a block of keys as two GEMMs (oneDNN's, on AMX
// tiles or AVX-512 BF16 where the CPU has them), while attention.cpp's tiles are dot products in
// vector registers. Which is faster depends on the CPU, so the engine measures both at start on the
// model's head shape and passes the chunk length from which this path serves
// (toolkit/backends/cpu/attention_plan.py).
//
// How: the request's K and V rows are read in place where its blocks are consecutive in the cache, else
// gathered out of its blocks into two contiguous buffers, and the
// chunk's queries, which are the last n of its len positions, attend to them. The flash kernel's causal
// mask is aligned top-left (query i sees keys 0..i), so a chunk over a cached prefix is two calls: the
// prefix's P = len - n keys without a mask, and the chunk's own n keys with the causal mask; their
// outputs are merged by the log-sum-exps the kernel returns. A chunk with no prefix is one causal call.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>  // aten ops through the C shim

#include "stable_args.h"

namespace {

struct FlashResult {
    Tensor out;  // [1, heads, n, head_dim], q's dtype
    Tensor lse;  // [1, heads, n], float32
};

inline FlashResult flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
    AtenTensorHandle out, lse;
    STD_TORCH_CHECK(aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu(q.get(), k.get(), v.get(), 0.0, causal,
                                                                               nullptr, &scale, &out, &lse) ==
                        AOTI_TORCH_SUCCESS,
                    "paged_attention_cpu: ATen's CPU flash attention failed on q ", shape(q), ", k ", shape(k));
    return {Tensor(out), Tensor(lse)};
}

// A [1, heads, rows, head_dim] view of memory whose rows are `row_stride` elements apart and whose heads
// are `head_stride` apart (no copy; `data` outlives the view's use).
inline Tensor heads_view(void* data, ScalarType dtype, int64_t heads, int64_t rows, int64_t head_dim,
                         int64_t row_stride, int64_t head_stride) {
    const int64_t sizes[4] = {1, heads, rows, head_dim}, strides[4] = {rows * row_stride, head_stride, row_stride, 1};
    return torch::stable::from_blob(data, {sizes, 4}, {strides, 4}, torch::stable::Device(torch::headeronly::DeviceType::CPU),
                                    dtype);
}

// The first len rows of a request's blocks, all kv heads: `cache` ([blocks, block_size, row]) into
// `dst` ([len, row]).
template <typename T>
void gather_rows(const T* cache, const int32_t* table, int64_t len, int64_t block_size, int64_t row, T* dst) {
    for (int64_t b = 0; b * block_size < len; ++b) {
        const int64_t rows = std::min(block_size, len - b * block_size);
        std::memcpy(dst + b * block_size * row, cache + int64_t(table[b]) * block_size * row, rows * row * sizeof(T));
    }
}

// The first len rows of a request's K and V, [len, row] each: in place where its blocks are consecutive
// in the cache (a prompt's blocks are, when they were allocated together), else gathered into `buffer`
// (2 x len x row elements).
template <typename T>
std::pair<const T*, const T*> request_rows(const T* k_cache, const T* v_cache, const int32_t* table, int64_t len,
                                           int64_t block_size, int64_t row, T* buffer) {
    bool consecutive = true;
    for (int64_t b = 1; b * block_size < len && consecutive; ++b) consecutive = table[b] == table[0] + b;
    if (consecutive) {
        const int64_t first = int64_t(table[0]) * block_size * row;
        return {k_cache + first, v_cache + first};
    }
    gather_rows(k_cache, table, len, block_size, row, buffer);
    gather_rows(v_cache, table, len, block_size, row, buffer + len * row);
    return {buffer, buffer + len * row};
}

// One output row (one token, one head) from two attentions of it over disjoint sets of keys: x over
// keys whose scores' log-sum-exp is lx, y over the others (lse ly). Each is weighted by its share of the
// whole softmax's denominator. The one definition of the merge, for the flash path's two calls and for
// the cascade's shared and own parts.
template <typename T, typename X, typename Y>
inline void merge_row(T* out, const X* x, float lx, const Y* y, float ly, int64_t head_dim) {
    const float top = std::max(lx, ly), wx = std::exp(lx - top), wy = std::exp(ly - top), inv = 1.f / (wx + wy);
    for (int64_t d = 0; d < head_dim; ++d) put(out + d, (to_float(x[d]) * wx + to_float(y[d]) * wy) * inv);
}

// out rows [t0, t0 + n) of out ([tokens, heads, head_dim], contiguous) from one flash result, or from
// two merged by their log-sum-exps (a: the prefix's keys, b: the chunk's).
template <typename T>
void write_flash(T* out, int64_t n, int64_t heads, int64_t head_dim, const FlashResult& a, const FlashResult* b) {
    const T* oa = static_cast<const T*>(a.out.data_ptr());
    const T* ob = b ? static_cast<const T*>(b->out.data_ptr()) : nullptr;
    const float* la = static_cast<const float*>(a.lse.data_ptr());
    const float* lb = b ? static_cast<const float*>(b->lse.data_ptr()) : nullptr;
    const int64_t ah = a.out.stride(1), at = a.out.stride(2), lah = a.lse.stride(1), lat = a.lse.stride(2);
    const int64_t bh = b ? b->out.stride(1) : 0, bt = b ? b->out.stride(2) : 0;
    const int64_t lbh = b ? b->lse.stride(1) : 0, lbt = b ? b->lse.stride(2) : 0;
#pragma omp parallel for schedule(static) if (n * heads * head_dim >= (1 << 15))
    for (int64_t t = 0; t < n; ++t)
        for (int64_t h = 0; h < heads; ++h) {
            T* o = out + (t * heads + h) * head_dim;
            const T* x = oa + h * ah + t * at;
            if (!b) {
                std::memcpy(o, x, head_dim * sizeof(T));
                continue;
            }
            merge_row(o, x, la[h * lah + t * lat], ob + h * bh + t * bt, lb[h * lbh + t * lbt], head_dim);
        }
}

// One request's n new tokens (q rows from q_row), over its len positions, into out's rows from q_row.
// k_cache and v_cache are [blocks, block_size, kv_heads, head_dim]; buffer holds 2 x len x row elements.
template <typename T>
void flash_prefill(const T* q, int64_t q_token_stride, int64_t q_head_stride, ScalarType dtype, const T* k_cache,
                   const T* v_cache, const int32_t* table, int64_t q_row, int64_t n, int64_t len, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, int64_t block_size, double scale, T* buffer, T* out) {
    const int64_t row = kv_heads * head_dim, prefix = len - n;
    const auto [keys, values] = request_rows(k_cache, v_cache, table, len, block_size, row, buffer);
    const Tensor qv = heads_view(const_cast<T*>(q + q_row * q_token_stride), dtype, heads, n, head_dim, q_token_stride,
                                 q_head_stride);
    auto kv = [&](const T* base, int64_t first, int64_t rows) {  // the flash kernel only reads them
        return heads_view(const_cast<T*>(base) + first * row, dtype, kv_heads, rows, head_dim, row, head_dim);
    };
    const FlashResult own = flash_attention(qv, kv(keys, prefix, n), kv(values, prefix, n), true, scale);
    T* rows_out = out + q_row * heads * head_dim;
    if (prefix == 0) {
        write_flash(rows_out, n, heads, head_dim, own, nullptr);
        return;
    }
    const FlashResult cached = flash_attention(qv, kv(keys, 0, prefix), kv(values, 0, prefix), false, scale);
    write_flash(rows_out, n, heads, head_dim, cached, &own);
}

}  // namespace
