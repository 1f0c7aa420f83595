//! The CPU twin of the reference executor: the same memory model (every element in a
//! 32-bit word holding its dtype's bits), the same schedule and the same per-op
//! arithmetic as the WGSL stages (`gemm.wgsl`, `copy.wgsl`, `reduce.wgsl`,
//! `generate.wgsl`). It runs small plans quickly in unit tests and documents what
//! each shader computes.

mod gemm;

use crate::attention::online;
use crate::dtype::DType;
use crate::generator::{element_bits, Family};
use crate::moe::{check_routing, route, RoutingError, ROUTE_NONE};
use crate::plan::{attention_scale, AttnState, BufferRole, Op, Plan, PlanError, Region};
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
    /// A routing table is malformed or routes more rows than the plan holds.
    #[error(transparent)]
    Routing(#[from] RoutingError),
    /// The plan's buffers need more memory than the machine has available.
    #[error(
        "plan `{plan}`: its buffers need {} GiB of host memory, more than the {} GiB available",
        gib(*bytes),
        gib(*available as u128)
    )]
    TooLarge {
        /// Plan name.
        plan: String,
        /// Bytes its buffers take on every device together (a 32-bit word per element).
        bytes: u128,
        /// Bytes the system reports available.
        available: u64,
    },
}

fn gib(bytes: u128) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 30) as f64)
}

/// Bytes of memory the system can still give a process (Linux's `MemAvailable`), when
/// it says.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses, before anything is allocated, a plan whose buffers would not fit in the
/// memory available (an allocation that large would end the process instead).
fn check_memory(plan: &Plan) -> Result<(), CpuError> {
    let words: u128 = plan.devices as u128 * plan.buffers.iter().map(|b| b.len() as u128).sum::<u128>();
    let bytes = words * 4;
    match available_memory() {
        Some(available) if bytes > available as u128 => {
            Err(CpuError::TooLarge { plan: plan.name.clone(), bytes, available })
        }
        _ => Ok(()),
    }
}

/// Memory of all devices: `[device][buffer]` words.
pub type Memory = Vec<Vec<Vec<u32>>>;

/// A buffer's initial contents: its input window (twin of `generate.wgsl`), the
/// router's table (the same on every device), or poison ([`DType::poison_bits`]) for
/// scratch and output buffers.
pub fn generate_input(
    role: &BufferRole,
    device: usize,
    rows: usize,
    cols: usize,
    dtype: DType,
    seed: u32,
    family: Family,
) -> Vec<u32> {
    if let BufferRole::Router { part, router } = role {
        return router.words(*part, seed, family);
    }
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
    check_memory(plan)?;
    check_routing(plan, seed)?;
    let sched = schedule_with(plan, order)?;
    let mut mem = initial_memory(plan, seed, family);
    for site in sched.order {
        let op = &plan.programs[site.device].lanes[site.lane][site.index];
        execute(plan, &mut mem, site.device, op);
    }
    Ok(mem)
}

/// Every device's memory before the plan runs: inputs generated, the rest poison.
pub fn initial_memory(plan: &Plan, seed: u32, family: Family) -> Memory {
    (0..plan.devices)
        .map(|d| {
            plan.buffers
                .iter()
                .map(|b| {
                    // An uneven shard's padding rows (past the device's own) stay poison.
                    let mut words = generate_input(&b.role, d, b.rows_on(d), b.cols, b.dtype, seed, family);
                    words.resize(b.len(), b.dtype.poison_bits());
                    words
                })
                .collect()
        })
        .collect()
}

/// Executes one op of device `device` (one function per op below, each the twin of
/// its WGSL stage).
pub fn execute(plan: &Plan, mem: &mut Memory, device: usize, op: &Op) {
    match op {
        Op::Gemm { .. } => gemm_op(plan, mem, device, op),
        Op::Copy { .. } => copy(mem, device, op),
        Op::Reduce { .. } => reduce(plan, mem, device, op),
        Op::Pointwise { .. } => pointwise(plan, mem, device, op),
        Op::Attend { .. } => attend(plan, mem, device, op),
        Op::AttnMerge { .. } => attn_merge(mem, device, op),
        Op::AttnFinish { .. } => attn_finish(plan, mem, device, op),
        Op::Route { .. } => route_op(mem, device, op),
        Op::GroupedGemm { .. } => grouped_gemm(plan, mem, device, op),
        Op::Combine { .. } => combine(plan, mem, device, op),
        Op::Signal { .. } | Op::Wait { .. } => {}
    }
}

/// `Op::Gemm` (twin of `gemm.wgsl`): the blocked kernel in the reference's order, rounded once to c's dtype.
fn gemm_op(plan: &Plan, mem: &mut Memory, device: usize, op: &Op) {
    let Op::Gemm { a, b, c, trans_a, trans_b, accumulate, c_device, .. } = op else {
        unreachable!("dispatched on its variant")
    };
    let dt = |r: &Region| plan.buffers[r.buf.0].dtype;
    let (m, n) = (c.rows, c.cols);
    let k = if *trans_a { a.rows } else { a.cols };
    let owner = c_device.unwrap_or(device);
    let c_words = &mem[owner][c.buf.0];
    let mut out: Vec<f32> = if *accumulate {
        (0..m * n).map(|x| f32::from_bits(c_words[at(c, x / n, x % n)])).collect()
    } else {
        vec![0.0; m * n]
    };
    let (a_words, b_words) = (&mem[device][a.buf.0], &mem[device][b.buf.0]);
    let (a_type, b_type) = (dt(a), dt(b));
    let get_a = |i: usize, p: usize| a_type.decode(a_words[if *trans_a { at(a, p, i) } else { at(a, i, p) }]);
    let get_b = |p: usize, j: usize| b_type.decode(b_words[if *trans_b { at(b, j, p) } else { at(b, p, j) }]);
    gemm::gemm(m, n, k, &get_a, &get_b, &mut out);
    let c_type = dt(c);
    let c_words = &mut mem[owner][c.buf.0];
    for (x, value) in out.into_iter().enumerate() {
        c_words[at(c, x / n, x % n)] = c_type.encode(value);
    }
}

/// `Op::Copy` (twin of `copy.wgsl`): the words as they are.
fn copy(mem: &mut Memory, device: usize, op: &Op) {
    let Op::Copy { src, dst_device, dst, .. } = op else { unreachable!("dispatched on its variant") };
    for i in 0..src.rows {
        for j in 0..src.cols {
            let v = mem[device][src.buf.0][at(src, i, j)];
            mem[*dst_device][dst.buf.0][at(dst, i, j)] = v;
        }
    }
}

/// `Op::Reduce` (twin of `reduce.wgsl`): the inputs summed in order in f32, rounded once.
fn reduce(plan: &Plan, mem: &mut Memory, device: usize, op: &Op) {
    let Op::Reduce { inputs, output } = op else { unreachable!("dispatched on its variant") };
    let dt = |r: &Region| plan.buffers[r.buf.0].dtype;
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

/// `Op::Pointwise` (twin of `pointwise.wgsl`).
fn pointwise(plan: &Plan, mem: &mut Memory, device: usize, op: &Op) {
    let Op::Pointwise { function, inputs, output } = op else { unreachable!("dispatched on its variant") };
    let dt = |r: &Region| plan.buffers[r.buf.0].dtype;
    let mut args = Vec::with_capacity(inputs.len());
    for i in 0..output.rows {
        for j in 0..output.cols {
            args.clear();
            args.extend(inputs.iter().map(|r| dt(r).decode(mem[device][r.buf.0][at(r, i, j)])));
            mem[device][output.buf.0][at(output, i, j)] = dt(output).encode(function.apply(&args));
        }
    }
}

/// `Op::Attend` (twin of `attend.wgsl`): `online::attend` per (row, head).
fn attend(plan: &Plan, mem: &mut Memory, device: usize, op: &Op) {
    let Op::Attend { q, k, v, state, heads, kv_heads, causal, fresh } = op else {
        unreachable!("dispatched on its variant")
    };
    let dt = |r: &Region| plan.buffers[r.buf.0].dtype;
    let dh = q.cols / heads;
    let group = heads / kv_heads;
    let scale = attention_scale(dh);
    let dev = &mem[device];
    // Keys and values decoded once; the arithmetic is online::attend's, per
    // (row, head), so spreading the rows over threads keeps every bit.
    let (keys, values) = (decode_region(dev, k, dt(k)), decode_region(dev, v, dt(v)));
    let q_type = dt(q);
    let work = q.rows * heads * k.rows * dh;
    let states = parallel_map(q.rows * heads, work, |n| {
        let (i, h) = (n / heads, n % heads);
        let g = h / group;
        let mut row = if *fresh { online::RowState::empty(dh) } else { read_state(dev, state, i, h, dh) };
        let query: Vec<f32> = (0..dh).map(|c| q_type.decode(dev[q.buf.0][at(q, i, h * dh + c)])).collect();
        online::attend(
            &mut row,
            &query,
            k.rows,
            scale,
            |j, c| keys[j * k.cols + g * dh + c],
            |j, c| values[j * v.cols + g * dh + c],
            |j| causal.is_none_or(|m| m.visible(i, j)),
        );
        row
    });
    for (n, row) in states.iter().enumerate() {
        write_state(&mut mem[device], state, n / heads, n % heads, row);
    }
}

/// `Op::AttnMerge` (twin of `attn_state.wgsl`).
fn attn_merge(mem: &mut Memory, device: usize, op: &Op) {
    let Op::AttnMerge { from, into, heads } = op else { unreachable!("dispatched on its variant") };
    let dh = into.acc.cols / heads;
    for i in 0..into.max.rows {
        for h in 0..*heads {
            let other = read_state(&mem[device], from, i, h, dh);
            let mut row = read_state(&mem[device], into, i, h, dh);
            online::merge(&mut row, &other);
            write_state(&mut mem[device], into, i, h, &row);
        }
    }
}

/// `Op::AttnFinish` (twin of `attn_state.wgsl`): O and the log-sum-exp.
fn attn_finish(plan: &Plan, mem: &mut Memory, device: usize, op: &Op) {
    let Op::AttnFinish { state, out, lse, heads } = op else { unreachable!("dispatched on its variant") };
    let dt = |r: &Region| plan.buffers[r.buf.0].dtype;
    let dh = state.acc.cols / heads;
    for i in 0..state.max.rows {
        for h in 0..*heads {
            let row = read_state(&mem[device], state, i, h, dh);
            let (values, log_sum_exp) = online::finish(&row);
            for (c, x) in values.into_iter().enumerate() {
                mem[device][out.buf.0][at(out, i, h * dh + c)] = dt(out).encode(x);
            }
            mem[device][lse.buf.0][at(lse, i, h)] = log_sum_exp.to_bits();
        }
    }
}

/// `Op::Route` (twin of `route.wgsl`): the routing tables from the ids.
fn route_op(mem: &mut Memory, device: usize, op: &Op) {
    let Op::Route { ids, tables, experts } = op else { unreachable!("dispatched on its variant") };
    let words = read_region(&mem[device], ids);
    let chunks = tables.chunks(*experts);
    let t = route(&words, ids.cols, *experts, chunks, tables.shards, tables.perm.rows);
    for (r, values) in [(&tables.seg, &t.seg), (&tables.perm, &t.perm), (&tables.inv, &t.inv)] {
        write_region(&mut mem[device], r, values);
    }
}

/// `Op::GroupedGemm` (twin of `grouped_gemm.wgsl`): each expert's rows as one blocked GEMM.
fn grouped_gemm(plan: &Plan, mem: &mut Memory, device: usize, op: &Op) {
    let Op::GroupedGemm { a, b, c, tables, experts, groups, chunk, gather, zero_unrouted } = op else {
        unreachable!("dispatched on its variant")
    };
    let dt = |r: &Region| plan.buffers[r.buf.0].dtype;
    let dev = &mem[device];
    let seg = read_region(dev, &tables.seg);
    let perm = read_region(dev, &tables.perm);
    let (chunks, slots) = (tables.chunks(*experts), tables.inv.cols);
    let k = b.rows / experts;
    // Every index read from a table is bounded before use, as in the shaders.
    let bound = |x: u32| (x as usize).min(c.rows);
    let start = |e: usize| bound(seg[e * chunks + chunk]);
    let routed = bound(seg[seg.len() - 1]);
    // Each routed row of c: its expert and the row of a it reads.
    let mut routed_rows: Vec<(usize, usize, usize)> = Vec::new();
    let mut zero_rows: Vec<usize> = Vec::new();
    // perm has c's rows (plan validation).
    for (r, &slot) in perm.iter().enumerate() {
        // The last group whose segment starts at or before r, by the shaders'
        // binary search; r is in it if it ends after r.
        let (mut lo, mut hi) = (groups.start, groups.end);
        for _ in 0..32 {
            if lo >= hi {
                break;
            }
            let mid = lo + (hi - lo) / 2;
            if start(mid) <= r {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let expert = (lo > groups.start && r < bound(seg[(lo - 1) * chunks + chunk + 1])).then(|| lo - 1);
        let Some(e) = expert else {
            if *zero_unrouted && r >= routed {
                zero_rows.push(r);
            }
            continue;
        };
        let src = match gather {
            None => Some(r),
            Some(base) => {
                let token = (slot != ROUTE_NONE).then_some(slot as usize / slots);
                token.and_then(|t| t.checked_sub(*base)).filter(|&t| t < a.rows)
            }
        };
        match src {
            Some(i) => routed_rows.push((r, e, i)),
            // No source row: the sum of nothing, 0.
            None => zero_rows.push(r),
        }
    }
    // Consecutive rows of one expert form one GEMM against that expert's B.
    let (a_type, b_type) = (dt(a), dt(b));
    let (a_words, b_words) = (&dev[a.buf.0], &dev[b.buf.0]);
    let mut results: Vec<(usize, Vec<f32>)> = Vec::new();
    for run in routed_rows.chunk_by(|x, y| x.1 == y.1) {
        let e = run[0].1;
        let sources: Vec<usize> = run.iter().map(|x| x.2).collect();
        let get_a = |i: usize, p: usize| a_type.decode(a_words[at(a, sources[i], p)]);
        let get_b = |p: usize, j: usize| b_type.decode(b_words[at(b, e * k + p, j)]);
        let mut out = vec![0.0f32; run.len() * c.cols];
        gemm::gemm(run.len(), c.cols, k, &get_a, &get_b, &mut out);
        results.extend(run.iter().zip(out.chunks_exact(c.cols)).map(|(x, row)| (x.0, row.to_vec())));
    }
    let c_type = dt(c);
    let c_words = &mut mem[device][c.buf.0];
    for r in zero_rows {
        for j in 0..c.cols {
            c_words[at(c, r, j)] = c_type.encode(0.0);
        }
    }
    for (r, row) in results {
        for (j, value) in row.into_iter().enumerate() {
            c_words[at(c, r, j)] = c_type.encode(value);
        }
    }
}

/// `Op::Combine` (twin of `combine.wgsl`): the top-k weighted sum in slot order.
fn combine(plan: &Plan, mem: &mut Memory, device: usize, op: &Op) {
    let Op::Combine { rows, weights, inv, out } = op else { unreachable!("dispatched on its variant") };
    let dt = |r: &Region| plan.buffers[r.buf.0].dtype;
    let dev = &mem[device];
    let mut values = Vec::with_capacity(out.len());
    for t in 0..out.rows {
        for j in 0..out.cols {
            let mut acc = 0.0f32;
            for s in 0..inv.cols {
                let row = dev[inv.buf.0][at(inv, t, s)] as usize;
                if row < rows.rows {
                    let w = f32::from_bits(dev[weights.buf.0][at(weights, t, s)]);
                    acc += w * dt(rows).decode(dev[rows.buf.0][at(rows, row, j)]);
                }
            }
            values.push(dt(out).encode(acc));
        }
    }
    write_region(&mut mem[device], out, &values);
}

/// A region's elements decoded to f32, row-major.
fn decode_region(dev: &[Vec<u32>], r: &Region, dtype: DType) -> Vec<f32> {
    (0..r.rows).flat_map(|i| (0..r.cols).map(move |j| dtype.decode(dev[r.buf.0][at(r, i, j)]))).collect()
}

/// `(0..count).map(f)`, spread over the cores when `work` (multiply-adds, roughly) is
/// worth starting threads for; the results come back in index order.
fn parallel_map<T: Send>(count: usize, work: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads =
        if work < gemm::THREADED_FROM { 1 } else { std::thread::available_parallelism().map_or(1, |t| t.get()) };
    if threads <= 1 || count < 2 {
        return (0..count).map(f).collect();
    }
    let per_thread = count.div_ceil(threads);
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..count)
            .step_by(per_thread)
            .map(|first| scope.spawn(move || (first..count.min(first + per_thread)).map(f).collect::<Vec<T>>()))
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect()
    })
}

/// The words of a region, row-major.
fn read_region(dev: &[Vec<u32>], r: &Region) -> Vec<u32> {
    (0..r.rows).flat_map(|i| (0..r.cols).map(move |j| dev[r.buf.0][at(r, i, j)])).collect()
}

/// Writes row-major words into a region.
fn write_region(dev: &mut [Vec<u32>], r: &Region, words: &[u32]) {
    for i in 0..r.rows {
        for j in 0..r.cols {
            dev[r.buf.0][at(r, i, j)] = words[i * r.cols + j];
        }
    }
}

/// Reads the state of (row `i`, head `h`) from a device's memory.
fn read_state(dev: &[Vec<u32>], s: &AttnState, i: usize, h: usize, dh: usize) -> online::RowState {
    let word = |r: &Region, j: usize| f32::from_bits(dev[r.buf.0][at(r, i, j)]);
    online::RowState {
        max: word(&s.max, h),
        sum: word(&s.sum, h),
        acc: (0..dh).map(|c| word(&s.acc, h * dh + c)).collect(),
    }
}

/// Writes the state of (row `i`, head `h`) into a device's memory.
fn write_state(dev: &mut [Vec<u32>], s: &AttnState, i: usize, h: usize, row: &online::RowState) {
    let dh = row.acc.len();
    dev[s.max.buf.0][at(&s.max, i, h)] = row.max.to_bits();
    dev[s.sum.buf.0][at(&s.sum, i, h)] = row.sum.to_bits();
    for (c, a) in row.acc.iter().enumerate() {
        dev[s.acc.buf.0][at(&s.acc, i, h * dh + c)] = a.to_bits();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{algorithms_for, build_plan, Algorithm, AlgorithmError};
    use crate::oracle::expected_outputs;
    use crate::problem::{OpKind, Problem};

    /// A plan whose buffers cannot fit in memory is refused before anything is
    /// allocated, not ended by the kernel's out-of-memory killer.
    #[test]
    fn a_plan_larger_than_memory_is_refused_first() {
        use crate::plan::{BufferRole, PlanBuilder};
        if available_memory().is_none() {
            return; // No figure to refuse against (not Linux): the run would try.
        }
        let mut b = PlanBuilder::new("huge", 2);
        b.buffer("C", DType::F32, 1 << 20, 1 << 20, BufferRole::Output);
        let plan = b.finish().unwrap();
        match run(&plan, 1, Family::Exact) {
            Err(CpuError::TooLarge { bytes, .. }) => assert_eq!(bytes, 8 << 40),
            other => panic!("{other:?}"),
        }
    }

    /// Every algorithm on a few device counts matches the oracle exactly on the exact family.
    #[test]
    fn every_algorithm_matches_the_oracle_on_the_cpu() {
        for op in OpKind::ALL {
            for d in [1, 2, 3, 4, 5] {
                let p = Problem::new(op, d, 4 * d, 2 * d, 3 * d, DType::Bf16, DType::F32).unwrap();
                let want = expected_outputs(&p, 11, Family::Exact);
                for alg in algorithms_for(op) {
                    let plan = build_plan(&p, alg).unwrap();
                    let mem = run(&plan, 11, Family::Exact).unwrap();
                    let out = plan.output().unwrap();
                    for (dev, dev_mem) in mem.iter().enumerate() {
                        let got: Vec<f64> = dev_mem[out.0].iter().map(|&w| f32::from_bits(w) as f64).collect();
                        assert_eq!(got, want.values[dev], "{} device {dev}", plan.name);
                    }
                }
            }
        }
    }

    /// Uneven shards (M not a multiple of D, `tensor_split`'s order): every algorithm's
    /// plan is sound and matches the oracle bit for bit, chunked ones with chunks that
    /// do not divide the blocks either; partial sums in bf16 stay within their bound.
    #[test]
    fn uneven_shards_match_the_oracle_under_every_algorithm() {
        use crate::testing::{assert_matches_oracle, assert_sound};
        for op in OpKind::ALL {
            for d in [2, 3, 4, 5] {
                for m in [4 * d + 1, 5 * d - 1] {
                    let p = Problem::new(op, d, m, 2 * d, 3 * d, DType::Bf16, DType::F32).unwrap();
                    let mut algorithms = algorithms_for(op);
                    algorithms.extend([Algorithm::RingChunked { chunks: 3 }, Algorithm::Fused { chunks: 4 }]);
                    for alg in algorithms {
                        let plan = build_plan(&p, alg).unwrap_or_else(|e| panic!("{op} D={d} M={m} {alg}: {e}"));
                        assert_sound(&plan);
                        assert_matches_oracle(&plan, &p, 7, Family::Exact);
                    }
                    if op != OpKind::AgGemm {
                        let wire = p.with_wire(DType::Bf16).unwrap();
                        let plan = build_plan(&wire, Algorithm::RingChunked { chunks: 2 }).unwrap();
                        assert_matches_oracle(&plan, &wire, 7, Family::Realistic);
                    }
                }
            }
        }
        // More chunks than the smallest shard has rows: refused, naming both.
        let p = Problem::new(OpKind::AgGemm, 4, 9, 8, 8, DType::F32, DType::F32).unwrap();
        let e = build_plan(&p, Algorithm::RingChunked { chunks: 3 }).unwrap_err();
        assert!(matches!(e, AlgorithmError::TooManyChunks { rows: 2, chunks: 3, .. }), "{e}");
    }

    /// An op that reaches into an uneven shard's padding (past the rows its device
    /// holds) is refused before anything runs: no result can depend on the padding.
    #[test]
    fn an_op_reaching_into_a_shard_s_padding_is_refused() {
        let p = Problem::new(OpKind::AgGemm, 4, 10, 8, 8, DType::F32, DType::F32).unwrap();
        let mut plan = build_plan(&p, Algorithm::Baseline).unwrap();
        let a = plan.buffer_id("A").unwrap();
        assert_eq!(plan.buffer(a).device_rows, Some(vec![3, 3, 2, 2]));
        plan.validate().unwrap();
        // Device 3 copies its 2 rows of A into rows 8..10 of the gathered G; make it copy
        // 3 rows into 7..10.
        let Op::Copy { src, dst, .. } = &mut plan.programs[3].lanes[0][0] else { panic!("not a copy") };
        assert_eq!((src.buf, src.rows, dst.offset), (a, 2, 8 * 8));
        (src.rows, dst.rows, dst.offset) = (3, 3, 7 * 8);
        let e = plan.validate().unwrap_err().to_string();
        assert!(e.contains("reaches past device 3's 2 rows of `A`"), "{e}");
    }

    /// `ring_push` adds the same partials in the same order as `ring_accumulate`, only
    /// where they lie: the outputs agree bit for bit, in the realistic family too.
    #[test]
    fn ring_push_sums_as_ring_accumulate_bit_for_bit() {
        for op in [OpKind::GemmRs, OpKind::GemmAr] {
            for d in [1, 2, 3, 4] {
                let p = Problem::new(op, d, 8 * d, 24, 16 * d, DType::F16, DType::F16).unwrap();
                let output = |alg| {
                    let plan = build_plan(&p, alg).unwrap();
                    let out = plan.output().unwrap();
                    run(&plan, 5, Family::Realistic)
                        .unwrap()
                        .into_iter()
                        .map(|mem| mem[out.0].clone())
                        .collect::<Vec<_>>()
                };
                let push = output(Algorithm::RingPush);
                assert_eq!(push, output(Algorithm::RingAccumulate { chunks: 1 }), "{op} D={d}");
                assert!(push.iter().flatten().any(|&w| w != 0), "{op} D={d}: all zeros");
            }
        }
    }

    /// `fused_push` adds ring_push's partials on the same owners in the same order, but its
    /// own block's last partial is added in the GEMM rather than by a reduce: bit for bit
    /// ring_push's where sums are exact, within the oracle's bound where they round, with
    /// 1, 2 and 3 chunks.
    #[test]
    fn fused_push_sums_as_ring_push() {
        for op in [OpKind::GemmRs, OpKind::GemmAr] {
            for d in [1, 2, 3, 4] {
                let p = Problem::new(op, d, 12 * d, 24, 16 * d, DType::F16, DType::F16).unwrap();
                let output = |alg, family| {
                    let plan = build_plan(&p, alg).unwrap();
                    let out = plan.output().unwrap();
                    run(&plan, 5, family).unwrap().into_iter().map(|mem| mem[out.0].clone()).collect::<Vec<_>>()
                };
                let push = output(Algorithm::RingPush, Family::Exact);
                assert!(push.iter().flatten().any(|&w| w != 0), "{op} D={d}: all zeros");
                for chunks in [1, 2, 3] {
                    let fused = Algorithm::FusedPush { chunks };
                    assert_eq!(output(fused, Family::Exact), push, "{op} D={d} {fused}");
                    let plan = build_plan(&p, fused).unwrap();
                    crate::testing::assert_matches_oracle(&plan, &p, 5, Family::Realistic);
                }
            }
        }
    }

    /// Partial sums in bf16: every GEMM+RS/AR algorithm stays within the derived bound in
    /// the realistic family, and its partial buffers really are bf16.
    #[test]
    fn bf16_partials_stay_within_their_bound() {
        use crate::workload::Workload;
        for op in [OpKind::GemmRs, OpKind::GemmAr] {
            for d in [1, 2, 4] {
                let p = Problem::new(op, d, 8 * d, 6 * d, 40 * d, DType::Bf16, DType::Bf16)
                    .and_then(|p| p.with_wire(DType::Bf16))
                    .unwrap();
                assert!(p.unsupported_family(Family::Exact).is_some());
                for alg in algorithms_for(op) {
                    if let Algorithm::RingAccumulate { .. } | Algorithm::RingPush | Algorithm::FusedPush { .. } = alg {
                        // Adding in the GEMM would round into bf16 twice: refused.
                        let refused = build_plan(&p, alg);
                        assert!(
                            matches!(refused, Err(AlgorithmError::NeedsF32Wire { wire: DType::Bf16, .. })),
                            "{refused:?}"
                        );
                        continue;
                    }
                    let plan = build_plan(&p, alg).unwrap();
                    assert_eq!(plan.buffer(plan.buffer_id("P").unwrap()).dtype, DType::Bf16, "{}", plan.name);
                    crate::testing::assert_matches_oracle(&plan, &p, 3, Family::Realistic);
                }
            }
        }
        let ag = Problem::new(OpKind::AgGemm, 2, 8, 8, 8, DType::Bf16, DType::Bf16).unwrap();
        assert!(ag.with_wire(DType::Bf16).is_err(), "ag_gemm sends no partial sums");
    }
}
