//! The `lora-train` command line: thin commands over the library.

use clap::{Args, Parser, Subcommand, ValueEnum};
use lora_train::export::merge::{merge, MergeOptions};
use lora_train::recipe::{Dtype, Recipe, RecipeError};
use lora_train::train::stop::{
    DoesNotFit, Interrupted, OutOfMemory, EXIT_DOES_NOT_FIT, EXIT_INTERRUPTED, EXIT_OUT_OF_MEMORY,
};
use std::path::PathBuf;
use std::process::ExitCode;

/// LoRA fine-tuning of Hugging Face Llama-family checkpoints, on the CPU or CUDA.
///
/// `lora-train --recipe X` is `lora-train train --recipe X`.
#[derive(Parser)]
#[command(name = "lora-train", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Train LoRA adapters as a recipe says (the default command).
    Train(TrainArgs),
    /// Parse and check a recipe, print it resolved with every default, and exit.
    Check(TrainArgs),
    /// Time training steps on random weights of a named shape (no download); prints JSON with
    /// the fields of shared/bench/peft_baseline.py.
    Bench(BenchCli),
    /// Forecast device memory per rank (single / ddp / fsdp, checkpointing on and off) from
    /// config.json alone, and recommend a setting. `--shape` plans a `bench` shape instead.
    Plan(PlanCli),
    /// The smoke ramp: one full step at micro-batch 1 and seq 64, seq doubling to the recipe's
    /// seq_len, then micro-batch doubling, with the peak of each phase, to the first OOM
    /// (random token ids of the right shapes).
    Probe(ProbeCli),
    /// Download a Hub model (config, tokenizer, safetensors) into the Hugging Face cache and
    /// print its directory. Honours HF_HOME, HF_HUB_CACHE, HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE.
    Download(DownloadArgs),
    /// Merge a PEFT LoRA adapter into its base model and write the full weights
    /// (sharded safetensors, config and tokenizer files), loadable by transformers.
    Export(ExportArgs),
}

#[derive(Args, Clone)]
struct DownloadArgs {
    /// Hub repository id, e.g. meta-llama/Llama-3.2-1B.
    #[arg(value_parser = repo_id)]
    id: String,
    /// Branch, tag or commit.
    #[arg(long, default_value = lora_train::hub::DEFAULT_REVISION)]
    revision: String,
}

fn repo_id(s: &str) -> Result<String, String> {
    lora_train::hub::check_repo_id(s).map(|()| s.to_string())
}

#[derive(Args, Clone)]
struct ExportArgs {
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
    #[arg(long, default_value = lora_train::export::merge::DEFAULT_MAX_SHARD_SIZE, value_parser = parse_size)]
    max_shard_size: u64,
}

#[derive(Clone, Copy, ValueEnum)]
enum ExportDtype {
    F32,
    Bf16,
    F16,
}

fn parse_size(s: &str) -> Result<u64, String> {
    lora_train::export::merge::parse_size(s).map_err(|m| m.trim_start_matches("= ").to_string())
}

#[derive(Args, Clone)]
struct BenchCli {
    /// tiny | llama2-7b | llama2-13b | llama3-8b
    #[arg(long, default_value = "llama2-7b")]
    shape: String,
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    #[arg(long, default_value_t = 2)]
    micro_batch: usize,
    #[arg(long, default_value_t = 16)]
    rank: usize,
    /// Default: 2 × rank.
    #[arg(long)]
    alpha: Option<f64>,
    /// qv | attn | all
    #[arg(long, default_value = "all")]
    targets: String,
    /// Activation checkpointing.
    #[arg(long)]
    ckpt: bool,
    /// Park each layer's residual in host memory until its backward (true) or recompute it
    /// there (false), as the recipe's train.offload_activations (default: true; CUDA only).
    #[arg(long)]
    offload: Option<bool>,
    #[arg(long, default_value_t = 10)]
    steps: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// cpu | cuda (default: cuda in a CUDA build)
    #[arg(long)]
    device: Option<String>,
    /// CUDA ordinal (single).
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// single | ddp | fsdp (one thread per device, NCCL; CPU: virtual ranks).
    #[arg(long, default_value = "single", value_parser = ["single", "ddp", "fsdp"])]
    strategy: String,
    /// Devices for ddp / fsdp, e.g. 0,1 (default: --gpu).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
    /// Micro-batches per optimizer step (per rank).
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Dense bf16 matmul ceiling for MFU (790 measured on the H200 here).
    #[arg(long, default_value_t = 790.0)]
    peak_tflops: f64,
    /// Also append the JSON line to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Behave as a card of this size, e.g. 24GiB (CUDA: a ballast outside the pool).
    #[arg(long, value_parser = parse_size)]
    max_memory: Option<u64>,
}

#[derive(Args, Clone)]
struct PlanCli {
    /// The recipe (TOML); only its model's config.json is read.
    #[arg(long, short, conflicts_with = "shape")]
    recipe: Option<PathBuf>,
    /// Override a recipe field (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Plan a `bench` shape (tiny | llama2-7b | llama2-13b | llama3-8b; bf16) instead of a recipe.
    #[arg(long)]
    shape: Option<String>,
    /// Tokens per row (default: the recipe's data.seq_len; 2048 with --shape).
    #[arg(long)]
    seq: Option<usize>,
    /// Rows per micro-batch (default: the recipe's; 2 with --shape).
    #[arg(long)]
    micro_batch: Option<usize>,
    /// With --shape: LoRA rank.
    #[arg(long, default_value_t = 16)]
    rank: usize,
    /// With --shape: qv | attn | all.
    #[arg(long, default_value = "all")]
    targets: String,
    /// With --shape: the run's row uses activation checkpointing (the JSON's `selected`).
    #[arg(long)]
    ckpt: bool,
    /// GPUs for ddp / fsdp (default: the recipe's parallel.devices).
    #[arg(long)]
    gpus: Option<usize>,
    /// Memory per GPU, e.g. 24GiB (default: train.max_memory, else the free memory of the GPU
    /// in a CUDA build, else no fit column).
    #[arg(long, value_parser = parse_size)]
    gpu_mem: Option<u64>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Clone)]
struct ProbeCli {
    /// The recipe (TOML).
    #[arg(long, short)]
    recipe: PathBuf,
    /// Override a recipe field (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Stop doubling the micro-batch here.
    #[arg(long, default_value_t = 64)]
    max_micro_batch: usize,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Clone)]
struct TrainArgs {
    /// The recipe (TOML). See recipes/reference.toml for every field.
    #[arg(long, short)]
    recipe: Option<PathBuf>,
    /// Override a recipe field, e.g. --set train.lr=1e-4 --set lora.rank=8 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Start even when the memory plan says the run does not fit.
    #[arg(long)]
    force: bool,
}

/// Exit codes: 0 done, 1 the run failed, 2 the recipe or the command line is wrong,
/// 3 the memory plan says the run does not fit (nothing loaded; --force overrides),
/// 4 out of memory mid-run (the last complete checkpoint is intact),
/// 130 stopped by SIGINT / SIGTERM with a checkpoint saved (resumable), 131 a second signal
/// ended it at once (the last complete checkpoint is intact).
fn main() -> ExitCode {
    lora_train::parallel::prepare_process();
    let cli = Cli::parse();
    let res = match cli.command {
        Some(Command::Train(a)) => run("train", a),
        Some(Command::Check(a)) => run("check", a),
        Some(Command::Bench(b)) => bench(b),
        Some(Command::Plan(p)) => plan(p),
        Some(Command::Probe(p)) => probe(p),
        Some(Command::Download(d)) => download(d),
        Some(Command::Export(a)) => export(a),
        None => run("train", cli.train),
    };
    finish(res)
}

/// Prints a failure's whole chain and maps it to the exit code.
fn finish(res: anyhow::Result<()>) -> ExitCode {
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.downcast_ref::<RecipeError>().is_some() {
                ExitCode::from(2)
            } else if e.downcast_ref::<DoesNotFit>().is_some() {
                ExitCode::from(EXIT_DOES_NOT_FIT)
            } else if e.downcast_ref::<OutOfMemory>().is_some() {
                ExitCode::from(EXIT_OUT_OF_MEMORY)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

fn bench(b: BenchCli) -> anyhow::Result<()> {
    let device = match b.device.as_deref().unwrap_or(if cfg!(feature = "cuda") {
        "cuda"
    } else {
        "cpu"
    }) {
        "cpu" => candle_core::Device::Cpu,
        // The first listed GPU (rank 0's), not `--gpu`'s default, when --devices is given.
        "cuda" => candle_core::Device::new_cuda(b.devices.first().copied().unwrap_or(b.gpu))?,
        other => anyhow::bail!("--device {other}: expected cpu or cuda"),
    };
    let args = lora_train::bench::BenchArgs {
        shape: b.shape,
        seq: b.seq,
        micro_batch: b.micro_batch,
        rank: b.rank,
        alpha: b.alpha,
        targets: b.targets,
        ckpt: b.ckpt,
        offload: b.offload,
        steps: b.steps,
        warmup: b.warmup,
        device,
        peak_tflops: b.peak_tflops,
        strategy: match b.strategy.as_str() {
            "ddp" => lora_train::recipe::Strategy::Ddp,
            "fsdp" => lora_train::recipe::Strategy::Fsdp,
            _ => lora_train::recipe::Strategy::Single,
        },
        devices: if b.devices.is_empty() {
            vec![b.gpu]
        } else {
            b.devices
        },
        grad_accum: b.grad_accum,
        max_memory: b.max_memory,
    };
    let res = lora_train::bench::run(&args)?;
    println!("{res}");
    if let Some(p) = b.json {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)?;
        writeln!(f, "{res}")?;
    }
    Ok(())
}

fn plan(a: PlanCli) -> anyhow::Result<()> {
    use lora_train::memory::plan;
    use lora_train::recipe::Strategy;
    // The GPUs whose free memory bounds the plan: the recipe's parallel.devices, else (a
    // --shape plan, or devices = "all") GPU 0.
    let (input, grad_accum, selected, recipe_cap, gpus_used) = match (&a.shape, &a.recipe) {
        (Some(shape), _) => {
            let cfg = lora_train::bench::shape(shape)?;
            let flash_attention =
                lora_train::ops::flash::kernels_take(true, candle_core::DType::BF16, cfg.head_dim);
            let input = plan::PlanInput {
                tied: cfg.tie_word_embeddings.unwrap_or(false),
                cfg,
                dtype_bytes: 2,
                micro_batch: a.micro_batch.unwrap_or(2),
                seq_len: a.seq.unwrap_or(2048),
                rank: a.rank,
                targets: lora_train::bench::targets(&a.targets)?,
                gpus: a.gpus.unwrap_or(1).max(1),
                cuda: true,
                flash_attention,
                ce_kernel: lora_train::ops::cross_entropy::kernel_takes_for(
                    true,
                    candle_core::DType::BF16,
                ),
                offload: true,
                fold: lora_train::ops::fold::takes(true, candle_core::DType::BF16),
            };
            (input, 1, (Strategy::Single, a.ckpt), None, vec![0])
        }
        (None, Some(path)) => {
            let mut r = Recipe::load(path, &a.set)?;
            if let Some(s) = a.seq {
                r.data.seq_len = s;
            }
            if let Some(m) = a.micro_batch {
                r.train.micro_batch = m;
            }
            let cfg_path = lora_train::hub::config_file(&r.model)?;
            let cfg = lora_train::model::ModelConfig::from_file(&cfg_path)?;
            let gpus = a.gpus.unwrap_or(r.parallel.devices.len());
            let input = plan::input_from_recipe(&r, cfg, gpus, true)?;
            let sel = (r.parallel.strategy, r.train.activation_checkpointing);
            let used = match r.parallel.devices.is_empty() {
                true => vec![0],
                false => r.parallel.devices.clone(),
            };
            (input, r.train.grad_accum, sel, r.max_memory(), used)
        }
        (None, None) => {
            eprintln!("usage: lora-train plan --recipe RECIPE.toml | --shape NAME [--gpus N] [--gpu-mem 24GiB] [--json]");
            std::process::exit(2);
        }
    };
    let capacity = match a.gpu_mem.or(recipe_cap) {
        Some(c) => Some(c),
        None => free_gpu_memory(&gpus_used),
    };
    let p = plan::plan(&input, grad_accum, capacity);
    if a.json {
        println!("{}", plan::to_json(&p, selected));
    } else {
        print!("{}", plan::render(&p));
    }
    Ok(())
}

/// The least free memory of the GPUs `ordinals` in a CUDA build that has them all, plus the
/// context this process took to ask (the plan counts a context); None otherwise.
fn free_gpu_memory(ordinals: &[usize]) -> Option<u64> {
    if !cfg!(feature = "cuda") {
        return None;
    }
    let mut least: Option<u64> = None;
    for &o in ordinals {
        let dev = candle_core::Device::new_cuda(o).ok()?;
        let (free, _) = lora_train::memory::mem_info(&dev).ok().flatten()?;
        least = Some(least.map_or(free, |l| l.min(free)));
    }
    least.map(|f| f + lora_train::memory::plan::CONTEXT)
}

fn probe(a: ProbeCli) -> anyhow::Result<()> {
    let recipe = Recipe::load(&a.recipe, &a.set)?;
    let rep = lora_train::probe::run(&recipe, a.max_micro_batch)?;
    if a.json {
        println!("{}", rep.to_json());
    } else {
        print!("{}", rep.render());
    }
    Ok(())
}

fn download(a: DownloadArgs) -> anyhow::Result<()> {
    let files = lora_train::hub::download(&a.id, &a.revision)?;
    println!("{}", files.dir.display());
    Ok(())
}

fn run(cmd: &str, args: TrainArgs) -> anyhow::Result<()> {
    let Some(path) = args.recipe else {
        eprintln!("usage: lora-train --recipe RECIPE.toml [--set section.key=value ...]");
        std::process::exit(2);
    };
    let recipe = Recipe::load(&path, &args.set)?;
    if cmd == "check" {
        println!("# output dir: {}", recipe.output_dir().display());
        print!("{}", recipe.to_toml());
        return Ok(());
    }
    let opts = lora_train::train::RunOptions { force: args.force };
    let res = lora_train::train::run_with(recipe, &opts);
    if let Err(e) = &res {
        if let Some(i) = e.downcast_ref::<Interrupted>() {
            // The exact command that continues this run.
            let mut cmd = vec![
                "lora-train".to_string(),
                "--recipe".into(),
                quote(&path.to_string_lossy()),
            ];
            for s in args
                .set
                .iter()
                .filter(|s| !s.trim_start().starts_with("train.resume"))
            {
                cmd.push("--set".into());
                cmd.push(quote(s));
            }
            cmd.extend(["--set".into(), "train.resume=true".into()]);
            eprintln!("{i}\nresume with: {}", cmd.join(" "));
            std::process::exit(EXIT_INTERRUPTED.into());
        }
    }
    let s = res?;
    let last = s.losses.last().copied().unwrap_or(f64::NAN);
    let first = s.losses.first().copied().unwrap_or(f64::NAN);
    println!(
        "trained {} steps in {:.1}s ({:.0} tok/s): loss {first:.4} -> {last:.4}; adapter saved to {}",
        s.steps,
        s.seconds,
        s.tokens as f64 / s.seconds.max(1e-9),
        s.out_dir.display()
    );
    if let Some(e) = s.eval_loss {
        println!("eval loss {e:.4}");
    }
    Ok(())
}

/// `s` as one shell word.
fn quote(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./=:,+@%".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

fn export(a: ExportArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let base = match a.base {
        Some(b) => b,
        None => {
            let info = lora_train::export::read_adapter_config(&a.adapter)?;
            let name = info.base_model.unwrap_or_default();
            let p = PathBuf::from(&name);
            if name.is_empty() || !p.join("config.json").is_file() {
                anyhow::bail!(
                    "{}: base_model_name_or_path = \"{name}\" is not a local checkpoint directory: pass --base DIR",
                    a.adapter.join(lora_train::export::CONFIG).display()
                );
            }
            p
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
    };
    let r = merge(&a.adapter, &base, &a.out, &opts).with_context(|| {
        format!(
            "cannot merge {} into {}",
            a.adapter.display(),
            base.display()
        )
    })?;
    println!(
        "merged {} of {} tensors; wrote {} ({} shard(s), {:.1} MB)",
        r.merged,
        r.tensors,
        r.out.display(),
        r.shards,
        r.total_size as f64 / 1e6
    );
    Ok(())
}
