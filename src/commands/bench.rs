//! `lora-train bench --shape NAME`: training steps timed on random weights of a named shape.

use clap::{Args, ValueEnum};
use lora_train::recipe::{Checkpointing, DeviceKind, Quantize, Strategy, TrainObjective};
use std::path::PathBuf;

#[derive(Args, Clone)]
#[command(
    after_help = "Examples:\n  lora-train bench --shape llama2-7b --seq 2048 --micro-batch 2 --rank 16 --targets all\n  lora-train bench --shape llama2-7b --dropout 0.05 --tag dropout-0.05\n  lora-train bench --shape tiny --device cpu --steps 3 --warmup 1\n  bash scripts/sweep.sh   # every knob against the plain configuration"
)]
pub struct BenchArgs {
    /// tiny | llama2-7b | llama2-13b | llama2-70b | llama3-8b | qwen3-8b | gemma2-9b | gemma3-12b |
    /// phi3-mini | qwen3-30b-a3b (MoE) | gpt-oss-20b (MoE)
    #[arg(long, default_value = "llama2-7b", value_parser = shape)]
    shape: String,
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(2..=(1 << 22)))]
    seq: u32,
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=4096))]
    micro_batch: u32,
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=65536))]
    rank: u32,
    /// Default: 2 × rank.
    #[arg(long)]
    alpha: Option<f64>,
    #[arg(long, value_enum, default_value_t = Targets::All)]
    targets: Targets,
    /// Activation checkpointing: `--ckpt` recomputes each layer in backward, `--ckpt mlp` its
    /// MLP half only (train.activation_checkpointing = true / "mlp").
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "full")]
    ckpt: Option<Ckpt>,
    /// Park each layer's residual in host memory until its backward (true) or recompute it
    /// there (false), as the recipe's train.offload_activations (default: true; CUDA only).
    #[arg(long)]
    offload: Option<bool>,
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    steps: u32,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    warmup: u32,
    /// Default: cuda in a CUDA build, else cpu.
    #[arg(long, value_enum)]
    device: Option<DeviceArg>,
    /// CUDA ordinal (single).
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// One thread per device (NCCL; CPU: virtual ranks) for ddp / fsdp.
    #[arg(long, value_enum, default_value_t = Strategy::Single)]
    strategy: Strategy,
    /// Devices for ddp / fsdp, e.g. 0,1 (default: --gpu).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
    /// Micro-batches per optimizer step (per rank).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
    grad_accum: u32,
    /// Dense bf16 matmul ceiling for MFU (790 measured on the H200 here).
    #[arg(long, default_value_t = 790.0)]
    peak_tflops: f64,
    /// Also append the JSON line to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Behave as a card of this size, e.g. 24GiB (CUDA: a ballast outside the pool).
    #[arg(long, value_parser = super::parse_size)]
    max_memory: Option<u64>,
    /// Time a local checkpoint's weights (its config.json gives the shape) instead of random
    /// weights of --shape: what `train` would load.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Only kernels whose sums run in a fixed order, so that runs repeat bit for bit, as the
    /// recipe's train.deterministic.
    #[arg(long)]
    deterministic: bool,
    /// LoRA dropout on the adapters' input, as the recipe's lora.dropout.
    #[arg(long, default_value_t = 0.0, value_parser = dropout)]
    dropout: f32,
    /// rsLoRA: the adapters' scale α / √r, as lora.rslora.
    #[arg(long)]
    rslora: bool,
    /// Pack this many short examples into each row (block-diagonal attention, as packed data).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=(1 << 20)))]
    pack_short: u32,
    /// An eval forward every this many steps, as train.eval_every (0: none).
    #[arg(long, default_value_t = 0)]
    eval_every: u32,
    /// Micro-batches of the eval set (--eval-every).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    eval_batches: u32,
    /// A checkpoint (adapter and optimiser state, fsynced) every this many steps, as
    /// output.save_every (0: none); written under the temporary directory and removed after.
    #[arg(long, default_value_t = 0)]
    save_every: u32,
    /// A label copied into the JSON line (e.g. a sweep's row).
    #[arg(long)]
    tag: Option<String>,
    /// The frozen base in NF4 (QLoRA, bitsandbytes' format with double quant), as the
    /// recipe's model.quantize.
    #[arg(long, value_enum, default_value_t = QuantArg::None)]
    quantize: QuantArg,
    /// The objective (train.objective): sft, or dpo / orpo / simpo / kto on random pairs of
    /// --seq tokens a sequence (--micro-batch counts pairs).
    #[arg(long, value_enum, default_value_t = ObjectiveArg::Sft)]
    objective: ObjectiveArg,
    /// Preference objectives: the prompt tokens of each pair (of --seq).
    #[arg(long, default_value_t = 512)]
    prompt_len: u32,
}

/// `--objective`'s values.
#[derive(Clone, Copy, ValueEnum)]
enum ObjectiveArg {
    Sft,
    Dpo,
    Orpo,
    Simpo,
    Kto,
}

fn dropout(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(p) if (0.0..1.0).contains(&p) => Ok(p),
        _ => Err(format!("`{s}`: the dropout rate is a number in [0, 1)")),
    }
}

/// Which linears get adapters.
#[derive(Clone, Copy, ValueEnum)]
pub enum Targets {
    /// q_proj and v_proj
    Qv,
    /// q, k, v, o
    Attn,
    /// every linear of the decoder layers, and a MoE's fused experts (gate_up_proj, down_proj;
    /// not the router)
    All,
}

impl Targets {
    pub fn name(self) -> &'static str {
        match self {
            Targets::Qv => "qv",
            Targets::Attn => "attn",
            Targets::All => "all",
        }
    }
}

/// `--ckpt`'s value.
#[derive(Clone, Copy, ValueEnum)]
pub enum Ckpt {
    /// the whole layer (activation_checkpointing = true)
    Full,
    /// the MLP half (activation_checkpointing = "mlp")
    Mlp,
}

/// The recipe's setting for an optional `--ckpt`.
pub fn checkpointing(c: Option<Ckpt>) -> Checkpointing {
    match c {
        None => Checkpointing::Off,
        Some(Ckpt::Full) => Checkpointing::Full,
        Some(Ckpt::Mlp) => Checkpointing::Mlp,
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum QuantArg {
    None,
    Nf4,
}

#[derive(Clone, Copy, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

pub fn shape(s: &str) -> Result<String, String> {
    lora_train::model::shapes::shape(s)
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

pub fn run(b: BenchArgs) -> anyhow::Result<()> {
    let cuda = match b.device {
        Some(d) => matches!(d, DeviceArg::Cuda),
        None => cfg!(feature = "cuda"),
    };
    let device = match cuda {
        false => DeviceKind::Cpu,
        true => DeviceKind::Cuda,
    };
    let args = lora_train::bench::BenchArgs {
        shape: b.shape,
        seq: b.seq as usize,
        micro_batch: b.micro_batch as usize,
        rank: b.rank as usize,
        alpha: b.alpha,
        targets: b.targets.name().to_string(),
        ckpt: checkpointing(b.ckpt),
        offload: b.offload,
        steps: b.steps as usize,
        warmup: b.warmup as usize,
        device,
        peak_tflops: b.peak_tflops,
        strategy: b.strategy,
        devices: match b.devices.is_empty() {
            true => vec![b.gpu],
            false => b.devices,
        },
        grad_accum: b.grad_accum as usize,
        max_memory: b.max_memory,
        model: b.model,
        deterministic: b.deterministic,
        dropout: b.dropout,
        rslora: b.rslora,
        pack: b.pack_short as usize,
        eval_every: b.eval_every as usize,
        eval_batches: b.eval_batches as usize,
        save_every: b.save_every as usize,
        objective: match b.objective {
            ObjectiveArg::Sft => TrainObjective::Sft,
            ObjectiveArg::Dpo => TrainObjective::Dpo,
            ObjectiveArg::Orpo => TrainObjective::Orpo,
            ObjectiveArg::Simpo => TrainObjective::Simpo,
            ObjectiveArg::Kto => TrainObjective::Kto,
        },
        prompt_len: b.prompt_len as usize,
        tag: b.tag,
        quant: match b.quantize {
            QuantArg::None => Quantize::None,
            QuantArg::Nf4 => Quantize::Nf4,
        },
    };
    let res = lora_train::bench::run(&args)?;
    lora_train::outln!("{res}");
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
