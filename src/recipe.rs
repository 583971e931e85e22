//! Recipes: one TOML file per run, `--set section.key=value` overrides on top.
//!
//! Every field is documented here with its default; `recipes/reference.toml` spells them all
//! out and a test keeps it in step. Unknown keys are errors. Relative paths written in a recipe
//! are relative to the recipe file's directory (so recipes work from any working directory);
//! paths given with `--set` are relative to the current directory.

pub mod bounds;

use serde::{de, Deserialize, Deserializer, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A recipe that cannot be used as written. Exit code 2; nothing has been written yet.
#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    #[error("cannot read recipe {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("recipe {path}: {msg}")]
    Parse { path: PathBuf, msg: String },
    #[error("recipe {path}: `{key}` {msg}")]
    Invalid {
        path: PathBuf,
        key: String,
        msg: String,
    },
    #[error("--set {arg}: {msg}")]
    Override { arg: String, msg: String },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub model: ModelSection,
    #[serde(default)]
    pub lora: LoraSection,
    pub data: DataSection,
    #[serde(default)]
    pub train: TrainSection,
    #[serde(default)]
    pub parallel: ParallelSection,
    #[serde(default)]
    pub output: OutputSection,
    /// The recipe file this came from (not a TOML key).
    #[serde(skip)]
    pub source: PathBuf,
    /// The --set overrides it was loaded with, in order (not a TOML key).
    #[serde(skip)]
    pub sets: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

/// `[model]`: which checkpoint, in which precision, where.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Local Hugging Face checkpoint directory (config.json + safetensors). One of path / id.
    pub path: Option<PathBuf>,
    /// Hub repository id, e.g. "meta-llama/Llama-2-7b-hf". One of path / id.
    pub id: Option<String>,
    /// Hub revision (branch, tag or commit). Default: "main".
    pub revision: Option<String>,
    /// Base weight precision: "f32" | "bf16" | "f16". Default: "f32" on the CPU, "bf16" on CUDA.
    /// Adapters and optimiser state are always f32.
    pub dtype: Option<Dtype>,
    /// "cpu" | "cuda". Default: "cpu".
    #[serde(default = "default_device")]
    pub device: DeviceKind,
    /// The frozen linears of the decoder layers in 4 bits (QLoRA): "nf4" (bitsandbytes' NF4,
    /// quantized layer by layer as the checkpoint loads, dequantized just in time for each
    /// layer's GEMMs) | "none". Default: "none". Not yet with `parallel.strategy = "fsdp"`.
    #[serde(default)]
    pub quantize: crate::quant::Quantize,
    /// With quantize = "nf4": the absmax values quantized again to 8 bits in blocks of 256
    /// (bitsandbytes' `bnb_4bit_use_double_quant`), 0.37 fewer bits a weight. Default: true.
    #[serde(default = "d_true")]
    pub double_quant: bool,
}

fn default_device() -> DeviceKind {
    DeviceKind::Cpu
}

/// `[lora]`: the adapters.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraSection {
    /// Adapter rank r. Default: 8.
    #[serde(default = "d_rank")]
    pub rank: usize,
    /// Scale numerator: scale = alpha / r (alpha / √r with rslora). Default: 16.
    #[serde(default = "d_alpha")]
    pub alpha: f64,
    /// Dropout on the adapter input, in [0, 1). Default: 0.
    #[serde(default)]
    pub dropout: f64,
    /// Module names to adapt (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; Phi-3's
    /// qkv_proj o_proj gate_up_proj down_proj), or "all-linear" for all of the model's.
    /// Default: ["q_proj", "v_proj"] (PEFT's Llama default).
    #[serde(default = "d_targets")]
    pub targets: Targets,
    /// rsLoRA scaling alpha / √r. Default: false.
    #[serde(default)]
    pub rslora: bool,
    /// DoRA (PEFT's `use_dora`): each adapter also trains a magnitude per output row,
    /// y = (m / ‖W + s·B A‖_row) ⊙ (x Wᵀ + s·x Aᵀ Bᵀ) + bias. Needs dropout = 0; not with
    /// FSDP or train.sample_every. Default: false.
    #[serde(default)]
    pub use_dora: bool,
    /// A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to continue
    /// from. Its r, lora_alpha, target_modules and use_rslora replace the values above
    /// (`dropout` still comes from this recipe).
    pub init_adapter: Option<PathBuf>,
}

fn d_rank() -> usize {
    8
}
fn d_alpha() -> f64 {
    16.0
}
fn d_targets() -> Targets {
    Targets::List(vec!["q_proj".into(), "v_proj".into()])
}

impl Default for LoraSection {
    fn default() -> Self {
        LoraSection {
            rank: d_rank(),
            alpha: d_alpha(),
            dropout: 0.0,
            targets: d_targets(),
            rslora: false,
            use_dora: false,
            init_adapter: None,
        }
    }
}

/// `lora.targets`: a list of module names or "all-linear".
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Targets {
    AllLinear(String),
    List(Vec<String>),
}

impl<'de> Deserialize<'de> for Targets {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Targets;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of module names or \"all-linear\"")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Targets, E> {
                if s == "all-linear" || s == "all" {
                    Ok(Targets::AllLinear("all-linear".into()))
                } else {
                    Err(E::custom(format!(
                        "expected a list of module names or \"all-linear\", found \"{s}\""
                    )))
                }
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut a: A) -> Result<Targets, A::Error> {
                let mut v = Vec::new();
                while let Some(s) = a.next_element::<String>()? {
                    v.push(s);
                }
                Ok(Targets::List(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// `train.activation_checkpointing`: what forward keeps of each decoder layer for backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Checkpointing {
    /// Every activation (false).
    #[default]
    Off,
    /// The attention half's activations and the residual; backward recomputes the MLP half
    /// ("mlp": its gate and up are most of a layer's activations).
    Mlp,
    /// The layer's input only; backward recomputes the whole layer (true).
    Full,
}

impl Checkpointing {
    /// Whether backward recomputes anything.
    pub fn on(self) -> bool {
        self != Checkpointing::Off
    }

    /// As the recipe writes it: false, "mlp", true.
    pub fn name(self) -> &'static str {
        match self {
            Checkpointing::Off => "false",
            Checkpointing::Mlp => "\"mlp\"",
            Checkpointing::Full => "true",
        }
    }
}

impl From<bool> for Checkpointing {
    fn from(on: bool) -> Self {
        match on {
            true => Checkpointing::Full,
            false => Checkpointing::Off,
        }
    }
}

impl Serialize for Checkpointing {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Checkpointing::Off => s.serialize_bool(false),
            Checkpointing::Mlp => s.serialize_str("mlp"),
            Checkpointing::Full => s.serialize_bool(true),
        }
    }
}

impl<'de> Deserialize<'de> for Checkpointing {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Checkpointing;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("true, false or \"mlp\"")
            }
            fn visit_bool<E: de::Error>(self, on: bool) -> Result<Checkpointing, E> {
                Ok(on.into())
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Checkpointing, E> {
                match s {
                    "mlp" => Ok(Checkpointing::Mlp),
                    "true" | "full" => Ok(Checkpointing::Full),
                    "false" | "off" => Ok(Checkpointing::Off),
                    _ => Err(E::custom(format!(
                        "expected true, false or \"mlp\" (recompute the MLP half only), found \"{s}\""
                    ))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// jsonl rows {"input_ids": [...], "labels": [...]?}; labels default to input_ids.
    Tokens,
    /// jsonl rows {"text": "..."}, tokenized with the model's tokenizer.json.
    Text,
    /// jsonl rows {"instruction", "input"?, "output"}, in the Stanford Alpaca prompt.
    Alpaca,
    /// jsonl rows {"messages": [{"role", "content"}, ...]}, rendered with the model's chat
    /// template.
    Chat,
    /// jsonl rows {"prompt", "completion"} (field names: data.prompt_field / completion_field).
    Completion,
}

/// `data.train_on`: which tokens are trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainOn {
    /// Every token.
    All,
    /// Only completions (alpaca output, completion, assistant turns) and the EOS or
    /// end-of-turn token after each; prompts and system / user turns get label -100.
    Completions,
}

/// `data.on_bad_row`: what a malformed row does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBadRow {
    /// Stop with the file, the line and the reason.
    Error,
    /// Skip it; skipped rows are counted and reported (first one quoted).
    Skip,
}

/// `data.train`: one jsonl file, or several mixed with weights.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum TrainFiles {
    One(PathBuf),
    Mix(Vec<TrainFile>),
}

/// One file of a `data.train` mix: `{ path = "a.jsonl", weight = 2.0, format = "chat" }`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainFile {
    /// The data file (.jsonl, .json, .parquet) or Hub data set ("hf://datasets/ORG/NAME").
    /// Required.
    pub path: PathBuf,
    /// How many times each of its examples is seen per epoch, on average: 2.0 = twice,
    /// 0.5 = a seeded half, a different half each epoch. Default: 1.0.
    #[serde(default = "d_weight")]
    pub weight: f64,
    /// This file's format. Default: data.format.
    pub format: Option<DataFormat>,
    /// For an hf:// data set: its split, subset, revision and files glob. Default: data.split,
    /// data.subset, data.revision, data.files.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subset: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<String>,
    /// This file's column mapping. Default: data.columns.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub columns: Option<BTreeMap<String, String>>,
}

fn d_weight() -> f64 {
    1.0
}

impl TrainFiles {
    /// The file names, for messages.
    pub fn describe(&self) -> String {
        match self {
            TrainFiles::One(p) => p.display().to_string(),
            TrainFiles::Mix(v) => v
                .iter()
                .map(|f| f.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    /// Every file with its weight and format (`default` where the file names none).
    pub fn files(&self, default: DataFormat) -> Vec<TrainFile> {
        match self {
            TrainFiles::One(p) => vec![TrainFile {
                path: p.clone(),
                weight: 1.0,
                format: Some(default),
                ..TrainFile::default()
            }],
            TrainFiles::Mix(v) => v
                .iter()
                .map(|f| TrainFile {
                    format: Some(f.format.unwrap_or(default)),
                    ..f.clone()
                })
                .collect(),
        }
    }
}

impl<'de> Deserialize<'de> for TrainFiles {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = TrainFiles;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a jsonl path, or a list of { path, weight, format } tables")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<TrainFiles, E> {
                Ok(TrainFiles::One(PathBuf::from(s)))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut a: A) -> Result<TrainFiles, A::Error> {
                let mut v = Vec::new();
                while let Some(f) = a.next_element::<TrainFile>()? {
                    v.push(f);
                }
                Ok(TrainFiles::Mix(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// `[data]`: what to train on.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// Training data: a file (.jsonl or .json: JSON lines or a JSON array of rows; .parquet),
    /// a Hub data set "hf://datasets/ORG/NAME", or several mixed with weights:
    /// `[{ path = "a.jsonl", weight = 2.0 }, { path = "b.jsonl", format = "chat" }]`. Required.
    pub train: TrainFiles,
    /// "tokens" | "text" | "alpaca" | "chat" | "completion". Default: "text".
    #[serde(default = "d_format")]
    pub format: DataFormat,
    /// Tokens per row; longer rows are truncated (and counted). Default: 512.
    #[serde(default = "d_seq_len")]
    pub seq_len: usize,
    /// Shuffle the example order each epoch (seeded by train.seed). Default: true.
    #[serde(default = "d_true")]
    pub shuffle: bool,
    /// Pack several examples into each row of seq_len tokens, with no attention across
    /// examples and positions restarting at each. Default: false.
    #[serde(default)]
    pub pack: bool,
    /// "all" | "completions" (prompts, system and user turns get label -100; the EOS or
    /// end-of-turn token ends every completion). Default: "completions" for alpaca, chat and
    /// completion, "all" for text and tokens.
    pub train_on: Option<TrainOn>,
    /// The prompt field of "completion" rows. Default: "prompt".
    #[serde(default = "d_prompt_field")]
    pub prompt_field: String,
    /// The completion field of "completion" rows. Default: "completion".
    #[serde(default = "d_completion_field")]
    pub completion_field: String,
    /// The chat template for "chat" rows: a path to a .jinja file, or the name of one of the
    /// templates tokenizer_config.json lists. Default: the model's chat_template.jinja, else
    /// tokenizer_config.json's chat_template (its "default" when it lists several).
    pub chat_template: Option<String>,
    /// Eval file (in data.format), or a Hub data set (its split: data.eval_split). Default:
    /// none.
    pub eval: Option<PathBuf>,
    /// Hold out this fraction of the training examples (seeded) as the eval set, in [0, 1).
    /// Default: 0.
    #[serde(default)]
    pub eval_fraction: f64,
    /// "error" | "skip": what a malformed row does. Default: "error".
    #[serde(default = "d_on_bad_row")]
    pub on_bad_row: OnBadRow,
    /// hf:// data sets: the split to read ("train", "test", "train_sft", ...). Default: "train".
    pub split: Option<String>,
    /// hf:// data sets: the subset (configuration), a folder of the repository, e.g. "main".
    /// Default: none (the data set's only one).
    pub subset: Option<String>,
    /// hf:// data sets: branch, tag or commit. Default: "main".
    pub revision: Option<String>,
    /// hf:// data sets: a glob of repository paths to read instead of split and subset, e.g.
    /// "data/train-*.parquet". Default: none.
    pub files: Option<String>,
    /// An hf:// data.eval: its split. Default: "test".
    pub eval_split: Option<String>,
    /// Our field names → the data set's column names, for rows whose fields are named
    /// otherwise: `{ instruction = "question", output = "answer" }`. Default: {} (as named).
    #[serde(default)]
    pub columns: BTreeMap<String, String>,
}

impl DataSection {
    /// `train_on` for a file of `format`: as set, or the format's default.
    pub fn train_on_for(&self, format: DataFormat) -> TrainOn {
        self.train_on.unwrap_or(match format {
            DataFormat::Tokens | DataFormat::Text => TrainOn::All,
            _ => TrainOn::Completions,
        })
    }
}

fn d_prompt_field() -> String {
    "prompt".into()
}
fn d_completion_field() -> String {
    "completion".into()
}
fn d_on_bad_row() -> OnBadRow {
    OnBadRow::Error
}

fn d_format() -> DataFormat {
    DataFormat::Text
}
/// `train.offload_activations` when the recipe does not say (CUDA only: the CPU recomputes).
pub const OFFLOAD_ACTIVATIONS_DEFAULT: bool = true;

fn d_seq_len() -> usize {
    512
}
fn d_true() -> bool {
    true
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Constant,
    Linear,
    Cosine,
}

/// `[train]`: optimisation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// Rows per forward/backward. Default: 1.
    #[serde(default = "d_one")]
    pub micro_batch: usize,
    /// Micro-batches per optimiser step. Default: 1.
    #[serde(default = "d_one")]
    pub grad_accum: usize,
    /// Optimiser steps to take; wins over `epochs` when both are set.
    pub max_steps: Option<usize>,
    /// Passes over the data when max_steps is not set. Default: 1.
    pub epochs: Option<usize>,
    /// Peak learning rate. Default: 2e-4.
    #[serde(default = "d_lr")]
    pub lr: f64,
    /// AdamW decoupled weight decay. Default: 0.
    #[serde(default)]
    pub weight_decay: f64,
    /// AdamW betas. Default: [0.9, 0.999].
    #[serde(default = "d_betas")]
    pub betas: [f64; 2],
    /// AdamW epsilon. Default: 1e-8.
    #[serde(default = "d_eps")]
    pub eps: f64,
    /// "constant" | "linear" | "cosine" (decay to 0 at the last step). Default: "cosine".
    #[serde(default = "d_schedule")]
    pub schedule: Schedule,
    /// Linear warmup from 0 over this many steps (transformers' schedules). Default: 0.
    #[serde(default)]
    pub warmup_steps: usize,
    /// Clip the global gradient norm to this (0 disables). Default: 1.0.
    #[serde(default = "d_clip")]
    pub max_grad_norm: f64,
    /// Seed for adapter init, shuffling and dropout. Default: 42.
    #[serde(default = "d_seed")]
    pub seed: u64,
    /// What forward keeps for backward: false (every activation), true (each decoder layer's
    /// input only: backward recomputes the layer) or "mlp" (the attention half's activations:
    /// backward recomputes the MLP half, its gate and up GEMMs). Default: false.
    #[serde(default)]
    pub activation_checkpointing: Checkpointing,
    /// CUDA, without checkpointing: park each layer's residual (after attention, [tokens,
    /// hidden]) in pinned host memory between its forward and backward, copied beside the
    /// compute, instead of recomputing it in backward with o_proj's GEMM (false) — 2 × tokens
    /// × hidden bytes per layer of host memory (1 GiB at 7B, micro-batch 2 × 2048), none of
    /// the GPU's. Ignored on the CPU (recomputed). Default: true
    /// (`OFFLOAD_ACTIVATIONS_DEFAULT`).
    #[serde(default)]
    pub offload_activations: Option<bool>,
    /// Write a progress line / metrics row every this many steps. Default: 1.
    #[serde(default = "d_one")]
    pub log_every: usize,
    /// Eval loss every this many steps (0 = only at the end), when data.eval or
    /// data.eval_fraction gives an eval set. Default: 0.
    #[serde(default)]
    pub eval_every: usize,
    /// Continue from a checkpoint, exactly: `true` = the newest complete checkpoint-<step>/ in
    /// the output directory (none: start fresh), or the path of one checkpoint directory.
    /// The recipe must match the checkpoint's in everything that changes the numbers.
    /// Default: false (start fresh).
    #[serde(default)]
    pub resume: Resume,
    /// Print the greedy completion of each of `sample_prompts` every this many steps (and
    /// append them to samples.jsonl in the output directory); 0 = off. Needs the model's
    /// tokenizer. Default: 0.
    #[serde(default)]
    pub sample_every: usize,
    /// The prompts `sample_every` completes (text, encoded as the tokenizer says, no EOS).
    /// Default: [].
    #[serde(default)]
    pub sample_prompts: Vec<String>,
    /// On a non-finite loss or gradient, skip that step's update (and count it) instead of
    /// stopping the run. Default: false.
    #[serde(default)]
    pub skip_nonfinite: bool,
    /// Only kernels whose sums run in a fixed order, so that a run repeats bit for bit on the
    /// same GPU (CUDA: flash attention's dQ in a kernel of its own; a little slower). Default:
    /// false.
    #[serde(default)]
    pub deterministic: bool,
    /// Device memory per rank, e.g. "24GiB": on CUDA the run holds the rest of the card
    /// (cuMemAlloc, outside the pool) so it behaves as a card of this size and runs out of
    /// memory for real; the preflight check compares the memory plan with it. On the CPU it
    /// caps an accounting of the tensor bytes the trainer holds. Default: unset (the card).
    pub max_memory: Option<String>,
    /// A layer's MLP (norm, gate / up, activation, down) runs over chunks of this many tokens
    /// of the micro-batch: in backward always, and with activation checkpointing in forward and
    /// its recompute too, so that its [tokens, intermediate] tensors exist for one chunk at a
    /// time (long context). A multiple of 64; 0: never chunked. Not with dropout on an MLP adapter (runs
    /// whole). Default: 16384 (`model::layer_mlp::MLP_CHUNK`).
    #[serde(default = "d_mlp_chunk")]
    pub mlp_chunk: usize,
    /// A MoE model's router load-balancing loss (transformers' `load_balancing_loss_func`)
    /// joins the loss × this weight; padding does not count. Qwen3-MoE's config.json writes
    /// 0.001 for it, but transformers adds it only with output_router_logits: here too only
    /// when set. Default: 0 (off).
    #[serde(default)]
    pub router_aux_loss_coef: f64,
}

fn d_mlp_chunk() -> usize {
    crate::model::layer_mlp::MLP_CHUNK
}

/// `train.mlp_chunk`'s bound: a chunk of more tokens than any micro-batch could hold.
pub const MLP_CHUNK_MAX: usize = 1 << 24;

/// `train.resume`: false | true | "path/to/checkpoint-<step>".
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Resume {
    Flag(bool),
    Path(PathBuf),
}

impl Default for Resume {
    fn default() -> Self {
        Resume::Flag(false)
    }
}

impl<'de> Deserialize<'de> for Resume {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Resume;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("true, false or the path of a checkpoint directory")
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<Resume, E> {
                Ok(Resume::Flag(b))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Resume, E> {
                Ok(Resume::Path(PathBuf::from(s)))
            }
        }
        d.deserialize_any(V)
    }
}

fn d_one() -> usize {
    1
}
fn d_lr() -> f64 {
    2e-4
}
fn d_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn d_eps() -> f64 {
    1e-8
}
fn d_schedule() -> Schedule {
    Schedule::Cosine
}
fn d_clip() -> f64 {
    1.0
}
fn d_seed() -> u64 {
    42
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            micro_batch: 1,
            grad_accum: 1,
            max_steps: None,
            epochs: None,
            lr: d_lr(),
            weight_decay: 0.0,
            betas: d_betas(),
            eps: d_eps(),
            schedule: d_schedule(),
            warmup_steps: 0,
            max_grad_norm: d_clip(),
            seed: d_seed(),
            activation_checkpointing: Checkpointing::Off,
            offload_activations: None,
            log_every: 1,
            eval_every: 0,
            sample_every: 0,
            sample_prompts: Vec::new(),
            resume: Resume::default(),
            skip_nonfinite: false,
            deterministic: false,
            max_memory: None,
            mlp_chunk: d_mlp_chunk(),
            router_aux_loss_coef: 0.0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    Single,
    Ddp,
    Fsdp,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Single => "single",
            Strategy::Ddp => "ddp",
            Strategy::Fsdp => "fsdp",
        }
    }
}

/// `[parallel]`: how to spread the run over devices.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelSection {
    /// "single" | "ddp" | "fsdp". Default: "single".
    #[serde(default = "d_strategy")]
    pub strategy: Strategy,
    /// CUDA ordinals to use, one rank each, or "all" (every visible GPU). With
    /// model.device = "cpu": virtual ranks (threads), e.g. [0, 1] for two. Default: [0].
    #[serde(default = "d_devices", deserialize_with = "devices_or_all")]
    pub devices: Vec<usize>,
    /// Seconds a rank waits in a collective for the others before the run fails (a rank
    /// that died or hangs). Default: 1800.
    #[serde(default = "d_timeout_s")]
    pub timeout_s: u64,
}

/// `devices = "all"` is kept as an empty list and resolved when the devices are opened.
fn devices_or_all<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<usize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Devices {
        List(Vec<usize>),
        Word(String),
    }
    match Devices::deserialize(d)? {
        Devices::List(v) => Ok(v),
        Devices::Word(w) if w == "all" => Ok(Vec::new()),
        Devices::Word(w) => Err(serde::de::Error::custom(format!(
            "parallel.devices = \"{w}\": expected a list of device ordinals like [0, 1], or \"all\""
        ))),
    }
}

fn d_timeout_s() -> u64 {
    1800
}

fn d_strategy() -> Strategy {
    Strategy::Single
}
fn d_devices() -> Vec<usize> {
    vec![0]
}

impl Default for ParallelSection {
    fn default() -> Self {
        ParallelSection {
            strategy: d_strategy(),
            devices: d_devices(),
            timeout_s: d_timeout_s(),
        }
    }
}

/// `[output]`: where the adapter goes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    /// Output directory. Default: "adapters/<recipe file name without .toml>", relative to the
    /// current directory.
    pub dir: Option<PathBuf>,
    /// Save checkpoint-<step>/ (adapter, optimiser state, trainer state) every this many
    /// steps and at the last step; 0 = none (SIGINT / SIGTERM still save one). Default: 0.
    #[serde(default)]
    pub save_every: usize,
    /// Also write merged full weights (W + scale·B·A, in the base checkpoint's dtype) to
    /// <dir>/merged/ at the end of the run. Default: false.
    #[serde(default)]
    pub merge: bool,
    /// Keep only the newest this many checkpoint-<step>/ directories (0 = keep all).
    /// Default: 0.
    #[serde(default)]
    pub keep_last: usize,
    /// Largest safetensors shard of the merged model, e.g. "5GB", "500MB", "2GiB".
    /// Default: "5GB".
    pub max_shard_size: Option<String>,
    /// What `merge` merges the adapter into: "base" (the base checkpoint's weights; a
    /// bitsandbytes 4-bit checkpoint's dequantized) or "dequantized" (each decoder linear
    /// of the base through NF4 as training quantized it, for model.quantize = "nf4").
    /// Default: "base".
    #[serde(default)]
    pub merge_into: crate::export::merge::MergeInto,
}

/// Keys holding paths: relative values are resolved against the recipe's directory.
const PATH_KEYS: [&str; 7] = [
    "model.path",
    "lora.init_adapter",
    "data.train",
    "output.dir",
    "data.eval",
    "data.chat_template",
    "train.resume",
];

impl Recipe {
    /// Reads `path`, applies `--set` overrides, resolves relative paths and validates.
    pub fn load(path: &Path, sets: &[String]) -> Result<Recipe, RecipeError> {
        let text = std::fs::read_to_string(path).map_err(|source| RecipeError::Read {
            path: path.to_owned(),
            source,
        })?;
        let parse_err = |msg: String| RecipeError::Parse {
            path: path.to_owned(),
            msg,
        };
        let mut doc: toml_edit::DocumentMut = text
            .parse()
            .map_err(|e: toml_edit::TomlError| parse_err(e.to_string()))?;
        let mut overridden = BTreeSet::new();
        for arg in sets {
            overridden.insert(apply_set(&mut doc, arg)?);
        }
        let merged = doc.to_string();
        let mut r: Recipe = toml::from_str(&merged).map_err(|e| {
            // The same error in the file as written: report it there, with the file's lines.
            if let Err(orig) = toml::from_str::<Recipe>(&text) {
                if orig.message() == e.message() {
                    return parse_err(orig.to_string().trim_end().to_string());
                }
            }
            // Caused by an override: the merged document's line numbers mean nothing to the
            // user, so quote the offending line with its section instead.
            let mut msg = format!(
                "with --set {}: {}",
                sets.join(" --set "),
                e.message().trim_end()
            );
            if let Some(span) = e.span() {
                let before = &merged[..span.start.min(merged.len())];
                let line = merged[before.rfind('\n').map_or(0, |i| i + 1)..]
                    .lines()
                    .next()
                    .unwrap_or("");
                let section = before
                    .lines()
                    .rev()
                    .find(|l| l.trim_start().starts_with('['));
                msg.push_str(&format!(
                    "\n  at: {} {}",
                    section.unwrap_or("").trim(),
                    line.trim()
                ));
            }
            parse_err(msg)
        })?;
        r.source = path.to_owned();
        r.sets = sets.to_vec();
        bounds::empty_paths(&r)?;
        let base = path.parent().unwrap_or(Path::new("")).to_owned();
        r.resolve_paths(&base, &overridden);
        r.validate()?;
        Ok(r)
    }

    fn resolve_paths(&mut self, base: &Path, overridden: &BTreeSet<String>) {
        let fix = |key: &str, p: &mut PathBuf| {
            // hf://datasets/ORG/NAME is a Hub data set, not a path.
            let hub = p.to_str().is_some_and(|s| s.starts_with("hf://"));
            if p.is_relative() && !hub && !overridden.contains(key) {
                *p = base.join(&*p);
            }
        };
        for key in PATH_KEYS {
            match key {
                "model.path" => self.model.path.iter_mut().for_each(|p| fix(key, p)),
                "lora.init_adapter" => self.lora.init_adapter.iter_mut().for_each(|p| fix(key, p)),
                "data.train" => match &mut self.data.train {
                    TrainFiles::One(p) => fix(key, p),
                    TrainFiles::Mix(v) => v.iter_mut().for_each(|f| fix(key, &mut f.path)),
                },
                "data.eval" => self.data.eval.iter_mut().for_each(|p| fix(key, p)),
                // A template file, not a template name.
                "data.chat_template" => {
                    if let Some(t) = self
                        .data
                        .chat_template
                        .as_mut()
                        .filter(|t| t.ends_with(".jinja"))
                    {
                        let mut p = PathBuf::from(&*t);
                        fix(key, &mut p);
                        *t = p.to_string_lossy().into_owned();
                    }
                }
                "train.resume" => {
                    if let Resume::Path(p) = &mut self.train.resume {
                        fix(key, p)
                    }
                }
                _ => self.output.dir.iter_mut().for_each(|p| fix(key, p)),
            }
        }
    }

    fn invalid(&self, key: &str, msg: impl Into<String>) -> RecipeError {
        RecipeError::Invalid {
            path: self.source.clone(),
            key: key.into(),
            msg: msg.into(),
        }
    }

    /// Whether this binary can train the recipe: CUDA for model.device = "cuda", NCCL for
    /// several GPUs. Only training asks; `check` and `plan` run on any build.
    pub fn check_build(&self) -> Result<(), RecipeError> {
        let cuda = self.model.device == DeviceKind::Cuda;
        if cuda && !cfg!(feature = "cuda") {
            return Err(self.invalid("model.device", "= \"cuda\", but this binary was built without CUDA: rebuild with `cargo build --release --features cuda`"));
        }
        let p = &self.parallel;
        if p.strategy != Strategy::Single && cuda && !cfg!(feature = "nccl") {
            return Err(self.invalid("parallel.strategy", format!("= \"{}\" on CUDA needs NCCL, but this binary was built without it: rebuild with `cargo build --release --features cuda,nccl`", p.strategy.name())));
        }
        Ok(())
    }

    /// Checks that need no model: ranges, files that must exist, what this build supports.
    pub fn validate(&self) -> Result<(), RecipeError> {
        self.validate_model()?;
        self.validate_lora()?;
        self.validate_data()?;
        if self.data.seq_len < 2 {
            return Err(self.invalid(
                "data.seq_len",
                "must be at least 2 (a token and the next one to predict)",
            ));
        }
        self.validate_train()?;
        self.validate_parallel()?;
        self.validate_output()?;
        bounds::check(self)
    }

    /// `[model]`: where the checkpoint comes from, and its quantization.
    fn validate_model(&self) -> Result<(), RecipeError> {
        let m = &self.model;
        match (&m.path, &m.id) {
            (None, None) => {
                return Err(self.invalid(
                    "model",
                    "needs `path` (a local checkpoint directory) or `id` (a Hub repository)",
                ))
            }
            (Some(_), Some(_)) => {
                return Err(self.invalid("model", "has both `path` and `id`; keep one"))
            }
            (Some(p), None) if !p.is_dir() => {
                return Err(
                    self.invalid("model.path", format!("{} is not a directory", p.display()))
                )
            }
            (None, Some(id)) => {
                if let Err(msg) = crate::util::check_repo_id(id) {
                    return Err(self.invalid("model.id", msg));
                }
            }
            _ => {}
        }
        match (&m.revision, &m.id) {
            (Some(_), None) => {
                return Err(self.invalid(
                    "model.revision",
                    "applies to `model.id` (a Hub repository) only: remove it",
                ))
            }
            (Some(r), _) if crate::util::check_revision(r).is_err() => {
                return Err(self.invalid(
                    "model.revision",
                    format!("= \"{r}\" is not a branch, tag or commit (a git ref name)"),
                ))
            }
            _ => {}
        }
        if !m.double_quant && m.quantize == crate::quant::Quantize::None {
            return Err(self.invalid(
                "model.double_quant",
                "= false applies to model.quantize = \"nf4\" only: remove it",
            ));
        }
        Ok(())
    }

    /// `[lora]`: rank, alpha, dropout, targets, DoRA and the init adapter.
    fn validate_lora(&self) -> Result<(), RecipeError> {
        let l = &self.lora;
        if l.rank == 0 {
            return Err(self.invalid("lora.rank", "must be at least 1"));
        }
        if !(l.alpha.is_finite() && l.alpha > 0.0) {
            return Err(self.invalid("lora.alpha", "must be a positive number"));
        }
        if !(0.0..1.0).contains(&l.dropout) {
            return Err(self.invalid("lora.dropout", "must be in [0, 1)"));
        }
        self.target_modules()?;
        self.validate_dora()?;
        if let Some(p) = &l.init_adapter {
            if !p.join("adapter_config.json").is_file() {
                return Err(self.invalid(
                    "lora.init_adapter",
                    format!(
                        "{} has no adapter_config.json (expected a PEFT adapter directory)",
                        p.display()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `[train]`: batch sizes, the optimizer, sampling, resume and the memory knobs.
    fn validate_train(&self) -> Result<(), RecipeError> {
        let t = &self.train;
        for (key, v) in [
            ("train.micro_batch", t.micro_batch),
            ("train.grad_accum", t.grad_accum),
            ("train.log_every", t.log_every),
        ] {
            if v == 0 {
                return Err(self.invalid(key, "must be at least 1"));
            }
        }
        if t.sample_every > 0 && t.sample_prompts.iter().all(|p| p.is_empty()) {
            return Err(self.invalid(
                "train.sample_every",
                "needs prompts to complete: set train.sample_prompts = [\"...\"]",
            ));
        }
        if t.sample_every > 0 && self.model.quantize == crate::quant::Quantize::Nf4 {
            return Err(self.invalid(
                "train.sample_every",
                "cannot sample from an NF4 base yet (model.quantize = \"nf4\"); set it to 0 and \
                 try the adapter after training with `lora-train generate --recipe`",
            ));
        }
        if t.sample_every > 0 && self.parallel.strategy == Strategy::Fsdp {
            return Err(self.invalid(
                "train.sample_every",
                "cannot sample under FSDP (each rank holds a shard of the base); set it to 0 and \
                 try the adapter after training with `lora-train generate --recipe`",
            ));
        }
        if t.max_steps == Some(0) {
            return Err(self.invalid("train.max_steps", "must be at least 1"));
        }
        if t.epochs == Some(0) {
            return Err(self.invalid("train.epochs", "must be at least 1"));
        }
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return Err(self.invalid("train.lr", "must be a positive number"));
        }
        if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
            return Err(self.invalid("train.weight_decay", "must be >= 0"));
        }
        if !t.betas.iter().all(|b| (0.0..1.0).contains(b)) {
            return Err(self.invalid("train.betas", "both betas must be in [0, 1)"));
        }
        if !(t.eps.is_finite() && t.eps > 0.0) {
            return Err(self.invalid("train.eps", "must be a positive number"));
        }
        if !(t.max_grad_norm.is_finite() && t.max_grad_norm >= 0.0) {
            return Err(self.invalid("train.max_grad_norm", "must be >= 0 (0 disables clipping)"));
        }
        if let Resume::Path(p) = &t.resume {
            if !p.join(crate::util::TRAINER_STATE).is_file() {
                return Err(self.invalid(
                    "train.resume",
                    format!(
                        "= \"{}\" is not a checkpoint directory (it has no {}); use true for the newest checkpoint in the output directory",
                        p.display(),
                        crate::util::TRAINER_STATE
                    ),
                ));
            }
        }
        if let Some(s) = &t.max_memory {
            if let Err(msg) = crate::util::parse_size(s) {
                return Err(self.invalid("train.max_memory", msg));
            }
        }
        let coef = t.router_aux_loss_coef;
        if !coef.is_finite() || !(0.0..=1.0).contains(&coef) {
            return Err(self.invalid(
                "train.router_aux_loss_coef",
                format!("= {coef}: use a weight in [0, 1] (0: off; transformers' default 0.001)"),
            ));
        }
        if t.mlp_chunk > MLP_CHUNK_MAX || t.mlp_chunk % 64 != 0 {
            return Err(self.invalid(
                "train.mlp_chunk",
                format!(
                    "= {} tokens: use a multiple of 64 (whole GEMM row tiles, so a chunk's rows \
                     are the unchunked values) up to {MLP_CHUNK_MAX}, or 0 for none",
                    t.mlp_chunk
                ),
            ));
        }
        Ok(())
    }

    /// `[parallel]`: the devices and strategy.
    fn validate_parallel(&self) -> Result<(), RecipeError> {
        let p = &self.parallel;
        let mut seen = BTreeSet::new();
        for d in &p.devices {
            if !seen.insert(d) {
                return Err(self.invalid(
                    "parallel.devices",
                    format!("lists device {d} twice: list each device once, e.g. [0, 1]"),
                ));
            }
        }
        if p.devices.is_empty() && self.model.device == DeviceKind::Cpu {
            return Err(self.invalid("parallel.devices", "= \"all\" needs model.device = \"cuda\": on the CPU list the virtual ranks, e.g. [0, 1]"));
        }
        if p.strategy == Strategy::Single && p.devices.len() > 1 {
            return Err(self.invalid("parallel.devices", "lists several devices but strategy is \"single\": use \"ddp\" or \"fsdp\", or list one device"));
        }
        if p.timeout_s == 0 {
            return Err(self.invalid("parallel.timeout_s", "must be at least 1 (seconds)"));
        }
        Ok(())
    }

    /// `[output]`: shard size and what the merge goes into.
    fn validate_output(&self) -> Result<(), RecipeError> {
        if let Some(s) = &self.output.max_shard_size {
            if let Err(msg) = crate::util::parse_size(s) {
                return Err(self.invalid("output.max_shard_size", msg));
            }
        }
        if self.output.merge_into == crate::export::merge::MergeInto::Dequantized {
            if !self.output.merge {
                return Err(self.invalid(
                    "output.merge_into",
                    "= \"dequantized\" applies to output.merge = true only: set merge = true, or remove it",
                ));
            }
            if self.model.quantize != crate::quant::Quantize::Nf4 {
                return Err(self.invalid(
                    "output.merge_into",
                    "= \"dequantized\" is for an adapter trained on an NF4 base (model.quantize = \"nf4\"); with quantize = \"none\" it trained on the base's own weights: remove it",
                ));
            }
        }
        Ok(())
    }

    /// `lora.use_dora` against what DoRA does not run with.
    pub(crate) fn validate_dora(&self) -> Result<(), RecipeError> {
        if !self.lora.use_dora {
            return Ok(());
        }
        if self.lora.dropout > 0.0 {
            // PEFT's DoRA under dropout recomputes the base output from the dropped input
            // (an extra GEMM per linear, and not the maths above); we do not reproduce it.
            return Err(self.invalid(
                "lora.use_dora",
                format!(
                    "= true with lora.dropout = {} is not supported: set lora.dropout = 0, or \
                     use_dora = false",
                    self.lora.dropout
                ),
            ));
        }
        if self.parallel.strategy == Strategy::Fsdp {
            return Err(self.invalid(
                "lora.use_dora",
                "= true with parallel.strategy = \"fsdp\" is not implemented (DoRA needs each \
                 whole weight for its row norms): use strategy = \"ddp\", or use_dora = false",
            ));
        }
        if self.train.sample_every > 0 {
            return Err(self.invalid(
                "lora.use_dora",
                "= true with train.sample_every > 0 is not implemented (sampling runs plain \
                 LoRA adapters): set sample_every = 0 and generate from the merged export \
                 (`lora-train export --adapter DIR --out merged/`)",
            ));
        }
        Ok(())
    }

    /// `[data]` checks, and `train.eval_every`, which needs an eval set.
    fn validate_data(&self) -> Result<(), RecipeError> {
        let d = &self.data;
        let files = d.train.files(d.format);
        if files.is_empty() {
            return Err(self.invalid("data.train", "is an empty list: name at least one file"));
        }
        crate::data::source::check(d).map_err(|(key, msg)| self.invalid(&key, msg))?;
        for f in &files {
            if !crate::data::source::is_hub(&f.path) && !f.path.is_file() {
                return Err(self.invalid(
                    "data.train",
                    format!("file {} does not exist", f.path.display()),
                ));
            }
            if !(f.weight.is_finite() && f.weight > 0.0) {
                return Err(self.invalid(
                    "data.train",
                    format!(
                        "weight of {} must be a positive number (1.0 = each example once per epoch)",
                        f.path.display()
                    ),
                ));
            }
            let format = f.format.unwrap_or(d.format);
            if matches!(format, DataFormat::Text | DataFormat::Tokens)
                && d.train_on == Some(TrainOn::Completions)
            {
                return Err(self.invalid(
                    "data.train_on",
                    format!(
                        "= \"completions\" needs prompts to mask, but {} is in format \"{}\": use \"all\", or the alpaca, chat or completion format (\"tokens\" rows mask with labels -100)",
                        f.path.display(),
                        if format == DataFormat::Text { "text" } else { "tokens" }
                    ),
                ));
            }
        }
        if let Some(e) = &d.eval {
            if !crate::data::source::is_hub(e) && !e.is_file() {
                return Err(
                    self.invalid("data.eval", format!("file {} does not exist", e.display()))
                );
            }
            if d.eval_fraction > 0.0 {
                return Err(self.invalid(
                    "data.eval_fraction",
                    "is set together with data.eval: keep one",
                ));
            }
        }
        if !(0.0..1.0).contains(&d.eval_fraction) {
            return Err(self.invalid("data.eval_fraction", "must be in [0, 1)"));
        }
        if self.train.eval_every > 0 && d.eval.is_none() && d.eval_fraction == 0.0 {
            return Err(self.invalid(
                "train.eval_every",
                "needs an eval set: set data.eval (a file) or data.eval_fraction",
            ));
        }
        for (key, v) in [
            ("data.prompt_field", &d.prompt_field),
            ("data.completion_field", &d.completion_field),
        ] {
            if v.is_empty() {
                return Err(self.invalid(key, "must name a field"));
            }
        }
        if d.prompt_field == d.completion_field {
            return Err(self.invalid(
                "data.completion_field",
                "must differ from data.prompt_field",
            ));
        }
        if let Some(t) = d.chat_template.as_deref().filter(|t| t.ends_with(".jinja")) {
            if !Path::new(t).is_file() {
                return Err(self.invalid("data.chat_template", format!("file {t} does not exist")));
            }
        }
        Ok(())
    }

    /// How the frozen base is stored (`[model] quantize`, `double_quant`).
    pub fn quant(&self) -> crate::quant::Quant {
        crate::quant::Quant {
            kind: self.model.quantize,
            double_quant: self.model.double_quant,
        }
    }

    /// `lora.targets` as module names in checkpoint order; unknown names are errors.
    /// "all-linear" is every known name (`lora::KNOWN_LINEAR`), which the model's config
    /// narrows to its own (`ModelConfig::resolve_targets`).
    pub fn target_modules(&self) -> Result<Vec<String>, RecipeError> {
        use crate::lora::KNOWN_LINEAR as ALL_LINEAR;
        let list = match &self.lora.targets {
            Targets::AllLinear(_) => return Ok(ALL_LINEAR.iter().map(|s| s.to_string()).collect()),
            Targets::List(l) => l,
        };
        if list.is_empty() {
            return Err(self.invalid(
                "lora.targets",
                "is empty: name at least one module, or use \"all-linear\"",
            ));
        }
        for t in list {
            if !ALL_LINEAR.contains(&t.as_str()) {
                return Err(self.invalid(
                    "lora.targets",
                    format!(
                        "has unknown module \"{t}\"; allowed: {}, or \"all-linear\"",
                        ALL_LINEAR.join(", ")
                    ),
                ));
            }
        }
        Ok(ALL_LINEAR
            .iter()
            .filter(|m| list.iter().any(|t| t == *m))
            .map(|s| s.to_string())
            .collect())
    }

    /// `train.mlp_chunk` as `Model::mlp_chunk` (None: 0, never chunked).
    pub fn mlp_chunk(&self) -> Option<usize> {
        (self.train.mlp_chunk > 0).then_some(self.train.mlp_chunk)
    }

    /// `train.max_memory` in bytes (validated at load).
    pub fn max_memory(&self) -> Option<u64> {
        self.train
            .max_memory
            .as_deref()
            .and_then(|s| crate::util::parse_size(s).ok())
    }

    /// The output directory: `output.dir`, or adapters/<recipe stem>.
    pub fn output_dir(&self) -> PathBuf {
        self.output.dir.clone().unwrap_or_else(|| {
            let stem = self
                .source
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned());
            Path::new("adapters").join(stem.unwrap_or_else(|| "run".into()))
        })
    }

    /// The recipe as resolved (defaults filled in), to store beside the adapter.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }

    /// What `check` prints: `to_toml` with the defaults that depend on other fields written
    /// out (`data.train_on` from the format, `train.offload_activations`), and each field
    /// left unset named in a comment at the end of its section, with what unset means.
    pub fn check_toml(&self) -> String {
        let mut r = self.clone();
        r.data.train_on = Some(self.data.train_on_for(self.data.format));
        r.train.offload_activations = Some(
            self.train
                .offload_activations
                .unwrap_or(OFFLOAD_ACTIVATIONS_DEFAULT),
        );
        if r.output.max_shard_size.is_none() {
            r.output.max_shard_size = Some(crate::export::merge::DEFAULT_MAX_SHARD_SIZE.into());
        }
        let unset: Vec<(&str, &str)> = [
            (
                self.lora.init_adapter.is_none(),
                "lora",
                "init_adapter = unset: new adapters (A random, B zero)",
            ),
            (
                self.data.chat_template.is_none(),
                "data",
                "chat_template = unset: the tokenizer's",
            ),
            (
                self.data.eval.is_none(),
                "data",
                "eval = unset: no eval file (eval_fraction holds out rows)",
            ),
            (
                self.train.max_memory.is_none(),
                "train",
                "max_memory = unset: the whole card",
            ),
        ]
        .into_iter()
        .filter(|(none, _, _)| *none)
        .map(|(_, section, line)| (section, line))
        .collect();
        with_section_notes(&r.to_toml(), &unset)
    }
}

/// `text` (TOML) with `# note` lines added at the end of each named `[section]`.
fn with_section_notes(text: &str, notes: &[(&str, &str)]) -> String {
    let mut out = String::new();
    let mut section = "";
    let flush = |out: &mut String, section: &str| {
        let trimmed = out.trim_end_matches('\n').len();
        out.truncate(trimmed);
        out.push('\n');
        for (_, line) in notes.iter().filter(|(s, _)| *s == section) {
            out.push_str(&format!("# {line}\n"));
        }
        out.push('\n');
    };
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            if !section.is_empty() {
                flush(&mut out, section);
            }
            section = name;
        }
        out.push_str(line);
        out.push('\n');
    }
    if !section.is_empty() {
        flush(&mut out, section);
    }
    out.trim_end().to_string() + "\n"
}

/// Applies one `a.b=v` to the document; returns the dotted key. The value is read as TOML
/// (numbers, booleans, arrays, quoted strings); anything else is taken as a bare string.
fn apply_set(doc: &mut toml_edit::DocumentMut, arg: &str) -> Result<String, RecipeError> {
    let err = |msg: &str| RecipeError::Override {
        arg: arg.into(),
        msg: msg.into(),
    };
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| err("expected section.key=value"))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
        return Err(err("the key must be section.key, e.g. train.lr=1e-4"));
    }
    let raw = raw.trim();
    let value: toml_edit::Value = raw
        .parse()
        .unwrap_or_else(|_| toml_edit::Value::from(raw.to_string()));
    let mut item = doc.as_item_mut();
    for part in &parts {
        // Absent keys become tables on the way down; a non-table value in the way is an error.
        item = item.get_mut(part).ok_or_else(|| {
            err(&format!(
                "cannot set `{key}`: `{part}` sits under a value, not a table"
            ))
        })?;
    }
    if item.is_table() {
        return Err(err(&format!(
            "`{key}` is a whole section; set one of its keys"
        )));
    }
    *item = toml_edit::Item::Value(value);
    Ok(key.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_checkpointing_reads_bools_and_mlp_and_writes_them_back() {
        #[derive(Deserialize, Serialize)]
        struct T {
            c: Checkpointing,
        }
        for (text, want) in [
            ("c = true", Checkpointing::Full),
            ("c = false", Checkpointing::Off),
            ("c = \"mlp\"", Checkpointing::Mlp),
            ("c = \"full\"", Checkpointing::Full),
        ] {
            let t: T = toml::from_str(text).unwrap();
            assert_eq!(t.c, want, "{text}");
            let back: T = toml::from_str(&toml::to_string(&t).unwrap()).unwrap();
            assert_eq!(back.c, want, "{text}");
        }
        assert_eq!(
            toml::to_string(&T {
                c: Checkpointing::Mlp
            })
            .unwrap()
            .trim(),
            "c = \"mlp\""
        );
        let err = toml::from_str::<T>("c = \"attn\"")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("expected true, false or \"mlp\""), "{err}");
        assert!(toml::from_str::<T>("c = 1").is_err());
    }

    #[test]
    fn reference_recipe_spells_out_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/reference.toml");
        let r = Recipe::load(&path, &[]).unwrap();
        let toml = |v: &dyn erased::Ser| v.to();
        assert_eq!(toml(&r.lora), toml(&LoraSection::default()));
        assert_eq!(toml(&r.train), toml(&TrainSection::default()));
        assert_eq!(toml(&r.parallel), toml(&ParallelSection::default()));
        assert_eq!(toml(&r.output), toml(&OutputSection::default()));
        assert_eq!(r.data.seq_len, d_seq_len());
        assert_eq!(r.data.format, d_format());
        assert_eq!((r.data.shuffle, r.data.pack), (true, false));
        assert_eq!(r.data.train_on, None);
        assert_eq!(r.data.prompt_field, d_prompt_field());
        assert_eq!(r.data.completion_field, d_completion_field());
        assert_eq!((&r.data.chat_template, &r.data.eval), (&None, &None));
        assert_eq!(r.data.eval_fraction, 0.0);
        assert_eq!(r.data.on_bad_row, d_on_bad_row());
        // Every [data] key is in reference.toml (set, or commented out where it has no value).
        let text = std::fs::read_to_string(&path).unwrap();
        let data: toml::Table = toml::from_str(&toml::to_string(&r.data).unwrap()).unwrap();
        let unset = [
            "train_on",
            "chat_template",
            "eval",
            "split",
            "subset",
            "revision",
            "files",
            "eval_split",
        ];
        for key in data.keys().map(String::as_str).chain(unset) {
            assert!(
                text.lines()
                    .any(|l| l.trim_start_matches("# ").starts_with(&format!("{key} ="))),
                "recipes/reference.toml lacks data.{key}"
            );
        }
        assert_eq!((r.model.device, r.model.dtype), (DeviceKind::Cpu, None));
        assert_eq!(r.model.quantize, crate::quant::Quantize::None);
        assert!(r.model.double_quant);
        assert!(text.contains("# quantize = \"none\"") && text.contains("# double_quant = true"));
    }

    /// Serialize any section to TOML text, to compare sections field by field.
    mod erased {
        pub trait Ser {
            fn to(&self) -> String;
        }
        impl<T: serde::Serialize> Ser for T {
            fn to(&self) -> String {
                toml::to_string(self).unwrap()
            }
        }
    }

    #[test]
    fn set_overrides_types_and_paths() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("m")).unwrap();
        std::fs::write(dir.path().join("d.jsonl"), "{}").unwrap();
        let p = dir.path().join("r.toml");
        std::fs::write(&p, "[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\n").unwrap();
        let sets = [
            "train.lr=1e-4",
            "lora.targets=all-linear",
            "train.betas=[0.8, 0.9]",
            "data.pack=true",
        ];
        let r = Recipe::load(&p, &sets.map(String::from)).unwrap();
        assert_eq!(r.train.lr, 1e-4);
        assert_eq!(r.lora.targets, Targets::AllLinear("all-linear".into()));
        assert_eq!(r.train.betas, [0.8, 0.9]);
        assert!(r.data.pack);
        assert_eq!(
            r.model.path.as_deref(),
            Some(dir.path().join("m").as_path())
        );
        assert_eq!(r.target_modules().unwrap().len(), 11);
        let e = Recipe::load(&p, &["lora.rank=0".into()])
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("`lora.rank` must be at least 1"), "{e}");
        let e = Recipe::load(&p, &["model=3".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("the key must be section.key"), "{e}");
        let e = Recipe::load(&p, &["model.path.x=3".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("sits under a value"), "{e}");
    }

    #[test]
    fn train_mix_parses_resolves_validates_and_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("m")).unwrap();
        for f in ["a.jsonl", "b.jsonl"] {
            std::fs::write(dir.path().join(f), "{}").unwrap();
        }
        let p = dir.path().join("r.toml");
        let head = "[model]\npath = \"m\"\n[data]\n";
        std::fs::write(
            &p,
            format!("{head}train = [{{ path = \"a.jsonl\", weight = 2.0 }}, {{ path = \"b.jsonl\", format = \"chat\" }}]\nformat = \"alpaca\"\n"),
        )
        .unwrap();
        let r = Recipe::load(&p, &[]).unwrap();
        let files = r.data.train.files(r.data.format);
        assert_eq!(files.len(), 2);
        assert_eq!(files[0].path, dir.path().join("a.jsonl"));
        assert_eq!(
            (files[0].weight, files[0].format),
            (2.0, Some(DataFormat::Alpaca))
        );
        assert_eq!(
            (files[1].weight, files[1].format),
            (1.0, Some(DataFormat::Chat))
        );
        assert_eq!(r.data.train_on_for(DataFormat::Chat), TrainOn::Completions);
        assert_eq!(r.data.train_on_for(DataFormat::Text), TrainOn::All);
        // The resolved recipe (written beside the adapter) loads back as the same recipe.
        let back = dir.path().join("back.toml");
        std::fs::write(&back, r.to_toml()).unwrap();
        assert_eq!(Recipe::load(&back, &[]).unwrap().data.train, r.data.train);

        let err = |text: &str, sets: &[&str]| {
            std::fs::write(&p, format!("{head}{text}")).unwrap();
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            Recipe::load(&p, &sets).unwrap_err().to_string()
        };
        let e = err("train = [{ path = \"a.jsonl\", wieght = 2 }]\n", &[]);
        assert!(
            e.contains("unknown field `wieght`, expected one of `path`, `weight`, `format`"),
            "{e}"
        );
        let e = err("train = [{ path = \"a.jsonl\", weight = 0 }]\n", &[]);
        assert!(
            e.ends_with("must be a positive number (1.0 = each example once per epoch)"),
            "{e}"
        );
        let e = err("train = []\n", &[]);
        assert!(
            e.ends_with("`data.train` is an empty list: name at least one file"),
            "{e}"
        );
        let e = err("train = \"a.jsonl\"\ntrain_on = \"completions\"\n", &[]);
        assert!(
            e.contains("`data.train_on` = \"completions\" needs prompts to mask"),
            "{e}"
        );
        let e = err("train = \"a.jsonl\"\n", &["train.eval_every=5"]);
        assert!(e.ends_with("`train.eval_every` needs an eval set: set data.eval (a file) or data.eval_fraction"), "{e}");
        let e = err(
            "train = \"a.jsonl\"\neval = \"b.jsonl\"\neval_fraction = 0.1\n",
            &[],
        );
        assert!(
            e.ends_with("`data.eval_fraction` is set together with data.eval: keep one"),
            "{e}"
        );
        let e = err("train = \"a.jsonl\"\neval_fraction = 1.0\n", &[]);
        assert!(e.ends_with("`data.eval_fraction` must be in [0, 1)"), "{e}");
        let e = err("train = \"a.jsonl\"\nchat_template = \"t.jinja\"\n", &[]);
        assert!(
            e.contains("`data.chat_template` file ") && e.ends_with("t.jinja does not exist"),
            "{e}"
        );
        let e = err("train = \"a.jsonl\"\non_bad_row = \"ignore\"\n", &[]);
        assert!(
            e.contains("unknown variant `ignore`, expected `error` or `skip`"),
            "{e}"
        );
    }

    #[test]
    fn resume_takes_a_flag_or_a_checkpoint_path() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("m")).unwrap();
        std::fs::write(dir.path().join("d.jsonl"), "{}").unwrap();
        let ck = dir.path().join("out/checkpoint-3");
        std::fs::create_dir_all(&ck).unwrap();
        std::fs::write(ck.join("trainer_state.json"), "{}").unwrap();
        let p = dir.path().join("r.toml");
        let base = "[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\n";
        std::fs::write(
            &p,
            format!("{base}[train]\nresume = \"out/checkpoint-3\"\n"),
        )
        .unwrap();
        // A path in the recipe is relative to the recipe's directory.
        let r = Recipe::load(&p, &[]).unwrap();
        assert_eq!(r.train.resume, Resume::Path(ck));
        let r = Recipe::load(&p, &["train.resume=true".into()]).unwrap();
        assert_eq!(r.train.resume, Resume::Flag(true));
        let load_err = |set: &str| Recipe::load(&p, &[set.into()]).unwrap_err().to_string();
        let e = load_err("train.resume=no/such/dir");
        assert!(
            e.ends_with("`train.resume` = \"no/such/dir\" is not a checkpoint directory (it has no trainer_state.json); use true for the newest checkpoint in the output directory"),
            "{e}"
        );
        let e = load_err("train.resume=3");
        assert!(
            e.contains("expected true, false or the path of a checkpoint directory"),
            "{e}"
        );
        let e = load_err("output.max_shard_size=5XB");
        assert!(
            e.ends_with("`output.max_shard_size` = \"5XB\" is not a size: write a number with a unit, e.g. \"5GB\", \"500MB\", \"2GiB\""),
            "{e}"
        );
        let e = load_err("output.merge_into=nf4");
        assert!(
            e.contains("unknown variant `nf4`, expected `base` or `dequantized`"),
            "{e}"
        );
        let e = load_err("output.merge_into=dequantized");
        assert!(
            e.ends_with("`output.merge_into` = \"dequantized\" applies to output.merge = true only: set merge = true, or remove it"),
            "{e}"
        );
        let e = Recipe::load(
            &p,
            &[
                "output.merge_into=dequantized".into(),
                "output.merge=true".into(),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.ends_with("`output.merge_into` = \"dequantized\" is for an adapter trained on an NF4 base (model.quantize = \"nf4\"); with quantize = \"none\" it trained on the base's own weights: remove it"),
            "{e}"
        );
        let r = Recipe::load(
            &p,
            &[
                "output.merge_into=dequantized".into(),
                "output.merge=true".into(),
                "model.quantize=nf4".into(),
            ],
        )
        .unwrap();
        assert_eq!(
            r.output.merge_into,
            crate::export::merge::MergeInto::Dequantized
        );
        let sets = [
            "output.merge=true",
            "output.keep_last=2",
            "train.skip_nonfinite=true",
        ];
        let r = Recipe::load(&p, &sets.map(String::from)).unwrap();
        assert!(r.output.merge && r.train.skip_nonfinite);
        assert_eq!(r.output.keep_last, 2);
    }
}
