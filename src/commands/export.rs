//! `lora-train export --adapter DIR --out DIR`: an adapter merged into its base.

use anyhow::Context;
use clap::{Args, ValueEnum};
use lora_train::export::merge::{merge, MergeInto, MergeOptions};
use lora_train::recipe::Dtype;
use lora_train::train::stop::StopSignal;
use lora_train::util::lock::DirLock;
use lora_train::util::on_exit::{remove_on_exit, Registered};
use std::path::{Path, PathBuf};

#[derive(Args, Clone)]
#[command(
    after_help = "Examples:\n  lora-train export --adapter adapters/tiny-cpu --out merged/\n  lora-train export --adapter adapters/my --base /models/Llama-2-7b-hf --out merged/ --dtype bf16\n  lora-train export --adapter adapters/qlora --out merged/ --merge-into dequantized   # trained with model.quantize = \"nf4\""
)]
pub struct ExportArgs {
    /// The PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
    #[arg(long)]
    adapter: PathBuf,
    /// Where to write the merged model; must not exist or be empty.
    #[arg(long)]
    out: PathBuf,
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
    if !a.adapter.join(lora_train::export::CONFIG).is_file() {
        return Err(super::Usage(format!(
            "--adapter {}: no {} there (expected a PEFT adapter directory)",
            a.adapter.display(),
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
    let base = match a.base {
        Some(b) => b,
        None => {
            let info = lora_train::export::read_adapter_config(&a.adapter)?;
            lora_train::export::base_of(&a.adapter, &info)?
        }
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
    let packed = lora_train::quant::bnb::nf4_config(&base.join("config.json"));
    if opts.merge_into == MergeInto::Base
        && matches!(packed, Ok(None))
        && trained_on_nf4(&a.adapter)
    {
        lora_train::errln!(
            "note: {}/recipe.toml trained on an NF4 base (model.quantize = \"nf4\"); \
             --merge-into dequantized merges into the weights it trained against",
            a.adapter.display()
        );
    }
    let guard = OutGuard::take(&a.out)?;
    let r = merge(&a.adapter, &base, &a.out, &opts).with_context(|| {
        format!(
            "cannot merge {} into {}",
            a.adapter.display(),
            base.display()
        )
    });
    // A signal that removed the unfinished output made this fail: its exit (130) is the end.
    if r.is_err() {
        guard.signal.settle();
    }
    drop(guard);
    let r = r?;
    let into = match r.merged_into {
        "base" => String::new(),
        _ => format!(" into the NF4 base dequantized ({} linears)", r.dequantized),
    };
    lora_train::outln!(
        "merged {} of {} tensors{into}; wrote {} ({} shard(s), {:.1} MB)",
        r.merged,
        r.tensors,
        r.out.display(),
        r.shards,
        r.total_size as f64 / 1e6
    );
    Ok(())
}

/// What an export holds while it writes `--out`: its lock (a second export there refuses,
/// naming this pid), and signal handlers that remove its unfinished output
/// (`.<out>.tmp-<pid>`) and exit with 130.
struct OutGuard {
    _lock: DirLock,
    signal: StopSignal,
    _tmp: Registered,
}

impl OutGuard {
    fn take(out: &Path) -> anyhow::Result<OutGuard> {
        let lock = DirLock::try_dir(out, "lora-train export").context("--out")?;
        // What an export killed there left (its pid gone): ours to remove, under the lock.
        for p in lora_train::util::stale_temporaries(out) {
            std::fs::remove_dir_all(&p)
                .or_else(|_| std::fs::remove_file(&p))
                .with_context(|| format!("cannot remove {}", p.display()))?;
            lora_train::errln!(
                "removed {}, left by an export that did not finish",
                p.display()
            );
        }
        Ok(OutGuard {
            _lock: lock,
            signal: lora_train::train::stop::exit_on_signal()?,
            _tmp: remove_on_exit(&lora_train::util::tmp_path(out), true),
        })
    }
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
