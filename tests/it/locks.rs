//! Two processes, one directory, with the real binary. A first export or run is held while it
//! holds its lock (its stderr is a full pipe: it stops at its first line), and a second export
//! to that `--out`, a second `train` or a resume on that `output.dir` refuses, naming the
//! holder's pid, and writes nothing; the first then ends as it would have. A lock left by a
//! dead process is taken over. A download of a repository another process is fetching waits
//! for it, naming it.

use crate::common::{root, wait_until, Blocked};
use crate::liar::{Liar, Req, Server, REPO};
use lora_train::util::lock::DirLock;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

fn bin() -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin("lora-train"));
    c.current_dir(root());
    c
}

fn export(out: &Path) -> Command {
    let mut c = bin();
    c.args([
        "export",
        "--adapter",
        "tests/fixtures/golden/tiny_shipped/init_adapter",
        "--base",
        "recipes/assets/tiny-llama",
        "--max-shard-size",
        "300KB",
        "--out",
    ])
    .arg(out);
    c
}

fn train(out: &Path, extra: &[&str]) -> Command {
    let mut c = bin();
    c.args(["train", "--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", out.display()))
        .args(["--set", "train.max_steps=3", "--set", "output.save_every=2"]);
    for s in extra {
        c.args(["--set", s]);
    }
    c
}

/// The lock file of directory `dir` (which need not exist).
fn lock_of(dir: &Path) -> PathBuf {
    let parent = dir.parent().unwrap().canonicalize().unwrap();
    parent.join(format!(
        ".{}.lora-train.lock",
        dir.file_name().unwrap().to_string_lossy()
    ))
}

/// Waits until `pid` holds the lock of `dir` for `what`.
fn held_by(dir: &Path, pid: u32, what: &str) -> PathBuf {
    let lock = lock_of(dir);
    let want = format!("{pid} {what}\n");
    wait_until("the lock", || {
        std::fs::read_to_string(&lock).is_ok_and(|t| t == want)
    });
    lock
}

fn refusal(flag: &str, dir: &Path, pid: u32, what: &str, lock: &Path) -> String {
    format!(
        "error: {flag}: {} is in use: pid {pid} ({what}) holds its lock {}; wait for it to end \
         (or stop it), or choose another directory\n",
        dir.display(),
        lock.display()
    )
}

#[test]
fn a_second_export_to_a_locked_out_refuses_and_names_the_holder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let first = Blocked::spawn(export(&out));
    let pid = first.child.id();
    let lock = held_by(&out, pid, "lora-train export");
    let o = export(&out).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        refusal("--out", &out, pid, "lora-train export", &lock)
    );
    assert!(!out.exists());
    let (status, err) = first.finish();
    assert!(status.success(), "{err}");
    assert!(out.join("model.safetensors.index.json").is_file());
    assert!(!lock.exists(), "the lock goes with its holder");
}

#[test]
fn a_second_run_or_a_resume_on_a_locked_output_dir_refuses_and_names_the_holder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let first = Blocked::spawn(train(&out, &[]));
    let pid = first.child.id();
    let lock = held_by(&out, pid, "lora-train train");
    for extra in [&[][..], &["train.resume=true"], &["lora.rank=4"]] {
        let o = train(&out, extra).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{extra:?}");
        assert_eq!(
            String::from_utf8_lossy(&o.stderr),
            refusal("output.dir", &out, pid, "lora-train train", &lock),
            "{extra:?}"
        );
    }
    // The refused runs wrote nothing: the first one, held while loading, has not either.
    assert!(!out.exists());
    let (status, err) = first.finish();
    assert!(status.success(), "{err}");
    assert!(out.join("adapter_model.safetensors").is_file());
    assert!(out.join("checkpoint-2/trainer_state.json").is_file());
    assert!(!lock.exists());
}

#[test]
fn a_lock_left_by_a_dead_process_is_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut dead = Command::new("true").spawn().unwrap();
    let pid = dead.id();
    dead.wait().unwrap();
    let lock = lock_of(&out);
    std::fs::write(&lock, format!("{pid} lora-train train\n")).unwrap();
    let o = train(&out, &[]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.join("adapter_model.safetensors").is_file());
    assert!(!lock.exists());
}

#[test]
fn a_download_waits_for_another_fetching_the_same_repository() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    let hub = Server::start(Liar {
        lie: Arc::new(|_: &Req, _, _| None),
        token: None,
    });
    let repo_lock = hf.join("hub/.locks/models--tiny--m/lora-train.lock");
    let held = DirLock::wait(&repo_lock, Path::new("tiny/m"), "lora-train test").unwrap();
    let mut child = crate::loopback::hub_std_command(&hf, &hub.endpoint())
        .args(["download", REPO])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let err = child.stderr.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(err));
    let first = lines.next().unwrap().unwrap();
    assert!(
        first.starts_with(&format!(
            "waiting for pid {} (lora-train test) to finish with {}",
            std::process::id(),
            hf.join("hub/models--tiny--m").display()
        )),
        "{first}"
    );
    assert!(hub.requests().is_empty(), "nothing is asked while it waits");
    drop(held);
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{rest:?}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("models--tiny--m/snapshots"));
}
