//! Entry points without a GPU return typed errors (never a panic); with a GPU (these
//! tests skip without one, or fail with `CMM_REQUIRE_GPU=1`) and on the host twin (the
//! same kernels on the CPU, always): the CUDA generator matches the Rust one bit for
//! bit, every GEMM engine and both sync modes match the CPU twin, a run past its time
//! limit is aborted and drained and leaves the backend usable; on a GPU, the GEMM timer
//! reports which engine it timed.

use cmm_core::generator::{element_bits, Family};
use cmm_core::plan::{BufferRole, PlanBuilder};
use cmm_core::{build_plan, Algorithm, DType, OpKind, Problem};
use std::time::Duration;

use cmm_cuda::{
    gpu_or_skip as backend, probe, CudaBackend, CudaError, CudaExecutor, CudaRunOptions, GemmEngine, GemmSpec,
    HostTwin, SyncMode,
};

fn host() -> HostTwin {
    HostTwin::new().unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `plan` on the exact family and compares every device's output with the twin.
fn assert_matches_twin(
    b: &impl CudaExecutor,
    plan: &cmm_core::Plan,
    options: &CudaRunOptions,
) -> cmm_cuda::CudaRunOutput {
    let out = b.run(plan, 3, Family::Exact, options).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
    let twin = cmm_core::cpu::run(plan, 3, Family::Exact).unwrap();
    let c = plan.output().unwrap().0;
    for (d, (got, want)) in out.buffers.iter().zip(&twin).enumerate() {
        assert_eq!(got[c], want[c], "{} {options:?} device {d}", plan.name);
    }
    out
}

#[test]
fn without_a_driver_every_entry_point_is_a_typed_error() {
    match probe() {
        Ok(found) => eprintln!("SKIPPED (no-GPU test): this machine has a CUDA driver ({found})"),
        Err(e) => {
            assert!(matches!(e, CudaError::NoCudaDriver | CudaError::NoCudaDevice { .. }), "{e:?}");
            let err = CudaBackend::new(1).unwrap_err();
            assert!(matches!(err, CudaError::NoCudaDriver | CudaError::NoCudaDevice { .. }), "{err:?}");
            assert!(err.to_string().contains("driver") || err.to_string().contains("device"), "{err}");
        }
    }
}

#[test]
fn cuda_generator_matches_rust_bit_for_bit() {
    if let Some(b) = backend() {
        generator_matches_rust(&b);
    }
}

#[test]
fn host_generator_matches_rust_bit_for_bit() {
    generator_matches_rust(&host());
}

fn generator_matches_rust(b: &impl CudaExecutor) {
    for dtype in DType::ALL {
        for family in [Family::Exact, Family::Realistic] {
            let (rows, cols, tensor, seed) = (37, 129, 5, 0xdead_beef);
            let mut p = PlanBuilder::new("generate", 1);
            p.buffer("X", dtype, rows, cols, BufferRole::whole_tensor(tensor, cols));
            let plan = p.finish().unwrap();
            let out = b.run(&plan, seed, family, &CudaRunOptions::default()).unwrap();
            let want: Vec<u32> =
                (0..rows * cols).map(|i| element_bits(seed, tensor, i as u32, family, dtype)).collect();
            assert_eq!(out.buffers[0][0], want, "{dtype} {family}");
        }
    }
}

#[test]
fn tile_kernels_and_cublas_match_the_cpu_twin_on_the_exact_family() {
    let Some(b) = backend() else { return };
    engines_match_the_cpu_twin(&b, b.has_cublas(), true);
}

#[test]
fn host_tile_kernels_match_the_cpu_twin_and_cublas_is_refused() {
    let b = host();
    engines_match_the_cpu_twin(&b, false, false);
    let p = Problem::new(OpKind::GemmRs, 4, 96, 40, 200, DType::F16, DType::F16).unwrap();
    let plan = build_plan(&p, Algorithm::Ring).unwrap();
    let cublas = CudaRunOptions { gemm: GemmEngine::Cublas, ..Default::default() };
    assert!(matches!(b.run(&plan, 3, Family::Exact, &cublas), Err(CudaError::NoCublas)));
}

/// Every engine the executor has matches the CPU twin and reports which ran; `gated`:
/// whether small plans run behind the gate (the GPU's, which the host twin has no need of).
fn engines_match_the_cpu_twin(b: &impl CudaExecutor, has_cublas: bool, gated: bool) {
    let engines: &[GemmEngine] = if has_cublas {
        &[GemmEngine::TileKernel, GemmEngine::Cublas, GemmEngine::Auto]
    } else {
        &[GemmEngine::TileKernel, GemmEngine::Auto]
    };
    for &engine in engines {
        for (input, output) in [(DType::F16, DType::F16), (DType::Bf16, DType::F32), (DType::F32, DType::F32)] {
            let p = Problem::new(OpKind::GemmRs, 4, 96, 40, 200, input, output).unwrap();
            let plan = build_plan(&p, Algorithm::Ring).unwrap();
            let out = assert_matches_twin(b, &plan, &CudaRunOptions { gemm: engine, ..Default::default() });
            let gemms = plan.ops().filter(|(_, op)| matches!(op, cmm_core::Op::Gemm { .. })).count();
            match engine {
                GemmEngine::TileKernel => assert_eq!((out.gemms.tile, out.gemms.cublas), (gemms, 0)),
                _ if has_cublas => assert_eq!((out.gemms.tile, out.gemms.cublas), (0, gemms)),
                _ => assert_eq!((out.gemms.tile, out.gemms.cublas), (gemms, 0)),
            }
            assert_eq!(out.gated, gated, "a small plan runs behind the gate on a GPU");
        }
    }
}

#[test]
fn stream_memory_ops_match_the_cpu_twin() {
    let Some(b) = backend() else { return };
    if let Err(why) = b.stream_memops() {
        panic!("stream memory operations are unavailable on this GPU: {why}");
    }
    memops_match_the_cpu_twin(&b);
}

#[test]
fn host_stream_memory_ops_match_the_cpu_twin() {
    memops_match_the_cpu_twin(&host());
}

fn memops_match_the_cpu_twin(b: &impl CudaExecutor) {
    let options = CudaRunOptions { sync: SyncMode::StreamMemOps, ..Default::default() };
    for (op, algorithm) in [(OpKind::AgGemm, Algorithm::Ring), (OpKind::GemmAr, Algorithm::RingBidir)] {
        let p = Problem::new(op, 4, 64, 64, 64, DType::Bf16, DType::F32).unwrap();
        assert_matches_twin(b, &build_plan(&p, algorithm).unwrap(), &options);
    }
}

#[test]
fn a_run_past_its_limit_is_aborted_drained_and_the_backend_stays_usable() {
    if let Some(b) = backend() {
        aborted_and_usable(&b, 8 * 256);
    }
}

#[test]
fn host_a_run_past_its_limit_is_aborted_drained_and_the_twin_stays_usable() {
    aborted_and_usable(&host(), 8 * 32);
}

/// A run with a zero time limit is aborted (or finished before the first look), and the
/// next run is right; `rows` sizes the ring's shards.
fn aborted_and_usable(b: &impl CudaExecutor, rows: usize) {
    let p = Problem::new(OpKind::AgGemm, 8, rows, rows, 1024, DType::F32, DType::F32).unwrap();
    let plan = build_plan(&p, Algorithm::Ring).unwrap();
    // A zero limit expires at the first look, while the ring is still waiting.
    let hurried = CudaRunOptions { run_timeout: Duration::ZERO, ..Default::default() };
    let start = std::time::Instant::now();
    match b.run(&plan, 3, Family::Exact, &hurried) {
        Err(CudaError::RunTimeout { pending, .. }) => eprintln!("aborted as expected: {pending}"),
        Ok(_) => eprintln!("note: the plan finished before the first look; nothing to abort"),
        Err(e) => panic!("{e}"),
    }
    assert!(start.elapsed() < Duration::from_secs(20), "the abort drained the streams quickly");
    assert_matches_twin(b, &plan, &CudaRunOptions::default());
}

#[test]
fn the_gemm_timer_runs_each_engine() {
    let Some(b) = backend() else { return };
    let spec = GemmSpec {
        m: 512,
        n: 512,
        k: 512,
        input: DType::F16,
        output: DType::F32,
        trans_a: false,
        trans_b: false,
        accumulate: false,
    };
    let tile = b.time_gemm(&spec, GemmEngine::TileKernel, 5).unwrap();
    assert!(tile > 0.0);
    if b.has_cublas() {
        assert!(b.time_gemm(&spec, GemmEngine::Cublas, 5).unwrap() > 0.0);
    } else {
        assert!(matches!(b.time_gemm(&spec, GemmEngine::Cublas, 5), Err(CudaError::NoCublas)));
    }
}
