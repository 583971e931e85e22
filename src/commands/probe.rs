//! `lora-train probe --recipe X`: the smoke ramp to the first out-of-memory.

use clap::Args;
use lora_train::probe::Ramp;
use std::path::PathBuf;

#[derive(Args, Clone)]
#[command(
    after_help = "Examples:\n  lora-train probe --recipe my.toml\n  lora-train probe --recipe my.toml --set train.max_memory=24GiB --json\n  lora-train probe --recipe my.toml --max-seq 524288 --set train.max_memory=80GiB"
)]
pub struct ProbeArgs {
    /// The recipe (TOML).
    #[arg(long, short)]
    recipe: PathBuf,
    /// Override a recipe field (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Stop doubling the micro-batch here.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    max_micro_batch: u32,
    /// The context ramp instead: micro-batch 1, seq doubling from 64 up to this (past the
    /// recipe's data.seq_len), then bisection after the first out-of-memory.
    #[arg(long, value_parser = clap::value_parser!(u32).range(64..=(1 << 22)))]
    max_seq: Option<u32>,
    /// With --max-seq: bisection steps between the knee and the first failure.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=16), requires = "max_seq")]
    refine: u32,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: ProbeArgs) -> anyhow::Result<()> {
    let recipe = lora_train::run::load_recipe(&a.recipe, &a.set)?;
    let ramp = match a.max_seq {
        Some(max_seq) => Ramp::Seq {
            max_seq: max_seq as usize,
            refine: a.refine as usize,
        },
        None => Ramp::Batch {
            max_micro_batch: a.max_micro_batch as usize,
        },
    };
    let rep = lora_train::probe::run(&recipe, ramp)?;
    if a.json {
        lora_train::outln!("{}", rep.to_json());
    } else {
        lora_train::out!("{}", rep.render());
    }
    Ok(())
}
