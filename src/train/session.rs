//! One rank's training session: the model (FSDP: with this rank's shards of the frozen base),
//! its communicator, and the data, loaded from a recipe. `bench` builds the same model from
//! random weights of a named shape (`sharded_model` with `Model::random_with`).

use super::checkpoint::Cursor;
use super::driver::Par;
use super::eval;
use super::preflight::MemoryWatch;
use crate::data::{Batch, Dataset, ExampleRef, RecipeData, Sampler, TextTokenizer};
use crate::export;
use crate::hub::{self, ModelFiles};
use crate::lora::LoraSpec;
use crate::model::llama::{Group, Loaded};
use crate::model::Model;
use crate::parallel::fsdp::{Flat, Shards};
use crate::parallel::{Comm, Solo};
use crate::recipe::{DataSection, DeviceKind, Dtype, Recipe};
use anyhow::{Context, Result};
use candle_core::{DType, Device};

/// Everything a run needs, built from a recipe (model loaded, data read).
pub struct Session {
    pub recipe: Recipe,
    pub model: Model,
    pub spec: LoraSpec,
    pub data: Dataset,
    pub sampler: Sampler,
    pub pad_id: u32,
    pub base_name: String,
    /// The base checkpoint's directory (a Hub model's snapshot in the cache).
    pub base_dir: std::path::PathBuf,
    /// The Hub commit the base was read at (None for a local directory).
    pub base_revision: Option<String>,
    /// The eval set (data.eval, or held out by data.eval_fraction).
    pub eval: Option<Dataset>,
    /// What loading the data found worth telling: skipped rows, dropped examples, how
    /// chat turns end.
    pub data_notes: Vec<String>,
    /// The model's tokenizer, when the data or `train.sample_every` needs it.
    pub tokenizer: Option<TextTokenizer>,
    /// This rank's communicator (`Solo` for one device).
    pub comm: Box<dyn Comm>,
    /// FSDP: this rank's shards of the frozen base (the model holds placeholders).
    pub shards: Option<Shards>,
    /// The memory plan and what the run measured at load (for reports and OOM diagnoses).
    pub memory: MemoryWatch,
    /// What loading took, part by part.
    pub load_times: LoadTimes,
}

/// Seconds spent loading, apart: the weights (read, cast and uploaded, fresh adapters made
/// with them), lora.init_adapter and the adapters' broadcast to the ranks, and the data
/// (tokenizer, tokenizing or mapping the cache, the eval split).
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadTimes {
    pub weights: f64,
    pub adapters: f64,
    pub data: f64,
}

pub fn device_and_dtype(recipe: &Recipe) -> Result<(Device, DType)> {
    device_and_dtype_on(
        recipe,
        recipe.parallel.devices.first().copied().unwrap_or(0),
    )
}

/// The device (CUDA ordinal `ordinal` when model.device = "cuda") and base dtype.
pub fn device_and_dtype_on(recipe: &Recipe, ordinal: usize) -> Result<(Device, DType)> {
    recipe.check_build()?;
    let dev = match recipe.model.device {
        DeviceKind::Cpu => Device::Cpu,
        DeviceKind::Cuda => {
            missing_ordinal(recipe, ordinal)?;
            Device::new_cuda(ordinal)
                .with_context(|| format!("cannot open CUDA device {ordinal}"))?
        }
    };
    let dtype = match (recipe.model.dtype, recipe.model.device) {
        (Some(Dtype::F32), _) | (None, DeviceKind::Cpu) => DType::F32,
        (Some(Dtype::Bf16), _) | (None, DeviceKind::Cuda) => DType::BF16,
        (Some(Dtype::F16), _) => DType::F16,
    };
    Ok((dev, dtype))
}

/// A CUDA ordinal this machine does not have is a recipe error (parallel.devices).
#[cfg(feature = "cuda")]
fn missing_ordinal(recipe: &Recipe, ordinal: usize) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    let Ok(count) = CudaContext::device_count() else {
        return Ok(()); // opening the device reports the driver's error
    };
    let count = count.max(0) as usize;
    if ordinal < count {
        return Ok(());
    }
    Err(crate::recipe::RecipeError::Invalid {
        path: recipe.source.clone(),
        key: "parallel.devices".into(),
        msg: format!(
            "lists device {ordinal}, but this machine has {count} CUDA device(s): list existing ordinals{}",
            if count > 0 { format!(" (0..{})", count - 1) } else { String::new() }
        ),
    }
    .into())
}

#[cfg(not(feature = "cuda"))]
fn missing_ordinal(_: &Recipe, _: usize) -> Result<()> {
    Ok(())
}

impl Session {
    pub fn new(recipe: Recipe) -> Result<Session> {
        let ordinal = recipe.parallel.devices.first().copied().unwrap_or(0);
        Self::for_rank(recipe, Box::new(Solo), ordinal)
    }

    /// The session of rank `comm.rank()` on CUDA device `ordinal` (ignored on the CPU): under
    /// FSDP only this rank's shards of the base stay resident; the adapters are rank 0's.
    pub fn for_rank(recipe: Recipe, comm: Box<dyn Comm>, ordinal: usize) -> Result<Session> {
        let (dev, dtype) = device_and_dtype_on(&recipe, ordinal)?;
        let files = hub::model_files(&recipe.model)?;
        let dir = files.dir.clone();
        let init = match &recipe.lora.init_adapter {
            Some(p) => Some((p.clone(), export::read_adapter_config(p)?)),
            None => None,
        };
        let spec = match &init {
            // The adapter's shape (r, alpha, targets, rslora) comes from its config; dropout is a
            // training setting and comes from the recipe.
            Some((p, info)) => {
                super::run_check::init_dora(&recipe, p, info)?;
                LoraSpec {
                    dropout: recipe.lora.dropout as f32,
                    ..info.spec.clone()
                }
            }
            None => LoraSpec {
                rank: recipe.lora.rank,
                alpha: recipe.lora.alpha,
                dropout: recipe.lora.dropout as f32,
                rslora: recipe.lora.rslora,
                dora: recipe.lora.use_dora,
                targets: recipe.target_modules()?,
            },
        };
        let init_dir = init.as_ref().map(|(p, _)| p.as_path());
        let spec = super::run_check::lora_targets(&recipe, &files, spec, init_dir)?;
        super::run_check::lora_fits(&recipe, &files, &spec, init_dir)?;
        let fsdp = recipe.parallel.strategy == crate::recipe::Strategy::Fsdp;
        let seed = recipe.train.seed;
        // The run's kernels; with them the adapters' forward folded into the base GEMMs
        // (ops::fold), each layer padded before FSDP shards it.
        let kernels = run_kernels(&recipe, &files, &dev, dtype)?;
        let quant = recipe.quant().for_checkpoint(&files.config)?;
        let t0 = std::time::Instant::now();
        let (mut model, shards) = sharded_model(fsdp, quant, &*comm, &kernels, &mut |loaded| {
            Model::load_with(&files, dtype, &dev, &spec, seed, &kernels, loaded)
        })
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
        model.mlp_chunk = recipe.mlp_chunk();
        model.router_aux_coef = recipe.train.router_aux_loss_coef;
        model.device.synchronize()?;
        let weights = t0.elapsed().as_secs_f64();
        let t0 = std::time::Instant::now();
        if let Some((p, _)) = &init {
            export::load_adapter_weights(p, &model)
                .with_context(|| format!("cannot load lora.init_adapter {}", p.display()))?;
        }
        // Every rank starts from rank 0's adapters.
        if comm.world() > 1 {
            for (_, l) in model.adapters() {
                for v in l.vars() {
                    v.set(&comm.broadcast(v.as_tensor(), 0)?)?;
                }
            }
        }
        model.device.synchronize()?;
        let adapters = t0.elapsed().as_secs_f64();
        let t0 = std::time::Instant::now();
        let opts = crate::data::Options::from_env()?;
        let RecipeData {
            data,
            eval,
            notes: data_notes,
            tokenizer,
        } = crate::data::recipe_data(&recipe, &files, model.cfg.vocab_size, &opts)?;
        let load_times = LoadTimes {
            weights,
            adapters,
            data: t0.elapsed().as_secs_f64(),
        };
        super::run_check::something_to_train(&recipe, &data)?;
        let sampler = Sampler::new(&data, &recipe.data, recipe.train.seed);
        let pad_id = model.cfg.pad_token_id.unwrap_or(0);
        // What PEFT loads the base from: the Hub id, or the local directory as an absolute
        // path (the adapter is loaded from anywhere, not only where training ran).
        let base_name = match &recipe.model.id {
            Some(id) => id.clone(),
            None => std::path::absolute(&dir)
                .unwrap_or_else(|_| dir.clone())
                .to_string_lossy()
                .into_owned(),
        };
        // A Hub model is read from the cache's snapshots/<commit>/: that commit.
        let base_revision = match (&recipe.model.id, dir.parent().and_then(|p| p.file_name())) {
            (Some(_), Some(p)) if p == "snapshots" => {
                dir.file_name().map(|c| c.to_string_lossy().into_owned())
            }
            _ => None,
        };
        Ok(Session {
            recipe,
            model,
            spec,
            data,
            sampler,
            pad_id,
            base_name,
            base_dir: dir,
            base_revision,
            eval,
            data_notes,
            tokenizer,
            comm,
            shards,
            memory: MemoryWatch::default(),
            load_times,
        })
    }

    /// How this rank's micro-batches run (`reduce`: sum gradients over ranks in this one).
    pub fn par(&self, reduce: bool) -> Par<'_> {
        Par {
            comm: &*self.comm,
            shards: self.shards.as_ref(),
            reduce,
        }
    }

    /// Mean token cross-entropy over the eval set (no dropout, no gradients) and its number
    /// of tokens; None without an eval set.
    pub fn eval_loss(&self) -> Result<Option<(f64, usize)>> {
        let Some(ev) = &self.eval else {
            return Ok(None);
        };
        let cfg = DataSection {
            shuffle: false,
            ..self.recipe.data.clone()
        };
        let rows = Sampler::new(ev, &cfg, 0).rows(0);
        let (mut sum, mut n) = (0.0, 0);
        for chunk in rows.chunks(self.recipe.train.micro_batch) {
            let rows: Vec<Vec<ExampleRef>> = chunk
                .iter()
                .map(|r| r.iter().map(|&i| ev.examples.get(i)).collect())
                .collect();
            let b = Batch::from_rows(&rows, self.pad_id, cfg.pack);
            sum += eval::ce_sum_par(&self.model, &self.par(false), &b)?;
            n += b.n_targets();
        }
        Ok(Some((sum / n.max(1) as f64, n)))
    }

    /// This rank's steps of one epoch: steps → micro-batches → rows → example indices.
    pub fn epoch_plan(&self, epoch: usize) -> Vec<Vec<Vec<Vec<usize>>>> {
        self.epoch_plan_of(epoch, self.comm.rank())
    }

    /// Rank `rank`'s steps of one epoch (rows rank, rank + world, ... of the epoch's order).
    pub fn epoch_plan_of(&self, epoch: usize, rank: usize) -> Vec<Vec<Vec<Vec<usize>>>> {
        let t = &self.recipe.train;
        let rows = self.sampler.rows_for(epoch, rank, self.comm.world());
        let micro: Vec<Vec<Vec<usize>>> = rows.chunks(t.micro_batch).map(|c| c.to_vec()).collect();
        micro.chunks(t.grad_accum).map(|c| c.to_vec()).collect()
    }

    pub fn total_steps(&self) -> usize {
        let t = &self.recipe.train;
        t.max_steps
            .unwrap_or_else(|| self.epoch_plan(0).len() * t.epochs.unwrap_or(1))
    }

    /// Counted tokens of each step of an epoch over all ranks: the loss denominator, which
    /// every rank computes alone since every rank sees the whole order.
    pub fn step_denoms(&self, epoch: usize) -> Vec<usize> {
        let mut d: Vec<usize> = Vec::new();
        for rank in 0..self.comm.world() {
            for (i, step) in self.epoch_plan_of(epoch, rank).iter().enumerate() {
                if d.len() <= i {
                    d.resize(i + 1, 0);
                }
                d[i] += step
                    .iter()
                    .map(|m| self.batch(m).n_targets())
                    .sum::<usize>();
            }
        }
        d
    }

    pub fn batch(&self, rows: &[Vec<usize>]) -> Batch {
        let rows: Vec<Vec<ExampleRef>> = rows
            .iter()
            .map(|r| r.iter().map(|&i| self.data.examples.get(i)).collect())
            .collect();
        Batch::from_rows(&rows, self.pad_id, self.recipe.data.pack)
    }

    /// This rank's steps from `cursor` on, epoch after epoch, as batches with the step's loss
    /// denominator (its counted tokens over every rank).
    pub fn steps_from(&self, cursor: Cursor) -> Result<Steps<'_>> {
        Ok(Steps {
            s: self,
            epoch: cursor.epoch,
            first: cursor.step_in_epoch,
            plan: Vec::new().into_iter(),
            denoms: Vec::new(),
            started: false,
        })
    }
}

/// One step of the data plan: where it is in its epoch, this rank's micro-batches.
pub struct PlannedStep {
    pub epoch: usize,
    /// The step's index in its epoch's plan (0-based).
    pub index: usize,
    pub batches: Vec<Batch>,
    /// Counted tokens of the step over every rank.
    pub denom: usize,
}

/// `Session::steps_from`'s iterator.
pub struct Steps<'a> {
    s: &'a Session,
    epoch: usize,
    /// The step of `epoch` to start at (a resumed run's cursor).
    first: usize,
    plan: std::vec::IntoIter<(usize, Vec<Vec<Vec<usize>>>)>,
    /// Several ranks: every step's denominator of `epoch` (each rank computes them alone,
    /// since every rank sees the whole order).
    denoms: Vec<usize>,
    started: bool,
}

impl Iterator for Steps<'_> {
    type Item = Result<PlannedStep>;

    fn next(&mut self) -> Option<Result<PlannedStep>> {
        let s = self.s;
        let (index, rows) = loop {
            if let Some(x) = self.plan.next() {
                break x;
            }
            if self.started {
                self.epoch += 1;
                self.first = 0;
            }
            self.started = true;
            let plan = s.epoch_plan(self.epoch);
            if plan.is_empty() {
                return Some(Err(empty_epoch(s, self.epoch)));
            }
            // A resumed cursor at its epoch's end goes on with the next epoch.
            self.plan = plan
                .into_iter()
                .enumerate()
                .skip(self.first)
                .collect::<Vec<_>>()
                .into_iter();
            self.denoms = match s.comm.world() {
                1 => Vec::new(),
                _ => s.step_denoms(self.epoch),
            };
        };
        let batches: Vec<Batch> = rows.iter().map(|m| s.batch(m)).collect();
        let denom = match s.comm.world() {
            1 => batches.iter().map(Batch::n_targets).sum(),
            _ => self.denoms.get(index).copied().unwrap_or(0),
        };
        Some(Ok(PlannedStep {
            epoch: self.epoch,
            index,
            batches,
            denom,
        }))
    }
}

/// An epoch with no step for this rank: too few rows for the ranks and batch.
fn empty_epoch(s: &Session, epoch: usize) -> anyhow::Error {
    let t = &s.recipe.train;
    let world = s.comm.world();
    let rows = s.sampler.rows(epoch).len();
    anyhow::anyhow!(
        "epoch {epoch} has no step: the data gives {rows} rows and a step takes {} per rank × {world} rank(s) (micro_batch {} × grad_accum {}); add data, or lower train.micro_batch, train.grad_accum or the number of ranks",
        t.micro_batch * t.grad_accum,
        t.micro_batch,
        t.grad_accum
    )
}

/// The kernels a recipe's run takes on `dev` (ops::Kernels, resolved once): from the device,
/// the dtype, the checkpoint's attention shape (head dim, soft-cap) and train.deterministic.
pub fn run_kernels(
    recipe: &Recipe,
    files: &ModelFiles,
    dev: &Device,
    dtype: DType,
) -> Result<crate::ops::Kernels> {
    let attn = crate::model::ModelConfig::from_file(&files.config)?.attn_shape();
    let k = crate::ops::Kernels::resolve(dev, dtype, attn, recipe.train.deterministic)?;
    let k = k.for_adapters(recipe.lora.use_dora);
    Ok(k.for_base(recipe.quant().for_checkpoint(&files.config)?))
}

/// A model that `build` makes layer by layer (from a checkpoint or random weights, the
/// adapters' forward folded into the base GEMMs where `ops::fold` takes the device), its
/// decoder linears in NF4 where `quant` says, and under FSDP this rank's shards of its frozen
/// base: each layer's frozen tensors (NF4 arrays included, quantized first) go into flat
/// shards as soon as they are on the device (padded first, so the shards hold the folded
/// weights), and the full copy is dropped at once.
pub fn sharded_model(
    fsdp: bool,
    quant: crate::quant::Quant,
    comm: &dyn Comm,
    kernels: &crate::ops::Kernels,
    build: &mut dyn FnMut(Loaded) -> Result<Model>,
) -> Result<(Model, Option<Shards>)> {
    let (mut groups, mut nf4_bytes) = (Vec::new(), 0);
    let model = build(&mut |mut g| {
        if let (Group::Layer(layer), true) = (&mut g, quant.is_nf4()) {
            layer.quantize(quant.double_quant)?;
            nf4_bytes += layer.nf4_bytes();
        }
        if fsdp {
            groups.push(Flat::take(g.tensors(), comm)?);
        }
        Ok(())
    })?;
    let shards = match fsdp {
        true => {
            let mut s = Shards::from_groups(groups, model.layers.len(), kernels, comm)?;
            s.nf4_bytes = nf4_bytes;
            Some(s)
        }
        false => None,
    };
    Ok((model, shards))
}
