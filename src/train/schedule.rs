//! Learning-rate schedules, as transformers' `get_*_schedule_with_warmup`: the optimiser step
//! with index s (0-based) uses lr · f(s). Warmup rises linearly from 0; linear and cosine
//! decay reach 0 at s = total.

use crate::recipe::Schedule;

pub(crate) fn lr_factor(kind: Schedule, step: usize, total: usize, warmup: usize) -> f64 {
    if step < warmup {
        return step as f64 / warmup.max(1) as f64;
    }
    let progress = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
    match kind {
        Schedule::Constant => 1.0,
        Schedule::Linear => (1.0 - progress).max(0.0),
        Schedule::Cosine => (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_transformers_schedules() {
        // get_cosine_schedule_with_warmup(warmup=2, total=10): [0, .5, 1, .9619, .8536, ...]
        let c: Vec<f64> = (0..10)
            .map(|s| lr_factor(Schedule::Cosine, s, 10, 2))
            .collect();
        let want = [
            0.0, 0.5, 1.0, 0.961940, 0.853553, 0.691342, 0.5, 0.308658, 0.146447, 0.038060,
        ];
        for (a, b) in c.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{c:?}");
        }
        // get_linear_schedule_with_warmup(warmup=1, total=5): [0, 1, .75, .5, .25]
        let l: Vec<f64> = (0..5)
            .map(|s| lr_factor(Schedule::Linear, s, 5, 1))
            .collect();
        assert_eq!(l, vec![0.0, 1.0, 0.75, 0.5, 0.25]);
        assert_eq!(lr_factor(Schedule::Constant, 7, 5, 0), 1.0);
    }
}
