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
use cmm_conformance::{load_corpus, run_corpus, write_report, Backend, CpuTwin, Options, OutputFiles, Summary};
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
        /// Interleavings to replay (the default order first), 1 to 100000.
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=cmm_cli::verify::MAX_SCHEDULES as i64))]
        schedules: u32,
        /// Also write a report, one test case per interleaving: JSON for .json, JUnit XML
        /// for .xml.
        #[arg(long)]
        report: Option<PathBuf>,
    },
    /// Simulate a plan file, or a problem's plan (1D op, mesh GEMM, linear layer,
    /// attention, MoE op), on a hardware profile; --json for one JSON object.
    Simulate(Box<cmm_cli::simulate::Args>),
    /// Rank the candidate plans of a problem by simulated time (2D: seed 002's closed form
    /// over every configuration, then cmm's plans for its leaders simulated) and say why the
    /// winner wins.
    Tune(Box<cmm_cli::tune::Args>),
}

fn main() -> ExitCode {
    cmm_cli::end_quietly_on_a_closed_pipe();
    cmm_cli::no_wayland_display_without_a_session();
    match run(Cli::parse().command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", cmm_cli::describe_error(&e));
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
        Command::Verify { plan, schedules, report } => verify_file(&plan, schedules as usize, report.as_deref()),
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
    let protected: [(&str, &Path); 3] = [("the cases", cases), ("the goldens", golden), ("the outputs", outputs)];
    if let Some(path) = report {
        cmm_conformance::check_report_path(path, &protected)?;
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
        write_report(path, "cmm check", &summary.backend, &summary.records, &protected)?;
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
    let protected: [(&str, &Path); 1] = [("the plan file", path)];
    if let Some(report) = report {
        cmm_conformance::check_report_path(report, &protected)?;
    }
    let plan = read_plan(path)?;
    let verification = cmm_cli::verify::verify_plan(&plan, schedules).with_context(|| format!("{}", path.display()))?;
    for line in &verification.lines {
        println!("{line}");
    }
    if let Some(path) = report {
        write_report(path, "cmm verify", "verifier", &verification.records, &protected)?;
        println!("report: {}", path.display());
    }
    Ok(if verification.findings > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
