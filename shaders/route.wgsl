// The routing op: expert ids (tokens × slots) -> segment offsets, row permutation and
// its inverse. Three passes, one dispatch each: (0) clear perm and inv to NONE and count
// each (expert, chunk) segment, (1) exclusive scan of the counts (one invocation),
// (2) fill each segment's rows in token then slot order. CPU twin: `route` in cmm-core
// `moe/route.rs`. Chunk c's tokens: `chunk_tokens` there (the tokens cut into `shards`
// shards, each into chunks/shards sub-chunks, both in tensor_split's order). Loops: a
// chunk's tokens·slots (pass 0, 2) or experts·chunks (pass 1); the host keeps both under
// lavapipe's 65,535.

struct RouteParams {
    pass_: u32,
    tokens: u32,
    slots: u32,
    experts: u32,
    chunks: u32,
    capacity: u32,
    ids_off: u32,
    ids_stride: u32,
    seg_off: u32,
    perm_off: u32,
    perm_stride: u32,
    inv_off: u32,
    inv_stride: u32,
    row_begin: u32,
    shards: u32,
    _pad: u32,
}

@group(0) @binding(1) var<uniform> P: RouteParams;

const NONE: u32 = 0xffffffffu;
const ROW: u32 = 4096u;

fn id_at(slot: u32) -> u32 {
    return ld(P.ids_off + (slot / P.slots) * P.ids_stride + slot % P.slots);
}

// Piece i of n pieces of `total` in tensor_split's order: (first, length).
fn piece(total: u32, n: u32, i: u32) -> vec2<u32> {
    let len = total / n;
    let longer = total % n;
    return vec2<u32>(i * len + min(i, longer), len + select(0u, 1u, i < longer));
}

// Chunk c's first (token, slot) and its tokens·slots.
fn chunk_slots(c: u32) -> vec2<u32> {
    let per_shard = max(P.chunks / P.shards, 1u);
    let shard = piece(P.tokens, P.shards, c / per_shard);
    let sub = piece(shard.y, per_shard, c % per_shard);
    return vec2<u32>((shard.x + sub.x) * P.slots, sub.y * P.slots);
}

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = (P.row_begin + gid.y) * ROW + gid.x;
    let total = P.tokens * P.slots;
    let segments = P.experts * P.chunks;
    if (P.pass_ == 0u) {
        if (i < total) {
            st(P.inv_off + (i / P.slots) * P.inv_stride + i % P.slots, NONE);
        }
        if (i < P.capacity) {
            st(P.perm_off + i * P.perm_stride, NONE);
        }
        if (i == 0u) {
            st(P.seg_off, 0u);
        }
        if (i < segments) {
            let e = i / P.chunks;
            let chunk = chunk_slots(i % P.chunks);
            let first = chunk.x;
            var count = 0u;
            for (var s = 0u; s < chunk.y; s = s + 1u) {
                if (id_at(first + s) == e) {
                    count = count + 1u;
                }
            }
            st(P.seg_off + i + 1u, count);
        }
    } else if (P.pass_ == 1u) {
        if (i == 0u) {
            for (var s = 1u; s <= segments; s = s + 1u) {
                st(P.seg_off + s, ld(P.seg_off + s) + ld(P.seg_off + s - 1u));
            }
        }
    } else if (i < segments) {
        let e = i / P.chunks;
        let chunk = chunk_slots(i % P.chunks);
        let first = chunk.x;
        var row = ld(P.seg_off + i);
        for (var s = 0u; s < chunk.y; s = s + 1u) {
            let slot = first + s;
            if (id_at(slot) == e) {
                if (row < P.capacity) {
                    st(P.perm_off + row * P.perm_stride, slot);
                    st(P.inv_off + (slot / P.slots) * P.inv_stride + slot % P.slots, row);
                }
                row = row + 1u;
            }
        }
    }
}
