//! The data features through the real binary: the alpaca and chat recipes with eval loss, a
//! weighted mix with skipped rows, and data errors that stop the run before anything is written.

use crate::common::root;
use assert_cmd::Command;

fn bin() -> Command {
    Command::cargo_bin("lora-train").unwrap()
}

fn metrics(dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Runs a shipped recipe for 20 steps, eval every 10; returns (stdout, stderr, metrics rows).
fn run_recipe(recipe: &str) -> (String, String, Vec<serde_json::Value>) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let o = bin()
        .current_dir(root())
        .args(["--recipe", recipe, "--set"])
        .arg(format!("output.dir={}", out.display()))
        .args([
            "--set",
            "train.max_steps=20",
            "--set",
            "train.eval_every=10",
        ])
        .args(["--set", "train.log_every=5"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{stderr}");
    assert!(out.join("adapter_model.safetensors").is_file());
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr,
        metrics(&out),
    )
}

fn check_eval_rows(rows: &[serde_json::Value], what: &str) {
    let steps: Vec<u64> = rows.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![5, 10, 15, 20], "{what}");
    let eval: Vec<f64> = rows
        .iter()
        .filter_map(|r| r["eval_loss"].as_f64())
        .collect();
    assert_eq!(eval.len(), 2, "{what}: eval at steps 10 and 20: {rows:?}");
    assert!(eval[1] < eval[0], "{what}: eval loss must fall: {eval:?}");
    assert!(rows[1]["eval_tokens"].as_u64().unwrap() > 0);
    let loss = |i: usize| rows[i]["loss"].as_f64().unwrap();
    assert!(loss(3) < loss(0), "{what}: loss must fall: {rows:?}");
    for r in rows {
        assert_eq!(
            (r["truncated"].as_u64(), r["skipped_rows"].as_u64()),
            (Some(0), Some(0))
        );
    }
}

#[test]
fn alpaca_recipe_trains_on_completions_with_eval_loss() {
    let (stdout, stderr, rows) = run_recipe("recipes/tiny-cpu-alpaca.toml");
    assert!(
        stderr.contains("data recipes/data/tiny-alpaca.jsonl: 54 examples (0 truncated to seq_len 256), 20 steps"),
        "{stderr}"
    );
    assert!(
        stderr.contains("eval: 6 examples from data.eval_fraction 0.1 of the training data (0 truncated, 0 bad rows skipped)"),
        "{stderr}"
    );
    assert!(stderr.contains("step 10/20  loss "), "{stderr}");
    assert!(stderr
        .lines()
        .any(|l| l.starts_with("step 10/20") && l.contains("  eval ")));
    let last = rows[3]["eval_loss"].as_f64().unwrap();
    assert!(
        stdout.ends_with(&format!("eval loss {last:.4}\n")),
        "{stdout}"
    );
    check_eval_rows(&rows, "alpaca");
}

#[test]
fn chat_recipe_trains_on_assistant_turns_with_eval_loss() {
    let (_, stderr, rows) = run_recipe("recipes/tiny-cpu-chat.toml");
    assert!(
        stderr.contains(
            "data recipes/data/tiny-chat.jsonl: 54 examples (0 truncated to seq_len 256), 20 steps"
        ),
        "{stderr}"
    );
    // The 60 conversations of the file (eval ones included) hold 75 assistant turns, each
    // ended by </s>.
    assert!(
        stderr.contains("75 completions end with </s> (id 2)"),
        "{stderr}"
    );
    check_eval_rows(&rows, "chat");
}

#[test]
fn a_weighted_mix_with_bad_rows_skipped_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let data = root().join("recipes/data");
    let bad = d.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Yes.\"}]}\n{\"messages\": 3}\n",
    )
    .unwrap();
    let recipe = d.join("mix.toml");
    std::fs::write(
        &recipe,
        format!(
            r#"[model]
path = "{model}"
[data]
train = [{{ path = "{chat}", format = "chat" }}, {{ path = "{alpaca}", format = "alpaca", weight = 0.5 }}, {{ path = "{bad}", format = "chat", weight = 2.0 }}]
seq_len = 256
on_bad_row = "skip"
[train]
micro_batch = 8
max_steps = 2
[output]
dir = "{out}"
"#,
            model = root().join("recipes/assets/tiny-llama").display(),
            chat = data.join("tiny-chat.jsonl").display(),
            alpaca = data.join("tiny-alpaca.jsonl").display(),
            bad = bad.display(),
            out = d.join("out").display(),
        ),
    )
    .unwrap();
    let o = bin().arg("--recipe").arg(&recipe).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    // 60 chat + 60 alpaca + 1 good row; an epoch is 60 + 30 + 2 = 92 rows = 12 steps of 8.
    assert!(
        stderr.contains(": 121 examples (0 truncated to seq_len 256), 2 steps"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "data mix: {} (60 examples, weight 1), {} (60 examples, weight 0.5), {} (1 examples, weight 2)",
            data.join("tiny-chat.jsonl").display(),
            data.join("tiny-alpaca.jsonl").display(),
            bad.display()
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "skipped 1 bad rows (data.on_bad_row = \"skip\"); first: {}:2: \"messages\" must be a list",
            bad.display()
        )),
        "{stderr}"
    );
    let rows = metrics(&d.join("out"));
    assert_eq!(rows[1]["skipped_rows"], 1);
}

#[test]
fn chat_without_a_template_exits_2_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let src = root().join("recipes/assets/tiny-llama");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), model.join(f)).unwrap();
    }
    std::fs::write(
        model.join("tokenizer_config.json"),
        "{\"eos_token\": \"</s>\"}",
    )
    .unwrap();
    let out = tmp.path().join("out");
    let o = bin()
        .current_dir(tmp.path())
        .args(["--recipe"])
        .arg(root().join("recipes/tiny-cpu-chat.toml"))
        .args(["--set", "model.path=model", "--set", "output.dir=out"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.ends_with(
            "`data.chat_template` is unset, and model has no chat template (no chat_template.jinja, no chat_template in model/tokenizer_config.json): set data.chat_template to a .jinja file\n"
        ),
        "{err}"
    );
    assert!(!out.exists(), "nothing is written");
}
