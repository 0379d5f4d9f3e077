/* nbgen CPU decode attention for one (sequence, kv head) in bf16 with AVX512-BF16 (built with cpu_ops.c into one
 * library; cpu_ops.c's paged_decode_attention calls it for bf16 caches when attn_bf16_fits(G, D)).
 *
 * A batch-32 decode step of a small model reads ~1.7 MB of K/V a layer, 2 KB pages scattered over the pool, which
 * the layers in between have evicted from the caches: the portable kernel (scores for all keys into a buffer,
 * then the weighted sum of the values, each page widened to fp32 first) waited on those reads and kept its
 * output sums in memory. This one makes a single pass over the keys in blocks of 16, with
 *   - the next block's K and V rows prefetched while this block is computed;
 *   - q . k as bf16 dot products (vdpbf16ps: the products of two bf16 values are exact in fp32, only the
 *     summation order differs from fp32 FMAs on the widened values);
 *   - an online softmax in fp32 (running max and sum per query head, earlier sums rescaled when the max
 *     grows) and the weighted sum of the values in fp32 registers: G x D / 16 accumulators, at most 16;
 *   - the output divided by the softmax sum and rounded to bf16 (nearest even) once.
 * Query heads g < G of the kv head share each K / V row (GQA). Layouts as paged_decode_attention's: kh / vh
 * [S, D] bf16 rows of this kv head, page pages[t / P] holds token t at row pages[t / P] * P + t % P.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define ATTN_BF16 1
#endif

#define KEYS 16            /* keys per block: one score vector per query head */
#define MAX_ACC 16         /* fp32 accumulators (zmm registers) for the output rows of one pass */

/* 1 when attend_bf16 handles this head geometry: built with AVX512-BF16, D a multiple of 32 up to 256. Query
 * heads are taken MAX_ACC * 16 / D at a time (each pass reads the head's K / V rows again, from the caches). */
int attn_bf16_fits(int G, int D) {
#ifdef ATTN_BF16
    return G >= 1 && D % 32 == 0 && D <= 256;
#else
    (void)G;
    (void)D;
    return 0;
#endif
}

#ifdef ATTN_BF16
#include "sum16.h"

/* e^x for 16 lanes, x clamped to [-87, 88]: x = n ln2 + r, e^r by a degree-6 polynomial, 2^n in the exponent bits */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* 16 bf16 values -> 16 fp32 (exact) */
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* NG query heads (q rows [NG, D] bf16) against n keys -> out [NG, D] bf16; NG * C <= MAX_ACC with C = D / 16 (both
 * constants after inlining, so the accumulators stay in registers) */
static inline __attribute__((always_inline)) void attend_pass(const uint16_t *q, const uint16_t *kh, const uint16_t *vh,
                                                               const int64_t *pages, int64_t n, int P, float scale,
                                                               uint16_t *out, const int NG, const int C) {
    __m512 acc[MAX_ACC];
    __m512bh qv[MAX_ACC / 2];                               /* q as bf16 pairs, 32 values a register */
    float mx[MAX_ACC], sum[MAX_ACC];
    const int D = C * 16;
    for (int i = 0; i < NG * C; i++) acc[i] = _mm512_setzero_ps();
    for (int i = 0; i < NG * C / 2; i++) qv[i] = (__m512bh)_mm512_loadu_si512((const void *)(q + i * 32));
    for (int g = 0; g < NG; g++) mx[g] = -INFINITY, sum[g] = 0.f;
#define ROW(t) ((pages[(t) / P] * P + (t) % P) * D)
    for (int64_t t0 = 0; t0 < n; t0 += KEYS) {
        const int m = n - t0 < KEYS ? (int)(n - t0) : KEYS;
        int64_t row[KEYS];
        for (int kk = 0; kk < KEYS; kk++) row[kk] = ROW(t0 + (kk < m ? kk : 0));
        for (int kk = 0; kk < KEYS && t0 + KEYS + kk < n; kk++) {       /* the next block's rows, on their way */
            const int64_t r = ROW(t0 + KEYS + kk);
            for (int c = 0; c < D * 2; c += 64) {
                _mm_prefetch((const char *)(kh + r) + c, _MM_HINT_T0);
                _mm_prefetch((const char *)(vh + r) + c, _MM_HINT_T0);
            }
        }
        const __mmask16 valid = (__mmask16)((1u << m) - 1);
        __m512 p[MAX_ACC];
        for (int g = 0; g < NG; g++) {                  /* scores of the block: lane kk = q_g . k_kk */
            __m512 a[KEYS];
            for (int kk = 0; kk < KEYS; kk++) {
                __m512 s = _mm512_setzero_ps();
                for (int c = 0; c < C / 2; c++)
                    s = _mm512_dpbf16_ps(s, qv[g * C / 2 + c], (__m512bh)_mm512_loadu_si512((const void *)(kh + row[kk] + c * 32)));
                a[kk] = s;
            }
            const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,
                                                 _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale)));
            const float bmax = _mm512_reduce_max_ps(sc), nmax = bmax > mx[g] ? bmax : mx[g];
            const float corr = mx[g] == -INFINITY ? 0.f : expf(mx[g] - nmax);
            p[g] = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(nmax))));
            sum[g] = sum[g] * corr + _mm512_reduce_add_ps(p[g]);
            mx[g] = nmax;
            if (corr != 1.f)
                for (int c = 0; c < C; c++) acc[g * C + c] = _mm512_mul_ps(acc[g * C + c], _mm512_set1_ps(corr));
        }
        float pw[MAX_ACC][KEYS];
        for (int g = 0; g < NG; g++) _mm512_storeu_ps(pw[g], p[g]);
        for (int kk = 0; kk < m; kk++) {                 /* acc_g += p[g, kk] v_kk */
            const uint16_t *vr = vh + row[kk];
            for (int c = 0; c < C; c++) {
                const __m512 vv = widen16(vr + c * 16);
                for (int g = 0; g < NG; g++)
                    acc[g * C + c] = _mm512_fmadd_ps(_mm512_set1_ps(pw[g][kk]), vv, acc[g * C + c]);
            }
        }
    }
#undef ROW
    for (int g = 0; g < NG; g++) {
        const __m512 inv = _mm512_set1_ps(1.f / sum[g]);
        for (int c = 0; c < C; c++)
            _mm256_storeu_si256((__m256i *)(out + g * D + c * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g * C + c], inv)));
    }
}
#endif

/* G query heads q [G, D] bf16 (contiguous) of one sequence against its n cached tokens in kv head rows kh / vh
 * (bf16 [S, D]) -> out [G, D] bf16. Needs attn_bf16_fits(G, D). */
void attend_bf16(const uint16_t *q, const uint16_t *kh, const uint16_t *vh, const int64_t *pages, int64_t n, int G,
                 int D, int P, float scale, uint16_t *out) {
#ifdef ATTN_BF16
    if (n <= 0) {                                           /* no keys: zeros, as the portable kernel */
        memset(out, 0, sizeof(uint16_t) * (size_t)G * (size_t)D);
        return;
    }
    const int C = D / 16, per = MAX_ACC / C;                /* query heads a pass */
    for (int g0 = 0; g0 < G; g0 += per) {
        const int ng = G - g0 < per ? G - g0 : per;
        const uint16_t *qg = q + (int64_t)g0 * D;
        uint16_t *og = out + (int64_t)g0 * D;
        switch (C * 100 + ng) {                              /* constant shapes: registers, unrolled loops */
            case 201: attend_pass(qg, kh, vh, pages, n, P, scale, og, 1, 2); break;
            case 202: attend_pass(qg, kh, vh, pages, n, P, scale, og, 2, 2); break;
            case 203: attend_pass(qg, kh, vh, pages, n, P, scale, og, 3, 2); break;
            case 204: attend_pass(qg, kh, vh, pages, n, P, scale, og, 4, 2); break;
            case 205: attend_pass(qg, kh, vh, pages, n, P, scale, og, 5, 2); break;
            case 206: attend_pass(qg, kh, vh, pages, n, P, scale, og, 6, 2); break;
            case 207: attend_pass(qg, kh, vh, pages, n, P, scale, og, 7, 2); break;
            case 208: attend_pass(qg, kh, vh, pages, n, P, scale, og, 8, 2); break;
            case 401: attend_pass(qg, kh, vh, pages, n, P, scale, og, 1, 4); break;
            case 402: attend_pass(qg, kh, vh, pages, n, P, scale, og, 2, 4); break;
            case 403: attend_pass(qg, kh, vh, pages, n, P, scale, og, 3, 4); break;
            case 404: attend_pass(qg, kh, vh, pages, n, P, scale, og, 4, 4); break;
            case 601: attend_pass(qg, kh, vh, pages, n, P, scale, og, 1, 6); break;
            case 602: attend_pass(qg, kh, vh, pages, n, P, scale, og, 2, 6); break;
            case 801: attend_pass(qg, kh, vh, pages, n, P, scale, og, 1, 8); break;
            case 802: attend_pass(qg, kh, vh, pages, n, P, scale, og, 2, 8); break;
            case 1001: attend_pass(qg, kh, vh, pages, n, P, scale, og, 1, 10); break;
            case 1201: attend_pass(qg, kh, vh, pages, n, P, scale, og, 1, 12); break;
            case 1401: attend_pass(qg, kh, vh, pages, n, P, scale, og, 1, 14); break;
            default: attend_pass(qg, kh, vh, pages, n, P, scale, og, 1, 16); break;
        }
    }
#else
    (void)q, (void)kh, (void)vh, (void)pages, (void)n, (void)G, (void)D, (void)P, (void)scale, (void)out;
#endif
}
