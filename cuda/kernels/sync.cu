// Semaphores in device memory, and the run's control words in host-mapped memory.
//
// `cmm_signal` is a release increment visible system-wide (peers read it over NVLink).
// `cmm_wait` is an acquire spin that ends three ways: the value is reached; the
// deadline on the global timer passes (status = 1); or the host raises the run's abort
// word (status = 2), which it does on a run timeout or an error while enqueueing, so
// that no stream is left spinning. On status 1 or 2 it records the value it saw, and the
// host turns that into an error naming device, lane, semaphore, awaited and current
// value. `cmm_gate` holds every lane stream until the host has enqueued the whole plan,
// so the timed region starts with the first op rather than with the host's launches.
// One thread each.

extern "C" __global__ void cmm_signal(u64 sem, u32 add) {
    // Release: every write of this stream before the signal is visible to whoever
    // acquires the new value.
    cmm_red_release_add(sem, add);
}

// status[0] = 1 (deadline) or 2 (aborted), status[1] = the last value seen.
extern "C" __global__ void cmm_wait(u64 sem, u32 value, u64 timeout_ns, u64 status, u64 abort) {
    cmm_spin_at_least(sem, value, abort, timeout_ns, status);
}

// Spins until the host sets `*go` (status[0] stays 0) or the deadline passes
// (status[0] = 1: the host never released the gate, the run is reported and aborted).
extern "C" __global__ void cmm_gate(u64 go, u64 timeout_ns, u64 status) {
    u64 start = cmm_globaltimer_ns();
    while (cmm_load_acquire(go) == 0u) {
        if (cmm_globaltimer_ns() - start > timeout_ns) {
            ((volatile u32*)status)[0] = 1u;
            return;
        }
        __nanosleep(1000);
    }
}
