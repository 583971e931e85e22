//! `[model] id` and `lora-train download` against a loopback server that answers like the
//! Hub's resolve endpoint: HEAD with ETag / X-Repo-Commit (LFS files: 302 to a "CDN" on
//! another host name with X-Linked-Etag / X-Linked-Size), GET with Range (206), X-Error-Code
//! on 401 / 403 / 404. It serves the tiny model we ship, its weights split into 2 shards.

use crate::common::root;
use assert_cmd::Command;
use std::collections::BTreeMap;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const REPO: &str = "tiny/llama";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const SHARD1: &str = "model-00001-of-00002.safetensors";
const SHARD2: &str = "model-00002-of-00002.safetensors";
const TOKEN: &str = "hf_lora_train_test_token_8c1f";

/// A file as served: bytes, ETag, and whether it is an LFS file (served through the CDN).
#[derive(Clone)]
struct File {
    bytes: Vec<u8>,
    etag: String,
    lfs: bool,
}

/// The tiny model's files with its weights in 2 shards + index, as a Hub repository holds them.
fn tiny_repo() -> BTreeMap<String, File> {
    let dir = root().join("recipes/assets/tiny-llama");
    let mut files = BTreeMap::new();
    let mut add = |name: &str, bytes: Vec<u8>| {
        let lfs = name.ends_with(".safetensors");
        // As the Hub: an LFS file's ETag is its sha256 (checked by the client); a stand-in for
        // the git blob sha1 otherwise.
        let h = fnv(&bytes);
        let etag = if lfs {
            sha256(&bytes)
        } else {
            format!("{h:016x}{:024x}", bytes.len())
        };
        files.insert(name.to_string(), File { bytes, etag, lfs });
    };
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        add(f, std::fs::read(dir.join(f)).unwrap());
    }
    let raw = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
    let mut names = st.names();
    names.sort();
    let half = names.len() / 2;
    let mut weight_map = serde_json::Map::new();
    for (shard, part) in [(SHARD1, &names[..half]), (SHARD2, &names[half..])] {
        let views: Vec<_> = part
            .iter()
            .map(|n| (n.to_string(), st.tensor(n).unwrap()))
            .collect();
        for n in part {
            weight_map.insert(n.to_string(), shard.into());
        }
        add(shard, safetensors::serialize(views, None).unwrap());
    }
    let index =
        serde_json::json!({"metadata": {"total_size": raw.len()}, "weight_map": weight_map});
    add(
        "model.safetensors.index.json",
        serde_json::to_vec_pretty(&index).unwrap(),
    );
    files
}

pub fn sha256(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
struct Req {
    method: String,
    host: String,
    path: String,
    range: Option<String>,
    auth: Option<String>,
}

/// How the server misbehaves, once each.
#[derive(Default)]
struct Faults {
    /// Close the connection after this many body bytes of the first GET of this file.
    drop_first_get: Option<(String, usize)>,
    /// Send this many body bytes of the first GET of this file, then hang until released.
    stall_first_get: Option<(String, usize, Receiver<()>)>,
}

struct Access {
    /// Requests must carry `Bearer <token>`.
    token: Option<String>,
    /// 401 / 403 with X-Error-Code GatedRepo instead of RepositoryNotFound.
    gated: bool,
}

/// A loopback "Hub" on 127.0.0.1 (its CDN: `localhost`, the same port), in a thread that
/// serves one connection at a time and stops when dropped, or after two minutes.
struct FakeHub {
    port: u16,
    log: Arc<Mutex<Vec<Req>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeHub {
    fn start(files: BTreeMap<String, File>, access: Access, mut faults: Faults) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (log2, stop2) = (log.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(120);
            while !stop2.load(Ordering::SeqCst) && Instant::now() < deadline {
                match listener.accept() {
                    Ok((s, _)) => {
                        let _ = serve(s, port, &files, &access, &mut faults, &log2);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        FakeHub {
            port,
            log,
            stop,
            thread: Some(thread),
        }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn requests(&self) -> Vec<Req> {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Answers one request on `s` and closes it.
fn serve(
    s: TcpStream,
    port: u16,
    files: &BTreeMap<String, File>,
    access: &Access,
    faults: &mut Faults,
    log: &Mutex<Vec<Req>>,
) -> std::io::Result<()> {
    let (method, path, headers) = crate::common::read_request_head(&s)?;
    let req = Req {
        method: method.clone(),
        host: headers.get("host").cloned().unwrap_or_default(),
        path: path.clone(),
        range: headers.get("range").cloned(),
        auth: headers.get("authorization").cloned(),
    };
    log.lock().unwrap().push(req.clone());
    let mut out = s;
    let head = method == "HEAD";
    let reply = |out: &mut TcpStream, status: &str, hs: &[(&str, String)], body: &[u8]| {
        let mut text = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
        for (k, v) in hs {
            text.push_str(&format!("{k}: {v}\r\n"));
        }
        text.push_str("\r\n");
        out.write_all(text.as_bytes())?;
        if !head {
            out.write_all(body)?;
        }
        out.flush()
    };
    let error = |out: &mut TcpStream, status: &str, code: &str| {
        let msg = format!("{code} (fake hub)");
        reply(
            out,
            status,
            &[
                ("X-Error-Code", code.to_string()),
                ("X-Error-Message", msg.clone()),
                ("X-Repo-Commit", COMMIT.to_string()),
                ("Content-Length", msg.len().to_string()),
            ],
            msg.as_bytes(),
        )
    };

    // The CDN: bytes by ETag, with Range.
    if let Some(etag) = path.strip_prefix("/cdn/") {
        let Some((name, f)) = files.iter().find(|(_, f)| f.etag == etag) else {
            return error(&mut out, "404 Not Found", "EntryNotFound");
        };
        let from: usize = req
            .range
            .as_deref()
            .and_then(|r| r.strip_prefix("bytes="))
            .and_then(|r| r.strip_suffix('-'))
            .map_or(0, |n| n.parse().unwrap());
        let body = &f.bytes[from..];
        let mut hs = vec![("Content-Length", body.len().to_string())];
        let status = if req.range.is_some() {
            hs.push((
                "Content-Range",
                format!("bytes {from}-{}/{}", f.bytes.len() - 1, f.bytes.len()),
            ));
            "206 Partial Content"
        } else {
            "200 OK"
        };
        if !head {
            if let Some((_, n)) = faults.drop_first_get.take_if(|(f, _)| f == name) {
                reply(&mut out, status, &hs, &body[..n])?;
                return out.shutdown(std::net::Shutdown::Both);
            }
            if let Some((_, n, release)) = faults.stall_first_get.take_if(|(f, ..)| f == name) {
                reply(&mut out, status, &hs, &body[..n])?;
                let _ = release.recv_timeout(Duration::from_secs(60));
                return out.shutdown(std::net::Shutdown::Both);
            }
        }
        return reply(&mut out, status, &hs, body);
    }

    // The resolve endpoint: /{org}/{name}/resolve/{revision}/{file}
    let seg: Vec<&str> = path.splitn(5, '/').skip(1).collect();
    if seg.len() != 4 || seg[2] != "resolve" {
        return error(&mut out, "404 Not Found", "EntryNotFound");
    }
    let repo = format!("{}/{}", seg[0], seg[1]);
    let (rev, file) = seg[3].split_once('/').unwrap_or(("", ""));
    if repo == "tiny/llama-old" {
        // A renamed repository: a relative redirect to the new name.
        let to = format!("/{REPO}/resolve/{rev}/{file}");
        return reply(
            &mut out,
            "307 Temporary Redirect",
            &[("Location", to), ("Content-Length", "0".into())],
            b"",
        );
    }
    if let Some(t) = &access.token {
        let ok = req.auth.as_deref() == Some(&format!("Bearer {t}"));
        match (ok, req.auth.is_some(), access.gated) {
            (true, ..) => {}
            (false, false, true) => return error(&mut out, "401 Unauthorized", "GatedRepo"),
            (false, true, true) => return error(&mut out, "403 Forbidden", "GatedRepo"),
            (false, ..) => return error(&mut out, "401 Unauthorized", "RepositoryNotFound"),
        }
    }
    if repo != REPO {
        return error(&mut out, "401 Unauthorized", "RepositoryNotFound");
    }
    if rev != "main" && rev != COMMIT {
        return error(&mut out, "404 Not Found", "RevisionNotFound");
    }
    let Some(f) = files.get(file) else {
        return error(&mut out, "404 Not Found", "EntryNotFound");
    };
    let mut hs = vec![("X-Repo-Commit", COMMIT.to_string())];
    if f.lfs {
        // As the Hub: the redirect's own ETag and length are not the file's.
        hs.push((
            "Location",
            format!("http://localhost:{port}/cdn/{}", f.etag),
        ));
        hs.push(("X-Linked-Etag", format!("\"{}\"", f.etag)));
        hs.push(("X-Linked-Size", f.bytes.len().to_string()));
        hs.push(("ETag", "\"redirect-etag\"".into()));
        hs.push(("Content-Length", "0".into()));
        reply(&mut out, "302 Found", &hs, b"")
    } else {
        hs.push(("ETag", format!("\"{}\"", f.etag)));
        hs.push(("Content-Length", f.bytes.len().to_string()));
        reply(&mut out, "200 OK", &hs, &f.bytes)
    }
}

fn bin(hf_home: &Path, endpoint: &str) -> Command {
    crate::loopback::hub_command(hf_home, endpoint)
}

fn std_bin(hf_home: &Path, endpoint: &str) -> std::process::Command {
    crate::loopback::hub_std_command(hf_home, endpoint)
}

fn out_err(o: &std::process::Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn repo_dir(hf_home: &Path) -> PathBuf {
    hf_home.join("hub/models--tiny--llama")
}

/// Every file under `dir` (following nothing: symlinks are listed, not entered).
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

fn recipe(dir: &Path, out: &Path) -> PathBuf {
    let p = dir.join("hub.toml");
    std::fs::write(
        &p,
        format!(
            r#"[model]
id = "{REPO}"
[data]
train = "{}"
format = "text"
seq_len = 32
[train]
micro_batch = 2
max_steps = 3
lr = 1e-3
[output]
dir = "{}"
"#,
            root().join("recipes/data/tiny-text.jsonl").display(),
            out.display()
        ),
    )
    .unwrap();
    p
}

#[test]
fn hub_model_downloads_resumes_trains_and_runs_offline() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    let files = tiny_repo();
    let hub = FakeHub::start(
        files.clone(),
        Access {
            token: Some(TOKEN.into()),
            gated: false,
        },
        Faults {
            drop_first_get: Some((SHARD1.into(), 100_000)),
            ..Faults::default()
        },
    );
    let recipe = recipe(tmp.path(), &tmp.path().join("run1"));

    // 1. Train on the Hub model: everything is downloaded, the cut shard resumed.
    let o = bin(&hf, &hub.endpoint())
        .env("HF_TOKEN", TOKEN)
        .arg("--recipe")
        .arg(&recipe)
        .output()
        .unwrap();
    let (out, err) = out_err(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.starts_with("trained 3 steps"), "{out}");
    assert!(
        err.contains(&format!("{SHARD1}: connection dropped (",))
            && err.contains("; resuming at byte 100000"),
        "{err}"
    );
    let snap = repo_dir(&hf).join("snapshots").join(COMMIT);
    for (name, f) in &files {
        let got = std::fs::read(snap.join(name)).unwrap();
        assert!(got == f.bytes, "{name} differs from the served file");
        let link = std::fs::read_link(snap.join(name)).unwrap();
        assert_eq!(link, Path::new("../../blobs").join(&f.etag), "{name}");
    }
    assert_eq!(
        std::fs::read_to_string(repo_dir(&hf).join("refs/main")).unwrap(),
        COMMIT
    );
    assert!(repo_dir(&hf)
        .join(".no_exist")
        .join(COMMIT)
        .join("special_tokens_map.json")
        .is_file());
    let blobs = walk(&repo_dir(&hf).join("blobs"));
    assert_eq!(blobs.len(), files.len(), "{blobs:?}");

    let reqs = hub.requests();
    let cdn = |name: &str| {
        let path = format!("/cdn/{}", files[name].etag);
        reqs.iter()
            .filter(|r| r.path == path && r.method == "GET")
            .map(|r| r.range.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(cdn(SHARD1), [None, Some("bytes=100000-".to_string())]);
    assert_eq!(cdn(SHARD2), [None]);
    // The token goes to the endpoint only, never to the CDN's host, and is never shown.
    for r in &reqs {
        if r.host.starts_with("127.0.0.1") {
            assert_eq!(
                r.auth.as_deref(),
                Some(&*format!("Bearer {TOKEN}")),
                "{r:?}"
            );
        } else {
            assert!(r.host.starts_with("localhost") && r.auth.is_none(), "{r:?}");
        }
    }
    assert!(!out.contains(TOKEN) && !err.contains(TOKEN));
    for p in walk(tmp.path()) {
        if let Ok(text) = std::fs::read(&p) {
            let text = String::from_utf8_lossy(&text);
            assert!(!text.contains(TOKEN), "{} holds the token", p.display());
        }
    }
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("run1/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["base_model_name_or_path"], REPO);
    // The commit the base was read at, as PEFT records it (null for a local directory).
    assert_eq!(cfg["revision"], COMMIT);

    // 2. Again, server up: the cache is complete, so not one request.
    let n = reqs.len();
    let o = bin(&hf, &hub.endpoint())
        .arg("--recipe")
        .arg(&recipe)
        .args([
            "--set",
            &format!("output.dir={}", tmp.path().join("run2").display()),
        ])
        .output()
        .unwrap();
    let (_, err) = out_err(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "model {REPO} at \"main\" = commit {COMMIT}, from the cache {}",
            repo_dir(&hf).display()
        )),
        "{err}"
    );
    assert_eq!(hub.requests().len(), n, "a complete cache needs no network");

    // A renamed repository (relative redirect) resolves to the same files.
    let o = bin(&hf, &hub.endpoint())
        .env("HF_TOKEN", TOKEN)
        .args(["download", "tiny/llama-old"])
        .output()
        .unwrap();
    let (out, err) = out_err(&o);
    assert!(o.status.success(), "{err}");
    let old_snap = hf
        .join("hub/models--tiny--llama-old/snapshots")
        .join(COMMIT);
    assert_eq!(out.trim(), old_snap.display().to_string());
    assert!(std::fs::read(old_snap.join(SHARD2)).unwrap() == files[SHARD2].bytes);
    let endpoint = hub.endpoint();
    drop(hub);

    // 3. Server gone: training runs from the cache, and gives the same adapter.
    let o = bin(&hf, &endpoint)
        .arg("--recipe")
        .arg(&recipe)
        .args([
            "--set",
            &format!("output.dir={}", tmp.path().join("run3").display()),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", out_err(&o).1);
    let adapter =
        |run: &str| std::fs::read(tmp.path().join(run).join("adapter_model.safetensors")).unwrap();
    assert!(adapter("run3") == adapter("run1") && adapter("run2") == adapter("run1"));

    // `download` asks the Hub whether main moved; unreachable, it falls back to the cache.
    let o = bin(&hf, &endpoint)
        .args(["download", REPO])
        .output()
        .unwrap();
    let (out, err) = out_err(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(out.trim(), snap.display().to_string());
    assert!(
        err.contains(&format!("warning: cannot reach {endpoint}")),
        "{err}"
    );
    // ... and at a commit, it needs no network at all.
    let o = bin(&hf, &endpoint)
        .args(["download", REPO, "--revision", COMMIT])
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert_eq!(out_err(&o).0.trim(), snap.display().to_string());

    // 4. Offline with an empty cache: the error says what is missing and how to get it.
    let empty = tmp.path().join("empty");
    let o = bin(&empty, &endpoint)
        .env("HF_HUB_OFFLINE", "1")
        .arg("--recipe")
        .arg(&recipe)
        .args([
            "--set",
            &format!("output.dir={}", tmp.path().join("run4").display()),
        ])
        .output()
        .unwrap();
    let (_, err) = out_err(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(
        err,
        format!(
            "error: HF_HUB_OFFLINE is set and the cache {} has no snapshot of it ({REPO} at \
             revision \"main\"): download it first where the Hub is reachable (`lora-train \
             download {REPO} --revision main`), or unset HF_HUB_OFFLINE\n",
            empty.join("hub/models--tiny--llama").display()
        )
    );
    assert!(!tmp.path().join("run4").exists());
}

#[test]
fn a_killed_download_resumes_where_it_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    let files = tiny_repo();
    let (release, stalled): (Sender<()>, Receiver<()>) = channel();
    let hub = FakeHub::start(
        files.clone(),
        Access {
            token: None,
            gated: false,
        },
        Faults {
            stall_first_get: Some((SHARD2.into(), 50_000, stalled)),
            ..Faults::default()
        },
    );
    let mut child = std_bin(&hf, &hub.endpoint())
        .args(["download", REPO])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the first 50 000 bytes are on disk, then SIGKILL the download.
    let part = repo_dir(&hf)
        .join("blobs")
        .join(format!("{}.incomplete", files[SHARD2].etag));
    let t0 = Instant::now();
    while std::fs::metadata(&part).map_or(0, |m| m.len()) < 50_000 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no partial download"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    release.send(()).unwrap();
    assert_eq!(std::fs::metadata(&part).unwrap().len(), 50_000);

    let o = bin(&hf, &hub.endpoint())
        .args(["download", REPO])
        .output()
        .unwrap();
    let (out, err) = out_err(&o);
    assert!(o.status.success(), "{err}");
    let snap = repo_dir(&hf).join("snapshots").join(COMMIT);
    assert_eq!(out, format!("{}\n", snap.display()));
    assert!(
        err.contains(&format!(
            "{SHARD2}: resuming at byte 50000 of {}",
            files[SHARD2].bytes.len()
        )),
        "{err}"
    );
    let ranges: Vec<_> = hub
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.ends_with(&files[SHARD2].etag))
        .map(|r| r.range)
        .collect();
    assert_eq!(ranges, [None, Some("bytes=50000-".to_string())]);
    assert!(std::fs::read(snap.join(SHARD2)).unwrap() == files[SHARD2].bytes);
    assert!(!part.exists());
}

#[test]
fn hub_errors_name_the_repo_revision_file_and_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    let hub = FakeHub::start(
        tiny_repo(),
        Access {
            token: Some(TOKEN.into()),
            gated: true,
        },
        Faults::default(),
    );
    let ep = hub.endpoint();
    let run = |token: Option<&str>, args: &[&str]| {
        let mut c = bin(&hf, &ep);
        if let Some(t) = token {
            c.env("HF_TOKEN", t);
        }
        let o = c.args(args).output().unwrap();
        let (out, err) = out_err(&o);
        assert!(out.is_empty(), "{out}");
        for t in [TOKEN, "hf_wrong_token"] {
            assert!(!err.contains(t), "{err}");
        }
        (o.status.code().unwrap_or(-1), err)
    };
    let at = |repo: &str, rev: &str| format!("config.json of {repo} at revision \"{rev}\"");

    let (code, err) = run(None, &["download", REPO]);
    assert_eq!(code, 1);
    assert_eq!(
        err,
        format!(
            "error: {REPO} is a gated model ({ep} answered HTTP 401 for {}: \"GatedRepo (fake \
             hub)\"): accept its license at {ep}/{REPO} while logged in, and no token was sent: \
             set HF_TOKEN to an access token (huggingface.co/settings/tokens)\n",
            at(REPO, "main")
        )
    );
    let (code, err) = run(Some("hf_wrong_token"), &["download", REPO]);
    assert_eq!(code, 1);
    assert!(
        err.contains("HTTP 403")
            && err.contains("the token that was sent (HF_TOKEN or the token file) cannot read it"),
        "{err}"
    );
    let (code, err) = run(Some(TOKEN), &["download", "tiny/nope"]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with(&format!(
            "error: {ep} refused {} (HTTP 401: \"RepositoryNotFound (fake hub)\"): the \
             repository does not exist, or it is private or gated; check the id \"tiny/nope\"",
            at("tiny/nope", "main")
        )),
        "{err}"
    );
    let (code, err) = run(Some(TOKEN), &["download", REPO, "--revision", "v9"]);
    assert_eq!(code, 1);
    assert_eq!(
        err,
        format!(
            "error: {REPO} has no revision \"v9\" on {ep} (HTTP 404 for {}: \"RevisionNotFound \
             (fake hub)\"): set model.revision (or --revision) to an existing branch, tag or \
             commit\n",
            at(REPO, "v9")
        )
    );
    // A malformed id is a command-line error (exit 2), before any request.
    let n = hub.requests().len();
    let (code, err) = run(None, &["download", "tiny/llama/extra"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("\"tiny/llama/extra\" is not a Hub repository id"),
        "{err}"
    );
    assert_eq!(hub.requests().len(), n);

    // Training a gated model without a token: exit 1, nothing written.
    let out = tmp.path().join("out");
    let recipe = recipe(tmp.path(), &out);
    let (code, err) = run(None, &["--recipe", recipe.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("is a gated model"), "{err}");
    assert!(!out.exists());

    // Nothing listens: the error names the endpoint, the file, and what offline mode needs.
    drop(hub);
    let (code, err) = run(None, &["download", REPO]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with(&format!(
            "error: cannot reach {ep} to download {}: ",
            at(REPO, "main")
        )) && err.contains(&format!(
            "Offline runs (HF_HUB_OFFLINE=1) need every file of the revision in the cache {}: \
             download it where the Hub is reachable (`lora-train download {REPO} --revision \
             main`) or copy that cache here.",
            hf.join("hub").display()
        )),
        "{err}"
    );
}

#[test]
fn bad_hub_keys_in_a_recipe_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    let data = root().join("recipes/data/tiny-text.jsonl");
    let cases = [
        (
            "id = \"org/na me\"",
            "`model.id` \"org/na me\" is not a Hub repository id: expected \"org/name\" \
             (letters, digits, '-', '_', '.'), e.g. \"meta-llama/Llama-3.2-1B\"",
        ),
        (
            "path = \".\"\nrevision = \"v1\"",
            "`model.revision` applies to `model.id` (a Hub repository) only: remove it",
        ),
        (
            "id = \"a/b\"\nrevision = \"\"",
            "`model.revision` = \"\" is not a branch, tag or commit (a git ref name)",
        ),
    ];
    for (model, want) in cases {
        let p = tmp.path().join("r.toml");
        std::fs::write(
            &p,
            format!("[model]\n{model}\n[data]\ntrain = \"{}\"\n", data.display()),
        )
        .unwrap();
        let o = bin(&tmp.path().join("hf"), "http://127.0.0.1:9")
            .args(["check", "--recipe"])
            .arg(&p)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err, format!("error: recipe {}: {want}\n", p.display()));
        assert_eq!(o.status.code(), Some(2));
    }
}

#[test]
fn plan_of_a_hub_model_fetches_config_json_only() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    let hub = FakeHub::start(
        tiny_repo(),
        Access {
            token: None,
            gated: false,
        },
        Faults::default(),
    );
    let recipe = recipe(tmp.path(), &tmp.path().join("run"));
    let o = bin(&hf, &hub.endpoint())
        .args(["plan", "--recipe"])
        .arg(&recipe)
        .args(["--gpu-mem", "1GiB"])
        .output()
        .unwrap();
    let (out, err) = out_err(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("fits as written (single"), "{out}");
    // The cache holds config.json and nothing else: no weights, no tokenizer.
    let blobs = walk(&repo_dir(&hf).join("blobs"));
    assert_eq!(blobs.len(), 1, "{blobs:?}");
    let snap: Vec<String> = walk(&repo_dir(&hf).join("snapshots"))
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(snap, ["config.json"]);
    assert!(hub
        .requests()
        .iter()
        .all(|r| !r.path.contains("safetensors")));
}
