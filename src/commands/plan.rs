//! `lora-train plan --recipe X | --shape NAME`: the memory forecast per rank, no weights read.

use super::bench::Targets;
use super::Usage;
use clap::Args;
use lora_train::memory::plan;
use lora_train::recipe::{DeviceKind, Dtype, Strategy};
use lora_train::run::Machine;
use lora_train::train::RunConfig;
use std::path::PathBuf;

#[derive(Args, Clone)]
#[command(
    after_help = "Examples:\n  lora-train plan --recipe recipes/llama7b.toml --gpus 4 --gpu-mem 24GiB\n  lora-train plan --shape llama2-7b --seq 2048 --micro-batch 2 --json"
)]
pub struct PlanArgs {
    /// The recipe (TOML); only its model's config.json is read.
    #[arg(long, short, conflicts_with = "shape")]
    recipe: Option<PathBuf>,
    /// Override a recipe field (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Plan a `bench` shape (tiny | llama2-7b | llama2-13b | llama2-70b | llama3-8b | qwen3-8b | gemma2-9b |
    /// gemma3-12b | phi3-mini | qwen3-30b-a3b | gpt-oss-20b; bf16) instead of a recipe.
    #[arg(long, value_parser = super::bench::shape)]
    shape: Option<String>,
    /// Tokens per row (default: the recipe's data.seq_len; 2048 with --shape).
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..=(1 << 22)))]
    seq: Option<u32>,
    /// Rows per micro-batch (default: the recipe's; 2 with --shape).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    micro_batch: Option<u32>,
    /// With --shape: LoRA rank.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=65536))]
    rank: u32,
    /// With --shape: which linears get adapters (all: a MoE's experts too).
    #[arg(long, value_enum, default_value_t = Targets::All)]
    targets: Targets,
    /// With --shape: the run's row (the JSON's `selected`) uses activation checkpointing,
    /// of each layer (`--ckpt`) or of its MLP half (`--ckpt mlp`).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "full")]
    ckpt: Option<super::bench::Ckpt>,
    /// With --shape: the frozen base in NF4 (QLoRA, double quant), as a recipe's
    /// model.quantize = "nf4".
    #[arg(long)]
    nf4: bool,
    /// GPUs for ddp / fsdp (default: the recipe's parallel.devices).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    gpus: Option<u32>,
    /// Memory per GPU, e.g. 24GiB (default: train.max_memory, else the free memory of the GPU
    /// in a CUDA build, else no fit column).
    #[arg(long, value_parser = super::parse_size)]
    gpu_mem: Option<u64>,
    /// Host memory free for the ranks' pinned activations, e.g. 125GiB (default:
    /// LORA_TRAIN_HOST_MEMORY, else what this machine has free within this process's limits).
    #[arg(long, value_parser = super::parse_size)]
    host_mem: Option<u64>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: PlanArgs) -> anyhow::Result<()> {
    let seq = a.seq.map(|s| s as usize);
    let micro_batch = a.micro_batch.map(|m| m as usize);
    let gpus = a.gpus.map(|g| g as usize);
    // The GPUs whose free memory bounds the plan: the recipe's parallel.devices, else (a
    // --shape plan, or devices = "all") GPU 0.
    let (input, grad_accum, selected, recipe_cap, gpus_used) = match (&a.shape, &a.recipe) {
        (Some(shape), _) => {
            let cfg = lora_train::model::shapes::shape(shape)?;
            let targets = lora_train::model::shapes::targets(a.targets.name(), &cfg)?;
            let input = plan::input_from_shape(
                shape,
                seq.unwrap_or(2048),
                micro_batch.unwrap_or(2),
                a.rank as usize,
                targets,
                gpus.unwrap_or(1),
            )?;
            let input = match a.nf4 {
                true => input.nf4(),
                false => input,
            };
            (input, 1, (Strategy::Single, super::bench::checkpointing(a.ckpt)), None, vec![0])
        }
        (None, Some(path)) => {
            let mut r = lora_train::run::load_recipe(path, &a.set)?;
            if let Some(s) = seq {
                r.data.seq_len = s;
            }
            if let Some(m) = micro_batch {
                r.train.micro_batch = m;
            }
            let used = match r.parallel.devices.is_empty() {
                true => vec![0],
                false => r.parallel.devices.clone(),
            };
            let gpus = gpus.unwrap_or(r.parallel.devices.len()).max(1);
            // A plan forecasts a GPU run (a CPU recipe's base keeps its f32).
            if r.model.device == DeviceKind::Cpu {
                r.model.dtype = r.model.dtype.or(Some(Dtype::F32));
                r.model.device = DeviceKind::Cuda;
            }
            let offline = plan::shape_command(&r, gpus, a.gpu_mem);
            let run = match RunConfig::resolve(r, Machine::Forecast { gpus }) {
                Ok(run) => run,
                Err(e) if e.is::<lora_train::recipe::RecipeError>() => return Err(e),
                Err(e) => match offline {
                    Some(cmd) => {
                        return Err(anyhow::anyhow!(
                            "{e:#}\nwithout the model's config.json (offline), plan its shape: {cmd}"
                        ))
                    }
                    None => return Err(e),
                },
            };
            let sel = (run.strategy, run.ckpt);
            let input = run.plan_input(gpus);
            if let (Some(note), false) = (run.plan_note(), a.json) {
                lora_train::outln!("{note}");
            }
            (input, run.batch.grad_accum, sel, run.max_memory, used)
        }
        (None, None) => {
            return Err(Usage(
                "plan needs --recipe RECIPE.toml or --shape NAME: usage: lora-train plan --recipe RECIPE.toml | --shape NAME [--gpus N] [--gpu-mem 24GiB] [--json]".into(),
            )
            .into())
        }
    };
    let capacity = match a.gpu_mem.or(recipe_cap) {
        Some(c) => Some(c),
        None => lora_train::memory::free_gpu_memory(&gpus_used),
    };
    let host = match a.host_mem {
        Some(h) => Some(h),
        None => lora_train::memory::host::probe()
            .map_err(anyhow::Error::msg)?
            .map(|h| h.available),
    };
    let input = input.with_host(host);
    let p = plan::plan(&input, grad_accum, capacity);
    if a.json {
        lora_train::outln!("{}", plan::to_json(&p, selected));
    } else {
        lora_train::out!("{}", plan::render(&p, selected));
    }
    Ok(())
}
