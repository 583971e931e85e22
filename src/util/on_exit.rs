//! What a process removes when it ends at once, without unwinding (the first SIGINT / SIGTERM
//! of an `export` or of a run still loading, a closed output pipe): an output's temporary, the
//! lock file of a directory it owns. Destructors do not run on `std::process::exit`, so each
//! such path is registered here while it exists and [`exit`] removes them first.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// One registered path: its number, the path, and whether an exit names it ("removed the
/// unfinished ...") or removes it silently (a lock file).
struct Entry {
    id: u64,
    path: PathBuf,
    shown: bool,
}

static ENTRIES: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static NEXT: AtomicU64 = AtomicU64::new(0);

/// A path that [`exit`] removes; dropping this forgets it (the path itself stays).
#[derive(Debug)]
pub struct Registered(u64);

impl Drop for Registered {
    fn drop(&mut self) {
        let mut v = ENTRIES.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|e| e.id != self.0);
    }
}

/// Registers `path` (a file or a directory) for removal by [`exit`]; `shown`: the exit's
/// message names it.
pub fn remove_on_exit(path: &Path, shown: bool) -> Registered {
    let id = NEXT.fetch_add(1, Ordering::SeqCst);
    let mut v = ENTRIES.lock().unwrap_or_else(|e| e.into_inner());
    v.push(Entry {
        id,
        path: path.to_owned(),
        shown,
    });
    Registered(id)
}

/// Removes every registered path that exists; returns those to be named that were there. A
/// directory another thread is still writing into is retried until it is gone (a file
/// created between the listing and the rmdir), a bounded number of times.
pub(crate) fn remove_registered() -> Vec<PathBuf> {
    remove_where(|_| true)
}

/// [`remove_registered`] for the registered paths that `pick` accepts.
fn remove_where(pick: impl Fn(&Path) -> bool) -> Vec<PathBuf> {
    let v = ENTRIES.lock().unwrap_or_else(|e| e.into_inner());
    let mut removed = Vec::new();
    for e in v.iter().filter(|e| pick(&e.path)) {
        let Ok(meta) = std::fs::symlink_metadata(&e.path) else {
            continue;
        };
        if meta.is_dir() {
            for _ in 0..100 {
                if std::fs::remove_dir_all(&e.path).is_ok() || !e.path.exists() {
                    break;
                }
            }
        } else {
            let _ = std::fs::remove_file(&e.path);
        }
        if e.shown {
            removed.push(e.path.clone());
        }
    }
    removed
}

/// Removes the registered paths and ends the process with `code`.
pub fn exit(code: i32) -> ! {
    remove_registered();
    std::process::exit(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_paths_are_removed_until_forgotten() {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, file, kept) = (
            tmp.path().join("d"),
            tmp.path().join("f"),
            tmp.path().join("k"),
        );
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/x"), "x").unwrap();
        std::fs::write(&file, "f").unwrap();
        std::fs::write(&kept, "k").unwrap();
        let _d = remove_on_exit(&dir, true);
        let _f = remove_on_exit(&file, false);
        drop(remove_on_exit(&kept, true));
        let removed = remove_where(|p| p.starts_with(tmp.path()));
        assert!(removed.contains(&dir) && !removed.contains(&file));
        assert!(!dir.exists() && !file.exists() && kept.exists());
    }
}
