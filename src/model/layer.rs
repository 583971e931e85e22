//! The decoder layer: attention and the MLP, each behind an RMSNorm and a residual, with LoRA
//! on chosen linears. `Layer::forward` builds an autograd graph (the reference; tests, eval);
//! training runs `Layer::forward_train` and its hand-written backward (model/layer_train.rs).
//! Every family runs this one layer; what differs is data (`LayerSpec`, `Extra`, and
//! whether q/k/v and gate/up are one projection each), resolved from the config
//! (model/family.rs):
//!
//!   h = x + N_ao(o(attn(rope(N_q(q(n)), N_k(k(n)), v(n)))),  n = N_in(x)
//!   y = h + N_mo(down(act(gate(m)) ⊙ up(m))),                   m = N_post(h)
//!
//! with N_q, N_k (QK-norm over each head), N_ao, N_mo (Gemma's output norms) the identity where
//! the family has none, the scores soft-capped (Gemma 2) and windowed per layer.
//!
//! Shapes: B batch, T tokens, C hidden, H heads, K kv heads, D head dim, I mlp.

use super::decoder::Ctx;
use super::layer_moe::Moe;
use super::linear::Linear;
use super::parts::pad_group;
use crate::ops::glu::Act;
use crate::ops::{self, AttnMask, NormSpec};
use candle_core::{Result, Tensor};
use std::borrow::Cow;
use std::sync::Arc;

/// A layer's shape and the family's settings of it.
#[derive(Clone, Copy, Debug)]
pub struct LayerSpec {
    /// Every norm of the layer: eps, and Gemma's 1 + w gain.
    pub(crate) norm: NormSpec,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    /// Keys this many positions back or more are masked (0: full attention).
    pub window: usize,
    /// The attention scores' scale.
    pub(crate) scale: f64,
    /// Scores soft-capped at this (0: none).
    pub(crate) softcap: f32,
    pub(crate) act: Act,
    /// RoPE from the context's local table (Gemma 3's sliding layers).
    pub(crate) local_rope: bool,
}

/// The norm gains only some families have.
#[derive(Clone, Default)]
pub(crate) struct Extra {
    /// QK-norm's gains [D] (Qwen3, Gemma 3).
    pub(crate) q_norm: Option<Tensor>,
    pub(crate) k_norm: Option<Tensor>,
    /// Gemma's post_attention_layernorm [C]: on o_proj's output, before the residual add.
    pub(crate) attn_out_norm: Option<Tensor>,
    /// Gemma's post_feedforward_layernorm [C]: on down_proj's output.
    pub(crate) mlp_out_norm: Option<Tensor>,
    /// gpt-oss's attention sinks [H] (`self_attn.sinks`: ops/attention/sinks.rs).
    pub(crate) sinks: Option<Tensor>,
}

impl Extra {
    /// The gains present, in a fixed order (q, k, attention output, MLP output), then the
    /// sinks.
    fn present_mut(&mut self) -> Vec<&mut Tensor> {
        [
            &mut self.q_norm,
            &mut self.k_norm,
            &mut self.attn_out_norm,
            &mut self.mlp_out_norm,
            &mut self.sinks,
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    fn present(&self) -> Vec<&Tensor> {
        [
            &self.q_norm,
            &self.k_norm,
            &self.attn_out_norm,
            &self.mlp_out_norm,
            &self.sinks,
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// Gemma's norm of an attention or MLP output (`w` its gain), before the residual add; x
/// itself where the family has none.
pub(crate) fn out_norm(x: Tensor, w: &Option<Tensor>, norm: NormSpec) -> Result<Tensor> {
    match w {
        Some(w) => ops::rms_norm(&x, w, norm),
        None => Ok(x),
    }
}

/// One decoder layer: its norms' gains, its linears, and its shape.
#[derive(Clone)]
pub struct Layer {
    /// Before the attention [C].
    pub input_norm: Tensor,
    /// Before the MLP [C] (post_attention_layernorm; Gemma's pre_feedforward_layernorm).
    pub post_norm: Tensor,
    pub(crate) extra: Extra,
    /// q_proj, k_proj, v_proj; or Phi-3's one qkv_proj [(H + 2K)·D, C].
    pub attn_in: Vec<Linear>,
    /// o_proj [C, H·D].
    pub o: Linear,
    /// gate_proj, up_proj; or Phi-3's one gate_up_proj [2I, C] (gate first); empty in a MoE
    /// layer.
    pub mlp_in: Vec<Linear>,
    /// down_proj; None in a MoE layer.
    pub down: Option<Linear>,
    /// A MoE layer's router and experts (model/layer_moe.rs), in place of the dense MLP.
    pub(crate) moe: Option<Box<Moe>>,
    pub(crate) spec: LayerSpec,
    /// An NF4 layer made resident in a `quant::Slabs` buffer holds that slab until it drops.
    pub(crate) lease: Option<Arc<()>>,
}

impl Layer {
    /// x: [B, T, C] → [B, T, C]
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let (b, t, _c) = x.dims3()?;
        let s = &self.spec;
        let (h, k, d) = (s.heads, s.kv_heads, s.head_dim);
        let hn = ops::rms_norm(x, &self.input_norm, s.norm)?;
        let outs = self
            .attn_in
            .iter()
            .map(|l| l.forward(&hn, ctx))
            .collect::<Result<Vec<_>>>()?;
        let [q, kk, v] = self.split_qkv(outs, 2)?; // [B, T, H·D], [B, T, K·D] ×2
        let heads = |x: Tensor, n: usize, norm: &Option<Tensor>| -> Result<Tensor> {
            let x = x.reshape((b, t, n, d))?;
            let x = match norm {
                Some(w) => ops::rms_norm(&x, w, s.norm)?, // over each head's D
                None => x,
            };
            x.transpose(1, 2) // [B, n, T, D]
        };
        let q = heads(q, h, &self.extra.q_norm)?;
        let kk = heads(kk, k, &self.extra.k_norm)?;
        let v = heads(v, k, &None)?;
        let (cos, sin) = ctx.rope(s.local_rope);
        let q = ops::rope(&q, cos, sin)?;
        let kk = ops::rope(&kk, cos, sin)?;
        let (kk, v) = (repeat_kv(&kk, h / k)?, repeat_kv(&v.contiguous()?, h / k)?); // [B, H, T, D]
        let o = ops::attention(&q, &kk, &v, &self.mask(ctx), s.scale, ctx.attn_block)?;
        let attn = o.transpose(1, 2)?.reshape((b, t, h * d))?; // [B, T, H·D]
        let ao = self.o.forward(&attn, ctx)?;
        let ao = out_norm(ao, &self.extra.attn_out_norm, s.norm)?;
        let x = (x + ao)?;
        let hn = ops::rms_norm(&x, &self.post_norm, s.norm)?;
        if let Some(moe) = &self.moe {
            let m = moe.forward(&hn.reshape((b * t, hn.dim(2)?))?)?; // [m, C]
            let m = m.reshape(x.shape())?;
            return x + m;
        }
        let outs = self
            .mlp_in
            .iter()
            .map(|l| l.forward(&hn, ctx))
            .collect::<Result<Vec<_>>>()?;
        let [gate, up] = self.split_gate_up(outs, 2)?;
        let a = s.act.glu(&gate, &up)?; // [B, T, I]
        let m = self.down()?.forward(&a, ctx)?;
        let m = out_norm(m, &self.extra.mlp_out_norm, s.norm)?;
        x + m
    }

    /// The attention mask of this layer for the batch: its window, soft-cap and sinks.
    pub(crate) fn mask(&self, ctx: &Ctx) -> AttnMask {
        AttnMask {
            window: self.spec.window,
            softcap: self.spec.softcap,
            sinks: self.extra.sinks.clone(),
            ..ctx.mask.clone()
        }
    }

    /// q, k, v from the attention input projections' outputs (each [.., n·D] along `dim`):
    /// as they are, or Phi-3's one output cut at `qkv_cuts` (copied contiguous).
    pub(crate) fn split_qkv(&self, outs: Vec<Tensor>, dim: usize) -> Result<[Tensor; 3]> {
        split_parts(outs, &self.qkv_cuts(), dim)
    }

    /// gate and up from the MLP input projections' outputs: as they are, or Phi-3's one
    /// output cut at `gate_up_cuts` (gate first; copied contiguous).
    pub(crate) fn split_gate_up(&self, outs: Vec<Tensor>, dim: usize) -> Result<[Tensor; 2]> {
        split_parts(outs, &self.gate_up_cuts(), dim)
    }

    /// The widths of the parts of Phi-3's fused qkv_proj output (H·D, K·D, K·D), which the
    /// folded GEMMs make apart (`Linear::fwd_folded_parts`); none for separate q, k, v.
    pub(crate) fn qkv_cuts(&self) -> Vec<usize> {
        let s = &self.spec;
        match self.attn_in.len() {
            1 => vec![
                s.heads * s.head_dim,
                s.kv_heads * s.head_dim,
                s.kv_heads * s.head_dim,
            ],
            _ => Vec::new(),
        }
    }

    /// The widths of the parts of Phi-3's fused gate_up_proj output (I, I); none for separate
    /// gate and up.
    pub(crate) fn gate_up_cuts(&self) -> Vec<usize> {
        match &self.mlp_in[..] {
            [gu] => vec![gu.out_features() / 2; 2],
            _ => Vec::new(),
        }
    }

    /// The layer's frozen tensors, in a fixed order (norms, then each linear's W, or its
    /// padded W* when folded, or its NF4 arrays (`QWeight::arrays_mut`) when quantized, and
    /// bias): FSDP flattens them into one buffer per dtype and puts views of the gathered
    /// buffers back. An NF4 linear's 1-element W placeholder is not among them (it stays, as
    /// the dtype `resident_in` dequantizes to); its `QWeight` is unshared first (a clone of
    /// handles) so that a gathered layer's views do not reach the skeleton's. After changing
    /// them, `sync_views` makes each folded W a view of its W* again.
    pub fn frozen_mut(&mut self) -> Vec<&mut Tensor> {
        let (norms, lins) = self.parts_mut();
        let mut v = norms;
        for lin in lins {
            match (&mut lin.pad, &mut lin.q) {
                (_, Some(q)) => v.extend(Arc::make_mut(q).arrays_mut()),
                (Some(pad), None) => v.push(&mut pad.full),
                (None, None) => v.push(&mut lin.w),
            }
            v.extend(lin.b.as_mut());
        }
        v
    }

    /// For each tensor of `frozen_mut`, in its order, the linear whose W (or W*) it is; None for
    /// the norms, the biases and NF4 arrays.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn frozen_linears(&self) -> Vec<Option<&Linear>> {
        let moe = self.moe.as_ref().map_or(0, |m| m.frozen().len());
        let mut v = vec![None; 2 + self.extra.present().len() + moe];
        for lin in self.linears() {
            match &lin.q {
                Some(q) => v.extend(q.arrays().iter().map(|_| None)),
                None => v.push(Some(lin)),
            }
            if lin.b.is_some() {
                v.push(None);
            }
        }
        v
    }

    /// Every norm gain of the layer (input, post, then the family's).
    pub(crate) fn norms(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.input_norm, &self.post_norm];
        v.extend(self.extra.present());
        v
    }

    /// The frozen tensors besides the linears: the norms' gains, then a MoE layer's router and
    /// experts (`Layer::frozen_mut` order).
    pub(crate) fn frozen_plain(&self) -> Vec<&Tensor> {
        let mut v = self.norms();
        v.extend(self.moe.iter().flat_map(|m| m.frozen()));
        v
    }

    /// Each folded linear's W as the first `in` columns of its W* (which `frozen_mut` may have
    /// replaced: FSDP's placeholder, or a gathered view). A placeholder W* (not [out, in + p])
    /// leaves W that placeholder too, so the skeleton holds no weights.
    pub(crate) fn sync_views(&mut self) -> Result<()> {
        for lin in self.parts_mut().1 {
            if let Some(pad) = &lin.pad {
                lin.w = match pad.full.rank() {
                    2 => pad.full.narrow(1, 0, pad.in_f)?,
                    _ => pad.full.clone(),
                };
            }
        }
        Ok(())
    }

    /// Quantizes each linear's W, and a MoE layer's experts (`Moe::quantize`), to NF4
    /// (`[model] quantize = "nf4"`; one read in NF4 stays as it is), leaving a 1-element placeholder of its dtype in `w`, so the full copy is freed
    /// as the layer loads (`nf4_bytes` counts what it keeps). Folded linears are refused
    /// (`ops::fold` is off under NF4).
    pub(crate) fn quantize(&mut self, double_quant: bool) -> Result<()> {
        if let Some(moe) = self.moe.as_deref_mut() {
            moe.quantize(double_quant)?;
        }
        for lin in self.parts_mut().1 {
            if lin.q.is_some() {
                continue; // read in NF4 (a bitsandbytes 4-bit checkpoint)
            }
            if lin.pad.is_some() {
                candle_core::bail!("nf4: {} is folded (ops::fold is off under NF4)", lin.name);
            }
            let q = crate::quant::QWeight::quantize(&lin.w, double_quant)?;
            lin.w = Tensor::zeros(1, lin.w.dtype(), lin.w.device())?;
            lin.q = Some(Arc::new(q));
        }
        Ok(())
    }

    /// The layer with each NF4 linear's W dequantized (to its placeholder's dtype), for one
    /// use: borrowed as it is where nothing is quantized. The dequantized weights are freed
    /// with the returned layer.
    pub fn resident(&self) -> Result<Cow<'_, Layer>> {
        self.resident_in(None)
    }

    /// `resident`, on CUDA into a free buffer of `slabs` (each W a view of it, at offsets of 64
    /// elements), which the returned layer holds until it and its clones drop. The returned
    /// layer keeps no NF4 arrays (`q` None: its W's are real), so it is resident as it is and
    /// frees an FSDP gather's NF4 buffers when that layer drops.
    pub(crate) fn resident_in(
        &self,
        slabs: Option<&crate::quant::Slabs>,
    ) -> Result<Cow<'_, Layer>> {
        let Some(first) = self.linears().into_iter().find(|l| l.q.is_some()) else {
            return Ok(Cow::Borrowed(self));
        };
        let (dtype, device) = (first.w.dtype(), first.w.device().clone());
        let mut layer = self.clone();
        let span = |q: &crate::quant::QWeight| q.numel().next_multiple_of(64);
        let total: usize = self
            .linears()
            .iter()
            .filter_map(|l| l.q.as_deref())
            .map(span)
            .sum();
        let slab = match slabs {
            Some(s) => s.take(total, dtype, &device)?,
            None => None,
        };
        let mut off = 0;
        for lin in layer.parts_mut().1 {
            let Some(q) = lin.q.take() else { continue };
            lin.w = match &slab {
                Some((buf, _)) => {
                    let w = buf.narrow(0, off, q.numel())?.reshape(q.shape.as_slice())?;
                    q.dequantize_into(&w)?;
                    w
                }
                None => q.dequantize(dtype)?,
            };
            off += span(&q);
        }
        layer.lease = slab.map(|(_, lease)| lease);
        Ok(Cow::Owned(layer))
    }

    /// Bytes of the layer's NF4 weights (its linears', and a MoE layer's experts').
    pub fn nf4_bytes(&self) -> usize {
        let lins: usize = self
            .linears()
            .iter()
            .filter_map(|l| l.q.as_ref())
            .map(|q| q.bytes())
            .sum();
        lins + self.moe.as_ref().map_or(0, |m| m.nf4_bytes())
    }

    /// Pads this layer's foldable groups (`Model::fold`); their bytes.
    pub(crate) fn fold(&mut self) -> Result<usize> {
        let mut bytes = 0;
        for mut group in self.fold_groups() {
            bytes += pad_group(&mut group)?;
        }
        Ok(bytes)
    }

    /// The norms and the linears (`linears` order), each borrowed apart.
    fn parts_mut(&mut self) -> (Vec<&mut Tensor>, Vec<&mut Linear>) {
        let mut norms = vec![&mut self.input_norm, &mut self.post_norm];
        norms.extend(self.extra.present_mut());
        let mut lins: Vec<&mut Linear> = self.attn_in.iter_mut().collect();
        lins.push(&mut self.o);
        lins.extend(self.mlp_in.iter_mut());
        lins.extend(self.down.as_mut());
        if let Some(moe) = self.moe.as_deref_mut() {
            norms.extend(moe.frozen_mut());
        }
        (norms, lins)
    }

    /// The linears whose forward can fold (`ops::fold`), by groups that share their input:
    /// q, k, v (or qkv); gate, up (or gate_up); down (the fold's kernels compute its input,
    /// SwiGLU or GeGLU). (o_proj's input is the flash kernel's output.)
    fn fold_groups(&mut self) -> Vec<Vec<&mut Linear>> {
        let mut g = vec![
            self.attn_in.iter_mut().collect(),
            self.mlp_in.iter_mut().collect(),
        ];
        if let Some(down) = self.down.as_mut() {
            g.push(vec![down]);
        }
        g
    }

    /// Every linear: the attention's input projections, o, the MLP's input projections, down.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut v: Vec<&Linear> = self.attn_in.iter().collect();
        v.push(&self.o);
        v.extend(self.mlp_in.iter());
        v.extend(self.down.as_ref());
        v
    }

    /// Every linear, mutably, in `linears` order (`Inject` fills their slots so).
    pub(crate) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v: Vec<&mut Linear> = self.attn_in.iter_mut().collect();
        v.push(&mut self.o);
        v.extend(self.mlp_in.iter_mut());
        v.extend(self.down.as_mut());
        v
    }

    /// The layer's adapters with their module names: the linears' (`linears` order), then a
    /// MoE layer's experts' (PEFT's module paths).
    pub fn adapters(&self) -> Vec<(&str, &super::adapter::Lora)> {
        let mut v: Vec<(&str, &super::adapter::Lora)> = self
            .linears()
            .into_iter()
            .filter_map(|lin| lin.lora.as_ref().map(|a| (lin.name.as_str(), a)))
            .collect();
        v.extend(self.moe.iter().flat_map(|m| m.adapters()));
        v
    }

    /// down_proj (a dense MLP's; a MoE layer has none).
    pub(crate) fn down(&self) -> Result<&Linear> {
        match &self.down {
            Some(d) => Ok(d),
            None => candle_core::bail!("a MoE layer has no dense down_proj"),
        }
    }
}

/// Projections' outputs as their N parts: N outputs as they are, or one fused output cut
/// along `dim` at `cuts` (N widths), each part copied contiguous.
fn split_parts<const N: usize>(
    outs: Vec<Tensor>,
    cuts: &[usize],
    dim: usize,
) -> Result<[Tensor; N]> {
    let outs = match <[Tensor; N]>::try_from(outs) {
        Ok(parts) => return Ok(parts),
        Err(outs) => outs,
    };
    let [fused] = super::layer_train::array(outs)?;
    let parts = super::parts::cut(&fused, dim, cuts)?;
    super::layer_train::array(
        parts
            .iter()
            .map(Tensor::contiguous)
            .collect::<Result<_>>()?,
    )
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
