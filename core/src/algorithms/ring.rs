//! The 1D ring family (BRIEF §4) and the non-overlapped baselines.

use super::{input_buffer, output_buffer, Algorithm, AlgorithmError};
use crate::dtype::DType;
use crate::plan::{BufId, BufferRole, Engine, LaneId, Op, Plan, PlanBuilder, Region, SemId};
use crate::problem::{OpKind, Problem};

fn left(d: usize, n: usize) -> usize {
    (d + n - 1) % n
}

fn right(d: usize, n: usize) -> usize {
    (d + 1) % n
}

fn gemm(a: Region, b: Region, c: Region) -> Op {
    Op::Gemm { a, b, c, trans_a: false, trans_b: false, accumulate: false }
}

fn copy(src: Region, dst_device: usize, dst: Region) -> Op {
    Op::Copy { src, dst_device, dst, engine: Engine::CopyEngine }
}

fn signal(device: usize, sem: SemId) -> Op {
    Op::Signal { device, sem, add: 1 }
}

fn wait(sem: SemId, value: u32) -> Op {
    Op::Wait { sem, value }
}

fn plan_name(p: &Problem, algorithm: Algorithm) -> String {
    format!("{}/{} D={} {}", p.op, algorithm, p.devices, p.shape_string())
}

/// AG+GEMM, unidirectional ring. At step i device d multiplies the shard of device
/// (d+i)%D and forwards it to (d−1)%D into scratch slot i; each shard travels as
/// `chunks` row chunks, each with its own signal, so the consumer can start on the
/// first chunk early. Scratch has D−1 slots, so no slot is ever reused.
pub(super) fn ag_gemm_ring(p: &Problem, algorithm: Algorithm, chunks: usize) -> Result<Plan, AlgorithmError> {
    let n = p.devices;
    let ms = p.m / n;
    if chunks == 0 || ms % chunks != 0 {
        return Err(AlgorithmError::Indivisible {
            algorithm,
            what: "per-shard rows M/D",
            size: ms,
            param: "chunks",
            by: chunks,
        });
    }
    let cr = ms / chunks;
    let mut b = PlanBuilder::new(plan_name(p, algorithm), n);
    let a = input_buffer(&mut b, p, 0);
    let bm = input_buffer(&mut b, p, 1);
    let c = output_buffer(&mut b, p);
    let s = b.buffer("S", p.input, (n - 1) * ms, p.k, BufferRole::Scratch);
    let recv = b.semaphore("recv");
    let compute = b.lane("compute");
    let comm = b.lane("comm");
    let arrived = |step: usize, chunk: usize| ((step - 1) * chunks + chunk + 1) as u32;
    for d in 0..n {
        let to = left(d, n);
        for i in 0..n - 1 {
            for j in 0..chunks {
                let src = if i == 0 {
                    b.rows(a, j * cr, cr)
                } else {
                    b.push(d, comm, wait(recv, arrived(i, j)));
                    b.rows(s, (i - 1) * ms + j * cr, cr)
                };
                let dst = b.rows(s, i * ms + j * cr, cr);
                b.push(d, comm, copy(src, to, dst));
                b.push(d, comm, signal(to, recv));
            }
        }
        let whole_b = b.whole(bm);
        let own = b.rows(c, d * ms, ms);
        let whole_a = b.whole(a);
        b.push(d, compute, gemm(whole_a, whole_b, own));
        for i in 1..n {
            let blk = (d + i) % n;
            for j in 0..chunks {
                b.push(d, compute, wait(recv, arrived(i, j)));
                let src = b.rows(s, (i - 1) * ms + j * cr, cr);
                let dst = b.rows(c, blk * ms + j * cr, cr);
                b.push(d, compute, gemm(src, whole_b, dst));
            }
        }
    }
    Ok(b.finish()?)
}

/// AG+GEMM, bidirectional ring: shards from the right travel leftwards and shards from
/// the left travel rightwards, so the D−1 remote shards arrive in ⌈(D−1)/2⌉ rounds.
pub(super) fn ag_gemm_bidir(p: &Problem) -> Result<Plan, AlgorithmError> {
    let n = p.devices;
    let ms = p.m / n;
    let from_right = n / 2; // ⌈(D−1)/2⌉
    let from_left = (n - 1) / 2; // ⌊(D−1)/2⌋
    let mut b = PlanBuilder::new(plan_name(p, Algorithm::RingBidir), n);
    let a = input_buffer(&mut b, p, 0);
    let bm = input_buffer(&mut b, p, 1);
    let c = output_buffer(&mut b, p);
    let s = b.buffer("S", p.input, (n - 1) * ms, p.k, BufferRole::Scratch);
    let recv_r = b.semaphore("recv_from_right");
    let recv_l = b.semaphore("recv_from_left");
    let compute = b.lane("compute");
    let comm_left = b.lane("comm_left");
    let comm_right = b.lane("comm_right");
    for d in 0..n {
        // Leftward flow into slots [0, from_right), rightward flow into the rest.
        for (lane, count, base, sem, to) in
            [(comm_left, from_right, 0, recv_r, left(d, n)), (comm_right, from_left, from_right, recv_l, right(d, n))]
        {
            for j in 0..count {
                let src = if j == 0 {
                    b.whole(a)
                } else {
                    b.push(d, lane, wait(sem, j as u32));
                    b.rows(s, (base + j - 1) * ms, ms)
                };
                let dst = b.rows(s, (base + j) * ms, ms);
                b.push(d, lane, copy(src, to, dst));
                b.push(d, lane, signal(to, sem));
            }
        }
        let whole_b = b.whole(bm);
        let (whole_a, own) = (b.whole(a), b.rows(c, d * ms, ms));
        b.push(d, compute, gemm(whole_a, whole_b, own));
        for r in 1..=from_right {
            b.push(d, compute, wait(recv_r, r as u32));
            let (src, dst) = (b.rows(s, (r - 1) * ms, ms), b.rows(c, ((d + r) % n) * ms, ms));
            b.push(d, compute, gemm(src, whole_b, dst));
            if r <= from_left {
                b.push(d, compute, wait(recv_l, r as u32));
                let src = b.rows(s, (from_right + r - 1) * ms, ms);
                let dst = b.rows(c, ((d + n - r) % n) * ms, ms);
                b.push(d, compute, gemm(src, whole_b, dst));
            }
        }
    }
    Ok(b.finish()?)
}

/// AG+GEMM baseline: ring AllGather of A into a gathered buffer, then one GEMM.
pub(super) fn ag_gemm_baseline(p: &Problem) -> Result<Plan, AlgorithmError> {
    let n = p.devices;
    let ms = p.m / n;
    let mut b = PlanBuilder::new(plan_name(p, Algorithm::Baseline), n);
    let a = input_buffer(&mut b, p, 0);
    let bm = input_buffer(&mut b, p, 1);
    let c = output_buffer(&mut b, p);
    let g = b.buffer("G", p.input, p.m, p.k, BufferRole::Scratch);
    let recv = b.semaphore("recv");
    let main = b.lane("main");
    for d in 0..n {
        let (src, dst) = (b.whole(a), b.rows(g, d * ms, ms));
        b.push(d, main, copy(src, d, dst));
        ring_all_gather(&mut b, d, main, g, ms, recv);
        let (whole_g, whole_b, whole_c) = (b.whole(g), b.whole(bm), b.whole(c));
        b.push(d, main, gemm(whole_g, whole_b, whole_c));
    }
    Ok(b.finish()?)
}

/// Ring AllGather of the row blocks of `buf` (block d already in place on device d):
/// at iteration i device d forwards block (d+i)%D to its left neighbour, then waits
/// until all D−1 remote blocks have arrived.
fn ring_all_gather(b: &mut PlanBuilder, d: usize, lane: LaneId, buf: BufId, rows: usize, sem: SemId) {
    let n = b.devices();
    for i in 0..n - 1 {
        if i > 0 {
            b.push(d, lane, wait(sem, i as u32));
        }
        let blk = (d + i) % n;
        let region = b.rows(buf, blk * rows, rows);
        b.push(d, lane, copy(region, left(d, n), region));
        b.push(d, lane, signal(left(d, n), sem));
    }
    if n > 1 {
        b.push(d, lane, wait(sem, (n - 1) as u32));
    }
}

/// Buffers and semaphores of one ring ReduceScatter direction.
struct RsDirection {
    /// Column window [col0, col0 + cols) of C this direction reduces.
    col0: usize,
    cols: usize,
    /// true: send to the left neighbour (blocks (d+s+1)%D); false: to the right.
    leftwards: bool,
    ready: SemId,
    recv: SemId,
    comm: LaneId,
}

impl RsDirection {
    fn block(&self, d: usize, s: usize, n: usize) -> usize {
        if self.leftwards {
            (d + s + 1) % n
        } else {
            (d + 2 * n - s - 1) % n
        }
    }

    fn peer(&self, d: usize, n: usize) -> usize {
        if self.leftwards {
            left(d, n)
        } else {
            right(d, n)
        }
    }
}

/// GEMM+RS (and GEMM+AR as RS then AG), ring, overlapped: at step s device d computes
/// its partial of block b_s, adds the running sum received from its neighbour and sends
/// the result on; at s = D−1 the block is its own and the sum is final. With `bidir`
/// the columns are split in two halves that travel in opposite directions.
pub(super) fn gemm_reduce_ring(p: &Problem, bidir: bool) -> Result<Plan, AlgorithmError> {
    let n = p.devices;
    let mb = p.m / n;
    let algorithm = if bidir { Algorithm::RingBidir } else { Algorithm::Ring };
    let mut b = PlanBuilder::new(plan_name(p, algorithm), n);
    let a = input_buffer(&mut b, p, 0);
    let bm = input_buffer(&mut b, p, 1);
    let c = output_buffer(&mut b, p);
    let partial = b.buffer("P", DType::F32, mb, p.n, BufferRole::Scratch);
    let send = b.buffer("send", DType::F32, (n - 1) * mb, p.n, BufferRole::Scratch);
    let recv_buf = b.buffer("recv", DType::F32, (n - 1) * mb, p.n, BufferRole::Scratch);
    let compute = b.lane("compute");
    let mut dirs = Vec::new();
    let halves =
        if bidir { vec![(0, p.n.div_ceil(2), true), (p.n.div_ceil(2), p.n / 2, false)] } else { vec![(0, p.n, true)] };
    for (col0, cols, leftwards) in halves {
        let tag = if leftwards { "left" } else { "right" };
        let ready = b.semaphore(&format!("ready_{tag}"));
        let recv = b.semaphore(&format!("recv_{tag}"));
        let comm = b.lane(&format!("comm_{tag}"));
        if cols > 0 {
            dirs.push(RsDirection { col0, cols, leftwards, ready, recv, comm });
        }
    }
    let all_reduce = p.op == OpKind::GemmAr;
    // The AllGather of AR exists only with peers to gather from.
    let (done, ag) =
        if all_reduce && n > 1 { (Some(b.semaphore("done")), Some(b.semaphore("ag"))) } else { (None, None) };
    for d in 0..n {
        // The final block lands in C: rows block d for AR (C is M×N), all of C for RS.
        let final_row0 = if all_reduce { d * mb } else { 0 };
        for s in 0..n {
            for dir in &dirs {
                let blk = dir.block(d, s, n);
                let a_rows = b.rows(a, blk * mb, mb);
                let b_cols = b.window(bm, 0, dir.col0, p.k / n, dir.cols);
                let out = if s == n - 1 {
                    b.window(c, final_row0, dir.col0, mb, dir.cols)
                } else {
                    b.window(send, s * mb, dir.col0, mb, dir.cols)
                };
                if s == 0 {
                    b.push(d, compute, gemm(a_rows, b_cols, out));
                } else {
                    let part = b.window(partial, 0, dir.col0, mb, dir.cols);
                    b.push(d, compute, gemm(a_rows, b_cols, part));
                    b.push(d, compute, wait(dir.recv, s as u32));
                    let got = b.window(recv_buf, (s - 1) * mb, dir.col0, mb, dir.cols);
                    b.push(d, compute, Op::Reduce { inputs: vec![part, got], output: out });
                }
                if s < n - 1 {
                    b.push(d, compute, signal(d, dir.ready));
                }
            }
        }
        if let Some(done) = done {
            // One release after every direction's final reduce.
            b.push(d, compute, signal(d, done));
        }
        for dir in &dirs {
            for s in 0..n - 1 {
                b.push(d, dir.comm, wait(dir.ready, (s + 1) as u32));
                let src = b.window(send, s * mb, dir.col0, mb, dir.cols);
                let dst = b.window(recv_buf, s * mb, dir.col0, mb, dir.cols);
                b.push(d, dir.comm, copy(src, dir.peer(d, n), dst));
                b.push(d, dir.comm, signal(dir.peer(d, n), dir.recv));
            }
        }
        if let (Some(done), Some(ag)) = (done, ag) {
            // AllGather of the reduced blocks on the first comm lane, once every
            // direction's final reduce is done.
            let lane = dirs[0].comm;
            b.push(d, lane, wait(done, 1));
            ring_all_gather(&mut b, d, lane, c, mb, ag);
        }
    }
    Ok(b.finish()?)
}

/// GEMM+RS / GEMM+AR baseline: the whole partial product first, then a ring
/// ReduceScatter (and for AR a ring AllGather), all in one lane with no overlap.
pub(super) fn gemm_reduce_baseline(p: &Problem) -> Result<Plan, AlgorithmError> {
    let n = p.devices;
    let mb = p.m / n;
    let mut b = PlanBuilder::new(plan_name(p, Algorithm::Baseline), n);
    let a = input_buffer(&mut b, p, 0);
    let bm = input_buffer(&mut b, p, 1);
    let c = output_buffer(&mut b, p);
    let partial = b.buffer("P", DType::F32, p.m, p.n, BufferRole::Scratch);
    let send = b.buffer("send", DType::F32, (n - 1) * mb, p.n, BufferRole::Scratch);
    let recv_buf = b.buffer("recv", DType::F32, (n - 1) * mb, p.n, BufferRole::Scratch);
    let recv = b.semaphore("recv");
    let ag = b.semaphore("ag");
    let main = b.lane("main");
    let all_reduce = p.op == OpKind::GemmAr;
    for d in 0..n {
        let (wa, wb, wp) = (b.whole(a), b.whole(bm), b.whole(partial));
        b.push(d, main, gemm(wa, wb, wp));
        let final_out = if all_reduce { b.rows(c, d * mb, mb) } else { b.whole(c) };
        if n == 1 {
            let src = b.whole(partial);
            b.push(d, main, Op::Reduce { inputs: vec![src], output: final_out });
            continue;
        }
        for s in 0..n {
            let blk = (d + s + 1) % n;
            let mine = b.rows(partial, blk * mb, mb);
            let out = if s == 0 {
                mine
            } else {
                b.push(d, main, wait(recv, s as u32));
                let got = b.rows(recv_buf, (s - 1) * mb, mb);
                let out = if s == n - 1 { final_out } else { b.rows(send, s * mb, mb) };
                b.push(d, main, Op::Reduce { inputs: vec![mine, got], output: out });
                out
            };
            if s < n - 1 {
                let dst = b.rows(recv_buf, s * mb, mb);
                b.push(d, main, copy(out, left(d, n), dst));
                b.push(d, main, signal(left(d, n), recv));
            }
        }
        if all_reduce {
            ring_all_gather(&mut b, d, main, c, mb, ag);
        }
    }
    Ok(b.finish()?)
}
