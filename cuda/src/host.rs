//! The host twin of the CUDA backend: the kernels of `cuda/kernels/*.cu`, compiled with
//! the system C++ compiler against a CPU runtime (`cuda/host/runtime.h`), run the
//! lowered plan with one OS thread per stream, or through emulated FIFO hardware queues
//! ([`HostFeed`]).
//!
//! Everything but the driver is the GPU path's own: [`crate::lower`] decides the
//! enqueue order and every command, `launch.rs` resolves them to the same kernel
//! launches with the same parameter structs, and the same kernel sources run, block by
//! block with every thread a fiber (so `__syncthreads` and the warp-collective mma are
//! real rendezvous), their semaphores real atomics, their waits real spins with
//! deadlines and the abort word. Guard bytes around every buffer turn a write past it
//! into [`CudaError::OutOfBounds`] and a read of them into NaN. What it cannot show:
//! tensor-core rounding (the mma twin sums exact products in k order), the memory model
//! of a GPU (the host's is stronger), the driver calls, and timing. A kernel that writes
//! far outside its buffers can crash the process, as it would fault a GPU context.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use cmm_core::generator::Family;
use cmm_core::plan::OpSite;
use cmm_core::Plan;

use crate::backend::{prepare, prepare_in_order};
use crate::cpp::{build, cache_dir, compiler, host_source, Mode};
use crate::error::CudaError;
use crate::launch::{
    buffer_fill, fused_launch, fused_table, host_tensor_map, released_waits, submissions, timed_out_wait, Addressing,
    ControlLayout, Fill, Kernel, Launch, RunWords, Submission, TensorMap, TensorMapSpec,
};
use crate::lower::{Command, Loc, Lowered};
use crate::options::{CudaRunOptions, CudaRunOutput};
use crate::CudaExecutor;

/// Blocks of a tile-granular GEMM on the host: several, so that the tile scheduler, the
/// per-block counters and the ordered release really run concurrently.
const HOST_FUSED_CTAS: u32 = 3;

/// The Hopper engine as the host twin runs it: a persistent grid of [`HOST_FUSED_CTAS`]
/// CTAs, where the run asks for the engine.
fn host_hopper(options: &CudaRunOptions) -> Option<crate::lower::HopperTarget> {
    options.asks_hopper().then_some(crate::lower::HopperTarget {
        sms: HOST_FUSED_CTAS,
        // The twin runs a cluster's CTAs as fibers of one scheduler: as many as the grid.
        pair_clusters: [HOST_FUSED_CTAS / 2; 2],
        tile: options.hopper_tile,
        variant: options.hopper_variant,
    })
}

/// runtime.h's `REVERSED_ROUNDS`: the mode's flag for [`FiberOrder::LastToFirst`].
const REVERSED_ROUNDS: u32 = 0x10;

/// `extern "C" int cmm_host_<entry>(grid, block, mode, params, error, error_len)`.
type Entry = unsafe extern "C" fn(*const u32, *const u32, u32, *mut *mut std::ffi::c_void, *mut u8, u64) -> i32;

/// The kernels compiled for the host and loaded.
struct HostKernels {
    entries: Vec<Entry>,
    // Keeps the entries' code mapped.
    _library: libloading::Library,
}

fn load() -> Result<HostKernels, CudaError> {
    load_from(&host_source(), "cmm-host", &[])
}

/// Builds `source` (a [`host_source`], or a variant of it in tests) as `<stem>-<key>.so`
/// in the cache and loads its launchers.
fn load_from(source: &str, stem: &str, extra: &[&str]) -> Result<HostKernels, CudaError> {
    let path = build(&compiler(), source, &cache_dir(), stem, extra)?;
    let fail = |message: String| CudaError::HostBuild { compiler: compiler(), message, log: String::new() };
    // SAFETY: the library is the one just built from the project's own sources; loading
    // it runs only the C++ runtime's static initialisers.
    #[allow(unsafe_code)]
    let library =
        unsafe { libloading::Library::new(&path) }.map_err(|e| fail(format!("loading {}: {e}", path.display())))?;
    let mut entries = Vec::with_capacity(Kernel::ALL.len());
    for kernel in Kernel::ALL {
        let name = format!("cmm_host_{}", kernel.entry());
        // SAFETY: every launcher is defined by `host_source` with exactly `Entry`'s
        // signature; the pointer is used only while `library` is alive (it is kept
        // in the same struct, in a static).
        #[allow(unsafe_code)]
        let entry = unsafe { library.get::<Entry>(name.as_bytes()) }
            .map_err(|e| fail(format!("{name} is missing from {}: {e}", path.display())))?;
        entries.push(*entry);
    }
    Ok(HostKernels { entries, _library: library })
}

impl HostKernels {
    /// Built and loaded once per process.
    fn get() -> Result<&'static HostKernels, CudaError> {
        static KERNELS: OnceLock<Result<HostKernels, (String, String, String)>> = OnceLock::new();
        let loaded = KERNELS.get_or_init(|| {
            load().map_err(|e| match e {
                CudaError::HostBuild { compiler, message, log } => (compiler, message, log),
                other => (compiler(), other.to_string(), String::new()),
            })
        });
        loaded.as_ref().map_err(|(compiler, message, log)| CudaError::HostBuild {
            compiler: compiler.clone(),
            message: message.clone(),
            log: log.clone(),
        })
    }

    /// Runs `l` to completion on this thread (a persistent kernel's blocks on threads of
    /// their own).
    fn launch(&self, l: &Launch) -> Result<(), CudaError> {
        self.launch_ordered(l, FiberOrder::FirstToLast)
    }

    /// The same, its blocks' fibers resumed in `order`.
    fn launch_ordered(&self, l: &Launch, order: FiberOrder) -> Result<(), CudaError> {
        self.launch_in(l, Mode::of(l.kernel), order)
    }

    fn launch_in(&self, l: &Launch, mode: Mode, order: FiberOrder) -> Result<(), CudaError> {
        let mut params: Vec<*mut std::ffi::c_void> = l.params.iter().map(|p| p.as_ptr()).collect();
        let grid = [l.cfg.grid_dim.0, l.cfg.grid_dim.1, l.cfg.grid_dim.2];
        let block = [l.cfg.block_dim.0, l.cfg.block_dim.1, l.cfg.block_dim.2];
        let mut error = [0u8; 256];
        // SAFETY: the launcher reads one parameter per pointer, each pointing at a live
        // value of the kernel's parameter type (`Param` holds the `#[repr(C)]` mirrors);
        // the addresses inside point into the run's host allocations, sized by the plan
        // that lowering checked; `error` is writable for its length.
        #[allow(unsafe_code)]
        let status = unsafe {
            (self.entries[l.kernel.index()])(
                grid.as_ptr(),
                block.as_ptr(),
                // The fiber order rides beside the mode, the cluster size above it
                // (runtime.h `launch`).
                mode as u32 | order.mode_bits() | l.kernel.cluster() << 8,
                params.as_mut_ptr(),
                error.as_mut_ptr(),
                error.len() as u64,
            )
        };
        if status == 0 {
            return Ok(());
        }
        let end = error.iter().position(|&b| b == 0).unwrap_or(error.len());
        Err(CudaError::HostKernel {
            kernel: l.kernel.entry(),
            what: l.what,
            message: String::from_utf8_lossy(&error[..end]).into_owned(),
        })
    }
}

/// Host memory of a run: per device one heap holding every buffer (256-byte aligned)
/// and its semaphore words; atomics, because kernels on other threads write them.
/// Unlike the GPU's, the heap puts a guard of canary bytes before every buffer and
/// after the last, checked after the run, so a kernel that writes past a buffer is an
/// error rather than a silently corrupted neighbour, and one that reads past it reads NaN.
struct HostMemory {
    // Owns the memory `base` points into.
    heaps: Vec<Box<[AtomicU64]>>,
    semaphores: Vec<Box<[AtomicU64]>>,
    base: Vec<Vec<u64>>,
    /// Per device, the heap's first (256-aligned) byte.
    start: Vec<u64>,
    /// Per region (the plan's buffers, then the lowering's staging), its offset; then the
    /// heap's length.
    offsets: Vec<usize>,
    /// Per region, its name in errors and its bytes.
    regions: Vec<(String, usize)>,
}

/// Bytes of canary before each buffer and after the last.
const GUARD: usize = 256;
/// The canary byte: all ones, a NaN as f32, f16 and bf16 alike, so that a kernel that
/// reads a guard also spoils what it computes (NaN never passes the oracle).
const CANARY_BYTE: u8 = 0xff;

impl Addressing for HostMemory {
    fn addr(&self, l: &Loc) -> u64 {
        self.base[l.device][l.buffer] + l.offset
    }

    fn sem(&self, device: usize, sem: usize) -> u64 {
        self.semaphores[device].as_ptr() as u64 + 4 * sem as u64
    }

    fn tensor_map(&self, spec: &TensorMapSpec) -> Result<TensorMap, CudaError> {
        Ok(host_tensor_map(spec))
    }
}

fn zeroed_words<T: Default>(count: usize) -> Box<[T]> {
    (0..count).map(|_| T::default()).collect()
}

impl HostMemory {
    /// Every device's heap: the plan's buffers, then the lowering's staging regions
    /// (`staging`, [`Lowered::staging`], each in every device's heap), each behind a guard.
    fn allocate(plan: &Plan, staging: &[crate::lower::Staging]) -> HostMemory {
        let align = |x: usize| x.div_ceil(256) * 256;
        let buffers = plan.buffers.iter().map(|b| (b.name.clone(), b.len() * b.dtype.size_bytes()));
        let staging = staging.iter().map(|s| (format!("the staging of stream {}", s.stream), s.bytes as usize));
        let regions: Vec<(String, usize)> = buffers.chain(staging).collect();
        let mut offsets = Vec::with_capacity(regions.len() + 1);
        let mut total = 0usize;
        for (_, bytes) in &regions {
            total += GUARD;
            offsets.push(total);
            total += align(*bytes);
        }
        total += GUARD;
        offsets.push(total);
        let (mut heaps, mut semaphores, mut base, mut start) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..plan.devices {
            // Spare words so that the heap's start can be rounded up to 256 bytes.
            let heap: Box<[AtomicU64]> =
                (0..total / 8 + 32).map(|_| AtomicU64::new(u64::from_ne_bytes([CANARY_BYTE; 8]))).collect();
            let first = (heap.as_ptr() as u64).div_ceil(256) * 256;
            base.push(offsets[..regions.len()].iter().map(|&o| first + o as u64).collect());
            start.push(first);
            heaps.push(heap);
            // Semaphores as u32 words, two per u64.
            semaphores.push(zeroed_words(plan.semaphores.len().div_ceil(2).max(1)));
        }
        HostMemory { heaps, semaphores, base, start, offsets, regions }
    }

    /// The first region (buffer or staging) whose guard a kernel overwrote: the bytes
    /// after it up to the next region (or the heap's end), and before buffer 0.
    fn check_guards(&self, plan: &Plan) -> Result<(), CudaError> {
        let total = *self.offsets.last().expect("the heap's length");
        for (d, first) in self.start.iter().enumerate() {
            debug_assert!(self.heaps[d].len() * 8 >= total);
            // SAFETY: the heap holds `total` bytes from `first` (allocated with spare words
            // for the alignment), and every thread that wrote it has been joined.
            #[allow(unsafe_code)]
            let heap = unsafe { std::slice::from_raw_parts(*first as *const u8, total) };
            let spoiled = |range: std::ops::Range<usize>| heap[range.clone()].iter().position(|&b| b != CANARY_BYTE);
            let out_of_bounds = |region: usize, detail: String| CudaError::OutOfBounds {
                plan: plan.name.clone(),
                device: d,
                buffer: self.regions[region].0.clone(),
                detail,
            };
            if let Some(at) = spoiled(0..self.offsets[0]) {
                return Err(out_of_bounds(0, format!("{} bytes before its start", self.offsets[0] - at)));
            }
            for (i, (_, bytes)) in self.regions.iter().enumerate() {
                if let Some(at) = spoiled(self.offsets[i] + bytes..self.offsets[i + 1]) {
                    return Err(out_of_bounds(i, format!("at byte {at} after its end")));
                }
            }
        }
        Ok(())
    }

    fn read_back(&self, plan: &Plan, which: crate::ReadBack) -> Vec<Vec<Vec<u32>>> {
        if which == crate::ReadBack::Nothing {
            return Vec::new();
        }
        (0..plan.devices)
            .map(|d| {
                plan.buffers
                    .iter()
                    .enumerate()
                    .map(|(i, b)| {
                        if !which.wants(b) {
                            return Vec::new();
                        }
                        let len = b.len() * b.dtype.size_bytes();
                        // SAFETY: the buffer lies inside device d's heap (the layout that
                        // sized it), and every thread that wrote it has been joined.
                        #[allow(unsafe_code)]
                        let bytes = unsafe { std::slice::from_raw_parts(self.base[d][i] as *const u8, len) };
                        b.dtype.words_from_le(bytes, b.len())
                    })
                    .collect()
            })
            .collect()
    }
}

/// The run's control words, laid out as the GPU's ([`ControlLayout`]).
struct HostControl {
    words: Box<[AtomicU32]>,
}

impl HostControl {
    fn new(waits: usize) -> HostControl {
        HostControl { words: zeroed_words(ControlLayout::words(waits)) }
    }

    fn words(&self, wait_timeout: Duration) -> RunWords {
        RunWords::at(self.words.as_ptr() as u64, wait_timeout)
    }

    fn abort(&self) {
        self.words[ControlLayout::ABORT].store(1, Ordering::SeqCst);
    }

    fn aborted(&self) -> bool {
        self.words[ControlLayout::ABORT].load(Ordering::SeqCst) != 0
    }

    fn status(&self, slot: usize) -> (u32, u32) {
        let w = ControlLayout::status(slot);
        (self.words[w].load(Ordering::SeqCst), self.words[w + 1].load(Ordering::SeqCst))
    }
}

/// How the host twin feeds its streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HostFeed {
    /// A thread per stream: each stream runs as soon as its own order allows (a GPU with
    /// a hardware queue per stream).
    #[default]
    Streams,
    /// The GPU's FIFO hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`), emulated: stream
    /// `s` feeds queue `(s + offset) mod queues`, in enqueue order; a queue starts its head
    /// once the head's stream has finished everything before it (then moves on, so
    /// kernels of different streams in one queue overlap), and a stream-memory-op wait
    /// holds its queue until it is satisfied. The execution side of the model that
    /// [`cmm_core::verify::queues`] checks statically.
    Queues {
        /// Hardware queues.
        queues: usize,
        /// The round-robin offset of stream 0.
        offset: usize,
    },
}

/// The order in which each round of a block's fiber scheduler resumes its threads. Any
/// order is one a GPU may take; each finds the hazards the others' head starts hide (in
/// the first, the producer's first thread fills every stage before a consumer looks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FiberOrder {
    /// Thread 0 first.
    #[default]
    FirstToLast,
    /// The block's last thread first (`REVERSED_ROUNDS` in host/runtime.h).
    LastToFirst,
    /// A permutation drawn afresh each round from this seed (0 is taken as 1): threads
    /// overtake each other in ways neither fixed order shows.
    Shuffled(u16),
}

impl FiberOrder {
    /// Its bits beside a launch's mode (host/runtime.h `launch`): the reversed flag, and
    /// a shuffle's seed in the top 16 bits.
    fn mode_bits(self) -> u32 {
        match self {
            FiberOrder::FirstToLast => 0,
            FiberOrder::LastToFirst => REVERSED_ROUNDS,
            FiberOrder::Shuffled(seed) => u32::from(seed.max(1)) << 16,
        }
    }
}

/// The CUDA backend's kernels and lowering, run on the CPU.
#[derive(Clone, Copy)]
pub struct HostTwin {
    kernels: &'static HostKernels,
    feed: HostFeed,
    order: FiberOrder,
}

impl std::fmt::Debug for HostTwin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTwin")
            .field("compiler", &compiler())
            .field("kernels", &self.kernels.entries.len())
            .field("feed", &self.feed)
            .field("order", &self.order)
            .finish()
    }
}

impl HostTwin {
    /// Builds (or finds in the cache) and loads the host kernels.
    pub fn new() -> Result<HostTwin, CudaError> {
        Ok(HostTwin { kernels: HostKernels::get()?, feed: HostFeed::Streams, order: FiberOrder::FirstToLast })
    }

    /// The same twin, feeding its streams as `feed` says.
    pub fn with_feed(self, feed: HostFeed) -> HostTwin {
        HostTwin { feed, ..self }
    }

    /// The same twin, its blocks' fibers resumed in `order`.
    pub fn with_fiber_order(self, order: FiberOrder) -> HostTwin {
        HostTwin { order, ..self }
    }

    /// Runs `plan` enqueued in `order` (every op once, each lane in program order), which
    /// lowering first proves unable to hang on `check_queues` hardware queues; see
    /// [`CudaExecutor::run`].
    pub fn run_in_order(
        &self,
        plan: &Plan,
        order: &[OpSite],
        check_queues: usize,
        seed: u32,
        family: Family,
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError> {
        let lowered =
            prepare_in_order(plan, Some(seed), options, false, host_hopper(options), Some((order, check_queues)))?;
        self.run_lowered(plan, &lowered, seed, family, options)
    }

    /// One line for reports.
    pub fn summary(&self) -> String {
        format!("the CUDA kernels and lowering on the CPU (host twin, compiled by `{}`)", compiler())
    }
}

impl CudaExecutor for HostTwin {
    fn describe(&self) -> String {
        self.summary()
    }

    /// The twin runs the Hopper engine's kernels (host/hopper.h).
    fn has_hopper_engine(&self) -> bool {
        true
    }

    /// Runs `plan` as the CUDA backend would (placement and cuBLAS aside: GEMMs run on
    /// the tile kernels, and [`crate::GemmEngine::Cublas`] is refused as on a machine
    /// without libcublas).
    fn run(
        &self,
        plan: &Plan,
        seed: u32,
        family: Family,
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError> {
        // The twin runs a persistent kernel's blocks on threads, not on SMs: a count per SM
        // it cannot honour is refused rather than passed as if checked.
        let per_sm = (options.fused_ctas_per_sm != 1).then(|| format!("{} CTAs per SM", options.fused_ctas_per_sm));
        let free = options.fused_free_sms.map(|f| format!("{f} SMs left free"));
        if let Some(asked) = per_sm.or(free) {
            return Err(CudaError::Unsupported {
                plan: plan.name.clone(),
                what: format!("{asked}: the host twin has no SMs (run it on the GPU or the fake driver)"),
            });
        }
        let offset = crate::backend::emulated(plan, options)?;
        let plan = offset.as_ref().unwrap_or(plan);
        let lowered = match self.feed {
            // Emulated queues: the hang check proves the order for as many as it emulates
            // (a plan whose persistent kernels wait for each other needs one a stream).
            HostFeed::Queues { queues, .. } => {
                let order = cmm_core::schedule::schedule(plan)?.order;
                let hopper = host_hopper(options);
                crate::backend::prepare_in_order(plan, Some(seed), options, false, hopper, Some((&order, queues)))?
            }
            _ => prepare(plan, seed, options, false, host_hopper(options))?,
        };
        let mut out = self.run_lowered(plan, &lowered, seed, family, options)?;
        out.offset_starts = offset.is_some();
        Ok(out)
    }
}

impl HostTwin {
    fn run_lowered(
        &self,
        plan: &Plan,
        lowered: &Lowered,
        seed: u32,
        family: Family,
        options: &CudaRunOptions,
    ) -> Result<CudaRunOutput, CudaError> {
        let start = Instant::now();
        let memory = HostMemory::allocate(plan, &lowered.staging);
        fill_inputs(self.kernels, plan, &memory, seed, family)?;
        let control = HostControl::new(lowered.wait_slots.len());
        let words = control.words(options.wait_timeout);
        // The fused GEMMs' tables live as long as the run.
        let (ordered, tables) = stream_work(lowered, &memory, &words)?;
        let shared = Shared {
            kernels: self.kernels,
            order: self.order,
            plan,
            control: &control,
            options,
            first_error: Mutex::new(None),
        };
        let began = Instant::now();
        let (first_error, timed_out) = run_feed(shared, self.feed, &ordered, lowered.streams);
        let elapsed_run = began.elapsed();
        if let Some(e) = first_error {
            return Err(e);
        }
        if timed_out {
            return Err(CudaError::RunTimeout {
                plan: plan.name.clone(),
                limit_ms: options.run_timeout.as_millis() as u64,
                pending: released_waits(plan, lowered, |slot| control.status(slot))
                    .unwrap_or_else(|| "the streams did not finish on the host".into()),
            });
        }
        if let Some(e) = timed_out_wait(plan, lowered, |slot| control.status(slot), options.wait_timeout) {
            return Err(e);
        }
        let fused_waits = lowered
            .fused_gemms()
            .map(|f| crate::launch::FusedLayout::of(f).stats as usize / 8)
            .zip(&tables)
            .map(|(at, table)| {
                let word = |i: usize| table[at + i].load(Ordering::Acquire);
                crate::launch::FusedWaits::from_words([word(0), word(1)])
            })
            .collect();
        drop(tables);
        memory.check_guards(plan)?;
        Ok(CudaRunOutput {
            buffers: memory.read_back(plan, options.read_back),
            gpu_time: elapsed_run,
            gated: false,
            gemms: lowered.gemms(),
            comm_priority: None,
            staggered: Vec::new(),
            offset_starts: false,
            op_times: Vec::new(),
            fused_waits,
            elapsed: start.elapsed(),
        })
    }
}

/// Generates every input buffer, uploads the routing tables and poisons the rest, as
/// the GPU path does (`buffer_fill`), before any stream starts.
fn fill_inputs(
    kernels: &HostKernels,
    plan: &Plan,
    memory: &HostMemory,
    seed: u32,
    family: Family,
) -> Result<(), CudaError> {
    for d in 0..plan.devices {
        for (i, base) in memory.base[d].iter().enumerate().take(plan.buffers.len()) {
            for fill in buffer_fill(plan, d, i, *base, seed, family) {
                match fill {
                    Fill::Launch(l) => kernels.launch(&l)?,
                    Fill::Upload(bytes) => {
                        // SAFETY: the destination is buffer i of device d's heap, which holds
                        // `bytes.len()` bytes; no other thread runs yet.
                        #[allow(unsafe_code)]
                        unsafe {
                            std::ptr::copy_nonoverlapping(bytes.as_ptr(), *base as *mut u8, bytes.len())
                        };
                    }
                }
            }
        }
    }
    Ok(())
}

/// A fused GEMM's table on the host.
type Table = Box<[AtomicU64]>;

/// Every submission with its stream, in enqueue order, and the fused GEMMs' tables they
/// point into.
/// Every submission with the index of its stream, and the fused GEMMs' tables.
type StreamWork = (Vec<(usize, Submission)>, Vec<Table>);

fn stream_work(lowered: &Lowered, memory: &HostMemory, words: &RunWords) -> Result<StreamWork, CudaError> {
    let mut tables: Vec<Table> = Vec::new();
    let mut ordered: Vec<(usize, Submission)> = Vec::new();
    for step in &lowered.steps {
        let Some(command) = &step.command else { continue };
        let work = match command {
            Command::FusedGemm(f) => {
                let bytes = fused_table(memory, f)?;
                let table: Table = zeroed_words(bytes.len().div_ceil(8));
                for (word, chunk) in table.iter().zip(bytes.chunks(8)) {
                    let mut le = [0u8; 8];
                    le[..chunk.len()].copy_from_slice(chunk);
                    word.store(u64::from_le_bytes(le), Ordering::Relaxed);
                }
                let launch = fused_launch(memory, f, table.as_ptr() as u64, HOST_FUSED_CTAS, words)?;
                tables.push(table);
                vec![Submission::Launch(launch)]
            }
            other => submissions(other, memory, words)?,
        };
        ordered.extend(work.into_iter().map(|w| (step.stream, w)));
    }
    Ok((ordered, tables))
}

/// What a run's threads share: the first error (which raises the abort word, so every
/// wait returns) and the control words.
struct Shared<'a> {
    kernels: &'a HostKernels,
    order: FiberOrder,
    plan: &'a Plan,
    control: &'a HostControl,
    options: &'a CudaRunOptions,
    first_error: Mutex<Option<CudaError>>,
}

impl Shared<'_> {
    /// Runs one submission; false (after recording the error and aborting) if it failed.
    fn execute(&self, s: &Submission) -> bool {
        match execute(self.kernels, self.order, self.plan, s, self.control, self.options.wait_timeout) {
            Ok(()) => true,
            Err(e) => {
                self.first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                self.control.abort();
                false
            }
        }
    }

    /// Waits for `workers`, raising the abort word once the run's deadline passes;
    /// returns whether it passed.
    fn join<T>(&self, workers: &[std::thread::ScopedJoinHandle<'_, T>], began: Instant) -> bool {
        let mut timed_out = false;
        while !workers.iter().all(|w| w.is_finished()) {
            if !timed_out && began.elapsed() > self.options.run_timeout {
                timed_out = true;
                self.control.abort();
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        timed_out
    }
}

/// Per-stream counts of finished submissions, and a way to wait for one to grow.
#[derive(Default)]
struct Progress {
    lock: Mutex<()>,
    grew: std::sync::Condvar,
}

impl Progress {
    fn advance(&self, count: &AtomicUsize) {
        let _held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        count.fetch_add(1, Ordering::SeqCst);
        self.grew.notify_all();
    }

    /// Waits until `count` reaches `value`; false if the run was aborted first.
    fn wait_for(&self, count: &AtomicUsize, value: usize, control: &HostControl) -> bool {
        let mut held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        while count.load(Ordering::SeqCst) < value {
            if control.aborted() {
                return false;
            }
            // The abort word is not signalled: look at it every millisecond.
            held = self.grew.wait_timeout(held, Duration::from_millis(1)).unwrap_or_else(|p| p.into_inner()).0;
        }
        true
    }
}

/// Runs the submissions as `feed` says until all finish (or the run is aborted): the
/// first error, and whether the run's deadline passed.
fn run_feed(
    shared: Shared<'_>,
    feed: HostFeed,
    ordered: &[(usize, Submission)],
    streams: usize,
) -> (Option<CudaError>, bool) {
    let began = Instant::now();
    // Per stream: how many of its submissions have finished; per submission, its index
    // in its stream.
    let finished: Vec<AtomicUsize> = (0..streams).map(|_| AtomicUsize::new(0)).collect();
    let mut count = vec![0usize; streams];
    let indexed: Vec<(usize, usize, &Submission)> = ordered
        .iter()
        .map(|(stream, s)| {
            count[*stream] += 1;
            (*stream, count[*stream] - 1, s)
        })
        .collect();
    let progress = Progress::default();
    let (shared_ref, finished, indexed) = (&shared, &finished, &indexed);
    let timed_out = std::thread::scope(|scope| match feed {
        HostFeed::Streams => {
            let workers: Vec<_> = (0..streams)
                .map(|stream| {
                    scope.spawn(move || {
                        for (_, _, s) in indexed.iter().filter(|(of, _, _)| *of == stream) {
                            if shared_ref.control.aborted() || !shared_ref.execute(s) {
                                return;
                            }
                        }
                    })
                })
                .collect();
            shared_ref.join(&workers, began)
        }
        HostFeed::Queues { queues, offset } => {
            let queues = queues.max(1);
            let mut inboxes = Vec::with_capacity(streams);
            let mut workers = Vec::with_capacity(streams + queues);
            let progress = &progress;
            for done in finished {
                let (send, receive) = std::sync::mpsc::channel::<&Submission>();
                inboxes.push(send);
                workers.push(scope.spawn(move || {
                    for s in receive {
                        if !shared_ref.control.aborted() && !shared_ref.execute(s) {
                            return;
                        }
                        progress.advance(done);
                    }
                }));
            }
            for queue in 0..queues {
                let inboxes = inboxes.clone();
                workers.push(scope.spawn(move || {
                    for &(stream, index, s) in
                        indexed.iter().filter(|(stream, _, _)| (stream + offset) % queues == queue)
                    {
                        // The head starts once its stream has finished everything before it.
                        if !progress.wait_for(&finished[stream], index, shared_ref.control) {
                            return;
                        }
                        if let Submission::StreamWait { .. } = s {
                            // Evaluated by the queue itself: it holds the queue until satisfied.
                            if !shared_ref.execute(s) {
                                return;
                            }
                            progress.advance(&finished[stream]);
                        } else if inboxes[stream].send(s).is_err() {
                            return;
                        }
                    }
                }));
            }
            // A worker ends when every queue has dropped its sender.
            drop(inboxes);
            shared_ref.join(&workers, began)
        }
    });
    (shared.first_error.into_inner().unwrap_or_else(|p| p.into_inner()), timed_out)
}

/// Runs one submission on the calling (stream) thread.
fn execute(
    kernels: &HostKernels,
    order: FiberOrder,
    plan: &Plan,
    submission: &Submission,
    control: &HostControl,
    wait_timeout: Duration,
) -> Result<(), CudaError> {
    match submission {
        Submission::Launch(l) => kernels.launch_ordered(l, order),
        Submission::Cublas { .. } => Err(CudaError::NoCublas),
        Submission::CopyEngine { src, src_pitch, dst, dst_pitch, width, rows } => {
            for r in 0..*rows {
                // SAFETY: lowering checked both strided regions against their buffers
                // (pitch ≥ width), which lie in the run's heaps; `copy` allows overlap.
                #[allow(unsafe_code)]
                unsafe {
                    std::ptr::copy(
                        (*src as usize + r * src_pitch) as *const u8,
                        (*dst as usize + r * dst_pitch) as *mut u8,
                        *width,
                    )
                };
            }
            Ok(())
        }
        Submission::StreamWrite { addr, value } => {
            semaphore(*addr).store(*value, Ordering::Release);
            Ok(())
        }
        Submission::StreamWait { addr, value } => {
            let start = Instant::now();
            // Longer naps the longer it waits (as the fake driver's and the kernels' spins):
            // dozens of waiting queues must not take the cores from the streams that work.
            let mut nap = Duration::from_micros(50);
            while semaphore(*addr).load(Ordering::Acquire) < *value {
                if control.aborted() {
                    return Ok(());
                }
                if start.elapsed() > wait_timeout {
                    return Err(CudaError::RunTimeout {
                        plan: plan.name.clone(),
                        limit_ms: wait_timeout.as_millis() as u64,
                        pending: format!(
                            "a stream-memory-op wait for >= {value} saw {} (on a GPU it would hang)",
                            semaphore(*addr).load(Ordering::Acquire)
                        ),
                    });
                }
                std::thread::sleep(nap);
                nap = (2 * nap).min(Duration::from_micros(200));
            }
            Ok(())
        }
    }
}

/// The semaphore word at `addr` (an element of a `HostMemory` semaphore array).
fn semaphore(addr: u64) -> &'static AtomicU32 {
    // SAFETY: semaphore addresses come from `HostMemory::sem`, whose arrays outlive every
    // stream thread of the run (they are joined before the memory is dropped).
    #[allow(unsafe_code)]
    unsafe {
        AtomicU32::from_ptr(addr as *mut u32)
    }
}

#[cfg(test)]
mod tests {
    use cudarc::driver::LaunchConfig;

    use super::*;
    use crate::launch::{Param, ONE_THREAD};

    fn kernels() -> &'static HostKernels {
        HostKernels::get().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Other machines than x86-64 switch fibers with ucontext (`CMM_HOST_UCONTEXT` forces
    /// it here): that path must keep compiling.
    #[test]
    fn the_portable_fiber_switch_compiles() {
        use std::io::Write;
        let mut child = std::process::Command::new(compiler())
            .args(["-std=c++17", "-fsyntax-only", "-w", "-DCMM_HOST_UCONTEXT", "-x", "c++", "-"])
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", compiler()));
        child.stdin.take().expect("piped").write_all(host_source().as_bytes()).expect("the source is written");
        let output = child.wait_with_output().expect("the compiler finishes");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    }

    /// Shared memory is checked as racecheck would. Each variant below drops one barrier
    /// of a tile and computes the right numbers here (every warp collective keeps the
    /// warps in step), but is an error naming the hazard.
    #[test]
    fn shared_memory_hazards_of_the_tiles_are_errors() {
        let source = host_source();
        let without = |barrier: &str, then: &str| {
            let (from, to) = (format!("{barrier}        __syncthreads();\n{then}"), format!("{barrier}{then}"));
            assert!(source.contains(&from), "the tile's loop has changed: {from}");
            source.replacen(&from, &to, 1)
        };
        // The pipelined tile: its one barrier per K step; or that barrier moved after the
        // next step's copies.
        let pipeline_wait = without("", "        const u32 next = step + S::STAGES - 1;\n");
        let commit = "        cmm_cp_async_commit();\n        const u32 st = step % S::STAGES;\n";
        let copies_first = pipeline_wait.replacen(commit, &format!("{commit}        __syncthreads();\n"), 1);
        // The staged tile (any strides and transposes): the barrier after its reads.
        let staged_reads = without(
            "            for (int mi = 0; mi < 2; ++mi) cmm_mma16816<BF16>(w.acc[mi][ni], afrag[mi], bfrag);\n        }\n",
            "    }\n    cmm_warp_tile_store(w, g);\n",
        );
        // A 64×64 tile over K = 128 (four pipeline steps of the 64×64 tile, eight of the
        // 128×128 one, so every stage is refilled); B transposed takes the staged tile.
        let (m, n, k) = (64usize, 64usize, 128usize);
        let halves = |len: usize, seed: usize| -> Vec<u16> {
            (0..len).map(|i| cmm_core::DType::F16.encode(((i * 7 + seed) % 5) as f32 - 2.0) as u16).collect()
        };
        let (a, b) = (halves(m * k, 1), halves(k * n, 3));
        let mut c = vec![0f32; m * n];
        let launch = |trans_b: bool, wide: bool, c: &mut [f32]| {
            let args = crate::launch::GemmArgs {
                a: a.as_ptr() as u64,
                b: b.as_ptr() as u64,
                c: c.as_mut_ptr() as u64,
                a_stride: k as u64,
                b_stride: if trans_b { k } else { n } as u64,
                c_stride: n as u64,
                m: m as u32,
                n: n as u32,
                k: k as u32,
                a_dtype: crate::launch::dtype_code(cmm_core::DType::F16),
                b_dtype: crate::launch::dtype_code(cmm_core::DType::F16),
                c_dtype: crate::launch::dtype_code(cmm_core::DType::F32),
                flags: u32::from(trans_b) << 1,
                ..Default::default()
            };
            let (kernel, threads) = if wide { (Kernel::GemmMmaWideF16, 256) } else { (Kernel::GemmMmaF16, 128) };
            let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
            Launch { kernel, cfg, params: vec![Param::Gemm(args)], what: "a test gemm" }
        };
        let decode = |h: u16| cmm_core::DType::F16.decode(h as u32);
        for (trans_b, wide) in [(false, false), (true, false), (false, true)] {
            kernels().launch(&launch(trans_b, wide, &mut c)).unwrap();
            let b0 = |p: usize| decode(if trans_b { b[p] } else { b[p * n] });
            assert_eq!(c[0], (0..k).map(|p| decode(a[p]) * b0(p)).sum::<f32>(), "B transposed: {trans_b}");
        }
        let landed = "a cp.async landed in with no __syncthreads between the copy's wait and the read";
        let overwritten = "a cp.async overwrites 16 bytes that another warp read";
        for (variant, trans_b, wide, hazard) in [
            (&pipeline_wait, false, false, landed),
            (&pipeline_wait, false, true, landed),
            (&copies_first, false, false, overwritten),
            (&copies_first, false, true, overwritten),
            (&staged_reads, true, false, "a thread overwrites a shared element another thread read"),
        ] {
            let broken = load_variant(variant, "cmm-host-hazard").unwrap_or_else(|e| panic!("{e}"));
            let e = broken.launch(&launch(trans_b, wide, &mut c)).unwrap_err();
            assert!(e.to_string().contains(hazard), "wide tiles: {wide}: {e}");
        }
    }

    /// The line of hopper.cu (1-based) of `text`'s first occurrence once the producer's
    /// fence (a line before it) is removed, as the broken variant numbers it.
    fn hopper_source_line(text: &str) -> usize {
        let source = crate::KERNEL_FILES.iter().find(|f| f.name == "hopper.cu").unwrap().source;
        let fence = source.lines().position(|l| l.trim() == "cmm_fence_proxy_async_global();").unwrap();
        let load = source.lines().position(|l| l.trim() == text).unwrap();
        assert!(fence < load, "the fence comes before the loads");
        load // 1-based line of the load, less the removed fence line
    }

    /// The fiber orders the Hopper twin tests run their kernels as written in: the two
    /// fixed ones and two shuffles.
    const ORDERS: [FiberOrder; 4] =
        [FiberOrder::FirstToLast, FiberOrder::LastToFirst, FiberOrder::Shuffled(1), FiberOrder::Shuffled(2)];

    /// The host twin's kernel source with the first `from` of hopper.cu replaced by `to`.
    /// A variant of the host source with a planted bug, built without optimisation
    /// (`-O0` after the flags' `-O2`): each is compiled afresh whenever the sources change
    /// and runs a few small launches, so its compile is most of its cost, and `-O0` halves
    /// it. The roundings are the same: no contraction either way, and SSE arithmetic.
    fn load_variant(source: &str, stem: &str) -> Result<HostKernels, CudaError> {
        load_from(source, stem, &["-O0"])
    }

    fn hopper_variant(from: &str, to: &str) -> String {
        let source = host_source();
        assert!(source.contains(from), "hopper.cu has changed: {from}");
        source.replacen(from, to, 1)
    }

    /// Host memory for a hand-made Hopper launch: buffer `b` of device 0 starts at
    /// `bases[b]`, semaphores at `sems`.
    struct TestMemory {
        bases: Vec<u64>,
        sems: u64,
    }

    impl Addressing for TestMemory {
        fn addr(&self, l: &Loc) -> u64 {
            self.bases[l.buffer] + l.offset
        }
        fn sem(&self, _device: usize, sem: usize) -> u64 {
            self.sems + 4 * sem as u64
        }
        fn tensor_map(&self, spec: &TensorMapSpec) -> Result<TensorMap, CudaError> {
            Ok(host_tensor_map(spec))
        }
    }

    /// The words a fused Hopper run of one block reads and writes, gated by one wait that
    /// is already satisfied (the producer acquires before its first loads); boxed, so that
    /// the addresses handed to the kernel stay put.
    struct OneSatisfiedWait {
        sems: [u32; 1],
        /// CmmHopperSync: the semaphore's address, then the value 1 (and padding).
        waits: [u64; 2],
        status: [u32; 2],
        abort: u32,
        /// Unused, blocks released, failed, the block's tiles done; then the run's counts
        /// (two u64 at the next 8-byte boundary).
        control: [u32; 8],
    }

    impl OneSatisfiedWait {
        fn new() -> Box<Self> {
            Box::new(OneSatisfiedWait { sems: [1], waits: [0, 1], status: [0; 2], abort: 0, control: [0; 8] })
        }

        /// The semaphores' base address (`TestMemory::sems`).
        fn sems(&self) -> u64 {
            self.sems.as_ptr() as u64
        }

        /// Makes `args` a fused run of one block gated by the wait.
        fn gate(&mut self, args: &mut crate::launch::HopperArgs) {
            self.waits[0] = self.sems();
            args.waits = self.waits.as_ptr() as u64;
            args.control = self.control.as_mut_ptr() as u64;
            args.status = self.status.as_mut_ptr() as u64;
            args.abort = &self.abort as *const u32 as u64;
            args.first.waits_end = 1;
        }
    }

    /// `len` bf16 values from -2 to 2 (products and sums of a few hundred are exact in f32).
    fn halves(len: usize, seed: usize) -> Vec<u16> {
        (0..len).map(|i| cmm_core::DType::Bf16.encode(((i * 7 + seed) % 5) as f32 - 2.0) as u16).collect()
    }

    /// A bf16 GEMM onto f32 C of buffers 0 (A, M×K), 1 (B, K×N, or N×K transposed) and 2
    /// (C, M×N) of device 0, on `imp`.
    fn bf16_gemm([m, n, k]: [usize; 3], trans_b: bool, imp: crate::lower::GemmImpl) -> crate::lower::GemmCommand {
        let loc = |buffer| Loc { device: 0, buffer, offset: 0 };
        crate::lower::GemmCommand {
            a: loc(0),
            b: loc(1),
            c: loc(2),
            strides: [k as u64, if trans_b { k } else { n } as u64, n as u64],
            mnk: [m as u32, n as u32, k as u32],
            dtypes: [cmm_core::DType::Bf16, cmm_core::DType::Bf16, cmm_core::DType::F32],
            trans_a: false,
            trans_b,
            accumulate: false,
            imp,
        }
    }

    /// The twin of the Hopper engine must not hide the bugs it exists to find: the kernel
    /// as written computes the product (B N-major and K-major, both tiles); a descriptor
    /// with the wrong swizzle mode or the wrong stride byte offset computes something
    /// else; a stage announced without its bytes (no expect-tx) is read before its copy is
    /// published, as is a B operand one thread of a warpgroup reads without its wait
    /// (its 127 peers waited), and a TMA load after an acquire without `fence.proxy.async` is
    /// refused, each an error naming what went wrong.
    #[test]
    fn the_hopper_twin_finds_wrong_descriptors_missing_expect_tx_and_missing_proxy_fences() {
        use crate::lower::{GemmImpl, HopperKernel, HopperTile, HopperVariant};
        // Seven steps of K: every variant's stages are refilled, their barriers' phases flip.
        let (m, k) = (128usize, 448usize);
        let decode = |h: u16| cmm_core::DType::Bf16.decode(h as u32);
        let run = |kernels: &HostKernels,
                   (tile, variant): (HopperTile, HopperVariant),
                   trans_b: bool,
                   order: FiberOrder,
                   tweak: &dyn Fn(&mut crate::launch::HopperArgs)| {
            let n = tile.columns();
            let a = halves(m * k, 1);
            let b = halves(k * n, 3);
            let mut c = vec![0f32; m * n];
            let mut wait = OneSatisfiedWait::new();
            let memory = TestMemory {
                bases: vec![a.as_ptr() as u64, b.as_ptr() as u64, c.as_mut_ptr() as u64],
                sems: wait.sems(),
            };
            let g = bf16_gemm([m, n, k], trans_b, GemmImpl::Hopper { tile, ctas: 1, variant });
            let mut args = crate::launch::hopper_args(&memory, &g, (tile, variant)).unwrap();
            wait.gate(&mut args);
            tweak(&mut args);
            let shared_mem_bytes = tile.shared_bytes(variant);
            let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (384, 1, 1), shared_mem_bytes };
            let kernel = crate::launch::hopper_kernel(tile, variant, cmm_core::DType::Bf16);
            let params = vec![Param::Hopper(Box::new(args))];
            let launched = kernels.launch_ordered(&Launch { kernel, cfg, params, what: "a test gemm" }, order);
            let b_at = |p: usize, j: usize| decode(if trans_b { b[j * k + p] } else { b[p * n + j] });
            let want = |i: usize, j: usize| (0..k).map(|p| decode(a[i * k + p]) * b_at(p, j)).sum::<f32>();
            launched.map(|()| (0..m).all(|i| (0..n).all(|j| c[i * n + j] == want(i, j))))
        };
        let plain: &dyn Fn(&mut crate::launch::HopperArgs) = &|_| {};
        // The engine's kernels and the sweep's shallow ones (the clusters and ping-pong: the
        // next tests), the block's threads resumed in each of the orders.
        let first = FiberOrder::FirstToLast;
        for tile in HopperTile::ALL {
            for variant in [HopperVariant::Engine, HopperVariant::Shallow] {
                for trans_b in [false, true] {
                    for order in ORDERS {
                        let right = run(kernels(), (tile, variant), trans_b, order, plain).unwrap();
                        assert!(right, "{tile:?} {variant:?}, B transposed: {trans_b}, {order:?}");
                    }
                }
            }
        }
        let narrow = (HopperTile::Narrow, HopperVariant::Engine);
        // The 64-byte swizzle where the copies wrote the 128-byte one; eight rows 512 bytes
        // apart where they are 1024.
        let swizzle_64: &dyn Fn(&mut crate::launch::HopperArgs) =
            &|a| a.desc_b = (a.desc_b & !(3u64 << 62)) | (2u64 << 62);
        let stride_512: &dyn Fn(&mut crate::launch::HopperArgs) =
            &|a| a.desc_a = (a.desc_a & !(0x3fffu64 << 32)) | (32u64 << 32);
        // Either wrong numbers, or an error where the misread bytes belong to a stage whose
        // copy the thread has not waited for.
        for (what, tweak) in [("a 64-byte swizzle", swizzle_64), ("a 512-byte stride", stride_512)] {
            for trans_b in [false, true] {
                let outcome = run(kernels(), narrow, trans_b, first, tweak);
                assert!(!matches!(outcome, Ok(true)), "{what} went unnoticed (B transposed: {trans_b})");
            }
        }
        let variant = hopper_variant;
        let no_expect_tx = variant(
            "cmm_mbar_arrive_expect_tx(full, CMM_HOPPER_A_BYTES + cmm_hopper_b_box_bytes<S>(p, n0));",
            "cmm_mbar_arrive(full);",
        );
        let no_fence = variant("                cmm_fence_proxy_async_global();\n", "");
        // One thread of each consumer warpgroup reads B unwaited, beside 127 that wait (A
        // from shared memory no copy wrote, so that only B can tell): the twin decodes a B
        // operand once for the warpgroup, and must still hold each thread to its own waits.
        let one_unwaited = variant(
            "            cmm_mbar_wait(bars + 8u * stage, phase, limit_ns);",
            "            if (threadIdx.x % 128u != 77u) cmm_mbar_wait(bars + 8u * stage, phase, limit_ns);",
        )
        .replacen(
            "const u32 sa = smem + stage * CMM_HOPPER_A_BYTES + (S::PINGPONG ? 0u : wg * 64u * 128u);",
            "const u32 sa = smem + 200u * 1024u;",
            1,
        );
        // The fence's absence is named by the kernel file's line of the TMA load.
        let load_line = hopper_source_line("cmm_tma_load_2d(sa, amap, k0, a_row, full);");
        for (source, hazard, place) in [
            (no_expect_tx, "before its thread waited for the mbarrier phase that publishes the copy", String::new()),
            (one_unwaited, "before its thread waited for the mbarrier phase that publishes the copy", String::new()),
            (
                no_fence,
                "a TMA copy issued after an acquire with no fence.proxy.async",
                format!("hopper.cu:{load_line}:"),
            ),
        ] {
            let broken = load_variant(&source, "cmm-host-hopper-hazard").unwrap_or_else(|e| panic!("{e}"));
            let e = run(&broken, narrow, false, first, plain).unwrap_err().to_string();
            assert!(e.contains(hazard) && e.contains("cmm_hopper_gemm_bf16_n128") && e.contains(&place), "{e}");
        }
    }

    /// The Hopper engine's clusters of two (the GEMM sweep's `_c2` kernels) on the twin: each
    /// CTA of a pair takes one row tile and multicasts half of B's boxes into both. Right on
    /// both tiles with three row tiles (the last pair's second tile a phantom past M), a
    /// column tile past N with one box, and K wrapping every stage, on one cluster and on
    /// two; and the twin catches a consumer that gives a stage back to its own producer
    /// only (a deadlock), and a missing cluster barrier after the barriers' initialisation
    /// or before exit, each an error saying what.
    #[test]
    fn the_hopper_twin_runs_clusters_and_finds_missing_remote_arrives_and_cluster_barriers() {
        use crate::lower::{GemmImpl, HopperKernel, HopperTile, HopperVariant};
        let (m, k) = (384usize, 448usize);
        let decode = |h: u16| cmm_core::DType::Bf16.decode(h as u32);
        let run = |kernels: &HostKernels, tile: HopperTile, ctas: u32, order: FiberOrder| -> Result<bool, CudaError> {
            let n = tile.columns() + 64;
            let (a, b) = (halves(m * k, 1), halves(k * n, 3));
            let mut c = vec![f32::NAN; m * n];
            let memory =
                TestMemory { bases: vec![a.as_ptr() as u64, b.as_ptr() as u64, c.as_mut_ptr() as u64], sems: 0 };
            let g = bf16_gemm([m, n, k], false, GemmImpl::Hopper { tile, ctas, variant: HopperVariant::Pair });
            let Submission::Launch(launch) = crate::launch::gemm_submission(&memory, &g)? else {
                panic!("a Hopper GEMM is a launch")
            };
            assert_eq!((launch.kernel.cluster(), launch.cfg.grid_dim.0 % 2), (2, 0));
            assert_eq!(launch.cfg.shared_mem_bytes, tile.shared_bytes(HopperVariant::Engine));
            kernels.launch_ordered(&launch, order)?;
            let want = |i: usize, j: usize| (0..k).map(|p| decode(a[i * k + p]) * decode(b[p * n + j])).sum::<f32>();
            Ok((0..m).all(|i| (0..n).all(|j| c[i * n + j] == want(i, j))))
        };
        for tile in HopperTile::ALL {
            // One cluster walks all four pairs; two take two each; threads in each order.
            for ctas in [2, 4] {
                for order in ORDERS {
                    assert!(run(kernels(), tile, ctas, order).unwrap(), "{tile:?}, {ctas} CTAs, {order:?}");
                }
            }
        }
        // A transposed B has no boxes to multicast: refused, not run.
        let memory = TestMemory { bases: vec![0; 3], sems: 0 };
        let pair = GemmImpl::Hopper { tile: HopperTile::Narrow, ctas: 2, variant: HopperVariant::Pair };
        let transposed = bf16_gemm([128, 128, 64], true, pair);
        let e = crate::launch::gemm_submission(&memory, &transposed).unwrap_err().to_string();
        assert!(e.contains("multicast B's N-major boxes") && e.contains("128x128x64"), "{e}");
        let broken = [
            (
                "        if constexpr (S::CLUSTER == 2u) cmm_mbar_arrive_cluster(empty, cmm_cluster_ctarank() ^ 1u);\n",
                "deadlock: every live thread of the block spins on an mbarrier phase",
            ),
            (
                "    // The peer's copies and arrives reach these barriers only once they are initialised.\n    \
                 if constexpr (S::CLUSTER == 2u) cmm_cluster_sync();\n",
                "whose initialisation no cluster barrier has made visible",
            ),
            (
                "    // No CTA leaves while its peer may still copy into its shared memory or arrive on its\n    \
                 // barriers.\n    if constexpr (S::CLUSTER == 2u) cmm_cluster_sync();\n",
                "into a CTA of the cluster that has exited",
            ),
        ];
        for (i, (line, error)) in broken.into_iter().enumerate() {
            let source = hopper_variant(line, "");
            let kernels =
                load_variant(&source, &format!("cmm-host-cluster-hazard-{i}")).unwrap_or_else(|e| panic!("{e}"));
            let e = run(&kernels, HopperTile::Narrow, 2, FiberOrder::FirstToLast).unwrap_err().to_string();
            assert!(e.contains(error) && e.contains("cmm_hopper_gemm_bf16_n128_c2"), "{e}");
        }
    }

    /// The Hopper engine's ping-pong kernels (the GEMM sweep's `_pp`: the consumer
    /// warpgroups on alternate 128×128 tiles, each a whole tile, taking turns) on the twin,
    /// as a fused run of one block with a satisfied wait: right, and the block released
    /// once, with six tiles (a column tile past N with one box, K wrapping the six stages)
    /// on one CTA (three tiles a warpgroup), two, and four (some warpgroups with none),
    /// with the block's threads resumed in fixed and shuffled orders. And the twin
    /// catches a stage's barrier counting both warpgroups' arrivals (a deadlock), a
    /// warpgroup that does not let the other's stages pass it by, a tile counted at a
    /// barrier of both warpgroups, which no longer share a tile (a CTA whose warpgroups
    /// have unequal numbers of tiles waits there for ever), warpgroups that do not take
    /// turns (the second's parity waits, two phases ahead of the stages' last completed
    /// ones, pass at once when its threads run first), and a stage given back before the
    /// wgmma group that read it has completed (seen once threads overtake each other: a
    /// shuffled order).
    #[test]
    fn the_hopper_twin_runs_ping_pong_and_finds_its_stages_barriers_and_turns_wrong() {
        use crate::lower::{GemmImpl, HopperKernel, HopperTile, HopperVariant};
        let (m, n, k) = (384usize, 192usize, 448usize);
        let decode = |h: u16| cmm_core::DType::Bf16.decode(h as u32);
        let (tile, variant) = (HopperTile::Narrow, HopperVariant::PingPong);
        let run = |kernels: &HostKernels, ctas: u32, order: FiberOrder| -> Result<bool, CudaError> {
            let (a, b) = (halves(m * k, 1), halves(k * n, 3));
            let mut c = vec![f32::NAN; m * n];
            let mut wait = OneSatisfiedWait::new();
            let memory = TestMemory {
                bases: vec![a.as_ptr() as u64, b.as_ptr() as u64, c.as_mut_ptr() as u64],
                sems: wait.sems(),
            };
            let g = bf16_gemm([m, n, k], false, GemmImpl::Hopper { tile, ctas, variant });
            let mut args = crate::launch::hopper_args(&memory, &g, (tile, variant))?;
            wait.gate(&mut args);
            let cfg = LaunchConfig {
                grid_dim: (ctas, 1, 1),
                block_dim: (384, 1, 1),
                shared_mem_bytes: tile.shared_bytes(variant),
            };
            let kernel = crate::launch::hopper_kernel(tile, variant, cmm_core::DType::Bf16);
            assert_eq!(kernel.entry(), "cmm_hopper_gemm_bf16_n128_pp");
            let params = vec![Param::Hopper(Box::new(args))];
            kernels.launch_ordered(&Launch { kernel, cfg, params, what: "a test gemm" }, order)?;
            let want = |i: usize, j: usize| (0..k).map(|p| decode(a[i * k + p]) * decode(b[p * n + j])).sum::<f32>();
            let right = (0..m).all(|i| (0..n).all(|j| c[i * n + j] == want(i, j)));
            // The block released, the run not failed, its six tiles counted.
            Ok(right && wait.control[1..4] == [1, 0, 6])
        };
        for ctas in [1, 2, 4] {
            for order in ORDERS {
                assert!(run(kernels(), ctas, order).unwrap(), "{ctas} CTAs, {order:?}");
            }
        }
        let variant = hopper_variant;
        let both_arrive = variant(
            "cmm_mbar_init(bars + 8u * (S::STAGES + s), S::PINGPONG ? 1u : 2u * S::CLUSTER);",
            "cmm_mbar_init(bars + 8u * (S::STAGES + s), 2u * S::CLUSTER);",
        );
        let kernels = load_variant(&both_arrive, "cmm-host-pingpong-hazard").unwrap_or_else(|e| panic!("{e}"));
        let e = run(&kernels, 1, FiberOrder::FirstToLast).unwrap_err().to_string();
        assert!(e.contains("deadlock") && e.contains("cmm_hopper_gemm_bf16_n128_pp"), "{e}");
        let no_pass_by = variant(
            "                stage += steps;\n                phase ^= (stage / S::STAGES) & 1u;\n                stage %= S::STAGES;\n",
            "",
        );
        let shared_barrier =
            variant("                cmm_bar_sync(1u + wg, 128u);", "                cmm_bar_sync(1u, 256u);");
        let no_turns = variant(
            "            if (index > 0u) cmm_mbar_wait(turns + 8u * wg, ((index - 1u) / 2u) & 1u, limit_ns);\n",
            "",
        );
        // A stage given back as soon as the wgmma that read it is issued, not once its group
        // has completed: a warp of the warpgroup still to read it finds the next phase's
        // data (or waits for a phase it will not see again).
        let early_give_back = variant("            cmm_wgmma_wait<1>();\n", "");
        for (i, (source, what, order)) in [
            (no_pass_by, "stages not passed by", FiberOrder::FirstToLast),
            (shared_barrier, "a barrier of both warpgroups", FiberOrder::FirstToLast),
            (no_turns, "warpgroups that do not take turns", FiberOrder::LastToFirst),
            (early_give_back, "a stage given back before its readers' group completed", FiberOrder::Shuffled(1)),
        ]
        .into_iter()
        .enumerate()
        {
            let kernels =
                load_variant(&source, &format!("cmm-host-pingpong-wrong-{i}")).unwrap_or_else(|e| panic!("{e}"));
            // Two and four CTAs: some CTA's warpgroups have unequal numbers of tiles.
            for ctas in [2, 4] {
                assert!(!matches!(run(&kernels, ctas, order), Ok(true)), "{what} went unnoticed on {ctas} CTAs");
            }
        }
    }

    /// The TMA-store kernels' epilogue: on both tiles, f32 and bf16 C, M past two whole
    /// tiles (the partial row of tiles leaves from registers) and N past a whole tile (the
    /// TMA stores clip the columns past N), two CTAs taking several tiles each (the staging
    /// reused), every fiber order: C comes out right, bit for bit, and no element past C
    /// is written, as a plain GEMM and as a fused run of one block (gated by a satisfied
    /// wait, its tiles counted and the block released). Planted bugs: a staging written
    /// with another swizzle comes out wrong; no writer fence before the stores, a staging
    /// written again with no wait for the stores before, stores of boxes past the tile's
    /// columns (stale staging, which the next tile's stores may or may not overwrite: the
    /// order decides), and a fused run's release with its stores not waited for to
    /// completion are errors naming the kernel.
    #[test]
    fn the_hopper_twin_finds_tma_stores_from_unfenced_or_reused_staging() {
        use crate::lower::{GemmImpl, HopperKernel, HopperTile, HopperVariant};
        const GUARD: usize = 64;
        let k = 448usize;
        let decode = |h: u16| cmm_core::DType::Bf16.decode(h as u32);
        // `fused`: a fused run of one block, gated by a satisfied wait, whose release
        // must follow the completion of the block's stores.
        let run = |kernels: &HostKernels, tile: HopperTile, output: cmm_core::DType, fused: bool, order: FiberOrder| {
            let (m, n) = (300usize, tile.columns() + 40);
            let a = halves(m * k, 1);
            let b = halves(k * n, 3);
            // C and a guard after it, in 32-bit words (bf16 C: two elements a word).
            let words = if output == cmm_core::DType::F32 { m * n } else { (m * n).div_ceil(2) };
            let mut c = vec![0x7fc0_0000u32; words + GUARD];
            let mut wait = OneSatisfiedWait::new();
            let memory = TestMemory {
                bases: vec![a.as_ptr() as u64, b.as_ptr() as u64, c.as_mut_ptr() as u64],
                sems: wait.sems(),
            };
            let variant = HopperVariant::TmaStore;
            let mut g = bf16_gemm([m, n, k], false, GemmImpl::Hopper { tile, ctas: 2, variant });
            g.dtypes[2] = output;
            let mut args = crate::launch::hopper_args(&memory, &g, (tile, variant)).unwrap();
            assert_ne!(args.flags & 256, 0, "C's map is encoded");
            if fused {
                wait.gate(&mut args);
            }
            let cfg = LaunchConfig {
                grid_dim: (2, 1, 1),
                block_dim: (384, 1, 1),
                shared_mem_bytes: tile.shared_bytes(variant),
            };
            let kernel = crate::launch::hopper_kernel(tile, variant, cmm_core::DType::Bf16);
            let params = vec![Param::Hopper(Box::new(args))];
            let launched = kernels.launch_ordered(&Launch { kernel, cfg, params, what: "a test gemm" }, order);
            let want = |i: usize, j: usize| {
                let sum = (0..k).map(|p| decode(a[i * k + p]) * decode(b[p * n + j])).sum::<f32>();
                output.decode(output.encode(sum))
            };
            let got = |i: usize, j: usize| match output {
                cmm_core::DType::F32 => f32::from_bits(c[i * n + j]),
                _ => output.decode((c[(i * n + j) / 2] >> (16 * ((i * n + j) % 2))) & 0xffff),
            };
            launched.map(|()| {
                (0..m).all(|i| (0..n).all(|j| got(i, j) == want(i, j))) && c[words..].iter().all(|&w| w == 0x7fc0_0000)
            })
        };
        for tile in HopperTile::ALL {
            for output in [cmm_core::DType::F32, cmm_core::DType::Bf16] {
                for fused in [false, true] {
                    for order in ORDERS {
                        let right = run(kernels(), tile, output, fused, order).unwrap();
                        assert!(right, "{tile:?}, {output}, fused: {fused}, {order:?}");
                    }
                }
            }
        }
        let variant = hopper_variant;
        let swizzle = "((in_box * size) ^ ((row & 7u) << 4))";
        let unswizzled = variant(swizzle, "(in_box * size)");
        let broken = load_variant(&unswizzled, "cmm-host-hopper-store-wrong").unwrap_or_else(|e| panic!("{e}"));
        let wrong = run(&broken, HopperTile::Narrow, cmm_core::DType::F32, false, FiberOrder::FirstToLast).unwrap();
        assert!(!wrong, "a staging written unswizzled went unnoticed");
        let unfenced = variant(
            "        // Written through the generic proxy, read by TMA through the async one.\n        cmm_fence_proxy_async_shared();\n",
            "",
        );
        let unwaited = variant("        if (issuer) cmm_bulk_wait_read();\n", "");
        let past_the_tile =
            variant("min(CMM_HOPPER_STAGING_BYTES / (64u * size), S::BN)", "CMM_HOPPER_STAGING_BYTES / (64u * size)");
        // A fused run's release before its block's stores have completed.
        let released_early = variant(
            "                cmm_bulk_wait();\n                cmm_fence_proxy_async_global();\n",
            "                cmm_fence_proxy_async_global();\n",
        );
        for (source, output, fused, hazard) in [
            (unfenced, cmm_core::DType::F32, false, "with no fence.proxy.async.shared::cta by its writer"),
            (unwaited, cmm_core::DType::F32, false, "before its issuing thread's cp.async.bulk.wait_group.read"),
            (past_the_tile, cmm_core::DType::Bf16, false, "(stale staging)"),
            (
                released_early,
                cmm_core::DType::F32,
                true,
                "a release fence while TMA stores of the CTA have not completed",
            ),
        ] {
            let broken = load_variant(&source, "cmm-host-hopper-store-hazard").unwrap_or_else(|e| panic!("{e}"));
            let e = run(&broken, HopperTile::Narrow, output, fused, FiberOrder::FirstToLast).unwrap_err().to_string();
            assert!(e.contains(hazard) && e.contains("cmm_hopper_gemm_bf16_n128_ts"), "{e}");
        }
    }

    /// The same for a grouped GEMM whose rows are gathered by token (ag_moe's): as
    /// written, two experts' rows in a hand-made routing, with a dropped slot and unrouted
    /// rows zeroed, come out right on both tiles in every fiber order, with the proxy fence
    /// made by the producer threads (the engine's and the ping-pong kernels, whose
    /// warpgroups each wait for alternate tiles' stages alone) or by the consumers (the
    /// reader-fence variant); rows copied without the 128-byte swizzle come out wrong. Errors: on the
    /// engine's kernels, a stage handed over with no producer fence, with the fence made
    /// before its copies landed, or before `cp.async.wait_group` saw them land; on the
    /// reader-fence variant, a copy no `cp.async.mbarrier.arrive` tracks, and a wgmma that
    /// reads cp.async's rows with no `fence.proxy.async.shared::cta` after its wait.
    #[test]
    fn the_hopper_twin_finds_gathered_rows_read_unswizzled_untracked_or_unfenced() {
        use crate::lower::{HopperKernel, HopperTile, HopperVariant};
        const NONE: u32 = u32::MAX;
        // K of 9 steps (the last partial): more stages than the producer keeps in flight,
        // so that stages are handed over inside its loop, not only after it.
        let (tokens, slots, experts, k, rows) = (4usize, 2usize, 2usize, 520usize, 8usize);
        let decode = |h: u16| cmm_core::DType::Bf16.decode(h as u32);
        // Expert 0 takes rows 0..3, expert 1 rows 3..6 (one of its slots dropped: row 5
        // has no token); rows 6 and 7 are past the routed ones.
        let seg = [0u32, 3, 6];
        let perm = [0u32, 3, 5, 1, 2, NONE, NONE, NONE];
        let expert_of = |r: usize| {
            if r < 3 {
                Some(0)
            } else if r < 6 {
                Some(1)
            } else {
                None
            }
        };
        let run = |kernels: &HostKernels, (tile, variant): (HopperTile, HopperVariant), order: FiberOrder| {
            let n = tile.columns();
            let a = halves(tokens * k, 1);
            let b = halves(experts * k * n, 3);
            let mut c = vec![f32::NAN; rows * n];
            let memory = TestMemory {
                bases: vec![
                    a.as_ptr() as u64,
                    b.as_ptr() as u64,
                    c.as_mut_ptr() as u64,
                    seg.as_ptr() as u64,
                    perm.as_ptr() as u64,
                ],
                sems: 0,
            };
            let loc = |buffer| Loc { device: 0, buffer, offset: 0 };
            let bf16 = cmm_core::DType::Bf16;
            let tensors =
                [(loc(0), k as u64, bf16), (loc(1), n as u64, bf16), (loc(2), n as u64, cmm_core::DType::F32)];
            let shape = [tokens as u32, rows as u32, n as u32, k as u32];
            let routing = [1, 0, 0, experts as u32, experts as u32, slots as u32];
            let perm_at = (loc(4), 1u64);
            let args = crate::launch::hopper_grouped_args(
                &memory,
                &tensors,
                &loc(3),
                Some((&perm_at, 0)),
                true,
                shape,
                routing,
                (tile, variant),
            )
            .unwrap();
            let shared_mem_bytes = tile.shared_bytes(variant);
            let cfg = LaunchConfig { grid_dim: (2, 1, 1), block_dim: (384, 1, 1), shared_mem_bytes };
            let kernel = crate::launch::hopper_kernel(tile, variant, bf16);
            let params = vec![Param::Hopper(Box::new(args))];
            let launched = kernels.launch_ordered(&Launch { kernel, cfg, params, what: "a test gemm" }, order);
            let want = |r: usize, j: usize| match (expert_of(r), perm[r]) {
                (Some(e), slot) if slot != NONE => {
                    let t = slot as usize / slots;
                    (0..k).map(|p| decode(a[t * k + p]) * decode(b[(e * k + p) * n + j])).sum::<f32>()
                }
                _ => 0.0,
            };
            launched.map(|()| (0..rows).all(|r| (0..n).all(|j| c[r * n + j] == want(r, j))))
        };
        let engine = (HopperTile::Narrow, HopperVariant::Engine);
        let reader_fence = (HopperTile::Narrow, HopperVariant::ReaderFence);
        for tile in HopperTile::ALL {
            for fence in [HopperVariant::Engine, HopperVariant::PingPong, HopperVariant::ReaderFence] {
                for order in ORDERS {
                    assert!(run(kernels(), (tile, fence), order).unwrap(), "{tile:?}, {fence:?}, {order:?}");
                }
            }
        }
        let variant = hopper_variant;
        let unswizzled = variant(
            "cmm_hopper_cp_async16(a + row * 128u + ((chunk ^ (row & 7u)) << 4), src, bytes);",
            "cmm_hopper_cp_async16(a + row * 128u + (chunk << 4), src, bytes);",
        );
        // Each lane copying from its own row's source, not the one the row's lane found.
        let unshuffled = variant("const u32 source = __shfl_sync(0xffffffffu, mine, r);", "const u32 source = mine;");
        for (source, what) in [(unswizzled, "without the swizzle"), (unshuffled, "from another row's source")] {
            let broken = load_variant(&source, "cmm-host-hopper-gather-wrong").unwrap_or_else(|e| panic!("{e}"));
            assert!(!run(&broken, engine, FiberOrder::FirstToLast).unwrap(), "rows copied {what} went unnoticed");
        }
        let (landed, fence) = ("cmm_hopper_cp_async_wait<LAG>();\n", "cmm_fence_proxy_async_shared();\n");
        let handed_over = format!("                    {landed}                    {fence}");
        let unfenced_writer = variant(&handed_over, &format!("                    {landed}"));
        let fenced_early = variant(&handed_over, &format!("                    {fence}                    {landed}"));
        let unlanded = variant(&handed_over, &format!("                    {fence}"));
        let untracked =
            variant("                cmm_hopper_cp_async_arrive(full);", "                cmm_mbar_arrive(full);");
        let unfenced_reader = variant("            if (reader_fence) cmm_fence_proxy_async_shared();", "");
        // Half a warp at the hand-off, the other half gone on to the stage's barrier.
        let diverged = variant(
            "const u32 source = __shfl_sync(0xffffffffu, mine, r);",
            "const u32 source = lane % 2u == 0u ? __shfl_sync(0xffffffffu, mine, r) : mine;",
        );
        let unfenced = "with no fence.proxy.async.shared::cta by the reading thread after its wait, nor by the writing";
        let untracked_hazard = "a cp.async wrote that no mbarrier tracks";
        for (source, kernels, hazard) in [
            (unfenced_writer, engine, unfenced),
            (fenced_early, engine, unfenced),
            (unlanded, engine, untracked_hazard),
            (untracked, reader_fence, untracked_hazard),
            (unfenced_reader, reader_fence, unfenced),
            (diverged, engine, "barrier divergence: threads of a warp"),
        ] {
            let broken = load_variant(&source, "cmm-host-hopper-gather-hazard").unwrap_or_else(|e| panic!("{e}"));
            let e = run(&broken, kernels, FiberOrder::FirstToLast).unwrap_err().to_string();
            assert!(e.contains(hazard) && e.contains("cmm_hopper_gemm_bf16_n128"), "{kernels:?}: {e}");
        }
    }

    /// `elements` of `size` bytes each, packed little-endian into 16-byte-aligned words.
    fn packed(elements: &[u32], size: usize) -> Vec<u128> {
        let mut bytes: Vec<u8> = elements.iter().flat_map(|e| e.to_le_bytes()[..size].to_vec()).collect();
        bytes.resize(bytes.len().next_multiple_of(16), 0);
        bytes.chunks(16).map(|c| u128::from_le_bytes(c.try_into().unwrap())).collect()
    }

    /// The first `len` elements of `size` bytes of a [`packed`] buffer.
    fn unpacked(buffer: &[u128], size: usize, len: usize) -> Vec<u32> {
        let bytes: Vec<u8> = buffer.iter().flat_map(|w| w.to_le_bytes()).collect();
        (0..len)
            .map(|i| {
                let mut word = [0u8; 4];
                word[..size].copy_from_slice(&bytes[i * size..(i + 1) * size]);
                u32::from_le_bytes(word)
            })
            .collect()
    }

    /// Runs an elementwise command's launches on `kernels`, at `memory`'s addresses.
    fn run_command(kernels: &HostKernels, memory: &TestMemory, command: &crate::lower::Command) {
        let control = [0u32; 8];
        let words = crate::launch::RunWords::at(control.as_ptr() as u64, Duration::from_secs(1));
        for submission in crate::launch::submissions(command, memory, &words).unwrap() {
            let Submission::Launch(launch) = submission else { panic!("{command:?} launches no kernel") };
            kernels.launch(&launch).unwrap_or_else(|e| panic!("{e}"));
        }
    }

    /// Element `i` of a buffer whose `rows × cols` region starts at element `offset`, rows
    /// `stride` apart: its row and column in the region, or `None` outside it.
    fn in_region(i: usize, (rows, cols, stride, offset): (usize, usize, usize, usize)) -> Option<(usize, usize)> {
        let (r, c) = (i.checked_sub(offset)? / stride, (i - offset) % stride);
        (r < rows && c < cols).then_some((r, c))
    }

    /// The output bits `cmm_reduce` writes for `count` inputs (f32, f32, bf16, f16: the
    /// first `count`) into an `out_dtype` output, each region `rows × cols` at element
    /// `offset` of its buffer, rows `stride` apart; and the bits expected there: the
    /// left-to-right f32 sum rounded once, and the buffer's fill everywhere else.
    fn reduced(
        kernels: &HostKernels,
        (rows, cols, stride, offset): (usize, usize, usize, usize),
        count: usize,
        out_dtype: cmm_core::DType,
    ) -> (Vec<u32>, Vec<u32>) {
        use crate::lower::{Command, Elementwise};
        use cmm_core::DType;
        const FILL: u32 = 0xabcd;
        let dtypes = [DType::F32, DType::F32, DType::Bf16, DType::F16];
        let len = offset + rows * stride;
        // Values with bits below any 16-bit rounding, so the sums round.
        let value = |i: usize, j: usize| ((i * 37 + j * 11) % 97) as f32 / 13.0 - 3.7 + j as f32 * 0.001;
        let elements: Vec<Vec<u32>> = (0..=count)
            .map(|j| {
                let dtype = if j == count { out_dtype } else { dtypes[j] };
                (0..len).map(|i| if j == count { FILL } else { dtype.encode(value(i, j)) }).collect()
            })
            .collect();
        // Each buffer 16-byte aligned, its elements packed as the dtype lays them out.
        let mut buffers: Vec<Vec<u128>> = elements
            .iter()
            .enumerate()
            .map(|(j, e)| packed(e, if j == count { out_dtype } else { dtypes[j] }.size_bytes()))
            .collect();
        let memory = TestMemory { bases: buffers.iter_mut().map(|b| b.as_mut_ptr() as u64).collect(), sems: 0 };
        let at = |j: usize, dtype: DType| {
            (Loc { device: 0, buffer: j, offset: (offset * dtype.size_bytes()) as u64 }, stride as u64, dtype)
        };
        let (out, _, _) = at(count, out_dtype);
        let e = Elementwise {
            out,
            out_stride: stride as u64,
            out_dtype,
            rows: rows as u32,
            cols: cols as u32,
            inputs: (0..count).map(|j| at(j, dtypes[j])).collect(),
        };
        run_command(kernels, &memory, &Command::Reduce(e));
        let got = unpacked(&buffers[count], out_dtype.size_bytes(), len);
        let expected = (0..len)
            .map(|i| match in_region(i, (rows, cols, stride, offset)) {
                None => FILL,
                Some(_) => out_dtype.encode(
                    (1..count).fold(dtypes[0].decode(elements[0][i]), |acc, j| acc + dtypes[j].decode(elements[j][i])),
                ),
            })
            .collect();
        (got, expected)
    }

    /// `cmm_reduce` sums four elements a thread where every region is aligned for it (base
    /// and stride on four elements, columns a multiple of four) and one a thread otherwise;
    /// both give the left-to-right f32 sum rounded once, bit for bit, and write nothing
    /// outside the output. A variant whose four-element path leaves out its last input gets
    /// the aligned layouts wrong and the others right: the layouts run the paths they name.
    #[test]
    fn the_reduce_sums_four_elements_a_thread_or_one_bit_for_bit() {
        use cmm_core::DType;
        // (rows, cols, stride, offset): aligned; the regions one element off; an odd width.
        let aligned = (9, 40, 44, 4);
        let unaligned = [(9, 40, 44, 1), (5, 42, 46, 0)];
        let source = host_source();
        let from = "if (j < count) {\n                    const CmmQuad x";
        assert!(source.contains(from), "reduce.cu has changed");
        let broken = load_variant(
            &source.replacen(from, "if (j + 1u < count) {\n                    const CmmQuad x", 1),
            "cmm-host-reduce",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        for out_dtype in [DType::F32, DType::Bf16, DType::F16] {
            for count in 1..=4 {
                let (got, expected) = reduced(kernels(), aligned, count, out_dtype);
                assert!(got == expected, "aligned, {count} inputs into {out_dtype}");
                for layout in unaligned {
                    let (got, expected) = reduced(kernels(), layout, count, out_dtype);
                    assert!(got == expected, "{layout:?}, {count} inputs into {out_dtype}");
                    let (got, expected) = reduced(&broken, layout, count, out_dtype);
                    assert!(got == expected, "{layout:?} on the variant, {count} inputs into {out_dtype}");
                }
                if count > 1 {
                    let (got, expected) = reduced(&broken, aligned, count, out_dtype);
                    assert!(got != expected, "the variant's quads, {count} inputs into {out_dtype}");
                }
            }
        }
    }

    /// The elements `cmm_copy2d` leaves in its destination, copying `rows × cols` elements
    /// of `elem_bytes` from element `offset` of one buffer (rows `src_stride` apart) to
    /// element `offset` of another (rows `dst_stride` apart); and the elements expected
    /// there: the source's in the region, the buffer's fill everywhere else.
    fn copied(
        kernels: &HostKernels,
        (rows, cols, src_stride, dst_stride, offset): (usize, usize, usize, usize, usize),
        elem_bytes: usize,
    ) -> (Vec<u32>, Vec<u32>) {
        use crate::lower::Command;
        const FILL: u32 = 0xabcd;
        let len = |stride: usize| offset + rows * stride;
        let mask = if elem_bytes == 4 { u32::MAX } else { 0xffff };
        let source: Vec<u32> = (0..len(src_stride)).map(|i| (i as u32).wrapping_mul(2_654_435_761) & mask).collect();
        let mut buffers = [packed(&source, elem_bytes), packed(&vec![FILL; len(dst_stride)], elem_bytes)];
        let memory = TestMemory { bases: buffers.iter_mut().map(|b| b.as_mut_ptr() as u64).collect(), sems: 0 };
        let loc = |buffer| Loc { device: 0, buffer, offset: (offset * elem_bytes) as u64 };
        let command = Command::SmCopy {
            src: loc(0),
            src_stride: src_stride as u64,
            dst: loc(1),
            dst_stride: dst_stride as u64,
            rows: rows as u32,
            cols: cols as u32,
            elem_bytes: elem_bytes as u32,
        };
        run_command(kernels, &memory, &command);
        let got = unpacked(&buffers[1], elem_bytes, len(dst_stride));
        let expected = (0..len(dst_stride))
            .map(|i| match in_region(i, (rows, cols, dst_stride, offset)) {
                None => FILL,
                Some((r, c)) => source[offset + r * src_stride + c],
            })
            .collect();
        (got, expected)
    }

    /// `cmm_copy2d` copies 16 bytes a thread where both regions are aligned for it and one
    /// element a thread otherwise, both exactly and nothing outside the destination. A
    /// variant whose 16-byte path leaves each row's last 16 bytes out gets the aligned
    /// layouts wrong and the others right: the layouts run the paths they name.
    #[test]
    fn the_sm_copy_moves_sixteen_bytes_a_thread_or_one_element() {
        // (rows, cols, source stride, destination stride, offset)
        let aligned = (9, 40, 48, 56, 8);
        let unaligned = [(9, 40, 48, 56, 1), (5, 42, 46, 50, 0)];
        let source = host_source();
        let from = "const u32 chunks = (u32)(row_bytes / 16ull);";
        assert!(source.contains(from), "copy.cu has changed");
        let variant = source.replacen(from, "const u32 chunks = (u32)(row_bytes / 16ull) - 1u;", 1);
        let broken = load_variant(&variant, "cmm-host-copy").unwrap_or_else(|e| panic!("{e}"));
        for elem_bytes in [2, 4] {
            let (got, expected) = copied(kernels(), aligned, elem_bytes);
            assert!(got == expected, "aligned, {elem_bytes}-byte elements");
            let (got, expected) = copied(&broken, aligned, elem_bytes);
            assert!(got != expected, "the variant's 16-byte path, {elem_bytes}-byte elements");
            for layout in unaligned {
                for kernels in [kernels(), &broken] {
                    let (got, expected) = copied(kernels, layout, elem_bytes);
                    assert!(got == expected, "{layout:?}, {elem_bytes}-byte elements");
                }
            }
        }
    }

    /// Every command of an ag_moe ring plan with its rows staged (routing tables, staged
    /// grouped GEMMs, copies, signals and waits) enqueues as many driver calls as
    /// `Command::driver_calls` counts toward the gate's limit of calls a lane (a strided
    /// copy asked of the copy engines, one a row, is counted by the fake-driver tests).
    #[test]
    fn each_command_enqueues_the_driver_calls_the_gate_counts() {
        use cmm_core::moe::{build_moe_plan, MoeOp, MoeProblem, Routing};
        use cmm_core::DType;
        let p = MoeProblem::new(MoeOp::AgMoe, 3, 48, 64, 96, 4, 2, Routing::Skewed, DType::Bf16, DType::Bf16);
        let plan = build_moe_plan(&p.unwrap(), cmm_core::Algorithm::Ring).unwrap();
        let options = CudaRunOptions {
            gemm: crate::GemmEngine::Hopper,
            hopper_variant: crate::HopperVariant::StagedGather,
            ..Default::default()
        };
        let lowered = crate::backend::prepare(&plan, 1, &options, false, host_hopper(&options)).unwrap();
        let memory = HostMemory::allocate(&plan, &lowered.staging);
        let control = [0u32; 8];
        let words = crate::launch::RunWords::at(control.as_ptr() as u64, Duration::from_secs(1));
        let mut kinds = std::collections::BTreeSet::new();
        for command in lowered.steps.iter().filter_map(|s| s.command.as_ref()) {
            let calls = crate::launch::submissions(command, &memory, &words).unwrap().len();
            assert_eq!(calls, command.driver_calls(crate::CopyIssue::Auto), "{command:?}");
            kinds.insert(format!("{:?}", std::mem::discriminant(command)));
        }
        assert!(
            lowered.gemms().staged == 3 * 3 && kinds.len() >= 5,
            "{} kinds, {}",
            kinds.len(),
            lowered.gemms().describe()
        );
    }

    /// The rows `cmm_gather_rows` stages for a grouped GEMM of 3 experts over 2 token
    /// chunks whose rows are gathered from a shard of 6 tokens starting at token 3 (K
    /// bf16: K·2/16 whole 16-byte pieces, then the last elements), chunk 1 computed; and
    /// the rows expected: each of chunk 1's segments' rows its token's row, zeros for an
    /// unrouted slot and for a token outside the shard, and the staging's fill everywhere
    /// else (the other chunk's rows, the rows past the routed ones, each row past K).
    fn gathered(kernels: &HostKernels, k: usize) -> (Vec<u32>, Vec<u32>) {
        const FILL: u32 = 0xabcd;
        const NONE: u32 = u32::MAX;
        let stride = k.next_multiple_of(8);
        let (tokens, a_stride, rows) = (6usize, stride + 8, 12usize);
        let a: Vec<u32> = (0..tokens * a_stride).map(|i| (i as u32).wrapping_mul(2_654_435_761) & 0xffff).collect();
        // Segments (expert, chunk): e0 [0,2) [2,4), e1 [4,5) [5,8), e2 [8,8) [8,10).
        let seg = [0u32, 2, 4, 5, 8, 8, 10];
        // Each row's token·2 + slot; chunk 1's rows hold tokens 3..9: row 6 an unrouted
        // slot, row 9 token 9, past the shard's six.
        let perm = [0u32, 2, 6, 9, 1, 7, NONE, 11, 12, 18, NONE, NONE];
        let mut buffers = [packed(&a, 2), packed(&seg, 4), packed(&perm, 4), packed(&vec![FILL; rows * stride], 2)];
        let [a_at, seg_at, perm_at, to] = [0, 1, 2, 3].map(|i| buffers[i].as_mut_ptr() as u64);
        let args = crate::launch::GroupedGemmArgs {
            a: a_at,
            a_stride: a_stride as u64,
            seg: seg_at,
            perm: perm_at,
            perm_stride: 1,
            a_dtype: 2,
            a_rows: tokens as u32,
            rows: rows as u32,
            k: k as u32,
            chunks: 2,
            chunk: 1,
            group_begin: 0,
            group_end: 3,
            experts: 3,
            slots: 2,
            gather: 1,
            gather_base: 3,
            ..Default::default()
        };
        let Submission::Launch(launch) = crate::launch::gather_rows_launch(&args, to, stride as u64).unwrap() else {
            panic!("a launch")
        };
        kernels.launch(&launch).unwrap_or_else(|e| panic!("{e}"));
        let got = unpacked(&buffers[3], 2, rows * stride);
        let source = |r: usize| match perm[r] {
            NONE => None,
            slot => (slot as usize / 2).checked_sub(3).filter(|&t| t < tokens),
        };
        let expected = (0..rows * stride)
            .map(|i| {
                let (r, c) = (i / stride, i % stride);
                let staged = [2..4, 5..8, 8..10].iter().any(|s| s.contains(&r));
                match (staged && c < k, source(r)) {
                    (false, _) => FILL,
                    (true, None) => 0,
                    (true, Some(t)) => a[t * a_stride + c],
                }
            })
            .collect();
        (got, expected)
    }

    /// `cmm_gather_rows` stages exactly chunk 1's rows, 16 bytes a lane and then each row's
    /// last elements (a variant that leaves those out gets them wrong), at K = 20 (two
    /// pieces a row) and K = 1100 (137 pieces: past one round of a warp's four loads a
    /// lane), and refuses a source whose rows are not 16-byte aligned.
    #[test]
    fn staged_gathered_rows_are_the_chunks_rows_in_order() {
        for k in [20, 1100] {
            let (got, expected) = gathered(kernels(), k);
            assert!(got == expected, "K = {k}");
        }
        let source = host_source();
        let from = "for (u32 j = tail + lane; j < a.k; j += 32u)";
        assert!(source.contains(from), "moe.cu has changed");
        let variant = source.replacen(from, "for (u32 j = tail + lane; j < tail; j += 32u)", 1);
        let broken = load_variant(&variant, "cmm-host-gather").unwrap_or_else(|e| panic!("{e}"));
        let (got, expected) = gathered(&broken, 20);
        assert_ne!(got, expected, "the variant without the last elements");
        let unaligned =
            crate::launch::GroupedGemmArgs { a: 256, a_stride: 20, a_dtype: 2, rows: 4, ..Default::default() };
        let e = crate::launch::gather_rows_launch(&unaligned, 512, 24).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("16-byte bases and row strides"), "{e}");
    }

    #[test]
    fn a_missing_compiler_is_a_typed_error() {
        let dir = std::env::temp_dir().join("cmm-host-test-missing");
        let e = build("/nonexistent/c++", "int main() {}", &dir, "cmm-host", &[]).unwrap_err();
        assert!(matches!(e, CudaError::HostBuild { .. }), "{e}");
        assert!(e.to_string().contains("cannot run it") && e.to_string().contains("/nonexistent/c++"), "{e}");
    }

    #[test]
    fn a_compile_error_carries_the_compiler_log() {
        let dir = std::env::temp_dir().join(format!("cmm-host-test-broken-{}", std::process::id()));
        let e = build(&compiler(), "int broken = ;\n", &dir, "cmm-host", &[]).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, CudaError::HostBuild { .. }), "{text}");
        assert!(text.contains("exited with") && text.contains("error"), "{text}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_barrier_in_a_launch_without_fibers_is_an_error_not_a_hang() {
        // One f32 64×64 matrix serves as A, B and C.
        let mut words = vec![0u32; 64 * 64];
        let at = words.as_mut_ptr() as u64;
        let args = crate::launch::GemmArgs {
            a: at,
            b: at,
            c: at,
            a_stride: 64,
            b_stride: 64,
            c_stride: 64,
            m: 64,
            n: 64,
            k: 16,
            ..Default::default()
        };
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let l = Launch { kernel: Kernel::GemmSimt, cfg, params: vec![Param::Gemm(args)], what: "a test gemm" };
        let e = kernels().launch_in(&l, Mode::Plain, FiberOrder::FirstToLast).unwrap_err();
        assert!(e.to_string().contains("barrier in a kernel launched without fibers"), "{e}");
        kernels().launch(&l).unwrap();
    }

    #[test]
    fn a_kernel_writing_past_a_buffer_is_caught_by_the_guards() {
        let spec = crate::GemmSpec {
            m: 3,
            n: 5,
            k: 7,
            input: cmm_core::DType::F16,
            output: cmm_core::DType::F32,
            trans_a: false,
            trans_b: false,
            accumulate: false,
        };
        let plan = crate::backend::gemm_plan(&spec).unwrap();
        let memory = HostMemory::allocate(&plan, &[]);
        memory.check_guards(&plan).unwrap();
        let c = plan.buffers.iter().position(|b| b.name == "C").unwrap();
        let fill = |count: u64| Launch {
            kernel: Kernel::Fill,
            cfg: ONE_THREAD,
            params: vec![Param::U64(memory.base[0][c]), Param::U32(0), Param::U64(count), Param::U32(7)],
            what: "a test fill",
        };
        kernels().launch(&fill(15)).unwrap();
        memory.check_guards(&plan).unwrap();
        kernels().launch(&fill(16)).unwrap();
        let e = memory.check_guards(&plan).unwrap_err();
        assert!(matches!(e, CudaError::OutOfBounds { .. }), "{e}");
        assert!(e.to_string().contains("outside buffer C of device 0 (at byte 0 after its end)"), "{e}");
    }

    #[test]
    fn the_wait_kernel_gives_up_at_its_deadline_and_on_abort_and_passes_when_reached() {
        // Words: semaphore, abort, status why, status seen.
        let words: Vec<AtomicU32> = (0..4).map(|_| AtomicU32::new(0)).collect();
        let at = |w: usize| words.as_ptr() as u64 + 4 * w as u64;
        let wait = |value: u32, timeout_ns: u64| {
            words[2].store(0, Ordering::SeqCst);
            let params = vec![
                Param::U64(at(0)),
                Param::U32(value),
                Param::U64(timeout_ns),
                Param::U64(at(2)),
                Param::U64(at(1)),
            ];
            let l = Launch { kernel: Kernel::Wait, cfg: ONE_THREAD, params, what: "a test wait" };
            kernels().launch(&l).unwrap();
            (words[2].load(Ordering::SeqCst), words[3].load(Ordering::SeqCst))
        };
        words[0].store(2, Ordering::SeqCst);
        assert_eq!(wait(2, 1_000_000).0, 0, "a reached value passes");
        assert_eq!(wait(3, 2_000_000), (1, 2), "the deadline passes: why 1, seen 2");
        words[1].store(1, Ordering::SeqCst);
        assert_eq!(wait(3, 60_000_000_000), (2, 2), "the abort word ends it long before its deadline");
    }
}
