//! `lora-train report DIR`: a run's curves (one SVG) and its summary, from metrics.jsonl.

use clap::Args;
use std::path::PathBuf;

#[derive(Args, Clone)]
#[command(
    after_help = "Examples:\n  lora-train report adapters/tiny-cpu\n  lora-train report runs/a --out a.svg"
)]
pub struct ReportArgs {
    /// A run's output directory (holding metrics.jsonl).
    dir: PathBuf,
    /// Where to write the picture. Default: DIR/report.svg.
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(a: ReportArgs) -> anyhow::Result<()> {
    if !a.dir.is_dir() {
        return Err(super::Usage(format!("{}: no such directory", a.dir.display())).into());
    }
    let (summary, out) = lora_train::report::report(&a.dir, a.out.as_deref())?;
    lora_train::out!("{}: {summary}", a.dir.display());
    lora_train::outln!("wrote {}", out.display());
    Ok(())
}
