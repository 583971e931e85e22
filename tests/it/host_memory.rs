//! The host's memory counted (issue 63, classes 5 and 8): a CPU run whose plan needs more than
//! the process can get refuses with exit 3, the plan and the limit named, before it loads a
//! weight; `plan`'s advice counts the pinned host memory of parked activations against the
//! host (`--host-mem`, LORA_TRAIN_HOST_MEMORY, else this machine).

use crate::common::root;
use std::os::unix::process::CommandExt;
use std::process::Command;

const GIB: u64 = 1 << 30;
/// The plan searches seq_len in steps of this many tokens (memory::plan's SEQ_STEP).
const SEQ_STEP: u64 = 1024;

fn bin() -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin("lora-train"));
    c.current_dir(root()).env_remove("LORA_TRAIN_HOST_MEMORY");
    c
}

/// The tiny CPU recipe at 32 × 65536 tokens a micro-batch: some 16 GiB planned.
fn large_cpu_run(out: &std::path::Path) -> Command {
    let mut c = bin();
    c.args(["train", "--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", out.display()))
        .args([
            "--set",
            "data.seq_len=65536",
            "--set",
            "train.micro_batch=32",
        ])
        .args(["--set", "train.grad_accum=1", "--set", "train.max_steps=1"]);
    c
}

#[test]
fn a_cpu_run_over_ulimit_v_refuses_with_exit_3_naming_the_limit_and_the_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut c = large_cpu_run(&out);
    let lim = 4 * GIB;
    // SAFETY: setrlimit only, in the child between fork and exec (async-signal-safe).
    unsafe {
        c.pre_exec(move || {
            let l = libc::rlimit {
                rlim_cur: lim,
                rlim_max: lim,
            };
            match libc::setrlimit(libc::RLIMIT_AS, &l) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("the memory plan says this run does not fit: single needs")
            && err.contains("the host memory of this process (ulimit -v (RLIMIT_AS) of 4.00 GiB"),
        "{err}"
    );
    assert!(
        err.contains("| memory plan per rank: micro-batch 32 × seq 65536"),
        "{err}"
    );
    assert!(err.contains("remedies: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // Refused before the run wrote anything.
    assert!(!out.join("adapter_model.safetensors").exists());
    assert!(!out.join("metrics.jsonl").exists());
}

#[test]
fn a_cpu_run_over_the_hosts_memory_refuses_and_one_within_it_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let o = large_cpu_run(&out)
        .env("LORA_TRAIN_HOST_MEMORY", "2GiB")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("the host memory of this process (LORA_TRAIN_HOST_MEMORY = 2GiB"),
        "{err}"
    );
    // The tiny run as shipped fits 2 GiB: it trains.
    let o = bin()
        .args(["train", "--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", out.display()))
        .args(["--set", "train.max_steps=1"])
        .env("LORA_TRAIN_HOST_MEMORY", "2GiB")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A bad value is named.
    let o = large_cpu_run(&tmp.path().join("x"))
        .env("LORA_TRAIN_HOST_MEMORY", "lots")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("LORA_TRAIN_HOST_MEMORY = \"lots\" is not a size"),
        "{err}"
    );
}

/// `lora-train plan --shape llama2-7b --gpu-mem 80GiB --json` with `extra`: its JSON.
fn plan_json(extra: &[&str]) -> serde_json::Value {
    let o = bin()
        .args([
            "plan",
            "--shape",
            "llama2-7b",
            "--gpu-mem",
            "80GiB",
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The row that holds the longest context, as the advice picks it (the first of the longest).
fn longest(p: &serde_json::Value) -> serde_json::Value {
    let rows = p["rows"].as_array().unwrap();
    let t = |r: &serde_json::Value| r["max_seq_len"].as_u64().unwrap_or(0);
    let most = rows.iter().map(t).max().unwrap();
    assert_eq!(p["advice"]["max_seq_len"].as_u64(), Some(most));
    rows.iter().find(|r| t(r) == most).unwrap().clone()
}

/// `like`'s row (strategy and checkpointing) in plan `p`.
fn row_of(p: &serde_json::Value, like: &serde_json::Value) -> serde_json::Value {
    let rows = p["rows"].as_array().unwrap();
    let same =
        |r: &&serde_json::Value| r["strategy"] == like["strategy"] && r["ckpt"] == like["ckpt"];
    rows.iter().find(same).unwrap().clone()
}

/// llama2-7b on an 80 GiB card: unbounded, the longest context advised pins more than three
/// quarters of a 125 GiB host (the report); with that host, the advice is shorter,
/// its row's pinned memory within the host and one step (1024 tokens) more does not fit.
#[test]
fn the_longest_context_advised_fits_the_hosts_pinned_memory() {
    let budget = 125 * GIB / 4 * 3;
    let at = |t: u64, host: &str| {
        let seq = t.to_string();
        plan_json(&["--seq", &seq, "--micro-batch", "1", "--host-mem", host])
    };
    let free = plan_json(&["--host-mem", "100TiB"]);
    let t_free = free["advice"]["max_seq_len"].as_u64().unwrap();
    let r = row_of(&at(t_free, "100TiB"), &longest(&free));
    assert!(r["host_bytes"].as_u64().unwrap() > budget, "{r}");

    let held = plan_json(&["--host-mem", "125GiB"]);
    let t = held["advice"]["max_seq_len"].as_u64().unwrap();
    assert!(t < t_free, "{t} < {t_free}");
    let like = longest(&held);
    let r = row_of(&at(t, "125GiB"), &like);
    assert_eq!(r["fits"], true, "{r}");
    assert!(r["host_bytes"].as_u64().unwrap() <= budget, "{r}");
    let next = row_of(&at(t + SEQ_STEP, "125GiB"), &like);
    assert_eq!(next["fits"], false, "{next}");
    let line = held["advice"]["lines"].as_array().unwrap().last().unwrap();
    assert!(
        line.as_str()
            .unwrap()
            .contains(&format!("data.seq_len = {t} ")),
        "{line}"
    );
}

#[test]
fn plan_takes_the_host_from_host_mem_or_the_environment() {
    let longest = |c: &mut Command, extra: &[&str]| {
        let o = c
            .args([
                "plan",
                "--shape",
                "llama2-7b",
                "--gpu-mem",
                "80GiB",
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (
            v["advice"]["max_seq_len"].as_u64().unwrap(),
            v["host_available_bytes"].as_u64(),
        )
    };
    let big = longest(&mut bin(), &["--host-mem", "100TiB"]);
    let env = longest(bin().env("LORA_TRAIN_HOST_MEMORY", "125GiB"), &[]);
    let flag = longest(&mut bin(), &["--host-mem", "125GiB"]);
    assert_eq!(env, flag);
    assert_eq!(flag.1, Some(125 * GIB));
    assert!(flag.0 < big.0, "{flag:?} {big:?}");
    // The host line says what the host has.
    let o = bin()
        .args([
            "plan",
            "--shape",
            "llama2-7b",
            "--gpu-mem",
            "80GiB",
            "--host-mem",
            "125GiB",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("the host has 125.00 GiB free, of which three quarters may be pinned"),
        "{text}"
    );
}
