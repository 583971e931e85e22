//! Advisory locks on what a process writes: a run's `output.dir`, an export's `--out`, a Hub
//! repository's folder in the cache while it downloads.
//!
//! A lock is a file, `flock()`ed (exclusive) for as long as its holder lives, holding the
//! holder's pid and command (`1234 lora-train train`) for the message of whoever finds it
//! taken. The kernel releases a flock when its holder dies, so a lock file left by a dead
//! process is simply taken over. A directory's lock lives beside it, `.<name>.lora-train.lock`
//! in its parent, for two reasons: one place whether the directory exists yet or not, and an
//! export's `--out` stays empty until the export renames its complete output into place.
//! Its path is made from the directory's resolved absolute path, so two spellings of one
//! directory share one lock. The holder removes the file when it ends (the file is checked to
//! still be the one locked after each flock, so that a file removed meanwhile is not trusted).

use super::on_exit::{remove_on_exit, Registered};
use anyhow::{bail, Context, Result};
use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

/// The suffix of a lock file's name.
pub(crate) const LOCK_SUFFIX: &str = "lora-train.lock";

/// Another live process holds the lock of `dir`.
#[derive(Debug, thiserror::Error)]
#[error(
    "{} is in use: {} holds its lock {}; wait for it to end (or stop it), or choose another \
     directory",
    dir.display(),
    holder,
    lock.display()
)]
pub(crate) struct Locked {
    /// The directory (or what the lock guards).
    pub(crate) dir: PathBuf,
    /// The lock file.
    pub(crate) lock: PathBuf,
    /// The holder's pid, when its lock file says it.
    pub(crate) pid: Option<u32>,
    /// "pid 1234 (lora-train train)", or "another process" when the file names none.
    pub(crate) holder: String,
}

/// A lock held until dropped (or until the process ends).
#[derive(Debug)]
pub struct DirLock {
    /// The locked file; None where the filesystem has no locks (a warning said so).
    file: Option<File>,
    path: PathBuf,
    _exit: Registered,
}

impl DirLock {
    /// Takes the lock of directory `dir` (which need not exist; its parents are created) for
    /// `what` (e.g. "lora-train export"), or fails with [`Locked`] naming the holder.
    pub fn try_dir(dir: &Path, what: &str) -> Result<DirLock> {
        let lock = beside(dir)?;
        acquire(&lock, dir, what, false)
    }

    /// Takes the lock file `lock` guarding `guarded` for `what`, waiting (and saying whom for)
    /// while another process holds it.
    pub fn wait(lock: &Path, guarded: &Path, what: &str) -> Result<DirLock> {
        if let Some(p) = lock.parent() {
            std::fs::create_dir_all(p).with_context(|| format!("cannot create {}", p.display()))?;
        }
        acquire(lock, guarded, what, true)
    }

    /// The lock file.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Removed while still held: whoever opened it meanwhile finds it gone and starts over.
        if let Some(f) = &self.file {
            if same_file(f, &self.path) {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

/// The lock file of directory `dir`: `.<name>.lora-train.lock` beside it (inside it for a
/// root), from its resolved absolute path; the parent is created.
pub(crate) fn beside(dir: &Path) -> Result<PathBuf> {
    let abs = resolved(dir).with_context(|| format!("cannot resolve {}", dir.display()))?;
    let lock = match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => {
            let mut n = OsString::from(".");
            n.push(name);
            n.push(".");
            n.push(LOCK_SUFFIX);
            parent.join(n)
        }
        _ => abs.join(format!(".{LOCK_SUFFIX}")),
    };
    if let Some(p) = lock.parent() {
        std::fs::create_dir_all(p).with_context(|| format!("cannot create {}", p.display()))?;
    }
    Ok(lock)
}

/// `p` absolute, `.` and `..` resolved, symlinks resolved as far as the path exists.
fn resolved(p: &Path) -> std::io::Result<PathBuf> {
    let mut abs = PathBuf::new();
    for c in std::path::absolute(p)?.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                abs.pop();
            }
            c => abs.push(c),
        }
    }
    let mut rest = Vec::new();
    let mut base = abs.as_path();
    loop {
        if let Ok(real) = base.canonicalize() {
            return Ok(rest.iter().rev().fold(real, |acc, n| acc.join(n)));
        }
        match (base.file_name(), base.parent()) {
            (Some(n), Some(parent)) => {
                rest.push(n.to_owned());
                base = parent;
            }
            _ => return Ok(abs),
        }
    }
}

fn acquire(lock: &Path, guarded: &Path, what: &str, wait: bool) -> Result<DirLock> {
    for _ in 0..50 {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(lock)
            .with_context(|| format!("cannot open the lock file {}", lock.display()))?;
        match flock(&file, false) {
            Ok(true) => {}
            Ok(false) if wait => {
                crate::errln!(
                    "waiting for {} to finish with {} (lock {})",
                    holder(&file).1,
                    guarded.display(),
                    lock.display()
                );
                flock(&file, true).with_context(|| format!("cannot lock {}", lock.display()))?;
            }
            Ok(false) => {
                let (pid, holder) = holder(&file);
                return Err(Locked {
                    dir: guarded.to_owned(),
                    lock: lock.to_owned(),
                    pid,
                    holder,
                }
                .into());
            }
            Err(e) if unsupported(&e) => {
                crate::errln!(
                    "warning: cannot lock {} ({e}): nothing stops another process from writing \
                     {} meanwhile",
                    lock.display(),
                    guarded.display()
                );
                return Ok(held(None, lock));
            }
            Err(e) => return Err(e).with_context(|| format!("cannot lock {}", lock.display())),
        }
        // The holder we waited for (or a dead one's cleanup) may have removed this file.
        if same_file(&file, lock) {
            let mut f = &file;
            f.set_len(0)
                .and_then(|()| f.write_all(format!("{} {what}\n", std::process::id()).as_bytes()))
                .with_context(|| format!("cannot write the lock file {}", lock.display()))?;
            return Ok(held(Some(file), lock));
        }
    }
    bail!(
        "cannot lock {}: its lock file {} keeps being replaced",
        guarded.display(),
        lock.display()
    )
}

fn held(file: Option<File>, lock: &Path) -> DirLock {
    DirLock {
        file,
        path: lock.to_owned(),
        _exit: remove_on_exit(lock, false),
    }
}

/// The pid and a description of the process a taken lock file names (it may be writing it
/// right now: read again for a moment until it says something).
fn holder(file: &File) -> (Option<u32>, String) {
    let mut text = String::new();
    for _ in 0..20 {
        text.clear();
        let mut f = file;
        let _ = std::io::Seek::rewind(&mut f);
        let _ = f.read_to_string(&mut text);
        if !text.trim().is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let line = text.lines().next().unwrap_or("").trim();
    let (pid, cmd) = line.split_once(' ').unwrap_or((line, ""));
    match pid.parse::<u32>() {
        Ok(p) if cmd.is_empty() => (Some(p), format!("pid {p}")),
        Ok(p) => (Some(p), format!("pid {p} ({})", cmd.trim())),
        Err(_) => (None, "another process".to_string()),
    }
}

/// Whether a process with this pid exists (one of another user's counts).
pub(crate) fn pid_alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(p) = libc::pid_t::try_from(pid) else {
            return false;
        };
        if p <= 0 {
            return false;
        }
        // SAFETY: kill with signal 0 sends nothing; it only checks that the pid exists.
        let rc = unsafe { libc::kill(p, 0) };
        rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Whether `file` is flock()ed (exclusive) now, without waiting: false when another holds it,
/// on an error, and where there is no flock (so a caller never takes a lock for free).
pub(crate) fn try_flock(file: &File) -> bool {
    cfg!(unix) && matches!(flock(file, false), Ok(true))
}

/// flock(LOCK_EX) on `file`, the lock file at `path`: at once when free, else after saying
/// `waiting` (with the lock's path) on stderr, blocking until its holder closes it.
pub(crate) fn flock_waiting(file: &File, path: &Path, waiting: &str) -> Result<()> {
    if let Ok(true) = flock(file, false) {
        return Ok(());
    }
    crate::errln!("{waiting} (lock {})", path.display());
    flock(file, true).with_context(|| format!("cannot lock {}", path.display()))?;
    Ok(())
}

/// flock(LOCK_EX), blocking or not: Ok(false) when another holds it.
#[cfg(unix)]
fn flock(file: &File, block: bool) -> std::io::Result<bool> {
    use std::os::unix::io::AsRawFd;
    let op = match block {
        true => libc::LOCK_EX,
        false => libc::LOCK_EX | libc::LOCK_NB,
    };
    loop {
        // SAFETY: flock on a descriptor we own; it reads only the descriptor and the flags.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) if !block => return Ok(false),
            _ => return Err(e),
        }
    }
}

#[cfg(not(unix))]
fn flock(_: &File, _: bool) -> std::io::Result<bool> {
    Ok(true)
}

/// A filesystem without flock (some network filesystems).
fn unsupported(e: &std::io::Error) -> bool {
    #[cfg(unix)]
    {
        matches!(
            e.raw_os_error(),
            Some(libc::ENOLCK) | Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
        )
    }
    #[cfg(not(unix))]
    {
        let _ = e;
        false
    }
}

/// Whether `path` is still the file `file` has open.
fn same_file(file: &File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (file.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = file;
        path.exists()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time_named_by_pid_and_released_on_drop() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("out");
        let a = DirLock::try_dir(&dir, "lora-train test").unwrap();
        let real = tmp.path().canonicalize().unwrap();
        assert_eq!(a.path(), real.join(".out.lora-train.lock"));
        assert_eq!(
            std::fs::read_to_string(a.path()).unwrap(),
            format!("{} lora-train test\n", std::process::id())
        );
        // Another spelling of the same directory finds it taken (flock is per open file, so
        // this process is a second holder as much as another would be).
        std::fs::create_dir_all(tmp.path().join("sub")).unwrap();
        let other = tmp.path().join("sub/../out/.");
        let e = DirLock::try_dir(&other, "lora-train test").unwrap_err();
        let l = e.downcast_ref::<Locked>().unwrap();
        assert_eq!(l.pid, Some(std::process::id()));
        assert_eq!(
            e.to_string(),
            format!(
                "{} is in use: pid {} (lora-train test) holds its lock {}; wait for it to end \
                 (or stop it), or choose another directory",
                other.display(),
                std::process::id(),
                a.path().display()
            )
        );
        let path = a.path().to_owned();
        drop(a);
        assert!(!path.exists());
        // A lock file that nobody holds (its writer died) is taken over.
        std::fs::write(&path, "999999999 lora-train train\n").unwrap();
        let b = DirLock::try_dir(&dir, "lora-train test").unwrap();
        assert!(std::fs::read_to_string(b.path())
            .unwrap()
            .starts_with(&std::process::id().to_string()));
        assert!(!pid_alive(999_999_999) && pid_alive(std::process::id()));
    }

    #[test]
    fn a_waiting_lock_gets_it_when_the_holder_lets_go() {
        let tmp = tempfile::tempdir().unwrap();
        let lock = tmp.path().join("locks/repo.lock");
        let a = DirLock::wait(&lock, tmp.path(), "first").unwrap();
        let l2 = lock.clone();
        let t = std::thread::spawn(move || {
            let b = DirLock::wait(&l2, Path::new("repo"), "second").unwrap();
            std::fs::read_to_string(b.path()).unwrap()
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(a);
        let text = t.join().unwrap();
        assert_eq!(text, format!("{} second\n", std::process::id()));
    }
}
