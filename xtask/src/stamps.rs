//! The conformance stamp that gates CUDA benchmarks: `conformance --backend cuda` writes,
//! per GPU, binary and sync mode, the (op, algorithm) pairs whose every corpus case
//! passed; `bench --backend cuda` times only those.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::ValueEnum;
use cmm_conformance::golden::fnv1a64;
use cmm_conformance::Summary;
use cmm_cuda::{CudaBackend, SyncMode};

/// How the CUDA backend issues signals and waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Sync {
    /// One-thread signal and wait kernels (a wait has a deadline and can be aborted).
    Kernels,
    /// `cuStreamWaitValue32` / `cuStreamWriteValue32` where a semaphore has one signaller.
    Memops,
}

impl Sync {
    /// The backend's mode.
    pub fn mode(self) -> SyncMode {
        match self {
            Sync::Kernels => SyncMode::Kernels,
            Sync::Memops => SyncMode::StreamMemOps,
        }
    }

    /// The name used in stamps and reports.
    pub fn name(self) -> &'static str {
        match self {
            Sync::Kernels => "kernels",
            Sync::Memops => "memops",
        }
    }
}

/// The stamp directory: the flag, else `$CMM_STAMP_DIR`, else `target/cuda-stamps`.
fn stamp_dir(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os("CMM_STAMP_DIR").map(PathBuf::from))
        .unwrap_or_else(|| crate::workspace_root().join("target").join("cuda-stamps"))
}

/// Where the stamp of this GPU, this binary and this sync mode lives.
fn stamp_path(backend: &CudaBackend, sync: Sync, dir: Option<&Path>) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the running binary")?;
    let bytes = fs::read(&exe).with_context(|| format!("reading {}", exe.display()))?;
    let gpu = backend.identity()?;
    Ok(stamp_dir(dir).join(format!("{:016x}-{:016x}-{}.txt", fnv1a64(gpu.as_bytes()), fnv1a64(&bytes), sync.name())))
}

/// After `conformance --backend cuda`: updates the stamp of this GPU, binary and sync
/// mode. A pair (op, algorithm) is stamped when every corpus case of it ran in this run
/// and passed; a failure removes it; a run that covered a pair only in part (a filter)
/// leaves its entry as it was.
pub fn write_stamp(
    backend: &CudaBackend,
    sync: Sync,
    dir: Option<&Path>,
    corpus: &[cmm_conformance::Case],
    summary: &Summary,
) -> Result<()> {
    let key = |case: &cmm_conformance::Case| format!("{} {}", case.op_name(), case.algorithm);
    let path = stamp_path(backend, sync, dir)?;
    let mut stamp: BTreeSet<String> = match fs::read_to_string(&path) {
        Ok(text) => text.lines().filter(|l| !l.is_empty()).map(str::to_string).collect(),
        Err(_) => BTreeSet::new(),
    };
    let pairs: BTreeSet<String> = summary.outcomes.iter().map(|(c, _)| key(c)).collect();
    for pair in pairs {
        let ran: Vec<bool> = summary.outcomes.iter().filter(|(c, _)| key(c) == pair).map(|(_, ok)| *ok).collect();
        let in_corpus = corpus.iter().filter(|c| key(c) == pair).count();
        if ran.iter().any(|ok| !ok) {
            stamp.remove(&pair);
        } else if ran.len() == in_corpus {
            stamp.insert(pair);
        }
    }
    fs::create_dir_all(path.parent().unwrap_or(Path::new("."))).context("creating the stamp directory")?;
    let lines: Vec<&str> = stamp.iter().map(String::as_str).collect();
    fs::write(&path, lines.join("\n") + "\n").with_context(|| format!("writing {}", path.display()))?;
    println!(
        "stamp: {} op/algorithm pair(s) passed every corpus case on {} ({}) -> {}",
        lines.len(),
        backend.identity()?,
        sync.name(),
        path.display()
    );
    Ok(())
}

pub(crate) fn stamped(backend: &CudaBackend, sync: Sync, dir: Option<&Path>) -> Result<BTreeSet<String>> {
    let path = stamp_path(backend, sync, dir)?;
    let text = fs::read_to_string(&path).with_context(|| {
        format!(
            "no conformance stamp for this GPU, binary and sync mode ({}): run `cargo xtask conformance --backend cuda --sync {}` first",
            path.display(),
            sync.name()
        )
    })?;
    Ok(text.lines().map(str::to_string).collect())
}
