//! The deterministic scheduler shared by every step-by-step executor.
//!
//! Semaphores only change through `Signal` ops, so the whole execution order of a plan
//! can be decided on the host before any data moves: lanes are visited device by
//! device, lane by lane, and each runs until it finishes or reaches a `Wait` whose
//! value is not yet reached; the sweep repeats until every lane is done. When a sweep
//! makes no progress the plan is deadlocked, and the error names every blocked lane.

use std::fmt;

use thiserror::Error;

use crate::plan::{Op, OpSite, Plan};

/// One lane that cannot proceed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockedLane {
    /// Device.
    pub device: usize,
    /// Lane name.
    pub lane: String,
    /// Index of the blocking `Wait` in the lane.
    pub index: usize,
    /// Semaphore name.
    pub semaphore: String,
    /// The value the lane waits for.
    pub awaited: u32,
    /// The value the semaphore reached.
    pub reached: u32,
}

impl fmt::Display for BlockedLane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device {} lane {} op {}: waits for {} >= {}, reached {}",
            self.device, self.lane, self.index, self.semaphore, self.awaited, self.reached
        )
    }
}

/// A plan that cannot finish.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("plan `{plan}` deadlocks after {executed} ops; blocked: {}", .blocked.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct Deadlock {
    /// Plan name.
    pub plan: String,
    /// Ops executed before no lane could move.
    pub executed: usize,
    /// Every blocked lane.
    pub blocked: Vec<BlockedLane>,
}

/// The result of scheduling a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Every data op and sync op in execution order.
    pub order: Vec<OpSite>,
    /// Final value of every semaphore, `[device][semaphore]`.
    pub final_semaphores: Vec<Vec<u32>>,
}

/// Computes the deterministic execution order of a (validated) plan.
pub fn schedule(plan: &Plan) -> Result<Schedule, Deadlock> {
    let lanes = plan.lanes.len();
    let mut pc = vec![vec![0usize; lanes]; plan.devices];
    let mut sems = vec![vec![0u32; plan.semaphores.len()]; plan.devices];
    let mut order = Vec::with_capacity(plan.op_count());
    loop {
        let before = order.len();
        let mut unfinished = false;
        for device in 0..plan.devices {
            #[allow(clippy::needless_range_loop)] // `pc` and `sems` are indexed by other devices too
            for lane in 0..lanes {
                let ops = &plan.programs[device].lanes[lane];
                while let Some(op) = ops.get(pc[device][lane]) {
                    if let Op::Wait { sem, value } = op {
                        if sems[device][sem.0] < *value {
                            break;
                        }
                    }
                    if let Op::Signal {
                        device: target,
                        sem,
                        add,
                    } = op
                    {
                        let s = &mut sems[*target][sem.0];
                        *s = s.saturating_add(*add);
                    }
                    order.push(OpSite {
                        device,
                        lane,
                        index: pc[device][lane],
                    });
                    pc[device][lane] += 1;
                }
                unfinished |= pc[device][lane] < ops.len();
            }
        }
        if !unfinished {
            return Ok(Schedule {
                order,
                final_semaphores: sems,
            });
        }
        if order.len() == before {
            let mut blocked = Vec::new();
            for (device, lane_pcs) in pc.iter().enumerate() {
                for (lane, &index) in lane_pcs.iter().enumerate() {
                    if let Some(Op::Wait { sem, value }) = plan.programs[device].lanes[lane].get(index) {
                        blocked.push(BlockedLane {
                            device,
                            lane: plan.lanes[lane].clone(),
                            index,
                            semaphore: plan.semaphores[sem.0].clone(),
                            awaited: *value,
                            reached: sems[device][sem.0],
                        });
                    }
                }
            }
            return Err(Deadlock {
                plan: plan.name.clone(),
                executed: order.len(),
                blocked,
            });
        }
    }
}
