//! Which engine runs each GEMM of a plan: the one rule that the CUDA executor's lowering
//! follows (cmm-cuda `lower`) and that the simulator prices (`sim`), so that a prediction
//! names the kernel the GPU would run rather than the fastest one there is.
//!
//! Engines: cuBLAS (`cublasGemmEx`), cmm's Hopper engine (`hopper.cu`: TMA, wgmma,
//! warp-specialised, persistent; on GPUs of compute capability 9.0), and cmm's tile
//! kernels (`gemm.cu`: `mma.sync` tensor cores for f16/bf16 on 64×64 or 128×128 tiles,
//! SIMT otherwise). A tile-granular (fused) GEMM waits and signals inside its kernel, so
//! it runs on one of cmm's persistent kernels, never on cuBLAS.

use crate::dtype::DType;
use crate::plan::{Op, Plan, Region};

/// The policy that picks an engine for each GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GemmEngine {
    /// cmm's own kernels: the Hopper engine where it applies, else the tile kernels.
    TileKernel,
    /// cuBLAS for every GEMM; a GEMM cuBLAS cannot run (A and B of different dtypes) or
    /// a missing libcublas is an error, never a silent fallback.
    Cublas,
    /// cuBLAS where present and the dtypes allow, cmm's own kernels otherwise.
    #[default]
    Auto,
    /// The Hopper engine for every GEMM; a GEMM it cannot take ([`hopper_rule`]) or a GPU
    /// without it is an error.
    Hopper,
}

/// The output tile of the Hopper engine: 128 rows by 256 or 128 columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HopperTile {
    /// 128×256, four stages (`cmm_hopper_gemm_*_n256`).
    Wide,
    /// 128×128, six stages (`cmm_hopper_gemm_*_n128`).
    Narrow,
}

/// Rows of a Hopper-engine tile.
pub const HOPPER_TILE_M: usize = 128;

impl HopperTile {
    /// Both tiles.
    pub const ALL: [HopperTile; 2] = [HopperTile::Wide, HopperTile::Narrow];

    /// Columns of a tile (rows: [`HOPPER_TILE_M`]).
    pub fn columns(self) -> usize {
        match self {
            HopperTile::Wide => 256,
            HopperTile::Narrow => 128,
        }
    }

    /// "128x256" or "128x128".
    pub fn name(self) -> String {
        format!("{HOPPER_TILE_M}x{}", self.columns())
    }
}

/// What runs one GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Engine {
    /// `cublasGemmEx`.
    Cublas,
    /// cmm's Hopper engine on this tile.
    Hopper(HopperTile),
    /// cmm's tensor-core tile kernel, 64×64 (or 128×128: `wide`).
    TensorTile {
        /// The 128×128 tile of 8 warps.
        wide: bool,
    },
    /// cmm's SIMT tile kernel (f32 or mixed dtypes).
    SimtTile,
    /// cmm's scalar grouped GEMM kernel (`cmm_grouped_gemm`: one thread per output, on
    /// the CUDA cores): the grouped GEMMs the Hopper engine cannot take
    /// ([`grouped_engine`]); never a plain or fused GEMM's engine.
    ScalarGrouped,
}

impl Engine {
    /// Its name in reports: "cuBLAS", "Hopper engine 128x256", "tile kernel 64x64", ….
    pub fn name(self) -> String {
        match self {
            Engine::Cublas => "cuBLAS".into(),
            Engine::Hopper(tile) => format!("Hopper engine {}", tile.name()),
            Engine::TensorTile { wide: false } => "tile kernel 64x64".into(),
            Engine::TensorTile { wide: true } => "tile kernel 128x128".into(),
            Engine::SimtTile => "SIMT tile kernel".into(),
            Engine::ScalarGrouped => "scalar grouped kernel".into(),
        }
    }
}

/// What the machine and the run offer: cuBLAS, the Hopper engine (with the SMs a
/// persistent grid may take, and a tile every GEMM on it must take), the tile kernels'
/// 128×128 tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct EngineSupport {
    /// libcublas is present.
    pub cublas: bool,
    /// The Hopper engine runs here, on a persistent grid of at most this many CTAs.
    pub hopper_sms: Option<u32>,
    /// Every GEMM on the Hopper engine takes this tile (`None`: [`hopper_rule`]'s choice).
    pub hopper_tile: Option<HopperTile>,
    /// f16 and bf16 GEMMs on the tile kernels take the 128×128 tiles.
    pub wide_tiles: bool,
}

/// What the engines need to know of one GEMM: its shape and dtypes, transposes and
/// accumulation, and where its operands lie (byte offsets of A and B from 256-byte
/// aligned buffer starts; row strides of A, B and C in elements, as leading dimensions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmFacts {
    /// m, n, k.
    pub mnk: [usize; 3],
    /// Dtypes of A, B and C.
    pub dtypes: [DType; 3],
    /// A stored K×M.
    pub trans_a: bool,
    /// B stored N×K.
    pub trans_b: bool,
    /// C += A·B.
    pub accumulate: bool,
    /// Byte offsets of A and B from their buffers' (256-byte aligned) starts.
    pub offsets: [u64; 2],
    /// Row strides (leading dimensions) of A, B and C in elements.
    pub strides: [u64; 3],
}

impl GemmFacts {
    /// A plain GEMM `c = a·b` of densely packed row-major operands at aligned addresses.
    pub fn dense(m: usize, n: usize, k: usize, input: DType, output: DType) -> GemmFacts {
        GemmFacts {
            mnk: [m, n, k],
            dtypes: [input, input, output],
            trans_a: false,
            trans_b: false,
            accumulate: false,
            offsets: [0, 0],
            strides: [k as u64, n as u64, n as u64],
        }
    }

    /// The facts of a plan's `Gemm` op (`None` for other ops).
    pub fn of(plan: &Plan, op: &Op) -> Option<GemmFacts> {
        let Op::Gemm { a, b, c, trans_a, trans_b, accumulate, .. } = op else { return None };
        let k = if *trans_a { a.rows } else { a.cols };
        Some(GemmFacts {
            trans_a: *trans_a,
            trans_b: *trans_b,
            accumulate: *accumulate,
            ..GemmFacts::laid_out(plan, [a, b, c], [c.rows, c.cols, k])
        })
    }

    /// The facts of a GEMM `c = a·b` (no transposes, no accumulation) of these regions.
    fn laid_out(plan: &Plan, [a, b, c]: [&Region; 3], mnk: [usize; 3]) -> GemmFacts {
        let dt = |r: &Region| plan.buffer(r.buf).dtype;
        // A one-row region may have any stride; as a leading dimension it must cover the row.
        let ld = |r: &Region| if r.rows <= 1 { r.stride.max(r.cols) } else { r.stride } as u64;
        let offset = |r: &Region| (r.offset * dt(r).size_bytes()) as u64;
        GemmFacts {
            mnk,
            dtypes: [dt(a), dt(b), dt(c)],
            trans_a: false,
            trans_b: false,
            accumulate: false,
            offsets: [offset(a), offset(b)],
            strides: [ld(a), ld(b), ld(c)],
        }
    }

    /// Whether cuBLAS can run it (`cublasGemmEx` with one input dtype, 32-bit sizes).
    pub fn cublas_can(&self) -> bool {
        let fits = |x: u64| x <= i32::MAX as u64;
        self.dtypes[0] == self.dtypes[1]
            && self.mnk[2] > 0
            && self.mnk.iter().all(|&x| fits(x as u64))
            && self.strides.iter().all(|&x| fits(x))
    }

    /// The tile kernel that runs it.
    pub fn tile_engine(&self, wide_tiles: bool) -> Engine {
        match self.dtypes {
            [DType::F16, DType::F16, _] | [DType::Bf16, DType::Bf16, _] => Engine::TensorTile { wide: wide_tiles },
            _ => Engine::SimtTile,
        }
    }
}

/// What the engines need to know of a grouped GEMM ([`Op::GroupedGemm`]): the facts of
/// its GEMM (m: c's rows, the capacity; k: one expert's rows of the stacked B; A's row
/// layout), whether its rows are gathered by token and staged first, and the experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupedFacts {
    /// The GEMM of every row at once (A and C of `m` rows, one expert's K×N of B).
    pub gemm: GemmFacts,
    /// Experts stacked in B.
    pub experts: usize,
    /// a's rows are gathered by token (ag_moe's), not c's own.
    pub gathered: bool,
    /// Gathered rows are staged in order before the kernel, which loads them by TMA
    /// ([`stages_gathered_rows`] unless a variant of the engine fixes the way); false
    /// where its producer copies them, and where they are not gathered.
    pub staged: bool,
}

impl GroupedFacts {
    /// The facts of a plan's `GroupedGemm` op (`None` for other ops).
    pub fn of(plan: &Plan, op: &Op) -> Option<GroupedFacts> {
        let Op::GroupedGemm { a, b, c, experts, gather, .. } = op else { return None };
        Some(GroupedFacts {
            gemm: GemmFacts::laid_out(plan, [a, b, c], [c.rows, c.cols, b.rows / (*experts).max(1)]),
            experts: *experts,
            gathered: gather.is_some(),
            staged: gather.is_some() && stages_gathered_rows(c.cols),
        })
    }
}

/// The fewest columns (N) of a grouped GEMM over rows gathered by token for which the
/// Hopper engine stages the rows in order first (one pass that reads each routed row from
/// its token and writes it, then TMA loads as for rows that are not gathered) rather than
/// have its producer warpgroup copy them into each tile with `cp.async`.
///
/// Why a column count: staging adds 2·K bytes a row through HBM, once, and the GEMM does
/// 2·N·K FLOPs a row, so its share of the GEMM's time falls as 1/N. At the H100's peak
/// and HBM rate and the engine's grouped rate of 0.4 of peak, it is about 240/N of the
/// GEMM: 13 % at Mixtral's N = 1792 per device at D = 8, but more than the GEMM itself at
/// Qwen-MoE's N = 176. Copying in the kernel cost the engine 1.15–1.95× its grouped rate
/// over TMA-loaded rows on an H100 (2026-11-26) and about 1.6× on an H200 (2026-11-27):
/// staging pays from N of about 240/0.5, and 512 is that, rounded up to a power of two.
/// An assumption until a GPU times both ways on shapes on each side of it (the GEMM
/// sweep times both at N = 1792).
pub const STAGED_GATHER_MIN_COLUMNS: usize = 512;

/// Whether the Hopper engine stages a grouped GEMM's gathered rows first
/// ([`STAGED_GATHER_MIN_COLUMNS`]), for a GEMM of `columns` columns.
pub fn stages_gathered_rows(columns: usize) -> bool {
    columns >= STAGED_GATHER_MIN_COLUMNS
}

/// The engine of a grouped GEMM: `Some(tile)`, the Hopper engine, which schedules its
/// tiles on the GPU from the segment offsets the route op wrote (an empty expert has no
/// tile), where [`hopper_rule`] holds of the GEMM over all of c's rows (f16/bf16, 16-byte
/// aligned rows of A and B: TMA's rules, and those of the producer's cp.async copies when
/// a's rows are gathered by token) and the experts' stacked B fits a 3D tensor map;
/// `None`: cmm's scalar grouped kernel (`cmm_grouped_gemm`). cuBLAS never runs one (its grouped GEMMs take the group sizes
/// from the host, and the route op writes them on the GPU), whatever the policy; under
/// [`GemmEngine::Hopper`] a grouped GEMM the engine cannot take is an error.
pub fn grouped_engine(
    policy: GemmEngine,
    support: &EngineSupport,
    g: &GroupedFacts,
) -> Result<Option<HopperTile>, String> {
    let [m, n, k] = g.gemm.mnk;
    let why_not = match support.hopper_sms {
        None => "this GPU does not run it (it needs compute capability 9.0)".to_string(),
        // The stacked B is loaded as a 3D tensor (N, K, experts): its experts' stride too
        // must be a TMA stride.
        Some(_) if (g.experts as u64).saturating_mul(k as u64).saturating_mul(g.gemm.strides[1]) * 2 >= 1u64 << 40 => {
            format!("{} experts of {k}x{n} past TMA's strides", g.experts)
        }
        Some(sms) => match hopper_rule(&g.gemm, sms) {
            Ok(tile) => {
                // Rows the producer copies into each tile ran faster on 128×256 whatever
                // K (0.38–0.42× cuBLAS against 0.30–0.32 on 128×128, on an H100 and an
                // H200 at K = 4096): the tile count decides there, not K.
                let copied = g.gathered && !g.staged;
                let tile = if copied && wide_tiles_fill(m, n, sms) { HopperTile::Wide } else { tile };
                return Ok(Some(support.hopper_tile.unwrap_or(tile)));
            }
            Err(why) => why,
        },
    };
    if policy == GemmEngine::Hopper {
        return Err(format!(
            "grouped gemm {m}x{n}x{k} over {} experts cannot run on the Hopper engine (GemmEngine::Hopper asks for it on every GEMM): {why_not}",
            g.experts
        ));
    }
    Ok(None)
}

/// The shortest K on which [`hopper_rule`] takes the 128×256 tile. Measured with both
/// tiles in one run, wherever 128×256 tiles filled the SMs: at K ≤ 4096 the 128×128 tile
/// was faster every time (1024×4096×4096 on an H100 and an H200, 0.72–0.81× cuBLAS against
/// 0.68–0.76; ag_moe's dense 8192×1792×4096 on the H200, 0.80 against 0.71; moe_rs's
/// 8192×4096×1792 with f32 rows, dense 0.69 against 0.53 and grouped 0.64 against 0.49 on
/// the H200, 0.53 against 0.48 grouped on the H100), and at K ≥ 8192 the 128×256 tile
/// (8192³ and 4096×6144×12288 on both GPUs, 0.76–0.86 against 0.68–0.73). Between 4096
/// and 8192 no shape has been timed.
pub const HOPPER_WIDE_MIN_K: usize = 8192;

/// Whether 128×256 tiles of an m × n GEMM have N over 128 and fill every SM once.
fn wide_tiles_fill(m: usize, n: usize, sms: u32) -> bool {
    n > HopperTile::Narrow.columns()
        && m.div_ceil(HOPPER_TILE_M) * n.div_ceil(HopperTile::Wide.columns()) >= sms as usize
}

/// Whether the Hopper engine can run `g`, and on which tile: 128×256 where N is over
/// 128, such tiles still fill every SM once and K is at least [`HOPPER_WIDE_MIN_K`], else
/// 128×128. `Err` says what it lacks (TMA's alignment and stride rules, wgmma's dtypes).
pub fn hopper_rule(g: &GemmFacts, sms: u32) -> Result<HopperTile, String> {
    let [m, n, k] = g.mnk;
    let [a, b, c] = g.dtypes;
    if a != b || !matches!(a, DType::F16 | DType::Bf16) {
        return Err(format!("A {a} and B {b}: the engine takes f16 or bf16 for both"));
    }
    if !matches!(c, DType::F32 | DType::F16 | DType::Bf16) || (g.accumulate && c != DType::F32) {
        return Err(format!("C {c}{}", if g.accumulate { " accumulated" } else { "" }));
    }
    if g.trans_a {
        return Err("a transposed A (TMA loads A K-major)".into());
    }
    if m == 0 || n == 0 || k == 0 {
        return Err(format!("an empty GEMM {m}x{n}x{k}"));
    }
    let ab_strides = [g.strides[0], g.strides[1]];
    if g.offsets.iter().any(|o| o % 16 != 0) || ab_strides.iter().any(|s| s % 8 != 0) {
        return Err(format!(
            "A or B not 16-byte aligned (offsets {:?} bytes, row strides {ab_strides:?} elements; TMA needs multiples of 16 bytes)",
            g.offsets
        ));
    }
    let fits = |x: usize| x < (1usize << 31);
    if ![m, n, k].iter().all(|&x| fits(x)) || ab_strides.iter().any(|&s| s * 2 >= 1u64 << 40) {
        return Err(format!("a GEMM {m}x{n}x{k} past TMA's coordinates"));
    }
    Ok(if wide_tiles_fill(m, n, sms) && k >= HOPPER_WIDE_MIN_K { HopperTile::Wide } else { HopperTile::Narrow })
}

/// The engine of a GEMM run alone (not a block of a fused run), or why `policy` allows
/// none here.
pub fn plain_engine(policy: GemmEngine, support: &EngineSupport, g: &GemmFacts) -> Result<Engine, String> {
    let [m, n, k] = g.mnk;
    let hopper = support.hopper_sms.map(|sms| hopper_rule(g, sms).map(|t| support.hopper_tile.unwrap_or(t)));
    let blas_ok = support.cublas && g.cublas_can();
    match policy {
        GemmEngine::Hopper => match hopper {
            Some(Ok(tile)) => Ok(Engine::Hopper(tile)),
            Some(Err(why)) => Err(format!(
                "gemm {m}x{n}x{k} cannot run on the Hopper engine (GemmEngine::Hopper asks for it on every GEMM): {why}"
            )),
            None => Err("GemmEngine::Hopper asks for the Hopper engine, which this GPU does not run (it needs compute capability 9.0)".into()),
        },
        GemmEngine::Cublas if !blas_ok => Err(format!(
            "gemm {m}x{n}x{k} with A {} and B {} cannot run on cuBLAS (GemmEngine::Cublas asks for it on every GEMM; use Auto to let cmm's kernels take it)",
            g.dtypes[0], g.dtypes[1]
        )),
        GemmEngine::Cublas => Ok(Engine::Cublas),
        GemmEngine::Auto if blas_ok => Ok(Engine::Cublas),
        _ => Ok(match hopper {
            Some(Ok(tile)) => Engine::Hopper(tile),
            _ => g.tile_engine(support.wide_tiles),
        }),
    }
}

/// The engine of a fused run whose blocks are `blocks` (one kernel: never cuBLAS): the
/// Hopper engine where every block can take it, on one tile — the wide one where N is
/// over 128 and the run's wide tiles fill the device's share of the SMs once (the GPU's
/// SMs over `devices` virtual devices) — else the tile kernels.
pub fn fused_engine(
    policy: GemmEngine,
    support: &EngineSupport,
    blocks: &[GemmFacts],
    devices: usize,
) -> Result<Engine, String> {
    if policy == GemmEngine::Cublas {
        return Err("a fused gemm waits and signals between its blocks inside one kernel, which cuBLAS cannot; GemmEngine::Cublas asks for cuBLAS on every GEMM (use Auto)".into());
    }
    let Some(first) = blocks.first() else { return Err("a fused gemm without blocks".into()) };
    if let Some(sms) = support.hopper_sms {
        if blocks.iter().all(|b| hopper_rule(b, sms).is_ok()) {
            let n = first.mnk[1];
            let tile = support.hopper_tile.unwrap_or_else(|| {
                let wide: usize = blocks.iter().map(|b| b.mnk[0].div_ceil(HOPPER_TILE_M)).sum::<usize>()
                    * n.div_ceil(HopperTile::Wide.columns());
                let share = (sms as usize / devices.max(1)).max(1);
                if n > HopperTile::Narrow.columns() && wide >= share {
                    HopperTile::Wide
                } else {
                    HopperTile::Narrow
                }
            });
            return Ok(Engine::Hopper(tile));
        }
    }
    if policy == GemmEngine::Hopper {
        return Err(
            "GemmEngine::Hopper asks for the Hopper engine, and this fused gemm's blocks cannot all take it".into()
        );
    }
    Ok(first.tile_engine(support.wide_tiles))
}

/// How many GEMMs of a plan (fused runs counted once) each engine runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineCounts(pub Vec<(Engine, usize)>);

impl EngineCounts {
    /// Counts one more GEMM (or fused run) on `engine`.
    pub fn add(&mut self, engine: Engine) {
        match self.0.iter_mut().find(|(e, _)| *e == engine) {
            Some((_, n)) => *n += 1,
            None => self.0.push((engine, 1)),
        }
    }

    /// "cuBLAS ×12, Hopper engine 128x256 ×1"; "no GEMM" without any.
    pub fn describe(&self) -> String {
        if self.0.is_empty() {
            return "no GEMM".into();
        }
        self.0.iter().map(|(e, n)| format!("{} ×{n}", e.name())).collect::<Vec<_>>().join(", ")
    }
}

/// How a plan's copy-engine copies (`Engine::CopyEngine` ops) reach the GPU: the CUDA
/// executor's `--copies`, and what the simulator prices a copy between virtual devices of
/// one GPU as ([`CopyIssue::driver_makes`]), so that both follow one rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CopyIssue {
    /// `cuMemcpy2DAsync`: the driver picks the hardware. Between GPUs that is a copy
    /// engine; within one GPU (D virtual devices) the driver may copy with a kernel of its
    /// own on the SMs, which then waits for SMs beside the plan's kernels as theirs do.
    Driver,
    /// `cuMemcpyBatchAsync` with `CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`: the driver
    /// is asked to keep the copy off the SMs, as a copy between GPUs is (one copy, or one
    /// a row where either side is strided). CUDA 13.1's release notes say the flag selects
    /// the copy engines; what an older driver does with it, a bench shows. The CUDA
    /// executor refuses it where the driver lacks the call in its CUDA 13 form.
    PreferCopyEngines,
    /// The default: each contiguous copy ([`contiguous_copy`]) as
    /// [`Self::PreferCopyEngines`] issues it, each strided one as [`Self::Driver`] does
    /// (one 2D copy, not one copy a row); every copy as [`Self::Driver`] where the driver
    /// lacks the batched call. On an H200 (2026-11-27, docs/perf.md) every plan timed both
    /// ways ran faster with its copies asked of the copy engines: the rings 7 to 14 %, the
    /// fused ag_gemm plans 1.9 to 2.7 times, as the driver's own copies within one GPU
    /// waited for SMs that the persistent kernels held.
    #[default]
    Auto,
}

impl CopyIssue {
    /// Every way, in the order of their keys.
    pub const ALL: [CopyIssue; 3] = [CopyIssue::Driver, CopyIssue::PreferCopyEngines, CopyIssue::Auto];

    /// Its name in options (a rank worker's options line, `--copies`).
    pub fn key(self) -> &'static str {
        match self {
            CopyIssue::Driver => "driver",
            CopyIssue::PreferCopyEngines => "copy-engines",
            CopyIssue::Auto => "auto",
        }
    }

    /// What this asks of a driver that has the batched copy call (`batch_copies`) or not:
    /// [`Self::Auto`] without it is [`Self::Driver`].
    pub fn on_driver(self, batch_copies: bool) -> CopyIssue {
        match self {
            CopyIssue::Auto if !batch_copies => CopyIssue::Driver,
            other => other,
        }
    }

    /// Whether a copy of `rows` rows of `width` bytes between these pitches goes through
    /// the batched call, and as how many of its copies (one a row where either side is
    /// strided), or `None` where it is the driver's one 2D copy.
    pub fn batch_entries(self, width: usize, rows: usize, src_pitch: usize, dst_pitch: usize) -> Option<usize> {
        let contiguous = contiguous_copy(width, rows, src_pitch, dst_pitch);
        match self {
            CopyIssue::Driver => None,
            CopyIssue::Auto if !contiguous => None,
            CopyIssue::Auto => Some(1),
            CopyIssue::PreferCopyEngines => Some(if contiguous { 1 } else { rows }),
        }
    }

    /// Whether the driver makes this copy its own way (its one 2D copy), rather than being
    /// asked for the copy engines, on a driver that has the batched call.
    pub fn driver_makes(self, width: usize, rows: usize, src_pitch: usize, dst_pitch: usize) -> bool {
        self.batch_entries(width, rows, src_pitch, dst_pitch).is_none()
    }

    /// The way [`Self::key`] names, or an error listing the keys.
    pub fn parse(key: &str) -> Result<CopyIssue, String> {
        CopyIssue::ALL.into_iter().find(|c| c.key() == key).ok_or_else(|| {
            let keys: Vec<&str> = CopyIssue::ALL.iter().map(|c| c.key()).collect();
            format!("`{key}` is not one of {}", keys.join(", "))
        })
    }
}

/// Whether a copy of `rows` rows of `width` bytes between these pitches is one run of
/// bytes on both sides.
pub fn contiguous_copy(width: usize, rows: usize, src_pitch: usize, dst_pitch: usize) -> bool {
    rows <= 1 || (src_pitch == width && dst_pitch == width)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The driver makes a copy its own way under `driver`, and under `auto` where a side
    /// is strided; asked of the copy engines, a strided copy becomes one copy a row.
    #[test]
    fn the_driver_makes_what_the_copy_engines_are_not_asked_for() {
        let (row, rows) = (4096, 64);
        let contiguous = (row, rows, row, row);
        let strided = (row, rows, 2 * row, row);
        let single_row = (row, 1, 2 * row, 3 * row);
        let makes = |issue: CopyIssue, (w, r, s, d): (usize, usize, usize, usize)| issue.driver_makes(w, r, s, d);
        for shape in [contiguous, strided, single_row] {
            assert!(makes(CopyIssue::Driver, shape));
            assert!(!makes(CopyIssue::PreferCopyEngines, shape));
        }
        assert!(!makes(CopyIssue::Auto, contiguous) && !makes(CopyIssue::Auto, single_row));
        assert!(makes(CopyIssue::Auto, strided));
        assert_eq!(CopyIssue::PreferCopyEngines.batch_entries(row, rows, 2 * row, row), Some(rows));
        assert_eq!(CopyIssue::Auto.on_driver(false), CopyIssue::Driver);
        assert_eq!(CopyIssue::Auto.on_driver(true), CopyIssue::Auto);
        for issue in CopyIssue::ALL {
            assert_eq!(CopyIssue::parse(issue.key()), Ok(issue));
        }
        let e = CopyIssue::parse("dma").unwrap_err();
        assert!(e.contains("`dma`") && e.contains("driver, copy-engines, auto"), "{e}");
    }

    fn facts(m: usize, n: usize, k: usize, input: DType) -> GemmFacts {
        GemmFacts::dense(m, n, k, input, input)
    }

    #[test]
    fn the_policies_pick_the_engines_the_lowering_documents() {
        let big = facts(1024, 4096, 4096, DType::Bf16);
        let gpu = EngineSupport { cublas: true, hopper_sms: Some(132), ..Default::default() };
        assert_eq!(plain_engine(GemmEngine::Auto, &gpu, &big), Ok(Engine::Cublas));
        assert_eq!(plain_engine(GemmEngine::TileKernel, &gpu, &big), Ok(Engine::Hopper(HopperTile::Narrow)));
        let wide = facts(8192, 8192, 8192, DType::Bf16);
        assert_eq!(plain_engine(GemmEngine::Hopper, &gpu, &wide), Ok(Engine::Hopper(HopperTile::Wide)));
        // As many tiles, but K = 4096: the 128×128 tile.
        let short = facts(8192, 8192, 4096, DType::Bf16);
        assert_eq!(plain_engine(GemmEngine::Hopper, &gpu, &short), Ok(Engine::Hopper(HopperTile::Narrow)));
        // A row stride of 60 halves is not a multiple of 16 bytes: the tile kernels.
        let odd = GemmFacts { strides: [4096, 60, 60], mnk: [1024, 60, 4096], ..big };
        assert_eq!(plain_engine(GemmEngine::TileKernel, &gpu, &odd), Ok(Engine::TensorTile { wide: false }));
        assert!(plain_engine(GemmEngine::Hopper, &gpu, &odd).unwrap_err().contains("16-byte aligned"));
        let older = EngineSupport { hopper_sms: None, ..gpu };
        assert_eq!(plain_engine(GemmEngine::TileKernel, &older, &big), Ok(Engine::TensorTile { wide: false }));
        let f32s = facts(64, 64, 64, DType::F32);
        assert_eq!(plain_engine(GemmEngine::TileKernel, &gpu, &f32s), Ok(Engine::SimtTile));
        let no_blas = EngineSupport { cublas: false, ..gpu };
        assert!(plain_engine(GemmEngine::Cublas, &no_blas, &big).is_err());
        assert_eq!(plain_engine(GemmEngine::Auto, &no_blas, &big), Ok(Engine::Hopper(HopperTile::Narrow)));
    }

    #[test]
    fn a_grouped_gemm_takes_the_hopper_engine_where_tma_can_load_its_rows() {
        let gpu = EngineSupport { cublas: true, hopper_sms: Some(132), ..Default::default() };
        // moe_rs on one device of Mixtral at D = 8: 8192 rows, H = 4096, F/D = 1792.
        // Its K of 1792 takes the 128×128 tile, however many tiles it has.
        let rs =
            GroupedFacts { gemm: facts(8192, 4096, 1792, DType::Bf16), experts: 8, gathered: false, staged: false };
        for policy in [GemmEngine::Auto, GemmEngine::Cublas, GemmEngine::TileKernel, GemmEngine::Hopper] {
            assert_eq!(grouped_engine(policy, &gpu, &rs), Ok(Some(HopperTile::Narrow)), "{policy:?}");
        }
        let long = GroupedFacts { gemm: facts(8192, 4096, 8192, DType::Bf16), ..rs };
        assert_eq!(grouped_engine(GemmEngine::Auto, &gpu, &long), Ok(Some(HopperTile::Wide)));
        // ag_moe's on Mixtral (8192 rows, F/D = 1792, H = 4096): staged, so K decides; on
        // Qwen-MoE (131072 rows, 176 columns, H = 2048) copied in the kernel, so the tiles do.
        let staged = GroupedFacts { gemm: facts(8192, 1792, 4096, DType::Bf16), gathered: true, staged: true, ..rs };
        assert_eq!(grouped_engine(GemmEngine::Auto, &gpu, &staged), Ok(Some(HopperTile::Narrow)));
        let copied = GroupedFacts { gemm: facts(131072, 176, 2048, DType::Bf16), gathered: true, ..rs };
        assert_eq!(grouped_engine(GemmEngine::Auto, &gpu, &copied), Ok(Some(HopperTile::Wide)));
        // Mixtral's shape with its rows copied in the kernel (a variant that fixes the way)
        // takes the tile measured faster for copied rows.
        let in_kernel = GroupedFacts { staged: false, ..staged };
        assert_eq!(grouped_engine(GemmEngine::Auto, &gpu, &in_kernel), Ok(Some(HopperTile::Wide)));
        let narrow = GroupedFacts { gemm: facts(256, 128, 64, DType::F16), ..rs };
        assert_eq!(grouped_engine(GemmEngine::Auto, &gpu, &narrow), Ok(Some(HopperTile::Narrow)));
        let forced = EngineSupport { hopper_tile: Some(HopperTile::Wide), ..gpu };
        assert_eq!(grouped_engine(GemmEngine::Auto, &forced, &rs), Ok(Some(HopperTile::Wide)));
        // ag_moe's, from its plan: rows gathered by token (cp.async), the unrouted ones zeroed.
        let p = crate::MoeProblem::new(
            crate::MoeOp::AgMoe,
            2,
            64,
            64,
            128,
            4,
            2,
            crate::Routing::Uniform,
            DType::Bf16,
            DType::Bf16,
        )
        .unwrap();
        let plan = crate::moe::build_moe_plan(&p, crate::Algorithm::Ring).unwrap();
        let (_, op) = plan.ops().find(|(_, op)| matches!(op, Op::GroupedGemm { gather: Some(_), .. })).unwrap();
        let gathered = GroupedFacts::of(&plan, op).unwrap();
        assert_eq!((gathered.gemm.mnk, gathered.experts), ([128, 64, 64], 4), "T·k rows × F/D × H");
        assert!(gathered.gathered && !gathered.staged, "64 columns: copied in the kernel");
        assert_eq!(grouped_engine(GemmEngine::Hopper, &gpu, &gathered), Ok(Some(HopperTile::Narrow)));
        // What the engine cannot load falls back to the scalar kernel, or is an error under Hopper.
        let f32s = GroupedFacts { gemm: facts(8192, 4096, 1792, DType::F32), ..rs };
        let odd = GroupedFacts { gemm: GemmFacts { strides: [1796, 4096, 4096], ..rs.gemm }, ..rs };
        for (g, why) in [(f32s, "f16 or bf16"), (odd, "16-byte")] {
            assert_eq!(grouped_engine(GemmEngine::Auto, &gpu, &g), Ok(None), "{why}");
            let e = grouped_engine(GemmEngine::Hopper, &gpu, &g).unwrap_err();
            assert!(e.contains(why) && e.contains("grouped gemm 8192x4096x1792"), "{e}");
        }
        let older = EngineSupport { hopper_sms: None, ..gpu };
        assert_eq!(grouped_engine(GemmEngine::TileKernel, &older, &rs), Ok(None));
        assert!(grouped_engine(GemmEngine::Hopper, &older, &rs).unwrap_err().contains("compute capability 9.0"));
    }

    #[test]
    fn a_fused_run_takes_the_hopper_engine_only_if_every_block_can() {
        let gpu = EngineSupport { cublas: true, hopper_sms: Some(132), ..Default::default() };
        let block = facts(1024, 4096, 4096, DType::F16);
        // Four blocks of 8 × 16 wide tiles fill a quarter of the GPU many times over.
        assert_eq!(fused_engine(GemmEngine::Auto, &gpu, &[block; 4], 4), Ok(Engine::Hopper(HopperTile::Wide)));
        let small = facts(64, 96, 64, DType::F16);
        assert_eq!(fused_engine(GemmEngine::Auto, &gpu, &[small; 2], 2), Ok(Engine::Hopper(HopperTile::Narrow)));
        let off = GemmFacts { offsets: [8, 0], ..block };
        assert_eq!(fused_engine(GemmEngine::Auto, &gpu, &[block, off], 2), Ok(Engine::TensorTile { wide: false }));
        assert!(fused_engine(GemmEngine::Hopper, &gpu, &[block, off], 2).is_err());
        assert!(fused_engine(GemmEngine::Cublas, &gpu, &[block], 1).is_err());
    }
}
