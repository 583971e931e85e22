//! Paths kept as the OS gives them: a path that is not UTF-8 (TOML and JSON hold only UTF-8)
//! is recorded relative to the directory of the file that records it where that form is
//! UTF-8 (`recordable`), and shown or compared with its odd bytes escaped (`escaped`).

use std::path::{Component, Path, PathBuf};

/// `path` as a file in directory `dir` may record it: as it is where it is UTF-8, else
/// relative to `dir` where that is UTF-8 (a run and its base in one oddly named directory);
/// None where neither is.
pub(crate) fn recordable(path: &Path, dir: &Path) -> Option<PathBuf> {
    if path.to_str().is_some() {
        return Some(path.to_owned());
    }
    relative_to(path, dir).filter(|r| r.to_str().is_some())
}

/// `path` relative to directory `dir` (both made absolute against the working directory, and
/// resolved through symbolic links where they exist): `..` for each of `dir`'s components
/// past the common prefix, then the rest of `path`; "." for `dir` itself.
pub(crate) fn relative_to(path: &Path, dir: &Path) -> Option<PathBuf> {
    let full = |p: &Path| {
        std::fs::canonicalize(p)
            .ok()
            .or_else(|| std::path::absolute(p).ok())
    };
    let (path, dir) = (full(path)?, full(dir)?);
    let (p, d): (Vec<Component>, Vec<Component>) =
        (path.components().collect(), dir.components().collect());
    let common = p.iter().zip(&d).take_while(|(a, b)| a == b).count();
    if common == 0 {
        return None;
    }
    let mut out = PathBuf::new();
    for _ in common..d.len() {
        out.push("..");
    }
    for c in &p[common..] {
        out.push(c.as_os_str());
    }
    if out.as_os_str().is_empty() {
        out.push(".");
    }
    Some(out)
}

/// `path` as UTF-8 text, each byte that is not part of UTF-8 written `\xNN`: for messages and
/// for comparing paths (distinct paths stay distinct but for a path that spells `\xNN` itself).
pub(crate) fn escaped(path: &Path) -> String {
    let mut out = String::new();
    for chunk in path.as_os_str().as_encoded_bytes().utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn odd_paths_are_recorded_relative_and_escaped() {
        let odd = Path::new(OsStr::from_bytes(b"/nowhere/lt-\xff-dir"));
        let base = odd.join("base");
        let run = odd.join("run");
        assert_eq!(relative_to(&base, &run), Some(PathBuf::from("../base")));
        assert_eq!(recordable(&base, &run), Some(PathBuf::from("../base")));
        assert_eq!(relative_to(&run, &run), Some(PathBuf::from(".")));
        assert_eq!(
            recordable(&base, Path::new("/elsewhere/run")),
            None,
            "../../nowhere/lt-\\xff-dir/base is not UTF-8 either"
        );
        let plain = Path::new("/srv/models/base");
        assert_eq!(recordable(plain, &run), Some(plain.to_owned()));
        assert_eq!(escaped(&base), "/nowhere/lt-\\xFF-dir/base");
        assert_eq!(escaped(plain), "/srv/models/base");
    }
}
