//! Kernel sources (`cuda/kernels/*.cu`, each prepended with `common.cuh`) and their
//! compilation with NVRTC for an explicit architecture. NVRTC runs on the CPU, so every
//! kernel is compile-checked without a GPU (`cargo xtask cuda-check`).

use std::collections::BTreeMap;
use std::sync::Mutex;

use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};

use crate::error::CudaError;

const COMMON: &str = include_str!("../kernels/common.cuh");

/// One kernel file and its entry points.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelFile {
    /// File name under `cuda/kernels/`.
    pub name: &'static str,
    /// Its source (without `common.cuh`).
    pub source: &'static str,
    /// The `extern "C" __global__` functions it defines.
    pub entry_points: &'static [&'static str],
}

/// Every kernel file of the backend.
pub const KERNEL_FILES: [KernelFile; 9] = [
    KernelFile {
        name: "generate.cu",
        source: include_str!("../kernels/generate.cu"),
        entry_points: &["cmm_generate", "cmm_fill"],
    },
    KernelFile {
        name: "gemm.cu",
        source: include_str!("../kernels/gemm.cu"),
        entry_points: &[
            "cmm_gemm_mma_f16",
            "cmm_gemm_mma_bf16",
            "cmm_gemm_simt",
            "cmm_gemm_mma_wide_f16",
            "cmm_gemm_mma_wide_bf16",
            "cmm_fused_gemm_mma_f16",
            "cmm_fused_gemm_mma_bf16",
            "cmm_fused_gemm_simt",
            "cmm_fused_gemm_mma_wide_f16",
            "cmm_fused_gemm_mma_wide_bf16",
        ],
    },
    KernelFile {
        name: "hopper.cu",
        source: include_str!("../kernels/hopper.cu"),
        entry_points: &[
            "cmm_hopper_gemm_f16_n256",
            "cmm_hopper_gemm_bf16_n256",
            "cmm_hopper_gemm_f16_n128",
            "cmm_hopper_gemm_bf16_n128",
            "cmm_hopper_gemm_f16_n256_s3",
            "cmm_hopper_gemm_bf16_n256_s3",
            "cmm_hopper_gemm_f16_n128_s4",
            "cmm_hopper_gemm_bf16_n128_s4",
            "cmm_hopper_gemm_f16_n256_c2",
            "cmm_hopper_gemm_bf16_n256_c2",
            "cmm_hopper_gemm_f16_n128_c2",
            "cmm_hopper_gemm_bf16_n128_c2",
            "cmm_hopper_gemm_f16_n128_pp",
            "cmm_hopper_gemm_bf16_n128_pp",
            "cmm_hopper_gemm_f16_n256_ts",
            "cmm_hopper_gemm_bf16_n256_ts",
            "cmm_hopper_gemm_f16_n128_ts",
            "cmm_hopper_gemm_bf16_n128_ts",
        ],
    },
    KernelFile { name: "copy.cu", source: include_str!("../kernels/copy.cu"), entry_points: &["cmm_copy2d"] },
    KernelFile { name: "reduce.cu", source: include_str!("../kernels/reduce.cu"), entry_points: &["cmm_reduce"] },
    KernelFile {
        name: "pointwise.cu",
        source: include_str!("../kernels/pointwise.cu"),
        entry_points: &["cmm_pointwise"],
    },
    KernelFile {
        name: "attention.cu",
        source: include_str!("../kernels/attention.cu"),
        entry_points: &["cmm_attend", "cmm_attn_state"],
    },
    KernelFile {
        name: "moe.cu",
        source: include_str!("../kernels/moe.cu"),
        entry_points: &["cmm_route", "cmm_grouped_gemm", "cmm_gather_rows", "cmm_combine"],
    },
    KernelFile {
        name: "sync.cu",
        source: include_str!("../kernels/sync.cu"),
        entry_points: &["cmm_signal", "cmm_wait", "cmm_gate"],
    },
];

/// The architecture kernels are compiled for when no GPU says otherwise: Hopper with its
/// architecture-specific features (H100/H200).
pub const DEFAULT_ARCH: &str = "sm_90a";

impl KernelFile {
    /// The full source NVRTC compiles: `common.cuh`, then the file.
    pub fn full_source(&self) -> String {
        format!("{COMMON}\n// ---- {} ----\n{}", self.name, self.source)
    }
}

/// The NVRTC virtual architecture for a real one (`sm_90a` -> `compute_90a`).
pub fn virtual_arch(arch: &str) -> Result<&'static str, CudaError> {
    // NVRTC's option takes a `&'static str`; the set of architectures is small.
    const KNOWN: [(&str, &str); 8] = [
        ("sm_80", "compute_80"),
        ("sm_86", "compute_86"),
        ("sm_89", "compute_89"),
        ("sm_90", "compute_90"),
        ("sm_90a", "compute_90a"),
        ("sm_100", "compute_100"),
        ("sm_100a", "compute_100a"),
        ("sm_120", "compute_120"),
    ];
    KNOWN.iter().find(|(real, _)| *real == arch).map(|(_, v)| *v).ok_or_else(|| CudaError::Unsupported {
        plan: String::new(),
        what: format!("architecture {arch} (known: {})", KNOWN.map(|(r, _)| r).join(", ")),
    })
}

/// Whether libnvrtc can be loaded (checked before touching cudarc, which panics otherwise).
pub fn nvrtc_available() -> bool {
    // SAFETY: only probes the dynamic loader for the library; nothing is called.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::nvrtc::sys::is_culib_present()
    }
}

/// Compiles one kernel file to PTX for `arch` (e.g. `sm_90a`). Errors carry NVRTC's
/// log and the file name.
pub fn compile(kernel: &KernelFile, arch: &str) -> Result<String, CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    // One compile per (file, source, arch) serves every backend the process opens (a
    // test binary opens one per test).
    type Key = (&'static str, &'static str, String);
    static COMPILED: Mutex<BTreeMap<Key, String>> = Mutex::new(BTreeMap::new());
    let key = (kernel.name, kernel.source, arch.to_string());
    if let Some(ptx) = COMPILED.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(ptx.clone());
    }
    let ptx = compile_cached_on_disk(kernel, arch)?;
    COMPILED.lock().unwrap_or_else(|p| p.into_inner()).insert(key, ptx.clone());
    Ok(ptx)
}

/// NVRTC's version, for the disk cache's key.
fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two live out-parameters; NVRTC was found loadable by the caller.
    #[allow(unsafe_code)]
    let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

/// The PTX of `kernel` for `arch` from the disk cache (`~/.cache/cmm/ptx`, keyed by the
/// source, the architecture, the options and NVRTC's version), or compiled and put there:
/// every process of a one-process-per-GPU job, and every test binary, starts without
/// compiling again what an earlier one compiled. `CMM_PTX_CACHE=0` turns it off.
fn compile_cached_on_disk(kernel: &KernelFile, arch: &str) -> Result<String, CudaError> {
    use std::hash::{Hash, Hasher};
    if std::env::var("CMM_PTX_CACHE").is_ok_and(|v| v.trim() == "0") {
        return compile_fresh(kernel, arch);
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (kernel.full_source(), arch, OPTIONS, nvrtc_version()).hash(&mut hasher);
    let dir = crate::cpp::cache_dir().with_file_name("ptx");
    let file = dir.join(format!("{}-{arch}-{:016x}.ptx", kernel.name.trim_end_matches(".cu"), hasher.finish()));
    // A cached file is used only whole: writers rename complete files into place.
    if let Ok(ptx) = std::fs::read_to_string(&file) {
        if ptx.contains(".entry") {
            return Ok(ptx);
        }
    }
    let ptx = compile_fresh(kernel, arch)?;
    let unique = format!("{}-{:?}", std::process::id(), std::thread::current().id()).replace(['(', ')'], "");
    let partial = file.with_extension(unique);
    // The cache is an optimisation: a read-only or full disk costs a compile, not a failure.
    let written = std::fs::create_dir_all(&dir).is_ok() && std::fs::write(&partial, &ptx).is_ok();
    if written && std::fs::rename(&partial, &file).is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    Ok(ptx)
}

/// NVRTC's options beside the architecture and the name.
const OPTIONS: &[&str] = &["--std=c++17"];

/// The environment variable naming a folder of prebuilt kernel images: cubins that
/// `cargo xtask cuda-check` wrote with ptxas (the GPU bundle carries them), which the
/// backend loads instead of compiling with NVRTC and having the driver compile the PTX.
pub const KERNEL_IMAGES_VAR: &str = "CMM_KERNEL_IMAGES";

/// The file name of `kernel`'s prebuilt image for `arch`: keyed by the source NVRTC
/// compiles, the architecture and NVRTC's options, so an image of any other source is
/// never found. (The image itself says which ptxas made it; the driver refuses one it
/// cannot run, and the backend then compiles.)
pub fn image_file_name(kernel: &KernelFile, arch: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (kernel.full_source(), arch, OPTIONS).hash(&mut hasher);
    format!("{}-{arch}-{:016x}.cubin", kernel.name.trim_end_matches(".cu"), hasher.finish())
}

/// `kernel`'s prebuilt image for `arch` in `dir`: `Ok(None)` if there is none (see
/// [`image_file_name`]), an error naming the file if it is not a whole ELF image.
pub fn prebuilt_image(dir: &std::path::Path, kernel: &KernelFile, arch: &str) -> Result<Option<Vec<u8>>, String> {
    let file = dir.join(image_file_name(kernel, arch));
    let bytes = match std::fs::read(&file) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", file.display())),
    };
    elf_whole(&bytes).map_err(|why| format!("{}: {why}", file.display()))?;
    Ok(Some(bytes))
}

/// Checks that `bytes` is a little-endian ELF64 image whose program and section headers,
/// and every section with contents, lie within it. The driver takes an image without its
/// size and reads where the headers point: a truncated file must be refused here.
pub fn elf_whole(bytes: &[u8]) -> Result<(), String> {
    let u16_at = |at: usize| bytes.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as u64);
    let u32_at = |at: usize| bytes.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as u64);
    let u64_at = |at: usize| bytes.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    if bytes.len() < 64 || !bytes.starts_with(b"\x7fELF") || bytes[4] != 2 || bytes[5] != 1 {
        return Err("not a little-endian ELF64 image".into());
    }
    let len = bytes.len() as u64;
    let within = |what: &str, offset: u64, size: u64| match offset.checked_add(size) {
        Some(end) if end <= len => Ok(()),
        _ => Err(format!("{what} ends past the file's {len} bytes (truncated?)")),
    };
    // (e_phoff, e_phentsize, e_phnum; p_offset, p_filesz) and the same of the sections.
    let tables =
        [("the program headers", false, [32, 54, 56], [8, 32]), ("the section headers", true, [40, 58, 60], [24, 32])];
    for (what, sections, [offset_at, entry_at, count_at], [entry_offset, entry_size]) in tables {
        let (offset, entry, count) = (u64_at(offset_at), u16_at(entry_at), u16_at(count_at));
        let (offset, entry, count) =
            (offset.zip(entry).zip(count)).map(|((o, e), c)| (o, e, c)).expect("in the 64 bytes");
        within(what, offset, entry.saturating_mul(count))?;
        for i in 0..count {
            let base = (offset + i * entry) as usize;
            let (start, size) = (u64_at(base + entry_offset), u64_at(base + entry_size));
            // Sections without contents in the file (SHT_NOBITS, 8) take no bytes of it.
            let nobits = sections && u32_at(base + 4) == Some(8);
            match (start, size) {
                (Some(_), Some(_)) if nobits => {}
                (Some(start), Some(size)) => within(&format!("entry {i} of {what}"), start, size)?,
                _ => return Err(format!("entry {i} of {what} is cut short")),
            }
        }
    }
    Ok(())
}

/// Compiles `kernel` for `arch` with NVRTC now, whatever any cache holds (the compile
/// check: `cargo xtask cuda-check`).
pub fn compile_fresh(kernel: &KernelFile, arch: &str) -> Result<String, CudaError> {
    let options = CompileOptions {
        arch: Some(virtual_arch(arch)?),
        name: Some(kernel.name.to_string()),
        // No fused multiply-add contraction differences matter for the exact family, but
        // keep the default (fmad on) like any production build.
        options: OPTIONS.iter().map(|o| o.to_string()).collect(),
        ..Default::default()
    };
    compile_ptx_with_opts(kernel.full_source(), options).map(|ptx| ptx.to_src()).map_err(|e| {
        let (message, log) = match &e {
            CompileError::CompileError { nvrtc, log, .. } => (format!("{nvrtc:?}"), log.to_string_lossy().into_owned()),
            other => (format!("{other:?}"), String::new()),
        };
        CudaError::Compile { kernel: kernel.name, arch: arch.to_string(), message, log }
    })
}

/// Resource usage of one entry point as reported by `ptxas -v`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PtxasUsage {
    /// Entry point.
    pub function: String,
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory in bytes.
    pub shared_bytes: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
}

/// Parses the `-v` output of ptxas into one record per function.
pub fn parse_ptxas_verbose(text: &str) -> Vec<PtxasUsage> {
    let mut out: Vec<PtxasUsage> = Vec::new();
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let at = line.find(unit)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(PtxasUsage { function: name, ..Default::default() });
        } else if let Some(current) = out.last_mut() {
            if line.contains("bytes spill stores") {
                current.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                current.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            }
            if line.contains("Used") && line.contains("registers") {
                current.registers = number_before(line, "registers").unwrap_or(0);
                current.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_output_is_parsed() {
        let text = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'cmm_gemm_simt' for 'sm_90a'\n\
            ptxas info    : Function properties for cmm_gemm_simt\n\
            \x20   8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
            ptxas info    : Used 64 registers, used 1 barriers, 8192 bytes smem, 464 bytes cmem[0]\n";
        let usage = parse_ptxas_verbose(text);
        assert_eq!(
            usage,
            vec![PtxasUsage {
                function: "cmm_gemm_simt".into(),
                registers: 64,
                shared_bytes: 8192,
                spill_stores: 4,
                spill_loads: 12
            }]
        );
    }

    #[test]
    fn every_entry_point_is_declared_extern_c_global() {
        for k in KERNEL_FILES {
            for e in k.entry_points {
                // Declared directly, or by hopper.cu's entry-point macro.
                let declared = k.source.contains(&format!(" {e}(")) && k.source.contains("extern \"C\" __global__")
                    || k.source.contains(&format!("CMM_HOPPER_ENTRY({e},"));
                assert!(declared, "{} {e}", k.name);
            }
        }
    }

    #[test]
    fn an_image_whose_headers_point_past_its_end_is_not_whole() {
        let mut elf = vec![0u8; 64 + 64];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        assert_eq!(elf_whole(&elf), Ok(()), "no headers: nothing past the end");
        // One section header at byte 64, its contents at 100..100+28: within 128 bytes.
        elf[40..48].copy_from_slice(&64u64.to_le_bytes());
        elf[58..60].copy_from_slice(&64u16.to_le_bytes());
        elf[60..62].copy_from_slice(&1u16.to_le_bytes());
        elf[64 + 24..64 + 32].copy_from_slice(&100u64.to_le_bytes());
        elf[64 + 32..64 + 40].copy_from_slice(&28u64.to_le_bytes());
        assert_eq!(elf_whole(&elf), Ok(()));
        elf[64 + 32..64 + 40].copy_from_slice(&29u64.to_le_bytes());
        assert!(elf_whole(&elf).unwrap_err().contains("entry 0 of the section headers ends past"));
        // The same section without contents in the file (SHT_NOBITS) takes none of it.
        elf[64 + 4..64 + 8].copy_from_slice(&8u32.to_le_bytes());
        assert_eq!(elf_whole(&elf), Ok(()));
        // Two headers of 64 bytes from byte 64 need 192 bytes.
        elf[60..62].copy_from_slice(&2u16.to_le_bytes());
        assert!(elf_whole(&elf).unwrap_err().contains("the section headers ends past"));
        // An offset near u64::MAX does not wrap around.
        elf[60..62].copy_from_slice(&1u16.to_le_bytes());
        elf[40..48].copy_from_slice(&(u64::MAX - 8).to_le_bytes());
        assert!(elf_whole(&elf).is_err());
        assert!(elf_whole(b"\x7fELF").unwrap_err().contains("not a little-endian ELF64"));
    }

    #[test]
    fn unknown_architectures_are_a_typed_error() {
        assert_eq!(virtual_arch("sm_90a").unwrap(), "compute_90a");
        assert!(matches!(virtual_arch("sm_12"), Err(CudaError::Unsupported { .. })));
    }
}
