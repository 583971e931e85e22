//! The tokenized cache through the real binary: `prepare` fills it and `train` maps it, a
//! preparation killed mid-write leaves nothing a later run trusts, two processes preparing
//! the same data build it once, and one huge row costs memory for seq_len tokens, not for
//! the row (issue 63's 200 MB row; here 64 MB, with the process's peak RSS measured).

use crate::common::root;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn bin_path() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_lora-train"))
}

/// `lora-train <args>` with the cache in `cache` and `workers` tokenizing threads.
fn cmd(cache: &Path, workers: usize, args: &[&str]) -> Command {
    let mut c = Command::new(bin_path());
    c.args(args)
        .env("LORA_TRAIN_CACHE", cache)
        .env("LORA_TRAIN_DATA_WORKERS", workers.to_string())
        .current_dir(root());
    c
}

/// A recipe in `dir` training the tiny model on `data` (format `format`, seq_len `seq_len`).
fn recipe(dir: &Path, data: &Path, format: &str, seq_len: usize) -> PathBuf {
    let p = dir.join("recipe.toml");
    std::fs::write(
        &p,
        format!(
            "[model]\npath = \"{}\"\ndtype = \"f32\"\ndevice = \"cpu\"\n\n[lora]\nrank = 4\nalpha = 8\n\n\
             [data]\ntrain = \"{}\"\nformat = \"{format}\"\nseq_len = {seq_len}\npack = true\n\n\
             [train]\nmicro_batch = 2\nmax_steps = 2\nlr = 1e-3\n\n[output]\ndir = \"{}\"\n",
            root().join("recipes/assets/tiny-llama").display(),
            data.display(),
            dir.join("run").display()
        ),
    )
    .unwrap();
    p
}

/// `n` distinct Alpaca rows (the tiny data set's, numbered).
fn alpaca_rows(path: &Path, n: usize) {
    let base: Vec<serde_json::Value> =
        std::fs::read_to_string(root().join("recipes/data/tiny-alpaca.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    let mut text = String::new();
    for i in 0..n {
        let mut r = base[i % base.len()].clone();
        r["output"] = format!("{} ({i})", r["output"].as_str().unwrap()).into();
        text += &r.to_string();
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

fn run(c: &mut Command) -> (String, String) {
    let o = c.output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "{out}\n{err}");
    (out, err)
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn prepare_fills_the_cache_and_train_maps_it() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let data = tmp.path().join("rows.jsonl");
    alpaca_rows(&data, 300);
    let r = recipe(tmp.path(), &data, "alpaca", 200);
    let r = r.to_str().unwrap();
    let (out, _) = run(&mut cmd(&cache, 2, &["prepare", "--recipe", r]));
    assert!(out.contains("tokenized 300 rows"), "{out}");
    assert!(out.contains("on 2 threads"), "{out}");
    assert!(
        out.contains(&format!("cached in {}", cache.display())),
        "{out}"
    );
    let (again, _) = run(&mut cmd(&cache, 2, &["prepare", "--recipe", r]));
    assert!(again.contains("read from the tokenized cache"), "{again}");
    let (_, err) = run(&mut cmd(&cache, 2, &["train", "--recipe", r]));
    assert!(err.contains("read from the tokenized cache"), "{err}");
    let loaded = err.lines().find(|l| l.starts_with("loaded in")).unwrap();
    assert!(
        loaded.contains(": data ") && loaded.contains(", weights "),
        "{loaded}"
    );
    // Another packing and another seed order the same examples: the same file.
    let (_, err) = run(cmd(&cache, 2, &["train", "--recipe", r]).args([
        "--set",
        "data.pack=false",
        "--set",
        "train.seed=3",
        "--set",
        &format!("output.dir={}", tmp.path().join("run2").display()),
    ]));
    assert!(err.contains("read from the tokenized cache"), "{err}");
    let files = names(&cache);
    assert_eq!(
        files.iter().filter(|n| n.ends_with(".tokens")).count(),
        1,
        "{files:?}"
    );
}

#[test]
fn a_killed_preparation_leaves_nothing_that_a_later_run_trusts() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let data = tmp.path().join("rows.jsonl");
    alpaca_rows(&data, 12_000);
    let r = recipe(tmp.path(), &data, "alpaca", 200);
    let r = r.to_str().unwrap();
    let mut child = cmd(&cache, 1, &["prepare", "--recipe", r])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Killed once its temporary holds examples (the writer flushes a MiB at a time).
    let started = std::time::Instant::now();
    let tmp_file = loop {
        let found = names(&cache)
            .into_iter()
            .find(|n| n.contains(".tokens.tmp-"));
        if let Some(f) = found.map(|f| cache.join(f)) {
            if std::fs::metadata(&f).map_or(0, |m| m.len()) > 1 << 20 {
                break f;
            }
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "prepare ended before it was killed"
        );
        assert!(started.elapsed().as_secs() < 300, "no temporary appeared");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    child.kill().unwrap();
    child.wait().unwrap();
    let files = names(&cache);
    assert!(!files.iter().any(|n| n.ends_with(".tokens")), "{files:?}");
    assert!(tmp_file.exists());
    // The next run builds it (nothing to trust), removing the dead build's temporary.
    let (out, _) = run(&mut cmd(&cache, 2, &["prepare", "--recipe", r]));
    assert!(out.contains("tokenized 12000 rows"), "{out}");
    assert!(!tmp_file.exists());
    let files = names(&cache);
    assert_eq!(
        files.iter().filter(|n| n.ends_with(".tokens")).count(),
        1,
        "{files:?}"
    );
    assert!(!files.iter().any(|n| n.contains(".tmp-")), "{files:?}");
    let (again, _) = run(&mut cmd(&cache, 2, &["prepare", "--recipe", r]));
    assert!(again.contains("read from the tokenized cache"), "{again}");
}

#[test]
fn two_processes_preparing_the_same_data_build_it_once() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let data = tmp.path().join("rows.jsonl");
    alpaca_rows(&data, 3000);
    let r = recipe(tmp.path(), &data, "alpaca", 200);
    let r = r.to_str().unwrap();
    let spawn = || {
        cmd(&cache, 1, &["prepare", "--recipe", r])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let outs: Vec<String> = [a, b]
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            String::from_utf8_lossy(&o.stdout).into_owned()
        })
        .collect();
    let built = outs
        .iter()
        .filter(|o| o.contains("tokenized 3000 rows"))
        .count();
    let mapped = outs
        .iter()
        .filter(|o| o.contains("read from the tokenized cache"))
        .count();
    assert_eq!((built, mapped), (1, 1), "{outs:?}");
    let files = names(&cache);
    assert_eq!(
        files.iter().filter(|n| n.ends_with(".tokens")).count(),
        1,
        "{files:?}"
    );
}

/// Issue 63, point 4: one 64 MB text row is cut before tokenizing. Tokenized whole (main at
/// 6ba318d) it took 112 s and peaked at 9.5 GB; cut, the process peaks near twice the row's
/// size (the line read, and its text parsed) and takes a second.
#[cfg(target_os = "linux")]
#[test]
fn one_huge_row_costs_memory_for_seq_len_tokens_not_for_the_row() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let data = tmp.path().join("huge.jsonl");
    let words = ["red ", "fox ", "jumps ", "over ", "the ", "lazy ", "dog. "];
    let mut row = String::with_capacity(64 << 20);
    row.push_str("{\"text\": \"");
    let mut k = 0;
    while row.len() < 64 << 20 {
        row.push_str(words[k % words.len()]);
        k += 3;
    }
    row.push_str("\"}\n");
    let short = "{\"text\": \"Five times four is twenty.\"}\n";
    std::fs::write(&data, format!("{short}{row}{short}")).unwrap();
    drop(row);
    let r = recipe(tmp.path(), &data, "text", 256);
    let (out, _) = run(&mut cmd(
        &cache,
        2,
        &["prepare", "--recipe", r.to_str().unwrap()],
    ));
    assert!(
        out.contains("3 examples") && out.contains("1 truncated"),
        "{out}"
    );
    // The kernel's high-water mark of the process's own memory (VmHWM), as prepare reports it.
    let peak: f64 = out
        .lines()
        .find_map(|l| l.strip_prefix("peak memory (RSS): "))
        .and_then(|v| v.trim_end_matches(" MB").parse().ok())
        .unwrap_or_else(|| panic!("no peak memory line: {out}"));
    assert!(peak < 300.0, "peak RSS {peak} MB");
}
