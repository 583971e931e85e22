//! Preference objectives on sequence log-probabilities: DPO (sigmoid, ipo, hinge), ORPO, SimPO
//! and KTO with TRL 1.16's formulas, each giving the micro-batch's loss, dL/d(each sequence's
//! summed completion log-probability) and TRL's metrics.
//!
//! The head turns these into per-token weights: every scored completion token of sequence i
//! gets `d_chosen[i]` (or `d_rejected[i]`) as dL/d(its log-probability); ORPO's NLL also scores
//! the chosen sequences' prompt tokens, each with `d_chosen_prompt`.
//!
//! The inputs are a micro-batch's few sequence-level values (2N numbers for N pairs), read to
//! the host and computed in f64 with `ln_1p` / `exp_m1` (ORPO's log(1 - p) near p = 1 needs
//! them); the gradients go back as tensors on the inputs' device, in their dtype.
//!
//! Where each formula comes from (TRL 1.16, checked by scripts/reference_pref.py against TRL's
//! trainers): DPO trl/trainer/dpo_trainer.py `_compute_loss`; ORPO
//! trl/experimental/orpo/orpo_trainer.py `odds_ratio_loss`, `concatenated_forward`,
//! `get_batch_loss_metrics`; SimPO trl/experimental/cpo/cpo_trainer.py `cpo_loss` (loss_type
//! "simpo"). KTO is in [`super::kto_loss`].
//!
//! The loss is the micro-batch's mean over pairs (KTO: over examples), as TRL's; gradient
//! accumulation and ranks scale it as they do for any mean loss (TRL divides by the
//! accumulation steps).

use candle_core::{bail, DType, Device, Result, Tensor};

/// DPO's loss on the reward margin (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DpoLoss {
    /// -log σ(β Δ), Δ = (π_c - ref_c) - (π_r - ref_r).
    Sigmoid,
    /// (Δ_c / n_c - Δ_r / n_r - 1 / 2β)², the log-ratios averaged over the completion tokens.
    Ipo,
    /// max(0, 1 - β Δ).
    Hinge,
}

/// A paired objective and its settings (TRL's names in the comments).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PairObjective {
    /// DPO against a reference: `beta`, `loss_type`.
    Dpo {
        /// β: the temperature of the implicit reward.
        beta: f64,
        /// The loss on the reward margin (`loss_type`).
        loss: DpoLoss,
    },
    /// ORPO: NLL of the chosen sequences minus β × mean log σ(log odds ratio).
    Orpo {
        /// β: the weight of the odds-ratio term.
        beta: f64,
    },
    /// SimPO (CPO's loss_type "simpo"): -log σ(β (mean π_c - mean π_r) - γ), plus `cpo_alpha`
    /// × the NLL of the chosen completions (0: pure SimPO).
    Simpo {
        /// β: the scale of the length-normalised margin.
        beta: f64,
        /// γ: the target reward margin.
        gamma: f64,
        /// The weight of the chosen completions' NLL (0: pure SimPO).
        cpo_alpha: f64,
    },
}

/// One micro-batch of N pairs: the sequence-level inputs of a paired objective.
#[derive(Debug, Clone, Copy)]
pub struct PairLogps<'a> {
    /// [N] Σ log p over each chosen completion's tokens, under the policy.
    pub chosen: &'a Tensor,
    /// [N] the same for the rejected completions.
    pub rejected: &'a Tensor,
    /// [N] the reference's sums (DPO only).
    pub ref_chosen: Option<&'a Tensor>,
    /// [N] the reference's sums for the rejected completions (DPO only).
    pub ref_rejected: Option<&'a Tensor>,
    /// [N] ORPO: Σ log p over each chosen sequence's scored prompt tokens (positions 1.. of the
    /// prompt: its first token is never predicted), under the policy.
    pub chosen_prompt: Option<&'a Tensor>,
    /// Completion tokens of each chosen sequence (each scored: the prompt is never empty).
    pub chosen_len: &'a [usize],
    /// Completion tokens of each rejected sequence.
    pub rejected_len: &'a [usize],
    /// Prompt tokens of each pair (ORPO's NLL scores `prompt_len - 1` of them).
    pub prompt_len: &'a [usize],
}

/// A metric as TRL logs it: its name ("rewards/chosen", ...) and the micro-batch's value.
pub type Metric = (&'static str, f64);

/// A paired objective's result for one micro-batch.
#[derive(Debug, Clone)]
pub struct PairLoss {
    /// The micro-batch's loss (mean over its pairs).
    pub loss: f64,
    /// [N] dL/d(chosen[i]): the weight of each scored token of chosen completion i (ORPO and
    /// SimPO's NLL part included), on the inputs' device and dtype.
    pub d_chosen: Tensor,
    /// [N] dL/d(rejected[i]).
    pub d_rejected: Tensor,
    /// ORPO: dL/d(log p) of each scored prompt token of a chosen sequence (-1 / NLL tokens);
    /// 0 for the others.
    pub d_chosen_prompt: f64,
    /// TRL's metrics for this micro-batch, in TRL's order.
    pub metrics: Vec<Metric>,
}

/// The values of a 1-D tensor, as f64 on the host.
pub(crate) fn host(t: &Tensor, n: usize, what: &str) -> Result<Vec<f64>> {
    let v = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    if v.len() != n {
        bail!("pref_loss: {what} has {} values, expected {n}", v.len());
    }
    Ok(v)
}

/// `v` as a tensor like `like` (device, dtype).
pub(crate) fn like(v: Vec<f64>, like: &Tensor) -> Result<Tensor> {
    let n = v.len();
    Tensor::from_vec(v, n, &Device::Cpu)?
        .to_dtype(like.dtype())?
        .to_device(like.device())
}

/// σ(x), without overflow.
pub fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// log σ(x) = min(x, 0) - ln(1 + e^-|x|), as torch's logsigmoid.
pub fn log_sigmoid(x: f64) -> f64 {
    x.min(0.0) - (-x.abs()).exp().ln_1p()
}

/// log(1 - e^x) for x < 0, branching at -ln 2 as TRL's `log1mexp`.
pub fn log1mexp(x: f64) -> f64 {
    if x < -std::f64::consts::LN_2 {
        (-x.exp()).ln_1p()
    } else {
        (-x.exp_m1()).ln()
    }
}

/// d/dx log(1 - e^x) = -1 / (e^-x - 1).
fn d_log1mexp(x: f64) -> f64 {
    -1.0 / (-x).exp_m1()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// The reward metrics every paired objective logs: rewards/{chosen, rejected, accuracies,
/// margins} from the per-pair rewards, logps/{chosen, rejected} from `logps`.
fn reward_metrics(rc: &[f64], rr: &[f64], lc: &[f64], lr: &[f64]) -> Vec<Metric> {
    let acc: Vec<f64> = rc.iter().zip(rr).map(|(a, b)| f64::from(a > b)).collect();
    let margins: Vec<f64> = rc.iter().zip(rr).map(|(a, b)| a - b).collect();
    vec![
        ("rewards/chosen", mean(rc)),
        ("rewards/rejected", mean(rr)),
        ("rewards/accuracies", mean(&acc)),
        ("rewards/margins", mean(&margins)),
        ("logps/chosen", mean(lc)),
        ("logps/rejected", mean(lr)),
    ]
}

/// A paired objective on one micro-batch: loss, gradients, metrics.
pub fn pair_loss(obj: PairObjective, x: &PairLogps) -> Result<PairLoss> {
    let n = x.chosen_len.len();
    if n == 0 || x.rejected_len.len() != n || x.prompt_len.len() != n {
        bail!(
            "pref_loss: {n} chosen, {} rejected and {} prompt lengths (one each per pair, at least one pair)",
            x.rejected_len.len(),
            x.prompt_len.len()
        );
    }
    if x.chosen_len.iter().chain(x.rejected_len).any(|&l| l == 0) {
        bail!("pref_loss: a completion with no tokens");
    }
    let pc = host(x.chosen, n, "chosen")?;
    let pr = host(x.rejected, n, "rejected")?;
    let lc: Vec<f64> = x.chosen_len.iter().map(|&l| l as f64).collect();
    let lr: Vec<f64> = x.rejected_len.iter().map(|&l| l as f64).collect();
    let (loss, dc, dr, dp, metrics) = match obj {
        PairObjective::Dpo { beta, loss } => {
            let (Some(rc), Some(rr)) = (x.ref_chosen, x.ref_rejected) else {
                bail!("pref_loss: DPO needs the reference's log-probabilities");
            };
            let rc = host(rc, n, "ref_chosen")?;
            let rr = host(rr, n, "ref_rejected")?;
            let (l, dc, dr, m) = dpo(beta, loss, &pc, &pr, &rc, &rr, &lc, &lr);
            (l, dc, dr, 0.0, m)
        }
        PairObjective::Orpo { beta } => {
            let Some(pp) = x.chosen_prompt else {
                bail!("pref_loss: ORPO needs the chosen sequences' prompt log-probabilities");
            };
            let pp = host(pp, n, "chosen_prompt")?;
            orpo(beta, &pc, &pr, &pp, &lc, &lr, x.prompt_len)
        }
        PairObjective::Simpo {
            beta,
            gamma,
            cpo_alpha,
        } => {
            let (l, dc, dr, m) = simpo(beta, gamma, cpo_alpha, &pc, &pr, &lc, &lr);
            (l, dc, dr, 0.0, m)
        }
    };
    Ok(PairLoss {
        loss,
        d_chosen: like(dc, x.chosen)?,
        d_rejected: like(dr, x.rejected)?,
        d_chosen_prompt: dp,
        metrics,
    })
}

type Grads = (f64, Vec<f64>, Vec<f64>, Vec<Metric>);

/// DPO (dpo_trainer.py `_compute_loss`, f_divergence "reverse_kl"): per pair Δ = Δ_c - Δ_r,
/// Δ_c = π_c - ref_c, Δ_r = π_r - ref_r; sigmoid -log σ(βΔ); hinge relu(1 - βΔ); ipo
/// (Δ_c / max(n_c, 1) - Δ_r / max(n_r, 1) - 1 / 2β)²; the mean over pairs. Rewards β(π - ref);
/// logps the policy's sums.
#[allow(clippy::too_many_arguments)]
fn dpo(
    beta: f64,
    kind: DpoLoss,
    pc: &[f64],
    pr: &[f64],
    rc: &[f64],
    rr: &[f64],
    lc: &[f64],
    lr: &[f64],
) -> Grads {
    let n = pc.len() as f64;
    let (mut loss, mut dc, mut dr) = (0.0, Vec::new(), Vec::new());
    for i in 0..pc.len() {
        let (cl, rl) = (pc[i] - rc[i], pr[i] - rr[i]);
        let delta = cl - rl;
        let (l, gc, gr) = match kind {
            DpoLoss::Sigmoid => {
                let g = -beta * sigmoid(-beta * delta);
                (-log_sigmoid(beta * delta), g, -g)
            }
            DpoLoss::Hinge => {
                let h = 1.0 - beta * delta;
                let g = if h > 0.0 { -beta } else { 0.0 };
                (h.max(0.0), g, -g)
            }
            DpoLoss::Ipo => {
                let (nc, nr) = (lc[i].max(1.0), lr[i].max(1.0));
                let d = cl / nc - rl / nr - 1.0 / (2.0 * beta);
                (d * d, 2.0 * d / nc, -2.0 * d / nr)
            }
        };
        loss += l / n;
        dc.push(gc / n);
        dr.push(gr / n);
    }
    let rew_c: Vec<f64> = pc.iter().zip(rc).map(|(p, r)| beta * (p - r)).collect();
    let rew_r: Vec<f64> = pr.iter().zip(rr).map(|(p, r)| beta * (p - r)).collect();
    (loss, dc, dr, reward_metrics(&rew_c, &rew_r, pc, pr))
}

/// ORPO (orpo_trainer.py): a = the mean log-prob of each completion; log odds = (a_c - a_r) -
/// (log(1 - e^a_c) - log(1 - e^a_r)); loss = NLL - β mean log σ(log odds), the NLL the mean
/// -log p over every scored token of the chosen sequences, prompt included (TRL's
/// `concatenated_forward`: labels are the ids wherever the attention mask is 1). Rewards β a;
/// logps the means a.
fn orpo(
    beta: f64,
    pc: &[f64],
    pr: &[f64],
    pp: &[f64],
    lc: &[f64],
    lr: &[f64],
    prompt_len: &[usize],
) -> (f64, Vec<f64>, Vec<f64>, f64, Vec<Metric>) {
    let n = pc.len() as f64;
    let ac: Vec<f64> = pc.iter().zip(lc).map(|(s, l)| s / l).collect();
    let ar: Vec<f64> = pr.iter().zip(lr).map(|(s, l)| s / l).collect();
    let nll_tokens: f64 = lc.iter().sum::<f64>()
        + prompt_len
            .iter()
            .map(|&p| p.saturating_sub(1) as f64)
            .sum::<f64>();
    let nll = -(pc.iter().sum::<f64>() + pp.iter().sum::<f64>()) / nll_tokens;
    let d_nll = -1.0 / nll_tokens;
    let (mut ratio_sum, mut odds_sum, mut dc, mut dr) = (0.0, 0.0, Vec::new(), Vec::new());
    for i in 0..pc.len() {
        let lo = (ac[i] - ar[i]) - (log1mexp(ac[i]) - log1mexp(ar[i]));
        ratio_sum += log_sigmoid(lo);
        odds_sum += lo;
        // loss = nll - β/N Σ log σ(lo): d/d lo = -β/N σ(-lo)
        let g = -beta / n * sigmoid(-lo);
        dc.push(g * (1.0 - d_log1mexp(ac[i])) / lc[i] + d_nll);
        dr.push(g * (-1.0 + d_log1mexp(ar[i])) / lr[i]);
    }
    let loss = nll - beta * ratio_sum / n;
    let rew_c: Vec<f64> = ac.iter().map(|a| beta * a).collect();
    let rew_r: Vec<f64> = ar.iter().map(|a| beta * a).collect();
    let mut m = reward_metrics(&rew_c, &rew_r, &ac, &ar);
    m.push(("nll_loss", nll));
    m.push(("log_odds_ratio", ratio_sum / n));
    m.push(("log_odds_chosen", odds_sum / n));
    (loss, dc, dr, d_nll, m)
}

/// SimPO (cpo_trainer.py `cpo_loss`, loss_type "simpo", label_smoothing 0, alpha 0): a = the
/// mean log-prob of each completion; -log σ(β (a_c - a_r) - γ), the mean over pairs, plus
/// cpo_alpha × the NLL of the chosen completion tokens. Rewards β a; logps the means a.
fn simpo(
    beta: f64,
    gamma: f64,
    cpo_alpha: f64,
    pc: &[f64],
    pr: &[f64],
    lc: &[f64],
    lr: &[f64],
) -> Grads {
    let n = pc.len() as f64;
    let ac: Vec<f64> = pc.iter().zip(lc).map(|(s, l)| s / l).collect();
    let ar: Vec<f64> = pr.iter().zip(lr).map(|(s, l)| s / l).collect();
    let tokens: f64 = lc.iter().sum();
    let (nll, d_nll) = match cpo_alpha != 0.0 {
        true => (-pc.iter().sum::<f64>() / tokens, -cpo_alpha / tokens),
        false => (0.0, 0.0),
    };
    let (mut loss, mut dc, mut dr) = (cpo_alpha * nll, Vec::new(), Vec::new());
    for i in 0..pc.len() {
        // TRL: logits = (a_c - a_r) - γ/β, then β × logits
        let z = beta * ((ac[i] - ar[i]) - gamma / beta);
        loss -= log_sigmoid(z) / n;
        let g = -sigmoid(-z) / n * beta;
        dc.push(g / lc[i] + d_nll);
        dr.push(-g / lr[i]);
    }
    let rew_c: Vec<f64> = ac.iter().map(|a| beta * a).collect();
    let rew_r: Vec<f64> = ar.iter().map(|a| beta * a).collect();
    let mut m = reward_metrics(&rew_c, &rew_r, &ac, &ar);
    m.push(("nll_loss", nll));
    (loss, dc, dr, m)
}

/// TRL's logged value of each metric over a logging interval: the mean of the micro-batch
/// values that reported it (KTO leaves out rewards of a kind a micro-batch did not have).
#[derive(Debug, Clone, Default)]
pub struct MetricMeans {
    sums: Vec<(&'static str, f64, usize)>,
}

impl MetricMeans {
    /// Adds one micro-batch's metrics.
    pub fn add(&mut self, metrics: &[Metric]) {
        for &(name, v) in metrics {
            match self.sums.iter_mut().find(|(n, ..)| *n == name) {
                Some(e) => {
                    e.1 += v;
                    e.2 += 1;
                }
                None => self.sums.push((name, v, 1)),
            }
        }
    }

    /// Each metric's mean, in first-seen order; then empty for the next interval.
    pub fn take(&mut self) -> Vec<Metric> {
        std::mem::take(&mut self.sums)
            .into_iter()
            .map(|(n, s, c)| (n, s / c as f64))
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! Against scripts/reference_pref.py's fixtures (tests/fixtures/pref/<case>/meta.json: per
    //! step the sequence-level inputs, TRL's loss and metrics, and dL/d(input) by autograd, all
    //! f64) and against central differences in f64.
    use super::*;
    use serde_json::Value;

    pub(crate) fn meta(case: &str) -> Value {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/pref")
            .join(case)
            .join("meta.json");
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
    }

    pub(crate) fn f(v: &Value) -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    }

    pub(crate) fn t(v: &[f64]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    fn lens(v: &Value) -> Vec<usize> {
        f(v).iter().map(|&x| x as usize).collect()
    }

    pub(crate) fn close(what: &str, got: f64, want: f64, tol: f64) {
        let err = (got - want).abs() / want.abs().max(1.0);
        assert!(err <= tol, "{what}: {got} vs {want} (rel {err:.2e})");
    }

    pub(crate) fn vec_of(t: &Tensor) -> Vec<f64> {
        t.to_vec1::<f64>().unwrap()
    }

    /// Every metric TRL logged for the step, by name, equal to ours (and none missing).
    pub(crate) fn same_metrics(case: &str, s: usize, ours: &[Metric], want: &Value) {
        let want = want.as_object().unwrap();
        assert_eq!(
            ours.len(),
            want.len(),
            "{case} step {s}: {ours:?} vs {want:?}"
        );
        for (name, v) in ours {
            let w = want[*name].as_f64().unwrap();
            close(&format!("{case} step {s} {name}"), *v, w, 1e-10);
        }
    }

    fn paired(case: &str, obj: PairObjective) {
        let m = meta(case);
        let steps = m["steps"].as_array().unwrap();
        assert_eq!(steps.len(), 6);
        for (s, r) in steps.iter().enumerate() {
            let (pc, pr) = (f(&r["policy_chosen"]), f(&r["policy_rejected"]));
            let (lc, lr, lp) = (
                lens(&r["chosen_len"]),
                lens(&r["rejected_len"]),
                lens(&r["prompt_len"]),
            );
            let refs = r.get("reference_chosen").map(|_| {
                (
                    t(&f(&r["reference_chosen"])),
                    t(&f(&r["reference_rejected"])),
                )
            });
            // ORPO's record has Σ log p over all scored chosen tokens: the prompt's part is
            // that minus the completion's.
            let prompt: Option<Tensor> = r.get("chosen_all").map(|all| {
                let all = f(all);
                t(&all.iter().zip(&pc).map(|(a, c)| a - c).collect::<Vec<_>>())
            });
            let (tc, tr) = (t(&pc), t(&pr));
            let x = PairLogps {
                chosen: &tc,
                rejected: &tr,
                ref_chosen: refs.as_ref().map(|r| &r.0),
                ref_rejected: refs.as_ref().map(|r| &r.1),
                chosen_prompt: prompt.as_ref(),
                chosen_len: &lc,
                rejected_len: &lr,
                prompt_len: &lp,
            };
            let out = pair_loss(obj, &x).unwrap();
            close(
                &format!("{case} step {s} loss"),
                out.loss,
                r["loss"].as_f64().unwrap(),
                1e-12,
            );
            let mut want_c = f(&r["grad_policy_chosen"]);
            if let Some(g) = r.get("grad_chosen_all") {
                // the NLL's gradient reaches the completion tokens through chosen_all
                let g = f(g);
                want_c.iter_mut().zip(&g).for_each(|(w, a)| *w += a);
                for a in &g {
                    close(
                        &format!("{case} step {s} d prompt"),
                        out.d_chosen_prompt,
                        *a,
                        1e-12,
                    );
                }
            } else {
                assert_eq!(out.d_chosen_prompt, 0.0);
            }
            let pairs = [
                (vec_of(&out.d_chosen), want_c),
                (vec_of(&out.d_rejected), f(&r["grad_policy_rejected"])),
            ];
            for (got, want) in pairs {
                for (g, w) in got.iter().zip(&want) {
                    close(&format!("{case} step {s} grad"), *g, *w, 1e-12);
                }
            }
            same_metrics(case, s, &out.metrics, &m["metrics"][s]);
            let loss = m["train_losses"][s].as_f64().unwrap();
            close(
                &format!("{case} step {s} train loss"),
                out.loss,
                loss,
                1e-12,
            );
        }
    }

    #[test]
    fn dpo_sigmoid_matches_trl_formulas() {
        let beta = meta("dpo_sigmoid")["objective"]["beta"].as_f64().unwrap();
        paired(
            "dpo_sigmoid",
            PairObjective::Dpo {
                beta,
                loss: DpoLoss::Sigmoid,
            },
        );
        paired(
            "dpo_ref_init",
            PairObjective::Dpo {
                beta: 0.1,
                loss: DpoLoss::Sigmoid,
            },
        );
    }

    #[test]
    fn dpo_ipo_and_hinge_match_trl_formulas() {
        paired(
            "dpo_ipo",
            PairObjective::Dpo {
                beta: 0.5,
                loss: DpoLoss::Ipo,
            },
        );
        paired(
            "dpo_hinge",
            PairObjective::Dpo {
                beta: 0.1,
                loss: DpoLoss::Hinge,
            },
        );
    }

    #[test]
    fn orpo_matches_trl_formulas() {
        paired("orpo", PairObjective::Orpo { beta: 0.1 });
    }

    #[test]
    fn simpo_matches_trl_formulas() {
        let o = &meta("simpo")["objective"];
        let obj = PairObjective::Simpo {
            beta: o["beta"].as_f64().unwrap(),
            gamma: o["gamma"].as_f64().unwrap(),
            cpo_alpha: o["cpo_alpha"].as_f64().unwrap(),
        };
        assert_eq!(
            obj,
            PairObjective::Simpo {
                beta: 2.0,
                gamma: 0.5,
                cpo_alpha: 0.0
            }
        );
        paired("simpo", obj);
    }

    /// Pairs with the log-prob sums of completions of these lengths, spread around typical
    /// values, for the finite-difference checks.
    fn random_pairs(n: usize, seed: u64) -> Vec<[f64; 5]> {
        let mut rng = crate::rng::Rng::keyed(seed, &[]);
        (0..n)
            .map(|_| {
                let mut u = || rng.next_f32() as f64;
                let (lc, lr) = (1.0 + (u() * 8.0).floor(), 1.0 + (u() * 8.0).floor());
                // mean log-probs in (-6, -0.01): ORPO's log(1 - p) on both branches
                let ac = -0.01 - 6.0 * u() * u();
                let ar = -0.01 - 6.0 * u() * u();
                [ac * lc, ar * lr, lc, lr, -3.0 * u()]
            })
            .collect()
    }

    fn fd_check(obj: PairObjective, seed: u64) {
        let pairs = random_pairs(5, seed);
        let n = pairs.len();
        let col = |k: usize| pairs.iter().map(|p| p[k]).collect::<Vec<f64>>();
        let (lc, lr): (Vec<usize>, Vec<usize>) = (
            col(2).iter().map(|&x| x as usize).collect(),
            col(3).iter().map(|&x| x as usize).collect(),
        );
        let lp = vec![4usize; n];
        let refc: Vec<f64> = col(0).iter().map(|x| x + 0.3).collect();
        let refr: Vec<f64> = col(1).iter().map(|x| x - 0.2).collect();
        // [chosen, rejected, prompt] sums
        let eval = |v: &[Vec<f64>; 3]| {
            let (a, b, c, d, e) = (t(&v[0]), t(&v[1]), t(&v[2]), t(&refc), t(&refr));
            let x = PairLogps {
                chosen: &a,
                rejected: &b,
                ref_chosen: Some(&d),
                ref_rejected: Some(&e),
                chosen_prompt: Some(&c),
                chosen_len: &lc,
                rejected_len: &lr,
                prompt_len: &lp,
            };
            pair_loss(obj, &x).unwrap()
        };
        let base = [col(0), col(1), col(4)];
        let out = eval(&base);
        let h = 1e-6;
        for which in 0..3 {
            for i in 0..n {
                let (mut up, mut dn) = (base.clone(), base.clone());
                up[which][i] += h;
                dn[which][i] -= h;
                let fd = (eval(&up).loss - eval(&dn).loss) / (2.0 * h);
                let an = match which {
                    0 => vec_of(&out.d_chosen)[i],
                    1 => vec_of(&out.d_rejected)[i],
                    _ => out.d_chosen_prompt,
                };
                assert!(
                    (fd - an).abs() <= 1e-6 * an.abs() + 1e-8,
                    "{obj:?} input {which}[{i}]: finite difference {fd} vs {an}"
                );
            }
        }
    }

    #[test]
    fn paired_gradients_equal_finite_differences() {
        for (k, loss) in [DpoLoss::Sigmoid, DpoLoss::Ipo, DpoLoss::Hinge]
            .into_iter()
            .enumerate()
        {
            fd_check(PairObjective::Dpo { beta: 0.3, loss }, k as u64);
        }
        fd_check(PairObjective::Orpo { beta: 0.25 }, 7);
        fd_check(
            PairObjective::Simpo {
                beta: 2.0,
                gamma: 0.5,
                cpo_alpha: 0.0,
            },
            8,
        );
        fd_check(
            PairObjective::Simpo {
                beta: 2.5,
                gamma: 1.4,
                cpo_alpha: 0.7,
            },
            9,
        );
    }

    #[test]
    fn stable_where_naive_formulas_overflow() {
        assert_eq!(log_sigmoid(-800.0), -800.0);
        assert_eq!(log_sigmoid(800.0), 0.0);
        assert!((sigmoid(-800.0)).abs() < 1e-300 && sigmoid(800.0) == 1.0);
        // log(1 - e^x) near x = 0: ln(-expm1(x)) keeps the digits that ln(1 - e^x) loses
        let x = -1e-12;
        assert!((log1mexp(x) - (1e-12f64).ln()).abs() < 1e-9);
        assert!((log1mexp(-30.0) + (-30.0f64).exp()).abs() < 1e-25);
    }

    #[test]
    fn metric_means_average_only_the_micro_batches_that_reported() {
        let mut m = MetricMeans::default();
        m.add(&[("kl", 1.0), ("rewards/chosen", 2.0)]);
        m.add(&[("kl", 3.0)]);
        assert_eq!(m.take(), vec![("kl", 2.0), ("rewards/chosen", 2.0)]);
        assert!(m.take().is_empty());
    }

    #[test]
    fn refusals_name_what_is_missing() {
        let a = t(&[-1.0]);
        let x = PairLogps {
            chosen: &a,
            rejected: &a,
            ref_chosen: None,
            ref_rejected: None,
            chosen_prompt: None,
            chosen_len: &[1],
            rejected_len: &[1],
            prompt_len: &[1],
        };
        let dpo = PairObjective::Dpo {
            beta: 0.1,
            loss: DpoLoss::Sigmoid,
        };
        assert!(pair_loss(dpo, &x)
            .unwrap_err()
            .to_string()
            .contains("reference"));
        let orpo = PairObjective::Orpo { beta: 0.1 };
        assert!(pair_loss(orpo, &x)
            .unwrap_err()
            .to_string()
            .contains("prompt"));
        let bad = PairLogps {
            chosen_len: &[0],
            ..x
        };
        let simpo = PairObjective::Simpo {
            beta: 2.0,
            gamma: 0.5,
            cpo_alpha: 0.0,
        };
        assert!(pair_loss(simpo, &bad)
            .unwrap_err()
            .to_string()
            .contains("no tokens"));
        let short = PairLogps {
            rejected_len: &[],
            ..x
        };
        assert!(pair_loss(simpo, &short).is_err());
    }

    #[test]
    fn gradients_come_back_on_the_inputs_dtype() {
        let a = Tensor::new(&[-4.0f32, -6.0], &Device::Cpu).unwrap();
        let b = Tensor::new(&[-5.0f32, -2.0], &Device::Cpu).unwrap();
        let x = PairLogps {
            chosen: &a,
            rejected: &b,
            ref_chosen: Some(&b),
            ref_rejected: Some(&a),
            chosen_prompt: None,
            chosen_len: &[2, 3],
            rejected_len: &[2, 2],
            prompt_len: &[3, 3],
        };
        let out = pair_loss(
            PairObjective::Dpo {
                beta: 0.1,
                loss: DpoLoss::Sigmoid,
            },
            &x,
        )
        .unwrap();
        assert_eq!(out.d_chosen.dtype(), DType::F32);
        assert_eq!(out.d_chosen.dims(), &[2]);
    }
}
