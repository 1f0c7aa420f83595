//! The online-softmax arithmetic of the attention ops ([`Op::Attend`],
//! [`Op::AttnMerge`], [`Op::AttnFinish`]) on one (query row, head), in f32 and in the
//! operation order every executor follows: the CPU twin calls these, and
//! `shaders/attend.wgsl`, `shaders/attn_state.wgsl` and `cuda/kernels/attention.cu`
//! mirror them line for line.
//!
//! [`Op::Attend`]: crate::plan::Op::Attend
//! [`Op::AttnMerge`]: crate::plan::Op::AttnMerge
//! [`Op::AttnFinish`]: crate::plan::Op::AttnFinish

use crate::numeric::{exp_f32, ln_f32};
use crate::plan::{ATTN_EMPTY_MAX, ATTN_KEY_TILE};

/// The running state of one (query row, head): max, sum and the unnormalised output.
#[derive(Clone, Debug, PartialEq)]
pub struct RowState {
    /// Running max of the scaled scores ([`ATTN_EMPTY_MAX`] when empty).
    pub max: f32,
    /// Running Σ exp(s − max); 0 means empty.
    pub sum: f32,
    /// Running Σ exp(s − max)·v, `head_dim` values.
    pub acc: Vec<f32>,
}

impl RowState {
    /// The empty state of a head of `head_dim`.
    pub fn empty(head_dim: usize) -> RowState {
        RowState { max: ATTN_EMPTY_MAX, sum: 0.0, acc: vec![0.0; head_dim] }
    }
}

/// One key block of [`Op::Attend`](crate::plan::Op::Attend) for one (row, head): `q` is
/// the query's head (dh values), `key(j)` and `value(j)` the block's key j's head,
/// `visible(j)` the mask. Keys go in tiles of [`ATTN_KEY_TILE`].
pub fn attend(
    state: &mut RowState,
    q: &[f32],
    keys: usize,
    scale: f32,
    key: impl Fn(usize, usize) -> f32,
    value: impl Fn(usize, usize) -> f32,
    visible: impl Fn(usize) -> bool,
) {
    let dh = q.len();
    let mut scores = [0.0f32; ATTN_KEY_TILE];
    let mut probs = [0.0f32; ATTN_KEY_TILE];
    let mut tile0 = 0;
    while tile0 < keys {
        let n = (keys - tile0).min(ATTN_KEY_TILE);
        let mut tile_max = ATTN_EMPTY_MAX;
        let mut any = false;
        for (t, score) in scores.iter_mut().enumerate().take(n) {
            if visible(tile0 + t) {
                let mut dot = 0.0f32;
                for (c, &qc) in q.iter().enumerate() {
                    dot += qc * key(tile0 + t, c);
                }
                *score = dot * scale;
                tile_max = if any { tile_max.max(*score) } else { *score };
                any = true;
            }
        }
        if any {
            let new_max = state.max.max(tile_max);
            let alpha = if state.sum == 0.0 { 0.0 } else { exp_f32(state.max - new_max) };
            let mut sum = state.sum * alpha;
            for (t, (p, &s)) in probs.iter_mut().zip(&scores).enumerate().take(n) {
                *p = if visible(tile0 + t) { exp_f32(s - new_max) } else { 0.0 };
                if visible(tile0 + t) {
                    sum += *p;
                }
            }
            for c in 0..dh {
                let mut a = state.acc[c] * alpha;
                for (t, &p) in probs.iter().enumerate().take(n) {
                    if visible(tile0 + t) {
                        a += p * value(tile0 + t, c);
                    }
                }
                state.acc[c] = a;
            }
            state.max = new_max;
            state.sum = sum;
        }
        tile0 += n;
    }
}

/// [`Op::AttnMerge`](crate::plan::Op::AttnMerge) for one (row, head): `from` into `into`.
pub fn merge(into: &mut RowState, from: &RowState) {
    if from.sum == 0.0 {
        return;
    }
    if into.sum == 0.0 {
        *into = from.clone();
        return;
    }
    let max = into.max.max(from.max);
    let a1 = exp_f32(into.max - max);
    let a2 = exp_f32(from.max - max);
    into.sum = into.sum * a1 + from.sum * a2;
    for (x, &y) in into.acc.iter_mut().zip(&from.acc) {
        *x = *x * a1 + y * a2;
    }
    into.max = max;
}

/// [`Op::AttnFinish`](crate::plan::Op::AttnFinish) for one (row, head): the output
/// values (before their rounding to the output dtype) and the log-sum-exp.
pub fn finish(state: &RowState) -> (Vec<f32>, f32) {
    if state.sum == 0.0 {
        return (vec![0.0; state.acc.len()], ATTN_EMPTY_MAX);
    }
    let out = state.acc.iter().map(|&a| a / state.sum).collect();
    (out, state.max + ln_f32(state.sum))
}
