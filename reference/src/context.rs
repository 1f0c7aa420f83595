//! Getting a device: adapter selection (Vulkan first, then GL, then any backend), the
//! adapter's real limits, and the compute pipelines built once per device.

use std::sync::{Arc, Mutex, OnceLock};

use crate::error::ReferenceError;
use crate::params::PARAMS_SIZE;

/// A wgpu device with the reference's pipelines, ready to run plans.
#[derive(Debug)]
pub struct Gpu {
    /// The adapter that runs the work.
    pub info: wgpu::AdapterInfo,
    /// The device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    pub(crate) pipelines: Pipelines,
    /// Errors wgpu raised outside an error scope (recorded instead of panicking).
    pub(crate) uncaptured: Arc<Mutex<Vec<String>>>,
    /// Words of one heap part (the pipelines are built for it).
    part_words: u64,
}

/// The bind group layout every stage shares — bindings 0, 2, 3 and 4 = the heap's parts
/// (`array<u32>`, read-write), binding 1 = the dispatch's parameters (uniform, dynamic
/// offset) — and the stages, built on first use in two variants.
#[derive(Debug)]
pub(crate) struct Pipelines {
    pub layout: wgpu::BindGroupLayout,
    pipeline_layout: wgpu::PipelineLayout,
    part_words: u64,
    /// For a heap that fits its first part: `ld` and `st` touch binding 0 only. On a CPU
    /// adapter every branch of a split-heap access runs as a loop over the lanes, taken
    /// or not, so this variant makes memory-bound stages several times faster there.
    one_part: OnceLock<Stages>,
    /// For a heap over several parts.
    split: OnceLock<Stages>,
}

/// Every compute stage of the reference, for one heap variant.
#[derive(Debug)]
pub(crate) struct Stages {
    pub gemm: wgpu::ComputePipeline,
    pub copy: wgpu::ComputePipeline,
    pub reduce: wgpu::ComputePipeline,
    pub pointwise: wgpu::ComputePipeline,
    pub attend: wgpu::ComputePipeline,
    pub attn_state: wgpu::ComputePipeline,
    pub generate: wgpu::ComputePipeline,
    pub signal: wgpu::ComputePipeline,
    pub route: wgpu::ComputePipeline,
    pub grouped_gemm: wgpu::ComputePipeline,
    pub combine: wgpu::ComputePipeline,
}

const NUMERIC: &str = include_str!("../../shaders/numeric.wgsl");
const MEMORY: &str = include_str!("../../shaders/memory.wgsl");

/// Storage bindings the heap is split over (`shaders/memory.wgsl`): bindings 0, 2, 3, 4.
pub const HEAP_PARTS: usize = 4;

/// The binding of each heap part.
pub(crate) const HEAP_BINDINGS: [u32; HEAP_PARTS] = [0, 2, 3, 4];

/// The source of a stage: the shared numeric helpers and heap access, then the stage.
fn stage_source(stage: &str) -> String {
    format!("{NUMERIC}\n{MEMORY}\n{stage}")
}

/// WGSL sources of every stage, by name (for tests and tools).
pub fn stage_sources() -> Vec<(&'static str, String)> {
    vec![
        ("gemm", stage_source(include_str!("../../shaders/gemm.wgsl"))),
        ("copy", stage_source(include_str!("../../shaders/copy.wgsl"))),
        ("reduce", stage_source(include_str!("../../shaders/reduce.wgsl"))),
        ("pointwise", stage_source(include_str!("../../shaders/pointwise.wgsl"))),
        ("attend", stage_source(include_str!("../../shaders/attend.wgsl"))),
        ("attn_state", stage_source(include_str!("../../shaders/attn_state.wgsl"))),
        ("generate", stage_source(include_str!("../../shaders/generate.wgsl"))),
        ("signal", stage_source(include_str!("../../shaders/signal.wgsl"))),
        ("route", stage_source(include_str!("../../shaders/route.wgsl"))),
        ("grouped_gemm", stage_source(include_str!("../../shaders/grouped_gemm.wgsl"))),
        ("combine", stage_source(include_str!("../../shaders/combine.wgsl"))),
    ]
}

impl Pipelines {
    fn new(device: &wgpu::Device, part_words: u64) -> Pipelines {
        let heap_part = |binding| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only: false },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("cmm heap + params"),
            entries: &[
                heap_part(HEAP_BINDINGS[0]),
                heap_part(HEAP_BINDINGS[1]),
                heap_part(HEAP_BINDINGS[2]),
                heap_part(HEAP_BINDINGS[3]),
                wgpu::BindGroupLayoutEntry {
                    binding: 1,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: true,
                        min_binding_size: wgpu::BufferSize::new(PARAMS_SIZE),
                    },
                    count: None,
                },
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("cmm pipeline layout"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        Pipelines { layout, pipeline_layout, part_words, one_part: OnceLock::new(), split: OnceLock::new() }
    }

    /// The stages for a heap of `heap_words` words, built on first use.
    pub fn stages(&self, device: &wgpu::Device, heap_words: usize) -> &Stages {
        let split = heap_words as u64 > self.part_words;
        let cell = if split { &self.split } else { &self.one_part };
        cell.get_or_init(|| self.build(device, split))
    }

    fn build(&self, device: &wgpu::Device, split: bool) -> Stages {
        let sources = stage_sources();
        let constants = [("PART_WORDS", self.part_words as f64), ("SPLIT_HEAP", if split { 1.0 } else { 0.0 })];
        let build = |name: &str| {
            let source = &sources.iter().find(|(n, _)| *n == name).expect("known stage").1;
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(name),
                source: wgpu::ShaderSource::Wgsl(source.as_str().into()),
            });
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(name),
                layout: Some(&self.pipeline_layout),
                module: &module,
                entry_point: Some("main"),
                compilation_options: wgpu::PipelineCompilationOptions { constants: &constants, ..Default::default() },
                cache: None,
            })
        };
        Stages {
            gemm: build("gemm"),
            copy: build("copy"),
            reduce: build("reduce"),
            pointwise: build("pointwise"),
            attend: build("attend"),
            attn_state: build("attn_state"),
            generate: build("generate"),
            signal: build("signal"),
            route: build("route"),
            grouped_gemm: build("grouped_gemm"),
            combine: build("combine"),
        }
    }
}

/// Words of one heap part on `device`: its largest storage binding (and buffer), in
/// whole words, at most 2^30 so that four parts stay within the u32 word index.
fn heap_part_words(device: &wgpu::Device) -> u64 {
    let l = device.limits();
    (l.max_storage_buffer_binding_size.min(l.max_buffer_size) / 4).min(1 << 30)
}

/// Names the backends the reference may use, as wgpu's own variable does (`vulkan`,
/// `gl`, …, comma-separated); unset, it tries Vulkan, then GL, then any.
pub const BACKEND_VAR: &str = "WGPU_BACKEND";

/// The backends Mesa gives a machine without a GPU (lavapipe's Vulkan, llvmpipe's GL),
/// the two the reference tries first.
pub const MESA_BACKENDS: [&str; 2] = ["vulkan", "gl"];

/// The backends `value` names. Unlike wgpu's `Backends::from_env`, which drops an
/// unknown name with a log line, a name that is not a backend is an error: a typo must
/// not quietly run the reference on another backend.
fn backends_named(value: &str) -> Result<wgpu::Backends, ReferenceError> {
    let mut backends = wgpu::Backends::empty();
    for name in value.split(',').map(str::trim) {
        backends |= match name.to_lowercase().as_str() {
            "vulkan" | "vk" => wgpu::Backends::VULKAN,
            "gl" | "gles" | "opengl" => wgpu::Backends::GL,
            "metal" | "mtl" => wgpu::Backends::METAL,
            "dx12" | "d3d12" => wgpu::Backends::DX12,
            _ => return Err(ReferenceError::UnknownBackend { value: value.into(), name: name.into() }),
        };
    }
    Ok(backends)
}

fn describe(info: &wgpu::AdapterInfo) -> String {
    format!("{} ({:?}, {:?}, driver {} {})", info.name, info.backend, info.device_type, info.driver, info.driver_info)
}

impl Gpu {
    /// Finds an adapter (Vulkan first, GL second, then any backend the platform offers;
    /// only the backends [`BACKEND_VAR`] names where it is set) and creates a device with
    /// the adapter's real limits.
    pub fn new() -> Result<Gpu, ReferenceError> {
        Gpu::from_adapter(&Gpu::find_adapter()?)
    }

    /// A device on the first adapter of the backends `names` names (as in
    /// [`BACKEND_VAR`]: `"vulkan"`, `"gl"`, …), whatever the variable says: tests that
    /// hold each backend to the twin's bits ask for each by name.
    pub fn on_backends(names: &str) -> Result<Gpu, ReferenceError> {
        let adapter = Gpu::adapter_on(names.to_string(), backends_named(names)?)
            .map_err(|tried| ReferenceError::NoAdapter { tried })?;
        Gpu::from_adapter(&adapter)
    }

    /// [`Gpu::new`] with heap parts of `part_words` words (see [`Gpu::with_heap_parts_of`]).
    pub fn new_with_heap_parts_of(part_words: u64) -> Result<Gpu, ReferenceError> {
        let gpu = Gpu::new()?;
        Ok(Gpu::with_heap_parts_of(gpu.info, gpu.device, gpu.queue, part_words))
    }

    fn find_adapter() -> Result<wgpu::Adapter, ReferenceError> {
        let order = match std::env::var(BACKEND_VAR) {
            Ok(value) => vec![(format!("{BACKEND_VAR}={value}"), backends_named(&value)?)],
            Err(std::env::VarError::NotUnicode(value)) => {
                let value = value.to_string_lossy().into_owned();
                return Err(ReferenceError::UnknownBackend { name: value.clone(), value });
            }
            Err(std::env::VarError::NotPresent) => vec![
                ("Vulkan".to_string(), wgpu::Backends::VULKAN),
                ("GL".to_string(), wgpu::Backends::GL),
                ("any".to_string(), wgpu::Backends::all()),
            ],
        };
        let mut tried = Vec::new();
        for (name, backends) in order {
            match Gpu::adapter_on(name, backends) {
                Ok(adapter) => return Ok(adapter),
                Err(name) => tried.push(name),
            }
        }
        Err(ReferenceError::NoAdapter { tried: tried.join(", ") })
    }

    /// The first adapter of `backends`, or `name` back when there is none.
    fn adapter_on(name: String, backends: wgpu::Backends) -> Result<wgpu::Adapter, String> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let request = instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        });
        pollster::block_on(request).map_err(|_| name)
    }

    /// Creates a device on a given adapter with the adapter's own limits.
    pub fn from_adapter(adapter: &wgpu::Adapter) -> Result<Gpu, ReferenceError> {
        let info = adapter.get_info();
        let request = adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("cmm reference"),
            required_features: wgpu::Features::empty(),
            required_limits: adapter.limits(),
            ..Default::default()
        });
        let (device, queue) = pollster::block_on(request)
            .map_err(|e| ReferenceError::RequestDevice { adapter: describe(&info), reason: e.to_string() })?;
        Ok(Gpu::from_device(info, device, queue))
    }

    /// Wraps a device the caller created (tests can pass their own).
    pub fn from_device(info: wgpu::AdapterInfo, device: wgpu::Device, queue: wgpu::Queue) -> Gpu {
        let part_words = heap_part_words(&device);
        Gpu::with_heap_parts_of(info, device, queue, part_words)
    }

    /// Wraps a device with heap parts of `part_words` words (at most the adapter's
    /// binding): small parts make small plans cross parts, which is how the tests check
    /// the split heap.
    pub fn with_heap_parts_of(
        info: wgpu::AdapterInfo,
        device: wgpu::Device,
        queue: wgpu::Queue,
        part_words: u64,
    ) -> Gpu {
        let part_words = part_words.clamp(1, heap_part_words(&device));
        let uncaptured = Arc::new(Mutex::new(Vec::new()));
        let sink = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut v) = sink.lock() {
                v.push(e.to_string());
            }
        }));
        let pipelines = Pipelines::new(&device, part_words);
        Gpu { info, device, queue, pipelines, uncaptured, part_words }
    }

    /// One line naming the adapter, its backend and driver.
    pub fn summary(&self) -> String {
        describe(&self.info)
    }

    /// The largest heap one run can bind, in bytes: four storage bindings of
    /// the adapter's largest binding each.
    pub fn max_heap_bytes(&self) -> u64 {
        HEAP_PARTS as u64 * self.heap_part_words() * 4
    }

    /// Words of one heap part (normally the adapter's largest storage binding, in whole
    /// words).
    pub fn heap_part_words(&self) -> u64 {
        self.part_words
    }

    pub(crate) fn take_uncaptured(&self) -> Option<String> {
        let mut v = self.uncaptured.lock().ok()?;
        if v.is_empty() {
            None
        } else {
            Some(std::mem::take(&mut *v).join("; "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_are_wgpus_and_a_typo_is_an_error() {
        assert_eq!(backends_named("vulkan").unwrap(), wgpu::Backends::VULKAN);
        assert_eq!(backends_named(" GL , vk").unwrap(), wgpu::Backends::GL | wgpu::Backends::VULKAN);
        match backends_named("vulkan,vulcan") {
            Err(ReferenceError::UnknownBackend { value, name }) => {
                assert_eq!((value.as_str(), name.as_str()), ("vulkan,vulcan", "vulcan"))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(backends_named(""), Err(ReferenceError::UnknownBackend { .. })));
    }
}
