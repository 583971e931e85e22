//! `lora-train download ORG/NAME`: a Hub model into the Hugging Face cache.

use clap::Args;

#[derive(Args, Clone)]
#[command(
    after_help = "Examples:\n  lora-train download meta-llama/Llama-3.2-1B\n  HF_HUB_CACHE=/data/hub lora-train download Qwen/Qwen2.5-7B --revision main"
)]
pub struct DownloadArgs {
    /// Hub repository id, e.g. meta-llama/Llama-3.2-1B.
    #[arg(value_parser = repo_id)]
    id: String,
    /// Branch, tag or commit.
    #[arg(long, default_value = lora_train::hub::DEFAULT_REVISION, value_parser = revision)]
    revision: String,
}

fn repo_id(s: &str) -> Result<String, String> {
    lora_train::util::check_repo_id(s).map(|()| s.to_string())
}

/// A branch, tag or commit, as git names them (as the recipe's model.revision).
fn revision(s: &str) -> Result<String, String> {
    lora_train::util::check_revision(s).map(|()| s.to_string())
}

pub fn run(a: DownloadArgs) -> anyhow::Result<()> {
    let files = lora_train::hub::download(&a.id, &a.revision)?;
    lora_train::outln!("{}", files.dir.display());
    Ok(())
}
