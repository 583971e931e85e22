//! Preference training (DPO sigmoid / ipo / hinge, DPO against the init adapter, ORPO, SimPO,
//! KTO) against scripts/reference_pref.py's goldens (tests/fixtures/pref/<case>: transformers +
//! PEFT with TRL 1.16's loss formulas, in f64, from an init adapter with non-zero B): 6 AdamW
//! steps in f32 on the CPU land within 2e-5 of the golden adapter; the losses and TRL's
//! metrics in metrics.jsonl match the fixture's; DDP / FSDP on CPU ranks equal one rank.

use crate::common::*;
use assert_cmd::Command;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The held-out bound: |ours - golden| on every adapter entry after 6 steps.
const ADAPTER_TOL: f32 = 2e-5;

pub(crate) fn pref_dir(case: &str) -> PathBuf {
    root().join("tests/fixtures/pref").join(case)
}

pub(crate) fn meta(case: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(pref_dir(case).join("meta.json")).unwrap())
        .unwrap()
}

/// A recipe of a pref case: the fixture's model, init adapter, rows and optimiser; the
/// objective's keys as the case sets them.
pub(crate) fn pref_recipe(case: &str, out: &Path) -> String {
    let d = pref_dir(case);
    let m = meta(case);
    let o = &m["opt"];
    let obj = &m["objective"];
    let name = obj["objective"].as_str().unwrap();
    let mut train = format!(
        "objective = \"{name}\"\npref_beta = {}\n",
        obj["beta"].as_f64().unwrap()
    );
    // sigmoid is the default: the held-out keys leave it out
    if let Some(l) = obj["loss_type"].as_str().filter(|&l| l != "sigmoid") {
        train.push_str(&format!("pref_loss = \"{l}\"\n"));
    }
    if obj["reference"].as_str() == Some("init_adapter") {
        train.push_str("pref_reference = \"init_adapter\"\n");
    }
    for (key, ours) in [
        ("gamma", "simpo_gamma"),
        ("cpo_alpha", "cpo_alpha"),
        ("desirable_weight", "kto_desirable_weight"),
        ("undesirable_weight", "kto_undesirable_weight"),
    ] {
        if let Some(v) = obj[key].as_f64() {
            train.push_str(&format!("{ours} = {v}\n"));
        }
    }
    let format = match name {
        "kto" => "unpaired_preference",
        _ => "preference",
    };
    format!(
        r#"
[model]
path = "{model}"
dtype = "f32"
[lora]
init_adapter = "{adapter}"
dropout = 0.0
[data]
train = "{train_file}"
format = "{format}"
seq_len = 64
shuffle = false
[train]
{train}micro_batch = {mb}
max_steps = {steps}
lr = {lr}
betas = [{b1}, {b2}]
eps = {eps}
weight_decay = {wd}
max_grad_norm = {clip}
schedule = "{sched}"
warmup_steps = {warm}
[output]
dir = "{out}"
"#,
        model = d.join(m["model_dir"].as_str().unwrap()).display(),
        adapter = d.join("init_adapter").display(),
        train_file = d.join("train.jsonl").display(),
        mb = o["micro_batch"],
        steps = o["steps"],
        lr = o["lr"],
        b1 = o["betas"][0],
        b2 = o["betas"][1],
        eps = o["eps"],
        wd = o["weight_decay"],
        clip = o["max_grad_norm"],
        sched = o["schedule"].as_str().unwrap(),
        warm = o["warmup_steps"],
        out = out.display(),
    )
}

/// metrics.jsonl's rows.
pub(crate) fn metrics_rows(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The largest |ours - golden| over the adapter's entries (every key present in both).
fn adapter_diff(case: &str, out: &Path) -> f32 {
    let got = load_st(&out.join("adapter_model.safetensors"));
    let want = load_st(&pref_dir(case).join("golden.safetensors"));
    let n_after = want.keys().filter(|k| k.starts_with("after.")).count();
    assert_eq!(got.len(), n_after, "{case}: adapter tensors");
    got.iter()
        .map(|(k, t)| max_abs_diff(t, &want[&format!("after.{k}")]))
        .fold(0f32, f32::max)
}

/// The adapter moved from its init by more than the tolerance (the check is not vacuous).
fn moved(case: &str, out: &Path) -> f32 {
    let got = load_st(&out.join("adapter_model.safetensors"));
    let init = load_st(&pref_dir(case).join("init_adapter/adapter_model.safetensors"));
    got.iter()
        .map(|(k, t)| max_abs_diff(t, &init[k]))
        .fold(0f32, f32::max)
}

/// Trains a case with the library; checks the adapter, the losses and TRL's metrics.
fn check_case(case: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let r = recipe(tmp.path(), &pref_recipe(case, &out), &[]);
    let summary = lora_train::run::run(r).unwrap();
    check_outputs(case, &out, Some(&summary.losses));
    (tmp, out)
}

pub(crate) fn check_outputs(case: &str, out: &Path, losses: Option<&[f64]>) {
    let m = meta(case);
    let want_losses: Vec<f64> = m["train_losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let rows = metrics_rows(out);
    assert_eq!(rows.len(), want_losses.len(), "{case}: metrics rows");
    for (s, (row, want)) in rows.iter().zip(&want_losses).enumerate() {
        let got = row["loss"].as_f64().unwrap();
        assert!(
            (got - want).abs() < 1e-5,
            "{case} step {s}: loss {got} vs {want}"
        );
        if let Some(l) = losses {
            assert!((l[s] - want).abs() < 1e-5, "{case} step {s}: summary loss");
        }
        // Every metric the fixture has, under TRL's name, in metrics.jsonl.
        let wm = m["metrics"][s].as_object().unwrap();
        assert!(wm.len() >= 6, "{case}: fixture metrics");
        for (k, v) in wm {
            let v = v.as_f64().unwrap();
            let g = row[k.as_str()]
                .as_f64()
                .unwrap_or_else(|| panic!("{case} step {s}: metrics.jsonl lacks {k}: {row}"));
            // logps are sums of ~10 log-probabilities of ~-6 each in f32
            let tol = 1e-4 * v.abs().max(1.0);
            assert!((g - v).abs() <= tol, "{case} step {s}: {k} {g} vs {v}");
        }
    }
    let d = adapter_diff(case, out);
    assert!(
        d <= ADAPTER_TOL,
        "{case}: adapter max |ours - golden| {d:.3e}"
    );
    let mv = moved(case, out);
    assert!(
        mv > 100.0 * ADAPTER_TOL,
        "{case}: the adapter moved only {mv}"
    );
    if std::env::var_os("GOLDEN_REPORT").is_some() {
        eprintln!("{case}: adapter max abs diff {d:.3e} (moved {mv:.3e})");
    }
}

#[test]
fn dpo_sigmoid_matches_the_golden() {
    check_case("dpo_sigmoid");
}

#[test]
fn dpo_ipo_matches_the_golden() {
    check_case("dpo_ipo");
}

#[test]
fn dpo_hinge_matches_the_golden() {
    check_case("dpo_hinge");
}

#[test]
fn dpo_against_the_init_adapter_matches_the_golden() {
    check_case("dpo_ref_init");
}

#[test]
fn orpo_matches_the_golden() {
    check_case("orpo");
}

#[test]
fn simpo_matches_the_golden() {
    check_case("simpo");
}

#[test]
fn kto_matches_the_golden() {
    check_case("kto");
}

/// The real binary with exactly the held-out keys: data.format, train.objective,
/// train.pref_beta, train.micro_batch, data.seq_len (the rest of the recipe is the fixture's
/// model, adapter and optimiser).
#[test]
fn the_binary_trains_dpo_to_the_golden_and_logs_trl_metrics() {
    let case = "dpo_sigmoid";
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let text = pref_recipe(case, &out);
    assert!(!text.contains("pref_loss") && !text.contains("pref_reference"));
    let p = tmp.path().join("recipe.toml");
    std::fs::write(&p, text).unwrap();
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .arg("--recipe")
        .arg(&p)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    // the progress lines show the margin and accuracy
    assert!(
        stderr.contains("margin") && stderr.contains("acc"),
        "{stderr}"
    );
    check_outputs(case, &out, None);
}

/// DDP and FSDP on CPU thread ranks give one rank's adapter (DPO: its reference forward under
/// FSDP gathers; ORPO: its NLL's token mean over the step): 2 ranks × half the micro-batch
/// against one rank accumulating two halves, and against one rank of the whole micro-batch.
/// (Not KTO: its mismatched pairs are drawn within a micro-batch, and the ranks' micro-batches
/// hold other rows than one rank's.)
fn ranks_equal_one_rank(case: &str, strategy: &str) {
    let run = |sets: &[&str], par: &str| -> HashMap<String, candle_core::Tensor> {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let text = format!("{}\n{par}", pref_recipe(case, &out));
        let mut all = vec!["train.max_steps=3"];
        all.extend_from_slice(sets);
        lora_train::run::run(recipe(tmp.path(), &text, &all)).unwrap();
        load_st(&out.join("adapter_model.safetensors"))
    };
    let mb = meta(case)["opt"]["micro_batch"].as_u64().unwrap() as usize;
    let half = format!("train.micro_batch={}", mb / 2);
    let par = format!("[parallel]\nstrategy = \"{strategy}\"\ndevices = [0, 1]\ntimeout_s = 60\n");
    let two = run(&[&half], &par);
    let one_accum = run(&[&half, "train.grad_accum=2"], "");
    assert!(one_accum.len() >= 4);
    for (k, t) in &one_accum {
        assert_close(&format!("{case} {strategy} {k}"), &two[k], t, 1e-5, 1e-5);
    }
    let one = run(&[], "");
    for (k, t) in &one {
        assert_close(&format!("{case} accum {k}"), &one_accum[k], t, 1e-5, 1e-5);
    }
}

#[test]
fn dpo_on_ddp_ranks_equals_one_rank() {
    ranks_equal_one_rank("dpo_sigmoid", "ddp");
}

#[test]
fn orpo_on_fsdp_ranks_equals_one_rank() {
    ranks_equal_one_rank("orpo", "fsdp");
}

#[test]
fn dpo_on_fsdp_ranks_equals_one_rank() {
    ranks_equal_one_rank("dpo_sigmoid", "fsdp");
}

/// DPO against the init adapter (the reference is the adapter as loaded, not the checkpoint's),
/// with dropout and shuffling, 300 steps of one pair: SIGINT after a step, then resume, ends
/// bit-identical to a run that never stopped (adapter, optimiser state, metrics rows).
#[test]
fn a_dpo_run_resumed_after_sigint_is_bit_identical_to_one_that_never_stopped() {
    use crate::resume::{assert_same, spawn, wait_for_line};
    let case = "dpo_ref_init";
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let args = |out: &Path, extra: &[&str]| -> Vec<String> {
        let dir = out.with_extension("recipe");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("recipe.toml");
        std::fs::write(&p, pref_recipe(case, out)).unwrap();
        let mut v = vec!["--recipe".to_string(), p.display().to_string()];
        let sets = [
            "train.max_steps=300",
            "train.micro_batch=1",
            "lora.dropout=0.1",
            "data.shuffle=true",
            "output.save_every=1000",
        ];
        for s in sets.iter().chain(extra) {
            v.push("--set".into());
            v.push(s.to_string());
        }
        v
    };
    let (mut child, rx) = spawn(&args(&b, &[]), &[]);
    wait_for_line(&rx, "step 1/300");
    send_signal(child.id(), libc::SIGINT);
    let status = child.wait().unwrap();
    let text: Vec<String> = rx.iter().collect();
    let text = text.join("\n");
    assert_eq!(status.code(), Some(130), "{text}");
    let k: usize = text
        .split("interrupted after step ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{text}"));
    assert!((1..300).contains(&k), "{text}");
    assert!(b.join(format!("checkpoint-{k}")).is_dir());

    let run = |args: Vec<String>| {
        let o = Command::cargo_bin("lora-train")
            .unwrap()
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    run(args(&b, &["train.resume=true"]));
    run(args(&a, &[]));
    for f in [
        "adapter_model.safetensors",
        "checkpoint-300/optimizer.safetensors",
        "checkpoint-300/adapter_model.safetensors",
        "checkpoint-300/trainer_state.json",
    ] {
        assert_same(&a.join(f), &b.join(f));
    }
    let rows = |d: &Path| -> Vec<(u64, f64, f64)> {
        metrics_rows(d)
            .iter()
            .map(|r| {
                let f = |k: &str| r[k].as_f64().unwrap();
                (r["step"].as_u64().unwrap(), f("loss"), f("rewards/margins"))
            })
            .collect()
    };
    let (ra, rb) = (rows(&a), rows(&b));
    assert_eq!(ra.len(), 300);
    assert_eq!(ra, rb);
}

/// Recipes that cannot train a preference objective stop before anything runs, naming the
/// key and the fix.
#[test]
fn mismatched_objective_format_and_reference_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let text = pref_recipe("dpo_sigmoid", &out);
    let p = tmp.path().join("recipe.toml");
    std::fs::write(&p, &text).unwrap();
    let err = |sets: &[&str]| -> String {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        match lora_train::recipe::Recipe::load(&p, &sets) {
            Ok(_) => panic!("{sets:?} was accepted"),
            Err(e) => e.to_string(),
        }
    };
    let e = err(&["data.format=tokens"]);
    assert!(
        e.contains("data.format") && e.contains("\"dpo\" reads data.format = \"preference\""),
        "{e}"
    );
    let e = err(&["train.objective=sft"]);
    assert!(
        e.contains("train.objective") && e.contains("\"preference\""),
        "{e}"
    );
    let no_init: String = text
        .lines()
        .filter(|l| !l.starts_with("init_adapter"))
        .map(|l| format!("{l}\n"))
        .collect();
    let q = tmp.path().join("no-init.toml");
    std::fs::write(&q, no_init).unwrap();
    let sets = vec!["train.pref_reference=init_adapter".to_string()];
    let e = lora_train::recipe::Recipe::load(&q, &sets)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs lora.init_adapter"), "{e}");
    let e = err(&["train.objective=orpo", "train.pref_reference=init_adapter"]);
    assert!(e.contains("no reference model"), "{e}");
    let e = err(&["train.pref_beta=0"]);
    assert!(e.contains("train.pref_beta"), "{e}");
    let e = err(&["data.pack=true"]);
    assert!(e.contains("data.pack"), "{e}");
    let e = err(&["data.eval_fraction=0.1"]);
    assert!(e.contains("not evaluated"), "{e}");
    let e = err(&["data.format=unpaired_preference"]);
    assert!(e.contains("\"unpaired_preference\""), "{e}");
}

/// `plan` counts a pair as its prefix tree: the prompt once, each sequence cut to seq_len, at
/// most 2 × seq_len − 1 tokens a row (a one-token prompt).
#[test]
fn plan_counts_a_pair_as_one_prefix_tree() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("recipe.toml");
    std::fs::write(&p, pref_recipe("dpo_sigmoid", &tmp.path().join("out"))).unwrap();
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .args(["plan", "--recipe"])
        .arg(&p)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("2 × data.seq_len − 1 = 127"), "{stdout}");
    assert!(
        stdout.contains("micro-batch 2 × seq 127 (254 tokens)"),
        "{stdout}"
    );
}

/// `bench --objective dpo` trains random pairs on the tiny shape: from B = 0 the policy is the
/// reference, so the first loss is ln 2; the JSON counts pairs and times the reference's
/// forwards alone (reference_fwd_s, reference_share of step_s).
#[test]
fn bench_dpo_starts_at_ln2_and_counts_pairs() {
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .args([
            "bench",
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--objective",
            "dpo",
            "--seq",
            "32",
            "--prompt-len",
            "8",
            "--micro-batch",
            "2",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    let j: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(j["objective"], "dpo", "{j}");
    assert_eq!(j["prompt_len"], 8);
    let losses = j["losses"].as_array().unwrap();
    // the JSON rounds losses to 1e-4
    let first = losses[0].as_f64().unwrap();
    assert!((first - std::f64::consts::LN_2).abs() < 1e-4, "{j}");
    let pairs_s = j["pairs_per_s"].as_f64().unwrap();
    assert!(pairs_s > 0.0, "{j}");
    // a pair is one prefix tree: its prompt once, 8 + 2 × 24 = 56 tokens
    let per_pair = j["tokens_per_s"].as_f64().unwrap() / pairs_s;
    assert!(
        (per_pair - 56.0).abs() < 0.5,
        "{per_pair} tokens a pair: {j}"
    );
    // the reference's forwards timed alone: a part of the step (it keeps no graph)
    let r = j["reference_fwd_s"].as_f64().unwrap();
    let share = j["reference_share"].as_f64().unwrap();
    let step = j["step_s"].as_f64().unwrap();
    assert!(r > 0.0 && share > 0.0 && share < 1.0, "{j}");
    assert!((share - r / step).abs() < 0.01, "{j}");
}
