//! `lora-train [train] --recipe X`: the whole run a recipe describes.

use super::Usage;
use clap::Args;
use lora_train::train::stop::{Interrupted, EXIT_INTERRUPTED};
use lora_train::train::EnvRank;
use lora_train::util::{on_exit, out};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Args, Clone)]
#[command(
    after_help = "Examples:\n  lora-train --recipe recipes/tiny-cpu.toml\n  lora-train --recipe my.toml --set train.lr=1e-4 --set lora.rank=16\n  lora-train --recipe my.toml --set train.resume=true"
)]
pub struct TrainArgs {
    /// The recipe (TOML). See recipes/reference.toml for every field.
    #[arg(long, short)]
    pub recipe: Option<PathBuf>,
    /// Override a recipe field, e.g. --set train.lr=1e-4 --set lora.rank=8 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub set: Vec<String>,
    /// Start even when the memory plan says the run does not fit.
    #[arg(long)]
    pub force: bool,
    /// Replace a finished run in output.dir (its adapter, merged model and checkpoints);
    /// without it such a directory is refused. The same as --set output.overwrite=true.
    #[arg(long)]
    pub overwrite: bool,
}

pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    let path = recipe_path(
        a.recipe.as_deref(),
        "lora-train --recipe RECIPE.toml [--set section.key=value ...]",
    )?;
    let mut sets = a.set.clone();
    if a.overwrite {
        sets.push("output.overwrite=true".into());
    }
    let recipe = lora_train::run::load_recipe(&path, &sets)?;
    let opts = lora_train::run::RunOptions { force: a.force };
    // A run's streams are logs (util::out). Until its signal handlers take over, a closed one
    // ends it at once: nothing is written yet.
    out::on_closed(Arc::new(|_| on_exit::exit(EXIT_INTERRUPTED.into())));
    let res = lora_train::run::run_with(recipe, &opts);
    // The run is over: a stream closed now ends nothing, and changes no exit status.
    out::on_closed(Arc::new(|_| {}));
    let s = match res {
        Ok(s) => s,
        Err(e) => {
            if let Some(i) = e.downcast_ref::<Interrupted>() {
                lora_train::errln!("{i}\nresume with: {}", resume_command(&path, &a.set));
                std::process::exit(EXIT_INTERRUPTED.into());
            }
            return Err(e);
        }
    };
    let last = s.losses.last().copied().unwrap_or(f64::NAN);
    let first = s.losses.first().copied().unwrap_or(f64::NAN);
    // A launcher's rank other than 0 trained the same steps; rank 0 alone writes.
    if let Some(e) = EnvRank::from_env(&|k| std::env::var(k).ok())?.filter(|e| e.rank > 0) {
        lora_train::outln!(
            "rank {} of {}: trained {} steps; rank 0 writes the adapter to {}",
            e.rank,
            e.world,
            s.steps,
            s.out_dir.display()
        );
        return Ok(());
    }
    lora_train::outln!(
        "trained {} steps in {:.1}s ({:.0} tok/s): loss {first:.4} -> {last:.4}; adapter saved to {}",
        s.steps,
        s.seconds,
        s.tokens as f64 / s.seconds.max(1e-9),
        s.out_dir.display()
    );
    if let Some(e) = s.eval_loss {
        lora_train::outln!("eval loss {e:.4}");
    }
    Ok(())
}

/// The recipe a command was given, or a usage error naming the command's form.
pub fn recipe_path(p: Option<&Path>, usage: &str) -> anyhow::Result<PathBuf> {
    match p {
        Some(p) => Ok(p.to_path_buf()),
        None => Err(Usage(format!("no recipe given: usage: {usage}")).into()),
    }
}

/// The command that continues an interrupted run, as this binary was started (its path
/// when it is not on PATH, e.g. under `cargo run`). The checkpoint keeps the overrides that
/// change the numbers; the others (output.dir, logging, memory) are repeated.
fn resume_command(path: &Path, set: &[String]) -> String {
    use lora_train::run::checkpoint::{numbers_sets, set_key};
    let program = std::env::args()
        .next()
        .filter(|p| p.contains('/'))
        .unwrap_or_else(|| "lora-train".into());
    let mut cmd = vec![
        quote(&program),
        "--recipe".into(),
        quote(&path.to_string_lossy()),
    ];
    let kept = numbers_sets(set);
    for s in set {
        if !kept.contains(s) && !["train.resume", "output.overwrite"].contains(&set_key(s)) {
            cmd.push("--set".into());
            cmd.push(quote(s));
        }
    }
    cmd.extend(["--set".into(), "train.resume=true".into()]);
    cmd.join(" ")
}

/// `s` as one shell word.
pub(super) fn quote(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./=:,+@%".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}
