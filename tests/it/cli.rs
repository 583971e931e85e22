//! The real binary: the tiny recipe end to end, and bad recipes (error text pinned, exit
//! code 2, nothing written).

use crate::common::{copy_dir, root};
use assert_cmd::Command;

fn bin() -> Command {
    Command::cargo_bin("lora-train").unwrap()
}

#[test]
fn tiny_recipe_trains_and_writes_a_peft_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let o = bin()
        .current_dir(root())
        .args(["--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", out.display()))
        .args([
            "--set",
            "train.max_steps=30",
            "--set",
            "output.save_every=20",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.starts_with("trained 30 steps"), "{stdout}");
    assert!(stderr.contains("35 truncated to seq_len 64"), "{stderr}");

    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["task_type"], "CAUSAL_LM");
    assert_eq!(cfg["r"], 8);
    assert_eq!(cfg["lora_alpha"], 16.0);
    assert_eq!(cfg["target_modules"].as_array().unwrap().len(), 7);
    let st = candle_core::safetensors::load(
        out.join("adapter_model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert_eq!(st.len(), 2 * 7 * 2);
    let a = &st["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"];
    let b = &st["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"];
    assert_eq!((a.dims(), b.dims()), (&[8, 176][..], &[64, 8][..]));
    assert_eq!(a.dtype(), candle_core::DType::F32);
    // PEFT reads the "format" metadata.
    let raw = std::fs::read(out.join("adapter_model.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&raw).unwrap();
    assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
    assert!(out
        .join("checkpoint-20/adapter_model.safetensors")
        .is_file());
    assert!(out.join("recipe.toml").is_file());

    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3, "log_every = 10");
    let loss = |i: usize| rows[i]["loss"].as_f64().unwrap();
    assert!(loss(2) < loss(0), "loss must fall: {rows:?}");
    for k in ["step", "lr", "grad_norm", "tok_per_s", "tokens"] {
        assert!(rows[0].get(k).is_some(), "metrics.jsonl lacks {k}");
    }
}

#[test]
fn train_subcommand_and_check_resolve_the_same_recipe() {
    // `train` (the subcommand itself) trains, and the recipe its run records is the one `check`
    // prints for the same command line.
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let sets = [
        format!("output.dir={}", out.display()),
        "train.max_steps=2".to_string(),
    ];
    let with_sets = |cmd: &str| {
        let mut c = bin();
        c.current_dir(root())
            .args([cmd, "--recipe", "recipes/tiny-cpu.toml"]);
        for s in &sets {
            c.args(["--set", s]);
        }
        c.output().unwrap()
    };
    let o = with_sets("train");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("trained 2 steps"));
    assert!(out.join("adapter_model.safetensors").is_file());
    let o = with_sets("check");
    assert!(o.status.success());
    let checked = String::from_utf8_lossy(&o.stdout).into_owned();
    let ran: toml::Table =
        toml::from_str(&std::fs::read_to_string(out.join("recipe.toml")).unwrap()).unwrap();
    let mut printed: toml::Table = toml::from_str(checked.split_once('\n').unwrap().1).unwrap();
    // `check` also writes out the defaults that follow from other fields; the rest is the same.
    for (section, key) in [
        ("data", "train_on"),
        ("output", "max_shard_size"),
        ("train", "offload_activations"),
    ] {
        let t = printed[section].as_table_mut().unwrap();
        assert!(t.remove(key).is_some(), "check writes out {section}.{key}");
    }
    assert_eq!(ran, printed);

    let o = bin()
        .current_dir(root())
        .args(["check", "--recipe", "recipes/tiny-cpu.toml"])
        .output()
        .unwrap();
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    // Defaults filled in, paths resolved against the recipe's directory.
    assert!(text.contains("eps = 0.00000001"), "{text}");
    assert!(
        text.starts_with("# output dir: adapters/tiny-cpu\n"),
        "{text}"
    );
    assert!(
        text.contains("path = \"recipes/assets/tiny-llama\""),
        "{text}"
    );
    // Defaults that depend on other fields are written out; unset fields say what unset means.
    for line in [
        "train_on = \"all\"\n",
        "offload_activations = true\n",
        "max_shard_size = \"5GB\"\n",
        "# max_memory = unset: the whole card\n",
        "# init_adapter = unset: new adapters",
    ] {
        assert!(text.contains(line), "check lacks {line:?}: {text}");
    }
    // What check prints is a recipe itself.
    let printed: toml::Table = toml::from_str(text.split_once('\n').unwrap().1).unwrap();
    assert_eq!(printed["data"]["train_on"].as_str(), Some("all"));
    // Every shipped recipe parses.
    for e in std::fs::read_dir(root().join("recipes")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let o = bin()
                .current_dir(root())
                .arg("check")
                .arg("--recipe")
                .arg(&p)
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "{}: {}",
                p.display(),
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
}

const BASE: &str = r#"[model]
path = "assets/tiny-llama"
[data]
train = "data/tiny-text.jsonl"
seq_len = 32
"#;

/// Runs the binary on BASE + `extra` with `sets`; returns (exit code, stderr with the
/// temporary directory written as [TMP]) and checks that no output directory appeared.
fn bad(extra: &str, sets: &[&str]) -> (i32, String) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for sub in ["assets", "data"] {
        copy_dir(&root().join("recipes").join(sub), &dir.join(sub));
    }
    std::fs::write(dir.join("bad.toml"), format!("{BASE}{extra}")).unwrap();
    let mut cmd = bin();
    cmd.current_dir(dir)
        .args(["--recipe", "bad.toml"])
        .args(["--set", "output.dir=out"]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let o = cmd.output().unwrap();
    assert!(
        !dir.join("out").exists(),
        "a failed recipe must write nothing"
    );
    let err = String::from_utf8_lossy(&o.stderr).replace(&dir.display().to_string(), "[TMP]");
    (o.status.code().unwrap_or(-1), err)
}

#[test]
fn bad_recipes_exit_2_with_the_file_the_key_and_the_fix() {
    let cases: &[(&str, &[&str], &str)] = &[
        (
            "[lora]\nrnak = 8\n",
            &[],
            "error: recipe bad.toml: TOML parse error at line 7, column 1
  |
7 | rnak = 8
  | ^^^^
unknown field `rnak`, expected one of `rank`, `alpha`, `dropout`, `targets`, `rslora`, `use_dora`, `init_adapter`
",
        ),
        (
            "[lora]\nrank = \"eight\"\n",
            &[],
            "error: recipe bad.toml: TOML parse error at line 7, column 8
  |
7 | rank = \"eight\"
  |        ^^^^^^^
invalid type: string \"eight\", expected usize
",
        ),
        ("[lora]\nrank = 0\n", &[], "error: recipe bad.toml: `lora.rank` must be at least 1\n"),
        (
            "",
            &["data.seq_len=0"],
            "error: recipe bad.toml: `data.seq_len` must be at least 2 (a token and the next one to predict)\n",
        ),
        (
            "",
            &["model.dtype=fp32"],
            "error: recipe bad.toml: with --set output.dir=out --set model.dtype=fp32: unknown variant `fp32`, expected one of `f32`, `bf16`, `f16`
  at: [model] dtype = \"fp32\"
",
        ),
        (
            "[lora]\ntargets = [\"q_proj\", \"qkv\"]\n",
            &[],
            "error: recipe bad.toml: `lora.targets` has unknown module \"qkv\"; allowed: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, qkv_proj, gate_up_proj, mlp.experts.gate_up_proj, mlp.experts.down_proj, or \"all-linear\"\n",
        ),
        ("", &["train.lr"], "error: --set train.lr: expected section.key=value\n"),
        ("", &["data.train=nope.jsonl"], "error: recipe bad.toml: `data.train` file nope.jsonl does not exist\n"),
        (
            "[parallel]\nstrategy = \"single\"\ndevices = [0, 1, 0]\n",
            &[],
            "error: recipe bad.toml: `parallel.devices` lists device 0 twice: list each device once, e.g. [0, 1]\n",
        ),
        (
            "[parallel]\nstrategy = \"ddp\"\ndevices = \"all\"\n",
            &[],
            "error: recipe bad.toml: `parallel.devices` = \"all\" needs model.device = \"cuda\": on the CPU list the virtual ranks, e.g. [0, 1]\n",
        ),
        (
            "[parallel]\nstrategy = \"single\"\ndevices = [0, 1]\n",
            &[],
            "error: recipe bad.toml: `parallel.devices` lists several devices but strategy is \"single\": use \"ddp\" or \"fsdp\", or list one device\n",
        ),
        (
            "[parallel]\nstrategy = \"fsdp\"\ndevices = [0, 1]\ntimeout_s = 0\n",
            &[],
            "error: recipe bad.toml: `parallel.timeout_s` must be at least 1 (seconds)\n",
        ),
        (
            "",
            &["model.device=cuda"],
            "error: recipe bad.toml: `model.device` = \"cuda\", but this binary was built without CUDA: install a CUDA build (NVIDIA driver >= 580, CUDA 13.0; docs/gpu.md): with a CUDA toolkit, `CUDA_COMPUTE_CAP=90 cargo install --locked --path . --features cuda` (90 H100/H200, 89 RTX 40xx, 86 RTX 30xx, 80 A100); without one, `bash scripts/build-cuda.sh`\n",
        ),
        (
            "[train]\nsample_every = 2\nsample_prompts = [\"hi\"]\n",
            &["model.quantize=nf4"],
            "error: recipe bad.toml: `train.sample_every` cannot sample from an NF4 base yet (model.quantize = \"nf4\"); set it to 0 and try the adapter after training with `lora-train generate --recipe`\n",
        ),
        (
            "",
            &["model.double_quant=false"],
            "error: recipe bad.toml: `model.double_quant` = false applies to model.quantize = \"nf4\" only: remove it\n",
        ),
        (
            "",
            &["model.quantize=int4"],
            "error: recipe bad.toml: with --set output.dir=out --set model.quantize=int4: unknown variant `int4`, expected `none` or `nf4`
  at: [model] quantize = \"int4\"
",
        ),
        (
            "[train]\nbetas = [0.9, 1.5]\n",
            &[],
            "error: recipe bad.toml: `train.betas` both betas must be in [0, 1)\n",
        ),
    ];
    for (extra, sets, want) in cases {
        let (code, err) = bad(extra, sets);
        assert_eq!(err, *want, "recipe extra {extra:?} sets {sets:?}");
        assert_eq!(code, 2, "{err}");
    }
}

#[test]
fn bad_data_names_the_file_and_line_and_exits_1() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("rows.jsonl");
    std::fs::write(
        &data,
        "{\"input_ids\": [1, 2, 3]}\n\n{\"input_ids\": [1, \"x\"]}\n",
    )
    .unwrap();
    let o = bin()
        .current_dir(root())
        .args([
            "--recipe",
            "recipes/tiny-cpu.toml",
            "--set",
            "data.format=tokens",
            "--set",
        ])
        .arg(format!("data.train={}", data.display()))
        .arg("--set")
        .arg(format!("output.dir={}", tmp.path().join("out").display()))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "{}:3: \"input_ids\" must hold non-negative integers",
            data.display()
        )),
        "{err}"
    );
}

#[test]
fn ddp_and_fsdp_recipes_train_on_cpu_ranks_and_write_a_complete_adapter() {
    for strategy in ["ddp", "fsdp"] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("run");
        let o = bin()
            .current_dir(root())
            .args(["--recipe", "recipes/tiny-cpu.toml", "--set"])
            .arg(format!("output.dir={}", out.display()))
            .args(["--set", "train.max_steps=4", "--set", "train.micro_batch=4"])
            .args(["--set", "output.save_every=2", "--set", "train.log_every=1"])
            .args(["--set", &format!("parallel.strategy={strategy}")])
            .args(["--set", "parallel.devices=[0, 1]"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{strategy}: {stderr}");
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            stdout.starts_with("trained 4 steps"),
            "{strategy}: {stdout}"
        );
        assert!(
            stderr.contains(&format!("{strategy} over 2 ranks (devices [0, 1])")),
            "{stderr}"
        );
        // Rank 0 alone logs: one metrics row per step, not two.
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 4, "{strategy}: {metrics}");
        assert!(out.join("checkpoint-2/adapter_model.safetensors").is_file());
        assert!(out.join("checkpoint-4/optimizer.safetensors").is_file());
        // The adapter is complete: every layer x 7 modules x (A, B) at full shape.
        let st = candle_core::safetensors::load(
            out.join("adapter_model.safetensors"),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(root().join("recipes/assets/tiny-llama/config.json")).unwrap(),
        )
        .unwrap();
        let (layers, c) = (
            cfg["num_hidden_layers"].as_u64().unwrap() as usize,
            cfg["hidden_size"].as_u64().unwrap() as usize,
        );
        assert_eq!(st.len(), layers * 7 * 2, "{strategy}");
        for l in 0..layers {
            let a =
                &st[&format!("base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight")];
            let b = &st[&format!("base_model.model.model.layers.{l}.mlp.down_proj.lora_B.weight")];
            assert_eq!(a.dims(), &[8, c], "{strategy}");
            assert_eq!(b.dims(), &[c, 8], "{strategy}");
            let moved = b
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(moved > 0.0, "{strategy}: layer {l} lora_B never trained");
        }
    }
}

/// The sweep's knobs on the bench (scripts/sweep.sh): dropout, rsLoRA, packed short examples,
/// eval and checkpoints every step run through the training loop's order, the line carries
/// them and the work they add (`work_flops_per_token`), and no checkpoint is left behind.
#[test]
fn bench_takes_the_sweeps_knobs_and_counts_their_work() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| -> serde_json::Value {
        let o = bin()
            .env("TMPDIR", tmp.path())
            .args(["bench", "--device", "cpu", "--shape", "tiny", "--seq", "32"])
            .args(["--micro-batch", "2", "--steps", "2", "--warmup", "1"])
            .args(extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{extra:?}: {stderr}");
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let plain = run(&["--tag", "plain"]);
    assert_eq!(plain["tag"], "plain");
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    assert!(f(&plain, "work_flops_per_token") > f(&plain, "flops_per_token"));
    let knobs = run(&[
        "--dropout",
        "0.1",
        "--rslora",
        "--pack-short",
        "4",
        "--eval-every",
        "1",
        "--save-every",
        "1",
        "--tag",
        "knobs",
    ]);
    assert_eq!(knobs["pack"], 4);
    assert_eq!(
        (knobs["eval_every"].clone(), knobs["save_every"].clone()),
        (1.into(), 1.into())
    );
    assert!(knobs["rslora"].as_bool().unwrap());
    assert!((f(&knobs, "dropout") - 0.1).abs() < 1e-6);
    // Eval forwards add work; packing's shorter attention takes some away.
    assert!(f(&knobs, "work_flops_per_token") > f(&plain, "work_flops_per_token"));
    assert_eq!(knobs["losses"].as_array().unwrap().len(), 3);
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(
        left.is_empty(),
        "the bench's checkpoints were left behind: {left:?}"
    );
    let e = bin()
        .args([
            "bench",
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--dropout",
            "1.0",
        ])
        .output()
        .unwrap();
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("the dropout rate is a number in [0, 1)"));
}

#[test]
fn bench_runs_ddp_and_fsdp_on_cpu_ranks() {
    for strategy in ["ddp", "fsdp"] {
        let o = bin()
            .args(["bench", "--device", "cpu", "--shape", "tiny", "--seq", "16"])
            .args([
                "--micro-batch",
                "1",
                "--grad-accum",
                "2",
                "--steps",
                "2",
                "--warmup",
                "1",
            ])
            .args(["--strategy", strategy, "--devices", "0,1", "--ckpt"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{strategy}: {stderr}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["strategy"], strategy);
        assert_eq!(v["world"], 2);
        assert_eq!(v["global_batch"], 4);
        assert_eq!(v["per_rank"].as_array().unwrap().len(), 2);
        let losses = v["losses"].as_array().unwrap();
        assert_eq!(losses.len(), 3, "{v}");
        // Random tokens over a 32000 vocabulary: the loss starts near ln 32000 = 10.37.
        let first = losses[0].as_f64().unwrap();
        assert!((first - 10.37).abs() < 0.3, "{first}");
    }
}

/// `bench --model DIR` times a checkpoint's own weights (what `train` would load) at its
/// config.json's shape, with the same JSON fields as a named shape.
#[test]
fn bench_times_a_checkpoint_at_its_own_shape() {
    let dir = root().join("recipes/assets/tiny-llama");
    let unix = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let started = unix();
    let o = bin()
        .arg("bench")
        .arg("--model")
        .arg(&dir)
        .args([
            "--device",
            "cpu",
            "--seq",
            "32",
            "--micro-batch",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let (c, l) = (
        cfg["hidden_size"].as_u64().unwrap(),
        cfg["num_hidden_layers"].as_u64().unwrap(),
    );
    // Adapters r16 on all 7 linears of every layer: at least r·(in + out) per linear.
    assert!(v["trainable_params"].as_u64().unwrap() >= l * 7 * 16 * 2 * c.min(64));
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["final_loss"].as_f64().unwrap().is_finite());
    // The timed window by wall time (scripts/energy.py reads the GPU's counters in it): inside
    // the run, and as long as its two steps.
    let w = &v["timed_unix_s"];
    let (t0, t1) = (w[0].as_f64().unwrap(), w[1].as_f64().unwrap());
    assert!(
        started <= t0 && t0 < t1 && t1 <= unix(),
        "{w} outside the run"
    );
    let step_s = v["step_s"].as_f64().unwrap();
    assert!(
        ((t1 - t0) / 2.0 - step_s).abs() < 1e-3,
        "{w} against step_s {step_s}"
    );
}
