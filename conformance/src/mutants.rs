//! `cargo xtask mutants`: every corpus plan is mutated (see [`cmm_core::mutants`]) and
//! each mutant goes through the same checks as a conformance case: plan validation,
//! the deadlock check and the verifier under several interleavings, then a run on the
//! backend compared with the oracle (and across interleavings). A mutant is caught
//! when any check fails. A surviving mutant whose mutation is provably equivalent is
//! excluded from the rate, with its reason printed.

use std::collections::BTreeMap;
use std::io::Write;

use cmm_core::mutants::{mutants, MutationKind};
use cmm_core::schedule::{orders, schedule_with};
use cmm_core::verify::verify;
use cmm_core::Plan;

use crate::backend::Backend;
use crate::case::Case;
use crate::check::check_case_with;
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

/// The first check a mutant fails, or `None` if it survives them all.
pub fn catch(case: &Case, plan: &Plan, backend: &dyn Backend) -> Option<String> {
    if let Err(e) = plan.validate() {
        return Some(format!("invalid plan: {e}"));
    }
    for order in orders(MUTANT_SCHEDULES, plan.devices) {
        match schedule_with(plan, order) {
            Err(deadlock) => return Some(deadlock.to_string()),
            Ok(s) => {
                if let Some(f) = verify(plan, &s).first() {
                    return Some(f.describe(plan));
                }
            }
        }
    }
    let result = check_case_with(case, plan, backend, None, MUTANT_SCHEDULES);
    (!result.passed()).then(|| result.reason())
}

/// Mutates the plan of every case and reports the kill rate to `out`.
pub fn run_mutants(
    cases: &[Case],
    backend: &dyn Backend,
    out: &mut dyn Write,
    verbose: bool,
) -> Result<MutantReport, ConformanceError> {
    let io = |source| ConformanceError::Io { what: "the mutant report".into(), source };
    let mut report = MutantReport::default();
    for case in cases {
        let Ok(plan) = case.plan() else {
            continue;
        };
        let sites = [0, plan.devices - 1];
        for m in mutants(&plan, &sites) {
            let k = report.kinds.entry(m.kind).or_default();
            k.total += 1;
            match catch(case, &m.plan, backend) {
                Some(why) => {
                    k.caught += 1;
                    if verbose {
                        writeln!(out, "caught   {} {}: {why}", case.name, m.description).map_err(io)?;
                    }
                }
                None => match m.equivalent {
                    Some(reason) => {
                        k.equivalent += 1;
                        *report.excluded.entry(reason).or_default() += 1;
                    }
                    None => {
                        writeln!(out, "SURVIVED {} [{}] {}", case.name, m.kind, m.description).map_err(io)?;
                        report.survivors.push((case.name.clone(), m.description));
                    }
                },
            }
        }
    }
    writeln!(out, "{:<16} {:>7} {:>7} {:>10} {:>9}", "mutation", "total", "caught", "equivalent", "survived")
        .map_err(io)?;
    for (kind, k) in &report.kinds {
        let survived = k.total - k.caught - k.equivalent;
        writeln!(out, "{:<16} {:>7} {:>7} {:>10} {:>9}", kind.name(), k.total, k.caught, k.equivalent, survived)
            .map_err(io)?;
    }
    for (reason, n) in &report.excluded {
        writeln!(out, "excluded as equivalent ({n}): {reason}").map_err(io)?;
    }
    writeln!(out, "{} of {} mutants caught", report.caught(), report.counted()).map_err(io)?;
    out.flush().map_err(io)?;
    Ok(report)
}
