//! The measurements behind the one-GPU simulator profile (`sim/profiles/h100-one-gpu.toml`),
//! taken by `cargo xtask bench --backend cuda` on the GPU it runs on, so that the profile's
//! assumptions can be replaced by figures: the device-to-device copy rate, what D GEMMs at
//! once gain over one at a time, what a copy and a GEMM beside each other cost each other
//! (the driver's copy, and the same copy asked of the copy engines), what a copy and a
//! reduce keep beside persistent kernels (the fused plans' GEMMs), and a signal–wait
//! round between two devices. Each is a small plan
//! (`cmm_sim::calibration`, which the simulator runs too) run through the backend like
//! any other (gated, cold L2, median of the bench's repetitions).

use anyhow::{Context, Result};
use cmm_core::emulate::sm_copies;
use cmm_core::plan::Op;
use cmm_core::{DType, Family, Plan};
use cmm_cuda::{CopyIssue, CudaBackend, CudaExecutor, CudaRunOptions, GemmEngine, GemmSpec};
use cmm_sim::calibration::{self, PairTimes, PersistentTimes};
use serde::Serialize;

use crate::timing::{median, time_plan};

/// D GEMMs of the local shape on D devices at once, against D times one alone.
#[derive(Debug, Serialize)]
pub struct Together {
    pub devices: usize,
    pub together_us: f64,
    /// D × the GEMM alone (cuBLAS, timed by itself).
    pub one_at_a_time_us: f64,
    /// `together_us / one_at_a_time_us` (< 1: running together gains).
    pub ratio: f64,
}

/// What the bench measured for the one-GPU profile.
#[derive(Debug, Serialize)]
pub struct Calibration {
    /// Bytes of the copies below (an f32 1024×4096 block: one ring step's partial sum).
    pub copy_bytes: usize,
    /// One copy from a device to another alone, µs, and its rate in GB/s copied.
    pub copy_us: f64,
    pub copy_gbps: f64,
    /// The local GEMMs of 2, 4 and 8 devices at once.
    pub together: Vec<Together>,
    /// The local GEMM alone, µs (cuBLAS).
    pub gemm_us: f64,
    /// A copy and a GEMM of two devices started together: each one's time in that run
    /// (events around each op), µs.
    pub gemm_beside_copy_us: f64,
    pub copy_beside_gemm_us: f64,
    /// One signal–wait round trip between two devices, µs (the mean of `calibration::ROUNDS`).
    pub round_trip_us: f64,
    /// The copy asked of the copy engines (`CopyIssue::PreferCopyEngines`), alone and
    /// beside the GEMM; null where the driver lacks the call. Within one GPU the driver's
    /// own copy may run on the SMs: if so, this one keeps its pace beside the GEMM where
    /// that one waits for the GEMM's SMs.
    pub copy_engines: Option<EngineCopies>,
    /// The copy and a reduce beside two devices' persistent kernels; null where they
    /// failed to run (the bench says why).
    pub persistent: Option<PersistentTimes>,
}

/// The calibration's copy asked of the copy engines.
#[derive(Debug, Serialize)]
pub struct EngineCopies {
    /// Alone, µs, and its rate in GB/s copied.
    pub copy_us: f64,
    pub copy_gbps: f64,
    /// Started together with device 0's GEMM: each one's time in that run, µs.
    pub gemm_beside_copy_us: f64,
    pub copy_beside_gemm_us: f64,
}

/// Median GPU time of `reps` runs of `plan`, µs (as the bench times a plan).
fn time(backend: &CudaBackend, plan: &Plan, options: &CudaRunOptions, reps: usize) -> Result<f64> {
    Ok(time_plan(backend, plan, options, reps, false)?.0)
}

/// Measures the calibration at the local GEMM's shape `(m, n, k)` (f16).
pub fn calibrate(
    backend: &CudaBackend,
    options: &CudaRunOptions,
    (m, n, k): (usize, usize, usize),
    reps: usize,
) -> Result<Calibration> {
    // The copies' first lines are the driver's, whatever the bench's default: the report's
    // `copies` says which the plans took, and `copy_engines` holds the other way.
    let options = CudaRunOptions { gemm: GemmEngine::Cublas, copies: CopyIssue::Driver, ..*options };
    let spec =
        GemmSpec { m, n, k, input: DType::F16, output: DType::F16, trans_a: false, trans_b: false, accumulate: false };
    let gemm_us = backend.time_gemm(&spec, GemmEngine::Cublas, reps).context("timing the local GEMM")?;
    let copy_bytes = m * n * 4;
    let copy_us = time(backend, &calibration::gemms_plan(2, (m, n, k), false, true)?, &options, reps)?;
    let mut together = Vec::new();
    for devices in [2, 4, 8] {
        let together_us = time(backend, &calibration::gemms_plan(devices, (m, n, k), true, false)?, &options, reps)?;
        let one_at_a_time_us = devices as f64 * gemm_us;
        together.push(Together { devices, together_us, one_at_a_time_us, ratio: together_us / one_at_a_time_us });
    }
    let pair = calibration::gemms_plan(2, (m, n, k), true, true)?;
    let (gemm_beside_copy_us, copy_beside_gemm_us) = beside(backend, &pair, &options, reps)?.0;
    let round_trip_us = time(backend, &calibration::round_trip_plan()?, &options, reps)? / calibration::ROUNDS as f64;
    let copy_engines = match backend.batch_copies() {
        Ok(()) => {
            let engines = CudaRunOptions { copies: CopyIssue::PreferCopyEngines, ..options };
            let copy_us = time(backend, &calibration::gemms_plan(2, (m, n, k), false, true)?, &engines, reps)?;
            let (gemm_beside_copy_us, copy_beside_gemm_us) = beside(backend, &pair, &engines, reps)?.0;
            let copy_gbps = copy_bytes as f64 / copy_us / 1e3;
            Some(EngineCopies { copy_us, copy_gbps, gemm_beside_copy_us, copy_beside_gemm_us })
        }
        Err(_) => None,
    };
    // The persistent kernels run on the engine the fused plans' GEMMs take.
    let persistent = persistent(backend, CudaRunOptions { gemm: GemmEngine::Auto, ..options }, (m, n, k), reps)
        .map_err(|e| println!("calibration: the persistent kernels' lines failed: {e:#}"))
        .ok();
    Ok(Calibration {
        copy_bytes,
        copy_us,
        copy_gbps: copy_bytes as f64 / copy_us / 1e3,
        together,
        gemm_us,
        gemm_beside_copy_us,
        copy_beside_gemm_us,
        round_trip_us,
        copy_engines,
        persistent,
    })
}

/// The copy beside two devices' persistent kernels, the driver's and, where the driver has
/// the call, the copy engines', and a reduce beside them.
fn persistent(
    backend: &CudaBackend,
    options: CudaRunOptions,
    shape: (usize, usize, usize),
    reps: usize,
) -> Result<PersistentTimes> {
    let devices = 2;
    let alone = calibration::persistent_plan(devices, shape, calibration::Beside::Nothing)?;
    let kernels_us = time_plan(backend, &alone, &options, reps, true)?.0;
    let kernels_f32_us =
        time_plan(backend, &calibration::persistent_f32_plan(devices, shape)?, &options, reps, true)?.0;
    let plan = calibration::persistent_plan(devices, shape, calibration::Beside::Copy)?;
    let ((kernel_beside_copy_us, copy_beside_kernel_us), gemm_engine) = beside(backend, &plan, &options, reps)?;
    // The same copy made by cmm_copy2d on the SMs, alone and beside the kernels.
    let sm_copy_us = time(backend, &sm_copies(&calibration::gemms_plan(2, shape, false, true)?), &options, reps)?;
    let (sm_copy_beside, _) = beside(backend, &sm_copies(&plan), &options, reps)?;
    let copy_engines = match backend.batch_copies() {
        Ok(()) => {
            let engines = CudaRunOptions { copies: CopyIssue::PreferCopyEngines, ..options };
            let ((kernel_us, op_us), _) = beside(backend, &plan, &engines, reps)?;
            Some(PairTimes { kernel_us, op_us })
        }
        Err(_) => None,
    };
    let reduce_us = time(backend, &calibration::reduce_plan(shape)?, &options, reps)?;
    let plan = calibration::persistent_plan(devices, shape, calibration::Beside::Reduce)?;
    let ((kernel_us, op_us), _) = beside(backend, &plan, &options, reps)?;
    Ok(PersistentTimes {
        devices,
        gemm_engine,
        kernels_us,
        kernels_f32_us,
        kernel_beside_copy_us,
        copy_beside_kernel_us,
        copy_engines,
        reduce_us,
        reduce_beside: PairTimes { kernel_us, op_us },
        sm_copy_us: Some(sm_copy_us),
        sm_copy_beside: Some(PairTimes { kernel_us: sm_copy_beside.0, op_us: sm_copy_beside.1 }),
    })
}

/// The GEMM of device 0 and the op beside it in `plan` (a calibration plan: its copy to
/// device 1, or its reduce) started together, each timed inside the same runs (events
/// around each op): the medians of the GEMM's and the op's times, µs, and the engines its
/// GEMMs ran on.
fn beside(backend: &CudaBackend, plan: &Plan, options: &CudaRunOptions, reps: usize) -> Result<((f64, f64), String)> {
    let timed = CudaRunOptions { time_ops: true, ..*options };
    let (mut gemm_times, mut op_times) = (Vec::new(), Vec::new());
    let mut engines = String::new();
    for rep in 0..reps {
        let out = backend
            .run(plan, 1000 + rep as u32, Family::Realistic, &timed)
            .with_context(|| format!("running {}", plan.name))?;
        engines = out.gemms.describe();
        for (site, _, duration) in &out.op_times {
            match plan.programs[site.device].lanes[site.lane][site.index] {
                Op::Gemm { .. } if site.device == 0 => gemm_times.push(*duration),
                Op::Copy { .. } | Op::Reduce { .. } => op_times.push(*duration),
                _ => {}
            }
        }
    }
    Ok(((median(gemm_times), median(op_times)), engines))
}

impl Calibration {
    /// The lines the bench prints.
    pub fn lines(&self) -> Vec<String> {
        let mut lines = vec![format!(
            "calibration: a {:.1} MiB device-to-device copy alone {:.1} µs ({:.0} GB/s copied); the local GEMM alone {:.1} µs",
            self.copy_bytes as f64 / (1 << 20) as f64,
            self.copy_us,
            self.copy_gbps,
            self.gemm_us
        )];
        for t in &self.together {
            lines.push(format!(
                "calibration: {} local GEMMs at once {:.1} µs, one at a time {:.1} µs ({:.3}×)",
                t.devices, t.together_us, t.one_at_a_time_us, t.ratio
            ));
        }
        lines.push(format!(
            "calibration: started together, the GEMM took {:.1} µs and the copy {:.1} µs (alone: {:.1} and {:.1})",
            self.gemm_beside_copy_us, self.copy_beside_gemm_us, self.gemm_us, self.copy_us
        ));
        lines.push(format!("calibration: a signal-wait round trip between two devices {:.2} µs", self.round_trip_us));
        if let Some(e) = &self.copy_engines {
            lines.push(format!(
                "calibration: the copy asked of the copy engines alone {:.1} µs ({:.0} GB/s); started together with the GEMM, the GEMM took {:.1} µs and the copy {:.1} µs",
                e.copy_us, e.copy_gbps, e.gemm_beside_copy_us, e.copy_beside_gemm_us
            ));
        }
        if let Some(p) = &self.persistent {
            lines.push(format!(
                "calibration: {} persistent GEMMs ({}) alone {:.1} µs ({:.1} µs writing f32); started together with the copy, device 0's took {:.1} µs and the copy {:.1} µs{}",
                p.devices,
                p.gemm_engine,
                p.kernels_us,
                p.kernels_f32_us,
                p.kernel_beside_copy_us,
                p.copy_beside_kernel_us,
                p.copy_engines.as_ref().map_or(String::new(), |e| format!(
                    "; the copy asked of the copy engines: the kernel {:.1} µs, the copy {:.1} µs",
                    e.kernel_us, e.op_us
                ))
            ));
            lines.push(format!(
                "calibration: a reduce of two {:.1} MiB blocks alone {:.1} µs; started together with the {} persistent GEMMs, device 0's took {:.1} µs and the reduce {:.1} µs",
                self.copy_bytes as f64 / (1 << 20) as f64,
                p.reduce_us,
                p.devices,
                p.reduce_beside.kernel_us,
                p.reduce_beside.op_us
            ));
            if let (Some(alone), Some(pair)) = (p.sm_copy_us, p.sm_copy_beside) {
                lines.push(format!(
                    "calibration: the copy made on the SMs (cmm_copy2d) alone {alone:.1} µs; started together with the {} persistent GEMMs, device 0's took {:.1} µs and the copy {:.1} µs",
                    p.devices, pair.kernel_us, pair.op_us
                ));
            }
        }
        lines
    }
}
