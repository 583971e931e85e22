//! What a `data.train` entry (or `data.eval`) reads: a local file as it is, or the files of a
//! Hub data set's split (`hf://datasets/ORG/NAME`), downloaded into the Hugging Face cache.

use super::columns::check_keys;
use crate::hub::dataset::{dataset_files, repo_of, DataRepo};
use crate::hub::download::HubEnv;
use crate::recipe::{DataSection, TrainFile};
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub(crate) const DEFAULT_SPLIT: &str = "train";
pub(crate) const DEFAULT_EVAL_SPLIT: &str = "test";
pub(crate) const DEFAULT_REVISION: &str = "main";

/// One file to read: where it is, and the name errors give it (the path, or
/// `hf://datasets/ORG/NAME/<file>`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SourceFile {
    pub(crate) path: PathBuf,
    pub(crate) name: String,
}

/// `p` names a Hub data set (hf://...), not a local file.
pub(crate) fn is_hub(p: &Path) -> bool {
    p.to_str().is_some_and(|s| s.starts_with("hf://"))
}

/// The entry's options, each from the entry, else `[data]`, else its default.
pub(crate) struct HubChoice<'a> {
    pub(crate) split: &'a str,
    pub(crate) subset: Option<&'a str>,
    pub(crate) revision: &'a str,
    pub(crate) files: Option<&'a str>,
}

impl<'a> HubChoice<'a> {
    pub(crate) fn of(f: &'a TrainFile, cfg: &'a DataSection) -> HubChoice<'a> {
        HubChoice {
            split: f
                .split
                .as_deref()
                .or(cfg.split.as_deref())
                .unwrap_or(DEFAULT_SPLIT),
            subset: f.subset.as_deref().or(cfg.subset.as_deref()),
            revision: f
                .revision
                .as_deref()
                .or(cfg.revision.as_deref())
                .unwrap_or(DEFAULT_REVISION),
            files: f.files.as_deref().or(cfg.files.as_deref()),
        }
    }
}

/// data.eval as an entry: its split is data.eval_split, never data.files.
pub(crate) fn eval_entry(cfg: &DataSection) -> Option<TrainFile> {
    let path = cfg.eval.clone()?;
    let split = cfg
        .eval_split
        .clone()
        .unwrap_or_else(|| DEFAULT_EVAL_SPLIT.to_string());
    Some(TrainFile {
        path,
        weight: 1.0,
        format: Some(cfg.format),
        split: Some(split),
        ..TrainFile::default()
    })
}

/// The entry's column mapping: its own, else data.columns.
pub(crate) fn columns_of<'a>(
    f: &'a TrainFile,
    cfg: &'a DataSection,
) -> &'a BTreeMap<String, String> {
    f.columns.as_ref().unwrap_or(&cfg.columns)
}

/// The files `f` reads: itself, or the data set's files of its split, fetched as needed.
pub(crate) fn files_of(f: &TrainFile, cfg: &DataSection, eval: bool) -> Result<Vec<SourceFile>> {
    let Some(s) = f.path.to_str().filter(|s| s.starts_with("hf://")) else {
        return Ok(vec![SourceFile {
            path: f.path.clone(),
            name: f.path.display().to_string(),
        }]);
    };
    let id = repo_of(s)
        .unwrap_or_else(|| Err(String::new()))
        .map_err(anyhow::Error::msg)?;
    let c = HubChoice::of(f, cfg);
    let d = DataRepo {
        id,
        revision: c.revision,
        subset: c.subset,
        split: c.split,
        files: if eval { None } else { c.files },
    };
    let files = dataset_files(&HubEnv::from_env()?, &d)?;
    Ok(files
        .into_iter()
        .map(|df| SourceFile {
            name: format!("hf://datasets/{id}/{}", df.file),
            path: df.path,
        })
        .collect())
}

/// The `[data]` checks of hf:// entries and columns, before any network: the error's key and
/// message.
pub(crate) fn check(d: &DataSection) -> Result<(), (String, String)> {
    let err = |k: &str, m: String| Err((k.to_string(), m));
    let files = d.train.files(d.format);
    let mut any_hub = false;
    for f in &files {
        let hub = is_hub(&f.path);
        any_hub |= hub;
        if let Some(Err(m)) = f.path.to_str().and_then(repo_of) {
            return err("data.train", m);
        }
        let own = [
            ("split", &f.split),
            ("subset", &f.subset),
            ("revision", &f.revision),
            ("files", &f.files),
        ];
        for (k, v) in own {
            if v.is_some() && !hub {
                return err(
                    "data.train",
                    format!(
                        "entry {} sets `{k}`, which applies to hf:// data sets only: remove it",
                        f.path.display()
                    ),
                );
            }
        }
        check_values(&own, "data.train")?;
        let format = f.format.unwrap_or(d.format);
        if let Err(m) = check_keys(format, columns_of(f, d)) {
            let key = match f.columns.is_some() {
                true => "data.train",
                false => "data.columns",
            };
            return err(key, m);
        }
    }
    let section = [
        ("split", &d.split),
        ("subset", &d.subset),
        ("revision", &d.revision),
        ("files", &d.files),
    ];
    let eval_hub = d.eval.as_deref().is_some_and(is_hub);
    for (k, v) in &section {
        if v.is_some() && !any_hub && !(eval_hub && *k != "files") {
            return err(
                &format!("data.{k}"),
                "applies to hf:// data sets (data.train = \"hf://datasets/ORG/NAME\") only: remove it"
                    .to_string(),
            );
        }
    }
    check_values(&section, "data")?;
    if d.subset.is_some() && d.files.is_some() {
        return err(
            "data.files",
            "is set together with data.subset: data.files chooses the files itself; keep one"
                .to_string(),
        );
    }
    if let Some(e) = &d.eval {
        if let Some(Err(m)) = e.to_str().and_then(repo_of) {
            return err("data.eval", m);
        }
    }
    if d.eval_split.is_some() && !eval_hub {
        return err(
            "data.eval_split",
            "applies to an hf:// data.eval only: remove it".to_string(),
        );
    }
    check_values(&[("eval_split", &d.eval_split)], "data")?;
    Ok(())
}

/// Set options are non-empty; a revision is a git ref name (`util::check_revision`).
fn check_values(v: &[(&str, &Option<String>)], prefix: &str) -> Result<(), (String, String)> {
    for (k, v) in v {
        let Some(v) = v else { continue };
        let key = format!("{prefix}.{k}");
        if v.trim().is_empty() {
            return Err((key, format!("= \"{v}\" is empty: remove it or name one")));
        }
        if *k == "revision" && crate::util::check_revision(v).is_err() {
            return Err((
                key,
                format!("= \"{v}\" is not a branch, tag or commit (a git ref name)"),
            ));
        }
        if *k == "subset" && (v.contains('/') || v.starts_with('.')) {
            return Err((
                key,
                format!("= \"{v}\" is not a subset name (a folder of the data set)"),
            ));
        }
    }
    Ok(())
}
