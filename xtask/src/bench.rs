//! `cargo xtask bench --backend reference` / `--backend cpu`: GFLOP/s of the reference's
//! GEMM shader, or of the CPU twin's GEMM op, beside native CPU sgemm (the
//! `matrixmultiply` crate, on every core like lavapipe) on the same shapes in the same run;
//! for the CPU, the f64 oracle beside native dgemm; and `cmm golden` end to end on one
//! kernel engineer's case on either backend.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use cmm_conformance::{run_corpus_to, Backend, CpuTwin, Options};
use cmm_core::{cpu, oracle, DType, Family, OpKind, Problem};
use cmm_reference::Reference;

use crate::timing::median;

/// Which executor to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchBackend {
    /// The wgpu reference.
    Reference,
    /// The CPU twin and the f64 oracle.
    Cpu,
    /// The CUDA backend (gated on a conformance stamp).
    Cuda,
}

/// Arguments of `cargo xtask bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The executor to measure.
    #[arg(long, value_enum, default_value = "reference")]
    pub backend: BenchBackend,
    /// Timed repetitions per measurement (the median is reported; at least 20 on CUDA).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub reps: u32,
    /// CUDA only: how signals and waits are issued (the plans must have passed
    /// conformance in the same mode).
    #[arg(long, value_enum, default_value = "kernels")]
    pub sync: crate::stamps::Sync,
    /// CUDA only: the stamp directory [default: $CMM_STAMP_DIR, else target/cuda-stamps].
    #[arg(long, value_name = "DIR")]
    pub stamps: Option<std::path::PathBuf>,
    /// CUDA only: where to save the JSON report [default: bench/results/cuda-<gpu>-<sync>.json].
    #[arg(long, value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
    /// CUDA only: divide every dimension by this power of two (up to 64), and let `--reps`
    /// go below 20: a rehearsal of the bench's whole path on a small machine (the fake
    /// CUDA driver); its figures are not the seed-000 shape's and say so.
    #[arg(long, default_value_t = 1, value_parser = parse_shrink)]
    pub shrink: usize,
    /// CUDA only: after the table, write a timeline of one run (every op's start and
    /// end, from events on its stream) of gemm_rs `ring_accumulate`, `ring_push` and
    /// the direct baseline at D = 4 and 8, plain, staggered and with offset starts,
    /// into DIR (`<plan>.svg`, and `<plan>.json` for Perfetto).
    #[arg(long, value_name = "DIR")]
    pub timelines: Option<std::path::PathBuf>,
    /// CUDA only: time only the plans of these algorithms (names, as `fused,ring`; every
    /// one of a name, whatever its chunks); the direct baseline, every row's reference, is
    /// timed regardless. The targets then judge only the plans timed.
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    pub algorithms: Vec<String>,
    /// CUDA only: the Hopper engine's tile for the fused plans and their twins (default:
    /// its rule's choice).
    #[arg(long, value_enum, value_name = "TILE")]
    pub hopper_tile: Option<crate::conformance::HopperTileArg>,
    /// CUDA only: which of the Hopper engine's kernels the fused plans and their twins
    /// take (default: the engine's own); `pingpong` with `--hopper-tile narrow` runs all
    /// of them on the ping-pong kernels. The plans must have passed conformance that way
    /// too (`conformance --hopper --hopper-tile narrow --hopper-variant pingpong`); each
    /// is spot-checked at the bench's shape before it is timed, as always.
    #[arg(long, value_name = "KERNELS", value_parser = cmm_cuda::HopperVariant::parse)]
    pub hopper_variant: Option<cmm_cuda::HopperVariant>,
}

fn parse_shrink(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n.is_power_of_two() && n <= 64 => Ok(n),
        _ => Err(format!("`{text}` is not a power of two from 1 to 64")),
    }
}

/// Shapes measured, as (M, N, K).
const SHAPES: [(usize, usize, usize); 3] = [(256, 256, 256), (512, 512, 512), (256, 1024, 512)];

/// Shapes the CPU twin is measured on, as (M, N, K): one device's GEMM of
/// [`GOLDEN_CASE`], and the whole case's global GEMM.
const CPU_SHAPES: [(usize, usize, usize); 2] = [(2048, 256, 2048), (2048, 2048, 2048)];

/// The case `cmm golden` is timed on: AG+GEMM at D = 8, M = N = K = 2048, bf16,
/// realistic (17.2 GFLOP of device GEMMs), the size a kernel engineer tests.
const GOLDEN_CASE: &str = r#"[[case]]
name = "bench_ag_gemm_d8_2048"
op = "ag_gemm"
devices = 8
algorithm = "ring"
m = 2048
n = 2048
k = 2048
input = "bf16"
output = "bf16"
family = "realistic"
seed = 7
"#;

/// GEMMs submitted back to back in one timed reference run.
const GEMMS_PER_RUN: usize = 4;

/// Input dtypes measured on the reference (the output is f32).
const DTYPES: [DType; 2] = [DType::F32, DType::Bf16];

/// Median GFLOP/s of `reps` `matrixmultiply::sgemm` calls (threaded over all cores).
fn native_sgemm_gflops(m: usize, n: usize, k: usize, reps: u32) -> f64 {
    let mut state = 0x2545_f491_u32;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        (state >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    };
    let a: Vec<f32> = (0..m * k).map(|_| next()).collect();
    let b: Vec<f32> = (0..k * n).map(|_| next()).collect();
    let mut c = vec![0.0f32; m * n];
    sgemm(m, n, k, &a, &b, &mut c); // warm-up
    let times = (0..reps)
        .map(|_| {
            let start = Instant::now();
            sgemm(m, n, k, &a, &b, &mut c);
            start.elapsed().as_secs_f64()
        })
        .collect();
    2.0 * (m * n * k) as f64 / median(times) / 1e9
}

/// `c = a · b` for row-major `a` (m×k), `b` (k×n), `c` (m×n).
#[allow(unsafe_code)]
fn sgemm(m: usize, n: usize, k: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    assert!(a.len() == m * k && b.len() == k * n && c.len() == m * n);
    // SAFETY: the slices have exactly the lengths the row-major strides below address
    // (checked above), and `c` is a unique borrow that aliases neither input.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            n as isize,
            1,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// Runs the benchmark and prints the table.
pub fn run(args: &Args) -> Result<()> {
    if args.backend == BenchBackend::Cuda {
        return crate::cuda::bench(&crate::cuda::BenchSettings {
            reps: if args.shrink == 1 { args.reps.max(20) } else { args.reps } as usize,
            shrink: args.shrink,
            sync: args.sync,
            stamps: args.stamps.clone(),
            json: args.json.clone(),
            timelines: args.timelines.clone(),
            algorithms: args.algorithms.clone(),
            hopper_tile: args.hopper_tile.map(|t| t.tile()),
            hopper_variant: args.hopper_variant.unwrap_or_default(),
        });
    }
    // The CUDA-only options would be ignored here: refuse them rather than let the table
    // pass for what they asked.
    let cuda_only = [
        (args.sync != crate::stamps::Sync::Kernels, "--sync memops"),
        (args.stamps.is_some(), "--stamps"),
        (args.json.is_some(), "--json"),
        (args.shrink != 1, "--shrink"),
        (args.timelines.is_some(), "--timelines"),
        (!args.algorithms.is_empty(), "--algorithms"),
        (args.hopper_tile.is_some(), "--hopper-tile"),
        (args.hopper_variant.is_some(), "--hopper-variant"),
    ];
    if let Some((_, flag)) = cuda_only.iter().find(|(given, _)| *given) {
        bail!("{flag} applies to `bench --backend cuda`, not to the reference's GEMM table");
    }
    if args.backend == BenchBackend::Cpu {
        return cpu_tables(args.reps);
    }
    let reference = Reference::new().context("cannot start the wgpu reference")?;
    println!("adapter: {}", reference.adapter_summary());
    println!(
        "reference: median of {} runs of the GEMM shader ({GEMMS_PER_RUN} back-to-back GEMMs per run), f32 output",
        args.reps
    );
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "native:    median of {} calls of matrixmultiply::sgemm (f32, {threads} threads) on the same shape",
        args.reps
    );
    println!();
    println!("{:>14}  {:<5}  {:>15}  {:>12}  {:>9}", "MxNxK", "input", "reference GF/s", "native GF/s", "ref/nat");
    for (m, n, k) in SHAPES {
        let native = native_sgemm_gflops(m, n, k, args.reps);
        for dtype in DTYPES {
            reference.gemm_gflops(m, n, k, dtype, 1).context("warm-up GEMM on the reference")?;
            let runs = (0..args.reps)
                .map(|_| reference.gemm_gflops(m, n, k, dtype, GEMMS_PER_RUN))
                .collect::<Result<Vec<f64>, _>>()
                .with_context(|| format!("GEMM {m}x{n}x{k} {dtype} on the reference"))?;
            let gpu = median(runs);
            println!(
                "{:>14}  {:<5}  {:>15.2}  {:>12.2}  {:>9.4}",
                format!("{m}x{n}x{k}"),
                dtype.name(),
                gpu,
                native,
                gpu / native
            );
        }
    }
    println!();
    golden_end_to_end(&reference)
}

/// The CPU twin's GEMM op beside native sgemm, the oracle beside native dgemm, and
/// `cmm golden --backend cpu` of [`GOLDEN_CASE`].
fn cpu_tables(reps: u32) -> Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("twin:   median of {reps} runs of the CPU twin's GEMM op (cmm_core::cpu::execute: decode, pack, blocked kernel, encode), f32 output");
    println!("native: median of {reps} calls of matrixmultiply::sgemm / dgemm ({threads} threads) on the same shape");
    println!();
    println!("{:>14}  {:<5}  {:>11}  {:>12}  {:>9}", "MxNxK", "input", "twin GF/s", "native GF/s", "twin/nat");
    for (m, n, k) in CPU_SHAPES {
        let native = native_sgemm_gflops(m, n, k, reps);
        for dtype in DTYPES {
            let plan = cmm_core::plan::gemm_benchmark(m, n, k, dtype, 1)?;
            let op = &plan.programs[0].lanes[0][0];
            let mut memory = cpu::initial_memory(&plan, 1, Family::Realistic);
            cpu::execute(&plan, &mut memory, 0, op); // warm-up
            let times = (0..reps)
                .map(|_| {
                    let start = Instant::now();
                    cpu::execute(&plan, &mut memory, 0, op);
                    start.elapsed().as_secs_f64()
                })
                .collect();
            let twin = 2.0 * (m * n * k) as f64 / median(times) / 1e9;
            println!(
                "{:>14}  {:<5}  {:>11.2}  {:>12.2}  {:>9.4}",
                format!("{m}x{n}x{k}"),
                dtype.name(),
                twin,
                native,
                twin / native
            );
        }
    }
    println!();
    // The oracle computes C and |A|·|B|, two global GEMMs, after generating the inputs.
    let (d, m, n, k) = (8, 2048, 2048, 2048);
    let problem = Problem::new(OpKind::AgGemm, d, m, n, k, DType::Bf16, DType::Bf16)?;
    let times = (0..reps)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(oracle::expected_outputs(&problem, 7, Family::Realistic));
            start.elapsed().as_secs_f64()
        })
        .collect();
    let oracle_rate = 2.0 * 2.0 * (m * n * k) as f64 / median(times) / 1e9;
    let native = native_dgemm_gflops(m, n, k, reps);
    println!("f64 oracle of ag_gemm D={d} {m}x{n}x{k} bf16 (inputs, C and |A|·|B|: two GEMMs counted)");
    println!("{:>14}  {:>11}  {:>12}  {:>9}", "MxNxK", "oracle GF/s", "dgemm GF/s", "orc/nat");
    println!("{:>14}  {:>11.2}  {:>12.2}  {:>9.4}", format!("{m}x{n}x{k}"), oracle_rate, native, oracle_rate / native);
    println!();
    golden_end_to_end(&CpuTwin)?;
    verify_a_million_ops()
}

/// `cmm verify --schedules 1` of a plan with over a million ops (ag_gemm ring_chunked,
/// D = 16, 1000 chunks: 1,184,016 ops), from its file's text to the last line.
fn verify_a_million_ops() -> Result<()> {
    let problem = Problem::new(OpKind::AgGemm, 16, 16_000, 16, 8, DType::F32, DType::F32)?;
    let text = cmm_core::build_plan(&problem, cmm_core::Algorithm::RingChunked { chunks: 1000 })?.to_file_json();
    let start = Instant::now();
    let plan = cmm_core::Plan::from_file_json(&text)?;
    let verification = cmm_cli::verify::verify_plan(&plan, 1)?;
    let seconds = start.elapsed().as_secs_f64();
    if verification.findings > 0 {
        bail!("the bench plan has findings: {}", verification.lines.join("; "));
    }
    println!(
        "cmm verify --schedules 1 of a {}-op plan (its JSON parsed, verified, queues checked): {seconds:.2} s",
        plan.op_count()
    );
    Ok(())
}

/// Median GFLOP/s of `reps` `matrixmultiply::dgemm` calls (threaded) through the oracle's
/// own entry point.
fn native_dgemm_gflops(m: usize, n: usize, k: usize, reps: u32) -> f64 {
    let a: Vec<f64> = (0..m * k).map(|x| (x % 7) as f64 - 3.0).collect();
    let b: Vec<f64> = (0..k * n).map(|x| (x % 5) as f64 - 2.0).collect();
    std::hint::black_box(oracle::dgemm(m, n, k, oracle::Strided::row_major(&a, k), oracle::Strided::row_major(&b, n))); // warm-up
    let times = (0..reps)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(oracle::dgemm(
                m,
                n,
                k,
                oracle::Strided::row_major(&a, k),
                oracle::Strided::row_major(&b, n),
            ));
            start.elapsed().as_secs_f64()
        })
        .collect();
    2.0 * (m * n * k) as f64 / median(times) / 1e9
}

/// `cmm golden` of [`GOLDEN_CASE`] on `backend`, end to end: plan, inputs, run, f64
/// oracle check, golden and `.npy` export, into a scratch directory.
fn golden_end_to_end(backend: &dyn Backend) -> Result<()> {
    let scratch = std::env::temp_dir().join(format!("cmm-bench-golden-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
    std::fs::write(scratch.join("case.toml"), GOLDEN_CASE).context("writing the bench case")?;
    let out = scratch.join("out");
    let options = Options {
        bless: true,
        export: Some(out.clone()),
        cases_dir: scratch.clone(),
        golden_dir: out.join("golden"),
        ..Options::default()
    };
    let start = Instant::now();
    let summary = run_corpus_to(backend, &options, &mut std::io::sink());
    let seconds = start.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&scratch).with_context(|| format!("removing {}", scratch.display()))?;
    let summary = summary.context("cmm golden of the bench case")?;
    if summary.failed > 0 {
        bail!("the bench case failed its oracle check on {}", backend.name());
    }
    println!(
        "cmm golden --backend {} of ag_gemm D=8 2048x2048x2048 bf16 realistic, end to end: {seconds:.2} s",
        backend.name()
    );
    Ok(())
}
