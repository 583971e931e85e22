//! `export` under signals, with the real binary. The export is held mid-write without a clock:
//! its stderr is a full pipe, so it stops at its first line, the one saying its first shard is
//! written (21 shards: --max-shard-size 1B), until the test reads. SIGINT or SIGTERM then removes
//! the unfinished `.<out>.tmp-<pid>` and exits 130, leaving no `--out` and no lock; after a
//! SIGKILL, the next export removes the temporary the dead one left (and only such: a live
//! process's, and anything not of its naming, stay).

use crate::common::{root, send_signal, wait_until, Blocked};
use std::path::{Path, PathBuf};
use std::process::Command;

const SHARDS: usize = 21;

fn export(out: &Path) -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin("lora-train"));
    c.current_dir(root())
        .args([
            "export",
            "--adapter",
            "tests/fixtures/golden/tiny_shipped/init_adapter",
            "--base",
            "recipes/assets/tiny-llama",
            "--max-shard-size",
            "1B",
            "--out",
        ])
        .arg(out);
    c
}

fn tmp_of(out: &Path, pid: u32) -> PathBuf {
    out.with_file_name(format!(".out.tmp-{pid}"))
}

fn first_shard(dir: &Path) -> PathBuf {
    dir.join(format!("model-00001-of-{SHARDS:05}.safetensors"))
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_signal_mid_export_removes_its_temporary_and_exits_130() {
    for (sig, name) in [(libc::SIGINT, "SIGINT"), (libc::SIGTERM, "SIGTERM")] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let b = Blocked::spawn(export(&out));
        let pid = b.child.id();
        let partial = tmp_of(&out, pid);
        wait_until("the first shard", || first_shard(&partial).is_file());
        assert!(
            !partial.join("config.json").exists(),
            "the export is mid-write"
        );
        send_signal(pid, sig);
        // The temporary goes first, while the export still waits on its stderr.
        wait_until("the temporary to go", || !partial.exists());
        let (status, err) = b.finish();
        assert_eq!(status.code(), Some(130), "{name}: {err}");
        assert!(
            err.contains(&format!(
                "{name}: stopped; removed the unfinished {}",
                partial.display()
            )),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        // Nothing is left beside --out: no output, no temporary, no lock.
        assert_eq!(names(tmp.path()), Vec::<String>::new(), "{name}");
    }
}

#[test]
fn the_next_export_removes_what_a_killed_one_left_and_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let b = Blocked::spawn(export(&out));
    let pid = b.child.id();
    let partial = tmp_of(&out, pid);
    wait_until("the first shard", || first_shard(&partial).is_file());
    send_signal(pid, libc::SIGKILL);
    let (status, _) = b.finish();
    assert_eq!(status.code(), None, "killed");
    assert!(
        first_shard(&partial).is_file(),
        "SIGKILL leaves the temporary"
    );
    // Beside it: a temporary of a live process (this test's), an empty and a non-empty
    // `.old` of dead ones, and a directory of another naming.
    let me = tmp_of(&out, std::process::id());
    let old_empty = tmp.path().join(format!(".out.old-{pid}"));
    let old_full = tmp.path().join(".out.old-999999999");
    let other = tmp.path().join(".outer.tmp-999999999");
    for d in [&me, &old_empty, &old_full, &other] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(old_full.join("kept"), "x").unwrap();

    let o = export(&out).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    for gone in [&partial, &old_empty] {
        assert!(
            err.contains(&format!(
                "removed {}, left by an export that did not finish",
                gone.display()
            )),
            "{err}"
        );
        assert!(!gone.exists());
    }
    for kept in [&me, &old_full, &other] {
        assert!(kept.exists(), "{}", kept.display());
    }
    assert_eq!(names(&out).len(), SHARDS + 5, "{:?}", names(&out));
    assert!(
        err.contains(&format!(
            "wrote model-{SHARDS:05}-of-{SHARDS:05}.safetensors ({SHARDS} of {SHARDS}"
        )),
        "{err}"
    );
}
