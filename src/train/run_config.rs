//! The resolved run: every decision a run takes from its recipe, its checkpoint's config.json
//! and its machine, made once (run::resolve), as ripgrep turns its raw arguments into one
//! value that the rest of the program reads. Every rank, the memory preflight and plan, model
//! loading, the data, the loop and the checkpoints read this value; nothing after resolution
//! reads the raw recipe's fields (`recipe` is kept as the run's record: written beside the
//! adapter, fingerprinted in checkpoints, matched on resume). `bench` and `probe` build the same
//! value from their flags (`RunConfig::bench`), so they measure what `train` runs.

use super::objective::ObjectiveKind;
use super::ranks::Ranks;
use crate::hub::Source;
use crate::lora::LoraSpec;
use crate::model::{Keep, ModelConfig};
use crate::ops::Kernels;
use crate::quant::Quant;
use crate::recipe::{Checkpointing, DataSection, DeviceKind, MergeInto, Recipe, Schedule};
use crate::recipe::{Resume, Strategy};
use candle_core::DType;
use std::path::PathBuf;
use std::time::Duration;

/// One run, resolved.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The recipe as loaded (for `bench`, one made from its flags): the run's record.
    pub(crate) recipe: Recipe,
    /// Where the base's weights come from; None: random weights of `cfg` (`bench --shape`).
    pub(crate) source: Option<Source>,
    /// The base's config.json, parsed once (`ModelConfig::from_file`).
    pub(crate) cfg: ModelConfig,
    /// What the base is called in the adapter's config (`base_model_name_or_path`): the Hub id,
    /// or the local directory as an absolute path.
    pub(crate) base_name: String,
    /// CPU or CUDA.
    pub(crate) device: DeviceKind,
    /// The base's dtype (adapters and optimiser state are f32 whatever it is).
    pub(crate) dtype: DType,
    /// How the frozen base is stored (a bitsandbytes NF4 checkpoint is NF4 whatever the recipe
    /// says).
    pub(crate) quant: Quant,
    /// The adapters: their shape from the recipe or the init adapter's config, their targets
    /// the model's own linears, their rank checked against them.
    pub spec: LoraSpec,
    /// `lora.init_adapter`: the PEFT adapter the run starts from.
    pub(crate) init_adapter: Option<PathBuf>,
    /// Every kernel choice (`Kernels::resolve` on the run's device, or `Kernels::forecast`
    /// without one), for this base and these adapters.
    pub(crate) kernels: Kernels,
    /// Where the ranks are: this thread, a thread per device, or a launcher's processes.
    pub(crate) ranks: Ranks,
    /// single, ddp or fsdp.
    pub strategy: Strategy,
    /// The ranks' devices (CUDA ordinals, or virtual CPU ranks).
    pub(crate) devices: Vec<usize>,
    /// How long a rank waits in a collective.
    pub(crate) timeout: Duration,
    /// `train.activation_checkpointing`.
    pub ckpt: Checkpointing,
    /// What forward keeps of each layer (the parked pairs in flight are fitted to the memory
    /// by the preflight: `Keep::with_park`).
    pub(crate) keep: Keep,
    /// Tokens per MLP chunk (`train.mlp_chunk`; None: never chunked).
    pub(crate) mlp_chunk: Option<usize>,
    /// The weight of a MoE's load-balancing loss (0: off).
    pub(crate) router_aux_coef: f64,
    /// Adapter init, shuffling and dropout's seed.
    pub(crate) seed: u64,
    /// The optimiser and its schedule.
    pub optim: Optim,
    /// How many rows a step takes, and how many steps.
    pub batch: BatchPlan,
    /// The data (None: `bench` and `probe`, which run on random rows).
    pub(crate) data: Option<DataSection>,
    /// What the loop does beside the steps.
    pub(crate) hooks: HookPlan,
    /// Where the run writes, and what.
    pub(crate) output: OutputPlan,
    /// `train.max_memory` in bytes.
    pub max_memory: Option<u64>,
    /// What the head's loss is.
    pub(crate) objective: ObjectiveKind,
    /// The reference's log-probabilities are computed in one pass before the first step and
    /// kept in the output directory (`train.precompute_ref`; only with a reference).
    pub(crate) precompute_ref: bool,
}

/// AdamW and the learning-rate schedule (`[train]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Optim {
    /// Peak learning rate.
    pub lr: f64,
    /// AdamW's betas.
    pub betas: [f64; 2],
    /// AdamW's epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Global-norm clipping (0: off).
    pub(crate) max_grad_norm: f64,
    /// constant, linear or cosine.
    pub(crate) schedule: Schedule,
    /// Linear warmup steps.
    pub(crate) warmup_steps: usize,
}

/// Rows per step and steps per run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPlan {
    /// Rows per forward and backward.
    pub(crate) micro_batch: usize,
    /// Micro-batches per optimiser step.
    pub grad_accum: usize,
    /// Tokens per row (`data.seq_len`; bench's `--seq`).
    pub(crate) seq_len: usize,
    /// Steps to take (wins over `epochs`).
    pub(crate) max_steps: Option<usize>,
    /// Passes over the data when `max_steps` is unset (None: one).
    pub(crate) epochs: Option<usize>,
}

/// What the loop does beside the steps (`[train]`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HookPlan {
    /// A progress line and metrics row every this many steps.
    pub(crate) log_every: usize,
    /// Eval every this many steps (0: at the end only, when there is an eval set).
    pub(crate) eval_every: usize,
    /// Greedy samples of `sample_prompts` every this many steps (0: off).
    pub(crate) sample_every: usize,
    /// The prompts `sample_every` completes.
    pub(crate) sample_prompts: Vec<String>,
    /// Skip a non-finite step's update instead of stopping.
    pub(crate) skip_nonfinite: bool,
    /// Only kernels whose sums run in a fixed order (already in `kernels`; kept for reports).
    pub(crate) deterministic: bool,
    /// The trackers the metrics go to as the run goes.
    pub(crate) report_to: Vec<crate::recipe::Tracker>,
}

/// Where a run writes, and what (`[output]`, `train.resume`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OutputPlan {
    /// The output directory.
    pub(crate) dir: PathBuf,
    /// A checkpoint every this many steps (0: none but on a signal).
    pub(crate) save_every: usize,
    /// Checkpoints kept (0: all).
    pub(crate) keep_last: usize,
    /// The merged model written at the end.
    pub(crate) merge: Option<MergePlan>,
    /// Which checkpoint to continue from.
    pub(crate) resume: Resume,
}

/// `[output] merge = true`: the merged model's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MergePlan {
    /// The largest shard, in bytes.
    pub(crate) max_shard_size: u64,
    /// What the adapter goes into.
    pub(crate) merge_into: MergeInto,
}

impl RunConfig {
    /// Whether the run is on CUDA.
    pub(crate) fn cuda(&self) -> bool {
        self.device == DeviceKind::Cuda
    }

    /// The world size the recipe asks for (the launcher's when it started the ranks).
    pub(crate) fn world(&self) -> usize {
        match &self.ranks {
            Ranks::Solo(_) => 1,
            Ranks::Threads { devices, .. } => devices.len().max(1),
            Ranks::Process { env, .. } => env.world,
        }
    }

    /// Dropout's stream seed: the run's seed when the adapters draw dropout, else None.
    pub(crate) fn dropout_seed(&self) -> Option<u64> {
        (self.spec.dropout > 0.0).then_some(self.seed)
    }

    /// The first device's ordinal: the one a single run trains on.
    pub(crate) fn first_ordinal(&self) -> usize {
        match &self.ranks {
            Ranks::Solo(o) => *o,
            Ranks::Threads { devices, .. } => devices.first().copied().unwrap_or(0),
            Ranks::Process { env, .. } => env.local,
        }
    }
}
