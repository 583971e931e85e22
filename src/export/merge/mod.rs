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
//! (`experts`).
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
//!   rank 2) and each MoE expert's gate, up and down matrix (fused or one by one: expert by
//!   expert, `experts::requant`) is quantized to NF4 as training quantized it (`Nf4::quantize`,
//!   `double_quant`) and dequantized; the embedding, norms, biases, routers and head are the
//!   base's.
//!
//! Either way the merged config.json has no `quantization_config` (transformers loads it as a
//! plain model) and says what the adapter went into: `"lora_train_merged_into":
//! "dequantized-nf4"`. A plain merge (no key) leaves config.json as it was, byte for byte, but
//! for its dtype when cast.
//!
//! The whole output is written into a temporary sibling directory and renamed into place at
//! the end, so a failure or a crash never leaves a half-written model directory.

mod check;
mod dtype;
mod experts;
mod read;
mod write;

use super::{peft_key, read_adapter_config, CONFIG, WEIGHTS};
use crate::hub::ModelFiles;
use crate::ops::dora::row_norms;
use crate::quant::{bnb, Nf4};
use crate::recipe::Dtype;
use crate::recipe::KNOWN_LINEAR;
use crate::util::fs::write_dir;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use check::*;
use dtype::*;
use read::*;
use safetensors::tensor::TensorView;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use write::*;

pub use crate::recipe::{MergeInto, DEFAULT_MAX_SHARD_SIZE};

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
    /// The output directory.
    pub out: PathBuf,
    /// Tensors written, and how many of them got an adapter merged in.
    pub tensors: usize,
    /// Of them, those an adapter was merged into.
    pub merged: usize,
    /// Safetensors shards written.
    pub shards: usize,
    /// Bytes of tensor data (the index's metadata.total_size).
    pub total_size: u64,
    /// What the adapter went into: "base", or "dequantized-nf4" (config.json's
    /// `lora_train_merged_into`, which a plain merge does not write).
    pub merged_into: &'static str,
    /// Linears written dequantized from NF4 (read packed, or quantized here).
    pub dequantized: usize,
}

/// Merges the PEFT adapter in `adapter` into the checkpoint in `base`, writing `out`.
pub fn merge(adapter: &Path, base: &Path, out: &Path, opts: &MergeOptions) -> Result<MergeReport> {
    let info = read_adapter_config(adapter)?;
    check_unsupported(adapter)?;
    let files = ModelFiles::local(base)?;
    let cfg = crate::model::ModelConfig::from_file(&files.config)?;
    let pairs = read_adapter_tensors(adapter, &cfg)?;
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
    // Memory-map every base shard.
    let maps = files
        .weights
        .iter()
        .map(|p| {
            let f =
                std::fs::File::open(p).with_context(|| format!("cannot open {}", p.display()))?;
            // SAFETY: read-only maps of files we do not modify while they are mapped (the
            // output goes to another directory).
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

#[cfg(test)]
mod tests {
    use crate::util::parse_size;

    #[test]
    fn sizes_read_as_transformers_reads_them() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("500MB"), Ok(500_000_000));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5 kb"), Ok(1500));
        assert_eq!(parse_size("1000B"), Ok(1000));
        let e = parse_size("24").unwrap_err();
        assert!(
            e.contains("\"24\" has no unit: write e.g. \"24GiB\""),
            "{e}"
        );
        for bad in ["", "GB", "5XB", "-1GB", "0MB"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains("is not a size"), "{bad}: {e}");
        }
    }
}
