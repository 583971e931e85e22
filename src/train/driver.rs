//! The layer-wise forward/backward driver: the home of activation checkpointing, FSDP gathers
//! and DDP gradient buckets.
//!
//! Forward runs the decoder one layer at a time, each layer keeping what its hand-written
//! backward needs (`Layer::forward_train`, model/layer_train.rs); backward runs one layer at a
//! time too: given dL/d(output), `Layer::backward` returns dL/d(input) for the layer below and
//! the layer's LoRA gradients. No autograd graph is built at all (`Model::head_loss_bwd` does
//! the head's).
//!
//! With activation checkpointing, forward keeps only each layer's input [B, T, C]; backward
//! recomputes the layer from it (dropout masks are keyed, so identical). Without it, each
//! layer's residual h is parked in host memory until its backward (`Keep::Offload`, the
//! default on CUDA: train/offload.rs) or dropped and recomputed there (`Keep::Acts`). With the
//! MLP half checkpointed, its gate and up are parked instead of recomputed (`Keep::ParkMlp`,
//! the default on CUDA) but in the last few layers.
//!
//! Several ranks (`Par`): under FSDP each layer's frozen base is all-gathered just before its
//! forward and again before its backward (and recompute), and dropped after use; the next
//! layer's gather is issued one layer early (on a second stream, overlapping this layer, by
//! peer copies or NCCL: parallel::nccl; in line on the CPU).
//! The embedding, norm and head are gathered likewise: in line for the embedding, ahead under
//! the last layer for the head; and the last layer's second gather is issued under the head.
//! What forward keeps holds no weights, so only one or two gathered groups exist at a time,
//! with or without checkpointing. On the step's last micro-batch each layer's adapter gradients
//! are summed over the ranks in one bucket as soon as that layer's backward is done (DDP and
//! FSDP alike). With world 1 every collective is the identity.

use super::comm::{Comm, Solo};
use super::objective::{HeadIn, Objective, Sft, Targets};
use super::offload::Offload;
use super::optim::Grads;
use crate::data::Batch;
use crate::model::moe_aux::MoeAux;
use crate::model::router::RouteStore;
use crate::model::{Ctx, Keep, Layer, LayerActs, LayerGrads, Model, Retain};
use crate::ops::pool;
use crate::train::shards::Shards;
use candle_core::{DType, Result, Tensor, Var};
use std::borrow::Cow;

/// How one micro-batch is spread over the ranks.
pub struct Par<'a> {
    pub(crate) comm: &'a dyn Comm,
    /// FSDP: the frozen base's shards (the model's frozen tensors are placeholders).
    pub(crate) shards: Option<&'a Shards>,
    /// Sum the adapter gradients over the ranks as each layer's backward ends (true on the
    /// last micro-batch of a step; the sums of the earlier ones ride along).
    pub(crate) reduce: bool,
}

impl Par<'static> {
    /// One rank, the whole model resident.
    pub fn single() -> Par<'static> {
        Par {
            comm: &Solo,
            shards: None,
            reduce: true,
        }
    }
}

impl Par<'_> {
    /// Layer `l`, gathered under FSDP, dequantized on an NF4 base.
    pub(crate) fn layer<'m>(&self, model: &'m Model, l: usize) -> Result<Cow<'m, Layer>> {
        self.gather(model, l, false)
    }

    /// Layer `l`, its gather issued ahead of use: call `ready`, then `resident`, before
    /// running it (under FSDP an NF4 layer arrives in NF4, to be dequantized once it landed).
    pub(crate) fn layer_ahead<'m>(&self, model: &'m Model, l: usize) -> Result<Cow<'m, Layer>> {
        self.gather(model, l, true)
    }

    /// `layer` (from `layer_ahead`, after `ready`) with its NF4 linears dequantized; as it is
    /// when it has none, or was dequantized as it was gathered.
    pub(crate) fn resident<'m>(
        &self,
        model: &Model,
        layer: Cow<'m, Layer>,
    ) -> Result<Cow<'m, Layer>> {
        match layer {
            Cow::Borrowed(l) => l.resident_in(Some(&model.slabs)),
            Cow::Owned(l) => match l.resident_in(Some(&model.slabs))? {
                Cow::Owned(r) => Ok(Cow::Owned(r)),
                Cow::Borrowed(_) => Ok(Cow::Owned(l)),
            },
        }
    }

    /// The layers issued ahead so far may be used from here on.
    pub(crate) fn ready(&self) -> Result<()> {
        match self.shards {
            Some(_) => self.comm.gathered(),
            None => Ok(()),
        }
    }

    fn gather<'m>(&self, model: &'m Model, l: usize, ahead: bool) -> Result<Cow<'m, Layer>> {
        match self.shards {
            // NF4: dequantized here, freed when the layer is dropped.
            None => match model.layers.get(l) {
                Some(layer) => layer.resident_in(Some(&model.slabs)),
                None => candle_core::bail!("driver: no layer {l}"),
            },
            // NF4 under FSDP: dequantized once the gather landed (in line: now).
            Some(s) => {
                let layer = Cow::Owned(s.layer(model, l, self.comm, ahead)?);
                match ahead {
                    true => Ok(layer),
                    false => self.resident(model, layer),
                }
            }
        }
    }

    /// The embedding / norm / head, gathered under FSDP (None: use the model's own).
    pub(crate) fn io(&self, model: &Model) -> Result<Option<Model>> {
        self.shards
            .map(|s| s.io(model, self.comm, false))
            .transpose()
    }

    /// `io`, its gather issued ahead of use: call `ready` before using it.
    pub(crate) fn io_ahead(&self, model: &Model) -> Result<Option<Model>> {
        self.shards
            .map(|s| s.io(model, self.comm, true))
            .transpose()
    }
}

/// What forward leaves behind for one layer.
enum Saved {
    /// Checkpointed: the layer input only.
    Input(Tensor),
    /// Checkpointed, the input parked in host memory.
    Parked,
    /// Kept: what the layer's backward needs, but what was parked in host memory.
    Acts(LayerActs, Option<Bundle>),
}

/// What a layer whose activations are kept parked in host memory.
#[derive(Clone, Copy)]
enum Bundle {
    /// The residual h [m, C].
    H,
    /// The MLP's gate and up [m, I] each.
    GateUp,
}

/// Runs one micro-batch forward and backward on one rank; adds its adapter gradients into
/// `grads`. The loss is Σ token CE / `denom` (denom = counted tokens of the whole accumulated
/// batch, so micro-batches of different sizes weigh as one big batch would). Returns Σ token
/// CE. The reference form of what the step engine (train::step) runs: `forward_backward_dev`.
pub fn forward_backward(
    model: &Model,
    batch: &Batch,
    denom: f64,
    keep: Keep,
    dropout: Option<(u64, [u64; 2])>,
    grads: &mut Grads,
) -> Result<f64> {
    let par = Par::single();
    let ce = forward_backward_dev(
        model,
        &par,
        batch,
        denom,
        keep,
        dropout,
        grads,
        &Sft::default(),
        &mut |_| Ok(()),
    )?;
    match ce {
        Some(ce) => Ok(ce.to_scalar::<f32>()? as f64),
        None => Ok(0.0),
    }
}

/// The Σ CE of a step's micro-batches so far with one more micro-batch's
/// (`forward_backward_dev`'s), kept on the device; None while nothing was counted.
pub(crate) fn add_ce(sum: Option<Tensor>, more: Option<Tensor>) -> Result<Option<Tensor>> {
    match (sum, more) {
        (Some(a), Some(b)) => Ok(Some((a + b)?)),
        (a, b) => Ok(a.or(b)),
    }
}

/// One micro-batch's forward and backward on rank `par.comm.rank()` of `par.comm.world()`:
/// `denom` is the counted tokens of the whole step over every rank, so the ranks' summed
/// gradients are the single-rank ones. Σ CE of this rank stays on the device (a scalar f32
/// tensor; None: nothing counted), so that the host does not wait for the backward: reading
/// it is a synchronisation. `probe(phase)` is called as each phase ends ("forward", "head",
/// "backward"): the memory meter reads the pool's peak there. `objective`: what the head's
/// loss is (train::objective).
#[allow(clippy::too_many_arguments)]
pub fn forward_backward_dev(
    model: &Model,
    par: &Par,
    batch: &Batch,
    denom: f64,
    keep: Keep,
    dropout: Option<(u64, [u64; 2])>,
    grads: &mut Grads,
    objective: &dyn Objective,
    probe: &mut dyn FnMut(&'static str) -> Result<()>,
) -> Result<Option<Tensor>> {
    let dev = &model.device;
    let (b, t) = (batch.b, batch.t);
    // A preference objective's reference forward (keeping nothing) comes first.
    let reference = objective.reference(model, par, batch)?;
    // Every upload of the micro-batch happens here, before any work of it is queued: an
    // upload from pageable host memory can wait for the device's queue to drain, which at
    // the head would hold the host until the whole forward has run.
    let ids = Tensor::from_slice(&batch.ids, (b, t), dev)?;
    let n_tgt = batch.targets.len();
    let targets = match n_tgt {
        0 => None,
        _ => {
            // [rows | targets] in one upload
            let both: Vec<u32> = (batch.targets.iter().map(|&(i, _)| i as u32))
                .chain(batch.targets.iter().map(|&(_, l)| l))
                .collect();
            let both = Tensor::from_vec(both, 2 * n_tgt, dev)?;
            Some(Targets {
                rows: both.narrow(0, 0, n_tgt)?,
                tokens: both.narrow(0, n_tgt, n_tgt)?,
            })
        }
    };
    let mut ctx = batch_ctx(model, batch, dropout)?;
    if let Some(s) = par.shards {
        // FSDP: the folded linears' B's go into the shards, to arrive with each gather.
        ctx.folded = s.write_pads(model)?;
    }
    if model.cfg.arch.moe.is_some() {
        // the forward's routing of each MoE layer, for its backward: no second read
        ctx.moe_routes = Some(RouteStore::default());
        if model.router_aux_coef > 0.0 {
            // this micro-batch's share of the step's loss: its counted tokens over the step's
            let scale = model.router_aux_coef * n_tgt as f64 / denom.max(1.0);
            ctx.moe_aux = Some(MoeAux::new(&batch.real, scale, dev)?);
        }
    }
    let fwd = forward(model, par, &ctx, &ids, keep)?;
    probe("forward")?;
    // The routers' load-balancing loss, in Σ CE's units (× denom), once every layer counted.
    let aux = match &ctx.moe_aux {
        Some(a) => a.finish()?.map(|l| l * denom).transpose()?,
        None => None,
    };

    // With several ranks a rank with nothing to predict still runs backward: the others wait
    // for its gathers and gradient sums.
    if batch.targets.is_empty() && par.comm.world() == 1 {
        return Ok(None);
    }
    let io = match fwd.head {
        Some(io) => {
            par.ready()?;
            Some(io)
        }
        None => par.io(model)?,
    };
    // The last layer's weights come in again for its backward under the head.
    let n_layers = model.layers.len();
    let next = (n_layers > 0)
        .then(|| par.layer_ahead(model, n_layers - 1))
        .transpose()?;
    let c = model.cfg.hidden_size;
    let x = fwd.x.reshape((b * t, c))?;
    let head_model = io.as_ref().unwrap_or(model);
    let head_in = HeadIn {
        targets: targets.as_ref(),
        denom,
        batch,
        reference: reference.as_ref(),
    };
    let out = objective.head(head_model, &x, &head_in)?;
    let (ce, g) = (out.loss_sum, out.grad_rows);
    let g = place_rows(g, &batch.targets, &x)?; // dL/dh [B·T, C]
    drop((x, io));
    let g = g.reshape((b, t, c))?;
    probe("head")?;

    let back = Back {
        saved: fwd.saved,
        offload: fwd.offload,
        held: fwd.held,
    };
    backward(model, par, &ctx, back, next, g, grads)?;
    probe("backward")?;
    add_ce(ce, aux)
}

/// What the forward leaves for the head and the backward.
struct Forward {
    /// The last layer's output [B, T, C].
    x: Tensor,
    /// Per layer, what its backward needs.
    saved: Vec<Saved>,
    /// Bytes of `saved`, for ops::pool::account_cpu.
    held: u64,
    offload: Option<Offload>,
    /// FSDP: the embedding / norm / head, gathered ahead under the last layer.
    head: Option<Model>,
}

/// The decoder forward, layer by layer, each keeping what `keep` says for its backward; under
/// FSDP each layer gathered one layer ahead.
fn forward(model: &Model, par: &Par, ctx: &Ctx, ids: &Tensor, keep: Keep) -> Result<Forward> {
    let dev = &model.device;
    let n_layers = model.layers.len();
    let mut x = match par.io(model)? {
        Some(io) => io.embed(ids)?,
        None => model.embed(ids)?,
    }; // [B, T, C], no graph
    let mut saved = Vec::with_capacity(n_layers);
    let mut held = 0u64;
    let mut offload = match keep {
        k if k.parks() => Some(Offload::new(dev, n_layers, k.pending())?),
        _ => None,
    };
    let m = ids.elem_count();
    let mut next = (n_layers > 0).then(|| par.layer(model, 0)).transpose()?;
    let mut head = None;
    for l in 0..n_layers {
        let Some(layer) = next.take() else {
            candle_core::bail!("driver: layer {l} was not gathered");
        };
        // This layer's gather has landed; the next one's is issued before this layer runs.
        par.ready()?;
        if l + 1 < n_layers {
            next = Some(par.layer_ahead(model, l + 1)?);
        } else {
            // the head's weights come in under the last layer (in the next layer's room)
            head = par.io_ahead(model)?;
        }
        let layer = par.resident(model, layer)?; // (the next gather overlaps the dequant)
        let park_mlp = keep.parks_mlp(l, n_layers) && layer.mlp_runs_whole(ctx, m);
        let retain = match park_mlp {
            true => Retain::All,
            false => keep.retain(),
        };
        let (y, acts) = layer.forward_retain(&x, ctx, retain)?;
        saved.push(match acts {
            Some(mut acts) => {
                let parked = match (keep, &mut offload) {
                    // gate and up parked, the residual h kept on the device
                    (_, Some(off)) if park_mlp => match acts.take_gate_up() {
                        Some(gu) => {
                            off.put(l, gu)?;
                            Some(Bundle::GateUp)
                        }
                        None => candle_core::bail!("driver: layer {l} kept no gate and up"),
                    },
                    // The residual h: parked (but the last layer's, whose backward comes
                    // first), or dropped and recomputed in backward.
                    (Keep::Offload | Keep::Acts, off) => match (acts.take_h(), off) {
                        (Some(h), Some(off)) if l + 1 < n_layers => {
                            off.put(l, vec![h])?;
                            Some(Bundle::H)
                        }
                        (Some(h), Some(_)) => {
                            acts.put_h(h);
                            None
                        }
                        _ => None,
                    },
                    _ => None,
                };
                held += acts.bytes() as u64;
                Saved::Acts(acts, parked)
            }
            // The input: parked (but the last layer's, whose recompute comes first), or kept.
            None => match &mut offload {
                Some(off) if l + 1 < n_layers => {
                    off.put(l, vec![x])?;
                    Saved::Parked
                }
                _ => {
                    held += crate::ops::tensor_bytes(&x);
                    Saved::Input(x)
                }
            },
        });
        x = y;
        pool::account_cpu(dev, held, "forward")?;
    }
    Ok(Forward {
        x,
        saved,
        held,
        offload,
        head,
    })
}

/// The one tensor of a parked bundle.
fn one(bundle: Vec<Tensor>) -> Result<Tensor> {
    match <[Tensor; 1]>::try_from(bundle) {
        Ok([t]) => Ok(t),
        Err(b) => candle_core::bail!(
            "driver: a bundle of {} tensors where one was parked",
            b.len()
        ),
    }
}

/// What the backward takes over from the forward.
struct Back {
    saved: Vec<Saved>,
    offload: Option<Offload>,
    held: u64,
}

/// The decoder backward from dL/d(last output) `g`, last layer first (recomputing a
/// checkpointed layer from its input; under FSDP each layer gathered again, one layer ahead,
/// `next` the last one's gather); adds the adapter gradients into `grads`, and on the step's
/// last micro-batch sums each layer's over the ranks as soon as its backward is done.
fn backward<'m>(
    model: &'m Model,
    par: &Par,
    ctx: &Ctx,
    mut back: Back,
    mut next: Option<Cow<'m, Layer>>,
    mut g: Tensor,
    grads: &mut Grads,
) -> Result<()> {
    let dev = &model.device;
    let n_layers = model.layers.len();
    let world = par.comm.world();
    for l in (0..n_layers).rev() {
        let Some(layer) = next.take() else {
            candle_core::bail!("driver: layer {l} was not gathered");
        };
        par.ready()?;
        if l > 0 {
            next = Some(par.layer_ahead(model, l - 1)?);
        }
        let layer = par.resident(model, layer)?;
        let acts = match back.saved.pop() {
            Some(Saved::Acts(mut acts, parked)) => {
                if let (Some(off), Some(bundle)) = (&mut back.offload, parked) {
                    let tensors = off.take(l)?;
                    match bundle {
                        Bundle::H => acts.put_h(one(tensors)?),
                        Bundle::GateUp => acts.put_gate_up(tensors)?,
                    }
                }
                // the layer below's parked tensors come back while this layer runs backward
                if let (Some(off), Some(Saved::Acts(_, Some(_)))) =
                    (&mut back.offload, back.saved.last())
                {
                    off.fetch(l - 1)?;
                }
                acts
            }
            Some(saved @ (Saved::Input(_) | Saved::Parked)) => {
                let x = match (saved, &mut back.offload) {
                    (Saved::Input(x), _) => x,
                    (_, Some(off)) => one(off.take(l)?)?,
                    (_, None) => candle_core::bail!("driver: layer {l}'s input was not parked"),
                };
                // the layer below's input comes back while this layer runs
                if let (Some(off), true) = (&mut back.offload, l > 0) {
                    off.fetch(l - 1)?;
                }
                let acts = layer.recompute(&x, ctx)?;
                pool::account_cpu(dev, back.held + acts.bytes() as u64, "backward")?;
                acts
            }
            None => candle_core::bail!("driver: no saved activations for layer {l}"),
        };
        // The first layer's input is the frozen embedding's output: no dL/dx for it.
        let lg = if l > 0 {
            let (dx, lg) = layer.backward(acts, &g, ctx)?;
            g = dx;
            lg
        } else {
            layer.backward_grads(acts, &g, ctx)?
        };
        accumulate(lg, grads)?;
        if par.reduce && world > 1 {
            all_reduce_layer(&layer, grads, par.comm, ctx)?;
        }
    }
    if par.reduce && world > 1 && ctx.kernels.experiments.reduce_ahead {
        par.comm.reduced()?; // the sums issued under the layers below are in
    }
    Ok(())
}

/// dL/dh [N, C] (`like`'s shape and dtype) from the head chunks' rows, `targets` giving each
/// row's position; the rest zero, a position given twice the sum. Runs of consecutive
/// positions (a row's tokens but its last, or a completion) go in as slices between zero
/// blocks, a few copies; a position behind the last run's end (a preference pair's prompt end,
/// which predicts both completions' first tokens: data::pref_batch) adds in after them by one
/// index_add; many short runs take one index_add for all (candle's copies all of dL/dh at each
/// call, so not one a chunk).
fn place_rows(mut parts: Vec<Tensor>, targets: &[(usize, u32)], like: &Tensor) -> Result<Tensor> {
    const MAX_RUNS: usize = 64;
    let (n, c) = like.dims2()?;
    if parts.is_empty() {
        return like.zeros_like();
    }
    let gh = match parts.len() {
        1 => parts.swap_remove(0),
        _ => Tensor::cat(&parts, 0)?,
    }; // [targets, C]
       // (first position, length, first row of gh) of each run of consecutive positions; the
       // (row of gh, position) of each target behind the runs' end
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    let mut behind: Vec<(u32, u32)> = Vec::new();
    for (k, &(i, _)) in targets.iter().enumerate() {
        match runs.last_mut() {
            Some((s, l, _)) if *s + *l == i => *l += 1,
            Some((s, l, _)) if i < *s + *l => behind.push((k as u32, i as u32)),
            _ => runs.push((i, 1, k)),
        }
    }
    if runs.len() > MAX_RUNS || behind.len() > MAX_RUNS {
        let rows: Vec<u32> = targets.iter().map(|&(i, _)| i as u32).collect();
        let rows = Tensor::from_vec(rows, targets.len(), like.device())?;
        return like.zeros_like()?.index_add(&rows, &gh, 0);
    }
    let mut pieces = Vec::with_capacity(2 * runs.len() + 1);
    let mut at = 0;
    for (s, l, off) in runs {
        if s > at {
            pieces.push(Tensor::zeros((s - at, c), like.dtype(), like.device())?);
        }
        pieces.push(gh.narrow(0, off, l)?);
        at = s + l;
    }
    if at < n {
        pieces.push(Tensor::zeros((n - at, c), like.dtype(), like.device())?);
    }
    let placed = Tensor::cat(&pieces, 0)?;
    if behind.is_empty() {
        return Ok(placed);
    }
    let dev = like.device();
    let (from, to): (Vec<u32>, Vec<u32>) = behind.into_iter().unzip();
    let k = from.len();
    let rows = gh.index_select(&Tensor::from_vec(from, k, dev)?, 0)?;
    placed.index_add(&Tensor::from_vec(to, k, dev)?, &rows, 0)
}

/// Adds a layer's adapter gradients (f32) into the running sums.
fn accumulate(lg: LayerGrads, grads: &mut Grads) -> Result<()> {
    for (id, g) in lg {
        let sum = match grads.remove(&id) {
            Some(prev) => (prev + g)?,
            None => g,
        };
        grads.insert(id, sum);
    }
    Ok(())
}

/// Sums one layer's adapter gradients over the ranks as one flat f32 bucket (a missing
/// gradient counts as zeros, so every rank sends the same layout). Under the `reduce_ahead`
/// experiment (`ctx.kernels.experiments`) the sum runs on the comm's second stream under the
/// backward of the layers below, and the compute stream waits for them all once, after the
/// first layer (`Comm::reduced`), instead of for each as it is issued.
fn all_reduce_layer(layer: &Layer, grads: &mut Grads, comm: &dyn Comm, ctx: &Ctx) -> Result<()> {
    // every adapter of the layer, a MoE layer's experts' included
    let vars: Vec<&Var> = layer
        .adapters()
        .into_iter()
        .flat_map(|(_, l)| l.vars())
        .collect();
    if vars.is_empty() {
        return Ok(());
    }
    let mut flat = Vec::with_capacity(vars.len());
    for v in &vars {
        let g = match grads.get(&v.id()) {
            Some(g) => g.clone(),
            None => v.as_tensor().zeros_like()?.to_dtype(DType::F32)?,
        };
        flat.push(g.flatten_all()?);
    }
    let flat = Tensor::cat(&flat, 0)?; // [Σ numel] f32
    let sum = match ctx.kernels.experiments.reduce_ahead {
        true => comm.all_reduce_sum_ahead(&flat)?, // read after `reduced`, past the last layer
        false => comm.all_reduce_sum(&flat)?,
    };
    let mut off = 0;
    for v in vars {
        let n = v.elem_count();
        grads.insert(v.id(), sum.narrow(0, off, n)?.reshape(v.dims())?);
        off += n;
    }
    Ok(())
}

/// A batch's context: its positions and segment ids, the prefix-tree mask where its rows are
/// preference pairs laid out as trees (`data::pref_batch`), and the dropout key.
pub(crate) fn batch_ctx(
    model: &Model,
    batch: &Batch,
    dropout: Option<(u64, [u64; 2])>,
) -> Result<Ctx> {
    let segments = batch.segments.clone();
    let mut ctx = model.ctx(&batch.positions, batch.b, batch.t, segments, dropout)?;
    ctx.mask.prefix_tree = batch.prefix_tree;
    Ok(ctx)
}

/// Forward only, for logits-level checks: the model's `forward` with a batch's context.
pub fn logits(model: &Model, batch: &Batch) -> Result<Tensor> {
    let ids = Tensor::from_slice(&batch.ids, (batch.b, batch.t), &model.device)?;
    model.forward(&ids, &batch_ctx(model, batch, None)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Runs of positions between zero rows, many short runs by index_add: both equal the
    /// scatter they replace, to the bit.
    #[test]
    fn placed_rows_equal_the_scatter() {
        let dev = Device::Cpu;
        let (n, c) = (300, 3);
        let like = Tensor::zeros((n, c), candle_core::DType::F32, &dev).unwrap();
        let few: Vec<usize> = (5..40)
            .chain(41..41)
            .chain(100..180)
            .chain(250..299)
            .collect();
        let many: Vec<usize> = (0..n).filter(|i| i % 3 == 1).collect(); // 100 runs of 1

        // prefix trees (data::pref_batch): each completion's first token from the prompt's
        // end, a position again behind the run before; and one behind into a gap
        let trees: Vec<usize> = (9..20)
            .chain([9])
            .chain(21..30)
            .chain(40..50)
            .chain([40, 3])
            .chain(55..60)
            .collect();
        for positions in [few, many, trees] {
            let targets: Vec<(usize, u32)> = positions.iter().map(|&i| (i, 0)).collect();
            let k = targets.len();
            let gh = Tensor::arange(1f32, (k * c + 1) as f32, &dev)
                .unwrap()
                .reshape((k, c))
                .unwrap();
            // two chunks, as the head makes them
            let parts = vec![
                gh.narrow(0, 0, k / 2).unwrap(),
                gh.narrow(0, k / 2, k - k / 2).unwrap(),
            ];
            let got = place_rows(parts, &targets, &like).unwrap();
            let rows: Vec<u32> = positions.iter().map(|&i| i as u32).collect();
            let rows = Tensor::from_vec(rows, k, &dev).unwrap();
            let want = like.index_add(&rows, &gh, 0).unwrap();
            assert_eq!(
                got.to_vec2::<f32>().unwrap(),
                want.to_vec2::<f32>().unwrap()
            );
        }
    }
}
