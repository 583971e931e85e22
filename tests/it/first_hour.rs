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
