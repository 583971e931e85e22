//! LoRA adapters: what to inject (`LoraSpec`: rank, scale, dropout, DoRA, the targeted
//! modules), their init, and their injection into a built model's empty slots (`Inject`,
//! PEFT's design: the model knows no targets). y = base(x) + scale · B(A(dropout(x)));
//! dropout's masks are `ops::dropout`'s (drawn where they are used, keyed by seed, step,
//! micro-batch, layer and module).
//!
//! A: [r, in], B: [out, r], both f32 `Var`s whatever the base dtype; they are cast to the
//! activation dtype inside the forward (the cast's backward returns f32 gradients).
//! scale = alpha / r, or alpha / √r with rsLoRA. Init as PEFT: A kaiming-uniform(a=√5), i.e.
//! U(−1/√in, 1/√in); B zeros, so training starts from the base model exactly.
//!
//! DoRA (`lora.use_dora`) adds a trainable magnitude m [out] f32, initialised to the row norms
//! of W: y = (m / ‖W + s·B A‖_row) ⊙ (x Wᵀ + s·x Aᵀ Bᵀ) + bias (`ops::dora`).

use crate::model::layer_moe::ExpertLora;
use crate::model::{module_index, Inject, Layer, Lora, ModelConfig, EXPERT_PARAMS};
use crate::rng::Rng;
use candle_core::{DType, Device, Result, Tensor, Var};
use std::sync::Arc;

/// What to inject, resolved from the recipe (or an init adapter's config).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// r: the adapters' inner dimension (A [r, in], B [out, r]).
    pub rank: usize,
    /// α: the adapters' scale is α / r (α / √r with `rslora`).
    pub alpha: f64,
    /// Probability that an element of an adapter's input is zeroed (0: none).
    pub dropout: f32,
    /// rsLoRA: scale α / √r instead of α / r.
    pub rslora: bool,
    /// DoRA: each adapter has a magnitude vector (PEFT's `use_dora`).
    pub dora: bool,
    /// Module names (subset of `KNOWN_LINEAR`), in `KNOWN_LINEAR` order; once resolved against
    /// a model's config, its own linears'.
    pub targets: Vec<String>,
}

impl LoraSpec {
    pub(crate) fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    pub(crate) fn targets(&self, module: &str) -> bool {
        self.targets.iter().any(|t| t == module)
    }
}

impl Lora {
    /// Fresh adapter: A ~ U(−1/√in, 1/√in) from a stream keyed by (seed, layer, module); B = 0.
    pub(crate) fn init(
        spec: &LoraSpec,
        in_f: usize,
        out_f: usize,
        seed: u64,
        key: &[u64],
        dev: &Device,
    ) -> Result<Self> {
        let bound = 1.0 / (in_f as f32).sqrt();
        let mut rng = Rng::keyed(seed, key);
        let a: Vec<f32> = (0..spec.rank * in_f)
            .map(|_| (rng.next_f32() * 2.0 - 1.0) * bound)
            .collect();
        let a = Var::from_tensor(&Tensor::from_vec(a, (spec.rank, in_f), dev)?)?;
        let b = Var::zeros((out_f, spec.rank), DType::F32, dev)?;
        Ok(Lora {
            a,
            b,
            scale: spec.scale(),
            dropout: spec.dropout,
            m: None,
        })
    }

    /// `init` with DoRA's magnitude where `spec.dora`: m = ‖W‖_row of the weight the forward
    /// uses (`w` [out, in], dequantized for an NF4 base), so that m / ‖W + s·B A‖ starts at 1.
    pub(crate) fn init_for(
        spec: &LoraSpec,
        w: &Tensor,
        seed: u64,
        key: &[u64],
        dev: &Device,
    ) -> Result<Self> {
        let (out_f, in_f) = w.dims2()?;
        let mut lora = Self::init(spec, in_f, out_f, seed, key, dev)?;
        if spec.dora {
            let m = crate::ops::dora::row_norms(w)?.to_device(dev)?;
            lora.m = Some(Var::from_tensor(&m)?);
        }
        Ok(lora)
    }
}

impl Inject for LoraSpec {
    /// Layer `l`'s adapters: a fresh one (keyed by seed, layer and module: the linear's `key`)
    /// on each linear the spec targets, DoRA's magnitude from the W the forward uses
    /// (dequantized where the base is NF4), then a MoE's experts' (`experts`).
    fn inject(
        &self,
        layer: &mut Layer,
        cfg: &ModelConfig,
        l: usize,
        seed: u64,
    ) -> anyhow::Result<()> {
        for lin in layer.linears_mut() {
            let module = lin.name.rsplit('.').next().unwrap_or("").to_string();
            if !self.targets(&module) {
                continue;
            }
            let Some((in_f, out_f)) = cfg.linear_shape(&module) else {
                continue;
            };
            let device = lin.w.device().clone();
            let key = lin.key;
            lin.lora = Some(match (self.dora, &lin.q) {
                (false, _) => Lora::init(self, in_f, out_f, seed, &key, &device)?,
                (true, Some(q)) => {
                    let wd = q.dequantize(lin.w.dtype())?;
                    Lora::init_for(self, &wd, seed, &key, &device)?
                }
                (true, None) => Lora::init_for(self, &lin.w, seed, &key, &device)?,
            });
        }
        if let Some(moe) = layer.moe.as_mut() {
            let device = moe.router.device().clone();
            let (gate_up, down) = experts(
                self,
                cfg,
                moe.spec.inter,
                moe.spec.experts,
                l,
                seed,
                &device,
            )?;
            (moe.gate_up_lora, moe.down_lora) = (gate_up, down);
        }
        Ok(())
    }

    fn shared(&self) -> Arc<dyn Inject> {
        Arc::new(self.clone())
    }
}

/// Layer `l`'s expert adapters, on the expert parameters `spec` targets (A [E·r, in] uniform in
/// ±1/√in as PEFT's, B zero; the scale of rank r): (gate_up's, down's).
fn experts(
    spec: &LoraSpec,
    cfg: &ModelConfig,
    i: usize,
    e: usize,
    l: usize,
    seed: u64,
    device: &Device,
) -> anyhow::Result<(Option<ExpertLora>, Option<ExpertLora>)> {
    let c = cfg.hidden_size;
    let p = format!("model.layers.{l}.mlp");
    let targeted = |name: &str| spec.targets(name);
    let [gu_name, down_name] = EXPERT_PARAMS;
    let both = targeted(gu_name) && targeted(down_name);
    if (targeted(gu_name) || targeted(down_name)) && (spec.dora || spec.dropout > 0.0) {
        anyhow::bail!(
            "lora.targets names the experts ({gu_name}, {down_name}): PEFT's adapters on \
             expert parameters take neither DoRA nor dropout; set lora.use_dora = false and \
             lora.dropout = 0, or target the attention only"
        );
    }
    let adapter = |name: &str, in_f: usize, out_f: usize, module: &str| {
        if !targeted(name) {
            return Ok(None);
        }
        let wide = LoraSpec {
            rank: spec.rank * e,
            ..spec.clone()
        };
        let key = [l as u64, module_index(name)];
        let mut lora = Lora::init(&wide, in_f, out_f, seed, &key, device)?;
        lora.scale = spec.scale();
        anyhow::Ok(Some(ExpertLora {
            name: format!("{p}.{module}"),
            lora,
        }))
    };
    // PEFT nests one wrapper per targeted parameter, gate_up_proj's innermost: with both,
    // gate_up's adapter is keyed under `experts.base_layer`
    let gu_module = if both {
        "experts.base_layer"
    } else {
        "experts"
    };
    Ok((
        adapter(gu_name, c, 2 * i, gu_module)?,
        adapter(down_name, i, c, "experts")?,
    ))
}
