//! The plan model (BRIEF §5): symmetric buffers, semaphores, and per device a few lanes,
//! each an ordered list of ops. Only semaphores order ops across lanes and devices.
//!
//! Executors (the wgpu reference, CUDA, the simulator) run plans without knowing which
//! algorithm made them; algorithms produce plans without knowing any executor.

use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::dtype::DType;
use crate::router::{Router, RouterPart};

mod validate;

/// Index of a buffer in [`Plan::buffers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BufId(pub usize);

/// Index of a semaphore in [`Plan::semaphores`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SemId(pub usize);

/// What a buffer holds at the start and end of a run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BufferRole {
    /// Filled by the input generator before the run: on device d, the window of global
    /// tensor `tensor` (of `global_cols` columns) starting at `origins[d]`.
    Input {
        /// Generator tensor id.
        tensor: u32,
        /// Columns of the global tensor (the row stride of its element index).
        global_cols: usize,
        /// Per device, the (row, column) of the buffer's element (0, 0) in the global tensor.
        origins: Vec<(usize, usize)>,
    },
    /// Read back after the run: the device's result.
    Output,
    /// Working memory: received shards, partial sums.
    Scratch,
    /// Generated like an [`BufferRole::Input`], updated in place by the plan and read
    /// back as a result (a main_grad the wgrad GEMMs add into).
    Accumulator {
        /// Generator tensor id.
        tensor: u32,
        /// Columns of the global tensor.
        global_cols: usize,
        /// Per device, the (row, column) of the buffer's element (0, 0) in the global tensor.
        origins: Vec<(usize, usize)>,
    },
    /// A table of the router's result (every token's expert ids or weights), the same
    /// on every device, generated on the host ([`crate::router::Router::words`]) and
    /// uploaded before the run: routing is data, not a property of the plan.
    Router {
        /// Which table.
        part: RouterPart,
        /// The router.
        router: Router,
    },
}

/// Per device, the (row, column) of a generated buffer's element (0, 0) in its tensor.
pub type Origins = [(usize, usize)];

impl BufferRole {
    /// The input of a one-device plan that is the whole of generator tensor `tensor`
    /// (`cols` columns wide).
    pub fn whole_tensor(tensor: u32, cols: usize) -> BufferRole {
        BufferRole::Input { tensor, global_cols: cols, origins: vec![(0, 0)] }
    }

    /// The generator window of a buffer filled before the run (an input or an
    /// accumulator): tensor id, global columns, per-device origins.
    pub fn generated(&self) -> Option<(u32, usize, &Origins)> {
        match self {
            BufferRole::Input { tensor, global_cols, origins }
            | BufferRole::Accumulator { tensor, global_cols, origins } => Some((*tensor, *global_cols, origins)),
            BufferRole::Output | BufferRole::Scratch | BufferRole::Router { .. } => None,
        }
    }

    /// Whether the buffer holds data before the run (generated or uploaded).
    pub fn initialized(&self) -> bool {
        self.generated().is_some() || matches!(self, BufferRole::Router { .. })
    }

    /// Whether the buffer holds a result read back after the run.
    pub fn is_result(&self) -> bool {
        matches!(self, BufferRole::Output | BufferRole::Accumulator { .. })
    }
}

/// Rows of a per-device matrix on device `device`: its own count when the devices'
/// differ (uneven shards, `device_rows`), else `rows`.
pub fn rows_on(rows: usize, device_rows: Option<&[usize]>, device: usize) -> usize {
    device_rows.and_then(|r| r.get(device).copied()).unwrap_or(rows)
}

/// Each device's rows as a buffer or an output records them: the largest count, and the
/// counts themselves only when they differ (uneven shards).
pub fn per_device_rows(rows: Vec<usize>) -> (usize, Option<Vec<usize>>) {
    let max = rows.iter().copied().max().unwrap_or(0);
    (max, rows.iter().any(|&r| r != max).then_some(rows))
}

/// Per-device rows as text: `26` when every device has them, `7/7/6/6` when not.
pub fn rows_text(rows: usize, device_rows: Option<&[usize]>) -> String {
    match device_rows {
        None => rows.to_string(),
        Some(each) => each.iter().map(usize::to_string).collect::<Vec<_>>().join("/"),
    }
}

/// A buffer that every device has (a symmetric allocation), a row-major matrix.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDecl {
    /// Name used when printing plans.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Rows.
    pub rows: usize,
    /// Columns (and row stride).
    pub cols: usize,
    /// Role.
    pub role: BufferRole,
    /// Uneven shards: per device, how many of the `rows` rows hold that device's data.
    /// The buffer is allocated at `rows` (the largest device's) everywhere, as symmetric
    /// memory is; device d's ops touch only its first `device_rows[d]` rows, and the
    /// rest is padding that no op reads or writes. `None`: every row on every device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_rows: Option<Vec<usize>>,
}

impl BufferDecl {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Rows holding device `device`'s data ([`BufferDecl::device_rows`]).
    pub fn rows_on(&self, device: usize) -> usize {
        rows_on(self.rows, self.device_rows.as_deref(), device)
    }

    /// Elements holding device `device`'s data: the first `rows_on(device)` rows.
    pub fn len_on(&self, device: usize) -> usize {
        self.rows_on(device) * self.cols
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A 2D strided region of one buffer: element (r, c) is at `offset + r * stride + c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Region {
    /// The buffer.
    pub buf: BufId,
    /// Element offset of (0, 0).
    pub offset: usize,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Distance between rows, in elements.
    pub stride: usize,
}

impl Region {
    /// Whether two regions (of one buffer) share an element: exact for regions with the
    /// same row stride that do not wrap around a row, conservative (their spans overlap)
    /// otherwise.
    pub fn overlaps(&self, other: &Region) -> bool {
        let (a, b) = (self, other);
        if a.is_empty() || b.is_empty() || a.offset >= b.end() || b.offset >= a.end() {
            return false;
        }
        let s = a.stride;
        let rect = |r: &Region| (r.offset / s, r.offset % s, r.rows, r.cols);
        if s == 0 || b.stride != s || a.offset % s + a.cols > s || b.offset % s + b.cols > s {
            return true;
        }
        let ((ar, ac, ah, aw), (br, bc, bh, bw)) = (rect(a), rect(b));
        ar < br + bh && br < ar + ah && ac < bc + bw && bc < ac + aw
    }

    /// One past the last element the region touches (0 when empty). Saturates: a
    /// region of a malformed plan file whose end overflows ends at `usize::MAX`, past
    /// every buffer, and fails validation instead of wrapping into one.
    pub fn end(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            self.offset.saturating_add((self.rows - 1).saturating_mul(self.stride)).saturating_add(self.cols)
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether the region has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The most elements one buffer may have: 2^48, a petabyte of f32, beyond any device's
/// memory. It keeps every index computation on a validated plan far from overflowing
/// (a plan file can declare any size).
pub const MAX_BUFFER_ELEMENTS: usize = 1 << 48;

/// The most ops a plan may have: 2^22. An op takes about 300 bytes, and as much again in
/// the simulator, so the largest plan needs a few GiB; a larger one (a ring of thousands
/// of devices, a 64×64 mesh cut into fine slices) is refused with
/// [`PlanError::TooManyOps`] rather than exhausting memory.
pub const MAX_PLAN_OPS: usize = 1 << 22;

/// Refuses, before any planning, a plan of at least `at_least` ops when that is more than
/// [`MAX_PLAN_OPS`]: the builder would only count the ops past the limit, but a planner
/// that loops over billions of them still takes minutes. Each family's planner passes a
/// cheap lower bound (its devices' exchanges), so what gets past this is counted quickly.
pub fn check_op_bound(plan: impl FnOnce() -> String, at_least: u128) -> Result<(), PlanError> {
    if at_least > MAX_PLAN_OPS as u128 {
        let ops = u64::try_from(at_least).unwrap_or(u64::MAX);
        return Err(PlanError::TooManyOps { plan: plan(), ops, at_least: true, limit: MAX_PLAN_OPS });
    }
    Ok(())
}

/// The most devices a problem may have: 2^16. Every plan gives each device ops, so a plan
/// of more devices could not stay under [`MAX_PLAN_OPS`] for long; refusing the problem
/// first keeps the planners from looping over them at all.
pub const MAX_DEVICES: usize = 1 << 16;

/// A problem with more devices than [`MAX_DEVICES`] (every family's constructor refuses it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("{devices} devices: more than the {MAX_DEVICES} a problem may have")]
pub struct TooManyDevices {
    /// The device count (Nr·Nc for a mesh, computed without overflow).
    pub devices: u128,
}

/// `Ok` if `devices` is at most [`MAX_DEVICES`].
pub fn check_device_count(devices: u128) -> Result<(), TooManyDevices> {
    if devices > MAX_DEVICES as u128 {
        Err(TooManyDevices { devices })
    } else {
        Ok(())
    }
}

/// The most inputs one [`Op::Reduce`] may sum (every executor sums them in one pass);
/// longer sums chain through an f32 accumulator, which adds in the same order.
pub const MAX_REDUCE_INPUTS: usize = 4;

/// Who moves the bytes of a [`Op::Copy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    /// A DMA copy engine (cudaMemcpyAsync); no SMs used.
    CopyEngine,
    /// A copy kernel on the SMs (TileLink's tile push).
    Sm,
}

/// An elementwise function of [`Op::Pointwise`] (the GeLU of seed 004's MLP block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pointwise {
    /// `out = gelu(x)`, inputs `[x]`.
    Gelu,
    /// `out = dy · gelu'(x)`, inputs `[dy, x]`.
    GeluGrad,
}

impl Pointwise {
    /// How many inputs it takes.
    pub fn arity(self) -> usize {
        match self {
            Pointwise::Gelu => 1,
            Pointwise::GeluGrad => 2,
        }
    }

    /// Name in plan texts.
    pub fn name(self) -> &'static str {
        match self {
            Pointwise::Gelu => "gelu",
            Pointwise::GeluGrad => "gelu_grad",
        }
    }

    /// Its code in shaders and kernels (`shaders/pointwise.wgsl`, `cuda/kernels/pointwise.cu`).
    pub fn code(self) -> u32 {
        match self {
            Pointwise::Gelu => 0,
            Pointwise::GeluGrad => 1,
        }
    }

    /// The function on f32 values, as every executor evaluates it (see
    /// [`crate::numeric::gelu`]).
    pub fn apply(self, inputs: &[f32]) -> f32 {
        match self {
            Pointwise::Gelu => crate::numeric::gelu(inputs[0]),
            Pointwise::GeluGrad => inputs[0] * crate::numeric::gelu_grad(inputs[1]),
        }
    }
}

/// Keys an [`Op::Attend`] processes per online-softmax update: every executor walks a
/// block's keys in tiles of this many, from the block's first key, updating the running
/// max once per tile. Part of the contract, since it fixes the rounding.
pub const ATTN_KEY_TILE: usize = 16;

/// The running max of an empty attention state, and the log-sum-exp of a row that saw
/// no key: −f32::MAX, finite, because WGSL lets implementations assume no infinities.
pub const ATTN_EMPTY_MAX: f32 = -f32::MAX;

/// The largest head dimension the attention ops accept (every executor keeps one row of
/// a head in registers or private memory).
pub const MAX_HEAD_DIM: usize = 256;

/// The softmax scale of a head dimension, as every executor computes it on the host:
/// 1/√dh rounded once to f32. The oracle uses this value too: it is part of the contract.
pub fn attention_scale(head_dim: usize) -> f32 {
    (1.0 / (head_dim as f64).sqrt()) as f32
}

/// The online-softmax state of attention rows (f32): per (query row, head) the running
/// max (`max`, rows × heads) and sum of exponentials (`sum`, rows × heads), and the
/// unnormalised output (`acc`, rows × heads·head_dim).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AttnState {
    /// Running max of the scaled scores.
    pub max: Region,
    /// Running sum of exp(score − max).
    pub sum: Region,
    /// Running Σ exp(score − max)·v.
    pub acc: Region,
}

impl AttnState {
    /// Its three regions.
    pub fn regions(&self) -> [Region; 3] {
        [self.max, self.sum, self.acc]
    }
}

/// The routing tables an [`Op::Route`] writes and the grouped GEMM and the combine
/// read (all `u32`, see [`crate::moe::route`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RouteTables {
    /// Segment offsets, 1 × (experts·chunks + 1): the rows of (expert e, chunk c) are
    /// `[seg[e·chunks + c], seg[e·chunks + c + 1])`.
    pub seg: Region,
    /// Per row, its `token·slots + slot` (capacity × 1; [`crate::router::ROUTE_NONE`] past
    /// the routed rows).
    pub perm: Region,
    /// Per (token, slot), its row (tokens × slots; [`crate::router::ROUTE_NONE`] when dropped).
    pub inv: Region,
    /// How the token chunks lie: the tokens cut into `shards` shards (the devices'
    /// token shards), each into chunks/shards sub-chunks, both in `tensor_split`'s
    /// order ([`crate::moe::chunk_tokens`]). 1 (the default): the tokens cut into the
    /// chunks directly.
    #[serde(default = "one_shard", skip_serializing_if = "is_one_shard")]
    pub shards: usize,
}

fn one_shard() -> usize {
    1
}

fn is_one_shard(shards: &usize) -> bool {
    *shards == 1
}

impl RouteTables {
    /// Its three regions.
    pub fn regions(&self) -> [Region; 3] {
        [self.seg, self.perm, self.inv]
    }

    /// The tokens of chunk `chunk` of these tables for `experts` experts.
    pub fn chunk_tokens(&self, experts: usize, chunk: usize) -> std::ops::Range<usize> {
        crate::moe::chunk_tokens(self.inv.rows, self.shards, self.chunks(experts), chunk)
    }

    /// Token chunks of a segment table for `experts` experts (0 if it does not fit).
    pub fn chunks(&self, experts: usize) -> usize {
        if experts == 0 || self.seg.cols == 0 || (self.seg.cols - 1) % experts != 0 {
            0
        } else {
            (self.seg.cols - 1) / experts
        }
    }
}

/// Causal masking of an [`Op::Attend`]: the global sequence positions of its first query
/// row and first key row. Key j is visible to query i iff `k_pos + j <= q_pos + i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Causal {
    /// Position of query row 0.
    pub q_pos: usize,
    /// Position of key row 0.
    pub k_pos: usize,
}

impl Causal {
    /// Whether key `j` is visible to query `i`.
    pub fn visible(&self, i: usize, j: usize) -> bool {
        self.k_pos + j <= self.q_pos + i
    }
}

/// One step of a lane.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// `c (+)= op(a) · op(b)` with f32 accumulation in increasing k, rounded once to c's
    /// dtype. `op(x)` is `x` or, with `trans_*`, its transpose. With `accumulate`, c
    /// (which must be f32) is read and added to the accumulator first.
    Gemm {
        /// Left operand (m×k, or k×m when `trans_a`).
        a: Region,
        /// Right operand (k×n, or n×k when `trans_b`).
        b: Region,
        /// Result (m×n).
        c: Region,
        /// Use the transpose of `a`.
        trans_a: bool,
        /// Use the transpose of `b`.
        trans_b: bool,
        /// Add to c instead of overwriting it.
        accumulate: bool,
        /// The tile-granular GEMM this one is a block of: the GEMMs of a lane that
        /// share an id are the row blocks of one persistent kernel ([`FusedRun`]), and
        /// the Waits and Signals between them gate and release single blocks. `None`: a
        /// GEMM of its own.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fused: Option<u32>,
        /// The device whose `c` it is: a peer's, for a GEMM whose epilogue adds straight
        /// into the peer's running sum (reads and writes of c cross to that device, as a
        /// copy's do). `None`: this device's own. Only a GEMM of its own (`fused: None`)
        /// reaches a peer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        c_device: Option<usize>,
    },
    /// Copies a local region into `dst` on device `dst_device` (itself or a peer).
    Copy {
        /// Local source.
        src: Region,
        /// Destination device.
        dst_device: usize,
        /// Destination region (same shape and dtype as `src`).
        dst: Region,
        /// Copy engine or SMs.
        engine: Engine,
    },
    /// `output = inputs[0] + inputs[1] + …` elementwise, left to right in f32, rounded
    /// once to the output's dtype. With one input it is a conversion.
    Reduce {
        /// Local regions of equal shape.
        inputs: Vec<Region>,
        /// Local output region of the same shape.
        output: Region,
    },
    /// `output = function(inputs…)` elementwise: each input decoded to f32, the function
    /// evaluated in f32 as [`Pointwise::apply`], rounded once to the output's dtype.
    Pointwise {
        /// The function.
        function: Pointwise,
        /// Local regions of the output's shape, `function.arity()` of them.
        inputs: Vec<Region>,
        /// Local output region.
        output: Region,
    },
    /// Attention of query rows against one block of keys, as an online-softmax update
    /// of `state` (seed 001's AG-KV attention). Per query row i and head h (kv head
    /// g = h / (heads / kv_heads), dh = q.cols / heads), the block's keys are walked
    /// in tiles of [`ATTN_KEY_TILE`]; per tile, with s_j = (Σ_c q[i,h·dh+c]·k[j,g·dh+c])
    /// · [`attention_scale`] summed in increasing c over the visible keys: if none is
    /// visible the tile is skipped; else m' = max(m, max_j s_j), α = exp(m − m'),
    /// l = l·α, acc_c = acc_c·α, then for each visible j in order p = exp(s_j − m'),
    /// l += p, acc_c += p·v[j,g·dh+c]; m = m'. A state with l = 0 is empty: its α is
    /// 0, without evaluating exp (no executor computes with infinities). With `fresh`
    /// the state starts empty (m = [`ATTN_EMPTY_MAX`], l = 0, acc = 0) instead of
    /// being read.
    Attend {
        /// Queries (rows × heads·dh).
        q: Region,
        /// Keys (keys × kv_heads·dh).
        k: Region,
        /// Values (keys × kv_heads·dh).
        v: Region,
        /// The state updated in place.
        state: AttnState,
        /// Query heads.
        heads: usize,
        /// Key/value heads (divides `heads`; fewer is grouped-query attention).
        kv_heads: usize,
        /// The causal mask, if any.
        causal: Option<Causal>,
        /// Start from the empty state instead of reading `state`.
        fresh: bool,
    },
    /// Merges the attention state `from` into `into` (same shapes), per row and head:
    /// nothing if `from` is empty (l₂ = 0); `into` becomes `from` if it is empty; else
    /// m' = max(m₁, m₂), a₁ = exp(m₁ − m'), a₂ = exp(m₂ − m'), l = l₁·a₁ + l₂·a₂,
    /// acc_c = acc₁_c·a₁ + acc₂_c·a₂, m = m'.
    AttnMerge {
        /// The other partial state (read).
        from: AttnState,
        /// The state merged into (read and written).
        into: AttnState,
        /// Heads.
        heads: usize,
    },
    /// Normalises an attention state: `out[i, h·dh+c] = acc_c / l` rounded once to
    /// out's dtype and `lse[i, h] = m + ln(l)` (f32); an empty row (l = 0, no visible
    /// key) gives 0 and [`ATTN_EMPTY_MAX`].
    AttnFinish {
        /// The state (read).
        state: AttnState,
        /// The output (rows × heads·dh).
        out: Region,
        /// The log-sum-exp (rows × heads, f32).
        lse: Region,
        /// Heads.
        heads: usize,
    },
    /// Builds the routing tables from the router's expert ids (tokens × slots, `u32`):
    /// per (expert, chunk of tokens/chunks consecutive tokens) the number of routed
    /// (token, slot) pairs, their offsets in expert-major then chunk order, the rows in
    /// token then slot order within each segment (`perm`) and each pair's row (`inv`),
    /// exactly as [`crate::moe::route`]. An id not below `experts` selects no row.
    Route {
        /// The router's ids (tokens × slots).
        ids: Region,
        /// The tables written.
        tables: RouteTables,
        /// Experts E.
        experts: usize,
    },
    /// A GEMM per expert over the rows the tables give it: for each expert e in
    /// `groups` and each row r of segment (e, `chunk`), `c[r] = a[r'] · b_e` with f32
    /// accumulation in increasing k, rounded once to c's dtype. `b` stacks the experts'
    /// K×N matrices (expert e at rows [e·K, (e+1)·K)); r' is r itself, or with
    /// `gather = Some(base)` the token of `perm[r]` minus `base` (rows of a's token
    /// shard; a row outside a gives 0). With `zero_unrouted`, rows of c past the last
    /// routed row are set to 0. Rows of other segments are untouched. Every executor
    /// finds a row's expert by binary search over the segment starts (which Route
    /// writes in increasing order) and bounds every table entry by c's rows.
    GroupedGemm {
        /// Left operand: a token shard (gather) or the rows themselves.
        a: Region,
        /// The experts' matrices, stacked (experts·K × N).
        b: Region,
        /// Result rows (capacity × N).
        c: Region,
        /// The routing tables (seg and perm are read).
        tables: RouteTables,
        /// Experts E (b's row blocks).
        experts: usize,
        /// Which experts this op computes (all of them, unless an algorithm splits).
        groups: std::ops::Range<usize>,
        /// Which token chunk's segments.
        chunk: usize,
        /// Gather a's rows by token, from this first token; `None`: a's row is c's.
        gather: Option<usize>,
        /// Zero the rows past the routed ones.
        zero_unrouted: bool,
    },
    /// The top-k weighted combine: `out[t] = Σ_slot weights[t, slot] · rows[inv[t, slot]]`
    /// over the slots in order whose row exists, in f32, rounded once to out's dtype
    /// (0 for a token with no routed slot).
    Combine {
        /// Expert outputs per row (capacity × N).
        rows: Region,
        /// Slot weights of the tokens (tokens × slots, f32).
        weights: Region,
        /// The tokens' rows (tokens × slots, `u32`, the tables' `inv`).
        inv: Region,
        /// One row per token (tokens × N).
        out: Region,
    },
    /// Adds `add` to semaphore `sem` of device `device` (release: everything earlier in
    /// this lane is visible to whoever acquires the new value).
    Signal {
        /// The device whose semaphore is incremented.
        device: usize,
        /// The semaphore.
        sem: SemId,
        /// The increment.
        add: u32,
    },
    /// Blocks the lane until the local semaphore `sem` is at least `value` (acquire).
    Wait {
        /// The local semaphore.
        sem: SemId,
        /// The value to reach.
        value: u32,
    },
}

impl Op {
    /// `c = a · b`: a plain GEMM (no transposes, no accumulation, a GEMM of its own).
    pub fn gemm(a: Region, b: Region, c: Region) -> Op {
        Op::Gemm { a, b, c, trans_a: false, trans_b: false, accumulate: false, fused: None, c_device: None }
    }
}

/// The program of one device: its lanes, in the order of [`Plan::lanes`].
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DeviceProgram {
    /// Ops of each lane.
    pub lanes: Vec<Vec<Op>>,
}

/// A schedule of a collective matmul on `devices` devices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Human-readable name, e.g. `ag_gemm/ring D=4`.
    pub name: String,
    /// Number of devices.
    pub devices: usize,
    /// Symmetric buffers.
    pub buffers: Vec<BufferDecl>,
    /// Semaphore names; every device has one counter per name, starting at 0.
    pub semaphores: Vec<String>,
    /// Lane names; every device has the same lanes.
    pub lanes: Vec<String>,
    /// One program per device.
    pub programs: Vec<DeviceProgram>,
}

/// One tile-granular GEMM ([`Op::Gemm`] blocks sharing a `fused` id in one lane): a
/// persistent kernel over every block's output tiles. Its meaning is the lane's ops as
/// written: block i runs after the Waits before it, and a Signal after block i releases
/// the blocks up to i. A kernel keeps that meaning while it computes several ready
/// blocks at once: before a tile of block i it checks every Wait up to block i, and it
/// performs a Signal only once every earlier block is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedRun {
    /// Device.
    pub device: usize,
    /// Lane index.
    pub lane: usize,
    /// The `fused` id.
    pub id: u32,
    /// Lane indices of the blocks, in order (at least one).
    pub blocks: Vec<usize>,
}

impl FusedRun {
    /// Lane index of the last block.
    pub fn end(&self) -> usize {
        self.blocks[self.blocks.len() - 1]
    }

    /// Lane indices from the first block to the last.
    pub fn span(&self) -> std::ops::RangeInclusive<usize> {
        self.blocks[0]..=self.end()
    }

    /// Whether an op of the plan lies in the run's span.
    pub fn holds(&self, site: OpSite) -> bool {
        (site.device, site.lane) == (self.device, self.lane) && self.span().contains(&site.index)
    }

    /// Whether an op lies between the run's first and last block (a Wait or Signal the
    /// kernel performs).
    pub fn inside(&self, site: OpSite) -> bool {
        self.holds(site) && self.blocks[0] < site.index && site.index < self.end()
    }
}

/// Where an op sits in a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpSite {
    /// Device.
    pub device: usize,
    /// Lane index.
    pub lane: usize,
    /// Index in the lane.
    pub index: usize,
}

impl fmt::Display for OpSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {} lane {} op {}", self.device, self.lane, self.index)
    }
}

/// A structural defect of a plan, found before anything runs.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The plan has no devices or a program count different from the device count.
    #[error("plan `{plan}` declares {devices} devices but has {programs} programs")]
    DeviceCount {
        /// Plan name.
        plan: String,
        /// Declared devices.
        devices: usize,
        /// Programs present.
        programs: usize,
    },
    /// A device program has a lane count different from the plan's lanes.
    #[error("plan `{plan}`: device {device} has {got} lanes, the plan declares {expected}")]
    LaneCount {
        /// Plan name.
        plan: String,
        /// Device.
        device: usize,
        /// Lanes present.
        got: usize,
        /// Lanes declared.
        expected: usize,
    },
    /// Two buffers, two semaphores or two lanes share a name (a plan file names them;
    /// a name must say which one is meant).
    #[error("plan `{plan}` declares two {kind}s named `{name}`")]
    DuplicateName {
        /// Plan name.
        plan: String,
        /// `buffer`, `semaphore` or `lane`.
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// An op names a buffer, semaphore or device that does not exist.
    #[error("plan `{plan}` at {site}: {what}")]
    BadReference {
        /// Plan name.
        plan: String,
        /// The op.
        site: OpSite,
        /// What is missing.
        what: String,
    },
    /// The plan has more ops than [`MAX_PLAN_OPS`].
    #[error("plan `{plan}` has {}{ops} ops, more than the {limit} a plan may have; simulate fewer devices, slices or chunks (`tune` prices 2D meshes of any size with seed 002's analytic model)", if *at_least { "at least " } else { "" })]
    TooManyOps {
        /// Plan name.
        plan: String,
        /// Its ops (as many as were pushed), or a lower bound of them (saturated at
        /// u64::MAX).
        ops: u64,
        /// Whether `ops` is a lower bound, counted before planning ([`check_op_bound`]).
        at_least: bool,
        /// [`MAX_PLAN_OPS`].
        limit: usize,
    },
    /// A buffer has more elements than [`MAX_BUFFER_ELEMENTS`] (or rows × columns overflows).
    #[error("plan `{plan}`: buffer `{buffer}` is {rows}×{cols}, more than the {limit} elements a buffer may have")]
    BufferTooLarge {
        /// Plan name.
        plan: String,
        /// Buffer name.
        buffer: String,
        /// Its rows.
        rows: usize,
        /// Its columns.
        cols: usize,
        /// [`MAX_BUFFER_ELEMENTS`].
        limit: usize,
    },
    /// A region reaches past the end of its buffer or has a stride smaller than its width.
    #[error("plan `{plan}` at {site}: region {region:?} does not fit buffer `{buffer}` of {len} elements")]
    RegionOutOfBounds {
        /// Plan name.
        plan: String,
        /// The op.
        site: OpSite,
        /// The region.
        region: Region,
        /// Buffer name.
        buffer: String,
        /// Buffer length.
        len: usize,
    },
    /// An input buffer reaches generator indices beyond 2^32 (a plan built for the
    /// simulator only); executors refuse it rather than wrap the indices.
    #[error("plan `{plan}`: input buffer `{buffer}` reaches generator index {index}, beyond the 2^32 the input generator indexes (simulate such plans; do not execute them)")]
    GeneratorRange {
        /// Plan name.
        plan: String,
        /// Buffer name.
        buffer: String,
        /// The largest index it needs.
        index: u64,
    },
    /// The operands of an op have inconsistent shapes or dtypes.
    #[error("plan `{plan}` at {site}: {detail}")]
    Mismatch {
        /// Plan name.
        plan: String,
        /// The op.
        site: OpSite,
        /// What disagrees, with the shapes.
        detail: String,
    },
}

impl Plan {
    /// Finds a buffer by name.
    pub fn buffer_id(&self, name: &str) -> Option<BufId> {
        self.buffers.iter().position(|b| b.name == name).map(BufId)
    }

    /// The buffer a region refers to. Panics on an unvalidated plan's bad id.
    pub fn buffer(&self, id: BufId) -> &BufferDecl {
        &self.buffers[id.0]
    }

    /// The output buffer (the one with [`BufferRole::Output`]), if any.
    pub fn output(&self) -> Option<BufId> {
        self.buffers.iter().position(|b| b.role == BufferRole::Output).map(BufId)
    }

    /// Every op with its site, device by device, lane by lane.
    pub fn ops(&self) -> impl Iterator<Item = (OpSite, &Op)> + '_ {
        self.programs.iter().enumerate().flat_map(|(device, p)| {
            p.lanes.iter().enumerate().flat_map(move |(lane, ops)| {
                ops.iter().enumerate().map(move |(index, op)| (OpSite { device, lane, index }, op))
            })
        })
    }

    /// Total number of ops.
    pub fn op_count(&self) -> usize {
        self.programs.iter().flat_map(|p| &p.lanes).map(Vec::len).sum()
    }

    /// Elements of every buffer over every device (saturating: a plan file may declare
    /// any size).
    pub fn elements(&self) -> u64 {
        let per_device = self.buffers.iter().fold(0u64, |sum, b| sum.saturating_add(b.len() as u64));
        per_device.saturating_mul(self.devices as u64)
    }

    /// Checks that every input buffer's generator indices fit in 32 bits, as every
    /// executor's generator needs (the simulator does not generate and skips this).
    pub fn check_generator_range(&self) -> Result<(), PlanError> {
        for b in &self.buffers {
            if let Some((_, global_cols, origins)) = b.role.generated() {
                for &(r0, c0) in origins {
                    if b.is_empty() {
                        continue;
                    }
                    // In u128: a plan file's origins can be anything up to usize::MAX.
                    let last =
                        (r0 as u128 + b.rows as u128 - 1) * global_cols as u128 + (c0 as u128 + b.cols as u128 - 1);
                    if last > u32::MAX as u128 {
                        return Err(PlanError::GeneratorRange {
                            plan: self.name.clone(),
                            buffer: b.name.clone(),
                            index: u64::try_from(last).unwrap_or(u64::MAX),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Formats one op for humans, with buffer and semaphore names.
    pub fn op_text(&self, op: &Op) -> String {
        let reg = |r: &Region| {
            let name = self.buffers.get(r.buf.0).map_or("?", |b| b.name.as_str());
            let cols = self.buffers.get(r.buf.0).map_or(1, |b| b.cols.max(1));
            let (r0, c0) = (r.offset / cols, r.offset % cols);
            // Every `step`-th row of the buffer (MeshSlice's slices), or rows at a
            // stride that is not a whole number of the buffer's rows.
            let step = if c0 + r.cols > cols {
                None // a row that wraps into the next
            } else if r.rows <= 1 {
                Some(1)
            } else {
                (r.stride > 0 && r.stride % cols == 0).then(|| r.stride / cols)
            };
            match step {
                Some(1) if c0 == 0 && r.cols == cols => format!("{name}[{}..{}]", r0, r0 + r.rows),
                Some(1) => format!("{name}[{}..{}, {}..{}]", r0, r0 + r.rows, c0, c0 + r.cols),
                Some(k) => format!("{name}[{}..{} step {k}, {}..{}]", r0, r0 + (r.rows - 1) * k + 1, c0, c0 + r.cols),
                None => format!("{name}[{} + {}·r + 0..{}, r < {}]", r.offset, r.stride, r.cols, r.rows),
            }
        };
        let sem = |s: &SemId| self.semaphores.get(s.0).map_or("?", String::as_str);
        match op {
            Op::Gemm { a, b, c, trans_a, trans_b, accumulate, fused, c_device } => format!(
                "gemm{} {}{} {} {}{} · {}{}",
                fused.map_or(String::new(), |k| format!("[fused {k}]")),
                c_device.map_or(String::new(), |d| format!("dev{d}:")),
                reg(c),
                if *accumulate { "+=" } else { "=" },
                reg(a),
                if *trans_a { "ᵀ" } else { "" },
                reg(b),
                if *trans_b { "ᵀ" } else { "" },
            ),
            Op::Copy { src, dst_device, dst, engine } => format!(
                "copy {} -> dev{}:{} ({})",
                reg(src),
                dst_device,
                reg(dst),
                match engine {
                    Engine::CopyEngine => "ce",
                    Engine::Sm => "sm",
                }
            ),
            Op::Reduce { inputs, output } => {
                format!("reduce {} = {}", reg(output), inputs.iter().map(reg).collect::<Vec<_>>().join(" + "))
            }
            Op::Pointwise { function, inputs, output } => format!(
                "{} {} = {}({})",
                function.name(),
                reg(output),
                function.name(),
                inputs.iter().map(reg).collect::<Vec<_>>().join(", ")
            ),
            Op::Attend { q, k, v, state, heads, kv_heads, causal, fresh } => format!(
                "attend {} {} softmax({}·{}ᵀ{}) {} ({heads}/{kv_heads} heads)",
                reg(&state.acc),
                if *fresh { "=" } else { "+=" },
                reg(q),
                reg(k),
                causal.map_or(String::new(), |c| format!(" causal q@{} k@{}", c.q_pos, c.k_pos)),
                reg(v),
            ),
            Op::AttnMerge { from, into, .. } => format!("attn_merge {} <- {}", reg(&into.acc), reg(&from.acc)),
            Op::AttnFinish { state, out, lse, .. } => {
                format!("attn_finish {}, {} = normalise {}", reg(out), reg(lse), reg(&state.acc))
            }
            Op::Route { ids, tables, experts } => format!(
                "route {}, {}, {} = route({}, {experts} experts)",
                reg(&tables.seg),
                reg(&tables.perm),
                reg(&tables.inv),
                reg(ids)
            ),
            Op::GroupedGemm { a, b, c, experts, groups, chunk, gather, zero_unrouted, .. } => format!(
                "grouped_gemm {} = {}{} · {} (chunk {chunk}, experts {}..{} of {experts}{})",
                reg(c),
                reg(a),
                gather.map_or(String::new(), |t| format!(" gathered from token {t}")),
                reg(b),
                groups.start,
                groups.end,
                if *zero_unrouted { ", zero unrouted" } else { "" }
            ),
            Op::Combine { rows, weights, inv, out } => {
                format!("combine {} = Σ {}·{}[{}]", reg(out), reg(weights), reg(rows), reg(inv))
            }
            Op::Signal { device, sem: s, add } => format!("signal dev{device}:{} += {add}", sem(s)),
            Op::Wait { sem: s, value } => format!("wait {} >= {value}", sem(s)),
        }
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "plan {} (D={})", self.name, self.devices)?;
        for b in &self.buffers {
            let role = match &b.role {
                BufferRole::Input { tensor, .. } => format!("input of tensor {tensor}"),
                BufferRole::Output => "output".to_string(),
                BufferRole::Scratch => "scratch".to_string(),
                BufferRole::Accumulator { tensor, .. } => format!("accumulator, initially tensor {tensor}"),
                BufferRole::Router { part, router } => format!("router {part:?} ({} routing)", router.routing),
            };
            writeln!(f, "  buffer {}: {}[{}x{}] {}", b.name, b.dtype, b.rows, b.cols, role)?;
        }
        writeln!(f, "  semaphores: {}", self.semaphores.join(", "))?;
        for (d, p) in self.programs.iter().enumerate() {
            writeln!(f, "  device {d}:")?;
            for (l, ops) in p.lanes.iter().enumerate() {
                writeln!(f, "    lane {}:", self.lanes[l])?;
                for (i, op) in ops.iter().enumerate() {
                    writeln!(f, "      {i:3}  {}", self.op_text(op))?;
                }
            }
        }
        Ok(())
    }
}

/// Builds plans: declare buffers, semaphores and lanes, then push ops per device and lane.
#[derive(Debug)]
pub struct PlanBuilder {
    plan: Plan,
    /// Ops pushed, kept or not (past `op_limit` they are counted and dropped).
    pushed: usize,
    /// [`MAX_PLAN_OPS`], or less in tests.
    op_limit: usize,
}

/// A lane handle from [`PlanBuilder::lane`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneId(pub usize);

impl PlanBuilder {
    /// Starts a plan on `devices` devices.
    pub fn new(name: impl Into<String>, devices: usize) -> Self {
        PlanBuilder {
            plan: Plan {
                name: name.into(),
                devices,
                buffers: Vec::new(),
                semaphores: Vec::new(),
                lanes: Vec::new(),
                programs: vec![DeviceProgram::default(); devices],
            },
            pushed: 0,
            op_limit: MAX_PLAN_OPS,
        }
    }

    /// Declares a symmetric buffer.
    pub fn buffer(&mut self, name: &str, dtype: DType, rows: usize, cols: usize, role: BufferRole) -> BufId {
        self.plan.buffers.push(BufferDecl { name: name.into(), dtype, rows, cols, role, device_rows: None });
        BufId(self.plan.buffers.len() - 1)
    }

    /// Declares a buffer of which device d holds `rows[d]` rows: as many rows as the
    /// largest, and each device's own count when they differ (uneven shards,
    /// [`BufferDecl::device_rows`]). The same count everywhere is a plain buffer, so even
    /// shards make the plans they always made.
    pub fn sharded_buffer(
        &mut self,
        name: &str,
        dtype: DType,
        rows: Vec<usize>,
        cols: usize,
        role: BufferRole,
    ) -> BufId {
        let (max, device_rows) = per_device_rows(rows);
        let id = self.buffer(name, dtype, max, cols, role);
        self.plan.buffers[id.0].device_rows = device_rows;
        id
    }

    /// Declares a semaphore (one counter per device).
    pub fn semaphore(&mut self, name: &str) -> SemId {
        self.plan.semaphores.push(name.into());
        SemId(self.plan.semaphores.len() - 1)
    }

    /// Declares a lane (every device gets one).
    pub fn lane(&mut self, name: &str) -> LaneId {
        self.plan.lanes.push(name.into());
        for p in &mut self.plan.programs {
            p.lanes.push(Vec::new());
        }
        LaneId(self.plan.lanes.len() - 1)
    }

    /// Appends an op to a lane of a device. Past [`MAX_PLAN_OPS`] ops the op is only
    /// counted, so that a plan too large to hold fails in [`PlanBuilder::finish`] instead
    /// of exhausting memory.
    pub fn push(&mut self, device: usize, lane: LaneId, op: Op) {
        if self.pushed < self.op_limit {
            self.plan.programs[device].lanes[lane.0].push(op);
        }
        self.pushed = self.pushed.saturating_add(1);
    }

    /// Number of devices of the plan being built.
    pub fn devices(&self) -> usize {
        self.plan.devices
    }

    /// The buffer declaration behind an id.
    pub fn decl(&self, id: BufId) -> &BufferDecl {
        &self.plan.buffers[id.0]
    }

    /// A row block `[row0, row0 + rows)` of a whole buffer.
    pub fn rows(&self, buf: BufId, row0: usize, rows: usize) -> Region {
        let cols = self.decl(buf).cols;
        Region { buf, offset: row0 * cols, rows, cols, stride: cols }
    }

    /// A sub-matrix of a buffer.
    pub fn window(&self, buf: BufId, row0: usize, col0: usize, rows: usize, cols: usize) -> Region {
        let stride = self.decl(buf).cols;
        Region { buf, offset: row0 * stride + col0, rows, cols, stride }
    }

    /// The whole buffer.
    pub fn whole(&self, buf: BufId) -> Region {
        let rows = self.decl(buf).rows;
        self.rows(buf, 0, rows)
    }

    /// Finishes and validates the plan.
    pub fn finish(self) -> Result<Plan, PlanError> {
        if self.pushed > self.op_limit {
            return Err(PlanError::TooManyOps {
                plan: self.plan.name,
                ops: self.pushed as u64,
                at_least: false,
                limit: self.op_limit,
            });
        }
        self.plan.validate()?;
        Ok(self.plan)
    }
}

/// A one-device plan of `reps` back-to-back GEMMs `C = A·B` (m×k times k×n) with
/// `input` operands and an f32 output: what the benchmarks time on every executor.
pub fn gemm_benchmark(m: usize, n: usize, k: usize, input: DType, reps: usize) -> Result<Plan, PlanError> {
    let mut b = PlanBuilder::new(format!("bench gemm {m}x{n}x{k} {input}"), 1);
    let a = b.buffer("A", input, m, k, BufferRole::whole_tensor(0, k));
    let bb = b.buffer("B", input, k, n, BufferRole::whole_tensor(1, n));
    let c = b.buffer("C", DType::F32, m, n, BufferRole::Output);
    let lane = b.lane("compute");
    for _ in 0..reps.max(1) {
        let op = Op::gemm(b.whole(a), b.whole(bb), b.whole(c));
        b.push(0, lane, op);
    }
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{build_plan, Algorithm};
    use crate::{OpKind, Problem};

    /// A plan file that names two buffers (or semaphores, or lanes) alike is refused:
    /// the names are how a reader of the file tells them apart.
    #[test]
    fn two_buffers_semaphores_or_lanes_with_one_name_are_refused() {
        let p = Problem::new(OpKind::AgGemm, 2, 4, 4, 4, DType::F32, DType::F32).unwrap();
        let plan = build_plan(&p, Algorithm::Ring).unwrap();
        let mut buffers = plan.clone();
        buffers.buffers.push(buffers.buffers[0].clone());
        let mut semaphores = plan.clone();
        semaphores.semaphores.push(semaphores.semaphores[0].clone());
        for (twice, kind, name) in
            [(buffers, "buffer", plan.buffers[0].name.clone()), (semaphores, "semaphore", plan.semaphores[0].clone())]
        {
            let want = PlanError::DuplicateName { plan: plan.name.clone(), kind, name: name.clone() };
            assert_eq!(twice.validate(), Err(want));
            let e = Plan::from_file_json(&twice.to_file_json()).unwrap_err().to_string();
            assert!(e.contains(&format!("declares two {kind}s named `{name}`")), "{e}");
        }
    }

    #[test]
    fn every_family_refuses_more_devices_than_a_problem_may_have() {
        use crate::attention::{AttentionProblem, Layout};
        use crate::linear::{Layer, LinearProblem, Pass};
        use crate::mesh::{Dataflow, MeshProblem};
        use crate::moe::{MoeOp, MoeProblem, Routing};
        let (d, f) = (MAX_DEVICES + 1, DType::F32);
        let errors = [
            Problem::new(OpKind::AgGemm, d, d, d, 1, f, f).unwrap_err().to_string(),
            MeshProblem::new(1 << 32, 1 << 32, Dataflow::Os, 1 << 32, 1 << 32, 1 << 32, f, f).unwrap_err().to_string(),
            AttentionProblem::new(d, d, 1, 1, 1, false, Layout::Contiguous, None, f).unwrap_err().to_string(),
            MoeProblem::new(MoeOp::AgMoe, d, d, 1, d, 1, 1, Routing::Uniform, f, f).unwrap_err().to_string(),
            LinearProblem::new(Layer::Column, Pass::Forward, true, d, 1, d, 1, d, f).unwrap_err().to_string(),
        ];
        for e in &errors {
            assert!(e.ends_with("devices: more than the 65536 a problem may have"), "{e}");
        }
        assert!(errors[1].starts_with("mesh 4294967296x4294967296: 18446744073709551616 devices"), "{}", errors[1]);
        assert!(MeshProblem::new(256, 256, Dataflow::Os, 256, 256, 256, f, f).is_ok(), "exactly the limit");
        // Micro-batches multiply a linear layer's tensors and GEMMs the same way.
        let e = LinearProblem::new(Layer::Row, Pass::Forward, false, 4, 1 << 31, 32, 32, 32, f).unwrap_err();
        assert!(e.to_string().contains("2147483648 micro-batches, more than the 65536"), "{e}");
    }

    #[test]
    fn op_texts_name_the_rows_a_region_really_covers() {
        let mut b = PlanBuilder::new("texts", 1);
        let x = b.buffer("X", DType::F32, 8, 4, BufferRole::Scratch);
        let plan = b.finish().unwrap();
        let copy = |offset, rows, cols, stride| {
            let region = Region { buf: x, offset, rows, cols, stride };
            plan.op_text(&Op::Copy { src: region, dst_device: 0, dst: region, engine: Engine::CopyEngine })
        };
        assert_eq!(copy(4, 3, 4, 4), "copy X[1..4] -> dev0:X[1..4] (ce)");
        assert_eq!(copy(5, 3, 2, 4), "copy X[1..4, 1..3] -> dev0:X[1..4, 1..3] (ce)");
        // Rows 1, 3 and 5 (every other row), as MeshSlice's slices take them.
        assert_eq!(copy(5, 3, 2, 8), "copy X[1..6 step 2, 1..3] -> dev0:X[1..6 step 2, 1..3] (ce)");
        assert_eq!(copy(5, 2, 2, 6), "copy X[5 + 6·r + 0..2, r < 2] -> dev0:X[5 + 6·r + 0..2, r < 2] (ce)");
        // Columns 2..6 of a 4-column row wrap into the next.
        assert_eq!(copy(2, 1, 4, 4), "copy X[2 + 4·r + 0..4, r < 1] -> dev0:X[2 + 4·r + 0..4, r < 1] (ce)");
    }

    /// A GEMM's c on a peer: named in its text, refused on a device that does not exist,
    /// kept through a plan file.
    #[test]
    fn a_gemm_on_a_peers_c_is_checked_and_round_trips() {
        let p = Problem::new(OpKind::GemmRs, 2, 16, 8, 16, DType::F16, DType::F16).unwrap();
        let plan = build_plan(&p, Algorithm::RingPush).unwrap();
        let site =
            plan.ops().find_map(|(site, op)| matches!(op, Op::Gemm { c_device: Some(1), .. }).then_some(site)).unwrap();
        let text = plan.op_text(&plan.programs[site.device].lanes[site.lane][site.index]);
        assert_eq!(text, "gemm dev1:S[0..8] = A[8..16] · B[0..8]");
        let file = plan.to_file_json();
        assert!(file.contains("\"c_device\": 1"), "{file}");
        assert_eq!(Plan::from_file_json(&file).unwrap(), plan);
        let with = |change: &dyn Fn(&mut Op)| {
            let mut bad = plan.clone();
            change(&mut bad.programs[site.device].lanes[site.lane][site.index]);
            bad.validate().unwrap_err().to_string()
        };
        let e = with(&|op| {
            if let Op::Gemm { c_device, .. } = op {
                *c_device = Some(2);
            }
        });
        assert!(e.contains("device 2 does not exist (D=2)"), "{e}");
        // A block of a persistent kernel may add into a peer's c too (fused_push's blocks).
        let mut fused = plan.clone();
        if let Op::Gemm { fused, .. } = &mut fused.programs[site.device].lanes[site.lane][site.index] {
            *fused = Some(0);
        }
        fused.validate().unwrap();
    }

    /// Two blocks of one persistent kernel clash only where they touch the same elements
    /// of the same device: fused_push's blocks write the same rows of S on different
    /// owners, and one pointed at another's owner is refused.
    #[test]
    fn fused_blocks_clash_only_on_the_same_device() {
        let p = Problem::new(OpKind::GemmRs, 4, 32, 8, 16, DType::F16, DType::F16).unwrap();
        let plan = build_plan(&p, Algorithm::FusedPush { chunks: 1 }).unwrap();
        let runs = plan.fused_runs().unwrap();
        assert_eq!(runs.len(), 4, "one persistent kernel a device");
        let run = &runs[0];
        let owners: Vec<Option<usize>> = run
            .blocks
            .iter()
            .map(|&i| match &plan.programs[0].lanes[run.lane][i] {
                Op::Gemm { c_device, accumulate: true, .. } => *c_device,
                other => panic!("{other:?}"),
            })
            .collect();
        // Steps 1 and 2 add into devices 2 and 3, step 3 into device 0's own sum.
        assert_eq!(owners, [Some(2), Some(3), None]);
        let mut clash = plan.clone();
        if let Op::Gemm { c_device, .. } = &mut clash.programs[0].lanes[run.lane][run.blocks[1]] {
            *c_device = Some(2);
        }
        let e = clash.validate().unwrap_err().to_string();
        assert!(e.contains("blocks 0 and 1 of fused gemm 0 touch the same elements"), "{e}");
    }

    #[test]
    fn hopeless_sizes_are_refused_before_planning() {
        // A ring of 4096 devices: at least 4096 · 4095 exchanges, refused without a push.
        let p = Problem::new(OpKind::AgGemm, 4096, 4096, 4096, 1, DType::F32, DType::F32).unwrap();
        let e = build_plan(&p, Algorithm::Ring).unwrap_err().to_string();
        assert!(e.contains("has at least 16773120 ops, more than the 4194304"), "{e}");
    }

    #[test]
    fn a_plan_past_the_op_limit_is_counted_not_kept_and_refused() {
        let build = |ops: usize| {
            let mut b = PlanBuilder::new("many", 2);
            b.op_limit = 10;
            let s = b.semaphore("s");
            let lane = b.lane("main");
            for _ in 0..ops {
                b.push(1, lane, Op::Signal { device: 0, sem: s, add: 1 });
            }
            b.push(0, lane, Op::Wait { sem: s, value: ops as u32 });
            (b.plan.op_count(), b.finish())
        };
        let (kept, plan) = build(9);
        assert_eq!((kept, plan.unwrap().op_count()), (10, 10));
        let (kept, e) = build(1000);
        assert_eq!(kept, 10, "ops past the limit are dropped as they come");
        assert_eq!(
            e.unwrap_err(),
            PlanError::TooManyOps { plan: "many".into(), ops: 1001, at_least: false, limit: 10 }
        );
    }

    fn fused_ag_gemm() -> Plan {
        let p = Problem::new(OpKind::AgGemm, 2, 8, 6, 4, DType::F32, DType::F32).unwrap();
        build_plan(&p, Algorithm::Fused { chunks: 2 }).unwrap()
    }

    fn compute_lane(plan: &mut Plan) -> &mut Vec<Op> {
        &mut plan.programs[0].lanes[0]
    }

    #[test]
    fn a_fused_gemm_is_one_run_of_blocks_with_its_waits_inside() {
        let plan = fused_ag_gemm();
        let runs = plan.fused_runs().unwrap();
        assert_eq!(runs.len(), 2, "one run per device");
        let run = &runs[0];
        // The own shard, then two chunks of the peer's, each behind its wait.
        assert_eq!(run.blocks, vec![0, 2, 4]);
        let at = |index| OpSite { device: 0, lane: 0, index };
        assert!(run.inside(at(1)) && run.inside(at(3)) && !run.inside(at(0)) && !run.inside(at(4)));
        assert!(!run.inside(OpSite { device: 1, ..at(1) }), "another device's op");
    }

    #[test]
    fn malformed_fused_gemms_are_refused_with_the_reason() {
        let refused = |plan: &Plan, words: &str| match plan.validate() {
            Err(PlanError::Mismatch { detail, .. }) => assert!(detail.contains(words), "{detail}"),
            other => panic!("expected a mismatch about {words}, got {other:?}"),
        };
        // A block after another kind of op: the kernel would have to resume.
        let mut split = fused_ag_gemm();
        let lane = compute_lane(&mut split);
        let Op::Gemm { a, c, .. } = lane[0] else { panic!() };
        lane.insert(3, Op::Reduce { inputs: vec![c], output: c });
        let _ = a;
        refused(&split, "resumes");
        // Blocks of one kernel share b.
        let mut other_b = fused_ag_gemm();
        if let Op::Gemm { b, .. } = &mut compute_lane(&mut other_b)[2] {
            b.cols -= 1;
        }
        assert!(other_b.validate().is_err());
        // Two blocks writing the same rows would race inside the kernel.
        let mut clash = fused_ag_gemm();
        let lane = compute_lane(&mut clash);
        let Op::Gemm { c: first, .. } = lane[0] else { panic!() };
        if let Op::Gemm { c, .. } = &mut lane[2] {
            *c = Region { rows: c.rows, ..first };
        }
        refused(&clash, "touch the same elements");
    }
}
