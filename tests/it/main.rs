//! One integration-test binary (one link): golden checks against transformers + PEFT, driver
//! invariants, the real CLI, checkpoints and exact resume, and the merged export.

mod chat;
mod cli;
mod common;
mod compat;
mod data;
mod data_cli;
mod generate;
mod golden;
mod hub;
mod invariants;
mod merge;
mod ops;
mod parallel;
mod plan;
mod report;
mod resume;
