// Elementwise functions of `Op::Pointwise` (the MLP block's GeLU and its backward),
// evaluated in f32 and rounded once to the output dtype; grid-stride. Twin of
// shaders/pointwise.wgsl and `Pointwise::apply` (core/src/linear/gelu.rs), whose
// operation order this follows: clamp, u = c·(x + (k·x)·(x·x)), e = expf(2u),
// t = 1 − 2/(e + 1). NVRTC may contract a multiply and an add into an FMA; the
// oracle's error bound covers that (it only removes roundings).
//
// function 0: out = gelu(in0); function 1: out = in0 · gelu'(in1).

// Mirror: `PointwiseInputs` in cuda/src/launch.rs.
struct CmmPointwiseInputs {
    CmmTensor in[2];
};

#define CMM_GELU_C 0.7978846f
#define CMM_GELU_K 0.044715f
#define CMM_GELU_CLAMP 30.0f

// q = 2/(e + 1) = 1 − tanh(u); 1 + t written 2 − q, as the twin and the shader write it.
__device__ __forceinline__ float cmm_one_minus_tanh(float xc) {
    float inner = CMM_GELU_C * (xc + (CMM_GELU_K * xc) * (xc * xc));
    float e = expf(2.0f * inner);
    return 2.0f / (e + 1.0f);
}

__device__ __forceinline__ float cmm_gelu(float x) {
    float q = cmm_one_minus_tanh(fminf(fmaxf(x, -CMM_GELU_CLAMP), CMM_GELU_CLAMP));
    return 0.5f * x * (2.0f - q);
}

__device__ __forceinline__ float cmm_gelu_grad(float x) {
    float xc = fminf(fmaxf(x, -CMM_GELU_CLAMP), CMM_GELU_CLAMP);
    float q = cmm_one_minus_tanh(xc);
    float t = 1.0f - q;
    float s = 1.0f - t * t;
    return 0.5f * (2.0f - q) + xc * (0.5f * CMM_GELU_C) * s * (1.0f + 3.0f * CMM_GELU_K * xc * xc);
}

extern "C" __global__ void cmm_pointwise(u64 out, u64 out_stride, u32 out_dtype, u32 rows, u32 cols, u32 function,
                                         CmmPointwiseInputs inputs) {
    u64 total = (u64)rows * cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / cols;
        u64 c = i % cols;
        float x0 = cmm_load(inputs.in[0].base, r * inputs.in[0].stride + c, inputs.in[0].dtype);
        float v;
        if (function == 0u) {
            v = cmm_gelu(x0);
        } else {
            float x1 = cmm_load(inputs.in[1].base, r * inputs.in[1].stride + c, inputs.in[1].dtype);
            v = x0 * cmm_gelu_grad(x1);
        }
        cmm_store_bits(out, r * out_stride + c, out_dtype, cmm_encode(v, out_dtype));
    }
}
