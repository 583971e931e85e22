//! Reading a recipe: the TOML file, `--set` overrides on top, relative paths resolved against
//! the recipe's directory, then `validate`.

use super::{bounds, Recipe, RecipeError, Resume, TrainFiles};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Keys holding paths: relative values are resolved against the recipe's directory.
const PATH_KEYS: [&str; 7] = [
    "model.path",
    "lora.init_adapter",
    "data.train",
    "output.dir",
    "data.eval",
    "data.chat_template",
    "train.resume",
];

impl Recipe {
    /// Reads `path`, applies `--set` overrides, resolves relative paths and validates.
    pub fn load(path: &Path, sets: &[String]) -> Result<Recipe, RecipeError> {
        let text = std::fs::read_to_string(path).map_err(|source| RecipeError::Read {
            path: path.to_owned(),
            source,
        })?;
        let parse_err = |msg: String| RecipeError::Parse {
            path: path.to_owned(),
            msg,
        };
        let mut doc: toml_edit::DocumentMut = text
            .parse()
            .map_err(|e: toml_edit::TomlError| parse_err(e.to_string()))?;
        let mut overridden = BTreeSet::new();
        for arg in sets {
            overridden.insert(apply_set(&mut doc, arg)?);
        }
        let merged = doc.to_string();
        let mut r: Recipe = toml::from_str(&merged).map_err(|e| {
            // The same error in the file as written: report it there, with the file's lines.
            if let Err(orig) = toml::from_str::<Recipe>(&text) {
                if orig.message() == e.message() {
                    return parse_err(orig.to_string().trim_end().to_string());
                }
            }
            // Caused by an override: the merged document's line numbers mean nothing to the
            // user, so quote the offending line with its section instead.
            let mut msg = format!(
                "with --set {}: {}",
                sets.join(" --set "),
                e.message().trim_end()
            );
            if let Some(span) = e.span() {
                let before = &merged[..span.start.min(merged.len())];
                let line = merged[before.rfind('\n').map_or(0, |i| i + 1)..]
                    .lines()
                    .next()
                    .unwrap_or("");
                let section = before
                    .lines()
                    .rev()
                    .find(|l| l.trim_start().starts_with('['));
                msg.push_str(&format!(
                    "\n  at: {} {}",
                    section.unwrap_or("").trim(),
                    line.trim()
                ));
            }
            parse_err(msg)
        })?;
        r.source = path.to_owned();
        r.sets = sets.to_vec();
        bounds::empty_paths(&r)?;
        let base = path.parent().unwrap_or(Path::new("")).to_owned();
        r.resolve_paths(&base, &overridden);
        r.validate()?;
        Ok(r)
    }

    fn resolve_paths(&mut self, base: &Path, overridden: &BTreeSet<String>) {
        self.for_each_path(|key, p| {
            // hf://datasets/ORG/NAME is a Hub data set, not a path.
            let hub = p.to_str().is_some_and(|s| s.starts_with("hf://"));
            if p.is_relative() && !hub && !overridden.contains(key) {
                *p = base.join(&*p);
            }
        });
    }

    /// Calls `f` with each path field of the recipe and its key (`PATH_KEYS`): a
    /// `data.chat_template` that names a `.jinja` file, as a path, and written back lossily
    /// (the field is text).
    pub(crate) fn for_each_path(&mut self, mut f: impl FnMut(&'static str, &mut PathBuf)) {
        for key in PATH_KEYS {
            match key {
                "model.path" => self.model.path.iter_mut().for_each(|p| f(key, p)),
                "lora.init_adapter" => self.lora.init_adapter.iter_mut().for_each(|p| f(key, p)),
                "data.train" => match &mut self.data.train {
                    TrainFiles::One(p) => f(key, p),
                    TrainFiles::Mix(v) => v.iter_mut().for_each(|x| f(key, &mut x.path)),
                },
                "data.eval" => self.data.eval.iter_mut().for_each(|p| f(key, p)),
                // A template file, not a template name.
                "data.chat_template" => {
                    if let Some(t) = self
                        .data
                        .chat_template
                        .as_mut()
                        .filter(|t| t.ends_with(".jinja"))
                    {
                        let mut p = PathBuf::from(&*t);
                        f(key, &mut p);
                        *t = p.to_string_lossy().into_owned();
                    }
                }
                "train.resume" => {
                    if let Resume::Path(p) = &mut self.train.resume {
                        f(key, p)
                    }
                }
                _ => self.output.dir.iter_mut().for_each(|p| f(key, p)),
            }
        }
    }
}

/// (numbers, booleans, arrays, quoted strings); anything else is taken as a bare string.
/// `model.path` replaces the file's `model.id` (and its revision), `model.id` its `model.path`.
fn apply_set(doc: &mut toml_edit::DocumentMut, arg: &str) -> Result<String, RecipeError> {
    let err = |msg: &str| RecipeError::Override {
        arg: arg.into(),
        msg: msg.into(),
    };
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| err("expected section.key=value"))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
        return Err(err("the key must be section.key, e.g. train.lr=1e-4"));
    }
    let raw = raw.trim();
    let value: toml_edit::Value = raw
        .parse()
        .unwrap_or_else(|_| toml_edit::Value::from(raw.to_string()));
    let mut item = doc.as_item_mut();
    for part in &parts {
        // Absent keys become tables on the way down; a non-table value in the way is an error.
        item = item.get_mut(part).ok_or_else(|| {
            err(&format!(
                "cannot set `{key}`: `{part}` sits under a value, not a table"
            ))
        })?;
    }
    if item.is_table() {
        return Err(err(&format!(
            "`{key}` is a whole section; set one of its keys"
        )));
    }
    *item = toml_edit::Item::Value(value);
    // model.path and model.id are one choice: setting one replaces the other.
    let other: &[&str] = match key {
        "model.path" => &["id", "revision"],
        "model.id" => &["path"],
        _ => &[],
    };
    if let Some(model) = doc.get_mut("model").and_then(|m| m.as_table_like_mut()) {
        for k in other {
            model.remove(k);
        }
    }
    Ok(key.to_string())
}
