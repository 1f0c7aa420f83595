//! `--export DIR`: every device's inputs and outputs of the selected cases as `.npy`
//! files, and `DIR/index.json` describing them, for inspection with NumPy:
//!
//! ```python
//! import json, numpy as np
//! index = json.load(open("DIR/index.json"))
//! case = index["cases"][0]
//! c0 = np.load("DIR/" + case["devices"][0]["files"][-1]["path"])
//! ```
//!
//! f32 is written as `<f4` and f16 as `<f2`; NumPy has no bfloat16, so bf16 tensors are
//! widened (exactly) to `<f4`, and the index gives both the tensor's `dtype` and the
//! file's `npy_dtype`.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use cmm_core::cpu::Memory;
use cmm_core::{BufferRole, DType, Family, Plan};
use serde::Serialize;
use serde_json::{json, Value};

use crate::case::{Case, Topology};
use crate::check::CaseResult;
pub use crate::npy::{npy_bytes, npy_descr, read_npy, read_npy_file, NpyError};

/// One exported file.
#[derive(Serialize)]
struct FileEntry {
    buffer: String,
    role: &'static str,
    path: String,
    shape: [usize; 2],
    dtype: String,
    npy_dtype: &'static str,
}

/// How one output is judged: where it sits, and the rule.
#[derive(Serialize)]
struct OutputEntry {
    buffer: String,
    dtype: String,
    /// Rows (the largest device's, when they differ) and columns of a device's output.
    shape: [usize; 2],
    /// Uneven shards: each device's rows (its file is that many rows by `shape[1]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    device_rows: Option<Vec<usize>>,
    /// Where each device's output sits in the global result.
    layout: String,
    /// `bits` (exact family: equal to the oracle rounded once) or `within`.
    rule: &'static str,
    /// For `within`: |got − value| ≤ accumulation·magnitude·(1 + rounding) + floor +
    /// rounding·|value|, magnitude per element (Σ|a·b| or a derived bound; `cmm check`
    /// computes it).
    tolerance: ToleranceEntry,
}

#[derive(Serialize)]
struct ToleranceEntry {
    rounding: f64,
    accumulation: f64,
    floor: f64,
}

/// One device's files.
#[derive(Serialize)]
struct DeviceEntry {
    device: usize,
    files: Vec<FileEntry>,
}

/// One exported case: the case file's fields, whether it passed, the files.
#[derive(Serialize)]
struct CaseEntry {
    case: String,
    op: &'static str,
    algorithm: String,
    /// The fields of the case's family (mesh shape, layer, attention heads, …).
    #[serde(flatten)]
    topology: Value,
    #[serde(rename = "D")]
    devices: usize,
    m: usize,
    n: usize,
    k: usize,
    input: String,
    output: String,
    family: String,
    seed: u32,
    passed: bool,
    /// Every output with its layout and the rule that judges it.
    outputs: Vec<OutputEntry>,
    #[serde(rename = "devices")]
    files: Vec<DeviceEntry>,
}

/// `index.json`.
#[derive(Serialize)]
struct Index {
    format: &'static str,
    note: &'static str,
    cases: Vec<CaseEntry>,
}

/// The outputs of a case with their layouts and rules (none if the case is invalid).
fn outputs_of(case: &Case) -> Vec<OutputEntry> {
    let Ok(problem) = case.problem() else { return Vec::new() };
    let workload = problem.workload();
    if workload.unsupported_family(case.family).is_some() {
        return Vec::new();
    }
    workload
        .expected(case.seed, case.family)
        .into_iter()
        .map(|e| OutputEntry {
            rule: if case.family == Family::Exact { "bits" } else { "within" },
            tolerance: ToleranceEntry {
                rounding: e.tolerance.rounding,
                accumulation: e.tolerance.accumulation,
                floor: e.tolerance.floor,
            },
            shape: [e.rows, e.cols],
            device_rows: e.device_rows,
            dtype: e.dtype.to_string(),
            layout: e.layout,
            buffer: e.buffer,
        })
        .collect()
}

/// Collects exported cases and writes the index at the end.
pub struct Exporter {
    dir: PathBuf,
    entries: Vec<CaseEntry>,
}

impl std::fmt::Debug for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exporter").field("dir", &self.dir).field("cases", &self.entries.len()).finish()
    }
}

impl Exporter {
    /// Exports into `dir` (created if needed).
    pub fn new(dir: &Path) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        Ok(Exporter { dir: dir.to_path_buf(), entries: Vec::new() })
    }

    /// Writes the input and output buffers of every device of one case run.
    pub fn add(&mut self, result: &CaseResult, plan: &Plan, memory: &Memory) -> io::Result<()> {
        let case = &result.case;
        crate::case::check_case_name(&case.name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let case_dir = self.dir.join(&case.name);
        fs::create_dir_all(&case_dir)?;
        let mut devices = Vec::new();
        for (d, buffers) in memory.iter().enumerate() {
            let mut files = Vec::new();
            for (decl, words) in plan.buffers.iter().zip(buffers) {
                let role = match decl.role {
                    BufferRole::Input { .. } => "input",
                    BufferRole::Output => "output",
                    BufferRole::Accumulator { .. } => "accumulator",
                    BufferRole::Router { .. } => "router",
                    BufferRole::Scratch => continue,
                };
                let file = format!("d{d}_{}.npy", decl.name);
                // An uneven shard's file holds the device's own rows, not the padding.
                let rows = decl.rows_on(d);
                let (bytes, npy_dtype) = npy_bytes(decl.dtype, rows, decl.cols, &words[..rows * decl.cols]);
                fs::write(case_dir.join(&file), bytes)?;
                files.push(FileEntry {
                    buffer: decl.name.clone(),
                    role,
                    path: format!("{}/{file}", case.name),
                    shape: [rows, decl.cols],
                    dtype: decl.dtype.to_string(),
                    npy_dtype,
                });
            }
            devices.push(DeviceEntry { device: d, files });
        }
        // 1D cases keep the v1 fields; the other families name their own.
        let topology = match case.topology {
            Topology::Ring { wire, .. } => {
                let mut fields = json!({ "chunks": case.chunks, "wire": wire.unwrap_or(DType::F32).name() });
                // `hierarchical`'s GPUs per node, only where given (v1 readers see no new field).
                if let Some(node) = case.node {
                    fields["node"] = json!(node);
                }
                fields
            }
            Topology::Linear { layer, pass, sp, microbatches, .. } => json!({
                "layer": layer.name(), "pass": pass.name(), "sp": sp, "microbatches": microbatches,
            }),
            Topology::Mesh { nr, nc, dataflow, wire } => json!({
                "dataflow": dataflow.to_string(), "nr": nr, "nc": nc, "slices": case.slices, "block": case.block,
                "wire": wire.unwrap_or(DType::F32).name(),
            }),
            Topology::Attention { kv_heads, causal, layout, queries, .. } => json!({
                "heads": case.n, "kv_heads": kv_heads, "head_dim": case.k, "causal": causal,
                "layout": layout.name(), "queries": queries,
            }),
            Topology::Moe { experts, topk, routing, .. } => json!({
                "tokens": case.m, "hidden": case.k, "ffn": case.n, "experts": experts, "topk": topk,
                "routing": routing.name(), "chunks": case.chunks,
            }),
        };
        self.entries.push(CaseEntry {
            case: case.name.clone(),
            op: case.op_name(),
            algorithm: case.algorithm.clone(),
            topology,
            devices: case.devices(),
            m: case.m,
            n: case.n,
            k: case.k,
            input: case.input.to_string(),
            output: case.output.to_string(),
            family: case.family.to_string(),
            seed: case.seed,
            passed: result.passed(),
            outputs: outputs_of(case),
            files: devices,
        });
        Ok(())
    }

    /// Writes `index.json` and returns its path.
    pub fn finish(self) -> io::Result<PathBuf> {
        let path = self.dir.join("index.json");
        let index = Index {
            format: "cmm-export v1",
            note: "matrices are row-major (rows, cols) per device; bf16 tensors are written as <f4 \
                   (exact widening): dtype is the tensor's type, npy_dtype the file's",
            cases: self.entries,
        };
        let mut text = serde_json::to_string_pretty(&index).map_err(io::Error::other)?;
        text.push('\n');
        fs::write(&path, text)?;
        Ok(path)
    }
}
