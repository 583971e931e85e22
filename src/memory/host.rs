//! The host memory this process can get (`probe`): the least of its cgroup's limit (v2
//! `memory.max` up the hierarchy, v1 `memory.limit_in_bytes`), its address-space limit
//! (`ulimit -v`, RLIMIT_AS, less what the process maps already) and the machine's physical
//! memory (MemTotal); and, within that, what is free now (MemAvailable). `LORA_TRAIN_HOST_MEMORY`
//! (a size, e.g. "125GiB") stands for all of them: a plan made for another host, and tests.
//! The CPU preflight holds a run to `limit`; pinned host memory (parked activations) is held
//! to `available` (see `host_fits`).

use std::path::{Path, PathBuf};

/// The variable that names the host's memory in place of the probe.
pub(crate) const ENV: &str = "LORA_TRAIN_HOST_MEMORY";

/// Limits at or above this many bytes mean "no limit" (cgroup v1 writes 2⁶³ rounded down to
/// a page; RLIM_INFINITY is u64::MAX).
const UNLIMITED: u64 = 1 << 60;

/// What bounds this process's host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostMemory {
    /// Bytes the process may hold in all: the least bound.
    pub limit: u64,
    /// Which bound that is, in words with its figure (e.g. "ulimit -v (RLIMIT_AS) of 2.00 GiB
    /// less 0.31 GiB already mapped").
    pub source: String,
    /// Bytes free for it now: MemAvailable, within `limit`.
    pub available: u64,
}

/// The host memory this process can get; None where nothing says (no /proc). An error only
/// for a `LORA_TRAIN_HOST_MEMORY` that is not a size.
pub fn probe() -> Result<Option<HostMemory>, String> {
    if let Some(v) = std::env::var_os(ENV) {
        let text = v.to_string_lossy();
        let bytes = crate::util::parse_size(&text).map_err(|e| format!("{ENV} {e}"))?;
        return Ok(Some(HostMemory {
            limit: bytes,
            source: format!("{ENV} = {text}"),
            available: bytes,
        }));
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let mut bounds: Vec<(u64, String)> = Vec::new();
    if let Some(total) = meminfo
        .as_deref()
        .and_then(|t| meminfo_field(t, "MemTotal"))
    {
        bounds.push((total, "the machine's physical memory (MemTotal)".into()));
    }
    bounds.extend(cgroup_limit());
    bounds.extend(address_space_room());
    let Some((limit, source)) = least(bounds) else {
        return Ok(None);
    };
    let free = meminfo
        .as_deref()
        .and_then(|t| meminfo_field(t, "MemAvailable"));
    Ok(Some(HostMemory {
        limit,
        available: free.unwrap_or(limit).min(limit),
        source: format!("{source}: {}", super::plan::fmt_bytes(limit)),
    }))
}

/// The smallest of `bounds` (the first of equals).
fn least(bounds: Vec<(u64, String)>) -> Option<(u64, String)> {
    bounds
        .into_iter()
        .reduce(|a, b| if b.0 < a.0 { b } else { a })
}

/// A /proc/meminfo field (`MemTotal`, `MemAvailable`), in bytes.
pub(crate) fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.split(':').next() == Some(key))?;
    let mut words = line.split(':').nth(1)?.split_whitespace();
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        _ => None,
    }
}

/// The cgroup's memory limit, if any: v2's `memory.max` of this process's group and of every
/// group above it (the least), else v1's `memory.limit_in_bytes`.
fn cgroup_limit() -> Option<(u64, String)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let root = Path::new("/sys/fs/cgroup");
    let (v2, v1) = cgroup_paths(&text, root);
    let read = |p: &PathBuf| {
        let t = std::fs::read_to_string(p).ok()?;
        let n: u64 = t.trim().parse().ok()?;
        (n < UNLIMITED).then(|| (n, format!("the cgroup's limit ({})", p.display())))
    };
    least(v2.iter().chain(&v1).filter_map(read).collect())
}

/// The files that may hold this process's cgroup memory limit, from /proc/self/cgroup
/// (`text`) under the cgroup mount `root`: (v2's `memory.max` from the group up to the
/// mount, v1's `memory.limit_in_bytes` of the group and of the mount's root, where a
/// container's own group is mounted).
pub(crate) fn cgroup_paths(text: &str, root: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let (mut v2, mut v1) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctl), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        if rel.split('/').any(|c| c == "..") {
            continue;
        }
        if id == "0" && ctl.is_empty() {
            let mut dir = root.join(rel);
            loop {
                v2.push(dir.join("memory.max"));
                if dir == root || !dir.pop() || !dir.starts_with(root) {
                    break;
                }
            }
        } else if ctl.split(',').any(|c| c == "memory") {
            let mount = root.join("memory");
            v1.push(mount.join(rel).join("memory.limit_in_bytes"));
            v1.push(mount.join("memory.limit_in_bytes"));
        }
    }
    (v2, v1)
}

/// `ulimit -v` (RLIMIT_AS) less the address space the process maps already (VmSize), if a
/// limit is set.
fn address_space_room() -> Option<(u64, String)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a pointer to a live, writable one.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } != 0 {
        return None;
    }
    let cap: u64 = lim.rlim_cur;
    if lim.rlim_cur == libc::RLIM_INFINITY || cap >= UNLIMITED {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let mapped = meminfo_field(&status, "VmSize").unwrap_or(0);
    let fmt = super::plan::fmt_bytes;
    Some((
        cap.saturating_sub(mapped),
        format!(
            "ulimit -v (RLIMIT_AS) of {} less the {} this process maps already",
            fmt(cap),
            fmt(mapped)
        ),
    ))
}

/// Whether `ranks` ranks on one host may each pin `pinned` bytes of its `available` memory:
/// three quarters of it at most, the rest left to the data, the page cache and the process.
pub(crate) fn host_fits(pinned: u64, ranks: usize, available: u64) -> bool {
    pinned.saturating_mul(ranks.max(1) as u64) <= available / 4 * 3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_are_read_in_bytes() {
        let text = "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   100000000 kB\n";
        assert_eq!(
            meminfo_field(text, "MemAvailable"),
            Some(100_000_000 * 1024)
        );
        assert_eq!(meminfo_field(text, "MemTotal"), Some(131_072_000 * 1024));
        assert_eq!(meminfo_field("MemTotal: 5 kB\n", "MemAvailable"), None);
        assert_eq!(
            meminfo_field("MemAvailable: many kB\n", "MemAvailable"),
            None
        );
        assert_eq!(meminfo_field("MemAvailable: 5 MB\n", "MemAvailable"), None);
        let status = "Name:\tlora-train\nVmPeak:\t  300000 kB\nVmSize:\t  262144 kB\n";
        assert_eq!(meminfo_field(status, "VmSize"), Some(256 << 20));
        // 12 GiB pinned by each of 2 ranks of a host with 32 GiB available: 24 of 24 allowed.
        let gib = 1u64 << 30;
        assert!(host_fits(12 * gib, 2, 32 * gib));
        assert!(!host_fits(12 * gib + 1, 2, 32 * gib));
        assert!(host_fits(0, 0, 0));
    }

    #[test]
    fn cgroup_files_are_found_from_proc_self_cgroup() {
        let root = Path::new("/sys/fs/cgroup");
        let (v2, v1) = cgroup_paths("0::/user.slice/run-1.scope\n", root);
        let want: Vec<PathBuf> = [
            "/sys/fs/cgroup/user.slice/run-1.scope/memory.max",
            "/sys/fs/cgroup/user.slice/memory.max",
            "/sys/fs/cgroup/memory.max",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        assert_eq!((v2, v1.len()), (want, 0));
        let (v2, v1) = cgroup_paths("12:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n", root);
        assert_eq!(v2, [PathBuf::from("/sys/fs/cgroup/memory.max")]);
        assert_eq!(
            v1,
            [
                PathBuf::from("/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes"),
                PathBuf::from("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
            ]
        );
        // A path that climbs out of the mount is not followed.
        assert_eq!(cgroup_paths("0::/../../etc\n", root), (vec![], vec![]));
    }

    #[test]
    fn the_least_bound_is_the_limit() {
        let b = vec![(8, "a".to_string()), (3, "b".into()), (3, "c".into())];
        assert_eq!(least(b), Some((3, "b".to_string())));
        assert_eq!(least(vec![]), None);
    }
}
