//! One integration-test binary (one link): golden checks against transformers + PEFT, driver
//! invariants, the real CLI, checkpoints and exact resume, and the merged export.

mod cli;
mod common;
mod compat;
mod golden;
mod invariants;
mod merge;
mod resume;
