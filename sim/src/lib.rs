//! cmm-sim: the simulator, the third executor of a plan beside the wgpu reference and
//! CUDA (BRIEF §5), with its hardware profiles (`sim/profiles/*.toml`), the analytic
//! cost models, the autotuner and timelines. Shapes only: nothing here allocates a
//! tensor.

pub mod engine;
pub mod profile;
pub mod topology;

pub use engine::{simulate, Engines, HardwareQueues, OpClass, OpRecord, SimError, SimOptions, SimReport};
pub use profile::{Profile, ProfileError, TopologyKind};
pub mod analytic;
pub mod calibration;
pub mod timeline;
pub mod tune;
pub mod validate;
