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
use cmm_core::{BufferRole, DType, Plan};
use serde::Serialize;
use serde_json::{json, Value};

use crate::case::Topology;
use crate::check::CaseResult;

/// The bytes of an NPY v1.0 file holding a row-major `rows × cols` matrix of `dtype`
/// elements (`words` as in executor memory), and the NumPy dtype used.
pub fn npy_bytes(dtype: DType, rows: usize, cols: usize, words: &[u32]) -> (Vec<u8>, &'static str) {
    let descr = npy_descr(dtype);
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // Magic (6) + version (2) + header length (2) + header, padded with spaces and a
    // final newline to a multiple of 64 bytes.
    let unpadded = 10 + header.len() + 1;
    header.extend(std::iter::repeat_n(' ', unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + words.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for &w in words {
        match dtype {
            DType::F32 | DType::F16 | DType::U32 => dtype.push_le_bytes(w, &mut bytes),
            _ => bytes.extend_from_slice(&dtype.decode(w).to_le_bytes()),
        }
    }
    (bytes, descr)
}

/// The NumPy dtype a tensor of `dtype` is written as: its own for f32 and f16, f32
/// (an exact widening) for types NumPy lacks, such as bf16.
pub fn npy_descr(dtype: DType) -> &'static str {
    match dtype {
        DType::F16 => "<f2",
        DType::U32 => "<u4",
        _ => "<f4",
    }
}

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
                let (bytes, npy_dtype) = npy_bytes(decl.dtype, decl.rows, decl.cols, words);
                fs::write(case_dir.join(&file), bytes)?;
                files.push(FileEntry {
                    buffer: decl.name.clone(),
                    role,
                    path: format!("{}/{file}", case.name),
                    shape: [decl.rows, decl.cols],
                    dtype: decl.dtype.to_string(),
                    npy_dtype,
                });
            }
            devices.push(DeviceEntry { device: d, files });
        }
        // 1D cases keep the v1 fields; the other families name their own.
        let topology = match case.topology {
            Topology::Ring { .. } => json!({ "chunks": case.chunks }),
            Topology::Linear { layer, pass, sp, microbatches, .. } => json!({
                "layer": layer.name(), "pass": pass.name(), "sp": sp, "microbatches": microbatches,
            }),
            Topology::Mesh { nr, nc, dataflow } => json!({
                "dataflow": dataflow.to_string(), "nr": nr, "nc": nc, "slices": case.slices, "block": case.block,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_header_is_aligned_and_describes_the_data() {
        let words: Vec<u32> = [1.0f32, -2.0, 0.5, 3.0, 4.0, 5.0].iter().map(|x| x.to_bits()).collect();
        let (bytes, descr) = npy_bytes(DType::F32, 2, 3, &words);
        assert_eq!(descr, "<f4");
        assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
        let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + header_len) % 64, 0);
        let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
        assert!(header.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"), "{header}");
        assert!(header.ends_with('\n'));
        let data = &bytes[10 + header_len..];
        assert_eq!(data.len(), 24);
        assert_eq!(f32::from_le_bytes(data[4..8].try_into().unwrap()), -2.0);
    }

    #[test]
    fn bf16_is_widened_and_f16_kept() {
        let bf = DType::Bf16.encode(1.5);
        let (bytes, descr) = npy_bytes(DType::Bf16, 1, 1, &[bf]);
        assert_eq!(descr, "<f4");
        assert_eq!(f32::from_le_bytes(bytes[bytes.len() - 4..].try_into().unwrap()), 1.5);
        let h = DType::F16.encode(-0.25);
        let (bytes, descr) = npy_bytes(DType::F16, 1, 1, &[h]);
        assert_eq!(descr, "<f2");
        assert_eq!(u16::from_le_bytes(bytes[bytes.len() - 2..].try_into().unwrap()) as u32, h);
    }
}
