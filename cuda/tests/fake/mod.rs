//! Shared by the fake-driver tests (`fake_driver.rs`, `fake_driver_hang.rs`,
//! `given_buffers.rs`, `ranks.rs`).
#![allow(dead_code)] // each test binary that includes this module uses a part of it

use cmm_core::attention::build_attention_plan;
use cmm_core::moe::build_moe_plan;
use cmm_core::plan::Plan;
use cmm_core::{
    build_plan, Algorithm, AttentionAlgorithm, AttentionProblem, DType, Layout, MoeOp, MoeProblem, OpKind, Problem,
    Routing,
};
use cmm_cuda::{fake, nvrtc_available, CudaBackend, CudaError, CudaRunOutput};

/// The backend on the fake driver's first `gpus` GPUs (it has two), or `None` after
/// saying why (no NVRTC here).
pub fn backend_on(gpus: usize) -> Option<CudaBackend> {
    fake::install().unwrap_or_else(|e| panic!("{e}"));
    nvrtc_or_skip().then(|| CudaBackend::new(gpus).unwrap_or_else(|e| panic!("{e}")))
}

/// Whether NVRTC is here; if not, says that the test skips (a failure with
/// `CMM_REQUIRE_NVRTC`, as CI sets it).
pub fn nvrtc_or_skip() -> bool {
    if nvrtc_available() {
        return true;
    }
    let required = std::env::var_os("CMM_REQUIRE_NVRTC").is_some();
    assert!(!required, "CMM_REQUIRE_NVRTC is set but libnvrtc cannot be loaded");
    eprintln!("SKIPPED (needs libnvrtc; see `cargo xtask cuda-check`): the backend compiles its kernels with it");
    false
}

/// Two-device plans of every family whose ops cross devices differently: AG+GEMM (ring,
/// fused), GEMM+RS (ring_push's GEMMs on a peer's c, ring_accumulate), AG+MoE (routing
/// tables) and ring attention.
pub fn family_plans() -> Vec<Plan> {
    let mut plans = Vec::new();
    for (op, algorithm) in [
        (OpKind::AgGemm, Algorithm::Ring),
        (OpKind::AgGemm, Algorithm::Fused { chunks: 2 }),
        (OpKind::GemmRs, Algorithm::RingPush),
        (OpKind::GemmRs, Algorithm::RingAccumulate { chunks: 2 }),
    ] {
        let p = Problem::new(op, 2, 64, 48, 32, DType::Bf16, DType::F32).unwrap();
        plans.push(build_plan(&p, algorithm).unwrap());
    }
    let moe = MoeProblem::new(MoeOp::AgMoe, 2, 16, 8, 12, 4, 2, Routing::Skewed, DType::F16, DType::F32).unwrap();
    plans.push(build_moe_plan(&moe, Algorithm::Ring).unwrap());
    let attention = AttentionProblem::new(2, 32, 2, 1, 16, true, Layout::Balanced, None, DType::F16).unwrap();
    plans.push(build_attention_plan(&attention, AttentionAlgorithm::Ring).unwrap());
    // Uneven shards: 63 rows on 2 devices (32 and 31), chunks that do not divide them.
    for (op, algorithm) in
        [(OpKind::AgGemm, Algorithm::Fused { chunks: 2 }), (OpKind::GemmRs, Algorithm::RingAccumulate { chunks: 3 })]
    {
        let p = Problem::new(op, 2, 63, 48, 32, DType::Bf16, DType::F32).unwrap();
        plans.push(build_plan(&p, algorithm).unwrap());
    }
    plans
}

/// The index of the AG+MoE plan in [`family_plans`].
pub const MOE_PLAN: usize = 4;

/// A run's outcome in one line (a successful run's buffers would flood the message).
pub fn outcome(result: &Result<CudaRunOutput, CudaError>) -> String {
    match result {
        Ok(out) => format!("a finished run ({:?} of GPU time)", out.gpu_time),
        Err(e) => e.to_string(),
    }
}
