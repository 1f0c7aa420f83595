//! The hierarchical (node-aware) AG+GEMM: for D devices in nodes of `node` GPUs, every
//! shard crosses between two nodes once, not once for each GPU of the receiving node.
//!
//! Device d is GPU l = d mod `node` of node g = d / `node`; the G = D / `node` nodes' GPUs
//! of one local index l share a network rail (each GPU its own NIC). Device (g, l):
//! - sends its shard to every other GPU of its node (the fast links inside a node);
//! - sends its shard over its NIC to GPU l of every other node, at step s to node g + s
//!   (mod G), so that at every step each NIC sends one shard and receives one;
//! - forwards each shard that arrives over its NIC to the other GPUs of its node.
//!
//! A NIC then carries G − 1 shards each way, where a direct AllGather sends it the
//! D − `node` shards of all the other nodes' GPUs: `node` times fewer bytes over the
//! network, for `node` − 1 extra copies inside the node per remote shard. The GEMMs
//! overlap the collective: the own shard's first, the node's other shards' once they are
//! in, then each remote node's rows (one GEMM) once all of its shards are in.

use super::ring::{copy, signal, wait};
use super::{start_plan, Algorithm, AlgorithmError};
use crate::plan::{BufferRole, Op, Plan, Region};
use crate::problem::Problem;

/// Refuses a node size that does not cut the devices into whole nodes.
pub(super) fn check_node(devices: usize, node: usize) -> Result<(), AlgorithmError> {
    if node == 0 || devices % node != 0 {
        return Err(AlgorithmError::NodeSize { devices, node });
    }
    Ok(())
}

/// AG+GEMM, hierarchical: see the module's description.
pub(super) fn ag_gemm(p: &Problem, node: usize) -> Result<Plan, AlgorithmError> {
    check_node(p.devices, node)?;
    let (n, shards) = (p.devices, p.row_split());
    let nodes = n / node;
    let (mut b, a, bm, c) = start_plan(p, Algorithm::Hierarchical { node });
    let gathered = b.buffer("G", p.input, p.m, p.k, BufferRole::Scratch);
    // The node's other shards; at step s the shard from GPU l of node g − s (over the
    // NIC), and the same node's other shards (forwarded inside this node).
    let local = b.semaphore("local");
    let over_nic: Vec<_> = (1..nodes).map(|s| b.semaphore(&format!("nic_step{s}"))).collect();
    let forwarded: Vec<_> = (1..nodes).map(|s| b.semaphore(&format!("forwarded_step{s}"))).collect();
    let (compute, nic, inside) = (b.lane("compute"), b.lane("nic"), b.lane("inside"));
    let blocks: Vec<Region> = (0..n).map(|r| b.rows(gathered, shards.start(r), shards.len(r))).collect();
    // The rows of devices `first..end` (contiguous in the gathered buffer and in C).
    let span = |first: usize, end: usize| {
        (shards.start(first), shards.start(end - 1) + shards.len(end - 1) - shards.start(first))
    };
    for d in 0..n {
        let (g, l) = (d / node, d % node);
        let peers = |step: usize| g * node + (l + step) % node;
        let own = b.rows(a, 0, shards.len(d));
        for s in 1..nodes {
            let to = (g + s) % nodes * node + l;
            b.push(d, nic, copy(own, to, blocks[d]));
            b.push(d, nic, signal(to, over_nic[s - 1]));
        }
        for t in 1..node {
            b.push(d, inside, copy(own, peers(t), blocks[d]));
            b.push(d, inside, signal(peers(t), local));
        }
        for s in 1..nodes {
            let from = (g + nodes - s) % nodes * node + l;
            b.push(d, inside, wait(over_nic[s - 1], 1));
            for t in 1..node {
                b.push(d, inside, copy(blocks[from], peers(t), blocks[from]));
                b.push(d, inside, signal(peers(t), forwarded[s - 1]));
            }
        }

        let whole_b = b.whole(bm);
        let own_c = b.rows(c, shards.start(d), shards.len(d));
        b.push(d, compute, Op::gemm(own, whole_b, own_c));
        if node > 1 {
            b.push(d, compute, wait(local, (node - 1) as u32));
        }
        // The node's rows before and after the own shard's.
        for (first, end) in [(g * node, d), (d + 1, (g + 1) * node)] {
            if first < end {
                let (start, rows) = span(first, end);
                let (a_rows, c_rows) = (b.rows(gathered, start, rows), b.rows(c, start, rows));
                b.push(d, compute, Op::gemm(a_rows, whole_b, c_rows));
            }
        }
        for s in 1..nodes {
            let h = (g + nodes - s) % nodes;
            b.push(d, compute, wait(over_nic[s - 1], 1));
            if node > 1 {
                b.push(d, compute, wait(forwarded[s - 1], (node - 1) as u32));
            }
            let (start, rows) = span(h * node, (h + 1) * node);
            let (a_rows, c_rows) = (b.rows(gathered, start, rows), b.rows(c, start, rows));
            b.push(d, compute, Op::gemm(a_rows, whole_b, c_rows));
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

    fn problem(devices: usize) -> Problem {
        Problem::new(OpKind::AgGemm, devices, 8 * devices, 2 * devices, 8, DType::F32, DType::F32).unwrap()
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
    fn each_shard_crosses_once_per_node_pair() {
        for (devices, node) in [(4, 2), (8, 2), (8, 4), (12, 4), (6, 3)] {
            let plan = ag_gemm(&problem(devices), node).unwrap();
            // G − 1 crossings a device: its shard to each other node, once.
            assert_eq!(crossings(&plan, node), vec![devices / node - 1; devices], "D={devices} node={node}");
            // Every device still receives the D − 1 shards it does not hold.
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
        for (devices, node) in [(1, 1), (2, 1), (2, 2), (4, 2), (6, 2), (6, 3), (8, 4), (8, 2)] {
            for input in [DType::F32, DType::Bf16] {
                // M not a multiple of D: the nodes' row spans differ.
                let p =
                    Problem::new(OpKind::AgGemm, devices, 4 * devices + 3, 2 * devices, 24, input, DType::F32).unwrap();
                let plan = ag_gemm(&p, node).unwrap();
                assert_sound(&plan);
                for family in [Family::Exact, Family::Realistic] {
                    assert_matches_oracle(&plan, &p, 7, family);
                }
            }
        }
    }

    #[test]
    fn a_node_size_that_does_not_cut_the_devices_is_refused() {
        for node in [0, 3, 5] {
            let e = ag_gemm(&problem(8), node).unwrap_err();
            assert_eq!(e, AlgorithmError::NodeSize { devices: 8, node });
        }
        // One node, and nodes of one GPU, are the two ends: a broadcast inside one node,
        // and a direct exchange with nothing to forward.
        assert_eq!(crossings(&ag_gemm(&problem(4), 4).unwrap(), 4), vec![0; 4]);
        assert_eq!(crossings(&ag_gemm(&problem(4), 1).unwrap(), 1), vec![3; 4]);
    }
}
