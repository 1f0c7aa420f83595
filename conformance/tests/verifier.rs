//! The verifier shadows memory in cells (rectangles that every access covers whole or
//! not at all, `cmm_core::verify::Cells`), not elements. These tests hold it to the
//! per-element replay it replaces: the same findings, at the same elements, on the
//! whole corpus and on the mutants of part of it, where the findings are many.

mod common;

use std::collections::BTreeMap;

use cmm_core::mutants::mutants;
use cmm_core::schedule::{orders, schedule_with};
use cmm_core::verify::{verify, verify_per_element, Cells, Finding};

fn kind(f: &Finding) -> &'static str {
    match f {
        Finding::Race { .. } => "race",
        Finding::UnwrittenRead { .. } => "unwritten read",
        Finding::UnwrittenOutput { .. } => "unwritten output",
        Finding::UnorderedOutput { .. } => "unordered output",
        Finding::SemaphoreAudit { .. } => "semaphore audit",
    }
}

#[test]
fn cells_find_what_elements_find_on_the_corpus_and_on_mutants() {
    let (mut compared, mut elements, mut cells) = (0usize, 0u64, 0u64);
    let mut found: BTreeMap<&'static str, usize> = BTreeMap::new();
    for (i, case) in common::corpus().iter().enumerate() {
        let plan = case.plan().unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let d = plan.devices;
        elements += plan.buffers.iter().map(|b| b.len() as u64).sum::<u64>() * d as u64;
        cells += Cells::of(&plan).per_device() * d as u64;
        // The mutants of one case in sixteen, and of one MeshSlice case in four (their
        // strided slices cut row by row), bring the findings; the per-element replay
        // is slow, so they run under one order.
        let mut plans = vec![(plan.clone(), 2)];
        if i % 16 == 0 || (case.algorithm == "meshslice") {
            plans.extend(mutants(&plan, &[0, d - 1]).into_iter().map(|m| (m.plan, 1)));
        }
        for (p, n) in &plans {
            for order in orders(*n, d) {
                let Ok(schedule) = schedule_with(p, order) else { continue };
                let by_cells = verify(p, &schedule).unwrap_or_else(|e| panic!("{}: {e}", p.name));
                let by_elements = verify_per_element(p, &schedule).unwrap();
                assert_eq!(by_cells, by_elements, "{} under {order}", p.name);
                for f in &by_cells {
                    *found.entry(kind(f)).or_default() += 1;
                }
                compared += 1;
            }
        }
    }
    eprintln!("{compared} replays compared; findings {found:?}; {elements} elements in {cells} cells");
    for k in ["race", "unwritten read", "unwritten output", "unordered output", "semaphore audit"] {
        assert!(found.get(k).copied().unwrap_or(0) > 0, "no `{k}` finding was compared: {found:?}");
    }
    assert!(cells * 20 < elements, "{cells} cells for {elements} elements");
}
