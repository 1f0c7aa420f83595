//! `cargo xtask gpu-bundle`: everything a GPU machine without a Rust toolchain needs to
//! run every GPU check in one command — the xtask binary, the CUDA test binaries, the
//! kernels' cubins, the corpus, the goldens, the Vulkan loader for the reference, and
//! `run.sh` — in one folder small enough to carry. `--check` then checks the script here:
//! it must parse, fail cleanly for want of a GPU, walk its GPU path dry (each step's program
//! present, each of its scripts parsing), and pass its rehearsal (the GPU steps on the fake
//! CUDA driver, or without NVRTC the kernels on the host twin) from a copy elsewhere.
//! `gpu-bundle-summary` (called by the script) turns the step table and logs into
//! `summary.md` and `summary.json`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use cmm_cli::bench_file::{PlanFigures, PlanTimes};
use cmm_cuda::{image_file_name, KernelFile, KERNEL_FILES};
use serde::{Deserialize, Serialize};

/// The script the bundle runs.
const RUN_SH: &str = include_str!("gpu-bundle/run.sh");

/// The most a device call may carry: the working tree (tracked files and the untracked ones
/// git does not ignore) and the carried bundle together.
const CARRY_LIMIT_BYTES: u64 = 64 << 20;

/// Arguments of `cargo xtask gpu-bundle`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The folder to (re)create [default: target/gpu-bundle].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Do not fetch the Vulkan loader and GL dispatch libraries with `apt-get download`.
    #[arg(long)]
    pub no_vulkan: bool,
    /// Do not build the Python package's wheel (with maturin: `$CMM_MATURIN`, else
    /// `maturin` on the PATH) for the step that runs torch's tensors through it.
    #[arg(long)]
    pub no_python: bool,
    /// After building, check the script here: it parses (`bash -n`), exits 3 for want of a
    /// GPU, walks its GPU path dry (`CMM_BUNDLE_DRY_RUN=1`), and its rehearsal passes from
    /// a copy elsewhere.
    #[arg(long)]
    pub check: bool,
}

/// Arguments of `cargo xtask gpu-bundle-summary`.
#[derive(Debug, clap::Args)]
pub struct SummaryArgs {
    /// The folder with `steps.tsv` and one `<step>.log` per step.
    #[arg(long, value_name = "DIR")]
    pub logs: PathBuf,
    /// Where `summary.md` and `summary.json` go.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

fn copy_dir(from: &Path, to: &Path) -> Result<u64> {
    fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    let mut bytes = 0;
    for entry in fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let path = entry?.path();
        if path.is_file() {
            bytes += fs::copy(&path, to.join(path.file_name().expect("a file has a name")))
                .with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(bytes)
}

/// Copies a folder with everything below it (file modes kept).
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    copy_dir(from, to)?;
    for entry in fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            copy_tree(&path, &to.join(path.file_name().expect("a folder has a name")))?;
        }
    }
    Ok(())
}

/// The release test binaries `(package, test target)`, built if needed, by path. They
/// are built as `cargo test --workspace --release` builds them: selecting packages would
/// resolve the dependencies' features anew and build wgpu and naga a second time.
fn test_binaries(targets: &[(&str, &str)]) -> Result<Vec<PathBuf>> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command.current_dir(crate::workspace_root()).args([
        "test",
        "--workspace",
        "--release",
        "--no-run",
        "--message-format=json",
    ]);
    let output = command.output().context("running cargo test --no-run")?;
    if !output.status.success() {
        bail!("building the test binaries failed:\n{}", String::from_utf8_lossy(&output.stderr));
    }
    let mut found = vec![None; targets.len()];
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(name), Some(exe)) = (message["target"]["name"].as_str(), message["executable"].as_str()) else {
            continue;
        };
        let is_test = message["target"]["kind"].as_array().is_some_and(|k| k.iter().any(|v| v == "test"));
        // Two packages may name a test target alike (`reference`): the package id says
        // whose it is (`path+file:///…/cuda#cmm-cuda@0.1.0`).
        let package = message["package_id"].as_str().unwrap_or_default();
        let of = |p: &str| package.contains(&format!("#{p}@"));
        if let Some(i) = targets.iter().position(|(p, t)| *t == name && of(p)).filter(|_| is_test) {
            found[i] = Some(PathBuf::from(exe));
        }
    }
    targets
        .iter()
        .zip(found)
        .map(|((p, t), f)| f.with_context(|| format!("cargo did not report the test binary {p}/{t}")))
        .collect()
}

/// The newest glibc symbol version an ELF binary needs (`GLIBC_2.35` → `(2, 35)`): the
/// oldest glibc it starts on. Read from its version-needs table (`.gnu.version_r`), not
/// from the bytes at large, where any string that looks like a version (an error message,
/// a test's stand-in) would count.
fn glibc_needed(elf: &[u8]) -> Result<(u32, u32)> {
    use object::read::elf::{FileHeader, SectionTable};
    let header = object::elf::FileHeader64::<object::Endianness>::parse(elf).context("not a 64-bit ELF file")?;
    let endian = header.endian().context("reading the ELF header")?;
    let sections: SectionTable<_, _> = header.sections(endian, elf).context("reading the ELF sections")?;
    let mut newest = (2, 0);
    let Some((mut needs, link)) = sections.gnu_verneed(endian, elf).context("reading .gnu.version_r")? else {
        return Ok(newest);
    };
    let strings = sections.strings(endian, elf, link).context("reading the version names")?;
    while let Some((_, mut versions)) = needs.next().context("reading .gnu.version_r")? {
        while let Some(version) = versions.next().context("reading .gnu.version_r")? {
            let name = version.name(endian, strings).context("reading a version name")?;
            let Some(number) = name.strip_prefix(b"GLIBC_") else { continue };
            let mut parts = std::str::from_utf8(number).unwrap_or("").split('.').map(str::parse::<u32>);
            if let (Some(Ok(major)), Some(Ok(minor))) = (parts.next(), parts.next()) {
                newest = newest.max((major, minor));
            }
        }
    }
    Ok(newest)
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).current_dir(crate::workspace_root()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The bytes of the working tree a device call sends beside what it carries: the files git
/// tracks and the untracked ones it does not ignore, as they are on disk.
fn tree_bytes(root: &Path) -> Result<u64> {
    let out = Command::new("git")
        .args(["ls-files", "-z", "--cached", "--others", "--exclude-standard"])
        .current_dir(root)
        .output()
        .context("listing the working tree (git ls-files)")?;
    if !out.status.success() {
        bail!("git ls-files failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    // A tracked file deleted in the working tree does not travel.
    Ok(out
        .stdout
        .split(|&b| b == 0)
        .filter(|p| !p.is_empty())
        .filter_map(|p| fs::metadata(root.join(String::from_utf8_lossy(p).as_ref())).ok())
        .map(|m| m.len())
        .sum())
}

fn strip(path: &Path) {
    // Best effort: symbols only make the bundle larger.
    let _ = Command::new("strip").arg(path).status();
}

/// Builds the bundle (and with `--check` runs it here).
pub fn run(args: &Args) -> Result<()> {
    let root = crate::workspace_root();
    let dir = args.out.clone().unwrap_or_else(|| root.join("target").join("gpu-bundle"));
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    let bin = dir.join("bin");
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    let xtask = std::env::current_exe().context("locating the xtask binary")?;
    let tests = test_binaries(&[("cmm-cuda", "device"), ("cmm-conformance", "cuda")])?;
    let mut glibc = (2, 0);
    for (from, name) in [(&xtask, "xtask"), (&tests[0], "cuda-device-tests"), (&tests[1], "conformance-cuda-tests")] {
        let to = bin.join(name);
        fs::copy(from, &to).with_context(|| format!("copying {}", from.display()))?;
        strip(&to);
        let bytes = fs::read(&to).with_context(|| format!("reading {}", to.display()))?;
        glibc = glibc.max(glibc_needed(&bytes).with_context(|| format!("reading {}", to.display()))?);
    }
    // The binaries are built against this machine's glibc; run.sh checks that they start.
    fs::write(dir.join("GLIBC"), format!("{}.{}\n", glibc.0, glibc.1)).context("writing GLIBC")?;
    copy_dir(&cmm_conformance::cases_dir(), &dir.join("cases"))?;
    copy_dir(&cmm_conformance::Goldens::default_dir(), &dir.join("golden"))?;
    let script = dir.join("run.sh");
    fs::write(&script, RUN_SH).context("writing run.sh")?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).context("making run.sh executable")?;
    }
    let commit = match (git(&["rev-parse", "HEAD"]), git(&["status", "--porcelain"])) {
        (Some(head), Some(status)) if !status.is_empty() => format!("{head}-dirty"),
        (Some(head), _) => head,
        _ => "unknown".into(),
    };
    fs::write(dir.join("COMMIT"), format!("{commit}\n")).context("writing COMMIT")?;
    let vulkan =
        if args.no_vulkan { "not bundled (--no-vulkan)".to_string() } else { fetch_vulkan(&dir.join("vulkan")) };
    let python =
        if args.no_python { "not bundled (--no-python)".to_string() } else { build_python(&root, &dir.join("python")) };
    let images = bundle_images(&dir.join("kernels"));
    let bytes = dir_bytes(&dir)?;
    let tree = tree_bytes(&root)?;
    println!(
        "bundle: {} ({:.1} MiB; {:.1} MiB of working tree travel with it), commit {commit}; needs glibc >= {}.{}; kernels: {images}; Vulkan loader: {vulkan}; Python: {python}",
        dir.display(),
        bytes as f64 / 1048576.0,
        tree as f64 / 1048576.0,
        glibc.0,
        glibc.1
    );
    if bytes + tree > CARRY_LIMIT_BYTES {
        bail!(
            "the bundle ({bytes} bytes) and the working tree that travels with it ({tree} bytes) are more than the {CARRY_LIMIT_BYTES} a device call carries"
        );
    }
    let shown = dir.strip_prefix(&root).unwrap_or(&dir).display().to_string();
    println!("run it on a GPU machine: `bash {shown}/run.sh` (carry `{shown}`; results under $OUT)");
    if args.check {
        check(&dir)?;
    }
    Ok(())
}

/// Every kernel file's cubin for the GPUs the bundle is for (sm_90a: H100, H200), as
/// `cargo xtask cuda-check` checked them (run here first if one is missing), into `dir`;
/// returns what happened, in words. The GPU then compiles nothing: NVRTC and the driver's
/// compile of hopper.cu's PTX took most of a minute of a device call's ten. Without NVRTC
/// or ptxas here, nothing is bundled and the GPU compiles the kernels.
fn bundle_images(dir: &Path) -> String {
    let arch = crate::cuda::CHECK_ARCH;
    let checked = |k: &KernelFile| crate::cuda::images_dir().join(image_file_name(k, arch));
    if KERNEL_FILES.iter().any(|k| !checked(k).is_file()) {
        if !cmm_cuda::nvrtc_available() {
            return "not bundled (no libnvrtc here: the GPU compiles them)".into();
        }
        if let Err(e) = crate::cuda::cuda_check(arch) {
            return format!("not bundled (cargo xtask cuda-check: {e:#}; the GPU compiles them)");
        }
    }
    let copied = fs::create_dir_all(dir).map_err(anyhow::Error::from).and_then(|()| {
        KERNEL_FILES.iter().try_for_each(|k| {
            fs::copy(checked(k), dir.join(image_file_name(k, arch))).map(|_| ()).map_err(anyhow::Error::from)
        })
    });
    match copied {
        Ok(()) => format!("{} cubins for {arch}, as cargo xtask cuda-check checked them", KERNEL_FILES.len()),
        Err(e) => {
            let _ = fs::remove_dir_all(dir);
            format!("not bundled ({e}; the GPU compiles them)")
        }
    }
}

/// The Vulkan loader and the GL vendor-neutral dispatch libraries that NVIDIA's
/// Vulkan driver (`libGLX_nvidia.so.0`) links against; a GPU machine may have none of
/// them (on an H100 the loader alone found no adapter).
const VULKAN_PACKAGES: [&str; 7] =
    ["libvulkan1", "libglvnd0", "libglx0", "libegl1", "libgl1", "libopengl0", "libgles2"];

/// `apt-get download` of [`VULKAN_PACKAGES`] into `dir`; returns what happened, in words.
fn fetch_vulkan(dir: &Path) -> String {
    if let Err(e) = fs::create_dir_all(dir) {
        return format!("not bundled ({e})");
    }
    match Command::new("apt-get").arg("download").args(VULKAN_PACKAGES).current_dir(dir).output() {
        Ok(out) if out.status.success() => format!("{} .debs bundled", VULKAN_PACKAGES.join(", ")),
        Ok(out) => format!("not bundled (apt-get download: {})", String::from_utf8_lossy(&out.stderr).trim()),
        Err(e) => format!("not bundled (apt-get: {e})"),
    }
}

/// The Python package's wheel (the extension in release, stripped) and the test that runs
/// torch's own CUDA tensors through it (`python/tests/test_torch_gpu.py`) into `dir`;
/// returns what happened, in words. maturin is `$CMM_MATURIN`, else `maturin` on the PATH.
fn build_python(root: &Path, dir: &Path) -> String {
    let maturin = std::env::var_os("CMM_MATURIN").unwrap_or_else(|| "maturin".into());
    if let Err(e) = fs::create_dir_all(dir) {
        return format!("not bundled ({e})");
    }
    let built = Command::new(&maturin)
        .args(["build", "--release", "--strip", "--manifest-path"])
        .arg(root.join("python").join("Cargo.toml"))
        .arg("--out")
        .arg(dir)
        .env("CARGO_TARGET_DIR", root.join("target"))
        .output();
    let test = root.join("python").join("tests").join("test_torch_gpu.py");
    match built {
        Ok(out) if out.status.success() => match fs::copy(&test, dir.join("test_torch_gpu.py")) {
            Ok(_) => "the cmm wheel and test_torch_gpu.py bundled".into(),
            Err(e) => format!("not bundled (copying {}: {e})", test.display()),
        },
        Ok(out) => {
            let _ = fs::remove_dir_all(dir);
            let log = String::from_utf8_lossy(&out.stderr);
            format!("not bundled (maturin build: {})", log.lines().last().unwrap_or("failed"))
        }
        Err(e) => {
            let _ = fs::remove_dir_all(dir);
            format!("not bundled ({}: {e})", maturin.to_string_lossy())
        }
    }
}

fn dir_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() { dir_bytes(&entry.path())? } else { meta.len() };
    }
    Ok(total)
}

/// Runs a bundle's `run.sh` with `out` as its output folder, `how` adding its environment;
/// returns its exit code and its stdout and stderr together.
fn run_script(bundle: &Path, out: &Path, how: impl FnOnce(&mut Command)) -> Result<(Option<i32>, String)> {
    let mut command = Command::new("bash");
    command.arg(bundle.join("run.sh")).arg(out);
    how(&mut command);
    let output = command.output().with_context(|| format!("running {}", bundle.join("run.sh").display()))?;
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    Ok((output.status.code(), text))
}

/// Runs the bundle here, where there is no GPU: the whole script must parse, it must exit 3
/// and say so, stop at a binary that cannot start, walk its GPU path dry, and pass its
/// rehearsal.
fn check(dir: &Path) -> Result<()> {
    check_parses(dir)?;
    let out = std::env::temp_dir().join(format!("cmm-gpu-bundle-check-{}", std::process::id()));
    let _ = fs::remove_dir_all(&out);
    let (code, text) = run_script(dir, &out, |_| ())?;
    if crate_has_gpu() {
        println!("check: this machine has a GPU; the no-GPU exit cannot be checked here");
        return Ok(());
    }
    if code != Some(3) || !text.contains("no GPU") {
        bail!("run.sh without a GPU should exit 3 saying `no GPU`; it exited {code:?}:\n{text}");
    }
    for file in ["summary.md", "summary.json", "logs.tar.gz"] {
        if !out.join(file).is_file() {
            bail!("run.sh without a GPU wrote no {file} under {}", out.display());
        }
    }
    let summary = fs::read_to_string(out.join("summary.md"))?;
    if !summary.contains("no GPU") {
        bail!("summary.md does not say why nothing ran:\n{summary}");
    }
    let _ = fs::remove_dir_all(&out);
    println!("check: without a GPU the bundle exits 3 with `no GPU` and still writes its summary");
    check_unstartable(dir)?;
    check_dry_run(dir)?;
    rehearse(dir)
}

/// `bash -n`: the whole script parses. Bash reads a script as it runs it, so a syntax error
/// in the GPU path would otherwise show only on a GPU machine, and end the run there with
/// no summary.
fn check_parses(dir: &Path) -> Result<()> {
    let output = Command::new("bash").arg("-n").arg(dir.join("run.sh")).output().context("running bash -n")?;
    if !output.status.success() {
        bail!("run.sh does not parse (bash -n):\n{}", String::from_utf8_lossy(&output.stderr));
    }
    println!("check: run.sh parses (bash -n)");
    Ok(())
}

/// The GPU steps of the script, in its order: the `step NAME …` lines at the start of a line
/// (the rehearsal's are indented inside its branch).
fn gpu_steps(script: &str) -> Vec<&str> {
    script.lines().filter_map(|l| l.strip_prefix("step ")).filter_map(|rest| rest.split_whitespace().next()).collect()
}

/// The rehearsal's steps in the script's order, on the fake driver and on the host twin:
/// the `step` lines of the two branches of its `CMM_BUNDLE_REHEARSAL` block.
fn rehearsal_steps(script: &str) -> (Vec<&str>, Vec<&str>) {
    let (mut fake, mut host, mut on_host) = (Vec::new(), Vec::new(), false);
    for line in script.lines().skip_while(|l| !l.starts_with("if [ \"${CMM_BUNDLE_REHEARSAL")) {
        match line {
            "    else" => on_host = true,
            "    fi" => break,
            _ => {
                let name = line.trim_start().strip_prefix("step ").and_then(|rest| rest.split_whitespace().next());
                if let Some(name) = name {
                    if on_host {
                        host.push(name)
                    } else {
                        fake.push(name)
                    }
                }
            }
        }
    }
    (fake, host)
}

/// The GPU path walked dry (`CMM_BUNDLE_DRY_RUN=1`): past the GPU check, every top-level
/// command of the path run, and each step's program found and its `bash -c` script parsed
/// rather than run. It must exit 0 with every GPU step of the script listed, in order, as
/// not executed, and the summary written.
fn check_dry_run(dir: &Path) -> Result<()> {
    let out = std::env::temp_dir().join(format!("cmm-gpu-bundle-dry-{}", std::process::id()));
    let _ = fs::remove_dir_all(&out);
    let (code, text) = run_script(dir, &out, |c| {
        c.env("CMM_BUNDLE_DRY_RUN", "1").env_remove("CMM_BUNDLE_STEPS");
    })?;
    let written = fs::read_to_string(out.join("summary.json")).ok();
    let Some(summary) = written.and_then(|t| serde_json::from_str::<Summary>(&t).ok()) else {
        bail!("run.sh's dry run wrote no summary.json (exit {code:?}):\n{text}");
    };
    // Each step's note (a dry run's verdict) is the first of its details.
    let rows: Vec<(String, String)> =
        summary.steps.into_iter().map(|s| (s.name, s.details.into_iter().next().unwrap_or_default())).collect();
    let expected = gpu_steps(RUN_SH);
    let walked: Vec<&str> = rows.iter().map(|(name, _)| name.as_str()).collect();
    let findings: Vec<String> = rows
        .iter()
        .filter(|(_, note)| note != "dry run: not executed")
        .map(|(name, note)| format!("{name}: {note}"))
        .collect();
    if code != Some(0) || walked != expected || !findings.is_empty() {
        bail!(
            "run.sh's GPU path, walked dry, should reach each of its {} steps and run none (exit {code:?}); it reached {walked:?}\n{}\n{text}",
            expected.len(),
            findings.join("\n")
        );
    }
    let _ = fs::remove_dir_all(&out);
    println!(
        "check: the GPU path, walked dry, reaches its {} steps, each program there and each script parsing",
        walked.len()
    );
    Ok(())
}

/// A copy of the bundle whose test binary cannot start (as one built against a newer glibc
/// than the machine's) stops before any step, exits 1, and says which binary and why.
fn check_unstartable(dir: &Path) -> Result<()> {
    let scratch = std::env::temp_dir().join(format!("cmm-gpu-bundle-unstartable-{}", std::process::id()));
    let _ = fs::remove_dir_all(&scratch);
    let (moved, out) = (scratch.join("bundle"), scratch.join("out"));
    copy_tree(dir, &moved).context("copying the bundle")?;
    let loader = "libc.so.6: version GLIBC_9.99 not found (required by conformance-cuda-tests)";
    fs::write(moved.join("bin").join("conformance-cuda-tests"), format!("#!/bin/sh\necho \"{loader}\" >&2\nexit 1\n"))
        .context("writing a binary that cannot start")?;
    let (code, text) = run_script(&moved, &out, |_| ())?;
    let steps = fs::read_to_string(out.join("steps.tsv")).unwrap_or_default();
    if code != Some(1)
        || !text.contains("bin/conformance-cuda-tests does not start")
        || !text.contains(loader)
        || !steps.contains("start-conformance-cuda-tests\t1")
    {
        bail!("a bundle whose binary cannot start should stop at once, exit 1 and say why; it exited {code:?}:\n{text}\n{steps}");
    }
    let _ = fs::remove_dir_all(&scratch);
    println!("check: a bundle whose binary cannot start stops before any step and says why");
    Ok(())
}

/// Copies the bundle elsewhere and runs its rehearsal there (`CMM_BUNDLE_REHEARSAL=1`:
/// its own binaries, corpus and goldens; the GPU steps on the fake CUDA driver when NVRTC
/// is here, else the kernels on the host twin): every step must pass, so the folder is
/// known to be self-contained, and its GPU steps to run, before a device call carries it.
fn rehearse(dir: &Path) -> Result<()> {
    let scratch = std::env::temp_dir().join(format!("cmm-gpu-bundle-rehearsal-{}", std::process::id()));
    let _ = fs::remove_dir_all(&scratch);
    let (moved, out) = (scratch.join("elsewhere"), scratch.join("out"));
    copy_tree(dir, &moved).context("copying the bundle for its rehearsal")?;
    let (code, text) = run_script(&moved, &out, |c| {
        // The copy must not lean on this tree's corpus.
        c.env("CMM_BUNDLE_REHEARSAL", "1")
            .env_remove("CMM_CASES_DIR")
            .env_remove("CMM_GOLDEN_DIR")
            .current_dir(&scratch);
    })?;
    let summary = fs::read_to_string(out.join("summary.md")).unwrap_or_default();
    let rows = summary.lines().filter(|l| l.starts_with("| rehearsal-")).collect::<Vec<_>>();
    // With NVRTC, the GPU steps on the fake driver; without, the host twin's.
    let fake = cmm_cuda::nvrtc_available();
    // The fake driver loads the bundled cubins as a GPU would (it reads their entries).
    if fake && moved.join("kernels").is_dir() && !summary.contains("kernels from prebuilt sm_90a images") {
        bail!("the bundle carries cubins, but the rehearsal's backend did not load them:\n{summary}");
    }
    let (on_fake, on_host) = rehearsal_steps(RUN_SH);
    let expected = if fake { on_fake } else { on_host };
    let ran: Vec<&str> = rows.iter().filter_map(|r| r.split('|').nth(1)).map(str::trim).collect();
    if code != Some(0) || ran != expected || !rows.iter().all(|r| r.contains("| passed |")) {
        bail!("the bundle's rehearsal failed (exit {code:?}):\n{text}\n{summary}");
    }
    let _ = fs::remove_dir_all(&scratch);
    let on = if fake { "the fake CUDA driver" } else { "the host twin (no libnvrtc here)" };
    println!("check: a copy of the bundle elsewhere passes its rehearsal on {on} ({} steps)", rows.len());
    Ok(())
}

fn crate_has_gpu() -> bool {
    cmm_cuda::probe().is_ok()
}

/// One step of a bundle run, as summarised.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct StepSummary {
    /// Step name.
    pub name: String,
    /// Exit status (`None`: skipped).
    pub rc: Option<i32>,
    /// Seconds it took.
    pub seconds: u64,
    /// "passed", "FAILED", "skipped" or "no GPU".
    pub result: String,
    /// The lines that matter from its log.
    pub details: Vec<String>,
}

/// The whole summary.
#[derive(Debug, Serialize, Deserialize)]
struct Summary {
    commit: Option<String>,
    environment: Vec<String>,
    steps: Vec<StepSummary>,
}

/// The lines of a step's log worth showing: counts, failures, sanitizer totals, tables.
pub fn key_lines(step: &str, log: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_table = false;
    for line in log.lines() {
        let t = line.trim_end();
        let counts = t.split_whitespace().collect::<Vec<_>>();
        let is_total = counts.len() == 4 && counts[1] == "passed," && counts[3] == "failed";
        let keep = is_total
            || t.starts_with("adapter:")
            || t.starts_with("error:")
            || t.starts_with("stamp:")
            || t.starts_with("test result:")
            || (t.starts_with("test ") && t.ends_with("FAILED"))
            || t.contains("panicked at")
            || t.contains("ERROR SUMMARY")
            || t.starts_with("variant failed:")
            || t.starts_with("GEMM engines over the run:")
            || step == "gemm-sweep"
            || (step == "python-torch"
                && (["python:", "torch", "ok ", "FAILED "].iter().any(|h| t.starts_with(h)) || t.ends_with(" failed")))
            || (step.contains("conformance") || step == "reference-vulkan") && t.contains("  FAIL  ")
            || step == "reference-vulkan" && t.starts_with("bits: ");
        // The profiler's kernels and their throughputs: every such line.
        if step == "ncu-hopper" {
            let metrics = [
                "Duration",
                "Compute (SM) Throughput",
                "Memory Throughput",
                "DRAM Throughput",
                "L2 Cache Throughput",
                "L1/TEX Cache Throughput",
                "Achieved Occupancy",
                "Registers Per Thread",
                "Warp Cycles Per Issued Instruction",
            ];
            let trimmed = t.trim_start();
            let heads = ["cmm_hopper", "cmm_gather_rows", "profiled:", "ncu:", "==PROF==", "==ERROR==", "==WARNING=="];
            // WarpStateStats' rule says where the warps wait most (a fence, a barrier).
            let stalls = trimmed.contains("cycles being stalled");
            if heads.iter().any(|h| trimmed.starts_with(h)) || metrics.iter().any(|m| trimmed.starts_with(m)) || stalls
            {
                out.push(t.to_string());
            }
            continue;
        }
        // The model's table beside the bench's: every line of it.
        if step.ends_with("model-vs-bench") {
            out.push(t.to_string());
            continue;
        }
        if step.starts_with("bench") {
            // The GPU, the peak, the sync mode, whether communication had priority, and
            // what the staggered and offset columns time.
            let header = [
                "gpu:",
                "cuBLAS",
                "sync:",
                "signals, waits and SM copies at",
                "every launch at the default",
                "`staggered`",
                "`offsets`",
                "plans:",
            ];
            if header.iter().any(|h| t.starts_with(h)) {
                out.push(t.to_string());
            }
            if t.starts_with("op ") {
                in_table = true;
            }
            if in_table && !t.is_empty() && !t.starts_with("saved") {
                out.push(t.to_string());
                continue;
            }
        }
        if keep && out.len() < 60 {
            out.push(t.to_string());
        }
    }
    out
}

/// `cargo xtask gpu-bundle-summary`: `steps.tsv` and the logs into `summary.md` and
/// `summary.json`.
pub fn summarise(args: &SummaryArgs) -> Result<()> {
    let table = fs::read_to_string(args.logs.join("steps.tsv")).context("reading steps.tsv")?;
    let mut steps = Vec::new();
    for row in table.lines().skip(1) {
        let cols: Vec<&str> = row.split('\t').collect();
        let [name, rc, seconds, note] = cols[..] else { continue };
        let log = fs::read_to_string(args.logs.join(format!("{name}.log"))).unwrap_or_default();
        let rc: Option<i32> = rc.parse().ok();
        let result = match (rc, note) {
            (_, "no GPU") => "no GPU",
            (None, _) => "skipped",
            (Some(0), _) => "passed",
            _ => "FAILED",
        };
        let mut details = key_lines(name, &log);
        if !note.is_empty() {
            details.insert(0, note.to_string());
        }
        if name == "env" {
            details = log.lines().take(12).map(str::to_string).collect();
        }
        steps.push(StepSummary {
            name: name.to_string(),
            rc,
            seconds: seconds.parse().unwrap_or(0),
            result: result.into(),
            details,
        });
    }
    let environment: Vec<String> = ["env.log", "libraries.log"]
        .iter()
        .filter_map(|f| fs::read_to_string(args.logs.join(f)).ok())
        .flat_map(|t| t.lines().take(16).map(str::to_string).collect::<Vec<_>>())
        .collect();
    let summary = Summary { commit: std::env::var("CMM_COMMIT").ok(), environment, steps };
    fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let json = serde_json::to_string_pretty(&summary).context("encoding the summary")?;
    fs::write(args.out.join("summary.json"), json + "\n").context("writing summary.json")?;
    let mut md = String::from("# cmm GPU bundle\n\n");
    md += &format!("commit: {}\n\n```text\n", summary.commit.as_deref().unwrap_or("unknown"));
    for line in &summary.environment {
        md += &format!("{line}\n");
    }
    md += "```\n\n| step | result | seconds |\n|---|---|---:|\n";
    for s in &summary.steps {
        md += &format!("| {} | {} | {} |\n", s.name, s.result, s.seconds);
    }
    for s in &summary.steps {
        if !s.details.is_empty() {
            md += &format!("\n## {} ({})\n\n```text\n{}\n```\n", s.name, s.result, s.details.join("\n"));
        }
    }
    // The bench reports as tables, ready for docs/perf.md.
    let read = |path: PathBuf| {
        fs::read_to_string(path).ok().map(|text| serde_json::from_str::<BenchReport>(&text).map_err(|e| e.to_string()))
    };
    for name in ["bench-kernels.json", "bench-memops.json"] {
        let Some(report) = read(args.out.join(name)) else { continue };
        md += &format!("\n## {name} as a table\n\n");
        md += &match report {
            Ok(report) => report.table(),
            Err(e) => format!("not readable as a bench report: {e}\n"),
        };
    }
    // The plans that later steps timed again another way, beside the bench's own times.
    let again = [
        (
            "bench-kernels-narrow.json",
            "128×128",
            "on the Hopper engine's tile by the fused rule and on its own 128×128 kernels (twins too)",
        ),
        (
            "bench-kernels-tma-store.json",
            "TMA stores",
            "on the Hopper engine's own kernels and on its TMA-store kernels (twins too)",
        ),
        ("bench-kernels-8-queues.json", "on 8 queues", "on the bench's hardware queues and on CUDA's default 8"),
    ];
    if let Some(Ok(bench)) = read(args.out.join("bench-kernels.json")) {
        for (name, label, heading) in again {
            if let Some(Ok(other)) = read(args.logs.join(name)) {
                md += &format!("\n## The same plans {heading}\n\n");
                md += &beside_table(&bench, &other, label);
            }
        }
    }
    fs::write(args.out.join("summary.md"), md).context("writing summary.md")?;
    Ok(())
}

/// The rows of `other` (a later bench of some of the plans, run another way: `label`)
/// beside the same plans' rows of `bench` (the bundle's own bench), with their twins: the
/// plan's time, and its excess over its twin, each way.
fn beside_table(bench: &BenchReport, other: &BenchReport, label: &str) -> String {
    let us = |t: Option<f64>| t.map_or("–".to_string(), |t| format!("{t:.1}"));
    let mut md = format!(
        "| op | D | plan | time µs | {label} µs | {label} ÷ bench | twin µs | twin {label} µs | ÷ twin | ÷ twin {label} |\n\
         |---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in &other.rows {
        let key = (&r.plan.op, r.plan.devices, &r.plan.algorithm);
        let Some(m) = bench.rows.iter().find(|m| (&m.plan.op, m.plan.devices, &m.plan.algorithm) == key) else {
            continue;
        };
        let over = |row: &BenchRow| row.figures.compute_only_us.map(|t| row.plan.time_us / t);
        md += &format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.3} | {} | {} | {} | {} |\n",
            r.plan.op,
            r.plan.devices,
            r.plan.algorithm,
            m.plan.time_us,
            r.plan.time_us,
            r.plan.time_us / m.plan.time_us,
            us(m.figures.compute_only_us),
            us(r.figures.compute_only_us),
            over(m).map_or("–".to_string(), |x| format!("{x:.3}")),
            over(r).map_or("–".to_string(), |x| format!("{x:.3}")),
        );
    }
    md
}

/// The part of a CUDA bench report (`cargo xtask bench --backend cuda --json`) the
/// summary tabulates.
#[derive(Debug, Deserialize)]
struct BenchReport {
    gpu: String,
    sync: String,
    commit: Option<String>,
    #[serde(default)]
    complete: bool,
    /// cuBLAS's 8192³ f16 rate in the same run, TFLOP/s.
    #[serde(default)]
    peak_cublas_tflops: Option<f64>,
    rows: Vec<BenchRow>,
}

/// One row of the report: the plan's times and its ratios.
#[derive(Debug, Deserialize)]
struct BenchRow {
    #[serde(flatten)]
    plan: PlanTimes,
    #[serde(flatten)]
    figures: PlanFigures,
}

impl BenchReport {
    /// The rows as a markdown table: every time taken, the best over Σ GEMMs and the
    /// baseline (a missing time is `–`).
    fn table(&self) -> String {
        let us = |t: Option<f64>| t.map_or("–".to_string(), |t| format!("{t:.1}"));
        let mut md = format!(
            "{} · sync {} · commit {}{}\n\n",
            self.gpu,
            self.sync,
            self.commit.as_deref().unwrap_or("unknown"),
            if self.complete { "" } else { " · incomplete: the bench stopped before its last row" }
        );
        if let Some(peak) = self.peak_cublas_tflops {
            md += &format!("cuBLAS's 8192³ f16 in this run: {peak:.0} TFLOP/s (`÷ 8192³`: a plan's rate over it)\n\n");
        }
        md += "| op | D | plan | time µs | staggered µs | offsets µs | tile kernel µs | 128×128 µs | 2 CTAs/SM µs | more SMs free µs | SM copies µs | copy engines µs | driver copies µs | Σ GEMMs µs | best ÷ Σ | twin µs | best ÷ twin | baseline µs | speedup | TFLOP/s | ÷ 8192³ | GEMMs on |\n";
        md +=
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n";
        for r in &self.rows {
            let (p, f) = (&r.plan, &r.figures);
            let over_twin = f.compute_only_us.map(|t| p.fastest_us() / t);
            let of_peak = self.peak_cublas_tflops.filter(|&peak| peak > 0.0).map(|peak| f.tflops / peak);
            md += &format!(
                "| {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.3} | {} | {} | {:.1} | {:.2}× | {:.0} | {} | {} |\n",
                p.op,
                p.devices,
                p.algorithm,
                p.time_us,
                us(p.time_staggered_us),
                us(p.time_offset_us),
                us(p.time_tile_kernel_us),
                us(p.time_wide_tiles_us),
                us(p.time_two_ctas_per_sm_us),
                us(p.time_free_sms_us),
                us(p.time_sm_copies_us),
                us(p.time_copy_engines_us),
                us(p.time_driver_copies_us),
                f.gemm_sum_us,
                f.time_over_gemm_sum,
                us(f.compute_only_us),
                over_twin.map_or("–".to_string(), |x| format!("{x:.3}")),
                f.baseline_us,
                f.speedup_over_baseline,
                f.tflops,
                of_peak.map_or("–".to_string(), |x| format!("{x:.2}")),
                f.gemm_engine
            );
        }
        md
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The script as shipped parses, and the check refuses one that does not: the
    /// apostrophe inside `${…:-…}` in double quotes that once made bash read the rest of
    /// the file as a quoted string, which only a GPU machine reached.
    #[test]
    fn the_parse_check_refuses_a_script_bash_cannot_read() {
        let dir = std::env::temp_dir().join(format!("cmm-bundle-parse-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("run.sh"), RUN_SH).unwrap();
        check_parses(&dir).unwrap();
        let broken = RUN_SH.replacen("unset (the binaries of cmm set 32)", "unset (cmm's binaries set 32)", 1);
        assert_ne!(broken, RUN_SH);
        fs::write(dir.join("run.sh"), broken).unwrap();
        let error = check_parses(&dir).unwrap_err().to_string();
        assert!(error.contains("run.sh does not parse") && error.contains(": line "), "{error}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A device call brings back at most 8 files from `$OUT`: every file the script (and
    /// the summary it calls) may write there must fit, the rest travel in logs.tar.gz.
    #[test]
    fn what_the_script_writes_under_out_fits_what_a_device_call_returns() {
        let mut files: std::collections::BTreeSet<&str> =
            RUN_SH.split("\"$out/").skip(1).filter_map(|rest| rest.split('"').next()).collect();
        files.insert("summary.json");
        assert!(files.contains("bench-kernels.json") && files.contains("logs.tar.gz"), "{files:?}");
        assert!(files.iter().all(|f| !f.contains('/')), "{files:?}");
        assert!(files.len() <= 8, "{} files under $OUT, a device call returns 8: {files:?}", files.len());
    }

    /// docs/howto.md's table of the bundle's steps names every GPU step of the script, in
    /// its order (a row may name several: `` `sanitizer-memcheck`, `-racecheck` ``).
    /// `ncu-hopper` profiles as many launches as the sweep's profile mode makes of its
    /// kernels (fewer, and the last runs would go unprofiled).
    #[test]
    fn the_profilers_launch_count_is_the_profile_modes() {
        let count = RUN_SH
            .split("--launch-count ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<usize>().ok())
            .expect("run.sh's ncu-hopper step gives --launch-count");
        assert_eq!(count, crate::sweep::profiled_launches());
    }

    #[test]
    fn the_howto_lists_the_gpu_steps_in_the_scripts_order() {
        let howto = include_str!("../../docs/howto.md");
        let table = howto.split("| step | what |").nth(1).expect("howto.md has the bundle's step table");
        let mut listed = Vec::new();
        for row in table.lines().skip(2).take_while(|l| l.starts_with("| `")) {
            let names = row.trim_start_matches("| ").split(" |").next().unwrap_or_default();
            let mut stem = "";
            for name in names.split(", ").map(|n| n.trim_matches('`')) {
                if let Some(suffix) = name.strip_prefix('-') {
                    listed.push(format!("{stem}-{suffix}"));
                } else {
                    stem = name.split('-').next().unwrap_or_default();
                    listed.push(name.to_string());
                }
            }
        }
        assert_eq!(listed, gpu_steps(RUN_SH), "docs/howto.md's step table against run.sh");
    }

    /// The dry run is checked against the GPU steps as the script lists them: the top-level
    /// `step` lines, none of the rehearsal's.
    #[test]
    fn the_gpu_steps_are_the_scripts_top_level_steps() {
        let steps = gpu_steps(RUN_SH);
        assert!(steps.len() >= 20, "{steps:?}");
        assert_eq!(steps[..3], ["gate-probe", "fused-push-probe", "gemm-sweep"]);
        assert!(steps.contains(&"bench-kernels") && steps.contains(&"sanitizer-fused"), "{steps:?}");
        assert!(steps.iter().all(|s| !s.starts_with("rehearsal-")), "{steps:?}");
    }

    #[test]
    fn the_rehearsal_is_held_to_the_steps_of_its_two_branches() {
        let (fake, host) = rehearsal_steps(RUN_SH);
        assert!(fake.len() >= 20 && fake.iter().all(|s| s.starts_with("rehearsal-")), "{fake:?}");
        assert_eq!(fake.first(), Some(&"rehearsal-device-tests"));
        assert_eq!(fake.last(), Some(&"rehearsal-gemm-sweep-profile"));
        assert!(fake.contains(&"rehearsal-sanitizer-hopper-staged-command"), "{fake:?}");
        assert_eq!(host, ["rehearsal-device-tests", "rehearsal-conformance-kernels", "rehearsal-conformance-memops"]);
    }

    /// The rehearsal runs the lowering's variants on `$sample`: it must hold at least one
    /// case of every op/algorithm pair of the corpus, or a variant's path for a new plan
    /// would go unrun here until a GPU runs it.
    #[test]
    fn the_rehearsal_sample_holds_every_op_algorithm_pair() {
        let sample = RUN_SH.lines().find_map(|l| l.trim().strip_prefix("sample=")).expect("run.sh sets sample=");
        let corpus = cmm_conformance::load_corpus(&cmm_conformance::cases_dir()).unwrap();
        let pair = |c: &cmm_conformance::Case| (c.op_name(), c.algorithm.clone());
        let all: std::collections::BTreeSet<_> = corpus.iter().map(pair).collect();
        let sampled: Vec<_> = corpus.iter().filter(|c| cmm_conformance::name_matches(sample, &c.name)).collect();
        let held: std::collections::BTreeSet<_> = sampled.iter().map(|c| pair(c)).collect();
        let missing: Vec<_> = all.difference(&held).collect();
        assert!(missing.is_empty(), "the rehearsal's sample {sample} misses {missing:?}");
        assert!(sampled.len() * 2 < corpus.len(), "{} of {} cases: not a sample", sampled.len(), corpus.len());
        let users = RUN_SH.lines().filter(|l| l.contains("--filter \"$sample\"")).count();
        assert_eq!(users, 5, "the variant steps that run on the sample");
    }

    #[test]
    fn the_glibc_needed_comes_from_the_version_table_not_from_any_string() {
        // This test binary holds the stand-in loader message of `check_unstartable`,
        // `GLIBC_9.99`, among its strings; it needs a real glibc 2.x all the same.
        let me = fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(me.windows(10).any(|w| w == b"GLIBC_9.99"));
        let (major, minor) = glibc_needed(&me).unwrap();
        assert!(major == 2 && (2..60).contains(&minor), "{major}.{minor}");
        assert!(glibc_needed(b"GLIBC_2.35, not an ELF file").is_err());
    }

    #[test]
    fn key_lines_keep_totals_failures_and_the_bench_table() {
        let conformance = "adapter: cuda on H100\ncase  op\nag_gemm_ring_d2  ag_gemm  ring  2  1x1x1  f32->f32  exact  0  ok  1.0 ms\n\
            gemm_rs_ring_d3  gemm_rs  ring  3  1x1x1  f32->f32  exact  -  FAIL  -  cuda: wait timed out\n185 passed, 1 failed\n\
            stamp: 20 op/algorithm pair(s)\n";
        let lines = key_lines("conformance-kernels", conformance);
        assert_eq!(lines.len(), 4, "{lines:?}");
        assert!(lines[1].contains("FAIL") && lines[2] == "185 passed, 1 failed");
        let bench =
            "gpu: H100\ncuBLAS 8192³ f16: 700 TFLOP/s\nsync: kernels\nsignals, waits and SM copies at priority -5\nop  D plan\nag_gemm 2 ring 100.0\n\
             targets, on the fastest overlapped plan of each op and D:\ntarget ag_gemm D=2: ring at 1.010× Σ GEMMs (≤ 1.05: met)\n\
             targets: 1 of 1 met\nsaved x.json\n";
        let lines = key_lines("bench-kernels", bench);
        assert_eq!(
            lines,
            vec![
                "gpu: H100",
                "cuBLAS 8192³ f16: 700 TFLOP/s",
                "sync: kernels",
                "signals, waits and SM copies at priority -5",
                "op  D plan",
                "ag_gemm 2 ring 100.0",
                "targets, on the fastest overlapped plan of each op and D:",
                "target ag_gemm D=2: ring at 1.010× Σ GEMMs (≤ 1.05: met)",
                "targets: 1 of 1 met"
            ]
        );
        let tests = "test a ... ok\ntest b ... FAILED\nthread 'b' panicked at x.rs:1:1:\ntest result: FAILED. 1 passed; 1 failed\n";
        assert_eq!(key_lines("device-tests", tests).len(), 3);
        assert_eq!(
            key_lines("sanitizer-memcheck", "========= ERROR SUMMARY: 0 errors\n"),
            vec!["========= ERROR SUMMARY: 0 errors"]
        );
        let vulkan = "VK_DRIVER_FILES=x\nadapter: GPU (Vulkan)\n406 passed, 0 failed\nbits: 1 of 9 exported files differ\nbits: Files a and b differ\n";
        assert_eq!(key_lines("reference-vulkan", vulkan).len(), 4);
        let model = "as the profile stands (h100-one-gpu):\ncase measured\ngemm_rs D=4 ring 1.0 µs\n";
        assert_eq!(key_lines("model-vs-bench", model).len(), 3);
        let ncu = "ncu: /usr/local/cuda/bin/ncu\n==PROF== Connected to process 7\n  cmm_hopper_gemm_bf16_n256 (132, 1, 1)x(384, 1, 1), Context 1\n    Section: GPU Speed Of Light Throughput\n    ----------------------- ----------- ------------\n    DRAM Frequency                  Ghz         2.62\n    Duration                         ms         1.84\n    Compute (SM) Throughput           %        61.20\n    Section: Warp State Statistics\n    Warp Cycles Per Issued Instruction  cycle  28.41\n    Warp Cycles Per Executed Instruction  cycle  28.42\n    OPT   Est. Speedup: 40%\n          On average, each warp of this kernel spends 12.3 cycles being stalled waiting for a memory barrier.\nprofiled: plain 8192x8192x8192 bf16 on hopper 128x256\n";
        let lines = key_lines("ncu-hopper", ncu);
        assert_eq!(lines.len(), 8, "{lines:?}");
        assert!(lines[2].contains("cmm_hopper_gemm_bf16_n256") && lines[3].contains("Duration"), "{lines:?}");
    }

    #[test]
    fn the_summary_names_each_step_and_its_result() {
        let dir = std::env::temp_dir().join(format!("cmm-summary-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("steps.tsv"),
            "step\trc\tseconds\tnote\ndevice-tests\t0\t12\t\nconformance-kernels\t1\t40\t\nbench-kernels\t-\t0\tskipped: the time budget is spent\n",
        )
        .unwrap();
        fs::write(dir.join("conformance-kernels.log"), "185 passed, 1 failed\n").unwrap();
        let row = r#"{"op": "gemm_rs", "devices": 4, "algorithm": "ring_push", "time_us": 1010.04,
            "time_staggered_us": null, "time_offset_us": 1003.0, "gemm_sum_us": 1000.0, "time_over_gemm_sum": 1.003,
            "baseline_us": 1150.0, "speedup_over_baseline": 1.1466, "tflops": 545.2, "gemm_engine": "cuBLAS",
            "compute_only_us": 980.0, "time_copy_engines_us": 1005.0, "time_driver_copies_us": 1020.0,
            "gated": true, "spot_check_worst": 0.5, "variant_failures": []}"#;
        let report = format!(
            r#"{{"gpu": "H100", "sync": "kernels", "commit": "abc", "complete": true, "peak_cublas_tflops": 727.0, "rows": [{row}]}}"#
        );
        fs::write(dir.join("bench-kernels.json"), &report).unwrap();
        fs::write(dir.join("bench-memops.json"), "{}").unwrap();
        // The 8-queue step's report: the same plan, 1.25 times as long, its twin 1.1.
        let eight =
            report.replace("1010.04", "1262.55").replace("\"compute_only_us\": 980.0", "\"compute_only_us\": 1078.0");
        fs::write(dir.join("bench-kernels-8-queues.json"), eight).unwrap();
        // The 128×128 step's: the same plan 0.9 times as long, its twin 0.95.
        let narrow =
            report.replace("1010.04", "909.04").replace("\"compute_only_us\": 980.0", "\"compute_only_us\": 931.0");
        fs::write(dir.join("bench-kernels-narrow.json"), narrow).unwrap();
        summarise(&SummaryArgs { logs: dir.clone(), out: dir.clone() }).unwrap();
        let md = fs::read_to_string(dir.join("summary.md")).unwrap();
        assert!(md.contains("| device-tests | passed | 12 |"), "{md}");
        assert!(md.contains("| conformance-kernels | FAILED | 40 |") && md.contains("185 passed, 1 failed"), "{md}");
        assert!(md.contains("| bench-kernels | skipped | 0 |") && md.contains("time budget is spent"), "{md}");
        // The bench reports as tables: every time taken, `–` for the others.
        let row =
            "| gemm_rs | 4 | ring_push | 1010.0 | – | 1003.0 | – | – | – | – | – | 1005.0 | 1020.0 | 1000.0 | 1.003 | 980.0 | 1.023 | 1150.0 | \
                   1.15× | 545 | 0.75 | cuBLAS |";
        assert!(md.contains("## bench-kernels.json as a table") && md.contains(row), "{md}");
        assert!(md.contains("## bench-memops.json as a table\n\nnot readable as a bench report"), "{md}");
        let row = "| gemm_rs | 4 | ring_push | 1010.0 | 1262.5 | 1.250 | 980.0 | 1078.0 | 1.031 | 1.171 |";
        assert!(md.contains("CUDA's default 8") && md.contains(row), "{md}");
        let row = "| gemm_rs | 4 | ring_push | 1010.0 | 909.0 | 0.900 | 980.0 | 931.0 | 1.031 | 0.976 |";
        assert!(md.contains("| 128×128 ÷ bench |") && md.contains(row), "{md}");
        let json: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
        assert_eq!(json["steps"][1]["result"], "FAILED");
        assert_eq!(json["steps"][2]["rc"], serde_json::Value::Null);
        let _ = fs::remove_dir_all(&dir);
    }
}
