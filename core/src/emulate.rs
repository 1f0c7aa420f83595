//! Running D devices on one GPU: a plan changed only in when work may start, and the
//! priorities that serve the devices in order.
//!
//! An executor that puts D virtual devices on one GPU (the CUDA bench, the one-GPU
//! simulator profile) runs every device's GEMMs on the same SMs. Started together, the
//! devices of a ring run in lockstep: each step's GEMMs share the GPU and end together,
//! and every device then copies at once with nothing left to hide the copies under.
//! Two ways out of it:
//! - [`staggered_priorities`]: each device's compute at its own priority, in device order
//!   (the CUDA executor's `stagger`, the simulator's `compute_priority`);
//! - [`offset_starts`]: the devices start one after another, and the plan's own
//!   dependencies then keep them apart. It adds waits only, so it cannot change a result
//!   or add a race; it is refused where it would deadlock.

use thiserror::Error;

use crate::plan::{Engine, Op, Plan, SemId};
use crate::schedule::{schedule, Deadlock};

/// The staggered compute priorities of `devices` virtual devices on one GPU with `levels`
/// priorities to spare: device d at ⌊d·levels / devices⌋ (0 the greatest), so that when
/// every device has a GEMM ready the GPU serves them in device order rather than all at
/// once, and one device's copy runs under the next devices' GEMMs. The CUDA executor
/// offsets these by its greatest free priority; the simulator takes them as they are.
/// Levels past `devices` order the devices no differently (each has its own level either
/// way), so they count as `devices`: a `--stagger` of 10^18 neither overflows nor
/// reorders them.
pub fn staggered_priorities(devices: usize, levels: usize) -> Vec<i32> {
    let levels = levels.clamp(1, devices.max(1));
    (0..devices).map(|d| i32::try_from(d * levels / devices).unwrap_or(i32::MAX)).collect()
}

/// The semaphore [`offset_starts`] adds.
pub const OFFSET_SEMAPHORE: &str = "offset start";

/// Why a plan's starts cannot be offset.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum OffsetError {
    /// A device's first GEMM is a block of a tile-granular GEMM, whose kernel a wait
    /// between its blocks would split.
    #[error(
        "plan `{plan}`: device {device}'s first GEMM is a block of a tile-granular GEMM; its start cannot be offset"
    )]
    Fused {
        /// Plan name.
        plan: String,
        /// The device.
        device: usize,
    },
    /// The plan already has a semaphore of that name.
    #[error("plan `{plan}` already has a semaphore `{OFFSET_SEMAPHORE}`")]
    Taken {
        /// Plan name.
        plan: String,
    },
    /// With its starts offset, the plan would deadlock.
    #[error("offsetting the starts would deadlock: {0}")]
    Deadlock(Deadlock),
}

/// `plan` with device d's first GEMM waiting for device d − 1's first GEMM to end, over
/// the devices that run a GEMM, in device order (each device's first GEMM is the first
/// GEMM, grouped GEMM or attention block of its lowest lane that has one). A plan with
/// fewer than two such devices comes back unchanged. The result is proven free of
/// deadlock; it has one semaphore more, [`OFFSET_SEMAPHORE`].
pub fn offset_starts(plan: &Plan) -> Result<Plan, OffsetError> {
    let first_gemm = |ops: &[Op]| {
        ops.iter().position(|op| matches!(op, Op::Gemm { .. } | Op::GroupedGemm { .. } | Op::Attend { .. }))
    };
    // (device, lane, index) of each device's first GEMM.
    let mut firsts = Vec::new();
    for (device, program) in plan.programs.iter().enumerate() {
        let found = program.lanes.iter().enumerate().find_map(|(lane, ops)| first_gemm(ops).map(|i| (lane, i)));
        if let Some((lane, index)) = found {
            if matches!(program.lanes[lane][index], Op::Gemm { fused: Some(_), .. }) {
                return Err(OffsetError::Fused { plan: plan.name.clone(), device });
            }
            firsts.push((device, lane, index));
        }
    }
    if firsts.len() < 2 {
        return Ok(plan.clone());
    }
    if plan.semaphores.iter().any(|s| s == OFFSET_SEMAPHORE) {
        return Err(OffsetError::Taken { plan: plan.name.clone() });
    }
    let mut out = plan.clone();
    out.semaphores.push(OFFSET_SEMAPHORE.into());
    let sem = SemId(out.semaphores.len() - 1);
    // Every signal first, right after its device's first GEMM; then every wait, right
    // before it (which moves the GEMM and its signal down together).
    for pair in firsts.windows(2) {
        let ((from, lane, index), (to, _, _)) = (pair[0], pair[1]);
        out.programs[from].lanes[lane].insert(index + 1, Op::Signal { device: to, sem, add: 1 });
    }
    for &(to, lane, index) in &firsts[1..] {
        out.programs[to].lanes[lane].insert(index, Op::Wait { sem, value: 1 });
    }
    schedule(&out).map_err(OffsetError::Deadlock)?;
    Ok(out)
}

/// `plan` without its communication: every copy, wait and signal left out, every other
/// op (GEMMs, tile-granular ones included, reductions, pointwise ops) kept in its lane's
/// order. What it computes is not the plan's result (data it would have received is
/// never sent), but it does the plan's arithmetic on the same engines: the floor an
/// overlapped plan is measured against on one GPU (the bench's compute-only twin).
pub fn compute_only(plan: &Plan) -> Plan {
    let mut out = plan.clone();
    out.name = format!("{} (compute only)", plan.name);
    for program in &mut out.programs {
        for lane in &mut program.lanes {
            lane.retain(|op| !matches!(op, Op::Copy { .. } | Op::Wait { .. } | Op::Signal { .. }));
        }
    }
    out
}

/// `plan` with every copy made by a kernel on the SMs ([`Engine::Sm`]) rather than a
/// copy engine: the same bytes to the same places in the same order, so the same result.
/// The bench times the fused plans so too, which says whether their copies are starved
/// because the copy engines cannot get at memory beside the persistent kernels, or for
/// a reason an SM copy shares.
pub fn sm_copies(plan: &Plan) -> Plan {
    let mut out = plan.clone();
    out.name = format!("{} (SM copies)", plan.name);
    for op in out.programs.iter_mut().flat_map(|p| p.lanes.iter_mut()).flatten() {
        if let Op::Copy { engine, .. } = op {
            *engine = Engine::Sm;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{algorithms_for, build_plan, Algorithm};
    use crate::dtype::DType;
    use crate::problem::{OpKind, Problem};

    #[test]
    fn the_compute_only_twin_keeps_every_gemm_and_no_communication() {
        let p = Problem::new(OpKind::AgGemm, 4, 64, 32, 48, DType::F16, DType::F16).unwrap();
        for algorithm in [Algorithm::Ring, Algorithm::Fused { chunks: 1 }] {
            let plan = build_plan(&p, algorithm).unwrap();
            let twin = compute_only(&plan);
            twin.validate().unwrap();
            let count = |plan: &Plan, f: fn(&Op) -> bool| plan.ops().filter(|(_, op)| f(op)).count();
            let gemm: fn(&Op) -> bool = |op| matches!(op, Op::Gemm { .. });
            let talk: fn(&Op) -> bool = |op| matches!(op, Op::Copy { .. } | Op::Wait { .. } | Op::Signal { .. });
            assert_eq!(count(&twin, gemm), count(&plan, gemm));
            assert!(count(&plan, talk) > 0 && count(&twin, talk) == 0, "{algorithm}");
            assert_eq!(twin.fused_runs().unwrap().len(), plan.fused_runs().unwrap().len());
        }
    }

    #[test]
    fn sm_copies_change_each_copy_engine_and_nothing_else() {
        let p = Problem::new(OpKind::AgGemm, 4, 64, 32, 48, DType::F16, DType::F16).unwrap();
        let plan = build_plan(&p, Algorithm::Fused { chunks: 1 }).unwrap();
        let sm = sm_copies(&plan);
        sm.validate().unwrap();
        assert_eq!(crate::verify::verify(&sm, &schedule(&sm).unwrap()).unwrap(), Vec::new(), "no race, no finding");
        let copies = |plan: &Plan, engine: Engine| {
            plan.ops().filter(|(_, op)| matches!(op, Op::Copy { engine: e, .. } if *e == engine)).count()
        };
        assert!(copies(&plan, Engine::CopyEngine) > 0 && copies(&plan, Engine::Sm) == 0);
        assert_eq!((copies(&sm, Engine::Sm), copies(&sm, Engine::CopyEngine)), (copies(&plan, Engine::CopyEngine), 0));
        // Every op but the copies' engine is the plan's, in the same place.
        let strip = |op: &Op| match op {
            Op::Copy { src, dst_device, dst, .. } => {
                Op::Copy { src: *src, dst_device: *dst_device, dst: *dst, engine: Engine::Sm }
            }
            other => other.clone(),
        };
        let ops = |plan: &Plan| plan.ops().map(|(site, op)| (site, strip(op))).collect::<Vec<_>>();
        assert_eq!(ops(&sm), ops(&plan));
        let family = crate::generator::Family::Exact;
        assert_eq!(crate::cpu::run(&sm, 3, family).unwrap(), crate::cpu::run(&plan, 3, family).unwrap());
    }

    #[test]
    fn staggered_priorities_follow_device_order_over_the_levels() {
        assert_eq!(staggered_priorities(4, 5), vec![0, 1, 2, 3]);
        assert_eq!(staggered_priorities(8, 5), vec![0, 0, 1, 1, 2, 3, 3, 4]);
        assert_eq!(staggered_priorities(3, 1), vec![0, 0, 0]);
        // More levels than devices: each device its own, in order, however many.
        assert_eq!(staggered_priorities(3, usize::MAX), vec![0, 1, 2]);
    }

    #[test]
    fn each_device_starts_after_the_previous_ones_first_gemm_and_results_do_not_change() {
        let p = Problem::new(OpKind::GemmRs, 4, 32, 40, 64, DType::F16, DType::F32).unwrap();
        let plan = build_plan(&p, Algorithm::RingAccumulate { chunks: 1 }).unwrap();
        let offset = offset_starts(&plan).unwrap();
        offset.validate().unwrap();
        assert_eq!(offset.op_count(), plan.op_count() + 6, "three signals and three waits");
        let scheduled = schedule(&offset).unwrap();
        assert_eq!(crate::verify::verify(&offset, &scheduled).unwrap(), Vec::new(), "no race, no finding");
        let order = scheduled.order;
        let first = |d: usize| {
            order
                .iter()
                .position(|s| {
                    matches!(offset.programs[s.device].lanes[s.lane][s.index], Op::Gemm { .. }) && s.device == d
                })
                .unwrap()
        };
        assert!((1..4).all(|d| first(d - 1) < first(d)), "first GEMMs in device order");
        let family = crate::generator::Family::Exact;
        assert_eq!(crate::cpu::run(&offset, 3, family).unwrap(), crate::cpu::run(&plan, 3, family).unwrap());
    }

    #[test]
    fn a_plan_whose_device_order_runs_backwards_is_refused_as_a_deadlock() {
        use crate::plan::{BufferRole, PlanBuilder};
        // Device 0's GEMM waits for device 1's: device 1 cannot also wait for device 0.
        let mut b = PlanBuilder::new("backwards", 2);
        let x = b.buffer("X", DType::F32, 8, 8, BufferRole::Scratch);
        let done = b.semaphore("done");
        let lane = b.lane("compute");
        let gemm = |b: &PlanBuilder| Op::gemm(b.whole(x), b.whole(x), b.whole(x));
        b.push(0, lane, Op::Wait { sem: done, value: 1 });
        b.push(0, lane, gemm(&b));
        b.push(1, lane, gemm(&b));
        b.push(1, lane, Op::Signal { device: 0, sem: done, add: 1 });
        let plan = b.finish().unwrap();
        schedule(&plan).unwrap();
        match offset_starts(&plan) {
            Err(e @ OffsetError::Deadlock(_)) => assert!(e.to_string().contains("would deadlock"), "{e}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_unfused_ring_plan_takes_offset_starts_and_fused_ones_are_refused() {
        for op in OpKind::ALL {
            let p = Problem::new(op, 4, 64, 64, 64, DType::Bf16, DType::F32).unwrap();
            for algorithm in algorithms_for(op) {
                let plan = build_plan(&p, algorithm).unwrap();
                match (offset_starts(&plan), algorithm) {
                    (Err(OffsetError::Fused { device: 0, .. }), Algorithm::Fused { .. }) => {}
                    (Ok(offset), _) => assert!(offset.semaphores.len() == plan.semaphores.len() + 1, "{}", plan.name),
                    (other, _) => panic!("{}: {other:?}", plan.name),
                }
            }
        }
        let one =
            build_plan(&Problem::new(OpKind::AgGemm, 1, 8, 8, 8, DType::F32, DType::F32).unwrap(), Algorithm::Ring)
                .unwrap();
        assert_eq!(offset_starts(&one).unwrap(), one, "one device: nothing to offset");
    }
}
