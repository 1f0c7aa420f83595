//! The plan model (BRIEF §5): symmetric buffers, semaphores, and per device a few lanes,
//! each an ordered list of ops. Only semaphores order ops across lanes and devices.
//!
//! Executors (the wgpu reference, CUDA, the simulator) run plans without knowing which
//! algorithm made them; algorithms produce plans without knowing any executor.

use std::fmt;

use thiserror::Error;

use crate::dtype::DType;

/// Index of a buffer in [`Plan::buffers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufId(pub usize);

/// Index of a semaphore in [`Plan::semaphores`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SemId(pub usize);

/// What a buffer holds at the start and end of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
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
}

/// Per device, the (row, column) of a generated buffer's element (0, 0) in its tensor.
pub type Origins = [(usize, usize)];

impl BufferRole {
    /// The generator window of a buffer filled before the run (an input or an
    /// accumulator): tensor id, global columns, per-device origins.
    pub fn generated(&self) -> Option<(u32, usize, &Origins)> {
        match self {
            BufferRole::Input { tensor, global_cols, origins }
            | BufferRole::Accumulator { tensor, global_cols, origins } => Some((*tensor, *global_cols, origins)),
            BufferRole::Output | BufferRole::Scratch => None,
        }
    }

    /// Whether the buffer holds a result read back after the run.
    pub fn is_result(&self) -> bool {
        matches!(self, BufferRole::Output | BufferRole::Accumulator { .. })
    }
}

/// A buffer that every device has (a symmetric allocation), a row-major matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
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
}

impl BufferDecl {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A 2D strided region of one buffer: element (r, c) is at `offset + r * stride + c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
    /// One past the last element the region touches (0 when empty).
    pub fn end(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            self.offset + (self.rows - 1) * self.stride + self.cols
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

/// The most inputs one [`Op::Reduce`] may sum (every executor sums them in one pass);
/// longer sums chain through an f32 accumulator, which adds in the same order.
pub const MAX_REDUCE_INPUTS: usize = 4;

/// Who moves the bytes of a [`Op::Copy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Engine {
    /// A DMA copy engine (cudaMemcpyAsync); no SMs used.
    CopyEngine,
    /// A copy kernel on the SMs (TileLink's tile push).
    Sm,
}

/// An elementwise function of [`Op::Pointwise`] (the GeLU of seed 004's MLP block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
    /// [`crate::linear::gelu`]).
    pub fn apply(self, inputs: &[f32]) -> f32 {
        match self {
            Pointwise::Gelu => crate::linear::gelu(inputs[0]),
            Pointwise::GeluGrad => inputs[0] * crate::linear::gelu_grad(inputs[1]),
        }
    }
}

/// One step of a lane.
#[derive(Clone, Debug, PartialEq, Eq)]
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

/// The program of one device: its lanes, in the order of [`Plan::lanes`].
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct DeviceProgram {
    /// Ops of each lane.
    pub lanes: Vec<Vec<Op>>,
}

/// A schedule of a collective matmul on `devices` devices.
#[derive(Clone, Debug, PartialEq, Eq)]
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

    /// Checks every reference, bound, shape and dtype of the plan.
    pub fn validate(&self) -> Result<(), PlanError> {
        let plan = || self.name.clone();
        if self.devices == 0 || self.programs.len() != self.devices {
            return Err(PlanError::DeviceCount { plan: plan(), devices: self.devices, programs: self.programs.len() });
        }
        for (device, p) in self.programs.iter().enumerate() {
            if p.lanes.len() != self.lanes.len() {
                return Err(PlanError::LaneCount {
                    plan: plan(),
                    device,
                    got: p.lanes.len(),
                    expected: self.lanes.len(),
                });
            }
        }
        for b in &self.buffers {
            if let Some((_, _, origins)) = b.role.generated() {
                if origins.len() != self.devices {
                    return Err(PlanError::Mismatch {
                        plan: plan(),
                        site: OpSite { device: 0, lane: 0, index: 0 },
                        detail: format!(
                            "input buffer `{}` has {} origins for {} devices",
                            b.name,
                            origins.len(),
                            self.devices
                        ),
                    });
                }
            }
        }
        for (site, op) in self.ops() {
            self.validate_op(site, op)?;
        }
        Ok(())
    }

    fn validate_op(&self, site: OpSite, op: &Op) -> Result<(), PlanError> {
        let bad = |what: String| PlanError::BadReference { plan: self.name.clone(), site, what };
        let mismatch = |detail: String| PlanError::Mismatch { plan: self.name.clone(), site, detail };
        let region = |r: &Region| -> Result<&BufferDecl, PlanError> {
            let b = self.buffers.get(r.buf.0).ok_or_else(|| bad(format!("buffer #{} does not exist", r.buf.0)))?;
            if r.end() > b.len() || (r.rows > 1 && r.stride < r.cols) {
                return Err(PlanError::RegionOutOfBounds {
                    plan: self.name.clone(),
                    site,
                    region: *r,
                    buffer: b.name.clone(),
                    len: b.len(),
                });
            }
            Ok(b)
        };
        let device = |d: usize| {
            if d < self.devices {
                Ok(())
            } else {
                Err(bad(format!("device {d} does not exist (D={})", self.devices)))
            }
        };
        let sem = |s: SemId| {
            if s.0 < self.semaphores.len() {
                Ok(())
            } else {
                Err(bad(format!("semaphore #{} does not exist", s.0)))
            }
        };
        match op {
            Op::Gemm { a, b, c, trans_a, trans_b, accumulate } => {
                region(a)?;
                region(b)?;
                let cb = region(c)?;
                let (m, ka) = if *trans_a { (a.cols, a.rows) } else { (a.rows, a.cols) };
                let (kb, n) = if *trans_b { (b.cols, b.rows) } else { (b.rows, b.cols) };
                if ka != kb || c.rows != m || c.cols != n {
                    return Err(mismatch(format!(
                        "gemm shapes disagree: op(a) is {m}x{ka}, op(b) is {kb}x{n}, c is {}x{}",
                        c.rows, c.cols
                    )));
                }
                if *accumulate && cb.dtype != DType::F32 {
                    return Err(mismatch(format!(
                        "accumulating gemm into `{}` of dtype {} would round twice; accumulate into f32",
                        cb.name, cb.dtype
                    )));
                }
            }
            Op::Copy { src, dst_device, dst, .. } => {
                let s = region(src)?;
                let d = region(dst)?;
                device(*dst_device)?;
                if (src.rows, src.cols) != (dst.rows, dst.cols) || s.dtype != d.dtype {
                    return Err(mismatch(format!(
                        "copy {} {}x{} -> {} {}x{}",
                        s.dtype, src.rows, src.cols, d.dtype, dst.rows, dst.cols
                    )));
                }
            }
            Op::Reduce { inputs, output } => {
                region(output)?;
                if inputs.is_empty() || inputs.len() > MAX_REDUCE_INPUTS {
                    return Err(mismatch(format!(
                        "reduce of {} inputs: 1 to {MAX_REDUCE_INPUTS} (chain longer sums through an f32 accumulator)",
                        inputs.len()
                    )));
                }
                for r in inputs {
                    region(r)?;
                    if (r.rows, r.cols) != (output.rows, output.cols) {
                        return Err(mismatch(format!(
                            "reduce input {}x{} vs output {}x{}",
                            r.rows, r.cols, output.rows, output.cols
                        )));
                    }
                }
            }
            Op::Pointwise { function, inputs, output } => {
                region(output)?;
                if inputs.len() != function.arity() {
                    return Err(mismatch(format!(
                        "{} takes {} input(s), got {}",
                        function.name(),
                        function.arity(),
                        inputs.len()
                    )));
                }
                for r in inputs {
                    region(r)?;
                    if (r.rows, r.cols) != (output.rows, output.cols) {
                        return Err(mismatch(format!(
                            "{} input {}x{} vs output {}x{}",
                            function.name(),
                            r.rows,
                            r.cols,
                            output.rows,
                            output.cols
                        )));
                    }
                }
            }
            Op::Signal { device: d, sem: s, .. } => {
                device(*d)?;
                sem(*s)?;
            }
            Op::Wait { sem: s, .. } => sem(*s)?,
        }
        Ok(())
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
                    let last = (r0 + b.rows - 1) as u64 * global_cols as u64 + (c0 + b.cols - 1) as u64;
                    if last > u32::MAX as u64 {
                        return Err(PlanError::GeneratorRange {
                            plan: self.name.clone(),
                            buffer: b.name.clone(),
                            index: last,
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
            if r.stride == cols && r.offset % cols == 0 {
                let r0 = r.offset / cols;
                let c_full = r.cols == cols;
                if c_full {
                    format!("{name}[{}..{}]", r0, r0 + r.rows)
                } else {
                    format!("{name}[{}..{}, 0..{}]", r0, r0 + r.rows, r.cols)
                }
            } else {
                let (r0, c0) = (r.offset / cols, r.offset % cols);
                format!("{name}[{}..{}, {}..{}]", r0, r0 + r.rows, c0, c0 + r.cols)
            }
        };
        let sem = |s: &SemId| self.semaphores.get(s.0).map_or("?", String::as_str);
        match op {
            Op::Gemm { a, b, c, trans_a, trans_b, accumulate } => format!(
                "gemm {} {} {}{} · {}{}",
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
        }
    }

    /// Declares a symmetric buffer.
    pub fn buffer(&mut self, name: &str, dtype: DType, rows: usize, cols: usize, role: BufferRole) -> BufId {
        self.plan.buffers.push(BufferDecl { name: name.into(), dtype, rows, cols, role });
        BufId(self.plan.buffers.len() - 1)
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

    /// Appends an op to a lane of a device.
    pub fn push(&mut self, device: usize, lane: LaneId, op: Op) {
        self.plan.programs[device].lanes[lane.0].push(op);
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
        self.plan.validate()?;
        Ok(self.plan)
    }
}
