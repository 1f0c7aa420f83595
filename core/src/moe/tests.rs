//! Every MoE plan on the CPU twin against the oracle, through the verifier and the
//! hardware-queue check; malformed routing refused with typed errors.

use super::*;
use crate::algorithms::Algorithm;
use crate::cpu::{self, CpuError};
use crate::generator::Family;
use crate::plan::{BufferRole, Op};
use crate::testing::{assert_matches_oracle, assert_sound};

#[allow(clippy::too_many_arguments)]
fn problem(op: MoeOp, d: usize, t: usize, h: usize, f: usize, e: usize, k: usize, r: Routing, dt: DType) -> MoeProblem {
    MoeProblem::new(op, d, t, h, f, e, k, r, dt, dt).unwrap()
}

fn problems() -> Vec<MoeProblem> {
    let mut v = Vec::new();
    for op in [MoeOp::AgMoe, MoeOp::MoeRs] {
        for (d, routing) in [(1, Routing::Uniform), (2, Routing::Drop), (3, Routing::Skewed), (4, Routing::Empty)] {
            v.push(problem(op, d, 6 * d, 5, 3 * d, 5, 2, routing, DType::F32));
        }
        v.push(problem(op, 2, 8, 4, 4, 4, 1, Routing::Single, DType::Bf16));
        v.push(problem(op, 4, 16, 3, 8, 8, 4, Routing::Uniform, DType::F16));
        // Uneven token shards (tensor_split's order), and chunks that do not divide them.
        for (d, routing) in [(2, Routing::Skewed), (3, Routing::Drop), (4, Routing::Uniform)] {
            v.push(problem(op, d, 6 * d + d - 1, 5, 3 * d, 5, 2, routing, DType::F32));
        }
        v.push(problem(op, 4, 13, 4, 8, 6, 3, Routing::Empty, DType::Bf16));
    }
    v
}

fn algorithms() -> [Algorithm; 3] {
    [Algorithm::Baseline, Algorithm::Ring, Algorithm::RingChunked { chunks: 2 }]
}

#[test]
fn every_plan_matches_the_oracle_and_passes_the_verifier_and_the_queue_check() {
    for p in problems() {
        for alg in algorithms() {
            let plan = match build_moe_plan(&p, alg) {
                Ok(plan) => plan,
                Err(MoeError::Chunks { .. }) => continue,
                Err(e) => panic!("{} {alg}: {e}", p.describe()),
            };
            let chunks = match alg {
                crate::Algorithm::RingChunked { chunks } => chunks,
                _ => 1,
            };
            let bound = super::plans::min_ops(&p, chunks);
            assert!(bound <= plan.op_count() as u128, "{}: {bound} ops at least?", plan.name);
            assert_sound(&plan);
            assert_matches_oracle(&plan, &p, 7, Family::Exact);
            assert_matches_oracle(&plan, &p, 7, Family::Realistic);
        }
    }
}

#[test]
fn algorithms_agree_on_every_row_and_the_permutation() {
    // The row order is the contract's, not the algorithm's: Y and perm are the same bits.
    let p = problem(MoeOp::AgMoe, 4, 16, 6, 8, 6, 3, Routing::Drop, DType::F32);
    let outputs = |alg| {
        let plan = build_moe_plan(&p, alg).unwrap();
        let mem = cpu::run(&plan, 3, Family::Realistic).unwrap();
        let (y, perm) = (plan.buffer_id("Y").unwrap().0, plan.buffer_id("perm").unwrap().0);
        mem.iter().map(|m| (m[y].clone(), m[perm].clone())).collect::<Vec<_>>()
    };
    let base = outputs(Algorithm::Baseline);
    assert_eq!(outputs(Algorithm::Ring), base);
    assert_eq!(outputs(Algorithm::RingChunked { chunks: 2 }), base);
    // Dropped slots leave rows unrouted: they are zero, and perm says none.
    let routed = p.tables(3, 1).routed();
    assert!(routed < p.capacity());
    assert!(base[0].1[routed..].iter().all(|&w| w == ROUTE_NONE));
    assert!(base[0].0[routed * 2..].iter().all(|&w| w == 0));
}

#[test]
fn problems_and_algorithms_refuse_what_they_cannot_do() {
    let e = MoeProblem::new(MoeOp::AgMoe, 3, 8, 4, 7, 4, 2, Routing::Uniform, DType::F32, DType::F32);
    assert_eq!(e, Err(MoeError::Indivisible { op: MoeOp::AgMoe, dim: "F", size: 7, devices: 3 }));
    let e = MoeProblem::new(MoeOp::AgMoe, 3, 2, 4, 6, 4, 2, Routing::Uniform, DType::F32, DType::F32);
    assert_eq!(e, Err(MoeError::TooFewTokens { op: MoeOp::AgMoe, tokens: 2, devices: 3 }));
    // T = 8 on 3 devices splits 3, 3, 2.
    let uneven = problem(MoeOp::AgMoe, 3, 8, 4, 6, 4, 2, Routing::Uniform, DType::F32);
    assert_eq!(uneven.token_split().lens(), vec![3, 3, 2]);
    let e = MoeProblem::new(MoeOp::MoeRs, 2, 8, 4, 6, 4, 3, Routing::Empty, DType::F32, DType::F32);
    assert!(matches!(e, Err(MoeError::Slots { available: 2, .. })), "{e:?}");
    let e = MoeProblem::new(MoeOp::MoeRs, 2, 8, 4, 6, 4, 2, Routing::Uniform, DType::U32, DType::F32);
    assert!(matches!(e, Err(MoeError::DType { .. })), "{e:?}");
    let p = problem(MoeOp::MoeRs, 2, 8, 4, 4, 4, 2, Routing::Uniform, DType::F32);
    assert!(matches!(build_moe_plan(&p, Algorithm::RingChunked { chunks: 5 }), Err(MoeError::Chunks { .. })));
    assert!(build_moe_plan(&p, Algorithm::RingChunked { chunks: 3 }).is_ok(), "chunks need not divide the tokens");
    assert!(matches!(build_moe_plan(&p, Algorithm::RingBidir), Err(MoeError::Algorithm { .. })));
}

#[test]
fn a_malformed_routing_table_is_a_typed_error_before_anything_runs() {
    let p = problem(MoeOp::AgMoe, 2, 8, 4, 4, 4, 2, Routing::Uniform, DType::F32);
    let mut plan = build_moe_plan(&p, Algorithm::Ring).unwrap();
    // A router that names more experts than the plan's route op knows: ids out of range.
    let ids = plan.buffer_id("ids").unwrap().0;
    if let BufferRole::Router { router, .. } = &mut plan.buffers[ids].role {
        router.experts = 64;
    }
    match cpu::run(&plan, 1, Family::Exact) {
        Err(CpuError::Routing(RoutingError::ExpertOutOfRange { experts: 4, id, .. })) => assert!(id >= 4),
        other => panic!("{other:?}"),
    }
    // A row table too small for the rows routed: an overflow, named with the sizes.
    let mut plan = build_moe_plan(&p, Algorithm::Baseline).unwrap();
    for (_, op) in plan.programs.iter_mut().flat_map(|pr| pr.lanes.iter_mut().flatten().map(|op| ((), op))) {
        if let Op::Route { tables, .. } = op {
            tables.perm.rows = 5;
        }
    }
    let perm = plan.buffer_id("perm").unwrap().0;
    plan.buffers[perm].rows = 5;
    match crate::moe::check_routing(&plan, 1) {
        Err(RoutingError::Overflow { needed: 16, capacity: 5, .. }) => {}
        other => panic!("{other:?}"),
    }
    // A router of no experts, or of more than a u32 id counts (a plan file can say so; the
    // fuzzer found the first dividing by zero): refused by validation, before any id.
    for experts in [0, 1 << 32] {
        let mut plan = build_moe_plan(&p, Algorithm::Ring).unwrap();
        if let BufferRole::Router { router, .. } = &mut plan.buffers[ids].role {
            router.experts = experts;
        }
        let e = plan.validate().unwrap_err().to_string();
        assert!(e.contains(&format!("routes among {experts} experts")), "{e}");
        assert!(matches!(cpu::run(&plan, 1, Family::Exact), Err(CpuError::Plan(_))), "{experts}");
    }
}

/// The routed row layout, pinned in numbers: the oracle states it on its own, and the
/// routing the plans run must agree with it.
#[test]
fn the_routed_rows_are_in_expert_token_slot_order() {
    // Three tokens of two slots over two experts; id 2 routes nowhere.
    let ids = [1, 0, 0, 2, 1, 1];
    let (perm, inv) = super::oracle::contract_rows(&ids, 2);
    assert_eq!(perm, [1, 2, 0, 4, 5]);
    assert_eq!(inv, [Some(2), Some(0), Some(1), None, Some(3), Some(4)]);
    let tables = super::route(&ids, 2, 2, 1, 1, 6);
    assert_eq!(&tables.perm[..5], &perm[..]);
    assert_eq!(tables.perm[5], super::ROUTE_NONE);
    for p in problems() {
        let ids = p.router().ids(7);
        let (perm, inv) = super::oracle::contract_rows(&ids, p.experts);
        let tables = p.tables(7, 1);
        assert_eq!(&tables.perm[..perm.len()], &perm[..], "{}", p.describe());
        let table_inv: Vec<Option<usize>> =
            tables.inv.iter().map(|&r| (r != super::ROUTE_NONE).then_some(r as usize)).collect();
        assert_eq!(table_inv, inv, "{}", p.describe());
    }
}

/// The moe_rs baseline's ReduceScatter adds up beside its copies from
/// [`crate::algorithms::SUMS_BESIDE_FROM_BYTES`] blocks up (512 tokens of 1024 f32
/// columns here), and on its one lane below it (every problem of [`problems`]).
#[test]
fn the_moe_rs_baseline_sums_beside_its_copies_on_large_blocks() {
    for p in problems().iter().filter(|p| p.op == MoeOp::MoeRs) {
        let plan = build_moe_plan(p, Algorithm::Baseline).unwrap();
        assert!(!plan.lanes.iter().any(|l| l == "sum"), "{}", plan.name);
    }
    let p = problem(MoeOp::MoeRs, 2, 1024, 1024, 4, 4, 2, Routing::Uniform, DType::F32);
    let plan = build_moe_plan(&p, Algorithm::Baseline).unwrap();
    let sum = plan.lanes.iter().position(|l| l == "sum").expect("a sum lane");
    for program in &plan.programs {
        assert!(program.lanes[sum].iter().any(|op| matches!(op, Op::Reduce { .. })), "{}", plan.name);
        assert!(!program.lanes[0].iter().any(|op| matches!(op, Op::Reduce { .. })), "{}", plan.name);
    }
    assert_sound(&plan);
    assert_matches_oracle(&plan, &p, 3, Family::Realistic);
}
