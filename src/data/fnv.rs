//! FNV-1a over 64-bit words: the stable hash of a data set's examples and settings that a
//! checkpoint's data cursor records (the same on every machine and release).

/// An FNV-1a state; [`Fnv::word`] hashes a word's 8 little-endian bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fnv(pub u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv::new()
    }
}

impl Fnv {
    /// The FNV-1a offset basis.
    pub fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    /// Hashes one word.
    pub fn word(&mut self, x: u64) {
        for b in x.to_le_bytes() {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// Hashes an example as the sampler's fingerprint does: its length, its ids, its labels.
    pub fn example(&mut self, ids: &[u32], labels: &[i64]) {
        self.word(ids.len() as u64);
        ids.iter().for_each(|&t| self.word(t as u64));
        labels.iter().for_each(|&l| self.word(l as u64));
    }
}
