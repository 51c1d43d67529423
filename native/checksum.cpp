// Block checksum: the portable CRC32C, the lane folding shared by both kernels, and run-time dispatch.
#include <cstring>

#include "checksum.h"

namespace zo {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC32C (Castagnoli), reflected

struct Tables {
    uint32_t t[8][256];
    Tables() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
            t[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; ++i)
            for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
};

const Tables& tables() {
    static const Tables tab;  // thread-safe lazy init
    return tab;
}

bool cpu_has_sse42() {
    static const bool has = __builtin_cpu_supports("sse4.2");
    return has;
}

using UpdateFn = uint32_t (*)(uint32_t, const uint8_t*, size_t);
using LanesFn = void (*)(const uint8_t*, size_t, uint32_t*);

// Both kernels share this folding so their values are identical by construction.
uint32_t checksum_with(UpdateFn update, LanesFn lanes, const uint8_t* p, int64_t len) {
    size_t n = len > 0 ? static_cast<size_t>(len) : 0;
    if (n < 3 * static_cast<size_t>(ZO_CHECKSUM_LANE_MIN)) return ~update(0xFFFFFFFFu, p, n);
    size_t lane = (n / 3) & ~static_cast<size_t>(7);
    uint32_t parts[4];
    lanes(p, lane, parts);
    for (int i = 0; i < 3; ++i) parts[i] = ~parts[i];
    parts[3] = ~update(0xFFFFFFFFu, p + 3 * lane, n - 3 * lane);
    return ~update(0xFFFFFFFFu, reinterpret_cast<const uint8_t*>(parts), sizeof(parts));
}

}  // namespace

uint32_t crc32c_update_scalar(uint32_t crc, const uint8_t* p, size_t n) {
    const auto& t = tables().t;
    for (; n >= 8; n -= 8, p += 8) {  // slicing-by-8
        uint32_t lo, hi;
        std::memcpy(&lo, p, 4);
        std::memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
              t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    }
    for (; n > 0; --n, ++p) crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xFF];
    return crc;
}

void crc32c_lanes3_scalar(const uint8_t* p, size_t lane, uint32_t out[3]) {
    for (int i = 0; i < 3; ++i) out[i] = crc32c_update_scalar(0xFFFFFFFFu, p + i * lane, lane);
}

}  // namespace zo

extern "C" uint32_t zo_checksum_scalar(const void* data, int64_t len) {
    return zo::checksum_with(zo::crc32c_update_scalar, zo::crc32c_lanes3_scalar,
                             static_cast<const uint8_t*>(data), len);
}

extern "C" uint32_t zo_checksum(const void* data, int64_t len) {
    if (!zo::cpu_has_sse42()) return zo_checksum_scalar(data, len);
    return zo::checksum_with(zo::crc32c_update_sse42, zo::crc32c_lanes3_sse42,
                             static_cast<const uint8_t*>(data), len);
}

extern "C" const char* zo_checksum_impl(void) { return zo::cpu_has_sse42() ? "sse4.2" : "scalar"; }
