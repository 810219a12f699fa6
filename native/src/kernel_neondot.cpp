// The integer products with NEON's sdot (ARMv8.2 dot product: four s8 x s8 products summed into each 32-bit
// lane). Compiled with -march=armv8.2-a+dotprod; called only when the CPU has it. Not run on the project's x86-64
// machines.
#include "integer.h"
#include "simd_neon.h"

namespace minimlx_native {

// A step of 32 values: the codes as two vectors of 16 bytes (a 4-bit step's low nibbles, then its high ones), each
// dotted with 16 inputs. sdot multiplies signed bytes, so 8-bit codes enter recentred, q - 128.
struct NeonDot {
  template <int BITS>
  static constexpr int span = 32;
  using Codes = uint8x16x2_t;
  template <int BITS>
  static constexpr int offset = BITS == 8 ? 128 : 0;
  template <int BITS>
  static Codes codes(const uint8_t* p) {
    if constexpr (BITS == 8) return {{vld1q_u8(p), vld1q_u8(p + 16)}};
    const uint8x16_t bytes = vld1q_u8(p);
    return {{vandq_u8(bytes, vdupq_n_u8(0xF)), vshrq_n_u8(bytes, 4)}};
  }
  template <int BITS>
  static float32x4_t dot(const Codes& codes, const int8_t* xq) {
    int32x4_t sums = vdupq_n_s32(0);
    for (int i = 0; i < 2; ++i) {
      const uint8x16_t q = BITS == 8 ? veorq_u8(codes.val[i], vdupq_n_u8(0x80)) : codes.val[i];
      sums = vdotq_s32(sums, vreinterpretq_s8_u8(q), vld1q_s8(xq + 16 * i));
    }
    return vcvtq_f32_s32(sums);
  }
  template <int N, class S>
  static float32x4_t spread(const S* s) {
    return vdupq_n_f32(static_cast<float>(s[0]));
  }
};

void integer_rows_neon(const Problem& p, int row_begin, int row_end) { integer_rows<Neon, NeonDot>(p, row_begin, row_end); }

}  // namespace minimlx_native
