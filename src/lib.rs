//! lora-train: LoRA fine-tuning of Hugging Face Llama-family checkpoints on candle.
//!
//! The modules in the order a run's data goes through them; `ops` (the layers' kernels and
//! their CPU references) lies beneath the model, `util` and `rng` beneath everything.

// A recipe (TOML + --set) read, checked and resolved.
pub mod recipe;
// The checkpoint's files: a local directory or the Hugging Face Hub and its cache.
pub mod hub;
// The decoder (Llama, Mistral, Qwen2), its layers' forward and hand-written backward.
pub mod model;
// The frozen base in 4 bits (QLoRA): bitsandbytes' NF4, made at load or read as saved.
pub mod quant;
// The adapters: their shape, init and dropout.
pub mod lora;
// Examples read, tokenized, batched, packed and sampled.
pub mod data;
// The step engine, the training loop, checkpoints, stops.
pub mod train;
// Ranks and their communicators (CPU threads, NCCL), FSDP's shards.
pub mod parallel;
// Device memory: the plan, the pool's peaks, the OOM diagnosis.
pub mod memory;
// The PEFT adapter and the merged model written.
pub mod export;
// Trying the result: decoding with a KV cache; a run's curves drawn.
pub mod generate;
pub mod report;
// `lora-train bench` and `lora-train probe`: the engine on random weights and batches.
pub mod bench;
pub mod probe;

// The kernels (CUDA and their CPU references) the layers run on.
pub mod ops;
// Seeded random streams.
pub mod rng;
// What a run reports as it goes: TensorBoard event files, an MLflow server.
pub mod track;
// Crash-safe writes, sizes, ids.
pub mod util;
