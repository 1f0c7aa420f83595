use super::*;
use crate::cpu;
use crate::generator::Family;
use crate::oracle::{expected_outputs, global_input};
use crate::testing::assert_clean_under;
use DType::*;

const MESHES: [(usize, usize); 8] = [(1, 1), (1, 4), (4, 1), (2, 2), (2, 4), (4, 2), (3, 3), (4, 4)];

fn lcm(a: usize, b: usize) -> usize {
    (1..=a * b).find(|x| x % a == 0 && x % b == 0).unwrap_or(a * b)
}

/// A problem every dataflow and MeshSlice(S=2, B=1) can shard on the mesh, with
/// non-square global shapes and two blocks per slice on every chip.
fn problem(nr: usize, nc: usize, dataflow: Dataflow, input: DType, output: DType) -> MeshProblem {
    let l = lcm(nr, nc);
    MeshProblem::new(nr, nc, dataflow, 4 * l, 6 * l, 4 * l, input, output).unwrap()
}

fn algorithms(p: &MeshProblem) -> Vec<MeshAlgorithm> {
    let mut all = vec![
        MeshAlgorithm::Collective,
        MeshAlgorithm::Summa,
        MeshAlgorithm::MeshSlice { slices: 2, block: 1 },
        MeshAlgorithm::MeshSlice { slices: 1, block: 2 },
    ];
    all.extend(MeshAlgorithm::WANG);
    if p.nr == p.nc {
        all.push(MeshAlgorithm::Cannon);
    }
    all
}

#[test]
fn every_algorithm_and_dataflow_matches_the_oracle_on_the_cpu() {
    for (nr, nc) in MESHES {
        for dataflow in Dataflow::ALL {
            for (input, output) in [(Bf16, F32), (F16, F16)] {
                let p = problem(nr, nc, dataflow, input, output);
                let want = expected_outputs(&p, 21, Family::Exact);
                for alg in algorithms(&p) {
                    let plan = build_mesh_plan(&p, alg).unwrap_or_else(|e| panic!("{alg} {}: {e}", p.shape_string()));
                    let bound = super::plans::min_ops(&p, alg);
                    assert!(bound <= plan.op_count() as u128, "{}: {bound} ops at least?", plan.name);
                    let mem = cpu::run(&plan, 21, Family::Exact).unwrap();
                    let out = plan.output().unwrap();
                    for (dev, dev_mem) in mem.iter().enumerate() {
                        let got: Vec<f64> = dev_mem[out.0].iter().map(|&w| output.decode(w) as f64).collect();
                        let exact: Vec<f64> =
                            want.values[dev].iter().map(|&v| output.decode(output.encode(v as f32)) as f64).collect();
                        assert_eq!(got, exact, "{} device {dev}", plan.name);
                    }
                }
            }
        }
    }
}

#[test]
fn every_plan_is_clean_under_four_interleavings() {
    for (nr, nc) in MESHES {
        for dataflow in Dataflow::ALL {
            let p = problem(nr, nc, dataflow, F32, F32);
            for alg in algorithms(&p) {
                assert_clean_under(&build_mesh_plan(&p, alg).unwrap(), 4);
            }
        }
    }
}

#[test]
fn collective_and_meshslice_traffic_is_the_seed_formula() {
    for (nr, nc) in MESHES {
        for dataflow in Dataflow::ALL {
            for input in [F32, Bf16] {
                let p = problem(nr, nc, dataflow, input, input);
                let (row, col) = p.analytic_traffic();
                for alg in [
                    MeshAlgorithm::Collective,
                    MeshAlgorithm::MeshSlice { slices: 2, block: 1 },
                    MeshAlgorithm::MeshSlice { slices: 2, block: 2 },
                ] {
                    let Ok(plan) = build_mesh_plan(&p, alg) else { continue };
                    let t = mesh_traffic(&plan, nr, nc).unwrap();
                    for d in 0..p.devices() {
                        assert_eq!((t.row[d], t.col[d], t.other[d]), (row, col, 0), "{} device {d}", plan.name);
                    }
                }
            }
        }
    }
    // The numbers themselves, for one case: OS on 2x4, f32, M=32 N=48 K=32: A flows in
    // rows, (4−1)·(32·32·4 B)/8 = 1536 B per chip; B in columns, (2−1)·(32·48·4 B)/8 = 768 B.
    let p = MeshProblem::new(2, 4, Dataflow::Os, 32, 48, 32, F32, F32).unwrap();
    assert_eq!(p.analytic_traffic(), (1536, 768));
    // LS on 4x2 sends f32 partial sums of C within rows: (2−1)·(32·48·4 B)/8 = 768 B.
    let p = MeshProblem::new(4, 2, Dataflow::Ls, 32, 48, 32, Bf16, Bf16).unwrap();
    assert_eq!(p.analytic_traffic(), (768, 3 * 48 * 32 * 2 / 8));
}

/// Every collective of the collective and MeshSlice plans goes both ways round its ring:
/// on a 4 × 4 mesh each chip sends its left and its right neighbour, along both axes, the
/// same bytes (the halves of every block or sum). A ring run one way (as the gathers and
/// sums once were) sends nothing to the right.
#[test]
fn collectives_send_half_of_every_block_each_way_round() {
    for dataflow in Dataflow::ALL {
        let p = MeshProblem::new(4, 4, dataflow, 32, 48, 64, Bf16, Bf16).unwrap();
        for alg in [MeshAlgorithm::Collective, MeshAlgorithm::MeshSlice { slices: 2, block: 2 }] {
            let plan = build_mesh_plan(&p, alg).unwrap();
            let mut sent = std::collections::HashMap::new();
            for (site, op) in plan.ops() {
                if let crate::plan::Op::Copy { src, dst_device, .. } = op {
                    let bytes = src.len() * plan.buffer(src.buf).dtype.size_bytes();
                    *sent.entry((site.device, *dst_device)).or_insert(0) += bytes;
                }
            }
            for d in 0..p.devices() {
                let (i, j) = p.chip(d);
                let bytes = |to: usize| sent.get(&(d, to)).copied().unwrap_or(0);
                let along_row = (bytes(p.device(i, (j + 3) % 4)), bytes(p.device(i, (j + 1) % 4)));
                let along_col = (bytes(p.device((i + 3) % 4, j)), bytes(p.device((i + 1) % 4, j)));
                for (axis, (left, right)) in [("row", along_row), ("column", along_col)] {
                    assert!(
                        left > 0 && left == right,
                        "{} device {d} along its {axis}: {left} B left, {right} B right",
                        plan.name
                    );
                }
            }
        }
    }
}

#[test]
fn other_algorithms_stay_on_mesh_links_and_cannon_pays_for_its_skew() {
    for dataflow in Dataflow::ALL {
        let p = problem(3, 3, dataflow, F32, F32);
        let (row, col) = p.analytic_traffic();
        let total = |alg| {
            let plan = build_mesh_plan(&p, alg).unwrap();
            let t = mesh_traffic(&plan, 3, 3).unwrap();
            assert!(t.other.iter().all(|&x| x == 0), "{}", plan.name);
            t.row.iter().chain(&t.col).sum::<u64>()
        };
        let collective = total(MeshAlgorithm::Collective);
        assert_eq!(collective, 9 * (row + col));
        assert_eq!(total(MeshAlgorithm::Summa), collective, "{dataflow}");
        for wang in MeshAlgorithm::WANG {
            assert_eq!(total(wang), collective, "{wang} {dataflow}");
        }
        assert!(total(MeshAlgorithm::Cannon) > collective, "{dataflow}");
    }
}

/// Partial sums in bf16 on every LS/RS plan: within the oracle's tolerance widened by
/// the wire's roundings, at half the sums' bytes; OS and integer wires are refused, and
/// so is the exact family (rounded sums have no exact answer).
#[test]
fn partial_sums_on_a_narrow_wire_match_the_oracle_at_half_the_bytes() {
    use crate::testing::{assert_matches_oracle, assert_sound};
    use crate::workload::Workload;
    for (nr, nc) in MESHES {
        for dataflow in [Dataflow::Ls, Dataflow::Rs] {
            let wide = problem(nr, nc, dataflow, Bf16, Bf16);
            let p = wide.with_wire(Bf16).unwrap();
            assert!(p.shape_string().ends_with(" wire=bf16"), "{}", p.shape_string());
            assert!(p.unsupported_family(Family::Exact).is_some());
            for alg in algorithms(&p) {
                let plan = build_mesh_plan(&p, alg).unwrap_or_else(|e| panic!("{alg} {}: {e}", p.shape_string()));
                assert_sound(&plan);
                assert_matches_oracle(&plan, &p, 5, Family::Realistic);
                // The bytes of the partial sums a plan sends (from P or a sum in flight).
                let sums = |plan: &crate::plan::Plan| -> usize {
                    plan.ops()
                        .filter_map(|(site, op)| match op {
                            crate::plan::Op::Copy { src, dst_device, .. } if *dst_device != site.device => {
                                let buf = plan.buffer(src.buf);
                                ["P", "send"].contains(&buf.name.as_str()).then(|| src.len() * buf.dtype.size_bytes())
                            }
                            _ => None,
                        })
                        .sum()
                };
                let wide_plan = build_mesh_plan(&wide, alg).unwrap();
                assert_eq!(2 * sums(&plan), sums(&wide_plan), "{}", plan.name);
                assert!(sums(&plan) > 0 || p.reduce_ring() == 1, "{}", plan.name);
            }
        }
    }
    let os = problem(2, 2, Dataflow::Os, Bf16, Bf16);
    let e = os.with_wire(Bf16).unwrap_err();
    assert_eq!(e, MeshError::Wire { dataflow: Dataflow::Os, wire: Bf16 });
    assert!(e.to_string().contains("only the LS and RS dataflows send partial sums"), "{e}");
    assert!(os.with_wire(F32).is_ok());
    let ls = problem(2, 2, Dataflow::Ls, Bf16, Bf16);
    assert!(matches!(ls.with_wire(DType::U32), Err(MeshError::Wire { .. })));
}

#[test]
fn a_plan_on_another_mesh_size_is_an_error() {
    let p = problem(2, 2, Dataflow::Os, F32, F32);
    let plan = build_mesh_plan(&p, MeshAlgorithm::Collective).unwrap();
    assert_eq!(
        mesh_traffic(&plan, 2, 3),
        Err(MeshError::DeviceCount { plan: plan.name.clone(), devices: 4, nr: 2, nc: 3 })
    );
    assert_eq!(mesh_traffic(&plan, 0, 3), Err(MeshError::EmptyMesh { nr: 0, nc: 3 }));
}

#[test]
fn shards_and_outputs_are_blocks_of_the_global_tensors() {
    let p = MeshProblem::new(2, 3, Dataflow::Rs, 12, 9, 8, F32, F32).unwrap();
    // Chip (1, 2) = device 5: A is K×M = 8×12 in (K/Nr)×(M/Nc) = 4×4 blocks.
    assert_eq!(p.input_shard(0, 5), Window { row0: 4, col0: 8, rows: 4, cols: 4 });
    assert_eq!(p.input_shard(1, 5), Window { row0: 4, col0: 6, rows: 4, cols: 3 });
    assert_eq!(p.output_window(5), Window { row0: 6, col0: 6, rows: 6, cols: 3 });
    let p = MeshProblem::new(2, 3, Dataflow::Ls, 4, 12, 9, F32, F32).unwrap();
    assert_eq!(p.input_shard(1, 4), Window { row0: 6, col0: 3, rows: 6, cols: 3 });
}

#[test]
fn the_oracle_uses_the_transposes_of_ls_and_rs() {
    let (seed, family) = (4, Family::Realistic);
    let p = MeshProblem::new(2, 2, Dataflow::Ls, 4, 6, 8, F32, F32).unwrap();
    let (a, b) = (global_input(&p, 0, seed, family), global_input(&p, 1, seed, family));
    let e = expected_outputs(&p, seed, family);
    // Device 3 = chip (1, 1), its (0, 1) is C[2][4] = Σ A[2][k]·B[4][k] (B is N×K).
    let want: f64 = (0..8).map(|k| a[2 * 8 + k] * b[4 * 8 + k]).sum();
    assert_eq!(e.values[3][1], want);
    let p = MeshProblem::new(2, 2, Dataflow::Rs, 4, 6, 8, F32, F32).unwrap();
    let (a, b) = (global_input(&p, 0, seed, family), global_input(&p, 1, seed, family));
    let e = expected_outputs(&p, seed, family);
    // C[2][4] = Σ A[k][2]·B[k][4] (A is K×M).
    let want: f64 = (0..8).map(|k| a[k * 4 + 2] * b[k * 6 + 4]).sum();
    assert_eq!(e.values[3][1], want);
}

#[test]
fn indivisible_dimensions_name_the_dimension_and_the_mesh_axis() {
    let new = |nr, nc, df, m, n, k| MeshProblem::new(nr, nc, df, m, n, k, F32, F32);
    use Dataflow::*;
    let e = new(2, 3, Os, 5, 6, 6).unwrap_err();
    assert!(e.to_string().contains("M=5 is not divisible by Nr=2"), "{e}");
    // (dataflow, M, N, K on a 2×3 mesh) → the dimension, its size and the axis named.
    let indivisible = [
        (Os, 5, 6, 6, "M", 5, "Nr"),
        (Os, 4, 6, 4, "K", 4, "Nc"),
        (Os, 4, 6, 3, "K", 3, "Nr"),
        (Os, 4, 4, 6, "N", 4, "Nc"),
        // LS splits N over both axes (B's rows by Nr, C's columns by Nc), K only by Nc.
        (Ls, 4, 3, 3, "N", 3, "Nr"),
        (Ls, 4, 6, 4, "K", 4, "Nc"),
        // RS splits M over both axes, K only by Nr.
        (Rs, 4, 6, 4, "M", 4, "Nc"),
        (Rs, 6, 6, 3, "K", 3, "Nr"),
    ];
    for (dataflow, m, n, k, dim, size, axis) in indivisible {
        let parts = if axis == "Nr" { 2 } else { 3 };
        assert_eq!(
            new(2, 3, dataflow, m, n, k).unwrap_err(),
            MeshError::Indivisible { dataflow, dim, size, axis, parts },
            "{dataflow} M={m} N={n} K={k}"
        );
    }
    assert!(new(2, 3, Ls, 4, 6, 3).is_ok(), "LS does not split K over Nr");
    assert!(new(2, 3, Rs, 6, 6, 2).is_ok(), "RS does not split K over Nc");
}

#[test]
fn zero_sizes_and_empty_meshes_are_errors() {
    assert_eq!(MeshProblem::new(0, 2, Dataflow::Os, 4, 4, 4, F32, F32), Err(MeshError::EmptyMesh { nr: 0, nc: 2 }));
    assert_eq!(MeshProblem::new(2, 0, Dataflow::Os, 4, 4, 4, F32, F32), Err(MeshError::EmptyMesh { nr: 2, nc: 0 }));
    let e = MeshProblem::new(2, 2, Dataflow::Ls, 4, 0, 4, F32, F32).unwrap_err();
    assert!(matches!(e, MeshError::ZeroDimension { dim: "N", .. }), "{e}");
    assert!(e.to_string().contains("N=0"), "{e}");
    let e = MeshProblem::new(2, 2, Dataflow::Rs, 4, 4, 4, Bf16, F16).unwrap_err();
    assert_eq!(e, MeshError::UnsupportedDtypes { input: Bf16, output: F16 });
    let e = MeshProblem::new(1, 1, Dataflow::Os, 1 << 17, 4, 1 << 16, F32, F32).unwrap_err();
    assert!(matches!(e, MeshError::TooLarge { tensor: "A", .. }), "{e}");
}

#[test]
fn cannon_on_a_non_square_mesh_is_an_error() {
    for dataflow in Dataflow::ALL {
        let p = problem(2, 4, dataflow, F32, F32);
        let e = build_mesh_plan(&p, MeshAlgorithm::Cannon).unwrap_err();
        assert_eq!(e, MeshError::NotSquare { nr: 2, nc: 4 });
        assert!(e.to_string().contains("2x4 is not square"), "{e}");
    }
}

#[test]
fn meshslice_checks_that_s_times_b_divides_both_extents() {
    // OS slices K: K/Nr = 12, K/Nc = 8 on a 2x3 mesh.
    let p = MeshProblem::new(2, 3, Dataflow::Os, 4, 6, 24, F32, F32).unwrap();
    assert!(build_mesh_plan(&p, MeshAlgorithm::MeshSlice { slices: 2, block: 2 }).is_ok());
    let e = build_mesh_plan(&p, MeshAlgorithm::MeshSlice { slices: 3, block: 2 }).unwrap_err();
    assert_eq!(
        e,
        MeshError::SliceIndivisible {
            dataflow: Dataflow::Os,
            dim: "K",
            what: "K/Nc".into(),
            size: 8,
            slices: 3,
            block: 2
        }
    );
    assert!(e.to_string().contains("S·B = 3·2 = 6 does not divide K/Nc=8"), "{e}");
    let e = build_mesh_plan(&p, MeshAlgorithm::MeshSlice { slices: 1, block: 8 }).unwrap_err();
    assert!(matches!(&e, MeshError::SliceIndivisible { what, size: 12, .. } if what == "K/Nr"), "{e}");
    // LS slices N (B's rows per chip N/Nr, C's columns per chip N/Nc); RS slices M.
    let p = MeshProblem::new(2, 3, Dataflow::Ls, 4, 6, 3, F32, F32).unwrap();
    let e = build_mesh_plan(&p, MeshAlgorithm::MeshSlice { slices: 2, block: 1 }).unwrap_err();
    assert!(matches!(&e, MeshError::SliceIndivisible { dim: "N", what, size: 3, .. } if what == "N/Nr"), "{e}");
    let p = MeshProblem::new(2, 3, Dataflow::Rs, 12, 6, 2, F32, F32).unwrap();
    let e = build_mesh_plan(&p, MeshAlgorithm::MeshSlice { slices: 4, block: 1 }).unwrap_err();
    assert!(matches!(&e, MeshError::SliceIndivisible { dim: "M", what, size: 6, .. } if what == "M/Nr"), "{e}");
    for (slices, block) in [(0, 1), (2, 0)] {
        let e = build_mesh_plan(&p, MeshAlgorithm::MeshSlice { slices, block }).unwrap_err();
        assert_eq!(e, MeshError::ZeroSlicing { slices, block });
    }
    // S·B past usize (it wrapped to 0 and divided by it): indivisible, with the true product.
    let e = build_mesh_plan(&p, MeshAlgorithm::MeshSlice { slices: 4, block: 1 << 62 }).unwrap_err();
    assert!(matches!(e, MeshError::SliceIndivisible { .. }), "{e}");
    assert!(e.to_string().contains("= 4·4611686018427387904 = 18446744073709551616 does not divide"), "{e}");
}

#[test]
fn algorithm_names_parse_with_their_parameters() {
    assert_eq!(
        MeshAlgorithm::parse("meshslice", Some(2), Some(4)),
        Ok(MeshAlgorithm::MeshSlice { slices: 2, block: 4 })
    );
    assert_eq!(MeshAlgorithm::MeshSlice { slices: 2, block: 4 }.to_string(), "meshslice(S=2,B=4)");
    assert_eq!(
        MeshAlgorithm::parse("meshslice", Some(2), None),
        Err(MeshError::MissingParameter { algorithm: "meshslice", parameter: "block" })
    );
    assert_eq!(
        MeshAlgorithm::parse("cannon", None, Some(2)),
        Err(MeshError::UnexpectedParameter { algorithm: "cannon", parameter: "block" })
    );
    assert!(matches!(MeshAlgorithm::parse("fox", None, None), Err(MeshError::UnknownAlgorithm { .. })));
    // Wang's four variants: each (direction, ways round) once, by name.
    assert_eq!(
        MeshAlgorithm::parse("wang_columns_bidir", None, None),
        Ok(MeshAlgorithm::Wang { ring: WangRing::Columns, bidir: true })
    );
    assert_eq!(
        MeshAlgorithm::parse("wang", None, None),
        Ok(MeshAlgorithm::Wang { ring: WangRing::Rows, bidir: false })
    );
    assert_eq!(
        MeshAlgorithm::parse("wang_bidir", Some(2), None),
        Err(MeshError::UnexpectedParameter { algorithm: "wang_bidir", parameter: "slices" })
    );
    let e = MeshAlgorithm::parse("wang_rows", None, None).unwrap_err();
    assert!(e.to_string().contains("wang, wang_bidir, wang_columns, wang_columns_bidir"), "{e}");
    let variants: std::collections::HashSet<MeshAlgorithm> = MeshAlgorithm::WANG.into_iter().collect();
    assert_eq!(variants.len(), 4);
    for name in MeshAlgorithm::NAMES {
        let parsed = MeshAlgorithm::parse(name, (name == "meshslice").then_some(1), (name == "meshslice").then_some(1));
        assert_eq!(parsed.map(MeshAlgorithm::name), Ok(name));
    }
    assert_eq!("rs".parse::<Dataflow>(), Ok(Dataflow::Rs));
    assert!("xs".parse::<Dataflow>().is_err());
}

/// The equivalence rules of `crate::mutants` that mesh plans rely on are sound here: every
/// mutant they exclude is clean under the verifier and computes the same outputs.
#[test]
fn mutants_excluded_by_the_slot_and_accumulation_rules_change_nothing() {
    use crate::mutants::{mutants, MutationKind};
    let mut checked = [0usize; 2];
    let cases = [
        (2, 4, Dataflow::Ls, MeshAlgorithm::MeshSlice { slices: 3, block: 1 }),
        (4, 2, Dataflow::Rs, MeshAlgorithm::MeshSlice { slices: 4, block: 1 }),
        (3, 3, Dataflow::Rs, MeshAlgorithm::Summa),
        (2, 2, Dataflow::Os, MeshAlgorithm::Summa),
        (1, 4, Dataflow::Os, MeshAlgorithm::Summa),
        (4, 1, Dataflow::Os, MeshAlgorithm::Summa),
    ];
    for (nr, nc, dataflow, alg) in cases {
        let l = lcm(nr, nc);
        let p = MeshProblem::new(nr, nc, dataflow, 8 * l, 12 * l, 8 * l, Bf16, F32).unwrap();
        let plan = build_mesh_plan(&p, alg).unwrap();
        let original = cpu::run(&plan, 9, Family::Realistic).unwrap();
        let out = plan.output().unwrap().0;
        for m in mutants(&plan, &[0, plan.devices - 1]) {
            let rule = match (m.kind, m.equivalent) {
                (MutationKind::ShrinkScratch, Some(_)) => 0,
                (MutationKind::SwapAdjacent, Some(reason)) if reason.contains("accumulating") => 1,
                _ => continue,
            };
            checked[rule] += 1;
            assert_clean_under(&m.plan, 4);
            let got = cpu::run(&m.plan, 9, Family::Realistic).unwrap();
            for (d, (g, o)) in got.iter().zip(&original).enumerate() {
                let close = g[out].iter().zip(&o[out]).all(|(&x, &y)| {
                    let (x, y) = (f32::from_bits(x), f32::from_bits(y));
                    if rule == 0 {
                        x.to_bits() == y.to_bits()
                    } else {
                        (x - y).abs() <= 1e-5 * y.abs().max(1.0)
                    }
                });
                assert!(close, "{} device {d}", m.plan.name);
            }
        }
    }
    assert!(checked[0] > 0 && checked[1] > 0, "{checked:?}");
}

#[test]
fn simulation_only_problems_skip_the_generator_limit_but_their_plans_cannot_execute() {
    let p = MeshProblem::for_simulation(2, 2, Dataflow::Os, 1 << 17, 4, 1 << 16, F32, F32).unwrap();
    let plan = crate::mesh::build_mesh_plan(&p, MeshAlgorithm::Collective).unwrap();
    assert!(plan.validate().is_ok());
    let e = plan.check_generator_range().unwrap_err();
    assert!(matches!(e, crate::plan::PlanError::GeneratorRange { .. }), "{e}");
    let e = crate::cpu::run(&plan, 1, crate::Family::Exact).unwrap_err();
    assert!(e.to_string().contains("beyond the 2^32"), "{e}");
    // Shape errors are still errors.
    assert!(MeshProblem::for_simulation(2, 2, Dataflow::Os, 3, 4, 4, F32, F32).is_err());
}
