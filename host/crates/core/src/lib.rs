//! tokwatt's bottom layer: the words every other crate speaks and the boundaries as traits.
//!
//! - [`types`]: one GPU's observation of a tick, the settings a policy asks for, the
//!   operator's objective.
//! - [`telemetry`], [`actuator`], [`workload`]: the three boundaries to a GPU and its work
//!   (NVML, the simulator and the CUDA decode implement them in their own crates).
//! - [`model`]: model shapes as data; [`clock`]: wall and virtual time; [`rng`]: the seeded
//!   random source runs replay from; [`quantile`], [`files`]: small shared arithmetic and
//!   bounded reads; [`privileges`]: whether this process may change GPU settings.
//!
//! Nothing here knows wasmtime, NVML, CUDA or tokio.

pub mod actuator;
pub mod clock;
pub mod files;
pub mod model;
pub mod privileges;
pub mod quantile;
pub mod rng;
pub mod telemetry;
pub mod types;
pub mod workload;
