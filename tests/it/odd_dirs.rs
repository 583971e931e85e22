//! Directories that are odd. Paths that are not UTF-8 (issue 63, class 9): a run whose recipe, base, data and output
//! live in a directory named with the byte 0xFF records them relative to the files that hold
//! them (recipe.toml, adapter_config.json; TOML and JSON hold only UTF-8), so the records load
//! back to the same files and `export` and `generate` find the base without `--base`; a path
//! no record can hold is refused before the run trains (exit 2), naming the field. Directories that
//! cannot be written (under /proc: refused to root as well): a run or an export there exits 1
//! naming the directory, without a panic.

use crate::common::{copy_dir, root};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin("lora-train"));
    c.current_dir(root());
    c
}

/// `<tmp>/lt-\xff-odd/` with the tiny Llama (`base/`), the tiny text data (`data.jsonl`) and
/// a recipe naming them relative to itself, training 2 steps with a checkpoint at step 1.
fn odd_dir(tmp: &Path) -> PathBuf {
    let odd = tmp.join(OsStr::from_bytes(b"lt-\xff-odd"));
    assert!(odd.to_str().is_none());
    copy_dir(&root().join("recipes/assets/tiny-llama"), &odd.join("base"));
    std::fs::copy(
        root().join("recipes/data/tiny-text.jsonl"),
        odd.join("data.jsonl"),
    )
    .unwrap();
    let recipe = std::fs::read_to_string(root().join("recipes/tiny-cpu.toml"))
        .unwrap()
        .replace("path = \"assets/tiny-llama\"", "path = \"base\"")
        .replace("train = \"data/tiny-text.jsonl\"", "train = \"data.jsonl\"")
        .replace("max_steps = 200", "max_steps = 2")
        .replace("save_every = 100", "save_every = 1\ndir = \"run\"");
    std::fs::write(odd.join("recipe.toml"), recipe).unwrap();
    odd
}

fn ok(o: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    err
}

#[test]
fn a_run_in_a_non_utf8_directory_records_its_base_so_export_and_generate_find_it() {
    let tmp = tempfile::tempdir().unwrap();
    let odd = odd_dir(tmp.path());
    let run = odd.join("run");
    ok(&bin()
        .arg("train")
        .arg("--recipe")
        .arg(odd.join("recipe.toml"))
        .output()
        .unwrap());
    // What the run recorded: paths relative to the file's directory, UTF-8.
    let recorded = |file: &Path| -> toml::Table {
        toml::from_str(&std::fs::read_to_string(file).unwrap()).unwrap()
    };
    let r = recorded(&run.join("recipe.toml"));
    assert_eq!(r["model"]["path"].as_str(), Some("../base"));
    assert_eq!(r["data"]["train"].as_str(), Some("../data.jsonl"));
    assert_eq!(r["output"]["dir"].as_str(), Some("."));
    let ck = recorded(&run.join("checkpoint-1/recipe.toml"));
    assert_eq!(ck["model"]["path"].as_str(), Some("../../base"));
    for dir in [run.clone(), run.join("checkpoint-1")] {
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("adapter_config.json")).unwrap())
                .unwrap();
        let base = cfg["base_model_name_or_path"].as_str().unwrap();
        assert_eq!(
            std::fs::canonicalize(dir.join(base)).unwrap(),
            std::fs::canonicalize(odd.join("base")).unwrap()
        );
    }
    // The record loads back to the same files.
    let back = lora_train::recipe::Recipe::load(&run.join("recipe.toml"), &[]).unwrap();
    let same = |a: &Path, b: &Path| {
        assert_eq!(
            std::fs::canonicalize(a).unwrap(),
            std::fs::canonicalize(b).unwrap()
        )
    };
    same(back.model.path.as_deref().unwrap(), &odd.join("base"));
    same(&back.output_dir(), &run);
    // export and generate without --base / --model find the base.
    let merged = odd.join("merged");
    ok(&bin()
        .args(["export", "--adapter"])
        .arg(&run)
        .arg("--out")
        .arg(&merged)
        .output()
        .unwrap());
    assert!(merged.join("config.json").is_file());
    let o = bin()
        .args(["generate", "--adapter"])
        .arg(&run)
        .args(["--prompt", "Once", "--max-new-tokens", "2"])
        .output()
        .unwrap();
    ok(&o);
    assert!(!o.stdout.is_empty());
    // A resume from the run's own checkpoint: the recipe's fingerprint holds its paths.
    // (--set takes UTF-8: the checkpoint is named from the odd directory itself.)
    let o = bin()
        .current_dir(&odd)
        .args(["train", "--recipe", "recipe.toml", "--set"])
        .arg("train.resume=run/checkpoint-1")
        .output()
        .unwrap();
    let err = ok(&o);
    assert!(err.contains("resuming from"), "{err}");
}

#[test]
fn a_non_utf8_base_that_no_record_can_hold_is_refused_before_training() {
    let tmp = tempfile::tempdir().unwrap();
    let odd = odd_dir(tmp.path());
    let out = tmp.path().join("plain-run");
    let o = bin()
        .arg("train")
        .arg("--recipe")
        .arg(odd.join("recipe.toml"))
        .arg("--set")
        .arg(format!("output.dir={}", out.display()))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("`model.path` = \"")
            && err.contains("lt-\\xFF-odd/base\" is not UTF-8, nor is its path from")
            && err.contains("recipe.toml (UTF-8) cannot record it"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out.join("adapter_model.safetensors").exists());
    assert!(!out.join("checkpoint-1").exists());
}

#[test]
fn a_run_or_an_export_into_a_directory_that_cannot_be_written_exits_1_naming_it() {
    let out = "/proc/lt-read-only/run";
    let o = bin()
        .args(["train", "--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={out}"))
        .args(["--set", "train.max_steps=1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("/proc/lt-read-only"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let o = bin()
        .args([
            "export",
            "--adapter",
            "tests/fixtures/golden/tiny_shipped/init_adapter",
        ])
        .args([
            "--base",
            "recipes/assets/tiny-llama",
            "--out",
            "/proc/lt-read-only/merged",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("/proc/lt-read-only"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
