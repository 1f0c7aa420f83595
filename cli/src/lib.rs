//! cmm-cli: the commands users run on their own problems, shared by the `cmm` binary
//! and `cargo xtask`: `simulate` (a problem, a mesh GEMM, a layer, attention, an MoE op,
//! or a plan file on a hardware profile) and `tune` (rank the candidate plans).

pub mod problem_args;
pub mod simulate;
pub mod tune;
