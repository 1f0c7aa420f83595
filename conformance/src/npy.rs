//! The `.npy` format as cmm writes and reads it: NPY v1.0 files of row-major matrices
//! (`npy_bytes`), and the bounded reader of users' outputs (`read_npy_file`: the header
//! first, the size checked against it, no more read than the output needs).

use std::fs;
use std::io;
use std::path::Path;

use cmm_core::DType;

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

/// Why an `.npy` file cannot be read as an output.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NpyError {
    /// Not an NPY v1–v3 file, or a header this reader does not understand.
    #[error("not an .npy file this reader understands: {0}")]
    Format(String),
    /// The file's element type cannot hold the output's dtype.
    #[error("holds {descr}, but the output is {dtype} (accepted: {accepted})")]
    DType {
        /// The file's descr.
        descr: String,
        /// The output's dtype.
        dtype: DType,
        /// What would be accepted.
        accepted: &'static str,
    },
    /// The path is not a regular file (a directory, a FIFO, a device).
    #[error("is not a regular file")]
    NotAFile,
    /// The file's size is not its header's plus the output's elements.
    #[error("is {found} bytes; its header and the output's elements make {expected}")]
    Size {
        /// The file's size.
        found: u64,
        /// What its header and the output's shape imply.
        expected: u64,
    },
    /// An element is not a value of the output's dtype.
    #[error(
        "element {index} (row-major) is {}, not a {dtype} value (write the output's own rounded values)",
        f32::from_bits(*bits)
    )]
    NotRepresentable {
        /// Row-major index of the element.
        index: usize,
        /// Its bits as the file holds them (an f32).
        bits: u32,
        /// The output's dtype.
        dtype: DType,
    },
    /// Reading the file failed.
    #[error("{0}")]
    Io(String),
    /// The array's shape is not the output's.
    #[error("has shape {found:?}, expected [{rows}, {cols}]")]
    Shape {
        /// The file's shape.
        found: Vec<usize>,
        /// Expected rows.
        rows: usize,
        /// Expected columns.
        cols: usize,
    },
}

/// The largest NPY header this reader accepts: NumPy writes a few hundred bytes.
const MAX_NPY_HEADER: usize = 1 << 16;

/// An NPY header: where the data starts, its element type and its shape.
struct NpyHeader {
    data_start: usize,
    descr: String,
    shape: Vec<usize>,
}

/// Bytes of the NPY prefix that give the header's length: magic, version, length.
fn header_span(prefix: &[u8]) -> Result<(usize, usize), NpyError> {
    let bad = |what: &str| NpyError::Format(what.to_string());
    if prefix.len() < 10 || &prefix[..6] != b"\x93NUMPY" {
        return Err(bad("no NPY magic"));
    }
    let (header_len, start) = match prefix[6] {
        1 => (u16::from_le_bytes([prefix[8], prefix[9]]) as usize, 10),
        2 | 3 if prefix.len() >= 12 => {
            (u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]) as usize, 12)
        }
        v => return Err(NpyError::Format(format!("version {v}"))),
    };
    if header_len > MAX_NPY_HEADER {
        return Err(NpyError::Format(format!("a header of {header_len} bytes (at most {MAX_NPY_HEADER} are read)")));
    }
    Ok((start, header_len))
}

/// Parses the header of `bytes` (the file's start, header included).
fn parse_header(bytes: &[u8]) -> Result<NpyHeader, NpyError> {
    let bad = |what: &str| NpyError::Format(what.to_string());
    let (start, header_len) = header_span(bytes)?;
    let header = bytes.get(start..start + header_len).ok_or_else(|| bad("truncated header"))?;
    let header = std::str::from_utf8(header).map_err(|_| bad("header is not text"))?;
    let field = |key: &str| -> Result<&str, NpyError> {
        let at =
            header.find(&format!("'{key}':")).ok_or_else(|| NpyError::Format(format!("no '{key}' in the header")))?;
        Ok(header[at + key.len() + 3..].trim_start())
    };
    let descr = field("descr")?;
    let descr =
        descr.strip_prefix('\'').and_then(|d| d.split('\'').next()).ok_or_else(|| bad("descr is not a string"))?;
    if field("fortran_order")?.starts_with("True") {
        return Err(bad("Fortran order (save a C-contiguous array)"));
    }
    let shape_text = field("shape")?;
    let shape_text = shape_text.strip_prefix('(').and_then(|s| s.split(')').next()).ok_or_else(|| bad("shape"))?;
    let shape: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| NpyError::Format(format!("shape entry `{s}`"))))
        .collect::<Result<_, _>>()?;
    Ok(NpyHeader { data_start: start + header_len, descr: descr.to_string(), shape })
}

/// How the file's elements become the output's words: their size in bytes and whether
/// each is an f32 that must hold a bf16 value.
fn element_reading(header: &NpyHeader, dtype: DType, rows: usize, cols: usize) -> Result<(usize, bool), NpyError> {
    let fits = match header.shape.as_slice() {
        [r, c] => (*r, *c) == (rows, cols),
        [n] => rows == 1 && *n == cols || cols == 1 && *n == rows,
        _ => false,
    };
    if !fits {
        return Err(NpyError::Shape { found: header.shape.clone(), rows, cols });
    }
    match (dtype, header.descr.as_str()) {
        (DType::F32, "<f4") | (DType::U32, "<u4") => Ok((4, false)),
        (DType::F16, "<f2") => Ok((2, false)),
        (DType::Bf16, "<f4") => Ok((4, true)),
        (DType::Bf16, "<V2" | "|V2" | "bfloat16") => Ok((2, false)),
        _ => {
            let accepted = match dtype {
                DType::F32 => "<f4",
                DType::F16 => "<f2",
                DType::Bf16 => "<f4 holding bf16 values, or ml_dtypes bfloat16",
                _ => "<u4",
            };
            Err(NpyError::DType { descr: header.descr.clone(), dtype, accepted })
        }
    }
}

/// The words of `data` (exactly the elements, little-endian).
fn decode_elements(data: &[u8], size: usize, bf16_in_f32: bool) -> Result<Vec<u32>, NpyError> {
    data.chunks_exact(size)
        .enumerate()
        .map(|(index, b)| {
            if size == 2 {
                return Ok(u16::from_le_bytes([b[0], b[1]]) as u32);
            }
            let w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            if !bf16_in_f32 {
                return Ok(w);
            }
            // A bf16 output given as f32 must hold a bf16 value: rounding it here would
            // let a kernel that skipped its bf16 rounding pass bit for bit.
            if w & 0xffff != 0 {
                return Err(NpyError::NotRepresentable { index, bits: w, dtype: DType::Bf16 });
            }
            Ok(w >> 16)
        })
        .collect()
}

/// The words of a `rows × cols` matrix of output dtype `dtype` given as little-endian
/// elements of NumPy type `descr` (`<f4`, `<f2`, `<u4`, or `bfloat16`/`<V2` for
/// ml_dtypes' bf16), by the rules of [`read_npy`]: a bf16 output given as f32 must hold
/// bf16 values. For arrays handed over in memory (the Python package).
pub fn words_from_elements(
    data: &[u8],
    descr: &str,
    dtype: DType,
    rows: usize,
    cols: usize,
) -> Result<Vec<u32>, NpyError> {
    let header = NpyHeader { data_start: 0, descr: descr.to_string(), shape: vec![rows, cols] };
    let (size, bf16_in_f32) = element_reading(&header, dtype, rows, cols)?;
    if data.len() != rows * cols * size {
        return Err(NpyError::Format(format!("{} bytes for {rows}×{cols} elements of {size} bytes", data.len())));
    }
    decode_elements(data, size, bf16_in_f32)
}

/// Reads an NPY file's bytes holding a `rows × cols` matrix of `dtype` (as NumPy and
/// ml_dtypes write it: f32 `<f4`, f16 `<f2`, bf16 as `<f4` holding bf16 values or
/// ml_dtypes' 2-byte `bfloat16`, u32 `<u4`; C order) into executor words. A bf16 output
/// given as f32 must hold bf16 values: any other value is an error naming its index.
pub fn read_npy(bytes: &[u8], dtype: DType, rows: usize, cols: usize) -> Result<Vec<u32>, NpyError> {
    let header = parse_header(bytes)?;
    let (size, bf16_in_f32) = element_reading(&header, dtype, rows, cols)?;
    let data = &bytes[header.data_start..];
    // Exactly: bytes past the data mean the file is not what its header says (two
    // arrays written one after the other, a header from another array).
    let n = rows * cols;
    if data.len() != n * size {
        return Err(NpyError::Format(format!(
            "{} data bytes for {n} elements of {size} bytes (the header's shape)",
            data.len()
        )));
    }
    decode_elements(data, size, bf16_in_f32)
}

/// [`read_npy`] of a file, reading no more than the output needs: the file must be a
/// regular file (a FIFO or a device such as `/dev/zero` is refused before it is opened),
/// its size must be exactly its header plus `rows × cols` elements (checked before the
/// data is read), and only the header is read before that.
pub fn read_npy_file(path: &Path, dtype: DType, rows: usize, cols: usize) -> Result<Vec<u32>, NpyError> {
    use std::io::{Read, Seek, SeekFrom};
    let io = |e: io::Error| NpyError::Io(e.to_string());
    let meta = fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(NpyError::NotAFile);
    }
    let mut file = fs::File::open(path).map_err(io)?;
    let prefix_len = 12.min(meta.len()) as usize;
    let mut head = vec![0u8; prefix_len];
    file.read_exact(&mut head).map_err(io)?;
    let (start, header_len) = header_span(&head)?;
    let header_end = start + header_len;
    if header_end as u64 > meta.len() {
        return Err(NpyError::Format("truncated header".into()));
    }
    if header_end > prefix_len {
        head.resize(header_end, 0);
        file.read_exact(&mut head[prefix_len..]).map_err(io)?;
    }
    let header = parse_header(&head)?;
    let (size, bf16_in_f32) = element_reading(&header, dtype, rows, cols)?;
    let expected = (header.data_start + rows * cols * size) as u64;
    if meta.len() != expected {
        return Err(NpyError::Size { found: meta.len(), expected });
    }
    let mut data = vec![0u8; rows * cols * size];
    file.seek(SeekFrom::Start(header.data_start as u64)).map_err(io)?;
    file.read_exact(&mut data).map_err(io)?;
    decode_elements(&data, size, bf16_in_f32)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_files_are_read_only_as_far_as_the_output_needs() {
        let dir = std::env::temp_dir().join(format!("cmm-npy-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let words: Vec<u32> = (0..6).map(|i| (i as f32 * 0.5).to_bits()).collect();
        let (bytes, _) = npy_bytes(DType::F32, 2, 3, &words);
        let good = dir.join("good.npy");
        fs::write(&good, &bytes).unwrap();
        assert_eq!(read_npy_file(&good, DType::F32, 2, 3).unwrap(), words);
        // A directory, and on Unix a device that never ends and a FIFO that never
        // opens: refused before they are opened.
        assert_eq!(read_npy_file(&dir, DType::F32, 2, 3), Err(NpyError::NotAFile));
        #[cfg(unix)]
        {
            assert_eq!(read_npy_file(Path::new("/dev/zero"), DType::F32, 2, 3), Err(NpyError::NotAFile));
            let fifo = dir.join("fifo.npy");
            let made = std::process::Command::new("mkfifo").arg(&fifo).status();
            if made.is_ok_and(|s| s.success()) {
                assert_eq!(read_npy_file(&fifo, DType::F32, 2, 3), Err(NpyError::NotAFile));
            }
        }
        // A valid header in front of 16 GiB (sparse): refused from its size, unread.
        let huge = dir.join("huge.npy");
        fs::write(&huge, &bytes).unwrap();
        fs::File::options().write(true).open(&huge).unwrap().set_len(1 << 34).unwrap();
        let e = read_npy_file(&huge, DType::F32, 2, 3).unwrap_err();
        assert_eq!(e, NpyError::Size { found: 1 << 34, expected: bytes.len() as u64 });
        // A header that claims more than a header can be.
        let mut long = b"\x93NUMPY\x02\x00".to_vec();
        long.extend_from_slice(&(MAX_NPY_HEADER as u32 + 1).to_le_bytes());
        long.extend_from_slice(&bytes[10..]);
        fs::write(&huge, &long).unwrap();
        let e = read_npy_file(&huge, DType::F32, 2, 3).unwrap_err();
        assert!(e.to_string().contains("a header of 65537 bytes"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A bf16 output written as f32 must hold bf16 values: −13.984375 where −14 is
    /// expected, or 2.3e-41 where 0 is, is an error, not a rounding.
    #[test]
    fn a_bf16_output_given_as_f32_must_hold_bf16_values() {
        let ok: Vec<u32> = [-14.0f32, 0.0, 1.5].iter().map(|x| x.to_bits()).collect();
        let (bytes, _) = npy_bytes(DType::F32, 1, 3, &ok);
        let words = read_npy(&bytes, DType::Bf16, 1, 3).unwrap();
        assert_eq!(words, [-14.0f32, 0.0, 1.5].map(|x| DType::Bf16.encode(x)));
        for (at, wrong) in [(0, -13.984_375f32), (1, 2.3e-41)] {
            let mut values = ok.clone();
            values[at] = wrong.to_bits();
            let (bytes, _) = npy_bytes(DType::F32, 1, 3, &values);
            let e = read_npy(&bytes, DType::Bf16, 1, 3).unwrap_err();
            assert_eq!(e, NpyError::NotRepresentable { index: at, bits: wrong.to_bits(), dtype: DType::Bf16 });
            assert!(
                e.to_string().starts_with(&format!("element {at} (row-major) is {wrong}, not a bf16 value")),
                "{e}"
            );
        }
    }

    #[test]
    fn npy_files_read_back_as_the_words_they_were_written_from() {
        let words: Vec<u32> = (0..6).map(|i| DType::Bf16.encode(i as f32 * 0.75 - 1.0)).collect();
        for dtype in [DType::F32, DType::F16, DType::Bf16, DType::U32] {
            let w: Vec<u32> = match dtype {
                DType::F32 => (0..6).map(|i| (i as f32 * 0.1).to_bits()).collect(),
                DType::F16 => (0..6).map(|i| DType::F16.encode(i as f32 * 0.1)).collect(),
                DType::U32 => vec![0, 1, 7, 9, u32::MAX, 3],
                _ => words.clone(),
            };
            let (bytes, _) = npy_bytes(dtype, 2, 3, &w);
            assert_eq!(read_npy(&bytes, dtype, 2, 3).unwrap(), w, "{dtype}");
        }
        let (bytes, _) = npy_bytes(DType::F32, 2, 3, &[0; 6]);
        assert!(matches!(read_npy(&bytes, DType::F32, 3, 2), Err(NpyError::Shape { .. })));
        assert!(matches!(read_npy(&bytes, DType::F16, 2, 3), Err(NpyError::DType { .. })));
        assert!(matches!(read_npy(b"not an npy file", DType::F32, 2, 3), Err(NpyError::Format(_))));
        for wrong in [&bytes[..bytes.len() - 1], &[&bytes[..], &[0u8; 4]].concat()[..]] {
            let e = read_npy(wrong, DType::F32, 2, 3).unwrap_err();
            assert!(e.to_string().contains("data bytes for 6 elements of 4 bytes"), "{e}");
        }
        // ml_dtypes' bfloat16: two bytes per element.
        let mut raw = bytes[..bytes.len() - 24].to_vec();
        let text = String::from_utf8_lossy(&raw[10..]).replace("'<f4'", "'<V2'");
        raw.truncate(10);
        raw.extend_from_slice(text.as_bytes());
        for w in &words {
            raw.extend_from_slice(&(*w as u16).to_le_bytes());
        }
        assert_eq!(read_npy(&raw, DType::Bf16, 2, 3).unwrap(), words);
    }

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
