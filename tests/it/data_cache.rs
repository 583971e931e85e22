//! The tokenized cache and the parallel tokenizer against the data path as it was before them
//! (main at 6ba318d): every shipped format (text, alpaca, chat, completion, tokens, parquet),
//! a weighted mix, truncation, skipped rows and a held-out eval split, each packed and
//! shuffled, give the same examples, counts, fingerprints and batches, bit for bit.
//!
//! tests/fixtures/data_cache/batches.json holds the digests that code gave
//! (`cargo test --release --locked data_cache::write_batch_digests -- --ignored` at 6ba318d
//! wrote it; run at a later commit it rewrites the file from the code of that commit).

use crate::chat::load;
use crate::common::root;
use lora_train::data::{Batch, Dataset, Options, Sampler, Store, TextTokenizer};
use lora_train::recipe::DataSection;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// FNV-1a over 64-bit words (a digest of everything a case yields).
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn w(&mut self, x: u64) {
        for b in x.to_le_bytes() {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn all(&mut self, xs: impl IntoIterator<Item = u64>) {
        let mut n = 0;
        for x in xs {
            self.w(x);
            n += 1;
        }
        self.w(n);
    }
}

fn tiny() -> PathBuf {
    root().join("recipes/assets/tiny-llama")
}

fn hub_fixtures() -> PathBuf {
    root().join("tests/fixtures/hub_data")
}

/// Token rows: lengths 1..=90, some with their own labels (-100 on the first half).
fn tokens_file(dir: &Path) -> PathBuf {
    let path = dir.join("tokens.jsonl");
    let mut text = String::new();
    for i in 0..50usize {
        let n = (i * 37) % 90 + 1;
        let ids: Vec<usize> = (0..n).map(|j| (i * 13 + j * 7) % 500).collect();
        let ids_s: Vec<String> = ids.iter().map(|t| t.to_string()).collect();
        if i % 3 == 0 {
            let labels: Vec<String> = ids
                .iter()
                .enumerate()
                .map(|(j, t)| {
                    if j < n / 2 {
                        "-100".into()
                    } else {
                        t.to_string()
                    }
                })
                .collect();
            text += &format!(
                "{{\"input_ids\": [{}], \"labels\": [{}]}}\n",
                ids_s.join(","),
                labels.join(",")
            );
        } else {
            text += &format!("{{\"input_ids\": [{}]}}\n", ids_s.join(","));
        }
    }
    std::fs::write(&path, text).unwrap();
    path
}

/// Rows of recipes/data/tiny-alpaca.jsonl with bad ones between them (on_bad_row = "skip").
fn bad_rows_file(dir: &Path) -> PathBuf {
    let path = dir.join("bad.jsonl");
    let good = std::fs::read_to_string(root().join("recipes/data/tiny-alpaca.jsonl")).unwrap();
    let mut text = String::new();
    for (i, l) in good.lines().enumerate() {
        text += l;
        text += "\n";
        if i % 7 == 3 {
            text += "{\"instruction\": 5, \"output\": \"x\"}\nnot json\n\n";
        }
    }
    std::fs::write(&path, text).unwrap();
    path
}

/// (case name, `[data]` lines): every format, packed and shuffled.
fn cases(dir: &Path) -> Vec<(&'static str, String)> {
    let r = |p: &str| root().join(p).display().to_string();
    let tokens = tokens_file(dir).display().to_string();
    let bad = bad_rows_file(dir).display().to_string();
    let alpaca_pq = hub_fixtures().join("alpaca/data/train-00000-of-00002.parquet");
    let sharegpt_pq = hub_fixtures().join("sharegpt/train.parquet");
    vec![
        (
            "text",
            format!(
                "train = \"{}\"\nformat = \"text\"\nseq_len = 24\npack = true",
                r("recipes/data/tiny-text.jsonl")
            ),
        ),
        (
            "text-unpacked",
            format!(
                "train = \"{}\"\nformat = \"text\"\nseq_len = 16",
                r("recipes/data/tiny-text.jsonl")
            ),
        ),
        (
            "alpaca",
            format!(
                "train = \"{}\"\nformat = \"alpaca\"\nseq_len = 165\npack = true",
                r("recipes/data/tiny-alpaca.jsonl")
            ),
        ),
        (
            "alpaca-all",
            format!(
                "train = \"{}\"\nformat = \"alpaca\"\nseq_len = 64\npack = true\ntrain_on = \"all\"",
                r("recipes/data/tiny-alpaca.jsonl")
            ),
        ),
        (
            "chat",
            format!(
                "train = \"{}\"\nformat = \"chat\"\nseq_len = 128\npack = true",
                r("recipes/data/tiny-chat.jsonl")
            ),
        ),
        (
            "completion",
            format!(
                "train = \"{}\"\nformat = \"completion\"\nseq_len = 48\npack = true\ncolumns = {{ prompt = \"instruction\", completion = \"output\" }}",
                r("recipes/data/tiny-alpaca.jsonl")
            ),
        ),
        (
            "tokens",
            format!("train = \"{tokens}\"\nformat = \"tokens\"\nseq_len = 64\npack = true"),
        ),
        (
            "parquet-alpaca",
            format!(
                "train = \"{}\"\nformat = \"alpaca\"\nseq_len = 256\npack = true\ncolumns = {{ instruction = \"question\", input = \"context\", output = \"answer\" }}",
                alpaca_pq.display()
            ),
        ),
        (
            "parquet-sharegpt",
            format!(
                "train = \"{}\"\nformat = \"chat\"\nseq_len = 128\npack = true",
                sharegpt_pq.display()
            ),
        ),
        (
            "mix",
            format!(
                "train = [{{ path = \"{}\", weight = 2.0 }}, {{ path = \"{}\", weight = 0.5, format = \"chat\" }}, {{ path = \"{tokens}\", weight = 1.5, format = \"tokens\" }}]\nformat = \"alpaca\"\nseq_len = 200\npack = true",
                r("recipes/data/tiny-alpaca.jsonl"),
                r("recipes/data/tiny-chat.jsonl")
            ),
        ),
        (
            "skip",
            format!(
                "train = \"{bad}\"\nformat = \"alpaca\"\nseq_len = 40\npack = true\non_bad_row = \"skip\"\ntrain_on = \"all\""
            ),
        ),
    ]
}

/// The cases' data sections.
fn section(lines: &str) -> DataSection {
    toml::from_str(lines).unwrap()
}

/// Everything a data set gives training: its counts, the sampler's fingerprint, and two
/// shuffled epochs of micro-batches of 4 rows.
fn digest(ds: &Dataset, cfg: &DataSection, seed: u64) -> String {
    let mut h = Fnv::new();
    h.all([
        ds.examples.len() as u64,
        ds.truncated as u64,
        ds.skipped as u64,
        ds.no_targets as u64,
        ds.no_answer as u64,
        ds.eos_added as u64,
    ]);
    h.all(
        ds.turn_ends
            .iter()
            .flat_map(|(&k, &v)| [k as u64, v as u64]),
    );
    h.all(ds.file_of.iter().map(|&k| k as u64));
    let s = Sampler::new(ds, cfg, seed);
    h.w(s.fingerprint());
    for epoch in 0..2 {
        let rows = s.rows(epoch);
        for chunk in rows.chunks(4) {
            let b = batch(ds, chunk, cfg.pack);
            h.all([b.b as u64, b.t as u64, b.tokens as u64]);
            h.all(b.ids.iter().map(|&x| x as u64));
            h.all(b.positions.iter().map(|&x| x as u64));
            h.all(b.segments.iter().flatten().map(|&x| x as u64));
            h.all(b.targets.iter().flat_map(|&(i, t)| [i as u64, t as u64]));
            h.all(b.real.iter().map(|&x| x as u64));
        }
    }
    format!("{:016x}", h.0)
}

/// The micro-batch of `rows` (example indices of `ds`).
fn batch(ds: &Dataset, rows: &[Vec<usize>], packed: bool) -> Batch {
    let rows: Vec<Vec<_>> = rows
        .iter()
        .map(|r| r.iter().map(|&i| ds.examples.get(i)).collect())
        .collect();
    Batch::from_rows(&rows, 0, packed)
}

/// Every case's digest (and, split 10% for eval, the split's two), loaded by `load`; the
/// files the cases write go to `dir`.
fn digests(
    dir: &Path,
    load: &dyn Fn(&DataSection, &TextTokenizer) -> Dataset,
) -> BTreeMap<String, String> {
    let tok = load_tok();
    let mut out = BTreeMap::new();
    for (name, lines) in cases(dir) {
        let cfg = section(&lines);
        let mut ds = load(&cfg, &tok);
        eprintln!(
            "{name}: {} examples, {} truncated, {} skipped, {} no target left, {} no answer",
            ds.examples.len(),
            ds.truncated,
            ds.skipped,
            ds.no_targets,
            ds.no_answer
        );
        out.insert(name.to_string(), digest(&ds, &cfg, 7));
        let ev = ds.split_eval(0.1, 7);
        out.insert(format!("{name}/split-train"), digest(&ds, &cfg, 7));
        out.insert(format!("{name}/split-eval"), digest(&ev, &cfg, 0));
    }
    out
}

fn load_tok() -> TextTokenizer {
    load(&tiny())
}

fn fixture() -> PathBuf {
    root().join("tests/fixtures/data_cache/batches.json")
}

/// Writes the fixture from this commit's data path (see the module docs).
#[test]
#[ignore]
fn write_batch_digests() {
    let tmp = tempfile::tempdir().unwrap();
    let d = digests(tmp.path(), &|cfg, tok| {
        Dataset::load(cfg, Some(tok), 512).unwrap()
    });
    std::fs::create_dir_all(fixture().parent().unwrap()).unwrap();
    std::fs::write(fixture(), serde_json::to_string_pretty(&d).unwrap() + "\n").unwrap();
}

/// The options of a test: the cache (or none) in `store`, `workers` threads, no progress.
fn opts(store: Store, workers: usize) -> Options {
    Options {
        store,
        workers,
        progress: false,
        stream: false,
    }
}

/// A case's data section loaded as `o` says.
fn load_with(cfg: &DataSection, tok: &TextTokenizer, o: &Options) -> Dataset {
    Dataset::load_files_with(&cfg.train.files(cfg.format), cfg, Some(tok), 512, o).unwrap()
}

fn want_digests() -> BTreeMap<String, String> {
    serde_json::from_str(&std::fs::read_to_string(fixture()).unwrap()).unwrap()
}

/// The acceptance: the parallel path into the cache, the same read back from the cache, into
/// an unlinked file, and in memory on one thread all give today's examples, counts,
/// fingerprints and batches, bit for bit.
#[test]
fn batches_match_the_pre_cache_digests_on_every_format() {
    let want = want_digests();
    assert_eq!(want.len(), 33, "every case and its split");
    let tmp = tempfile::tempdir().unwrap();
    let files = tmp.path();
    let dir = tmp.path().join("cache");
    let built = digests(files, &|cfg, tok| {
        let ds = load_with(cfg, tok, &opts(Store::Cache(dir.clone()), 2));
        assert!(!ds.prep.reused && ds.prep.cache.is_some(), "{:?}", ds.prep);
        assert_eq!(ds.prep.workers, 2);
        ds
    });
    assert_eq!(built, want, "built into the cache on 2 threads");
    let reused = digests(files, &|cfg, tok| {
        let ds = load_with(cfg, tok, &opts(Store::Cache(dir.clone()), 2));
        assert!(ds.prep.reused, "{:?}", ds.prep);
        ds
    });
    assert_eq!(reused, want, "mapped from the cache");
    let temp = digests(files, &|cfg, tok| {
        load_with(cfg, tok, &opts(Store::Temp(String::new()), 3))
    });
    assert_eq!(temp, want, "an unlinked file, 3 threads");
    let memory = digests(files, &|cfg, tok| {
        load_with(cfg, tok, &opts(Store::Memory, 1))
    });
    assert_eq!(memory, want, "in memory, 1 thread");
    // One cache file per case (a split shares its data set's), nothing else but locks.
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names.iter().filter(|n| n.ends_with(".tokens")).count(),
        11,
        "{names:?}"
    );
    assert!(
        names
            .iter()
            .all(|n| n.ends_with(".tokens") || n.ends_with(".lock") || n.contains(".fnv-")),
        "{names:?}"
    );
}

/// A changed data file, tokenizer or recipe field makes a new cache file; settings that only
/// order the examples (pack, shuffle, weights) reuse it.
#[test]
fn what_decides_the_examples_keys_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let o = opts(Store::Cache(cache.clone()), 2);
    let data = tmp.path().join("rows.jsonl");
    let rows = std::fs::read_to_string(root().join("recipes/data/tiny-alpaca.jsonl")).unwrap();
    std::fs::write(&data, &rows).unwrap();
    // `[data]` lines: train, format = "alpaca", seq_len = 200, with `over` replacing or adding.
    let lines = |over: &[(&str, &str)]| {
        let mut kv: Vec<(String, String)> = vec![
            ("train".into(), format!("\"{}\"", data.display())),
            ("format".into(), "\"alpaca\"".into()),
            ("seq_len".into(), "200".into()),
        ];
        for (k, v) in over {
            match kv.iter_mut().find(|(key, _)| key == k) {
                Some(slot) => slot.1 = v.to_string(),
                None => kv.push((k.to_string(), v.to_string())),
            }
        }
        kv.iter()
            .map(|(k, v)| format!("{k} = {v}\n"))
            .collect::<String>()
    };
    let base = lines(&[]);
    let tok = load_tok();
    let reused = |lines: &str, tok: &TextTokenizer| {
        let ds = load_with(&section(lines), tok, &o);
        ds.prep.reused
    };
    assert!(!reused(&base, &tok), "a first run builds");
    assert!(reused(&base, &tok), "a second run reuses");
    for same in [
        ("pack", "true"),
        ("shuffle", "false"),
        ("eval_fraction", "0.2"),
        ("prompt_field", "\"q\""),
    ] {
        assert!(reused(&lines(&[same]), &tok), "{same:?}");
    }
    // Each of these makes a new file (and a second load of it reuses that one).
    for other in [
        vec![("seq_len", "180")],
        vec![("train_on", "\"all\"")],
        vec![("on_bad_row", "\"skip\"")],
        vec![("columns", "{ input = \"instruction\" }")],
        vec![
            ("format", "\"completion\""),
            (
                "columns",
                "{ prompt = \"instruction\", completion = \"output\" }",
            ),
        ],
    ] {
        assert!(!reused(&lines(&other), &tok), "{other:?} must invalidate");
        assert!(reused(&lines(&other), &tok), "{other:?}, again");
    }
    // The file's content, at the same size and name.
    let changed = rows.replacen("four", "FOUR", 1);
    assert_eq!(changed.len(), rows.len());
    std::fs::write(&data, &changed).unwrap();
    assert!(!reused(&base, &tok), "a changed data file");
    assert!(reused(&base, &tok));
    // The tokenizer: its tokenizer_config.json (another eos_token), then tokenizer.json.
    let tdir = tmp.path().join("tok");
    std::fs::create_dir(&tdir).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "generation_config.json",
    ] {
        std::fs::copy(tiny().join(f), tdir.join(f)).unwrap();
    }
    assert!(
        reused(&base, &load(&tdir)),
        "the same tokenizer files elsewhere"
    );
    let cfg_text = std::fs::read_to_string(tdir.join("tokenizer_config.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&cfg_text).unwrap();
    let mut v = v.as_object().unwrap().clone();
    v.insert("add_eos_token".into(), serde_json::Value::Bool(true));
    std::fs::write(
        tdir.join("tokenizer_config.json"),
        serde_json::to_string(&v).unwrap(),
    )
    .unwrap();
    assert!(
        !reused(&base, &load(&tdir)),
        "a changed tokenizer_config.json"
    );
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tdir.join("tokenizer.json")).unwrap())
            .unwrap();
    std::fs::write(
        tdir.join("tokenizer.json"),
        serde_json::to_string_pretty(&t).unwrap(),
    )
    .unwrap();
    assert!(!reused(&base, &load(&tdir)), "a changed tokenizer.json");
    assert!(reused(&base, &load(&tdir)));
}

/// A file under the final name that is not whole (a truncated copy, a damaged index) is
/// rebuilt, never read; a killed build's temporary is removed by the next build.
#[test]
fn a_damaged_or_partial_cache_file_is_rebuilt() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let o = opts(Store::Cache(cache.clone()), 2);
    let cfg = section(&format!(
        "train = \"{}\"\nformat = \"text\"\nseq_len = 32",
        root().join("recipes/data/tiny-text.jsonl").display()
    ));
    let tok = load_tok();
    let first = load_with(&cfg, &tok, &o);
    let path = first.prep.cache.clone().unwrap();
    let want = digest(&first, &cfg, 1);
    drop(first);
    let bytes = std::fs::read(&path).unwrap();
    let stem = path.file_name().unwrap().to_string_lossy().into_owned();
    let stale = cache.join(format!("{stem}.tmp-999999"));
    // Another key's temporary: stale when its lock is free, kept while a build holds it.
    let other = "0123456789abcdef0123456789abcdef";
    let (other_tmp, other_lock) = (
        cache.join(format!("{other}.tokens.tmp-7")),
        cache.join(format!("{other}.lock")),
    );
    for (what, bad) in [
        ("cut short", bytes[..bytes.len() / 2].to_vec()),
        ("no header", {
            let mut b = bytes.clone();
            b[..64].fill(0);
            b
        }),
        ("a flipped index bit", {
            let mut b = bytes.clone();
            let i = b.len() - 40;
            b[i] ^= 4;
            b
        }),
    ] {
        std::fs::write(&path, &bad).unwrap();
        std::fs::write(&stale, &bytes[..1000]).unwrap();
        std::fs::write(&other_tmp, b"x").unwrap();
        std::fs::write(&other_lock, b"").unwrap();
        let held = std::fs::File::open(&other_lock).unwrap();
        // SAFETY: flock on a descriptor this test owns.
        let got = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&held), libc::LOCK_EX) };
        assert_eq!(got, 0);
        let ds = load_with(&cfg, &tok, &o);
        assert!(
            other_tmp.exists(),
            "{what}: a running build's temporary is kept"
        );
        drop(held);
        std::fs::remove_file(&path).unwrap();
        assert!(!load_with(&cfg, &tok, &o).prep.reused);
        assert!(
            !other_tmp.exists(),
            "{what}: a dead build's temporary is removed"
        );
        assert!(!ds.prep.reused, "{what}: rebuilt");
        assert_eq!(digest(&ds, &cfg, 1), want, "{what}");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            bytes,
            "{what}: the same file again"
        );
        assert!(
            !stale.exists(),
            "{what}: the killed build's temporary is gone"
        );
        assert!(load_with(&cfg, &tok, &o).prep.reused, "{what}: then reused");
    }
}

/// A text row far longer than seq_len (2 MB) is cut before tokenizing: the examples are
/// those of tokenizing it whole and truncating, and it is counted as truncated.
#[test]
fn a_huge_row_is_cut_before_tokenizing_with_the_same_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let words = [
        "red", "fox", "jumps", "over", "the", "lazy", "dog", "seven", "plus", "two",
    ];
    let mut text = String::new();
    let mut k = 0usize;
    while text.len() < 2_000_000 {
        text += words[k % words.len()];
        text += if k % 7 == 6 { ". " } else { " " };
        k = k * 31 % 1009 + 1;
    }
    let data = tmp.path().join("huge.jsonl");
    let short = r#"{"text": "Five times four is twenty."}"#;
    let row = serde_json::json!({ "text": text }).to_string();
    std::fs::write(&data, format!("{short}\n{row}\n{short}\n")).unwrap();
    let tok = load_tok();
    for seq_len in [64, 4096] {
        let cfg = section(&format!(
            "train = \"{}\"\nformat = \"text\"\nseq_len = {seq_len}",
            data.display()
        ));
        let ds = load_with(&cfg, &tok, &opts(Store::Memory, 2));
        assert_eq!((ds.examples.len(), ds.truncated), (3, 1));
        let whole = tok.encode(&text).unwrap();
        assert!(whole.len() > 100_000);
        assert_eq!(
            ds.examples.get(1).ids,
            &whole[..seq_len],
            "seq_len {seq_len}"
        );
        assert_eq!(
            ds.examples.get(0).ids,
            &tok.encode("Five times four is twenty.").unwrap()[..]
        );
    }
}

/// A cache directory that cannot be used (not a directory; a lock that cannot be taken) only
/// costs the cache: the run tokenizes into an unlinked file and says why.
#[test]
fn an_unusable_cache_directory_falls_back_to_no_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = section(&format!(
        "train = \"{}\"\nformat = \"text\"\nseq_len = 32",
        root().join("recipes/data/tiny-text.jsonl").display()
    ));
    let tok = load_tok();
    let want = digest(&load_with(&cfg, &tok, &opts(Store::Memory, 1)), &cfg, 1);
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let ds = load_with(&cfg, &tok, &opts(Store::Cache(file.join("cache")), 2));
    let why = ds.prep.no_cache.clone().unwrap_or_default();
    assert!(
        why.starts_with("cannot create") && ds.prep.cache.is_none(),
        "{:?}",
        ds.prep
    );
    assert_eq!(digest(&ds, &cfg, 1), want);
    // The lock file is a directory: it cannot be opened.
    let cache = tmp.path().join("cache");
    let built = load_with(&cfg, &tok, &opts(Store::Cache(cache.clone()), 2));
    let path = built.prep.cache.clone().unwrap();
    drop(built);
    std::fs::remove_file(&path).unwrap();
    let lock = path.with_extension("lock");
    std::fs::remove_file(&lock).unwrap();
    std::fs::create_dir(&lock).unwrap();
    let ds = load_with(&cfg, &tok, &opts(Store::Cache(cache), 2));
    let why = ds.prep.no_cache.clone().unwrap_or_default();
    assert!(why.contains("cannot open the lock file"), "{:?}", ds.prep);
    assert!(ds
        .prep
        .describe()
        .contains("not cached: cannot open the lock file"));
    assert_eq!(digest(&ds, &cfg, 1), want);
}
