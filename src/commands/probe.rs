//! `lora-train probe --recipe X`: the smoke ramp to the first out-of-memory.

use clap::Args;
use lora_train::recipe::Recipe;
use std::path::PathBuf;

#[derive(Args, Clone)]
#[command(
    after_help = "Examples:\n  lora-train probe --recipe my.toml\n  lora-train probe --recipe my.toml --set train.max_memory=24GiB --json"
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
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: ProbeArgs) -> anyhow::Result<()> {
    let recipe = Recipe::load(&a.recipe, &a.set)?;
    let rep = lora_train::probe::run(&recipe, a.max_micro_batch as usize)?;
    if a.json {
        println!("{}", rep.to_json());
    } else {
        print!("{}", rep.render());
    }
    Ok(())
}
