//! KTO on sequence log-probabilities with TRL 1.16's formula (trl/trainer/kto_trainer.py
//! `_compute_loss`, loss_type "kto"): the micro-batch's loss, dL/d(each example's summed
//! completion log-probability) and TRL's metrics. The KL estimate from mismatched pairs is a
//! constant of the loss, as there (computed without a graph and detached).

use super::pref_loss::{host, like, sigmoid, Metric};
use candle_core::{bail, Result, Tensor};

/// One micro-batch of B unpaired KTO examples.
#[derive(Debug, Clone, Copy)]
pub struct KtoLogps<'a> {
    /// [B] Σ log p over each completion's tokens, under the policy.
    pub policy: &'a Tensor,
    /// [B] the reference's sums.
    pub reference: &'a Tensor,
    /// Per example: desirable (TRL's label true) or not.
    pub desirable: &'a [bool],
    /// The KL estimate: [`kto_kl`] of the micro-batch's mismatched pairs, averaged over the
    /// ranks (TRL gathers it) and not yet clamped.
    pub kl: f64,
}

/// KTO's settings (TRL's `beta`, `desirable_weight`, `undesirable_weight`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Kto {
    /// β.
    pub beta: f64,
    /// Weight of the desirable examples' losses.
    pub desirable_weight: f64,
    /// Weight of the undesirable examples' losses.
    pub undesirable_weight: f64,
}

/// KTO's result for one micro-batch.
#[derive(Debug, Clone)]
pub struct KtoLoss {
    /// The micro-batch's loss (mean over its examples).
    pub loss: f64,
    /// [B] dL/d(policy[i]), on the inputs' device and dtype (the KL term is a constant).
    pub d_policy: Tensor,
    /// TRL's metrics: kl, then rewards/logps of the kinds present, then rewards/margins.
    pub metrics: Vec<Metric>,
}

/// KTO's KL estimate of one micro-batch (kto_trainer.py): the mean of policy - reference over
/// its mismatched (prompt, other completion) pairs, both summed over the completion tokens.
/// Average it over the ranks before [`kto_loss`] (which clamps it at 0).
pub fn kto_kl(policy: &Tensor, reference: &Tensor) -> Result<f64> {
    let n = policy.elem_count();
    let p = host(policy, n, "KL policy")?;
    let r = host(reference, n, "KL reference")?;
    Ok(p.iter().zip(&r).map(|(a, b)| a - b).sum::<f64>() / n.max(1) as f64)
}

/// KTO (kto_trainer.py `_compute_loss`, loss_type "kto"): kl = max(kl, 0), a constant; per
/// desirable example w_d (1 - σ(β(π - ref - kl))), per undesirable one w_u (1 - σ(β(kl - (π -
/// ref)))); the mean over all examples. Rewards β(π - ref) averaged over each kind present.
pub fn kto_loss(k: Kto, x: &KtoLogps) -> Result<KtoLoss> {
    let b = x.desirable.len();
    if b == 0 {
        bail!("pref_loss: a KTO micro-batch with no examples");
    }
    let pol = host(x.policy, b, "policy")?;
    let refs = host(x.reference, b, "reference")?;
    let kl = x.kl.max(0.0);
    let (mut loss, mut d) = (0.0, Vec::with_capacity(b));
    let (mut rew, mut lps) = ([0.0; 2], [0.0; 2]); // [desirable, undesirable] sums
    let mut count = [0usize; 2];
    for i in 0..b {
        let ratio = pol[i] - refs[i];
        let (w, u, sign, kind) = match x.desirable[i] {
            true => (k.desirable_weight, k.beta * (ratio - kl), 1.0, 0),
            false => (k.undesirable_weight, k.beta * (kl - ratio), -1.0, 1),
        };
        let s = sigmoid(u);
        loss += w * (1.0 - s) / b as f64;
        // d/dπ of w (1 - σ(u)) = -w σ(u) (1 - σ(u)) du/dπ, du/dπ = ±β
        d.push(-w * s * (1.0 - s) * sign * k.beta / b as f64);
        rew[kind] += k.beta * ratio;
        lps[kind] += pol[i];
        count[kind] += 1;
    }
    let mut metrics = vec![("kl", kl)];
    let names = [
        ("rewards/chosen", "logps/chosen"),
        ("rewards/rejected", "logps/rejected"),
    ];
    for (kind, (r, l)) in names.into_iter().enumerate() {
        if count[kind] > 0 {
            metrics.push((r, rew[kind] / count[kind] as f64));
            metrics.push((l, lps[kind] / count[kind] as f64));
        }
    }
    if count[0] > 0 && count[1] > 0 {
        metrics.push((
            "rewards/margins",
            rew[0] / count[0] as f64 - rew[1] / count[1] as f64,
        ));
    }
    Ok(KtoLoss {
        loss,
        d_policy: like(d, x.policy)?,
        metrics,
    })
}

#[cfg(test)]
mod tests {
    //! Against scripts/reference_pref.py's kto fixture and central differences in f64.
    use super::*;
    use crate::train::pref_loss::tests::{close, f, meta, same_metrics, t, vec_of};

    #[test]
    fn kto_matches_trl_formulas() {
        let m = meta("kto");
        let o = &m["objective"];
        let k = Kto {
            beta: o["beta"].as_f64().unwrap(),
            desirable_weight: o["desirable_weight"].as_f64().unwrap(),
            undesirable_weight: o["undesirable_weight"].as_f64().unwrap(),
        };
        assert_eq!(k.undesirable_weight, 1.5);
        for (s, r) in m["steps"].as_array().unwrap().iter().enumerate() {
            let labels: Vec<bool> = r["label"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_bool().unwrap())
                .collect();
            let kl = kto_kl(&t(&f(&r["kl_policy"])), &t(&f(&r["kl_reference"]))).unwrap();
            let (p, rf) = (t(&f(&r["policy"])), t(&f(&r["reference"])));
            let x = KtoLogps {
                policy: &p,
                reference: &rf,
                desirable: &labels,
                kl,
            };
            let out = kto_loss(k, &x).unwrap();
            close(
                &format!("kto step {s} loss"),
                out.loss,
                r["loss"].as_f64().unwrap(),
                1e-12,
            );
            for (g, w) in vec_of(&out.d_policy).iter().zip(&f(&r["grad_policy"])) {
                close(&format!("kto step {s} grad"), *g, *w, 1e-12);
            }
            same_metrics("kto", s, &out.metrics, &m["metrics"][s]);
        }
    }

    #[test]
    fn kto_gradient_equals_finite_differences_and_kl_is_constant() {
        let k = Kto {
            beta: 0.4,
            desirable_weight: 1.3,
            undesirable_weight: 0.8,
        };
        let labels = [true, false, false, true, true];
        let pol = vec![-12.0, -3.5, -20.25, -7.0, -1.5];
        let refs = vec![-11.0, -4.0, -19.0, -8.5, -1.25];
        let eval = |p: &[f64], kl: f64| {
            let (a, b) = (t(p), t(&refs));
            kto_loss(
                k,
                &KtoLogps {
                    policy: &a,
                    reference: &b,
                    desirable: &labels,
                    kl,
                },
            )
            .unwrap()
        };
        for kl in [0.7, -0.4] {
            let out = eval(&pol, kl);
            let an = vec_of(&out.d_policy);
            for i in 0..pol.len() {
                let (mut up, mut dn) = (pol.clone(), pol.clone());
                up[i] += 1e-6;
                dn[i] -= 1e-6;
                let fd = (eval(&up, kl).loss - eval(&dn, kl).loss) / 2e-6;
                assert!(
                    (fd - an[i]).abs() <= 1e-8,
                    "kto [{i}] kl {kl}: {fd} vs {}",
                    an[i]
                );
            }
            // a negative estimate is clamped at 0 (the kl metric too)
            assert_eq!(out.metrics[0], ("kl", kl.max(0.0)));
        }
    }
}
