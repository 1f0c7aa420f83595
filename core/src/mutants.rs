//! Plan mutants: small, plausible bugs injected into a correct plan, used to measure
//! how many the verifier and the conformance checks catch (`cargo xtask mutants`).

use crate::plan::{BufferRole, Op, OpSite, Plan, Region};
use crate::schedule::{orders, schedule_with};
use crate::verify::{accesses, dataflow, timed_ops, verify, Cells, TimedOp};

/// The kinds of mutation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MutationKind {
    /// Remove one `Signal`.
    DropSignal,
    /// Lower one `Wait` value by one.
    LowerWait,
    /// Swap two adjacent ops of a lane.
    SwapAdjacent,
    /// Send a `Copy`, or a GEMM's result on a peer, to a different device.
    WrongPeer,
    /// Write a `Copy` into the neighbouring slot of its destination buffer.
    WrongSlot,
    /// Shrink a multi-slot scratch buffer by one slot, so a slot is reused too early.
    ShrinkScratch,
    /// Make an accumulating GEMM overwrite its output instead (a wgrad that forgets
    /// beta = 1).
    Overwrite,
    /// Move an accumulating GEMM before the previous one into the same region of its
    /// lane (the contributions added in another order); likewise an attention block
    /// or state merge moved before the previous one into the same state.
    ReorderAccumulation,
    /// Shift the first key position of a causal attention block by one (a wrong
    /// causal offset).
    CausalOffset,
    /// Remove one attention block (a key block never attended).
    SkipBlock,
    /// Point a grouped GEMM at the next token chunk's segments (a wrong offset into
    /// the routing tables).
    WrongOffset,
    /// Shift a combine's weights by one slot (each row weighted by its neighbour's weight).
    WrongWeight,
    /// Leave out the last expert group of a grouped GEMM.
    DropGroup,
    /// Compute a block of a tile-granular GEMM before the Wait that gates it (the
    /// kernel skips the block's flag).
    UngatedBlock,
    /// Perform a Signal of a tile-granular GEMM before the block it releases is written.
    EarlyRelease,
}

// In report order.
names!(MutationKind, "mutation kind", {
    DropSignal => "drop-signal",
    LowerWait => "lower-wait",
    SwapAdjacent => "swap-adjacent",
    WrongPeer => "wrong-peer",
    WrongSlot => "wrong-slot",
    ShrinkScratch => "shrink-scratch",
    Overwrite => "overwrite",
    ReorderAccumulation => "reorder-accumulation",
    CausalOffset => "causal-offset",
    SkipBlock => "skip-block",
    WrongOffset => "wrong-offset",
    WrongWeight => "wrong-weight",
    DropGroup => "drop-group",
    UngatedBlock => "ungated-block",
    EarlyRelease => "early-release",
});

/// One mutant of a plan.
#[derive(Clone, Debug)]
pub struct Mutant {
    /// The kind.
    pub kind: MutationKind,
    /// What was changed, for the report.
    pub description: String,
    /// The mutated plan.
    pub plan: Plan,
    /// When the mutation provably cannot change behaviour, why (such a mutant is
    /// excluded from the kill rate if it survives, and the reason is printed).
    pub equivalent: Option<&'static str>,
    /// Whether that proof holds only for the exact input family (a change of the f32
    /// summation order, invisible only when every partial sum is exact).
    pub exact_only: bool,
    /// For a swap of adjacent ops, the (device, lane, index) of the first.
    pub swapped: Option<(usize, usize, usize)>,
    /// Whether the mutation keeps every op in its place and changes only where a copy
    /// writes or how long a wait waits (wrong peer, wrong slot, lower wait), so that
    /// [`dataflow_equivalence`] can decide it.
    pub rewired: bool,
    /// For a mutation of a grouped GEMM, the (device, op, segments) it changes: it is
    /// equivalent when the routing of the run leaves all of them empty
    /// ([`routing_equivalence`]).
    pub segments: Option<ChangedSegments>,
}

/// The routing segments a grouped-GEMM mutant changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChangedSegments {
    /// Device of the op.
    pub device: usize,
    /// The segment table the op reads.
    pub seg: crate::plan::BufId,
    /// (expert, chunk) pairs whose rows the mutant computes differently.
    pub pairs: Vec<(usize, usize)>,
}

/// Why a grouped-GEMM mutant cannot change results under `seed`'s routing, if it
/// cannot: every segment it changes is empty (the router sent no token there).
pub fn routing_equivalence(plan: &Plan, changed: &ChangedSegments, seed: u32) -> Option<&'static str> {
    let (ids, tables, experts) = plan.programs[changed.device].lanes.iter().flatten().find_map(|op| match op {
        Op::Route { ids, tables, experts } if tables.seg.buf == changed.seg => Some((ids, tables, *experts)),
        _ => None,
    })?;
    let BufferRole::Router { router, .. } = &plan.buffer(ids.buf).role else { return None };
    let chunks = tables.chunks(experts);
    let t = crate::moe::route(&router.ids(seed), ids.cols, experts, chunks, tables.shards, tables.perm.rows);
    changed.pairs.iter().all(|&(e, c)| t.segment(e, c, chunks).is_empty()).then_some(
        "every routing segment the mutant changes is empty under this case's routing: no row is computed differently",
    )
}

fn is_data(op: &Op) -> bool {
    !matches!(op, Op::Signal { .. } | Op::Wait { .. })
}

fn conflict(device: usize, a: &Op, b: &Op) -> bool {
    let (xa, xb) = (accesses(device, a), accesses(device, b));
    xa.iter().any(|p| {
        xb.iter().any(|q| {
            (p.write || q.write) && p.device == q.device && p.region.buf == q.region.buf && p.region.overlaps(&q.region)
        })
    })
}

/// Why swapping adjacent ops `a` (first) and `b` cannot change results, if it cannot.
fn swap_equivalence(device: usize, a: &Op, b: &Op) -> Option<&'static str> {
    match (a, b) {
        (Op::Wait { .. }, Op::Wait { .. }) => Some("two acquires in a row commute: the lane proceeds after both"),
        (Op::Signal { .. }, Op::Signal { .. }) => {
            Some("two releases in a row commute: each covers the same earlier ops")
        }
        (Op::Signal { .. }, _) => {
            Some("moves a release later: adds ordering only, so a race-free, deadlock-free result cannot change")
        }
        (_, Op::Wait { .. }) => {
            Some("moves an acquire earlier: adds ordering only, so a race-free, deadlock-free result cannot change")
        }
        _ if is_data(a) && is_data(b) && !conflict(device, a, b) => {
            Some("two data ops of one lane touching disjoint memory commute")
        }
        (
            Op::GroupedGemm { a: a1, c: c1, tables: t1, chunk: k1, groups: g1, zero_unrouted: false, .. },
            Op::GroupedGemm { a: a2, c: c2, tables: t2, chunk: k2, groups: g2, zero_unrouted: false, .. },
        ) if c1 == c2
            && t1 == t2
            && (k1 != k2 || g1.end <= g2.start || g2.end <= g1.start)
            && [a1, a2].iter().all(|r| r.buf != c1.buf) =>
        {
            Some(
                "two grouped GEMMs of different routing segments write disjoint rows whatever the routing, and commute",
            )
        }
        (
            Op::Gemm { a: a1, b: b1, c: c1, accumulate: true, c_device: o1, .. },
            Op::Gemm { a: a2, b: b2, c: c2, accumulate: true, c_device: o2, .. },
        ) if c1 == c2 && o1 == o2 && [a1, b1, a2, b2].iter().all(|r| r.buf != c1.buf || !r.overlaps(c1)) => {
            Some(ACCUMULATION_ORDER)
        }
        _ => None,
    }
}

/// Why two GEMMs accumulating into one region may trade places (the exact family
/// only: in the realistic family the changed rounding is caught by the comparison with
/// the unmutated plan's bits).
const ACCUMULATION_ORDER: &str = "two GEMMs accumulating into the same f32 region commute up to the order of the f32 \
     sum: with exact inputs every partial sum is exact, so the bits cannot change (exact cases only)";

/// Why shrinking scratch buffer `buf` by its last slot of `slot` elements cannot change
/// results, if it cannot: after the shrink the last slot shares memory with the first,
/// which is harmless when, on every device, every access to one of them happens before
/// every access to the other (checked in each of the interleavings the mutants run
/// under): each read then still sees the write it saw before.
fn shrink_equivalence(plan: &Plan, buf: usize, slot: usize) -> Option<&'static str> {
    let len = plan.buffers[buf].len();
    let touches = |r: &Region, range: std::ops::Range<usize>| {
        r.buf.0 == buf
            && (0..r.rows).any(|row| {
                let start = r.offset + row * r.stride;
                start < range.end && range.start < start + r.cols
            })
    };
    for order in orders(EQUIVALENCE_ORDERS, plan.devices) {
        let schedule = schedule_with(plan, order).ok()?;
        let timed = timed_ops(plan, &schedule);
        for device in 0..plan.devices {
            let (mut first, mut last) = (Vec::new(), Vec::new());
            for t in &timed {
                let op = &plan.programs[t.site.device].lanes[t.site.lane][t.site.index];
                for acc in accesses(t.site.device, op).iter().filter(|acc| acc.device == device) {
                    if touches(&acc.region, 0..slot) {
                        first.push(t);
                    }
                    if touches(&acc.region, len - slot..len) {
                        last.push(t);
                    }
                }
            }
            let ordered = |xs: &[&TimedOp], ys: &[&TimedOp]| xs.iter().all(|x| ys.iter().all(|y| x.happens_before(y)));
            if !(ordered(&first, &last) || ordered(&last, &first)) {
                return None;
            }
        }
    }
    Some(
        "on every device the scratch's first and last slots are used one after the other (happens-before), \
         so they can share memory: the plan does not need the slot the mutant removes",
    )
}

/// Why a mutant that keeps every op in its place cannot change results when no local
/// rule says so (checked only for mutants that survive; it replays both plans): the
/// mutant is race-free and every read in it, and every element of every result,
/// observes the same write as in the plan, so both compute the same function. `swapped`
/// names the first of two adjacent ops a [`MutationKind::SwapAdjacent`] mutant swapped
/// (their sites are exchanged before comparing); without it the sites are the plan's
/// ([`Mutant::rewired`]: a copy sent elsewhere, a lower wait).
pub fn dataflow_equivalence(
    plan: &Plan,
    mutant: &Plan,
    swapped: Option<(usize, usize, usize)>,
) -> Option<&'static str> {
    let schedule = schedule_with(plan, crate::schedule::Order::Default).ok()?;
    let replayed = schedule_with(mutant, crate::schedule::Order::Default).ok()?;
    if !verify(mutant, &replayed).ok()?.is_empty() {
        return None;
    }
    let rename = |s: OpSite| match swapped {
        Some((device, lane, index))
            if (s.device, s.lane) == (device, lane) && (s.index == index || s.index == index + 1) =>
        {
            OpSite { index: 2 * index + 1 - s.index, ..s }
        }
        _ => s,
    };
    let cells = Cells::common(&[plan, mutant])?;
    if dataflow(plan, &schedule, &|s| s, &cells).ok()? != dataflow(mutant, &replayed, &rename, &cells).ok()? {
        return None;
    }
    Some(if swapped.is_some() {
        "the swap leaves every read and every output element with the same writer (other synchronisation \
         orders the accesses it exposes) and the plan race-free, so it computes the same function"
    } else {
        "the changed copy or wait leaves every read and every output element with the same writer (the data \
         it moves is never read there, or other synchronisation orders it) and the plan race-free, so it \
         computes the same function"
    })
}

/// Interleavings in which [`shrink_equivalence`] checks the order of slot uses (those
/// `cargo xtask mutants` runs every mutant under).
pub const EQUIVALENCE_ORDERS: usize = 4;

/// The slot size of a multi-slot scratch buffer: the size of the copies written into it.
fn slot_size(plan: &Plan, buf: usize) -> Option<usize> {
    let b = &plan.buffers[buf];
    if b.role != BufferRole::Scratch {
        return None;
    }
    plan.ops().find_map(|(_, op)| match op {
        Op::Copy { dst, .. } if dst.buf.0 == buf && dst.stride == b.cols && dst.cols == b.cols => {
            let slot = dst.rows * b.cols;
            (slot > 0 && b.len() % slot == 0 && b.len() / slot >= 2).then_some(slot)
        }
        _ => None,
    })
}

/// Every mutant of `plan` whose mutation site lies on one of `devices` (mutants are
/// symmetric across devices; the first and last device cover the ring's wrap-around).
pub fn mutants(plan: &Plan, devices: &[usize]) -> Vec<Mutant> {
    let mut out = Vec::new();
    let n = plan.devices;
    for (site, op) in plan.ops() {
        if !devices.contains(&site.device) {
            continue;
        }
        let OpSite { device, lane, index } = site;
        let text = plan.op_text(op);
        let mut with = |kind, description: String, f: &mut dyn FnMut(&mut Plan), equivalent| {
            let mut p = plan.clone();
            f(&mut p);
            p.name = format!("{} [{kind}: {description}]", plan.name);
            let exact_only = equivalent == Some(ACCUMULATION_ORDER);
            let swapped =
                matches!(kind, MutationKind::SwapAdjacent | MutationKind::UngatedBlock | MutationKind::EarlyRelease)
                    .then_some((device, lane, index));
            let rewired = matches!(kind, MutationKind::WrongPeer | MutationKind::WrongSlot | MutationKind::LowerWait);
            out.push(Mutant { kind, description, plan: p, equivalent, exact_only, swapped, rewired, segments: None });
        };
        let here = format!("device {device} lane {} op {index} `{text}`", plan.lanes[lane]);
        match op {
            Op::Signal { .. } => {
                with(
                    MutationKind::DropSignal,
                    format!("drop {here}"),
                    &mut |p| {
                        p.programs[device].lanes[lane].remove(index);
                    },
                    None,
                );
            }
            Op::Wait { sem, value } if *value > 0 => {
                let (sem, value) = (*sem, *value);
                with(
                    MutationKind::LowerWait,
                    format!("{here} -> >= {}", value - 1),
                    &mut |p| {
                        p.programs[device].lanes[lane][index] = Op::Wait { sem, value: value - 1 };
                    },
                    None,
                );
            }
            Op::Copy { src, dst_device, dst, engine } if n > 1 => {
                let (src, dst, engine) = (*src, *dst, *engine);
                let wrong = (dst_device + 1) % n;
                with(
                    MutationKind::WrongPeer,
                    format!("{here} -> dev{wrong}"),
                    &mut |p| {
                        p.programs[device].lanes[lane][index] = Op::Copy { src, dst_device: wrong, dst, engine };
                    },
                    None,
                );
            }
            Op::Gemm { c_device: Some(peer), .. } if n > 1 => {
                let wrong = (peer + 1) % n;
                let mut mutated = op.clone();
                if let Op::Gemm { c_device, .. } = &mut mutated {
                    *c_device = Some(wrong);
                }
                with(
                    MutationKind::WrongPeer,
                    format!("{here} -> dev{wrong}"),
                    &mut |p| {
                        p.programs[device].lanes[lane][index] = mutated.clone();
                    },
                    None,
                );
            }
            _ => {}
        }
        if let Op::Copy { src, dst_device, dst, engine } = op {
            let len = plan.buffers[dst.buf.0].len();
            let step = dst.rows * dst.stride;
            let moved = if dst.end() + step <= len { Some(dst.offset + step) } else { dst.offset.checked_sub(step) };
            if let (Some(offset), true) = (moved, step > 0) {
                let (src, dst_device, engine) = (*src, *dst_device, *engine);
                let dst = Region { offset, ..*dst };
                with(
                    MutationKind::WrongSlot,
                    format!("{here} -> offset {offset}"),
                    &mut |p| {
                        p.programs[device].lanes[lane][index] = Op::Copy { src, dst_device, dst, engine };
                    },
                    None,
                );
            }
        }
        if let Op::Gemm { a, b, c, trans_a, trans_b, accumulate: true, fused, c_device } = op {
            let (a, b, c, trans_a, trans_b, fused, c_device) = (*a, *b, *c, *trans_a, *trans_b, *fused, *c_device);
            with(
                MutationKind::Overwrite,
                format!("{here} overwrites"),
                &mut |p| {
                    p.programs[device].lanes[lane][index] =
                        Op::Gemm { a, b, c, trans_a, trans_b, accumulate: false, fused, c_device };
                },
                None,
            );
        }
        // The next accumulation into the same region of the same device (a GEMM's f32
        // output, an attention state) of this lane, moved before this one.
        let target = |o: &Op| match o {
            Op::Gemm { c, accumulate: true, c_device, .. } => Some((c_device.unwrap_or(device), *c)),
            Op::Attend { state, .. } | Op::AttnMerge { into: state, .. } => Some((device, state.acc)),
            _ => None,
        };
        if let Some((_, acc)) = target(op) {
            let later = plan.programs[device].lanes[lane].iter().enumerate().skip(index + 1).find(|(_, o)| {
                target(o) == target(op)
                    && matches!(
                        (o, op),
                        (Op::Gemm { .. }, Op::Gemm { .. })
                            | (Op::Attend { .. } | Op::AttnMerge { .. }, Op::Attend { .. } | Op::AttnMerge { .. })
                    )
            });
            if let Some((j, next)) = later {
                // Two GEMMs commute in exact cases when neither reads what they add into.
                let equivalent = match op {
                    Op::Gemm { a, b, .. } => {
                        [a, b].iter().all(|r| r.buf != acc.buf || !r.overlaps(&acc)).then_some(ACCUMULATION_ORDER)
                    }
                    _ => None,
                };
                with(
                    MutationKind::ReorderAccumulation,
                    format!("move op {j} `{}` before {here}", plan.op_text(next)),
                    &mut |p| {
                        let moved = p.programs[device].lanes[lane].remove(j);
                        p.programs[device].lanes[lane].insert(index, moved);
                    },
                    equivalent,
                );
            }
        }
        // Attention: a causal block whose keys start one position earlier (or later); a
        // block skipped.
        if let Op::Attend { causal, .. } = op {
            if let Some(c) = causal {
                let shifted = if c.k_pos > 0 { c.k_pos - 1 } else { c.k_pos + 1 };
                with(
                    MutationKind::CausalOffset,
                    format!("{here} with keys from position {shifted}"),
                    &mut |p| {
                        if let Op::Attend { causal: Some(c), .. } = &mut p.programs[device].lanes[lane][index] {
                            c.k_pos = shifted;
                        }
                    },
                    None,
                );
            }
            with(
                MutationKind::SkipBlock,
                format!("skip {here}"),
                &mut |p| {
                    p.programs[device].lanes[lane].remove(index);
                },
                None,
            );
        }
        // MoE: a grouped GEMM reading the next chunk's segments, or missing its last
        // group; a combine weighting each slot with its neighbour's weight.
        let mut table_mutants = Vec::new();
        if let Op::GroupedGemm { tables, experts, groups, chunk, .. } = op {
            let chunks = tables.chunks(*experts);
            let segs = |c: usize, gs: std::ops::Range<usize>| gs.map(move |e| (e, c));
            let changed = |pairs: Vec<(usize, usize)>| ChangedSegments { device, seg: tables.seg.buf, pairs };
            let mut table_mutant = |kind, description: String, f: &mut dyn FnMut(&mut Op), pairs| {
                let mut p = plan.clone();
                f(&mut p.programs[device].lanes[lane][index]);
                p.name = format!("{} [{kind}: {description}]", plan.name);
                let segments = Some(changed(pairs));
                table_mutants.push(Mutant {
                    kind,
                    description,
                    plan: p,
                    equivalent: None,
                    exact_only: false,
                    swapped: None,
                    rewired: false,
                    segments,
                });
            };
            if chunks > 1 {
                let wrong = (chunk + 1) % chunks;
                let pairs = segs(*chunk, groups.clone()).chain(segs(wrong, groups.clone())).collect();
                table_mutant(
                    MutationKind::WrongOffset,
                    format!("{here} -> chunk {wrong}"),
                    &mut |o| {
                        if let Op::GroupedGemm { chunk, .. } = o {
                            *chunk = wrong;
                        }
                    },
                    pairs,
                );
            }
            if !groups.is_empty() {
                let last = groups.end - 1;
                table_mutant(
                    MutationKind::DropGroup,
                    format!("{here} without expert {last}"),
                    &mut |o| {
                        if let Op::GroupedGemm { groups, .. } = o {
                            groups.end -= 1;
                        }
                    },
                    vec![(last, *chunk)],
                );
            }
        }
        if let Op::Combine { weights, .. } = op {
            let len = plan.buffers[weights.buf.0].len();
            let shifted = if weights.end() < len { weights.offset + 1 } else { weights.offset.saturating_sub(1) };
            if shifted != weights.offset {
                with(
                    MutationKind::WrongWeight,
                    format!("{here} with weights shifted one slot"),
                    &mut |p| {
                        if let Op::Combine { weights, .. } = &mut p.programs[device].lanes[lane][index] {
                            weights.offset = shifted;
                        }
                    },
                    None,
                );
            }
        }
        if let Some(next) = plan.programs[device].lanes[lane].get(index + 1) {
            let equivalent = swap_equivalence(device, op, next);
            let desc = format!("swap {here} with `{}`", plan.op_text(next));
            // Two swaps of a tile-granular GEMM's blocks have names of their own.
            let kind = match (op, next) {
                (Op::Wait { .. }, Op::Gemm { fused: Some(_), .. }) => MutationKind::UngatedBlock,
                (Op::Gemm { fused: Some(_), .. }, Op::Signal { .. }) => MutationKind::EarlyRelease,
                _ => MutationKind::SwapAdjacent,
            };
            with(
                kind,
                desc,
                &mut |p| {
                    p.programs[device].lanes[lane].swap(index, index + 1);
                },
                equivalent,
            );
        }
        out.append(&mut table_mutants);
    }
    for buf in 0..plan.buffers.len() {
        if let Some(slot) = slot_size(plan, buf) {
            let len = plan.buffers[buf].len();
            let smaller = len - slot;
            let name = plan.buffers[buf].name.clone();
            let mut p = plan.clone();
            let remap = |r: &mut Region| {
                if r.buf.0 == buf {
                    r.offset %= smaller;
                }
            };
            for prog in &mut p.programs {
                for ops in &mut prog.lanes {
                    for op in ops {
                        match op {
                            Op::Gemm { a, b, c, .. } | Op::GroupedGemm { a, b, c, .. } => {
                                [a, b, c].into_iter().for_each(remap)
                            }
                            Op::Combine { rows, weights, inv, out } => {
                                [rows, weights, inv, out].into_iter().for_each(remap)
                            }
                            Op::Copy { src, dst, .. } => [src, dst].into_iter().for_each(remap),
                            Op::Reduce { inputs, output } | Op::Pointwise { inputs, output, .. } => {
                                inputs.iter_mut().for_each(remap);
                                remap(output);
                            }
                            _ => {}
                        }
                    }
                }
            }
            p.buffers[buf].rows -= slot / p.buffers[buf].cols;
            let description = format!("{name}: {} slots -> {}", len / slot, smaller / slot);
            p.name = format!("{} [shrink-scratch: {description}]", plan.name);
            let equivalent = shrink_equivalence(plan, buf, slot);
            out.push(Mutant {
                kind: MutationKind::ShrinkScratch,
                description,
                plan: p,
                equivalent,
                exact_only: false,
                swapped: None,
                rewired: false,
                segments: None,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::build_plan;
    use crate::{Algorithm, DType, OpKind, Problem};

    #[test]
    fn every_kind_is_generated_for_a_ring_plan() {
        let p = Problem::new(OpKind::AgGemm, 3, 6, 3, 2, DType::F32, DType::F32).unwrap();
        let plan = build_plan(&p, Algorithm::Ring).unwrap();
        let ms = mutants(&plan, &[0, 2]);
        // The ring has no accumulating GEMM, no attention and no routing (see the linear,
        // attention and MoE tests for those kinds).
        let elsewhere = [
            MutationKind::Overwrite,
            MutationKind::ReorderAccumulation,
            MutationKind::CausalOffset,
            MutationKind::SkipBlock,
            MutationKind::WrongOffset,
            MutationKind::WrongWeight,
            MutationKind::DropGroup,
            MutationKind::UngatedBlock,
            MutationKind::EarlyRelease,
        ];
        for kind in MutationKind::ALL.into_iter().filter(|k| !elsewhere.contains(k)) {
            assert!(ms.iter().any(|m| m.kind == kind), "{kind}");
        }
        assert!(ms.iter().all(|m| m.plan != plan));
        // Shrinking keeps every region inside the smaller buffer.
        let shrunk = ms.iter().find(|m| m.kind == MutationKind::ShrinkScratch).unwrap();
        shrunk.plan.validate().unwrap();
        // The ring's two slots are live at once (no happens-before between their uses).
        assert_eq!(shrunk.equivalent, None);
    }

    #[test]
    fn fused_gemm_blocks_without_their_wait_or_released_early_are_caught_statically() {
        for (op, algorithm) in [
            (OpKind::AgGemm, Algorithm::Fused { chunks: 2 }),
            (OpKind::GemmRs, Algorithm::Fused { chunks: 2 }),
            (OpKind::GemmRs, Algorithm::FusedPush { chunks: 2 }),
        ] {
            let p = Problem::new(op, 3, 12, 6, 6, DType::F32, DType::F32).unwrap();
            let plan = build_plan(&p, algorithm).unwrap();
            let ms = mutants(&plan, &[0, 2]);
            // AG+GEMM's blocks wait for shards; GEMM+RS's blocks release partials;
            // fused_push's blocks wait for the previous contributor and release the next.
            let kinds: &[MutationKind] = match (op, algorithm) {
                (OpKind::AgGemm, _) => &[MutationKind::UngatedBlock],
                (_, Algorithm::FusedPush { .. }) => &[MutationKind::UngatedBlock, MutationKind::EarlyRelease],
                _ => &[MutationKind::EarlyRelease],
            };
            for &kind in kinds {
                let of_kind: Vec<&Mutant> = ms.iter().filter(|m| m.kind == kind).collect();
                assert!(!of_kind.is_empty(), "{op}: no {kind} mutant");
                for m in of_kind {
                    m.plan.validate().unwrap_or_else(|e| panic!("{}: {e}", m.description));
                    let s = schedule_with(&m.plan, crate::schedule::Order::Default).unwrap();
                    assert!(!verify(&m.plan, &s).unwrap().is_empty(), "{op}: not caught: {}", m.description);
                }
            }
        }
    }

    #[test]
    fn accumulating_gemms_get_overwrite_and_reorder_mutants() {
        use crate::linear::{build_linear_plan, Layer, LinearAlgorithm, LinearProblem, Pass};
        let p = LinearProblem::new(Layer::Row, Pass::Backward, false, 2, 2, 4, 4, 4, DType::F32).unwrap();
        let plan = build_linear_plan(&p, LinearAlgorithm::Baseline).unwrap();
        let ms = mutants(&plan, &[0]);
        let overwrite = ms.iter().find(|m| m.kind == MutationKind::Overwrite).expect("an overwrite mutant");
        assert!(overwrite.plan.ops().any(|(_, op)| matches!(op, Op::Gemm { accumulate: false, c, .. }
            if overwrite.plan.buffer(c.buf).name == "main_grad")));
        let reorder = ms.iter().find(|m| m.kind == MutationKind::ReorderAccumulation).expect("a reorder mutant");
        // Micro-batch 1's wgrad now comes first: equivalent only for exact inputs.
        assert!(reorder.exact_only && reorder.equivalent.is_some(), "{}", reorder.description);
    }

    /// ring_push's GEMMs add into the same region of different devices: no two of them
    /// accumulate into one place, so none is a reorder of another; a wrong owner is a
    /// wrong-peer mutant, caught by the verifier.
    #[test]
    fn gemms_on_peers_are_rewired_but_never_reordered_across_devices() {
        let p = Problem::new(OpKind::GemmRs, 3, 12, 6, 6, DType::F32, DType::F32).unwrap();
        let plan = build_plan(&p, Algorithm::RingPush).unwrap();
        let ms = mutants(&plan, &[0]);
        assert!(!ms.iter().any(|m| m.kind == MutationKind::ReorderAccumulation), "a cross-device reorder");
        let rewired: Vec<&Mutant> = ms.iter().filter(|m| m.kind == MutationKind::WrongPeer).collect();
        assert_eq!(rewired.len(), 2, "one per GEMM of device 0 on a peer");
        for m in rewired {
            let s = schedule_with(&m.plan, crate::schedule::Order::Default).unwrap();
            assert!(!verify(&m.plan, &s).unwrap().is_empty(), "not caught: {}", m.description);
        }
    }

    #[test]
    fn attention_blocks_get_offset_skip_and_reorder_mutants_and_copies_are_rewired() {
        use crate::attention::{build_attention_plan, AttentionAlgorithm, AttentionProblem, Layout};
        let p = AttentionProblem::new(4, 32, 2, 1, 4, true, Layout::Balanced, None, DType::F32).unwrap();
        let plan = build_attention_plan(&p, AttentionAlgorithm::Ring).unwrap();
        let ms = mutants(&plan, &[0, 3]);
        for kind in [MutationKind::CausalOffset, MutationKind::SkipBlock, MutationKind::ReorderAccumulation] {
            let m = ms.iter().find(|m| m.kind == kind).unwrap_or_else(|| panic!("no {kind} mutant"));
            assert!(m.equivalent.is_none() && !m.rewired, "{}", m.description);
        }
        let offset = ms.iter().find(|m| m.kind == MutationKind::CausalOffset).unwrap();
        assert!(offset
            .plan
            .ops()
            .any(|(_, op)| matches!(op, Op::Attend { causal: Some(c), .. } if c.k_pos != c.q_pos)));
        assert!(ms.iter().filter(|m| m.kind == MutationKind::WrongPeer).all(|m| m.rewired));
        // A merge reordered in split-KV decode.
        let p = AttentionProblem::new(4, 16, 2, 2, 4, false, Layout::Contiguous, Some(1), DType::F32).unwrap();
        let plan = build_attention_plan(&p, AttentionAlgorithm::SplitKv).unwrap();
        assert!(mutants(&plan, &[0])
            .iter()
            .any(|m| m.kind == MutationKind::ReorderAccumulation && m.description.contains("attn_merge")));
    }

    #[test]
    fn grouped_gemms_and_combines_get_table_mutants_decided_on_the_routing() {
        use crate::moe::{build_moe_plan, MoeOp, MoeProblem, Routing};
        let p = MoeProblem::new(MoeOp::MoeRs, 2, 8, 4, 4, 4, 1, Routing::Single, DType::F32, DType::F32).unwrap();
        let plan = build_moe_plan(&p, Algorithm::Ring).unwrap();
        let ms = mutants(&plan, &[0]);
        for kind in [MutationKind::WrongOffset, MutationKind::WrongWeight, MutationKind::DropGroup] {
            let m = ms.iter().find(|m| m.kind == kind).unwrap_or_else(|| panic!("no {kind} mutant"));
            m.plan.validate().unwrap_or_else(|e| panic!("{}: {e}", m.description));
        }
        // Single routing sends every token to the last expert: dropping it changes rows,
        // while a wrong offset between two chunks that both route to it does too.
        let drop = ms.iter().find(|m| m.kind == MutationKind::DropGroup).unwrap();
        assert_eq!(routing_equivalence(&plan, drop.segments.as_ref().unwrap(), 1), None);
        // Dropping expert 0 instead (which single routing never uses) is provably harmless.
        let mut empty = drop.segments.clone().unwrap();
        empty.pairs = vec![(0, 0), (0, 1)];
        assert!(routing_equivalence(&plan, &empty, 1).is_some());
    }
}
