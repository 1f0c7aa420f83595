//! The discrete-event simulator: replays any plan with durations from a profile.
//!
//! Every (device, lane) is a sequential queue (and with [`SimOptions::hardware_queues`],
//! the lanes also share the GPU's FIFO hardware queues). An op goes through phases:
//!
//! - `Gemm`: launch overhead, then its work (FLOPs at the profile's efficiency, or its HBM
//!   traffic, whichever is slower) on the device's compute resource;
//! - `Reduce`: launch overhead, then its HBM traffic on the compute resource;
//! - `Copy` to a peer: launch overhead, then its bytes through every link of its route
//!   (capped by the engine's rate: copy engine or SM copy), then one latency per hop;
//!   a local copy reads and writes its bytes through the device's HBM;
//! - `Signal`: one latency per hop, then the increment lands on the target semaphore;
//! - `Wait`: blocks until the semaphore reaches the value, then pays a synchronisation cost:
//!   `local_wait_us` when the Signal that satisfied it came from the same device; otherwise
//!   `remote_round_us` (fence + semaphore round, seed 000's 6 µs) when the lane next runs SM
//!   work (GEMM, reduce, SM copy), or `dma_wait_us` when it next runs a copy-engine copy or
//!   nothing (the DMA front end only polls the flag).
//!
//! Shared resources (links, switch ports, HBM, compute) are **fair-shared**: the active
//! users of every resource get max-min fair rates (progressive filling), recomputed
//! whenever a transfer starts or ends. A plan that cannot finish is a [`SimError::Deadlock`].
//! Only shapes are used: no tensor is ever allocated.

use thiserror::Error;

use super::profile::Profile;
use super::topology::{ResId, ResourceKind, Topology};
use cmm_core::dtype::DType;
use cmm_core::engines::CopyIssue;
use cmm_core::plan::{Engine, FusedRun, Op, OpSite, Plan, PlanError, Region, SemId};
use cmm_core::schedule::BlockedLane;
use cmm_core::verify::accesses;

/// How to simulate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimOptions {
    /// Torus shape for torus profiles (product = devices); default a ring of all devices.
    pub torus_dims: Option<Vec<usize>>,
    /// Per device, the priority of its work on a compute resource, as CUDA numbers stream
    /// priorities: a lower number is served first, and work of one priority shares what
    /// the greater ones leave fairly. Empty: every device at one priority. Only a resource
    /// shared by devices (one GPU's compute) makes it matter.
    pub compute_priority: Vec<i32>,
    /// Which engine prices each GEMM: [`Engines::AsBuilt`] (default), what the CUDA
    /// backend runs it on; or [`Engines::CublasSpeed`], every GEMM at the profile's library
    /// rate (a potential, not what cmm runs).
    pub engines: Engines,
    /// The GPU's hardware queues, as the CUDA backend meets them: `None` (default), every
    /// lane on its own, as `CUDA_DEVICE_MAX_CONNECTIONS` ≥ the plan's streams gives (`cargo
    /// xtask` asks for 32); `Some`, the lanes' ops share FIFO queues in the backend's
    /// enqueue order ([`HardwareQueues`]).
    pub hardware_queues: Option<HardwareQueues>,
    /// How the CUDA backend issues the plan's copy-engine copies (its `--copies`), on a
    /// driver that has the batched copy call: on one GPU, those the driver makes its own
    /// way share the profile's `copy.driver_gbps` ([`CopyIssue::driver_makes`]; default
    /// [`CopyIssue::Auto`], as cmm issues them). Elsewhere it changes nothing.
    pub copies: CopyIssue,
}

/// FIFO hardware queues shared by a plan's streams, as `cmm_core::verify::queues` models
/// them: stream `s` (device by device, lane by lane) feeds queue `(s + offset) mod queues`
/// with its ops in the CUDA backend's enqueue order (the schedule order, a fused run whole
/// at its last block); an op leaves its queue when it starts, and starts only once its
/// own lane has finished the op before it, so an op waiting for its lane holds every op
/// behind it in the queue, of any stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HardwareQueues {
    /// How many (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 when unset).
    pub queues: usize,
    /// The queue stream 0 feeds (the driver's round-robin counter, unknown to the host).
    pub offset: usize,
}

/// How the simulator prices GEMMs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Engines {
    /// Each GEMM on the engine the CUDA backend picks for it under this policy
    /// ([`cmm_core::engines`]), at that engine's rate in the profile.
    #[default]
    AsBuilt,
    /// Every GEMM, fused ones included, at the profile's library (cuBLAS) rate: what the
    /// plan would take if cmm's kernels ran as fast as cuBLAS.
    CublasSpeed,
}

/// Why a plan cannot be simulated.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum SimError {
    /// The plan is malformed.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The plan has more devices than the profile's system.
    #[error("plan `{plan}` has {devices} devices; profile {profile} describes at most {max} (a multi-node profile such as h100-ib, or one with a [network] section, describes more)")]
    TooManyDevices {
        /// Plan name.
        plan: String,
        /// Devices of the plan.
        devices: usize,
        /// Profile name.
        profile: String,
        /// The profile's limit.
        max: usize,
    },
    /// The torus shape does not hold the plan's devices.
    #[error("torus shape {dims:?} does not hold the {devices} devices of the plan")]
    TorusShape {
        /// The shape given.
        dims: Vec<usize>,
        /// Devices of the plan.
        devices: usize,
    },
    /// The hardware queue count is outside what CUDA offers.
    #[error("{queues} hardware queues: CUDA offers 1 to {}", cmm_core::verify::queues::MAX_QUEUES)]
    HardwareQueues {
        /// The count asked for.
        queues: usize,
    },
    /// The plan cannot finish.
    #[error("plan `{plan}` deadlocks at {time_us:.3} µs; blocked: {}", .blocked.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Deadlock {
        /// Plan name.
        plan: String,
        /// Simulated time when nothing could move.
        time_us: f64,
        /// Every blocked lane.
        blocked: Vec<BlockedLane>,
    },
}

/// What kind of op a record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// A GEMM.
    Gemm,
    /// A copy to the same device.
    LocalCopy,
    /// A copy to a peer.
    RemoteCopy,
    /// A reduction.
    Reduce,
    /// A semaphore increment.
    Signal,
    /// A semaphore wait.
    Wait,
}

impl OpClass {
    /// Whether the op keeps the device's compute engine busy.
    pub fn is_compute(self) -> bool {
        matches!(self, OpClass::Gemm | OpClass::Reduce)
    }
}

/// When one op ran.
#[derive(Clone, Debug, PartialEq)]
pub struct OpRecord {
    /// Where it is in the plan.
    pub site: OpSite,
    /// Its kind.
    pub class: OpClass,
    /// When its lane reached it, seconds.
    pub reached_s: f64,
    /// When it started working (for a Wait: when it was satisfied), seconds.
    pub start_s: f64,
    /// When it finished, seconds.
    pub end_s: f64,
    /// The op whose end determined this op's start: the previous op of the lane, or for a
    /// blocked Wait the Signal that satisfied it, or for an op held in its hardware queue
    /// ([`SimOptions::hardware_queues`]) the op ahead of it there, whose start released it.
    pub pred: Option<OpSite>,
    /// Bytes moved (copies) or touched (reduces).
    pub bytes: f64,
    /// Floating-point operations (GEMMs).
    pub flops: f64,
    /// Seconds of standalone work (GEMM/reduce at full compute, copy at full bandwidth).
    pub work_s: f64,
    /// When its compute ended: its end, but for a GEMM on a peer's c across a link, when
    /// the epilogue's transfer began (what follows is communication), seconds.
    pub compute_end_s: f64,
}

/// The result of simulating a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// Plan name.
    pub plan: String,
    /// Profile name.
    pub profile: String,
    /// Devices.
    pub devices: usize,
    /// Lane names.
    pub lanes: Vec<String>,
    /// Time the last op ends, seconds.
    pub makespan_s: f64,
    /// Max over devices of the GEMM and reduce work (no launch overhead), seconds; on one
    /// GPU, the sum over its devices.
    pub compute_floor_s: f64,
    /// Max over directed links of bytes / bandwidth, seconds.
    pub comm_floor_s: f64,
    /// The link behind `comm_floor_s`, if any bytes crossed a link.
    pub busiest_link: Option<String>,
    /// `[device][lane][index]` records.
    pub records: Vec<Vec<Vec<OpRecord>>>,
    /// `[device][lane]` time spent executing ops (not blocked), seconds.
    pub lane_busy_s: Vec<Vec<f64>>,
    /// Per device: makespan minus the time its compute engine runs GEMMs/reduces (on one
    /// GPU, the GPU's: any device's), seconds.
    pub exposed_comm_s: Vec<f64>,
    /// The chain of ops that determines the makespan, first to last.
    pub critical_path: Vec<OpSite>,
    /// The engine each GEMM was priced on (fused runs counted once, grouped GEMMs
    /// included; attention blocks apart).
    pub engines: cmm_core::engines::EngineCounts,
    /// How GEMMs were priced.
    pub pricing: Engines,
    /// The profile gives one GEMM rate and none of cmm's kernels (the TPU's): `engines`
    /// then names what the CUDA backend would pick, each priced at that one rate.
    pub one_rate: bool,
    /// The hardware queues the lanes shared, where modelled ([`SimOptions::hardware_queues`]).
    pub hardware_queues: Option<HardwareQueues>,
    /// How the copy-engine copies were issued ([`SimOptions::copies`]).
    pub copies: CopyIssue,
    /// On one GPU with the profile's `copy.driver_gbps`: the copies between virtual
    /// devices priced as the driver's own, counted once each.
    pub driver_copies: usize,
}

impl SimReport {
    /// Every record, device by device, lane by lane.
    pub fn ops(&self) -> impl Iterator<Item = &OpRecord> + '_ {
        self.records.iter().flatten().flatten()
    }

    /// The record of one op.
    pub fn record(&self, site: OpSite) -> &OpRecord {
        &self.records[site.device][site.lane][site.index]
    }

    /// What priced the GEMMs, in words: "cuBLAS ×12, Hopper engine 128x256 ×1", or on a
    /// profile with one GEMM rate (which has no cuBLAS to name) "16 GEMM(s) at the
    /// profile's rate".
    pub fn gemm_engines(&self) -> String {
        if self.one_rate {
            format!("{} GEMM(s) at the profile's rate", self.gemm_count())
        } else {
            self.engines.describe()
        }
    }

    /// The GEMMs the plan ran, on every engine.
    pub fn gemm_count(&self) -> usize {
        self.engines.0.iter().map(|(_, n)| n).sum()
    }

    /// Largest exposed communication over devices, seconds.
    pub fn max_exposed_comm_s(&self) -> f64 {
        self.exposed_comm_s.iter().copied().fold(0.0, f64::max)
    }

    /// Mean duration of the ops of a class (0 when there are none), seconds.
    pub fn mean_duration_s(&self, class: OpClass) -> f64 {
        let (n, total) =
            self.ops().filter(|r| r.class == class).fold((0usize, 0.0), |(n, t), r| (n + 1, t + (r.end_s - r.start_s)));
        if n == 0 {
            0.0
        } else {
            total / n as f64
        }
    }

    /// Total time lanes spent blocked in Waits on device `device`'s compute lanes (lanes
    /// that run GEMMs), seconds.
    pub fn blocked_on_compute_lanes_s(&self, device: usize) -> f64 {
        self.records[device]
            .iter()
            .filter(|lane| lane.iter().any(|r| r.class == OpClass::Gemm))
            .flatten()
            .filter(|r| r.class == OpClass::Wait)
            .map(|r| r.start_s - r.reached_s)
            .sum()
    }
}

enum Phase {
    Fixed(f64),
    /// `amount` units through every resource of `resources`, at most `cap` per second;
    /// on one GPU, also `hbm_bytes` over the whole amount through its HBM.
    Fluid {
        amount: f64,
        cap: f64,
        resources: Vec<ResId>,
        hbm_bytes: f64,
    },
    Deliver {
        device: usize,
        sem: SemId,
        add: u32,
    },
    Block {
        sem: SemId,
        value: u32,
    },
    /// A Wait between the blocks of a tile-granular GEMM: the kernel's next tiles poll
    /// the flag, so it costs nothing when already set, and a synchronisation round when
    /// the kernel has to wait for it.
    Gate {
        sem: SemId,
        value: u32,
    },
    /// A Signal between the blocks of a tile-granular GEMM: the kernel posts it and goes
    /// on computing; it lands after the latency.
    Post {
        device: usize,
        sem: SemId,
        add: u32,
        latency: f64,
    },
    /// The op's compute is done; the rest of it moves data ([`OpRecord::compute_end_s`]).
    ComputeDone,
}

/// A posted increment on its way to its semaphore.
struct InFlight {
    at: f64,
    device: usize,
    sem: SemId,
    add: u32,
    from: OpSite,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum LaneState {
    Ready,
    Timed(f64),
    Flowing,
    Blocked,
    /// Its next op waits for the ops ahead of it in its hardware queue to start.
    Queued,
    Finished,
}

struct Flow {
    lane: usize,
    /// Whether it runs on a compute resource (a GEMM, a reduce), not a copy.
    computes: bool,
    /// Served before every flow with a greater number ([`SimOptions::compute_priority`]).
    priority: i32,
    remaining: f64,
    cap: f64,
    /// Each resource with what one unit of the flow takes of it.
    resources: Vec<(ResId, f64)>,
    rate: f64,
}

struct LaneRun {
    device: usize,
    lane: usize,
    pc: usize,
    phases: Vec<Phase>,
    step: usize,
    state: LaneState,
    /// Since when op `pc`, its lane done with the op before, has waited in its hardware
    /// queue (`None`: the previous op is not yet closed).
    queued_since: Option<f64>,
    /// The tile-granular GEMM (its index in `Sim::runs`) whose part op `pc` is (a block,
    /// or a Wait or Signal between blocks), once started: its persistent kernel holds SMs.
    persistent: Option<usize>,
}

/// An op's hardware queue and its position there.
type QueueSlot = Option<(usize, usize)>;

/// Each op's place in its hardware queue ([`SimOptions::hardware_queues`]).
struct QueueSlots {
    /// Per device, lane and op: (queue, position), or none for the ops inside a fused
    /// run after its first (one kernel, one place).
    slots: Vec<Vec<Vec<QueueSlot>>>,
    /// Per queue, its ops in order.
    order: Vec<Vec<OpSite>>,
    /// Per queue, how many of its ops have started.
    started: Vec<usize>,
}

impl QueueSlots {
    fn new(plan: &Plan, runs: &[FusedRun], hw: HardwareQueues) -> Result<QueueSlots, SimError> {
        let queues = hw.queues;
        if !(1..=cmm_core::verify::queues::MAX_QUEUES).contains(&queues) {
            return Err(SimError::HardwareQueues { queues });
        }
        let order = cmm_core::verify::queues::schedule_order(plan).map_err(|d| SimError::Deadlock {
            plan: plan.name.clone(),
            time_us: 0.0,
            blocked: d.blocked,
        })?;
        let mut slots: Vec<Vec<Vec<QueueSlot>>> =
            plan.programs.iter().map(|p| p.lanes.iter().map(|ops| vec![None; ops.len()]).collect()).collect();
        let mut per_queue: Vec<Vec<OpSite>> = vec![Vec::new(); queues];
        for site in cmm_core::verify::queues::with_fused_runs_whole(&order, runs) {
            if runs.iter().any(|r| r.holds(site) && site.index != r.blocks[0]) {
                continue;
            }
            // Each term reduced first: an offset near 2^64 (`--queue-offset`) must not wrap.
            let q = (cmm_core::verify::queues::stream_of(plan, site) % queues + hw.offset % queues) % queues;
            slots[site.device][site.lane][site.index] = Some((q, per_queue[q].len()));
            per_queue[q].push(site);
        }
        Ok(QueueSlots { slots, order: per_queue, started: vec![0; queues] })
    }
}

/// A semaphore increment that has landed.
struct Landed {
    value_after: u32,
    from: OpSite,
}

struct Sim<'a> {
    plan: &'a Plan,
    profile: &'a Profile,
    topo: Topology,
    compute_priority: Vec<i32>,
    now: f64,
    lanes: Vec<LaneRun>,
    flows: Vec<Flow>,
    flows_dirty: bool,
    sems: Vec<Vec<u32>>,
    landed: Vec<Vec<Vec<Landed>>>,
    records: Vec<Vec<Vec<OpRecord>>>,
    link_bytes: Vec<f64>,
    /// Routing tables per (device, segment buffer), built on first use.
    routes: std::collections::HashMap<(usize, cmm_core::plan::BufId), cmm_core::moe::Tables>,
    /// The plan's tile-granular GEMMs.
    runs: Vec<FusedRun>,
    /// Per run, the work of each block: the run's one-kernel cost shared by tiles.
    block_work: Vec<Vec<f64>>,
    /// Per run: priced at the rate its engine's persistent kernels reach together on one
    /// GPU (set once its engine is known, before the run starts).
    run_together: Vec<bool>,
    /// Posted increments not landed yet.
    in_flight: Vec<InFlight>,
    /// How GEMMs are priced, and what ran them.
    pricing: Engines,
    engines: cmm_core::engines::EngineCounts,
    /// The hardware queues the lanes share, if modelled, and each op's place in them.
    hardware_queues: Option<HardwareQueues>,
    queues: Option<QueueSlots>,
    /// How the copy-engine copies are issued ([`SimOptions::copies`]), and how many
    /// between virtual devices the driver made its own way.
    copies: CopyIssue,
    driver_copies: usize,
}

/// The seed whose routing the simulator prices grouped GEMMs with (the router's
/// distribution is the problem's; which tokens go where barely changes the time).
pub const SIM_ROUTING_SEED: u32 = 1;

fn dtype_of(plan: &Plan, buf: cmm_core::plan::BufId) -> DType {
    plan.buffer(buf).dtype
}

impl<'a> Sim<'a> {
    fn class(op: &Op, device: usize) -> OpClass {
        match op {
            Op::Gemm { .. } | Op::Attend { .. } | Op::GroupedGemm { .. } => OpClass::Gemm,
            Op::Copy { dst_device, .. } if *dst_device == device => OpClass::LocalCopy,
            Op::Copy { .. } => OpClass::RemoteCopy,
            Op::Reduce { .. }
            | Op::Pointwise { .. }
            | Op::AttnMerge { .. }
            | Op::AttnFinish { .. }
            | Op::Route { .. }
            | Op::Combine { .. } => OpClass::Reduce,
            Op::Signal { .. } => OpClass::Signal,
            Op::Wait { .. } => OpClass::Wait,
        }
    }

    /// The phases of an op and its (bytes, flops, standalone work) for the record.
    fn phases(&mut self, device: usize, op: &Op) -> (Vec<Phase>, f64, f64, f64) {
        let p = self.profile;
        let launch = p.launch_s();
        match op {
            Op::Gemm { a, b, c, trans_a, accumulate, c_device, .. } => {
                let k = if *trans_a { a.rows } else { a.cols };
                let (da, db) = (dtype_of(self.plan, a.buf), dtype_of(self.plan, b.buf));
                // Mixed inputs run at the slower operand's rate.
                let input = if p.peak_flops(da) <= p.peak_flops(db) { da } else { db };
                let engine = self.gemm_engine(op);
                let cost = p.gemm_cost_on(engine, c.rows, c.cols, k, input, dtype_of(self.plan, c.buf), *accumulate);
                let flops = 2.0 * c.rows as f64 * c.cols as f64 * k as f64;
                let mut phases = self.compute_phases(device, cost.work_s, cost.bytes);
                // The library's fixed cost is latency beside the kernel's work, not a share
                // of the compute: GEMMs at once overlap their fills and last epilogues.
                if let [Phase::Fixed(launch), Phase::Fluid { amount, .. }] = &mut phases[..] {
                    *launch += cost.fixed_s;
                    *amount -= cost.fixed_s;
                }
                let (epilogue, moved, route) = self.peer_epilogue(device, *c_device, c, *accumulate);
                for &r in &route {
                    self.link_bytes[r] += moved;
                }
                phases.extend(epilogue);
                (phases, moved, flops, cost.work_s - cost.fixed_s)
            }
            // Two GEMMs over the visible score tiles (Q·Kᵀ and P·V), see
            // `Profile::attention_cost`; masked key tiles are skipped, so a causal block
            // costs its visible fraction. The softmax's exponentials overlap the GEMMs, as
            // in FlashAttention-3, and are not timed separately.
            Op::Attend { q, k, heads, causal, .. } => {
                let dh = q.cols / heads;
                let visible = match causal {
                    None => 1.0,
                    Some(c) => cmm_core::attention::visible_fraction(c, q.rows, k.rows),
                };
                let input = dtype_of(self.plan, q.buf);
                let mut cost = p.attention_cost(q.rows * heads, k.rows, dh, k.len(), input, visible);
                let flops = 4.0 * (q.rows * heads * dh) as f64 * k.rows as f64 * visible;
                if self.pricing == Engines::AsBuilt {
                    cost = p.scalar_kernel_cost(|e| e.attention, flops, cost.bytes).unwrap_or(cost);
                }
                (self.compute_phases(device, cost.work_s, cost.bytes), 0.0, flops, cost.work_s)
            }
            // The groups' rows come from the routing of this device's route op.
            Op::GroupedGemm { b, c, tables, experts, groups, chunk, gather, .. } => {
                let t = self.tables(device, tables.seg.buf);
                let chunks = tables.chunks(*experts);
                let rows: Vec<usize> =
                    groups.clone().map(|e| t.as_ref().map_or(0, |t| t.segment(e, *chunk, chunks).len())).collect();
                let k = b.rows / experts;
                let (input, output) = (dtype_of(self.plan, b.buf), dtype_of(self.plan, c.buf));
                let flops = 2.0 * rows.iter().sum::<usize>() as f64 * c.cols as f64 * k as f64;
                let cost = match self.grouped_engine(op) {
                    Some(engine @ cmm_core::engines::Engine::Hopper(_)) => {
                        p.grouped_gemm_cost_on(engine, &rows, c.cols, k, input, output, gather.is_some())
                    }
                    Some(cmm_core::engines::Engine::ScalarGrouped) => {
                        let cost = p.grouped_gemm_cost(&rows, c.cols, k, input, output);
                        p.scalar_kernel_cost(|e| e.grouped, flops, cost.bytes).unwrap_or(cost)
                    }
                    _ => p.grouped_gemm_cost(&rows, c.cols, k, input, output),
                };
                (self.compute_phases(device, cost.work_s, cost.bytes), 0.0, flops, cost.work_s)
            }
            // Memory-bound: every region the op reads or writes (its verifier accesses)
            // crosses HBM once; a combine reads only the k rows of each token.
            Op::Reduce { .. }
            | Op::Pointwise { .. }
            | Op::AttnMerge { .. }
            | Op::AttnFinish { .. }
            | Op::Route { .. }
            | Op::Combine { .. } => {
                let size = |r: &cmm_core::plan::Region| r.len() as f64 * dtype_of(self.plan, r.buf).size_bytes() as f64;
                let bytes: f64 = match op {
                    Op::Combine { rows, weights, inv, out } => {
                        let row_bytes = rows.cols as f64 * dtype_of(self.plan, rows.buf).size_bytes() as f64;
                        inv.len() as f64 * row_bytes + size(weights) + size(inv) + size(out)
                    }
                    _ => accesses(device, op).iter().map(|a| size(&a.region)).sum(),
                };
                let rate = if matches!(op, Op::Reduce { .. }) { p.reduce_bps() } else { p.hbm_bps() };
                let work = bytes / rate;
                (self.compute_phases(device, work, bytes), bytes, 0.0, work)
            }
            Op::Copy { src, dst_device, engine, .. } => {
                let bytes = src.len() as f64 * dtype_of(self.plan, src.buf).size_bytes() as f64;
                let rate = 1e9
                    * match engine {
                        Engine::CopyEngine => p.copy.copy_engine_gbps,
                        Engine::Sm => p.copy.sm_copy_gbps,
                    };
                if *dst_device == device || self.topo.one_gpu() {
                    // Through one HBM, each byte read and written once: a local copy at
                    // whatever rate the HBM gives it, a copy between virtual devices of one
                    // GPU at most at the engine's, then the signal latency. A copy the
                    // driver makes its own way queues with the others it makes for one
                    // copy's rate.
                    let mut resources = vec![self.topo.hbm(device)];
                    let mut cap = if *dst_device == device { f64::INFINITY } else { 2.0 * rate };
                    if let (Some(pipe), Some(gbps)) = (self.topo.driver_copies(), p.copy.driver_gbps) {
                        if *dst_device != device && *engine == Engine::CopyEngine && self.driver_makes(op) {
                            resources.push(pipe);
                            cap = 2e9 * gbps;
                            self.driver_copies += 1;
                        }
                    }
                    let latency = self.topo.latency_s(device, *dst_device);
                    (
                        vec![
                            Phase::Fixed(launch),
                            Phase::Fluid { amount: 2.0 * bytes, cap, resources, hbm_bytes: 0.0 },
                            Phase::Fixed(latency),
                        ],
                        bytes,
                        0.0,
                        2.0 * bytes / cap.min(p.hbm_bps()),
                    )
                } else {
                    let route = self.topo.route(device, *dst_device);
                    for &r in &route {
                        self.link_bytes[r] += bytes;
                    }
                    let latency = self.topo.latency_s(device, *dst_device);
                    let work = bytes / rate.min(p.link_bps());
                    (
                        vec![
                            Phase::Fixed(launch),
                            Phase::Fluid { amount: bytes, cap: rate, resources: route, hbm_bytes: 0.0 },
                            Phase::Fixed(latency),
                        ],
                        bytes,
                        0.0,
                        work,
                    )
                }
            }
            Op::Signal { device: target, sem, add } => {
                let latency = self.topo.latency_s(device, *target);
                (vec![Phase::Fixed(latency), Phase::Deliver { device: *target, sem: *sem, add: *add }], 0.0, 0.0, 0.0)
            }
            Op::Wait { sem, value } => (vec![Phase::Block { sem: *sem, value: *value }], 0.0, 0.0, 0.0),
        }
    }

    /// The routing tables a device's route op writes into segment buffer `seg`, from the
    /// router's ids under [`SIM_ROUTING_SEED`] (`None` if no route op reads a router).
    fn tables(&mut self, device: usize, seg: cmm_core::plan::BufId) -> Option<cmm_core::moe::Tables> {
        if let Some(t) = self.routes.get(&(device, seg)) {
            return Some(t.clone());
        }
        let plan = self.plan;
        let found = plan.programs[device].lanes.iter().flatten().find_map(|op| match op {
            Op::Route { ids, tables, experts } if tables.seg.buf == seg => Some((ids, tables, *experts)),
            _ => None,
        });
        let (ids, tables, experts) = found?;
        let cmm_core::plan::BufferRole::Router { router, .. } = &plan.buffer(ids.buf).role else { return None };
        let t = cmm_core::moe::route(
            &router.ids(SIM_ROUTING_SEED),
            ids.cols,
            experts,
            tables.chunks(experts),
            tables.shards,
            tables.perm.rows,
        );
        self.routes.insert((device, seg), t.clone());
        Some(t)
    }

    /// Moves lane `li` as far as it can at the current time; returns whether it moved.
    fn advance(&mut self, li: usize) -> bool {
        let mut moved = false;
        loop {
            let (device, lane) = (self.lanes[li].device, self.lanes[li].lane);
            match self.lanes[li].state {
                LaneState::Finished | LaneState::Timed(_) | LaneState::Flowing => return moved,
                LaneState::Ready | LaneState::Blocked | LaneState::Queued => {}
            }
            let ops = &self.plan.programs[device].lanes[lane];
            let run = &mut self.lanes[li];
            if run.step >= run.phases.len() {
                // The current op (if any) is done; start the next one.
                if run.queued_since.is_none() {
                    if run.pc > 0 || !run.phases.is_empty() {
                        let record = &mut self.records[device][lane][run.pc];
                        record.end_s = self.now;
                        if record.compute_end_s.is_nan() {
                            record.compute_end_s = self.now;
                        }
                        run.pc += 1;
                        moved = true;
                        if run.persistent.take().is_some() {
                            self.flows_dirty = true;
                        }
                    }
                    if run.pc >= ops.len() {
                        run.state = LaneState::Finished;
                        return true;
                    }
                    run.queued_since = Some(self.now);
                }
                let index = run.pc;
                let reached = run.queued_since.unwrap_or(self.now);
                // Its hardware queue lets it start once every op ahead of it has.
                let mut queued_behind = None;
                if let Some(q) = &mut self.queues {
                    if let Some((queue, position)) = q.slots[device][lane][index] {
                        if q.started[queue] < position {
                            run.state = LaneState::Queued;
                            return moved;
                        }
                        q.started[queue] += 1;
                        queued_behind = (position > 0 && self.now > reached).then(|| q.order[queue][position - 1]);
                    }
                }
                run.queued_since = None;
                let op = &ops[index];
                let (mut phases, bytes, flops, mut work_s) = self.phases(device, op);
                if let Some((fused, work, run)) = self.fused_phases(OpSite { device, lane, index }, op) {
                    (phases, work_s) = (fused, work);
                    self.lanes[li].persistent = Some(run);
                    self.flows_dirty = true;
                }
                let pred = queued_behind.or((index > 0).then_some(OpSite { device, lane, index: index - 1 }));
                self.records[device][lane][index] = OpRecord {
                    site: OpSite { device, lane, index },
                    class: Sim::class(op, device),
                    reached_s: reached,
                    start_s: self.now,
                    end_s: self.now,
                    pred,
                    bytes,
                    flops,
                    work_s,
                    compute_end_s: f64::NAN,
                };
                let run = &mut self.lanes[li];
                run.phases = phases;
                run.step = 0;
                run.state = LaneState::Ready;
                moved = true;
                continue;
            }
            let site = OpSite { device, lane, index: run.pc };
            match &run.phases[run.step] {
                Phase::Fixed(d) => {
                    run.step += 1;
                    if *d > 0.0 {
                        run.state = LaneState::Timed(self.now + d);
                        return true;
                    }
                }
                Phase::Fluid { amount, cap, resources, hbm_bytes } => {
                    run.step += 1;
                    if *amount > 0.0 {
                        let computes = resources.iter().any(|&r| self.topo.resources[r].kind == ResourceKind::Compute);
                        let priority = match self.compute_priority.get(device) {
                            Some(&p) if computes => p,
                            _ => 0,
                        };
                        let mut uses: Vec<(ResId, f64)> = resources.iter().map(|&r| (r, 1.0)).collect();
                        // On one GPU the work's memory traffic shares the HBM its copies use.
                        if *hbm_bytes > 0.0 && self.topo.one_gpu() {
                            uses.push((self.topo.hbm(device), hbm_bytes / amount));
                        }
                        self.flows.push(Flow {
                            lane: li,
                            computes,
                            priority,
                            remaining: *amount,
                            cap: *cap,
                            resources: uses,
                            rate: 0.0,
                        });
                        self.flows_dirty = true;
                        run.state = LaneState::Flowing;
                        return true;
                    }
                }
                Phase::Deliver { device: target, sem, add } => {
                    let (target, sem, add) = (*target, *sem, *add);
                    run.step += 1;
                    self.land(target, sem, add, site);
                }
                Phase::ComputeDone => {
                    run.step += 1;
                    self.records[device][lane][site.index].compute_end_s = self.now;
                }
                Phase::Post { device: target, sem, add, latency } => {
                    let at = self.now + latency;
                    self.in_flight.push(InFlight { at, device: *target, sem: *sem, add: *add, from: site });
                    run.step += 1;
                }
                Phase::Block { sem, value } | Phase::Gate { sem, value } => {
                    let in_kernel = matches!(run.phases[run.step], Phase::Gate { .. });
                    let (sem, value) = (*sem, *value);
                    if self.sems[device][sem.0] < value {
                        run.state = LaneState::Blocked;
                        return moved;
                    }
                    run.step += 1;
                    // Values only grow as increments land: binary search.
                    let landed = &self.landed[device][sem.0];
                    let satisfier = landed.get(landed.partition_point(|l| l.value_after < value)).map(|l| l.from);
                    let remote = satisfier.is_some_and(|s| s.device != device);
                    let record = &mut self.records[device][lane][site.index];
                    let waited = self.now > record.reached_s;
                    if waited {
                        record.pred = satisfier.or(record.pred);
                    }
                    record.start_s = self.now;
                    let sync = &self.profile.sync;
                    let next_uses_sms = match self.plan.programs[device].lanes[lane].get(site.index + 1) {
                        Some(
                            Op::Gemm { .. }
                            | Op::Reduce { .. }
                            | Op::Pointwise { .. }
                            | Op::Attend { .. }
                            | Op::AttnMerge { .. }
                            | Op::AttnFinish { .. },
                        ) => true,
                        Some(Op::Copy { engine, .. }) => *engine == Engine::Sm,
                        _ => false,
                    };
                    let cost = match (in_kernel, waited, remote, next_uses_sms) {
                        // A kernel's next tiles poll the flag: free when it is already set.
                        (true, false, _, _) => 0.0,
                        (true, true, true, _) | (false, _, true, true) => sync.remote_round_us,
                        (true, true, false, _) | (false, _, false, _) => sync.local_wait_us,
                        (false, _, true, false) => sync.dma_wait_us,
                    } * 1e-6;
                    if cost > 0.0 {
                        self.lanes[li].state = LaneState::Timed(self.now + cost);
                        return true;
                    }
                    self.lanes[li].state = LaneState::Ready;
                    moved = true;
                }
            }
        }
    }

    /// Lands an increment on a semaphore, remembering which op made it.
    fn land(&mut self, device: usize, sem: SemId, add: u32, from: OpSite) {
        let v = &mut self.sems[device][sem.0];
        *v = v.saturating_add(add);
        let value_after = *v;
        self.landed[device][sem.0].push(Landed { value_after, from });
    }

    /// A GEMM's c on a peer across a link (`c_device`): the epilogue writes it there (and
    /// first reads it back when accumulating, over the other direction at the same time),
    /// as phases after the compute, the bytes moved and their route (for the caller to count
    /// once). Charged after the compute, not under it: a kernel writes c tile by tile as
    /// tiles finish, most of it in the last wave. Communication, so not in the op's
    /// standalone (compute) work. Nothing where c is the device's own or the devices share
    /// one GPU's memory.
    fn peer_epilogue(
        &self,
        device: usize,
        c_device: Option<usize>,
        c: &Region,
        accumulate: bool,
    ) -> (Vec<Phase>, f64, Vec<ResId>) {
        let Some(owner) = c_device.filter(|&owner| owner != device && !self.topo.one_gpu()) else {
            return (Vec::new(), 0.0, Vec::new());
        };
        let moved = c.len() as f64 * dtype_of(self.plan, c.buf).size_bytes() as f64;
        let mut route = self.topo.route(device, owner);
        if accumulate {
            route.extend(self.topo.route(owner, device));
        }
        let rate = 1e9 * self.profile.copy.sm_copy_gbps;
        let phases = vec![
            Phase::ComputeDone,
            Phase::Fluid { amount: moved, cap: rate, resources: route.clone(), hbm_bytes: 0.0 },
            Phase::Fixed(self.topo.latency_s(device, owner)),
        ];
        (phases, moved, route)
    }

    /// The phases and work of an op of a tile-granular GEMM, `None` for an op outside
    /// every run: the first block launches the kernel, each block computes its tiles'
    /// share of the one kernel's work, the Waits between blocks gate and the Signals
    /// between them are posted.
    fn fused_phases(&mut self, site: OpSite, op: &Op) -> Option<(Vec<Phase>, f64, usize)> {
        let OpSite { device, index, .. } = site;
        let run = self.runs.iter().position(|r| r.holds(site))?;
        let r = &self.runs[run];
        match op {
            Op::Gemm { c, accumulate, c_device, .. } => {
                let position = r.blocks.iter().position(|&b| b == index)?;
                let first = index == r.blocks[0];
                if self.block_work[run].is_empty() {
                    self.block_work[run] = self.run_work(run);
                }
                let work = self.block_work[run][position];
                let launch = first.then(|| Phase::Fixed(self.profile.launch_s()));
                let compute =
                    Phase::Fluid { amount: work, cap: 1.0, resources: vec![self.topo.compute(device)], hbm_bytes: 0.0 };
                // A block adding into a peer's c (fused_push) moves it over the link after
                // its tiles, as a GEMM of its own does (its bytes counted by `phases`).
                let (epilogue, ..) = self.peer_epilogue(device, *c_device, c, *accumulate);
                Some((launch.into_iter().chain([compute]).chain(epilogue).collect(), work, run))
            }
            Op::Wait { sem, value } if r.inside(site) => {
                Some((vec![Phase::Gate { sem: *sem, value: *value }], 0.0, run))
            }
            Op::Signal { device: target, sem, add } if r.inside(site) => {
                let latency = self.topo.latency_s(device, *target);
                Some((vec![Phase::Post { device: *target, sem: *sem, add: *add, latency }], 0.0, run))
            }
            _ => None,
        }
    }

    /// The engine that prices a plain GEMM op.
    fn gemm_engine(&self, op: &Op) -> cmm_core::engines::Engine {
        use cmm_core::engines::{plain_engine, Engine, GemmEngine, GemmFacts};
        match (self.pricing, GemmFacts::of(self.plan, op)) {
            (Engines::AsBuilt, Some(g)) => {
                plain_engine(GemmEngine::Auto, &self.profile.engine_support(), &g).unwrap_or(Engine::Cublas)
            }
            _ => Engine::Cublas,
        }
    }

    /// The engine that prices a grouped GEMM op: as built, the Hopper engine or the
    /// scalar grouped kernel; cuBLAS's rate as a potential (`None` for another op).
    fn grouped_engine(&self, op: &Op) -> Option<cmm_core::engines::Engine> {
        use cmm_core::engines::{grouped_engine, Engine, GemmEngine, GroupedFacts};
        let g = GroupedFacts::of(self.plan, op)?;
        Some(match self.pricing {
            Engines::CublasSpeed => Engine::Cublas,
            Engines::AsBuilt => match grouped_engine(GemmEngine::Auto, &self.profile.engine_support(), &g) {
                Ok(Some(tile)) => Engine::Hopper(tile),
                _ => Engine::ScalarGrouped,
            },
        })
    }

    /// The engine of fused run `run` (cmm's persistent kernels, at cuBLAS's rate only when
    /// pricing so).
    fn run_engine(&self, run: usize) -> cmm_core::engines::Engine {
        use cmm_core::engines::{fused_engine, Engine, GemmEngine, GemmFacts};
        if self.pricing == Engines::CublasSpeed {
            return Engine::Cublas;
        }
        let r = &self.runs[run];
        let ops = &self.plan.programs[r.device].lanes[r.lane];
        let blocks: Vec<GemmFacts> = r.blocks.iter().filter_map(|&i| GemmFacts::of(self.plan, &ops[i])).collect();
        let support = self.profile.engine_support();
        fused_engine(GemmEngine::Auto, &support, &blocks, self.plan.devices)
            .unwrap_or_else(|_| blocks.first().map_or(Engine::SimtTile, |b| b.tile_engine(false)))
    }

    /// Whether the driver makes this copy its own way under [`SimOptions::copies`], by
    /// its shape in bytes as the CUDA lowering hands it over.
    fn driver_makes(&self, op: &Op) -> bool {
        let Op::Copy { src, dst, .. } = op else { return false };
        let es = dtype_of(self.plan, src.buf).size_bytes();
        self.copies.driver_makes(src.cols * es, src.rows, src.stride * es, dst.stride * es)
    }

    /// Whether the plan's devices are virtual devices of one GPU, more than one.
    fn shares_one_gpu(&self) -> bool {
        self.topo.one_gpu() && self.plan.devices > 1
    }

    /// Each block's share of a run's one-kernel cost, by its output tiles.
    fn run_work(&self, run: usize) -> Vec<f64> {
        let r = &self.runs[run];
        let ops = &self.plan.programs[r.device].lanes[r.lane];
        let shapes: Vec<(usize, usize, usize)> = r
            .blocks
            .iter()
            .map(|&i| match &ops[i] {
                Op::Gemm { a, c, trans_a, .. } => (c.rows, c.cols, if *trans_a { a.rows } else { a.cols }),
                _ => unreachable!("run blocks are gemms"),
            })
            .collect();
        let Op::Gemm { a, b, c, accumulate, .. } = &ops[r.blocks[0]] else { unreachable!("run blocks are gemms") };
        let p = self.profile;
        let (da, db) = (dtype_of(self.plan, a.buf), dtype_of(self.plan, b.buf));
        let input = if p.peak_flops(da) <= p.peak_flops(db) { da } else { db };
        let (n, k) = (shapes[0].1, shapes[0].2);
        let rows: Vec<usize> = shapes.iter().map(|s| s.0).collect();
        let engine = self.run_engine(run);
        // On one GPU the other virtual devices' persistent kernels run beside this one.
        let shared = self.shares_one_gpu();
        let cost = p.fused_gemm_cost_on(engine, &rows, n, k, input, dtype_of(self.plan, c.buf), *accumulate, shared);
        let tiles: Vec<usize> = rows.iter().map(|&m| p.tiles_on(engine, m, n)).collect();
        let total = tiles.iter().sum::<usize>().max(1) as f64;
        tiles.iter().map(|&t| cost.work_s * t as f64 / total).collect()
    }

    /// Max-min fair rates by progressive filling, one class at a time: compute work by
    /// priority from the greatest, then copies; each class shares what the ones before it
    /// left. Only on one GPU do the two meet (in its HBM, where a GEMM's or a reduce's
    /// traffic is served before a copy's: the copy takes what they leave).
    fn allocate(&mut self) {
        let mut left: Vec<f64> = self.topo.resources.iter().map(|r| r.capacity).collect();
        // On one GPU a copy beside compute slows both, by the profile's contention factors
        // (a copy's cap is scaled below).
        let copying = self.flows.iter().any(|f| !f.computes);
        let contended = self.topo.one_gpu() && copying && self.flows.iter().any(|f| f.computes);
        // A persistent kernel holds its SMs while it computes and while it spins on a wait;
        // where the profile says what a copy keeps beside one, that applies instead.
        let persistent = self.topo.one_gpu() && self.lanes.iter().any(|l| l.persistent.is_some());
        let copy_share = match self.profile.copy.rate_beside_persistent {
            Some(share) if persistent => share,
            _ if contended => self.profile.copy.rate_beside_compute,
            _ => 1.0,
        };
        // Beside a persistent kernel, one that is not (a reduce, a GEMM of its own) shares
        // the one compute with it like any op: on the H200 the gemm_rs twins' reduces took
        // their time alone from the persistent GEMMs beside them (docs/simulator.md).
        let uses: Vec<Vec<(ResId, f64)>> = self.flows.iter().map(|f| f.resources.clone()).collect();
        let caps: Vec<f64> = self.flows.iter().map(|f| if f.computes { f.cap } else { f.cap * copy_share }).collect();
        // The driver's copies beside compute keep the same share of the rate they share as
        // each keeps of its own: one pipe, slowed as a copy is.
        if let Some(pipe) = self.topo.driver_copies() {
            left[pipe] *= copy_share;
        }
        // On one GPU, ops computing at once fill the chip better than one alone; persistent
        // kernels priced at the rate they reach together already have that gain.
        if self.topo.one_gpu() {
            let together = |f: &Flow| self.lanes[f.lane].persistent.is_some_and(|run| self.run_together[run]);
            for (r, resource) in self.topo.resources.iter().enumerate() {
                if resource.kind == ResourceKind::Compute {
                    let ops = (0..self.flows.len())
                        .filter(|&i| self.flows[i].computes && !together(&self.flows[i]))
                        .filter(|&i| uses[i].iter().any(|&(u, _)| u == r))
                        .count();
                    left[r] *= self.profile.compute.throughput_with(ops);
                    if contended {
                        left[r] *= self.profile.copy.compute_beside_copy;
                    }
                }
            }
        }
        let mut classes: Vec<(bool, i32)> = self.flows.iter().map(|f| (!f.computes, f.priority)).collect();
        classes.sort_unstable();
        classes.dedup();
        for class in classes {
            let open = (0..self.flows.len()).filter(|&i| (!self.flows[i].computes, self.flows[i].priority) == class);
            self.fill(&mut left, open.collect(), &uses, &caps);
        }
        self.flows_dirty = false;
    }

    /// Progressive filling of the `open` flows over the capacities `left`: every open
    /// flow's rate rises together until a resource is full (flow i takes its weight of
    /// each resource of `uses[i]` per unit of rate) or the flow reaches its cap `caps[i]`;
    /// those flows are fixed.
    fn fill(&mut self, left: &mut [f64], mut open: Vec<usize>, uses: &[Vec<(ResId, f64)>], caps: &[f64]) {
        let mut load = vec![0.0f64; left.len()];
        for &i in &open {
            for &(r, w) in &uses[i] {
                load[r] += w;
            }
        }
        while !open.is_empty() {
            let limit = |i: usize| uses[i].iter().map(|&(r, _)| left[r] / load[r]).fold(caps[i], f64::min);
            let lowest = open.iter().map(|&i| limit(i)).fold(f64::INFINITY, f64::min);
            let (fix, keep): (Vec<usize>, Vec<usize>) = open.iter().partition(|&&i| limit(i) <= lowest * (1.0 + 1e-12));
            for &i in &fix {
                self.flows[i].rate = lowest;
                for &(r, w) in &uses[i] {
                    left[r] = (left[r] - lowest * w).max(0.0);
                    load[r] = (load[r] - w).max(0.0);
                }
            }
            open = keep;
        }
    }

    /// A launch, then `work` seconds on the device's compute (shared with the devices of
    /// its GPU); on one GPU its `bytes` of memory traffic also share the HBM.
    fn compute_phases(&self, device: usize, work: f64, bytes: f64) -> Vec<Phase> {
        let compute = vec![self.topo.compute(device)];
        vec![
            Phase::Fixed(self.profile.launch_s()),
            Phase::Fluid { amount: work, cap: 1.0, resources: compute, hbm_bytes: bytes },
        ]
    }

    fn deadlock(&self) -> SimError {
        let blocked = self
            .lanes
            .iter()
            .filter(|r| r.state == LaneState::Blocked)
            .filter_map(|r| match self.plan.programs[r.device].lanes[r.lane].get(r.pc) {
                Some(Op::Wait { sem, value }) => Some(BlockedLane {
                    device: r.device,
                    lane: self.plan.lanes[r.lane].clone(),
                    index: r.pc,
                    semaphore: self.plan.semaphores[sem.0].clone(),
                    awaited: *value,
                    reached: self.sems[r.device][sem.0],
                }),
                _ => None,
            })
            .collect();
        SimError::Deadlock { plan: self.plan.name.clone(), time_us: self.now * 1e6, blocked }
    }

    fn run(&mut self) -> Result<(), SimError> {
        loop {
            // Settle: move every lane as far as it goes at this instant.
            loop {
                let mut moved = false;
                for li in 0..self.lanes.len() {
                    moved |= self.advance(li);
                }
                if !moved {
                    break;
                }
            }
            if self.lanes.iter().all(|r| r.state == LaneState::Finished) && self.in_flight.is_empty() {
                return Ok(());
            }
            if self.flows_dirty {
                self.allocate();
            }
            let timed = self
                .lanes
                .iter()
                .filter_map(|r| match r.state {
                    LaneState::Timed(t) => Some(t),
                    _ => None,
                })
                .fold(f64::INFINITY, f64::min);
            let flowing = self.flows.iter().map(|f| self.now + f.remaining / f.rate).fold(f64::INFINITY, f64::min);
            let landing = self.in_flight.iter().map(|f| f.at).fold(f64::INFINITY, f64::min);
            let next = timed.min(flowing).min(landing);
            if !next.is_finite() {
                return Err(self.deadlock());
            }
            let dt = next - self.now;
            let tolerance = next.abs() * 1e-12 + 1e-18;
            let mut finished_lanes = Vec::new();
            self.flows.retain_mut(|f| {
                let done = self.now + f.remaining / f.rate <= next + tolerance;
                f.remaining -= f.rate * dt;
                if done {
                    finished_lanes.push(f.lane);
                }
                !done
            });
            if !finished_lanes.is_empty() {
                self.flows_dirty = true;
            }
            self.now = next;
            let (landed, flying): (Vec<InFlight>, Vec<InFlight>) =
                std::mem::take(&mut self.in_flight).into_iter().partition(|f| f.at <= next + tolerance);
            self.in_flight = flying;
            for f in landed {
                self.land(f.device, f.sem, f.add, f.from);
            }
            for li in finished_lanes {
                self.lanes[li].state = LaneState::Ready;
            }
            for r in &mut self.lanes {
                if let LaneState::Timed(t) = r.state {
                    if t <= next + tolerance {
                        r.state = LaneState::Ready;
                    }
                }
            }
        }
    }
}

/// The torus shape a simulation uses.
fn torus_dims(plan: &Plan, options: &SimOptions) -> Result<Vec<usize>, SimError> {
    match &options.torus_dims {
        None => Ok(vec![plan.devices]),
        Some(dims) if dims.iter().product::<usize>() == plan.devices && dims.iter().all(|&d| d > 0) => Ok(dims.clone()),
        Some(dims) => Err(SimError::TorusShape { dims: dims.clone(), devices: plan.devices }),
    }
}

/// Simulates `plan` on the hardware of `profile`.
pub fn simulate(plan: &Plan, profile: &Profile, options: &SimOptions) -> Result<SimReport, SimError> {
    plan.validate()?;
    if plan.devices > profile.max_devices {
        return Err(SimError::TooManyDevices {
            plan: plan.name.clone(),
            devices: plan.devices,
            profile: profile.name.clone(),
            max: profile.max_devices,
        });
    }
    let topo = Topology::new(profile, plan.devices, torus_dims(plan, options)?);
    let runs = plan.fused_runs()?;
    let empty = OpRecord {
        site: OpSite { device: 0, lane: 0, index: 0 },
        class: OpClass::Wait,
        reached_s: 0.0,
        start_s: 0.0,
        end_s: 0.0,
        pred: None,
        bytes: 0.0,
        flops: 0.0,
        work_s: 0.0,
        compute_end_s: 0.0,
    };
    let records =
        plan.programs.iter().map(|p| p.lanes.iter().map(|ops| vec![empty.clone(); ops.len()]).collect()).collect();
    let lanes = (0..plan.devices)
        .flat_map(|device| {
            (0..plan.lanes.len()).map(move |lane| LaneRun {
                device,
                lane,
                pc: 0,
                phases: Vec::new(),
                step: 0,
                state: LaneState::Ready,
                queued_since: None,
                persistent: None,
            })
        })
        .collect();
    let n_res = topo.resources.len();
    let mut sim = Sim {
        plan,
        profile,
        topo,
        compute_priority: options.compute_priority.clone(),
        now: 0.0,
        lanes,
        flows: Vec::new(),
        flows_dirty: false,
        sems: vec![vec![0; plan.semaphores.len()]; plan.devices],
        landed: (0..plan.devices).map(|_| (0..plan.semaphores.len()).map(|_| Vec::new()).collect()).collect(),
        records,
        link_bytes: vec![0.0; n_res],
        routes: std::collections::HashMap::new(),
        block_work: vec![Vec::new(); runs.len()],
        run_together: vec![false; runs.len()],
        runs,
        in_flight: Vec::new(),
        pricing: options.engines,
        engines: Default::default(),
        hardware_queues: options.hardware_queues,
        queues: None,
        copies: options.copies,
        driver_copies: 0,
    };
    if let Some(hw) = options.hardware_queues {
        sim.queues = Some(QueueSlots::new(plan, &sim.runs, hw)?);
    }
    // What prices each GEMM: a fused run once, every other GEMM op apart.
    for run in 0..sim.runs.len() {
        let engine = sim.run_engine(run);
        sim.engines.add(engine);
        sim.run_together[run] = sim.shares_one_gpu() && profile.together_efficiency(engine).is_some();
    }
    for (site, op) in plan.ops() {
        if matches!(op, Op::Gemm { .. }) && !sim.runs.iter().any(|r| r.holds(site)) {
            let engine = sim.gemm_engine(op);
            sim.engines.add(engine);
        }
        if let Some(engine) = sim.grouped_engine(op) {
            sim.engines.add(engine);
        }
    }
    sim.run()?;
    Ok(report(sim))
}

fn report(sim: Sim<'_>) -> SimReport {
    let plan = sim.plan;
    let records = sim.records;
    let all = || records.iter().flatten().flatten();
    let makespan_s = all().map(|r| r.end_s).fold(0.0, f64::max);
    let work = (0..plan.devices)
        .map(|d| records[d].iter().flatten().filter(|r| r.class.is_compute()).map(|r| r.work_s).sum::<f64>());
    // Devices of one GPU take turns on its compute; otherwise each has its own.
    let compute_floor_s = if sim.topo.one_gpu() { work.sum() } else { work.fold(0.0, f64::max) };
    let (mut comm_floor_s, mut busiest_link) = (0.0, None);
    for (r, res) in sim.topo.resources.iter().enumerate() {
        if res.kind == ResourceKind::Link && sim.link_bytes[r] > 0.0 {
            let t = sim.link_bytes[r] / res.capacity;
            if t > comm_floor_s {
                comm_floor_s = t;
                busiest_link = Some(res.name.clone());
            }
        }
    }
    let lane_busy_s = records
        .iter()
        .map(|lanes| lanes.iter().map(|ops| ops.iter().map(|r| r.end_s - r.start_s).sum()).collect())
        .collect();
    // A device's compute engine; on one GPU every device's runs on the same one, so the
    // time nobody computes is what each device exposes.
    let one_gpu = sim.topo.one_gpu();
    let exposed_comm_s = records
        .iter()
        .map(|lanes| {
            let engine: Vec<&Vec<Vec<OpRecord>>> = if one_gpu { records.iter().collect() } else { vec![lanes] };
            let mut spans: Vec<(f64, f64)> = engine
                .into_iter()
                .flatten()
                .flatten()
                .filter(|r| r.class.is_compute())
                .map(|r| (r.start_s, r.compute_end_s))
                .collect();
            spans.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (mut covered, mut reach) = (0.0, f64::NEG_INFINITY);
            for (s, e) in spans {
                if e > reach {
                    covered += e - s.max(reach);
                    reach = e;
                }
            }
            (makespan_s - covered).max(0.0)
        })
        .collect();
    let mut critical_path = Vec::new();
    let last = all().filter(|r| r.end_s >= makespan_s).map(|r| r.site).next();
    let mut at = last;
    while let Some(site) = at {
        critical_path.push(site);
        at = records[site.device][site.lane][site.index].pred;
    }
    critical_path.reverse();
    SimReport {
        plan: plan.name.clone(),
        profile: sim.profile.name.clone(),
        devices: plan.devices,
        lanes: plan.lanes.clone(),
        makespan_s,
        compute_floor_s,
        comm_floor_s,
        busiest_link,
        lane_busy_s,
        exposed_comm_s,
        critical_path,
        records,
        engines: sim.engines,
        pricing: sim.pricing,
        one_rate: sim.profile.engines.is_none(),
        hardware_queues: sim.hardware_queues,
        copies: sim.copies,
        driver_copies: sim.driver_copies,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::MAX_CONCURRENT;
    use cmm_core::algorithms::{algorithms_for, build_plan};
    use cmm_core::{Algorithm, OpKind, Problem};

    fn seed000(devices: usize) -> Problem {
        crate::validate::seed000_problem(OpKind::AgGemm, devices, 1).unwrap()
    }

    fn sim(plan: &Plan, profile: &Profile) -> SimReport {
        simulate(plan, profile, &SimOptions::default()).unwrap()
    }

    #[test]
    fn a_ring_across_nodes_waits_on_the_network() {
        let p = Problem::new(OpKind::AgGemm, 16, 16 * 1024, 16 * 4096, 4096, DType::Bf16, DType::Bf16).unwrap();
        let plan = build_plan(&p, Algorithm::Ring).unwrap();
        let nvlink = Profile::load("h100-nvlink").unwrap();
        assert!(matches!(
            simulate(&plan, &nvlink, &SimOptions::default()),
            Err(SimError::TooManyDevices { max: 8, .. })
        ));
        let ib = Profile::load("h100-ib").unwrap();
        let r = sim(&plan, &ib);
        // Two of the 16 ring hops cross nodes; the ring moves at their pace.
        assert!(r.busiest_link.as_deref().is_some_and(|l| l.contains("nic")), "{:?}", r.busiest_link);
        let eight = sim(&build_plan(&seed000(8), Algorithm::Ring).unwrap(), &ib);
        assert!(eight.busiest_link.as_deref().is_some_and(|l| !l.contains("nic")), "one node stays on NVLink");
        assert!(r.makespan_s >= r.comm_floor_s);
    }

    #[test]
    fn makespan_respects_the_compute_and_communication_floors() {
        for name in Profile::builtin_names() {
            let profile = Profile::load(name).unwrap();
            for op in OpKind::ALL {
                for d in [1, 2, 3, 4, 8] {
                    let p = Problem::new(op, d, 512 * d, 256 * d, 128 * d, DType::Bf16, DType::F32).unwrap();
                    for alg in algorithms_for(op) {
                        let plan = build_plan(&p, alg).unwrap();
                        let r = sim(&plan, &profile);
                        let eps = 1e-12;
                        assert!(r.makespan_s + eps >= r.compute_floor_s, "{name} {}: {r:?}", plan.name);
                        assert!(r.makespan_s + eps >= r.comm_floor_s, "{name} {}", plan.name);
                        assert!(r.compute_floor_s > 0.0);
                        // One GPU has no links: its copies cross its HBM, beside the GEMMs.
                        let links = profile.interconnect.topology != crate::TopologyKind::OneGpu;
                        assert_eq!(r.comm_floor_s > 0.0, d > 1 && links, "{name} {}", plan.name);
                        assert_eq!(r.ops().count(), plan.op_count());
                    }
                }
            }
        }
    }

    #[test]
    fn a_lone_gemm_takes_launch_plus_its_work() {
        let profile = Profile::load("h100-nvlink").unwrap();
        let plan = build_plan(&seed000(1), Algorithm::Ring).unwrap();
        let r = sim(&plan, &profile);
        let work = profile.gemm_cost(1024, 4096, 4096, DType::F16, DType::F16, false).work_s;
        assert!((r.makespan_s - work - profile.launch_s()).abs() < 1e-12, "{}", r.makespan_s);
        assert_eq!(r.compute_floor_s, work);
    }

    #[test]
    fn more_bandwidth_is_never_slower() {
        let base = Profile::load("h100-nvlink").unwrap();
        for alg in algorithms_for(OpKind::AgGemm) {
            for op in OpKind::ALL {
                let p = Problem::new(op, 4, 4096, 4096, 4096, DType::F16, DType::F16).unwrap();
                let Ok(plan) = build_plan(&p, alg) else { continue };
                let mut previous = f64::INFINITY;
                for scale in [0.05, 0.2, 1.0, 4.0] {
                    let mut profile = base.clone();
                    profile.interconnect.link_gbps *= scale;
                    profile.copy.copy_engine_gbps *= scale;
                    profile.copy.sm_copy_gbps *= scale;
                    let t = sim(&plan, &profile).makespan_s;
                    assert!(t <= previous * (1.0 + 1e-12), "{} at x{scale}: {t} > {previous}", plan.name);
                    previous = t;
                }
            }
        }
    }

    #[test]
    fn more_devices_at_fixed_shard_size_are_never_faster_for_ag_gemm() {
        let profile = Profile::load("h100-nvlink").unwrap();
        for alg in [Algorithm::Baseline, Algorithm::Ring, Algorithm::RingBidir, Algorithm::RingChunked { chunks: 4 }] {
            let mut previous = 0.0;
            for d in 1..=8 {
                let plan = build_plan(&seed000(d), alg).unwrap();
                let t = sim(&plan, &profile).makespan_s;
                assert!(t >= previous, "{alg} D={d}: {t} < {previous}");
                previous = t;
            }
        }
    }

    #[test]
    fn ring_hides_communication_the_baseline_exposes() {
        let profile = Profile::load("h100-nvlink").unwrap();
        let ring = sim(&build_plan(&seed000(4), Algorithm::Ring).unwrap(), &profile);
        let base = sim(&build_plan(&seed000(4), Algorithm::Baseline).unwrap(), &profile);
        assert!(ring.makespan_s < base.makespan_s);
        assert!(ring.max_exposed_comm_s() < base.max_exposed_comm_s());
        // The ring's critical path ends in a GEMM and runs through the compute lane.
        let last = *ring.critical_path.last().unwrap();
        assert_eq!(ring.record(last).class, OpClass::Gemm);
        assert!(ring.critical_path.len() >= 4);
    }

    #[test]
    fn two_copies_on_one_port_share_it_fairly() {
        use cmm_core::plan::{BufferRole, PlanBuilder};
        // Device 0 sends the same bytes to devices 1 and 2 from two lanes at once: through
        // one NVSwitch egress port each gets half of it.
        let mut profile = Profile::load("h100-nvlink").unwrap();
        profile.compute.launch_us = 0.0;
        profile.interconnect.link_latency_us = 0.0;
        profile.copy.copy_engine_gbps = profile.interconnect.link_gbps;
        let mut b = PlanBuilder::new("fanout", 3);
        let x = b.buffer("X", DType::F32, 1024, 1024, BufferRole::Scratch);
        let l0 = b.lane("a");
        let l1 = b.lane("b");
        for (lane, to) in [(l0, 1), (l1, 2)] {
            let r = b.whole(x);
            b.push(0, lane, Op::Copy { src: r, dst_device: to, dst: r, engine: Engine::CopyEngine });
        }
        let plan = b.finish().unwrap();
        let r = sim(&plan, &profile);
        let one = 4.0 * 1024.0 * 1024.0 / profile.link_bps();
        assert!((r.makespan_s - 2.0 * one).abs() < 1e-12, "{} vs {}", r.makespan_s, 2.0 * one);
        assert!((r.comm_floor_s - 2.0 * one).abs() < 1e-12);
        assert_eq!(r.busiest_link.as_deref(), Some("dev0 egress"));
    }

    /// Device 0's one GEMM adds into device 1's c: across GPUs its compute, then c over
    /// the link both ways (read and written), counted as communication, not compute; on
    /// one GPU nothing more than the same GEMM into its own c.
    #[test]
    fn a_gemm_on_a_peers_c_moves_it_after_its_compute() {
        use cmm_core::plan::{BufferRole, PlanBuilder};
        let plan = |c_device| {
            let mut b = PlanBuilder::new("peer c", 2);
            let a = b.buffer("A", DType::F16, 1024, 4096, BufferRole::Scratch);
            let w = b.buffer("B", DType::F16, 4096, 4096, BufferRole::Scratch);
            let c = b.buffer("C", DType::F32, 1024, 4096, BufferRole::Scratch);
            let lane = b.lane("compute");
            let (a, w, c) = (b.whole(a), b.whole(w), b.whole(c));
            let gemm = Op::Gemm { a, b: w, c, trans_a: false, trans_b: false, accumulate: true, fused: None, c_device };
            b.push(0, lane, gemm);
            b.finish().unwrap()
        };
        let mut nvlink = Profile::load("h100-nvlink").unwrap();
        nvlink.interconnect.link_latency_us = 0.0;
        let work = nvlink.gemm_cost(1024, 4096, 4096, DType::F16, DType::F32, true).work_s;
        let moving = 4.0 * 1024.0 * 4096.0 / (nvlink.copy.sm_copy_gbps * 1e9).min(nvlink.link_bps());
        let r = sim(&plan(Some(1)), &nvlink);
        assert!((r.makespan_s - nvlink.launch_s() - work - moving).abs() < 1e-9, "{r:?}");
        assert_eq!(r.compute_floor_s, work);
        assert!((r.exposed_comm_s[0] - moving).abs() < 1e-9, "{:?}", r.exposed_comm_s);
        assert!((r.comm_floor_s - 4.0 * 1024.0 * 4096.0 / nvlink.link_bps()).abs() < 1e-9);
        let local = sim(&plan(None), &nvlink);
        assert!(local.exposed_comm_s[0] < 1e-12 && local.comm_floor_s == 0.0);
        let one = Profile::load("h100-one-gpu").unwrap();
        assert_eq!(sim(&plan(Some(1)), &one).makespan_s, sim(&plan(None), &one).makespan_s);
    }

    fn on_queues(plan: &Plan, profile: &Profile, queues: usize, offset: usize) -> Result<SimReport, SimError> {
        let options = SimOptions { hardware_queues: Some(HardwareQueues { queues, offset }), ..SimOptions::default() };
        simulate(plan, profile, &options)
    }

    /// As many queues as streams change nothing; fewer start each queue's ops in the
    /// backend's enqueue order, so an op whose lane is ready can wait behind another
    /// stream's op, and the record names that op as what held it.
    #[test]
    fn lanes_sharing_hardware_queues_start_their_ops_in_enqueue_order() {
        let one = Profile::load("h100-one-gpu").unwrap();
        let p = crate::validate::seed000_problem(OpKind::GemmRs, 4, 8).unwrap();
        for algorithm in [Algorithm::Ring, Algorithm::Fused { chunks: 1 }] {
            let plan = build_plan(&p, algorithm).unwrap();
            let streams = plan.devices * plan.lanes.len();
            let free = sim(&plan, &one);
            let own = on_queues(&plan, &one, streams, 3).unwrap();
            assert_eq!(own.makespan_s, free.makespan_s, "{}", plan.name);
            let runs = plan.fused_runs().unwrap();
            let mut held = 0;
            for queues in [1, 2] {
                let shared = on_queues(&plan, &one, queues, 1).unwrap();
                assert!(shared.makespan_s >= free.makespan_s * (1.0 - 1e-9), "{} on {queues}", plan.name);
                let slots = QueueSlots::new(&plan, &runs, HardwareQueues { queues, offset: 1 }).unwrap();
                for order in &slots.order {
                    // (A Wait's start is when it was satisfied, not when it left its queue.)
                    let starts: Vec<f64> = order
                        .iter()
                        .map(|&s| shared.record(s))
                        .filter(|r| r.class != OpClass::Wait)
                        .map(|r| r.start_s)
                        .collect();
                    assert!(starts.windows(2).all(|w| w[0] <= w[1]), "{} on {queues}: {starts:?}", plan.name);
                }
                held += shared
                    .ops()
                    .filter(|r| {
                        r.start_s > r.reached_s
                            && r.pred.is_some_and(|p| (p.device, p.lane) != (r.site.device, r.site.lane))
                    })
                    .filter(|r| r.class != OpClass::Wait)
                    .count();
            }
            assert!(held > 0, "{}: no op waited behind another stream's", plan.name);
        }
        let plan = build_plan(&p, Algorithm::Ring).unwrap();
        for queues in [0, 33] {
            assert_eq!(on_queues(&plan, &one, queues, 0).unwrap_err(), SimError::HardwareQueues { queues });
        }
        // An offset is taken modulo the queues, however large: usize::MAX on 3 queues is 0
        // (2^64 − 1 is a multiple of 3), where a sum that wrapped would give 2.
        let runs = plan.fused_runs().unwrap();
        let slots = |offset| QueueSlots::new(&plan, &runs, HardwareQueues { queues: 3, offset }).unwrap().order;
        assert_eq!(slots(usize::MAX), slots(0));
        assert_ne!(slots(2), slots(0));
    }

    /// The one-GPU profile with no launch cost, no library GEMM's fixed cost (which has a
    /// test of its own) and no signal latency, so that a test's times are its flows' alone.
    fn instant_one_gpu() -> Profile {
        let mut profile = Profile::load("h100-one-gpu").unwrap();
        profile.compute.launch_us = 0.0;
        profile.compute.gemm_overhead_us = 0.0;
        profile.interconnect.link_latency_us = 0.0;
        profile
    }

    /// A library GEMM's fixed cost (its fill and last epilogue) is latency, not compute:
    /// two GEMMs at once on one GPU share the compute for their rates' parts and overlap
    /// their fixed costs, so they end after both rates' parts and one fixed cost (the
    /// calibration's GEMMs at once took 0.81–0.83 of their time one after the other).
    #[test]
    fn on_one_gpu_gemms_at_once_overlap_their_fixed_costs() {
        let mut profile = instant_one_gpu();
        (profile.copy.rate_beside_compute, profile.copy.compute_beside_copy) = (1.0, 1.0);
        let plan = one_gpu_plan();
        let rate_part = profile.gemm_cost(1024, 4096, 4096, DType::F16, DType::F32, false).work_s;
        let copy_alone = sim(&plan, &profile).makespan_s;
        profile.compute.gemm_overhead_us = 12.0;
        let cost = profile.gemm_cost(1024, 4096, 4096, DType::F16, DType::F32, false);
        assert!((cost.fixed_s - 12e-6).abs() < 1e-15 && (cost.work_s - rate_part - 12e-6).abs() < 1e-12);
        let r = sim(&plan, &profile);
        assert!((copy_alone - 2.0 * rate_part).abs() < 1e-9, "{copy_alone}");
        assert!((r.makespan_s - (2.0 * rate_part + 12e-6)).abs() < 1e-9, "{}", r.makespan_s);
        assert!((r.compute_floor_s - 2.0 * rate_part).abs() < 1e-12, "the floor is the shared work");
    }

    /// The one-GPU profile file with `line` replaced is refused, naming `field`.
    fn assert_refused((line, with): (&str, &str), field: &str) {
        let text = include_str!("../profiles/h100-one-gpu.toml").replace(line, with);
        let e = Profile::parse(&text, "test.toml").unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
    }

    /// Two devices of one GPU each run one GEMM, and device 0 copies a buffer to device 1.
    fn one_gpu_plan() -> Plan {
        use cmm_core::plan::{BufferRole, PlanBuilder};
        let mut b = PlanBuilder::new("one gpu", 2);
        let a = b.buffer("A", DType::F16, 1024, 4096, BufferRole::Scratch);
        let w = b.buffer("B", DType::F16, 4096, 4096, BufferRole::Scratch);
        let c = b.buffer("C", DType::F32, 1024, 4096, BufferRole::Scratch);
        let (compute, comm) = (b.lane("compute"), b.lane("comm"));
        for d in 0..2 {
            let (a, w, c) = (b.whole(a), b.whole(w), b.whole(c));
            b.push(d, compute, Op::gemm(a, w, c));
        }
        let x = b.whole(a);
        b.push(0, comm, Op::Copy { src: x, dst_device: 1, dst: x, engine: Engine::CopyEngine });
        b.finish().unwrap()
    }

    #[test]
    fn devices_of_one_gpu_share_its_compute_and_copy_through_its_hbm() {
        let mut profile = instant_one_gpu();
        // The HBM alone (the contention factors have a test of their own).
        (profile.copy.rate_beside_compute, profile.copy.compute_beside_copy) = (1.0, 1.0);
        let plan = one_gpu_plan();
        let r = sim(&plan, &profile);
        let cost = profile.gemm_cost(1024, 4096, 4096, DType::F16, DType::F32, false);
        let gemm = cost.work_s;
        // Two GEMMs at once on one GPU take as long as both one after the other.
        assert!((r.makespan_s - 2.0 * gemm).abs() < 1e-9, "{} vs {}", r.makespan_s, 2.0 * gemm);
        assert!((r.compute_floor_s - 2.0 * gemm).abs() < 1e-12, "one GPU's floor is every device's work");
        // The copy: 8 MiB read and written through the HBM the GEMMs leave (their traffic
        // is served first), below the copy engine's rate here.
        let copy = r.record(OpSite { device: 0, lane: 1, index: 0 });
        let bytes = 1024.0 * 4096.0 * 2.0;
        let left = profile.hbm_bps() - cost.bytes / cost.work_s;
        assert!(left < 2.0 * profile.copy.copy_engine_gbps * 1e9, "the test needs the HBM to bind");
        assert!((copy.end_s - copy.start_s - 2.0 * bytes / left).abs() < 1e-12, "{copy:?}");
        assert_eq!(r.comm_floor_s, 0.0, "no links on one GPU");
    }

    #[test]
    fn on_one_gpu_a_copy_beside_compute_costs_both_what_the_profile_says() {
        let mut profile = instant_one_gpu();
        // An HBM wide enough that only the contention factors bind.
        profile.memory.hbm_gbps = 1e9;
        profile.copy.rate_beside_compute = 0.25;
        profile.copy.compute_beside_copy = 0.5;
        let plan = one_gpu_plan();
        let gemm = profile.gemm_cost(1024, 4096, 4096, DType::F16, DType::F32, false).work_s;
        let r = sim(&plan, &profile);
        // Alone, the 8 MiB copy would run at the copy engine's rate; beside the GEMMs at a quarter.
        let alone = 1024.0 * 4096.0 * 2.0 / (profile.copy.copy_engine_gbps * 1e9);
        let copy = r.record(OpSite { device: 0, lane: 1, index: 0 });
        assert!(4.0 * alone < gemm, "the test needs the copy to end first");
        assert!((copy.end_s - copy.start_s - 4.0 * alone).abs() < 1e-12, "{copy:?} vs {alone}");
        // The GEMMs (two GEMMs' work) run at half their throughput while it copies.
        let gemms_end = 2.0 * gemm + 0.5 * 4.0 * alone;
        assert!((r.makespan_s - gemms_end).abs() < 1e-9, "{} vs {gemms_end}", r.makespan_s);
        // Devices with GPUs of their own do not contend.
        let mut nvlink = Profile::load("h100-nvlink").unwrap();
        let before = sim(&plan, &nvlink).makespan_s;
        nvlink.copy.rate_beside_compute = 0.25;
        nvlink.copy.compute_beside_copy = 0.5;
        assert_eq!(sim(&plan, &nvlink).makespan_s, before);
        // A factor above 1 is refused, naming it.
        assert_refused(("rate_beside_compute = 0.30", "rate_beside_compute = 1.5"), "copy.rate_beside_compute");
    }

    /// Device 1 runs a persistent kernel of two blocks that waits, between them, for device
    /// 0's copy of 64 MiB to device 1, after which device 0 signals.
    fn beside_a_persistent_kernel() -> Plan {
        use cmm_core::plan::{BufferRole, PlanBuilder};
        let mut b = PlanBuilder::new("beside a persistent kernel", 2);
        let a = b.buffer("A", DType::F16, 128, 512, BufferRole::Scratch);
        let w = b.buffer("B", DType::F16, 512, 4096, BufferRole::Scratch);
        let c = b.buffer("C", DType::F32, 128, 4096, BufferRole::Scratch);
        let x = b.buffer("X", DType::F16, 8192, 4096, BufferRole::Scratch);
        let ready = b.semaphore("ready");
        let (compute, comm) = (b.lane("compute"), b.lane("comm"));
        let block = |b: &PlanBuilder, half: usize| {
            let mut op = Op::gemm(b.rows(a, 64 * half, 64), b.whole(w), b.rows(c, 64 * half, 64));
            if let Op::Gemm { fused, .. } = &mut op {
                *fused = Some(0);
            }
            op
        };
        let (first, second) = (block(&b, 0), block(&b, 1));
        b.push(1, compute, first);
        b.push(1, compute, Op::Wait { sem: ready, value: 1 });
        b.push(1, compute, second);
        let x = b.whole(x);
        b.push(0, comm, Op::Copy { src: x, dst_device: 1, dst: x, engine: Engine::CopyEngine });
        b.push(0, comm, Op::Signal { device: 1, sem: ready, add: 1 });
        b.finish().unwrap()
    }

    /// Every device copies 16 MiB to the next, all at once: rows of a whole buffer, or
    /// (`strided`) the left half of a buffer twice as wide; with `gemm`, device 0 also runs
    /// a GEMM of 8192×8192×8192 beside them.
    fn copies_at_once(devices: usize, strided: bool, gemm: bool) -> Plan {
        use cmm_core::plan::{BufferRole, PlanBuilder};
        let mut b = PlanBuilder::new("copies at once", devices);
        let cols = if strided { 8192 } else { 4096 };
        let x = b.buffer("X", DType::F32, 1024, cols, BufferRole::Scratch);
        let comm = b.lane("comm");
        if gemm {
            let a = b.buffer("A", DType::F16, 8192, 8192, BufferRole::Scratch);
            let c = b.buffer("C", DType::F16, 8192, 8192, BufferRole::Scratch);
            let compute = b.lane("compute");
            b.push(0, compute, Op::gemm(b.whole(a), b.whole(a), b.whole(c)));
        }
        for d in 0..devices {
            let region = b.window(x, 0, 0, 1024, 4096);
            b.push(
                d,
                comm,
                Op::Copy { src: region, dst_device: (d + 1) % devices, dst: region, engine: Engine::CopyEngine },
            );
        }
        b.finish().unwrap()
    }

    /// On one GPU the copies the driver makes its own way share one copy's rate
    /// (`copy.driver_gbps`): D of them at once take D times one; asked of the copy engines
    /// they share only the HBM. Under `auto` only the strided ones are the driver's.
    #[test]
    fn on_one_gpu_the_drivers_copies_share_one_copys_rate() {
        let mut profile = instant_one_gpu();
        let driver_gbps = profile.copy.driver_gbps.expect("the one-GPU profiles give the driver's rate");
        let bytes = 1024.0 * 4096.0 * 4.0;
        let with = |plan: &Plan, copies: CopyIssue, profile: &Profile| {
            simulate(plan, profile, &SimOptions { copies, ..SimOptions::default() }).unwrap()
        };
        for devices in [2, 4, 8] {
            let plan = copies_at_once(devices, false, false);
            let devices = devices as f64;
            let driver = with(&plan, CopyIssue::Driver, &profile);
            let alone = bytes / (driver_gbps * 1e9);
            assert!(
                (driver.makespan_s - devices * alone).abs() < 1e-12,
                "{} vs {devices} × {alone}",
                driver.makespan_s
            );
            assert_eq!(driver.driver_copies, plan.devices);
            // The copy engines' each at its rate, the HBM shared (each byte read and written).
            let engines = with(&plan, CopyIssue::Auto, &profile);
            let rate = (profile.copy.copy_engine_gbps * 1e9).min(profile.hbm_bps() / 2.0 / devices);
            assert!((engines.makespan_s - bytes / rate).abs() < 1e-12, "{}", engines.makespan_s);
            assert_eq!(engines.driver_copies, 0);
        }
        // Beside compute they keep the profile's share of that one rate together (on the
        // H100 timeline of 6581ea8 the driver's copies beside GEMMs moved 0.29 of it:
        // tests/recorded_timelines.rs), not each of its own.
        let share = profile.copy.rate_beside_compute;
        let beside = with(&copies_at_once(4, false, true), CopyIssue::Driver, &profile);
        let copies_end =
            (0..4).map(|d| beside.record(OpSite { device: d, lane: 0, index: 0 }).end_s).fold(0.0, f64::max);
        let expected = 4.0 * bytes / (driver_gbps * 1e9) / share;
        assert!((copies_end - expected).abs() < 1e-9, "{copies_end} vs {expected}");
        assert!(beside.makespan_s > copies_end, "the GEMM outlasts them");
        let strided = copies_at_once(4, true, false);
        let auto = with(&strided, CopyIssue::Auto, &profile);
        assert_eq!(auto.driver_copies, 4);
        assert_eq!(auto.makespan_s, with(&strided, CopyIssue::Driver, &profile).makespan_s);
        assert_eq!(with(&strided, CopyIssue::PreferCopyEngines, &profile).driver_copies, 0);
        // A profile without the driver's rate prices them as the copy engines'.
        profile.copy.driver_gbps = None;
        let plan = copies_at_once(4, false, false);
        assert_eq!(
            with(&plan, CopyIssue::Driver, &profile).makespan_s,
            with(&plan, CopyIssue::Auto, &profile).makespan_s
        );
        // Across GPUs the driver's copies are the copy engines' (no shared rate).
        let nvlink = Profile::load("h100-nvlink").unwrap();
        assert_eq!(
            with(&plan, CopyIssue::Driver, &nvlink).makespan_s,
            with(&plan, CopyIssue::Auto, &nvlink).makespan_s
        );
        // A rate of 0 is refused, naming it.
        assert_refused(("driver_gbps = 782.0", "driver_gbps = 0"), "copy.driver_gbps");
    }

    /// Device 1 runs a persistent kernel of two blocks (2048×4096×4096, f32 out) and, with
    /// `reduce`, device 0 a reduce of two 64 MiB blocks into a third beside it.
    fn reduce_beside_persistent_blocks(kernel: bool, reduce: bool) -> Plan {
        use cmm_core::plan::{BufferRole, PlanBuilder};
        let mut b = PlanBuilder::new("a reduce beside a persistent kernel", 2);
        let a = b.buffer("A", DType::F16, 2048, 4096, BufferRole::Scratch);
        let w = b.buffer("B", DType::F16, 4096, 4096, BufferRole::Scratch);
        let c = b.buffer("C", DType::F32, 2048, 4096, BufferRole::Scratch);
        let [x, y, z] = ["X", "Y", "Z"].map(|name| b.buffer(name, DType::F16, 8192, 4096, BufferRole::Scratch));
        let (compute, comm) = (b.lane("compute"), b.lane("comm"));
        for half in [0, 1].into_iter().filter(|_| kernel) {
            let mut op = Op::gemm(b.rows(a, 1024 * half, 1024), b.whole(w), b.rows(c, 1024 * half, 1024));
            if let Op::Gemm { fused, .. } = &mut op {
                *fused = Some(0);
            }
            b.push(1, compute, op);
        }
        if reduce {
            let op = Op::Reduce { inputs: vec![b.whole(x), b.whole(y)], output: b.whole(z) };
            b.push(0, comm, op);
        }
        b.finish().unwrap()
    }

    /// On one GPU a kernel that is not persistent (a reduce) shares the one compute with
    /// the persistent kernels beside it, as any two compute ops do: neither runs at its
    /// rate alone, and together they take about the sum of their times alone. The H200's
    /// gemm_rs twins (bench of e806307, whose reduces start beside the persistent GEMMs)
    /// took about that sum: their time less the ag_gemm twins' (the same GEMMs, no reduce)
    /// was 1453 µs at D = 8, where their reduces take 1507 µs alone.
    #[test]
    fn on_one_gpu_a_reduce_shares_the_compute_with_the_persistent_kernels_beside_it() {
        let profile = instant_one_gpu();
        let time = |kernel, reduce| sim(&reduce_beside_persistent_blocks(kernel, reduce), &profile).makespan_s;
        let (kernel_alone, reduce_alone, together) = (time(true, false), time(false, true), time(true, true));
        assert!(
            reduce_alone > 0.3 * kernel_alone && kernel_alone > 0.3 * reduce_alone,
            "{kernel_alone} {reduce_alone}"
        );
        let sum = kernel_alone + reduce_alone;
        assert!((together / sum - 1.0).abs() < 0.02, "{together} against {kernel_alone} + {reduce_alone}");
        let r = sim(&reduce_beside_persistent_blocks(true, true), &profile);
        let reduce = r.record(OpSite { device: 0, lane: 1, index: 0 });
        assert!(reduce.end_s - reduce.start_s > 1.5 * reduce_alone, "{reduce:?} against {reduce_alone}");
    }

    #[test]
    fn on_one_gpu_a_persistent_kernel_holds_a_copy_to_the_share_the_profile_gives_it() {
        let plan = beside_a_persistent_kernel();
        let mut profile = instant_one_gpu();
        // An HBM wide enough that only the contention factors bind.
        profile.memory.hbm_gbps = 1e9;
        profile.copy.rate_beside_compute = 0.5;
        let alone = 8192.0 * 4096.0 * 2.0 / (profile.copy.copy_engine_gbps * 1e9);
        let copy_time = |profile: &Profile| {
            let r = sim(&plan, profile);
            let copy = r.record(OpSite { device: 0, lane: 1, index: 0 });
            copy.end_s - copy.start_s
        };
        // Unset, the kernel is compute like any other: the copy keeps half its rate while
        // the first block computes, and all of it once the kernel only waits.
        let unset = copy_time(&profile);
        assert!(unset > alone * (1.0 + 1e-9) && unset < 2.0 * alone * (1.0 - 1e-9), "{unset} vs {alone}");
        // Set, the copy keeps that share from start to end, waiting kernel or not.
        profile.copy.rate_beside_persistent = Some(0.1);
        let held = copy_time(&profile);
        assert!((held - 10.0 * alone).abs() < 1e-12, "{held} vs {}", 10.0 * alone);
        // It is no term for plain GEMMs: the cuBLAS pair keeps the compute share.
        let pair = one_gpu_plan();
        let mut without = profile.clone();
        without.copy.rate_beside_persistent = None;
        assert_eq!(sim(&pair, &profile).makespan_s, sim(&pair, &without).makespan_s);
        // Devices with GPUs of their own do not contend.
        let mut nvlink = Profile::load("h100-nvlink").unwrap();
        let before = sim(&plan, &nvlink).makespan_s;
        nvlink.copy.rate_beside_persistent = Some(0.1);
        assert_eq!(sim(&plan, &nvlink).makespan_s, before);
        // A share above 1 is refused, naming it.
        assert_refused(
            ("compute_beside_copy = 0.88", "compute_beside_copy = 0.88\nrate_beside_persistent = 1.5"),
            "copy.rate_beside_persistent",
        );
    }

    #[test]
    fn persistent_kernels_of_one_gpu_run_at_the_rate_measured_together_and_no_faster() {
        let mut profile = Profile::load("h200-one-gpu").unwrap();
        let together = profile.engines.unwrap().hopper_128x256.unwrap().shared_efficiency.unwrap();
        for d in [2usize, 4] {
            // Each device: (D·1024)×4096×4096, its blocks one persistent kernel.
            let p = Problem::new(OpKind::AgGemm, d, 1024 * d, 4096 * d, 4096, DType::F16, DType::F16).unwrap();
            let twin = cmm_core::emulate::compute_only(&build_plan(&p, Algorithm::Fused { chunks: 1 }).unwrap());
            let flops = 2.0 * (1024 * d) as f64 * 4096.0 * 4096.0 * d as f64;
            let expected = flops / (profile.peak_flops(DType::F16) * together) + profile.launch_s();
            profile.compute.concurrent_throughput = [1.0; MAX_CONCURRENT];
            let r = sim(&twin, &profile);
            assert!(r.engines.describe().contains("Hopper engine 128x256"), "{}", r.engines.describe());
            // Their FLOPs at that rate: no waves or fixed cost of each kernel on top.
            assert!((r.makespan_s / expected - 1.0).abs() < 1e-9, "D={d}: {} vs {expected}", r.makespan_s);
            // The gain of cuBLAS GEMMs at once is in that rate already: not counted twice.
            profile.compute.concurrent_throughput = [1.0, 1.3, 1.5, 1.6, 1.6, 1.6, 1.6, 1.6];
            assert_eq!(sim(&twin, &profile).makespan_s, r.makespan_s, "D={d}");
            // Plain GEMMs still gain it.
            let plain = one_gpu_plan();
            let gained = sim(&plain, &profile).makespan_s;
            profile.compute.concurrent_throughput = [1.0; MAX_CONCURRENT];
            assert!(gained < sim(&plain, &profile).makespan_s);
        }
        // Kernels writing f32 take the rate measured for them where the profile has one.
        use cmm_core::engines::{Engine, HopperTile};
        let flops = 2.0 * 1024.0 * 4096.0 * 4096.0;
        let work = |p: &Profile, output| {
            p.fused_gemm_cost_on(Engine::Hopper(HopperTile::Wide), &[1024], 4096, 4096, DType::F16, output, false, true)
                .work_s
        };
        let peak = profile.peak_flops(DType::F16);
        assert!((work(&profile, DType::F32) / (flops / (peak * together)) - 1.0).abs() < 1e-12);
        if let Some(rate) = profile.engines.as_mut().and_then(|e| e.hopper_128x256.as_mut()) {
            rate.shared_efficiency_f32 = Some(0.3);
        }
        assert!((work(&profile, DType::F32) / (flops / (peak * 0.3)) - 1.0).abs() < 1e-12);
        assert!((work(&profile, DType::F16) / (flops / (peak * together)) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn on_one_gpu_the_greater_priority_gets_the_compute_first() {
        let mut profile = Profile::load("h100-one-gpu").unwrap();
        // Compute alone (the copy beside it has a test of its own).
        (profile.copy.rate_beside_compute, profile.copy.compute_beside_copy) = (1.0, 1.0);
        (profile.compute.launch_us, profile.compute.gemm_overhead_us) = (0.0, 0.0);
        let plan = one_gpu_plan();
        let gemm = profile.gemm_cost(1024, 4096, 4096, DType::F16, DType::F32, false).work_s;
        let end = |priorities: Vec<i32>, device| {
            let options = SimOptions { compute_priority: priorities, ..SimOptions::default() };
            let r = simulate(&plan, &profile, &options).unwrap();
            r.record(OpSite { device, lane: 0, index: 0 }).end_s
        };
        // Together, both end at 2 GEMMs; device 1 first, it ends at 1 and device 0 at 2.
        assert!((end(Vec::new(), 0) - 2.0 * gemm).abs() < 1e-9);
        assert!((end(vec![1, 0], 1) - gemm).abs() < 1e-9);
        assert!((end(vec![1, 0], 0) - 2.0 * gemm).abs() < 1e-9);
        // One after the other, each device computes half the run, but the GPU computes
        // all of it: nothing is exposed.
        let options = SimOptions { compute_priority: vec![1, 0], ..SimOptions::default() };
        let r = simulate(&plan, &profile, &options).unwrap();
        assert!(r.max_exposed_comm_s() < 1e-9, "{:?}", r.exposed_comm_s);
        // Priorities of devices with their own GPUs change nothing.
        let nvlink = Profile::load("h100-nvlink").unwrap();
        let options = SimOptions { compute_priority: vec![1, 0], ..SimOptions::default() };
        let apart = simulate(&plan, &nvlink, &options).unwrap();
        assert_eq!(apart.makespan_s, sim(&plan, &nvlink).makespan_s);
    }

    #[test]
    fn on_one_gpu_gemms_at_once_gain_what_the_profile_says() {
        let mut profile = Profile::load("h100-one-gpu").unwrap();
        // Compute alone (the copy beside it has a test of its own).
        (profile.copy.rate_beside_compute, profile.copy.compute_beside_copy) = (1.0, 1.0);
        (profile.compute.launch_us, profile.compute.gemm_overhead_us) = (0.0, 0.0);
        profile.compute.concurrent_throughput = [1.0, 1.25, 1.25, 1.25, 1.25, 1.25, 1.25, 1.25];
        let plan = one_gpu_plan();
        let gemm = profile.gemm_cost(1024, 4096, 4096, DType::F16, DType::F32, false).work_s;
        let end = |priorities: Vec<i32>, device| {
            let options = SimOptions { compute_priority: priorities, ..SimOptions::default() };
            simulate(&plan, &profile, &options).unwrap().record(OpSite { device, lane: 0, index: 0 }).end_s
        };
        // Together: both at 1.25/2 of the GPU, ending at 2/1.25 GEMMs.
        assert!((end(Vec::new(), 0) - 2.0 * gemm / 1.25).abs() < 1e-9);
        // Device 1 first: it runs as fast as alone (a GEMM never beats its own time), and
        // device 0 takes the quarter it leaves, then the whole GPU.
        assert!((end(vec![1, 0], 1) - gemm).abs() < 1e-9);
        assert!((end(vec![1, 0], 0) - (gemm + 0.75 * gemm)).abs() < 1e-9);
        // A profile whose first throughput is not 1 is refused.
        assert_refused(
            ("launch_us = 2.0", "launch_us = 2.0\nconcurrent_throughput = [1.1, 1.2, 1.2, 1.2]"),
            "concurrent_throughput",
        );
    }

    /// fused_push's blocks add into the owners' sums as ring_push's GEMMs do: across GPUs
    /// the same bytes cross the same links (counted once, not again for the kernel), the
    /// link time lengthening the run; on one GPU nothing crosses a link.
    #[test]
    fn fused_blocks_on_a_peers_c_cross_the_link_as_ring_push_s_gemms_do() {
        let p = Problem::new(OpKind::GemmRs, 4, 4 * 1024, 4096, 4 * 4096, DType::F16, DType::F16).unwrap();
        let (push, fused) =
            (build_plan(&p, Algorithm::RingPush).unwrap(), build_plan(&p, Algorithm::FusedPush { chunks: 1 }).unwrap());
        let nvlink = Profile::load("h100-nvlink").unwrap();
        let (a, b) = (sim(&push, &nvlink), sim(&fused, &nvlink));
        assert!(a.comm_floor_s > 0.0);
        assert!(
            (a.comm_floor_s - b.comm_floor_s).abs() <= 1e-9 * a.comm_floor_s,
            "{} {}",
            a.comm_floor_s,
            b.comm_floor_s
        );
        assert!(b.makespan_s >= b.comm_floor_s);
        let one = Profile::load("h100-one-gpu").unwrap();
        assert_eq!(sim(&fused, &one).comm_floor_s, 0.0);
    }

    #[test]
    fn a_fused_gemm_waits_inside_only_for_late_data() {
        // The kernel's mechanics, whatever its engine's rate: GEMMs at cuBLAS's.
        let sim = |plan: &Plan, profile: &Profile| {
            simulate(plan, profile, &SimOptions { engines: Engines::CublasSpeed, ..SimOptions::default() }).unwrap()
        };
        // Over PCIe the shards arrive long after the GEMM could use them: the kernel's
        // blocks wait, and the plan cannot beat the ring's arrival of the last shard.
        let p = seed000(4);
        let pcie = Profile::load("pcie-gen4").unwrap();
        let fused = sim(&build_plan(&p, Algorithm::Fused { chunks: 1 }).unwrap(), &pcie);
        assert!(fused.comm_floor_s > fused.compute_floor_s);
        assert!(fused.makespan_s >= fused.comm_floor_s, "{} < {}", fused.makespan_s, fused.comm_floor_s);
        let gated: f64 =
            fused.records[0][0].iter().filter(|r| r.class == OpClass::Wait).map(|r| r.start_s - r.reached_s).sum();
        assert!(gated > 0.0, "no block waited");
        // On NVLink the data is early: no block waits, and the kernel is one launch.
        let h100 = Profile::load("h100-nvlink").unwrap();
        let fast = sim(&build_plan(&p, Algorithm::Fused { chunks: 1 }).unwrap(), &h100);
        let gated: f64 =
            fast.records[0][0].iter().filter(|r| r.class == OpClass::Wait).map(|r| r.end_s - r.reached_s).sum();
        assert_eq!(gated, 0.0);
        assert!((fast.makespan_s - (h100.launch_s() + fast.compute_floor_s)).abs() < 1e-9, "{fast:?}");
    }

    /// Each GEMM is priced on the engine the CUDA backend runs it on: the ring's on cuBLAS,
    /// the fused run once on the Hopper engine (on a Hopper profile) or the tile kernel (on
    /// an A100's); at cuBLAS's rate (a potential) the fused plan is never slower.
    #[test]
    fn gemms_are_priced_on_the_engines_that_run_them() {
        let p = seed000(4);
        let (ring, fused) =
            (build_plan(&p, Algorithm::Ring).unwrap(), build_plan(&p, Algorithm::Fused { chunks: 1 }).unwrap());
        let h100 = Profile::load("h100-nvlink").unwrap();
        assert_eq!(sim(&ring, &h100).engines.describe(), "cuBLAS ×16");
        assert_eq!(sim(&fused, &h100).engines.describe(), "Hopper engine 128x256 ×4");
        let pcie = Profile::load("pcie-gen4").unwrap();
        assert_eq!(sim(&fused, &pcie).engines.describe(), "tile kernel 64x64 ×4");
        let potential = SimOptions { engines: Engines::CublasSpeed, ..SimOptions::default() };
        for profile in [&h100, &pcie] {
            let at_cublas = simulate(&fused, profile, &potential).unwrap();
            assert!(at_cublas.makespan_s <= sim(&fused, profile).makespan_s, "{}", profile.name);
            assert_eq!(at_cublas.pricing, Engines::CublasSpeed);
        }
        // A profile without rates of cmm's kernels (a TPU's) prices every GEMM at its own.
        let tpu = Profile::load("tpuv4-torus").unwrap();
        let r = simulate(&ring, &tpu, &SimOptions::default()).unwrap();
        let at = simulate(&ring, &tpu, &potential).unwrap();
        assert_eq!(r.makespan_s, at.makespan_s);
        // It has no cuBLAS to name: its GEMMs are told by their rate.
        assert_eq!(r.gemm_engines(), "16 GEMM(s) at the profile's rate");
        assert_eq!(sim(&ring, &h100).gemm_engines(), "cuBLAS ×16");
    }

    #[test]
    fn a_deadlocked_plan_is_an_error_naming_the_blocked_lane() {
        let profile = Profile::load("h100-nvlink").unwrap();
        let mut plan = build_plan(&seed000(2), Algorithm::Ring).unwrap();
        // Device 1 never signals: device 0's compute lane waits forever.
        plan.programs[1].lanes[1].retain(|op| !matches!(op, Op::Signal { .. }));
        let e = simulate(&plan, &profile, &SimOptions::default()).unwrap_err();
        match &e {
            SimError::Deadlock { blocked, .. } => {
                assert!(blocked.iter().any(|b| b.device == 0 && b.lane == "compute" && b.semaphore == "recv"), "{e}")
            }
            other => panic!("expected a deadlock, got {other}"),
        }
    }

    #[test]
    fn too_many_devices_and_bad_torus_shapes_are_errors() {
        let profile = Profile::load("h100-nvlink").unwrap();
        let p = Problem::new(OpKind::AgGemm, 16, 16, 16, 16, DType::F16, DType::F16).unwrap();
        let plan = build_plan(&p, Algorithm::Ring).unwrap();
        assert!(matches!(
            simulate(&plan, &profile, &SimOptions::default()),
            Err(SimError::TooManyDevices { max: 8, .. })
        ));
        let tpu = Profile::load("tpuv4-torus").unwrap();
        let bad = SimOptions { torus_dims: Some(vec![3, 5]), ..SimOptions::default() };
        assert!(matches!(simulate(&plan, &tpu, &bad), Err(SimError::TorusShape { .. })));
        let square = SimOptions { torus_dims: Some(vec![4, 4]), ..SimOptions::default() };
        assert!(simulate(&plan, &tpu, &square).is_ok());
    }
}
