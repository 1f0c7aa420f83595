//! cmm-cli: the commands users run on their own problems, shared by the `cmm` binary
//! and `cargo xtask`: `simulate` (a problem, a mesh GEMM, a layer, attention, an MoE op,
//! or a plan file on a hardware profile) and `tune` (rank the candidate plans).

pub mod bench_file;
pub mod fuzz;
pub mod output;
pub mod problem_args;
pub mod simulate;
pub mod tune;
pub mod verify;

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

/// Tells the Wayland client library, when the process has no desktop session (no
/// `XDG_RUNTIME_DIR` and no `WAYLAND_DISPLAY`: a container, CI, an SSH shell), that
/// there is no display, so that its probe while the Vulkan adapter starts does not
/// print `error: XDG_RUNTIME_DIR is invalid or not set` twice on every lavapipe run. An
/// absolute `WAYLAND_DISPLAY` that names no socket makes the probe fail quietly. Call
/// first thing in `main`, before any thread starts.
pub fn no_wayland_display_without_a_session() {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() && std::env::var_os("WAYLAND_DISPLAY").is_none() {
        std::env::set_var("WAYLAND_DISPLAY", "/nonexistent/cmm-has-no-wayland-display");
    }
}

/// An error and its causes in one line, each cause once: a cause that an error's own
/// message already quotes (an I/O error inside "cannot write …: {source}") is not
/// repeated.
pub fn describe_error(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_quoted_by_its_error_is_printed_once() {
        let io = std::io::Error::new(std::io::ErrorKind::AlreadyExists, "File exists (os error 17)");
        let e = anyhow::Error::new(cmm_conformance::ConformanceError::Io {
            what: "the export directory x".into(),
            source: io,
        })
        .context("conformance run");
        assert_eq!(
            describe_error(&e),
            "conformance run: cannot write the export directory x: File exists (os error 17)"
        );
    }
}
