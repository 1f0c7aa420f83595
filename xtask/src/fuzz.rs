//! `cargo xtask fuzz`: the parsers users feed (`cmm_conformance::fuzz`'s targets, and
//! `cmm_cli::fuzz`'s hardware profiles and bench reports) on mutated inputs for a bounded
//! time, on stable Rust. Seeds are the corpus's case files, the plan files of small corpus
//! cases, `.npy` files of every dtype, the built-in profiles and the GPU runs' bench
//! reports; each
//! input gets a few byte-level and token-level mutations (flips, splices, extreme
//! numbers). A panic, or an input that runs past the time limit, fails the command and
//! leaves the input in `target/fuzz-findings/`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use cmm_conformance::fuzz::{Rng, Target};
use cmm_core::DType;

/// Arguments of `cargo xtask fuzz`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Seconds to spend on each target.
    #[arg(long, default_value_t = 20)]
    pub seconds: u64,
    /// Only the target with this name (case_file, plan_file, npy, profile or bench_report).
    #[arg(long)]
    pub target: Option<String>,
    /// The random seed (default: from the clock; printed, so a run can be replayed).
    #[arg(long)]
    pub seed: Option<u64>,
}

thread_local! {
    /// Whether this thread is running a target (its panics are reported by the loop, not
    /// the hook).
    static IN_TARGET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A fuzzing thread's input in flight, for the watchdog: when it started (ms since the
/// run's epoch, 0 = none), and the target and input.
#[derive(Default)]
struct InFlight {
    started: AtomicU64,
    input: std::sync::Mutex<(String, Vec<u8>)>,
}

/// One input may take this long before it counts as a hang.
const HANG_AFTER: Duration = Duration::from_secs(20);

/// Every target: the files of cases, plans and outputs, then hardware profiles.
fn targets() -> impl Iterator<Item = Target> {
    cmm_conformance::fuzz::TARGETS.into_iter().chain(cmm_cli::fuzz::TARGETS)
}

/// Tokens spliced into text inputs: numbers at every limit and the punctuation that
/// decides structure.
const TOKENS: [&str; 27] = [
    "0",
    "-1",
    "1",
    "65536",
    "4294967295",
    "4294967296",
    "18446744073709551616",
    "1e309",
    "-0",
    "nan",
    "\"\"",
    "\"..\"",
    "[]",
    "{}",
    "[[case]]",
    "null",
    "true",
    ",",
    "\"f16\"",
    "\"bf16\"",
    "\"ring_chunked\"",
    "\"attention\"",
    "1e308",
    "1e-300",
    "\"torus\"",
    "\"one_gpu\"",
    "[compute]",
];

/// The seed inputs of `target`.
fn seeds(target: &str) -> Result<Vec<Vec<u8>>> {
    let corpus = cmm_conformance::load_corpus(&cmm_conformance::cases_dir()).context("loading the corpus")?;
    Ok(match target {
        "case_file" => {
            let dir = cmm_conformance::cases_dir();
            let mut seeds = Vec::new();
            for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
                let text = std::fs::read_to_string(entry?.path())?;
                // One case per seed: whole files are large and mutate slowly.
                seeds.extend(text.split("[[case]]").skip(1).map(|c| format!("[[case]]{c}").into_bytes()));
            }
            seeds
        }
        "plan_file" => corpus
            .iter()
            .filter_map(|c| c.plan().ok())
            .filter(|p| p.op_count() < 400)
            .step_by(7)
            .map(|p| p.to_file_json().into_bytes())
            .collect(),
        "profile" => files_in(&crate::workspace_root().join("sim").join("profiles"), ".toml")?,
        // The GPU runs' bench reports, and the fake driver's (whose calibration has the
        // persistent kernels' lines, which no GPU run has yet).
        "bench_report" => {
            let runs = crate::workspace_root().join("docs").join("gpu-runs");
            let mut seeds = files_in(&crate::workspace_root().join("cli").join("fuzz").join("bench_report"), ".json")?;
            for run in std::fs::read_dir(&runs).with_context(|| format!("reading {}", runs.display()))? {
                let run = run?.path();
                if run.is_dir() {
                    seeds.extend(files_in(&run, "-bench-kernels.json")?);
                }
            }
            seeds
        }
        _ => {
            let words: Vec<u32> = (0..6).map(|i| DType::F16.encode(i as f32 - 2.5)).collect();
            let mut seeds = Vec::new();
            for dtype in [DType::F32, DType::F16, DType::Bf16, DType::U32] {
                seeds.push(cmm_conformance::export::npy_bytes(dtype, 2, 3, &words).0);
            }
            seeds
        }
    })
}

/// The contents of every file in `dir` whose name ends in `suffix`.
fn files_in(dir: &std::path::Path, suffix: &str) -> Result<Vec<Vec<u8>>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.to_string_lossy().ends_with(suffix) {
            files.push(std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?);
        }
    }
    Ok(files)
}

/// A mutated copy of `input`, with a few changes and sometimes a splice of `other`.
fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(out.len() + 1);
        match rng.below(7) {
            0 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] ^= 1 << rng.below(8);
            }
            1 if !out.is_empty() => {
                const BYTES: &[u8] = b"\x00\xff0-9\".[]{}=,\n";
                let i = rng.below(out.len());
                out[i] = BYTES[rng.below(BYTES.len())];
            }
            2 => out.insert(at, rng.next_u64() as u8),
            3 if !out.is_empty() => {
                let end = (at + 1 + rng.below(16)).min(out.len());
                out.drain(at.min(end)..end);
            }
            4 => {
                let token = TOKENS[rng.below(TOKENS.len())].as_bytes();
                // Replace the number or word at `at`, if any, else insert.
                let start = at.min(out.len());
                let end = out[start..]
                    .iter()
                    .position(|b| !b.is_ascii_alphanumeric() && *b != b'.')
                    .map_or(out.len(), |p| start + p);
                out.splice(start..end, token.iter().copied());
            }
            5 if !other.is_empty() => {
                let from = rng.below(other.len());
                let len = rng.below(64).min(other.len() - from);
                out.splice(at..at, other[from..from + len].iter().copied());
            }
            _ => {
                let end = (at + rng.below(32)).min(out.len());
                let copy = out[at.min(end)..end].to_vec();
                out.splice(at..at, copy);
            }
        }
    }
    out
}

/// Runs the fuzz targets, as many at once as there are cores (each target still gets its
/// seconds on a core of its own); fails on the first panic or hang.
pub fn run(args: &Args) -> Result<()> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1
    });
    let findings = crate::workspace_root().join("target").join("fuzz-findings");
    let targets: Vec<_> = targets().filter(|(name, _)| args.target.as_deref().is_none_or(|t| t == *name)).collect();
    if targets.is_empty() {
        let names: Vec<_> = self::targets().map(|(name, _)| name).collect();
        bail!("no fuzz target `{}` ({})", args.target.as_deref().unwrap_or(""), names.join(", "));
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(targets.len());
    let epoch = Instant::now();
    let in_flight: Arc<Vec<InFlight>> = Arc::new((0..threads).map(|_| InFlight::default()).collect());
    {
        let (in_flight, findings) = (in_flight.clone(), findings.clone());
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(500));
            for slot in in_flight.iter() {
                let at = slot.started.load(Ordering::Relaxed);
                if at > 0 && epoch.elapsed().as_millis() as u64 > at + HANG_AFTER.as_millis() as u64 {
                    let (name, input) = slot.input.lock().map(|c| c.clone()).unwrap_or_default();
                    let path = save(&findings, &name, "hang", &input);
                    eprintln!("fuzz: {name}: an input ran past {HANG_AFTER:?}: {}", path.display());
                    std::process::exit(1);
                }
            }
        });
    }
    // A target's panic is reported once, by its loop, with its input; any other panic is
    // this driver's own and keeps the default report.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !IN_TARGET.with(|t| t.get()) {
            default_hook(info);
        }
    }));
    println!("fuzz: seed {seed} (replay with --seed {seed}), {} s per target, {threads} at once", args.seconds);
    let queue = std::sync::Mutex::new(targets.into_iter());
    let session = Session { seed, seconds: args.seconds, epoch, findings, failed: AtomicBool::new(false) };
    let outcomes: Vec<Result<()>> = std::thread::scope(|scope| {
        let workers: Vec<_> = in_flight
            .iter()
            .map(|slot| {
                let (queue, session) = (&queue, &session);
                scope.spawn(move || -> Result<()> {
                    loop {
                        let Some((name, target)) = queue.lock().ok().and_then(|mut q| q.next()) else { return Ok(()) };
                        if session.failed.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        let outcome = session.fuzz(name, target, slot);
                        if outcome.is_err() {
                            session.failed.store(true, Ordering::Relaxed);
                            return outcome;
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a fuzzing thread panicked"))))
            .collect()
    });
    outcomes.into_iter().collect()
}

/// What every fuzzing thread of a run shares.
struct Session {
    seed: u64,
    /// Seconds per target.
    seconds: u64,
    /// The watchdog's clock.
    epoch: Instant,
    /// Where a finding's input is saved.
    findings: PathBuf,
    /// Whether a target failed: the others stop.
    failed: AtomicBool,
}

impl Session {
    /// Fuzzes one target for its seconds (or until another target fails), with `slot`
    /// telling the watchdog its input in flight.
    fn fuzz(&self, name: &str, target: fn(&[u8]), slot: &InFlight) -> Result<()> {
        let seeds = seeds(name)?;
        let mut rng = Rng(self.seed ^ name.len() as u64);
        let deadline = Instant::now() + Duration::from_secs(self.seconds);
        let mut inputs = 0u64;
        while Instant::now() < deadline && !self.failed.load(Ordering::Relaxed) {
            let (a, b) = (&seeds[rng.below(seeds.len())], &seeds[rng.below(seeds.len())]);
            let input = mutate(&mut rng, a, b);
            if let Ok(mut c) = slot.input.lock() {
                *c = (name.to_string(), input.clone());
            }
            slot.started.store(self.epoch.elapsed().as_millis() as u64 + 1, Ordering::Relaxed);
            IN_TARGET.with(|t| t.set(true));
            let outcome = std::panic::catch_unwind(|| target(&input));
            IN_TARGET.with(|t| t.set(false));
            slot.started.store(0, Ordering::Relaxed);
            if let Err(panic) = outcome {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                let path = save(&self.findings, name, "panic", &input);
                bail!("fuzz: {name}: a panic ({message}) on the input saved in {}", path.display());
            }
            inputs += 1;
        }
        if !self.failed.load(Ordering::Relaxed) {
            println!("fuzz: {name}: {inputs} inputs from {} seeds, no panic, no hang", seeds.len());
        }
        Ok(())
    }
}

/// Writes a finding's input under `dir` and returns its path.
fn save(dir: &std::path::Path, name: &str, kind: &str, input: &[u8]) -> PathBuf {
    let _ = std::fs::create_dir_all(dir);
    let path = dir.join(format!("{name}-{kind}-{:016x}", cmm_conformance::golden::fnv1a64(input)));
    let _ = std::fs::write(&path, input);
    path
}

#[cfg(test)]
mod tests {
    /// Every target `cargo xtask fuzz` drives has its cargo-fuzz twin in `fuzz/`, calling
    /// the same function, and every twin a target.
    #[test]
    fn every_target_has_its_libfuzzer_twin() {
        let fuzz = crate::workspace_root().join("fuzz");
        let manifest = std::fs::read_to_string(fuzz.join("Cargo.toml")).unwrap();
        let mut twins: Vec<String> = std::fs::read_dir(fuzz.join("fuzz_targets"))
            .unwrap()
            .map(|e| e.unwrap().path().file_stem().unwrap().to_string_lossy().into_owned())
            .collect();
        twins.sort();
        let mut names: Vec<String> = super::targets().map(|(name, _)| name.to_string()).collect();
        names.sort();
        assert_eq!(twins, names);
        for name in names {
            let source = std::fs::read_to_string(fuzz.join("fuzz_targets").join(format!("{name}.rs"))).unwrap();
            assert!(source.contains(&format!("::fuzz::{name}(data)")), "fuzz/fuzz_targets/{name}.rs");
            assert!(manifest.contains(&format!("name = \"{name}\"\npath = \"fuzz_targets/{name}.rs\"")), "{name}");
        }
    }
}
