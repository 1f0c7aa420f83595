//! Every linear plan on the CPU twin against the oracle, and through the verifier.

use super::*;
use crate::generator::Family;
use crate::plan::Op;
use crate::workload::Workload;

fn problems() -> Vec<LinearProblem> {
    let mut v = Vec::new();
    for (layer, pass) in [
        (Layer::Column, Pass::Forward),
        (Layer::Column, Pass::Backward),
        (Layer::Row, Pass::Forward),
        (Layer::Row, Pass::Backward),
    ] {
        for sp in [true, false] {
            for (d, mb) in [(1, 1), (2, 2), (3, 1), (4, 3)] {
                v.push(LinearProblem::new(layer, pass, sp, d, mb, 12 * d, 8 * d, 4 * d, DType::Bf16).unwrap());
            }
        }
    }
    for (d, mb) in [(1, 1), (2, 2), (4, 1)] {
        v.push(LinearProblem::new(Layer::Mlp, Pass::Train, true, d, mb, 4 * d, 6 * d, 2 * d, DType::F16).unwrap());
    }
    v
}

/// Runs `plan` on the twin and checks each output against the oracle.
fn check(p: &LinearProblem, alg: LinearAlgorithm, family: Family) {
    let plan = build_linear_plan(p, alg).unwrap_or_else(|e| panic!("{} {alg}: {e}", p.describe()));
    let bound = super::plans::min_ops(p);
    assert!(bound <= plan.op_count() as u128, "{}: {bound} ops at least?", plan.name);
    crate::testing::assert_sound(&plan);
    crate::testing::assert_matches_oracle(&plan, p, 9, family);
}

#[test]
fn every_layer_pass_and_algorithm_matches_the_oracle() {
    for p in problems() {
        for alg in LinearAlgorithm::ALL {
            if p.layer != Layer::Mlp {
                check(&p, alg, Family::Exact);
            }
            check(&p, alg, Family::Realistic);
        }
    }
}

#[test]
fn the_error_bound_is_not_vacuous() {
    // An error the size of a typical element (a wrong block, a lost micro-batch) is far
    // outside the bound of every element.
    let p = LinearProblem::new(Layer::Mlp, Pass::Train, true, 2, 2, 8, 12, 4, DType::Bf16).unwrap();
    for e in Workload::expected(&p, 3, Family::Realistic) {
        let values: Vec<f64> = e.values.iter().flatten().copied().collect();
        let rms = (values.iter().map(|v| v * v).sum::<f64>() / values.len() as f64).sqrt();
        let worst = e.magnitudes.iter().flatten().copied().fold(0.0, f64::max);
        assert!(worst < 0.2 * rms, "{}: bound up to {worst}, rms value {rms}", e.buffer);
    }
}

#[test]
fn invalid_problems_are_typed_errors() {
    let e = LinearProblem::new(Layer::Column, Pass::Forward, true, 3, 1, 8, 8, 6, DType::F32).unwrap_err();
    assert!(matches!(e, LinearError::Indivisible { dim: "S (m)", .. }), "{e}");
    let e = LinearProblem::new(Layer::Row, Pass::Backward, true, 4, 1, 8, 6, 8, DType::F32).unwrap_err();
    assert!(matches!(e, LinearError::Indivisible { dim: "H (k)", .. }), "{e}");
    let e = LinearProblem::new(Layer::Mlp, Pass::Forward, true, 2, 1, 8, 8, 8, DType::F32).unwrap_err();
    assert!(matches!(e, LinearError::Pass { .. }) && e.to_string().contains("mlp block train"), "{e}");
    let e = LinearProblem::new(Layer::Mlp, Pass::Train, false, 2, 1, 8, 8, 8, DType::F32).unwrap_err();
    assert_eq!(e, LinearError::MlpWithoutSp);
    let e = LinearProblem::new(Layer::Column, Pass::Backward, true, 2, 0, 8, 8, 8, DType::F32).unwrap_err();
    assert!(matches!(e, LinearError::Zero { .. }), "{e}");
    let p = LinearProblem::new(Layer::Mlp, Pass::Train, true, 2, 1, 8, 8, 8, DType::F32).unwrap();
    assert!(p.unsupported_family(Family::Exact).is_some() && p.unsupported_family(Family::Realistic).is_none());
}

#[test]
fn megatron_overlaps_the_dgrad_reduce_scatter_with_the_wgrad_gemm() {
    // On the compute lane the wgrad GEMM follows the release of the dgrad partial, and
    // the comm lane's ReduceScatter starts by acquiring it: the two run side by side.
    let p = LinearProblem::new(Layer::Column, Pass::Backward, true, 4, 1, 16, 8, 8, DType::F32).unwrap();
    let plan = build_linear_plan(&p, LinearAlgorithm::Megatron).unwrap();
    let compute = &plan.programs[0].lanes[0];
    let release = compute.iter().position(|op| matches!(op, Op::Signal { .. })).expect("a release");
    assert!(matches!(&compute[release + 1..], [Op::Wait { .. }, Op::Gemm { accumulate: true, .. }]), "{plan}");
    let comm = &plan.programs[0].lanes[1];
    assert!(comm.iter().any(|op| matches!(op, Op::Reduce { .. })), "the ReduceScatter runs on the comm lane");
}

/// From [`crate::algorithms::SUMS_BESIDE_FROM_BYTES`] blocks up (2 MiB of f32 here) the
/// whole ReduceScatters of the baseline and Megatron plans add up on the `sum` lane,
/// beside their copies; below it (every problem of [`problems`]) there is no such lane.
#[test]
fn whole_reductions_sum_beside_their_copies_on_large_blocks() {
    let sums = |plan: &crate::plan::Plan| {
        let lane = plan.lanes.iter().position(|l| l == "sum")?;
        Some(
            plan.programs
                .iter()
                .map(|p| p.lanes[lane].iter().filter(|op| matches!(op, Op::Reduce { .. })).count())
                .min(),
        )
    };
    for p in problems() {
        for alg in [LinearAlgorithm::Baseline, LinearAlgorithm::Megatron] {
            assert_eq!(sums(&build_linear_plan(&p, alg).unwrap()), None, "{} {alg}", p.describe());
        }
    }
    for sp in [true, false] {
        let p = LinearProblem::new(Layer::Column, Pass::Backward, sp, 4, 1, 2048, 1024, 8, DType::F32).unwrap();
        for alg in [LinearAlgorithm::Baseline, LinearAlgorithm::Megatron] {
            let plan = build_linear_plan(&p, alg).unwrap();
            // Two hops of running sums and the final sum, each in two pieces.
            assert_eq!(sums(&plan), Some(Some(6)), "{}", plan.name);
            crate::testing::assert_sound(&plan);
            crate::testing::assert_matches_oracle(&plan, &p, 9, Family::Realistic);
        }
    }
}
