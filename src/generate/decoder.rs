//! The forward of generation: tokens at the next positions through every layer against the KV
//! cache, logits of the last one only.
//!
//! Shapes: T tokens of this call (the prompt, a chunk of it, or 1), p0 the first one's position,
//! L the keys it sees (p0 + T, less what a sliding window hides), H heads, K kv heads
//! (n = H / K queries each: GQA without repeating the cache), D head dim, C hidden, V vocab.
//!
//! Per layer (model/layer.rs's equations, the family's `LayerSpec`): RMSNorm (with the residual
//! add before it fused on CUDA; Gemma's 1 + w gain) → q, k, v → QK-norm (Qwen3, Gemma 3) → RoPE
//! at the absolute positions (the layer's table: Gemma 3's sliding layers have their own base;
//! Phi-3's LongRoPE switches table on the call's reach) → the token's keys and values written
//! into the cache → attention over cache[.., start..p0 + T] (the layer's window, scale and
//! soft-cap) → o (→ Gemma's output norm) → add + RMSNorm → the MLP (the family's GLU, or
//! Qwen3-MoE's routed experts) (→ Gemma's output norm); the residual add of the MLP's output
//! is the next layer's fused add. Gemma scales the embeddings by √C and Gemma 2 soft-caps the
//! logits, as training does. Attention is transformers' eager attention:
//! scores in the activation dtype, scaled, masked (causal and window), softmax in f32 (gpt-oss's
//! sink logit per head one more column of it, dropped after), then the
//! values. For one token on CUDA (bf16 or f32) the RoPE, the cache write and the attention are one
//! kernel of ours (`cuda`): per token only the sampled id comes back to the host.

use super::cache::KvCache;
use super::weights::{self, Matvec, Weights};
use crate::model::layer::out_norm;
use crate::ops::{self, NormSpec};
use anyhow::{bail, Result};
use candle_core::{DType, Tensor, D};

/// Score entries a prefill chunk may hold (H × T × L f32): 2^25 is 128 MiB.
const CHUNK_SCORES: usize = 1 << 25;

/// The weights and the cache of one generation (or one chat).
pub struct Decoder {
    pub(crate) w: Weights,
    pub(crate) cache: KvCache,
    /// The decode kernels, when the device and dtype take them.
    #[cfg(feature = "cuda")]
    kernels: Option<super::cuda::Kernels>,
    /// One-token steps' device inputs (with the kernels), and their graph.
    #[cfg(feature = "cuda")]
    step: Option<super::graph::Inputs>,
    #[cfg(feature = "cuda")]
    graph: super::graph::Graph,
}

impl Decoder {
    /// A decoder over `w` with a cache for `cap` positions (bounded by the model's
    /// max_position_embeddings; it grows on demand up to there).
    pub fn new(w: Weights, cap: usize) -> Result<Decoder> {
        let c = &w.cfg;
        let limit = c.max_position_embeddings.max(1);
        let cache = KvCache::new(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            cap.clamp(1, limit),
            limit,
            (&w.rope, w.rope_local.as_ref()),
            w.dtype,
            &w.device,
        )?;
        // decode.cu's attention has no sinks: gpt-oss decodes with candle's ops
        #[cfg(feature = "cuda")]
        let kernels = match w.layers.iter().any(|l| l.sinks.is_some()) {
            true => None,
            false => super::cuda::Kernels::for_model(&w)?,
        };
        #[cfg(feature = "cuda")]
        let step = match &kernels {
            Some(_) => Some(super::graph::Inputs::new(&w.device, c.vocab_size)?),
            None => None,
        };
        #[cfg(feature = "cuda")]
        let mut graph = super::graph::Graph::new(&w.device, w.dtype, w.adapter_bytes() > 0);
        // A MoE's routing reads the chosen experts back to the host: no graph holds a step.
        #[cfg(feature = "cuda")]
        if w.layers
            .iter()
            .any(|l| matches!(l.mlp, weights::Mlp::Moe(_)))
        {
            graph.on = false;
        }
        Ok(Decoder {
            w,
            cache,
            #[cfg(feature = "cuda")]
            kernels,
            #[cfg(feature = "cuda")]
            step,
            #[cfg(feature = "cuda")]
            graph,
        })
    }

    /// The same decoder running candle's ops for every step (the kernels' reference).
    pub fn without_kernels(self) -> Decoder {
        Decoder {
            #[cfg(feature = "cuda")]
            kernels: None,
            #[cfg(feature = "cuda")]
            step: None,
            #[cfg(feature = "cuda")]
            graph: Default::default(),
            ..self
        }
    }

    /// The same decoder with one-token steps run eagerly, never as a captured graph.
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    pub fn without_graph(mut self) -> Decoder {
        #[cfg(feature = "cuda")]
        {
            self.graph.on = false;
        }
        self
    }

    /// Whether one-token steps replay a captured CUDA graph.
    pub fn graph_captured(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.graph.captured()
        }
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Whether one-token steps run our CUDA kernels (else candle's ops).
    pub(crate) fn fused_kernels(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.kernels.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// The one-token product of our kernels, when they run.
    fn mv(&self) -> Option<&dyn Matvec> {
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.kernels {
            return Some(k as &dyn Matvec);
        }
        None
    }

    /// Runs `ids` (≥ 1) at the next positions, keeps their keys and values, and returns the
    /// logits of the last one: [V] f32 on the device.
    pub fn extend(&mut self, ids: &[u32]) -> Result<Tensor> {
        if ids.is_empty() {
            bail!("nothing to run: no tokens");
        }
        let vocab = self.w.cfg.vocab_size as u32;
        if let Some(&bad) = ids.iter().find(|&&i| i >= vocab) {
            bail!("token id {bad} is outside the vocabulary of {vocab}");
        }
        let reach = self.cache.len() + ids.len();
        self.cache.reserve(reach)?;
        let (h, l) = (self.w.cfg.num_heads, reach);
        let chunk = (CHUNK_SCORES / (h * l).max(1)).clamp(1, 512);
        let mut last = None;
        for part in ids.chunks(chunk) {
            #[cfg(feature = "cuda")]
            if let (1, true) = (part.len(), self.step.is_some()) {
                last = Some(self.step_one(part[0])?);
                continue;
            }
            let idt = Tensor::from_slice(part, part.len(), &self.w.device)?;
            let logits = self.run(&idt, part.len(), reach)?;
            self.cache.ids.extend_from_slice(part);
            last = Some(logits);
        }
        match last {
            Some(x) => Ok(x),
            None => bail!("nothing to run: no tokens"),
        }
    }

    /// One token with our kernels: its id and position written to the step's device inputs,
    /// then the step as a graph (captured at the second step for these cache buffers) or
    /// eagerly. The logits are the step's buffer.
    #[cfg(feature = "cuda")]
    fn step_one(&mut self, tok: u32) -> Result<Tensor> {
        let p0 = self.cache.len();
        let Some(step) = &self.step else {
            bail!("one-token step without the decode kernels");
        };
        step.set(tok, p0 as u32)?;
        let key = (
            self.cache.capacity(),
            super::cuda::addr(&self.cache.kv[0].0)?,
        );
        if !self.graph.replay(key)? {
            let mut graph = std::mem::take(&mut self.graph);
            let captured = match graph.on && graph.eager > 0 {
                true => {
                    let dev = self.w.device.clone();
                    graph.capture(key, &dev, || self.run_into(step))?
                }
                false => false,
            };
            if !captured {
                self.run_into(step)?;
                graph.eager += 1;
            }
            self.graph = graph;
        }
        self.cache.ids.push(tok);
        match &self.step {
            // a copy: the buffer is the next step's too
            Some(s) => Ok(s.logits.copy()?),
            None => bail!("one-token step without its buffers"),
        }
    }

    /// `run` for the one token in `step.tok`, its logits copied into `step.logits` (every
    /// tensor it makes is dropped before it returns: it may be captured).
    #[cfg(feature = "cuda")]
    fn run_into(&self, step: &super::graph::Inputs) -> Result<()> {
        let l = self.run(&step.tok, 1, self.cache.len() + 1)?;
        step.logits.slice_set(&l, 0, 0)?;
        Ok(())
    }

    /// The cache's tokens, then `ids`: the cached positions that agree with `ids` are kept and
    /// only the rest is run (a chat's earlier turns are not recomputed). Logits of the last.
    pub(crate) fn prime(&mut self, ids: &[u32]) -> Result<Tensor> {
        let same = self
            .cache
            .ids
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count();
        // The last token is run again when all are cached: its logits are wanted.
        let keep = same.min(ids.len().saturating_sub(1));
        self.cache.truncate(keep);
        self.extend(&ids[keep..])
    }

    /// One chunk of T tokens `ids` (u32 [T] on the device) at positions p0 = cache.len()..
    /// (room reserved; the caller records the ids) of a call that reaches `reach` (its last
    /// position + 1: LongRoPE picks its table by it) → logits [V] f32 of its last.
    fn run(&self, ids: &Tensor, t: usize, reach: usize) -> Result<Tensor> {
        let p0 = self.cache.len();
        let c = &self.w.cfg;
        let mut h = self.w.embed.index_select(ids, 0)?; // [T, C]
        if let Some(f) = c.embed_scale() {
            h = h.affine(f, 0.0)?;
        }
        let mut pending: Option<Tensor> = None; // the MLP's output, added at the next norm
        for (li, lw) in self.w.layers.iter().enumerate() {
            let norm = lw.spec.norm;
            let (hh, hn) = match pending.take() {
                Some(d) => ops::add_rms_norm(&h, &d, &lw.input_norm, norm)?,
                None => {
                    let y = ops::rms_norm(&h, &lw.input_norm, norm)?;
                    (h, y)
                }
            };
            let [q, k, v] = lw.qkv(&hn, self.mv())?;
            let (q, k) = (qk_norm(q, &lw.q_norm, norm)?, qk_norm(k, &lw.k_norm, norm)?);
            let o = self.attend(li, &q, &k, &v, (p0, t, reach))?; // [T, H·D]
            let a = out_norm(lw.o.forward(&o, self.mv())?, &lw.attn_out_norm, norm)?;
            let (hh, hn) = ops::add_rms_norm(&hh, &a, &lw.post_norm, norm)?;
            let m = out_norm(lw.mlp(&hn, self.mv())?, &lw.mlp_out_norm, norm)?;
            h = hh;
            pending = Some(m);
        }
        // Final norm and head on the last position only; Gemma 2's logits soft-capped.
        let last = h.narrow(0, t - 1, 1)?;
        let hn = match pending {
            Some(m) => {
                ops::add_rms_norm(&last, &m.narrow(0, t - 1, 1)?, &self.w.norm, c.norm_spec())?.1
            }
            None => ops::rms_norm(&last, &self.w.norm, c.norm_spec())?,
        };
        let logits = weights::linear(&hn, &self.w.lm_head, None, None, self.mv())?; // [1, V]
        let logits = logits.to_dtype(DType::F32)?.squeeze(0)?;
        Ok(match c.arch.final_softcap {
            Some(cap) => ops::softcap::softcap(&logits, cap)?,
            None => logits,
        })
    }

    /// Attention of layer `li` for T new tokens at p0.. of a call reaching `reach`: q
    /// [T, H·D], k, v [T, K·D] (before RoPE) → [T, H·D]; writes the new keys and values into
    /// the cache. The layer's own window, score scale and soft-cap, and RoPE tables.
    fn attend(
        &self,
        li: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        (p0, t, reach): (usize, usize, usize),
    ) -> Result<Tensor> {
        let spec = &self.w.layers[li].spec;
        let (nh, nk, d) = (spec.heads, spec.kv_heads, spec.head_dim);
        let window = spec.window;
        let (kc, vc) = &self.cache.kv[li];
        let tables = self.cache.tables(spec.local_rope);
        let end = p0 + t;
        // Keys before the first query's window are seen by no query of this call.
        let start = match window {
            0 => 0,
            w => (p0 + 1).saturating_sub(w),
        };
        #[cfg(feature = "cuda")]
        if let (Some(kn), Some(step), 1) = (&self.kernels, &self.step, t) {
            // the position from the step's device input (a graph replays at every position)
            let scores = (window, spec.scale as f32, spec.softcap);
            let at = (&step.pos, tables.one_token());
            return kn.attention(q, k, v, at, (kc, vc), scores);
        }
        let (cos, sin) = tables.rows(p0, t, reach)?;
        let heads = |x: &Tensor, n: usize| x.reshape((1, t, n, d))?.transpose(1, 2); // [1, n, T, D]
        let q = ops::rope(&heads(q, nh)?, &cos, &sin)?;
        let k = ops::rope(&heads(k, nk)?, &cos, &sin)?;
        let v = heads(v, nk)?.contiguous()?;
        kc.slice_set(&k, 2, p0)?;
        vc.slice_set(&v, 2, p0)?;
        let len = end - start;
        let keys = kc.narrow(2, start, len)?.squeeze(0)?; // [K, L, D], rows cap apart
        let vals = vc.narrow(2, start, len)?.squeeze(0)?;
        let n = nh / nk;
        let q = q.reshape((nk, n * t, d))?; // head j·n + i → (kv head j, query i)
        let s = q.matmul(&keys.t()?)?; // [K, n·T, L]
        let s = (s * spec.scale)?.to_dtype(DType::F32)?;
        let s = match spec.softcap {
            0.0 => s,
            cap => ops::softcap::softcap(&s, cap as f64)?,
        };
        let s = match mask(p0, t, start, end, window) {
            Some(m) => {
                let m = Tensor::from_vec(m, (t, len), &self.w.device)?;
                s.reshape((nk, n, t, len))?
                    .broadcast_add(&m)?
                    .reshape((nk, n * t, len))?
            }
            None => s,
        };
        let p = match &self.w.layers[li].sinks {
            // gpt-oss: each head's sink logit joins its rows' softmax as one more column,
            // dropped after (a key whose value is zero)
            Some(sinks) => {
                let col = sinks
                    .to_dtype(DType::F32)?
                    .reshape((nk, n, 1, 1))?
                    .broadcast_as((nk, n, t, 1))?
                    .reshape((nk, n * t, 1))?;
                let p = candle_nn::ops::softmax_last_dim(&Tensor::cat(&[&s, &col], 2)?)?;
                p.narrow(2, 0, len)?.contiguous()?
            }
            None => candle_nn::ops::softmax_last_dim(&s)?,
        };
        let p = p.to_dtype(self.w.dtype)?;
        let o = p.matmul(&vals)?; // [K, n·T, D]
        Ok(o.reshape((nh, t, d))?
            .transpose(0, 1)?
            .reshape((t, nh * d))?)
    }
}

/// QK-norm (Qwen3, Gemma 3): x [T, n·D] → RMSNorm over each head's D with gain w [D]; x
/// itself without a gain.
fn qk_norm(x: Tensor, w: &Option<Tensor>, norm: NormSpec) -> Result<Tensor> {
    let Some(w) = w else { return Ok(x) };
    let (t, nd) = x.dims2()?;
    let d = w.dim(0)?;
    let y = ops::rms_norm(&x.reshape((t, nd / d, d))?, w, norm)?;
    Ok(y.reshape((t, nd))?)
}

/// The additive mask [T × L] (0 seen, −∞ hidden) of queries p0.. against keys start..end:
/// key j is seen by query i when j ≤ i and (no window or i − j < window). None when every key
/// is seen (one token whose window `start` already applied).
fn mask(p0: usize, t: usize, start: usize, end: usize, window: usize) -> Option<Vec<f32>> {
    let seen = |i: usize, j: usize| j <= i && (window == 0 || i - j < window);
    let all = (0..t).all(|qi| (start..end).all(|j| seen(p0 + qi, j)));
    if all {
        return None;
    }
    let mut m = Vec::with_capacity(t * (end - start));
    for qi in 0..t {
        for j in start..end {
            m.push(if seen(p0 + qi, j) {
                0.0
            } else {
                f32::NEG_INFINITY
            });
        }
    }
    Some(m)
}

/// The greedy pick: the index of the largest logit (the first on ties), read back.
pub fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?)
}

#[cfg(test)]
mod tests {
    use super::mask;

    #[test]
    fn masks_are_causal_and_windowed() {
        assert_eq!(mask(4, 1, 0, 5, 0), None);
        // two queries at 4, 5 over keys 0..6: query 4 does not see key 5
        let m = mask(4, 2, 0, 6, 0).unwrap();
        assert_eq!(m[5], f32::NEG_INFINITY);
        assert!(m[..5].iter().chain(&m[6..]).all(|&x| x == 0.0));
        // window 2 from position 3 on, keys 2..5: query 3 sees 2, 3; query 4 sees 3, 4
        let m = mask(3, 2, 2, 5, 2).unwrap();
        let ninf = f32::NEG_INFINITY;
        assert_eq!(m, vec![0.0, 0.0, ninf, ninf, 0.0, 0.0]);
    }
}
