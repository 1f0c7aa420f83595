//! What the executor submits for each lowered command, with every address resolved but
//! no driver involved: kernel launches with their parameters (the `#[repr(C)]` mirrors
//! of the kernels' argument structs), cuBLAS calls, copy-engine copies and stream memory
//! operations. The CUDA executor hands them to the driver; the host twin
//! ([`crate::host`]) runs the same launches of the same kernels on the CPU, so both
//! execute one description of every command.

use cudarc::driver::{DeviceRepr, LaunchConfig};

use cmm_core::generator::Family;
use cmm_core::plan::{BufferRole, Op, Plan};
use cmm_core::DType;

use crate::error::CudaError;
use crate::lower::{
    Command, FusedBlock, FusedGemmCommand, GemmCommand, GemmImpl, HopperKernel, HopperTile, HopperVariant, Loc,
    Lowered, MAX_REDUCE_INPUTS,
};

/// A kernel entry point of `cuda/kernels/*.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `cmm_generate`.
    Generate,
    /// `cmm_fill`.
    Fill,
    /// `cmm_gemm_mma_f16`.
    GemmMmaF16,
    /// `cmm_gemm_mma_bf16`.
    GemmMmaBf16,
    /// `cmm_gemm_simt`.
    GemmSimt,
    /// `cmm_gemm_mma_wide_f16`.
    GemmMmaWideF16,
    /// `cmm_gemm_mma_wide_bf16`.
    GemmMmaWideBf16,
    /// `cmm_fused_gemm_mma_f16`.
    FusedMmaF16,
    /// `cmm_fused_gemm_mma_bf16`.
    FusedMmaBf16,
    /// `cmm_fused_gemm_mma_wide_f16`.
    FusedMmaWideF16,
    /// `cmm_fused_gemm_mma_wide_bf16`.
    FusedMmaWideBf16,
    /// `cmm_fused_gemm_simt`.
    FusedSimt,
    /// `cmm_hopper_gemm_{f16,bf16}_{n256,n128}` (the engine) and the GEMM sweep's
    /// variants of it: shallower (`_s3`, `_s4`) and in clusters of two (`_c2`).
    Hopper {
        /// Its output tile.
        tile: HopperTile,
        /// bf16 operands (else f16).
        bf16: bool,
        /// Which of the tile's kernels.
        variant: HopperVariant,
    },
    /// `cmm_copy2d`.
    Copy2d,
    /// `cmm_reduce`.
    Reduce,
    /// `cmm_pointwise`.
    Pointwise,
    /// `cmm_attend`.
    Attend,
    /// `cmm_attn_state`.
    AttnState,
    /// `cmm_route`.
    Route,
    /// `cmm_grouped_gemm`.
    GroupedGemm,
    /// `cmm_gather_rows`.
    GatherRows,
    /// `cmm_combine`.
    Combine,
    /// `cmm_signal`.
    Signal,
    /// `cmm_wait`.
    Wait,
    /// `cmm_gate`.
    Gate,
}

impl Kernel {
    /// Every kernel.
    pub const ALL: [Kernel; 42] = [
        Kernel::Generate,
        Kernel::Fill,
        Kernel::GemmMmaF16,
        Kernel::GemmMmaBf16,
        Kernel::GemmSimt,
        Kernel::GemmMmaWideF16,
        Kernel::GemmMmaWideBf16,
        Kernel::FusedMmaF16,
        Kernel::FusedMmaBf16,
        Kernel::FusedMmaWideF16,
        Kernel::FusedMmaWideBf16,
        Kernel::FusedSimt,
        Kernel::Hopper { tile: HopperTile::Wide, bf16: false, variant: HopperVariant::Engine },
        Kernel::Hopper { tile: HopperTile::Wide, bf16: true, variant: HopperVariant::Engine },
        Kernel::Hopper { tile: HopperTile::Narrow, bf16: false, variant: HopperVariant::Engine },
        Kernel::Hopper { tile: HopperTile::Narrow, bf16: true, variant: HopperVariant::Engine },
        Kernel::Hopper { tile: HopperTile::Wide, bf16: false, variant: HopperVariant::Shallow },
        Kernel::Hopper { tile: HopperTile::Wide, bf16: true, variant: HopperVariant::Shallow },
        Kernel::Hopper { tile: HopperTile::Narrow, bf16: false, variant: HopperVariant::Shallow },
        Kernel::Hopper { tile: HopperTile::Narrow, bf16: true, variant: HopperVariant::Shallow },
        Kernel::Hopper { tile: HopperTile::Wide, bf16: false, variant: HopperVariant::Pair },
        Kernel::Hopper { tile: HopperTile::Wide, bf16: true, variant: HopperVariant::Pair },
        Kernel::Hopper { tile: HopperTile::Narrow, bf16: false, variant: HopperVariant::Pair },
        Kernel::Hopper { tile: HopperTile::Narrow, bf16: true, variant: HopperVariant::Pair },
        Kernel::Hopper { tile: HopperTile::Narrow, bf16: false, variant: HopperVariant::PingPong },
        Kernel::Hopper { tile: HopperTile::Narrow, bf16: true, variant: HopperVariant::PingPong },
        Kernel::Hopper { tile: HopperTile::Wide, bf16: false, variant: HopperVariant::TmaStore },
        Kernel::Hopper { tile: HopperTile::Wide, bf16: true, variant: HopperVariant::TmaStore },
        Kernel::Hopper { tile: HopperTile::Narrow, bf16: false, variant: HopperVariant::TmaStore },
        Kernel::Hopper { tile: HopperTile::Narrow, bf16: true, variant: HopperVariant::TmaStore },
        Kernel::Copy2d,
        Kernel::Reduce,
        Kernel::Pointwise,
        Kernel::Attend,
        Kernel::AttnState,
        Kernel::Route,
        Kernel::GroupedGemm,
        Kernel::GatherRows,
        Kernel::Combine,
        Kernel::Signal,
        Kernel::Wait,
        Kernel::Gate,
    ];

    /// Its position in [`Kernel::ALL`]: the index of its function in a loaded table.
    pub fn index(self) -> usize {
        Kernel::ALL.iter().position(|k| *k == self).expect("Kernel::ALL lists every kernel (tested)")
    }

    /// The `extern "C"` name.
    pub fn entry(self) -> &'static str {
        match self {
            Kernel::Generate => "cmm_generate",
            Kernel::Fill => "cmm_fill",
            Kernel::GemmMmaF16 => "cmm_gemm_mma_f16",
            Kernel::GemmMmaBf16 => "cmm_gemm_mma_bf16",
            Kernel::GemmSimt => "cmm_gemm_simt",
            Kernel::GemmMmaWideF16 => "cmm_gemm_mma_wide_f16",
            Kernel::GemmMmaWideBf16 => "cmm_gemm_mma_wide_bf16",
            Kernel::FusedMmaF16 => "cmm_fused_gemm_mma_f16",
            Kernel::FusedMmaBf16 => "cmm_fused_gemm_mma_bf16",
            Kernel::FusedMmaWideF16 => "cmm_fused_gemm_mma_wide_f16",
            Kernel::FusedMmaWideBf16 => "cmm_fused_gemm_mma_wide_bf16",
            Kernel::FusedSimt => "cmm_fused_gemm_simt",
            Kernel::Hopper { tile, bf16, variant } => match (tile, variant.on(tile).kernels(), bf16) {
                (HopperTile::Wide, HopperVariant::Engine, false) => "cmm_hopper_gemm_f16_n256",
                (HopperTile::Wide, HopperVariant::Engine, true) => "cmm_hopper_gemm_bf16_n256",
                (HopperTile::Narrow, HopperVariant::Engine, false) => "cmm_hopper_gemm_f16_n128",
                (HopperTile::Narrow, HopperVariant::Engine, true) => "cmm_hopper_gemm_bf16_n128",
                (HopperTile::Wide, HopperVariant::Shallow, false) => "cmm_hopper_gemm_f16_n256_s3",
                (HopperTile::Wide, HopperVariant::Shallow, true) => "cmm_hopper_gemm_bf16_n256_s3",
                (HopperTile::Narrow, HopperVariant::Shallow, false) => "cmm_hopper_gemm_f16_n128_s4",
                (HopperTile::Narrow, HopperVariant::Shallow, true) => "cmm_hopper_gemm_bf16_n128_s4",
                (HopperTile::Wide, HopperVariant::Pair, false) => "cmm_hopper_gemm_f16_n256_c2",
                (HopperTile::Wide, HopperVariant::Pair, true) => "cmm_hopper_gemm_bf16_n256_c2",
                (HopperTile::Narrow, HopperVariant::Pair, false) => "cmm_hopper_gemm_f16_n128_c2",
                (HopperTile::Narrow, HopperVariant::Pair, true) => "cmm_hopper_gemm_bf16_n128_c2",
                (HopperTile::Narrow, HopperVariant::PingPong, false) => "cmm_hopper_gemm_f16_n128_pp",
                (HopperTile::Narrow, HopperVariant::PingPong, true) => "cmm_hopper_gemm_bf16_n128_pp",
                (HopperTile::Wide, HopperVariant::TmaStore, false) => "cmm_hopper_gemm_f16_n256_ts",
                (HopperTile::Wide, HopperVariant::TmaStore, true) => "cmm_hopper_gemm_bf16_n256_ts",
                (HopperTile::Narrow, HopperVariant::TmaStore, false) => "cmm_hopper_gemm_f16_n128_ts",
                (HopperTile::Narrow, HopperVariant::TmaStore, true) => "cmm_hopper_gemm_bf16_n128_ts",
                // `on` and `kernels` give these the engine's kernel.
                (_, HopperVariant::StagedGather | HopperVariant::InKernelGather | HopperVariant::ReaderFence, _)
                | (HopperTile::Wide, HopperVariant::PingPong, _) => unreachable!("{tile:?} {variant:?}: normalised"),
            },
            Kernel::Copy2d => "cmm_copy2d",
            Kernel::Reduce => "cmm_reduce",
            Kernel::Pointwise => "cmm_pointwise",
            Kernel::Attend => "cmm_attend",
            Kernel::AttnState => "cmm_attn_state",
            Kernel::Route => "cmm_route",
            Kernel::GroupedGemm => "cmm_grouped_gemm",
            Kernel::GatherRows => "cmm_gather_rows",
            Kernel::Combine => "cmm_combine",
            Kernel::Signal => "cmm_signal",
            Kernel::Wait => "cmm_wait",
            Kernel::Gate => "cmm_gate",
        }
    }

    /// The kernel file that defines it ([`crate::KERNEL_FILES`]).
    pub fn file(self) -> &'static str {
        crate::KERNEL_FILES
            .iter()
            .find(|f| f.entry_points.contains(&self.entry()))
            .map(|f| f.name)
            .expect("every kernel is an entry point of a kernel file (tested)")
    }

    /// Whether its threads meet at barriers (`__syncthreads`, warp collectives).
    pub fn has_barriers(self) -> bool {
        self.persistent()
            || matches!(
                self,
                Kernel::GemmMmaF16
                    | Kernel::GemmMmaBf16
                    | Kernel::GemmSimt
                    | Kernel::GemmMmaWideF16
                    | Kernel::GemmMmaWideBf16
            )
    }

    /// Whether its blocks wait for each other (all must be resident at once).
    pub fn persistent(self) -> bool {
        matches!(
            self,
            Kernel::FusedMmaF16
                | Kernel::FusedMmaBf16
                | Kernel::FusedSimt
                | Kernel::FusedMmaWideF16
                | Kernel::FusedMmaWideBf16
        ) || self.hopper().is_some()
    }

    /// CTAs of a cluster of its launches (a cluster dimension along x).
    pub fn cluster(self) -> u32 {
        self.hopper().map_or(1, |(_, variant)| variant.cluster())
    }

    /// The tile and variant of a Hopper-engine kernel (`hopper.cu`).
    pub fn hopper(self) -> Option<(HopperTile, HopperVariant)> {
        match self {
            Kernel::Hopper { tile, variant, .. } => Some((tile, variant)),
            _ => None,
        }
    }

    /// Whether it moves data or synchronises rather than computes: a signal, a wait or
    /// an SM copy. The GPU executor launches these at the context's greatest priority
    /// ([`crate::CudaRunOptions::comm_priority`]), so that when SMs free up the block
    /// scheduler hands them to a signal before the next blocks of another stream's GEMM.
    pub fn communicates(self) -> bool {
        matches!(self, Kernel::Signal | Kernel::Wait | Kernel::Copy2d)
    }
}

/// One kernel parameter, passed by value (cuLaunchKernelEx reads it through a pointer).
#[derive(Clone, Debug)]
pub(crate) enum Param {
    U32(u32),
    U64(u64),
    Gemm(GemmArgs),
    Fused(FusedArgs),
    /// Boxed: 448 bytes with two tensor maps.
    Hopper(Box<HopperArgs>),
    Reduce(ReduceInputs),
    Pointwise(PointwiseInputs),
    Attend(AttendArgs),
    AttnState(AttnStateArgs),
    Route(RouteArgs),
    GroupedGemm(GroupedGemmArgs),
    Combine(CombineArgs),
}

impl Param {
    /// The address of the value, as a kernel parameter pointer.
    pub(crate) fn as_ptr(&self) -> *mut std::ffi::c_void {
        fn ptr<T>(value: &T) -> *mut std::ffi::c_void {
            value as *const T as *mut std::ffi::c_void
        }
        match self {
            Param::U32(v) => ptr(v),
            Param::U64(v) => ptr(v),
            Param::Gemm(v) => ptr(v),
            Param::Fused(v) => ptr(v),
            Param::Hopper(v) => ptr(&**v),
            Param::Reduce(v) => ptr(v),
            Param::Pointwise(v) => ptr(v),
            Param::Attend(v) => ptr(v),
            Param::AttnState(v) => ptr(v),
            Param::Route(v) => ptr(v),
            Param::GroupedGemm(v) => ptr(v),
            Param::Combine(v) => ptr(v),
        }
    }
}

/// A kernel launch: entry point, shape and parameters.
#[derive(Clone, Debug)]
pub(crate) struct Launch {
    pub(crate) kernel: Kernel,
    pub(crate) cfg: LaunchConfig,
    pub(crate) params: Vec<Param>,
    /// What it does, for error messages.
    pub(crate) what: &'static str,
}

impl Launch {
    pub(crate) fn new(kernel: Kernel, cfg: LaunchConfig, params: Vec<Param>, what: &'static str) -> Launch {
        Launch { kernel, cfg, params, what }
    }
}

/// One thing to put on a stream.
#[derive(Clone, Debug)]
pub(crate) enum Submission {
    Launch(Launch),
    /// `cublasGemmEx` on the lane's handle.
    Cublas {
        args: GemmArgs,
        dtypes: [DType; 3],
    },
    /// A strided 2D copy (pitches and width in bytes).
    CopyEngine {
        src: u64,
        src_pitch: usize,
        dst: u64,
        dst_pitch: usize,
        width: usize,
        rows: usize,
    },
    /// `cuStreamWriteValue32` (release).
    StreamWrite {
        addr: u64,
        value: u32,
    },
    /// `cuStreamWaitValue32` (≥).
    StreamWait {
        addr: u64,
        value: u32,
    },
}

/// Where a run's memory lives: the element addresses of a plan's buffers and semaphores.
pub(crate) trait Addressing {
    /// The address of an element location.
    fn addr(&self, l: &Loc) -> u64;
    /// The address of semaphore `sem` of `device`.
    fn sem(&self, device: usize, sem: usize) -> u64;
    /// The encoded TMA descriptor of a tensor in this memory (the GPU's driver encodes
    /// it; the host twin has its own format).
    fn tensor_map(&self, spec: &TensorMapSpec) -> Result<TensorMap, CudaError>;
}

/// A TMA tensor map as the Hopper engine asks for it: a 2D tensor of 16-bit elements
/// at `base`, `dims[0]` of them contiguous in a row, rows `stride` bytes apart (and,
/// with `layers`, a 3D one: that many such tensors, that many bytes apart), copied in
/// boxes of `boxed[0]` × `boxed[1]` elements (one layer deep) into shared memory with the
/// 128-byte swizzle, zeros past its edges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorMapSpec {
    /// Byte address of element (0, 0).
    pub base: u64,
    /// f16 or bf16.
    pub dtype: DType,
    /// Elements along the contiguous dimension, then rows.
    pub dims: [u64; 2],
    /// Bytes from one row to the next.
    pub stride: u64,
    /// The box: elements along the contiguous dimension (64: 128 bytes, the swizzle
    /// span), then rows.
    pub boxed: [u32; 2],
    /// A third dimension: its extent and the bytes from one layer to the next (the
    /// grouped GEMM's experts); `None` for a 2D map.
    pub layers: Option<(u64, u64)>,
}

/// An encoded tensor map (`CUtensorMap`: 128 opaque bytes, 64-byte aligned). Mirror of
/// `CmmTensorMap` in cuda/kernels/hopper.cu.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TensorMap(pub [u64; 16]);

/// The host twin's own encoding of a tensor map (the real one is the driver's secret):
/// base, the two dimensions, the row stride, the box, the dtype code, the swizzle span
/// in bytes, the layers and their stride (0, 0 for a 2D map), then a tag. Mirror:
/// `CmmHostTensorMap` in cuda/host/hopper.h.
pub(crate) fn host_tensor_map(spec: &TensorMapSpec) -> TensorMap {
    let mut words = [0u64; 16];
    words[0] = spec.base;
    words[1] = spec.dims[0];
    words[2] = spec.dims[1];
    words[3] = spec.stride;
    words[4] = u64::from(spec.boxed[0]) | (u64::from(spec.boxed[1]) << 32);
    words[5] = u64::from(dtype_code(spec.dtype));
    words[6] = 128;
    if let Some((layers, stride)) = spec.layers {
        words[7] = layers;
        words[8] = stride;
    }
    words[15] = HOST_TENSOR_MAP_TAG;
    TensorMap(words)
}

/// Marks a tensor map encoded by [`host_tensor_map`].
pub(crate) const HOST_TENSOR_MAP_TAG: u64 = 0x636d_6d5f_746d_6170; // "cmm_tmap"

/// Where each of a run's control words lies (the GPU's in mapped host memory, the host
/// twin's in atomics): go, abort, the gate's status, a spare word, then `[why, seen]` per
/// kernel wait.
pub(crate) struct ControlLayout;

impl ControlLayout {
    pub(crate) const GO: usize = 0;
    pub(crate) const ABORT: usize = 1;
    pub(crate) const GATE: usize = 2;
    const FIRST_STATUS: usize = 4;

    /// Words of a run with `waits` kernel waits.
    pub(crate) fn words(waits: usize) -> usize {
        Self::FIRST_STATUS + 2 * waits
    }

    /// The `why` word of wait slot `slot` (`seen` follows it).
    pub(crate) fn status(slot: usize) -> usize {
        Self::FIRST_STATUS + 2 * slot
    }
}

/// The run's control words as kernels see them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunWords {
    /// Status words of wait slot 0 (`[why, seen]`); slot i is 8·i bytes further.
    pub(crate) status: u64,
    /// The abort word.
    pub(crate) abort: u64,
    /// Deadline of one wait.
    pub(crate) wait_timeout_ns: u64,
}

impl RunWords {
    /// The words of a control block whose first word is at byte address `base`.
    pub(crate) fn at(base: u64, wait_timeout: std::time::Duration) -> RunWords {
        let word = |w: usize| base + 4 * w as u64;
        RunWords {
            status: word(ControlLayout::status(0)),
            abort: word(ControlLayout::ABORT),
            wait_timeout_ns: wait_timeout.as_nanos() as u64,
        }
    }

    fn status_word(&self, slot: usize) -> u64 {
        self.status + 8 * slot as u64
    }
}

pub(crate) const ONE_THREAD: LaunchConfig =
    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };

/// The launch shape of a grid-stride elementwise kernel over `count` elements.
pub(crate) fn elementwise(count: usize) -> Option<LaunchConfig> {
    (count > 0).then(|| LaunchConfig {
        grid_dim: (count.div_ceil(256).min(65_535 * 8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub(crate) fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
        // Tables are never decoded (plan validation keeps them out of arithmetic).
        _ => 3,
    }
}

/// The kernel arguments of a GEMM command.
pub(crate) fn gemm_args(at: &impl Addressing, g: &GemmCommand) -> GemmArgs {
    GemmArgs {
        a: at.addr(&g.a),
        b: at.addr(&g.b),
        c: at.addr(&g.c),
        a_stride: g.strides[0],
        b_stride: g.strides[1],
        c_stride: g.strides[2],
        m: g.mnk[0],
        n: g.mnk[1],
        k: g.mnk[2],
        a_dtype: dtype_code(g.dtypes[0]),
        b_dtype: dtype_code(g.dtypes[1]),
        c_dtype: dtype_code(g.dtypes[2]),
        flags: g.trans_a as u32 | (g.trans_b as u32) << 1 | (g.accumulate as u32) << 2,
        pad: 0,
    }
}

/// A GEMM command: a tile-kernel launch (one output tile per block), a Hopper-engine
/// launch (a persistent grid) or a cuBLAS call.
pub(crate) fn gemm_submission(at: &impl Addressing, g: &GemmCommand) -> Result<Submission, CudaError> {
    let args = gemm_args(at, g);
    let (kernel, threads) = match g.imp {
        GemmImpl::Cublas => return Ok(Submission::Cublas { args, dtypes: g.dtypes }),
        GemmImpl::Hopper { tile, ctas, variant: HopperVariant::Pair } => {
            let hopper = hopper_args(at, g, (tile, HopperVariant::Pair))?;
            if hopper.flags & HOPPER_B_N_MAJOR == 0 {
                return Err(CudaError::Unsupported {
                    plan: String::new(),
                    what: format!(
                        "the Hopper engine's clusters of two multicast B's N-major boxes; this GEMM's B is transposed \
                         ({}x{}x{})",
                        g.mnk[0], g.mnk[1], g.mnk[2]
                    ),
                });
            }
            // One cluster per pair of row tiles (the second may be a phantom past M), an
            // even grid of at most the clusters the GPU holds at once (`ctas`, from the
            // driver's occupancy query): a cluster that found no room would run after the
            // others, a tail the sweep would read as the kernel's speed.
            if ctas < 2 {
                return Err(CudaError::Unsupported {
                    plan: String::new(),
                    what: format!(
                        "no cluster of two CTAs of the Hopper engine's {} kernel ({} bytes of shared memory each) \
                         fits on this GPU, by the driver's occupancy query",
                        tile.name(),
                        tile.shared_bytes(HopperVariant::Pair)
                    ),
                });
            }
            let pairs = (hopper.tiles / hopper.tiles_n.max(1)).div_ceil(2) * hopper.tiles_n;
            let grid = (ctas / 2).clamp(1, pairs.max(1)) * 2;
            return Ok(hopper_launch((tile, HopperVariant::Pair), g.dtypes[0], grid, hopper, "a hopper gemm"));
        }
        GemmImpl::Hopper { tile, ctas, variant } => {
            let hopper = hopper_args(at, g, (tile, variant))?;
            return Ok(hopper_launch((tile, variant), g.dtypes[0], ctas.min(hopper.tiles), hopper, "a hopper gemm"));
        }
        GemmImpl::MmaF16 => (Kernel::GemmMmaF16, 128),
        GemmImpl::MmaBf16 => (Kernel::GemmMmaBf16, 128),
        GemmImpl::MmaWideF16 => (Kernel::GemmMmaWideF16, 256),
        GemmImpl::MmaWideBf16 => (Kernel::GemmMmaWideBf16, 256),
        GemmImpl::Simt => (Kernel::GemmSimt, 256),
    };
    let (edge, _) = g.imp.tile_shape();
    let edge = edge as u32;
    let cfg = LaunchConfig {
        grid_dim: (args.n.div_ceil(edge), args.m.div_ceil(edge), 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok(Submission::Launch(Launch::new(kernel, cfg, vec![Param::Gemm(args)], "launching a gemm")))
}

/// Threads of a Hopper-engine CTA: a producer warpgroup and two consumer warpgroups.
pub(crate) const HOPPER_THREADS: u32 = 384;

/// A Hopper-engine GEMM run alone (plain or grouped: no waits inside) on a persistent
/// grid of `ctas` CTAs (at least one).
fn hopper_launch(
    (tile, variant): (HopperTile, HopperVariant),
    input: DType,
    ctas: u32,
    args: HopperArgs,
    what: &'static str,
) -> Submission {
    let cfg = LaunchConfig {
        grid_dim: (ctas.max(1), 1, 1),
        block_dim: (HOPPER_THREADS, 1, 1),
        shared_mem_bytes: tile.shared_bytes(variant),
    };
    Submission::Launch(Launch::new(hopper_kernel(tile, variant, input), cfg, vec![Param::Hopper(Box::new(args))], what))
}

/// Elements of a row of staged gathered rows: K rounded up to 16 bytes of 16-bit
/// elements, the row stride TMA needs.
pub(crate) fn staged_row_elements(k: u32) -> u32 {
    k.next_multiple_of(8)
}

/// `cmm_gather_rows` copying the rows of `grouped` (a grouped GEMM's arguments, its rows
/// gathered) in order to `to`, rows `stride` elements apart: one warp a row. An error
/// where a's or the staging's base or row stride is not a multiple of 16 bytes (the
/// engine's rule asks the same of a: TMA's and `cp.async`'s alignment).
pub(crate) fn gather_rows_launch(grouped: &GroupedGemmArgs, to: u64, stride: u64) -> Result<Submission, CudaError> {
    let bytes = if grouped.a_dtype == 0 { 4 } else { 2 };
    if [grouped.a, grouped.a_stride * bytes, to, stride * bytes].iter().any(|x| x % 16 != 0) {
        return Err(CudaError::Unsupported {
            plan: String::new(),
            what: format!(
                "staging gathered rows from {:#x} (row stride {} elements) to {to:#x} (row stride {stride}): \
                 both need 16-byte bases and row strides",
                grouped.a, grouped.a_stride
            ),
        });
    }
    let args = GroupedGemmArgs { c: to, c_stride: stride, ..*grouped };
    let cfg = elementwise(32 * grouped.rows as usize).expect("a grouped GEMM with rows");
    Ok(Submission::Launch(Launch::new(
        Kernel::GatherRows,
        cfg,
        vec![Param::GroupedGemm(args)],
        "staging gathered rows",
    )))
}

/// The Hopper-engine kernel of a tile, variant and input dtype (f16 unless bf16): the
/// engine's where the tile has no kernel of the variant ([`HopperVariant::on`]).
pub(crate) fn hopper_kernel(tile: HopperTile, variant: HopperVariant, input: DType) -> Kernel {
    Kernel::Hopper { tile, bf16: input == DType::Bf16, variant: variant.on(tile).kernels() }
}

/// `CMM_HOPPER_*` flags of hopper.cu.
const HOPPER_B_N_MAJOR: u32 = 1;
const HOPPER_ACCUMULATE: u32 = 4;
const HOPPER_PAIRS: u32 = 8;
const HOPPER_GROUPED: u32 = 16;
const HOPPER_GATHER: u32 = 32;
const HOPPER_ZERO_UNROUTED: u32 = 64;
const HOPPER_READER_FENCE: u32 = 128;
const HOPPER_STORE_TMA: u32 = 256;

/// The bits of a wgmma shared-memory descriptor besides the start address: the leading
/// and stride byte offsets (in 16-byte units) and the 128-byte swizzle (1 in bits 62–63).
fn descriptor_bits(leading_bytes: u64, stride_bytes: u64) -> u64 {
    ((leading_bytes >> 4) << 16) | ((stride_bytes >> 4) << 32) | (1u64 << 62)
}

/// A K-major stage (rows of 64 elements, 128 bytes, eight-row groups 1024 bytes apart):
/// A's, and B's when B is stored N×K.
fn k_major_descriptor() -> u64 {
    descriptor_bits(16, 1024)
}

/// An N-major stage of B: 64-column boxes of 64 K-rows (8 KiB) side by side, so the
/// next 64 columns are 8 KiB on and the next 8 rows 1 KiB on. `CMM_HOPPER_MN_OFFSETS=swap`
/// swaps the two, to tell on a GPU which reading of the two offsets the hardware has.
fn n_major_descriptor() -> u64 {
    let swap = std::env::var("CMM_HOPPER_MN_OFFSETS").is_ok_and(|v| v.trim() == "swap");
    if swap {
        descriptor_bits(1024, 64 * 128)
    } else {
        descriptor_bits(64 * 128, 1024)
    }
}

/// The tensor map of A (K-major, boxes of 64 × 128) for a block of `rows` rows of `k`
/// elements at `a`, rows `stride` elements apart.
fn hopper_a_map(
    at: &impl Addressing,
    a: &Loc,
    stride: u64,
    [rows, k]: [u32; 2],
    dtype: DType,
) -> Result<TensorMap, CudaError> {
    at.tensor_map(&TensorMapSpec {
        base: at.addr(a),
        dtype,
        dims: [u64::from(k), u64::from(rows)],
        stride: 2 * stride,
        boxed: [64, crate::lower::HOPPER_TILE_M as u32],
        layers: None,
    })
}

/// Whether C leaves a Hopper GEMM through TMA stores: on `variant`'s kernels where they
/// are the TMA-store ones, C is not added onto and TMA's rules allow C (a 16-byte aligned
/// base and row pitch, some rows); else the kernel stores from registers.
fn stores_by_tma(
    at: &impl Addressing,
    variant: HopperVariant,
    accumulate: bool,
    (c, stride, dtype): (&Loc, u64, DType),
    rows: u32,
) -> bool {
    let size = dtype.size_bytes() as u64;
    variant == HopperVariant::TmaStore && !accumulate && at.addr(c) % 16 == 0 && (stride * size) % 16 == 0 && rows > 0
}

/// C's tensor map for the TMA-store kernels' epilogue (boxes of 128 bytes × 64 rows: one
/// consumer warpgroup's rows) and its flag where [`stores_by_tma`]; else none.
fn c_store_map(
    at: &impl Addressing,
    variant: HopperVariant,
    accumulate: bool,
    (c, stride, dtype): (&Loc, u64, DType),
    [rows, n]: [u32; 2],
) -> Result<(TensorMap, u32), CudaError> {
    if !stores_by_tma(at, variant, accumulate, (c, stride, dtype), rows) {
        return Ok((TensorMap::default(), 0));
    }
    let (size, base) = (dtype.size_bytes() as u64, at.addr(c));
    let map = at.tensor_map(&TensorMapSpec {
        base,
        dtype,
        dims: [u64::from(n), u64::from(rows)],
        stride: stride * size,
        boxed: [128 / size as u32, 64],
        layers: None,
    })?;
    Ok((map, HOPPER_STORE_TMA))
}

/// The Hopper engine's arguments for a GEMM command run alone (one block), on `variant`'s
/// kernels.
pub(crate) fn hopper_args(
    at: &impl Addressing,
    g: &GemmCommand,
    (tile, variant): (HopperTile, HopperVariant),
) -> Result<HopperArgs, CudaError> {
    let [m, n, k] = g.mnk;
    let b_map = if g.trans_b {
        TensorMapSpec {
            base: at.addr(&g.b),
            dtype: g.dtypes[1],
            dims: [u64::from(k), u64::from(n)],
            stride: 2 * g.strides[1],
            boxed: [64, tile.columns() as u32],
            layers: None,
        }
    } else {
        TensorMapSpec {
            base: at.addr(&g.b),
            dtype: g.dtypes[1],
            dims: [u64::from(n), u64::from(k)],
            stride: 2 * g.strides[1],
            boxed: [64, 64],
            layers: None,
        }
    };
    let c_bytes = g.dtypes[2].size_bytes() as u64;
    let pairs = at.addr(&g.c) % (2 * c_bytes) == 0 && g.strides[2] % 2 == 0;
    let flags = if g.trans_b { 0 } else { HOPPER_B_N_MAJOR }
        | if g.accumulate { HOPPER_ACCUMULATE } else { 0 }
        | if pairs { HOPPER_PAIRS } else { 0 };
    let tiles_n = n.div_ceil(tile.columns() as u32);
    let tiles = m.div_ceil(crate::lower::HOPPER_TILE_M as u32) * tiles_n;
    let (c_map, store) = c_store_map(at, variant, g.accumulate, (&g.c, g.strides[2], g.dtypes[2]), [m, n])?;
    Ok(HopperArgs {
        b: at.tensor_map(&b_map)?,
        first: HopperBlockArgs {
            a: hopper_a_map(at, &g.a, g.strides[0], [m, k], g.dtypes[0])?,
            c: at.addr(&g.c),
            c_stride: g.strides[2],
            rows: m,
            c_map,
            ..HopperBlockArgs::default()
        },
        timeout_ns: HOPPER_PLAIN_TIMEOUT_NS,
        desc_a: k_major_descriptor(),
        desc_b: if g.trans_b { k_major_descriptor() } else { n_major_descriptor() },
        n,
        k,
        c_dtype: dtype_code(g.dtypes[2]),
        flags: flags | store,
        count: 1,
        tiles,
        tiles_n,
        ..HopperArgs::default()
    })
}

/// The Hopper engine's arguments for a grouped GEMM: A (a's rows are c's: a tensor map;
/// `gathered`, the permutation and the shard's first token: the shard's address for the
/// producer's cp.async copies) and C of every row in `first`, B as a 3D map of the
/// experts' K×N matrices, the tiles left to the kernel, which reads them from the segment
/// offsets; with the reader-fence variant's flag where `variant` is it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn hopper_grouped_args(
    at: &impl Addressing,
    tensors: &[(Loc, u64, DType); 3],
    seg: &Loc,
    gathered: Option<(&(Loc, u64), u32)>,
    zero_unrouted: bool,
    [a_rows, rows, n, k]: [u32; 4],
    [chunks, chunk, group_begin, group_end, experts, slots]: [u32; 6],
    (tile, variant): (HopperTile, HopperVariant),
) -> Result<HopperArgs, CudaError> {
    let [(a, a_stride, input), (b, b_stride, _), (c, c_stride, output)] = *tensors;
    let b_map = TensorMapSpec {
        base: at.addr(&b),
        dtype: input,
        dims: [u64::from(n), u64::from(k)],
        stride: 2 * b_stride,
        boxed: [64, 64],
        layers: Some((u64::from(experts), 2 * b_stride * u64::from(k))),
    };
    let c_bytes = output.size_bytes() as u64;
    let pairs = at.addr(&c) % (2 * c_bytes) == 0 && c_stride % 2 == 0;
    let flags = HOPPER_B_N_MAJOR
        | HOPPER_GROUPED
        | if pairs { HOPPER_PAIRS } else { 0 }
        | if gathered.is_some() { HOPPER_GATHER } else { 0 }
        | if zero_unrouted { HOPPER_ZERO_UNROUTED } else { 0 }
        | if variant == HopperVariant::ReaderFence { HOPPER_READER_FENCE } else { 0 };
    let ((perm, perm_stride), gather_base) = gathered.map_or(((0, 0), 0), |(p, base)| ((at.addr(&p.0), p.1), base));
    let (c_map, store) = c_store_map(at, variant, false, (&c, c_stride, output), [rows, n])?;
    Ok(HopperArgs {
        b: at.tensor_map(&b_map)?,
        first: HopperBlockArgs {
            // Gathered rows are copied by the producer threads, not through a map.
            a: match gathered {
                Some(_) => TensorMap::default(),
                None => hopper_a_map(at, &a, a_stride, [rows, k], input)?,
            },
            c: at.addr(&c),
            c_stride,
            rows,
            c_map,
            ..HopperBlockArgs::default()
        },
        timeout_ns: HOPPER_PLAIN_TIMEOUT_NS,
        desc_a: k_major_descriptor(),
        desc_b: n_major_descriptor(),
        seg: at.addr(seg),
        perm,
        perm_stride,
        a: at.addr(&a),
        a_stride,
        n,
        k,
        c_dtype: dtype_code(output),
        flags: flags | store,
        count: 1,
        tiles_n: n.div_ceil(tile.columns() as u32),
        chunks,
        chunk,
        group_begin,
        group_end,
        experts,
        slots,
        gather_base,
        a_rows,
        ..HopperArgs::default()
    })
}

/// A plain Hopper GEMM has no waits; this bounds its barrier waits (twice it and a
/// second, then the kernel traps rather than hang).
const HOPPER_PLAIN_TIMEOUT_NS: u64 = 10_000_000_000;

/// Byte offsets in a fused GEMM's table: blocks, then waits, signals and control words.
pub(crate) struct FusedLayout {
    pub(crate) waits: u64,
    pub(crate) signals: u64,
    pub(crate) control: u64,
    /// Two u64 the Hopper engine's producers add to ([`FusedWaits`]), 8-byte aligned
    /// after the control words.
    pub(crate) stats: u64,
    pub(crate) bytes: usize,
}

/// What a fused GEMM's CTAs spent in their blocks' waits, as the Hopper engine's
/// producers count it (the tile kernels count nothing: zeros).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FusedWaits {
    /// CTAs that ran.
    pub ctas: u64,
    /// Nanoseconds their producers spent spinning on the waits before their blocks' loads,
    /// summed over the CTAs.
    pub wait_ns: u64,
}

impl FusedWaits {
    /// The words at [`FusedLayout::stats`] of a table read back.
    pub(crate) fn from_words(words: [u64; 2]) -> FusedWaits {
        FusedWaits { ctas: words[0], wait_ns: words[1] }
    }

    /// The share of its CTAs' time that the kernel spent waiting for data, over a run of
    /// `kernel_s` seconds (`None` where nothing was counted).
    pub fn share_of(&self, kernel_s: f64) -> Option<f64> {
        (self.ctas > 0 && kernel_s > 0.0).then(|| self.wait_ns as f64 * 1e-9 / (self.ctas as f64 * kernel_s))
    }
}

impl FusedLayout {
    pub(crate) fn of(f: &FusedGemmCommand) -> FusedLayout {
        let sync = std::mem::size_of::<FusedSyncArgs>();
        let block = match f.gemm.imp {
            GemmImpl::Hopper { .. } => std::mem::size_of::<HopperBlockArgs>(),
            _ => std::mem::size_of::<FusedBlockArgs>(),
        };
        let waits = f.blocks.len() * block;
        let signals = waits + f.waits.len() * sync;
        let control = signals + f.signals.len() * sync;
        // Next tile, blocks released, failed, then per block its tiles done; then the
        // producers' counts (8-byte aligned; the kernel finds them the same way).
        let stats = (control + 4 * (3 + f.blocks.len())).next_multiple_of(8);
        let bytes = stats + 16;
        FusedLayout {
            waits: waits as u64,
            signals: signals as u64,
            control: control as u64,
            stats: stats as u64,
            bytes,
        }
    }
}

/// A fused GEMM's table: blocks, waits and signals resolved to addresses, then zeroed
/// control words ([`FusedLayout`]).
pub(crate) fn fused_table(at: &impl Addressing, f: &FusedGemmCommand) -> Result<Vec<u8>, CudaError> {
    let layout = FusedLayout::of(f);
    let mut bytes: Vec<u8> = Vec::with_capacity(layout.bytes);
    let hopper = matches!(f.gemm.imp, GemmImpl::Hopper { .. });
    for b in &f.blocks {
        if hopper {
            let block = hopper_block(at, f, b)?;
            bytes.extend_from_slice(bytemuck_bytes(&block));
            continue;
        }
        for word in [at.addr(&b.a.0), at.addr(&b.c.0), b.a.1, b.c.1] {
            bytes.extend(word.to_le_bytes());
        }
        for word in [b.rows, b.first_tile, b.waits_end, b.signals.0, b.signals.1, 0] {
            bytes.extend(word.to_le_bytes());
        }
    }
    for &(device, sem, value) in f.waits.iter().chain(&f.signals) {
        bytes.extend(at.sem(device, sem).to_le_bytes());
        bytes.extend(value.to_le_bytes());
        bytes.extend(0u32.to_le_bytes());
    }
    debug_assert_eq!(bytes.len() as u64, layout.control);
    bytes.resize(layout.bytes, 0);
    Ok(bytes)
}

/// One block of a fused run on the Hopper engine, its A's tensor map encoded, and its C's
/// on the TMA-store kernels where C allows ([`c_store_map`]).
fn hopper_block(at: &impl Addressing, f: &FusedGemmCommand, b: &FusedBlock) -> Result<HopperBlockArgs, CudaError> {
    let variant = match f.gemm.imp {
        GemmImpl::Hopper { variant, .. } => variant,
        _ => HopperVariant::Engine,
    };
    let c = (&b.c.0, b.c.1, f.gemm.dtypes[2]);
    let (c_map, _) = c_store_map(at, variant, f.gemm.accumulate, c, [b.rows, f.gemm.mnk[1]])?;
    Ok(HopperBlockArgs {
        a: hopper_a_map(at, &b.a.0, b.a.1, [b.rows, f.gemm.mnk[2]], f.gemm.dtypes[0])?,
        c: at.addr(&b.c.0),
        c_stride: b.c.1,
        rows: b.rows,
        first_tile: b.first_tile,
        waits_end: b.waits_end,
        signals_begin: b.signals.0,
        signals_end: b.signals.1,
        pad: [0; 7],
        c_map,
    })
}

/// The bytes of a `#[repr(C)]` mirror without padding holes.
fn bytemuck_bytes(block: &HopperBlockArgs) -> &[u8] {
    // SAFETY: `HopperBlockArgs` is `#[repr(C, align(64))]` with fields that fill its
    // 320 bytes exactly (checked by `hopper_mirrors_have_the_kernel_sizes`), so every byte
    // is initialised; the slice borrows `block` for its lifetime.
    #[allow(unsafe_code)]
    unsafe {
        std::slice::from_raw_parts(
            (block as *const HopperBlockArgs).cast::<u8>(),
            std::mem::size_of::<HopperBlockArgs>(),
        )
    }
}

/// The persistent kernel of a tile-granular GEMM and its threads per CTA.
pub(crate) fn fused_kernel(f: &FusedGemmCommand) -> (Kernel, u32) {
    match f.gemm.imp {
        GemmImpl::Hopper { tile, variant, .. } => (hopper_kernel(tile, variant, f.gemm.dtypes[0]), HOPPER_THREADS),
        GemmImpl::MmaF16 => (Kernel::FusedMmaF16, 128),
        GemmImpl::MmaBf16 => (Kernel::FusedMmaBf16, 128),
        GemmImpl::MmaWideF16 => (Kernel::FusedMmaWideF16, 256),
        GemmImpl::MmaWideBf16 => (Kernel::FusedMmaWideBf16, 256),
        _ => (Kernel::FusedSimt, 256),
    }
}

/// The launch of a tile-granular GEMM whose table (from [`fused_table`]) is at `table`,
/// with `ctas` blocks (all resident at once, at most one per tile).
pub(crate) fn fused_launch(
    at: &impl Addressing,
    f: &FusedGemmCommand,
    table: u64,
    ctas: u32,
    words: &RunWords,
) -> Result<Launch, CudaError> {
    let layout = FusedLayout::of(f);
    let (kernel, threads) = fused_kernel(f);
    let grid_dim = (ctas.max(1).min(f.tiles.max(1)), 1, 1);
    if let GemmImpl::Hopper { tile, variant, .. } = f.gemm.imp {
        // The blocks' C maps, not the run's (whose C is only the first block's start).
        let mut args = hopper_args(at, &f.gemm, (tile, HopperVariant::Engine))?;
        // TMA stores where every block's C allows them (the table's blocks hold the maps).
        let (accumulate, output) = (f.gemm.accumulate, f.gemm.dtypes[2]);
        if f.blocks.iter().all(|b| stores_by_tma(at, variant, accumulate, (&b.c.0, b.c.1, output), b.rows)) {
            args.flags |= HOPPER_STORE_TMA;
        }
        args.first = hopper_block(at, f, &f.blocks[0])?;
        args.blocks = table;
        args.waits = table + layout.waits;
        args.signals = table + layout.signals;
        args.control = table + layout.control;
        args.status = words.status_word(f.first_slot);
        args.abort = words.abort;
        args.timeout_ns = words.wait_timeout_ns;
        args.count = f.blocks.len() as u32;
        args.tiles = f.tiles;
        args.tiles_n = f.tiles_n;
        let cfg = LaunchConfig { grid_dim, block_dim: (threads, 1, 1), shared_mem_bytes: tile.shared_bytes(variant) };
        return Ok(Launch::new(kernel, cfg, vec![Param::Hopper(Box::new(args))], "a fused hopper gemm"));
    }
    let args = FusedArgs {
        gemm: gemm_args(at, &f.gemm),
        blocks: table,
        waits: table + layout.waits,
        signals: table + layout.signals,
        control: table + layout.control,
        status: words.status_word(f.first_slot),
        abort: words.abort,
        timeout_ns: words.wait_timeout_ns,
        count: f.blocks.len() as u32,
        tiles: f.tiles,
        tiles_n: f.tiles_n,
        pad: 0,
    };
    let cfg = LaunchConfig { grid_dim, block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    Ok(Launch::new(kernel, cfg, vec![Param::Fused(args)], "a fused gemm"))
}

fn tensor(at: &impl Addressing, (loc, stride, dtype): &(Loc, u64, DType)) -> TensorArg {
    TensorArg { base: at.addr(loc), stride: *stride, dtype: dtype_code(*dtype), pad: 0 }
}

/// What one lowered command submits (a fused GEMM: [`fused_launch`]).
pub(crate) fn submissions(
    command: &Command,
    at: &impl Addressing,
    words: &RunWords,
) -> Result<Vec<Submission>, CudaError> {
    let launch = |kernel, cfg: Option<LaunchConfig>, params: Vec<Param>, what| {
        cfg.map(|cfg| Submission::Launch(Launch::new(kernel, cfg, params, what))).into_iter().collect()
    };
    Ok(match command {
        Command::Gemm(g) => vec![gemm_submission(at, g)?],
        Command::FusedGemm(_) => unreachable!("a fused gemm's launch needs its table: fused_launch"),
        Command::CopyEngine { src, src_pitch, dst, dst_pitch, width, rows } => {
            if *rows == 0 || *width == 0 {
                return Ok(Vec::new());
            }
            vec![Submission::CopyEngine {
                src: at.addr(src),
                src_pitch: *src_pitch,
                dst: at.addr(dst),
                dst_pitch: *dst_pitch,
                width: *width,
                rows: *rows,
            }]
        }
        Command::SmCopy { src, src_stride, dst, dst_stride, rows, cols, elem_bytes } => {
            let params = vec![
                Param::U64(at.addr(src)),
                Param::U64(*src_stride),
                Param::U64(at.addr(dst)),
                Param::U64(*dst_stride),
                Param::U32(*rows),
                Param::U32(*cols),
                Param::U32(*elem_bytes),
            ];
            // cmm_copy2d copies 16 bytes a thread where its regions allow it.
            let bytes = *rows as usize * *cols as usize * *elem_bytes as usize;
            launch(Kernel::Copy2d, elementwise(bytes.div_ceil(16)), params, "an SM copy")
        }
        Command::Reduce(e) | Command::Pointwise { target: e, .. } => {
            let packed: Vec<TensorArg> = e.inputs.iter().map(|t| tensor(at, t)).collect();
            let elements = e.rows as usize * e.cols as usize;
            // cmm_reduce sums four elements a thread where its regions allow it.
            let per_thread = if matches!(command, Command::Reduce(_)) { 4 } else { 1 };
            let cfg = elementwise(elements.div_ceil(per_thread));
            let head = [Param::U64(at.addr(&e.out)), Param::U64(e.out_stride), Param::U32(dtype_code(e.out_dtype))];
            let shape = [Param::U32(e.rows), Param::U32(e.cols)];
            if let Command::Pointwise { function, .. } = command {
                let mut inputs = PointwiseInputs::default();
                inputs.inputs.iter_mut().zip(&packed).for_each(|(slot, p)| *slot = *p);
                let params = [&head[..], &shape, &[Param::U32(*function), Param::Pointwise(inputs)]].concat();
                launch(Kernel::Pointwise, cfg, params, "a pointwise kernel")
            } else {
                let mut inputs = ReduceInputs::default();
                inputs.inputs.iter_mut().zip(&packed).for_each(|(slot, p)| *slot = *p);
                let count = Param::U32(packed.len() as u32);
                let params = [&head[..], &shape, &[count, Param::Reduce(inputs)]].concat();
                launch(Kernel::Reduce, cfg, params, "a reduce")
            }
        }
        Command::Attend { tensors, rows, keys, heads, group, head_dim, causal, fresh } => {
            let mut args = AttendArgs {
                rows: *rows,
                keys: *keys,
                heads: *heads,
                group: *group,
                head_dim: *head_dim,
                causal: causal.is_some() as u32,
                q_pos: causal.map_or(0, |c| c.0),
                k_pos: causal.map_or(0, |c| c.1),
                fresh: *fresh as u32,
                scale_bits: cmm_core::plan::attention_scale(*head_dim as usize).to_bits(),
                ..AttendArgs::default()
            };
            for (slot, t) in args.tensors.iter_mut().zip(tensors) {
                *slot = tensor(at, t);
            }
            let cfg = elementwise(*rows as usize * *heads as usize);
            launch(Kernel::Attend, cfg, vec![Param::Attend(args)], "an attention block")
        }
        Command::AttnState { function, tensors, rows, heads, head_dim } => {
            let mut args = AttnStateArgs {
                function: *function,
                rows: *rows,
                heads: *heads,
                head_dim: *head_dim,
                ..AttnStateArgs::default()
            };
            for (slot, t) in args.tensors.iter_mut().zip(tensors) {
                *slot = tensor(at, t);
            }
            let cfg = elementwise(*rows as usize * *heads as usize);
            launch(Kernel::AttnState, cfg, vec![Param::AttnState(args)], "an attention merge or finish")
        }
        Command::Route { ids, seg, perm, inv, sizes } => {
            let [tokens, slots, experts, chunks, capacity, shards] = *sizes;
            let args = RouteArgs {
                ids: at.addr(&ids.0),
                ids_stride: ids.1,
                seg: at.addr(seg),
                perm: at.addr(&perm.0),
                perm_stride: perm.1,
                inv: at.addr(&inv.0),
                inv_stride: inv.1,
                pass: 0,
                tokens,
                slots,
                experts,
                chunks,
                capacity,
                shards,
            };
            let words = (tokens as usize * slots as usize).max(capacity as usize).max((experts * chunks) as usize);
            // Three passes: count, scan, fill.
            (0..3)
                .flat_map(|pass| {
                    let args = RouteArgs { pass, ..args };
                    launch(
                        Kernel::Route,
                        elementwise(words.max(1)),
                        vec![Param::Route(args)],
                        "building routing tables",
                    )
                })
                .collect()
        }
        Command::GroupedGemm { tensors, seg, perm, shape, routing, gather, zero_unrouted, hopper, staged } => {
            let [(a, a_stride, a_dtype), (b, b_stride, b_dtype), (c, c_stride, c_dtype)] = tensors;
            let [a_rows, rows, n, k] = *shape;
            let [chunks, chunk, group_begin, group_end, experts, slots] = *routing;
            let args = GroupedGemmArgs {
                a: at.addr(a),
                a_stride: *a_stride,
                b: at.addr(b),
                b_stride: *b_stride,
                c: at.addr(c),
                c_stride: *c_stride,
                seg: at.addr(seg),
                perm: at.addr(&perm.0),
                perm_stride: perm.1,
                a_dtype: dtype_code(*a_dtype),
                b_dtype: dtype_code(*b_dtype),
                c_dtype: dtype_code(*c_dtype),
                a_rows,
                rows,
                n,
                k,
                chunks,
                chunk,
                group_begin,
                group_end,
                experts,
                slots,
                gather: gather.is_some() as u32,
                gather_base: gather.unwrap_or(0),
                zero_unrouted: *zero_unrouted as u32,
            };
            if let Some((tile, ctas, variant)) = *hopper {
                let mut launches = Vec::new();
                // Staged rows are c's rows in order: the engine loads them as it loads
                // rows that are not gathered.
                let (tensors, shape, gathered) = match staged {
                    Some(to) => {
                        let staging = (*to, u64::from(staged_row_elements(k)), *a_dtype);
                        launches.push(gather_rows_launch(&args, at.addr(to), staging.1)?);
                        ([staging, tensors[1], tensors[2]], [rows, rows, n, k], None)
                    }
                    None => (*tensors, *shape, gather.map(|base| (perm, base))),
                };
                let args =
                    hopper_grouped_args(at, &tensors, seg, gathered, *zero_unrouted, shape, *routing, (tile, variant))?;
                // At most one CTA per tile: every block (each expert's rows, the zero
                // block's) may end in a partial row of tiles.
                let blocks = group_end - group_begin + u32::from(*zero_unrouted);
                let tiles = (rows.div_ceil(crate::lower::HOPPER_TILE_M as u32) + blocks) * args.tiles_n;
                launches.push(hopper_launch((tile, variant), *a_dtype, ctas.min(tiles), args, "a grouped hopper gemm"));
                return Ok(launches);
            }
            let cfg = elementwise(rows as usize * n as usize);
            launch(Kernel::GroupedGemm, cfg, vec![Param::GroupedGemm(args)], "a grouped gemm")
        }
        Command::Combine { tensors, src_rows, shape } => {
            let [(src, src_stride, src_dtype), (w, w_stride, _), (inv, inv_stride, _), (out, out_stride, out_dtype)] =
                tensors;
            let [rows, cols, slots] = *shape;
            let args = CombineArgs {
                src: at.addr(src),
                src_stride: *src_stride,
                w: at.addr(w),
                w_stride: *w_stride,
                inv: at.addr(inv),
                inv_stride: *inv_stride,
                out: at.addr(out),
                out_stride: *out_stride,
                src_dtype: dtype_code(*src_dtype),
                src_rows: *src_rows,
                out_dtype: dtype_code(*out_dtype),
                rows,
                cols,
                slots,
            };
            let cfg = elementwise(rows as usize * cols as usize);
            launch(Kernel::Combine, cfg, vec![Param::Combine(args)], "a top-k combine")
        }
        Command::SignalAdd { device, sem, add } => {
            let params = vec![Param::U64(at.sem(*device, *sem)), Param::U32(*add)];
            launch(Kernel::Signal, Some(ONE_THREAD), params, "a signal")
        }
        Command::SignalWrite { device, sem, value } => {
            vec![Submission::StreamWrite { addr: at.sem(*device, *sem), value: *value }]
        }
        Command::WaitKernel { device, sem, value, slot } => {
            let params = vec![
                Param::U64(at.sem(*device, *sem)),
                Param::U32(*value),
                Param::U64(words.wait_timeout_ns),
                Param::U64(words.status_word(*slot)),
                Param::U64(words.abort),
            ];
            launch(Kernel::Wait, Some(ONE_THREAD), params, "a wait")
        }
        Command::WaitValue { device, sem, value } => {
            vec![Submission::StreamWait { addr: at.sem(*device, *sem), value: *value }]
        }
    })
}

/// The first kernel wait that gave up (deadline or abort), as the error naming its
/// device, lane, semaphore and values; `status(slot)` reads a slot's `[why, seen]`.
pub(crate) fn timed_out_wait(
    plan: &Plan,
    lowered: &Lowered,
    status: impl Fn(usize) -> (u32, u32),
    timeout: std::time::Duration,
) -> Option<CudaError> {
    lowered.wait_slots.iter().enumerate().find_map(|(slot, site)| {
        let (why, seen) = status(slot);
        let Op::Wait { sem, value } = &plan.programs[site.device].lanes[site.lane][site.index] else {
            unreachable!("wait slots point at waits")
        };
        (why != 0).then(|| CudaError::WaitTimeout {
            device: site.device,
            lane: plan.lanes[site.lane].clone(),
            index: site.index,
            semaphore: plan.semaphores[sem.0].clone(),
            awaited: *value,
            current: seen,
            timeout_ms: timeout.as_millis() as u64,
        })
    })
}

/// After an abort, the kernel waits it released, in words (they are what the run was
/// stuck on); `None` if it released none.
pub(crate) fn released_waits(plan: &Plan, lowered: &Lowered, status: impl Fn(usize) -> (u32, u32)) -> Option<String> {
    let released: Vec<String> = lowered
        .wait_slots
        .iter()
        .enumerate()
        .filter(|(slot, _)| status(*slot).0 == 2)
        .map(|(slot, site)| {
            let op = &plan.programs[site.device].lanes[site.lane][site.index];
            format!("{site} `{}` at {}", plan.op_text(op), status(slot).1)
        })
        .collect();
    (!released.is_empty()).then(|| format!("waits released by the abort: {}", released.join("; ")))
}

/// What fills one buffer of device `d` before a run.
#[derive(Clone, Debug)]
pub(crate) enum Fill {
    /// A generator or poison launch.
    Launch(Launch),
    /// Bytes copied from the host (a router's table: routing is data).
    Upload(Vec<u8>),
}

/// How buffer `buffer` of device `d` at address `dst` starts a run, in order: generated
/// inputs, uploaded routing tables, poison everywhere else (nothing for an empty
/// buffer). An uneven shard's input is poisoned whole, then its own rows generated.
pub(crate) fn buffer_fill(plan: &Plan, d: usize, buffer: usize, dst: u64, seed: u32, family: Family) -> Vec<Fill> {
    let b = &plan.buffers[buffer];
    let dtype = dtype_code(b.dtype);
    let Some(cfg) = elementwise(b.len()) else { return Vec::new() };
    if let BufferRole::Router { part, router } = &b.role {
        return vec![Fill::Upload(b.dtype.le_bytes(&router.words(*part, seed, family)))];
    }
    let poison = || {
        let params =
            vec![Param::U64(dst), Param::U32(dtype), Param::U64(b.len() as u64), Param::U32(b.dtype.poison_bits())];
        Fill::Launch(Launch::new(Kernel::Fill, cfg, params, "poisoning a buffer"))
    };
    let Some((tensor, global_cols, origins)) = b.role.generated() else { return vec![poison()] };
    let mut fills: Vec<Fill> = b.device_rows.is_some().then(poison).into_iter().collect();
    let rows = b.rows_on(d);
    if let Some(cfg) = elementwise(rows * b.cols) {
        let (row0, col0) = (origins[d].0 as u32, origins[d].1 as u32);
        let params = [dtype, rows as u32, b.cols as u32, seed, tensor, family.code(), global_cols as u32, row0, col0];
        let params = [vec![Param::U64(dst)], params.map(Param::U32).to_vec()].concat();
        fills.push(Fill::Launch(Launch::new(Kernel::Generate, cfg, params, "generating an input")));
    }
    fills
}

/// Mirror of `CmmGemmArgs` in `cuda/kernels/gemm.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct GemmArgs {
    pub(crate) a: u64,
    pub(crate) b: u64,
    pub(crate) c: u64,
    pub(crate) a_stride: u64,
    pub(crate) b_stride: u64,
    pub(crate) c_stride: u64,
    pub(crate) m: u32,
    pub(crate) n: u32,
    pub(crate) k: u32,
    pub(crate) a_dtype: u32,
    pub(crate) b_dtype: u32,
    pub(crate) c_dtype: u32,
    pub(crate) flags: u32,
    pub(crate) pad: u32,
}

// SAFETY: `GemmArgs` is `#[repr(C)]`, plain old data, and matches `CmmGemmArgs` field for
// field (u64s first, then u32s), so passing it by value as a kernel parameter is sound.
#[allow(unsafe_code)]
unsafe impl DeviceRepr for GemmArgs {}

/// Mirror of `CmmFusedBlock` in `cuda/kernels/gemm.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FusedBlockArgs {
    pub(crate) a: u64,
    pub(crate) c: u64,
    pub(crate) a_stride: u64,
    pub(crate) c_stride: u64,
    pub(crate) rows: u32,
    pub(crate) first_tile: u32,
    pub(crate) waits_end: u32,
    pub(crate) signals_begin: u32,
    pub(crate) signals_end: u32,
    pub(crate) pad: u32,
}

/// Mirror of `CmmFusedSync` in `cuda/kernels/gemm.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FusedSyncArgs {
    pub(crate) sem: u64,
    pub(crate) value: u32,
    pub(crate) pad: u32,
}

/// Mirror of `CmmFusedArgs` in `cuda/kernels/gemm.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FusedArgs {
    pub(crate) gemm: GemmArgs,
    pub(crate) blocks: u64,
    pub(crate) waits: u64,
    pub(crate) signals: u64,
    pub(crate) control: u64,
    pub(crate) status: u64,
    pub(crate) abort: u64,
    pub(crate) timeout_ns: u64,
    pub(crate) count: u32,
    pub(crate) tiles: u32,
    pub(crate) tiles_n: u32,
    pub(crate) pad: u32,
}

// SAFETY: `FusedArgs` is `#[repr(C)]` plain old data matching `CmmFusedArgs` field for
// field (the GEMM's arguments, then u64s, then u32s).
#[allow(unsafe_code)]
unsafe impl DeviceRepr for FusedArgs {}

/// Mirror of `CmmHopperBlock` in `cuda/kernels/hopper.cu`.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct HopperBlockArgs {
    pub(crate) a: TensorMap,
    pub(crate) c: u64,
    pub(crate) c_stride: u64,
    pub(crate) rows: u32,
    pub(crate) first_tile: u32,
    pub(crate) waits_end: u32,
    pub(crate) signals_begin: u32,
    pub(crate) signals_end: u32,
    pub(crate) pad: [u32; 7],
    pub(crate) c_map: TensorMap,
}

/// Mirror of `CmmHopperArgs` in `cuda/kernels/hopper.cu`, passed as a
/// `__grid_constant__` parameter (TMA reads the tensor maps where they lie).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct HopperArgs {
    pub(crate) b: TensorMap,
    pub(crate) first: HopperBlockArgs,
    pub(crate) blocks: u64,
    pub(crate) waits: u64,
    pub(crate) signals: u64,
    pub(crate) control: u64,
    pub(crate) status: u64,
    pub(crate) abort: u64,
    pub(crate) timeout_ns: u64,
    pub(crate) desc_a: u64,
    pub(crate) desc_b: u64,
    pub(crate) seg: u64,
    pub(crate) perm: u64,
    pub(crate) perm_stride: u64,
    pub(crate) a: u64,
    pub(crate) a_stride: u64,
    pub(crate) n: u32,
    pub(crate) k: u32,
    pub(crate) c_dtype: u32,
    pub(crate) flags: u32,
    pub(crate) count: u32,
    pub(crate) tiles: u32,
    pub(crate) tiles_n: u32,
    pub(crate) chunks: u32,
    pub(crate) chunk: u32,
    pub(crate) group_begin: u32,
    pub(crate) group_end: u32,
    pub(crate) experts: u32,
    pub(crate) slots: u32,
    pub(crate) gather_base: u32,
    pub(crate) a_rows: u32,
    pub(crate) pad: [u32; 5],
}

/// Mirror of `CmmTensor` in `cuda/kernels/common.cuh`: a strided tensor of any dtype.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TensorArg {
    pub(crate) base: u64,
    pub(crate) stride: u64,
    pub(crate) dtype: u32,
    pub(crate) pad: u32,
}

/// Mirror of `CmmReduceInputs` in `cuda/kernels/reduce.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ReduceInputs {
    pub(crate) inputs: [TensorArg; MAX_REDUCE_INPUTS],
}

// SAFETY: `#[repr(C)]` plain old data matching `CmmReduceInputs` (four `CmmTensor`).
#[allow(unsafe_code)]
unsafe impl DeviceRepr for ReduceInputs {}

/// Mirror of `CmmPointwiseInputs` in `cuda/kernels/pointwise.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PointwiseInputs {
    pub(crate) inputs: [TensorArg; 2],
}

// SAFETY: `#[repr(C)]` plain old data matching `CmmPointwiseInputs` (two `CmmTensor`).
#[allow(unsafe_code)]
unsafe impl DeviceRepr for PointwiseInputs {}

/// Mirror of `CmmAttendArgs` in `cuda/kernels/attention.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AttendArgs {
    /// q, k, v, max, sum, acc (each a `CmmTensor`).
    pub(crate) tensors: [TensorArg; 6],
    pub(crate) rows: u32,
    pub(crate) keys: u32,
    pub(crate) heads: u32,
    pub(crate) group: u32,
    pub(crate) head_dim: u32,
    pub(crate) causal: u32,
    pub(crate) q_pos: u32,
    pub(crate) k_pos: u32,
    pub(crate) fresh: u32,
    pub(crate) scale_bits: u32,
}

// SAFETY: `#[repr(C)]` plain old data matching `CmmAttendArgs` field for field (six
// 24-byte tensors, then ten u32s).
#[allow(unsafe_code)]
unsafe impl DeviceRepr for AttendArgs {}

/// Mirror of `CmmRouteArgs` in `cuda/kernels/moe.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RouteArgs {
    pub(crate) ids: u64,
    pub(crate) ids_stride: u64,
    pub(crate) seg: u64,
    pub(crate) perm: u64,
    pub(crate) perm_stride: u64,
    pub(crate) inv: u64,
    pub(crate) inv_stride: u64,
    pub(crate) pass: u32,
    pub(crate) tokens: u32,
    pub(crate) slots: u32,
    pub(crate) experts: u32,
    pub(crate) chunks: u32,
    pub(crate) capacity: u32,
    pub(crate) shards: u32,
}

// SAFETY: `#[repr(C)]` plain old data matching `CmmRouteArgs` field for field (seven
// u64s, then seven u32s, padded alike to a multiple of 8 bytes).
#[allow(unsafe_code)]
unsafe impl DeviceRepr for RouteArgs {}

/// Mirror of `CmmGroupedGemmArgs` in `cuda/kernels/moe.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GroupedGemmArgs {
    pub(crate) a: u64,
    pub(crate) a_stride: u64,
    pub(crate) b: u64,
    pub(crate) b_stride: u64,
    pub(crate) c: u64,
    pub(crate) c_stride: u64,
    pub(crate) seg: u64,
    pub(crate) perm: u64,
    pub(crate) perm_stride: u64,
    pub(crate) a_dtype: u32,
    pub(crate) b_dtype: u32,
    pub(crate) c_dtype: u32,
    pub(crate) a_rows: u32,
    pub(crate) rows: u32,
    pub(crate) n: u32,
    pub(crate) k: u32,
    pub(crate) chunks: u32,
    pub(crate) chunk: u32,
    pub(crate) group_begin: u32,
    pub(crate) group_end: u32,
    pub(crate) experts: u32,
    pub(crate) slots: u32,
    pub(crate) gather: u32,
    pub(crate) gather_base: u32,
    pub(crate) zero_unrouted: u32,
}

// SAFETY: `#[repr(C)]` plain old data matching `CmmGroupedGemmArgs` field for field
// (nine u64s, then sixteen u32s).
#[allow(unsafe_code)]
unsafe impl DeviceRepr for GroupedGemmArgs {}

/// Mirror of `CmmCombineArgs` in `cuda/kernels/moe.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CombineArgs {
    pub(crate) src: u64,
    pub(crate) src_stride: u64,
    pub(crate) w: u64,
    pub(crate) w_stride: u64,
    pub(crate) inv: u64,
    pub(crate) inv_stride: u64,
    pub(crate) out: u64,
    pub(crate) out_stride: u64,
    pub(crate) src_dtype: u32,
    pub(crate) src_rows: u32,
    pub(crate) out_dtype: u32,
    pub(crate) rows: u32,
    pub(crate) cols: u32,
    pub(crate) slots: u32,
}

// SAFETY: `#[repr(C)]` plain old data matching `CmmCombineArgs` field for field (eight
// u64s, then six u32s).
#[allow(unsafe_code)]
unsafe impl DeviceRepr for CombineArgs {}

/// Mirror of `CmmAttnStateArgs` in `cuda/kernels/attention.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AttnStateArgs {
    /// from's max, sum, acc; into's max, sum, acc; out; lse.
    pub(crate) tensors: [TensorArg; 8],
    pub(crate) function: u32,
    pub(crate) rows: u32,
    pub(crate) heads: u32,
    pub(crate) head_dim: u32,
}

// SAFETY: `#[repr(C)]` plain old data matching `CmmAttnStateArgs` field for field (eight
// 24-byte tensors, then four u32s).
#[allow(unsafe_code)]
unsafe impl DeviceRepr for AttnStateArgs {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_of_every_kernel_file_is_one_kernel() {
        let mut entries: Vec<&str> = crate::KERNEL_FILES.iter().flat_map(|f| f.entry_points.iter().copied()).collect();
        let mut kernels: Vec<&str> = Kernel::ALL.iter().map(|k| k.entry()).collect();
        entries.sort_unstable();
        kernels.sort_unstable();
        assert_eq!(entries, kernels);
        for (i, k) in Kernel::ALL.iter().enumerate() {
            // Functions are indexed by it: ALL names each kernel once.
            assert_eq!(k.index(), i, "{k:?} is listed twice in Kernel::ALL");
            assert!(crate::KERNEL_FILES.iter().any(|f| f.name == k.file() && f.source.contains(k.entry())));
        }
    }

    #[test]
    fn hopper_mirrors_have_the_kernel_sizes() {
        // CmmTensorMap 128, CmmHopperBlock 320 (its fields, then C's map), CmmHopperArgs 640,
        // as hopper.cu lays them out (and asserts).
        assert_eq!((std::mem::size_of::<TensorMap>(), std::mem::align_of::<TensorMap>()), (128, 64));
        assert_eq!(std::mem::size_of::<HopperBlockArgs>(), 320);
        assert_eq!(std::mem::size_of::<HopperArgs>(), 640);
        assert_eq!(std::mem::offset_of!(HopperBlockArgs, c_map), 192);
        assert_eq!(std::mem::offset_of!(HopperArgs, blocks), 448);
        assert_eq!(std::mem::offset_of!(HopperArgs, seg), 520);
        assert_eq!(std::mem::offset_of!(HopperArgs, n), 560);
        assert_eq!(std::mem::offset_of!(HopperArgs, pad), 620);
    }

    #[test]
    fn kernels_that_use_barriers_say_so() {
        for k in Kernel::ALL {
            let file = crate::KERNEL_FILES.iter().find(|f| f.name == k.file()).unwrap();
            if !file.source.contains("__syncthreads") {
                assert!(!k.has_barriers(), "{k:?}");
            }
        }
        assert!(Kernel::GemmMmaF16.has_barriers() && Kernel::FusedSimt.persistent() && !Kernel::Reduce.has_barriers());
    }
}
