// Mirrors a semaphore increment in the heap, so that the GPU-side copy of every
// semaphore can be checked against the host scheduler's state after a run. One
// invocation. CPU twin: the `Op::Signal` arm of cmm-core `schedule.rs`.

struct SignalParams {
    word: u32,
    add: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(1) var<uniform> P: SignalParams;

@compute @workgroup_size(1, 1, 1)
fn main() {
    st(P.word, ld(P.word) + P.add);
}
