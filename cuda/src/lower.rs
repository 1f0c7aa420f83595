//! Lowering a plan to the executor's commands, without a GPU.
//!
//! Everything the CUDA executor decides before its first launch is decided here: the
//! order in which ops are enqueued (the schedule order, proven not to hang on the
//! hardware queues by [`cmm_core::verify::queues`]), which engine runs each GEMM, the
//! launch limits of every kernel, and how each `Signal` and `Wait` is issued. The GPU
//! side then only resolves addresses and calls the driver, so the whole corpus is
//! lowered and checked on any machine (`conformance/tests/queues.rs`).

use cmm_core::plan::{Engine, Op, OpSite, Plan, Region};
use cmm_core::schedule::schedule;
use cmm_core::verify::queues::{check_enqueue_order, stream_of, with_fused_runs_whole, DEFAULT_QUEUES, MAX_QUEUES};
use cmm_core::DType;

use crate::error::CudaError;

use cmm_core::engines::{self, EngineSupport};
pub use cmm_core::engines::{hopper_rule, GemmEngine, GemmFacts, GroupedFacts, HopperTile, HOPPER_TILE_M};

/// Which of the Hopper engine's kernels of a tile runs: the engine's own, or one of the
/// variants the GEMM sweep times beside it (plans never take those).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HopperVariant {
    /// What every plan runs: 4 stages of the 128×256 tile, 6 of the 128×128 (192 KiB
    /// each, `CmmHopperWide`, `CmmHopperNarrow` in hopper.cu), one CTA per tile.
    #[default]
    Engine,
    /// A shallower pipeline: 3 stages of the 128×256 tile, 4 of the 128×128
    /// (`CmmHopperWideShallow`, `CmmHopperNarrowShallow`).
    Shallow,
    /// The engine's stages in clusters of two CTAs that take a pair of row tiles and
    /// multicast B's boxes to both (`CmmHopperWidePair`, `CmmHopperNarrowPair`): plain
    /// GEMMs with B N-major only.
    Pair,
    /// The engine's stages of the 128×128 tile with the two consumer warpgroups on
    /// alternate tiles, each a whole tile, so that one's epilogue runs beside the other's
    /// multiplies (`CmmHopperNarrowPingPong`). The 128×256 tile has no such kernel (a
    /// warpgroup would hold 256 accumulators a thread): its GEMMs keep the engine's.
    PingPong,
    /// The engine's kernels, with a grouped GEMM's gathered rows (ag_moe's) staged in
    /// order by `cmm_gather_rows` and loaded by TMA whatever the GEMM's columns (the engine
    /// stages them from [`engines::STAGED_GATHER_MIN_COLUMNS`]): the staged path on the
    /// corpus's small shapes. Other GEMMs run as on the engine's kernels.
    StagedGather,
    /// The engine's kernels, with a grouped GEMM's gathered rows (ag_moe's) copied into
    /// shared memory by the producer warpgroup's `cp.async` inside the kernel whatever the
    /// GEMM's columns, as the engine did on every shape before it staged them (2026-11-28,
    /// after the fence had moved to the producer the same day). Whether staging
    /// them is what the engine's gathered GEMM lacked. Other GEMMs run as on the engine's
    /// kernels.
    InKernelGather,
    /// [`HopperVariant::InKernelGather`] with the gathered rows made visible to wgmma as
    /// the engine did until 2026-11-28: every consumer thread makes the proxy fence after
    /// each stage's wait, rather than each producer thread once its copies have landed
    /// (`CMM_HOPPER_READER_FENCE`). Whether that fence, one wgmma group in flight, is what
    /// stalls the tensor cores. Other GEMMs run as on the engine's kernels.
    ReaderFence,
    /// Each tile's C staged in shared memory and stored by TMA while the warpgroups go on
    /// to the next tile (`CmmHopperWideStore`, `CmmHopperNarrowStore`): the staging, 64 KiB,
    /// takes one stage of each tile (3 of 128×256, 5 of 128×128). For GEMMs not added onto
    /// C, whose C meets TMA's rules, on tiles wholly inside their block's rows (a fused
    /// block released once its stores have completed); the others store from registers as
    /// the engine does. Whether an epilogue with the tensor cores idle limits the engine
    /// where C is large against K.
    TmaStore,
}

impl HopperVariant {
    /// Every variant, the engine's first.
    pub const ALL: [HopperVariant; 8] = [
        HopperVariant::Engine,
        HopperVariant::Shallow,
        HopperVariant::Pair,
        HopperVariant::PingPong,
        HopperVariant::StagedGather,
        HopperVariant::InKernelGather,
        HopperVariant::ReaderFence,
        HopperVariant::TmaStore,
    ];

    /// Its name in options (`conformance --hopper-variant`, a rank worker's options
    /// line): `engine`, `shallow`, `pair`, `pingpong`, `staged-gather`, `in-kernel-gather`,
    /// `reader-fence`, `tma-store`.
    pub fn key(self) -> &'static str {
        match self {
            HopperVariant::Engine => "engine",
            HopperVariant::Shallow => "shallow",
            HopperVariant::Pair => "pair",
            HopperVariant::PingPong => "pingpong",
            HopperVariant::StagedGather => "staged-gather",
            HopperVariant::InKernelGather => "in-kernel-gather",
            HopperVariant::ReaderFence => "reader-fence",
            HopperVariant::TmaStore => "tma-store",
        }
    }

    /// The variant whose kernels this one launches: itself, or the engine's for the
    /// variants of how gathered rows arrive, which are flags and launches around the
    /// engine's kernels.
    pub fn kernels(self) -> HopperVariant {
        match self {
            HopperVariant::StagedGather | HopperVariant::InKernelGather | HopperVariant::ReaderFence => {
                HopperVariant::Engine
            }
            other => other,
        }
    }

    /// Whether a grouped GEMM of `columns` columns over gathered rows has them staged in
    /// order (`cmm_gather_rows`) before the kernel, which loads them by TMA, or copied by
    /// its producer warpgroup: the engine's rule ([`engines::stages_gathered_rows`]) but
    /// where this variant fixes the way.
    pub fn stages_gathered_rows(self, columns: usize) -> bool {
        match self {
            HopperVariant::StagedGather => true,
            HopperVariant::InKernelGather | HopperVariant::ReaderFence => false,
            _ => engines::stages_gathered_rows(columns),
        }
    }

    /// The variant of a GEMM whose tiles no cluster can pair (a fused run's blocks wait
    /// for their own rows; a grouped GEMM's tiles follow its experts): itself, or the
    /// engine's own kernels for [`HopperVariant::Pair`].
    pub fn unpaired(self) -> HopperVariant {
        match self {
            HopperVariant::Pair => HopperVariant::Engine,
            other => other,
        }
    }

    /// The variant a GEMM on `tile` runs when this one is asked for: itself, or the
    /// engine's kernel where the tile has none of this variant.
    pub fn on(self, tile: HopperTile) -> HopperVariant {
        match (self, tile) {
            (HopperVariant::PingPong, HopperTile::Wide) => HopperVariant::Engine,
            _ => self,
        }
    }

    /// The variant [`Self::key`] names, or an error listing the keys.
    pub fn parse(key: &str) -> Result<HopperVariant, String> {
        by_key(key, &HopperVariant::ALL, HopperVariant::key)
    }

    /// CTAs of a cluster.
    pub fn cluster(self) -> u32 {
        match self {
            HopperVariant::Pair => 2,
            HopperVariant::Engine
            | HopperVariant::Shallow
            | HopperVariant::PingPong
            | HopperVariant::StagedGather
            | HopperVariant::InKernelGather
            | HopperVariant::ReaderFence
            | HopperVariant::TmaStore => 1,
        }
    }
}

/// What the CUDA backend's Hopper-engine kernels need beside a tile's shape.
pub trait HopperKernel {
    /// Shared-memory stages of the kernel of this tile at `variant`.
    fn stages(self, variant: HopperVariant) -> u32;
    /// Dynamic shared memory of a CTA (`CmmHopperShape::SMEM_BYTES`): 1024 bytes of
    /// alignment slack, the stages of A (128×64) and B (columns×64, 16-bit), a full and
    /// an empty barrier per stage, and the ping-pong kernels' two turn barriers.
    fn shared_bytes(self, variant: HopperVariant) -> u32;
}

impl HopperKernel for HopperTile {
    fn stages(self, variant: HopperVariant) -> u32 {
        match (self, variant.kernels()) {
            (HopperTile::Wide, HopperVariant::Shallow | HopperVariant::TmaStore) => 3,
            (HopperTile::Narrow, HopperVariant::Shallow) => 4,
            (HopperTile::Narrow, HopperVariant::TmaStore) => 5,
            // The engine's stages (its kernels, the clusters' and the ping-pong ones;
            // (Wide, PingPong) runs the engine's kernel, [`HopperVariant::on`]).
            (HopperTile::Wide, _) => 4,
            (HopperTile::Narrow, _) => 6,
        }
    }

    fn shared_bytes(self, variant: HopperVariant) -> u32 {
        let stage = (HOPPER_TILE_M + self.columns()) as u32 * 64 * 2;
        // The ping-pong kernels' two turn barriers.
        let turns = if variant.on(self) == HopperVariant::PingPong { 16 } else { 0 };
        // The TMA-store kernels' staging of C: 32 KiB per consumer warpgroup.
        let staging = if variant == HopperVariant::TmaStore { 2 * 32768 } else { 0 };
        1024 + self.stages(variant) * stage + staging + 16 * self.stages(variant) + turns
    }
}

/// Where the GPU runs the Hopper engine: its SM count (a plain GEMM's persistent grid),
/// a tile that every GEMM must take (`None`: the tile rule's choice) and the kernel
/// variant of its plain GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HopperTarget {
    /// SMs a persistent grid may take.
    pub sms: u32,
    /// Clusters of two of each tile's [`HopperVariant::Pair`] kernel that the GPU holds at
    /// once (`cuOccupancyMaxActiveClusters`), in [`HopperTile::ALL`]'s order: their grid's
    /// bound, since a cluster that found no room would run after the others.
    pub pair_clusters: [u32; 2],
    /// Force this tile.
    pub tile: Option<HopperTile>,
    /// The kernels' variant ([`HopperVariant::Engine`] but in the GEMM sweep).
    pub variant: HopperVariant,
}

impl HopperTarget {
    /// CTAs of a plain GEMM's persistent grid on `tile` before the tiles bound it: one
    /// per SM, or a cluster's CTAs per co-resident cluster (0 where none fits).
    pub fn ctas(&self, tile: HopperTile) -> u32 {
        let cluster = self.variant.cluster();
        if cluster == 1 {
            return self.sms.max(1);
        }
        let fit = HopperTile::ALL.iter().position(|&t| t == tile).map_or(0, |i| self.pair_clusters[i]);
        self.sms.min(fit.saturating_mul(cluster))
    }
}

/// How `Signal` and `Wait` ops are issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SyncMode {
    /// One-thread kernels: `cmm_signal` (a release add) and `cmm_wait` (an acquire spin
    /// with a deadline and an abort flag), so a wait can never hang the GPU.
    #[default]
    Kernels,
    /// Stream memory operations: `cuStreamWaitValue32` (≥) for waits, and
    /// `cuStreamWriteValue32` of the running total for a signal whose semaphore has a
    /// single signalling lane (the CUDA 13.0 driver has no atomic add among stream
    /// memory operations, so other signals stay `cmm_signal` kernels). Cheaper, but a
    /// wait has no deadline: a hang makes the backend unusable until the process exits.
    StreamMemOps,
}

/// How many GEMMs ran on each engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemmCounts {
    /// cuBLAS calls.
    pub cublas: usize,
    /// Tile-kernel launches (`gemm.cu`), fused runs included.
    pub tile: usize,
    /// Hopper-engine launches (`hopper.cu`), fused runs and grouped GEMMs included.
    pub hopper: usize,
    /// Of the Hopper-engine launches, those in clusters of two ([`HopperVariant::Pair`]).
    pub clusters: usize,
    /// Of the Hopper engine's grouped GEMMs, those whose gathered rows `cmm_gather_rows`
    /// staged in order first ([`HopperVariant::stages_gathered_rows`]).
    pub staged: usize,
}

impl GemmCounts {
    /// The GEMMs of `steps` on each engine (a fused run is one kernel, however many blocks
    /// it has).
    pub fn of(steps: &[Step]) -> GemmCounts {
        let mut counts = GemmCounts::default();
        for step in steps {
            match &step.command {
                Some(Command::Gemm(g)) if g.imp == GemmImpl::Cublas => counts.cublas += 1,
                Some(Command::Gemm(GemmCommand { imp: GemmImpl::Hopper { variant, .. }, .. })) => {
                    counts.hopper += 1;
                    counts.clusters += usize::from(*variant == HopperVariant::Pair);
                }
                Some(Command::FusedGemm(f)) if matches!(f.gemm.imp, GemmImpl::Hopper { .. }) => counts.hopper += 1,
                Some(Command::GroupedGemm { hopper: Some(_), staged, .. }) => {
                    counts.hopper += 1;
                    counts.staged += usize::from(staged.is_some());
                }
                Some(Command::Gemm(_) | Command::FusedGemm(_)) => counts.tile += 1,
                _ => {}
            }
        }
        counts
    }

    /// The engines that ran, e.g. "cuBLAS", "Hopper engine ×2, tile kernels ×1", "Hopper
    /// engine (clusters of two ×1)", "Hopper engine (gathered rows staged ×2)"; "none"
    /// without GEMMs.
    pub fn describe(&self) -> String {
        let notes: Vec<String> = [("clusters of two", self.clusters), ("gathered rows staged", self.staged)]
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(what, n)| format!("{what} ×{n}"))
            .collect();
        let hopper = match notes.as_slice() {
            [] => "Hopper engine".to_string(),
            notes => format!("Hopper engine ({})", notes.join(", ")),
        };
        let parts: Vec<(&str, usize)> =
            [("cuBLAS", self.cublas), (hopper.as_str(), self.hopper), ("tile kernels", self.tile)]
                .into_iter()
                .filter(|(_, n)| *n > 0)
                .collect();
        match parts.as_slice() {
            [] => "none".into(),
            [(name, _)] => (*name).into(),
            many => many.iter().map(|(name, n)| format!("{name} ×{n}")).collect::<Vec<_>>().join(", "),
        }
    }
}

impl std::ops::AddAssign for GemmCounts {
    fn add_assign(&mut self, other: GemmCounts) {
        self.cublas += other.cublas;
        self.tile += other.tile;
        self.hopper += other.hopper;
        self.clusters += other.clusters;
        self.staged += other.staged;
    }
}

/// The one of `all` whose key is `key`, or an error listing the keys (the options that
/// name a value by key: `--hopper-variant`, `--copies`, a rank worker's options line).
pub(crate) fn by_key<T: Copy>(key: &str, all: &[T], key_of: fn(T) -> &'static str) -> Result<T, String> {
    all.iter().copied().find(|&t| key_of(t) == key).ok_or_else(|| {
        let keys: Vec<&str> = all.iter().map(|&t| key_of(t)).collect();
        format!("`{key}` is not one of {}", keys.join(", "))
    })
}

/// An element address: buffer `buffer` of device `device`, `offset` bytes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loc {
    /// Device.
    pub device: usize,
    /// Buffer index in the plan.
    pub buffer: usize,
    /// Byte offset.
    pub offset: u64,
}

/// The GEMM kernel or library call of a `Gemm` op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmImpl {
    /// `cublasGemmEx`.
    Cublas,
    /// `cmm_gemm_mma_f16`.
    MmaF16,
    /// `cmm_gemm_mma_bf16`.
    MmaBf16,
    /// `cmm_gemm_mma_wide_f16`: 128×128 tiles ([`LowerOptions::wide_tiles`]).
    MmaWideF16,
    /// `cmm_gemm_mma_wide_bf16`.
    MmaWideBf16,
    /// `cmm_gemm_simt`.
    Simt,
    /// `cmm_hopper_gemm_*`: the Hopper engine on a persistent grid of at most `ctas` CTAs.
    Hopper {
        /// Its output tile.
        tile: HopperTile,
        /// CTAs of its grid (at most one per tile).
        ctas: u32,
        /// Which of the engine's kernels of the tile.
        variant: HopperVariant,
    },
}

impl GemmImpl {
    /// The kernel (or call) of `engine` for `input` operands; a Hopper-engine GEMM alone
    /// takes a persistent grid of at most `hopper`'s SMs (one CTA per tile), in its variant.
    pub fn on(engine: engines::Engine, input: DType, hopper: Option<HopperTarget>) -> GemmImpl {
        match engine {
            engines::Engine::Cublas => GemmImpl::Cublas,
            engines::Engine::Hopper(tile) => GemmImpl::Hopper {
                tile,
                ctas: hopper.map_or(1, |t| t.ctas(tile)),
                variant: hopper.map_or(HopperVariant::Engine, |t| t.variant.on(tile)),
            },
            engines::Engine::TensorTile { wide } => match (input, wide) {
                (DType::Bf16, false) => GemmImpl::MmaBf16,
                (DType::Bf16, true) => GemmImpl::MmaWideBf16,
                (_, false) => GemmImpl::MmaF16,
                (_, true) => GemmImpl::MmaWideF16,
            },
            // Never a plain or fused GEMM's engine (only `grouped_engine` names it, and
            // grouped GEMMs are not `Gemm` commands): the CUDA cores' kernel nearest it.
            engines::Engine::SimtTile | engines::Engine::ScalarGrouped => GemmImpl::Simt,
        }
    }

    /// The output tile of its kernel, rows by columns (`CMM_TILE`, `CmmTileWide::TILE`
    /// in gemm.cu, the Hopper tiles); cuBLAS has none of cmm's.
    pub fn tile_shape(self) -> (usize, usize) {
        match self {
            GemmImpl::MmaWideF16 | GemmImpl::MmaWideBf16 => (WIDE_TILE, WIDE_TILE),
            GemmImpl::Hopper { tile, .. } => (HOPPER_TILE_M, tile.columns()),
            _ => (TILE, TILE),
        }
    }
}

/// A GEMM with its operands resolved to locations; strides in elements, already
/// valid as leading dimensions (a one-row operand's stride is at least its width).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmCommand {
    /// Left operand storage.
    pub a: Loc,
    /// Right operand storage.
    pub b: Loc,
    /// Result.
    pub c: Loc,
    /// Row strides of the stored matrices.
    pub strides: [u64; 3],
    /// m, n, k.
    pub mnk: [u32; 3],
    /// Dtypes of a, b, c.
    pub dtypes: [DType; 3],
    /// Transpose A.
    pub trans_a: bool,
    /// Transpose B.
    pub trans_b: bool,
    /// c += instead of c =.
    pub accumulate: bool,
    /// Who runs it.
    pub imp: GemmImpl,
}

/// One block of a tile-granular GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedBlock {
    /// op(A)'s storage and its row stride.
    pub a: (Loc, u64),
    /// C and its row stride.
    pub c: (Loc, u64),
    /// Rows of op(A) and C.
    pub rows: u32,
    /// Tiles of the blocks before it.
    pub first_tile: u32,
    /// The first `waits_end` waits of the run gate it.
    pub waits_end: u32,
    /// Its range of the run's signals (performed once it and every block before it are written).
    pub signals: (u32, u32),
}

/// A tile-granular GEMM ([`cmm_core::plan::FusedRun`]): `cmm_fused_gemm_*`, one
/// persistent kernel whose waits and signals between blocks happen inside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedGemmCommand {
    /// Block 0 as a GEMM: b, n, k, dtypes, transposes, accumulation and the tile kernel.
    pub gemm: GemmCommand,
    /// The blocks, in order.
    pub blocks: Vec<FusedBlock>,
    /// The run's waits in lane order: (device, semaphore, value).
    pub waits: Vec<(usize, usize, u32)>,
    /// The run's signals in lane order: (device, semaphore, increment).
    pub signals: Vec<(usize, usize, u32)>,
    /// The status slot of the first wait; the others follow.
    pub first_slot: usize,
    /// Tiles of all blocks.
    pub tiles: u32,
    /// Column tiles of a row of tiles (of the kernel's [`GemmImpl::tile_shape`]).
    pub tiles_n: u32,
}

/// The output tile edge of the tile kernels (`CMM_TILE` in gemm.cu).
pub const TILE: usize = 64;

/// The output tile edge of the wide tensor-core kernels (`CmmTileWide::TILE` in gemm.cu).
pub const WIDE_TILE: usize = 128;

/// One driver call or launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// A GEMM.
    Gemm(GemmCommand),
    /// A tile-granular GEMM (a fused run of the plan).
    FusedGemm(FusedGemmCommand),
    /// `cuMemcpy2DAsync` (pitches and width in bytes).
    CopyEngine {
        /// Source.
        src: Loc,
        /// Source pitch.
        src_pitch: usize,
        /// Destination.
        dst: Loc,
        /// Destination pitch.
        dst_pitch: usize,
        /// Bytes per row.
        width: usize,
        /// Rows.
        rows: usize,
    },
    /// `cmm_copy2d` (strides in elements).
    SmCopy {
        /// Source.
        src: Loc,
        /// Source stride.
        src_stride: u64,
        /// Destination.
        dst: Loc,
        /// Destination stride.
        dst_stride: u64,
        /// Rows.
        rows: u32,
        /// Columns.
        cols: u32,
        /// Bytes per element.
        elem_bytes: u32,
    },
    /// `cmm_reduce` of up to [`MAX_REDUCE_INPUTS`] inputs, summed left to right.
    Reduce(Elementwise),
    /// `cmm_pointwise` (GeLU and its backward) of up to two inputs.
    Pointwise {
        /// The function's code (`Pointwise::code`).
        function: u32,
        /// Output and inputs.
        target: Elementwise,
    },
    /// `cmm_attend`: one key block of attention (`Op::Attend`).
    Attend {
        /// q, k, v, then the state's max, sum and acc: (location, stride, dtype).
        tensors: [(Loc, u64, DType); 6],
        /// Query rows.
        rows: u32,
        /// Keys of the block.
        keys: u32,
        /// Query heads.
        heads: u32,
        /// Query heads per kv head.
        group: u32,
        /// Head dimension.
        head_dim: u32,
        /// The causal mask's (q_pos, k_pos), if any.
        causal: Option<(u32, u32)>,
        /// Start from the empty state.
        fresh: bool,
    },
    /// `cmm_attn_state`: a merge (`from` into `into`) or a finish (`into` into `out`
    /// and `lse`).
    AttnState {
        /// 0: merge, 1: finish.
        function: u32,
        /// from's max, sum, acc; into's max, sum, acc; out; lse: (location, stride, dtype).
        tensors: [(Loc, u64, DType); 8],
        /// Rows.
        rows: u32,
        /// Heads.
        heads: u32,
        /// Head dimension.
        head_dim: u32,
    },
    /// `cmm_route`, three launches (count, scan, fill): the routing tables (`Op::Route`).
    Route {
        /// The router's ids and their row stride.
        ids: (Loc, u64),
        /// The segment offsets.
        seg: Loc,
        /// The row permutation and its stride.
        perm: (Loc, u64),
        /// The inverse (tokens × slots) and its stride.
        inv: (Loc, u64),
        /// Tokens, slots, experts, chunks, row capacity, shards.
        sizes: [u32; 6],
    },
    /// `cmm_grouped_gemm`, or the Hopper engine where `hopper` says
    /// ([`engines::grouped_engine`]) (`Op::GroupedGemm`).
    GroupedGemm {
        /// a, b, c: (location, stride, dtype).
        tensors: [(Loc, u64, DType); 3],
        /// The segment offsets.
        seg: Loc,
        /// The row permutation and its stride.
        perm: (Loc, u64),
        /// a's rows, c's rows, n, k.
        shape: [u32; 4],
        /// chunks, chunk, first group, end of groups, experts, slots.
        routing: [u32; 6],
        /// The first token of a gathered shard, if a's rows are gathered.
        gather: Option<u32>,
        /// Zero the rows past the routed ones.
        zero_unrouted: bool,
        /// The Hopper engine's tile, the CTAs of its persistent grid and its kernels'
        /// variant; `None`: the scalar kernel.
        hopper: Option<(HopperTile, u32, HopperVariant)>,
        /// Where gathered rows are staged in order for the Hopper engine's TMA loads (c's
        /// rows × K in a's dtype, the lane's [`Lowered::staging`] region), or `None`.
        staged: Option<Loc>,
    },
    /// `cmm_combine` (`Op::Combine`).
    Combine {
        /// The expert rows, weights, inverse table and output: (location, stride, dtype).
        tensors: [(Loc, u64, DType); 4],
        /// The expert rows' row count.
        src_rows: u32,
        /// Tokens, columns, slots.
        shape: [u32; 3],
    },
    /// `cmm_signal`: a release add on semaphore `sem` of `device`.
    SignalAdd {
        /// Target device.
        device: usize,
        /// Semaphore index.
        sem: usize,
        /// Increment.
        add: u32,
    },
    /// `cuStreamWriteValue32` of the semaphore's running total (single signalling lane).
    SignalWrite {
        /// Target device.
        device: usize,
        /// Semaphore index.
        sem: usize,
        /// The total after this signal.
        value: u32,
    },
    /// `cmm_wait` with its status slot.
    WaitKernel {
        /// The waiting device (its own semaphore).
        device: usize,
        /// Semaphore index.
        sem: usize,
        /// Value to reach.
        value: u32,
        /// Index of the wait's status words.
        slot: usize,
    },
    /// `cuStreamWaitValue32` (≥).
    WaitValue {
        /// The waiting device.
        device: usize,
        /// Semaphore index.
        sem: usize,
        /// Value to reach.
        value: u32,
    },
}

/// An elementwise kernel's output and inputs (`cmm_reduce`, `cmm_pointwise`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Elementwise {
    /// Output.
    pub out: Loc,
    /// Output stride.
    pub out_stride: u64,
    /// Output dtype.
    pub out_dtype: DType,
    /// Rows.
    pub rows: u32,
    /// Columns.
    pub cols: u32,
    /// Inputs: (location, stride, dtype).
    pub inputs: Vec<(Loc, u64, DType)>,
}

impl Command {
    /// The driver calls that enqueue it when `copies` issues the copies: a strided copy
    /// asked of the copy engines one a row, the routing tables three launches, a grouped
    /// GEMM with staged rows two, any other one ([`crate::launch::submissions`]' count).
    pub fn driver_calls(&self, copies: crate::CopyIssue) -> usize {
        match self {
            Command::CopyEngine { src_pitch, dst_pitch, width, rows, .. } => {
                copies.batch_entries(*width, *rows, *src_pitch, *dst_pitch).unwrap_or(1)
            }
            Command::Route { .. } => 3,
            Command::GroupedGemm { staged: Some(_), hopper: Some(_), .. } => 2,
            _ => 1,
        }
    }
}

/// The most inputs `cmm_reduce` sums in one launch: the plan model's limit.
pub use cmm_core::plan::MAX_REDUCE_INPUTS;

/// One op of the plan, in enqueue order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// The op.
    pub site: OpSite,
    /// Its stream (`device · lanes + lane`).
    pub stream: usize,
    /// What to issue; `None` for an op with nothing to move (an empty region).
    pub command: Option<Command>,
}

/// A plan lowered for the executor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lowered {
    /// Every op, in the order it is enqueued.
    pub steps: Vec<Step>,
    /// Number of streams (`devices · lanes`).
    pub streams: usize,
    /// The wait of each status slot (kernel waits only).
    pub wait_slots: Vec<OpSite>,
    /// The hardware queue count the order was proven safe for.
    pub queues: usize,
    /// Device memory that the executor owns beside the plan's buffers: per stream that
    /// stages a grouped GEMM's gathered rows, its device and the bytes of its largest
    /// staging. One region serves every grouped GEMM of its stream, which runs them one
    /// after another. A [`Loc`] names region j as buffer `plan.buffers.len() + j`.
    pub staging: Vec<Staging>,
}

/// A staging region of [`Lowered::staging`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staging {
    /// The stream whose grouped GEMMs it serves.
    pub stream: usize,
    /// Its device.
    pub device: usize,
    /// Its size.
    pub bytes: u64,
}

impl Lowered {
    /// Which engine runs the GEMMs of its steps.
    pub fn gemms(&self) -> GemmCounts {
        GemmCounts::of(&self.steps)
    }

    /// Per device, the bytes of each staging region, in [`Lowered::staging`]'s order (0
    /// for another device's): the sizes to allocate after the plan's `buffers`.
    pub fn staging_bytes(&self, device: usize) -> impl Iterator<Item = u64> + '_ {
        self.staging.iter().map(move |s| if s.device == device { s.bytes } else { 0 })
    }

    /// The fused GEMMs, in step order (the order of their tables).
    pub(crate) fn fused_gemms(&self) -> impl Iterator<Item = &FusedGemmCommand> {
        self.steps.iter().filter_map(|step| match &step.command {
            Some(Command::FusedGemm(f)) => Some(f),
            _ => None,
        })
    }

    /// The most driver calls that enqueue one stream's steps when `copies` issues the
    /// copies ([`Command::driver_calls`]). (On an H200 a lane with 1,280 strided copies
    /// asked of the copy engines, one call a row, held the host behind the gate until the
    /// gate's deadline; one with 768 did not, 2026-11-27.)
    pub fn most_calls_on_a_stream(&self, copies: crate::CopyIssue) -> usize {
        let mut calls = vec![0; self.streams];
        for step in &self.steps {
            calls[step.stream] += step.command.as_ref().map_or(1, |c| c.driver_calls(copies));
        }
        calls.into_iter().max().unwrap_or(0)
    }
}

/// What lowering may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LowerOptions {
    /// GEMM engine policy.
    pub gemm: GemmEngine,
    /// How signals and waits are issued.
    pub sync: SyncMode,
    /// Whether libcublas can be loaded.
    pub cublas_present: bool,
    /// Hardware queues to prove the order safe for.
    pub queues: usize,
    /// f16 and bf16 GEMMs on the tile kernels, fused ones included, take the 128×128
    /// tiles (`cmm_gemm_mma_wide_*`) instead of the 64×64 ones.
    pub wide_tiles: bool,
    /// The GPU runs the Hopper engine: GEMMs that would run on the tile kernels, fused
    /// ones included, take it where [`hopper_rule`] allows.
    pub hopper: Option<HopperTarget>,
}

impl LowerOptions {
    /// What the engines rule may pick from under these options.
    pub fn engine_support(&self) -> EngineSupport {
        EngineSupport {
            cublas: self.cublas_present,
            hopper_sms: self.hopper.map(|t| t.sms),
            hopper_tile: self.hopper.and_then(|t| t.tile),
            wide_tiles: self.wide_tiles,
        }
    }
}

/// The hardware queue count of this process: `CUDA_DEVICE_MAX_CONNECTIONS`, 8 when unset.
pub fn hardware_queues() -> Result<usize, CudaError> {
    parse_queues(std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok().as_deref())
}

/// Parses a `CUDA_DEVICE_MAX_CONNECTIONS` value (`None`: unset, CUDA's default of 8).
pub fn parse_queues(value: Option<&str>) -> Result<usize, CudaError> {
    let Some(text) = value else { return Ok(DEFAULT_QUEUES) };
    match text.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_QUEUES).contains(&n) => Ok(n),
        _ => Err(CudaError::Environment {
            variable: "CUDA_DEVICE_MAX_CONNECTIONS",
            value: text.to_string(),
            expected: "an integer from 1 to 32",
        }),
    }
}

/// Lowers `plan` (validated) in its schedule order, after proving that order safe.
pub fn lower(plan: &Plan, options: &LowerOptions) -> Result<Lowered, CudaError> {
    let order = schedule(plan)?.order;
    lower_in_order(plan, &order, options)
}

/// Lowers `plan` in the given enqueue order, refusing an order that could hang on
/// `options.queues` hardware queues.
///
/// A fused run is one kernel, enqueued where the order reaches its last block
/// ([`with_fused_runs_whole`]).
pub fn lower_in_order(plan: &Plan, order: &[OpSite], options: &LowerOptions) -> Result<Lowered, CudaError> {
    let runs = plan.fused_runs()?;
    let run_of = |s: &OpSite| runs.iter().position(|r| r.holds(*s));
    let contiguous = with_fused_runs_whole(order, &runs);
    let order = &contiguous[..];
    check_enqueue_order(plan, order, options.queues)?;
    if options.gemm == GemmEngine::Cublas && !options.cublas_present {
        return Err(CudaError::NoCublas);
    }
    let writes = signal_writes(plan, options.sync)?;
    let mut lowered = Lowered {
        steps: Vec::with_capacity(order.len()),
        streams: plan.devices * plan.lanes.len(),
        wait_slots: Vec::new(),
        queues: options.queues,
        staging: Vec::new(),
    };
    for site in order {
        let op = &plan.programs[site.device].lanes[site.lane][site.index];
        let command = match run_of(site) {
            Some(i) if site.index == runs[i].blocks[0] => {
                Some(Command::FusedGemm(lower_fused(plan, &runs[i], options, &mut lowered)?))
            }
            // Inside the kernel.
            Some(_) => None,
            None => stage_gathered_rows(
                plan,
                *site,
                lower_op(plan, *site, op, options, &writes, &mut lowered)?,
                &mut lowered,
            ),
        };
        lowered.steps.push(Step { site: *site, stream: stream_of(plan, *site), command });
    }
    Ok(lowered)
}

/// For stream-memory-op sync: per signal site, the running total it writes, for the
/// semaphores that exactly one lane signals.
fn signal_writes(plan: &Plan, sync: SyncMode) -> Result<Vec<(OpSite, u32)>, CudaError> {
    if sync != SyncMode::StreamMemOps {
        return Ok(Vec::new());
    }
    let mut signallers: std::collections::BTreeMap<(usize, usize), Vec<(OpSite, u32)>> = Default::default();
    for (site, op) in plan.ops() {
        if let Op::Signal { device, sem, add } = op {
            signallers.entry((*device, sem.0)).or_default().push((site, *add));
        }
    }
    let mut writes = Vec::new();
    for ((device, sem), signals) in signallers {
        let (d0, l0) = (signals[0].0.device, signals[0].0.lane);
        if signals.iter().any(|(s, _)| (s.device, s.lane) != (d0, l0)) {
            continue;
        }
        // `plan.ops()` walks each lane in program order, so this is the running total.
        let mut total = 0u32;
        for (site, add) in signals {
            total = total.checked_add(add).ok_or_else(|| CudaError::Unsupported {
                plan: plan.name.clone(),
                what: format!("semaphore {} of device {device} passes 2^32", plan.semaphores[sem]),
            })?;
            writes.push((site, total));
        }
    }
    Ok(writes)
}

/// A grouped GEMM whose gathered rows the Hopper engine loads by TMA
/// ([`HopperVariant::stages_gathered_rows`]) staged in its stream's region, which grows to
/// its rows × K (rounded up to 16 bytes); any other command as it is.
fn stage_gathered_rows(
    plan: &Plan,
    site: OpSite,
    mut command: Option<Command>,
    lowered: &mut Lowered,
) -> Option<Command> {
    if let Some(Command::GroupedGemm {
        tensors, shape, gather: Some(_), hopper: Some((_, _, variant)), staged, ..
    }) = &mut command
    {
        let [_, rows, columns, k] = shape.map(u64::from);
        if variant.stages_gathered_rows(columns as usize) {
            let bytes =
                rows * u64::from(crate::launch::staged_row_elements(k as u32)) * tensors[0].2.size_bytes() as u64;
            let stream = stream_of(plan, site);
            let index = lowered.staging.iter().position(|s| s.stream == stream).unwrap_or_else(|| {
                lowered.staging.push(Staging { stream, device: site.device, bytes: 0 });
                lowered.staging.len() - 1
            });
            lowered.staging[index].bytes = lowered.staging[index].bytes.max(bytes);
            *staged = Some(Loc { device: site.device, buffer: plan.buffers.len() + index, offset: 0 });
        }
    }
    command
}

/// The persistent kernel of a fused run, on the engine the engines rule gives the run
/// ([`engines::fused_engine`]).
fn lower_fused(
    plan: &Plan,
    run: &cmm_core::plan::FusedRun,
    options: &LowerOptions,
    lowered: &mut Lowered,
) -> Result<FusedGemmCommand, CudaError> {
    let unsupported = unsupported_in(plan, run);
    let ops = &plan.programs[run.device].lanes[run.lane];
    let blocks: Vec<GemmFacts> = run.blocks.iter().filter_map(|&i| GemmFacts::of(plan, &ops[i])).collect();
    let engine =
        engines::fused_engine(options.gemm, &options.engine_support(), &blocks, plan.devices).map_err(unsupported)?;
    let on = match engine {
        engines::Engine::Hopper(tile) => {
            let hopper = options.hopper.map(|t| HopperTarget { tile: Some(tile), variant: t.variant.unpaired(), ..t });
            LowerOptions { hopper, ..*options }
        }
        _ => LowerOptions { hopper: None, ..*options },
    };
    lower_fused_on(plan, run, &on, lowered)
}

/// An `Unsupported` error about a fused run, naming its first block.
fn unsupported_in<'p>(plan: &'p Plan, run: &cmm_core::plan::FusedRun) -> impl Fn(String) -> CudaError + 'p {
    let first = OpSite { device: run.device, lane: run.lane, index: run.blocks[0] };
    move |what| CudaError::Unsupported { plan: plan.name.clone(), what: format!("{first}: {what}") }
}

/// Whether two blocks' GEMMs run on the same kernel (the Hopper engine's grid is the
/// fused run's own, whatever each block alone would take).
fn same_kernel(a: GemmImpl, b: GemmImpl) -> bool {
    match (a, b) {
        (GemmImpl::Hopper { tile: x, variant: a, .. }, GemmImpl::Hopper { tile: y, variant: b, .. }) => {
            (x, a) == (y, b)
        }
        (GemmImpl::Hopper { .. }, _) | (_, GemmImpl::Hopper { .. }) => false,
        _ => true,
    }
}

/// [`lower_fused`] with `options` set for the run's engine; an error if the blocks'
/// kernels differ.
fn lower_fused_on(
    plan: &Plan,
    run: &cmm_core::plan::FusedRun,
    options: &LowerOptions,
    lowered: &mut Lowered,
) -> Result<FusedGemmCommand, CudaError> {
    let first = OpSite { device: run.device, lane: run.lane, index: run.blocks[0] };
    let unsupported = unsupported_in(plan, run);
    // Block 0 lowered as a GEMM on cmm's kernels (with `options` the run's engine) gives
    // the shared operand, shape and kernel; every other block takes the same kernel.
    let own = LowerOptions { gemm: GemmEngine::TileKernel, ..*options };
    let ops = &plan.programs[run.device].lanes[run.lane];
    let lower_block = |index: usize, lowered: &mut Lowered| -> Result<GemmCommand, CudaError> {
        let site = OpSite { index, ..first };
        match lower_op(plan, site, &ops[index], &own, &[], lowered)? {
            Some(Command::Gemm(g)) => Ok(g),
            _ => Err(unsupported(format!("block at op {index} has no output"))),
        }
    };
    let gemm = lower_block(run.blocks[0], lowered)?;
    let gemm_of = |index: usize, lowered: &mut Lowered| -> Result<GemmCommand, CudaError> {
        let g = lower_block(index, lowered)?;
        if !same_kernel(g.imp, gemm.imp) {
            return Err(unsupported(format!("block at op {index} runs on {:?}, block 0 on {:?}", g.imp, gemm.imp)));
        }
        Ok(g)
    };
    let (edge, edge_n) = gemm.imp.tile_shape();
    let tiles_n = (gemm.mnk[1] as usize).div_ceil(edge_n);
    let mut command = FusedGemmCommand {
        gemm,
        blocks: Vec::new(),
        waits: Vec::new(),
        signals: Vec::new(),
        first_slot: lowered.wait_slots.len(),
        tiles: 0,
        tiles_n: tiles_n as u32,
    };
    let mut tiles = 0usize;
    for (index, op) in ops.iter().enumerate().take(run.end() + 1).skip(run.blocks[0]) {
        match op {
            Op::Gemm { .. } => {
                let g = if index == run.blocks[0] { command.gemm } else { gemm_of(index, lowered)? };
                let rows = g.mnk[0] as usize;
                let block_tiles = rows.div_ceil(edge) * tiles_n;
                if block_tiles == 0 {
                    return Err(unsupported(format!(
                        "block at op {index} of fused gemm {} has no output tile ({rows} rows, {} columns)",
                        run.id, g.mnk[1]
                    )));
                }
                let signal_at = command.signals.len() as u32;
                command.blocks.push(FusedBlock {
                    a: (g.a, g.strides[0]),
                    c: (g.c, g.strides[2]),
                    rows: rows as u32,
                    first_tile: tiles as u32,
                    waits_end: command.waits.len() as u32,
                    signals: (signal_at, signal_at),
                });
                tiles += block_tiles;
            }
            Op::Wait { sem, value } => {
                command.waits.push((run.device, sem.0, *value));
                lowered.wait_slots.push(OpSite { index, ..first });
            }
            Op::Signal { device, sem, add } => {
                command.signals.push((*device, sem.0, *add));
                if let Some(last) = command.blocks.last_mut() {
                    last.signals.1 = command.signals.len() as u32;
                }
            }
            other => return Err(unsupported(format!("`{}` inside a fused gemm", plan.op_text(other)))),
        }
    }
    command.tiles = u32::try_from(tiles).map_err(|_| unsupported(format!("{tiles} tiles exceed the tile counter")))?;
    Ok(command)
}

fn lower_op(
    plan: &Plan,
    site: OpSite,
    op: &Op,
    options: &LowerOptions,
    writes: &[(OpSite, u32)],
    lowered: &mut Lowered,
) -> Result<Option<Command>, CudaError> {
    let d = site.device;
    let dt = |r: &Region| plan.buffer(r.buf).dtype;
    let loc = |device: usize, r: &Region| Loc {
        device,
        buffer: r.buf.0,
        offset: (r.offset * plan.buffer(r.buf).dtype.size_bytes()) as u64,
    };
    let unsupported =
        |what: String| CudaError::Unsupported { plan: plan.name.clone(), what: format!("{site}: {what}") };
    // A one-row region may have any stride; as a leading dimension it must cover the row.
    let ld = |r: &Region| if r.rows <= 1 { r.stride.max(r.cols) } else { r.stride } as u64;
    let elementwise = |output: &Region, inputs: &[Region]| Elementwise {
        out: loc(d, output),
        out_stride: output.stride as u64,
        out_dtype: dt(output),
        rows: output.rows as u32,
        cols: output.cols as u32,
        inputs: inputs.iter().map(|r| (loc(d, r), r.stride as u64, dt(r))).collect(),
    };
    Ok(match op {
        Op::Gemm { a, b, c, trans_a, trans_b, accumulate, c_device, .. } => {
            let (m, n) = (c.rows, c.cols);
            let k = if *trans_a { a.rows } else { a.cols };
            if m == 0 || n == 0 {
                return Ok(None);
            }
            let facts = GemmFacts::of(plan, op).expect("a gemm");
            let engine = engines::plain_engine(options.gemm, &options.engine_support(), &facts).map_err(unsupported)?;
            let mut imp = GemmImpl::on(engine, facts.dtypes[0], options.hopper);
            if matches!(imp, GemmImpl::Hopper { variant: HopperVariant::Pair, .. }) && *trans_b {
                // Clusters multicast B's N-major boxes: a transposed B keeps the engine's
                // own kernel (the run's counts say how many ran in clusters).
                let own = options.hopper.map(|t| HopperTarget { variant: HopperVariant::Engine, ..t });
                imp = GemmImpl::on(engine, facts.dtypes[0], own);
            }
            let (edge_m, edge_n) = imp.tile_shape();
            if imp != GemmImpl::Cublas
                && (m.div_ceil(edge_m) > 65_535 || n.div_ceil(edge_n) > i32::MAX as usize || k > u32::MAX as usize)
            {
                return Err(unsupported(format!("gemm {m}x{n}x{k} exceeds the tile kernel's grid")));
            }
            Some(Command::Gemm(GemmCommand {
                a: loc(d, a),
                b: loc(d, b),
                // A peer's c: the kernel reaches it through peer access, as an SM copy does.
                c: loc(c_device.unwrap_or(d), c),
                strides: [ld(a), ld(b), ld(c)],
                mnk: [m as u32, n as u32, k as u32],
                dtypes: [dt(a), dt(b), dt(c)],
                trans_a: *trans_a,
                trans_b: *trans_b,
                accumulate: *accumulate,
                imp,
            }))
        }
        Op::Copy { src, dst_device, dst, engine } => {
            if src.is_empty() {
                return Ok(None);
            }
            let es = dt(src).size_bytes();
            match engine {
                Engine::CopyEngine => Some(Command::CopyEngine {
                    src: loc(d, src),
                    src_pitch: ld(src) as usize * es,
                    dst: loc(*dst_device, dst),
                    dst_pitch: ld(dst) as usize * es,
                    width: src.cols * es,
                    rows: src.rows,
                }),
                Engine::Sm => {
                    if src.rows > u32::MAX as usize || src.cols > u32::MAX as usize {
                        return Err(unsupported(format!("SM copy of {}x{} elements", src.rows, src.cols)));
                    }
                    Some(Command::SmCopy {
                        src: loc(d, src),
                        src_stride: src.stride as u64,
                        dst: loc(*dst_device, dst),
                        dst_stride: dst.stride as u64,
                        rows: src.rows as u32,
                        cols: src.cols as u32,
                        elem_bytes: es as u32,
                    })
                }
            }
        }
        Op::Reduce { inputs, output } => {
            if inputs.len() > MAX_REDUCE_INPUTS {
                return Err(unsupported(format!(
                    "reduce of {} inputs (cmm_reduce sums at most {MAX_REDUCE_INPUTS})",
                    inputs.len()
                )));
            }
            if output.is_empty() {
                return Ok(None);
            }
            if output.rows > u32::MAX as usize || output.cols > u32::MAX as usize {
                return Err(unsupported(format!("reduce of {}x{} elements", output.rows, output.cols)));
            }
            Some(Command::Reduce(elementwise(output, inputs)))
        }
        Op::Pointwise { function, inputs, output } => {
            if output.is_empty() {
                return Ok(None);
            }
            if output.rows > u32::MAX as usize || output.cols > u32::MAX as usize || inputs.len() > 2 {
                return Err(unsupported(format!(
                    "{} of {}x{} elements, {} inputs",
                    function.name(),
                    output.rows,
                    output.cols,
                    inputs.len()
                )));
            }
            Some(Command::Pointwise { function: function.code(), target: elementwise(output, inputs) })
        }
        Op::Attend { q, k, v, state, heads, kv_heads, causal, fresh } => {
            let dh = q.cols / heads;
            let fits = [q.rows, k.rows, *heads, dh].iter().all(|&x| x <= u32::MAX as usize)
                && causal
                    .is_none_or(|c| c.q_pos + q.rows <= u32::MAX as usize && c.k_pos + k.rows <= u32::MAX as usize);
            if !fits {
                return Err(unsupported(format!("attention over {}x{} queries and {} keys", q.rows, q.cols, k.rows)));
            }
            if q.rows == 0 {
                return Ok(None);
            }
            let t = |r: &Region| (loc(d, r), r.stride as u64, dt(r));
            Some(Command::Attend {
                tensors: [t(q), t(k), t(v), t(&state.max), t(&state.sum), t(&state.acc)],
                rows: q.rows as u32,
                keys: k.rows as u32,
                heads: *heads as u32,
                group: (heads / kv_heads) as u32,
                head_dim: dh as u32,
                causal: causal.map(|c| (c.q_pos as u32, c.k_pos as u32)),
                fresh: *fresh,
            })
        }
        Op::AttnMerge { .. } | Op::AttnFinish { .. } => {
            let t = |r: &Region| (loc(d, r), r.stride as u64, dt(r));
            let (function, from, into, heads, out) = match op {
                Op::AttnMerge { from, into, heads } => (0, from, into, *heads, None),
                Op::AttnFinish { state, out, lse, heads } => (1, state, state, *heads, Some((out, lse))),
                _ => unreachable!("matched above"),
            };
            if into.max.rows == 0 {
                return Ok(None);
            }
            let [fm, fl, fa] = from.regions().map(|r| t(&r));
            let [im, il, ia] = into.regions().map(|r| t(&r));
            let (o, l) = out.map_or((im, im), |(o, l)| (t(o), t(l)));
            Some(Command::AttnState {
                function,
                tensors: [fm, fl, fa, im, il, ia, o, l],
                rows: into.max.rows as u32,
                heads: heads as u32,
                head_dim: (into.acc.cols / heads) as u32,
            })
        }
        Op::Route { ids, tables, experts } => {
            let chunks = tables.chunks(*experts);
            let sizes = [ids.rows, ids.cols, *experts, chunks, tables.perm.rows, tables.shards];
            if sizes.iter().any(|&x| x > u32::MAX as usize) || ids.len() > u32::MAX as usize {
                return Err(unsupported(format!("routing {}x{} slots over {experts} experts", ids.rows, ids.cols)));
            }
            Some(Command::Route {
                ids: (loc(d, ids), ld(ids)),
                seg: loc(d, &tables.seg),
                perm: (loc(d, &tables.perm), ld(&tables.perm)),
                inv: (loc(d, &tables.inv), ld(&tables.inv)),
                sizes: sizes.map(|x| x as u32),
            })
        }
        Op::GroupedGemm { a, b, c, tables, experts, groups, chunk, gather, zero_unrouted } => {
            let k = b.rows / experts;
            let chunks = tables.chunks(*experts);
            let all = [a.rows, c.rows, c.cols, k, chunks, *chunk, groups.start, groups.end, *experts, tables.inv.cols];
            if all.iter().chain(gather.iter()).any(|&x| x > u32::MAX as usize) {
                return Err(unsupported(format!("grouped gemm {}x{}x{k} over {experts} experts", c.rows, c.cols)));
            }
            if c.is_empty() {
                return Ok(None);
            }
            let mut facts = GroupedFacts::of(plan, op).expect("a grouped gemm");
            // A variant that fixes how gathered rows arrive fixes the tile the rule gives
            // rows arriving so, as `stage_gathered_rows` below follows it.
            let asked = options.hopper.map_or(HopperVariant::Engine, |t| t.variant);
            facts.staged = facts.gathered && asked.stages_gathered_rows(c.cols);
            let tile = engines::grouped_engine(options.gemm, &options.engine_support(), &facts).map_err(unsupported)?;
            let t = |r: &Region| (loc(d, r), ld(r), dt(r));
            Some(Command::GroupedGemm {
                tensors: [t(a), t(b), t(c)],
                seg: loc(d, &tables.seg),
                perm: (loc(d, &tables.perm), ld(&tables.perm)),
                shape: [a.rows, c.rows, c.cols, k].map(|x| x as u32),
                routing: [chunks, *chunk, groups.start, groups.end, *experts, tables.inv.cols].map(|x| x as u32),
                gather: gather.map(|g| g as u32),
                zero_unrouted: *zero_unrouted,
                hopper: tile.map(|tile| {
                    let variant = options.hopper.map_or(HopperVariant::Engine, |t| t.variant.unpaired().on(tile));
                    (tile, options.hopper.map_or(1, |t| t.sms), variant)
                }),
                staged: None,
            })
        }
        Op::Combine { rows, weights, inv, out } => {
            if [rows.rows, out.rows, out.cols, inv.cols].iter().any(|&x| x > u32::MAX as usize) {
                return Err(unsupported(format!("combine of {}x{} elements", out.rows, out.cols)));
            }
            if out.is_empty() {
                return Ok(None);
            }
            let t = |r: &Region| (loc(d, r), ld(r), dt(r));
            Some(Command::Combine {
                tensors: [t(rows), t(weights), t(inv), t(out)],
                src_rows: rows.rows as u32,
                shape: [out.rows, out.cols, inv.cols].map(|x| x as u32),
            })
        }
        Op::Signal { device, sem, add } => match writes.iter().find(|(s, _)| *s == site) {
            Some(&(_, value)) => Some(Command::SignalWrite { device: *device, sem: sem.0, value }),
            None => Some(Command::SignalAdd { device: *device, sem: sem.0, add: *add }),
        },
        Op::Wait { sem, value } => match options.sync {
            SyncMode::Kernels => {
                let slot = lowered.wait_slots.len();
                lowered.wait_slots.push(site);
                Some(Command::WaitKernel { device: d, sem: sem.0, value: *value, slot })
            }
            SyncMode::StreamMemOps => Some(Command::WaitValue { device: d, sem: sem.0, value: *value }),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cmm_core::plan::{BufferRole, PlanBuilder};
    use cmm_core::verify::queues::whole_lane_order;
    use cmm_core::{build_plan, Algorithm, OpKind, Problem};

    fn options(gemm: GemmEngine, sync: SyncMode, cublas_present: bool) -> LowerOptions {
        LowerOptions { gemm, sync, cublas_present, queues: DEFAULT_QUEUES, wide_tiles: false, hopper: None }
    }

    fn plan(op: OpKind, algorithm: Algorithm, d: usize, input: DType) -> Plan {
        let p = Problem::new(op, d, 16 * d, 16 * d, 16 * d, input, DType::F32).unwrap();
        build_plan(&p, algorithm).unwrap()
    }

    #[test]
    fn a_fused_gemm_is_one_tile_kernel_with_its_waits_and_signals_inside() {
        let ag = plan(OpKind::AgGemm, Algorithm::Fused { chunks: 2 }, 3, DType::F16);
        let lowered = lower(&ag, &options(GemmEngine::Auto, SyncMode::Kernels, true)).unwrap();
        let fused: Vec<&FusedGemmCommand> = lowered
            .steps
            .iter()
            .filter_map(|s| if let Some(Command::FusedGemm(f)) = &s.command { Some(f) } else { None })
            .collect();
        assert_eq!(fused.len(), 3);
        // Own shard, then two chunks of each of the two peers' shards, each behind a wait.
        let f = fused[0];
        assert_eq!(f.gemm.imp, GemmImpl::MmaF16);
        assert_eq!(f.blocks.len(), 5);
        assert_eq!(f.blocks.iter().map(|b| b.waits_end).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert_eq!(
            lowered.wait_slots.len()
                - lowered.steps.iter().filter(|s| matches!(s.command, Some(Command::WaitKernel { .. }))).count(),
            12
        );
        assert_eq!(lowered.gemms(), GemmCounts { cublas: 0, tile: 3, hopper: 0, clusters: 0, staged: 0 });
        // GEMM+RS: each block released by the signal after it.
        let rs = plan(OpKind::GemmRs, Algorithm::Fused { chunks: 1 }, 2, DType::F32);
        let lowered = lower(&rs, &options(GemmEngine::TileKernel, SyncMode::Kernels, false)).unwrap();
        let Some(Command::FusedGemm(f)) =
            lowered.steps.iter().find_map(|s| s.command.clone().filter(|c| matches!(c, Command::FusedGemm(_))))
        else {
            panic!("no fused gemm")
        };
        assert_eq!(f.blocks.iter().map(|b| b.signals).collect::<Vec<_>>(), vec![(0, 1), (1, 1)]);
        assert_eq!(f.gemm.imp, GemmImpl::Simt);
        // cuBLAS cannot wait inside a GEMM: asking for it everywhere is an error.
        let err = lower(&ag, &options(GemmEngine::Cublas, SyncMode::Kernels, true)).unwrap_err();
        assert!(err.to_string().contains("cuBLAS cannot"), "{err}");
    }

    #[test]
    fn a_persistent_grid_is_one_cta_per_sm_or_two_per_resident_cluster() {
        let target = |variant| HopperTarget { sms: 132, pair_clusters: [50, 70], tile: None, variant };
        for variant in HopperVariant::ALL.into_iter().filter(|&v| v != HopperVariant::Pair) {
            assert_eq!(target(variant).ctas(HopperTile::Wide), 132, "{variant:?}");
        }
        let pair = target(HopperVariant::Pair);
        // 50 clusters of 128×256 CTAs fit (100 CTAs); 70 of 128×128 would be 140, past the SMs.
        assert_eq!((pair.ctas(HopperTile::Wide), pair.ctas(HopperTile::Narrow)), (100, 132));
        assert_eq!(HopperTarget { pair_clusters: [0, 0], ..pair }.ctas(HopperTile::Wide), 0, "no cluster fits");
        assert_eq!(HopperTarget { sms: 0, ..target(HopperVariant::Engine) }.ctas(HopperTile::Wide), 1);
    }

    #[test]
    fn wide_tiles_take_the_tensor_core_gemms_and_the_fused_tile_grid() {
        let fused = |dtype, wide_tiles| {
            let ag = plan(OpKind::AgGemm, Algorithm::Fused { chunks: 1 }, 2, dtype);
            let l =
                lower(&ag, &LowerOptions { wide_tiles, ..options(GemmEngine::Auto, SyncMode::Kernels, true) }).unwrap();
            l.steps
                .iter()
                .find_map(|s| if let Some(Command::FusedGemm(f)) = &s.command { Some(f.clone()) } else { None })
        };
        // 32 rows by 32 columns per block: one tile of either edge, two blocks.
        let narrow = fused(DType::F16, false).unwrap();
        let wide = fused(DType::F16, true).unwrap();
        assert_eq!((narrow.gemm.imp, wide.gemm.imp), (GemmImpl::MmaF16, GemmImpl::MmaWideF16));
        assert_eq!(fused(DType::Bf16, true).unwrap().gemm.imp, GemmImpl::MmaWideBf16);
        assert_eq!(fused(DType::F32, true).unwrap().gemm.imp, GemmImpl::Simt, "no tensor cores for f32");
        let big = Problem::new(OpKind::AgGemm, 2, 512, 320, 64, DType::F16, DType::F32).unwrap();
        let big = build_plan(&big, Algorithm::Fused { chunks: 1 }).unwrap();
        let tiles = |wide_tiles| {
            let l = lower(&big, &LowerOptions { wide_tiles, ..options(GemmEngine::Auto, SyncMode::Kernels, true) })
                .unwrap();
            l.steps
                .iter()
                .find_map(
                    |s| if let Some(Command::FusedGemm(f)) = &s.command { Some((f.tiles, f.tiles_n)) } else { None },
                )
                .unwrap()
        };
        // Two blocks of 256 rows by 160 columns: 4·3 tiles of 64 each, 2·2 of 128.
        assert_eq!(tiles(false), (24, 3));
        assert_eq!(tiles(true), (8, 2));
        // Plain GEMMs on the tile kernels launch one CTA per 128×128 tile; cuBLAS ignores it.
        let ring = plan(OpKind::AgGemm, Algorithm::Ring, 2, DType::Bf16);
        let gemm = |gemm| {
            let l = lower(&ring, &LowerOptions { wide_tiles: true, ..options(gemm, SyncMode::Kernels, true) }).unwrap();
            l.steps.iter().find_map(|s| if let Some(Command::Gemm(g)) = s.command { Some(g.imp) } else { None })
        };
        assert_eq!(gemm(GemmEngine::TileKernel), Some(GemmImpl::MmaWideBf16));
        assert_eq!(gemm(GemmEngine::Cublas), Some(GemmImpl::Cublas));
    }

    #[test]
    fn steps_follow_the_schedule_and_every_op_is_lowered_once() {
        let plan = plan(OpKind::GemmAr, Algorithm::RingBidir, 4, DType::F16);
        let l = lower(&plan, &options(GemmEngine::Auto, SyncMode::Kernels, true)).unwrap();
        let order: Vec<OpSite> = l.steps.iter().map(|s| s.site).collect();
        assert_eq!(order, schedule(&plan).unwrap().order);
        assert_eq!(l.streams, 4 * plan.lanes.len());
        let waits = plan.ops().filter(|(_, op)| matches!(op, Op::Wait { .. })).count();
        assert_eq!(l.wait_slots.len(), waits);
        let gemms = plan.ops().filter(|(_, op)| matches!(op, Op::Gemm { .. })).count();
        assert_eq!(l.gemms(), GemmCounts { cublas: gemms, tile: 0, hopper: 0, clusters: 0, staged: 0 });
    }

    #[test]
    fn an_order_that_can_hang_is_refused_before_any_launch() {
        let plan = plan(OpKind::AgGemm, Algorithm::Ring, 8, DType::F32);
        let err = lower_in_order(&plan, &whole_lane_order(&plan), &options(GemmEngine::Auto, SyncMode::Kernels, true))
            .unwrap_err();
        assert!(matches!(err, CudaError::Enqueue(_)), "{err}");
        assert!(err.to_string().contains("hangs on 8 hardware queue(s)"), "{err}");
    }

    #[test]
    fn the_gemm_engine_is_explicit() {
        let plan = plan(OpKind::AgGemm, Algorithm::Ring, 2, DType::Bf16);
        let tile = lower(&plan, &options(GemmEngine::Auto, SyncMode::Kernels, false)).unwrap();
        assert_eq!(tile.gemms().cublas, 0);
        assert!(tile.gemms().tile > 0);
        assert_eq!(tile.gemms().describe(), "tile kernels");
        let err = lower(&plan, &options(GemmEngine::Cublas, SyncMode::Kernels, false)).unwrap_err();
        assert!(matches!(err, CudaError::NoCublas), "{err}");
        let blas = lower(&plan, &options(GemmEngine::Cublas, SyncMode::Kernels, true)).unwrap();
        assert_eq!((blas.gemms().tile, blas.gemms().describe().as_str()), (0, "cuBLAS"));
        let never = lower(&plan, &options(GemmEngine::TileKernel, SyncMode::Kernels, true)).unwrap();
        assert_eq!(never.gemms().cublas, 0);
    }

    #[test]
    fn mixed_dtypes_are_refused_by_strict_cublas_and_run_on_tiles_under_auto() {
        let mut b = PlanBuilder::new("mixed", 1);
        let x = b.buffer("X", DType::F16, 4, 8, BufferRole::whole_tensor(0, 8));
        let y = b.buffer("Y", DType::F32, 8, 4, BufferRole::whole_tensor(1, 4));
        let c = b.buffer("C", DType::F32, 4, 4, BufferRole::Output);
        let lane = b.lane("main");
        let (a, bb, cc) = (b.whole(x), b.whole(y), b.whole(c));
        b.push(0, lane, Op::gemm(a, bb, cc));
        let plan = b.finish().unwrap();
        let err = lower(&plan, &options(GemmEngine::Cublas, SyncMode::Kernels, true)).unwrap_err();
        assert!(err.to_string().contains("A f16 and B f32 cannot run on cuBLAS"), "{err}");
        let auto = lower(&plan, &options(GemmEngine::Auto, SyncMode::Kernels, true)).unwrap();
        assert_eq!(auto.gemms(), GemmCounts { cublas: 0, tile: 1, hopper: 0, clusters: 0, staged: 0 });
        let Some(Command::Gemm(g)) = &auto.steps[0].command else { panic!() };
        assert_eq!(g.imp, GemmImpl::Simt);
    }

    #[test]
    fn stream_memory_ops_write_running_totals_of_single_lane_semaphores() {
        let plan = plan(OpKind::AgGemm, Algorithm::Ring, 4, DType::F32);
        let l = lower(&plan, &options(GemmEngine::Auto, SyncMode::StreamMemOps, true)).unwrap();
        let finals = schedule(&plan).unwrap().final_semaphores;
        let mut last = std::collections::HashMap::new();
        for step in &l.steps {
            match &step.command {
                Some(Command::SignalWrite { device, sem, value }) => {
                    let prev = last.insert((*device, *sem), *value).unwrap_or(0);
                    assert!(*value > prev, "totals grow");
                }
                Some(Command::SignalAdd { .. } | Command::WaitKernel { .. }) => {
                    panic!("ring semaphores have one signaller")
                }
                _ => {}
            }
        }
        for ((device, sem), value) in last {
            assert_eq!(finals[device][sem], value, "the last write is the final value");
        }
        assert!(l.wait_slots.is_empty());
    }

    #[test]
    fn a_semaphore_with_several_signallers_keeps_the_add_kernel() {
        let mut b = PlanBuilder::new("two signallers", 3);
        let s = b.semaphore("s");
        let lane = b.lane("main");
        b.push(1, lane, Op::Signal { device: 0, sem: s, add: 1 });
        b.push(2, lane, Op::Signal { device: 0, sem: s, add: 1 });
        b.push(0, lane, Op::Wait { sem: s, value: 2 });
        let plan = b.finish().unwrap();
        let l = lower(&plan, &options(GemmEngine::Auto, SyncMode::StreamMemOps, true)).unwrap();
        let adds = l.steps.iter().filter(|s| matches!(s.command, Some(Command::SignalAdd { .. }))).count();
        assert_eq!(adds, 2);
    }

    #[test]
    fn too_many_reduce_inputs_are_a_typed_error() {
        let mut b = PlanBuilder::new("wide reduce", 1);
        let x = b.buffer("X", DType::F32, 9, 4, BufferRole::whole_tensor(0, 4));
        let y = b.buffer("Y", DType::F32, 1, 4, BufferRole::Output);
        let lane = b.lane("main");
        let inputs = (0..9).map(|r| b.rows(x, r, 1)).collect();
        let output = b.whole(y);
        b.push(0, lane, Op::Reduce { inputs, output });
        // The plan model refuses it before lowering; lowering refuses it too.
        assert!(b.finish().unwrap_err().to_string().contains("reduce of 9 inputs"));
    }

    #[test]
    fn one_row_operands_get_a_valid_leading_dimension() {
        let mut b = PlanBuilder::new("one row", 1);
        let x = b.buffer("X", DType::F32, 1, 8, BufferRole::whole_tensor(0, 8));
        let y = b.buffer("Y", DType::F32, 8, 4, BufferRole::whole_tensor(1, 4));
        let c = b.buffer("C", DType::F32, 1, 4, BufferRole::Output);
        let lane = b.lane("main");
        let a = Region { stride: 1, ..b.whole(x) };
        let (bb, cc) = (b.whole(y), b.whole(c));
        b.push(0, lane, Op::gemm(a, bb, cc));
        let plan = b.finish().unwrap();
        let l = lower(&plan, &options(GemmEngine::Cublas, SyncMode::Kernels, true)).unwrap();
        let Some(Command::Gemm(g)) = &l.steps[0].command else { panic!() };
        assert_eq!(g.strides, [8, 4, 4]);
    }

    #[test]
    fn the_queue_count_comes_from_cuda_device_max_connections() {
        assert_eq!(parse_queues(None).unwrap(), 8);
        assert_eq!(parse_queues(Some(" 32 ")).unwrap(), 32);
        for bad in ["0", "33", "eight", ""] {
            let err = parse_queues(Some(bad)).unwrap_err();
            assert!(err.to_string().contains(&format!("CUDA_DEVICE_MAX_CONNECTIONS={bad}")), "{err}");
        }
    }

    /// ag_moe's gathered grouped GEMMs on the Hopper engine: from 512 columns their rows
    /// are staged in one region per stream (the largest step's rows × K), named after the
    /// plan's buffers; below it, or on the in-kernel variants,
    /// the producer copies them; the staged variant stages them at any width.
    #[test]
    fn gathered_rows_are_staged_per_stream_from_512_columns() {
        use cmm_core::moe::{build_moe_plan, MoeOp, MoeProblem, Routing};
        let lowered = |ffn: usize, variant: HopperVariant| {
            let p = MoeProblem::new(MoeOp::AgMoe, 2, 64, 40, ffn, 4, 2, Routing::Uniform, DType::Bf16, DType::Bf16);
            let plan = build_moe_plan(&p.unwrap(), Algorithm::Ring).unwrap();
            let hopper = HopperTarget { sms: 132, pair_clusters: [0; 2], tile: None, variant };
            let options = LowerOptions { hopper: Some(hopper), ..options(GemmEngine::Auto, SyncMode::Kernels, true) };
            let l = lower(&plan, &options).unwrap();
            let staged: Vec<(usize, Option<Loc>)> = l
                .steps
                .iter()
                .filter_map(|s| match &s.command {
                    Some(Command::GroupedGemm { staged, gather: Some(_), .. }) => Some((s.stream, *staged)),
                    _ => None,
                })
                .collect();
            (plan.buffers.len(), l, staged)
        };
        // F = 1024 on 2 devices: 512 columns each.
        let (buffers, l, staged) = lowered(1024, HopperVariant::Engine);
        assert_eq!(staged.len(), 4, "two ring steps on each of two devices");
        assert_eq!(l.staging.len(), 2, "one region per stream that stages");
        for (stream, at) in staged {
            let j = l.staging.iter().position(|s| s.stream == stream).unwrap();
            assert_eq!(at, Some(Loc { device: l.staging[j].device, buffer: buffers + j, offset: 0 }));
            // 128 rows (T·k) of K = H = 40 bf16.
            assert_eq!(l.staging[j].bytes, 128 * 40 * 2);
        }
        assert_eq!((l.gemms().hopper, l.gemms().staged), (4, 4));
        for (ffn, variant) in [(1008, HopperVariant::Engine), (1024, HopperVariant::InKernelGather)] {
            let (_, l, staged) = lowered(ffn, variant);
            assert!(staged.iter().all(|(_, at)| at.is_none()) && l.staging.is_empty(), "{ffn} columns, {variant:?}");
            assert_eq!(l.gemms().staged, 0);
        }
        let (_, l, staged) = lowered(64, HopperVariant::StagedGather);
        assert!(staged.iter().all(|(_, at)| at.is_some()) && l.gemms().staged == 4);
    }

    #[test]
    fn a_variant_that_fixes_how_gathered_rows_arrive_fixes_their_tile() {
        use cmm_core::moe::{build_moe_plan, MoeOp, MoeProblem, Routing};
        // 128 rows (T·k) × 512 columns a device: two 128×256 tiles, which fill 2 SMs.
        let p = MoeProblem::new(MoeOp::AgMoe, 2, 64, 40, 1024, 4, 2, Routing::Uniform, DType::Bf16, DType::Bf16);
        let plan = build_moe_plan(&p.unwrap(), Algorithm::Ring).unwrap();
        let tiles = |variant: HopperVariant| {
            let hopper = HopperTarget { sms: 2, pair_clusters: [0; 2], tile: None, variant };
            let options = LowerOptions { hopper: Some(hopper), ..options(GemmEngine::Auto, SyncMode::Kernels, true) };
            let l = lower(&plan, &options).unwrap();
            let tiles: Vec<(HopperTile, bool)> = l
                .steps
                .iter()
                .filter_map(|s| match &s.command {
                    Some(Command::GroupedGemm { hopper: Some((tile, ..)), staged, gather: Some(_), .. }) => {
                        Some((*tile, staged.is_some()))
                    }
                    _ => None,
                })
                .collect();
            assert_eq!(tiles.len(), 4, "{variant:?}");
            tiles
        };
        // Staged, K = 40 < 8192 decides: 128×128. Copied in the kernel, the tile count
        // does: 128×256, as the rule gives rows copied so.
        let staged = [(HopperTile::Narrow, true); 4];
        let copied = [(HopperTile::Wide, false); 4];
        assert_eq!(tiles(HopperVariant::Engine), staged);
        assert_eq!(tiles(HopperVariant::StagedGather), staged);
        assert_eq!(tiles(HopperVariant::InKernelGather), copied);
        assert_eq!(tiles(HopperVariant::ReaderFence), copied);
    }

    #[test]
    fn moe_plans_lower_every_table_op_with_its_routing_parameters() {
        use cmm_core::moe::{build_moe_plan, MoeOp, MoeProblem, Routing};
        let p = MoeProblem::new(MoeOp::AgMoe, 4, 32, 8, 8, 6, 2, Routing::Drop, DType::Bf16, DType::Bf16).unwrap();
        let plan = build_moe_plan(&p, Algorithm::RingChunked { chunks: 2 }).unwrap();
        for queues in [8, 32] {
            let l = lower(&plan, &LowerOptions { queues, ..options(GemmEngine::Auto, SyncMode::Kernels, true) })
                .unwrap_or_else(|e| panic!("{queues} queues: {e}"));
            let routes = l.steps.iter().filter(|s| matches!(s.command, Some(Command::Route { .. }))).count();
            assert_eq!(routes, 4, "one route per device");
            let chunks: Vec<u32> = l
                .steps
                .iter()
                .filter(|s| s.site.device == 1)
                .filter_map(|s| match &s.command {
                    Some(Command::GroupedGemm { routing, gather, .. }) => {
                        assert_eq!(routing[0], 8, "D·c = 8 token chunks");
                        assert_eq!(gather.unwrap() % 4, 0, "gathered from a chunk's first token");
                        Some(routing[1])
                    }
                    _ => None,
                })
                .collect();
            // Device 1 computes its own two sub-chunks first, then the others' as they arrive.
            assert_eq!(chunks, [2, 3, 4, 5, 6, 7, 0, 1]);
        }
        let rs = MoeProblem::new(MoeOp::MoeRs, 2, 8, 4, 4, 4, 2, Routing::Uniform, DType::F32, DType::F32).unwrap();
        let l =
            lower(&build_moe_plan(&rs, Algorithm::Ring).unwrap(), &options(GemmEngine::Auto, SyncMode::Kernels, true))
                .unwrap();
        let combine = l.steps.iter().find_map(|s| match &s.command {
            Some(Command::Combine { shape, src_rows, .. }) => Some((*shape, *src_rows)),
            _ => None,
        });
        assert_eq!(combine, Some(([4, 4, 2], 16)), "4 tokens x 4 columns over 2 slots, 16 expert rows");
    }
}
