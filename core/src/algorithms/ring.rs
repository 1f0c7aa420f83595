//! The 1D ring family (BRIEF §4) and the non-overlapped baselines.

use super::{check_chunks, start_plan, Algorithm, AlgorithmError, BaselineSums};
use crate::dtype::DType;
use crate::plan::{BufId, BufferRole, Engine, LaneId, Op, Plan, PlanBuilder, Region, SemId};
use crate::problem::{OpKind, Problem, Split, Window};

fn left(d: usize, n: usize) -> usize {
    (d + n - 1) % n
}

fn right(d: usize, n: usize) -> usize {
    (d + 1) % n
}

/// A block of tile-granular GEMM `id` of its lane.
pub(crate) fn gemm_block(a: Region, b: Region, c: Region, id: u32) -> Op {
    Op::Gemm { a, b, c, trans_a: false, trans_b: false, accumulate: false, fused: Some(id), c_device: None }
}

/// A GEMM adding into (`accumulate`) or writing c on device `owner` (`None`: its own),
/// alone or as a block of tile-granular GEMM `fused`.
fn gemm_into(a: Region, b: Region, c: Region, owner: Option<usize>, accumulate: bool, fused: Option<u32>) -> Op {
    Op::Gemm { a, b, c, trans_a: false, trans_b: false, accumulate, fused, c_device: owner }
}

pub(crate) fn copy(src: Region, dst_device: usize, dst: Region) -> Op {
    Op::Copy { src, dst_device, dst, engine: Engine::CopyEngine }
}

pub(crate) fn signal(device: usize, sem: SemId) -> Op {
    Op::Signal { device, sem, add: 1 }
}

pub(crate) fn wait(sem: SemId, value: u32) -> Op {
    Op::Wait { sem, value }
}

/// One member's view of a ring: the devices in ring order (a 1D ring is `0..D`; a mesh
/// row or column is a sub-ring) and the member's position. Messages of the ring
/// collectives travel to the left neighbour, the previous member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ring {
    /// Device ids in ring order.
    pub members: Vec<usize>,
    /// Position of this member in `members`.
    pub pos: usize,
}

impl Ring {
    /// The whole 1D ring `0..devices`, seen from `device`.
    pub fn all(devices: usize, device: usize) -> Ring {
        Ring { members: (0..devices).collect(), pos: device }
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// This member's device id.
    pub fn me(&self) -> usize {
        self.members[self.pos]
    }

    /// The device `offset` positions after this member (wrapping).
    pub fn at(&self, offset: usize) -> usize {
        self.members[(self.pos + offset) % self.len()]
    }

    /// The left neighbour (the previous member), where messages go.
    pub fn left(&self) -> usize {
        self.at(self.len() - 1)
    }

    /// The right neighbour (the next member), where messages going the other way go.
    pub fn right(&self) -> usize {
        self.at(1)
    }
}

/// `slot` cut to the rows and columns of `data`, from its first element: a slot sized
/// for the largest block holding a smaller one (uneven shards). Even shards fill it.
pub(crate) fn fit(slot: Region, data: Region) -> Region {
    Region { rows: data.rows, cols: data.cols, ..slot }
}

/// Chunk `j` of `chunks` of a slot sized for blocks of `max` rows, holding a block of
/// `split`'s block `blk`: where it starts in the slot (chunk j of the largest block's
/// cut, so chunk places do not depend on which block the slot holds) and its rows
/// (chunk j of the block's own cut).
pub(crate) fn slot_chunk(split: Split, blk: usize, chunks: usize, j: usize) -> (usize, usize) {
    (Split::new(split.max(), chunks).start(j), split.piece(blk, chunks, j).1)
}

/// A sub-window of a region, `window` relative to the region's element (0, 0).
pub(crate) fn sub(r: Region, window: Window) -> Region {
    Region { offset: r.offset + window.row0 * r.stride + window.col0, rows: window.rows, cols: window.cols, ..r }
}

/// Merges `u` same-shaped regions (one per piece, offsets in arithmetic progression) into
/// one region covering exactly their elements, if such a 2D region exists.
fn merge_one(parts: &[Region], rule: MergeRule) -> Option<Region> {
    let first = *parts.first()?;
    if parts.len() == 1 {
        return Some(first);
    }
    let same = parts
        .iter()
        .all(|r| r.buf == first.buf && (r.rows, r.cols, r.stride) == (first.rows, first.cols, first.stride));
    let delta = parts[1].offset.checked_sub(first.offset)?;
    let progression = parts.iter().enumerate().all(|(u, r)| r.offset == first.offset + u * delta);
    if !same || !progression {
        return None;
    }
    let u = parts.len();
    let contiguous = first.rows == 1 || first.stride == first.cols;
    match rule {
        // Blocks stacked one under the other.
        MergeRule::Below if delta == first.rows * first.stride => Some(Region { rows: u * first.rows, ..first }),
        // Blocks side by side.
        MergeRule::Beside if delta == first.cols && (first.rows == 1 || u * first.cols <= first.stride) => {
            Some(Region { cols: u * first.cols, ..first })
        }
        // Contiguous blocks at a constant distance: one row per block.
        MergeRule::Strided if contiguous && delta >= first.len() => {
            Some(Region { rows: u, cols: first.len(), stride: delta, ..first })
        }
        _ => None,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MergeRule {
    Below,
    Beside,
    Strided,
}

/// Merges pieces of an elementwise op (each piece a list of same-shaped regions: e.g.
/// a copy's source and destination, or a reduce's inputs and output) into one piece when
/// every component merges by the same rule, so that the op runs once instead of once
/// per piece. Otherwise the pieces are returned as they are.
pub(crate) fn merge_pieces(pieces: Vec<Vec<Region>>) -> Vec<Vec<Region>> {
    if pieces.len() <= 1 {
        return pieces;
    }
    let width = pieces[0].len();
    for rule in [MergeRule::Below, MergeRule::Beside, MergeRule::Strided] {
        let merged: Option<Vec<Region>> =
            (0..width).map(|c| merge_one(&pieces.iter().map(|p| p[c]).collect::<Vec<_>>(), rule)).collect();
        if let Some(merged) = merged {
            return vec![merged];
        }
    }
    pieces
}

/// One member's part of a ring AllGather (BRIEF §4): `blocks[r]` is member r's block,
/// the same region on every member. At iteration i the member sends block (pos+i)%n to
/// its left neighbour (from `own` at i = 0, the member's own data, which may be
/// `blocks[pos]` itself) and signals `sem` there; before forwarding a block it received
/// it waits until `sem` reaches `base + i`. The last block arrives with `base + n − 1`,
/// which the caller waits for where it reads the blocks.
pub(crate) fn ring_all_gather(
    b: &mut PlanBuilder,
    ring: &Ring,
    lane: LaneId,
    sem: SemId,
    base: u32,
    own: Region,
    blocks: &[Region],
) {
    gather_one_way(b, ring, lane, sem, base, own, blocks, Way::Left, ring.len().saturating_sub(1), Some);
}

/// Which way round a ring a collective's messages go.
#[derive(Clone, Copy)]
enum Way {
    /// To the previous member: block (pos + i) % n at iteration i.
    Left,
    /// To the next member: block (pos − i) % n at iteration i.
    Right,
}

impl Way {
    /// The member messages go to.
    fn to(self, ring: &Ring) -> usize {
        match self {
            Way::Left => ring.left(),
            Way::Right => ring.right(),
        }
    }

    /// The block `i` places from this member's own, this way round.
    fn block(self, ring: &Ring, i: usize) -> usize {
        let n = ring.len();
        match self {
            Way::Left => (ring.pos + i) % n,
            Way::Right => (ring.pos + n - i % n) % n,
        }
    }
}

/// [`ring_all_gather`] one `way` round for `count` iterations (n − 1 for a whole
/// gather), moving `part` of every block (`None`: nothing of it, the signal alone).
#[allow(clippy::too_many_arguments)]
fn gather_one_way(
    b: &mut PlanBuilder,
    ring: &Ring,
    lane: LaneId,
    sem: SemId,
    base: u32,
    own: Region,
    blocks: &[Region],
    way: Way,
    count: usize,
    part: impl Fn(Region) -> Option<Region>,
) {
    let (me, to) = (ring.me(), way.to(ring));
    for i in 0..count {
        let blk = way.block(ring, i);
        let src = if i == 0 {
            own
        } else {
            b.push(me, lane, wait(sem, base + i as u32));
            blocks[blk]
        };
        if let (Some(src), Some(dst)) = (part(src), part(blocks[blk])) {
            b.push(me, lane, copy(src, to, dst));
        }
        b.push(me, lane, signal(to, sem));
    }
}

/// The two halves of a region: its top and bottom rows, or, for one row, its left and
/// right columns. A single element has no second half (`None`).
pub(crate) fn halves(r: Region) -> (Region, Option<Region>) {
    let (first, second) = half_windows(r);
    (sub(r, first), second.map(|w| sub(r, w)))
}

/// The windows of [`halves`], relative to the region's element (0, 0).
fn half_windows(r: Region) -> (Window, Option<Window>) {
    let whole = Window { row0: 0, col0: 0, rows: r.rows, cols: r.cols };
    if r.rows >= 2 {
        let top = r.rows / 2;
        (Window { rows: top, ..whole }, Some(Window { row0: top, rows: r.rows - top, ..whole }))
    } else if r.cols >= 2 {
        let left = r.cols / 2;
        (Window { cols: left, ..whole }, Some(Window { col0: left, cols: r.cols - left, ..whole }))
    } else {
        (whole, None)
    }
}

/// [`ring_all_gather`] both ways round the ring (BRIEF §4's bidirectional ring, here for
/// a collective): the first [`halves`] half of every block goes round to the left on
/// `lanes[0]`, counted on `sems[0]`, the second to the right on `lanes[1]`, counted on
/// `sems[1]`, each a ring AllGather of its halves, so each semaphore reaches
/// `base + n − 1`. On a torus the two ways are links of their own, and the gather takes
/// half the time of one way; through a switch they share the chip's port. Blocks of one
/// element go the first way whole, and the second way's count still reaches its value.
pub(crate) fn ring_all_gather_both_ways(
    b: &mut PlanBuilder,
    ring: &Ring,
    lanes: [LaneId; 2],
    sems: [SemId; 2],
    base: u32,
    own: Region,
    blocks: &[Region],
) {
    let n = ring.len().saturating_sub(1);
    gather_one_way(b, ring, lanes[0], sems[0], base, own, blocks, Way::Left, n, |r| Some(halves(r).0));
    gather_one_way(b, ring, lanes[1], sems[1], base, own, blocks, Way::Right, n, |r| halves(r).1);
}

/// A ring AllGather whose blocks a consumer takes one by one as they come (the AG+GEMM
/// ring of BRIEF §4 over any ring): one way round on `lanes[0]`, counted on `sems[0]`
/// ([`ring_all_gather`]), or both ways round (`bidir`, the bidirectional ring): the blocks
/// of the ⌈(n−1)/2⌉ members to the right go round to the left on `lanes[0]`, those of the
/// ⌊(n−1)/2⌋ to the left go right on `lanes[1]` (counted on `sems[1]`), so they arrive in
/// ⌈(n−1)/2⌉ rounds (the second lane and count are unused one way round). Returns the
/// blocks in the order they arrive, each with the wait that guards it: the member's own
/// first (none), then one way round the block t members to the right (`sems[0]` at t), or
/// both ways round, round by round, the block r members to the right (`sems[0]` at r) and
/// the one r to the left (`sems[1]` at r).
pub(crate) fn ring_gather_stepwise(
    b: &mut PlanBuilder,
    ring: &Ring,
    lanes: [LaneId; 2],
    sems: [SemId; 2],
    own: Region,
    blocks: &[Region],
    bidir: bool,
) -> Vec<(usize, Option<(SemId, u32)>)> {
    let n = ring.len();
    let mut order = vec![(ring.pos, None)];
    if bidir {
        gather_one_way(b, ring, lanes[0], sems[0], 0, own, blocks, Way::Left, n / 2, Some);
        gather_one_way(b, ring, lanes[1], sems[1], 0, own, blocks, Way::Right, (n - 1) / 2, Some);
        for r in 1..=n / 2 {
            order.push((Way::Left.block(ring, r), Some((sems[0], r as u32))));
            if r <= (n - 1) / 2 {
                order.push((Way::Right.block(ring, r), Some((sems[1], r as u32))));
            }
        }
    } else {
        ring_all_gather(b, ring, lanes[0], sems[0], 0, own, blocks);
        order.extend((1..n).map(|t| (Way::Left.block(ring, t), Some((sems[0], t as u32)))));
    }
    order
}

/// Where a ring ReduceScatter finishes: each piece is a window of the member's block
/// (relative to it) and the region the sum of that window lands in (in the output
/// dtype). One piece covering the whole block is the common case.
pub(crate) type FinalPieces = [(Window, Region)];

/// One member's part of a non-overlapped ring ReduceScatter (BRIEF §4) of a partial
/// that lane `made_on` writes before: `parts[r]` is this member's partial of member r's
/// block. At step s it adds block (pos+s+1)%n of its partial to the running sum received
/// from its right neighbour (none at s = 0) and sends the sum left into `recv[s]` there,
/// signalling `sem`; at s = n−1 the block is its own and the sum lands in `out`. `send[s]`
/// (1 ≤ s < n−1) holds the sums in flight; no slot is reused, so no back-pressure. Slots
/// may be larger than a block (uneven shards): each use takes the block's shape from
/// the slot's first element. The copies run on `comm`, which the caller orders after
/// `made_on` where they differ. Without `sums` the sums run between the copies on
/// `comm`; with a [`SummingBeside`] they run on its lane, beside the copies, as a
/// collective library pipelines them, started by `made_on` and ending the collective
/// on `comm` with the last one (into `out`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn ring_reduce_scatter(
    b: &mut PlanBuilder,
    ring: &Ring,
    made_on: LaneId,
    comm: LaneId,
    sem: SemId,
    parts: &[Region],
    slots: SumSlots,
    out: &FinalPieces,
    sums: Option<SummingBeside>,
) {
    let me = ring.me();
    if let Some(sums) = sums {
        b.push(me, made_on, signal(me, sums.ready));
        b.push(me, sums.lane.lane, wait(sums.ready, 1));
    }
    let sum_lane = sums.map(|s| s.lane);
    reduce_one_way(b, ring, comm, sem, 0, parts, slots, out, Way::Left, &whole_window, sum_lane);
    if let Some(sums) = sums {
        b.push(me, sums.lane.lane, signal(me, sums.reduced));
        b.push(me, comm, wait(sums.reduced, 1));
    }
}

/// All of a region, as a window of it.
fn whole_window(r: Region) -> Option<Window> {
    Some(Window { row0: 0, col0: 0, rows: r.rows, cols: r.cols })
}

/// A ring ReduceScatter's slots for the sums: received (`recv[s]`, written by the
/// neighbour at step s) and in flight (`send[s]`).
#[derive(Clone, Copy)]
pub(crate) struct SumSlots<'a> {
    pub recv: &'a [Region],
    pub send: &'a [Region],
}

/// The lane a ring ReduceScatter adds its running sums up on, beside the lane that copies
/// them, [`SUM_PIECES`] pieces of each block in turn, and the member's count of the
/// pieces summed, which the copy lane waits for: a piece's sum overlaps the copy of the
/// piece before it, where adding up on the copy lane would idle the link. The lane must
/// be ordered after the partial is ready, as the copy lane is.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SumLane {
    pub lane: LaneId,
    pub summed: SemId,
}

/// A [`SumLane`] for a whole [`ring_reduce_scatter`], with the semaphores that start the
/// sums once the lane making the partial has it (`ready`) and end the collective on the
/// lane that copies with its last sum (`reduced`), as a collective call returns on its
/// stream.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SummingBeside {
    lane: SumLane,
    ready: SemId,
    reduced: SemId,
}

impl SummingBeside {
    /// Declares the sum lane and its semaphores, once a plan (they are symmetric).
    pub(crate) fn declare(b: &mut PlanBuilder) -> SummingBeside {
        let lane = SumLane { lane: b.lane("sum"), summed: b.semaphore("summed") };
        SummingBeside { lane, ready: b.semaphore("partial_ready"), reduced: b.semaphore("reduced") }
    }

    /// One of several a plan has, on lanes and semaphores declared by the caller.
    pub(crate) fn new(lane: SumLane, ready: SemId, reduced: SemId) -> SummingBeside {
        SummingBeside { lane, ready, reduced }
    }
}

/// The pieces a ReduceScatter with a [`SumLane`] cuts each block's share into.
pub(crate) const SUM_PIECES: usize = 2;

/// Piece `j` of `pieces` of a window: its rows cut into near-equal runs (its columns
/// where it has fewer rows than pieces); `None` where the piece is empty.
fn piece_of(w: Window, j: usize, pieces: usize) -> Option<Window> {
    let cut = |len: usize| {
        let (base, extra) = (len / pieces, len % pieces);
        (j * base + j.min(extra), base + usize::from(j < extra))
    };
    let piece = if w.rows >= pieces {
        let (at, rows) = cut(w.rows);
        Window { row0: w.row0 + at, rows, ..w }
    } else {
        let (at, cols) = cut(w.cols);
        Window { col0: w.col0 + at, cols, ..w }
    };
    (piece.rows > 0 && piece.cols > 0).then_some(piece)
}

/// [`ring_reduce_scatter`] both ways round the ring: the first [`halves`] half of every
/// block is summed going round to the left on `lanes[0]`, counted on `sems[0]`, the
/// second going round to the right on `lanes[1]`, counted on `sems[1]`, in the same
/// slots (each way its half of them). Each element's sum is still added up in one fixed
/// order, its way's; on a torus the two ways are links of their own, and the sums take
/// half the time of one way. Blocks of one element go the first way whole; the second
/// way then only counts, so both semaphores reach their values.
#[allow(clippy::too_many_arguments)]
pub(crate) fn ring_reduce_scatter_both_ways(
    b: &mut PlanBuilder,
    ring: &Ring,
    lanes: [LaneId; 2],
    sems: [SemId; 2],
    base: u32,
    parts: &[Region],
    slots: SumSlots,
    out: &FinalPieces,
    sum_lanes: [SumLane; 2],
) {
    if ring.len() == 1 {
        return reduce_one_way(b, ring, lanes[0], sems[0], base, parts, slots, out, Way::Left, &whole_window, None);
    }
    let one_way = |b: &mut PlanBuilder, i: usize, way: Way, part: &dyn Fn(Region) -> Option<Window>| {
        reduce_one_way(b, ring, lanes[i], sems[i], base, parts, slots, out, way, part, Some(sum_lanes[i]))
    };
    one_way(b, 0, Way::Left, &|r| Some(half_windows(r).0));
    one_way(b, 1, Way::Right, &|r| half_windows(r).1);
}

/// The final pieces of `out` that fall in `part` (a window of the block), relative to it.
fn pieces_in(out: &FinalPieces, part: Window) -> Vec<(Window, Region)> {
    out.iter()
        .filter_map(|&(w, dst)| {
            let (row0, col0) = (w.row0.max(part.row0), w.col0.max(part.col0));
            let row1 = (w.row0 + w.rows).min(part.row0 + part.rows);
            let col1 = (w.col0 + w.cols).min(part.col0 + part.cols);
            (row0 < row1 && col0 < col1).then(|| {
                let rows = row1 - row0;
                let cols = col1 - col0;
                let in_dst = Window { row0: row0 - w.row0, col0: col0 - w.col0, rows, cols };
                let in_part = Window { row0: row0 - part.row0, col0: col0 - part.col0, rows, cols };
                (in_part, sub(dst, in_dst))
            })
        })
        .collect()
}

/// [`ring_reduce_scatter`] one `way` round, summing the `part` of every block (a window
/// of it; `None`: nothing of it, the signals alone). Without `sums` each hop's running sum
/// is added up on the copy lane, between the copy that brought it and the one that sends
/// it on. With a [`SumLane`] the sums run there instead, [`SUM_PIECES`] pieces a block:
/// the copy lane sends piece j on once the sum lane has counted it, and signals each
/// piece, so the copy semaphore counts `SUM_PIECES` a hop (awaited from
/// `SUM_PIECES · base` on; `base` counts the hops of earlier calls, n − 1 a call). Each
/// element is added in the same order either way, so the sums keep their bits.
#[allow(clippy::too_many_arguments)]
fn reduce_one_way(
    b: &mut PlanBuilder,
    ring: &Ring,
    lane: LaneId,
    sem: SemId,
    base: u32,
    parts: &[Region],
    slots: SumSlots,
    out: &FinalPieces,
    way: Way,
    part: &dyn Fn(Region) -> Option<Window>,
    sums: Option<SumLane>,
) {
    let (n, me, to) = (ring.len(), ring.me(), way.to(ring));
    if n == 1 {
        if let Some(w) = part(parts[0]) {
            reduce_pieces(b, me, lane, sub(parts[0], w), None, &pieces_in(out, w));
        }
        return;
    }
    let (c, sum_lane) = sums.map_or((1, lane), |s| (SUM_PIECES, s.lane));
    debug_assert!(sums.is_none() || base as usize % (n - 1) == 0, "a pipelined ring of {n} at base {base}");
    let (arrived, mut summed) = (base * c as u32, (base as usize / (n - 1) * (n - 2) * c) as u32);
    // Piece j of block `mine`'s part, and `region`'s share of it.
    let piece = |mine: Region, j: usize| part(mine).and_then(|w| piece_of(w, j, c));
    let share = |region: Region, mine: Region, j: usize| piece(mine, j).map(|w| sub(fit(region, mine), w));
    for s in 0..n {
        let block = parts[way.block(ring, s + 1)];
        for j in 0..c {
            let mine = share(block, block, j);
            let sum = if s == 0 {
                mine
            } else {
                b.push(me, sum_lane, wait(sem, arrived + ((s - 1) * c + j + 1) as u32));
                let got = share(slots.recv[s - 1], block, j);
                if s == n - 1 {
                    if let (Some(mine), Some(w)) = (mine, piece(block, j)) {
                        reduce_pieces(b, me, sum_lane, mine, got, &pieces_in(out, w));
                    }
                    continue;
                }
                let sum = share(slots.send[s], block, j);
                if let (Some(mine), Some(got), Some(sum)) = (mine, got, sum) {
                    b.push(me, sum_lane, Op::Reduce { inputs: vec![mine, got], output: sum });
                }
                if let Some(SumLane { summed: counted, .. }) = sums {
                    b.push(me, sum_lane, signal(me, counted));
                    summed += 1;
                    b.push(me, lane, wait(counted, summed));
                }
                sum
            };
            if let (Some(sum), Some(dst)) = (sum, share(slots.recv[s], block, j)) {
                b.push(me, lane, copy(sum, to, dst));
            }
            b.push(me, lane, signal(to, sem));
        }
    }
}

/// One member's part of a ring broadcast from `root` (a position in `ring`): the root
/// sends `src` into `dst` of its left neighbour, every member but the last forwards it
/// on after waiting for `sem` to reach `arrived + 1`. Returns whether this member
/// receives (then `dst` holds the data once `sem` reaches `arrived + 1`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn ring_broadcast(
    b: &mut PlanBuilder,
    ring: &Ring,
    lane: LaneId,
    sem: SemId,
    arrived: u32,
    root: usize,
    src: Region,
    dst: Region,
) -> bool {
    let (n, me, to) = (ring.len(), ring.me(), ring.left());
    if n == 1 {
        return false;
    }
    // Hops from the root along the chain root, root−1, …, root+1.
    let hops = (root + n - ring.pos) % n;
    if hops == 0 {
        b.push(me, lane, copy(src, to, dst));
        b.push(me, lane, signal(to, sem));
        return false;
    }
    if hops < n - 1 {
        b.push(me, lane, wait(sem, arrived + 1));
        b.push(me, lane, copy(dst, to, dst));
        b.push(me, lane, signal(to, sem));
    }
    true
}

/// Reduces `part + got` (or just `part`) into the final pieces, merged where possible.
pub(crate) fn reduce_pieces(
    b: &mut PlanBuilder,
    me: usize,
    lane: LaneId,
    part: Region,
    got: Option<Region>,
    out: &FinalPieces,
) {
    let pieces = out
        .iter()
        .map(|&(w, dst)| {
            let mut regions = vec![sub(part, w)];
            regions.extend(got.map(|g| sub(g, w)));
            regions.push(dst);
            regions
        })
        .collect();
    for mut piece in merge_pieces(pieces) {
        let output = piece.pop().expect("a piece has an output");
        b.push(me, lane, Op::Reduce { inputs: piece, output });
    }
}

/// One member's part of a ring reduce to `root`: the chain starts at the root's left
/// neighbour and runs leftwards all around, each member adding its `part` to the sum it
/// received (`recv`, awaited at `arrived + 1`) and passing it on through `send`; the
/// root's sum lands in `out`. Returns whether this member receives.
#[allow(clippy::too_many_arguments)]
pub(crate) fn ring_reduce_to(
    b: &mut PlanBuilder,
    ring: &Ring,
    lane: LaneId,
    sem: SemId,
    arrived: u32,
    root: usize,
    part: Region,
    recv: Region,
    send: Region,
    out: &FinalPieces,
) -> bool {
    let (n, me, to) = (ring.len(), ring.me(), ring.left());
    if n == 1 {
        reduce_pieces(b, me, lane, part, None, out);
        return false;
    }
    // Position in the chain root−1, root−2, …, root+1, root.
    let link = (root + 2 * n - 1 - ring.pos) % n;
    if link == 0 {
        b.push(me, lane, copy(part, to, recv));
        b.push(me, lane, signal(to, sem));
        return false;
    }
    b.push(me, lane, wait(sem, arrived + 1));
    if link == n - 1 {
        reduce_pieces(b, me, lane, part, Some(recv), out);
    } else {
        b.push(me, lane, Op::Reduce { inputs: vec![part, recv], output: send });
        b.push(me, lane, copy(send, to, recv));
        b.push(me, lane, signal(to, sem));
    }
    true
}

/// One member's part of an overlapped ring reduction (the GEMM+RS ring of BRIEF §4):
/// at step s the compute lane writes this step's partial, adds the running sum received
/// from the right neighbour (s > 0) and releases it; the comm lane passes it to `peer`;
/// at s = n−1 the sum is final and lands in the step's output instead.
#[derive(Clone, Debug)]
pub(crate) struct OverlappedReduce {
    /// This member.
    pub me: usize,
    /// Where running sums go.
    pub peer: usize,
    /// Members of the ring (steps).
    pub n: usize,
    /// Compute → comm: the sum of step s is ready (local).
    pub ready: SemId,
    /// Sums received from the other neighbour.
    pub recv: SemId,
    /// The comm lane.
    pub comm: LaneId,
    /// Scratch for the partial of steps s > 0 (f32), cut to each step's shape.
    pub part: Region,
    /// Sums in flight, one slot per step s < n−1 (f32), each of its step's shape.
    pub send: Vec<Region>,
    /// Sums received, one slot per step s < n−1 (f32), each of the shape of the sum it
    /// receives (step s+1's). A slot sent into on the peer takes the shape of the sum
    /// sent from the slot's first element.
    pub recv_slots: Vec<Region>,
}

impl OverlappedReduce {
    /// Step s of the compute lane: `partial(b, dst)` pushes the ops writing this step's
    /// partial into `dst` (waits for its operands included); `out` is where the final
    /// sum lands at s = n−1.
    pub fn compute_step(
        &self,
        b: &mut PlanBuilder,
        lane: LaneId,
        s: usize,
        out: Region,
        partial: &mut dyn FnMut(&mut PlanBuilder, Region),
    ) {
        let n = self.n;
        let dst = if s == n - 1 { out } else { self.send[s] };
        if s == 0 {
            partial(b, dst);
        } else {
            let part = fit(self.part, dst);
            partial(b, part);
            b.push(self.me, lane, wait(self.recv, s as u32));
            b.push(self.me, lane, Op::Reduce { inputs: vec![part, self.recv_slots[s - 1]], output: dst });
        }
        if s < n - 1 {
            b.push(self.me, lane, signal(self.me, self.ready));
        }
    }

    /// The comm lane: passes each step's sum on as soon as it is ready.
    pub fn comm(&self, b: &mut PlanBuilder) {
        for s in 0..self.n - 1 {
            self.comm_step(b, s);
        }
    }

    /// Step s (< n−1) of the comm lane; rings sharing a lane interleave their steps.
    pub fn comm_step(&self, b: &mut PlanBuilder, s: usize) {
        self.comm_step_from(b, s, self.send[s]);
    }

    /// Step s (< n−1) of the comm lane, passing on the sum held in `sum`.
    pub fn comm_step_from(&self, b: &mut PlanBuilder, s: usize, sum: Region) {
        b.push(self.me, self.comm, wait(self.ready, (s + 1) as u32));
        b.push(self.me, self.comm, copy(sum, self.peer, fit(self.recv_slots[s], sum)));
        b.push(self.me, self.comm, signal(self.peer, self.recv));
    }
}

/// The running sums of a ring ReduceScatter in flight: sent and received, one block
/// slot per step but the last, in the wire dtype.
/// `send_slots` of them are sent from `send` (a ring that accumulates in place sends
/// from `recv` after its first step).
fn sum_slots(b: &mut PlanBuilder, p: &Problem, send_slots: usize) -> (BufId, BufId) {
    let (slots, rows) = (p.devices - 1, p.row_split().max());
    let send = b.buffer("send", p.wire, send_slots.min(slots) * rows, p.n, BufferRole::Scratch);
    let recv = b.buffer("recv", p.wire, slots * rows, p.n, BufferRole::Scratch);
    (send, recv)
}

pub(crate) fn plan_name(p: &Problem, algorithm: Algorithm) -> String {
    format!("{}/{} D={} {}", p.op, algorithm, p.devices, p.shape_string())
}

/// AG+GEMM, unidirectional ring. At step i device d multiplies the shard of device
/// (d+i)%D and forwards it to (d−1)%D into scratch slot i; each shard travels as
/// `chunks` row chunks, each with its own signal, so the consumer can start on the
/// first chunk early. Scratch has D−1 slots, so no slot is ever reused. With
/// [`Algorithm::Fused`] the GEMMs are the blocks of one tile-granular GEMM: the own
/// shard first, then each chunk as it arrives, gated by its wait inside the kernel.
pub(super) fn ag_gemm_ring(p: &Problem, algorithm: Algorithm, chunks: usize) -> Result<Plan, AlgorithmError> {
    let (n, shards) = (p.devices, p.row_split());
    check_chunks(algorithm, "the smallest shard's rows", shards.min(), chunks)?;
    let (mut b, a, bm, c) = start_plan(p, algorithm);
    let s = b.buffer("S", p.input, (n - 1) * shards.max(), p.k, BufferRole::Scratch);
    let ring = ChunkedRing { own: a, slots: s, shards, chunks, recv: b.semaphore("recv") };
    let compute = b.lane("compute");
    let comm = b.lane("comm");
    for d in 0..n {
        ring.forward(&mut b, d, n, comm);
        let whole_b = b.whole(bm);
        let own = b.rows(c, shards.start(d), shards.len(d));
        let own_a = b.rows(a, 0, shards.len(d));
        let fused = matches!(algorithm, Algorithm::Fused { .. });
        let multiply = |a, c| if fused { gemm_block(a, whole_b, c, 0) } else { Op::gemm(a, whole_b, c) };
        b.push(d, compute, multiply(own_a, own));
        for i in 1..n {
            let blk = (d + i) % n;
            for j in 0..chunks {
                let src = ring.chunk(&mut b, d, compute, i, j);
                let (start, rows) = shards.piece(blk, chunks, j);
                let dst = b.rows(c, shards.start(blk) + start, rows);
                b.push(d, compute, multiply(src, dst));
            }
        }
    }
    Ok(b.finish()?)
}

/// A unidirectional ring AllGather whose shards (device r's of `shards.len(r)` rows)
/// travel as `chunks` row chunks with one signal each: at step i device d holds the
/// shard of device (d+i) mod D, its own (`own`) at i = 0, else slot i−1 of `slots` (D−1
/// slots of the largest shard's rows, so no slot is reused), where it arrives with
/// `recv` at `(i−1)·chunks + j + 1`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkedRing {
    /// The device's own shard.
    pub own: BufId,
    /// The received shards, one slot per step i ≥ 1.
    pub slots: BufId,
    /// How the rows are cut into the devices' shards.
    pub shards: Split,
    /// Chunks per shard.
    pub chunks: usize,
    /// Counts the chunks that have arrived.
    pub recv: SemId,
}

impl ChunkedRing {
    /// Chunk j of the shard device d holds at step i, after waiting for it on `lane`.
    pub fn chunk(&self, b: &mut PlanBuilder, d: usize, lane: LaneId, i: usize, j: usize) -> Region {
        let blk = (d + i) % self.shards.parts;
        if i == 0 {
            let (start, rows) = self.shards.piece(blk, self.chunks, j);
            return b.rows(self.own, start, rows);
        }
        b.push(d, lane, wait(self.recv, ((i - 1) * self.chunks + j + 1) as u32));
        self.slot(b, i - 1, blk, j)
    }

    /// Chunk j of shard `blk` in slot `slot`.
    fn slot(&self, b: &PlanBuilder, slot: usize, blk: usize, j: usize) -> Region {
        let (start, rows) = slot_chunk(self.shards, blk, self.chunks, j);
        b.rows(self.slots, slot * self.shards.max() + start, rows)
    }

    /// Device d's comm lane: every chunk it holds forwarded to its left neighbour (into
    /// the next slot there) as soon as it holds it.
    pub fn forward(&self, b: &mut PlanBuilder, d: usize, n: usize, lane: LaneId) {
        let to = left(d, n);
        for i in 0..n - 1 {
            for j in 0..self.chunks {
                let src = self.chunk(b, d, lane, i, j);
                let dst = self.slot(b, i, (d + i) % n, j);
                b.push(d, lane, copy(src, to, dst));
                b.push(d, lane, signal(to, self.recv));
            }
        }
    }
}

/// AG+GEMM, bidirectional ring: shards from the right travel leftwards and shards from
/// the left travel rightwards, so the D−1 remote shards arrive in ⌈(D−1)/2⌉ rounds.
pub(super) fn ag_gemm_bidir(p: &Problem) -> Result<Plan, AlgorithmError> {
    let (n, shards) = (p.devices, p.row_split());
    let ms = shards.max();
    let from_right = n / 2; // ⌈(D−1)/2⌉
    let from_left = (n - 1) / 2; // ⌊(D−1)/2⌋
    let (mut b, a, bm, c) = start_plan(p, Algorithm::RingBidir);
    let s = b.buffer("S", p.input, (n - 1) * ms, p.k, BufferRole::Scratch);
    // Slot `slot` holding device blk's shard, and where that shard lands in C.
    let slot = |b: &PlanBuilder, slot: usize, blk: usize| b.rows(s, slot * ms, shards.len(blk));
    let c_rows = |b: &PlanBuilder, blk: usize| b.rows(c, shards.start(blk), shards.len(blk));
    let recv_r = b.semaphore("recv_from_right");
    let recv_l = b.semaphore("recv_from_left");
    let compute = b.lane("compute");
    let comm_left = b.lane("comm_left");
    let comm_right = b.lane("comm_right");
    for d in 0..n {
        // Leftward flow into slots [0, from_right), rightward flow into the rest: the
        // j-th message carries the shard of device d+j (leftward) or d−j (rightward).
        for (lane, count, base, sem, to, ahead) in [
            (comm_left, from_right, 0, recv_r, left(d, n), 1),
            (comm_right, from_left, from_right, recv_l, right(d, n), n - 1),
        ] {
            for j in 0..count {
                let blk = (d + j * ahead) % n;
                let src = if j == 0 {
                    b.rows(a, 0, shards.len(d))
                } else {
                    b.push(d, lane, wait(sem, j as u32));
                    slot(&b, base + j - 1, blk)
                };
                let dst = slot(&b, base + j, blk);
                b.push(d, lane, copy(src, to, dst));
                b.push(d, lane, signal(to, sem));
            }
        }
        let whole_b = b.whole(bm);
        let (own_a, own) = (b.rows(a, 0, shards.len(d)), c_rows(&b, d));
        b.push(d, compute, Op::gemm(own_a, whole_b, own));
        for r in 1..=from_right {
            b.push(d, compute, wait(recv_r, r as u32));
            let blk = (d + r) % n;
            let (src, dst) = (slot(&b, r - 1, blk), c_rows(&b, blk));
            b.push(d, compute, Op::gemm(src, whole_b, dst));
            if r <= from_left {
                b.push(d, compute, wait(recv_l, r as u32));
                let blk = (d + n - r) % n;
                let (src, dst) = (slot(&b, from_right + r - 1, blk), c_rows(&b, blk));
                b.push(d, compute, Op::gemm(src, whole_b, dst));
            }
        }
    }
    Ok(b.finish()?)
}

/// AG+GEMM baseline: ring AllGather of A into a gathered buffer, then one GEMM.
pub(super) fn ag_gemm_baseline(p: &Problem) -> Result<Plan, AlgorithmError> {
    let n = p.devices;
    ag_gemm_gathered(p, Algorithm::Baseline, &|b, d, lane, sem, _own, blocks| {
        ring_all_gather(b, &Ring::all(n, d), lane, sem, 0, blocks[d], blocks)
    })
}

/// How a non-overlapped AG+GEMM fills the gathered buffer: on device d, from its own
/// shard (`own`, already copied into `blocks[d]`), every other block, each arrival a
/// release of `sem` there.
pub(super) type Gather<'a> = dyn Fn(&mut PlanBuilder, usize, LaneId, SemId, Region, &[Region]) + 'a;

/// AG+GEMM without overlap: the own shard into the gathered buffer G, `gather` for the
/// other D − 1 blocks, one wait for them, then one GEMM over all rows.
pub(super) fn ag_gemm_gathered(p: &Problem, algorithm: Algorithm, gather: &Gather) -> Result<Plan, AlgorithmError> {
    let (n, shards) = (p.devices, p.row_split());
    let (mut b, a, bm, c) = start_plan(p, algorithm);
    let g = b.buffer("G", p.input, p.m, p.k, BufferRole::Scratch);
    let recv = b.semaphore("recv");
    let main = b.lane("main");
    let blocks: Vec<Region> = (0..n).map(|r| b.rows(g, shards.start(r), shards.len(r))).collect();
    for d in 0..n {
        let own = b.rows(a, 0, shards.len(d));
        b.push(d, main, copy(own, d, blocks[d]));
        gather(&mut b, d, main, recv, own, &blocks);
        if n > 1 {
            b.push(d, main, wait(recv, (n - 1) as u32));
        }
        let (whole_g, whole_b, whole_c) = (b.whole(g), b.whole(bm), b.whole(c));
        b.push(d, main, Op::gemm(whole_g, whole_b, whole_c));
    }
    Ok(b.finish()?)
}

/// GEMM+AR's C cut into the devices' row blocks.
fn c_blocks(b: &PlanBuilder, c: BufId, blocks: Split) -> Vec<Region> {
    (0..blocks.parts).map(|r| b.rows(c, blocks.start(r), blocks.len(r))).collect()
}

/// GEMM+AR's AllGather on `lane` of device d: once `done` says d's block of C (rows
/// block d, one of `blocks`) is reduced, a ring AllGather of every device's block.
fn gather_reduced_blocks(b: &mut PlanBuilder, d: usize, lane: LaneId, done: SemId, ag: SemId, blocks: &[Region]) {
    let n = blocks.len();
    b.push(d, lane, wait(done, 1));
    ring_all_gather(b, &Ring::all(n, d), lane, ag, 0, blocks[d], blocks);
    b.push(d, lane, wait(ag, (n - 1) as u32));
}

/// GEMM+RS (and GEMM+AR as RS then AG), ring, overlapped: at step s device d computes
/// its partial of block b_s, adds the running sum received from its neighbour and sends
/// the result on; at s = D−1 the block is its own and the sum is final. With
/// [`Algorithm::RingBidir`] the columns are split in two halves that travel in opposite
/// directions. With `chunks` > 1 each block is cut into that many row chunks, each its
/// own ring (own semaphores, steps interleaved on the comm lane), so a chunk's sum
/// travels while the next chunk's partial is computed. With
/// [`Algorithm::RingAccumulate`] the GEMM of each step 0 < s < D−1 adds onto the
/// received sum in its receive slot, which the comm lane then sends on.
pub(super) fn gemm_reduce_ring(p: &Problem, algorithm: Algorithm) -> Result<Plan, AlgorithmError> {
    let (n, blocks) = (p.devices, p.row_split());
    let mb = blocks.max();
    let (bidir, chunks, accumulate) = match algorithm {
        Algorithm::RingBidir => (true, 1, false),
        Algorithm::RingChunked { chunks } => (false, chunks, false),
        Algorithm::RingAccumulate { chunks } => (false, chunks, true),
        Algorithm::Ring => (false, 1, false),
        other => return Err(AlgorithmError::NotDefined { algorithm: other, op: p.op.name() }),
    };
    check_chunks(algorithm, "the smallest block's rows", blocks.min(), chunks)?;
    if accumulate && p.wire != DType::F32 {
        return Err(AlgorithmError::NeedsF32Wire { algorithm, wire: p.wire });
    }
    let (mut b, a, bm, c) = start_plan(p, algorithm);
    let partial = b.buffer("P", p.wire, mb, p.n, BufferRole::Scratch);
    // A ring that adds in place sends from its receive slots after its first step.
    let send_slots = if accumulate { 1.min(n - 1) } else { n - 1 };
    let (send, recv_buf) = sum_slots(&mut b, p, send_slots);
    let compute = b.lane("compute");
    // (column window, leftwards, comm lane, per chunk (ready, recv)) of each direction.
    let mut dirs = Vec::new();
    let halves =
        if bidir { vec![(0, p.n.div_ceil(2), true), (p.n.div_ceil(2), p.n / 2, false)] } else { vec![(0, p.n, true)] };
    for (col0, cols, leftwards) in halves {
        let tag = if leftwards { "left" } else { "right" };
        let sems: Vec<(SemId, SemId)> = (0..chunks)
            .map(|j| {
                let chunk = if chunks == 1 { String::new() } else { format!(".{j}") };
                (b.semaphore(&format!("ready_{tag}{chunk}")), b.semaphore(&format!("recv_{tag}{chunk}")))
            })
            .collect();
        let comm = b.lane(&format!("comm_{tag}"));
        if cols > 0 {
            dirs.push((col0, cols, leftwards, comm, sems));
        }
    }
    let all_reduce = p.op == OpKind::GemmAr;
    // The AllGather of AR exists only with peers to gather from.
    let (done, ag) =
        if all_reduce && n > 1 { (Some(b.semaphore("done")), Some(b.semaphore("ag"))) } else { (None, None) };
    for d in 0..n {
        // The final block lands in C: rows block d for AR (C is M×N), all of C for RS.
        let final_row0 = if all_reduce { blocks.start(d) } else { 0 };
        // Leftwards, step s reduces block (d+s+1)%D; rightwards, block (d−s−1)%D.
        let block_at = |leftwards: bool, s: usize| if leftwards { (d + s + 1) % n } else { (d + 2 * n - s - 1) % n };
        // One ring per (direction, chunk j), over chunk j of each block.
        let rings: Vec<(OverlappedReduce, usize, usize, bool, usize)> = dirs
            .iter()
            .flat_map(|(col0, cols, leftwards, comm, sems)| {
                sems.iter()
                    .enumerate()
                    .map(move |(j, &(ready, recv))| (*col0, *cols, *leftwards, *comm, j, ready, recv))
            })
            .map(|(col0, cols, leftwards, comm, j, ready, recv)| {
                // Slot s holding chunk j of the block reduced at step `step(s)`.
                let slots = |buf, count: usize, step: &dyn Fn(usize) -> usize| {
                    (0..count)
                        .map(|s| {
                            let (start, rows) = slot_chunk(blocks, block_at(leftwards, step(s)), chunks, j);
                            b.window(buf, s * mb + start, col0, rows, cols)
                        })
                        .collect::<Vec<Region>>()
                };
                let (start, rows) = slot_chunk(blocks, 0, chunks, j);
                let ring = OverlappedReduce {
                    me: d,
                    peer: if leftwards { left(d, n) } else { right(d, n) },
                    n,
                    ready,
                    recv,
                    comm,
                    part: b.window(partial, start, col0, rows, cols),
                    send: slots(send, send_slots, &|s| s),
                    recv_slots: slots(recv_buf, n - 1, &|s| s + 1),
                };
                (ring, col0, cols, leftwards, j)
            })
            .collect();
        for s in 0..n {
            for (ring, col0, cols, leftwards, j) in &rings {
                let blk = block_at(*leftwards, s);
                let (start, rows) = blocks.piece(blk, chunks, *j);
                let a_rows = b.rows(a, blocks.start(blk) + start, rows);
                let b_cols = b.window(bm, 0, *col0, p.k / n, *cols);
                // Used at s = D−1 only, where blk is d.
                let out = b.window(c, final_row0 + start, *col0, rows, *cols);
                if accumulate && s > 0 && s < n - 1 {
                    // This step's partial lands on the sum received, where it lies.
                    let sum = ring.recv_slots[s - 1];
                    b.push(d, compute, wait(ring.recv, s as u32));
                    let gemm = Op::Gemm {
                        a: a_rows,
                        b: b_cols,
                        c: sum,
                        trans_a: false,
                        trans_b: false,
                        accumulate: true,
                        fused: None,
                        c_device: None,
                    };
                    b.push(d, compute, gemm);
                    b.push(d, compute, signal(d, ring.ready));
                } else {
                    ring.compute_step(&mut b, compute, s, out, &mut |b, dst| {
                        b.push(d, compute, Op::gemm(a_rows, b_cols, dst))
                    });
                }
            }
        }
        if let Some(done) = done {
            // One release after every ring's final reduce.
            b.push(d, compute, signal(d, done));
        }
        for s in 0..n - 1 {
            for (ring, ..) in &rings {
                let sum = if accumulate && s > 0 { ring.recv_slots[s - 1] } else { ring.send[s] };
                ring.comm_step_from(&mut b, s, sum);
            }
        }
        if let (Some(done), Some(ag)) = (done, ag) {
            // AllGather of the reduced blocks on the first comm lane, once every
            // ring's final reduce is done.
            let c_blocks = c_blocks(&b, c, blocks);
            gather_reduced_blocks(&mut b, d, rings[0].0.comm, done, ag, &c_blocks);
        }
    }
    Ok(b.finish()?)
}

/// GEMM+RS (and GEMM+AR), ring order, sums that never travel: block b's running sum
/// lives in scratch S on its owner, device b, and each contributor's GEMM adds its
/// partial straight into it there (β = 1 with a peer's c; the first contributor
/// overwrites). At step s device d computes block (d+s+1)%D after its right neighbour
/// has added to that block at step s−1, then releases its left neighbour; at s = D−1
/// the block is d's own, computed into P while the last peer adds, and P + S lands in
/// C. The contributors and their order are the ring's, so the sums are the ring's bit
/// for bit; the copies are gone, their bytes moved by the GEMMs' epilogues instead.
/// Every device writes into each peer's S in turn, one writer per S at a time.
pub(super) fn gemm_reduce_push(p: &Problem) -> Result<Plan, AlgorithmError> {
    let algorithm = Algorithm::RingPush;
    if p.wire != DType::F32 {
        return Err(AlgorithmError::NeedsF32Wire { algorithm, wire: p.wire });
    }
    let (n, rows) = (p.devices, p.row_split());
    let mb = rows.max();
    let (mut b, a, bm, c) = start_plan(p, algorithm);
    let partial = b.buffer("P", p.wire, mb, p.n, BufferRole::Scratch);
    let sum = b.buffer("S", p.wire, mb, p.n, BufferRole::Scratch);
    // Incremented by the right neighbour once per step it has added to a block.
    let added = b.semaphore("added");
    let compute = b.lane("compute");
    let all_reduce = p.op == OpKind::GemmAr;
    let (comm, done, ag) = if all_reduce && n > 1 {
        (Some(b.lane("comm")), Some(b.semaphore("done")), Some(b.semaphore("ag")))
    } else {
        (None, None, None)
    };
    let blocks = c_blocks(&b, c, rows);
    for d in 0..n {
        let whole_b = b.whole(bm);
        let (own_p, own_s) = (b.rows(partial, 0, rows.len(d)), b.rows(sum, 0, rows.len(d)));
        let out = if all_reduce { blocks[d] } else { b.rows(c, 0, rows.len(d)) };
        // Steps 0..D−2: the peers' blocks, each added into its owner's sum.
        for s in 0..n - 1 {
            let blk = (d + s + 1) % n;
            if s > 0 {
                b.push(d, compute, wait(added, s as u32));
            }
            let (a_rows, s_rows) = (b.rows(a, rows.start(blk), rows.len(blk)), b.rows(sum, 0, rows.len(blk)));
            b.push(d, compute, gemm_into(a_rows, whole_b, s_rows, Some(blk), s > 0, None));
            b.push(d, compute, signal(left(d, n), added));
        }
        // Step D−1, the own block: its partial needs no one; the peers' sum does.
        let own = b.rows(a, rows.start(d), rows.len(d));
        if n == 1 {
            b.push(d, compute, Op::gemm(own, whole_b, out));
        } else {
            b.push(d, compute, Op::gemm(own, whole_b, own_p));
            b.push(d, compute, wait(added, (n - 1) as u32));
            b.push(d, compute, Op::Reduce { inputs: vec![own_p, own_s], output: out });
        }
        if let (Some(lane), Some(done), Some(ag)) = (comm, done, ag) {
            b.push(d, compute, signal(d, done));
            gather_reduced_blocks(&mut b, d, lane, done, ag, &blocks);
        }
    }
    Ok(b.finish()?)
}

/// GEMM+RS (and GEMM+AR), `ring_push` fused: the same contributors in the same order,
/// adding into the same sums on the blocks' owners, with every GEMM after the first a
/// block of one tile-granular GEMM (in `chunks` row chunks). At step 0 device d's own
/// GEMM writes block (d+1)%D fresh into S there and releases its left neighbour for
/// every chunk at once. At step 1 ≤ s ≤ D−2 chunk j of block (d+s+1)%D waits inside the
/// kernel until the right neighbour has added its chunk j of step s−1 (at step 1, one
/// wait for the whole first GEMM), adds onto S on the owner and releases the left
/// neighbour. At s = D−1 each chunk of the own block
/// waits for the right neighbour's last addition and adds onto its own S, which a
/// conversion writes to C. The persistent kernels run beside nothing: no copy, no
/// reduce but the last conversion. The chunk sums equal `ring_push`'s up to the order
/// of the own block's last addition.
pub(super) fn gemm_reduce_fused_push(p: &Problem, chunks: usize) -> Result<Plan, AlgorithmError> {
    let algorithm = Algorithm::FusedPush { chunks };
    if p.wire != DType::F32 {
        return Err(AlgorithmError::NeedsF32Wire { algorithm, wire: p.wire });
    }
    let (n, rows) = (p.devices, p.row_split());
    check_chunks(algorithm, "the smallest block's rows", rows.min(), chunks)?;
    let (mut b, a, bm, c) = start_plan(p, algorithm);
    let sum = b.buffer("S", p.wire, rows.max(), p.n, BufferRole::Scratch);
    // Incremented by the right neighbour once per chunk it has added (step 0: all at once).
    let added = b.semaphore("added");
    let compute = b.lane("compute");
    // GEMM+AR gathers the reduced blocks on the same lane, after the kernel: one stream a
    // device, so D kernels that wait for each other need only D hardware queues.
    let all_reduce = p.op == OpKind::GemmAr;
    let ag = (all_reduce && n > 1).then(|| b.semaphore("ag"));
    // The count `added` reaches with chunk j of step s.
    let count = |s: usize, j: usize| (s * chunks + j + 1) as u32;
    let blocks = c_blocks(&b, c, rows);
    for d in 0..n {
        let whole_b = b.whole(bm);
        let out = if all_reduce { blocks[d] } else { b.rows(c, 0, rows.len(d)) };
        if n == 1 {
            for j in 0..chunks {
                let (start, len) = rows.piece(0, chunks, j);
                let (a_rows, c_rows) = (b.rows(a, start, len), b.rows(c, start, len));
                b.push(d, compute, gemm_block(a_rows, whole_b, c_rows, 0));
            }
            continue;
        }
        let first = (d + 1) % n;
        let (a_rows, s_rows) = (b.rows(a, rows.start(first), rows.len(first)), b.rows(sum, 0, rows.len(first)));
        b.push(d, compute, gemm_into(a_rows, whole_b, s_rows, Some(first), false, None));
        b.push(d, compute, Op::Signal { device: left(d, n), sem: added, add: chunks as u32 });
        for s in 1..n {
            let blk = (d + s + 1) % n;
            for j in 0..chunks {
                let (start, len) = rows.piece(blk, chunks, j);
                // Step 0 released every chunk at once: step 1 waits once.
                if s > 1 || j == 0 {
                    b.push(d, compute, wait(added, count(s - 1, if s == 1 { chunks - 1 } else { j })));
                }
                let (a_rows, s_rows) = (b.rows(a, rows.start(blk) + start, len), b.rows(sum, start, len));
                b.push(d, compute, gemm_into(a_rows, whole_b, s_rows, (blk != d).then_some(blk), true, Some(0)));
                if s < n - 1 {
                    b.push(d, compute, signal(left(d, n), added));
                }
            }
        }
        let own_sum = b.rows(sum, 0, rows.len(d));
        b.push(d, compute, Op::Reduce { inputs: vec![own_sum], output: out });
        if let Some(ag) = ag {
            ring_all_gather(&mut b, &Ring::all(n, d), compute, ag, 0, blocks[d], &blocks);
            b.push(d, compute, wait(ag, (n - 1) as u32));
        }
    }
    Ok(b.finish()?)
}

/// GEMM+RS (and GEMM+AR), fused: one tile-granular GEMM computes this device's
/// partials of every block in the order the ring consumes them (block (d+s+1)%D at step
/// s, in `chunks` row chunks), each into its own slot of P, released as soon as it is
/// written. The reduce lane adds each to the running sum received from the right
/// neighbour; the comm lane passes the sums on leftwards. At s = D−1 the block is d's
/// own and the sum is final. GEMM+AR then gathers the reduced blocks on the comm lane.
/// No slot is reused, so nothing waits for a slot to drain.
pub(super) fn gemm_reduce_fused(p: &Problem, chunks: usize) -> Result<Plan, AlgorithmError> {
    let (n, blocks) = (p.devices, p.row_split());
    let mb = blocks.max();
    let algorithm = Algorithm::Fused { chunks };
    check_chunks(algorithm, "the smallest block's rows", blocks.min(), chunks)?;
    let (mut b, a, bm, c) = start_plan(p, algorithm);
    let partial = b.buffer("P", p.wire, n * mb, p.n, BufferRole::Scratch);
    let (send, recv_buf) = sum_slots(&mut b, p, p.devices - 1);
    // Local: chunks the GEMM has written, running sums ready to send. From the right
    // neighbour: running sums received, in (step, chunk) order.
    let computed = b.semaphore("computed");
    let summed = b.semaphore("summed");
    let recv = b.semaphore("recv");
    let compute = b.lane("compute");
    let reduce = b.lane("reduce");
    let comm = b.lane("comm");
    let all_reduce = p.op == OpKind::GemmAr;
    let (done, ag) =
        if all_reduce && n > 1 { (Some(b.semaphore("done")), Some(b.semaphore("ag"))) } else { (None, None) };
    // The count a semaphore reaches with chunk j of step s.
    let count = |s: usize, j: usize| (s * chunks + j + 1) as u32;
    for d in 0..n {
        let final_row0 = if all_reduce { blocks.start(d) } else { 0 };
        let whole_b = b.whole(bm);
        // Chunk j of slot s of `buf`, holding the block of step s.
        let slot = |b: &PlanBuilder, buf: BufId, s: usize, j: usize| {
            let (start, rows) = slot_chunk(blocks, (d + s + 1) % n, chunks, j);
            b.rows(buf, s * mb + start, rows)
        };
        let part = |b: &mut PlanBuilder, s: usize, j: usize| slot(b, partial, s, j);
        for s in 0..n {
            let blk = (d + s + 1) % n;
            for j in 0..chunks {
                let (start, rows) = blocks.piece(blk, chunks, j);
                let (a_rows, dst) = (b.rows(a, blocks.start(blk) + start, rows), part(&mut b, s, j));
                b.push(d, compute, gemm_block(a_rows, whole_b, dst, 0));
                b.push(d, compute, signal(d, computed));
            }
        }
        for s in (1..n).chain((n == 1).then_some(0)) {
            for j in 0..chunks {
                b.push(d, reduce, wait(computed, count(s, j)));
                let mut inputs = vec![part(&mut b, s, j)];
                // With one device the partial is the sum: a conversion into C.
                if s > 0 {
                    b.push(d, reduce, wait(recv, count(s - 1, j)));
                    // Slot s−1 received the right neighbour's step s−1: this step's block.
                    inputs.push(fit(slot(&b, recv_buf, s - 1, j), inputs[0]));
                }
                let last = s == n - 1;
                let output = if last {
                    let (start, rows) = blocks.piece(d, chunks, j);
                    b.rows(c, final_row0 + start, rows)
                } else {
                    slot(&b, send, s, j)
                };
                b.push(d, reduce, Op::Reduce { inputs, output });
                if !last {
                    b.push(d, reduce, signal(d, summed));
                }
            }
        }
        if let Some(done) = done {
            b.push(d, reduce, signal(d, done));
        }
        for s in 0..n - 1 {
            for j in 0..chunks {
                // Step 0 sends the partial itself, later steps the running sum.
                let src = if s == 0 {
                    b.push(d, comm, wait(computed, count(0, j)));
                    part(&mut b, 0, j)
                } else {
                    b.push(d, comm, wait(summed, count(s - 1, j)));
                    slot(&b, send, s, j)
                };
                let dst = slot(&b, recv_buf, s, j);
                b.push(d, comm, copy(src, left(d, n), dst));
                b.push(d, comm, signal(left(d, n), recv));
            }
        }
        if let (Some(done), Some(ag)) = (done, ag) {
            let c_blocks = c_blocks(&b, c, blocks);
            gather_reduced_blocks(&mut b, d, comm, done, ag, &c_blocks);
        }
    }
    Ok(b.finish()?)
}

/// GEMM+RS / GEMM+AR baseline: the whole partial product first, then a ring
/// ReduceScatter (and for AR a ring AllGather), with no overlap of GEMM and
/// communication. The ReduceScatter copies on `main` and adds its running sums up on a
/// lane of their own ([`SumLane`]), a piece's sum beside the copy of the one before, as
/// a collective library does: summing between the copies would idle the link and make
/// the baseline slower than the collective it stands for. On small blocks the sums stay
/// on `main` ([`BaselineSums`]: pieces cost launches).
pub(super) fn gemm_reduce_baseline(p: &Problem, sums: BaselineSums) -> Result<Plan, AlgorithmError> {
    let (n, rows) = (p.devices, p.row_split());
    let mb = rows.max();
    let (mut b, a, bm, c) = start_plan(p, Algorithm::Baseline);
    let partial = b.buffer("P", p.wire, p.m, p.n, BufferRole::Scratch);
    let (send, recv_buf) = sum_slots(&mut b, p, p.devices - 1);
    let recv = b.semaphore("recv");
    let ag = b.semaphore("ag");
    let main = b.lane("main");
    let all_reduce = p.op == OpKind::GemmAr;
    let parts: Vec<Region> = (0..n).map(|r| b.rows(partial, rows.start(r), rows.len(r))).collect();
    let send_slots: Vec<Region> = (0..n - 1).map(|s| b.rows(send, s * mb, mb)).collect();
    let recv_slots: Vec<Region> = (0..n - 1).map(|s| b.rows(recv_buf, s * mb, mb)).collect();
    let slots = SumSlots { recv: &recv_slots, send: &send_slots };
    let blocks = c_blocks(&b, c, rows);
    let sums = sums.beside(n, mb * p.n * p.wire.size_bytes()).then(|| SummingBeside::declare(&mut b));
    for d in 0..n {
        let (wa, wb, wp) = (b.whole(a), b.whole(bm), b.whole(partial));
        b.push(d, main, Op::gemm(wa, wb, wp));
        let final_out = if all_reduce { blocks[d] } else { b.rows(c, 0, rows.len(d)) };
        let whole_block = Window { row0: 0, col0: 0, rows: rows.len(d), cols: p.n };
        let ring = Ring::all(n, d);
        ring_reduce_scatter(&mut b, &ring, main, main, recv, &parts, slots, &[(whole_block, final_out)], sums);
        if all_reduce && n > 1 {
            ring_all_gather(&mut b, &ring, main, ag, 0, blocks[d], &blocks);
            b.push(d, main, wait(ag, (n - 1) as u32));
        }
    }
    Ok(b.finish()?)
}
