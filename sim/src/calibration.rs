//! The plans behind the one-GPU profile's calibration: `cargo xtask bench --backend cuda`
//! times them on the GPU (`xtask/src/calibrate.rs`), and `cmm simulate --validate-bench`
//! simulates the same plans, so the model meets each measurement on the plan that made it.

use cmm_core::dtype::DType;
use cmm_core::plan::{BufId, BufferRole, Engine, Op, Plan, PlanBuilder, PlanError};

/// Round trips in [`round_trip_plan`] (each lane has 2 ops per round, under the CUDA
/// gate's limit of ops per stream).
pub const ROUNDS: usize = 100;

/// An input buffer of every device, filled alike on each.
fn input(b: &mut PlanBuilder, name: &str, tensor: u32, dtype: DType, rows: usize, cols: usize) -> BufId {
    let devices = b.devices();
    b.buffer(name, dtype, rows, cols, BufferRole::Input { tensor, global_cols: cols, origins: vec![(0, 0); devices] })
}

/// `devices` devices, each running one `m×n×k` f16 GEMM on a compute lane (with `gemm`);
/// with `copy`, device 0 also copies an f32 `m×n` block (one ring step's partial sum) to
/// device 1 on a comm lane.
pub fn gemms_plan(devices: usize, shape: (usize, usize, usize), gemm: bool, copy: bool) -> Result<Plan, PlanError> {
    let name = format!("calibration: {devices} devices, gemm {gemm}, copy {copy}");
    local_plan(name, devices, shape, gemm.then_some(None), copy)
}

/// `devices` devices, each running one `m×n×k` f16 GEMM as a persistent kernel (a fused
/// GEMM of one block and no waits: the kernel and grid of the fused plans' GEMMs); with
/// `copy`, device 0 also copies the f32 `m×n` block of [`gemms_plan`] to device 1 on a
/// comm lane. It measures what a copy keeps of its rate while persistent kernels hold the
/// SMs, which the fused plans' copies meet and the cuBLAS pair does not show.
pub fn persistent_plan(devices: usize, shape: (usize, usize, usize), copy: bool) -> Result<Plan, PlanError> {
    let name = format!("calibration: {devices} persistent GEMMs, copy {copy}");
    local_plan(name, devices, shape, Some(Some(0)), copy)
}

/// Every device's local GEMM where `gemm` is given (its `fused` id: `None`, a GEMM of its
/// own), and device 0's copy of an f32 `m×n` block to device 1 with `copy`.
fn local_plan(
    name: String,
    devices: usize,
    (m, n, k): (usize, usize, usize),
    gemm: Option<Option<u32>>,
    copy: bool,
) -> Result<Plan, PlanError> {
    let mut b = PlanBuilder::new(name, devices);
    let a = input(&mut b, "A", 0, DType::F16, m, k);
    let w = input(&mut b, "B", 1, DType::F16, k, n);
    let x = input(&mut b, "X", 2, DType::F32, m, n);
    let c = b.buffer("C", DType::F16, m, n, BufferRole::Output);
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
    if copy {
        let (src, dst) = (b.whole(x), b.whole(y));
        b.push(0, comm, Op::Copy { src, dst_device: 1, dst, engine: Engine::CopyEngine });
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
