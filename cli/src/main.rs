//! `cmm`: the project's checks applied to your own work (docs/guide.md).
//!
//! - `cmm golden` runs the cases of any case file on the reference (or the CPU twin),
//!   checks them against the f64 oracle, and writes goldens, inputs, outputs and an
//!   `index.json` that says where every output sits and how it is judged.
//! - `cmm check` judges outputs your kernel wrote (`.npy`) by the same rules.
//! - `cmm plan` writes the plan of a case as a plan file; `cmm verify` checks a plan
//!   file for races, deadlocks and semaphore errors.
//! - `cmm simulate` times a plan file or a problem's plans on a hardware profile;
//!   `cmm tune` ranks the candidates.
//!
//! `cargo xtask` is the developers' tool; both call the same library code.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use cmm_conformance::{
    load_corpus, run_corpus, write_report, Backend, CaseRecord, CpuTwin, Options, OutputFiles, Summary,
};
use cmm_core::schedule::{orders, schedule_with};
use cmm_core::verify::{check_cells, verify_in, Cells};
use cmm_core::Plan;
use cmm_reference::Reference;

#[derive(Parser, Debug)]
#[command(
    name = "cmm",
    version,
    about = "Goldens, output checks, plan verification and simulation for collective matmuls"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Who runs the cases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    /// The wgpu reference (a GPU, or the CPU through Mesa's lavapipe).
    Reference,
    /// The CPU twin of the reference: no adapter, the same bits.
    Cpu,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the cases of a case file, check them against the oracle, and write goldens,
    /// inputs, outputs (.npy) and index.json into a directory.
    Golden {
        /// A case file (or a directory of *.toml case files).
        #[arg(long)]
        cases: PathBuf,
        /// Where to write: DIR/golden/<case>.bin, DIR/<case>/d<d>_<buffer>.npy, DIR/index.json.
        #[arg(long)]
        out: PathBuf,
        /// Only cases whose name contains this.
        #[arg(long)]
        filter: Option<String>,
        /// Who runs the cases.
        #[arg(long, value_enum, default_value = "reference")]
        backend: BackendKind,
    },
    /// Judge outputs your kernel wrote (DIR/<case>/d<d>_<buffer>.npy) against the
    /// goldens of `cmm golden` and the f64 oracle; exits 1 if any case fails.
    Check {
        /// The case file the goldens were made from.
        #[arg(long)]
        cases: PathBuf,
        /// The directory `cmm golden --out` wrote.
        #[arg(long)]
        golden: PathBuf,
        /// Your outputs.
        #[arg(long)]
        outputs: PathBuf,
        /// Only cases whose name contains this.
        #[arg(long)]
        filter: Option<String>,
        /// Also write a report: JSON for .json, JUnit XML for .xml.
        #[arg(long)]
        report: Option<PathBuf>,
    },
    /// Write the plan of one case as a plan file (JSON, format cmm-plan version 1).
    Plan {
        /// The case file.
        #[arg(long)]
        cases: PathBuf,
        /// The case's name.
        #[arg(long)]
        case: String,
        /// The plan file to write (default: standard output).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Check a plan file: structure, deadlocks, races, reads of unwritten memory and
    /// semaphore accounting under several interleavings; exits 1 on any finding.
    Verify {
        /// The plan file.
        plan: PathBuf,
        /// Interleavings to replay (the default order first).
        #[arg(long, default_value_t = 4)]
        schedules: usize,
        /// Also write a report, one test case per interleaving: JSON for .json, JUnit XML
        /// for .xml.
        #[arg(long)]
        report: Option<PathBuf>,
    },
    /// Simulate a plan file, or a problem's plan (1D op, mesh GEMM, linear layer,
    /// attention, MoE op), on a hardware profile; --json for one JSON object.
    Simulate(Box<cmm_cli::simulate::Args>),
    /// Rank the candidate plans of a problem by simulated time (or 2D configurations by
    /// seed 002's model) and say why the winner wins.
    Tune(Box<cmm_cli::tune::Args>),
}

fn main() -> ExitCode {
    cmm_cli::end_quietly_on_a_closed_pipe();
    match run(Cli::parse().command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<ExitCode> {
    match command {
        Command::Golden { cases, out, filter, backend } => golden(&cases, &out, filter, backend),
        Command::Check { cases, golden, outputs, filter, report } => {
            check(&cases, &golden, &outputs, filter, report.as_deref())
        }
        Command::Plan { cases, case, out } => plan(&cases, &case, out.as_deref()),
        Command::Verify { plan, schedules, report } => verify_file(&plan, schedules, report.as_deref()),
        Command::Simulate(args) => cmm_cli::simulate::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Tune(args) => cmm_cli::tune::run(&args).map(|()| ExitCode::SUCCESS),
    }
}

fn exit(summary: &Summary) -> ExitCode {
    if summary.failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn golden(cases: &Path, out: &Path, filter: Option<String>, backend: BackendKind) -> Result<ExitCode> {
    let runner: Box<dyn Backend> = match backend {
        BackendKind::Reference => {
            let r = Reference::new()
                .context("cannot start the wgpu reference (`--backend cpu` runs the cases on the CPU twin)")?;
            println!("adapter: {}", r.adapter_summary());
            Box::new(r)
        }
        BackendKind::Cpu => Box::new(CpuTwin),
    };
    let options = Options {
        filter,
        inputs: Vec::new(),
        bless: true,
        export: Some(out.to_path_buf()),
        cases_dir: cases.to_path_buf(),
        golden_dir: out.join("golden"),
        schedules: 1,
        stats: false,
    };
    let summary = run_corpus(runner.as_ref(), &options).context("running the cases")?;
    if summary.failed > 0 {
        eprintln!("{} case(s) failed the oracle check: no golden was written for them", summary.failed);
    }
    Ok(exit(&summary))
}

fn check(
    cases: &Path,
    golden: &Path,
    outputs: &Path,
    filter: Option<String>,
    report: Option<&Path>,
) -> Result<ExitCode> {
    if let Some(path) = report {
        cmm_conformance::check_report_path(path)?;
    }
    let corpus = load_corpus(cases)?;
    let files = OutputFiles::new(outputs, &corpus);
    let options = Options {
        filter,
        inputs: Vec::new(),
        bless: false,
        export: None,
        cases_dir: cases.to_path_buf(),
        golden_dir: golden.join("golden"),
        schedules: 1,
        stats: false,
    };
    if !options.golden_dir.is_dir() {
        bail!("{} is not a directory: pass the directory `cmm golden --out` wrote", options.golden_dir.display());
    }
    let summary = run_corpus(&files, &options).context("checking the outputs")?;
    if let Some(path) = report {
        write_report(path, &summary.backend, &summary.records)?;
        println!("report: {}", path.display());
    }
    Ok(exit(&summary))
}

fn plan(cases: &Path, name: &str, out: Option<&Path>) -> Result<ExitCode> {
    let corpus = load_corpus(cases)?;
    let case =
        corpus.iter().find(|c| c.name == name).with_context(|| format!("no case `{name}` in {}", cases.display()))?;
    let text = case.plan().with_context(|| format!("case `{name}` has no plan"))?.to_file_json();
    match out {
        Some(path) => std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?,
        None => println!("{text}"),
    }
    Ok(ExitCode::SUCCESS)
}

fn read_plan(path: &Path) -> Result<Plan> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Plan::from_file_json(&text).with_context(|| format!("{}", path.display()))
}

fn verify_file(path: &Path, schedules: usize, report: Option<&Path>) -> Result<ExitCode> {
    if let Some(path) = report {
        cmm_conformance::check_report_path(path)?;
    }
    let plan = read_plan(path)?;
    let cells = Cells::of(&plan);
    println!(
        "plan {}: {} devices, {} lanes, {} ops; its {} buffer elements shadowed in {} cells",
        plan.name,
        plan.devices,
        plan.lanes.len(),
        plan.op_count(),
        plan.elements(),
        cells.per_device() * plan.devices as u64
    );
    check_cells(&plan, &cells).with_context(|| format!("{}", path.display()))?;
    let mut findings = 0;
    let mut records = Vec::new();
    for order in orders(schedules.max(1), plan.devices) {
        let found: Vec<String> = match schedule_with(&plan, order) {
            Ok(schedule) => verify_in(&plan, &schedule, &cells)?.iter().map(|f| f.describe(&plan)).collect(),
            Err(deadlock) => vec![deadlock.to_string()],
        };
        for f in &found {
            println!("{order}: {f}");
        }
        if found.is_empty() {
            println!("{order}: no finding");
        }
        findings += found.len();
        records.push(CaseRecord {
            name: format!("{} [{order}]", plan.name),
            op: "verify".into(),
            algorithm: String::new(),
            devices: plan.devices.to_string(),
            shape: String::new(),
            dtype: String::new(),
            family: String::new(),
            passed: found.is_empty(),
            time_ms: None,
            max_error: None,
            reason: found.join("; "),
        });
    }
    if let Some(path) = report {
        write_report(path, "verifier", &records)?;
        println!("report: {}", path.display());
    }
    if findings > 0 {
        println!("{findings} finding(s)");
        return Ok(ExitCode::FAILURE);
    }
    println!("verified under {} interleaving(s): no race, no deadlock, no read of unwritten memory", schedules.max(1));
    for line in queue_advice(&plan)? {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// What a CUDA executor's enqueue order does with the plan on the GPU's FIFO hardware
/// queues (`CUDA_DEVICE_MAX_CONNECTIONS`, docs/cuda.md): the schedule order cannot hang on
/// any number of them; enqueueing each lane whole, device by device, may.
fn queue_advice(plan: &Plan) -> Result<Vec<String>> {
    use cmm_core::verify::queues::{check_enqueue_order, schedule_order, whole_lane_order, EnqueueError};
    use cmm_core::verify::queues::{DEFAULT_QUEUES, MAX_QUEUES};
    let mut lines = Vec::new();
    match check_enqueue_order(plan, &schedule_order(plan)?, 1) {
        Ok(()) => lines.push(
            "hardware queues: enqueued in schedule order, the plan cannot hang on any number of CUDA's FIFO \
             queues (proven on one)"
                .to_string(),
        ),
        Err(e) => lines.push(format!("hardware queues: enqueued in schedule order: {e}")),
    }
    for queues in [DEFAULT_QUEUES, MAX_QUEUES] {
        let whole = "hardware queues: enqueued lane by lane (each lane whole, device by device)";
        lines.push(match check_enqueue_order(plan, &whole_lane_order(plan), queues) {
            Ok(()) => format!("{whole}, it cannot hang on {queues} queues"),
            Err(EnqueueError::Hang(hang)) => format!("{whole}: {hang}"),
            Err(e) => bail!("{e}"),
        });
    }
    Ok(lines)
}
