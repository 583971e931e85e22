//! Streaming start (issue 69, point 3): a run whose first epoch reads the examples in file
//! order starts on them as they land while the rest tokenize. Its steps are the ones a run that
//! waited for the whole preparation takes (every shipped format, packed and not, through the
//! library, into the later epochs); through the real binary the first step comes before the
//! preparation ends, the adapter is byte-identical to a run that did not stream and to one that
//! reads the finished cache, a run killed mid-stream leaves nothing a later run trusts, and a
//! bad row found behind the steps ends the run with its file and line.

use crate::common::{recipe, root, Session};
use lora_train::data::{Options, Store};
use lora_train::train::train_data::Cursor;
use lora_train::train::TrainData;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn tiny() -> String {
    root()
        .join("recipes/assets/tiny-llama")
        .display()
        .to_string()
}

/// A tokens file of 40 rows of 3 to 40 ids.
fn tokens_file(dir: &Path) -> PathBuf {
    let p = dir.join("tokens.jsonl");
    let text: String = (0..40)
        .map(|i| {
            let ids: Vec<u32> = (0..3 + (i * 7) % 38)
                .map(|k| (i * 31 + k * 11) % 500)
                .collect();
            format!("{{\"input_ids\": {ids:?}}}\n")
        })
        .collect();
    std::fs::write(&p, text).unwrap();
    p
}

/// The tiny Alpaca rows with bad lines among them.
fn bad_rows_file(dir: &Path) -> PathBuf {
    let p = dir.join("bad.jsonl");
    let good = std::fs::read_to_string(root().join("recipes/data/tiny-alpaca.jsonl")).unwrap();
    let mut text = String::new();
    for (i, l) in good.lines().enumerate() {
        if i % 5 == 2 {
            text += "{\"instruction\": \n";
        }
        text += l;
        text.push('\n');
    }
    std::fs::write(&p, text).unwrap();
    p
}

/// (case, `[data]` lines) for every shipped format, in file order (shuffle off).
fn cases(dir: &Path) -> Vec<(&'static str, String)> {
    let r = |p: &str| root().join(p).display().to_string();
    let pq = |p: &str| root().join("tests/fixtures/hub_data").join(p);
    vec![
        ("text", format!("train = \"{}\"\nformat = \"text\"\nseq_len = 24\npack = true", r("recipes/data/tiny-text.jsonl"))),
        ("text-unpacked", format!("train = \"{}\"\nformat = \"text\"\nseq_len = 16", r("recipes/data/tiny-text.jsonl"))),
        ("alpaca", format!("train = \"{}\"\nformat = \"alpaca\"\nseq_len = 165\npack = true", r("recipes/data/tiny-alpaca.jsonl"))),
        ("chat", format!("train = \"{}\"\nformat = \"chat\"\nseq_len = 128\npack = true", r("recipes/data/tiny-chat.jsonl"))),
        ("completion", format!("train = \"{}\"\nformat = \"completion\"\nseq_len = 48\npack = true\ncolumns = {{ prompt = \"instruction\", completion = \"output\" }}", r("recipes/data/tiny-alpaca.jsonl"))),
        ("tokens", format!("train = \"{}\"\nformat = \"tokens\"\nseq_len = 64\npack = true", tokens_file(dir).display())),
        ("parquet-alpaca", format!("train = \"{}\"\nformat = \"alpaca\"\nseq_len = 256\npack = true\ncolumns = {{ instruction = \"question\", input = \"context\", output = \"answer\" }}", pq("alpaca/data/train-00000-of-00002.parquet").display())),
        ("parquet-sharegpt", format!("train = \"{}\"\nformat = \"chat\"\nseq_len = 128\npack = true", pq("sharegpt/train.parquet").display())),
        ("skip", format!("train = \"{}\"\nformat = \"alpaca\"\nseq_len = 40\npack = true\non_bad_row = \"skip\"\ntrain_on = \"all\"", bad_rows_file(dir).display())),
        ("mix", format!("train = [{{ path = \"{}\" }}, {{ path = \"{}\", format = \"chat\" }}]\nformat = \"alpaca\"\nseq_len = 200\npack = true", r("recipes/data/tiny-alpaca.jsonl"), r("recipes/data/tiny-chat.jsonl"))),
    ]
}

/// The batches' every field and the denominator of `n` steps from the start.
fn steps(d: &TrainData, n: usize) -> Vec<String> {
    let start = Cursor {
        epoch: 0,
        step_in_epoch: 0,
    };
    d.steps_from(start)
        .unwrap()
        .take(n)
        .map(|s| {
            let s = s.unwrap();
            let b: Vec<String> = s
                .batches
                .iter()
                .map(|b| {
                    format!(
                        "{} {} {} {:?} {:?} {:?} {:?} {:?}",
                        b.b, b.t, b.tokens, b.ids, b.positions, b.segments, b.targets, b.real
                    )
                })
                .collect();
            format!("denom {}: {}", s.denom, b.join(" | "))
        })
        .collect()
}

#[test]
fn streamed_steps_are_the_prepared_ones_on_every_format() {
    let files = tempfile::tempdir().unwrap();
    for (name, lines) in cases(files.path()) {
        let tmp = tempfile::tempdir().unwrap();
        let text = format!(
            "[model]\npath = \"{}\"\ndtype = \"f32\"\ndevice = \"cpu\"\n\n[lora]\nrank = 4\nalpha = 8\n\n\
             [data]\n{lines}\nshuffle = false\n\n[train]\nmicro_batch = 2\ngrad_accum = 2\nmax_steps = 30\n\n\
             [output]\ndir = \"{}\"\n",
            tiny(),
            tmp.path().join("out").display()
        );
        let s = Session::new(recipe(tmp.path(), &text, &[])).unwrap();
        let opts = Options {
            store: Store::Cache(tmp.path().join("cache")),
            workers: 2,
            progress: false,
            stream: true,
        };
        let streamed = TrainData::load_with(&s.s, &opts, true).unwrap();
        assert!(streamed.streaming(), "{name}: streams");
        // 30 steps: the first epoch streamed, the next ones from the prepared set.
        let (got, want) = (steps(&streamed, 30), steps(&s.d, 30));
        assert_eq!(got.len(), 30, "{name}");
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{name}: step {k}");
        }
        let (a, b) = (streamed.data().unwrap(), s.d.data().unwrap());
        assert_eq!(
            (a.examples.len(), a.truncated, a.skipped, a.file_of.clone()),
            (b.examples.len(), b.truncated, b.skipped, b.file_of.clone()),
            "{name}"
        );
        // Read back from the cache it filled: no stream.
        let again = TrainData::load_with(&s.s, &opts, true).unwrap();
        assert!(!again.streaming(), "{name}: the cache holds it");
        assert_eq!(steps(&again, 30), want, "{name}");
    }
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

/// `lora-train train` on `recipe` into `out`, the cache in `cache`, one tokenizing thread.
fn train(recipe: &Path, out: &Path, cache: &Path, stream: bool) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lora-train"));
    c.args(["train", "--recipe"])
        .arg(recipe)
        .args(["--set", &format!("output.dir={}", out.display())])
        .env("LORA_TRAIN_CACHE", cache)
        .env("LORA_TRAIN_DATA_WORKERS", "1")
        .env("LORA_TRAIN_DATA_STREAM", if stream { "on" } else { "off" })
        .current_dir(root());
    c
}

fn stderr_of(c: &mut Command) -> Vec<String> {
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    err.lines().map(String::from).collect()
}

fn adapter(out: &Path) -> Vec<u8> {
    std::fs::read(out.join("adapter_model.safetensors")).unwrap()
}

fn tokens_files(cache: &Path) -> Vec<String> {
    std::fs::read_dir(cache)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".tokens"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn the_first_step_comes_before_the_preparation_ends_and_trains_the_same_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = t.join("rows.jsonl");
    alpaca_rows(&data, 12_000);
    let r = t.join("recipe.toml");
    std::fs::write(
        &r,
        format!(
            "[model]\npath = \"{}\"\ndtype = \"f32\"\ndevice = \"cpu\"\n\n[lora]\nrank = 4\nalpha = 8\n\n\
             [data]\ntrain = \"{}\"\nformat = \"alpaca\"\nseq_len = 200\npack = true\nshuffle = false\n\n\
             [train]\nmicro_batch = 2\nmax_steps = 3\nlr = 1e-3\nlog_every = 1\n",
            tiny(),
            data.display()
        ),
    )
    .unwrap();
    // The reference: no streaming.
    let lines = stderr_of(&mut train(&r, &t.join("plain"), &t.join("c1"), false));
    assert!(!lines.iter().any(|l| l.contains("streams")), "{lines:#?}");
    let want = adapter(&t.join("plain"));

    // Streaming: the first step starts, and its metrics line is out, before the preparation
    // (one thread, 12000 rows) ends.
    let lines = stderr_of(&mut train(&r, &t.join("streamed"), &t.join("c2"), true));
    let at = |p: &str| lines.iter().position(|l| l.starts_with(p));
    let (streams, first, step1, prepared) = (
        at("data "),
        at("first step starts"),
        at("step 1/3"),
        at("data prepared behind the steps"),
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains(": streams: the first epoch")),
        "{lines:#?}"
    );
    let first = first.unwrap();
    assert!(lines[first].contains("(streaming"), "{lines:#?}");
    assert!(
        streams.is_some() && step1.is_some() && prepared.is_some(),
        "{lines:#?}"
    );
    assert!(first < step1.unwrap(), "{lines:#?}");
    assert!(step1.unwrap() < prepared.unwrap(), "{lines:#?}");
    assert!(
        lines[prepared.unwrap()].contains("tokenized 12000 rows"),
        "{lines:#?}"
    );
    assert_eq!(adapter(&t.join("streamed")), want, "streamed vs not");
    assert_eq!(tokens_files(&t.join("c2")).len(), 1);

    // The finished cache read back: no stream, the same adapter.
    let lines = stderr_of(&mut train(&r, &t.join("cached"), &t.join("c2"), true));
    assert!(
        lines
            .iter()
            .any(|l| l.contains("read from the tokenized cache")),
        "{lines:#?}"
    );
    assert_eq!(adapter(&t.join("cached")), want, "from the cache");

    // Killed mid-stream: nothing trusted; the next run tokenizes again, the same adapter.
    let c3 = t.join("c3");
    let mut child = train(&r, &t.join("killed"), &c3, true)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = Vec::new();
    for l in err.lines() {
        let l = l.unwrap();
        let started = l.starts_with("first step starts");
        seen.push(l);
        if started {
            break;
        }
    }
    assert!(
        seen.last()
            .is_some_and(|l| l.starts_with("first step starts")),
        "{seen:#?}"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        tokens_files(&c3).is_empty(),
        "a killed stream leaves no cache file"
    );
    let lines = stderr_of(&mut train(&r, &t.join("after"), &c3, true));
    assert!(
        lines.iter().any(|l| l.contains("tokenized 12000 rows")),
        "{lines:#?}"
    );
    assert_eq!(adapter(&t.join("after")), want, "after a killed stream");
    let left: Vec<String> = std::fs::read_dir(&c3)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_bad_row_found_behind_the_steps_ends_the_run_with_its_line() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = t.join("rows.jsonl");
    alpaca_rows(&data, 6_000);
    let mut text = std::fs::read_to_string(&data).unwrap();
    text += "{\"instruction\": \n";
    std::fs::write(&data, text).unwrap();
    let r = t.join("recipe.toml");
    std::fs::write(
        &r,
        format!(
            "[model]\npath = \"{}\"\ndtype = \"f32\"\ndevice = \"cpu\"\n\n[lora]\nrank = 4\nalpha = 8\n\n\
             [data]\ntrain = \"{}\"\nformat = \"alpaca\"\nseq_len = 200\nshuffle = false\n\n\
             [train]\nmicro_batch = 2\nmax_steps = 2\nlr = 1e-3\n",
            tiny(),
            data.display()
        ),
    )
    .unwrap();
    let cache = t.join("cache");
    let o = train(&r, &t.join("out"), &cache, true).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains(": streams: "), "{err}");
    assert!(err.contains("rows.jsonl:6001"), "{err}");
    assert!(!t.join("out/adapter_model.safetensors").exists(), "{err}");
    let left: Vec<String> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tokens"))
        .collect();
    assert!(left.is_empty(), "nothing trusted, no temporary: {left:?}");
}
