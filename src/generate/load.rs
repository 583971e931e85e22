//! What `generate` runs: a checkpoint directory (a base, or a merged model), a base with a PEFT
//! adapter (the base from `--model`, or the adapter's base_model_name_or_path: a local
//! directory, or a Hub id read from the cache), or a recipe's model with the adapter in its
//! output directory.

use crate::data::chat::ChatTemplate;
use crate::data::TextTokenizer;
use crate::export;
use crate::hub::{self, ModelFiles};
use crate::lora::LoraSpec;
use crate::model::Model;
use crate::recipe::Recipe;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};

/// A model ready to generate from, and what came with it.
pub struct Loaded {
    /// The model (with the adapter, when one was given).
    pub model: Model,
    /// The checkpoint's files.
    pub files: ModelFiles,
    /// The adapter applied (unmerged), if any.
    pub adapter: Option<PathBuf>,
    /// The checkpoint's tokenizer (None without tokenizer.json: token-id prompts only).
    pub tok: Option<TextTokenizer>,
}

/// `model_dir` alone, or with `adapter`; without `model_dir` the adapter's base.
pub fn from_dirs(
    model_dir: Option<&Path>,
    adapter: Option<&Path>,
    device: &Device,
    dtype: DType,
) -> Result<Loaded> {
    let files = match (model_dir, adapter) {
        (Some(d), _) => ModelFiles::local(d)?,
        (None, Some(a)) => adapter_base(a)?,
        (None, None) => bail!("nothing to load: give a model directory or an adapter"),
    };
    load(files, adapter, device, dtype)
}

/// The recipe's model with the adapter its run saved (output.dir).
pub fn from_recipe(recipe: &Recipe, device: &Device, dtype: DType) -> Result<Loaded> {
    let out = recipe.output_dir();
    if !out.join(export::CONFIG).is_file() {
        bail!(
            "{} holds no adapter ({} is missing): train it first with `lora-train --recipe {}`",
            out.display(),
            export::CONFIG,
            recipe.source.display()
        );
    }
    let m = &recipe.model;
    let source = hub::Source::of(m.path.as_deref(), m.id.as_deref(), m.revision.as_deref())
        .context("the recipe's [model] needs `path` or `id`")?;
    let files = hub::model_files(&source)?;
    load(files, Some(&out), device, dtype)
}

/// The base an adapter names: base_model_name_or_path as a local checkpoint directory, else as
/// a Hub id at the adapter's `revision` (the cache, or a download).
fn adapter_base(adapter: &Path) -> Result<ModelFiles> {
    let info = export::read_adapter_config(adapter)?;
    let cfg = adapter.join(export::CONFIG);
    let name = info.base_model.unwrap_or_default();
    if name.is_empty() {
        bail!(
            "{}: base_model_name_or_path is empty: pass the base with --model DIR",
            cfg.display()
        );
    }
    // A relative path: from the working directory, else from the adapter's own (a run
    // whose base path is not UTF-8 records it so).
    let p = PathBuf::from(&name);
    let p = match p.is_relative() && !p.join("config.json").is_file() {
        true => adapter.join(&p),
        false => p,
    };
    if p.join("config.json").is_file() {
        return ModelFiles::local(&p);
    }
    if crate::util::check_repo_id(&name).is_err() {
        bail!(
            "{}: base_model_name_or_path = \"{name}\" is neither a checkpoint directory nor a Hub id: pass the base with --model DIR",
            cfg.display()
        );
    }
    let revision = std::fs::read_to_string(&cfg)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("revision")?.as_str().map(String::from));
    let source = hub::Source::Hub {
        id: name.clone(),
        revision: revision.unwrap_or_else(|| hub::DEFAULT_REVISION.to_string()),
    };
    hub::model_files(&source).with_context(|| {
        format!(
            "cannot get the base `{name}` that {} names (or pass it with --model DIR)",
            cfg.display()
        )
    })
}

fn load(
    files: ModelFiles,
    adapter: Option<&Path>,
    device: &Device,
    dtype: DType,
) -> Result<Loaded> {
    let spec = match adapter {
        Some(a) => {
            let spec = export::read_adapter_config(a)?.spec;
            if spec.dora {
                // The decoder's adapter path (generate::weights) adds s·B A to W's product
                // and has no per-row rescale; the merged model decodes at full speed anyway.
                bail!(
                    "{}: a DoRA adapter (use_dora = true) is not applied unmerged by generate: \
                     merge it with `lora-train export --adapter {} --out merged/`, then \
                     `lora-train generate --model merged/`",
                    a.join(export::CONFIG).display(),
                    a.display()
                );
            }
            LoraSpec {
                dropout: 0.0,
                ..spec
            }
        }
        None => LoraSpec {
            rank: 1,
            alpha: 1.0,
            dropout: 0.0,
            rslora: false,
            dora: false,
            targets: Vec::new(),
        },
    };
    let model = Model::load(&files, dtype, device, &spec, 0)
        .with_context(|| format!("cannot load the model in {}", files.dir.display()))?;
    if let Some(a) = adapter {
        export::load_adapter_weights(a, &model)
            .with_context(|| format!("cannot load the adapter {}", a.display()))?;
    }
    let tok = match &files.tokenizer {
        Some(t) => Some(TextTokenizer::load(t, files.tokenizer_config.as_deref())?),
        None => None,
    };
    Ok(Loaded {
        model,
        files,
        adapter: adapter.map(Path::to_path_buf),
        tok,
    })
}

/// The chat template of a checkpoint (`choice`: a template name or a .jinja file, as
/// data.chat_template) and the tokens that end its assistant turns: rendering a probe
/// conversation shows which stop token follows a reply (e.g. <|im_end|>, <|eot_id|>).
pub fn chat_template(
    loaded: &Loaded,
    tok: &TextTokenizer,
    choice: Option<&str>,
) -> Result<(ChatTemplate, Vec<u32>)> {
    let tpl = ChatTemplate::load(
        &loaded.files.dir,
        loaded.files.tokenizer_config.as_deref(),
        choice,
        tok.specials.clone(),
    )?;
    let probe: minijinja::Value = serde_json::from_str(
        r#"[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]"#,
    )?;
    let stops = match tpl.encode(tok, &probe, true) {
        Ok(ex) if ex.eos_added == 0 => ex.turn_ends,
        _ => Vec::new(),
    };
    Ok((tpl, stops))
}
