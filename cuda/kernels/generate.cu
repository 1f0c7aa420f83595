// The input generator (twin of cmm-core generator.rs and shaders/generate.wgsl) and
// the poison fill. One thread per element, grid-stride so any size fits one launch.

__device__ __forceinline__ u32 cmm_mix32(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

__device__ __forceinline__ u32 cmm_tensor_key(u32 seed, u32 tensor) {
    return cmm_mix32(cmm_mix32(seed ^ 0x5bd1e995u) ^ (tensor * 0x9e3779b9u));
}

__device__ __forceinline__ float cmm_raw_value(u32 key, u32 index, u32 family) {
    u32 h = cmm_mix32(key ^ index);
    if (family == 0u) {
        return (float)((int)(h % 5u) - 2);
    }
    u32 h2 = cmm_mix32(h ^ 0x85ebca6bu);
    u32 sum = (h & 0xffffu) + (h >> 16) + (h2 & 0xffffu) + (h2 >> 16);
    return (float)((int)sum - 131070) * (1.0f / 32768.0f);
}

// Fills a rows×cols buffer with the window of global tensor `tensor` at (row0, col0).
extern "C" __global__ void cmm_generate(u64 dst, u32 dtype, u32 rows, u32 cols, u32 seed, u32 tensor,
                                        u32 family, u32 global_cols, u32 row0, u32 col0) {
    u32 key = cmm_tensor_key(seed, tensor);
    u64 total = (u64)rows * cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u32 r = (u32)(i / cols);
        u32 c = (u32)(i % cols);
        u32 index = (row0 + r) * global_cols + col0 + c;
        cmm_store_bits(dst, i, dtype, cmm_encode(cmm_raw_value(key, index, family), dtype));
    }
}

// Writes `bits` into `count` elements (the poison pattern of scratch and outputs).
extern "C" __global__ void cmm_fill(u64 dst, u32 dtype, u64 count, u32 bits) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x) {
        cmm_store_bits(dst, i, dtype, bits);
    }
}
