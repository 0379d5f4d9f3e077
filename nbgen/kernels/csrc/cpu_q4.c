/* nbgen CPU kernel for 4-bit weights (built with cpu_ops.c into one library, see nbgen/kernels/cpu_ops.py).
 *
 * A batch-1 decode step of a small GGUF Q4 model is compute-bound in a dequantize-to-float GEMV (widening
 * every nibble to fp32 costs more instructions than reading it). The activations are quantized instead:
 * each group of 32 of a row of x becomes int16 values xq and a scale dx (max|x| / 32767: finer than x's own
 * bf16 rounding, so no precision is lost against the dequantized weight; int8 activations, as llama.cpp's
 * Q4 x Q8, cost greedy agreement with the fp32 model), and the weights' nibbles meet them in integer VNNI
 * instructions (vpdpwssd: 32 s16 x s16 products summed pairwise into 16 int32 lanes). With the weight
 * w = d * q + m per group (q in [0, 15], GGUF Q4_1):
 *
 *   y[t, n] = sum_g  d[n, g] * dx[t, g] * sum_i q[n, g, i] * xq[t, g, i]   +   m[n, g] * sx[t, g]
 *
 * where sx is the group's sum of x (exact, in fp32). Layouts:
 *   qw [N, K / 2] uint8: per group of 32, 16 bytes; byte i holds q[i] in its low nibble and q[i + 16] in its high
 *   d, m [N, K / 32] fp16: each group's scale and minimum.
 * K is a multiple of 64 (groups go in pairs). Without AVX512-VNNI (and BW, VL) the same sums are taken in plain C
 * (same integer products, so the results agree up to the fp32 summation order).
 */
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define Q4_GROUP 32
#define Q4_MAX_ROWS 8

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define Q4_VNNI 1
#endif


static inline float q4_f16_to_f32(uint16_t h) {
#if defined(__F16C__) || defined(__AVX512F__)
    return _cvtsh_ss(h);
#else
    const uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, mant = h & 0x3ff;
    float f;
    if (e == 0) f = ldexpf((float)mant, -24);
    else if (e == 31) f = mant ? NAN : INFINITY;
    else f = ldexpf((float)(mant | 0x400), (int)e - 25);
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u |= s;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* 1 when the vectorised (VNNI) path was compiled in: the Python side prefers torch's int4 kernel otherwise. */
int q4_vnni(void) {
#ifdef Q4_VNNI
    return 1;
#else
    return 0;
#endif
}

/* One row of x [K] (bf16 or fp32) -> xq [K] int16, dx [K/32] and sx [K/32] fp32 (see the header). With VNNI the
 * int16 values of each pair of groups (g, g + 1) are stored in the order the unpacked nibbles come in (low nibbles
 * of g, low of g + 1, high of g, high of g + 1: x[0:16] of g, x[0:16] of g + 1, x[16:32] of g, x[16:32] of g + 1). */
static void quantize_row(const void *x, int is_bf16, int64_t K, int16_t *xq, float *dx, float *sx) {
    for (int64_t g = 0; g < K / Q4_GROUP; g++) {
        float v[Q4_GROUP], amax = 0.f, s = 0.f;
        for (int i = 0; i < Q4_GROUP; i++) {
            const int64_t k = g * Q4_GROUP + i;
            v[i] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
            amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
            s += v[i];
        }
        const float inv = amax > 0 ? 32767.0f / amax : 0.0f;
        for (int i = 0; i < Q4_GROUP; i++) {
#ifdef Q4_VNNI
            const int64_t at = (g / 2) * 64 + (i / 16) * 32 + (g % 2) * 16 + i % 16;
#else
            const int64_t at = g * Q4_GROUP + i;
#endif
            xq[at] = (int16_t)lrintf(v[i] * inv);
        }
        dx[g] = amax / 32767.0f;
        sx[g] = s;
    }
}

/* y[t, n] for rows t < R of one output feature n (R a constant after inlining). */
static inline __attribute__((always_inline)) void q4_dot(const uint8_t *qn, const uint16_t *dn, const uint16_t *mn,
                                                         const int16_t *xq, const float *dx, const float *sx,
                                                         int64_t K, int R, float *res) {
    const int64_t G = K / Q4_GROUP;
#ifdef Q4_VNNI
    /* two groups per step: 32 bytes of nibbles -> low / high halves, each widened to 32 s16; two vpdpwssd give 16
     * int32 lanes (0-7: group g, 8-15: group g + 1), scaled by [d dx of g x 8, d dx of g + 1 x 8] */
    __m512 acc[Q4_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int64_t g = 0; g < G; g += 2) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qn + g * 16));
        const __m512i lo = _mm512_cvtepu8_epi16(_mm256_and_si256(v, low));
        const __m512i hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        int32_t d2;
        memcpy(&d2, dn + g, sizeof d2);
        const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128(d2));                  /* d of g, g + 1 (lanes 0, 1) */
        for (int r = 0; r < R; r++) {
            const int16_t *xg = xq + r * K + g * Q4_GROUP;
            __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)xg));
            s = _mm512_dpwssd_epi32(s, hi, _mm512_loadu_si512((const void *)(xg + 32)));
            const __m128 ds = _mm_mul_ps(dw, _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(dx + r * G + g))));
            const __m512 sc = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(ds));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {                                   /* + sum_g m sx, 16 groups at a time */
        __m512 mt = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; g += 16) {
            const __mmask16 k = G - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - g)) - 1);
            const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mn + g));
            mt = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, sx + r * G + g), mt);
        }
        res[r] = _mm512_reduce_add_ps(acc[r]) + _mm512_reduce_add_ps(mt);
    }
#else
    for (int r = 0; r < R; r++) {
        float s = 0.f;
        for (int64_t g = 0; g < G; g++) {
            int32_t isum = 0;
            for (int i = 0; i < 16; i++) {
                const uint8_t b = qn[g * 16 + i];
                isum += (int32_t)(b & 0x0f) * xq[r * K + g * Q4_GROUP + i]
                      + (int32_t)(b >> 4) * xq[r * K + g * Q4_GROUP + 16 + i];
            }
            s += q4_f16_to_f32(dn[g]) * dx[r * G + g] * (float)isum + q4_f16_to_f32(mn[g]) * sx[r * G + g];
        }
        res[r] = s;
    }
#endif
}

/* y [T, N] (row stride y_stride) = x [T, K] (row stride x_stride) @ W.T for W = d * q + m as in the header;
 * x and y bf16 when is_bf16 else fp32; T <= Q4_MAX_ROWS, K a multiple of 64 and at most 16384 (cpu_q4.MAX_K). */
void q4_gemv(const void *x, int64_t x_stride, const uint8_t *qw, const uint16_t *d, const uint16_t *m, void *y,
             int64_t y_stride, int T, int64_t N, int64_t K, int is_bf16) {
    const int64_t G = K / Q4_GROUP;
    int16_t xq[Q4_MAX_ROWS * K] __attribute__((aligned(64)));
    float dx[Q4_MAX_ROWS * G], sx[Q4_MAX_ROWS * G];
    const size_t esz = is_bf16 ? 2 : 4;
    for (int t = 0; t < T; t++)
        quantize_row((const char *)x + t * x_stride * esz, is_bf16, K, xq + t * K, dx + t * G, sx + t * G);
#pragma omp parallel for schedule(static) if (N * K >= 32768)
    for (int64_t n = 0; n < N; n++) {
        float res[Q4_MAX_ROWS];
        const uint8_t *qn = qw + n * (K / 2);
        switch (T) {                     /* a constant row count per call: the accumulators stay in registers */
            case 1: q4_dot(qn, d + n * G, m + n * G, xq, dx, sx, K, 1, res); break;
            case 2: q4_dot(qn, d + n * G, m + n * G, xq, dx, sx, K, 2, res); break;
            case 3: q4_dot(qn, d + n * G, m + n * G, xq, dx, sx, K, 3, res); break;
            case 4: q4_dot(qn, d + n * G, m + n * G, xq, dx, sx, K, 4, res); break;
            case 5: q4_dot(qn, d + n * G, m + n * G, xq, dx, sx, K, 5, res); break;
            case 6: q4_dot(qn, d + n * G, m + n * G, xq, dx, sx, K, 6, res); break;
            case 7: q4_dot(qn, d + n * G, m + n * G, xq, dx, sx, K, 7, res); break;
            default: q4_dot(qn, d + n * G, m + n * G, xq, dx, sx, K, Q4_MAX_ROWS, res); break;
        }
        for (int t = 0; t < T; t++) {
            if (is_bf16) ((uint16_t *)y)[t * y_stride + n] = f32_to_bf16(res[t]);
            else ((float *)y)[t * y_stride + n] = res[t];
        }
    }
}
