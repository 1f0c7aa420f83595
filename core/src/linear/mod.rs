//! The linear-layer family (BRIEF §3.7, seed 004): tensor-parallel linear layers of a
//! transformer in training, forward and backward, over `m` micro-batches, with the
//! weight gradient accumulated into an fp32 `main_grad` (gradient-accumulation fusion).
//!
//! Sizes: S tokens per micro-batch (`m` of a case), H input features (`k`), F output
//! features (`n`). X is S×H, W is H×F, Y = X·W is S×F. With sequence parallelism (SP)
//! activations between layers are sharded by tokens; without, they are replicated.
//!
//! | layer | device d holds | forward | backward |
//! |---|---|---|---|
//! | column | W_d = columns block d of W (H×F/D) | Y_d = AG(X)·W_d (S×F/D); without SP Y_d = X·W_d | dX = RS(dY_d·W_dᵀ) (S/D×H; without SP AllReduce, S×H); main_grad_d += AG(X)ᵀ·dY_d, X gathered again |
//! | row | W_d = rows block d of W (H/D×F), X_d = columns block d of X (S×H/D) | Y = RS(X_d·W_d) (S/D×F; without SP AllReduce, S×F) | dX_d = AG(dY)·W_dᵀ (S×H/D); main_grad_d += X_dᵀ·AG(dY) |
//! | mlp | W1_d (H×F/D), W2_d (F/D×H), both sequence parallel | Z = AG(X)·W1_d, A = GeLU(Z), Y = RS(A·W2_d) | dA = AG(dY)·W2_dᵀ, main_grad2 += Aᵀ·AG(dY), dZ = dA ⊙ GeLU'(Z), dX = RS(dZ·W1_dᵀ), main_grad1 += AG(X)ᵀ·dZ |
//!
//! Every micro-batch j has its own X_j and dY_j; outputs stack the micro-batches by rows
//! (`Y`, `dX`), and each `main_grad` is an accumulator: it starts from a generated fp32
//! value (so a GEMM that overwrote it instead of adding would fail), the wgrad GEMMs add
//! micro-batch 0, 1, … into it in place, and its final value is an output.
//! Activations, gradients and weights share one dtype (f32, f16 or bf16); every
//! intermediate (Z, A, dA, dZ) is rounded to it once, as a framework would store it.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::dtype::DType;
use crate::problem::Window;

mod gelu;
mod oracle;
mod plans;
#[cfg(test)]
mod tests;

pub use gelu::{gelu, gelu_grad, GELU_GRAD_LIPSCHITZ, GELU_LIPSCHITZ};
pub use plans::build_linear_plan;

/// Which layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layer {
    /// Column-parallel linear: W sharded by output features.
    Column,
    /// Row-parallel linear: W sharded by input features.
    Row,
    /// Column-parallel linear → GeLU → row-parallel linear, sequence parallel.
    Mlp,
}

/// Which pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    /// The forward pass.
    Forward,
    /// The backward pass (input gradient and weight gradient).
    Backward,
    /// Forward then backward of every micro-batch (the MLP block).
    Train,
}

names!(Layer, "layer", { Column => "column", Row => "row", Mlp => "mlp" });
names!(Pass, "pass", { Forward => "forward", Backward => "backward", Train => "train" });

/// The most micro-batches a linear problem may have: 2^16. Each has its own input tensors
/// and GEMMs, so the plan grows with them; the bound also keeps the generator's tensor ids
/// (3 + 2 · micro-batches) within 32 bits.
pub const MAX_MICROBATCHES: usize = 1 << 16;

/// Why a linear problem is invalid.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum LinearError {
    /// More micro-batches than [`MAX_MICROBATCHES`].
    #[error("linear {layer}: {microbatches} micro-batches, more than the {MAX_MICROBATCHES} a problem may have (each has its own inputs and GEMMs)")]
    MicroBatches {
        /// The layer.
        layer: Layer,
        /// The count.
        microbatches: usize,
    },
    /// Too many devices.
    #[error("linear {layer}: {count}")]
    Devices {
        /// The layer.
        layer: Layer,
        /// The count (not a `source`: the message already quotes it).
        count: crate::plan::TooManyDevices,
    },
    /// D, the micro-batch count or a size is zero.
    #[error("linear {layer}: {what} is 0")]
    Zero {
        /// The layer.
        layer: Layer,
        /// What is zero.
        what: &'static str,
    },
    /// A size the sharding splits is not a multiple of D.
    #[error("linear {layer}: {dim}={size} is not divisible by D={devices} ({why})")]
    Indivisible {
        /// The layer.
        layer: Layer,
        /// Which size.
        dim: &'static str,
        /// Its value.
        size: usize,
        /// The device count.
        devices: usize,
        /// What splits it.
        why: &'static str,
    },
    /// The pass is not defined for the layer (column and row: forward or backward;
    /// the MLP block: train).
    #[error("linear {layer}: pass `{pass}` is not defined (column and row layers take forward or backward, the mlp block train)")]
    Pass {
        /// The layer.
        layer: Layer,
        /// The pass asked for.
        pass: Pass,
    },
    /// The MLP block is defined with sequence parallelism only.
    #[error("linear mlp: the MLP block is sequence parallel (sp = true)")]
    MlpWithoutSp,
    /// A tensor is too large for the input generator.
    #[error("linear {layer}: tensor {tensor} has {elements} elements, more than the 2^32 the input generator indexes")]
    TooLarge {
        /// The layer.
        layer: Layer,
        /// Which tensor.
        tensor: String,
        /// Its element count.
        elements: u128,
    },
}

/// A validated linear-layer problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LinearProblem {
    /// The layer.
    pub layer: Layer,
    /// The pass.
    pub pass: Pass,
    /// Sequence parallelism.
    pub sp: bool,
    /// Tensor-parallel devices D.
    pub devices: usize,
    /// Micro-batches.
    pub microbatches: usize,
    /// Tokens per micro-batch, S.
    pub tokens: usize,
    /// Input features H (the MLP's hidden size).
    pub hidden: usize,
    /// Output features F (the MLP's inner size).
    pub ffn: usize,
    /// Dtype of activations, gradients and weights (main_grad is f32).
    pub dtype: DType,
}

/// One generated input tensor: its name, generator id, global shape and dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearTensor {
    /// Buffer name in plans (`W`, `X.0`, `dY.1`, `main_grad`, …).
    pub name: String,
    /// Generator tensor id.
    pub id: u32,
    /// Global rows.
    pub rows: usize,
    /// Global columns.
    pub cols: usize,
    /// Element type.
    pub dtype: DType,
}

/// Which input a [`LinearTensor`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tensor {
    /// The weight (W, or W1 of the MLP).
    W1,
    /// W2 of the MLP.
    W2,
    /// X of micro-batch j.
    X(usize),
    /// dY of micro-batch j.
    DY(usize),
    /// The initial main_grad of W (or W1).
    Grad1,
    /// The initial main_grad of W2.
    Grad2,
}

impl LinearProblem {
    /// Validates and builds a problem.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layer: Layer,
        pass: Pass,
        sp: bool,
        devices: usize,
        microbatches: usize,
        tokens: usize,
        hidden: usize,
        ffn: usize,
        dtype: DType,
    ) -> Result<LinearProblem, LinearError> {
        for (value, what) in [
            (devices, "D"),
            (microbatches, "the micro-batch count"),
            (tokens, "S (m)"),
            (hidden, "H (k)"),
            (ffn, "F (n)"),
        ] {
            if value == 0 {
                return Err(LinearError::Zero { layer, what });
            }
        }
        crate::plan::check_device_count(devices as u128).map_err(|count| LinearError::Devices { layer, count })?;
        if microbatches > MAX_MICROBATCHES {
            return Err(LinearError::MicroBatches { layer, microbatches });
        }
        match (layer, pass) {
            (Layer::Mlp, Pass::Train) | (Layer::Column | Layer::Row, Pass::Forward | Pass::Backward) => {}
            _ => return Err(LinearError::Pass { layer, pass }),
        }
        if layer == Layer::Mlp && !sp {
            return Err(LinearError::MlpWithoutSp);
        }
        let split = |dim: &'static str, size: usize, why: &'static str| {
            if size % devices == 0 {
                Ok(())
            } else {
                Err(LinearError::Indivisible { layer, dim, size, devices, why })
            }
        };
        // Sequence parallelism splits the tokens; column layers split F, row layers H.
        if sp || (layer == Layer::Row && pass == Pass::Forward) || (layer == Layer::Column && pass == Pass::Backward) {
            split("S (m)", tokens, "tokens are sharded by sequence, and reduce-scatters split them")?;
        }
        match layer {
            Layer::Column | Layer::Mlp => split("F (n)", ffn, "W's output features are sharded")?,
            Layer::Row => split("H (k)", hidden, "W's input features are sharded")?,
        }
        let p = LinearProblem { layer, pass, sp, devices, microbatches, tokens, hidden, ffn, dtype };
        for t in p.tensors() {
            let elements = t.rows as u128 * t.cols as u128;
            if elements > 1u128 << 32 {
                return Err(LinearError::TooLarge { layer, tensor: t.name, elements });
            }
        }
        Ok(p)
    }

    /// Whether the pass runs the backward.
    pub fn backward(&self) -> bool {
        self.pass != Pass::Forward
    }

    /// Whether the pass runs the forward.
    pub fn forward(&self) -> bool {
        self.pass != Pass::Backward
    }

    /// The generator id of an input.
    pub fn tensor_id(&self, t: Tensor) -> u32 {
        let mb = self.microbatches as u32;
        match t {
            Tensor::W1 => 0,
            Tensor::W2 => 1,
            Tensor::X(j) => 2 + j as u32,
            Tensor::DY(j) => 2 + mb + j as u32,
            Tensor::Grad1 => 2 + 2 * mb,
            Tensor::Grad2 => 3 + 2 * mb,
        }
    }

    /// Every input the pass reads, with its global shape.
    pub fn tensors(&self) -> Vec<LinearTensor> {
        let mlp = self.layer == Layer::Mlp;
        let mut v = vec![Tensor::W1];
        if mlp {
            v.push(Tensor::W2);
        }
        v.extend((0..self.microbatches).map(Tensor::X));
        if self.backward() {
            v.extend((0..self.microbatches).map(Tensor::DY));
            v.push(Tensor::Grad1);
            if mlp {
                v.push(Tensor::Grad2);
            }
        }
        v.into_iter().map(|t| self.tensor(t)).collect()
    }

    /// Input `t` with its name, generator id and global shape.
    pub fn tensor(&self, t: Tensor) -> LinearTensor {
        let (s, h, f, dt) = (self.tokens, self.hidden, self.ffn, self.dtype);
        let mlp = self.layer == Layer::Mlp;
        let (name, rows, cols, dtype) = match t {
            Tensor::W1 => (if mlp { "W1".into() } else { "W".into() }, h, f, dt),
            Tensor::W2 => ("W2".into(), f, h, dt),
            Tensor::X(j) => (format!("X.{j}"), s, h, dt),
            Tensor::DY(j) => (format!("dY.{j}"), s, if mlp { h } else { f }, dt),
            Tensor::Grad1 => (if mlp { "main_grad1".into() } else { "main_grad".into() }, h, f, DType::F32),
            Tensor::Grad2 => ("main_grad2".into(), f, h, DType::F32),
        };
        LinearTensor { name, id: self.tensor_id(t), rows, cols, dtype }
    }

    /// The window of input `t` that device `d` holds.
    pub fn input_window(&self, t: Tensor, d: usize) -> Window {
        let (s, h, f, n) = (self.tokens, self.hidden, self.ffn, self.devices);
        let all = |rows, cols| Window { row0: 0, col0: 0, rows, cols };
        let row_block = |rows: usize, cols| Window { row0: d * rows / n, col0: 0, rows: rows / n, cols };
        let col_block = |rows, cols: usize| Window { row0: 0, col0: d * cols / n, rows, cols: cols / n };
        match (self.layer, t) {
            (Layer::Column | Layer::Mlp, Tensor::W1 | Tensor::Grad1) => col_block(h, f),
            (Layer::Mlp, Tensor::W2 | Tensor::Grad2) => row_block(f, h),
            (Layer::Row, Tensor::W1 | Tensor::Grad1) => row_block(h, f),
            (Layer::Column | Layer::Mlp, Tensor::X(_)) if self.sp => row_block(s, h),
            (Layer::Column | Layer::Mlp, Tensor::X(_)) => all(s, h),
            (Layer::Row, Tensor::X(_)) => col_block(s, h),
            (Layer::Column, Tensor::DY(_)) => col_block(s, f),
            (Layer::Row, Tensor::DY(_)) if self.sp => row_block(s, f),
            (Layer::Row, Tensor::DY(_)) => all(s, f),
            (Layer::Mlp, Tensor::DY(_)) => row_block(s, h),
            (_, Tensor::W2 | Tensor::Grad2) => unreachable!("only the MLP has W2"),
        }
    }

    /// The per-device shape of each output, in the order goldens store them: `(name,
    /// dtype, rows, cols)`; micro-batches are stacked by rows in `Y` and `dX`.
    pub fn outputs(&self) -> Vec<(&'static str, DType, usize, usize)> {
        let (s, h, f, n, mb, dt) = (self.tokens, self.hidden, self.ffn, self.devices, self.microbatches, self.dtype);
        let tokens = |sharded: bool| mb * if sharded { s / n } else { s };
        match (self.layer, self.pass) {
            (Layer::Column, Pass::Forward) => vec![("Y", dt, tokens(false), f / n)],
            (Layer::Column, _) => {
                vec![("dX", dt, tokens(self.sp), h), ("main_grad", DType::F32, h, f / n)]
            }
            (Layer::Row, Pass::Forward) => vec![("Y", dt, tokens(self.sp), f)],
            (Layer::Row, _) => vec![("dX", dt, tokens(false), h / n), ("main_grad", DType::F32, h / n, f)],
            (Layer::Mlp, _) => vec![
                ("Y", dt, tokens(true), h),
                ("dX", dt, tokens(true), h),
                ("main_grad1", DType::F32, h, f / n),
                ("main_grad2", DType::F32, f / n, h),
            ],
        }
    }

    /// FLOPs of the pass over all micro-batches (2 per multiply-add).
    pub fn flops(&self) -> f64 {
        let (s, h, f) = (self.tokens as f64, self.hidden as f64, self.ffn as f64);
        let one = 2.0 * s * h * f;
        let gemms = match (self.layer, self.pass) {
            (Layer::Mlp, _) => 6.0,
            (_, Pass::Forward) => 1.0,
            _ => 2.0,
        };
        gemms * one * self.microbatches as f64
    }

    /// A short description, e.g. `column backward sp D=4 mb=2 S=64 H=32 F=48 bf16`.
    pub fn describe(&self) -> String {
        format!(
            "{} {}{} D={} mb={} S={} H={} F={} {}",
            self.layer,
            self.pass,
            if self.sp { " sp" } else { "" },
            self.devices,
            self.microbatches,
            self.tokens,
            self.hidden,
            self.ffn,
            self.dtype
        )
    }
}

/// A linear-layer algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LinearAlgorithm {
    /// Everything on one lane: each collective whole (ring AllGather / ReduceScatter),
    /// then the GEMMs that need it; no overlap.
    Baseline,
    /// Megatron-LM's order: collectives on a comm lane, the AllGather of X launched
    /// before the dgrad GEMM, the dgrad ReduceScatter (or AllReduce) overlapped with the
    /// wgrad GEMM; forward passes as the baseline.
    Megatron,
    /// Every collective decomposed into ring steps, each overlapped with the GEMM of
    /// the block that already arrived (the ring AG+GEMM and GEMM+RS of BRIEF §4).
    Ring,
}

names!(LinearAlgorithm, "linear algorithm", { Baseline => "baseline", Megatron => "megatron", Ring => "ring" });
