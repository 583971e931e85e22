//! A Hub that lies (`liar`), in 37 ways: wrong and missing lengths, bodies cut short, altered
//! or longer than declared, slow drips and silence past the time-outs, redirect loops, redirects
//! off the endpoint's origin, to other schemes or without a Location, sizes that are no numbers
//! or larger than the disk, bad JSON, file names that leave the snapshot, 5xx then the file, 401
//! / 403 / 404 with and without tokens, commits and ETags that are not what they claim. Each
//! runs the real binary (`download`, or `train` on an hf:// data set) against its own server,
//! and each is handled cleanly: exit 0 with the true bytes where the client can see through the
//! lie, else exit 1 with an error naming the cause; never a panic; nothing in the cache's
//! snapshots that is not the true file; the token only ever sent to the endpoint's own origin
//! and never printed. (Names and the cache's place: `hub_names`.)

use crate::common::root;
use crate::hub::sha256;
use crate::liar::{
    at, cdn, commit_hdr, config, config_elsewhere, config_etag, honest, index, lfs_redirect,
    partial, s, set, weights, weights_head, Body, Liar, Lie, Reply, Req, Server, COMMIT, CONFIG,
    DATASET, REPO, TOKEN,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const OTHER: &str = "0000000000000000000000000000000000000001";
/// What a case runs.
enum Cmd {
    /// `lora-train download tiny/m` and these arguments.
    Download(Vec<&'static str>),
    /// `lora-train --recipe R` on the local tiny model and `hf://datasets/tiny/d`.
    TrainOnDataset,
}

struct Case {
    name: &'static str,
    lie: Lie,
    cmd: Cmd,
    /// The server wants this token (GatedRepo otherwise).
    wants_token: bool,
    /// HF_TOKEN of the run.
    token: Option<&'static str>,
    /// Exit 0 (the true bytes cached) or 1.
    ok: bool,
    /// What stderr must say.
    want: Vec<String>,
    /// The file lied about: never in the snapshot after a failure.
    lied: &'static str,
    /// A second server (another origin) the lie sends the client to.
    second: Option<Server>,
}

fn case(name: &'static str, ok: bool, lied: &'static str, want: &[&str], lie: Lie) -> Case {
    Case {
        name,
        lie,
        cmd: Cmd::Download(vec![]),
        wants_token: false,
        token: Some(TOKEN),
        ok,
        want: want.iter().map(|s| s.to_string()).collect(),
        lied,
        second: None,
    }
}

fn cases() -> Vec<Case> {
    let n = weights().len();
    let mut v = vec![
        case(
            "a small file redirected with Content-Length 0 (once cached as an empty config.json)",
            true,
            "config.json",
            &[],
            config_elsewhere("/plain/config.json", config()),
        ),
        case(
            "an empty body that nobody declared",
            false,
            "config.json",
            &["has no bytes, and the Hub declared no size for it; nothing was cached"],
            config_elsewhere("/plain/config.json", vec![]),
        ),
        case(
            "X-Linked-Size and the CDN's Content-Length differ",
            false,
            "model.safetensors",
            &[],
            cdn(|_, _, _| {
                let mut w = weights();
                w.extend([0; 5]);
                Some(Reply::new("200 OK", vec![], w))
            }),
        ),
        case(
            "a body cut short once",
            true,
            "model.safetensors",
            &["resuming at byte 1000"],
            cdn(|r, k, _| {
                let w = weights();
                Some(match k {
                    0 => Reply::raw(
                        "200 OK",
                        vec![("Content-Length", w.len().to_string())],
                        Body::Cut(w, 1000),
                    ),
                    _ => partial(&w, r),
                })
            }),
        ),
        case(
            "a body cut short every time",
            false,
            "model.safetensors",
            &["(after 5 attempts; 0 bytes kept in"],
            cdn(|_, _, _| {
                let w = weights();
                Some(Reply::raw(
                    "200 OK",
                    vec![("Content-Length", w.len().to_string())],
                    Body::Cut(w, 0),
                ))
            }),
        ),
        case(
            "bytes altered on the way (sha256)",
            false,
            "model.safetensors",
            &[
                "the downloaded bytes have sha256",
                "the download was deleted",
            ],
            cdn(|r, _, _| {
                let mut w = weights();
                w[100] ^= 0xff;
                Some(partial(&w, r))
            }),
        ),
        case(
            "a redirect loop in HEAD",
            false,
            "config.json",
            &["more than 8 redirects for config.json of tiny/m at revision \"main\""],
            at("HEAD", CONFIG, |_, _, _| {
                Reply::new(
                    "307 Temporary Redirect",
                    vec![("Location", s(CONFIG))],
                    vec![],
                )
            }),
        ),
        case(
            "a redirect loop on the CDN",
            false,
            "model.safetensors",
            &[
                "more than 8 redirects (the last from http://localhost:",
                "a redirect loop",
            ],
            cdn(|r, _, _| {
                Some(Reply::new(
                    "302 Found",
                    vec![("Location", r.path.clone())],
                    vec![],
                ))
            }),
        ),
        case(
            "a redirect to a file:// URL",
            false,
            "model.safetensors",
            &["with a redirect to file:///etc/passwd, which is not an http(s) URL"],
            weights_head(|h, _| set(h, "Location", s("file:///etc/passwd"))),
        ),
        case(
            "a redirect without a Location",
            false,
            "config.json",
            &["with HTTP 302 and no Location (for config.json of tiny/m"],
            at("HEAD", CONFIG, |_, _, _| {
                Reply::new("302 Found", vec![commit_hdr(), config_etag()], vec![])
            }),
        ),
        case(
            "an index that is not JSON",
            false,
            "",
            &["model.safetensors.index.json is not valid JSON"],
            index("{\"weight_map\": {not json"),
        ),
        case(
            "shard names that leave the snapshot",
            false,
            "",
            &[
                "names the shard \"../../../../evil.safetensors\"",
                "is not a file name inside a repository",
            ],
            index(r#"{"weight_map": {"w": "../../../../evil.safetensors"}}"#),
        ),
        case(
            "a declared size larger than the disk",
            false,
            "model.safetensors",
            &[
                "still to download, but the filesystem of",
                "free: free some space, or set HF_HUB_CACHE",
            ],
            weights_head(|h, _| set(h, "X-Linked-Size", (1u64 << 60).to_string())),
        ),
        case(
            "a size that is not a number",
            false,
            "model.safetensors",
            &["with X-Linked-Size \"12abc\", which is not a byte count"],
            weights_head(|h, _| set(h, "X-Linked-Size", s("12abc"))),
        ),
        case(
            "a size beyond 2^64",
            false,
            "model.safetensors",
            &["X-Linked-Size \"99999999999999999999999\", which is not a byte count"],
            weights_head(|h, _| set(h, "X-Linked-Size", s("99999999999999999999999"))),
        ),
        case(
            "a drip slower than the time-out",
            false,
            "model.safetensors",
            &[
                "no bytes came for 2 s (HF_HUB_DOWNLOAD_TIMEOUT)",
                "(after 5 attempts;",
            ],
            cdn(|_, _, _| {
                let w = weights();
                Some(Reply::raw(
                    "200 OK",
                    vec![("Content-Length", w.len().to_string())],
                    Body::Drip(w, Duration::from_secs(3)),
                ))
            }),
        ),
        case(
            "a HEAD that is never answered",
            false,
            "config.json",
            &[
                "cannot reach http://127.0.0.1:",
                "to download config.json of tiny/m",
                "imeout",
            ],
            at("HEAD", CONFIG, |_, _, _| {
                Reply::silent(Duration::from_secs(4))
            }),
        ),
        case(
            "503, then the file",
            true,
            "config.json",
            &["config.json of tiny/m at revision \"main\": HTTP 503; trying again"],
            Arc::new(|r: &Req, k, _| {
                (r.path == CONFIG && k == 0).then(|| Reply::error("503 Service Unavailable", ""))
            }),
        ),
        case(
            "503 for good",
            false,
            "config.json",
            &[
                "answered HTTP 503 for config.json of tiny/m",
                "the Hub may be down",
            ],
            at("HEAD", CONFIG, |_, _, _| {
                Reply::error("503 Service Unavailable", "")
            }),
        ),
        case(
            "401 to a run without a token",
            false,
            "config.json",
            &["HTTP 401", "no token was sent: set HF_TOKEN"],
            Arc::new(|_: &Req, _, _| None),
        ),
        case(
            "403 to a run with the wrong token",
            false,
            "config.json",
            &[
                "HTTP 403",
                "the token that was sent (HF_TOKEN or the token file) cannot read it",
            ],
            Arc::new(|_: &Req, _, _| None),
        ),
        case(
            "a revision the repository does not have",
            false,
            "config.json",
            &["tiny/m has no revision \"v9\""],
            Arc::new(|_: &Req, _, _| None),
        ),
        case(
            "no config.json",
            false,
            "config.json",
            &["has no config.json of tiny/m at revision \"main\" (HTTP 404)"],
            at("HEAD", CONFIG, |_, _, _| {
                Reply::error("404 Not Found", "EntryNotFound")
            }),
        ),
        case(
            "another commit than the one asked for",
            false,
            "model.safetensors",
            &[],
            Arc::new(|r: &Req, _, port| {
                (r.method == "HEAD"
                    && r.path == format!("/tiny/m/resolve/{COMMIT}/model.safetensors"))
                .then(|| {
                    let mut rep = lfs_redirect(&weights(), port);
                    set(&mut rep.headers, "X-Repo-Commit", OTHER.to_string());
                    rep
                })
            }),
        ),
        case(
            "an ETag that is a path",
            false,
            "config.json",
            &["without a usable ETag (for config.json of tiny/m"],
            at("HEAD", CONFIG, |_, _, _| {
                Reply::new(
                    "200 OK",
                    vec![commit_hdr(), ("ETag", s("\"../../../x\""))],
                    vec![],
                )
            }),
        ),
        case(
            "a commit that is not a hash",
            false,
            "config.json",
            &["without a commit hash in X-Repo-Commit"],
            at("HEAD", CONFIG, |_, _, _| {
                Reply::new(
                    "200 OK",
                    vec![("X-Repo-Commit", s("main")), config_etag()],
                    vec![],
                )
            }),
        ),
        case(
            "a captive portal's page",
            false,
            "config.json",
            &[
                "without an X-Repo-Commit header",
                "is HF_ENDPOINT a Hugging Face Hub",
            ],
            Arc::new(|r: &Req, _, _| {
                r.path.starts_with("/tiny/").then(|| {
                    Reply::new(
                        "200 OK",
                        vec![("Content-Type", s("text/html"))],
                        b"<html>log in to the wifi</html>".to_vec(),
                    )
                })
            }),
        ),
        case(
            "a CDN that refuses its signed URL",
            false,
            "model.safetensors",
            &["answered HTTP 403: its signed URL may have expired"],
            cdn(|_, _, _| Some(Reply::new("403 Forbidden", vec![], b"expired".to_vec()))),
        ),
        case(
            "more bytes than declared, without a Content-Length",
            false,
            "model.safetensors",
            &["sent more than the 200000 bytes X-Linked-Size declared"],
            cdn(|_, _, _| {
                let mut w = weights();
                w.extend([7; 10]);
                Some(Reply::raw("200 OK", vec![], Body::Bytes(w)))
            }),
        ),
        case(
            "a resume answered from the wrong byte",
            true,
            "model.safetensors",
            &["the server sent the range \"bytes 0-199999/200000\" for bytes 1000-"],
            cdn(|r, k, _| {
                let w = weights();
                Some(match k {
                    0 => Reply::raw(
                        "200 OK",
                        vec![("Content-Length", w.len().to_string())],
                        Body::Cut(w, 1000),
                    ),
                    1 => Reply::new(
                        "206 Partial Content",
                        vec![(
                            "Content-Range",
                            format!("bytes 0-{}/{}", w.len() - 1, w.len()),
                        )],
                        w,
                    ),
                    _ => partial(&w, r),
                })
            }),
        ),
        case(
            "a 206 whose length does not fit its range",
            false,
            "model.safetensors",
            &["sent 5 bytes (Content-Length) for the range \"bytes 1000-199999/200000\""],
            cdn(|r, k, _| {
                let w = weights();
                Some(match k {
                    0 => Reply::raw(
                        "200 OK",
                        vec![("Content-Length", w.len().to_string())],
                        Body::Cut(w, 1000),
                    ),
                    _ => Reply::raw(
                        "206 Partial Content",
                        vec![
                            (
                                "Content-Range",
                                format!("bytes {}-{}/{}", r.from(), w.len() - 1, w.len()),
                            ),
                            ("Content-Length", s("5")),
                        ],
                        Body::Bytes(w[r.from()..r.from() + 5].to_vec()),
                    ),
                })
            }),
        ),
        case(
            "a 206 for a longer file than declared",
            false,
            "model.safetensors",
            &[
                "the file is 200000 bytes by X-Linked-Size, but http://localhost:",
                "sends 200010 (Content-Range)",
            ],
            cdn(|r, k, _| {
                let mut w = weights();
                Some(match k {
                    0 => Reply::raw(
                        "200 OK",
                        vec![("Content-Length", w.len().to_string())],
                        Body::Cut(w, 1000),
                    ),
                    _ => {
                        w.extend([1; 10]);
                        Reply::new(
                            "206 Partial Content",
                            vec![(
                                "Content-Range",
                                format!("bytes {}-{}/{}", r.from(), w.len() - 1, w.len()),
                            )],
                            w[r.from()..].to_vec(),
                        )
                    }
                })
            }),
        ),
    ];
    v[2].want = vec![
        s("the file is 200000 bytes by X-Linked-Size, but http://localhost:"),
        format!("sends {} (Content-Length); nothing was kept", n + 5),
    ];
    let find = |v: &mut Vec<Case>, name: &str| v.iter().position(|c| c.name == name).unwrap();
    let i = find(&mut v, "401 to a run without a token");
    (v[i].wants_token, v[i].token) = (true, None);
    let i = find(&mut v, "403 to a run with the wrong token");
    (v[i].wants_token, v[i].token) = (true, Some("hf_wrong_token_31c9"));
    let i = find(&mut v, "a revision the repository does not have");
    v[i].cmd = Cmd::Download(vec!["--revision", "v9"]);
    let i = find(&mut v, "another commit than the one asked for");
    v[i].want = vec![format!("for commit {COMMIT} with X-Repo-Commit {OTHER}")];
    v.extend(other_origins());
    v.extend(dataset_cases());
    v
}

/// The endpoint's token never leaves its origin: an LFS redirect to another port of the same
/// host, and a small file's redirect to another host name.
fn other_origins() -> Vec<Case> {
    let second = Server::start(Liar {
        lie: Arc::new(|_: &Req, _, _| None),
        token: None,
    });
    let p2 = second.port;
    let mut c = case(
        "an LFS redirect to another port (another origin)",
        true,
        "model.safetensors",
        &[],
        weights_head(move |h, _| {
            set(
                h,
                "Location",
                format!("http://127.0.0.1:{p2}/cdn/{}", sha256(&weights())),
            )
        }),
    );
    c.second = Some(second);
    c.wants_token = true;
    let mut d = case(
        "a small file redirected to another host with a token",
        true,
        "config.json",
        &[],
        config_elsewhere("/plain/config.json", config()),
    );
    d.wants_token = true;
    vec![c, d]
}

/// The data set API's lies, seen by `train` on `hf://datasets/tiny/d`.
fn dataset_cases() -> Vec<Case> {
    let api = format!("/api/datasets/{DATASET}/revision/main");
    let listing = |names: &[&str]| {
        let siblings: Vec<serde_json::Value> = names
            .iter()
            .map(|n| serde_json::json!({ "rfilename": n }))
            .collect();
        serde_json::json!({"id": DATASET, "sha": COMMIT, "siblings": siblings}).to_string()
    };
    let on_api = |api: String, body: String| -> Lie {
        Arc::new(move |r: &Req, _, _| {
            (r.path == api).then(|| Reply::new("200 OK", vec![], body.clone().into_bytes()))
        })
    };
    let mut v = vec![
        case(
            "a file list naming a path outside the repository",
            false,
            "",
            &["with the file name \"../../evil.jsonl\", which is not a path inside a repository"],
            on_api(api.clone(), listing(&["train.jsonl", "../../evil.jsonl"])),
        ),
        case(
            "a file list that is not JSON",
            false,
            "",
            &["answered the file list of data set tiny/d at revision \"main\" with something else than the Hub's repository JSON"],
            on_api(api.clone(), "{\"sha\": ".into()),
        ),
    ];
    let a2 = api.clone();
    v.push(case(
        "a file list redirected to another host with a token",
        false,
        "",
        &["with something else than the Hub's repository JSON"],
        Arc::new(move |r: &Req, _, port| {
            if r.path == a2 && r.host.starts_with("127.0.0.1") {
                return Some(Reply::new(
                    "302 Found",
                    vec![("Location", format!("http://localhost:{port}/elsewhere"))],
                    vec![],
                ));
            }
            (r.path == "/elsewhere").then(|| Reply::new("200 OK", vec![], b"<html/>".to_vec()))
        }),
    ));
    for c in &mut v {
        c.cmd = Cmd::TrainOnDataset;
        c.wants_token = true;
    }
    v
}

/// Runs one case; what went wrong, if anything.
fn run(c: &Case) -> Vec<String> {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    let hub = Server::start(Liar {
        lie: c.lie.clone(),
        token: c.wants_token.then(|| TOKEN.to_string()),
    });
    let mut cmd = crate::loopback::hub_std_command(&hf, &hub.endpoint());
    cmd.env("HF_HUB_DOWNLOAD_TIMEOUT", "2")
        .env("HF_HUB_ETAG_TIMEOUT", "2");
    if let Some(t) = c.token {
        cmd.env("HF_TOKEN", t);
    }
    match &c.cmd {
        Cmd::Download(args) => {
            cmd.args(["download", REPO]).args(args);
        }
        Cmd::TrainOnDataset => {
            let r = tmp.path().join("r.toml");
            std::fs::write(
                &r,
                format!(
                    "[model]\npath = \"{}\"\n[data]\ntrain = \"hf://datasets/{DATASET}\"\nformat = \"text\"\n[train]\nmax_steps = 1\n[output]\ndir = \"{}\"\n",
                    root().join("recipes/assets/tiny-llama").display(),
                    tmp.path().join("out").display()
                ),
            )
            .unwrap();
            cmd.arg("--recipe").arg(&r);
        }
    }
    let o = cmd.output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    let mut bad = Vec::new();
    let code = o.status.code();
    if code != Some(if c.ok { 0 } else { 1 }) {
        bad.push(format!("exit {code:?}"));
    }
    for w in &c.want {
        if !err.contains(w.as_str()) {
            bad.push(format!("stderr lacks {w:?}"));
        }
    }
    if err.contains("panicked") {
        bad.push("a panic".into());
    }
    for t in [Some(TOKEN), c.token].into_iter().flatten() {
        if out.contains(t) || err.contains(t) {
            bad.push(format!("the token {t} was printed"));
        }
    }
    let mut reqs = hub.requests();
    if let Some(s) = &c.second {
        reqs.extend(s.requests());
    }
    let own = format!("127.0.0.1:{}", hub.port);
    for r in &reqs {
        if r.host != own && r.auth.is_some() {
            bad.push(format!("the token went to {} ({})", r.host, r.path));
        }
    }
    if c.second.as_ref().is_some_and(|s| s.requests().is_empty()) {
        bad.push("the other origin was never asked".into());
    }
    bad.extend(cache_problems(&hf, c));
    if let Some(p) = walk(tmp.path())
        .iter()
        .find(|p| p.to_string_lossy().contains("evil"))
    {
        bad.push(format!("{} was written", p.display()));
    }
    if !bad.is_empty() {
        bad.push(format!("stderr: {err}"));
    }
    bad
}

/// Every file of the model's snapshots is the true file; after a failure the lied-about one
/// is not there at all.
fn cache_problems(hf: &Path, c: &Case) -> Vec<String> {
    let mut bad = Vec::new();
    let snaps = hf.join("hub/models--tiny--m/snapshots");
    for p in walk(&snaps) {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if let Some(want) = honest(&name) {
            if std::fs::read(&p).ok() != Some(want) {
                bad.push(format!(
                    "{} is cached with other bytes than the true file",
                    p.display()
                ));
            }
        }
        if !c.ok && name == c.lied {
            bad.push(format!("{} is cached after the failure", p.display()));
        }
    }
    if c.ok && !c.lied.is_empty() && !walk(&snaps).iter().any(|p| p.ends_with(c.lied)) {
        bad.push(format!("{} was not cached", c.lied));
    }
    bad
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[test]
fn a_lying_hub_is_caught_in_every_way_and_nothing_false_is_cached() {
    let cases = cases();
    assert!(cases.len() >= 37, "{} cases", cases.len());
    // Six at a time: the slow ones wait out time-outs and retries (about 15 s).
    let mut failures = Vec::new();
    for chunk in cases.chunks(6) {
        let results: Vec<(&str, Vec<String>)> = std::thread::scope(|s| {
            let hs: Vec<_> = chunk.iter().map(|c| (c.name, s.spawn(|| run(c)))).collect();
            hs.into_iter()
                .map(|(n, h)| (n, h.join().unwrap()))
                .collect()
        });
        for (name, bad) in results {
            if !bad.is_empty() {
                failures.push(format!("{name}:\n  {}", bad.join("\n  ")));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
