//! `cargo xtask mutants [--filter P] [--backend B] [--every-device] [--verbose]`: the
//! mutation kill rate.

use std::io::IsTerminal;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use cmm_conformance::mutants::{run_mutants, MutantOptions, Sites};
use cmm_conformance::{cases_dir, load_corpus};
use indicatif::{ProgressBar, ProgressStyle};

use crate::conformance::{self, make_backend, BackendKind};

/// Arguments of `cargo xtask mutants`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Mutate only the plans of cases whose name contains this substring (or one of
    /// several, separated by commas).
    #[arg(long, value_name = "P")]
    pub filter: Option<String>,
    /// The executor that runs mutants the static checks do not catch.
    #[arg(long, value_enum, default_value = "reference")]
    pub backend: BackendKind,
    /// Print every caught mutant and the check that caught it.
    #[arg(long)]
    pub verbose: bool,
    /// Mutate the ops of every device, not only the first and the last (D/2 times the
    /// mutants; about 4 times as long on the corpus).
    #[arg(long)]
    pub every_device: bool,
}

/// Runs every mutant; fails when a mutant that is not provably equivalent survives.
pub fn run(args: &Args) -> Result<()> {
    let cases: Vec<_> = load_corpus(&cases_dir())
        .context("loading the corpus")?
        .into_iter()
        .filter(|c| args.filter.as_ref().is_none_or(|f| cmm_conformance::name_matches(f, &c.name)))
        .collect();
    if cases.is_empty() {
        bail!("no case name contains `{}`", args.filter.clone().unwrap_or_default());
    }
    let backend = make_backend(&conformance::Args::plain(args.backend, 1))?;
    // A bar on a terminal; elsewhere (CI logs) a line every tenth of the cases.
    let bar = ProgressBar::new(cases.len() as u64).with_style(
        ProgressStyle::with_template("mutants {bar:30} {pos}/{len} cases, {elapsed} {msg}").expect("a valid template"),
    );
    let terminal = std::io::stderr().is_terminal();
    let step = cases.len().div_ceil(10).max(1);
    let started = Instant::now();
    let mut progress = |i: usize, total: usize, name: &str| {
        bar.set_position(i as u64);
        bar.set_message(name.to_string());
        if !terminal && i % step == 0 {
            eprintln!("mutants: case {}/{total} ({name}), {:.0} s", i + 1, started.elapsed().as_secs_f64());
        }
    };
    let options = MutantOptions {
        verbose: args.verbose,
        sites: if args.every_device { Sites::Every } else { Sites::FirstAndLast },
    };
    let report = run_mutants(&cases, backend.as_ref(), &mut std::io::stdout().lock(), options, &mut progress)?;
    bar.finish_and_clear();
    if !report.survivors.is_empty() {
        bail!("{} mutant(s) survived every check", report.survivors.len());
    }
    Ok(())
}
