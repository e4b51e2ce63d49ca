// Decode-step kernels for tokwatt's CUDA workload, compiled at run time by NVRTC.
// One file because NVRTC compiles one source: the helpers, the small kernels, the
// matrix-vector kernels and attention, in that order.
//
// Conventions:
// - bf16 values are carried as raw 16-bit patterns (`bf16` below), so the source needs no CUDA
//   headers; conversions are bit operations and `cvt.rn.bf16.f32`. Arithmetic is fp32.
// - Matrices are row-major with one row per output feature ([out, in], as nn.Linear stores
//   them), so a warp streams a weight row with coalesced 16-byte loads.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float bf16_to_f32(bf16 v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Two floats to a packed bf16x2 word: `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x);
    f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z);
    f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    uint4 v;
    v.x = pack_bf16x2(f[0], f[1]);
    v.y = pack_bf16x2(f[2], f[3]);
    v.z = pack_bf16x2(f[4], f[5]);
    v.w = pack_bf16x2(f[6], f[7]);
    return v;
}

// Streaming load of data read once per step (weights, the KV cache): skip L1 so that the
// activations, which every warp of a block re-reads, stay there. Not volatile: the compiler may
// hoist these loads, which is what keeps many of them in flight. Only for data no kernel of
// the step writes before reading it here.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}


__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Thread block clusters (Hopper and newer): a barrier over every block of the cluster that
// orders their shared-memory writes before the reads after it, and a load from the shared
// memory of block `rank` of the cluster at the address `p` has in this block.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ float ld_cluster(const float* p, u32 rank) {
#if __CUDA_ARCH__ >= 900
    u64 generic = (u64)p, local;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(local) : "l"(generic));
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"((u32)local), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    return 0.f;
#endif
}

// D = A·B + D for one m16n8k16 tile: bf16 operands, fp32 accumulators, fragments in the
// PTX ISA's register layout for .row.col.
__device__ __forceinline__ void mma_bf16_16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
    return v;
}

// Sum over a block of `nwarps` warps; every thread gets the result. `scratch` holds nwarps floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & (WARP_SIZE - 1);
    const int warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read from a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < nwarps; ++w) total += scratch[w];
    return total;
}

// rsqrt(mean(x^2) + eps) of one row of `hidden` values, for the whole block; `scratch` holds
// one float per warp. Every thread of the block must call it.
__device__ __forceinline__ float rms_factor(const bf16* __restrict__ x, int hidden, float eps,
                                            float* scratch) {
    const uint4* xr = (const uint4*)x;
    const int n = hidden / 8;
    float ss = 0.f;
    // Four loads per thread in flight before any is used: one round trip, not four.
    for (int i0 = threadIdx.x; i0 < n; i0 += 4 * blockDim.x) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * blockDim.x;
            v[u] = i < n ? xr[i] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            float f[8];
            unpack8(v[u], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
        }
    }
    return rsqrtf(block_sum(ss, scratch) / (float)hidden + eps);
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// Rotary angle for pair `i` of a head of `head_dim`, at position `pos`:
// angle = pos * theta^(-2i/head_dim), theta given as log2(theta).
__device__ __forceinline__ void rope_sincos(int pos, int i, int head_dim, float log2_theta,
                                            float* s, float* c) {
    const float inv_freq = exp2f(-(2.f * (float)i / (float)head_dim) * log2_theta);
    sincosf((float)pos * inv_freq, s, c);
}

// 64-bit mix (splitmix64 finaliser), for reproducible random fills.
__device__ __forceinline__ u64 mix64(u64 x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

// ---------------------------------------------------------------------------------------------
// Initialisation: uniform values in [offset - scale, offset + scale), from (seed, index) only.
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void fill_uniform(bf16* __restrict__ out, u64 n, u64 seed, float scale,
                                        float offset) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const u64 h = mix64(i * 0x9e3779b97f4a7c15ull + seed);
        // 24 random bits to [-1, 1).
        const float u = (float)(h >> 40) * (2.f / 16777216.f) - 1.f;
        out[i] = f32_to_bf16(offset + scale * u);
    }
}

// Folds an RMSNorm's weights into the projection after it: W[n, k] *= gamma[k] for W of
// [rows, cols]. Then norm(x) · W^T = rsqrt(mean(x^2) + eps) * (x · W'^T): the projection reads the
// raw residual stream and the kernel after it applies the factor.
extern "C" __global__ void scale_columns(bf16* __restrict__ w, u64 rows, int cols,
                                         const bf16* __restrict__ gamma) {
    const u64 n = rows * (u64)cols;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        w[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(gamma[i % (u64)cols]));
}

// ---------------------------------------------------------------------------------------------
// Embedding lookup: x[b] = table[tokens[b]]; sumsq[b] = sum of x[b]^2 (for the fused norms).
// grid = batch, block = 256.
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void embed(const u32* __restrict__ tokens, const bf16* __restrict__ table,
                                 bf16* __restrict__ x, float* __restrict__ sumsq, int hidden,
                                 int vocab) {
    __shared__ float scratch[32];
    const int b = blockIdx.x;
    u32 token = tokens[b];
    if (token >= (u32)vocab) token = (u32)vocab - 1;
    const uint4* src = (const uint4*)(table + (size_t)token * hidden);
    uint4* dst = (uint4*)(x + (size_t)b * hidden);
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) {
        const uint4 v = src[i];
        dst[i] = v;
        float f[8];
        unpack8(v, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
    ss = block_sum(ss, scratch);
    if (threadIdx.x == 0) sumsq[b] = ss;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: out[b] = x[b] * rsqrt(mean(x[b]^2) + eps) * gamma. grid = batch, block = 256.
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void rmsnorm(const bf16* __restrict__ x, const bf16* __restrict__ gamma,
                                   bf16* __restrict__ out, int hidden, float eps) {
    __shared__ float scratch[32];
    const int b = blockIdx.x;
    const uint4* xr = (const uint4*)(x + (size_t)b * hidden);
    const uint4* gr = (const uint4*)gamma;
    uint4* outr = (uint4*)(out + (size_t)b * hidden);
    const float rstd = rms_factor(x + (size_t)b * hidden, hidden, eps, scratch);
    for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) {
        float f[8], g[8];
        unpack8(xr[i], f);
        unpack8(gr[i], g);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = f[e] * rstd * g[e];
        outr[i] = pack8(f);
    }
}

// ---------------------------------------------------------------------------------------------
// SiLU-gated product: out[b, j] = silu(r * gu[b, j]) * (r * gu[b, mlp + j]), r the RMSNorm
// factor rsqrt(mean(x[b]^2) + eps) when `x` is given (the norm's weights are folded into the
// gate/up projection, whose input was the raw residual stream), else 1.
// grid = (blocks covering mlp / 8, batch), one thread per 8 outputs.
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void silu_mul(const bf16* __restrict__ gu, bf16* __restrict__ out, int mlp,
                                    const bf16* __restrict__ x, int hidden, float eps) {
    __shared__ float scratch[32];
    const int b = blockIdx.y;
    float r = 1.f;
    if (x != nullptr) r = rms_factor(x + (size_t)b * hidden, hidden, eps, scratch);
    const int vecs_per_row = mlp / 8;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= vecs_per_row) return;
    const uint4* row = (const uint4*)(gu + (size_t)b * 2 * mlp);
    float g[8], u[8];
    unpack8(row[j], g);
    unpack8(row[vecs_per_row + j], u);
#pragma unroll
    for (int e = 0; e < 8; ++e) g[e] = silu(g[e] * r) * (u[e] * r);
    ((uint4*)(out + (size_t)b * mlp))[j] = pack8(g);
}

// ---------------------------------------------------------------------------------------------
// RoPE in place on the query and key heads of a fused qkv row (rotate-half convention).
// The decode step fuses the same rotation into `attention`; this kernel exists so the rotation
// can be checked on its own. grid = batch, block = 128.
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void rope_qk(bf16* __restrict__ qkv, int ld_qkv, int n_heads, int n_kv_heads,
                                   int head_dim, int pos, float log2_theta) {
    const int b = blockIdx.x;
    const int half = head_dim / 2;
    const int pairs = (n_heads + n_kv_heads) * half;
    bf16* row = qkv + (size_t)b * ld_qkv;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int head = p / half;  // query heads first, then key heads: contiguous in the row
        const int i = p - head * half;
        bf16* h = row + head * head_dim;
        float s, c;
        rope_sincos(pos, i, head_dim, log2_theta, &s, &c);
        const float x1 = bf16_to_f32(h[i]);
        const float x2 = bf16_to_f32(h[i + half]);
        h[i] = f32_to_bf16(x1 * c - x2 * s);
        h[i + half] = f32_to_bf16(x2 * c + x1 * s);
    }
}

// ---------------------------------------------------------------------------------------------
// Greedy argmax over each row of logits; ties go to the lowest index. grid = batch, block = 1024.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void argmax_merge(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

extern "C" __global__ void argmax(const bf16* __restrict__ logits, int vocab, u32* __restrict__ tokens) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int b = blockIdx.x;
    const bf16* row = logits + (size_t)b * vocab;
    float best = NEG_INF;
    int best_i = 0x7fffffff;
    // 16-byte loads need every row 16-byte aligned; other vocabularies take the scalar loop.
    const int nvec = (vocab % 8 == 0) ? vocab / 8 : 0;
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
        float f[8];
        unpack8(((const uint4*)row)[v], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) argmax_merge(best, best_i, f[e], v * 8 + e);
    }
    for (int i = nvec * 8 + threadIdx.x; i < vocab; i += blockDim.x)
        argmax_merge(best, best_i, bf16_to_f32(row[i]), i);
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
        const float v2 = __shfl_xor_sync(FULL_MASK, best, off);
        const int i2 = __shfl_xor_sync(FULL_MASK, best_i, off);
        argmax_merge(best, best_i, v2, i2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = best_i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x / WARP_SIZE); ++w) argmax_merge(best, best_i, sv[w], si[w]);
        // A row of NaNs (never in practice) yields token 0 rather than an out-of-range id.
        tokens[b] = best_i == 0x7fffffff ? 0u : (u32)best_i;
    }
}

// ---------------------------------------------------------------------------------------------
// Bandwidth-bound matrix-vector products for small batches: Y[b, n] = sum_k W[n, k] * X[b, k].
//
// One warp per output row (two for MODE_SILU: the gate row and the up row), over the whole of K:
// each lane streams 16 bytes of the row per chunk of 256 columns, U chunks at a time (all loads
// issued before use), so no cross-warp reduction is needed. A block holds 8 warps (8 rows); a
// kernel is thousands of warps, which the GPU balances across multiprocessors. The activations
// X are tiny and re-read by every warp of a block, so they stay in L1.
//
// Modes:
//   MODE_STORE:    Y = acc                          (fused QKV, LM head)
//   MODE_RESIDUAL: Y += acc, and sumsq_out[b] += sum of the new Y[b]^2 (O and down projections,
//                  Y is the residual stream; the sum feeds the next fused RMSNorm)
//   MODE_SILU:     Y[b, n] = silu(acc(n)) * acc(N + n): W holds the gate rows then the up rows.
// With NORM, X is RMS-normalised on the fly: X * gamma, and the result scaled by
// rsqrt(sumsq_in[b] / K + eps); block 0 also zeroes `zero_out` for the next accumulation.
// ---------------------------------------------------------------------------------------------

#define MODE_STORE 0
#define MODE_RESIDUAL 1
#define MODE_SILU 2
#define GEMV_WARPS 8
#define GEMV_THREADS (GEMV_WARPS * WARP_SIZE)

template <int B, int U, int MODE, bool NORM>
__device__ __forceinline__ void gemv_impl(const bf16* __restrict__ W, const bf16* __restrict__ X,
                                          const bf16* __restrict__ gamma,
                                          const float* __restrict__ sumsq_in,
                                          float* __restrict__ zero_out, bf16* __restrict__ Y,
                                          float* __restrict__ sumsq_out, int N, int K, int ldx,
                                          int ldy, float eps) {
    constexpr int NR = (MODE == MODE_SILU) ? 2 : 1;  // weight rows streamed per warp
    __shared__ float block_ss[GEMV_WARPS][B];
    const int lane = threadIdx.x & (WARP_SIZE - 1);
    const int warp = threadIdx.x / WARP_SIZE;
    const int row = blockIdx.x * GEMV_WARPS + warp;
    const bool valid = row < N;
    const int r = min(row, N - 1);  // a row past N is computed but never stored

    const bf16* wrow[NR];
    wrow[0] = W + (size_t)r * K;
    if (MODE == MODE_SILU) wrow[NR - 1] = W + (size_t)(N + r) * K;

    // Pull the head of each weight row into L2 before the first reads (only the head, so
    // prefetches of waiting warps cannot evict each other).
    if (lane < 16) {
#pragma unroll
        for (int i = 0; i < NR; ++i)
            if (lane * 128 < K * 2) prefetch_l2((const char*)wrow[i] + lane * 128);
    }

    float rstd[B];
#pragma unroll
    for (int b = 0; b < B; ++b) rstd[b] = NORM ? rsqrtf(sumsq_in[b] / (float)K + eps) : 1.f;
    if (NORM && zero_out != nullptr && blockIdx.x == 0 && threadIdx.x < B) zero_out[threadIdx.x] = 0.f;

    float acc[NR][B];
#pragma unroll
    for (int i = 0; i < NR; ++i)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[i][b] = 0.f;

    const int nchunks = (K + 255) / 256;
    for (int c0 = 0; c0 < nchunks; c0 += U) {
        uint4 w[U][NR];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int e = (c0 + u) * 256 + lane * 8;
            const bool ok = (c0 + u < nchunks) && (e < K);
#pragma unroll
            for (int i = 0; i < NR; ++i) w[u][i] = ok ? ld_stream(wrow[i] + e) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int e = (c0 + u) * 256 + lane * 8;
            if ((c0 + u < nchunks) && (e < K)) {
                float wf[NR][8];
#pragma unroll
                for (int i = 0; i < NR; ++i) unpack8(w[u][i], wf[i]);
                float g[8];
                if (NORM) unpack8(*(const uint4*)(gamma + e), g);
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    float xf[8];
                    unpack8(*(const uint4*)(X + (size_t)b * ldx + e), xf);
                    if (NORM) {
#pragma unroll
                        for (int j = 0; j < 8; ++j) xf[j] *= g[j];
                    }
#pragma unroll
                    for (int i = 0; i < NR; ++i)
#pragma unroll
                        for (int j = 0; j < 8; ++j) acc[i][b] = fmaf(wf[i][j], xf[j], acc[i][b]);
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < NR; ++i)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[i][b] = warp_sum(acc[i][b]);

    // Every lane now holds every total; lane b stores the output of sequence b.
    float ss = 0.f;
#pragma unroll
    for (int b = 0; b < B; ++b) {
        if (lane == b && valid) {
            bf16* y = Y + (size_t)b * ldy + row;
            if (MODE == MODE_STORE) {
                *y = f32_to_bf16(acc[0][b] * rstd[b]);
            } else if (MODE == MODE_RESIDUAL) {
                const bf16 out = f32_to_bf16(bf16_to_f32(*y) + acc[0][b]);
                *y = out;
                const float o = bf16_to_f32(out);
                ss = o * o;
            } else {
                *y = f32_to_bf16(silu(acc[0][b] * rstd[b]) * (acc[NR - 1][b] * rstd[b]));
            }
        }
    }

    if (MODE == MODE_RESIDUAL) {
        if (lane < B) block_ss[warp][lane] = ss;
        __syncthreads();
        if (threadIdx.x < B) {
            float total = 0.f;
#pragma unroll
            for (int w2 = 0; w2 < GEMV_WARPS; ++w2) total += block_ss[w2][threadIdx.x];
            atomicAdd(sumsq_out + threadIdx.x, total);
        }
    }
}

#define GEMV_PARAMS                                                                               \
    const bf16 *__restrict__ W, const bf16 *__restrict__ X, const bf16 *__restrict__ gamma,       \
        const float *__restrict__ sumsq_in, float *__restrict__ zero_out, bf16 *__restrict__ Y,   \
        float *__restrict__ sumsq_out, int N, int K, int ldx, int ldy, float eps
#define GEMV_ARGS W, X, gamma, sumsq_in, zero_out, Y, sumsq_out, N, K, ldx, ldy, eps

// Chunks in flight per warp: about eight 16-byte loads per lane for small batches, fewer when
// the batch multiplies the arithmetic per loaded byte.
#define GEMV_FOR_BATCH(BB, U_ONE, U_TWO)                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv_norm_store_b##BB(GEMV_PARAMS) { \
        gemv_impl<BB, U_ONE, MODE_STORE, true>(GEMV_ARGS);                                        \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv_residual_b##BB(GEMV_PARAMS) { \
        gemv_impl<BB, U_ONE, MODE_RESIDUAL, false>(GEMV_ARGS);                                    \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv_norm_silu_b##BB(GEMV_PARAMS) { \
        gemv_impl<BB, U_TWO, MODE_SILU, true>(GEMV_ARGS);                                         \
    }

GEMV_FOR_BATCH(1, 8, 4)
GEMV_FOR_BATCH(2, 8, 4)
GEMV_FOR_BATCH(3, 4, 2)
GEMV_FOR_BATCH(4, 4, 2)
GEMV_FOR_BATCH(5, 2, 1)
GEMV_FOR_BATCH(6, 2, 1)
GEMV_FOR_BATCH(7, 2, 1)
GEMV_FOR_BATCH(8, 2, 1)

// ---------------------------------------------------------------------------------------------
// Decode attention (one new token per sequence) with grouped-query heads, RoPE and the KV-cache
// append fused in; with `x` given, also the attention RMSNorm's factor (its weights are folded
// into the QKV projection).
//
// The KV cache of a layer is [batch_max, n_kv_heads, ctx, HD]. The new token sits at position
// `pos`; its key (rotated) and value are taken from the qkv row and written to slot `pos`.
// grid = (splits, n_kv_heads, batch), block = 128: a block handles the G query heads of one KV
// head over positions [split * chunk, min(ctx, (split + 1) * chunk)). Scores go to shared memory
// (dynamic, G * chunk floats), then softmax, then the value pass. With several splits, either
// (cluster_merge, launched as clusters of `splits` blocks) every block keeps its partial output,
// maximum and sum in shared memory and merges a slice of the outputs from all blocks of its
// cluster; or each block writes them to global memory and the last block of a (sequence, KV
// head) to finish merges them, resetting the arrival counter for the next launch.
// The block owning `pos` uses the new key and value from shared memory rather than reading them
// back, so no block reads a cache slot written in the same launch.
// Softmax runs in base 2: q is scaled by log2(e) / sqrt(HD) up front.
// The score and the value pass each come in two implementations that share everything else:
// CUDA cores (fp32) and tensor cores (bf16 mma.sync with fp32 accumulation, as flash attention
// does; far fewer instructions per byte, which matters once the power cap lowers the clock).
// ---------------------------------------------------------------------------------------------

#define ATT_THREADS 128
#define ATT_WARPS (ATT_THREADS / WARP_SIZE)

// Cache rows are read so that every 16-byte load instruction of a warp covers whole 32-byte
// sectors: lanes that read the same row take adjacent 16-byte pieces. (Reading 32 contiguous
// bytes per lane as two loads would fetch each sector from L2 twice, since the streaming loads
// do not allocate in L1.) Which dimensions a lane then holds is given by these maps.

// CUDA cores: element e (0..15) of the thread that is `sub`-th of its position's HD / 16
// threads: two runs of 8, one in each half of the row.
template <int HD>
__device__ __forceinline__ int thread_dim(int sub, int e) {
    return (e >> 3) * (HD / 2) + sub * 8 + (e & 7);
}

// Tensor-core scores: 32-bit word w of the key row quarter held by lane t4 (of 4): its load
// v = w / 4 covers 32 dimensions, 8 per lane.
__device__ __forceinline__ int key_word_dim(int t4, int w) {
    return (w >> 2) * 32 + t4 * 8 + (w & 3) * 2;
}

// Tensor-core values: 32-bit word mt (one per m-tile) of the value row part held by lane gid
// (of 8): its load v = mt / 4 covers 64 dimensions, 8 per lane.
__device__ __forceinline__ int value_word_dim(int gid, int mt) {
    return (mt >> 2) * 64 + gid * 8 + (mt & 3) * 2;
}

// CUDA cores: this thread's two 16-byte pieces (one per half, `thread_dim`) of the cache rows
// p + u * PPI for u < U, all requested before any is used; zeros from row `stop` on.
template <int U, int HD, int PPI>
__device__ __forceinline__ void load_cache_rows(uint4 (&rows)[U][2], const bf16* base, int p, int stop) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int row = p + u * PPI;
        if (row < stop) {
            rows[u][0] = ld_stream(base + (size_t)row * HD);
            rows[u][1] = ld_stream(base + (size_t)row * HD + HD / 2);
        } else {
            rows[u][0] = make_uint4(0, 0, 0, 0);
            rows[u][1] = make_uint4(0, 0, 0, 0);
        }
    }
}

// One warp over n values v[0..n): returns their maximum M, replaces each v[i] by 2^(v[i] - M)
// and returns in `total` the sum of those, each times weight[i] when WEIGHTED. The softmax of a
// head's scores, and the split merge's weights of a head's statistics.
template <bool WEIGHTED>
__device__ __forceinline__ float warp_exp2_from_max(float* v, int n, const float* weight, float& total) {
    const int lane = threadIdx.x & (WARP_SIZE - 1);
    float mx = NEG_INF;
    for (int i = lane; i < n; i += WARP_SIZE) mx = fmaxf(mx, v[i]);
    mx = warp_max(mx);
    float t = 0.f;
    for (int i = lane; i < n; i += WARP_SIZE) {
        const float e = exp2f(v[i] - mx);
        v[i] = e;
        t = WEIGHTED ? fmaf(e, weight[i], t) : t + e;
    }
    total = warp_sum(t);
    return mx;
}

// The merge's partial outputs of splits [s0, s0 + SB), OPT of the N per split for this thread
// (output tid + k * ATT_THREADS), all requested before any is used; zeros past the ends.
template <int N, int SB, int OPT>
__device__ __forceinline__ void load_partials(float (&pv)[SB][OPT], const float* po, int s0,
                                              int splits, int tid) {
#pragma unroll
    for (int sb = 0; sb < SB; ++sb)
#pragma unroll
        for (int k = 0; k < OPT; ++k) {
            const int i = tid + k * ATT_THREADS;
            pv[sb][k] = (s0 + sb < splits && i < N) ? __ldcg(po + (size_t)(s0 + sb) * N + i) : 0.f;
        }
}

template <int HD, int G, int UK, int UV>
__device__ __forceinline__ void attention_impl(
    const bf16* __restrict__ qkv, int ld_qkv, int n_heads, int n_kv_heads, bf16* __restrict__ k_cache,
    bf16* __restrict__ v_cache, int ctx, int pos, int chunk, int splits, bf16* __restrict__ out,
    float* __restrict__ part_o, float* __restrict__ part_ml, u32* __restrict__ counters,
    float q_scale, float log2_theta, const bf16* __restrict__ x, int hidden, float eps,
    int cluster_merge) {
    constexpr int TPP = HD / 16;             // threads per position; each handles 16 dims
    constexpr int PPI = ATT_THREADS / TPP;   // positions per block iteration
    // UK (scores) and UV (values) > 0: that pass on CUDA cores, with that many block iterations
    // of loads in flight (32 bytes per thread each); 0: that pass on tensor cores.

    extern __shared__ float scores[];        // [G][chunk]; the merge reuses it as [2][G][splits]
    __shared__ float q_s[G][HD];
    __shared__ float knew_s[HD];
    __shared__ float vnew_s[HD];
    __shared__ float red[ATT_WARPS][G * HD];
    __shared__ float stat[ATT_WARPS][G];
    __shared__ float m_s[G], l_s[G];
    __shared__ int is_last;
    __shared__ float norm_scratch[ATT_WARPS];

    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & (WARP_SIZE - 1), warp = tid / WARP_SIZE;
    const int start = split * chunk;
    const int end = min(start + chunk, ctx);
    const bool owns_pos = pos >= start && pos < end;
    const int stop = owns_pos ? pos : end;   // cache positions read: [start, stop)
    const int n_local = end - start;
    const size_t seq_base = ((size_t)b * n_kv_heads + kvh) * (size_t)ctx * HD;

    // Cache positions before `pos` are written by no kernel of this step: pull the head of this
    // block's keys and values into L2 before the query is ready (small splits: all of it).
    {
        const char* kb = (const char*)(k_cache + seq_base + (size_t)start * HD);
        const char* vb = (const char*)(v_cache + seq_base + (size_t)start * HD);
        const int bytes = min((stop - start) * HD * 2, 16384);
        for (int off = tid * 128; off < bytes; off += ATT_THREADS * 128) {
            prefetch_l2(kb + off);
            prefetch_l2(vb + off);
        }
    }

    const bf16* row = qkv + (size_t)b * ld_qkv;
    constexpr int HALF = HD / 2;
    // The query's rotation pairs, loaded before the norm factor's reduction so that both reads
    // are in flight at once.
    constexpr int QPT = (G * HALF + ATT_THREADS - 1) / ATT_THREADS;
    float q1[QPT], q2[QPT];
#pragma unroll
    for (int t = 0; t < QPT; ++t) {
        const int i = tid + t * ATT_THREADS;
        const int g = i / HALF, j = i - g * HALF;
        const bf16* qh = row + (kvh * G + g) * HD;
        q1[t] = i < G * HALF ? bf16_to_f32(qh[j]) : 0.f;
        q2[t] = i < G * HALF ? bf16_to_f32(qh[j + HALF]) : 0.f;
    }
    // With x given, the attention norm's weights are folded into the QKV projection, which read
    // the raw residual stream: q, k and v take the RMSNorm factor here.
    const float r = x != nullptr ? rms_factor(x + (size_t)b * hidden, hidden, eps, norm_scratch) : 1.f;
#pragma unroll
    for (int t = 0; t < QPT; ++t) {
        const int i = tid + t * ATT_THREADS;
        if (i >= G * HALF) break;
        const int g = i / HALF, j = i - g * HALF;
        float s, c;
        rope_sincos(pos, j, HD, log2_theta, &s, &c);
        const float x1 = q1[t] * r, x2 = q2[t] * r;
        q_s[g][j] = (x1 * c - x2 * s) * q_scale;
        q_s[g][j + HALF] = (x2 * c + x1 * s) * q_scale;
    }
    if (owns_pos) {
        const bf16* kh = row + n_heads * HD + kvh * HD;
        const bf16* vh = row + (n_heads + n_kv_heads) * HD + kvh * HD;
        bf16* kslot = k_cache + seq_base + (size_t)pos * HD;
        bf16* vslot = v_cache + seq_base + (size_t)pos * HD;
        for (int j = tid; j < HALF; j += ATT_THREADS) {
            float s, c;
            rope_sincos(pos, j, HD, log2_theta, &s, &c);
            const float x1 = bf16_to_f32(kh[j]) * r, x2 = bf16_to_f32(kh[j + HALF]) * r;
            const bf16 k1 = f32_to_bf16(x1 * c - x2 * s), k2 = f32_to_bf16(x2 * c + x1 * s);
            kslot[j] = k1;
            kslot[j + HALF] = k2;
            knew_s[j] = bf16_to_f32(k1);
            knew_s[j + HALF] = bf16_to_f32(k2);
        }
        for (int j = tid; j < HD; j += ATT_THREADS) {
            const bf16 v = f32_to_bf16(bf16_to_f32(vh[j]) * r);
            vslot[j] = v;
            vnew_s[j] = bf16_to_f32(v);
        }
    }
    __syncthreads();

    // Pass 1: scores for cache positions [start, stop).
    if constexpr (UK > 0) {
        // CUDA cores: TPP threads per position, 16 dimensions each (`thread_dim`), butterfly sums.
        const int sub = tid % TPP;   // which 16 dimensions this thread handles
        const int pgrp = tid / TPP;  // which position of an iteration
        const bf16* kbase = k_cache + seq_base + sub * 8;
        float qr[G][16];
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int e = 0; e < 16; ++e) qr[g][e] = q_s[g][thread_dim<HD>(sub, e)];
        for (int p0 = start; p0 < stop; p0 += PPI * UK) {
            uint4 kv[UK][2];
            load_cache_rows<UK, HD, PPI>(kv, kbase, p0 + pgrp, stop);
#pragma unroll
            for (int u = 0; u < UK; ++u) {
                float kf[16];
                unpack8(kv[u][0], kf);
                unpack8(kv[u][1], kf + 8);
                float s[G];
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    s[g] = 0.f;
#pragma unroll
                    for (int e = 0; e < 16; ++e) s[g] = fmaf(qr[g][e], kf[e], s[g]);
#pragma unroll
                    for (int off = TPP / 2; off > 0; off >>= 1) s[g] += __shfl_xor_sync(FULL_MASK, s[g], off);
                }
                const int p = p0 + u * PPI + pgrp;
                if (sub == 0 && p < stop) {
#pragma unroll
                    for (int g = 0; g < G; ++g) scores[g * chunk + (p - start)] = s[g];
                }
            }
        }
    } else {
        // Tensor cores: each warp takes tiles of 16 positions; S[p][h] = K[p][:] · Q[h][:] as
        // mma.m16n8k16 with A = 16 key rows, B = the (up to 8) query heads. Lane (gid, t4) loads
        // a quarter of rows gid and gid + 8 with 16-byte loads (`key_word_dim`); the contraction
        // order of the dimensions is permuted identically for keys and queries, which a dot
        // product does not notice.
        constexpr int QD = HD / 4;      // dimensions of a row per lane
        constexpr int QW = QD / 2;      // their 32-bit words
        constexpr int KSTEPS = HD / 16;
        constexpr int UT = 2;           // tiles with loads in flight per warp
        const int gid = lane >> 2, t4 = lane & 3;
        u32 qb[KSTEPS][2];
#pragma unroll
        for (int j = 0; j < KSTEPS; ++j) {
            if (gid < G) {
                const float* q0 = &q_s[gid][key_word_dim(t4, 2 * j)];
                const float* q1 = &q_s[gid][key_word_dim(t4, 2 * j + 1)];
                qb[j][0] = pack_bf16x2(q0[0], q0[1]);
                qb[j][1] = pack_bf16x2(q1[0], q1[1]);
            } else {
                qb[j][0] = 0u;
                qb[j][1] = 0u;
            }
        }
        const bf16* kq = k_cache + seq_base + t4 * 8;
        for (int t0 = start + warp * 16; t0 < stop; t0 += ATT_WARPS * 16 * UT) {
            u32 kw[UT][2][QW];
#pragma unroll
            for (int u = 0; u < UT; ++u)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int p = t0 + u * ATT_WARPS * 16 + gid + 8 * h;
#pragma unroll
                    for (int v = 0; v < QW / 4; ++v) {
                        const uint4 x = p < stop ? ld_stream(kq + (size_t)p * HD + 32 * v) : make_uint4(0, 0, 0, 0);
                        kw[u][h][4 * v] = x.x;
                        kw[u][h][4 * v + 1] = x.y;
                        kw[u][h][4 * v + 2] = x.z;
                        kw[u][h][4 * v + 3] = x.w;
                    }
                }
#pragma unroll
            for (int u = 0; u < UT; ++u) {
                float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < KSTEPS; ++j)
                    mma_bf16_16816(c, kw[u][0][2 * j], kw[u][1][2 * j], kw[u][0][2 * j + 1],
                                   kw[u][1][2 * j + 1], qb[j][0], qb[j][1]);
                // c0, c1: position (row gid), heads 2*t4 and 2*t4 + 1; c2, c3: row gid + 8.
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int p = t0 + u * ATT_WARPS * 16 + gid + 8 * h;
                    if (p < stop) {
                        if (2 * t4 < G) scores[(2 * t4) * chunk + (p - start)] = c[2 * h];
                        if (2 * t4 + 1 < G) scores[(2 * t4 + 1) * chunk + (p - start)] = c[2 * h + 1];
                    }
                }
            }
        }
    }

    if (owns_pos && warp == 0) {
        for (int g = 0; g < G; ++g) {
            float s = 0.f;
            for (int d = lane; d < HD; d += WARP_SIZE) s = fmaf(q_s[g][d], knew_s[d], s);
            s = warp_sum(s);
            if (lane == 0) scores[g * chunk + (pos - start)] = s;
        }
    }
    __syncthreads();

    // Softmax statistics over the n_local scores of this block. With at least a head per warp,
    // each warp takes whole heads and needs no block barrier until the values read the scores.
    if constexpr (G >= ATT_WARPS) {
        for (int g = warp; g < G; g += ATT_WARPS) {
            float l;
            const float mx = warp_exp2_from_max<false>(scores + g * chunk, n_local, nullptr, l);
            if (lane == 0) {
                m_s[g] = mx;
                l_s[g] = l;
            }
        }
        __syncthreads();
    } else {
        float m[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            m[g] = NEG_INF;
            for (int i = tid; i < n_local; i += ATT_THREADS) m[g] = fmaxf(m[g], scores[g * chunk + i]);
            m[g] = warp_max(m[g]);
            if (lane == 0) stat[warp][g] = m[g];
        }
        __syncthreads();
        if (tid < G) {
            float mm = stat[0][tid];
            for (int w2 = 1; w2 < ATT_WARPS; ++w2) mm = fmaxf(mm, stat[w2][tid]);
            m_s[tid] = mm;
        }
        __syncthreads();
        float l[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            l[g] = 0.f;
            const float mg = m_s[g];
            for (int i = tid; i < n_local; i += ATT_THREADS) {
                const float e = exp2f(scores[g * chunk + i] - mg);
                scores[g * chunk + i] = e;
                l[g] += e;
            }
            l[g] = warp_sum(l[g]);
        }
        __syncthreads();  // stat is reused below
#pragma unroll
        for (int g = 0; g < G; ++g)
            if (lane == 0) stat[warp][g] = l[g];
        __syncthreads();
        if (tid < G) {
            float ll = 0.f;
            for (int w2 = 0; w2 < ATT_WARPS; ++w2) ll += stat[w2][tid];
            l_s[tid] = ll;
        }
        __syncthreads();
    }

    // Pass 2: weighted sum of values, into red[warp][head][dim].
    if constexpr (UV > 0) {
        const int sub = tid % TPP;   // which 16 dimensions this thread handles
        const int pgrp = tid / TPP;  // which position of an iteration
        const bf16* vbase = v_cache + seq_base + sub * 8;
        float acc[G][16];
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int e = 0; e < 16; ++e) acc[g][e] = 0.f;
        for (int p0 = start; p0 < stop; p0 += PPI * UV) {
            uint4 vv[UV][2];
            load_cache_rows<UV, HD, PPI>(vv, vbase, p0 + pgrp, stop);
#pragma unroll
            for (int u = 0; u < UV; ++u) {
                const int p = p0 + u * PPI + pgrp;
                if (p < stop) {
                    float vf[16];
                    unpack8(vv[u][0], vf);
                    unpack8(vv[u][1], vf + 8);
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        const float w = scores[g * chunk + (p - start)];
#pragma unroll
                        for (int e = 0; e < 16; ++e) acc[g][e] = fmaf(w, vf[e], acc[g][e]);
                    }
                }
            }
        }
        if (owns_pos && pgrp == 0) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float w = scores[g * chunk + (pos - start)];
#pragma unroll
                for (int e = 0; e < 16; ++e) acc[g][e] = fmaf(w, vnew_s[thread_dim<HD>(sub, e)], acc[g][e]);
            }
        }
        // Lanes with the same `sub` hold partial sums for the same dimensions.
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int e = 0; e < 16; ++e)
#pragma unroll
                for (int off = TPP; off < WARP_SIZE; off <<= 1) acc[g][e] += __shfl_xor_sync(FULL_MASK, acc[g][e], off);
        if (lane < TPP) {
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int e = 0; e < 16; ++e) red[warp][g * HD + thread_dim<HD>(lane, e)] = acc[g][e];
        }
    } else {
        // Tensor cores: O^T[d][h] = V^T[d][:] · P^T[:][h] as mma.m16n8k16 with A = 16 value
        // dimensions x 16 positions, B = the probabilities of the (up to 8) heads. Lane (gid, t4)
        // loads positions 2*t4, 2*t4 + 1, 2*t4 + 8, 2*t4 + 9 of a tile, HD / 8 dimensions of
        // each; word mt of them holds the dimensions (`value_word_dim`) of rows gid and gid + 8
        // of m-tile mt, which byte permutes pair up across positions.
        constexpr int MT = HD / 16;     // m-tiles (= 32-bit words of a lane's dimensions)
        constexpr int UT = 2;
        const int gid = lane >> 2, t4 = lane & 3;
        float acc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][e] = 0.f;
        const bf16* vq = v_cache + seq_base + gid * 8;
        for (int t0 = start + warp * 16; t0 < stop; t0 += ATT_WARPS * 16 * UT) {
            u32 vw[UT][4][MT];
#pragma unroll
            for (int u = 0; u < UT; ++u)
#pragma unroll
                for (int k4 = 0; k4 < 4; ++k4) {
                    const int p = t0 + u * ATT_WARPS * 16 + 2 * t4 + (k4 & 1) + 8 * (k4 >> 1);
#pragma unroll
                    for (int v = 0; v < MT / 4; ++v) {
                        const uint4 x = p < stop ? ld_stream(vq + (size_t)p * HD + 64 * v) : make_uint4(0, 0, 0, 0);
                        vw[u][k4][4 * v] = x.x;
                        vw[u][k4][4 * v + 1] = x.y;
                        vw[u][k4][4 * v + 2] = x.z;
                        vw[u][k4][4 * v + 3] = x.w;
                    }
                }
#pragma unroll
            for (int u = 0; u < UT; ++u) {
                float pv[4];
#pragma unroll
                for (int k4 = 0; k4 < 4; ++k4) {
                    const int p = t0 + u * ATT_WARPS * 16 + 2 * t4 + (k4 & 1) + 8 * (k4 >> 1);
                    pv[k4] = (gid < G && p < stop) ? scores[gid * chunk + (p - start)] : 0.f;
                }
                const u32 b0 = pack_bf16x2(pv[0], pv[1]);
                const u32 b1 = pack_bf16x2(pv[2], pv[3]);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const u32 a0 = __byte_perm(vw[u][0][mt], vw[u][1][mt], 0x5410);
                    const u32 a1 = __byte_perm(vw[u][0][mt], vw[u][1][mt], 0x7632);
                    const u32 a2 = __byte_perm(vw[u][2][mt], vw[u][3][mt], 0x5410);
                    const u32 a3 = __byte_perm(vw[u][2][mt], vw[u][3][mt], 0x7632);
                    mma_bf16_16816(acc[mt], a0, a1, a2, a3, b0, b1);
                }
            }
        }
        // c0: (dim value_word_dim(gid, mt), head 2*t4), c1: head 2*t4 + 1; c2, c3: dim + 1.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int head = 2 * t4 + (e & 1);
                const int dim = value_word_dim(gid, mt) + (e >> 1);
                if (head < G) {
                    float o = acc[mt][e];
                    // The new token's value is not in the cache reads: warp 0 adds it.
                    if (owns_pos && warp == 0) o = fmaf(scores[head * chunk + (pos - start)], vnew_s[dim], o);
                    red[warp][head * HD + dim] = o;
                }
            }
        }
    }
    __syncthreads();

    const size_t pair = (size_t)b * n_kv_heads + kvh;
    bf16* out_row = out + (size_t)b * n_heads * HD + (size_t)kvh * G * HD;
    constexpr int OPT = (G * HD + ATT_THREADS - 1) / ATT_THREADS;  // outputs per thread
    if (splits == 1) {
        for (int i = tid; i < G * HD; i += ATT_THREADS) {
            float o = 0.f;
#pragma unroll
            for (int w2 = 0; w2 < ATT_WARPS; ++w2) o += red[w2][i];
            out_row[i] = f32_to_bf16(o / l_s[i / HD]);
        }
        return;
    }

    if (cluster_merge) {
        // The splits of this (sequence, KV head) form one cluster (rank = split): each block
        // leaves its partial output in its own shared memory (red[0]) and, after a cluster
        // barrier, merges a slice of the outputs from all of them. No global round trips,
        // fences or atomics, and the merge is spread over the splits.
        float o[OPT];
#pragma unroll
        for (int k = 0; k < OPT; ++k) {
            const int i = tid + k * ATT_THREADS;
            o[k] = 0.f;
            if (i < G * HD) {
#pragma unroll
                for (int w2 = 0; w2 < ATT_WARPS; ++w2) o[k] += red[w2][i];
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < OPT; ++k) {
            const int i = tid + k * ATT_THREADS;
            if (i < G * HD) red[0][i] = o[k];
        }
        cluster_sync();
        const int slice = (G * HD + splits - 1) / splits;
        for (int j = tid; j < slice; j += ATT_THREADS) {
            const int i = split * slice + j;
            if (i >= G * HD) break;
            const int g = i / HD;
            constexpr int MAX_RANKS = 16;
            float m[MAX_RANKS], l[MAX_RANKS], p[MAX_RANKS];
#pragma unroll
            for (int r = 0; r < MAX_RANKS; ++r) {
                if (r < splits) {
                    m[r] = ld_cluster(&m_s[g], r);
                    l[r] = ld_cluster(&l_s[g], r);
                    p[r] = ld_cluster(&red[0][i], r);
                }
            }
            float mx = NEG_INF;
#pragma unroll
            for (int r = 0; r < MAX_RANKS; ++r)
                if (r < splits) mx = fmaxf(mx, m[r]);
            float num = 0.f, den = 0.f;
#pragma unroll
            for (int r = 0; r < MAX_RANKS; ++r) {
                if (r < splits) {
                    const float w = exp2f(m[r] - mx);
                    num = fmaf(w, p[r], num);
                    den = fmaf(w, l[r], den);
                }
            }
            out_row[i] = f32_to_bf16(num / den);
        }
        // Every block's shared memory must outlive the other blocks' reads of it.
        cluster_sync();
        return;
    }

    float* my_o = part_o + (pair * splits + split) * G * HD;
    for (int i = tid; i < G * HD; i += ATT_THREADS) {
        float o = 0.f;
#pragma unroll
        for (int w2 = 0; w2 < ATT_WARPS; ++w2) o += red[w2][i];
        my_o[i] = o;
    }
    if (tid < G) {
        float* ml = part_ml + ((pair * splits + split) * G + tid) * 2;
        ml[0] = m_s[tid];
        ml[1] = l_s[tid];
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(counters + pair, 1u) == (u32)(splits - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    // Merge: split s of head g weighs 2^(m_s - M). Partials come from other blocks of this
    // grid, so they are read through L2 (`__ldcg`), never from a possibly stale L1. The
    // statistics are requested first, then the partial outputs of the first SB splits (each
    // thread has OPT outputs), all before any is used, so that the reads overlap: one L2 round
    // trip per SB splits rather than one per split.
    constexpr int SB = OPT > 4 ? 8 : 16;
    float* split_w = scores;                 // [G][splits]: maxima, then weights
    float* split_l = scores + G * splits;    // [G][splits]
    for (int i = tid; i < G * splits; i += ATT_THREADS) {
        const int g = i / splits, s = i - g * splits;
        const float* ml = part_ml + ((pair * splits + s) * G + g) * 2;
        split_w[i] = __ldcg(ml);
        split_l[i] = __ldcg(ml + 1);
    }
    const float* po = part_o + pair * splits * G * HD;
    float pv[SB][OPT];
    load_partials<G * HD>(pv, po, 0, splits, tid);
    __syncthreads();
    // A warp per head: the maximum over its splits, each split's weight, the merged denominator.
    for (int g = warp; g < G; g += ATT_WARPS) {
        float total;
        warp_exp2_from_max<true>(split_w + g * splits, splits, split_l + g * splits, total);
        if (lane == 0) m_s[g] = total;  // the merged denominator
    }
    __syncthreads();
    float o[OPT];
#pragma unroll
    for (int k = 0; k < OPT; ++k) o[k] = 0.f;
    for (int s0 = 0; s0 < splits; s0 += SB) {
        if (s0 > 0) load_partials<G * HD>(pv, po, s0, splits, tid);
#pragma unroll
        for (int sb = 0; sb < SB; ++sb)
#pragma unroll
            for (int k = 0; k < OPT; ++k) {
                const int i = tid + k * ATT_THREADS;
                if (s0 + sb < splits && i < G * HD)
                    o[k] = fmaf(split_w[(i / HD) * splits + s0 + sb], pv[sb][k], o[k]);
            }
    }
#pragma unroll
    for (int k = 0; k < OPT; ++k) {
        const int i = tid + k * ATT_THREADS;
        if (i < G * HD) out_row[i] = f32_to_bf16(o[k] / m_s[i / HD]);
    }
    if (tid == 0) counters[pair] = 0u;
}

#define ATTENTION_KERNEL(HD_, G_, UK_, UV_)                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                     \
        attention_hd##HD_##_g##G_##_k##UK_##_v##UV_(                                              \
        const bf16* __restrict__ qkv, int ld_qkv, int n_heads, int n_kv_heads, bf16* k_cache,      \
        bf16* v_cache, int ctx, int pos, int chunk, int splits, bf16* __restrict__ out,            \
        float* __restrict__ part_o, float* __restrict__ part_ml, u32* __restrict__ counters,      \
        float q_scale, float log2_theta, const bf16* __restrict__ x, int hidden, float eps,      \
        int cluster_merge) {                                                                      \
        attention_impl<HD_, G_, UK_, UV_>(qkv, ld_qkv, n_heads, n_kv_heads, k_cache, v_cache, ctx, pos,  \
                                    chunk, splits, out, part_o, part_ml, counters, q_scale,       \
                                    log2_theta, x, hidden, eps, cluster_merge);                   \
    }

// Per group size, each pass on CUDA cores with U iterations of loads in flight (4, or 2 for 8
// heads) or on tensor cores (0): both on CUDA cores, both on tensor cores, and scores on tensor
// cores with values on CUDA cores. The engine times them and keeps the fastest.
#define ATTENTION_PAIRINGS(HD_, G_, U_) \
    ATTENTION_KERNEL(HD_, G_, U_, U_)   \
    ATTENTION_KERNEL(HD_, G_, 0, 0)     \
    ATTENTION_KERNEL(HD_, G_, 0, U_)
#define ATTENTION_KERNELS(HD_)       \
    ATTENTION_PAIRINGS(HD_, 1, 4)    \
    ATTENTION_PAIRINGS(HD_, 2, 4)    \
    ATTENTION_PAIRINGS(HD_, 3, 4)    \
    ATTENTION_PAIRINGS(HD_, 4, 4)    \
    ATTENTION_PAIRINGS(HD_, 8, 2)

ATTENTION_KERNELS(64)
ATTENTION_KERNELS(128)

// ---------------------------------------------------------------------------------------------
// Prefill: chunks of prompt tokens, one per sequence, processed as rows of one matrix.
//
// A chunk is described by four ints (`PREFILL_DESC`): `row0`, the chunk's first row in the
// activations; `len`, its tokens; `start`, the position of its first token (the prefix already
// in the cache: 0 for a whole prompt); `slot`, the sequence's KV cache slot. Its tokens sit at
// positions [start, start + len) and attend causally to positions [0, start + len).
// ---------------------------------------------------------------------------------------------

#define PREFILL_DESC 4

// RoPE on the chunk's query heads in place, and its keys (rotated) and values into the cache
// at their positions. grid = (longest chunk, chunks), block = 128.
extern "C" __global__ void prefill_rope_kv(bf16* __restrict__ qkv, int ld_qkv, int n_heads,
                                           int n_kv_heads, int head_dim,
                                           const int* __restrict__ chunks,
                                           bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                           int ctx, float log2_theta) {
    const int* d = chunks + PREFILL_DESC * blockIdx.y;
    const int local = blockIdx.x;
    if (local >= d[1]) return;
    const int pos = d[2] + local;
    const size_t slot = (size_t)d[3];
    bf16* row = qkv + (size_t)(d[0] + local) * ld_qkv;
    const int half = head_dim / 2;
    for (int p = threadIdx.x; p < n_heads * half; p += blockDim.x) {
        const int head = p / half;
        const int i = p - head * half;
        bf16* h = row + head * head_dim;
        float s, c;
        rope_sincos(pos, i, head_dim, log2_theta, &s, &c);
        const float x1 = bf16_to_f32(h[i]);
        const float x2 = bf16_to_f32(h[i + half]);
        h[i] = f32_to_bf16(x1 * c - x2 * s);
        h[i + half] = f32_to_bf16(x2 * c + x1 * s);
    }
    for (int p = threadIdx.x; p < n_kv_heads * half; p += blockDim.x) {
        const int kvh = p / half;
        const int i = p - kvh * half;
        const bf16* k = row + (n_heads + kvh) * head_dim;
        bf16* dst = k_cache + ((slot * n_kv_heads + kvh) * (size_t)ctx + pos) * head_dim;
        float s, c;
        rope_sincos(pos, i, head_dim, log2_theta, &s, &c);
        const float x1 = bf16_to_f32(k[i]);
        const float x2 = bf16_to_f32(k[i + half]);
        dst[i] = f32_to_bf16(x1 * c - x2 * s);
        dst[i + half] = f32_to_bf16(x2 * c + x1 * s);
    }
    const bf16* v = row + (n_heads + n_kv_heads) * head_dim;
    for (int p = threadIdx.x; p < n_kv_heads * head_dim; p += blockDim.x) {
        const int kvh = p / head_dim;
        const int e = p - kvh * head_dim;
        v_cache[((slot * n_kv_heads + kvh) * (size_t)ctx + pos) * head_dim + e] = v[p];
    }
}

// dst[i] = src[rows[i]] for `n` rows of `width` bf16 (the last token of each chunk that ends
// its prompt, for the output head). grid = n, block = 256.
extern "C" __global__ void gather_rows(const bf16* __restrict__ src, const int* __restrict__ rows,
                                       bf16* __restrict__ dst, int width) {
    const uint4* s = (const uint4*)(src + (size_t)rows[blockIdx.x] * width);
    uint4* o = (uint4*)(dst + (size_t)blockIdx.x * width);
    for (int i = threadIdx.x; i < width / 8; i += blockDim.x) o[i] = s[i];
}

// rows_tokens[pairs[2i]] = slot_tokens[pairs[2i + 1]]: a decoding sequence's row takes the
// token its slot generated last. grid = 1, block = 256.
extern "C" __global__ void slot_tokens_in(const u32* __restrict__ slot_tokens,
                                          const int* __restrict__ pairs, int n,
                                          u32* __restrict__ rows_tokens) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        rows_tokens[pairs[2 * i]] = slot_tokens[pairs[2 * i + 1]];
}

// tokens[slots[i]] = next[i]: each finished prompt's first generated token becomes its
// sequence's next decode input. grid = 1, block = 256.
extern "C" __global__ void scatter_tokens(const u32* __restrict__ next, const int* __restrict__ slots,
                                          int n, u32* __restrict__ tokens) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) tokens[slots[i]] = next[i];
}

// ---- causal attention over a chunk, flash-attention style -----------------------------------
//
// One block of 4 warps per (query tile, query head, chunk); each warp owns MT row tiles of 16
// query rows (a query tile is 64 * MT rows). Keys and values stream through shared memory in
// tiles of BN positions, double-buffered with cp.async; scores and P·V on tensor cores
// (mma.m16n8k16, bf16 in, fp32 accumulate), the softmax online in base 2. With MT = 2 each
// key or value fragment read from shared memory feeds two row tiles. Shared tiles are
// row-major with 16-byte chunks XOR-swizzled by the row (chunk c of row r at c ^ (r & 7)), so
// that ldmatrix's eight row reads hit distinct banks.
//
// The grid puts the query heads on x and the query tiles, last first, on y: the tiles with the
// most keys (the last ones) of every head start first, and the heads sharing a KV head run
// side by side and share its tiles in L2.

#define FA_THREADS 128

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes global -> shared, asynchronously; `src_bytes` 0 fills zeros (rows past the data).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// Byte offset of 16-byte chunk `c` of row `r` in a swizzled tile of HD-element rows.
template <int HD>
__device__ __forceinline__ u32 swizzled(int r, int c) {
    return (u32)(r * HD * 2 + ((c ^ (r & 7)) << 4));
}

// Copies `rows` rows (of HD elements, `stride` elements apart) starting at `src` into a
// swizzled tile at shared address `dst`; rows at or past `valid` are zero-filled.
template <int HD, int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const bf16* src, size_t stride, int valid) {
    constexpr int CH = HD / 8;
#pragma unroll
    for (int i = threadIdx.x; i < ROWS * CH; i += FA_THREADS) {
        const int r = i / CH, c = i - (i / CH) * CH;
        const bool in = r < valid;
        const bf16* s = src + (size_t)(in ? r : 0) * stride + c * 8;
        cp_async16(dst + swizzled<HD>(r, c), s, in ? 16 : 0);
    }
}

template <int HD, int MT, int BN>
__device__ __forceinline__ void flash_prefill_impl(
    const bf16* __restrict__ qkv, int ld_qkv, int n_heads, int n_kv_heads,
    const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache, int ctx,
    const int* __restrict__ chunks, bf16* __restrict__ out, int ld_out, float scale_log2) {
    constexpr int BM = 64 * MT;     // query rows per block
    constexpr int WR = 16 * MT;     // query rows per warp
    constexpr int KS = HD / 16;     // k-steps of 16 over the head dimension
    constexpr int DN = HD / 8;      // n-tiles of 8 over the head dimension (P·V)
    constexpr int SN = BN / 8;      // n-tiles of 8 over a key tile (scores)
    constexpr int TILE_BYTES = BN * HD * 2;
    extern __shared__ __align__(128) unsigned char fa_smem[];
    const u32 q_s = shared_address(fa_smem);
    const u32 k_s = q_s + BM * HD * 2;         // two buffers
    const u32 v_s = k_s + 2 * TILE_BYTES;      // two buffers

    const int* d = chunks + PREFILL_DESC * blockIdx.z;
    const int len = d[1];
    const int n_q_tiles = (len + BM - 1) / BM;
    const int q_tile = n_q_tiles - 1 - (int)blockIdx.y;
    if (q_tile < 0) return;
    const int row0 = d[0], start = d[2];
    const size_t slot = (size_t)d[3];
    const int h = blockIdx.x;
    const int kvh = h / (n_heads / n_kv_heads);
    const int q0 = q_tile * BM;                        // the tile's first row within the chunk
    const int q_rows = min(BM, len - q0);
    const int kv_len = start + q0 + q_rows;            // keys the tile's last row sees
    const int n_kv = (kv_len + BN - 1) / BN;
    const bf16* k_base = k_cache + (slot * n_kv_heads + kvh) * (size_t)ctx * HD;
    const bf16* v_base = v_cache + (slot * n_kv_heads + kvh) * (size_t)ctx * HD;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, t4 = lane & 3;

    load_tile<HD, BM>(q_s, qkv + (size_t)(row0 + q0) * ld_qkv + h * HD, ld_qkv, q_rows);
    load_tile<HD, BN>(k_s, k_base, HD, kv_len);
    load_tile<HD, BN>(v_s, v_base, HD, kv_len);
    cp_async_commit();

    float o[MT][DN][4];
    float m_run[MT][2], l_run[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < DN; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
        m_run[mt][0] = m_run[mt][1] = NEG_INF;
        l_run[mt][0] = l_run[mt][1] = 0.f;
    }
    // The warp's first row's position; row tile mt's rows are at + 16 * mt + gid (+ 8).
    const int warp_first_pos = start + q0 + warp * WR;

    for (int j = 0; j < n_kv; ++j) {
        if (j + 1 < n_kv) {
            const int next = (j + 1) * BN;
            const u32 buf = ((j + 1) & 1) * TILE_BYTES;
            load_tile<HD, BN>(k_s + buf, k_base + (size_t)next * HD, HD, kv_len - next);
            load_tile<HD, BN>(v_s + buf, v_base + (size_t)next * HD, HD, kv_len - next);
        }
        cp_async_commit();
        cp_async_wait_one();
        __syncthreads();
        const int key0 = j * BN;
        // A warp whose rows all precede this tile has nothing to add (causal), nor one whose
        // rows are all past the chunk (a decode row's tile has one row).
        if (key0 <= warp_first_pos + WR - 1 && warp * WR < q_rows) {
            const u32 kt = k_s + (j & 1) * TILE_BYTES;
            const u32 vt = v_s + (j & 1) * TILE_BYTES;
            float s[MT][SN][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < SN; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KS; kk += 2) {
                // The query fragments of two k-steps for each row tile.
                u32 qa[MT][2][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int step = 0; step < 2; ++step) {
                        const int mat = lane >> 3;
                        const int r = warp * WR + mt * 16 + (lane & 7) + (mat & 1) * 8;
                        ldmatrix_x4(qa[mt][step][0], qa[mt][step][1], qa[mt][step][2], qa[mt][step][3],
                                    q_s + swizzled<HD>(r, (kk + step) * 2 + (mat >> 1)));
                    }
#pragma unroll
                for (int n = 0; n < SN; ++n) {
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4(b0, b1, b2, b3, kt + swizzled<HD>(n * 8 + (lane & 7), kk * 2 + (lane >> 3)));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_bf16_16816(s[mt][n], qa[mt][0][0], qa[mt][0][1], qa[mt][0][2], qa[mt][0][3], b0, b1);
                        mma_bf16_16816(s[mt][n], qa[mt][1][0], qa[mt][1][1], qa[mt][1][2], qa[mt][1][3], b2, b3);
                    }
                }
            }
            // Mask keys after each row's position (only near the diagonal), then the online
            // softmax: each row's running max and sum (the sum kept per thread, summed over
            // the row's four threads at the end), in base 2 with the scale folded in.
            const bool diagonal = key0 + BN - 1 > warp_first_pos;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int qp = warp_first_pos + mt * 16 + gid + 8 * r;
                    float mx = NEG_INF;
#pragma unroll
                    for (int n = 0; n < SN; ++n) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int key = key0 + n * 8 + t4 * 2 + e;
                            if (diagonal && key > qp) s[mt][n][2 * r + e] = NEG_INF;
                            mx = fmaxf(mx, s[mt][n][2 * r + e]);
                        }
                    }
                    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
                    const float m_new = fmaxf(m_run[mt][r], mx * scale_log2);
                    // A row with every key masked so far keeps max -inf: subtract 0, not -inf.
                    const float m_use = m_new == NEG_INF ? 0.f : m_new;
                    const float alpha = exp2f(m_run[mt][r] - m_use);
                    float sum = 0.f;
#pragma unroll
                    for (int n = 0; n < SN; ++n) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float p = exp2f(fmaf(s[mt][n][2 * r + e], scale_log2, -m_use));
                            s[mt][n][2 * r + e] = p;
                            sum += p;
                        }
                    }
                    l_run[mt][r] = l_run[mt][r] * alpha + sum;
                    m_run[mt][r] = m_new;
#pragma unroll
                    for (int n = 0; n < DN; ++n) {
                        o[mt][n][2 * r] *= alpha;
                        o[mt][n][2 * r + 1] *= alpha;
                    }
                }
            }
            // O += P·V: the score accumulators are already in the A-operand layout.
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                u32 pa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    pa[mt][0] = pack_bf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                    pa[mt][1] = pack_bf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                    pa[mt][2] = pack_bf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                    pa[mt][3] = pack_bf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                }
#pragma unroll
                for (int n = 0; n < DN; n += 2) {
                    const int mat = lane >> 3;
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4_trans(b0, b1, b2, b3,
                                      vt + swizzled<HD>(kk * 16 + (mat & 1) * 8 + (lane & 7), n + (mat >> 1)));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_bf16_16816(o[mt][n], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], b0, b1);
                        mma_bf16_16816(o[mt][n + 1], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], b2, b3);
                    }
                }
            }
        }
        __syncthreads();  // the buffer just read is refilled two tiles on
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_run[mt][r];
            l += __shfl_xor_sync(FULL_MASK, l, 1);
            l += __shfl_xor_sync(FULL_MASK, l, 2);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const int local = q0 + warp * WR + mt * 16 + gid + 8 * r;
            if (local < len) {
                bf16* dst = out + (size_t)(row0 + local) * ld_out + h * HD + t4 * 2;
#pragma unroll
                for (int n = 0; n < DN; ++n)
                    *(u32*)(dst + n * 8) = pack_bf16x2(o[mt][n][2 * r] * inv, o[mt][n][2 * r + 1] * inv);
            }
        }
    }
}

// grid = (query heads, query tiles of the longest chunk, chunks), block = FA_THREADS, dynamic
// shared memory = (64 * MT + 4 * BN) * HD * 2 bytes. Named flash_prefill_hd{HD}_m{MT}_n{BN}.
#define FLASH_PREFILL(HD, MT, BN)                                                                  \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                       \
        flash_prefill_hd##HD##_m##MT##_n##BN(                                                      \
            const bf16* __restrict__ qkv, int ld_qkv, int n_heads, int n_kv_heads,                 \
            const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache, int ctx,           \
            const int* __restrict__ chunks, bf16* __restrict__ out, int ld_out, float scale_log2) { \
        flash_prefill_impl<HD, MT, BN>(qkv, ld_qkv, n_heads, n_kv_heads, k_cache, v_cache, ctx,    \
                                       chunks, out, ld_out, scale_log2);                           \
    }
FLASH_PREFILL(64, 1, 64)
FLASH_PREFILL(64, 2, 32)
FLASH_PREFILL(64, 2, 64)
FLASH_PREFILL(128, 1, 64)
FLASH_PREFILL(128, 2, 32)
FLASH_PREFILL(128, 2, 64)
