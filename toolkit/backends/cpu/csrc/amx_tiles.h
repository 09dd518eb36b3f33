// What every AMX user here shares (panel_kernel.h's linears, experts.cpp, attention_amx.h's attention):
// the tile configuration's memory layout, the process's permission to use the tile registers, and
// memory for the tiles' operands.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include <sys/syscall.h>
#include <unistd.h>

namespace {

struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Whether this process may use the tile registers: Linux hands them out on request (once per process).
inline bool amx_ready() {
    static const bool ready = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ready;
}

// Memory for the tiles' operands, on a cache line: a tile's rows are 64 bytes, and at malloc's 16-byte
// alignment every one of them lay across two lines.
struct FreeAligned {
    void operator()(void* p) const { std::free(p); }
};
template <typename T>
using TileBuffer = std::unique_ptr<T[], FreeAligned>;

template <typename T>
TileBuffer<T> tile_buffer(size_t n) {
    return TileBuffer<T>(static_cast<T*>(std::aligned_alloc(64, std::max<size_t>(64, (n * sizeof(T) + 63) / 64 * 64))));
}

}  // namespace
