//! The validation table: predictions beside published numbers (seed 000 on 8×H100, seed 002
//! on 256 TPU v4). The profiles are never fitted to these numbers; the gaps are explained in
//! `docs/simulator.md`.

use super::analytic::{ring_1d, ring_1d_with, MeshFamily, MeshShape};
use super::engine::{simulate, SimError, SimOptions};
use super::profile::{Profile, MAX_CONCURRENT};
use super::tune::{best_per_algorithm, replay_llm, tune_llm, LlmConfig, MeshConfig, TuneError};
use cmm_core::algorithms::{build_plan, build_plan_with, Algorithm, AlgorithmError, BaselineSums};
use cmm_core::dtype::DType;
use cmm_core::engines::CopyIssue;
use cmm_core::problem::{OpKind, Problem, ProblemError};
use thiserror::Error;

/// Why the validation could not be computed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// A problem was rejected.
    #[error(transparent)]
    Problem(#[from] ProblemError),
    /// A plan could not be built.
    #[error(transparent)]
    Algorithm(#[from] AlgorithmError),
    /// A simulation failed.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// The 2D tuner failed.
    #[error(transparent)]
    Tune(#[from] TuneError),
    /// A plan's starts could not be offset.
    #[error(transparent)]
    Offset(#[from] cmm_core::emulate::OffsetError),
    /// A bench's calibration cannot stand for a profile's constants.
    #[error("the bench's calibration: {0}")]
    Calibration(String),
}

/// One numeric comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct TimeRow {
    /// What is compared.
    pub case: String,
    /// The simulator's prediction, µs.
    pub simulated_us: f64,
    /// The closed-form estimate, µs.
    pub analytic_us: f64,
    /// The published number, µs.
    pub published_us: f64,
}

impl TimeRow {
    /// (simulated − published) / published.
    pub fn relative_error(&self) -> f64 {
        (self.simulated_us - self.published_us) / self.published_us
    }
}

/// The GEMM sweeps recorded under docs/gpu-runs (`cargo xtask gemm-sweep --json`, kept
/// beside each GPU run's summary) as (path, text), in path order: what the tests that
/// hold the engine's rules and the profiles' rates to measurements read.
pub fn recorded_gemm_sweeps() -> std::io::Result<Vec<(std::path::PathBuf, String)>> {
    let runs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/gpu-runs");
    let mut out = Vec::new();
    for day in std::fs::read_dir(&runs)? {
        let day = day?.path();
        if !day.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(day)? {
            let path = file?.path();
            if path.to_string_lossy().ends_with("gemm-sweep.json") {
                let text = std::fs::read_to_string(&path)?;
                out.push((path, text));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The seed-000 problem (f16, per-shard M=1024, K=N=4096) of `op` at `devices` devices:
/// every ring step is one 1024×4096×4096 GEMM per device (ag_gemm gathers M; gemm_rs and
/// gemm_ar split K). With `shrink` > 1, every dimension divided by it.
pub fn seed000_problem(op: OpKind, devices: usize, shrink: usize) -> Result<Problem, ProblemError> {
    let (m, k) = (1024 / shrink.max(1), 4096 / shrink.max(1));
    match op {
        OpKind::AgGemm => Problem::new(op, devices, devices * m, devices * k, k, DType::F16, DType::F16),
        _ => Problem::new(op, devices, devices * m, k, devices * k, DType::F16, DType::F16),
    }
}

/// Seed 000 (8×H100, f16, per-shard M=1024, K=N=4096): the ring plan against the Pallas
/// kernel and the baseline plan against NCCL + cuBLAS, at D = 2, 4, 8.
pub fn seed000(profile: &Profile) -> Result<Vec<TimeRow>, ValidationError> {
    const KERNEL_US: [(usize, f64, f64); 3] = [(2, 102.0, 147.0), (4, 212.0, 290.0), (8, 436.0, 565.0)];
    let mut rows = Vec::new();
    for (d, kernel, reference) in KERNEL_US {
        let p = seed000_problem(OpKind::AgGemm, d, 1)?;
        for (algorithm, published, what) in [
            (Algorithm::Ring, kernel, "ring plan vs Pallas kernel"),
            (Algorithm::Baseline, reference, "baseline plan vs NCCL+cuBLAS"),
        ] {
            let plan = build_plan(&p, algorithm)?;
            let r = simulate(&plan, profile, &SimOptions::default())?;
            rows.push(TimeRow {
                case: format!("seed 000 D={d} {what}"),
                simulated_us: r.makespan_s * 1e6,
                analytic_us: ring_1d(&p, algorithm, profile).total_s * 1e6,
                published_us: published,
            });
        }
    }
    Ok(rows)
}

/// One plan of the one-GPU table: simulated with every device at one priority (as the
/// H100 run was) and with staggered priorities (a prediction: nothing measured yet).
#[derive(Clone, Debug, PartialEq)]
pub struct OneGpuRow {
    /// The operation.
    pub op: OpKind,
    /// Virtual devices.
    pub devices: usize,
    /// The plan.
    pub algorithm: Algorithm,
    /// Simulated, analytic and measured times (the plain run's, with its copies issued
    /// as the bench's plain runs issued them).
    pub time: TimeRow,
    /// The simulator's Σ of the plan's compute work (GEMMs and reduces, each alone, less
    /// the GEMMs' fixed costs, which overlap other work), µs.
    pub compute_floor_us: f64,
    /// The simulated time with staggered priorities ([`cmm_core::emulate::staggered_priorities`]), µs.
    pub staggered_us: f64,
    /// The simulated time with the devices' starts offset
    /// ([`cmm_core::emulate::offset_starts`]), µs.
    pub offset_us: f64,
    /// The measured time with staggered priorities, where the bench took it, µs.
    pub measured_staggered_us: Option<f64>,
    /// The measured time with offset starts, where the bench took it, µs.
    pub measured_offset_us: Option<f64>,
    /// The simulated compute-only twin ([`cmm_core::emulate::compute_only`]: the same
    /// GEMMs and reduces, no copy, wait or signal), µs: the part of the plan's time that
    /// no communication term of the profile touches.
    pub twin_us: f64,
    /// The twin as the bench measured it, where it did, µs.
    pub measured_twin_us: Option<f64>,
    /// The plan with the copies asked of the copy engines, where the bench timed it apart, µs.
    pub measured_copy_engines_us: Option<f64>,
    /// The simulated time with every copy asked of the copy engines, µs.
    pub copy_engines_us: f64,
    /// The plan with every copy left to the driver, where the bench timed it apart, µs.
    pub measured_driver_copies_us: Option<f64>,
    /// The simulated time with every copy left to the driver, µs.
    pub driver_copies_us: f64,
}

/// The priority levels an H100 leaves for compute when communication takes the greatest
/// (its range is 0 to −5).
pub const H100_COMPUTE_LEVELS: usize = 5;

/// One plan as a CUDA bench on one GPU timed it (µs): with every device at one priority
/// and starting together, and where taken with staggered priorities and offset starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BenchTime {
    /// The operation.
    pub op: OpKind,
    /// Virtual devices.
    pub devices: usize,
    /// The plan.
    pub algorithm: Algorithm,
    /// The plain time.
    pub plain_us: f64,
    /// With staggered lane priorities.
    pub staggered_us: Option<f64>,
    /// With the devices' starts offset.
    pub offset_us: Option<f64>,
    /// Its compute-only twin ([`cmm_core::emulate::compute_only`]), where timed.
    pub compute_only_us: Option<f64>,
    /// Its time with the copies asked of the copy engines, as cmm issues them by default,
    /// where the plain runs did not and the bench timed it apart.
    pub copy_engines_us: Option<f64>,
    /// Its time with every copy left to the driver, where the plain runs did not and the
    /// bench timed it apart.
    pub driver_copies_us: Option<f64>,
    /// How the plain, staggered and offset runs issued their copies: the driver's way in
    /// every bench before cmm asked for the copy engines by default.
    pub copies: CopyIssue,
    /// Where the GEMM+RS / GEMM+AR baselines the bench timed added their sums up: in
    /// series on their copy lane in every bench before the sum lane (`BySize`: as cmm
    /// builds them).
    /// The row replays that plan.
    pub baseline_sums: BaselineSums,
}

/// The CUDA bench on one H100 (f16, per-shard M=1024, K=N=4096, D virtual devices,
/// kernel waits), measured on 2026-11-24 at 30786c1 (docs/perf.md), against the
/// simulator on a one-GPU profile: every plan the bench times that the simulator models
/// with cuBLAS-like GEMMs (the fused plans run cmm's own tile kernel and are left out).
pub fn one_gpu_bench(profile: &Profile) -> Result<Vec<OneGpuRow>, ValidationError> {
    // (op, D, algorithm, measured µs)
    const MEASURED: [(OpKind, usize, Algorithm, f64); 18] = [
        (OpKind::AgGemm, 2, Algorithm::Ring, 210.8),
        (OpKind::AgGemm, 2, Algorithm::BaselineDirect, 238.6),
        (OpKind::AgGemm, 4, Algorithm::Ring, 846.1),
        (OpKind::AgGemm, 4, Algorithm::BaselineDirect, 910.0),
        (OpKind::AgGemm, 8, Algorithm::Ring, 3410.0),
        (OpKind::AgGemm, 8, Algorithm::BaselineDirect, 3596.3),
        (OpKind::GemmRs, 2, Algorithm::Ring, 293.2),
        (OpKind::GemmRs, 2, Algorithm::RingAccumulate { chunks: 1 }, 295.3),
        (OpKind::GemmRs, 2, Algorithm::RingAccumulate { chunks: 2 }, 327.9),
        (OpKind::GemmRs, 2, Algorithm::BaselineDirect, 292.5),
        (OpKind::GemmRs, 4, Algorithm::Ring, 1337.7),
        (OpKind::GemmRs, 4, Algorithm::RingAccumulate { chunks: 1 }, 1149.5),
        (OpKind::GemmRs, 4, Algorithm::RingAccumulate { chunks: 2 }, 1297.1),
        (OpKind::GemmRs, 4, Algorithm::BaselineDirect, 1154.6),
        (OpKind::GemmRs, 8, Algorithm::Ring, 5693.6),
        (OpKind::GemmRs, 8, Algorithm::RingAccumulate { chunks: 1 }, 4530.7),
        (OpKind::GemmRs, 8, Algorithm::RingAccumulate { chunks: 2 }, 5154.5),
        (OpKind::GemmRs, 8, Algorithm::BaselineDirect, 5016.5),
    ];
    let times = MEASURED.map(|(op, devices, algorithm, plain_us)| BenchTime {
        op,
        devices,
        algorithm,
        plain_us,
        staggered_us: None,
        offset_us: None,
        compute_only_us: None,
        copy_engines_us: None,
        driver_copies_us: None,
        copies: CopyIssue::Driver,
        baseline_sums: BaselineSums::InSeries,
    });
    one_gpu_rows(profile, &times, 1, H100_COMPUTE_LEVELS)
}

/// The plans the bench times that no GPU has run yet, on a one-GPU profile at the
/// seed-000 shape: gemm_rs `ring_push` at D = 2, 4 and 8 (its measured time is NaN).
pub fn one_gpu_predictions(profile: &Profile) -> Result<Vec<OneGpuRow>, ValidationError> {
    let times = [2, 4, 8].map(|devices| BenchTime {
        op: OpKind::GemmRs,
        devices,
        algorithm: Algorithm::RingPush,
        plain_us: f64::NAN,
        staggered_us: None,
        offset_us: None,
        compute_only_us: None,
        copy_engines_us: None,
        driver_copies_us: None,
        copies: CopyIssue::Auto,
        baseline_sums: BaselineSums::BySize,
    });
    one_gpu_rows(profile, &times, 1, H100_COMPUTE_LEVELS)
}

/// Each bench time beside the simulator's three predictions for its plan at the seed-000
/// shape divided by `shrink` (the bench's own `--shrink`), staggered over `levels`
/// compute priorities (the GPU's spare levels below communication's, as the CUDA
/// executor staggers them).
pub fn one_gpu_rows(
    profile: &Profile,
    times: &[BenchTime],
    shrink: usize,
    levels: usize,
) -> Result<Vec<OneGpuRow>, ValidationError> {
    let mut rows = Vec::new();
    for t in times {
        let (op, d, algorithm) = (t.op, t.devices, t.algorithm);
        let p = seed000_problem(op, d, shrink)?;
        let plan = build_plan_with(&p, algorithm, t.baseline_sums)?;
        let as_run = SimOptions { copies: t.copies, ..SimOptions::default() };
        let together = simulate(&plan, profile, &as_run)?;
        let staggered =
            SimOptions { compute_priority: cmm_core::emulate::staggered_priorities(d, levels), ..as_run.clone() };
        // The plan with its copies issued another way (the plain run's time where it is that way).
        let issued = |copies: CopyIssue| -> Result<f64, ValidationError> {
            if copies == t.copies {
                return Ok(together.makespan_s * 1e6);
            }
            Ok(simulate(&plan, profile, &SimOptions { copies, ..SimOptions::default() })?.makespan_s * 1e6)
        };
        rows.push(OneGpuRow {
            op,
            devices: d,
            algorithm,
            time: TimeRow {
                case: format!("{op} D={d} {algorithm}"),
                simulated_us: together.makespan_s * 1e6,
                analytic_us: ring_1d_with(
                    &p,
                    algorithm,
                    t.baseline_sums,
                    &super::analytic::copied_by(profile, t.copies),
                )
                .total_s
                    * 1e6,
                published_us: t.plain_us,
            },
            compute_floor_us: together.compute_floor_s * 1e6,
            staggered_us: simulate(&plan, profile, &staggered)?.makespan_s * 1e6,
            offset_us: simulate(&cmm_core::emulate::offset_starts(&plan)?, profile, &as_run)?.makespan_s * 1e6,
            measured_staggered_us: t.staggered_us,
            measured_offset_us: t.offset_us,
            twin_us: simulate(&cmm_core::emulate::compute_only(&plan), profile, &SimOptions::default())?.makespan_s
                * 1e6,
            measured_twin_us: t.compute_only_us,
            measured_copy_engines_us: t.copy_engines_us,
            copy_engines_us: issued(CopyIssue::PreferCopyEngines)?,
            measured_driver_copies_us: t.driver_copies_us,
            driver_copies_us: issued(CopyIssue::Driver)?,
        });
    }
    Ok(rows)
}

/// What a CUDA bench measured of a one-GPU profile's assumptions (its `calibration`
/// lines): a device-to-device copy's rate, a signal–wait round trip between two devices,
/// and the local GEMM (1024×4096×4096 f16 at the bench's shape) alone.
#[derive(Clone, Debug, PartialEq)]
pub struct OneGpuCalibration {
    /// GB/s copied (each byte read and written once), by the copy as the bench's plans
    /// made theirs.
    pub copy_gbps: f64,
    /// GB/s of the driver's own copy alone (`cuMemcpy2DAsync` within the GPU) once
    /// started ([`copy_rate_gbps`]), where timed.
    pub driver_copy_gbps: Option<f64>,
    /// µs for a signal to travel to the other device and back.
    pub round_trip_us: f64,
    /// µs of the local GEMM alone (cuBLAS).
    pub gemm_us: f64,
    /// (n, ratio): n local GEMMs of n devices at once took `ratio` × n times one alone.
    pub together: Vec<(usize, f64)>,
    /// The bench's `--shrink` (the local GEMM's dimensions divided by it).
    pub shrink: usize,
    /// The copy beside persistent kernels (benches since the calibration measured it).
    pub copy_beside_persistent: Option<BesidePersistent>,
    /// The reduce beside persistent kernels (likewise): alone, it times the reduce
    /// kernel's own rate; beside them, it checks the model, which sets nothing from it.
    pub reduce_beside_persistent: Option<BesidePersistent>,
    /// The calibration's persistent kernels alone (two devices' local GEMMs,
    /// [`crate::calibration::persistent_plan`]), writing f16 and writing f32, µs (likewise).
    pub persistent_kernels_us: Option<(f64, f64)>,
}

/// An op of the calibration (a copy, a reduce) beside the persistent kernels of
/// [`crate::calibration::persistent_plan`], each timed by events inside the same runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BesidePersistent {
    /// The op alone, µs.
    pub alone_us: f64,
    /// The op, started together with the kernels, µs.
    pub beside_us: f64,
    /// Device 0's persistent kernel in that run, µs.
    pub kernel_beside_us: f64,
}

impl BesidePersistent {
    /// The fraction of its rate the op kept while the kernels ran, if it kept any, where
    /// `fixed_us` of its time alone is fixed cost (its launch, a copy's signal latency) that
    /// no share slows: started together, it ran at that fraction while the kernel ran and
    /// at its own rate after, so `share × (min(op, kernel) − fixed) + max(0, op − kernel) =
    /// alone − fixed`. `None` when the op outlasted the kernel by its own time or more (it
    /// waited for the kernel's end: no rate to take), or a figure is not a positive time.
    pub fn share(&self, fixed_us: f64) -> Option<f64> {
        let (alone, beside, kernel) = (self.alone_us, self.beside_us, self.kernel_beside_us);
        if ![alone, beside, kernel].iter().all(|v| v.is_finite() && *v > 0.0) {
            return None;
        }
        let (busy, during) = (alone - fixed_us, beside.min(kernel) - fixed_us);
        if !(busy > 0.0 && during > 0.0) {
            return None;
        }
        let share = (busy - (beside - kernel).max(0.0)) / during;
        (share > 0.0).then_some(share.min(1.0))
    }
}

/// The fixed part of a copy between virtual devices as `profile` prices it: its launch,
/// then the signal's latency.
pub fn copy_fixed_us(profile: &Profile) -> f64 {
    profile.compute.launch_us + profile.interconnect.link_latency_us
}

/// The throughputs of 1 to [`MAX_CONCURRENT`] GEMMs at once from measured (n, ratio)
/// points, n local GEMMs having taken `ratio` × n times one alone (`alone_us`): as the
/// model runs them, each pays `fixed_us` (its launch and fixed cost, which overlap) and
/// they share the compute for their rates' parts, so at n the throughput is n rates' parts
/// over the time less one fixed cost; linear between the n measured, the last held beyond.
/// An error where a time together is not above the fixed cost.
fn concurrent_throughput(
    together: &[(usize, f64)],
    alone_us: f64,
    fixed_us: f64,
) -> Result<[f64; MAX_CONCURRENT], ValidationError> {
    let mut points = vec![(1usize, 1.0f64)];
    let mut measured = Vec::new();
    for &(n, ratio) in together.iter().filter(|(n, _)| (2..=MAX_CONCURRENT).contains(n)) {
        let together_us = ratio * n as f64 * alone_us;
        if together_us <= fixed_us {
            return Err(ValidationError::Calibration(format!(
                "{n} GEMMs at once in {together_us} µs are not above one GEMM's launch and fixed cost ({fixed_us} µs)"
            )));
        }
        measured.push((n, n as f64 * (alone_us - fixed_us) / (together_us - fixed_us)));
    }
    measured.sort_by_key(|&(n, _)| n);
    points.extend(measured);
    Ok(std::array::from_fn(|i| {
        let n = i + 1;
        match points.iter().position(|&(m, _)| m >= n) {
            Some(j) if points[j].0 == n || j == 0 => points[j].1,
            Some(j) => {
                let ((n0, g0), (n1, g1)) = (points[j - 1], points[j]);
                g0 + (g1 - g0) * (n - n0) as f64 / (n1 - n0) as f64
            }
            None => points[points.len() - 1].1,
        }
    }))
}

/// The rate, GB/s, at which a copy of `bytes` that took `us` alone moved them once
/// started, as `profile` prices a copy between virtual devices: a launch, the bytes at
/// that rate, then a signal's latency. An error where `us` is not above those two.
pub fn copy_rate_gbps(profile: &Profile, bytes: f64, us: f64) -> Result<f64, ValidationError> {
    let busy_us = us - copy_fixed_us(profile);
    if !(bytes.is_finite() && bytes > 0.0 && busy_us.is_finite() && busy_us > 0.0) {
        return Err(ValidationError::Calibration(format!(
            "a copy of {bytes} bytes in {us} µs is not above the profile's launch and signal latency"
        )));
    }
    Ok(bytes / busy_us / 1e3)
}

/// `profile` with the calibration's figures in place of its assumptions: both copy rates,
/// the remote waits (half a round trip, one signal reaching one wait, less the signal's
/// latency), the best efficiency scaled so that the local GEMM takes the measured time,
/// what GEMMs at once gain, and, where measured, the share of its rate a copy keeps beside
/// persistent kernels ([`BesidePersistent::share`]), the reduce kernel's own rate and the
/// together-rate of persistent kernels (of every Hopper rate that has one) writing f16 and
/// f32. The reduce beside persistent kernels sets nothing: a reduce shares the one compute
/// with them, which the line checks (docs/simulator.md, "a reduce beside persistent
/// kernels").
pub fn calibrated_one_gpu(profile: &Profile, c: &OneGpuCalibration) -> Result<Profile, ValidationError> {
    let bad = |what: String, value: f64| {
        ValidationError::Calibration(format!("{what} = {value} is not a positive time, rate or ratio"))
    };
    let ratios = c.together.iter().map(|&(n, r)| (format!("together ratio of {n}"), r));
    let mut figures = vec![("copy_gbps", c.copy_gbps), ("round_trip_us", c.round_trip_us), ("gemm_us", c.gemm_us)];
    figures.extend(c.driver_copy_gbps.map(|v| ("driver_copy_gbps", v)));
    for (what, value) in figures.into_iter().map(|(w, v)| (w.to_string(), v)).chain(ratios) {
        if !(value.is_finite() && value > 0.0) {
            return Err(bad(what, value));
        }
    }
    let s = c.shrink.max(1);
    let mut p = profile.clone();
    p.copy.copy_engine_gbps = c.copy_gbps;
    p.copy.sm_copy_gbps = c.copy_gbps;
    p.copy.driver_gbps = c.driver_copy_gbps.or(p.copy.driver_gbps);
    // A hop of the round trip is a signal's latency, then the wait's cost before the next
    // kernel: keep the profile's latency (if the hop allows it) and give the rest to the
    // waits, before SM work or not (on the GPU both are a kernel boundary).
    let hop = c.round_trip_us / 2.0;
    p.interconnect.link_latency_us = p.interconnect.link_latency_us.min(hop);
    p.sync.remote_round_us = hop - p.interconnect.link_latency_us;
    p.sync.dma_wait_us = p.sync.remote_round_us;
    // The rate scales so that the local GEMM takes the measured time: its launch and the
    // profile's fixed cost of a GEMM, which stay, then its rate's part.
    let (overhead_us, fixed_us) = (p.compute.gemm_overhead_us, p.compute.gemm_overhead_us + p.compute.launch_us);
    if c.gemm_us <= fixed_us {
        return Err(ValidationError::Calibration(format!(
            "gemm_us = {} is not above the profile's launch and fixed cost of a GEMM (compute.launch_us + \
             compute.gemm_overhead_us = {fixed_us})",
            c.gemm_us
        )));
    }
    let modelled_us = p.gemm_cost(1024 / s, 4096 / s, 4096 / s, DType::F16, DType::F16, false).work_s * 1e6;
    p.compute.max_efficiency =
        (p.compute.max_efficiency * (modelled_us - overhead_us) / (c.gemm_us - fixed_us)).min(1.0);
    p.compute.concurrent_throughput = concurrent_throughput(&c.together, c.gemm_us, fixed_us)?;
    if let Some(share) = c.copy_beside_persistent.and_then(|b| b.share(copy_fixed_us(&p))) {
        p.copy.rate_beside_persistent = Some(share);
    }
    // The reduce alone ([`crate::calibration::reduce_plan`]: two f32 blocks of the local
    // GEMM's output summed into a third) less its launch: the reduce kernel's own rate.
    if let Some(alone_us) = c.reduce_beside_persistent.as_ref().map(|r| r.alone_us) {
        let busy_us = alone_us - p.compute.launch_us;
        if !(alone_us.is_finite() && busy_us > 0.0) {
            return Err(bad("the reduce alone (µs)".into(), alone_us));
        }
        let bytes = 3.0 * (1024 / s) as f64 * (4096 / s) as f64 * 4.0;
        p.memory.reduce_gbps = Some(bytes / busy_us / 1e3);
    }
    // The together-rate of persistent kernels from the calibration's two alone, as the
    // GEMM's efficiency from the GEMM alone: their FLOPs over their time less a launch (the
    // model's price of them), for f16 and f32 results.
    if let Some((f16_us, f32_us)) = c.persistent_kernels_us {
        let flops = 2.0 * 2.0 * (1024 / s) as f64 * (4096 / s) as f64 * (4096 / s) as f64;
        let (launch_us, peak) = (p.compute.launch_us, p.peak_flops(DType::F16));
        let together = |what: &str, us: f64| {
            let busy = us - launch_us;
            if !(us.is_finite() && busy > 0.0) {
                return Err(bad(format!("persistent kernels writing {what} (µs)"), us));
            }
            Ok((flops / (busy * 1e-6) / peak).min(1.0))
        };
        let (f16_rate, f32_rate) = (together("f16", f16_us)?, together("f32", f32_us)?);
        let engines = p.engines.iter_mut().flat_map(|e| [&mut e.hopper_128x256, &mut e.hopper_128x128]);
        for rate in engines.flatten() {
            if rate.shared_efficiency.is_some() {
                (rate.shared_efficiency, rate.shared_efficiency_f32) = (Some(f16_rate), Some(f32_rate));
            }
        }
    }
    // What holds a profile file holds the calibrated profile: a bench whose figures are
    // positive but absurd (a copy of hours) must not price plans at infinity.
    p.check("calibrated from the bench").map_err(|e| ValidationError::Calibration(e.to_string()))?;
    Ok(p)
}

/// Flux's published performance report (8×H800, bf16): two shapes, the non-overlapped
/// NCCL + torch time and Flux's fused kernels. Ours: the baseline plan beside the first,
/// the tuner's best plan (each GEMM on the engine cmm runs it on) beside the second, and
/// the same best plan with every GEMM at cuBLAS's rate, a potential (rows are the
/// algorithm's name with its engines, and the numbers). GEMM+RS is shown with f32 partial
/// sums (our default contract) and with bf16 partials, as NCCL's reduce-scatter runs in
/// the input dtype.
pub fn flux(profile: &Profile) -> Result<Vec<(String, TimeRow)>, ValidationError> {
    // (op, M, N, K, wire, NCCL+torch µs, Flux µs)
    const SHAPES: [(OpKind, usize, usize, usize, DType, f64, f64); 3] = [
        (OpKind::AgGemm, 4096, 49152, 12288, DType::F32, 1429.0, 957.0),
        (OpKind::GemmRs, 4096, 12288, 49152, DType::F32, 1408.0, 932.0),
        (OpKind::GemmRs, 4096, 12288, 49152, DType::Bf16, 1408.0, 932.0),
    ];
    let mut rows = Vec::new();
    for (op, m, n, k, wire, torch, fused) in SHAPES {
        let p = Problem::new(op, 8, m, n, k, DType::Bf16, DType::Bf16)?.with_wire(wire)?;
        let ranking = super::tune::tune_1d(&p, profile)?;
        let base = ranking.ranked.iter().find(|c| c.algorithm == Algorithm::Baseline).expect("the baseline runs");
        let best = &ranking.ranked[0];
        let shape = format!("{op} {}", p.shape_string());
        for (ranked, published, what) in [(base, torch, "baseline vs NCCL+torch"), (best, fused, "best plan vs Flux")] {
            rows.push((
                format!("{} ({})", ranked.algorithm, ranked.report.engines.describe()),
                TimeRow {
                    case: format!("{shape} {what}"),
                    simulated_us: ranked.report.makespan_s * 1e6,
                    analytic_us: ring_1d(&p, ranked.algorithm, profile).total_s * 1e6,
                    published_us: published,
                },
            ));
        }
        // The potential: the best plan's GEMMs at cuBLAS's rate (what the Hopper engine
        // works toward), never what cmm runs today.
        let plan = build_plan(&p, best.algorithm)?;
        let at_cublas = SimOptions { engines: super::engine::Engines::CublasSpeed, ..SimOptions::default() };
        rows.push((
            format!("{} (at cuBLAS's rate)", best.algorithm),
            TimeRow {
                case: format!("{shape} best plan vs Flux, potential"),
                simulated_us: simulate(&plan, profile, &at_cublas)?.makespan_s * 1e6,
                analytic_us: ring_1d(&p, best.algorithm, profile).total_s * 1e6,
                published_us: fused,
            },
        ));
    }
    Ok(rows)
}

/// One claim of seed 002 checked against the analytic model.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimRow {
    /// The claim.
    pub claim: String,
    /// What the model predicts.
    pub predicted: String,
    /// What seed 002 reports.
    pub published: String,
    /// Whether the prediction agrees.
    pub holds: bool,
}

/// Seed 002's result: the claims checked, then per algorithm (name, best mesh, ms per block).
pub type Seed002 = (Vec<ClaimRow>, Vec<(String, String, f64)>);

/// Seed 002 (256 TPU v4, GPT-3 175B FC layers at batch 128): the ranking of the 2D
/// algorithms at each one's best mesh, MeshSlice's speed-up over Wang, and the mesh shape.
pub fn seed002(profile: &Profile) -> Result<Seed002, ValidationError> {
    let llm = LlmConfig::gpt3_175b(128);
    let configs = tune_llm(&llm, 256, profile)?;
    Ok(seed002_claims(&best_per_algorithm(&configs), true))
}

/// Seed 002's claims against cmm's own plans: each algorithm's best configuration by the
/// closed form ([`seed002`]), its mesh kept, replayed as cmm builds it ([`replay_llm`], each
/// layer at its best S of `slices`). The mesh shape the closed form picked is not a claim
/// here (the replay keeps it).
pub fn seed002_as_built(profile: &Profile, slices: &[usize]) -> Result<Seed002, ValidationError> {
    let llm = LlmConfig::gpt3_175b(128);
    let configs = tune_llm(&llm, 256, profile)?;
    let mut replayed = Vec::new();
    for c in best_per_algorithm(&configs) {
        replayed.extend(replay_llm(&llm, c.algorithm, c.shape, profile, slices)?);
    }
    replayed.sort_by(|a, b| a.total_s.total_cmp(&b.total_s));
    Ok(seed002_claims(&replayed.iter().collect::<Vec<_>>(), false))
}

/// Seed 002's claims checked on `best` (each algorithm's configuration, fastest first),
/// with its autotuner's mesh among them where `with_mesh`.
fn seed002_claims(best: &[&MeshConfig], with_mesh: bool) -> Seed002 {
    let time = |name: &str| best.iter().find(|c| c.algorithm.name() == name).map(|c| c.total_s);
    let order: Vec<&str> = best.iter().map(|c| c.algorithm.name()).collect();
    let position = |name: &str| order.iter().position(|n| *n == name).unwrap_or(usize::MAX);
    let mut rows = Vec::new();
    rows.push(ClaimRow {
        claim: "MeshSlice >= Wang >= Collective (each at its best mesh)".into(),
        predicted: order.join(" > "),
        published: "MeshSlice > Wang > Collective".into(),
        holds: position("MeshSlice") <= position("Wang") && position("Wang") <= position("Collective"),
    });
    rows.push(ClaimRow {
        claim: "SUMMA last".into(),
        predicted: format!("last: {}", order.last().copied().unwrap_or("-")),
        published: "SUMMA last (Cannon also slower than Collective)".into(),
        holds: order.last() == Some(&"SUMMA"),
    });
    if let (Some(ms), Some(wang)) = (time("MeshSlice"), time("Wang")) {
        let speedup = wang / ms - 1.0;
        rows.push(ClaimRow {
            claim: "MeshSlice faster than Wang (FC layers)".into(),
            predicted: format!("{:.1} %", speedup * 100.0),
            published: "13.8 %".into(),
            holds: speedup > 0.0,
        });
    }
    if let (true, Some(winner)) = (with_mesh, best.first()) {
        let slices: Vec<String> = winner.layers.iter().map(|l| format!("{}:S={}", l.layer, l.slices)).collect();
        rows.push(ClaimRow {
            claim: "autotuner's mesh shape and S".into(),
            predicted: format!("{} {} ({})", winner.algorithm, winner.shape, slices.join(" ")),
            published: "32x8 (the mesh seed 002 Fig. 14 tunes S on; best S not given in the seed)".into(),
            holds: winner.shape == MeshShape { rows: 32, cols: 8 },
        });
    }
    let per_algorithm =
        best.iter().map(|c| (c.algorithm.name().to_string(), c.shape.to_string(), c.total_s * 1e3)).collect();
    (rows, per_algorithm)
}

/// The cross-check of seed 002's autotuner: the analytic tuner's MeshSlice choice
/// (mesh and S per layer) beside cmm's own MeshSlice plans replayed on the `top` meshes the
/// tuner ranks highest, each layer at its best S of `slices` ([`replay_llm`]). Returns (the
/// tuner's choice, the replays, fastest first).
pub fn seed002_simulated(
    profile: &Profile,
    top: usize,
    slices: &[usize],
) -> Result<(MeshConfig, Vec<MeshConfig>), ValidationError> {
    let llm = LlmConfig::gpt3_175b(128);
    let configs = tune_llm(&llm, 256, profile)?;
    let meshslice: Vec<&MeshConfig> = configs.iter().filter(|c| c.algorithm == MeshFamily::MeshSlice).collect();
    let tuner = meshslice.first().map(|c| (*c).clone()).ok_or(TuneError::NoMeshConfiguration {
        what: "GPT-3 175B with MeshSlice".into(),
        chips: 256,
        why: String::new(),
    })?;
    let mut choices = Vec::new();
    for config in meshslice.iter().take(top) {
        choices.extend(replay_llm(&llm, MeshFamily::MeshSlice, config.shape, profile, slices)?);
    }
    choices.sort_by(|a, b| a.total_s.total_cmp(&b.total_s));
    Ok((tuner, choices))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seed 002's claims read the order and times they are given: the published order
    /// holds or fails by position, and the autotuner's mesh is a claim only where asked.
    #[test]
    fn seed_002s_claims_follow_the_configurations_given() {
        let config = |algorithm, ms: f64| MeshConfig {
            algorithm,
            shape: MeshShape { rows: 32, cols: 8 },
            layers: Vec::new(),
            total_s: ms * 1e-3,
            compute_s: 0.0,
        };
        let published = [
            config(MeshFamily::MeshSlice, 100.0),
            config(MeshFamily::Wang, 125.0),
            config(MeshFamily::Collective, 130.0),
            config(MeshFamily::Cannon, 200.0),
            config(MeshFamily::Summa, 300.0),
        ];
        let (rows, per_algorithm) = seed002_claims(&published.iter().collect::<Vec<_>>(), false);
        assert!(rows.iter().all(|r| r.holds) && rows.len() == 3, "{rows:?}");
        assert_eq!(rows[2].predicted, "25.0 %");
        assert_eq!(per_algorithm[4], ("SUMMA".to_string(), "32x8".to_string(), 300.0));
        let swapped = [&published[1], &published[0], &published[2], &published[4], &published[3]];
        let (rows, _) = seed002_claims(&swapped, true);
        assert!(!rows[0].holds && !rows[1].holds && rows[2].holds && rows.len() == 4, "{rows:?}");
        assert!(rows[3].holds && rows[3].predicted.starts_with("Wang 32x8"), "{rows:?}");
    }

    #[test]
    fn the_share_an_op_keeps_beside_persistent_kernels_is_read_from_its_times() {
        let share =
            |beside_us, kernel_beside_us| BesidePersistent { alone_us: 20.0, beside_us, kernel_beside_us }.share(0.0);
        // Ended under the kernel: alone ÷ beside.
        assert_eq!(share(80.0, 200.0), Some(0.25));
        // Outlasted it by 10 µs of its 20: the other 10 µs of work took the kernel's 200.
        assert_eq!(share(210.0, 200.0), Some(0.05));
        // Outlasted it by its own time or more: it waited for the kernel's end.
        assert_eq!(share(220.0, 200.0), None);
        assert_eq!(share(300.0, 200.0), None);
        // Faster beside than alone is noise, not a share above 1.
        assert_eq!(share(15.0, 200.0), Some(1.0));
        assert_eq!(share(f64::NAN, 200.0), None);
        assert_eq!(share(80.0, 0.0), None);
        // A fixed cost of 4 µs is no part of the share: 16 µs of work in the kernel's first
        // 64 µs after it, a quarter; all of it fixed, no rate to take.
        let pair = BesidePersistent { alone_us: 20.0, beside_us: 68.0, kernel_beside_us: 200.0 };
        assert_eq!(pair.share(4.0), Some(0.25));
        assert_eq!(pair.share(20.0), None);
        // The calibrated profile takes it; with none measured it keeps the profile's.
        let profile = Profile::load("h100-one-gpu").unwrap();
        let mut c = OneGpuCalibration {
            copy_gbps: 700.0,
            driver_copy_gbps: None,
            round_trip_us: 10.0,
            gemm_us: 60.0,
            together: vec![(2, 0.9)],
            shrink: 1,
            copy_beside_persistent: Some(BesidePersistent { alone_us: 20.0, beside_us: 80.0, kernel_beside_us: 200.0 }),
            reduce_beside_persistent: Some(BesidePersistent {
                alone_us: 10.0,
                beside_us: 100.0,
                kernel_beside_us: 200.0,
            }),
            persistent_kernels_us: Some((100.0, 125.0)),
        };
        let p = calibrated_one_gpu(&profile, &c).unwrap();
        // Its fixed costs aside: the copy's 2 µs launch and 1 µs latency (17 µs of work in
        // 77).
        let share = p.copy.rate_beside_persistent.unwrap();
        assert!((share - 17.0 / 77.0).abs() < 1e-12, "{share}");
        // The reduce beside them sets nothing (it shares the one compute with them): only
        // its time alone counts.
        let mut other = c.clone();
        other.reduce_beside_persistent =
            Some(BesidePersistent { alone_us: 10.0, beside_us: 11.0, kernel_beside_us: 300.0 });
        assert_eq!(calibrated_one_gpu(&profile, &other).unwrap(), p);
        // The reduce alone, 10 µs less a 2 µs launch for two f32 1024×4096 blocks read and
        // one written: the reduce kernel's rate, which prices every reduce (below the HBM's).
        let reduce_gbps = 3.0 * 1024.0 * 4096.0 * 4.0 / 8.0 / 1e3;
        assert!((p.memory.reduce_gbps.unwrap() - reduce_gbps).abs() < 1e-9, "{:?}", p.memory.reduce_gbps);
        // Faster than this HBM carries: the HBM's rate prices it.
        assert!(reduce_gbps * 1e9 > p.hbm_bps());
        assert_eq!(p.reduce_bps(), p.hbm_bps());
        // Two 1024×4096×4096 GEMMs in 100 µs less a 2 µs launch, and in 125 less 2 writing
        // f32: the together-rates those FLOPs give on this peak.
        let wide = |p: &Profile| p.engines.unwrap().hopper_128x256.unwrap();
        let rate = |us: f64| 4.0 * 1024.0 * 4096.0 * 4096.0 / ((us - 2.0) * 1e-6) / profile.peak_flops(DType::F16);
        let (f16_rate, f32_rate) = (wide(&p).shared_efficiency.unwrap(), wide(&p).shared_efficiency_f32.unwrap());
        assert!(
            (f16_rate - rate(100.0)).abs() < 1e-12 && (f32_rate - rate(125.0)).abs() < 1e-12,
            "{f16_rate} {f32_rate}"
        );
        // The narrow tile has no together-rate in the profile: none is made up for it.
        assert_eq!(p.engines.unwrap().hopper_128x128.unwrap().shared_efficiency, None);
        (c.copy_beside_persistent, c.reduce_beside_persistent, c.persistent_kernels_us) = (None, None, None);
        let p = calibrated_one_gpu(&profile, &c).unwrap();
        assert_eq!(p.copy.rate_beside_persistent, None);
        assert_eq!(p.memory.reduce_gbps, profile.memory.reduce_gbps);
        assert_eq!(
            (wide(&p).shared_efficiency, wide(&p).shared_efficiency_f32),
            (wide(&profile).shared_efficiency, None)
        );
        c.persistent_kernels_us = Some((1.0, 125.0));
        assert!(calibrated_one_gpu(&profile, &c).unwrap_err().to_string().contains("persistent kernels writing f16"));
    }

    #[test]
    fn seed000_overlap_beats_its_baseline_and_never_beats_the_lower_bound() {
        let h100 = Profile::load("h100-nvlink").unwrap();
        let rows = seed000(&h100).unwrap();
        assert_eq!(rows.len(), 6);
        for pair in rows.chunks(2) {
            let (ring, base) = (&pair[0], &pair[1]);
            assert!(ring.simulated_us < base.simulated_us, "{ring:?} {base:?}");
        }
        // Seed 000's lower bound D·t_local + (D−1)·t_sync with this profile's own constants.
        let local = h100.gemm_cost(1024, 4096, 4096, DType::F16, DType::F16, false).work_s * 1e6;
        for (row, d) in rows.iter().step_by(2).zip([2.0, 4.0, 8.0]) {
            let bound = d * local + (d - 1.0) * h100.sync.remote_round_us;
            assert!(row.simulated_us >= bound, "{row:?} below {bound}");
        }
    }

    #[test]
    fn the_one_gpu_model_follows_the_h100_bench_where_it_models_the_cost() {
        let profile = Profile::load("h100-one-gpu").unwrap();
        let rows = one_gpu_bench(&profile).unwrap();
        assert_eq!(rows.len(), 18);
        for row in &rows {
            let t = &row.time;
            // This bench left its copies to the driver, which the model prices at the
            // driver's shared rate, beside compute at the calibration pair's share of it:
            // the baselines, whose copies follow their GEMMs, within 5 % (5 to 15 % fast
            // before the rate was shared); the other plans no row slow by more than 5 %,
            // none fast by more than 30 % (ring_accumulate(c=2) at D = 4 and 8, whose
            // 512-row GEMMs also overlap less than the model lets them: docs/simulator.md).
            let bound = if matches!(row.algorithm, Algorithm::Baseline | Algorithm::BaselineDirect) {
                -0.05..0.05
            } else {
                -0.30..0.05
            };
            assert!(bound.contains(&t.relative_error()), "{t:?}");
            // The closed forms read one GPU as D devices in lockstep, each with 1/D of it
            // (a reduce too, which the simulator runs at the kernel's whole rate beside the
            // others' work; and the direct baseline's last copies beside its reduces, which
            // slow each other in the simulator alone: it differs most). With the copy
            // engines' copies they follow the simulator within 6 %; with the driver's they
            // leave out its contention beside compute, so they are never slower than it.
            let p = seed000_problem(row.op, row.devices, 1).unwrap();
            let closed = ring_1d_with(&p, row.algorithm, BaselineSums::InSeries, &profile);
            let closed_us = closed.total_s * 1e6;
            assert!((closed_us - row.copy_engines_us).abs() < 0.06 * row.copy_engines_us, "{row:?}");
            assert!(t.analytic_us < t.simulated_us * 1.06, "{t:?}");
            // Staggering can expose a copy the plain run hid under a GEMM (a copy beside
            // compute is slowed, docs/simulator.md): by a few per cent at most, as in the
            // bench (up to 3.5 % on the H100, 2026-11-26); and no plan beats its compute.
            assert!(row.staggered_us <= t.simulated_us * 1.05, "{row:?}");
            for time in [row.staggered_us, row.offset_us] {
                assert!(time >= row.compute_floor_us * (1.0 - 1e-9), "{row:?}");
            }
        }
        // Adding in the GEMM does not hide its copies at D = 4 and 8, together, staggered
        // or with the starts offset: the H100 benches of 2026-11-25 and 26 measured all
        // three within a few per cent of each other, over 10 % above the plan's compute
        // twin. (Without the contention term the model said staggering hid them.)
        for d in [4, 8] {
            let row = rows.iter().find(|r| r.time.case == format!("gemm_rs D={d} ring_accumulate")).unwrap();
            for time in [row.time.simulated_us, row.staggered_us, row.offset_us] {
                assert!(time > 1.05 * row.compute_floor_us, "{row:?}");
            }
        }
    }

    #[test]
    fn ring_push_is_predicted_within_its_compute_on_one_gpu_and_under_ring_accumulate() {
        let one = Profile::load("h100-one-gpu").unwrap();
        let measured = one_gpu_bench(&one).unwrap();
        for row in one_gpu_predictions(&one).unwrap() {
            let t = &row.time;
            assert!(t.published_us.is_nan(), "{}: not measured yet", t.case);
            // No copies to expose: within 5 % of its own compute, as the issue's bound asks:
            // the shared work, and each of its D steps' GEMM's fixed cost and launch, which
            // lie on its path beside the others' work.
            let d: usize = t.case.split("D=").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
            let path_us = d as f64 * (one.compute.gemm_overhead_us + one.compute.launch_us);
            assert!(t.simulated_us <= 1.05 * (row.compute_floor_us + path_us), "{}: {t:?}", t.case);
            let accumulate = measured.iter().find(|r| r.time.case == format!("gemm_rs D={d} ring_accumulate")).unwrap();
            // One step at D = 2: the copy hides under the own block's GEMM, the plans tie.
            // From D = 4 the lockstep copies it saves are over 5 % of ring_accumulate.
            let most = if d == 2 { 1.01 } else { 0.95 };
            assert!(t.simulated_us <= most * accumulate.time.simulated_us, "{}: {t:?}", t.case);
        }
    }

    /// Flux's published times stay visible beside what cmm would take: the best plan as
    /// built names its engines, its potential (every GEMM at cuBLAS's rate) is never slower
    /// than it, and at that potential the fused plans reach Flux's times (the comparison
    /// the simulator used to claim as cmm's own).
    #[test]
    fn flux_s_times_stand_beside_the_as_built_plan_and_its_potential() {
        let h800 = Profile::load("h800-nvlink").unwrap();
        let rows = flux(&h800).unwrap();
        for case in ["ag_gemm M=4096 N=49152 K=12288", "wire=bf16"] {
            let row = |what: &str| {
                rows.iter()
                    .find(|(_, r)| r.case.contains(case) && r.case.ends_with(what))
                    .unwrap_or_else(|| panic!("{case} {what}"))
            };
            let (built_name, built) = row("best plan vs Flux");
            let (potential_name, potential) = row("best plan vs Flux, potential");
            assert!(built_name.contains(" on ") || built_name.contains('×'), "{built_name}: the engines are named");
            assert!(potential_name.ends_with("(at cuBLAS's rate)"), "{potential_name}");
            assert!(potential.simulated_us <= built.simulated_us + 1e-6, "{potential:?} vs {built:?}");
            if built_name.starts_with("fused") {
                assert!(built_name.contains("Hopper engine"), "{built_name}: a fused plan runs cmm's kernel");
                assert!(potential.simulated_us <= potential.published_us, "{case}: {potential:?}");
            }
        }
        // The non-overlapped baseline as users run it (bf16 partials) stays near NCCL+torch.
        let (_, base) = rows.iter().find(|(_, r)| r.case.contains("wire=bf16 baseline")).unwrap();
        assert!(base.relative_error().abs() <= 0.15, "{base:?}");
    }

    /// Seed 000 at D = 8 on 8 H100s: the fused plan's kernel is cmm's Hopper engine, so its
    /// prediction is no faster than at cuBLAS's rate; at that rate (a potential) it keeps
    /// the lead on the Pallas time it used to be claimed with.
    #[test]
    fn seed000_d8_s_fused_plan_is_priced_on_the_hopper_engine() {
        let h100 = Profile::load("h100-nvlink").unwrap();
        let p = Problem::new(OpKind::AgGemm, 8, 8 * 1024, 8 * 4096, 4096, DType::F16, DType::F16).unwrap();
        let time = |algorithm, engines| {
            let options = SimOptions { engines, ..SimOptions::default() };
            simulate(&build_plan(&p, algorithm).unwrap(), &h100, &options).unwrap()
        };
        use super::super::engine::Engines;
        let fused = time(Algorithm::Fused { chunks: 1 }, Engines::AsBuilt);
        let potential = time(Algorithm::Fused { chunks: 1 }, Engines::CublasSpeed);
        assert!(fused.engines.describe().contains("Hopper engine"), "{:?}", fused.engines);
        assert!(potential.makespan_s <= fused.makespan_s, "{} > {}", potential.makespan_s, fused.makespan_s);
        assert!(potential.makespan_s * 1e6 <= 400.0, "the Pallas time stays in reach at cuBLAS's rate");
        // One kernel of waves: never below its own compute.
        let g = h100.fused_gemm_cost(&[1024; 8], 4096, 4096, DType::F16, DType::F16, false).work_s * 1e6;
        assert!(potential.makespan_s * 1e6 >= g);
    }

    /// On one H200 and on one H100 (the CUDA benches of 2026-11-26) every fused plan on the
    /// Hopper engine took longer than the best ring plan of its op and D (H200, ag_gemm:
    /// ring 212, 846, 3403 µs against fused 653, 1733, 5197; gemm_rs: ring_push 247, 883,
    /// 3372 against 468, 1800, 7402; H100: ring 210, 840, 3420 against 765, 1697, 5760;
    /// ring_push 249, 904, 3442 against 508, 1840, 8255). The one-GPU profiles must not rank
    /// a fused plan first where that was measured.
    #[test]
    fn on_one_gpu_no_fused_plan_outranks_what_the_benches_measured_faster() {
        for name in ["h200-one-gpu", "h100-one-gpu"] {
            let profile = Profile::load(name).unwrap();
            for (op, d) in [OpKind::AgGemm, OpKind::GemmRs].into_iter().flat_map(|op| [2, 4, 8].map(|d| (op, d))) {
                let p = seed000_problem(op, d, 1).unwrap();
                let ranking = super::super::tune::tune_1d(&p, &profile).unwrap();
                let position = |wanted: &dyn Fn(Algorithm) -> bool| {
                    ranking.ranked.iter().position(|c| wanted(c.algorithm)).unwrap()
                };
                let fused = position(&|a| a.is_fused());
                let measured_faster = if op == OpKind::AgGemm { Algorithm::Ring } else { Algorithm::RingPush };
                let winner = ranking.winner().algorithm;
                assert!(position(&|a| a == measured_faster) < fused, "{name} {op} D={d}: {winner:?}");
            }
        }
    }

    #[test]
    fn seed002_meshslice_leads_and_overlap_beats_collective() {
        let tpu = Profile::load("tpuv4-torus").unwrap();
        let (claims, per_algorithm) = seed002(&tpu).unwrap();
        assert_eq!(per_algorithm[0].0, "MeshSlice");
        assert!(claims[0].holds, "{claims:?}");
        assert_eq!(per_algorithm.len(), MeshFamily::ALL.len());
    }
}
