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
use cmm_core::timeline::json_str;
use cmm_core::{BufferRole, DType, Plan};

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
            DType::F32 | DType::F16 => dtype.push_le_bytes(w, &mut bytes),
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
        _ => "<f4",
    }
}

/// Collects exported cases and writes the index at the end.
#[derive(Debug)]
pub struct Exporter {
    dir: PathBuf,
    entries: Vec<String>,
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
                    BufferRole::Scratch => continue,
                };
                let file = format!("d{d}_{}.npy", decl.name);
                let (bytes, descr) = npy_bytes(decl.dtype, decl.rows, decl.cols, words);
                fs::write(case_dir.join(&file), bytes)?;
                files.push(format!(
                    "{{\"buffer\": {}, \"role\": \"{role}\", \"path\": {}, \"shape\": [{}, {}], \"dtype\": \"{}\", \"npy_dtype\": \"{descr}\"}}",
                    json_str(&decl.name),
                    json_str(&format!("{}/{file}", case.name)),
                    decl.rows,
                    decl.cols,
                    decl.dtype,
                ));
            }
            devices.push(format!("{{\"device\": {d}, \"files\": [\n        {}\n      ]}}", files.join(",\n        ")));
        }
        let opt = |x: Option<usize>| x.map_or("null".to_string(), |v| v.to_string());
        // Mesh cases name their mesh and dataflow; 1D cases keep the v1 fields only.
        let topology = match case.topology {
            Topology::Ring { .. } => format!("\"chunks\": {}, ", opt(case.chunks)),
            Topology::Linear { layer, pass, sp, microbatches, .. } => format!(
                "\"layer\": \"{layer}\", \"pass\": \"{pass}\", \"sp\": {sp}, \"microbatches\": {microbatches}, "
            ),
            Topology::Mesh { nr, nc, dataflow } => format!(
                "\"dataflow\": \"{dataflow}\", \"nr\": {nr}, \"nc\": {nc}, \"slices\": {}, \"block\": {}, ",
                opt(case.slices),
                opt(case.block)
            ),
            Topology::Attention { kv_heads, causal, layout, queries, .. } => format!(
                "\"heads\": {}, \"kv_heads\": {kv_heads}, \"head_dim\": {}, \"causal\": {causal}, \"layout\": \"{layout}\", \"queries\": {}, ",
                case.n,
                case.k,
                opt(queries)
            ),
        };
        self.entries.push(format!(
            concat!(
                "{{\"case\": {}, \"op\": \"{}\", \"algorithm\": {}, {}\"D\": {}, ",
                "\"m\": {}, \"n\": {}, \"k\": {}, \"input\": \"{}\", \"output\": \"{}\", ",
                "\"family\": \"{}\", \"seed\": {}, \"passed\": {},\n    \"devices\": [\n      {}\n    ]}}"
            ),
            json_str(&case.name),
            case.op_name(),
            json_str(&case.algorithm),
            topology,
            case.devices(),
            case.m,
            case.n,
            case.k,
            case.input,
            case.output,
            case.family,
            case.seed,
            result.passed(),
            devices.join(",\n      "),
        ));
        Ok(())
    }

    /// Writes `index.json` and returns its path.
    pub fn finish(self) -> io::Result<PathBuf> {
        let path = self.dir.join("index.json");
        let text = format!(
            concat!(
                "{{\"format\": \"cmm-export v1\",\n",
                " \"note\": \"matrices are row-major (rows, cols) per device; bf16 tensors are written as <f4 ",
                "(exact widening): dtype is the tensor's type, npy_dtype the file's\",\n",
                " \"cases\": [\n    {}\n  ]}}\n"
            ),
            self.entries.join(",\n    ")
        );
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

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_str("a\"b\\c\n\u{1}"), "\"a\\\"b\\\\c\\n\\u0001\"");
    }
}
