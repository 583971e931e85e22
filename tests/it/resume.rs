//! Checkpoints, exact resume and safe interruption: a run stopped at step k and resumed ends
//! bit-identical to one that never stopped (adapter, optimiser state, trainer state); SIGINT
//! saves a checkpoint and says how to resume; a second signal or a SIGKILL in the middle of a
//! save leaves the previous checkpoint loadable; NaN / Inf stops or skips.

use crate::common::Session;
use crate::common::*;
use assert_cmd::Command;
use lora_train::recipe::{Recipe, RecipeError};
use lora_train::train::checkpoint::{self, Cursor};
use lora_train::train::stop::Interrupted;
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
fn assert_same(a: &Path, b: &Path) {
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
fn spawn(args: &[String], env: &[(&str, &str)]) -> (Child, mpsc::Receiver<String>) {
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
fn wait_for_line(rx: &mpsc::Receiver<String>, what: &str) -> Vec<String> {
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
    // SAFETY: kill(2) on the pid of a child we spawned and have not reaped yet.
    let rc = unsafe { libc::kill(child.id() as i32, sig) };
    assert_eq!(rc, 0);
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

/// What a save cut short leaves in `out`: the temporary directory of the checkpoint of
/// `step` that process `pid` was writing, its adapter written (the save's first files, here
/// checkpoint-5's), its optimiser state and trainer state not.
fn plant_partial_save(out: &Path, step: usize, pid: u32) -> PathBuf {
    let tmp = out.join(format!(".checkpoint-{step}.tmp-{pid}"));
    std::fs::create_dir_all(&tmp).unwrap();
    for f in ["adapter_model.safetensors", "adapter_config.json"] {
        std::fs::copy(out.join("checkpoint-5").join(f), tmp.join(f)).unwrap();
    }
    tmp
}

/// A run of 10 slow steps (20 micro-batches each, ~0.2 s), saving at 5 (and at the end).
fn slow_args(out: &Path) -> Vec<String> {
    tiny_cli_args(out, 10, &["output.save_every=5", "train.grad_accum=20"])
}

#[test]
fn a_second_signal_exits_at_once_and_leaves_the_last_checkpoint_intact() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let args = slow_args(&out);
    let (mut child, rx) = spawn(&args, &[]);
    wait_for_line(&rx, "step 6/10");
    assert!(out.join("checkpoint-5/trainer_state.json").is_file());
    let before = bytes(&out.join("checkpoint-5/optimizer.safetensors"));
    // The first signal as step 7 begins: the run would finish that step, then save.
    signal(&child, libc::SIGTERM);
    wait_for_line(&rx, "SIGTERM: finishing this step");
    let t = Instant::now();
    signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(131));
    assert!(
        t.elapsed() < Duration::from_millis(400),
        "a second signal must not wait for the step or the save: {:?}",
        t.elapsed()
    );
    // No save after the signals became a checkpoint; checkpoint-5 is as it was.
    let steps: Vec<usize> = checkpoint::list(&out).iter().map(|c| c.0).collect();
    assert_eq!(steps, vec![5]);
    assert!(bytes(&out.join("checkpoint-5/optimizer.safetensors")) == before);
    // A save the second signal cut short stays hidden.
    plant_partial_save(&out, 7, child.id());
    assert!(saving(&out).is_some(), "the partial save stays hidden");
    let steps: Vec<usize> = checkpoint::list(&out).iter().map(|c| c.0).collect();
    assert_eq!(steps, vec![5]);
    // Resuming takes checkpoint-5 and clears the leftover.
    let mut resume = tiny_cli_args(&out, 8, &["output.save_every=5", "train.grad_accum=20"]);
    resume.extend(["--set".into(), "train.resume=true".into()]);
    let o = bin().current_dir(root()).args(&resume).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "max_steps differs: {err}");
    assert!(
        err.contains("`train.max_steps` = 8, but checkpoint"),
        "{err}"
    );
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

#[test]
fn sigkill_during_a_checkpoint_write_leaves_the_previous_checkpoint_loadable() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let args = slow_args(&out);
    let (mut child, rx) = spawn(&args, &[]);
    wait_for_line(&rx, "step 6/10");
    assert!(out.join("checkpoint-5").is_dir());
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // What the kill leaves had it come in the middle of writing checkpoint-10: its adapter
    // written, its optimiser not.
    plant_partial_save(&out, 10, child.id());
    assert!(!out.join("checkpoint-10").exists());
    let steps: Vec<usize> = checkpoint::list(&out).iter().map(|c| c.0).collect();
    assert_eq!(steps, vec![5]);

    // checkpoint-5 loads: state, adapter and optimiser into a fresh session.
    let r = Recipe::load(
        &root().join("recipes/tiny-cpu.toml"),
        &args
            .iter()
            .skip(2)
            .filter(|a| *a != "--set")
            .cloned()
            .chain([format!(
                "train.resume={}",
                out.join("checkpoint-5").display()
            )])
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
    let saved = load_st(&out.join("checkpoint-5/adapter_model.safetensors"));
    let (module, lora) = s.model.adapters().next().unwrap();
    assert_close(
        "restored lora_B",
        lora.b.as_tensor(),
        &saved[&lora_train::export::peft_key(module, 'B')],
        0.0,
        0.0,
    );
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
    // A fresh run over a finished one: its checkpoints go (resume = true would pick them up).
    let err = run(3, &["output.save_every=0"]);
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
