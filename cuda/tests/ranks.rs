//! One process per device on the fake CUDA driver (`CudaBackend::run_rank`): this test
//! binary starts D copies of itself, one per rank, which meet at a Unix-domain socket,
//! exchange their parts of the symmetric heap as file descriptors, and each run their
//! device's lanes, on generated inputs and on its own device buffers; every rank's results
//! must be the one-process run's, bit for bit, in both sync modes, and every rank must have
//! unmapped and released everything it mapped. Then the failures: a rank that faults leaves its peers a typed error within the wait deadline;
//! a rank that never comes, or runs another plan, is named at the rendezvous; a rendezvous
//! path that holds a file of the user's is refused and the file left as it was.
//!
//! `harness = false`: `main` is the parent, or with `CMM_RANK_CHILD` set one rank.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cmm_core::plan::Plan;
use cmm_core::{build_plan, Algorithm, DType, Family, OpKind, Problem};
use cmm_cuda::fake::Injection;
use cmm_cuda::{
    fake, CudaBackend, CudaExecutor, CudaRunOptions, DeviceBuffer, GivenBuffer, Kernel, Placement, Rendezvous, SyncMode,
};

#[path = "fake/mod.rs"]
mod common;

const SEED: u32 = 13;

/// One of the parent's checks, given a scratch directory.
type Check = fn(&Path);
const CHILD_VAR: &str = "CMM_RANK_CHILD";

fn main() {
    if std::env::var_os(CHILD_VAR).is_some() {
        std::process::exit(child());
    }
    fake::install().unwrap_or_else(|e| panic!("{e}"));
    if !common::nvrtc_or_skip() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("cmm-ranks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tests: [(&str, Check); 4] = [
        ("every_family_runs_one_process_per_device_bit_for_bit", every_family_runs_one_process_per_device_bit_for_bit),
        ("a_rank_that_faults_leaves_its_peers_a_typed_error_within_the_wait_deadline", a_rank_that_faults),
        ("a_rank_that_never_comes_is_named_at_the_rendezvous", a_rank_that_never_comes),
        ("a_rank_running_another_plan_is_refused_at_the_rendezvous", a_rank_running_another_plan),
    ];
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    for (name, test) in tests {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let start = Instant::now();
        test(&dir);
        println!("test {name} ... ok ({:.1} s)", start.elapsed().as_secs_f64());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The fake-driver tests' family plans, a four-device ring and GEMM+AR's two rings.
fn plans() -> Vec<Plan> {
    let mut plans = common::family_plans();
    for (op, algorithm) in [(OpKind::AgGemm, Algorithm::Ring), (OpKind::GemmAr, Algorithm::RingBidir)] {
        let p = Problem::new(op, 4, 64, 48, 32, DType::Bf16, DType::F32).unwrap();
        plans.push(build_plan(&p, algorithm).unwrap());
    }
    plans
}

/// What one rank is told to do.
struct Rank<'a> {
    plan: &'a Path,
    rank: usize,
    world: usize,
    socket: &'a Path,
    sync: SyncMode,
    out: PathBuf,
    /// Fault the first launch of this kernel (a dying rank).
    fault: Option<&'static str>,
    /// Run on the rank's own device buffers (`run_rank_given`).
    given: bool,
}

fn spawn(r: &Rank<'_>) -> std::process::Child {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .env(CHILD_VAR, "1")
        .env("RANK", r.rank.to_string())
        .env("WORLD_SIZE", r.world.to_string())
        .env(cmm_cuda::RENDEZVOUS_VAR, r.socket)
        .env("CMM_RANK_PLAN", r.plan)
        .env("CMM_RANK_SYNC", if r.sync == SyncMode::StreamMemOps { "memops" } else { "kernels" })
        .env("CMM_RANK_OUT", &r.out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(kernel) = r.fault {
        command.env("CMM_RANK_FAULT", kernel);
    }
    if r.given {
        command.env("CMM_RANK_GIVEN", "1");
    }
    command.spawn().unwrap()
}

/// What a rank reported: its exit status, its error (stderr) and, on success, its result
/// buffers' words.
struct Report {
    ok: bool,
    error: String,
    words: Vec<u8>,
    seconds: f64,
}

fn collect(children: Vec<(std::process::Child, PathBuf)>) -> Vec<Report> {
    children
        .into_iter()
        .map(|(child, out)| {
            let output = child.wait_with_output().unwrap();
            let seconds = std::fs::read_to_string(out.with_extension("seconds"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(f64::NAN);
            Report {
                ok: output.status.success(),
                error: String::from_utf8_lossy(&output.stderr).into_owned(),
                words: std::fs::read(&out).unwrap_or_default(),
                seconds,
            }
        })
        .collect()
}

/// How the ranks of one run are told to run.
#[derive(Clone, Copy)]
struct How {
    sync: SyncMode,
    /// A rank whose first launch of a kernel faults.
    fault: Option<(usize, &'static str)>,
    /// On the ranks' own buffers.
    given: bool,
}

fn run_ranks(dir: &Path, plan: &Plan, how: How, tag: &str) -> Vec<Report> {
    let plan_path = dir.join(format!("{tag}.plan.json"));
    std::fs::write(&plan_path, plan.to_file_json()).unwrap();
    let socket = dir.join(format!("{tag}.sock"));
    let children = (0..plan.devices)
        .map(|rank| {
            let out = dir.join(format!("{tag}.rank{rank}.bin"));
            let r = Rank {
                plan: &plan_path,
                rank,
                world: plan.devices,
                socket: &socket,
                sync: how.sync,
                out: out.clone(),
                fault: how.fault.filter(|(at, _)| *at == rank).map(|(_, k)| k),
                given: how.given,
            };
            (spawn(&r), out)
        })
        .collect();
    collect(children)
}

/// Every rank's results are the one-process run's on the same (fake) GPU, bit for bit,
/// on generated inputs and on each rank's own buffers.
fn every_family_runs_one_process_per_device_bit_for_bit(dir: &Path) {
    let backend = CudaBackend::new(1).unwrap_or_else(|e| panic!("{e}"));
    for (i, plan) in plans().iter().enumerate() {
        for (sync, given) in
            [SyncMode::Kernels, SyncMode::StreamMemOps].into_iter().flat_map(|s| [(s, false), (s, true)])
        {
            let what = format!("{} ({sync:?}{})", plan.name, if given { ", own buffers" } else { "" });
            let options = CudaRunOptions { sync, ..Default::default() };
            let one = backend.run(plan, SEED, Family::Exact, &options).unwrap_or_else(|e| panic!("{what}: {e}"));
            let how = How { sync, fault: None, given };
            let reports = run_ranks(dir, plan, how, &format!("plan{i}-{sync:?}-{given}"));
            for (rank, report) in reports.iter().enumerate() {
                assert!(report.ok, "{what}: rank {rank} failed:\n{}", report.error);
                let mut expected = Vec::new();
                for (b, decl) in plan.buffers.iter().enumerate() {
                    if decl.role.is_result() {
                        expected.extend(one.buffers[rank][b].iter().flat_map(|w| w.to_le_bytes()));
                    }
                }
                assert!(!expected.is_empty(), "{what}: rank {rank} has results");
                assert!(report.words == expected, "{what}: rank {rank}'s results differ from the one-process run's");
            }
        }
    }
}

fn a_rank_that_faults(dir: &Path) {
    let p = Problem::new(OpKind::AgGemm, 2, 32, 48, 32, DType::Bf16, DType::F32).unwrap();
    let plan = build_plan(&p, Algorithm::Ring).unwrap();
    // Rank 1's first signal faults: its context is lost, it reports so and exits; rank 0
    // waits for the shard rank 1 never announces, until the wait deadline (2 s here).
    let how = How { sync: SyncMode::Kernels, fault: Some((1, "cmm_signal")), given: false };
    let reports = run_ranks(dir, &plan, how, "fault");
    // It released what it mapped (the child checks) and said why it stopped.
    assert!(!reports[1].ok && reports[1].error.contains("the CUDA context was lost"), "rank 1: {}", reports[1].error);
    let e = &reports[0].error;
    assert!(!reports[0].ok, "rank 0 passed without its peer's shard");
    assert!(e.contains("wait timed out after 2000 ms on device 0") || e.contains("rank 1 left"), "rank 0: {e}");
    assert!(reports[0].seconds < 2.0 + 8.0, "rank 0 took {} s to fail", reports[0].seconds);
}

/// Starts rank `rank` of `world` on `plan` (written under `tag`), kernel waits, generated
/// inputs, and returns it with the path of its results.
fn spawn_rank(dir: &Path, tag: &str, plan: &Plan, rank: usize, world: usize) -> (std::process::Child, PathBuf) {
    let plan_path = dir.join(format!("{tag}{rank}.plan.json"));
    std::fs::write(&plan_path, plan.to_file_json()).unwrap();
    let (socket, out) = (dir.join(format!("{tag}.sock")), dir.join(format!("{tag}.rank{rank}.bin")));
    let sync = SyncMode::Kernels;
    let r = Rank { plan: &plan_path, rank, world, socket: &socket, sync, out: out.clone(), fault: None, given: false };
    (spawn(&r), out)
}

fn ring_of(n: usize) -> Plan {
    build_plan(&Problem::new(OpKind::AgGemm, 2, 32, n, 32, DType::Bf16, DType::F32).unwrap(), Algorithm::Ring).unwrap()
}

fn a_rank_that_never_comes(dir: &Path) {
    let socket = dir.join("alone.sock");
    let reports = collect(vec![spawn_rank(dir, "alone", &ring_of(48), 0, 2)]);
    let e = &reports[0].error;
    assert!(!reports[0].ok && e.contains("rank 0 of 2") && e.contains("ranks 1 did not come"), "{e}");
    assert!(!socket.exists(), "rank 0 removes its socket");
    // A rendezvous path that holds a file of the user's is refused, and the file stays.
    std::fs::write(&socket, "the user's").unwrap();
    let reports = collect(vec![spawn_rank(dir, "alone", &ring_of(48), 0, 2)]);
    let e = &reports[0].error;
    assert!(!reports[0].ok && e.contains("exists and is not a socket"), "{e}");
    assert_eq!(std::fs::read_to_string(&socket).unwrap(), "the user's");
}

fn a_rank_running_another_plan(dir: &Path) {
    let children = vec![spawn_rank(dir, "mixed", &ring_of(48), 0, 2), spawn_rank(dir, "mixed", &ring_of(64), 1, 2)];
    let reports = collect(children);
    let e = &reports[0].error;
    assert!(!reports[0].ok && e.contains("rank 1 runs another job") && e.contains("plan digest"), "{e}");
    assert!(!reports[1].ok && reports[1].error.contains("rank 0"), "rank 1: {}", reports[1].error);
}

/// One rank: runs its lanes, writes its result buffers' words to `CMM_RANK_OUT`, checks
/// that everything it mapped is released, and exits 0; on an error, prints it and exits 1.
fn child() -> i32 {
    let start = Instant::now();
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let out = PathBuf::from(var("CMM_RANK_OUT"));
    let result = (|| -> Result<Vec<u8>, String> {
        fake::install().map_err(|e| e.to_string())?;
        let plan =
            Plan::from_file_json(&std::fs::read_to_string(var("CMM_RANK_PLAN")).unwrap()).map_err(|e| e.to_string())?;
        let mut rendezvous = Rendezvous::from_env().map_err(|e| e.to_string())?;
        rendezvous.timeout = Duration::from_secs(5);
        let backend = CudaBackend::new(1).map_err(|e| e.to_string())?;
        if let Ok(kernel) = std::env::var("CMM_RANK_FAULT") {
            let kernel = Kernel::ALL.into_iter().find(|k| k.entry() == kernel).expect("a kernel entry name");
            fake::inject(Injection::Fault(kernel), 1).map_err(|e| e.to_string())?;
        }
        let sync = if var("CMM_RANK_SYNC") == "memops" { SyncMode::StreamMemOps } else { SyncMode::Kernels };
        let options = CudaRunOptions { sync, wait_timeout: Duration::from_secs(2), ..Default::default() };
        let rank = rendezvous.rank;
        // On the caller's buffers: this rank's, holding what the generated path makes.
        let own: Vec<(GivenBuffer, DeviceBuffer)> = if std::env::var_os("CMM_RANK_GIVEN").is_some() {
            let all =
                backend.generated_buffers(&plan, SEED, Family::Exact, Placement::Virtual).map_err(|e| e.to_string())?;
            all.into_iter().filter(|(g, _)| g.device == rank).collect()
        } else {
            Vec::new()
        };
        let run = if own.is_empty() {
            backend.run_rank(&plan, &rendezvous, SEED, Family::Exact, &options)
        } else {
            let given: Vec<GivenBuffer> = own.iter().map(|(g, _)| g.clone()).collect();
            backend.run_rank_given(&plan, &rendezvous, &given, &options)
        };
        let live = fake::vmm_live().map_err(|e| e.to_string())?;
        if live != 0 {
            return Err(format!("{live} VMM handles or reservations left after the run ({:?})", run.as_ref().err()));
        }
        let run = run.map_err(|e| e.to_string())?;
        let mut words = Vec::new();
        for (b, decl) in plan.buffers.iter().enumerate() {
            if !decl.role.is_result() {
                continue;
            }
            let mine = &run.buffers[rank][b];
            if let Some((g, buffer)) = own.iter().find(|(g, _)| g.name == decl.name) {
                // The result in the caller's buffer is the one the heap held.
                let bytes = buffer.download().map_err(|e| e.to_string())?;
                // An uneven shard's buffer holds the rank's own rows only.
                let theirs = g.dtype.words_from_le(&bytes, decl.len_on(rank));
                if theirs != mine[..decl.len_on(rank)] {
                    return Err(format!("`{}`: the caller's buffer is not the run's result", decl.name));
                }
            }
            words.extend(mine.iter().flat_map(|w| w.to_le_bytes()));
        }
        Ok(words)
    })();
    let _ = std::fs::write(out.with_extension("seconds"), format!("{}", start.elapsed().as_secs_f64()));
    match result {
        Ok(words) => {
            std::fs::write(&out, words).unwrap();
            0
        }
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}
