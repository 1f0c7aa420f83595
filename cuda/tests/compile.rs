//! Every kernel compiles with NVRTC for sm_90a and defines its entry points. NVRTC runs
//! on the CPU, so this needs no GPU, only libnvrtc (CI installs it from the PyPI wheel
//! `nvidia-cuda-nvrtc` and sets `CMM_REQUIRE_NVRTC`, so there it cannot skip).

use cmm_cuda::kernels::{compile, nvrtc_available, DEFAULT_ARCH, KERNEL_FILES};

#[test]
fn every_kernel_compiles_for_hopper() {
    if !nvrtc_available() {
        assert!(
            std::env::var_os("CMM_REQUIRE_NVRTC").is_none(),
            "CMM_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
        );
        eprintln!("SKIPPED: libnvrtc is not installed; see `cargo xtask cuda-check`");
        return;
    }
    for kernel in KERNEL_FILES {
        let ptx = compile(&kernel, DEFAULT_ARCH).unwrap_or_else(|e| panic!("{e}"));
        assert!(ptx.contains(".target sm_90a"), "{}: {}", kernel.name, &ptx[..ptx.len().min(400)]);
        for entry in kernel.entry_points {
            assert!(ptx.contains(&format!(".entry {entry}(")), "{} lacks {entry}", kernel.name);
        }
    }
}

#[test]
fn a_broken_kernel_reports_the_file_and_the_log() {
    if !nvrtc_available() {
        eprintln!("SKIPPED: libnvrtc is not installed");
        return;
    }
    let broken = cmm_cuda::KernelFile {
        name: "broken.cu",
        source: "extern \"C\" __global__ void f() { undefined_symbol(); }",
        entry_points: &["f"],
    };
    let err = compile(&broken, DEFAULT_ARCH).unwrap_err().to_string();
    assert!(err.contains("broken.cu") && err.contains("undefined_symbol"), "{err}");
}
