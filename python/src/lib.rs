//! `cmm._cmm`: the Python package's native half. It calls the library code the `cmm`
//! command calls — cases parsed and planned by `cmm-conformance`, inputs generated and
//! outputs checked by the same runner, plans verified and simulated by `cmm-cli`'s own
//! functions — and hands arrays over as little-endian bytes with their dtype and shape
//! (the Python half, `python/cmm/`, turns them into NumPy arrays and back). Every error
//! becomes a Python exception naming what was wrong; no panic crosses into Python.

mod cuda;

use std::collections::BTreeMap;
use std::path::Path;

use clap::Parser;
use cmm_conformance::{
    check_case_keeping_memory, check_case_with, load_corpus, parse_cases, Backend, Case, CaseResult, CpuTwin, Failure,
    GivenOutputs, Mismatch,
};
use cmm_core::cpu::initial_memory;
use cmm_core::{DType, Family, Plan};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// A Python `ValueError` with `e`'s message and its causes.
fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// The NumPy name of a dtype as cmm hands it over (bf16 as ml_dtypes' `bfloat16`).
fn numpy_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::Bf16 => "bfloat16",
        DType::U32 => "uint32",
        other => other.name(),
    }
}

/// An array handed to Python: (buffer, NumPy dtype, rows, cols, little-endian bytes).
type Array<'py> = (String, &'static str, usize, usize, Bound<'py, PyBytes>);

/// An output's per-device arrays handed to Python: (buffer, NumPy dtype, rows, cols, bytes
/// per device).
type DeviceArrays<'py> = (String, &'static str, usize, usize, Vec<Bound<'py, PyBytes>>);

/// An array handed from Python: (NumPy dtype, little-endian bytes, rows, cols).
type GivenArray = (String, Vec<u8>, usize, usize);

/// An output as `index.json` states it: (buffer, NumPy dtype, rows, cols, layout, rule,
/// tolerance as (rounding, accumulation, floor)).
type OutputFacts = (String, &'static str, usize, usize, String, &'static str, (f64, f64, f64), Option<Vec<usize>>);

/// One case (`cmm.Case` wraps it).
#[pyclass(name = "Case", module = "cmm._cmm", frozen)]
struct PyCase {
    case: Case,
}

impl PyCase {
    fn plan(&self) -> PyResult<Plan> {
        self.case.plan().map_err(|e| value_error(format!("case `{}`: {e}", self.case.name)))
    }
}

/// A mismatch as a dict: device, row and column of its output (and global, when the
/// output is a window of a global matrix), got, expected, allowed, count, total.
fn mismatch_dict<'py>(py: Python<'py>, kind: &str, m: &Mismatch) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("against", kind)?;
    d.set_item("output", m.output.clone())?;
    d.set_item("device", m.device)?;
    d.set_item("row", m.row)?;
    d.set_item("col", m.col)?;
    d.set_item("global_row", m.global.map(|g| g.0))?;
    d.set_item("global_col", m.global.map(|g| g.1))?;
    d.set_item("got", m.got)?;
    d.set_item("expected", m.expected)?;
    d.set_item("allowed", m.allowed)?;
    d.set_item("count", m.count)?;
    d.set_item("total", m.total)?;
    Ok(d)
}

/// A check's result as a dict: ok, reason, the worst element, every failure in words,
/// and the rule applied.
fn result_dict<'py>(py: Python<'py>, result: &CaseResult) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("ok", result.passed())?;
    d.set_item("reason", result.reason())?;
    d.set_item("failures", result.failures.iter().map(|f| f.to_string()).collect::<Vec<_>>())?;
    d.set_item("rule", if result.case.family == Family::Exact { "bits" } else { "within" })?;
    d.set_item("max_error", result.max_error)?;
    let worst = result.failures.iter().find_map(|f| match f {
        Failure::Oracle(m) => Some(("oracle", m)),
        Failure::Golden { mismatch, .. } => Some(("golden", mismatch)),
        _ => None,
    });
    match worst {
        Some((kind, m)) => d.set_item("worst", mismatch_dict(py, kind, m)?)?,
        None => d.set_item("worst", py.None())?,
    }
    Ok(d)
}

#[pymethods]
impl PyCase {
    #[getter]
    fn name(&self) -> String {
        self.case.name.clone()
    }

    #[getter]
    fn op(&self) -> &'static str {
        self.case.op_name()
    }

    #[getter]
    fn algorithm(&self) -> String {
        self.case.algorithm_label()
    }

    #[getter]
    fn devices(&self) -> usize {
        self.case.devices()
    }

    #[getter]
    fn seed(&self) -> u32 {
        self.case.seed
    }

    #[getter]
    fn family(&self) -> String {
        self.case.family.to_string()
    }

    fn __repr__(&self) -> String {
        format!(
            "Case(name={:?}, op={:?}, algorithm={:?}, devices={}, m={}, n={}, k={}, input={:?}, output={:?}, family={:?}, seed={})",
            self.case.name,
            self.case.op_name(),
            self.case.algorithm_label(),
            self.case.devices(),
            self.case.m,
            self.case.n,
            self.case.k,
            self.case.input.name(),
            self.case.output.name(),
            self.case.family.name(),
            self.case.seed
        )
    }

    /// Raises ValueError if the case describes no valid problem or its algorithm cannot
    /// plan it (a case file's loader leaves that to the run, as `cmm golden` does).
    fn validate(&self) -> PyResult<()> {
        self.plan().map(|_| ())
    }

    /// The plan as a plan file (JSON text, format cmm-plan version 1).
    fn plan_json(&self) -> PyResult<String> {
        Ok(self.plan()?.to_file_json())
    }

    /// Per device, every input buffer: (name, NumPy dtype, rows, cols, little-endian bytes).
    fn inputs<'py>(&self, py: Python<'py>) -> PyResult<Vec<Vec<Array<'py>>>> {
        let plan = self.plan()?;
        let memory = initial_memory(&plan, self.case.seed, self.case.family);
        Ok(memory
            .iter()
            .enumerate()
            .map(|(d, buffers)| {
                plan.buffers
                    .iter()
                    .zip(buffers)
                    .filter(|(b, _)| b.role.initialized())
                    .map(|(b, words)| {
                        // An uneven shard: the device's own rows.
                        (
                            b.name.clone(),
                            numpy_name(b.dtype),
                            b.rows_on(d),
                            b.cols,
                            PyBytes::new(py, &b.dtype.le_bytes(&words[..b.len_on(d)])),
                        )
                    })
                    .collect()
            })
            .collect())
    }

    /// Every output: (buffer, NumPy dtype, rows, cols, layout, rule, tolerance as
    /// (rounding, accumulation, floor), each device's rows when they differ), as
    /// `index.json` states them.
    fn expected(&self) -> PyResult<Vec<OutputFacts>> {
        let problem = self.case.problem().map_err(value_error)?;
        let rule = if self.case.family == Family::Exact { "bits" } else { "within" };
        Ok(problem
            .workload()
            .expected(self.case.seed, self.case.family)
            .into_iter()
            .map(|e| {
                let t = e.tolerance;
                let tolerance = (t.rounding, t.accumulation, t.floor);
                (e.buffer, numpy_name(e.dtype), e.rows, e.cols, e.layout, rule, tolerance, e.device_rows)
            })
            .collect())
    }

    /// Runs the case on `backend` ("reference" or "cpu"), checks it against the f64
    /// oracle as `cmm golden` does, and returns every output: (buffer, NumPy dtype,
    /// rows, cols, per-device bytes). A run that fails its check raises ValueError.
    fn golden<'py>(&self, py: Python<'py>, backend: &str) -> PyResult<Vec<DeviceArrays<'py>>> {
        let plan = self.plan()?;
        let reference;
        let runner: &dyn Backend = match backend {
            "cpu" => &CpuTwin,
            "reference" => {
                reference = cmm_reference::Reference::new().map_err(|e| {
                    PyRuntimeError::new_err(format!(
                        "cannot start the wgpu reference ({e}); backend=\"cpu\" runs the CPU twin, which gives the same bits"
                    ))
                })?;
                &reference
            }
            other => return Err(value_error(format!("backend `{other}`: expected \"reference\" or \"cpu\""))),
        };
        let (result, memory) = check_case_keeping_memory(&self.case, &plan, runner, None, 1);
        let memory = match memory {
            Some(m) if result.passed() => m,
            _ => {
                return Err(value_error(format!("case `{}` failed on {backend}: {}", self.case.name, result.reason())))
            }
        };
        let problem = self.case.problem().map_err(value_error)?;
        let mut outputs = Vec::new();
        for e in problem.workload().expected(self.case.seed, self.case.family) {
            let id = plan.buffer_id(&e.buffer).ok_or_else(|| value_error(format!("no output `{}`", e.buffer)))?;
            let per_device = (memory.iter().enumerate())
                .map(|(d, bufs)| PyBytes::new(py, &e.dtype.le_bytes(&bufs[id.0][..e.len_on(d)])))
                .collect();
            outputs.push((e.buffer, numpy_name(e.dtype), e.rows, e.cols, per_device));
        }
        Ok(outputs)
    }

    /// Checks outputs computed elsewhere against the f64 oracle by the project's rules:
    /// `outputs` maps each output buffer to its per-device arrays as (NumPy dtype name,
    /// bytes, rows, cols). Returns the result as a dict.
    fn check<'py>(&self, py: Python<'py>, outputs: BTreeMap<String, Vec<GivenArray>>) -> PyResult<Bound<'py, PyDict>> {
        let plan = self.plan()?;
        let mut given = GivenOutputs::default();
        for (name, arrays) in outputs {
            let id = plan.buffer_id(&name).filter(|id| plan.buffer(*id).role.is_result()).ok_or_else(|| {
                let names: Vec<&str> =
                    plan.buffers.iter().filter(|b| b.role.is_result()).map(|b| b.name.as_str()).collect();
                value_error(format!(
                    "case `{}` has no output `{name}` (its outputs: {})",
                    self.case.name,
                    names.join(", ")
                ))
            })?;
            let decl = plan.buffer(id);
            if arrays.len() != plan.devices {
                return Err(value_error(format!(
                    "output `{name}`: {} arrays given, the case has {} devices",
                    arrays.len(),
                    plan.devices
                )));
            }
            let mut words = Vec::with_capacity(arrays.len());
            for (device, (dtype, bytes, rows, cols)) in arrays.iter().enumerate() {
                if (*rows, *cols) != (decl.rows_on(device), decl.cols) {
                    return Err(value_error(format!(
                        "output `{name}` of device {device} has shape ({rows}, {cols}); the case's is ({}, {})",
                        decl.rows_on(device),
                        decl.cols
                    )));
                }
                let descr = match dtype.as_str() {
                    "float32" => "<f4",
                    "float16" => "<f2",
                    "uint32" => "<u4",
                    "bfloat16" => "bfloat16",
                    other => {
                        return Err(value_error(format!(
                            "output `{name}` of device {device} is {other}; the output is {} (give float32, float16, bfloat16 or uint32)",
                            decl.dtype
                        )))
                    }
                };
                let device_words = cmm_conformance::npy::words_from_elements(bytes, descr, decl.dtype, *rows, *cols)
                    .map_err(|e| value_error(format!("output `{name}` of device {device}: {e}")))?;
                words.push(device_words);
            }
            given.buffers.insert(name, words);
        }
        let result = py.detach(|| check_case_with(&self.case, &plan, &given, None, 1));
        result_dict(py, &result)
    }
}

/// The cases of a case file's text (`path` names it in errors).
#[pyfunction]
fn parse_case_text(text: &str, path: &str) -> PyResult<Vec<PyCase>> {
    let cases = parse_cases(text, Path::new(path)).map_err(value_error)?;
    Ok(cases.into_iter().map(|case| PyCase { case }).collect())
}

/// The cases of a case file, or of every `*.toml` in a directory.
#[pyfunction]
fn load_cases(path: &str) -> PyResult<Vec<PyCase>> {
    let p = Path::new(path);
    let cases = if p.is_dir() {
        load_corpus(p).map_err(value_error)?
    } else {
        let text = std::fs::read_to_string(p).map_err(|e| value_error(format!("reading {path}: {e}")))?;
        parse_cases(&text, p).map_err(value_error)?
    };
    Ok(cases.into_iter().map(|case| PyCase { case }).collect())
}

/// The corpus shipped with the source tree this module was built from.
#[pyfunction]
fn corpus() -> PyResult<Vec<PyCase>> {
    let cases = load_corpus(&cmm_conformance::cases_dir()).map_err(value_error)?;
    Ok(cases.into_iter().map(|case| PyCase { case }).collect())
}

/// Verifies a plan file's text under `schedules` interleavings: (the lines `cmm verify`
/// prints, the findings in words).
#[pyfunction]
fn verify(py: Python<'_>, plan_json: &str, schedules: i64) -> PyResult<(Vec<String>, Vec<String>)> {
    let schedules = cmm_cli::verify::schedule_count(schedules.into()).map_err(value_error)?;
    let plan = Plan::from_file_json(plan_json).map_err(value_error)?;
    let v = py.detach(|| cmm_cli::verify::verify_plan(&plan, schedules)).map_err(value_error)?;
    let findings = v.records.iter().filter(|r| !r.passed).map(|r| r.reason.clone()).collect();
    Ok((v.lines, findings))
}

#[derive(Parser)]
struct SimulateCommand {
    #[command(flatten)]
    args: cmm_cli::simulate::Args,
}

#[derive(Parser)]
struct TuneCommand {
    #[command(flatten)]
    args: cmm_cli::tune::Args,
}

/// Runs `f` and returns the one JSON object it emits (as `--json` prints it).
fn captured_json(py: Python<'_>, f: impl FnOnce() -> anyhow::Result<()> + Send) -> PyResult<String> {
    let (result, values) = py.detach(|| cmm_cli::output::capture_json(f));
    result.map_err(|e| value_error(cmm_cli::describe_error(&e)))?;
    match values.as_slice() {
        [one] => Ok(one.to_string()),
        other => Err(PyRuntimeError::new_err(format!("expected one JSON object, got {}", other.len()))),
    }
}

/// The command `name`'s arguments parsed from `argv` as the CLI parses them (the keywords
/// of `cmm.simulate` and `cmm.tune` as `--keyword=value`); a bad one is a `ValueError`
/// in the caller's words ([`keyword_words`]).
fn parse_command<C: Parser>(name: &str, argv: Vec<String>) -> PyResult<C> {
    C::try_parse_from(std::iter::once(name.to_string()).chain(argv)).map_err(|e| value_error(keyword_words(name, &e)))
}

/// clap's message for a bad flag, said of the keyword a Python caller passed: its first
/// line, each `'--flag-name <VALUE>'` as `` `flag_name` ``, without the usage line and the
/// pointer to `--help`, which belong to the command line.
fn keyword_words(command: &str, error: &clap::Error) -> String {
    let text = error.to_string();
    let first = text.lines().next().unwrap_or_default().trim_start_matches("error: ");
    let (mut said, mut names) = (String::new(), Vec::new());
    let mut rest = first;
    while let Some(at) = rest.find("'--") {
        said.push_str(&rest[..at]);
        let flag = &rest[at + 3..];
        let end = flag.find('\'').unwrap_or(flag.len());
        let name = flag[..end].split([' ', '=']).next().unwrap_or_default().replace('-', "_");
        said.push_str(&format!("`{name}`"));
        names.push(name);
        rest = flag.get(end + 1..).unwrap_or_default();
    }
    said.push_str(rest);
    match (error.kind(), names.as_slice()) {
        (clap::error::ErrorKind::UnknownArgument, [name]) => format!("{command} takes no keyword `{name}`"),
        _ => format!("{command}: {said}"),
    }
}

/// `cmm simulate … --json` with these arguments (flags as the command takes them).
#[pyfunction]
fn simulate(py: Python<'_>, argv: Vec<String>) -> PyResult<String> {
    let command: SimulateCommand = parse_command("simulate", argv)?;
    captured_json(py, move || cmm_cli::simulate::run(&command.args))
}

/// `cmm simulate PLAN … --json` for a plan file's text, with these other arguments.
#[pyfunction]
fn simulate_plan(py: Python<'_>, plan_json: String, argv: Vec<String>) -> PyResult<String> {
    let command: SimulateCommand = parse_command("simulate", argv)?;
    captured_json(py, move || cmm_cli::simulate::plan_text(&command.args, &plan_json, "the plan"))
}

/// `cmm tune … --json` with these arguments.
#[pyfunction]
fn tune(py: Python<'_>, argv: Vec<String>) -> PyResult<String> {
    let command: TuneCommand = parse_command("tune", argv)?;
    captured_json(py, move || cmm_cli::tune::run(&command.args))
}

#[pymodule]
fn _cmm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCase>()?;
    m.add_function(wrap_pyfunction!(parse_case_text, m)?)?;
    m.add_function(wrap_pyfunction!(load_cases, m)?)?;
    m.add_function(wrap_pyfunction!(corpus, m)?)?;
    m.add_function(wrap_pyfunction!(verify, m)?)?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(simulate_plan, m)?)?;
    m.add_function(wrap_pyfunction!(tune, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_run, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_describe, m)?)?;
    m.add_class::<cuda::PyDeviceBuffer>()?;
    Ok(())
}
