//! The CPU twin's GEMM kernel: every output element is summed exactly as `gemm.wgsl`
//! sums it — its starting value, then per k, in increasing order, one rounded product
//! and one rounded add, never a fused multiply-add — but the elements are computed in
//! register blocks over packed f32 panels, vectorised across columns and spread over
//! the cores. Blocking decides which elements are computed together and when, never the
//! operations one element sees, so the bits depend on neither the block sizes, the
//! vector width nor the thread count (a k block continues from the f32 partial).

/// Rows of A per micro-kernel call (interleaved in A's packed panel).
const MR: usize = 4;
/// Columns of B per micro-kernel call (contiguous in B's packed panel).
const NR: usize = 32;
/// Depth of one pass: a KC×NR block of packed B (32 KiB) stays in the first-level cache.
const KC: usize = 256;
/// Below this many multiply-adds a GEMM runs on the calling thread: starting threads
/// would cost more than they save.
pub(super) const THREADED_FROM: usize = 1 << 18;

/// An f32 operand read element by element while it is packed: `get(row, col)`.
pub trait Source: Sync {
    /// The element at (row, col) of op(X), decoded to f32.
    fn get(&self, row: usize, col: usize) -> f32;
}

impl<F: Fn(usize, usize) -> f32 + Sync> Source for F {
    fn get(&self, row: usize, col: usize) -> f32 {
        self(row, col)
    }
}

/// `c[i·n + j] ← c[i·n + j] + Σ_p a(i, p)·b(p, j)` for an m×n row-major `c`, summed per
/// element in increasing p with a rounded product and a rounded add per step (the
/// reference's order). `c` holds each element's starting value (0 or the accumulator).
pub fn gemm(m: usize, n: usize, k: usize, a: &dyn Source, b: &dyn Source, c: &mut [f32]) {
    assert_eq!(c.len(), m * n, "c is m×n");
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let a_panels = pack_a(m, k, a);
    let b_panels = pack_b(k, n, b);
    let row_blocks = m.div_ceil(MR);
    let threads = if m * n * k < THREADED_FROM {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |t| t.get()).min(row_blocks)
    };
    let blocks_per_thread = row_blocks.div_ceil(threads);
    let job = Job { m, n, k, a: &a_panels, b: &b_panels };
    if threads == 1 {
        job.run_dispatched(0, c);
        return;
    }
    std::thread::scope(|scope| {
        for (t, rows) in c.chunks_mut(blocks_per_thread * MR * n).enumerate() {
            let job = &job;
            scope.spawn(move || job.run_dispatched(t * blocks_per_thread, rows));
        }
    });
}

/// A's rows in blocks of MR, each block k-major with its MR values of one k adjacent;
/// rows past m are zeros (computed, never stored).
fn pack_a(m: usize, k: usize, a: &dyn Source) -> Vec<f32> {
    let blocks = m.div_ceil(MR);
    let mut out = vec![0.0f32; blocks * k * MR];
    for (block, panel) in out.chunks_exact_mut(k * MR).enumerate() {
        for r in 0..MR.min(m - block * MR) {
            let i = block * MR + r;
            for p in 0..k {
                panel[p * MR + r] = a.get(i, p);
            }
        }
    }
    out
}

/// B's columns in panels of NR, each panel k-major with NR contiguous values per k;
/// columns past n are zeros.
fn pack_b(k: usize, n: usize, b: &dyn Source) -> Vec<f32> {
    let panels = n.div_ceil(NR);
    let mut out = vec![0.0f32; panels * k * NR];
    for (panel_index, panel) in out.chunks_exact_mut(k * NR).enumerate() {
        let j0 = panel_index * NR;
        for p in 0..k {
            for jj in 0..NR.min(n - j0) {
                panel[p * NR + jj] = b.get(p, j0 + jj);
            }
        }
    }
    out
}

/// One GEMM over packed panels; each thread runs it on its own rows of C.
struct Job<'a> {
    m: usize,
    n: usize,
    k: usize,
    a: &'a [f32],
    b: &'a [f32],
}

impl Job<'_> {
    /// Runs the row blocks from `first_block` that `c_rows` (whole rows of C) holds,
    /// on the widest vector unit this CPU has.
    #[allow(unsafe_code)]
    fn run_dispatched(&self, first_block: usize, c_rows: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F (checked on the line above), the only
                // requirement `run_avx512` adds to `run`.
                return unsafe { self.run_avx512(first_block, c_rows) };
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked on the line above), the only
                // requirement `run_avx2` adds to `run`.
                return unsafe { self.run_avx2(first_block, c_rows) };
            }
        }
        self.run(first_block, c_rows)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn run_avx512(&self, first_block: usize, c_rows: &mut [f32]) {
        self.run(first_block, c_rows)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn run_avx2(&self, first_block: usize, c_rows: &mut [f32]) {
        self.run(first_block, c_rows)
    }

    #[inline(always)]
    fn run(&self, first_block: usize, c_rows: &mut [f32]) {
        let (m, n, k) = (self.m, self.n, self.k);
        let rows = c_rows.len() / n;
        let blocks = rows.div_ceil(MR);
        for k0 in (0..k).step_by(KC) {
            let kc = KC.min(k - k0);
            for (panel_index, b_panel) in self.b.chunks_exact(k * NR).enumerate() {
                let b_block = &b_panel[k0 * NR..(k0 + kc) * NR];
                let j0 = panel_index * NR;
                let width = NR.min(n - j0);
                for local in 0..blocks {
                    let block = first_block + local;
                    let a_block = &self.a[(block * k + k0) * MR..(block * k + k0 + kc) * MR];
                    let height = MR.min(m - block * MR);
                    let mut acc = [[0.0f32; NR]; MR];
                    for (r, acc_row) in acc.iter_mut().enumerate().take(height) {
                        let start = (local * MR + r) * n + j0;
                        acc_row[..width].copy_from_slice(&c_rows[start..start + width]);
                    }
                    micro_kernel(a_block, b_block, &mut acc);
                    for (r, acc_row) in acc.iter().enumerate().take(height) {
                        let start = (local * MR + r) * n + j0;
                        c_rows[start..start + width].copy_from_slice(&acc_row[..width]);
                    }
                }
            }
        }
    }
}

/// MR×NR accumulators over one k block: for each k, a product rounded to f32, then an
/// add rounded to f32 (Rust never contracts the two into a fused multiply-add).
#[inline(always)]
fn micro_kernel(a_block: &[f32], b_block: &[f32], acc: &mut [[f32; NR]; MR]) {
    for (a, b) in a_block.chunks_exact(MR).zip(b_block.chunks_exact(NR)) {
        for r in 0..MR {
            let x = a[r];
            for j in 0..NR {
                acc[r][j] += x * b[j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The naive order the kernel must reproduce: per element, start, then + a·b in k.
    fn naive(m: usize, n: usize, k: usize, a: &[f32], b: &[f32], c0: &[f32]) -> Vec<f32> {
        let mut c = c0.to_vec();
        for i in 0..m {
            for j in 0..n {
                let mut acc = c0[i * n + j];
                for p in 0..k {
                    acc += a[i * k + p] * b[p * n + j];
                }
                c[i * n + j] = acc;
            }
        }
        c
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                // Values of every magnitude, so that a changed order changes the bits.
                let mantissa = (s >> 9) as f32 / (1u32 << 23) as f32 - 0.5;
                mantissa * f32::powi(2.0, (s % 17) as i32 - 8)
            })
            .collect()
    }

    /// Ragged shapes around every block edge, threaded and not, with and without a
    /// starting value: bit for bit the naive order.
    #[test]
    fn blocked_gemm_sums_in_the_reference_order_bit_for_bit() {
        for (m, n, k) in
            [(1, 1, 1), (3, 5, 7), (4, 32, 256), (5, 33, 257), (9, 70, 600), (67, 129, 300), (130, 40, 520)]
        {
            for start in [false, true] {
                let a = values(m * k, 1 + m as u32);
                let b = values(k * n, 2 + n as u32);
                let c0 = if start { values(m * n, 3) } else { vec![0.0; m * n] };
                let mut c = c0.clone();
                gemm(m, n, k, &|i: usize, p: usize| a[i * k + p], &|p: usize, j: usize| b[p * n + j], &mut c);
                let want = naive(m, n, k, &a, &b, &c0);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&c), bits(&want), "{m}x{n}x{k} start={start}");
            }
        }
    }

    /// A fused multiply-add would give different bits for this element: the test above
    /// would see an FMA-contracting kernel.
    #[test]
    fn the_inputs_tell_a_fused_multiply_add_apart() {
        let (a, b) = (values(64, 11), values(64, 12));
        let (mut split, mut fused) = (0.0f32, 0.0f32);
        let mut differs = false;
        for p in 0..64 {
            split += a[p] * b[p];
            fused = a[p].mul_add(b[p], fused);
            differs |= split != fused;
        }
        assert!(differs, "the test values never round differently under FMA");
    }
}
