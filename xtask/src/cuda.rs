//! CUDA tasks: `cargo xtask cuda-check` (compile every kernel without a GPU) and
//! `cargo xtask bench --backend cuda` (only what the conformance stamp allows).

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use cmm_cli::bench_file::{PlanFigures, PlanTimes};
use cmm_conformance::golden::fnv1a64;
use cmm_core::oracle::spot_check;
use cmm_core::plan::OpSite;
use cmm_core::workload::output_tolerance;
use cmm_core::{build_plan, build_plan_with, Algorithm, BaselineSums, DType, Family, Op, OpKind, Plan, Problem};
use cmm_cuda::kernels::{compile, image_file_name, nvrtc_available, parse_ptxas_verbose, DEFAULT_ARCH, KERNEL_FILES};
use cmm_cuda::{
    CopyIssue, CudaBackend, CudaExecutor, CudaRunOptions, GemmEngine, GemmSpec, HopperTile, HopperVariant, ReadBack,
};
use cmm_sim::validate::seed000_problem;
use serde::Serialize;

use crate::stamps::{stamped, Sync};
use crate::timing::time_plan;

/// `cargo xtask cuda-check`: NVRTC to PTX, then `ptxas -v` for `arch`, per kernel file.
/// The cubins go to [`images_dir`] under their keyed names: the GPU bundle carries them,
/// so that the kernels a GPU runs are the ones checked here, and it compiles nothing.
pub fn cuda_check(arch: &str) -> Result<()> {
    if !nvrtc_available() {
        bail!(
            "libnvrtc cannot be loaded. Install it without a GPU with \
             `python3 -m pip install --target ~/.cache/cmm/cuda-13.0.88 nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88` \
             and export LD_LIBRARY_PATH=~/.cache/cmm/cuda-13.0.88/nvidia/cu13/lib CMM_PTXAS=~/.cache/cmm/cuda-13.0.88/nvidia/cu13/bin/ptxas \
             (what .ci/run does)"
        );
    }
    let ptxas = std::env::var_os("CMM_PTXAS").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("ptxas"));
    let out_dir = crate::workspace_root().join("target").join("cuda-check");
    fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    println!(
        "{:<12} {:<28} {:>9} {:>11} {:>12} {:>11}",
        "file", "kernel", "registers", "smem bytes", "spill stores", "spill loads"
    );
    let mut spilling = Vec::new();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Every file's NVRTC and ptxas on its own worker, the longest (by source size) first,
    // so that the other files compile beside hopper.cu (most of the check); reported in file order.
    let mut order: Vec<usize> = (0..KERNEL_FILES.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(KERNEL_FILES[i].source.len()));
    let next = std::sync::Mutex::new(order.into_iter());
    let mut results: Vec<Option<Result<std::process::Output>>> = (0..KERNEL_FILES.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.min(KERNEL_FILES.len()))
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    while let Some(i) = next.lock().expect("a worker panicked").next() {
                        done.push((i, compile_and_assemble(&KERNEL_FILES[i], arch, &ptxas, &out_dir, threads)));
                    }
                    done
                })
            })
            .collect();
        for worker in workers {
            for (i, outcome) in worker.join().expect("a compile worker panicked") {
                results[i] = Some(outcome);
            }
        }
    });
    for (kernel, outcome) in KERNEL_FILES.iter().zip(results) {
        let output = outcome.context("a compile worker stopped early")??;
        let log = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            bail!("ptxas failed on {} for {arch}:\n{log}", kernel.name);
        }
        // ptxas says so when it serialises wgmma (C7518) or ignores setmaxnreg (C7508):
        // either costs the Hopper engine most of its rate.
        let slow: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("(C7518)") || l.contains("(C7508)") || l.contains("serialized"))
            .collect();
        if !slow.is_empty() {
            bail!("ptxas on {} for {arch}:\n{}", kernel.name, slow.join("\n"));
        }
        let usage = parse_ptxas_verbose(&log);
        for entry in kernel.entry_points {
            let u = usage
                .iter()
                .find(|u| u.function == *entry)
                .with_context(|| format!("ptxas reported nothing for {entry} in {}", kernel.name))?;
            println!(
                "{:<12} {:<28} {:>9} {:>11} {:>12} {:>11}",
                kernel.name, u.function, u.registers, u.shared_bytes, u.spill_stores, u.spill_loads
            );
            if u.spill_stores > 0 || u.spill_loads > 0 {
                spilling.push(format!("{} ({})", u.function, kernel.name));
            }
        }
    }
    // A spill in a GEMM's inner loop costs more than any overlap wins back.
    if !spilling.is_empty() {
        bail!("registers spill to local memory in {} for {arch}", spilling.join(", "));
    }
    // Only cubins of a check that passed whole are kept under their keyed names.
    fs::create_dir_all(images_dir()).with_context(|| format!("creating {}", images_dir().display()))?;
    for kernel in KERNEL_FILES {
        let (from, to) =
            (out_dir.join(format!("{}.cubin", kernel.name)), images_dir().join(image_file_name(&kernel, arch)));
        fs::copy(&from, &to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    }
    println!(
        "every kernel compiled for {arch} without spills (PTX in {}, cubins in {})",
        out_dir.display(),
        images_dir().display()
    );
    Ok(())
}

/// NVRTC on `kernel` to PTX in `out_dir`, then `ptxas -v` on it to a cubin there. The PTX
/// comes from the backend's disk cache where NVRTC already made it (keyed by the source,
/// architecture, options and NVRTC's version: the tests compile every file first);
/// `CMM_PTX_CACHE=0` compiles afresh. ptxas always runs.
fn compile_and_assemble(
    kernel: &cmm_cuda::kernels::KernelFile,
    arch: &str,
    ptxas: &Path,
    out_dir: &Path,
    threads: usize,
) -> Result<std::process::Output> {
    let ptx = compile(kernel, arch).with_context(|| format!("NVRTC on {}", kernel.name))?;
    let ptx_path = out_dir.join(format!("{}.ptx", kernel.name));
    fs::write(&ptx_path, ptx).with_context(|| format!("writing {}", ptx_path.display()))?;
    Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-v")
        // Entry points compile in parallel (hopper.cu's take most of the check); the
        // code is the same as one at a time, only the toolkit note differs.
        .arg("--split-compile")
        .arg(threads.to_string())
        .arg(&ptx_path)
        .arg("-o")
        .arg(out_dir.join(format!("{}.cubin", kernel.name)))
        .output()
        .with_context(|| format!("running {} (set CMM_PTXAS or put ptxas on PATH)", ptxas.display()))
}

/// Where `cuda-check` leaves the cubins it checked, named by [`image_file_name`].
pub fn images_dir() -> PathBuf {
    crate::workspace_root().join("target").join("cuda-check").join("images")
}

/// The default architecture of `cuda-check`.
pub const CHECK_ARCH: &str = DEFAULT_ARCH;

/// What the CUDA bench measures with.
#[derive(Debug)]
pub struct BenchSettings {
    /// Timed repetitions (the median is reported).
    pub reps: usize,
    /// How signals and waits are issued.
    pub sync: Sync,
    /// Stamp directory.
    pub stamps: Option<PathBuf>,
    /// Where the JSON goes.
    pub json: Option<PathBuf>,
    /// Every dimension divided by this (1: the seed-000 shape).
    pub shrink: usize,
    /// Where to write the timelines of a few runs (none if unset).
    pub timelines: Option<PathBuf>,
    /// Time only the plans of these algorithm names (all when empty) and the direct
    /// baseline.
    pub algorithms: Vec<String>,
    /// The Hopper engine's tile for the fused plans (`None`: its rule's choice).
    pub hopper_tile: Option<HopperTile>,
    /// The Hopper engine's kernels for the fused plans.
    pub hopper_variant: HopperVariant,
}

impl BenchSettings {
    /// The Hopper engine's tile and kernels the flags chose for the fused plans, as a
    /// label ("128x128, pingpong kernels"); `None` where they chose nothing.
    fn hopper_choice(&self) -> Option<String> {
        let tile = self.hopper_tile.map(|t| t.name().to_string());
        let kernels =
            (self.hopper_variant != HopperVariant::Engine).then(|| format!("{} kernels", self.hopper_variant.key()));
        let chosen: Vec<String> = tile.into_iter().chain(kernels).collect();
        (!chosen.is_empty()).then(|| chosen.join(", "))
    }
}

/// A variant's result, or `None` and a `variant failed: {what}: …` line, printed and kept
/// in `failed` (the row's `variant_failures`), so one failed run costs only its column.
fn or_failed<T, E: std::fmt::Display>(result: Result<T, E>, what: String, failed: &mut Vec<String>) -> Option<T> {
    match result {
        Ok(t) => Some(t),
        Err(e) => {
            let line = format!("variant failed: {what}: {e:#}");
            println!("{line}");
            failed.push(line);
            None
        }
    }
}

/// One timed plan.
#[derive(Debug, Serialize)]
struct Row {
    /// The plan and its times, plain and in each variant taken (`simulate
    /// --validate-bench` reads them back).
    #[serde(flatten)]
    plan: PlanTimes,
    /// The bound, the baseline and the ratios.
    #[serde(flatten)]
    figures: PlanFigures,
    gated: bool,
    /// The plan again with signals, waits and SM copies at the default priority (null
    /// where the GPU has one priority, and for the baseline, which is timed once).
    time_without_comm_priority_us: Option<f64>,
    /// The largest error of the spot-checked output elements, as a fraction of what the
    /// tolerance allows (≤ 1: right at this shape).
    spot_check_worst: f64,
    /// The variants (staggered, offsets, wide tiles, 2 CTAs per SM, free SMs, SM copies, copy engines, no prio,
    /// the baseline's sums in series)
    /// whose run failed, each with its error; their times are null.
    variant_failures: Vec<String>,
    /// A fused plan on the Hopper engine: the share of its persistent kernels' CTA time
    /// spent in their blocks' waits, from one more plain run (null for the other plans).
    fused_wait_share: Option<f64>,
    /// A GEMM+RS / GEMM+AR baseline again with its sums in series (`BaselineSums::InSeries`,
    /// the plan before the sum lane: the ring's between its copies, the direct one's
    /// after its last block), in the same run: what adding them up beside the copies
    /// saved (null for the other plans; where the two are one plan, the run-to-run noise).
    time_sums_in_series_us: Option<f64>,
    /// The GEMM shapes `gemm_sum_us` sums, one per GEMM op.
    #[serde(skip)]
    gemm_specs: Vec<GemmSpec>,
    /// Whether the plan moves data between devices by copies (`ring_push` does not: its
    /// GEMMs write the owners' sums).
    #[serde(skip)]
    copies: bool,
}

/// A plan's times besides its plain one, where taken (µs), and the runs that failed.
#[derive(Clone, Debug, Default)]
struct Variants {
    staggered: Option<f64>,
    offset: Option<f64>,
    wide_tiles: Option<f64>,
    two_ctas_per_sm: Option<f64>,
    tile_kernel: Option<f64>,
    free_sms: Option<f64>,
    sm_copies: Option<f64>,
    copy_engines: Option<f64>,
    driver_copies: Option<f64>,
    /// One line per variant whose run failed (its time is then missing).
    failed: Vec<String>,
}

impl Variants {
    /// `plain` (a plan's plain time) with these times, and the failures.
    fn times(self, plain: PlanTimes) -> (PlanTimes, Vec<String>) {
        let times = PlanTimes {
            time_staggered_us: self.staggered,
            time_offset_us: self.offset,
            time_wide_tiles_us: self.wide_tiles,
            time_two_ctas_per_sm_us: self.two_ctas_per_sm,
            time_tile_kernel_us: self.tile_kernel,
            time_free_sms_us: self.free_sms,
            time_sm_copies_us: self.sm_copies,
            time_copy_engines_us: self.copy_engines,
            time_driver_copies_us: self.driver_copies,
            ..plain
        };
        (times, self.failed)
    }
}

impl Row {
    /// The fastest of the plan's times.
    fn best_us(&self) -> f64 {
        self.plan.fastest_us()
    }
}

/// Output elements per device that the bench checks against the f64 oracle, at the
/// bench's own shape, before it times a plan: the corpus's conformance stamp covers
/// small shapes only, and an index that overflows shows at large ones.
const SPOT_CHECKS: usize = 32;

/// One run of `plan` with its output read back and [`SPOT_CHECKS`] elements per device
/// compared with the oracle: `Ok(worst)` (the largest error over its allowance), or
/// `Err(why)` when an element is wrong.
fn spot_checked(
    backend: &CudaBackend,
    problem: &Problem,
    plan: &Plan,
    options: &CudaRunOptions,
) -> Result<std::result::Result<f64, String>> {
    const SEED: u32 = 7;
    let options = CudaRunOptions { read_back: ReadBack::Results, cold_l2: false, ..*options };
    let out = backend
        .run(plan, SEED, Family::Realistic, &options)
        .with_context(|| format!("the spot-checked run of {}", plan.name))?;
    let c = plan.buffer_id("C").with_context(|| format!("{} has no output buffer C", plan.name))?;
    let decl = plan.buffer(c);
    let window = cmm_core::ShardedGemm::output_window_of(problem, 0);
    if (decl.rows, decl.cols) != (window.rows, window.cols) {
        bail!("{}: C is {}x{}, the problem's output {}x{}", plan.name, decl.rows, decl.cols, window.rows, window.cols);
    }
    let got = |d: usize, r: usize, col: usize| {
        let word = out.buffers.get(d).and_then(|b| b.get(c.0)).and_then(|w| w.get(r * decl.cols + col));
        word.map_or(f64::NAN, |&w| decl.dtype.decode(w) as f64)
    };
    let check = spot_check(problem, SEED, Family::Realistic, &output_tolerance(problem), SPOT_CHECKS, &got);
    Ok(match check.misses.first() {
        None => Ok(check.worst),
        Some(m) => Err(format!(
            "{} of {} spot-checked elements wrong; first: device {} C[{}, {}] = {} where the oracle has {} (± {:.2e})",
            check.misses.len(),
            check.checked,
            m.device,
            m.row,
            m.col,
            m.got,
            m.expected,
            m.allowed
        )),
    })
}

/// The most a plan may take over the sum of its GEMMs alone (issue 10's target).
const BOUND_TARGET: f64 = 1.05;

/// The targets for one op at one D, judged on its fastest overlapped plan: at most
/// [`BOUND_TARGET`] × the Σ-GEMM bound, and at D ≥ 4 faster than the baseline (copies,
/// then one cuBLAS GEMM).
#[derive(Debug, Serialize, PartialEq)]
struct Target {
    op: String,
    devices: usize,
    /// The fastest overlapped plan (`None`: none was timed).
    best: Option<BestPlan>,
    /// Where `best` copies nothing (`ring_push`: its GEMMs write the owners' sums), the
    /// fastest plan that copies, so the line also says whether copies were hidden.
    best_with_copies: Option<BestPlan>,
    within_bound: bool,
    /// `None` where it is not a target (D = 2).
    faster_than_baseline: Option<bool>,
}

/// A target's plan and its ratios.
#[derive(Debug, Serialize, PartialEq)]
struct BestPlan {
    plan: String,
    time_over_gemm_sum: f64,
    /// Over its compute-only twin, where the twin was timed.
    time_over_compute_only: Option<f64>,
    speedup_over_baseline: f64,
}

impl BestPlan {
    /// The ratio the bound judges: over the compute-only twin where timed, else over Σ.
    fn bounded(&self) -> f64 {
        self.time_over_compute_only.unwrap_or(self.time_over_gemm_sum)
    }

    fn ratios(&self) -> String {
        match self.time_over_compute_only {
            Some(t) => format!("{t:.3}× its compute-only twin ({:.3}× Σ GEMMs)", self.time_over_gemm_sum),
            None => format!("{:.3}× Σ GEMMs (no compute-only twin timed)", self.time_over_gemm_sum),
        }
    }
}

impl Target {
    fn met(&self) -> bool {
        self.within_bound && self.faster_than_baseline != Some(false)
    }

    fn line(&self) -> String {
        let head = format!("target {} D={}:", self.op, self.devices);
        let Some(best) = &self.best else {
            return format!("{head} no overlapped plan was timed: NOT MET");
        };
        let (plan, speedup) = (&best.plan, best.speedup_over_baseline);
        let verdict = |met: bool| if met { "met" } else { "NOT MET" };
        let versus = match self.faster_than_baseline {
            Some(faster) => format!("{speedup:.2}× the baseline's speed (> 1: {})", verdict(faster)),
            None => format!("{speedup:.2}× the baseline's speed (not a target at D = {})", self.devices),
        };
        let line =
            format!("{head} {plan} at {} (≤ {BOUND_TARGET}: {}); {versus}", best.ratios(), verdict(self.within_bound));
        match &self.best_with_copies {
            Some(c) => format!(
                "{line}; of the plans with copies, {} at {} and {:.2}× the baseline's speed",
                c.plan,
                c.ratios(),
                c.speedup_over_baseline
            ),
            None => line,
        }
    }
}

/// The targets of every (op, D) of the table, in its order.
fn targets(rows: &[Row]) -> Vec<Target> {
    let mut keys: Vec<(&str, usize)> = Vec::new();
    for row in rows {
        if !keys.contains(&(row.plan.op.as_str(), row.plan.devices)) {
            keys.push((row.plan.op.as_str(), row.plan.devices));
        }
    }
    keys.into_iter()
        .map(|(op, devices)| {
            let overlapped = rows
                .iter()
                .filter(|r| r.plan.op == op && r.plan.devices == devices && !r.plan.algorithm.starts_with("baseline"));
            let fastest = |r: &&Row, other: &&Row| r.best_us().total_cmp(&other.best_us());
            let best = overlapped.clone().min_by(fastest);
            let best_plan = |r: &Row| BestPlan {
                plan: r.plan.algorithm.clone(),
                time_over_gemm_sum: r.figures.time_over_gemm_sum,
                time_over_compute_only: r.figures.compute_only_us.map(|t| r.best_us() / t),
                speedup_over_baseline: r.figures.speedup_over_baseline,
            };
            let best_with_copies =
                best.filter(|r| !r.copies).and_then(|_| overlapped.filter(|r| r.copies).min_by(fastest)).map(best_plan);
            Target {
                op: op.to_string(),
                devices,
                best: best.map(best_plan),
                best_with_copies,
                within_bound: best.map(best_plan).is_some_and(|b| b.bounded() <= BOUND_TARGET),
                faster_than_baseline: (devices >= 4)
                    .then(|| best.is_some_and(|r| r.figures.speedup_over_baseline > 1.0)),
            }
        })
        .collect()
}

/// The saved report.
#[derive(Debug, Serialize)]
struct Report {
    gpu: String,
    sync: &'static str,
    commit: Option<String>,
    reps: usize,
    /// Every dimension divided by this (1: the shapes the table names).
    shrink: usize,
    peak_cublas_tflops: f64,
    /// The priority signals, waits and SM copies ran at, or why they ran at the default.
    comm_priority: String,
    /// The hardware queues the lanes' streams shared (`CUDA_DEVICE_MAX_CONNECTIONS`).
    hardware_queues: usize,
    /// How the plain runs issued copy-engine copies (`CopyIssue::key` of what the
    /// default came to on this driver: `auto` or `driver`).
    copies: &'static str,
    /// Where the GEMM+RS / GEMM+AR baselines' ReduceScatters add their sums up: as
    /// `cmm_core::algorithms::BaselineSums::BySize` says (reports without the key timed them
    /// in series).
    baseline_sums: &'static str,
    local_gemm: String,
    local_cublas_us: f64,
    local_tile_us: f64,
    tile_over_cublas: f64,
    /// The same GEMM on the tile kernel's 128×128 tiles (`CudaRunOptions::wide_tiles`).
    local_wide_tile_us: f64,
    wide_tile_over_cublas: f64,
    rows: Vec<Row>,
    /// The targets, judged on this table (meaningless with `shrink` > 1).
    targets: Vec<Target>,
    /// Whether the bench reached its end. The report is saved after every (op, D), so a
    /// bench stopped early (a device call's time limit) leaves the rows it measured.
    complete: bool,
    /// The one-GPU profile's measurements (after the table).
    calibration: Option<crate::calibrate::Calibration>,
}

impl Report {
    /// Judges the targets on the rows so far and writes the report to `path`.
    fn save(&mut self, path: &Path) -> Result<()> {
        self.targets = targets(&self.rows);
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let json = serde_json::to_string_pretty(self).context("encoding the bench report")?;
        fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))
    }
}

/// A plan's plain time at the bench's shape, or why it has none.
enum Timed {
    /// Median µs, whether gated, and the spot check's worst error over its allowance.
    Done { us: f64, gated: bool, worst: f64 },
    /// The spot check found a wrong element.
    WrongOutput(String),
    /// A run failed.
    Failed(anyhow::Error),
}

/// [`spot_checked`], then [`time_plan`].
fn checked_time(
    backend: &CudaBackend,
    problem: &Problem,
    plan: &Plan,
    options: &CudaRunOptions,
    reps: usize,
    fused: bool,
) -> Timed {
    match spot_checked(backend, problem, plan, options) {
        Err(e) => Timed::Failed(e),
        Ok(Err(why)) => Timed::WrongOutput(why),
        Ok(Ok(worst)) => match time_plan(backend, plan, options, reps, fused) {
            Ok((us, gated)) => Timed::Done { us, gated, worst },
            Err(e) => Timed::Failed(e),
        },
    }
}

/// The share of the fused GEMMs' CTA time that `out`'s run spent in their blocks' waits
/// (`None` where no Hopper engine counted any).
fn wait_share(out: &cmm_cuda::CudaRunOutput) -> Option<f64> {
    let (ctas, wait_ns) = out.fused_waits.iter().fold((0, 0), |(c, w), f| (c + f.ctas, w + f.wait_ns));
    cmm_cuda::FusedWaits { ctas, wait_ns }.share_of(out.gpu_time.as_secs_f64())
}

/// SMs the bench's `free SMs` variant has the fused plans' persistent kernels leave free
/// (against one by default): an eighth of an H100's 132.
const FREE_SMS: u32 = 16;

/// The plan's times with staggered lane priorities (where the GPU has the levels), with
/// its devices' starts offset (not for the fused plans: their tile-granular GEMMs cannot
/// be offset), and for the fused plans on the tile kernel's 128×128 tiles and with two
/// CTAs per SM, and with more SMs left free of their persistent kernels ([`FREE_SMS`]), and
/// for every plan with copy-engine copies with those asked of the copy engines, each as
/// [`time_plan`] measures.
fn variants(
    backend: &CudaBackend,
    problem: &Problem,
    plan: &Plan,
    options: &CudaRunOptions,
    reps: usize,
    stagger: bool,
    fused: bool,
) -> Variants {
    let mut failed = Vec::new();
    // A variant that fails leaves its column empty and says why, rather than ending the
    // bench: the plain times and the other variants still count. The ones that change
    // kernels (wide tiles, CTAs per SM) could change results: their output is spot-checked
    // first, as the plain run's was. Staggering and offsets change only priorities and add
    // waits.
    let mut time_plan_as = |plan: &Plan, wanted: bool, what: &str, changed: CudaRunOptions, check: bool| {
        if !wanted {
            return None;
        }
        let timed = if check {
            match checked_time(backend, problem, plan, &changed, reps, fused) {
                Timed::Done { us, .. } => Ok(us),
                Timed::WrongOutput(why) => Err(format!("wrong output at this shape: {why}")),
                Timed::Failed(e) => Err(format!("{e:#}")),
            }
        } else {
            time_plan(backend, plan, &changed, reps, fused).map(|(us, _)| us).map_err(|e| format!("{e:#}"))
        };
        or_failed(timed, format!("{} {what}", plan.name), &mut failed)
    };
    // The diagnostics of a fused plan's excess over its twin (other kernels, more SMs
    // free, SM copies) are for plans with copies beside their persistent kernels; one
    // without (fused_push) is timed plain, staggered and as its twin, which keeps the
    // bench inside its step's time.
    let diagnosed = fused && plan.ops().any(|(_, op)| matches!(op, cmm_core::plan::Op::Copy { .. }));
    let mut time = |wanted, what: &str, changed, check| time_plan_as(plan, wanted, what, changed, check);
    let staggered = time(stagger, "staggered", CudaRunOptions { stagger: true, ..*options }, false);
    let offset = time(!fused, "offsets", CudaRunOptions { offset_starts: true, ..*options }, false);
    // The tile kernels' variants run with the Hopper engine off (it would take their GEMMs).
    let tiles = CudaRunOptions { hopper: false, ..*options };
    let wide_tiles = time(diagnosed, "wide tiles", CudaRunOptions { wide_tiles: true, ..tiles }, true);
    let two_ctas_per_sm = time(diagnosed, "2 CTAs per SM", CudaRunOptions { fused_ctas_per_sm: 2, ..tiles }, true);
    let tile_kernel = time(diagnosed && options.hopper && backend.has_hopper_engine(), "tile kernel", tiles, true);
    // Whether the persistent kernels starve the kernels their waits depend on (signals,
    // waits, copies on SMs): the same engines with more SMs left to those.
    let more_free = CudaRunOptions { fused_free_sms: Some(FREE_SMS), ..*options };
    let free_sms = time(diagnosed, &format!("{FREE_SMS} SMs free"), more_free, true);
    // Whether the driver's own copies within one GPU take SMs: the same copies asked of
    // the copy engines, which leave the SMs to the GEMMs, and left to the driver. Each
    // where it issues some copy otherwise than the plain run did.
    let batch = backend.batch_copies().is_ok();
    let plain_copies = options.copies.on_driver(batch);
    let copy_engines = time(
        batch && copies_differ(plan, plain_copies, CopyIssue::PreferCopyEngines),
        "copy engines",
        CudaRunOptions { copies: CopyIssue::PreferCopyEngines, ..*options },
        true,
    );
    let driver_copies = time(
        copies_differ(plan, plain_copies, CopyIssue::Driver),
        "driver copies",
        CudaRunOptions { copies: CopyIssue::Driver, ..*options },
        true,
    );
    // The same plan with its copies made by cmm's kernels on the free SMs, against the
    // driver's copies (which within one GPU may be SM kernels of its own).
    let sm_copies = time_plan_as(&cmm_core::emulate::sm_copies(plan), diagnosed, "SM copies", *options, true);
    Variants {
        staggered,
        offset,
        wide_tiles,
        two_ctas_per_sm,
        tile_kernel,
        free_sms,
        sm_copies,
        copy_engines,
        driver_copies,
        failed,
    }
}

/// How the plain runs issue copy-engine copies, in words.
fn copies_line(copies: CopyIssue) -> &'static str {
    match copies {
        CopyIssue::Driver => "copies: every copy-engine copy left to the driver (cuMemcpy2DAsync)",
        CopyIssue::PreferCopyEngines => {
            "copies: every copy-engine copy asked of the copy engines, strided ones a row at a time"
        }
        _ => {
            "copies: contiguous copies asked of the copy engines (cuMemcpyBatchAsync), strided ones left to the driver"
        }
    }
}

/// Whether `a` and `b` issue some copy-engine copy of `plan` differently (through the
/// batched call or not, or as more of its copies).
fn copies_differ(plan: &Plan, a: CopyIssue, b: CopyIssue) -> bool {
    use cmm_cuda::lower::{lower, Command, LowerOptions};
    let options = LowerOptions {
        gemm: GemmEngine::Auto,
        sync: cmm_cuda::SyncMode::Kernels,
        cublas_present: true,
        queues: cmm_core::verify::queues::MAX_QUEUES,
        wide_tiles: false,
        hopper: None,
    };
    // A plan that does not lower fails its plain run first; where it does, every copy
    // command is the same whatever the GEMMs' options.
    lower(plan, &options).is_ok_and(|lowered| {
        lowered.steps.iter().any(|step| match &step.command {
            Some(Command::CopyEngine { src_pitch, dst_pitch, width, rows, .. }) => {
                a.batch_entries(*width, *rows, *src_pitch, *dst_pitch)
                    != b.batch_entries(*width, *rows, *src_pitch, *dst_pitch)
            }
            _ => false,
        })
    })
}

/// Σ over the plan's GEMM ops of the cuBLAS time of the same GEMM alone (memoised per
/// shape): the time the plan's arithmetic takes on one GPU with nothing overlapped.
/// The GEMM shapes of a plan, one entry per GEMM op (empty GEMMs left out).
fn gemm_specs(plan: &Plan) -> Vec<GemmSpec> {
    plan.ops().filter_map(|(_, op)| GemmSpec::of(plan, op)).filter(|spec| spec.m > 0 && spec.n > 0).collect()
}

/// The Σ-GEMM bound of a plan: each of its GEMMs timed alone through cuBLAS, once per
/// shape (kept in `cache`).
fn gemm_sum_us(
    backend: &CudaBackend,
    specs: &[GemmSpec],
    reps: usize,
    cache: &mut HashMap<GemmSpec, f64>,
) -> Result<f64> {
    let mut total = 0.0;
    for spec in specs {
        let us = match cache.get(spec) {
            Some(&us) => us,
            None => {
                let us = time_cublas(backend, spec, reps)?;
                cache.insert(*spec, us);
                us
            }
        };
        total += us;
    }
    Ok(total)
}

fn time_cublas(backend: &CudaBackend, spec: &GemmSpec, reps: usize) -> Result<f64> {
    backend
        .time_gemm(spec, GemmEngine::Cublas, reps)
        .with_context(|| format!("timing a {}x{}x{} GEMM", spec.m, spec.n, spec.k))
}

/// Two timings of one GEMM shape this far apart are reported: the GPU was not in the
/// same state for both.
const BOUND_DRIFT: f64 = 1.10;

/// Times every shape in `cache` again and keeps, per shape, the lower of the two medians
/// (a bound should not carry a moment when the GPU ran slow: seen once on an H100, a
/// shape's first timing 32 % above its others). Returns (shape, first µs, second µs) of
/// every shape whose timings differ by more than [`BOUND_DRIFT`].
fn retime_bounds(
    backend: &CudaBackend,
    cache: &mut HashMap<GemmSpec, f64>,
    reps: usize,
) -> Result<Vec<(GemmSpec, f64, f64)>> {
    let mut drifted = Vec::new();
    for (spec, first) in cache.iter_mut() {
        let second = time_cublas(backend, spec, reps)?;
        if second.max(*first) > BOUND_DRIFT * second.min(*first) {
            drifted.push((*spec, *first, second));
        }
        *first = first.min(second);
    }
    drifted.sort_by_key(|(spec, _, _)| (spec.m, spec.n, spec.k));
    Ok(drifted)
}

/// Sets each row's bound from `cache` (after [`retime_bounds`]); returns the rows whose
/// bound moved by more than 1 %, with their old ÷ Σ.
fn rebound_rows(rows: &mut [Row], cache: &HashMap<GemmSpec, f64>) -> Vec<(usize, f64)> {
    let mut moved = Vec::new();
    for (i, row) in rows.iter_mut().enumerate() {
        let bound: f64 = row.gemm_specs.iter().map(|spec| cache[spec]).sum();
        if (bound - row.figures.gemm_sum_us).abs() > 0.01 * row.figures.gemm_sum_us {
            moved.push((i, row.figures.time_over_gemm_sum));
        }
        row.figures.gemm_sum_us = bound;
        row.figures.time_over_gemm_sum = row.best_us() / bound;
    }
    moved
}

/// `cargo xtask bench --backend cuda`: for ag_gemm and gemm_rs at the seed-000 shape and
/// D = 2, 4, 8 virtual devices on one GPU, each stamped plan beside the direct baseline
/// (copies, then one cuBLAS GEMM) and the sum of its own GEMMs timed alone through
/// cuBLAS (the lower bound on one GPU, where all D² local GEMMs share the chip), and
/// again with every launch at the default priority (where the GPU has priorities); then
/// the tile kernel against cuBLAS on the local GEMM.
pub fn bench(settings: &BenchSettings) -> Result<()> {
    // Names checked before anything runs: a misspelt one would time nothing silently.
    for name in &settings.algorithms {
        Algorithm::parse(name, None)
            .or_else(|_| Algorithm::parse(name, Some(1)))
            .with_context(|| format!("--algorithms: `{name}`"))?;
    }
    let backend = CudaBackend::new(1).context("cannot start the CUDA backend")?;
    println!("gpu: {}", backend.summary());
    if !backend.has_cublas() {
        bail!("libcublas cannot be loaded: the bench compares plans with cuBLAS and will not label tile kernels as cuBLAS");
    }
    let timed = |a: Algorithm| settings.algorithms.is_empty() || settings.algorithms.iter().any(|n| n == a.name());
    if !settings.algorithms.is_empty() {
        println!("plans: {} only, beside the direct baseline (--algorithms)", settings.algorithms.join(", "));
    }
    let stamp = stamped(&backend, settings.sync, settings.stamps.as_deref())?;
    let reps = settings.reps;
    let options = CudaRunOptions {
        gemm: GemmEngine::Cublas,
        sync: settings.sync.mode(),
        wait_timeout: Duration::from_secs(30),
        cold_l2: true,
        read_back: ReadBack::Nothing,
        hopper_tile: settings.hopper_tile,
        hopper_variant: settings.hopper_variant,
        ..Default::default()
    };
    // What the fused plans run on, where the GPU runs the Hopper engine.
    let hopper_engine = match settings.hopper_choice() {
        Some(choice) => {
            println!("fused plans and their twins on the Hopper engine's {choice} (--hopper-tile, --hopper-variant)");
            format!("Hopper engine (persistent, {choice})")
        }
        None => "Hopper engine (persistent)".to_string(),
    };
    let square = |n: usize| GemmSpec {
        m: n,
        n,
        k: n,
        input: DType::F16,
        output: DType::F16,
        trans_a: false,
        trans_b: false,
        accumulate: false,
    };
    let shrink = settings.shrink;
    if shrink > 1 {
        println!(
            "shrink: every dimension divided by {shrink} (a rehearsal of the bench's path, not the seed-000 shape)"
        );
    }
    let peak = square(8192 / shrink);
    let peak_us = backend.time_gemm(&peak, GemmEngine::Cublas, reps)?;
    let peak_tflops = peak.flops() / peak_us / 1e6;
    let local = GemmSpec { m: 1024 / shrink, n: 4096 / shrink, k: 4096 / shrink, ..square(0) };
    let local_name = format!("{}x{}x{} f16->f16", local.m, local.n, local.k);
    let local_cublas_us = backend.time_gemm(&local, GemmEngine::Cublas, reps)?;
    let local_tile_us = backend.time_gemm(&local, GemmEngine::TileKernel, reps)?;
    let local_wide_tile_us = backend.time_gemm_tiles(&local, GemmEngine::TileKernel, true, reps)?;
    let tile_figures = |us: f64| {
        format!("{us:.1} µs ({:.0} TFLOP/s, {:.2}× cuBLAS's time)", local.flops() / us / 1e6, us / local_cublas_us)
    };
    println!(
        "cuBLAS {peak_n}³ f16: {peak_tflops:.0} TFLOP/s; local GEMM {local_name}: cuBLAS {local_cublas_us:.1} µs ({:.0} TFLOP/s), tile kernel {}; with 128×128 tiles {}",
        local.flops() / local_cublas_us / 1e6,
        tile_figures(local_tile_us),
        tile_figures(local_wide_tile_us),
        peak_n = peak.m,
    );
    println!(
        "sync: {}; median of {reps} runs each, fresh inputs per run, L2 overwritten before each; every plan's \
         output first spot-checked against the f64 oracle at this shape ({SPOT_CHECKS} elements per device: \
         corners, 16 spread rows, then anywhere)",
        settings.sync.name()
    );
    println!("{}", copies_line(options.copies.on_driver(backend.batch_copies().is_ok())));
    // Whether the no-prio column can differ from the plan's own time.
    let (comm_priority, compare_priority) = match backend.comm_priority() {
        Ok(p) => {
            println!("signals, waits and SM copies at priority {p}; `no prio` times each plan again without it");
            (format!("{p}"), true)
        }
        Err(reason) => {
            println!("every launch at the default priority: {reason}");
            (format!("none: {reason}"), false)
        }
    };
    // Whether each plan can also run with staggered lane priorities (two levels or more
    // below communication's).
    let stagger = matches!(backend.comm_priority(), Ok(p) if p <= -2);
    if stagger {
        println!(
            "`staggered` times each plan again with device d's lanes at a lower priority than device d − 1's \
             (below communication)"
        );
    }
    println!(
        "`offsets` times each plan again with device d's first GEMM after device d − 1's, and each fused plan \
         with copies runs again on the tile kernel's 128×128 tiles, with 2 CTAs per SM, with {FREE_SMS} SMs left \
         free and with its copies made by SM kernels; plans whose copies the copy engines make run again with each copy \
         issued otherwise (asked of the copy engines, or left to the driver); ÷ Σ, speedup and TFLOP/s take the \
         fastest of a plan's times, and the baseline is the fastest of its own"
    );
    println!(
        "{:<8} {:>2} {:<20} {:>10} {:>12} {:>10} {:>12} {:>8} {:>10} {:>7} {:>12} {:>8} {:>8} {:>12}",
        "op",
        "D",
        "plan",
        "time µs",
        "staggered µs",
        "offsets µs",
        "Σ GEMMs µs",
        "÷ Σ",
        "twin µs",
        "÷ twin",
        "baseline µs",
        "speedup",
        "TFLOP/s",
        "no prio µs"
    );
    let mut report = Report {
        gpu: backend.identity()?,
        sync: settings.sync.name(),
        commit: std::env::var("CMM_COMMIT").ok(),
        reps,
        shrink,
        peak_cublas_tflops: peak_tflops,
        comm_priority,
        hardware_queues: cmm_cuda::lower::hardware_queues()?,
        copies: options.copies.on_driver(backend.batch_copies().is_ok()).key(),
        baseline_sums: BaselineSums::BySize.key(),
        local_gemm: local_name,
        local_cublas_us,
        local_tile_us,
        tile_over_cublas: local_tile_us / local_cublas_us,
        local_wide_tile_us,
        wide_tile_over_cublas: local_wide_tile_us / local_cublas_us,
        rows: Vec::new(),
        targets: Vec::new(),
        complete: false,
        calibration: None,
    };
    let path = settings.json.clone().unwrap_or_else(|| {
        crate::workspace_root().join("bench").join("results").join(format!(
            "cuda-{:016x}-{}.json",
            fnv1a64(report.gpu.as_bytes()),
            settings.sync.name()
        ))
    });
    let mut cache = HashMap::new();
    for op in [OpKind::AgGemm, OpKind::GemmRs] {
        for d in [2usize, 4, 8] {
            let problem = seed000_problem(op, d, shrink)?;
            let baseline_key = format!("{op} {}", Algorithm::BaselineDirect.name());
            if !stamp.contains(&baseline_key) {
                bail!("`{baseline_key}` has not passed conformance on this GPU with this binary; refusing to time it");
            }
            let baseline = build_plan(&problem, Algorithm::BaselineDirect)?;
            let baseline_check = spot_checked(&backend, &problem, &baseline, &options)?
                .map_err(|why| anyhow::anyhow!("{}: wrong output at this shape: {why}", baseline.name))?;
            let (baseline_default_us, _) = time_plan(&backend, &baseline, &options, reps, false)?;
            let (baseline_times, baseline_failed) =
                variants(&backend, &problem, &baseline, &options, reps, stagger, false).times(PlanTimes::plain(
                    op.name(),
                    d,
                    &Algorithm::BaselineDirect.to_string(),
                    baseline_default_us,
                ));
            let baseline_us = baseline_times.fastest_us();
            let mut algorithms = vec![Algorithm::Ring, Algorithm::RingBidir];
            if op == OpKind::GemmRs {
                // The running sum added in the GEMM, whole and in two chunks, and added by
                // each GEMM on the block's owner (no copies).
                algorithms.extend([
                    Algorithm::RingAccumulate { chunks: 1 },
                    Algorithm::RingAccumulate { chunks: 2 },
                    Algorithm::RingPush,
                ]);
            }
            algorithms.push(Algorithm::Fused { chunks: 1 });
            if op == OpKind::GemmRs {
                // ring_push's later steps as one persistent kernel: no reduce or copy
                // beside it.
                algorithms.push(Algorithm::FusedPush { chunks: 1 });
            }
            algorithms.extend([Algorithm::Baseline, Algorithm::BaselineDirect]);
            algorithms.retain(|&a| timed(a));
            for algorithm in algorithms {
                let key = format!("{op} {}", algorithm.name());
                if !stamp.contains(&key) {
                    println!("{op:<8} {d:>2} {:<20} refused: no conformance stamp for `{key}`", algorithm.to_string());
                    continue;
                }
                let plan = build_plan(&problem, algorithm)?;
                // cuBLAS cannot wait inside a GEMM: the fused plan runs the persistent tile
                // kernel, and its row says so.
                let fused = algorithm.is_fused();
                let engine = if fused { "persistent tile kernel" } else { "cuBLAS" };
                let run_options =
                    CudaRunOptions { gemm: if fused { GemmEngine::Auto } else { GemmEngine::Cublas }, ..options };
                let ((us, gated), worst) = if algorithm == Algorithm::BaselineDirect {
                    ((baseline_default_us, true), baseline_check)
                } else {
                    // A plan whose run fails is refused with the error; the other plans
                    // are still timed.
                    match checked_time(&backend, &problem, &plan, &run_options, reps, fused) {
                        Timed::Done { us, gated, worst } => ((us, gated), worst),
                        Timed::WrongOutput(why) => {
                            println!(
                                "{op:<8} {d:>2} {:<20} refused: wrong output at this shape: {why}",
                                algorithm.to_string()
                            );
                            continue;
                        }
                        Timed::Failed(e) => {
                            println!("{op:<8} {d:>2} {:<20} refused: the run failed: {e:#}", algorithm.to_string());
                            continue;
                        }
                    }
                };
                // Side by side, in the same run: the plan without the priority.
                let mut without_failed = Vec::new();
                let without = if compare_priority && algorithm != Algorithm::BaselineDirect {
                    let options = CudaRunOptions { comm_priority: false, ..run_options };
                    let timed = time_plan(&backend, &plan, &options, reps, fused).map(|(us, _)| us);
                    or_failed(timed, format!("{} without priority", plan.name), &mut without_failed)
                } else {
                    None
                };
                let (times, mut failed) = if algorithm == Algorithm::BaselineDirect {
                    (baseline_times.clone(), baseline_failed.clone())
                } else {
                    variants(&backend, &problem, &plan, &run_options, reps, stagger, fused).times(PlanTimes::plain(
                        op.name(),
                        d,
                        &algorithm.to_string(),
                        us,
                    ))
                };
                let best = times.fastest_us();
                // The engine of the fastest time: a fused plan's plain time is the Hopper
                // engine's where the GPU runs it, its variants the tile kernel's.
                let on_tile_kernel =
                    [times.time_tile_kernel_us, times.time_wide_tiles_us, times.time_two_ctas_per_sm_us]
                        .contains(&Some(best));
                let engine = if fused && !on_tile_kernel && backend.has_hopper_engine() {
                    hopper_engine.as_str()
                } else {
                    engine
                };
                // Every plan beside its compute-only twin: the same GEMMs (and reduces) on
                // the same engines, nothing to copy or wait for, in this run. Its floor on
                // one GPU, where the devices' GEMMs share the chip.
                let twin = cmm_core::emulate::compute_only(&plan);
                let compute_only = or_failed(
                    time_plan(&backend, &twin, &run_options, reps, fused).map(|(us, _)| us),
                    format!("{} compute only", plan.name),
                    &mut failed,
                );
                // Where a fused plan's time goes: its CTAs' time in their blocks' waits.
                let fused_wait_share = if fused {
                    let run = backend.run(&plan, 1, Family::Realistic, &run_options);
                    or_failed(run, format!("{} waits counted", plan.name), &mut failed).and_then(|out| wait_share(&out))
                } else {
                    None
                };
                // A baseline as it was before its sums went beside its copies, side by
                // side with today's (the simulator's `baseline_sums` replay of older reports).
                // Where the two are one plan (the direct baseline at D ≤ 4, small blocks)
                // the pair measures the run-to-run noise.
                let baseline = matches!(algorithm, Algorithm::Baseline | Algorithm::BaselineDirect);
                let sums_in_series = if baseline && op != OpKind::AgGemm {
                    let series = build_plan_with(&problem, algorithm, BaselineSums::InSeries)?;
                    let timed = time_plan(&backend, &series, &run_options, reps, false).map(|(us, _)| us);
                    let us = or_failed(timed, format!("{} with its sums in series", plan.name), &mut failed);
                    if let Some(us) = us {
                        println!("sums: {} D={d} {algorithm}, its sums in series: {us:.1} µs", op.name());
                    }
                    us
                } else {
                    None
                };
                failed.extend(without_failed);
                let specs = gemm_specs(&plan);
                let bound = gemm_sum_us(&backend, &specs, reps, &mut cache)?;
                let tflops = problem.flops() / best / 1e6;
                println!(
                    "{:<8} {:>2} {:<20} {:>10.1} {:>12} {:>10} {:>12.1} {:>8.3} {:>10} {:>7} {:>12.1} {:>7.2}x {:>8.0} {:>12}{}{}",
                    op.name(),
                    d,
                    algorithm.to_string(),
                    us,
                    times.time_staggered_us.map_or("-".to_string(), |s| format!("{s:.1}")),
                    times.time_offset_us.map_or("-".to_string(), |s| format!("{s:.1}")),
                    bound,
                    best / bound,
                    compute_only.map_or("-".to_string(), |t| format!("{t:.1}")),
                    compute_only.map_or("-".to_string(), |t| format!("{:.3}", best / t)),
                    baseline_us,
                    baseline_us / best,
                    tflops,
                    without.map_or("-".to_string(), |w| format!("{w:.1}")),
                    if gated { "" } else { "  (ungated: includes enqueueing)" },
                    if fused {
                        // fused_push's first GEMM is one of its own, on cuBLAS.
                        let own = crate::timing::own_gemms(&plan) > 0;
                        let blas = if own { "its GEMMs of their own on cuBLAS" } else { "not cuBLAS" };
                        format!(
                            "  ({engine}, {blas}; tile kernel: {}; 128×128 tiles: {}; 2 CTAs per SM: {}; {FREE_SMS} SMs free: {}; SM copies: {}; copy engines: {}; driver copies: {})",
                            times.time_tile_kernel_us.map_or("-".into(), |w| format!("{w:.1} µs")),
                            times.time_wide_tiles_us.map_or("-".into(), |w| format!("{w:.1} µs")),
                            times.time_two_ctas_per_sm_us.map_or("-".into(), |w| format!("{w:.1} µs")),
                            times.time_free_sms_us.map_or("-".into(), |w| format!("{w:.1} µs")),
                            times.time_sm_copies_us.map_or("-".into(), |w| format!("{w:.1} µs")),
                            times.time_copy_engines_us.map_or("-".into(), |w| format!("{w:.1} µs")),
                            times.time_driver_copies_us.map_or("-".into(), |w| format!("{w:.1} µs"))
                        )
                    } else {
                        let copies = [
                            ("copies asked of the copy engines", times.time_copy_engines_us),
                            ("copies left to the driver", times.time_driver_copies_us),
                        ];
                        copies
                            .iter()
                            .filter_map(|(what, us)| us.map(|us| format!("  ({what}: {us:.1} µs)")))
                            .collect::<String>()
                    }
                );
                if let Some(share) = fused_wait_share {
                    println!(
                        "waits: {} D={d} {}: its persistent kernels' CTAs spent {:.1} % of the run in their blocks' waits",
                        op.name(),
                        algorithm,
                        100.0 * share
                    );
                }
                report.rows.push(Row {
                    plan: times,
                    figures: PlanFigures {
                        gemm_sum_us: bound,
                        time_over_gemm_sum: best / bound,
                        baseline_us,
                        speedup_over_baseline: baseline_us / best,
                        tflops,
                        gemm_engine: engine.into(),
                        compute_only_us: compute_only,
                    },
                    gated,
                    time_without_comm_priority_us: without,
                    spot_check_worst: worst,
                    variant_failures: failed,
                    fused_wait_share,
                    time_sums_in_series_us: sums_in_series,
                    gemm_specs: specs,
                    copies: plan
                        .ops()
                        .any(|(site, op)| matches!(op, Op::Copy { dst_device, .. } if *dst_device != site.device)),
                });
            }
            report.save(&path)?;
        }
    }
    // Each bound shape once more, now that the GPU has run for a while.
    for (spec, first, second) in retime_bounds(&backend, &mut cache, reps)? {
        println!(
            "bound: a {}x{}x{} GEMM timed {first:.1} µs, then {second:.1} µs at the end; the bound keeps the lower",
            spec.m, spec.n, spec.k
        );
    }
    for (i, old) in rebound_rows(&mut report.rows, &cache) {
        let r = &report.rows[i];
        println!(
            "bound: {} D={} {}: Σ GEMMs now {:.1} µs, ÷ Σ {:.3} (was {old:.3})",
            r.plan.op, r.plan.devices, r.plan.algorithm, r.figures.gemm_sum_us, r.figures.time_over_gemm_sum
        );
    }
    report.complete = true;
    report.save(&path)?;
    let targets = &report.targets;
    let shrunk = if shrink > 1 { " (shrunk shapes: not the shape the targets are set for)" } else { "" };
    println!("targets, on the fastest overlapped plan of each op and D{shrunk}:");
    for target in targets {
        println!("{}", target.line());
    }
    let met = targets.iter().filter(|t| t.met()).count();
    println!("targets: {met} of {} met{shrunk}", targets.len());
    // The table is saved: a calibration that fails says so and leaves the timelines to run.
    match crate::calibrate::calibrate(&backend, &options, (local.m, local.n, local.k), reps) {
        Ok(calibration) => {
            for line in calibration.lines() {
                println!("{line}");
            }
            report.calibration = Some(calibration);
            report.save(&path)?;
        }
        Err(e) => println!("calibration: failed: {e:#}"),
    }
    println!("saved {}", path.display());
    if let Some(dir) = &settings.timelines {
        write_timelines(&backend, &options, &stamp, shrink, dir)?;
    }
    Ok(())
}

/// One run each of gemm_rs `ring_accumulate`, `ring_push` and `baseline_direct` at D = 4 and 8, plain,
/// staggered and with offset starts, with every op's events recorded: a timeline per run
/// (SVG and Perfetto JSON) in `dir`, to see whether the devices ran in lockstep; and the
/// fused plans at D = 4 with their copies on the copy engines and on SMs.
fn write_timelines(
    backend: &CudaBackend,
    options: &CudaRunOptions,
    stamp: &BTreeSet<String>,
    shrink: usize,
    dir: &Path,
) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let modes = [
        ("plain", CudaRunOptions { time_ops: true, ..*options }),
        ("staggered", CudaRunOptions { time_ops: true, stagger: true, ..*options }),
        ("offsets", CudaRunOptions { time_ops: true, offset_starts: true, ..*options }),
    ];
    for d in [4usize, 8] {
        let problem = seed000_problem(OpKind::GemmRs, d, shrink)?;
        for algorithm in [Algorithm::RingAccumulate { chunks: 1 }, Algorithm::RingPush, Algorithm::BaselineDirect] {
            if !stamp.contains(&format!("{} {}", OpKind::GemmRs, algorithm.name())) {
                continue;
            }
            let plan = build_plan(&problem, algorithm)?;
            for (mode, run_options) in &modes {
                // A failed run loses its own timeline only.
                let out = match backend.run(&plan, 1, Family::Realistic, run_options) {
                    Ok(out) => out,
                    Err(e) => {
                        println!("timeline: {} {mode} failed: {e}", plan.name);
                        continue;
                    }
                };
                if run_options.stagger && out.staggered.is_empty() {
                    println!("timeline: {} {mode} skipped: this GPU has too few priorities to stagger", plan.name);
                    continue;
                }
                // The sites name the ops of the plan that ran.
                let ran = if out.offset_starts { cmm_core::emulate::offset_starts(&plan)? } else { plan.clone() };
                let title = format!(
                    "{} {mode} on {}: {:.1} µs with an event around every op",
                    plan.name,
                    backend.summary(),
                    out.gpu_time.as_secs_f64() * 1e6
                );
                let timeline = cmm_sim::timeline::Timeline::from_measured(&ran, title, &out.op_times);
                let stem = format!("gemm_rs-{}-d{d}-{mode}", algorithm.name());
                fs::write(dir.join(format!("{stem}.svg")), timeline.svg())?;
                fs::write(dir.join(format!("{stem}.json")), timeline.chrome_trace_json())?;
                println!("timeline: {} ({} ops)", dir.join(format!("{stem}.svg")).display(), out.op_times.len());
            }
        }
    }
    // The fused plans at D = 4 and 8: how long their copies, signals, waits and (gemm_rs)
    // reductions take under the persistent kernels, and how long the run goes on after
    // its last GEMM span ends, in words (the kernel is one span; its waits are inside it);
    // again with the copies made by cmm's SM kernels, and with the copies left to the
    // driver where the plain run asked the copy engines. (gemm_rs's fused plans took 1.15
    // to 1.34 times their twins at D = 4 and 8 on an H200 with nothing in their kernels
    // waiting: whether the reductions beside the kernels, or after them, are where that
    // goes.)
    for (op, d) in [(OpKind::AgGemm, 4), (OpKind::GemmRs, 4), (OpKind::GemmRs, 8)] {
        let algorithm = Algorithm::Fused { chunks: 1 };
        if !stamp.contains(&format!("{op} {}", algorithm.name())) {
            continue;
        }
        let fused = build_plan(&seed000_problem(op, d, shrink)?, algorithm)?;
        // cuBLAS cannot run a fused GEMM: the engine rule picks cmm's kernel.
        let fused_options = CudaRunOptions { gemm: GemmEngine::Auto, ..modes[0].1 };
        let driver = CudaRunOptions { copies: CopyIssue::Driver, ..fused_options };
        let mut variants = vec![
            ("plain", fused.clone(), fused_options),
            ("sm-copies", cmm_core::emulate::sm_copies(&fused), fused_options),
        ];
        if copies_differ(&fused, fused_options.copies.on_driver(backend.batch_copies().is_ok()), CopyIssue::Driver) {
            variants.push(("driver-copies", fused.clone(), driver));
        }
        for (variant, plan, fused_options) in variants {
            let out = match backend.run(&plan, 1, Family::Realistic, &fused_options) {
                Ok(out) => out,
                Err(e) => {
                    println!("timeline: {} failed: {e}", plan.name);
                    continue;
                }
            };
            let span = |f: &dyn Fn(&Op) -> bool| -> Vec<f64> {
                out.op_times
                    .iter()
                    .filter(|(site, _, _)| f(&plan.programs[site.device].lanes[site.lane][site.index]))
                    .map(|(_, _, duration)| *duration)
                    .collect()
            };
            let copies = span(&|op| matches!(op, Op::Copy { .. }));
            let signals = span(&|op| matches!(op, Op::Signal { .. }));
            let waits = span(&|op| matches!(op, Op::Wait { .. }));
            let reduces = span(&|op| matches!(op, Op::Reduce { .. }));
            let gemms = span(&|op| matches!(op, Op::Gemm { .. }));
            let stats = |xs: &[f64]| {
                let mean = xs.iter().sum::<f64>() / xs.len().max(1) as f64;
                let longest = xs.iter().copied().fold(0.0, f64::max);
                format!("{} of them, mean {mean:.1} µs, longest {longest:.1} µs", xs.len())
            };
            let took = out.gpu_time.as_secs_f64() * 1e6;
            println!(
                "timeline: {} {variant}, {took:.1} µs with an event around every op: copies {}; signals {}; waits {}; \
                 reductions {}; GEMM spans {}; after the last GEMM span {}",
                plan.name,
                stats(&copies),
                stats(&signals),
                stats(&waits),
                stats(&reduces),
                stats(&gemms),
                after_last_gemm(&plan, &out.op_times).map_or("-".into(), |us| format!("{us:.1} µs")),
            );
            let stem = format!("{op}-fused-d{d}-{variant}");
            let title = format!("{} {variant}: {took:.1} µs with an event around every op", plan.name);
            let timeline = cmm_sim::timeline::Timeline::from_measured(&plan, title, &out.op_times);
            fs::write(dir.join(format!("{stem}.svg")), timeline.svg())?;
        }
    }
    Ok(())
}

/// How long a run's ops go on after its last GEMM op ends (µs, by the ops' own events),
/// or `None` where no GEMM op was timed.
fn after_last_gemm(plan: &Plan, op_times: &[(OpSite, f64, f64)]) -> Option<f64> {
    let end = |gemm: bool| {
        op_times
            .iter()
            .filter(|(site, _, _)| {
                gemm == matches!(plan.programs[site.device].lanes[site.lane][site.index], Op::Gemm { .. })
            })
            .map(|(_, start, duration)| start + duration)
            .fold(None, |latest: Option<f64>, e| Some(latest.map_or(e, |l| l.max(e))))
    };
    let gemms = end(true)?;
    Some((end(false).unwrap_or(gemms) - gemms).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_after_the_last_gemm_counts_the_ops_that_end_later() {
        let p = Problem::new(OpKind::GemmRs, 2, 64, 64, 64, DType::F32, DType::F32).unwrap();
        let plan = build_plan(&p, Algorithm::Fused { chunks: 1 }).unwrap();
        let sites: Vec<(OpSite, bool)> = plan.ops().map(|(site, op)| (site, matches!(op, Op::Gemm { .. }))).collect();
        let (gemm, other) = (sites.iter().find(|s| s.1).unwrap().0, sites.iter().find(|s| !s.1).unwrap().0);
        // A GEMM from 10 to 110 µs, another op from 50 to 175: 65 µs after.
        let times = vec![(gemm, 10.0, 100.0), (other, 50.0, 125.0)];
        assert_eq!(after_last_gemm(&plan, &times), Some(65.0));
        // Nothing after the GEMMs, and no GEMM timed.
        assert_eq!(after_last_gemm(&plan, &times[..1]), Some(0.0));
        assert_eq!(after_last_gemm(&plan, &times[1..]), None);
    }

    fn row(op: &str, devices: usize, algorithm: &str, time_us: f64, gemm_sum_us: f64, baseline_us: f64) -> Row {
        row_of(op, devices, algorithm, time_us, gemm_sum_us, baseline_us, Vec::new())
    }

    fn row_of(
        op: &str,
        devices: usize,
        algorithm: &str,
        time_us: f64,
        gemm_sum_us: f64,
        baseline_us: f64,
        gemm_specs: Vec<GemmSpec>,
    ) -> Row {
        Row {
            plan: PlanTimes::plain(op, devices, algorithm, time_us),
            figures: PlanFigures {
                gemm_sum_us,
                time_over_gemm_sum: time_us / gemm_sum_us,
                baseline_us,
                speedup_over_baseline: baseline_us / time_us,
                tflops: 0.0,
                gemm_engine: "cuBLAS".into(),
                compute_only_us: None,
            },
            gated: true,
            time_without_comm_priority_us: None,
            spot_check_worst: 0.0,
            variant_failures: Vec::new(),
            fused_wait_share: None,
            time_sums_in_series_us: None,
            gemm_specs,
            copies: algorithm != "ring_push",
        }
    }

    #[test]
    fn a_lower_second_timing_of_a_shape_moves_every_row_that_sums_it() {
        let spec = |k| GemmSpec {
            m: 64,
            n: 64,
            k,
            input: DType::F16,
            output: DType::F16,
            trans_a: false,
            trans_b: false,
            accumulate: false,
        };
        // The first timing of shape k=64 was 80 µs; the bound now keeps 60.
        let cache = HashMap::from([(spec(64), 60.0), (spec(128), 50.0)]);
        let mut rows = vec![
            row_of("ag_gemm", 4, "ring", 210.0, 2.0 * 80.0 + 50.0, 300.0, vec![spec(64), spec(64), spec(128)]),
            row_of("ag_gemm", 4, "baseline", 60.0, 50.0, 300.0, vec![spec(128)]),
        ];
        let moved = rebound_rows(&mut rows, &cache);
        assert_eq!(moved, vec![(0, 1.0)]);
        assert_eq!(rows[0].figures.gemm_sum_us, 170.0);
        assert!((rows[0].figures.time_over_gemm_sum - 210.0 / 170.0).abs() < 1e-12);
        // Within the 1.05 bound before, not after: the targets follow the rows.
        assert!(!targets(&rows)[0].within_bound);
        assert_eq!((rows[1].figures.gemm_sum_us, rows[1].figures.time_over_gemm_sum), (50.0, 1.2));
    }

    #[test]
    fn a_faster_staggered_time_is_the_one_the_bound_and_the_targets_judge() {
        let spec = GemmSpec {
            m: 64,
            n: 64,
            k: 64,
            input: DType::F16,
            output: DType::F16,
            trans_a: false,
            trans_b: false,
            accumulate: false,
        };
        let mut slow = row_of("gemm_rs", 4, "ring_accumulate", 118.0, 100.0, 110.0, vec![spec]);
        slow.plan.time_staggered_us = Some(103.0);
        let mut other = row_of("gemm_rs", 4, "ring", 112.0, 100.0, 110.0, vec![spec]);
        other.plan.time_staggered_us = Some(125.0);
        other.plan.time_offset_us = Some(114.0);
        let mut rows = vec![slow, other];
        // The bound moves (80 → 100 µs per the cache): both rows are judged again.
        rows[0].figures.gemm_sum_us = 80.0;
        rows[1].figures.gemm_sum_us = 80.0;
        rebound_rows(&mut rows, &HashMap::from([(spec, 100.0)]));
        assert_eq!(rows[0].figures.time_over_gemm_sum, 1.03, "the staggered time, the faster");
        assert_eq!(rows[1].figures.time_over_gemm_sum, 1.12, "the unstaggered time, the faster");
        let t = &targets(&rows)[0];
        assert_eq!(t.best.as_ref().map(|b| b.plan.as_str()), Some("ring_accumulate"));
        assert!(t.within_bound);
        // A fused plan is judged by its time on wide tiles where that is the faster.
        let mut fused = row_of("gemm_rs", 4, "fused", 900.0, 100.0, 110.0, vec![spec]);
        fused.plan.time_wide_tiles_us = Some(450.0);
        rows.push(fused);
        rebound_rows(&mut rows, &HashMap::from([(spec, 100.0)]));
        assert_eq!(rows[2].figures.time_over_gemm_sum, 4.5);
        // A row of the report reads back as `simulate --validate-bench` reads it.
        let json = serde_json::to_value(&rows[1]).unwrap();
        assert_eq!(json["time_offset_us"], 114.0);
        assert_eq!(serde_json::from_value::<PlanTimes>(json).unwrap(), rows[1].plan);
    }

    #[test]
    fn targets_judge_the_fastest_overlapped_plan_of_each_op_and_d() {
        let rows = vec![
            row("ag_gemm", 2, "ring", 100.0, 98.0, 90.0),
            row("ag_gemm", 2, "baseline_direct", 90.0, 80.0, 90.0),
            row("ag_gemm", 4, "ring", 210.0, 200.0, 290.0),
            row("ag_gemm", 4, "ring_bidir", 205.0, 200.0, 290.0),
            row("ag_gemm", 4, "baseline", 150.0, 200.0, 290.0),
            row("gemm_rs", 8, "ring", 500.0, 400.0, 450.0),
            row("gemm_rs", 4, "baseline_direct", 300.0, 250.0, 300.0),
            row("gemm_ar", 4, "ring", 1300.0, 1000.0, 1150.0),
            row("gemm_ar", 4, "ring_accumulate", 1100.0, 1000.0, 1150.0),
            row("gemm_ar", 4, "ring_push", 1010.0, 1000.0, 1150.0),
        ];
        let t = targets(&rows);
        assert_eq!(t.len(), 5);
        // D = 2: within the bound, slower than the baseline, which is no target there.
        assert_eq!(
            (t[0].best.as_ref().map(|b| b.plan.as_str()), t[0].within_bound, t[0].faster_than_baseline),
            (Some("ring"), true, None)
        );
        assert!(t[0].met() && t[0].line().contains("not a target at D = 2"), "{}", t[0].line());
        // The fastest overlapped plan, never a baseline, however fast.
        assert_eq!(t[1].best.as_ref().map(|b| b.plan.as_str()), Some("ring_bidir"));
        assert!(t[1].met(), "{}", t[1].line());
        // 1.25× the bound and slower than the baseline.
        assert!(!t[2].within_bound && t[2].faster_than_baseline == Some(false) && !t[2].met());
        assert_eq!(t[2].line().matches("NOT MET").count(), 2, "{}", t[2].line());
        // Nothing overlapped was timed: not met.
        assert!(t[3].best.is_none() && !t[3].met() && t[3].line().ends_with("NOT MET"));
        assert!(t[..4].iter().all(|t| t.best_with_copies.is_none()), "every best plan copies");
        // A best plan that copies nothing is judged as any other, and its line adds the
        // fastest plan that copies.
        assert_eq!(t[4].best.as_ref().map(|b| b.plan.as_str()), Some("ring_push"));
        assert!(t[4].met(), "{}", t[4].line());
        assert_eq!(t[4].best_with_copies.as_ref().map(|b| b.plan.as_str()), Some("ring_accumulate"));
        let tail = "of the plans with copies, ring_accumulate at 1.100× Σ GEMMs (no compute-only twin timed) and \
                    1.05× the baseline's speed";
        assert!(t[4].line().ends_with(tail), "{}", t[4].line());
        // Where its compute-only twin was timed, the bound judges the plan against the twin,
        // not against Σ: 1.01 × Σ is over the bound when the twin took 90 % of Σ.
        let mut twinned = rows;
        let push = twinned.iter().position(|r| r.plan.op == "gemm_ar" && r.plan.algorithm == "ring_push").unwrap();
        twinned[push].figures.compute_only_us = Some(900.0);
        let t = targets(&twinned);
        assert!(!t[4].within_bound, "{}", t[4].line());
        assert!(
            t[4].line().contains("1.122× its compute-only twin (1.010× Σ GEMMs) (≤ 1.05: NOT MET)"),
            "{}",
            t[4].line()
        );
    }
}
