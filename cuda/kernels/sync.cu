// Semaphores in device memory. `cmm_signal` is a release increment visible system-wide
// (peers read it over NVLink); `cmm_wait` is an acquire spin bounded by a deadline on
// the global timer: on timeout it records the value it saw and returns instead of
// hanging, and the host turns the record into an error naming device, lane,
// semaphore, awaited and current value. One thread each.

extern "C" __global__ void cmm_signal(u64 sem, u32 add) {
    // Release: every write of this stream before the signal is visible to whoever
    // acquires the new value.
    asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(sem), "r"(add) : "memory");
}

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

// status[0] = 1 and status[1] = the last value seen when the deadline passes.
extern "C" __global__ void cmm_wait(u64 sem, u32 value, u64 timeout_ns, u64 status) {
    u64 start = cmm_globaltimer_ns();
    u32 seen = cmm_load_acquire(sem);
    while (seen < value) {
        if (cmm_globaltimer_ns() - start > timeout_ns) {
            ((u32*)status)[1] = seen;
            ((volatile u32*)status)[0] = 1u;
            return;
        }
        __nanosleep(200);
        seen = cmm_load_acquire(sem);
    }
}
