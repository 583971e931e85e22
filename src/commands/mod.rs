//! The `lora-train` command line: one file a command, each parsing its flags into the
//! library's options and calling one library function.
//!
//! Exit codes: 0 done, 1 the run failed, 2 the recipe or the command line is wrong (a
//! RecipeError, a Usage error, or a ConfigError: a value of config.json / adapter_config.json
//! out of range or not fitting the tensors), 3 the memory plan says the run does not fit
//! (nothing loaded; --force overrides), 4 out of memory mid-run (the last complete checkpoint
//! is intact), 130 stopped by SIGINT / SIGTERM (or a run's closed stdout / stderr) with a
//! checkpoint saved (resumable; or while loading, nothing written; or with ranks stuck, the
//! last checkpoint named; an export: its unfinished output removed), 131 a second signal ended
//! it at once (the last complete checkpoint is intact). A closed stdout ends any other command
//! with 0, quietly (`util::out` says why).

mod bench;
mod check;
mod download;
mod export;
mod generate;
mod plan;
mod prepare;
mod probe;
mod report;
mod train;

use clap::{Parser, Subcommand};
use lora_train::model::ConfigError;
use lora_train::recipe::RecipeError;
use lora_train::run::DoesNotFit;
use lora_train::train::stop::{
    OutOfMemory, StoppedUnsaved, EXIT_DOES_NOT_FIT, EXIT_INTERRUPTED, EXIT_OUT_OF_MEMORY,
};
use std::process::ExitCode;

/// LoRA fine-tuning of Hugging Face Llama-family checkpoints, on the CPU or CUDA.
///
/// `lora-train --recipe X` is `lora-train train --recipe X`.
#[derive(Parser)]
#[command(
    name = "lora-train",
    version,
    args_conflicts_with_subcommands = true,
    after_help = "Examples:\n  lora-train --recipe recipes/tiny-cpu.toml\n  lora-train plan --recipe recipes/tiny-cpu.toml --gpus 4 --gpu-mem 24GiB"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    train: train::TrainArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Train LoRA adapters as a recipe says (the default command).
    Train(train::TrainArgs),
    /// Parse and check a recipe, print it resolved with every default, and exit.
    Check(check::CheckArgs),
    /// Time training steps on random weights of a named shape (no download); prints JSON with
    /// the fields of scripts/bench_peft.py.
    Bench(bench::BenchArgs),
    /// Tokenize a recipe's data into the tokenized cache ahead of a run (downloading the model
    /// and data it names), so that `train` maps it and starts at once.
    Prepare(prepare::PrepareArgs),
    /// Forecast device memory per rank (single / ddp / fsdp, checkpointing on and off) from
    /// config.json alone, and recommend a setting. `--shape` plans a `bench` shape instead.
    Plan(plan::PlanArgs),
    /// The smoke ramp: one full step at micro-batch 1 and seq 64, seq doubling to the recipe's
    /// seq_len, then micro-batch doubling, with the peak of each phase, to the first OOM
    /// (random token ids of the right shapes).
    Probe(probe::ProbeArgs),
    /// Download a Hub model (config, tokenizer, safetensors) into the Hugging Face cache and
    /// print its directory. Honours HF_HOME, HF_HUB_CACHE, HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE.
    Download(download::DownloadArgs),
    /// Merge a PEFT LoRA adapter into its base model and write the full weights
    /// (sharded safetensors, config and tokenizer files), loadable by transformers.
    Export(export::ExportArgs),
    /// Generate text from a base + adapter, a merged model or a recipe's output (--prompt, or
    /// --chat from stdin), streamed; `--bench` times decoding on random weights of a shape.
    Generate(Box<generate::GenerateArgs>),
    /// Draw a run's loss, eval loss, lr, tok/s and memory curves from its metrics.jsonl into
    /// one SVG and print a summary (steps, tokens, time, best eval, peak memory per rank).
    Report(report::ReportArgs),
}

/// Runs the command the line names.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Some(Command::Train(a)) => train::run(a),
        Some(Command::Check(a)) => check::run(a),
        Some(Command::Bench(a)) => bench::run(a),
        Some(Command::Plan(a)) => plan::run(a),
        Some(Command::Prepare(a)) => prepare::run(a),
        Some(Command::Probe(a)) => probe::run(a),
        Some(Command::Download(a)) => download::run(a),
        Some(Command::Export(a)) => export::run(a),
        Some(Command::Generate(a)) => generate::run(*a),
        Some(Command::Report(a)) => report::run(a),
        None => train::run(cli.train),
    }
}

/// Prints a failure's whole chain and maps it to the exit code. A command whose output could
/// not all be written to stdout (a full disk) fails too.
pub fn finish(res: anyhow::Result<()>) -> ExitCode {
    let res = res.and_then(|()| match lora_train::util::out::failure() {
        Some(why) => Err(anyhow::anyhow!(why)),
        None => Ok(()),
    });
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            lora_train::errln!("error: {e:#}");
            if e.downcast_ref::<RecipeError>().is_some()
                || e.downcast_ref::<Usage>().is_some()
                || e.downcast_ref::<ConfigError>().is_some()
            {
                ExitCode::from(2)
            } else if e.downcast_ref::<DoesNotFit>().is_some() {
                ExitCode::from(EXIT_DOES_NOT_FIT)
            } else if e.downcast_ref::<OutOfMemory>().is_some() {
                ExitCode::from(EXIT_OUT_OF_MEMORY)
            } else if e.downcast_ref::<StoppedUnsaved>().is_some() {
                ExitCode::from(EXIT_INTERRUPTED)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// The command line, parsed; clap's error for a common slip (`--set train.lr 1e-4`, a recipe
/// without `--recipe`) is followed by the line to type instead (exit 2).
pub fn parse() -> Cli {
    // Parsed as the OS gave the words (a path need not be UTF-8); read as text for the hint.
    let e = match Cli::try_parse_from(std::env::args_os()) {
        Ok(cli) => return cli,
        Err(e) => e,
    };
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    use clap::error::ErrorKind::{DisplayHelp, DisplayVersion};
    let fixed = slip_fixed(&args);
    if matches!(e.kind(), DisplayHelp | DisplayVersion) || fixed == args {
        e.exit()
    }
    let _ = e.print();
    let words: Vec<String> = fixed[1..].iter().map(|w| train::quote(w)).collect();
    lora_train::errln!("to run that, type: lora-train {}", words.join(" "));
    std::process::exit(2)
}

/// `args` with the common slips mended: `--set KEY VALUE` → `--set KEY=VALUE`, a bare
/// `*.toml` → `--recipe *.toml`.
fn slip_fixed(args: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        let value_of = |j: usize| args.get(j).filter(|v| !v.starts_with('-'));
        let after_flag = out
            .last()
            .is_some_and(|p| p.starts_with('-') && !p.contains('='));
        if a == "--set" && value_of(i + 1).is_some_and(|k| !k.contains('=')) {
            if let (Some(k), Some(v)) = (value_of(i + 1), value_of(i + 2)) {
                out.extend(["--set".to_string(), format!("{k}={v}")]);
                i += 3;
                continue;
            }
        }
        if i > 0 && a.ends_with(".toml") && !a.starts_with('-') && !after_flag {
            out.push("--recipe".into());
        }
        out.push(a.clone());
        i += 1;
    }
    out
}

/// A command line that cannot run as given (exit code 2, like clap's own errors).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// `--max-memory 24GiB`, `--max-shard-size 5GB`: a byte size.
fn parse_size(s: &str) -> Result<u64, String> {
    lora_train::util::parse_size(s).map_err(|m| m.trim_start_matches("= ").to_string())
}
