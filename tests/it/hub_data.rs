//! Hub data sets (`data.train = "hf://datasets/ORG/NAME"`) against the loopback Hub, and the
//! readers behind them: the parquet fixtures (scripts/make_hub_data.py) hold the same rows as
//! their jsonl twins, and a data set read from the Hub trains the same adapter, bit for bit
//! (CPU f32), as those rows given as local jsonl.

use crate::chat::load;
use crate::common::root;
use crate::loopback::{etag, hub_command, Repo, Server, COMMIT};
use assert_cmd::Command;
use lora_train::data::reader::read_all;
use lora_train::data::{Dataset, ExampleRef};
use lora_train::hub::dataset::{dataset_files, DataRepo};
use lora_train::hub::download::HubEnv;
use lora_train::recipe::{DataSection, TrainFile};
use std::path::{Path, PathBuf};

const DS: &str = "tiny/alpaca-qa";
const TRAIN: [&str; 2] = [
    "data/train-00000-of-00002.parquet",
    "data/train-00001-of-00002.parquet",
];
const TEST: &str = "data/test-00000-of-00001.parquet";

fn fixtures() -> PathBuf {
    root().join("tests/fixtures/hub_data")
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

/// The alpaca data set as the Hub holds it: a README and three parquet files.
fn alpaca_repo() -> Repo {
    let mut r = Repo::default().add("README.md", b"# tiny alpaca-qa\n".to_vec());
    for f in TRAIN.iter().chain([&TEST]) {
        r = r.add(f, read(&fixtures().join("alpaca").join(f)));
    }
    r
}

fn hub(repos: &[(&str, Repo)]) -> Server {
    Server::start(
        repos
            .iter()
            .map(|(k, r)| (k.to_string(), r.clone()))
            .collect(),
    )
}

/// Records of several files, in order.
fn records(paths: &[PathBuf]) -> Vec<lora_train::data::record::Field> {
    paths
        .iter()
        .flat_map(|p| read_all(p, &[]).unwrap().into_iter().map(|(_, f)| f))
        .collect()
}

#[test]
fn parquet_fixtures_hold_the_rows_of_their_jsonl() {
    let a = fixtures().join("alpaca");
    let parquet = records(&TRAIN.map(|f| a.join(f)));
    let jsonl = records(&[fixtures().join("alpaca.jsonl")]);
    assert_eq!(parquet.len(), 54);
    assert_eq!(parquet, jsonl, "row for row");
    assert_eq!(
        records(&[a.join(TEST)]),
        records(&[fixtures().join("alpaca-test.jsonl")])
    );
    // Nested lists of structs, in schema order.
    let chats = records(&[fixtures().join("sharegpt/train.parquet")]);
    assert_eq!(chats.len(), 20);
    assert_eq!(chats, records(&[fixtures().join("sharegpt.jsonl")]));
    // Row numbers run on across row groups (8 rows each).
    let locs: Vec<String> = read_all(&a.join(TRAIN[0]), &[])
        .unwrap()
        .iter()
        .map(|(l, _)| l.at("f"))
        .collect();
    assert_eq!(
        (locs[0].as_str(), locs[29].as_str()),
        ("f: row 1", "f: row 30")
    );
}

fn alpaca_recipe(dir: &Path, name: &str, train: &str, eval: &str, out: &Path) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(
        &p,
        format!(
            r#"[model]
path = "{model}"
dtype = "f32"
[lora]
rank = 4
alpha = 8
dropout = 0.1
targets = "all-linear"
[data]
train = "{train}"
eval = "{eval}"
format = "alpaca"
columns = {{ instruction = "question", input = "context", output = "answer" }}
seq_len = 256
pack = true
[train]
micro_batch = 2
grad_accum = 2
max_steps = 4
lr = 3e-3
warmup_steps = 1
eval_every = 2
[output]
dir = "{out}"
"#,
            model = root().join("recipes/assets/tiny-llama").display(),
            out = out.display()
        ),
    )
    .unwrap();
    p
}

fn bin(hf: &Path, endpoint: &str) -> Command {
    hub_command(hf, endpoint)
}

fn train(c: &mut Command, recipe: &Path) -> (String, String) {
    let o = c.arg("--recipe").arg(recipe).output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "{err}");
    (out, err)
}

#[test]
fn a_hub_parquet_data_set_trains_the_adapter_of_the_same_rows_as_local_jsonl() {
    let tmp = tempfile::tempdir().unwrap();
    let (t, hf) = (tmp.path(), tmp.path().join("hf"));
    let server = hub(&[(&format!("datasets/{DS}"), alpaca_repo())]);
    let uri = format!("hf://datasets/{DS}");
    let from_hub = alpaca_recipe(t, "hub.toml", &uri, &uri, &t.join("hub"));
    let local = alpaca_recipe(
        t,
        "local.toml",
        &fixtures().join("alpaca.jsonl").display().to_string(),
        &fixtures().join("alpaca-test.jsonl").display().to_string(),
        &t.join("local"),
    );
    let (out_hub, err) = train(&mut bin(&hf, &server.endpoint()), &from_hub);
    let (out_local, _) = train(&mut bin(&hf, "http://127.0.0.1:9"), &local);
    let adapter = |run: &str| read(&t.join(run).join("adapter_model.safetensors"));
    assert!(
        adapter("hub") == adapter("local"),
        "same rows, same adapter"
    );
    let eval = |out: &str| out.lines().last().unwrap_or("").to_string();
    assert!(eval(&out_hub).starts_with("eval loss "), "{out_hub}");
    assert_eq!(eval(&out_hub), eval(&out_local));
    assert!(
        err.contains(&format!(
            "data set {DS} at \"main\" = commit {COMMIT}: {}, {} (",
            TRAIN[0], TRAIN[1]
        )) && err.contains(&format!(
            "data set {DS} at \"main\" = commit {COMMIT}: {TEST} ("
        )),
        "{err}"
    );

    // The cache as huggingface_hub lays out a data set: blobs named by sha256, relative links.
    let repo = hf.join("hub").join("datasets--tiny--alpaca-qa");
    assert_eq!(read(&repo.join("refs/main")), COMMIT.as_bytes());
    let snap = repo.join("snapshots").join(COMMIT);
    for f in TRAIN.iter().chain([&TEST]) {
        let bytes = read(&fixtures().join("alpaca").join(f));
        assert!(read(&snap.join(f)) == bytes, "{f}");
        let link = std::fs::read_link(snap.join(f)).unwrap();
        assert_eq!(link, Path::new("../../../blobs").join(etag(f, &bytes)));
    }
    assert!(!snap.join("README.md").exists(), "only the split's files");
    // Per run: the file list (train, eval), then each file once, from the CDN's host.
    let reqs = server.requests();
    for r in &reqs {
        let cdn = r.path.starts_with("/cdn/");
        assert_eq!(r.host.starts_with("localhost"), cdn, "{r:?}");
    }
    let api = reqs.iter().filter(|r| r.path.starts_with("/api/")).count();
    assert_eq!(api, 2, "{reqs:?}");
    let gets = reqs
        .iter()
        .filter(|r| r.method == "GET" && r.path.starts_with("/cdn/"))
        .count();
    assert_eq!(gets, 3, "{reqs:?}");

    // Again: the files come from the cache (the list is asked again: a branch moves).
    let n = reqs.len();
    let mut c = bin(&hf, &server.endpoint());
    train(
        c.args([
            "--set",
            &format!("output.dir={}", t.join("again").display()),
        ]),
        &from_hub,
    );
    assert_eq!(server.requests().len(), n + 2, "two file lists, no file");
    // Two ranks (threads) read the data set rank 0 resolved: one file list each for train and
    // eval, not one per rank.
    let n = server.requests().len();
    let mut c = bin(&hf, &server.endpoint());
    c.args([
        "--set",
        "parallel.strategy=ddp",
        "--set",
        "parallel.devices=[0, 1]",
    ])
    .args(["--set", &format!("output.dir={}", t.join("ddp").display())]);
    train(&mut c, &from_hub);
    assert_eq!(
        server.requests().len(),
        n + 2,
        "{:?}",
        &server.requests()[n..]
    );
    let endpoint = server.endpoint();
    drop(server);

    // Offline, and with the Hub gone: the cached snapshot's files, the same adapter.
    let mut c = bin(&hf, &endpoint);
    c.env("HF_HUB_OFFLINE", "1").args([
        "--set",
        &format!("output.dir={}", t.join("offline").display()),
    ]);
    let (_, err) = train(&mut c, &from_hub);
    assert!(
        err.contains("from the cache (HF_HUB_OFFLINE is set)"),
        "{err}"
    );
    let mut c = bin(&hf, &endpoint);
    c.args(["--set", &format!("output.dir={}", t.join("gone").display())]);
    let (_, err) = train(&mut c, &from_hub);
    assert!(
        err.contains(&format!("warning: cannot reach {endpoint}"))
            && err.contains("as last downloaded (it may have moved since)"),
        "{err}"
    );
    for run in ["again", "offline", "gone"] {
        assert!(adapter(run) == adapter("local"), "{run}");
    }
}

fn env(hf: &Path, endpoint: &str) -> HubEnv {
    let (hf, endpoint) = (hf.display().to_string(), endpoint.to_string());
    HubEnv::from_vars(move |k| match k {
        "HF_HOME" => Some(hf.clone()),
        "HF_ENDPOINT" => Some(endpoint.clone()),
        _ => None,
    })
    .unwrap()
}

fn repo<'a>(id: &'a str, split: &'a str, subset: Option<&'a str>) -> DataRepo<'a> {
    DataRepo {
        id,
        revision: "main",
        subset,
        split,
        files: None,
    }
}

#[test]
fn hub_data_set_errors_name_the_data_set_what_there_is_and_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    let gsm = Repo::default()
        .add("main/train-00000-of-00001.parquet", b"PAR1 main".to_vec())
        .add(
            "socratic/train-00000-of-00001.parquet",
            b"PAR1 soc".to_vec(),
        );
    let mut bad = alpaca_repo();
    bad.corrupt = vec![TRAIN[1].to_string()];
    let gated = Repo {
        gated: true,
        ..alpaca_repo()
    };
    let server = hub(&[
        (&format!("datasets/{DS}"), alpaca_repo()),
        ("datasets/tiny/gsm", gsm),
        ("datasets/tiny/corrupt", bad),
        ("datasets/tiny/gated", gated),
    ]);
    let ep = server.endpoint();
    let e = env(&hf, &ep);
    let err = |d: DataRepo| format!("{:#}", dataset_files(&e, &d).unwrap_err());

    assert_eq!(
        err(repo(DS, "validation", None)),
        format!(
            "data set {DS} at revision \"main\" (commit {COMMIT}) on {ep} has no split \
             \"validation\": its splits: test, train (data files: {TEST}, {}, {}); set \
             data.split, or data.files to a glob of the files to read",
            TRAIN[0], TRAIN[1]
        )
    );
    assert!(err(repo("tiny/gsm", "train", None)).ends_with(
        "has split \"train\" in several subsets (main, socratic): set data.subset to one of them"
    ));
    let got = dataset_files(&e, &repo("tiny/gsm", "train", Some("main"))).unwrap();
    assert_eq!(got[0].file, "main/train-00000-of-00001.parquet");
    assert_eq!(
        err(repo("tiny/gated", "train", None)),
        format!(
            "tiny/gated is a gated data set ({ep} answered HTTP 401 for the file list of data set \
             tiny/gated at revision \"main\": \"GatedRepo (loopback hub)\"): accept its license \
             at {ep}/datasets/tiny/gated while logged in, and no token was sent: set HF_TOKEN to \
             an access token (huggingface.co/settings/tokens)"
        )
    );
    assert!(err(repo("tiny/nope", "train", None)).starts_with(&format!(
        "{ep} refused the file list of data set tiny/nope at revision \"main\" (HTTP 401: \
         \"RepositoryNotFound (loopback hub)\"): the repository does not exist"
    )));
    let e2 = err(DataRepo {
        revision: "v9",
        ..repo(DS, "train", None)
    });
    assert!(
        e2.ends_with("set data.revision to an existing branch, tag or commit"),
        "{e2}"
    );

    // Bytes that are not the file the Hub names: refused, nothing enters the cache.
    let e3 = err(repo("tiny/corrupt", "train", None));
    assert!(
        e3.starts_with(&format!(
            "{} of data set tiny/corrupt at revision \"main\": the downloaded bytes have sha256 ",
            TRAIN[1]
        )) && e3.contains("the download was deleted: run again"),
        "{e3}"
    );
    let blobs = hf.join("hub/datasets--tiny--corrupt/blobs");
    let names: Vec<String> = std::fs::read_dir(&blobs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 1, "the good file only: {names:?}");

    // Offline with nothing cached; and the Hub gone with nothing cached.
    let mut off = env(&hf, &ep);
    off.offline = true;
    assert_eq!(
        format!(
            "{:#}",
            dataset_files(&off, &repo("tiny/other", "train", None)).unwrap_err()
        ),
        format!(
            "HF_HUB_OFFLINE is set and the cache {} has no snapshot of data set tiny/other at \
             revision \"main\": train once where the Hub is reachable (or copy that cache here), \
             or unset HF_HUB_OFFLINE",
            hf.join("hub/datasets--tiny--other").display()
        )
    );
    drop(server);
    let gone = format!(
        "{:#}",
        dataset_files(&e, &repo("tiny/other", "train", None)).unwrap_err()
    );
    assert!(
        gone.starts_with(&format!(
            "cannot reach {ep} to download the file list of data set tiny/other at revision \"main\": "
        )) && gone.ends_with(&format!(
            "Offline runs (HF_HUB_OFFLINE=1) need the data set's files in the cache {}: train once \
             where the Hub is reachable, or copy that cache here.",
            hf.join("hub").display()
        )),
        "{gone}"
    );
}

fn section(lines: &str) -> DataSection {
    toml::from_str(&format!("train = \"x.jsonl\"\n{lines}")).unwrap()
}

fn entry(path: PathBuf, cfg: &DataSection) -> TrainFile {
    TrainFile {
        path,
        weight: 1.0,
        format: Some(cfg.format),
        ..TrainFile::default()
    }
}

fn examples(ds: &Dataset) -> Vec<ExampleRef<'_>> {
    ds.examples.iter().collect()
}

#[test]
fn sharegpt_parquet_trains_the_examples_of_the_chat_jsonl() {
    let tiny = root().join("recipes/assets/tiny-llama");
    let tok = load(&tiny);
    let cfg = section("format = \"chat\"\nseq_len = 256");
    let tmp = tempfile::tempdir().unwrap();
    let chat = tmp.path().join("chat.jsonl");
    let rows: Vec<String> = std::fs::read_to_string(root().join("recipes/data/tiny-chat.jsonl"))
        .unwrap()
        .lines()
        .take(20)
        .map(String::from)
        .collect();
    std::fs::write(&chat, rows.join("\n")).unwrap();
    let from = |p: PathBuf| Dataset::load_files(&[entry(p, &cfg)], &cfg, Some(&tok), 512).unwrap();
    let want = from(chat);
    let got = from(fixtures().join("sharegpt/train.parquet"));
    assert_eq!(want.examples.len(), 20);
    assert_eq!(examples(&got), examples(&want));
    assert_eq!(got.turn_ends, want.turn_ends);
    // The same ShareGPT rows as JSON lines, and as one JSON array.
    assert_eq!(
        examples(&from(fixtures().join("sharegpt.jsonl"))),
        examples(&want)
    );
    let array = tmp.path().join("sharegpt.json");
    let text = std::fs::read_to_string(fixtures().join("sharegpt.jsonl")).unwrap();
    let items: Vec<&str> = text.lines().collect();
    std::fs::write(&array, format!("[\n{}\n]\n", items.join(",\n"))).unwrap();
    assert_eq!(examples(&from(array)), examples(&want));
}

#[test]
fn bad_rows_and_files_name_the_file_the_row_and_the_column() {
    let tok = load(&root().join("recipes/assets/tiny-llama"));
    let mapped = "format = \"alpaca\"\ncolumns = { instruction = \"question\", input = \"context\", output = \"answer\" }\n";
    let load_with = |p: &Path, lines: &str| {
        let cfg = section(lines);
        Dataset::load_files(&[entry(p.to_owned(), &cfg)], &cfg, Some(&tok), 512)
    };
    let nulls = fixtures().join("bad/nulls.parquet");
    let e = format!("{:#}", load_with(&nulls, mapped).unwrap_err());
    assert_eq!(
        e,
        format!(
            "{}: row 3: expected a string field \"answer\"",
            nulls.display()
        )
    );
    let ds = load_with(&nulls, &format!("{mapped}on_bad_row = \"skip\"")).unwrap();
    assert_eq!((ds.examples.len(), ds.skipped), (4, 2));
    assert!(ds.skipped_first[1].ends_with(": row 6: expected a string field \"answer\""));

    // No mapping: the file lacks our column, and the error says which it has.
    let e = format!(
        "{:#}",
        load_with(&nulls, "format = \"alpaca\"").unwrap_err()
    );
    assert_eq!(
        e,
        format!(
            "{} has no column \"instruction\" (its columns: question, context, answer): name the \
             column that holds it with data.columns, e.g. columns = {{ instruction = \"question\" }}",
            nulls.display()
        )
    );
    // A column mapped for a field the format does not read.
    let e = format!(
        "{:#}",
        load_with(
            &nulls,
            "format = \"text\"\ncolumns = { output = \"answer\" }"
        )
        .unwrap_err()
    );
    assert_eq!(
        e,
        "data.columns maps \"output\", which format \"text\" does not read; its fields: text"
    );

    // Broken parquet: a cut file, and pages with garbage in them. Errors, never a panic.
    let tmp = tempfile::tempdir().unwrap();
    let good = read(&fixtures().join("alpaca").join(TRAIN[0]));
    let cut = tmp.path().join("cut.parquet");
    std::fs::write(&cut, &good[..good.len() / 2]).unwrap();
    let e = format!("{:#}", load_with(&cut, mapped).unwrap_err());
    assert!(
        e.starts_with(&format!("{} is not a readable parquet file", cut.display())),
        "{e}"
    );
    let mut garbled = good.clone();
    for b in &mut garbled[8..good.len() / 2] {
        *b = b.wrapping_mul(31).wrapping_add(7);
    }
    let g = tmp.path().join("garbled.parquet");
    std::fs::write(&g, &garbled).unwrap();
    let e = format!("{:#}", load_with(&g, mapped).unwrap_err());
    assert!(e.starts_with(&g.display().to_string()), "{e}");

    // JSON arrays: a bad element names its row; bad JSON names its place.
    let arr = tmp.path().join("rows.json");
    std::fs::write(
        &arr,
        r#"[{"question": "q", "answer": "a"}, {"question": "q", "answer": 7}]"#,
    )
    .unwrap();
    let e = format!("{:#}", load_with(&arr, mapped).unwrap_err());
    assert_eq!(
        e,
        format!(
            "{}: row 2: expected a string field \"answer\"",
            arr.display()
        )
    );
    std::fs::write(&arr, r#"[{"question": "q", "answer": "a"}, {"question": "#).unwrap();
    let e = format!("{:#}", load_with(&arr, mapped).unwrap_err());
    assert!(
        e.starts_with(&format!(
            "{} is not a valid JSON array of records: ",
            arr.display()
        )) && e.contains("line 1 column"),
        "{e}"
    );
}
