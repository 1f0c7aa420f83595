//! `cargo xtask conformance [--bless] [--filter P] [--export DIR] [--backend B] [--schedules N] [--stats]
//! [--cases DIR] [--goldens DIR] [--sync S] [--case-timeout SECS] [--stamps DIR] [--report FILE]`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use cmm_conformance::{
    cases_dir, check_report_path, load_corpus, run_corpus, write_report, Backend, CpuTwin, Cuda, Goldens, Options,
};
use cmm_core::DType;
use cmm_cuda::{
    CopyIssue, CudaBackend, CudaExecutor, CudaRunOptions, GemmEngine, HopperTile, HopperVariant, HostTwin, RankPool,
};
use cmm_reference::Reference;

use crate::stamps::Sync;

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
    /// The CUDA backend's lowering and kernels on the CPU (the host twin: the kernel
    /// sources compiled by the system C++ compiler); no GPU needed.
    CudaHost,
}

impl BackendKind {
    /// The name `--backend` takes.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Reference => "reference",
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::CudaHost => "cuda-host",
        }
    }
}

/// Arguments of `cargo xtask conformance`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Write the goldens of cases that pass the oracle check (then commit them).
    #[arg(long)]
    pub bless: bool,
    /// Run only the cases whose name contains this substring (or one of several,
    /// separated by commas: `ring_d2_,ring_push_d2_`), and none written `!part`
    /// (`!fused_push`: every case but those).
    #[arg(long, value_name = "P")]
    pub filter: Option<String>,
    /// Run only the cases whose input dtype is one of these (comma-separated:
    /// `--input f16,bf16`).
    #[arg(long = "input", value_name = "DTYPES", value_delimiter = ',')]
    pub inputs: Vec<DType>,
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
    /// The corpus directory [default: $CMM_CASES_DIR, else conformance/cases of this
    /// source tree].
    #[arg(long, value_name = "DIR")]
    pub cases: Option<PathBuf>,
    /// The golden directory [default: $CMM_GOLDEN_DIR, else conformance/golden].
    #[arg(long, value_name = "DIR")]
    pub goldens: Option<PathBuf>,
    /// CUDA and its host twin: how signals and waits are issued.
    #[arg(long, value_enum, default_value = "kernels")]
    pub sync: Sync,
    /// CUDA only: the time limit of each run of a case, in seconds (past it the run is
    /// aborted, drained and reported as a failure); on the fake driver also each wait's.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub case_timeout: u64,
    /// CUDA only: do not hold the lanes behind the gate until the plan is enqueued (for
    /// tools that make launches blocking or serialise GPU work, such as
    /// compute-sanitizer; the reported time then includes enqueueing).
    #[arg(long)]
    pub ungated: bool,
    /// CUDA only: launch signals, waits and SM copies at the default priority like every
    /// other kernel, not at the GPU's greatest (to tell whether a difference comes from it).
    #[arg(long)]
    pub no_comm_priority: bool,
    /// CUDA only: with D virtual devices on one GPU, run each device's lanes at a
    /// staggered stream priority (device order, below communication), as the bench's
    /// `staggered` column does; results must not change.
    #[arg(long)]
    pub stagger: bool,
    /// CUDA only: with D virtual devices on one GPU, start device d's first GEMM after
    /// device d − 1's (waits added, results unchanged; a plan that would deadlock, or with
    /// tile-granular GEMMs, fails with the reason).
    #[arg(long)]
    pub offset_starts: bool,
    /// CUDA and cuda-host only: f16/bf16 GEMMs on the tile kernels, fused ones included,
    /// take 128×128 tiles of 8 warps instead of 64×64 tiles of 4 (as the bench's
    /// `wide tiles` figures do); results must not change beyond the tolerance.
    #[arg(long)]
    pub wide_tiles: bool,
    /// CUDA only: every GEMM runs on cmm's own kernels (never cuBLAS), and on the Hopper
    /// engine (`hopper.cu`) wherever the GPU runs it and TMA's rules allow; the others on
    /// the tile kernels. The run ends with how many GEMMs each engine ran.
    #[arg(long)]
    pub hopper: bool,
    /// CUDA only: no GEMM runs on the Hopper engine, even where the GPU runs it (the
    /// fused plans then take the tile kernels, as on GPUs before Hopper).
    #[arg(long, conflicts_with = "hopper")]
    pub no_hopper: bool,
    /// CUDA only, with --hopper: the Hopper engine's tile for every GEMM it runs
    /// (default: its rule's choice, 128×128 on the corpus's small shapes).
    #[arg(long, value_enum, value_name = "TILE")]
    pub hopper_tile: Option<HopperTileArg>,
    /// CUDA and cuda-host only, with --hopper: which of the engine's kernels its GEMMs
    /// take (default: the engine's own). `pair` runs every plain GEMM whose B is N-major in
    /// clusters of two that multicast B (a transposed B keeps the engine's own; fused and
    /// grouped GEMMs keep theirs); the run's counts say how many ran in clusters.
    /// `pingpong` runs every GEMM on the 128×128 tile (plain, fused, grouped) with its
    /// consumer warpgroups on alternate tiles; with `--hopper-tile narrow`, all of them.
    /// `shallow`: the engine's tiles with fewer stages. `staged-gather`: the engine's
    /// kernels, ag_moe's gathered rows staged in order first and loaded by TMA on every
    /// shape (the engine does so from 512 columns). `in-kernel-gather`: the engine's
    /// kernels, ag_moe's gathered rows copied by the producer warpgroup on every shape.
    /// `reader-fence`: as `in-kernel-gather`, the rows fenced by the consumers, as before
    /// 2026-11-28.
    /// `tma-store`: C staged in shared memory and stored by TMA (whole tiles of GEMMs
    /// that do not accumulate; the others from registers).
    #[arg(long, value_name = "KERNELS", value_parser = HopperVariant::parse)]
    pub hopper_variant: Option<HopperVariant>,
    /// CUDA only: how the copy-engine copies are issued: `auto` (default: contiguous ones
    /// through `cuMemcpyBatchAsync` asking the driver to keep them off the SMs, strided ones
    /// as `driver`; all as `driver` where the call is missing), `driver`
    /// (`cuMemcpy2DAsync`: the driver picks the hardware, within one GPU possibly its SMs)
    /// or `copy-engines` (every copy through `cuMemcpyBatchAsync`, a strided one a row at a
    /// time).
    #[arg(long, value_name = "HOW", value_parser = CopyIssue::parse)]
    pub copies: Option<CopyIssue>,
    /// CUDA only: run each device of each case in a process of its own (rank workers,
    /// `CudaBackend::run_rank`: a symmetric heap shared through CUDA VMM handles, a
    /// Unix-socket rendezvous), all on GPU 0, as a torchrun job does on one GPU.
    #[arg(long)]
    pub processes: bool,
    /// CUDA only: CTAs per SM of each fused plan's persistent kernel (default 1; more is
    /// refused unless every SM has room for one more, and on the host twin, which has no SMs).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=32))]
    pub fused_ctas_per_sm: u32,
    /// CUDA only: SMs that the fused plans' persistent kernels leave free of their CTAs,
    /// for the signals, waits and copies (default: one where a CTA fills an SM).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub fused_free_sms: Option<u32>,
    /// CUDA only: where the conformance stamps go [default: $CMM_STAMP_DIR, else
    /// target/cuda-stamps].
    #[arg(long, value_name = "DIR")]
    pub stamps: Option<PathBuf>,
    /// Also write a machine-readable report: JSON for FILE.json, JUnit XML for FILE.xml
    /// (one test case per corpus case).
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
}

impl Args {
    /// The arguments of a plain run on `backend` (what `cargo xtask ci` uses).
    pub fn plain(backend: BackendKind, schedules: u32) -> Args {
        Args {
            bless: false,
            filter: None,
            inputs: Vec::new(),
            export: None,
            backend,
            schedules,
            stats: false,
            cases: None,
            goldens: None,
            sync: Sync::Kernels,
            case_timeout: 60,
            ungated: false,
            no_comm_priority: false,
            stagger: false,
            offset_starts: false,
            wide_tiles: false,
            hopper: false,
            no_hopper: false,
            hopper_tile: None,
            hopper_variant: None,
            copies: None,
            fused_ctas_per_sm: 1,
            fused_free_sms: None,
            processes: false,
            stamps: None,
            report: None,
        }
    }

    /// The corpus directory these arguments select.
    pub fn cases_dir(&self) -> PathBuf {
        self.cases.clone().unwrap_or_else(cases_dir)
    }

    /// The first CUDA-only option given with a backend that is not CUDA's (it would be
    /// ignored, and the run would pass for what it did not check).
    fn cuda_only_flag(&self) -> Option<&'static str> {
        if matches!(self.backend, BackendKind::Cuda | BackendKind::CudaHost) {
            return None;
        }
        [
            (self.sync != Sync::Kernels, "--sync memops"),
            (self.ungated, "--ungated"),
            (self.no_comm_priority, "--no-comm-priority"),
            (self.stagger, "--stagger"),
            (self.offset_starts, "--offset-starts"),
            (self.wide_tiles, "--wide-tiles"),
            (self.hopper, "--hopper"),
            (self.no_hopper, "--no-hopper"),
            (self.hopper_tile.is_some(), "--hopper-tile"),
            (self.hopper_variant.is_some(), "--hopper-variant"),
            (self.copies.is_some(), "--copies"),
            (self.fused_ctas_per_sm != 1, "--fused-ctas-per-sm"),
            (self.fused_free_sms.is_some(), "--fused-free-sms"),
            (self.stamps.is_some(), "--stamps"),
            (self.processes, "--processes"),
        ]
        .into_iter()
        .find_map(|(given, flag)| given.then_some(flag))
    }

    fn cuda_options(&self) -> CudaRunOptions {
        let defaults = CudaRunOptions::default();
        let run_timeout = Duration::from_secs(self.case_timeout);
        CudaRunOptions {
            sync: self.sync.mode(),
            run_timeout,
            // On the fake driver the kernels run on this machine's shared CPU: a wait gets
            // the case's whole time, not a GPU's (`cmm_cuda::EMULATED_WAIT_TIMEOUT` says why).
            wait_timeout: if cmm_cuda::fake::requested() { run_timeout } else { defaults.wait_timeout },
            gate: defaults.gate && !self.ungated,
            comm_priority: !self.no_comm_priority,
            stagger: self.stagger,
            offset_starts: self.offset_starts,
            wide_tiles: self.wide_tiles,
            fused_ctas_per_sm: self.fused_ctas_per_sm,
            fused_free_sms: self.fused_free_sms,
            gemm: if self.hopper { GemmEngine::TileKernel } else { defaults.gemm },
            hopper: !self.no_hopper,
            hopper_tile: self.hopper_tile.map(HopperTileArg::tile),
            hopper_variant: self.hopper_variant.unwrap_or(defaults.hopper_variant),
            copies: self.copies.unwrap_or(defaults.copies),
            ..defaults
        }
    }
}

/// The Hopper engine's tiles, as `--hopper-tile` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HopperTileArg {
    /// 128×256.
    Wide,
    /// 128×128.
    Narrow,
}

impl HopperTileArg {
    pub(crate) fn tile(self) -> HopperTile {
        match self {
            HopperTileArg::Wide => HopperTile::Wide,
            HopperTileArg::Narrow => HopperTile::Narrow,
        }
    }
}

/// Starts the chosen backend and prints which adapter runs the work.
pub fn make_backend(args: &Args) -> Result<Box<dyn Backend>> {
    Ok(match args.backend {
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
        BackendKind::Cuda => Box::new(start_cuda(args)?),
        BackendKind::CudaHost => {
            let twin = HostTwin::new().context("cannot build the host twin of the CUDA kernels")?;
            let host = Cuda::new(twin, args.cuda_options());
            println!("adapter: none ({})", host.name());
            Box::new(host)
        }
    })
}

fn start_cuda(args: &Args) -> Result<Cuda> {
    let backend = CudaBackend::new(1).context("cannot start the CUDA backend")?;
    let cuda = Cuda::new(backend, args.cuda_options());
    println!("adapter: {}", cuda.name());
    Ok(cuda)
}

/// Comma-separated name parts of cases to leave out of every run (`fused_push`): the GPU
/// bundle sets it when a probe finds a family that cannot finish on the machine, so that
/// later steps do not spend their time limits on it (the run says so).
pub const EXCLUDE_VAR: &str = "CMM_CONFORMANCE_EXCLUDE";

/// `filter` with each part of `excluded` (comma-separated) left out, as `!part`.
fn with_exclusions(filter: Option<String>, excluded: Option<&str>) -> Option<String> {
    let parts: Vec<String> =
        excluded.into_iter().flat_map(|e| e.split(',')).filter(|p| !p.is_empty()).map(|p| format!("!{p}")).collect();
    if parts.is_empty() {
        return filter;
    }
    println!("cases left out ({EXCLUDE_VAR}): {}", parts.join(","));
    Some(filter.into_iter().chain(parts).collect::<Vec<_>>().join(","))
}

/// Runs the corpus; fails when any case fails.
pub fn run(args: &Args) -> Result<()> {
    let (cases_dir, golden_dir) = (args.cases_dir(), args.goldens.clone().unwrap_or_else(Goldens::default_dir));
    let protected: [(&str, &std::path::Path); 2] = [("the corpus", &cases_dir), ("the goldens", &golden_dir)];
    if let Some(path) = &args.report {
        check_report_path(path, &protected)?;
    }
    if args.bless && matches!(args.backend, BackendKind::Cuda | BackendKind::CudaHost) {
        bail!("--bless writes goldens from the reference (or its CPU twin), never from the CUDA executor they judge");
    }
    if let Some(flag) = args.cuda_only_flag() {
        bail!(
            "{flag} applies to the CUDA executor (--backend cuda or cuda-host), not to --backend {}",
            args.backend.name()
        );
    }
    let options = Options {
        filter: with_exclusions(args.filter.clone(), std::env::var(EXCLUDE_VAR).ok().as_deref()),
        inputs: args.inputs.clone(),
        bless: args.bless,
        export: args.export.clone(),
        schedules: args.schedules as usize,
        stats: args.stats,
        cases_dir: cases_dir.clone(),
        golden_dir: golden_dir.clone(),
    };
    if args.hopper_tile.is_some() && !args.hopper {
        bail!("--hopper-tile chooses the Hopper engine's tile: give --hopper too");
    }
    if args.hopper_variant.is_some() && !args.hopper {
        bail!("--hopper-variant chooses the Hopper engine's kernels: give --hopper too");
    }
    if args.copies.is_some() && args.backend == BackendKind::CudaHost {
        bail!("--copies chooses the driver call that issues each copy (--backend cuda; CMM_FAKE_CUDA=1 without a GPU), not the host twin's");
    }
    if args.processes && args.backend == BackendKind::CudaHost {
        bail!("--processes runs ranks on the CUDA driver (--backend cuda; CMM_FAKE_CUDA=1 without a GPU), not on the host twin");
    }
    if args.processes && (args.stagger || args.offset_starts || args.stamps.is_some()) {
        bail!("--stagger, --offset-starts and --stamps apply to one process driving every device, not to --processes");
    }
    if args.backend == BackendKind::Cuda && args.processes {
        let exe = std::env::current_exe().context("finding this program, to start rank workers")?;
        let pool = RankPool::new(Box::new(move || {
            let mut command = std::process::Command::new(&exe);
            command.arg("rank-worker");
            command
        }))
        .context("starting the rank pool")?;
        let cuda = Cuda::new(pool, args.cuda_options());
        println!("adapter: {}", cuda.name());
        let summary = run_corpus(&cuda, &options).context("conformance run")?;
        println!("GEMM engines over the run: {}", cuda.engines().describe());
        return finish(args, &summary, &protected);
    }
    if args.backend == BackendKind::Cuda {
        let cuda = start_cuda(args)?;
        if args.hopper && !cuda.backend.has_hopper_engine() {
            bail!("--hopper: this GPU does not run the Hopper engine (it needs compute capability 9.0)");
        }
        let summary = run_corpus(&cuda, &options).context("conformance run")?;
        println!("GEMM engines over the run: {}", cuda.engines().describe());
        let corpus = load_corpus(&options.cases_dir).context("loading the corpus for the stamp")?;
        crate::stamps::write_stamp(&cuda.backend, args.sync, args.stamps.as_deref(), &corpus, &summary)?;
        return finish(args, &summary, &protected);
    }
    if args.backend == BackendKind::CudaHost {
        let host =
            Cuda::new(HostTwin::new().context("cannot build the host twin of the CUDA kernels")?, args.cuda_options());
        println!("adapter: none ({})", host.name());
        let summary = run_corpus(&host, &options).context("conformance run")?;
        println!("GEMM engines over the run: {}", host.engines().describe());
        return finish(args, &summary, &protected);
    }
    let backend = make_backend(args)?;
    let summary = run_corpus(backend.as_ref(), &options).context("conformance run")?;
    finish(args, &summary, &protected)
}

fn finish(
    args: &Args,
    summary: &cmm_conformance::Summary,
    protected: &cmm_conformance::report::Protected<'_>,
) -> Result<()> {
    if let Some(path) = &args.report {
        write_report(path, "cmm conformance", &summary.backend, &summary.records, protected)?;
        println!("report: {}", path.display());
    }
    if summary.failed > 0 {
        bail!("{} of {} conformance cases failed", summary.failed, summary.failed + summary.passed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excluded_parts_join_the_filter_as_exclusions() {
        assert_eq!(with_exclusions(None, None), None);
        assert_eq!(with_exclusions(Some("ring".into()), Some("")), Some("ring".into()));
        assert_eq!(with_exclusions(None, Some("fused_push")), Some("!fused_push".into()));
        let both = with_exclusions(Some("gemm_rs".into()), Some("fused_push,_d8_")).unwrap();
        assert_eq!(both, "gemm_rs,!fused_push,!_d8_");
        assert!(cmm_conformance::name_matches(&both, "gemm_rs_ring_d4_bf16_bf16_realistic"));
        assert!(!cmm_conformance::name_matches(&both, "gemm_rs_fused_push_d4_f16_f16_realistic"));
    }

    #[test]
    fn cuda_only_options_are_refused_where_they_would_be_ignored() {
        let wide = |backend| Args { wide_tiles: true, ..Args::plain(backend, 1) };
        assert_eq!(wide(BackendKind::Cpu).cuda_only_flag(), Some("--wide-tiles"));
        assert_eq!(wide(BackendKind::Reference).cuda_only_flag(), Some("--wide-tiles"));
        assert_eq!(wide(BackendKind::CudaHost).cuda_only_flag(), None);
        assert_eq!(wide(BackendKind::Cuda).cuda_only_flag(), None);
        let memops = Args { sync: Sync::Memops, ..Args::plain(BackendKind::Reference, 1) };
        assert_eq!(memops.cuda_only_flag(), Some("--sync memops"));
        assert_eq!(Args::plain(BackendKind::Reference, 4).cuda_only_flag(), None);
    }
}
