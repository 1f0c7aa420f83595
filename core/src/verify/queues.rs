//! The hang check of a GPU executor's hardware (BRIEF §7).
//!
//! A CUDA executor puts each (device, lane) of a plan on its own stream, but the GPU
//! feeds streams through a few FIFO hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by
//! default, at most 32). The model:
//!
//! - streams are numbered in creation order, device by device, lane by lane
//!   (`device · lanes + lane`), and stream `s` feeds queue `(s + offset) mod N`: the
//!   driver hands queues out round-robin, from wherever its counter stands, so every
//!   offset is checked;
//! - each queue holds the ops of its streams in the order the host *enqueued* them;
//! - the op at the head of a queue leaves it when it has started; a `Wait` starts only
//!   once its semaphore reached the value, and until then it holds its queue, with
//!   everything behind it, whatever stream that belongs to (a spinning wait kernel holds
//!   the queue as soon as its own stream's next op is behind it; `cuStreamWaitValue32`
//!   holds it at once);
//! - any other op always leaves eventually, and a `Signal` counts once it has left.
//!
//! Semaphores only grow, so the order in which heads leave does not matter: the check
//! drains every queue as far as it goes, and the plan runs to the end on this hardware
//! if and only if every queue empties. When one does not, [`QueueHang`] names a cycle:
//! each wait at a queue head needs a signal that sits behind another blocked wait.
//!
//! An order that passes with one queue passes under every mapping of streams to any
//! number of queues (the earliest op not yet started always heads its queue, and every
//! signal it needs was enqueued before it); the schedule order of [`crate::schedule`] is
//! such an order.

use std::fmt;

use thiserror::Error;

use crate::plan::{FusedRun, Op, OpSite, Plan};
use crate::schedule::{schedule, Deadlock};

/// The default number of hardware queues CUDA gives a context.
pub const DEFAULT_QUEUES: usize = 8;

/// The most hardware queues `CUDA_DEVICE_MAX_CONNECTIONS` can ask for.
pub const MAX_QUEUES: usize = 32;

/// One link of a hang: a wait that heads its queue and the signal it needs, stuck
/// behind another wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HangLink {
    /// The blocked wait.
    pub wait: OpSite,
    /// Its text.
    pub wait_text: String,
    /// The queue it heads.
    pub queue: usize,
    /// The value it waits for.
    pub awaited: u32,
    /// The value its semaphore reached.
    pub reached: u32,
    /// A signal it needs that never left its queue (`None`: no signal left in any queue
    /// could raise the semaphore to the value, a deadlock of the plan itself).
    pub signal: Option<(OpSite, String, usize)>,
}

/// An enqueue order that hangs on the modelled hardware.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueHang {
    /// Plan name.
    pub plan: String,
    /// Number of hardware queues.
    pub queues: usize,
    /// The round-robin offset of the first stream that hangs.
    pub offset: usize,
    /// Ops that left their queues before nothing could move.
    pub started: usize,
    /// The cycle: the wait of each link needs a signal behind the wait of the next one,
    /// and the last link's signal is behind the first link's wait.
    pub cycle: Vec<HangLink>,
    /// Lane names, for the report.
    lanes: Vec<String>,
}

impl QueueHang {
    fn site(&self, s: &OpSite) -> String {
        let lane = self.lanes.get(s.lane).map_or("?", String::as_str);
        format!("device {} lane {lane} op {}", s.device, s.index)
    }
}

impl fmt::Display for QueueHang {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "plan `{}` hangs on {} hardware queue(s) (streams from queue {} on, {} op(s) started): ",
            self.plan, self.queues, self.offset, self.started
        )?;
        for (i, link) in self.cycle.iter().enumerate() {
            if i == 0 {
                write!(f, "`{}` ({}) heads queue {}", link.wait_text, self.site(&link.wait), link.queue)?;
            } else {
                write!(f, ", which is")?;
            }
            write!(f, " at {} of {}", link.reached, link.awaited)?;
            match &link.signal {
                Some((site, text, queue)) => {
                    let next = &self.cycle[(i + 1) % self.cycle.len()];
                    let again = if i + 1 == self.cycle.len() { " again" } else { "" };
                    write!(
                        f,
                        " and needs `{text}` ({}), queued on queue {queue} behind `{}` ({}){again}",
                        self.site(site),
                        next.wait_text,
                        self.site(&next.wait)
                    )?;
                }
                None => write!(f, " and no signal left anywhere can raise it")?,
            }
        }
        write!(f, ".")
    }
}

/// Why an enqueue order cannot be checked or would hang.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum EnqueueError {
    /// The order is not every op of the plan once, each lane in program order.
    #[error("enqueue order of plan `{plan}` is malformed: {detail}")]
    Malformed {
        /// Plan name.
        plan: String,
        /// What is wrong.
        detail: String,
    },
    /// The queue count is outside 1..=32.
    #[error("{queues} hardware queues: CUDA offers 1 to {MAX_QUEUES}")]
    Queues {
        /// The count asked for.
        queues: usize,
    },
    /// The order hangs.
    #[error("{0}")]
    Hang(Box<QueueHang>),
}

/// The order in which an executor that walks device by device, lane by lane, enqueues
/// each lane whole (what `cmm-cuda` did before the hang check existed).
pub fn whole_lane_order(plan: &Plan) -> Vec<OpSite> {
    plan.ops().map(|(site, _)| site).collect()
}

/// The order of the deterministic schedule: safe under any mapping of streams to queues.
pub fn schedule_order(plan: &Plan) -> Result<Vec<OpSite>, Deadlock> {
    Ok(schedule(plan)?.order)
}

/// `order` (every op once) as a CUDA executor enqueues it: a fused run is one kernel, so
/// its ops go together where `order` reaches its last block, once everything its waits
/// need is enqueued (the queue check then sees the kernel occupy its queue while it
/// waits, as it does). Each run's span stays whole and in lane order.
pub fn with_fused_runs_whole(order: &[OpSite], runs: &[FusedRun]) -> Vec<OpSite> {
    let run_of = |s: &OpSite| runs.iter().position(|r| r.holds(*s));
    let mut whole = Vec::with_capacity(order.len());
    for s in order {
        match run_of(s) {
            None => whole.push(*s),
            Some(i) if s.index == runs[i].end() => whole.extend(runs[i].span().map(|index| OpSite { index, ..*s })),
            Some(_) => {}
        }
    }
    whole
}

/// The stream of an op: streams are created device by device, lane by lane.
pub fn stream_of(plan: &Plan, site: OpSite) -> usize {
    site.device * plan.lanes.len() + site.lane
}

/// Checks that `order` (every op of the validated `plan` once, each lane in program
/// order) cannot hang on `queues` FIFO hardware queues, for every round-robin offset.
pub fn check_enqueue_order(plan: &Plan, order: &[OpSite], queues: usize) -> Result<(), EnqueueError> {
    if !(1..=MAX_QUEUES).contains(&queues) {
        return Err(EnqueueError::Queues { queues });
    }
    check_well_formed(plan, order)?;
    // A plan with fewer streams than queues still has `queues` distinct offsets, but
    // only `streams` of them can differ in which streams share a queue.
    let streams = plan.devices * plan.lanes.len();
    for offset in 0..queues.min(streams.max(1)) {
        drain(plan, order, queues, offset)?;
    }
    Ok(())
}

fn check_well_formed(plan: &Plan, order: &[OpSite]) -> Result<(), EnqueueError> {
    let malformed = |detail: String| EnqueueError::Malformed { plan: plan.name.clone(), detail };
    let lanes = plan.lanes.len();
    let mut next = vec![0usize; plan.devices * lanes];
    for site in order {
        let lane_ops = plan
            .programs
            .get(site.device)
            .and_then(|p| p.lanes.get(site.lane))
            .ok_or_else(|| malformed(format!("{site} does not exist")))?;
        let expected = &mut next[stream_of(plan, *site)];
        if site.index != *expected || site.index >= lane_ops.len() {
            return Err(malformed(format!("{site} enqueued where op {} of its lane was due", *expected)));
        }
        *expected += 1;
    }
    if order.len() != plan.op_count() {
        return Err(malformed(format!("{} ops enqueued, the plan has {}", order.len(), plan.op_count())));
    }
    Ok(())
}

fn drain(plan: &Plan, order: &[OpSite], queues: usize, offset: usize) -> Result<(), EnqueueError> {
    let op = |s: &OpSite| &plan.programs[s.device].lanes[s.lane][s.index];
    let queue_of = |s: &OpSite| (stream_of(plan, *s) + offset) % queues;
    let mut fifo: Vec<Vec<OpSite>> = vec![Vec::new(); queues];
    // Each enqueued op's position in its queue.
    let mut position = Vec::with_capacity(order.len());
    for site in order {
        let q = &mut fifo[queue_of(site)];
        position.push(q.len());
        q.push(*site);
    }
    let n_sems = plan.semaphores.len();
    let mut head = vec![0usize; queues];
    let mut sems = vec![vec![0u32; n_sems]; plan.devices];
    // Queues whose head may start, and per (device, semaphore) the queues whose head
    // waits on it: a signal wakes only those, so every op is looked at a bounded number
    // of times (semaphores only grow, so a wait once satisfied stays so).
    let mut runnable: Vec<usize> = (0..queues).rev().collect();
    let mut waiting: Vec<Vec<usize>> = vec![Vec::new(); plan.devices * n_sems];
    let mut started = 0usize;
    while let Some(q) = runnable.pop() {
        while let Some(site) = fifo[q].get(head[q]) {
            match op(site) {
                Op::Wait { sem, value } if sems[site.device][sem.0] < *value => {
                    waiting[site.device * n_sems + sem.0].push(q);
                    break;
                }
                Op::Signal { device, sem, add } => {
                    let s = &mut sems[*device][sem.0];
                    *s = s.saturating_add(*add);
                    let reached = *s;
                    waiting[*device * n_sems + sem.0].retain(|&w| {
                        let awaited = match fifo[w].get(head[w]).map(op) {
                            Some(Op::Wait { value, .. }) => *value,
                            _ => 0,
                        };
                        let wakes = awaited <= reached;
                        if wakes {
                            runnable.push(w);
                        }
                        !wakes
                    });
                }
                _ => {}
            }
            head[q] += 1;
            started += 1;
        }
    }
    if started == order.len() {
        return Ok(());
    }
    // Explain: from some blocked head, follow "needs a signal behind" until a repeat.
    let blocked_head = |q: usize| fifo[q].get(head[q]).copied();
    let link_of = |q: usize| -> (HangLink, Option<usize>) {
        let site = blocked_head(q).expect("a blocked queue has a head");
        let Op::Wait { sem, value } = op(&site) else { unreachable!("only waits block a queue") };
        // The earliest enqueued signal to this semaphore that has not started.
        let pending = order.iter().zip(&position).find_map(|(s, &pos)| {
            let signals_it = matches!(op(s), Op::Signal { device, sem: t, .. } if *device == site.device && t == sem);
            (signals_it && pos >= head[queue_of(s)]).then_some(s)
        });
        let signal = pending.map(|s| (*s, plan.op_text(op(s)), queue_of(s)));
        let next = pending.map(&queue_of);
        let link = HangLink {
            wait: site,
            wait_text: plan.op_text(op(&site)),
            queue: q,
            awaited: *value,
            reached: sems[site.device][sem.0],
            signal,
        };
        (link, next)
    };
    let first = (0..queues).find(|&q| blocked_head(q).is_some()).expect("some queue is blocked");
    let mut path: Vec<(usize, HangLink)> = Vec::new();
    let mut q = first;
    let cycle = loop {
        if let Some(at) = path.iter().position(|(seen, _)| *seen == q) {
            break path.split_off(at).into_iter().map(|(_, l)| l).collect();
        }
        let (link, next) = link_of(q);
        match next {
            Some(n) => {
                path.push((q, link));
                q = n;
            }
            None => break vec![link],
        }
    };
    Err(EnqueueError::Hang(Box::new(QueueHang {
        plan: plan.name.clone(),
        queues,
        offset,
        started,
        cycle,
        lanes: plan.lanes.clone(),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{algorithms_for, build_plan};
    use crate::{Algorithm, DType, OpKind, Problem};

    fn ring_ag(devices: usize) -> Plan {
        let p = Problem::new(OpKind::AgGemm, devices, 8 * devices, 8, 8, DType::F32, DType::F32).unwrap();
        build_plan(&p, Algorithm::Ring).unwrap()
    }

    #[test]
    fn schedule_order_is_safe_on_one_queue_for_every_1d_plan() {
        for op in [OpKind::AgGemm, OpKind::GemmRs, OpKind::GemmAr] {
            for d in [1, 2, 3, 4, 8] {
                let p = Problem::new(op, d, 8 * d, 8 * d, 8 * d, DType::F32, DType::F32).unwrap();
                for alg in algorithms_for(op) {
                    let plan = build_plan(&p, alg).unwrap();
                    let order = schedule_order(&plan).unwrap();
                    for queues in [1, 2, 8, 32] {
                        check_enqueue_order(&plan, &order, queues).unwrap_or_else(|e| panic!("{e}"));
                    }
                }
            }
        }
    }

    #[test]
    fn whole_lanes_on_one_queue_hang_and_the_report_names_the_cycle() {
        let plan = ring_ag(4);
        let err = check_enqueue_order(&plan, &whole_lane_order(&plan), 1).unwrap_err();
        let EnqueueError::Hang(hang) = &err else { panic!("{err}") };
        // Device 0's compute lane is first in the only queue; its first wait needs a
        // signal from device 1, which was enqueued later in the same queue.
        assert_eq!(hang.cycle.len(), 1, "{err}");
        let link = &hang.cycle[0];
        assert_eq!((link.wait.device, link.queue, link.reached), (0, 0, 0), "{err}");
        let (signal, _, queue) = link.signal.as_ref().expect("a signal is pending");
        assert_eq!((signal.device, *queue), (1, 0), "{err}");
        let text = err.to_string();
        assert!(text.starts_with("plan `ag_gemm/ring"), "{text}");
        assert!(text.contains("heads queue 0") && text.contains("queued on queue 0 behind"), "{text}");
        assert!(text.ends_with('.') && !text.contains('\n'), "one sentence: {text}");
    }

    #[test]
    fn whole_lanes_with_a_queue_per_stream_do_not_hang() {
        let plan = ring_ag(4);
        let streams = plan.devices * plan.lanes.len();
        check_enqueue_order(&plan, &whole_lane_order(&plan), streams).unwrap();
    }

    #[test]
    fn every_offset_is_checked() {
        // Two streams per queue: whether the two lanes of one device share a queue
        // depends on the offset, and a hang needs only one bad offset.
        let plan = ring_ag(4);
        let order = whole_lane_order(&plan);
        let hangs: Vec<usize> = (0..4).filter(|&o| drain(&plan, &order, 4, o).is_err()).collect();
        assert!(!hangs.is_empty());
        assert!(check_enqueue_order(&plan, &order, 4).is_err());
    }

    #[test]
    fn malformed_orders_and_queue_counts_are_typed_errors() {
        let plan = ring_ag(2);
        let mut order = schedule_order(&plan).unwrap();
        assert!(matches!(check_enqueue_order(&plan, &order, 0), Err(EnqueueError::Queues { queues: 0 })));
        assert!(matches!(check_enqueue_order(&plan, &order, 33), Err(EnqueueError::Queues { .. })));
        order.pop();
        let err = check_enqueue_order(&plan, &order, 8).unwrap_err();
        assert!(matches!(err, EnqueueError::Malformed { .. }) && err.to_string().contains("ops enqueued"), "{err}");
        let mut swapped = schedule_order(&plan).unwrap();
        let (i, j) = (0..swapped.len())
            .flat_map(|i| (i + 1..swapped.len()).map(move |j| (i, j)))
            .find(|&(i, j)| swapped[i].device == swapped[j].device && swapped[i].lane == swapped[j].lane)
            .unwrap();
        swapped.swap(i, j);
        let err = check_enqueue_order(&plan, &swapped, 8).unwrap_err();
        assert!(err.to_string().contains("was due"), "{err}");
    }

    #[test]
    fn a_plan_deadlock_is_reported_without_a_signal() {
        let mut plan = ring_ag(2);
        // Drop every signal: the first wait can never pass, whatever the queues.
        for p in &mut plan.programs {
            for lane in &mut p.lanes {
                lane.retain(|op| !matches!(op, Op::Signal { .. }));
            }
        }
        let order = whole_lane_order(&plan);
        let Err(EnqueueError::Hang(hang)) = check_enqueue_order(&plan, &order, 8) else { panic!() };
        assert!(hang.cycle.iter().any(|l| l.signal.is_none()));
        assert!(hang.to_string().contains("no signal left anywhere"), "{hang}");
    }
}
