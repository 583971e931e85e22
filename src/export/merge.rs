//! Merged export: base checkpoint + PEFT LoRA adapter → a plain Hugging Face checkpoint.
//!
//! For every adapted linear, W' = W + scale · B A, computed in f32 (W [out, in] cast up,
//! B [out, r], A [r, in]) and cast back to the output dtype; every other tensor is copied
//! unchanged under its HF name (or cast, when an output dtype is asked for). Tensors go into
//! shards of at most `max_shard_size` bytes in the base checkpoint's order, named as
//! transformers names them: one `model.safetensors`, or `model-0000i-of-0000N.safetensors`
//! plus `model.safetensors.index.json` {metadata.total_size, weight_map}. config.json
//! (its dtype updated when cast), generation_config.json and the tokenizer files are copied.
//!
//! The whole output is written into a temporary sibling directory and renamed into place at
//! the end, so a failure or a crash never leaves a half-written model directory.

use super::{peft_key, read_adapter_config, CONFIG, WEIGHTS};
use crate::hub::ModelFiles;
use crate::recipe::Dtype;
pub use crate::util::parse_size;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::TensorView;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// transformers' default `max_shard_size` for `save_pretrained` in 4.x.
pub const DEFAULT_MAX_SHARD_SIZE: &str = "5GB";

/// Files besides the weights that make a checkpoint usable; copied when the base has them.
const COPIED: [&str; 10] = [
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
];

/// How to write the merged model.
#[derive(Debug, Clone)]
pub struct MergeOptions {
    /// Output dtype of every floating-point tensor; None keeps each tensor's stored dtype.
    pub dtype: Option<Dtype>,
    /// Largest shard in bytes (a single larger tensor gets a shard of its own).
    pub max_shard_size: u64,
    /// Replace `out` when it exists (a run's own merged/ dir); otherwise an existing
    /// non-empty `out` is an error.
    pub replace: bool,
}

impl Default for MergeOptions {
    fn default() -> Self {
        MergeOptions {
            dtype: None,
            max_shard_size: 5_000_000_000,
            replace: false,
        }
    }
}

/// What a merge wrote.
#[derive(Debug, Clone)]
pub struct MergeReport {
    pub out: PathBuf,
    /// Tensors written, and how many of them got an adapter merged in.
    pub tensors: usize,
    pub merged: usize,
    pub shards: usize,
    /// Bytes of tensor data (the index's metadata.total_size).
    pub total_size: u64,
}

fn st_dtype(d: Dtype) -> StDtype {
    match d {
        Dtype::F32 => StDtype::F32,
        Dtype::Bf16 => StDtype::BF16,
        Dtype::F16 => StDtype::F16,
    }
}

fn candle_dtype(d: StDtype) -> Option<DType> {
    match d {
        StDtype::F32 => Some(DType::F32),
        StDtype::BF16 => Some(DType::BF16),
        StDtype::F16 => Some(DType::F16),
        StDtype::F64 => Some(DType::F64),
        _ => None,
    }
}

/// config.json's name for a dtype.
fn torch_name(d: StDtype) -> &'static str {
    match d {
        StDtype::BF16 => "bfloat16",
        StDtype::F16 => "float16",
        StDtype::F64 => "float64",
        _ => "float32",
    }
}

fn n_bytes(shape: &[usize], d: StDtype) -> u64 {
    shape.iter().product::<usize>() as u64 * (d.bitsize() / 8) as u64
}

/// A CPU tensor's elements as little-endian bytes.
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F64 => t
            .to_vec1::<f64>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        other => bail!("cannot write a {other:?} tensor"),
    })
}

fn view_tensor(v: &TensorView) -> Result<Tensor> {
    let d =
        candle_dtype(v.dtype()).with_context(|| format!("dtype {} is not a float", v.dtype()))?;
    Ok(Tensor::from_raw_buffer(
        v.data(),
        d,
        v.shape(),
        &Device::Cpu,
    )?)
}

/// One adapted module's (A [r, in], B [out, r]), f32.
struct Pair {
    a: Option<Tensor>,
    b: Option<Tensor>,
}

/// Reads the adapter's tensors, grouped by module (HF name, e.g. model.layers.0.mlp.up_proj).
fn read_adapter_tensors(dir: &Path) -> Result<BTreeMap<String, Pair>> {
    let path = dir.join(WEIGHTS);
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut out: BTreeMap<String, Pair> = BTreeMap::new();
    for (key, t) in tensors {
        let name = key.replace(".default.weight", ".weight");
        let parsed = name.strip_prefix("base_model.model.").and_then(|m| {
            m.strip_suffix(".lora_A.weight")
                .map(|m| (m, 'A'))
                .or_else(|| m.strip_suffix(".lora_B.weight").map(|m| (m, 'B')))
        });
        let Some((module, which)) = parsed else {
            bail!(
                "{}: tensor `{key}` is not a LoRA A/B weight of a linear module \
                 (embedding adapters, DoRA magnitudes and modules_to_save are not supported)",
                path.display()
            );
        };
        super::adapter_check::tensor(&path, &key, &t)?;
        let t = t.to_dtype(DType::F32)?;
        let p = out
            .entry(module.to_string())
            .or_insert(Pair { a: None, b: None });
        if which == 'A' {
            p.a = Some(t);
        } else {
            p.b = Some(t);
        }
    }
    if out.is_empty() {
        bail!("{} holds no LoRA tensors", path.display());
    }
    Ok(out)
}

/// adapter_config.json settings that change what a merge must do and that we do not do.
fn check_unsupported(dir: &Path) -> Result<()> {
    let path = dir.join(CONFIG);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let set = |k: &str| match v.get(k) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    };
    for (k, why) in [
        (
            "fan_in_fan_out",
            "weights stored transposed (Conv1D models)",
        ),
        ("modules_to_save", "fully trained extra modules"),
        ("layers_to_transform", "adapters on some layers only"),
        ("exclude_modules", "modules left out of target_modules"),
        ("layer_replication", "layers duplicated by the adapter"),
        ("lora_bias", "a bias on lora_B"),
        ("target_parameters", "adapters on parameters, not modules"),
        ("trainable_token_indices", "trained embedding rows"),
    ] {
        if set(k) {
            bail!(
                "{}: `{k}` is set ({why}); merging such adapters is not supported",
                path.display()
            );
        }
    }
    Ok(())
}

/// Merges the PEFT adapter in `adapter` into the checkpoint in `base`, writing `out`.
pub fn merge(adapter: &Path, base: &Path, out: &Path, opts: &MergeOptions) -> Result<MergeReport> {
    let info = read_adapter_config(adapter)?;
    check_unsupported(adapter)?;
    let scale = info.spec.scale();
    let pairs = read_adapter_tensors(adapter)?;
    let files = ModelFiles::local(base)?;
    if out.exists() && !opts.replace {
        let empty = std::fs::read_dir(out)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false);
        if !empty {
            bail!(
                "{} exists and is not empty: choose a new output directory or remove it",
                out.display()
            );
        }
    }

    // Memory-map every base shard. SAFETY: read-only maps of files we do not modify while
    // they are mapped (the output goes to another directory).
    let maps = files
        .weights
        .iter()
        .map(|p| {
            let f =
                std::fs::File::open(p).with_context(|| format!("cannot open {}", p.display()))?;
            unsafe { memmap2::Mmap::map(&f) }.with_context(|| format!("cannot map {}", p.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    let sts = maps
        .iter()
        .zip(&files.weights)
        .map(|(m, p)| {
            SafeTensors::deserialize(m)
                .with_context(|| format!("{} is not a safetensors file", p.display()))
        })
        .collect::<Result<Vec<_>>>()?;

    // Every base tensor in checkpoint order: (name, shard, output dtype, bytes out).
    struct Item {
        name: String,
        shard: usize,
        dtype: StDtype,
        size: u64,
    }
    let mut items = Vec::new();
    let mut seen = HashMap::new();
    for (i, st) in sts.iter().enumerate() {
        let (_, meta) = SafeTensors::read_metadata(&maps[i])?;
        for name in meta.offset_keys() {
            let v = st.tensor(&name)?;
            if let Some(prev) = seen.insert(name.clone(), i) {
                bail!(
                    "tensor `{name}` is in both {} and {}",
                    files.weights[prev].display(),
                    files.weights[i].display()
                );
            }
            let float = candle_dtype(v.dtype()).is_some();
            let dtype = match opts.dtype {
                Some(d) if float => st_dtype(d),
                _ => v.dtype(),
            };
            items.push(Item {
                size: n_bytes(v.shape(), dtype),
                name,
                shard: i,
                dtype,
            });
        }
    }

    // Every adapter module must match a base linear, shapes included; every targeted linear
    // of the base must have its adapter.
    let targets = &info.spec.targets;
    for it in &items {
        let Some(module) = it.name.strip_suffix(".weight") else {
            continue;
        };
        let leaf = module.rsplit('.').next().unwrap_or("");
        if module.starts_with("model.layers.")
            && targets.iter().any(|t| t == leaf)
            && !pairs.contains_key(module)
        {
            bail!(
                "{}: no lora_A/lora_B for `{module}`, although adapter_config.json targets {leaf}: \
                 the adapter does not match the base model in {}",
                adapter.join(WEIGHTS).display(),
                base.display()
            );
        }
    }
    let mut checked: HashMap<String, (Tensor, Tensor)> = HashMap::new();
    for (module, p) in pairs {
        let (Some(a), Some(b)) = (p.a, p.b) else {
            bail!(
                "{}: `{module}` has only one of lora_A / lora_B",
                adapter.join(WEIGHTS).display()
            );
        };
        let wname = format!("{module}.weight");
        let Some(&shard) = seen.get(&wname) else {
            bail!(
                "the adapter has `{}`, but the base model in {} has no tensor `{wname}`: \
                 the adapter was trained on another model",
                peft_key(&module, 'A'),
                base.display()
            );
        };
        let w = sts[shard].tensor(&wname)?;
        let (r, in_f) = a.dims2()?;
        let (out_f, rb) = b.dims2()?;
        let leaf = module.rsplit('.').next().unwrap_or("");
        if !targets.iter().any(|t| t == leaf) {
            bail!(
                "{}: `{module}` is not among adapter_config.json's target_modules {targets:?}",
                adapter.join(WEIGHTS).display()
            );
        }
        if r != info.spec.rank || rb != r || w.shape() != [out_f, in_f] {
            bail!(
                "the adapter's `{module}` (lora_A {:?}, lora_B {:?}, r = {}) does not fit the base \
                 weight `{wname}` {:?} in {}: the adapter was trained on another model",
                a.dims(),
                b.dims(),
                info.spec.rank,
                w.shape(),
                base.display()
            );
        }
        if candle_dtype(w.dtype()).is_none() {
            bail!(
                "`{wname}` in {} is {}, not a float tensor",
                base.display(),
                w.dtype()
            );
        }
        checked.insert(module, (a, b));
    }

    // Shards: greedy in checkpoint order.
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut used = 0u64;
    for (i, it) in items.iter().enumerate() {
        if shards.is_empty() || (used + it.size > opts.max_shard_size && used > 0) {
            shards.push(Vec::new());
            used = 0;
        }
        used += it.size;
        if let Some(s) = shards.last_mut() {
            s.push(i);
        }
    }
    let n = shards.len();
    let shard_name = |k: usize| {
        if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
        }
    };

    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    let tmp = crate::util::tmp_path(out);
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let res = (|| -> Result<MergeReport> {
        let mut weight_map = BTreeMap::new();
        let mut total_size = 0u64;
        let mut merged = 0;
        for (k, shard) in shards.iter().enumerate() {
            // Owned bytes for what we compute; views into the base maps for what we copy.
            let mut owned: Vec<(usize, Vec<u8>)> = Vec::new();
            for &i in shard {
                let it = &items[i];
                let v = sts[it.shard].tensor(&it.name)?;
                let module = it.name.strip_suffix(".weight").unwrap_or("");
                if let Some((a, b)) = checked.get(module) {
                    // W' = W + scale · B A in f32, then the output dtype.
                    let w = view_tensor(&v)?.to_dtype(DType::F32)?;
                    let delta = (b.matmul(a)? * scale)?;
                    let w = (w + delta)?;
                    let d = candle_dtype(it.dtype).unwrap_or(DType::F32);
                    owned.push((i, tensor_bytes(&w.to_dtype(d)?)?));
                    merged += 1;
                } else if v.dtype() != it.dtype {
                    let d = candle_dtype(it.dtype).unwrap_or(DType::F32);
                    owned.push((i, tensor_bytes(&view_tensor(&v)?.to_dtype(d)?)?));
                }
            }
            let owned: HashMap<usize, Vec<u8>> = owned.into_iter().collect();
            let mut views = Vec::with_capacity(shard.len());
            for &i in shard {
                let it = &items[i];
                let v = sts[it.shard].tensor(&it.name)?;
                let view = match owned.get(&i) {
                    Some(bytes) => TensorView::new(it.dtype, v.shape().to_vec(), bytes)?,
                    None => v,
                };
                total_size += it.size;
                weight_map.insert(it.name.clone(), shard_name(k));
                views.push((it.name.clone(), view));
            }
            let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
            let path = tmp.join(shard_name(k));
            safetensors::serialize_to_file(views, Some(meta), &path)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        if n > 1 {
            let index = json!({
                "metadata": {"total_size": total_size},
                "weight_map": weight_map,
            });
            std::fs::write(
                tmp.join("model.safetensors.index.json"),
                serde_json::to_string_pretty(&index)?,
            )?;
        }
        // config.json: as is, or with its dtype field naming the new dtype.
        let cfg_text = std::fs::read_to_string(&files.config)
            .with_context(|| format!("cannot read {}", files.config.display()))?;
        let cfg_out = match opts.dtype {
            None => cfg_text,
            Some(d) => {
                let mut cfg: Value = serde_json::from_str(&cfg_text)
                    .with_context(|| format!("{} is not valid JSON", files.config.display()))?;
                let name = torch_name(st_dtype(d));
                if let Some(o) = cfg.as_object_mut() {
                    let keys: Vec<&str> = ["torch_dtype", "dtype"]
                        .into_iter()
                        .filter(|k| o.contains_key(*k))
                        .collect();
                    for k in if keys.is_empty() {
                        vec!["torch_dtype"]
                    } else {
                        keys
                    } {
                        o.insert(k.to_string(), Value::from(name));
                    }
                }
                serde_json::to_string_pretty(&cfg)? + "\n"
            }
        };
        std::fs::write(tmp.join("config.json"), cfg_out)?;
        // safetensors writes through a private temporary file (mode 0600): give the shards
        // the mode of an ordinary new file, as config.json has.
        let mode = std::fs::metadata(tmp.join("config.json"))?.permissions();
        for k in 0..n {
            std::fs::set_permissions(tmp.join(shard_name(k)), mode.clone())?;
        }
        for f in COPIED {
            let src = base.join(f);
            if src.is_file() {
                std::fs::copy(&src, tmp.join(f))
                    .with_context(|| format!("cannot copy {}", src.display()))?;
            }
        }
        sync_dir_files(&tmp)?;
        Ok(MergeReport {
            out: out.to_owned(),
            tensors: items.len(),
            merged,
            shards: n,
            total_size,
        })
    })();
    let report = match res {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = replace_dir(&tmp, out) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok(report)
}

/// fsyncs every file in `dir`, then `dir` itself.
pub(crate) fn sync_dir_files(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_file() {
            std::fs::File::open(&p)?.sync_all()?;
        }
    }
    sync_dir(dir);
    Ok(())
}

/// fsyncs a directory's entry list (best effort: not every platform allows it).
pub(crate) fn sync_dir(dir: &Path) {
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

/// Puts the complete directory `tmp` at `dst`: a rename, after moving an existing `dst`
/// aside (and deleting it once the new one is in place). A crash leaves either the old or the
/// new directory at `dst`, or none, never a mix.
pub(crate) fn replace_dir(tmp: &Path, dst: &Path) -> Result<()> {
    let old = dst.with_file_name(format!(
        ".{}.old-{}",
        dst.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    let had_old = dst.exists();
    if had_old {
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(dst, &old)
            .with_context(|| format!("cannot move {} aside", dst.display()))?;
    }
    std::fs::rename(tmp, dst)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), dst.display()))?;
    if let Some(p) = dst.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(p);
    }
    if had_old {
        std::fs::remove_dir_all(&old)
            .with_context(|| format!("cannot remove {}", old.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_transformers_reads_them() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("500MB"), Ok(500_000_000));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5 kb"), Ok(1500));
        assert_eq!(parse_size("1000"), Ok(1000));
        for bad in ["", "GB", "5XB", "-1GB", "0MB"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains("is not a size"), "{bad}: {e}");
        }
    }
}
