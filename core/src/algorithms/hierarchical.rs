//! The hierarchical (node-aware) plans: for D devices in nodes of `node` GPUs, every
//! shard (AG+GEMM) or node sum of a block (GEMM+RS) crosses between two nodes once, not
//! once for each GPU of the receiving node.
//!
//! Device d is GPU l = d mod `node` of node g = d / `node`; the G = D / `node` nodes' GPUs
//! of one local index l share a network rail (each GPU its own NIC). In AG+GEMM, device
//! (g, l):
//! - sends its shard to every other GPU of its node (the fast links inside a node);
//! - sends its shard over its NIC to GPU l of every other node, at step s to node g + s
//!   (mod G), so that at every step each NIC sends one shard and receives one;
//! - forwards each shard that arrives over its NIC to the other GPUs of its node.
//!
//! A NIC then carries G − 1 shards each way, where a direct AllGather sends it the
//! D − `node` shards of all the other nodes' GPUs: `node` times fewer bytes over the
//! network, for `node` − 1 extra copies inside the node per remote shard. The GEMMs
//! overlap the collective: the own shard's first, the node's other shards' once they are
//! in, then each remote node's rows (one GEMM) once all of its shards are in. GEMM+RS runs
//! the same rails the other way ([`gemm_reduce`]); GEMM+AR is GEMM+RS, then the
//! AllGather of C's blocks.

use super::direct::chained_sum;
use super::ring::{copy, signal, wait};
use super::{start_plan, Algorithm, AlgorithmError};
use crate::dtype::DType;
use crate::plan::MAX_REDUCE_INPUTS as REDUCE_FAN_IN;
use crate::plan::{BufferRole, LaneId, Op, Plan, PlanBuilder, Region, SemId};
use crate::problem::{OpKind, Problem};

/// The devices cut into nodes of `node` GPUs: device d is GPU d mod `node` of node
/// d / `node`.
#[derive(Clone, Copy)]
struct Nodes {
    node: usize,
    nodes: usize,
}

impl Nodes {
    /// `devices` in nodes of `node` GPUs, refused where they do not make whole nodes.
    fn new(devices: usize, node: usize) -> Result<Nodes, AlgorithmError> {
        if node == 0 || devices % node != 0 {
            return Err(AlgorithmError::NodeSize { devices, node });
        }
        Ok(Nodes { node, nodes: devices / node })
    }

    /// The GPU `t` places on from d inside d's node.
    fn peer(self, d: usize, t: usize) -> usize {
        d / self.node * self.node + (d % self.node + t) % self.node
    }

    /// The GPU of d's local index in the node `s` nodes on: where d sends at step s.
    fn rail(self, d: usize, s: usize) -> usize {
        (d / self.node + s) % self.nodes * self.node + d % self.node
    }

    /// The GPU of d's local index in the node `s` nodes back: what d receives at step s.
    fn rail_back(self, d: usize, s: usize) -> usize {
        (d / self.node + self.nodes - s % self.nodes) % self.nodes * self.node + d % self.node
    }

    /// The first device of node `h`.
    fn first(self, h: usize) -> usize {
        h * self.node
    }
}

/// The semaphores of a hierarchical AllGather, as each device counts what it receives:
/// its node's other blocks (`local`), at step s the block from the NIC (`over_nic[s − 1]`)
/// and that node's other blocks, forwarded inside this node (`forwarded[s − 1]`).
struct GatherSems {
    local: SemId,
    over_nic: Vec<SemId>,
    forwarded: Vec<SemId>,
}

impl GatherSems {
    fn declare(b: &mut PlanBuilder, nodes: Nodes, prefix: &str) -> GatherSems {
        let steps = |b: &mut PlanBuilder, what: &str| {
            (1..nodes.nodes).map(|s| b.semaphore(&format!("{prefix}{what}_step{s}"))).collect()
        };
        let local = b.semaphore(&format!("{prefix}local"));
        let over_nic = steps(b, "nic");
        let forwarded = steps(b, "forwarded");
        GatherSems { local, over_nic, forwarded }
    }

    /// Waits on `lane` until step s's node (or, at s = 0, the own node) is all in.
    fn wait_node(&self, b: &mut PlanBuilder, d: usize, lane: LaneId, nodes: Nodes, s: usize) {
        let others = (nodes.node - 1) as u32;
        if s == 0 {
            if others > 0 {
                b.push(d, lane, wait(self.local, others));
            }
            return;
        }
        b.push(d, lane, wait(self.over_nic[s - 1], 1));
        if others > 0 {
            b.push(d, lane, wait(self.forwarded[s - 1], others));
        }
    }
}

/// The lanes of the copies inside a node: two where a GPU sends to more than one peer
/// there, the first to the first half of the node and the second to the rest, so that two
/// copies run at once and together take the GPU's link rather than one copy engine's rate.
fn inside_lanes(b: &mut PlanBuilder, node: usize) -> Vec<LaneId> {
    let mut lanes = vec![b.lane("inside")];
    if node > 2 {
        lanes.push(b.lane("inside2"));
    }
    lanes
}

/// The lane of [`inside_lanes`] that sends to the GPU `t` places on in the node.
fn inside_lane(lanes: &[LaneId], nodes: Nodes, t: usize) -> LaneId {
    lanes[usize::from(t > nodes.node / 2).min(lanes.len() - 1)]
}

/// Device d's part of a hierarchical AllGather of `blocks` (device e's block is
/// `blocks[e]` on every device; d's own comes from `own`): over the NIC on `nic` to GPU
/// l of every other node, and to the node's other GPUs, then each block that came over
/// the NIC forwarded to them, on the lanes `inside` ([`inside_lanes`]).
fn gather(
    b: &mut PlanBuilder,
    d: usize,
    nodes: Nodes,
    (nic, inside): (LaneId, &[LaneId]),
    sems: &GatherSems,
    own: Region,
    blocks: &[Region],
) {
    let lane_to = |t: usize| inside_lane(inside, nodes, t);
    for s in 1..nodes.nodes {
        let to = nodes.rail(d, s);
        b.push(d, nic, copy(own, to, blocks[d]));
        b.push(d, nic, signal(to, sems.over_nic[s - 1]));
    }
    for t in 1..nodes.node {
        b.push(d, lane_to(t), copy(own, nodes.peer(d, t), blocks[d]));
        b.push(d, lane_to(t), signal(nodes.peer(d, t), sems.local));
    }
    for s in 1..nodes.nodes {
        let from = nodes.rail_back(d, s);
        for &lane in inside {
            b.push(d, lane, wait(sems.over_nic[s - 1], 1));
        }
        for t in 1..nodes.node {
            b.push(d, lane_to(t), copy(blocks[from], nodes.peer(d, t), blocks[from]));
            b.push(d, lane_to(t), signal(nodes.peer(d, t), sems.forwarded[s - 1]));
        }
    }
}

/// AG+GEMM, hierarchical: see the module's description.
pub(super) fn ag_gemm(p: &Problem, node: usize) -> Result<Plan, AlgorithmError> {
    let nodes = Nodes::new(p.devices, node)?;
    let (n, shards) = (p.devices, p.row_split());
    let (mut b, a, bm, c) = start_plan(p, Algorithm::Hierarchical { node });
    let gathered = b.buffer("G", p.input, p.m, p.k, BufferRole::Scratch);
    let sems = GatherSems::declare(&mut b, nodes, "");
    let (compute, nic) = (b.lane("compute"), b.lane("nic"));
    let inside = inside_lanes(&mut b, node);
    let blocks: Vec<Region> = (0..n).map(|r| b.rows(gathered, shards.start(r), shards.len(r))).collect();
    for d in 0..n {
        let own = b.rows(a, 0, shards.len(d));
        gather(&mut b, d, nodes, (nic, &inside), &sems, own, &blocks);
        let whole_b = b.whole(bm);
        let own_c = b.rows(c, shards.start(d), shards.len(d));
        b.push(d, compute, Op::gemm(own, whole_b, own_c));
        // The rows of devices `first..end`, once they are in.
        let multiply = |b: &mut PlanBuilder, first: usize, end: usize| {
            if first < end {
                let (start, rows) = shards.span(first, end);
                let (a_rows, c_rows) = (b.rows(gathered, start, rows), b.rows(c, start, rows));
                b.push(d, compute, Op::gemm(a_rows, whole_b, c_rows));
            }
        };
        // The node's rows before and after the own shard's, then each other node's.
        let g = d / node;
        sems.wait_node(&mut b, d, compute, nodes, 0);
        multiply(&mut b, nodes.first(g), d);
        multiply(&mut b, d + 1, nodes.first(g + 1));
        for s in 1..nodes.nodes {
            let h = nodes.rail_back(d, s) / node;
            sems.wait_node(&mut b, d, compute, nodes, s);
            multiply(&mut b, nodes.first(h), nodes.first(h + 1));
        }
    }
    Ok(b.finish()?)
}

/// GEMM+RS (and GEMM+AR), hierarchical. Device (g, l) computes its partial a node's rows
/// at a time, the other nodes' first in the order it sends to them (node g + s at step s),
/// its own last. As each node h's rows are done it sends block (h, l') to GPU l' of its
/// node, and sums block (h, l) over its node once the node's GPUs have sent theirs; that
/// node sum goes over the NIC to (h, l). Its own block's node sum and the G − 1 that
/// arrive over its NIC are its block of C. A NIC carries G − 1 blocks each way where a
/// direct ReduceScatter sends it D − `node`. GEMM+AR then gathers the blocks of C as
/// AG+GEMM gathers its shards.
pub(super) fn gemm_reduce(p: &Problem, node: usize) -> Result<Plan, AlgorithmError> {
    let nodes = Nodes::new(p.devices, node)?;
    let (n, rows, mb) = (p.devices, p.row_split(), p.row_split().max());
    // L GPUs a node, G nodes.
    let (l_count, g_count) = (nodes.node, nodes.nodes);
    let (mut b, a, bm, c) = start_plan(p, Algorithm::Hierarchical { node });
    let partial = b.buffer("P", p.wire, p.m, p.n, BufferRole::Scratch);
    // Slot s·(L − 1) + t − 1 on device (g, l'): step s's block from GPU l' − t of node g.
    let inside_slots = b.buffer("inside", p.wire, (g_count * (l_count - 1)).max(1) * mb, p.n, BufferRole::Scratch);
    // Slot s: the node sum of block (g + s, l) (s = 0: the own block's).
    let node_sums = b.buffer("node_sum", p.wire, g_count * mb, p.n, BufferRole::Scratch);
    // Slot s − 1: the node sum that came over the NIC at step s.
    let remote = b.buffer("remote", p.wire, (g_count - 1).max(1) * mb, p.n, BufferRole::Scratch);
    let acc = (l_count.max(g_count) > REDUCE_FAN_IN).then(|| b.buffer("acc", DType::F32, mb, p.n, BufferRole::Scratch));
    let piece = b.semaphore("piece");
    let summed = b.semaphore("summed");
    let inside_steps: Vec<SemId> = (0..g_count).map(|s| b.semaphore(&format!("inside_step{s}"))).collect();
    let remote_steps: Vec<SemId> = (1..g_count).map(|s| b.semaphore(&format!("remote_step{s}"))).collect();
    let ag = (p.op == OpKind::GemmAr).then(|| (b.semaphore("reduced"), GatherSems::declare(&mut b, nodes, "ag_")));
    let compute = b.lane("compute");
    let inside = inside_lanes(&mut b, node);
    let (sum, nic) = (b.lane("sum"), b.lane("nic"));
    // The other nodes in the order they are sent to, then the own.
    let order: Vec<usize> = (1..g_count).chain([0]).collect();
    let block = |b: &PlanBuilder, e: usize| b.rows(partial, rows.start(e), rows.len(e));
    for d in 0..n {
        let b_whole = b.whole(bm);
        for &s in &order {
            let h = nodes.rail(d, s) / node;
            let (start, span) = rows.span(nodes.first(h), nodes.first(h + 1));
            let (a_rows, p_rows) = (b.rows(a, start, span), b.rows(partial, start, span));
            b.push(d, compute, Op::gemm(a_rows, b_whole, p_rows));
            b.push(d, compute, signal(d, piece));
        }
        for (i, &s) in order.iter().enumerate() {
            for &lane in &inside {
                b.push(d, lane, wait(piece, (i + 1) as u32));
            }
            for t in 1..l_count {
                let (to, lane) = (nodes.peer(d, t), inside_lane(&inside, nodes, t));
                let (src, dst) = (
                    block(&b, nodes.rail(to, s)),
                    b.rows(inside_slots, (s * (l_count - 1) + t - 1) * mb, rows.len(nodes.rail(to, s))),
                );
                b.push(d, lane, copy(src, to, dst));
                b.push(d, lane, signal(to, inside_steps[s]));
            }
        }
        // Step s's node sum: the own partial's block first, then the node's in turn.
        let out =
            if p.op == OpKind::GemmAr { b.rows(c, rows.start(d), rows.len(d)) } else { b.rows(c, 0, rows.len(d)) };
        let node_sum = |b: &PlanBuilder, s: usize| {
            let e = nodes.rail(d, s);
            if l_count == 1 {
                block(b, e)
            } else {
                b.rows(node_sums, s * mb, rows.len(e))
            }
        };
        let acc_rows = |b: &PlanBuilder, e: usize| acc.map(|acc| b.rows(acc, 0, rows.len(e)));
        for (i, &s) in order.iter().enumerate() {
            let e = nodes.rail(d, s);
            b.push(d, sum, wait(piece, (i + 1) as u32));
            if l_count > 1 {
                b.push(d, sum, wait(inside_steps[s], (l_count - 1) as u32));
                let mut terms = vec![block(&b, e)];
                terms.extend((1..l_count).map(|t| b.rows(inside_slots, (s * (l_count - 1) + t - 1) * mb, rows.len(e))));
                // One node: its sum is the block of C.
                let to = if g_count == 1 { out } else { node_sum(&b, s) };
                for op in chained_sum(&terms, acc_rows(&b, e), to) {
                    b.push(d, sum, op);
                }
                if s != 0 {
                    b.push(d, sum, signal(d, summed));
                }
            }
        }
        let ready = if l_count > 1 { summed } else { piece };
        for s in 1..g_count {
            let to = nodes.rail(d, s);
            b.push(d, nic, wait(ready, s as u32));
            let dst = b.rows(remote, (s - 1) * mb, rows.len(to));
            b.push(d, nic, copy(node_sum(&b, s), to, dst));
            b.push(d, nic, signal(to, remote_steps[s - 1]));
        }
        if g_count == 1 && l_count == 1 {
            // One device: its partial, converted into C.
            b.push(d, sum, Op::Reduce { inputs: vec![block(&b, d)], output: out });
        }
        if g_count > 1 {
            let mut terms = vec![node_sum(&b, 0)];
            for s in 1..g_count {
                b.push(d, sum, wait(remote_steps[s - 1], 1));
                terms.push(b.rows(remote, (s - 1) * mb, rows.len(d)));
            }
            for op in chained_sum(&terms, acc_rows(&b, d), out) {
                b.push(d, sum, op);
            }
        }
        if let Some((reduced, sems)) = &ag {
            let blocks: Vec<Region> = (0..n).map(|e| b.rows(c, rows.start(e), rows.len(e))).collect();
            b.push(d, sum, signal(d, *reduced));
            for &lane in std::iter::once(&nic).chain(&inside) {
                b.push(d, lane, wait(*reduced, 1));
            }
            gather(&mut b, d, nodes, (nic, &inside), sems, out, &blocks);
            for s in 0..g_count {
                sems.wait_node(&mut b, d, sum, nodes, s);
            }
        }
    }
    Ok(b.finish()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::plan::Op;
    use crate::problem::OpKind;

    fn problem(op: OpKind, devices: usize) -> Problem {
        let k = if op == OpKind::AgGemm { 8 } else { 8 * devices };
        Problem::new(op, devices, 8 * devices, 2 * devices, k, DType::F32, DType::F32).unwrap()
    }

    /// The plan of `op` over `devices` in nodes of `node`.
    fn plan(op: OpKind, devices: usize, node: usize) -> Result<Plan, AlgorithmError> {
        let p = problem(op, devices);
        if op == OpKind::AgGemm {
            ag_gemm(&p, node)
        } else {
            gemm_reduce(&p, node)
        }
    }

    /// The copies that leave device d's node, per device.
    fn crossings(plan: &Plan, node: usize) -> Vec<usize> {
        let mut sent = vec![0; plan.devices];
        for (site, op) in plan.ops() {
            if matches!(op, Op::Copy { dst_device, .. } if dst_device / node != site.device / node) {
                sent[site.device] += 1;
            }
        }
        sent
    }

    #[test]
    fn each_shard_or_node_sum_crosses_once_per_node_pair() {
        for (devices, node) in [(4, 2), (8, 2), (8, 4), (12, 4), (6, 3)] {
            let nodes = devices / node;
            // G − 1 crossings a device: its shard (or its node's sum of a block) to each
            // other node, once; GEMM+AR's gather as many again.
            for (op, collectives) in [(OpKind::AgGemm, 1), (OpKind::GemmRs, 1), (OpKind::GemmAr, 2)] {
                let plan = plan(op, devices, node).unwrap();
                assert_eq!(
                    crossings(&plan, node),
                    vec![collectives * (nodes - 1); devices],
                    "{op} D={devices} node={node}"
                );
            }
            // Every device still receives the D − 1 shards it does not hold.
            let plan = plan(OpKind::AgGemm, devices, node).unwrap();
            for d in 0..devices {
                let received =
                    plan.ops().filter(|(_, op)| matches!(op, Op::Copy { dst_device, .. } if *dst_device == d)).count();
                assert_eq!(received, devices - 1, "D={devices} node={node} device {d}");
            }
        }
    }

    #[test]
    fn the_plans_are_sound_and_match_the_oracle_with_uneven_shards() {
        use crate::generator::Family;
        use crate::testing::{assert_matches_oracle, assert_sound};
        // Nodes of up to 5 GPUs, and up to 5 nodes: sums of more than four terms chain.
        let shapes = [(1, 1), (2, 1), (2, 2), (4, 2), (6, 2), (6, 3), (8, 4), (8, 2), (10, 5), (5, 1)];
        for op in [OpKind::AgGemm, OpKind::GemmRs, OpKind::GemmAr] {
            for (devices, node) in shapes {
                for input in [DType::F32, DType::Bf16] {
                    // M not a multiple of D: the nodes' row spans differ.
                    let k = if op == OpKind::AgGemm { 24 } else { 8 * devices };
                    let p = Problem::new(op, devices, 4 * devices + 3, 2 * devices, k, input, DType::F32).unwrap();
                    let wires = if op == OpKind::AgGemm { vec![p] } else { vec![p, p.with_wire(input).unwrap()] };
                    for p in wires {
                        let plan =
                            if op == OpKind::AgGemm { ag_gemm(&p, node) } else { gemm_reduce(&p, node) }.unwrap();
                        assert_sound(&plan);
                        for family in [Family::Exact, Family::Realistic] {
                            assert_matches_oracle(&plan, &p, 7, family);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_node_size_that_does_not_cut_the_devices_is_refused() {
        for op in [OpKind::AgGemm, OpKind::GemmRs, OpKind::GemmAr] {
            for node in [0, 3, 5] {
                let e = plan(op, 8, node).unwrap_err();
                assert_eq!(e, AlgorithmError::NodeSize { devices: 8, node });
            }
        }
        // One node, and nodes of one GPU, are the two ends: a broadcast inside one node,
        // and a direct exchange with nothing to forward.
        assert_eq!(crossings(&plan(OpKind::AgGemm, 4, 4).unwrap(), 4), vec![0; 4]);
        assert_eq!(crossings(&plan(OpKind::AgGemm, 4, 1).unwrap(), 1), vec![3; 4]);
    }
}
