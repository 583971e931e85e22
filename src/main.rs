//! The `lora-train` command line: thin commands over the library.

use clap::{Args, Parser, Subcommand};
use lora_train::recipe::{Recipe, RecipeError};
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
}

#[derive(Args, Clone)]
struct TrainArgs {
    /// The recipe (TOML). See recipes/reference.toml for every field.
    #[arg(long, short)]
    recipe: Option<PathBuf>,
    /// Override a recipe field, e.g. --set train.lr=1e-4 --set lora.rank=8 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
}

/// Exit codes: 0 done, 1 the run failed, 2 the recipe or the command line is wrong.
fn main() -> ExitCode {
    let cli = Cli::parse();
    let (cmd, args) = match cli.command {
        Some(Command::Train(a)) => ("train", a),
        Some(Command::Check(a)) => ("check", a),
        None => ("train", cli.train),
    };
    match run(cmd, args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.downcast_ref::<RecipeError>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
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
    let s = lora_train::train::run(recipe)?;
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
