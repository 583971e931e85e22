//! Bad input, as a new user meets it (issue #26): damaged checkpoints, checkpoint states that
//! do not fit the run, huge counts, hangs and signals, garbage that used to be accepted, and
//! errors blamed on the wrong thing. Every case runs the real binary on a copy of the tiny
//! model made bad on the fly, and checks the exit code, the text that names the file and the
//! field, and that the output directory is as it was.

use crate::common::{copy_dir, root};
use assert_cmd::Command;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::cargo_bin("lora-train").unwrap()
}

/// A temporary directory holding a copy of the tiny model (`model/`), the shipped data
/// (`data/`) and `r.toml`: 4 steps of 2 rows, a checkpoint every 2, into `out/`.
struct Fixture {
    tmp: tempfile::TempDir,
}

const RECIPE: &str = r#"[model]
path = "model"
[data]
train = "data/tiny-text.jsonl"
seq_len = 32
[train]
max_steps = 4
micro_batch = 2
[output]
dir = "out"
save_every = 2
"#;

impl Fixture {
    fn new() -> Fixture {
        let tmp = tempfile::tempdir().unwrap();
        copy_dir(
            &root().join("recipes/assets/tiny-llama"),
            &tmp.path().join("model"),
        );
        copy_dir(&root().join("recipes/data"), &tmp.path().join("data"));
        std::fs::write(tmp.path().join("r.toml"), RECIPE).unwrap();
        Fixture { tmp }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.tmp.path().join(p)
    }

    /// Runs `lora-train ARGS` in the fixture: (exit code, stderr).
    fn run(&self, args: &[&str]) -> (i32, String) {
        let o = bin()
            .current_dir(self.tmp.path())
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        (o.status.code().unwrap_or(-1), err)
    }

    /// `lora-train --recipe r.toml --set S ...`.
    fn train(&self, sets: &[&str]) -> (i32, String) {
        let mut args = vec!["--recipe", "r.toml"];
        for s in sets {
            args.extend(["--set", s]);
        }
        self.run(&args)
    }

    /// Every file under `out/` with its bytes, to show that a refused run changed nothing.
    fn out_files(&self) -> BTreeMap<PathBuf, Vec<u8>> {
        fn walk(d: &Path, into: &mut BTreeMap<PathBuf, Vec<u8>>) {
            for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                match e.path().is_dir() {
                    true => walk(&e.path(), into),
                    false => {
                        into.insert(e.path(), std::fs::read(e.path()).unwrap());
                    }
                }
            }
        }
        let mut m = BTreeMap::new();
        walk(&self.path("out"), &mut m);
        m
    }

    /// config.json of the model with `key` set to `value` (JSON).
    fn set_config(&self, key: &str, value: &str) {
        let p = self.path("model/config.json");
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        c[key] = serde_json::from_str(value).unwrap();
        std::fs::write(&p, c.to_string()).unwrap();
    }
}

/// Asserts a refusal: `code`, every one of `names` in stderr, no panic or abort.
fn refused(what: &str, (code, err): (i32, String), want: i32, names: &[&str]) {
    assert_eq!(code, want, "{what}: {err}");
    for n in names {
        assert!(err.contains(n), "{what}: stderr lacks {n:?}: {err}");
    }
    assert!(!err.contains("panicked"), "{what}: {err}");
}

/// One safetensors tensor as raw parts: dtype as the format writes it, shape, bytes.
type Raw = (String, Vec<usize>, Vec<u8>);

fn read_st(path: &Path) -> Vec<(String, Raw)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Raw)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            let raw = (
                format!("{:?}", t.dtype()),
                t.shape().to_vec(),
                t.data().to_vec(),
            );
            (n, raw)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Writes a safetensors file by hand, so that any dtype string can be written.
fn write_st(path: &Path, tensors: &[(String, Raw)]) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut data = Vec::new();
    for (name, (dtype, shape, bytes)) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let h = serde_json::Value::Object(header).to_string().into_bytes();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

/// Rewrites one tensor of a safetensors file.
fn edit_tensor(path: &Path, name: &str, f: impl Fn(&mut Raw)) {
    let mut t = read_st(path);
    let (_, raw) = t.iter_mut().find(|(n, _)| n == name).unwrap();
    f(raw);
    write_st(path, &t);
}

fn set_f32(raw: &mut Raw, i: usize, v: f32) {
    raw.2[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
}

fn edit_json(path: &Path, f: impl Fn(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

#[test]
fn a_damaged_checkpoint_is_an_error_naming_its_file_and_nothing_is_ever_deleted() {
    let fx = Fixture::new();
    assert_eq!(fx.train(&[]).0, 0);
    // A half-copied checkpoint: the newest lacks its trainer state.
    std::fs::remove_file(fx.path("out/checkpoint-4/trainer_state.json")).unwrap();
    let before = fx.out_files();
    refused(
        "resume over a checkpoint without trainer_state.json",
        fx.train(&["train.resume=true"]),
        2,
        &[
            "`train.resume` = true, but the newest checkpoint out/checkpoint-4 cannot be read",
            "out/checkpoint-4/trainer_state.json",
            "train.resume = \"out/checkpoint-2\"",
        ],
    );
    assert_eq!(fx.out_files(), before, "a refused resume changes nothing");
    // A fresh start cannot prove the damaged checkpoint belongs to a finished run of ours.
    refused(
        "a fresh start over it",
        fx.train(&[]),
        2,
        &[
            "out/checkpoint-4, which cannot be read",
            "nothing was changed",
        ],
    );
    assert_eq!(
        fx.out_files(),
        before,
        "a refused fresh start deletes nothing"
    );

    // An unreadable trainer state, and a truncated optimiser file: the same.
    let fx = Fixture::new();
    assert_eq!(fx.train(&[]).0, 0);
    std::fs::write(
        fx.path("out/checkpoint-4/trainer_state.json"),
        "{\"step\": ",
    )
    .unwrap();
    let before = fx.out_files();
    refused(
        "resume over an unreadable trainer state",
        fx.train(&["train.resume=true"]),
        2,
        &["out/checkpoint-4/trainer_state.json is not a lora-train trainer state"],
    );
    assert_eq!(fx.out_files(), before);
    let fx = Fixture::new();
    assert_eq!(fx.train(&[]).0, 0);
    let opt = fx.path("out/checkpoint-2/optimizer.safetensors");
    let len = std::fs::metadata(&opt).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&opt)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let before = fx.out_files();
    refused(
        "a fresh start over a truncated optimiser file",
        fx.train(&[]),
        2,
        &["out/checkpoint-2/optimizer.safetensors is not a complete safetensors file"],
    );
    refused(
        "resuming the truncated checkpoint by path",
        fx.train(&["train.resume=out/checkpoint-2"]),
        2,
        &["out/checkpoint-2/optimizer.safetensors is not a complete safetensors file"],
    );
    assert_eq!(fx.out_files(), before);
    // A resume that would save over a damaged checkpoint is refused too.
    std::fs::remove_dir_all(fx.path("out/checkpoint-2")).unwrap();
    assert_eq!(
        fx.train(&["train.max_steps=6", "output.overwrite=true"]).0,
        0
    );
    std::fs::remove_file(fx.path("out/checkpoint-6/optimizer.safetensors")).unwrap();
    let before = fx.out_files();
    refused(
        "resuming an older checkpoint under a damaged one",
        fx.train(&["train.max_steps=6", "train.resume=out/checkpoint-4"]),
        2,
        &[
            "would save over",
            "out/checkpoint-6/optimizer.safetensors is missing",
        ],
    );
    assert_eq!(fx.out_files(), before);
    // What a fresh start may remove: the checkpoints of a finished run, complete.
    std::fs::remove_dir_all(fx.path("out/checkpoint-6")).unwrap();
    let (code, err) = fx.train(&["train.max_steps=6"]);
    assert_eq!(code, 2, "checkpoint-4 of 6 is unfinished: {err}");
    assert!(err.contains("holds an unfinished run"), "{err}");
    assert!(fx.path("out/checkpoint-4/trainer_state.json").is_file());
}

#[test]
fn a_checkpoint_state_that_does_not_fit_the_run_names_the_field_and_changes_nothing() {
    type Edit = fn(&Fixture);
    let cases: [(&str, Edit, &[&str]); 6] = [
        (
            "a step beyond the run's total",
            |fx| edit_json(&fx.path("out/checkpoint-2/trainer_state.json"), |s| s["step"] = 9.into()),
            &["checkpoint-2/trainer_state.json `step` = 9 is beyond the run's 4 steps"],
        ),
        (
            "a data cursor beyond its epoch",
            |fx| {
                edit_json(&fx.path("out/checkpoint-2/trainer_state.json"), |s| {
                    s["cursor"]["step_in_epoch"] = 999.into()
                })
            },
            &["`cursor.step_in_epoch` = 999 is beyond epoch 0, which has 300 steps"],
        ),
        (
            "a cursor that is not where the step leads",
            |fx| {
                edit_json(&fx.path("out/checkpoint-2/trainer_state.json"), |s| {
                    s["cursor"]["step_in_epoch"] = 1.into()
                })
            },
            &["`cursor` = epoch 0, step 1 of it, which is step 1 of the run, not step = 2"],
        ),
        (
            "an optimiser tensor too many",
            |fx| {
                let p = fx.path("out/checkpoint-2/optimizer.safetensors");
                let mut t = read_st(&p);
                let extra = t[0].1.clone();
                t.push(("base_model.model.extra.lora_A.weight.exp_avg".into(), extra));
                write_st(&p, &t);
            },
            &["optimizer.safetensors holds 17 tensors, but the adapters need 16"],
        ),
        (
            "an optimiser tensor of the wrong shape",
            |fx| {
                let p = fx.path("out/checkpoint-2/optimizer.safetensors");
                let name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight.exp_avg";
                edit_tensor(&p, name, |raw| raw.1 = vec![raw.1[1], raw.1[0]]);
            },
            &["`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight.exp_avg` has shape [64, 8], its adapter tensor [8, 64]"],
        ),
        (
            "a trainer state from another data set (same counts, another order)",
            |fx| {
                let p = fx.path("data/tiny-text.jsonl");
                let text = std::fs::read_to_string(&p).unwrap();
                let mut lines: Vec<&str> = text.lines().collect();
                lines.swap(0, 1);
                std::fs::write(&p, lines.join("\n") + "\n").unwrap();
            },
            &["`data.train`", "is not the data checkpoint", "was trained on"],
        ),
    ];
    for (what, edit, names) in cases {
        let fx = Fixture::new();
        assert_eq!(fx.train(&[]).0, 0);
        // checkpoint-2 is the newest: the run resumes there.
        std::fs::remove_dir_all(fx.path("out/checkpoint-4")).unwrap();
        edit(&fx);
        let before = fx.out_files();
        refused(what, fx.train(&["train.resume=true"]), 2, names);
        assert_eq!(
            fx.out_files(),
            before,
            "{what}: the output must stay as it was"
        );
    }
}

#[test]
fn huge_or_impossible_counts_exit_2_naming_the_key_before_anything_is_allocated() {
    let fx = Fixture::new();
    let cases: &[(&str, &str)] = &[
        (
            "train.max_steps=9223372036854775807",
            "`train.max_steps` = 9223372036854775807",
        ),
        (
            "train.max_steps=1000000000000",
            "`train.max_steps` = 1000000000000",
        ),
        (
            "train.max_steps=400000000",
            "`train.max_steps` = 400000000 would take 1333334 passes over the data",
        ),
        ("lora.rank=1000000000000", "`lora.rank` = 1000000000000"),
        (
            "lora.rank=33",
            "`lora.rank` = 33 is more than the adapted linears allow: v_proj maps 64 → 32",
        ),
        (
            "train.epochs=9223372036854775807",
            "`train.epochs` = 9223372036854775807",
        ),
        (
            "data.seq_len=9223372036854775807",
            "`data.seq_len` = 9223372036854775807",
        ),
        (
            "train.micro_batch=9223372036854775807",
            "`train.micro_batch` = 9223372036854775807",
        ),
        (
            "parallel.timeout_s=9223372036854775807",
            "`parallel.timeout_s` = 9223372036854775807",
        ),
    ];
    for (set, want) in cases {
        refused(set, fx.train(&[set]), 2, &["error: recipe r.toml:", want]);
        assert!(!fx.path("out").exists(), "{set}: nothing may be written");
    }
    // config.json's counts: bounded, and checked against the tensors present.
    // (key, value, the error, whether `plan` (config.json alone, no weights) finds it too)
    for (key, value, want, plan) in [
        ("num_hidden_layers", "100000000000000", "`num_hidden_layers` = 100000000000000 is out of range", true),
        ("num_hidden_layers", "1", "`num_hidden_layers` = 1, but the weights hold 2 decoder layers", false),
        ("num_hidden_layers", "3", "`num_hidden_layers` = 3, but the weights hold 2 decoder layers", false),
        ("hidden_size", "100000000000", "`hidden_size` = 100000000000 is out of range", true),
        ("intermediate_size", "100", "`intermediate_size` = 100, but `model.layers.0.mlp.gate_proj.weight` has shape [176, 64]", false),
        ("vocab_size", "100000000000", "`vocab_size` = 100000000000 is out of range", true),
    ] {
        let fx = Fixture::new();
        fx.set_config(key, value);
        let what = format!("config.json {key} = {value}");
        refused(&what, fx.train(&[]), 2, &["model/config.json", want]);
        assert!(!fx.path("out").exists(), "{what}: nothing may be written");
        if plan {
            let res = fx.run(&["plan", "--recipe", "r.toml"]);
            refused(&format!("plan with {what}"), res, 2, &[want]);
        }
    }
}

/// Spawns `lora-train ARGS` in `dir`, sends `sig` after `after`, and waits for it to end
/// (killing it after `limit`): (exit code, stderr, seconds from the signal to the end).
fn signalled(dir: &Path, args: &[&str], after: Duration, limit: Duration) -> (i32, String, f64) {
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("lora-train"))
        .current_dir(dir)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(after);
    // SAFETY: kill(2) on the pid of a child we spawned and have not reaped yet.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let t = Instant::now();
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code().unwrap_or(-1);
        }
        if t.elapsed() > limit {
            child.kill().unwrap();
            child.wait().unwrap();
            break -1;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (code, err, t.elapsed().as_secs_f64())
}

#[test]
fn more_ranks_than_rows_fails_at_once_and_a_signal_during_loading_ends_the_run() {
    let fx = Fixture::new();
    let one = fx.path("one.jsonl");
    let text = std::fs::read_to_string(fx.path("data/tiny-text.jsonl")).unwrap();
    std::fs::write(&one, text.lines().next().unwrap().to_string() + "\n").unwrap();
    let ranks = ["parallel.devices=[0, 1]", "parallel.timeout_s=5"];
    for strategy in ["ddp", "fsdp"] {
        let t = Instant::now();
        let s = format!("parallel.strategy={strategy}");
        let (code, err) = fx.train(&["data.train=one.jsonl", &s, ranks[0], ranks[1]]);
        refused(
            strategy,
            (code, err),
            1,
            &["epoch 0 has no step: the data gives 1 rows and a step takes 2 per rank × 2 rank(s)"],
        );
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{strategy}: {:?}",
            t.elapsed()
        );
        assert!(
            !fx.path("out").exists(),
            "{strategy}: a run that fails before training writes nothing"
        );
    }

    // A chat template that renders a huge string: loading the data takes minutes, and a
    // SIGTERM ends the run at once (nothing written yet), with one rank or two.
    std::fs::write(
        fx.path("slow.jinja"),
        "{% for m in messages %}{% for i in range(10000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let chat = [
        "data.train=data/tiny-chat.jsonl",
        "data.format=chat",
        "data.chat_template=slow.jinja",
    ];
    for extra in [&[][..], &["parallel.strategy=ddp", ranks[0]][..]] {
        let mut args = vec!["--recipe", "r.toml"];
        for s in chat.iter().chain(extra) {
            args.extend(["--set", s]);
        }
        let (code, err, secs) = signalled(
            fx.tmp.path(),
            &args,
            Duration::from_millis(1500),
            Duration::from_secs(15),
        );
        assert_eq!(code, 130, "{extra:?} ({secs:.1}s after SIGTERM): {err}");
        assert!(secs < 5.0, "{extra:?}: {secs:.1}s after SIGTERM: {err}");
        assert!(
            err.contains("SIGTERM while loading: stopped (nothing was written)"),
            "{err}"
        );
        assert!(!fx.path("out").exists());
    }
}

#[test]
fn garbage_is_refused_naming_the_value() {
    // A tokens data set where no label survives: nothing to train.
    let fx = Fixture::new();
    let rows = "{\"input_ids\": [5, 6, 7, 8], \"labels\": [-100, -100, -100, -100]}\n".repeat(4);
    std::fs::write(fx.path("nolabels.jsonl"), rows).unwrap();
    refused(
        "no label survives",
        fx.train(&["data.train=nolabels.jsonl", "data.format=tokens"]),
        1,
        &["the training data nolabels.jsonl has no token to train on: every label of its 4 examples is -100"],
    );
    assert!(!fx.path("out").exists());

    // lora_alpha = "big" in an adapter config: export and lora.init_adapter alike.
    let fx = Fixture::new();
    assert_eq!(fx.train(&["output.save_every=0"]).0, 0);
    edit_json(&fx.path("out/adapter_config.json"), |c| {
        c["lora_alpha"] = "big".into()
    });
    let want = "adapter config out/adapter_config.json: `lora_alpha` = \"big\" must be a number";
    refused(
        "export",
        fx.run(&[
            "export",
            "--adapter",
            "out",
            "--base",
            "model",
            "--out",
            "merged",
        ]),
        2,
        &[want],
    );
    assert!(!fx.path("merged").exists());
    refused(
        "lora.init_adapter",
        fx.train(&["lora.init_adapter=out", "output.dir=out2"]),
        2,
        &[want],
    );
    assert!(!fx.path("out2").exists());
    edit_json(&fx.path("out/adapter_config.json"), |c| {
        c["lora_alpha"] = 16.into()
    });
    edit_json(&fx.path("out/adapter_config.json"), |c| {
        c["use_rslora"] = "yes".into()
    });
    refused(
        "use_rslora = \"yes\"",
        fx.train(&["lora.init_adapter=out", "output.dir=out2"]),
        2,
        &["`use_rslora` = \"yes\" must be true or false"],
    );

    // Integer base weights are not cast to floats.
    let fx = Fixture::new();
    edit_tensor(
        &fx.path("model/model.safetensors"),
        "model.norm.weight",
        |raw| {
            raw.0 = "I32".into();
        },
    );
    refused(
        "an I32 base tensor",
        fx.train(&[]),
        1,
        &["tensor `model.norm.weight` in model/model.safetensors has dtype I32, an integer dtype"],
    );
    assert!(!fx.path("out").exists());

    // plan's numbers start at 1: command-line errors.
    for flag in ["--gpus", "--seq", "--micro-batch", "--rank"] {
        let (code, err) = fx.run(&["plan", "--shape", "tiny", flag, "0"]);
        refused(
            flag,
            (code, err),
            2,
            &[&format!("invalid value '0' for '{flag}")],
        );
    }
}

#[test]
fn non_finite_weights_and_bad_config_values_are_named_instead_of_blamed_on_the_lr() {
    // A NaN in a shard, an infinity in another tensor: named as the model loads.
    for (name, v) in [
        ("model.layers.1.mlp.up_proj.weight", f32::NAN),
        ("model.norm.weight", f32::INFINITY),
    ] {
        let fx = Fixture::new();
        edit_tensor(&fx.path("model/model.safetensors"), name, |raw| {
            set_f32(raw, 3, v)
        });
        let (code, err) = fx.train(&[]);
        refused(
            name,
            (code, err.clone()),
            1,
            &[&format!(
                "tensor `{name}` in model holds NaN or infinite values"
            )],
        );
        assert!(!err.contains("lower train.lr"), "{err}");
        assert!(!fx.path("out").exists());
    }
    // NaN weights in a checkpoint's adapter: named before the run goes on.
    let fx = Fixture::new();
    assert_eq!(fx.train(&[]).0, 0);
    std::fs::remove_dir_all(fx.path("out/checkpoint-4")).unwrap();
    let key = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight";
    edit_tensor(
        &fx.path("out/checkpoint-2/adapter_model.safetensors"),
        key,
        |raw| set_f32(raw, 0, f32::NAN),
    );
    let before = fx.out_files();
    let (code, err) = fx.train(&["train.resume=true"]);
    refused(
        "NaN in a checkpoint",
        (code, err.clone()),
        1,
        &[&format!("`{key}` holds NaN or infinite values")],
    );
    assert!(!err.contains("lower train.lr"), "{err}");
    assert_eq!(fx.out_files(), before);

    // config.json values that can only give NaN.
    for (key, value, want) in [
        (
            "rope_theta",
            "0",
            "`rope_theta` = 0 must be a positive number",
        ),
        (
            "rms_norm_eps",
            "-1",
            "`rms_norm_eps` = -1 must be in (0, 1)",
        ),
        (
            "pad_token_id",
            "100000",
            "`pad_token_id` = 100000 is not a token: vocab_size is 512",
        ),
        (
            "num_attention_heads",
            "5",
            "num_attention_heads 5 is not a multiple of num_key_value_heads 2",
        ),
        (
            "rope_scaling",
            "{\"rope_type\": \"linear\", \"factor\": 0}",
            "`rope_scaling.factor` = 0 must be a positive number",
        ),
    ] {
        let fx = Fixture::new();
        fx.set_config(key, value);
        refused(key, fx.train(&[]), 2, &["model/config.json", want]);
        assert!(!fx.path("out").exists());
    }

    // Output directories that cannot be one: recipe errors, found before any weight is read
    // (the weights here are not even a safetensors file).
    let fx = Fixture::new();
    std::fs::write(fx.path("model/model.safetensors"), "not weights").unwrap();
    std::fs::write(fx.path("afile"), "").unwrap();
    for (set, want) in [
        ("output.dir=", "`output.dir` is empty"),
        (
            "output.dir=afile",
            "`output.dir` afile is an existing file, not a directory",
        ),
        (
            "output.dir=afile/sub",
            "`output.dir` afile/sub cannot be created: afile is a file",
        ),
    ] {
        refused(set, fx.train(&[set]), 2, &["error: recipe r.toml:", want]);
    }
    std::fs::write(
        fx.tmp.path().join("empty.toml"),
        RECIPE.replace("dir = \"out\"", "dir = \"\""),
    )
    .unwrap();
    refused(
        "dir = \"\" in the file",
        fx.run(&["--recipe", "empty.toml"]),
        2,
        &["`output.dir` is empty"],
    );

    // An unsupported safetensors dtype names the file and the tensor.
    let fx = Fixture::new();
    edit_tensor(
        &fx.path("model/model.safetensors"),
        "model.layers.0.input_layernorm.weight",
        |raw| {
            raw.0 = "F8_E4M3".into();
            raw.2.truncate(raw.1[0]);
        },
    );
    refused(
        "F8_E4M3",
        fx.train(&[]),
        1,
        &["tensor `model.layers.0.input_layernorm.weight` in model/model.safetensors has dtype F8_E4M3"],
    );
}

#[test]
fn bad_flags_to_plan_download_and_export_exit_2() {
    let fx = Fixture::new();
    let cases: &[&[&str]] = &[
        &["plan", "--shape", "tiny", "--gpus", "x"],
        &["plan", "--shape", "tiny", "--gpu-mem", "12XB"],
        &["plan"],
        &["plan", "--recipe", "nope.toml"],
        &["download"],
        &["download", "a/b/c"],
        &["download", "org/name", "--revision", ""],
        &["download", "org/name", "--revision", "../main"],
        &["export", "--adapter", "nope", "--out", "merged"],
        &["export", "--adapter", "data", "--out", "merged"],
    ];
    for args in cases {
        let o = bin()
            .current_dir(fx.tmp.path())
            .args(*args)
            .env("HF_HUB_OFFLINE", "1")
            .env("HF_HUB_CACHE", fx.path("hub"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    }
    assert!(!fx.path("merged").exists() && !fx.path("hub").exists());
}

#[test]
fn a_line_that_is_not_utf8_is_a_bad_row_and_blank_lines_are_skipped() {
    let fx = Fixture::new();
    let good = std::fs::read(fx.path("data/tiny-text.jsonl")).unwrap();
    let mut data = b"\n   \n".to_vec();
    data.extend_from_slice(b"{\"text\": \"caf\xe9 latin-1\"}\n\r\n");
    data.extend_from_slice(&good);
    std::fs::write(fx.path("mixed.jsonl"), &data).unwrap();

    // on_bad_row = "error" (the default) names the line and the encoding.
    refused(
        "a latin-1 line",
        fx.train(&["data.train=mixed.jsonl"]),
        1,
        &["mixed.jsonl:3: not valid UTF-8 (byte 14 of the line); re-encode the file as UTF-8"],
    );
    assert!(!fx.path("out").exists());

    // on_bad_row = "skip" skips it (the blank lines are not rows at all) and trains.
    let (code, err) = fx.train(&["data.train=mixed.jsonl", "data.on_bad_row=skip"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("skipped 1 bad rows (data.on_bad_row = \"skip\"); first: mixed.jsonl:3: not valid UTF-8"),
        "{err}"
    );
}

#[test]
fn a_chat_row_with_no_assistant_turn_is_named_not_blamed_on_seq_len() {
    let fx = Fixture::new();
    let rows = "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello?\"}]}\n".repeat(3);
    std::fs::write(fx.path("noreply.jsonl"), rows).unwrap();
    let (code, err) = fx.train(&["data.train=noreply.jsonl", "data.format=chat"]);
    refused(
        "no assistant turn",
        (code, err.clone()),
        1,
        &[
            "3 examples have nothing to train on under train_on = \"completions\"; first: noreply.jsonl:1: no assistant turn",
            "set data.train_on = \"all\"",
        ],
    );
    assert!(!err.contains("seq_len"), "{err}");
    assert!(!fx.path("out").exists());
}

#[test]
fn an_unsupported_model_type_exits_2_naming_it_and_the_list_before_any_weight_is_read() {
    for (model_type, extra, names) in [
        (
            "bert",
            None,
            &["model_type `bert` is not supported; supported: "][..],
        ),
        (
            "llava",
            Some(("text_config", r#"{"model_type": "llama"}"#)),
            &["model_type `llava` is not supported (a vision-language checkpoint"][..],
        ),
        (
            "gemma3",
            None,
            &["Gemma 3's text model alone is `gemma3_text`"][..],
        ),
    ] {
        let fx = Fixture::new();
        fx.set_config("model_type", &format!("\"{model_type}\""));
        if let Some((k, v)) = extra {
            fx.set_config(k, v);
        }
        // Weights that cannot be parsed: the refusal must come before they are opened.
        std::fs::write(fx.path("model/model.safetensors"), b"not safetensors").unwrap();
        let (code, err) = fx.train(&[]);
        refused(model_type, (code, err.clone()), 2, names);
        for family in [
            "llama",
            "mistral",
            "qwen2",
            "qwen3",
            "gemma2",
            "gemma3_text",
            "phi3",
            "qwen3_moe",
        ] {
            assert!(
                err.contains(family),
                "{model_type}: the list lacks {family}: {err}"
            );
        }
        assert!(
            !err.contains("safetensors"),
            "{model_type}: weights were read: {err}"
        );
        assert!(!fx.path("out").exists());
    }
}

#[test]
fn activation_checkpointing_takes_true_false_or_mlp_and_names_the_rest() {
    let fx = Fixture::new();
    refused(
        "activation_checkpointing = \"attn\"",
        fx.train(&["train.activation_checkpointing=attn"]),
        2,
        &[
            "train.activation_checkpointing",
            "expected true, false or \"mlp\"",
            "found \"attn\"",
        ],
    );
    assert!(!fx.path("out").exists());
    // "mlp" recomputes the MLP half in backward: the same losses as keeping everything.
    let losses = |dir: &str| -> Vec<f64> {
        std::fs::read_to_string(fx.path(dir).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["loss"].as_f64())
            .collect()
    };
    for (value, dir) in [("false", "off"), ("mlp", "mlp")] {
        let set = format!("train.activation_checkpointing={value}");
        let out = format!("output.dir={dir}");
        let (code, err) = fx.train(&[&set, &out, "lora.dropout=0.1"]);
        assert_eq!(code, 0, "{value}: {err}");
    }
    let (off, mlp) = (losses("off"), losses("mlp"));
    assert_eq!(off.len(), 4, "{off:?}");
    assert_eq!(off, mlp);
}
