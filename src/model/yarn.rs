//! YaRN rotary scaling (gpt-oss), as transformers' `_compute_yarn_parameters`: its fields read
//! from config.json, and the frequencies it makes.
//!
//! With dim = head_dim and base θ, per frequency i < dim/2 (f32 as transformers):
//!   extrapolated eᵢ = 1 / θ^(2i/dim), interpolated eᵢ / factor;
//!   ramp rᵢ = clamp((i − low) / (high − low), 0, 1) with [low, high] the dimensions that turn
//!   beta_fast and beta_slow times over original_max_position (floored and ceiled with
//!   `truncate`, clipped to [0, dim − 1]);
//!   inv_freqᵢ = eᵢ / factor · rᵢ + eᵢ · (1 − rᵢ);
//! cos and sin × the attention factor (0.1·ln(factor) + 1 unless config.json gives it).

use super::config::RopeScaling;
use serde_json::Value;

/// The `yarn` entry of `rope_scaling` / `rope_parameters`: `orig` is its
/// original_max_position_embeddings (or the config's, else `max_pos`, as transformers
/// standardises it).
pub(super) fn parse(s: &Value, orig: usize, max_pos: usize) -> Result<RopeScaling, String> {
    let f = |k: &str| s.get(k).and_then(Value::as_f64);
    if orig == 0 {
        return Err("rope scaling `yarn`: original_max_position_embeddings is 0".into());
    }
    let factor = f("factor").unwrap_or(max_pos as f64 / orig as f64);
    if !factor.is_finite() || factor <= 0.0 {
        return Err(format!(
            "rope scaling `yarn`: factor {factor} must be a positive number"
        ));
    }
    // transformers: `beta_fast or 32`, `beta_slow or 1` (0 takes the default too)
    let beta = |k: &str, default: f64| match f(k) {
        Some(b) if b != 0.0 => b,
        _ => default,
    };
    let (beta_fast, beta_slow) = (beta("beta_fast", 32.0), beta("beta_slow", 1.0));
    if !(beta_fast.is_finite() && beta_slow.is_finite() && beta_fast > 0.0 && beta_slow > 0.0) {
        return Err(format!(
            "rope scaling `yarn`: beta_fast {beta_fast} and beta_slow {beta_slow} must be positive"
        ));
    }
    let mscale = |m: f64| match factor <= 1.0 {
        true => 1.0,
        false => 0.1 * m * factor.ln() + 1.0,
    };
    let attention_factor = match (f("attention_factor"), f("mscale"), f("mscale_all_dim")) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(m) / mscale(all),
        _ => mscale(1.0),
    };
    if !attention_factor.is_finite() || attention_factor <= 0.0 {
        return Err(format!(
            "rope scaling `yarn`: attention_factor {attention_factor} must be a positive number"
        ));
    }
    Ok(RopeScaling::Yarn {
        factor,
        beta_fast,
        beta_slow,
        original_max_position: orig,
        truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
        attention_factor,
    })
}

/// YaRN's inv_freq [dim/2] from the base θ (`theta`) and the head's `dim`; the fields of
/// `RopeScaling::Yarn` but the attention factor.
pub(super) fn inv_freq(
    theta: f64,
    dim: usize,
    [factor, beta_fast, beta_slow]: [f64; 3],
    original_max_position: usize,
    truncate: bool,
) -> Vec<f32> {
    let base = theta as f32;
    // the dimension at which a frequency turns `rot` times over the original context
    let corr = |rot: f64| {
        (dim as f64 * (original_max_position as f64 / (rot * 2.0 * std::f64::consts::PI)).ln())
            / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    if low == high {
        high += 0.001; // transformers: prevents a singularity
    }
    let (lo, span) = (low as f32, (high - low) as f32);
    (0..dim / 2)
        .map(|i| {
            let pos = base.powf((2 * i) as f32 / dim as f32);
            let (extra, inter) = (1.0 / pos, 1.0 / (factor as f32 * pos));
            let ramp = ((i as f32 - lo) / span).clamp(0.0, 1.0);
            let keep = 1.0 - ramp; // the extrapolated share
            inter * (1.0 - keep) + extra * keep
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gpt-oss-20b's rope: θ 150000, head_dim 64, factor 32, betas 32 and 1 over 4096, not
    /// truncated; values from transformers 5.25's `_compute_yarn_parameters`.
    #[test]
    fn gpt_oss_frequencies_and_factor_match_transformers() {
        let s: Value = serde_json::from_str(
            r#"{"rope_type":"yarn","factor":32.0,"beta_fast":32.0,"beta_slow":1.0,
            "original_max_position_embeddings":4096,"truncate":false}"#,
        )
        .unwrap();
        let RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position,
            truncate,
            attention_factor,
        } = parse(&s, 4096, 131072).unwrap()
        else {
            panic!("not yarn")
        };
        assert!((attention_factor - 1.3465735902799727).abs() < 1e-12);
        assert!(!truncate);
        let f = inv_freq(
            150000.0,
            64,
            [factor, beta_fast, beta_slow],
            original_max_position,
            truncate,
        );
        assert_eq!(f.len(), 32);
        for (i, want) in YARN_GPT_OSS {
            let got = f[i] as f64;
            assert!(
                (got - want).abs() <= 2e-7 * want.abs(),
                "{i}: {got} vs {want}"
            );
        }
        let bad: Value = serde_json::from_str(r#"{"rope_type":"yarn","factor":-1.0}"#).unwrap();
        assert!(parse(&bad, 4096, 4096).unwrap_err().contains("factor -1"));
        assert!(parse(&s, 0, 4096).unwrap_err().contains("is 0"));
    }

    /// (i, inv_freq[i]) of transformers for the case above.
    const YARN_GPT_OSS: [(usize, f64); 6] = [
        (0, 1.0),
        (5, 0.15532298386096954),
        (9, 0.031705696135759354),
        (14, 0.002093792660161853),
        (20, 1.818833698052913e-05),
        (31, 3.023511396804679e-07),
    ];
}
