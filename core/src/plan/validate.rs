//! Plan validation: every reference, bound, shape and dtype, checked before anything
//! runs, op by op ([`OpCheck`] has one method per op of the plan model).

use super::*;

impl Plan {
    fn check_fused_run(&self, run: &FusedRun) -> Result<(), PlanError> {
        let ops = &self.programs[run.device].lanes[run.lane];
        let block = |i: usize| match &ops[run.blocks[i]] {
            Op::Gemm { a, b, c, trans_a, trans_b, accumulate, c_device, .. } => {
                (a, b, c, (*trans_a, *trans_b, *accumulate), c_device.unwrap_or(run.device))
            }
            _ => unreachable!("run blocks are gemms"),
        };
        let (a0, b0, c0, flags0, _) = block(0);
        let dtypes = |a: &Region, c: &Region| (self.buffer(a.buf).dtype, self.buffer(c.buf).dtype);
        for i in 0..run.blocks.len() {
            let site = OpSite { device: run.device, lane: run.lane, index: run.blocks[i] };
            let mismatch = |detail: String| OpCheck { plan: self, site }.mismatch(detail);
            let (a, b, c, flags, owner) = block(i);
            if b != b0 || flags != flags0 || dtypes(a, c) != dtypes(a0, c0) || c.cols != c0.cols {
                return Err(mismatch(format!(
                    "block {i} of fused gemm {} differs from block 0 in b, transposes, accumulation, dtypes or columns; the blocks of one kernel share all of them",
                    run.id
                )));
            }
            // Where each block's operands lie: a and b on the run's device, c on its owner.
            let local = run.device;
            for j in 0..i {
                let (other_a, _, other_c, _, other_owner) = block(j);
                let meet =
                    |(x, xd): (&Region, usize), (y, yd): (&Region, usize)| xd == yd && x.buf == y.buf && x.overlaps(y);
                let clash = [
                    ((c, owner), (other_c, other_owner)),
                    ((c, owner), (other_a, local)),
                    ((a, local), (other_c, other_owner)),
                    ((b, local), (other_c, other_owner)),
                    ((b, local), (c, owner)),
                ]
                .into_iter()
                .any(|(x, y)| meet(x, y));
                if clash {
                    return Err(mismatch(format!(
                        "blocks {j} and {i} of fused gemm {} touch the same elements and one of them writes them; the kernel computes ready blocks concurrently",
                        run.id
                    )));
                }
            }
        }
        Ok(())
    }

    /// Every tile-granular GEMM of the plan, checked: its blocks lie in one lane with
    /// only Waits and Signals between them, agree on b, the transposes, accumulation and
    /// dtypes, and no block writes what another block of the run reads or writes (the
    /// kernel computes ready blocks concurrently).
    pub fn fused_runs(&self) -> Result<Vec<FusedRun>, PlanError> {
        let mut runs: Vec<FusedRun> = Vec::new();
        for (device, program) in self.programs.iter().enumerate() {
            for (lane, ops) in program.lanes.iter().enumerate() {
                let first_run = runs.len();
                let mut open: Option<FusedRun> = None;
                for (index, op) in ops.iter().enumerate() {
                    let site = OpSite { device, lane, index };
                    let mismatch = |detail: String| OpCheck { plan: self, site }.mismatch(detail);
                    match (op, open.as_mut()) {
                        // Only waits and signals keep a run open, so this block follows
                        // the previous one.
                        (Op::Gemm { fused: Some(id), .. }, Some(run)) if run.id == *id => {
                            run.blocks.push(index);
                        }
                        (Op::Gemm { fused: Some(id), .. }, _) => {
                            if let Some(run) = open.take() {
                                runs.push(run);
                            }
                            if runs[first_run..].iter().any(|r| r.id == *id) {
                                return Err(mismatch(format!(
                                    "fused gemm {id} resumes after other ops of its lane; its blocks must follow one another with only waits and signals between them"
                                )));
                            }
                            open = Some(FusedRun { device, lane, id: *id, blocks: vec![index] });
                        }
                        (Op::Wait { .. } | Op::Signal { .. }, _) => {}
                        _ => runs.extend(open.take()),
                    }
                }
                runs.extend(open);
            }
        }
        for run in &runs {
            self.check_fused_run(run)?;
        }
        Ok(runs)
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
        let buffer_names = self.buffers.iter().map(|b| b.name.as_str());
        let lane_names = self.lanes.iter().map(String::as_str);
        let semaphore_names = self.semaphores.iter().map(String::as_str);
        for (kind, names) in [
            ("buffer", buffer_names.collect::<Vec<_>>()),
            ("semaphore", semaphore_names.collect()),
            ("lane", lane_names.collect()),
        ] {
            let mut seen = std::collections::HashSet::new();
            if let Some(name) = names.into_iter().find(|n| !seen.insert(*n)) {
                return Err(PlanError::DuplicateName { plan: plan(), kind, name: name.to_string() });
            }
        }
        let ops = self.op_count();
        if ops > MAX_PLAN_OPS {
            return Err(PlanError::TooManyOps { plan: plan(), ops: ops as u64, at_least: false, limit: MAX_PLAN_OPS });
        }
        // A buffer's declaration contradicts itself (no op is at fault: site 0 stands in).
        let declaration = |detail: String| PlanError::Mismatch {
            plan: plan(),
            site: OpSite { device: 0, lane: 0, index: 0 },
            detail,
        };
        for b in &self.buffers {
            if b.rows.checked_mul(b.cols).is_none_or(|n| n > MAX_BUFFER_ELEMENTS) {
                return Err(PlanError::BufferTooLarge {
                    plan: plan(),
                    buffer: b.name.clone(),
                    rows: b.rows,
                    cols: b.cols,
                    limit: MAX_BUFFER_ELEMENTS,
                });
            }
            if let BufferRole::Router { router, .. } = &b.role {
                // Ids are u32 picks among the experts: at least one, and as many as a u32
                // counts (the generator draws them modulo that count).
                if router.experts == 0 || u32::try_from(router.experts).is_err() {
                    return Err(declaration(format!(
                        "router buffer `{}` routes among {} experts: a router needs 1 to {}",
                        b.name,
                        router.experts,
                        u32::MAX
                    )));
                }
                // The router's tables fill the buffer exactly: T rows of k slots.
                if (b.rows, b.cols) != (router.tokens, router.slots) {
                    return Err(declaration(format!(
                        "router buffer `{}` is {}×{}, but its router has {} tokens of {} slots",
                        b.name, b.rows, b.cols, router.tokens, router.slots
                    )));
                }
            }
            if let Some(rows) = &b.device_rows {
                let holds_data = b.role.generated().is_some() || b.role == BufferRole::Output;
                if rows.len() != self.devices || rows.iter().any(|&r| r > b.rows) || !holds_data {
                    return Err(declaration(format!(
                        "buffer `{}` declares per-device rows {rows:?}: an input, accumulator or output of {} rows \
                         needs one count of at most {} per device ({} devices)",
                        b.name, b.rows, b.rows, self.devices
                    )));
                }
            }
            if let Some((_, _, origins)) = b.role.generated() {
                if origins.len() != self.devices {
                    return Err(declaration(format!(
                        "input buffer `{}` has {} origins for {} devices",
                        b.name,
                        origins.len(),
                        self.devices
                    )));
                }
            }
        }
        for (site, op) in self.ops() {
            self.validate_op(site, op)?;
            self.validate_device_rows(site, op)?;
        }
        self.fused_runs().map(|_| ())
    }

    /// An op reaches only the rows of an unevenly sharded buffer that hold the data of
    /// the device it reaches ([`BufferDecl::device_rows`]): the padding is never read, so
    /// its contents cannot change a result, and a caller's buffer of exactly the
    /// device's rows can stand in for the whole allocation.
    fn validate_device_rows(&self, site: OpSite, op: &Op) -> Result<(), PlanError> {
        for access in crate::verify::accesses(site.device, op) {
            let b = self.buffer(access.region.buf);
            if b.device_rows.is_some() && access.region.end() > b.len_on(access.device) {
                return Err(PlanError::Mismatch {
                    plan: self.name.clone(),
                    site,
                    detail: format!(
                        "{} reaches past device {}'s {} rows of `{}` (an uneven shard; the rows after them are padding)",
                        self.op_text(op),
                        access.device,
                        b.rows_on(access.device),
                        b.name
                    ),
                });
            }
        }
        Ok(())
    }

    /// Checks one op: what it names exists, its regions fit their buffers, its operands
    /// agree (per op: [`OpCheck`]'s methods).
    fn validate_op(&self, site: OpSite, op: &Op) -> Result<(), PlanError> {
        let check = OpCheck { plan: self, site };
        check.arithmetic_dtypes(op)?;
        match op {
            Op::Gemm { .. } => check.gemm(op),
            Op::Copy { .. } => check.copy(op),
            Op::Reduce { .. } => check.reduce(op),
            Op::Pointwise { .. } => check.pointwise(op),
            Op::Attend { .. } => check.attend(op),
            Op::AttnMerge { .. } => check.attn_merge(op),
            Op::AttnFinish { .. } => check.attn_finish(op),
            Op::Route { .. } => check.route(op),
            Op::GroupedGemm { .. } => check.grouped_gemm(op),
            Op::Combine { .. } => check.combine(op),
            Op::Signal { .. } => check.signal(op),
            Op::Wait { .. } => check.wait(op),
        }
    }
}

/// The checks of one op, with the plan and site its errors name.
struct OpCheck<'p> {
    plan: &'p Plan,
    site: OpSite,
}

impl<'p> OpCheck<'p> {
    /// The op names something that does not exist.
    fn bad(&self, what: String) -> PlanError {
        PlanError::BadReference { plan: self.plan.name.clone(), site: self.site, what }
    }

    /// The op's operands disagree.
    fn mismatch(&self, detail: String) -> PlanError {
        PlanError::Mismatch { plan: self.plan.name.clone(), site: self.site, detail }
    }

    /// The buffer of a region that exists and fits it.
    fn region(&self, r: &Region) -> Result<&'p BufferDecl, PlanError> {
        let plan = self.plan;
        let b = plan.buffers.get(r.buf.0).ok_or_else(|| self.bad(format!("buffer #{} does not exist", r.buf.0)))?;
        if r.end() > b.len() || (r.rows > 1 && r.stride < r.cols) {
            return Err(PlanError::RegionOutOfBounds {
                plan: plan.name.clone(),
                site: self.site,
                region: *r,
                buffer: b.name.clone(),
                len: b.len(),
            });
        }
        Ok(b)
    }

    /// Checks the shapes and dtype (f32) of an attention state for `rows` rows of `heads`
    /// heads of dimension `dh`.
    fn attn_state(&self, state: &AttnState, rows: usize, heads: usize, dh: usize) -> Result<(), PlanError> {
        let want = [(rows, heads), (rows, heads), (rows, heads * dh)];
        for (r, (wr, wc)) in state.regions().iter().zip(want) {
            let b = self.region(r)?;
            if (r.rows, r.cols) != (wr, wc) || b.dtype != DType::F32 {
                return Err(self.mismatch(format!(
                    "attention state `{}` is {}x{} {}, expected {wr}x{wc} f32 ({rows} rows, {heads} heads of {dh})",
                    b.name, r.rows, r.cols, b.dtype
                )));
            }
        }
        Ok(())
    }

    /// Checks routing tables for `tokens` × `slots` slots and `experts` experts (all
    /// `u32`; seg one row, perm one column); returns the chunk count.
    fn tables(&self, tables: &RouteTables, tokens: usize, slots: usize, experts: usize) -> Result<usize, PlanError> {
        if experts == 0 || slots == 0 {
            return Err(self.mismatch(format!(
                "routing tables for {experts} experts of {slots} slots per token (both must be at least 1)"
            )));
        }
        for r in tables.regions() {
            let b = self.region(&r)?;
            if b.dtype != DType::U32 {
                return Err(self.mismatch(format!("routing table `{}` is {}, expected u32", b.name, b.dtype)));
            }
        }
        let chunks = tables.chunks(experts);
        if chunks == 0
            || tables.shards == 0
            || chunks % tables.shards != 0
            || tables.seg.rows != 1
            || tables.perm.cols != 1
            || (tables.inv.rows, tables.inv.cols) != (tokens, slots)
        {
            return Err(self.mismatch(format!(
                "routing tables: seg {}x{}, perm {}x{}, inv {}x{}, {} shards for {tokens} tokens x {slots} slots and {experts} experts (seg is 1 x experts·chunks+1 with the shards dividing the chunks, perm one column)",
                tables.seg.rows, tables.seg.cols, tables.perm.rows, tables.perm.cols, tables.inv.rows, tables.inv.cols, tables.shards
            )));
        }
        Ok(chunks)
    }

    /// A device that exists.
    fn device(&self, d: usize) -> Result<(), PlanError> {
        if d < self.plan.devices {
            Ok(())
        } else {
            Err(self.bad(format!("device {d} does not exist (D={})", self.plan.devices)))
        }
    }

    /// A semaphore that exists.
    fn sem(&self, s: SemId) -> Result<(), PlanError> {
        if s.0 < self.plan.semaphores.len() {
            Ok(())
        } else {
            Err(self.bad(format!("semaphore #{} does not exist", s.0)))
        }
    }

    /// Only the routing ops and copies touch u32 tables; arithmetic decodes floats.
    fn arithmetic_dtypes(&self, op: &Op) -> Result<(), PlanError> {
        let arithmetic: Vec<&Region> = match op {
            Op::Gemm { a, b, c, .. } | Op::GroupedGemm { a, b, c, .. } => vec![a, b, c],
            Op::Reduce { inputs, output } | Op::Pointwise { inputs, output, .. } => {
                inputs.iter().chain(std::iter::once(output)).collect()
            }
            Op::Attend { q, k, v, .. } => vec![q, k, v],
            Op::AttnFinish { out, .. } => vec![out],
            Op::Combine { rows, out, .. } => vec![rows, out],
            _ => Vec::new(),
        };
        for r in arithmetic {
            if self.plan.buffers.get(r.buf.0).is_some_and(|b| !b.dtype.is_float()) {
                return Err(self.mismatch(format!(
                    "`{}` is a {} table; arithmetic ops read f32, f16 or bf16",
                    self.plan.buffers[r.buf.0].name, self.plan.buffers[r.buf.0].dtype
                )));
            }
        }
        Ok(())
    }

    /// A GEMM: operands exist and fit, op(a)·op(b) fits c, a peer's c on a device that exists, accumulation in f32.
    fn gemm(&self, op: &Op) -> Result<(), PlanError> {
        let Op::Gemm { a, b, c, trans_a, trans_b, accumulate, c_device, .. } = op else {
            unreachable!("dispatched on its variant")
        };
        self.region(a)?;
        self.region(b)?;
        let cb = self.region(c)?;
        if let Some(peer) = c_device {
            self.device(*peer)?;
        }
        let (m, ka) = if *trans_a { (a.cols, a.rows) } else { (a.rows, a.cols) };
        let (kb, n) = if *trans_b { (b.cols, b.rows) } else { (b.rows, b.cols) };
        if ka != kb || c.rows != m || c.cols != n {
            return Err(self.mismatch(format!(
                "gemm shapes disagree: op(a) is {m}x{ka}, op(b) is {kb}x{n}, c is {}x{}",
                c.rows, c.cols
            )));
        }
        if *accumulate && cb.dtype != DType::F32 {
            return Err(self.mismatch(format!(
                "accumulating gemm into `{}` of dtype {} would round twice; accumulate into f32",
                cb.name, cb.dtype
            )));
        }
        Ok(())
    }

    /// A copy: same shape and dtype on both ends, to a device that exists.
    fn copy(&self, op: &Op) -> Result<(), PlanError> {
        let Op::Copy { src, dst_device, dst, .. } = op else { unreachable!("dispatched on its variant") };
        let s = self.region(src)?;
        let d = self.region(dst)?;
        self.device(*dst_device)?;
        if (src.rows, src.cols) != (dst.rows, dst.cols) || s.dtype != d.dtype {
            return Err(self.mismatch(format!(
                "copy {} {}x{} -> {} {}x{}",
                s.dtype, src.rows, src.cols, d.dtype, dst.rows, dst.cols
            )));
        }
        Ok(())
    }

    /// A reduce: 1 to MAX_REDUCE_INPUTS inputs of the output's shape.
    fn reduce(&self, op: &Op) -> Result<(), PlanError> {
        let Op::Reduce { inputs, output } = op else { unreachable!("dispatched on its variant") };
        self.region(output)?;
        if inputs.is_empty() || inputs.len() > MAX_REDUCE_INPUTS {
            return Err(self.mismatch(format!(
                "reduce of {} inputs: 1 to {MAX_REDUCE_INPUTS} (chain longer sums through an f32 accumulator)",
                inputs.len()
            )));
        }
        for r in inputs {
            self.region(r)?;
            if (r.rows, r.cols) != (output.rows, output.cols) {
                return Err(self.mismatch(format!(
                    "reduce input {}x{} vs output {}x{}",
                    r.rows, r.cols, output.rows, output.cols
                )));
            }
        }
        Ok(())
    }

    /// A pointwise function: its arity of inputs, each of the output's shape.
    fn pointwise(&self, op: &Op) -> Result<(), PlanError> {
        let Op::Pointwise { function, inputs, output } = op else { unreachable!("dispatched on its variant") };
        self.region(output)?;
        if inputs.len() != function.arity() {
            return Err(self.mismatch(format!(
                "{} takes {} input(s), got {}",
                function.name(),
                function.arity(),
                inputs.len()
            )));
        }
        for r in inputs {
            self.region(r)?;
            if (r.rows, r.cols) != (output.rows, output.cols) {
                return Err(self.mismatch(format!(
                    "{} input {}x{} vs output {}x{}",
                    function.name(),
                    r.rows,
                    r.cols,
                    output.rows,
                    output.cols
                )));
            }
        }
        Ok(())
    }

    /// An attention block: heads that divide, a head dimension in range, keys and values alike, an f32 state.
    fn attend(&self, op: &Op) -> Result<(), PlanError> {
        let Op::Attend { q, k, v, state, heads, kv_heads, .. } = op else { unreachable!("dispatched on its variant") };
        for r in [q, k, v] {
            self.region(r)?;
        }
        if *heads == 0 || *kv_heads == 0 || heads % kv_heads != 0 || q.cols % heads != 0 {
            return Err(self.mismatch(format!(
                "attend: {heads} heads over {kv_heads} kv heads and {} query columns (kv heads must divide heads, heads the columns)",
                q.cols
            )));
        }
        let dh = q.cols / heads;
        if dh == 0 || dh > MAX_HEAD_DIM {
            return Err(self.mismatch(format!("attend: head dimension {dh} is outside 1..={MAX_HEAD_DIM}")));
        }
        if k.cols != kv_heads * dh || (v.rows, v.cols) != (k.rows, k.cols) {
            return Err(self.mismatch(format!(
                "attend: k is {}x{} and v {}x{}, expected keys x {kv_heads}·{dh}",
                k.rows, k.cols, v.rows, v.cols
            )));
        }
        self.attn_state(state, q.rows, *heads, dh)?;
        Ok(())
    }

    /// A merge of two attention states of the same shape.
    fn attn_merge(&self, op: &Op) -> Result<(), PlanError> {
        let Op::AttnMerge { from, into, heads } = op else { unreachable!("dispatched on its variant") };
        let dh = if *heads == 0 { 0 } else { into.acc.cols / heads };
        if dh == 0 || dh * heads != into.acc.cols {
            return Err(self.mismatch(format!("attn_merge: {heads} heads do not split {} columns", into.acc.cols)));
        }
        self.attn_state(from, into.max.rows, *heads, dh)?;
        self.attn_state(into, into.max.rows, *heads, dh)?;
        Ok(())
    }

    /// The end of attention: O and an f32 LSE for the state's rows and heads.
    fn attn_finish(&self, op: &Op) -> Result<(), PlanError> {
        let Op::AttnFinish { state, out, lse, heads } = op else { unreachable!("dispatched on its variant") };
        let dh = if *heads == 0 { 0 } else { state.acc.cols / heads };
        if dh == 0 || dh * heads != state.acc.cols {
            return Err(self.mismatch(format!("attn_finish: {heads} heads do not split {} columns", state.acc.cols)));
        }
        let rows = state.max.rows;
        self.attn_state(state, rows, *heads, dh)?;
        self.region(out)?;
        let l = self.region(lse)?;
        if (out.rows, out.cols) != (rows, heads * dh) || (lse.rows, lse.cols) != (rows, *heads) || l.dtype != DType::F32
        {
            return Err(self.mismatch(format!(
                "attn_finish: out {}x{} and lse {}x{} ({}) for {rows} rows of {heads} heads of {dh} (lse is f32)",
                out.rows, out.cols, lse.rows, lse.cols, l.dtype
            )));
        }
        Ok(())
    }

    /// Routing: u32 ids and tables that fit them.
    fn route(&self, op: &Op) -> Result<(), PlanError> {
        let Op::Route { ids, tables, experts } = op else { unreachable!("dispatched on its variant") };
        let id = self.region(ids)?;
        self.tables(tables, ids.rows, ids.cols, *experts)?;
        if id.dtype != DType::U32 {
            return Err(self.mismatch(format!("route: ids `{}` are {}, expected u32", id.name, id.dtype)));
        }
        Ok(())
    }

    /// A grouped GEMM: tables, experts' B and c agree; the chunk and expert group exist; a gather takes one chunk of tokens.
    fn grouped_gemm(&self, op: &Op) -> Result<(), PlanError> {
        let Op::GroupedGemm { a, b, c, tables, experts, groups, chunk, gather, .. } = op else {
            unreachable!("dispatched on its variant")
        };
        self.region(a)?;
        self.region(b)?;
        self.region(c)?;
        let (tokens, slots) = (tables.inv.rows, tables.inv.cols);
        let chunks = self.tables(tables, tokens, slots, *experts)?;
        let k = b.rows / experts;
        if k * experts != b.rows || a.cols != k || c.cols != b.cols || c.rows != tables.perm.rows {
            return Err(self.mismatch(format!(
                "grouped gemm: a {}x{}, b {}x{} for {experts} experts, c {}x{} for {} table rows",
                a.rows, a.cols, b.rows, b.cols, c.rows, c.cols, tables.perm.rows
            )));
        }
        if *chunk >= chunks || groups.end > *experts || groups.start > groups.end {
            return Err(
                self.mismatch(format!("grouped gemm: chunk {chunk} of {chunks}, experts {groups:?} of {experts}"))
            );
        }
        let one_chunk = |base: usize| (0..chunks).any(|i| tables.chunk_tokens(*experts, i) == (base..base + a.rows));
        match gather {
            Some(base) if !one_chunk(*base) => {
                return Err(self.mismatch(format!(
                    "grouped gemm: gathering {} rows from token {base} is not one chunk of the {tokens} tokens in {chunks} chunks",
                    a.rows
                )))
            }
            None if a.rows != c.rows => {
                return Err(self.mismatch(format!(
                    "grouped gemm: without a gather a's rows are c's ({} vs {})",
                    a.rows, c.rows
                )))
            }
            _ => {}
        }
        Ok(())
    }

    /// A combine: f32 weights and a u32 row table of one shape, rows of out's width.
    fn combine(&self, op: &Op) -> Result<(), PlanError> {
        let Op::Combine { rows, weights, inv, out } = op else { unreachable!("dispatched on its variant") };
        self.region(rows)?;
        let w = self.region(weights)?;
        let i = self.region(inv)?;
        self.region(out)?;
        if w.dtype != DType::F32 || i.dtype != DType::U32 {
            return Err(self.mismatch(format!(
                "combine: weights are {} and the row table {}, expected f32 and u32",
                w.dtype, i.dtype
            )));
        }
        if (weights.rows, weights.cols) != (inv.rows, inv.cols) || out.rows != inv.rows || out.cols != rows.cols {
            return Err(self.mismatch(format!(
                "combine: weights {}x{}, row table {}x{}, rows of {} columns into {}x{}",
                weights.rows, weights.cols, inv.rows, inv.cols, rows.cols, out.rows, out.cols
            )));
        }
        Ok(())
    }

    /// A signal: to a device and a semaphore that exist.
    fn signal(&self, op: &Op) -> Result<(), PlanError> {
        let Op::Signal { device: d, sem: s, .. } = op else { unreachable!("dispatched on its variant") };
        self.device(*d)?;
        self.sem(*s)?;
        Ok(())
    }

    /// A wait: on a semaphore that exists.
    fn wait(&self, op: &Op) -> Result<(), PlanError> {
        let Op::Wait { sem: s, .. } = op else { unreachable!("dispatched on its variant") };
        self.sem(*s)?;
        Ok(())
    }
}
