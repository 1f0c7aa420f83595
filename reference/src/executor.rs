//! Runs a plan on D virtual devices of one adapter.
//!
//! Memory: one heap holds every device's copy of every symmetric buffer (one 32-bit word
//! per element), then the GPU mirror of every semaphore, then a temporary f32 area for
//! GEMMs whose K is split across dispatches. It is split over up to four storage
//! bindings of the adapter's largest binding each (`shaders/memory.wgsl`), so a plan may
//! need four times what one binding holds; beyond that it is refused before any work. The host scheduler
//! (`cmm_core::schedule`) fixes the order of all ops up front; each op becomes one or
//! more dispatches in that order on one queue, so the same plan always produces the
//! same bits.

use std::time::{Duration, Instant};

use cmm_core::generator::Family;
use cmm_core::plan::OpSite;
use cmm_core::plan::{attention_scale, AttnState, BufferRole, Causal, Op, Plan, Region, ATTN_KEY_TILE};
use cmm_core::schedule::{schedule_with, Order};
use cmm_core::DType;

use crate::context::{Gpu, Stages, HEAP_BINDINGS, HEAP_PARTS};
use crate::error::ReferenceError;
use crate::params::*;

/// Largest K slice of one GEMM dispatch: 16,384 · 11/8 loop trips per invocation stay
/// well below lavapipe's 65,535 (BRIEF §7).
pub const GEMM_K_PER_DISPATCH: usize = 16_384;
/// Columns of C one GEMM workgroup computes (`gemm.wgsl`).
const GEMM_TILE_COLS: usize = 256;
/// Rows of C one GEMM workgroup computes (`gemm.wgsl`).
const GEMM_TILE_ROWS: usize = 256;

/// Loop trips one attention invocation may take per dispatch, below lavapipe's 65,535
/// (BRIEF §7): a 16-key tile costs 33·dh + 48 trips, the state 2·dh.
pub const ATTEND_LOOP_BUDGET: usize = 60_000;

/// Loop trips one routing or grouped-GEMM invocation may take, below lavapipe's 65,535
/// (BRIEF §7): a chunk's slots or the segment count (route), groups + k (grouped GEMM).
pub const ROUTE_LOOP_BUDGET: usize = 60_000;

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct RunOutput {
    /// `[device][buffer]` words after the run (the layout of `cmm_core::cpu::Memory`).
    pub buffers: Vec<Vec<Vec<u32>>>,
    /// Wall time of the whole run (generation, ops, read-back).
    pub elapsed: Duration,
    /// Wall time of the ops alone (one submission, waited for).
    pub execute: Duration,
    /// Number of dispatches the ops took.
    pub dispatches: usize,
    /// With [`RunOptions::time_ops`]: every op in executed order with its wall time.
    pub op_times: Option<Vec<OpTiming>>,
}

/// The wall time of one op in a timed run ([`RunOptions::time_ops`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpTiming {
    /// The op.
    pub site: OpSite,
    /// From the start of the ops to its submission.
    pub start: Duration,
    /// From its submission to the queue finishing it (zero for ops with no dispatch: a Wait).
    pub duration: Duration,
}

fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
        // Tables are never decoded (plan validation keeps them out of arithmetic).
        _ => 3,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Gemm,
    Copy,
    Reduce,
    Pointwise,
    Attend,
    AttnState,
    Generate,
    Signal,
    Route,
    GroupedGemm,
    Combine,
}

struct Dispatch {
    stage: Stage,
    params: Vec<u8>,
    groups: (u32, u32),
}

/// Word offsets of every (device, buffer), the semaphore mirror and the GEMM temporary.
struct Layout {
    base: Vec<Vec<usize>>,
    sem_base: usize,
    tmp_base: usize,
    total: usize,
}

impl Layout {
    fn new(plan: &Plan) -> Layout {
        let mut next = 0;
        let base = (0..plan.devices)
            .map(|_| {
                plan.buffers
                    .iter()
                    .map(|b| {
                        let at = next;
                        next += b.len();
                        at
                    })
                    .collect()
            })
            .collect();
        let sem_base = next;
        next += plan.devices * plan.semaphores.len();
        let tmp_base = next;
        let tmp = plan
            .ops()
            .filter_map(|(_, op)| match op {
                Op::Gemm { c, trans_a, a, .. } => {
                    let k = if *trans_a { a.rows } else { a.cols };
                    let needs = k > GEMM_K_PER_DISPATCH && plan.buffer(c.buf).dtype != DType::F32;
                    needs.then_some(c.len())
                }
                _ => None,
            })
            .max()
            .unwrap_or(0);
        next += tmp;
        Layout { base, sem_base, tmp_base, total: next.max(1) }
    }

    fn word(&self, device: usize, r: &Region) -> u32 {
        (self.base[device][r.buf.0] + r.offset) as u32
    }
}

struct Encoder<'a> {
    plan: &'a Plan,
    layout: &'a Layout,
    max_groups: u32,
    dispatches: Vec<Dispatch>,
}

impl Encoder<'_> {
    fn unsupported(&self, what: String) -> ReferenceError {
        ReferenceError::Unsupported { plan: self.plan.name.clone(), what }
    }

    fn push<T: bytemuck::Pod>(&mut self, stage: Stage, params: &T, groups: (u32, u32)) {
        self.dispatches.push(Dispatch { stage, params: bytemuck::bytes_of(params).to_vec(), groups });
    }

    /// Splits `rows × cols` elementwise work into dispatches of at most `max_groups` rows.
    fn elementwise(
        &mut self,
        rows: usize,
        cols: usize,
        mut make: impl FnMut(u32) -> (Stage, Vec<u8>),
    ) -> Result<(), ReferenceError> {
        let gx = cols.div_ceil(64);
        if gx > self.max_groups as usize {
            return Err(self.unsupported(format!(
                "{cols} columns need {gx} workgroups, more than the adapter's {}",
                self.max_groups
            )));
        }
        let mut begin = 0;
        while begin < rows {
            let count = (rows - begin).min(self.max_groups as usize);
            let (stage, params) = make(begin as u32);
            self.dispatches.push(Dispatch { stage, params, groups: (gx as u32, count as u32) });
            begin += count;
        }
        Ok(())
    }

    /// Splits work of one invocation per (row, head) into dispatches of at most
    /// `max_groups` workgroups of 64.
    fn per_row_head(
        &mut self,
        rows: usize,
        heads: usize,
        mut make: impl FnMut(u32) -> (Stage, Vec<u8>),
    ) -> Result<(), ReferenceError> {
        let rows_per_dispatch = (self.max_groups as usize * 64 / heads.max(1)).max(1);
        let mut begin = 0;
        while begin < rows {
            let count = (rows - begin).min(rows_per_dispatch);
            let (stage, params) = make(begin as u32);
            self.dispatches.push(Dispatch { stage, params, groups: ((count * heads).div_ceil(64) as u32, 1) });
            begin += count;
        }
        Ok(())
    }

    /// A region as a shader operand: (word offset, row stride, dtype code, rows).
    fn tensor(&self, device: usize, r: &Region) -> [u32; 4] {
        [self.layout.word(device, r), r.stride as u32, dtype_code(self.plan.buffer(r.buf).dtype), r.rows as u32]
    }

    fn attn_state_params(
        &self,
        device: usize,
        function: u32,
        from: &AttnState,
        into: &AttnState,
        heads: usize,
        finish: Option<(&Region, &Region)>,
    ) -> AttnStateParams {
        let region = |r: &Region| [self.layout.word(device, r), r.stride as u32, 0, 0];
        let (out, lse) = finish.map_or(([0; 4], [0; 4]), |(o, l)| (region(o), region(l)));
        AttnStateParams {
            function,
            rows: into.max.rows as u32,
            heads: heads as u32,
            head_dim: (into.acc.cols / heads) as u32,
            row_begin: 0,
            out_dtype: finish.map_or(0, |(o, _)| dtype_code(self.plan.buffer(o.buf).dtype)),
            _pad: [0; 2],
            from_m: region(&from.max),
            from_l: region(&from.sum),
            from_acc: region(&from.acc),
            into_m: region(&into.max),
            into_l: region(&into.sum),
            into_acc: region(&into.acc),
            out,
            lse,
        }
    }

    fn generate(&mut self, device: usize, seed: u32, family: Family) -> Result<(), ReferenceError> {
        for (i, b) in self.plan.buffers.iter().enumerate() {
            if let Some((tensor, global_cols, origins)) = b.role.generated() {
                let (row0, col0) = origins[device];
                // An uneven shard: the device's rows only (its padding stays poison).
                let rows = b.rows_on(device);
                let p = GenerateParams {
                    rows: rows as u32,
                    cols: b.cols as u32,
                    row_begin: 0,
                    dst_off: self.layout.base[device][i] as u32,
                    dtype: dtype_code(b.dtype),
                    family: family.code(),
                    seed,
                    tensor,
                    global_cols: global_cols as u32,
                    row0: row0 as u32,
                    col0: col0 as u32,
                    _pad: 0,
                };
                self.elementwise(rows, b.cols, |row_begin| {
                    (Stage::Generate, bytemuck::bytes_of(&GenerateParams { row_begin, ..p }).to_vec())
                })?;
            }
        }
        Ok(())
    }

    fn op(&mut self, device: usize, op: &Op) -> Result<(), ReferenceError> {
        let dt = |r: &Region| dtype_code(self.plan.buffer(r.buf).dtype);
        match op {
            Op::Gemm { a, b, c, trans_a, trans_b, accumulate, c_device, .. } => {
                let owner = c_device.unwrap_or(device);
                let (m, n) = (c.rows, c.cols);
                let k = if *trans_a { a.rows } else { a.cols };
                let (gx, gy) = (n.div_ceil(GEMM_TILE_COLS), m.div_ceil(GEMM_TILE_ROWS));
                if gx.max(gy) > self.max_groups as usize {
                    return Err(self.unsupported(format!(
                        "gemm {m}x{n} needs {gx}x{gy} workgroups, more than the adapter's {} per dimension",
                        self.max_groups
                    )));
                }
                let flags = (*trans_a as u32) * GEMM_TRANS_A + (*trans_b as u32) * GEMM_TRANS_B;
                let c_f32 = self.plan.buffer(c.buf).dtype == DType::F32;
                // Split K so that no invocation loops too long; chunks after the first
                // accumulate in f32 exactly as a single pass would.
                let split = k > GEMM_K_PER_DISPATCH;
                let (c_off, c_stride, c_dtype) = if split && !c_f32 {
                    (self.layout.tmp_base as u32, n as u32, 0)
                } else {
                    (self.layout.word(owner, c), c.stride as u32, dt(c))
                };
                let mut k_begin = 0;
                loop {
                    let k_end = (k_begin + GEMM_K_PER_DISPATCH).min(k);
                    let acc = if k_begin == 0 { *accumulate } else { true };
                    let p = GemmParams {
                        m: m as u32,
                        n: n as u32,
                        flags: flags | if acc { GEMM_ACCUMULATE } else { 0 },
                        k_begin: k_begin as u32,
                        k_end: k_end as u32,
                        a_off: self.layout.word(device, a),
                        a_stride: a.stride as u32,
                        a_dtype: dt(a),
                        b_off: self.layout.word(device, b),
                        b_stride: b.stride as u32,
                        b_dtype: dt(b),
                        c_off,
                        c_stride,
                        c_dtype,
                        _pad: [0; 2],
                    };
                    self.push(Stage::Gemm, &p, (gx as u32, gy as u32));
                    k_begin = k_end;
                    if k_begin >= k {
                        break;
                    }
                }
                if split && !c_f32 {
                    let mut inputs = [[0u32; 4]; 4];
                    inputs[0] = [self.layout.tmp_base as u32, n as u32, 0, 0];
                    self.reduce(m, n, 1, inputs, self.layout.word(owner, c), c.stride as u32, dt(c))?;
                }
            }
            Op::Copy { src, dst_device, dst, .. } => {
                let p = CopyParams {
                    rows: src.rows as u32,
                    cols: src.cols as u32,
                    row_begin: 0,
                    src_off: self.layout.word(device, src),
                    src_stride: src.stride as u32,
                    dst_off: self.layout.word(*dst_device, dst),
                    dst_stride: dst.stride as u32,
                    _pad: 0,
                };
                self.elementwise(src.rows, src.cols, |row_begin| {
                    (Stage::Copy, bytemuck::bytes_of(&CopyParams { row_begin, ..p }).to_vec())
                })?;
            }
            Op::Reduce { inputs, output } => {
                if inputs.len() > 4 {
                    return Err(self.unsupported(format!("reduce of {} inputs (at most 4 in one pass)", inputs.len())));
                }
                let mut packed = [[0u32; 4]; 4];
                for (slot, r) in packed.iter_mut().zip(inputs) {
                    *slot = [self.layout.word(device, r), r.stride as u32, dt(r), 0];
                }
                let out = self.layout.word(device, output);
                self.reduce(
                    output.rows,
                    output.cols,
                    inputs.len() as u32,
                    packed,
                    out,
                    output.stride as u32,
                    dt(output),
                )?;
            }
            Op::Pointwise { function, inputs, output } => {
                let mut packed = [[0u32; 4]; 2];
                for (slot, r) in packed.iter_mut().zip(inputs) {
                    *slot = [self.layout.word(device, r), r.stride as u32, dt(r), 0];
                }
                let p = PointwiseParams {
                    rows: output.rows as u32,
                    cols: output.cols as u32,
                    row_begin: 0,
                    function: function.code(),
                    out_off: self.layout.word(device, output),
                    out_stride: output.stride as u32,
                    out_dtype: dt(output),
                    _pad: 0,
                    inputs: packed,
                };
                self.elementwise(output.rows, output.cols, |row_begin| {
                    (Stage::Pointwise, bytemuck::bytes_of(&PointwiseParams { row_begin, ..p }).to_vec())
                })?;
            }
            Op::Attend { q, k, v, state, heads, kv_heads, causal, fresh } => {
                let dh = q.cols / heads;
                let tiles = ATTEND_LOOP_BUDGET.saturating_sub(2 * dh) / (33 * dh + 48);
                if tiles == 0 {
                    return Err(self.unsupported(format!("attention head dimension {dh} exceeds the loop budget")));
                }
                let region = |r: &Region| [self.layout.word(device, r), r.stride as u32, dt(r), 0];
                let c = causal.unwrap_or(Causal { q_pos: 0, k_pos: 0 });
                let p = AttendParams {
                    rows: q.rows as u32,
                    heads: *heads as u32,
                    group: (heads / kv_heads) as u32,
                    head_dim: dh as u32,
                    key_begin: 0,
                    key_end: 0,
                    fresh: 0,
                    causal: causal.is_some() as u32,
                    q_pos: c.q_pos as u32,
                    k_pos: c.k_pos as u32,
                    scale_bits: attention_scale(dh).to_bits(),
                    row_begin: 0,
                    q: region(q),
                    k: region(k),
                    v: region(v),
                    m: region(&state.max),
                    l: region(&state.sum),
                    acc: region(&state.acc),
                };
                // Key ranges of whole tiles, so that the dispatches round as one pass.
                let step = tiles * ATTN_KEY_TILE;
                let mut key_begin = 0;
                loop {
                    let key_end = (key_begin + step).min(k.rows);
                    let fresh = (*fresh && key_begin == 0) as u32;
                    let p = AttendParams { key_begin: key_begin as u32, key_end: key_end as u32, fresh, ..p };
                    self.per_row_head(q.rows, *heads, |row_begin| {
                        (Stage::Attend, bytemuck::bytes_of(&AttendParams { row_begin, ..p }).to_vec())
                    })?;
                    key_begin = key_end;
                    if key_begin >= k.rows {
                        break;
                    }
                }
            }
            Op::AttnMerge { from, into, heads } => {
                let p = self.attn_state_params(device, ATTN_MERGE, from, into, *heads, None);
                self.per_row_head(into.max.rows, *heads, |row_begin| {
                    (Stage::AttnState, bytemuck::bytes_of(&AttnStateParams { row_begin, ..p }).to_vec())
                })?;
            }
            Op::AttnFinish { state, out, lse, heads } => {
                let p = self.attn_state_params(device, ATTN_FINISH, state, state, *heads, Some((out, lse)));
                self.per_row_head(state.max.rows, *heads, |row_begin| {
                    (Stage::AttnState, bytemuck::bytes_of(&AttnStateParams { row_begin, ..p }).to_vec())
                })?;
            }
            Op::Route { ids, tables, experts } => {
                let chunks = tables.chunks(*experts);
                let (tokens, slots) = (ids.rows, ids.cols);
                // The longest chunk: the first of the first shard.
                let per_chunk = tables.chunk_tokens(*experts, 0).len() * slots;
                if per_chunk > ROUTE_LOOP_BUDGET || experts * chunks > ROUTE_LOOP_BUDGET {
                    return Err(self.unsupported(format!(
                        "routing {tokens} tokens x {slots} slots in {chunks} chunks over {experts} experts loops {per_chunk} or {} times per invocation, more than {ROUTE_LOOP_BUDGET}",
                        experts * chunks
                    )));
                }
                let word = |r: &Region| self.layout.word(device, r);
                let p = RouteParams {
                    pass: 0,
                    tokens: tokens as u32,
                    slots: slots as u32,
                    experts: *experts as u32,
                    chunks: chunks as u32,
                    capacity: tables.perm.rows as u32,
                    ids_off: word(ids),
                    ids_stride: ids.stride as u32,
                    seg_off: word(&tables.seg),
                    perm_off: word(&tables.perm),
                    perm_stride: tables.perm.stride as u32,
                    inv_off: word(&tables.inv),
                    inv_stride: tables.inv.stride as u32,
                    row_begin: 0,
                    shards: tables.shards as u32,
                    _pad: 0,
                };
                let words = (tokens * slots).max(tables.perm.rows).max(experts * chunks).max(1);
                for pass in 0..3 {
                    let p = RouteParams { pass, ..p };
                    self.elementwise(words.div_ceil(ROUTE_ROW), ROUTE_ROW, |row_begin| {
                        (Stage::Route, bytemuck::bytes_of(&RouteParams { row_begin, ..p }).to_vec())
                    })?;
                }
            }
            Op::GroupedGemm { a, b, c, tables, experts, groups, chunk, gather, zero_unrouted } => {
                let k = b.rows / experts;
                if k + experts > ROUTE_LOOP_BUDGET {
                    return Err(self.unsupported(format!(
                        "grouped gemm with k={k} over {experts} experts loops more than {ROUTE_LOOP_BUDGET} times per invocation"
                    )));
                }
                let word = |r: &Region| self.layout.word(device, r);
                let p = GroupedGemmParams {
                    n: c.cols as u32,
                    k: k as u32,
                    row_begin: 0,
                    experts: *experts as u32,
                    a: self.tensor(device, a),
                    b: self.tensor(device, b),
                    c: self.tensor(device, c),
                    seg_off: word(&tables.seg),
                    perm_off: word(&tables.perm),
                    perm_stride: tables.perm.stride as u32,
                    slots: tables.inv.cols as u32,
                    chunks: tables.chunks(*experts) as u32,
                    chunk: *chunk as u32,
                    group_begin: groups.start as u32,
                    group_end: groups.end as u32,
                    gather: gather.is_some() as u32,
                    gather_base: gather.unwrap_or(0) as u32,
                    zero_unrouted: *zero_unrouted as u32,
                    _pad: 0,
                };
                self.elementwise(c.rows, c.cols, |row_begin| {
                    (Stage::GroupedGemm, bytemuck::bytes_of(&GroupedGemmParams { row_begin, ..p }).to_vec())
                })?;
            }
            Op::Combine { rows, weights, inv, out } => {
                let p = CombineParams {
                    cols: out.cols as u32,
                    slots: inv.cols as u32,
                    row_begin: 0,
                    _pad: 0,
                    src: self.tensor(device, rows),
                    weights: self.tensor(device, weights),
                    inv: self.tensor(device, inv),
                    out: self.tensor(device, out),
                };
                self.elementwise(out.rows, out.cols, |row_begin| {
                    (Stage::Combine, bytemuck::bytes_of(&CombineParams { row_begin, ..p }).to_vec())
                })?;
            }
            Op::Signal { device: target, sem, add } => {
                let word = self.layout.sem_base + target * self.plan.semaphores.len() + sem.0;
                self.push(Stage::Signal, &SignalParams { word: word as u32, add: *add, _pad: [0; 2] }, (1, 1));
            }
            Op::Wait { .. } => {}
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &mut self,
        rows: usize,
        cols: usize,
        count: u32,
        inputs: [[u32; 4]; 4],
        out_off: u32,
        out_stride: u32,
        out_dtype: u32,
    ) -> Result<(), ReferenceError> {
        let p = ReduceParams {
            rows: rows as u32,
            cols: cols as u32,
            row_begin: 0,
            count,
            out_off,
            out_stride,
            out_dtype,
            _pad: 0,
            inputs,
        };
        self.elementwise(rows, cols, |row_begin| {
            (Stage::Reduce, bytemuck::bytes_of(&ReduceParams { row_begin, ..p }).to_vec())
        })
    }
}

/// How to run a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunOptions {
    /// The interleaving of the lanes.
    pub order: Order,
    /// Fault injection for testing the semaphore audit: the GPU mirror of this `Signal`
    /// is not updated, as if the signal were lost on the way.
    pub lose_signal: Option<OpSite>,
    /// Submit op by op and wait for each, recording its wall time in
    /// [`RunOutput::op_times`] (slower: one submission per op instead of one in all).
    pub time_ops: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions { order: Order::Default, lose_signal: None, time_ops: false }
    }
}

impl Gpu {
    /// Whether `plan`'s memory fits what this adapter binds, checked before any work
    /// (inputs, oracle, dispatches): a typed error naming the sizes, and the CPU twin.
    pub fn check_fits(&self, plan: &Plan) -> Result<(), ReferenceError> {
        let layout = Layout::new(plan);
        let bytes = layout.total as u64 * 4;
        if bytes > self.max_heap_bytes() || layout.total > u32::MAX as usize {
            return Err(ReferenceError::TooLarge {
                plan: plan.name.clone(),
                needed: bytes,
                devices: plan.devices,
                limit: self.max_heap_bytes(),
            });
        }
        Ok(())
    }

    /// Runs `plan` with inputs from `(seed, family)` in the default order.
    pub fn run(&self, plan: &Plan, seed: u32, family: Family) -> Result<RunOutput, ReferenceError> {
        self.run_with(plan, seed, family, &RunOptions::default())
    }

    /// Runs `plan` with inputs from `(seed, family)` and returns every buffer of every
    /// device. Scratch and output buffers start as poison (`DType::poison_bits`).
    pub fn run_with(
        &self,
        plan: &Plan,
        seed: u32,
        family: Family,
        options: &RunOptions,
    ) -> Result<RunOutput, ReferenceError> {
        let start = Instant::now();
        plan.validate()?;
        plan.check_generator_range()?;
        cmm_core::moe::check_routing(plan, seed)?;
        let sched = schedule_with(plan, options.order)?;
        self.check_fits(plan)?;
        let layout = Layout::new(plan);
        let max_groups = self.device.limits().max_compute_workgroups_per_dimension;
        let mut setup = Encoder { plan, layout: &layout, max_groups, dispatches: Vec::new() };
        for d in 0..plan.devices {
            setup.generate(d, seed, family)?;
        }
        let mut ops = Encoder { plan, layout: &layout, max_groups, dispatches: Vec::new() };
        // Per executed op, the range of its dispatches (for timed runs).
        let mut op_ranges = Vec::with_capacity(sched.order.len());
        for site in &sched.order {
            let first = ops.dispatches.len();
            if options.lose_signal != Some(*site) {
                ops.op(site.device, &plan.programs[site.device].lanes[site.lane][site.index])?;
            }
            op_ranges.push((*site, first..ops.dispatches.len()));
        }

        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let heap = self.heap_parts(layout.total);
        let mut initial = vec![0u32; layout.total];
        for bases in &layout.base {
            for (b, &at) in plan.buffers.iter().zip(bases) {
                if let BufferRole::Router { part, router } = &b.role {
                    initial[at..at + b.len()].copy_from_slice(&router.words(*part, seed, family));
                } else if b.role.generated().is_none() || b.device_rows.is_some() {
                    // Outputs and scratch, and the padding of an uneven shard's input.
                    initial[at..at + b.len()].fill(b.dtype.poison_bits());
                }
            }
        }
        let part_words = self.heap_part_words() as usize;
        for (part, words) in heap.iter().zip(initial.chunks(part_words)) {
            self.queue.write_buffer(part, 0, bytemuck::cast_slice(words));
        }
        let stages = self.pipelines.stages(&self.device, layout.total);
        self.submit_dispatches(stages, &heap, &setup.dispatches)?;
        let t0 = Instant::now();
        let op_times = if options.time_ops {
            let mut times = Vec::with_capacity(op_ranges.len());
            for (site, range) in op_ranges {
                let start = t0.elapsed();
                self.submit_dispatches(stages, &heap, &ops.dispatches[range])?;
                times.push(OpTiming { site, start, duration: t0.elapsed() - start });
            }
            Some(times)
        } else {
            self.submit_dispatches(stages, &heap, &ops.dispatches)?;
            None
        };
        let execute = t0.elapsed();
        let mut words = Vec::with_capacity(layout.total);
        for (k, part) in heap.iter().enumerate() {
            let len = layout.total.saturating_sub(k * part_words).min(part_words);
            if len > 0 {
                words.extend(self.read_back(part, len as u64 * 4)?);
            }
        }
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(ReferenceError::Wgpu { during: "running the plan", message: e.to_string() });
        }
        if let Some(message) = self.take_uncaptured() {
            return Err(ReferenceError::Wgpu { during: "running the plan", message });
        }
        for (device, host) in sched.final_semaphores.iter().enumerate() {
            for (s, &host_value) in host.iter().enumerate() {
                let gpu = words[layout.sem_base + device * plan.semaphores.len() + s];
                if gpu != host_value {
                    return Err(ReferenceError::SemaphoreMirror {
                        plan: plan.name.clone(),
                        device,
                        semaphore: plan.semaphores[s].clone(),
                        gpu,
                        host: host_value,
                    });
                }
            }
        }
        let buffers = (0..plan.devices)
            .map(|d| {
                plan.buffers
                    .iter()
                    .enumerate()
                    .map(|(i, b)| words[layout.base[d][i]..layout.base[d][i] + b.len()].to_vec())
                    .collect()
            })
            .collect();
        Ok(RunOutput { buffers, elapsed: start.elapsed(), execute, dispatches: ops.dispatches.len(), op_times })
    }

    /// Encodes `dispatches` in order in one compute pass, submits and waits.
    /// The heap of `total` words as [`HEAP_PARTS`] buffers of at most one binding each
    /// (parts past the end get a one-word buffer, since every binding must be bound).
    fn heap_parts(&self, total: usize) -> Vec<wgpu::Buffer> {
        let part_words = self.heap_part_words() as usize;
        (0..HEAP_PARTS)
            .map(|k| {
                let words = total.saturating_sub(k * part_words).min(part_words).max(1);
                self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("cmm heap part"),
                    size: words as u64 * 4,
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            })
            .collect()
    }

    fn submit_dispatches(
        &self,
        stages: &Stages,
        heap: &[wgpu::Buffer],
        dispatches: &[Dispatch],
    ) -> Result<(), ReferenceError> {
        if dispatches.is_empty() {
            return Ok(());
        }
        let align = (self.device.limits().min_uniform_buffer_offset_alignment as u64).max(PARAMS_SIZE);
        let mut staging = vec![0u8; dispatches.len() * align as usize];
        for (i, d) in dispatches.iter().enumerate() {
            let at = i * align as usize;
            staging[at..at + d.params.len()].copy_from_slice(&d.params);
        }
        let params = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cmm dispatch params"),
            size: staging.len() as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&params, 0, &staging);
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("cmm heap + params"),
            layout: &self.pipelines.layout,
            entries: &[
                wgpu::BindGroupEntry { binding: HEAP_BINDINGS[0], resource: heap[0].as_entire_binding() },
                wgpu::BindGroupEntry { binding: HEAP_BINDINGS[1], resource: heap[1].as_entire_binding() },
                wgpu::BindGroupEntry { binding: HEAP_BINDINGS[2], resource: heap[2].as_entire_binding() },
                wgpu::BindGroupEntry { binding: HEAP_BINDINGS[3], resource: heap[3].as_entire_binding() },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &params,
                        offset: 0,
                        size: wgpu::BufferSize::new(PARAMS_SIZE),
                    }),
                },
            ],
        });
        let mut encoder =
            self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("cmm ops") });
        {
            let mut pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("cmm ops"), timestamp_writes: None });
            let mut current = None;
            for (i, d) in dispatches.iter().enumerate() {
                if current != Some(d.stage) {
                    pass.set_pipeline(match d.stage {
                        Stage::Gemm => &stages.gemm,
                        Stage::Copy => &stages.copy,
                        Stage::Reduce => &stages.reduce,
                        Stage::Route => &stages.route,
                        Stage::GroupedGemm => &stages.grouped_gemm,
                        Stage::Combine => &stages.combine,
                        Stage::Pointwise => &stages.pointwise,
                        Stage::Attend => &stages.attend,
                        Stage::AttnState => &stages.attn_state,
                        Stage::Generate => &stages.generate,
                        Stage::Signal => &stages.signal,
                    });
                    current = Some(d.stage);
                }
                pass.set_bind_group(0, &bind_group, &[(i as u64 * align) as u32]);
                pass.dispatch_workgroups(d.groups.0, d.groups.1, 1);
            }
        }
        self.queue.submit([encoder.finish()]);
        self.wait("executing dispatches")
    }

    fn wait(&self, during: &'static str) -> Result<(), ReferenceError> {
        self.device
            .poll(wgpu::PollType::Wait { submission_index: None, timeout: Some(Duration::from_secs(600)) })
            .map(|_| ())
            .map_err(|e| ReferenceError::Wgpu { during, message: e.to_string() })
    }

    fn read_back(&self, heap: &wgpu::Buffer, bytes: u64) -> Result<Vec<u32>, ReferenceError> {
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cmm read-back"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder =
            self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("cmm read-back") });
        encoder.copy_buffer_to_buffer(heap, 0, &staging, 0, bytes);
        self.queue.submit([encoder.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait("reading results back")?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(ReferenceError::Wgpu { during: "mapping the read-back buffer", message: e.to_string() })
            }
            Err(_) => {
                return Err(ReferenceError::Wgpu {
                    during: "mapping the read-back buffer",
                    message: "the map callback never ran".into(),
                })
            }
        }
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| ReferenceError::Wgpu { during: "reading the mapped buffer", message: e.to_string() })?;
        let words = bytemuck::cast_slice::<u8, u32>(&view).to_vec();
        drop(view);
        staging.unmap();
        Ok(words)
    }
}
