//! The CPU twin of the reference executor: the same memory model (every element in a
//! 32-bit word holding its dtype's bits), the same schedule and the same per-op
//! arithmetic as the WGSL stages (`gemm.wgsl`, `copy.wgsl`, `reduce.wgsl`,
//! `generate.wgsl`). It runs small plans quickly in unit tests and documents what
//! each shader computes.

use crate::dtype::DType;
use crate::generator::{element_bits, Family};
use crate::plan::{BufferRole, Op, Plan, PlanError, Region};
use crate::schedule::{schedule_with, Deadlock, Order};

/// Why the CPU twin could not run a plan.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CpuError {
    /// The plan deadlocks.
    #[error(transparent)]
    Deadlock(#[from] Deadlock),
    /// The plan is malformed or cannot be executed (generator range).
    #[error(transparent)]
    Plan(#[from] PlanError),
}

/// Memory of all devices: `[device][buffer]` words.
pub type Memory = Vec<Vec<Vec<u32>>>;

/// A buffer's initial contents: its input window (twin of `generate.wgsl`), or poison
/// ([`DType::poison_bits`]) for scratch and output buffers.
pub fn generate_input(
    role: &BufferRole,
    device: usize,
    rows: usize,
    cols: usize,
    dtype: DType,
    seed: u32,
    family: Family,
) -> Vec<u32> {
    let mut out = vec![dtype.poison_bits(); rows * cols];
    if let Some((tensor, global_cols, origins)) = role.generated() {
        let (r0, c0) = origins[device];
        for r in 0..rows {
            for c in 0..cols {
                let index = ((r0 + r) * global_cols + c0 + c) as u32;
                out[r * cols + c] = element_bits(seed, tensor, index, family, dtype);
            }
        }
    }
    out
}

fn at(r: &Region, row: usize, col: usize) -> usize {
    r.offset + row * r.stride + col
}

/// Runs `plan` on the CPU in the default order and returns every device's memory.
pub fn run(plan: &Plan, seed: u32, family: Family) -> Result<Memory, CpuError> {
    run_with(plan, seed, family, Order::Default)
}

/// Runs `plan` on the CPU in the given interleaving.
pub fn run_with(plan: &Plan, seed: u32, family: Family, order: Order) -> Result<Memory, CpuError> {
    plan.validate()?;
    plan.check_generator_range()?;
    let sched = schedule_with(plan, order)?;
    let mut mem: Memory = (0..plan.devices)
        .map(|d| {
            plan.buffers.iter().map(|b| generate_input(&b.role, d, b.rows, b.cols, b.dtype, seed, family)).collect()
        })
        .collect();
    for site in sched.order {
        let op = &plan.programs[site.device].lanes[site.lane][site.index];
        execute(plan, &mut mem, site.device, op);
    }
    Ok(mem)
}

/// Executes one op of device `device`.
pub fn execute(plan: &Plan, mem: &mut Memory, device: usize, op: &Op) {
    let dt = |r: &Region| plan.buffers[r.buf.0].dtype;
    match op {
        Op::Gemm { a, b, c, trans_a, trans_b, accumulate } => {
            let (m, n) = (c.rows, c.cols);
            let k = if *trans_a { a.rows } else { a.cols };
            let dev = &mem[device];
            let mut out = vec![0u32; m * n];
            for i in 0..m {
                for j in 0..n {
                    let mut acc = if *accumulate { f32::from_bits(dev[c.buf.0][at(c, i, j)]) } else { 0.0 };
                    for p in 0..k {
                        let ai = if *trans_a { at(a, p, i) } else { at(a, i, p) };
                        let bi = if *trans_b { at(b, j, p) } else { at(b, p, j) };
                        let x = dt(a).decode(dev[a.buf.0][ai]);
                        let y = dt(b).decode(dev[b.buf.0][bi]);
                        acc += x * y;
                    }
                    out[i * n + j] = dt(c).encode(acc);
                }
            }
            for i in 0..m {
                for j in 0..n {
                    mem[device][c.buf.0][at(c, i, j)] = out[i * n + j];
                }
            }
        }
        Op::Copy { src, dst_device, dst, .. } => {
            for i in 0..src.rows {
                for j in 0..src.cols {
                    let v = mem[device][src.buf.0][at(src, i, j)];
                    mem[*dst_device][dst.buf.0][at(dst, i, j)] = v;
                }
            }
        }
        Op::Reduce { inputs, output } => {
            for i in 0..output.rows {
                for j in 0..output.cols {
                    let mut acc = 0.0f32;
                    for (t, r) in inputs.iter().enumerate() {
                        let v = dt(r).decode(mem[device][r.buf.0][at(r, i, j)]);
                        acc = if t == 0 { v } else { acc + v };
                    }
                    mem[device][output.buf.0][at(output, i, j)] = dt(output).encode(acc);
                }
            }
        }
        Op::Pointwise { function, inputs, output } => {
            let mut args = Vec::with_capacity(inputs.len());
            for i in 0..output.rows {
                for j in 0..output.cols {
                    args.clear();
                    args.extend(inputs.iter().map(|r| dt(r).decode(mem[device][r.buf.0][at(r, i, j)])));
                    mem[device][output.buf.0][at(output, i, j)] = dt(output).encode(function.apply(&args));
                }
            }
        }
        Op::Signal { .. } | Op::Wait { .. } => {}
    }
}
