//! config.json's rotary fields, as transformers 4.x and 5.x write them: `rope_theta` and
//! `rope_scaling`, or `rope_parameters` (Gemma 3: one entry per layer type), the scaling's
//! `type` or `rope_type`, Phi-3's LongRoPE factors, YaRN's (model/yarn.rs).

use super::config::{Raw, RopeScaling};
use super::family::{Family, Rope};
use serde_json::Value;

/// The global RoPE and, for Gemma 3, its sliding layers' own.
pub(super) fn ropes(
    family: Family,
    raw: &Raw,
    max_pos: usize,
    head_dim: usize,
) -> Result<(Rope, Option<Rope>), String> {
    // transformers 5 keeps theta and scaling in `rope_parameters`; 4.x at the top level.
    let params = raw.rope_parameters.as_ref().filter(|v| v.is_object());
    let top_scaling = raw.rope_scaling.as_ref().filter(|v| v.is_object());
    let partial = [
        raw.partial_rotary_factor,
        params.and_then(|p| p.get("partial_rotary_factor")?.as_f64()),
    ];
    if let Some(f) = partial.into_iter().flatten().find(|&f| f != 1.0) {
        return Err(format!(
            "partial_rotary_factor {f} is not supported (RoPE over the whole head only)"
        ));
    }
    let default_theta = match family {
        Family::Qwen2 => 1_000_000.0,
        Family::Gemma3 => 1_000_000.0,
        _ => 10_000.0,
    };
    let ctx = ScalingCtx {
        max_pos,
        orig_top: raw.original_max_position_embeddings,
        half: head_dim / 2,
    };
    if family == Family::Gemma3 {
        let per_type = |k: &str| params.and_then(|p| p.get(k)).filter(|v| v.is_object());
        if let (Some(full), Some(slide)) =
            (per_type("full_attention"), per_type("sliding_attention"))
        {
            return Ok((
                rope_of(full, default_theta, ctx)?,
                Some(rope_of(slide, 10_000.0, ctx)?),
            ));
        }
        // 4.x: rope_theta and rope_scaling are the global layers', rope_local_base_freq the
        // sliding ones' base (no scaling).
        let global = Rope {
            theta: raw.rope_theta.unwrap_or(default_theta),
            scaling: match top_scaling {
                Some(s) => parse_scaling(s, ctx)?,
                None => RopeScaling::None,
            },
        };
        let local = Rope {
            theta: raw.rope_local_base_freq.unwrap_or(10_000.0),
            scaling: RopeScaling::None,
        };
        return Ok((global, Some(local)));
    }
    let theta = params
        .and_then(|p| p.get("rope_theta"))
        .and_then(Value::as_f64)
        .or(raw.rope_theta)
        .unwrap_or(default_theta);
    let scaling = match top_scaling.or(params) {
        None => RopeScaling::None,
        Some(s) => parse_scaling(s, ctx)?,
    };
    Ok((Rope { theta, scaling }, None))
}

/// One `rope_parameters` entry: theta (or `default_theta`) and its scaling.
fn rope_of(p: &Value, default_theta: f64, ctx: ScalingCtx) -> Result<Rope, String> {
    Ok(Rope {
        theta: p
            .get("rope_theta")
            .and_then(Value::as_f64)
            .unwrap_or(default_theta),
        scaling: parse_scaling(p, ctx)?,
    })
}

/// What a scaling's defaults depend on besides its own fields.
#[derive(Clone, Copy)]
struct ScalingCtx {
    max_pos: usize,
    /// `original_max_position_embeddings` at config.json's top level (Phi-3).
    orig_top: Option<usize>,
    /// Frequencies per head (head_dim / 2): LongRoPE's factor lists are that long.
    half: usize,
}

fn parse_scaling(s: &Value, ctx: ScalingCtx) -> Result<RopeScaling, String> {
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let f = |k: &str| s.get(k).and_then(Value::as_f64);
    let factor = || f("factor").ok_or_else(|| format!("rope scaling `{kind}` needs `factor`"));
    let orig = s
        .get("original_max_position_embeddings")
        .and_then(Value::as_u64)
        .map(|v| v as usize);
    match kind {
        "default" => Ok(RopeScaling::None),
        // Dynamic NTK only changes frequencies past max_position_embeddings at inference.
        "dynamic" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
            high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
            original_max_position: orig.unwrap_or(ctx.max_pos),
        }),
        "longrope" | "su" => {
            let list = |k: &str| -> Result<Vec<f64>, String> {
                let v: Option<Vec<f64>> = s
                    .get(k)
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_f64).collect());
                match v {
                    Some(v) if v.len() == ctx.half => Ok(v),
                    Some(v) => Err(format!(
                        "rope scaling `{kind}`: `{k}` has {} factors, head_dim / 2 = {} wanted",
                        v.len(),
                        ctx.half
                    )),
                    None => Err(format!("rope scaling `{kind}` needs `{k}` (a list of numbers)")),
                }
            };
            let original_max_position = orig.or(ctx.orig_top).ok_or_else(|| {
                format!("rope scaling `{kind}` needs `original_max_position_embeddings`")
            })?;
            // transformers: factor = max / original when unset; the attention factor
            // √(1 + ln factor / ln original), 1 for factor ≤ 1.
            let factor = f("factor")
                .unwrap_or(ctx.max_pos as f64 / original_max_position.max(1) as f64);
            let attention_factor = f("attention_factor").unwrap_or(if factor <= 1.0 {
                1.0
            } else {
                (1.0 + factor.ln() / (original_max_position as f64).ln()).sqrt()
            });
            Ok(RopeScaling::LongRope {
                short: list("short_factor")?,
                long: list("long_factor")?,
                original_max_position,
                attention_factor,
            })
        }
        "yarn" => super::yarn::parse(s, orig.or(ctx.orig_top).unwrap_or(ctx.max_pos), ctx.max_pos),
        other => Err(format!(
            "rope scaling type `{other}` is not supported (supported: default, linear, dynamic, llama3, longrope, yarn)"
        )),
    }
}
