// The heap: every device's buffers, the semaphore mirror and the GEMM temporary, one
// 32-bit word per element, in up to four storage bindings of PART_WORDS words each (an
// adapter binds a limited number of bytes per storage buffer; the host sets PART_WORDS
// from the adapter's limit). Every stage addresses it by word through ld and st.
// Prepended to every stage by the host, after numeric.wgsl.

override PART_WORDS: u32 = 268435456u;
// False when the whole heap fits part 0 (the host builds a variant of every stage for
// that case): then ld and st are one access. On a CPU adapter each branch below costs a
// loop over the lanes whether any lane takes it or not.
override SPLIT_HEAP: bool = true;

@group(0) @binding(0) var<storage, read_write> mem0: array<u32>;
@group(0) @binding(2) var<storage, read_write> mem1: array<u32>;
@group(0) @binding(3) var<storage, read_write> mem2: array<u32>;
@group(0) @binding(4) var<storage, read_write> mem3: array<u32>;

fn ld(i: u32) -> u32 {
    if (!SPLIT_HEAP || i < PART_WORDS) {
        return mem0[i];
    }
    let j = i - PART_WORDS;
    if (j < PART_WORDS) {
        return mem1[j];
    }
    let k = j - PART_WORDS;
    if (k < PART_WORDS) {
        return mem2[k];
    }
    return mem3[k - PART_WORDS];
}

fn st(i: u32, v: u32) {
    if (!SPLIT_HEAP || i < PART_WORDS) {
        mem0[i] = v;
        return;
    }
    let j = i - PART_WORDS;
    if (j < PART_WORDS) {
        mem1[j] = v;
        return;
    }
    let k = j - PART_WORDS;
    if (k < PART_WORDS) {
        mem2[k] = v;
        return;
    }
    mem3[k - PART_WORDS] = v;
}
