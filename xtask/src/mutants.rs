//! `cargo xtask mutants [--filter P] [--backend B] [--verbose]`: the mutation kill rate.

use anyhow::{bail, Context, Result};
use cmm_conformance::mutants::run_mutants;
use cmm_conformance::{cases_dir, load_corpus};

use crate::conformance::{self, make_backend, BackendKind};

/// Arguments of `cargo xtask mutants`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Mutate only the plans of cases whose name contains this substring.
    #[arg(long, value_name = "P")]
    pub filter: Option<String>,
    /// The executor that runs mutants the static checks do not catch.
    #[arg(long, value_enum, default_value = "reference")]
    pub backend: BackendKind,
    /// Print every caught mutant and the check that caught it.
    #[arg(long)]
    pub verbose: bool,
}

/// Runs every mutant; fails when a mutant that is not provably equivalent survives.
pub fn run(args: &Args) -> Result<()> {
    let cases: Vec<_> = load_corpus(&cases_dir())
        .context("loading the corpus")?
        .into_iter()
        .filter(|c| args.filter.as_ref().is_none_or(|f| c.name.contains(f.as_str())))
        .collect();
    if cases.is_empty() {
        bail!("no case name contains `{}`", args.filter.clone().unwrap_or_default());
    }
    let backend = make_backend(&conformance::Args::plain(args.backend, 1))?;
    let report = run_mutants(&cases, backend.as_ref(), &mut std::io::stdout().lock(), args.verbose)?;
    if !report.survivors.is_empty() {
        bail!("{} mutant(s) survived every check", report.survivors.len());
    }
    Ok(())
}
