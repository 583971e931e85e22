//! What a new user meets in the first hour, through the real binary: where the adapter says its
//! base is, the numbers its config writes, resuming without repeating every --set, what
//! `check` prints.

use crate::common::root;
use assert_cmd::Command;
use std::path::Path;

fn bin() -> Command {
    Command::cargo_bin("lora-train").unwrap()
}

/// Trains the tiny recipe (named relative to the repository root, where it runs) for `steps`
/// steps into `out`; (exit code, stderr).
fn train(out: &Path, steps: usize, sets: &[&str]) -> (i32, String) {
    let mut cmd = bin();
    cmd.current_dir(root())
        .args(["--recipe", "recipes/tiny-cpu.toml"])
        .arg("--set")
        .arg(format!("output.dir={}", out.display()))
        .args(["--set", &format!("train.max_steps={steps}")]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let o = cmd.output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn adapter_config(dir: &Path) -> (String, serde_json::Value) {
    let text = std::fs::read_to_string(dir.join("adapter_config.json")).unwrap();
    let v = serde_json::from_str(&text).unwrap();
    (text, v)
}

/// The adapter names its local base by an absolute path, so `export` (and PEFT) find it from
/// any working directory; an older adapter's relative path resolves against the adapter's own
/// directory too.
#[test]
fn export_finds_the_base_from_anywhere() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (code, err) = train(&out, 2, &[]);
    assert_eq!(code, 0, "{err}");
    let (_, cfg) = adapter_config(&out);
    let base = cfg["base_model_name_or_path"].as_str().unwrap();
    assert!(Path::new(base).is_absolute(), "{base}");
    assert!(Path::new(base).join("config.json").is_file(), "{base}");

    let elsewhere = tempfile::tempdir().unwrap();
    let o = bin()
        .current_dir(elsewhere.path())
        .arg("export")
        .arg("--adapter")
        .arg(&out)
        .arg("--out")
        .arg(tmp.path().join("merged"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(tmp.path().join("merged/config.json").is_file());

    // An adapter written with a path relative to itself.
    let copy = tmp.path().join("adapters/mine");
    std::fs::create_dir_all(&copy).unwrap();
    for f in ["adapter_model.safetensors", "adapter_config.json"] {
        std::fs::copy(out.join(f), copy.join(f)).unwrap();
    }
    let base_copy = tmp.path().join("base");
    std::fs::create_dir_all(&base_copy).unwrap();
    for e in std::fs::read_dir(base).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), base_copy.join(e.file_name())).unwrap();
    }
    let (text, _) = adapter_config(&copy);
    let text = text.replace(base, "../../base");
    std::fs::write(copy.join("adapter_config.json"), text).unwrap();
    let o = bin()
        .current_dir(elsewhere.path())
        .arg("export")
        .arg("--adapter")
        .arg(&copy)
        .arg("--out")
        .arg(tmp.path().join("merged2"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// adapter_config.json carries the recipe's dropout as written (0.05), not an f32's digits.
#[test]
fn adapter_config_writes_the_recipes_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (code, err) = train(&out, 1, &[]);
    assert_eq!(code, 0, "{err}");
    let (text, cfg) = adapter_config(&out);
    assert_eq!(cfg["lora_dropout"].as_f64(), Some(0.05), "{text}");
    assert!(text.contains("\"lora_dropout\": 0.05,"), "{text}");
}

/// A resume needs only the recipe: the checkpoint keeps the run's overrides that change the
/// numbers and applies them again; an override given now that conflicts with one of them is
/// refused, naming it.
#[test]
fn resume_picks_up_the_runs_overrides() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (code, err) = train(&out, 4, &["lora.rank=4", "output.save_every=2"]);
    assert_eq!(code, 0, "{err}");
    let ck = out.join("checkpoint-2");
    let resume = format!("train.resume={}", ck.display());
    let o = bin()
        .current_dir(root())
        .args(["--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", out.display()))
        .args(["--set", &resume])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("--set train.max_steps=4 --set lora.rank=4"),
        "{err}"
    );
    let (_, cfg) = adapter_config(&out);
    assert_eq!(cfg["r"], 4);

    let o = bin()
        .current_dir(root())
        .args(["--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", out.display()))
        .args(["--set", &resume, "--set", "lora.rank=8"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("`lora.rank` = 8, but checkpoint"), "{err}");
}

/// `plan` answers for the recipe's own row first (marked in the table): whether it fits as
/// written, and at which micro-batch; the legend explains every column. `--recipe` with
/// `--shape` is refused with the reason (exit 2).
#[test]
fn plan_answers_for_the_recipes_own_row() {
    let run = |args: &[&str]| {
        let o = bin().current_dir(root()).args(args).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        (o.status.code().unwrap_or(-1), out, err)
    };
    let (code, out, err) = run(&[
        "plan",
        "--recipe",
        "recipes/tiny-cpu.toml",
        "--set",
        "parallel.strategy=fsdp",
        "--set",
        "parallel.devices=[0,1,2,3]",
        "--gpu-mem",
        "515MiB",
    ]);
    assert_eq!(code, 0, "{err}");
    let marked: Vec<&str> = out.lines().filter(|l| l.ends_with("  *")).collect();
    assert_eq!(marked.len(), 1, "{out}");
    assert!(marked[0].starts_with("fsdp ×4 "), "{out}");
    let verdict = out
        .lines()
        .find(|l| l.starts_with("as written (fsdp ×4, marked *): "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(verdict.contains("does NOT fit"), "{verdict}");
    assert!(verdict.contains("micro-batch 8; micro-batch "), "{verdict}");
    let first_advice = out.find("advice:").unwrap();
    assert!(out.find("as written").unwrap() < first_advice, "{out}");
    assert!(
        out.contains("max mb: the largest micro-batch that fits"),
        "{out}"
    );

    let (code, _, err) = run(&[
        "plan",
        "--recipe",
        "recipes/tiny-cpu.toml",
        "--shape",
        "tiny",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("'--recipe <RECIPE>' cannot be used with '--shape <SHAPE>'"),
        "{err}"
    );
}

/// A fresh run over a finished run's directory (with --overwrite) leaves no file of the earlier run that could be
/// taken for its own: interrupted early, the directory holds the new run's checkpoint and no
/// earlier final adapter (PeftModel.from_pretrained on it would load the old weights). An
/// adapter there that no run of ours wrote is refused, naming it, before anything is loaded.
#[test]
fn a_fresh_run_leaves_no_adapter_of_the_earlier_run() {
    use std::io::{BufRead, BufReader};
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (code, err) = train(&out, 3, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.join("adapter_model.safetensors").is_file());

    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("lora-train"))
        .current_dir(root())
        .args(["--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", out.display()))
        .args(["--set", "train.max_steps=300", "--set", "train.log_every=1"])
        .arg("--overwrite")
        .args([
            "--set",
            "train.micro_batch=1",
            "--set",
            "train.grad_accum=1",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    for l in lines.by_ref() {
        let l = l.unwrap();
        let started = l.starts_with("step 1/300");
        seen.push(l);
        if started {
            break;
        }
    }
    // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    seen.extend(lines.map_while(Result::ok));
    let status = child.wait().unwrap();
    let text = seen.join("\n");
    assert_eq!(status.code(), Some(130), "{text}");
    assert!(
        text.contains("removed adapter_model.safetensors, adapter_config.json of an earlier run"),
        "{text}"
    );
    assert!(!out.join("adapter_model.safetensors").exists(), "{text}");
    assert!(!out.join("adapter_config.json").exists(), "{text}");
    assert!(!checkpoint_dirs(&out).is_empty(), "{text}");

    // Not ours: an adapter put there by hand, no recipe.toml / metrics.jsonl beside it.
    let foreign = tmp.path().join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("adapter_config.json"), "{}").unwrap();
    let (code, err) = train(&foreign, 1, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("which no lora-train run there wrote"), "{err}");
    assert!(foreign.join("adapter_config.json").is_file());
}

fn checkpoint_dirs(out: &Path) -> Vec<String> {
    std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect()
}
