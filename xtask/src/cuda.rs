//! CUDA tasks: `cargo xtask cuda-check` (compile every kernel without a GPU), the
//! conformance stamp that gates benchmarks, and `cargo xtask bench --backend cuda`.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use cmm_conformance::golden::fnv1a64;
use cmm_conformance::Summary;
use cmm_core::{build_plan, Algorithm, DType, Family, OpKind, Problem};
use cmm_cuda::kernels::{compile, nvrtc_available, parse_ptxas_verbose, DEFAULT_ARCH, KERNEL_FILES};
use cmm_cuda::{CudaBackend, CudaRunOptions, GemmEngine};

/// `cargo xtask cuda-check`: NVRTC to PTX, then `ptxas -v` for `arch`, per kernel file.
pub fn cuda_check(arch: &str) -> Result<()> {
    if !nvrtc_available() {
        bail!(
            "libnvrtc cannot be loaded. Install it without a GPU with \
             `python3 -m pip install --target ~/.cache/cmm/cuda nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88` \
             and export LD_LIBRARY_PATH=~/.cache/cmm/cuda/nvidia/cu13/lib PATH=~/.cache/cmm/cuda/nvidia/cu13/bin:$PATH \
             (what .ci/run does)"
        );
    }
    let ptxas = std::env::var_os("CMM_PTXAS").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("ptxas"));
    let out_dir = crate::workspace_root().join("target").join("cuda-check");
    fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    println!(
        "{:<12} {:<20} {:>9} {:>11} {:>12} {:>11}",
        "file", "kernel", "registers", "smem bytes", "spill stores", "spill loads"
    );
    for kernel in KERNEL_FILES {
        let ptx = compile(&kernel, arch).with_context(|| format!("NVRTC on {}", kernel.name))?;
        let ptx_path = out_dir.join(format!("{}.ptx", kernel.name));
        fs::write(&ptx_path, ptx).with_context(|| format!("writing {}", ptx_path.display()))?;
        let output = Command::new(&ptxas)
            .arg(format!("-arch={arch}"))
            .arg("-v")
            .arg(&ptx_path)
            .arg("-o")
            .arg(out_dir.join(format!("{}.cubin", kernel.name)))
            .output()
            .with_context(|| format!("running {} (set CMM_PTXAS or put ptxas on PATH)", ptxas.display()))?;
        let log = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            bail!("ptxas failed on {} for {arch}:\n{log}", kernel.name);
        }
        let usage = parse_ptxas_verbose(&log);
        for entry in kernel.entry_points {
            let u = usage
                .iter()
                .find(|u| u.function == *entry)
                .with_context(|| format!("ptxas reported nothing for {entry} in {}", kernel.name))?;
            println!(
                "{:<12} {:<20} {:>9} {:>11} {:>12} {:>11}",
                kernel.name, u.function, u.registers, u.shared_bytes, u.spill_stores, u.spill_loads
            );
        }
    }
    println!("every kernel compiled for {arch} (PTX and cubins in {})", out_dir.display());
    Ok(())
}

/// The default architecture of `cuda-check`.
pub const CHECK_ARCH: &str = DEFAULT_ARCH;

/// Where stamps live: one file per (GPU, xtask binary).
fn stamp_path(backend: &CudaBackend) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the running binary")?;
    let bytes = fs::read(&exe).with_context(|| format!("reading {}", exe.display()))?;
    let gpu = backend.identity()?;
    Ok(crate::workspace_root().join("target").join("cuda-stamps").join(format!(
        "{:016x}-{:016x}.txt",
        fnv1a64(gpu.as_bytes()),
        fnv1a64(&bytes)
    )))
}

/// After `conformance --backend cuda`: records the (op, algorithm) pairs whose every
/// selected case passed on this GPU with this binary.
pub fn write_stamp(backend: &CudaBackend, summary: &Summary) -> Result<()> {
    let mut passed = BTreeSet::new();
    let mut failed = BTreeSet::new();
    for (case, ok) in &summary.outcomes {
        let key = format!("{} {}", case.op_name(), case.algorithm);
        if *ok {
            passed.insert(key);
        } else {
            failed.insert(key);
        }
    }
    let lines: Vec<String> = passed.difference(&failed).cloned().collect();
    let path = stamp_path(backend)?;
    fs::create_dir_all(path.parent().unwrap_or(Path::new("."))).context("creating the stamp directory")?;
    fs::write(&path, lines.join("\n") + "\n").with_context(|| format!("writing {}", path.display()))?;
    println!("stamp: {} op/algorithm pair(s) passed on {} -> {}", lines.len(), backend.identity()?, path.display());
    Ok(())
}

fn stamped(backend: &CudaBackend) -> Result<BTreeSet<String>> {
    let path = stamp_path(backend)?;
    let text = fs::read_to_string(&path).with_context(|| {
        format!(
            "no conformance stamp for this GPU and binary ({}): run `cargo xtask conformance --backend cuda` first",
            path.display()
        )
    })?;
    Ok(text.lines().map(str::to_string).collect())
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Median GPU time in µs of `reps` runs of `plan`, each with fresh inputs (new seed).
fn time_plan(backend: &CudaBackend, plan: &cmm_core::Plan, options: &CudaRunOptions, reps: usize) -> Result<f64> {
    backend.run(plan, 1, Family::Realistic, options).with_context(|| format!("warm-up of {}", plan.name))?;
    let mut times = Vec::new();
    for rep in 0..reps {
        let out = backend
            .run(plan, 1000 + rep as u32, Family::Realistic, options)
            .with_context(|| format!("running {}", plan.name))?;
        times.push(out.gpu_time.as_secs_f64() * 1e6);
    }
    Ok(median(times))
}

/// `cargo xtask bench --backend cuda`: the seed-000 shape (f16, per-shard M=1024,
/// K=N=4096) at D = 2, 4, 8 virtual devices, overlapped plans beside the baseline and
/// D × the cuBLAS local GEMM, refusing any op/algorithm without a conformance stamp.
pub fn bench(reps: usize) -> Result<()> {
    let backend = CudaBackend::new(1).context("cannot start the CUDA backend")?;
    println!("gpu: {}", backend.summary());
    let stamp = stamped(&backend)?;
    let options =
        CudaRunOptions { gemm: GemmEngine::Cublas, wait_timeout: Duration::from_secs(30), ..Default::default() };
    // Peak: one 8192³ f16 GEMM through cuBLAS.
    let peak_problem = Problem::new(OpKind::AgGemm, 1, 8192, 8192, 8192, DType::F16, DType::F16)?;
    let peak_plan = build_plan(&peak_problem, Algorithm::Baseline)?;
    let peak_us = time_plan(&backend, &peak_plan, &options, reps)?;
    let peak_tflops = peak_problem.flops() / peak_us / 1e6;
    let local_problem = Problem::new(OpKind::AgGemm, 1, 1024, 4096, 4096, DType::F16, DType::F16)?;
    let local_us = time_plan(&backend, &build_plan(&local_problem, Algorithm::Baseline)?, &options, reps)?;
    println!("cuBLAS peak 8192³ f16: {peak_tflops:.0} TFLOP/s; local GEMM 1024x4096x4096: {local_us:.1} µs");
    println!(
        "{:<8} {:>2} {:<14} {:>10} {:>12} {:>12} {:>9} {:>8} {:>9}",
        "op", "D", "algorithm", "time µs", "baseline µs", "D×local µs", "speedup", "TFLOP/s", "TC util"
    );
    let mut rows = Vec::new();
    for op in [OpKind::AgGemm, OpKind::GemmRs] {
        for d in [2usize, 4, 8] {
            // Per device: A shard 1024×4096 and a 4096×4096 B (ag_gemm); gemm_rs with
            // the same per-device GEMM, M = D·1024 rows reduced over a K split in D.
            let problem = match op {
                OpKind::AgGemm => Problem::new(op, d, d * 1024, d * 4096, 4096, DType::F16, DType::F16)?,
                _ => Problem::new(op, d, d * 1024, 4096, d * 4096, DType::F16, DType::F16)?,
            };
            let baseline_key = format!("{op} baseline");
            if !stamp.contains(&baseline_key) {
                bail!("`{baseline_key}` has not passed conformance on this GPU with this binary; refusing to time it");
            }
            let baseline_us = time_plan(&backend, &build_plan(&problem, Algorithm::Baseline)?, &options, reps)?;
            for algorithm in [Algorithm::Ring, Algorithm::RingBidir] {
                let key = format!("{op} {}", algorithm.name());
                if !stamp.contains(&key) {
                    println!("{op:<8} {d:>2} {:<14} refused: no conformance stamp for `{key}`", algorithm.to_string());
                    continue;
                }
                let us = time_plan(&backend, &build_plan(&problem, algorithm)?, &options, reps)?;
                let tflops = problem.flops() / us / 1e6;
                println!(
                    "{:<8} {:>2} {:<14} {:>10.1} {:>12.1} {:>12.1} {:>8.2}x {:>8.0} {:>8.0}%",
                    op.name(),
                    d,
                    algorithm.to_string(),
                    us,
                    baseline_us,
                    d as f64 * local_us,
                    baseline_us / us,
                    tflops,
                    100.0 * tflops / peak_tflops
                );
                rows.push(format!(
                    "{{\"op\":\"{op}\",\"devices\":{d},\"algorithm\":\"{algorithm}\",\"time_us\":{us:.3},\"baseline_us\":{baseline_us:.3},\"d_times_local_us\":{:.3},\"tflops\":{tflops:.2},\"tc_util\":{:.4}}}",
                    d as f64 * local_us,
                    tflops / peak_tflops
                ));
            }
        }
    }
    let dir = crate::workspace_root().join("bench").join("results");
    fs::create_dir_all(&dir).context("creating bench/results")?;
    let path = dir.join(format!("cuda-{:016x}.json", fnv1a64(backend.identity()?.as_bytes())));
    let json = format!(
        "{{\"gpu\":\"{}\",\"peak_tflops\":{peak_tflops:.2},\"local_gemm_us\":{local_us:.3},\"reps\":{reps},\"rows\":[{}]}}\n",
        backend.summary(),
        rows.join(",")
    );
    fs::write(&path, json).with_context(|| format!("writing {}", path.display()))?;
    println!("saved {}", path.display());
    Ok(())
}
