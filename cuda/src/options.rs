//! What a run of a plan the CUDA way is asked ([`CudaRunOptions`]) and what it gives
//! back ([`CudaRunOutput`]): one vocabulary for the GPU backend, its host twin and the
//! pool of rank processes. Also the GEMM shape the backend times alone ([`GemmSpec`]).

use std::time::Duration;

pub use cmm_core::engines::CopyIssue;
use cmm_core::plan::{Op, OpSite, Plan};
use cmm_core::DType;

use crate::backend::GATE_VAR;
use crate::launch::FusedWaits;
use crate::lower::{GemmCounts, GemmEngine, HopperTile, HopperVariant, SyncMode};

/// Where virtual devices live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// All devices on GPU 0, each with its own allocations and streams.
    Virtual,
    /// Device d on GPU d, peers reached over NVLink/PCIe with peer access.
    Gpus,
}

/// How to run a plan.
#[derive(Clone, Copy, Debug)]
pub struct CudaRunOptions {
    /// Device placement.
    pub placement: Placement,
    /// GEMM implementation.
    pub gemm: GemmEngine,
    /// How signals and waits are issued.
    pub sync: SyncMode,
    /// Deadline of every kernel wait.
    pub wait_timeout: Duration,
    /// Deadline of the whole run, from the moment the gate opens.
    pub run_timeout: Duration,
    /// Hold the lanes behind the gate until the whole plan is enqueued (the timed region
    /// then starts with the first op). Off, or with `CUDA_LAUNCH_BLOCKING=1`, the gate
    /// opens before anything is enqueued: a tool that makes launches blocking or runs
    /// GPU work one item at a time (`compute-sanitizer` may) would otherwise hold the
    /// host at the gate's launch until the gate's deadline. Default: on, unless
    /// `CMM_CUDA_GATE=0`.
    pub gate: bool,
    /// Launch signals, waits and SM copies ([`crate::Kernel::communicates`]) at the context's
    /// greatest stream priority, so that a signal another device waits for is not
    /// queued behind the blocks of a GEMM on another stream. Without effect where the
    /// GPU has a single priority or refused a prioritised launch
    /// ([`crate::CudaBackend::comm_priority`]).
    pub comm_priority: bool,
    /// With D virtual devices on one GPU, run device d's lanes at a stream priority below
    /// the communicating kernels' and below device d − 1's
    /// ([`cmm_core::emulate::staggered_priorities`] over the GPU's spare levels), so that when
    /// every device has a GEMM ready the GPU serves them in device order rather than all
    /// at once, and one device's copy runs under the next devices' GEMMs instead of every
    /// device copying at the same moment. Only priorities change, never what waits for
    /// what. Without effect on one GPU per device, or on a GPU with fewer than three
    /// priorities ([`CudaRunOutput::staggered`] says whether it applied).
    pub stagger: bool,
    /// With D virtual devices on one GPU, run the plan with device d's first GEMM waiting
    /// for device d − 1's ([`cmm_core::emulate::offset_starts`]), so that the devices start
    /// one after another rather than in lockstep; the plan's own dependencies then keep
    /// them apart. Only waits are added: results do not change, and a plan that would
    /// deadlock is refused ([`crate::CudaError::Offset`]). Without effect on a plan with
    /// tile-granular GEMMs (a wait would split the kernel) and on one GPU per device
    /// ([`CudaRunOutput::offset_starts`] says whether it applied).
    pub offset_starts: bool,
    /// Record a timed event before and after every op on its stream and report when each
    /// ran ([`CudaRunOutput::op_times`]), for a timeline of the run. The events cost a
    /// little: time plans without it.
    pub time_ops: bool,
    /// Before the run, overwrite twice the L2 of every GPU, so that the run does not
    /// start with the inputs that were just generated in the cache (for timing; the
    /// bench sets it).
    pub cold_l2: bool,
    /// Which buffers come back to the host after the run ([`CudaRunOutput::buffers`]).
    /// Nothing for timing alone: at the seed-000 shape and D = 8 the buffers are 1.3 GB.
    pub read_back: ReadBack,
    /// f16 and bf16 GEMMs that run on the tile kernels, the tile-granular (fused) ones
    /// included, take 128×128 tiles of 8 warps (`cmm_gemm_mma_wide_*`,
    /// `cmm_fused_gemm_mma_wide_*`) instead of 64×64 tiles of 4: twice the arithmetic per
    /// byte staged, and twice the warps per SM in a persistent kernel, which keeps one CTA
    /// per SM. GEMMs on cuBLAS are unaffected.
    pub wide_tiles: bool,
    /// CTAs per SM of a tile-granular (fused) GEMM's persistent kernel: the SMs each
    /// device gets on its GPU times this. 1 (the default) keeps every CTA resident with
    /// room to spare; more run more warps per SM, and are refused unless every SM can hold
    /// one more CTA of the kernel beside them (`cuOccupancyMaxActiveBlocksPerMultiprocessor`),
    /// so that the kernels its waits depend on still find a slot.
    pub fused_ctas_per_sm: u32,
    /// SMs that a fused GEMM's persistent kernels (every device's together) leave without
    /// a CTA of theirs, for the kernels their waits depend on: signals, waits, and the
    /// copies that run on SMs. `None`: one where a CTA fills an SM, none where an SM has
    /// room beside its CTAs (the least that cannot hang). More trade the kernels' SMs for
    /// the communication's (the bench's `free SMs` variant).
    pub fused_free_sms: Option<u32>,
    /// GEMMs that run on cmm's own kernels (fused ones included, and every GEMM under
    /// [`GemmEngine::TileKernel`]) take the Hopper engine (`hopper.cu`) where the GPU runs
    /// it (compute capability 9.0) and TMA's rules allow ([`crate::lower::hopper_rule`]);
    /// the others keep the tile kernels. [`CudaRunOutput::gemms`] counts both.
    /// [`GemmEngine::Hopper`] asks for it on every GEMM whatever this says. Default: on
    /// (the host twin and the fake driver have no Hopper engine and ignore it).
    pub hopper: bool,
    /// The Hopper engine's tile for every GEMM it runs (`None`: its rule's choice).
    pub hopper_tile: Option<HopperTile>,
    /// Which of the Hopper engine's kernels its GEMMs take: [`HopperVariant::Engine`] but
    /// in the GEMM sweep. Plain GEMMs take any; fused and grouped ones any but clusters
    /// (a fused run's blocks wait for their own rows; a grouped GEMM's tiles are no pairs).
    /// Only the 128×128 tile has ping-pong kernels: GEMMs on the other keep the engine's.
    pub hopper_variant: HopperVariant,
    /// How the plan's copy-engine copies are issued ([`CopyIssue`]).
    pub copies: CopyIssue,
}

/// Which buffers a run copies back to the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadBack {
    /// None: [`CudaRunOutput::buffers`] is empty.
    Nothing,
    /// Every buffer of every device.
    Everything,
    /// The results (outputs and accumulators) of every device; the other buffers come
    /// back empty.
    Results,
}

impl ReadBack {
    /// Whether buffer `b` comes back.
    pub(crate) fn wants(self, b: &cmm_core::plan::BufferDecl) -> bool {
        match self {
            ReadBack::Nothing => false,
            ReadBack::Everything => true,
            ReadBack::Results => b.role.is_result(),
        }
    }
}

/// The longest deadline a run takes, for a wait or for the whole run: a day.
pub const MAX_DEADLINE: Duration = Duration::from_secs(86_400);

/// A wait's deadline where the kernels run on the CPU (the host twin, the fake driver):
/// the corpus's plans finish in milliseconds there too, but the deadline is wall time on a
/// shared CPU (a hundred stream threads on two cores, a CI machine that can pause), where a
/// GPU's 10 s has run out with nothing wrong in the plan (docs/cuda.md, the host twin). A
/// hang still ends in an error naming the wait.
pub const EMULATED_WAIT_TIMEOUT: Duration = Duration::from_secs(60);

impl CudaRunOptions {
    /// Whether its GEMMs may take the Hopper engine: on cmm's own kernels
    /// ([`Self::hopper`]), or on every GEMM ([`GemmEngine::Hopper`]).
    pub fn asks_hopper(&self) -> bool {
        self.hopper || self.gemm == GemmEngine::Hopper
    }

    /// Why the deadlines cannot be kept, if they cannot: a wait's or the run's longer than
    /// [`MAX_DEADLINE`] (the kernels count a deadline in nanoseconds, and the host adds and
    /// doubles them), or a wait's of zero (every wait would fail at once).
    pub fn deadlines_refused(&self) -> Option<String> {
        let secs = |d: Duration| d.as_secs_f64();
        if self.wait_timeout.is_zero() {
            Some("a wait deadline of 0 s: every wait would time out at once".into())
        } else if self.wait_timeout > MAX_DEADLINE || self.run_timeout > MAX_DEADLINE {
            Some(format!(
                "deadlines of {} s a wait and {} s a run: at most {} s each (a day)",
                secs(self.wait_timeout),
                secs(self.run_timeout),
                MAX_DEADLINE.as_secs()
            ))
        } else {
            None
        }
    }

    /// The defaults with the deadlines of a run on the CPU: every wait
    /// [`EMULATED_WAIT_TIMEOUT`], the run twice that (so that a hung wait is named by its
    /// own deadline first). Runs that are meant to hang set their own, shorter ones.
    pub fn emulated() -> CudaRunOptions {
        CudaRunOptions {
            wait_timeout: EMULATED_WAIT_TIMEOUT,
            run_timeout: 2 * EMULATED_WAIT_TIMEOUT,
            ..CudaRunOptions::default()
        }
    }
}

impl Default for CudaRunOptions {
    fn default() -> Self {
        CudaRunOptions {
            placement: Placement::Virtual,
            gemm: GemmEngine::Auto,
            sync: SyncMode::Kernels,
            wait_timeout: Duration::from_secs(10),
            run_timeout: Duration::from_secs(60),
            gate: std::env::var(GATE_VAR).map_or(true, |v| v.trim() != "0"),
            comm_priority: true,
            stagger: false,
            offset_starts: false,
            time_ops: false,
            cold_l2: false,
            read_back: ReadBack::Everything,
            wide_tiles: false,
            fused_ctas_per_sm: 1,
            fused_free_sms: None,
            hopper: true,
            hopper_tile: None,
            hopper_variant: HopperVariant::Engine,
            copies: CopyIssue::Auto,
        }
    }
}

/// `(op, start µs, duration µs)` of the ops of a run ([`CudaRunOptions::time_ops`]).
pub type OpTimes = Vec<(OpSite, f64, f64)>;

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct CudaRunOutput {
    /// `[device][buffer]` words (the layout of `cmm_core::cpu::Memory`), for the buffers
    /// [`CudaRunOptions::read_back`] asks for (the others empty); empty with
    /// [`ReadBack::Nothing`].
    pub buffers: Vec<Vec<Vec<u32>>>,
    /// GPU time of the plan's ops, from CUDA events around all streams.
    pub gpu_time: Duration,
    /// Whether the lanes were held behind the gate until the whole plan was enqueued
    /// (plans too long for the launch queues run ungated, and `gpu_time` then includes
    /// the host's enqueueing).
    pub gated: bool,
    /// Which engine ran the GEMMs.
    pub gemms: GemmCounts,
    /// The priority signals, waits and SM copies were launched at on GPU 0 (`None`: the
    /// default one, as every other launch; always `None` on the host twin).
    pub comm_priority: Option<i32>,
    /// The stream priority of each device's lanes where [`CudaRunOptions::stagger`]
    /// applied (empty: every lane at the default priority).
    pub staggered: Vec<i32>,
    /// Whether the devices' starts were offset ([`CudaRunOptions::offset_starts`]).
    pub offset_starts: bool,
    /// With [`CudaRunOptions::time_ops`], `(op, start µs, duration µs)` of every op from the
    /// start of the run (the ops of the plan that ran: with offset starts, that plan);
    /// otherwise empty.
    pub op_times: OpTimes,
    /// Per fused GEMM of the plan, in step order: what its CTAs spent in their blocks'
    /// waits (counted by the Hopper engine; zeros on the tile kernels; empty from a
    /// one-process-per-device run).
    pub fused_waits: Vec<FusedWaits>,
    /// Wall time of the whole run.
    pub elapsed: Duration,
}

/// One GEMM shape for [`crate::CudaBackend::time_gemm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmSpec {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// Reduction length.
    pub k: usize,
    /// Dtype of A and B.
    pub input: DType,
    /// Dtype of C.
    pub output: DType,
    /// Transpose A.
    pub trans_a: bool,
    /// Transpose B.
    pub trans_b: bool,
    /// C += A·B (C must be f32).
    pub accumulate: bool,
}

impl GemmSpec {
    /// The spec of a plan's `Gemm` op (`None` for other ops or mixed input dtypes).
    pub fn of(plan: &Plan, op: &Op) -> Option<GemmSpec> {
        let Op::Gemm { a, b, c, trans_a, trans_b, accumulate, .. } = op else { return None };
        let (ta, tb) = (plan.buffer(a.buf).dtype, plan.buffer(b.buf).dtype);
        (ta == tb).then(|| GemmSpec {
            m: c.rows,
            n: c.cols,
            k: if *trans_a { a.rows } else { a.cols },
            input: ta,
            output: plan.buffer(c.buf).dtype,
            trans_a: *trans_a,
            trans_b: *trans_b,
            accumulate: *accumulate,
        })
    }

    /// 2·m·n·k.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}
