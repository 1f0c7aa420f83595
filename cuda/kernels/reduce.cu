// Elementwise sum of up to four regions (the plan model's limit), left to right in f32, rounded once to the
// output dtype (one input: a conversion). Twin of shaders/reduce.wgsl.
//
// Where every region allows it (its base and row stride aligned to four elements, the columns a multiple of
// four), each thread sums four consecutive elements of a row with one 16-byte (f32) or 8-byte (f16, bf16) load
// per input and one store: a GEMM+RS plan's reduces run beside persistent GEMMs on the few SMs those leave free,
// where the bytes each thread keeps in flight set the rate. The host sizes the grid for four elements a thread;
// the loops stride over the grid, so any grid covers every element. The sums are the same as one element a
// thread, bit for bit.

// Mirror: `ReduceInputs` in cuda/src/launch.rs; `count` of the four are used.
struct CmmReduceInputs {
    CmmTensor in[4];
};

// Four consecutive elements of a row, decoded to f32.
struct CmmQuad {
    float v[4];
};

// Whether a region's rows can be read four elements at a time from `base`, `stride` elements apart.
__device__ __forceinline__ bool cmm_quad_aligned(u64 base, u64 stride, u32 dtype) {
    const u64 bytes = dtype == 0u ? 16ull : 8ull;
    return base % bytes == 0ull && stride % 4ull == 0ull;
}

// Elements index .. index + 3 of a quad-aligned region.
__device__ __forceinline__ CmmQuad cmm_load_quad(u64 base, u64 index, u32 dtype) {
    CmmQuad q;
    if (dtype == 0u) {
        const CmmBits128 bits = *(const CmmBits128*)(base + 4ull * index);
#pragma unroll
        for (u32 e = 0u; e < 4u; ++e) q.v[e] = __uint_as_float(bits.w[e]);
    } else {
        const CmmBits64 bits = *(const CmmBits64*)(base + 2ull * index);
#pragma unroll
        for (u32 e = 0u; e < 4u; ++e) q.v[e] = cmm_decode((bits.w[e / 2u] >> (16u * (e % 2u))) & 0xffffu, dtype);
    }
    return q;
}

// Stores elements index .. index + 3 of a quad-aligned region, each rounded once.
__device__ __forceinline__ void cmm_store_quad(u64 base, u64 index, u32 dtype, const CmmQuad& q) {
    if (dtype == 0u) {
        CmmBits128 bits;
#pragma unroll
        for (u32 e = 0u; e < 4u; ++e) bits.w[e] = __float_as_uint(q.v[e]);
        *(CmmBits128*)(base + 4ull * index) = bits;
    } else {
        CmmBits64 bits;
#pragma unroll
        for (u32 h = 0u; h < 2u; ++h) {
            bits.w[h] = (cmm_encode(q.v[2u * h], dtype) & 0xffffu) | (cmm_encode(q.v[2u * h + 1u], dtype) << 16);
        }
        *(CmmBits64*)(base + 2ull * index) = bits;
    }
}

extern "C" __global__ void cmm_reduce(u64 out, u64 out_stride, u32 out_dtype, u32 rows, u32 cols, u32 count,
                                      CmmReduceInputs inputs) {
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, step = (u64)gridDim.x * blockDim.x;
    bool quads = cols % 4u == 0u && cmm_quad_aligned(out, out_stride, out_dtype);
#pragma unroll
    for (u32 j = 0u; j < 4u; ++j) {
        if (j < count) quads = quads && cmm_quad_aligned(inputs.in[j].base, inputs.in[j].stride, inputs.in[j].dtype);
    }
    if (quads) {
        const u32 quad_cols = cols / 4u;
        const u64 total = (u64)rows * quad_cols;
        for (u64 i = first; i < total; i += step) {
            u64 r, c;
            cmm_row_col(i, total, quad_cols, r, c);
            c *= 4u;
            CmmQuad acc = cmm_load_quad(inputs.in[0].base, r * inputs.in[0].stride + c, inputs.in[0].dtype);
#pragma unroll
            for (u32 j = 1u; j < 4u; ++j) {
                if (j < count) {
                    const CmmQuad x = cmm_load_quad(inputs.in[j].base, r * inputs.in[j].stride + c, inputs.in[j].dtype);
#pragma unroll
                    for (u32 e = 0u; e < 4u; ++e) acc.v[e] = acc.v[e] + x.v[e];
                }
            }
            cmm_store_quad(out, r * out_stride + c, out_dtype, acc);
        }
        return;
    }
    const u64 total = (u64)rows * cols;
    for (u64 i = first; i < total; i += step) {
        u64 r, c;
        cmm_row_col(i, total, cols, r, c);
        float acc = cmm_load(inputs.in[0].base, r * inputs.in[0].stride + c, inputs.in[0].dtype);
#pragma unroll
        for (u32 j = 1u; j < 4u; ++j) {
            if (j < count) acc = acc + cmm_load(inputs.in[j].base, r * inputs.in[j].stride + c, inputs.in[j].dtype);
        }
        cmm_store_bits(out, r * out_stride + c, out_dtype, cmm_encode(acc, out_dtype));
    }
}
