//! A data set's examples: each one's token ids and labels, in flat arrays in memory or in a
//! memory-mapped tokenized cache file ([`super::cache_file`]); a subset (an eval split) is a
//! list of indices into them. Nothing here holds one allocation per example.

use super::cache_file::Mapped;
use super::fnv::Fnv;
use super::Example;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// One example's tokens, borrowed from where they are stored: ids and labels of one length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExampleRef<'a> {
    /// Token ids.
    pub ids: &'a [u32],
    /// Labels aligned with `ids` (-100: not a target).
    pub labels: &'a [i64],
}

impl ExampleRef<'_> {
    /// An owned copy.
    pub fn to_example(&self) -> Example {
        Example {
            ids: self.ids.to_vec(),
            labels: self.labels.to_vec(),
        }
    }
}

impl PartialEq<Example> for ExampleRef<'_> {
    fn eq(&self, other: &Example) -> bool {
        self.ids == other.ids.as_slice() && self.labels == other.labels.as_slice()
    }
}

/// Examples in memory: example i is `ids[offsets[i]..offsets[i + 1]]` (labels alike).
#[derive(Debug, Clone)]
struct Flat {
    offsets: Vec<usize>,
    ids: Vec<u32>,
    labels: Vec<i64>,
}

impl Default for Flat {
    fn default() -> Self {
        Flat {
            offsets: vec![0],
            ids: Vec::new(),
            labels: Vec::new(),
        }
    }
}

#[derive(Debug)]
enum Base {
    Flat(Flat),
    Mapped(Arc<Mapped>),
}

/// The examples of a data set, in order. `get(i)` is example i.
#[derive(Debug)]
pub struct Examples {
    base: Base,
    /// A subset: the base's examples at these indices, in this order.
    pick: Option<Vec<usize>>,
    /// The fingerprint state of the examples (see [`Examples::fnv_state`]), once computed.
    fnv: OnceLock<u64>,
}

impl Default for Examples {
    fn default() -> Self {
        Examples {
            base: Base::Flat(Flat::default()),
            pick: None,
            fnv: OnceLock::new(),
        }
    }
}

impl FromIterator<Example> for Examples {
    fn from_iter<I: IntoIterator<Item = Example>>(it: I) -> Self {
        let mut e = Examples::default();
        for x in it {
            e.push(&x.ids, &x.labels);
        }
        e
    }
}

impl Examples {
    /// Every example of a mapped cache file.
    pub(super) fn mapped(m: Arc<Mapped>) -> Examples {
        Examples {
            base: Base::Mapped(m),
            pick: None,
            fnv: OnceLock::new(),
        }
    }

    /// Appends an example (examples read from a cache are first copied into memory).
    pub fn push(&mut self, ids: &[u32], labels: &[i64]) {
        if self.pick.is_some() || matches!(self.base, Base::Mapped(_)) {
            let all: Examples = self.iter().map(|e| e.to_example()).collect();
            *self = all;
        }
        self.fnv = OnceLock::new();
        if let Base::Flat(f) = &mut self.base {
            f.ids.extend_from_slice(ids);
            f.labels.extend_from_slice(labels);
            f.offsets.push(f.ids.len());
        }
    }

    /// How many examples.
    pub fn len(&self) -> usize {
        match (&self.pick, &self.base) {
            (Some(p), _) => p.len(),
            (None, Base::Flat(f)) => f.offsets.len() - 1,
            (None, Base::Mapped(m)) => m.len(),
        }
    }

    /// Whether there is no example.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn base_index(&self, i: usize) -> usize {
        match &self.pick {
            Some(p) => p[i],
            None => i,
        }
    }

    /// Example `i` (panics when `i >= len()`, as indexing a slice does).
    pub fn get(&self, i: usize) -> ExampleRef<'_> {
        let j = self.base_index(i);
        match &self.base {
            Base::Flat(f) => {
                let (a, b) = (f.offsets[j], f.offsets[j + 1]);
                ExampleRef {
                    ids: &f.ids[a..b],
                    labels: &f.labels[a..b],
                }
            }
            Base::Mapped(m) => m.example(j),
        }
    }

    /// Tokens of example `i`, without reading them.
    pub fn len_of(&self, i: usize) -> usize {
        let j = self.base_index(i);
        match &self.base {
            Base::Flat(f) => f.offsets[j + 1] - f.offsets[j],
            Base::Mapped(m) => m.len_of(j),
        }
    }

    /// Every example in order.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            e: self,
            at: 0,
            end: self.len(),
        }
    }

    /// Every example's length in order.
    pub fn lens(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        (0..self.len()).map(|i| self.len_of(i))
    }

    /// Tokens in all.
    pub fn tokens(&self) -> usize {
        self.lens().sum()
    }

    /// The cache file the examples are read from (None: in memory, or an unlinked file).
    pub fn cache_path(&self) -> Option<&PathBuf> {
        match &self.base {
            Base::Mapped(m) => m.path.as_ref(),
            Base::Flat(_) => None,
        }
    }

    /// Splits into (the examples not held, the examples held), each in order.
    pub(super) fn split(self, held: &[bool]) -> (Examples, Examples) {
        let n = self.len();
        let (mut keep, mut take) = (Vec::new(), Vec::new());
        for i in 0..n {
            let j = self.base_index(i);
            match held.get(i).copied().unwrap_or(false) {
                true => take.push(j),
                false => keep.push(j),
            }
        }
        match self.base {
            Base::Mapped(m) => {
                let part = |pick| Examples {
                    base: Base::Mapped(m.clone()),
                    pick: Some(pick),
                    fnv: OnceLock::new(),
                };
                (part(keep), part(take))
            }
            Base::Flat(f) => {
                let part = |pick: Vec<usize>| {
                    let mut e = Examples::default();
                    for j in pick {
                        let (a, b) = (f.offsets[j], f.offsets[j + 1]);
                        e.push(&f.ids[a..b], &f.labels[a..b]);
                    }
                    e
                };
                (part(keep), part(take))
            }
        }
    }

    /// The FNV state after hashing the count and then every example (length, ids, labels), as
    /// the sampler's fingerprint starts: computed once; a whole cache file's comes stored in
    /// it, a subset of one is read with pread (its pages never count as this process's
    /// memory) and remembered beside the file.
    pub fn fnv_state(&self) -> u64 {
        *self.fnv.get_or_init(|| match (&self.base, &self.pick) {
            (Base::Mapped(m), None) => m.fnv,
            (Base::Mapped(m), Some(p)) => subset_fnv(m, p),
            (Base::Flat(_), _) => {
                let mut h = Fnv::new();
                h.word(self.len() as u64);
                self.iter().for_each(|e| h.example(e.ids, e.labels));
                h.0
            }
        })
    }
}

/// [`Examples::iter`]: the examples in order.
pub struct Iter<'a> {
    e: &'a Examples,
    at: usize,
    end: usize,
}

impl<'a> Iterator for Iter<'a> {
    type Item = ExampleRef<'a>;

    fn next(&mut self) -> Option<ExampleRef<'a>> {
        (self.at < self.end).then(|| {
            self.at += 1;
            self.e.get(self.at - 1)
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.end - self.at;
        (n, Some(n))
    }
}

impl ExactSizeIterator for Iter<'_> {}

impl<'a> IntoIterator for &'a Examples {
    type Item = ExampleRef<'a>;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// The fingerprint state of examples `pick` of a mapped file: from the memo beside the file
/// when there is one, else read (and the memo written; a failure to write it only costs the
/// next run the same read).
fn subset_fnv(m: &Mapped, pick: &[usize]) -> u64 {
    let mut h = Fnv::new();
    h.word(pick.len() as u64);
    pick.iter().for_each(|&i| h.word(i as u64));
    let memo = m
        .path
        .as_ref()
        .map(|p| p.with_extension(format!("fnv-{:016x}", h.0)));
    if let Some(v) = memo
        .as_ref()
        .and_then(|p| std::fs::read(p).ok())
        .and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
    {
        return u64::from_le_bytes(v);
    }
    let state = match m.fnv_of(pick) {
        Ok(s) => s,
        // The file was checked when it was mapped; a read failing now is an I/O fault, and
        // the mapping reads the same bytes.
        Err(_) => {
            let mut h = Fnv::new();
            h.word(pick.len() as u64);
            pick.iter().for_each(|&i| {
                let e = m.example(i);
                h.example(e.ids, e.labels)
            });
            h.0
        }
    };
    if let Some(p) = memo {
        let _ = crate::util::atomic_write(&p, &state.to_le_bytes());
    }
    state
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
    fn flat_examples_split_and_hash_as_a_list_of_examples() {
        let list = [ex(&[1, 2]), ex(&[3]), ex(&[4, 5, 6]), ex(&[7])];
        let e: Examples = list.iter().cloned().collect();
        assert_eq!(e.len(), 4);
        assert_eq!(e.get(2), list[2]);
        assert_eq!(e.lens().collect::<Vec<_>>(), [2, 1, 3, 1]);
        assert_eq!(e.tokens(), 7);
        let mut h = Fnv::new();
        h.word(4);
        list.iter().for_each(|x| h.example(&x.ids, &x.labels));
        assert_eq!(e.fnv_state(), h.0);
        let (keep, held) = e.split(&[false, true, false, true]);
        assert_eq!(
            keep.iter().collect::<Vec<_>>(),
            [list[0].clone(), list[2].clone()]
        );
        assert_eq!(
            held.iter().collect::<Vec<_>>(),
            [list[1].clone(), list[3].clone()]
        );
    }
}
