//! The decoder, trainable: frozen base through `ops`, LoRA on chosen linears. One model for
//! every family (model/family.rs): the embedding (× √C on Gemma), the layers (model/layer.rs),
//! the final norm and the head (logits soft-capped on Gemma 2).
//!
//! Shapes: B batch, T tokens, C hidden, H heads, K kv heads, D head dim, V vocab, I mlp.

use super::adapter::{Inject, Lora};
use super::build::{Get, GetNf4};
use super::config::ModelConfig;
use super::layer::Layer;
use super::rope::Freqs;
use crate::hub::ModelFiles;
use crate::ops::{self, AttnMask, Kernels};
use crate::quant::QWeight;
use anyhow::{bail, Context};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Result, Tensor, TensorId, D};
use std::collections::HashMap;

/// Per-batch inputs every layer needs besides the hidden states.
pub struct Ctx {
    /// RoPE's cos at each token's position: [B, T, D/2] f32.
    pub cos: Tensor,
    /// RoPE's sin at each token's position: [B, T, D/2] f32.
    pub sin: Tensor,
    /// The sliding layers' own cos and sin (Gemma 3's local RoPE base), when they differ.
    pub(crate) local: Option<(Tensor, Tensor)>,
    /// Which keys each query sees (causal; packed segments, sliding window, soft-cap).
    pub mask: AttnMask,
    /// Queries per attention block (None: sized to the batch).
    pub(crate) attn_block: Option<usize>,
    /// Dropout stream key (seed, [step, micro-batch]); None = eval (no dropout).
    pub dropout: Option<(u64, [u64; 2])>,
    /// Each adapter's A and B in the activation dtype, by Var id, cast once for the batch
    /// (one launch for all on CUDA with bf16 activations); elsewhere each as stored, detached
    /// (the hand-written forward and backward cast at each use, and record no graph).
    pub(crate) adapters: HashMap<TensorId, Tensor>,
    /// The one buffer `adapters` are views of (each layer's A's side by side, then its B's).
    pub(crate) adapter_buf: Option<Tensor>,
    /// Whether the padded weights' B columns hold this batch's B's (`ops::fold`).
    pub folded: bool,
    /// The model's kernel choices (`Model::kernels`), which every op of the batch takes.
    pub kernels: Kernels,
    /// `Model::mlp_chunk`.
    pub(crate) mlp_chunk: Option<usize>,
    /// The routers' load-balancing loss of this micro-batch (model/moe_aux.rs): None when off
    /// (`Model::router_aux_coef` 0, or no MoE layer), and outside training.
    pub(crate) moe_aux: Option<super::moe_aux::MoeAux>,
    /// Each MoE layer's routing from its forward to its backward (model/router.rs): None
    /// outside training (no backward takes it).
    pub(crate) moe_routes: Option<super::router::RouteStore>,
}

impl Ctx {
    /// The cos and sin tables of a layer: the local ones when `local` and the model has them.
    pub(crate) fn rope(&self, local: bool) -> (&Tensor, &Tensor) {
        match (&self.local, local) {
            (Some((c, s)), true) => (c, s),
            _ => (&self.cos, &self.sin),
        }
    }

    /// `v` (an adapter's A or B) in the activation dtype when `adapters` has it, else as is.
    pub(crate) fn adapter<'a>(&'a self, v: &'a candle_core::Var) -> &'a Tensor {
        self.adapters.get(&v.id()).unwrap_or(v.as_tensor())
    }

    /// The A's [r_i, in] of `vs` stacked [Σ r_i, in] in `dt`: a view when their copies lie one
    /// after the other in `adapter_buf` (the layout `adapters_cast` makes), else a new tensor.
    pub(crate) fn a_stack(&self, vs: &[&candle_core::Var], dt: DType) -> Result<Tensor> {
        let copies: Option<Vec<&Tensor>> = vs.iter().map(|v| self.adapters.get(&v.id())).collect();
        if let (Some(buf), Some(copies)) = (&self.adapter_buf, &copies) {
            let start = |t: &Tensor| t.storage_and_layout().1.start_offset();
            let adjacent = copies.windows(2).all(|w| {
                w[1].dim(1).ok() == w[0].dim(1).ok()
                    && start(w[1]) == start(w[0]) + w[0].elem_count()
            });
            if let (true, Some(first)) = (adjacent, copies.first()) {
                let rows: usize = copies.iter().map(|t| t.dim(0).unwrap_or(0)).sum();
                let n: usize = copies.iter().map(|t| t.elem_count()).sum();
                return buf
                    .narrow(0, start(first), n)?
                    .reshape((rows, first.dim(1)?));
            }
        }
        let parts: Vec<Tensor> = vs
            .iter()
            .map(|v| self.adapter(v).to_dtype(dt))
            .collect::<Result<_>>()?;
        Tensor::cat(&parts, 0)
    }
}

/// `Ctx::adapters` and `Ctx::adapter_buf`.
type AdapterCopies = (HashMap<TensorId, Tensor>, Option<Tensor>);

/// A group of frozen tensors as it is loaded: a decoder layer, or the embedding, final norm and
/// untied head (`Model::io_mut` order).
pub enum Group<'a> {
    /// A decoder layer's frozen tensors.
    Layer(&'a mut Layer),
    /// The embedding, the final norm and the untied head.
    Io(Vec<&'a mut Tensor>),
}

impl<'a> Group<'a> {
    /// The group's frozen tensors (a layer's in `Layer::frozen_mut` order).
    pub fn tensors(self) -> Vec<&'a mut Tensor> {
        match self {
            Group::Layer(layer) => layer.frozen_mut(),
            Group::Io(t) => t,
        }
    }
}

/// Called with each group of frozen tensors as it is loaded (see `Model::load_with`).
pub type Loaded<'a> = &'a mut dyn FnMut(Group<'_>) -> anyhow::Result<()>;

/// The trainable decoder: the frozen base, adapters on its target linears, and the run's
/// kernel choices.
pub struct Model {
    /// The config it was built from.
    pub cfg: ModelConfig,
    /// The token embedding [V, C].
    pub(crate) embed: Tensor,
    /// The decoder layers, bottom first.
    pub layers: Vec<Layer>,
    /// The buffers NF4 layers are dequantized into on CUDA (quant::slabs).
    pub(crate) slabs: std::sync::Arc<crate::quant::Slabs>,
    /// The final norm's gain [C].
    pub(crate) norm: Tensor,
    /// The output head [V, C]; the embedding itself when tied.
    pub lm_head: Tensor,
    /// The head is the embedding (`tie_word_embeddings`).
    pub tied: bool,
    /// The frozen base's dtype (the adapters are f32).
    pub dtype: DType,
    /// Where the weights live.
    pub device: Device,
    /// Every kernel choice of the run (`Kernels::resolve`); each batch's `Ctx` carries a copy.
    pub kernels: Kernels,
    /// Tokens per MLP chunk (`train.mlp_chunk`; model/layer_mlp.rs): the forward of
    /// checkpointed layers, the backward of every layer; None: never chunked.
    pub mlp_chunk: Option<usize>,
    /// `train.router_aux_loss_coef`: the weight of a MoE's load-balancing loss (0: off).
    pub(crate) router_aux_coef: f64,
    /// The global RoPE's frequencies, and the sliding layers' where they differ (Gemma 3).
    rope: Freqs,
    rope_local: Option<Freqs>,
}

/// What a model's build takes besides its weights, for a checkpoint and random weights alike
/// (one params struct, as flash-attention's kernels take theirs).
#[derive(Debug, Clone)]
pub struct Build {
    /// The base's config.json, parsed.
    pub(crate) cfg: ModelConfig,
    /// The base's dtype on the device.
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    /// Who fills each layer's adapter slots (lora::LoraSpec: A random from `seed`, B zero).
    pub(crate) adapters: std::sync::Arc<dyn Inject>,
    /// The adapters' init stream.
    pub(crate) seed: u64,
    /// Every kernel choice of the run (`Kernels::resolve` for this device, dtype and head dim).
    pub kernels: Kernels,
    /// Tokens per MLP chunk (`Model::mlp_chunk`).
    pub(crate) mlp_chunk: Option<usize>,
    /// The weight of a MoE's load-balancing loss (`Model::router_aux_coef`).
    pub(crate) router_aux_coef: f64,
}

impl Build {
    /// A build on the device's own kernels (`Kernels::resolve`, not deterministic), MLP chunks
    /// of `layer_mlp::MLP_CHUNK`, no load-balancing loss.
    pub fn new(
        cfg: ModelConfig,
        dtype: DType,
        device: &Device,
        adapters: &dyn Inject,
        seed: u64,
    ) -> anyhow::Result<Build> {
        let kernels = Kernels::resolve(device, dtype, cfg.attn_shape(), false)?;
        Ok(Build {
            cfg,
            dtype,
            device: device.clone(),
            adapters: adapters.shared(),
            seed,
            kernels,
            mlp_chunk: Some(super::layer_mlp::MLP_CHUNK),
            router_aux_coef: 0.0,
        })
    }
}

impl Model {
    /// Memory-maps the checkpoint, casts the base to `dtype` on `device`, and injects fresh
    /// LoRA adapters (A random from `seed`, B zero) on the `spec.targets` modules; the
    /// kernels are the device's (`Build::new`).
    pub fn load(
        files: &ModelFiles,
        dtype: DType,
        device: &Device,
        adapters: &dyn Inject,
        seed: u64,
    ) -> anyhow::Result<Model> {
        let cfg = ModelConfig::from_file(&files.config)?;
        let b = Build::new(cfg, dtype, device, adapters, seed)?;
        Self::load_with(files, &b, &mut |_| Ok(()))
    }

    /// The checkpoint's model as `b` says, handing each group of frozen tensors to `loaded` as
    /// soon as it is on the device: each decoder layer's (`Layer::frozen_mut` order), then the
    /// embedding, final norm and untied head (`Model::io_mut` order). FSDP keeps a shard and
    /// replaces them with placeholders there, so only one full layer is ever resident. Where
    /// `b.kernels.fold`, each layer is padded (`Model::fold`) before `loaded` sees it, so
    /// FSDP's shards hold the padded weights.
    pub fn load_with(files: &ModelFiles, b: &Build, loaded: Loaded) -> anyhow::Result<Model> {
        let (cfg, dtype, device) = (&b.cfg, b.dtype, &b.device);
        super::check::weights(cfg, &files.config, &files.weights)?;
        // SAFETY: the files are memory-mapped read-only; like every safetensors reader we
        // assume they are not modified while training runs.
        let st = unsafe { MmapedSafetensors::multi(&files.weights) }
            .with_context(|| format!("cannot read safetensors in {}", files.dir.display()))?;
        let names: std::collections::HashSet<String> =
            st.tensors().into_iter().map(|(n, _)| n).collect();
        let prefetch = super::prefetch::Prefetch::new(&st);
        let finite = super::check::Finite::default();
        let get = |name: &str, shape: &[usize]| -> anyhow::Result<Tensor> {
            if !names.contains(name) && names.contains(&format!("{name}_blocks")) {
                prefetch.loading(name);
                let t = crate::quant::mxfp4::read(&st, name, shape, (dtype, device))
                    .with_context(|| format!("in the MXFP4 checkpoint {}", files.dir.display()))?;
                if let Some(t) = t {
                    return finite.watch(name, t);
                }
            }
            if !names.contains(name) {
                bail!(
                    "tensor `{name}` is missing from the weights in {}",
                    files.dir.display()
                );
            }
            let stored = st.get(name)?.shape().to_vec();
            if stored != shape {
                bail!(
                    "tensor `{name}` in {} has shape {:?}, config.json implies {:?}",
                    files.dir.display(),
                    stored,
                    shape
                );
            }
            prefetch.loading(name);
            // From the mapping to the device in one copy, cast there.
            finite.watch(name, st.load(name, device)?.to_dtype(dtype)?)
        };
        // A bitsandbytes 4-bit checkpoint's linears, read as NF4 (quant::bnb).
        let packed = cfg.bnb_nf4.is_some();
        let nf4 = |name: &str, shape: &[usize]| -> anyhow::Result<Option<QWeight>> {
            if !packed {
                return Ok(None);
            }
            prefetch.loading(name);
            let q = crate::quant::bnb::read(&st, name, shape)
                .with_context(|| format!("in the 4-bit checkpoint {}", files.dir.display()))?;
            Ok(q.map(|q| QWeight::from_nf4(&q, device)).transpose()?)
        };
        let has_head = names.contains("lm_head.weight");
        let tied = cfg.tie_word_embeddings.unwrap_or(!has_head);
        if !tied && !has_head {
            bail!(
                "config.json in {} says tie_word_embeddings = false but the weights have no lm_head.weight",
                files.dir.display()
            );
        }
        let m = Self::build(b, (&get, &nf4), tied, loaded)?;
        finite.verify(&files.dir, dtype)?;
        Ok(m)
    }

    /// Random weights of a given shape made on the device (benchmarks; no download): linear
    /// and embedding weights N(0, 0.02), norm gains 1 (Gemma's stored w 0, its gain being
    /// 1 + w), as transformers initialises a fresh model. The kernels are the device's.
    pub fn random(
        cfg: ModelConfig,
        dtype: DType,
        device: &Device,
        adapters: &dyn Inject,
        seed: u64,
    ) -> anyhow::Result<Model> {
        let b = Build::new(cfg, dtype, device, adapters, seed)?;
        Self::random_with(&b, &mut |_| Ok(()))
    }

    /// `random` as `b` says, with `loaded` as in `load_with`.
    pub fn random_with(b: &Build, loaded: Loaded) -> anyhow::Result<Model> {
        let (dtype, device) = (b.dtype, &b.device);
        if !device.is_cpu() {
            device.set_seed(b.seed)?;
        }
        let gemma = b.cfg.arch.norm == super::family::NormStyle::Gemma;
        let get = |name: &str, shape: &[usize]| -> anyhow::Result<Tensor> {
            let t = if name.ends_with("norm.weight") && gemma {
                Tensor::zeros(shape, DType::F32, device)?
            } else if name.ends_with("norm.weight") {
                Tensor::ones(shape, DType::F32, device)?
            } else if name.ends_with(".bias") {
                Tensor::zeros(shape, DType::F32, device)?
            } else {
                Tensor::randn(0f32, 0.02, shape, device)?
            };
            Ok(t.to_dtype(dtype)?)
        };
        let tied = b.cfg.tie_word_embeddings.unwrap_or(false);
        let nf4 = |_: &str, _: &[usize]| Ok(None);
        Self::build(b, (&get, &nf4), tied, loaded)
    }

    /// Assembles the model from a source of named base tensors (HF names and shapes), and of
    /// the linears a checkpoint holds in NF4.
    fn build(
        b: &Build,
        (get, nf4): (Get, GetNf4),
        tied: bool,
        loaded: Loaded,
    ) -> anyhow::Result<Model> {
        let (cfg, dtype, device, seed, kernels) =
            (b.cfg.clone(), b.dtype, &b.device, b.seed, b.kernels);
        let (c, v) = (cfg.hidden_size, cfg.vocab_size);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let mut layer = super::build::layer(&cfg, l, get, nf4, (dtype, device))?;
            b.adapters.inject(&mut layer, &cfg, l, seed)?;
            if kernels.fold {
                layer.fold()?;
            }
            loaded(Group::Layer(&mut layer))?;
            layer.sync_views()?;
            layers.push(layer);
        }
        let embed = get("model.embed_tokens.weight", &[v, c])?;
        let norm = get("model.norm.weight", &[c])?;
        let lm_head = if tied {
            embed.clone()
        } else {
            get("lm_head.weight", &[v, c])?
        };
        let rope = Freqs::new(
            cfg.head_dim,
            &super::family::Rope {
                theta: cfg.rope_theta,
                scaling: cfg.rope_scaling.clone(),
            },
        );
        let rope_local = cfg
            .arch
            .local_rope
            .as_ref()
            .map(|r| Freqs::new(cfg.head_dim, r));
        let mut m = Model {
            cfg,
            embed,
            layers,
            slabs: Default::default(),
            norm,
            lm_head,
            tied,
            dtype,
            device: device.clone(),
            kernels,
            mlp_chunk: b.mlp_chunk,
            router_aux_coef: b.router_aux_coef,
            rope,
            rope_local,
        };
        loaded(Group::Io(m.io_mut()))?;
        if m.tied {
            m.lm_head = m.embed.clone();
        }
        Ok(m)
    }

    /// The frozen tensors outside the decoder layers: embedding, final norm, and the head
    /// unless it is the embedding (tied).
    pub(crate) fn io_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![&mut self.embed, &mut self.norm];
        if !self.tied {
            v.push(&mut self.lm_head);
        }
        v
    }

    /// A model with no decoder layers whose embedding, final norm and head are the given
    /// tensors (`io_mut` order; FSDP's gathered views), for `embed` and `head`.
    pub(crate) fn io_view(&self, io: Vec<Tensor>) -> Result<Model> {
        let [embed, norm, rest @ ..] = io.as_slice() else {
            candle_core::bail!("io_view: {} tensors, want embed and norm", io.len());
        };
        let lm_head = match (self.tied, rest) {
            (true, []) => embed.clone(),
            (false, [h]) => h.clone(),
            _ => candle_core::bail!("io_view: a head tensor where tied = {}", self.tied),
        };
        Ok(Model {
            cfg: self.cfg.clone(),
            embed: embed.clone(),
            layers: Vec::new(),
            slabs: self.slabs.clone(),
            norm: norm.clone(),
            lm_head,
            tied: self.tied,
            dtype: self.dtype,
            device: self.device.clone(),
            kernels: self.kernels,
            mlp_chunk: self.mlp_chunk,
            router_aux_coef: self.router_aux_coef,
            rope: self.rope.clone(),
            rope_local: self.rope_local.clone(),
        })
    }

    /// Moves the base weights of the linears whose adapters' forward can fold into the base
    /// GEMM into padded buffers (`ops::fold`), where `kernels.fold` (CUDA, bf16). A group
    /// folds when each of its linears has an adapter and no bias, they share a scale, and
    /// their input width is a multiple of 8; a group folded already is left as it is.
    /// `load_with` does the same one layer at a time, before FSDP shards it. Returns the pads'
    /// bytes (the memory plan's `fold` term).
    pub fn fold(&mut self) -> Result<usize> {
        if !self.kernels.fold {
            return Ok(0);
        }
        let mut bytes = 0;
        for layer in &mut self.layers {
            bytes += layer.fold()?;
        }
        Ok(bytes)
    }

    /// Every LoRA adapter with its module name, in layer then module order.
    pub fn adapters(&self) -> impl Iterator<Item = (&str, &Lora)> {
        self.layers.iter().flat_map(|l| l.adapters())
    }

    /// Every frozen base tensor, an NF4 linear's arrays (`QWeight::arrays`) beside its W
    /// placeholder (the test that no gradient reaches them walks these).
    pub fn base_tensors(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.embed, &self.norm, &self.lm_head];
        for l in &self.layers {
            v.extend(l.frozen_plain());
            for lin in l.linears() {
                v.push(&lin.w);
                v.extend(lin.q.iter().flat_map(|q| q.arrays()));
                v.extend(lin.b.as_ref());
            }
        }
        v
    }

    /// The global RoPE's frequencies, and the sliding layers' where they differ (Gemma 3).
    pub(crate) fn rope_freqs(&self) -> (&Freqs, Option<&Freqs>) {
        (&self.rope, self.rope_local.as_ref())
    }

    /// Per-batch context: positions [B×T] (restarting per packed example), segment ids for the
    /// block-diagonal mask (None = one sequence per row), and the dropout key. Prefix-tree ids
    /// (preference pairs) set `mask.prefix_tree` on the result (`train::driver::batch_ctx`).
    pub fn ctx(
        &self,
        positions: &[u32],
        b: usize,
        t: usize,
        segments: Option<Vec<u32>>,
        dropout: Option<(u64, [u64; 2])>,
    ) -> Result<Ctx> {
        let (cos, sin) = self.rope.cos_sin(positions, b, t, &self.device)?;
        let local = match &self.rope_local {
            Some(f) => Some(f.cos_sin(positions, b, t, &self.device)?),
            None => None,
        };
        let segments = segments
            .map(|s| Tensor::from_vec(s, b * t, &self.device))
            .transpose()?;
        let mask = AttnMask {
            segments,
            prefix_tree: false,
            window: 0,
            softcap: 0.0,
            sinks: None,
        };
        let (adapters, adapter_buf) = self.adapters_cast()?;
        let folded = self.write_pads()?;
        Ok(Ctx {
            cos,
            sin,
            local,
            mask,
            attn_block: None,
            dropout,
            adapters,
            adapter_buf,
            folded,
            kernels: self.kernels,
            mlp_chunk: self.mlp_chunk,
            moe_aux: None,
            moe_routes: None,
        })
    }

    /// Every adapter's A and B in the activation dtype, cast in one launch and viewed out of
    /// one buffer (`Ctx::adapters`, `Ctx::adapter_buf`): on CUDA with bf16 activations only;
    /// elsewhere the adapters themselves, detached. Per layer the A's come first, side by side
    /// in module order, then the B's: the A's of linears that share an input are then one
    /// [Σ r, in] matrix as they lie.
    fn adapters_cast(&self) -> Result<AdapterCopies> {
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(dev), DType::BF16) = (&self.device, self.dtype) {
            use candle_core::{op::BackpropOp, CudaStorage, Storage};
            use ops::multi_tensor::{cast_bf16, f32_addr, MultiT};
            let vars: Vec<&candle_core::Var> = self
                .layers
                .iter()
                .flat_map(|l| {
                    let loras: Vec<&Lora> = l
                        .linears()
                        .into_iter()
                        .filter_map(|x| x.lora.as_ref())
                        .collect();
                    let a = loras.iter().map(|l| &l.a).collect::<Vec<_>>();
                    a.into_iter().chain(loras.into_iter().map(|l| &l.b))
                })
                .collect();
            let mut table = Vec::with_capacity(vars.len());
            for v in &vars {
                let Some(g) = f32_addr(v)? else {
                    return Ok((self.adapters_detached(), None)); // not f32 and contiguous
                };
                table.push(MultiT {
                    g,
                    n: v.elem_count() as i64,
                    ..Default::default()
                });
            }
            if table.is_empty() {
                return Ok((HashMap::new(), None));
            }
            let buf = cast_bf16(dev, &table)?;
            let n = buf.len();
            let flat = Tensor::from_storage(
                Storage::Cuda(CudaStorage::wrap_cuda_slice(buf, dev.clone())),
                n,
                BackpropOp::none(),
                false,
            );
            let mut out = HashMap::with_capacity(vars.len());
            let mut off = 0;
            for v in vars {
                let k = v.elem_count();
                out.insert(v.id(), flat.narrow(0, off, k)?.reshape(v.dims())?);
                off += k;
            }
            return Ok((out, Some(flat)));
        }
        Ok((self.adapters_detached(), None))
    }

    /// Every decoder linear's adapter A and B as stored, detached (elsewhere than
    /// `adapters_cast`'s copies): the hand-written passes take them from `Ctx::adapter`, and a
    /// product of a `Var` records its inputs, so a layer's gradients would hold its
    /// activations alive until the optimiser step, every layer's at once.
    fn adapters_detached(&self) -> HashMap<TensorId, Tensor> {
        self.layers
            .iter()
            .flat_map(|l| l.linears())
            .filter_map(|x| x.lora.as_ref())
            .flat_map(|l| [&l.a, &l.b])
            .map(|v| (v.id(), v.as_tensor().detach()))
            .collect()
    }

    /// Every folded linear's B rounded to bf16 into its pad columns (`ops::fold`), in one
    /// launch. Whether they were: false when nothing is folded, or a B is not an f32 CUDA
    /// tensor as stored (then nothing runs folded).
    fn write_pads(&self) -> Result<bool> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = &self.device {
            use ops::multi_tensor::{cast_rows_bf16, f32_addr, MultiT};
            let mut table = Vec::new();
            for lin in self.layers.iter().flat_map(|l| l.linears()) {
                let (Some(pad), Some(lora)) = (&lin.pad, &lin.lora) else {
                    continue;
                };
                if pad.full.rank() != 2 {
                    continue; // FSDP's placeholder: the shards carry the B's (Shards::write_pads)
                }
                let (out, ld) = pad.full.dims2()?;
                let (in_f, r) = (lin.w.dim(1)?, lora.b.dim(1)?);
                let (Some(g), Some(p)) = (f32_addr(&lora.b)?, ops::cuda::addr(&pad.full)?) else {
                    return Ok(false);
                };
                if pad.full.dtype() != DType::BF16
                    || lora.b.dim(0)? != out
                    || in_f + pad.col + r > ld
                {
                    return Ok(false);
                }
                table.push(MultiT {
                    p: p + 2 * (in_f + pad.col) as u64,
                    g,
                    m: r as u64,
                    v: ld as u64,
                    n: (out * r) as i64,
                });
            }
            if table.is_empty() {
                return Ok(false);
            }
            // SAFETY: each destination is its own linear's r pad columns of out rows ld apart
            // (checked above) in a live bf16 buffer on this device; the B's are live f32.
            unsafe { cast_rows_bf16(dev, &table)? };
            return Ok(true);
        }
        Ok(false)
    }

    /// ids: [B, T] u32 → hidden [B, T, C]. The embedding is frozen: no graph is built. Gemma
    /// scales it by √C, the factor rounded to the model dtype first (as transformers'
    /// `embed_scale.to(weight.dtype)`).
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let x = self.embed.index_select(&ids.flatten_all()?, 0)?.reshape((
            b,
            t,
            self.cfg.hidden_size,
        ))?;
        match self.cfg.embed_scale() {
            Some(f) => x.affine(f, 0.0),
            None => Ok(x),
        }
    }

    /// hidden [..., C] → logits [..., V] in f32 (final norm, then the frozen head, then the
    /// soft-cap where the model has one).
    pub fn head(&self, h: &Tensor) -> Result<Tensor> {
        let hn = ops::rms_norm(h, &self.norm, self.cfg.norm_spec())?;
        let logits = ops::frozen_linear(&hn, &self.lm_head, None)?.to_dtype(DType::F32)?;
        match self.cfg.arch.final_softcap {
            Some(cap) => ops::softcap::softcap(&logits, cap),
            None => Ok(logits),
        }
    }

    /// The head's loss and its backward without autograd, for training. x: hidden rows
    /// [n, C], targets [n] u32 → (Σ token CE, dL/dx [n, C]) for L = Σ CE / `denom`.
    /// The logits [n, V] stay in the activation dtype; `ops::cross_entropy` does the CE and
    /// its gradient in one kernel on CUDA (on the CPU, the former f32 tensor ops, bit for bit).
    pub fn head_loss_bwd(&self, x: &Tensor, targets: &Tensor, denom: f64) -> Result<(f64, Tensor)> {
        let (ce, dx) = self.head_loss_bwd_dev(x, targets, denom)?;
        Ok((ce.to_scalar::<f32>()? as f64, dx))
    }

    /// `head_loss_bwd` with Σ CE left on the device (a scalar f32 tensor): reading it is a
    /// synchronisation, which the driver does once a micro-batch, after backward is queued.
    pub(crate) fn head_loss_bwd_dev(
        &self,
        x: &Tensor,
        targets: &Tensor,
        denom: f64,
    ) -> Result<(Tensor, Tensor)> {
        let (ce_rows, dx) = self.head_ce_rows_bwd_dev(x, targets, denom)?;
        Ok((ce_rows.sum_all()?, dx))
    }

    /// Each row's CE, ce [n] f32, without the backward: the same kernel and the same bits as
    /// `head_ce_rows_bwd_dev`'s (a preference objective's reference scores ties exactly).
    pub fn head_ce_rows_dev(&self, x: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let hn = ops::rms_norm(x, &self.norm, self.cfg.norm_spec())?;
        let logits = ops::frozen_linear(&hn, &self.lm_head, None)?;
        let (ce_rows, _) = ops::cross_entropy::cross_entropy_fwd_bwd(
            &logits,
            targets,
            1.0,
            self.cfg.arch.final_softcap,
            self.kernels.cross_entropy,
        )?;
        Ok(ce_rows)
    }

    /// `head_loss_bwd_dev` with each row's CE kept: (ce [n] f32, dL/dx [n, C]) for L = Σ CE /
    /// `denom`. A preference objective weighs each row's gradient by dL/d(its log-probability).
    pub fn head_ce_rows_bwd_dev(
        &self,
        x: &Tensor,
        targets: &Tensor,
        denom: f64,
    ) -> Result<(Tensor, Tensor)> {
        let norm = self.cfg.norm_spec();
        let hn = ops::rms_norm(x, &self.norm, norm)?; // [n, C]
        let logits = ops::frozen_linear(&hn, &self.lm_head, None)?; // [n, V]

        // Gemma 2: the CE of the capped logits, its gradient back through the cap
        let (ce_rows, dl) = ops::cross_entropy::cross_entropy_fwd_bwd(
            &logits,
            targets,
            denom,
            self.cfg.arch.final_softcap,
            self.kernels.cross_entropy,
        )?;
        drop(logits);
        let dhn = dl.matmul(&self.lm_head)?; // [n, C]
        Ok((ce_rows, ops::rms_norm_bwd(x, &self.norm, norm, &dhn)?))
    }

    /// Logits at every position: ids [B, T] → [B, T, V] f32 (whole graph kept: tests, eval).
    pub fn forward(&self, ids: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let mut x = self.embed(ids)?;
        for layer in &self.layers {
            x = layer.resident_in(Some(&self.slabs))?.forward(&x, ctx)?;
        }
        self.head(&x)
    }
}

/// Sum of token cross-entropies: logits [N, V] f32, targets [N] u32 → scalar f32.
pub fn cross_entropy_sum(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    logp.gather(&targets.unsqueeze(1)?, 1)?.sum_all()?.neg()
}
