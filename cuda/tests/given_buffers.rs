//! Plans run on the caller's buffers (`CudaBackend::run_given`) on the fake CUDA driver:
//! the results match the generated path's bit for bit, every binding mistake is a
//! typed error naming the buffer, and a multi-GPU plan over a pair of GPUs without peer
//! access or native peer atomics is refused naming the pair, before anything runs.

use std::sync::Mutex;

use cmm_core::plan::{BufferRole, Plan};
use cmm_core::{DType, Family};
use cmm_cuda::fake::{deny_peer, PeerDenial};
use cmm_cuda::{
    CudaBackend, CudaError, CudaExecutor, CudaRunOptions, DeviceBuffer, GivenBuffer, Placement, ReadBack, SyncMode,
};

mod fake;

/// The fake driver's contexts and peer table are per process: the tests take turns.
static TURN: Mutex<()> = Mutex::new(());

const SEED: u32 = 11;

/// Device buffers holding what the generated path would put there, and their bindings.
fn given_buffers(backend: &CudaBackend, plan: &Plan, placement: Placement) -> (Vec<DeviceBuffer>, Vec<GivenBuffer>) {
    let pairs = backend.generated_buffers(plan, SEED, Family::Exact, placement).unwrap();
    let given = pairs.iter().map(|(g, _)| g.clone()).collect();
    (pairs.into_iter().map(|(_, b)| b).collect(), given)
}

fn words(plan: &Plan, given: &GivenBuffer, buffer: &DeviceBuffer) -> Vec<u32> {
    let dtype = plan.buffers.iter().find(|b| b.name == given.name).unwrap().dtype;
    let bytes = buffer.download().unwrap();
    dtype.words_from_le(&bytes, given.rows * given.cols)
}

#[test]
fn runs_on_given_buffers_match_the_generated_runs_bit_for_bit() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(backend) = fake::backend_on(2) else { return };
    for placement in [Placement::Virtual, Placement::Gpus] {
        for plan in fake::family_plans() {
            for sync in [SyncMode::Kernels, SyncMode::StreamMemOps] {
                let options = CudaRunOptions { placement, sync, ..Default::default() };
                let what = format!("{} ({placement:?}, {sync:?})", plan.name);
                let generated =
                    backend.run(&plan, SEED, Family::Exact, &options).unwrap_or_else(|e| panic!("{what}: {e}"));
                let (buffers, given) = given_buffers(&backend, &plan, placement);
                let nothing_back = CudaRunOptions { read_back: ReadBack::Nothing, ..options };
                backend.run_given(&plan, &given, &nothing_back).unwrap_or_else(|e| panic!("{what}: {e}"));
                let mut results = 0;
                for (g, buffer) in given.iter().zip(&buffers) {
                    let b = plan.buffers.iter().position(|b| b.name == g.name).unwrap();
                    let got = words(&plan, g, buffer);
                    // Inputs are left as given; results are the generated run's, bit for bit
                    // (an uneven shard's: the device's own rows).
                    let want = &generated.buffers[g.device][b][..plan.buffers[b].len_on(g.device)];
                    assert_eq!(got, want, "{what}: `{}` of device {}", g.name, g.device);
                    results += usize::from(plan.buffers[b].role.is_result());
                }
                assert!(results >= plan.devices, "{what}: every device has a result");
            }
        }
    }
}

#[test]
fn binding_mistakes_are_typed_errors_naming_the_buffer() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(backend) = fake::backend_on(2) else { return };
    let plan = &fake::family_plans()[0];
    // The device buffers stay alive (bound) for the whole test.
    let (_buffers, given) = given_buffers(&backend, plan, Placement::Virtual);
    let options = CudaRunOptions::default();
    let refused = |given: &[GivenBuffer]| match backend.run_given(plan, given, &options) {
        Err(CudaError::Binding { what, .. }) => what,
        other => panic!("expected a binding error, got {:?}", other.map(|o| o.gpu_time)),
    };
    let changed = |i: usize, change: &dyn Fn(&mut GivenBuffer)| {
        let mut given = given.clone();
        change(&mut given[i]);
        given
    };
    let name = &given[0].name;
    let scratch = plan.buffers.iter().find(|b| matches!(b.role, BufferRole::Scratch)).unwrap();

    assert!(refused(&given[1..]).contains(&format!("not given: `{name}` of device 0")));
    let twice = [given.clone(), vec![given[0].clone()]].concat();
    assert!(refused(&twice).contains("given twice"));
    assert!(refused(&changed(0, &|g| g.name = "nope".into())).contains("no buffer `nope`"));
    assert!(refused(&changed(0, &|g| g.name = scratch.name.clone())).contains("working memory"));
    assert!(refused(&changed(0, &|g| g.device = 7)).contains("the plan has 2 devices"));
    let e = refused(&changed(0, &|g| g.rows += 1));
    assert!(e.contains(&format!("buffer `{name}` of device 0 is")) && e.contains("the plan's is"), "{e}");
    assert!(refused(&changed(0, &|g| g.dtype = DType::F32)).contains("the plan's is"));
    assert!(refused(&changed(0, &|g| g.ptr += 16)).contains("not a non-null multiple of 256"));
    assert!(refused(&changed(0, &|g| g.ptr = 0)).contains("not a non-null multiple of 256"));
    // Another given buffer's place: two buffers share bytes.
    let other = given[1].ptr;
    assert!(refused(&changed(0, &|g| g.ptr = other)).contains("overlaps"));
    // Memory the driver does not know, and memory of the other GPU.
    let host = vec![0u8; 1 << 16];
    let host_ptr = (host.as_ptr() as u64).div_ceil(256) * 256;
    assert!(refused(&changed(0, &|g| g.ptr = host_ptr)).contains("not memory the CUDA driver knows"));
    let elsewhere = backend.device_buffer(1, 1 << 16).unwrap();
    let e = refused(&changed(0, &|g| g.ptr = elsewhere.ptr()));
    assert!(e.contains("memory of GPU 1, but device 0 runs on GPU 0"), "{e}");
    // A buffer one element too small for the plan's (its last element would lie in the
    // allocation's guard, never in another allocation).
    let bytes = given[0].rows * given[0].cols * given[0].dtype.size_bytes();
    let small = backend.device_buffer(0, bytes - given[0].dtype.size_bytes()).unwrap();
    let e = refused(&changed(0, &|g| g.ptr = small.ptr()));
    assert!(e.contains("run past the end of its allocation"), "{e}");
    // After every refusal the backend still runs the plan right.
    backend.run_given(plan, &given, &options).unwrap();
}

#[test]
fn given_routing_tables_are_checked_as_generated_ones_are() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(backend) = fake::backend_on(2) else { return };
    let plan = &fake::family_plans()[fake::MOE_PLAN];
    let (buffers, given) = given_buffers(&backend, plan, Placement::Virtual);
    let ids = plan.buffers.iter().position(|b| b.name.contains("ids")).expect("an AG+MoE plan has an id table");
    // Device 1's table names expert 9 of 4.
    let (g, buffer) =
        given.iter().zip(&buffers).find(|(g, _)| g.device == 1 && g.name == plan.buffers[ids].name).unwrap();
    let mut table = words(plan, g, buffer);
    table[0] = 9;
    let bytes: Vec<u8> = table.iter().flat_map(|w| w.to_le_bytes()).collect();
    buffer.upload(&bytes).unwrap();
    match backend.run_given(plan, &given, &CudaRunOptions::default()) {
        Err(CudaError::Routing(e)) => assert!(e.to_string().contains('9'), "{e}"),
        other => panic!("expected a routing error, got {:?}", other.map(|o| o.gpu_time)),
    }
}

#[test]
fn a_pair_without_peer_access_or_native_atomics_is_refused_naming_it() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(backend) = fake::backend_on(2) else { return };
    let plan = &fake::family_plans()[0];
    let options = CudaRunOptions { placement: Placement::Gpus, ..Default::default() };
    for (denial, missing) in
        [(PeerDenial::Access, "no peer access"), (PeerDenial::NativeAtomics, "no native peer atomics")]
    {
        deny_peer(0, 1, denial).unwrap();
        let result = backend.run(plan, SEED, Family::Exact, &options);
        deny_peer(0, 1, PeerDenial::Nothing).unwrap();
        match result {
            Err(e @ CudaError::PeerCapability { from: 0, to: 1, gpu_from: 0, gpu_to: 1, .. }) => {
                let text = e.to_string();
                assert!(text.contains("device 0 (GPU 0) reaches device 1 (GPU 1)") && text.contains(missing), "{text}");
            }
            other => panic!("expected a refusal naming GPUs 0 and 1, got {:?}", other.map(|o| o.gpu_time)),
        }
    }
    // The same plan on one GPU needs no peer capability; across the two it runs again.
    deny_peer(0, 1, PeerDenial::Access).unwrap();
    let virtual_run = backend.run(plan, SEED, Family::Exact, &CudaRunOptions::default());
    deny_peer(0, 1, PeerDenial::Nothing).unwrap();
    virtual_run.unwrap();
    backend.run(plan, SEED, Family::Exact, &options).unwrap();
}
