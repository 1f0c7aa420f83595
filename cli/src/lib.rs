//! cmm-cli: the commands users run on their own problems, shared by the `cmm` binary
//! and `cargo xtask`: `simulate` (a problem, a mesh GEMM, a layer, attention, an MoE op,
//! or a plan file on a hardware profile) and `tune` (rank the candidate plans).

pub mod bench_file;
pub mod problem_args;
pub mod simulate;
pub mod tune;

/// Lets a closed standard output end the process quietly, as it ends any Unix filter
/// (`cmm verify plan.json | head`, `cargo xtask conformance | grep -m1 FAIL`). Rust's
/// runtime ignores SIGPIPE, which turns the closed pipe into a panic in the next
/// `println!`. Call first thing in `main`, before any thread starts.
pub fn end_quietly_on_a_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: restores SIGPIPE's default action; no handler runs, and no other thread
    // exists yet to race with the change.
    #[allow(unsafe_code)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
