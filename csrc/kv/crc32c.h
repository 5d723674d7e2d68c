// Copyright keras_rec_emb authors. Apache-2.0.
//
// CRC-32C (Castagnoli), the checksum of the file tier's segment records:
// the SSE4.2 crc32 instruction where the CPU has it (chosen once, at the
// first call), else a table (byte at a time). Crc32c(c, p, n) extends the
// CRC c of some bytes by n more; start from 0.
#ifndef KRE_KV_CRC32C_H_
#define KRE_KV_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace kre {
namespace kv {
namespace crc32c_internal {

inline const uint32_t* Table() {
  static const struct T {
    uint32_t v[256];
    T() {
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
        v[i] = c;
      }
    }
  } table;
  return table.v;
}

inline uint32_t Software(uint32_t c, const uint8_t* p, size_t n) {
  const uint32_t* t = Table();
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline uint32_t Hardware(uint32_t c, const uint8_t* p, size_t n) {
  uint64_t c64 = c;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
  }
  c = static_cast<uint32_t>(c64);
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(c, *p);
  return c;
}

inline bool HasHardware() {
  static const bool has = [] {
    __builtin_cpu_init();  // may run before the constructors that set it up
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return has;
}
#endif

}  // namespace crc32c_internal

inline uint32_t Crc32c(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  if (crc32c_internal::HasHardware()) return ~crc32c_internal::Hardware(c, p, n);
#endif
  return ~crc32c_internal::Software(c, p, n);
}

}  // namespace kv
}  // namespace kre

#endif  // KRE_KV_CRC32C_H_
