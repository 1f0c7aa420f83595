//! The corpus: `cases/*.toml`, each a list of `[[case]]` tables.
//!
//! ```toml
//! [[case]]
//! name = "ag_gemm_ring_d4_bf16_f32_exact"
//! op = "ag_gemm"            # ag_gemm | gemm_rs | gemm_ar
//! algorithm = "ring"        # baseline | ring | ring_bidir | ring_chunked
//! chunks = 2                # only with ring_chunked
//! devices = 4
//! m = 96                    # global GEMM C = A·B: A is M×K, B is K×N
//! n = 32
//! k = 256
//! input = "bf16"            # f32 | f16 | bf16
//! output = "f32"            # f32 or the input dtype
//! family = "exact"          # exact | realistic
//! seed = 7
//! ```
//!
//! Loading checks the syntax, the field types and that names are unique and usable as
//! file names; whether a case describes a valid problem is checked when it runs, so an
//! invalid case is a failed row rather than a refusal to run the rest.

use std::fs;
use std::path::{Path, PathBuf};

use cmm_core::{Algorithm, AlgorithmError, DType, Family, OpKind, Problem, ProblemError};
use serde::Deserialize;
use thiserror::Error;

/// One conformance case.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// Unique name; also the golden's file name (`golden/<name>.bin`).
    pub name: String,
    /// The operation.
    pub op: OpKind,
    /// Algorithm name (`baseline`, `ring`, `ring_bidir`, `ring_chunked`).
    pub algorithm: String,
    /// Chunks per shard, for `ring_chunked` only.
    #[serde(default)]
    pub chunks: Option<usize>,
    /// Device count D.
    pub devices: usize,
    /// Global M.
    pub m: usize,
    /// Global N.
    pub n: usize,
    /// Global K.
    pub k: usize,
    /// Input dtype.
    pub input: DType,
    /// Output dtype.
    pub output: DType,
    /// Input family.
    pub family: Family,
    /// Generator seed.
    pub seed: u32,
}

impl Case {
    /// The validated problem the case describes.
    pub fn problem(&self) -> Result<Problem, ProblemError> {
        Problem::new(self.op, self.devices, self.m, self.n, self.k, self.input, self.output)
    }

    /// The algorithm the case names, with its parameters.
    pub fn algorithm(&self) -> Result<Algorithm, AlgorithmError> {
        Algorithm::parse(&self.algorithm, self.chunks)
    }

    /// The algorithm as printed in reports: `ring_chunked(c=2)`, or the name as written
    /// when it does not parse.
    pub fn algorithm_label(&self) -> String {
        self.algorithm().map_or_else(|_| self.algorithm.clone(), |a| a.to_string())
    }
}

/// Why the corpus cannot be loaded.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CorpusError {
    /// A directory or file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A case file is not valid TOML or has keys other than `case`.
    #[error("{}: {message}", path.display())]
    File {
        /// The case file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// One `[[case]]` table is malformed.
    #[error("{}: case #{index}{}: {message}", path.display(), name.as_ref().map(|n| format!(" `{n}`")).unwrap_or_default())]
    Case {
        /// The case file.
        path: PathBuf,
        /// Position of the case in its file, from 1.
        index: usize,
        /// The case's name, when it has one.
        name: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// Two cases share a name.
    #[error("case `{name}` is defined twice: in {} and in {}", first.display(), second.display())]
    DuplicateName {
        /// The name.
        name: String,
        /// File of the first definition.
        first: PathBuf,
        /// File of the second definition.
        second: PathBuf,
    },
    /// The directory holds no case at all.
    #[error("no case found in {}/*.toml", dir.display())]
    Empty {
        /// The corpus directory.
        dir: PathBuf,
    },
}

/// The corpus directory of this crate (`conformance/cases`).
pub fn cases_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("cases")
}

/// Loads every case of `dir/*.toml`, files in name order, cases in file order.
pub fn load_corpus(dir: &Path) -> Result<Vec<Case>, CorpusError> {
    let io = |source| CorpusError::Io { path: dir.to_path_buf(), source };
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.extension().is_some_and(|e| e == "toml") {
            files.push(path);
        }
    }
    files.sort();
    let mut cases: Vec<(Case, PathBuf)> = Vec::new();
    for path in files {
        let text = fs::read_to_string(&path).map_err(|source| CorpusError::Io { path: path.clone(), source })?;
        for case in parse_cases(&text, &path)? {
            if let Some((_, first)) = cases.iter().find(|(c, _)| c.name == case.name) {
                return Err(CorpusError::DuplicateName { name: case.name, first: first.clone(), second: path.clone() });
            }
            cases.push((case, path.clone()));
        }
    }
    if cases.is_empty() {
        return Err(CorpusError::Empty { dir: dir.to_path_buf() });
    }
    Ok(cases.into_iter().map(|(c, _)| c).collect())
}

/// Parses the text of one case file; `path` is only used in errors.
pub fn parse_cases(text: &str, path: &Path) -> Result<Vec<Case>, CorpusError> {
    let file_error = |message: String| CorpusError::File { path: path.to_path_buf(), message };
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| file_error(e.to_string()))?;
    if let Some(key) = table.keys().find(|k| *k != "case") {
        return Err(file_error(format!("unexpected top-level key `{key}` (a case file holds only [[case]] tables)")));
    }
    let Some(list) = table.get("case") else {
        return Ok(Vec::new());
    };
    let list = list.as_array().ok_or_else(|| file_error("`case` must be an array of tables ([[case]])".into()))?;
    let mut cases = Vec::with_capacity(list.len());
    for (i, value) in list.iter().enumerate() {
        let name = value.get("name").and_then(|v| v.as_str()).map(str::to_string);
        let case_error =
            |message: String| CorpusError::Case { path: path.to_path_buf(), index: i + 1, name: name.clone(), message };
        let case: Case =
            value.clone().try_into().map_err(|e: toml::de::Error| case_error(e.message().trim().to_string()))?;
        if case.name.is_empty() || !case.name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        {
            return Err(case_error(
                "the name must be non-empty and use only ASCII letters, digits, `_`, `-` and `.` \
                 (it names the golden file)"
                    .into(),
            ));
        }
        cases.push(case);
    }
    Ok(cases)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[[case]]
name = "a"
op = "ag_gemm"
algorithm = "ring_chunked"
chunks = 2
devices = 2
m = 8
n = 4
k = 3
input = "bf16"
output = "f32"
family = "exact"
seed = 1
"#;

    #[test]
    fn parses_a_case() {
        let cases = parse_cases(GOOD, Path::new("x.toml")).unwrap();
        assert_eq!(cases.len(), 1);
        let c = &cases[0];
        assert_eq!((c.op, c.devices, c.input, c.family), (OpKind::AgGemm, 2, DType::Bf16, Family::Exact));
        assert_eq!(c.algorithm().unwrap(), Algorithm::RingChunked { chunks: 2 });
        assert_eq!(c.algorithm_label(), "ring_chunked(c=2)");
        assert!(c.problem().is_ok());
    }

    #[test]
    fn errors_name_the_file_and_the_case() {
        let bad = GOOD.replace("\"bf16\"", "\"bf17\"");
        let e = parse_cases(&bad, Path::new("dir/x.toml")).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, CorpusError::Case { index: 1, .. }), "{text}");
        assert!(text.contains("dir/x.toml") && text.contains("`a`") && text.contains("bf17"), "{text}");

        let unknown = GOOD.replace("seed = 1", "seed = 1\nsed = 2");
        let text = parse_cases(&unknown, Path::new("x.toml")).unwrap_err().to_string();
        assert!(text.contains("sed"), "{text}");

        let missing = GOOD.replace("m = 8\n", "");
        let text = parse_cases(&missing, Path::new("x.toml")).unwrap_err().to_string();
        assert!(text.contains("missing field `m`"), "{text}");

        let text = parse_cases("[[case]\n", Path::new("y.toml")).unwrap_err().to_string();
        assert!(text.starts_with("y.toml:"), "{text}");

        let text = parse_cases("cases = 1\n", Path::new("y.toml")).unwrap_err().to_string();
        assert!(text.contains("unexpected top-level key `cases`"), "{text}");

        let text =
            parse_cases(&GOOD.replace("name = \"a\"", "name = \"a/b\""), Path::new("y.toml")).unwrap_err().to_string();
        assert!(text.contains("golden file"), "{text}");
    }

    #[test]
    fn duplicate_names_across_files_are_rejected() {
        let dir = std::env::temp_dir().join(format!("cmm-corpus-dup-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("a.toml"), GOOD).unwrap();
        fs::write(dir.join("b.toml"), GOOD).unwrap();
        let e = load_corpus(&dir).unwrap_err();
        fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(&e, CorpusError::DuplicateName { name, .. } if name == "a"), "{e}");
    }

    #[test]
    fn an_invalid_problem_loads_and_fails_later() {
        let bad = GOOD.replace("m = 8", "m = 7");
        let cases = parse_cases(&bad, Path::new("x.toml")).unwrap();
        assert!(cases[0].problem().is_err());
    }
}
