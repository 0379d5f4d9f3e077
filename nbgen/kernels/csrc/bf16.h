/* bf16 <-> fp32 scalar conversions shared by nbgen's CPU kernels (each .c file includes it; static inline,
 * so every translation unit gets its own copy and no symbol is exported). */
#pragma once

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {      /* round to nearest even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u)
                                           : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

