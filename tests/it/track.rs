//! Trackers (`train.report_to`): our event-file bytes equal TensorBoard's own writer's
//! (tests/fixtures/tensorboard/scalars.tfevents, made by scripts/make_tensorboard_fixture.py);
//! the tiny recipe's event files, read back with CRCs checked, hold metrics.jsonl's values
//! under transformers' tags, also across a resume over logged-but-unsaved steps (what
//! scripts/check_tensorboard.py checks with TensorBoard's EventAccumulator); MLflow against a
//! loopback server that records the REST calls, and servers that fail, refuse or break
//! mid-run: a warning, training goes on, the adapter is written.

use crate::common::*;
use assert_cmd::Command;
use lora_train::track::event::{self, Event, What};
use lora_train::track::tensorboard::{self, head, scalar_event};
use lora_train::track::{params_of, tfrecord, Scalars};
use std::collections::BTreeMap;
use std::io::{BufRead, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// scripts/make_tensorboard_fixture.py's clock and rows.
const T0: f64 = 1700000000.25;

fn fixture_rows() -> Vec<Scalars> {
    let row = |wall: f64, step: u64, values: &[(&str, f64)]| Scalars {
        step,
        wall: T0 + wall,
        values: values.iter().map(|(t, v)| (t.to_string(), *v)).collect(),
    };
    let long = "x".repeat(200);
    vec![
        row(
            1.5,
            1,
            &[
                ("train/loss", 3.25),
                ("train/learning_rate", 0.0003),
                ("train/grad_norm", 1.0),
            ],
        ),
        row(2.75, 2, &[("train/loss", 2.9375), ("eval/loss", 0.0)]),
        row(3.0, 0, &[("rewards/chosen", -0.125)]),
        row(4.125, 5_000_000_000, &[(&long, 123456.789)]),
    ]
}

#[test]
fn event_bytes_equal_tensorboards_own_writer() {
    let want = std::fs::read(root().join("tests/fixtures/tensorboard/scalars.tfevents")).unwrap();
    let mut got = Vec::new();
    let writer = "tensorboard.summary.writer.event_file_writer";
    for e in head(T0, 1, writer) {
        tfrecord::push_record(&mut got, &event::encode(&e));
    }
    for r in fixture_rows() {
        tfrecord::push_record(&mut got, &event::encode(&scalar_event(&r)));
    }
    assert_eq!(got.len(), want.len());
    let at = got.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(at, None, "first differing byte");

    // Read back: TensorBoard's bytes decode to the events we meant.
    let events: Vec<Event> = tfrecord::read_records(&want)
        .unwrap()
        .into_iter()
        .map(|r| event::decode(r).unwrap())
        .collect();
    assert_eq!(events.len(), 2 + 4);
    assert_eq!(events[0].what, What::FileVersion("brain.Event:2".into()));
    assert_eq!(events[0].writer.as_deref(), Some(writer));
    assert_eq!((events[1].step, &events[1].what), (1, &What::SessionLog(1)));
    for (e, r) in events[2..].iter().zip(fixture_rows()) {
        assert_eq!((e.wall_time, e.step), (r.wall, r.step as i64));
        let want: Vec<(String, f32)> = r
            .values
            .iter()
            .map(|(t, v)| (t.clone(), *v as f32))
            .collect();
        assert_eq!(e.what, What::Scalars(want));
    }
}

fn bin() -> Command {
    Command::cargo_bin("lora-train").unwrap()
}

/// The tiny recipe for `steps` steps into `out`, a row every 5 steps, eval every 10 on a
/// held-out tenth, with `sets` and `envs`; its stderr (asserting success).
fn tiny_run(out: &Path, steps: usize, sets: &[&str], envs: &[(&str, &str)]) -> String {
    let mut cmd = bin();
    cmd.current_dir(root())
        .args(["--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", out.display()));
    let base = [
        format!("train.max_steps={steps}"),
        "train.log_every=5".into(),
        "train.eval_every=10".into(),
        "data.eval_fraction=0.1".into(),
        "output.save_every=0".into(),
        // runs here follow one another into one directory
        "output.overwrite=true".into(),
    ];
    for s in base.iter().map(String::as_str).chain(sets.iter().copied()) {
        cmd.args(["--set", s]);
    }
    for k in [
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_EXPERIMENT_ID",
        "MLFLOW_RUN_ID",
    ] {
        cmd.env_remove(k);
    }
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let o = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{stderr}");
    assert!(out.join("adapter_model.safetensors").is_file(), "{stderr}");
    stderr
}

/// metrics.jsonl's rows as (tag → [(step, value)]), tags as the trackers name them.
fn metrics(out: &Path) -> BTreeMap<String, Vec<(u64, f64)>> {
    let mut m: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
    for line in std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
    {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        let s = Scalars::of(&row, 0.0).unwrap();
        for (t, v) in s.values {
            m.entry(t).or_default().push((s.step, v));
        }
    }
    m
}

/// The scalars TensorBoard shows for `out`/runs, against metrics.jsonl (float32 values).
fn assert_events_equal_metrics(out: &Path) -> usize {
    let files = tensorboard::read_dir(&out.join("runs"), 1 << 20).unwrap();
    let shown = tensorboard::scalars(&files);
    let want = metrics(out);
    for tag in [
        "train/loss",
        "train/learning_rate",
        "train/grad_norm",
        "eval/loss",
    ] {
        assert!(want.contains_key(tag), "metrics.jsonl lacks {tag}");
    }
    assert_eq!(
        shown.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (tag, rows) in &want {
        let want: Vec<(i64, f32)> = rows.iter().map(|(s, v)| (*s as i64, *v as f32)).collect();
        assert_eq!(shown[tag], want, "{tag}");
    }
    files.len()
}

#[test]
fn tiny_run_writes_tensorboard_events_equal_to_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    tiny_run(&out, 20, &["train.report_to=[\"tensorboard\"]"], &[]);
    assert_eq!(assert_events_equal_metrics(&out), 1);
    let files = tensorboard::read_dir(&out.join("runs"), 1 << 20).unwrap();
    let (path, events) = &files[0];
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("events.out.tfevents.") && name.ends_with(".lora-train"),
        "{name}"
    );
    assert_eq!(events[0].what, What::FileVersion("brain.Event:2".into()));
    assert_eq!(events[0].writer.as_deref(), Some("lora-train"));
    assert_eq!((events[1].step, &events[1].what), (1, &What::SessionLog(1)));
    let steps: Vec<i64> = events[2..].iter().map(|e| e.step).collect();
    assert_eq!(steps, [5, 10, 15, 20], "one event per metrics row");
    let walls: Vec<f64> = events.iter().map(|e| e.wall_time).collect();
    assert!(walls.windows(2).all(|w| w[0] <= w[1]), "{walls:?}");
    if let Ok(keep) = std::env::var("TRACK_KEEP_RUNS") {
        copy_dir(&out, &Path::new(&keep).join("fresh"));
    }

    // A fresh run over it (one name, not a list) replaces the earlier run's event file.
    let stderr = tiny_run(&out, 10, &["train.report_to=tensorboard"], &[]);
    assert!(
        stderr.contains("removed 1 event file(s) of an earlier run"),
        "{stderr}"
    );
    assert_eq!(assert_events_equal_metrics(&out), 1);
}

/// A run interrupted after step 6 (checkpoints 4 and 6), checkpoint-6 lost as in a crash, and
/// resumed from checkpoint-4: steps 5 and 6 are logged twice, in two files; what TensorBoard
/// shows (the second file's session start drops the first's from step 5) is metrics.jsonl.
#[test]
fn a_resumed_run_shows_each_step_once() {
    use lora_train::run::checkpoint;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let sets = [
        "train.max_steps=11",
        "train.micro_batch=1",
        "train.grad_accum=2",
        "output.save_every=4",
        "data.eval_fraction=0.25",
        "train.eval_every=3",
        "train.report_to=[\"tensorboard\"]",
    ];
    let text = golden_recipe("tiny_shipped", &out);
    let s = Session::new(recipe(tmp.path(), &text, &sets)).unwrap();
    let e = s.train_from(&out, None, &|s| s == 6).unwrap_err();
    assert!(
        e.downcast_ref::<lora_train::train::stop::Interrupted>()
            .is_some(),
        "{e:#}"
    );
    drop(s);
    std::fs::remove_dir_all(out.join("checkpoint-6")).unwrap();
    let mut resumed = sets.to_vec();
    resumed.push("train.resume=true");
    let r = recipe(tmp.path(), &text, &resumed);
    let ck = checkpoint::resume_point(&r, &out).unwrap().unwrap();
    assert_eq!(ck.state.step, 4);
    // Trackers do not change the numbers: a resume may add or drop them.
    assert!(!lora_train::train::fingerprint::recipe(&r).contains_key("train.report_to"));
    let set = "train.report_to=[\"mlflow\"]".to_string();
    assert!(checkpoint::numbers_sets(&[set]).is_empty());
    Session::new(r).unwrap().train(&out).unwrap();

    let files = tensorboard::read_dir(&out.join("runs"), 1 << 20).unwrap();
    assert_eq!(files.len(), 2);
    let steps = |es: &[Event]| -> Vec<i64> {
        es.iter()
            .filter(|e| matches!(e.what, What::Scalars(_)))
            .map(|e| e.step)
            .collect()
    };
    assert_eq!(steps(&files[0].1), [1, 2, 3, 4, 5, 6]);
    assert_eq!(files[1].1[1].what, What::SessionLog(1));
    assert_eq!(files[1].1[1].step, 5);
    assert_eq!(steps(&files[1].1), [5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(assert_events_equal_metrics(&out), 2);
    if let Ok(keep) = std::env::var("TRACK_KEEP_RUNS") {
        copy_dir(&out, &Path::new(&keep).join("resumed"));
    }
}

/// One request the loopback MLflow server saw.
#[derive(Debug, Clone)]
struct Call {
    method: String,
    path: String,
    body: serde_json::Value,
}

type Reply = dyn Fn(&Call) -> (u16, serde_json::Value) + Send + Sync;

/// A loopback HTTP server that records each call and answers with `reply`; one connection at
/// a time, `Connection: close`; stops when dropped or after two minutes.
struct Server {
    port: u16,
    calls: Arc<Mutex<Vec<Call>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(reply: Box<Reply>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (calls2, stop2) = (calls.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(120);
            while !stop2.load(Ordering::SeqCst) && Instant::now() < deadline {
                match listener.accept() {
                    Ok((s, _)) => {
                        let _ = serve(s, &*reply, &calls2);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Server {
            port,
            calls,
            stop,
            thread: Some(thread),
        }
    }

    fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(s: std::net::TcpStream, reply: &Reply, calls: &Mutex<Vec<Call>>) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut r = std::io::BufReader::new(s.try_clone()?);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.trim().eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap_or(0).min(1 << 24);
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    let call = Call {
        method,
        path,
        body: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    };
    let (status, answer) = reply(&call);
    calls.lock().unwrap().push(call);
    let body = answer.to_string();
    let mut out = s;
    write!(
        out,
        "HTTP/1.1 {status} X\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    out.flush()
}

const API: &str = "/api/2.0/mlflow/";

/// A working MLflow server: no experiment "tiny" until it is created (id 7), run "r-1".
fn mlflow_ok(c: &Call) -> (u16, serde_json::Value) {
    let route = c.path.strip_prefix(API).unwrap_or("");
    match route.split('?').next().unwrap_or("") {
        "experiments/get-by-name" => (
            404,
            serde_json::json!({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no"}),
        ),
        "experiments/create" => (200, serde_json::json!({"experiment_id": "7"})),
        "runs/create" => (200, serde_json::json!({"run": {"info": {"run_id": "r-1"}}})),
        "runs/log-batch" | "runs/update" => (200, serde_json::json!({})),
        _ => (404, serde_json::json!({"error_code": "ENDPOINT_NOT_FOUND"})),
    }
}

#[test]
fn mlflow_gets_the_metrics_and_the_recipe() {
    let server = Server::start(Box::new(mlflow_ok));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let uri = server.uri();
    let envs = [
        ("MLFLOW_TRACKING_URI", uri.as_str()),
        ("MLFLOW_EXPERIMENT_NAME", "tiny exp"),
        ("MLFLOW_TRACKING_TOKEN", "tok"),
    ];
    let stderr = tiny_run(&out, 20, &["train.report_to=[\"mlflow\"]"], &envs);
    assert!(!stderr.contains("warning"), "{stderr}");
    let calls = server.calls();
    let routes: Vec<String> = calls
        .iter()
        .map(|c| format!("{} {}", c.method, c.path))
        .collect();
    assert_eq!(
        routes[..3],
        [
            format!("GET {API}experiments/get-by-name?experiment_name=tiny%20exp"),
            format!("POST {API}experiments/create"),
            format!("POST {API}runs/create"),
        ],
        "{routes:#?}"
    );
    assert_eq!(calls[1].body["name"], "tiny exp");
    let create = &calls[2].body;
    assert_eq!(
        (&create["experiment_id"], &create["run_name"]),
        (&"7".into(), &"run".into())
    );
    let last = calls.last().unwrap();
    assert_eq!(last.path, format!("{API}runs/update"));
    assert_eq!(
        (&last.body["run_id"], &last.body["status"]),
        (&"r-1".into(), &"FINISHED".into())
    );
    assert!(last.body["end_time"].as_i64().unwrap() > 1_700_000_000_000);

    // Params: the resolved recipe (out/recipe.toml), every field set, once.
    let batches: Vec<&serde_json::Value> = calls
        .iter()
        .filter(|c| c.path == format!("{API}runs/log-batch"))
        .map(|c| {
            assert_eq!(c.body["run_id"], "r-1");
            &c.body
        })
        .collect();
    let mut params = BTreeMap::new();
    for b in &batches {
        for p in b["params"].as_array().into_iter().flatten() {
            let (k, v) = (p["key"].as_str().unwrap(), p["value"].as_str().unwrap());
            assert!(
                params.insert(k.to_string(), v.to_string()).is_none(),
                "{k} twice"
            );
        }
    }
    let resolved: serde_json::Value =
        toml::from_str(&std::fs::read_to_string(out.join("recipe.toml")).unwrap()).unwrap();
    let want: BTreeMap<String, String> = params_of(&resolved).into_iter().collect();
    assert_eq!(params, want);
    assert_eq!(params["train.lr"], "0.003");
    assert_eq!(params["train.max_steps"], "20");
    assert_eq!(params["train.report_to"], "[\"mlflow\"]");

    // Metrics: metrics.jsonl's values (exact f64), steps and tags; timestamps in ms.
    let mut got: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
    for b in &batches {
        for m in b["metrics"].as_array().into_iter().flatten() {
            assert!(m["timestamp"].as_i64().unwrap() > 1_700_000_000_000);
            got.entry(m["key"].as_str().unwrap().to_string())
                .or_default()
                .push((m["step"].as_u64().unwrap(), m["value"].as_f64().unwrap()));
        }
    }
    for v in got.values_mut() {
        v.sort_by_key(|(s, _)| *s);
    }
    assert_eq!(got, metrics(&out));
    assert_eq!(got["train/loss"].len(), 4);
    assert_eq!(got["eval/loss"].len(), 2);

    // runs/mlflow.json keeps the run for a resume.
    let kept: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("runs/mlflow.json")).unwrap())
            .unwrap();
    assert_eq!(
        (&kept["run_id"], &kept["tracking_uri"]),
        (&"r-1".into(), &uri.as_str().into())
    );
}

/// Failing servers: each warns once and training goes on to the adapter.
#[test]
fn a_failing_mlflow_never_stops_training() {
    let tmp = tempfile::tempdir().unwrap();
    let set = ["train.report_to=[\"mlflow\", \"tensorboard\"]"];
    let warnings = |stderr: &str| -> Vec<String> {
        stderr
            .lines()
            .filter(|l| l.contains("warning: mlflow"))
            .map(String::from)
            .collect()
    };

    // Every call answers 500.
    let server = Server::start(Box::new(|_| {
        (
            500,
            serde_json::json!({"error_code": "INTERNAL_ERROR", "message": "boom"}),
        )
    }));
    let (out, uri) = (tmp.path().join("a"), server.uri());
    let stderr = tiny_run(&out, 4, &set, &[("MLFLOW_TRACKING_URI", &uri)]);
    let w = warnings(&stderr);
    assert_eq!(w.len(), 1, "{stderr}");
    assert!(
        w[0].contains("runs/create: HTTP 500 INTERNAL_ERROR: boom"),
        "{stderr}"
    );
    assert_eq!(server.calls().len(), 1, "no call after the failure");
    assert_events_equal_metrics(&out);

    // The run starts, then log-batch fails: off for the rest of the run, no more calls.
    let server = Server::start(Box::new(|c: &Call| match c.body.get("metrics") {
        Some(_) => (
            500,
            serde_json::json!({"error_code": "INTERNAL_ERROR", "message": "full"}),
        ),
        None => mlflow_ok(c),
    }));
    let (out, uri) = (tmp.path().join("b"), server.uri());
    let stderr = tiny_run(&out, 4, &set, &[("MLFLOW_TRACKING_URI", &uri)]);
    let w = warnings(&stderr);
    assert_eq!(w.len(), 1, "{stderr}");
    assert!(w[0].contains("off for the rest of the run"), "{stderr}");
    let calls = server.calls();
    assert!(
        calls.last().unwrap().body.get("metrics").is_some(),
        "{calls:#?}"
    );
    assert_events_equal_metrics(&out);

    // Nothing listens on the port; and no MLFLOW_TRACKING_URI at all.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let uri = format!("http://127.0.0.1:{port}");
    let stderr = tiny_run(
        &tmp.path().join("c"),
        4,
        &set,
        &[("MLFLOW_TRACKING_URI", &uri)],
    );
    let w = warnings(&stderr);
    assert_eq!(w.len(), 1, "{stderr}");
    assert!(
        w[0].contains("is the server at MLFLOW_TRACKING_URI up?"),
        "{stderr}"
    );
    let stderr = tiny_run(
        &tmp.path().join("d"),
        4,
        &set,
        &[("MLFLOW_TRACKING_URI", "")],
    );
    let w = warnings(&stderr);
    assert_eq!(w.len(), 1, "{stderr}");
    assert!(w[0].contains("MLFLOW_TRACKING_URI is not set"), "{stderr}");
}

#[test]
fn report_to_is_checked() {
    let o = bin()
        .current_dir(root())
        .args(["check", "--recipe", "recipes/tiny-cpu.toml"])
        .args([
            "--set",
            "train.report_to=[\"tensorboard\", \"tensorboard\"]",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("`train.report_to` names \"tensorboard\" twice (entry 2)"),
        "{stderr}"
    );
    let o = bin()
        .current_dir(root())
        .args(["check", "--recipe", "recipes/tiny-cpu.toml"])
        .args(["--set", "train.report_to=[\"wandb\"]"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("wandb sync --sync-tensorboard"), "{stderr}");
}
