// What every AMX user here shares (panel_kernel.h's linears, attention_amx.h's attention): the tile
// configuration's memory layout and the process's permission to use the tile registers.

#pragma once

#include <cstdint>

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

}  // namespace
