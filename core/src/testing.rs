//! Checks the families' unit tests share: a plan verified under several interleavings,
//! and a CPU-twin run judged against the workload's oracle.

use crate::cpu;
use crate::generator::Family;
use crate::plan::Plan;
use crate::schedule::{orders, schedule_with};
use crate::verify::queues::{check_enqueue_order, schedule_order};
use crate::verify::verify;
use crate::workload::Workload;

/// The plan verifies clean under `n` interleavings (the default order first).
pub fn assert_clean_under(plan: &Plan, n: usize) {
    for order in orders(n, plan.devices) {
        let s = schedule_with(plan, order).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
        let findings = verify(plan, &s).unwrap_or_else(|e| panic!("{e}"));
        assert!(findings.is_empty(), "{} {order}: {}", plan.name, findings[0].describe(plan));
    }
}

/// The plan verifies clean under 3 interleavings, and its schedule order cannot hang
/// even on a single hardware queue.
pub fn assert_sound(plan: &Plan) {
    assert_clean_under(plan, 3);
    let enqueue = schedule_order(plan).unwrap();
    check_enqueue_order(plan, &enqueue, 1).unwrap_or_else(|e| panic!("{e}"));
}

/// The CPU twin's outputs against the oracle: bit for bit in the exact family, within
/// the tolerance in the realistic one. Returns the worst |got − value| / (magnitude +
/// floor), the share of a derived bound a correct run uses.
pub fn assert_matches_oracle(plan: &Plan, workload: &dyn Workload, seed: u32, family: Family) -> f64 {
    let mut worst = 0.0f64;
    let memory = cpu::run(plan, seed, family).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
    for e in workload.expected(seed, family) {
        let buf = plan.buffer_id(&e.buffer).unwrap().0;
        for (d, want) in e.values.iter().enumerate() {
            assert_eq!(want.len(), e.len_on(d));
            for (i, (&bits, &v)) in memory[d][buf].iter().zip(want).enumerate() {
                let got = e.dtype.decode(bits) as f64;
                let m = e.magnitudes[d][i];
                let ok = match family {
                    Family::Exact => bits == e.dtype.encode(v as f32),
                    Family::Realistic => e.tolerance.accepts(got, v, m),
                };
                assert!(ok, "{} {family} {} dev {d} elem {i}: {got} vs {v} ± {m}", plan.name, e.buffer);
                worst = worst.max((got - v).abs() / (m + e.tolerance.floor));
            }
        }
    }
    worst
}
