// SM copy of a strided 2D region (TileLink's tile push): grid-stride. Source and destination may live on
// different (virtual or peer) devices; the host passes raw device addresses. Elements are copied as bits (no
// conversion). Where both regions allow it (bases, row strides and the row's bytes multiples of 16), each thread
// copies 16 bytes with one load and one store, so that a copy on a few SMs keeps enough bytes in flight; else
// one element a thread. The host sizes the grid for 16 bytes a thread; any grid covers every element.

extern "C" __global__ void cmm_copy2d(u64 src, u64 src_stride, u64 dst, u64 dst_stride, u32 rows, u32 cols,
                                      u32 elem_bytes) {
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, step = (u64)gridDim.x * blockDim.x;
    const u64 row_bytes = (u64)cols * elem_bytes, src_pitch = src_stride * elem_bytes,
              dst_pitch = dst_stride * elem_bytes;
    if (((src | dst | src_pitch | dst_pitch | row_bytes) & 15ull) == 0ull && row_bytes / 16ull <= 0xffffffffull) {
        const u32 chunks = (u32)(row_bytes / 16ull);
        const u64 total = (u64)rows * chunks;
        for (u64 i = first; i < total; i += step) {
            u64 r, c;
            cmm_row_col(i, total, chunks, r, c);
            *(CmmBits128*)(dst + r * dst_pitch + 16ull * c) = *(const CmmBits128*)(src + r * src_pitch + 16ull * c);
        }
        return;
    }
    const u64 total = (u64)rows * cols;
    for (u64 i = first; i < total; i += step) {
        u64 r, c;
        cmm_row_col(i, total, cols, r, c);
        if (elem_bytes == 4u) {
            ((u32*)dst)[r * dst_stride + c] = ((const u32*)src)[r * src_stride + c];
        } else {
            ((u16*)dst)[r * dst_stride + c] = ((const u16*)src)[r * src_stride + c];
        }
    }
}
