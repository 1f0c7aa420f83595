//! The check of one case: run its plan on a backend, then compare every output of every
//! device (the workload's outputs, [`cmm_core::workload`]) with the f64 oracle and with
//! the golden.
//!
//! | family | vs oracle | vs golden |
//! |---|---|---|
//! | exact | bit for bit with `output.encode(oracle as f32)` | bit for bit |
//! | realistic | within the output's tolerance (for a GEMM [`Tolerance::gemm`]`(output, K)`) | within twice that tolerance |
//!
//! The golden comparison of the realistic family allows twice the oracle tolerance
//! because the golden and the run are two results, each within the tolerance of the
//! exact value (a backend may sum in a different order than the one that blessed).
//! Both bounds are scaled by the oracle's Σ|a·b| of each element, so a wrong block, a
//! wrong slot or a lost partial sum (errors of the order of |c|) fails either way.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cmm_core::cpu::Memory;
use cmm_core::schedule::{orders, schedule_with, Order};
use cmm_core::verify::{check_cells, verify_in, Cells};
use cmm_core::workload::ExpectedOutput;
use cmm_core::{AlgorithmError, Family, MeshError, Plan, ProblemError, Tolerance};
use thiserror::Error;

use crate::backend::{Backend, BackendError};
use crate::case::{Case, CaseError};
use crate::golden::{self, GoldenError};

/// The most buffer elements (over every device) a case may have: 7 × 2^25, about 235
/// million. A check holds every device's buffers on the host, with the f64 oracle's
/// outputs and the golden beside them: some 30 bytes per element at worst, so 7 GiB.
pub const MAX_CASE_ELEMENTS: u64 = 7 << 25;

/// Where goldens live and whether this run writes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Goldens {
    /// The directory of `<case>.bin` files.
    pub dir: PathBuf,
    /// Write the goldens of cases that pass the oracle check instead of comparing.
    pub bless: bool,
}

impl Goldens {
    /// The environment variable that points the runner at a golden directory.
    pub const DIR_VAR: &'static str = "CMM_GOLDEN_DIR";

    /// The golden directory: `$CMM_GOLDEN_DIR` when set, else this crate's `golden/` in
    /// the source tree it was built from.
    pub fn default_dir() -> PathBuf {
        std::env::var_os(Self::DIR_VAR)
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("golden"))
    }

    /// The path of a case's golden.
    pub fn path(&self, case: &Case) -> PathBuf {
        self.dir.join(format!("{}.bin", case.name))
    }
}

/// The worst element of a failed comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// The output buffer, when the workload has several.
    pub output: Option<String>,
    /// Device.
    pub device: usize,
    /// Row in the device's output.
    pub row: usize,
    /// Column in the device's output.
    pub col: usize,
    /// Row and column in the global result, where the device's output is one window
    /// of it.
    pub global: Option<(usize, usize)>,
    /// The backend's value.
    pub got: f64,
    /// The value it is compared with.
    pub expected: f64,
    /// Allowed absolute error; `None` for a bit-for-bit comparison.
    pub allowed: Option<f64>,
    /// Elements that failed, over all devices.
    pub count: usize,
    /// Elements compared, over all devices.
    pub total: usize,
}

fn num(x: f64) -> String {
    if x.is_finite() && x.fract() == 0.0 && x.abs() < 1e9 {
        format!("{x}")
    } else {
        format!("{x:.6e}")
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(output) = &self.output {
            write!(f, "{output} ")?;
        }
        write!(f, "dev {} (row {}, col {} of its output", self.device, self.row, self.col)?;
        if let Some((row, col)) = self.global {
            write!(f, "; global row {row}, col {col}")?;
        }
        write!(f, ") got {} expected {}", num(self.got), num(self.expected))?;
        match self.allowed {
            None => write!(f, "; {} of {} elements differ (bit-exact)", self.count, self.total),
            Some(allowed) => write!(
                f,
                ", |error| {:.3e} > allowed {allowed:.3e}; {} of {} elements off",
                (self.got - self.expected).abs(),
                self.count,
                self.total
            ),
        }
    }
}

/// What to do about a golden mismatch: a user's kernel is wrong, or an executor changed.
fn golden_advice(given_outputs: bool) -> &'static str {
    if given_outputs {
        " (the outputs given differ from the golden `cmm golden` wrote for this case)"
    } else {
        " (if the executor's change is intended, regenerate the golden: `cargo xtask conformance --bless` and \
         commit in the repository, `cmm golden` for your own cases)"
    }
}

/// Why a case failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Failure {
    /// The case's name cannot name its files ([`crate::case::check_case_name`]).
    #[error("{0}")]
    Name(String),
    /// The case does not describe a valid problem.
    #[error("invalid case: {0}")]
    Problem(#[from] ProblemError),
    /// The algorithm is unknown or cannot plan this problem.
    #[error("no plan: {0}")]
    Algorithm(#[from] AlgorithmError),
    /// The mesh case is invalid, or its algorithm unknown or unable to plan it.
    #[error("mesh case: {0}")]
    Mesh(#[from] MeshError),
    /// The linear case is invalid, or its algorithm unknown or unable to plan it.
    #[error("linear case: {0}")]
    Linear(String),
    /// The attention case is invalid, or its algorithm unknown or unable to plan it.
    #[error("attention case: {0}")]
    Attention(String),
    /// The MoE case is invalid, or its algorithm unknown or unable to plan it.
    #[error(transparent)]
    Moe(cmm_core::MoeError),
    /// The plan does not fit the case (device count, output buffer).
    #[error("plan does not fit the case: {0}")]
    Plan(String),
    /// The case asks for an input family its workload has no exact answer in.
    #[error("invalid case: {0}")]
    Family(String),
    /// The backend could not run the plan.
    #[error("{0}")]
    Backend(#[from] BackendError),
    /// The backend returned memory of the wrong shape.
    #[error("backend returned {0}")]
    Memory(String),
    /// The output differs from the f64 oracle.
    #[error("oracle: {0}")]
    Oracle(Mismatch),
    /// The output differs from the golden.
    #[error("golden: {mismatch}{}", golden_advice(*given_outputs))]
    Golden {
        /// The worst element.
        mismatch: Mismatch,
        /// Whether the outputs were given (`cmm check`) rather than computed by an
        /// executor of the project's plans.
        given_outputs: bool,
    },
    /// The verifier found races, reads of unwritten memory, unwritten outputs or
    /// semaphore accounting errors in one interleaving.
    #[error("verifier ({order}): {count} finding(s): {}", findings.join("; "))]
    Verifier {
        /// The interleaving replayed.
        order: Order,
        /// How many findings.
        count: usize,
        /// The first few, described.
        findings: Vec<String>,
    },
    /// The verifier does not replay the plan (too large to shadow).
    #[error("verifier: {0}")]
    Unverifiable(#[from] cmm_core::verify::VerifyError),
    /// The case's buffers are more than a check holds on the host.
    #[error("the plan's buffers hold {elements} elements over its devices, more than the {limit} a check holds on the host (every device's memory, the f64 oracle's outputs, the golden); check the algorithm at smaller M, N and K")]
    TooLarge {
        /// Elements of every buffer over every device.
        elements: u64,
        /// [`MAX_CASE_ELEMENTS`].
        limit: u64,
    },
    /// Poison (memory no op wrote) reached the output.
    #[error("poison reached the output{}: dev {device} (row {row}, col {col}), {count} element(s) of the device never written", output.as_ref().map(|o| format!(" {o}")).unwrap_or_default())]
    Poison {
        /// The output buffer, when the workload has several.
        output: Option<String>,
        /// Device.
        device: usize,
        /// Row.
        row: usize,
        /// Column.
        col: usize,
        /// Poisoned elements of that device.
        count: usize,
    },
    /// Two interleavings of a plan produced different outputs.
    #[error("schedule-dependent output{}: default and {order} differ first at dev {device} (row {row}, col {col}): {default_value} vs {other_value}", output.as_ref().map(|o| format!(" {o}")).unwrap_or_default())]
    ScheduleDependent {
        /// The output buffer, when the workload has several.
        output: Option<String>,
        /// The interleaving that differs from the default order.
        order: Order,
        /// Device.
        device: usize,
        /// Row.
        row: usize,
        /// Column.
        col: usize,
        /// Value in the default order.
        default_value: f64,
        /// Value under `order`.
        other_value: f64,
    },
    /// There is no golden for the case.
    #[error("golden {} is missing: run `cargo xtask conformance --bless` and commit it", path.display())]
    GoldenMissing {
        /// The expected golden path.
        path: PathBuf,
    },
    /// The golden file is unusable (corrupt, stale, unreadable).
    #[error("golden {}: {source}", path.display())]
    GoldenInvalid {
        /// The golden path.
        path: PathBuf,
        /// What is wrong.
        source: GoldenError,
    },
    /// The golden could not be read or written.
    #[error("golden {}: {source}", path.display())]
    GoldenIo {
        /// The golden path.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
}

/// What happened to the golden of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GoldenStatus {
    /// Not compared (the run failed before, or the golden is unusable).
    NotChecked,
    /// Compared.
    Compared,
    /// Written for the first time.
    Created,
    /// Rewritten with different contents.
    Updated,
    /// Blessed, and identical to the file already there.
    Unchanged,
}

/// The outcome of one case.
#[derive(Debug)]
pub struct CaseResult {
    /// The case.
    pub case: Case,
    /// Every failure; empty when the case passed.
    pub failures: Vec<Failure>,
    /// Largest |output − oracle| over all devices, when the run produced output.
    pub max_error: Option<f64>,
    /// Wall time of the backend's run.
    pub elapsed: Option<Duration>,
    /// What happened to the golden.
    pub golden: GoldenStatus,
}

impl From<CaseError> for Failure {
    fn from(e: CaseError) -> Self {
        match e {
            CaseError::Problem(e) => Failure::Problem(e),
            CaseError::Algorithm(e) => Failure::Algorithm(e),
            CaseError::Mesh(e) => Failure::Mesh(e),
            CaseError::Linear(e) => Failure::Linear(e.to_string()),
            CaseError::LinearPlan(e) => Failure::Linear(e),
            CaseError::Attention(e) => Failure::Attention(e.to_string()),
            CaseError::AttentionPlan(e) => Failure::Attention(e),
            CaseError::Moe(e) => Failure::Moe(e),
        }
    }
}

impl CaseResult {
    fn new(case: &Case) -> Self {
        CaseResult {
            case: case.clone(),
            failures: Vec::new(),
            max_error: None,
            elapsed: None,
            golden: GoldenStatus::NotChecked,
        }
    }

    /// Whether the case passed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// The failures as one line.
    pub fn reason(&self) -> String {
        self.failures.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    }
}

/// Builds the case's plan and checks it in the default order (see [`check_case`]).
pub fn run_case(case: &Case, backend: &dyn Backend, goldens: &Goldens) -> CaseResult {
    run_case_keeping_memory(case, backend, goldens, 1).0
}

/// [`run_case`], also returning the plan and the memory when the backend ran.
pub(crate) fn run_case_keeping_memory(
    case: &Case,
    backend: &dyn Backend,
    goldens: &Goldens,
    schedules: usize,
) -> (CaseResult, Option<(Plan, Memory)>) {
    let plan = case.plan().map_err(Failure::from);
    match plan {
        Ok(plan) => {
            let (result, memory) = check_case_keeping_memory(case, &plan, backend, Some(goldens), schedules);
            (result, memory.map(|m| (plan, m)))
        }
        Err(failure) => {
            let mut result = CaseResult::new(case);
            result.failures.push(failure);
            (result, None)
        }
    }
}

/// Runs `plan` (normally the case's own plan; tests pass broken ones) on `backend` and
/// compares the output with the oracle and the golden of `case`. Never panics on a
/// bad plan or a failing backend: every problem is a [`Failure`] in the result.
pub fn check_case(case: &Case, plan: &Plan, backend: &dyn Backend, goldens: &Goldens) -> CaseResult {
    check_case_keeping_memory(case, plan, backend, Some(goldens), 1).0
}

/// The run of a mutant ([`crate::mutants`]): [`check_case_with`] without goldens,
/// with the case's oracle computed once for all its mutants, and without the verifier
/// (the mutant has passed it already, under the same interleavings); also returns the
/// default-order run's memory.
pub(crate) fn check_mutant_keeping_memory(
    case: &Case,
    plan: &Plan,
    backend: &dyn Backend,
    schedules: usize,
    expected: &[ExpectedOutput],
) -> (CaseResult, Option<Memory>) {
    let mut result = CaseResult::new(case);
    match check_into(&mut result, case, plan, backend, None, schedules, Some(expected)) {
        Ok(memory) => (result, Some(memory)),
        Err(failure) => {
            result.failures.push(failure);
            (result, None)
        }
    }
}

/// [`check_case`] under the first `schedules` interleavings of
/// [`cmm_core::schedule::orders`] (the default order first), and without a golden
/// comparison when `goldens` is `None` (mutants have no golden).
pub fn check_case_with(
    case: &Case,
    plan: &Plan,
    backend: &dyn Backend,
    goldens: Option<&Goldens>,
    schedules: usize,
) -> CaseResult {
    check_case_keeping_memory(case, plan, backend, goldens, schedules).0
}

/// [`check_case_with`], also returning the memory the backend left (each device's
/// buffers, words as in [`cmm_core::cpu::Memory`]) when it ran.
pub fn check_case_keeping_memory(
    case: &Case,
    plan: &Plan,
    backend: &dyn Backend,
    goldens: Option<&Goldens>,
    schedules: usize,
) -> (CaseResult, Option<Memory>) {
    let mut result = CaseResult::new(case);
    match check_into(&mut result, case, plan, backend, goldens, schedules, None) {
        Ok(memory) => (result, Some(memory)),
        Err(failure) => {
            result.failures.push(failure);
            (result, None)
        }
    }
}

/// The check; an `Err` is a failure that stops it before the comparisons. With
/// `prepared` (a mutant's run) the oracle's outputs are given and the verifier, which
/// the mutant has passed, is not replayed.
fn check_into(
    result: &mut CaseResult,
    case: &Case,
    plan: &Plan,
    backend: &dyn Backend,
    goldens: Option<&Goldens>,
    schedules: usize,
    prepared: Option<&[ExpectedOutput]>,
) -> Result<Memory, Failure> {
    crate::case::check_case_name(&case.name).map_err(Failure::Name)?;
    let problem = case.problem()?;
    let workload = problem.workload();
    plan.validate().map_err(|e| Failure::Plan(e.to_string()))?;
    if plan.devices != workload.device_count() {
        return Err(Failure::Plan(format!("the plan has D={}, the case D={}", plan.devices, workload.device_count())));
    }
    if let Some(why) = workload.unsupported_family(case.family) {
        return Err(Failure::Family(why));
    }
    // Refused before the oracle (which can take long on a shape too large to run).
    backend.check_fits(plan)?;
    let elements = plan.elements();
    if elements > MAX_CASE_ELEMENTS {
        return Err(Failure::TooLarge { elements, limit: MAX_CASE_ELEMENTS });
    }
    let cells = Cells::of(plan);
    check_cells(plan, &cells)?;
    let computed;
    let expected: &[ExpectedOutput] = match prepared {
        Some(e) => e,
        None => {
            computed = workload.expected(case.seed, case.family);
            &computed
        }
    };
    let several = expected.len() > 1;
    let label = |e: &ExpectedOutput| several.then(|| e.buffer.clone());
    let mut buffers = Vec::with_capacity(expected.len());
    for e in expected {
        let id = plan
            .buffer_id(&e.buffer)
            .filter(|id| plan.buffer(*id).role.is_result())
            .ok_or_else(|| Failure::Plan(format!("the plan has no output buffer `{}`", e.buffer)))?;
        let decl = plan.buffer(id);
        if (decl.rows, decl.cols, decl.dtype, &decl.device_rows) != (e.rows, e.cols, e.dtype, &e.device_rows) {
            return Err(Failure::Plan(format!(
                "output buffer `{}` is {}[{}x{}], the case needs {}[{}x{}]",
                decl.name,
                decl.dtype,
                cmm_core::plan::rows_text(decl.rows, decl.device_rows.as_deref()),
                decl.cols,
                e.dtype,
                e.rows_text(),
                e.cols
            )));
        }
        buffers.push(id.0);
    }

    // The verifier replays every interleaving before anything runs: a plan that
    // deadlocks or races is reported precisely rather than by its wrong numbers.
    let orders = orders(schedules.max(1), plan.devices);
    // A mutant (`prepared`) has passed the verifier under these orders already.
    let unverified = if prepared.is_some() { &[][..] } else { &orders[..] };
    for &order in unverified {
        let schedule = schedule_with(plan, order).map_err(BackendError::from)?;
        let findings = verify_in(plan, &schedule, &cells)?;
        if !findings.is_empty() {
            let shown: Vec<String> = findings.iter().take(3).map(|f| f.describe(plan)).collect();
            result.failures.push(Failure::Verifier { order, count: findings.len(), findings: shown });
            break;
        }
    }

    let start = Instant::now();
    let memory = backend.run(plan, case.seed, case.family, Order::Default)?;
    result.elapsed = Some(start.elapsed());
    let outputs: Vec<Vec<&[u32]>> =
        expected.iter().zip(&buffers).map(|(e, &id)| output_words(&memory, plan, id, e)).collect::<Result<_, _>>()?;
    for (e, words) in expected.iter().zip(&outputs) {
        if let Some(p) = find_poison(words, e.dtype.poison_bits(), e.cols, label(e)) {
            result.failures.push(p);
            break;
        }
    }
    'orders: for &order in &orders[1..] {
        let other = backend.run(plan, case.seed, case.family, order)?;
        for (e, (words, &id)) in expected.iter().zip(outputs.iter().zip(&buffers)) {
            let other_words = output_words(&other, plan, id, e)?;
            if let Some(f) = schedule_difference(words, &other_words, order, e, label(e)) {
                result.failures.push(f);
                break 'orders;
            }
        }
    }

    let got: Vec<Vec<Vec<f64>>> = expected
        .iter()
        .zip(&outputs)
        .map(|(e, words)| words.iter().map(|w| w.iter().map(|&b| e.dtype.decode(b) as f64).collect()).collect())
        .collect();
    result.max_error = Some(got.iter().zip(expected).map(|(g, e)| max_error(g, &e.values)).fold(0.0, f64::max));

    let mut oracle_ok = true;
    for ((e, words), g) in expected.iter().zip(&outputs).zip(&got) {
        let rule = match case.family {
            Family::Exact => {
                Rule::Bits(e.values.iter().map(|d| d.iter().map(|&v| e.dtype.encode(v as f32)).collect()).collect())
            }
            Family::Realistic => Rule::Within(e.tolerance),
        };
        if let Some(m) = compare(words, g, &e.values, &rule, e, label(e)) {
            oracle_ok = false;
            result.failures.push(Failure::Oracle(m));
        }
    }

    let run = Run { case, expected, outputs: &outputs, got: &got };
    if let Some(goldens) = goldens {
        let golden = if goldens.bless {
            bless(result, goldens, &run, oracle_ok && result.failures.is_empty())
        } else {
            compare_golden(result, goldens, &run, backend.given_outputs())
        };
        result.failures.extend(golden.err());
    }
    Ok(memory)
}

/// The first output element still holding the poison pattern: memory no op wrote.
fn find_poison(outputs: &[&[u32]], poison: u32, cols: usize, output: Option<String>) -> Option<Failure> {
    outputs.iter().enumerate().find_map(|(device, words)| {
        let count = words.iter().filter(|&&w| w == poison).count();
        words.iter().position(|&w| w == poison).map(|i| Failure::Poison {
            output: output.clone(),
            device,
            row: i / cols,
            col: i % cols,
            count,
        })
    })
}

/// The first element where a run under `order` differs from the default-order run.
fn schedule_difference(
    first: &[&[u32]],
    other: &[&[u32]],
    order: Order,
    e: &ExpectedOutput,
    output: Option<String>,
) -> Option<Failure> {
    first.iter().zip(other).enumerate().find_map(|(device, (a, b))| {
        a.iter().zip(b.iter()).position(|(x, y)| x != y).map(|i| Failure::ScheduleDependent {
            output: output.clone(),
            order,
            device,
            row: i / e.cols,
            col: i % e.cols,
            default_value: e.dtype.decode(a[i]) as f64,
            other_value: e.dtype.decode(b[i]) as f64,
        })
    })
}

/// What one run produced, for the golden stage.
struct Run<'a> {
    case: &'a Case,
    expected: &'a [ExpectedOutput],
    /// Per output, each device's words.
    outputs: &'a [Vec<&'a [u32]>],
    /// The same, decoded.
    got: &'a [Vec<Vec<f64>>],
}

impl Run<'_> {
    fn shapes(&self) -> Vec<golden::OutputShape> {
        self.expected
            .iter()
            .map(|e| golden::OutputShape {
                buffer: e.buffer.clone(),
                dtype: e.dtype,
                rows: e.rows,
                device_rows: e.device_rows.clone(),
                cols: e.cols,
            })
            .collect()
    }
}

/// Writes the golden of a run that passed the oracle check.
fn bless(result: &mut CaseResult, goldens: &Goldens, run: &Run, oracle_ok: bool) -> Result<(), Failure> {
    if !oracle_ok {
        return Ok(());
    }
    let mut payload = Vec::new();
    for (e, words) in run.expected.iter().zip(run.outputs) {
        for &w in words.iter().copied().flatten() {
            e.dtype.push_le_bytes(w, &mut payload);
        }
    }
    let bytes = golden::encode(run.case, &run.shapes(), &payload);
    let path = goldens.path(run.case);
    let io = |source| Failure::GoldenIo { path: path.clone(), source };
    let old = match golden::read(&path, run.case, &run.shapes()) {
        Ok(old) => Some(old),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(io(e)),
    };
    result.golden = match old {
        Some(old) if old == bytes => GoldenStatus::Unchanged,
        old => {
            fs::create_dir_all(&goldens.dir).map_err(io)?;
            fs::write(&path, &bytes).map_err(io)?;
            if old.is_some() {
                GoldenStatus::Updated
            } else {
                GoldenStatus::Created
            }
        }
    };
    Ok(())
}

/// Compares a run with the case's golden.
fn compare_golden(result: &mut CaseResult, goldens: &Goldens, run: &Run, given_outputs: bool) -> Result<(), Failure> {
    let case = run.case;
    let path = goldens.path(case);
    let bytes = match golden::read(&path, case, &run.shapes()) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Failure::GoldenMissing { path }),
        Err(source) => return Err(Failure::GoldenIo { path, source }),
    };
    let stored = golden::decode(&bytes, case, &run.shapes())
        .map_err(|source| Failure::GoldenInvalid { path: path.clone(), source })?;
    result.golden = GoldenStatus::Compared;
    let several = run.expected.len() > 1;
    let mut at = 0usize;
    for ((e, words), got) in run.expected.iter().zip(run.outputs).zip(run.got) {
        // Each device's elements follow the previous device's.
        let mut golden_bits: Vec<Vec<u32>> = Vec::with_capacity(case.devices());
        for d in 0..case.devices() {
            let len = e.len_on(d);
            golden_bits.push((0..len).map(|i| e.dtype.read_le_bits(&stored[at..], i)).collect());
            at += len * e.dtype.size_bytes();
        }
        let golden_values: Vec<Vec<f64>> =
            golden_bits.iter().map(|d| d.iter().map(|&b| e.dtype.decode(b) as f64).collect()).collect();
        let t = e.tolerance;
        let rule = match case.family {
            Family::Exact => Rule::Bits(golden_bits),
            Family::Realistic => Rule::Within(Tolerance {
                rounding: 2.0 * t.rounding,
                accumulation: 2.0 * t.accumulation,
                floor: 2.0 * t.floor,
            }),
        };
        let output = several.then(|| e.buffer.clone());
        result.failures.extend(
            compare(words, got, &golden_values, &rule, e, output)
                .map(|mismatch| Failure::Golden { mismatch, given_outputs }),
        );
    }
    Ok(())
}

/// Each device's words of buffer `out` (its own rows of an uneven shard), after checking
/// the memory has the plan's shape: the whole buffer, or (outputs given by a user) just
/// the device's rows.
fn output_words<'m>(
    memory: &'m Memory,
    plan: &Plan,
    out: usize,
    e: &ExpectedOutput,
) -> Result<Vec<&'m [u32]>, Failure> {
    if memory.len() != plan.devices {
        return Err(Failure::Memory(format!("{} devices' memory, the plan has {}", memory.len(), plan.devices)));
    }
    let whole = plan.buffers[out].len();
    memory
        .iter()
        .enumerate()
        .map(|(d, buffers)| match buffers.get(out) {
            Some(words) if words.len() == whole || words.len() == e.len_on(d) => Ok(&words[..e.len_on(d)]),
            Some(words) => Err(Failure::Memory(format!(
                "{} words for device {d}'s output buffer `{}`, expected {}",
                words.len(),
                plan.buffers[out].name,
                e.len_on(d)
            ))),
            None => Err(Failure::Memory(format!(
                "{} buffers for device {d}, the plan has {}",
                buffers.len(),
                plan.buffers.len()
            ))),
        })
        .collect()
}

fn max_error(got: &[Vec<f64>], want: &[Vec<f64>]) -> f64 {
    got.iter()
        .flatten()
        .zip(want.iter().flatten())
        .map(|(g, w)| if g.is_nan() || w.is_nan() { f64::INFINITY } else { (g - w).abs() })
        .fold(0.0, f64::max)
}

/// How an element passes.
enum Rule {
    /// Its bits equal these (`[device][element]`).
    Bits(Vec<Vec<u32>>),
    /// Its value is within this tolerance, scaled by the oracle's magnitudes.
    Within(Tolerance),
}

/// Compares every device's copy of one output; `None` when all elements pass, else the
/// worst one.
fn compare(
    words: &[&[u32]],
    got: &[Vec<f64>],
    want: &[Vec<f64>],
    rule: &Rule,
    oracle: &ExpectedOutput,
    output: Option<String>,
) -> Option<Mismatch> {
    let cols = oracle.cols;
    let total = got.iter().map(Vec::len).sum();
    let mut count = 0;
    // (score, mismatch): the worst is the largest error (relative to the allowance).
    let mut worst: Option<(f64, Mismatch)> = None;
    for (device, (g, w)) in got.iter().zip(want).enumerate() {
        let candidate = match rule {
            Rule::Bits(bits) => {
                let mut local: Option<(f64, usize)> = None;
                for (i, (&word, &bit)) in words[device].iter().zip(&bits[device]).enumerate() {
                    if word != bit {
                        count += 1;
                        let error = if g[i].is_nan() || w[i].is_nan() { f64::INFINITY } else { (g[i] - w[i]).abs() };
                        if local.is_none_or(|(e, _)| error > e) {
                            local = Some((error, i));
                        }
                    }
                }
                local.map(|(error, i)| (error, i, None))
            }
            Rule::Within(tolerance) => {
                let mags = &oracle.magnitudes[device];
                let (ok, worst) = tolerance.compare(g, w, mags);
                if ok {
                    None
                } else {
                    count += (0..g.len()).filter(|&i| !tolerance.accepts(g[i], w[i], mags[i])).count();
                    worst.map(|x| (x.error / x.allowed.max(f64::MIN_POSITIVE), x.index, Some(x.allowed)))
                }
            }
        };
        if let Some((score, index, allowed)) = candidate {
            if worst.as_ref().is_none_or(|(s, _)| score > *s) {
                let (row, col) = (index / cols, index % cols);
                let global = oracle.windows.get(device).map(|w| (w.row0 + row, w.col0 + col));
                let mismatch = Mismatch {
                    output: output.clone(),
                    device,
                    row,
                    col,
                    global,
                    got: g[index],
                    expected: w[index],
                    allowed,
                    count: 0,
                    total,
                };
                worst = Some((score, mismatch));
            }
        }
    }
    worst.map(|(_, m)| Mismatch { count, ..m })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatch_text_names_device_row_col_and_values() {
        let m = Mismatch {
            output: None,
            device: 2,
            row: 5,
            col: 3,
            global: None,
            got: 12.0,
            expected: 14.0,
            allowed: None,
            count: 7,
            total: 64,
        };
        assert_eq!(
            m.to_string(),
            "dev 2 (row 5, col 3 of its output) got 12 expected 14; 7 of 64 elements differ (bit-exact)"
        );
        let m = Mismatch { allowed: Some(1e-3), got: 0.5, expected: 0.25, ..m };
        assert!(m.to_string().contains("|error| 2.500e-1 > allowed 1.000e-3"), "{m}");
        let m = Mismatch { output: Some("main_grad".into()), ..m };
        assert!(m.to_string().starts_with("main_grad dev 2 (row 5, col 3 of its output)"), "{m}");
        let m = Mismatch { global: Some((37, 3)), ..m };
        assert!(m.to_string().contains("dev 2 (row 5, col 3 of its output; global row 37, col 3) got"), "{m}");
    }
}
