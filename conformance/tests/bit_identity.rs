//! The claim the goldens rest on: the wgpu reference and its CPU twin give the same bits
//! for every op of every family — GEMMs (k in order, no fused multiply-add), copies,
//! reductions, GeLU, routing, grouped GEMMs, combines and the online softmax with its
//! `exp` and `ln` (`cmm_core::numeric`) — on generated cases, not only the corpus.
//!
//! Each run draws at least 500 valid cases over every family from a seed that changes
//! from run to run (set `CMM_PROPERTY_SEED` to replay one; a failure prints it and the
//! adapter), on Vulkan and on GL, each where the machine has it (both under `CI`). The
//! CUDA executor is not in the claim: its GEMMs sum in another order, and it is judged
//! within the tolerances (bit for bit only in the exact family).

use cmm_conformance::fuzz::Rng;
use cmm_conformance::{parse_cases, Backend, CpuTwin};
use cmm_core::schedule::Order;
use cmm_reference::{Reference, MESA_BACKENDS};

/// Cases each run checks, at least.
const CASES: usize = 500;

/// The dtype fields of a case: input, output and family.
fn dtypes(rng: &mut Rng, output_f32_allowed: bool, exact_allowed: bool) -> String {
    let input = rng.pick(&["f32", "f16", "bf16"]);
    let output = if output_f32_allowed && rng.below(2) == 0 { "f32" } else { input };
    let family = if exact_allowed { rng.pick(&["exact", "realistic"]) } else { "realistic" };
    format!("input = \"{input}\"\noutput = \"{output}\"\nfamily = \"{family}\"\nseed = {}\n", rng.below(1 << 30))
}

/// One random case of `family` (0: 1D, 1: mesh, 2: linear, 3: attention, 4: MoE), as a
/// case file's text; it may be invalid (the caller skips those).
fn random_case(rng: &mut Rng, family: usize, name: &str) -> String {
    let d = [1, 2, 3, 4, 4, 8][rng.below(6)];
    let mut c = format!("[[case]]\nname = \"{name}\"\n");
    match family {
        0 => {
            let op = rng.pick(&["ag_gemm", "gemm_rs", "gemm_ar"]);
            let alg = rng.pick(&[
                "baseline",
                "baseline_direct",
                "ring",
                "ring_bidir",
                "ring_chunked",
                "fused",
                "ring_accumulate",
                "ring_push",
            ]);
            let chunks = 1 + rng.below(3);
            c += &format!("op = \"{op}\"\nalgorithm = \"{alg}\"\ndevices = {d}\n");
            if matches!(alg, "ring_chunked" | "fused" | "ring_accumulate") {
                c += &format!("chunks = {chunks}\n");
            }
            let unit = d * chunks * 2;
            // A quarter of the cases shard M unevenly (tensor_split's order).
            let ragged = if rng.below(4) == 0 { rng.below(d) } else { 0 };
            let (m, n, k) = (unit * (1 + rng.below(6)) + ragged, d * 4 * (1 + rng.below(4)), 8 * (1 + rng.below(12)));
            c += &format!("m = {m}\nn = {n}\nk = {k}\n");
            if op != "ag_gemm" && rng.below(4) == 0 {
                c += &format!("wire = \"{}\"\n", rng.pick(&["f16", "bf16"]));
            }
            c += &dtypes(rng, true, true);
        }
        1 => {
            let (nr, nc) = [(1, 2), (2, 1), (2, 2), (1, 4), (2, 4), (4, 2), (3, 3)][rng.below(7)];
            let alg = rng.pick(&["collective", "summa", "cannon", "wang", "meshslice"]);
            c += &format!(
                "op = \"mesh_gemm\"\ndataflow = \"{}\"\nnr = {nr}\nnc = {nc}\nalgorithm = \"{alg}\"\n",
                rng.pick(&["os", "ls", "rs"])
            );
            if alg == "meshslice" {
                c += &format!("slices = {}\nblock = {}\n", 1 + rng.below(2), 1 + rng.below(2));
            }
            let unit = nr * nc * 4;
            c += &format!(
                "m = {}\nn = {}\nk = {}\n",
                unit * (1 + rng.below(3)),
                unit * (1 + rng.below(3)),
                unit * (1 + rng.below(3))
            );
            c += &dtypes(rng, true, true);
        }
        2 => {
            let layer = rng.pick(&["column", "row", "mlp"]);
            let pass = if layer == "mlp" { "train" } else { rng.pick(&["forward", "backward"]) };
            let sp = layer == "mlp" || rng.below(2) == 0;
            c += &format!(
                "op = \"linear\"\nlayer = \"{layer}\"\npass = \"{pass}\"\nsp = {sp}\ndevices = {d}\nmicrobatches = {}\nalgorithm = \"{}\"\n",
                1 + rng.below(2),
                rng.pick(&["baseline", "megatron", "ring"])
            );
            c += &format!(
                "m = {}\nn = {}\nk = {}\n",
                d * 8 * (1 + rng.below(3)),
                d * 8 * (1 + rng.below(3)),
                d * 8 * (1 + rng.below(3))
            );
            let input = rng.pick(&["f32", "f16", "bf16"]);
            let family = rng.pick(&["exact", "realistic"]);
            c += &format!(
                "input = \"{input}\"\noutput = \"{input}\"\nfamily = \"{family}\"\nseed = {}\n",
                rng.below(1 << 30)
            );
        }
        3 => {
            let decode = rng.below(3) == 0;
            let heads = [1, 2, 4][rng.below(3)];
            let kv = [1, heads][rng.below(2)];
            let alg = if decode {
                rng.pick(&["baseline", "split_kv"])
            } else {
                rng.pick(&["baseline", "ring", "ring_bidir"])
            };
            // Ragged decode keys; prefill chunks uneven in a quarter of the cases.
            let ragged = if rng.below(4) == 0 { rng.below(2 * d) } else { 0 };
            let s = if decode { d * (4 + rng.below(20)) + rng.below(d) } else { 2 * d * (2 + rng.below(12)) + ragged };
            c += &format!(
                "op = \"attention\"\ndevices = {d}\nalgorithm = \"{alg}\"\nm = {s}\nn = {heads}\nk = {}\nkv_heads = {kv}\ncausal = {}\n",
                [16, 32, 64][rng.below(3)],
                rng.below(2) == 0
            );
            if decode {
                c += &format!("queries = {}\n", 1 + rng.below(3));
            } else if rng.below(2) == 0 {
                c += "layout = \"balanced\"\n";
            }
            let input = rng.pick(&["f32", "f16", "bf16"]);
            c += &format!(
                "input = \"{input}\"\noutput = \"{input}\"\nfamily = \"realistic\"\nseed = {}\n",
                rng.below(1 << 30)
            );
        }
        _ => {
            let op = rng.pick(&["ag_moe", "moe_rs"]);
            let alg = rng.pick(&["baseline", "ring", "ring_chunked"]);
            let experts = [1, 2, 4, 5, 8][rng.below(5)];
            c += &format!(
                "op = \"{op}\"\ndevices = {d}\nalgorithm = \"{alg}\"\nexperts = {experts}\ntopk = {}\nrouting = \"{}\"\n",
                1 + rng.below(experts.min(3)),
                rng.pick(&["uniform", "skewed", "drop", "empty", "single"])
            );
            if alg == "ring_chunked" {
                c += &format!("chunks = {}\n", 1 + rng.below(3));
            }
            // Uneven token shards in a quarter of the cases.
            let ragged = if rng.below(4) == 0 { rng.below(d) } else { 0 };
            c += &format!(
                "m = {}\nn = {}\nk = {}\n",
                d * 6 * (1 + rng.below(4)) + ragged,
                8 * (1 + rng.below(4)),
                8 * (1 + rng.below(4))
            );
            c += &dtypes(rng, true, true);
        }
    }
    c
}

#[test]
fn the_reference_and_its_cpu_twin_agree_bit_for_bit_on_generated_cases() {
    let seed = std::env::var("CMM_PROPERTY_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1
    });
    eprintln!("CMM_PROPERTY_SEED={seed}");
    // Each backend reaches the driver through its own shader compiler (Mesa's GL path
    // once rewrote k·x·x·x as (k·x)·(x·x), which Vulkan's left alone), so each is held
    // to the twin's bits on the same cases.
    let references = Reference::on_each_backend(&MESA_BACKENDS).expect("CI is set but a Mesa backend is missing");
    if references.is_empty() {
        eprintln!("skipped: no wgpu adapter on any of {MESA_BACKENDS:?}");
    }
    for reference in &references {
        agree_on_generated_cases(reference, seed);
    }
}

fn agree_on_generated_cases(reference: &Reference, seed: u64) {
    let mut rng = Rng(seed);
    let mut checked = [0usize; 5];
    let mut uneven = 0;
    let mut attempts = 0;
    while checked.iter().sum::<usize>() < CASES {
        attempts += 1;
        assert!(attempts < 40 * CASES, "only {checked:?} valid cases in {attempts} draws (seed {seed})");
        let family = attempts % 5;
        let text = random_case(&mut rng, family, &format!("generated_{attempts}"));
        let Ok(cases) = parse_cases(&text, std::path::Path::new("generated.toml")) else { continue };
        let case = &cases[0];
        let Ok(plan) = case.plan() else { continue };
        if case.problem().is_ok_and(|p| p.workload().unsupported_family(case.family).is_some()) {
            continue;
        }
        let (Ok(twin), Ok(wgpu)) = (
            CpuTwin.run(&plan, case.seed, case.family, Order::Default),
            Backend::run(reference, &plan, case.seed, case.family, Order::Default),
        ) else {
            continue;
        };
        for (d, (t, w)) in twin.iter().zip(&wgpu).enumerate() {
            for (b, decl) in plan.buffers.iter().enumerate() {
                if !decl.role.is_result() {
                    continue;
                }
                if let Some(i) = (0..t[b].len()).find(|&i| t[b][i] != w[b][i]) {
                    panic!(
                        "{}, seed {seed}: device {d} buffer {} element {i}: twin {:#010x}, reference {:#010x}\n{text}",
                        reference.adapter_summary(),
                        decl.name,
                        t[b][i],
                        w[b][i]
                    );
                }
            }
        }
        checked[family] += 1;
        // Uneven shards: some buffer's devices hold different rows.
        uneven += usize::from(plan.buffers.iter().any(|b| b.device_rows.is_some()));
    }
    eprintln!("{}: {checked:?} cases (1D, mesh, linear, attention, MoE) agree bit for bit, {uneven} of them uneven, {attempts} drawn", reference.adapter_summary());
    assert!(checked.iter().all(|&n| n >= CASES / 20), "a family was barely drawn: {checked:?} (seed {seed})");
    assert!(uneven >= CASES / 50, "only {uneven} cases with uneven shards (seed {seed})");
}
