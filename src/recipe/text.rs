//! The recipe written back as TOML: resolved (`to_toml`, beside every adapter) and annotated
//! (`check_toml`, what `lora-train check` prints).

use super::{Recipe, RecipeError, DEFAULT_MAX_SHARD_SIZE, OFFLOAD_ACTIVATIONS_DEFAULT};
use crate::util::os_path;
use std::path::{Path, PathBuf};

impl Recipe {
    /// The recipe as resolved (defaults filled in), for people: a path that is not UTF-8 is
    /// shown with its odd bytes escaped (`os_path::escaped`).
    pub(crate) fn to_toml(&self) -> String {
        let mut r = self.clone();
        r.for_each_path(|_, p| {
            if p.to_str().is_none() {
                *p = PathBuf::from(os_path::escaped(p));
            }
        });
        toml::to_string_pretty(&r).unwrap_or_default()
    }

    /// The recipe as resolved, to store as a file in directory `dir` (beside an adapter) and
    /// load again from there: a path that is not UTF-8 is written relative to `dir`, which the
    /// loader resolves it against (`os_path::recordable`); where that form is not UTF-8
    /// either, the error names the field.
    pub(crate) fn to_toml_in(&self, dir: &Path) -> Result<String, RecipeError> {
        let mut r = self.clone();
        let mut unrecordable = None;
        r.for_each_path(|key, p| match os_path::recordable(p, dir) {
            Some(q) => *p = q,
            None => {
                unrecordable.get_or_insert((key, os_path::escaped(p)));
            }
        });
        if let Some((key, p)) = unrecordable {
            return Err(RecipeError::Invalid {
                path: self.source.clone(),
                key: key.into(),
                msg: format!(
                    "= \"{p}\" is not UTF-8, nor is its path from {}: recipe.toml (UTF-8) \
                     cannot record it; move it under the same directory as output.dir, or \
                     link it from a UTF-8 path",
                    os_path::escaped(dir)
                ),
            });
        }
        toml::to_string_pretty(&r).map_err(|e| RecipeError::Parse {
            path: self.source.clone(),
            msg: format!("cannot be written back as TOML: {e}"),
        })
    }

    /// What `check` prints: `to_toml` with the defaults that depend on other fields written
    /// out (`data.train_on` from the format, `train.offload_activations`), and each field
    /// left unset named in a comment at the end of its section, with what unset means.
    pub fn check_toml(&self) -> String {
        let mut r = self.clone();
        r.data.train_on = Some(self.data.train_on_for(self.data.format));
        r.train.offload_activations = Some(
            self.train
                .offload_activations
                .unwrap_or(OFFLOAD_ACTIVATIONS_DEFAULT),
        );
        if r.output.max_shard_size.is_none() {
            r.output.max_shard_size = Some(DEFAULT_MAX_SHARD_SIZE.into());
        }
        let unset: Vec<(&str, &str)> = [
            (
                self.lora.init_adapter.is_none(),
                "lora",
                "init_adapter = unset: new adapters (A random, B zero)",
            ),
            (
                self.data.chat_template.is_none(),
                "data",
                "chat_template = unset: the tokenizer's",
            ),
            (
                self.data.eval.is_none(),
                "data",
                "eval = unset: no eval file (eval_fraction holds out rows)",
            ),
            (
                self.train.max_memory.is_none(),
                "train",
                "max_memory = unset: the whole card",
            ),
        ]
        .into_iter()
        .filter(|(none, _, _)| *none)
        .map(|(_, section, line)| (section, line))
        .collect();
        with_section_notes(&r.to_toml(), &unset)
    }
}

/// `text` (TOML) with `# note` lines added at the end of each named `[section]`.
fn with_section_notes(text: &str, notes: &[(&str, &str)]) -> String {
    let mut out = String::new();
    let mut section = "";
    let flush = |out: &mut String, section: &str| {
        let trimmed = out.trim_end_matches('\n').len();
        out.truncate(trimmed);
        out.push('\n');
        for (_, line) in notes.iter().filter(|(s, _)| *s == section) {
            out.push_str(&format!("# {line}\n"));
        }
        out.push('\n');
    };
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            if !section.is_empty() {
                flush(&mut out, section);
            }
            section = name;
        }
        out.push_str(line);
        out.push('\n');
    }
    if !section.is_empty() {
        flush(&mut out, section);
    }
    out.trim_end().to_string() + "\n"
}
