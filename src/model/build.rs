//! One decoder layer assembled from a checkpoint's tensors, by the names each family gives
//! them (transformers' module names, which are also PEFT's adapter keys):
//!
//!   model.layers.{l}.input_layernorm, .post_attention_layernorm (the MLP's input norm; on
//!       Gemma the attention output's, the MLP's being .pre_feedforward_layernorm, and
//!       .post_feedforward_layernorm on its output)
//!   .self_attn.{q,k,v,o}_proj (Phi-3: .qkv_proj, .o_proj), .self_attn.{q,k}_norm (QK-norm)
//!   .mlp.{gate,up,down}_proj (Phi-3: .gate_up_proj, .down_proj)

use super::config::ModelConfig;
use super::layer::{Extra, Layer, LayerSpec};
use super::linear::Linear;
use crate::lora::{module_index, Lora, LoraSpec};
use crate::quant::QWeight;
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

/// A source of named base tensors: (HF name, shape) → the tensor on the device.
pub type Get<'a> = &'a dyn Fn(&str, &[usize]) -> anyhow::Result<Tensor>;

/// The linear weights a checkpoint stores in NF4 (a bitsandbytes 4-bit one): (HF name, shape)
/// → the weight on the device, None where it is a plain tensor (for `Get`).
pub type GetNf4<'a> = &'a dyn Fn(&str, &[usize]) -> anyhow::Result<Option<QWeight>>;

/// Layer `l` of `cfg`: its tensors from `get` (its linears' W from `nf4` where the checkpoint
/// holds them in NF4), fresh adapters (keyed by seed, layer and
/// module) on the linears `spec` targets.
pub fn layer(
    cfg: &ModelConfig,
    l: usize,
    get: Get,
    nf4: GetNf4,
    spec: &LoraSpec,
    seed: u64,
    (dtype, device): (DType, &Device),
) -> anyhow::Result<Layer> {
    let c = cfg.hidden_size;
    let linear = |group: &str, module: &str, bias: bool| -> anyhow::Result<Linear> {
        let Some((in_f, out_f)) = cfg.linear_shape(module) else {
            anyhow::bail!(
                "{module}: not a linear of a {} model",
                cfg.family.model_type()
            );
        };
        let name = format!("model.layers.{l}.{group}.{module}");
        let q = nf4(&format!("{name}.weight"), &[out_f, in_f])?;
        let w = match &q {
            // the placeholder `Layer::resident` replaces, in the dtype it dequantizes to
            Some(_) => Tensor::zeros(1, dtype, device)?,
            None => get(&format!("{name}.weight"), &[out_f, in_f])?,
        };
        let b = match bias {
            true => Some(get(&format!("{name}.bias"), &[out_f])?),
            false => None,
        };
        let key = [l as u64, module_index(module)];
        let lora = match (spec.targets(module), spec.dora, &q) {
            (false, _, _) => None,
            (true, false, _) => Some(Lora::init(spec, in_f, out_f, seed, &key, device)?),
            // DoRA's magnitude starts at ‖W‖_row of the W the forward uses
            (true, true, Some(q)) => {
                let wd = q.dequantize(dtype)?;
                Some(Lora::init_for(spec, &wd, seed, &key, device)?)
            }
            (true, true, None) => Some(Lora::init_for(spec, &w, seed, &key, device)?),
        };
        Ok(Linear {
            name,
            w,
            b,
            lora,
            pad: None,
            q: q.map(Arc::new),
            key,
        })
    };
    let p = format!("model.layers.{l}");
    let norm = |name: &str, width: usize| get(&format!("{p}.{name}.weight"), &[width]);
    let arch = &cfg.arch;
    let (attn_in, mlp_in) = match arch.fused {
        true => (
            vec![linear("self_attn", "qkv_proj", false)?],
            vec![linear("mlp", "gate_up_proj", false)?],
        ),
        false => (
            vec![
                linear("self_attn", "q_proj", cfg.qkv_bias)?,
                linear("self_attn", "k_proj", cfg.qkv_bias)?,
                linear("self_attn", "v_proj", cfg.qkv_bias)?,
            ],
            vec![
                linear("mlp", "gate_proj", cfg.mlp_bias)?,
                linear("mlp", "up_proj", cfg.mlp_bias)?,
            ],
        ),
    };
    let d = cfg.head_dim;
    let (post_norm, extra) = match arch.sandwich_norms {
        true => (
            norm("pre_feedforward_layernorm", c)?,
            Extra {
                attn_out_norm: Some(norm("post_attention_layernorm", c)?),
                mlp_out_norm: Some(norm("post_feedforward_layernorm", c)?),
                ..Extra::default()
            },
        ),
        false => (norm("post_attention_layernorm", c)?, Extra::default()),
    };
    let extra = match arch.qk_norm {
        true => Extra {
            q_norm: Some(norm("self_attn.q_norm", d)?),
            k_norm: Some(norm("self_attn.k_norm", d)?),
            ..extra
        },
        false => extra,
    };
    let sliding = arch.sliding.get(l).copied().unwrap_or(false);
    Ok(Layer {
        input_norm: norm("input_layernorm", c)?,
        post_norm,
        extra,
        attn_in,
        o: linear("self_attn", "o_proj", cfg.o_bias)?,
        mlp_in,
        down: linear("mlp", "down_proj", cfg.mlp_bias)?,
        spec: LayerSpec {
            norm: cfg.norm_spec(),
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: d,
            window: cfg.window(l),
            scale: cfg.attn_scale(),
            softcap: arch.attn_softcap.unwrap_or(0.0) as f32,
            act: arch.act,
            local_rope: sliding && arch.local_rope.is_some(),
        },
        lease: None,
    })
}
