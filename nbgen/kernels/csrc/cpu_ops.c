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
 *
 * rmsnorm / rope / silu_and_mul: the per-layer elementwise ops, one pass each instead of 4-8 torch
 * ops. They reproduce HF's rounding steps in bf16 (each op HF runs in the model dtype is rounded
 * where HF rounds it), so they give the torch path's numbers up to fp32 summation order.
 */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* widen n elements (bf16 when is_bf16, else fp32) to fp32 */
static inline void widen(const void *src, int is_bf16, float *dst, int64_t n) {
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) {           /* exact; memcpy: no float / uint32 aliasing */
            const uint32_t b = (uint32_t)s[i] << 16;
            memcpy(dst + i, &b, sizeof b);
        }
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

/* Elementwise ops (rmsnorm, rope, silu_and_mul) split their rows over threads above this many elements: a
 * batch-32 decode step of a small model (32 x 576 norm rows, 32 x 1536 SiLU) is worth both cores, while the
 * rows of a step of a few rows (batch 1: 576 / 1536 elements) cost less than waking the other thread. Rows
 * are independent, so the split does not change any result. */
#define PAR_MIN_ELEMS 8192

/* round an fp32 value to the nearest bf16 and back (HF's intermediate roundings in bf16) */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f;
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* exp(x) for x in [-87, 88] (clamped outside) in a form the compiler vectorises (libm's expf is a scalar call): x = n ln2 + r,
 * e^r by a degree-6 polynomial on |r| <= ln2/2, 2^n through the exponent bits. Relative error ~2e-7. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
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

#include "sum16.h"

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
#if defined(__AVX512F__)
            if (D % 16 == 0)
                for (; j + 16 <= m; j += 16) {   /* sixteen keys: one accumulator each, one add tree for all */
                    __m512 a[16];
                    for (int kk = 0; kk < 16; kk++) a[kk] = _mm512_setzero_ps();
                    for (int d = 0; d < D; d += 16) {
                        const __m512 qv = _mm512_loadu_ps(qg + d);
                        for (int kk = 0; kk < 16; kk++)
                            a[kk] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(blk + (j + kk) * D + d), a[kk]);
                    }
                    _mm512_storeu_ps(sg + j, _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale)));
                }
#endif
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
            sg[t] = exp_clamped(sg[t] - mx);
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

int attn_bf16_fits(int G, int D);
void attend_bf16(const uint16_t *q, const uint16_t *kh, const uint16_t *vh, const int64_t *pages, int64_t n, int G,
                 int D, int P, float scale, uint16_t *out);

/* k_new / v_new (NULL: already in the cache): the step's new K / V rows [B, Hkv, D] (row strides k_stride / v_stride, in
 * the cache's dtype), written at slots[b] of their head before that (sequence, kv head) attends: the KV
 * write of a decode-only step in the same call (each item writes only its own rows). */
void paged_decode_attention(const void *q, int64_t q_stride, void *k, void *v, void *out,
                   const int64_t *table, const int64_t *lens, int B, int Hq, int Hkv, int D, int P,
                   int64_t max_pages, int64_t S, float scale, int is_bf16,
                   const void *k_new, const void *v_new, int64_t k_stride, int64_t v_stride, const int64_t *slots) {
    const int G = Hq / Hkv;
    const size_t esize = is_bf16 ? 2 : 4;
    const int fast = is_bf16 && attn_bf16_fits(G, D);      /* cpu_attn_bf16.c: one pass, bf16 dot products */
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
        /* every new row's K / V lands before any row attends: rows of one sequence in one step (a jump's
         * forced tokens) read each other's (the loop's implicit barrier) */
        if (k_new != NULL) {
#pragma omp for schedule(static)
            for (int64_t item = 0; item < (int64_t)B * Hkv; item++) {
                const int64_t b = item / Hkv, h = item % Hkv;
                const size_t dst = (size_t)((h * S + slots[b]) * D) * esize;
                memcpy((char *)k + dst, (const char *)k_new + (size_t)(b * k_stride + h * D) * esize, (size_t)D * esize);
                memcpy((char *)v + dst, (const char *)v_new + (size_t)(b * v_stride + h * D) * esize, (size_t)D * esize);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)B * Hkv; item++) {
            const int64_t b = item / Hkv, h = item % Hkv;
            if (fast) {
                attend_bf16((const uint16_t *)q + b * q_stride + h * G * D, (const uint16_t *)k + h * S * D,
                            (const uint16_t *)v + h * S * D, table + b * max_pages, lens[b], G, D, P, scale,
                            (uint16_t *)out + (b * Hq + h * G) * D);
                continue;
            }
            widen((const char *)q + (size_t)(b * q_stride + h * G * D) * esize, is_bf16, qf, (int64_t)G * D);
            attend_one(qf, (const char *)k + (size_t)(h * S * D) * esize, (const char *)v + (size_t)(h * S * D) * esize,
                       table + b * max_pages, lens[b], G, D, P, esize, is_bf16, scale, s, max_len, blk, acc);
            narrow(acc, is_bf16, (char *)out + (size_t)((b * Hq + h * G) * D) * esize, (int64_t)G * D);
        }
    }
    free(scratch);
}

/* Rows (t, h) of width D at base + t * stride + h * D, for t < T, h < H (H = 1 for a plain [T, D]).
 * With r: r <- x + r (rounded to the storage type, as HF adds residuals), then y = norm(r) * w;
 * without: y = norm(x) * w. norm in fp32: h = v / sqrt(mean(v^2) + eps); bf16 rounds h before
 * the weight multiply, as HF's `weight * hidden.to(dtype)`. */
void rmsnorm(const void *x, int64_t x_stride, void *r, int64_t r_stride, const void *w, void *y,
             int64_t y_stride, int64_t T, int H, int D, float eps, int is_bf16) {
    const size_t es = is_bf16 ? 2 : 4;
    float wf[D];                                           /* the weight, widened once for all rows */
    widen(w, is_bf16, wf, D);
#pragma omp parallel for schedule(static) if (T * H * D > PAR_MIN_ELEMS)
    for (int64_t row = 0; row < T * H; row++) {
        const int64_t t = row / H, h = row % H;
        float v[D], rv[D];
        widen((const char *)x + (size_t)(t * x_stride + h * D) * es, is_bf16, v, D);
        if (r != NULL) {
            char *rp = (char *)r + (size_t)(t * r_stride + h * D) * es;
            widen(rp, is_bf16, rv, D);
            for (int d = 0; d < D; d++) v[d] = is_bf16 ? round_bf16(v[d] + rv[d]) : v[d] + rv[d];
            narrow(v, is_bf16, rp, D);
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int d = 0; d < D; d++) ss += v[d] * v[d];
        const float inv = 1.f / sqrtf(ss / (float)D + eps);
        if (is_bf16)
            for (int d = 0; d < D; d++) v[d] = wf[d] * round_bf16(v[d] * inv);
        else
            for (int d = 0; d < D; d++) v[d] = wf[d] * (v[d] * inv);
        narrow(v, is_bf16, (char *)y + (size_t)(t * y_stride + h * D) * es, D);
    }
}

/* In-place rotate-half RoPE on q [T, Hq, D] and k [T, Hk, D] (row strides q_stride / k_stride) at
 * positions pos [T]; cos_sin [max_pos, D] fp32 = cos of the D/2 frequencies | their sin. bf16 as
 * HF: cos/sin cast to bf16, x*cos and rotate_half(x)*sin rounded, then their sum rounded. */
void rope(void *q, int64_t q_stride, int Hq, void *k, int64_t k_stride, int Hk, const int64_t *pos,
          const float *cos_sin, int D, int64_t T, int is_bf16) {
    const size_t es = is_bf16 ? 2 : 4;
    const int half = D / 2;
#pragma omp parallel for schedule(static) if (T * (Hq + Hk) * D > PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        float c[half], sn[half], x[D];
        const float *cs = cos_sin + pos[t] * D;
        for (int i = 0; i < half; i++) {
            c[i] = is_bf16 ? round_bf16(cs[i]) : cs[i];
            sn[i] = is_bf16 ? round_bf16(cs[half + i]) : cs[half + i];
        }
        for (int h = 0; h < Hq + Hk; h++) {
            char *p = h < Hq ? (char *)q + (size_t)(t * q_stride + h * D) * es
                             : (char *)k + (size_t)(t * k_stride + (h - Hq) * D) * es;
            widen(p, is_bf16, x, D);
            float o[D];
            if (is_bf16) {
                for (int i = 0; i < half; i++) {
                    o[i] = round_bf16(round_bf16(x[i] * c[i]) - round_bf16(x[half + i] * sn[i]));
                    o[half + i] = round_bf16(round_bf16(x[half + i] * c[i]) + round_bf16(x[i] * sn[i]));
                }
            } else {
                for (int i = 0; i < half; i++) {
                    o[i] = x[i] * c[i] - x[half + i] * sn[i];
                    o[half + i] = x[half + i] * c[i] + x[i] * sn[i];
                }
            }
            narrow(o, is_bf16, p, D);
        }
    }
}

/* out [T, I] = silu(gate) * up for x [T, 2I] = gate | up (row stride x_stride); bf16 rounds silu's
 * result before the multiply, as HF's act_fn(gate) * up. */
void silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t T, int I, int is_bf16) {
    const size_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (T * I > PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        float g[I], u[I];
        widen((const char *)x + (size_t)(t * x_stride) * es, is_bf16, g, I);
        widen((const char *)x + (size_t)(t * x_stride + I) * es, is_bf16, u, I);
#pragma omp simd
        for (int i = 0; i < I; i++) {
            float sv = g[i] / (1.f + exp_clamped(-g[i]));
            g[i] = (is_bf16 ? round_bf16(sv) : sv) * u[i];
        }
        narrow(g, is_bf16, (char *)out + (size_t)(t * I) * es, I);
    }
}

/* out[t] = the first index of the largest value in row t of x [T, V] (row stride x_stride), as
 * torch.argmax (a NaN counts as largest). Vectorised per 1024-column chunk: the chunk max (and whether
 * it holds a NaN); then the first index of the row max inside the first chunk that holds it. */
void argmax_rows(const void *x, int64_t x_stride, int64_t T, int64_t V, int64_t *out, int is_bf16) {
    const size_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (T * V > 65536)
    for (int64_t t = 0; t < T; t++) {
        const char *row = (const char *)x + (size_t)(t * x_stride) * es;
        float buf[1024], mx = -INFINITY;
        int64_t best = 0, found = -1;
        for (int64_t c0 = 0; c0 < V && found < 0; c0 += 1024) {
            const int64_t m = V - c0 < 1024 ? V - c0 : 1024;
            widen(row + (size_t)c0 * es, is_bf16, buf, m);
            float cm = -INFINITY;
            int nan = 0;
#pragma omp simd reduction(max : cm) reduction(| : nan)
            for (int64_t i = 0; i < m; i++) {
                cm = buf[i] > cm ? buf[i] : cm;
                nan |= buf[i] != buf[i];
            }
            if (nan) {                                     /* the first NaN wins, as in torch */
                for (int64_t i = 0; i < m && found < 0; i++)
                    if (buf[i] != buf[i]) found = c0 + i;
            } else if (cm > mx) {
                mx = cm;
                best = c0;
            }
        }
        if (found < 0) {
            const int64_t m = V - best < 1024 ? V - best : 1024;
            widen(row + (size_t)best * es, is_bf16, buf, m);
            found = best;
            for (int64_t i = 0; i < m; i++)
                if (buf[i] == mx) { found = best + i; break; }
        }
        out[t] = found;
    }
}

/* 4-bit grid of a bf16 weight [N, K] (K a multiple of 32): per group of 32 along K, lo = min,
 * d = (max - lo) / 15, q = round((w - lo) / d) in [0, 15]. Returns 1 and fills q [N, K] (int32) and
 * sz [K/32, N, 2] = (d, lo + 8 d) (torch's int4 layout) when every value is within tol * (|max| + |lo|) of lo + q d
 * (a GGUF Q4 weight read back through bf16), else 0 (the outputs are then unspecified). */
int q4_grid(const uint16_t *w, int64_t N, int64_t K, int32_t *q, float *sz, float tol) {
    int ok = 1;
#pragma omp parallel for schedule(static) reduction(& : ok) if (N * K > 65536)
    for (int64_t n = 0; n < N; n++) {
        if (!ok) continue;
        for (int64_t g = 0; g < K / 32 && ok; g++) {
            float v[32], lo = INFINITY, hi = -INFINITY;
            widen(w + n * K + g * 32, 1, v, 32);
            for (int i = 0; i < 32; i++) { lo = v[i] < lo ? v[i] : lo; hi = v[i] > hi ? v[i] : hi; }
            const float d = (hi - lo) / 15.0f, inv = d > 0 ? 1.0f / d : 0.0f;
            const float lim = tol * (fabsf(hi) + fabsf(lo));
            int32_t *qo = q + n * K + g * 32;
            for (int i = 0; i < 32; i++) {
                const float r = rintf((v[i] - lo) * inv);
                qo[i] = (int32_t)r;
                if (fabsf(r * d + lo - v[i]) > lim) ok = 0;
            }
            sz[(g * N + n) * 2] = d;
            sz[(g * N + n) * 2 + 1] = lo + 8.0f * d;
        }
    }
    return ok;
}

/* Grammar masks: for each listed row of logits [*, >= width] (fp32 or bf16, row stride in elements), the
 * ids in [0, width) whose bit is 0 in the row's int32 bitmask (bit j % 32 of word j / 32, xgrammar's
 * layout) become -inf. Words with every bit set are skipped whole. */
void apply_token_bitmask(void *logits, int64_t stride, int is_bf16, const int32_t *bm, int64_t bm_stride,
                         const int64_t *rows, int64_t n_rows, int64_t width) {
    const int64_t words = (width + 31) / 32;
#pragma omp parallel for schedule(static) if (n_rows * width > 262144)
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t row = rows[r];
        const int32_t *m = bm + row * bm_stride;
        for (int64_t w = 0; w < words; w++) {
            const uint32_t word = (uint32_t)m[w];
            if (word == 0xffffffffu) continue;
            const int64_t end = (w + 1) * 32 < width ? (w + 1) * 32 : width;
            for (int64_t j = w * 32; j < end; j++) {
                if ((word >> (j - w * 32)) & 1u) continue;
                if (is_bf16) ((uint16_t *)logits)[row * stride + j] = 0xff80u;      /* bf16 -inf */
                else ((float *)logits)[row * stride + j] = -INFINITY;
            }
        }
    }
}
