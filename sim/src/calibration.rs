//! The plans behind the one-GPU profile's calibration: `cargo xtask bench --backend cuda`
//! times them on the GPU (`xtask/src/calibrate.rs`), and `cmm simulate --validate-bench`
//! simulates the same plans, so the model meets each measurement on the plan that made it.

use cmm_core::dtype::DType;
use cmm_core::plan::{BufId, BufferRole, Engine, Op, Plan, PlanBuilder, PlanError};
use serde::{Deserialize, Serialize};

use crate::validate::BesidePersistent;

/// Round trips in [`round_trip_plan`] (each lane has 2 ops per round, under the CUDA
/// gate's limit of ops per stream).
pub const ROUNDS: usize = 100;

/// An input buffer of every device, filled alike on each.
fn input(b: &mut PlanBuilder, name: &str, tensor: u32, dtype: DType, rows: usize, cols: usize) -> BufId {
    let devices = b.devices();
    b.buffer(name, dtype, rows, cols, BufferRole::Input { tensor, global_cols: cols, origins: vec![(0, 0); devices] })
}

/// What device 0 runs beside the calibration's GEMMs, on a lane of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Beside {
    /// Nothing.
    Nothing,
    /// A copy of an f32 `m×n` block (one ring step's partial sum) to device 1.
    Copy,
    /// A reduce of two f32 `m×n` blocks into a third (one ring step's sum of partials): a
    /// kernel on the SMs, whatever the driver does with copies.
    Reduce,
}

/// `devices` devices, each running one `m×n×k` f16 GEMM on a compute lane (with `gemm`);
/// with `copy`, device 0 also copies an f32 `m×n` block (one ring step's partial sum) to
/// device 1 on a comm lane.
pub fn gemms_plan(devices: usize, shape: (usize, usize, usize), gemm: bool, copy: bool) -> Result<Plan, PlanError> {
    let name = format!("calibration: {devices} devices, gemm {gemm}, copy {copy}");
    let beside = if copy { Beside::Copy } else { Beside::Nothing };
    local_plan(name, devices, shape, gemm.then_some(None), DType::F16, beside)
}

/// `devices` devices, each running one `m×n×k` f16 GEMM as a persistent kernel (a fused
/// GEMM of one block and no waits: the kernel and grid of the fused plans' GEMMs), and
/// device 0 running `beside` on a lane of its own. It measures what a copy, or a kernel
/// that is not persistent, keeps of its rate while persistent kernels hold the SMs, which
/// the fused plans' copies and reduces meet and the cuBLAS pair does not show.
pub fn persistent_plan(devices: usize, shape: (usize, usize, usize), beside: Beside) -> Result<Plan, PlanError> {
    let name = format!("calibration: {devices} persistent GEMMs, beside them {beside:?}");
    local_plan(name, devices, shape, Some(Some(0)), DType::F16, beside)
}

/// [`persistent_plan`]'s kernels writing f32, as gemm_rs's fused GEMMs write their partial
/// sums (ag_gemm's write f16, and the together-rate of the profiles comes from those), with
/// nothing beside them.
pub fn persistent_f32_plan(devices: usize, shape: (usize, usize, usize)) -> Result<Plan, PlanError> {
    let name = format!("calibration: {devices} persistent GEMMs writing f32");
    local_plan(name, devices, shape, Some(Some(0)), DType::F32, Beside::Nothing)
}

/// Device 0's reduce of [`Beside::Reduce`] alone (on 2 devices, as the pair runs).
pub fn reduce_plan(shape: (usize, usize, usize)) -> Result<Plan, PlanError> {
    local_plan("calibration: a reduce alone".into(), 2, shape, None, DType::F16, Beside::Reduce)
}

/// Every device's local GEMM where `gemm` is given (its `fused` id: `None`, a GEMM of its
/// own) writing `out`, and device 0 running `beside` on a lane of its own.
fn local_plan(
    name: String,
    devices: usize,
    (m, n, k): (usize, usize, usize),
    gemm: Option<Option<u32>>,
    out: DType,
    beside: Beside,
) -> Result<Plan, PlanError> {
    let mut b = PlanBuilder::new(name, devices);
    let a = input(&mut b, "A", 0, DType::F16, m, k);
    let w = input(&mut b, "B", 1, DType::F16, k, n);
    let x = input(&mut b, "X", 2, DType::F32, m, n);
    let c = b.buffer("C", out, m, n, BufferRole::Output);
    let y = b.buffer("Y", DType::F32, m, n, BufferRole::Scratch);
    let (compute, comm) = (b.lane("compute"), b.lane("comm"));
    if let Some(id) = gemm {
        for d in 0..devices {
            let mut op = Op::gemm(b.whole(a), b.whole(w), b.whole(c));
            if let Op::Gemm { fused, .. } = &mut op {
                *fused = id;
            }
            b.push(d, compute, op);
        }
    }
    match beside {
        Beside::Nothing => {}
        Beside::Copy => {
            let (src, dst) = (b.whole(x), b.whole(y));
            b.push(0, comm, Op::Copy { src, dst_device: 1, dst, engine: Engine::CopyEngine });
        }
        Beside::Reduce => {
            let z = input(&mut b, "Z", 3, DType::F32, m, n);
            let op = Op::Reduce { inputs: vec![b.whole(x), b.whole(z)], output: b.whole(y) };
            b.push(0, comm, op);
        }
    }
    b.finish()
}

/// Device 0 signals device 1, which answers; [`ROUNDS`] times.
pub fn round_trip_plan() -> Result<Plan, PlanError> {
    let mut b = PlanBuilder::new("calibration: signal-wait rounds", 2);
    let (ping, pong) = (b.semaphore("ping"), b.semaphore("pong"));
    let lane = b.lane("sync");
    for round in 1..=ROUNDS as u32 {
        b.push(0, lane, Op::Signal { device: 1, sem: ping, add: 1 });
        b.push(0, lane, Op::Wait { sem: pong, value: round });
        b.push(1, lane, Op::Wait { sem: ping, value: round });
        b.push(1, lane, Op::Signal { device: 0, sem: pong, add: 1 });
    }
    b.finish()
}

/// What the bench measured on [`persistent_plan`]s: the `persistent` object of a bench
/// report's `calibration`, written by the bench and read by `--validate-bench`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PersistentTimes {
    /// Devices with a persistent kernel each.
    pub devices: usize,
    /// The engine the kernels ran on, as the backend counts it.
    pub gemm_engine: String,
    /// The kernels alone (the plan beside nothing), µs.
    pub kernels_us: f64,
    /// The same kernels writing f32 ([`persistent_f32_plan`]) alone, µs.
    pub kernels_f32_us: f64,
    /// Started together: device 0's kernel and the copy ([`Beside::Copy`]), µs.
    pub kernel_beside_copy_us: f64,
    pub copy_beside_kernel_us: f64,
    /// The same with the copy asked of the copy engines; null where the driver lacks the
    /// call.
    pub copy_engines: Option<PairTimes>,
    /// Device 0's reduce ([`reduce_plan`]) alone, µs, and beside the kernels
    /// ([`Beside::Reduce`]).
    pub reduce_us: f64,
    pub reduce_beside: PairTimes,
    /// The copy made by `cmm_copy2d` on the SMs (the bench's `sm copies` variant) alone,
    /// µs, and beside the kernels; null in reports from before 2026-11-28's second session.
    #[serde(default)]
    pub sm_copy_us: Option<f64>,
    #[serde(default)]
    pub sm_copy_beside: Option<PairTimes>,
}

/// A persistent kernel and an op beside it started together, each one's time, µs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairTimes {
    pub kernel_us: f64,
    pub op_us: f64,
}

impl PersistentTimes {
    /// The copy beside the kernels, given the copy's time alone (the calibration's own
    /// line), as the simulator's calibration reads it.
    pub fn copy_beside(&self, copy_alone_us: f64) -> BesidePersistent {
        BesidePersistent {
            alone_us: copy_alone_us,
            beside_us: self.copy_beside_kernel_us,
            kernel_beside_us: self.kernel_beside_copy_us,
        }
    }

    /// The reduce beside the kernels, likewise.
    pub fn reduce_beside(&self) -> BesidePersistent {
        BesidePersistent {
            alone_us: self.reduce_us,
            beside_us: self.reduce_beside.op_us,
            kernel_beside_us: self.reduce_beside.kernel_us,
        }
    }
}
