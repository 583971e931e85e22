//! Crash-safe directories: written under a temporary name, their files fsynced, renamed into
//! place over what was there, so a reader (or a crash) sees the old directory or the new one
//! whole, never half of either.

use anyhow::{Context, Result};
use std::path::Path;

/// Writes the directory `dst` through `write` into `tmp` (emptied first, its parents made),
/// then renames it over `dst` (`replace_dir`); on any failure `tmp` is removed and `dst` left
/// as it was. The merge and the trainer's checkpoints write through here.
pub(crate) fn write_dir<T>(
    tmp: &Path,
    dst: &Path,
    write: impl FnOnce(&Path) -> Result<T>,
) -> Result<T> {
    let _ = std::fs::remove_dir_all(tmp);
    std::fs::create_dir_all(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let done = write(tmp).and_then(|r| replace_dir(tmp, dst).map(|()| r));
    if done.is_err() {
        let _ = std::fs::remove_dir_all(tmp);
    }
    done
}

/// fsyncs every file in `dir`, then `dir` itself.
pub(crate) fn sync_dir_files(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_file() {
            std::fs::File::open(&p)?.sync_all()?;
        }
    }
    sync_dir(dir);
    Ok(())
}

/// fsyncs a directory's entry list (best effort: not every platform allows it).
pub(crate) fn sync_dir(dir: &Path) {
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

/// Puts the complete directory `tmp` at `dst`: a rename, after moving an existing `dst`
/// aside (and deleting it once the new one is in place). A crash leaves either the old or the
/// new directory at `dst`, or none, never a mix.
pub(crate) fn replace_dir(tmp: &Path, dst: &Path) -> Result<()> {
    let old = dst.with_file_name(format!(
        ".{}.old-{}",
        dst.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    let had_old = dst.exists();
    if had_old {
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(dst, &old)
            .with_context(|| format!("cannot move {} aside", dst.display()))?;
    }
    std::fs::rename(tmp, dst)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), dst.display()))?;
    if let Some(p) = dst.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(p);
    }
    if had_old {
        std::fs::remove_dir_all(&old)
            .with_context(|| format!("cannot remove {}", old.display()))?;
    }
    Ok(())
}
