//! Where the Hub is, where its cache is, how to authenticate and how long to wait: the
//! environment variables Python's huggingface_hub reads, with its defaults (our time-outs are
//! longer), and the token that is never printed.

use anyhow::{bail, Result};
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

pub(crate) const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// A Hub access token. Debug and Display print `***`; only the Authorization header sees it.
#[derive(Clone)]
pub(crate) struct Token(String);

impl Token {
    /// The token itself, for a client that sends it (hf-hub's API).
    pub(super) fn secret(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("Token(***)")
    }
}

/// Where the Hub is, where the cache is, and how to authenticate: the environment variables
/// Python's huggingface_hub reads, with its defaults.
#[derive(Debug, Clone)]
pub struct HubEnv {
    /// $HF_ENDPOINT without a trailing `/`. Default: https://huggingface.co
    pub(crate) endpoint: String,
    /// $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    /// ~/.cache/huggingface/hub.
    pub(crate) cache: PathBuf,
    /// $HF_TOKEN, else the file $HF_TOKEN_PATH, else $HF_HOME/token (`huggingface-cli login`).
    pub(crate) token: Option<Token>,
    /// $HF_HUB_OFFLINE is 1 / true / yes / on: never use the network.
    pub offline: bool,
    /// $HF_HUB_ETAG_TIMEOUT seconds: the longest wait for a HEAD's or the file list's answer.
    /// Default: 60.
    pub(crate) etag_timeout: Duration,
    /// $HF_HUB_DOWNLOAD_TIMEOUT seconds: the longest wait for a download's next bytes.
    /// Default: 60.
    pub(crate) download_timeout: Duration,
}

/// No variable places the cache: HOME, XDG_CACHE_HOME, HF_HOME and HF_HUB_CACHE are all unset.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot place the Hugging Face cache: HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME and HOME are \
     all unset (or empty); set HF_HOME to a directory for the cache and the token (e.g. \
     HF_HOME=/data/huggingface), or HOME"
)]
pub(crate) struct NoCacheDir;

/// The default of HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT, in seconds.
const DEFAULT_TIMEOUT_S: f64 = 60.0;

impl HubEnv {
    /// The environment of this process (`NoCacheDir` when nothing places the cache).
    pub(crate) fn from_env() -> Result<HubEnv> {
        HubEnv::from_vars(|k| std::env::var(k).ok())
    }

    /// The same from any variable lookup (empty values count as unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<HubEnv> {
        let var = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let home = var("HOME").map(PathBuf::from);
        let hf_home = var("HF_HOME").map(PathBuf::from).or_else(|| {
            var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| home.map(|h| h.join(".cache")))
                .map(|c| c.join("huggingface"))
        });
        let cache = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .map(PathBuf::from)
            .or_else(|| hf_home.as_ref().map(|h| h.join("hub")))
            .ok_or(NoCacheDir)?;
        let token = var("HF_TOKEN")
            .or_else(|| {
                let path = var("HF_TOKEN_PATH")
                    .map(PathBuf::from)
                    .or_else(|| hf_home.as_ref().map(|h| h.join("token")))?;
                std::fs::read_to_string(path).ok()
            })
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .map(Token);
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        });
        let endpoint = var("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        let timeout = |k: &str| -> Result<Duration> {
            let Some(v) = var(k) else {
                return Ok(Duration::from_secs_f64(DEFAULT_TIMEOUT_S));
            };
            match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => {
                    Ok(Duration::from_secs_f64(s))
                }
                _ => bail!("{k} = \"{v}\" is not a number of seconds between 0 and 86400"),
            }
        };
        Ok(HubEnv {
            endpoint,
            cache,
            token,
            offline,
            etag_timeout: timeout("HF_HUB_ETAG_TIMEOUT")?,
            download_timeout: timeout("HF_HUB_DOWNLOAD_TIMEOUT")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(vars: &[(&str, &str)]) -> anyhow::Result<HubEnv> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        HubEnv::from_vars(|k| m.get(k).cloned())
    }

    /// The environment of `vars`, HOME=/h unless they set it.
    fn env(v: &[(&str, &str)]) -> HubEnv {
        let mut v = v.to_vec();
        if !v.iter().any(|(k, _)| *k == "HOME") {
            v.push(("HOME", "/h"));
        }
        vars(&v).unwrap()
    }

    #[test]
    fn no_home_names_the_variable_to_set_and_timeouts_are_checked() {
        for unset in [vec![], vec![("HOME", ""), ("XDG_CACHE_HOME", " ")]] {
            let e = vars(&unset).unwrap_err();
            assert!(e.is::<NoCacheDir>(), "{e}");
            assert!(e.to_string().contains("set HF_HOME to a directory"), "{e}");
        }
        // Any one of them places the cache.
        assert_eq!(
            vars(&[("HF_HUB_CACHE", "/c")]).unwrap().cache,
            PathBuf::from("/c")
        );
        assert_eq!(
            vars(&[("XDG_CACHE_HOME", "/x")]).unwrap().cache,
            PathBuf::from("/x/huggingface/hub")
        );
        let e = env(&[
            ("HF_HUB_DOWNLOAD_TIMEOUT", "1.5"),
            ("HF_HUB_ETAG_TIMEOUT", "2"),
        ]);
        assert_eq!(e.download_timeout, Duration::from_millis(1500));
        assert_eq!(e.etag_timeout, Duration::from_secs(2));
        assert_eq!(env(&[]).download_timeout, Duration::from_secs(60));
        for bad in ["0", "-1", "x", "inf"] {
            let e = vars(&[("HOME", "/h"), ("HF_HUB_ETAG_TIMEOUT", bad)]).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("HF_HUB_ETAG_TIMEOUT = \"{bad}\" is not a number of seconds between 0 and 86400")
            );
        }
    }

    #[test]
    fn environment_as_huggingface_hub_reads_it() {
        let e = env(&[("HOME", "/h")]);
        assert_eq!(e.endpoint, "https://huggingface.co");
        assert_eq!(e.cache, PathBuf::from("/h/.cache/huggingface/hub"));
        assert!(e.token.is_none() && !e.offline);
        let e = env(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]);
        assert_eq!(e.cache, PathBuf::from("/x/huggingface/hub"));
        let e = env(&[
            ("HOME", "/h"),
            ("HF_HOME", "/hf"),
            ("HF_ENDPOINT", "http://m:1/"),
        ]);
        assert_eq!(e.cache, PathBuf::from("/hf/hub"));
        assert_eq!(e.endpoint, "http://m:1");
        let e = env(&[
            ("HF_HOME", "/hf"),
            ("HF_HUB_CACHE", "/c"),
            ("HF_HUB_OFFLINE", "1"),
        ]);
        assert_eq!(e.cache, PathBuf::from("/c"));
        assert!(e.offline);
        for (v, off) in [("0", false), ("true", true), ("ON", true), ("", false)] {
            assert_eq!(env(&[("HF_HUB_OFFLINE", v)]).offline, off, "{v}");
        }

        // HF_TOKEN wins over the token file; the file is $HF_HOME/token unless HF_TOKEN_PATH.
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("token"), "hf_file\n").unwrap();
        let home = tmp.path().to_str().unwrap();
        let e = env(&[("HF_HOME", home)]);
        assert_eq!(e.token.as_ref().map(|t| t.0.as_str()), Some("hf_file"));
        let e = env(&[("HF_HOME", home), ("HF_TOKEN", "hf_env")]);
        assert_eq!(e.token.as_ref().map(|t| t.0.as_str()), Some("hf_env"));
        // ... and is never printed.
        let shown = format!("{e:?}");
        assert!(
            !shown.contains("hf_env") && shown.contains("Token(***)"),
            "{shown}"
        );
    }
}
