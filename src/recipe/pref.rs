//! `[train]`'s preference objectives (DPO, ORPO, SimPO, KTO: TRL 1.x's names and defaults) and
//! the checks that tie them to `[data]` and `[lora]`.

use super::{DataFormat, Recipe, RecipeError};
use serde::{Deserialize, Serialize};

/// `train.objective`: what the loss at the head is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainObjective {
    /// Causal-LM cross-entropy (supervised fine-tuning).
    #[default]
    Sft,
    /// DPO against a reference (the base with the adapters off, or the init adapter).
    Dpo,
    /// ORPO: the chosen sequences' NLL plus the odds-ratio term, no reference.
    Orpo,
    /// SimPO (TRL's CPO with loss_type "simpo"), no reference.
    Simpo,
    /// KTO on unpaired examples, against a reference.
    Kto,
}

impl TrainObjective {
    /// As the recipe writes it.
    pub fn name(self) -> &'static str {
        match self {
            TrainObjective::Sft => "sft",
            TrainObjective::Dpo => "dpo",
            TrainObjective::Orpo => "orpo",
            TrainObjective::Simpo => "simpo",
            TrainObjective::Kto => "kto",
        }
    }

    /// The data format it reads: None for SFT (any of the SFT formats).
    pub fn data_format(self) -> Option<DataFormat> {
        match self {
            TrainObjective::Sft => None,
            TrainObjective::Kto => Some(DataFormat::UnpairedPreference),
            _ => Some(DataFormat::Preference),
        }
    }

    /// Whether it scores the policy against a reference model.
    pub fn has_reference(self) -> bool {
        matches!(self, TrainObjective::Dpo | TrainObjective::Kto)
    }
}

/// `train.pref_loss`: DPO's loss on the reward margin (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefLoss {
    /// -log σ(β Δ).
    #[default]
    Sigmoid,
    /// (Δ_c / n_c - Δ_r / n_r - 1 / 2β)².
    Ipo,
    /// max(0, 1 - β Δ).
    Hinge,
}

/// `train.pref_reference`: what DPO and KTO score the policy against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefReference {
    /// The base with the adapters off (TRL's default for a PEFT model).
    #[default]
    Base,
    /// The adapter the run starts from, `lora.init_adapter` (TRL's `ref_adapter_name`).
    InitAdapter,
}

/// `train.pref_beta`'s default (TRL's `beta` of DPO, ORPO, CPO and KTO).
pub const PREF_BETA: f64 = 0.1;

impl Recipe {
    /// The objective against the data's format, the reference against the adapters, the
    /// settings' ranges.
    pub(super) fn validate_pref(&self) -> Result<(), RecipeError> {
        let (t, d) = (&self.train, &self.data);
        let obj = t.objective;
        for f in d.train.files(d.format) {
            let format = f.format.unwrap_or(d.format);
            let pref = matches!(
                format,
                DataFormat::Preference | DataFormat::UnpairedPreference
            );
            match obj.data_format() {
                Some(want) if format != want => {
                    return Err(self.invalid(
                        "data.format",
                        format!(
                            "train.objective = \"{}\" reads data.format = \"{}\", but {} is \"{}\"",
                            obj.name(),
                            crate::recipe::format_name(want),
                            f.path.display(),
                            crate::recipe::format_name(format)
                        ),
                    ))
                }
                None if pref => {
                    return Err(self.invalid(
                        "train.objective",
                        format!(
                            "= \"sft\", but {} is in format \"{}\": set train.objective = \"dpo\", \"orpo\", \"simpo\" or \"kto\"",
                            f.path.display(),
                            crate::recipe::format_name(format)
                        ),
                    ))
                }
                _ => {}
            }
        }
        if t.precompute_ref && !obj.has_reference() {
            return Err(self.invalid(
                "train.precompute_ref",
                format!(
                    "= true, but train.objective = \"{}\" has no reference model to precompute: remove train.precompute_ref, or train \"dpo\" or \"kto\"",
                    obj.name()
                ),
            ));
        }
        if obj == TrainObjective::Sft {
            return Ok(());
        }
        let beta = t.pref_beta.unwrap_or(PREF_BETA);
        if !(beta.is_finite() && beta > 0.0) {
            return Err(self.invalid("train.pref_beta", "must be a positive number"));
        }
        for (key, v) in [
            ("train.simpo_gamma", t.simpo_gamma),
            ("train.cpo_alpha", t.cpo_alpha),
            ("train.kto_desirable_weight", t.kto_desirable_weight),
            ("train.kto_undesirable_weight", t.kto_undesirable_weight),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(self.invalid(key, "must be a number ≥ 0"));
            }
        }
        if d.pack {
            return Err(self.invalid(
                "data.pack",
                "= true with a preference objective: each pair is one row already (its prompt once, then chosen and rejected); remove data.pack",
            ));
        }
        if d.eval.is_some() || d.eval_fraction > 0.0 {
            return Err(self.invalid(
                "data.eval",
                format!(
                    "an eval set is not evaluated under train.objective = \"{}\" yet: remove data.eval / data.eval_fraction",
                    obj.name()
                ),
            ));
        }
        if t.pref_reference == PrefReference::InitAdapter {
            if !obj.has_reference() {
                return Err(self.invalid(
                    "train.pref_reference",
                    format!("is set, but \"{}\" has no reference model", obj.name()),
                ));
            }
            if self.lora.init_adapter.is_none() {
                return Err(self.invalid(
                    "train.pref_reference",
                    "= \"init_adapter\" needs lora.init_adapter (the adapter the run starts from is the reference)",
                ));
            }
        }
        if obj.has_reference() && t.pref_reference == PrefReference::Base && self.lora.use_dora {
            return Err(self.invalid(
                "lora.use_dora",
                "DoRA with train.pref_reference = \"base\" is not supported yet (its adapters cannot be switched off exactly): use plain LoRA, or pref_reference = \"init_adapter\"",
            ));
        }
        if let Some(0) = d.max_prompt_len {
            return Err(self.invalid("data.max_prompt_len", "must be at least 1"));
        }
        Ok(())
    }
}
