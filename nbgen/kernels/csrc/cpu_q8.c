/* nbgen CPU kernels for 8-bit weights (built with cpu_ops.c into one library, see nbgen/kernels/cpu_ops.py).
 *
 * A tied LM head is the largest single weight read of a small model's batch-1 decode step (SmolLM2-135M:
 * 49152 x 576). GGUF files store it as Q8_0: groups of 32 along the input, q in [-127, 127] and one scale
 * d = max|w| / 127 per group. Kept as int8 plus an fp32 scale per group it is read at 9 bits a weight
 * instead of bf16's 16.
 *
 *   q8_grid: finds that grid in a bf16 weight (the GGUF loaded dequantized) -> q [N, K] int8, d [N, K/32].
 *   q8_gemv: y [T, N] = x [T, K] @ (q * d).T for a few rows T, fp32 accumulation.
 */
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define GROUP 32


/* Per group of 32 along K of w [N, K] (bf16): d = max|w| / 127, q = round(w / d). Returns 1 when every value
 * is within tol * |w| (+ 2^-12 * max|w|) of q * d: each value on the grid up to its own bf16 rounding, which a
 * weight that was never 8-bit quantized fails at its small values. Else 0 (outputs then unspecified). */
int q8_grid(const uint16_t *w, int64_t N, int64_t K, int8_t *q, float *d, float tol) {
    int ok = 1;
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static) reduction(& : ok) if (N * K > 65536)
    for (int64_t n = 0; n < N; n++) {
        if (!ok) continue;
        for (int64_t g = 0; g < G && ok; g++) {
            float v[GROUP], amax = 0.f;
            for (int i = 0; i < GROUP; i++) {
                v[i] = bf16_to_f32(w[n * K + g * GROUP + i]);
                amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
            }
            const float dg = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
            int8_t *qo = q + n * K + g * GROUP;
            for (int i = 0; i < GROUP; i++) {
                const float r = rintf(v[i] * inv);
                qo[i] = (int8_t)r;
                if (!(fabsf(r * dg - v[i]) <= tol * fabsf(v[i]) + amax * (1.0f / 4096.0f))) ok = 0;
            }
            d[n * G + g] = dg;
        }
    }
    return ok;
}

/* one output feature n for R (a constant after inlining) rows of xf [R, K] fp32: the group scale is folded into
 * the widened weights, each row sums in vector lanes, one horizontal sum per row at the end. Intrinsics where
 * the compiler targets AVX-512 / AVX2 (gcc does not vectorise the int8 -> fp32 widening of this loop nest). */
static inline __attribute__((always_inline)) void q8_dot(const int8_t *qn, const float *dn, const float *xf,
                                                         int64_t K, int R, float *res) {
#if defined(__AVX512F__)
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < K / GROUP; g++) {
        const __m512 dg = _mm512_set1_ps(dn[g]);
        const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128((const __m128i *)(qn + g * GROUP)))), dg);
        const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128((const __m128i *)(qn + g * GROUP + 16)))), dg);
        for (int r = 0; r < R; r++) {
            const float *xg = xf + r * K + g * GROUP;
            acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg), acc[r]);
            acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) res[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < K / GROUP; g++) {
        const __m256 dg = _mm256_set1_ps(dn[g]);
        __m256 w[4];
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                       _mm_loadl_epi64((const __m128i *)(qn + g * GROUP + 8 * j)))), dg);
        for (int r = 0; r < R; r++) {
            const float *xg = xf + r * K + g * GROUP;
            for (int j = 0; j < 4; j++) acc[r] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xg + 8 * j), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float lanes[8], s = 0.f;
        _mm256_storeu_ps(lanes, acc[r]);
        for (int i = 0; i < 8; i++) s += lanes[i];
        res[r] = s;
    }
#else
    for (int r = 0; r < R; r++) {
        float s = 0.f;
        for (int64_t g = 0; g < K / GROUP; g++) {
            float part = 0.f;
            for (int i = 0; i < GROUP; i++) part += (float)qn[g * GROUP + i] * xf[r * K + g * GROUP + i];
            s += part * dn[g];
        }
        res[r] = s;
    }
#endif
}

/* y [T, N] (row stride y_stride) = x [T, K] (row stride x_stride) @ W.T, W = q [N, K] int8 * d [N, K/32];
 * x and y bf16 when is_bf16 else fp32; T <= 4 (callers split larger steps). */
void q8_gemv(const void *x, int64_t x_stride, const int8_t *q, const float *d, void *y, int64_t y_stride,
             int T, int64_t N, int64_t K, int is_bf16) {
    float xf[4 * K];
    for (int t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++)
            xf[t * K + k] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[t * x_stride + k])
                                    : ((const float *)x)[t * x_stride + k];
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float res[4];
        const int8_t *qn = q + n * K;
        const float *dn = d + n * G;
        switch (T) {                     /* a constant row count per call: the lanes stay in registers */
            case 1: q8_dot(qn, dn, xf, K, 1, res); break;
            case 2: q8_dot(qn, dn, xf, K, 2, res); break;
            case 3: q8_dot(qn, dn, xf, K, 3, res); break;
            default: q8_dot(qn, dn, xf, K, 4, res); break;
        }
        for (int t = 0; t < T; t++) {
            if (is_bf16) ((uint16_t *)y)[t * y_stride + n] = f32_to_bf16(res[t]);
            else ((float *)y)[t * y_stride + n] = res[t];
        }
    }
}
