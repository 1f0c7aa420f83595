//! The plan verifier: replays one schedule of a plan over shadow memory and reports
//! races, reads of unwritten memory, outputs never written and semaphore accounting
//! errors, without running any arithmetic.
//!
//! Happens-before is tracked with vector clocks, one component per (device, lane):
//! program order within a lane, `Signal` = release, `Wait` = acquire. A wait for value
//! v acquires the releases of the signals that brought the counter to v in this
//! schedule (FastTrack-style epochs per element, one writer and the reads since it).

mod cells;
pub mod queues;

pub use cells::Cells;

use std::collections::BTreeSet;

use smallvec::SmallVec;
use std::fmt;
use thiserror::Error;

use crate::plan::{Op, OpSite, Plan, Region};
use crate::schedule::Schedule;

/// What an op does to a region of a device's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    /// Whose memory.
    pub device: usize,
    /// Which region.
    pub region: Region,
    /// Write (true) or read.
    pub write: bool,
}

/// Every region an op of device `device` reads or writes (reads first).
pub fn accesses(device: usize, op: &Op) -> Vec<Access> {
    let read = |region: &Region| Access { device, region: *region, write: false };
    match op {
        Op::Gemm { a, b, c, accumulate, c_device, .. } => {
            let owner = c_device.unwrap_or(device);
            let mut v = vec![read(a), read(b)];
            if *accumulate {
                v.push(Access { device: owner, region: *c, write: false });
            }
            v.push(Access { device: owner, region: *c, write: true });
            v
        }
        Op::Copy { src, dst_device, dst, .. } => {
            vec![read(src), Access { device: *dst_device, region: *dst, write: true }]
        }
        Op::Reduce { inputs, output } | Op::Pointwise { inputs, output, .. } => {
            let mut v: Vec<Access> = inputs.iter().map(read).collect();
            v.push(Access { device, region: *output, write: true });
            v
        }
        Op::Attend { q, k, v, state, fresh, .. } => {
            let mut v: Vec<Access> = vec![read(q), read(k), read(v)];
            if !*fresh {
                v.extend(state.regions().iter().map(read));
            }
            v.extend(state.regions().iter().map(|r| Access { device, region: *r, write: true }));
            v
        }
        Op::AttnMerge { from, into, .. } => {
            let mut v: Vec<Access> = from.regions().iter().chain(&into.regions()).map(read).collect();
            v.extend(into.regions().iter().map(|r| Access { device, region: *r, write: true }));
            v
        }
        Op::AttnFinish { state, out, lse, .. } => {
            let mut v: Vec<Access> = state.regions().iter().map(read).collect();
            v.extend([out, lse].iter().map(|r| Access { device, region: **r, write: true }));
            v
        }
        // Table-driven ops are described by the regions they may touch, whatever the
        // tables hold: a plan proven race-free this way is race-free for every routing.
        Op::Route { ids, tables, .. } => {
            let mut v = vec![read(ids)];
            v.extend(tables.regions().iter().map(|r| Access { device, region: *r, write: true }));
            v
        }
        Op::GroupedGemm { a, b, c, tables, gather, .. } => {
            let mut v = vec![read(a), read(b), read(&tables.seg)];
            if gather.is_some() {
                v.push(read(&tables.perm));
            }
            v.push(Access { device, region: *c, write: true });
            v
        }
        Op::Combine { rows, weights, inv, out } => {
            vec![read(rows), read(weights), read(inv), Access { device, region: *out, write: true }]
        }
        Op::Signal { .. } | Op::Wait { .. } => Vec::new(),
    }
}

/// What one device of a plan does to another's memory: the pairs a multi-GPU run needs
/// peer access for, and which of them need native peer atomics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PeerEdge {
    /// The device whose ops reach across.
    pub from: usize,
    /// The device whose memory or semaphores they reach.
    pub to: usize,
    /// Whether a signal crosses (an atomic add on the peer's semaphore), not only data.
    pub atomic: bool,
}

/// Every pair of devices whose ops reach across, with whether a signal crosses, in
/// (from, to) order.
pub fn peer_edges(plan: &Plan) -> Vec<PeerEdge> {
    let mut edges = std::collections::BTreeMap::<(usize, usize), bool>::new();
    for (site, op) in plan.ops() {
        let from = site.device;
        if let Op::Signal { device, .. } = op {
            if *device != from {
                edges.insert((from, *device), true);
            }
        }
        for access in accesses(from, op) {
            if access.device != from {
                edges.entry((from, access.device)).or_insert(false);
            }
        }
    }
    edges.into_iter().map(|((from, to), atomic)| PeerEdge { from, to, atomic }).collect()
}

/// A defect found by the verifier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finding {
    /// Two conflicting accesses not ordered by happens-before.
    Race {
        /// The earlier op (in this schedule).
        first: OpSite,
        /// Its text.
        first_text: String,
        /// The later op.
        second: OpSite,
        /// Its text.
        second_text: String,
        /// Whose memory.
        device: usize,
        /// Buffer name.
        buffer: String,
        /// First conflicting element (row, column).
        element: (usize, usize),
        /// "write/write", "write/read" or "read/write".
        kind: &'static str,
    },
    /// An op read an element that no op (and no input) had written.
    UnwrittenRead {
        /// The op.
        site: OpSite,
        /// Its text.
        text: String,
        /// Whose memory.
        device: usize,
        /// Buffer name.
        buffer: String,
        /// First such element (row, column).
        element: (usize, usize),
    },
    /// An output element that no op wrote (it would hold poison).
    UnwrittenOutput {
        /// Device.
        device: usize,
        /// Buffer name.
        buffer: String,
        /// First such element (row, column).
        element: (usize, usize),
        /// How many elements.
        count: usize,
    },
    /// An output element whose last write is not ordered before the end of its device's
    /// program: the device could consider its result complete before the data arrives.
    UnorderedOutput {
        /// The writing op.
        writer: OpSite,
        /// Its text.
        writer_text: String,
        /// Whose output.
        device: usize,
        /// Buffer name.
        buffer: String,
        /// First such element (row, column).
        element: (usize, usize),
    },
    /// A semaphore whose final value disagrees with what the plan implies.
    SemaphoreAudit {
        /// Device.
        device: usize,
        /// Semaphore name.
        semaphore: String,
        /// The value implied by the plan.
        expected: u32,
        /// The value reached.
        actual: u32,
        /// Why `expected` is expected.
        detail: &'static str,
    },
}

fn site_text(plan: &Plan, s: &OpSite) -> String {
    format!("device {} lane {} op {}", s.device, plan.lanes[s.lane], s.index)
}

impl Finding {
    /// A one-line report.
    pub fn describe(&self, plan: &Plan) -> String {
        match self {
            Finding::Race { first, first_text, second, second_text, device, buffer, element, kind } => format!(
                "race ({kind}) on device {device} {buffer}[{}, {}]: {} `{first_text}` and {} `{second_text}` are not ordered",
                element.0,
                element.1,
                site_text(plan, first),
                site_text(plan, second)
            ),
            Finding::UnwrittenRead { site, text, device, buffer, element } => format!(
                "read of unwritten memory: {} `{text}` reads device {device} {buffer}[{}, {}] before anything wrote it",
                site_text(plan, site),
                element.0,
                element.1
            ),
            Finding::UnwrittenOutput { device, buffer, element, count } => format!(
                "output never written: device {device} {buffer} has {count} elements no op wrote, first [{}, {}]",
                element.0, element.1
            ),
            Finding::UnorderedOutput { writer, writer_text, device, buffer, element } => format!(
                "output not ordered before the end: device {device} {buffer}[{}, {}] is written by {} `{writer_text}`, which no wait of device {device} orders before its last op",
                element.0,
                element.1,
                site_text(plan, writer)
            ),
            Finding::SemaphoreAudit { device, semaphore, expected, actual, detail } => {
                format!("semaphore audit: device {device} {semaphore} ends at {actual}, expected {expected} ({detail})")
            }
        }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// An op as the replay saw it: its lane's vector clock component when it ran. A lane's
/// own component starts at 1 and only its own ops advance it (other lanes learn it, never
/// raise it), so the op is the lane's op number `clock − 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Epoch {
    lane: u32,
    clock: u32,
}

/// The last write of an element: an op's epoch, or one of two lanes no plan has (so that
/// a cell stays 32 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Written(Epoch);

impl Written {
    /// Never written.
    const NEVER: Written = Written(Epoch { lane: u32::MAX, clock: 0 });
    /// An input: written before everything.
    const INPUT: Written = Written(Epoch { lane: u32::MAX - 1, clock: 0 });

    /// The op that wrote it, if an op did.
    fn by(self) -> Option<Epoch> {
        (self != Written::NEVER && self != Written::INPUT).then_some(self.0)
    }
}

/// The shadow of one element: the verifier's hot data, so kept small (a replay touches
/// every element of every access).
#[derive(Clone, Debug)]
struct Cell {
    write: Written,
    /// The reads since the write, at most one per lane; inline, since an element is
    /// read by one or two lanes between writes in almost every plan.
    reads: SmallVec<[Epoch; 2]>,
}

fn join(into: &mut [u32], other: &[u32]) {
    for (a, b) in into.iter_mut().zip(other) {
        *a = (*a).max(*b);
    }
}

/// Vector clocks of a replay: one per (device, lane), advanced by program order,
/// `Signal` (release into the semaphore's history) and `Wait` (acquire of the signals
/// that brought the counter to the awaited value in this schedule).
struct Clocks {
    lanes: usize,
    n_sems: usize,
    clocks: Vec<Vec<u32>>,
    /// Per (device, semaphore): cumulative value after each signal and the joined
    /// release clocks up to it.
    history: Vec<Vec<(u32, Vec<u32>)>>,
}

impl Clocks {
    fn new(plan: &Plan) -> Clocks {
        let lanes = plan.lanes.len();
        let n_lanes = plan.devices * lanes;
        let clocks = (0..n_lanes)
            .map(|t| {
                let mut v = vec![0u32; n_lanes];
                v[t] = 1;
                v
            })
            .collect();
        let n_sems = plan.semaphores.len();
        Clocks { lanes, n_sems, clocks, history: vec![Vec::new(); plan.devices * n_sems] }
    }

    /// The lane index of a site (its vector clock component).
    fn lane(&self, s: &OpSite) -> usize {
        s.device * self.lanes + s.lane
    }

    /// Applies the synchronisation of `op` at `site` (before its data accesses).
    fn sync(&mut self, site: &OpSite, op: &Op) {
        let t = self.lane(site);
        match op {
            Op::Signal { device, sem, add } => {
                let n_lanes = self.clocks.len();
                let h = &mut self.history[device * self.n_sems + sem.0];
                let (value, mut clock) = h.last().cloned().unwrap_or((0, vec![0; n_lanes]));
                join(&mut clock, &self.clocks[t]);
                h.push((value.saturating_add(*add), clock));
            }
            Op::Wait { sem, value } if *value > 0 => {
                let h = &self.history[site.device * self.n_sems + sem.0];
                // Values only grow along a history: the first entry that reaches the
                // wait's value, by binary search.
                if let Some((_, clock)) = h.get(h.partition_point(|(v, _)| v < value)) {
                    let clock = clock.clone();
                    join(&mut self.clocks[t], &clock);
                }
            }
            _ => {}
        }
    }

    /// Advances the lane of `site` past its op.
    fn tick(&mut self, site: &OpSite) {
        let t = self.lane(site);
        self.clocks[t][t] += 1;
    }
}

/// One op of a replay with its happens-before clock: op a happens before op b iff
/// `a.clock[a.lane] <= b.clock[a.lane]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimedOp {
    /// The op.
    pub site: OpSite,
    /// Its lane's vector clock component.
    pub lane: usize,
    /// The vector clock of its lane when it ran.
    pub clock: Vec<u32>,
}

impl TimedOp {
    /// Whether this op happens before `other` (in the replayed schedule).
    pub fn happens_before(&self, other: &TimedOp) -> bool {
        self.clock[self.lane] <= other.clock[self.lane] && self.site != other.site
    }
}

/// Every op of `schedule` with its happens-before clock, in schedule order.
pub fn timed_ops(plan: &Plan, schedule: &Schedule) -> Vec<TimedOp> {
    let mut clocks = Clocks::new(plan);
    schedule
        .order
        .iter()
        .map(|site| {
            let op = &plan.programs[site.device].lanes[site.lane][site.index];
            clocks.sync(site, op);
            let lane = clocks.lane(site);
            let timed = TimedOp { site: *site, lane, clock: clocks.clocks[lane].clone() };
            clocks.tick(site);
            timed
        })
        .collect()
}

/// The most memory the verifier's state may take: 7 GiB. It keeps a shadow cell of at
/// most [`SHADOW_CELL_BYTES`] per element of every buffer on every device, and a vector
/// clock of 4 bytes per lane of the plan for every lane and every signal. A plan with few
/// lanes may so hold 2^27 elements, as many 32-bit words as the reference binds on
/// lavapipe (4 × 128 MiB), and more; about 43,000 lanes over all devices reach it through their
/// clocks alone (a ring's plan reaches [`crate::plan::MAX_PLAN_OPS`] first, at ~900
/// devices, with clocks of about 6 GiB). Past it, a plan is refused with
/// [`VerifyError::TooLarge`] rather than exhausting memory.
pub const MAX_VERIFIER_BYTES: u64 = 7 << 30;

/// The bytes [`MAX_VERIFIER_BYTES`] counts per shadowed element (the largest shadow cell
/// (`Cell`, with smallvec's `union`).
pub const SHADOW_CELL_BYTES: u64 = 32;

// A plan without lanes may shadow 2^27 elements at least.
const _: () = assert!(MAX_VERIFIER_BYTES >= (1 << 27) * SHADOW_CELL_BYTES);

/// A plan the verifier does not replay.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// Its state would exceed [`MAX_VERIFIER_BYTES`].
    #[error("plan `{plan}`: the verifier would need {bytes} bytes, more than its {limit}: {cells} shadow cells ({SHADOW_CELL_BYTES} bytes each; the plan's regions cut its {elements} buffer elements over {devices} devices no coarser) and {clock_entries} vector-clock entries (4 bytes each; {lanes} lanes, {signals} signals); verify the same algorithm on fewer devices or with coarser regions, where the same synchronisation is exercised")]
    TooLarge {
        /// Plan name.
        plan: String,
        /// Devices.
        devices: usize,
        /// Buffer elements over every device.
        elements: u64,
        /// Shadow cells over every device ([`Cells`]): rectangles of elements that every
        /// access covers whole or not at all.
        cells: u64,
        /// Lanes over every device (the length of a vector clock).
        lanes: u64,
        /// Signal ops (each keeps a clock).
        signals: u64,
        /// Clock entries: lanes × (lanes + signals).
        clock_entries: u64,
        /// The estimate.
        bytes: u64,
        /// [`MAX_VERIFIER_BYTES`].
        limit: u64,
    },
}

/// Whether the verifier's state for `plan` fits [`MAX_VERIFIER_BYTES`].
pub fn check_size(plan: &Plan) -> Result<(), VerifyError> {
    check_cells(plan, &Cells::of(plan))
}

/// Whether the verifier's state for `plan`, shadowed in `cells`, fits [`MAX_VERIFIER_BYTES`]
/// (for a caller that replays several schedules in the same cells).
pub fn check_cells(plan: &Plan, cells: &Cells) -> Result<(), VerifyError> {
    let devices = plan.devices as u64;
    let elements = plan.elements();
    let shadow_cells = cells.per_device().saturating_mul(devices);
    let lanes = devices.saturating_mul(plan.lanes.len() as u64);
    let signals = plan.ops().filter(|(_, op)| matches!(op, Op::Signal { .. })).count() as u64;
    let clock_entries = lanes.saturating_mul(lanes.saturating_add(signals));
    let bytes = shadow_cells.saturating_mul(SHADOW_CELL_BYTES).saturating_add(clock_entries.saturating_mul(4));
    if bytes > MAX_VERIFIER_BYTES {
        return Err(VerifyError::TooLarge {
            plan: plan.name.clone(),
            devices: plan.devices,
            elements,
            cells: shadow_cells,
            lanes,
            signals,
            clock_entries,
            bytes,
            limit: MAX_VERIFIER_BYTES,
        });
    }
    Ok(())
}

/// Replays `schedule` of `plan` and returns every finding (deduplicated per op pair),
/// or refuses a plan too large to shadow ([`check_size`]).
pub fn verify(plan: &Plan, schedule: &Schedule) -> Result<Vec<Finding>, VerifyError> {
    verify_in(plan, schedule, &Cells::of(plan))
}

/// [`verify`] with one shadow cell per element of every buffer: the definition that the
/// cells of [`Cells::of`] must agree with, finding for finding (a test compares them on
/// the corpus). Its cost grows with M, N and K.
pub fn verify_per_element(plan: &Plan, schedule: &Schedule) -> Result<Vec<Finding>, VerifyError> {
    verify_in(plan, schedule, &Cells::per_element(plan))
}

/// [`verify`] in cells computed once for several schedules of the plan ([`Cells::of`]).
pub fn verify_in(plan: &Plan, schedule: &Schedule, cells: &Cells) -> Result<Vec<Finding>, VerifyError> {
    check_cells(plan, cells)?;
    let lanes = plan.lanes.len();
    let n_lanes = plan.devices * lanes;
    let mut hb = Clocks::new(plan);
    let mut shadow: Vec<Vec<Vec<Cell>>> = (0..plan.devices)
        .map(|_| {
            plan.buffers
                .iter()
                .zip(&cells.grids)
                .map(|(b, grid)| {
                    let write = if b.role.initialized() { Written::INPUT } else { Written::NEVER };
                    vec![Cell { write, reads: SmallVec::new() }; grid.len()]
                })
                .collect()
        })
        .collect();
    let mut findings = Vec::new();
    let mut reported: BTreeSet<(OpSite, OpSite)> = BTreeSet::new();
    let mut unwritten_reported: BTreeSet<OpSite> = BTreeSet::new();

    let site_of = |e: &Epoch| OpSite {
        device: e.lane as usize / lanes,
        lane: e.lane as usize % lanes,
        index: e.clock as usize - 1,
    };
    for site in &schedule.order {
        let t = hb.lane(site);
        let op = &plan.programs[site.device].lanes[site.lane][site.index];
        hb.sync(site, op);
        let clocks = &hb.clocks;
        let now = Epoch { lane: t as u32, clock: clocks[t][t] };
        debug_assert_eq!(site_of(&now), *site);
        match op {
            Op::Signal { .. } | Op::Wait { .. } => {}
            _ => {
                let mine = &clocks[t];
                let ordered = |e: &Epoch| e.clock <= mine[e.lane as usize];
                for acc in accesses(site.device, op) {
                    let b = &plan.buffers[acc.region.buf.0];
                    let grid = &cells.grids[acc.region.buf.0];
                    let shadow = &mut shadow[acc.device][acc.region.buf.0];
                    // The first element of a cell, for a finding only: this loop is the
                    // verifier's hot path.
                    let element = |idx: usize| grid.element(idx);
                    let mut race = |findings: &mut Vec<Finding>, other: &Epoch, kind: &'static str, idx: usize| {
                        let first = site_of(other);
                        if reported.insert((first, *site)) {
                            findings.push(Finding::Race {
                                first,
                                first_text: plan.op_text(&plan.programs[first.device].lanes[first.lane][first.index]),
                                second: *site,
                                second_text: plan.op_text(op),
                                device: acc.device,
                                buffer: b.name.clone(),
                                element: element(idx),
                                kind,
                            });
                        }
                    };
                    // Elements past the buffer are the plan validator's to report.
                    for run in grid.runs(&acc.region, b) {
                        for (idx, cell) in run.clone().zip(&mut shadow[run]) {
                            if cell.write == Written::NEVER && !acc.write {
                                if unwritten_reported.insert(*site) {
                                    findings.push(Finding::UnwrittenRead {
                                        site: *site,
                                        text: plan.op_text(op),
                                        device: acc.device,
                                        buffer: b.name.clone(),
                                        element: element(idx),
                                    });
                                }
                                // The rest of the row is this read's too: once is enough.
                                break;
                            }
                            if let Some(w) = cell.write.by().filter(|w| !ordered(w)) {
                                race(&mut findings, &w, if acc.write { "write/write" } else { "write/read" }, idx);
                            }
                            if acc.write {
                                for rd in &cell.reads {
                                    if !ordered(rd) && rd.lane != now.lane {
                                        race(&mut findings, rd, "read/write", idx);
                                    }
                                }
                                cell.write = Written(now);
                                cell.reads.clear();
                            } else {
                                cell.reads.retain(|e| e.lane != now.lane);
                                cell.reads.push(now);
                            }
                        }
                    }
                }
            }
        }
        hb.tick(site);
    }
    let clocks = &hb.clocks;

    for (device, bufs) in shadow.iter().enumerate() {
        // The end of a device's program: every one of its lanes has finished.
        let mut end = vec![0u32; n_lanes];
        for lane in 0..lanes {
            join(&mut end, &clocks[device * lanes + lane]);
        }
        for (i, b) in plan.buffers.iter().enumerate() {
            if !b.role.is_result() {
                continue;
            }
            let grid = &cells.grids[i];
            let late = bufs[i]
                .iter()
                .enumerate()
                .find_map(|(e, cell)| cell.write.by().filter(|w| w.clock > end[w.lane as usize]).map(|w| (e, w)));
            if let Some((e, w)) = late {
                findings.push(Finding::UnorderedOutput {
                    writer: site_of(&w),
                    writer_text: {
                        let ws = site_of(&w);
                        plan.op_text(&plan.programs[ws.device].lanes[ws.lane][ws.index])
                    },
                    device,
                    buffer: b.name.clone(),
                    element: grid.element(e),
                });
            }
            // An uneven shard's padding holds no result: only the device's rows count.
            let mut missing = (0..grid.len())
                .filter(|&e| bufs[i][e].write == Written::NEVER && grid.element(e).0 < b.rows_on(device));
            if let Some(first) = missing.next() {
                findings.push(Finding::UnwrittenOutput {
                    device,
                    buffer: b.name.clone(),
                    element: grid.element(first),
                    count: grid.weight(first) + missing.map(|e| grid.weight(e)).sum::<usize>(),
                });
            }
        }
    }
    findings.extend(audit(plan, schedule));
    Ok(findings)
}

/// Who each read observes: per (op, read access), a digest of the op that last wrote
/// each element it reads (or "an input"), and per (device, output buffer) a digest of
/// the last writer of each element, in the replayed schedule. In a race-free plan every
/// read observes the write that happens before it, whatever the interleaving, so two
/// race-free plans with equal dataflows (sites mapped by `rename`) compute the same
/// function of their inputs. Digests are taken cell by cell of `cells`, which must cut
/// both plans' accesses whole ([`Cells::common`]), so that equal digests mean equal
/// writers element by element.
pub fn dataflow(
    plan: &Plan,
    schedule: &Schedule,
    rename: &dyn Fn(OpSite) -> OpSite,
    cells: &Cells,
) -> Result<std::collections::BTreeMap<(OpSite, usize), u64>, VerifyError> {
    check_cells(plan, cells)?;
    let fold = |h: u64, x: u64| (h ^ x).wrapping_mul(0x0100_0000_01b3);
    let code = |w: Option<OpSite>| match w.map(rename) {
        None => u64::MAX,
        Some(s) => ((s.device as u64) << 48) ^ ((s.lane as u64) << 32) ^ s.index as u64,
    };
    let mut writer: Vec<Vec<Vec<Option<OpSite>>>> =
        (0..plan.devices).map(|_| cells.grids.iter().map(|g| vec![None; g.len()]).collect()).collect();
    let mut out = std::collections::BTreeMap::new();
    for site in &schedule.order {
        let op = &plan.programs[site.device].lanes[site.lane][site.index];
        for (i, acc) in accesses(site.device, op).into_iter().enumerate() {
            let buf = acc.region.buf.0;
            let shadow = &mut writer[acc.device][buf];
            let mut h = 0xcbf2_9ce4_8422_2325u64;
            for run in cells.grids[buf].runs(&acc.region, &plan.buffers[buf]) {
                for cell in &mut shadow[run] {
                    if acc.write {
                        *cell = Some(*site);
                    } else {
                        h = fold(h, code(*cell));
                    }
                }
            }
            if !acc.write {
                out.insert((rename(*site), i), h);
            }
        }
    }
    for (device, bufs) in writer.iter().enumerate() {
        for (b, shadow) in bufs.iter().enumerate() {
            if plan.buffers[b].role.is_result() {
                let h = shadow.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, w| fold(h, code(*w)));
                out.insert((OpSite { device, lane: usize::MAX, index: b }, 0), h);
            }
        }
    }
    Ok(out)
}

/// The semaphore audit: each semaphore must end at the sum of the signals sent to it,
/// and that sum must be exactly the largest value any wait on it needs (a signal that
/// no wait consumes lets a later reuse run early).
pub fn audit(plan: &Plan, schedule: &Schedule) -> Vec<Finding> {
    let n_sems = plan.semaphores.len();
    let mut implied = vec![0u32; plan.devices * n_sems];
    let mut awaited = vec![0u32; plan.devices * n_sems];
    for (site, op) in plan.ops() {
        match op {
            Op::Signal { device, sem, add } => {
                let v = &mut implied[device * n_sems + sem.0];
                *v = v.saturating_add(*add);
            }
            Op::Wait { sem, value } => {
                let v = &mut awaited[site.device * n_sems + sem.0];
                *v = (*v).max(*value);
            }
            _ => {}
        }
    }
    let mut findings = Vec::new();
    for device in 0..plan.devices {
        for s in 0..n_sems {
            let actual = schedule.final_semaphores.get(device).and_then(|v| v.get(s)).copied().unwrap_or(0);
            let semaphore = plan.semaphores[s].clone();
            let (exp, waits) = (implied[device * n_sems + s], awaited[device * n_sems + s]);
            if actual != exp {
                findings.push(Finding::SemaphoreAudit {
                    device,
                    semaphore: semaphore.clone(),
                    expected: exp,
                    actual,
                    detail: "the sum of the plan's signals to it",
                });
            } else if actual != waits {
                findings.push(Finding::SemaphoreAudit {
                    device,
                    semaphore,
                    expected: waits,
                    actual,
                    detail: "the largest value any wait on it needs",
                });
            }
        }
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{algorithms_for, build_plan};
    use crate::schedule::{orders, schedule_with};
    use crate::testing::assert_clean_under;
    use crate::{DType, OpKind, Problem};

    #[test]
    fn the_shadow_of_the_largest_verified_plan_is_as_documented() {
        assert_eq!(std::mem::size_of::<Cell>() as u64, SHADOW_CELL_BYTES);
    }

    #[test]
    fn a_plan_too_large_to_shadow_is_a_typed_error_not_an_allocation() {
        use crate::plan::{BufferRole, Engine, PlanBuilder};
        // X is `rows` × 2^10 on each of 2 devices. A copy out of it with a row stride of
        // 3 elements, not a multiple of X's columns, makes X one cell per element.
        let plan_of = |rows, stride| {
            let mut b = PlanBuilder::new("huge", 2);
            let x = b.buffer("X", DType::F32, rows, 1 << 10, BufferRole::Scratch);
            let y = b.buffer("Y", DType::F32, 2, 1, BufferRole::Scratch);
            let lane = b.lane("l");
            let src = Region { buf: x, offset: 0, rows: 2, cols: 1, stride };
            b.push(0, lane, Op::Copy { src, dst_device: 0, dst: b.whole(y), engine: Engine::CopyEngine });
            b.finish().unwrap()
        };
        // Per device X's cells and Y's one (it is only accessed whole); clocks of 2 lanes
        // (16 bytes).
        let bytes_of = |rows: u64| 2 * (rows * (1 << 10) + 1) * SHADOW_CELL_BYTES + 16;
        let rows = ((MAX_VERIFIER_BYTES - bytes_of(0)) / (2 * (1 << 10) * SHADOW_CELL_BYTES)) as usize;
        assert!(bytes_of(rows as u64) <= MAX_VERIFIER_BYTES && bytes_of(rows as u64 + 1) > MAX_VERIFIER_BYTES);
        assert_eq!(check_size(&plan_of(rows, 3)), Ok(()));
        let plan = plan_of(rows + 1, 3);
        let s = schedule_with(&plan, crate::schedule::Order::Default).unwrap();
        let e = verify(&plan, &s).unwrap_err();
        let cells = 2 * ((rows as u64 + 1) * (1 << 10) + 1);
        assert_eq!(
            e,
            VerifyError::TooLarge {
                plan: "huge".into(),
                devices: 2,
                elements: cells + 2,
                cells,
                lanes: 2,
                signals: 0,
                clock_entries: 4,
                bytes: bytes_of(rows as u64 + 1),
                limit: MAX_VERIFIER_BYTES
            }
        );
        assert!(e.to_string().contains("verify the same algorithm on fewer devices or with coarser regions"), "{e}");
        assert!(dataflow(&plan, &s, &|s| s, &Cells::of(&plan)).is_err());
        // The same buffer read as whole rows is a few cells: it verifies, and reports
        // the read of unwritten memory at its first element.
        let plan = plan_of(rows + 1, 1 << 10);
        assert_eq!(check_size(&plan), Ok(()));
        let s = schedule_with(&plan, crate::schedule::Order::Default).unwrap();
        let found = verify(&plan, &s).unwrap();
        assert!(matches!(&found[..], [Finding::UnwrittenRead { element: (0, 0), .. }]), "{found:?}");
    }

    #[test]
    fn a_plan_at_production_sizes_verifies_in_a_few_cells() {
        // Seed 000's shape: 671 million elements over 8 devices, 21 GB of per-element shadow.
        let p = Problem::new(OpKind::AgGemm, 8, 8192, 32768, 4096, DType::F16, DType::F16).unwrap();
        for alg in algorithms_for(OpKind::AgGemm) {
            let plan = build_plan(&p, alg).unwrap();
            let cells = Cells::of(&plan).per_device();
            assert!(cells < 1000, "{}: {cells} cells per device", plan.name);
            assert_clean_under(&plan, 4);
        }
    }

    #[test]
    fn a_plan_whose_vector_clocks_are_too_large_is_refused_too() {
        // Clocks of `lanes` entries, one per lane: lanes² × 4 bytes, with almost no data.
        let plan_of = |lanes: usize| {
            let mut b = crate::plan::PlanBuilder::new("wide", 1);
            b.buffer("X", DType::F32, 1, 1, crate::plan::BufferRole::Scratch);
            for l in 0..lanes {
                b.lane(&format!("l{l}"));
            }
            b.finish().unwrap()
        };
        let e = check_size(&plan_of(45_000)).unwrap_err();
        let VerifyError::TooLarge { elements, lanes, clock_entries, bytes, .. } = e.clone();
        assert_eq!((elements, lanes, clock_entries), (1, 45_000, 45_000 * 45_000), "{e}");
        assert_eq!(bytes, 45_000 * 45_000 * 4 + SHADOW_CELL_BYTES, "{e}");
        assert!(check_size(&plan_of(10_000)).is_ok());
    }

    #[test]
    fn corpus_like_plans_are_clean_under_every_order() {
        for op in OpKind::ALL {
            for d in [1, 2, 3, 4] {
                let p = Problem::new(op, d, 4 * d, 2 * d, 2 * d, DType::F32, DType::F32).unwrap();
                for alg in algorithms_for(op) {
                    let plan = build_plan(&p, alg).unwrap();
                    let bound = crate::algorithms::min_ops(&p, alg);
                    assert!(bound <= plan.op_count() as u128, "{}: {bound} ops at least?", plan.name);
                    assert_clean_under(&plan, 4);
                }
            }
        }
    }

    #[test]
    fn peer_edges_are_the_pairs_a_plan_reaches_across() {
        let problem = |d| Problem::new(OpKind::AgGemm, d, 4 * d, 2 * d, 2 * d, DType::F32, DType::F32).unwrap();
        let ring = build_plan(&problem(4), crate::Algorithm::Ring).unwrap();
        let edges = peer_edges(&ring);
        // A ring reaches its neighbours only, and signals every one it sends to.
        assert_eq!(edges.len(), 4, "{edges:?}");
        for e in &edges {
            assert!(e.to == (e.from + 1) % 4 || e.from == (e.to + 1) % 4, "{e:?} is not a ring step");
            assert!(e.atomic, "{e:?}: the ring signals the shard's receiver");
        }
        let direct = build_plan(&problem(4), crate::Algorithm::BaselineDirect).unwrap();
        let pairs: Vec<(usize, usize)> = peer_edges(&direct).iter().map(|e| (e.from, e.to)).collect();
        let every: Vec<(usize, usize)> =
            (0..4).flat_map(|a| (0..4).filter(move |&b| b != a).map(move |b| (a, b))).collect();
        assert_eq!(pairs, every);
        assert!(peer_edges(&build_plan(&problem(1), crate::Algorithm::Ring).unwrap()).is_empty());
    }

    #[test]
    fn a_wait_too_low_is_reported_as_a_race_naming_both_ops() {
        let p = Problem::new(OpKind::AgGemm, 3, 6, 3, 2, DType::F32, DType::F32).unwrap();
        let mut plan = build_plan(&p, crate::Algorithm::Ring).unwrap();
        // Device 0's compute lane stops waiting for the shard it multiplies at step 1.
        let compute = &mut plan.programs[0].lanes[0];
        let at = compute.iter().position(|op| matches!(op, Op::Wait { .. })).unwrap();
        compute[at] = Op::Wait { sem: crate::SemId(0), value: 0 };
        let mut found = false;
        for order in orders(4, 3) {
            let s = schedule_with(&plan, order).unwrap();
            for f in verify(&plan, &s).unwrap() {
                let text = f.describe(&plan);
                if let Finding::Race { .. } = f {
                    assert!(text.contains("copy") && text.contains("gemm"), "{text}");
                    found = true;
                }
                if let Finding::UnwrittenRead { .. } = f {
                    found = true;
                }
            }
        }
        assert!(found);
    }

    #[test]
    fn reading_scratch_before_any_write_is_reported() {
        let p = Problem::new(OpKind::AgGemm, 2, 4, 2, 2, DType::F32, DType::F32).unwrap();
        let mut plan = build_plan(&p, crate::Algorithm::Ring).unwrap();
        // Device 1 never sends: device 0 then multiplies a slot nobody wrote. Replace
        // the copy with nothing but keep the signal so nothing deadlocks.
        let comm = &mut plan.programs[1].lanes[1];
        let at = comm.iter().position(|op| matches!(op, Op::Copy { .. })).unwrap();
        comm.remove(at);
        let s = schedule_with(&plan, crate::schedule::Order::Default).unwrap();
        let f = verify(&plan, &s).unwrap();
        assert!(f.iter().any(|x| matches!(x, Finding::UnwrittenRead { device: 0, .. })), "{f:?}");
    }

    #[test]
    fn an_extra_signal_fails_the_audit() {
        let p = Problem::new(OpKind::AgGemm, 2, 4, 2, 2, DType::F32, DType::F32).unwrap();
        let mut plan = build_plan(&p, crate::Algorithm::Ring).unwrap();
        plan.programs[1].lanes[1].push(Op::Signal { device: 0, sem: crate::SemId(0), add: 1 });
        let s = schedule_with(&plan, crate::schedule::Order::Default).unwrap();
        let f = verify(&plan, &s).unwrap();
        assert!(
            f.iter().any(|x| matches!(x, Finding::SemaphoreAudit { device: 0, expected: 1, actual: 2, .. })),
            "{f:?}"
        );
    }
}
