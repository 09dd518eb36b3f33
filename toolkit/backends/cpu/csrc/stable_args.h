// What the kernels' torch ops check on their arguments, through torch's stable C ABI
// (torch/csrc/stable): the ops link against no C++ torch API, so they build in seconds.

#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <string>

#include "half_float.h"

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// The element kinds the kernels read and write.
enum Kind { F32 = 0, BF16 = 1, F16 = 2 };

inline Kind kind_of(const Tensor& t, const char* what) {
    switch (t.scalar_type()) {
        case ScalarType::Float: return F32;
        case ScalarType::BFloat16: return BF16;
        case ScalarType::Half: return F16;
        default: STD_TORCH_CHECK(false, what, " must be float32, bfloat16 or float16");
    }
    return F32;
}

inline void check_cpu(const Tensor& t, const char* what) {
    STD_TORCH_CHECK(t.is_cpu(), what, " must be a CPU tensor");
}

inline void check_int32(const Tensor& t, const char* what, int64_t dim) {
    check_cpu(t, what);
    STD_TORCH_CHECK(t.scalar_type() == ScalarType::Int && t.dim() == dim && t.is_contiguous(), what,
                    " must be a contiguous int32 tensor of ", dim, " dimension(s)");
}

inline std::string shape(const Tensor& t) {
    std::string s = "(";
    for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
    return s + ")";
}

}  // namespace

namespace {

// A new contiguous CPU tensor of `like`'s dtype: through the C shim directly, not the dispatcher
// (the ops run dozens of times a step, and every microsecond of a batch-1 step shows).
inline Tensor empty_as(const Tensor& like, std::initializer_list<int64_t> sizes) {
    int64_t size[8], stride[8];
    const int64_t ndim = int64_t(sizes.size());
    int64_t d = 0;
    for (int64_t s : sizes) size[d++] = s;
    int64_t step = 1;
    for (d = ndim - 1; d >= 0; --d) stride[d] = step, step *= size[d];
    int32_t dtype;
    STD_TORCH_CHECK(aoti_torch_get_dtype(like.get(), &dtype) == AOTI_TORCH_SUCCESS, "could not read a dtype");
    AtenTensorHandle handle;
    STD_TORCH_CHECK(aoti_torch_empty_strided(ndim, size, stride, dtype, aoti_torch_device_type_cpu(), 0, &handle) ==
                        AOTI_TORCH_SUCCESS,
                    "could not allocate a tensor");
    return Tensor(handle);
}

}  // namespace
