//! `lora-train train`: recipe → model + adapters → data → steps → PEFT adapter.
//!
//! One optimiser step = `grad_accum` micro-batches of `micro_batch` rows. The loss of a step is
//! the mean token cross-entropy over all its counted tokens (not a mean of micro-batch means).
//!
//! defines the engine, one rank's training: `run_config` (the resolved run; run::resolve makes
//! it), `ranks` and `comm` (where the ranks are, and what the step asks of them: `Comm`,
//! implemented by parallel/), `session` (one rank's model, shards (`shards`, `flat`),
//! communicator and memory watch), `train_data`, the step engine that train, bench and probe
//! share (`step`, over `driver`'s layer-wise forward and backward, the objectives, `optim`,
//! `readback`, `offload`, `sizes`, `meter`), `run_loop` (the one loop over `Hooks`), `eval`,
//! `schedule`, `stop`, `run_check`, `fingerprint`. run/ wires it to the layers above: the
//! resolution, the preflight, the ranks, the trainer's hooks and the checkpoints.

pub mod comm;
pub mod driver;
pub mod eval;
pub mod fingerprint;
pub mod flat;
pub(crate) mod first_epoch;
pub mod kto_loss;
pub mod objective;
pub mod meter;
pub(crate) mod offload;
pub mod optim;
pub mod pref_loss;
pub(crate) mod pref_objective;
pub(crate) mod pref_precompute;
pub(crate) mod pref_ref;
pub(crate) mod pref_store;
pub mod ranks;
pub mod readback;
pub(crate) mod run_check;
pub(crate) mod run_config;
pub(crate) mod run_loop;
pub(crate) mod schedule;
pub mod session;
pub mod shards;
pub mod sizes;
pub mod step;
pub mod stop;
pub mod train_data;

pub use comm::{Comm, Solo};
pub use ranks::EnvRank;
pub(crate) use ranks::Ranks;
pub use run_config::RunConfig;
pub use session::Session;
pub use train_data::TrainData;
