//! The five 2D algorithms of seed 002 for the three dataflows, as plans.
//!
//! Every plan has one lane per mesh direction plus a compute lane, so the two directions
//! communicate concurrently, and a second lane for each collective AllGather, which goes
//! both ways round its ring; row and column sub-rings have their own semaphores, each
//! signalled by exactly one lane of one peer (so a wait for value v always acquires the
//! same v signals, whatever the interleaving). Scratch slots are never reused, so no
//! plan needs back-pressure. The ring collectives are the 1D helpers of
//! [`crate::algorithms::ring`] run over a mesh row or column.
//!
//! OS is written directly. LS and RS are one logical form ([`Flow`]): the stationary
//! operand S (p×q) times the transpose of the moving operand gathered along one axis,
//! GM (G×q), is the partial P (p×G), reduce-scattered along the other axis into C blocks
//! (p×G/n). LS (C = A·Bᵀ) stores those matrices as they are; RS (C = Aᵀ·B, i.e.
//! Cᵀ = Bᵀ·(Aᵀ)ᵀ) is the same computation with every matrix stored transposed.

use super::{Dataflow, MeshAlgorithm, MeshError, MeshProblem, WangRing};
use crate::algorithms::ring::{
    copy, merge_pieces, ring_all_gather_both_ways, ring_broadcast, ring_gather_stepwise, ring_reduce_scatter_both_ways,
    ring_reduce_to, signal, sub, wait, OverlappedReduce, Ring, SumLane, SumSlots,
};
use crate::algorithms::{input_buffer, output_buffer};
use crate::dtype::DType;
use crate::plan::{BufId, BufferRole, LaneId, Op, Plan, PlanBuilder, Region, SemId};
use crate::problem::Window;

/// A lower bound of the ops of `algorithm`'s plan of `p` ([`crate::plan::check_op_bound`]):
/// every chip receives from the other chips of its row and of its column, in each of
/// MeshSlice's slices; halved, to stay below whatever an algorithm merges.
pub(crate) fn min_ops(p: &MeshProblem, algorithm: MeshAlgorithm) -> u128 {
    let slices = match algorithm {
        MeshAlgorithm::MeshSlice { slices, .. } => slices as u128,
        _ => 1,
    };
    p.devices() as u128 * (p.nr + p.nc - 2) as u128 * slices / 2
}

/// Builds the plan of `algorithm` for `problem`.
pub fn build_mesh_plan(problem: &MeshProblem, algorithm: MeshAlgorithm) -> Result<Plan, MeshError> {
    let p = problem;
    let name = format!("mesh_gemm/{}/{algorithm} {}", p.dataflow, p.shape_string());
    crate::plan::check_op_bound(|| name.clone(), min_ops(p, algorithm))?;
    let os = p.dataflow == Dataflow::Os;
    let plan = match algorithm {
        MeshAlgorithm::Collective => {
            // MeshSlice with one slice is the collective algorithm: one AllGather or
            // ReduceScatter per direction, the GEMM between them, nothing to overlap.
            let (_, [(_, along_rows), (_, along_cols)]) = p.sliced_dimension();
            let slicing = Slicing { slices: 1, block: gcd(along_rows, along_cols) };
            if os {
                os_meshslice(p, name, slicing)?
            } else {
                flow_meshslice(p, name, slicing)?
            }
        }
        MeshAlgorithm::MeshSlice { slices, block } => {
            let slicing = Slicing::check(p, slices, block)?;
            if os {
                os_meshslice(p, name, slicing)?
            } else {
                flow_meshslice(p, name, slicing)?
            }
        }
        MeshAlgorithm::Summa if os => os_summa(p, name)?,
        MeshAlgorithm::Summa => flow_summa(p, name)?,
        MeshAlgorithm::Cannon => {
            if p.nr != p.nc {
                return Err(MeshError::NotSquare { nr: p.nr, nc: p.nc });
            }
            if os {
                os_cannon(p, name)?
            } else {
                flow_cannon(p, name)?
            }
        }
        // Wang decomposes one direction (for LS the mesh row carries the ReduceScatter of
        // C and the column the AllGather of B; for RS the row the AllGather of A and the
        // column the ReduceScatter of C); the other direction is one collective.
        MeshAlgorithm::Wang { ring, bidir } => {
            let ring = match ring {
                WangRing::Rows => Axis::Row,
                WangRing::Columns => Axis::Col,
            };
            if os {
                os_wang(p, name, ring, bidir)?
            } else if Flow::of(p).reduce == ring {
                flow_wang_decomposed_reduce(p, name, bidir)?
            } else {
                flow_wang_decomposed_gather(p, name, bidir)?
            }
        }
    };
    Ok(plan)
}

/// Greatest common divisor.
pub fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Least common multiple.
pub fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

/// A mesh direction: the sub-ring within a mesh row (horizontal, the chip's position is
/// its column j) or within a mesh column (vertical, position i).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Axis {
    Row,
    Col,
}

impl Axis {
    /// Chips along this axis.
    fn len(self, p: &MeshProblem) -> usize {
        match self {
            Axis::Row => p.nc,
            Axis::Col => p.nr,
        }
    }

    /// The sub-ring of `device` along this axis, in increasing position; messages go to
    /// the previous chip (left in a row, up in a column).
    fn ring(self, p: &MeshProblem, device: usize) -> Ring {
        let (i, j) = p.chip(device);
        match self {
            Axis::Row => Ring { members: (0..p.nc).map(|c| p.device(i, c)).collect(), pos: j },
            Axis::Col => Ring { members: (0..p.nr).map(|r| p.device(r, j)).collect(), pos: i },
        }
    }

    fn name(self) -> &'static str {
        match self {
            Axis::Row => "row",
            Axis::Col => "col",
        }
    }

    /// The other direction.
    fn other(self) -> Axis {
        match self {
            Axis::Row => Axis::Col,
            Axis::Col => Axis::Row,
        }
    }
}

/// MeshSlice's S slices of block size B: slice s of the sliced dimension is
/// { x : (x / B) mod S = s }, the same set whichever chip's extent it is cut from.
#[derive(Clone, Copy, Debug)]
struct Slicing {
    slices: usize,
    block: usize,
}

impl Slicing {
    fn check(p: &MeshProblem, slices: usize, block: usize) -> Result<Slicing, MeshError> {
        if slices == 0 || block == 0 {
            return Err(MeshError::ZeroSlicing { slices, block });
        }
        let (dim, extents) = p.sliced_dimension();
        for (what, size) in extents {
            // A product that overflows exceeds every extent: indivisible too.
            if slices.checked_mul(block).is_none_or(|period| size % period != 0) {
                return Err(MeshError::SliceIndivisible { dataflow: p.dataflow, dim, what, size, slices, block });
            }
        }
        Ok(Slicing { slices, block })
    }

    /// Blocks of slice s in an extent of `extent` indices: block u starts at u·S·B + s·B
    /// there and at u·B in the slice's packed (natural order) form.
    fn blocks(&self, extent: usize) -> usize {
        extent / (self.slices * self.block)
    }
}

/// Pushes the copies of a list of (source, destination) pieces on `device`'s `lane`,
/// merged into one copy where the pieces form one 2D region on both sides.
fn push_copies(b: &mut PlanBuilder, device: usize, lane: LaneId, pieces: Vec<Vec<Region>>) {
    for piece in merge_pieces(pieces) {
        b.push(device, lane, copy(piece[0], device, piece[1]));
    }
}

/// Where the OS sum of several GEMMs accumulates: C itself when it is f32 or when a
/// single GEMM writes it (rounded once); otherwise an f32 accumulator converted into C
/// at the end, so that C is still rounded only once.
struct OsTarget {
    c: BufId,
    acc: Option<BufId>,
}

impl OsTarget {
    fn new(b: &mut PlanBuilder, p: &MeshProblem, c: BufId, gemms: usize) -> OsTarget {
        let acc = (gemms > 1 && p.output != DType::F32).then(|| {
            let w = p.output_window(0);
            b.buffer("ACC", DType::F32, w.rows, w.cols, BufferRole::Scratch)
        });
        OsTarget { c, acc }
    }

    /// Step `t` of the sum: `target (+)= a · b`.
    fn gemm(&self, b: &PlanBuilder, t: usize, a: Region, bm: Region) -> Op {
        let c = b.whole(self.acc.unwrap_or(self.c));
        Op::Gemm { a, b: bm, c, trans_a: false, trans_b: false, accumulate: t > 0, fused: None, c_device: None }
    }

    /// Converts the accumulator into C, if there is one.
    fn finish(&self, b: &mut PlanBuilder, device: usize, lane: LaneId) {
        if let Some(acc) = self.acc {
            let (src, dst) = (b.whole(acc), b.whole(self.c));
            b.push(device, lane, Op::Reduce { inputs: vec![src], output: dst });
        }
    }
}

/// What every OS plan declares: its operands A, B and C, and the row, column and compute
/// lanes.
struct Os {
    a: BufId,
    bm: BufId,
    c: BufId,
    row_lane: LaneId,
    col_lane: LaneId,
    compute: LaneId,
}

impl Os {
    fn start(p: &MeshProblem, name: String) -> (PlanBuilder, Os) {
        let mut b = PlanBuilder::new(name, p.devices());
        let (a, bm, c) = (input_buffer(&mut b, p, 0), input_buffer(&mut b, p, 1), output_buffer(&mut b, p));
        let (row_lane, col_lane, compute) = (b.lane("row"), b.lane("col"), b.lane("compute"));
        (b, Os { a, bm, c, row_lane, col_lane, compute })
    }
}

/// The gathered operands of an OS plan that collects A along its mesh row (GA, M/Nr × K)
/// and B along its mesh column (GB, K × N/Nc), with the semaphores counting arrivals.
struct Gathered {
    ga: BufId,
    gb: BufId,
    row_recv: SemId,
    col_recv: SemId,
}

impl Gathered {
    fn declare(b: &mut PlanBuilder, p: &MeshProblem) -> Gathered {
        let ga = b.buffer("GA", p.input, p.m / p.nr, p.k, BufferRole::Scratch);
        let gb = b.buffer("GB", p.input, p.k, p.n / p.nc, BufferRole::Scratch);
        Gathered { ga, gb, row_recv: b.semaphore("row_recv"), col_recv: b.semaphore("col_recv") }
    }
}

/// OS MeshSlice (and, with one slice, OS Collective): for each slice s, the row lane
/// packs slice s of A_ij (columns u·S·B + s·B …) into this chip's slot of slice s of GA
/// and all-gathers it over the mesh row, both ways round (the second way on the
/// `row_back` lane); the column lane does the same for the rows of B_ij over the mesh
/// column; the compute lane adds GA_s · GB_s into C as soon as both slices have arrived,
/// while the lanes already move slice s+1.
fn os_meshslice(p: &MeshProblem, name: String, sl: Slicing) -> Result<Plan, MeshError> {
    let (nr, nc, k) = (p.nr, p.nc, p.k);
    let (mb, kc, kr) = (p.m / nr, k / nc, k / nr);
    let (slices, blk) = (sl.slices, sl.block);
    let ks = k / slices;
    let (mut b, Os { a, bm, c, row_lane, col_lane, compute }) = Os::start(p, name);
    let Gathered { ga, gb, row_recv, col_recv } = Gathered::declare(&mut b, p);
    let target = OsTarget::new(&mut b, p, c, slices);
    let a_packed = b.semaphore("a_packed");
    let b_packed = b.semaphore("b_packed");
    // Each gather goes both ways round its ring, the second way on a lane and a count of
    // its own.
    let (row_back, col_back) = (b.lane("row_back"), b.lane("col_back"));
    let (row_back_recv, col_back_recv) = (b.semaphore("row_back_recv"), b.semaphore("col_back_recv"));
    for d in 0..p.devices() {
        let (row, col) = (Axis::Row.ring(p, d), Axis::Col.ring(p, d));
        let (i, j) = p.chip(d);
        for s in 0..slices {
            // Slice s of the gathered K: chip x's part of it at offset s·K/S + x·(its
            // extent)/S, in natural order, so GA_s's columns and GB_s's rows coincide.
            let a_slots: Vec<Region> =
                (0..nc).map(|x| b.window(ga, 0, s * ks + x * kc / slices, mb, kc / slices)).collect();
            let pieces = (0..sl.blocks(kc))
                .map(|u| {
                    vec![
                        b.window(a, 0, u * slices * blk + s * blk, mb, blk),
                        b.window(ga, 0, s * ks + j * kc / slices + u * blk, mb, blk),
                    ]
                })
                .collect();
            push_copies(&mut b, d, row_lane, pieces);
            b.push(d, row_lane, signal(d, a_packed));
            if nc > 1 {
                b.push(d, row_back, wait(a_packed, (s + 1) as u32));
            }
            let (lanes, sems) = ([row_lane, row_back], [row_recv, row_back_recv]);
            ring_all_gather_both_ways(&mut b, &row, lanes, sems, (s * (nc - 1)) as u32, a_slots[j], &a_slots);

            let b_slots: Vec<Region> = (0..nr).map(|x| b.rows(gb, s * ks + x * kr / slices, kr / slices)).collect();
            let pieces = (0..sl.blocks(kr))
                .map(|u| {
                    vec![
                        b.rows(bm, u * slices * blk + s * blk, blk),
                        b.rows(gb, s * ks + i * kr / slices + u * blk, blk),
                    ]
                })
                .collect();
            push_copies(&mut b, d, col_lane, pieces);
            b.push(d, col_lane, signal(d, b_packed));
            if nr > 1 {
                b.push(d, col_back, wait(b_packed, (s + 1) as u32));
            }
            let (lanes, sems) = ([col_lane, col_back], [col_recv, col_back_recv]);
            ring_all_gather_both_ways(&mut b, &col, lanes, sems, (s * (nr - 1)) as u32, b_slots[i], &b_slots);

            b.push(d, compute, wait(a_packed, (s + 1) as u32));
            if nc > 1 {
                b.push(d, compute, wait(row_recv, ((s + 1) * (nc - 1)) as u32));
                b.push(d, compute, wait(row_back_recv, ((s + 1) * (nc - 1)) as u32));
            }
            b.push(d, compute, wait(b_packed, (s + 1) as u32));
            if nr > 1 {
                b.push(d, compute, wait(col_recv, ((s + 1) * (nr - 1)) as u32));
                b.push(d, compute, wait(col_back_recv, ((s + 1) * (nr - 1)) as u32));
            }
            let (ga_s, gb_s) = (b.window(ga, 0, s * ks, mb, ks), b.rows(gb, s * ks, ks));
            let op = target.gemm(&b, s, ga_s, gb_s);
            b.push(d, compute, op);
        }
        target.finish(&mut b, d, compute);
    }
    Ok(b.finish()?)
}

/// The operand of step t of a broadcast or shift sequence on the compute lane: the
/// chip's own data, or a received region after the wait that guards it.
fn received(b: &mut PlanBuilder, device: usize, lane: LaneId, guard: Option<(SemId, u32)>, region: Region) -> Region {
    if let Some((sem, value)) = guard {
        b.push(device, lane, wait(sem, value));
    }
    region
}

/// OS SUMMA: the gathered K is cut into T = lcm(Nr, Nc) panels of K/T; at step t the
/// owner of A's panel t broadcasts it along its mesh row, the owner of B's panel t along
/// its mesh column, and every chip adds the panel product into C.
fn os_summa(p: &MeshProblem, name: String) -> Result<Plan, MeshError> {
    let (nr, nc, k) = (p.nr, p.nc, p.k);
    let (mb, kc, kr) = (p.m / nr, k / nc, k / nr);
    let steps = lcm(nr, nc);
    let w = k / steps;
    let (mut b, Os { a, bm, c, row_lane, col_lane, compute }) = Os::start(p, name);
    let Gathered { ga, gb, row_recv, col_recv } = Gathered::declare(&mut b, p);
    let target = OsTarget::new(&mut b, p, c, steps);
    for d in 0..p.devices() {
        let (row, col) = (Axis::Row.ring(p, d), Axis::Col.ring(p, d));
        let a_panels: Vec<Panel> = (0..steps)
            .map(|t| {
                let root = t * w / kc;
                let src = b.window(a, 0, t * w - root * kc, mb, w);
                Panel { root, src, dst: b.window(ga, 0, t * w, mb, w) }
            })
            .collect();
        let b_panels: Vec<Panel> = (0..steps)
            .map(|t| {
                let root = t * w / kr;
                Panel { root, src: b.rows(bm, t * w - root * kr, w), dst: b.rows(gb, t * w, w) }
            })
            .collect();
        let a_guards = broadcast_panels(&mut b, &row, row_lane, row_recv, &a_panels);
        let b_guards = broadcast_panels(&mut b, &col, col_lane, col_recv, &b_panels);
        for t in 0..steps {
            let a_t = received(&mut b, d, compute, a_guards[t], a_panels[t].operand(a_guards[t]));
            let b_t = received(&mut b, d, compute, b_guards[t], b_panels[t].operand(b_guards[t]));
            let op = target.gemm(&b, t, a_t, b_t);
            b.push(d, compute, op);
        }
        target.finish(&mut b, d, compute);
    }
    Ok(b.finish()?)
}

/// One panel of a SUMMA broadcast: the ring position of the chip that owns it, where it
/// lies there, and where every chip receives it.
#[derive(Clone, Copy, Debug)]
struct Panel {
    root: usize,
    src: Region,
    dst: Region,
}

impl Panel {
    /// The region a chip computes with: the received copy, or its own where it is the root.
    fn operand(&self, guard: Option<(SemId, u32)>) -> Region {
        if guard.is_some() {
            self.dst
        } else {
            self.src
        }
    }
}

/// A chip's part of the ring broadcasts of `panels`, served on `lane` in order of hops
/// from each panel's root, then of panel: each chip then forwards the panels in the order
/// its sender delivers them (the sender serves the same order one hop nearer the roots),
/// so no panel waits on the lane behind one that is still hops away. In panel order a
/// chip far down one panel's chain held every later panel back: GPT-3's qkv forward as
/// OS SUMMA on 32 × 8 TPU v4 chips simulated 2.7 times as long (43.9 ms against 16.2).
/// Returns, per panel, the wait that guards its arrival on the chip (`None` where the
/// chip is the root).
fn broadcast_panels(
    b: &mut PlanBuilder,
    ring: &Ring,
    lane: LaneId,
    sem: SemId,
    panels: &[Panel],
) -> Vec<Option<(SemId, u32)>> {
    let n = ring.len();
    let mut order: Vec<usize> = (0..panels.len()).collect();
    order.sort_by_key(|&t| ((panels[t].root + n - ring.pos) % n, t));
    let mut guards = vec![None; panels.len()];
    let mut arrived = 0;
    for t in order {
        let Panel { root, src, dst } = panels[t];
        if ring_broadcast(b, ring, lane, sem, arrived, root, src, dst) {
            arrived += 1;
            guards[t] = Some((sem, arrived));
        }
    }
    guards
}

/// Slots of Cannon's moving operand: slot 0 receives the skewed block, slot t+1 the
/// block shifted in after step t. `own` is the chip's own block.
struct CannonMover {
    own: Region,
    slots: Vec<Region>,
    skew_sem: SemId,
    shift_sem: SemId,
}

impl CannonMover {
    /// The mover lane: sends the own block `skew` positions left along `ring` (unless
    /// skew is 0, when the chip keeps it), then passes the current block one position
    /// left after each step but the last.
    fn lane(&self, b: &mut PlanBuilder, ring: &Ring, lane: LaneId, skew: usize) {
        let (n, me) = (ring.len(), ring.me());
        if skew % n != 0 {
            let target = ring.at(n - skew % n);
            b.push(me, lane, copy(self.own, target, self.slots[0]));
            b.push(me, lane, signal(target, self.skew_sem));
        }
        for t in 0..n - 1 {
            let current = self.operand(b, me, lane, skew % n, t);
            b.push(me, lane, copy(current, ring.left(), self.slots[t + 1]));
            b.push(me, lane, signal(ring.left(), self.shift_sem));
        }
    }

    /// The block of step t on `lane`, after the wait that guards it.
    fn operand(&self, b: &mut PlanBuilder, me: usize, lane: LaneId, skew: usize, t: usize) -> Region {
        match (t, skew) {
            (0, 0) => self.own,
            (0, _) => received(b, me, lane, Some((self.skew_sem, 1)), self.slots[0]),
            _ => received(b, me, lane, Some((self.shift_sem, t as u32)), self.slots[t]),
        }
    }
}

/// OS Cannon on an n×n mesh: A_ij is skewed i chips left and B_ij j chips up, so that
/// chip (i, j) starts with A_{i,i+j} and B_{i+j,j}; then n steps multiply and add into C
/// while A shifts one chip left and B one chip up.
fn os_cannon(p: &MeshProblem, name: String) -> Result<Plan, MeshError> {
    let n = p.nr;
    let (mb, nb, kb) = (p.m / n, p.n / n, p.k / n);
    let (mut b, Os { a, bm, c, row_lane, col_lane, compute }) = Os::start(p, name);
    let sa = b.buffer("SA", p.input, n * mb, kb, BufferRole::Scratch);
    let sb = b.buffer("SB", p.input, n * kb, nb, BufferRole::Scratch);
    let target = OsTarget::new(&mut b, p, c, n);
    let a_skew = b.semaphore("a_skew");
    let a_shift = b.semaphore("a_shift");
    let b_skew = b.semaphore("b_skew");
    let b_shift = b.semaphore("b_shift");
    let a_mover = CannonMover {
        own: b.whole(a),
        slots: (0..n).map(|t| b.rows(sa, t * mb, mb)).collect(),
        skew_sem: a_skew,
        shift_sem: a_shift,
    };
    let b_mover = CannonMover {
        own: b.whole(bm),
        slots: (0..n).map(|t| b.rows(sb, t * kb, kb)).collect(),
        skew_sem: b_skew,
        shift_sem: b_shift,
    };
    for d in 0..p.devices() {
        let (i, j) = p.chip(d);
        a_mover.lane(&mut b, &Axis::Row.ring(p, d), row_lane, i);
        b_mover.lane(&mut b, &Axis::Col.ring(p, d), col_lane, j);
        for t in 0..n {
            let a_t = a_mover.operand(&mut b, d, compute, i % n, t);
            let b_t = b_mover.operand(&mut b, d, compute, j % n, t);
            let op = target.gemm(&b, t, a_t, b_t);
            b.push(d, compute, op);
        }
        target.finish(&mut b, d, compute);
    }
    Ok(b.finish()?)
}

/// OS Wang with the `ring` direction decomposed. Rows: B is all-gathered over the mesh
/// column first (one collective, both ways round), while A travels around the mesh row
/// shard by shard (the 1D AG+GEMM ring; both ways round when `bidir`), each arrival's
/// GEMM overlapping the next shards' transfers. Columns: the same with the roles of A
/// (gathered over the row) and B (travelling around the column) swapped.
fn os_wang(p: &MeshProblem, name: String, ring: Axis, bidir: bool) -> Result<Plan, MeshError> {
    let (nr, nc, k) = (p.nr, p.nc, p.k);
    let (mb, kc, kr) = (p.m / nr, k / nc, k / nr);
    let (mut b, Os { a, bm, c, row_lane, col_lane, compute }) = Os::start(p, name);
    let Gathered { ga, gb, row_recv, col_recv } = Gathered::declare(&mut b, p);
    let target = OsTarget::new(&mut b, p, c, ring.len(p));
    let ready = b.semaphore(if ring == Axis::Row { "b_ready" } else { "a_ready" });
    // The collective goes both ways round its ring, and so does the ring when `bidir`,
    // each second way on a lane and a count of its own.
    let mut back = |axis: Axis, lane: LaneId, sem: SemId| {
        if axis == ring && !bidir {
            (lane, sem)
        } else {
            (b.lane(&format!("{}_back", axis.name())), b.semaphore(&format!("{}_back_recv", axis.name())))
        }
    };
    let (col_back, col_back_recv) = back(Axis::Col, col_lane, col_recv);
    let (row_back, row_back_recv) = back(Axis::Row, row_lane, row_recv);
    let a_blocks: Vec<Region> = (0..nc).map(|x| b.window(ga, 0, x * kc, mb, kc)).collect();
    let b_blocks: Vec<Region> = (0..nr).map(|x| b.rows(gb, x * kr, kr)).collect();
    // Per direction: its lanes, its counts, the operand moving along it and its blocks.
    let row_side = ([row_lane, row_back], [row_recv, row_back_recv], a, &a_blocks);
    let col_side = ([col_lane, col_back], [col_recv, col_back_recv], bm, &b_blocks);
    let (ring_side, collective_side) = if ring == Axis::Row { (row_side, col_side) } else { (col_side, row_side) };
    let (ring_lanes, ring_sems, ring_operand, ring_blocks) = ring_side;
    let (lanes, sems, operand, blocks) = collective_side;
    for d in 0..p.devices() {
        let (ring_of_d, other) = (ring.ring(p, d), ring.other().ring(p, d));
        let own = b.whole(ring_operand);
        let arrivals = ring_gather_stepwise(&mut b, &ring_of_d, ring_lanes, ring_sems, own, ring_blocks, bidir);

        let own_other = b.whole(operand);
        b.push(d, lanes[0], copy(own_other, d, blocks[other.pos]));
        ring_all_gather_both_ways(&mut b, &other, lanes, sems, 0, own_other, blocks);
        if other.len() > 1 {
            for sem in sems {
                b.push(d, lanes[0], wait(sem, (other.len() - 1) as u32));
            }
        }
        b.push(d, lanes[0], signal(d, ready));

        b.push(d, compute, wait(ready, 1));
        for (t, (x, guard)) in arrivals.into_iter().enumerate() {
            let moving = received(&mut b, d, compute, guard, if t == 0 { own } else { ring_blocks[x] });
            // Step t multiplies K block x of the ring's operand by the same K block of the
            // gathered one: columns of GA (K/Nr wide) or rows of GB (K/Nc tall).
            let (a_t, b_t) = match ring {
                Axis::Row => (moving, b.rows(gb, x * kc, kc)),
                Axis::Col => (b.window(ga, 0, x * kr, mb, kr), moving),
            };
            let op = target.gemm(&b, t, a_t, b_t);
            b.push(d, compute, op);
        }
        target.finish(&mut b, d, compute);
    }
    Ok(b.finish()?)
}

/// LS and RS in one logical form (see the module documentation).
#[derive(Clone, Copy, Debug)]
struct Flow {
    /// RS: every logical matrix is stored transposed.
    transposed: bool,
    /// The axis the moving operand is gathered along.
    gather: Axis,
    /// The axis the partial products are reduce-scattered along.
    reduce: Axis,
    /// Rows of the stationary operand S and of P and C (logical).
    p: usize,
    /// Columns of S and of the moving operand (the chip's K extent).
    q: usize,
    /// Rows of the moving shard (its extent of the gathered dimension G).
    g: usize,
    /// The gathered dimension G (N for LS, M for RS).
    big_g: usize,
    /// Columns of a C block (G split over the reduce axis).
    cb: usize,
    /// Generator tensor of the stationary operand (the other one moves).
    stationary: u32,
}

/// The lanes of a reduce ring that read the partial, so each waits for it: the copy lane
/// alone on a ring of one, else both ways' copy lanes and their sum lanes.
fn reduce_lanes(reduce: LaneId, back: LaneId, sum_lanes: [SumLane; 2], ring: usize) -> Vec<LaneId> {
    if ring == 1 {
        return vec![reduce];
    }
    vec![reduce, back, sum_lanes[0].lane, sum_lanes[1].lane]
}

impl Flow {
    fn of(p: &MeshProblem) -> Flow {
        // RS is LS of the transposed problem: M and N trade places, and so do the mesh
        // axes. (OS is not a Flow and never asks for one.)
        let transposed = p.dataflow == Dataflow::Rs;
        let (rows, big_g, gather, reduce) =
            if transposed { (p.n, p.m, Axis::Row, Axis::Col) } else { (p.m, p.n, Axis::Col, Axis::Row) };
        let (ng, nrd) = (gather.len(p), reduce.len(p));
        Flow {
            transposed,
            gather,
            reduce,
            p: rows / ng,
            q: p.k / nrd,
            g: big_g / ng,
            big_g,
            cb: big_g / nrd,
            stationary: u32::from(transposed),
        }
    }

    /// The three lanes of every LS/RS plan, declared in this order: gather, compute,
    /// reduce.
    fn lanes(&self, b: &mut PlanBuilder) -> (LaneId, LaneId, LaneId) {
        (b.lane(self.gather.name()), b.lane("compute"), b.lane(self.reduce.name()))
    }

    /// The lane and the count of the blocks going the second way round the gather ring.
    fn gather_back(&self, b: &mut PlanBuilder) -> (LaneId, SemId) {
        let name = format!("{}_back", self.gather.name());
        (b.lane(&name), b.semaphore(&format!("{name}_recv")))
    }

    /// A logical window of columns `col0..col0 + cols` of a region p logical rows tall.
    fn cols(&self, r: Region, col0: usize, cols: usize) -> Region {
        sub(r, self.stored(Window { row0: 0, col0, rows: self.p, cols }))
    }

    /// The lane and the count of the sums going the second way round the reduce ring.
    fn reduce_back(&self, b: &mut PlanBuilder) -> (LaneId, SemId) {
        let name = format!("{}_back", self.reduce.name());
        (b.lane(&name), b.semaphore(&format!("{name}_reduce")))
    }

    /// The lanes each way's sums are added up on, beside the lanes that copy them
    /// ([`SumLane`]): `[reduce way, second way]`.
    fn sum_lanes(&self, b: &mut PlanBuilder) -> [SumLane; 2] {
        let ways = [self.reduce.name().to_string(), format!("{}_back", self.reduce.name())];
        ways.map(|way| SumLane { lane: b.lane(&format!("{way}_sum")), summed: b.semaphore(&format!("{way}_summed")) })
    }

    /// A logical window as stored.
    fn stored(&self, w: Window) -> Window {
        if self.transposed {
            Window { row0: w.col0, col0: w.row0, rows: w.cols, cols: w.rows }
        } else {
            w
        }
    }

    /// Declares a scratch buffer of logical shape rows×cols.
    fn scratch(&self, b: &mut PlanBuilder, name: &str, dtype: DType, rows: usize, cols: usize) -> BufId {
        let s = self.stored(Window { row0: 0, col0: 0, rows, cols });
        b.buffer(name, dtype, s.rows, s.cols, BufferRole::Scratch)
    }

    /// `count` scratch slots of logical shape rows×cols, stacked one under the other as
    /// stored.
    fn slots(
        &self,
        b: &mut PlanBuilder,
        name: &str,
        dtype: DType,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Vec<Region> {
        let s = self.stored(Window { row0: 0, col0: 0, rows, cols });
        let buf = b.buffer(name, dtype, count * s.rows, s.cols, BufferRole::Scratch);
        (0..count).map(|t| b.rows(buf, t * s.rows, s.rows)).collect()
    }

    /// A logical window of a buffer.
    fn win(&self, b: &PlanBuilder, buf: BufId, row0: usize, col0: usize, rows: usize, cols: usize) -> Region {
        let s = self.stored(Window { row0, col0, rows, cols });
        b.window(buf, s.row0, s.col0, s.rows, s.cols)
    }

    /// `out = s · gmᵀ` in logical terms (s p×q, gm x×q, out p×x).
    fn gemm(&self, s: Region, gm: Region, out: Region) -> Op {
        if self.transposed {
            // Stored: outᵀ (x×p) = gmᵀ (x×q) · sᵀ (q×p), gm stored q×x, s stored q×p.
            Op::Gemm {
                a: gm,
                b: s,
                c: out,
                trans_a: true,
                trans_b: false,
                accumulate: false,
                fused: None,
                c_device: None,
            }
        } else {
            Op::Gemm {
                a: s,
                b: gm,
                c: out,
                trans_a: false,
                trans_b: true,
                accumulate: false,
                fused: None,
                c_device: None,
            }
        }
    }

    /// The final piece of a reduce whose block (p × `cols`, logical) lands whole in `c`.
    fn whole_block(&self, c: Region, cols: usize) -> Vec<(Window, Region)> {
        vec![(self.stored(Window { row0: 0, col0: 0, rows: self.p, cols }), c)]
    }
}

/// The buffers every LS/RS plan has.
struct FlowBuffers {
    stationary: BufId,
    moving: BufId,
    c: BufId,
}

fn flow_buffers(b: &mut PlanBuilder, p: &MeshProblem, f: &Flow) -> FlowBuffers {
    // Declared in tensor order (A, B), so every plan of the family lists them alike.
    let first = input_buffer(b, p, 0);
    let second = input_buffer(b, p, 1);
    let c = output_buffer(b, p);
    let (stationary, moving) = if f.stationary == 0 { (first, second) } else { (second, first) };
    FlowBuffers { stationary, moving, c }
}

/// LS/RS MeshSlice (and, with one slice, LS/RS Collective): for each slice s the gather
/// lane packs slice s of the moving shard into this chip's slot of GM_s and all-gathers
/// it; the compute lane multiplies it into P_s (the partial of slice s's columns of
/// every C block of the reduce ring); the reduce lane reduce-scatters P_s, each chip's
/// sum landing in slice s's columns of its C block, while the compute lane already works
/// on slice s+1.
fn flow_meshslice(p: &MeshProblem, name: String, sl: Slicing) -> Result<Plan, MeshError> {
    let f = Flow::of(p);
    let (ng, nrd) = (f.gather.len(p), f.reduce.len(p));
    let (slices, blk) = (sl.slices, sl.block);
    let (gs, gw, cw) = (f.big_g / slices, f.g / slices, f.cb / slices);
    let mut b = PlanBuilder::new(name, p.devices());
    let bufs = flow_buffers(&mut b, p, &f);
    let gm = f.scratch(&mut b, "GM", p.input, f.big_g, f.q);
    let part = f.scratch(&mut b, "P", p.wire, f.p, f.big_g);
    let recv_slots = f.slots(&mut b, "recv", p.wire, slices * (nrd - 1), f.p, cw);
    let send_slots = f.slots(&mut b, "send", p.wire, slices * (nrd - 1), f.p, cw);
    let g_recv = b.semaphore(&format!("{}_recv", f.gather.name()));
    let packed = b.semaphore("packed");
    let p_ready = b.semaphore("p_ready");
    let r_recv = b.semaphore(&format!("{}_reduce", f.reduce.name()));
    let (gather_lane, compute, reduce_lane) = f.lanes(&mut b);
    // The gather and the sums go both ways round their rings, each second way on a lane
    // and a count of its own.
    let (gather_back, g_back_recv) = f.gather_back(&mut b);
    let (reduce_back, r_back_recv) = f.reduce_back(&mut b);
    let sum_lanes = f.sum_lanes(&mut b);
    for d in 0..p.devices() {
        let (gring, rring) = (f.gather.ring(p, d), f.reduce.ring(p, d));
        for s in 0..slices {
            let slots: Vec<Region> = (0..ng).map(|x| f.win(&b, gm, s * gs + x * gw, 0, gw, f.q)).collect();
            let pieces = (0..sl.blocks(f.g))
                .map(|u| {
                    vec![
                        f.win(&b, bufs.moving, u * slices * blk + s * blk, 0, blk, f.q),
                        f.win(&b, gm, s * gs + gring.pos * gw + u * blk, 0, blk, f.q),
                    ]
                })
                .collect();
            push_copies(&mut b, d, gather_lane, pieces);
            b.push(d, gather_lane, signal(d, packed));
            if ng > 1 {
                b.push(d, gather_back, wait(packed, (s + 1) as u32));
            }
            let (lanes, sems) = ([gather_lane, gather_back], [g_recv, g_back_recv]);
            ring_all_gather_both_ways(&mut b, &gring, lanes, sems, (s * (ng - 1)) as u32, slots[gring.pos], &slots);

            b.push(d, compute, wait(packed, (s + 1) as u32));
            if ng > 1 {
                b.push(d, compute, wait(g_recv, ((s + 1) * (ng - 1)) as u32));
                b.push(d, compute, wait(g_back_recv, ((s + 1) * (ng - 1)) as u32));
            }
            let (st, gm_s, p_s) =
                (b.whole(bufs.stationary), f.win(&b, gm, s * gs, 0, gs, f.q), f.win(&b, part, 0, s * gs, f.p, gs));
            b.push(d, compute, f.gemm(st, gm_s, p_s));
            b.push(d, compute, signal(d, p_ready));

            for lane in reduce_lanes(reduce_lane, reduce_back, sum_lanes, nrd) {
                b.push(d, lane, wait(p_ready, (s + 1) as u32));
            }
            let parts: Vec<Region> = (0..nrd).map(|x| f.win(&b, part, 0, s * gs + x * cw, f.p, cw)).collect();
            let out: Vec<(Window, Region)> = (0..sl.blocks(f.cb))
                .map(|u| {
                    let w = f.stored(Window { row0: 0, col0: u * blk, rows: f.p, cols: blk });
                    (w, f.win(&b, bufs.c, 0, u * slices * blk + s * blk, f.p, blk))
                })
                .collect();
            let range = s * (nrd - 1)..(s + 1) * (nrd - 1);
            let slots = SumSlots { recv: &recv_slots[range.clone()], send: &send_slots[range.clone()] };
            let (lanes, sems) = ([reduce_lane, reduce_back], [r_recv, r_back_recv]);
            ring_reduce_scatter_both_ways(
                &mut b,
                &rring,
                lanes,
                sems,
                range.start as u32,
                &parts,
                slots,
                &out,
                sum_lanes,
            );
        }
    }
    Ok(b.finish()?)
}

/// LS/RS SUMMA: the gathered dimension G is cut into T = lcm(n_gather, n_reduce) panels
/// of G/T; at step t the owner of the moving operand's panel t broadcasts it along the
/// gather axis, every chip multiplies it into its partial panel, and the partials are
/// reduced along the reduce axis to the chip whose C block holds panel t.
fn flow_summa(p: &MeshProblem, name: String) -> Result<Plan, MeshError> {
    let f = Flow::of(p);
    let (ng, nrd) = (f.gather.len(p), f.reduce.len(p));
    let steps = lcm(ng, nrd);
    let w = f.big_g / steps;
    let mut b = PlanBuilder::new(name, p.devices());
    let bufs = flow_buffers(&mut b, p, &f);
    let gm = f.scratch(&mut b, "GM", p.input, f.big_g, f.q);
    let part = f.scratch(&mut b, "P", p.wire, f.p, f.big_g);
    let recv = f.scratch(&mut b, "recv", p.wire, f.p, f.big_g);
    let send = f.scratch(&mut b, "send", p.wire, f.p, f.big_g);
    let g_recv = b.semaphore(&format!("{}_recv", f.gather.name()));
    let p_ready = b.semaphore("p_ready");
    let r_recv = b.semaphore(&format!("{}_reduce", f.reduce.name()));
    let (gather_lane, compute, reduce_lane) = f.lanes(&mut b);
    for d in 0..p.devices() {
        let (gring, rring) = (f.gather.ring(p, d), f.reduce.ring(p, d));
        let panels: Vec<Panel> = (0..steps)
            .map(|t| {
                let root = t * w / f.g;
                let src = f.win(&b, bufs.moving, t * w - root * f.g, 0, w, f.q);
                Panel { root, src, dst: f.win(&b, gm, t * w, 0, w, f.q) }
            })
            .collect();
        let guards = broadcast_panels(&mut b, &gring, gather_lane, g_recv, &panels);
        for (t, guard) in guards.into_iter().enumerate() {
            let panel = received(&mut b, d, compute, guard, panels[t].operand(guard));
            let (st, p_t) = (b.whole(bufs.stationary), f.win(&b, part, 0, t * w, f.p, w));
            b.push(d, compute, f.gemm(st, panel, p_t));
            b.push(d, compute, signal(d, p_ready));
        }
        // The reductions to each panel's root, served as the broadcasts are: by place in
        // the panel's chain, then by panel, so each chip adds what its sender delivers in
        // the order delivered (a panel's own chain, and so its sums' order, is unchanged).
        let n = rring.len();
        let link = |t: usize| (t * w / f.cb + 2 * n - 1 - rring.pos) % n;
        let mut order: Vec<usize> = (0..steps).collect();
        order.sort_by_key(|&t| (link(t), t));
        let mut r_arrived = 0;
        for t in order {
            let r_root = t * w / f.cb;
            b.push(d, reduce_lane, wait(p_ready, (t + 1) as u32));
            let p_t = f.win(&b, part, 0, t * w, f.p, w);
            let (recv_t, send_t) = (f.win(&b, recv, 0, t * w, f.p, w), f.win(&b, send, 0, t * w, f.p, w));
            let out = f.whole_block(f.win(&b, bufs.c, 0, t * w - r_root * f.cb, f.p, w), w);
            if ring_reduce_to(&mut b, &rring, reduce_lane, r_recv, r_arrived, r_root, p_t, recv_t, send_t, &out) {
                r_arrived += 1;
            }
        }
    }
    Ok(b.finish()?)
}

/// LS/RS Cannon on an n×n mesh. At step t chip (gather position x, reduce position y)
/// holds moving block (x+y+t) mod n and the running sum of C block (x+y+t) mod n: the
/// moving shard is skewed y chips back along the gather axis and shifted one chip per
/// step, the sums travel one chip per step along the reduce axis (the overlapped GEMM+RS
/// ring), and after the last step each sum is sent home to the chip owning that block.
fn flow_cannon(p: &MeshProblem, name: String) -> Result<Plan, MeshError> {
    let f = Flow::of(p);
    let n = p.nr;
    let mut b = PlanBuilder::new(name, p.devices());
    let bufs = flow_buffers(&mut b, p, &f);
    let moving_slots = f.slots(&mut b, "MS", p.input, n, f.g, f.q);
    let part = f.scratch(&mut b, "P", p.wire, f.p, f.cb);
    let send = f.slots(&mut b, "send", p.wire, n - 1, f.p, f.cb);
    let recv = f.slots(&mut b, "recv", p.wire, n - 1, f.p, f.cb);
    let stage = f.scratch(&mut b, "stage", p.output, f.p, f.cb);
    let skew = b.semaphore("skew");
    let shift = b.semaphore("shift");
    let ready = b.semaphore("ready");
    let r_recv = b.semaphore(&format!("{}_reduce", f.reduce.name()));
    let home_sem = b.semaphore("home");
    let (gather_lane, compute, reduce_lane) = f.lanes(&mut b);
    let mover = CannonMover { own: b.whole(bufs.moving), slots: moving_slots, skew_sem: skew, shift_sem: shift };
    for d in 0..p.devices() {
        let (gring, rring) = (f.gather.ring(p, d), f.reduce.ring(p, d));
        let y = rring.pos;
        mover.lane(&mut b, &gring, gather_lane, y);
        let ring = OverlappedReduce {
            me: d,
            peer: rring.left(),
            n,
            ready,
            recv: r_recv,
            comm: reduce_lane,
            part: b.whole(part),
            send: send.clone(),
            recv_slots: recv.clone(),
        };
        // After the last step this chip holds the sum of block x+y−1, owned by the chip
        // at that position of its reduce ring.
        let home = rring.at((gring.pos + 2 * n - 1) % n);
        let out = if home == d { b.whole(bufs.c) } else { b.whole(stage) };
        let st = b.whole(bufs.stationary);
        for t in 0..n {
            ring.compute_step(&mut b, compute, t, out, &mut |b, dst| {
                let moving = mover.operand(b, d, compute, y % n, t);
                b.push(d, compute, f.gemm(st, moving, dst));
            });
        }
        if home != d {
            let dst = b.whole(bufs.c);
            b.push(d, compute, copy(out, home, dst));
            b.push(d, compute, signal(home, home_sem));
            // The chip whose last sum is this chip's block sends it here likewise.
            b.push(d, compute, wait(home_sem, 1));
        }
        ring.comm(&mut b);
    }
    Ok(b.finish()?)
}

/// What both decomposed LS/RS Wang plans declare: the flow, its operands, the gathered
/// moving operand GM (one block per gather-ring member), the running sums in flight (sent
/// and received slots), the gather and reduce semaphores and the three lanes.
struct Wang {
    f: Flow,
    ng: usize,
    nrd: usize,
    bufs: FlowBuffers,
    gm: BufId,
    blocks: Vec<Region>,
    send: Vec<Region>,
    recv: Vec<Region>,
    g_recv: SemId,
    r_recv: SemId,
    gather_lane: LaneId,
    compute: LaneId,
    reduce_lane: LaneId,
}

impl Wang {
    fn declare(b: &mut PlanBuilder, p: &MeshProblem) -> Wang {
        let f = Flow::of(p);
        let (ng, nrd) = (f.gather.len(p), f.reduce.len(p));
        let bufs = flow_buffers(b, p, &f);
        let gm = f.scratch(b, "GM", p.input, f.big_g, f.q);
        let send = f.slots(b, "send", p.wire, nrd - 1, f.p, f.cb);
        let recv = f.slots(b, "recv", p.wire, nrd - 1, f.p, f.cb);
        let g_recv = b.semaphore(&format!("{}_recv", f.gather.name()));
        let r_recv = b.semaphore(&format!("{}_reduce", f.reduce.name()));
        let (gather_lane, compute, reduce_lane) = f.lanes(b);
        let blocks = (0..ng).map(|x| f.win(b, gm, x * f.g, 0, f.g, f.q)).collect();
        Wang { f, ng, nrd, bufs, gm, blocks, send, recv, g_recv, r_recv, gather_lane, compute, reduce_lane }
    }
}

/// LS/RS Wang with the gather direction decomposed (RS: A along the mesh row): the
/// moving shards travel around the gather ring (both ways round when `bidir`), each
/// multiplied into its columns of P as it arrives; then P is reduce-scattered along the
/// reduce axis as one collective, both ways round.
fn flow_wang_decomposed_gather(p: &MeshProblem, name: String, bidir: bool) -> Result<Plan, MeshError> {
    let mut b = PlanBuilder::new(name, p.devices());
    let Wang {
        f,
        nrd,
        bufs,
        blocks,
        send: send_slots,
        recv: recv_slots,
        g_recv,
        r_recv,
        gather_lane,
        compute,
        reduce_lane,
        ..
    } = Wang::declare(&mut b, p);
    let part = f.scratch(&mut b, "P", p.wire, f.p, f.big_g);
    let p_ready = b.semaphore("p_ready");
    let (gather_back, g_back_recv) = if bidir { f.gather_back(&mut b) } else { (gather_lane, g_recv) };
    let (reduce_back, r_back_recv) = f.reduce_back(&mut b);
    let sum_lanes = f.sum_lanes(&mut b);
    let parts: Vec<Region> = (0..nrd).map(|x| f.win(&b, part, 0, x * f.cb, f.p, f.cb)).collect();
    for d in 0..p.devices() {
        let (gring, rring) = (f.gather.ring(p, d), f.reduce.ring(p, d));
        let own = b.whole(bufs.moving);
        let (lanes, sems) = ([gather_lane, gather_back], [g_recv, g_back_recv]);
        let arrivals = ring_gather_stepwise(&mut b, &gring, lanes, sems, own, &blocks, bidir);
        let st = b.whole(bufs.stationary);
        for (t, (x, guard)) in arrivals.into_iter().enumerate() {
            let moving = received(&mut b, d, compute, guard, if t == 0 { own } else { blocks[x] });
            let p_x = f.win(&b, part, 0, x * f.g, f.p, f.g);
            b.push(d, compute, f.gemm(st, moving, p_x));
        }
        b.push(d, compute, signal(d, p_ready));
        for lane in reduce_lanes(reduce_lane, reduce_back, sum_lanes, nrd) {
            b.push(d, lane, wait(p_ready, 1));
        }
        let out = f.whole_block(b.whole(bufs.c), f.cb);
        let slots = SumSlots { recv: &recv_slots, send: &send_slots };
        let (lanes, sems) = ([reduce_lane, reduce_back], [r_recv, r_back_recv]);
        ring_reduce_scatter_both_ways(&mut b, &rring, lanes, sems, 0, &parts, slots, &out, sum_lanes);
    }
    Ok(b.finish()?)
}

/// LS/RS Wang with the reduce direction decomposed (LS: C along the mesh row): the
/// moving operand is all-gathered along the gather axis first (one collective, both ways
/// round), then the overlapped GEMM+RS ring computes at step s the partial of C block
/// (y+s+1) mod n, adds the running sum from the right and passes it left. When `bidir`
/// that is the left half of the columns; the right half goes the other way round (the 1D
/// bidirectional GEMM+RS ring): block (y−s−1) mod n, the sum from the left, passed right.
fn flow_wang_decomposed_reduce(p: &MeshProblem, name: String, bidir: bool) -> Result<Plan, MeshError> {
    let mut b = PlanBuilder::new(name, p.devices());
    let Wang { f, ng, nrd, bufs, gm, blocks, send, recv, g_recv, r_recv, gather_lane, compute, reduce_lane } =
        Wang::declare(&mut b, p);
    let part = f.scratch(&mut b, "P", p.wire, f.p, f.cb);
    let gm_ready = b.semaphore("gathered");
    let ready = b.semaphore("ready");
    let (gather_back, g_back_recv) = f.gather_back(&mut b);
    // The columns of every block: with `bidir` one half summed each way round (one ring
    // without peers).
    let two_ways = bidir && nrd > 1;
    let (ready_back, reduce_back, r_back_recv) = if two_ways {
        let ready_back = b.semaphore("ready_back");
        let (lane, sem) = f.reduce_back(&mut b);
        (ready_back, lane, sem)
    } else {
        (ready, reduce_lane, r_recv)
    };
    let left = if two_ways { f.cb.div_ceil(2) } else { f.cb };
    let halves: Vec<(usize, usize, bool)> =
        [(0, left, true), (left, f.cb - left, false)].into_iter().filter(|h| h.1 > 0).collect();
    for d in 0..p.devices() {
        let (gring, rring) = (f.gather.ring(p, d), f.reduce.ring(p, d));
        let own = b.whole(bufs.moving);
        b.push(d, gather_lane, copy(own, d, blocks[gring.pos]));
        let (lanes, sems) = ([gather_lane, gather_back], [g_recv, g_back_recv]);
        ring_all_gather_both_ways(&mut b, &gring, lanes, sems, 0, own, &blocks);
        if ng > 1 {
            b.push(d, gather_lane, wait(g_recv, (ng - 1) as u32));
            b.push(d, gather_lane, wait(g_back_recv, (ng - 1) as u32));
        }
        b.push(d, gather_lane, signal(d, gm_ready));

        let rings: Vec<(OverlappedReduce, usize, usize, bool)> = halves
            .iter()
            .map(|&(col0, cols, leftwards)| {
                let cut = |r: &Region| f.cols(*r, col0, cols);
                let ring = OverlappedReduce {
                    me: d,
                    peer: if leftwards { rring.left() } else { rring.right() },
                    n: nrd,
                    ready: if leftwards { ready } else { ready_back },
                    recv: if leftwards { r_recv } else { r_back_recv },
                    comm: if leftwards { reduce_lane } else { reduce_back },
                    part: cut(&b.whole(part)),
                    send: send.iter().map(cut).collect(),
                    recv_slots: recv.iter().map(cut).collect(),
                };
                (ring, col0, cols, leftwards)
            })
            .collect();
        b.push(d, compute, wait(gm_ready, 1));
        let (st, c) = (b.whole(bufs.stationary), b.whole(bufs.c));
        for s in 0..nrd {
            for (ring, col0, cols, leftwards) in &rings {
                let x = if *leftwards { (rring.pos + s + 1) % nrd } else { (rring.pos + 2 * nrd - s - 1) % nrd };
                let gm_x = f.win(&b, gm, x * f.cb + col0, 0, *cols, f.q);
                let out = f.cols(c, *col0, *cols);
                ring.compute_step(&mut b, compute, s, out, &mut |b, dst| b.push(d, compute, f.gemm(st, gm_x, dst)));
            }
        }
        for (ring, ..) in &rings {
            ring.comm(&mut b);
        }
    }
    Ok(b.finish()?)
}
