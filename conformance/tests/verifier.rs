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
        elements += plan.elements();
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

/// Counts the regions of a plan file (objects with a `stride`) in document order, and
/// applies `bend` to the one numbered `target` (counting from 0).
fn visit_regions(
    value: &mut serde_json::Value,
    seen: &mut usize,
    target: usize,
    bend: &mut dyn FnMut(&mut serde_json::Value),
) {
    match value {
        serde_json::Value::Object(map) if map.contains_key("stride") => {
            if *seen == target {
                bend(value);
            }
            *seen += 1;
        }
        serde_json::Value::Object(map) => map.values_mut().for_each(|v| visit_regions(v, seen, target, bend)),
        serde_json::Value::Array(items) => items.iter_mut().for_each(|v| visit_regions(v, seen, target, bend)),
        _ => {}
    }
}

/// Plans whose regions a fuzzer bent (offsets, strides, rows and columns nudged, so
/// that rows wrap, strides skip rows or stop being whole rows, regions overlap): every
/// one that still validates gives the same findings in cells as per element, including
/// buffers that fall back to a cell per element.
#[test]
fn cells_find_what_elements_find_on_bent_plans() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: usize| {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((state >> 33) % n as u64) as usize
    };
    let (mut compared, mut findings, mut finer) = (0usize, 0usize, 0usize);
    for case in common::corpus().iter().step_by(5) {
        let plan = case.plan().unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let file: serde_json::Value = serde_json::from_str(&plan.to_file_json()).unwrap();
        for _ in 0..40 {
            let mut bent = file.clone();
            let mut count = 0;
            visit_regions(&mut bent, &mut count, usize::MAX, &mut |_| {});
            for _ in 0..1 + next(3) {
                let (target, field, nudge) = (next(count), ["offset", "rows", "cols", "stride"][next(4)], next(7));
                visit_regions(&mut bent, &mut 0, target, &mut |region| {
                    let old = region[field].as_u64().unwrap() as i64;
                    region[field] = (old + [-3, -1, 1, 2, 5, old, -old][nudge]).max(0).into();
                });
            }
            let Ok(p) = cmm_core::Plan::from_file_json(&bent.to_string()) else { continue };
            let Ok(schedule) = schedule_with(&p, cmm_core::schedule::Order::Default) else { continue };
            let by_cells = verify(&p, &schedule).unwrap();
            assert_eq!(by_cells, verify_per_element(&p, &schedule).unwrap(), "{} bent: {bent}", case.name);
            compared += 1;
            findings += by_cells.len();
            finer += usize::from(Cells::of(&p).per_device() > Cells::of(&plan).per_device());
        }
    }
    eprintln!("{compared} bent plans compared, {findings} findings, {finer} cut finer than their originals");
    assert!(compared > 200 && findings > 150 && finer > 100, "{compared} {findings} {finer}");
}
