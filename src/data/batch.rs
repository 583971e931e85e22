//! Rows of examples → one padded micro-batch with its shifted targets.

use super::{Example, ExampleRef, IGNORE};

/// An example's tokens as a batch reads them: ids and aligned labels.
pub trait Tokens {
    /// Token ids.
    fn ids(&self) -> &[u32];
    /// Labels aligned with the ids (-100: not a target).
    fn labels(&self) -> &[i64];
}

impl Tokens for &Example {
    fn ids(&self) -> &[u32] {
        &self.ids
    }
    fn labels(&self) -> &[i64] {
        &self.labels
    }
}

impl Tokens for ExampleRef<'_> {
    fn ids(&self) -> &[u32] {
        self.ids
    }
    fn labels(&self) -> &[i64] {
        self.labels
    }
}

/// One micro-batch, host side: B rows of T tokens.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Rows: B.
    pub b: usize,
    /// Tokens a row: T.
    pub t: usize,
    /// Token ids [B×T] (padding after each row's examples).
    pub ids: Vec<u32>,
    /// Position ids [B×T], restarting at each packed example.
    pub positions: Vec<u32>,
    /// [B×T] example index within its row (packed rows only); prefix-tree ids where
    /// `prefix_tree` (`super::pref_batch`).
    pub segments: Option<Vec<u32>>,
    /// `segments` holds prefix-tree ids `example << 2 | branch` (a preference pair's prompt
    /// shared by its two completions: `ops::AttnMask::prefix_tree`).
    pub prefix_tree: bool,
    /// (flat index b·T + t of the predicting position, target token) for every counted token.
    pub targets: Vec<(usize, u32)>,
    /// Real (non-padding) tokens.
    pub tokens: usize,
    /// [B×T] whether each position holds a real token (not padding).
    pub real: Vec<bool>,
    /// Preference batches: which sequence each target belongs to, and what the objective
    /// needs besides (`super::pref_batch`); None for SFT rows.
    pub pref: Option<std::sync::Arc<super::pref_batch::PrefLayout>>,
}

impl Batch {
    /// Rows of examples → one batch, padded to its longest row.
    pub fn from_rows<E: Tokens>(rows: &[Vec<E>], pad_id: u32, packed: bool) -> Batch {
        let t = rows
            .iter()
            .map(|r| r.iter().map(|e| e.ids().len()).sum::<usize>())
            .max()
            .unwrap_or(1)
            .max(1);
        let b = rows.len();
        let mut ids = vec![pad_id; b * t];
        let mut positions = vec![0u32; b * t];
        let mut segments = vec![u32::MAX; b * t];
        let mut labels = vec![IGNORE; b * t];
        let mut real = vec![false; b * t];
        for (r, row) in rows.iter().enumerate() {
            let mut at = r * t;
            for (k, ex) in row.iter().enumerate() {
                for (p, (&id, &l)) in ex.ids().iter().zip(ex.labels()).enumerate() {
                    ids[at] = id;
                    real[at] = true;
                    positions[at] = p as u32;
                    segments[at] = k as u32;
                    // An example's first token is never a target: in a packed row it would be
                    // predicted from the previous example.
                    labels[at] = if p == 0 { IGNORE } else { l };
                    at += 1;
                }
            }
            // Padding continues the positions (its outputs are never used).
            for (p, pos) in positions[at..(r + 1) * t].iter_mut().enumerate() {
                *pos = (at - r * t + p) as u32;
            }
        }
        let mut targets = Vec::new();
        for r in 0..b {
            for i in 0..t - 1 {
                let l = labels[r * t + i + 1];
                if l != IGNORE {
                    targets.push((r * t + i, l as u32));
                }
            }
        }
        let tokens = rows.iter().flatten().map(|e| e.ids().len()).sum();
        Batch {
            b,
            t,
            ids,
            positions,
            segments: packed.then_some(segments),
            prefix_tree: false,
            targets,
            tokens,
            real,
            pref: None,
        }
    }

    /// The counted target tokens.
    pub fn n_targets(&self) -> usize {
        self.targets.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(ids: &[u32]) -> Example {
        Example {
            ids: ids.to_vec(),
            labels: ids.iter().map(|&t| t as i64).collect(),
        }
    }

    #[test]
    fn targets_are_shifted_and_padding_is_ignored() {
        let (a, b) = (ex(&[5, 6, 7]), ex(&[8, 9]));
        let batch = Batch::from_rows(&[vec![&a], vec![&b]], 0, false);
        assert_eq!((batch.b, batch.t), (2, 3));
        assert_eq!(batch.ids, vec![5, 6, 7, 8, 9, 0]);
        // position 0 predicts 6, 1 predicts 7; row 2: position 3 predicts 9; pad is ignored.
        assert_eq!(batch.targets, vec![(0, 6), (1, 7), (3, 9)]);
        assert!(batch.segments.is_none());
    }

    #[test]
    fn packed_rows_restart_positions_and_never_predict_across_examples() {
        let (a, b) = (ex(&[5, 6, 7]), ex(&[8, 9]));
        let batch = Batch::from_rows(&[vec![&a, &b]], 0, true);
        assert_eq!(batch.positions, vec![0, 1, 2, 0, 1]);
        assert_eq!(batch.segments, Some(vec![0, 0, 0, 1, 1]));
        // 7 → 8 crosses examples: not a target.
        assert_eq!(batch.targets, vec![(0, 6), (1, 7), (3, 9)]);
    }
}
