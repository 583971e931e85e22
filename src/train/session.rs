//! One rank's session: its model (under FSDP with this rank's shards of the frozen base), its
//! communicator and its memory watch, loaded from a resolved run (`RunConfig`). `train` adds
//! the data (train::train_data); `bench` is a session on random weights (or a checkpoint) on
//! random rows; `probe` a session stepped once per rung. One loader serves all three.

use super::comm::Comm;
use super::driver::Par;
use super::flat::Flat;
use super::meter::MemoryWatch;
use super::run_config::RunConfig;
use crate::hub::{self, ModelFiles};
use crate::model::decoder::{Group, Loaded};
use crate::model::{device, Build, Model};
use crate::ops::Kernels;
use crate::quant::Quant;
use crate::recipe::Strategy;
use crate::train::shards::Shards;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One rank's model, communicator and memory watch.
pub struct Session {
    /// The resolved run every rank shares.
    pub run: Arc<RunConfig>,
    /// This rank's model, its adapters trainable.
    pub model: Model,
    /// This rank's communicator (`Solo` for one device).
    pub comm: Box<dyn Comm>,
    /// FSDP: this rank's shards of the frozen base (the model holds placeholders).
    pub shards: Option<Shards>,
    /// The memory plan and what the run measured at load (for reports and OOM diagnoses).
    pub(crate) memory: MemoryWatch,
    /// The base checkpoint's directory (a Hub model's snapshot in the cache; None: random
    /// weights).
    pub(crate) base_dir: Option<PathBuf>,
    /// The Hub commit the base was read at (None for a local directory or random weights).
    pub base_revision: Option<String>,
    /// What loading took, part by part.
    pub load_times: LoadTimes,
    /// `train.pref_reference = "init_adapter"`: the init adapter's values, copied as loaded
    /// (the reference of DPO and KTO, whatever the run's adapters become).
    pub reference:
        Option<Arc<std::collections::HashMap<candle_core::TensorId, candle_core::Tensor>>>,
}

/// Seconds loading a session took, apart: the weights (read, cast and uploaded, fresh
/// adapters made with them), and lora.init_adapter with the adapters' broadcast to the ranks.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadTimes {
    /// The weights: read, cast and uploaded, fresh adapters made with them.
    pub weights: f64,
    /// lora.init_adapter, and the adapters' broadcast to the ranks.
    pub adapters: f64,
}

impl Session {
    /// The session of rank `comm.rank()` on CUDA device `ordinal` (ignored on the CPU): the
    /// base from the run's checkpoint (downloaded as needed) or random weights, the adapters
    /// fresh or the init adapter's, every rank starting from rank 0's; under FSDP only this
    /// rank's shards of the base stay resident. `init_adapter` reads lora.init_adapter's
    /// weights into the model's adapters (`run::session` passes export's PEFT reader).
    pub fn load_with(
        run: Arc<RunConfig>,
        comm: Box<dyn Comm>,
        ordinal: usize,
        init_adapter: &dyn Fn(&Path, &Model) -> Result<()>,
    ) -> Result<Session> {
        let dev = device::open(run.device, ordinal)?;
        crate::ops::pool::keep_pool_memory(&dev)?;
        let files = weights(&run)?;
        let build = Build {
            cfg: run.cfg.clone(),
            dtype: run.dtype,
            device: dev,
            adapters: Arc::new(run.spec.clone()),
            seed: run.seed,
            kernels: run.kernels,
            mlp_chunk: run.mlp_chunk,
            router_aux_coef: run.router_aux_coef,
        };
        let fsdp = run.strategy == Strategy::Fsdp;
        let t0 = std::time::Instant::now();
        let (model, shards) =
            sharded_model(
                fsdp,
                run.quant,
                &*comm,
                &run.kernels,
                &mut |loaded| match &files {
                    Some(f) => Model::load_with(f, &build, loaded),
                    None => Model::random_with(&build, loaded),
                },
            )
            .with_context(|| match &files {
                Some(f) => format!("cannot load the model in {}", f.dir.display()),
                None => format!("cannot make the random model of {}", run.base_name),
            })?;
        model.device.synchronize()?;
        let weights = t0.elapsed().as_secs_f64();
        let t0 = std::time::Instant::now();
        if let Some(p) = &run.init_adapter {
            init_adapter(p, &model)
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
        let reference = match run.objective.reference() {
            Some(super::objective::Reference::InitAdapter) => {
                Some(super::pref_ref::snapshot(&model)?)
            }
            _ => None,
        };
        model.device.synchronize()?;
        let load_times = LoadTimes {
            weights,
            adapters: t0.elapsed().as_secs_f64(),
        };
        let base_revision = files.as_ref().and_then(|f| revision_of(&run, f));
        Ok(Session {
            base_dir: files.map(|f| f.dir),
            base_revision,
            run,
            model,
            comm,
            shards,
            memory: MemoryWatch::default(),
            load_times,
            reference,
        })
    }

    /// How this rank's micro-batches run (`reduce`: sum gradients over ranks in this one).
    pub(crate) fn par(&self, reduce: bool) -> Par<'_> {
        Par {
            comm: &*self.comm,
            shards: self.shards.as_ref(),
            reduce,
        }
    }
}

/// The weights of a run's base: its checkpoint's files (a Hub model downloaded into the cache
/// as needed), or None for random weights.
fn weights(run: &RunConfig) -> Result<Option<hub::ModelFiles>> {
    match &run.source {
        Some(src) => Ok(Some(hub::model_files(src).with_context(|| {
            format!("cannot get the weights of {}", run.base_name)
        })?)),
        None => Ok(None),
    }
}

/// A Hub model is read from the cache's snapshots/<commit>/: that commit.
fn revision_of(run: &RunConfig, files: &ModelFiles) -> Option<String> {
    let dir = &files.dir;
    match (&run.source, dir.parent().and_then(|p| p.file_name())) {
        (Some(crate::hub::Source::Hub { .. }), Some(p)) if p == "snapshots" => {
            dir.file_name().map(|c| c.to_string_lossy().into_owned())
        }
        _ => None,
    }
}

/// A model that `build` makes layer by layer (from a checkpoint or random weights, the
/// adapters' forward folded into the base GEMMs where `ops::fold` takes the device), its
/// decoder linears in NF4 where `quant` says, and under FSDP this rank's shards of its frozen base:
/// each layer's frozen tensors (NF4 arrays included, quantized first) go into flat shards as
/// soon as they are on the device (padded first, so the shards hold the folded weights), and
/// the full copy is dropped at once.
pub fn sharded_model(
    fsdp: bool,
    quant: Quant,
    comm: &dyn Comm,
    kernels: &Kernels,
    build: &mut dyn FnMut(Loaded) -> Result<Model>,
) -> Result<(Model, Option<Shards>)> {
    let (mut groups, mut nf4_bytes) = (Vec::new(), 0);
    let model = build(&mut |mut g| {
        if let (Group::Layer(layer), true) = (&mut g, quant.nf4) {
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
