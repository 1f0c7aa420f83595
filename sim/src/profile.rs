//! Hardware profiles: the constants the simulator and the analytic models use, loaded from
//! `sim/profiles/*.toml`. Each file names the source of every constant in a comment.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

use cmm_core::dtype::DType;

/// Why a profile cannot be used.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ProfileError {
    /// No built-in profile has this name.
    #[error("unknown profile `{name}` (built in: {available}); or pass a path to a .toml file")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The built-in names.
        available: String,
    },
    /// The file could not be read.
    #[error("cannot read profile {file}: {reason}")]
    Read {
        /// The file.
        file: String,
        /// The I/O error.
        reason: String,
    },
    /// The file is not valid TOML or does not match the schema (the message names the field).
    #[error("profile {file}: {message}")]
    Parse {
        /// The file.
        file: String,
        /// toml's message, naming the field and line.
        message: String,
    },
    /// A field has a value no hardware can have.
    #[error("profile {file}: field `{field}` = {value}: {reason}")]
    Invalid {
        /// The file.
        file: String,
        /// Dotted field name.
        field: &'static str,
        /// The value found.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// How devices are wired.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopologyKind {
    /// Every device has one port into a non-blocking switch (NVSwitch, a PCIe switch): a
    /// copy uses the sender's egress and the receiver's ingress.
    Switch,
    /// A torus of point-to-point links (TPU ICI); copies route dimension by dimension
    /// along the shorter way round, using every directed link on the way.
    Torus,
    /// D virtual devices emulated on one GPU, as the CUDA bench runs them
    /// (`Placement::Virtual`): every device's GEMMs and reductions share the one GPU's
    /// compute, and a copy between devices is a device-to-device copy through its one HBM
    /// (each byte read and written). The interconnect's link fields are unused.
    OneGpu,
}

impl fmt::Display for TopologyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TopologyKind::Switch => "switch",
            TopologyKind::Torus => "torus",
            TopologyKind::OneGpu => "one_gpu",
        })
    }
}

/// Peak throughput per input dtype, TFLOP/s.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakTflops {
    /// f16 inputs.
    pub f16: f64,
    /// bf16 inputs.
    pub bf16: f64,
    /// f32 inputs.
    pub f32: f64,
}

/// The GEMM engine.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeProfile {
    /// Dense peak per input dtype.
    pub peak_tflops: PeakTflops,
    /// SMs (GPU) or matrix units (TPU) that each take one output tile at a time.
    pub parallel_units: usize,
    /// Rows of one output tile.
    pub tile_m: usize,
    /// Columns of one output tile.
    pub tile_n: usize,
    /// Largest split of K used to fill idle units on skinny problems.
    pub max_split_k: usize,
    /// The rate of a GEMM split along K, as a fraction of a full wave's (its partial sums
    /// take another pass, its tiles are thinner). Default 1: as fast (an assumption).
    #[serde(default = "as_fast")]
    pub split_k_efficiency: f64,
    /// Fraction of peak reached when every unit is busy.
    pub max_efficiency: f64,
    /// A library GEMM's fixed cost beyond its launch, µs: the pipeline's fill and the last
    /// wave's epilogue, which no later wave hides (so a one-wave GEMM runs well below the
    /// rate of a long one). Default 0: none (an assumption).
    #[serde(default)]
    pub gemm_overhead_us: f64,
    /// Fixed cost of every data op (kernel launch), µs.
    pub launch_us: f64,
    /// On one GPU shared by several devices (`one_gpu`): the compute's total throughput
    /// with 1, 2, … compute ops running at once, relative to one op alone (one GEMM alone
    /// leaves part of the chip idle at its wave tails, which a second one fills). The first
    /// is 1 by definition; a file gives 1 to [`MAX_CONCURRENT`] of them, and the last it
    /// gives holds for more ops. Default: no gain.
    #[serde(default = "no_concurrent_gain", deserialize_with = "up_to_max_concurrent")]
    pub concurrent_throughput: [f64; MAX_CONCURRENT],
}

/// How many compute ops at once a profile's `concurrent_throughput` can tell apart (the
/// bench's calibration times 2, 4 and 8).
pub const MAX_CONCURRENT: usize = 8;

fn no_concurrent_gain() -> [f64; MAX_CONCURRENT] {
    [1.0; MAX_CONCURRENT]
}

/// `concurrent_throughput` as a file gives it, 1 to [`MAX_CONCURRENT`] values, the last
/// held for more ops.
fn up_to_max_concurrent<'de, D: serde::Deserializer<'de>>(d: D) -> Result<[f64; MAX_CONCURRENT], D::Error> {
    let given = Vec::<f64>::deserialize(d)?;
    match given.last() {
        Some(&last) if given.len() <= MAX_CONCURRENT => {
            Ok(std::array::from_fn(|i| given.get(i).copied().unwrap_or(last)))
        }
        _ => Err(serde::de::Error::invalid_length(given.len(), &"1 to 8 throughputs")),
    }
}

fn as_fast() -> f64 {
    1.0
}

impl ComputeProfile {
    /// The compute's total throughput with `ops` compute ops at once, relative to one
    /// alone ([`Self::concurrent_throughput`]; more than it tells apart take the last).
    pub fn throughput_with(&self, ops: usize) -> f64 {
        self.concurrent_throughput[ops.clamp(1, MAX_CONCURRENT) - 1]
    }
}

/// Local memory.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryProfile {
    /// HBM bandwidth, GB/s.
    pub hbm_gbps: f64,
    /// The rate cmm's reduce kernel moves bytes alone (each byte read or written counted
    /// once), GB/s, where it is below the HBM's; unset: the HBM's rate (an assumption).
    #[serde(default)]
    pub reduce_gbps: Option<f64>,
}

/// The interconnect.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterconnectProfile {
    /// Switch or torus.
    pub topology: TopologyKind,
    /// Bandwidth of one port (switch) or link (torus), per direction, GB/s.
    pub link_gbps: f64,
    /// One-way latency of a small write, per hop, µs.
    pub link_latency_us: f64,
    /// How many directions a ring collective uses at once (2 on a torus ring).
    pub collective_directions: usize,
}

/// The network joining nodes of a multi-node system: the interconnect above wires the
/// devices inside a node; a copy between nodes leaves through the sender's NIC and
/// enters through the receiver's (one NIC per device, as on DGX/HGX systems).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkProfile {
    /// Devices per node (device d is in node d / devices_per_node).
    pub devices_per_node: usize,
    /// Bandwidth of one device's NIC, per direction, GB/s.
    pub nic_gbps: f64,
    /// One-way latency of a small write between nodes, µs.
    pub latency_us: f64,
}

/// Rates of the two ways to move bytes.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CopyProfile {
    /// One DMA copy, GB/s.
    pub copy_engine_gbps: f64,
    /// One SM copy kernel, GB/s.
    pub sm_copy_gbps: f64,
    /// On one GPU (`one_gpu`), the fraction of its rate a copy keeps while compute runs
    /// beside it (default 1: no contention beyond the HBM they share).
    #[serde(default = "uncontended")]
    pub rate_beside_compute: f64,
    /// On one GPU, the fraction of the compute's throughput left while a copy runs beside
    /// it (default 1).
    #[serde(default = "uncontended")]
    pub compute_beside_copy: f64,
    /// On one GPU, the fraction of its rate a copy keeps while a persistent kernel (a
    /// fused GEMM's, whose CTAs hold their SMs from launch to end, spinning on waits or
    /// computing) runs beside it, in place of `rate_beside_compute`. Unset: a persistent
    /// kernel is compute like any other. The bench's calibration measures it
    /// (`cmm_sim::calibration::persistent_plan`); no profile sets it until a GPU has.
    #[serde(default)]
    pub rate_beside_persistent: Option<f64>,
    /// On one GPU, the rate, GB/s, that every copy the driver makes its own way
    /// ([`cmm_core::engines::CopyIssue::driver_makes`]) between virtual devices shares
    /// with the others in flight: they queue for one copy's rate rather than each taking
    /// the copy engine's. Unset: they are priced as the copy engines' copies.
    #[serde(default)]
    pub driver_gbps: Option<f64>,
}

fn uncontended() -> f64 {
    1.0
}

/// Synchronisation costs.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncProfile {
    /// Cost of a Wait satisfied by another device's Signal when its lane next runs SM work
    /// (fence + semaphore round), µs. Also the L_sync of the analytic models.
    pub remote_round_us: f64,
    /// Cost of a Wait satisfied by another device's Signal when its lane next runs a
    /// copy-engine copy (or nothing): the DMA front end polls a flag, µs.
    pub dma_wait_us: f64,
    /// Cost of a Wait satisfied by a Signal of the same device, µs.
    pub local_wait_us: f64,
}

/// A hardware profile.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Short name, e.g. `h100-nvlink`.
    pub name: String,
    /// One line for humans.
    pub description: String,
    /// Most devices the system has.
    pub max_devices: usize,
    /// GEMM engine.
    pub compute: ComputeProfile,
    /// Local memory.
    pub memory: MemoryProfile,
    /// Interconnect.
    pub interconnect: InterconnectProfile,
    /// Copy rates.
    pub copy: CopyProfile,
    /// Synchronisation.
    pub sync: SyncProfile,
    /// The network between nodes, for multi-node systems (absent: one node).
    #[serde(default)]
    pub network: Option<NetworkProfile>,
    /// cmm's own GEMM kernels on this machine, by engine (absent: it runs none of them,
    /// and every GEMM is priced at [`ComputeProfile`]'s library rate).
    #[serde(default)]
    pub engines: Option<EngineRates>,
}

/// How fast each of cmm's GEMM kernels runs on a machine (cuBLAS's rate is
/// [`ComputeProfile`]'s). A kernel absent here does not run on it (the Hopper engine off
/// Hopper GPUs).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineRates {
    /// The Hopper engine on 128×256 tiles.
    #[serde(default)]
    pub hopper_128x256: Option<EngineRate>,
    /// The Hopper engine on 128×128 tiles.
    #[serde(default)]
    pub hopper_128x128: Option<EngineRate>,
    /// The tensor-core tile kernel on 64×64 tiles.
    pub tile_64x64: EngineRate,
    /// The tensor-core tile kernel on 128×128 tiles.
    pub tile_128x128: EngineRate,
    /// The SIMT tile kernel (f32, mixed dtypes), 64×64 tiles; its efficiency is a fraction
    /// of the f32 (CUDA-core) peak.
    pub simt: EngineRate,
    /// The grouped GEMM of the MoE plans (`cmm_grouped_gemm`: one thread per output, in k
    /// order); a fraction of the f32 peak.
    pub grouped: EngineRate,
    /// The attention kernel (`cmm_attend`: one thread per row and head); a fraction of
    /// the f32 peak.
    pub attention: EngineRate,
}

/// One kernel's rate: the fraction of the dense peak it reaches on full waves of its
/// tiles, and a fixed cost per launch (its pipeline's fill and last epilogue, which a
/// single wave does not hide).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineRate {
    /// Fraction of the dense peak on full waves.
    pub efficiency: f64,
    /// µs added to every launch.
    #[serde(default)]
    pub kernel_overhead_us: f64,
    /// On one GPU shared by several virtual devices (`one_gpu`), the fraction of peak its
    /// persistent kernels reach together, one per device at once (absent: `efficiency`).
    #[serde(default)]
    pub shared_efficiency: Option<f64>,
    /// The same for kernels writing f32 (gemm_rs's partial sums; absent:
    /// `shared_efficiency`). The bench's calibration times the persistent kernels both ways.
    #[serde(default)]
    pub shared_efficiency_f32: Option<f64>,
    /// As the MoE grouped GEMM's mainloop (tiles from the routing's segment offsets, the
    /// experts' B as a 3D tensor), the fraction of peak over rows that TMA loads
    /// (absent: `efficiency`); rows gathered by token that the engine stages first are
    /// loaded so too ([`Profile::grouped_gemm_cost_on`]).
    #[serde(default)]
    pub grouped_efficiency: Option<f64>,
    /// The same over rows gathered by token that the producer threads copy into each tile
    /// (`cp.async`, which no TMA box can load), as the engine does below
    /// [`cmm_core::engines::STAGED_GATHER_MIN_COLUMNS`] (absent: `grouped_efficiency`).
    #[serde(default)]
    pub gathered_efficiency: Option<f64>,
}

impl EngineRate {
    /// The fraction of peak this engine reaches as a grouped GEMM, over rows its producer
    /// gathers by token or over rows TMA loads.
    pub fn grouped(&self, gathered_in_kernel: bool) -> f64 {
        let grouped = self.grouped_efficiency.unwrap_or(self.efficiency);
        if gathered_in_kernel {
            self.gathered_efficiency.unwrap_or(grouped)
        } else {
            grouped
        }
    }
}

/// The least and most TFLOP/s or GB/s a profile may give: about a millionth of a chip's
/// or a link's rate today, and hundreds of times it.
const MIN_RATE: f64 = 1e-3;
const MAX_RATE: f64 = 1e6;
const PEAK_RANGE: &str = "is in TFLOP/s, 0.001 to 10^6 (a larger value reads like FLOP/s)";
const RATE_RANGE: &str = "is in GB/s, 0.001 to 10^6 (a larger value reads like bytes/s)";
/// The most µs a latency or fixed cost may be: a second.
const MAX_TIME_US: f64 = 1e6;
const TIME_RANGE: &str = "is in µs, at most 10^6 (a second; a larger value reads like ns or ps)";
/// The least fraction of a rate (an efficiency, a share beside other work) a profile may
/// give: below any measured, the fake CUDA driver's included (its CPU twin of the GPU,
/// calibrated by `--validate-bench`, runs at about 4·10^-8 of an H100's peak), and far
/// above what would overflow a time.
const MIN_FRACTION: f64 = 1e-12;
/// The most a throughput of several ops at once may be relative to one alone.
const MAX_GAIN: f64 = 1e3;
/// The most compute units (SMs, cores) and the widest tile a profile may give.
const MAX_UNITS: usize = 1_000_000;
const MAX_TILE: usize = 1 << 16;

/// A profile's number as its error shows it: plainly (`-1`, `3350`), or in exponent form
/// where the plain form would run to dozens of digits (`1e308`, `1e-300`).
fn shown(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-4..1e9).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        v.to_string()
    }
}

/// The HBM bytes of an `m × n × k` GEMM read and written once: a and b, and C (read too
/// when `accumulate`).
fn gemm_bytes(m: usize, n: usize, k: usize, input: DType, output: DType, accumulate: bool) -> f64 {
    let c_passes = if accumulate { 2.0 } else { 1.0 };
    (m * k + k * n) as f64 * input.size_bytes() as f64 + c_passes * (m * n) as f64 * output.size_bytes() as f64
}

/// The profiles shipped in `sim/profiles/`, by name.
const BUILTIN: [(&str, &str); 8] = [
    ("h100-nvlink", include_str!("../profiles/h100-nvlink.toml")),
    ("h800-nvlink", include_str!("../profiles/h800-nvlink.toml")),
    ("h100-ib", include_str!("../profiles/h100-ib.toml")),
    ("h200-nvlink", include_str!("../profiles/h200-nvlink.toml")),
    ("tpuv4-torus", include_str!("../profiles/tpuv4-torus.toml")),
    ("pcie-gen4", include_str!("../profiles/pcie-gen4.toml")),
    ("h100-one-gpu", include_str!("../profiles/h100-one-gpu.toml")),
    ("h200-one-gpu", include_str!("../profiles/h200-one-gpu.toml")),
];

/// The folder holding the shipped profile files.
pub fn profiles_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles")
}

/// Time of one GEMM and how it was derived.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmCost {
    /// Seconds the GEMM keeps the device's compute busy (no launch overhead).
    pub work_s: f64,
    /// Fraction of peak reached (after tiling and the memory roofline).
    pub efficiency: f64,
    /// Whether HBM traffic, not the tensor cores, bounds it.
    pub memory_bound: bool,
    /// Bytes it moves through HBM (operands once, the result once, twice when added onto).
    pub bytes: f64,
    /// Of `work_s`, the library GEMM's fixed cost ([`ComputeProfile::gemm_overhead_us`]):
    /// its pipeline's fill and last epilogue, latency that on a shared GPU overlaps the
    /// other kernels' work rather than taking the compute from them.
    pub fixed_s: f64,
}

impl Profile {
    /// Names of the built-in profiles.
    pub fn builtin_names() -> Vec<&'static str> {
        BUILTIN.iter().map(|(n, _)| *n).collect()
    }

    /// A built-in profile by name, or a profile file when `name_or_path` ends in `.toml`.
    pub fn load(name_or_path: &str) -> Result<Profile, ProfileError> {
        if name_or_path.ends_with(".toml") {
            return Profile::from_file(Path::new(name_or_path));
        }
        match BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            Some((n, text)) => Profile::parse(text, &format!("sim/profiles/{n}.toml")),
            None => Err(ProfileError::Unknown {
                name: name_or_path.to_string(),
                available: Profile::builtin_names().join(", "),
            }),
        }
    }

    /// Reads and checks a profile file.
    pub fn from_file(path: &Path) -> Result<Profile, ProfileError> {
        let file = path.display().to_string();
        let text =
            fs::read_to_string(path).map_err(|e| ProfileError::Read { file: file.clone(), reason: e.to_string() })?;
        Profile::parse(&text, &file)
    }

    /// Parses and checks profile text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Profile, ProfileError> {
        let profile: Profile = toml::from_str(text)
            .map_err(|e: toml::de::Error| ProfileError::Parse { file: file.to_string(), message: e.to_string() })?;
        profile.check(file)?;
        Ok(profile)
    }

    /// Checks every number against what hardware can have (`file` names the profile in
    /// errors).
    pub(crate) fn check(&self, file: &str) -> Result<(), ProfileError> {
        let invalid = |field: &'static str, value: String, reason: &'static str| ProfileError::Invalid {
            file: file.to_string(),
            field,
            value,
            reason,
        };
        // Finite and above 0, then within a range wider than any hardware's: a rate in
        // bytes/s where GB/s is meant is finite, but its simulated times come out absurd or
        // overflow to infinity, and `tune` would rank them.
        let peaks = [
            ("compute.peak_tflops.f16", self.compute.peak_tflops.f16),
            ("compute.peak_tflops.bf16", self.compute.peak_tflops.bf16),
            ("compute.peak_tflops.f32", self.compute.peak_tflops.f32),
        ];
        let mut rates = vec![
            ("memory.hbm_gbps", self.memory.hbm_gbps),
            ("interconnect.link_gbps", self.interconnect.link_gbps),
            ("copy.copy_engine_gbps", self.copy.copy_engine_gbps),
            ("copy.sm_copy_gbps", self.copy.sm_copy_gbps),
        ];
        rates.extend(self.network.iter().map(|n| ("network.nic_gbps", n.nic_gbps)));
        rates.extend(self.memory.reduce_gbps.map(|v| ("memory.reduce_gbps", v)));
        rates.extend(self.copy.driver_gbps.map(|v| ("copy.driver_gbps", v)));
        for (fields, range) in [(&peaks[..], PEAK_RANGE), (&rates[..], RATE_RANGE)] {
            for &(field, v) in fields {
                if !(v.is_finite() && v > 0.0) {
                    return Err(invalid(field, shown(v), "must be a finite number above 0"));
                }
                if !(MIN_RATE..=MAX_RATE).contains(&v) {
                    return Err(invalid(field, shown(v), range));
                }
            }
        }
        // At least 1; the units and tiles also at most any chip's (the ring's directions
        // have their own bound below).
        let mut counts = vec![
            ("max_devices", self.max_devices, usize::MAX),
            ("compute.parallel_units", self.compute.parallel_units, MAX_UNITS),
            ("compute.tile_m", self.compute.tile_m, MAX_TILE),
            ("compute.tile_n", self.compute.tile_n, MAX_TILE),
            ("compute.max_split_k", self.compute.max_split_k, usize::MAX),
            ("interconnect.collective_directions", self.interconnect.collective_directions, usize::MAX),
        ];
        counts.extend(self.network.iter().map(|n| ("network.devices_per_node", n.devices_per_node, usize::MAX)));
        for (field, v, max) in counts {
            if v == 0 {
                return Err(invalid(field, v.to_string(), "must be at least 1"));
            }
            if v > max {
                return Err(invalid(field, v.to_string(), "is above any chip's (at most 10^6 units, tiles of 2^16)"));
            }
        }
        let gains = self.compute.concurrent_throughput;
        if gains[0] != 1.0 || gains.iter().any(|g| !(MIN_FRACTION..=MAX_GAIN).contains(g)) {
            return Err(invalid(
                "compute.concurrent_throughput",
                format!("{gains:?}"),
                "is 1, then the throughputs of 2, 3, … ops at once relative to one (10^-12 to 1000)",
            ));
        }
        let fractions = [
            ("compute.max_efficiency", self.compute.max_efficiency),
            ("copy.rate_beside_compute", self.copy.rate_beside_compute),
            ("copy.compute_beside_copy", self.copy.compute_beside_copy),
            ("compute.split_k_efficiency", self.compute.split_k_efficiency),
        ];
        let persistent = self.copy.rate_beside_persistent.map(|v| ("copy.rate_beside_persistent", v));
        for (field, v) in fractions.into_iter().chain(persistent) {
            if !(MIN_FRACTION..=1.0).contains(&v) {
                return Err(invalid(field, shown(v), "is a fraction, at least 10^-12 and at most 1"));
            }
        }
        let mut non_negative = vec![
            ("sync.dma_wait_us", self.sync.dma_wait_us),
            ("compute.launch_us", self.compute.launch_us),
            ("compute.gemm_overhead_us", self.compute.gemm_overhead_us),
            ("interconnect.link_latency_us", self.interconnect.link_latency_us),
            ("sync.remote_round_us", self.sync.remote_round_us),
            ("sync.local_wait_us", self.sync.local_wait_us),
        ];
        non_negative.extend(self.network.iter().map(|n| ("network.latency_us", n.latency_us)));
        for (field, v) in non_negative {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(field, shown(v), "must be a finite number, 0 or more"));
            }
            if v > MAX_TIME_US {
                return Err(invalid(field, shown(v), TIME_RANGE));
            }
        }
        if let Some(e) = &self.engines {
            let rates = [
                ("engines.hopper_128x256", e.hopper_128x256),
                ("engines.hopper_128x128", e.hopper_128x128),
                ("engines.tile_64x64", Some(e.tile_64x64)),
                ("engines.tile_128x128", Some(e.tile_128x128)),
                ("engines.simt", Some(e.simt)),
                ("engines.grouped", Some(e.grouped)),
                ("engines.attention", Some(e.attention)),
            ];
            for (field, rate) in rates {
                let Some(r) = rate else { continue };
                if !(MIN_FRACTION..=1.0).contains(&r.efficiency) {
                    return Err(invalid(
                        field,
                        shown(r.efficiency),
                        "efficiency is a fraction of peak, at least 10^-12 and at most 1",
                    ));
                }
                let fractions = [
                    ("shared_efficiency", r.shared_efficiency),
                    ("shared_efficiency_f32", r.shared_efficiency_f32),
                    ("grouped_efficiency", r.grouped_efficiency),
                    ("gathered_efficiency", r.gathered_efficiency),
                ];
                for (name, fraction) in fractions {
                    if fraction.is_some_and(|e| !(MIN_FRACTION..=1.0).contains(&e)) {
                        return Err(invalid(
                            field,
                            format!("{name} = {fraction:?}"),
                            "is a fraction of peak, at least 10^-12 and at most 1",
                        ));
                    }
                }
                if !(0.0..=MAX_TIME_US).contains(&r.kernel_overhead_us) {
                    return Err(invalid(field, shown(r.kernel_overhead_us), "kernel_overhead_us is 0 to 10^6 µs"));
                }
            }
            if e.hopper_128x256.is_some() != e.hopper_128x128.is_some() {
                return Err(invalid("engines", "one Hopper tile".into(), "gives both Hopper tiles or neither"));
            }
        }
        if self.network.is_some() && self.interconnect.topology != TopologyKind::Switch {
            return Err(invalid(
                "network",
                self.interconnect.topology.to_string(),
                "joins nodes whose devices share a switch (interconnect.topology = \"switch\")",
            ));
        }
        if self.interconnect.collective_directions > 2 {
            return Err(invalid(
                "interconnect.collective_directions",
                self.interconnect.collective_directions.to_string(),
                "a ring has at most 2 directions",
            ));
        }
        Ok(())
    }

    /// Peak FLOP/s for an input dtype.
    pub fn peak_flops(&self, dtype: DType) -> f64 {
        let p = &self.compute.peak_tflops;
        1e12 * match dtype {
            DType::F16 => p.f16,
            DType::Bf16 => p.bf16,
            _ => p.f32,
        }
    }

    /// Fraction of the units busy for an `m × n` output split into tiles, with split-K
    /// filling idle units on skinny problems (the small-tile efficiency curve).
    pub fn tile_utilisation(&self, m: usize, n: usize, k: usize) -> f64 {
        let c = &self.compute;
        let tiles = m.div_ceil(c.tile_m) * n.div_ceil(c.tile_n);
        if tiles == 0 {
            return 1.0;
        }
        let work = tiles * self.split_k(m, n, k);
        let waves = work.div_ceil(c.parallel_units);
        work as f64 / (waves * c.parallel_units) as f64
    }

    /// How many slices of K an `m × n × k` GEMM is split into: only while units would
    /// idle, and never into slices thinner than a tile (1: not split).
    pub fn split_k(&self, m: usize, n: usize, k: usize) -> usize {
        let c = &self.compute;
        let tiles = m.div_ceil(c.tile_m) * n.div_ceil(c.tile_n);
        if tiles == 0 {
            return 1;
        }
        (c.parallel_units / tiles).clamp(1, c.max_split_k).min(k.div_ceil(c.tile_m).max(1))
    }

    /// Cost of `c (m×n) = a (m×k) · b (k×n)` with `input` operands and an `output` result:
    /// FLOPs at peak × max efficiency × tile utilisation (× the split-K efficiency where K
    /// is split), or HBM traffic at the HBM rate, whichever is slower (a roofline); with
    /// `accumulate` (β = 1), the epilogue's read of C at the HBM rate after that; then the
    /// library's fixed cost of a GEMM.
    pub fn gemm_cost(&self, m: usize, n: usize, k: usize, input: DType, output: DType, accumulate: bool) -> GemmCost {
        let flops = 2.0 * m as f64 * n as f64 * k as f64;
        let split = if self.split_k(m, n, k) > 1 { self.compute.split_k_efficiency } else { 1.0 };
        let efficiency = self.compute.max_efficiency * self.tile_utilisation(m, n, k) * split;
        let compute_s = flops / (self.peak_flops(input) * efficiency);
        let bytes = gemm_bytes(m, n, k, input, output, accumulate);
        let mut cost = self.roofline(flops, compute_s, bytes, input, efficiency);
        // cuBLAS reads C in its epilogue, after the mainloop, and nothing hides it: alone
        // (the benches' Σ-GEMMs bound) a β = 1 GEMM took its β = 0 twin's time plus C's
        // bytes at the HBM rate (1024×4096 f32 on an H100: 61.7 µs against 56.8, 5.0 µs of
        // HBM; on an H200 58.4 against 56.3, 3.5).
        if accumulate {
            cost.work_s += (m * n) as f64 * output.size_bytes() as f64 / self.hbm_bps();
        }
        cost.fixed_s = self.compute.gemm_overhead_us * 1e-6;
        cost.work_s += cost.fixed_s;
        if cost.work_s > 0.0 {
            cost.efficiency = flops / cost.work_s / self.peak_flops(input);
        }
        cost
    }

    /// What this machine offers the engines rule: cuBLAS (its library rate), and the
    /// Hopper engine on all its units where the profile gives its rates.
    pub fn engine_support(&self) -> cmm_core::engines::EngineSupport {
        let hopper = self.engines.as_ref().is_some_and(|e| e.hopper_128x256.is_some());
        cmm_core::engines::EngineSupport {
            cublas: true,
            hopper_sms: hopper.then_some(self.compute.parallel_units as u32),
            ..Default::default()
        }
    }

    /// The rate, tile and name of the kernel that `engine` is here: `None` for cuBLAS, or
    /// wherever the profile gives no rates of cmm's kernels (every GEMM then at the
    /// library rate).
    pub fn engine_rate(&self, engine: cmm_core::engines::Engine) -> Option<(EngineRate, usize, usize)> {
        use cmm_core::engines::{Engine, HopperTile};
        let e = self.engines.as_ref()?;
        match engine {
            Engine::Cublas => None,
            Engine::Hopper(HopperTile::Wide) => e.hopper_128x256.map(|r| (r, 128, 256)),
            Engine::Hopper(HopperTile::Narrow) => e.hopper_128x128.map(|r| (r, 128, 128)),
            Engine::TensorTile { wide: false } => Some((e.tile_64x64, 64, 64)),
            Engine::TensorTile { wide: true } => Some((e.tile_128x128, 128, 128)),
            Engine::SimtTile => Some((e.simt, 64, 64)),
            // Not tiled: priced by `scalar_kernel_cost` at the `grouped` rate.
            Engine::ScalarGrouped => None,
        }
    }

    /// [`Self::gemm_cost`] on `engine`: cmm's kernels at their own rate on whole waves of
    /// their own tiles (no split-K), plus their fixed cost per launch; cuBLAS (and every
    /// engine where the profile gives no rates of cmm's) as `gemm_cost`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_cost_on(
        &self,
        engine: cmm_core::engines::Engine,
        m: usize,
        n: usize,
        k: usize,
        input: DType,
        output: DType,
        accumulate: bool,
    ) -> GemmCost {
        let Some((rate, tile_m, tile_n)) = self.engine_rate(engine) else {
            return self.gemm_cost(m, n, k, input, output, accumulate);
        };
        let bytes = gemm_bytes(m, n, k, input, output, accumulate);
        // The SIMT tile multiplies on the CUDA cores, whatever its inputs.
        let rated = if engine == cmm_core::engines::Engine::SimtTile { DType::F32 } else { input };
        self.rated_cost(rate, tile_m, tile_n, &[m], n, k, rated, bytes)
    }

    /// A grouped GEMM or attention block as cmm's kernels run it (one thread per output
    /// or per row and head, on the CUDA cores): `flops` at the rate's fraction of the f32
    /// peak plus its fixed cost, against `bytes` of HBM traffic. `None` where the profile
    /// gives no rates of cmm's kernels.
    pub fn scalar_kernel_cost(&self, rate: fn(&EngineRates) -> EngineRate, flops: f64, bytes: f64) -> Option<GemmCost> {
        let r = rate(self.engines.as_ref()?);
        let compute_s = flops / (self.peak_flops(DType::F32) * r.efficiency) + r.kernel_overhead_us * 1e-6;
        Some(self.roofline(flops, compute_s, bytes, DType::F32, r.efficiency))
    }

    /// The rate `engine`'s persistent kernels reach together on one GPU shared by virtual
    /// devices (its `shared_efficiency`), where the profile gives one.
    pub fn together_efficiency(&self, engine: cmm_core::engines::Engine) -> Option<f64> {
        self.engine_rate(engine).and_then(|(rate, _, _)| rate.shared_efficiency)
    }

    /// [`Self::fused_gemm_cost`] on `engine` (see [`Self::gemm_cost_on`]); `shared`: the
    /// kernel runs beside the other virtual devices' on one GPU. Where the rate gives a
    /// `shared_efficiency`, that is what the devices' kernels were measured to reach
    /// together, their fills, epilogues and partial waves included: the kernel's FLOPs at
    /// that rate, with no waves or fixed cost of its own on top.
    #[allow(clippy::too_many_arguments)]
    pub fn fused_gemm_cost_on(
        &self,
        engine: cmm_core::engines::Engine,
        blocks: &[usize],
        n: usize,
        k: usize,
        input: DType,
        output: DType,
        accumulate: bool,
        shared: bool,
    ) -> GemmCost {
        let Some((rate, tile_m, tile_n)) = self.engine_rate(engine) else {
            return self.fused_gemm_cost(blocks, n, k, input, output, accumulate);
        };
        let rows: usize = blocks.iter().sum();
        let bytes = gemm_bytes(rows, n, k, input, output, accumulate);
        let rated = if engine == cmm_core::engines::Engine::SimtTile { DType::F32 } else { input };
        if let (true, Some(together)) = (shared, rate.shared_efficiency) {
            let together = match output {
                DType::F32 => rate.shared_efficiency_f32.unwrap_or(together),
                _ => together,
            };
            let flops = 2.0 * rows as f64 * n as f64 * k as f64;
            let compute_s = flops / (self.peak_flops(rated) * together);
            return self.roofline(flops, compute_s, bytes, rated, together);
        }
        self.rated_cost(rate, tile_m, tile_n, blocks, n, k, rated, bytes)
    }

    /// Output tiles of `engine` over blocks of `rows` × n (the library's tile for cuBLAS).
    pub fn tiles_on(&self, engine: cmm_core::engines::Engine, rows: usize, n: usize) -> usize {
        match self.engine_rate(engine) {
            Some((_, tile_m, tile_n)) => rows.div_ceil(tile_m) * n.div_ceil(tile_n),
            None => self.tiles(rows, n),
        }
    }

    /// One kernel of `rate` over the `tile_m` × `tile_n` tiles of groups of rows (× n × k
    /// each), whole tiles in waves of the units, plus its fixed cost, against `bytes` of
    /// HBM traffic: whichever is slower.
    #[allow(clippy::too_many_arguments)]
    fn rated_cost(
        &self,
        rate: EngineRate,
        tile_m: usize,
        tile_n: usize,
        groups: &[usize],
        n: usize,
        k: usize,
        input: DType,
        bytes: f64,
    ) -> GemmCost {
        let units = self.compute.parallel_units.max(1);
        let flops = 2.0 * groups.iter().sum::<usize>() as f64 * n as f64 * k as f64;
        let tiles: usize = groups.iter().map(|&m| m.div_ceil(tile_m) * n.div_ceil(tile_n)).sum();
        let waves = tiles.div_ceil(units);
        let tile_flops = 2.0 * (tile_m * tile_n * k) as f64;
        let per_unit = self.peak_flops(input) * rate.efficiency / units as f64;
        let compute_s = waves as f64 * tile_flops / per_unit + rate.kernel_overhead_us * 1e-6;
        self.roofline(flops, compute_s, bytes, input, rate.efficiency)
    }

    /// Cost of a grouped GEMM ([`cmm_core::plan::Op::GroupedGemm`]): one kernel over every
    /// group's output tiles, as a grouped GEMM runs, with `groups` the rows of each group
    /// (from the actual routing). Every tile costs a whole tile_m × tile_n × k tile at
    /// the profile's best efficiency, and tiles run in waves of `parallel_units`, so
    /// small or uneven groups (partial tiles, a last partial wave) cost what they waste.
    /// Memory: the gathered rows, the weights of the non-empty groups and the result
    /// cross HBM once.
    pub fn grouped_gemm_cost(&self, groups: &[usize], n: usize, k: usize, input: DType, output: DType) -> GemmCost {
        let rows: usize = groups.iter().sum();
        let used = groups.iter().filter(|&&m| m > 0).count();
        let bytes = (rows * k + used * k * n) as f64 * input.size_bytes() as f64
            + (rows * n) as f64 * output.size_bytes() as f64;
        self.tiled_cost(groups, n, k, input, bytes)
    }

    /// [`Self::grouped_gemm_cost`] on one of cmm's tiled engines (the Hopper engine): its
    /// grouped rate ([`EngineRate::grouped_efficiency`]) on whole waves of its own tiles
    /// over every group, plus its fixed cost. Rows `gathered` by token: where the engine
    /// stages them ([`cmm_core::engines::stages_gathered_rows`] of `n`), first that staging
    /// (every routed row read from its token's and written once, at the HBM rate, before
    /// the GEMM starts), then the GEMM over them as over any other rows; elsewhere the GEMM
    /// at its rate over rows its producer copies ([`EngineRate::gathered_efficiency`]).
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_gemm_cost_on(
        &self,
        engine: cmm_core::engines::Engine,
        groups: &[usize],
        n: usize,
        k: usize,
        input: DType,
        output: DType,
        gathered: bool,
    ) -> GemmCost {
        let cost = self.grouped_gemm_cost(groups, n, k, input, output);
        match self.engine_rate(engine) {
            Some((rate, tile_m, tile_n)) => {
                let staged = gathered && cmm_core::engines::stages_gathered_rows(n);
                let rate = EngineRate { efficiency: rate.grouped(gathered && !staged), ..rate };
                let gemm = self.rated_cost(rate, tile_m, tile_n, groups, n, k, input, cost.bytes);
                if !staged {
                    return gemm;
                }
                let rows: usize = groups.iter().sum();
                let staging_bytes = 2.0 * (rows * k) as f64 * input.size_bytes() as f64;
                let work_s = gemm.work_s + staging_bytes / self.hbm_bps();
                let flops = 2.0 * (rows * n * k) as f64;
                let efficiency = if work_s > 0.0 { flops / work_s / self.peak_flops(input) } else { gemm.efficiency };
                GemmCost { work_s, efficiency, bytes: gemm.bytes + staging_bytes, ..gemm }
            }
            None => cost,
        }
    }

    /// Cost of a tile-granular GEMM ([`cmm_core::plan::FusedRun`]): one persistent kernel
    /// over the output tiles of every block (`blocks` holds each block's rows), in waves of
    /// `parallel_units` at the profile's best efficiency, so the blocks share their waves
    /// instead of each ending in a partial one. Memory: every block's rows of a, b once,
    /// and the result (read too when accumulating) cross HBM once.
    pub fn fused_gemm_cost(
        &self,
        blocks: &[usize],
        n: usize,
        k: usize,
        input: DType,
        output: DType,
        accumulate: bool,
    ) -> GemmCost {
        let rows: usize = blocks.iter().sum();
        let bytes = gemm_bytes(rows, n, k, input, output, accumulate);
        self.tiled_cost(blocks, n, k, input, bytes)
    }

    /// Output tiles of a GEMM of `rows` × `n` (whole tiles: a partial one costs a whole one).
    pub fn tiles(&self, rows: usize, n: usize) -> usize {
        rows.div_ceil(self.compute.tile_m) * n.div_ceil(self.compute.tile_n)
    }

    /// One kernel over the tiles of groups of rows (`rows` × n × k each), whole tiles in
    /// waves, against `bytes` of HBM traffic: whichever is slower.
    fn tiled_cost(&self, groups: &[usize], n: usize, k: usize, input: DType, bytes: f64) -> GemmCost {
        let c = &self.compute;
        let flops = 2.0 * groups.iter().sum::<usize>() as f64 * n as f64 * k as f64;
        let tiles: usize = groups.iter().map(|&m| self.tiles(m, n)).sum();
        let waves = tiles.div_ceil(c.parallel_units.max(1));
        let tile_flops = 2.0 * (c.tile_m * c.tile_n * k) as f64;
        let per_unit = self.peak_flops(input) * c.max_efficiency / c.parallel_units.max(1) as f64;
        let compute_s = waves as f64 * tile_flops / per_unit;
        self.roofline(flops, compute_s, bytes, input, c.max_efficiency)
    }

    /// The cost of one attention block ([`cmm_core::plan::Op::Attend`]): `rows` query rows
    /// times heads against `keys` keys of head dimension `dh`, of which the fraction
    /// `visible` survives the mask; K and V hold `kv_elements` elements each. Compute: the two GEMMs Q·Kᵀ and P·V over the visible
    /// pairs at this profile's GEMM efficiency for an (rows × keys × dh) tile grid; memory:
    /// Q, K, V and the f32 state (read and written) cross HBM once, the scores never do
    /// (a fused kernel keeps them on chip).
    pub fn attention_cost(
        &self,
        rows: usize,
        keys: usize,
        dh: usize,
        kv_elements: usize,
        input: DType,
        visible: f64,
    ) -> GemmCost {
        let flops = 4.0 * rows as f64 * keys as f64 * dh as f64 * visible;
        let efficiency = self.compute.max_efficiency * self.tile_utilisation(rows, keys, dh);
        let compute_s = flops / (self.peak_flops(input) * efficiency);
        let bytes =
            (rows * dh + 2 * kv_elements) as f64 * input.size_bytes() as f64 + 2.0 * (rows * (dh + 2)) as f64 * 4.0;
        self.roofline(flops, compute_s, bytes, input, efficiency)
    }

    /// Seconds of one launch overhead.
    pub fn launch_s(&self) -> f64 {
        self.compute.launch_us * 1e-6
    }

    /// Bytes per second of one link direction.
    pub fn link_bps(&self) -> f64 {
        self.interconnect.link_gbps * 1e9
    }

    /// Bytes per second of HBM.
    pub fn hbm_bps(&self) -> f64 {
        self.memory.hbm_gbps * 1e9
    }

    /// Bytes/s that a reduce moves alone: cmm's reduce kernel's measured rate where the
    /// profile gives one, else the HBM's.
    pub fn reduce_bps(&self) -> f64 {
        self.memory.reduce_gbps.map_or(self.hbm_bps(), |r| (r * 1e9).min(self.hbm_bps()))
    }

    /// The slower of `compute_s` and `bytes` through the HBM, and the fraction of
    /// `input`'s peak that `flops` then reach (`idle` where no time passes).
    fn roofline(&self, flops: f64, compute_s: f64, bytes: f64, input: DType, idle: f64) -> GemmCost {
        let memory_s = bytes / self.hbm_bps();
        let work_s = compute_s.max(memory_s);
        let efficiency = if work_s > 0.0 { flops / work_s / self.peak_flops(input) } else { idle };
        GemmCost { work_s, efficiency, memory_bound: memory_s > compute_s, bytes, fixed_s: 0.0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_loads_and_every_file_is_builtin() {
        for name in Profile::builtin_names() {
            let p = Profile::load(name).unwrap();
            assert_eq!(p.name, name);
            let from_disk = Profile::from_file(&profiles_dir().join(format!("{name}.toml"))).unwrap();
            assert_eq!(from_disk, p);
        }
        let mut on_disk: Vec<String> = fs::read_dir(profiles_dir())
            .unwrap()
            .filter_map(|e| e.ok()?.path().file_stem().map(|s| s.to_string_lossy().into_owned()))
            .collect();
        on_disk.sort();
        let mut builtin: Vec<String> = Profile::builtin_names().into_iter().map(String::from).collect();
        builtin.sort();
        assert_eq!(on_disk, builtin);
    }

    /// A profile gives the throughputs of 1 to 8 ops at once; the last it gives holds for
    /// more, and none or more than 8 is refused.
    #[test]
    fn concurrent_throughputs_hold_their_last_value_for_more_ops() {
        let base = include_str!("../profiles/h100-one-gpu.toml");
        let with = |gains: &str| {
            Profile::parse(
                &base.replace("launch_us = 2.0", &format!("launch_us = 2.0\nconcurrent_throughput = {gains}")),
                "t",
            )
        };
        let p = with("[1.0, 1.2, 1.3]").unwrap();
        let got: Vec<f64> = (1..=10).map(|ops| p.compute.throughput_with(ops)).collect();
        assert_eq!(got, [1.0, 1.2, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3]);
        let p = with("[1.0, 1.1, 1.1, 1.1, 1.2, 1.2, 1.2, 1.4]").unwrap();
        assert_eq!((p.compute.throughput_with(8), p.compute.throughput_with(64)), (1.4, 1.4));
        for refused in ["[]", "[1.0, 1.1, 1.1, 1.1, 1.2, 1.2, 1.2, 1.4, 1.5]"] {
            let e = with(refused).unwrap_err().to_string();
            assert!(
                e.contains("concurrent_throughput = ") && e.contains("expected 1 to 8 throughputs"),
                "{refused}: {e}"
            );
        }
        // What no profile file gives: no gain.
        assert_eq!(Profile::load("h100-nvlink").unwrap().compute.throughput_with(8), 1.0);
    }

    #[test]
    fn a_number_in_other_units_is_refused_with_the_unit() {
        let base = include_str!("../profiles/h100-nvlink.toml");
        let cases = [
            ("hbm_gbps = 3350.0", "hbm_gbps = 3.35e12", "memory.hbm_gbps", "3.35e12", "bytes/s"),
            ("link_gbps = 450.0", "link_gbps = 1e-300", "interconnect.link_gbps", "1e-300", "GB/s"),
            ("launch_us = 2.0", "launch_us = 2e9", "compute.launch_us", "2e9", "ns"),
            ("f16 = 989.4", "f16 = 9.894e14", "compute.peak_tflops.f16", "9.894e14", "FLOP/s"),
            ("max_efficiency = 0.834", "max_efficiency = 1e-15", "compute.max_efficiency", "1e-15", "at least 10^-12"),
            ("parallel_units = 132", "parallel_units = 4294967296", "compute.parallel_units", "4294967296", "10^6"),
            (
                "launch_us = 2.0",
                "launch_us = 2.0\nconcurrent_throughput = [1.0, 1e-15, 1.0, 1.0]",
                "compute.concurrent_throughput",
                "1e-15",
                "10^-12",
            ),
        ];
        for (from, to, field, value, unit) in cases {
            let text = base.replacen(from, to, 1);
            assert_ne!(text, base, "{from} is not in the profile");
            let e = Profile::parse(&text, "u.toml").unwrap_err();
            let ProfileError::Invalid { field: named, value: shown, reason, .. } = &e else { panic!("{e}") };
            assert_eq!(*named, field, "{e}");
            assert!(shown.contains(value) && reason.contains(unit), "{e}");
        }
    }

    /// At the edges of every range a plan's simulated time stays finite: slow links, a
    /// low efficiency, long latencies and many units on the largest square GEMM a problem
    /// allows (each operand just under 2^32 elements).
    #[test]
    fn the_ranges_keep_simulated_times_finite() {
        let text = include_str!("../profiles/h100-nvlink.toml")
            .replacen("link_gbps = 450.0", &format!("link_gbps = {MIN_RATE}"), 1)
            .replacen("hbm_gbps = 3350.0", &format!("hbm_gbps = {MIN_RATE}"), 1)
            .replace("_gbps = 370.0", &format!("_gbps = {MIN_RATE}"))
            .replacen("f16 = 989.4", &format!("f16 = {MIN_RATE}"), 1)
            .replacen("max_efficiency = 0.834", &format!("max_efficiency = {MIN_FRACTION}"), 1)
            .replacen("launch_us = 2.0", &format!("launch_us = {MAX_TIME_US}"), 1)
            .replacen("remote_round_us = 6.0", &format!("remote_round_us = {MAX_TIME_US}"), 1)
            .replacen("parallel_units = 132", &format!("parallel_units = {MAX_UNITS}"), 1);
        let profile = Profile::parse(&text, "edges.toml").unwrap();
        let problem =
            cmm_core::Problem::new(cmm_core::OpKind::AgGemm, 8, 65528, 65528, 65528, DType::F16, DType::F16).unwrap();
        let plan = cmm_core::build_plan(&problem, cmm_core::Algorithm::Ring).unwrap();
        let report = crate::simulate(&plan, &profile, &crate::SimOptions::default()).unwrap();
        assert!(report.makespan_s.is_finite() && report.makespan_s > 1e6, "{}", report.makespan_s);
    }

    #[test]
    fn a_missing_field_is_named_with_the_file() {
        let text = include_str!("../profiles/h100-nvlink.toml").replace("hbm_gbps = 3350.0", "");
        let e = Profile::parse(&text, "x.toml").unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, ProfileError::Parse { .. }), "{msg}");
        assert!(msg.contains("x.toml") && msg.contains("hbm_gbps"), "{msg}");
    }

    #[test]
    fn an_unknown_field_is_rejected() {
        let text = include_str!("../profiles/h100-nvlink.toml").replace("[memory]", "[memory]\nhbm_tbps = 3.0");
        let msg = Profile::parse(&text, "y.toml").unwrap_err().to_string();
        assert!(msg.contains("y.toml") && msg.contains("hbm_tbps"), "{msg}");
    }

    #[test]
    fn an_impossible_value_names_the_field() {
        let text = include_str!("../profiles/h100-nvlink.toml").replace("link_gbps = 450.0", "link_gbps = -1.0");
        let e = Profile::parse(&text, "z.toml").unwrap_err();
        assert_eq!(
            e,
            ProfileError::Invalid {
                file: "z.toml".into(),
                field: "interconnect.link_gbps",
                value: "-1".into(),
                reason: "must be a finite number above 0"
            }
        );
    }

    #[test]
    fn a_grouped_rate_above_one_names_its_engine() {
        let text = include_str!("../profiles/h100-nvlink.toml")
            .replace("gathered_efficiency = 0.21", "gathered_efficiency = 1.5");
        let e = Profile::parse(&text, "z.toml").unwrap_err();
        let ProfileError::Invalid { field, value, .. } = e else { panic!("{e}") };
        assert_eq!((field, value.as_str()), ("engines.hopper_128x128", "gathered_efficiency = Some(1.5)"));
    }

    #[test]
    fn missing_file_and_unknown_name_are_errors() {
        let e = Profile::load("/nonexistent/p.toml").unwrap_err();
        assert!(matches!(e, ProfileError::Read { ref file, .. } if file == "/nonexistent/p.toml"), "{e}");
        let e = Profile::load("h900").unwrap_err();
        assert!(e.to_string().contains("h100-nvlink"), "{e}");
    }

    #[test]
    fn h100_gemm_matches_its_sources() {
        let p = Profile::load("h100-nvlink").unwrap();
        // BRIEF §7: ~800 TFLOP/s at 8192^3.
        let big = p.gemm_cost(8192, 8192, 8192, DType::F16, DType::F16, false);
        let tflops = 2.0 * 8192f64.powi(3) / big.work_s / 1e12;
        assert!((tflops - 800.0).abs() < 10.0, "{tflops}");
        // Seed 000: 1024x4096x4096 in ~43 µs (a cross-check, not a fit).
        let local = p.gemm_cost(1024, 4096, 4096, DType::F16, DType::F16, false);
        assert!((local.work_s * 1e6 - 43.0).abs() < 2.0, "{}", local.work_s * 1e6);
        // Tiny GEMMs are memory or tile bound and slower per FLOP.
        let tiny = p.gemm_cost(64, 64, 64, DType::F16, DType::F16, false);
        assert!(tiny.efficiency < 0.1, "{}", tiny.efficiency);
    }

    /// A β = 1 GEMM reads C in its epilogue, unhidden: the benches' Σ-GEMMs bound timed
    /// gemm_rs's 1024×4096×4096 GEMMs alone, f32 written fresh (`ring`) and added onto
    /// (`ring_accumulate`), per GEMM: 56.8 and 61.7 µs on the H100 (6581ea8), 56.3 and 58.4
    /// on the H200 (501302d). The model, with its launch, within 3 % of each; without the
    /// read of C, the added ones 8 % (H100) fast.
    #[test]
    fn a_gemm_adding_onto_c_pays_for_reading_it() {
        for (name, fresh, added) in [("h100-one-gpu", 56.8, 61.7), ("h200-one-gpu", 56.3, 58.4)] {
            let p = Profile::load(name).unwrap();
            let time = |accumulate| {
                (p.gemm_cost(1024, 4096, 4096, DType::F16, DType::F32, accumulate).work_s + p.launch_s()) * 1e6
            };
            for (model, measured) in [(time(false), fresh), (time(true), added)] {
                assert!((model / measured - 1.0).abs() < 0.03, "{name}: {model} against {measured}");
            }
            let c_read_us = 1024.0 * 4096.0 * 4.0 / p.hbm_bps() * 1e6;
            assert!((time(true) - time(false) - c_read_us).abs() < 1e-6, "{name}");
        }
    }

    /// A GEMM whose 64 tiles leave the 132 SMs half idle is split along K in two: a full
    /// wave's work as the 128-tile GEMM, at the split-K rate measured on the one-GPU
    /// benches (ring_bidir's GEMMs beside ring's).
    #[test]
    fn a_gemm_split_along_k_runs_at_its_measured_rate() {
        let p = Profile::load("h100-one-gpu").unwrap();
        assert_eq!((p.split_k(1024, 2048, 4096), p.split_k(1024, 4096, 4096)), (2, 1));
        assert_eq!(p.split_k(512, 4096, 4096), 2);
        let launch = p.compute.launch_us;
        let time = |m, n, output, accumulate| p.gemm_cost(m, n, 4096, DType::F16, output, accumulate).work_s * 1e6;
        // Measured alone through cuBLAS (the bench's Σ-GEMMs bound, one H100, 6581ea8):
        // ring_bidir's split GEMM 34.3 µs, ring_accumulate(c=2)'s 38.5, ring's unsplit
        // 1024-row one 56.8; each within 8 % with its launch. Without the fixed cost (a rate
        // alone) the split GEMMs would have been priced near half the unsplit one's.
        let priced = [
            (time(1024, 2048, DType::F16, false), 34.3),
            (time(512, 4096, DType::F32, true), 38.5),
            (time(1024, 4096, DType::F16, false), 56.8),
        ];
        for (model, measured) in priced {
            assert!(((model + launch) / measured - 1.0).abs() < 0.08, "{model} + {launch} against {measured}");
        }
        assert!(p.compute.gemm_overhead_us > 0.0);
        let text = include_str!("../profiles/h100-one-gpu.toml")
            .replace("split_k_efficiency = 1.0", "split_k_efficiency = 1.2");
        let e = Profile::parse(&text, "z.toml").unwrap_err();
        assert!(matches!(e, ProfileError::Invalid { field: "compute.split_k_efficiency", .. }), "{e}");
        let text = include_str!("../profiles/h100-one-gpu.toml").replace("reduce_gbps = 1826.0", "reduce_gbps = 0");
        let e = Profile::parse(&text, "z.toml").unwrap_err();
        assert!(matches!(e, ProfileError::Invalid { field: "memory.reduce_gbps", .. }), "{e}");
        let text =
            include_str!("../profiles/h100-one-gpu.toml").replace("gemm_overhead_us = 12.0", "gemm_overhead_us = -1");
        let e = Profile::parse(&text, "z.toml").unwrap_err();
        assert!(matches!(e, ProfileError::Invalid { field: "compute.gemm_overhead_us", .. }), "{e}");
    }
}
