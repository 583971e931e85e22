//! The layer-wise forward/backward driver: the home of activation checkpointing (and, later,
//! FSDP gathers and DDP buckets).
//!
//! Forward runs the decoder one layer at a time. Each layer's input is a fresh leaf (`Var`), so
//! backward can run one layer at a time too: given dL/d(output) g, the surrogate Σ(y ⊙ g)
//! has the layer's true gradients, and its backward yields dL/d(input) for the layer below and
//! the layer's LoRA gradients. Whatever a layer's backward produced is dropped before the next
//! layer's, so at most one layer's graph and gradients are alive at once during backward.
//!
//! With activation checkpointing, forward keeps only each layer's input [B, T, C] and drops
//! the graph; backward recomputes the layer from it (dropout masks are keyed, so identical).

use super::optim::Grads;
use crate::data::Batch;
use crate::memory;
use crate::model::llama::cross_entropy_sum;
use crate::model::{Ctx, Layer, Model};
use candle_core::{DType, Result, Tensor, Var};

/// What forward leaves behind for one layer.
enum Saved {
    /// Checkpointed: the layer input only.
    Input(Tensor),
    /// Kept: the input leaf and the output with its graph.
    Graph(Var, Tensor),
}

/// Runs one micro-batch forward and backward; adds its adapter gradients into `grads`.
/// The loss is Σ token CE / `denom` (denom = counted tokens of the whole accumulated batch,
/// so micro-batches of different sizes weigh as one big batch would). Returns Σ token CE.
pub fn forward_backward(
    model: &Model,
    batch: &Batch,
    denom: f64,
    checkpointing: bool,
    dropout: Option<(u64, [u64; 2])>,
    grads: &mut Grads,
) -> Result<f64> {
    forward_backward_probed(
        model,
        batch,
        denom,
        checkpointing,
        dropout,
        grads,
        None,
        &mut |_| Ok(()),
    )
}

/// `forward_backward`, calling `probe(phase)` as each phase ends ("forward", "head",
/// "backward"): the memory reports read and reset the device's peak there. `head_chunk`:
/// counted positions per lm_head + loss chunk (None: ~2^24 logits at a time).
#[allow(clippy::too_many_arguments)]
pub fn forward_backward_probed(
    model: &Model,
    batch: &Batch,
    denom: f64,
    checkpointing: bool,
    dropout: Option<(u64, [u64; 2])>,
    grads: &mut Grads,
    head_chunk: Option<usize>,
    probe: &mut dyn FnMut(&'static str) -> Result<()>,
) -> Result<f64> {
    let dev = &model.device;
    let (b, t) = (batch.b, batch.t);
    let ids = Tensor::from_slice(&batch.ids, (b, t), dev)?;
    let ctx = model.ctx(&batch.positions, b, t, batch.segments.clone(), dropout)?;

    // ---- forward, layer by layer
    let mut x = model.embed(&ids)?; // [B, T, C], no graph
    let mut saved = Vec::with_capacity(model.layers.len());
    let mut held = 0u64; // bytes of the saved tensors, for memory::account_cpu
    for layer in &model.layers {
        if checkpointing {
            let y = layer.forward(&x, &ctx)?.detach();
            held += memory::tensor_bytes(&x);
            saved.push(Saved::Input(std::mem::replace(&mut x, y)));
        } else {
            let xv = Var::from_tensor(&x)?;
            let y = layer.forward(xv.as_tensor(), &ctx)?;
            x = y.detach();
            held += memory::tensor_bytes(xv.as_tensor()) + memory::tensor_bytes(&y);
            saved.push(Saved::Graph(xv, y));
        }
        memory::account_cpu(dev, held, "forward")?;
    }

    probe("forward")?;

    // ---- head + loss on the counted positions only
    if batch.targets.is_empty() {
        return Ok(0.0);
    }
    // The head runs over chunks of the counted positions, each chunk's forward and backward
    // before the next, so the f32 logits of only ~2^24 entries exist at a time
    // ([N × V] at once is 0.5 GB per 4k tokens at a 32k vocabulary, and CE keeps several).
    let c = model.cfg.hidden_size;
    let x = x.reshape((b * t, c))?;
    let chunk = head_chunk
        .unwrap_or((1usize << 24) / model.cfg.vocab_size.max(1))
        .max(1);
    let mut g = x.zeros_like()?; // dL/dh [B·T, C]
    let mut ce_value = 0f64;
    for part in batch.targets.chunks(chunk) {
        let rows: Vec<u32> = part.iter().map(|&(i, _)| i as u32).collect();
        let tgt: Vec<u32> = part.iter().map(|&(_, l)| l).collect();
        let rows = Tensor::from_vec(rows, part.len(), dev)?;
        let tgt = Tensor::from_vec(tgt, part.len(), dev)?;
        let hv = Var::from_tensor(&x.index_select(&rows, 0)?)?; // [n, C]
        let ce = cross_entropy_sum(&model.head(hv.as_tensor())?, &tgt)?; // scalar f32
        ce_value += ce.to_scalar::<f32>()? as f64;
        let gs = (ce / denom)?.backward()?;
        if let Some(gh) = gs.get(hv.as_tensor()) {
            // Gradients come back with the graph that computed them attached: detach, or
            // the whole step's activations stay alive through them.
            g = g.index_add(&rows, &gh.detach(), 0)?;
        }
    }
    drop(x);
    let mut g = g.reshape((b, t, c))?;
    probe("head")?;

    // ---- backward, last layer first
    for (l, layer) in model.layers.iter().enumerate().rev() {
        let (xv, y) = match saved.pop() {
            Some(Saved::Graph(xv, y)) => (xv, y),
            Some(Saved::Input(x)) => {
                let xv = Var::from_tensor(&x)?;
                let y = layer.forward(xv.as_tensor(), &ctx)?;
                let now = memory::tensor_bytes(xv.as_tensor()) + memory::tensor_bytes(&y);
                memory::account_cpu(dev, held + now, "backward")?;
                (xv, y)
            }
            None => candle_core::bail!("driver: no saved activations for layer {l}"),
        };
        let gs = seed(&y, g.to_dtype(y.dtype())?)?.backward()?;
        accumulate(layer, &gs, grads)?;
        g = match gs.get(xv.as_tensor()) {
            Some(dx) => dx.detach(),
            None if l == 0 => break,
            None => xv.as_tensor().zeros_like()?,
        };
    }
    probe("backward")?;
    Ok(ce_value)
}

/// A scalar whose gradient with respect to `y` is `g`: backward through a layer given
/// dL/d(output), without computing Σ y ⊙ g (two full passes over the activation).
fn seed(y: &Tensor, g: Tensor) -> Result<Tensor> {
    y.apply_op1_arc(std::sync::Arc::new(Box::new(Seed(g))))
}

struct Seed(Tensor);

impl candle_core::CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "seed-grad"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        Ok((candle_core::CpuStorage::F32(vec![0.0]), ().into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let dev = s.device.clone();
        let z = dev.alloc_zeros::<f32>(1)?;
        Ok((candle_core::CudaStorage::wrap_cuda_slice(z, dev), ().into()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.0.clone()))
    }
}

/// Adds a layer's adapter gradients (f32) into the running sums.
fn accumulate(
    layer: &Layer,
    gs: &candle_core::backprop::GradStore,
    grads: &mut Grads,
) -> Result<()> {
    for lin in layer.linears() {
        let Some(lora) = &lin.lora else { continue };
        for var in [&lora.a, &lora.b] {
            let Some(g) = gs.get(var.as_tensor()) else {
                continue;
            };
            let g = g.to_dtype(DType::F32)?.detach();
            let sum = match grads.remove(&var.id()) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            grads.insert(var.id(), sum);
        }
    }
    Ok(())
}

/// Forward only, for logits-level checks: the model's `forward` with a batch's context.
pub fn logits(model: &Model, batch: &Batch) -> Result<Tensor> {
    let ids = Tensor::from_slice(&batch.ids, (batch.b, batch.t), &model.device)?;
    let ctx: Ctx = model.ctx(
        &batch.positions,
        batch.b,
        batch.t,
        batch.segments.clone(),
        None,
    )?;
    model.forward(&ids, &ctx)
}
