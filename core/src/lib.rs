//! cmm-core: problems and shardings, plans, the input generator, the f64 oracle and
//! tolerances, the simulator and its cost models. No GPU dependency: every executor builds
//! on this crate.

pub mod algorithms;
pub mod cpu;
pub mod dtype;
pub mod generator;
pub mod mutants;
pub mod oracle;
pub mod plan;
pub mod problem;
pub mod schedule;
pub mod sim;
pub mod timeline;
pub mod tolerance;
pub mod verify;

pub use algorithms::{build_plan, Algorithm, AlgorithmError};
pub use dtype::DType;
pub use generator::Family;
pub use plan::{BufId, BufferDecl, BufferRole, Engine, Op, OpSite, Plan, PlanError, Region, SemId};
pub use problem::{OpKind, Problem, ProblemError, Window};
pub use tolerance::Tolerance;
