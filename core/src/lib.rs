//! cmm-core: the plan model and what stands on it without running hardware: problems
//! and shardings of every family (1D rings, 2D meshes, linear layers, attention, MoE),
//! plans and plan files, the input generator, the f64 oracles and tolerances, the
//! scheduler, the verifier and mutants, the CPU twin of the reference, and the engine
//! rule the CUDA lowering and the simulator share. No GPU dependency: every executor
//! (the reference, CUDA, the simulator in `cmm-sim`) builds on this crate.

/// `ALL`, `name()`, `Display` and `FromStr` for a fieldless enum from its names, in the
/// order `ALL` lists the variants:
/// `names!(Layer, "layer", { Column => "column", Row => "row" })`.
#[macro_export]
macro_rules! names {
    ($ty:ident, $noun:literal, { $($variant:ident => $name:literal),* $(,)? }) => {
        impl $ty {
            /// Every variant, in the order of its declaration to `names!`.
            pub const ALL: [$ty; [$($ty::$variant),*].len()] = [$($ty::$variant),*];

            /// Name as used in case files and on the command line.
            pub fn name(self) -> &'static str {
                match self { $($ty::$variant => $name),* }
            }
        }
        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }
        impl ::std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($name => Ok($ty::$variant),)*
                    other => Err(format!("unknown {} `{other}` (expected {})", $noun, $crate::one_of(&[$($name),*]))),
                }
            }
        }
    };
}

/// `a`, `a or b`, `a, b or c`.
#[doc(hidden)]
pub fn one_of(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => (*one).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

pub mod algorithms;
pub mod attention;
pub mod cpu;
pub mod dtype;
pub mod emulate;
pub mod engines;
pub mod generator;
pub mod linear;
pub mod mesh;
pub mod moe;
pub mod mutants;
pub mod numeric;
pub mod oracle;
pub mod plan;
pub mod plan_file;
pub mod problem;
pub mod router;
pub mod schedule;
#[cfg(test)]
mod testing;
pub mod tolerance;
pub mod verify;
pub mod workload;

pub use algorithms::{build_plan, build_plan_with, Algorithm, AlgorithmError, BaselineSums};
pub use attention::{AttentionAlgorithm, AttentionError, AttentionProblem, Layout};
pub use dtype::DType;
pub use generator::Family;
pub use linear::{Layer, LinearAlgorithm, LinearError, LinearProblem, Pass};
pub use mesh::{Dataflow, MeshAlgorithm, MeshError, MeshProblem};
pub use moe::{MoeError, MoeOp, MoeProblem, Routing};
pub use plan::{
    AttnState, BufId, BufferDecl, BufferRole, Causal, Engine, Op, OpSite, Plan, PlanError, Pointwise, Region,
    RouteTables, SemId,
};
pub use problem::{GlobalGemm, OpKind, Problem, ProblemError, ShardedGemm, Split, Window};
pub use tolerance::Tolerance;
pub use workload::{ExpectedOutput, Workload};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_print_and_list_the_alternatives() {
        assert_eq!("ring_bidir".parse::<AttentionAlgorithm>(), Ok(AttentionAlgorithm::RingBidir));
        assert_eq!(Layout::Balanced.to_string(), "balanced");
        assert_eq!(
            "x".parse::<LinearAlgorithm>().unwrap_err(),
            "unknown linear algorithm `x` (expected baseline, megatron or ring)"
        );
        assert_eq!("y".parse::<Layer>().unwrap_err(), "unknown layer `y` (expected column, row or mlp)");
        assert_eq!(one_of(&["a"]), "a");
    }
}
