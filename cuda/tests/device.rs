//! Entry points without a GPU return typed errors (never a panic); with a GPU, the CUDA
//! generator matches the Rust one bit for bit and a ring plan matches the oracle.

use cmm_core::generator::{element_bits, Family};
use cmm_core::plan::{BufferRole, PlanBuilder};
use cmm_core::{build_plan, Algorithm, DType, OpKind, Problem};
use cmm_cuda::{probe, CudaBackend, CudaError, CudaRunOptions, GemmEngine};

/// The backend, or `None` with the reason printed when this machine has no GPU.
fn backend() -> Option<CudaBackend> {
    match CudaBackend::new(1) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("SKIPPED (GPU test): {e}");
            None
        }
    }
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
    let Some(b) = backend() else { return };
    for dtype in DType::ALL {
        for family in [Family::Exact, Family::Realistic] {
            let (rows, cols, tensor, seed) = (37, 129, 5, 0xdead_beef);
            let mut p = PlanBuilder::new("generate", 1);
            p.buffer("X", dtype, rows, cols, BufferRole::Input { tensor, global_cols: cols, origins: vec![(0, 0)] });
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
    for engine in [GemmEngine::TileKernel, GemmEngine::Cublas] {
        for (input, output) in [(DType::F16, DType::F16), (DType::Bf16, DType::F32), (DType::F32, DType::F32)] {
            let p = Problem::new(OpKind::GemmRs, 4, 96, 40, 200, input, output).unwrap();
            let plan = build_plan(&p, Algorithm::Ring).unwrap();
            let out = b.run(&plan, 3, Family::Exact, &CudaRunOptions { gemm: engine, ..Default::default() }).unwrap();
            let twin = cmm_core::cpu::run(&plan, 3, Family::Exact).unwrap();
            let c = plan.output().unwrap().0;
            for (d, (got, want)) in out.buffers.iter().zip(&twin).enumerate() {
                assert_eq!(got[c], want[c], "{engine:?} {input}->{output} device {d}");
            }
        }
    }
}
