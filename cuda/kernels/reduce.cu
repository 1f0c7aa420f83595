// Elementwise sum of up to four regions (the plan model's limit), left to right in f32, rounded once to the
// output dtype (one input: a conversion). Twin of shaders/reduce.wgsl.

// Mirror: `ReduceInputs` in cuda/src/launch.rs; `count` of the four are used.
struct CmmReduceInputs {
    CmmTensor in[4];
};

extern "C" __global__ void cmm_reduce(u64 out, u64 out_stride, u32 out_dtype, u32 rows, u32 cols, u32 count,
                                      CmmReduceInputs inputs) {
    u64 total = (u64)rows * cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / cols;
        u64 c = i % cols;
        float acc = cmm_load(inputs.in[0].base, r * inputs.in[0].stride + c, inputs.in[0].dtype);
#pragma unroll
        for (u32 j = 1u; j < 4u; ++j) {
            if (j < count) acc = acc + cmm_load(inputs.in[j].base, r * inputs.in[j].stride + c, inputs.in[j].dtype);
        }
        cmm_store_bits(out, r * out_stride + c, out_dtype, cmm_encode(acc, out_dtype));
    }
}
