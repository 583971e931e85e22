//! `lora-train check --recipe X`: the recipe parsed, checked and printed with every default.

use clap::Args;
use std::path::PathBuf;

#[derive(Args, Clone)]
#[command(
    after_help = "Examples:\n  lora-train check --recipe recipes/tiny-cpu.toml\n  lora-train check --recipe my.toml --set lora.rank=32"
)]
pub struct CheckArgs {
    /// The recipe (TOML). See recipes/reference.toml for every field.
    #[arg(long, short)]
    pub recipe: Option<PathBuf>,
    /// Override a recipe field, e.g. --set train.lr=1e-4 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub set: Vec<String>,
}

pub fn run(a: CheckArgs) -> anyhow::Result<()> {
    let path =
        super::train::recipe_path(a.recipe.as_deref(), "lora-train check --recipe RECIPE.toml")?;
    let recipe = lora_train::run::load_recipe(&path, &a.set)?;
    lora_train::outln!("# output dir: {}", recipe.output_dir().display());
    lora_train::out!("{}", recipe.check_toml());
    Ok(())
}
