//! cmm-conformance: the corpus (`cases/*.toml`), the goldens (`golden/*.bin`) and the
//! runner that checks a backend against both (BRIEF §6).
//!
//! Every case runs its plan on a [`Backend`], and every device's output is compared
//! with the f64 oracle and with the golden (see [`check`] for the rules). The runner
//! prints one aligned row per case, then `N passed, N failed`.

pub mod backend;
pub mod case;
pub mod check;
pub mod export;
pub mod fuzz;
pub mod golden;
pub mod mutants;
pub mod npy;
pub mod report;
pub mod stats;

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use cmm_core::DType;
use thiserror::Error;

pub use backend::{Backend, BackendError, CpuTwin, Cuda, GivenOutputs, OutputFiles};
pub use case::{
    cases_dir, check_case_name, load_corpus, parse_cases, Case, CaseAlgorithm, CaseError, CaseProblem, CorpusError,
    Topology, CASES_DIR_VAR,
};
pub use check::{
    check_case, check_case_keeping_memory, check_case_with, run_case, CaseResult, Failure, GoldenStatus, Goldens,
    Mismatch, MAX_CASE_ELEMENTS,
};
pub use report::{check_report_path, write_report, CaseRecord, ReportError};

/// What to run and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// Run only cases whose name contains this substring, or one of several separated
    /// by commas, and none written `!part` ([`name_matches`]).
    pub filter: Option<String>,
    /// Run only the cases whose input dtype is one of these (all when empty).
    pub inputs: Vec<DType>,
    /// Write goldens (of cases that pass the oracle check) instead of comparing.
    pub bless: bool,
    /// Export inputs and outputs of the selected cases as `.npy` files into this directory.
    pub export: Option<PathBuf>,
    /// The corpus directory.
    pub cases_dir: PathBuf,
    /// The golden directory.
    pub golden_dir: PathBuf,
    /// Interleavings each case runs under (the default order first); outputs must be
    /// bit-identical across them, and the verifier replays each.
    pub schedules: usize,
    /// After each case, print the bytes each device sends (per mesh direction for
    /// mesh cases), measured from the plan.
    pub stats: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            filter: None,
            inputs: Vec::new(),
            bless: false,
            export: None,
            cases_dir: cases_dir(),
            golden_dir: Goldens::default_dir(),
            schedules: 1,
            stats: false,
        }
    }
}

/// Counts of a corpus run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    /// Cases that passed.
    pub passed: usize,
    /// Cases that failed.
    pub failed: usize,
    /// Every case run, with whether it passed.
    pub outcomes: Vec<(Case, bool)>,
    /// Every case run, as a report records it.
    pub records: Vec<CaseRecord>,
    /// The backend's name.
    pub backend: String,
}

/// Why a corpus run could not proceed (case failures are not errors: they are counted).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConformanceError {
    /// The corpus could not be loaded.
    #[error(transparent)]
    Corpus(#[from] CorpusError),
    /// The golden directory does not exist (and the run does not bless).
    #[error("golden directory {} does not exist: pass `--goldens DIR` or set {} (or `--bless` to create goldens)", dir.display(), Goldens::DIR_VAR)]
    MissingGoldens {
        /// The directory looked for.
        dir: PathBuf,
    },
    /// The filter (and the input dtypes asked for) select no case.
    #[error("no case name contains `{filter}`{}", inputs_note(inputs))]
    NoCases {
        /// The filter.
        filter: String,
        /// The input dtypes asked for (all when empty).
        inputs: Vec<DType>,
    },
    /// Writing the report or the export failed.
    #[error("cannot write {what}: {source}")]
    Io {
        /// What was being written.
        what: String,
        /// The I/O error.
        source: io::Error,
    },
}

/// Runs the selected cases on `backend`, printing rows to stdout as they finish.
pub fn run_corpus(backend: &dyn Backend, options: &Options) -> Result<Summary, ConformanceError> {
    run_corpus_to(backend, options, &mut io::stdout().lock())
}

/// Whether a case name matches a filter: it contains the filter, or one of its
/// comma-separated parts (case names have no commas), e.g. `ring_d2_,ring_push_d2_`, and
/// none of the parts written `!part`; a filter of exclusions alone keeps every other case
/// (`!fused_push`).
pub fn name_matches(filter: &str, name: &str) -> bool {
    let (excluded, included): (Vec<&str>, Vec<&str>) = filter.split(',').partition(|part| part.starts_with('!'));
    let kept = included.is_empty() || included.iter().any(|part| name.contains(part));
    kept && !excluded.iter().any(|part| name.contains(&part[1..]))
}

fn inputs_note(inputs: &[DType]) -> String {
    if inputs.is_empty() {
        return String::new();
    }
    let names: Vec<String> = inputs.iter().map(|d| d.to_string()).collect();
    format!(" with an input of {}", names.join(" or "))
}

/// Whether a case is among those `options` select: its name matches the filter and its
/// input dtype is among those asked for.
fn selects(options: &Options, case: &Case) -> bool {
    options.filter.as_ref().is_none_or(|f| name_matches(f, &case.name))
        && (options.inputs.is_empty() || options.inputs.contains(&case.input))
}

/// [`run_corpus`], writing the report to `out` (flushed after every row).
pub fn run_corpus_to(
    backend: &dyn Backend,
    options: &Options,
    out: &mut dyn Write,
) -> Result<Summary, ConformanceError> {
    let cases: Vec<Case> = load_corpus(&options.cases_dir)?.into_iter().filter(|c| selects(options, c)).collect();
    if cases.is_empty() {
        return Err(ConformanceError::NoCases {
            filter: options.filter.clone().unwrap_or_default(),
            inputs: options.inputs.clone(),
        });
    }
    if !options.bless && !options.golden_dir.is_dir() {
        return Err(ConformanceError::MissingGoldens { dir: options.golden_dir.clone() });
    }
    let goldens = Goldens { dir: options.golden_dir.clone(), bless: options.bless };
    let mut exporter =
        options.export.as_deref().map(export::Exporter::new).transpose().map_err(|source| ConformanceError::Io {
            what: format!("the export directory {}", options.export.as_deref().unwrap_or(Path::new("")).display()),
            source,
        })?;
    let report = |source| ConformanceError::Io { what: "the report".into(), source };
    let export_error = |source| ConformanceError::Io { what: "the export".into(), source };

    let widths = Widths::new(&cases);
    writeln!(out, "{}", widths.header()).map_err(report)?;
    let mut summary = Summary { backend: backend.name(), ..Summary::default() };
    let mut updated = Vec::new();
    for case in &cases {
        let (result, ran) = check::run_case_keeping_memory(case, backend, &goldens, options.schedules);
        if result.golden == GoldenStatus::Updated {
            updated.push(case.name.clone());
        }
        if let (Some(exporter), Some((plan, memory))) = (exporter.as_mut(), &ran) {
            exporter.add(&result, plan, memory).map_err(export_error)?;
        }
        writeln!(out, "{}", widths.row(&result)).map_err(report)?;
        if options.stats {
            if let Some(line) = stats::traffic_line(case) {
                writeln!(out, "{line}").map_err(report)?;
            }
        }
        out.flush().map_err(report)?;
        if result.passed() {
            summary.passed += 1;
        } else {
            summary.failed += 1;
        }
        summary.outcomes.push((case.clone(), result.passed()));
        summary.records.push(CaseRecord::of(&result));
    }
    if let Some(exporter) = exporter {
        let index = exporter.finish().map_err(export_error)?;
        writeln!(out, "exported {} case(s); index: {}", cases.len(), index.display()).map_err(report)?;
    }
    if !updated.is_empty() {
        // A golden is rewritten only when its run passed the f64 oracle on its own;
        // these are the ones whose bits changed.
        writeln!(out, "{} golden(s) rewritten (each run passed the oracle): {}", updated.len(), updated.join(", "))
            .map_err(report)?;
    }
    writeln!(out, "{} passed, {} failed", summary.passed, summary.failed).map_err(report)?;
    out.flush().map_err(report)?;
    Ok(summary)
}

/// Column widths of the report.
struct Widths {
    name: usize,
    op: usize,
    algorithm: usize,
    devices: usize,
    shape: usize,
}

fn shape(case: &Case) -> String {
    format!("{}x{}x{}", case.m, case.n, case.k)
}

impl Widths {
    fn new(cases: &[Case]) -> Self {
        let max = |f: &dyn Fn(&Case) -> usize, min: usize| cases.iter().map(f).fold(min, usize::max);
        Widths {
            name: max(&|c| c.name.len(), 4),
            op: max(&|c| c.op_label().chars().count(), 7),
            algorithm: max(&|c| c.algorithm_label().len(), 9),
            devices: max(&|c| c.devices_label().len(), 2),
            shape: max(&|c| shape(c).len(), 5),
        }
    }

    fn header(&self) -> String {
        format!(
            "{:<nw$}  {:<ow$}  {:<aw$}  {:>dw$}  {:>sw$}  {:<10}  {:<9}  {:>9}  {:<6}  {:>9}  reason",
            "case",
            "op",
            "algorithm",
            "D",
            "MxNxK",
            "dtype",
            "family",
            "max err",
            "result",
            "time",
            nw = self.name,
            ow = self.op,
            aw = self.algorithm,
            dw = self.devices,
            sw = self.shape,
        )
    }

    fn row(&self, r: &CaseResult) -> String {
        let c = &r.case;
        let max_error = match r.max_error {
            None => "-".to_string(),
            Some(0.0) => "0".to_string(),
            Some(e) => format!("{e:.2e}"),
        };
        let time = r.elapsed.map_or("-".to_string(), |t| format!("{:.1} ms", t.as_secs_f64() * 1e3));
        let (result, reason) = if r.passed() {
            let note = match r.golden {
                GoldenStatus::Created => "golden created",
                GoldenStatus::Updated => "golden updated",
                GoldenStatus::Unchanged => "golden unchanged",
                GoldenStatus::Compared | GoldenStatus::NotChecked => "",
            };
            ("ok", note.to_string())
        } else {
            ("FAIL", r.reason())
        };
        let line = format!(
            "{:<nw$}  {:<ow$}  {:<aw$}  {:>dw$}  {:>sw$}  {:<10}  {:<9}  {:>9}  {:<6}  {:>9}  {reason}",
            c.name,
            c.op_label(),
            c.algorithm_label(),
            c.devices_label(),
            shape(c),
            format!("{}->{}", c.input, c.output),
            c.family.to_string(),
            max_error,
            result,
            time,
            nw = self.name,
            ow = self.op,
            aw = self.algorithm,
            dw = self.devices,
            sw = self.shape,
        );
        line.trim_end().to_string()
    }
}
