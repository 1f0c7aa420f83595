// SM copy of a strided 2D region (TileLink's tile push): one thread per element,
// grid-stride. Source and destination may live on different (virtual or peer) devices;
// the host passes raw device addresses. Elements are copied as bits (no conversion).

extern "C" __global__ void cmm_copy2d(u64 src, u64 src_stride, u64 dst, u64 dst_stride, u32 rows, u32 cols,
                                      u32 elem_bytes) {
    u64 total = (u64)rows * cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / cols;
        u64 c = i % cols;
        if (elem_bytes == 4u) {
            ((u32*)dst)[r * dst_stride + c] = ((const u32*)src)[r * src_stride + c];
        } else {
            ((u16*)dst)[r * dst_stride + c] = ((const u16*)src)[r * src_stride + c];
        }
    }
}
