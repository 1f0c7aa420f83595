//! Timing on the GPU, shared by the bench and the calibration: medians and a plan's
//! median GPU time on the engine it is meant to run on.

use anyhow::{bail, Context, Result};
use cmm_core::{Family, Plan};
use cmm_cuda::{CudaBackend, CudaExecutor, CudaRunOptions};

/// The median of `xs` (of an even count, the mean of the middle two).
pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// The GEMMs of `plan` that are not blocks of a tile-granular GEMM (fused_push's first).
pub(crate) fn own_gemms(plan: &Plan) -> usize {
    plan.ops().filter(|(_, op)| matches!(op, cmm_core::plan::Op::Gemm { fused: None, .. })).count()
}

/// Median GPU time in µs of `reps` runs of `plan` (fresh inputs per run, a new seed, then
/// the L2 overwritten: `options.cold_l2`),
/// after one warm-up; fails unless every GEMM ran on cuBLAS, or with `fused` every fused
/// run on cmm's persistent kernels (a GEMM that waits per tile cannot be a cuBLAS call)
/// and on cuBLAS no more than the plan's GEMMs of their own (fused_push's first), so that
/// no row names an engine that did not run.
pub(crate) fn time_plan(
    backend: &CudaBackend,
    plan: &Plan,
    options: &CudaRunOptions,
    reps: usize,
    fused: bool,
) -> Result<(f64, bool)> {
    let warm = backend.run(plan, 1, Family::Realistic, options).with_context(|| format!("warm-up of {}", plan.name))?;
    let (expected, other) = if fused {
        (
            "cmm's persistent kernels (and cuBLAS for GEMMs of their own)",
            warm.gemms.cublas.saturating_sub(own_gemms(plan)),
        )
    } else {
        ("cuBLAS", warm.gemms.tile + warm.gemms.hopper)
    };
    if other > 0 {
        bail!("{}: GEMMs ran on {}; the bench times this plan on {expected} only", plan.name, warm.gemms.describe());
    }
    let mut times = Vec::new();
    let mut gated = true;
    for rep in 0..reps {
        let out = backend
            .run(plan, 1000 + rep as u32, Family::Realistic, options)
            .with_context(|| format!("running {}", plan.name))?;
        gated &= out.gated;
        times.push(out.gpu_time.as_secs_f64() * 1e6);
    }
    Ok((median(times), gated))
}
