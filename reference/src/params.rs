//! Host mirrors of the WGSL parameter structs. Each is `#[repr(C)]` + `Pod` and must
//! match its shader's struct field for field (all u32, so no implicit padding).

use bytemuck::{Pod, Zeroable};

/// Mirror of `GemmParams` in `shaders/gemm.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct GemmParams {
    pub m: u32,
    pub n: u32,
    pub flags: u32,
    pub k_begin: u32,
    pub k_end: u32,
    pub a_off: u32,
    pub a_stride: u32,
    pub a_dtype: u32,
    pub b_off: u32,
    pub b_stride: u32,
    pub b_dtype: u32,
    pub c_off: u32,
    pub c_stride: u32,
    pub c_dtype: u32,
    pub _pad: [u32; 2],
}

/// `GemmParams::flags` bit: use the transpose of A.
pub const GEMM_TRANS_A: u32 = 1;
/// `GemmParams::flags` bit: use the transpose of B.
pub const GEMM_TRANS_B: u32 = 2;
/// `GemmParams::flags` bit: add to C (f32) instead of overwriting it.
pub const GEMM_ACCUMULATE: u32 = 4;

/// Mirror of `CopyParams` in `shaders/copy.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct CopyParams {
    pub rows: u32,
    pub cols: u32,
    pub row_begin: u32,
    pub src_off: u32,
    pub src_stride: u32,
    pub dst_off: u32,
    pub dst_stride: u32,
    pub _pad: u32,
}

/// Mirror of `ReduceParams` in `shaders/reduce.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct ReduceParams {
    pub rows: u32,
    pub cols: u32,
    pub row_begin: u32,
    pub count: u32,
    pub out_off: u32,
    pub out_stride: u32,
    pub out_dtype: u32,
    pub _pad: u32,
    /// Per input: offset, stride, dtype, unused.
    pub inputs: [[u32; 4]; 4],
}

/// Mirror of `PointwiseParams` in `shaders/pointwise.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct PointwiseParams {
    pub rows: u32,
    pub cols: u32,
    pub row_begin: u32,
    pub function: u32,
    pub out_off: u32,
    pub out_stride: u32,
    pub out_dtype: u32,
    pub _pad: u32,
    /// Per input: offset, stride, dtype, unused.
    pub inputs: [[u32; 4]; 2],
}

/// Mirror of `AttendParams` in `shaders/attend.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct AttendParams {
    pub rows: u32,
    pub heads: u32,
    pub group: u32,
    pub head_dim: u32,
    pub key_begin: u32,
    pub key_end: u32,
    pub fresh: u32,
    pub causal: u32,
    pub q_pos: u32,
    pub k_pos: u32,
    pub scale_bits: u32,
    pub row_begin: u32,
    /// Offset, stride, dtype, unused of q, k, v.
    pub q: [u32; 4],
    pub k: [u32; 4],
    pub v: [u32; 4],
    /// Offset, stride, unused, unused of the state's max, sum and acc.
    pub m: [u32; 4],
    pub l: [u32; 4],
    pub acc: [u32; 4],
}

/// Mirror of `AttnStateParams` in `shaders/attn_state.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct AttnStateParams {
    /// 0: merge `from` into `into`; 1: finish `into` into `out` and `lse`.
    pub function: u32,
    pub rows: u32,
    pub heads: u32,
    pub head_dim: u32,
    pub row_begin: u32,
    pub out_dtype: u32,
    pub _pad: [u32; 2],
    /// Offset, stride, unused, unused of each region.
    pub from_m: [u32; 4],
    pub from_l: [u32; 4],
    pub from_acc: [u32; 4],
    pub into_m: [u32; 4],
    pub into_l: [u32; 4],
    pub into_acc: [u32; 4],
    pub out: [u32; 4],
    pub lse: [u32; 4],
}

/// `AttnStateParams::function` of a merge.
pub const ATTN_MERGE: u32 = 0;
/// `AttnStateParams::function` of a finish.
pub const ATTN_FINISH: u32 = 1;

/// Mirror of `GenerateParams` in `shaders/generate.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct GenerateParams {
    pub rows: u32,
    pub cols: u32,
    pub row_begin: u32,
    pub dst_off: u32,
    pub dtype: u32,
    pub family: u32,
    pub seed: u32,
    pub tensor: u32,
    pub global_cols: u32,
    pub row0: u32,
    pub col0: u32,
    pub _pad: u32,
}

/// Mirror of `RouteParams` in `shaders/route.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct RouteParams {
    pub pass: u32,
    pub tokens: u32,
    pub slots: u32,
    pub experts: u32,
    pub chunks: u32,
    pub capacity: u32,
    pub ids_off: u32,
    pub ids_stride: u32,
    pub seg_off: u32,
    pub perm_off: u32,
    pub perm_stride: u32,
    pub inv_off: u32,
    pub inv_stride: u32,
    pub row_begin: u32,
    pub shards: u32,
    pub _pad: u32,
}

/// Words one row of a route dispatch covers (`ROW` in `shaders/route.wgsl`).
pub const ROUTE_ROW: usize = 4096;

/// Mirror of `GroupedGemmParams` in `shaders/grouped_gemm.wgsl`. Each operand is
/// (word offset, row stride, dtype code, rows).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct GroupedGemmParams {
    pub n: u32,
    pub k: u32,
    pub row_begin: u32,
    pub experts: u32,
    pub a: [u32; 4],
    pub b: [u32; 4],
    pub c: [u32; 4],
    pub seg_off: u32,
    pub perm_off: u32,
    pub perm_stride: u32,
    pub slots: u32,
    pub chunks: u32,
    pub chunk: u32,
    pub group_begin: u32,
    pub group_end: u32,
    pub gather: u32,
    pub gather_base: u32,
    pub zero_unrouted: u32,
    pub _pad: u32,
}

/// Mirror of `CombineParams` in `shaders/combine.wgsl`. Each operand is (word offset,
/// row stride, dtype code, rows).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct CombineParams {
    pub cols: u32,
    pub slots: u32,
    pub row_begin: u32,
    pub _pad: u32,
    pub src: [u32; 4],
    pub weights: [u32; 4],
    pub inv: [u32; 4],
    pub out: [u32; 4],
}

/// Mirror of `SignalParams` in `shaders/signal.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct SignalParams {
    pub word: u32,
    pub add: u32,
    pub _pad: [u32; 2],
}

/// Bytes reserved per dispatch in the parameter buffer for any of the structs above
/// (the usual uniform offset alignment, so it costs no space).
pub const PARAMS_SIZE: u64 = 256;

const _: () = {
    assert!(std::mem::size_of::<GemmParams>() as u64 <= PARAMS_SIZE);
    assert!(std::mem::size_of::<CopyParams>() as u64 <= PARAMS_SIZE);
    assert!(std::mem::size_of::<ReduceParams>() as u64 <= PARAMS_SIZE);
    assert!(std::mem::size_of::<PointwiseParams>() as u64 <= PARAMS_SIZE);
    assert!(std::mem::size_of::<GenerateParams>() as u64 <= PARAMS_SIZE);
    assert!(std::mem::size_of::<AttendParams>() as u64 <= PARAMS_SIZE);
    assert!(std::mem::size_of::<AttnStateParams>() as u64 <= PARAMS_SIZE);
    assert!(std::mem::size_of::<SignalParams>() as u64 <= PARAMS_SIZE);
    assert!(std::mem::size_of::<RouteParams>() as u64 <= PARAMS_SIZE);
    assert!(std::mem::size_of::<GroupedGemmParams>() as u64 <= PARAMS_SIZE);
    assert!(std::mem::size_of::<CombineParams>() as u64 <= PARAMS_SIZE);
};
