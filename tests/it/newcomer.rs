//! A newcomer's first day on a GPU (issue 64), through the real binary: `generate` asks the
//! model in the format it trained on, a finished run is never replaced silently, sizes need a
//! unit, the common command-line slips say what to type, `plan` works offline by shape and
//! answers "fits as written" first, and the help texts name real fields.

use crate::common::root;
use crate::loopback::hub_command;
use assert_cmd::Command;
use std::path::Path;

fn bin() -> Command {
    let mut c = Command::cargo_bin("lora-train").unwrap();
    c.current_dir(root());
    c
}

/// (exit code, stdout, stderr) of `lora-train args`, run in the repository root.
fn run(args: &[&str]) -> (i32, String, String) {
    let o = bin().args(args).output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Trains `recipe` for `steps` steps into `out`, with `sets` more.
fn train(recipe: &str, out: &Path, steps: usize, sets: &[&str]) -> (i32, String) {
    let dir = format!("output.dir={}", out.display());
    let steps = format!("train.max_steps={steps}");
    let mut args = vec!["--recipe", recipe, "--set", &dir, "--set", &steps];
    for s in sets {
        args.extend(["--set", s]);
    }
    let (code, _, err) = run(&args);
    (code, err)
}

/// The prompt's token count `generate` reports ("prompt N tokens in").
fn prompt_tokens(err: &str) -> usize {
    let at = err.find("; prompt ").unwrap_or_else(|| panic!("{err}")) + "; prompt ".len();
    err[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn template_line(err: &str) -> &str {
    err.lines()
        .find(|l| l.starts_with("prompt template: "))
        .unwrap_or_else(|| panic!("no template line: {err}"))
}

/// `generate --recipe` on an Alpaca run puts the prompt in the Alpaca template (more prompt
/// tokens than `--raw`, and the same tokens and text as `--raw` with the template written
/// out); `--adapter` reads the format from the run's recipe.toml; a chat run's prompt goes
/// through its chat template; a completion run's goes as it is; each names the template.
#[test]
fn generate_prompts_in_the_trained_format() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("alpaca");
    let (code, err) = train("recipes/tiny-cpu-alpaca.toml", &out, 2, &[]);
    assert_eq!(code, 0, "{err}");
    let dir = format!("output.dir={}", out.display());
    let ask = "Give three tips for staying healthy.";
    let gen = |extra: &[&str]| {
        let mut args = vec!["generate", "--max-new-tokens", "6", "--prompt"];
        args.extend(extra);
        run(&args)
    };
    let (code, text, err) = gen(&[
        ask,
        "--recipe",
        "recipes/tiny-cpu-alpaca.toml",
        "--set",
        &dir,
    ]);
    assert_eq!(code, 0, "{err}");
    let line = template_line(&err);
    assert!(
        line.starts_with(
            "prompt template: alpaca (data.format = \"alpaca\" of recipes/tiny-cpu-alpaca.toml"
        ),
        "{line}"
    );
    assert!(line.contains("--raw sends the prompt as it is"), "{line}");
    let templated = prompt_tokens(&err);

    let (code, raw_text, err) = gen(&[
        ask,
        "--raw",
        "--recipe",
        "recipes/tiny-cpu-alpaca.toml",
        "--set",
        &dir,
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(template_line(&err), "prompt template: none (--raw)");
    let raw = prompt_tokens(&err);
    assert!(
        templated > raw + 20,
        "alpaca {templated} vs raw {raw} prompt tokens"
    );

    // The template written out by hand and sent raw: the same tokens, the same answer.
    let by_hand = format!(
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{ask}\n\n### Response:\n"
    );
    let (code, hand_text, err) = gen(&[&by_hand, "--raw", "--adapter", out.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(prompt_tokens(&err), templated, "{err}");
    assert_eq!(hand_text, text);
    assert!(!raw_text.is_empty());

    // --adapter alone: the format recorded in its run's recipe.toml.
    let (code, ad_text, err) = gen(&[ask, "--adapter", out.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let line = template_line(&err);
    assert!(
        line.starts_with("prompt template: alpaca (data.format = \"alpaca\" of "),
        "{line}"
    );
    assert!(line.contains("recipe.toml"), "{line}");
    assert_eq!(prompt_tokens(&err), templated);
    assert_eq!(ad_text, text);

    // A chat run: one user turn through the chat template, its turn end a stop token.
    let chat = tmp.path().join("chat");
    let (code, err) = train("recipes/tiny-cpu-chat.toml", &chat, 1, &[]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = gen(&["Hi there", "--adapter", chat.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        template_line(&err).starts_with("prompt template: chat (data.format = \"chat\""),
        "{err}"
    );
    let chat_tokens = prompt_tokens(&err);
    let (_, _, err) = gen(&["Hi there", "--raw", "--adapter", chat.to_str().unwrap()]);
    assert!(chat_tokens > prompt_tokens(&err), "{err}");

    // A completion run: the prompt as it is (the completion follows it in training).
    let rows = tmp.path().join("rows.jsonl");
    std::fs::write(
        &rows,
        (0..8)
            .map(|i| {
                format!(
                    "{{\"prompt\": \"{i} plus one is\", \"completion\": \" {}\"}}\n",
                    i + 1
                )
            })
            .collect::<String>(),
    )
    .unwrap();
    let comp = tmp.path().join("completion");
    let train_rows = format!("data.train={}", rows.display());
    let (code, err) = train(
        "recipes/tiny-cpu.toml",
        &comp,
        1,
        &["data.format=completion", &train_rows],
    );
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = gen(&["7 plus one is", "--adapter", comp.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        template_line(&err).starts_with("prompt template: completion ("),
        "{err}"
    );
    let as_is = prompt_tokens(&err);
    let (_, _, err) = gen(&[
        "7 plus one is",
        "--raw",
        "--adapter",
        comp.to_str().unwrap(),
    ]);
    assert_eq!(prompt_tokens(&err), as_is);
}

fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// A second run into a finished run's directory fails (exit 2), names both ways on, and leaves
/// every file of the finished run byte-identical; `--overwrite` (or output.overwrite = true)
/// replaces it; resuming is unchanged.
#[test]
fn a_finished_run_is_never_replaced_silently() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (code, err) = train("recipes/tiny-cpu.toml", &out, 2, &[]);
    assert_eq!(code, 0, "{err}");
    let before = files_of(&out);
    assert!(before.iter().any(|(n, _)| n == "adapter_model.safetensors"));

    let (code, err) = train("recipes/tiny-cpu.toml", &out, 3, &["lora.rank=4"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("holds a finished run (adapter_model.safetensors"),
        "{err}"
    );
    assert!(
        err.contains(&format!("--set output.dir={}-2", out.display())),
        "{err}"
    );
    assert!(err.contains("--overwrite"), "{err}");
    assert_eq!(files_of(&out), before, "the finished run is untouched");

    // With checkpoints (save_every) the same; a resume of it still continues as before.
    let ck = tmp.path().join("ck");
    let (code, err) = train("recipes/tiny-cpu.toml", &ck, 2, &["output.save_every=1"]);
    assert_eq!(code, 0, "{err}");
    let (code, err) = train("recipes/tiny-cpu.toml", &ck, 2, &["output.save_every=1"]);
    assert_eq!(code, 2, "{err}");
    assert!(ck.join("checkpoint-2").is_dir());
    let (code, err) = train(
        "recipes/tiny-cpu.toml",
        &ck,
        2,
        &["output.save_every=1", "train.resume=true"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("resuming from"), "{err}");

    // --overwrite replaces it: the new run's adapter (rank 4), no old checkpoint.
    let dir = format!("output.dir={}", out.display());
    let (code, _, err) = run(&[
        "--recipe",
        "recipes/tiny-cpu.toml",
        "--set",
        &dir,
        "--set",
        "train.max_steps=1",
        "--set",
        "lora.rank=4",
        "--overwrite",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("of an earlier run"), "{err}");
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["r"], 4);
    // ... as the recipe field does.
    let (code, err) = train("recipes/tiny-cpu.toml", &out, 1, &["output.overwrite=true"]);
    assert_eq!(code, 0, "{err}");
    // save_every = 0: the final adapter alone, no checkpoint (as reference.toml says).
    let bare = tmp.path().join("bare");
    let (code, err) = train("recipes/tiny-cpu.toml", &bare, 2, &["output.save_every=0"]);
    assert_eq!(code, 0, "{err}");
    assert!(bare.join("adapter_model.safetensors").is_file());
    let checkpoints = std::fs::read_dir(&bare)
        .unwrap()
        .filter(|e| {
            let n = e.as_ref().unwrap().file_name();
            n.to_string_lossy().starts_with("checkpoint-")
        })
        .count();
    assert_eq!(checkpoints, 0);
}

/// A size without a unit is refused, naming the units (CLI flags and recipe fields alike).
#[test]
fn sizes_need_a_unit() {
    for args in [
        &[
            "plan",
            "--recipe",
            "recipes/tiny-cpu.toml",
            "--gpu-mem",
            "24",
        ][..],
        &["bench", "--shape", "tiny", "--max-memory", "24"][..],
        &[
            "export",
            "--adapter",
            "adapters",
            "--out",
            "x",
            "--max-shard-size",
            "5",
        ][..],
    ] {
        let (code, _, err) = run(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("has no unit: write e.g."), "{args:?}: {err}");
        assert!(err.contains("GiB"), "{err}");
    }
    let (code, _, err) = run(&[
        "check",
        "--recipe",
        "recipes/tiny-cpu.toml",
        "--set",
        "train.max_memory=24",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("train.max_memory"), "{err}");
    assert!(
        err.contains("\"24\" has no unit: write e.g. \"24GiB\""),
        "{err}"
    );
    // With a unit, the plan reads it as that many bytes.
    let (code, out, err) = run(&[
        "plan",
        "--recipe",
        "recipes/tiny-cpu.toml",
        "--gpu-mem",
        "24GiB",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("capacity per rank: 24.00 GiB"), "{out}");
}

/// The common slips get clap's error and then the line to type (exit 2).
#[test]
fn command_line_slips_say_what_to_type() {
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "--recipe",
                "recipes/tiny-cpu.toml",
                "--set",
                "train.lr",
                "1e-4",
            ],
            "to run that, type: lora-train --recipe recipes/tiny-cpu.toml --set train.lr=1e-4",
        ),
        (
            &["recipes/tiny-cpu.toml"],
            "to run that, type: lora-train --recipe recipes/tiny-cpu.toml",
        ),
        (
            &["train", "recipes/tiny-cpu.toml", "--set", "lora.rank=4"],
            "to run that, type: lora-train train --recipe recipes/tiny-cpu.toml --set lora.rank=4",
        ),
        (
            &["check", "recipes/tiny-cpu.toml"],
            "to run that, type: lora-train check --recipe recipes/tiny-cpu.toml",
        ),
    ];
    for (args, want) in cases {
        let (code, _, err) = run(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // Other errors stay clap's alone.
    let (code, _, err) = run(&["--no-such-flag"]);
    assert_eq!(code, 2, "{err}");
    assert!(!err.contains("to run that"), "{err}");
}

/// `--set model.path=DIR` replaces a recipe's model.id (and its revision); `--set model.id=`
/// replaces a model.path.
#[test]
fn set_model_path_replaces_model_id_and_back() {
    let tiny = root().join("recipes/assets/tiny-llama");
    let path = format!("model.path={}", tiny.display());
    let (code, out, err) = run(&["check", "--recipe", "recipes/llama7b.toml", "--set", &path]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("path = \"{}\"", tiny.display())),
        "{out}"
    );
    assert!(!out.contains("Llama-2-7b-hf"), "{out}");
    let (code, out, err) = run(&[
        "check",
        "--recipe",
        "recipes/tiny-cpu.toml",
        "--set",
        "model.id=org/some-model",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("id = \"org/some-model\""), "{out}");
    assert!(!out.contains("tiny-llama"), "{out}");
}

/// Offline, `plan` on a Hub recipe says which `plan --shape` line plans the same run without
/// the network, and that line runs offline.
#[test]
fn plan_offline_points_to_the_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let o = hub_command(&tmp.path().join("hf"), "http://127.0.0.1:9")
        .current_dir(root())
        .env("HF_HUB_OFFLINE", "1")
        .args([
            "plan",
            "--recipe",
            "recipes/llama7b-fsdp4.toml",
            "--gpu-mem",
            "24GiB",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    let want = "plan its shape: lora-train plan --shape llama2-7b --seq 2048 --micro-batch 2 --rank 16 --gpus 4 --gpu-mem 24GiB";
    assert!(err.contains(want), "{err}");
    let line = err[err.find("lora-train plan --shape").unwrap()..]
        .lines()
        .next()
        .unwrap();
    let words: Vec<&str> = line.split_whitespace().skip(1).collect();
    let o = hub_command(&tmp.path().join("hf"), "http://127.0.0.1:9")
        .current_dir(root())
        .env("HF_HUB_OFFLINE", "1")
        .args(&words)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("fsdp ×4"));
}

/// The GiB figures of an advice line: (needed, of the card), where it names both.
fn advised(line: &str) -> Option<(f64, f64)> {
    let nums: Vec<f64> = line
        .split_whitespace()
        .zip(line.split_whitespace().skip(1))
        .filter(|(_, u)| u.starts_with("GiB"))
        .filter_map(|(n, _)| n.parse().ok())
        .collect();
    (line.contains(" of ") && nums.len() >= 2).then(|| (nums[0], nums[1]))
}

/// On a recipe that fits, `plan` says "fits as written" before any advice, and never advises
/// a setting above 90% of the card (llama7b-fsdp4 at 24 GiB: single + ckpt mlp needs 23.94).
#[test]
fn plan_says_fits_as_written_first_and_advises_within_ninety_percent() {
    let cfg = root().join("tests/fixtures/configs/llama2-7b");
    let path = format!("model.path={}", cfg.display());
    for mem in ["24GiB", "26GiB", "40GiB", "80GiB"] {
        let (code, out, err) = run(&[
            "plan",
            "--recipe",
            "recipes/llama7b-fsdp4.toml",
            "--set",
            &path,
            "--gpu-mem",
            mem,
        ]);
        assert_eq!(code, 0, "{err}");
        let fits = out
            .lines()
            .position(|l| l.starts_with("fits as written (fsdp ×4, marked *): "))
            .unwrap_or_else(|| panic!("{out}"));
        let first_advice = out.lines().position(|l| l.starts_with("advice:")).unwrap();
        assert!(fits < first_advice, "{out}");
        for l in out.lines().filter(|l| l.starts_with("advice:")) {
            if l.starts_with("advice: longest context") {
                continue;
            }
            if let Some((need, cap)) = advised(l) {
                assert!(need <= 0.9 * cap, "{mem}: advised above 90%: {l}");
            }
            assert!(
                !l.starts_with("advice: use "),
                "{mem}: a correction of a fitting recipe: {l}"
            );
        }
    }
    let (_, out, _) = run(&[
        "plan",
        "--recipe",
        "recipes/llama7b-fsdp4.toml",
        "--set",
        &path,
        "--gpu-mem",
        "24GiB",
    ]);
    assert!(!out.contains("23.94 GiB of 24.00"), "{out}");
    assert!(
        out.contains("advice: this also fits: single with activation checkpointing: "),
        "{out}"
    );
}

/// Every `section.key` a --help text names is a field of the recipe (reference.toml, checked).
#[test]
fn help_texts_name_real_fields() {
    let (code, reference, err) = run(&["check", "--recipe", "recipes/reference.toml"]);
    assert_eq!(code, 0, "{err}");
    let mut fields = std::collections::BTreeSet::new();
    let mut section = String::new();
    for l in reference.lines() {
        let l = l.trim();
        if let Some(s) = l.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            section = s.to_string();
        } else if let Some((k, _)) = l.split_once(" = ") {
            fields.insert(format!("{section}.{}", k.trim()));
        }
    }
    // Fields left unset (None) are not printed: the reference's commented ones.
    let text = std::fs::read_to_string(root().join("recipes/reference.toml")).unwrap();
    let mut section = String::new();
    for l in text.lines() {
        let l = l.trim().trim_start_matches("# ");
        if let Some(s) = l.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            section = s.to_string();
        } else if let Some((k, _)) = l.split_once(" = ") {
            if k.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                fields.insert(format!("{section}.{k}"));
            }
        }
    }
    assert!(fields.contains("lora.rslora"), "{fields:?}");
    // reference.toml matches the code: nf4 is implemented (tests/it/nf4.rs, qlora.rs).
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(!flat.contains("not implemented"), "reference.toml");
    assert!(
        flat.contains("# quantize = \"none\" # \"none\" | \"nf4\": QLoRA"),
        "reference.toml"
    );
    let sections = ["model", "lora", "data", "train", "output", "parallel"];
    for cmd in [
        "train", "check", "bench", "prepare", "plan", "probe", "download", "export", "generate",
        "report",
    ] {
        let (code, help, err) = run(&[cmd, "--help"]);
        assert_eq!(code, 0, "{err}");
        for w in help.split(|c: char| !(c.is_ascii_alphanumeric() || c == '.' || c == '_')) {
            let w = w.trim_end_matches('.');
            let Some((s, k)) = w.split_once('.') else {
                continue;
            };
            // a file name (my-lora.gguf) is not a field
            let file = [
                "gguf",
                "toml",
                "json",
                "jsonl",
                "jinja",
                "svg",
                "safetensors",
            ];
            if sections.contains(&s) && !k.is_empty() && !k.contains('.') && !file.contains(&k) {
                assert!(
                    fields.contains(w),
                    "`{cmd} --help` names `{w}`, not a recipe field"
                );
            }
        }
    }
}

/// Everywhere a `cargo install` is written it is `--locked` (Cargo.lock is what CI tested).
#[test]
fn cargo_install_is_locked_everywhere() {
    let mut files = vec![root().join("README.md")];
    for d in ["docs", "recipes", "scripts", "adapters"] {
        for e in std::fs::read_dir(root().join(d)).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() {
                files.push(p);
            }
        }
    }
    let mut seen = 0;
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        for (i, l) in text.lines().enumerate() {
            if l.contains("cargo install") {
                seen += 1;
                assert!(l.contains("--locked"), "{}:{}: {l}", f.display(), i + 1);
            }
        }
    }
    assert!(seen >= 2, "README's install lines");
}

/// A CPU build asked for CUDA tells the one build story: driver, toolkit or none, features.
#[test]
#[cfg(not(feature = "cuda"))]
fn a_cpu_build_asked_for_cuda_tells_how_to_build() {
    let (code, _, err) = run(&[
        "--recipe",
        "recipes/tiny-cpu.toml",
        "--set",
        "model.device=cuda",
    ]);
    assert_eq!(code, 2, "{err}");
    let (gcode, _, gerr) = run(&[
        "generate",
        "--device",
        "cuda",
        "--model",
        "recipes/assets/tiny-llama",
        "--prompt",
        "Hi",
    ]);
    assert_eq!(gcode, 2, "{gerr}");
    for e in [&err, &gerr] {
        for want in [
            "driver >= 580",
            "CUDA 13.0",
            "docs/gpu.md",
            "cargo install --locked --path . --features cuda",
            "CUDA_COMPUTE_CAP=90",
            "bash scripts/build-cuda.sh",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
    }
    // docs/gpu.md tells the same story, and the missing-library fix.
    let gpu = std::fs::read_to_string(root().join("docs/gpu.md")).unwrap();
    for want in [
        "580",
        "CUDA 13.0",
        "--features cuda,nccl",
        "bash scripts/build-cuda.sh",
        "libcublas.so.13: not found",
        "scripts/device-env.sh",
    ] {
        assert!(gpu.contains(want), "docs/gpu.md lacks {want}");
    }
    let env = std::fs::read_to_string(root().join("scripts/device-env.sh")).unwrap();
    assert!(
        !env.contains("/opt/torch"),
        "scripts/device-env.sh names a lab path"
    );
}

/// README's recipe-for-your-card table quotes each recipe's figures as its header (which the
/// shipped-recipes test holds to `plan`); the README stays a user's page, its internals in docs/.
#[test]
fn readme_card_table_quotes_the_recipes_plans() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(readme.lines().count() <= 200, "README.md is a user's page");
    let at = readme.find("## Which recipe for your card").unwrap();
    let rows: Vec<&str> = readme[at..]
        .lines()
        .skip_while(|l| !l.starts_with("| your GPUs"))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .collect();
    let cards: Vec<&str> = rows
        .iter()
        .map(|r| r.split('|').nth(1).unwrap().trim())
        .collect();
    for want in ["12 GB", "24 GB", "48 GB", "80 GB", "4 × 24 GB"] {
        assert!(cards.iter().any(|c| c.starts_with(want)), "no {want} row");
    }
    for row in rows {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let recipes: Vec<String> = cells[2]
            .split('`')
            .skip(1)
            .step_by(2)
            .filter_map(|w| w.split_whitespace().next())
            .map(|w| w.trim_start_matches("recipes/").to_string())
            .collect();
        let figures: Vec<&str> = cells[3]
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|w| w.contains('.'))
            .collect();
        assert_eq!(recipes.len(), figures.len(), "{row}");
        for (r, f) in recipes.iter().zip(figures) {
            let text = std::fs::read_to_string(root().join("recipes").join(r)).unwrap();
            let header: Vec<&str> = text.lines().take_while(|l| l.starts_with('#')).collect();
            let quoted = format!("{f} GiB");
            let line = header.iter().find(|l| l.contains(&quoted));
            assert!(
                line.is_some(),
                "README: {r} at {f} GiB, its header does not say so"
            );
            // A row with overrides quotes the header line planned with them.
            if let Some(sets) = cells[2].split("--set ").nth(1) {
                let set = sets
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .trim_end_matches('`');
                assert!(line.unwrap().contains(set), "{row}");
            }
        }
    }
}
