//! stdout and stderr that fail under the real binary: a pipe whose reader is gone before the
//! first write (`check | head -1`, made deterministic: the read end is closed first) ends a
//! command quietly with status 0; a full disk (/dev/full) under a command's product is one
//! error and exit 1; under a run's logs it is one warning on the other stream and the run's
//! own status; a run whose log reader goes away stops as on SIGINT, with a checkpoint that a
//! resume continues; a run whose stdout reader is gone keeps its adapter and its exit 0.

use crate::common::root;
use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};

fn bin() -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin("lora-train"));
    c.current_dir(root());
    c
}

/// A write end whose reader is already gone.
fn closed_pipe() -> std::fs::File {
    let (r, w) = crate::common::pipe();
    drop(r);
    w
}

fn dev_full() -> std::fs::File {
    std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap()
}

/// The tiny CPU recipe, `steps` steps of one row, a line per step.
fn train_args(out: &Path, steps: usize) -> Vec<String> {
    let mut v: Vec<String> = vec!["--recipe".into(), "recipes/tiny-cpu.toml".into()];
    for s in [
        format!("output.dir={}", out.display()),
        format!("train.max_steps={steps}"),
        "train.micro_batch=1".into(),
        "train.grad_accum=1".into(),
        "train.log_every=1".into(),
    ] {
        v.extend(["--set".into(), s]);
    }
    v
}

const FULL: &str = "No space left on device (os error 28)";

#[test]
fn a_closed_stdout_ends_a_command_quietly_with_status_0() {
    for args in [
        &["check", "--recipe", "recipes/tiny-cpu.toml"][..],
        &[
            "plan",
            "--recipe",
            "recipes/tiny-cpu.toml",
            "--gpu-mem",
            "1GiB",
        ],
    ] {
        let o = bin()
            .args(args)
            .stdout(closed_pipe())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {err}");
        assert_eq!(err, "", "{args:?}");
    }
}

#[test]
fn a_full_disk_under_a_commands_output_is_one_error_and_exit_1() {
    let o = bin()
        .args(["check", "--recipe", "recipes/tiny-cpu.toml"])
        .stdout(dev_full())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        format!("error: cannot write the output to stdout: {FULL}\n")
    );
}

#[test]
fn a_full_disk_under_a_runs_logs_is_reported_once_and_the_run_ends_as_it_would() {
    let tmp = tempfile::tempdir().unwrap();
    // stderr full: one warning on stdout, then the run's own line.
    let out = tmp.path().join("a");
    let o = bin()
        .args(train_args(&out, 4))
        .stdout(Stdio::piped())
        .stderr(dev_full())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        format!("warning: cannot write to stderr ({FULL}); its further lines are dropped")
    );
    assert!(lines[1].starts_with("trained 4 steps"), "{text}");
    assert_eq!(lines.len(), 2, "{text}");
    assert!(out.join("adapter_model.safetensors").is_file());
    assert!(out.join("checkpoint-4/trainer_state.json").is_file());
    // stdout full: one warning on stderr; the run's status is unchanged.
    let out = tmp.path().join("b");
    let o = bin()
        .args(train_args(&out, 4))
        .stdout(dev_full())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let warning =
        format!("warning: cannot write to stdout ({FULL}); its further lines are dropped");
    assert_eq!(err.matches(&warning).count(), 1, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.join("adapter_model.safetensors").is_file());
}

#[test]
fn a_run_whose_stdout_reader_is_gone_keeps_its_adapter_and_exit_0() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let o = bin()
        .args(train_args(&out, 3))
        .stdout(closed_pipe())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        !err.contains("panicked") && !err.contains("was closed"),
        "{err}"
    );
    assert!(err.contains("step 3/3"), "{err}");
    assert!(out.join("adapter_model.safetensors").is_file());
}

#[test]
fn a_run_whose_log_reader_goes_away_stops_with_a_checkpoint_that_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (r, w) = crate::common::pipe();
    let mut cmd = bin();
    cmd.args(train_args(&out, 300))
        .stdout(Stdio::piped())
        .stderr(w);
    let child = cmd.spawn().unwrap();
    drop(cmd);
    // Read until step 2 is logged, then go away: the run's next line meets a closed pipe.
    let mut lines = std::io::BufReader::new(r).lines();
    loop {
        let l = lines.next().expect("the run ended before step 2").unwrap();
        if l.starts_with("step 2/300") {
            break;
        }
    }
    drop(lines);
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "");
    let saved = lora_train::run::checkpoint::list(&out);
    assert_eq!(saved.len(), 1, "{saved:?}");
    let (k, dir) = &saved[0];
    assert!((2..300).contains(k), "{saved:?}");
    assert!(dir.join("optimizer.safetensors").is_file());
    assert!(!out.join("adapter_model.safetensors").exists());
    // The checkpoint continues the run to its end.
    let mut resume = train_args(&out, 300);
    resume.extend(["--set".into(), "train.resume=true".into()]);
    let o = bin().args(&resume).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "resuming from {} (step {k} of 300)",
            dir.display()
        )),
        "{err}"
    );
    assert!(out.join("adapter_model.safetensors").is_file());
}
