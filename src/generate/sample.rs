//! Picking the next token from the logits: greedy, or sampled with temperature, top-k and
//! top-p (applied in that order, as transformers' logits processors are) from a seeded stream.
//!
//! Greedy takes the argmax on the device and reads back one id. Sampling reads the logits [V]
//! back (V × 4 bytes a step) and draws on the host, in f64, so that a seed repeats a run on
//! every machine.

use crate::rng::Rng;
use anyhow::{bail, Result};
use candle_core::Tensor;

/// How to pick tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0 = greedy; else the logits are divided by it before the softmax.
    pub temperature: f64,
    /// Keep the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches p (1 = all).
    pub top_p: f64,
    /// The seed of the sampling stream.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 42,
        }
    }
}

impl Sampling {
    /// Greedy decoding: the most likely token at each step.
    pub fn greedy() -> Self {
        Self::default()
    }

    pub(crate) fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The settings' ranges: temperature ≥ 0 and finite, top_p in (0, 1].
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            bail!(
                "temperature {} must be a number ≥ 0 (0 = greedy)",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p {} must be in (0, 1] (1 = off)", self.top_p);
        }
        Ok(())
    }
}

/// A sampler: the settings and the stream it draws from.
pub struct Sampler {
    pub(crate) s: Sampling,
    rng: Rng,
}

impl Sampler {
    /// A sampler for `s`; an error for settings out of range.
    pub fn new(s: Sampling) -> Result<Sampler> {
        s.check()?;
        let rng = Rng::keyed(s.seed, &[0x67656e]);
        Ok(Sampler { s, rng })
    }

    /// The next token from logits [V] f32 (on any device).
    pub(crate) fn pick(&mut self, logits: &Tensor) -> Result<u32> {
        if self.s.is_greedy() {
            return super::decoder::argmax(logits);
        }
        let v: Vec<f32> = logits.to_vec1()?;
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        Ok(draw(&v, &self.s, u))
    }
}

/// The token that uniform `u` ∈ [0, 1) lands on in the distribution `s` makes of `logits`.
pub(crate) fn draw(logits: &[f32], s: &Sampling, u: f64) -> u32 {
    let t = if s.temperature > 0.0 {
        s.temperature
    } else {
        1.0
    };
    let mut scores: Vec<(f64, u32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &x)| (x as f64 / t, i as u32))
        .filter(|(x, _)| !x.is_nan())
        .collect();
    if scores.is_empty() {
        return 0;
    }
    // Most likely first; ties by id, so that the order (and the draw) is the same everywhere.
    scores.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    if s.top_k > 0 && s.top_k < scores.len() {
        // transformers keeps every token tied with the k-th.
        let kth = scores[s.top_k - 1].0;
        let keep = scores.iter().take_while(|x| x.0 >= kth).count();
        scores.truncate(keep);
    }
    let max = scores[0].0;
    let mut p: Vec<f64> = scores.iter().map(|x| (x.0 - max).exp()).collect();
    let sum: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= sum);
    if s.top_p < 1.0 {
        // Drop the least likely tokens while what they hold together stays ≤ 1 − p
        // (transformers' rule); the most likely one always stays.
        let mut tail = 0.0;
        let mut keep = p.len();
        while keep > 1 && tail + p[keep - 1] <= 1.0 - s.top_p {
            tail += p[keep - 1];
            keep -= 1;
        }
        p.truncate(keep);
        let sum: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= sum);
    }
    let mut acc = 0.0;
    for (i, &pi) in p.iter().enumerate() {
        acc += pi;
        if u < acc {
            return scores[i].1;
        }
    }
    scores[p.len() - 1].1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(temperature: f64, top_k: usize, top_p: f64) -> Sampling {
        Sampling {
            temperature,
            top_k,
            top_p,
            seed: 1,
        }
    }

    #[test]
    fn draws_follow_the_filtered_distribution() {
        // probabilities ∝ e^x: [0.0900, 0.2447, 0.6652] for logits 0, 1, 2
        let l = [0.0f32, 1.0, 2.0];
        assert_eq!(draw(&l, &s(1.0, 0, 1.0), 0.0), 2);
        assert_eq!(draw(&l, &s(1.0, 0, 1.0), 0.70), 1);
        assert_eq!(draw(&l, &s(1.0, 0, 1.0), 0.95), 0);
        // top-k 2: token 0 is gone; the rest renormalised [0.269, 0.731]
        assert_eq!(draw(&l, &s(1.0, 2, 1.0), 0.95), 1);
        // top-p 0.6: 0.665 alone reaches it
        assert_eq!(draw(&l, &s(1.0, 0, 0.6), 0.99), 2);
        // top-p 0.9: the two most likely (0.910) are needed
        assert_eq!(draw(&l, &s(1.0, 0, 0.9), 0.99), 1);
        // a low temperature sharpens: e^(2/0.1) dominates
        assert_eq!(draw(&l, &s(0.1, 0, 1.0), 0.999), 2);
    }

    #[test]
    fn a_seed_repeats_and_the_frequencies_match() {
        let l = [0.0f32, 1.0, 2.0];
        let run = |seed| {
            let mut sm = Sampler::new(Sampling {
                seed,
                ..s(1.0, 0, 1.0)
            })
            .unwrap();
            let t = Tensor::new(&l, &candle_core::Device::Cpu).unwrap();
            (0..3000).map(|_| sm.pick(&t).unwrap()).collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7));
        assert_ne!(a, run(8));
        let f2 = a.iter().filter(|&&x| x == 2).count() as f64 / a.len() as f64;
        assert!((f2 - 0.6652).abs() < 0.03, "{f2}");
        assert!(Sampling {
            top_p: 0.0,
            ..s(1.0, 0, 1.0)
        }
        .check()
        .is_err());
        assert!(Sampling {
            temperature: -1.0,
            ..s(1.0, 0, 1.0)
        }
        .check()
        .is_err());
    }
}
