//! The simulator on the plans of every family and on the tuner's bounds.

use cmm_core::moe::{build_moe_plan, MoeOp, MoeProblem, Routing};
use cmm_core::plan::MAX_DEVICES;
use cmm_core::{Algorithm, DType};

#[test]
fn the_simulator_prices_grouped_gemms_from_the_routing() {
    use cmm_sim::{simulate, Engines, Profile, SimOptions};
    let profile = Profile::load("h100-nvlink").unwrap();
    // The same 1024 rows in one group, or spread thinly over 64 experts (partial tiles).
    let one = profile.grouped_gemm_cost(&[1024], 4096, 4096, DType::Bf16, DType::Bf16).work_s;
    let spread = profile.grouped_gemm_cost(&[16; 64], 4096, 4096, DType::Bf16, DType::Bf16).work_s;
    assert!(spread > 1.5 * one, "{spread} vs {one}");
    let time = |routing, experts, engines| {
        let p = MoeProblem::new(MoeOp::AgMoe, 8, 16384, 4096, 14336, experts, 2, routing, DType::Bf16, DType::Bf16)
            .unwrap();
        let plan = build_moe_plan(&p, Algorithm::Ring).unwrap();
        simulate(&plan, &profile, &SimOptions { engines, ..SimOptions::default() }).unwrap().compute_floor_s
    };
    // A tiled grouped GEMM (the potential: a library's rate) wastes tiles when the same
    // rows go to many small experts (compute floors: the ring of these shapes is bound by
    // its links).
    let (uniform, many) =
        (time(Routing::Uniform, 8, Engines::CublasSpeed), time(Routing::Uniform, 64, Engines::CublasSpeed));
    assert!(many > 1.5 * uniform, "{many} vs {uniform}");
    // As built (the Hopper engine, below cuBLAS's rate) it is slower than that.
    assert!(time(Routing::Uniform, 8, Engines::AsBuilt) > uniform);
}

/// As built, a grouped GEMM the Hopper engine can take (f16/bf16, aligned rows: moe_rs's,
/// and ag_moe's, whose rows it gathers by token) is priced on the engine and named so; an
/// f32 one on the scalar grouped kernel, as the CUDA backend runs them
/// (`cmm_core::engines::grouped_engine`). Experts with no token cost no tile.
#[test]
fn grouped_gemms_are_priced_on_the_engine_the_backend_runs_them_on() {
    use cmm_sim::{simulate, Engines, Profile, SimOptions};
    let profile = Profile::load("h100-nvlink").unwrap();
    let run = |op, input, engines| {
        let p = MoeProblem::new(op, 8, 16384, 4096, 14336, 8, 2, Routing::Uniform, input, input).unwrap();
        let plan = build_moe_plan(&p, Algorithm::Baseline).unwrap();
        simulate(&plan, &profile, &SimOptions { engines, ..SimOptions::default() }).unwrap()
    };
    let mut as_built_over_potential = Vec::new();
    for op in [MoeOp::MoeRs, MoeOp::AgMoe] {
        let built = run(op, DType::Bf16, Engines::AsBuilt);
        assert!(built.engines.describe().starts_with("Hopper engine"), "{op}: {}", built.engines.describe());
        // The engine runs a grouped GEMM well below cuBLAS's dense rate (measured on an
        // H100: 0.30-0.54 of it), so as built costs more than the potential.
        let potential = run(op, DType::Bf16, Engines::CublasSpeed).compute_floor_s;
        let floor = built.compute_floor_s;
        assert!(floor > 1.2 * potential, "{op}: {floor} vs {potential}");
        as_built_over_potential.push(floor / potential);
        let f32s = run(op, DType::F32, Engines::AsBuilt);
        assert!(f32s.engines.describe().starts_with("scalar grouped kernel"), "{op}: {}", f32s.engines.describe());
    }
    // ag_moe's rows, gathered by token (1792 columns: staged first), cost their staging
    // on top of the GEMM.
    assert!(as_built_over_potential[1] > as_built_over_potential[0], "{as_built_over_potential:?}");
    let hopper = cmm_core::engines::Engine::Hopper(cmm_core::engines::HopperTile::Wide);
    let cost = |groups: &[usize], gathered| {
        profile.grouped_gemm_cost_on(hopper, groups, 4096, 1792, DType::Bf16, DType::Bf16, gathered)
    };
    // Half the experts idle: the same rows in half the groups, no tile for the others.
    let (dense, with_idle) = (cost(&[1024; 8], false), cost(&[2048, 0, 2048, 0, 2048, 0, 2048, 0], false));
    assert!((with_idle.work_s - dense.work_s).abs() < 0.05 * dense.work_s, "{} vs {}", with_idle.work_s, dense.work_s);
    // The grouped rates are the profile's own, below the plain GEMM's on the same tiles.
    let plain = profile.gemm_cost_on(hopper, 8192, 4096, 1792, DType::Bf16, DType::Bf16, false);
    assert!(dense.work_s > 1.5 * plain.work_s, "{} vs {}", dense.work_s, plain.work_s);
    // Staged rows: each routed row read and written once more, at the HBM rate.
    let staged = cost(&[1024; 8], true);
    let staging_s = 2.0 * (8192 * 1792 * 2) as f64 / profile.hbm_bps();
    assert!(
        (staged.work_s - dense.work_s - staging_s).abs() < 1e-3 * staging_s,
        "{} vs {}",
        staged.work_s,
        dense.work_s
    );
    // Below 512 columns the producer copies them into each tile: no staging, but the
    // engine's slower rate over such rows.
    let narrow =
        |gathered| profile.grouped_gemm_cost_on(hopper, &[1024; 8], 256, 1792, DType::Bf16, DType::Bf16, gathered);
    let (copied, loaded) = (narrow(true), narrow(false));
    assert!(copied.work_s > 1.1 * loaded.work_s && copied.bytes == loaded.bytes, "{copied:?} vs {loaded:?}");
}

#[test]
fn the_tuner_bounds_its_chip_count_as_a_problem_bounds_devices() {
    let profile = cmm_sim::Profile::load("tpuv4-torus").unwrap();
    let llm = cmm_sim::tune::LlmConfig::gpt3_175b(128);
    let e = cmm_sim::tune::tune_llm(&llm, MAX_DEVICES + 1, &profile).unwrap_err();
    assert!(e.to_string().contains("65537 chips: more than the 65536"), "{e}");
    // Within a problem's bound but past the profile's system: refused, not priced on links
    // the profile does not have.
    let nvlink = cmm_sim::Profile::load("h100-nvlink").unwrap();
    let gemm = cmm_sim::analytic::MeshGemm {
        m: 8192,
        n: 8192,
        k: 8192,
        dataflow: cmm_sim::analytic::Dataflow::Os,
        dtype: cmm_core::DType::Bf16,
        wire: cmm_core::DType::F32,
    };
    let e = cmm_sim::tune::tune_mesh_gemm(&gemm, 16, &nvlink, 0).unwrap_err();
    assert!(e.to_string().contains("16 chips: profile h100-nvlink describes at most 8 devices"), "{e}");
    let e = cmm_sim::tune::tune_llm(&llm, 16, &nvlink).unwrap_err();
    assert!(matches!(e, cmm_sim::tune::TuneError::ProfileChips { chips: 16, max: 8, .. }), "{e}");
}

/// Uneven shards (M = 8191 rows on 8 devices: seven of 1024, one of 1023) simulate like
/// their even neighbours, under every 1D algorithm of GEMM+RS: between 8184 rows (1023
/// each) and 8192 (1024 each), within 1 %: not exactly, since one shorter copy shifts
/// how the copies sharing a link split its bandwidth (ring_bidir comes out 0.08 % over).
#[test]
fn uneven_shards_simulate_between_their_even_neighbours() {
    use cmm_core::{algorithms::build_plan, OpKind, Problem};
    use cmm_sim::{simulate, Profile, SimOptions};
    let profile = Profile::load("h100-nvlink").unwrap();
    let time = |m: usize, algorithm| {
        let p = Problem::new(OpKind::GemmRs, 8, m, 4096, 4096, DType::Bf16, DType::Bf16).unwrap();
        let plan = build_plan(&p, algorithm).unwrap();
        simulate(&plan, &profile, &SimOptions::default()).unwrap().makespan_s
    };
    for algorithm in cmm_core::algorithms::algorithms_for(OpKind::GemmRs) {
        let (low, uneven, high) = (time(8184, algorithm), time(8191, algorithm), time(8192, algorithm));
        assert!(0.99 * low <= uneven && uneven <= 1.01 * high, "{algorithm}: {low} <= {uneven} <= {high}");
        assert!(low < high, "{algorithm}: 8 rows more cost nothing ({low} vs {high})");
    }
}

/// SUMMA's lanes serve the panels in the order they arrive, so on every mesh of 16 TPU
/// chips and in every dataflow its plan simulates within a quarter of seed 002's form
/// (which streams each panel). Served in panel order, a chip far down one panel's chain
/// held the later panels back: up to 11.2 times the form on these meshes (all but one
/// case over 1.25).
#[test]
fn summa_plans_keep_pace_with_seed_002s_streamed_broadcasts() {
    use cmm_sim::analytic::{estimate_mesh, Dataflow, MeshFamily, MeshGemm, MeshShape};
    let profile = cmm_sim::Profile::load("tpuv4-torus").unwrap();
    for shape in MeshShape::all(16) {
        for dataflow in [Dataflow::Os, Dataflow::Ls, Dataflow::Rs] {
            let gemm = MeshGemm { m: 4096, n: 4096, k: 4096, dataflow, dtype: DType::Bf16, wire: DType::F32 };
            let form = estimate_mesh(MeshFamily::Summa, &gemm, shape, 1, &profile).unwrap().total_s;
            let plan = cmm_sim::tune::replay_mesh(&gemm, MeshFamily::Summa, shape, 1, &profile).unwrap().unwrap().1;
            let ratio = plan.makespan_s / form;
            assert!(ratio < 1.25, "{dataflow} SUMMA on {shape}: {ratio:.2} times the form");
        }
    }
}

/// The mesh plans' gathers go both ways round the torus, as seed 002's form streams
/// them: on a 4 × 4 TPU v4 torus the OS collective and Wang simulate at 1.08 times the
/// form, MeshSlice in 4 slices at 1.34 (it pays a round a hop of every slice, which the
/// form does once); one way round they took 1.54, 1.49 and 2.02 times it.
#[test]
fn mesh_gathers_use_both_ways_round_the_torus() {
    use cmm_sim::analytic::{estimate_mesh, Dataflow, MeshFamily, MeshGemm, MeshShape};
    let profile = cmm_sim::Profile::load("tpuv4-torus").unwrap();
    let gemm = MeshGemm { m: 8192, n: 8192, k: 8192, dataflow: Dataflow::Os, dtype: DType::Bf16, wire: DType::F32 };
    let shape = MeshShape { rows: 4, cols: 4 };
    for (family, slices) in [(MeshFamily::Collective, 1), (MeshFamily::MeshSlice, 4), (MeshFamily::Wang, 1)] {
        let form = estimate_mesh(family, &gemm, shape, slices, &profile).unwrap().total_s;
        let plan = cmm_sim::tune::replay_mesh(&gemm, family, shape, slices, &profile).unwrap().unwrap().1;
        let ratio = plan.makespan_s / form;
        assert!(ratio < 1.4, "{family} S={slices}: {ratio:.2} times the form");
    }
}

/// The mesh plans' ReduceScatters go both ways round the torus too. With the partial sums
/// in bf16, as seed 002's form prices them, on a 4 × 4 TPU v4 torus the LS and RS
/// collective plans simulate at 1.14 times the form and MeshSlice in 4 slices at 1.46 (a
/// round a hop of every slice); with the sums going one way they took 1.46 and 2.04.
#[test]
fn mesh_reduce_scatters_use_both_ways_round_the_torus() {
    use cmm_sim::analytic::{estimate_mesh, Dataflow, MeshFamily, MeshGemm, MeshShape};
    let profile = cmm_sim::Profile::load("tpuv4-torus").unwrap();
    let shape = MeshShape { rows: 4, cols: 4 };
    for dataflow in [Dataflow::Ls, Dataflow::Rs] {
        let gemm = MeshGemm { m: 8192, n: 8192, k: 8192, dataflow, dtype: DType::Bf16, wire: DType::Bf16 };
        for (family, slices, bound) in [(MeshFamily::Collective, 1, 1.25), (MeshFamily::MeshSlice, 4, 1.5)] {
            let form = estimate_mesh(family, &gemm, shape, slices, &profile).unwrap().total_s;
            let plan = cmm_sim::tune::replay_mesh(&gemm, family, shape, slices, &profile).unwrap().unwrap().1;
            let ratio = plan.makespan_s / form;
            assert!(ratio < bound, "{dataflow} {family} S={slices}: {ratio:.2} times the form");
        }
    }
}

/// A mesh ReduceScatter adds its running sums up on a lane of its own, a piece at a time,
/// so one piece's sum runs while the piece before it is copied on: on every chip of an
/// LS MeshSlice plan, each way's sums overlap that way's copies. With the sums on the
/// copy lane, none did, and the plan took 1052.3 µs against 945.1 µs now (tpuv4-torus,
/// 4 × 4, S = 4, 8192³ bf16 with f32 sums).
#[test]
fn mesh_reduce_scatters_add_up_beside_their_copies() {
    use cmm_core::mesh::{MeshAlgorithm, MeshProblem};
    use cmm_sim::{simulate, OpClass, SimOptions};
    let profile = cmm_sim::Profile::load("tpuv4-torus").unwrap();
    let p = MeshProblem::new(4, 4, cmm_core::mesh::Dataflow::Ls, 8192, 8192, 8192, DType::Bf16, DType::Bf16).unwrap();
    let plan = cmm_core::mesh::build_mesh_plan(&p, MeshAlgorithm::MeshSlice { slices: 4, block: 512 }).unwrap();
    let options = SimOptions { torus_dims: Some(vec![4, 4]), ..SimOptions::default() };
    let report = simulate(&plan, &profile, &options).unwrap();
    let lane = |name: &str| report.lanes.iter().position(|l| l == name).unwrap_or_else(|| panic!("no lane {name}"));
    for (copies, sums) in [("row", "row_sum"), ("row_back", "row_back_sum")] {
        let (copies, sums) = (lane(copies), lane(sums));
        for (d, lanes) in report.records.iter().enumerate() {
            let of = |l: usize, class: OpClass| lanes[l].iter().filter(move |r| r.class == class);
            let overlapped = of(sums, OpClass::Reduce)
                .filter(|s| of(copies, OpClass::RemoteCopy).any(|c| c.start_s < s.end_s && s.start_s < c.end_s))
                .count();
            assert!(overlapped * 2 >= of(sums, OpClass::Reduce).count(), "device {d}: {overlapped} sums beside a copy");
            assert_eq!(of(copies, OpClass::Reduce).count(), 0, "device {d}: a sum on the copy lane");
        }
    }
    assert!(report.makespan_s < 1000e-6, "{:.1} µs", report.makespan_s * 1e6);
}

/// Wang's replay takes the fastest of its four plans (each direction, one way and both
/// ways round): on a TPU v4 torus, whose two ways are links of their own, a ring both
/// ways round (an LS GEMM on 4 × 4: 1103 µs against 1689 one way); through h100-nvlink's
/// switch, whose ways share the chip's port, the one-way ring (an OS GEMM on 2 × 4:
/// 313.8 µs against 334.4 both ways round).
#[test]
fn wang_replays_take_the_fastest_of_its_four_plans() {
    use cmm_core::mesh::MeshAlgorithm;
    use cmm_sim::analytic::{Dataflow, MeshFamily, MeshGemm, MeshShape};
    use cmm_sim::{simulate, SimOptions};
    for (profile, dataflow, shape, bidir) in [
        ("tpuv4-torus", Dataflow::Ls, MeshShape { rows: 4, cols: 4 }, true),
        ("h100-nvlink", Dataflow::Os, MeshShape { rows: 2, cols: 4 }, false),
    ] {
        let profile = cmm_sim::Profile::load(profile).unwrap();
        let gemm = MeshGemm { m: 8192, n: 8192, k: 8192, dataflow, dtype: DType::Bf16, wire: DType::F32 };
        let plans = cmm_sim::tune::mesh_plans(&gemm, MeshFamily::Wang, shape, 1);
        assert_eq!(plans.len(), 4, "{}", profile.name);
        let options = SimOptions { torus_dims: Some(vec![shape.rows, shape.cols]), ..SimOptions::default() };
        let times: Vec<(MeshAlgorithm, f64)> =
            plans.iter().map(|(a, plan)| (*a, simulate(plan, &profile, &options).unwrap().makespan_s)).collect();
        let (algorithm, report) =
            cmm_sim::tune::replay_mesh(&gemm, MeshFamily::Wang, shape, 1, &profile).unwrap().unwrap();
        assert!(times.iter().all(|(_, t)| report.makespan_s <= *t), "{}: {times:?}", profile.name);
        assert!(
            matches!(algorithm, MeshAlgorithm::Wang { bidir: b, .. } if b == bidir),
            "{}: {algorithm}",
            profile.name
        );
        // And it beats the other way round along the same direction.
        let MeshAlgorithm::Wang { ring, .. } = algorithm else { unreachable!() };
        let other = times.iter().find(|(a, _)| *a == MeshAlgorithm::Wang { ring, bidir: !bidir }).unwrap().1;
        assert!(report.makespan_s < other, "{}: {algorithm} against {other}", profile.name);
    }
}
