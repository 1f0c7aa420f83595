//! The attention family (BRIEF §3.6, seed 001's AG-KV attention): sequence-parallel
//! attention whose keys and values are gathered across devices while it computes, and
//! split-KV decode.
//!
//! Per batch, Q is S×(h·dh), K and V are S×(h_kv·dh) (grouped-query attention when
//! h_kv < h: query head j reads kv head j / (h/h_kv)). Row-major; a row is a sequence
//! position. Every device computes, for its own query rows, O = softmax(Q·Kᵀ·σ + mask)·V
//! over all keys (σ = [`attention_scale`]`(dh)`, the causal mask hiding keys after the
//! query's position) and the log-sum-exp per (row, head), rounded once from the f32
//! online-softmax state of [`Op::Attend`](crate::plan::Op::Attend).
//!
//! | mode | device d holds | output per device |
//! |---|---|---|
//! | prefill, contiguous layout | chunk d of D contiguous chunks of Q, K, V | O and LSE of its rows |
//! | prefill, balanced layout | chunks d and 2D−1−d of 2D contiguous chunks of Q, K, V | O and LSE of its two chunks, stacked |
//! | decode | all T query rows (the last T positions); keys and values in D contiguous shards | O and LSE of the T queries, the same on every device |
//!
//! Chunks split the sequence as `torch.tensor_split` does: S positions in c chunks give
//! the first S mod c chunks one position more, so S need not divide into them.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::dtype::DType;
use crate::plan::{Causal, MAX_HEAD_DIM};
use crate::problem::Split;

pub mod online;
mod oracle;
mod plans;
#[cfg(test)]
mod tests;

pub use oracle::{AttentionBound, ORACLE_CHECK};
pub use plans::build_attention_plan;

/// How prefill shards the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Device d holds the d-th of D contiguous chunks (with a causal mask the last
    /// device attends D times more key blocks than the first).
    Contiguous,
    /// Device d holds chunks d and 2D−1−d of 2D chunks, so with a causal mask every
    /// device attends the same number of key blocks.
    Balanced,
}

names!(Layout, "layout", { Contiguous => "contiguous", Balanced => "balanced" });

/// Why an attention problem is invalid.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum AttentionError {
    /// Too many devices.
    #[error("attention: {0}")]
    Devices(crate::plan::TooManyDevices),
    /// D, S, a head count, the head dimension or the query count is zero.
    #[error("attention: {0} is 0")]
    Zero(&'static str),
    /// The kv heads do not divide the query heads.
    #[error(
        "attention: {kv_heads} kv heads do not divide {heads} query heads (grouped-query attention needs h_kv | h)"
    )]
    Heads {
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        kv_heads: usize,
    },
    /// The head dimension is larger than the ops accept.
    #[error("attention: head dimension {0} is larger than {MAX_HEAD_DIM}")]
    HeadDim(usize),
    /// The sequence is shorter than the layout's chunks: one would be empty.
    #[error("attention: S={seq} positions cannot give each of {chunks} chunks one ({why})")]
    TooShort {
        /// Sequence length.
        seq: usize,
        /// Chunks the layout needs.
        chunks: usize,
        /// Which layout.
        why: &'static str,
    },
    /// Decode has more queries than keys, or fewer keys than devices.
    #[error(
        "attention decode: {queries} queries against S={seq} keys on D={devices} devices (need queries ≤ S and D ≤ S)"
    )]
    Decode {
        /// Query tokens.
        queries: usize,
        /// Keys.
        seq: usize,
        /// Devices.
        devices: usize,
    },
    /// Decode takes no layout.
    #[error("attention decode shards keys contiguously; the balanced layout is for prefill")]
    DecodeLayout,
    /// A tensor is too large for the input generator.
    #[error("attention: tensor {tensor} has {elements} elements, more than the 2^32 the input generator indexes")]
    TooLarge {
        /// Which tensor.
        tensor: &'static str,
        /// Its element count.
        elements: u128,
    },
}

/// A validated attention problem (one batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionProblem {
    /// Devices D.
    pub devices: usize,
    /// Sequence length S (keys; also queries in prefill).
    pub seq: usize,
    /// Query heads h.
    pub heads: usize,
    /// Key/value heads h_kv.
    pub kv_heads: usize,
    /// Head dimension dh.
    pub head_dim: usize,
    /// Causal mask.
    pub causal: bool,
    /// How prefill shards the sequence.
    pub layout: Layout,
    /// Decode: the number of query tokens (the last positions), replicated on every
    /// device; `None` for prefill.
    pub queries: Option<usize>,
    /// Dtype of Q, K, V and O (the state and LSE are f32).
    pub dtype: DType,
}

/// Generator ids of the inputs.
pub const TENSOR_Q: u32 = 0;
/// Generator id of K.
pub const TENSOR_K: u32 = 1;
/// Generator id of V.
pub const TENSOR_V: u32 = 2;

/// A contiguous run of sequence positions a device holds: `rows` rows from `pos`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// First global position.
    pub pos: usize,
    /// Rows.
    pub rows: usize,
}

impl AttentionProblem {
    /// Validates and builds a problem.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        devices: usize,
        seq: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        causal: bool,
        layout: Layout,
        queries: Option<usize>,
        dtype: DType,
    ) -> Result<AttentionProblem, AttentionError> {
        for (value, what) in [
            (devices, "D"),
            (seq, "S (m)"),
            (heads, "the head count (n)"),
            (kv_heads, "the kv head count"),
            (head_dim, "the head dimension (k)"),
            (queries.unwrap_or(1), "the decode query count"),
        ] {
            if value == 0 {
                return Err(AttentionError::Zero(what));
            }
        }
        crate::plan::check_device_count(devices as u128).map_err(AttentionError::Devices)?;
        if heads % kv_heads != 0 {
            return Err(AttentionError::Heads { heads, kv_heads });
        }
        if head_dim > MAX_HEAD_DIM {
            return Err(AttentionError::HeadDim(head_dim));
        }
        match (queries, layout) {
            (Some(_), Layout::Balanced) => return Err(AttentionError::DecodeLayout),
            (Some(t), _) if t > seq || devices > seq => {
                return Err(AttentionError::Decode { queries: t, seq, devices })
            }
            (Some(_), _) => {}
            (None, Layout::Contiguous) if seq < devices => {
                return Err(AttentionError::TooShort {
                    seq,
                    chunks: devices,
                    why: "the contiguous layout gives device d the d-th of D chunks",
                })
            }
            (None, Layout::Balanced) if seq < 2 * devices => {
                return Err(AttentionError::TooShort {
                    seq,
                    chunks: 2 * devices,
                    why: "the balanced layout gives device d chunks d and 2D−1−d of 2D",
                })
            }
            (None, _) => {}
        }
        let p = AttentionProblem { devices, seq, heads, kv_heads, head_dim, causal, layout, queries, dtype };
        for (tensor, rows, cols) in [("Q", p.query_rows(), heads * head_dim), ("K", seq, kv_heads * head_dim)] {
            let elements = rows as u128 * cols as u128;
            if elements > 1u128 << 32 {
                return Err(AttentionError::TooLarge { tensor, elements });
            }
        }
        Ok(p)
    }

    /// Rows of the global Q: S in prefill, the query count in decode.
    pub fn query_rows(&self) -> usize {
        self.queries.unwrap_or(self.seq)
    }

    /// Global position of global query row 0 (decode queries are the last positions).
    pub fn query_pos0(&self) -> usize {
        self.seq - self.query_rows()
    }

    /// The key/value chunks device `d` holds, in the order its buffers stack them.
    pub fn kv_chunks(&self, d: usize) -> Vec<Chunk> {
        let (s, n) = (self.seq, self.devices);
        let chunk = |split: Split, i: usize| Chunk { pos: split.start(i), rows: split.len(i) };
        match (self.queries, self.layout) {
            (Some(_), _) | (None, Layout::Contiguous) => vec![chunk(Split::new(s, n), d)],
            (None, Layout::Balanced) => {
                let split = Split::new(s, 2 * n);
                vec![chunk(split, d), chunk(split, 2 * n - 1 - d)]
            }
        }
    }

    /// The query chunks device `d` computes, in the order its outputs stack them (as its
    /// key chunks in prefill; all queries in decode). Positions are global sequence
    /// positions; in decode, Q's row r is position `query_pos0() + r`.
    pub fn query_chunks(&self, d: usize) -> Vec<Chunk> {
        match self.queries {
            Some(t) => vec![Chunk { pos: self.seq - t, rows: t }],
            None => self.kv_chunks(d),
        }
    }

    /// Rows of a device's K/V buffers (the largest shard).
    pub fn kv_rows(&self) -> usize {
        (0..self.devices).map(|d| self.kv_chunks(d).iter().map(|c| c.rows).sum()).max().unwrap_or(0)
    }

    /// Rows of a device's outputs (the largest device's, when they differ).
    pub fn out_rows(&self) -> usize {
        (0..self.devices).map(|d| self.out_rows_on(d)).max().unwrap_or(0)
    }

    /// Rows of device `d`'s outputs.
    pub fn out_rows_on(&self, d: usize) -> usize {
        self.query_chunks(d).iter().map(|c| c.rows).sum()
    }

    /// Query columns h·dh.
    pub fn q_cols(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Key/value columns h_kv·dh.
    pub fn kv_cols(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// What the causal mask leaves of a block of queries against a block of keys.
    pub fn visibility(&self, q: Chunk, k: Chunk) -> Visibility {
        if !self.causal || k.rows == 0 || k.pos + k.rows - 1 <= q.pos {
            Visibility::All
        } else if k.pos > q.pos + q.rows - 1 {
            Visibility::Hidden
        } else {
            Visibility::Partial(Causal { q_pos: q.pos, k_pos: k.pos })
        }
    }

    /// Whether device `d` attends any key of device `r` (false when the causal mask
    /// hides all of `r`'s keys from all of `d`'s queries).
    pub fn needs(&self, d: usize, r: usize) -> bool {
        self.query_chunks(d)
            .into_iter()
            .any(|q| self.kv_chunks(r).into_iter().any(|k| self.visibility(q, k) != Visibility::Hidden))
    }

    /// Attention FLOPs of the whole problem (Q·Kᵀ and P·V, visible pairs only).
    pub fn flops(&self) -> f64 {
        let t = self.query_rows();
        let pairs = if self.causal {
            let pos0 = self.query_pos0();
            (0..t).map(|r| (pos0 + r + 1) as f64).sum::<f64>()
        } else {
            t as f64 * self.seq as f64
        };
        4.0 * pairs * (self.heads * self.head_dim) as f64
    }

    /// A short description, e.g. `causal balanced D=4 S=64 h=4/2 dh=64 bf16`.
    pub fn describe(&self) -> String {
        let mode = match self.queries {
            Some(t) => format!("decode T={t}"),
            None => self.layout.to_string(),
        };
        format!(
            "{}{mode} D={} S={} h={}/{} dh={} {}",
            if self.causal { "causal " } else { "" },
            self.devices,
            self.seq,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.dtype
        )
    }
}

/// What a causal mask leaves of a (query block, key block) pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Visibility {
    /// Every key is visible to every query: no mask needed.
    All,
    /// The diagonal crosses the block: the mask to apply.
    Partial(Causal),
    /// No key is visible to any query: the block is skipped.
    Hidden,
}

impl Visibility {
    /// The mask an [`Op::Attend`](crate::plan::Op::Attend) of the block needs (a hidden
    /// block's mask hides every key).
    pub fn mask(self, q: Chunk, k: Chunk) -> Option<Causal> {
        match self {
            Visibility::All => None,
            Visibility::Partial(c) => Some(c),
            Visibility::Hidden => Some(Causal { q_pos: q.pos, k_pos: k.pos }),
        }
    }
}

/// The fraction of (query, key) pairs of a causal block that are visible.
pub fn visible_fraction(c: &Causal, q_rows: usize, k_rows: usize) -> f64 {
    if q_rows == 0 || k_rows == 0 {
        return 0.0;
    }
    let visible: usize = (0..q_rows).map(|i| (c.q_pos + i + 1).saturating_sub(c.k_pos).min(k_rows)).sum();
    visible as f64 / (q_rows * k_rows) as f64
}

/// An attention algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AttentionAlgorithm {
    /// All-gather K and V, then attend to every key block in position order; no overlap.
    Baseline,
    /// Ring attention: at step i attend the K/V block of device (d+i) mod D while the
    /// next block arrives from the right neighbour.
    Ring,
    /// Ring attention with blocks travelling both ways: own, then right and left
    /// neighbours' blocks alternately, in ⌈(D−1)/2⌉ rounds.
    RingBidir,
    /// Split-KV decode: every device attends its own key shard, the partial states are
    /// all-gathered and merged in device order on every device.
    SplitKv,
}

impl AttentionAlgorithm {
    /// Whether it plans the problem's mode (prefill: baseline, ring, ring_bidir;
    /// decode: baseline, split_kv).
    pub fn plans(self, p: &AttentionProblem) -> bool {
        match self {
            AttentionAlgorithm::Baseline => true,
            AttentionAlgorithm::Ring | AttentionAlgorithm::RingBidir => p.queries.is_none(),
            AttentionAlgorithm::SplitKv => p.queries.is_some(),
        }
    }
}

names!(AttentionAlgorithm, "attention algorithm", {
    Baseline => "baseline",
    Ring => "ring",
    RingBidir => "ring_bidir",
    SplitKv => "split_kv",
});
