// SSE4.2 CRC32C kernels; compiled with -msse4.2 and only called after a CPU check (checksum.cpp).
#include <nmmintrin.h>

#include <cstring>

#include "checksum.h"

namespace zo {

static inline uint64_t load64(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);  // unaligned-safe; compiles to one mov
    return v;
}

uint32_t crc32c_update_sse42(uint32_t crc, const uint8_t* p, size_t n) {
    uint64_t c = crc;
    for (; n >= 8; n -= 8, p += 8) c = _mm_crc32_u64(c, load64(p));
    uint32_t c32 = static_cast<uint32_t>(c);
    for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
    return c32;
}

void crc32c_lanes3_sse42(const uint8_t* p, size_t lane, uint32_t out[3]) {
    // Three independent dependency chains hide the instruction's 3-cycle latency.
    uint64_t a = 0xFFFFFFFFu, b = 0xFFFFFFFFu, c = 0xFFFFFFFFu;
    const uint8_t* p1 = p + lane;
    const uint8_t* p2 = p + 2 * lane;
    size_t words = lane / 8;
    for (size_t i = 0; i < words; ++i) {
        a = _mm_crc32_u64(a, load64(p + 8 * i));
        b = _mm_crc32_u64(b, load64(p1 + 8 * i));
        c = _mm_crc32_u64(c, load64(p2 + 8 * i));
    }
    size_t done = words * 8;
    out[0] = crc32c_update_sse42(static_cast<uint32_t>(a), p + done, lane - done);
    out[1] = crc32c_update_sse42(static_cast<uint32_t>(b), p1 + done, lane - done);
    out[2] = crc32c_update_sse42(static_cast<uint32_t>(c), p2 + done, lane - done);
}

}  // namespace zo
