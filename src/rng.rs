//! A tiny counter-based random source (SplitMix64). Our own, so that a seed gives the same
//! shuffles, initial adapters and dropout masks on every machine and every release.

/// Stateful SplitMix64 generator.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// The generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// A generator for one purpose, derived from a seed and a list of counters
    /// (e.g. [step, micro-batch, layer, module]): the same inputs give the same stream.
    pub(crate) fn keyed(seed: u64, keys: &[u64]) -> Self {
        let mut s = mix(seed ^ 0x6c6f_7261_2d74_7261);
        for &k in keys {
            s = mix(s ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        }
        Rng(s)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in [0, 1) with 24 random bits (exact in f32).
    pub(crate) fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Fisher–Yates shuffle.
    pub(crate) fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_uniform() {
        let mut a = Rng::keyed(7, &[1, 2]);
        let mut b = Rng::keyed(7, &[1, 2]);
        let mut c = Rng::keyed(7, &[2, 1]);
        let xs: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
        assert_eq!(xs, (0..4).map(|_| b.next_u64()).collect::<Vec<_>>());
        assert_ne!(xs, (0..4).map(|_| c.next_u64()).collect::<Vec<_>>());
        let mut r = Rng::new(1);
        let mean = (0..100_000).map(|_| r.next_f32() as f64).sum::<f64>() / 100_000.0;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        let mut v: Vec<usize> = (0..100).collect();
        r.shuffle(&mut v);
        let mut s = v.clone();
        s.sort();
        assert_eq!(s, (0..100).collect::<Vec<_>>());
        assert_ne!(v, s);
    }
}
