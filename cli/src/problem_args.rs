//! Problem and profile arguments shared by `simulate` and `tune`.

use anyhow::{bail, Context, Result};
use cmm_core::{Algorithm, DType, OpKind, Problem, ProblemError};
use cmm_sim::Profile;

/// A 1D problem on the command line.
#[derive(Debug, Clone, clap::Args)]
pub struct ProblemArgs {
    /// Operation: ag_gemm, gemm_rs or gemm_ar.
    #[arg(long, value_parser = parse_op)]
    pub op: Option<OpKind>,
    /// Devices D.
    #[arg(long, short = 'd')]
    pub devices: Option<usize>,
    /// Global M (rows of A and C).
    #[arg(long, short = 'm')]
    pub m: Option<usize>,
    /// Global N (columns of B and C).
    #[arg(long, short = 'n')]
    pub n: Option<usize>,
    /// Global K.
    #[arg(long, short = 'k')]
    pub k: Option<usize>,
    /// Input dtype: f32, f16 or bf16.
    #[arg(long, default_value = "f16", value_parser = parse_dtype)]
    pub input: DType,
    /// Output dtype (default: the input dtype).
    #[arg(long, value_parser = parse_dtype)]
    pub output: Option<DType>,
    /// The dtype partial sums travel in (gemm_rs, gemm_ar, and 2D LS/RS GEMMs; default f32).
    #[arg(long, value_parser = parse_dtype)]
    pub wire: Option<DType>,
    /// Hardware profile: a built-in name (h100-nvlink, h100-ib, h200-nvlink, h800-nvlink,
    /// tpuv4-torus, pcie-gen4, h100-one-gpu, h200-one-gpu) or a path to a .toml file.
    #[arg(long, default_value = "h100-nvlink")]
    pub profile: String,
}

fn parse_op(s: &str) -> Result<OpKind, String> {
    s.parse()
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
}

impl ProblemArgs {
    /// The profile.
    pub fn profile(&self) -> Result<Profile> {
        Profile::load(&self.profile).context("loading the hardware profile")
    }

    /// The problem; every dimension is required. Beyond the input generator's 2^32
    /// elements per tensor too: it is simulated, and an executor refuses its plan
    /// (`--executor reference`).
    pub fn problem(&self) -> Result<Problem> {
        let (Some(op), Some(d), Some(m), Some(n), Some(k)) = (self.op, self.devices, self.m, self.n, self.k) else {
            bail!("a problem needs --op, --devices, -m, -n and -k (e.g. --op ag_gemm -d 8 -m 8192 -n 32768 -k 4096)");
        };
        let output = self.output.unwrap_or(self.input);
        let p = match Problem::new(op, d, m, n, k, self.input, output) {
            // The generator's range is checked last, so every other check has passed.
            Err(ProblemError::TooLarge { .. }) => {
                Problem { op, devices: d, m, n, k, input: self.input, output, wire: DType::F32 }
            }
            other => other?,
        };
        Ok(match self.wire {
            Some(wire) => p.with_wire(wire)?,
            None => p,
        })
    }
}

/// Parses `--algorithm`, `--chunks` and `--node`.
pub fn algorithm(name: &str, chunks: Option<usize>, node: Option<usize>) -> Result<Algorithm> {
    Ok(Algorithm::parse_with(name, chunks, node)?)
}

/// Microseconds with one decimal.
pub fn us(seconds: f64) -> String {
    format!("{:.1} µs", seconds * 1e6)
}
