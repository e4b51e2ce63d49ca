// Experiment: a batch <= 8 matrix-vector product fed by bulk tensor copies (TMA) into 128-byte
// swizzled shared-memory tiles and consumed by wgmma (weight rows as M = 64, batch padded to
// N = 8). Stream-K: the (row block, k tile) space is cut into equal contiguous ranges, one per
// block; partial sums leave by fp32 atomics. Needs sm_90a.

typedef unsigned int u32;
typedef unsigned long long u64;

struct __align__(64) TensorMap { u64 opaque[16]; };

#define TILE_K 64
#define TILE_M 64
#define A_TILE_BYTES (TILE_M * TILE_K * 2)
#define B_TILE_BYTES (8 * TILE_K * 2)

__device__ __forceinline__ u32 shared_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int c0, int c1,
                                            u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"((u64)map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// A shared-memory matrix descriptor for a K-major tile in the 128-byte swizzle layout: rows of
// 128 bytes, 8-row groups 1024 bytes apart.
__device__ __forceinline__ u64 sw128_desc(u32 addr) {
    u64 d = (u64)((addr & 0x3FFFF) >> 4);
    d |= (u64)1 << 16;
    d |= (u64)(1024 >> 4) << 32;
    d |= (u64)1 << 62;
    return d;
}

__device__ __forceinline__ void wgmma_m64n8k16(float (&d)[4], u64 a, u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, "
        "0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(a), "l"(b), "r"(1));
}


__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Warp-specialised: warps 0-3 (one warpgroup) multiply, warp 4 issues the copies. A stage holds
// BOXES consecutive 64-wide k tiles of the same 64 rows (BOXES * 9 KiB).
template <int STAGES, int BOXES, int COMPUTE>
__device__ __forceinline__ void wgmma_ws(const TensorMap* wmap, const TensorMap* xmap,
                                         float* __restrict__ y, int rows, int k_tiles,
                                         int batch) {
    extern __shared__ unsigned char smem_raw[];
    const u32 base = (shared_addr(smem_raw) + 1023u) & ~1023u;
    const u32 a_base = base;
    const u32 b_base = base + STAGES * BOXES * A_TILE_BYTES;
    const u32 full_base = b_base + STAGES * BOXES * B_TILE_BYTES;
    const u32 empty_base = full_base + 8 * STAGES;
    const int tid = threadIdx.x;
    const int groups = k_tiles / BOXES;  // stages per row block
    const long long total = (long long)(rows / TILE_M) * groups;
    const long long begin = total * blockIdx.x / gridDim.x;
    const long long end = total * (blockIdx.x + 1) / gridDim.x;
    const int n = (int)(end - begin);
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_base + 8 * s, 1);
            mbar_init(empty_base + 8 * s, 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int warp = tid / 32, lane = tid % 32;
    if (warp == 4) {
        if (lane == 0) {
            for (int i = 0; i < n; ++i) {
                const int s = i % STAGES;
                if (i >= STAGES) mbar_wait(empty_base + 8 * s, (u32)(i / STAGES - 1) & 1u);
                const long long t = begin + i;
                const int rb = (int)(t / groups);
                const int kt = (int)(t % groups) * BOXES;
                const u32 bar = full_base + 8 * s;
                mbar_expect(bar, BOXES * (A_TILE_BYTES + B_TILE_BYTES));
#pragma unroll
                for (int b = 0; b < BOXES; ++b) {
                    tma_load_2d(a_base + (s * BOXES + b) * A_TILE_BYTES, wmap, (kt + b) * TILE_K,
                                rb * TILE_M, bar);
                    tma_load_2d(b_base + (s * BOXES + b) * B_TILE_BYTES, xmap, (kt + b) * TILE_K,
                                0, bar);
                }
            }
        }
        return;
    }
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < n; ++i) {
        const int s = i % STAGES;
        mbar_wait(full_base + 8 * s, (u32)(i / STAGES) & 1u);
        if (COMPUTE) {
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int b = 0; b < BOXES; ++b)
#pragma unroll
                for (int j = 0; j < TILE_K / 16; ++j)
                    wgmma_m64n8k16(d, sw128_desc(a_base + (s * BOXES + b) * A_TILE_BYTES + 32 * j),
                                   sw128_desc(b_base + (s * BOXES + b) * B_TILE_BYTES + 32 * j));
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_base + 8 * s);
        const long long t = begin + i;
        if ((int)(t % groups) == groups - 1 || i == n - 1) {
            asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])::"memory");
            const int row = (int)(t / groups) * TILE_M + warp * 16 + lane / 4;
            const int col = (lane % 4) * 2;
            if (col < batch) {
                atomicAdd(&y[(long long)col * rows + row], d[0]);
                atomicAdd(&y[(long long)col * rows + row + 8], d[2]);
            }
            if (col + 1 < batch) {
                atomicAdd(&y[(long long)(col + 1) * rows + row], d[1]);
                atomicAdd(&y[(long long)(col + 1) * rows + row + 8], d[3]);
            }
            d[0] = d[1] = d[2] = d[3] = 0.f;
        }
    }
}

#define WGMMA_WS(STAGES, BOXES, COMPUTE)                                                        \
    extern "C" __global__ void __launch_bounds__(160) wgmma_ws_s##STAGES##_b##BOXES##_c##COMPUTE( \
        const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap,        \
        float* __restrict__ y, int rows, int k_tiles, int batch) {                              \
        wgmma_ws<STAGES, BOXES, COMPUTE>(&wmap, &xmap, y, rows, k_tiles, batch);                \
    }

template <int STAGES, int PIPE, int COMPUTE>
__device__ __forceinline__ void wgmma_gemv(const TensorMap* wmap, const TensorMap* xmap,
                                           float* __restrict__ y, int rows, int k_tiles,
                                           int batch) {
    extern __shared__ unsigned char smem_raw[];
    const u32 base = (shared_addr(smem_raw) + 1023u) & ~1023u;
    const u32 a_base = base;
    const u32 b_base = base + STAGES * A_TILE_BYTES;
    const u32 bar_base = b_base + STAGES * B_TILE_BYTES;
    const int tid = threadIdx.x;

    const long long total = (long long)(rows / TILE_M) * k_tiles;
    const long long begin = total * blockIdx.x / gridDim.x;
    const long long end = total * (blockIdx.x + 1) / gridDim.x;
    const int n = (int)(end - begin);

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(bar_base + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    auto issue = [&](int s, long long t) {
        const int rb = (int)(t / k_tiles);
        const int kt = (int)(t % k_tiles);
        const u32 bar = bar_base + 8 * s;
        mbar_expect(bar, A_TILE_BYTES + B_TILE_BYTES);
        tma_load_2d(a_base + s * A_TILE_BYTES, wmap, kt * TILE_K, rb * TILE_M, bar);
        tma_load_2d(b_base + s * B_TILE_BYTES, xmap, kt * TILE_K, 0, bar);
    };
    if (tid == 0) {
        for (int s = 0; s < STAGES && s < n; ++s) issue(s, begin + s);
    }

    float d[4] = {0.f, 0.f, 0.f, 0.f};
    const int warp = tid / 32, lane = tid % 32;
    for (int i = 0; i < n; ++i) {
        const int s = i % STAGES;
        mbar_wait(bar_base + 8 * s, (u32)(i / STAGES) & 1u);
        if (COMPUTE) {
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int j = 0; j < TILE_K / 16; ++j) {
                wgmma_m64n8k16(d, sw128_desc(a_base + s * A_TILE_BYTES + 32 * j),
                               sw128_desc(b_base + s * B_TILE_BYTES + 32 * j));
            }
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            if (PIPE) {
                asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            } else {
                asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            }
        }
        // The stage whose reads are known complete: the previous one when one product group
        // stays in flight.
        const int done = PIPE && COMPUTE ? i - 1 : i;
        if (done >= 0) {
            __syncthreads();
            if (tid == 0 && done + STAGES < n) issue(done % STAGES, begin + done + STAGES);
        }
        const long long t = begin + i;
        if ((int)(t % k_tiles) == k_tiles - 1 || i == n - 1) {
            if (COMPUTE) asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])::"memory");
            const int row = (int)(t / k_tiles) * TILE_M + warp * 16 + lane / 4;
            const int col = (lane % 4) * 2;
            if (col < batch) {
                atomicAdd(&y[(long long)col * rows + row], d[0]);
                atomicAdd(&y[(long long)col * rows + row + 8], d[2]);
            }
            if (col + 1 < batch) {
                atomicAdd(&y[(long long)(col + 1) * rows + row], d[1]);
                atomicAdd(&y[(long long)(col + 1) * rows + row + 8], d[3]);
            }
            d[0] = d[1] = d[2] = d[3] = 0.f;
        }
    }
}

#define WGMMA_GEMV(STAGES, PIPE, COMPUTE)                                                       \
    extern "C" __global__ void __launch_bounds__(128) wgmma_gemv_s##STAGES##_p##PIPE##_c##COMPUTE( \
        const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap,        \
        float* __restrict__ y, int rows, int k_tiles, int batch) {                              \
        wgmma_gemv<STAGES, PIPE, COMPUTE>(&wmap, &xmap, y, rows, k_tiles, batch);               \
    }

WGMMA_GEMV(4, 0, 1)
WGMMA_GEMV(4, 1, 1)
WGMMA_GEMV(6, 1, 1)
WGMMA_GEMV(8, 0, 1)
WGMMA_GEMV(8, 1, 1)
WGMMA_GEMV(4, 0, 0)
WGMMA_GEMV(8, 0, 0)

WGMMA_WS(16, 1, 1)
WGMMA_WS(8, 2, 1)
WGMMA_WS(4, 4, 1)
WGMMA_WS(2, 4, 1)
WGMMA_WS(6, 4, 1)
WGMMA_WS(8, 1, 1)
WGMMA_WS(4, 1, 1)
WGMMA_WS(16, 1, 0)
WGMMA_WS(4, 4, 0)
