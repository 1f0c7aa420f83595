//! The simulator (the third executor, BRIEF §5), its hardware profiles, the analytic cost
//! models and the autotuner. Shapes only: nothing here allocates a tensor.

pub mod engine;
pub mod profile;
pub mod topology;

pub use engine::{simulate, Engines, OpClass, OpRecord, SimError, SimOptions, SimReport};
pub use profile::{Profile, ProfileError, TopologyKind};
pub mod analytic;
pub mod calibration;
pub mod tune;
pub mod validate;
