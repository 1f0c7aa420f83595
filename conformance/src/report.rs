//! Machine-readable reports of a corpus run (`--report FILE`): JSON for a `.json` file,
//! JUnit XML for a `.xml` file (one test case per corpus case, as CI systems read it).

use std::fs;
use std::path::{Path, PathBuf};

use quick_xml::events::{BytesDecl, BytesEnd, BytesStart, BytesText, Event};
use quick_xml::Writer;
use serde::Serialize;
use thiserror::Error;

use crate::check::CaseResult;

/// One case of a report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CaseRecord {
    /// Case name.
    pub name: String,
    /// The op as printed in the text report.
    pub op: String,
    /// The algorithm as printed.
    pub algorithm: String,
    /// The devices as printed (`4`, `2x4`, `4·mb2`).
    pub devices: String,
    /// `MxNxK` of the case file.
    pub shape: String,
    /// Input and output dtypes, `bf16->f32`.
    pub dtype: String,
    /// `exact` or `realistic`.
    pub family: String,
    /// Whether it passed.
    pub passed: bool,
    /// Wall time of the backend's run, in milliseconds.
    pub time_ms: Option<f64>,
    /// Largest |output − oracle|.
    pub max_error: Option<f64>,
    /// Why it failed (empty when it passed).
    pub reason: String,
}

impl CaseRecord {
    /// The record of a checked case.
    pub fn of(result: &CaseResult) -> CaseRecord {
        let c = &result.case;
        CaseRecord {
            name: c.name.clone(),
            op: c.op_label(),
            algorithm: c.algorithm_label(),
            devices: c.devices_label(),
            shape: format!("{}x{}x{}", c.m, c.n, c.k),
            dtype: format!("{}->{}", c.input, c.output),
            family: c.family.to_string(),
            passed: result.passed(),
            time_ms: result.elapsed.map(|d| d.as_secs_f64() * 1e3),
            max_error: result.max_error,
            reason: if result.passed() { String::new() } else { result.reason() },
        }
    }
}

/// The JSON report.
#[derive(Serialize)]
struct JsonReport<'a> {
    format: &'static str,
    backend: &'a str,
    passed: usize,
    failed: usize,
    cases: &'a [CaseRecord],
}

/// Why a report could not be written.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ReportError {
    /// The file name ends in neither `.json` nor `.xml`.
    #[error("report file {0} must end in .json (JSON) or .xml (JUnit XML)")]
    Format(PathBuf),
    /// The report would replace or land among the run's own inputs or goldens.
    #[error("report file {path} would overwrite {what} {protected}: choose a path outside it")]
    Protected {
        /// The report's path.
        path: PathBuf,
        /// What it would overwrite.
        what: String,
        /// The file or directory.
        protected: PathBuf,
    },
    /// Encoding failed.
    #[error("encoding the report {path}: {detail}")]
    Encode {
        /// The file.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
    /// Writing failed.
    #[error("writing the report {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// What a report must not overwrite: the run's inputs and goldens, each a file or a
/// directory (everything under it), with the words that name it.
pub type Protected<'a> = [(&'a str, &'a Path)];

/// The absolute form of `path` with its existing part resolved (symbolic links, `..`),
/// so that two spellings of one file compare equal.
fn resolved(path: &Path) -> PathBuf {
    if let Ok(real) = fs::canonicalize(path) {
        return real;
    }
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => {
            let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
            resolved(parent).join(name)
        }
        _ => std::env::current_dir().map(|d| d.join(path)).unwrap_or_else(|_| path.to_path_buf()),
    }
}

/// Checks, before a run, that `path` names a format a report can be written in and
/// that it is none of the `protected` files and lies under none of its directories.
pub fn check_report_path(path: &Path, protected: &Protected<'_>) -> Result<(), ReportError> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("json" | "xml") => {}
        _ => return Err(ReportError::Format(path.to_path_buf())),
    }
    let report = resolved(path);
    for (what, p) in protected {
        if report.starts_with(resolved(p)) {
            return Err(ReportError::Protected {
                path: path.to_path_buf(),
                what: what.to_string(),
                protected: p.to_path_buf(),
            });
        }
    }
    Ok(())
}

/// Writes the report of `cases`, run on `backend`, to `path` (`.json` or `.xml`), as a
/// suite named `title` (`cmm check`, `cmm verify`, `cmm conformance`). The file appears
/// whole or not at all: it is written beside its final name and renamed.
pub fn write_report(
    path: &Path,
    title: &str,
    backend: &str,
    cases: &[CaseRecord],
    protected: &Protected<'_>,
) -> Result<(), ReportError> {
    check_report_path(path, protected)?;
    let encode = |detail: String| ReportError::Encode { path: path.to_path_buf(), detail };
    let failed = cases.iter().filter(|c| !c.passed).count();
    let bytes = if path.extension().and_then(|e| e.to_str()) == Some("json") {
        let report =
            JsonReport { format: "cmm-conformance-report v1", backend, passed: cases.len() - failed, failed, cases };
        let mut text = serde_json::to_string_pretty(&report).map_err(|e| encode(e.to_string()))?;
        text.push('\n');
        text.into_bytes()
    } else {
        junit(title, backend, cases, failed).map_err(|e| encode(e.to_string()))?
    };
    let io = |source| ReportError::Io { path: path.to_path_buf(), source };
    let name = path.file_name().ok_or_else(|| ReportError::Format(path.to_path_buf()))?;
    let mut temporary = name.to_os_string();
    temporary.push(format!(".partial-{}", std::process::id()));
    let temporary = path.with_file_name(temporary);
    fs::write(&temporary, bytes).map_err(io)?;
    fs::rename(&temporary, path).map_err(|e| {
        let _ = fs::remove_file(&temporary);
        io(e)
    })
}

/// JUnit XML: one `<testsuite>` named after the backend, one `<testcase>` per case
/// (classname = the op), a `<failure>` with the reason for each failed case.
fn junit(title: &str, backend: &str, cases: &[CaseRecord], failed: usize) -> Result<Vec<u8>, quick_xml::Error> {
    let mut w = Writer::new_with_indent(Vec::new(), b' ', 2);
    w.write_event(Event::Decl(BytesDecl::new("1.0", Some("UTF-8"), None)))?;
    let total = cases.len().to_string();
    let failures = failed.to_string();
    // Summed from +0: an empty f64 sum is −0, which would print as "-0.000000".
    let seconds = format!("{:.6}", cases.iter().filter_map(|c| c.time_ms).fold(0.0, |t, ms| t + ms) / 1e3);
    let suites = BytesStart::new("testsuites").with_attributes([
        ("name", title),
        ("tests", total.as_str()),
        ("failures", failures.as_str()),
        ("time", seconds.as_str()),
    ]);
    w.write_event(Event::Start(suites))?;
    let suite = BytesStart::new("testsuite").with_attributes([
        ("name", backend),
        ("tests", total.as_str()),
        ("failures", failures.as_str()),
        ("errors", "0"),
        ("skipped", "0"),
        ("time", seconds.as_str()),
    ]);
    w.write_event(Event::Start(suite))?;
    for c in cases {
        let time = format!("{:.6}", c.time_ms.unwrap_or(0.0) / 1e3);
        let case = BytesStart::new("testcase").with_attributes([
            ("name", c.name.as_str()),
            ("classname", c.op.as_str()),
            ("time", time.as_str()),
        ]);
        if c.passed {
            w.write_event(Event::Empty(case))?;
            continue;
        }
        w.write_event(Event::Start(case))?;
        let first_line = c.reason.lines().next().unwrap_or("failed");
        w.write_event(Event::Start(BytesStart::new("failure").with_attributes([("message", first_line)])))?;
        w.write_event(Event::Text(BytesText::new(&c.reason)))?;
        w.write_event(Event::End(BytesEnd::new("failure")))?;
        w.write_event(Event::End(BytesEnd::new("testcase")))?;
    }
    w.write_event(Event::End(BytesEnd::new("testsuite")))?;
    w.write_event(Event::End(BytesEnd::new("testsuites")))?;
    let mut bytes = w.into_inner();
    bytes.push(b'\n');
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quick_xml::events::Event;
    use quick_xml::Reader;

    fn records() -> Vec<CaseRecord> {
        let case = |name: &str, passed: bool, reason: &str| CaseRecord {
            name: name.into(),
            op: "ag_gemm".into(),
            algorithm: "ring".into(),
            devices: "4".into(),
            shape: "8x8x8".into(),
            dtype: "bf16->f32".into(),
            family: "exact".into(),
            passed,
            time_ms: Some(1.5),
            max_error: Some(0.0),
            reason: reason.into(),
        };
        vec![case("a", true, ""), case("b <&> \"q\"", false, "oracle: dev 0 row 1 col 2 got 3 expected 4\nsecond line")]
    }

    #[test]
    fn a_junit_report_parses_with_one_testcase_per_case_and_the_failure() {
        let dir = std::env::temp_dir().join(format!("cmm-report-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.xml");
        write_report(&path, "cmm check", "llvmpipe \"cpu\" <adapter>", &records(), &[]).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        let mut reader = Reader::from_str(&text);
        let (mut testcases, mut failures, mut names, mut failure_text) = (0, 0, Vec::new(), String::new());
        loop {
            match reader.read_event().unwrap() {
                Event::Eof => break,
                Event::Start(e) | Event::Empty(e) if e.name().as_ref() == b"testcase" => {
                    testcases += 1;
                    let name = e.try_get_attribute("name").unwrap().unwrap();
                    names.push(name.unescape_value().unwrap().into_owned());
                }
                Event::Start(e) if e.name().as_ref() == b"failure" => failures += 1,
                Event::Text(t) => failure_text.push_str(&t.unescape().unwrap()),
                _ => {}
            }
        }
        assert_eq!((testcases, failures), (2, 1), "{text}");
        assert_eq!(names, ["a", "b <&> \"q\""]);
        assert!(failure_text.contains("row 1 col 2"), "{text}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_json_report_round_trips_and_other_extensions_are_refused() {
        let dir = std::env::temp_dir().join(format!("cmm-report-json-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.json");
        write_report(&path, "cmm check", "my \"big\" \\ adapter", &records(), &[]).unwrap();
        let v: serde_json::Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["backend"], "my \"big\" \\ adapter");
        assert_eq!((v["passed"].as_u64(), v["failed"].as_u64()), (Some(1), Some(1)));
        assert_eq!(v["cases"][1]["name"], "b <&> \"q\"");
        assert!(matches!(write_report(&dir.join("r.txt"), "t", "x", &records(), &[]), Err(ReportError::Format(_))));
        fs::remove_dir_all(&dir).unwrap();
    }
}
