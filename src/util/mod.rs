//! Small helpers every module may use: crash-safe file writes, sizes written as text.

pub mod fs;

use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// A checkpoint's trainer state (step, data cursor, schedule inputs): the file that makes a
/// directory a checkpoint (train::checkpoint writes it last).
pub const TRAINER_STATE: &str = "trainer_state.json";

/// Writes `bytes` to `path` through a temporary sibling and a rename, so a reader (or a crash)
/// never sees a half-written file: the old file stays intact until the new one is complete.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_path(path);
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.with_context(|| format!("cannot write {}", path.display()))
}

/// `dir/name` → `dir/.name.tmp-<pid>`
pub fn tmp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// "5GB" → 5·10⁹, "500MB", "2GiB" → 2·2³⁰, "300KB", "1000" (bytes); as transformers reads
/// `max_shard_size`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        "TIB" => 1 << 40,
        _ => 0,
    };
    let n: f64 = num.parse().unwrap_or(-1.0);
    let bytes = n * mult as f64;
    if mult == 0 || !bytes.is_finite() || bytes < 1.0 {
        return Err(format!(
            "= \"{s}\" is not a size: write a number with a unit, e.g. \"5GB\", \"500MB\", \"2GiB\""
        ));
    }
    Ok(bytes as u64)
}

/// Checks a Hub repository id as the Hub does: `name` or `org/name`, each part letters, digits,
/// `-`, `_`, `.`, not starting or ending with `-` or `.`, no `--` or `..`, at most 96 long.
pub fn check_repo_id(id: &str) -> std::result::Result<(), String> {
    let parts: Vec<&str> = id.split('/').collect();
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !p.starts_with(['-', '.'])
            && !p.ends_with(['-', '.'])
    };
    if id.len() > 96
        || parts.len() > 2
        || !parts.iter().all(|p| part_ok(p))
        || id.contains("--")
        || id.contains("..")
    {
        return Err(format!(
            "\"{id}\" is not a Hub repository id: expected \"org/name\" (letters, digits, \
             '-', '_', '.'), e.g. \"meta-llama/Llama-3.2-1B\""
        ));
    }
    Ok(())
}

/// The message of a caught panic (`std::panic::catch_unwind`'s payload): its text, or "" when
/// it carries none.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}
