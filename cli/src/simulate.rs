//! `cmm simulate` (also `cargo xtask simulate`): simulate one plan on a hardware profile (or time it on the wgpu
//! reference), compare with the analytic formulas, write timelines, print the validation
//! table.

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use cmm_core::algorithms::build_plan;
use cmm_core::emulate::staggered_priorities;
use cmm_core::engines::CopyIssue;
use cmm_core::generator::Family;
use cmm_core::mesh::build_mesh_plan;
use cmm_core::plan::Plan;
use cmm_core::{AttentionProblem, Layer, Layout, LinearProblem, MoeOp, MoeProblem, Pass, Routing};
use cmm_core::{Dataflow, MeshAlgorithm, MeshProblem};
use cmm_reference::{Reference, RunOptions};
use cmm_sim::analytic::{copied_by, ring_1d};
use cmm_sim::analytic::{estimate_mesh_algorithm, MeshGemm, MeshShape};
use cmm_sim::timeline::Timeline;
use cmm_sim::tune::{candidates_1d, tune_attention, tune_linear, tune_moe, REPLAY_SLICES};
use cmm_sim::validate::{flux, one_gpu_bench, seed000, seed002, seed002_as_built, seed002_simulated};
use cmm_sim::TopologyKind;
use cmm_sim::{simulate, Engines, HardwareQueues, OpClass, Profile, SimOptions, SimReport};
use serde::Serialize;

use crate::problem_args::{algorithm, us, ProblemArgs};

/// Which executor produces the timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Executor {
    /// The discrete-event simulator with the profile's durations.
    Sim,
    /// The wgpu reference, op by op, with wall time per op.
    Reference,
}

/// Arguments of `cmm simulate` and `cargo xtask simulate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A plan file (JSON, format cmm-plan) to simulate instead of a problem.
    #[arg(value_name = "PLAN", conflicts_with_all = ["op", "chunks", "node", "compare", "validate", "layer", "attention", "moe", "mesh", "executor"])]
    pub plan: Option<PathBuf>,
    #[command(flatten)]
    pub problem: ProblemArgs,
    /// Algorithm: baseline, baseline_direct, ring, ring_bidir, ring_chunked, fused,
    /// hierarchical, or for gemm_rs and gemm_ar ring_accumulate, ring_push and fused_push.
    #[arg(long, default_value = "ring")]
    pub algorithm: String,
    /// Chunks per shard or block (ring_chunked, required; ring_accumulate, fused and
    /// fused_push, default 1).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// GPUs per node (hierarchical: required, unless the profile has a network, whose
    /// node size it then takes).
    #[arg(long)]
    pub node: Option<usize>,
    /// Torus shape for torus profiles, e.g. 4x4 (default: a ring of D devices).
    #[arg(long, value_name = "RxC")]
    pub torus: Option<String>,
    /// Stagger the devices' compute over this many priority levels (device d at
    /// ⌊d·N/D⌋), as the CUDA executor's `--stagger` does on one GPU; it matters where
    /// devices share compute (`--profile h100-one-gpu`). 0: every device at one priority.
    #[arg(long, default_value_t = 0)]
    pub stagger: usize,
    /// Start device d's first GEMM after device d − 1's, as the CUDA executor's
    /// `--offset-starts` does on one GPU (refused where it would deadlock).
    #[arg(long)]
    pub offset_starts: bool,
    /// The GPU's hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`, 1 to 32; CUDA gives 8
    /// unasked): the lanes' ops share them in the CUDA backend's enqueue order, so a lane
    /// waiting for its own previous op holds every op behind it (default: each lane on its
    /// own, as `cargo xtask`'s 32 give the corpus's plans). A plan or 1D op only.
    #[arg(long, value_name = "N", conflicts_with_all = ["compare", "validate", "validate_bench", "layer", "attention", "moe", "mesh"])]
    pub hardware_queues: Option<usize>,
    /// With --hardware-queues: the queue the first stream feeds (the driver's round-robin
    /// start, which the host does not know).
    #[arg(long, value_name = "K", default_value_t = 0, requires = "hardware_queues")]
    pub queue_offset: usize,
    /// How the plan's copy-engine copies are issued, as the CUDA executor's `--copies`:
    /// auto (contiguous ones asked of the copy engines, strided ones left to the driver),
    /// copy-engines, or driver. On a one-GPU profile the copies the driver makes share its
    /// `copy.driver_gbps`. A plan or 1D op only.
    #[arg(long, value_name = "HOW", default_value = "auto", value_parser = CopyIssue::parse,
          conflicts_with_all = ["compare", "validate", "validate_bench", "layer", "attention", "moe", "mesh"])]
    pub copies: CopyIssue,
    /// Price every GEMM at the profile's cuBLAS rate instead of on the engine cmm runs it
    /// on (a potential: what the plan would take if cmm's kernels were as fast as cuBLAS;
    /// with --compare, a second column beside the as-built one).
    #[arg(long)]
    pub potential: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write a Chrome/Perfetto trace JSON of the run.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Write an SVG Gantt chart of the run.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Who runs the plan.
    #[arg(long, value_enum, default_value = "sim")]
    pub executor: Executor,
    /// Print every candidate algorithm's simulated time beside its analytic formula
    /// (`hierarchical` at the profile's node size, across its nodes).
    #[arg(long, conflicts_with_all = ["executor", "trace", "svg", "node"])]
    pub compare: bool,
    /// Print the validation table (seed 000 on h100-nvlink, seed 002 on tpuv4-torus).
    #[arg(long, conflicts_with_all = ["op", "devices", "m", "n", "k", "profile", "input", "output", "compare", "executor", "trace", "svg", "json"])]
    pub validate: bool,
    /// Read a CUDA bench report (`cargo xtask bench --backend cuda --json FILE`, or the GPU
    /// bundle's `bench-*.json`) against the one-GPU profile: every modelled plan's measured
    /// times beside the simulator's, as the profile stands and with the report's
    /// `calibration` figures in place of its assumptions.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["plan", "op", "devices", "m", "n", "k", "profile", "input", "output", "compare", "executor", "trace", "svg", "json", "validate"])]
    pub validate_bench: Option<PathBuf>,
    /// A linear layer instead of a 1D op (with -d, -m = S tokens, -k = H, -n = F):
    /// column, row or mlp; every algorithm is simulated and the overlap verdict printed.
    #[arg(long, value_parser = parse_layer, conflicts_with_all = ["op", "chunks", "node", "torus", "compare", "trace", "svg", "executor", "validate"])]
    pub layer: Option<Layer>,
    /// The linear pass: forward, backward (column, row) or train (mlp).
    #[arg(long, value_parser = parse_pass, requires = "layer")]
    pub pass: Option<Pass>,
    /// Without sequence parallelism (column and row layers).
    #[arg(long, requires = "layer")]
    pub no_sp: bool,
    /// Micro-batches of the linear pass.
    #[arg(long, default_value_t = 1, requires = "layer")]
    pub microbatches: usize,
    /// Sequence-parallel attention instead of a 1D op (with -d, -m = S, -n = query heads,
    /// -k = head dimension): every algorithm is simulated, a causal prefill in both
    /// layouts, and the verdicts printed.
    #[arg(long, conflicts_with_all = ["op", "chunks", "node", "torus", "compare", "trace", "svg", "layer", "executor", "validate"])]
    pub attention: bool,
    /// Key/value heads (default: the query heads).
    #[arg(long, requires = "attention")]
    pub kv_heads: Option<usize>,
    /// Causal mask.
    #[arg(long, requires = "attention")]
    pub causal: bool,
    /// Decode: this many query tokens against S keys (split-KV).
    #[arg(long, requires = "attention")]
    pub queries: Option<usize>,
    /// A mixture-of-experts op instead of a 1D op (ag_moe or moe_rs; with -d, -m = T
    /// tokens, -k = H, -n = F, --experts, --topk, --routing): every algorithm is
    /// simulated, grouped GEMMs priced from the routing, and the verdict printed.
    #[arg(long, value_parser = parse_moe_op, conflicts_with_all = ["op", "chunks", "node", "torus", "compare", "trace", "svg", "layer", "attention", "executor", "validate"])]
    pub moe: Option<MoeOp>,
    /// Experts E.
    #[arg(long, requires = "moe")]
    pub experts: Option<usize>,
    /// Experts per token k (top-k).
    #[arg(long, requires = "moe")]
    pub topk: Option<usize>,
    /// The router's distribution: uniform, skewed, empty, single or drop.
    #[arg(long, default_value = "uniform", value_parser = parse_routing, requires = "moe")]
    pub routing: Routing,
    /// A 2D GEMM on an Nr×Nc mesh instead of a 1D op (with -m -n -k, --dataflow and
    /// --algorithm collective, summa, cannon, wang, wang_bidir, wang_columns, wang_columns_bidir
    /// or meshslice): the mesh plan itself is simulated, beside seed 002's analytic model.
    #[arg(long, value_name = "NRxNC", conflicts_with_all = ["op", "chunks", "node", "torus", "compare", "layer", "attention", "moe", "executor", "validate"])]
    pub mesh: Option<String>,
    /// The mesh dataflow: os, ls or rs.
    #[arg(long, default_value = "os", requires = "mesh")]
    pub dataflow: String,
    /// MeshSlice's slice count S.
    #[arg(long, requires = "mesh")]
    pub slices: Option<usize>,
    /// MeshSlice's block size B (default: the largest with S·B dividing both sliced extents).
    #[arg(long, requires = "mesh")]
    pub block: Option<usize>,
}

fn parse_moe_op(s: &str) -> Result<MoeOp, String> {
    s.parse()
}

fn parse_routing(s: &str) -> Result<Routing, String> {
    s.parse()
}

fn parse_layer(s: &str) -> Result<Layer, String> {
    s.parse()
}

fn parse_pass(s: &str) -> Result<Pass, String> {
    s.parse()
}

/// The dimensions of a shape such as `4x4`, given as the value of `flag`.
fn grid_dims(flag: &str, spec: &Option<String>) -> Result<Option<Vec<usize>>> {
    spec.as_ref()
        .map(|s| {
            s.split('x')
                .map(|p| p.trim().parse::<usize>().with_context(|| format!("{flag} {s}: expected e.g. 4x4")))
                .collect()
        })
        .transpose()
}

fn torus_dims(spec: &Option<String>) -> Result<Option<Vec<usize>>> {
    grid_dims("--torus", spec)
}

fn write_timeline(args: &Args, timeline: &Timeline) -> Result<()> {
    if let Some(path) = &args.trace {
        fs::write(path, timeline.chrome_trace_json()).with_context(|| format!("writing {}", path.display()))?;
        if !args.json {
            println!("trace: {} (open in https://ui.perfetto.dev or chrome://tracing)", path.display());
        }
    }
    if let Some(path) = &args.svg {
        fs::write(path, timeline.svg()).with_context(|| format!("writing {}", path.display()))?;
        if !args.json {
            println!("svg:   {}", path.display());
        }
    }
    Ok(())
}

/// Runs the command.
pub fn run(args: &Args) -> Result<()> {
    if args.validate {
        return validate();
    }
    if let Some(path) = &args.validate_bench {
        return crate::bench_file::validate_bench(path);
    }
    if let Some(path) = &args.plan {
        return plan_file(args, path);
    }
    if let Some(layer) = args.layer {
        return linear(args, layer);
    }
    if args.attention {
        return attention(args);
    }
    if let Some(op) = args.moe {
        return moe(args, op);
    }
    if let Some(mesh) = &args.mesh {
        return mesh_gemm(args, mesh);
    }
    let problem = args.problem.problem()?;
    let profile = args.problem.profile()?;
    if args.compare {
        return compare(&problem, &profile, args.potential, args.json);
    }
    // Without --node, the hierarchical plan takes the profile's node size (all D in one
    // node where D is smaller).
    let node = match (args.node, args.algorithm.as_str(), profile.network) {
        (None, "hierarchical", Some(net)) => Some(net.devices_per_node.min(problem.devices)),
        (node, ..) => node,
    };
    let alg = algorithm(&args.algorithm, args.chunks, node)?;
    let plan = build_plan(&problem, alg)?;
    let plan = if args.offset_starts { cmm_core::emulate::offset_starts(&plan)? } else { plan };
    match args.executor {
        Executor::Sim => {
            let compute_priority =
                if args.stagger > 0 { staggered_priorities(plan.devices, args.stagger) } else { Vec::new() };
            let options = SimOptions {
                torus_dims: torus_dims(&args.torus)?,
                compute_priority,
                engines: pricing(args),
                hardware_queues: hardware_queues(args),
                copies: args.copies,
            };
            let report = simulate(&plan, &profile, &options)?;
            let analytic = ring_1d(&problem, alg, &copied_by(&profile, args.copies));
            if args.json {
                crate::output::emit_json(json(&plan, &report, Some(analytic.total_s)))?;
            } else {
                print_report(&plan, &profile, &report, Some((analytic.total_s, analytic.formula)));
            }
            write_timeline(args, &Timeline::from_simulation(&plan, &report))
        }
        Executor::Reference => reference(args, &plan),
    }
}

fn reference(args: &Args, plan: &Plan) -> Result<()> {
    let r = Reference::new().context("cannot start the wgpu reference")?;
    let options = RunOptions { time_ops: true, ..Default::default() };
    let out = r.run_with(plan, 1, Family::Realistic, &options).context("running the plan on the reference")?;
    let times = out.op_times.unwrap_or_default();
    let ops: Vec<_> = times.iter().map(|t| (t.site, micros(t.start), micros(t.duration))).collect();
    let total = micros(out.execute);
    let title = format!("{} on the wgpu reference ({}), op by op: {total:.0} µs", plan.name, r.gpu().info.name);
    let timeline = Timeline::from_measured(plan, title, &ops);
    if args.json {
        let report = serde_json::json!({
            "plan": plan.name,
            "executor": "reference",
            "adapter": r.adapter_summary(),
            "wall_us": total,
            "ops": ops.len(),
        });
        println!("{report}");
    } else {
        println!("plan:     {}", plan.name);
        println!("executor: wgpu reference on {}", r.adapter_summary());
        println!("wall time of the ops, submitted one by one: {total:.0} µs ({} ops)", ops.len());
        for kind in cmm_sim::timeline::SpanKind::ALL {
            let spans: Vec<_> = timeline.spans.iter().filter(|s| s.kind == kind).collect();
            if !spans.is_empty() {
                let sum: f64 = spans.iter().map(|s| s.dur_us).sum();
                println!("  {:<10} {:>4} ops {:>12.0} µs", kind.name(), spans.len(), sum);
            }
        }
    }
    write_timeline(args, &timeline)
}

/// The times of one simulated plan, for `--json`.
#[derive(Serialize)]
struct Timing {
    makespan_us: f64,
    compute_floor_us: f64,
    comm_floor_us: f64,
    exposed_comm_us: f64,
}

impl Timing {
    fn of(r: &SimReport) -> Timing {
        Timing {
            makespan_us: r.makespan_s * 1e6,
            compute_floor_us: r.compute_floor_s * 1e6,
            comm_floor_us: r.comm_floor_s * 1e6,
            exposed_comm_us: r.max_exposed_comm_s() * 1e6,
        }
    }
}

/// Prints a ranking with its verdict as one JSON object.
fn print_ranking_json(
    problem: String,
    profile: &Profile,
    ranked: impl Serialize,
    overlap_pays: bool,
    reason: &str,
) -> Result<()> {
    let report = serde_json::json!({
        "problem": problem,
        "profile": profile.name,
        "ranked": ranked,
        "overlap_pays": overlap_pays,
        "reason": reason,
    });
    crate::output::emit_json(report)
}

/// How `--potential` asks the GEMMs to be priced.
fn pricing(args: &Args) -> Engines {
    if args.potential {
        Engines::CublasSpeed
    } else {
        Engines::AsBuilt
    }
}

/// One simulated algorithm (linear or MoE), for `--json`.
#[derive(Serialize)]
struct LinearRow {
    algorithm: String,
    #[serde(flatten)]
    timing: Timing,
    /// What priced its GEMMs ([`engines_line`]).
    gemm_engines: String,
}

/// What the run assumed of the GPU's hardware queues.
fn queues_line(plan: &Plan, r: &SimReport) -> String {
    let streams = plan.devices * plan.lanes.len();
    match r.hardware_queues {
        None => format!("each of the {streams} lanes on its own (CUDA_DEVICE_MAX_CONNECTIONS ≥ {streams})"),
        Some(hw) => format!(
            "{} hardware queue(s) for {streams} lanes (stream 0 on queue {}), ops in the CUDA backend's enqueue order",
            hw.queues,
            hw.offset % hw.queues.max(1)
        ),
    }
}

/// How a one-GPU run's copies were priced: which the driver made, at what shared rate.
fn copies_line(profile: &Profile, r: &SimReport) -> String {
    match profile.copy.driver_gbps {
        Some(gbps) => format!(
            "--copies {}: {} between virtual devices made by the driver, sharing its {gbps} GB/s; the others at the copy engines' {} GB/s each",
            r.copies.key(),
            r.driver_copies,
            profile.copy.copy_engine_gbps
        ),
        None => format!(
            "--copies {}: every copy at the copy engines' {} GB/s (the profile gives no driver rate)",
            r.copies.key(),
            profile.copy.copy_engine_gbps
        ),
    }
}

/// `--hardware-queues` and `--queue-offset`, as the simulator takes them.
fn hardware_queues(args: &Args) -> Option<HardwareQueues> {
    args.hardware_queues.map(|queues| HardwareQueues { queues, offset: args.queue_offset })
}

/// `--layer`: every linear algorithm simulated, and the verdict.
fn linear(args: &Args, layer: Layer) -> Result<()> {
    let pa = &args.problem;
    let (Some(d), Some(m), Some(n), Some(k)) = (pa.devices, pa.m, pa.n, pa.k) else {
        anyhow::bail!(
            "a linear layer needs -d, -m (S tokens), -n (F) and -k (H), e.g. --layer mlp --pass train -d 8 -m 2048 -k 12288 -n 49152"
        );
    };
    if pa.output.is_some_and(|o| o != pa.input) {
        anyhow::bail!("linear layers keep the input dtype for activations and gradients; drop --output");
    }
    let pass = args.pass.unwrap_or(if layer == Layer::Mlp { Pass::Train } else { Pass::Backward });
    let problem = LinearProblem::new(layer, pass, !args.no_sp, d, args.microbatches, m, k, n, pa.input)?;
    let profile = pa.profile()?;
    let ranking = tune_linear(&problem, &profile, pricing(args))?;
    let header = format!("linear {} on {} ({:.1} TFLOP)", problem.describe(), profile.name, problem.flops() / 1e12);
    let rows = ranking.ranked.iter().map(|c| (c.algorithm.to_string(), &c.report)).collect();
    print_ranking(args.json, header, problem.describe(), &profile, rows, ranking.overlap_pays, &ranking.reason)
}

/// A plan file simulated as it is (no analytic model: the plan says nothing of a problem).
fn plan_file(args: &Args, path: &std::path::Path) -> Result<()> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    plan_text(args, &text, &path.display().to_string())
}

/// A plan file's text (`origin` names it in errors) simulated with these arguments' other
/// options, as `cmm simulate FILE` does.
pub fn plan_text(args: &Args, text: &str, origin: &str) -> Result<()> {
    let plan = Plan::from_file_json(text).with_context(|| origin.to_string())?;
    let profile = args.problem.profile()?;
    let report = simulate(
        &plan,
        &profile,
        &SimOptions {
            torus_dims: torus_dims(&args.torus)?,
            hardware_queues: hardware_queues(args),
            copies: args.copies,
            ..SimOptions::default()
        },
    )?;
    if args.json {
        crate::output::emit_json(json(&plan, &report, None))?;
    } else {
        print_report(&plan, &profile, &report, None);
    }
    write_timeline(args, &Timeline::from_simulation(&plan, &report))
}

/// `--mesh`: one 2D plan simulated on the mesh, beside seed 002's analytic estimate.
fn mesh_gemm(args: &Args, mesh: &str) -> Result<()> {
    let dims = grid_dims("--mesh", &Some(mesh.to_string()))?.unwrap_or_default();
    let [nr, nc] = dims[..] else { bail!("--mesh {mesh}: expected NRxNC, e.g. 4x4") };
    let pa = &args.problem;
    let (Some(m), Some(n), Some(k)) = (pa.m, pa.n, pa.k) else {
        bail!("a mesh GEMM needs -m, -n and -k, e.g. --mesh 4x4 --dataflow os --algorithm meshslice --slices 4 -m 8192 -n 8192 -k 8192");
    };
    let dataflow: Dataflow = args.dataflow.parse().map_err(anyhow::Error::msg)?;
    let output = pa.output.unwrap_or(pa.input);
    let problem = MeshProblem::for_simulation(nr, nc, dataflow, m, n, k, pa.input, output)?;
    let problem = match pa.wire {
        Some(wire) => problem.with_wire(wire)?,
        None => problem,
    };
    // MeshSlice's block defaults to the largest B with S·B dividing both sliced extents.
    let block = args.block.or_else(|| problem.largest_block(args.slices?).filter(|_| args.algorithm == "meshslice"));
    let algorithm = MeshAlgorithm::parse(&args.algorithm, args.slices, block)?;
    let plan = build_mesh_plan(&problem, algorithm)?;
    let profile = pa.profile()?;
    let torus = profile.interconnect.topology == TopologyKind::Torus;
    let report =
        simulate(&plan, &profile, &SimOptions { torus_dims: torus.then(|| vec![nr, nc]), ..SimOptions::default() })?;
    let gemm = MeshGemm { m, n, k, dataflow, dtype: pa.input, wire: problem.wire };
    let analytic = estimate_mesh_algorithm(algorithm, &gemm, MeshShape { rows: nr, cols: nc }, &profile)?;
    if args.json {
        crate::output::emit_json(json(&plan, &report, Some(analytic.total_s)))?;
    } else {
        print_report(&plan, &profile, &report, Some((analytic.total_s, "seed 002's analytic model")));
    }
    write_timeline(args, &Timeline::from_simulation(&plan, &report))
}

/// `--moe`: every MoE algorithm simulated, and the verdict.
fn moe(args: &Args, op: MoeOp) -> Result<()> {
    let pa = &args.problem;
    let (Some(d), Some(t), Some(f), Some(h), Some(e), Some(k)) =
        (pa.devices, pa.m, pa.n, pa.k, args.experts, args.topk)
    else {
        anyhow::bail!(
            "an MoE op needs -d, -m (T tokens), -n (F), -k (H), --experts and --topk, e.g. --moe ag_moe -d 8 -m 8192 -k 4096 -n 14336 --experts 8 --topk 2 --input bf16"
        );
    };
    let problem = MoeProblem::new(op, d, t, h, f, e, k, args.routing, pa.input, pa.output.unwrap_or(pa.input))?;
    let profile = pa.profile()?;
    let ranking = tune_moe(&problem, &profile, pricing(args))?;
    let tables = problem.tables(cmm_sim::engine::SIM_ROUTING_SEED, 1);
    let rows: Vec<usize> = (0..e).map(|x| tables.segment(x, 0, 1).len()).collect();
    let header = format!(
        "{op} {} on {} ({:.1} TFLOP; {} of {} slots routed, rows per expert {}..{})",
        problem.describe(),
        profile.name,
        problem.flops(cmm_sim::engine::SIM_ROUTING_SEED) / 1e12,
        tables.routed(),
        problem.capacity(),
        rows.iter().min().unwrap_or(&0),
        rows.iter().max().unwrap_or(&0),
    );
    let rows = ranking.ranked.iter().map(|c| (c.algorithm.to_string(), &c.report)).collect();
    print_ranking(args.json, header, problem.describe(), &profile, rows, ranking.overlap_pays, &ranking.reason)
}

/// A ranking of algorithms with its verdict: one JSON object with `--json`, else the
/// header, the table of candidates (simulated time, floors, exposed communication) and
/// the verdict.
fn print_ranking(
    json: bool,
    header: String,
    problem: String,
    profile: &Profile,
    ranked: Vec<(String, &SimReport)>,
    overlap_pays: bool,
    reason: &str,
) -> Result<()> {
    if json {
        let rows: Vec<LinearRow> = ranked
            .iter()
            .map(|(name, r)| LinearRow {
                algorithm: name.clone(),
                timing: Timing::of(r),
                gemm_engines: engines_line(r),
            })
            .collect();
        return print_ranking_json(problem, profile, rows, overlap_pays, reason);
    }
    println!("{header}");
    let best = ranked.first().map(|(name, r)| format!("GEMMs of {name}: {}", engines_line(r)));
    print_ranked(ranked.into_iter());
    if let Some(line) = best {
        println!("{line}");
    }
    println!("verdict: {}: {reason}", if overlap_pays { "overlap pays" } else { "no overlap" });
    Ok(())
}

/// The table of ranked candidates: simulated time, floors and exposed communication.
fn print_ranked<'r>(rows: impl Iterator<Item = (String, &'r SimReport)>) {
    println!(
        "{:<18} {:>12} {:>14} {:>12} {:>13}",
        "algorithm", "simulated", "compute floor", "comm floor", "exposed comm"
    );
    for (name, r) in rows {
        println!(
            "{:<18} {:>12} {:>14} {:>12} {:>13}",
            name,
            us(r.makespan_s),
            us(r.compute_floor_s),
            us(r.comm_floor_s),
            us(r.max_exposed_comm_s())
        );
    }
}

/// One simulated attention plan, for `--json`.
#[derive(Serialize)]
struct AttentionRow {
    layout: String,
    algorithm: String,
    #[serde(flatten)]
    timing: Timing,
    compute_per_device_us: Vec<f64>,
}

/// `--attention`: every attention algorithm simulated, and the verdicts.
fn attention(args: &Args) -> Result<()> {
    let pa = &args.problem;
    let (Some(d), Some(s), Some(h), Some(dh)) = (pa.devices, pa.m, pa.n, pa.k) else {
        anyhow::bail!(
            "attention needs -d, -m (S), -n (query heads) and -k (head dimension), e.g. --attention --causal -d 8 -m 131072 -n 32 --kv-heads 8 -k 128 --input bf16"
        );
    };
    if pa.output.is_some_and(|o| o != pa.input) {
        anyhow::bail!("attention keeps the input dtype for its output (the log-sum-exp is f32); drop --output");
    }
    let problem = AttentionProblem::new(
        d,
        s,
        h,
        args.kv_heads.unwrap_or(h),
        dh,
        args.causal,
        Layout::Contiguous,
        args.queries,
        pa.input,
    )?;
    let profile = pa.profile()?;
    let ranking = tune_attention(&problem, &profile, pricing(args))?;
    if args.json {
        let rows: Vec<AttentionRow> = ranking
            .ranked
            .iter()
            .map(|c| AttentionRow {
                layout: c.layout.to_string(),
                algorithm: c.algorithm.to_string(),
                timing: Timing::of(&c.report),
                compute_per_device_us: c.compute_s.iter().map(|s| s * 1e6).collect(),
            })
            .collect();
        return print_ranking_json(problem.describe(), &profile, rows, ranking.overlap_pays, &ranking.reason);
    }
    println!("attention {} on {} ({:.1} TFLOP)", problem.describe(), profile.name, problem.flops() / 1e12);
    println!(
        "{:<11} {:<11} {:>13} {:>14} {:>12} {:>13} {:>21}",
        "layout", "algorithm", "simulated", "compute floor", "comm floor", "exposed comm", "compute max/min dev"
    );
    for c in &ranking.ranked {
        let r = &c.report;
        println!(
            "{:<11} {:<11} {:>13} {:>14} {:>12} {:>13} {:>21}",
            c.layout.to_string(),
            c.algorithm.to_string(),
            us(r.makespan_s),
            us(r.compute_floor_s),
            us(r.comm_floor_s),
            us(r.max_exposed_comm_s()),
            format!("{:.2}", c.imbalance())
        );
    }
    println!(
        "attention blocks priced {}",
        if args.potential {
            "at cuBLAS's GEMM rate: a potential, not what cmm runs"
        } else {
            "on cmm's attention kernel (one thread per row and head), as cmm runs them"
        }
    );
    println!("verdict: {}", ranking.reason);
    Ok(())
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn print_report(plan: &Plan, profile: &Profile, r: &SimReport, analytic: Option<(f64, &str)>) {
    println!("plan:          {}", plan.name);
    println!("profile:       {} ({})", profile.name, profile.description);
    println!("makespan:      {}", us(r.makespan_s));
    println!("GEMMs on:      {}", engines_line(r));
    println!("queues:        {}", queues_line(plan, r));
    let one_gpu = profile.interconnect.topology == TopologyKind::OneGpu;
    if one_gpu {
        println!("copies:        {}", copies_line(profile, r));
    }
    let over = if one_gpu { "sum over the GPU's devices" } else { "max over devices" };
    println!("compute floor: {} ({over} of GEMM/reduce work)", us(r.compute_floor_s));
    println!(
        "comm floor:    {} (max over directed links of bytes/bandwidth{})",
        us(r.comm_floor_s),
        r.busiest_link.as_ref().map(|l| format!("; busiest: {l}")).unwrap_or_default()
    );
    let busy = if one_gpu { "the GPU's compute busy" } else { "compute busy" };
    println!("exposed comm:  {} (max over devices of makespan − {busy})", us(r.max_exposed_comm_s()));
    if let Some((analytic_s, formula)) = analytic {
        println!("analytic:      {} ({formula})", us(analytic_s));
    }
    println!("lane busy, device 0:");
    for (lane, busy) in r.lanes.iter().zip(&r.lane_busy_s[0]) {
        println!("  {lane:<12} {:>12} ({:.0} %)", us(*busy), 100.0 * busy / r.makespan_s.max(1e-30));
    }
    println!("critical path ({} ops):", r.critical_path.len());
    const SHOWN: usize = 24;
    let path = &r.critical_path;
    for (i, site) in path.iter().enumerate() {
        if path.len() > SHOWN && i == SHOWN / 2 {
            println!("  … {} ops …", path.len() - SHOWN);
        }
        if path.len() > SHOWN && i >= SHOWN / 2 && i < path.len() - SHOWN / 2 {
            continue;
        }
        let rec = r.record(*site);
        let op = &plan.programs[site.device].lanes[site.lane][site.index];
        let blocked = if rec.class == OpClass::Wait && rec.start_s > rec.reached_s {
            format!(" (blocked {})", us(rec.start_s - rec.reached_s))
        } else {
            String::new()
        };
        println!(
            "  {:>9.1} – {:>9.1} µs  dev{} {:<10} {}{blocked}",
            rec.reached_s * 1e6,
            rec.end_s * 1e6,
            site.device,
            plan.lanes[site.lane],
            plan.op_text(op)
        );
    }
}

/// What priced the GEMMs of a simulation, in words: the engines cmm runs them on, or
/// cuBLAS's rate as a potential.
pub fn engines_line(r: &SimReport) -> String {
    match r.pricing {
        Engines::CublasSpeed => {
            format!("{} GEMM(s) at cuBLAS's rate: a potential, not what cmm runs", r.gemm_count())
        }
        Engines::AsBuilt if r.one_rate => format!("{} (it gives no rates of cmm's own kernels)", r.gemm_engines()),
        Engines::AsBuilt => format!("{} (as cmm runs them)", r.gemm_engines()),
    }
}

fn json(plan: &Plan, r: &SimReport, analytic_s: Option<f64>) -> serde_json::Value {
    let path: Vec<serde_json::Value> = r
        .critical_path
        .iter()
        .map(|s| {
            let rec = r.record(*s);
            serde_json::json!({
                "device": s.device,
                "lane": plan.lanes[s.lane],
                "index": s.index,
                "start_us": rec.start_s * 1e6,
                "end_us": rec.end_s * 1e6,
            })
        })
        .collect();
    let busy: Vec<Vec<f64>> = r.lane_busy_s.iter().map(|lanes| lanes.iter().map(|b| b * 1e6).collect()).collect();
    serde_json::json!({
        "plan": plan.name,
        "profile": r.profile,
        "devices": r.devices,
        "lanes": r.lanes,
        "makespan_us": r.makespan_s * 1e6,
        "compute_floor_us": r.compute_floor_s * 1e6,
        "comm_floor_us": r.comm_floor_s * 1e6,
        "exposed_comm_us": r.max_exposed_comm_s() * 1e6,
        "analytic_us": analytic_s.map(|s| s * 1e6),
        "gemm_engines": r.engines.0.iter().map(|(e, n)| serde_json::json!({"engine": e.name(), "gemms": n})).collect::<Vec<_>>(),
        "gemm_pricing": match r.pricing { Engines::AsBuilt => "as built", Engines::CublasSpeed => "cuBLAS speed (potential)" },
        "hardware_queues": r.hardware_queues.map(|hw| serde_json::json!({"queues": hw.queues, "offset": hw.offset})),
        "copies": r.copies.key(),
        "driver_copies": r.driver_copies,
        "lane_busy_us": busy,
        "critical_path": path,
    })
}

fn compare(problem: &cmm_core::Problem, profile: &Profile, potential: bool, json: bool) -> Result<()> {
    let mut rows = Vec::new();
    for alg in candidates_1d(problem.op, problem.devices, profile) {
        let Ok(plan) = build_plan(problem, alg) else { continue };
        let r = simulate(&plan, profile, &SimOptions::default())?;
        let at_cublas_s = if potential {
            let options = SimOptions { engines: Engines::CublasSpeed, ..SimOptions::default() };
            Some(simulate(&plan, profile, &options)?.makespan_s)
        } else {
            None
        };
        rows.push((alg, r, at_cublas_s, ring_1d(problem, alg, profile)));
    }
    if json {
        let candidates: Vec<_> = rows
            .iter()
            .map(|(alg, r, at_cublas_s, a)| {
                serde_json::json!({
                    "algorithm": alg.to_string(),
                    "simulated_us": r.makespan_s * 1e6,
                    "at_cublas_us": at_cublas_s.map(|s| s * 1e6),
                    "analytic_us": a.total_s * 1e6,
                    "gemm_engines": r.gemm_engines(),
                    "formula": a.formula,
                })
            })
            .collect();
        let out = serde_json::json!({
            "mode": "compare",
            "problem": problem.describe(),
            "profile": profile.name,
            "candidates": candidates,
            "at_cublas_note": potential.then_some("every GEMM at cuBLAS's rate, fused ones included: a potential, not what cmm runs"),
        });
        crate::output::emit_json(out)?;
        return Ok(());
    }
    println!("{} on {}", problem.describe(), profile.name);
    let extra = if potential { format!(" {:>12}", "at cuBLAS") } else { String::new() };
    println!("{:<20} {:>12}{extra} {:>12} {:>8}  GEMMs on; formula", "algorithm", "simulated", "analytic", "diff");
    for (alg, r, at_cublas_s, a) in &rows {
        let at_cublas = at_cublas_s.map_or(String::new(), |s| format!(" {:>12}", us(s)));
        println!(
            "{:<20} {:>12}{at_cublas} {:>12} {:>+7.1}%  {}; {}",
            alg.to_string(),
            us(r.makespan_s),
            us(a.total_s),
            100.0 * (a.total_s - r.makespan_s) / r.makespan_s,
            r.gemm_engines(),
            a.formula
        );
    }
    if potential {
        println!("`at cuBLAS`: every GEMM at cuBLAS's rate, fused ones included — a potential, not what cmm runs");
    }
    Ok(())
}

/// The benches the validation reads (committed with their runs' summaries): the H200's and
/// the H100's of 2026-11-26, and the H200's of 2026-11-27 (stopped before its gemm_rs rows
/// at D = 4 and 8; the first with the copy engines' column) with its rerun on CUDA's default
/// 8 hardware queues (the ring plans and all six fused ones, and a calibration), each beside
/// the one-GPU profile of its GPU.
pub(crate) const BENCHES: [(&str, &str, &str); 4] = [
    (
        "one H200, 2026-11-26 at 501302d",
        "docs/gpu-runs/2026-11-26-h200/3-501302d-bench-kernels.json",
        include_str!("../../docs/gpu-runs/2026-11-26-h200/3-501302d-bench-kernels.json"),
    ),
    (
        "one H100, 2026-11-26 at 6581ea8",
        "docs/gpu-runs/2026-11-26-h100/1-6581ea8-bench-kernels.json",
        include_str!("../../docs/gpu-runs/2026-11-26-h100/1-6581ea8-bench-kernels.json"),
    ),
    (
        "one H200, 2026-11-27 at e806307",
        "docs/gpu-runs/2026-11-27-h200/1-e806307-bench-kernels.json",
        include_str!("../../docs/gpu-runs/2026-11-27-h200/1-e806307-bench-kernels.json"),
    ),
    (
        "one H200, 2026-11-27 at e806307, on 8 hardware queues",
        "docs/gpu-runs/2026-11-27-h200/1-e806307-bench-kernels-8-queues.json",
        include_str!("../../docs/gpu-runs/2026-11-27-h200/1-e806307-bench-kernels-8-queues.json"),
    ),
];

fn validate() -> Result<()> {
    let h100 = Profile::load("h100-nvlink")?;
    println!("validation — the profiles are never fitted to these numbers; docs/simulator.md explains each gap");
    println!();
    println!(
        "seed 000: ring AG+GEMM, {} f16, per-shard M=1024, K=N=4096 (ag_gemm M=D·1024, N=D·4096, K=4096)",
        h100.name
    );
    println!("{:<44} {:>11} {:>11} {:>11} {:>8}", "case", "simulated", "analytic", "published", "error");
    for row in seed000(&h100)? {
        println!(
            "{:<44} {:>8.1} µs {:>8.1} µs {:>8.0} µs {:>+7.1}%",
            row.case.trim_start_matches("seed 000 "),
            row.simulated_us,
            row.analytic_us,
            row.published_us,
            100.0 * row.relative_error()
        );
    }
    let h800 = Profile::load("h800-nvlink")?;
    println!();
    println!("Flux's performance report: 8 GPUs, {} bf16 (its numbers measured on 8×H800)", h800.name);
    println!(
        "{:<70} {:<36} {:>11} {:>11} {:>8}",
        "case", "our algorithm (GEMMs on)", "simulated", "published", "error"
    );
    for (algorithm, row) in flux(&h800)? {
        println!(
            "{:<70} {:<36} {:>8.1} µs {:>8.0} µs {:>+7.1}%",
            row.case,
            algorithm,
            row.simulated_us,
            row.published_us,
            100.0 * row.relative_error()
        );
    }
    let one = Profile::load("h100-one-gpu")?;
    println!();
    println!(
        "the CUDA bench on one H100 ({}: D virtual devices share one GPU; f16, per-shard M=1024, K=N=4096), \
         measured at 30786c1 with every device at one priority and starting together; \
         staggered and offsets = predictions, not measured yet",
        one.name
    );
    println!(
        "{:<34} {:>11} {:>11} {:>11} {:>8} {:>11} {:>11} {:>11}",
        "case", "simulated", "analytic", "measured", "error", "Σ compute", "staggered", "offsets"
    );
    for row in one_gpu_bench(&one)? {
        let t = &row.time;
        println!(
            "{:<34} {:>8.1} µs {:>8.1} µs {:>8.1} µs {:>+7.1}% {:>8.1} µs {:>8.1} µs {:>8.1} µs",
            t.case,
            t.simulated_us,
            t.analytic_us,
            t.published_us,
            100.0 * t.relative_error(),
            row.compute_floor_us,
            row.staggered_us,
            row.offset_us
        );
    }
    for (machine, file, text) in BENCHES {
        println!();
        println!(
            "the CUDA bench on {machine} (every plan beside its compute-only twin, the fused ones on the \
             Hopper engine), as --validate-bench reads it:"
        );
        crate::bench_file::validate_bench_text(text, file)?;
    }
    let tpu = Profile::load("tpuv4-torus")?;
    println!();
    println!(
        "seed 002: 256 chips, {} bf16, GPT-3 175B FC layers (hidden 12288, MLP 4x, seq 2048, batch 128), fwd + bwd, analytic model",
        tpu.name
    );
    print_seed002(seed002(&tpu)?);
    println!();
    println!(
        "seed 002 as cmm builds the plans: each algorithm's best configuration above, its mesh kept, replayed on the {} \
         torus, each layer at its best S in {:?}",
        tpu.name, REPLAY_SLICES
    );
    print_seed002(seed002_as_built(&tpu, &REPLAY_SLICES)?);

    // The tuner's pick against the simulator's best, over real MeshSlice plans.
    println!();
    println!(
        "seed 002 cross-check: MeshSlice plans from the mesh module simulated on the {} torus, \
         the analytic tuner's 3 best meshes, S in {:?}",
        tpu.name, REPLAY_SLICES
    );
    let (tuner, simulated) = seed002_simulated(&tpu, 3, &REPLAY_SLICES)?;
    let tuner_s: Vec<String> = tuner.layers.iter().map(|l| format!("{}:S={}", l.layer, l.slices)).collect();
    println!("tuner (analytic): {} {} -> {:.2} ms", tuner.shape, tuner_s.join(" "), tuner.total_s * 1e3);
    for c in &simulated {
        let s: Vec<String> = c.layers.iter().map(|l| format!("{}:S={}", l.layer, l.slices)).collect();
        println!("simulated:        {} {} -> {:.2} ms", c.shape, s.join(" "), c.total_s * 1e3);
    }
    if let Some(best) = simulated.first() {
        let same_mesh = best.shape == tuner.shape;
        let same_s = best.layers.iter().zip(&tuner.layers).all(|(s, t)| s.slices == t.slices);
        println!(
            "[{}] the tuner's mesh matches the simulator's best ({} vs {})",
            if same_mesh { "holds" } else { "FAILS" },
            tuner.shape,
            best.shape
        );
        println!(
            "[{}] the tuner's S per layer matches the simulator's best on that mesh",
            if same_s { "holds" } else { "FAILS" }
        );
    }
    Ok(())
}

/// Seed 002's per-algorithm table and its claims.
fn print_seed002((claims, per_algorithm): cmm_sim::validate::Seed002) {
    println!("{:<12} {:>10} {:>18}", "algorithm", "best mesh", "ms per block");
    for (name, mesh, ms) in &per_algorithm {
        println!("{name:<12} {mesh:>10} {ms:>18.2}");
    }
    for c in claims {
        println!("[{}] {}", if c.holds { "holds" } else { "FAILS" }, c.claim);
        println!("        predicted: {}", c.predicted);
        println!("        published: {}", c.published);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cmm_core::{OpKind, Problem};

    #[test]
    fn the_json_report_parses_whatever_the_profile_and_plan_are_called() {
        let text = include_str!("../../sim/profiles/h100-nvlink.toml")
            .replace("name = \"h100-nvlink\"", "name = \"my \\\"big\\\" \\\\ cluster\"");
        let profile = Profile::parse(&text, "my.toml").unwrap();
        assert_eq!(profile.name, "my \"big\" \\ cluster");
        let p = Problem::new(OpKind::AgGemm, 2, 64, 32, 16, cmm_core::DType::F16, cmm_core::DType::F16).unwrap();
        let mut plan = build_plan(&p, cmm_core::Algorithm::Ring).unwrap();
        plan.name = "plan \"with\" quotes\\".into();
        let report = simulate(&plan, &profile, &SimOptions::default()).unwrap();
        let v: serde_json::Value = serde_json::from_str(&json(&plan, &report, Some(1e-6)).to_string()).unwrap();
        assert_eq!(v["profile"], "my \"big\" \\ cluster");
        assert_eq!(v["plan"], "plan \"with\" quotes\\");
        assert!(v["makespan_us"].as_f64().unwrap() > 0.0);
    }

    #[test]
    fn a_problem_past_the_generators_range_is_simulated() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        // C is 131072 × 65536 = 2^33 elements: no executor could generate it.
        let line = "x --op ag_gemm -d 8 -m 131072 -n 65536 -k 8192 --input bf16 --json";
        run(&Cli::try_parse_from(line.split_whitespace()).unwrap().args).unwrap();
        // Other errors are still reported as themselves.
        let line = "x --op ag_gemm -d 3 -m 131072 -n 65536 -k 8192";
        let e = run(&Cli::try_parse_from(line.split_whitespace()).unwrap().args).unwrap_err();
        assert!(e.to_string().contains("not divisible by D=3"), "{e}");
    }

    #[test]
    fn the_mesh_mode_simulates_the_mesh_plan_and_refuses_bad_shapes() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let parse = |line: &str| Cli::try_parse_from(line.split_whitespace()).map(|c| c.args);
        let ok = parse("x --mesh 2x2 --dataflow os --algorithm meshslice --slices 2 -m 64 -n 64 -k 64 --json").unwrap();
        run(&ok).unwrap();
        let bad = parse("x --mesh 2x2x2 --algorithm summa -m 64 -n 64 -k 64").unwrap();
        assert!(run(&bad).unwrap_err().to_string().contains("expected NRxNC"));
        let slices = parse("x --mesh 2x2 --algorithm meshslice --slices 3 -m 64 -n 64 -k 64").unwrap();
        assert!(run(&slices).is_err(), "3 slices do not divide K/Nr = 32");
        assert!(parse("x --mesh 2x2 --op ag_gemm -m 64 -n 64 -k 64").is_err(), "--op and --mesh conflict");
    }

    #[test]
    fn flags_a_mode_would_ignore_are_refused() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let parse = |line: &str| Cli::try_parse_from(line.split_whitespace()).map(|c| c.args);
        for line in [
            "x --validate --op ag_gemm",
            "x --validate -m 64",
            "x --compare --executor reference",
            "x --mesh 2x2 --executor reference -m 64 -n 64 -k 64",
            "x --moe ag_moe --executor reference",
            "x --layer mlp --validate",
            "x plan.json --op ag_gemm",
            "x --layer mlp --hardware-queues 8",
            "x --compare --hardware-queues 8",
            "x --op ag_gemm --queue-offset 1",
        ] {
            assert!(parse(line).is_err(), "`{line}` should be refused");
        }
        assert!(parse("x --mesh 2x2 --algorithm summa -m 64 -n 64 -k 64").is_ok());
        assert!(parse("x --op gemm_rs --hardware-queues 8 --queue-offset 3").is_ok());
    }
}
