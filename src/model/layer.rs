//! The decoder layer: attention and the MLP, each behind an RMSNorm and a residual, with LoRA
//! on chosen linears. `Layer::forward` builds an autograd graph (the reference; tests, eval);
//! training runs `Layer::forward_train` and its hand-written backward (model/layer_train.rs).
//!
//! Shapes: B batch, T tokens, C hidden, H heads, K kv heads, D head dim, I mlp.

use super::linear::{pad_group, Linear};
use super::llama::Ctx;
use crate::ops::{self, AttnMask};
use candle_core::{Result, Tensor};

/// One decoder layer: its two norms' gains [C], its seven linears, and its shape.
#[derive(Clone)]
pub struct Layer {
    pub input_norm: Tensor,
    pub post_norm: Tensor,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub(crate) eps: f64,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) window: usize,
}

impl Layer {
    /// x: [B, T, C] → [B, T, C]
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let (b, t, _c) = x.dims3()?;
        let (h, k, d) = (self.heads, self.kv_heads, self.head_dim);
        let hn = ops::rms_norm(x, &self.input_norm, self.eps)?;
        let q = self
            .q
            .forward(&hn, ctx)?
            .reshape((b, t, h, d))?
            .transpose(1, 2)?; // [B, H, T, D]
        let kk = self
            .k
            .forward(&hn, ctx)?
            .reshape((b, t, k, d))?
            .transpose(1, 2)?; // [B, K, T, D]
        let v = self
            .v
            .forward(&hn, ctx)?
            .reshape((b, t, k, d))?
            .transpose(1, 2)?; // [B, K, T, D]
        let q = ops::rope(&q, &ctx.cos, &ctx.sin)?;
        let kk = ops::rope(&kk, &ctx.cos, &ctx.sin)?;
        let (kk, v) = (repeat_kv(&kk, h / k)?, repeat_kv(&v.contiguous()?, h / k)?); // [B, H, T, D]
        let mask = AttnMask {
            window: self.window,
            ..ctx.mask.clone()
        };
        let o = ops::attention(&q, &kk, &v, &mask, 1.0 / (d as f64).sqrt(), ctx.attn_block)?;
        let attn = o.transpose(1, 2)?.reshape((b, t, h * d))?; // [B, T, H·D]
        let x = (x + self.o.forward(&attn, ctx)?)?;
        let hn = ops::rms_norm(&x, &self.post_norm, self.eps)?;
        let a = ops::swiglu(&self.gate.forward(&hn, ctx)?, &self.up.forward(&hn, ctx)?)?; // [B, T, I]
        let m = self.down.forward(&a, ctx)?;
        x + m
    }

    /// The layer's frozen tensors, in a fixed order (norms, then each linear's W, or its
    /// padded W* when folded, and bias): FSDP flattens them into one buffer and puts views of
    /// the gathered buffer back. After changing them, `sync_views` makes each folded W a view
    /// of its W* again.
    pub fn frozen_mut(&mut self) -> Vec<&mut Tensor> {
        let (norms, lins) = self.parts_mut();
        let mut v = Vec::from(norms);
        for lin in lins {
            match &mut lin.pad {
                Some(pad) => v.push(&mut pad.full),
                None => v.push(&mut lin.w),
            }
            v.extend(lin.b.as_mut());
        }
        v
    }

    /// For each tensor of `frozen_mut`, in its order, the linear whose W (or W*) it is; None for
    /// the norms and the biases.
    pub fn frozen_linears(&self) -> Vec<Option<&Linear>> {
        let mut v = vec![None, None];
        for lin in self.linears() {
            v.push(Some(lin));
            if lin.b.is_some() {
                v.push(None);
            }
        }
        v
    }

    /// Each folded linear's W as the first `in` columns of its W* (which `frozen_mut` may have
    /// replaced: FSDP's placeholder, or a gathered view). A placeholder W* (not [out, in + p])
    /// leaves W that placeholder too, so the skeleton holds no weights.
    pub fn sync_views(&mut self) -> Result<()> {
        for lin in self.linears_mut() {
            if let Some(pad) = &lin.pad {
                lin.w = match pad.full.rank() {
                    2 => pad.full.narrow(1, 0, pad.in_f)?,
                    _ => pad.full.clone(),
                };
            }
        }
        Ok(())
    }

    /// Pads this layer's foldable groups (`Model::fold`); their bytes.
    pub fn fold(&mut self) -> Result<usize> {
        let mut bytes = 0;
        for mut group in self.fold_groups() {
            bytes += pad_group(&mut group)?;
        }
        Ok(bytes)
    }

    fn linears_mut(&mut self) -> [&mut Linear; 7] {
        self.parts_mut().1
    }

    /// The two norms and the seven linears, each borrowed apart.
    fn parts_mut(&mut self) -> ([&mut Tensor; 2], [&mut Linear; 7]) {
        (
            [&mut self.input_norm, &mut self.post_norm],
            [
                &mut self.q,
                &mut self.k,
                &mut self.v,
                &mut self.o,
                &mut self.gate,
                &mut self.up,
                &mut self.down,
            ],
        )
    }

    /// The linears whose forward can fold (`ops::fold`), by groups that share their input:
    /// q, k, v; gate, up; down. (o_proj's input is the flash kernel's output.)
    fn fold_groups(&mut self) -> [Vec<&mut Linear>; 3] {
        [
            vec![&mut self.q, &mut self.k, &mut self.v],
            vec![&mut self.gate, &mut self.up],
            vec![&mut self.down],
        ]
    }

    pub fn linears(&self) -> [&Linear; 7] {
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
    }
}

/// [B, K, T, D] → [B, K·n, T, D], each kv head repeated n times (GQA).
pub(crate) fn repeat_kv(x: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x.clone());
    }
    let (b, k, t, d) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, k, n, t, d))?
        .reshape((b, k * n, t, d))
}
