//! A rank's `train::Session` opened from above: resolved from a recipe (`Session::new`), its
//! init adapter read by export's PEFT reader (`Session::load`).

use super::resolve::Machine;
use crate::export;
use crate::train::{Comm, RunConfig, Session, Solo};
use anyhow::Result;
use std::sync::Arc;

impl Session {
    /// A one-rank session of `recipe` on its first device (tests, tools): resolved and
    /// loaded, no preflight.
    pub fn new(recipe: crate::recipe::Recipe) -> Result<Session> {
        let run = Arc::new(RunConfig::resolve(recipe, Machine::Open)?);
        let ordinal = run.first_ordinal();
        Self::load(run, Box::new(Solo), ordinal)
    }

    /// The session of rank `comm.rank()` on CUDA device `ordinal` (`Session::load_with`), its
    /// adapters lora.init_adapter's where the run names one.
    pub fn load(run: Arc<RunConfig>, comm: Box<dyn Comm>, ordinal: usize) -> Result<Session> {
        Session::load_with(run, comm, ordinal, &|p, m| {
            export::load_adapter_weights(p, m)
        })
    }
}
