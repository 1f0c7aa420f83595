//! cmm-core: problems and shardings (1D rings and 2D meshes), plans, the input generator,
//! the f64 oracle and tolerances, the simulator and its cost models. No GPU dependency:
//! every executor builds on this crate.

pub mod algorithms;
pub mod attention;
pub mod cpu;
pub mod dtype;
pub mod generator;
pub mod linear;
pub mod mesh;
pub mod mutants;
pub mod oracle;
pub mod plan;
pub mod problem;
pub mod schedule;
pub mod sim;
pub mod timeline;
pub mod tolerance;
pub mod verify;
pub mod workload;

pub use algorithms::{build_plan, Algorithm, AlgorithmError};
pub use attention::{AttentionAlgorithm, AttentionError, AttentionProblem, Layout};
pub use dtype::DType;
pub use generator::Family;
pub use linear::{Layer, LinearAlgorithm, LinearError, LinearProblem, Pass};
pub use mesh::{Dataflow, MeshAlgorithm, MeshError, MeshProblem};
pub use plan::{
    AttnState, BufId, BufferDecl, BufferRole, Causal, Engine, Op, OpSite, Plan, PlanError, Pointwise, Region, SemId,
};
pub use problem::{GlobalGemm, OpKind, Problem, ProblemError, ShardedGemm, Window};
pub use tolerance::Tolerance;
pub use workload::{ExpectedOutput, Workload};
