//! Merged export: base checkpoint + PEFT LoRA adapter → a plain Hugging Face checkpoint.
//!
//! For every adapted linear, W' = W + scale · B A, computed in f32 (W [out, in] cast up,
//! B [out, r], A [r, in]) and cast back to the output dtype; for a DoRA adapter (use_dora,
//! magnitude m [out]) W' = (m / ‖V‖_row) ⊙ V with V = W + scale · B A, rows scaled, as PEFT's
//! merge computes it (`ops::dora`); every other tensor is copied
//! unchanged under its HF name (or cast, when an output dtype is asked for). Tensors go into
//! shards of at most `max_shard_size` bytes in the base checkpoint's order, named as
//! transformers names them: one `model.safetensors`, or `model-0000i-of-0000N.safetensors`
//! plus `model.safetensors.index.json` {metadata.total_size, weight_map}. config.json
//! (its dtype updated when cast), generation_config.json and the tokenizer files are copied.
//!
//! A MoE's adapters on its expert parameters (PEFT's `target_parameters`) go into the experts
//! as the base stores them, fused or one by one: expert e's W_e + scale · B_e A_e
//! (`merge_experts`).
//!
//! A QLoRA adapter's base is NF4, and a merge goes into the weights it computed with:
//!
//! * a bitsandbytes 4-bit checkpoint (config.json's `quantization_config.quant_method =
//!   "bitsandbytes"`): each packed linear (`P.weight` u8 and its `.absmax`, `.quant_map`,
//!   `.nested_absmax`, `.nested_quant_map`, `.quant_state.bitsandbytes__nf4`) is read as NF4
//!   (`quant::bnb`), dequantized in f32 and written as a plain `P.weight` [out, in] in the
//!   output dtype: `--dtype`, else the checkpoint's own (config.json's `torch_dtype` / `dtype`,
//!   the dtype of its unquantized tensors and of the model transformers builds from it; else
//!   `bnb_4bit_compute_dtype`; else f32). The quant-state tensors are dropped.
//! * `MergeInto::Dequantized` on a full-precision base (an adapter trained with
//!   `model.quantize = "nf4"`): each decoder-layer linear (`model.layers.N.….<proj>.weight`,
//!   rank 2) is quantized to NF4 as training quantized it (`Nf4::quantize`, `double_quant`) and
//!   dequantized; the embedding, norms, biases and head are the base's.
//!
//! Either way the merged config.json has no `quantization_config` (transformers loads it as a
//! plain model) and says what the adapter went into: `"lora_train_merged_into":
//! "dequantized-nf4"`. A plain merge (no key) leaves config.json as it was, byte for byte, but
//! for its dtype when cast.
//!
//! The whole output is written into a temporary sibling directory and renamed into place at
//! the end, so a failure or a crash never leaves a half-written model directory.

use super::merge_experts as experts;
use super::{peft_key, read_adapter_config, CONFIG, WEIGHTS};
use crate::hub::ModelFiles;
use crate::lora::KNOWN_LINEAR;
use crate::ops::dora::row_norms;
use crate::quant::{bnb, Nf4};
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

/// The config.json key a merged model states what its adapter was merged into.
pub const MERGED_INTO_KEY: &str = "lora_train_merged_into";

/// What the adapter is merged into (`export --merge-into`, `[output] merge_into`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MergeInto {
    /// The base checkpoint's weights (a bitsandbytes 4-bit checkpoint's dequantized: its
    /// weights are NF4).
    #[default]
    Base,
    /// Each decoder-layer linear of the base quantized to NF4 and dequantized: the weights an
    /// adapter trained with `model.quantize = "nf4"` computed with.
    Dequantized,
}

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
    /// The base as it is, or its decoder linears through NF4 first.
    pub merge_into: MergeInto,
    /// NF4 double quant for `MergeInto::Dequantized` (`model.double_quant`); a bitsandbytes
    /// checkpoint's own setting applies to it instead. Default: true.
    pub double_quant: bool,
    /// The dtype training held the base in (the run's model dtype): NF4 weights are quantized
    /// from the base rounded to it, and dequantized values rounded to it, before the adapter
    /// is added. None: the output dtype, else each tensor's stored dtype (for quantizing) and
    /// f32 (for dequantized values).
    pub quantize_dtype: Option<Dtype>,
}

impl Default for MergeOptions {
    fn default() -> Self {
        MergeOptions {
            dtype: None,
            max_shard_size: 5_000_000_000,
            replace: false,
            merge_into: MergeInto::Base,
            double_quant: true,
            quantize_dtype: None,
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
    /// What the adapter went into: "base", or "dequantized-nf4" (config.json's
    /// `lora_train_merged_into`, which a plain merge does not write).
    pub merged_into: &'static str,
    /// Linears written dequantized from NF4 (read packed, or quantized here).
    pub dequantized: usize,
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

/// A dtype as config.json names it (float32, bfloat16, float16; None for others).
fn from_torch_name(name: &str) -> Option<StDtype> {
    match name.strip_prefix("torch.").unwrap_or(name) {
        "float32" => Some(StDtype::F32),
        "bfloat16" => Some(StDtype::BF16),
        "float16" => Some(StDtype::F16),
        _ => None,
    }
}

/// The dtype a bitsandbytes 4-bit checkpoint's linears are written in, without `--dtype`:
/// config.json's `torch_dtype` / `dtype` (that of its unquantized tensors), else
/// `quantization_config.bnb_4bit_compute_dtype`, else f32.
fn checkpoint_dtype(cfg: &Value) -> StDtype {
    let named = |v: Option<&Value>| v.and_then(Value::as_str).and_then(from_torch_name);
    named(cfg.get("torch_dtype"))
        .or_else(|| named(cfg.get("dtype")))
        .or_else(|| {
            named(
                cfg.get("quantization_config")
                    .and_then(|q| q.get("bnb_4bit_compute_dtype")),
            )
        })
        .unwrap_or(StDtype::F32)
}

/// A decoder-layer linear's weight (`model.layers.N.….<proj>.weight`), the tensors training
/// keeps in NF4 under `model.quantize = "nf4"`: not a MoE's experts (those stay as loaded).
fn is_decoder_linear(name: &str, shape: &[usize]) -> bool {
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return false;
    };
    if experts::is_tensor(name) {
        return false;
    }
    let Some((layer, rest)) = rest.split_once('.') else {
        return false;
    };
    let leaf = rest
        .strip_suffix(".weight")
        .and_then(|m| m.rsplit('.').next());
    !layer.is_empty()
        && layer.bytes().all(|b| b.is_ascii_digit())
        && leaf.is_some_and(|l| KNOWN_LINEAR.contains(&l))
        && shape.len() == 2
}

/// The weight's shape its bitsandbytes quant state records.
fn packed_shape(state: &[u8], name: &str) -> Result<Vec<usize>> {
    let v: Value = serde_json::from_slice(state)
        .with_context(|| format!("`{name}{}` is not the JSON bitsandbytes writes", bnb::STATE))?;
    serde_json::from_value(v.get("shape").cloned().unwrap_or(Value::Null))
        .with_context(|| format!("`{name}{}` has no shape (a list of sizes)", bnb::STATE))
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

/// A CPU tensor's elements as little-endian bytes (the in-memory bytes: the targets we build
/// for are little-endian: export.rs refuses to build for others).
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => bytemuck::cast_slice(&t.to_vec1::<f32>()?).to_vec(),
        DType::BF16 => bytemuck::cast_slice(&t.to_vec1::<half::bf16>()?).to_vec(),
        DType::F16 => bytemuck::cast_slice(&t.to_vec1::<half::f16>()?).to_vec(),
        DType::F64 => bytemuck::cast_slice(&t.to_vec1::<f64>()?).to_vec(),
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

/// Where a tensor of the merged model comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Src {
    /// The base tensor (cast when asked).
    Stored,
    /// A bitsandbytes 4-bit weight, dequantized.
    Packed,
    /// A full-precision decoder linear quantized to NF4 and dequantized.
    Requant,
}

/// One tensor of the merged model.
struct Item {
    name: String,
    shard: usize,
    shape: Vec<usize>,
    /// The dtype written.
    dtype: StDtype,
    /// Bytes written.
    size: u64,
    src: Src,
}

fn to_recipe_dtype(d: DType) -> Option<Dtype> {
    match d {
        DType::F32 => Some(Dtype::F32),
        DType::BF16 => Some(Dtype::Bf16),
        DType::F16 => Some(Dtype::F16),
        _ => None,
    }
}

/// An NF4 weight's values as an f32 CPU tensor of its shape: level · absmax in f32, rounded
/// to `held` first when given (the dtype training dequantized it to).
fn dequantized_tensor(q: &Nf4, held: Option<Dtype>) -> Result<Tensor> {
    let w = Tensor::from_vec(q.dequantize(), q.shape.as_slice(), &Device::Cpu)?;
    Ok(match held {
        Some(d) => w
            .to_dtype(candle_dtype(st_dtype(d)).unwrap_or(DType::F32))?
            .to_dtype(DType::F32)?,
        None => w,
    })
}

/// One adapted module's (A [r, in], B [out, r], DoRA's m [out]), f32.
struct Pair {
    a: Option<Tensor>,
    b: Option<Tensor>,
    m: Option<Tensor>,
}

/// Reads the adapter's tensors, grouped by module (HF name, e.g. model.layers.0.mlp.up_proj).
fn read_adapter_tensors(dir: &Path) -> Result<BTreeMap<String, Pair>> {
    let path = dir.join(WEIGHTS);
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut out: BTreeMap<String, Pair> = BTreeMap::new();
    for (key, t) in tensors {
        let name = key.replace(".default.weight", ".weight");
        let name = name.replace(".lora_magnitude_vector.weight", ".lora_magnitude_vector");
        let parsed = name.strip_prefix("base_model.model.").and_then(|m| {
            m.strip_suffix(".lora_A.weight")
                .map(|m| (m, 'A'))
                .or_else(|| m.strip_suffix(".lora_B.weight").map(|m| (m, 'B')))
                .or_else(|| m.strip_suffix(".lora_magnitude_vector").map(|m| (m, 'm')))
        });
        let Some((module, which)) = parsed else {
            bail!(
                "{}: tensor `{key}` is not a LoRA A/B weight or DoRA magnitude of a linear \
                 module (embedding adapters and modules_to_save are not supported)",
                path.display()
            );
        };
        super::adapter_check::tensor(&path, &key, &t)?;
        let t = t.to_dtype(DType::F32)?;
        let p = out.entry(module.to_string()).or_insert(Pair {
            a: None,
            b: None,
            m: None,
        });
        match which {
            'A' => p.a = Some(t),
            'B' => p.b = Some(t),
            _ => p.m = Some(t),
        }
    }
    if out.is_empty() {
        bail!("{} holds no LoRA tensors", path.display());
    }
    Ok(out)
}

/// A module's DoRA magnitude (`m` [out]) is there exactly when the config says use_dora.
fn check_magnitude(
    adapter: &Path,
    module: &str,
    m: Option<&Tensor>,
    dora: bool,
    out_f: usize,
) -> Result<()> {
    let (path, cfg) = (adapter.join(WEIGHTS), adapter.join(CONFIG));
    match (m, dora) {
        (None, false) => Ok(()),
        (Some(m), true) if m.dims() == [out_f] => Ok(()),
        (Some(m), true) => bail!(
            "{}: `{module}`'s lora_magnitude_vector has shape {:?}, its linear has {out_f} \
             outputs: the adapter is damaged or was trained on another model",
            path.display(),
            m.dims()
        ),
        (None, true) => bail!(
            "{} says use_dora = true, but {} has no lora_magnitude_vector for `{module}`: \
             the adapter is incomplete",
            cfg.display(),
            path.display()
        ),
        (Some(_), false) => bail!(
            "{} has a lora_magnitude_vector for `{module}`, but {} says use_dora = false: \
             set \"use_dora\": true there if this is a DoRA adapter",
            path.display(),
            cfg.display()
        ),
    }
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
    let ckpt = Base::open(base, &files, &maps)?;
    let items = ckpt.items(&maps, opts)?;
    let (adapted, slots) = check_adapter(adapter, &ckpt, &info, pairs, &items)?;
    let job = Job {
        ckpt: &ckpt,
        shards: shard_plan(&items, opts.max_shard_size),
        items,
        adapted,
        slots,
        scale: info.spec.scale(),
        opts,
    };
    write_dir(&crate::util::tmp_path(out), out, |tmp| job.write(tmp, out))
}

/// The base checkpoint as a merge reads it.
struct Base<'a> {
    dir: &'a Path,
    files: &'a ModelFiles,
    /// Every shard, parsed from its map.
    sts: Vec<SafeTensors<'a>>,
    /// A bitsandbytes 4-bit checkpoint: Some(its double quant); a full-precision one: None.
    packed: Option<bool>,
    /// The packed weights read through candle's map, as the loader reads them.
    packed_st: Option<candle_core::safetensors::MmapedSafetensors>,
    cfg_text: String,
    cfg: Value,
}

impl<'a> Base<'a> {
    fn open(dir: &'a Path, files: &'a ModelFiles, maps: &'a [memmap2::Mmap]) -> Result<Self> {
        let sts = maps
            .iter()
            .zip(&files.weights)
            .map(|(m, p)| {
                SafeTensors::deserialize(m)
                    .with_context(|| format!("{} is not a safetensors file", p.display()))
            })
            .collect::<Result<Vec<_>>>()?;
        let packed = bnb::nf4_config(&files.config)?;
        let cfg_text = std::fs::read_to_string(&files.config)
            .with_context(|| format!("cannot read {}", files.config.display()))?;
        let cfg: Value = serde_json::from_str(&cfg_text)
            .with_context(|| format!("{} is not valid JSON", files.config.display()))?;
        // SAFETY: as the maps above.
        let packed_st = match packed {
            Some(_) => {
                Some(unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files.weights) }?)
            }
            None => None,
        };
        Ok(Base {
            dir,
            files,
            sts,
            packed,
            packed_st,
            cfg_text,
            cfg,
        })
    }

    fn packed_st(&self) -> Result<&candle_core::safetensors::MmapedSafetensors> {
        self.packed_st.as_ref().context("no 4-bit checkpoint map")
    }

    /// Every tensor of the merged model in checkpoint order: its name, shard, shape, output
    /// dtype, bytes and where its values come from.
    fn items(&self, maps: &[memmap2::Mmap], opts: &MergeOptions) -> Result<Vec<Item>> {
        let names = maps
            .iter()
            .map(|m| Ok(SafeTensors::read_metadata(m)?.1.offset_keys()))
            .collect::<Result<Vec<_>>>()?;
        // Packed 4-bit weights: those with a quant state (in any shard: transformers may put a
        // weight and its quant tensors in different ones); their quant tensors are dropped.
        let mut packed = std::collections::HashSet::new();
        let mut dropped = std::collections::HashSet::new();
        if self.packed.is_some() {
            for w in names
                .iter()
                .flatten()
                .filter_map(|n| n.strip_suffix(bnb::STATE))
            {
                packed.insert(w.to_string());
                for s in [
                    bnb::STATE,
                    ".absmax",
                    ".quant_map",
                    ".nested_absmax",
                    ".nested_quant_map",
                ] {
                    dropped.insert(format!("{w}{s}"));
                }
            }
        }
        let requant = opts.merge_into == MergeInto::Dequantized;
        let mut items = Vec::new();
        let mut seen = HashMap::new();
        for (i, (st, names)) in self.sts.iter().zip(names).enumerate() {
            for name in names.into_iter().filter(|n| !dropped.contains(n)) {
                let v = st.tensor(&name)?;
                if let Some(prev) = seen.insert(name.clone(), i) {
                    bail!(
                        "tensor `{name}` is in both {} and {}",
                        self.files.weights[prev].display(),
                        self.files.weights[i].display()
                    );
                }
                let (src, shape, stored) = if packed.contains(&name) {
                    let state = self.packed_st()?.get(&format!("{name}{}", bnb::STATE))?;
                    let shape = packed_shape(state.data(), &name).with_context(|| {
                        format!("in the 4-bit checkpoint {}", self.dir.display())
                    })?;
                    (Src::Packed, shape, checkpoint_dtype(&self.cfg))
                } else {
                    let shape = v.shape().to_vec();
                    let float = candle_dtype(v.dtype()).is_some();
                    let src = match requant && float && is_decoder_linear(&name, &shape) {
                        true => Src::Requant,
                        false => Src::Stored,
                    };
                    (src, shape, v.dtype())
                };
                let dtype = match opts.dtype {
                    Some(d) if candle_dtype(stored).is_some() => st_dtype(d),
                    _ => stored,
                };
                items.push(Item {
                    size: n_bytes(&shape, dtype),
                    name,
                    shard: i,
                    shape,
                    dtype,
                    src,
                });
            }
        }
        Ok(items)
    }
}

/// A checked adapter, shaped for its merge (f32).
enum Adapter {
    /// A linear's A [r, in], B [out, r] and DoRA's m [out].
    Linear(Tensor, Tensor, Option<Tensor>),
    /// A MoE's expert parameter's A [E, r, in] and B [E, out, r] (`merge_experts`).
    Experts(Tensor, Tensor),
}

/// The adapters by module.
type Adapted = HashMap<String, Adapter>;

/// Every adapter module must match a base linear, shapes included; every targeted linear of
/// the base must have its adapter. With the adapters, each item's slot among the experts'
/// adapters (`merge_experts::slot`; None for any other tensor).
fn check_adapter(
    adapter: &Path,
    ckpt: &Base,
    info: &super::AdapterInfo,
    pairs: BTreeMap<String, Pair>,
    items: &[Item],
) -> Result<(Adapted, Vec<Option<experts::Slot>>)> {
    let base = ckpt.dir;
    let targets = &info.spec.targets;
    let file = adapter.join(WEIGHTS);
    let slots: Vec<Option<experts::Slot>> = items
        .iter()
        .map(|it| experts::slot(&it.name, &it.shape, targets))
        .collect();
    every_target_adapted(&file, base, targets, &pairs, items, &slots)?;
    let index: HashMap<&str, &Item> = items.iter().map(|it| (it.name.as_str(), it)).collect();
    let mut checked = HashMap::new();
    for (module, p) in pairs {
        let (Some(a), Some(b)) = (p.a, p.b) else {
            bail!(
                "{}: `{module}` has only one of lora_A / lora_B",
                file.display()
            );
        };
        if experts::is_module(&module) {
            if p.m.is_some() || info.spec.dora {
                bail!(
                    "{}: `{module}` is an adapter on expert parameters with DoRA's magnitude: \
                     PEFT's adapters on parameters take no DoRA",
                    file.display()
                );
            }
            let into: Vec<(&experts::Slot, &[usize])> = items
                .iter()
                .zip(&slots)
                .filter_map(|(it, s)| s.as_ref().map(|s| (s, it.shape.as_slice())))
                .filter(|(s, _)| s.module == module)
                .collect();
            let (a, b) = experts::shaped(&a, &b, info.spec.rank, &into).with_context(|| {
                format!(
                    "the adapter's `{module}` does not fit the experts of the base model in {}: \
                     the adapter was trained on another model",
                    base.display()
                )
            })?;
            checked.insert(module, Adapter::Experts(a, b));
            continue;
        }
        let wname = format!("{module}.weight");
        let Some(w) = index.get(wname.as_str()) else {
            bail!(
                "the adapter has `{}`, but the base model in {} has no tensor `{wname}`: \
                 the adapter was trained on another model",
                peft_key(&module, 'A'),
                base.display()
            );
        };
        let (r, in_f) = a.dims2()?;
        let (out_f, rb) = b.dims2()?;
        let leaf = module.rsplit('.').next().unwrap_or("");
        if !targets.iter().any(|t| t == leaf) {
            bail!(
                "{}: `{module}` is not among adapter_config.json's target_modules {targets:?}",
                file.display()
            );
        }
        if r != info.spec.rank || rb != r || w.shape != [out_f, in_f] {
            bail!(
                "the adapter's `{module}` (lora_A {:?}, lora_B {:?}, r = {}) does not fit the base \
                 weight `{wname}` {:?} in {}: the adapter was trained on another model",
                a.dims(),
                b.dims(),
                info.spec.rank,
                w.shape,
                base.display()
            );
        }
        check_magnitude(adapter, &module, p.m.as_ref(), info.spec.dora, out_f)?;
        if w.src == Src::Stored && candle_dtype(w.dtype).is_none() {
            bail!(
                "`{wname}` in {} is {}, not a float tensor",
                base.display(),
                w.dtype
            );
        }
        checked.insert(module, Adapter::Linear(a, b, p.m));
    }
    Ok((checked, slots))
}

/// Every base tensor an adapter targets has its lora_A / lora_B in `pairs` (the adapter's
/// `file`): each targeted linear of a decoder layer, and each expert parameter (`slots`,
/// item by item); an error naming the first that has none.
fn every_target_adapted(
    file: &Path,
    base: &Path,
    targets: &[String],
    pairs: &BTreeMap<String, Pair>,
    items: &[Item],
    slots: &[Option<experts::Slot>],
) -> Result<()> {
    for (it, slot) in items.iter().zip(slots) {
        let (module, what) = match slot {
            Some(s) => (s.module.as_str(), "the experts"),
            None => {
                let Some(module) = it.name.strip_suffix(".weight") else {
                    continue;
                };
                let leaf = module.rsplit('.').next().unwrap_or("");
                let linear = module.starts_with("model.layers.") && !experts::is_tensor(&it.name);
                if !linear || !targets.iter().any(|t| t == leaf) {
                    continue;
                }
                (module, leaf)
            }
        };
        if !pairs.contains_key(module) {
            bail!(
                "{}: no lora_A/lora_B for `{module}`, although adapter_config.json targets {what}: \
                 the adapter does not match the base model in {}",
                file.display(),
                base.display()
            );
        }
    }
    Ok(())
}

/// Shards of at most `max` bytes, greedy in checkpoint order (a larger tensor alone).
fn shard_plan(items: &[Item], max: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut used = 0u64;
    for (i, it) in items.iter().enumerate() {
        if shards.is_empty() || (used + it.size > max && used > 0) {
            shards.push(Vec::new());
            used = 0;
        }
        used += it.size;
        if let Some(s) = shards.last_mut() {
            s.push(i);
        }
    }
    shards
}

/// Writes the directory `dst` through `write` into `tmp` (emptied first, its parents made),
/// then renames it over `dst` (`replace_dir`); on any failure `tmp` is removed and `dst` left
/// as it was. The merge and the trainer's checkpoints write through here.
pub(crate) fn write_dir<T>(
    tmp: &Path,
    dst: &Path,
    write: impl FnOnce(&Path) -> Result<T>,
) -> Result<T> {
    let _ = std::fs::remove_dir_all(tmp);
    std::fs::create_dir_all(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let done = write(tmp).and_then(|r| replace_dir(tmp, dst).map(|()| r));
    if done.is_err() {
        let _ = std::fs::remove_dir_all(tmp);
    }
    done
}

/// A checked merge, ready to write.
struct Job<'a> {
    ckpt: &'a Base<'a>,
    items: Vec<Item>,
    adapted: Adapted,
    /// Per item, its slot among the experts' adapters (`check_adapter`).
    slots: Vec<Option<experts::Slot>>,
    shards: Vec<Vec<usize>>,
    scale: f64,
    opts: &'a MergeOptions,
}

impl Job<'_> {
    /// What the adapter goes into: "base" or "dequantized-nf4".
    fn merged_into(&self) -> &'static str {
        match self.ckpt.packed.is_some() || self.opts.merge_into == MergeInto::Dequantized {
            true => "dequantized-nf4",
            false => "base",
        }
    }

    fn shard_name(&self, k: usize) -> String {
        match self.shards.len() {
            1 => "model.safetensors".to_string(),
            n => format!("model-{:05}-of-{n:05}.safetensors", k + 1),
        }
    }

    /// The merged model into `tmp`: shards, index, config.json and the copied files.
    fn write(&self, tmp: &Path, out: &Path) -> Result<MergeReport> {
        let mut weight_map = BTreeMap::new();
        let (mut total_size, mut merged, mut dequantized) = (0u64, 0, 0);
        let bar = super::progress::ShardBar::new(self.shards.len());
        for (k, shard) in self.shards.iter().enumerate() {
            // Owned bytes for what we compute; views into the base maps for what we copy.
            let mut owned = HashMap::new();
            for &i in shard {
                let (bytes, m, d) = self.item_bytes(i)?;
                (merged, dequantized) = (merged + m as usize, dequantized + d as usize);
                if let Some(bytes) = bytes {
                    owned.insert(i, bytes);
                }
            }
            let mut views = Vec::with_capacity(shard.len());
            for &i in shard {
                let it = &self.items[i];
                let view = match owned.get(&i) {
                    Some(bytes) => TensorView::new(it.dtype, it.shape.clone(), bytes)?,
                    None => self.ckpt.sts[it.shard].tensor(&it.name)?,
                };
                total_size += it.size;
                weight_map.insert(it.name.clone(), self.shard_name(k));
                views.push((it.name.clone(), view));
            }
            let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
            let path = tmp.join(self.shard_name(k));
            safetensors::serialize_to_file(views, Some(meta), &path)
                .with_context(|| format!("cannot write {}", path.display()))?;
            bar.written(&path, shard.iter().map(|&i| self.items[i].size).sum());
        }
        let n = self.shards.len();
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
        std::fs::write(tmp.join("config.json"), self.config_out()?)?;
        // safetensors writes through a private temporary file (mode 0600): give the shards
        // the mode of an ordinary new file, as config.json has.
        let mode = std::fs::metadata(tmp.join("config.json"))?.permissions();
        for k in 0..n {
            std::fs::set_permissions(tmp.join(self.shard_name(k)), mode.clone())?;
        }
        for f in COPIED {
            let src = self.ckpt.dir.join(f);
            if src.is_file() {
                std::fs::copy(&src, tmp.join(f))
                    .with_context(|| format!("cannot copy {}", src.display()))?;
            }
        }
        sync_dir_files(tmp)?;
        Ok(MergeReport {
            out: out.to_owned(),
            tensors: self.items.len(),
            merged,
            shards: n,
            total_size,
            merged_into: self.merged_into(),
            dequantized,
        })
    }

    /// One tensor's bytes where they are not the base's stored ones (None: copied as is), and
    /// whether an adapter was merged into it and whether it was dequantized.
    fn item_bytes(&self, i: usize) -> Result<(Option<Vec<u8>>, bool, bool)> {
        let it = &self.items[i];
        let out_dtype = candle_dtype(it.dtype).unwrap_or(DType::F32);
        let stored = || self.ckpt.sts[it.shard].tensor(&it.name);
        let computed = self.computed(it)?;
        let dequantized = computed.is_some();
        let slot = self.slots.get(i).and_then(Option::as_ref);
        let module = match slot {
            Some(s) => s.module.as_str(),
            None => it.name.strip_suffix(".weight").unwrap_or(""),
        };
        if let Some(adapter) = self.adapted.get(module) {
            let w = match computed {
                Some(w) => w,
                None => view_tensor(&stored()?)?.to_dtype(DType::F32)?,
            };
            // W' = W + scale · B A in f32 (DoRA: rows scaled to m / ‖·‖), then the output dtype.
            let w = match (adapter, slot) {
                (Adapter::Linear(a, b, m), None) => {
                    let w = (w + (b.matmul(a)? * self.scale)?)?;
                    match m {
                        Some(m) => {
                            let g = crate::ops::dora::magnitude_scale(m, &row_norms(&w)?)?;
                            w.broadcast_mul(&g.unsqueeze(1)?)?
                        }
                        None => w,
                    }
                }
                (Adapter::Experts(a, b), Some(slot)) => {
                    (w + experts::delta(a, b, self.scale, slot)?)?
                }
                _ => bail!("`{}`: its adapter is not of its kind", it.name),
            };
            return Ok((
                Some(tensor_bytes(&w.to_dtype(out_dtype)?)?),
                true,
                dequantized,
            ));
        }
        let bytes = match computed {
            Some(w) => Some(tensor_bytes(&w.to_dtype(out_dtype)?)?),
            None => {
                let v = stored()?;
                match v.dtype() != it.dtype {
                    true => Some(tensor_bytes(&view_tensor(&v)?.to_dtype(out_dtype)?)?),
                    false => None,
                }
            }
        };
        Ok((bytes, false, dequantized))
    }

    /// A weight's values in f32 where they are not the stored ones: dequantized from the
    /// checkpoint's NF4, or the base quantized to NF4 and back.
    fn computed(&self, it: &Item) -> Result<Option<Tensor>> {
        let opts = self.opts;
        Ok(match it.src {
            Src::Stored => None,
            Src::Packed => {
                let q = bnb::read(self.ckpt.packed_st()?, &it.name, &it.shape)
                    .with_context(|| {
                        format!("in the 4-bit checkpoint {}", self.ckpt.dir.display())
                    })?
                    .with_context(|| format!("`{}` has no quant state", it.name))?;
                Some(dequantized_tensor(&q, opts.quantize_dtype)?)
            }
            Src::Requant => {
                let w = view_tensor(&self.ckpt.sts[it.shard].tensor(&it.name)?)?;
                // Quantized from the weight as training held it: in the run's dtype, else the
                // output's, else as stored.
                let held = opts
                    .quantize_dtype
                    .or(opts.dtype)
                    .or_else(|| to_recipe_dtype(w.dtype()));
                let d = held.map_or(DType::F32, |d| {
                    candle_dtype(st_dtype(d)).unwrap_or(DType::F32)
                });
                let host = w
                    .to_dtype(d)?
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let double_quant = self.ckpt.packed.unwrap_or(opts.double_quant);
                let q = Nf4::quantize(&host, &it.shape, double_quant);
                Some(dequantized_tensor(&q, held)?)
            }
        })
    }

    /// config.json: the base's bytes for a plain merge that casts nothing (a rewrite would
    /// reorder its keys and reformat its numbers); otherwise its dtype field naming the dtype
    /// written (when cast, or a 4-bit checkpoint's linears), and for a merge into NF4 weights
    /// no quantization_config and `lora_train_merged_into`.
    fn config_out(&self) -> Result<String> {
        let nf4 = self.merged_into() != "base";
        let written = match (self.opts.dtype, self.ckpt.packed) {
            (Some(d), _) => Some(st_dtype(d)),
            (None, Some(_)) => Some(checkpoint_dtype(&self.ckpt.cfg)),
            (None, None) => None,
        };
        if written.is_none() && !nf4 {
            return Ok(self.ckpt.cfg_text.clone());
        }
        let mut cfg = self.ckpt.cfg.clone();
        if let Some(o) = cfg.as_object_mut() {
            if let Some(d) = written {
                let mut keys: Vec<&str> = ["torch_dtype", "dtype"]
                    .into_iter()
                    .filter(|k| o.contains_key(*k))
                    .collect();
                if keys.is_empty() {
                    keys.push("torch_dtype");
                }
                for k in keys {
                    o.insert(k.to_string(), Value::from(torch_name(d)));
                }
            }
            if nf4 {
                o.remove("quantization_config");
                o.insert(MERGED_INTO_KEY.to_string(), Value::from(self.merged_into()));
            }
        }
        Ok(serde_json::to_string_pretty(&cfg)? + "\n")
    }
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
