//! `lora-train train`: recipe → model + adapters → data → steps → PEFT adapter.
//!
//! One optimiser step = `grad_accum` micro-batches of `micro_batch` rows. The loss of a step is
//! the mean token cross-entropy over all its counted tokens (not a mean of micro-batch means).
//!
//! defines, in the order a run uses them: `launch` (the ranks: this thread, a thread per
//! device, or a launcher's processes), `preflight` (the memory plan checked before loading),
//! `session` (one rank's model, shards, communicator and data), `step` (the step engine that
//! train, bench and probe share, over `driver`'s layer-wise forward and backward, `optim`,
//! `readback`), `trainer` (the loop: log, eval, checkpoints, stops), `log`, `checkpoint` (its
//! files copied to the host by `host_stage`, written by `checkpoint_write`), `stop`,
//! `schedule`, `eval`, `offload`; `owner` (the output directory's lock, for the run's life).

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
