//! Hub names and the cache's place, with the real binary: revisions that are paths (absolute,
//! `..`, hidden or empty parts, git's forbidden characters) are refused before any request,
//! on the command line (`download --revision`, exit 2) and in a recipe (`model.revision`,
//! `data.revision`, exit 2), and the file at such a path is untouched; with no home directory
//! (HOME, HF_HOME, XDG_CACHE_HOME and HF_HUB_CACHE unset) the error names the variable to set
//! and nothing is written under the working directory.

use crate::common::root;
use crate::liar::{config, Liar, Req, Server, COMMIT, DATASET, REPO};
use std::sync::Arc;

#[test]
fn revisions_that_are_paths_are_refused_before_any_request() {
    let tmp = tempfile::tempdir().unwrap();
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let hub = Server::start(Liar {
        lie: Arc::new(|_: &Req, _, _| None),
        token: None,
    });
    let hf = tmp.path().join("hf");
    let v = victim.to_str().unwrap();
    for rev in [
        v,
        "../../../../x",
        "a//b",
        ".hidden",
        "main.lock",
        "a b",
        "ref~1",
    ] {
        let o = crate::loopback::hub_command(&hf, &hub.endpoint())
            .args(["download", REPO, "--revision", rev])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{rev}: {err}");
        assert!(err.contains("is not a branch, tag or commit"), "{err}");
    }
    // model.revision and data.revision in a recipe: exit 2 from `check`.
    let data = root().join("recipes/data/tiny-text.jsonl");
    for (body, key) in [
        (format!("[model]\nid = \"{REPO}\"\nrevision = \"{v}\"\n[data]\ntrain = \"{}\"\n", data.display()), "model.revision"),
        (format!("[model]\nid = \"{REPO}\"\n[data]\ntrain = \"hf://datasets/{DATASET}\"\nrevision = \"{v}\"\n"), "data.revision"),
    ] {
        let r = tmp.path().join("r.toml");
        std::fs::write(&r, body).unwrap();
        let o = crate::loopback::hub_command(&hf, &hub.endpoint())
            .args(["check", "--recipe"])
            .arg(&r)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!("`{key}` = \"{v}\" is not a branch, tag or commit (a git ref name)")),
            "{err}"
        );
    }
    assert!(hub.requests().is_empty());
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert!(!hf.exists());
}

#[test]
fn without_a_home_the_error_names_the_variable_to_set() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = Server::start(Liar {
        lie: Arc::new(|_: &Req, _, _| None),
        token: None,
    });
    let o = std::process::Command::new(assert_cmd::cargo::cargo_bin("lora-train"))
        .current_dir(tmp.path())
        .env_clear()
        .env("HF_ENDPOINT", hub.endpoint())
        .args(["download", REPO])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(
        err,
        "error: cannot place the Hugging Face cache: HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME and \
         HOME are all unset (or empty); set HF_HOME to a directory for the cache and the token \
         (e.g. HF_HOME=/data/huggingface), or HOME\n"
    );
    // Nothing under the working directory, no request.
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    assert!(hub.requests().is_empty());
    // With HF_HOME alone, it downloads there.
    let o = std::process::Command::new(assert_cmd::cargo::cargo_bin("lora-train"))
        .current_dir(tmp.path())
        .env_clear()
        .env("HF_ENDPOINT", hub.endpoint())
        .env("HF_HOME", tmp.path().join("hf"))
        .args(["download", REPO])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        std::fs::read(
            tmp.path()
                .join("hf/hub/models--tiny--m/snapshots")
                .join(COMMIT)
                .join("config.json")
        )
        .unwrap()
            == config()
    );
}
