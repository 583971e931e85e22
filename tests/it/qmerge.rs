//! The merged export of a QLoRA adapter: into a bitsandbytes 4-bit checkpoint (its packed
//! linears dequantized, the adapter added, the quant state dropped), and into a full-precision
//! base quantized to NF4 and dequantized (`--merge-into dequantized`), both against the numbers
//! they must be: bitsandbytes' own dequantized weights (golden.safetensors' `dequant.*`) and our
//! `Nf4` format's, plus scale · B · A.

use crate::common::Session;
use crate::common::*;
use assert_cmd::Command;
use candle_core::{DType, Device, Tensor};
use lora_train::export::merge::{merge, MergeInto, MergeOptions, MERGED_INTO_KEY};
use lora_train::hub::ModelFiles;
use lora_train::lora::LoraSpec;
use lora_train::model::Model;
use lora_train::quant::Nf4;
use lora_train::train::driver;
use std::collections::HashMap;
use std::path::Path;

const CASES: [&str; 2] = ["qlora_llama_gqa", "qlora_qwen2_bias"];

/// The fixtures' adapters: r = 4, lora_alpha = 8, no rsLoRA.
const SCALE: f64 = 2.0;

/// A checkpoint with no adapters.
fn plain(dir: &Path) -> Model {
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
        DType::F32,
        &Device::Cpu,
        &spec,
        0,
    )
    .unwrap()
}

fn config(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

/// W + scale · B · A for module `m` (`…weight` stripped), as the merge computes it in f32.
fn plus_delta(w: &Tensor, adapter: &HashMap<String, Tensor>, m: &str) -> Tensor {
    let a = &adapter[&format!("base_model.model.{m}.lora_A.weight")];
    let b = &adapter[&format!("base_model.model.{m}.lora_B.weight")];
    (w + (b.matmul(a).unwrap() * SCALE).unwrap()).unwrap()
}

/// Bit for bit.
fn assert_same(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let bad = host_f32(got)
        .iter()
        .zip(host_f32(want))
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        bad,
        0,
        "{what}: {bad} of {} values differ",
        got.elem_count()
    );
}

fn is_quant_state(name: &str) -> bool {
    [
        ".absmax",
        ".quant_map",
        ".nested_absmax",
        ".nested_quant_map",
        ".quant_state.bitsandbytes__nf4",
    ]
    .iter()
    .any(|s| name.ends_with(s))
}

/// Into a bitsandbytes 4-bit checkpoint: every linear is bitsandbytes' dequantized weight plus
/// scale · B · A exactly, every other tensor the checkpoint's, no quant state left, and a
/// config.json transformers loads as a plain model; its logits are the QLoRA model's.
#[test]
fn merging_into_a_bnb_4bit_checkpoint_adds_the_adapter_to_bitsandbytes_weights() {
    for case in CASES {
        let d = golden_dir(case);
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("merged");
        let base = d.join("model_bnb4");
        let rep = merge(
            &d.join("init_adapter"),
            &base,
            &out,
            &MergeOptions::default(),
        )
        .unwrap();
        let golden = load_st(&d.join("golden.safetensors"));
        let adapter = load_st(&d.join("init_adapter/adapter_model.safetensors"));
        let got = load_st(&out.join("model.safetensors"));
        let stored = load_st(&base.join("model.safetensors"));

        let linears: Vec<&str> = golden
            .keys()
            .filter_map(|k| k.strip_prefix("dequant."))
            .collect();
        assert_eq!(linears.len(), 7, "{case}");
        assert_eq!((rep.merged, rep.dequantized), (7, 7), "{case}");
        for name in &linears {
            let m = name.strip_suffix(".weight").unwrap();
            let want = plus_delta(&golden[&format!("dequant.{name}")], &adapter, m);
            assert_same(&format!("{case} {name}"), &got[*name], &want);
        }
        // The rest as stored; nothing of the quant state; nothing else.
        let mut want_names: Vec<&String> = stored.keys().filter(|k| !is_quant_state(k)).collect();
        let mut names: Vec<&String> = got.keys().collect();
        want_names.sort();
        names.sort();
        assert_eq!(names, want_names, "{case}");
        for (name, t) in &got {
            if !linears.contains(&name.as_str()) {
                assert_same(&format!("{case} {name}"), t, &stored[name]);
            }
        }
        let cfg = config(&out);
        assert!(cfg.get("quantization_config").is_none(), "{case}");
        assert_eq!(cfg[MERGED_INTO_KEY], "dequantized-nf4", "{case}");
        assert_eq!(cfg["dtype"], "float32", "{case}");
        assert_eq!(cfg["hidden_size"], config(&base)["hidden_size"]);
        assert_eq!(rep.merged_into, "dequantized-nf4");

        // A plain checkpoint to our loader, computing what the adapter on the 4-bit base does.
        let run = tmp.path().join("run");
        let set = format!("model.path={}", base.display());
        let r = recipe(tmp.path(), &golden_recipe(case, &run), &[&set]);
        let s = Session::new(r).unwrap();
        let batch = s.batch(&[vec![0], vec![1]]);
        let want = driver::logits(&s.model, &batch).unwrap();
        let m = plain(&out);
        assert!(m
            .layers
            .iter()
            .flat_map(|l| l.linears())
            .all(|l| l.q.is_none()));
        let got = driver::logits(&m, &batch).unwrap();
        assert_close(&format!("{case} merged logits"), &got, &want, 1e-5, 1e-6);
    }
}

/// `--merge-into dequantized` on the f32 base: each decoder linear is our NF4 quantize →
/// dequantize of the base's weight (double quant or not, as asked) plus scale · B · A exactly;
/// the embedding, norms, biases and head are the base's bit for bit. A plain merge of the same
/// adapter leaves config.json as it was.
#[test]
fn merging_into_the_dequantized_base_is_its_nf4_weights_plus_the_adapter() {
    for case in CASES {
        let d = golden_dir(case);
        let base = d.join("model");
        let stored = load_st(&base.join("model.safetensors"));
        let adapter = load_st(&d.join("init_adapter/adapter_model.safetensors"));
        let golden = load_st(&d.join("golden.safetensors"));
        for double_quant in [true, false] {
            let tmp = tempfile::tempdir().unwrap();
            let out = tmp.path().join("merged");
            let opts = MergeOptions {
                merge_into: MergeInto::Dequantized,
                double_quant,
                ..MergeOptions::default()
            };
            let rep = merge(&d.join("init_adapter"), &base, &out, &opts).unwrap();
            assert_eq!((rep.merged, rep.dequantized), (7, 7), "{case}");
            let got = load_st(&out.join("model.safetensors"));
            assert_eq!(got.len(), stored.len());
            let mut linears = 0;
            for (name, w) in &stored {
                let what = format!("{case} double_quant {double_quant} {name}");
                if !golden.contains_key(&format!("dequant.{name}")) {
                    assert_same(&what, &got[name], w);
                    continue;
                }
                linears += 1;
                let q = Nf4::quantize(&host_f32(w), w.dims(), double_quant);
                let dq = Tensor::from_vec(q.dequantize(), w.dims(), &Device::Cpu).unwrap();
                let m = name.strip_suffix(".weight").unwrap();
                assert_same(&what, &got[name], &plus_delta(&dq, &adapter, m));
                // It is NF4: bitsandbytes' weights to within its backends (tests/it/qlora.rs).
                let merged_bnb = plus_delta(&golden[&format!("dequant.{name}")], &adapter, m);
                if double_quant {
                    assert_rel_l2(&what, &got[name], &merged_bnb, 2e-3);
                }
            }
            assert_eq!(linears, 7);
            let cfg = config(&out);
            assert_eq!(cfg[MERGED_INTO_KEY], "dequantized-nf4");
            assert!(cfg.get("quantization_config").is_none());
        }
        // The plain merge says so too, and leaves the weights as they were.
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("merged");
        let rep = merge(
            &d.join("init_adapter"),
            &base,
            &out,
            &MergeOptions::default(),
        )
        .unwrap();
        assert_eq!(
            (rep.merged, rep.dequantized, rep.merged_into),
            (7, 0, "base")
        );
        assert_eq!(
            std::fs::read(out.join("config.json")).unwrap(),
            std::fs::read(base.join("config.json")).unwrap()
        );
    }
}

/// A sharded 4-bit checkpoint whose weights and quant states lie in different shards merges
/// as the single file does.
#[test]
fn a_sharded_4bit_checkpoint_merges_as_one_file_does() {
    let d = golden_dir("qlora_llama_gqa");
    let tmp = tempfile::tempdir().unwrap();
    let sharded = tmp.path().join("sharded");
    std::fs::create_dir(&sharded).unwrap();
    std::fs::copy(
        d.join("model_bnb4/config.json"),
        sharded.join("config.json"),
    )
    .unwrap();
    let st = load_st(&d.join("model_bnb4/model.safetensors"));
    // The packed codes in one shard, everything else (the quant states) in the other.
    let (first, second): (HashMap<_, _>, HashMap<_, _>) = st.into_iter().partition(|(k, t)| {
        k.starts_with("model.layers.") && k.ends_with(".weight") && t.dtype() == DType::U8
    });
    assert_eq!(first.len(), 7);
    let mut map = serde_json::Map::new();
    for (file, part) in [("a.safetensors", &first), ("b.safetensors", &second)] {
        candle_core::safetensors::save(part, sharded.join(file)).unwrap();
        for k in part.keys() {
            map.insert(k.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    let adapter = d.join("init_adapter");
    merge(
        &adapter,
        &d.join("model_bnb4"),
        &one,
        &MergeOptions::default(),
    )
    .unwrap();
    let rep = merge(&adapter, &sharded, &two, &MergeOptions::default()).unwrap();
    assert_eq!((rep.merged, rep.dequantized), (7, 7));
    let (a, b) = (
        load_st(&one.join("model.safetensors")),
        load_st(&two.join("model.safetensors")),
    );
    assert_eq!(a.len(), b.len());
    for (name, t) in &a {
        assert_same(name, &b[name], t);
    }
}

/// A 4-bit checkpoint missing part of a weight's quant state is an error naming it, and
/// writes nothing.
#[test]
fn a_damaged_4bit_checkpoint_is_a_clear_error() {
    let d = golden_dir("qlora_llama_gqa");
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(d.join("model_bnb4").join(f), bad.join(f)).unwrap();
    }
    let mut st = load_st(&d.join("model_bnb4/model.safetensors"));
    st.remove("model.layers.0.mlp.up_proj.weight.quant_map")
        .unwrap();
    candle_core::safetensors::save(&st, bad.join("model.safetensors")).unwrap();
    let out = tmp.path().join("out");
    let e = merge(
        &d.join("init_adapter"),
        &bad,
        &out,
        &MergeOptions::default(),
    )
    .unwrap_err();
    let e = format!("{e:#}");
    assert!(
        e.ends_with(
            "`model.layers.0.mlp.up_proj.weight.quant_map` is missing from the 4-bit checkpoint"
        ),
        "{e}"
    );
    assert!(!out.exists());
    let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(names.len(), 1, "no temporary directory is left");

    // A quant state that is not bitsandbytes' JSON.
    st.insert(
        "model.layers.0.mlp.up_proj.weight.quant_map".into(),
        load_st(&d.join("model_bnb4/model.safetensors"))
            ["model.layers.0.mlp.up_proj.weight.quant_map"]
            .clone(),
    );
    st.insert(
        "model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__nf4".into(),
        Tensor::new(b"{nope".as_slice(), &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&st, bad.join("model.safetensors")).unwrap();
    let e = merge(
        &d.join("init_adapter"),
        &bad,
        &out,
        &MergeOptions::default(),
    )
    .unwrap_err();
    let e = format!("{e:#}");
    assert!(
        e.contains("`model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__nf4` is not the JSON bitsandbytes writes"),
        "{e}"
    );
    assert!(!out.exists());
}

/// The CLI: `export --merge-into dequantized` writes what the library does and says so; a
/// 4-bit base merges with the default; a bad value is a usage error (exit 2) naming the
/// values; and training with `output.merge_into = "dequantized"` writes the same model as
/// exporting its adapter so (exporting it into the base as stored notes how it trained).
#[test]
fn export_merge_into_dequantized_through_the_cli() {
    let d = golden_dir("qlora_llama_gqa");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("cli");
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .arg("export")
        .arg("--adapter")
        .arg(d.join("init_adapter"))
        .arg("--base")
        .arg(d.join("model"))
        .arg("--out")
        .arg(&out)
        .args(["--merge-into", "dequantized"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        format!(
            "merged 7 of 12 tensors into the NF4 base dequantized (7 linears); wrote {} (1 shard(s), 0.2 MB)\n",
            out.display()
        )
    );
    let lib = tmp.path().join("lib");
    merge(
        &d.join("init_adapter"),
        &d.join("model"),
        &lib,
        &MergeOptions {
            merge_into: MergeInto::Dequantized,
            ..MergeOptions::default()
        },
    )
    .unwrap();
    for f in ["model.safetensors", "config.json", "generation_config.json"] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(lib.join(f)).unwrap(),
            "{f}"
        );
    }

    // The 4-bit checkpoint, merge-into left at its default.
    let out4 = tmp.path().join("cli4");
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .arg("export")
        .arg("--adapter")
        .arg(d.join("init_adapter"))
        .arg("--base")
        .arg(d.join("model_bnb4"))
        .arg("--out")
        .arg(&out4)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stdout)
            .starts_with("merged 7 of 12 tensors into the NF4 base dequantized (7 linears); "),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert_eq!(config(&out4)[MERGED_INTO_KEY], "dequantized-nf4");

    // A bad value.
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .arg("export")
        .arg("--adapter")
        .arg(d.join("init_adapter"))
        .arg("--out")
        .arg(tmp.path().join("x"))
        .args(["--merge-into", "nf4"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("invalid value 'nf4' for '--merge-into <MERGE_INTO>'")
            && err.contains("[possible values: base, dequantized]"),
        "{err}"
    );
    assert!(!tmp.path().join("x").exists());

    // Training on an NF4 base with the merge into it, then exporting its adapter the same way.
    let run = tmp.path().join("run");
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .current_dir(root())
        .args(["--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", run.display()))
        .args([
            "--set",
            "train.max_steps=2",
            "--set",
            "output.save_every=0",
            "--set",
            "model.quantize=nf4",
            "--set",
            "output.merge=true",
            "--set",
            "output.merge_into=dequantized",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("; into the NF4 base dequantized, 14 linears)"),
        "{err}"
    );
    // Exported into the base as stored, with a note that it trained on NF4.
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .current_dir(root())
        .arg("export")
        .arg("--adapter")
        .arg(&run)
        .arg("--out")
        .arg(tmp.path().join("as-stored"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("trained on an NF4 base (model.quantize = \"nf4\"); --merge-into dequantized merges into the weights it trained against"),
        "{err}"
    );
    let exported = tmp.path().join("exported");
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .current_dir(root())
        .arg("export")
        .arg("--adapter")
        .arg(&run)
        .arg("--out")
        .arg(&exported)
        .args(["--merge-into", "dequantized"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for f in ["model.safetensors", "config.json"] {
        assert_eq!(
            std::fs::read(exported.join(f)).unwrap(),
            std::fs::read(run.join("merged").join(f)).unwrap(),
            "{f}"
        );
    }
}
