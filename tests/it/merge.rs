//! Merged export: the merged checkpoint's logits equal base + adapter logits; the output is a
//! transformers-layout checkpoint (shards, index, config, tokenizer) our own loader reads;
//! adapters that do not fit the base are clear errors that write nothing.

use crate::common::Session;
use crate::common::*;
use assert_cmd::Command;
use candle_core::{DType, Device, Tensor};
use lora_train::export::merge::{merge, MergeInto, MergeOptions};
use lora_train::hub::ModelFiles;
use lora_train::lora::LoraSpec;
use lora_train::model::Model;
use lora_train::recipe::Dtype;
use lora_train::train::driver;
use std::path::Path;

/// The base of a golden case (the model its init adapter was made for).
fn base_dir(case: &str) -> std::path::PathBuf {
    let d = golden_dir(case);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("meta.json")).unwrap()).unwrap();
    d.join(meta["model_dir"].as_str().unwrap())
}

/// A checkpoint with no adapters, as transformers would load it.
fn plain(dir: &Path, dtype: DType) -> Model {
    let spec = LoraSpec {
        rank: 1,
        alpha: 1.0,
        dropout: 0.0,
        rslora: false,
        dora: false,
        targets: vec![],
    };
    Model::load(
        &ModelFiles::local(dir).unwrap(),
        dtype,
        &Device::Cpu,
        &spec,
        0,
    )
    .unwrap()
}

fn opts(max: u64) -> MergeOptions {
    MergeOptions {
        max_shard_size: max,
        ..MergeOptions::default()
    }
}

#[test]
fn merged_logits_equal_base_plus_adapter_logits() {
    // Golden init adapters have B ≠ 0; the cases cover GQA + sharded base, a tied head with
    // rsLoRA, q/k/v bias, an explicit head_dim, and the tiny model we ship.
    for case in [
        "llama_gqa",
        "llama_mha_tied_rope3",
        "qwen2_bias",
        "mistral_head_dim",
        "tiny_shipped",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let r = recipe(tmp.path(), &golden_recipe(case, &tmp.path().join("o")), &[]);
        let s = Session::new(r).unwrap();
        let batch = s.batch(&[vec![0], vec![1]]);
        let want = driver::logits(&s.model, &batch).unwrap();

        let out = tmp.path().join("merged");
        let rep = merge(
            &golden_dir(case).join("init_adapter"),
            &base_dir(case),
            &out,
            &opts(40_000),
        )
        .unwrap();
        assert_eq!(rep.merged, s.model.adapters().count(), "{case}");
        let m = plain(&out, DType::F32);
        assert_eq!(m.tied, s.model.tied, "{case}: tied head stays tied");
        let got = driver::logits(&m, &batch).unwrap();
        assert_close(&format!("{case} merged logits"), &got, &want, 1e-5, 1e-6);
        // The adapter really changes the model: the base alone is far off.
        let base = driver::logits(&plain(&base_dir(case), DType::F32), &batch).unwrap();
        let d = max_abs_diff(&base, &want);
        assert!(d > 1e-3, "{case}: the adapter changes logits by only {d}");
    }
}

/// gpt-oss (issue 68): the adapters on the attention and on both expert parameters (stored x·W,
/// gate and up interleaved) merge into the experts as the base stores them, and the merged
/// model gives PEFT's logits on batch 0 (the golden's, transformers + PEFT over the init
/// adapter: scripts/reference_gpt_oss.py, scripts/reference_gpt_oss_mxfp4.py) within the
/// golden tolerance, and ours within 1e-5. From the MXFP4 checkpoint the experts are written
/// dequantized under their own names and config.json loses its quantization_config: what
/// transformers needs to load a plain gpt-oss.
#[test]
fn gpt_oss_adapters_merge_into_peft_s_logits() {
    for case in ["gpt_oss", "gpt_oss_mxfp4"] {
        let tmp = tempfile::tempdir().unwrap();
        let r = recipe(tmp.path(), &golden_recipe(case, &tmp.path().join("o")), &[]);
        let s = Session::new(r).unwrap();
        let batch = s.batch(&[vec![0], vec![1]]);
        let ours = driver::logits(&s.model, &batch).unwrap();
        let out = tmp.path().join("merged");
        let o = MergeOptions {
            dtype: Some(Dtype::F32),
            ..opts(10_000_000)
        };
        let rep = merge(
            &golden_dir(case).join("init_adapter"),
            &base_dir(case),
            &out,
            &o,
        );
        // 2 layers: q, k, v, o and the two fused expert parameters
        assert_eq!(rep.unwrap().merged, 2 * (4 + 2), "{case}");
        let got = driver::logits(&plain(&out, DType::F32), &batch).unwrap();
        let peft = &load_st(&golden_dir(case).join("golden.safetensors"))["logits"];
        assert_close(&format!("{case} merged vs PEFT"), &got, peft, 1e-4, 1e-6);
        assert_close(&format!("{case} merged vs ours"), &got, &ours, 1e-5, 1e-6);
        let base = driver::logits(&plain(&base_dir(case), DType::F32), &batch).unwrap();
        let d = max_abs_diff(&base, &ours);
        assert!(d > 1e-3, "{case}: the adapter changes logits by only {d}");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        assert!(cfg.get("quantization_config").is_none(), "{case}: {cfg}");
        let st = load_st(&out.join("model.safetensors"));
        let gu = &st["model.layers.1.mlp.experts.gate_up_proj"];
        let two_i = if case == "gpt_oss" { 48 } else { 64 };
        assert_eq!(gu.dims(), [8, 32, two_i], "{case}: [E, C, 2I] as stored");
        assert!(st
            .keys()
            .all(|k| !k.ends_with("_blocks") && !k.ends_with("_scales")));
        assert!(st.contains_key("model.layers.1.mlp.experts.gate_up_proj_bias"));
        // Trained on NF4 (model.quantize = "nf4"): merged into the dequantized experts and
        // attention (the MXFP4 ones dequantized first), the NF4 model's logits.
        let (_tq, q) = golden_session(case, &["model.quantize=nf4"]);
        let nf4 = driver::logits(&q.model, &batch).unwrap();
        let out = tmp.path().join("merged-nf4");
        let o = MergeOptions {
            merge_into: MergeInto::Dequantized,
            quantize_dtype: Some(Dtype::F32),
            ..o
        };
        let rep = merge(
            &golden_dir(case).join("init_adapter"),
            &base_dir(case),
            &out,
            &o,
        );
        assert_eq!(rep.unwrap().dequantized, 2 * (4 + 2), "{case}");
        let got = driver::logits(&plain(&out, DType::F32), &batch).unwrap();
        assert_close(
            &format!("{case} nf4 merged vs ours"),
            &got,
            &nf4,
            1e-5,
            1e-6,
        );
    }
}

/// The MoE's adapters on its experts (PEFT's `target_parameters`) merge into the experts as
/// the base stores them, one by one (the Hub's layout, the fixture's) or fused (transformers
/// 5's [E, 2I, C] and [E, C, I]), and the merged model keeps that layout.
#[test]
fn moe_expert_adapters_merge_into_either_layout() {
    let case = "qwen3_moe";
    let tmp = tempfile::tempdir().unwrap();
    let r = recipe(tmp.path(), &golden_recipe(case, &tmp.path().join("o")), &[]);
    let s = Session::new(r).unwrap();
    let batch = s.batch(&[vec![0], vec![1]]);
    let want = driver::logits(&s.model, &batch).unwrap();
    let fused = tmp.path().join("fused");
    fuse_experts(&base_dir(case), &fused, 2, 8);
    // 2 layers: 4 attention linears each, and 8 experts' gate, up and down (or 2 fused)
    for (layout, base, merged, name) in [
        (
            "one by one",
            base_dir(case),
            2 * (4 + 8 * 3),
            "experts.7.up_proj.weight",
        ),
        ("fused", fused, 2 * (4 + 2), "experts.gate_up_proj"),
    ] {
        let out = tmp
            .path()
            .join(format!("merged-{}", layout.replace(" ", "-")));
        let adapter = golden_dir(case).join("init_adapter");
        let rep = merge(&adapter, &base, &out, &opts(10_000_000)).unwrap();
        assert_eq!(rep.merged, merged, "{layout}");
        let st = load_st(&out.join("model.safetensors"));
        assert!(
            st.contains_key(&format!("model.layers.1.mlp.{name}")),
            "{layout}"
        );
        let got = driver::logits(&plain(&out, DType::F32), &batch).unwrap();
        assert_close(&format!("{layout}: merged logits"), &got, &want, 1e-5, 1e-6);
        let base = driver::logits(&plain(&base, DType::F32), &batch).unwrap();
        let d = max_abs_diff(&base, &want);
        assert!(d > 1e-3, "{layout}: the adapter changes logits by only {d}");
    }
    // Without its experts' adapters, the adapter no longer covers what its config targets.
    let bad = tmp.path().join("no-experts");
    copy_dir(&golden_dir(case).join("init_adapter"), &bad);
    let mut st = load_st(&bad.join("adapter_model.safetensors"));
    st.retain(|k, _| !k.contains("layers.1.mlp.experts.base_layer"));
    candle_core::safetensors::save(&st, bad.join("adapter_model.safetensors")).unwrap();
    let e = format!(
        "{:#}",
        merge(
            &bad,
            &base_dir(case),
            &tmp.path().join("x"),
            &opts(10_000_000)
        )
        .unwrap_err()
    );
    assert!(
        e.contains("no lora_A/lora_B for `model.layers.1.mlp.experts.base_layer`"),
        "{e}"
    );
    assert!(!tmp.path().join("x").exists());
}

/// `dir`'s MoE checkpoint with its experts fused as transformers 5 stores them: per layer
/// `mlp.experts.gate_up_proj` [E, 2I, C] (gate's rows first) and `mlp.experts.down_proj`
/// [E, C, I], into `out`.
fn fuse_experts(dir: &Path, out: &Path, layers: usize, experts: usize) {
    std::fs::create_dir_all(out).unwrap();
    std::fs::copy(dir.join("config.json"), out.join("config.json")).unwrap();
    let mut st = load_st(&dir.join("model.safetensors"));
    for l in 0..layers {
        let p = format!("model.layers.{l}.mlp.experts");
        let mut take = |e: usize, w: &str| st.remove(&format!("{p}.{e}.{w}.weight")).unwrap();
        let (mut gu, mut down) = (vec![], vec![]);
        for e in 0..experts {
            let (g, u) = (take(e, "gate_proj"), take(e, "up_proj"));
            gu.push(Tensor::cat(&[g, u], 0).unwrap());
            down.push(take(e, "down_proj"));
        }
        st.insert(format!("{p}.gate_up_proj"), Tensor::stack(&gu, 0).unwrap());
        st.insert(format!("{p}.down_proj"), Tensor::stack(&down, 0).unwrap());
    }
    candle_core::safetensors::save(&st, out.join("model.safetensors")).unwrap();
}

#[test]
fn merged_checkpoint_has_the_transformers_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let base = root().join("recipes/assets/tiny-llama");
    let adapter = golden_dir("tiny_shipped").join("init_adapter");
    let out = tmp.path().join("merged");
    let rep = merge(&adapter, &base, &out, &opts(200_000)).unwrap();
    let base_st = load_st(&base.join("model.safetensors"));
    assert_eq!((rep.tensors, rep.merged), (base_st.len(), 14));

    // Shards of at most 200 kB, named model-0000i-of-0000N, and an index covering them.
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), base_st.len());
    let n = rep.shards;
    assert!(n >= 4, "{n} shards");
    let mut total = 0u64;
    let mut merged = std::collections::HashMap::new();
    for k in 1..=n {
        let name = format!("model-{k:05}-of-{n:05}.safetensors");
        let path = out.join(&name);
        let st = load_st(&path);
        let data: u64 = st
            .values()
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum();
        assert!(data <= 200_000 || st.len() == 1, "{name}: {data} bytes");
        total += data;
        for (k2, t) in st {
            assert_eq!(map[&k2], name.as_str());
            merged.insert(k2, t);
        }
    }
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total));
    assert!(!out.join("model.safetensors").exists());
    // Tensors without an adapter are copied bit for bit; adapted ones are W + scale·B·A.
    let ad = load_st(&adapter.join("adapter_model.safetensors"));
    for (name, w) in &base_st {
        let got = &merged[name];
        let module = name.trim_end_matches(".weight");
        let a = ad.get(&format!("base_model.model.{module}.lora_A.weight"));
        match a {
            None => assert_close(name, got, w, 0.0, 0.0),
            Some(a) => {
                let b = &ad[&format!("base_model.model.{module}.lora_B.weight")];
                let want = (w + (b.matmul(a).unwrap() * 2.0).unwrap()).unwrap(); // 16 / 8
                assert_close(name, got, &want, 1e-6, 1e-7);
                let moved = (got - w).unwrap().abs().unwrap().max_all().unwrap();
                assert!(moved.to_scalar::<f32>().unwrap() > 0.0, "{name} unchanged");
            }
        }
    }
    // Everything else a checkpoint needs, copied as it was.
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(base.join(f)).unwrap(),
            "{f}"
        );
    }
    let names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["merged"], "no temporary directory is left");

    // bf16: one file under the default shard size, config says bfloat16, weights are the
    // f32 merge rounded once.
    let out16 = tmp.path().join("merged16");
    let rep = merge(
        &adapter,
        &base,
        &out16,
        &MergeOptions {
            dtype: Some(Dtype::Bf16),
            ..MergeOptions::default()
        },
    )
    .unwrap();
    assert_eq!(rep.shards, 1);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out16.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    assert_eq!(cfg["hidden_size"], 64);
    let st16 = load_st(&out16.join("model.safetensors"));
    for (name, t) in &st16 {
        assert_eq!(t.dtype(), DType::BF16, "{name}");
        let want = merged[name].to_dtype(DType::BF16).unwrap();
        let d = max_abs_diff(
            &t.to_dtype(DType::F32).unwrap(),
            &want.to_dtype(DType::F32).unwrap(),
        );
        // Equal, or one bf16 ulp apart where B·A's f32 sum rounds differently.
        let ulp = want
            .to_dtype(DType::F32)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            / 128.0;
        assert!(d <= ulp, "{name}: {d}");
    }
    // Our loader reads it in bf16 and in f32.
    plain(&out16, DType::BF16);
    plain(&out16, DType::F32);
}

#[test]
fn adapters_that_do_not_fit_the_base_are_clear_errors_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let gqa = golden_dir("llama_gqa").join("init_adapter");
    let err = |adapter: &Path, base: &Path| -> String {
        let e = merge(adapter, base, &out, &opts(1 << 30)).unwrap_err();
        let names: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n != "bad")
            .collect();
        assert!(names.is_empty(), "wrote {names:?}");
        format!("{e:#}")
    };

    // Another model: qwen2_bias has 1 kv head, so k_proj is [16, 64], not [32, 64]: the
    // shared check of an adapter against its base (export::adapter_check::against_base).
    let qwen = base_dir("qwen2_bias");
    let e = err(&gqa, &qwen);
    assert_eq!(
        e,
        format!(
            "{}: `base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight` has shape \
             [32, 4], but `k_proj` of the base (qwen2, 2 layers, hidden size 64) takes [16, r] \
             (64 inputs, 16 outputs): the adapter was trained on another model; use the base it \
             was trained on (its adapter_config.json's base_model_name_or_path)",
            gqa.join("adapter_model.safetensors").display()
        )
    );

    // A targeted module without its tensors.
    let bad = tmp.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::copy(
        gqa.join("adapter_config.json"),
        bad.join("adapter_config.json"),
    )
    .unwrap();
    let mut st = load_st(&gqa.join("adapter_model.safetensors"));
    for w in ['A', 'B'] {
        st.remove(&format!(
            "base_model.model.model.layers.1.mlp.up_proj.lora_{w}.weight"
        ));
    }
    candle_core::safetensors::save(&st, bad.join("adapter_model.safetensors")).unwrap();
    let e = err(&bad, &base_dir("llama_gqa"));
    assert!(
        e.contains(
            "adapter_model.safetensors: no lora_A/lora_B for `model.layers.1.mlp.up_proj`, although \
             adapter_config.json targets up_proj: the adapter does not match the base model in"
        ),
        "{e}"
    );

    // A module the base does not have (a third layer).
    let mut st = load_st(&gqa.join("adapter_model.safetensors"));
    let a = st["base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"].clone();
    st.insert(
        "base_model.model.model.layers.2.mlp.up_proj.lora_A.weight".into(),
        a.clone(),
    );
    st.insert(
        "base_model.model.model.layers.2.mlp.up_proj.lora_B.weight".into(),
        Tensor::zeros((96, 4), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&st, bad.join("adapter_model.safetensors")).unwrap();
    let e = err(&bad, &base_dir("llama_gqa"));
    assert!(
        e.ends_with(
            "adapter_model.safetensors: `base_model.model.model.layers.2.mlp.up_proj.lora_A.weight` \
             adapts layer 2, but the base (llama, 2 layers, hidden size 64) has layers 0 to 1: \
             the adapter was trained on another model; use the base it was trained on (its \
             adapter_config.json's base_model_name_or_path)"
        ),
        "{e}"
    );

    // Adapter features a merge must not silently drop.
    std::fs::copy(
        gqa.join("adapter_model.safetensors"),
        bad.join("adapter_model.safetensors"),
    )
    .unwrap();
    let cfg = std::fs::read_to_string(gqa.join("adapter_config.json")).unwrap();
    for (from, to, want) in [
        (
            "\"use_dora\": false",
            "\"use_dora\": true",
            "has no lora_magnitude_vector for `model.layers.0.mlp.down_proj`: the adapter is incomplete",
        ),
        (
            "\"modules_to_save\": null",
            "\"modules_to_save\": [\"lm_head\"]",
            "`modules_to_save` is set (fully trained extra modules); merging such adapters is not supported",
        ),
    ] {
        assert!(cfg.contains(from), "{from}");
        std::fs::write(bad.join("adapter_config.json"), cfg.replace(from, to)).unwrap();
        let e = err(&bad, &base_dir("llama_gqa"));
        assert!(e.ends_with(want), "{e}");
    }

    // An existing, non-empty output directory is not overwritten.
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "x").unwrap();
    let e = merge(&gqa, &base_dir("llama_gqa"), &out, &opts(1 << 30)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{} exists and is not empty: choose a new output directory or remove it",
            out.display()
        )
    );
    assert_eq!(std::fs::read_to_string(out.join("keep.txt")).unwrap(), "x");
}

#[test]
fn training_with_merge_and_the_export_command_write_the_same_model() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .current_dir(root())
        .args(["--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", out.display()))
        .args([
            "--set",
            "train.max_steps=4",
            "--set",
            "output.merge=true",
            "--set",
            "output.max_shard_size=300KB",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let merged = out.join("merged");
    assert!(
        err.contains(&format!(
            "merged model written to {} (21 tensors, 14 with the adapter merged in, 3 shard(s))",
            merged.display()
        )),
        "{err}"
    );

    // `export` with the base taken from adapter_config.json (recipes/assets/tiny-llama,
    // relative to the directory the run was started in).
    let out2 = tmp.path().join("exported");
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .current_dir(root())
        .arg("export")
        .arg("--adapter")
        .arg(&out)
        .arg("--out")
        .arg(&out2)
        .args(["--max-shard-size", "300KB"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        stdout,
        format!(
            "merged 14 of 21 tensors; wrote {} (3 shard(s), 0.6 MB)\n",
            out2.display()
        )
    );
    let mut files: Vec<String> = std::fs::read_dir(&out2)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "config.json",
            "generation_config.json",
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    for f in &files {
        assert_eq!(
            std::fs::read(out2.join(f)).unwrap(),
            std::fs::read(merged.join(f)).unwrap(),
            "{f}"
        );
    }

    // Command-line mistakes exit 2; a base that is not there exits 1, naming it.
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .args(["export", "--adapter", "a", "--out", "b", "--dtype", "fp8"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .arg("export")
        .arg("--adapter")
        .arg(golden_dir("llama_gqa").join("init_adapter"))
        .arg("--out")
        .arg(tmp.path().join("x"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.ends_with(
            "init_adapter/adapter_config.json: base_model_name_or_path = \"\" is not a local checkpoint directory: pass --base DIR\n"
        ),
        "{err}"
    );
    assert!(!tmp.path().join("x").exists());
}
