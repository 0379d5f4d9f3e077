/* sum16: sixteen horizontal sums at once (AVX-512), shared by the C decode attention kernels. */
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

/* r[k] = the sum of a[k]'s 16 lanes, for 16 vectors at once: pairs, then quads inside each 128-bit lane, then
 * the four 128-bit lanes (a transposing add tree: ~45 instructions instead of 16 horizontal sums) */
static inline __m512 sum16(const __m512 *a) {
    __m512 p[8], q[4];
    for (int k = 0; k < 8; k++)                /* lane L of p[k]: key 2k's, 2k+1's, 2k's, 2k+1's pair sums */
        p[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++)                /* lane L of q[k]: keys 4k .. 4k+3, each summed over lane L */
        q[k] = _mm512_add_ps(_mm512_shuffle_ps(p[2 * k], p[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(p[2 * k], p[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif
