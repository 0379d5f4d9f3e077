/* nbgen CPU decode step through all decoder layers in one call (built with cpu_ops.c into one library, see
 * nbgen/kernels/cpu_q4.py).
 *
 * A batch-1 decode step of a small model runs ~10 kernels per layer; called one by one from Python each costs a
 * ctypes transition, tensor allocations and views (~25 us a layer on a 2-core VM, as much as the layer's 4-bit
 * matmuls at 135M parameters). This driver runs the same kernels in the same order on bf16 scratch rows, so its
 * outputs equal the per-kernel path bit for bit: per layer (Llama-shaped, no biases, every linear 4-bit)
 *
 *   x, r <- add_rmsnorm(x, r) | r = x, x = rmsnorm(x) at layer 0;  qkv = x @ Wqkv;  RoPE on q, k (in place);
 *   K/V written into their pages and paged attention -> a;  h = a @ Wo;  h, r <- add_rmsnorm(h, r);
 *   gu = h @ Wgate|up;  act = silu(gate) * up;  x = act @ Wdown
 */
#include <stdint.h>
#include <string.h>

void rmsnorm(const void *x, int64_t x_stride, void *r, int64_t r_stride, const void *w, void *y,
             int64_t y_stride, int64_t T, int H, int D, float eps, int is_bf16);
void rope(void *q, int64_t q_stride, int Hq, void *k, int64_t k_stride, int Hk, const int64_t *pos,
          const float *cos_sin, int D, int64_t T, int is_bf16);
void silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t T, int I, int is_bf16);
void paged_decode_attention(const void *q, int64_t q_stride, void *k, void *v, void *out,
                            const int64_t *table, const int64_t *lens, int B, int Hq, int Hkv, int D, int P,
                            int64_t max_pages, int64_t S, float scale, int is_bf16,
                            const void *k_new, const void *v_new, int64_t k_stride, int64_t v_stride,
                            const int64_t *slots);
void q4_gemv(const void *x, int64_t x_stride, const uint8_t *qw, const uint16_t *d, const uint16_t *m, void *y,
             int64_t y_stride, int T, int64_t N, int64_t K, int is_bf16);

/* the addresses of one layer's tensors in `layers` [L, LAYER_PTRS] (int64): norms' weights (bf16 [H]), each
 * linear's nibbles / d / m (cpu_q4.c's layout), the layer's K and V caches ([Hkv, S, D] bf16) */
enum { IN_NORM, QKV_Q, QKV_D, QKV_M, O_Q, O_D, O_M, POST_NORM, GU_Q, GU_D, GU_M, DOWN_Q, DOWN_D, DOWN_M, K_CACHE,
       V_CACHE, LAYER_PTRS };

int decode_layer_ptrs(void) { return LAYER_PTRS; }

/* x_in [T, H] bf16: the embeddings (read only); x [T, H]: the last layer's output (not yet added to the stream)
 * and r [T, H]: the residual stream, both out. scratch (bf16): qkv [T, (Hq + 2 Hkv) D], a [T, Hq D], h [T, H], gu [T, 2 I], act [T, I].
 * pos [T], slots [T]; table [T, max_pages], lens [T] as paged_decode_attention takes them. T <= 8. */
void q4_decode_layers(int L, const int64_t *layers, const void *x_in, void *x, void *r, void *qkv, void *a, void *h, void *gu,
                      void *act, int T, int H, int I, int Hq, int Hkv, int D, float eps, const int64_t *pos,
                      const float *cos_sin, const int64_t *table, const int64_t *lens, int P, int64_t max_pages,
                      int64_t S, float scale, const int64_t *slots) {
    const int64_t W = (int64_t)(Hq + 2 * Hkv) * D, A = (int64_t)Hq * D;
    char *q = (char *)qkv, *k = q + A * 2, *v = k + (int64_t)Hkv * D * 2;      /* bf16: 2 bytes a value */
    for (int l = 0; l < L; l++) {
        const int64_t *p = layers + (int64_t)l * LAYER_PTRS;
#define PTR(i) ((void *)(intptr_t)p[i])
        if (l == 0) {
            memcpy(r, x_in, (size_t)T * H * 2);
            rmsnorm(r, H, NULL, 0, PTR(IN_NORM), x, H, T, 1, H, eps, 1);
        } else {
            rmsnorm(x, H, r, H, PTR(IN_NORM), x, H, T, 1, H, eps, 1);
        }
        q4_gemv(x, H, PTR(QKV_Q), PTR(QKV_D), PTR(QKV_M), qkv, W, T, W, H, 1);
        rope(q, W, Hq, k, W, Hkv, pos, cos_sin, D, T, 1);
        paged_decode_attention(q, W, PTR(K_CACHE), PTR(V_CACHE), a, table, lens, T, Hq, Hkv, D, P, max_pages, S,
                               scale, 1, k, v, W, W, slots);
        q4_gemv(a, A, PTR(O_Q), PTR(O_D), PTR(O_M), h, H, T, H, A, 1);
        rmsnorm(h, H, r, H, PTR(POST_NORM), h, H, T, 1, H, eps, 1);
        q4_gemv(h, H, PTR(GU_Q), PTR(GU_D), PTR(GU_M), gu, 2 * (int64_t)I, T, 2 * (int64_t)I, H, 1);
        silu_and_mul(gu, 2 * (int64_t)I, act, T, I, 1);
        q4_gemv(act, I, PTR(DOWN_Q), PTR(DOWN_D), PTR(DOWN_M), x, H, T, H, I, 1);
#undef PTR
    }
}
