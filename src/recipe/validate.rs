//! What a recipe alone can check: ranges, files that must exist, the combinations that do not
//! run together, what this build supports. Checks that need the model, the data's formats or
//! an adapter's config come later (run::resolve), with the same error type.

use super::{bounds, DataFormat, DeviceKind, MergeInto, Quantize, Recipe, RecipeError};
use super::{Resume, Strategy, Targets, TrainOn, MLP_CHUNK_MAX};
use std::collections::BTreeSet;
use std::path::Path;

impl Recipe {
    /// Whether this binary can train the recipe: CUDA for model.device = "cuda", NCCL for
    /// several GPUs. Only training asks; `check` and `plan` run on any build.
    pub(crate) fn check_build(&self) -> Result<(), RecipeError> {
        let cuda = self.model.device == DeviceKind::Cuda;
        if cuda && !cfg!(feature = "cuda") {
            return Err(self.invalid(
                "model.device",
                format!(
                    "= \"cuda\", but this binary was built without CUDA: {}",
                    crate::util::CUDA_BUILD
                ),
            ));
        }
        let p = &self.parallel;
        if p.strategy != Strategy::Single && cuda && !cfg!(feature = "nccl") {
            return Err(self.invalid(
                "parallel.strategy",
                format!(
                    "= \"{}\" on CUDA needs NCCL, but this binary was built without it: {}",
                    p.strategy.name(),
                    crate::util::NCCL_BUILD
                ),
            ));
        }
        Ok(())
    }

    /// Checks that need no model: ranges, files that must exist, what this build supports.
    pub(crate) fn validate(&self) -> Result<(), RecipeError> {
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
        self.validate_pref()?;
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
        if !m.double_quant && m.quantize == Quantize::None {
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
        if t.sample_every > 0 && self.model.quantize == Quantize::Nf4 {
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
        if let Some((i, k)) =
            (t.report_to.iter().enumerate()).find(|(i, k)| t.report_to[..*i].contains(k))
        {
            return Err(self.invalid(
                "train.report_to",
                format!(
                    "names \"{}\" twice (entry {}): list each tracker once",
                    k.name(),
                    i + 1
                ),
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
        if self.output.merge_into == MergeInto::Dequantized {
            if !self.output.merge {
                return Err(self.invalid(
                    "output.merge_into",
                    "= \"dequantized\" applies to output.merge = true only: set merge = true, or remove it",
                ));
            }
            if self.model.quantize != Quantize::Nf4 {
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
        for f in &files {
            if !f.is_hub() && !f.path.is_file() {
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
            if !super::data::is_hub(e) && !e.is_file() {
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

    /// `lora.targets` as module names in checkpoint order; unknown names are errors.
    /// "all-linear" is every known name (`KNOWN_LINEAR`), which the model's config
    /// narrows to its own (`ModelConfig::resolve_targets`).
    pub(crate) fn target_modules(&self) -> Result<Vec<String>, RecipeError> {
        use super::KNOWN_LINEAR as ALL_LINEAR;
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
}
