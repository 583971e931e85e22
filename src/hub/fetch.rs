//! One file into the cache: GET (with `Range` from the bytes already there) into
//! `blobs/<etag>.incomplete`, continued across attempts and across runs, then held to what the
//! Hub declared before it is renamed into `blobs/<etag>`: its length (the HEAD's
//! `X-Linked-Size` or `Content-Length`, else the GET's own), an LFS file's sha256 (its ETag).
//! A body of another length or another hash, a download host that promises more bytes than the
//! Hub did, an empty body nobody declared: errors naming the cause, and nothing cached as
//! complete.

use super::cache::RepoCache;
use super::download::{
    header, http_error, is_http, join_url, origin, transient_error, transient_status, At, Fail,
    Hub, Remote,
};
use super::progress::FileBar;
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

/// An attempt that fetched less than this is not progress: a server that drips a few bytes
/// per connection runs out of attempts instead of holding the run forever.
const PROGRESS: u64 = 1 << 20;

/// The most redirects one GET follows.
const MAX_HOPS: usize = 8;

/// A length and the header that declared it.
type Declared = Option<(u64, &'static str)>;

impl Hub<'_> {
    /// Makes `blobs/<etag>` hold `remote`'s bytes: nothing to do when it is there, else
    /// downloads into `blobs/<etag>.incomplete` (continuing what an earlier attempt or run left
    /// there), checks length and hash and renames. Returns the bytes that came over the network.
    pub(crate) fn fetch(&self, cache: &RepoCache, at: &At, remote: &Remote) -> Result<u64> {
        let blob = cache.blob(&remote.etag);
        if blob.is_file() {
            return Ok(0);
        }
        let blobs = cache.dir.join("blobs");
        std::fs::create_dir_all(&blobs)
            .with_context(|| format!("cannot create {}", blobs.display()))?;
        let _lock = cache.lock(&remote.etag)?;
        if blob.is_file() {
            return Ok(0); // another process finished it while we waited for the lock
        }
        let part = cache.incomplete(&remote.etag);
        // Append mode: after a truncation to 0 the writes start at 0 again.
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&part)
            .with_context(|| format!("cannot open {}", part.display()))?;
        let len = |f: &File| f.metadata().map(|m| m.len());
        let mut have = len(&file)?;
        if remote.size.is_some_and(|s| have > s) {
            file.set_len(0)?;
            have = 0;
        }
        if let Some(size) = remote.size {
            check_space(&blobs, size.saturating_sub(have), at)?;
        }
        let bar = FileBar::new(at.file, remote.size, have);
        if have > 0 {
            bar.note(&format!(
                "{}: resuming at byte {have} of {}",
                at.file,
                remote.size.map_or("?".into(), |s| s.to_string())
            ));
        }
        let started_at = have;
        let mut declared: Declared = remote.size.map(|s| (s, remote.size_from));
        let mut attempt = 0;
        loop {
            if declared.is_some_and(|(s, _)| s == have) {
                break;
            }
            let before = have;
            let res = self.get_into(&mut file, at, &remote.url, have, &bar, &mut declared);
            have = len(&file)?;
            match res {
                Ok(()) => break,
                Err(Fail::Stop(e)) => {
                    bar.abandon();
                    return Err(e);
                }
                Err(Fail::Retry(why)) => {
                    if have >= before + PROGRESS {
                        attempt = 0; // progress was made: this is a flaky link, not a dead one
                    }
                    if attempt >= self.retries {
                        bar.abandon();
                        let kept = format!(
                            "{why} (after {} attempts; {have} bytes kept in {} for the next run)",
                            self.retries + 1,
                            part.display()
                        );
                        return Err(self.unreachable(at, kept));
                    }
                    bar.note(&format!("{}: {why}; resuming at byte {have}", at.file));
                    std::thread::sleep(self.backoff * 2u32.pow(attempt.min(5)));
                    attempt += 1;
                }
            }
        }
        file.sync_all()
            .with_context(|| format!("cannot write {}", part.display()))?;
        drop(file);
        if let Err(e) = check_complete(at, remote, &part, have, declared) {
            let _ = std::fs::remove_file(&part);
            return Err(e);
        }
        std::fs::rename(&part, &blob)
            .with_context(|| format!("cannot rename {} to {}", part.display(), blob.display()))?;
        bar.finish(have - started_at);
        Ok(have - started_at)
    }

    /// One GET from byte `from` to the end, appended to `file`, following redirects. Holds the
    /// response's length to `declared` (and declares it when nothing did).
    fn get_into(
        &self,
        file: &mut File,
        at: &At,
        url: &str,
        from: u64,
        bar: &FileBar,
        declared: &mut Declared,
    ) -> Result<(), Fail> {
        let stop = |m: String| Fail::Stop(anyhow::anyhow!(m));
        let mut url = url.to_string();
        let mut hops = 0;
        let resp = loop {
            if !is_http(&url) {
                return Err(stop(format!(
                    "{at}: the download was sent to {url}, which is not an http(s) URL"
                )));
            }
            let resp = match self.send(false, &url, (from > 0).then_some(from)) {
                Ok(r) => r,
                Err(e) if transient_error(&e) => return Err(Fail::Retry(e.to_string())),
                Err(e) => return Err(Fail::Stop(self.unreachable(at, e.to_string()))),
            };
            let status = resp.status().as_u16();
            if !(300..400).contains(&status) {
                break resp;
            }
            let Some(loc) = header(&resp, "location").filter(|l| !l.trim().is_empty()) else {
                return Err(stop(format!(
                    "{} answered HTTP {status} without a Location for {at}",
                    origin(&url)
                )));
            };
            hops += 1;
            if hops > MAX_HOPS {
                return Err(stop(format!(
                    "{at}: more than {MAX_HOPS} redirects (the last from {url} to {loc}): a \
                     redirect loop"
                )));
            }
            url = join_url(&url, &loc);
        };
        let status = resp.status().as_u16();
        let host = origin(&url).to_string();
        let io = |e: std::io::Error| {
            Fail::Stop(anyhow::Error::from(e).context(format!("cannot write the download of {at}")))
        };
        let length = match header(&resp, "content-length") {
            Some(v) => Some(
                byte_count("Content-Length", &v)
                    .map_err(|m| stop(format!("{at}: {host} sent {m}")))?,
            ),
            None => None,
        };
        // What the response says the whole file is.
        let whole = match status {
            206 => {
                let range = header(&resp, "content-range").unwrap_or_default();
                if !range.starts_with(&format!("bytes {from}-")) {
                    file.set_len(0).map_err(io)?;
                    bar.set_position(0);
                    return Err(Fail::Retry(format!(
                        "the server sent the range \"{range}\" for bytes {from}-"
                    )));
                }
                let total = range.rsplit('/').next().and_then(|t| t.parse::<u64>().ok());
                if let (Some(t), Some(l)) = (total, length) {
                    if t.checked_sub(from) != Some(l) {
                        return Err(stop(format!(
                            "{at}: {host} sent {l} bytes (Content-Length) for the range \
                             \"{range}\""
                        )));
                    }
                }
                total.map(|t| (t, "Content-Range"))
            }
            200 => {
                // The whole file, whatever was asked: start over.
                file.set_len(0).map_err(io)?;
                bar.set_position(0);
                length.map(|l| (l, "Content-Length"))
            }
            416 => {
                file.set_len(0).map_err(io)?;
                bar.set_position(0);
                return Err(Fail::Retry(format!(
                    "bytes {from}- are beyond the end (HTTP 416)"
                )));
            }
            s if transient_status(s) => return Err(Fail::Retry(format!("HTTP {s}"))),
            s if host != origin(&self.env.endpoint) => {
                return Err(stop(format!(
                    "{host}, where {} sent the download of {at}, answered HTTP {s}: its signed \
                     URL may have expired; run again",
                    self.env.endpoint
                )))
            }
            s => return Err(Fail::Stop(http_error(self.env, at, s, &resp))),
        };
        match (*declared, whole) {
            (Some((d, by)), Some((w, how))) if d != w => {
                file.set_len(0).map_err(io)?;
                return Err(stop(format!(
                    "{at}: the file is {d} bytes by {by}, but {host} sends {w} ({how}); nothing \
                     was kept: run again (a proxy or mirror that alters files gives this every \
                     time)"
                )));
            }
            (None, w) => *declared = w,
            _ => {}
        }
        let mut pos = if status == 200 { 0 } else { from };
        let mut body = resp.into_body().into_reader();
        let mut buf = vec![0u8; 1 << 18];
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n as u64,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if timed_out(&e) => {
                    return Err(Fail::Retry(format!(
                        "no bytes came for {:.0} s (HF_HUB_DOWNLOAD_TIMEOUT)",
                        self.env.download_timeout.as_secs_f64()
                    )))
                }
                Err(e) => return Err(Fail::Retry(format!("connection dropped ({e})"))),
            };
            if let Some((d, by)) = *declared {
                if pos + n > d {
                    file.set_len(0).map_err(io)?;
                    return Err(stop(format!(
                        "{at}: {host} sent more than the {d} bytes {by} declared; nothing was \
                         kept: run again"
                    )));
                }
            }
            file.write_all(&buf[..n as usize]).map_err(io)?;
            pos += n;
            bar.inc(n);
        }
        match *declared {
            Some((d, _)) if pos < d => Err(Fail::Retry(format!(
                "the connection closed at byte {pos} of {d}"
            ))),
            _ => Ok(()),
        }
    }
}

/// A read that waited longer than the time-out (ureq's, as an io::Error, or the socket's).
fn timed_out(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::TimedOut
        || e.get_ref()
            .and_then(|i| i.downcast_ref::<ureq::Error>())
            .is_some_and(|u| matches!(u, ureq::Error::Timeout(_)))
}

/// The downloaded `part` (`have` bytes) is what the Hub declared: its length, an empty file
/// only when declared so, an LFS file's sha256.
fn check_complete(
    at: &At,
    remote: &Remote,
    part: &Path,
    have: u64,
    declared: Declared,
) -> Result<()> {
    if let Some((size, by)) = declared {
        if have != size {
            bail!(
                "{at}: downloaded {have} bytes, but {by} declared {size}; the partial file was \
                 deleted: run again"
            );
        }
    }
    if have == 0 && remote.size != Some(0) {
        bail!(
            "{at}: the download ({}) has no bytes, and the Hub declared no size for it; nothing \
             was cached: run again",
            remote.url
        );
    }
    // An LFS file's ETag is its sha256.
    if is_sha256(&remote.etag) {
        let got = sha256_file(part)?;
        if got != remote.etag {
            bail!(
                "{at}: the downloaded bytes have sha256 {got}, but the Hub names the file by \
                 its sha256 {}; the download was deleted: run again (a proxy or mirror that \
                 alters files gives this every time)",
                remote.etag
            );
        }
    }
    Ok(())
}

/// A header's value as a byte count, or what is wrong with it.
pub(super) fn byte_count(name: &str, v: &str) -> Result<u64, String> {
    v.trim()
        .parse()
        .map_err(|_| format!("{name} \"{v}\", which is not a byte count"))
}

/// Refuses a download the disk under `dir` cannot hold (`need` more bytes), before any byte.
fn check_space(dir: &Path, need: u64, at: &At) -> Result<()> {
    let Some(free) = free_bytes(dir) else {
        return Ok(());
    };
    if need > free {
        bail!(
            "{at}: the Hub declares {} ({need} bytes) still to download, but the filesystem of \
             {} has {} free: free some space, or set HF_HUB_CACHE to a larger disk",
            indicatif::HumanBytes(need),
            dir.display(),
            indicatif::HumanBytes(free)
        );
    }
    Ok(())
}

/// The bytes an unprivileged process may still write on the filesystem of `dir`.
#[cfg(unix)]
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain old data; zeroed is a valid value for it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a pointer to a statvfs we own.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

#[cfg(not(unix))]
fn free_bytes(_: &Path) -> Option<u64> {
    None
}

/// 64 lowercase hex digits: the ETag the Hub gives an LFS file (its sha256).
pub(super) fn is_sha256(etag: &str) -> bool {
    etag.len() == 64 && etag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The sha256 of a file, in lowercase hex, read in 1 MiB pieces.
pub(crate) fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        ctx.update(&buf[..n]);
    }
    Ok(ctx
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_and_counts() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("x");
        std::fs::write(&p, b"abc").unwrap();
        assert_eq!(
            sha256_file(&p).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(is_sha256(&"ab".repeat(32)) && !is_sha256(&"AB".repeat(32)));
        assert_eq!(byte_count("X-Linked-Size", " 12 "), Ok(12));
        for bad in ["-1", "1e3", "", "99999999999999999999999"] {
            assert!(byte_count("X-Linked-Size", bad).is_err(), "{bad}");
        }
        assert!(free_bytes(tmp.path()).is_some_and(|b| b > 0));
    }
}
