//! The tokenized cache: a data set's examples built once into a file ([`super::cache_file`])
//! and memory-mapped by every later run, resume, eval and rank of the node.
//!
//! Where: `$LORA_TRAIN_CACHE` when set (`off` turns the cache off), else
//! `$HF_HOME/lora-train/tokenized` (HF_HOME defaulting to `$XDG_CACHE_HOME/huggingface`, then
//! `~/.cache/huggingface`), beside the Hub's own cache: it works for read-only data
//! directories and Hub data sets alike, it is local to the node (flock and mmap are reliable),
//! and one `rm -r` clears it. Each data set is `<key>.tokens`, with `<key>.lock` beside it.
//!
//! The key is a sha256 of everything that decides the examples: each file's name, size and
//! content; each entry's format, columns and train_on; seq_len, on_bad_row, the vocabulary
//! size, train or eval; the tokenizer (tokenizer.json and tokenizer_config.json bytes, the
//! special and stop tokens) and the chat template; and this build's data code ([`CODE`] and
//! Cargo.lock). Packing, shuffling, seeds and mixing weights are not in it: they order the
//! examples at run time and share one cache.
//!
//! One process builds a key's file while holding its lock (the others wait, then map it);
//! it writes `<key>.tokens.tmp-<pid>` and renames it into place whole. A build that was
//! killed leaves only its temporary, which the next build in the directory removes (any key's
//! whose lock is free). A subset's fingerprint (an eval split's) is memoized beside its file
//! as `<key>.fnv-<subset hash>`.

use super::build::{build, Counts, Entry, Out};
use super::cache_file::{Mapped, Writer};
use super::progress::Progress;
use super::rows::format_name;
use super::store::Examples;
use super::stream::Tap;
use super::TextTokenizer;
use crate::recipe::DataSection;
use crate::util::lock::{flock_waiting, try_flock};
use anyhow::{Context, Result};
use ring::digest::{Context as Sha, SHA256};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The cache directory, or `off`.
pub const CACHE_VAR: &str = "LORA_TRAIN_CACHE";
/// Threads that tokenize (default: every core this process may use).
pub const WORKERS_VAR: &str = "LORA_TRAIN_DATA_WORKERS";
/// `off` keeps a run from streaming its first epoch (default: on where it can).
pub const STREAM_VAR: &str = "LORA_TRAIN_DATA_STREAM";

/// The data code whose change makes a new key: every file of src/data (a test holds the
/// list to the directory), and the dependencies' versions.
const CODE: &[(&str, &str)] = &[
    ("batch.rs", include_str!("batch.rs")),
    ("build.rs", include_str!("build.rs")),
    ("cache.rs", include_str!("cache.rs")),
    ("cache_file.rs", include_str!("cache_file.rs")),
    ("chat.rs", include_str!("chat.rs")),
    ("columns.rs", include_str!("columns.rs")),
    ("fnv.rs", include_str!("fnv.rs")),
    ("load.rs", include_str!("load.rs")),
    ("mod.rs", include_str!("mod.rs")),
    ("parquet.rs", include_str!("parquet.rs")),
    ("pref_batch.rs", include_str!("pref_batch.rs")),
    ("pref_set.rs", include_str!("pref_set.rs")),
    ("preference.rs", include_str!("preference.rs")),
    ("progress.rs", include_str!("progress.rs")),
    ("reader.rs", include_str!("reader.rs")),
    ("record.rs", include_str!("record.rs")),
    ("rows.rs", include_str!("rows.rs")),
    ("sampler.rs", include_str!("sampler.rs")),
    ("source.rs", include_str!("source.rs")),
    ("store.rs", include_str!("store.rs")),
    ("stream.rs", include_str!("stream.rs")),
    ("tokenizer.rs", include_str!("tokenizer.rs")),
    ("Cargo.lock", include_str!("../../Cargo.lock")),
];

/// Where a data set's examples are kept.
#[derive(Debug, Clone, PartialEq)]
pub enum Store {
    /// The cache in this directory.
    Cache(PathBuf),
    /// An unlinked temporary file (mapped like a cache file, gone with the process); the
    /// reason there is no cache.
    Temp(String),
    /// Memory (tests and tools).
    Memory,
}

/// How a data set is prepared.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Where the examples go.
    pub store: Store,
    /// Threads that parse and tokenize.
    pub workers: usize,
    /// Show a progress bar (a terminal) or progress lines (a log).
    pub progress: bool,
    /// A run whose first epoch reads the examples in file order may start on them as they
    /// land (`data::stream`).
    pub stream: bool,
}

impl Options {
    /// From LORA_TRAIN_CACHE, LORA_TRAIN_DATA_WORKERS, LORA_TRAIN_DATA_STREAM and the Hugging
    /// Face variables.
    pub fn from_env() -> Result<Options> {
        Options::from_vars(|k| std::env::var(k).ok())
    }

    /// No cache: an unlinked temporary file, the threads LORA_TRAIN_DATA_WORKERS says, no
    /// progress display (library callers and tests).
    pub fn uncached() -> Result<Options> {
        Ok(Options {
            store: Store::Temp(String::new()),
            progress: false,
            ..Options::from_env()?
        })
    }

    /// The same from any variable lookup (empty values count as unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Options> {
        let var = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let off = |v: &str| {
            ["off", "0", "false", "no", "none"].contains(&v.trim().to_ascii_lowercase().as_str())
        };
        let store = match var(CACHE_VAR) {
            Some(v) if off(&v) => Store::Temp(format!("{CACHE_VAR}={v}")),
            Some(v) => Store::Cache(PathBuf::from(v)),
            None => {
                let hf_home = var("HF_HOME").map(PathBuf::from).or_else(|| {
                    var("XDG_CACHE_HOME")
                        .map(PathBuf::from)
                        .or_else(|| var("HOME").map(|h| Path::new(&h).join(".cache")))
                        .map(|c| c.join("huggingface"))
                });
                match hf_home {
                    Some(h) => Store::Cache(h.join("lora-train").join("tokenized")),
                    None => Store::Temp(format!(
                        "HOME, HF_HOME and XDG_CACHE_HOME are unset: set {CACHE_VAR} to a directory to keep the tokenized data"
                    )),
                }
            }
        };
        let workers = match var(WORKERS_VAR) {
            Some(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n >= 1)
                .with_context(|| {
                    format!("{WORKERS_VAR} = \"{v}\" is not a number of threads (1 or more)")
                })?,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        Ok(Options {
            store,
            workers,
            progress: true,
            stream: !var(STREAM_VAR).is_some_and(|v| off(&v)),
        })
    }
}

/// How a data set's examples were made: read from the cache, or tokenized now.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Prep {
    /// Seconds spent (hashing the files, waiting for another builder, tokenizing, mapping).
    pub secs: f64,
    /// The cache file the examples are read from.
    pub cache: Option<PathBuf>,
    /// The examples came from a cache file built before (an earlier run, `prepare`, or
    /// another rank).
    pub reused: bool,
    /// Tokenized now: rows and bytes read, on this many threads.
    pub rows: usize,
    /// Bytes of data read.
    pub bytes: u64,
    /// Threads that tokenized.
    pub workers: usize,
    /// Why no cache was used (none when one was).
    pub no_cache: Option<String>,
}

impl Prep {
    /// Where the examples came from, and at what rate they were tokenized.
    pub fn describe(&self) -> String {
        let cache = self.cache.as_ref().map(|p| p.display().to_string());
        match (self.reused, cache) {
            (true, Some(p)) => format!("read from the tokenized cache {p}"),
            (_, cache) => {
                let s = self.secs.max(1e-3);
                let kept = match (cache, &self.no_cache) {
                    (Some(p), _) => format!("; cached in {p}"),
                    (None, Some(why)) => format!("; not cached: {why}"),
                    (None, None) => String::new(),
                };
                format!(
                    "tokenized {} rows ({:.1} MB) on {} threads: {:.0} rows/s, {:.1} MB/s{kept}",
                    self.rows,
                    self.bytes as f64 / 1e6,
                    self.workers,
                    self.rows as f64 / s,
                    self.bytes as f64 / 1e6 / s
                )
            }
        }
    }
}

/// The examples of `entries` with what building counted: from the cache when it holds
/// them, else built now (into the cache, a temporary file or memory, as `opts` says).
pub(super) fn examples(
    entries: &[Entry],
    cfg: &DataSection,
    tok: Option<&TextTokenizer>,
    vocab: usize,
    eval: bool,
    opts: &Options,
) -> Result<(Examples, Counts, Prep)> {
    let t0 = Instant::now();
    let place = place(entries, cfg, tok, vocab, eval, opts)?;
    let (ex, counts, mut prep) = prepare(&place, entries, cfg, vocab, opts, None)?;
    prep.secs = t0.elapsed().as_secs_f64();
    Ok((ex, counts, prep))
}

/// Where a data set's examples go, decided (the cache key hashed) before they are built.
#[derive(Debug, Clone)]
pub(super) enum Place {
    /// The cache file of this key in this directory.
    Cache(PathBuf, [u8; 32]),
    /// An unlinked temporary file; why there is no cache ("" when the caller asked for none).
    Temp(String),
    /// Memory (`Store::Memory`, or a big-endian host: cache files are little-endian).
    Memory,
}

/// Where `opts` puts the examples of `entries` (a cache directory that cannot be created
/// falls back to a temporary file).
pub(super) fn place(
    entries: &[Entry],
    cfg: &DataSection,
    tok: Option<&TextTokenizer>,
    vocab: usize,
    eval: bool,
    opts: &Options,
) -> Result<Place> {
    let little = cfg!(target_endian = "little");
    Ok(match &opts.store {
        Store::Cache(dir) if little => match std::fs::create_dir_all(dir) {
            Ok(()) => Place::Cache(dir.clone(), key(entries, cfg, tok, vocab, eval)?),
            Err(e) => Place::Temp(format!("cannot create {}: {e}", dir.display())),
        },
        Store::Temp(why) if little => Place::Temp(why.clone()),
        _ => Place::Memory,
    })
}

/// The examples at `place` when the cache holds them already (nothing is built).
pub(super) fn hit(place: &Place, entries: usize) -> Option<(Examples, Counts, Prep)> {
    let Place::Cache(dir, key) = place else {
        return None;
    };
    let path = cache_path(dir, key);
    let (m, c) = open_cached(&path, key, entries).ok()??;
    Some(reused(path, m, c, None))
}

/// Builds the examples of `entries` at `place` (or maps them, when the cache holds them);
/// `tap` is told of every chunk's records as they are written (a streaming run).
pub(super) fn prepare(
    place: &Place,
    entries: &[Entry],
    cfg: &DataSection,
    vocab: usize,
    opts: &Options,
    tap: Option<&Tap>,
) -> Result<(Examples, Counts, Prep)> {
    match place {
        Place::Cache(dir, key) => match cached(dir, key, entries, cfg, vocab, opts, tap) {
            Ok(x) => Ok(x),
            Err(e) => match e.downcast::<Unusable>() {
                Ok(Unusable(why)) => temp(entries, cfg, vocab, opts, why, tap),
                Err(e) => Err(e),
            },
        },
        Place::Temp(why) => temp(entries, cfg, vocab, opts, why.clone(), tap),
        Place::Memory => in_memory(entries, cfg, vocab, opts),
    }
}

/// Bytes of every file of the entries (the progress bar's total).
fn total_bytes(entries: &[Entry]) -> u64 {
    entries
        .iter()
        .flat_map(|e| &e.files)
        .filter_map(|f| std::fs::metadata(&f.path).ok())
        .map(|m| m.len())
        .sum()
}

/// What building into a file counted, with the thread count.
fn built(c: &Counts, opts: &Options) -> Prep {
    Prep {
        rows: c.rows,
        bytes: c.bytes,
        workers: opts.workers,
        ..Prep::default()
    }
}

/// The examples into a cache file's writer; with a tap, each chunk's records announced once
/// flushed.
struct FileOut<'t> {
    w: Writer,
    tap: Option<&'t Tap>,
    /// Records written since the last chunk (with a tap).
    landed: Vec<(u64, u32)>,
}

impl Out for FileOut<'_> {
    fn push(&mut self, ids: &[u32], labels: &[i64]) -> Result<()> {
        if self.tap.is_some() {
            self.landed.push((self.w.pos(), ids.len() as u32));
        }
        self.w
            .push(ids, labels)
            .context("cannot write the tokenized data")
    }

    fn chunk_done(&mut self, c: &Counts) -> Result<()> {
        let Some(tap) = self.tap else {
            return Ok(());
        };
        self.w.flush().context("cannot write the tokenized data")?;
        tap.publish(&mut self.landed, c)
    }
}

impl Out for Examples {
    fn push(&mut self, ids: &[u32], labels: &[i64]) -> Result<()> {
        Examples::push(self, ids, labels);
        Ok(())
    }
}

/// Builds into `file` (a writer for it), returning it finished for `key`.
fn build_file(
    file: File,
    key: &[u8; 32],
    entries: &[Entry],
    cfg: &DataSection,
    vocab: usize,
    opts: &Options,
    tap: Option<&Tap>,
) -> Result<(File, Counts)> {
    if let Some(t) = tap {
        t.open(
            file.try_clone()
                .context("cannot reopen the tokenized data")?,
        );
    }
    let mut out = FileOut {
        w: Writer::new(file).context("cannot write the tokenized data")?,
        tap,
        landed: Vec::new(),
    };
    let mut progress = Progress::new(total_bytes(entries), opts.progress);
    let counts = build(entries, cfg, vocab, opts.workers, &mut progress, &mut out)?;
    progress.finish();
    let meta = serde_json::to_vec(&counts)?;
    let file = out
        .w
        .finish(key, &meta)
        .context("cannot write the tokenized data")?;
    Ok((file, counts))
}

fn in_memory(
    entries: &[Entry],
    cfg: &DataSection,
    vocab: usize,
    opts: &Options,
) -> Result<(Examples, Counts, Prep)> {
    let mut ex = Examples::default();
    let mut progress = Progress::new(total_bytes(entries), opts.progress);
    let counts = build(entries, cfg, vocab, opts.workers, &mut progress, &mut ex)?;
    progress.finish();
    let prep = built(&counts, opts);
    Ok((ex, counts, prep))
}

/// Builds into an unlinked temporary file (memory when none can be made).
fn temp(
    entries: &[Entry],
    cfg: &DataSection,
    vocab: usize,
    opts: &Options,
    why: String,
    tap: Option<&Tap>,
) -> Result<(Examples, Counts, Prep)> {
    let Some(file) = unlinked_temp() else {
        if tap.is_some() {
            anyhow::bail!("no temporary file to stream the tokenized data through");
        }
        let (ex, c, mut prep) = in_memory(entries, cfg, vocab, opts)?;
        prep.no_cache = Some(why);
        return Ok((ex, c, prep));
    };
    let key = [0u8; 32];
    let (file, counts) = build_file(file, &key, entries, cfg, vocab, opts, tap)?;
    let m = Mapped::open(file, None, &key)
        .map_err(|e| anyhow::anyhow!("the tokenized data just written is unreadable: {e}"))?;
    let mut prep = built(&counts, opts);
    prep.no_cache = Some(why).filter(|w| !w.is_empty());
    Ok((Examples::mapped(Arc::new(m)), counts, prep))
}

/// A new file in the temporary directory, already unlinked (gone when closed).
fn unlinked_temp() -> Option<File> {
    let dir = std::env::temp_dir();
    for n in 0..100u32 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let p = dir.join(format!(
            "lora-train-tokens-{}-{nanos}-{n}",
            std::process::id()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&p);
        if let Ok(f) = f {
            let _ = std::fs::remove_file(&p);
            return Some(f);
        }
    }
    None
}

/// The cache file for `key` in `dir`: mapped if there and sound, else built under the lock.
fn cached(
    dir: &Path,
    key: &[u8; 32],
    entries: &[Entry],
    cfg: &DataSection,
    vocab: usize,
    opts: &Options,
    tap: Option<&Tap>,
) -> Result<(Examples, Counts, Prep)> {
    let hex = hex_of(key);
    let path = cache_path(dir, key);
    if let Ok(Some((m, c))) = open_cached(&path, key, entries.len()) {
        return Ok(reused(path, m, c, tap));
    }
    let lock_path = dir.join(format!("{hex}.lock"));
    let _lock = lock(&lock_path).map_err(|e| Unusable(format!("{e:#}")))?;
    // Another process may have built it while this one waited.
    match open_cached(&path, key, entries.len()) {
        Ok(Some((m, c))) => return Ok(reused(path, m, c, tap)),
        Ok(None) => {}
        Err(why) => crate::errln!(
            "the tokenized cache {} is not to be trusted ({why}): building it again",
            path.display()
        ),
    }
    remove_stale(dir, &hex);
    let tmp = dir.join(format!("{hex}.tokens.tmp-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| Unusable(format!("cannot create {}: {e}", tmp.display())))?;
    let done = build_file(file, key, entries, cfg, vocab, opts, tap).and_then(|(file, counts)| {
        std::fs::rename(&tmp, &path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok((file, counts))
    });
    let (file, counts) = match done {
        Ok(x) => x,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    let m = Mapped::open(file, Some(path.clone()), key).map_err(|e| {
        anyhow::anyhow!(
            "the tokenized cache {} just written is unreadable: {e}",
            path.display()
        )
    })?;
    let prep = Prep {
        cache: Some(path),
        ..built(&counts, opts)
    };
    Ok((Examples::mapped(Arc::new(m)), counts, prep))
}

fn hex_of(key: &[u8; 32]) -> String {
    key[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// The cache file of `key` in `dir`.
fn cache_path(dir: &Path, key: &[u8; 32]) -> PathBuf {
    dir.join(format!("{}.tokens", hex_of(key)))
}

/// A cache file found whole: its examples mapped (and all announced on `tap`).
fn reused(path: PathBuf, m: Mapped, c: Counts, tap: Option<&Tap>) -> (Examples, Counts, Prep) {
    if let (Some(t), Ok(f)) = (tap, m.reopen()) {
        t.open(f);
        let mut all: Vec<(u64, u32)> = m.records().collect();
        // A stopped stream has no reader left to tell.
        let _ = t.publish(&mut all, &c);
    }
    let prep = Prep {
        cache: Some(path),
        reused: true,
        ..Prep::default()
    };
    (Examples::mapped(Arc::new(m)), c, prep)
}

/// The cache directory cannot be written (read-only, no permission): the data is prepared
/// without it, and the run says why.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Unusable(String);

/// The cache file at `path` with its counts: None when there is none, Err(why) when one is
/// there but not to be trusted (the caller rebuilds it).
fn open_cached(
    path: &Path,
    key: &[u8; 32],
    entries: usize,
) -> Result<Option<(Mapped, Counts)>, String> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot open it: {e}")),
    };
    let m = Mapped::open(file, Some(path.to_path_buf()), key)?;
    let c: Counts =
        serde_json::from_slice(m.meta()).map_err(|e| format!("its meta is not ours: {e}"))?;
    if c.per_entry.len() != entries || c.per_entry.iter().sum::<usize>() != m.len() {
        return Err("its meta does not match its examples".into());
    }
    Ok(Some((m, c)))
}

/// Removes the temporaries of killed builds in `dir`: `<key>.tokens.tmp-<pid>` files whose
/// key's lock is free (no build of that key is running; `held` is the key whose lock the
/// caller holds, its temporaries are stale too).
fn remove_stale(dir: &Path, held: &str) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some((key, _)) = name.to_str().and_then(|n| n.split_once(".tokens.tmp-")) else {
            continue;
        };
        let idle = key == held || try_lock(&dir.join(format!("{key}.lock"))).is_some();
        if idle {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The key's lock: the file held open and flock()ed; released when dropped.
struct Lock {
    _file: File,
}

fn lock(path: &Path) -> Result<Lock> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open the lock file {}", path.display()))?;
    flock_waiting(
        &file,
        path,
        "waiting while another process or rank prepares the same data",
    )?;
    Ok(Lock { _file: file })
}

/// The lock at `path` when it is free now (never waits; None when held or absent).
fn try_lock(path: &Path) -> Option<Lock> {
    let file = std::fs::OpenOptions::new().write(true).open(path).ok()?;
    try_flock(&file).then_some(Lock { _file: file })
}

/// The sha256 of everything that decides the examples (see the module docs).
fn key(
    entries: &[Entry],
    cfg: &DataSection,
    tok: Option<&TextTokenizer>,
    vocab: usize,
    eval: bool,
) -> Result<[u8; 32]> {
    let mut h = Sha::new(&SHA256);
    let mut put = |b: &[u8]| {
        h.update(&(b.len() as u64).to_le_bytes());
        h.update(b);
    };
    put(b"lora-train tokenized cache 1");
    for (name, text) in CODE {
        put(name.as_bytes());
        put(text.as_bytes());
    }
    put(format!(
        "eval {eval} vocab {vocab} seq_len {} on_bad_row {:?}",
        cfg.seq_len, cfg.on_bad_row
    )
    .as_bytes());
    match tok {
        Some(t) => {
            put(&t.digest);
            put(format!("{:?}", t.identity()).as_bytes());
        }
        None => put(b"no tokenizer"),
    }
    for e in entries {
        match e.chat {
            Some(c) => {
                put(&c.digest);
                put(c.source.as_bytes());
            }
            None => put(b"no chat template"),
        }
        put(e.path.as_os_str().as_encoded_bytes());
        let cols: Vec<(&str, &str, bool)> = e.columns.iter().collect();
        put(format!(
            "{} {cols:?} sharegpt {} completions_only {}",
            format_name(e.format),
            e.columns.sharegpt_fallback,
            e.completions_only
        )
        .as_bytes());
        for f in &e.files {
            put(f.name.as_bytes());
            let (size, digest) =
                file_digest(&f.path).with_context(|| format!("cannot read {}", f.name))?;
            put(&size.to_le_bytes());
            put(&digest);
        }
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(h.finish().as_ref());
    Ok(out)
}

/// A file's size and sha256.
fn file_digest(path: &Path) -> std::io::Result<(u64, [u8; 32])> {
    let mut f = File::open(path)?;
    let mut h = Sha::new(&SHA256);
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        size += n as u64;
        h.update(&buf[..n]);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(h.finish().as_ref());
    Ok((size, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_list_is_every_file_of_src_data() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/data");
        let mut have: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".rs"))
            .collect();
        have.sort();
        let listed: Vec<&str> = CODE
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| n.ends_with(".rs"))
            .collect();
        assert_eq!(have, listed);
    }

    #[test]
    fn options_follow_the_environment() {
        let with = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            Options::from_vars(move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
        };
        let o = with(&[("HOME", "/h")]).unwrap();
        assert_eq!(
            o.store,
            Store::Cache(PathBuf::from("/h/.cache/huggingface/lora-train/tokenized"))
        );
        assert!(o.workers >= 1);
        let o = with(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]).unwrap();
        assert_eq!(
            o.store,
            Store::Cache(PathBuf::from("/x/huggingface/lora-train/tokenized"))
        );
        let o = with(&[("HOME", "/h"), ("HF_HOME", "/hf")]).unwrap();
        assert_eq!(
            o.store,
            Store::Cache(PathBuf::from("/hf/lora-train/tokenized"))
        );
        let o = with(&[("HF_HOME", "/hf"), (CACHE_VAR, "/c"), (WORKERS_VAR, "3")]).unwrap();
        assert_eq!((o.store, o.workers), (Store::Cache(PathBuf::from("/c")), 3));
        let o = with(&[("HOME", "/h"), (CACHE_VAR, "off")]).unwrap();
        assert_eq!(o.store, Store::Temp(format!("{CACHE_VAR}=off")));
        assert!(o.stream);
        assert!(!with(&[(STREAM_VAR, "Off")]).unwrap().stream);
        let Store::Temp(why) = with(&[]).unwrap().store else {
            panic!()
        };
        assert!(
            why.contains("HOME, HF_HOME and XDG_CACHE_HOME are unset"),
            "{why}"
        );
        let e = with(&[(WORKERS_VAR, "0")]).unwrap_err().to_string();
        assert!(e.contains("not a number of threads"), "{e}");
    }
}
