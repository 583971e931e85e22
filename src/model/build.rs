//! One decoder layer assembled from a checkpoint's tensors, by the names each family gives
//! them (transformers' module names, which are also PEFT's adapter keys):
//!
//!   model.layers.{l}.input_layernorm, .post_attention_layernorm (the MLP's input norm; on
//!       Gemma the attention output's, the MLP's being .pre_feedforward_layernorm, and
//!       .post_feedforward_layernorm on its output)
//!   .self_attn.{q,k,v,o}_proj (Phi-3: .qkv_proj, .o_proj), .self_attn.{q,k}_norm (QK-norm)
//!   .mlp.{gate,up,down}_proj (Phi-3: .gate_up_proj, .down_proj)
//!   gpt-oss: .self_attn.sinks [H]; .mlp.router.{weight,bias}, .mlp.experts.gate_up_proj
//!       [E, C, 2I] and .down_proj [E, I, C] with their `_bias` (`oss_experts`)
//!   Qwen3-MoE: .mlp.gate (the router [E, C]), .mlp.experts.gate_up_proj [E, 2I, C] and
//!       .mlp.experts.down_proj [E, C, I] as transformers 5 saves them, or per expert as 4.x
//!       checkpoints on the Hub hold them (.mlp.experts.{e}.{gate,up,down}_proj.weight)

use super::adapter::module_index;
use super::config::ModelConfig;
use super::family::MoeSpec;
use super::layer::{Extra, Layer, LayerSpec};
use super::layer_moe::{Moe, OssBiases};
use super::linear::Linear;
use crate::quant::QWeight;
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

/// A source of named base tensors: (HF name, shape) → the tensor on the device.
pub(crate) type Get<'a> = &'a dyn Fn(&str, &[usize]) -> anyhow::Result<Tensor>;

/// The linear weights a checkpoint stores in NF4 (a bitsandbytes 4-bit one): (HF name, shape)
/// → the weight on the device, None where it is a plain tensor (for `Get`).
pub(crate) type GetNf4<'a> = &'a dyn Fn(&str, &[usize]) -> anyhow::Result<Option<QWeight>>;

/// Layer `l` of `cfg`: its tensors from `get` (its linears' W from `nf4` where the checkpoint
/// holds them in NF4), its adapter slots empty (`Inject` fills them).
pub(crate) fn layer(
    cfg: &ModelConfig,
    l: usize,
    get: Get,
    nf4: GetNf4,
    (dtype, device): (DType, &Device),
) -> anyhow::Result<Layer> {
    let src = Source {
        cfg,
        l,
        get,
        nf4,
        dtype,
        device,
    };
    let c = cfg.hidden_size;
    let (attn_in, mlp_in) = src.inputs()?;
    let (down, moe) = match cfg.arch.moe {
        Some(m) => (None, Some(Box::new(moe(cfg, m, l, get)?))),
        None => (Some(src.linear("mlp", "down_proj", cfg.mlp_bias)?), None),
    };
    let (post_norm, extra) = src.norms()?;
    Ok(Layer {
        input_norm: src.norm("input_layernorm", c)?,
        post_norm,
        extra,
        attn_in,
        o: src.linear("self_attn", "o_proj", cfg.o_bias)?,
        mlp_in,
        down,
        moe,
        spec: layer_spec(cfg, l),
        lease: None,
    })
}

/// Where layer `l`'s tensors come from (`get`, `nf4`).
struct Source<'a> {
    cfg: &'a ModelConfig,
    l: usize,
    get: Get<'a>,
    nf4: GetNf4<'a>,
    dtype: DType,
    device: &'a Device,
}

impl Source<'_> {
    /// The linear `{group}.{module}`: its W (NF4's placeholder where the checkpoint holds it
    /// in NF4), its bias where `bias`, its adapter slot empty; `key` its (layer, module)
    /// index.
    fn linear(&self, group: &str, module: &str, bias: bool) -> anyhow::Result<Linear> {
        let (cfg, l) = (self.cfg, self.l);
        let (get, dtype, device) = (self.get, self.dtype, self.device);
        let Some((in_f, out_f)) = cfg.linear_shape(module) else {
            anyhow::bail!(
                "{module}: not a linear of a {} model",
                cfg.family.model_type()
            );
        };
        let name = format!("model.layers.{l}.{group}.{module}");
        let q = (self.nf4)(&format!("{name}.weight"), &[out_f, in_f])?;
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
        Ok(Linear {
            name,
            w,
            b,
            lora: None,
            pad: None,
            q: q.map(Arc::new),
            key,
        })
    }

    /// The norm gain `model.layers.{l}.{name}.weight` [width].
    fn norm(&self, name: &str, width: usize) -> anyhow::Result<Tensor> {
        (self.get)(&format!("model.layers.{}.{name}.weight", self.l), &[width])
    }

    /// The plain parameter `model.layers.{l}.{name}` [width] (gpt-oss's sinks).
    fn norm_like(&self, name: &str, width: usize) -> anyhow::Result<Tensor> {
        (self.get)(&format!("model.layers.{}.{name}", self.l), &[width])
    }

    /// The attention's input projections (q, k and v, or Phi-3's qkv) and the MLP's (gate and
    /// up, or Phi-3's gate_up; none on a MoE layer, whose experts hold them).
    fn inputs(&self) -> anyhow::Result<(Vec<Linear>, Vec<Linear>)> {
        let cfg = self.cfg;
        Ok(match (cfg.arch.fused, cfg.arch.moe) {
            (true, _) => (
                vec![self.linear("self_attn", "qkv_proj", false)?],
                vec![self.linear("mlp", "gate_up_proj", false)?],
            ),
            (false, moe) => (
                vec![
                    self.linear("self_attn", "q_proj", cfg.qkv_bias)?,
                    self.linear("self_attn", "k_proj", cfg.qkv_bias)?,
                    self.linear("self_attn", "v_proj", cfg.qkv_bias)?,
                ],
                match moe {
                    Some(_) => Vec::new(),
                    None => vec![
                        self.linear("mlp", "gate_proj", cfg.mlp_bias)?,
                        self.linear("mlp", "up_proj", cfg.mlp_bias)?,
                    ],
                },
            ),
        })
    }

    /// The MLP's input norm, and the gains only some families have: Gemma's norms on the
    /// attention's and the MLP's outputs, QK-norm's on q and k.
    fn norms(&self) -> anyhow::Result<(Tensor, Extra)> {
        let (arch, c, d) = (&self.cfg.arch, self.cfg.hidden_size, self.cfg.head_dim);
        let (post_norm, extra) = match arch.sandwich_norms {
            true => (
                self.norm("pre_feedforward_layernorm", c)?,
                Extra {
                    attn_out_norm: Some(self.norm("post_attention_layernorm", c)?),
                    mlp_out_norm: Some(self.norm("post_feedforward_layernorm", c)?),
                    ..Extra::default()
                },
            ),
            false => (self.norm("post_attention_layernorm", c)?, Extra::default()),
        };
        let extra = match arch.sinks {
            true => Extra {
                sinks: Some(self.norm_like("self_attn.sinks", self.cfg.num_heads)?),
                ..extra
            },
            false => extra,
        };
        let extra = match arch.qk_norm {
            true => Extra {
                q_norm: Some(self.norm("self_attn.q_norm", d)?),
                k_norm: Some(self.norm("self_attn.k_norm", d)?),
                ..extra
            },
            false => extra,
        };
        Ok((post_norm, extra))
    }
}

/// Layer `l`'s attention and MLP settings from `cfg`: heads, window, scale, soft-cap,
/// activation, and whether it ropes from the local table.
fn layer_spec(cfg: &ModelConfig, l: usize) -> LayerSpec {
    let arch = &cfg.arch;
    let sliding = arch.sliding.get(l).copied().unwrap_or(false);
    LayerSpec {
        norm: cfg.norm_spec(),
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        window: cfg.window(l),
        scale: cfg.attn_scale(),
        softcap: arch.attn_softcap.unwrap_or(0.0) as f32,
        act: arch.act,
        local_rope: sliding && arch.local_rope.is_some(),
    }
}

/// Layer `l`'s router and experts, their adapter slots empty.
fn moe(cfg: &ModelConfig, m: MoeSpec, l: usize, get: Get) -> anyhow::Result<Moe> {
    let (c, i, e) = (cfg.hidden_size, m.inter, m.experts);
    let p = format!("model.layers.{l}.mlp");
    let (router, gate_up, down, biases) = match m.oss {
        Some(_) => oss_experts(get, &p, m, c)?,
        None => {
            let gate_up = match get(&format!("{p}.experts.gate_up_proj"), &[e, 2 * i, c]) {
                Ok(t) => t,
                Err(fused) => per_expert(get, &p, m, c, true).map_err(|_| fused)?,
            };
            let down = match get(&format!("{p}.experts.down_proj"), &[e, c, i]) {
                Ok(t) => t,
                Err(fused) => per_expert(get, &p, m, c, false).map_err(|_| fused)?,
            };
            (
                get(&format!("{p}.gate.weight"), &[e, c])?,
                gate_up,
                down,
                None,
            )
        }
    };
    Ok(Moe {
        router,
        gate_up,
        down,
        biases,
        spec: m,
        gate_up_lora: None,
        down_lora: None,
        nf4: None,
        layer: l,
    })
}

/// gpt-oss's router (`{p}.router.weight` [E, C], `.bias` [E]) and experts as transformers
/// stores them, x·W: gate_up_proj [E, C, 2I] (gate and up interleaved in its columns) and
/// down_proj [E, I, C], each with its bias (`_bias`: [E, 2I], [E, C]); the weights are turned
/// to the [E, out, in] the experts' GEMMs take (gate_up's rows keep the interleaving).
fn oss_experts(
    get: Get,
    p: &str,
    m: MoeSpec,
    c: usize,
) -> anyhow::Result<(Tensor, Tensor, Tensor, Option<OssBiases>)> {
    let (e, i) = (m.experts, m.inter);
    let t = |name: &str, shape: &[usize]| get(&format!("{p}.{name}"), shape);
    let turned = |name: &str, shape: &[usize]| -> anyhow::Result<Tensor> {
        Ok(t(name, shape)?.transpose(1, 2)?.contiguous()?)
    };
    let biases = OssBiases {
        router: t("router.bias", &[e])?,
        gate_up: t("experts.gate_up_proj_bias", &[e, 2 * i])?,
        down: t("experts.down_proj_bias", &[e, c])?,
    };
    Ok((
        t("router.weight", &[e, c])?,
        turned("experts.gate_up_proj", &[e, c, 2 * i])?,
        turned("experts.down_proj", &[e, i, c])?,
        Some(biases),
    ))
}

/// A 4.x checkpoint's experts one by one (`{p}.experts.{e}.gate_proj.weight` [I, C], up's,
/// down's [C, I]) stacked as transformers 5 fuses them: gate_up [E, 2I, C] (gate rows first),
/// or down [E, C, I].
fn per_expert(get: Get, p: &str, m: MoeSpec, c: usize, gate_up: bool) -> anyhow::Result<Tensor> {
    let i = m.inter;
    let mut v = Vec::with_capacity(m.experts);
    for e in 0..m.experts {
        let w = |n: &str, shape: &[usize]| get(&format!("{p}.experts.{e}.{n}.weight"), shape);
        v.push(match gate_up {
            true => Tensor::cat(&[w("gate_proj", &[i, c])?, w("up_proj", &[i, c])?], 0)?,
            false => w("down_proj", &[c, i])?,
        });
    }
    Ok(Tensor::stack(&v, 0)?)
}
