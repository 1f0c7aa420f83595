// Host twins of the Hopper engine's instructions (cuda/kernels/hopper.cu), after
// common.cuh and mma.h. The kernel's own code runs unchanged; what the GPU does in its
// asynchronous units happens here in the calling thread, with the checks the GPU leaves
// undefined:
//
// - Shared memory: a per-block buffer of an sm_90 CTA's largest dynamic shared memory;
//   a shared address is an offset into it (the kernel's 1024-byte alignment holds).
// - mbarriers (init, arrive, arrive.expect_tx, try_wait.parity): an arrival count and a
//   transaction count per phase; a phase completes when both reach zero. A try_wait that
//   finds its phase incomplete lets the block's other threads run; when every live
//   thread only spins and nothing changes, the block is deadlocked (an error).
// - TMA (cp.async.bulk.tensor.2d and .3d, of the map's rank): the tensor map is the host twin's own encoding
//   (cmm-cuda `host_tensor_map`, the fake driver's cuTensorMapEncodeTiled); the box is
//   copied at once, the 128-byte swizzle applied to the shared address and zeros past
//   the tensor's edges, and its bytes are counted on the barrier's current phase. Each
//   16-byte chunk it writes is published by that phase's completion: a wgmma that reads a
//   chunk whose publishing phase its thread has not waited for is an error (a missing or
//   short expect-tx, or a consumer that skips its wait, reads what the GPU may not have
//   landed yet). A TMA copy issued after an acquire without fence.proxy.async since is an
//   error naming the kernel's line: the async proxy need not see what the acquire made
//   visible to the generic one.
// - cp.async of 16 bytes into the Hopper engine's shared memory (gathered rows): the copy
//   is written at once but publishes nothing until its thread either
//   - makes a cp.async.mbarrier.arrive.noinc, which publishes the thread's copies so far
//     by the barrier's current phase and arrives once; or
//   - makes a plain mbarrier arrive (a release) once cp.async.wait_group has seen the
//     copy's group land: the arrive publishes the landed copies alone (commit_group closes
//     a group; a copy in no closed group, or in one not waited for, stays unpublished).
//   A copy counts as published by the first such arrive of its thread alone, though on
//   the GPU every later release of the thread covers it too: a reader that waited only for
//   a later one is reported. cmm's kernels hand each stage over by its own arrive.
//   A wgmma that reads a chunk no arrive has published is an error. So is one that reads
//   a chunk a cp.async wrote (the generic proxy) unless a fence.proxy.async.shared::cta
//   came between: by the writing thread after the copy landed and before the arrive that
//   published it, or by the reading thread after it saw the publishing phase. The GPU's
//   wgmma reads through the async proxy.
// - TMA stores (cp.async.bulk.tensor.2d.global.shared::cta, the TMA_STORE kernels'
//   epilogue): the box is copied out at once, un-swizzled, clipped at the tensor's edges.
//   The staging they read is written with st.shared (the generic proxy). Errors: a store
//   that reads a chunk whose writer made no fence.proxy.async.shared::cta since, or one no
//   thread wrote since the last store from it (stale staging: a store past what the tile
//   wrote); a write to a chunk a store has been issued from, until its issuing thread's
//   cp.async.bulk.wait_group(.read) (the GPU may still be reading it); and a fused run's
//   release fence (fence.acq_rel.sys) while a TMA store of the CTA has not been waited for
//   to completion (cp.async.bulk.wait_group, not .read), naming the kernel's line: the
//   release would announce rows that may not have landed.
// - wgmma (m64nNk16, f32 accumulate): each thread computes its own accumulators, laid out
//   as the PTX ISA specifies (row 16·warp + lane/4 + 8·((i/2)%2), column 8·(i/4) +
//   2·(lane%4) + i%2), from shared memory as the descriptors say: start address, leading
//   and stride byte offsets, and the swizzle mode (none, 32, 64 or 128 bytes), for
//   K-major and MN-major operands, per CUTLASS's canonical layouts. Products are summed
//   in k order onto the accumulator.
// - wgmma groups complete per warpgroup: wgmma.wait_group N returns once every thread of
//   the caller's warpgroup has committed all but the caller's last N groups (a GPU's
//   group cannot complete before all four warps have issued it), so that a thread that
//   runs ahead cannot give back a stage another warp of its warpgroup has yet to read.
// - Named barriers (bar.sync id, n) are rendezvous of n threads; setmaxnreg, the wgmma
//   fences and tensor-map prefetches do nothing here.
// - Clusters (the `_c2` kernels): the cluster's CTAs run as fibers of one scheduler
//   (runtime.h), each with its own shared memory and barriers here. barrier.cluster is a
//   rendezvous of every thread of the cluster; a remote arrive (mapa, then
//   mbarrier.arrive.shared::cluster) and a multicast TMA copy act on the other CTA's
//   barrier and shared memory as on one's own, with two more checks: the barrier's
//   initialisation must have been made visible by a cluster barrier completed since it
//   (fence.mbarrier_init and barrier.cluster), and the CTA must not have exited (a
//   cluster barrier before exit keeps it alive for its peer's last copies and arrives).

struct CmmTensorMap;  // hopper.cu's; the twin reads it as CmmHostTensorMap

namespace cmm_host {

// An sm_90 CTA's largest dynamic shared memory.
constexpr u32 HOPPER_SMEM_BYTES = 232448u;

struct MBarrier {
    u32 expected = 0;   // arrivals per phase
    u32 pending = 0;    // arrivals the current phase still needs
    long long tx = 0;   // transaction bytes the current phase still needs (may dip below 0)
    u32 completed = 0;  // phases completed
    u64 init_sync = 0;  // the cluster barriers completed when it was initialised
};

// What the running block did with the Hopper engine's instructions.
struct HopperBlock {
    u64 serial = ~0ull;
    std::unique_ptr<unsigned char[]> smem;
    std::unordered_map<u32, MBarrier> bars;
    // Per 16-byte chunk: 1 + the barrier offset whose phase publishes it (0: never
    // written by TMA or cp.async; UNTRACKED: a cp.async no mbarrier tracks yet), that
    // phase's index, and whether cp.async (the generic proxy) wrote it; side by side, as
    // a wgmma's check reads all three.
    struct Chunk {
        u32 bar = 0, phase = 0, generic = 0;
    };
    std::vector<Chunk> chunks;
    // Per thread: barrier → phases it has seen complete, and as of its last
    // fence.proxy.async.shared::cta.
    std::vector<std::unordered_map<u32, u32>> observed, fenced;
    // Per thread: its cp.async copies no arrive has published yet, each as its chunk and
    // its group (the count of the thread's commit_groups before the copy).
    struct Copy {
        u32 chunk, group;
    };
    std::vector<std::vector<Copy>> untracked;
    // Per thread: groups closed (commit_group), and landed (every group below it has,
    // as a wait_group has seen).
    std::vector<u32> groups_closed, groups_landed;
    // Per thread: the wgmma groups it has committed.
    std::vector<u32> committed;
    // Per 16-byte chunk, for the TMA stores' staging: written through the generic proxy
    // by a thread that has not fenced since, 1 + the thread whose TMA store may still read
    // it (0: none), and written since a store last read it. Per thread: the chunks it
    // wrote since its last fence, and those its stores read since its last bulk wait.
    struct Staged {
        u32 unfenced = 0, reader = 0, fresh = 0;
    };
    std::vector<Staged> staged;
    std::vector<std::vector<u32>> staged_writes, store_reads;
    // TMA stores issued and not yet waited for to completion: the CTA's, and per thread.
    u32 stores_incomplete = 0;
    std::vector<u32> thread_stores_incomplete;
    static constexpr u32 UNTRACKED = 0xffffffffu;

    // A wgmma's B operand, decoded once for the 128 threads that read all of it (each
    // thread of a warpgroup reads every 16-byte chunk of B, for its own columns): kept
    // with the shared memory and chunk records it came from, and reused only while both
    // are byte for byte the same. What it spares is the decoding and the per-chunk walk,
    // not the checks: a thread uses it only if it has waited for (and, after cp.async,
    // fenced) every phase the operand's chunks need; else it reads B the checked way,
    // which names its error as before.
    struct DecodedOperand {
        bool valid = false;
        u64 desc = 0;
        u32 n = 0, dtype = 0;
        bool mn_major = false;
        // The chunks it was read from, as runs of consecutive chunks [first, end), and
        // their bytes and records as decoded, run after run.
        std::vector<std::pair<u32, u32>> runs;
        std::vector<unsigned char> bytes;
        std::vector<Chunk> records;
        std::vector<float> values;         // element (column, k) at 16 · column + k
        // A thread may use it once it has seen phase `seen` of barrier `bar` complete, and
        // (where cp.async wrote) fenced as of phase `fenced`; bar UNTRACKED: no thread may.
        struct Need {
            u32 bar, seen, fenced;
        };
        std::vector<Need> needs;
    };
    // A thread issues a stage's four k-steps before it yields, and the ping-pong kernels'
    // two warpgroups read two stages: eight operands in use at once.
    DecodedOperand decoded_b[8];
    u32 decoded_next = 0;
};

// The state of the running cluster's CTA of rank `cta`.
inline HopperBlock& hopper_block_at(u32 cta) {
    static thread_local HopperBlock blocks[MAX_CLUSTER];
    HopperBlock& hb = blocks[cta < MAX_CLUSTER ? cta : 0];
    Block* block = running_block;
    const u64 serial = block != nullptr ? block->serial : 0;
    if (hb.serial != serial) {
        hb.serial = serial;
        if (!hb.smem) hb.smem.reset(new unsigned char[HOPPER_SMEM_BYTES]);
        hb.bars.clear();
        hb.chunks.assign(HOPPER_SMEM_BYTES / 16u, HopperBlock::Chunk{});
        const size_t threads = block != nullptr ? block->cta_threads : 1;
        hb.observed.assign(threads, {});
        hb.fenced.assign(threads, {});
        hb.untracked.assign(threads, {});
        hb.groups_closed.assign(threads, 0u);
        hb.groups_landed.assign(threads, 0u);
        hb.committed.assign(threads, 0u);
        hb.staged.assign(HOPPER_SMEM_BYTES / 16u, HopperBlock::Staged{});
        hb.staged_writes.assign(threads, {});
        hb.store_reads.assign(threads, {});
        hb.stores_incomplete = 0;
        hb.thread_stores_incomplete.assign(threads, 0u);
        for (auto& d : hb.decoded_b) d.valid = false;
    }
    return hb;
}

inline Fiber* current_fiber() { return running_block != nullptr ? running_block->current : nullptr; }

// The running thread's CTA's rank in its cluster.
inline u32 current_cta() {
    Fiber* f = current_fiber();
    return f != nullptr ? f->cta : 0u;
}

inline HopperBlock& hopper_block() { return hopper_block_at(current_cta()); }

// The message of a check, with the kernel file's line (a fixed buffer per OS thread: the
// error outlives the call).
inline const char* at_line(const char* file, int line, const char* what) {
    static thread_local char text[320];
    // The first error stands (fail keeps it): never rewrite the text it points at.
    if (thread_error == nullptr) std::snprintf(text, sizeof text, "%s:%d: %s", file, line, what);
    return text;
}

inline bool smem_range(u32 addr, u32 bytes) {
    if ((u64)addr + bytes > HOPPER_SMEM_BYTES) {
        fail("a shared address past an sm_90 CTA's dynamic shared memory");
        return false;
    }
    return true;
}

inline MBarrier* mbarrier_at(u32 cta, u32 bar) {
    HopperBlock& hb = hopper_block_at(cta);
    auto it = hb.bars.find(bar);
    if (bar % 8u != 0u || it == hb.bars.end()) {
        fail("an mbarrier operation on a shared address no mbarrier.init set up (or not 8-byte aligned)");
        return nullptr;
    }
    return &it->second;
}

inline MBarrier* mbarrier(u32 bar) { return mbarrier_at(current_cta(), bar); }

// Whether the running thread may reach CTA `cta` of its cluster (its shared memory, and
// its barrier at `bar` once initialised and made visible); the error says why not.
inline bool reachable(u32 cta, u32 bar) {
    Block* block = running_block;
    if (block == nullptr || cta >= block->ctas) {
        fail("a cluster operation on a CTA rank past the cluster (or outside fibers)");
        return false;
    }
    if (cta == current_cta()) return true;
    if (block->live[cta] == 0) {
        fail("a remote arrive or multicast copy into a CTA of the cluster that has exited: no cluster barrier kept "
             "it alive until its peer's last one");
        return false;
    }
    MBarrier* b = mbarrier_at(cta, bar);
    if (b == nullptr) return false;
    if (b->init_sync >= block->cluster_syncs) {
        fail("a remote arrive or multicast copy on an mbarrier of another CTA whose initialisation no cluster "
             "barrier has made visible (fence.mbarrier_init, then barrier.cluster)");
        return false;
    }
    return true;
}

inline void mbarrier_settle(MBarrier& b) {
    if (b.pending == 0u && b.tx == 0) {
        b.completed += 1u;
        b.pending = b.expected;
        b.tx = 0;
    }
    running_block->progress += 1;
}

inline void mbarrier_arrive_at(u32 cta, u32 bar, long long bytes) {
    MBarrier* b = mbarrier_at(cta, bar);
    if (b == nullptr) return;
    if (b->pending == 0u) {
        fail("an mbarrier arrive past the count the barrier was initialised with");
        return;
    }
    b->tx += bytes;
    b->pending -= 1u;
    mbarrier_settle(*b);
}

inline void mbarrier_arrive(u32 bar, long long bytes) { mbarrier_arrive_at(current_cta(), bar, bytes); }

// An arrive on `bar` that publishes the running thread's cp.async copies by the barrier's
// current phase: every one (`all`: cp.async.mbarrier.arrive, which tracks them until they
// land), or those whose group a wait_group has seen land (a plain arrive's release).
inline void arrive_publishing(u32 bar, bool all) {
    MBarrier* b = mbarrier(bar);
    if (b == nullptr) return;
    HopperBlock& hb = hopper_block();
    const u32 me = linear_thread();
    std::vector<HopperBlock::Copy>& mine = hb.untracked[me];
    const u32 landed = hb.groups_landed[me];
    size_t kept = 0;
    for (const HopperBlock::Copy& copy : mine) {
        HopperBlock::Chunk& c = hb.chunks[copy.chunk];
        if (!all && copy.group >= landed) {
            mine[kept++] = copy;
        } else if (c.bar == HopperBlock::UNTRACKED) {
            c.bar = bar + 1u;
            c.phase = b->completed;
        }
    }
    mine.resize(kept);
    mbarrier_arrive(bar, 0);
}

}  // namespace cmm_host

inline void cmm_mbar_init(u32 bar, u32 count) {
    if (!cmm_host::smem_range(bar, 8u)) return;
    cmm_host::MBarrier b;
    b.expected = b.pending = count;
    b.init_sync = cmm_host::running_block != nullptr ? cmm_host::running_block->cluster_syncs : 0;
    cmm_host::hopper_block().bars[bar] = b;
    cmm_host::running_block->progress += 1;
}

inline void cmm_mbar_init_fence() {}

inline void cmm_mbar_arrive_expect_tx(u32 bar, u32 bytes) { cmm_host::mbarrier_arrive(bar, (long long)bytes); }

// A plain arrive is a release: it publishes the thread's cp.async copies that have landed.
inline void cmm_mbar_arrive(u32 bar) { cmm_host::arrive_publishing(bar, false); }

inline u32 cmm_cluster_ctarank() { return cmm_host::current_cta(); }

inline void cmm_cluster_sync() { cmm_host::barrier(cmm_host::CLUSTER_SYNC); }

inline void cmm_mbar_arrive_cluster(u32 bar, u32 cta) {
    if (cmm_host::reachable(cta, bar)) cmm_host::mbarrier_arrive_at(cta, bar, 0);
}

// Whether the latest phase of parity `parity` has completed; if not, the block's other
// threads run before the caller tries again.
inline bool cmm_mbar_try_wait(u32 bar, u32 parity) {
    cmm_host::MBarrier* b = cmm_host::mbarrier(bar);
    if (b == nullptr) return true;  // the error is recorded; let the thread run out
    // The current (incomplete) phase has parity completed % 2: the latest phase of the
    // other parity is complete (a fresh barrier's phase "-1" counts as complete).
    if ((b->completed & 1u) != (parity & 1u)) {
        // The phase seen: the latest completed one of this parity, if any.
        if (b->completed > 0u) {
            u32& seen = cmm_host::hopper_block().observed[cmm_host::linear_thread()][bar];
            seen = std::max(seen, b->completed);
        }
        return true;
    }
    cmm_host::yield_thread();
    return false;
}

// The host twin's tensor map (cmm-cuda launch.rs `host_tensor_map`): dim2 0 for a
// rank-2 map, else the layers of a rank-3 one, stride2 bytes apart.
struct CmmHostTensorMap {
    u64 base, dim0, dim1, stride, box, dtype, swizzle, dim2, stride2;
    u64 unused[6];
    u64 tag;
};

// A TMA copy of the box at (x, y, z) through a map of rank `rank` (z is 0 for rank 2;
// a rank-3 box is one layer deep) into the shared memory at `dst` of every CTA of the
// cluster in `mask` (bit r: rank r; the issuing CTA alone without multicast), its bytes
// completing on the barrier at `bar` of each.
inline void cmm_tma_load_at(const char* file, int line, u32 rank, u32 dst, const CmmTensorMap* map, u32 x, u32 y,
                            u32 z, u32 bar, u32 mask) {
    using namespace cmm_host;
    const CmmHostTensorMap* m = reinterpret_cast<const CmmHostTensorMap*>(map);
    if (m->tag != 0x636d6d5f746d6170ull) {
        fail(at_line(file, line, "a TMA copy through a tensor map the host twin did not encode"));
        return;
    }
    if ((m->dim2 == 0u ? 2u : 3u) != rank) {
        fail(at_line(file, line, "a TMA copy whose dimension is not its tensor map's rank"));
        return;
    }
    Fiber* me = current_fiber();
    if (me != nullptr && me->acquired) {
        fail(at_line(file, line, "a TMA copy issued after an acquire with no fence.proxy.async between: the async "
                           "proxy need not see the data the acquire made visible"));
        return;
    }
    const u32 box0 = (u32)(m->box & 0xffffffffu), box1 = (u32)(m->box >> 32);
    if (m->swizzle != 128u || box0 * 2u != 128u || dst % 1024u != 0u || box1 == 0u || box1 > 256u) {
        fail(at_line(file, line, "a TMA copy the Hopper engine does not make: 128-byte swizzle, 64 16-bit elements "
                           "per box row, up to 256 rows, into 1024-byte aligned shared memory"));
        return;
    }
    const u32 bytes = box0 * box1 * 2u;
    if (!smem_range(dst, bytes)) return;
    for (u32 cta = 0; cta < MAX_CLUSTER; ++cta) {
        if ((mask >> cta & 1u) == 0u) continue;
        if (!reachable(cta, bar)) return;
        MBarrier* b = mbarrier_at(cta, bar);
        if (b == nullptr) return;
        HopperBlock& hb = hopper_block_at(cta);
        for (u32 r = 0; r < box1; ++r) {
            for (u32 c = 0; c < box0; ++c) {
                const u64 gx = (u64)x + c, gy = (u64)y + r;
                u16 v = 0;
                if (gx < m->dim0 && gy < m->dim1 && (rank == 2u || z < m->dim2)) {
                    v = *(const u16*)(m->base + (u64)z * m->stride2 + gy * m->stride + gx * 2u);
                }
                u32 addr = dst + r * 128u + c * 2u;
                addr ^= ((addr >> 7) & 7u) << 4;
                std::memcpy(hb.smem.get() + addr, &v, 2);
                hb.chunks[addr / 16u] = HopperBlock::Chunk{bar + 1u, b->completed, 0u};
            }
        }
        running_block->progress += 1;
        b->tx -= (long long)bytes;
        mbarrier_settle(*b);
    }
}

#define cmm_tma_load_2d(dst, map, x, y, bar) \
    cmm_tma_load_at(__FILE__, __LINE__, 2u, dst, map, x, y, 0u, bar, 1u << cmm_host::current_cta())
#define cmm_tma_load_3d(dst, map, x, y, z, bar) \
    cmm_tma_load_at(__FILE__, __LINE__, 3u, dst, map, x, y, z, bar, 1u << cmm_host::current_cta())
#define cmm_tma_load_2d_multicast(dst, map, x, y, bar, mask) \
    cmm_tma_load_at(__FILE__, __LINE__, 2u, dst, map, x, y, 0u, bar, (u32)(mask))

inline void cmm_tma_prefetch(const CmmTensorMap*) {}

inline void cmm_hopper_cp_async16(u32 dst, u64 src, u32 src_bytes) {
    using namespace cmm_host;
    if (dst % 16u != 0u || src % 16u != 0u || src_bytes > 16u) {
        fail("cp.async: a 16-byte copy from or to an address that is not 16-byte aligned, or of more than 16 bytes");
        return;
    }
    if (!smem_range(dst, 16u)) return;
    HopperBlock& hb = hopper_block();
    unsigned char* to = hb.smem.get() + dst;
    std::memset(to, 0, 16);
    if (src_bytes != 0u) std::memcpy(to, (const void*)src, src_bytes);
    hb.chunks[dst / 16u].bar = HopperBlock::UNTRACKED;
    hb.chunks[dst / 16u].generic = 1u;
    const u32 me = linear_thread();
    hb.untracked[me].push_back(HopperBlock::Copy{dst / 16u, hb.groups_closed[me]});
    running_block->progress += 1;
}

inline void cmm_hopper_cp_async_commit() {
    cmm_host::HopperBlock& hb = cmm_host::hopper_block();
    hb.groups_closed[cmm_host::linear_thread()] += 1u;
}

// The copies land at once here: waiting marks every group but the latest N landed.
template <u32 N>
inline void cmm_hopper_cp_async_wait() {
    cmm_host::HopperBlock& hb = cmm_host::hopper_block();
    const u32 me = cmm_host::linear_thread();
    const u32 closed = hb.groups_closed[me];
    hb.groups_landed[me] = std::max(hb.groups_landed[me], closed - std::min(N, closed));
}

inline void cmm_hopper_cp_async_arrive(u32 bar) { cmm_host::arrive_publishing(bar, true); }

inline void cmm_fence_proxy_async_shared() {
    cmm_host::HopperBlock& hb = cmm_host::hopper_block();
    const u32 me = cmm_host::linear_thread();
    // As a writer of a TMA store's staging: its writes are visible to the async proxy.
    for (u32 chunk : hb.staged_writes[me]) hb.staged[chunk].unfenced = 0u;
    hb.staged_writes[me].clear();
    // As a reader: the phases it has seen. As a writer: its landed copies, not yet
    // published, are visible to the async proxy once an arrive publishes them.
    hb.fenced[me] = hb.observed[me];
    const u32 landed = hb.groups_landed[me];
    for (const cmm_host::HopperBlock::Copy& copy : hb.untracked[me]) {
        cmm_host::HopperBlock::Chunk& c = hb.chunks[copy.chunk];
        if (copy.group < landed && c.bar == cmm_host::HopperBlock::UNTRACKED) c.generic = 0u;
    }
}

namespace cmm_host {

// A generic-proxy store of `bytes` bytes to the staging at `addr` (within one chunk).
inline void stage(u32 addr, const void* bits, u32 bytes) {
    if (addr % bytes != 0u || addr / 16u != (addr + bytes - 1u) / 16u) {
        fail("a staging store not aligned to its size");
        return;
    }
    if (!smem_range(addr, bytes)) return;
    HopperBlock& hb = hopper_block();
    const u32 me = linear_thread(), chunk = addr / 16u;
    if (hb.staged[chunk].reader != 0u) {
        fail("a store to shared memory a TMA store was issued from, before its issuing thread's "
             "cp.async.bulk.wait_group.read: the store may still be reading it");
        return;
    }
    std::memcpy(hb.smem.get() + addr, bits, bytes);
    if (hb.staged[chunk].unfenced == 0u) hb.staged_writes[me].push_back(chunk);
    hb.staged[chunk].unfenced = 1u;
    hb.staged[chunk].fresh = 1u;
    running_block->progress += 1;
}

// The running thread's TMA stores have read their staging, and with `complete` have
// completed (here a store is made at once; the order of the waits is what is checked).
inline void bulk_wait(bool complete) {
    HopperBlock& hb = hopper_block();
    const u32 me = linear_thread();
    for (u32 chunk : hb.store_reads[me]) hb.staged[chunk].reader = 0u;
    hb.store_reads[me].clear();
    if (complete) {
        hb.stores_incomplete -= hb.thread_stores_incomplete[me];
        hb.thread_stores_incomplete[me] = 0u;
    }
}

}  // namespace cmm_host

inline void cmm_hopper_stage_f32x2(u32 addr, float v0, float v1) {
    const float both[2] = {v0, v1};
    cmm_host::stage(addr, both, 8u);
}

inline void cmm_hopper_stage_b32(u32 addr, u32 bits) { cmm_host::stage(addr, &bits, 4u); }

#define cmm_tma_store_2d(map, src, x, y) cmm_tma_store_at(__FILE__, __LINE__, map, src, x, y)

// A TMA store of the box at (x, y) of `map` from the staging at `src`.
inline void cmm_tma_store_at(const char* file, int line, const CmmTensorMap* map, u32 src, u32 x, u32 y) {
    using namespace cmm_host;
    const CmmHostTensorMap* m = reinterpret_cast<const CmmHostTensorMap*>(map);
    if (m->tag != 0x636d6d5f746d6170ull || m->dim2 != 0u) {
        fail(at_line(file, line, "a TMA store through a tensor map the host twin did not encode, or not 2D"));
        return;
    }
    const u32 size = m->dtype == 0u ? 4u : 2u;
    const u32 box0 = (u32)(m->box & 0xffffffffu), box1 = (u32)(m->box >> 32);
    if (m->swizzle != 128u || box0 * size != 128u || src % 1024u != 0u || box1 == 0u || box1 > 256u) {
        fail(at_line(file, line, "a TMA store the Hopper engine does not make: 128-byte swizzle, 128-byte box rows, up "
                           "to 256 rows, from 1024-byte aligned shared memory"));
        return;
    }
    if (!smem_range(src, box0 * box1 * size)) return;
    HopperBlock& hb = hopper_block();
    const u32 me = linear_thread();
    for (u32 chunk = src / 16u; chunk < (src + box0 * box1 * size) / 16u; ++chunk) {
        if (hb.staged[chunk].unfenced != 0u) {
            fail(at_line(file, line, "a TMA store (the async proxy) reads shared memory written through the generic "
                               "proxy, with no fence.proxy.async.shared::cta by its writer since"));
            return;
        }
        if (hb.staged[chunk].fresh == 0u) {
            fail(at_line(file, line, "a TMA store reads shared memory no thread wrote since the last store from it "
                               "(stale staging)"));
            return;
        }
    }
    for (u32 chunk = src / 16u; chunk < (src + box0 * box1 * size) / 16u; ++chunk) {
        if (hb.staged[chunk].reader == 0u) hb.store_reads[me].push_back(chunk);
        hb.staged[chunk].reader = me + 1u;
        hb.staged[chunk].fresh = 0u;
    }
    hb.stores_incomplete += 1u;
    hb.thread_stores_incomplete[me] += 1u;
    for (u32 r = 0; r < box1; ++r) {
        for (u32 c = 0; c < box0; ++c) {
            const u64 gx = (u64)x + c, gy = (u64)y + r;
            if (gx >= m->dim0 || gy >= m->dim1) continue;
            u32 addr = src + r * 128u + c * size;
            addr ^= ((addr >> 7) & 7u) << 4;
            std::memcpy((void*)(m->base + gy * m->stride + gx * size), hb.smem.get() + addr, size);
        }
    }
    running_block->progress += 1;
}

inline void cmm_bulk_commit() {}
inline void cmm_bulk_wait_read() { cmm_host::bulk_wait(false); }
inline void cmm_bulk_wait() { cmm_host::bulk_wait(true); }

inline void cmm_fence_proxy_async_global() {
    if (cmm_host::Fiber* me = cmm_host::current_fiber()) me->acquired = false;
}

#define cmm_fence_acq_rel_sys() cmm_fence_acq_rel_sys_at(__FILE__, __LINE__)

inline void cmm_fence_acq_rel_sys_at(const char* file, int line) {
    if (cmm_host::hopper_block().stores_incomplete != 0u) {
        cmm_host::fail(cmm_host::at_line(file, line, "a release fence while TMA stores of the CTA have not completed "
                                                     "(no cp.async.bulk.wait_group by their issuer before it)"));
        return;
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

inline u32 cmm_load_relaxed(u64 addr) { return __atomic_load_n((const u32*)addr, __ATOMIC_RELAXED); }

inline u32 cmm_dynamic_smem() {
    cmm_host::hopper_block();
    return 0u;
}

inline void cmm_trap() { cmm_host::fail("a Hopper-engine barrier wait outlasted its deadline (the GPU would trap)"); }

template <u32 N>
inline void cmm_setmaxnreg_dec() {}
template <u32 N>
inline void cmm_setmaxnreg_inc() {}

inline void cmm_bar_sync(u32 id, u32 threads) { cmm_host::named_barrier(id, threads); }

inline void cmm_wgmma_fence() {}

inline void cmm_wgmma_commit() {
    cmm_host::hopper_block().committed[cmm_host::linear_thread()] += 1u;
    if (cmm_host::running_block != nullptr) cmm_host::running_block->progress += 1;
}

// Waits until every thread of the caller's warpgroup has committed all but the caller's
// last N groups.
template <int N>
inline void cmm_wgmma_wait() {
    const u32 me = cmm_host::linear_thread();
    for (;;) {
        const std::vector<u32>& committed = cmm_host::hopper_block().committed;
        if (committed[me] <= (u32)N) return;
        const u32 first = me / 128u * 128u, end = std::min<u32>(first + 128u, (u32)committed.size());
        u32 least = committed[me];
        for (u32 t = first; t < end; ++t) least = std::min(least, committed[t]);
        if (least + (u32)N >= committed[me]) return;
        cmm_host::yield_thread();
    }
}
inline void cmm_pin(float&) {}
inline void cmm_address_here(u64&) {}

inline u32 cmm_pack_f16x2(float lo, float hi) { return cmm_encode(lo, 1u) | (cmm_encode(hi, 1u) << 16); }
inline u32 cmm_pack_bf16x2(float lo, float hi) { return cmm_encode(lo, 2u) | (cmm_encode(hi, 2u) << 16); }

// __shfl_sync(mask, v, src) for a full warp: a rendezvous of the warp, staged per CTA of
// the cluster (its CTAs' fibers share this OS thread).
inline u32 __shfl_sync(u32 mask, u32 v, int src) {
    static thread_local u32 staged[cmm_host::MAX_CLUSTER][1024];
    if (mask != 0xffffffffu || src < 0 || src > 31) {
        cmm_host::fail("__shfl_sync of a partial warp or from a lane past 31");
        return v;
    }
    const u32 me = cmm_host::linear_thread();
    u32* mine = staged[cmm_host::current_cta()];
    mine[me] = v;
    cmm_host::barrier(cmm_host::WARP_COLLECTIVE);
    const u32 got = mine[(me / 32u) * 32u + (u32)src];
    // Nobody restages before every lane has read.
    cmm_host::barrier(cmm_host::WARP_COLLECTIVE);
    return got;
}

namespace cmm_host {

// Where the elements of a wgmma operand lie in shared memory, from its descriptor: rows
// along M or N and K as the canonical layouts of each swizzle mode lay them out (T = 8
// 16-bit elements, one 16-byte unit), then the swizzle. Decoded once per operand of a
// wgmma; every span is a power of two, so the layout's divisions are shifts.
struct OperandLayout {
    u32 start, lbo, sbo, mode, span_shift;
    bool mn_major;

    OperandLayout(u64 desc, bool mn_major_)
        : start((u32)(desc & 0x3fffu) << 4),
          lbo((u32)((desc >> 16) & 0x3fffu) << 4),
          sbo((u32)((desc >> 32) & 0x3fffu) << 4),
          mode((u32)(desc >> 62)),  // 0 none, 1: 128 B, 2: 64 B, 3: 32 B
          // log2 of the bytes of a row: 128, 64, 32, or 16 without swizzle
          span_shift(mode == 1u ? 7u : mode == 2u ? 6u : mode == 3u ? 5u : 4u),
          mn_major(mn_major_) {}

    // The byte offset of element (mn, k): the start, a part from mn and a part from k
    // (they add), then the swizzle of the whole address.
    u32 offset(u32 mn, u32 k) const { return swizzle(start + mn_part(mn) + k_part(k)); }

    u32 mn_part(u32 mn) const {
        // K-major: ((8, m), (T, 2k)), eight rows of `span` bytes, groups of eight SBO apart.
        if (!mn_major) return ((mn & 7u) << span_shift) + (mn >> 3) * sbo;
        if (mode == 0u) return (mn & 7u) * 2u + (mn >> 3) * sbo;
        // MN-major, swizzled: ((T, span/16, m), (8, k)), `span` bytes of M or N contiguous,
        // the next span LBO on.
        const u32 per_shift = span_shift - 1u;  // log2 of the elements of a row
        return (mn & ((1u << per_shift) - 1u)) * 2u + (mn >> per_shift) * lbo;
    }

    u32 k_part(u32 k) const {
        // K-major: along the row (without swizzle: 16-byte units LBO apart).
        if (!mn_major) return mode == 0u ? (k & 7u) * 2u + (k >> 3) * lbo : k * 2u;
        if (mode == 0u) return (k & 7u) * 16u + (k >> 3) * lbo;
        // MN-major, swizzled: K rows `span` bytes apart, groups of eight SBO.
        return ((k & 7u) << span_shift) + (k >> 3) * sbo;
    }

    u32 swizzle(u32 addr) const {
        if (mode == 1u) addr ^= ((addr >> 7) & 7u) << 4;
        if (mode == 2u) addr ^= ((addr >> 7) & 3u) << 4;
        if (mode == 3u) addr ^= ((addr >> 7) & 1u) << 4;
        return addr;
    }
};

// Reads the elements of wgmma operands for one thread, checked: inside shared memory,
// and, if a TMA copy or cp.async wrote them, published to the thread by a phase it has
// waited for (and, for cp.async, fenced). A wgmma runs without yielding, so a chunk
// checked once stays good for the rest of the call.
//
// The elements a thread needs come in runs that share one 16-byte unit: eight along K of
// a K-major row (k = 0..7 or 8..15), two along MN of an MN-major one (an even column and
// the next). Every other term of a layout offset is a multiple of 16 bytes, and the
// swizzles permute whole 16-byte units, so a run is contiguous after the swizzle too. One
// offset, one check and one copy serve the run.
struct OperandReader {
    HopperBlock& hb;
    const std::unordered_map<u32, u32>& seen;    // the thread's barrier → phases seen
    const std::unordered_map<u32, u32>& fenced;  // … as of its last proxy fence
    u32 dtype;
    bool ok = true;
    u32 last_bar = 0, last_seen = 0, last_fenced = 0;  // the last barrier looked up (1 + offset; 0: none)
    u32 good_chunk = ~0u;                              // the last chunk that passed the checks

    // Elements (mn, k) … (mn, k + count - 1) of a K-major operand, or (mn, k) … (mn + count
    // - 1, k) of an MN-major one, into `out`; a run stays inside one 16-byte unit.
    template <u32 count>
    __attribute__((always_inline)) void run(const OperandLayout& layout, u32 mn, u32 k, float* out) {
        run_at<count>(layout.offset(mn, k), out);
    }

    // The same, from the run's (swizzled) address.
    template <u32 count>
    __attribute__((always_inline)) void run_at(u32 addr, float* out) {
        if (addr + 2u * count > HOPPER_SMEM_BYTES) {
            fail("a wgmma descriptor reaches past shared memory");
            ok = false;
            return;
        }
        const u32 chunk = addr / 16u;
        if (chunk != good_chunk && !published(chunk)) return;
        good_chunk = chunk;
        u16 bits[count];
        std::memcpy(bits, hb.smem.get() + addr, sizeof bits);
        for (u32 i = 0; i < count; ++i) out[i] = cmm_decode(bits[i], dtype);
    }

    // Whether the thread may read `chunk`: at once where it was never copied into, or where
    // the barrier last looked up published it to this thread (and fenced it, for
    // cp.async); else the full check.
    __attribute__((always_inline)) bool published(u32 chunk) {
        const HopperBlock::Chunk& c = hb.chunks[chunk];
        if (c.bar == 0u) return true;
        if (c.bar == last_bar) {
            const u32 needed = c.phase + 1u;
            if (last_seen >= needed && (c.generic == 0u || last_fenced >= needed)) return true;
        }
        return check(chunk);
    }

    __attribute__((noinline)) bool check(u32 chunk) {
        const HopperBlock::Chunk& c = hb.chunks[chunk];
        const u32 bar = c.bar;
        if (bar == HopperBlock::UNTRACKED) {
            fail("wgmma reads shared memory a cp.async wrote that no mbarrier tracks (a missing "
                 "cp.async.mbarrier.arrive, or a plain arrive before cp.async.wait_group saw the copy land)");
            ok = false;
            return false;
        }
        if (bar != 0u) {
            if (bar != last_bar) {
                auto it = seen.find(bar - 1u);
                auto fit = fenced.find(bar - 1u);
                last_bar = bar;
                last_seen = it == seen.end() ? 0u : it->second;
                last_fenced = fit == fenced.end() ? 0u : fit->second;
            }
            if (last_seen < c.phase + 1u) {
                fail("wgmma reads shared memory a TMA copy or cp.async wrote, before its thread waited for the "
                     "mbarrier phase that publishes the copy (a missing or short expect-tx or arrive, or a "
                     "skipped wait)");
                ok = false;
                return false;
            }
            if (c.generic != 0u && last_fenced < c.phase + 1u) {
                fail("wgmma (the async proxy) reads shared memory a cp.async (the generic proxy) wrote, with no "
                     "fence.proxy.async.shared::cta by the reading thread after its wait, nor by the writing "
                     "thread between the copy's landing and its arrive");
                ok = false;
                return false;
            }
        }
        return true;
    }
};

// Decodes every element of a wgmma's B operand (N columns, 16 along K) into `d`, with the
// bytes and chunk records it came from and the phases its chunks need; false where an
// element lies past shared memory (the checked path reports that).
template <u32 N>
bool decode_operand(const HopperBlock& hb, const OperandLayout& lb, u32 dtype, HopperBlock::DecodedOperand& d) {
    // One bit per chunk of shared memory: the chunks read, in address order.
    u64 read[HOPPER_SMEM_BYTES / 16u / 64u + 1u] = {};
    u32 first = ~0u, last = 0u;
    d.values.resize(16u * N);
    d.needs.clear();
    for (u32 col = 0; col < N; ++col) {
        for (u32 k = 0; k < 16u; ++k) {
            const u32 addr = lb.offset(col, k);
            if (addr + 2u > HOPPER_SMEM_BYTES) return false;
            u16 bits;
            std::memcpy(&bits, hb.smem.get() + addr, sizeof bits);
            d.values[16u * col + k] = cmm_decode(bits, dtype);
            const u32 chunk = addr / 16u;
            read[chunk / 64u] |= 1ull << (chunk % 64u);
            first = std::min(first, chunk);
            last = std::max(last, chunk);
        }
    }
    d.runs.clear();
    d.bytes.clear();
    d.records.clear();
    for (u32 chunk = first; chunk <= last; ++chunk) {
        if ((read[chunk / 64u] >> (chunk % 64u) & 1u) == 0u) continue;
        if (d.runs.empty() || d.runs.back().second != chunk) d.runs.emplace_back(chunk, chunk);
        ++d.runs.back().second;
        const HopperBlock::Chunk& c = hb.chunks[chunk];
        d.bytes.insert(d.bytes.end(), hb.smem.get() + 16u * chunk, hb.smem.get() + 16u * (chunk + 1u));
        d.records.push_back(c);
        if (c.bar == 0u) continue;
        auto need = std::find_if(d.needs.begin(), d.needs.end(), [&](const auto& n) { return n.bar == c.bar; });
        if (need == d.needs.end()) need = d.needs.insert(d.needs.end(), {c.bar, 0u, 0u});
        need->seen = std::max(need->seen, c.phase + 1u);
        if (c.generic != 0u) need->fenced = std::max(need->fenced, c.phase + 1u);
    }
    return true;
}

// Whether shared memory and its chunk records are still, on every chunk `d` was read
// from, what they were when it was decoded.
inline bool still_as_decoded(const HopperBlock& hb, const HopperBlock::DecodedOperand& d) {
    u32 at = 0;
    for (const auto& [first, end] : d.runs) {
        const u32 count = end - first;
        if (std::memcmp(d.bytes.data() + 16u * at, hb.smem.get() + 16u * first, 16u * count) != 0 ||
            std::memcmp(d.records.data() + at, hb.chunks.data() + first, count * sizeof(HopperBlock::Chunk)) != 0) {
            return false;
        }
        at += count;
    }
    return true;
}

// B's decoded elements for the calling thread, or nullptr where it must read B the
// checked way: no decoding applies, or the thread has not waited for (or fenced) a phase
// that publishes one of B's chunks.
template <u32 N>
const float* decoded_b(HopperBlock& hb, u64 desc, const OperandLayout& lb, u32 dtype,
                       const std::unordered_map<u32, u32>& seen, const std::unordered_map<u32, u32>& fenced) {
    HopperBlock::DecodedOperand* hit = nullptr;
    for (auto& d : hb.decoded_b) {
        if (d.valid && d.desc == desc && d.n == N && d.dtype == dtype && d.mn_major == lb.mn_major &&
            still_as_decoded(hb, d)) {
            hit = &d;
            break;
        }
    }
    if (hit == nullptr) {
        hit = &hb.decoded_b[hb.decoded_next];
        hb.decoded_next = (hb.decoded_next + 1u) % (u32)std::size(hb.decoded_b);
        hit->valid = decode_operand<N>(hb, lb, dtype, *hit);
        if (!hit->valid) return nullptr;
        hit->desc = desc;
        hit->n = N;
        hit->dtype = dtype;
        hit->mn_major = lb.mn_major;
    }
    for (const auto& need : hit->needs) {
        if (need.bar == HopperBlock::UNTRACKED) return nullptr;
        auto s = seen.find(need.bar - 1u);
        if (s == seen.end() || s->second < need.seen) return nullptr;
        if (need.fenced != 0u) {
            auto f = fenced.find(need.bar - 1u);
            if (f == fenced.end() || f->second < need.fenced) return nullptr;
        }
    }
    return hit->values.data();
}

// Four floats in one vector register (GCC and Clang): the twin's wgmma sums four
// accumulators at once, with the same roundings as one at a time.
typedef float Float4 __attribute__((vector_size(16)));

template <u32 N, bool BF16, int TRANS_B>
inline void wgmma(float* d, u64 desc_a, u64 desc_b, u32 accumulate) {
    const u32 t = linear_thread() % 128u, warp = t / 32u, lane = t % 32u;
    HopperBlock& hb = hopper_block();
    OperandReader read{hb, hb.observed[linear_thread()], hb.fenced[linear_thread()], BF16 ? 2u : 1u};
    const OperandLayout la(desc_a, false), lb(desc_b, TRANS_B != 0);
    // B's K offsets, the same for every column.
    u32 b_rows[16];
    for (u32 k = 0; k < 16u; ++k) b_rows[k] = lb.k_part(k);
    float a[2][16];
    for (u32 h = 0; h < 2u && read.ok; ++h) {
        const u32 row = 16u * warp + lane / 4u + 8u * h;
        read.run<8>(la, row, 0u, a[h]);
        if (read.ok) read.run<8>(la, row, 8u, a[h] + 8);
    }
    // Accumulator 4j + 2h + e: row 16·warp + lane/4 + 8h, column 8j + 2·(lane%4) + e. B's
    // 16 rows of the thread's two columns of group j are read once for both rows.
    const float* decoded = read.ok ? decoded_b<N>(hb, desc_b, lb, read.dtype, read.seen, read.fenced) : nullptr;
    for (u32 j = 0; j < N / 8u && read.ok; ++j) {
        const u32 col = 8u * j + 2u * (lane % 4u);
        float b0_read[16], b1_read[16];
        const float* b0 = b0_read;
        const float* b1 = b1_read;
        if (decoded != nullptr) {
            b0 = decoded + 16u * col;
            b1 = decoded + 16u * (col + 1u);
        } else if (TRANS_B != 0) {
            const u32 column = lb.start + lb.mn_part(col);
            for (u32 k = 0; k < 16u && read.ok; ++k) {
                float pair[2];
                read.run_at<2>(lb.swizzle(column + b_rows[k]), pair);
                b0_read[k] = pair[0];
                b1_read[k] = pair[1];
            }
        } else {
            read.run<8>(lb, col, 0u, b0_read);
            if (read.ok) read.run<8>(lb, col, 8u, b0_read + 8);
            if (read.ok) read.run<8>(lb, col + 1u, 0u, b1_read);
            if (read.ok) read.run<8>(lb, col + 1u, 8u, b1_read + 8);
        }
        if (!read.ok) break;
        // Accumulators 4j … 4j + 3 as one vector: (h, e) = (0, 0), (0, 1), (1, 0), (1, 1).
        // Each still takes its products in k order, a multiply and an add apiece.
        Float4 sum = accumulate != 0u ? Float4{d[4u * j], d[4u * j + 1u], d[4u * j + 2u], d[4u * j + 3u]}
                                      : Float4{0.0f, 0.0f, 0.0f, 0.0f};
        for (u32 k = 0; k < 16u; ++k) {
            sum += Float4{a[0][k], a[0][k], a[1][k], a[1][k]} * Float4{b0[k], b1[k], b0[k], b1[k]};
        }
        for (u32 e = 0; e < 4u; ++e) d[4u * j + e] = sum[e];
    }
}

}  // namespace cmm_host

template <bool BF16, int TRANS_B>
inline void cmm_wgmma_n128(float* d, u64 desc_a, u64 desc_b, u32 accumulate) {
    cmm_host::wgmma<128, BF16, TRANS_B>(d, desc_a, desc_b, accumulate);
}

template <bool BF16, int TRANS_B>
inline void cmm_wgmma_n256(float* d, u64 desc_a, u64 desc_b, u32 accumulate) {
    cmm_host::wgmma<256, BF16, TRANS_B>(d, desc_a, desc_b, accumulate);
}
