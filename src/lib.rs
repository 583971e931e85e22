//! lora-train: LoRA fine-tuning of Hugging Face checkpoints (llama, mistral, qwen2, qwen3,
//! gemma2, gemma3_text, phi3, qwen3_moe) on candle, on one GPU, many GPUs or the CPU.
//!
//! The layers, issue 62's hallway: recipe → hub → model → lora → data → train → parallel →
//! memory → export, ops beneath; generate and report read their results; `run` assembles a
//! run from them all (the recipe resolved, the memory preflight, the ranks launched, the
//! trainer's hooks, which sample through generate), and bench and probe sit above. The modules
//! below are listed in their import layers, from the bottom: each imports only modules listed
//! before it (docs/design.md, "The house", holds the same list, and tests/it/house.rs holds the
//! code to both and to the order).

// Output goes through util::out (outln!, errln!): println! and eprintln! panic on a closed pipe
// or a full disk.
#![warn(clippy::print_stdout, clippy::print_stderr)]
// Every item reachable from the crate's API says what it is (shapes, units).
#![warn(missing_docs)]
// Every unsafe block says why it is sound (ops/mod.rs states the launch contract).
#![warn(clippy::undocumented_unsafe_blocks)]

/// Small helpers every module may use: crash-safe files, directories and locks, sizes, Hub
/// ids, output that never panics.
pub mod util;
/// Seeded random streams (adapter init, dropout, shuffling, random rows).
pub mod rng;
/// The layers' kernels: CUDA and their CPU references; every kernel choice in one value.
pub mod ops;
/// A recipe (TOML + `--set`): plain data, read and checked.
pub mod recipe;
/// What a run reports as it goes: TensorBoard event files, an MLflow server.
pub mod track;
/// Where a checkpoint's files are: a local directory, or the Hugging Face Hub and its cache.
pub mod hub;
/// The frozen base in 4 bits (QLoRA): bitsandbytes' NF4, made at load or read as saved.
pub mod quant;
/// The decoder of every family, its layers' forward and hand-written backward.
pub mod model;
/// The adapters: what to inject (rank, scale, dropout, DoRA, targets), their init, and their
/// injection into a built model's slots.
pub mod lora;
/// Examples read, tokenized, batched, packed and sampled.
pub mod data;
/// One rank's training: the resolved run, its session, the step engine (the step, the
/// objectives, the optimiser), the one loop over `Hooks`, what it asks of its ranks (`Comm`).
pub mod train;
/// Ranks and their communicators (CPU threads, TCP processes, NCCL): `train::Comm`'s backends.
pub mod parallel;
/// Device memory for a run: the plan, the host's memory, the ballast of `train.max_memory`.
pub mod memory;
/// The PEFT adapter written and read; the merged model; GGUF and Ollama.
pub mod export;
/// Trying the result: decoding with a KV cache.
pub mod generate;
/// A run's curves drawn from its metrics.jsonl.
pub mod report;
/// A run assembled from the layers: the recipe resolved, the memory preflight, the ranks
/// launched, the trainer's hooks (log, checkpoints, stops), the output directory owned.
pub mod run;
/// `lora-train bench`: training steps timed on random weights of a named shape.
pub mod bench;
/// `lora-train probe`: the smoke ramp to the first out-of-memory.
pub mod probe;
