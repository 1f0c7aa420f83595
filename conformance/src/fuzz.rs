//! Entry points for fuzzing what users hand cmm: case files, plan files and `.npy`
//! outputs. Each takes arbitrary bytes and must return — an error or a result — without
//! a panic, a hang or an allocation the input's own size does not bound. `cargo xtask
//! fuzz` drives them with mutated corpus inputs on stable Rust (CI runs it for a bounded
//! time); `fuzz/` wraps the same functions as cargo-fuzz (libFuzzer) targets.

use std::path::Path;

use cmm_core::schedule::{schedule_with, Order};
use cmm_core::verify::{verify_in, Cells};
use cmm_core::{cpu, DType, Plan};

/// Plans past these sizes are parsed and validated but not run: running them is bounded
/// work, only slower, and a fuzzer wants many inputs a second.
const MAX_RUN_OPS: usize = 2_000;
const MAX_RUN_ELEMENTS: u64 = 1 << 16;
/// Case dimensions past this are parsed but not planned, for the same reason.
const MAX_PLANNED_EXTENT: usize = 4096;

/// What a fuzz target is called and the function it runs.
pub type Target = (&'static str, fn(&[u8]));

/// Every target, by name.
pub const TARGETS: [Target; 3] = [("case_file", case_file), ("plan_file", plan_file), ("npy", npy)];

/// Runs every regression input kept under `root/<target>/` (inputs the fuzzer once found
/// a panic or a hang on) through its target; returns how many ran, or the first that
/// panics (its target and file).
pub fn replay_regressions(root: &Path, targets: &[Target]) -> Result<usize, String> {
    let mut inputs = 0;
    for (name, target) in targets {
        let Ok(entries) = std::fs::read_dir(root.join(name)) else { continue };
        for entry in entries {
            let path = entry.map_err(|e| e.to_string())?.path();
            let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            if std::panic::catch_unwind(|| target(&bytes)).is_err() {
                return Err(format!("{name}: {} panics", path.display()));
            }
            inputs += 1;
        }
    }
    Ok(inputs)
}

/// A case file: parsed, and each small valid case planned and run on the CPU twin.
pub fn case_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(cases) = crate::case::parse_cases(text, Path::new("fuzz.toml")) else { return };
    for case in cases.iter().take(4) {
        if [case.m, case.n, case.k, case.devices()].iter().any(|&x| x > MAX_PLANNED_EXTENT) {
            continue;
        }
        if let Ok(plan) = case.plan() {
            run_small(&plan, case.seed, case.family);
        }
    }
}

/// A plan file: parsed and validated, and a small one scheduled, verified and run.
pub fn plan_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(plan) = Plan::from_file_json(text) else { return };
    if plan.op_count() > MAX_RUN_OPS || plan.elements() > MAX_RUN_ELEMENTS {
        return;
    }
    let cells = Cells::of(&plan);
    if let Ok(schedule) = schedule_with(&plan, Order::Default) {
        let _ = verify_in(&plan, &schedule, &cells);
    }
    run_small(&plan, 1, cmm_core::Family::Realistic);
}

/// An `.npy` file read as an output of every dtype, in the shapes its size allows.
pub fn npy(data: &[u8]) {
    for dtype in [DType::F32, DType::F16, DType::Bf16, DType::U32] {
        for (rows, cols) in [(2, 3), (1, 6), (6, 1), (0, 0), (4, 4)] {
            let _ = crate::export::read_npy(data, dtype, rows, cols);
        }
    }
}

fn run_small(plan: &Plan, seed: u32, family: cmm_core::Family) {
    if plan.op_count() <= MAX_RUN_OPS && plan.elements() <= MAX_RUN_ELEMENTS {
        let _ = cpu::run(plan, seed, family);
    }
}

/// xorshift64*: a small deterministic generator for fuzzers and property tests (seeded,
/// so that a run can be replayed from its seed).
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// One of `from`.
    pub fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len())]
    }
}
