//! `lora-train export --adapter DIR --out DIR`: an adapter merged into its base, as a
//! transformers checkpoint (safetensors) or a llama.cpp GGUF file; or the adapter alone as a
//! llama.cpp LoRA GGUF (`--format gguf-lora`); `--ollama` adds a Modelfile.

use anyhow::Context;
use clap::{Args, ValueEnum};
use lora_train::export::gguf::{self, Quant};
use lora_train::export::merge::{merge, MergeInto, MergeOptions};
use lora_train::recipe::Dtype;
use std::path::PathBuf;

#[derive(Args, Clone)]
#[command(
    after_help = "Examples:\n  lora-train export --adapter adapters/tiny-cpu --out merged/\n  lora-train export --adapter adapters/tiny-cpu --format gguf --out tiny.gguf --quant q8_0 --ollama\n  lora-train export --adapter adapters/tiny-cpu --format gguf-lora --out tiny-lora.gguf\n  lora-train export --base recipes/assets/tiny-llama --format gguf --out base.gguf   # no adapter: the base as it is\n  lora-train export --adapter adapters/my --base /models/Llama-2-7b-hf --out merged/ --dtype bf16\n  lora-train export --adapter adapters/qlora --out merged/ --merge-into dequantized   # trained with model.quantize = \"nf4\""
)]
pub struct ExportArgs {
    /// The PEFT adapter directory (adapter_config.json + adapter_model.safetensors). Optional
    /// with --format gguf and --base: the base converted as it is.
    #[arg(long, required_unless_present = "base")]
    adapter: Option<PathBuf>,
    /// Where to write: the merged model's directory (must not exist or be empty), or the GGUF
    /// file (must not exist).
    #[arg(long)]
    out: PathBuf,
    /// What to write: a transformers checkpoint, llama.cpp's GGUF of the merged model, or the
    /// adapter alone as llama.cpp's LoRA GGUF (for `llama-cli --lora`, Ollama's ADAPTER).
    #[arg(long, value_enum, default_value = "safetensors")]
    format: Format,
    /// GGUF tensor type (llama.cpp's names; k-quant mixes as llama-quantize makes them).
    /// Default: f16 for gguf, f32 for gguf-lora.
    #[arg(long, value_enum)]
    quant: Option<QuantArg>,
    /// With a GGUF format: write an Ollama Modelfile beside the file (`ollama create NAME -f
    /// Modelfile`).
    #[arg(long)]
    ollama: bool,
    /// With --format gguf-lora --ollama: the Modelfile's FROM (the base model as a GGUF file or
    /// an Ollama model name).
    #[arg(long, value_name = "GGUF_OR_MODEL")]
    ollama_from: Option<String>,
    /// The base checkpoint directory. Default: the adapter's base_model_name_or_path, when
    /// that is a local directory.
    #[arg(long)]
    base: Option<PathBuf>,
    /// Dtype of the written weights. Default: each tensor's dtype in the base checkpoint.
    #[arg(long, value_enum)]
    dtype: Option<ExportDtype>,
    /// Largest shard, e.g. 5GB, 500MB, 2GiB.
    #[arg(long, default_value = lora_train::export::merge::DEFAULT_MAX_SHARD_SIZE, value_parser = super::parse_size)]
    max_shard_size: u64,
    /// What the adapter is merged into: the base's weights as they are (`base`; a bitsandbytes
    /// 4-bit checkpoint's are dequantized), or each decoder-layer linear of a full-precision
    /// base quantized to NF4 and dequantized (`dequantized`: the weights an adapter trained
    /// with model.quantize = "nf4" computed with).
    #[arg(long, value_enum, default_value = "base")]
    merge_into: MergeIntoArg,
    /// NF4 double quant for --merge-into dequantized (the recipe's model.double_quant).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    double_quant: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Safetensors,
    Gguf,
    GgufLora,
}

#[derive(Clone, Copy, ValueEnum)]
enum QuantArg {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_k_m")]
    Q4KM,
    #[value(name = "q5_k_m")]
    Q5KM,
    #[value(name = "q6_k")]
    Q6K,
}

impl QuantArg {
    fn quant(self) -> Quant {
        match self {
            QuantArg::F32 => Quant::F32,
            QuantArg::F16 => Quant::F16,
            QuantArg::Bf16 => Quant::Bf16,
            QuantArg::Q8_0 => Quant::Q8_0,
            QuantArg::Q4KM => Quant::Q4KM,
            QuantArg::Q5KM => Quant::Q5KM,
            QuantArg::Q6K => Quant::Q6K,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum MergeIntoArg {
    Base,
    Dequantized,
}

#[derive(Clone, Copy, ValueEnum)]
enum ExportDtype {
    F32,
    Bf16,
    F16,
}

pub fn run(a: ExportArgs) -> anyhow::Result<()> {
    if a.format != Format::Gguf && a.adapter.is_none() {
        return Err(super::Usage(
            "--adapter is needed (only --format gguf converts a --base alone)".into(),
        )
        .into());
    }
    if a.format == Format::Safetensors && (a.quant.is_some() || a.ollama) {
        return Err(
            super::Usage("--quant and --ollama go with --format gguf or gguf-lora".into()).into(),
        );
    }
    if let Some(ad) = a
        .adapter
        .as_ref()
        .filter(|d| !d.join(lora_train::export::CONFIG).is_file())
    {
        return Err(super::Usage(format!(
            "--adapter {}: no {} there (expected a PEFT adapter directory)",
            ad.display(),
            lora_train::export::CONFIG
        ))
        .into());
    }
    if let Some(b) = a.base.as_ref().filter(|b| !b.join("config.json").is_file()) {
        return Err(super::Usage(format!(
            "--base {}: no config.json there (expected a Hugging Face checkpoint directory)",
            b.display()
        ))
        .into());
    }
    let base = match (&a.base, &a.adapter) {
        (Some(b), _) => b.clone(),
        (None, Some(ad)) => {
            let info = lora_train::export::read_adapter_config(ad)?;
            lora_train::export::base_of(ad, &info)?
        }
        (None, None) => return Err(super::Usage("--adapter or --base is needed".into()).into()),
    };
    let opts = MergeOptions {
        dtype: a.dtype.map(|d| match d {
            ExportDtype::F32 => Dtype::F32,
            ExportDtype::Bf16 => Dtype::Bf16,
            ExportDtype::F16 => Dtype::F16,
        }),
        max_shard_size: a.max_shard_size,
        replace: false,
        merge_into: match a.merge_into {
            MergeIntoArg::Base => MergeInto::Base,
            MergeIntoArg::Dequantized => MergeInto::Dequantized,
        },
        double_quant: a.double_quant,
        quantize_dtype: None,
    };
    if a.format != Format::Safetensors {
        return run_gguf(&a, &base, &opts);
    }
    let Some(adapter) = a.adapter.as_ref() else {
        return Err(super::Usage("--adapter is needed".into()).into());
    };
    let packed = lora_train::quant::bnb::nf4_config(&base.join("config.json"));
    if opts.merge_into == MergeInto::Base && matches!(packed, Ok(None)) && trained_on_nf4(adapter) {
        eprintln!(
            "note: {}/recipe.toml trained on an NF4 base (model.quantize = \"nf4\"); \
             --merge-into dequantized merges into the weights it trained against",
            adapter.display()
        );
    }
    let r = merge(adapter, &base, &a.out, &opts)
        .with_context(|| format!("cannot merge {} into {}", adapter.display(), base.display()))?;
    let into = match r.merged_into {
        "base" => String::new(),
        _ => format!(" into the NF4 base dequantized ({} linears)", r.dequantized),
    };
    println!(
        "merged {} of {} tensors{into}; wrote {} ({} shard(s), {:.1} MB)",
        r.merged,
        r.tensors,
        r.out.display(),
        r.shards,
        r.total_size as f64 / 1e6
    );
    Ok(())
}

/// Whether the run that wrote the adapter (its `recipe.toml`, when it has one) kept its base in
/// NF4 (`[model] quantize = "nf4"`).
fn trained_on_nf4(adapter: &std::path::Path) -> bool {
    std::fs::read_to_string(adapter.join("recipe.toml"))
        .ok()
        .and_then(|t| t.parse::<toml::Table>().ok())
        .and_then(|t| {
            t.get("model")?
                .get("quantize")?
                .as_str()
                .map(|q| q == "nf4")
        })
        .unwrap_or(false)
}

/// `--format gguf` / `gguf-lora`: the GGUF file, then the Modelfile with --ollama.
fn run_gguf(a: &ExportArgs, base: &std::path::Path, opts: &MergeOptions) -> anyhow::Result<()> {
    let lora = a.format == Format::GgufLora;
    let q = a.quant.map(QuantArg::quant).unwrap_or(match lora {
        true => Quant::F32,
        false => Quant::F16,
    });
    let from = match (lora, a.ollama, &a.ollama_from) {
        (true, true, None) => {
            return Err(super::Usage(
                "--format gguf-lora --ollama needs --ollama-from (the base model: a GGUF file or an Ollama model name)".into(),
            )
            .into())
        }
        (_, _, f) => f.clone(),
    };
    let r = match (&a.adapter, lora) {
        (Some(ad), true) => gguf::lora::export(ad, base, &a.out, q),
        (Some(ad), false) => gguf::export_merged(ad, base, &a.out, q, opts),
        (None, _) => gguf::convert(base, &a.out, q, &gguf::dir_name(base)),
    }
    .with_context(|| format!("cannot write {}", a.out.display()))?;
    let types: Vec<String> = r.types.iter().map(|(t, n)| format!("{n} {t}")).collect();
    println!(
        "wrote {} ({}, {} tensors: {}, {:.1} MB)",
        r.out.display(),
        r.arch,
        r.tensors,
        types.join(", "),
        r.bytes as f64 / 1e6
    );
    if a.ollama {
        let file = format!(
            "./{}",
            a.out
                .file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default()
        );
        let text = match lora {
            true => gguf::modelfile::for_checkpoint(
                base,
                from.as_deref().unwrap_or_default(),
                Some(&file),
            ),
            false => gguf::modelfile::for_checkpoint(base, from.as_deref().unwrap_or(&file), None),
        }?;
        let dir = a
            .out
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new("."));
        let path = dir.join("Modelfile");
        if path.exists() {
            anyhow::bail!(
                "{} exists: remove it or write the GGUF elsewhere",
                path.display()
            );
        }
        lora_train::util::atomic_write(&path, text.as_bytes())?;
        println!(
            "wrote {} (ollama create NAME -f {})",
            path.display(),
            path.display()
        );
    }
    Ok(())
}
