//! `cmm tune` (also `cargo xtask tune`): rank the candidate plans of a 1D problem by simulated time, or the
//! 2D configurations (algorithm, dataflow, mesh shape, S) of a GEMM or an LLM's FC layers:
//! seed 002's closed form over them all, then cmm's own plans for its leaders simulated.

use anyhow::{bail, Result};
use cmm_core::DType;
use cmm_sim::analytic::{Dataflow, MeshGemm};
use cmm_sim::tune::{
    best_per_algorithm, choose_dataflows, replay_llm, tune_1d, tune_llm, tune_mesh_gemm, LlmConfig, MeshCandidate,
    MeshConfig, REPLAY_SLICES,
};
use serde_json::json;

use crate::problem_args::{us, ProblemArgs};

/// Arguments of `cargo xtask tune`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub problem: ProblemArgs,
    /// 2D mode: the chip count P of the mesh (every Nr x Nc with Nr·Nc = P is tried).
    #[arg(long)]
    pub chips: Option<usize>,
    /// 2D mode: the dataflow of the single GEMM given by -m -n -k (os, ls, rs).
    #[arg(long, default_value = "os")]
    pub dataflow: String,
    /// 2D mode: tune every FC layer of a model instead of one GEMM (gpt3-175b).
    #[arg(long)]
    pub llm: Option<String>,
    /// Batch size of the model (sequences of 2048 tokens).
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// Rows of the 2D ranking to print.
    #[arg(long, default_value_t = 12)]
    pub top: usize,
    /// 2D mode: how many of the candidates seed 002's closed form ranks highest (with --llm:
    /// of the algorithms' best configurations) are replayed as cmm builds them, simulated,
    /// and ranked by that; 0: the closed form alone.
    #[arg(long, default_value_t = 5)]
    pub replay: usize,
    /// 1D mode: also rank each plan as if its GEMMs ran at cuBLAS's rate, fused ones
    /// included (a potential column, clearly labelled: not what cmm runs).
    #[arg(long)]
    pub potential: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The plan of `algorithm` simulated with every GEMM at cuBLAS's rate, µs.
fn potential_us(
    problem: &cmm_core::Problem,
    profile: &cmm_sim::Profile,
    algorithm: cmm_core::Algorithm,
) -> Option<f64> {
    let plan = cmm_core::build_plan(problem, algorithm).ok()?;
    let options = cmm_sim::SimOptions { engines: cmm_sim::Engines::CublasSpeed, ..Default::default() };
    cmm_sim::simulate(&plan, profile, &options).ok().map(|r| r.makespan_s * 1e6)
}

fn print_json(value: serde_json::Value) -> Result<()> {
    crate::output::emit_json(value)
}

/// A one-GPU profile's winner that leads by less than this is within what the model got
/// wrong against the recorded benches (`cmm simulate --validate`: the fastest plan of an
/// op and D named in 12 of 16, the misses between plans 0.2 to 1.8 % apart on the GPU,
/// and the copies beside GEMMs priced cheap).
const ONE_GPU_TIE: f64 = 0.05;

/// What a winning plan's prediction assumes that no measurement has shown: the fused
/// plans' waits inside their persistent kernels cost nothing beyond the data's arrival;
/// the hierarchical plans' NICs run at the profile's rate, where cmm has never run;
/// on one GPU, a lead smaller than the model's misses there (`lead`: the runner-up's time
/// over the winner's, less 1).
fn caveat(winner: cmm_core::Algorithm, profile: &cmm_sim::Profile, lead: Option<f64>) -> Option<String> {
    let mut caveats = Vec::new();
    if matches!(winner, cmm_core::Algorithm::Fused { .. }) {
        caveats.push(
            "the fused plans have run only as virtual devices sharing one GPU (an H100 and two H200s, 2026-11-26 \
             and 27, docs/perf.md): with the driver's copies they took 1.14 to 2.53 times their compute-only twins; \
             with their copies asked of the copy engines, as cmm asks them by default since, 1.00 to 1.08 times \
             (gemm_rs at D = 4 and 8 not measured so), and they still lost to the ring plans; this prediction \
             assumes their waits cost nothing beyond the data's arrival, which no run across GPUs has shown"
                .to_string(),
        );
    }
    if matches!(winner, cmm_core::Algorithm::FusedPush { .. }) {
        caveats.push(
            "fused_push has not run on any GPU yet: its persistent kernels' waits and their epilogues adding into the peers' \
             sums are priced by the model alone"
                .to_string(),
        );
    }
    if matches!(winner, cmm_core::Algorithm::Hierarchical { .. }) {
        caveats.push(
            "the hierarchical plans have not run across nodes: cmm has no transport between nodes (docs/multinode.md); \
             they pass the corpus on the reference and the CUDA host twin, and this prediction prices each NIC at the \
             profile's rate from published figures, not from a run"
                .to_string(),
        );
    }
    let one_gpu = profile.interconnect.topology == cmm_sim::TopologyKind::OneGpu;
    if let Some(lead) = lead.filter(|&l| one_gpu && l < ONE_GPU_TIE) {
        caveats.push(format!(
            "it leads by {:.1} %: on one GPU the model prices a copy beside GEMMs cheap (the calibration's copy \
             beside two GEMMs took 5 to 9 times its price asked of the copy engines, two runs, and up to 2.2 times \
             left to the driver, ten runs), and against the recorded benches it named another \
             plan than the fastest where plans came within 2 % of each other (`cmm simulate --validate`); read \
             this as a tie",
            100.0 * lead
        ));
    }
    (!caveats.is_empty()).then(|| caveats.join("; "))
}

/// The runner-up's time over the winner's, less 1 (`None` with one candidate).
fn lead(ranking: &cmm_sim::tune::Ranking1d) -> Option<f64> {
    let [first, second, ..] = &ranking.ranked[..] else { return None };
    Some(second.report.makespan_s / first.report.makespan_s - 1.0)
}

/// Runs the command.
pub fn run(args: &Args) -> Result<()> {
    let profile = args.problem.profile()?;
    let Some(chips) = args.chips else {
        let problem = args.problem.problem()?;
        let ranking = tune_1d(&problem, &profile)?;
        if args.json {
            let base = ranking.baseline();
            let rows: Vec<_> = ranking
                .ranked
                .iter()
                .map(|c| {
                    json!({
                        "algorithm": c.algorithm.to_string(),
                        "makespan_us": c.report.makespan_s * 1e6,
                        "exposed_comm_us": c.report.max_exposed_comm_s() * 1e6,
                        "speedup_vs_baseline": base.map(|b| b.report.makespan_s / c.report.makespan_s),
                        "gemm_engines": c.report.gemm_engines(),
                        "potential_at_cublas_us": args.potential.then(|| potential_us(&problem, &profile, c.algorithm)).flatten(),
                    })
                })
                .collect();
            let skipped: Vec<_> =
                ranking.skipped.iter().map(|(a, why)| json!({ "algorithm": a.to_string(), "why": why })).collect();
            return print_json(json!({
                "mode": "1d",
                "op": problem.op.to_string(),
                "devices": problem.devices,
                "shape": problem.shape_string(),
                "input": problem.input.to_string(),
                "output": problem.output.to_string(),
                "profile": profile.name,
                "ranked": rows,
                "skipped": skipped,
                "baseline": base.map(|b| b.algorithm.to_string()),
                "winner": ranking.winner().algorithm.to_string(),
                "reason": ranking.reason,
                "caveat": caveat(ranking.winner().algorithm, &profile, lead(&ranking)),
            }));
        }
        let pricing = if profile.engines.is_none() {
            "every GEMM at the profile's one rate"
        } else {
            "each GEMM on the engine cmm runs it on"
        };
        println!("{} on {} (simulated, {pricing})", problem.describe(), profile.name);
        let extra = if args.potential { format!(" {:>16}", "at cuBLAS rate") } else { String::new() };
        println!(
            "{:<4} {:<20} {:>12} {:>14} {:>14}{extra}  GEMMs on",
            "rank", "algorithm", "simulated", "exposed comm", "vs baseline"
        );
        // Speeds are against the faster of the two baselines.
        let base = ranking.baseline().map(|c| c.report.makespan_s);
        for (i, c) in ranking.ranked.iter().enumerate() {
            let speed = base.map(|b| format!("{:.2}x", b / c.report.makespan_s)).unwrap_or_default();
            let potential = if args.potential {
                let at = potential_us(&problem, &profile, c.algorithm);
                format!(" {:>16}", at.map_or("-".into(), |u| format!("{u:.1} µs")))
            } else {
                String::new()
            };
            println!(
                "{:<4} {:<20} {:>12} {:>14} {:>14}{potential}  {}",
                i + 1,
                c.algorithm.to_string(),
                us(c.report.makespan_s),
                us(c.report.max_exposed_comm_s()),
                speed,
                c.report.gemm_engines()
            );
        }
        for (alg, why) in &ranking.skipped {
            println!("     {alg}: skipped ({why})");
        }
        if let Some(base) = ranking.baseline().filter(|c| c.algorithm != cmm_core::Algorithm::Baseline) {
            println!("`vs baseline`: against {}, the faster of the two baselines", base.algorithm);
        }
        if args.potential {
            println!(
                "`at cuBLAS rate`: the same plan with every GEMM, fused ones included, at cuBLAS's rate — a potential \
                 (the Hopper engine's target), not what cmm runs"
            );
        }
        let winner = ranking.winner();
        println!("winner: {} on {} — {}", winner.algorithm, winner.report.gemm_engines(), ranking.reason);
        if let Some(caveat) = caveat(winner.algorithm, &profile, lead(&ranking)) {
            println!("caveat: {caveat}");
        }
        return Ok(());
    };
    // 2D mode tries every Nr x Nc mesh of P chips: a 1D op or device count has no place.
    if args.problem.op.is_some() || args.problem.devices.is_some() {
        bail!("--chips selects 2D mode, which tries every Nr x Nc = {chips} mesh: drop --op and -d (or drop --chips to rank 1D plans)");
    }
    // The dtype cmm's LS/RS plans send partial sums in.
    let wire = args.problem.wire.unwrap_or(DType::F32);
    if let Some(name) = &args.llm {
        if name != "gpt3-175b" {
            bail!("unknown model `{name}` (known: gpt3-175b)");
        }
        if args.batch == 0 {
            bail!("--batch 0: a step needs at least one sequence of 2048 tokens");
        }
        if args.batch.checked_mul(2048).is_none() {
            bail!("--batch {}: its sequences of 2048 tokens overflow a count of tokens", args.batch);
        }
        let llm = LlmConfig { wire, ..LlmConfig::gpt3_175b(args.batch) };
        let configs = tune_llm(&llm, chips, &profile)?;
        let best = best_per_algorithm(&configs);
        let mut replayed = Vec::new();
        for c in best.iter().take(args.replay) {
            replayed.extend(replay_llm(&llm, c.algorithm, c.shape, &profile, &REPLAY_SLICES)?);
        }
        replayed.sort_by(|a, b| a.total_s.total_cmp(&b.total_s));
        let config_json = |c: &MeshConfig| {
            json!({
                "algorithm": cli_name(c.algorithm),
                "mesh": c.shape.to_string(),
                "time_ms": c.total_s * 1e3,
                "gemm_share": c.compute_s / c.total_s,
                "slices": c.layers.iter().map(|l| json!({ "layer": l.layer, "slices": l.slices })).collect::<Vec<_>>(),
            })
        };
        let winner = replayed.first().unwrap_or(&configs[0]);
        if args.json {
            return print_json(json!({
                "mode": "llm",
                "model": llm.name,
                "chips": chips,
                "profile": profile.name,
                "best_per_algorithm": best.iter().map(|c| config_json(c)).collect::<Vec<_>>(),
                "replayed": replayed.iter().map(config_json).collect::<Vec<_>>(),
                "winner": {
                    "algorithm": cli_name(winner.algorithm),
                    "mesh": winner.shape.to_string(),
                    "by": if replayed.is_empty() { "closed form" } else { "simulated" },
                },
            }));
        }
        println!(
            "{} on {chips} chips of {}: {} tokens per step, {}, partial sums in {wire}",
            llm.name, profile.name, llm.tokens, llm.dtype
        );
        println!();
        println!("phase 1: dataflows (the largest matrix stays stationary in all three passes)");
        for lf in choose_dataflows(&llm) {
            println!(
                "  {:<9} {:<10} {}{}; stored transposed: {}",
                lf.layer.name,
                lf.stationary.to_string(),
                lf.passes.iter().map(|p| format!("{}: {}", p.pass, p.formula)).collect::<Vec<_>>().join(", "),
                if lf.transposed { " (transposed dataflow)" } else { "" },
                lf.stored_transposed
            );
        }
        let table = |title: &str, rows: &[&MeshConfig]| {
            println!();
            println!("{title}");
            println!("{:<12} {:>8} {:>12} {:>10}  slices per layer", "algorithm", "mesh", "time", "GEMM share");
            for c in rows {
                println!(
                    "{:<12} {:>8} {:>9.2} ms {:>9.0}%  {}",
                    c.algorithm.name(),
                    c.shape.to_string(),
                    c.total_s * 1e3,
                    100.0 * c.compute_s / c.total_s,
                    if c.algorithm == cmm_sim::analytic::MeshFamily::MeshSlice {
                        c.layers.iter().map(|l| format!("{}={}", l.layer, l.slices)).collect::<Vec<_>>().join(" ")
                    } else {
                        "-".to_string()
                    }
                );
            }
        };
        table(
            "phase 2: mesh shape and slices by seed 002's closed form — best configuration of each algorithm (one block, fwd + bwd)",
            &best,
        );
        if !replayed.is_empty() {
            table(
                &format!(
                    "phase 3: cmm's own plans for the first {} of those, simulated (each layer at its best S of {:?}; GEMM share: the plans' compute floors)",
                    replayed.len(),
                    REPLAY_SLICES
                ),
                &replayed.iter().collect::<Vec<_>>(),
            );
        }
        let w = &configs[0];
        println!(
            "by seed 002's closed form: {} on a {} mesh ({:.2} ms per block)",
            w.algorithm,
            w.shape,
            w.total_s * 1e3
        );
        if let Some(r) = replayed.first() {
            println!(
                "winner as cmm builds it: {} on a {} mesh ({:.2} ms per block, simulated)",
                r.algorithm,
                r.shape,
                r.total_s * 1e3
            );
        }
        let pairs: Vec<(f64, f64)> = replayed
            .iter()
            .filter_map(|r| best.iter().find(|c| c.algorithm == r.algorithm).map(|c| (r.total_s, c.total_s)))
            .collect();
        print_form_note(&pairs, Some(wire));
        return Ok(());
    }
    let (Some(m), Some(n), Some(k)) = (args.problem.m, args.problem.n, args.problem.k) else {
        bail!("2D mode needs -m -n -k (one GEMM) or --llm gpt3-175b");
    };
    let dataflow = match args.dataflow.as_str() {
        "os" => Dataflow::Os,
        "ls" => Dataflow::Ls,
        "rs" => Dataflow::Rs,
        other => bail!("unknown dataflow `{other}` (os, ls or rs)"),
    };
    cmm_core::mesh::check_wire(dataflow, wire)?;
    let gemm = MeshGemm { m, n, k, dataflow, dtype: args.problem.input, wire };
    let ranked = tune_mesh_gemm(&gemm, chips, &profile, args.replay)?;
    if args.json {
        let rows: Vec<_> = ranked
            .iter()
            .take(args.top)
            .map(|c| {
                json!({
                    "algorithm": c.replayed.as_ref().map_or(cli_name(c.algorithm), |r| r.algorithm.name().to_string()),
                    "family": cli_name(c.algorithm),
                    "mesh": c.shape.to_string(),
                    "slices": c.slices(),
                    "time_us": c.time_s() * 1e6,
                    "how": if c.replayed.is_some() { "simulated" } else { "closed form" },
                    "simulated_us": c.replayed.as_ref().map(|r| r.report.makespan_s * 1e6),
                    "closed_form_us": c.analytic.total_s * 1e6,
                    "closed_form_slices": c.analytic_slices,
                })
            })
            .collect();
        return print_json(json!({
            "mode": "mesh_gemm",
            "dataflow": dataflow.to_string(),
            "m": m, "n": n, "k": k,
            "dtype": gemm.dtype.to_string(),
            "wire": wire.to_string(),
            "chips": chips,
            "profile": profile.name,
            "ranked": rows,
        }));
    }
    let sums = (dataflow != Dataflow::Os).then_some(wire);
    let wire_note = sums.map_or(String::new(), |w| format!(", partial sums in {w}"));
    println!("{dataflow} GEMM M={m} N={n} K={k} {}{wire_note} on {chips} chips of {}", gemm.dtype, profile.name);
    match args.replay.min(ranked.len()) {
        0 => println!("ranked by seed 002's closed form alone (--replay 0: no plan simulated)"),
        n => println!(
            "the {n} candidates seed 002's closed form ranks highest, replayed as cmm builds them (simulated at every S \
             that builds) and ranked by that; then the rest by the form"
        ),
    }
    println!(
        "{:<4} {:<18} {:>8} {:>5} {:>12}  {:>12} {:>5}  closed form's terms",
        "rank", "algorithm", "mesh", "S", "simulated", "closed form", "S"
    );
    for (i, c) in ranked.iter().take(args.top).enumerate() {
        if i > 0 && c.replayed.is_none() && ranked[..i].iter().all(|r| r.replayed.is_some()) {
            println!("not replayed, by seed 002's closed form alone:");
        }
        let simulated = c.replayed.as_ref().map_or("-".to_string(), |r| us(r.report.makespan_s));
        println!(
            "{:<4} {:<18} {:>8} {:>5} {:>12}  {:>12} {:>5}  {}",
            i + 1,
            label(c),
            c.shape.to_string(),
            c.replayed.as_ref().map_or("-".to_string(), |r| r.slices.to_string()),
            simulated,
            us(c.analytic.total_s),
            c.analytic_slices,
            c.analytic.detail
        );
    }
    let w = &ranked[0];
    println!(
        "winner: {} on a {} mesh, S = {} ({}, {})",
        label(w),
        w.shape,
        w.slices(),
        us(w.time_s()),
        if w.replayed.is_some() { "cmm's plan simulated" } else { "seed 002's closed form: nothing replayed" }
    );
    let pairs: Vec<(f64, f64)> =
        ranked.iter().filter_map(|c| c.replayed.as_ref().map(|r| (r.report.makespan_s, c.analytic.total_s))).collect();
    print_form_note(&pairs, sums);
    Ok(())
}

/// A candidate's algorithm as the table shows it: a replayed Wang names the variant that
/// simulated fastest (its direction and ways round), as `cmm simulate --mesh` takes it.
fn label(c: &MeshCandidate) -> String {
    match c.replayed.as_ref().map(|r| r.algorithm) {
        Some(wang @ cmm_core::mesh::MeshAlgorithm::Wang { .. }) => wang.name().to_string(),
        _ => c.algorithm.name().to_string(),
    }
}

/// A 2D algorithm as `cmm simulate --mesh --algorithm` spells it, so JSON reads back.
fn cli_name(algorithm: cmm_sim::analytic::MeshFamily) -> String {
    algorithm.name().to_ascii_lowercase()
}

/// Where seed 002's closed form and cmm's mesh plans part, with the spread of the replayed
/// candidates' simulated time over the form's (`pairs`: simulated and closed-form seconds;
/// `sums`: the dtype the plans' partial sums travel in, where there are any).
fn print_form_note(pairs: &[(f64, f64)], sums: Option<DType>) {
    if pairs.is_empty() {
        return;
    }
    let ratios = pairs.iter().map(|(simulated, form)| simulated / form);
    let (low, high) = ratios.fold((f64::INFINITY, 0.0_f64), |(l, h), r| (l.min(r), h.max(r)));
    let sums = match sums {
        None => String::new(),
        Some(DType::F32) => ", send partial sums as f32 (`--wire bf16` halves them)".to_string(),
        Some(wire) => format!(", send partial sums as {wire}"),
    };
    println!(
        "note: seed 002's closed form streams each collective both ways round a torus and each SUMMA broadcast in \
         packets, and prices partial sums in the input dtype; cmm's mesh plans gather and reduce-scatter both \
         ways round{sums}, and move a whole block or panel a hop (a copy and a signal each, in every slice): here \
         the simulated plans take {low:.2} to {high:.2} times the form's time"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use cmm_core::Algorithm;

    #[test]
    fn a_narrow_lead_on_one_gpu_is_called_a_tie_and_a_fused_winner_keeps_its_caveat() {
        let one = cmm_sim::Profile::load("h100-one-gpu").unwrap();
        let nvlink = cmm_sim::Profile::load("h100-nvlink").unwrap();
        assert!(caveat(Algorithm::Ring, &one, Some(0.03)).unwrap().contains("leads by 3.0 %"));
        assert_eq!(caveat(Algorithm::Ring, &one, Some(ONE_GPU_TIE)), None);
        assert_eq!(caveat(Algorithm::Ring, &one, None), None);
        assert_eq!(caveat(Algorithm::Ring, &nvlink, Some(0.01)), None);
        let fused = caveat(Algorithm::Fused { chunks: 1 }, &nvlink, Some(0.5)).unwrap();
        assert!(fused.starts_with("the fused plans have run only") && !fused.contains("tie"), "{fused}");
        let both = caveat(Algorithm::Fused { chunks: 1 }, &one, Some(0.02)).unwrap();
        assert!(both.contains("fused plans") && both.contains("read this as a tie"), "{both}");
        let ib = cmm_sim::Profile::load("h100-ib").unwrap();
        let nodes = caveat(Algorithm::Hierarchical { node: 8 }, &ib, Some(2.0)).unwrap();
        assert!(nodes.starts_with("the hierarchical plans have not run across nodes"), "{nodes}");
    }
}
