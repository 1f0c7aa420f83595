//! `cargo xtask gemm-sweep`: the Hopper engine's local GEMM against cuBLAS, side by side
//! in one run, on the shapes that matter to the overlapped plans (issue 31): every tile
//! variant's output spot-checked against the f64 oracle at the sweep's own shape before
//! it is timed, then timed as the bench times a GEMM (events, median, operands rotated
//! past the L2). Then the MoE grouped GEMM on the engine against cuBLAS on a dense GEMM
//! of the same FLOPs, with the engine's plain GEMM on that dense shape beside them (what
//! the grouping costs, apart from what the shape costs), and for moe_rs, whose rows are
//! f32, the dense GEMM again writing bf16 or f16 (what the f32 stores cost).
//!
//! Each tile is also timed, on the plain and the grouped GEMMs, as variants that each
//! answer one question of what the engine lacks:
//! - a shallower pipeline (3 stages of 128×256, 4 of 128×128, against the engine's 4 and
//!   6): the stages' depth;
//! - clusters of two that multicast B: B's traffic from L2;
//! - the 128×128 tile with its consumer warpgroups on alternate tiles (ping-pong), and
//!   each tile with its epilogue staged in shared memory and stored by TMA while the next
//!   tile multiplies: an epilogue that idles the tensor cores;
//! - ag_moe's gathered rows copied into shared memory by the kernel's producer warpgroup
//!   (`cp.async`), as the engine had them before it staged them (2026-11-28), rather than
//!   staged in order first and loaded by TMA: what the gather costs inside the kernel
//!   against before it; and copied so with their proxy fence in the consumers, where the
//!   engine had it before it moved the fence to the producer (earlier that day): whether
//!   that fence stalls the tensor cores.

mod rules;

use std::fs;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use cmm_core::moe::build_moe_plan;
use cmm_core::oracle::spot_check;
use cmm_core::workload::output_tolerance;
use cmm_core::{Algorithm, DType, Family, MoeOp, MoeProblem, OpKind, Problem, Routing};
use cmm_cuda::{
    CudaBackend, CudaExecutor, CudaRunOptions, GemmChoice, GemmEngine, GemmImpl, GemmSpec, HopperKernel, HopperTile,
    HopperVariant, ReadBack,
};
use serde::{Deserialize, Serialize};

/// Arguments of `cargo xtask gemm-sweep`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Timed runs per GEMM (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
    /// Also write the figures as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Divide every dimension by this (a rehearsal of the path, not the sweep's shapes).
    #[arg(long, default_value_t = 1)]
    pub shrink: usize,
    /// Instead of the sweep, run each of the Hopper engine's kernels of interest a few
    /// times, ungated and untimed, for a profiler to read (`ncu -k regex:cmm_hopper`): the
    /// 8192³ bf16 GEMM on both tiles and in ping-pong, and both MoE grouped GEMMs (bf16)
    /// with the engine's plain GEMM on their dense shapes, the same ways (ag_moe's rows
    /// staged first by `cmm_gather_rows`), and ag_moe's also with its rows copied in the
    /// kernel (the in-kernel-gather and reader-fence variants).
    #[arg(long)]
    pub profile: bool,
    /// Instead of the sweep, set the engine's rules as they are now against the rows of a
    /// recorded sweep (its `gemm-sweep.json`, e.g. under docs/gpu-runs/): no GPU needed.
    #[arg(long, value_name = "FILE", conflicts_with = "profile")]
    pub judge: Option<PathBuf>,
}

/// The sweep's shapes: the bench's local GEMM (seed 000, D = 4), one with K = 6144 between
/// the K's at which each of the engine's tiles was measured faster (the tile rule's
/// `HOPPER_WIDE_MIN_K`), Flux's per-device AG+GEMM shape and the square one cuBLAS is
/// usually quoted at.
const SHAPES: [(usize, usize, usize); 4] =
    [(1024, 4096, 4096), (4096, 4096, 6144), (4096, 6144, 12288), (8192, 8192, 8192)];

/// The grouped GEMMs the sweep times: ag_moe's (rows gathered by token, × W1) and
/// moe_rs's (× W2) on one device of a Mixtral-sized layer at D = 8 (T = 4096 tokens, top-2
/// of 8 experts, H = 4096, F/D = 1792), uniform routing, so that every slot is routed:
/// 8192 rows in 8 groups, 8192 × 1792 × 4096 and 8192 × 4096 × 1792 of dense work.
const GROUPED: MoeShape = MoeShape { tokens: 4096, hidden: 4096, ffn: 1792, experts: 8, topk: 2 };

struct MoeShape {
    tokens: usize,
    hidden: usize,
    ffn: usize,
    experts: usize,
    topk: usize,
}

/// One of the Hopper engine's kernels for a GEMM: its tile and which of its kernels.
type Variant = (HopperTile, HopperVariant);

/// The sweep's Hopper-engine variants: each tile as the engine runs it, then shallower,
/// then in clusters of two, then the 128×128 tile in ping-pong, then each tile with its
/// epilogue through TMA stores.
const VARIANTS: [Variant; 9] = [
    (HopperTile::Wide, HopperVariant::Engine),
    (HopperTile::Narrow, HopperVariant::Engine),
    (HopperTile::Wide, HopperVariant::Shallow),
    (HopperTile::Narrow, HopperVariant::Shallow),
    (HopperTile::Wide, HopperVariant::Pair),
    (HopperTile::Narrow, HopperVariant::Pair),
    (HopperTile::Narrow, HopperVariant::PingPong),
    (HopperTile::Wide, HopperVariant::TmaStore),
    (HopperTile::Narrow, HopperVariant::TmaStore),
];

/// The variants of the grouped GEMMs (and of the engine's plain GEMM on their dense
/// shapes): each tile as the engine runs it, the 128×128 tile in ping-pong, whose
/// epilogue (moe_rs writes f32 rows after 28 steps of K) overlaps the other tile's work,
/// and each tile with its epilogue through TMA stores, which overlap the next tile's.
const GROUPED_VARIANTS: [Variant; 5] = [
    (HopperTile::Wide, HopperVariant::Engine),
    (HopperTile::Narrow, HopperVariant::Engine),
    (HopperTile::Narrow, HopperVariant::PingPong),
    (HopperTile::Wide, HopperVariant::TmaStore),
    (HopperTile::Narrow, HopperVariant::TmaStore),
];

/// The variants only ag_moe's grouped GEMM (the gathered one) also takes: each tile with
/// its gathered rows copied by the kernel's producer warpgroup (the engine's way before it
/// staged them), beside the engine's rows staged first; and so with their proxy fence in
/// the consumers (the way before that). Neither changes a GEMM that gathers nothing.
const GATHERED_VARIANTS: [Variant; 4] = [
    (HopperTile::Wide, HopperVariant::InKernelGather),
    (HopperTile::Narrow, HopperVariant::InKernelGather),
    (HopperTile::Wide, HopperVariant::ReaderFence),
    (HopperTile::Narrow, HopperVariant::ReaderFence),
];

/// "hopper 128x256", "hopper 128x256 3 stages", "hopper 128x256 cluster 2", "hopper
/// 128x128 pingpong".
fn variant_name((tile, variant): Variant) -> String {
    match variant {
        HopperVariant::Engine => format!("hopper {}", tile.name()),
        HopperVariant::Shallow => format!("hopper {} {} stages", tile.name(), tile.stages(variant)),
        HopperVariant::Pair => format!("hopper {} cluster {}", tile.name(), variant.cluster()),
        HopperVariant::PingPong => format!("hopper {} pingpong", tile.name()),
        HopperVariant::StagedGather => format!("hopper {} staged gather", tile.name()),
        HopperVariant::InKernelGather => format!("hopper {} in-kernel gather", tile.name()),
        HopperVariant::ReaderFence => format!("hopper {} reader fence", tile.name()),
        HopperVariant::TmaStore => format!("hopper {} tma store", tile.name()),
    }
}

/// Output elements the sweep checks against the oracle per variant.
const SPOT_CHECKS: usize = 64;

#[derive(Debug, Serialize, Deserialize)]
struct Row {
    shape: String,
    input: String,
    /// "cuBLAS", or the Hopper engine's kernel ([`variant_name`]; "… dense" and
    /// "… grouped" on the MoE shapes), or a tile kernel.
    engine: String,
    us: Option<f64>,
    tflops: Option<f64>,
    /// This row's rate over cuBLAS's on the same shape, in the same run.
    of_cublas: Option<f64>,
    /// The spot check: "ok (worst x of its allowance)", or what was wrong, or why the
    /// variant did not run.
    check: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Report {
    gpu: String,
    commit: Option<String>,
    reps: usize,
    shrink: usize,
    /// The SMs the engine's grids spanned, which its tile rule is asked with (absent from
    /// the sweeps recorded before 2026-11-28, all on GPUs of 132 SMs).
    #[serde(default)]
    sms: Option<u32>,
    rows: Vec<Row>,
    /// The engine's rules set against the rows ([`rules::verdicts`]); a recorded sweep's
    /// are made again from its rows, by the rules as they are now.
    #[serde(skip_deserializing)]
    verdicts: Vec<rules::Verdict>,
}

impl Report {
    /// The engine's rules as they are now set against the rows ([`rules::verdicts`]), on
    /// the SMs the report names ([`RECORDED_SMS`] where it names none).
    fn judged(&self) -> Result<Vec<rules::Verdict>> {
        let sms = self.sms.unwrap_or(RECORDED_SMS);
        Ok(rules::verdicts(&self.rows, &rules::asked_of(&self.rows, self.shrink, sms)?))
    }

    /// Writes the report as JSON to `path`, where one was asked for: after each shape, so
    /// that a run cut short keeps what it measured.
    fn save(&self, path: Option<&std::path::Path>) -> Result<()> {
        let Some(path) = path else { return Ok(()) };
        let json = serde_json::to_string_pretty(self).context("encoding the sweep")?;
        fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))
    }
}

/// Runs the sweep.
pub fn run(args: &Args) -> Result<()> {
    if let Some(path) = &args.judge {
        for line in judge(path)? {
            println!("{line}");
        }
        return Ok(());
    }
    let backend = CudaBackend::new(1).context("cannot start the CUDA backend")?;
    println!("gpu: {}", backend.summary());
    if !backend.has_hopper_engine() {
        bail!("this GPU does not run the Hopper engine (compute capability 9.0 with a real driver)");
    }
    if !backend.has_cublas() {
        bail!("libcublas cannot be loaded: the sweep compares with cuBLAS");
    }
    let shrink = args.shrink.max(1);
    if args.profile {
        return profile(&backend, shrink);
    }
    println!(
        "each variant spot-checked against the f64 oracle ({SPOT_CHECKS} elements) at the shape, then timed: \
         median of {} runs, operands rotated past the L2; ratios are of rates measured in this run",
        args.reps
    );
    println!("{:<26} {:<5} {:<32} {:>10} {:>9} {:>9}  check", "M×N×K", "dtype", "engine", "µs", "TFLOP/s", "÷ cuBLAS");
    let mut report = Report {
        gpu: backend.identity()?,
        commit: std::env::var("CMM_COMMIT").ok(),
        reps: args.reps,
        shrink,
        sms: None,
        rows: Vec::new(),
        verdicts: Vec::new(),
    };
    let sms = backend.hopper_sms().context("the Hopper engine's SMs")?;
    report.sms = Some(sms);
    // A variant whose run failed (a trap, a lost context) is not tried again at the
    // larger shapes: each failure can cost its barrier waits' deadline.
    let mut failing: Vec<Variant> = Vec::new();
    for (m, n, k) in SHAPES {
        for input in [DType::Bf16, DType::F16] {
            let spec = GemmSpec {
                m: m / shrink,
                n: n / shrink,
                k: k / shrink,
                input,
                output: input,
                trans_a: false,
                trans_b: false,
                accumulate: false,
            };
            let shape = format!("{}x{}x{}", spec.m, spec.n, spec.k);
            let cublas = backend
                .time_gemm(&spec, GemmEngine::Cublas, args.reps)
                .with_context(|| format!("timing cuBLAS on {shape}"))?;
            let mut rows = vec![row(&shape, input, "cuBLAS".into(), Some(cublas), &spec, cublas, "-".into())];
            for variant in VARIANTS {
                let name = variant_name(variant);
                if failing.contains(&variant) {
                    rows.push(row(
                        &shape,
                        input,
                        name,
                        None,
                        &spec,
                        cublas,
                        "not run: it failed on a smaller shape".into(),
                    ));
                    continue;
                }
                let (us, check, run_failed) = checked_time(&backend, &spec, variant, args.reps);
                if run_failed {
                    failing.push(variant);
                }
                rows.push(row(&shape, input, name, us, &spec, cublas, check));
            }
            if (m, n, k) == SHAPES[0] {
                // cmm's tile kernels on the bench's local GEMM, for the ladder.
                for (wide, name) in [(false, "tile 64x64"), (true, "tile 128x128")] {
                    let (us, check) = match backend.time_gemm_tiles(&spec, GemmEngine::TileKernel, wide, args.reps) {
                        Ok(us) => (Some(us), "checked by the corpus".to_string()),
                        Err(e) => (None, format!("timing failed: {e}")),
                    };
                    rows.push(row(&shape, input, name.into(), us, &spec, cublas, check));
                }
            }
            for r in rows {
                print_row(&r);
                report.rows.push(r);
            }
            report.save(args.json.as_deref())?;
        }
    }
    for input in [DType::Bf16, DType::F16] {
        for op in [MoeOp::AgMoe, MoeOp::MoeRs] {
            for r in grouped_rows(&backend, op, input, shrink, args.reps)? {
                print_row(&r);
                report.rows.push(r);
            }
        }
        report.save(args.json.as_deref())?;
    }
    report.verdicts = report.judged()?;
    for line in rules::lines(&report.verdicts) {
        println!("{line}");
    }
    report.save(args.json.as_deref())?;
    let wrong =
        report.rows.iter().filter(|r| r.check.starts_with("WRONG") || r.check.starts_with("run failed")).count();
    if wrong > 0 {
        bail!("{wrong} variant(s) wrong or failed");
    }
    Ok(())
}

/// The SMs of every GPU the sweeps recorded before they said (H100 SXM, H200).
const RECORDED_SMS: u32 = 132;

/// The lines of [`rules::lines`] for a recorded sweep, judged by the rules as they are now.
fn judge(path: &std::path::Path) -> Result<Vec<String>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let report: Report =
        serde_json::from_str(&text).with_context(|| format!("{} is not a gemm-sweep report", path.display()))?;
    let sms = report.sms.unwrap_or(RECORDED_SMS);
    let verdicts = report.judged()?;
    let mut out = vec![format!(
        "{}: {} at {}, {sms} SMs{}",
        path.display(),
        report.gpu,
        report.commit.as_deref().map_or("an unrecorded commit", |c| &c[..c.len().min(7)]),
        if report.sms.is_some() { "" } else { " (not recorded: the GPUs of those runs had 132)" }
    )];
    out.extend(rules::lines(&verdicts));
    Ok(out)
}

fn print_row(r: &Row) {
    println!(
        "{:<26} {:<5} {:<32} {:>10} {:>9} {:>9}  {}",
        r.shape,
        r.input,
        r.engine,
        r.us.map_or("-".into(), |u| format!("{u:.1}")),
        r.tflops.map_or("-".into(), |t| format!("{t:.0}")),
        r.of_cublas.map_or("-".into(), |x| format!("{x:.2}")),
        r.check
    );
}

/// The grouped GEMM of `op` ([`GROUPED`]) on each of the Hopper engine's tiles, timed
/// inside a one-device run of its plan (route, grouped GEMM, and moe_rs's combine) by the
/// events around its op (median of `reps` runs, at most 10), beside cuBLAS on the dense GEMM of the same FLOPs (the routed
/// rows × H × F/D). Its results are checked by the corpus and the device tests (the
/// grouped GEMMs there run on the engine), not here.
fn grouped_rows(backend: &CudaBackend, op: MoeOp, input: DType, shrink: usize, reps: usize) -> Result<Vec<Row>> {
    let Grouped { plan, site, spec } = grouped(op, input, shrink)?;
    let out = if spec.output == input { String::new() } else { format!(" →{}", spec.output) };
    let shape = format!("{op} {}x{}x{} E{}{out}", spec.m, spec.n, spec.k, GROUPED.experts);
    let cublas = backend
        .time_gemm(&spec, GemmEngine::Cublas, reps)
        .with_context(|| format!("timing cuBLAS on the dense {}x{}x{}", spec.m, spec.n, spec.k))?;
    let mut rows = vec![row(&shape, input, "cuBLAS dense".into(), Some(cublas), &spec, cublas, "-".into())];
    // The engine's plain GEMM on the same dense shape: what the grouping itself costs,
    // apart from what the shape (moe_rs's short K, ag_moe's narrow N) costs any GEMM.
    for variant in GROUPED_VARIANTS {
        let (us, check, _) = checked_time(backend, &spec, variant, reps);
        rows.push(row(&shape, input, format!("{} dense", variant_name(variant)), us, &spec, cublas, check));
    }
    if spec.output != input {
        // moe_rs's rows are f32: the same dense GEMM writing the input's dtype, on cuBLAS
        // and on the engine's tiles, says what the f32 stores cost each (the engine stores
        // from its registers, with the tensor cores idle meanwhile).
        let narrow = GemmSpec { output: input, ..spec };
        let shape = format!("{op} {}x{}x{} E{}", spec.m, spec.n, spec.k, GROUPED.experts);
        let cublas = backend
            .time_gemm(&narrow, GemmEngine::Cublas, reps)
            .with_context(|| format!("timing cuBLAS on the dense {}x{}x{} →{input}", spec.m, spec.n, spec.k))?;
        rows.push(row(&shape, input, "cuBLAS dense".into(), Some(cublas), &narrow, cublas, "-".into()));
        for variant in GROUPED_VARIANTS.iter().filter(|v| v.1 != HopperVariant::PingPong) {
            let (us, check, _) = checked_time(backend, &narrow, *variant, reps);
            rows.push(row(&shape, input, format!("{} dense", variant_name(*variant)), us, &narrow, cublas, check));
        }
    }
    let gathered = if op == MoeOp::AgMoe { &GATHERED_VARIANTS[..] } else { &[] };
    for &variant in GROUPED_VARIANTS.iter().chain(gathered) {
        let options = CudaRunOptions { time_ops: true, cold_l2: true, ..grouped_options(variant) };
        let mut times = Vec::new();
        let mut failure = None;
        let mut staged = false;
        // One untimed run first: module loading and the first touch of the buffers. Each
        // run regenerates the inputs and cools the L2, so at most 10 are timed.
        for rep in 0..=reps.clamp(1, 10) {
            match backend.run(&plan, GROUPED_SEED, Family::Realistic, &options) {
                Ok(out) if out.gemms.hopper != 1 => {
                    failure = Some(format!("ran on {}, not the Hopper engine", out.gemms.describe()));
                    break;
                }
                Ok(out) if rep > 0 => match out.op_times.iter().find(|(s, _, _)| *s == site) {
                    Some(&(_, _, us)) => {
                        times.push(us);
                        staged = out.gemms.staged > 0;
                    }
                    None => {
                        failure = Some("the run timed no grouped GEMM".into());
                        break;
                    }
                },
                Ok(_) => {}
                Err(e) => {
                    failure = Some(format!("run failed: {e:#}"));
                    break;
                }
            }
        }
        let name = format!("{} grouped", variant_name(variant));
        let us = (failure.is_none() && !times.is_empty()).then(|| crate::timing::median(times));
        // The engine stages gathered rows from 512 columns: say which way this row ran.
        let how = if staged { format!("; {STAGED_MARK}") } else { String::new() };
        let check = failure.unwrap_or_else(|| format!("checked by the corpus and the device tests{how}"));
        rows.push(row(&shape, input, name, us, &spec, cublas, check));
    }
    Ok(rows)
}

/// What a grouped row's check says where its gathered rows were staged first: how the
/// rules tell, in a recorded sweep too, which way the engine's rows ran.
const STAGED_MARK: &str = "gathered rows staged first (its time includes theirs)";

/// The seed of the grouped GEMMs' routing and inputs.
const GROUPED_SEED: u32 = 17;

/// A grouped GEMM of the sweep: its one-device MoE plan, the grouped GEMM's site in it,
/// and the dense GEMM of the same FLOPs.
struct Grouped {
    plan: cmm_core::Plan,
    site: cmm_core::plan::OpSite,
    spec: GemmSpec,
}

/// The run options of a grouped GEMM on the Hopper engine's `variant`, its results not
/// read.
fn grouped_options((tile, variant): Variant) -> CudaRunOptions {
    CudaRunOptions {
        gemm: GemmEngine::Hopper,
        hopper_tile: Some(tile),
        hopper_variant: variant,
        read_back: ReadBack::Nothing,
        ..Default::default()
    }
}

/// The grouped GEMM of `op` ([`GROUPED`], every dimension divided by `shrink`).
fn grouped(op: MoeOp, input: DType, shrink: usize) -> Result<Grouped> {
    let g = GROUPED;
    let problem = MoeProblem::new(
        op,
        1,
        g.tokens / shrink,
        g.hidden / shrink,
        g.ffn / shrink,
        g.experts,
        g.topk,
        Routing::Uniform,
        input,
        input,
    )?;
    let plan = build_moe_plan(&problem, Algorithm::Baseline)?;
    let (site, c) = plan
        .ops()
        .find_map(|(site, op)| match op {
            cmm_core::Op::GroupedGemm { c, .. } => Some((site, c.buf)),
            _ => None,
        })
        .context("an MoE plan has a grouped GEMM")?;
    // The dense GEMMs write what the grouped one writes (moe_rs: f32 rows for the combine).
    let output = plan.buffer(c).dtype;
    // Uniform routing drops no slot: every token's k rows are computed, × W1 (H × F) for
    // ag_moe, × W2 (F × H) for moe_rs.
    let (n, k) = match op {
        MoeOp::AgMoe => (problem.ffn, problem.hidden),
        MoeOp::MoeRs => (problem.hidden, problem.ffn),
    };
    let spec = GemmSpec {
        m: problem.tokens * problem.slots,
        n,
        k,
        input,
        output,
        trans_a: false,
        trans_b: false,
        accumulate: false,
    };
    Ok(Grouped { plan, site, spec })
}

/// The clusters of two that the profile mode also runs on 8192³: where their kernels
/// stall, since they ran at 0.49–0.71 of cuBLAS on an H200 (2026-11-27) against the single
/// CTAs' 0.72–0.86.
const PROFILED_PAIRS: [Variant; 2] =
    [(HopperTile::Wide, HopperVariant::Pair), (HopperTile::Narrow, HopperVariant::Pair)];

/// One run of the profile mode ([`Args::profile`]).
#[derive(Clone, Copy, Debug)]
enum Profiled {
    /// The 8192³ bf16 GEMM.
    Square(Variant),
    /// The engine's plain GEMM on `op`'s dense shape.
    Dense(MoeOp, Variant),
    /// `op`'s grouped GEMM, inside its plan's run.
    Grouped(MoeOp, Variant),
}

impl Profiled {
    /// Every run of the profile mode, in its order.
    fn all() -> Vec<Profiled> {
        let mut runs: Vec<Profiled> =
            GROUPED_VARIANTS.into_iter().chain(PROFILED_PAIRS).map(Profiled::Square).collect();
        for op in [MoeOp::AgMoe, MoeOp::MoeRs] {
            let gathered = if op == MoeOp::AgMoe { &GATHERED_VARIANTS[..] } else { &[] };
            for &variant in GROUPED_VARIANTS.iter().chain(gathered) {
                if !GATHERED_VARIANTS.contains(&variant) {
                    runs.push(Profiled::Dense(op, variant));
                }
                runs.push(Profiled::Grouped(op, variant));
            }
        }
        runs
    }

    /// The launches of the engine's kernels and of `cmm_gather_rows` it makes at the
    /// sweep's own shapes (what the bundle's `ncu-hopper` step counts): a plain GEMM's
    /// warm-up and its run; a grouped GEMM's kernel, and where it stages ag_moe's rows
    /// the staging's.
    fn launches(self) -> usize {
        match self {
            Profiled::Square(_) | Profiled::Dense(..) => 2,
            Profiled::Grouped(MoeOp::AgMoe, (_, variant)) if variant.stages_gathered_rows(GROUPED.ffn) => 2,
            Profiled::Grouped(..) => 1,
        }
    }
}

/// The launches the profile mode makes of the kernels `ncu-hopper` profiles.
pub(crate) fn profiled_launches() -> usize {
    Profiled::all().into_iter().map(Profiled::launches).sum()
}

/// The profiler's runs ([`Args::profile`]): each kernel of interest a few times, ungated
/// (a profiler serialises launches, and the gate would hold them), nothing timed or
/// checked here.
fn profile(backend: &CudaBackend, shrink: usize) -> Result<()> {
    let n = 8192 / shrink;
    let square = GemmSpec {
        m: n,
        n,
        k: n,
        input: DType::Bf16,
        output: DType::Bf16,
        trans_a: false,
        trans_b: false,
        accumulate: false,
    };
    let plain = |what: &str, spec: &GemmSpec, variant: Variant| -> Result<()> {
        let name = variant_name(variant);
        backend.time_gemm_as(spec, &hopper_choice(variant), 1).with_context(|| format!("{what} on {name}"))?;
        println!("profiled: {what} {}x{}x{} bf16 on {name}", spec.m, spec.n, spec.k);
        Ok(())
    };
    let (ag_moe, moe_rs) = (grouped(MoeOp::AgMoe, DType::Bf16, shrink)?, grouped(MoeOp::MoeRs, DType::Bf16, shrink)?);
    let of = |op| if op == MoeOp::AgMoe { &ag_moe } else { &moe_rs };
    if shrink == 1 {
        println!("profiled: {} launches of cmm_hopper and cmm_gather_rows kernels to come", profiled_launches());
    }
    for run in Profiled::all() {
        match run {
            Profiled::Square(variant) => plain("plain", &square, variant)?,
            Profiled::Dense(op, variant) => plain(&format!("{op} dense"), &of(op).spec, variant)?,
            Profiled::Grouped(op, variant) => {
                let Grouped { plan, spec, .. } = of(op);
                let options = CudaRunOptions { gate: false, ..grouped_options(variant) };
                backend
                    .run(plan, GROUPED_SEED, Family::Realistic, &options)
                    .with_context(|| format!("{op} grouped"))?;
                println!("profiled: {op} grouped {}x{}x{} bf16 on {}", spec.m, spec.n, spec.k, variant_name(variant));
            }
        }
    }
    Ok(())
}

/// The Hopper engine's `variant` for every GEMM of a timing.
fn hopper_choice((tile, variant): Variant) -> GemmChoice {
    GemmChoice {
        engine: GemmEngine::Hopper,
        wide_tiles: false,
        hopper: true,
        hopper_tile: Some(tile),
        hopper_variant: variant,
    }
}

/// The GEMM on the Hopper engine's `variant`: spot-checked ([`checked`]), then timed as
/// the sweep times a GEMM; the time, the check's line ("WRONG: …" where it ran wrong),
/// and whether its run failed (a trap, a lost context: "run failed: …").
fn checked_time(backend: &CudaBackend, spec: &GemmSpec, variant: Variant, reps: usize) -> (Option<f64>, String, bool) {
    let choice = hopper_choice(variant);
    match checked(backend, spec, variant) {
        Ok(Ok(worst)) => match backend.time_gemm_as(spec, &choice, reps) {
            Ok((us, GemmImpl::Hopper { .. })) => (Some(us), format!("ok (worst {worst:.2} of its allowance)"), false),
            Ok((_, other)) => (None, format!("ran on {other:?}, not the Hopper engine"), false),
            Err(e) => (None, format!("timing failed: {e}"), false),
        },
        Ok(Err(wrong)) => (None, format!("WRONG: {wrong}"), false),
        Err(e) => (None, format!("run failed: {e:#}"), true),
    }
}

fn row(shape: &str, input: DType, engine: String, us: Option<f64>, spec: &GemmSpec, cublas: f64, check: String) -> Row {
    Row {
        shape: shape.into(),
        input: input.to_string(),
        engine,
        us,
        tflops: us.map(|u| spec.flops() / u / 1e6),
        of_cublas: us.map(|u| cublas / u),
        check,
    }
}

/// One run of the GEMM on the Hopper engine's `variant`, its output spot-checked against
/// the f64 oracle: `Ok(worst)` or `Err(what was wrong)`. With B N-major a wrong result is
/// also tried with the descriptor's two byte offsets swapped, and the line says whether
/// that reading was right (what the hardware makes of the offsets is then known).
fn checked(backend: &CudaBackend, spec: &GemmSpec, variant: Variant) -> Result<std::result::Result<f64, String>> {
    let first = check_once(backend, spec, variant)?;
    if first.is_ok() {
        return Ok(first);
    }
    std::env::set_var("CMM_HOPPER_MN_OFFSETS", "swap");
    let swapped = check_once(backend, spec, variant);
    std::env::remove_var("CMM_HOPPER_MN_OFFSETS");
    let note = match swapped {
        Ok(Ok(w)) => format!("with the N-major offsets swapped it is right (worst {w:.2})"),
        Ok(Err(why)) => format!("swapped offsets wrong too: {why}"),
        Err(e) => format!("swapped offsets failed: {e:#}"),
    };
    Ok(first.map_err(|why| format!("{why}; {note}")))
}

fn check_once(
    backend: &CudaBackend,
    spec: &GemmSpec,
    (tile, variant): Variant,
) -> Result<std::result::Result<f64, String>> {
    const SEED: u32 = 11;
    let problem = Problem::new(OpKind::AgGemm, 1, spec.m, spec.n, spec.k, spec.input, spec.output)?;
    let plan = cmm_cuda::gemm_plan(spec)?;
    let options = CudaRunOptions {
        gemm: GemmEngine::Hopper,
        hopper_tile: Some(tile),
        hopper_variant: variant,
        read_back: ReadBack::Results,
        ..Default::default()
    };
    let out = backend.run(&plan, SEED, Family::Realistic, &options)?;
    if out.gemms.hopper != 1 {
        bail!("the GEMM ran on {}", out.gemms.describe());
    }
    let c = plan.buffer_id("C").context("the GEMM plan has a C")?;
    let decl = plan.buffer(c);
    let got = |d: usize, r: usize, col: usize| {
        let word = out.buffers.get(d).and_then(|b| b.get(c.0)).and_then(|w| w.get(r * decl.cols + col));
        word.map_or(f64::NAN, |&w| decl.dtype.decode(w) as f64)
    };
    let check = spot_check(&problem, SEED, Family::Realistic, &output_tolerance(&problem), SPOT_CHECKS, &got);
    Ok(match check.misses.first() {
        None => Ok(check.worst),
        Some(m) => Err(format!(
            "{} of {} elements wrong; first C[{}, {}] = {} where the oracle has {} (± {:.2e})",
            check.misses.len(),
            check.checked,
            m.row,
            m.col,
            m.got,
            m.expected,
            m.allowed
        )),
    })
}
