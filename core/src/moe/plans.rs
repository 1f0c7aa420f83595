//! Plans of the MoE family: the non-overlapped baselines and the ring (and chunked
//! ring) of both ops, built from [`Op::Route`], [`Op::GroupedGemm`] and
//! [`Op::Combine`] plus the copies and semaphores of the 1D ring.
//!
//! Overlap stays static although the work per expert is data: the route op groups each
//! expert's rows by token chunk (the tokens of one source device, or a sub-chunk of
//! them), so ring step i computes, for every expert, exactly the rows of the chunk that
//! has arrived (ag_moe) or that the running sum needs next (moe_rs), whatever the
//! router chose.
//!
//! Buffers per device: `X` or `H` and `W1` or `W2` (inputs), `ids` (and `weights`) from
//! the router, the tables `seg`, `perm`, `inv`, the outputs (`Y` and `perm`, or `C`),
//! and scratch: the gathered tokens `G` or ring slots `S` (ag_moe); the expert outputs
//! `P`, the combined partials and the ring's send/receive slots (moe_rs, f32).

use super::{MoeError, MoeOp, MoeProblem, RouterPart, TENSOR_H, TENSOR_W1, TENSOR_W2, TENSOR_X};
use crate::algorithms::ring::{
    copy, ring_all_gather, ring_reduce_scatter, slot_chunk, wait, ChunkedRing, OverlappedReduce, Ring, SumSlots,
    SummingBeside,
};
use crate::algorithms::{Algorithm, BaselineSums};
use crate::dtype::DType;
use crate::plan::{BufId, BufferRole, LaneId, Op, Plan, PlanBuilder, RouteTables};
use crate::problem::Window;

/// A lower bound of the ops of a plan of `p` whose ring moves each shard in `chunks`
/// pieces (1 for the baseline) ([`crate::plan::check_op_bound`]): tokens or partial
/// outputs travel between every pair of devices, piece by piece.
pub(crate) fn min_ops(p: &MoeProblem, chunks: usize) -> u128 {
    let d = p.devices as u128;
    d * (d - 1) * chunks as u128
}

/// The plan of `algorithm` (baseline, ring or ring_chunked) for `p`.
pub fn build_moe_plan(p: &MoeProblem, algorithm: Algorithm) -> Result<Plan, MoeError> {
    let chunks = match algorithm {
        Algorithm::Baseline => None,
        Algorithm::Ring => Some(1),
        Algorithm::RingChunked { chunks } => Some(chunks),
        other => return Err(MoeError::Algorithm { op: p.op, algorithm: other.to_string() }),
    };
    if let Some(c) = chunks {
        // Chunks split a device's tokens in tensor_split's order: none may be empty.
        if c == 0 || c > p.token_split().min() {
            return Err(MoeError::Chunks { op: p.op, tokens: p.token_split().min(), chunks: c });
        }
    }
    let name = format!("{}/{algorithm} D={} {}", p.op, p.devices, p.describe());
    crate::plan::check_op_bound(|| name.clone(), min_ops(p, chunks.unwrap_or(1)))?;
    let mut b = PlanBuilder::new(name, p.devices);
    // The ring's route cuts every device's tokens into its chunks; the baseline's has one.
    let io = Io::declare(&mut b, p, chunks.map_or((1, 1), |c| (c * p.devices, p.devices)));
    match (p.op, chunks) {
        (MoeOp::AgMoe, None) => ag_moe_baseline(&mut b, p, &io),
        (MoeOp::AgMoe, Some(c)) => ag_moe_ring(&mut b, p, &io, c),
        (MoeOp::MoeRs, None) => moe_rs_baseline(&mut b, p, &io),
        (MoeOp::MoeRs, Some(c)) => moe_rs_ring(&mut b, p, &io, c),
    }
    Ok(b.finish()?)
}

/// The buffers every MoE plan declares.
struct Io {
    /// X (ag_moe) or H (moe_rs).
    a: BufId,
    /// W1 or W2, experts stacked.
    w: BufId,
    /// The router's ids.
    ids: BufId,
    /// The router's weights (moe_rs).
    weights: Option<BufId>,
    /// The routing tables.
    tables: RouteTables,
    /// Y or C.
    out: BufId,
}

impl Io {
    /// Declares the buffers, the route's tables in `chunks` token chunks over `shards`
    /// shards.
    fn declare(b: &mut PlanBuilder, p: &MoeProblem, (chunks, shards): (usize, usize)) -> Io {
        let n = p.devices;
        let (tokens, fd, cap) = (p.token_split(), p.ffn_per_device(), p.capacity());
        let router = p.router();
        let table = |b: &mut PlanBuilder, name: &str, part| {
            b.buffer(name, if part == RouterPart::Ids { DType::U32 } else { DType::F32 }, p.tokens, p.slots, {
                BufferRole::Router { part, router }
            })
        };
        let input =
            |tensor, global_cols, origins: Vec<(usize, usize)>| BufferRole::Input { tensor, global_cols, origins };
        let (a, w, out) = match p.op {
            MoeOp::AgMoe => {
                let x = b.sharded_buffer(
                    "X",
                    p.input,
                    tokens.lens(),
                    p.hidden,
                    input(TENSOR_X, p.hidden, (0..n).map(|d| (tokens.start(d), 0)).collect()),
                );
                let w1 = b.buffer(
                    "W1",
                    p.input,
                    p.experts * p.hidden,
                    fd,
                    input(TENSOR_W1, p.ffn, (0..n).map(|d| (0, d * fd)).collect()),
                );
                (x, w1, b.buffer("Y", p.output, cap, fd, BufferRole::Output))
            }
            MoeOp::MoeRs => {
                let h = b.buffer("H", p.input, cap, fd, input(TENSOR_H, p.ffn, (0..n).map(|d| (0, d * fd)).collect()));
                let w2 = b.buffer(
                    "W2",
                    p.input,
                    p.experts * fd,
                    p.hidden,
                    input(TENSOR_W2, p.hidden, (0..n).map(|d| (d * p.experts * fd, 0)).collect()),
                );
                (h, w2, b.sharded_buffer("C", p.output, tokens.lens(), p.hidden, BufferRole::Output))
            }
        };
        let ids = table(b, "ids", RouterPart::Ids);
        let weights = (p.op == MoeOp::MoeRs).then(|| table(b, "weights", RouterPart::Weights));
        let seg = b.buffer("seg", DType::U32, 1, p.experts * chunks + 1, BufferRole::Scratch);
        // The permutation is part of ag_moe's result: which (token, slot) each row of Y is.
        let perm_role = if p.op == MoeOp::AgMoe { BufferRole::Output } else { BufferRole::Scratch };
        let perm = b.buffer("perm", DType::U32, cap, 1, perm_role);
        let inv = b.buffer("inv", DType::U32, p.tokens, p.slots, BufferRole::Scratch);
        let tables = RouteTables { seg: b.whole(seg), perm: b.whole(perm), inv: b.whole(inv), shards };
        Io { a, w, ids, weights, tables, out }
    }

    fn route(&self, b: &mut PlanBuilder, p: &MoeProblem, d: usize, lane: LaneId) {
        let ids = b.whole(self.ids);
        b.push(d, lane, Op::Route { ids, tables: self.tables, experts: p.experts });
    }

    /// The grouped GEMM of token chunk `chunk` (of the route's chunks).
    #[allow(clippy::too_many_arguments)]
    fn grouped(
        &self,
        b: &mut PlanBuilder,
        p: &MoeProblem,
        d: usize,
        lane: LaneId,
        a: crate::plan::Region,
        c: crate::plan::Region,
        chunk: usize,
        gather: Option<usize>,
        zero_unrouted: bool,
    ) {
        let bw = b.whole(self.w);
        b.push(
            d,
            lane,
            Op::GroupedGemm {
                a,
                b: bw,
                c,
                tables: self.tables,
                experts: p.experts,
                groups: 0..p.experts,
                chunk,
                gather,
                zero_unrouted,
            },
        );
    }
}

/// All-gather the tokens, route, one grouped GEMM over every token.
fn ag_moe_baseline(b: &mut PlanBuilder, p: &MoeProblem, io: &Io) {
    let (n, tokens) = (p.devices, p.token_split());
    let g = b.buffer("G", p.input, p.tokens, p.hidden, BufferRole::Scratch);
    let recv = b.semaphore("recv");
    let main = b.lane("main");
    let blocks: Vec<_> = (0..n).map(|r| b.rows(g, tokens.start(r), tokens.len(r))).collect();
    for d in 0..n {
        io.route(b, p, d, main);
        let x = b.rows(io.a, 0, tokens.len(d));
        b.push(d, main, copy(x, d, blocks[d]));
        ring_all_gather(b, &Ring::all(n, d), main, recv, 0, blocks[d], &blocks);
        if n > 1 {
            b.push(d, main, wait(recv, (n - 1) as u32));
        }
        let (all, y) = (b.whole(g), b.whole(io.out));
        io.grouped(b, p, d, main, all, y, 0, Some(0), true);
    }
}

/// Ring: at step i device d computes, for every expert, the rows of the tokens of
/// device (d+i)%D while the next shard travels; each shard moves as `c` sub-chunks with
/// a signal each (the route's chunks are the D·c sub-chunks).
fn ag_moe_ring(b: &mut PlanBuilder, p: &MoeProblem, io: &Io, c: usize) {
    let (n, tokens) = (p.devices, p.token_split());
    let s = b.buffer("S", p.input, (n - 1) * tokens.max(), p.hidden, BufferRole::Scratch);
    let ring = ChunkedRing { own: io.a, slots: s, shards: tokens, chunks: c, recv: b.semaphore("recv") };
    let compute = b.lane("compute");
    let comm = b.lane("comm");
    for d in 0..n {
        ring.forward(b, d, n, comm);
        io.route(b, p, d, compute);
        let y = b.whole(io.out);
        for i in 0..n {
            let blk = (d + i) % n;
            for j in 0..c {
                let a = ring.chunk(b, d, compute, i, j);
                let first = i == 0 && j == 0;
                let token0 = tokens.start(blk) + tokens.piece(blk, c, j).0;
                io.grouped(b, p, d, compute, a, y, blk * c + j, Some(token0), first);
            }
        }
    }
}

/// Route, grouped GEMM over every row, combine every token, then a ring ReduceScatter
/// (its sums beside its copies on large blocks, as the 1D baseline's: [`BaselineSums`]).
fn moe_rs_baseline(b: &mut PlanBuilder, p: &MoeProblem, io: &Io) {
    let (n, tokens) = (p.devices, p.token_split());
    let td = tokens.max();
    let rows = b.buffer("P", DType::F32, p.capacity(), p.hidden, BufferRole::Scratch);
    let partial = b.buffer("partial", DType::F32, p.tokens, p.hidden, BufferRole::Scratch);
    let send = b.buffer("send", DType::F32, (n - 1) * td, p.hidden, BufferRole::Scratch);
    let recv_buf = b.buffer("recv", DType::F32, (n - 1) * td, p.hidden, BufferRole::Scratch);
    let recv = b.semaphore("recv");
    let main = b.lane("main");
    let weights = io.weights.expect("moe_rs has weights");
    let parts: Vec<_> = (0..n).map(|r| b.rows(partial, tokens.start(r), tokens.len(r))).collect();
    let send_slots: Vec<_> = (0..n - 1).map(|s| b.rows(send, s * td, td)).collect();
    let recv_slots: Vec<_> = (0..n - 1).map(|s| b.rows(recv_buf, s * td, td)).collect();
    let sums =
        BaselineSums::BySize.beside(n, td * p.hidden * DType::F32.size_bytes()).then(|| SummingBeside::declare(b));
    let slots = SumSlots { recv: &recv_slots, send: &send_slots };
    for d in 0..n {
        io.route(b, p, d, main);
        let (h, pr) = (b.whole(io.a), b.whole(rows));
        io.grouped(b, p, d, main, h, pr, 0, None, false);
        let (w, out) = (b.whole(weights), b.whole(partial));
        b.push(d, main, Op::Combine { rows: pr, weights: w, inv: io.tables.inv, out });
        let whole = Window { row0: 0, col0: 0, rows: tokens.len(d), cols: p.hidden };
        let c = b.rows(io.out, 0, tokens.len(d));
        ring_reduce_scatter(b, &Ring::all(n, d), main, main, recv, &parts, slots, &[(whole, c)], sums);
    }
}

/// Ring: at step s device d computes the expert outputs and the combine of the tokens
/// of block (d+s+1)%D, adds the running sum from its right neighbour and sends it left;
/// with `c` sub-chunks every block travels as c pieces, each with its own semaphores.
fn moe_rs_ring(b: &mut PlanBuilder, p: &MoeProblem, io: &Io, c: usize) {
    let (n, tokens) = (p.devices, p.token_split());
    let td = tokens.max();
    let rows = b.buffer("P", DType::F32, p.capacity(), p.hidden, BufferRole::Scratch);
    let part = b.buffer("partial", DType::F32, td, p.hidden, BufferRole::Scratch);
    let send = b.buffer("send", DType::F32, (n - 1) * td, p.hidden, BufferRole::Scratch);
    let recv_buf = b.buffer("recv", DType::F32, (n - 1) * td, p.hidden, BufferRole::Scratch);
    let compute = b.lane("compute");
    let comm = b.lane("comm");
    let sems: Vec<_> = (0..c)
        .map(|j| {
            let tag = if c == 1 { String::new() } else { format!(".{j}") };
            (b.semaphore(&format!("ready{tag}")), b.semaphore(&format!("recv{tag}")))
        })
        .collect();
    let weights = io.weights.expect("moe_rs has weights");
    for d in 0..n {
        io.route(b, p, d, compute);
        let rings: Vec<OverlappedReduce> = sems
            .iter()
            .enumerate()
            .map(|(j, &(ready, recv))| {
                // Slot s holding chunk j of the block reduced at step `step(s)`.
                let slots = |buf, step: usize| {
                    (0..n - 1)
                        .map(|s| {
                            let (start, rows) = slot_chunk(tokens, (d + s + step + 1) % n, c, j);
                            b.rows(buf, s * td + start, rows)
                        })
                        .collect::<Vec<_>>()
                };
                let (start, rows) = slot_chunk(tokens, 0, c, j);
                OverlappedReduce {
                    me: d,
                    peer: (d + n - 1) % n,
                    n,
                    ready,
                    recv,
                    comm,
                    part: b.rows(part, start, rows),
                    send: slots(send, 0),
                    recv_slots: slots(recv_buf, 1),
                }
            })
            .collect();
        let (h, pr) = (b.whole(io.a), b.whole(rows));
        for s in 0..n {
            let blk = (d + s + 1) % n;
            for (j, ring) in rings.iter().enumerate() {
                let (start, rows) = tokens.piece(blk, c, j);
                let first = tokens.start(blk) + start;
                let (w, inv) = (b.rows(weights, first, rows), sub_rows(io.tables.inv, first, rows));
                // Used at s = D−1 only, where blk is d.
                let out = b.rows(io.out, start, rows);
                ring.compute_step(b, compute, s, out, &mut |b, dst| {
                    io.grouped(b, p, d, compute, h, pr, blk * c + j, None, false);
                    b.push(d, compute, Op::Combine { rows: pr, weights: w, inv, out: dst });
                });
            }
        }
        for s in 0..n - 1 {
            for ring in &rings {
                ring.comm_step(b, s);
            }
        }
    }
}

/// Rows `[row0, row0 + rows)` of a whole-buffer region.
fn sub_rows(r: crate::plan::Region, row0: usize, rows: usize) -> crate::plan::Region {
    crate::plan::Region { offset: r.offset + row0 * r.stride, rows, ..r }
}
