//! One integration-test binary (one link): golden checks against transformers + PEFT, driver
//! invariants, and the real CLI.

mod cli;
mod common;
mod golden;
mod hub;
mod invariants;
mod ops;
