//! `cargo xtask mutants`: every corpus plan is mutated (see [`cmm_core::mutants`]) and
//! each mutant goes through the same checks as a conformance case: plan validation,
//! the deadlock check and the verifier under several interleavings, then a run on the
//! backend compared with the oracle (and across interleavings). A mutant is caught
//! when any check fails. A surviving mutant whose mutation is provably equivalent is
//! excluded from the rate, with its reason printed.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use cmm_core::cpu::Memory;
use cmm_core::mutants::{dataflow_equivalence, mutants, routing_equivalence, MutationKind};
use cmm_core::schedule::{orders, schedule_with, Order};
use cmm_core::verify::{verify_in, Cells};
use cmm_core::{ExpectedOutput, Family, Op, Plan};

use crate::backend::Backend;
use crate::case::Case;
use crate::check::check_mutant_keeping_memory;
use crate::ConformanceError;

/// Interleavings each mutant is checked under.
pub const MUTANT_SCHEDULES: usize = 4;

/// Counts for one mutation kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KindCount {
    /// Mutants generated.
    pub total: usize,
    /// Caught by a check.
    pub caught: usize,
    /// Survived, but provably equivalent (excluded).
    pub equivalent: usize,
}

/// The outcome of a mutant run.
#[derive(Clone, Debug, Default)]
pub struct MutantReport {
    /// Per kind.
    pub kinds: BTreeMap<MutationKind, KindCount>,
    /// Survivors that are not provably equivalent: (plan name, description).
    pub survivors: Vec<(String, String)>,
    /// Equivalence reasons of the excluded survivors, with how many each.
    pub excluded: BTreeMap<&'static str, usize>,
}

impl MutantReport {
    /// Mutants counted in the rate (not excluded).
    pub fn counted(&self) -> usize {
        self.kinds.values().map(|k| k.total - k.equivalent).sum()
    }

    /// Mutants caught.
    pub fn caught(&self) -> usize {
        self.kinds.values().map(|k| k.caught).sum()
    }
}

/// Every word a run leaves in the buffers whose bits the plan fixes, by name:
/// `(name, [device][word])`. These are the workload's outputs and every f32 buffer an
/// accumulating GEMM adds into or an attention state lives in: an output rounded to
/// f16/bf16 can hide a changed summation order that its f32 accumulator still shows.
type Outputs = Vec<(String, Vec<Vec<u32>>)>;

fn outputs_of(expected: &[ExpectedOutput], plan: &Plan, memory: &Memory) -> Option<Outputs> {
    let mut names: Vec<String> = expected.iter().map(|e| e.buffer.clone()).collect();
    for op in plan.programs.iter().flat_map(|p| p.lanes.iter().flatten()) {
        let targets = match op {
            Op::Gemm { c, accumulate: true, .. } => vec![*c],
            Op::Attend { state, .. } | Op::AttnMerge { into: state, .. } => state.regions().to_vec(),
            _ => Vec::new(),
        };
        for r in targets {
            let name = &plan.buffers[r.buf.0].name;
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
    }
    names
        .into_iter()
        .map(|name| {
            let id = plan.buffer_id(&name)?.0;
            Some((name, memory.iter().map(|dev| dev.get(id).cloned().unwrap_or_default()).collect()))
        })
        .collect()
}

/// The first static check a mutant fails (plan validation, a deadlock, a verifier
/// finding in one of the interleavings), or `None`.
pub fn catch_static(plan: &Plan) -> Option<String> {
    if let Err(e) = plan.validate() {
        return Some(format!("invalid plan: {e}"));
    }
    let cells = Cells::of(plan);
    for order in orders(MUTANT_SCHEDULES, plan.devices) {
        match schedule_with(plan, order) {
            Err(deadlock) => return Some(deadlock.to_string()),
            Ok(s) => {
                // A plan too large to shadow is not caught here (its case failed the
                // verifier already); the run decides.
                if let Some(f) = verify_in(plan, &s, &cells).ok().as_ref().and_then(|f| f.first()) {
                    return Some(f.describe(plan));
                }
            }
        }
    }
    None
}

/// The first check of a run on `backend` a mutant fails, or `None`. With `original`
/// (the unmutated plan's outputs and f32 accumulators on the same backend), a mutant
/// whose outputs pass every check but leave other bits is caught too: the plan fixes
/// its summation order, so goldens are stable and any change of it is visible.
pub fn catch_dynamic(
    case: &Case,
    plan: &Plan,
    backend: &dyn Backend,
    expected: &[ExpectedOutput],
    original: Option<&Outputs>,
) -> Option<String> {
    let (result, memory) = check_mutant_keeping_memory(case, plan, backend, MUTANT_SCHEDULES, expected);
    if !result.passed() {
        return Some(result.reason());
    }
    let (original, memory) = (original?, memory?);
    for (name, want) in original {
        let id = plan.buffer_id(name)?.0;
        let got: Vec<&[u32]> = memory.iter().map(|dev| dev.get(id).map_or(&[][..], |w| &w[..])).collect();
        for (d, (w, g)) in want.iter().zip(got).enumerate() {
            if let Some(i) = w.iter().zip(g).position(|(a, b)| a != b) {
                return Some(format!(
                    "{name} dev {d} word {i} differs from the unmutated plan's bits ({:#x} vs {:#x})",
                    g[i], w[i]
                ));
            }
        }
    }
    None
}

/// Which devices' ops a run mutates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sites {
    /// The first and the last device: a ring is symmetric, and the last device covers
    /// its wrap-around.
    #[default]
    FirstAndLast,
    /// Every device (a mesh's interior chips, every ring position): D/2 times the mutants.
    Every,
}

/// How a mutant run goes.
#[derive(Clone, Copy, Debug, Default)]
pub struct MutantOptions {
    /// Report every caught mutant and the check that caught it, not only survivors.
    pub verbose: bool,
    /// The devices whose ops are mutated.
    pub sites: Sites,
}

/// What the mutants of one case came to; merged into the report in case order.
#[derive(Default)]
struct CaseMutants {
    kinds: BTreeMap<MutationKind, KindCount>,
    survivors: Vec<(String, String)>,
    excluded: BTreeMap<&'static str, usize>,
    /// Report lines (every survivor; every catch when verbose).
    lines: Vec<String>,
}

/// Mutates the plan of `case` and puts every mutant through the checks.
fn mutate_case(case: &Case, backend: &dyn Backend, options: MutantOptions) -> CaseMutants {
    let mut outcome = CaseMutants::default();
    let (Ok(plan), Ok(problem)) = (case.plan(), case.problem()) else {
        return outcome;
    };
    let verbose = options.verbose;
    let sites: Vec<usize> = match options.sites {
        Sites::FirstAndLast => vec![0, plan.devices - 1],
        Sites::Every => (0..plan.devices).collect(),
    };
    // The oracle once per case, for every mutant's run.
    let expected = problem.workload().expected(case.seed, case.family);
    let original = backend
        .run(&plan, case.seed, case.family, Order::Default)
        .ok()
        .and_then(|memory| outputs_of(&expected, &plan, &memory));
    for m in mutants(&plan, &sites) {
        let k = outcome.kinds.entry(m.kind).or_default();
        k.total += 1;
        // A mutant the static checks pass and a proof covers needs no run: the
        // proofs assume exactly what those checks establish (no deadlock, no race).
        let caught = catch_static(&m.plan);
        let proven = || {
            m.equivalent
                .filter(|_| !m.exact_only || case.family == Family::Exact)
                .or_else(|| m.segments.as_ref().and_then(|s| routing_equivalence(&plan, s, case.seed)))
                .or_else(|| {
                    (m.swapped.is_some() || m.rewired)
                        .then(|| dataflow_equivalence(&plan, &m.plan, m.swapped))
                        .flatten()
                })
        };
        let verdict = match caught {
            Some(why) => Err(why),
            None => match proven() {
                Some(reason) => Ok(Some(reason)),
                None => catch_dynamic(case, &m.plan, backend, &expected, original.as_ref()).map_or(Ok(None), Err),
            },
        };
        match verdict {
            Err(why) => {
                k.caught += 1;
                if verbose {
                    outcome.lines.push(format!("caught   {} {}: {why}", case.name, m.description));
                }
            }
            Ok(Some(reason)) => {
                k.equivalent += 1;
                *outcome.excluded.entry(reason).or_default() += 1;
            }
            Ok(None) => {
                outcome.lines.push(format!("SURVIVED {} [{}] {}", case.name, m.kind, m.description));
                outcome.survivors.push((case.name.clone(), m.description));
            }
        }
    }
    outcome
}

/// [`mutate_case`] on every case, one case per thread at a time on every core;
/// `progress` hears of each case as it finishes (how many finished before it).
fn mutate_on_threads(
    cases: &[Case],
    backend: &(dyn Backend + Sync),
    options: MutantOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Vec<CaseMutants> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(cases.len());
    let next = AtomicUsize::new(0);
    let mut outcomes: Vec<Option<CaseMutants>> = cases.iter().map(|_| None).collect();
    std::thread::scope(|scope| {
        let (sender, receiver) = mpsc::channel();
        for _ in 0..threads {
            let (sender, next) = (sender.clone(), &next);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(case) = cases.get(i) else { break };
                if sender.send((i, mutate_case(case, backend, options))).is_err() {
                    break;
                }
            });
        }
        drop(sender);
        for (finished, (i, outcome)) in receiver.into_iter().enumerate() {
            progress(finished, cases.len(), &cases[i].name);
            outcomes[i] = Some(outcome);
        }
    });
    outcomes.into_iter().flatten().collect()
}

/// Mutates the plan of every case and reports the kill rate to `out`; `progress` is
/// told of each case (how many came before it, the case count, its name). Cases run
/// on every core where the backend allows it ([`Backend::concurrent`]); the report is
/// the same either way, in case order.
pub fn run_mutants(
    cases: &[Case],
    backend: &dyn Backend,
    out: &mut dyn Write,
    options: MutantOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<MutantReport, ConformanceError> {
    let io = |source| ConformanceError::Io { what: "the mutant report".into(), source };
    let outcomes = match backend.concurrent() {
        Some(shared) => mutate_on_threads(cases, shared, options, progress),
        None => cases
            .iter()
            .enumerate()
            .map(|(i, case)| {
                progress(i, cases.len(), &case.name);
                mutate_case(case, backend, options)
            })
            .collect(),
    };
    let mut report = MutantReport::default();
    for outcome in outcomes {
        for line in &outcome.lines {
            writeln!(out, "{line}").map_err(io)?;
        }
        for (kind, k) in outcome.kinds {
            let total = report.kinds.entry(kind).or_default();
            total.total += k.total;
            total.caught += k.caught;
            total.equivalent += k.equivalent;
        }
        report.survivors.extend(outcome.survivors);
        for (reason, n) in outcome.excluded {
            *report.excluded.entry(reason).or_default() += n;
        }
    }
    writeln!(out, "{:<20} {:>7} {:>7} {:>10} {:>9}", "mutation", "total", "caught", "equivalent", "survived")
        .map_err(io)?;
    for (kind, k) in &report.kinds {
        let survived = k.total - k.caught - k.equivalent;
        writeln!(out, "{:<20} {:>7} {:>7} {:>10} {:>9}", kind.name(), k.total, k.caught, k.equivalent, survived)
            .map_err(io)?;
    }
    for (reason, n) in &report.excluded {
        writeln!(out, "excluded as equivalent ({n}): {reason}").map_err(io)?;
    }
    writeln!(out, "{} of {} mutants caught", report.caught(), report.counted()).map_err(io)?;
    out.flush().map_err(io)?;
    Ok(report)
}
