//! `cargo xtask ci`: every check CI runs, in order, stopping at the first failure:
//! fmt, clippy, tests, the CUDA compile check, the GPU bundle (built, and run here to
//! check its no-GPU exit, its stop on a binary that cannot start and, from a copy
//! elsewhere, its rehearsal on the fake driver or the host twin), the corpus under four
//! interleavings (with a JUnit report in `target/conformance-report.xml`), the corpus one
//! process per device on the fake CUDA driver in both sync modes, the parsers
//! fuzzed for a bounded time, the mutants on the CPU twin (not with `--quick`).

use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::conformance;

/// Seconds per fuzz target in a CI run (`--fuzz SECONDS` sets another): five targets
/// in under a minute.
const FUZZ_SECONDS: u64 = 10;

/// The cargo steps, before the conformance run.
const STEPS: [&[&str]; 3] = [
    &["fmt", "--all", "--", "--check"],
    &["clippy", "--workspace", "--all-targets", "--release", "--", "-D", "warnings"],
    &["test", "--workspace", "--release"],
];

/// Runs the steps, then the conformance corpus on the reference under four
/// interleavings, then (unless `quick`) the mutation kill rate on the CPU twin.
pub fn run(quick: bool, fuzz: Option<u64>) -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let root = crate::workspace_root();
    let mut clock = StepClock::new();
    let mut step = |shown: &str| clock.next(shown);
    for args in STEPS {
        let shown = format!("cargo {}", args.join(" "));
        step(&shown);
        // The tests see the user's environment, as `cargo test` run by hand does.
        let status = crate::with_user_environment(&mut Command::new(&cargo))
            .args(args)
            .current_dir(&root)
            .status()
            .with_context(|| format!("cannot start `{shown}`"))?;
        if !status.success() {
            bail!("ci step `{shown}` failed ({status}); fix it, then rerun `cargo xtask ci`");
        }
    }
    step("cargo xtask cuda-check");
    if cmm_cuda::nvrtc_available() || std::env::var_os("CMM_REQUIRE_NVRTC").is_some() {
        crate::cuda::cuda_check(crate::cuda::CHECK_ARCH).context("ci step `cargo xtask cuda-check` failed")?;
    } else {
        println!("skipped: libnvrtc is not installed here (.ci/run installs it; see `cargo xtask cuda-check`)");
    }
    step("cargo xtask gpu-bundle --no-vulkan --check");
    crate::bundle::run(&crate::bundle::Args { out: None, no_vulkan: true, no_python: false, check: true })
        .context("ci step `cargo xtask gpu-bundle --no-vulkan --check` failed")?;
    let report = root.join("target").join("conformance-report.xml");
    step(&format!("cargo xtask conformance --schedules 4 --report {}", report.display()));
    let args =
        conformance::Args { report: Some(report), ..conformance::Args::plain(conformance::BackendKind::Reference, 4) };
    conformance::run(&args).context("ci step `cargo xtask conformance --schedules 4` failed")?;
    // One process per device, on the fake CUDA driver (NVRTC compiles the kernels; the
    // host twin runs them): the whole corpus with stream memory ops. (With kernel waits
    // the bundle's rehearsal above ran it, from the bundle's own binaries.)
    // Then ag_moe's cases with their gathered rows staged in each process's own device
    // memory (`Memory::stage`), which the corpus's narrow GEMMs do not ask for by default.
    let fake_runs: [&[&str]; 2] = [
        &["--processes", "--sync", "memops"],
        &["--processes", "--hopper", "--hopper-variant", "staged-gather", "--filter", "moe_ag"],
    ];
    for extra in fake_runs {
        let shown = format!("CMM_FAKE_CUDA=1 cargo xtask conformance --backend cuda {}", extra.join(" "));
        step(&shown);
        if cmm_cuda::nvrtc_available() || std::env::var_os("CMM_REQUIRE_NVRTC").is_some() {
            let exe = std::env::current_exe().context("finding this program")?;
            let status = std::process::Command::new(exe)
                .args(["conformance", "--backend", "cuda"])
                .args(extra)
                .env(cmm_cuda::fake::FAKE_CUDA_VAR, "1")
                .current_dir(&root)
                .status()
                .with_context(|| format!("cannot start `{shown}`"))?;
            if !status.success() {
                bail!("ci step `{shown}` failed ({status})");
            }
        } else {
            println!("skipped: libnvrtc is not installed here (.ci/run installs it)");
        }
    }
    let fuzz_seconds = fuzz.unwrap_or(FUZZ_SECONDS);
    step(&format!("cargo xtask fuzz --seconds {fuzz_seconds}"));
    crate::fuzz::run(&crate::fuzz::Args { seconds: fuzz_seconds, target: None, seed: None })
        .with_context(|| format!("ci step `cargo xtask fuzz --seconds {fuzz_seconds}` failed"))?;
    if quick {
        step("");
        println!("ci: all quick steps passed (the mutants did not run: `cargo xtask ci` runs them)");
        return Ok(());
    }
    // The CPU twin gives the reference's bits on the whole corpus (the tests' `corpus_passes`
    // on it compares every golden), so it catches the same mutants, in less than half the
    // time of lavapipe.
    step("cargo xtask mutants --backend cpu");
    crate::mutants::run(&crate::mutants::Args {
        filter: None,
        backend: conformance::BackendKind::Cpu,
        verbose: false,
        every_device: false,
    })
    .context("ci step `cargo xtask mutants --backend cpu` failed")?;
    step("");
    println!("ci: all steps passed");
    Ok(())
}

/// Prints each step's heading and, before the next, how long the last one took, so that a
/// slow step shows in CI's log.
struct StepClock {
    started: Instant,
    current: Option<(String, Instant)>,
}

impl StepClock {
    fn new() -> StepClock {
        StepClock { started: Instant::now(), current: None }
    }

    /// Ends the current step and starts `shown` ("": none, the run is over).
    fn next(&mut self, shown: &str) {
        if let Some((last, began)) = self.current.take() {
            println!(
                "<== {last}: {:.0} s (ci so far: {:.0} s)",
                began.elapsed().as_secs_f64(),
                self.started.elapsed().as_secs_f64()
            );
        }
        if !shown.is_empty() {
            println!("==> {shown}");
            self.current = Some((shown.to_string(), Instant::now()));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::process::Command;

    /// Each package `cargo tree` lists, with its features: `serde v1.0.228` → `derive,std`.
    fn features(selection: &[&str], kinds: &str) -> BTreeMap<String, String> {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let output = Command::new(cargo)
            .current_dir(crate::workspace_root())
            .args(["tree", "--quiet", "--offline", "--prefix", "none", "--no-dedupe", "--format", "{p}|{f}", "-e"])
            .arg(kinds)
            .args(selection)
            .output()
            .expect("cargo tree runs");
        assert!(output.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| line.trim_end_matches(" (*)").split_once('|'))
            .map(|(package, features)| (package.to_string(), features.to_string()))
            .collect()
    }

    /// `cargo xtask` builds its dependencies with the features `cargo test --workspace`
    /// gives them, so CI's test build reuses what building xtask compiled (a fresh clone
    /// once compiled serde, naga, wgpu and cmm's crates twice). If this fails, give xtask's
    /// Cargo.toml the features the workspace adds (the package named here).
    #[test]
    fn xtask_builds_its_dependencies_as_the_workspace_tests_do() {
        let alone = features(&["--package", "xtask"], "normal,build");
        let workspace = features(&["--workspace"], "normal,build,dev");
        assert!(alone.len() > 50, "cargo tree listed only {} packages for xtask", alone.len());
        for (package, features) in &alone {
            let unified = workspace.get(package).unwrap_or_else(|| panic!("{package} is not in the workspace's tree"));
            assert_eq!(
                features, unified,
                "{package}: built for xtask with [{features}], for the tests with [{unified}]"
            );
        }
    }
}
