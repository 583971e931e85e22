//! Resolving a run once: a recipe (from its file, or made from `bench`'s flags), its
//! checkpoint's config.json (read once: a Hub id's config is fetched alone, the weights later)
//! and the machine become one `RunConfig`. The checks that need more than the recipe itself
//! (the data's formats, the model's linears, the init adapter's config) are made here, with the
//! recipe's error type, before anything is loaded or written.

use crate::export::{self, AdapterInfo};
use crate::hub::{self, Source};
use crate::lora::LoraSpec;
use crate::memory::plan::{self, PlanInput};
use crate::model::{device, ConfigError, Keep, ModelConfig};
use crate::ops::Kernels;
use crate::quant::Quant;
use crate::recipe::{Quantize, Recipe, DEFAULT_MAX_SHARD_SIZE};
use crate::train::objective::ObjectiveKind;
use crate::train::ranks::Ranks;
use crate::train::run_config::{BatchPlan, HookPlan, MergePlan, Optim, OutputPlan, RunConfig};
use anyhow::Result;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Whether resolution may open the run's device (train, bench, probe) or must not (plan,
/// check: any build, any machine; the kernels forecast).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Machine {
    /// Open the device, check this build can run the recipe, read the launcher's ranks.
    Open,
    /// No device: forecast the kernels; one process of `gpus` ranks.
    Forecast {
        /// Ranks to forecast for.
        gpus: usize,
    },
}

/// Reads a recipe (`Recipe::load`: the file, `--set`, paths, the recipe's own checks) and
/// checks what the data module knows of it (hf:// names, the columns each format needs).
pub fn load_recipe(path: &Path, sets: &[String]) -> Result<Recipe> {
    let r = Recipe::load(path, sets)?;
    crate::data::source::check(&r.data).map_err(|(key, msg)| r.invalid(&key, msg))?;
    Ok(r)
}

impl RunConfig {
    /// `lora-train train`: the recipe against its checkpoint's config.json and this machine.
    pub fn resolve(recipe: Recipe, machine: Machine) -> Result<RunConfig> {
        if machine == Machine::Open {
            recipe.check_build()?;
        }
        let m = &recipe.model;
        let source = Source::of(m.path.as_deref(), m.id.as_deref(), m.revision.as_deref())
            .ok_or_else(|| {
                recipe.invalid(
                    "model",
                    "needs `path` (a local checkpoint directory) or `id` (a Hub repository)",
                )
            })?;
        let config = hub::config_file(&source)?;
        let cfg = ModelConfig::from_file(&config)?;
        Self::of(recipe, Some(source), cfg, machine)
    }

    /// The run of `recipe` on the base `source` (None: random weights) whose config is `cfg`:
    /// the one resolution `train`, `bench`, `probe` and `plan` share.
    pub(crate) fn of(
        recipe: Recipe,
        source: Option<Source>,
        cfg: ModelConfig,
        machine: Machine,
    ) -> Result<RunConfig> {
        let r = &recipe;
        let t = &r.train;
        if t.router_aux_loss_coef > 0.0 && cfg.arch.moe.is_some_and(|m| m.oss.is_some()) {
            return Err(r
                .invalid(
                    "train.router_aux_loss_coef",
                    "gpt-oss's load-balancing loss (over its top-k-softmax router) is not \
                     implemented; set it to 0",
                )
                .into());
        }
        let kind = r.model.device;
        let dtype = device::dtype(kind, r.model.dtype);
        let quant = match cfg.bnb_nf4 {
            Some(double_quant) => Quant::nf4(double_quant),
            None => Quant {
                nf4: r.model.quantize == Quantize::Nf4,
                double_quant: r.model.double_quant,
            },
        };
        let init = match &r.lora.init_adapter {
            Some(p) => Some((p.clone(), export::read_adapter_config(p)?)),
            None => None,
        };
        let spec = lora_spec(r, &cfg, init.as_ref())?;
        let (ranks, kernels) = match machine {
            Machine::Open => {
                let ranks = Ranks::for_recipe(r)?;
                let dev =
                    device::open(kind, first_ordinal(&ranks)).map_err(|e| match e
                        .downcast_ref::<device::DeviceError>(
                    ) {
                        Some(device::DeviceError::Missing { .. }) => {
                            r.invalid("parallel.devices", format!("{e:#}")).into()
                        }
                        _ => e,
                    })?;
                let k = Kernels::resolve(&dev, dtype, cfg.attn_shape(), t.deterministic)?;
                (ranks, k)
            }
            Machine::Forecast { gpus } => {
                let k = Kernels::forecast(kind.is_cuda(), dtype, cfg.attn_shape());
                let ranks = match gpus {
                    0 | 1 => Ranks::Solo(0),
                    n => Ranks::Threads {
                        cuda: kind.is_cuda(),
                        devices: (0..n).collect(),
                    },
                };
                (ranks, k)
            }
        };
        let kernels = kernels.for_adapters(spec.dora).for_base(quant.nf4);
        let base_name = base_name(r, source.as_ref());
        let o = &r.output;
        let max_shard_size = crate::util::parse_size(
            o.max_shard_size
                .as_deref()
                .unwrap_or(DEFAULT_MAX_SHARD_SIZE),
        )
        .map_err(|m| r.invalid("output.max_shard_size", m))?;
        Ok(RunConfig {
            source,
            base_name,
            device: kind,
            dtype,
            quant,
            init_adapter: init.map(|(p, _)| p),
            kernels,
            ranks,
            strategy: r.parallel.strategy,
            devices: r.parallel.devices.clone(),
            timeout: Duration::from_secs(r.parallel.timeout_s),
            ckpt: t.activation_checkpointing,
            keep: Keep::new(
                t.activation_checkpointing,
                t.offload_activations,
                kind.is_cuda(),
            ),
            mlp_chunk: r.mlp_chunk(),
            router_aux_coef: t.router_aux_loss_coef,
            seed: t.seed,
            optim: Optim {
                lr: t.lr,
                betas: t.betas,
                eps: t.eps,
                weight_decay: t.weight_decay,
                max_grad_norm: t.max_grad_norm,
                schedule: t.schedule,
                warmup_steps: t.warmup_steps,
            },
            batch: BatchPlan {
                micro_batch: t.micro_batch,
                grad_accum: t.grad_accum,
                seq_len: r.data.seq_len,
                max_steps: t.max_steps,
                epochs: t.epochs,
            },
            data: Some(r.data.clone()),
            hooks: HookPlan {
                log_every: t.log_every,
                eval_every: t.eval_every,
                sample_every: t.sample_every,
                sample_prompts: t.sample_prompts.clone(),
                skip_nonfinite: t.skip_nonfinite,
                deterministic: t.deterministic,
                report_to: t.report_to.clone(),
            },
            output: OutputPlan {
                dir: r.output_dir(),
                save_every: o.save_every,
                keep_last: o.keep_last,
                merge: o.merge.then_some(MergePlan {
                    max_shard_size,
                    merge_into: o.merge_into,
                }),
                resume: t.resume.clone(),
            },
            max_memory: r.max_memory(),
            objective: ObjectiveKind::of(r),
            precompute_ref: t.precompute_ref && ObjectiveKind::of(r).reference().is_some(),
            spec,
            cfg,
            recipe,
        })
    }

    /// What the plan of a preference run counts that an SFT plan does not: a pair's tree a
    /// row (None for SFT and KTO).
    pub fn plan_note(&self) -> Option<String> {
        let s = self.batch.seq_len;
        let pairs = (self.objective.row_tokens(s) > s).then(|| {
            format!(
                "train.objective = \"{}\": micro_batch counts pairs, a pair one row [prompt | chosen | rejected] (its prompt computed once) of p + c + r tokens, each sequence cut to data.seq_len: at most 2 × data.seq_len − 1 = {} (a one-token prompt; a pair with a p-token prompt takes 2 × data.seq_len − p)",
                self.recipe.train.objective.name(),
                self.objective.row_tokens(s)
            )
        });
        // The plan counts no reference forward in a step either way (it keeps nothing, and
        // its one layer's working set stays under the step's peak): with precompute_ref the
        // steps run none, the pass before them one each micro-batch, and the values are tiny.
        let pre = self.precompute_ref.then(|| {
            let b = &self.batch;
            let steps = b.max_steps.map_or("steps".to_string(), |s| format!("{s} steps"));
            let bytes = b.max_steps.map(|s| 8 * b.micro_batch * b.grad_accum * self.world() * s);
            format!(
                "train.precompute_ref: the reference's forward runs in one pass before the first step (its transient under the step's peak), none in the steps; its log-probabilities take 8 B a pair (kto: an example) × micro_batch {} × grad_accum {} × {} rank(s) × {steps}{} on the host and in reference_logps.bin",
                b.micro_batch,
                b.grad_accum,
                self.world(),
                bytes.map_or(String::new(), |x| format!(" = {}", crate::util::fmt_bytes(x as u64)))
            )
        });
        match (pairs, pre) {
            (Some(a), Some(b)) => Some(format!("{a}\n{b}")),
            (a, b) => a.or(b),
        }
    }

    /// The base as an adapter_config.json in directory `dir` records it
    /// (`base_model_name_or_path`): `base_name`, but a local base whose path is not UTF-8
    /// relative to `dir` where that form is (`util::os_path::recordable`), which `export` and
    /// `generate` resolve against the adapter's directory.
    pub(crate) fn base_name_in(&self, dir: &Path) -> String {
        let Some(Source::Local(base)) = &self.source else {
            return self.base_name.clone();
        };
        let abs = std::path::absolute(base).unwrap_or_else(|_| base.clone());
        match crate::util::os_path::recordable(&abs, dir) {
            Some(p) if abs.to_str().is_none() => p.to_string_lossy().into_owned(),
            _ => self.base_name.clone(),
        }
    }

    /// The memory plan's input for this run over `gpus` ranks: its shape, batch, adapters,
    /// kernels and storage.
    pub fn plan_input(&self, gpus: usize) -> PlanInput {
        let cfg = self.cfg.clone();
        let dropout = self.spec.dropout as f64;
        let mlp_chunk = plan::mlp_chunk_as_run(&cfg, self.mlp_chunk, dropout, &self.spec.targets);
        PlanInput {
            tied: cfg.tie_word_embeddings.unwrap_or(false),
            dtype_bytes: self.dtype.size_in_bytes() as u64,
            micro_batch: self.batch.micro_batch,
            // A pair is one row, its prompt once (data::pref_batch): rows of up to
            // 2 × seq_len − 1 tokens. The reference's forward (and KTO's over its mismatched
            // pairs) keeps nothing and runs before the policy's: its transient, one layer's
            // working set, stays under the step's peak, which is counted.
            seq_len: self.objective.row_tokens(self.batch.seq_len),
            rank: self.spec.rank,
            targets: self.spec.targets.clone(),
            dora: self.spec.dora,
            gpus: gpus.max(1),
            cuda: self.cuda(),
            kernels: self.kernels,
            offload: self.keep.parks(),
            quant: self.quant,
            mlp_chunk,
            cfg,
            host: None,
        }
    }
}

/// The first rank's device ordinal.
fn first_ordinal(ranks: &Ranks) -> usize {
    match ranks {
        Ranks::Solo(o) => *o,
        Ranks::Threads { devices, .. } => devices.first().copied().unwrap_or(0),
        Ranks::Process { env, .. } => env.local,
    }
}

/// What PEFT loads the base from: the Hub id, or the local directory as an absolute path (the
/// adapter is loaded from anywhere, not only where training ran); random weights are named by
/// the recipe's source.
fn base_name(r: &Recipe, source: Option<&Source>) -> String {
    match source {
        Some(Source::Hub { id, .. }) => id.clone(),
        Some(Source::Local(dir)) => std::path::absolute(dir)
            .unwrap_or_else(|_| dir.clone())
            .to_string_lossy()
            .into_owned(),
        None => r.source.to_string_lossy().into_owned(),
    }
}

/// The adapters' spec: the init adapter's shape (r, alpha, targets, rslora, DoRA) or the
/// recipe's, dropout from the recipe, the targets as the model's own linears, the rank within
/// the smallest adapted linear.
fn lora_spec(
    r: &Recipe,
    cfg: &ModelConfig,
    init: Option<&(PathBuf, AdapterInfo)>,
) -> Result<LoraSpec> {
    let spec = match init {
        Some((p, info)) => {
            init_dora(r, p, info)?;
            LoraSpec {
                dropout: r.lora.dropout as f32,
                ..info.spec.clone()
            }
        }
        None => LoraSpec {
            rank: r.lora.rank,
            alpha: r.lora.alpha,
            dropout: r.lora.dropout as f32,
            rslora: r.lora.rslora,
            dora: r.lora.use_dora,
            targets: r.target_modules()?,
        },
    };
    let init_dir = init.map(|(p, _)| p.as_path());
    let spec = lora_targets(r, cfg, spec, init_dir)?;
    lora_fits(r, cfg, &spec, init_dir)?;
    Ok(spec)
}

/// `spec` with its targets as the model's own linears (`ModelConfig::resolve_targets`:
/// "all-linear" becomes the family's; a name the family does not have is an error naming the
/// ones it has, against lora.targets or the init adapter's target_modules).
fn lora_targets(
    r: &Recipe,
    cfg: &ModelConfig,
    spec: LoraSpec,
    init: Option<&Path>,
) -> Result<LoraSpec> {
    match cfg.resolve_targets(&spec.targets) {
        Ok(targets) => Ok(LoraSpec { targets, ..spec }),
        Err(why) => Err(match init {
            Some(dir) => ConfigError::Adapter {
                path: dir.join(export::CONFIG),
                msg: format!("`target_modules` {why}"),
            }
            .into(),
            None => r.invalid("lora.targets", why).into(),
        }),
    }
}

/// DoRA from an init adapter: its adapter_config.json's use_dora decides, as its rank does; a
/// recipe asking for DoRA from a plain adapter is an error, and a DoRA adapter is held to the
/// recipe checks of `lora.use_dora = true`.
fn init_dora(r: &Recipe, dir: &Path, info: &AdapterInfo) -> Result<()> {
    let cfg = dir.join(export::CONFIG);
    if r.lora.use_dora && !info.spec.dora {
        return Err(r
            .invalid(
                "lora.use_dora",
                format!(
                    "= true, but lora.init_adapter's {} says use_dora = false (a plain LoRA \
                     adapter): remove use_dora, or continue from a DoRA adapter",
                    cfg.display()
                ),
            )
            .into());
    }
    if info.spec.dora {
        let mut dora = r.clone();
        dora.lora.use_dora = true;
        dora.validate_dora().map_err(|e| {
            anyhow::Error::new(e).context(format!(
                "lora.init_adapter is a DoRA adapter ({} says use_dora = true)",
                cfg.display()
            ))
        })?;
    }
    Ok(())
}

/// `spec.rank` is at most min(in, out) of every linear it adapts (a larger rank adds
/// parameters that cannot raise the adapter's rank, and sizes A and B by a number nothing
/// bounds). `init`: the adapter directory the spec came from (lora.init_adapter), if any.
fn lora_fits(r: &Recipe, cfg: &ModelConfig, spec: &LoraSpec, init: Option<&Path>) -> Result<()> {
    let Some((module, (n_in, n_out))) = spec
        .targets
        .iter()
        .filter_map(|m| Some((m.as_str(), cfg.linear_shape(m)?)))
        .min_by_key(|(_, (a, b))| (*a).min(*b))
    else {
        return Ok(());
    };
    let max = n_in.min(n_out);
    if spec.rank <= max {
        return Ok(());
    }
    let why = format!(
        "= {} is more than the adapted linears allow: {module} maps {n_in} → {n_out} features in {}, so the rank is at most {max}",
        spec.rank,
        cfg_dir(r)
    );
    Err(match init {
        Some(dir) => ConfigError::Adapter {
            path: dir.join(export::CONFIG),
            msg: format!("`r` {why}"),
        }
        .into(),
        None => r.invalid("lora.rank", why).into(),
    })
}

/// The base checkpoint as a recipe names it, for messages.
fn cfg_dir(r: &Recipe) -> String {
    match (&r.model.path, &r.model.id) {
        (Some(p), _) => p.display().to_string(),
        (None, Some(id)) => id.clone(),
        (None, None) => r.source.display().to_string(),
    }
}
