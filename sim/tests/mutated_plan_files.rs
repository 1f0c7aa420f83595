//! Plan files mutated at random (numbers, strings, fields removed): each is refused with a
//! typed error, or verified and simulated; never a panic.

use cmm_core::algorithms::build_plan;
use cmm_core::moe::{build_moe_plan, MoeOp, MoeProblem, Routing};
use cmm_core::{Algorithm, DType, OpKind, Plan, Problem};

/// Mutates one number, string or field of a plan file's JSON tree, deterministically.
fn mutate(v: &mut serde_json::Value, rng: &mut u64) {
    let mut next = |n: usize| {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        (*rng % n.max(1) as u64) as usize
    };
    // Walk down to a random node, as a JSON pointer.
    let (mut path, mut at, mut remove) = (String::new(), &*v, false);
    while next(4) != 0 {
        let (key, child) = match at {
            serde_json::Value::Object(m) if !m.is_empty() => {
                let (k, c) = m.iter().nth(next(m.len())).unwrap();
                (k.clone(), c)
            }
            serde_json::Value::Array(a) if !a.is_empty() => {
                let i = next(a.len());
                (i.to_string(), &a[i])
            }
            _ => break,
        };
        path = format!("{path}/{key}");
        at = child;
        if next(12) == 0 {
            remove = true;
            break;
        }
    }
    let replacement = match at {
        serde_json::Value::Number(n) if next(2) == 0 => serde_json::json!(n.as_u64().unwrap_or(0).wrapping_add(1)),
        _ => [
            serde_json::json!(0),
            serde_json::json!(1),
            serde_json::json!(2),
            serde_json::json!(7),
            serde_json::json!(4095),
            serde_json::json!(1u64 << 31),
            serde_json::json!((1u64 << 32) + 5),
            serde_json::json!(1u64 << 63),
            serde_json::json!(u64::MAX),
            serde_json::json!(-1),
            serde_json::json!(0.5),
            serde_json::json!("x"),
            serde_json::json!(null),
            serde_json::json!([]),
        ][next(14)]
        .clone(),
    };
    let Some((parent, key)) = path.rsplit_once('/') else { return };
    match v.pointer_mut(parent) {
        Some(serde_json::Value::Object(m)) if remove => {
            m.remove(key);
        }
        Some(serde_json::Value::Array(a)) if remove => {
            a.remove(key.parse::<usize>().unwrap());
        }
        Some(p) => {
            *p.pointer_mut(&format!("/{key}")).unwrap() = replacement;
        }
        None => {}
    }
}

#[test]
fn mutated_plan_files_are_refused_or_verified_and_simulated_never_a_panic() {
    use cmm_core::schedule::{schedule_with, Order};
    use cmm_sim::{simulate, HardwareQueues, Profile, SimOptions};
    let ring = build_plan(&Problem::new(OpKind::GemmRs, 3, 6, 4, 6, DType::Bf16, DType::F32).unwrap(), Algorithm::Ring);
    let fused = build_plan(
        &Problem::new(OpKind::AgGemm, 2, 8, 4, 8, DType::F16, DType::F16).unwrap(),
        Algorithm::Fused { chunks: 2 },
    );
    let m = MoeProblem::new(MoeOp::MoeRs, 2, 8, 4, 4, 4, 2, Routing::Skewed, DType::F32, DType::F32).unwrap();
    let moe = build_moe_plan(&m, Algorithm::Ring).unwrap();
    let trees: Vec<serde_json::Value> =
        [ring.unwrap(), fused.unwrap(), moe].iter().map(|p| serde_json::from_str(&p.to_file_json()).unwrap()).collect();
    let profile = Profile::load("h100-nvlink").unwrap();
    let (mut rng, mut accepted) = (0x9e37_79b9_7f4a_7c15u64, 0);
    for i in 0..600 {
        let mut tree = trees[i % trees.len()].clone();
        for _ in 0..1 + i % 3 {
            mutate(&mut tree, &mut rng);
        }
        let Ok(plan) = Plan::from_file_json(&tree.to_string()) else { continue };
        accepted += 1;
        if let Ok(schedule) = schedule_with(&plan, Order::Default) {
            let _ = cmm_core::verify::verify(&plan, &schedule);
        }
        let _ = simulate(&plan, &profile, &SimOptions::default());
        // And with the lanes on shared hardware queues (1 to 3, any offset).
        let queues = Some(HardwareQueues { queues: 1 + i % 3, offset: i });
        let _ = simulate(&plan, &profile, &SimOptions { hardware_queues: queues, ..SimOptions::default() });
    }
    // Most mutations break the file; enough survive to exercise the verifier and simulator.
    assert!((30..600).contains(&accepted), "{accepted} of 600 mutated files were accepted");
}
