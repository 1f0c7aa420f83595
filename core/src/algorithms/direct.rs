//! The direct baselines: a plain collective, then the GEMM (or the GEMM, then the
//! collective), with no overlap and no ring. Every device copies its shard (or each
//! block of its partial) straight to the peer that needs it with the copy engine, one
//! signal per message, so the collective costs one wait instead of D − 1 dependent hops.
//! This is what "collective library, then cuBLAS" does on a fully connected NVLink
//! switch, and what the CUDA bench compares the overlapped plans with.

use super::ring::{ag_gemm_gathered, copy, signal, wait};
use super::{start_plan, Algorithm, AlgorithmError, BaselineSums};
use crate::dtype::DType;
use crate::plan::{BufferRole, LaneId, Op, Plan, PlanBuilder, Region, SemId};
use crate::problem::{OpKind, Problem};

use crate::plan::MAX_REDUCE_INPUTS as REDUCE_FAN_IN;

/// The peer device `d` sends to at `step` (1 ≤ step < D) of a direct plan. At every step
/// the D devices send to D distinct peers, and every aligned group of 2^j devices that
/// divides D (a node of a multi-node machine) keeps its copies inside for its first
/// 2^j − 1 steps and sends every later one out, all at the same step, each to a different
/// receiver. With 2^a the largest power of two dividing D, device d is place d mod 2^a of
/// block d / 2^a, and step s goes s / 2^a blocks on (mod D / 2^a) to place
/// (d mod 2^a) ⊕ (s mod 2^a): pairwise exchange where D is a power of two, d + s (mod D)
/// where D is odd. Under d + s alone, the senders of one node, each after its own number
/// of fast copies inside it, reach the same remote receiver within a few copies of one
/// another and share its NIC.
pub fn direct_peer(d: usize, step: usize, devices: usize) -> usize {
    // One device (or none) has no peer to send to.
    if devices < 2 {
        return d;
    }
    let block = 1 << devices.trailing_zeros();
    let blocks = devices / block;
    (d / block + step / block) % blocks * block + ((d % block) ^ (step % block))
}

/// The device that sends to `r` at `step` of a direct plan: the inverse of
/// [`direct_peer`] at that step (each step is a permutation of the devices).
fn direct_sender(r: usize, step: usize, devices: usize) -> usize {
    if devices < 2 {
        return r;
    }
    let block = 1 << devices.trailing_zeros();
    let blocks = devices / block;
    (r / block + blocks - step / block % blocks) % blocks * block + ((r % block) ^ (step % block))
}

/// The peers of `d` in the order it sends to them ([`direct_peer`]).
fn peers(d: usize, n: usize) -> impl Iterator<Item = usize> {
    (1..n).map(move |step| direct_peer(d, step, n))
}

/// Sends `src` to every peer's `dst` (the same region there), each copy followed by a
/// release of `sem` on that peer.
fn broadcast(b: &mut PlanBuilder, d: usize, lane: LaneId, sem: SemId, src: Region, dst: Region) {
    for e in peers(d, b.devices()) {
        b.push(d, lane, copy(src, e, dst));
        b.push(d, lane, signal(e, sem));
    }
}

/// AG+GEMM: own shard into the gathered buffer, a copy of it to every peer, one wait
/// for the D − 1 that arrive, then one GEMM over all rows.
pub(super) fn ag_gemm(p: &Problem) -> Result<Plan, AlgorithmError> {
    ag_gemm_gathered(p, Algorithm::BaselineDirect, &|b, d, lane, sem, own, blocks| {
        broadcast(b, d, lane, sem, own, blocks[d])
    })
}

/// GEMM+RS (and GEMM+AR): the whole partial product, block r of it copied to device r,
/// then the D partials of each block added up as a chain of `Reduce`s of at most
/// [`REDUCE_FAN_IN`] inputs (through an f32 accumulator); for AR, the reduced block is
/// then copied to every peer.
///
/// Where the chain has more than one `Reduce` (D > [`REDUCE_FAN_IN`]) and `sums` says so
/// ([`BaselineSums::direct_beside`]), each device adds the blocks up on a `sum` lane as they arrive,
/// in the order of the steps that send them (its own first), each `Reduce` once its
/// blocks are in: its sums overlap the copies still coming, as a library's direct
/// ReduceScatter adds what it receives as it comes, with the same `Reduce`s and bytes.
/// Each step's block is counted on a semaphore of its own (one count would not say which
/// block came). Otherwise one wait for all D − 1, then the sum in device order.
pub(super) fn gemm_reduce(p: &Problem, sums: BaselineSums) -> Result<Plan, AlgorithmError> {
    let (n, rows) = (p.devices, p.row_split());
    let mb = rows.max();
    let (mut b, a, bm, c) = start_plan(p, Algorithm::BaselineDirect);
    let partial = b.buffer("P", p.wire, p.m, p.n, BufferRole::Scratch);
    // Slot s of `recv` on device r holds the block sent by device r + 1 + s (mod D):
    // each a copy of block r, of its rows.
    let recv_buf = b.buffer("recv", p.wire, (n - 1) * mb, p.n, BufferRole::Scratch);
    let beside = sums.direct_beside(n, mb * p.n * p.wire.size_bytes());
    let chained = n > REDUCE_FAN_IN;
    let acc = chained.then(|| b.buffer("acc", DType::F32, mb, p.n, BufferRole::Scratch));
    let arrivals = Arrivals::declare(&mut b, n, beside);
    let ag = (p.op == OpKind::GemmAr && n > 1).then(|| b.semaphore("ag"));
    let main = b.lane("main");
    for d in 0..n {
        let (wa, wb, wp) = (b.whole(a), b.whole(bm), b.whole(partial));
        b.push(d, main, Op::gemm(wa, wb, wp));
        if let Arrivals::Beside { lane, ready, .. } = &arrivals {
            let (lane, ready) = (*lane, *ready);
            b.push(d, main, signal(d, ready));
            b.push(d, lane, wait(ready, 1));
        }
        for (step, r) in (1..n).map(|step| (step, direct_peer(d, step, n))) {
            let slot = (d + n - r - 1) % n;
            let (src, dst) = (b.rows(partial, rows.start(r), rows.len(r)), b.rows(recv_buf, slot * mb, rows.len(r)));
            b.push(d, main, copy(src, r, dst));
            b.push(d, main, signal(r, arrivals.sem(step)));
        }
        // Block d of device `src`'s partial: its own, or the copy in its slot.
        let term = |b: &PlanBuilder, src: usize| {
            if src == d {
                b.rows(partial, rows.start(d), rows.len(d))
            } else {
                b.rows(recv_buf, ((src + n - d - 1) % n) * mb, rows.len(d))
            }
        };
        let out =
            if p.op == OpKind::GemmAr { b.rows(c, rows.start(d), rows.len(d)) } else { b.rows(c, 0, rows.len(d)) };
        let acc = acc.map(|acc| b.rows(acc, 0, rows.len(d)));
        let order: Vec<usize> = match &arrivals {
            // Its own block first, then each step's as it comes.
            Arrivals::Beside { .. } => std::iter::once(d).chain((1..n).map(|step| direct_sender(d, step, n))).collect(),
            Arrivals::InSeries { .. } => (0..n).collect(),
        };
        let terms: Vec<Region> = order.iter().map(|&src| term(&b, src)).collect();
        match &arrivals {
            Arrivals::Beside { lane, reduced, .. } => {
                let (lane, reduced) = (*lane, *reduced);
                // Each sum waits for the steps whose blocks it adds, the last for the last.
                let mut arrived = 0;
                for (run, op) in direct_sum_runs(n).into_iter().zip(chained_sum(&terms, acc, out)) {
                    for step in arrived + 1..run.end {
                        b.push(d, lane, wait(arrivals.sem(step), 1));
                    }
                    arrived = run.end - 1;
                    b.push(d, lane, op);
                }
                b.push(d, lane, signal(d, reduced));
                b.push(d, main, wait(reduced, 1));
            }
            Arrivals::InSeries { recv } => {
                if n > 1 {
                    b.push(d, main, wait(*recv, (n - 1) as u32));
                }
                for op in chained_sum(&terms, acc, out) {
                    b.push(d, main, op);
                }
            }
        }
        if let Some(ag) = ag {
            broadcast(&mut b, d, main, ag, out, out);
            b.push(d, main, wait(ag, (n - 1) as u32));
        }
    }
    Ok(b.finish()?)
}

/// How a direct ReduceScatter counts what it receives.
enum Arrivals {
    /// One count of every block; the sum waits for all of them.
    InSeries { recv: SemId },
    /// A count for each step's block (`recv_step{step}`, `steps[step − 1]`), summed as it
    /// comes on `lane`, which starts once the partial is `ready` and ends the collective
    /// on `main` (`reduced`).
    Beside { lane: LaneId, ready: SemId, reduced: SemId, steps: Vec<SemId> },
}

impl Arrivals {
    fn declare(b: &mut PlanBuilder, devices: usize, beside: bool) -> Arrivals {
        if !beside {
            return Arrivals::InSeries { recv: b.semaphore("recv") };
        }
        let steps = (1..devices).map(|step| b.semaphore(&format!("recv_step{step}"))).collect();
        let (ready, reduced) = (b.semaphore("partial_ready"), b.semaphore("reduced"));
        Arrivals::Beside { lane: b.lane("sum"), ready, reduced, steps }
    }

    /// The semaphore that counts the block sent at `step` (1 ≤ step < D).
    fn sem(&self, step: usize) -> SemId {
        match self {
            Arrivals::InSeries { recv } => *recv,
            Arrivals::Beside { steps, .. } => steps[step - 1],
        }
    }
}

/// The terms each `Reduce` of the direct ReduceScatter's sum of `terms` blocks adds
/// ([`chained_sum`]): the first [`REDUCE_FAN_IN`], then up to `REDUCE_FAN_IN − 1` more
/// onto the running sum each. Summed as they arrive, term t is the block of step t (the
/// own block is term 0).
pub fn direct_sum_runs(terms: usize) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut start = 0;
    while start < terms {
        let end = if start == 0 { REDUCE_FAN_IN } else { start + REDUCE_FAN_IN - 1 }.min(terms);
        runs.push(start..end);
        start = end;
    }
    runs
}

/// `out = terms[0] + terms[1] + …` left to right as `Reduce` ops of at most
/// [`REDUCE_FAN_IN`] inputs ([`direct_sum_runs`]), the running sum kept in the f32 `acc`
/// between them.
pub(super) fn chained_sum(terms: &[Region], acc: Option<Region>, out: Region) -> Vec<Op> {
    let runs = direct_sum_runs(terms.len());
    let last = runs.len() - 1;
    runs.into_iter()
        .enumerate()
        .map(|(i, run)| {
            // Every Reduce but the first adds onto the running sum, every one but the last
            // writes it.
            let running = || acc.expect("a chained sum has an accumulator");
            let mut inputs: Vec<Region> = if i == 0 { vec![] } else { vec![running()] };
            inputs.extend_from_slice(&terms[run]);
            let output = if i == last { out } else { running() };
            Op::Reduce { inputs, output }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{build_plan, build_plan_with};
    use crate::cpu;
    use crate::generator::Family;
    use crate::schedule::schedule;
    use crate::verify::verify;

    fn problem(op: OpKind, d: usize, input: DType, output: DType) -> Problem {
        Problem::new(op, d, 4 * d, 4 * d, 4 * d, input, output).unwrap()
    }

    /// Every step is a permutation without fixed points, each device meets every peer
    /// once, and every aligned power-of-two group dividing D (a node) sends inside itself
    /// for exactly its first size − 1 steps, all devices alike.
    #[test]
    fn direct_peers_exchange_in_pairs_inside_every_aligned_group() {
        for n in 1..=48usize {
            for step in 1..n {
                let mut seen = vec![false; n];
                for d in 0..n {
                    let e = direct_peer(d, step, n);
                    assert!(e < n && e != d && !seen[e], "D={n} step {step}: device {d} sends to {e}");
                    seen[e] = true;
                }
            }
            for d in 0..n {
                for step in 1..n {
                    assert_eq!(
                        direct_sender(direct_peer(d, step, n), step, n),
                        d,
                        "D={n} step {step}: sender of {d}'s peer"
                    );
                }
                let mut met: Vec<usize> = peers(d, n).collect();
                met.sort_unstable();
                assert_eq!(met, (0..n).filter(|&e| e != d).collect::<Vec<_>>(), "D={n} device {d}");
            }
            let groups = (1..=n.trailing_zeros()).map(|j| 1usize << j);
            for g in groups {
                for step in 1..n {
                    let inside = (0..n).filter(|&d| d / g == direct_peer(d, step, n) / g).count();
                    let expected = if step < g { n } else { 0 };
                    assert_eq!(inside, expected, "D={n}, groups of {g}, step {step}: copies inside a group");
                }
            }
        }
    }

    #[test]
    fn direct_baselines_equal_the_ring_baselines_bit_for_bit_on_exact_inputs() {
        for op in [OpKind::AgGemm, OpKind::GemmRs, OpKind::GemmAr] {
            for d in [1, 2, 3, 5, 9, 10] {
                let p = problem(op, d, DType::Bf16, DType::F32);
                let direct = build_plan(&p, Algorithm::BaselineDirect).unwrap();
                let ring = build_plan(&p, Algorithm::Baseline).unwrap();
                let (x, y) = (cpu::run(&direct, 5, Family::Exact).unwrap(), cpu::run(&ring, 5, Family::Exact).unwrap());
                let (cx, cy) = (direct.output().unwrap().0, ring.output().unwrap().0);
                for dev in 0..d {
                    assert_eq!(x[dev][cx], y[dev][cy], "{op} D={d} device {dev}");
                }
                let s = schedule(&direct).unwrap();
                assert!(verify(&direct, &s).unwrap().is_empty(), "{op} D={d}: {:?}", verify(&direct, &s).unwrap());
            }
        }
    }

    /// Summed as they arrive, each `Reduce` waits for the steps whose blocks it adds:
    /// without the wait for any one step the verifier finds the sum reading a slot before
    /// its copy lands.
    #[test]
    fn sums_as_blocks_arrive_wait_for_each_of_their_steps() {
        let p = problem(OpKind::GemmRs, 7, DType::Bf16, DType::Bf16);
        let plan = build_plan_with(&p, Algorithm::BaselineDirect, BaselineSums::Beside).unwrap();
        let sum = plan.lanes.iter().position(|l| l == "sum").unwrap();
        let waits = |plan: &Plan| plan.programs[3].lanes[sum].iter().filter(|op| matches!(op, Op::Wait { .. })).count();
        // The partial's readiness, then one a step.
        assert_eq!(waits(&plan), 7);
        for step in 1..7 {
            let sem = plan.semaphores.iter().position(|s| *s == format!("recv_step{step}")).unwrap();
            let mut broken = plan.clone();
            broken.programs[3].lanes[sum].retain(|op| !matches!(op, Op::Wait { sem: s, .. } if s.0 == sem));
            let s = schedule(&broken).unwrap();
            assert!(!verify(&broken, &s).unwrap().is_empty(), "without the wait for step {step}");
        }
    }

    #[test]
    fn sums_beyond_the_fan_in_chain_through_an_f32_accumulator() {
        let p = problem(OpKind::GemmRs, 6, DType::F16, DType::F16);
        let plan = build_plan(&p, Algorithm::BaselineDirect).unwrap();
        let reduces: Vec<&Op> = plan.programs[0].lanes[0].iter().filter(|op| matches!(op, Op::Reduce { .. })).collect();
        assert_eq!(reduces.len(), 2);
        for op in &reduces {
            let Op::Reduce { inputs, .. } = op else { unreachable!() };
            assert!(inputs.len() <= REDUCE_FAN_IN);
        }
        let acc = plan.buffer_id("acc").unwrap();
        assert_eq!(plan.buffer(acc).dtype, DType::F32);
    }
}
