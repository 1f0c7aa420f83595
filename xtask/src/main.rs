//! `cargo xtask <command>`: the project's tasks. Thin by design: each subcommand
//! orchestrates, and the work lives in the crates (BRIEF §2).

mod bench;
mod bundle;
mod calibrate;
mod ci;
mod conformance;
mod cuda;
mod fuzz;
mod mutants;
mod stamps;
mod sweep;
mod timing;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Parser, Subcommand};
use cmm_cli::{simulate, tune};

/// cmm project tasks.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the conformance corpus against the goldens and the f64 oracle.
    Conformance(conformance::Args),
    /// Measure the GEMM shader's throughput beside native CPU sgemm.
    Bench(bench::Args),
    /// Compile every CUDA kernel with NVRTC and ptxas (no GPU needed); print registers,
    /// shared memory and spills.
    CudaCheck {
        /// Target architecture.
        #[arg(long, default_value = cuda::CHECK_ARCH)]
        arch: String,
    },
    /// The Hopper engine's local GEMM against cuBLAS on the overlapped plans' shapes (GPU).
    GemmSweep(sweep::Args),
    /// Mutate every corpus plan and report how many mutants the checks catch.
    Mutants(mutants::Args),
    /// Feed the case-file, plan-file and .npy parsers mutated inputs for a bounded time;
    /// fail on a panic or a hang.
    Fuzz(fuzz::Args),
    /// Simulate a plan on a hardware profile (or time it on the reference); --validate
    /// prints the validation table.
    Simulate(Box<simulate::Args>),
    /// Rank candidate plans (1D, simulated) or 2D configurations (closed form, leaders simulated).
    Tune(Box<tune::Args>),
    /// Build the folder a GPU machine runs every CUDA check from (binaries, corpus,
    /// goldens, run.sh); see docs/cuda.md.
    GpuBundle(bundle::Args),
    /// Summarise a bundle run's logs (called by the bundle's run.sh).
    #[command(hide = true)]
    GpuBundleSummary(bundle::SummaryArgs),
    /// One rank worker of `conformance --backend cuda --processes` (started by it: reads
    /// requests on stdin, answers on stdout).
    #[command(hide = true)]
    RankWorker,
    /// Formatting, clippy, tests, the CUDA compile check, the GPU bundle, the corpus
    /// under four interleavings and one process per device (fake CUDA driver), the
    /// fuzzers, the mutants; stops at the first failure.
    Ci {
        /// Everything but the mutants (a few minutes instead of about ten).
        #[arg(long)]
        quick: bool,
        /// Also fuzz the parsers, this many seconds per target.
        #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "20")]
        fuzz: Option<u64>,
    },
}

/// The workspace root (the parent of this crate).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Whether this process set `LP_NUM_THREADS` ([`lavapipe_on_the_calling_thread`]), so
/// that the commands it spawns can be given the user's environment back.
static LAVAPIPE_PINNED: AtomicBool = AtomicBool::new(false);

/// lavapipe (Mesa's CPU Vulkan driver) splits each dispatch over a pool of threads and
/// wakes the pool for each; the corpus's dispatches are small, so on 2 cores the wake-ups
/// cost more than they save (`conformance --schedules 4`: 24.4 s with the pool, 15.8 s
/// without). The correctness commands run lavapipe on the calling thread
/// (`LP_NUM_THREADS=0`) unless the user chose; other drivers ignore the variable. The
/// bench and the reference's timed runs keep the pool: they time the reference.
fn lavapipe_on_the_calling_thread() {
    if std::env::var_os("LP_NUM_THREADS").is_none() {
        // Set before any thread of this process exists.
        std::env::set_var("LP_NUM_THREADS", "0");
        LAVAPIPE_PINNED.store(true, Ordering::Relaxed);
    }
}

/// Gives a spawned command the environment the user started this process with.
fn with_user_environment(command: &mut std::process::Command) -> &mut std::process::Command {
    if LAVAPIPE_PINNED.load(Ordering::Relaxed) {
        command.env_remove("LP_NUM_THREADS");
    }
    command
}

fn main() -> ExitCode {
    cmm_cli::end_quietly_on_a_closed_pipe();
    cmm_cli::no_wayland_display_without_a_session();
    // Before any thread and any CUDA call (the driver reads them at cuInit).
    cmm_cuda::driver_environment_unless_chosen();
    let cli = Cli::parse();
    if matches!(cli.command, Command::Conformance(_) | Command::Mutants(_) | Command::Ci { .. }) {
        lavapipe_on_the_calling_thread();
    }
    let result = match cli.command {
        Command::Conformance(args) => conformance::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Mutants(args) => mutants::run(&args),
        Command::Fuzz(args) => fuzz::run(&args),
        Command::CudaCheck { arch } => cuda::cuda_check(&arch),
        Command::GemmSweep(args) => sweep::run(&args),
        Command::Simulate(args) => simulate::run(&args),
        Command::Tune(args) => tune::run(&args),
        Command::GpuBundle(args) => bundle::run(&args),
        Command::GpuBundleSummary(args) => bundle::summarise(&args),
        Command::RankWorker => cmm_cuda::serve_rank_worker().map_err(Into::into),
        Command::Ci { quick, fuzz } => ci::run(quick, fuzz),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", cmm_cli::describe_error(&e));
            ExitCode::FAILURE
        }
    }
}
