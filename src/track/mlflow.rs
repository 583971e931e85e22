//! The MLflow tracker, over the tracking server's REST API (`/api/2.0/mlflow/...`) at
//! `MLFLOW_TRACKING_URI`: the experiment found or created by name (`MLFLOW_EXPERIMENT_NAME`;
//! else `MLFLOW_EXPERIMENT_ID`; else the default one, "0"), a run created (named
//! `MLFLOW_RUN_NAME`, else the output directory's name) with the resolved recipe as its
//! params, each batch of rows as one or more `runs/log-batch` calls, and the run's status at
//! the end. The run's id is kept in `<output.dir>/runs/mlflow.json`: a resumed run goes on
//! logging to it (so does `MLFLOW_RUN_ID`). Auth: `MLFLOW_TRACKING_TOKEN` (bearer) or
//! `MLFLOW_TRACKING_USERNAME` + `MLFLOW_TRACKING_PASSWORD` (basic).

use super::{params_of, Scalars, Sink, Start, Status};
use crate::util::atomic_write;
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::time::Duration;

/// Where a run's MLflow id is kept, under `<output.dir>/runs/`.
pub(crate) const RUN_FILE: &str = "mlflow.json";

/// MLflow's limits per log-batch request: metrics, params.
const MAX_METRICS: usize = 1000;
const MAX_PARAMS: usize = 100;
/// MLflow's longest param value (2.x servers; longer ones are cut, marked with "...").
const MAX_PARAM_LEN: usize = 6000;

/// An MLflow run being logged to.
pub(crate) struct Mlflow {
    agent: ureq::Agent,
    /// The tracking URI without a trailing `/`.
    base: String,
    /// The Authorization header's value, if any.
    auth: Option<String>,
    /// The run's id.
    pub(crate) run_id: String,
}

/// A failed call: an HTTP error status with MLflow's error code, or no answer at all.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    /// The server answered with an error status.
    #[error("{what}: HTTP {status} {code}: {message}")]
    Status {
        /// The endpoint, e.g. "runs/log-batch".
        what: String,
        /// The HTTP status.
        status: u16,
        /// MLflow's `error_code` (e.g. RESOURCE_DOES_NOT_EXIST), empty when it sent none.
        code: String,
        /// MLflow's `message`, else the start of the body.
        message: String,
    },
    /// No answer: refused, reset, timed out.
    #[error("{what}: {cause} (is the server at MLFLOW_TRACKING_URI up?)")]
    Net {
        /// The method and endpoint.
        what: String,
        /// What the HTTP client said.
        cause: String,
    },
}

impl Mlflow {
    /// Connects to the server `MLFLOW_TRACKING_URI` names and starts (or, resuming, reopens)
    /// the run, its params logged when it is new.
    pub(crate) fn open(start: &Start) -> Result<Mlflow> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let uri = env("MLFLOW_TRACKING_URI").context(
            "MLFLOW_TRACKING_URI is not set: set it to the tracking server, e.g. \
             MLFLOW_TRACKING_URI=http://127.0.0.1:5000",
        )?;
        if !(uri.starts_with("http://") || uri.starts_with("https://")) {
            anyhow::bail!(
                "MLFLOW_TRACKING_URI={uri}: lora-train logs over MLflow's REST API; set an \
                 http:// or https:// server (`mlflow server` serves one for a local mlruns/)"
            );
        }
        let auth = match (
            env("MLFLOW_TRACKING_TOKEN"),
            env("MLFLOW_TRACKING_USERNAME"),
        ) {
            (Some(t), _) => Some(format!("Bearer {t}")),
            (None, Some(u)) => {
                let p = env("MLFLOW_TRACKING_PASSWORD").unwrap_or_default();
                Some(format!("Basic {}", base64(format!("{u}:{p}").as_bytes())))
            }
            _ => None,
        };
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .user_agent(concat!("lora-train/", env!("CARGO_PKG_VERSION")))
            .timeout_connect(Some(Duration::from_secs(10)))
            .timeout_global(Some(Duration::from_secs(30)))
            .build();
        let mut m = Mlflow {
            agent: config.into(),
            base: uri.trim_end_matches('/').to_string(),
            auth,
            run_id: String::new(),
        };
        let file = start.out_dir.join(super::tensorboard::RUNS).join(RUN_FILE);
        let kept = match start.resumed_at {
            Some(_) => kept_run(&file, &m.base),
            None => None,
        };
        if let Some(id) = env("MLFLOW_RUN_ID").or(kept) {
            m.run_id = id;
            m.update("RUNNING")?;
            return Ok(m);
        }
        let experiment = match (env("MLFLOW_EXPERIMENT_NAME"), env("MLFLOW_EXPERIMENT_ID")) {
            (Some(name), _) => m.experiment(&name)?,
            (None, Some(id)) => id,
            (None, None) => "0".into(),
        };
        let name = env("MLFLOW_RUN_NAME").unwrap_or_else(|| start.run_name.clone());
        let run = m.post(
            "runs/create",
            &json!({
                "experiment_id": experiment, "start_time": now_ms(), "run_name": name,
                "tags": [{"key": "mlflow.runName", "value": name},
                         {"key": "mlflow.source.name", "value": "lora-train"}],
            }),
        )?;
        m.run_id = run["run"]["info"]["run_id"]
            .as_str()
            .context("runs/create: the answer has no run.info.run_id")?
            .to_string();
        let keep = json!({"tracking_uri": m.base, "experiment_id": experiment, "run_id": m.run_id});
        let dir = file.parent().unwrap_or(&start.out_dir);
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        atomic_write(&file, format!("{keep:#}\n").as_bytes())?;
        if let Err(e) = m.params(&start.recipe) {
            (start.say)(&format!(
                "warning: mlflow: the recipe's params not logged: {e:#}"
            ));
        }
        Ok(m)
    }

    /// The id of the experiment called `name`, created when there is none.
    fn experiment(&self, name: &str) -> Result<String> {
        let path = format!("experiments/get-by-name?experiment_name={}", encode(name));
        let id = |v: &Value| v["experiment"]["experiment_id"].as_str().map(String::from);
        match self.call("GET", &path, None) {
            Ok(v) => return id(&v).context("experiments/get-by-name: no experiment_id"),
            Err(CallError::Status { code, .. }) if code == "RESOURCE_DOES_NOT_EXIST" => {}
            Err(e) => return Err(e.into()),
        }
        match self.post("experiments/create", &json!({ "name": name })) {
            Ok(v) => v["experiment_id"]
                .as_str()
                .map(String::from)
                .context("experiments/create: no experiment_id"),
            // Created meanwhile by another run: read it.
            Err(CallError::Status { code, .. }) if code == "RESOURCE_ALREADY_EXISTS" => {
                let v = self.call("GET", &path, None)?;
                id(&v).context("experiments/get-by-name: no experiment_id")
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The recipe's fields as the run's params, `MAX_PARAMS` per request.
    fn params(&self, recipe: &Value) -> Result<()> {
        let params: Vec<Value> = params_of(recipe)
            .into_iter()
            .map(|(k, v)| json!({"key": k, "value": cut(v)}))
            .collect();
        for chunk in params.chunks(MAX_PARAMS) {
            self.post(
                "runs/log-batch",
                &json!({"run_id": self.run_id, "params": chunk}),
            )?;
        }
        Ok(())
    }

    fn update(&self, status: &str) -> Result<(), CallError> {
        let mut body = json!({"run_id": self.run_id, "status": status});
        if status != "RUNNING" {
            body["end_time"] = now_ms().into();
        }
        self.post("runs/update", &body).map(|_| ())
    }

    fn post(&self, what: &str, body: &Value) -> Result<Value, CallError> {
        self.call("POST", what, Some(body))
    }

    /// One call to `/api/2.0/mlflow/<what>`, tried up to three times while the server answers
    /// 429 or 502-504 (busy or restarting); its JSON answer.
    fn call(&self, method: &str, what: &str, body: Option<&Value>) -> Result<Value, CallError> {
        let url = format!("{}/api/2.0/mlflow/{what}", self.base);
        let name = what.split('?').next().unwrap_or(what).to_string();
        let mut wait = Duration::from_millis(500);
        let mut attempt = 0;
        loop {
            let res = match body {
                Some(b) => {
                    let mut req = self.agent.post(&url);
                    req = req.header("Content-Type", "application/json");
                    if let Some(a) = &self.auth {
                        req = req.header("Authorization", a);
                    }
                    req.send(b.to_string())
                }
                None => {
                    let mut req = self.agent.get(&url);
                    if let Some(a) = &self.auth {
                        req = req.header("Authorization", a);
                    }
                    req.call()
                }
            };
            let mut resp = res.map_err(|e| CallError::Net {
                what: format!("{method} {name}"),
                cause: e.to_string(),
            })?;
            let status = resp.status().as_u16();
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            if (200..300).contains(&status) {
                return Ok(serde_json::from_str(&text).unwrap_or(Value::Null));
            }
            if matches!(status, 429 | 502..=504) && attempt < 2 {
                std::thread::sleep(wait);
                wait *= 2;
                attempt += 1;
                continue;
            }
            let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
            return Err(CallError::Status {
                what: name,
                status,
                code: s("error_code"),
                message: match s("message") {
                    m if m.is_empty() => text.chars().take(200).collect(),
                    m => m,
                },
            });
        }
    }
}

impl Sink for Mlflow {
    fn rows(&mut self, rows: &[Scalars]) -> Result<()> {
        let metrics: Vec<Value> = rows
            .iter()
            .flat_map(|r| {
                let ms = (r.wall * 1000.0) as i64;
                r.values.iter().filter(|(_, v)| v.is_finite()).map(
                    move |(k, v)| json!({"key": k, "value": v, "timestamp": ms, "step": r.step}),
                )
            })
            .collect();
        for chunk in metrics.chunks(MAX_METRICS) {
            self.post(
                "runs/log-batch",
                &json!({"run_id": self.run_id, "metrics": chunk}),
            )?;
        }
        Ok(())
    }

    fn end(&mut self, status: Status) -> Result<()> {
        let s = match status {
            Status::Finished => "FINISHED",
            Status::Failed => "FAILED",
        };
        Ok(self.update(s)?)
    }
}

/// The run id kept in `file` by an earlier session logging to `base`.
fn kept_run(file: &std::path::Path, base: &str) -> Option<String> {
    let text = std::fs::read_to_string(file).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    if v["tracking_uri"].as_str()? != base {
        return None;
    }
    v["run_id"].as_str().map(String::from)
}

/// A param value cut to MLflow's limit (on a character boundary).
fn cut(mut v: String) -> String {
    if v.len() > MAX_PARAM_LEN {
        let mut end = MAX_PARAM_LEN - 3;
        while !v.is_char_boundary(end) {
            end -= 1;
        }
        v.truncate(end);
        v.push_str("...");
    }
    v
}

fn now_ms() -> i64 {
    (super::now() * 1000.0) as i64
}

/// `s` percent-encoded for a query string (RFC 3986 unreserved characters kept).
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// Standard base64 with padding (RFC 4648), for the basic auth header.
fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            match i <= c.len() {
                true => out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char),
                false => out.push('='),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_encoders() {
        // RFC 4648 section 10's vectors.
        for (i, o) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(i.as_bytes()), o);
        }
        assert_eq!(encode("my exp/é"), "my%20exp%2F%C3%A9");
        assert_eq!(cut("x".repeat(7000)).len(), MAX_PARAM_LEN);
        assert_eq!(cut("é".repeat(4000)).len(), 5999);
    }
}
