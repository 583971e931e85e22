//! GGUF export: a merged model (or a base as it is) or an adapter alone, in llama.cpp's
//! format, written with candle's GGUF writer (`candle_core::quantized::gguf_file`).
//!
//! A model file is what llama.cpp's convert_hf_to_gguf.py writes for the same checkpoint:
//! its tensor names (`names`), q/k rows reordered for llama's rotary, norms and biases f32,
//! Gemma's norm gains stored as 1 + w, Qwen3-MoE's experts stacked [E, …], the family's
//! metadata keys (`meta`) and the tokenizer (`tokenizer`, `special`); the k-quant mixes are
//! llama-quantize's (`quant`). The adapter is merged first into a temporary sibling of the
//! output (`export::merge::merge`, the base's dtype), which is removed afterwards.
//! An adapter file is llama.cpp's LoRA GGUF (`lora`); `modelfile` writes an Ollama Modelfile.
//!
//! candle writes GGUF version 2 (llama.cpp and gguf-py read 2 and 3; the layout of a
//! little-endian file is the same) and holds every converted tensor in memory until the
//! file is written: the peak is about the output file's size.

pub mod lora;
pub(crate) mod meta;
pub mod modelfile;
pub(crate) mod names;
mod pre_hashes;
pub(crate) mod quant;
pub(crate) mod special;
mod spm;
pub(crate) mod tokenizer;

use crate::export::merge::{merge, MergeOptions};
use crate::hub::ModelFiles;
use crate::model::{Family, ModelConfig};
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use names::{Rotary, Target};
pub use quant::Quant;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A metadata key and its value.
pub(crate) type Kv = (String, Value);

/// What a GGUF export wrote.
#[derive(Debug, Clone)]
pub struct GgufReport {
    /// The file written.
    pub out: PathBuf,
    /// llama.cpp's architecture name.
    pub arch: String,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of the file.
    pub bytes: u64,
    /// How many tensors were written in each ggml type ("F16" → 201).
    pub types: BTreeMap<String, usize>,
}

/// Refuses an existing output: nothing a user made is replaced.
pub(crate) fn check_out(out: &Path) -> Result<()> {
    if out.exists() {
        bail!(
            "{} exists: choose a new output file or remove it",
            out.display()
        );
    }
    if out.file_name().is_none() {
        bail!("{}: not a file name", out.display());
    }
    Ok(())
}

/// A temporary directory beside `out` that is removed when dropped (only the one made here).
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The adapter in `adapter` merged into `base` (`opts`), written as GGUF at `out`.
pub fn export_merged(
    adapter: &Path,
    base: &Path,
    out: &Path,
    q: Quant,
    opts: &MergeOptions,
) -> Result<GgufReport> {
    check_out(out)?;
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = TempDir(out.with_file_name(format!(".{name}.merged-{}", std::process::id())));
    merge(adapter, base, &tmp.0, opts)?;
    let label = dir_name(adapter);
    convert(&tmp.0, out, q, &label)
}

/// The last component of a path, for `general.name`.
pub fn dir_name(p: &Path) -> String {
    std::fs::canonicalize(p)
        .ok()
        .as_deref()
        .unwrap_or(p)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// config.json of `dir`, read twice: resolved, and as written (convert_hf_to_gguf.py's keys
/// come from both).
pub(crate) fn read_config(dir: &Path) -> Result<(ModelConfig, serde_json::Value)> {
    let path = dir.join("config.json");
    let cfg = ModelConfig::from_file(&path)?;
    if cfg.family == Family::GptOss {
        bail!(
            "{}: GGUF export of gpt_oss is not implemented (attention sinks, biased experts)",
            path.display()
        );
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let raw = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    Ok((cfg, raw))
}

/// One tensor of the output, before its type is chosen.
struct Out {
    name: String,
    layer: Option<usize>,
    /// ggml's row order, any float dtype.
    t: Tensor,
}

/// The Hugging Face checkpoint in `dir` as a GGUF model file at `out` (`general.name` =
/// `label`).
pub fn convert(dir: &Path, out: &Path, q: Quant, label: &str) -> Result<GgufReport> {
    check_out(out)?;
    let (cfg, raw) = read_config(dir)?;
    let arch = names::arch_name(cfg.family);
    let files = ModelFiles::local(dir)?;
    // SAFETY: read-only maps of checkpoint files that this export does not modify.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files.weights) }
        .with_context(|| format!("cannot map the safetensors files of {}", dir.display()))?;
    let mut outs = extra_tensors(&cfg)?;
    outs.extend(checkpoint_tensors(dir, &cfg, &st)?);
    let tied = !outs.iter().any(|o| o.name == "output.weight");
    let mix = quant::Mix {
        quant: q,
        layers: cfg.num_layers,
        n_attn_v: outs
            .iter()
            .filter(|o| o.name.contains(".attn_v.weight") || o.name.contains(".attn_qkv.weight"))
            .count(),
        experts: cfg.arch.moe.map_or(0, |m| m.experts),
        tied,
    };
    let (tensors, sizes) = quantize_all(outs, &mix)?;
    let mut kv: Vec<Kv> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.type".into(), Value::String("model".into())),
    ];
    let gen = dir.join("generation_config.json");
    if gen.is_file() {
        let text = std::fs::read_to_string(&gen)
            .with_context(|| format!("cannot read {}", gen.display()))?;
        if let Ok(g) = serde_json::from_str(&text) {
            kv.extend(meta::sampling_keys(&g));
        }
    }
    kv.push(("general.name".into(), Value::String(label.into())));
    kv.push((
        "general.size_label".into(),
        Value::String(meta::size_label(&sizes)),
    ));
    kv.extend(meta::arch_keys(arch, &cfg, &raw, q.file_type()));
    kv.push((
        "general.quantization_version".into(),
        Value::U32(meta::QUANT_VERSION),
    ));
    kv.extend(tokenizer::keys(dir, cfg.family, cfg.vocab_size)?);
    write(out, arch, &kv, &tensors)
}

/// Quantizes every tensor under `mix`, with a progress bar; also each one's (name, element
/// count, experts) for the size label.
#[allow(clippy::type_complexity)]
fn quantize_all(
    outs: Vec<Out>,
    mix: &quant::Mix,
) -> Result<(Vec<(String, QTensor)>, Vec<(String, u64, Option<u64>)>)> {
    let bar = indicatif::ProgressBar::new(outs.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("{msg:>8} [{bar:40}] {pos}/{len} tensors")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(mix.quant.name());
    let mut v_seen = 0;
    let mut tensors = Vec::with_capacity(outs.len());
    let mut sizes = Vec::with_capacity(outs.len());
    for o in outs {
        let dims = o.t.dims().to_vec();
        let ncols = dims.last().copied().unwrap_or(1);
        let ty = quant::tensor_type(mix, &o.name, dims.len(), ncols, o.layer, v_seen);
        if o.name.contains(".attn_v.weight") || o.name.contains(".attn_qkv.weight") {
            v_seen += 1;
        }
        let qt = quant::quantize(&o.t, ty, mix.quant.k_mix())
            .with_context(|| format!("cannot write `{}` as {ty:?}", o.name))?;
        let experts = (dims.len() == 3).then(|| dims[0] as u64);
        sizes.push((o.name.clone(), o.t.elem_count() as u64, experts));
        tensors.push((o.name, qt));
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok((tensors, sizes))
}

/// The tensors convert_hf_to_gguf.py generates (before the checkpoint's): Llama 3.1's
/// `rope_freqs`, Phi-3's `rope_factors_long` / `_short`.
fn extra_tensors(cfg: &ModelConfig) -> Result<Vec<Out>> {
    let f32v = |name: &str, v: Vec<f32>| -> Result<Out> {
        let n = v.len();
        Ok(Out {
            name: name.into(),
            layer: None,
            t: Tensor::from_vec(v, n, &Device::Cpu)?,
        })
    };
    let mut out = Vec::new();
    if names::permutes_qk(cfg.family) {
        if let Some(f) = meta::llama3_rope_freqs(cfg) {
            out.push(f32v("rope_freqs.weight", f)?);
        }
    }
    if cfg.family == Family::Phi3 {
        if let Some((long, short)) = meta::phi3_rope_factors(cfg) {
            out.push(f32v("rope_factors_long.weight", long)?);
            out.push(f32v("rope_factors_short.weight", short)?);
        }
    }
    Ok(out)
}

/// The rows of `t` in llama.cpp's rotary order.
pub(crate) fn permute_rows(t: &Tensor, heads: usize) -> Result<Tensor> {
    let rows = t.dim(0)?;
    let order = names::rotary_rows(rows, heads).map_err(anyhow::Error::msg)?;
    let idx: Vec<u32> = order.iter().map(|&i| i as u32).collect();
    let idx = Tensor::from_vec(idx, rows, t.device())?;
    Ok(t.index_select(&idx, 0)?)
}

/// Sort key of a checkpoint name: embeddings, layers in order, then the rest.
fn order_key(name: &str) -> (usize, usize, String) {
    if name.starts_with("model.embed_tokens") {
        return (0, 0, name.into());
    }
    match name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(l, _)| l.parse::<usize>().ok())
    {
        Some(l) => (1, l, name.into()),
        None => (2, 0, name.into()),
    }
}

/// Every checkpoint tensor under its GGUF name, transformed as convert_hf_to_gguf.py
/// transforms it (f32 unless f16 or f32 already; rotary rows; Gemma's 1 + w; Gemma 3's
/// embedding cut to the tokenizer's size; experts stacked).
fn checkpoint_tensors(
    dir: &Path,
    cfg: &ModelConfig,
    st: &candle_core::safetensors::MmapedSafetensors,
) -> Result<Vec<Out>> {
    let mut hf: Vec<String> = st.tensors().into_iter().map(|(n, _)| n).collect();
    hf.sort_by_key(|n| order_key(n));
    let mut outs = Vec::new();
    // (gguf name) → experts' slices, filled as they come
    let mut experts: BTreeMap<String, (Option<usize>, Vec<Option<Tensor>>)> = BTreeMap::new();
    let n_exp = cfg.arch.moe.map_or(0, |m| m.experts);
    for name in &hf {
        let target = names::target(cfg.family, name).map_err(anyhow::Error::msg)?;
        if target == Target::Skip {
            continue;
        }
        let mut t = st.load(name, &Device::Cpu)?;
        if !matches!(t.dtype(), DType::F16 | DType::F32) {
            t = t.to_dtype(DType::F32)?;
        }
        if cfg.family.gemma() && name.ends_with("norm.weight") {
            t = (t + 1.0)?;
        }
        if cfg.family == Family::Gemma3 && name == "model.embed_tokens.weight" {
            let n = tokenizer_size(dir, cfg.vocab_size)?;
            if n < t.dim(0)? {
                t = t.narrow(0, 0, n)?;
            }
        }
        match target {
            Target::Skip => {}
            Target::One(m) => {
                let t = match m.rotary {
                    Rotary::None => t,
                    Rotary::Q => permute_rows(&t, cfg.num_heads)?,
                    Rotary::K => permute_rows(&t, cfg.num_kv_heads)?,
                };
                outs.push(Out {
                    name: m.name,
                    layer: m.layer,
                    t,
                });
            }
            Target::Experts(ms) => {
                // gate_up [E, 2I, C] → gate [E, I, C], up [E, I, C]; down as it is
                let parts = ms.len();
                let rows = t.dim(1)? / parts;
                for (i, m) in ms.into_iter().enumerate() {
                    outs.push(Out {
                        name: m.name,
                        layer: m.layer,
                        t: t.narrow(1, i * rows, rows)?.contiguous()?,
                    });
                }
            }
            Target::Expert { mapped, expert } => {
                if expert >= n_exp {
                    bail!("{name}: expert {expert} of {n_exp}");
                }
                let slot = experts
                    .entry(mapped.name.clone())
                    .or_insert_with(|| (mapped.layer, vec![None; n_exp]));
                slot.1[expert] = Some(t);
                if slot.1.iter().all(Option::is_some) {
                    let (layer, parts) = experts.remove(&mapped.name).unwrap_or_default();
                    let parts: Vec<Tensor> = parts.into_iter().flatten().collect();
                    outs.push(Out {
                        name: mapped.name,
                        layer,
                        t: Tensor::stack(&parts, 0)?,
                    });
                }
            }
        }
    }
    if let Some(name) = experts.keys().next() {
        bail!("{}: some experts of `{name}` are missing", dir.display());
    }
    Ok(outs)
}

/// Gemma 3's real vocabulary size (convert_hf_to_gguf.py cuts the embedding to it): the
/// SentencePiece vocabulary (config.json's vocab_size), else tokenizer.json's tokens.
fn tokenizer_size(dir: &Path, vocab_size: usize) -> Result<usize> {
    if dir.join("tokenizer.model").is_file() {
        return Ok(vocab_size);
    }
    let p = dir.join("tokenizer.json");
    let text =
        std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
    let t: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", p.display()))?;
    let n = |v: &serde_json::Value| match v {
        serde_json::Value::Object(m) => m.len(),
        serde_json::Value::Array(a) => a.len(),
        _ => 0,
    };
    Ok(n(&t["model"]["vocab"]) + n(&t["added_tokens"]))
}

/// Writes the GGUF file atomically (a temporary sibling, fsynced, renamed).
pub(crate) fn write(
    out: &Path,
    arch: &str,
    kv: &[Kv],
    tensors: &[(String, QTensor)],
) -> Result<GgufReport> {
    let tmp = crate::util::tmp_path(out);
    let res = (|| -> Result<u64> {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(&tmp)
                .with_context(|| format!("cannot create {}", tmp.display()))?,
        );
        let kv_refs: Vec<(&str, &Value)> = kv.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        gguf_file::write(&mut f, &kv_refs, &t_refs)?;
        let f = f.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        let bytes = f.metadata()?.len();
        std::fs::rename(&tmp, out)?;
        Ok(bytes)
    })();
    let bytes = match res {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.context(format!("cannot write {}", out.display())));
        }
    };
    let mut types = BTreeMap::new();
    for (_, t) in tensors {
        *types.entry(type_name(t.dtype()).to_string()).or_insert(0) += 1;
    }
    Ok(GgufReport {
        out: out.to_path_buf(),
        arch: arch.into(),
        tensors: tensors.len(),
        bytes,
        types,
    })
}

/// ggml's name of a type (F16, Q4_K, …).
pub fn type_name(t: GgmlDType) -> &'static str {
    match t {
        GgmlDType::F32 => "F32",
        GgmlDType::F16 => "F16",
        GgmlDType::BF16 => "BF16",
        GgmlDType::Q4_0 => "Q4_0",
        GgmlDType::Q4_1 => "Q4_1",
        GgmlDType::Q5_0 => "Q5_0",
        GgmlDType::Q5_1 => "Q5_1",
        GgmlDType::Q8_0 => "Q8_0",
        GgmlDType::Q8_1 => "Q8_1",
        GgmlDType::Q2K => "Q2_K",
        GgmlDType::Q3K => "Q3_K",
        GgmlDType::Q4K => "Q4_K",
        GgmlDType::Q5K => "Q5_K",
        GgmlDType::Q6K => "Q6_K",
        GgmlDType::Q8K => "Q8_K",
    }
}
