//! A pool of rank processes that runs whole plans one process per device
//! ([`RankPool`], `cargo xtask conformance --backend cuda --processes`): it implements
//! [`CudaExecutor`], so the conformance corpus, its goldens and its checks run unchanged
//! while every device of every case runs in a process of its own
//! ([`crate::CudaBackend::run_rank`]).
//!
//! The workers are long-lived copies of a program that calls [`serve_rank_worker`] (the
//! xtask binary's hidden `rank-worker` command), started as a case first needs them; each
//! opens the CUDA backend once. Per run the pool writes the plan file, sends each rank one
//! line on its stdin (`run`, the plan's path, the seed and family, the rendezvous, the
//! options) and reads one line back (`ok` with the timing and engine counts, or `err`
//! with the message); each rank writes its device's buffers to a file the pool reads.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cmm_core::generator::Family;
use cmm_core::plan::Plan;

use crate::backend::{prepare, CudaBackend};
use crate::error::CudaError;
use crate::lower::{GemmCounts, GemmEngine, HopperTile, HopperVariant, SyncMode};
use crate::options::{CopyIssue, CudaRunOptions, CudaRunOutput, ReadBack};
use crate::rank::Rendezvous;
use crate::CudaExecutor;

/// Starts one worker process (a program that calls [`serve_rank_worker`]).
pub type WorkerCommand = Box<dyn Fn() -> Command + Send + Sync>;

/// Runs each device of a plan in a worker process of its own.
pub struct RankPool {
    command: WorkerCommand,
    workers: Mutex<Vec<Worker>>,
    dir: PathBuf,
    runs: AtomicU64,
    meeting_timeout: Duration,
    answer_slack: Duration,
}

/// How long a rank waits for the others at each meeting, unless set
/// ([`RankPool::with_meeting_timeout`]).
const MEETING_TIMEOUT: Duration = Duration::from_secs(30);

/// Beyond its ranks' own deadlines, how long the pool waits for an answer before it stops a
/// worker as hung (a fresh worker opens its backend in it).
const ANSWER_SLACK: Duration = Duration::from_secs(30);

impl std::fmt::Debug for RankPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankPool").field("dir", &self.dir).finish()
    }
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    /// Whether the worker has begun to answer by `deadline` (its stdout is readable).
    fn answers_by(&self, deadline: Instant) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use std::os::fd::AsFd;
        if !self.stdout.buffer().is_empty() {
            return true;
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = PollTimeout::try_from(left.as_millis().min(i32::MAX as u128) as i32).unwrap_or(PollTimeout::MAX);
            let mut fds = [PollFd::new(self.stdout.get_ref().as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, ms) {
                Ok(0) => return false,
                // Readable, or closed (the read then sees the end).
                Ok(_) => return true,
                Err(nix::errno::Errno::EINTR) if Instant::now() < deadline => continue,
                Err(_) => return true,
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing stdin ends the worker's loop; then reap it.
        let _ = self.stdin.flush();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn pool_error(what: impl Into<String>) -> CudaError {
    CudaError::Ranks { failures: vec![(None, what.into())] }
}

impl RankPool {
    /// A pool whose workers `command` starts, with its files under a fresh directory of
    /// the system's temporary one.
    pub fn new(command: WorkerCommand) -> Result<RankPool, CudaError> {
        static POOLS: AtomicU64 = AtomicU64::new(0);
        let pool = POOLS.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("cmm-ranks-{}-{pool}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| pool_error(format!("creating {}: {e}", dir.display())))?;
        Ok(RankPool {
            command,
            workers: Mutex::new(Vec::new()),
            dir,
            runs: AtomicU64::new(0),
            meeting_timeout: MEETING_TIMEOUT,
            answer_slack: ANSWER_SLACK,
        })
    }

    /// The same pool with `timeout` for each meeting of the ranks (30 s by default).
    pub fn with_meeting_timeout(mut self, timeout: Duration) -> RankPool {
        self.meeting_timeout = timeout;
        self
    }

    /// The longest a run's ranks may take to answer: three meetings, the run and its
    /// drain, and some slack. A worker that has not answered by then is stopped.
    fn answer_limit(&self, options: &CudaRunOptions) -> Duration {
        // Saturating, though `prepare` has refused deadlines past a day before any run.
        self.meeting_timeout
            .saturating_mul(3)
            .saturating_add(options.run_timeout)
            .saturating_add(options.wait_timeout.saturating_mul(2))
            .saturating_add(self.answer_slack)
    }

    fn spawn(&self) -> Result<Worker, CudaError> {
        let mut child = (self.command)()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| pool_error(format!("starting a rank worker: {e}")))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        Ok(Worker { child, stdin, stdout })
    }
}

impl Drop for RankPool {
    fn drop(&mut self) {
        self.workers.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The options a rank runs with, as one line's words (those a rank can use).
fn options_words(o: &CudaRunOptions) -> String {
    let sync = match o.sync {
        SyncMode::Kernels => "kernels",
        SyncMode::StreamMemOps => "memops",
    };
    let gemm = match o.gemm {
        GemmEngine::TileKernel => "tile",
        GemmEngine::Cublas => "cublas",
        GemmEngine::Auto => "auto",
        GemmEngine::Hopper => "hopper",
    };
    let tile = match o.hopper_tile {
        None => "rule",
        Some(HopperTile::Wide) => "wide",
        Some(HopperTile::Narrow) => "narrow",
    };
    let variant = o.hopper_variant.key();
    let copies = o.copies.key();
    let read_back = match o.read_back {
        ReadBack::Nothing => "nothing",
        ReadBack::Everything => "everything",
        ReadBack::Results => "results",
    };
    let free = o.fused_free_sms.map_or("-".to_string(), |f| f.to_string());
    format!(
        "{sync} {gemm} {} {} {} {} {} {} {tile} {variant} {} {free} {read_back} {} {copies}",
        o.wait_timeout.as_millis(),
        o.run_timeout.as_millis(),
        u8::from(o.gate),
        u8::from(o.comm_priority),
        u8::from(o.wide_tiles),
        u8::from(o.hopper),
        o.fused_ctas_per_sm,
        u8::from(o.cold_l2),
    )
}

fn parse_options(words: &[&str]) -> Option<CudaRunOptions> {
    let [sync, gemm, wait, run, gate, priority, wide, hopper, tile, variant, ctas, free, read_back, cold, copies] =
        words
    else {
        return None;
    };
    let flag = |w: &str| match w {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    };
    Some(CudaRunOptions {
        sync: match *sync {
            "kernels" => SyncMode::Kernels,
            "memops" => SyncMode::StreamMemOps,
            _ => return None,
        },
        gemm: match *gemm {
            "tile" => GemmEngine::TileKernel,
            "cublas" => GemmEngine::Cublas,
            "auto" => GemmEngine::Auto,
            "hopper" => GemmEngine::Hopper,
            _ => return None,
        },
        wait_timeout: Duration::from_millis(wait.parse().ok()?),
        run_timeout: Duration::from_millis(run.parse().ok()?),
        gate: flag(gate)?,
        comm_priority: flag(priority)?,
        wide_tiles: flag(wide)?,
        hopper: flag(hopper)?,
        hopper_tile: match *tile {
            "rule" => None,
            "wide" => Some(HopperTile::Wide),
            "narrow" => Some(HopperTile::Narrow),
            _ => return None,
        },
        hopper_variant: HopperVariant::parse(variant).ok()?,
        fused_ctas_per_sm: ctas.parse().ok()?,
        fused_free_sms: match *free {
            "-" => None,
            free => Some(free.parse().ok()?),
        },
        read_back: match *read_back {
            "nothing" => ReadBack::Nothing,
            "everything" => ReadBack::Everything,
            "results" => ReadBack::Results,
            _ => return None,
        },
        cold_l2: flag(cold)?,
        copies: CopyIssue::parse(copies).ok()?,
        ..CudaRunOptions::default()
    })
}

/// One line, without its newlines (messages keep theirs as `\n`).
fn one_line(text: &str) -> String {
    text.replace('\\', "\\\\").replace('\n', "\\n")
}

fn from_line(text: &str) -> String {
    text.replace("\\n", "\n").replace("\\\\", "\\")
}

impl CudaExecutor for RankPool {
    fn describe(&self) -> String {
        "cuda, one process per device (rank workers on GPU 0)".into()
    }

    fn run(
        &self,
        plan: &Plan,
        seed: u32,
        family: Family,
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError> {
        let start = Instant::now();
        // What can be decided before any process runs is decided here, with its type
        // (a deadlock, a malformed plan or routing table, an unsafe enqueue order).
        prepare(plan, seed, options, crate::cublas_present(), None)?;
        if plan.devices > crate::rank::MAX_RANKS {
            return Err(pool_error(format!("{} devices; a rendezvous takes {}", plan.devices, crate::rank::MAX_RANKS)));
        }
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        while workers.len() < plan.devices {
            workers.push(self.spawn()?);
        }
        let run = self.runs.fetch_add(1, Ordering::Relaxed);
        let plan_path = self.dir.join(format!("run{run}.plan.json"));
        std::fs::write(&plan_path, plan.to_file_json())
            .map_err(|e| pool_error(format!("writing {}: {e}", plan_path.display())))?;
        let socket = self.dir.join(format!("run{run}.sock"));
        let out_of = |rank: usize| self.dir.join(format!("run{run}.rank{rank}.bin"));
        let words = options_words(options);
        let mut failures = Vec::new();
        for (rank, worker) in workers.iter_mut().enumerate().take(plan.devices) {
            let request = format!(
                "run\t{}\t{seed}\t{}\t{rank}\t{}\t{}\t{}\t{}\t{words}\n",
                plan_path.display(),
                family.code(),
                plan.devices,
                socket.display(),
                self.meeting_timeout.as_millis(),
                out_of(rank).display()
            );
            if let Err(e) = worker.stdin.write_all(request.as_bytes()).and_then(|()| worker.stdin.flush()) {
                failures.push((Some(rank), format!("its worker process cannot take work ({e})")));
            }
        }
        let mut output = CudaRunOutput {
            buffers: vec![Vec::new(); plan.devices],
            gpu_time: Duration::ZERO,
            gated: true,
            gemms: GemmCounts::default(),
            comm_priority: None,
            staggered: Vec::new(),
            offset_starts: false,
            op_times: Vec::new(),
            fused_waits: Vec::new(),
            elapsed: Duration::ZERO,
        };
        let mut dead = Vec::new();
        let limit = self.answer_limit(options);
        let deadline = start + limit;
        for (rank, worker) in workers.iter_mut().enumerate().take(plan.devices) {
            if failures.iter().any(|(r, _)| *r == Some(rank)) {
                dead.push(rank);
                continue;
            }
            if !worker.answers_by(deadline) {
                failures.push((Some(rank), format!("its worker gave no answer within {limit:?}; it was stopped")));
                dead.push(rank);
                continue;
            }
            let mut line = String::new();
            match worker.stdout.read_line(&mut line) {
                Ok(0) | Err(_) => {
                    failures.push((Some(rank), "its worker process ended".into()));
                    dead.push(rank);
                }
                Ok(_) => {
                    let fields: Vec<&str> = line.trim_end_matches('\n').split('\t').collect();
                    match fields.as_slice() {
                        ["ok", nanos, gated, cublas, tile, hopper, clusters, staged] => {
                            let number = |w: &str| w.parse::<u64>().unwrap_or(0);
                            output.gpu_time = output.gpu_time.max(Duration::from_nanos(number(nanos)));
                            output.gated &= *gated == "1";
                            output.gemms += GemmCounts {
                                cublas: number(cublas) as usize,
                                tile: number(tile) as usize,
                                hopper: number(hopper) as usize,
                                clusters: number(clusters) as usize,
                                staged: number(staged) as usize,
                            };
                            match read_buffers(&out_of(rank), plan) {
                                Ok(buffers) => output.buffers[rank] = buffers,
                                Err(e) => failures.push((Some(rank), e)),
                            }
                        }
                        ["err", message] => failures.push((Some(rank), from_line(message))),
                        _ => failures.push((Some(rank), format!("an answer that is not one: {line:?}"))),
                    }
                }
            }
            let _ = std::fs::remove_file(out_of(rank));
        }
        // A worker that failed to answer is replaced before the next run.
        for rank in dead.into_iter().rev() {
            workers.remove(rank);
        }
        let _ = std::fs::remove_file(&plan_path);
        let _ = std::fs::remove_file(&socket);
        if !failures.is_empty() {
            return Err(CudaError::Ranks { failures });
        }
        output.elapsed = start.elapsed();
        Ok(output)
    }
}

/// A rank's device buffers as its worker wrote them: per buffer, its word count (u64)
/// and its words (u32), little-endian.
fn read_buffers(path: &Path, plan: &Plan) -> Result<Vec<Vec<u32>>, String> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| format!("reading its buffers ({}): {e}", path.display()))?;
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let slice = bytes.get(at..at + n).ok_or_else(|| format!("{} ends early", path.display()))?;
        at += n;
        Ok(slice)
    };
    let mut buffers = Vec::with_capacity(plan.buffers.len());
    for decl in &plan.buffers {
        let count = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes")) as usize;
        if count != 0 && count != decl.len() {
            return Err(format!("buffer `{}` came back with {count} elements, not {}", decl.name, decl.len()));
        }
        let words = take(4 * count)?;
        buffers.push(words.chunks_exact(4).map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes"))).collect());
    }
    Ok(buffers)
}

fn write_buffers(path: &Path, buffers: &[Vec<u32>]) -> std::io::Result<()> {
    let mut bytes = Vec::new();
    for words in buffers {
        bytes.extend_from_slice(&(words.len() as u64).to_le_bytes());
        for w in words {
            bytes.extend_from_slice(&w.to_le_bytes());
        }
    }
    std::fs::write(path, bytes)
}

/// A rank worker's loop: opens the CUDA backend (GPU 0), then runs one rank per request
/// line of stdin and answers each with one line on stdout, until stdin closes. The
/// program that calls it must print nothing else on stdout.
pub fn serve_rank_worker() -> Result<(), CudaError> {
    let backend = CudaBackend::new(1);
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    for line in stdin.lock().lines() {
        let line = line.map_err(|e| pool_error(format!("reading a request: {e}")))?;
        let answer = serve_one(&backend, &line).unwrap_or_else(|e| format!("err\t{}", one_line(&e)));
        writeln!(stdout, "{answer}").and_then(|()| stdout.flush()).map_err(|e| pool_error(e.to_string()))?;
    }
    Ok(())
}

fn serve_one(backend: &Result<CudaBackend, CudaError>, line: &str) -> Result<String, String> {
    let backend = backend.as_ref().map_err(|e| format!("the CUDA backend did not start: {e}"))?;
    let fields: Vec<&str> = line.split('\t').collect();
    let ["run", plan_path, seed, family, rank, world, socket, meeting_ms, out, options] = fields.as_slice() else {
        return Err(format!("not a request: {line:?}"));
    };
    let bad = |what: &str| format!("a request with a bad {what}: {line:?}");
    let options = parse_options(&options.split(' ').collect::<Vec<_>>()).ok_or_else(|| bad("option"))?;
    let family = match *family {
        "0" => Family::Exact,
        "1" => Family::Realistic,
        _ => return Err(bad("family")),
    };
    let text = std::fs::read_to_string(plan_path).map_err(|e| format!("reading {plan_path}: {e}"))?;
    let plan = Plan::from_file_json(&text).map_err(|e| e.to_string())?;
    let rendezvous = Rendezvous {
        rank: rank.parse().map_err(|_| bad("rank"))?,
        world: world.parse().map_err(|_| bad("world"))?,
        socket: PathBuf::from(socket),
        timeout: Duration::from_millis(meeting_ms.parse().map_err(|_| bad("meeting timeout"))?),
    };
    let seed = seed.parse().map_err(|_| bad("seed"))?;
    let run = backend.run_rank(&plan, &rendezvous, seed, family, &options).map_err(|e| e.to_string())?;
    write_buffers(Path::new(out), &run.buffers[rendezvous.rank]).map_err(|e| format!("writing {out}: {e}"))?;
    Ok(format!(
        "ok\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
        run.gpu_time.as_nanos(),
        u8::from(run.gated),
        run.gemms.cublas,
        run.gemms.tile,
        run.gemms.hopper,
        run.gemms.clusters,
        run.gemms.staged
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker that never answers is stopped at the pool's deadline, and the run fails
    /// naming its rank rather than hanging.
    #[test]
    fn a_worker_that_never_answers_is_stopped_at_the_deadline() {
        let pool = RankPool::new(Box::new(|| {
            let mut silent = Command::new("sleep");
            silent.arg("600");
            silent
        }))
        .unwrap()
        .with_meeting_timeout(Duration::from_millis(100));
        let mut pool = pool;
        pool.answer_slack = Duration::from_millis(500);
        let options = CudaRunOptions {
            run_timeout: Duration::from_millis(200),
            wait_timeout: Duration::from_millis(100),
            ..Default::default()
        };
        let p =
            cmm_core::Problem::new(cmm_core::OpKind::AgGemm, 2, 8, 4, 4, cmm_core::DType::F32, cmm_core::DType::F32)
                .unwrap();
        let plan = cmm_core::build_plan(&p, cmm_core::Algorithm::Ring).unwrap();
        let start = Instant::now();
        let e = pool.run(&plan, 1, Family::Exact, &options).unwrap_err().to_string();
        let took = start.elapsed();
        assert!(e.contains("rank 0: its worker gave no answer within") && e.contains("rank 1:"), "{e}");
        assert!(took < pool.answer_limit(&options) + Duration::from_secs(5), "{took:?}");
        // The stopped workers are replaced: the next run starts fresh ones (and fails the same way).
        assert!(pool.run(&plan, 1, Family::Exact, &options).is_err());
    }

    #[test]
    fn options_survive_the_line() {
        let options = CudaRunOptions {
            sync: SyncMode::StreamMemOps,
            gemm: GemmEngine::TileKernel,
            wait_timeout: Duration::from_millis(1234),
            gate: false,
            wide_tiles: true,
            hopper_tile: Some(HopperTile::Narrow),
            hopper_variant: HopperVariant::Shallow,
            fused_ctas_per_sm: 2,
            fused_free_sms: Some(16),
            read_back: ReadBack::Results,
            copies: CopyIssue::PreferCopyEngines,
            ..Default::default()
        };
        let words = options_words(&options);
        let back = parse_options(&words.split(' ').collect::<Vec<_>>()).unwrap();
        assert_eq!(options_words(&back), words);
        assert_eq!(
            (back.sync, back.wait_timeout, back.read_back),
            (SyncMode::StreamMemOps, options.wait_timeout, ReadBack::Results)
        );
        assert_eq!((back.fused_free_sms, back.hopper_variant), (Some(16), HopperVariant::Shallow));
        assert_eq!(back.copies, CopyIssue::PreferCopyEngines);
        let default = options_words(&CudaRunOptions::default());
        assert_eq!(parse_options(&default.split(' ').collect::<Vec<_>>()).unwrap().fused_free_sms, None);
        assert!(parse_options(&["kernels"]).is_none());
        assert_eq!(from_line(&one_line("a\\b\nc")), "a\\b\nc");
    }
}
