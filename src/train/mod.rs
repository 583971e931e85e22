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

pub mod checkpoint;
pub mod comm;
pub(crate) mod checkpoint_check;
pub(crate) mod checkpoint_write;
pub mod driver;
pub mod eval;
pub mod flat;
pub(crate) mod first_epoch;
pub mod host_stage;
pub mod kto_loss;
pub(crate) mod log;
pub mod objective;
pub(crate) mod offload;
pub mod optim;
pub mod pref_loss;
pub(crate) mod pref_objective;
pub(crate) mod pref_precompute;
pub(crate) mod pref_ref;
pub(crate) mod pref_store;
pub mod ranks;
pub(crate) mod preflight;
pub mod readback;
pub(crate) mod resolve;
pub(crate) mod run_check;
pub(crate) mod run_config;
pub(crate) mod run_loop;
pub(crate) mod schedule;
pub mod session;
pub mod shards;
pub mod step;
pub mod stop;
pub mod train_data;
pub(crate) mod trainer;

pub use comm::{Comm, Solo};
pub use ranks::EnvRank;
pub(crate) use ranks::Ranks;
pub use resolve::{load_recipe, Machine};
pub use run_config::RunConfig;
pub use session::Session;
pub use train_data::TrainData;

use std::path::PathBuf;

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// The step the run ended at (a resumed run counts its earlier steps).
    pub steps: usize,
    /// The training loss of each step this process ran, in order.
    pub losses: Vec<f64>,
    /// The run's output directory.
    pub out_dir: PathBuf,
    /// Tokens this process trained on (the count the logged rate divides).
    pub tokens: usize,
    /// Seconds since this process's training log started.
    pub seconds: f64,
    /// Training examples cut to seq_len.
    pub truncated: usize,
    /// The last eval loss (at the end), when there is an eval set.
    pub eval_loss: Option<f64>,
    /// Bad rows skipped (data.on_bad_row = "skip").
    pub skipped: usize,
}

/// How `run_with` may deviate from the recipe.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Start even when the memory plan says the run does not fit.
    pub force: bool,
}
