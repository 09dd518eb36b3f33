// A request's prefill chunk through ATen's CPU flash attention (the kernel torch's
// scaled_dot_product_attention runs on CPU), for toolkit::paged_attention_cpu (attention.cpp).
//
// Why: that kernel computes a block of queries against a block of keys as two GEMMs (oneDNN's, on AMX
// tiles or AVX-512 BF16 where the CPU has them), while attention.cpp's tiles are dot products in
// vector registers. Which is faster depends on the CPU, so the engine measures both at start on the
// model's head shape and passes the chunk length from which this path serves
// (toolkit/backends/cpu/attention_plan.py).
//
// How: the chunk's queries, which are the last n of its len positions, attend to the request's K and V
// rows. The flash kernel's causal mask is aligned top-left (query i sees keys 0..i), so a chunk over a
// cached prefix is two calls: the prefix's P = len - n keys without a mask, and the chunk's own n keys
// with the causal mask; their outputs are merged by the log-sum-exps the kernel returns. A chunk with no
// prefix is one causal call. Each call's rows are read in place where the blocks holding them are
// consecutive in the cache (so a cached prefix is, though the chunk's own blocks came later), else
// gathered into a buffer. attention.cpp's cascade calls the same pieces for requests sharing a prefix.

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

// Rows [from, to) of a cache copied out of its blocks, position p's row to dst + (p - from) * row.
template <typename T>
void gather_rows(const T* cache, const int32_t* table, int64_t from, int64_t to, int64_t block_size, int64_t row,
                 T* dst) {
    for (int64_t p = from; p < to;) {
        const int64_t b = p / block_size, rows = std::min((b + 1) * block_size, to) - p;
        std::memcpy(dst + (p - from) * row, cache + (int64_t(table[b]) * block_size + p % block_size) * row,
                    rows * row * sizeof(T));
        p += rows;
    }
}

// Rows [from, to) of a request's K or V (rows of `row` elements, paged in `cache` [blocks, block_size,
// row]): read in place where the blocks holding them are consecutive in the cache (a prompt's are, when
// they were allocated together; a shared prefix's are, as its first request allocated them), else
// gathered to dst + from * row. Returns the span's first row.
template <typename T>
const T* span_rows(const T* cache, const int32_t* table, int64_t from, int64_t to, int64_t block_size, int64_t row,
                   T* dst) {
    const int64_t first = from / block_size, last = (to - 1) / block_size;
    bool consecutive = true;
    for (int64_t b = first + 1; b <= last && consecutive; ++b) consecutive = table[b] == table[first] + (b - first);
    if (consecutive) return cache + (int64_t(table[first]) * block_size + from % block_size) * row;
    gather_rows(cache, table, from, to, block_size, row, dst + from * row);
    return dst + from * row;
}

// One output row (one token, one head) from two attentions of it over disjoint sets of keys: x over
// keys whose scores' log-sum-exp is lx, y over the others (lse ly). Each is weighted by its share of the
// whole softmax's denominator; returns the whole's log-sum-exp. The one definition of the merge, for the
// flash path's two calls and for the cascade's shared and own parts.
template <typename T, typename X, typename Y>
inline float merge_row(T* out, const X* x, float lx, const Y* y, float ly, int64_t head_dim) {
    const float top = std::max(lx, ly), wx = std::exp(lx - top), wy = std::exp(ly - top), inv = 1.f / (wx + wy);
    for (int64_t d = 0; d < head_dim; ++d) put(out + d, (to_float(x[d]) * wx + to_float(y[d]) * wy) * inv);
    return top + std::log(wx + wy);
}

// n rows of out ([n, heads, head_dim], contiguous; O is q's dtype or float) from one flash result, or
// from two merged by their log-sum-exps (a: the earlier keys, b: the chunk's own); with `lse` ([n,
// heads]), the rows' log-sum-exps too.
template <typename T, typename O>
void write_flash(O* out, float* lse, int64_t n, int64_t heads, int64_t head_dim, const FlashResult& a,
                 const FlashResult* b) {
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
            O* o = out + (t * heads + h) * head_dim;
            const T* x = oa + h * ah + t * at;
            float l = la[h * lah + t * lat];
            if (b)
                l = merge_row(o, x, l, ob + h * bh + t * bt, lb[h * lbh + t * lbt], head_dim);
            else
                for (int64_t d = 0; d < head_dim; ++d) put(o + d, to_float(x[d]));
            if (lse) lse[t * heads + h] = l;
        }
}

// n queries (qv: [1, heads, n, head_dim]), the last n of a request's len positions, over its positions
// [from, len): the chunk's own n keys with the causal mask, and the earlier [from, len - n), if any,
// without one (two calls merged by log-sum-exp). Into out ([n, heads, head_dim]) and, with `lse`, their
// log-sum-exps. k_cache and v_cache are [blocks, block_size, kv_heads, head_dim]; buffer holds 2 x len
// rows (K's first, V's from row len), for the spans whose blocks are not consecutive.
template <typename T, typename O>
void flash_span(const Tensor& qv, ScalarType dtype, const T* k_cache, const T* v_cache, const int32_t* table,
                int64_t from, int64_t n, int64_t len, int64_t heads, int64_t kv_heads, int64_t head_dim,
                int64_t block_size, double scale, T* buffer, O* out, float* lse) {
    const int64_t row = kv_heads * head_dim, prefix = len - n;
    auto kv = [&](const T* cache, T* dst, int64_t a, int64_t b) {  // the flash kernel only reads them
        return heads_view(const_cast<T*>(span_rows(cache, table, a, b, block_size, row, dst)), dtype, kv_heads, b - a,
                          head_dim, row, head_dim);
    };
    const FlashResult own = flash_attention(qv, kv(k_cache, buffer, prefix, len), kv(v_cache, buffer + len * row, prefix, len),
                                            true, scale);
    if (prefix == from) {
        write_flash<T>(out, lse, n, heads, head_dim, own, nullptr);
        return;
    }
    const FlashResult earlier = flash_attention(qv, kv(k_cache, buffer, from, prefix),
                                                kv(v_cache, buffer + len * row, from, prefix), false, scale);
    write_flash<T>(out, lse, n, heads, head_dim, earlier, &own);
}

// One request's n new tokens (q rows from q_row), over all its len positions, into out's rows from q_row.
template <typename T>
void flash_prefill(const T* q, int64_t q_token_stride, int64_t q_head_stride, ScalarType dtype, const T* k_cache,
                   const T* v_cache, const int32_t* table, int64_t q_row, int64_t n, int64_t len, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, int64_t block_size, double scale, T* buffer, T* out) {
    const Tensor qv = heads_view(const_cast<T*>(q + q_row * q_token_stride), dtype, heads, n, head_dim, q_token_stride,
                                 q_head_stride);
    flash_span(qv, dtype, k_cache, v_cache, table, 0, n, len, heads, kv_heads, head_dim, block_size, scale, buffer,
               out + q_row * heads * head_dim, static_cast<float*>(nullptr));
}

}  // namespace
