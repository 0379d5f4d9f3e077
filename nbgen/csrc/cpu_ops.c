/* nbgen CPU kernels, built on first use by nbgen/runtime/cpu_ops.py (gcc -O3 -march=native -fopenmp)
 * and called through ctypes with raw tensor pointers. No torch headers: the build takes ~1 s.
 *
 * paged_decode_attention: one query token per sequence against its paged KV cache, read in place.
 * The torch path gathers every sequence's keys and values into a padded buffer per layer and runs
 * matmul-softmax-matmul; on a 2-core CPU that gather streams the KV twice through memory and was
 * the largest cost after the linears. Here each (sequence, kv head) reads its pages once.
 *
 * Layouts (element strides):
 *   q    [B, Hq, D]      row stride q_stride (>= Hq * D), heads and dims contiguous
 *   out  [B, Hq, D]      contiguous
 *   k, v [Hkv, S, D]     head-major cache of one layer, S = num_pages * page_size slots
 *   table [B, max_pages] int64 page ids; lens [B] int64 tokens in cache (incl. the new one)
 * GQA: query head i reads kv head i / G (G = Hq / Hkv), as HF's repeat_kv.
 * Math in fp32 (scores, softmax, weighted sum); bf16 inputs are widened exactly, the output is
 * rounded to nearest even.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* widen n elements (bf16 when is_bf16, else fp32) to fp32 */
static inline void widen(const void *src, int is_bf16, float *dst, int64_t n) {
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src;
        uint32_t *d = (uint32_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;   /* exact */
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

/* fp32 -> storage type (bf16: round to nearest even, NaN kept quiet) */
static inline void narrow(const float *src, int is_bf16, void *dst, int64_t n) {
    if (!is_bf16) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &src[i], sizeof u);
        d[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u)
                                               : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* exp(x) for x <= 0 in a form the compiler vectorises (libm's expf is a scalar call): x = n ln2 + r,
 * e^r by a degree-6 polynomial on |r| <= ln2/2, 2^n through the exponent bits. Relative error ~2e-7. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* round to nearest by the 1.5 * 2^23 trick (vectorises; roundf would stay a scalar call) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* one (sequence, kv head): G query rows qf [G, D] against n cached tokens; acc [G, D] gets the output */
static void attend_one(const float *qf, const char *kh, const char *vh, const int64_t *pages, int64_t n,
                       int G, int D, int P, size_t esize, int is_bf16, float scale,
                       float *s, int64_t s_stride, float *blk, float *acc) {
    for (int64_t t0 = 0; t0 < n; t0 += P) {                  /* scores s[g, t] = scale * q_g . k_t */
        const int64_t m = n - t0 < P ? n - t0 : P;
        widen(kh + (size_t)(pages[t0 / P] * P * D) * esize, is_bf16, blk, m * D);
        for (int g = 0; g < G; g++) {
            const float *qg = qf + g * D;
            float *sg = s + g * s_stride + t0;
            int64_t j = 0;
            for (; j + 4 <= m; j += 4) {   /* four keys at once: independent sums hide the FMA latency */
                const float *k0 = blk + j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
                float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
                for (int d = 0; d < D; d++) {
                    d0 += qg[d] * k0[d];
                    d1 += qg[d] * k1[d];
                    d2 += qg[d] * k2[d];
                    d3 += qg[d] * k3[d];
                }
                sg[j] = d0 * scale, sg[j + 1] = d1 * scale, sg[j + 2] = d2 * scale, sg[j + 3] = d3 * scale;
            }
            for (; j < m; j++) {
                const float *kr = blk + j * D;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) dot += qg[d] * kr[d];
                sg[j] = dot * scale;
            }
        }
    }
    for (int g = 0; g < G; g++) {                              /* softmax, normalised at the end */
        float *sg = s + g * s_stride, mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; t++) {
            sg[t] = exp_neg(sg[t] - mx);
            sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; t++) sg[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int64_t t0 = 0; t0 < n; t0 += P) {                  /* acc[g] = sum_t p[g, t] v_t */
        const int64_t m = n - t0 < P ? n - t0 : P;
        widen(vh + (size_t)(pages[t0 / P] * P * D) * esize, is_bf16, blk, m * D);
        for (int g = 0; g < G; g++) {
            float *ag = acc + g * D;
            const float *sg = s + g * s_stride + t0;
            int64_t j = 0;
            for (; j + 4 <= m; j += 4) {   /* four values per pass over acc: fewer dependent stores */
                const float p0 = sg[j], p1 = sg[j + 1], p2 = sg[j + 2], p3 = sg[j + 3];
                const float *v0 = blk + j * D, *v1 = v0 + D, *v2 = v1 + D, *v3 = v2 + D;
#pragma omp simd
                for (int d = 0; d < D; d++) ag[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
            }
            for (; j < m; j++) {
                const float p = sg[j], *vr = blk + j * D;
#pragma omp simd
                for (int d = 0; d < D; d++) ag[d] += p * vr[d];
            }
        }
    }
}

void paged_decode_attention(const void *q, int64_t q_stride, const void *k, const void *v, void *out,
                   const int64_t *table, const int64_t *lens, int B, int Hq, int Hkv, int D, int P,
                   int64_t max_pages, int64_t S, float scale, int is_bf16) {
    const int G = Hq / Hkv;
    const size_t esize = is_bf16 ? 2 : 4;
    int64_t max_len = 1;
    for (int b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    /* scratch per thread, allocated here (malloc inside the parallel region is slow on worker
     * threads): scores [G, max_len], q and acc [G, D], one page block [P, D], all fp32 */
    const size_t per_thread = (size_t)G * (size_t)max_len + 2 * (size_t)G * D + (size_t)P * D + 16;
    float *scratch = (float *)malloc(sizeof(float) * per_thread * (size_t)omp_get_max_threads());
    if (scratch == NULL) return;
#pragma omp parallel
    {
        float *s = scratch + per_thread * (size_t)omp_get_thread_num();
        float *qf = s + (size_t)G * max_len, *acc = qf + (size_t)G * D, *blk = acc + (size_t)G * D;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)B * Hkv; item++) {
            const int64_t b = item / Hkv, h = item % Hkv;
            widen((const char *)q + (size_t)(b * q_stride + h * G * D) * esize, is_bf16, qf, (int64_t)G * D);
            attend_one(qf, (const char *)k + (size_t)(h * S * D) * esize, (const char *)v + (size_t)(h * S * D) * esize,
                       table + b * max_pages, lens[b], G, D, P, esize, is_bf16, scale, s, max_len, blk, acc);
            narrow(acc, is_bf16, (char *)out + (size_t)((b * Hq + h * G) * D) * esize, (int64_t)G * D);
        }
    }
    free(scratch);
}
