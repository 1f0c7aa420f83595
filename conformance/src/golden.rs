//! Golden outputs: `golden/<case>.bin`, written only by `cargo xtask conformance --bless`.
//!
//! A golden is one text line, then the payload:
//!
//! ```text
//! cmm-golden v1 case=<name> op=ag_gemm devices=4 m=96 n=32 k=256 input=bf16 output=f32 family=exact seed=7 rows=96 cols=8 digest=<fnv1a64 of the payload, 16 hex digits>\n
//! <raw little-endian output elements in the output dtype (2 bytes for f16/bf16), device 0 first, each row-major rows×cols>
//! ```
//!
//! Uneven shards record each device's rows, `rows=7/7/6/6`, and the payload holds each
//! device's own rows.
//!
//! Mesh cases add their shape after the device count (`op=mesh_gemm devices=8 nr=2
//! nc=4 dataflow=os m=…`), linear cases their layer (`layer=mlp pass=train sp=true
//! microbatches=2`). A workload with several outputs replaces `rows=… cols=…` by
//! `outputs=Y:bf16:8x64,dX:bf16:8x64,main_grad1:f32:64x32,…`, and the payload holds the
//! outputs in that order, each device 0 first. The header records what the golden was blessed for, so a
//! case edited after blessing is reported as stale instead of as a wall of wrong
//! numbers, and the digest catches a truncated or hand-edited payload.

use std::fmt::Write as _;

use thiserror::Error;

use cmm_core::DType;

use crate::case::{Case, Topology};

/// The shape of one output as a golden records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputShape {
    /// The plan's buffer.
    pub buffer: String,
    /// Element type.
    pub dtype: DType,
    /// Rows per device (the largest device's, when they differ).
    pub rows: usize,
    /// Uneven shards: each device's rows, when not all `rows`.
    pub device_rows: Option<Vec<usize>>,
    /// Columns per device.
    pub cols: usize,
}

impl OutputShape {
    /// Rows as the header records them: `96`, or each device's as `7/7/6/6`.
    fn rows_text(&self) -> String {
        cmm_core::plan::rows_text(self.rows, self.device_rows.as_deref())
    }

    /// Payload bytes of this output over `devices` devices.
    fn bytes(&self, devices: usize) -> usize {
        let rows: usize =
            (0..devices).map(|d| cmm_core::plan::rows_on(self.rows, self.device_rows.as_deref(), d)).sum();
        rows * self.cols * self.dtype.size_bytes()
    }
}

const MAGIC: &str = "cmm-golden";
const VERSION: &str = "v1";

/// FNV-1a, 64 bits.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Why a golden file cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum GoldenError {
    /// The file has no header line.
    #[error("no header line")]
    NoHeader,
    /// The header does not start with `cmm-golden v1`.
    #[error("header starts with `{found}`, expected `{MAGIC} {VERSION}`")]
    BadMagic {
        /// What the header starts with.
        found: String,
    },
    /// A header token is not `key=value`, or a key repeats.
    #[error("bad header field `{token}`")]
    BadField {
        /// The token.
        token: String,
    },
    /// A header key is missing.
    #[error("header lacks `{key}`")]
    MissingField {
        /// The key.
        key: &'static str,
    },
    /// The golden was blessed for different case parameters.
    #[error(
        "blessed for {key}={golden}, but the case says {key}={case}: re-bless with `cargo xtask conformance --bless`"
    )]
    Stale {
        /// The differing key.
        key: &'static str,
        /// Value in the golden header.
        golden: String,
        /// Value the case implies.
        case: String,
    },
    /// The payload does not hash to the header's digest.
    #[error(
        "digest mismatch: header says {header}, payload hashes to {payload:016x} (the file is corrupt or was edited)"
    )]
    Digest {
        /// Digest in the header.
        header: String,
        /// Digest of the payload.
        payload: u64,
    },
    /// The payload has the wrong size for the header's shape.
    #[error("payload has {found} bytes, the header's shape needs {expected}")]
    Length {
        /// Bytes needed.
        expected: usize,
        /// Bytes present.
        found: usize,
    },
}

/// The header fields a case implies, in file order (the digest comes last). Mesh
/// cases add their mesh shape and dataflow after the device count, linear cases their
/// layer.
fn fields(case: &Case, outputs: &[OutputShape]) -> Vec<(&'static str, String)> {
    let mut fields =
        vec![("case", case.name.clone()), ("op", case.op_name().to_string()), ("devices", case.devices().to_string())];
    match case.topology {
        Topology::Mesh { nr, nc, dataflow, wire } => {
            fields.extend([("nr", nr.to_string()), ("nc", nc.to_string()), ("dataflow", dataflow.to_string())]);
            fields.extend(wire.map(|wire| ("wire", wire.to_string())));
        }
        Topology::Linear { layer, pass, sp, microbatches, .. } => fields.extend([
            ("layer", layer.to_string()),
            ("pass", pass.to_string()),
            ("sp", sp.to_string()),
            ("microbatches", microbatches.to_string()),
        ]),
        Topology::Attention { kv_heads, causal, layout, queries, .. } => fields.extend([
            ("kv_heads", kv_heads.to_string()),
            ("causal", causal.to_string()),
            ("layout", layout.to_string()),
            ("queries", queries.map_or("none".into(), |t| t.to_string())),
        ]),
        Topology::Moe { experts, topk, routing, .. } => fields.extend([
            ("experts", experts.to_string()),
            ("topk", topk.to_string()),
            ("routing", routing.to_string()),
        ]),
        Topology::Ring { wire: Some(wire), .. } => fields.push(("wire", wire.to_string())),
        Topology::Ring { wire: None, .. } => {}
    }
    fields.extend([
        ("m", case.m.to_string()),
        ("n", case.n.to_string()),
        ("k", case.k.to_string()),
        ("input", case.input.to_string()),
        ("output", case.output.to_string()),
        ("family", case.family.to_string()),
        ("seed", case.seed.to_string()),
    ]);
    match outputs {
        [one] => fields.extend([("rows", one.rows_text()), ("cols", one.cols.to_string())]),
        several => fields.push((
            "outputs",
            several
                .iter()
                .map(|o| format!("{}:{}:{}x{}", o.buffer, o.dtype, o.rows_text(), o.cols))
                .collect::<Vec<_>>()
                .join(","),
        )),
    }
    fields
}

/// Bytes of a golden file for `case` with these outputs.
pub fn encode(case: &Case, outputs: &[OutputShape], payload: &[u8]) -> Vec<u8> {
    let mut header = format!("{MAGIC} {VERSION}");
    for (key, value) in fields(case, outputs) {
        let _ = write!(header, " {key}={value}");
    }
    let _ = writeln!(header, " digest={:016x}", fnv1a64(payload));
    let mut bytes = header.into_bytes();
    bytes.extend_from_slice(payload);
    bytes
}

/// The exact size of a golden file for `case` with these outputs (its header, then
/// every device's elements of every output).
pub fn file_len(case: &Case, outputs: &[OutputShape]) -> u64 {
    let payload: usize = outputs.iter().map(|o| o.bytes(case.devices())).sum();
    (encode(case, outputs, &[]).len() + payload) as u64
}

/// Reads a golden file of `case`, refusing before any read a path that is not a regular
/// file, and reading no more than [`file_len`] and one byte (so that a longer file is
/// seen as one).
pub fn read(path: &std::path::Path, case: &Case, outputs: &[OutputShape]) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    if !std::fs::metadata(path)?.is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(file_len(case, outputs) + 1).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Checks a golden file against `case` and the output shapes, and returns its payload.
pub fn decode<'a>(bytes: &'a [u8], case: &Case, outputs: &[OutputShape]) -> Result<&'a [u8], GoldenError> {
    let newline = bytes.iter().position(|&b| b == b'\n').ok_or(GoldenError::NoHeader)?;
    let (header, payload) = (String::from_utf8_lossy(&bytes[..newline]), &bytes[newline + 1..]);
    let mut tokens = header.split_whitespace();
    let start = [tokens.next(), tokens.next()];
    if start != [Some(MAGIC), Some(VERSION)] {
        return Err(GoldenError::BadMagic { found: start.iter().flatten().copied().collect::<Vec<_>>().join(" ") });
    }
    let mut found: Vec<(&str, &str)> = Vec::new();
    for token in tokens {
        let bad = || GoldenError::BadField { token: token.to_string() };
        let (key, value) = token.split_once('=').ok_or_else(bad)?;
        if found.iter().any(|(k, _)| *k == key) {
            return Err(bad());
        }
        found.push((key, value));
    }
    let get = |key: &'static str| {
        found.iter().find(|(k, _)| *k == key).map(|(_, v)| *v).ok_or(GoldenError::MissingField { key })
    };
    for (key, want) in fields(case, outputs) {
        let got = get(key)?;
        if got != want {
            return Err(GoldenError::Stale { key, golden: got.to_string(), case: want });
        }
    }
    let digest = get("digest")?;
    let actual = fnv1a64(payload);
    if u64::from_str_radix(digest, 16).ok() != Some(actual) {
        return Err(GoldenError::Digest { header: digest.to_string(), payload: actual });
    }
    let expected: usize = outputs.iter().map(|o| o.bytes(case.devices())).sum();
    if payload.len() != expected {
        return Err(GoldenError::Length { expected, found: payload.len() });
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cmm_core::{Dataflow, Family, OpKind};

    fn shape(rows: usize, cols: usize) -> Vec<OutputShape> {
        vec![OutputShape { buffer: "C".into(), dtype: DType::F16, rows, device_rows: None, cols }]
    }

    fn case() -> Case {
        Case {
            name: "t".into(),
            topology: Topology::Ring { op: OpKind::GemmRs, devices: 2, wire: None },
            algorithm: "ring".into(),
            chunks: None,
            node: None,
            slices: None,
            block: None,
            m: 4,
            n: 3,
            k: 2,
            input: DType::F16,
            output: DType::F16,
            family: Family::Exact,
            seed: 5,
        }
    }

    #[test]
    fn fnv1a64_known_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn round_trip_and_header_text() {
        let payload: Vec<u8> = (0..24).collect();
        let bytes = encode(&case(), &shape(2, 3), &payload);
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.starts_with("cmm-golden v1 case=t op=gemm_rs devices=2 m=4 n=3 k=2 input=f16 output=f16 family=exact seed=5 rows=2 cols=3 digest="));
        assert_eq!(decode(&bytes, &case(), &shape(2, 3)).unwrap(), &payload[..]);
    }

    #[test]
    fn mesh_headers_name_the_mesh_and_the_dataflow() {
        let mut mesh = case();
        mesh.topology = Topology::Mesh { nr: 1, nc: 2, dataflow: Dataflow::Rs, wire: None };
        let payload: Vec<u8> = (0..24).collect();
        let bytes = encode(&mesh, &shape(2, 3), &payload);
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            text.starts_with("cmm-golden v1 case=t op=mesh_gemm devices=2 nr=1 nc=2 dataflow=rs m=4 n=3 k=2 "),
            "{text}"
        );
        assert_eq!(decode(&bytes, &mesh, &shape(2, 3)).unwrap(), &payload[..]);
        let mut other = mesh.clone();
        other.topology = Topology::Mesh { nr: 2, nc: 1, dataflow: Dataflow::Rs, wire: None };
        assert_eq!(
            decode(&bytes, &other, &shape(2, 3)),
            Err(GoldenError::Stale { key: "nr", golden: "1".into(), case: "2".into() })
        );
    }

    #[test]
    fn several_outputs_are_listed_and_sized_together() {
        let outputs = vec![
            OutputShape { buffer: "Y".into(), dtype: DType::F16, rows: 2, device_rows: None, cols: 3 },
            OutputShape { buffer: "main_grad".into(), dtype: DType::F32, rows: 1, device_rows: None, cols: 2 },
        ];
        let payload: Vec<u8> = (0..2 * (12 + 8)).map(|x| x as u8).collect();
        let bytes = encode(&case(), &outputs, &payload);
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains(" seed=5 outputs=Y:f16:2x3,main_grad:f32:1x2 digest="), "{text}");
        assert_eq!(decode(&bytes, &case(), &outputs).unwrap(), &payload[..]);
        assert!(matches!(decode(&bytes, &case(), &shape(2, 3)), Err(GoldenError::MissingField { key: "rows" })));
    }

    #[test]
    fn corruption_and_staleness_are_errors() {
        let payload: Vec<u8> = (0..24).collect();
        let bytes = encode(&case(), &shape(2, 3), &payload);

        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(decode(&flipped, &case(), &shape(2, 3)), Err(GoldenError::Digest { .. })));

        let truncated = encode(&case(), &shape(2, 3), &payload[..20]);
        assert_eq!(decode(&truncated, &case(), &shape(2, 3)), Err(GoldenError::Length { expected: 24, found: 20 }));

        let mut other = case();
        other.seed = 6;
        let e = decode(&bytes, &other, &shape(2, 3)).unwrap_err();
        assert_eq!(e, GoldenError::Stale { key: "seed", golden: "5".into(), case: "6".into() });
        assert!(e.to_string().contains("--bless"));

        assert_eq!(decode(b"no newline", &case(), &shape(2, 3)), Err(GoldenError::NoHeader));
        assert!(matches!(decode(b"cmm-golden v2\n", &case(), &shape(2, 3)), Err(GoldenError::BadMagic { .. })));
        let dup = String::from_utf8_lossy(&bytes).replacen("case=t", "case=t case=t", 1);
        assert!(matches!(decode(dup.as_bytes(), &case(), &shape(2, 3)), Err(GoldenError::BadField { .. })));
        let no_digest = String::from_utf8_lossy(&bytes).replacen("digest=", "digestx=", 1);
        assert!(matches!(
            decode(no_digest.as_bytes(), &case(), &shape(2, 3)),
            Err(GoldenError::MissingField { key: "digest" })
        ));
    }
}
