//! `lora-train prepare --recipe X`: the recipe's data tokenized into the tokenized cache ahead
//! of a run (the model and data it names downloaded as `train` would), so that `train`, a
//! resume, and every rank map it instead of tokenizing.

use clap::Args;
use lora_train::data::{recipe_data, DataPlan, Dataset, Options};
use lora_train::hub::Source;
use lora_train::recipe::Recipe;
use std::path::PathBuf;

#[derive(Args, Clone)]
#[command(
    after_help = "Examples:\n  lora-train prepare --recipe recipes/tiny-cpu-alpaca.toml\n  LORA_TRAIN_CACHE=/scratch/tok lora-train prepare --recipe my.toml\n\nThe cache is $LORA_TRAIN_CACHE, else $HF_HOME/lora-train/tokenized (~/.cache/huggingface/lora-train/tokenized); delete that directory to clear it."
)]
pub struct PrepareArgs {
    /// The recipe (TOML). See recipes/reference.toml for every field.
    #[arg(long, short)]
    pub recipe: Option<PathBuf>,
    /// Override a recipe field, e.g. --set data.seq_len=2048 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub set: Vec<String>,
}

pub fn run(a: PrepareArgs) -> anyhow::Result<()> {
    let path = super::train::recipe_path(
        a.recipe.as_deref(),
        "lora-train prepare --recipe RECIPE.toml",
    )?;
    let recipe = Recipe::load(&path, &a.set)?;
    let m = &recipe.model;
    let source = Source::of(m.path.as_deref(), m.id.as_deref(), m.revision.as_deref())
        .ok_or_else(|| recipe.invalid("model", "needs `path` or `id`"))?;
    let files = lora_train::hub::model_files(&source)?;
    let vocab = lora_train::model::ModelConfig::from_file(&files.config)?.vocab_size;
    let opts = Options::from_env()?;
    let plan = DataPlan {
        recipe: &recipe,
        data: &recipe.data,
        sample_every: recipe.train.sample_every,
        seed: recipe.train.seed,
    };
    let d = recipe_data(&plan, &files, vocab, &opts)?;
    let seq_len = recipe.data.seq_len;
    lora_train::outln!("{}", line("train", &d.data, seq_len));
    if let Some(e) = d.eval.as_ref().filter(|_| recipe.data.eval.is_some()) {
        lora_train::outln!("{}", line("eval", e, seq_len));
    }
    for note in &d.notes {
        lora_train::outln!("{note}");
    }
    if let Some(kb) = peak_rss_kb() {
        lora_train::outln!("peak memory (RSS): {:.1} MB", kb as f64 / 1e3);
    }
    Ok(())
}

/// This process's peak resident set (VmHWM of /proc/self/status, Linux), in kB.
fn peak_rss_kb() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// What one data set holds and how it was prepared.
fn line(what: &str, d: &Dataset, seq_len: usize) -> String {
    format!(
        "{what} data {}: {} examples, {} tokens ({} truncated to seq_len {seq_len}); {:.1}s, {}",
        d.source.display(),
        d.examples.len(),
        d.examples.tokens(),
        d.truncated,
        d.prep.secs,
        d.prep.describe()
    )
}
