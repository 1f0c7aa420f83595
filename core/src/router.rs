//! The router's tables as the plan model holds them: a router gives every token `slots`
//! (top-k) expert ids and as many weights, generated on the host under a named
//! [`Routing`] distribution and uploaded as buffers ([`crate::plan::BufferRole::Router`]).
//! The MoE family (`crate::moe`) builds its routing ops and tables on this vocabulary.

use serde::{Deserialize, Serialize};

use crate::generator::{mix32, tensor_key, Family};

/// The id of a dropped slot (a token over an expert's capacity), and of table entries
/// that select no row.
pub const ROUTE_NONE: u32 = u32::MAX;

/// How the generator draws the router's expert ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Routing {
    /// Every slot picks an expert uniformly (distinct within a token).
    Uniform,
    /// Zipf-like: expert e is drawn with probability falling steeply with e, so a few
    /// low-numbered experts are hot and the last ones nearly idle.
    Skewed,
    /// Only even-numbered experts are ever chosen: half the experts receive no token
    /// (needs k ≤ E/2).
    Empty,
    /// Slot 0 of every token goes to the last expert and the other slots are dropped:
    /// all the work in one group.
    Single,
    /// Uniform, with each slot dropped (id [`ROUTE_NONE`]) with probability 1/4, as a
    /// capacity limit does.
    Drop,
}

names!(Routing, "routing", {
    Uniform => "uniform",
    Skewed => "skewed",
    Empty => "empty",
    Single => "single",
    Drop => "drop",
});

/// The router of an MoE layer: which ids and weights the generator produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Router {
    /// Tokens T.
    pub tokens: usize,
    /// Experts E.
    pub experts: usize,
    /// Slots per token k (top-k).
    pub slots: usize,
    /// The distribution of the ids.
    pub routing: Routing,
    /// Generator tensor id (keys the ids' and weights' streams).
    pub tensor: u32,
}

/// The two tables of a router.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterPart {
    /// Expert ids, `u32`, tokens × slots.
    Ids,
    /// Slot weights, `f32`, tokens × slots.
    Weights,
}

impl Router {
    /// Expert ids (tokens × slots, row-major) for `seed`. The family does not matter:
    /// routing is the same for exact and realistic inputs.
    pub fn ids(&self, seed: u32) -> Vec<u32> {
        let key = tensor_key(seed, self.tensor);
        let (e, k) = (self.experts as u32, self.slots);
        let mut out = vec![ROUTE_NONE; self.tokens * k];
        for t in 0..self.tokens {
            let row = &mut out[t * k..(t + 1) * k];
            for j in 0..k {
                let h = mix32(key ^ ((t * k + j) as u32).wrapping_mul(0x2545_f491));
                let pick = match self.routing {
                    Routing::Uniform | Routing::Drop => h % e,
                    // u³ with u uniform in [0, 1): density ∝ x^(−2/3), steep near 0.
                    Routing::Skewed => {
                        let u = (h >> 8) as f64 / (1u32 << 24) as f64;
                        ((u * u * u) * e as f64) as u32
                    }
                    Routing::Empty => 2 * (h % e.div_ceil(2)),
                    Routing::Single => e - 1,
                };
                let dropped = match self.routing {
                    Routing::Drop => mix32(h ^ 0x68e3_1da4) % 4 == 0,
                    Routing::Single => j > 0,
                    _ => false,
                };
                if dropped {
                    continue;
                }
                // Distinct within a token: probe upwards (over the allowed experts).
                let step = if self.routing == Routing::Empty { 2 } else { 1 };
                let modulus = e + (self.routing == Routing::Empty && e % 2 == 1) as u32;
                let mut id = pick;
                // Bounded: with more slots than allowed experts (which problems refuse)
                // the slot is dropped rather than probed forever.
                for _ in 0..modulus {
                    if !row[..j].contains(&id) {
                        break;
                    }
                    id = (id + step) % modulus;
                }
                row[j] = if row[..j].contains(&id) { ROUTE_NONE } else { id };
            }
        }
        out
    }

    /// Slot weights (tokens × slots, f32 bits) for `seed` and `family`: in the exact
    /// family multiples of 1/4 in [1/4, 1], so every weighted sum of the corpus is exact
    /// in f32; in the realistic family positive weights summing to 1 per token, as a
    /// softmax router gives. Dropped slots weigh 0.
    pub fn weights(&self, seed: u32, family: Family) -> Vec<u32> {
        let ids = self.ids(seed);
        let key = tensor_key(seed, self.tensor ^ 0x8000_0000);
        let k = self.slots;
        let mut out = vec![0u32; self.tokens * k];
        for t in 0..self.tokens {
            let raw: Vec<f32> = (0..k)
                .map(|j| {
                    if ids[t * k + j] == ROUTE_NONE {
                        return 0.0;
                    }
                    let h = mix32(key ^ (t * k + j) as u32);
                    match family {
                        Family::Exact => (1 + h % 4) as f32 / 4.0,
                        Family::Realistic => (1 + h % 1024) as f32 / 1024.0,
                    }
                })
                .collect();
            let total: f32 = raw.iter().sum();
            for j in 0..k {
                let w = match family {
                    Family::Realistic if total > 0.0 => raw[j] / total,
                    _ => raw[j],
                };
                out[t * k + j] = w.to_bits();
            }
        }
        out
    }

    /// The words of one table, as every executor uploads them.
    pub fn words(&self, part: RouterPart, seed: u32, family: Family) -> Vec<u32> {
        match part {
            RouterPart::Ids => self.ids(seed),
            RouterPart::Weights => self.weights(seed, family),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_quarters_or_a_distribution() {
        let r = Router { tokens: 96, experts: 8, slots: 4, routing: Routing::Drop, tensor: 3 };
        let ids = r.ids(9);
        let exact = r.weights(9, Family::Exact);
        let real = r.weights(9, Family::Realistic);
        for t in 0..r.tokens {
            let row = |w: &[u32]| (0..4).map(|j| f32::from_bits(w[t * 4 + j])).collect::<Vec<f32>>();
            let (x, y) = (row(&exact), row(&real));
            for j in 0..4 {
                let dropped = ids[t * 4 + j] == ROUTE_NONE;
                assert_eq!(dropped, x[j] == 0.0);
                assert!(dropped || [0.25, 0.5, 0.75, 1.0].contains(&x[j]));
            }
            let total: f32 = y.iter().sum();
            assert!(total == 0.0 || (total - 1.0).abs() < 1e-6, "{y:?}");
        }
    }
}
