//! The tokenized cache's file: a data set's examples (token ids and labels) in one file that
//! is memory-mapped and read where a batch needs it, never whole.
//!
//! Layout (little-endian; every section starts 8-byte aligned):
//! - header, [`HEADER_LEN`] bytes: magic, version, the key the file was built for, the counts,
//!   the sections' offsets, the examples' fingerprint state ([`super::fnv`]), and the sha256
//!   of everything after the records;
//! - records, from HEADER_LEN: per example its ids (u32 × len, padded to 8 bytes), then its
//!   labels (i64 × len);
//! - index: each example's record offset (u64 × n), then its length (u32 × n, padded);
//! - meta: JSON, what the build counted (truncated, skipped rows, ...), for the caller.
//!
//! The writer fills a file that nobody else sees (a temporary name, or an unlinked file) and
//! writes the header last, then syncs; [`Mapped::open`] trusts a file only when its header,
//! length, index digest and record layout all agree, so a half-written or damaged file is
//! rebuilt, never read.

use super::fnv::Fnv;
use super::store::ExampleRef;
use memmap2::Mmap;
use std::fs::File;
use std::io::{self, BufWriter, Seek, SeekFrom, Write};
use std::path::PathBuf;

/// The header's size; records start here.
pub const HEADER_LEN: usize = 256;
const MAGIC: &[u8; 8] = b"LTTOKENS";
const VERSION: u32 = 1;

/// The header's fields at their byte offsets.
mod at {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const KEY: usize = 16;
    pub const N: usize = 48;
    pub const TOKENS: usize = 56;
    pub const INDEX: usize = 64;
    pub const META: usize = 72;
    pub const META_LEN: usize = 80;
    pub const TOTAL: usize = 88;
    pub const FNV: usize = 96;
    pub const DIGEST: usize = 104;
}

/// Bytes of an example's record of `len` tokens.
fn record_len(len: usize) -> usize {
    pad8(4 * len) + 8 * len
}

fn pad8(n: usize) -> usize {
    n.div_ceil(8) * 8
}

/// Streams examples into a file, then writes index, meta and header (see the module docs).
pub struct Writer {
    out: BufWriter<File>,
    pos: usize,
    starts: Vec<u64>,
    lens: Vec<u32>,
    tokens: u64,
}

impl Writer {
    /// Starts the file (a zero header, replaced by [`Writer::finish`]).
    pub fn new(file: File) -> io::Result<Writer> {
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&[0u8; HEADER_LEN])?;
        Ok(Writer {
            out,
            pos: HEADER_LEN,
            starts: Vec::new(),
            lens: Vec::new(),
            tokens: 0,
        })
    }

    /// Appends one example (ids and labels of one length).
    pub fn push(&mut self, ids: &[u32], labels: &[i64]) -> io::Result<()> {
        let len = u32::try_from(ids.len())
            .ok()
            .filter(|_| labels.len() == ids.len())
            .ok_or_else(|| io::Error::other("an example longer than 2³² tokens"))?;
        self.out.write_all(bytemuck::cast_slice(ids))?;
        let pad = pad8(4 * ids.len()) - 4 * ids.len();
        self.out.write_all(&[0u8; 8][..pad])?;
        self.out.write_all(bytemuck::cast_slice(labels))?;
        self.starts.push(self.pos as u64);
        self.lens.push(len);
        self.pos += record_len(ids.len());
        self.tokens += ids.len() as u64;
        Ok(())
    }

    /// Where the next example's record starts.
    pub fn pos(&self) -> u64 {
        self.pos as u64
    }

    /// Hands the records written so far to the file (a streaming run reads them back).
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// Writes the index, `meta` and the header (for `key`), and syncs the file.
    pub fn finish(self, key: &[u8; 32], meta: &[u8]) -> io::Result<File> {
        let Writer {
            mut out,
            pos,
            starts,
            lens,
            tokens,
        } = self;
        let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
        let mut put = |out: &mut BufWriter<File>, b: &[u8]| -> io::Result<()> {
            digest.update(b);
            out.write_all(b)
        };
        let index = pos;
        put(&mut out, bytemuck::cast_slice(&starts))?;
        put(&mut out, bytemuck::cast_slice(&lens))?;
        let pad = pad8(4 * lens.len()) - 4 * lens.len();
        put(&mut out, &[0u8; 8][..pad])?;
        let meta_at = index + 8 * starts.len() + pad8(4 * lens.len());
        put(&mut out, meta)?;
        let total = meta_at + meta.len();
        let mut file = out.into_inner().map_err(|e| e.into_error())?;
        let fnv = fnv_of(&file, starts.iter().zip(&lens).map(|(&s, &l)| (s, l)))?;
        let mut h = [0u8; HEADER_LEN];
        let mut set = |at: usize, b: &[u8]| h[at..at + b.len()].copy_from_slice(b);
        set(at::MAGIC, MAGIC);
        set(at::VERSION, &VERSION.to_le_bytes());
        set(at::KEY, key);
        set(at::N, &(lens.len() as u64).to_le_bytes());
        set(at::TOKENS, &tokens.to_le_bytes());
        set(at::INDEX, &(index as u64).to_le_bytes());
        set(at::META, &(meta_at as u64).to_le_bytes());
        set(at::META_LEN, &(meta.len() as u64).to_le_bytes());
        set(at::TOTAL, &(total as u64).to_le_bytes());
        set(at::FNV, &fnv.to_le_bytes());
        set(at::DIGEST, digest.finish().as_ref());
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&h)?;
        file.sync_all()?;
        Ok(file)
    }
}

/// The sampler's hash of examples (start, len) of `file`: their count, then each one's
/// length, ids and labels; read with pread, so that the pages never count as our memory.
fn fnv_of(file: &File, records: impl ExactSizeIterator<Item = (u64, u32)>) -> io::Result<u64> {
    let mut h = Fnv::new();
    h.word(records.len() as u64);
    let mut buf: Vec<u8> = Vec::new();
    for (start, len) in records {
        let len = len as usize;
        buf.resize(record_len(len), 0);
        read_at(file, &mut buf, start)?;
        h.word(len as u64);
        for c in buf[..4 * len].chunks_exact(4) {
            h.word(u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u64);
        }
        for c in buf[pad8(4 * len)..].chunks_exact(8) {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            h.word(u64::from_le_bytes(w));
        }
    }
    Ok(h.0)
}

/// The example of `len` tokens whose record starts at `start` in `file`, read with pread (a
/// file still being written: the records before its index are final once flushed).
pub fn read_example(file: &File, start: u64, len: usize) -> io::Result<super::Example> {
    let mut buf = vec![0u8; record_len(len)];
    read_at(file, &mut buf, start)?;
    let ids = buf[..4 * len]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let labels = buf[pad8(4 * len)..]
        .chunks_exact(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            i64::from_le_bytes(w)
        })
        .collect();
    Ok(super::Example { ids, labels })
}

#[cfg(unix)]
fn read_at(file: &File, buf: &mut [u8], at: u64) -> io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, at)
}

#[cfg(not(unix))]
fn read_at(file: &File, buf: &mut [u8], at: u64) -> io::Result<()> {
    use std::io::Read;
    let mut f = file.try_clone()?;
    f.seek(SeekFrom::Start(at))?;
    f.read_exact(buf)
}

/// A cache file mapped read-only and checked (see [`Mapped::open`]).
pub struct Mapped {
    map: Mmap,
    file: File,
    /// Where the file is (None: an unlinked temporary file).
    pub path: Option<PathBuf>,
    n: usize,
    tokens: usize,
    index: usize,
    meta: (usize, usize),
    /// The examples' fingerprint state (count, then every example), as written.
    pub fnv: u64,
}

impl std::fmt::Debug for Mapped {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "Mapped({:?}, {} examples)", self.path, self.n)
    }
}

impl Mapped {
    /// Maps `file` and checks it was built for `key` and is whole: Err says why it is not to
    /// be trusted.
    pub fn open(file: File, path: Option<PathBuf>, key: &[u8; 32]) -> Result<Mapped, String> {
        // SAFETY: cache files are written under a temporary name (or unlinked) and renamed into
        // place whole; nothing writes to one afterwards (a rebuild renames a new file over the
        // name, leaving this inode as it is). Only a user truncating the file by hand while a
        // run maps it could change what this mapping reads.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| format!("cannot map it: {e}"))?;
        let m = map.len();
        if m < HEADER_LEN {
            return Err(format!("it has {m} bytes, less than a header"));
        }
        let u64_at = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&map[at..at + 8]);
            u64::from_le_bytes(w)
        };
        if &map[at::MAGIC..at::MAGIC + 8] != MAGIC {
            return Err("it is not a tokenized cache file (no header)".into());
        }
        let version = u64_at(at::VERSION) as u32;
        if version != VERSION {
            return Err(format!("it has format version {version}, not {VERSION}"));
        }
        if &map[at::KEY..at::KEY + 32] != key {
            return Err("it was built for other data or settings".into());
        }
        let total = u64_at(at::TOTAL);
        if total != m as u64 {
            return Err(format!("it has {m} bytes, its header says {total}"));
        }
        let n = u64_at(at::N);
        let (index, meta, meta_len) = (u64_at(at::INDEX), u64_at(at::META), u64_at(at::META_LEN));
        let m64 = m as u64;
        let layout_ok = n <= m64 / 12
            && index % 8 == 0
            && index >= HEADER_LEN as u64
            && index <= m64
            && meta == index + 8 * n + (4 * n).div_ceil(8) * 8
            && meta.checked_add(meta_len) == Some(m64);
        if !layout_ok {
            return Err("its header's sections do not fit the file".into());
        }
        let (n, index, meta, meta_len) =
            (n as usize, index as usize, meta as usize, meta_len as usize);
        let digest = ring::digest::digest(&ring::digest::SHA256, &map[index..]);
        if digest.as_ref() != &map[at::DIGEST..at::DIGEST + 32] {
            return Err("its index or meta is damaged (digest mismatch)".into());
        }
        let mapped = Mapped {
            n,
            tokens: u64_at(at::TOKENS) as usize,
            index,
            meta: (meta, meta_len),
            fnv: u64_at(at::FNV),
            map,
            file,
            path,
        };
        mapped.check_records()?;
        Ok(mapped)
    }

    /// The records lie back to back from the header to the index, and hold `tokens` in all.
    fn check_records(&self) -> Result<(), String> {
        let (starts, lens) = (self.starts(), self.lens());
        let (mut at, mut tokens) = (HEADER_LEN, 0usize);
        for (&s, &l) in starts.iter().zip(lens) {
            if s != at as u64 {
                return Err("its index does not match its records".into());
            }
            at += record_len(l as usize);
            tokens += l as usize;
        }
        if at != self.index || tokens != self.tokens {
            return Err("its records do not end where its index begins".into());
        }
        Ok(())
    }

    fn starts(&self) -> &[u64] {
        // The index is 8-byte aligned in a page-aligned mapping (checked in `open`).
        bytemuck::cast_slice(&self.map[self.index..self.index + 8 * self.n])
    }

    fn lens(&self) -> &[u32] {
        let at = self.index + 8 * self.n;
        bytemuck::cast_slice(&self.map[at..at + 4 * self.n])
    }

    /// Examples in the file.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.n
    }

    /// Tokens of example `i`.
    pub fn len_of(&self, i: usize) -> usize {
        self.lens()[i] as usize
    }

    /// Example `i`, read from the mapping.
    pub fn example(&self, i: usize) -> ExampleRef<'_> {
        let (s, len) = (self.starts()[i] as usize, self.lens()[i] as usize);
        let labels = s + pad8(4 * len);
        // Records start 8-byte aligned and lie inside the file (checked in `open`).
        ExampleRef {
            ids: bytemuck::cast_slice(&self.map[s..s + 4 * len]),
            labels: bytemuck::cast_slice(&self.map[labels..labels + 8 * len]),
        }
    }

    /// Every example's record: (start, tokens), in order.
    pub fn records(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.starts()
            .iter()
            .copied()
            .zip(self.lens().iter().copied())
    }

    /// Another handle on the mapped file (reads with pread).
    pub fn reopen(&self) -> io::Result<File> {
        self.file.try_clone()
    }

    /// The meta JSON written with the file.
    pub fn meta(&self) -> &[u8] {
        &self.map[self.meta.0..self.meta.0 + self.meta.1]
    }

    /// The fingerprint state of examples `idx` (in that order), read with pread.
    pub fn fnv_of(&self, idx: &[usize]) -> io::Result<u64> {
        let (starts, lens) = (self.starts(), self.lens());
        fnv_of(&self.file, idx.iter().map(|&i| (starts[i], lens[i])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> (tempfile::TempDir, PathBuf, File) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        (dir, p, f)
    }

    #[test]
    fn examples_round_trip_and_damage_is_refused() {
        let (_d, p, f) = file();
        let mut w = Writer::new(f).unwrap();
        let ex: Vec<(Vec<u32>, Vec<i64>)> = vec![
            (vec![1, 2, 3], vec![-100, 2, 3]),
            (vec![7], vec![7]),
            (vec![], vec![]),
            (vec![4, 5, 6, 7], vec![4, -100, 6, 7]),
        ];
        for (i, l) in &ex {
            w.push(i, l).unwrap();
        }
        let key = [3u8; 32];
        let f = w.finish(&key, br#"{"x":1}"#).unwrap();
        let m = Mapped::open(f, Some(p.clone()), &key).unwrap();
        assert_eq!(m.len(), 4);
        for (k, (i, l)) in ex.iter().enumerate() {
            assert_eq!(m.example(k).ids, &i[..]);
            assert_eq!(m.example(k).labels, &l[..]);
            assert_eq!(m.len_of(k), i.len());
        }
        assert_eq!(m.meta(), br#"{"x":1}"#);
        let f = m.reopen().unwrap();
        for ((start, len), (i, l)) in m.records().zip(&ex) {
            let e = read_example(&f, start, len as usize).unwrap();
            assert_eq!((&e.ids, &e.labels), (i, l));
        }
        // The stored fingerprint is the sampler's hash of the examples in order.
        let mut h = Fnv::new();
        h.word(4);
        ex.iter().for_each(|(i, l)| h.example(i, l));
        assert_eq!(m.fnv, h.0);
        assert_eq!(m.fnv_of(&[0, 1, 2, 3]).unwrap(), h.0);
        let mut h = Fnv::new();
        h.word(2);
        h.example(&ex[3].0, &ex[3].1);
        h.example(&ex[1].0, &ex[1].1);
        assert_eq!(m.fnv_of(&[3, 1]).unwrap(), h.0);
        drop(m);

        let open = |bytes: &[u8], key: &[u8; 32]| {
            std::fs::write(&p, bytes).unwrap();
            Mapped::open(File::open(&p).unwrap(), None, key).map(|_| ())
        };
        let good = std::fs::read(&p).unwrap();
        assert!(open(&good, &key).is_ok());
        let e = open(&good, &[4u8; 32]).unwrap_err();
        assert!(e.contains("other data"), "{e}");
        let e = open(&good[..good.len() - 1], &key).unwrap_err();
        assert!(e.contains("its header says"), "{e}");
        let e = open(&good[..100], &key).unwrap_err();
        assert!(e.contains("less than a header"), "{e}");
        // A file whose header was never written (a killed build) is not a cache file.
        let mut blank = good.clone();
        blank[..HEADER_LEN].fill(0);
        let e = open(&blank, &key).unwrap_err();
        assert!(e.contains("not a tokenized cache file"), "{e}");
        // A flipped bit in the index or meta.
        let mut bad = good.clone();
        let last = bad.len() - 2;
        bad[last] ^= 1;
        let e = open(&bad, &key).unwrap_err();
        assert!(e.contains("digest"), "{e}");
    }
}
