//! Small helpers every module may use: crash-safe file writes and their stale temporaries,
//! sizes written as text, Hub names checked; output that never panics (`out`), progress bars
//! (`bar`), directory
//! locks (`lock`), what an abrupt exit removes (`on_exit`), paths that are not UTF-8 recorded
//! and shown (`os_path`).

pub(crate) mod bar;
pub(crate) mod fs;
pub mod lock;
pub mod on_exit;
pub mod os_path;
pub mod out;
pub(crate) mod signal;

use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// A checkpoint's trainer state (step, data cursor, schedule inputs): the file that makes a
/// directory a checkpoint (run::checkpoint writes it last).
pub const TRAINER_STATE: &str = "trainer_state.json";

/// Bytes for people: B, KiB, MiB or GiB with two decimals.
pub fn fmt_bytes(x: u64) -> String {
    let f = x as f64;
    if x >= 1 << 30 {
        format!("{:.2} GiB", f / (1u64 << 30) as f64)
    } else if x >= 1 << 20 {
        format!("{:.2} MiB", f / (1u64 << 20) as f64)
    } else if x >= 1024 {
        format!("{:.2} KiB", f / 1024.0)
    } else {
        format!("{x} B")
    }
}

/// The adapter's weights file, as PEFT names it (export writes it; the reference store
/// fingerprints an init adapter's).
pub const WEIGHTS: &str = "adapter_model.safetensors";
/// The adapter's config file, as PEFT names it.
pub const CONFIG: &str = "adapter_config.json";

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

/// The temporaries of `path`'s own naming beside it (`.<name>.tmp-<pid>`, and an empty
/// `.<name>.old-<pid>` that a replacement moved aside) whose writer is gone: another pid that
/// is no longer running. What a killed writer left; nothing else matches.
pub fn stale_temporaries(path: &Path) -> Vec<PathBuf> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Vec::new();
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let name = name.to_string_lossy();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = rd
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let rest = n.strip_prefix('.')?.strip_prefix(&*name)?;
            let (old, pid) = match (rest.strip_prefix(".tmp-"), rest.strip_prefix(".old-")) {
                (Some(pid), _) => (false, pid),
                (_, Some(pid)) => (true, pid),
                _ => return None,
            };
            let pid: u32 = pid.parse().ok().filter(|p: &u32| p.to_string() == pid)?;
            let p = e.path();
            let empty = || std::fs::read_dir(&p).is_ok_and(|mut d| d.next().is_none());
            (pid != std::process::id() && !lock::pid_alive(pid) && (!old || empty())).then_some(p)
        })
        .collect();
    out.sort();
    out
}

/// How to build with CUDA, for the errors of a build without it (docs/gpu.md tells it whole):
/// the driver, the toolkit or none, and the feature for one GPU.
pub const CUDA_BUILD: &str =
    "install a CUDA build (NVIDIA driver >= 580, CUDA 13.0; docs/gpu.md): \
     with a CUDA toolkit, `CUDA_COMPUTE_CAP=90 cargo install --locked --path . --features cuda` \
     (90 H100/H200, 89 RTX 40xx, 86 RTX 30xx, 80 A100); without one, `bash scripts/build-cuda.sh`";

/// The same for several GPUs: NCCL too.
pub const NCCL_BUILD: &str = "install a build with NCCL (NVIDIA driver >= 580, CUDA 13.0; \
     docs/gpu.md): with a CUDA toolkit, `CUDA_COMPUTE_CAP=90 cargo install --locked --path . \
     --features cuda,nccl`; without one, `bash scripts/build-cuda.sh` (cuda,nccl by default)";

/// "5GB" → 5·10⁹, "500MB", "2GiB" → 2·2³⁰, "300KB", "1000B" (bytes), as transformers reads
/// `max_shard_size`; a bare number ("24": bytes or GiB?) is refused, naming the units.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if unit.trim().is_empty() && !num.is_empty() {
        return Err(format!(
            "= \"{s}\" has no unit: write e.g. \"{num}GiB\" (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        ));
    }
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "B" => 1,
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

/// Checks a revision (branch, tag or commit) as git and the Hub accept one, before it becomes
/// a path (`refs/<revision>` in the cache) or part of a URL: not empty, at most 255 bytes, no
/// control characters, space, `~ ^ : ? * [ \`, no `..` or `@{`, not `@`, no empty part or
/// part starting with `.` or ending with `.lock` between its `/`s (so no absolute path, no
/// leading or trailing `/`), not ending with `.`. `refs/pr/1` and `v1.0` pass.
pub fn check_revision(rev: &str) -> std::result::Result<(), String> {
    let bad_char = |c: char| c.is_control() || " ~^:?*[\\".contains(c);
    let bad = rev.is_empty()
        || rev.len() > 255
        || rev == "@"
        || rev.contains("..")
        || rev.contains("@{")
        || rev.ends_with('.')
        || rev.chars().any(bad_char)
        || rev
            .split('/')
            .any(|p| p.is_empty() || p.starts_with('.') || p.ends_with(".lock"));
    match bad {
        true => Err(format!(
            "\"{}\" is not a branch, tag or commit (git ref names: no absolute path, no `..`, \
             no empty or hidden part, no spaces or ~^:?*[\\), e.g. \"main\", \"v1.0\", \"refs/pr/1\" \
             or a 40-digit commit",
            rev.escape_debug()
        )),
        false => Ok(()),
    }
}

/// The message of a caught panic (`std::panic::catch_unwind`'s payload): its text, or "" when
/// it carries none.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revisions_as_git_names_them() {
        for ok in [
            "main",
            "v1.0",
            "refs/pr/1",
            "refs/convert/parquet",
            "feature/x-y_z",
            "0123456789abcdef0123456789abcdef01234567",
        ] {
            assert!(check_revision(ok).is_ok(), "{ok}");
        }
        let long = "a".repeat(256);
        for bad in [
            "",
            " ",
            "/etc/passwd",
            "/",
            "a/",
            "a//b",
            "..",
            "a/../b",
            "../../x",
            ".hidden",
            "a/.b",
            "x.lock",
            "a/b.lock/c",
            "v1.",
            "@",
            "a@{1}",
            "a b",
            "a~1",
            "a^",
            "a:b",
            "a?",
            "a*",
            "a[",
            "a\\b",
            "a\nb",
            "a\0b",
            &long,
        ] {
            let e = check_revision(bad).unwrap_err();
            assert!(e.contains("is not a branch, tag or commit"), "{bad}: {e}");
        }
    }

    #[test]
    fn stale_temporaries_are_of_this_naming_and_of_dead_writers_only() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let me = std::process::id();
        let dead = 999_999_999u32;
        let mk = |name: &str, file: Option<&str>| {
            let p = tmp.path().join(name);
            std::fs::create_dir_all(&p).unwrap();
            if let Some(f) = file {
                std::fs::write(p.join(f), "x").unwrap();
            }
            p
        };
        let stale = mk(&format!(".out.tmp-{dead}"), Some("shard"));
        let empty_old = mk(&format!(".out.old-{dead}"), None);
        mk(&format!(".out.old-{}", dead - 1), Some("kept"));
        mk(&format!(".out.tmp-{me}"), None);
        mk(&format!(".outer.tmp-{dead}"), None);
        mk(&format!(".out.tmp-0{dead}"), None);
        mk(&format!(".out.tmp-{dead}x"), None);
        mk("out", None);
        assert_eq!(stale_temporaries(&out), vec![empty_old, stale]);
    }
}
