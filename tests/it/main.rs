//! One integration-test binary (one link): golden checks against transformers + PEFT, driver
//! invariants, and the real CLI.

mod chat;
mod cli;
mod common;
mod data;
mod data_cli;
mod golden;
mod hub;
mod invariants;
mod ops;
