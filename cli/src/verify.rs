//! `cmm verify`: a plan's structure, deadlocks, races, reads of unwritten memory and
//! semaphore accounting under several interleavings, and what CUDA's FIFO hardware
//! queues do with it.

use anyhow::{bail, Context, Result};
use cmm_conformance::CaseRecord;
use cmm_core::schedule::{orders, schedule_with};
use cmm_core::verify::{check_cells, verify_in, Cells};
use cmm_core::Plan;

/// What `cmm verify` found in a plan.
#[derive(Debug)]
pub struct Verification {
    /// The lines it prints, in order.
    pub lines: Vec<String>,
    /// Findings over every interleaving.
    pub findings: usize,
    /// One report record per interleaving.
    pub records: Vec<CaseRecord>,
}

/// The most interleavings one verification replays: each is the whole plan again, with a
/// line of its own in the output and the report, so that a count of 10^9 would run for
/// hours and hold gigabytes before saying anything.
pub const MAX_SCHEDULES: usize = 100_000;

/// `schedules` as the count of interleavings [`verify_plan`] takes, or why it is not one
/// (a caller such as Python may hand it a negative number).
pub fn schedule_count(schedules: i128) -> Result<usize> {
    usize::try_from(schedules)
        .ok()
        .filter(|count| (1..=MAX_SCHEDULES).contains(count))
        .with_context(|| format!("schedules: 1 to {MAX_SCHEDULES}, not {schedules} (the interleavings verify replays)"))
}

/// Verifies `plan` under `schedules` interleavings (the default order first), 1 to
/// [`MAX_SCHEDULES`].
pub fn verify_plan(plan: &Plan, schedules: usize) -> Result<Verification> {
    let schedules = schedule_count(schedules as i128)?;
    let cells = Cells::of(plan);
    let mut lines = vec![format!(
        "plan {}: {} devices, {} lanes, {} ops; its {} buffer elements shadowed in {} cells",
        plan.name,
        plan.devices,
        plan.lanes.len(),
        plan.op_count(),
        plan.elements(),
        cells.per_device() * plan.devices as u64
    )];
    check_cells(plan, &cells)?;
    let mut findings = 0;
    let mut records = Vec::new();
    for order in orders(schedules, plan.devices) {
        let found: Vec<String> = match schedule_with(plan, order) {
            Ok(schedule) => verify_in(plan, &schedule, &cells)?.iter().map(|f| f.describe(plan)).collect(),
            Err(deadlock) => vec![deadlock.to_string()],
        };
        lines.extend(found.iter().map(|f| format!("{order}: {f}")));
        if found.is_empty() {
            lines.push(format!("{order}: no finding"));
        }
        findings += found.len();
        records.push(CaseRecord {
            name: format!("{} [{order}]", plan.name),
            op: "verify".into(),
            algorithm: String::new(),
            devices: plan.devices.to_string(),
            shape: String::new(),
            dtype: String::new(),
            family: String::new(),
            passed: found.is_empty(),
            time_ms: None,
            max_error: None,
            reason: found.join("; "),
        });
    }
    if findings > 0 {
        lines.push(format!("{findings} finding(s)"));
    } else {
        lines.push(format!(
            "verified under {schedules} interleaving(s): no race, no deadlock, no read of unwritten memory"
        ));
        lines.extend(queue_advice(plan)?);
    }
    Ok(Verification { lines, findings, records })
}

/// What a CUDA executor's enqueue order does with the plan on the GPU's FIFO hardware
/// queues (`CUDA_DEVICE_MAX_CONNECTIONS`, docs/cuda.md): the schedule order cannot hang on
/// any number of them; enqueueing each lane whole, device by device, may.
fn queue_advice(plan: &Plan) -> Result<Vec<String>> {
    use cmm_core::verify::queues::{check_enqueue_order, schedule_order, whole_lane_order, EnqueueError};
    use cmm_core::verify::queues::{DEFAULT_QUEUES, MAX_QUEUES};
    let mut lines = Vec::new();
    match check_enqueue_order(plan, &schedule_order(plan)?, 1) {
        Ok(()) => lines.push(
            "hardware queues: enqueued in schedule order, the plan cannot hang on any number of CUDA's FIFO \
             queues (proven on one)"
                .to_string(),
        ),
        Err(e) => lines.push(format!("hardware queues: enqueued in schedule order: {e}")),
    }
    for queues in [DEFAULT_QUEUES, MAX_QUEUES] {
        let whole = "hardware queues: enqueued lane by lane (each lane whole, device by device)";
        lines.push(match check_enqueue_order(plan, &whole_lane_order(plan), queues) {
            Ok(()) => format!("{whole}, it cannot hang on {queues} queues"),
            Err(EnqueueError::Hang(hang)) => format!("{whole}: {hang}"),
            Err(e) => bail!("{e}"),
        });
    }
    Ok(lines)
}
