//! The host twin's C++: one translation unit of the CPU runtime (`cuda/host/*.h`), the
//! kernels' common helpers and every kernel file, with one exported launcher per entry
//! point, and its build with the system compiler into a cached shared library. The host
//! twin ([`crate::HostTwin`]) and the fake driver (`fake.rs`) both load what it builds.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command as Process;

use crate::error::CudaError;
use crate::kernels::KERNEL_FILES;
use crate::launch::Kernel;

pub(crate) const RUNTIME: &str = include_str!("../host/runtime.h");
const MMA: &str = include_str!("../host/mma.h");
const HOPPER: &str = include_str!("../host/hopper.h");
pub(crate) const COMMON: &str = include_str!("../kernels/common.cuh");

/// The compiler flags: no contraction of multiplies and adds, as the bit-exact kernels
/// assume of their host twins. `-Bsymbolic`: the host twin and the fake driver each hold
/// a copy of the runtime, and a process may load both; an inline function the compiler
/// did not inline (the cp.async twins, say) would otherwise bind to the other library's
/// copy, which reads that library's thread-local block, not the caller's.
const FLAGS: [&str; 8] =
    ["-std=c++17", "-O2", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-w", "-Wl,-Bsymbolic"];

/// The one C++ translation unit: runtime, common helpers, mma twin, every kernel file,
/// then one exported launcher per entry point.
pub fn host_source() -> String {
    let mut src = format!("{RUNTIME}\n// ---- common.cuh ----\n{COMMON}\n{MMA}\n{HOPPER}\n");
    for file in KERNEL_FILES {
        // The twins' messages name the kernel file's own lines.
        src.push_str(&format!("// ---- {} ----\n#line 1 \"{}\"\n{}\n", file.name, file.name, file.source));
    }
    src.push_str("// ---- launchers ----\n");
    for kernel in Kernel::ALL {
        let (e, mode) = (kernel.entry(), Mode::of(kernel) as u32);
        src.push_str(&format!(
            "extern \"C\" int cmm_host_{e}(const u32* grid, const u32* block, u32 mode, void** params, char* error, \
             u64 error_len) {{ return cmm_host::launch({e}, grid, block, mode, params, error, error_len); }}\n\
             extern \"C\" u32 cmm_host_params_{e}(u64* sizes, u32 capacity) {{ \
             return cmm_host::param_sizes({e}, sizes, capacity); }}\n\
             extern \"C\" u32 cmm_host_mode_{e}() {{ return {mode}; }}\n"
        ));
    }
    src
}

/// How a launch runs its blocks (`cmm_host::Mode` in runtime.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Block after block, thread after thread: kernels without barriers.
    Plain = 0,
    /// Block after block, every thread a fiber.
    Fibers = 1,
    /// Every block on its own OS thread, with fibers (blocks that wait for each other).
    ConcurrentBlocks = 2,
}

impl Mode {
    /// How `kernel`'s blocks must run: concurrently when they wait for each other, as
    /// fibers when they have barriers.
    pub(crate) fn of(kernel: Kernel) -> Mode {
        match (kernel.has_barriers(), kernel.persistent()) {
            (_, true) => Mode::ConcurrentBlocks,
            (true, false) => Mode::Fibers,
            (false, false) => Mode::Plain,
        }
    }
}

pub(crate) fn compiler() -> String {
    std::env::var("CXX").ok().filter(|c| !c.trim().is_empty()).unwrap_or_else(|| "c++".into())
}

pub(crate) fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("cmm").join("host-kernels")
}

/// Compiles `src` with `cxx` and `extra` flags into `dir` as `<stem>-<key>.so` (keyed by
/// source, compiler and flags) unless it is there, and returns the library's path.
pub(crate) fn build(cxx: &str, src: &str, dir: &Path, stem: &str, extra: &[&str]) -> Result<PathBuf, CudaError> {
    let fail = |message: String, log: String| CudaError::HostBuild { compiler: cxx.to_string(), message, log };
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (src, cxx, FLAGS, extra).hash(&mut hasher);
    let library = dir.join(format!("{stem}-{:016x}.so", hasher.finish()));
    if library.exists() {
        return Ok(library);
    }
    std::fs::create_dir_all(dir).map_err(|e| fail(format!("creating {}: {e}", dir.display()), String::new()))?;
    // Concurrent builders each write their own files, then rename: the last one wins whole.
    let unique = format!("{}-{:?}", std::process::id(), std::thread::current().id()).replace(['(', ')'], "");
    let (source, partial) = (library.with_extension(format!("{unique}.cpp")), library.with_extension(unique));
    std::fs::write(&source, src).map_err(|e| fail(format!("writing {}: {e}", source.display()), String::new()))?;
    let output = Process::new(cxx).args(FLAGS).arg("-o").arg(&partial).arg(&source).args(extra).output();
    let _ = std::fs::remove_file(&source);
    let output = output.map_err(|e| fail(format!("cannot run it ({e}); install g++ or clang++"), String::new()))?;
    if !output.status.success() {
        let log = String::from_utf8_lossy(&output.stderr).into_owned();
        return Err(fail(format!("it exited with {}", output.status), format!("\n{log}")));
    }
    std::fs::rename(&partial, &library)
        .map_err(|e| fail(format!("moving the library into {}: {e}", dir.display()), String::new()))?;
    Ok(library)
}
