//! `[data]`: what to train on.

use serde::{de, Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// `data.format`: how rows are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// jsonl rows {"input_ids": [...], "labels": [...]?}; labels default to input_ids.
    Tokens,
    /// jsonl rows {"text": "..."}, tokenized with the model's tokenizer.json.
    Text,
    /// jsonl rows {"instruction", "input"?, "output"}, in the Stanford Alpaca prompt.
    Alpaca,
    /// jsonl rows {"messages": [{"role", "content"}, ...]}, rendered with the model's chat
    /// template.
    Chat,
    /// jsonl rows {"prompt", "completion"} (field names: data.prompt_field / completion_field).
    Completion,
}

/// `data.train_on`: which tokens are trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum TrainOn {
    /// Every token.
    All,
    /// Only completions (alpaca output, completion, assistant turns) and the EOS or
    /// end-of-turn token after each; prompts and system / user turns get label -100.
    Completions,
}

/// `data.on_bad_row`: what a malformed row does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum OnBadRow {
    /// Stop with the file, the line and the reason.
    Error,
    /// Skip it; skipped rows are counted and reported (first one quoted).
    Skip,
}

/// `data.train`: one jsonl file, or several mixed with weights.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum TrainFiles {
    One(PathBuf),
    Mix(Vec<TrainFile>),
}

/// One file of a `data.train` mix: `{ path = "a.jsonl", weight = 2.0, format = "chat" }`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainFile {
    /// The data file (.jsonl, .json, .parquet) or Hub data set ("hf://datasets/ORG/NAME").
    /// Required.
    pub path: PathBuf,
    /// How many times each of its examples is seen per epoch, on average: 2.0 = twice,
    /// 0.5 = a seeded half, a different half each epoch. Default: 1.0.
    #[serde(default = "d_weight")]
    pub weight: f64,
    /// This file's format. Default: data.format.
    pub format: Option<DataFormat>,
    /// For an hf:// data set: its split, subset, revision and files glob. Default: data.split,
    /// data.subset, data.revision, data.files.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    /// A Hub data set's subset (configuration).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subset: Option<String>,
    /// The Hub data set's branch, tag or commit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// A glob of the Hub data set's files (replaces subset and split).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<String>,
    /// This file's column mapping. Default: data.columns.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub columns: Option<BTreeMap<String, String>>,
}

fn d_weight() -> f64 {
    1.0
}

impl TrainFiles {
    /// The file names, for messages.
    pub(crate) fn describe(&self) -> String {
        match self {
            TrainFiles::One(p) => p.display().to_string(),
            TrainFiles::Mix(v) => v
                .iter()
                .map(|f| f.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    /// Every file with its weight and format (`default` where the file names none).
    pub fn files(&self, default: DataFormat) -> Vec<TrainFile> {
        match self {
            TrainFiles::One(p) => vec![TrainFile {
                path: p.clone(),
                weight: 1.0,
                format: Some(default),
                ..TrainFile::default()
            }],
            TrainFiles::Mix(v) => v
                .iter()
                .map(|f| TrainFile {
                    format: Some(f.format.unwrap_or(default)),
                    ..f.clone()
                })
                .collect(),
        }
    }
}

impl<'de> Deserialize<'de> for TrainFiles {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = TrainFiles;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a jsonl path, or a list of { path, weight, format } tables")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<TrainFiles, E> {
                Ok(TrainFiles::One(PathBuf::from(s)))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut a: A) -> Result<TrainFiles, A::Error> {
                let mut v = Vec::new();
                while let Some(f) = a.next_element::<TrainFile>()? {
                    v.push(f);
                }
                Ok(TrainFiles::Mix(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// `[data]`: what to train on.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// Training data: a file (.jsonl or .json: JSON lines or a JSON array of rows; .parquet),
    /// a Hub data set "hf://datasets/ORG/NAME", or several mixed with weights:
    /// `[{ path = "a.jsonl", weight = 2.0 }, { path = "b.jsonl", format = "chat" }]`. Required.
    pub train: TrainFiles,
    /// "tokens" | "text" | "alpaca" | "chat" | "completion". Default: "text".
    #[serde(default = "d_format")]
    pub format: DataFormat,
    /// Tokens per row; longer rows are truncated (and counted). Default: 512.
    #[serde(default = "d_seq_len")]
    pub seq_len: usize,
    /// Shuffle the example order each epoch (seeded by train.seed). Default: true.
    #[serde(default = "super::d_true")]
    pub(crate) shuffle: bool,
    /// Pack several examples into each row of seq_len tokens, with no attention across
    /// examples and positions restarting at each. Default: false.
    #[serde(default)]
    pub pack: bool,
    /// "all" | "completions" (prompts, system and user turns get label -100; the EOS or
    /// end-of-turn token ends every completion). Default: "completions" for alpaca, chat and
    /// completion, "all" for text and tokens.
    pub(crate) train_on: Option<TrainOn>,
    /// The prompt field of "completion" rows. Default: "prompt".
    #[serde(default = "d_prompt_field")]
    pub(crate) prompt_field: String,
    /// The completion field of "completion" rows. Default: "completion".
    #[serde(default = "d_completion_field")]
    pub(crate) completion_field: String,
    /// The chat template for "chat" rows: a path to a .jinja file, or the name of one of the
    /// templates tokenizer_config.json lists. Default: the model's chat_template.jinja, else
    /// tokenizer_config.json's chat_template (its "default" when it lists several).
    pub chat_template: Option<String>,
    /// Eval file (in data.format), or a Hub data set (its split: data.eval_split). Default:
    /// none.
    pub eval: Option<PathBuf>,
    /// Hold out this fraction of the training examples (seeded) as the eval set, in [0, 1).
    /// Default: 0.
    #[serde(default)]
    pub(crate) eval_fraction: f64,
    /// "error" | "skip": what a malformed row does. Default: "error".
    #[serde(default = "d_on_bad_row")]
    pub(crate) on_bad_row: OnBadRow,
    /// hf:// data sets: the split to read ("train", "test", "train_sft", ...). Default: "train".
    pub(crate) split: Option<String>,
    /// hf:// data sets: the subset (configuration), a folder of the repository, e.g. "main".
    /// Default: none (the data set's only one).
    pub(crate) subset: Option<String>,
    /// hf:// data sets: branch, tag or commit. Default: "main".
    pub(crate) revision: Option<String>,
    /// hf:// data sets: a glob of repository paths to read instead of split and subset, e.g.
    /// "data/train-*.parquet". Default: none.
    pub(crate) files: Option<String>,
    /// An hf:// data.eval: its split. Default: "test".
    pub(crate) eval_split: Option<String>,
    /// Our field names → the data set's column names, for rows whose fields are named
    /// otherwise: `{ instruction = "question", output = "answer" }`. Default: {} (as named).
    #[serde(default)]
    pub(crate) columns: BTreeMap<String, String>,
}

impl DataSection {
    /// `train_on` for a file of `format`: as set, or the format's default.
    pub(crate) fn train_on_for(&self, format: DataFormat) -> TrainOn {
        self.train_on.unwrap_or(match format {
            DataFormat::Tokens | DataFormat::Text => TrainOn::All,
            _ => TrainOn::Completions,
        })
    }
}

pub(super) fn d_prompt_field() -> String {
    "prompt".into()
}
pub(super) fn d_completion_field() -> String {
    "completion".into()
}
pub(super) fn d_on_bad_row() -> OnBadRow {
    OnBadRow::Error
}

pub(super) fn d_format() -> DataFormat {
    DataFormat::Text
}
pub(super) fn d_seq_len() -> usize {
    512
}

impl TrainFile {
    /// A Hub data set ("hf://datasets/ORG/NAME"), not a file.
    pub(crate) fn is_hub(&self) -> bool {
        is_hub(&self.path)
    }
}

/// Whether a data path names a Hub data set ("hf://..."), not a file.
pub(crate) fn is_hub(p: &std::path::Path) -> bool {
    p.to_str().is_some_and(|s| s.starts_with("hf://"))
}
