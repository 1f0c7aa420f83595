//! Reference executor tests. They need an adapter (lavapipe on a machine without a
//! GPU); when none exists they say why and pass nothing off as checked.

use cmm_core::algorithms::{algorithms_for, build_plan};
use cmm_core::generator::{element_bits, Family};
use cmm_core::oracle::expected_outputs;
use cmm_core::plan::{BufferRole, Op, PlanBuilder};
use cmm_core::{cpu, DType, OpKind, Problem};
use cmm_reference::{Reference, ReferenceError, GEMM_K_PER_DISPATCH, MESA_BACKENDS};

fn reference() -> Option<Reference> {
    match Reference::new() {
        Ok(r) => Some(r),
        // CI installs lavapipe: there a missing adapter is a failure, not a skip.
        Err(e) if std::env::var_os("CI").is_some() => panic!("CI is set but no wgpu adapter exists: {e}"),
        Err(e) => {
            eprintln!("SKIPPED: no wgpu adapter: {e}");
            None
        }
    }
}

#[test]
fn wgsl_generator_matches_rust_bit_for_bit() {
    let Some(r) = reference() else { return };
    for dtype in DType::ALL {
        for family in [Family::Exact, Family::Realistic] {
            let (rows, cols, tensor, seed) = (37, 129, 5, 0xdead_beef);
            let gpu = r.generate(rows, cols, tensor, dtype, seed, family).unwrap();
            let cpu: Vec<u32> = (0..rows * cols).map(|i| element_bits(seed, tensor, i as u32, family, dtype)).collect();
            assert_eq!(gpu, cpu, "{dtype} {family}");
        }
    }
}

#[test]
fn every_algorithm_matches_the_cpu_twin_and_the_oracle() {
    let Some(r) = reference() else { return };
    println!("adapter: {}", r.adapter_summary());
    for op in OpKind::ALL {
        for (d, input, output) in
            [(1, DType::F32, DType::F32), (3, DType::F16, DType::F16), (4, DType::Bf16, DType::F32)]
        {
            let p = Problem::new(op, d, 8 * d, 6 * d, 70 * d, input, output).unwrap();
            let want = expected_outputs(&p, 5, Family::Exact);
            for alg in algorithms_for(op) {
                let plan = build_plan(&p, alg).unwrap();
                let out = r.run(&plan, 5, Family::Exact).unwrap();
                let twin = cpu::run(&plan, 5, Family::Exact).unwrap();
                let c = plan.output().unwrap().0;
                for (dev, (got, expected)) in out.buffers.iter().zip(&want.values).enumerate() {
                    assert_eq!(got[c], twin[dev][c], "{} device {dev}", plan.name);
                    let oracle: Vec<u32> = expected.iter().map(|&v| output.encode(v as f32)).collect();
                    assert_eq!(got[c], oracle, "{} device {dev} vs oracle", plan.name);
                }
            }
        }
    }
}

#[test]
fn runs_are_bit_identical() {
    let Some(r) = reference() else { return };
    let p = Problem::new(OpKind::GemmRs, 4, 32, 24, 64, DType::F32, DType::F32).unwrap();
    let plan = build_plan(&p, cmm_core::Algorithm::RingBidir).unwrap();
    let a = r.run(&plan, 9, Family::Realistic).unwrap();
    let b = r.run(&plan, 9, Family::Realistic).unwrap();
    assert_eq!(a.buffers, b.buffers);
}

#[test]
fn long_k_is_split_across_dispatches_and_stays_exact() {
    let Some(r) = reference() else { return };
    let k = GEMM_K_PER_DISPATCH + 1000;
    for out_dtype in [DType::F32, DType::F16] {
        let mut b = PlanBuilder::new("long k", 1);
        let a = b.buffer("A", DType::F16, 3, k, BufferRole::whole_tensor(0, k));
        let bb = b.buffer("B", DType::F16, k, 5, BufferRole::whole_tensor(1, 5));
        let c = b.buffer("C", out_dtype, 3, 5, BufferRole::Output);
        let lane = b.lane("compute");
        let op = Op::gemm(b.whole(a), b.whole(bb), b.whole(c));
        b.push(0, lane, op);
        let plan = b.finish().unwrap();
        let out = r.run(&plan, 3, Family::Exact).unwrap();
        let twin = cpu::run(&plan, 3, Family::Exact).unwrap();
        assert_eq!(out.buffers[0][2], twin[0][2], "{out_dtype}");
        assert!(out.dispatches >= 2);
    }
}

#[test]
fn a_missing_signal_is_a_deadlock_error_not_a_hang() {
    let Some(r) = reference() else { return };
    let p = Problem::new(OpKind::AgGemm, 3, 6, 6, 4, DType::F32, DType::F32).unwrap();
    let mut plan = build_plan(&p, cmm_core::Algorithm::Ring).unwrap();
    let comm = &mut plan.programs[1].lanes[1];
    let at = comm.iter().position(|op| matches!(op, Op::Signal { .. })).unwrap();
    comm.remove(at);
    match r.run(&plan, 1, Family::Exact) {
        Err(ReferenceError::Deadlock(d)) => {
            let text = d.to_string();
            assert!(!d.blocked.is_empty());
            assert!(text.contains("device 0") && text.contains("recv"), "{text}");
        }
        other => panic!("expected a deadlock, got {other:?}"),
    }
}

#[test]
fn a_plan_too_large_for_the_adapter_is_a_typed_error() {
    let Some(r) = reference() else { return };
    let limit = r.gpu().max_heap_bytes();
    let rows = (limit / 4 / 4096 + 1) as usize;
    let mut b = PlanBuilder::new("huge", 1);
    b.buffer("X", DType::F32, rows, 4096, BufferRole::Scratch);
    let plan = b.finish().unwrap();
    assert!(matches!(r.run(&plan, 0, Family::Exact), Err(ReferenceError::TooLarge { .. })));
    // Also before any work, with the way out named.
    let e = r.gpu().check_fits(&plan).unwrap_err();
    assert!(e.to_string().contains("--backend cpu"), "{e}");
}

#[test]
fn scratch_starts_as_poison_and_a_lost_signal_fails_the_mirror_audit() {
    let Some(r) = reference() else { return };
    let p = Problem::new(OpKind::AgGemm, 2, 4, 4, 4, DType::Bf16, DType::Bf16).unwrap();
    let plan = build_plan(&p, cmm_core::Algorithm::Ring).unwrap();
    // Before any op: scratch holds poison.
    let mut empty = plan.clone();
    for prog in &mut empty.programs {
        for lane in &mut prog.lanes {
            lane.clear();
        }
    }
    let out = r.run(&empty, 1, Family::Exact).unwrap();
    let s = plan.buffer_id("S").unwrap().0;
    assert!(out.buffers[0][s].iter().all(|&w| w == DType::Bf16.poison_bits()));
    // A signal the host counts but the GPU mirror never sees.
    let (site, target) = plan
        .ops()
        .find_map(|(site, op)| match op {
            Op::Signal { device, .. } => Some((site, *device)),
            _ => None,
        })
        .unwrap();
    let options = cmm_reference::RunOptions { lose_signal: Some(site), ..Default::default() };
    match r.run_with(&plan, 1, Family::Exact, &options) {
        Err(ReferenceError::SemaphoreMirror { device, gpu, host, .. }) => {
            assert_eq!((device, gpu, host), (target, 0, 1));
        }
        other => panic!("expected a semaphore mirror error, got {other:?}"),
    }
}

#[test]
fn timed_runs_time_every_op_in_order_and_give_the_same_bits() {
    let Some(r) = reference() else { return };
    let p = Problem::new(OpKind::AgGemm, 3, 24, 12, 32, DType::F16, DType::F32).unwrap();
    let plan = build_plan(&p, cmm_core::Algorithm::Ring).unwrap();
    let fast = r.run(&plan, 3, Family::Exact).unwrap();
    assert!(fast.op_times.is_none(), "the default path does not time ops");
    let options = cmm_reference::RunOptions { time_ops: true, ..Default::default() };
    let timed = r.run_with(&plan, 3, Family::Exact, &options).unwrap();
    assert_eq!(timed.buffers, fast.buffers);
    let times = timed.op_times.unwrap();
    assert_eq!(times.len(), plan.op_count());
    assert!(times.windows(2).all(|w| w[0].start + w[0].duration <= w[1].start), "ops run one after another");
    let gemms = times
        .iter()
        .filter(|t| matches!(plan.programs[t.site.device].lanes[t.site.lane][t.site.index], Op::Gemm { .. }));
    assert!(gemms.clone().count() == 3 * 3 && gemms.clone().all(|t| t.duration.as_nanos() > 0));
}

#[test]
fn moe_stages_match_their_cpu_twins_word_for_word_and_malformed_routing_is_refused() {
    use cmm_core::moe::{build_moe_plan, MoeOp, MoeProblem, Routing, RoutingError};
    use cmm_core::Algorithm;
    let Some(r) = reference() else { return };
    // Every buffer, tables and scratch included: the route, grouped GEMM and combine
    // stages are the twins' bit for bit, realistic inputs and dropped slots included.
    for (op, routing, alg) in [
        (MoeOp::AgMoe, Routing::Drop, Algorithm::RingChunked { chunks: 2 }),
        (MoeOp::MoeRs, Routing::Skewed, Algorithm::Ring),
        (MoeOp::MoeRs, Routing::Empty, Algorithm::Baseline),
    ] {
        let p = MoeProblem::new(op, 4, 32, 12, 8, 6, 3, routing, DType::Bf16, DType::Bf16).unwrap();
        let plan = build_moe_plan(&p, alg).unwrap();
        let out = r.run(&plan, 3, Family::Realistic).unwrap();
        let twin = cpu::run(&plan, 3, Family::Realistic).unwrap();
        for (dev, (got, want)) in out.buffers.iter().zip(&twin).enumerate() {
            for (b, decl) in plan.buffers.iter().enumerate() {
                assert_eq!(got[b], want[b], "{} device {dev} buffer {}", plan.name, decl.name);
            }
        }
    }
    // A router naming experts the plan does not have: refused before anything runs.
    let p = MoeProblem::new(MoeOp::AgMoe, 2, 8, 4, 4, 4, 2, Routing::Uniform, DType::F32, DType::F32).unwrap();
    let mut plan = build_moe_plan(&p, Algorithm::Ring).unwrap();
    let ids = plan.buffer_id("ids").unwrap().0;
    if let BufferRole::Router { router, .. } = &mut plan.buffers[ids].role {
        router.experts = 64;
    }
    match r.run(&plan, 1, Family::Exact) {
        Err(ReferenceError::Routing(RoutingError::ExpertOutOfRange { experts: 4, .. })) => {}
        other => panic!("{:?}", other.map(|o| o.dispatches)),
    }
}

#[test]
fn a_heap_split_over_several_bindings_gives_the_bits_of_one_binding() {
    use cmm_core::attention::{build_attention_plan, AttentionAlgorithm, AttentionProblem, Layout};
    use cmm_core::moe::{build_moe_plan, MoeOp, MoeProblem, Routing};
    use cmm_core::Algorithm;
    let Some(whole) = reference() else { return };
    // Parts of 500 words: every plan below spans two to four of them, so every stage
    // reads and writes across part boundaries.
    let r = Reference::with_gpu(cmm_reference::Gpu::new_with_heap_parts_of(500).unwrap());
    assert_eq!(r.gpu().max_heap_bytes(), 4 * 500 * 4);
    let ring = Problem::new(OpKind::GemmRs, 2, 16, 12, 16, DType::F16, DType::F32).unwrap();
    let attn = AttentionProblem::new(2, 16, 2, 1, 8, true, Layout::Balanced, None, DType::Bf16).unwrap();
    let moe = MoeProblem::new(MoeOp::AgMoe, 2, 16, 8, 8, 4, 2, Routing::Drop, DType::F32, DType::F32).unwrap();
    let plans = [
        build_plan(&ring, Algorithm::RingChunked { chunks: 2 }).unwrap(),
        build_attention_plan(&attn, AttentionAlgorithm::Ring).unwrap(),
        build_moe_plan(&moe, Algorithm::Ring).unwrap(),
    ];
    for plan in plans {
        let out = r.run(&plan, 4, Family::Realistic).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
        let one_part = whole.run(&plan, 4, Family::Realistic).unwrap();
        assert!(out.buffers == one_part.buffers, "{}: the split heap changed the bits", plan.name);
        let words: usize = plan.buffers.iter().map(|b| b.len()).sum::<usize>() * plan.devices;
        assert!(words > 500, "{} fits one part ({words} words): it tests nothing", plan.name);
    }
    // Beyond four parts: refused before anything runs.
    let big = Problem::new(OpKind::AgGemm, 2, 64, 64, 64, DType::F32, DType::F32).unwrap();
    let e = r.run(&build_plan(&big, Algorithm::Ring).unwrap(), 1, Family::Exact).unwrap_err();
    assert!(matches!(e, ReferenceError::TooLarge { limit: 8000, .. }), "{e}");
}

#[test]
fn gelu_and_its_gradient_give_the_twins_bits_on_every_backend() {
    use cmm_core::plan::Pointwise;
    // 2·256·512 realistic inputs a seed: with k·x³ written ((k·x)·x)·x, Mesa's GL path
    // (which rewrites it as (k·x)·(x·x)) gave other bits on about one element in 400.
    let (rows, cols) = (256, 512);
    let mut b = PlanBuilder::new("gelu", 1);
    let lane = b.lane("compute");
    let x = b.buffer("X", DType::F32, rows, cols, BufferRole::whole_tensor(0, cols));
    let dy = b.buffer("dY", DType::F32, rows, cols, BufferRole::whole_tensor(1, cols));
    let y = b.buffer("Y", DType::F32, rows, cols, BufferRole::Output);
    let dx = b.buffer("dX", DType::F32, rows, cols, BufferRole::Output);
    let (xr, dyr, yr, dxr) = (b.whole(x), b.whole(dy), b.whole(y), b.whole(dx));
    b.push(0, lane, Op::Pointwise { function: Pointwise::Gelu, inputs: vec![xr], output: yr });
    b.push(0, lane, Op::Pointwise { function: Pointwise::GeluGrad, inputs: vec![dyr, xr], output: dxr });
    let plan = b.finish().unwrap();
    let references = Reference::on_each_backend(&MESA_BACKENDS).expect("CI is set but a Mesa backend is missing");
    if references.is_empty() {
        eprintln!("skipped: neither a Vulkan nor a GL adapter");
    }
    for r in &references {
        for seed in 0..2 {
            let got = r.run(&plan, seed, Family::Realistic).unwrap().buffers.remove(0);
            let want = cpu::run(&plan, seed, Family::Realistic).unwrap().remove(0);
            for buf in [y, dx] {
                let differ = (0..rows * cols).filter(|&i| got[buf.0][i] != want[buf.0][i]).count();
                assert_eq!(
                    differ,
                    0,
                    "{}, seed {seed}: {differ} elements of {} differ from the twin's",
                    r.adapter_summary(),
                    plan.buffers[buf.0].name
                );
            }
        }
    }
}
