//! `train.precompute_ref` (TRL's `precompute_ref_log_probs`) through the real binary: the
//! reference's log-probabilities computed in one pass before the first step give the adapter
//! of a run that computes them in every step, bit for bit (DPO against the base and against
//! the init adapter, KTO; several epochs, shuffled, dropout; gradient accumulation, DDP and
//! FSDP CPU ranks), and the golden of scripts/reference_pref.py; they are kept in
//! `<output.dir>/reference_logps.bin`, read again on resume (nothing recomputed, the file
//! untouched) and computed again when the file is damaged or of another run.

use crate::common::*;
use crate::pref::{check_outputs, meta, metrics_rows, pref_recipe};
use crate::resume::assert_same;
use assert_cmd::Command;
use std::path::{Path, PathBuf};

const FILE: &str = "reference_logps.bin";

/// Trains `case` into `out` with the binary and `sets`; its stderr.
fn train(case: &str, out: &Path, sets: &[&str]) -> String {
    let p = out.with_extension("toml");
    std::fs::write(&p, pref_recipe(case, out)).unwrap();
    let mut cmd = Command::cargo_bin("lora-train").unwrap();
    cmd.arg("--recipe").arg(&p);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let o = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{case} {sets:?}: {stderr}");
    stderr
}

/// The line the run prints of its stored reference log-probabilities: (sequences, computed).
fn ref_line(stderr: &str) -> (usize, bool) {
    let l = stderr
        .lines()
        .find(|l| l.starts_with("reference log-probs: "))
        .unwrap_or_else(|| panic!("no reference log-probs line: {stderr}"));
    let n = l["reference log-probs: ".len()..]
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{l}"));
    (n, l.contains(" computed in "))
}

/// Every row's loss and TRL metrics (not its timings).
fn numbers(out: &Path) -> Vec<Vec<(String, u64)>> {
    metrics_rows(out)
        .iter()
        .map(|r| {
            r.as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| {
                    k.as_str() == "loss"
                        || k.as_str() == "grad_norm"
                        || k.starts_with("rewards/")
                        || k.starts_with("logps/")
                        || k.as_str() == "kl"
                })
                .map(|(k, v)| (k.clone(), v.as_f64().unwrap().to_bits()))
                .collect()
        })
        .collect()
}

/// 15 steps (2½ epochs of the fixture's rows), shuffled, with dropout: with and without the
/// precomputed reference, the same adapter and metrics bit for bit.
fn precomputed_equals_computed(case: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let sets = [
        "train.max_steps=15",
        "data.shuffle=true",
        "lora.dropout=0.1",
    ];
    let e = train(case, &a, &sets);
    assert!(!e.contains("reference log-probs") && !a.join(FILE).exists());
    let mut with = sets.to_vec();
    with.push("train.precompute_ref=true");
    let e = train(case, &b, &with);
    // 15 steps × micro_batch rows × 2 values (chosen and rejected; KTO: the example and its
    // mismatched pair)
    let mb = meta(case)["opt"]["micro_batch"].as_u64().unwrap() as usize;
    assert_eq!(ref_line(&e), (15 * mb * 2, true), "{e}");
    assert!(b.join(FILE).is_file());
    assert_same(
        &a.join("adapter_model.safetensors"),
        &b.join("adapter_model.safetensors"),
    );
    let (na, nb) = (numbers(&a), numbers(&b));
    assert_eq!(na.len(), 15);
    assert!(na[0].len() >= 5, "{:?}", na[0]);
    assert_eq!(na, nb);
}

#[test]
fn dpo_with_a_precomputed_reference_is_bit_identical_to_computing_it_each_step() {
    precomputed_equals_computed("dpo_sigmoid");
}

#[test]
fn dpo_against_the_init_adapter_precomputed_is_bit_identical() {
    precomputed_equals_computed("dpo_ref_init");
}

#[test]
fn kto_with_a_precomputed_reference_and_kl_pairs_is_bit_identical() {
    precomputed_equals_computed("kto");
}

/// The fixture's run (6 steps, held-out keys) with precompute_ref lands on TRL's golden.
#[test]
fn precomputed_dpo_and_kto_match_the_golden() {
    for case in ["dpo_sigmoid", "kto"] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let e = train(case, &out, &["train.precompute_ref=true"]);
        assert!(ref_line(&e).1, "{e}");
        check_outputs(case, &out, None);
    }
}

/// Resume reads the stored values (the line says 0 computed; the file keeps its bytes and
/// mtime) and ends byte-identical to a run that never stopped; a damaged file, or one of
/// another run, is computed again, saying why.
#[test]
fn a_resumed_precomputed_dpo_run_reads_its_values_and_ends_bit_identical() {
    use crate::resume::{spawn, wait_for_line};
    let case = "dpo_ref_init";
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let args = |out: &Path, extra: &[&str]| -> Vec<String> {
        let p = out.with_extension("toml");
        std::fs::write(&p, pref_recipe(case, out)).unwrap();
        let mut v = vec!["--recipe".to_string(), p.display().to_string()];
        let sets = [
            "train.max_steps=300",
            "train.micro_batch=1",
            "lora.dropout=0.1",
            "data.shuffle=true",
            "output.save_every=1000",
            "train.precompute_ref=true",
        ];
        for s in sets.iter().chain(extra) {
            v.push("--set".into());
            v.push(s.to_string());
        }
        v
    };
    let (mut child, rx) = spawn(&args(&b, &[]), &[]);
    let mut text = wait_for_line(&rx, "step 1/300");
    send_signal(child.id(), libc::SIGINT);
    let status = child.wait().unwrap();
    text.extend(rx.iter());
    let text = text.join("\n");
    assert_eq!(status.code(), Some(130), "{text}");
    assert_eq!(ref_line(&text), (600, true), "{text}");
    let file = b.join(FILE);
    let (bytes, mtime) = (
        std::fs::read(&file).unwrap(),
        std::fs::metadata(&file).unwrap().modified().unwrap(),
    );
    std::thread::sleep(std::time::Duration::from_millis(20));
    let run = |args: Vec<String>| -> String {
        let o = Command::cargo_bin("lora-train")
            .unwrap()
            .args(args)
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{e}");
        e
    };
    let e = run(args(&b, &["train.resume=true"]));
    assert!(e.contains("resuming from"), "{e}");
    assert_eq!(ref_line(&e), (600, false), "{e}");
    assert!(e.contains("(0 computed)"), "{e}");
    assert_eq!(std::fs::read(&file).unwrap(), bytes);
    assert_eq!(std::fs::metadata(&file).unwrap().modified().unwrap(), mtime);
    run(args(&a, &[]));
    for f in [
        "adapter_model.safetensors",
        "checkpoint-300/optimizer.safetensors",
        "checkpoint-300/adapter_model.safetensors",
        "checkpoint-300/trainer_state.json",
        FILE,
    ] {
        assert_same(&a.join(f), &b.join(f));
    }
    assert_eq!(numbers(&a), numbers(&b));
    assert_eq!(numbers(&a).len(), 300);
}

/// A stored file cut short, flipped, or written by a run with another data.max_prompt_len is
/// not trusted: computed again (naming why), with the same adapter as before.
#[test]
fn a_damaged_or_foreign_stored_reference_is_computed_again() {
    let case = "dpo_sigmoid";
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let base = ["train.precompute_ref=true", "output.overwrite=true"];
    let e = train(case, &out, &base);
    assert_eq!(ref_line(&e), (24, true), "{e}");
    let adapter = std::fs::read(out.join("adapter_model.safetensors")).unwrap();
    let file = out.join(FILE);
    let good = std::fs::read(&file).unwrap();
    let again = |why: &str, sets: &[&str]| {
        let mut all = base.to_vec();
        all.extend_from_slice(sets);
        let e = train(case, &out, &all);
        assert_eq!(ref_line(&e), (24, true), "{e}");
        assert!(e.contains(why), "{why}: {e}");
        assert_eq!(
            std::fs::read(out.join("adapter_model.safetensors")).unwrap(),
            adapter
        );
    };
    // the same run again: read, nothing computed
    let e = train(case, &out, &base);
    assert_eq!(ref_line(&e), (24, false), "{e}");
    std::fs::write(&file, &good[..good.len() - 7]).unwrap();
    again("truncated", &[]);
    let mut flipped = good.clone();
    let n = flipped.len();
    flipped[n - 40] ^= 0x01; // a value's bits
    std::fs::write(&file, &flipped).unwrap();
    again("checksum", &[]);
    assert_eq!(std::fs::read(&file).unwrap(), good);
    // another run's file (longer prompts kept) is named by the field that differs
    train(case, &out, &[base[0], base[1], "data.max_prompt_len=3"]);
    again("another recipe.data.max_prompt_len", &[]);
}

/// Gradient accumulation and DDP / FSDP CPU ranks with the precomputed reference: each equals
/// its computed twin bit for bit, and two ranks equal one rank accumulating two halves.
#[test]
fn precomputed_reference_on_ddp_fsdp_and_accumulation_agrees_with_one_rank() {
    let run = |case: &str, sets: &[&str], par: &str| -> (PathBuf, tempfile::TempDir) {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let text = format!("{}\n{par}", pref_recipe(case, &out));
        let p = tmp.path().join("r.toml");
        std::fs::write(&p, text).unwrap();
        let mut cmd = Command::cargo_bin("lora-train").unwrap();
        cmd.arg("--recipe").arg(&p);
        for s in ["train.max_steps=3"].iter().chain(sets) {
            cmd.args(["--set", s]);
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (out.join("adapter_model.safetensors"), tmp)
    };
    for (case, strategy) in [
        ("dpo_sigmoid", "ddp"),
        ("dpo_sigmoid", "fsdp"),
        ("kto", "ddp"),
    ] {
        let mb = meta(case)["opt"]["micro_batch"].as_u64().unwrap() as usize;
        let half = format!("train.micro_batch={}", mb / 2);
        let pre = "train.precompute_ref=true";
        let par =
            format!("[parallel]\nstrategy = \"{strategy}\"\ndevices = [0, 1]\ntimeout_s = 60\n");
        let two = run(case, &[&half, pre], &par);
        assert_same(&two.0, &run(case, &[&half], &par).0);
        let accum = run(case, &[&half, "train.grad_accum=2", pre], "");
        assert_same(&accum.0, &run(case, &[&half, "train.grad_accum=2"], "").0);
        if case == "kto" {
            continue; // KTO's mismatched pairs are drawn within a micro-batch: other rows
        }
        let (two, accum) = (load_st(&two.0), load_st(&accum.0));
        assert!(accum.len() >= 4);
        for (k, t) in &accum {
            assert_close(&format!("{case} {strategy} {k}"), &two[k], t, 1e-5, 1e-5);
        }
    }
}

/// orpo, simpo and sft have no reference to precompute: the recipe is refused, naming the
/// field and the fix (exit 2, nothing written).
#[test]
fn precompute_ref_without_a_reference_is_a_recipe_error() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, obj) in [("orpo", "orpo"), ("simpo", "simpo"), ("dpo_sigmoid", "sft")] {
        let out = tmp.path().join(case);
        let p = out.with_extension("toml");
        std::fs::write(&p, pref_recipe(case, &out)).unwrap();
        let mut cmd = Command::cargo_bin("lora-train").unwrap();
        cmd.arg("--recipe").arg(&p);
        cmd.args(["--set", "train.precompute_ref=true"]);
        if obj == "sft" {
            cmd.args([
                "--set",
                "train.objective=sft",
                "--set",
                "data.format=tokens",
            ]);
        }
        let o = cmd.output().unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{obj}: {e}");
        assert!(
            e.contains("train.precompute_ref")
                && e.contains(&format!("\"{obj}\" has no reference model"))
                && e.contains("remove train.precompute_ref"),
            "{obj}: {e}"
        );
        assert!(!out.exists(), "{obj}");
    }
}

/// `plan` of a DPO recipe with precompute_ref: the same counts (no reference forward is
/// counted in a step either way), and a line giving the pass and the stored values' bytes.
#[test]
fn plan_of_a_precomputed_reference_counts_no_step_transient_and_its_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let p = tmp.path().join("r.toml");
    std::fs::write(&p, pref_recipe("dpo_sigmoid", &out)).unwrap();
    let plan = |sets: &[&str]| -> String {
        let mut cmd = Command::cargo_bin("lora-train").unwrap();
        cmd.args(["plan", "--gpu-mem", "24GiB", "--recipe"]).arg(&p);
        for s in sets {
            cmd.args(["--set", s]);
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let (off, on) = (plan(&[]), plan(&["train.precompute_ref=true"]));
    // 6 steps × 2 pairs × 8 B = 96 B
    let line = on
        .lines()
        .find(|l| l.starts_with("train.precompute_ref:"))
        .unwrap_or_else(|| panic!("{on}"));
    assert!(
        line.contains("none in the steps")
            && line.ends_with("= 96 B on the host and in reference_logps.bin"),
        "{line}"
    );
    let counts = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| !l.starts_with("train.precompute_ref:"))
            .map(String::from)
            .collect()
    };
    assert_eq!(counts(&off), counts(&on));
}

/// The steps read the stored values, not a forward of their own: a file whose chosen values
/// are moved by δ (re-checksummed, the key kept) is read (0 computed), and step 1's
/// `rewards/chosen` = β (policy − reference) moves by −β δ while `rewards/rejected` stays.
#[test]
fn the_steps_score_against_the_stored_values() {
    let case = "dpo_sigmoid";
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let sets = ["train.precompute_ref=true", "output.overwrite=true"];
    train(case, &out, &sets);
    let first = |out: &Path| {
        let r = &metrics_rows(out)[0];
        let f = |k: &str| r[k].as_f64().unwrap();
        (f("rewards/chosen"), f("rewards/rejected"))
    };
    let (chosen, rejected) = first(&out);
    // magic, key length, key, count, values (chosen, rejected, ...), SHA-256
    let file = out.join(FILE);
    let mut b = std::fs::read(&file).unwrap();
    let magic = b"lora-train reference log-probs 1\n".len();
    let klen = u64::from_le_bytes(b[magic..magic + 8].try_into().unwrap()) as usize;
    let at = magic + 8 + klen + 8;
    let n = (b.len() - at - 32) / 4;
    assert_eq!(n, 24);
    let delta = 2.0f32;
    for i in (0..n).step_by(2) {
        let p = at + 4 * i;
        let v = f32::from_le_bytes(b[p..p + 4].try_into().unwrap()) + delta;
        b[p..p + 4].copy_from_slice(&v.to_le_bytes());
    }
    let end = b.len() - 32;
    let sum = ring::digest::digest(&ring::digest::SHA256, &b[..end]);
    b[end..].copy_from_slice(sum.as_ref());
    std::fs::write(&file, &b).unwrap();
    let e = train(case, &out, &sets);
    assert_eq!(ref_line(&e), (24, false), "{e}");
    let (c2, r2) = first(&out);
    let beta = meta(case)["objective"]["beta"].as_f64().unwrap();
    assert!(
        (c2 - (chosen - beta * delta as f64)).abs() < 1e-5,
        "{c2} vs {chosen}"
    );
    assert!((r2 - rejected).abs() < 1e-7, "{r2} vs {rejected}");
}
