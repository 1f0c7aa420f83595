//! Plans of the attention family: the all-gather baseline, ring attention (one way and
//! both ways) and split-KV decode, built from [`Op::Attend`], [`Op::AttnMerge`] and
//! [`Op::AttnFinish`] plus the copies and semaphores every plan uses.
//!
//! Buffers per device: the inputs `Q.c`, `K.c`, `V.c` (one per chunk the device holds;
//! two in the balanced layout), the gathered key/value blocks `Kg`, `Vg` (one slot of
//! [`AttentionProblem::kv_rows`] rows per source device, chunks stacked), the f32 state
//! `m`, `l`, `acc` (one slot per device in split-KV, else one), and the outputs `O`,
//! `LSE`. A device's own keys are always read from its inputs.

use super::{AttentionAlgorithm, AttentionProblem, Chunk, Visibility, TENSOR_K, TENSOR_Q, TENSOR_V};
use crate::algorithms::ring::{copy, ring_all_gather, signal, wait, Ring};
use crate::dtype::DType;
use crate::plan::{AttnState, BufId, BufferRole, LaneId, Op, Plan, PlanBuilder, PlanError, Region};

/// A lower bound of the ops of every plan of `p` ([`crate::plan::check_op_bound`]): every
/// device attends to (or gathers) every other device's keys or partial state.
pub(crate) fn min_ops(p: &AttentionProblem) -> u128 {
    let d = p.devices as u128;
    d * (d - 1)
}

/// The plan of `alg` for `p`. Fails when the algorithm does not plan the problem's mode
/// (ring attention is for prefill, split-KV for decode).
pub fn build_attention_plan(p: &AttentionProblem, alg: AttentionAlgorithm) -> Result<Plan, PlanError> {
    let name = format!("attention/{alg} {}", p.describe());
    if !alg.plans(p) {
        return Err(PlanError::Mismatch {
            plan: name,
            site: crate::plan::OpSite { device: 0, lane: 0, index: 0 },
            detail: format!(
                "{alg} does not plan {} attention (prefill: baseline, ring, ring_bidir; decode: baseline, split_kv)",
                if p.queries.is_some() { "decode" } else { "prefill" }
            ),
        });
    }
    crate::plan::check_op_bound(|| name.clone(), min_ops(p))?;
    let mut b = PlanBuilder::new(name, p.devices);
    let io = Io::declare(&mut b, p, alg);
    let n = p.devices;
    match alg {
        AttentionAlgorithm::Baseline => {
            let main = b.lane("main");
            let sems: Vec<_> = (0..io.kv_chunks())
                .map(|c| (b.semaphore(&format!("kg.{c}")), b.semaphore(&format!("vg.{c}"))))
                .collect();
            for d in 0..n {
                let ring = Ring::all(n, d);
                for (c, &(ks, vs)) in sems.iter().enumerate() {
                    let (kb, vb): (Vec<_>, Vec<_>) = (0..n).map(|r| io.gathered(p, r, c)).unzip();
                    let (own_k, own_v) = io.own(p, d, c);
                    ring_all_gather(&mut b, &ring, main, ks, 0, own_k, &kb);
                    ring_all_gather(&mut b, &ring, main, vs, 0, own_v, &vb);
                }
                if n > 1 {
                    for &(ks, vs) in &sems {
                        b.push(d, main, wait(ks, n as u32 - 1));
                        b.push(d, main, wait(vs, n as u32 - 1));
                    }
                }
                // Every key chunk in position order.
                let mut blocks: Vec<(Chunk, usize, usize)> =
                    (0..n).flat_map(|r| p.kv_chunks(r).into_iter().enumerate().map(move |(c, k)| (k, r, c))).collect();
                blocks.sort_by_key(|(k, _, _)| k.pos);
                let mut fresh = vec![true; io.q_chunks()];
                for (k, r, c) in blocks {
                    let (kr, vr) = io.block(p, d, r, c);
                    io.attend(&mut b, p, d, main, 0, k, kr, vr, &mut fresh);
                }
                io.finish(&mut b, p, d, main, 0);
            }
        }
        AttentionAlgorithm::Ring | AttentionAlgorithm::RingBidir => {
            let compute = b.lane("compute");
            let bidir = alg == AttentionAlgorithm::RingBidir;
            let to_left = b.lane(if bidir { "comm_left" } else { "comm" });
            let to_right = bidir.then(|| b.lane("comm_right"));
            let from_right = b.semaphore("from_right");
            let from_left = b.semaphore("from_left");
            // Blocks travel left a hops (offsets +1..+a arrive from the right) and, both
            // ways, right b hops (offsets −1..−b arrive from the left).
            let (a, bl) = if bidir { (n / 2, (n - 1) / 2) } else { (n - 1, 0) };
            let passes = [Pass { n, hops: a, step: n - 1 }, Pass { n, hops: bl, step: 1 }];
            let sems = [from_right, from_left];
            for d in 0..n {
                let lanes = [Some(to_left), to_right];
                for ((pass, lane), sem) in passes.iter().zip(lanes).zip(sems) {
                    let Some(lane) = lane else { continue };
                    let to = (d + pass.step) % n;
                    for t in 0..pass.hops {
                        let blk = pass.block_at(d, t);
                        if !pass.useful(p, blk, t) {
                            continue;
                        }
                        if t > 0 {
                            b.push(d, lane, wait(sem, pass.arrivals(p, d, t)));
                        }
                        for c in 0..io.kv_chunks() {
                            let (src_k, src_v) = io.block(p, d, blk, c);
                            let (dst_k, dst_v) = io.gathered(p, blk, c);
                            b.push(d, lane, copy(src_k, to, dst_k));
                            b.push(d, lane, copy(src_v, to, dst_v));
                        }
                        b.push(d, lane, signal(to, sem));
                    }
                }
                // Own block, then the right and left neighbours' alternately.
                let mut order = vec![(d, None)];
                for i in 1..=a {
                    order.push((passes[0].block_at(d, i), Some((0, i))));
                    if i <= bl {
                        order.push((passes[1].block_at(d, i), Some((1, i))));
                    }
                }
                let mut fresh = vec![true; io.q_chunks()];
                for (r, arrival) in order {
                    if !p.needs(d, r) {
                        continue;
                    }
                    if let Some((dir, i)) = arrival {
                        b.push(d, compute, wait(sems[dir], passes[dir].arrivals(p, d, i)));
                    }
                    for (c, k) in p.kv_chunks(r).into_iter().enumerate() {
                        let (kr, vr) = io.block(p, d, r, c);
                        io.attend(&mut b, p, d, compute, 0, k, kr, vr, &mut fresh);
                    }
                }
                io.finish(&mut b, p, d, compute, 0);
            }
        }
        AttentionAlgorithm::SplitKv => {
            let compute = b.lane("compute");
            let comm = b.lane("comm");
            let done = b.semaphore("done");
            let states = b.semaphore("states");
            let sent = b.semaphore("sent");
            for d in 0..n {
                let k = p.kv_chunks(d)[0];
                let (kr, vr) = io.block(p, d, d, 0);
                // Every device writes its slot, even when the mask hides every key.
                let q0 = p.query_chunks(d)[0];
                let mask = p.visibility(q0, k).mask(q0, k);
                let q = b.whole(io.q[0]);
                b.push(d, compute, attend_op(p, q, kr, vr, io.state(d), mask, true));
                if n > 1 {
                    // The comm lane sends this device's partial to every peer's slot d
                    // while nothing else runs; the merges wait until the partials of all
                    // peers have arrived and its own has left (slot 0 is merged into).
                    b.push(d, compute, signal(d, done));
                    b.push(d, comm, wait(done, 1));
                    for e in (1..n).map(|i| (d + i) % n) {
                        for r in io.state(d).regions() {
                            b.push(d, comm, copy(r, e, r));
                        }
                        b.push(d, comm, signal(e, states));
                    }
                    b.push(d, comm, signal(d, sent));
                    b.push(d, compute, wait(states, n as u32 - 1));
                    b.push(d, compute, wait(sent, 1));
                }
                for r in 1..n {
                    b.push(d, compute, Op::AttnMerge { from: io.state(r), into: io.state(0), heads: p.heads });
                }
                io.finish(&mut b, p, d, compute, 0);
            }
        }
    }
    b.finish()
}

/// One direction of a ring pass: every block travels `hops` hops, each to the device
/// `step` positions on (n − 1: left, 1: right). A hop is sent only while some device
/// further along still needs the block (with a causal mask, the last device's block is
/// needed by nobody to its left), and waits count only the hops that are sent.
struct Pass {
    n: usize,
    hops: usize,
    step: usize,
}

impl Pass {
    /// The block device `d` holds after `t` hops (and receives as its arrival t).
    fn block_at(&self, d: usize, t: usize) -> usize {
        (d + t * (self.n - self.step)) % self.n
    }

    /// Whether hop `k` of block `blk` is sent: a recipient of it or of a later hop needs it.
    fn useful(&self, p: &AttentionProblem, blk: usize, k: usize) -> bool {
        (k..self.hops).any(|k2| p.needs((blk + (k2 + 1) * self.step) % self.n, blk))
    }

    /// The semaphore value at which device `d` has received its arrival `i` (1-based).
    fn arrivals(&self, p: &AttentionProblem, d: usize, i: usize) -> u32 {
        (1..=i).filter(|&j| self.useful(p, self.block_at(d, j), j - 1)).count() as u32
    }
}

fn attend_op(
    p: &AttentionProblem,
    q: Region,
    k: Region,
    v: Region,
    state: AttnState,
    causal: Option<crate::plan::Causal>,
    fresh: bool,
) -> Op {
    Op::Attend { q, k, v, state, heads: p.heads, kv_heads: p.kv_heads, causal, fresh }
}

/// The buffers of a plan.
struct Io {
    q: Vec<BufId>,
    k: Vec<BufId>,
    v: Vec<BufId>,
    kg: BufId,
    vg: BufId,
    m: BufId,
    l: BufId,
    acc: BufId,
    o: BufId,
    lse: BufId,
    /// Rows of one state slot (the largest device's output rows).
    rows: usize,
    heads: usize,
    head_dim: usize,
}

impl Io {
    fn declare(b: &mut PlanBuilder, p: &AttentionProblem, alg: AttentionAlgorithm) -> Io {
        let n = p.devices;
        let (qc, kc) = (p.q_cols(), p.kv_cols());
        let input = |tensor: u32, cols: usize, origins: Vec<(usize, usize)>| BufferRole::Input {
            tensor,
            global_cols: cols,
            origins,
        };
        // One input buffer per chunk a device holds, as long as the longest device's
        // chunk, each device's own length declared (uneven chunks).
        let chunked = |b: &mut PlanBuilder, name: &str, tensor, cols, chunks: &dyn Fn(usize) -> Vec<Chunk>| {
            (0..chunks(0).len())
                .map(|c| {
                    let rows = (0..n).map(|d| chunks(d)[c].rows).collect();
                    let origins = (0..n).map(|d| (chunks(d)[c].pos, 0)).collect();
                    b.sharded_buffer(&format!("{name}.{c}"), p.dtype, rows, cols, input(tensor, cols, origins))
                })
                .collect::<Vec<BufId>>()
        };
        // Q's global row r is position query_pos0() + r.
        let q_rows = |d: usize| {
            let chunks = p.query_chunks(d);
            chunks.into_iter().map(|c| Chunk { pos: c.pos - p.query_pos0(), rows: c.rows }).collect()
        };
        let q = chunked(b, "Q", TENSOR_Q, qc, &q_rows);
        let k = chunked(b, "K", TENSOR_K, kc, &|d| p.kv_chunks(d));
        let v = chunked(b, "V", TENSOR_V, kc, &|d| p.kv_chunks(d));
        let gathered_rows = if n > 1 && alg != AttentionAlgorithm::SplitKv { n * p.kv_rows() } else { 0 };
        let kg = b.buffer("Kg", p.dtype, gathered_rows, kc, BufferRole::Scratch);
        let vg = b.buffer("Vg", p.dtype, gathered_rows, kc, BufferRole::Scratch);
        let rows = p.out_rows();
        let slots = if alg == AttentionAlgorithm::SplitKv { n } else { 1 };
        let m = b.buffer("m", DType::F32, slots * rows, p.heads, BufferRole::Scratch);
        let l = b.buffer("l", DType::F32, slots * rows, p.heads, BufferRole::Scratch);
        let acc = b.buffer("acc", DType::F32, slots * rows, qc, BufferRole::Scratch);
        let out_rows = || (0..n).map(|d| p.out_rows_on(d)).collect();
        let o = b.sharded_buffer("O", p.dtype, out_rows(), qc, BufferRole::Output);
        let lse = b.sharded_buffer("LSE", DType::F32, out_rows(), p.heads, BufferRole::Output);
        Io { q, k, v, kg, vg, m, l, acc, o, lse, rows, heads: p.heads, head_dim: p.head_dim }
    }

    fn q_chunks(&self) -> usize {
        self.q.len()
    }

    fn kv_chunks(&self) -> usize {
        self.k.len()
    }

    /// Rows `[row0, row0 + rows)` of state slot `slot`.
    fn state_rows(&self, slot: usize, row0: usize, rows: usize) -> AttnState {
        let r0 = slot * self.rows + row0;
        let (h, w) = (self.heads, self.heads * self.head_dim);
        let region = |buf, cols: usize| Region { buf, offset: r0 * cols, rows, cols, stride: cols };
        AttnState { max: region(self.m, h), sum: region(self.l, h), acc: region(self.acc, w) }
    }

    fn state(&self, slot: usize) -> AttnState {
        self.state_rows(slot, 0, self.rows)
    }

    /// Device `d`'s own K and V rows of chunk `c`.
    fn own(&self, p: &AttentionProblem, d: usize, c: usize) -> (Region, Region) {
        let rows = p.kv_chunks(d)[c].rows;
        let cols = p.kv_cols();
        let r = |buf| Region { buf, offset: 0, rows, cols, stride: cols };
        (r(self.k[c]), r(self.v[c]))
    }

    /// Where chunk `c` of source device `r` lands in the gathered scratch.
    fn gathered(&self, p: &AttentionProblem, r: usize, c: usize) -> (Region, Region) {
        let chunks = p.kv_chunks(r);
        let row0 = r * p.kv_rows() + chunks[..c].iter().map(|k| k.rows).sum::<usize>();
        let cols = p.kv_cols();
        let reg = |buf| Region { buf, offset: row0 * cols, rows: chunks[c].rows, cols, stride: cols };
        (reg(self.kg), reg(self.vg))
    }

    /// Chunk `c` of source device `r`'s keys and values as device `d` reads them.
    fn block(&self, p: &AttentionProblem, d: usize, r: usize, c: usize) -> (Region, Region) {
        if r == d {
            self.own(p, d, c)
        } else {
            self.gathered(p, r, c)
        }
    }

    /// Attends every query chunk of device `d` to one key chunk, skipping pairs the
    /// causal mask hides entirely; `fresh[qi]` tracks which states are still unwritten.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        b: &mut PlanBuilder,
        p: &AttentionProblem,
        d: usize,
        lane: LaneId,
        slot: usize,
        k: Chunk,
        kr: Region,
        vr: Region,
        fresh: &mut [bool],
    ) {
        let mut row0 = 0;
        for (qi, qc) in p.query_chunks(d).into_iter().enumerate() {
            let visibility = p.visibility(qc, k);
            if visibility != Visibility::Hidden {
                let mask = visibility.mask(qc, k);
                let q = b.rows(self.q[qi], 0, qc.rows);
                let state = self.state_rows(slot, row0, qc.rows);
                b.push(d, lane, attend_op(p, q, kr, vr, state, mask, fresh[qi]));
                fresh[qi] = false;
            }
            row0 += qc.rows;
        }
    }

    /// Normalises device `d`'s rows of state slot `slot` into O and LSE.
    fn finish(&self, b: &mut PlanBuilder, p: &AttentionProblem, d: usize, lane: LaneId, slot: usize) {
        let rows = p.out_rows_on(d);
        let (out, lse) = (b.rows(self.o, 0, rows), b.rows(self.lse, 0, rows));
        let state = self.state_rows(slot, 0, rows);
        b.push(d, lane, Op::AttnFinish { state, out, lse, heads: self.heads });
    }
}
