// Elementwise sum of up to four regions, left to right in f32, rounded once to the
// output dtype (one input: a conversion). Twin of shaders/reduce.wgsl.

struct CmmReduceInput {
    u64 base;
    u64 stride;
    u32 dtype;
    u32 pad;
};

extern "C" __global__ void cmm_reduce(u64 out, u64 out_stride, u32 out_dtype, u32 rows, u32 cols, u32 count,
                                      CmmReduceInput in0, CmmReduceInput in1, CmmReduceInput in2,
                                      CmmReduceInput in3) {
    u64 total = (u64)rows * cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / cols;
        u64 c = i % cols;
        float acc = cmm_load(in0.base, r * in0.stride + c, in0.dtype);
        if (count > 1u) acc = acc + cmm_load(in1.base, r * in1.stride + c, in1.dtype);
        if (count > 2u) acc = acc + cmm_load(in2.base, r * in2.stride + c, in2.dtype);
        if (count > 3u) acc = acc + cmm_load(in3.base, r * in3.stride + c, in3.dtype);
        cmm_store_bits(out, r * out_stride + c, out_dtype, cmm_encode(acc, out_dtype));
    }
}
