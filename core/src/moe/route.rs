//! The router's output and the routing tables built from it on the device.
//!
//! A router gives every token `slots` (top-k) expert ids and as many weights. Ids are
//! data, generated on the host under a named [`Routing`] distribution and uploaded as a
//! `u32` buffer; [`Op::Route`](crate::plan::Op::Route) turns them into the tables the
//! grouped GEMM and the combine read. [`route`] is the CPU twin of that op (and of
//! `shaders/route.wgsl`, `cuda/kernels/moe.cu`), and what the oracle, the simulator and
//! the executors' table checks use.

use crate::problem::Split;
use thiserror::Error;

pub use crate::router::{Router, RouterPart, Routing, ROUTE_NONE};

/// A malformed routing table.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum RoutingError {
    /// An expert id is neither below E nor [`ROUTE_NONE`].
    #[error("routing table: token {token} slot {slot} names expert {id}, but there are {experts} experts (ids 0..{experts}, or {ROUTE_NONE} for a dropped slot)")]
    ExpertOutOfRange {
        /// Token.
        token: usize,
        /// Slot.
        slot: usize,
        /// The id.
        id: u32,
        /// E.
        experts: usize,
    },
    /// A token names one expert twice.
    #[error("routing table: token {token} names expert {id} in slots {first} and {second}; a token's experts must be distinct")]
    DuplicateExpert {
        /// Token.
        token: usize,
        /// The expert.
        id: u32,
        /// The first slot naming it.
        first: usize,
        /// The second.
        second: usize,
    },
    /// More rows are routed than a table or output holds.
    #[error("routing: {needed} (token, slot) rows are routed but `{buffer}` holds {capacity} rows")]
    Overflow {
        /// The buffer too small.
        buffer: String,
        /// Rows routed.
        needed: usize,
        /// Rows it holds.
        capacity: usize,
    },
    /// A segment table's offsets decrease or run past the rows.
    #[error("routing: segment table offset {at} is {value}, after {previous} (offsets must not decrease and stay within {capacity} rows)")]
    OffsetsOutOfOrder {
        /// Index in the segment table.
        at: usize,
        /// Its value.
        value: u32,
        /// The previous offset.
        previous: u32,
        /// Rows of the table.
        capacity: usize,
    },
    /// A table's shape does not fit the router.
    #[error("routing table: {0}")]
    Shape(String),
}

/// Checks a router's ids: every id below `experts` or [`ROUTE_NONE`], distinct within
/// a token.
pub fn check_ids(ids: &[u32], slots: usize, experts: usize) -> Result<(), RoutingError> {
    if slots == 0 || ids.len() % slots != 0 {
        return Err(RoutingError::Shape(format!("{} ids do not form rows of {slots} slots", ids.len())));
    }
    for (token, row) in ids.chunks(slots).enumerate() {
        for (slot, &id) in row.iter().enumerate() {
            if id == ROUTE_NONE {
                continue;
            }
            if id as usize >= experts {
                return Err(RoutingError::ExpertOutOfRange { token, slot, id, experts });
            }
            if let Some(first) = row[..slot].iter().position(|&o| o == id) {
                return Err(RoutingError::DuplicateExpert { token, id, first, second: slot });
            }
        }
    }
    Ok(())
}

/// The routing tables of [`route`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tables {
    /// `experts·chunks + 1` offsets: the rows of segment (expert e, token chunk c) are
    /// `[seg[e·chunks + c], seg[e·chunks + c + 1])`; `seg[experts·chunks]` rows are routed.
    pub seg: Vec<u32>,
    /// Per row (capacity of them), the (token, slot) it holds as `token·slots + slot`;
    /// [`ROUTE_NONE`] past the routed rows.
    pub perm: Vec<u32>,
    /// Per (token, slot), its row; [`ROUTE_NONE`] for a dropped slot.
    pub inv: Vec<u32>,
}

impl Tables {
    /// Rows routed.
    pub fn routed(&self) -> usize {
        *self.seg.last().unwrap_or(&0) as usize
    }

    /// Rows of segment (expert, chunk) of a table built with `chunks` chunks.
    pub fn segment(&self, expert: usize, chunk: usize, chunks: usize) -> std::ops::Range<usize> {
        let i = expert * chunks + chunk;
        self.seg[i] as usize..self.seg[i + 1] as usize
    }

    /// Checks a segment table: offsets from 0, never decreasing, within `capacity`.
    pub fn check_offsets(seg: &[u32], capacity: usize) -> Result<(), RoutingError> {
        let mut previous = 0;
        for (at, &value) in seg.iter().enumerate() {
            if value < previous || value as usize > capacity || (at == 0 && value != 0) {
                return Err(RoutingError::OffsetsOutOfOrder { at, value, previous, capacity });
            }
            previous = value;
        }
        Ok(())
    }
}

/// The tokens of chunk `chunk` of `chunks`: the tokens cut into `shards` shards, each
/// into `chunks / shards` sub-chunks, both in `torch.tensor_split`'s order (the first n
/// mod k pieces one token longer). With one shard and chunks that divide the tokens,
/// `tokens / chunks` tokens per chunk. Part of the contract of
/// [`Op::Route`](crate::plan::Op::Route) (twins in `route.wgsl` and `moe.cu`).
pub fn chunk_tokens(tokens: usize, shards: usize, chunks: usize, chunk: usize) -> std::ops::Range<usize> {
    let shards = Split::new(tokens, shards);
    let per_shard = (chunks / shards.parts).max(1);
    let (shard, sub) = (chunk / per_shard, chunk % per_shard);
    let (start, len) = shards.piece(shard, per_shard, sub);
    let first = shards.start(shard) + start;
    first..first + len
}

/// Routes `ids` (tokens × slots): rows grouped by expert, then by token chunk
/// ([`chunk_tokens`] of `chunks` over `shards`), then by token and slot. This is the
/// contract of [`Op::Route`](crate::plan::Op::Route): an id that is not below `experts`
/// selects no row (executors check the ids before a run, see [`check_ids`]), and rows
/// past `capacity` are not stored.
pub fn route(ids: &[u32], slots: usize, experts: usize, chunks: usize, shards: usize, capacity: usize) -> Tables {
    let tokens = ids.len() / slots;
    let ranges: Vec<std::ops::Range<usize>> = (0..chunks).map(|c| chunk_tokens(tokens, shards, chunks, c)).collect();
    let mut counts = vec![0u32; experts * chunks];
    for (c, range) in ranges.iter().enumerate() {
        for &id in &ids[range.start * slots..range.end * slots] {
            if (id as usize) < experts {
                counts[id as usize * chunks + c] += 1;
            }
        }
    }
    let mut seg = vec![0u32; experts * chunks + 1];
    for i in 0..counts.len() {
        seg[i + 1] = seg[i] + counts[i];
    }
    let mut perm = vec![ROUTE_NONE; capacity];
    let mut inv = vec![ROUTE_NONE; ids.len()];
    for e in 0..experts {
        for (c, range) in ranges.iter().enumerate() {
            let mut row = seg[e * chunks + c] as usize;
            for i in range.start * slots..range.end * slots {
                if ids[i] as usize == e {
                    if row < capacity {
                        perm[row] = i as u32;
                        inv[i] = row as u32;
                    }
                    row += 1;
                }
            }
        }
    }
    Tables { seg, perm, inv }
}

/// Checks, before a run, every routing table a plan's [`Op::Route`]s read from the
/// router (ids in range and distinct) and that the rows they route fit the row table
/// and every grouped GEMM output (decided on the actual ids of `seed`). Executors call
/// it so that a malformed table is a typed error, never a silently wrong result.
///
/// [`Op::Route`]: crate::plan::Op::Route
pub fn check_routing(plan: &crate::plan::Plan, seed: u32) -> Result<(), RoutingError> {
    // Every device holds the same generated table: check it once.
    let mut generated = std::collections::BTreeMap::new();
    check_routing_with(plan, |_, buffer, router| {
        Ok(Some(generated.entry(buffer).or_insert_with(|| router.ids(seed)).clone()))
    })
}

/// [`check_routing`] for the ids a run's router buffers hold: `ids_of(device, buffer,
/// router)` gives the words of id buffer `buffer` on `device` (its whole length),
/// generated or read from where a caller put them, or `None` where this caller does not
/// hold that device's table (a rank checks its own).
pub fn check_routing_with<E>(
    plan: &crate::plan::Plan,
    mut ids_of: impl FnMut(usize, usize, &Router) -> Result<Option<Vec<u32>>, E>,
) -> Result<(), E>
where
    E: From<RoutingError>,
{
    use crate::plan::{BufferRole, Op};
    let mut checked = std::collections::BTreeSet::new();
    for (site, op) in plan.ops() {
        let Op::Route { ids, tables, experts } = op else { continue };
        if !checked.insert((site.device, ids.buf, ids.offset, tables.perm.rows, *experts)) {
            continue;
        }
        let Some(BufferRole::Router { part: RouterPart::Ids, router }) = plan.buffers.get(ids.buf.0).map(|b| &b.role)
        else {
            continue;
        };
        let Some(all) = ids_of(site.device, ids.buf.0, router)? else { continue };
        let cols = plan.buffers[ids.buf.0].cols;
        let words: Vec<u32> = (0..ids.rows)
            .flat_map(|i| (0..ids.cols).map(move |j| ids.offset + i * cols + j))
            .map(|at| all.get(at).copied().unwrap_or(ROUTE_NONE))
            .collect();
        check_ids(&words, ids.cols, *experts)?;
        let needed = words.iter().filter(|&&id| (id as usize) < *experts).count();
        let perm = &plan.buffers[tables.perm.buf.0];
        if needed > tables.perm.rows {
            return Err(RoutingError::Overflow { buffer: perm.name.clone(), needed, capacity: tables.perm.rows }.into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(routing: Routing, experts: usize, slots: usize) -> Router {
        Router { tokens: 96, experts, slots, routing, tensor: 3 }
    }

    #[test]
    fn every_distribution_gives_valid_distinct_ids() {
        for routing in Routing::ALL {
            for (e, k) in [(4, 1), (8, 2), (16, 4), (64, 8)] {
                let r = router(routing, e, k);
                let ids = r.ids(5);
                check_ids(&ids, k, e).unwrap_or_else(|err| panic!("{routing} E={e} k={k}: {err}"));
                let used: Vec<bool> = (0..e).map(|x| ids.contains(&(x as u32))).collect();
                match routing {
                    Routing::Empty => assert!(used.iter().skip(1).step_by(2).all(|u| !u), "{used:?}"),
                    Routing::Single => assert_eq!(ids.iter().filter(|&&i| i != ROUTE_NONE).count(), 96),
                    Routing::Drop => assert!(ids.contains(&ROUTE_NONE)),
                    _ => assert!(!ids.contains(&ROUTE_NONE)),
                }
            }
        }
        // Skewed: the first quarter of the experts takes most of the slots.
        let ids = router(Routing::Skewed, 16, 1).ids(1);
        let hot = ids.iter().filter(|&&i| i < 4).count();
        assert!(hot > 96 / 2, "{hot}");
    }

    #[test]
    fn route_groups_by_expert_then_chunk_and_inverts() {
        // 4 tokens, 2 slots, 3 experts, 2 chunks of 2 tokens.
        let ids = [2, 0, 1, ROUTE_NONE, 0, 2, 1, 0];
        let t = route(&ids, 2, 3, 2, 1, 8);
        // Expert 0: (t0,s1) chunk 0; (t2,s0), (t3,s1) chunk 1. Expert 1: (t1,s0) | (t3,s0).
        assert_eq!(t.seg, [0, 1, 3, 4, 5, 6, 7]);
        assert_eq!(t.perm, [1, 4, 7, 2, 6, 0, 5, ROUTE_NONE]);
        for (row, &slot) in t.perm.iter().enumerate().take(t.routed()) {
            assert_eq!(t.inv[slot as usize], row as u32);
        }
        assert_eq!(t.inv[3], ROUTE_NONE);
        assert_eq!(t.segment(0, 1, 2), 1..3);
        // One chunk: the same rows (expert-major, then token order).
        assert_eq!(route(&ids, 2, 3, 1, 1, 8).perm, t.perm);
        Tables::check_offsets(&t.seg, 8).unwrap();
    }

    #[test]
    fn malformed_tables_are_typed_errors() {
        assert_eq!(
            check_ids(&[0, 5], 2, 4),
            Err(RoutingError::ExpertOutOfRange { token: 0, slot: 1, id: 5, experts: 4 })
        );
        assert_eq!(
            check_ids(&[1, 2, 3, 3], 2, 4),
            Err(RoutingError::DuplicateExpert { token: 1, id: 3, first: 0, second: 1 })
        );
        assert!(matches!(check_ids(&[1, 2, 3], 2, 4), Err(RoutingError::Shape(_))));
        assert_eq!(
            Tables::check_offsets(&[0, 3, 2], 8),
            Err(RoutingError::OffsetsOutOfOrder { at: 2, value: 2, previous: 3, capacity: 8 })
        );
        assert!(Tables::check_offsets(&[0, 3, 9], 8).is_err());
        let msg = check_ids(&[7], 1, 4).unwrap_err().to_string();
        assert!(msg.contains("expert 7") && msg.contains("4 experts"), "{msg}");
    }
}
