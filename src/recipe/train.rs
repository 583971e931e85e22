//! `[train]`: optimisation, what forward keeps, resume, memory knobs.

use super::pref::{PrefLoss, PrefReference, TrainObjective};
use serde::{de, Deserialize, Deserializer, Serialize};
use std::path::PathBuf;

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
    pub(crate) fn on(self) -> bool {
        self != Checkpointing::Off
    }

    /// As the recipe writes it: false, "mlp", true.
    pub(crate) fn name(self) -> &'static str {
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

/// `train.offload_activations` when the recipe does not say (CUDA only: the CPU recomputes).
pub(crate) const OFFLOAD_ACTIVATIONS_DEFAULT: bool = true;

/// `train.schedule`: the learning rate over the run (transformers' schedules).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Schedule {
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
    pub(crate) grad_accum: usize,
    /// Optimiser steps to take; wins over `epochs` when both are set.
    pub(crate) max_steps: Option<usize>,
    /// Passes over the data when max_steps is not set. Default: 1.
    pub(crate) epochs: Option<usize>,
    /// Peak learning rate. Default: 2e-4.
    #[serde(default = "d_lr")]
    pub(crate) lr: f64,
    /// AdamW decoupled weight decay. Default: 0.
    #[serde(default)]
    pub(crate) weight_decay: f64,
    /// AdamW betas. Default: [0.9, 0.999].
    #[serde(default = "d_betas")]
    pub(crate) betas: [f64; 2],
    /// AdamW epsilon. Default: 1e-8.
    #[serde(default = "d_eps")]
    pub(crate) eps: f64,
    /// "constant" | "linear" | "cosine" (decay to 0 at the last step). Default: "cosine".
    #[serde(default = "d_schedule")]
    pub(crate) schedule: Schedule,
    /// Linear warmup from 0 over this many steps (transformers' schedules). Default: 0.
    #[serde(default)]
    pub(crate) warmup_steps: usize,
    /// Clip the global gradient norm to this (0 disables). Default: 1.0.
    #[serde(default = "d_clip")]
    pub(crate) max_grad_norm: f64,
    /// Seed for adapter init, shuffling and dropout. Default: 42.
    #[serde(default = "d_seed")]
    pub seed: u64,
    /// What forward keeps for backward: false (every activation), true (each decoder layer's
    /// input only: backward recomputes the layer) or "mlp" (the attention half's activations:
    /// backward recomputes the MLP half, its gate and up GEMMs). Default: false.
    #[serde(default)]
    pub(crate) activation_checkpointing: Checkpointing,
    /// CUDA, without checkpointing: park each layer's residual (after attention, [tokens,
    /// hidden]) in pinned host memory between its forward and backward, copied beside the
    /// compute, instead of recomputing it in backward with o_proj's GEMM (false) — 2 × tokens
    /// × hidden bytes per layer of host memory (1 GiB at 7B, micro-batch 2 × 2048), none of
    /// the GPU's. Ignored on the CPU (recomputed). Default: true
    /// (`OFFLOAD_ACTIVATIONS_DEFAULT`).
    #[serde(default)]
    pub(crate) offload_activations: Option<bool>,
    /// Write a progress line / metrics row every this many steps. Default: 1.
    #[serde(default = "d_one")]
    pub(crate) log_every: usize,
    /// Eval loss every this many steps (0 = only at the end), when data.eval or
    /// data.eval_fraction gives an eval set. Default: 0.
    #[serde(default)]
    pub(crate) eval_every: usize,
    /// Continue from a checkpoint, exactly: `true` = the newest complete checkpoint-<step>/ in
    /// the output directory (none: start fresh), or the path of one checkpoint directory.
    /// The recipe must match the checkpoint's in everything that changes the numbers.
    /// Default: false (start fresh).
    #[serde(default)]
    pub(crate) resume: Resume,
    /// Print the greedy completion of each of `sample_prompts` every this many steps (and
    /// append them to samples.jsonl in the output directory); 0 = off. Needs the model's
    /// tokenizer. Default: 0.
    #[serde(default)]
    pub sample_every: usize,
    /// The prompts `sample_every` completes (text, encoded as the tokenizer says, no EOS).
    /// Default: [].
    #[serde(default)]
    pub(crate) sample_prompts: Vec<String>,
    /// On a non-finite loss or gradient, skip that step's update (and count it) instead of
    /// stopping the run. Default: false.
    #[serde(default)]
    pub(crate) skip_nonfinite: bool,
    /// Only kernels whose sums run in a fixed order, so that a run repeats bit for bit on the
    /// same GPU (CUDA: flash attention's dQ in a kernel of its own; a little slower). Default:
    /// false.
    #[serde(default)]
    pub(crate) deterministic: bool,
    /// Device memory per rank, e.g. "24GiB": on CUDA the run holds the rest of the card
    /// (cuMemAlloc, outside the pool) so it behaves as a card of this size and runs out of
    /// memory for real; the preflight check compares the memory plan with it. On the CPU it
    /// caps an accounting of the tensor bytes the trainer holds. Default: unset (the card).
    #[serde(default, deserialize_with = "size_text")]
    pub(crate) max_memory: Option<String>,
    /// A layer's MLP (norm, gate / up, activation, down) runs over chunks of this many tokens
    /// of the micro-batch: in backward always, and with activation checkpointing in forward and
    /// its recompute too, so that its [tokens, intermediate] tensors exist for one chunk at a
    /// time (long context). A multiple of 64; 0: never chunked. Not with dropout on an MLP adapter (runs
    /// whole). Default: 16384 (`model::layer_mlp::MLP_CHUNK`).
    #[serde(default = "d_mlp_chunk")]
    pub(crate) mlp_chunk: usize,
    /// A MoE model's router load-balancing loss (transformers' `load_balancing_loss_func`)
    /// joins the loss × this weight; padding does not count. Qwen3-MoE's config.json writes
    /// 0.001 for it, but transformers adds it only with output_router_logits: here too only
    /// when set. Default: 0 (off).
    #[serde(default)]
    pub(crate) router_aux_loss_coef: f64,
    /// Trackers that receive the metrics as the run goes: "tensorboard" (event files under
    /// `<output.dir>/runs/`; W&B syncs them) and "mlflow" (the server at
    /// MLFLOW_TRACKING_URI, with the recipe as params). One name or a list. Default: [].
    #[serde(default, deserialize_with = "de_report_to")]
    pub(crate) report_to: Vec<Tracker>,
    /// "sft" | "dpo" | "orpo" | "simpo" | "kto": the loss (TRL's trainers' formulas). The
    /// preference objectives read data.format = "preference" ("unpaired_preference" for kto);
    /// micro_batch then counts pairs (kto: examples). Default: "sft".
    #[serde(default)]
    pub(crate) objective: TrainObjective,
    /// TRL's `beta` of dpo, orpo, simpo and kto. Default: 0.1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) pref_beta: Option<f64>,
    /// DPO's loss: "sigmoid" | "ipo" | "hinge" (TRL's `loss_type`). Default: "sigmoid".
    #[serde(default)]
    pub(crate) pref_loss: PrefLoss,
    /// What dpo and kto score the policy against: "base" (the adapters off) | "init_adapter"
    /// (lora.init_adapter, TRL's `ref_adapter_name`). Default: "base".
    #[serde(default)]
    pub(crate) pref_reference: PrefReference,
    /// dpo / kto: the reference's per-sequence log-probabilities of every row the run's steps
    /// see, computed in one pass before the first step and kept in the output directory
    /// (`reference_logps.bin`, read again on resume), so the steps run no reference forward
    /// (TRL's `precompute_ref_log_probs`). Default: false.
    #[serde(default)]
    pub(crate) precompute_ref: bool,
    /// SimPO's target reward margin γ (TRL's `simpo_gamma`). Default: 0.5.
    #[serde(default = "d_simpo_gamma")]
    pub(crate) simpo_gamma: f64,
    /// SimPO: the weight of the chosen completions' NLL (TRL's `cpo_alpha`; 0 is SimPO as
    /// published). Default: 0.
    #[serde(default)]
    pub(crate) cpo_alpha: f64,
    /// KTO: the weight of the desirable examples' losses. Default: 1.0.
    #[serde(default = "d_weight_one")]
    pub(crate) kto_desirable_weight: f64,
    /// KTO: the weight of the undesirable examples' losses. Default: 1.0.
    #[serde(default = "d_weight_one")]
    pub(crate) kto_undesirable_weight: f64,
}

fn d_simpo_gamma() -> f64 {
    0.5
}

fn d_weight_one() -> f64 {
    1.0
}

fn d_mlp_chunk() -> usize {
    MLP_CHUNK
}

/// `train.mlp_chunk`'s bound: a chunk of more tokens than any micro-batch could hold.
pub(crate) const MLP_CHUNK_MAX: usize = 1 << 24;

/// `train.resume`: false | true | "path/to/checkpoint-<step>".
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub(crate) enum Resume {
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
            report_to: Vec::new(),
            objective: TrainObjective::Sft,
            pref_beta: None,
            pref_loss: PrefLoss::Sigmoid,
            pref_reference: PrefReference::Base,
            precompute_ref: false,
            simpo_gamma: d_simpo_gamma(),
            cpo_alpha: 0.0,
            kto_desirable_weight: 1.0,
            kto_undesirable_weight: 1.0,
        }
    }
}

/// `train.mlp_chunk`'s default: tokens a chunk of a layer's MLP runs over (the model's
/// `layer_mlp::MLP_CHUNK`, which a test holds equal).
pub(crate) const MLP_CHUNK: usize = 16384;

/// One tracker `train.report_to` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Tracker {
    /// Event files under `<output.dir>/runs/`.
    Tensorboard,
    /// The server at `MLFLOW_TRACKING_URI`.
    Mlflow,
}

impl<'de> Deserialize<'de> for Tracker {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Tracker::named(&s).map_err(de::Error::custom)
    }
}

impl Tracker {
    /// Its name in a recipe.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Tracker::Tensorboard => "tensorboard",
            Tracker::Mlflow => "mlflow",
        }
    }

    /// The tracker called `s`, or what to write instead.
    pub(crate) fn named(s: &str) -> Result<Tracker, String> {
        match s {
            "tensorboard" => Ok(Tracker::Tensorboard),
            "mlflow" => Ok(Tracker::Mlflow),
            "wandb" => Err(
                "\"wandb\" is not a tracker of its own: write \"tensorboard\" and \
                 sync the event files with `wandb sync --sync-tensorboard <output.dir>/runs`"
                    .into(),
            ),
            other => Err(format!(
                "unknown tracker \"{other}\": use \"tensorboard\" or \"mlflow\""
            )),
        }
    }
}

/// `train.report_to`: one tracker's name or a list of them.
pub(super) fn de_report_to<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Tracker>, D::Error> {
    struct V;
    impl<'de> de::Visitor<'de> for V {
        type Value = Vec<Tracker>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of trackers, e.g. [\"tensorboard\"]")
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<Vec<Tracker>, E> {
            Tracker::named(s).map(|t| vec![t]).map_err(E::custom)
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Tracker>, A::Error> {
            let mut out = Vec::new();
            while let Some(t) = seq.next_element()? {
                out.push(t);
            }
            Ok(out)
        }
    }
    d.deserialize_any(V)
}

/// A size field (`"24GiB"`) read as its text; a bare number (`24`) is kept as text too, for
/// `validate` to refuse with the units it takes rather than a TOML type error.
pub(super) fn size_text<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<String>, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Size {
        Text(String),
        Int(i64),
        Float(f64),
    }
    Ok(Some(match Size::deserialize(d)? {
        Size::Text(s) => s,
        Size::Int(n) => n.to_string(),
        Size::Float(x) => x.to_string(),
    }))
}
