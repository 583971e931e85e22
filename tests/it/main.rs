//! One integration-test binary (one link): golden checks against transformers + PEFT, driver
//! invariants, the real CLI, checkpoints and exact resume, the merged export, Hub models and
//! data sets against loopback servers (and one that lies), every shipped recipe, and faults
//! around a run: signals, locks, failing output streams.

mod adapter_base;
mod bad_input;
mod chat;
mod cli;
mod common;
mod compat;
mod data;
mod data_cache;
mod data_cli;
mod data_prepare;
mod data_stream;
mod dora;
mod dropout;
mod export_signals;
mod fault_corpus;
mod first_hour;
mod generate;
mod gguf;
mod golden;
mod grad_fd;
mod host_memory;
mod house;
mod hub;
mod hub_data;
mod hub_faults;
mod hub_names;
mod invariants;
mod liar;
mod locks;
mod loopback;
mod merge;
mod moe;
mod moe_nf4;
mod newcomer;
mod nf4;
mod odd_dirs;
mod ops;
mod output_streams;
mod parallel;
mod pref;
mod pref_precompute;
mod plan;
mod process_ranks;
mod qlora;
mod qmerge;
mod quick_start;
mod recipes;
mod report;
mod resume;
mod track;
