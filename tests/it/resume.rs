//! Checkpoints, exact resume and safe interruption: a run stopped at step k and resumed ends
//! bit-identical to one that never stopped (adapter, optimiser state, trainer state); SIGINT
//! saves a checkpoint and says how to resume; a second signal or a SIGKILL in the middle of a
//! save leaves the previous checkpoint loadable; NaN / Inf stops or skips.

use crate::common::Session;
use crate::common::*;
use assert_cmd::Command;
use lora_train::recipe::{Recipe, RecipeError};
use lora_train::run::checkpoint;
use lora_train::train::stop::Interrupted;
use lora_train::train::train_data::Cursor;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The shipped tiny model on the tiny_shipped golden rows (8 rows: 4 steps per epoch of
/// 1 row × 2 micro-batches), shuffled, with dropout, 11 steps = 2¾ epochs.
const SETS: [&str; 6] = [
    "train.max_steps=11",
    "train.micro_batch=1",
    "train.grad_accum=2",
    "lora.dropout=0.1",
    "data.shuffle=true",
    "output.save_every=4",
];

fn tiny(dir: &Path, out: &Path, extra: &[&str]) -> Recipe {
    std::fs::create_dir_all(dir).unwrap();
    let sets: Vec<&str> = SETS.iter().chain(extra).copied().collect();
    recipe(dir, &golden_recipe("tiny_shipped", out), &sets)
}

fn bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Two files with the same bytes (the message names the first difference, not the bytes).
pub(crate) fn assert_same(a: &Path, b: &Path) {
    let (x, y) = (bytes(a), bytes(b));
    if x != y {
        let at = x
            .iter()
            .zip(&y)
            .position(|(p, q)| p != q)
            .unwrap_or(x.len().min(y.len()));
        panic!(
            "{} and {} differ at byte {at} of {}/{}",
            a.display(),
            b.display(),
            x.len(),
            y.len()
        );
    }
}

fn interrupted(e: anyhow::Error) -> (usize, PathBuf) {
    let i = e
        .downcast_ref::<Interrupted>()
        .unwrap_or_else(|| panic!("expected Interrupted, got {e:#}"));
    (i.step, i.checkpoint.clone())
}

#[test]
fn a_run_stopped_twice_and_resumed_is_bit_identical_to_one_that_never_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));

    let whole = Session::new(tiny(&tmp.path().join("ra"), &a, &[])).unwrap();
    let sa = whole.train(&a).unwrap();
    assert_eq!(sa.steps, 11);

    // Stop after step 4 (an epoch boundary, where save_every already saved) ...
    let s = Session::new(tiny(&tmp.path().join("rb"), &b, &[])).unwrap();
    let (step, dir) = interrupted(s.train_from(&b, None, &|s| s == 4).unwrap_err());
    assert_eq!((step, dir.clone()), (4, b.join("checkpoint-4")));
    assert!(!b.join("adapter_model.safetensors").exists());
    let st = checkpoint::read_state(&dir).unwrap();
    assert_eq!(
        st.cursor,
        Cursor {
            epoch: 0,
            step_in_epoch: 4
        }
    );
    assert_eq!((st.step, st.total_steps, st.optimizer_steps), (4, 11, 4));

    // ... resume and stop again after step 6 (mid-epoch: a checkpoint of its own) ...
    let r = tiny(&tmp.path().join("rb"), &b, &["train.resume=true"]);
    let ck = checkpoint::resume_point(&r, &b).unwrap().unwrap();
    assert_eq!(ck.dir, b.join("checkpoint-4"));
    let s = Session::new(r).unwrap();
    let (step, dir) = interrupted(s.train_from(&b, Some(&ck), &|s| s == 6).unwrap_err());
    assert_eq!((step, dir.clone()), (6, b.join("checkpoint-6")));
    assert_eq!(
        checkpoint::read_state(&dir).unwrap().cursor,
        Cursor {
            epoch: 1,
            step_in_epoch: 2
        }
    );

    // ... and resume to the end (the newest checkpoint is picked).
    let s = Session::new(tiny(&tmp.path().join("rb"), &b, &["train.resume=true"])).unwrap();
    let sb = s.train(&b).unwrap();
    assert_eq!(sb.steps, 11);
    assert_eq!(sb.losses, sa.losses[6..], "losses of steps 7-11");

    assert_same(
        &a.join("adapter_model.safetensors"),
        &b.join("adapter_model.safetensors"),
    );
    for step in [8, 11] {
        for f in [
            "adapter_model.safetensors",
            "optimizer.safetensors",
            "trainer_state.json",
        ] {
            let p = format!("checkpoint-{step}/{f}");
            assert_same(&a.join(&p), &b.join(&p));
        }
    }
    // The optimiser file holds m and v for every adapter tensor, and the update count.
    let opt = load_st(&a.join("checkpoint-11/optimizer.safetensors"));
    assert_eq!(opt.len(), 2 * 2 * 7 * 2);
    let st = checkpoint::read_state(&a.join("checkpoint-11")).unwrap();
    assert_eq!((st.optimizer_steps, st.skipped_steps), (11, 0));
    assert_eq!(st.loss_history.len(), 11);
    // metrics.jsonl: one row per step, steps 1..=11 once each, the same losses.
    let rows = |d: &Path| -> Vec<(u64, f64)> {
        std::fs::read_to_string(d.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
            })
            .collect()
    };
    assert_eq!(rows(&a), rows(&b));
    assert_eq!(rows(&a).len(), 11);
}

#[test]
fn resume_refuses_a_different_recipe_or_data_and_a_fresh_start_over_an_unfinished_run() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let data = tmp.path().join("train.jsonl");
    std::fs::copy(golden_dir("tiny_shipped").join("train.jsonl"), &data).unwrap();
    let data_set = format!("data.train={}", data.display());
    let rdir = tmp.path().join("r");
    let s = Session::new(tiny(&rdir, &out, &[&data_set])).unwrap();
    interrupted(s.train_from(&out, None, &|s| s == 2).unwrap_err());

    let err = |sets: &[&str]| -> String {
        let mut all = vec![data_set.as_str()];
        all.extend(sets);
        let r = tiny(&rdir, &out, &all);
        let e = checkpoint::resume_point(&r, &out).unwrap_err();
        assert!(e.downcast_ref::<RecipeError>().is_some(), "{e:#}");
        e.to_string()
    };
    let ck = out.join("checkpoint-2");
    let e = err(&["train.resume=true", "train.lr=0.5"]);
    assert!(
        e.ends_with(&format!(
            "`train.lr` = 0.5, but checkpoint {} was trained with 0.02: train.resume continues a run \
             exactly, so everything that changes the numbers must match; set it back, or start a new \
             run from the checkpoint's adapter with lora.init_adapter = \"{}\"",
            ck.display(),
            ck.display()
        )),
        "{e}"
    );
    let e = err(&["train.resume=true", "lora.dropout=0.2", "train.seed=1"]);
    assert!(e.contains("`lora.dropout` = 0.2, but checkpoint"), "{e}");
    assert!(e.ends_with("(also different: train.seed)"), "{e}");
    // Masks drawn by another generator (an older build's) cannot continue exactly.
    let state = ck.join(checkpoint::STATE);
    let kept = bytes(&state);
    let mut js: serde_json::Value = serde_json::from_slice(&kept).unwrap();
    assert_eq!(js["rng"], checkpoint::RNG);
    js["rng"] = "SplitMix64 streams keyed by seed".into();
    std::fs::write(&state, serde_json::to_vec(&js).unwrap()).unwrap();
    let e = err(&["train.resume=true"]);
    assert!(
        e.contains("`lora.dropout` = 0.1, but checkpoint")
            && e.contains("drew its dropout masks as \"SplitMix64 streams keyed by seed\""),
        "{e}"
    );
    std::fs::write(&state, kept).unwrap();
    let e = err(&[]);
    assert!(
        e.ends_with(&format!(
            "`train.resume` = false, but {} holds an unfinished run ({} is at step 2 of 11): continue \
             it with --set train.resume=true, or remove that directory (or set output.dir) to start over",
            out.display(),
            ck.display()
        )),
        "{e}"
    );
    // Settings that do not change the numbers may differ.
    let r = tiny(
        &rdir,
        &out,
        &[
            &data_set,
            "train.resume=true",
            "train.log_every=5",
            "output.save_every=3",
            "output.keep_last=1",
        ],
    );
    assert!(checkpoint::resume_point(&r, &out).unwrap().is_some());

    // The same file with other contents: refused once the data is read, before any write.
    let text = std::fs::read_to_string(&data).unwrap();
    let fewer: Vec<&str> = text.lines().take(7).collect();
    std::fs::write(&data, fewer.join("\n") + "\n").unwrap();
    let ck = checkpoint::resume_point(&r, &out).unwrap().unwrap();
    let before = bytes(&out.join("metrics.jsonl"));
    let s = Session::new(r).unwrap();
    let e = s.train_from(&out, Some(&ck), &|_| false).unwrap_err();
    assert!(e.downcast_ref::<RecipeError>().is_some(), "{e:#}");
    assert!(
        e.to_string().contains(&format!(
            "`data.train` {} changed since checkpoint {} was saved (8 examples",
            data.display(),
            ck.dir.display()
        )),
        "{e}"
    );
    assert!(bytes(&out.join("metrics.jsonl")) == before);
}

fn bin() -> Command {
    Command::cargo_bin("lora-train").unwrap()
}

/// The tiny CPU recipe, one row per step: ~10 ms a step.
fn tiny_cli_args(out: &Path, steps: usize, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = vec!["--recipe".into(), "recipes/tiny-cpu.toml".into()];
    let sets = [
        format!("output.dir={}", out.display()),
        format!("train.max_steps={steps}"),
        "train.micro_batch=1".into(),
        "train.grad_accum=1".into(),
        "train.log_every=1".into(),
    ];
    for s in sets.iter().map(String::as_str).chain(extra.iter().copied()) {
        v.push("--set".into());
        v.push(s.into());
    }
    v
}

/// Starts the binary with stderr read line by line on a channel.
pub(crate) fn spawn(args: &[String], env: &[(&str, &str)]) -> (Child, mpsc::Receiver<String>) {
    let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("lora-train"));
    cmd.current_dir(root())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let err = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines() {
            if tx.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Lines until one contains `what` (that one included).
pub(crate) fn wait_for_line(rx: &mpsc::Receiver<String>, what: &str) -> Vec<String> {
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
            let hit = l.contains(what);
            seen.push(l);
            if hit {
                return seen;
            }
        }
    }
    panic!("no line with {what:?} in {seen:#?}");
}

fn signal(child: &Child, sig: i32) {
    send_signal(child.id(), sig);
}

/// A temporary checkpoint directory (a save in progress), if any.
fn saving(out: &Path) -> Option<String> {
    std::fs::read_dir(out).ok()?.flatten().find_map(|e| {
        let n = e.file_name().to_string_lossy().into_owned();
        (n.starts_with(".checkpoint-") && n.contains(".tmp-")).then_some(n)
    })
}

#[test]
fn sigint_finishes_the_step_saves_a_checkpoint_and_resume_ends_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    // save_every larger than the run: no periodic checkpoint, only the final one.
    let extra = ["output.save_every=1000"];

    let (mut child, rx) = spawn(&tiny_cli_args(&b, 300, &extra), &[]);
    wait_for_line(&rx, "step 1/300");
    signal(&child, libc::SIGINT);
    let status = child.wait().unwrap();
    let lines: Vec<String> = rx.iter().collect();
    let text = lines.join("\n");
    assert_eq!(status.code(), Some(130), "{text}");
    assert!(
        text.contains(
            "SIGINT: finishing this step, then saving a checkpoint (send it again to quit at once)"
        ),
        "{text}"
    );
    let i = lines
        .iter()
        .position(|l| l.starts_with("interrupted after step "))
        .unwrap_or_else(|| panic!("{text}"));
    let k: usize = lines[i]["interrupted after step ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..300).contains(&k), "{text}");
    let ck = b.join(format!("checkpoint-{k}"));
    assert_eq!(
        lines[i],
        format!(
            "interrupted after step {k} of 300; checkpoint saved to {}",
            ck.display()
        )
    );
    // The printed command: this binary, the recipe, and only the overrides the checkpoint
    // does not keep (it keeps those that change the numbers: max_steps, micro_batch, ...).
    let resume: Vec<String> = [
        "--recipe",
        "recipes/tiny-cpu.toml",
        "--set",
        &format!("output.dir={}", b.display()),
        "--set",
        "train.log_every=1",
        "--set",
        "output.save_every=1000",
        "--set",
        "train.resume=true",
    ]
    .map(String::from)
    .to_vec();
    let program = assert_cmd::cargo::cargo_bin("lora-train");
    assert_eq!(
        lines[i + 1],
        format!("resume with: {} {}", program.display(), resume.join(" "))
    );
    let st = checkpoint::read_state(&ck).unwrap();
    assert_eq!((st.step, st.optimizer_steps), (k, k));
    assert!(!b.join("adapter_model.safetensors").exists());

    // The printed command continues the run to the end ...
    let o = bin().current_dir(root()).args(&resume).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.starts_with(&format!(
            "resuming with the overrides of {}: --set train.max_steps=300 --set train.micro_batch=1 --set train.grad_accum=1\nresuming from {} (step {k} of 300)\n",
            ck.display(),
            ck.display()
        )),
        "{err}"
    );
    // ... exactly where a run that was never interrupted ends.
    let o = bin()
        .current_dir(root())
        .args(tiny_cli_args(&a, 300, &extra))
        .output()
        .unwrap();
    assert!(o.status.success());
    for f in [
        "adapter_model.safetensors",
        "checkpoint-300/optimizer.safetensors",
        "checkpoint-300/adapter_model.safetensors",
        "checkpoint-300/trainer_state.json",
    ] {
        assert_same(&a.join(f), &b.join(f));
    }
}

/// A run of `steps` slow steps (20 micro-batches each, ~0.2 s), saving every 5 (and at the end).
fn slow_args(out: &Path, steps: usize) -> Vec<String> {
    tiny_cli_args(out, steps, &["output.save_every=5", "train.grad_accum=20"])
}

/// Whether process `pid` has no signal pending (a signal sent to it has been taken by a
/// handler, or acted on), from /proc: its shared and every thread's pending sets.
fn no_signal_pending(pid: u32) -> bool {
    let pending = |status: &str, key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .is_some_and(|v| v.trim().chars().any(|c| c != '0'))
    };
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return true;
    };
    if pending(&status, "ShdPnd:") {
        return false;
    }
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|rd| {
            rd.flatten().all(|t| {
                std::fs::read_to_string(t.path().join("status"))
                    .map_or(true, |s| !pending(&s, "SigPnd:"))
            })
        })
        .unwrap_or(true)
}

/// The second signal ends the run at once: no clock. The run is held at its next line to
/// stderr (a full pipe), i.e. at the end of the step it is in, before any save; the first
/// SIGTERM is taken (its announcement waits on that pipe too), then the second ends the
/// process while the run is still held there: exit 131, and no checkpoint after the signals.
#[test]
fn a_second_signal_exits_at_once_and_leaves_the_last_checkpoint_intact() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let args = slow_args(&out, 10);
    let (r, w) = crate::common::pipe();
    let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("lora-train"));
    cmd.current_dir(root())
        .args(&args)
        .stdout(Stdio::null())
        .stderr(w.try_clone().unwrap());
    let mut child = cmd.spawn().unwrap();
    drop(cmd);
    let mut lines = std::io::BufReader::new(r).lines();
    while !lines.next().unwrap().unwrap().starts_with("step 6/10") {}
    let ck5 = out.join("checkpoint-5");
    wait_until("checkpoint-5", || ck5.join("trainer_state.json").is_file());
    let before = bytes(&ck5.join("optimizer.safetensors"));
    fill_pipe(&w);
    drop(w);
    send_signal(child.id(), libc::SIGTERM);
    wait_until("the first signal to be taken", || {
        no_signal_pending(child.id())
    });
    send_signal(child.id(), libc::SIGTERM);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(131));
    let rest: Vec<String> = lines
        .map_while(Result::ok)
        .filter(|l| !l.is_empty())
        .collect();
    assert!(
        !rest.iter().any(|l| l.starts_with("interrupted after")),
        "{rest:?}"
    );
    // No save after the signals became a checkpoint; checkpoint-5 is as it was. One race is
    // the first signal's own: taken between step 6's line and step 6's stop check (a loaded
    // machine can stall the run right there), it saves checkpoint-6 before any line blocks,
    // and that save may finish before the second signal lands. A whole checkpoint-6 is then
    // the first signal's due; a partial one never is.
    let steps: Vec<usize> = checkpoint::list(&out).iter().map(|c| c.0).collect();
    assert!(steps == vec![5] || steps == vec![5, 6], "{steps:?}");
    if steps.len() == 2 {
        assert!(out.join("checkpoint-6/trainer_state.json").is_file());
    }
    assert!(bytes(&ck5.join("optimizer.safetensors")) == before);
    // A resume must keep the recipe (max_steps differs here) ...
    let mut resume = tiny_cli_args(&out, 8, &["output.save_every=5", "train.grad_accum=20"]);
    resume.extend(["--set".into(), "train.resume=true".into()]);
    let o = bin().current_dir(root()).args(&resume).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "max_steps differs: {err}");
    assert!(
        err.contains("`train.max_steps` = 8, but checkpoint"),
        "{err}"
    );
    // ... and then continues from the last checkpoint.
    let resume: Vec<String> = args
        .iter()
        .cloned()
        .chain(["--set".into(), "train.resume=true".into()])
        .collect();
    let o = bin().current_dir(root()).args(&resume).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("resuming from"), "{err}");
    assert!(saving(&out).is_none());
    assert!(out.join("checkpoint-10/trainer_state.json").is_file());
}

/// Sets a resource limit of process `pid` (soft and hard).
fn set_limit(pid: u32, resource: libc::__rlimit_resource_t, value: u64) {
    let lim = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: prlimit on a child of ours with a valid limit and no old-limit output.
    let rc = unsafe { libc::prlimit(pid as i32, resource, &lim, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
}

/// A kill in the middle of a real checkpoint write. Once checkpoint-5 is complete, the run's
/// file-size limit is set just under an optimizer.safetensors: the kernel kills it (SIGXFSZ,
/// no handler: as abrupt as SIGKILL, and unlike a SIGKILL from here, certain to land inside
/// the write) as the next checkpoint's optimizer state is written, its adapter written, its
/// trainer state not. What it leaves stays hidden; checkpoint-5 is
/// byte for byte as it was and loads; a resume continues from it and clears the leftover.
#[test]
fn a_kill_in_the_middle_of_a_checkpoint_write_leaves_the_previous_checkpoint_loadable() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let args = slow_args(&out, 20);
    let (mut child, rx) = spawn(&args, &[]);
    wait_for_line(&rx, "step 6/20");
    let ck5 = out.join("checkpoint-5");
    wait_until("checkpoint-5", || ck5.join("trainer_state.json").is_file());
    let files = [
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ];
    let saved: Vec<Vec<u8>> = files.iter().map(|f| bytes(&ck5.join(f))).collect();
    let limit = saved[1].len() as u64 - 1000;
    assert!(
        limit > saved[0].len() as u64,
        "the adapter fits under the limit"
    );
    set_limit(child.id(), libc::RLIMIT_CORE, 0);
    set_limit(child.id(), libc::RLIMIT_FSIZE, limit);
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGXFSZ), "{status:?}");
    // The save it died in: adapter complete, optimizer cut at the limit, no trainer state.
    let partial = saving(&out).expect("the unfinished save");
    let partial = out.join(partial);
    assert!(partial
        .to_string_lossy()
        .ends_with(&format!(".tmp-{}", child.id())));
    assert_eq!(
        bytes(&partial.join("adapter_model.safetensors")).len(),
        saved[0].len()
    );
    // The optimizer state was being written: safetensors' temporary for it is there (sized past
    // the limit before its first byte), optimizer.safetensors is not.
    let mut names: Vec<String> = std::fs::read_dir(&partial)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names.len(), 3, "{names:?}");
    assert!(names[0].starts_with(".tmp"), "{names:?}");
    assert_eq!(
        names[1..],
        ["adapter_config.json", "adapter_model.safetensors"]
    );
    assert!(!partial.join("trainer_state.json").exists());
    let steps: Vec<usize> = checkpoint::list(&out).iter().map(|c| c.0).collect();
    assert_eq!(steps, vec![5]);
    for (f, b) in files.iter().zip(&saved) {
        assert!(bytes(&ck5.join(f)) == *b, "{f} changed");
    }

    // checkpoint-5 loads: state, adapter and optimiser into a fresh session.
    let r = Recipe::load(
        &root().join("recipes/tiny-cpu.toml"),
        &args
            .iter()
            .skip(2)
            .filter(|a| *a != "--set")
            .cloned()
            .chain([format!("train.resume={}", ck5.display())])
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let ck = checkpoint::resume_point(&r, &out).unwrap().unwrap();
    assert_eq!(ck.state.step, 5);
    let s = Session::new(r).unwrap();
    let mut opt = lora_train::train::optim::AdamW::new(
        s.model
            .adapters()
            .flat_map(|(_, l)| [l.a.clone(), l.b.clone()])
            .collect(),
        [0.9, 0.999],
        1e-8,
        0.0,
    )
    .unwrap();
    let keys: Vec<String> = s
        .model
        .adapters()
        .flat_map(|(m, _)| ['A', 'B'].map(|w| lora_train::export::peft_key(m, w)))
        .collect();
    checkpoint::restore(&ck, &s, &mut opt, &keys).unwrap();
    assert_eq!(opt.t, 5);
    let st = load_st(&ck5.join("adapter_model.safetensors"));
    let (module, lora) = s.model.adapters().next().unwrap();
    assert_close(
        "restored lora_B",
        lora.b.as_tensor(),
        &st[&lora_train::export::peft_key(module, 'B')],
        0.0,
        0.0,
    );
    // The run continues from checkpoint-5 to its end; the leftover is gone.
    let resume: Vec<String> = args
        .iter()
        .cloned()
        .chain(["--set".into(), "train.resume=true".into()])
        .collect();
    let o = bin().current_dir(root()).args(&resume).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!("resuming from {} (step 5 of 20)", ck5.display())),
        "{err}"
    );
    assert!(saving(&out).is_none());
    assert!(out.join("checkpoint-20/trainer_state.json").is_file());
}

#[test]
fn nonfinite_loss_stops_with_the_step_and_checkpoint_or_is_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    // lr 1e30: step 1 is finite and throws the adapters to ~1e30; step 2 overflows.
    let extra = [
        "train.lr=1e30",
        "train.warmup_steps=0",
        "output.save_every=1",
    ];
    let out = tmp.path().join("stop");
    let o = bin()
        .current_dir(root())
        .args(tiny_cli_args(&out, 6, &extra))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let ck = out.join("checkpoint-1");
    let want = format!(
        "error: step 2 of 6: the loss is NaN and the gradient norm NaN; stopped without applying that update
  last good checkpoint: {} (to go on with other settings, start a new run from its adapter: lora.init_adapter = \"{}\")
  hints: lower train.lr (now 1e30); or set train.skip_nonfinite = true to skip such steps
",
        ck.display(),
        ck.display()
    );
    assert!(err.ends_with(&want), "{err}");
    assert!(!out.join("adapter_model.safetensors").exists());
    assert_eq!(
        checkpoint::list(&out)
            .iter()
            .map(|c| c.0)
            .collect::<Vec<_>>(),
        vec![1]
    );

    let out = tmp.path().join("skip");
    let mut extra = extra.to_vec();
    extra.push("train.skip_nonfinite=true");
    let o = bin()
        .current_dir(root())
        .args(tiny_cli_args(&out, 6, &extra))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("skipped 5 of 6 steps with a non-finite loss or gradient"),
        "{err}"
    );
    let skipped: Vec<bool> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["skipped"] == true)
        .collect();
    assert_eq!(skipped, [false, true, true, true, true, true]);
    // No update after step 1 reached the adapter.
    assert_same(
        &out.join("adapter_model.safetensors"),
        &out.join("checkpoint-1/adapter_model.safetensors"),
    );
    let st = checkpoint::read_state(&out.join("checkpoint-6")).unwrap();
    assert_eq!((st.step, st.optimizer_steps, st.skipped_steps), (6, 1, 5));
    assert_eq!(st.loss_history[1], (2, None));
}

#[test]
fn keep_last_prunes_and_a_fresh_run_replaces_a_finished_ones_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let run = |steps: usize, extra: &[&str]| {
        let o = bin()
            .current_dir(root())
            .args(tiny_cli_args(&out, steps, extra))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        err
    };
    run(10, &["output.save_every=2", "output.keep_last=2"]);
    let steps = || -> Vec<usize> { checkpoint::list(&out).iter().map(|c| c.0).collect() };
    assert_eq!(steps(), vec![8, 10]);
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(names.is_empty(), "leftovers: {names:?}");
    // A fresh run over a finished one (--overwrite): its checkpoints go (resume = true would
    // pick them up).
    let err = run(3, &["output.save_every=0", "output.overwrite=true"]);
    assert!(
        err.contains(&format!(
            "removed checkpoint-10, checkpoint-8 of an earlier run from {}",
            out.display()
        )),
        "{err}"
    );
    assert_eq!(steps(), Vec::<usize>::new());
    // resume = true with no checkpoint starts fresh, and says so.
    let err = run(3, &["train.resume=true"]);
    assert!(
        err.starts_with(&format!(
            "train.resume = true, but {} holds no checkpoint: starting fresh\n",
            out.display()
        )),
        "{err}"
    );
}
