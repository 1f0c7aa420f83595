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
    /// The interleaving that produced it.
    pub order_kind: Order,
    /// Every data op and sync op in execution order.
    pub order: Vec<OpSite>,
    /// Final value of every semaphore, `[device][semaphore]`.
    pub final_semaphores: Vec<Vec<u32>>,
}

/// How the scheduler picks the next lane among those that can move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Order {
    /// Device by device, lane by lane, each lane until it blocks; repeat.
    Default,
    /// A seeded random runnable lane moves one op at a time.
    Random {
        /// Seed of the choice sequence.
        seed: u64,
    },
    /// The lanes of `device` run as far as they can before any other lane moves; the
    /// others move one op at a time only while it is blocked.
    RunAhead {
        /// The favoured device.
        device: usize,
    },
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Order::Default => f.write_str("default"),
            Order::Random { seed } => write!(f, "random(seed={seed})"),
            Order::RunAhead { device } => write!(f, "run-ahead(device {device})"),
        }
    }
}

/// The first `n` interleavings used by `--schedules n`: the default order first, then
/// run-ahead orders (rotating the favoured device) alternating with seeded random ones.
pub fn orders(n: usize, devices: usize) -> Vec<Order> {
    (0..n)
        .map(|i| match i {
            0 => Order::Default,
            i if i % 2 == 1 => Order::RunAhead { device: (i / 2) % devices.max(1) },
            i => Order::Random { seed: i as u64 },
        })
        .collect()
}

/// Computes the deterministic default execution order of a (validated) plan.
pub fn schedule(plan: &Plan) -> Result<Schedule, Deadlock> {
    schedule_with(plan, Order::Default)
}

struct State<'p> {
    plan: &'p Plan,
    pc: Vec<Vec<usize>>,
    sems: Vec<Vec<u32>>,
    order: Vec<OpSite>,
}

impl State<'_> {
    fn runnable(&self, device: usize, lane: usize) -> bool {
        match self.plan.programs[device].lanes[lane].get(self.pc[device][lane]) {
            None => false,
            Some(Op::Wait { sem, value }) => self.sems[device][sem.0] >= *value,
            Some(_) => true,
        }
    }

    fn step(&mut self, device: usize, lane: usize) {
        let index = self.pc[device][lane];
        if let Op::Signal { device: target, sem, add } = &self.plan.programs[device].lanes[lane][index] {
            let s = &mut self.sems[*target][sem.0];
            *s = s.saturating_add(*add);
        }
        self.order.push(OpSite { device, lane, index });
        self.pc[device][lane] += 1;
    }

    fn finished(&self) -> bool {
        self.pc
            .iter()
            .zip(&self.plan.programs)
            .all(|(pcs, p)| pcs.iter().zip(&p.lanes).all(|(&pc, ops)| pc >= ops.len()))
    }

    fn deadlock(&self) -> Deadlock {
        let mut blocked = Vec::new();
        for (device, lane_pcs) in self.pc.iter().enumerate() {
            for (lane, &index) in lane_pcs.iter().enumerate() {
                if let Some(Op::Wait { sem, value }) = self.plan.programs[device].lanes[lane].get(index) {
                    blocked.push(BlockedLane {
                        device,
                        lane: self.plan.lanes[lane].clone(),
                        index,
                        semaphore: self.plan.semaphores[sem.0].clone(),
                        awaited: *value,
                        reached: self.sems[device][sem.0],
                    });
                }
            }
        }
        Deadlock { plan: self.plan.name.clone(), executed: self.order.len(), blocked }
    }
}

/// A small deterministic generator (splitmix64) for random interleavings.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Computes the execution order of a (validated) plan under an interleaving policy.
pub fn schedule_with(plan: &Plan, order_kind: Order) -> Result<Schedule, Deadlock> {
    let lanes = plan.lanes.len();
    let mut st = State {
        plan,
        pc: vec![vec![0usize; lanes]; plan.devices],
        sems: vec![vec![0u32; plan.semaphores.len()]; plan.devices],
        order: Vec::with_capacity(plan.op_count()),
    };
    let all: Vec<(usize, usize)> = (0..plan.devices).flat_map(|d| (0..lanes).map(move |l| (d, l))).collect();
    let mut rng = match order_kind {
        Order::Random { seed } => seed,
        _ => 0,
    };
    loop {
        let before = st.order.len();
        match order_kind {
            Order::Default => {
                for &(d, l) in &all {
                    while st.runnable(d, l) {
                        st.step(d, l);
                    }
                }
            }
            Order::Random { .. } => {
                let ready: Vec<_> = all.iter().copied().filter(|&(d, l)| st.runnable(d, l)).collect();
                if !ready.is_empty() {
                    let (d, l) = ready[(splitmix(&mut rng) % ready.len() as u64) as usize];
                    st.step(d, l);
                }
            }
            Order::RunAhead { device } => {
                let favoured = device % plan.devices.max(1);
                let mut moved = false;
                for l in 0..lanes {
                    while st.runnable(favoured, l) {
                        st.step(favoured, l);
                        moved = true;
                    }
                }
                if !moved {
                    if let Some(&(d, l)) = all.iter().find(|&&(d, l)| st.runnable(d, l)) {
                        st.step(d, l);
                    }
                }
            }
        }
        if st.finished() {
            return Ok(Schedule { order_kind, order: st.order, final_semaphores: st.sems });
        }
        if st.order.len() == before {
            return Err(st.deadlock());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{algorithms_for, build_plan};
    use crate::{DType, OpKind, Problem};

    #[test]
    fn every_order_runs_every_op_once_and_respects_waits() {
        let p = Problem::new(OpKind::GemmAr, 4, 8, 4, 8, DType::F32, DType::F32).unwrap();
        for alg in algorithms_for(OpKind::GemmAr) {
            let plan = build_plan(&p, alg).unwrap();
            let mut seen = Vec::new();
            for order in orders(6, 4) {
                let s = schedule_with(&plan, order).unwrap();
                assert_eq!(s.order.len(), plan.op_count(), "{order}");
                let mut sorted = s.order.clone();
                sorted.sort_by_key(|x| (x.device, x.lane, x.index));
                sorted.dedup();
                assert_eq!(sorted.len(), plan.op_count());
                seen.push(s.order);
            }
            seen.sort();
            seen.dedup();
            assert!(seen.len() >= 3, "orders should differ for {}", plan.name);
        }
    }
}
