//! Every shipped recipe opens with its purpose, the command that runs it and the hardware it
//! was planned for, and passes `lora-train check` and `lora-train plan` as its header says. The
//! Hub models' config.json files (tests/fixtures/configs, as published) are served by the
//! loopback Hub, so `plan` takes the real path: HF_ENDPOINT, the cache, config.json alone.

use crate::common::root;
use crate::loopback::{hub_command, Repo, Server};
use assert_cmd::Command;

/// The Hub models the recipes name, and their config.json fixtures.
const MODELS: [(&str, &str); 7] = [
    ("meta-llama/Llama-2-7b-hf", "llama2-7b"),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama3.1-8b-instruct"),
    ("Qwen/Qwen2.5-7B", "qwen2.5-7b"),
    ("mistralai/Mistral-7B-v0.3", "mistral-7b-v0.3"),
    ("Qwen/Qwen3-8B", "qwen3-8b"),
    ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
    ("openai/gpt-oss-20b", "gpt-oss-20b"),
];

/// The recipes for real models (the others train the tiny model we ship).
const REAL: [&str; 12] = [
    "llama7b.toml",
    "llama3-8b-dpo.toml",
    "qwen2.5-7b-orpo.toml",
    "llama7b-qlora.toml",
    "llama7b-fsdp4.toml",
    "llama3-8b-chat.toml",
    "qwen2.5-7b.toml",
    "mistral-7b.toml",
    "qwen3-8b.toml",
    "qwen3-30b-a3b.toml",
    "qwen3-30b-a3b-qlora.toml",
    "gpt-oss-20b.toml",
];

/// The binary on a host of 125 GiB (LORA_TRAIN_HOST_MEMORY): the headers' plans do not depend
/// on the machine that runs the tests.
fn bin(hf: &std::path::Path, endpoint: &str) -> Command {
    let mut c = hub_command(hf, endpoint);
    c.current_dir(root())
        .env("LORA_TRAIN_HOST_MEMORY", "125GiB");
    c
}

/// The first number of GiB in `line`, e.g. "16.32".
fn first_gib(line: &str) -> Option<&str> {
    line.split_whitespace()
        .zip(line.split_whitespace().skip(1))
        .find(|(_, unit)| unit.starts_with("GiB"))
        .map(|(n, _)| n.trim_start_matches(':'))
}

/// A header's plan line against `plan --json`'s selected row: its total (the first figure), and
/// `base B GiB` where it says one.
fn check_claim(rel: &str, claim: &str, sel: &serde_json::Value) {
    let total = format!("{:.2}", sel["total_gib"].as_f64().unwrap());
    assert_eq!(
        first_gib(claim),
        Some(total.as_str()),
        "{rel}: header says {claim}"
    );
    if let Some(at) = claim.find("base ") {
        let base = sel["base_bytes"].as_f64().unwrap() / (1u64 << 30) as f64;
        assert_eq!(
            first_gib(&claim[at..]),
            Some(format!("{base:.2}").as_str()),
            "{rel}: header says {claim}"
        );
    }
}

#[test]
fn every_shipped_recipe_checks_and_plans_as_its_header_says() {
    let repos = MODELS
        .iter()
        .map(|(id, dir)| {
            let config = root()
                .join("tests/fixtures/configs")
                .join(dir)
                .join("config.json");
            (
                id.to_string(),
                Repo::default().add("config.json", std::fs::read(config).unwrap()),
            )
        })
        .collect();
    let hub = Server::start(repos);
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    let mut names: Vec<String> = std::fs::read_dir(root().join("recipes"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".toml"))
        .collect();
    names.sort();
    for real in REAL {
        assert!(names.iter().any(|n| n == real), "recipes/{real} is missing");
    }
    for name in &names {
        let rel = format!("recipes/{name}");
        let text = std::fs::read_to_string(root().join(&rel)).unwrap();
        let o = bin(&hf, &hub.endpoint())
            .args(["check", "--recipe", &rel])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{rel}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        if name == "reference.toml" {
            continue;
        }
        // The header: what the recipe does, then the command that runs it.
        let header: Vec<&str> = text.lines().take_while(|l| l.starts_with('#')).collect();
        assert!(header.len() >= 3, "{rel} opens with no header");
        let run = format!("#   cargo run --release -- --recipe {rel}");
        let run_bin = format!("#   lora-train --recipe {rel}");
        assert!(
            header.iter().any(|l| *l == run || *l == run_bin),
            "{rel}: the header lacks `{}`",
            run_bin.trim_start_matches("#   ")
        );
        if !REAL.contains(&name.as_str()) {
            let o = bin(&hf, &hub.endpoint())
                .args(["plan", "--recipe", &rel])
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "{rel}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            continue;
        }
        // The plan the header quotes: its command, and the planned total of the recipe's own
        // setting (strategy, checkpointing, micro-batch), which must fit.
        let plan = header
            .iter()
            .find_map(|l| l.strip_prefix("#   lora-train plan "))
            .unwrap_or_else(|| panic!("{rel}: the header has no `lora-train plan` command"));
        let claim = header
            .iter()
            .find_map(|l| l.strip_prefix("#   -> "))
            .unwrap_or_else(|| panic!("{rel}: the header quotes no plan (`#   -> ...`)"));
        let args: Vec<&str> = plan.split_whitespace().collect();
        assert!(args.contains(&rel.as_str()), "{rel}: {plan}");
        let planned = |sets: &[&str]| {
            let o = bin(&hf, &hub.endpoint())
                .arg("plan")
                .args(&args)
                .args(sets.iter().flat_map(|s| ["--set", s]))
                .arg("--json")
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(o.status.success(), "{rel} {sets:?}: {err}");
            serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
        };
        let p = planned(&[]);
        assert_eq!(p["selected"]["fits"], true, "{rel}: {}", p["selected"]);
        check_claim(&rel, claim, &p["selected"]);
        // a preference pair's row: its prompt once, each sequence cut to seq_len 1024
        let pairs = ["-dpo.", "-orpo."].iter().any(|o| rel.contains(o));
        assert_eq!(p["seq_len"], if pairs { 2047 } else { 2048 }, "{rel}");
        // `#   with --set K=V ...: N GiB[, base B GiB][, does not fit]`: the same plan with
        // those overrides, each figure as `plan` prints it now.
        let mut checked = vec![claim.to_string()];
        for l in header.iter().filter_map(|l| l.strip_prefix("#   with ")) {
            let (sets, figures) = l.split_once(": ").unwrap_or_else(|| panic!("{rel}: {l}"));
            let sets: Vec<&str> = sets.split_whitespace().filter(|w| *w != "--set").collect();
            let sel = &planned(&sets)["selected"];
            check_claim(&rel, figures, sel);
            let fits = !figures.contains("does not fit");
            assert_eq!(sel["fits"], fits, "{rel}: header says {l}");
            checked.push(figures.to_string());
        }
        // No plan figure (x.xx GiB) in the header's prose: each is on a line checked above.
        for l in &header {
            for (n, unit) in l.split_whitespace().zip(l.split_whitespace().skip(1)) {
                let plan_figure =
                    unit.starts_with("GiB") && n.split_once('.').is_some_and(|(_, d)| d.len() == 2);
                if plan_figure && !l.contains("--gpu-mem") {
                    assert!(
                        checked.iter().any(|c| l.contains(c.as_str())),
                        "{rel}: `{l}` quotes {n} GiB, which no checked plan line holds"
                    );
                }
            }
        }
    }
    // plan fetched config.json and nothing else.
    let reqs = hub.requests();
    assert!(!reqs.is_empty());
    assert!(
        reqs.iter().all(|r| r.path.ends_with("/config.json")),
        "{reqs:?}"
    );
    for (id, _) in MODELS {
        let dir = hf
            .join("hub")
            .join(format!("models--{}", id.replace('/', "--")));
        assert!(dir.join("refs/main").is_file(), "{id}");
    }
}
