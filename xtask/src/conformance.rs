//! `cargo xtask conformance [--bless] [--filter P] [--export DIR] [--backend B] [--schedules N] [--stats]`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use cmm_conformance::{run_corpus, Backend, CpuTwin, Options};
use cmm_cuda::CudaBackend;
use cmm_reference::Reference;

/// Where the corpus runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The wgpu reference (a GPU, or Mesa lavapipe on the CPU).
    Reference,
    /// The CPU twin of the reference (`cmm_core::cpu`): no GPU needed, same arithmetic.
    Cpu,
    /// The CUDA backend on GPU 0 (virtual devices); a pass writes the stamp that lets
    /// `cargo xtask bench --backend cuda` time the passing op/algorithm pairs.
    Cuda,
}

/// Arguments of `cargo xtask conformance`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Write the goldens of cases that pass the oracle check (then commit them).
    #[arg(long)]
    pub bless: bool,
    /// Run only the cases whose name contains this substring.
    #[arg(long, value_name = "P")]
    pub filter: Option<String>,
    /// Write every device's inputs and outputs as .npy files, with an index.json.
    #[arg(long, value_name = "DIR")]
    pub export: Option<PathBuf>,
    /// The executor to check.
    #[arg(long, value_enum, default_value = "reference")]
    pub backend: BackendKind,
    /// Run every case under N interleavings (the default order first): the verifier
    /// replays each, and the outputs must be bit-identical across them.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub schedules: u32,
    /// After each case, print the bytes each device sends, measured from its plan (per
    /// mesh direction for mesh cases, beside seed 002's analytic traffic).
    #[arg(long)]
    pub stats: bool,
}

/// Starts the chosen backend and prints which adapter runs the work.
pub fn make_backend(kind: BackendKind) -> Result<Box<dyn Backend>> {
    Ok(match kind {
        BackendKind::Reference => {
            let reference = Reference::new()
                .context("cannot start the wgpu reference (use `--backend cpu` to run on the CPU twin)")?;
            println!("adapter: {}", reference.adapter_summary());
            Box::new(reference)
        }
        BackendKind::Cpu => {
            println!("adapter: none (CPU twin, cmm_core::cpu)");
            Box::new(CpuTwin)
        }
        BackendKind::Cuda => {
            let cuda = CudaBackend::new(1).context("cannot start the CUDA backend")?;
            println!("adapter: {}", cuda.summary());
            Box::new(cuda)
        }
    })
}

/// Runs the corpus; fails when any case fails.
pub fn run(args: &Args) -> Result<()> {
    let options = Options {
        filter: args.filter.clone(),
        bless: args.bless,
        export: args.export.clone(),
        schedules: args.schedules as usize,
        stats: args.stats,
        ..Options::default()
    };
    if args.backend == BackendKind::Cuda {
        let cuda = CudaBackend::new(1).context("cannot start the CUDA backend")?;
        println!("adapter: {}", cuda.summary());
        let summary = run_corpus(&cuda, &options).context("conformance run")?;
        crate::cuda::write_stamp(&cuda, &summary)?;
        return finish(&summary);
    }
    let backend = make_backend(args.backend)?;
    let summary = run_corpus(backend.as_ref(), &options).context("conformance run")?;
    finish(&summary)
}

fn finish(summary: &cmm_conformance::Summary) -> Result<()> {
    if summary.failed > 0 {
        bail!("{} of {} conformance cases failed", summary.failed, summary.failed + summary.passed);
    }
    Ok(())
}
