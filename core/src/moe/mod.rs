//! The MoE family (BRIEF §3.5, seed 001's AG+MoE and MoE+RS): a mixture-of-experts
//! layer under tensor parallelism, whose work per expert is decided at run time by the
//! router.
//!
//! T tokens X (T×H) are sharded by rows over D devices. Expert e has W1_e (H×F) and
//! W2_e (F×H); inside every expert device d holds columns [d·F/D, (d+1)·F/D) of W1_e
//! and the same rows of W2_e. The router gives each token k distinct expert ids (or
//! [`ROUTE_NONE`] for a dropped slot) and k weights ([`Router`]). A *row* is one routed
//! (token, slot); rows are ordered by expert, then token, then slot ([`route`]).
//!
//! | op | device d holds | output per device |
//! |---|---|---|
//! | `ag_moe` | X rows [d·T/D, (d+1)·T/D), all W1_e columns of its F/D slice, the router | `Y` ((T·k)×F/D): row r = X[token(r)]·W1_e[:, slice d] for r's expert e, rows past the routed ones 0; `perm` ((T·k)×1 u32): row r's `token·k + slot` |
//! | `moe_rs` | `H` ((T·k)×F/D, the activation rows of its slice in row order), the W2_e rows of its slice, the router | `C` ((T/D)×H): for its tokens t, Σ_slot w_t,slot · H[row(t, slot)]·W2_e summed over all F |
//!
//! Both keep every sum's order fixed within a device (f32, increasing k, slots in
//! order); moe_rs adds the devices' partials in the order of its ReduceScatter, in
//! f32, and rounds once.

use thiserror::Error;

use crate::dtype::DType;
use crate::problem::Split;

mod oracle;
mod plans;
pub mod route;
#[cfg(test)]
mod tests;

pub use plans::build_moe_plan;
pub use route::{
    check_ids, check_routing, check_routing_with, chunk_tokens, route, Router, RouterPart, Routing, RoutingError,
    Tables, ROUTE_NONE,
};

/// The two MoE ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MoeOp {
    /// AllGather of the tokens, routing, grouped GEMM with W1 (seed 001's AG+MoE).
    AgMoe,
    /// Grouped GEMM with W2, top-k weighted combine, ReduceScatter (MoE+RS).
    MoeRs,
}

names!(MoeOp, "moe op", { AgMoe => "ag_moe", MoeRs => "moe_rs" });

/// Why an MoE problem is invalid.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum MoeError {
    /// Too many devices.
    #[error("{op}: {count}")]
    Devices {
        /// The operation.
        op: MoeOp,
        /// The count (not a `source`: the message already quotes it).
        count: crate::plan::TooManyDevices,
    },
    /// A size is zero.
    #[error("{op}: {what} is 0")]
    Zero {
        /// The op.
        op: MoeOp,
        /// Which size.
        what: &'static str,
    },
    /// F (the experts' weights) does not split over D.
    #[error("{op}: {dim}={size} is not divisible by D={devices} (the experts' weights split into D equal blocks; the tokens may split unevenly)")]
    Indivisible {
        /// The op.
        op: MoeOp,
        /// Dimension name.
        dim: &'static str,
        /// Its size.
        size: usize,
        /// D.
        devices: usize,
    },
    /// More slots than experts the distribution can pick distinctly.
    #[error(
        "{op}: top-{slots} needs {slots} distinct experts, but {routing} routing picks from {available} of E={experts}"
    )]
    Slots {
        /// The op.
        op: MoeOp,
        /// k.
        slots: usize,
        /// The distribution.
        routing: Routing,
        /// Experts it picks from.
        available: usize,
        /// E.
        experts: usize,
    },
    /// A dtype the op cannot take.
    #[error("{op}: unsupported dtype {dtype} (inputs and outputs are f32, f16 or bf16)")]
    DType {
        /// The op.
        op: MoeOp,
        /// The dtype.
        dtype: DType,
    },
    /// The algorithm does not plan MoE ops.
    #[error("{op}: algorithm {algorithm} is not defined (expected baseline, ring or ring_chunked)")]
    Algorithm {
        /// The op.
        op: MoeOp,
        /// The algorithm.
        algorithm: String,
    },
    /// Fewer tokens than devices: some device would hold none.
    #[error("{op}: T={tokens} tokens cannot give each of D={devices} devices a token (uneven shards need T >= D)")]
    TooFewTokens {
        /// The op.
        op: MoeOp,
        /// T.
        tokens: usize,
        /// D.
        devices: usize,
    },
    /// More chunks than a device has tokens (or none).
    #[error("{op}: {chunks} chunks of the smallest device's {tokens} tokens would leave a chunk empty (chunks must be 1 to {tokens})")]
    Chunks {
        /// The op.
        op: MoeOp,
        /// The smallest device's tokens.
        tokens: usize,
        /// The chunk count.
        chunks: usize,
    },
    /// The produced plan failed validation (a bug in the algorithm).
    #[error(transparent)]
    Plan(Box<crate::plan::PlanError>),
    /// A table or tensor is too large.
    #[error("{op}: {what} has {size} entries, more than the {limit} the tables index exactly")]
    TooLarge {
        /// The op.
        op: MoeOp,
        /// What.
        what: &'static str,
        /// Its size.
        size: u128,
        /// The limit.
        limit: u128,
    },
}

impl From<crate::plan::PlanError> for MoeError {
    fn from(e: crate::plan::PlanError) -> Self {
        MoeError::Plan(Box::new(e))
    }
}

/// Generator id of X (ag_moe).
pub const TENSOR_X: u32 = 0;
/// Generator id of the stacked W1 ((E·H)×F, expert e at rows [e·H, (e+1)·H)).
pub const TENSOR_W1: u32 = 1;
/// Generator id of the router (ids and weights).
pub const TENSOR_ROUTER: u32 = 2;
/// Generator id of the activation rows H ((T·k)×F).
pub const TENSOR_H: u32 = 3;
/// Generator id of W2, stored as D blocks of E blocks of F/D rows: row
/// `d·E·F/D + e·F/D + j` is row d·F/D + j of W2_e, so device d's rows are one window.
pub const TENSOR_W2: u32 = 4;

/// Table entries are compared through f32 in the conformance check; they stay exact
/// below this.
pub const MAX_TABLE_ROWS: usize = 1 << 24;

/// A validated MoE problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MoeProblem {
    /// The op.
    pub op: MoeOp,
    /// Devices D.
    pub devices: usize,
    /// Tokens T.
    pub tokens: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert FFN size F (split over the devices).
    pub ffn: usize,
    /// Experts E.
    pub experts: usize,
    /// Slots per token k (top-k).
    pub slots: usize,
    /// How the router picks experts.
    pub routing: Routing,
    /// Input dtype.
    pub input: DType,
    /// Output dtype.
    pub output: DType,
}

impl MoeProblem {
    /// Validates and builds a problem.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        op: MoeOp,
        devices: usize,
        tokens: usize,
        hidden: usize,
        ffn: usize,
        experts: usize,
        slots: usize,
        routing: Routing,
        input: DType,
        output: DType,
    ) -> Result<MoeProblem, MoeError> {
        for (value, what) in [
            (devices, "D"),
            (tokens, "T (m)"),
            (hidden, "H (k)"),
            (ffn, "F (n)"),
            (experts, "E (experts)"),
            (slots, "k (topk)"),
        ] {
            if value == 0 {
                return Err(MoeError::Zero { op, what });
            }
        }
        crate::plan::check_device_count(devices as u128).map_err(|count| MoeError::Devices { op, count })?;
        // F (the weights) splits evenly; the tokens in tensor_split's order.
        if ffn % devices != 0 {
            return Err(MoeError::Indivisible { op, dim: "F", size: ffn, devices });
        }
        if tokens < devices {
            return Err(MoeError::TooFewTokens { op, tokens, devices });
        }
        let available = if routing == Routing::Empty { experts.div_ceil(2) } else { experts };
        if slots > available {
            return Err(MoeError::Slots { op, slots, routing, available, experts });
        }
        for dtype in [input, output] {
            if !dtype.is_float() {
                return Err(MoeError::DType { op, dtype });
            }
        }
        let rows = tokens as u128 * slots as u128;
        if rows >= MAX_TABLE_ROWS as u128 {
            return Err(MoeError::TooLarge {
                op,
                what: "the row table (T·k)",
                size: rows,
                limit: MAX_TABLE_ROWS as u128,
            });
        }
        let p = MoeProblem { op, devices, tokens, hidden, ffn, experts, slots, routing, input, output };
        for (what, size) in [
            ("X", tokens as u128 * hidden as u128),
            ("W1", (experts * hidden) as u128 * ffn as u128),
            ("H", rows * ffn as u128),
            ("W2", (experts * ffn) as u128 * hidden as u128),
        ] {
            if size > 1 << 32 {
                return Err(MoeError::TooLarge { op, what, size, limit: 1 << 32 });
            }
        }
        Ok(p)
    }

    /// The router of the problem.
    pub fn router(&self) -> Router {
        Router {
            tokens: self.tokens,
            experts: self.experts,
            slots: self.slots,
            routing: self.routing,
            tensor: TENSOR_ROUTER,
        }
    }

    /// Rows of the row table: T·k (every slot routed at most once).
    pub fn capacity(&self) -> usize {
        self.tokens * self.slots
    }

    /// How the tokens are cut among the devices: `tensor_split`'s order, so when T is
    /// not a multiple of D the first T mod D devices hold one token more.
    pub fn token_split(&self) -> Split {
        Split::new(self.tokens, self.devices)
    }

    /// FFN columns per device, F/D.
    pub fn ffn_per_device(&self) -> usize {
        self.ffn / self.devices
    }

    /// The routing tables of `seed` with `chunks` token chunks.
    pub fn tables(&self, seed: u32, chunks: usize) -> Tables {
        route(&self.router().ids(seed), self.slots, self.experts, chunks, 1, self.capacity())
    }

    /// FLOPs of the op for `seed`'s routing (2 per multiply-add, routed rows only).
    pub fn flops(&self, seed: u32) -> f64 {
        2.0 * self.tables(seed, 1).routed() as f64 * self.hidden as f64 * self.ffn as f64
    }

    /// `T=.. H=.. F=.. E=.. k=.. routing dtype`, for plan names and reports.
    pub fn describe(&self) -> String {
        format!(
            "T={} H={} F={} E={} k={} {} {}->{}",
            self.tokens, self.hidden, self.ffn, self.experts, self.slots, self.routing, self.input, self.output
        )
    }
}
