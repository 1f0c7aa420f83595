//! Entry points without a GPU return typed errors (never a panic); with a GPU (these
//! tests skip without one, or fail with `CMM_REQUIRE_GPU=1`) and on the host twin (the
//! same kernels on the CPU, always): the CUDA generator matches the Rust one bit for
//! bit, every GEMM engine and both sync modes match the CPU twin, a run past its time
//! limit is aborted and drained and leaves the backend usable, both tensor-core tile
//! paths are right; on a GPU, the GEMM timer reports which engine it timed, and signals,
//! waits and SM copies launch at the greatest priority.

use cmm_core::generator::{element_bits, Family};
use cmm_core::plan::{BufferRole, PlanBuilder};
use cmm_core::{build_plan, Algorithm, DType, OpKind, Problem};
use std::time::Duration;

use cmm_cuda::{
    gpu_or_skip as backend, probe, CudaBackend, CudaError, CudaExecutor, CudaRunOptions, GemmEngine, GemmSpec,
    HopperVariant, HostTwin, ReadBack, SyncMode,
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
    engines_match_the_cpu_twin(&b, b.has_cublas(), b.can_gate() && CudaRunOptions::default().gate);
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
            // cmm's own kernels: the tile kernels, or the Hopper engine where it applies.
            let own = out.gemms.tile + out.gemms.hopper;
            match engine {
                GemmEngine::TileKernel => assert_eq!((own, out.gemms.cublas), (gemms, 0)),
                _ if has_cublas => assert_eq!((own, out.gemms.cublas), (0, gemms)),
                _ => assert_eq!((own, out.gemms.cublas), (gemms, 0)),
            }
            assert_eq!(out.gated, gated, "a small plan runs behind the gate on a GPU");
        }
    }
}

#[test]
fn both_tensor_core_tile_paths_match_the_cpu_twin() {
    let Some(b) = backend() else { return };
    tile_paths_match_the_cpu_twin(&b);
}

#[test]
fn host_both_tensor_core_tile_paths_match_the_cpu_twin() {
    tile_paths_match_the_cpu_twin(&host());
}

/// One GEMM C (+)= op(A)·op(B) on the tile kernels, 64×64 and 128×128, for shapes that take the pipelined
/// tile (untransposed, 16-byte aligned, K a multiple of 8; edges in M, N and K, one K
/// step or many, accumulation, N not a multiple of 8 in a wider B) and shapes that must
/// fall back to the staged one (A's or B's base 8 bytes off alignment, a transposed
/// operand, A's or B's row stride not a multiple of 8, K not a multiple of 8 with NaN
/// poison beside A's last column).
fn tile_paths_match_the_cpu_twin(b: &impl CudaExecutor) {
    struct Case {
        m: usize,
        n: usize,
        k: usize,
        /// Columns of A's buffer before the window A reads (4 halves: 8 bytes off).
        a_col0: usize,
        /// Columns of A's buffer after the window, on top of those that round its row
        /// stride up to a multiple of 8.
        a_pad: usize,
        /// B is a window of `n` of this many columns (its row stride), from column `b_col0`.
        b_cols: usize,
        b_col0: usize,
        /// A is copied first into the left of a scratch buffer whose other columns hold
        /// the poison (NaN), as a plan's received shards may.
        a_scratch: bool,
        trans_b: bool,
        accumulate: bool,
    }
    let case = |m, n, k| Case {
        m,
        n,
        k,
        a_col0: 0,
        a_pad: 0,
        b_cols: n,
        b_col0: 0,
        a_scratch: false,
        trans_b: false,
        accumulate: false,
    };
    let cases = [
        case(64, 64, 32),
        case(72, 136, 104),
        case(5, 8, 8),
        case(130, 24, 200),
        case(200, 264, 48),
        Case { accumulate: true, ..case(72, 136, 104) },
        Case { a_col0: 4, ..case(72, 136, 104) },
        Case { a_pad: 4, ..case(72, 136, 104) },
        Case { b_cols: 144, b_col0: 4, ..case(72, 136, 104) },
        Case { trans_b: true, ..case(72, 136, 104) },
        case(72, 60, 104),
        Case { b_cols: 64, ..case(72, 60, 104) },
        Case { a_scratch: true, ..case(72, 136, 100) },
    ];
    for c in cases {
        for (input, output) in [(DType::F16, DType::F16), (DType::Bf16, DType::F32)] {
            let output = if c.accumulate { DType::F32 } else { output };
            let mut p = PlanBuilder::new(
                format!(
                    "gemm {}x{}x{} {input}->{output} a_col0={} a_pad={} b_cols={} b_col0={} a_scratch={} trans_b={} \
                     accumulate={}",
                    c.m, c.n, c.k, c.a_col0, c.a_pad, c.b_cols, c.b_col0, c.a_scratch, c.trans_b, c.accumulate
                ),
                1,
            );
            // A row stride that is a multiple of 8, so only the window's base is off.
            let a_cols = (c.a_col0 + c.k).next_multiple_of(8) + c.a_pad;
            let x = if c.a_scratch {
                p.buffer("A", input, c.m, a_cols, BufferRole::Scratch)
            } else {
                p.buffer("A", input, c.m, a_cols, BufferRole::whole_tensor(0, a_cols))
            };
            let a_in = c.a_scratch.then(|| p.buffer("A_in", input, c.m, c.k, BufferRole::whole_tensor(0, c.k)));
            let (br, bc) = if c.trans_b { (c.n, c.k) } else { (c.k, c.b_cols) };
            let y = p.buffer("B", input, br, bc, BufferRole::whole_tensor(1, bc));
            let role = if c.accumulate {
                BufferRole::Accumulator { tensor: 2, global_cols: c.n, origins: vec![(0, 0)] }
            } else {
                BufferRole::Output
            };
            let z = p.buffer("C", output, c.m, c.n, role);
            let lane = p.lane("main");
            let (a, cc) = (p.window(x, 0, c.a_col0, c.m, c.k), p.whole(z));
            let bb = if c.trans_b { p.whole(y) } else { p.window(y, 0, c.b_col0, c.k, c.n) };
            if let Some(a_in) = a_in {
                let src = p.whole(a_in);
                p.push(
                    0,
                    lane,
                    cmm_core::Op::Copy { src, dst_device: 0, dst: a, engine: cmm_core::plan::Engine::CopyEngine },
                );
            }
            let op = cmm_core::Op::Gemm {
                a,
                b: bb,
                c: cc,
                trans_a: false,
                trans_b: c.trans_b,
                accumulate: c.accumulate,
                fused: None,
                c_device: None,
            };
            p.push(0, lane, op);
            let plan = p.finish().unwrap();
            let twin = cmm_core::cpu::run(&plan, 3, Family::Exact).unwrap();
            // The Hopper engine where the GPU runs it: bit for bit where TMA's rules hold
            // (16-byte aligned A and B, row strides multiples of 8 halves), a typed refusal
            // where they do not.
            if b.has_hopper_engine() {
                let b_stride = if c.trans_b { c.k } else { c.b_cols };
                let eligible = c.a_col0 % 8 == 0 && c.b_col0 % 8 == 0 && a_cols % 8 == 0 && b_stride % 8 == 0;
                let hopper = CudaRunOptions { gemm: GemmEngine::Hopper, ..Default::default() };
                match b.run(&plan, 3, Family::Exact, &hopper) {
                    Ok(out) if eligible => {
                        assert_eq!(out.buffers[0][z.0], twin[0][z.0], "{} on the Hopper engine", plan.name);
                        assert_eq!(out.gemms.hopper, 1, "{}", plan.name);
                    }
                    Err(CudaError::Unsupported { what, .. }) if !eligible => {
                        assert!(what.contains("Hopper engine"), "{}: {what}", plan.name)
                    }
                    other => panic!("{}: eligible {eligible}, got {other:?}", plan.name),
                }
            }
            // The tile kernels themselves (the Hopper engine would take what it can).
            let options = CudaRunOptions { gemm: GemmEngine::TileKernel, hopper: false, ..Default::default() };
            let out = b.run(&plan, 3, Family::Exact, &options).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
            assert_eq!(out.buffers[0][z.0], twin[0][z.0], "{}", plan.name);
            assert_eq!(out.gemms.tile, 1, "{}", plan.name);
            // The 128×128 tiles: pipelined on the same shapes, straight from global
            // memory on the others.
            let wide = CudaRunOptions { wide_tiles: true, ..options };
            let out = b.run(&plan, 3, Family::Exact, &wide).unwrap_or_else(|e| panic!("{} wide: {e}", plan.name));
            assert_eq!(out.buffers[0][z.0], twin[0][z.0], "{} on 128×128 tiles", plan.name);
            // Timing alone (the bench): nothing comes back.
            let timing = CudaRunOptions { read_back: ReadBack::Nothing, ..options };
            let out = b.run(&plan, 4, Family::Exact, &timing).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
            assert!(out.buffers.is_empty() && out.gemms.tile == 1, "{}", plan.name);
            // The bench's spot check: the results only, every other buffer empty.
            let results = CudaRunOptions { read_back: ReadBack::Results, ..options };
            let out = b.run(&plan, 3, Family::Exact, &results).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
            for (i, decl) in plan.buffers.iter().enumerate() {
                let want = if decl.role.is_result() { &twin[0][i][..] } else { &[][..] };
                assert_eq!(out.buffers[0][i], want, "{} {}", plan.name, decl.name);
            }
        }
    }
}

/// Runs `test` on the GPU where it has the Hopper engine (skipped without a GPU, as every
/// GPU test here).
fn on_a_hopper_gpu(test: impl FnOnce(&CudaBackend)) {
    if let Some(b) = backend().filter(CudaBackend::has_hopper_engine) {
        test(&b);
    }
}

#[test]
fn grouped_gemms_on_the_hopper_engine_match_the_cpu_twin() {
    on_a_hopper_gpu(grouped_gemms_on_the_hopper_engine);
}

#[test]
fn host_grouped_gemms_on_the_hopper_engine_match_the_cpu_twin() {
    grouped_gemms_on_the_hopper_engine(&host());
}

/// The MoE grouped GEMMs on the Hopper engine, on both tiles, bit for bit with the CPU
/// twin on the exact family: moe_rs's (a's rows are c's: TMA) with H = 320 columns (a
/// partial second column of wide tiles) and an expert's K = F/D = 72 rows (not a multiple
/// of the 64-row step: the 3D map's zero fill, not the next expert's rows), and ag_moe's
/// (rows gathered by token, the rows past the routed ones zeroed) with K = H = 72, 80 and
/// 456 (K steps past K: zero-filled chunks; 456 has more steps than the producer keeps
/// in flight, so stages are handed over inside its loop), its rows staged in order by
/// `cmm_gather_rows` and loaded by TMA (`staged-gather`; the engine's own way from 512
/// columns, which the last case, of 520, runs on the engine's and the ping-pong kernels),
/// or copied by the producer's cp.async with their proxy fence in the producer
/// (`in-kernel-gather`, the engine's way below 512) or in the consumers (`reader-fence`);
/// experts with no token (`Empty`), dropped
/// slots, chunks, uneven token splits. f32 inputs stay on the scalar kernel, and asking
/// for the engine on every GEMM then is a typed error naming why.
fn grouped_gemms_on_the_hopper_engine(b: &impl CudaExecutor) {
    use cmm_core::{moe::build_moe_plan, MoeOp, MoeProblem, Routing};
    let problems = [
        (MoeOp::MoeRs, 2, 64, 320, 144, Routing::Empty, Algorithm::Baseline, DType::Bf16, DType::F32),
        (MoeOp::MoeRs, 2, 50, 320, 144, Routing::Drop, Algorithm::RingChunked { chunks: 2 }, DType::F16, DType::F16),
        (MoeOp::MoeRs, 3, 70, 320, 216, Routing::Skewed, Algorithm::Ring, DType::Bf16, DType::Bf16),
        (MoeOp::AgMoe, 2, 64, 72, 320, Routing::Empty, Algorithm::Baseline, DType::Bf16, DType::F32),
        (MoeOp::AgMoe, 3, 70, 80, 96, Routing::Drop, Algorithm::RingChunked { chunks: 2 }, DType::F16, DType::F16),
        (MoeOp::AgMoe, 2, 50, 456, 272, Routing::Skewed, Algorithm::Ring, DType::Bf16, DType::Bf16),
        (MoeOp::AgMoe, 2, 40, 64, 1040, Routing::Drop, Algorithm::Ring, DType::F16, DType::F16),
    ];
    for (op, devices, tokens, hidden, ffn, routing, algorithm, input, output) in problems {
        let p = MoeProblem::new(op, devices, tokens, hidden, ffn, 6, 2, routing, input, output).unwrap();
        let plan = build_moe_plan(&p, algorithm).unwrap();
        let grouped = plan.ops().filter(|(_, op)| matches!(op, cmm_core::Op::GroupedGemm { .. })).count();
        let fences: &[HopperVariant] = match op {
            // From 512 columns the engine's own kernels stage the rows, the ping-pong ones
            // too (the sweep times both so).
            MoeOp::AgMoe if ffn / devices >= 512 => {
                &[HopperVariant::Engine, HopperVariant::PingPong, HopperVariant::InKernelGather]
            }
            MoeOp::AgMoe => &[HopperVariant::StagedGather, HopperVariant::InKernelGather, HopperVariant::ReaderFence],
            MoeOp::MoeRs => &[HopperVariant::Engine],
        };
        for &variant in fences {
            on_each_hopper_tile(b, &plan, variant, grouped);
        }
    }
    let f32s = MoeProblem::new(MoeOp::AgMoe, 2, 32, 64, 64, 4, 2, Routing::Uniform, DType::F32, DType::F32);
    let plan = build_moe_plan(&f32s.unwrap(), Algorithm::Ring).unwrap();
    let every = CudaRunOptions { gemm: GemmEngine::Hopper, ..Default::default() };
    match b.run(&plan, 3, Family::Exact, &every) {
        Err(CudaError::Unsupported { what, .. }) => assert!(what.contains("f16 or bf16"), "{what}"),
        other => panic!("{}: expected a refusal, got {:?}", plan.name, other.map(|o| o.gemms)),
    }
    let out = assert_matches_twin(b, &plan, &CudaRunOptions::default());
    assert_eq!(out.gemms.hopper, 0, "{}", plan.name);
}

#[test]
fn tma_stores_on_the_hopper_engine_match_the_cpu_twin() {
    on_a_hopper_gpu(tma_stores_on_the_hopper_engine);
}

#[test]
fn host_tma_stores_on_the_hopper_engine_match_the_cpu_twin() {
    tma_stores_on_the_hopper_engine(&host());
}

/// The engine's TMA-store kernels on both tiles, bit for bit with the CPU twin on the
/// exact family, where their tiles are whole (the corpus's are mostly partial and leave
/// from registers): ag_gemm's ring, plain GEMMs of 256 rows with 320 columns (a partial
/// column of tiles, clipped by TMA), bf16 and f32 C; the fused plans of ag_gemm and
/// gemm_rs (f32 partials), each block released once its stores have completed; moe_rs's and ag_moe's grouped GEMMs
/// with 256 rows per expert (whole tiles of each segment, f32 and bf16 rows, ag_moe's
/// gathered: copied in the kernel at 128 columns, staged first at 512).
fn tma_stores_on_the_hopper_engine(b: &impl CudaExecutor) {
    use cmm_core::{moe::build_moe_plan, MoeOp, MoeProblem, Routing};
    let mut plans = Vec::new();
    for output in [DType::Bf16, DType::F32] {
        let p = Problem::new(OpKind::AgGemm, 2, 512, 640, 128, DType::Bf16, output).unwrap();
        plans.push(build_plan(&p, Algorithm::Ring).unwrap());
    }
    // Fused runs, whose blocks are released only once their stores have completed.
    for op in [OpKind::AgGemm, OpKind::GemmRs] {
        let p = Problem::new(op, 2, 512, 640, 256, DType::Bf16, DType::F32).unwrap();
        plans.push(build_plan(&p, Algorithm::Fused { chunks: 1 }).unwrap());
    }
    // ag_moe's rows copied in the kernel (128 columns) and staged first (512).
    for (op, ffn, output) in
        [(MoeOp::MoeRs, 256, DType::F32), (MoeOp::AgMoe, 256, DType::Bf16), (MoeOp::AgMoe, 1024, DType::Bf16)]
    {
        let p = MoeProblem::new(op, 2, 512, 128, ffn, 2, 1, Routing::Uniform, DType::Bf16, output).unwrap();
        plans.push(build_moe_plan(&p, Algorithm::Baseline).unwrap());
    }
    for plan in &plans {
        // A fused run is one kernel, each other GEMM one.
        let alone = plan
            .ops()
            .filter(|(_, op)| matches!(op, cmm_core::Op::Gemm { fused: None, .. } | cmm_core::Op::GroupedGemm { .. }));
        let kernels = alone.count() + plan.fused_runs().unwrap().len();
        on_each_hopper_tile(b, plan, HopperVariant::TmaStore, kernels);
    }
}

/// Runs `plan` with every GEMM on the Hopper engine's `variant` of each tile, bit for bit
/// with the CPU twin, and checks that `gemms` GEMMs ran on the engine, every gathered grouped
/// GEMM with its rows staged first where the variant stages them.
fn on_each_hopper_tile(b: &impl CudaExecutor, plan: &cmm_core::Plan, variant: HopperVariant, gemms: usize) {
    // ag_moe's grouped GEMMs, whose rows are gathered: staged first where the variant
    // (or for the engine, the GEMM's columns) says so.
    let staged = plan
        .ops()
        .filter(|(_, op)| match op {
            cmm_core::Op::GroupedGemm { c, gather: Some(_), .. } => variant.stages_gathered_rows(c.cols),
            _ => false,
        })
        .count();
    for tile in cmm_core::engines::HopperTile::ALL {
        let options = CudaRunOptions {
            gemm: GemmEngine::Hopper,
            hopper_tile: Some(tile),
            hopper_variant: variant,
            ..Default::default()
        };
        let out = assert_matches_twin(b, plan, &options);
        assert_eq!(out.gemms.hopper, gemms, "{} on {tile:?} tiles, {variant:?}", plan.name);
        assert_eq!(out.gemms.staged, staged, "{} on {tile:?} tiles, {variant:?}: rows staged", plan.name);
    }
}

#[test]
fn fused_gemms_on_the_hopper_engine_count_their_ctas_and_waits() {
    on_a_hopper_gpu(fused_waits_counted);
}

#[test]
fn host_fused_gemms_on_the_hopper_engine_count_their_ctas_and_waits() {
    fused_waits_counted(&host());
}

/// A fused plan's persistent kernels on the Hopper engine count their CTAs and the time
/// their producers spent in the blocks' waits (`CudaRunOutput::fused_waits`, one entry per
/// device's fused GEMM): every CTA once, and no CTA waiting longer than the run; the tile
/// kernels count nothing.
fn fused_waits_counted(b: &impl CudaExecutor) {
    let p = Problem::new(OpKind::AgGemm, 2, 256, 256, 128, DType::F16, DType::F16).unwrap();
    let plan = build_plan(&p, Algorithm::Fused { chunks: 1 }).unwrap();
    let out = assert_matches_twin(b, &plan, &CudaRunOptions::default());
    assert!(out.gemms.hopper > 0, "{}", out.gemms.describe());
    assert_eq!(out.fused_waits.len(), plan.devices, "{:?}", out.fused_waits);
    for waits in &out.fused_waits {
        // At most one CTA per tile: a device's C is at most 256×256, four 128×128 tiles.
        assert!((1..=4).contains(&waits.ctas), "{waits:?}");
        let share = waits.share_of(out.gpu_time.as_secs_f64()).unwrap();
        assert!((0.0..=1.0).contains(&share), "{waits:?} over {:?}", out.gpu_time);
    }
    let tiles = assert_matches_twin(b, &plan, &CudaRunOptions { hopper: false, ..Default::default() });
    assert_eq!(tiles.gemms.hopper, 0);
    assert!(tiles.fused_waits.iter().all(|w| w.ctas == 0 && w.wait_ns == 0), "{:?}", tiles.fused_waits);
}

/// Every GPU cmm targets has stream priorities, so the backend's probe of a prioritised
/// launch must succeed, and runs must report the priority they used (else the bench's
/// `no prio` column compares a setting with itself).
#[test]
fn communication_launches_at_the_greatest_priority() {
    let Some(b) = backend() else { return };
    let priority = b.comm_priority().unwrap_or_else(|why| panic!("no prioritised launches on this GPU: {why}"));
    assert!(priority < 0, "the greatest priority is numerically below the default 0, got {priority}");
    let p = Problem::new(OpKind::AgGemm, 4, 64, 48, 32, DType::F16, DType::F32).unwrap();
    let plan = build_plan(&p, Algorithm::Ring).unwrap();
    let out = assert_matches_twin(&b, &plan, &CudaRunOptions::default());
    assert_eq!(out.comm_priority, Some(priority));
    let off = assert_matches_twin(&b, &plan, &CudaRunOptions { comm_priority: false, ..Default::default() });
    assert_eq!(off.comm_priority, None);
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

/// On the caller's buffers (`run_given`), the generated run's results bit for bit, the
/// caller's inputs untouched (the fake driver's `given_buffers.rs` covers more plans and
/// every binding mistake).
#[test]
fn a_run_on_given_buffers_matches_the_generated_run() {
    let Some(b) = backend() else { return };
    for (op, algorithm) in [(OpKind::AgGemm, Algorithm::Ring), (OpKind::GemmRs, Algorithm::RingPush)] {
        let p = Problem::new(op, 4, 256, 128, 192, DType::Bf16, DType::F32).unwrap();
        let plan = build_plan(&p, algorithm).unwrap();
        let options = CudaRunOptions::default();
        let generated = b.run(&plan, 9, Family::Exact, &options).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
        let buffers = b.generated_buffers(&plan, 9, Family::Exact, options.placement).unwrap();
        let given: Vec<_> = buffers.iter().map(|(g, _)| g.clone()).collect();
        b.run_given(&plan, &given, &CudaRunOptions { read_back: ReadBack::Nothing, ..options })
            .unwrap_or_else(|e| panic!("{}: {e}", plan.name));
        for (g, buffer) in &buffers {
            let i = plan.buffers.iter().position(|decl| decl.name == g.name).unwrap();
            let bytes = buffer.download().unwrap();
            let words = g.dtype.words_from_le(&bytes, g.rows * g.cols);
            assert_eq!(words, generated.buffers[g.device][i], "{}: `{}` of device {}", plan.name, g.name, g.device);
        }
    }
}

/// `on_gpu` on a GPU; `on_cpu` on the fake driver, whose kernels run on the CPU (the
/// host twin's size), so that sizes meant to keep a GPU busy do not take the CI minutes.
fn sized(on_gpu: usize, on_cpu: usize) -> usize {
    if cmm_cuda::fake::requested() {
        on_cpu
    } else {
        on_gpu
    }
}

#[test]
fn a_run_past_its_limit_is_aborted_drained_and_the_backend_stays_usable() {
    if let Some(b) = backend() {
        aborted_and_usable(&b, sized(8 * 256, 8 * 32));
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
    let size = sized(512, 128);
    let spec = GemmSpec {
        m: size,
        n: size,
        k: size,
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

/// The host twin runs a persistent kernel's blocks on threads: a count of CTAs per SM is
/// refused, never passed as if it had been checked.
#[test]
fn host_twin_refuses_ctas_per_sm() {
    let p = cmm_core::Problem::new(cmm_core::OpKind::AgGemm, 2, 32, 32, 32, DType::F16, DType::F32).unwrap();
    let plan = cmm_core::build_plan(&p, cmm_core::Algorithm::Fused { chunks: 1 }).unwrap();
    let options = CudaRunOptions { fused_ctas_per_sm: 2, ..Default::default() };
    let e = host().run(&plan, 3, Family::Exact, &options).unwrap_err();
    assert!(matches!(e, CudaError::Unsupported { .. }) && e.to_string().contains("no SMs"), "{e}");
}
