//! The order of rows in each epoch (shuffled, packed, mixed by weights), sharded over ranks,
//! and the cursor a checkpoint resumes from.

use super::fnv::Fnv;
use super::Dataset;
use crate::recipe::DataSection;
use crate::rng::Rng;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Where a run is in its data: `index` rows of epoch `epoch`'s global row list (all ranks
/// together) are done. A checkpoint saves it; [`Sampler::rows_from`] resumes from it, on any
/// number of ranks. After s steps of an epoch, index = s · micro_batch · grad_accum · world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct DataCursor {
    pub(crate) epoch: usize,
    pub(crate) index: usize,
    /// [`Sampler::fingerprint`] of the data it was taken on: resuming on other data (or other
    /// seed, seq_len, packing, shuffling or weights) is refused.
    pub(crate) fingerprint: u64,
}

/// Deterministic order of rows for each epoch; rows are lists of example indices.
pub struct Sampler {
    pub(crate) n_examples: usize,
    lens: Vec<usize>,
    /// Per file of the mix: its examples (ascending) and weight.
    groups: Vec<(Vec<usize>, f64)>,
    seq_len: usize,
    pack: bool,
    shuffle: bool,
    seed: u64,
    fingerprint: u64,
}

impl Sampler {
    /// The epochs' order of `ds`'s examples under `cfg` (packing, shuffling, mixing weights),
    /// from `seed`.
    pub fn new(ds: &Dataset, cfg: &DataSection, seed: u64) -> Self {
        let n = ds.examples.len();
        let mut groups: Vec<(Vec<usize>, f64)> =
            ds.files.iter().map(|(_, w)| (Vec::new(), *w)).collect();
        for i in 0..n {
            let k = ds.file_of.get(i).copied().unwrap_or(0);
            if groups.len() <= k {
                groups.resize(k + 1, (Vec::new(), 1.0));
            }
            groups[k].0.push(i);
        }
        // The count and every example (stored with a cache file, or hashed once).
        let mut h = Fnv(ds.examples.fnv_state());
        for (members, w) in &groups {
            h.word(members.len() as u64);
            members.iter().for_each(|&i| h.word(i as u64));
            h.word(w.to_bits());
        }
        for x in [
            cfg.seq_len as u64,
            cfg.pack as u64,
            cfg.shuffle as u64,
            seed,
        ] {
            h.word(x);
        }
        Sampler {
            n_examples: n,
            lens: ds.examples.lens().collect(),
            groups,
            seq_len: cfg.seq_len,
            pack: cfg.pack,
            shuffle: cfg.shuffle,
            seed,
            fingerprint: h.0,
        }
    }

    /// A hash of everything that decides the rows: the examples, the weights, the settings.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The examples of epoch `epoch`, in order: each file's examples `weight` times (the
    /// whole part as repeats, the fraction as a seeded subset, new each epoch), then a seeded
    /// permutation of it all (or file order without shuffle).
    fn order(&self, epoch: usize) -> Vec<usize> {
        let mut order = Vec::with_capacity(self.n_examples);
        for (g, (members, w)) in self.groups.iter().enumerate() {
            let whole = w.floor() as usize;
            for _ in 0..whole {
                order.extend_from_slice(members);
            }
            let part = ((w - whole as f64) * members.len() as f64).round() as usize;
            if part > 0 {
                let mut m = members.clone();
                Rng::keyed(self.seed, &[0x5745_4947, epoch as u64, g as u64]).shuffle(&mut m);
                m.truncate(part);
                m.sort_unstable();
                order.extend(m);
            }
        }
        if self.shuffle {
            Rng::keyed(self.seed, &[0x5348_5546, epoch as u64]).shuffle(&mut order);
        }
        order
    }

    /// Rows of epoch `epoch`: the epoch's order, then, when packing, greedy filling of rows up
    /// to seq_len tokens in that order.
    pub fn rows(&self, epoch: usize) -> Vec<Vec<usize>> {
        let mut p = Packer::new(self.pack, self.seq_len);
        let mut rows: Vec<Vec<usize>> = self
            .order(epoch)
            .into_iter()
            .filter_map(|i| p.push(i, self.lens[i]))
            .collect();
        rows.extend(p.finish());
        rows
    }

    /// Rank `rank`'s rows of epoch `epoch` out of `world` (DDP / FSDP): rows rank, rank+world,
    /// ... of [`Sampler::rows`], the same number on every rank (the last rows.len() % world
    /// rows of the epoch are left out), so no row is seen twice in an epoch.
    pub(crate) fn rows_for(&self, epoch: usize, rank: usize, world: usize) -> Vec<Vec<usize>> {
        shard(self.rows(epoch), rank, world)
    }

    /// The cursor after `index` global rows of `epoch`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn cursor(&self, epoch: usize, index: usize) -> DataCursor {
        DataCursor {
            epoch,
            index,
            fingerprint: self.fingerprint,
        }
    }

    /// Rank `rank`'s remaining rows of the cursor's epoch: the global rows from `c.index` on,
    /// sharded as [`Sampler::rows_for`] does. Refuses a cursor taken on other data.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn rows_from(
        &self,
        c: &DataCursor,
        rank: usize,
        world: usize,
    ) -> Result<Vec<Vec<usize>>> {
        if c.fingerprint != self.fingerprint {
            bail!(
                "the data cursor was saved on other data or data settings (fingerprint {:016x}, now {:016x}): resume with the same files, weights, seq_len, pack, shuffle and seed",
                c.fingerprint,
                self.fingerprint
            );
        }
        let mut rows = self.rows(c.epoch);
        if c.index > rows.len() {
            bail!(
                "the data cursor is at row {} of epoch {}, which has only {} rows",
                c.index,
                c.epoch,
                rows.len()
            );
        }
        let rest = rows.split_off(c.index);
        Ok(shard(rest, rank, world))
    }
}

/// Rows made from examples as they come, in order: each example a row, or, when packing,
/// rows filled greedily up to seq_len tokens (a row is done when the next example does not
/// fit). [`Sampler::rows`] and a streaming run's first epoch make their rows with it.
pub struct Packer {
    pack: bool,
    seq_len: usize,
    cur: Vec<usize>,
    used: usize,
}

impl Packer {
    /// A packer for `seq_len`-token rows (`pack` false: a row per example).
    pub fn new(pack: bool, seq_len: usize) -> Packer {
        Packer {
            pack,
            seq_len,
            cur: Vec::new(),
            used: 0,
        }
    }

    /// Example `i` of `len` tokens comes next: the row it closes, if any.
    pub fn push(&mut self, i: usize, len: usize) -> Option<Vec<usize>> {
        if !self.pack {
            return Some(vec![i]);
        }
        let mut done = None;
        if self.used + len > self.seq_len && !self.cur.is_empty() {
            done = Some(std::mem::take(&mut self.cur));
            self.used = 0;
        }
        self.cur.push(i);
        self.used += len;
        done
    }

    /// The examples are over: the last row, if any.
    pub fn finish(&mut self) -> Option<Vec<usize>> {
        self.used = 0;
        Some(std::mem::take(&mut self.cur)).filter(|r| !r.is_empty())
    }
}

/// Rows rank, rank+world, ... with the tail that does not fill a round dropped.
fn shard(rows: Vec<Vec<usize>>, rank: usize, world: usize) -> Vec<Vec<usize>> {
    let world = world.max(1);
    let per = rows.len() / world;
    rows.into_iter()
        .skip(rank)
        .step_by(world)
        .take(per)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Example;
    use std::path::PathBuf;

    /// A `[data]` section from TOML lines (train = "x.jsonl" added).
    fn section(lines: &str) -> DataSection {
        toml::from_str(&format!("train = \"x.jsonl\"\n{lines}")).unwrap()
    }

    fn ex(ids: &[u32]) -> Example {
        Example {
            ids: ids.to_vec(),
            labels: ids.iter().map(|&t| t as i64).collect(),
        }
    }

    #[test]
    fn sampler_packs_greedily_and_shuffles_reproducibly() {
        let ds = Dataset {
            examples: [ex(&[1, 2, 3]), ex(&[1, 2]), ex(&[1, 2, 3, 4]), ex(&[1])]
                .into_iter()
                .collect(),
            ..Dataset::default()
        };
        let mut cfg = section("format = \"tokens\"\nseq_len = 5\nshuffle = false\npack = true");
        let s = Sampler::new(&ds, &cfg, 1);
        assert_eq!(s.rows(0), vec![vec![0, 1], vec![2, 3]]);
        // Fed one example at a time, the packer closes each row when the next one does not fit.
        let mut p = Packer::new(true, 5);
        let got: Vec<Option<Vec<usize>>> = [3, 2, 4, 1]
            .iter()
            .enumerate()
            .map(|(i, &len)| p.push(i, len))
            .collect();
        assert_eq!(got, [None, None, Some(vec![0, 1]), None]);
        assert_eq!(p.finish(), Some(vec![2, 3]));
        assert_eq!(p.finish(), None);
        cfg.shuffle = true;
        cfg.pack = false;
        let s = Sampler::new(&ds, &cfg, 1);
        assert_eq!(s.rows(3), s.rows(3));
        let mut all: Vec<usize> = s.rows(0).concat();
        all.sort();
        assert_eq!(all, vec![0, 1, 2, 3]);
    }

    /// n examples of distinct lengths 1..=n, in files of `sizes` with `weights`.
    fn mix(sizes: &[usize], weights: &[f64]) -> Dataset {
        let mut ds = Dataset::default();
        for (k, (&n, &w)) in sizes.iter().zip(weights).enumerate() {
            ds.files.push((PathBuf::from(format!("f{k}.jsonl")), w));
            for _ in 0..n {
                let len = ds.examples.len() + 1;
                let e = ex(&vec![7; len]);
                ds.examples.push(&e.ids, &e.labels);
                ds.file_of.push(k);
            }
        }
        ds
    }

    #[test]
    fn weights_repeat_and_subsample_files_each_epoch() {
        // File 0: 4 examples × 2; file 1: 10 examples × 0.5 (a new seeded half each epoch).
        let ds = mix(&[4, 10], &[2.0, 0.5]);
        let s = Sampler::new(&ds, &section("shuffle = true"), 3);
        let count = |epoch| {
            let mut c = vec![0; 14];
            s.rows(epoch).concat().iter().for_each(|&i| c[i] += 1);
            c
        };
        for epoch in 0..3 {
            let c = count(epoch);
            assert_eq!(&c[..4], &[2, 2, 2, 2], "epoch {epoch}");
            assert_eq!(c[4..].iter().sum::<usize>(), 5, "epoch {epoch}");
            assert!(c[4..].iter().all(|&x| x <= 1), "epoch {epoch}: {c:?}");
        }
        assert_ne!(count(0)[4..], count(1)[4..], "another half each epoch");
        assert_eq!(s.rows(1), s.rows(1));
        // Weight 1 everywhere: every example once, in the foundation's order.
        let one = Sampler::new(&mix(&[4, 10], &[1.0, 1.0]), &section("shuffle = false"), 3);
        assert_eq!(one.rows(0).concat(), (0..14).collect::<Vec<_>>());
    }

    #[test]
    fn ranks_share_an_epoch_without_overlap_and_a_cursor_resumes_it() {
        let ds = mix(&[23], &[1.0]);
        let s = Sampler::new(&ds, &section("seq_len = 512"), 9);
        let all = s.rows(2);
        assert_eq!(all.len(), 23);
        let world = 3;
        let shards: Vec<Vec<Vec<usize>>> = (0..world).map(|r| s.rows_for(2, r, world)).collect();
        // 7 rows each; the 2 rows that do not fill a round are left out of this epoch.
        assert!(shards.iter().all(|sh| sh.len() == 7));
        let mut seen: Vec<usize> = shards.concat().concat();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 21, "no example twice in an epoch");
        // Rank r's k-th row is global row k·world + r.
        assert_eq!(shards[1][4], all[4 * world + 1]);

        // 5 steps done on 3 ranks (15 global rows): resume on 2 ranks, the rest exactly once.
        let c = s.cursor(2, 15);
        let json = serde_json::to_string(&c).unwrap();
        let c: DataCursor = serde_json::from_str(&json).unwrap();
        let rest: Vec<Vec<usize>> = (0..2)
            .flat_map(|r| s.rows_from(&c, r, 2).unwrap())
            .collect();
        let mut got: Vec<usize> = rest.concat();
        got.sort();
        let mut want: Vec<usize> = all[15..].concat();
        want.sort();
        assert_eq!(got, want);
        assert_eq!(s.rows_from(&s.cursor(2, 0), 0, 1).unwrap(), all);

        // Another seed (or other data) gives another fingerprint: the cursor is refused.
        let other = Sampler::new(&ds, &section("seq_len = 512"), 10);
        let e = other.rows_from(&c, 0, 1).unwrap_err().to_string();
        assert!(e.contains("saved on other data"), "{e}");
        assert!(s.rows_from(&s.cursor(2, 24), 0, 1).is_err());
    }
}
