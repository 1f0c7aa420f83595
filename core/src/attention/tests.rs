//! Every attention plan on the CPU twin against the oracle, through the verifier and
//! the hardware-queue check; the bound's derivation exercised on both sides.

use super::*;
use crate::generator::Family;
use crate::plan::Op;
use crate::workload::Workload;

#[allow(clippy::too_many_arguments)]
fn problem(
    d: usize,
    s: usize,
    h: usize,
    hkv: usize,
    dh: usize,
    causal: bool,
    layout: Layout,
    q: Option<usize>,
    dt: DType,
) -> AttentionProblem {
    AttentionProblem::new(d, s, h, hkv, dh, causal, layout, q, dt).unwrap()
}

fn problems() -> Vec<AttentionProblem> {
    let mut v = Vec::new();
    for d in [1, 2, 3, 4] {
        for causal in [false, true] {
            v.push(problem(d, 12 * d, 2, 1, 8, causal, Layout::Contiguous, None, DType::F32));
            v.push(problem(d, 10 * d, 2, 2, 4, causal, Layout::Balanced, None, DType::Bf16));
            // Ragged decode: S mod D ≠ 0 and a key tile that straddles shards.
            v.push(problem(d, 17 * d + 1, 4, 2, 8, causal, Layout::Contiguous, Some(3), DType::F16));
            // Uneven prefill: S not a multiple of D (contiguous) or of 2D (balanced).
            v.push(problem(d, 12 * d + d.saturating_sub(1), 2, 1, 8, causal, Layout::Contiguous, None, DType::F16));
            v.push(problem(d, 10 * d + 1, 2, 2, 4, causal, Layout::Balanced, None, DType::Bf16));
            // Balanced, where a later device holds more rows than device 0.
            v.push(problem(d, 12 * d - 1, 2, 1, 8, causal, Layout::Balanced, None, DType::F32));
        }
    }
    v
}

/// The worst |got − value| / bound over every output of `plan`'s CPU run; panics when
/// an element is outside its bound.
fn check(p: &AttentionProblem, plan: &crate::plan::Plan) -> f64 {
    crate::testing::assert_matches_oracle(plan, p, 5, Family::Realistic)
}

#[test]
fn every_plan_matches_the_oracle_and_passes_the_verifier_and_the_queue_check() {
    for p in problems() {
        for alg in AttentionAlgorithm::ALL.into_iter().filter(|a| a.plans(&p)) {
            let plan = build_attention_plan(&p, alg).unwrap_or_else(|e| panic!("{} {alg}: {e}", p.describe()));
            let bound = super::plans::min_ops(&p);
            assert!(bound <= plan.op_count() as u128, "{}: {bound} ops at least?", plan.name);
            crate::testing::assert_sound(&plan);
            check(&p, &plan);
        }
    }
}

#[test]
fn the_bound_is_met_but_not_vacuous() {
    // f32 output: no final rounding to hide behind, so the derived accumulation and
    // exp terms carry the bound. A correct run uses a visible part of it; dropping
    // one key block is far outside it.
    let p = problem(4, 128, 2, 2, 64, true, Layout::Balanced, None, DType::F32);
    let plan = build_attention_plan(&p, AttentionAlgorithm::Ring).unwrap();
    let used = check(&p, &plan);
    assert!(used > 1e-4 && used < 1.0, "a correct run uses {used} of the bound");
    let mut skipped = plan.clone();
    let lane = &mut skipped.programs[3].lanes[0];
    let second = lane
        .iter()
        .enumerate()
        .filter(|(_, op)| matches!(op, Op::Attend { fresh: false, .. }))
        .map(|(i, _)| i)
        .nth(1)
        .unwrap();
    lane.remove(second);
    let result = std::panic::catch_unwind(|| check(&p, &skipped));
    assert!(result.is_err(), "a skipped key block passed the oracle");
}

#[test]
fn balanced_layout_evens_out_causal_work() {
    let work = |layout| -> Vec<f64> {
        let p = problem(4, 64, 1, 1, 4, true, layout, None, DType::F32);
        (0..4)
            .map(|d| {
                let qs = p.query_chunks(d);
                (0..4)
                    .flat_map(|r| p.kv_chunks(r))
                    .flat_map(|k| qs.iter().map(move |&q| (q, k)))
                    .filter_map(|(q, k)| match p.visibility(q, k) {
                        Visibility::All => Some((q.rows * k.rows) as f64),
                        Visibility::Partial(c) => Some(visible_fraction(&c, q.rows, k.rows) * (q.rows * k.rows) as f64),
                        Visibility::Hidden => None,
                    })
                    .sum()
            })
            .collect()
    };
    let naive = work(Layout::Contiguous);
    let balanced = work(Layout::Balanced);
    assert_eq!(naive.iter().sum::<f64>(), balanced.iter().sum::<f64>());
    assert!(balanced.iter().all(|&w| w == balanced[0]), "{balanced:?}");
    assert!(naive[3] > 6.0 * naive[0], "{naive:?}");
}

#[test]
fn invalid_problems_are_errors_with_the_sizes() {
    let e = AttentionProblem::new(4, 60, 4, 3, 64, false, Layout::Contiguous, None, DType::F16).unwrap_err();
    assert!(e.to_string().contains("3 kv heads do not divide 4"), "{e}");
    let e = AttentionProblem::new(4, 7, 4, 2, 64, true, Layout::Balanced, None, DType::F16).unwrap_err();
    assert!(e.to_string().contains("S=7") && e.to_string().contains("8 chunks"), "{e}");
    let e = AttentionProblem::new(4, 3, 4, 2, 64, true, Layout::Contiguous, None, DType::F16).unwrap_err();
    assert!(matches!(e, AttentionError::TooShort { seq: 3, chunks: 4, .. }), "{e}");
    let e = AttentionProblem::new(4, 36, 4, 2, 512, true, Layout::Contiguous, None, DType::F16).unwrap_err();
    assert!(matches!(e, AttentionError::HeadDim(512)), "{e}");
    let e = AttentionProblem::new(8, 5, 4, 2, 64, true, Layout::Contiguous, Some(1), DType::F16).unwrap_err();
    assert!(e.to_string().contains("D=8"), "{e}");
    let p = problem(2, 8, 2, 2, 4, false, Layout::Contiguous, None, DType::F32);
    assert!(build_attention_plan(&p, AttentionAlgorithm::SplitKv).is_err());
    assert!(p.unsupported_family(Family::Exact).is_some());
}

#[test]
fn online_softmax_handles_empty_tiles_and_states() {
    use super::online::{attend, finish, merge, RowState};
    let mut s = RowState::empty(2);
    attend(&mut s, &[1.0, 0.0], 20, 1.0, |j, _| j as f32, |j, c| (j + c) as f32, |_| false);
    assert_eq!(s, RowState::empty(2));
    let (out, lse) = finish(&s);
    assert_eq!((out, lse), (vec![0.0, 0.0], crate::plan::ATTN_EMPTY_MAX));
    attend(&mut s, &[1.0, 0.0], 20, 1.0, |_, _| 0.0, |j, c| (j + c) as f32, |j| j >= 17);
    let (out, _) = finish(&s);
    assert!((out[0] - 18.0).abs() < 1e-5 && (out[1] - 19.0).abs() < 1e-5, "{out:?}");
    let mut empty = RowState::empty(2);
    merge(&mut empty, &s);
    assert_eq!(empty, s);
    let before = s.clone();
    merge(&mut s, &RowState::empty(2));
    assert_eq!(s, before);
}

/// The layouts, pinned in numbers: the contract the oracle states on its own and the
/// chunks the plans are built from must both say this.
#[test]
fn the_layouts_hold_the_positions_their_definitions_say() {
    let problem = |d, s, layout, queries| problem(d, s, 2, 1, 16, true, layout, queries, DType::F32);
    let positions = |p: &AttentionProblem, d: usize| -> Vec<usize> {
        p.query_chunks(d).iter().flat_map(|c| c.pos..c.pos + c.rows).collect()
    };
    let balanced = problem(2, 8, Layout::Balanced, None);
    assert_eq!(positions(&balanced, 0), [0, 1, 6, 7]);
    assert_eq!(positions(&balanced, 1), [2, 3, 4, 5]);
    assert_eq!(balanced.contract_positions(0), [0, 1, 6, 7]);
    assert_eq!(balanced.contract_positions(1), [2, 3, 4, 5]);
    let contiguous = problem(3, 6, Layout::Contiguous, None);
    for d in 0..3 {
        assert_eq!(positions(&contiguous, d), [2 * d, 2 * d + 1]);
        assert_eq!(contiguous.contract_positions(d), [2 * d, 2 * d + 1]);
    }
    // Decode: every device answers the last T queries; the keys split 4, 3, 3.
    let decode = problem(3, 10, Layout::Contiguous, Some(2));
    for d in 0..3 {
        assert_eq!(positions(&decode, d), [8, 9]);
        assert_eq!(decode.contract_positions(d), [8, 9]);
    }
    let keys: Vec<(usize, usize)> = (0..3).map(|d| (decode.kv_chunks(d)[0].pos, decode.kv_chunks(d)[0].rows)).collect();
    assert_eq!(keys, [(0, 4), (4, 3), (7, 3)]);
    // Uneven prefill, in tensor_split's order: 11 positions on 3 devices are 4, 4, 3;
    // balanced, 11 in 4 chunks are 3, 3, 3, 2, and device 1 holds chunks 1 and 2.
    let contiguous = problem(3, 11, Layout::Contiguous, None);
    assert_eq!(contiguous.contract_positions(2), [8, 9, 10]);
    let balanced = problem(2, 11, Layout::Balanced, None);
    assert_eq!(balanced.contract_positions(0), [0, 1, 2, 9, 10]);
    assert_eq!(balanced.contract_positions(1), [3, 4, 5, 6, 7, 8]);
    for (p, d) in [(contiguous, 3), (balanced, 2)] {
        for dev in 0..d {
            assert_eq!(positions(&p, dev), p.contract_positions(dev), "{} device {dev}", p.describe());
        }
    }
    // And for every shape the corpus uses, the plans' chunks are the contract.
    for d in 1..=8 {
        for layout in [Layout::Contiguous, Layout::Balanced] {
            let p = problem(d, 16 * d, layout, None);
            for dev in 0..d {
                assert_eq!(positions(&p, dev), p.contract_positions(dev), "D={d} {layout:?} device {dev}");
            }
        }
    }
}
