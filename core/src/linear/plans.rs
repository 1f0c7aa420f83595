//! Plans of the linear family, built from the ring collectives of the 1D family.
//!
//! Per micro-batch j every collective has its own scratch and semaphores (`G_x.j`,
//! `ag_x.j`, …), so nothing is reused across micro-batches and no back-pressure is
//! needed. Each `main_grad` is an accumulator buffer (generated, updated in place, read
//! back): the wgrad GEMMs add into it (beta = 1), micro-batch after micro-batch.
//!
//! | algorithm | lanes | collectives |
//! |---|---|---|
//! | baseline | main (+ sum) | each AllGather, ReduceScatter or AllReduce whole, then the GEMMs that need it; no overlap of GEMM and communication (a ReduceScatter's sums on the `sum` lane, beside its copies, on blocks from 2 MiB: [`BaselineSums`]) |
//! | megatron | compute, comm (+ sum) | on the comm lane (sums as the baseline's); the AllGather of X (in the backward, again) starts before the dgrad GEMM, and the dgrad ReduceScatter/AllReduce runs while the wgrad GEMM does; the forward as the baseline |
//! | ring | compute, comm, comm_rs | AllGathers overlapped block by block with the GEMMs of arrived blocks (AG+GEMM), ReduceScatters step by step with the GEMM of the next block (GEMM+RS) |

use std::collections::HashMap;

use super::{Layer, LinearAlgorithm, LinearProblem, Pass, Tensor};
use crate::algorithms::ring::{
    copy, ring_all_gather, ring_reduce_scatter, signal, wait, OverlappedReduce, Ring, SumLane, SumSlots, SummingBeside,
};
use crate::algorithms::BaselineSums;
use crate::dtype::DType;
use crate::plan::{BufId, BufferRole, LaneId, Op, Plan, PlanBuilder, PlanError, Pointwise, Region, SemId};
use crate::problem::Window;

/// `c (+)= op(a)·op(b)`.
fn gemm(a: Region, b: Region, c: Region, trans_a: bool, trans_b: bool, accumulate: bool) -> Op {
    Op::Gemm { a, b, c, trans_a, trans_b, accumulate, fused: None, c_device: None }
}

/// Rows `[r·rows/n, (r+1)·rows/n)` of a region.
fn block(r: Region, index: usize, n: usize) -> Region {
    let rows = r.rows / n;
    Region { offset: r.offset + index * rows * r.stride, rows, ..r }
}

/// A gathered buffer of one micro-batch: its n row blocks and its semaphore.
struct Gathered {
    sem: SemId,
    whole: Region,
}

/// A partial to reduce: the f32 scratch and the ring's slots and semaphores.
struct Reduction {
    /// The whole f32 partial (whole reductions) or one block of it (ring).
    part: Region,
    recv: Vec<Region>,
    send: Vec<Region>,
    sem: SemId,
    ready: SemId,
    /// The AllGather semaphore completing an AllReduce.
    ar: Option<SemId>,
    /// `{name}.{j}`, naming the reduction's other semaphores.
    key: String,
}

struct Builder<'p> {
    p: &'p LinearProblem,
    alg: LinearAlgorithm,
    b: PlanBuilder,
    n: usize,
    compute: LaneId,
    comm: LaneId,
    comm_rs: LaneId,
    /// The lane of the whole ReduceScatters' sums, once one needs it.
    sum: Option<LaneId>,
    /// Scratch buffers and semaphores by name: symmetric, so the first device to ask
    /// declares them and the others reuse them.
    buffers: HashMap<String, BufId>,
    semaphores: HashMap<String, SemId>,
}

impl Builder<'_> {
    /// The buffer of input `t`: an input, or for a main_grad an accumulator.
    fn input(&mut self, t: Tensor) -> BufId {
        let decl = self.p.tensor(t);
        let w = self.p.input_window(t, 0);
        let origins = (0..self.n)
            .map(|d| {
                let w = self.p.input_window(t, d);
                (w.row0, w.col0)
            })
            .collect();
        let role = match t {
            Tensor::Grad1 | Tensor::Grad2 => {
                BufferRole::Accumulator { tensor: decl.id, global_cols: decl.cols, origins }
            }
            _ => BufferRole::Input { tensor: decl.id, global_cols: decl.cols, origins },
        };
        self.b.buffer(&decl.name, decl.dtype, w.rows, w.cols, role)
    }

    fn scratch(&mut self, name: &str, dtype: DType, rows: usize, cols: usize) -> Region {
        let buf = match self.buffers.get(name) {
            Some(&buf) => buf,
            None => {
                let buf = self.b.buffer(name, dtype, rows, cols, BufferRole::Scratch);
                self.buffers.insert(name.to_string(), buf);
                buf
            }
        };
        self.b.whole(buf)
    }

    fn semaphore(&mut self, name: &str) -> SemId {
        match self.semaphores.get(name) {
            Some(&sem) => sem,
            None => {
                let sem = self.b.semaphore(name);
                self.semaphores.insert(name.to_string(), sem);
                sem
            }
        }
    }

    fn push(&mut self, d: usize, lane: LaneId, op: Op) {
        self.b.push(d, lane, op);
    }

    /// A buffer of S rows to gather micro-batch j's shards into.
    fn gathered(&mut self, name: &str, j: usize, cols: usize) -> Gathered {
        let whole = self.scratch(&format!("G_{name}.{j}"), self.p.dtype, self.p.tokens, cols);
        let sem = self.semaphore(&format!("ag_{name}.{j}"));
        Gathered { sem, whole }
    }

    /// Device d's whole AllGather of `own` into `g`: the own block copied on the compute
    /// lane, the ring passes on `comm`, then the compute lane waits for every block.
    fn gather_whole(&mut self, d: usize, comm: LaneId, own: Region, g: &Gathered) {
        let (n, compute) = (self.n, self.compute);
        let blocks: Vec<Region> = (0..n).map(|r| block(g.whole, r, n)).collect();
        self.push(d, compute, copy(own, d, blocks[d]));
        ring_all_gather(&mut self.b, &Ring::all(n, d), comm, g.sem, 0, own, &blocks);
        if n > 1 {
            self.push(d, compute, wait(g.sem, (n - 1) as u32));
        }
    }

    /// Device d's AllGather overlapped with per-block work: the ring passes on `comm`;
    /// the compute lane calls `on_block(b, r, block)` for r = d, d+1, … as each arrives.
    fn gather_blocks(
        &mut self,
        d: usize,
        comm: LaneId,
        own: Region,
        g: &Gathered,
        on_block: &mut dyn FnMut(&mut PlanBuilder, usize, Region),
    ) {
        let (n, compute) = (self.n, self.compute);
        let blocks: Vec<Region> = (0..n).map(|r| block(g.whole, r, n)).collect();
        ring_all_gather(&mut self.b, &Ring::all(n, d), comm, g.sem, 0, own, &blocks);
        for i in 0..n {
            let r = (d + i) % n;
            let src = if i == 0 {
                own
            } else {
                self.push(d, compute, wait(g.sem, i as u32));
                blocks[r]
            };
            on_block(&mut self.b, r, src);
        }
    }

    /// Scratch and semaphores of a ReduceScatter of micro-batch j over S tokens and
    /// `cols` columns (`whole`: a full S-row partial; else one S/D-row block).
    fn reduction(&mut self, name: &str, j: usize, cols: usize, whole: bool, all_reduce: bool) -> Reduction {
        let (n, sb) = (self.n, self.p.tokens / self.n);
        let rows = if whole { self.p.tokens } else { sb };
        let part = self.scratch(&format!("P_{name}.{j}"), DType::F32, rows, cols);
        let slots = (n - 1).max(1) * sb;
        let recv_buf = self.scratch(&format!("recv_{name}.{j}"), DType::F32, slots, cols);
        let send_buf = self.scratch(&format!("send_{name}.{j}"), DType::F32, slots, cols);
        let slot = |r: Region, s: usize| Region { offset: r.offset + s * sb * r.stride, rows: sb, ..r };
        let recv = (0..n - 1).map(|s| slot(recv_buf, s)).collect();
        let send = (0..n - 1).map(|s| slot(send_buf, s)).collect();
        let key = format!("{name}.{j}");
        let sem = self.semaphore(&format!("rs_{key}"));
        let ready = self.semaphore(&format!("ready_{key}"));
        let ar = all_reduce.then(|| self.semaphore(&format!("ar_{key}")));
        Reduction { part, recv, send, sem, ready, ar, key }
    }

    /// Where device d's reduced block lands: `out` itself (ReduceScatter) or its block d
    /// (AllReduce, `out` holding all S rows).
    fn landing(&self, out: Region, r: &Reduction, d: usize) -> Region {
        if r.ar.is_some() {
            block(out, d, self.n)
        } else {
            out
        }
    }

    /// The AllGather completing an AllReduce, on `lane`.
    fn finish_all_reduce(&mut self, d: usize, lane: LaneId, out: Region, r: &Reduction) {
        if let Some(ar) = r.ar {
            let n = self.n;
            let blocks: Vec<Region> = (0..n).map(|i| block(out, i, n)).collect();
            ring_all_gather(&mut self.b, &Ring::all(n, d), lane, ar, 0, blocks[d], &blocks);
            if n > 1 {
                self.push(d, lane, wait(ar, (n - 1) as u32));
            }
        }
    }

    /// Device d's whole ReduceScatter (AllReduce) of the partial `r.part`, written by
    /// the compute lane before, into `out`: the copies on `comm` (released by the compute
    /// lane when `comm` is another lane), and on large blocks the sums beside them on the
    /// `sum` lane, as a collective library pipelines them ([`BaselineSums`]).
    fn reduce_whole(&mut self, d: usize, comm: LaneId, out: Region, r: &Reduction) {
        let (n, s) = (self.n, self.p.tokens);
        let sums = BaselineSums::BySize.beside(n, s / n * out.cols * DType::F32.size_bytes()).then(|| {
            let lane = SumLane { lane: self.sum_lane(), summed: self.semaphore(&format!("summed_{}", r.key)) };
            SummingBeside::new(lane, r.ready, self.semaphore(&format!("reduced_{}", r.key)))
        });
        let compute = self.compute;
        if comm != compute {
            // With sums beside, the ReduceScatter signals `ready` itself.
            if sums.is_none() {
                self.push(d, compute, signal(d, r.ready));
            }
            self.push(d, comm, wait(r.ready, 1));
        }
        let parts: Vec<Region> = (0..n).map(|i| block(r.part, i, n)).collect();
        let window = Window { row0: 0, col0: 0, rows: s / n, cols: out.cols };
        let landing = self.landing(out, r, d);
        let slots = SumSlots { recv: &r.recv, send: &r.send };
        let ring = Ring::all(n, d);
        ring_reduce_scatter(&mut self.b, &ring, compute, comm, r.sem, &parts, slots, &[(window, landing)], sums);
        self.finish_all_reduce(d, comm, out, r);
    }

    /// The lane the whole ReduceScatters add up on, declared at its first use.
    fn sum_lane(&mut self) -> LaneId {
        *self.sum.get_or_insert_with(|| self.b.lane("sum"))
    }

    /// Device d's ReduceScatter (AllReduce) overlapped step by step (the GEMM+RS ring):
    /// step s of the compute lane writes the partial of block (d+s+1)%D with `partial`,
    /// then `between(s)` runs (other work to interleave), and `comm_rs` passes the sums.
    fn reduce_ring(
        &mut self,
        d: usize,
        out: Region,
        r: &Reduction,
        partial: &mut dyn FnMut(&mut PlanBuilder, usize, Region),
        between: &mut dyn FnMut(&mut Self, usize),
    ) {
        let n = self.n;
        let ring = OverlappedReduce {
            me: d,
            peer: (d + n - 1) % n,
            n,
            ready: r.ready,
            recv: r.sem,
            comm: self.comm_rs,
            part: r.part,
            send: r.send.clone(),
            recv_slots: r.recv.clone(),
        };
        let landing = self.landing(out, r, d);
        for s in 0..n {
            let blk = (d + s + 1) % n;
            ring.compute_step(&mut self.b, self.compute, s, landing, &mut |b, dst| partial(b, blk, dst));
            between(self, s);
        }
        ring.comm(&mut self.b);
        if r.ar.is_some() {
            // The last reduce (compute lane) releases the AllGather (comm_rs lane).
            let done = self.semaphore(&format!("done_{}", self.b.decl(r.part.buf).name));
            self.push(d, self.compute, signal(d, done));
            self.push(d, self.comm_rs, wait(done, 1));
            self.finish_all_reduce(d, self.comm_rs, out, r);
        }
    }
}

/// The buffers of a problem, per micro-batch where they differ.
struct Io {
    w1: BufId,
    w2: Option<BufId>,
    x: Vec<BufId>,
    dy: Vec<BufId>,
    /// Output buffers by name.
    outputs: Vec<(&'static str, BufId)>,
}

impl Io {
    fn output(&self, name: &str) -> BufId {
        self.outputs.iter().find(|(n, _)| *n == name).map(|(_, b)| *b).expect("an output of the problem")
    }
}

/// A lower bound of the ops of every plan of `p` ([`crate::plan::check_op_bound`]): a
/// GEMM per device and micro-batch; with sequence parallelism X (or Y) also travels
/// between every pair of devices.
pub(crate) fn min_ops(p: &LinearProblem) -> u128 {
    let (d, mb) = (p.devices as u128, p.microbatches as u128);
    if p.sp {
        mb * d * (d - 1)
    } else {
        mb * d
    }
}

/// Builds the plan of `alg` for `p`.
pub fn build_linear_plan(p: &LinearProblem, alg: LinearAlgorithm) -> Result<Plan, PlanError> {
    let n = p.devices;
    crate::plan::check_op_bound(|| format!("linear/{alg} {}", p.describe()), min_ops(p))?;
    let mut b = PlanBuilder::new(format!("linear/{alg} {}", p.describe()), n);
    let (compute, comm, comm_rs) = match alg {
        LinearAlgorithm::Baseline => {
            let main = b.lane("main");
            (main, main, main)
        }
        LinearAlgorithm::Megatron => {
            let compute = b.lane("compute");
            (compute, b.lane("comm"), compute)
        }
        LinearAlgorithm::Ring => (b.lane("compute"), b.lane("comm"), b.lane("comm_rs")),
    };
    let mut lb = Builder {
        p,
        alg,
        b,
        n,
        compute,
        comm,
        comm_rs,
        sum: None,
        buffers: HashMap::new(),
        semaphores: HashMap::new(),
    };
    let mb = p.microbatches;
    let w1 = lb.input(Tensor::W1);
    let w2 = (p.layer == Layer::Mlp).then(|| lb.input(Tensor::W2));
    let x: Vec<BufId> = (0..mb).map(|j| lb.input(Tensor::X(j))).collect();
    let dy: Vec<BufId> = if p.backward() { (0..mb).map(|j| lb.input(Tensor::DY(j))).collect() } else { Vec::new() };
    let outputs: Vec<(&'static str, BufId)> = p
        .outputs()
        .into_iter()
        .map(|(name, dtype, rows, cols)| {
            let buf = match name {
                "main_grad" | "main_grad1" => lb.input(Tensor::Grad1),
                "main_grad2" => lb.input(Tensor::Grad2),
                _ => lb.b.buffer(name, dtype, rows, cols, BufferRole::Output),
            };
            (name, buf)
        })
        .collect();
    let io = Io { w1, w2, x, dy, outputs };
    for d in 0..n {
        for j in 0..mb {
            match (p.layer, p.pass) {
                (Layer::Column, Pass::Forward) => column_forward(&mut lb, &io, d, j),
                (Layer::Row, Pass::Forward) => row_forward(&mut lb, &io, d, j),
                (Layer::Column, _) => column_backward(&mut lb, &io, d, j),
                (Layer::Row, _) => row_backward(&mut lb, &io, d, j),
                (Layer::Mlp, _) => mlp_train(&mut lb, &io, d, j),
            }
        }
    }
    lb.b.finish()
}

/// Y_j (S × F/D) = AG(X_j)·W_d, or X_j·W_d without SP.
fn column_forward(lb: &mut Builder, io: &Io, d: usize, j: usize) {
    let (p, n, s) = (lb.p, lb.n, lb.p.tokens);
    let (x, w) = (lb.b.whole(io.x[j]), lb.b.whole(io.w1));
    let y = lb.b.rows(io.output("Y"), j * s, s);
    if !p.sp {
        lb.push(d, lb.compute, gemm(x, w, y, false, false, false));
        return;
    }
    let g = lb.gathered("x", j, p.hidden);
    match lb.alg {
        LinearAlgorithm::Ring => {
            let compute = lb.compute;
            lb.gather_blocks(d, lb.comm, x, &g, &mut |b, r, src| {
                b.push(d, compute, gemm(src, w, block(y, r, n), false, false, false))
            })
        }
        _ => {
            lb.gather_whole(d, lb.comm, x, &g);
            lb.push(d, lb.compute, gemm(g.whole, w, y, false, false, false));
        }
    }
}

/// Y = RS(X_d·W_d) (S/D × F per micro-batch), or the AllReduce without SP (S × F).
fn row_forward(lb: &mut Builder, io: &Io, d: usize, j: usize) {
    let (p, n, s) = (lb.p, lb.n, lb.p.tokens);
    let (x, w) = (lb.b.whole(io.x[j]), lb.b.whole(io.w1));
    let y = if p.sp { lb.b.rows(io.output("Y"), j * s / n, s / n) } else { lb.b.rows(io.output("Y"), j * s, s) };
    let ring = lb.alg == LinearAlgorithm::Ring;
    let compute = lb.compute;
    let r = lb.reduction("y", j, p.ffn, !ring, !p.sp);
    if ring {
        lb.reduce_ring(
            d,
            y,
            &r,
            &mut |b, blk, dst| b.push(d, compute, gemm(block(x, blk, n), w, dst, false, false, false)),
            &mut |_, _| {},
        );
    } else {
        lb.push(d, lb.compute, gemm(x, w, r.part, false, false, false));
        lb.reduce_whole(d, lb.comm, y, &r);
    }
}

/// dX = RS(dY_d·W_dᵀ) (AllReduce without SP); main_grad_d += AG(X)ᵀ·dY_d.
fn column_backward(lb: &mut Builder, io: &Io, d: usize, j: usize) {
    let (p, n, s) = (lb.p, lb.n, lb.p.tokens);
    let (x, w, dy) = (lb.b.whole(io.x[j]), lb.b.whole(io.w1), lb.b.whole(io.dy[j]));
    let grad = lb.b.whole(io.output("main_grad"));
    let dx = if p.sp { lb.b.rows(io.output("dX"), j * s / n, s / n) } else { lb.b.rows(io.output("dX"), j * s, s) };
    let compute = lb.compute;
    match lb.alg {
        LinearAlgorithm::Ring => {
            let r = lb.reduction("dx", j, p.hidden, false, !p.sp);
            let g = p.sp.then(|| lb.gathered("x", j, p.hidden));
            // The X blocks travel on the comm lane while the dgrad ring runs; step s
            // also accumulates the wgrad of the X block that arrived s-th.
            if let Some(g) = &g {
                ring_all_gather(&mut lb.b, &Ring::all(n, d), lb.comm, g.sem, 0, x, &blocks_of(g.whole, n));
            }
            lb.reduce_ring(
                d,
                dx,
                &r,
                &mut |b, blk, dst| b.push(d, compute, gemm(block(dy, blk, n), w, dst, false, true, false)),
                &mut |lb, step| {
                    if let Some(g) = &g {
                        let blk = (d + step) % n;
                        let src = if step == 0 {
                            x
                        } else {
                            lb.push(d, compute, wait(g.sem, step as u32));
                            block(g.whole, blk, n)
                        };
                        lb.push(d, compute, gemm(src, block(dy, blk, n), grad, true, false, true));
                    }
                },
            );
            if !p.sp {
                lb.push(d, compute, gemm(x, dy, grad, true, false, true));
            }
        }
        alg => {
            let r = lb.reduction("dx", j, p.hidden, true, !p.sp);
            let g = p.sp.then(|| lb.gathered("x", j, p.hidden));
            let comm = if alg == LinearAlgorithm::Megatron { lb.comm } else { compute };
            if let Some(g) = &g {
                if alg == LinearAlgorithm::Megatron {
                    // Launched first: the gather runs while the dgrad GEMM does.
                    lb.push(d, compute, copy(x, d, block(g.whole, d, n)));
                    ring_all_gather(&mut lb.b, &Ring::all(n, d), comm, g.sem, 0, x, &blocks_of(g.whole, n));
                } else {
                    lb.gather_whole(d, comm, x, g);
                }
            }
            lb.push(d, compute, gemm(dy, w, r.part, false, true, false));
            // The dgrad reduction (comm lane) runs while the wgrad GEMM does.
            lb.reduce_whole(d, comm, dx, &r);
            let src = match &g {
                Some(g) => {
                    if alg == LinearAlgorithm::Megatron && n > 1 {
                        lb.push(d, compute, wait(g.sem, (n - 1) as u32));
                    }
                    g.whole
                }
                None => x,
            };
            lb.push(d, compute, gemm(src, dy, grad, true, false, true));
        }
    }
}

/// dX_d = AG(dY)·W_dᵀ (S × H/D); main_grad_d += X_dᵀ·AG(dY).
fn row_backward(lb: &mut Builder, io: &Io, d: usize, j: usize) {
    let (p, n, s) = (lb.p, lb.n, lb.p.tokens);
    let (x, w, dy) = (lb.b.whole(io.x[j]), lb.b.whole(io.w1), lb.b.whole(io.dy[j]));
    let grad = lb.b.whole(io.output("main_grad"));
    let dx = lb.b.rows(io.output("dX"), j * s, s);
    let compute = lb.compute;
    if !p.sp {
        lb.push(d, compute, gemm(dy, w, dx, false, true, false));
        lb.push(d, compute, gemm(x, dy, grad, true, false, true));
        return;
    }
    let g = lb.gathered("dy", j, p.ffn);
    match lb.alg {
        LinearAlgorithm::Ring => lb.gather_blocks(d, lb.comm, dy, &g, &mut |b, r, src| {
            b.push(d, compute, gemm(src, w, block(dx, r, n), false, true, false));
            b.push(d, compute, gemm(block(x, r, n), src, grad, true, false, true));
        }),
        _ => {
            lb.gather_whole(d, lb.comm, dy, &g);
            lb.push(d, compute, gemm(g.whole, w, dx, false, true, false));
            lb.push(d, compute, gemm(x, g.whole, grad, true, false, true));
        }
    }
}

/// One micro-batch of the MLP block, forward then backward.
fn mlp_train(lb: &mut Builder, io: &Io, d: usize, j: usize) {
    let (p, n, s) = (lb.p, lb.n, lb.p.tokens);
    let (fd, h) = (p.ffn / n, p.hidden);
    let w2 = io.w2.expect("the MLP has W2");
    let (x, w1, w2, dy) = (lb.b.whole(io.x[j]), lb.b.whole(io.w1), lb.b.whole(w2), lb.b.whole(io.dy[j]));
    let y = lb.b.rows(io.output("Y"), j * s / n, s / n);
    let dx = lb.b.rows(io.output("dX"), j * s / n, s / n);
    let (grad1, grad2) = (lb.b.whole(io.output("main_grad1")), lb.b.whole(io.output("main_grad2")));
    let dtype = p.dtype;
    let z = lb.scratch(&format!("Z.{j}"), dtype, s, fd);
    let a = lb.scratch(&format!("A.{j}"), dtype, s, fd);
    let da = lb.scratch(&format!("dA.{j}"), dtype, s, fd);
    let dz = lb.scratch(&format!("dZ.{j}"), dtype, s, fd);
    let compute = lb.compute;
    let gelu = |x: Region, out: Region| Op::Pointwise { function: Pointwise::Gelu, inputs: vec![x], output: out };
    let gelu_grad = |g: Region, x: Region, out: Region| Op::Pointwise {
        function: Pointwise::GeluGrad,
        inputs: vec![g, x],
        output: out,
    };
    let gx = lb.gathered("x", j, h);
    let gdy = lb.gathered("dy", j, h);
    let gx2 = lb.gathered("x_again", j, h);
    match lb.alg {
        LinearAlgorithm::Ring => {
            // Forward: Z and A block by block as X arrives, then Y by the GEMM+RS ring.
            lb.gather_blocks(d, lb.comm, x, &gx, &mut |b, r, src| {
                b.push(d, compute, gemm(src, w1, block(z, r, n), false, false, false));
                b.push(d, compute, gelu(block(z, r, n), block(a, r, n)));
            });
            let ry = lb.reduction("y", j, h, false, false);
            lb.reduce_ring(
                d,
                y,
                &ry,
                &mut |b, blk, dst| b.push(d, compute, gemm(block(a, blk, n), w2, dst, false, false, false)),
                &mut |_, _| {},
            );
            // Backward: dA, main_grad2 and dZ block by block as dY arrives; then dX by
            // the GEMM+RS ring, each step also adding the wgrad of the X block that
            // arrived again.
            lb.gather_blocks(d, lb.comm, dy, &gdy, &mut |b, r, src| {
                b.push(d, compute, gemm(src, w2, block(da, r, n), false, true, false));
                b.push(d, compute, gemm(block(a, r, n), src, grad2, true, false, true));
                b.push(d, compute, gelu_grad(block(da, r, n), block(z, r, n), block(dz, r, n)));
            });
            ring_all_gather(&mut lb.b, &Ring::all(n, d), lb.comm, gx2.sem, 0, x, &blocks_of(gx2.whole, n));
            let rdx = lb.reduction("dx", j, h, false, false);
            lb.reduce_ring(
                d,
                dx,
                &rdx,
                &mut |b, blk, dst| b.push(d, compute, gemm(block(dz, blk, n), w1, dst, false, true, false)),
                &mut |lb, step| {
                    let blk = (d + step) % n;
                    let src = if step == 0 {
                        x
                    } else {
                        lb.push(d, compute, wait(gx2.sem, step as u32));
                        block(gx2.whole, blk, n)
                    };
                    lb.push(d, compute, gemm(src, block(dz, blk, n), grad1, true, false, true));
                },
            );
        }
        alg => {
            let comm = lb.comm;
            // Forward, not overlapped.
            lb.gather_whole(d, comm, x, &gx);
            lb.push(d, compute, gemm(gx.whole, w1, z, false, false, false));
            lb.push(d, compute, gelu(z, a));
            let ry = lb.reduction("y", j, h, true, false);
            lb.push(d, compute, gemm(a, w2, ry.part, false, false, false));
            lb.reduce_whole(d, comm, y, &ry);
            // Backward of the row layer: gather dY, dgrad, wgrad.
            lb.gather_whole(d, comm, dy, &gdy);
            if alg == LinearAlgorithm::Megatron {
                // The column layer's gather of X starts now, behind dY's, and runs
                // while the row layer's GEMMs and the GeLU backward do.
                lb.push(d, compute, copy(x, d, block(gx2.whole, d, n)));
                ring_all_gather(&mut lb.b, &Ring::all(n, d), comm, gx2.sem, 0, x, &blocks_of(gx2.whole, n));
            }
            lb.push(d, compute, gemm(gdy.whole, w2, da, false, true, false));
            lb.push(d, compute, gemm(a, gdy.whole, grad2, true, false, true));
            lb.push(d, compute, gelu_grad(da, z, dz));
            if alg != LinearAlgorithm::Megatron {
                lb.gather_whole(d, comm, x, &gx2);
            }
            // Backward of the column layer: dgrad, its ReduceScatter beside the wgrad.
            let rdx = lb.reduction("dx", j, h, true, false);
            lb.push(d, compute, gemm(dz, w1, rdx.part, false, true, false));
            lb.reduce_whole(d, comm, dx, &rdx);
            if alg == LinearAlgorithm::Megatron && n > 1 {
                lb.push(d, compute, wait(gx2.sem, (n - 1) as u32));
            }
            lb.push(d, compute, gemm(gx2.whole, dz, grad1, true, false, true));
        }
    }
}

/// The n row blocks of a region.
fn blocks_of(r: Region, n: usize) -> Vec<Region> {
    (0..n).map(|i| block(r, i, n)).collect()
}
