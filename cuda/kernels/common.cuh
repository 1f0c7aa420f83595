// Shared device helpers, prepended to every kernel file by the host (NVRTC needs no
// include path). CPU twins: cmm-core `dtype.rs` and `generator.rs`; WGSL twins:
// shaders/numeric.wgsl and shaders/generate.wgsl. Integer algorithms only, so the bits
// match the Rust and WGSL versions exactly. Dtype codes: 0 = f32, 1 = f16, 2 = bf16.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ float cmm_f16_bits_to_f32(u32 h) {
    u32 sign = (h & 0x8000u) << 16;
    u32 e = (h >> 10) & 0x1fu;
    u32 mant = h & 0x3ffu;
    if (e == 0u) {
        float v = (float)mant * __uint_as_float(0x33800000u); // mant * 2^-24, exact
        return __uint_as_float(sign | __float_as_uint(v));
    }
    if (e == 31u) {
        return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (mant << 13));
}

__device__ __forceinline__ u32 cmm_f32_to_f16_bits(float x) {
    u32 b = __float_as_uint(x);
    u32 sign = (b >> 16) & 0x8000u;
    int ex = (int)((b >> 23) & 0xffu);
    u32 mant = b & 0x7fffffu;
    if (ex == 255) {
        return mant == 0u ? (sign | 0x7c00u) : (sign | 0x7e00u | (mant >> 13));
    }
    int e = ex - 127 + 15;
    if (e >= 31) {
        return sign | 0x7c00u;
    }
    if (e <= 0) {
        if (e < -10) {
            return sign;
        }
        u32 m = mant | 0x800000u;
        u32 shift = (u32)(14 - e);
        u32 q = m >> shift;
        u32 rem = m & ((1u << shift) - 1u);
        u32 halfway = 1u << (shift - 1u);
        u32 up = (rem > halfway || (rem == halfway && (q & 1u) == 1u)) ? 1u : 0u;
        return sign | (q + up);
    }
    u32 h = sign | ((u32)e << 10) | (mant >> 13);
    u32 rem = mant & 0x1fffu;
    u32 up = (rem > 0x1000u || (rem == 0x1000u && (h & 1u) == 1u)) ? 1u : 0u;
    return h + up;
}

__device__ __forceinline__ u32 cmm_f32_to_bf16_bits(float x) {
    u32 b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16) | 0x40u;
    }
    u32 lsb = (b >> 16) & 1u;
    return (b + 0x7fffu + lsb) >> 16;
}

__device__ __forceinline__ float cmm_decode(u32 bits, u32 dtype) {
    if (dtype == 1u) return cmm_f16_bits_to_f32(bits);
    if (dtype == 2u) return __uint_as_float(bits << 16);
    return __uint_as_float(bits);
}

__device__ __forceinline__ u32 cmm_encode(float x, u32 dtype) {
    if (dtype == 1u) return cmm_f32_to_f16_bits(x);
    if (dtype == 2u) return cmm_f32_to_bf16_bits(x);
    return __float_as_uint(x);
}

// Element `index` of a buffer of `dtype` at byte address `base` (f32: 4 bytes, else 2).
__device__ __forceinline__ u32 cmm_load_bits(u64 base, u64 index, u32 dtype) {
    if (dtype == 0u) return ((const u32*)base)[index];
    return (u32)((const u16*)base)[index];
}

__device__ __forceinline__ void cmm_store_bits(u64 base, u64 index, u32 dtype, u32 bits) {
    if (dtype == 0u) {
        ((u32*)base)[index] = bits;
    } else {
        ((u16*)base)[index] = (u16)bits;
    }
}

__device__ __forceinline__ float cmm_load(u64 base, u64 index, u32 dtype) {
    return cmm_decode(cmm_load_bits(base, index, dtype), dtype);
}

// Sixteen or eight bytes as one aligned access (the wide paths of cmm_reduce and cmm_copy2d).
struct __align__(16) CmmBits128 {
    u32 w[4];
};
struct __align__(8) CmmBits64 {
    u32 w[2];
};

// Row and column of item `i` of `total` in rows of `cols` items (elements, or groups of them) for a
// grid-stride loop over a 2D region: 32-bit division wherever the count allows.
__device__ __forceinline__ void cmm_row_col(u64 i, u64 total, u32 cols, u64& r, u64& c) {
    if (total <= 0xffffffffull) {
        const u32 r32 = (u32)i / cols;
        r = r32;
        c = (u32)i - r32 * cols;
    } else {
        r = i / cols;
        c = i % cols;
    }
}

// A strided 2D tensor of any dtype: element (r, c) at element index r·stride + c from
// base. Mirror: `TensorArg` in cuda/src/launch.rs (the inputs of cmm_reduce and
// cmm_pointwise, and the tensors of the attention kernels).
struct CmmTensor {
    u64 base;
    u64 stride;
    u32 dtype;
    u32 pad;
};

// Synchronisation helpers of sync.cu and the persistent GEMM (gemm.cu). Every inline
// PTX of the kernels lives in these helpers (and in gemm.cu's mma), so the host twin of
// the kernels (cuda/host/runtime.h, which defines CMM_HOST) can supply its own.
#ifndef CMM_HOST
__device__ __forceinline__ u32 cmm_load_acquire(u64 addr) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
    return v;
}

__device__ __forceinline__ u64 cmm_globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// A signal: every write of this thread before it is visible to whoever acquires the sum.
__device__ __forceinline__ void cmm_red_release_add(u64 addr, u32 value) {
    asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
}

__device__ __forceinline__ void cmm_store_release_gpu(u64 addr, u32 value) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
}

// The shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ u32 cmm_smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}
#endif

// A shared array or variable read and written by plain loads and stores: on the GPU a
// plain __shared__ declaration; the host twin (cuda/host/runtime.h) checks every access
// for hazards between threads, as racecheck does. `dims` is empty for a scalar.
#ifndef CMM_HOST
#define CMM_SHARED(type, name, dims) __shared__ type name dims
#endif

// How many polls of the semaphore between two reads of the abort word (which lives in
// host memory, a PCIe round trip away).
#define CMM_ABORT_POLL 32u

// Spins until `*word >= value` (acquire). False when `timeout_ns` passes or the run's
// abort word is raised; then, unless `status` is 0, status[1] is the last value seen and
// status[0] says why (1: deadline, 2: aborted). The waits of cmm_wait and of the
// persistent GEMMs.
__device__ __forceinline__ bool cmm_spin_at_least(u64 word, u32 value, u64 abort, u64 timeout_ns, u64 status) {
    u64 start = cmm_globaltimer_ns();
    u32 seen = cmm_load_acquire(word);
    u32 polls = 0u;
    while (seen < value) {
        u32 why = 0u;
        if (++polls % CMM_ABORT_POLL == 0u && cmm_load_acquire(abort) != 0u) {
            why = 2u;
        } else if (cmm_globaltimer_ns() - start > timeout_ns) {
            why = 1u;
        }
        if (why != 0u) {
            if (status != 0ull) {
                ((u32*)status)[1] = seen;
                ((volatile u32*)status)[0] = why;
            }
            return false;
        }
        __nanosleep(200);
        seen = cmm_load_acquire(word);
    }
    return true;
}
