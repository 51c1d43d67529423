// Block checksum for the NVMe swap store: CRC32C (Castagnoli) over three interleaved lanes.
//
// Why three lanes: one crc32 instruction stream is latency-bound (~3 cycles per 8 bytes); three
// independent streams keep the unit busy, so checksumming an 8 MiB block costs well under a tenth of
// the time the drive needs for it. The lanes' CRCs are then folded by a CRC of the lane CRCs, so the
// value is not the textbook CRC32C of the whole block for large blocks, but it keeps CRC's
// guarantee that any single-burst error of up to 32 bits is detected. Blocks shorter than
// ZO_CHECKSUM_LANE_MIN * 3 get the plain CRC32C, which makes the standard test vector checkable.
#pragma once
#include <cstddef>
#include <cstdint>

#define ZO_CHECKSUM_LANE_MIN 4096

extern "C" {
// Best implementation for this CPU (SSE4.2 when present, else the table-driven one); identical values.
uint32_t zo_checksum(const void* data, int64_t len);
// Portable table-driven implementation, exported so tests can compare it with the fast one.
uint32_t zo_checksum_scalar(const void* data, int64_t len);
// "sse4.2" or "scalar": which one zo_checksum runs.
const char* zo_checksum_impl(void);
}

namespace zo {
// Raw CRC32C update without pre/post inversion; `crc` is the running register.
uint32_t crc32c_update_scalar(uint32_t crc, const uint8_t* p, size_t n);
uint32_t crc32c_update_sse42(uint32_t crc, const uint8_t* p, size_t n);
// Three equal lanes of `lane` bytes starting at p, p+lane, p+2*lane; results in out[0..2].
void crc32c_lanes3_scalar(const uint8_t* p, size_t lane, uint32_t out[3]);
void crc32c_lanes3_sse42(const uint8_t* p, size_t lane, uint32_t out[3]);
}  // namespace zo
