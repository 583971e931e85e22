//! A recipe's data, loaded: the tokenizer its formats need (with the chat template), each
//! data.train entry resolved (files, format, columns) and read through the tokenized cache,
//! the eval set (data.eval, or held out by data.eval_fraction), and the notes worth telling.

use super::build::{Counts, Entry};
use super::cache::{self, Options, Place, Prep};
use super::chat::ChatTemplate;
use super::columns::Columns;
use super::rows::format_name;
use super::source::SourceFile;
use super::store::Examples;
use super::stream::Stream;
use super::{source, Dataset, TextTokenizer, IGNORE};
use crate::hub::ModelFiles;
use crate::recipe::{DataFormat, DataSection, Recipe, RecipeError, TrainFile, TrainOn};
use anyhow::{bail, Context, Result};
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Instant;

/// A recipe's data sets, what loading them found worth telling, and the tokenizer they (or
/// `train.sample_every`) needed.
pub struct RecipeData {
    /// The training data (without the examples held out for eval).
    pub data: Dataset,
    /// The eval set (data.eval, or data.eval_fraction of the training data).
    pub eval: Option<Dataset>,
    /// Lines about the data beyond counts (see [`data_notes`]).
    pub notes: Vec<String>,
    /// The model's tokenizer, when the data or `train.sample_every` needs it.
    pub tokenizer: Option<TextTokenizer>,
}

/// What a run's data depends on besides the files: its `[data]` section, whether
/// `train.sample_every` needs the tokenizer, the seed of an eval split, and the recipe that
/// errors name.
pub struct DataPlan<'a> {
    /// The recipe (a bad chat template is its error, on data.chat_template).
    pub recipe: &'a Recipe,
    /// The data section.
    pub data: &'a DataSection,
    /// train.sample_every (> 0: the tokenizer is needed whatever the format).
    pub sample_every: usize,
    /// The seed that holds out data.eval_fraction.
    pub seed: u64,
}

/// The training data, the eval set and the notes worth telling about them, tokenized as the
/// plan says (through the cache `opts` names).
pub fn recipe_data(
    plan: &DataPlan,
    files: &ModelFiles,
    vocab: usize,
    opts: &Options,
) -> Result<RecipeData> {
    let d = plan.data;
    let tok = recipe_tokenizer(plan, files)?;
    let train = d.train.files(d.format);
    let mut data = load_entries(&train, d, tok.as_ref(), vocab, false, opts)?;
    let eval = match source::eval_entry(d) {
        Some(entry) => Some(load_entries(&[entry], d, tok.as_ref(), vocab, true, opts)?),
        None if d.eval_fraction > 0.0 => {
            if data.examples.len() < 2 {
                bail!(
                    "data.eval_fraction = {} needs at least 2 examples; the data has {}",
                    d.eval_fraction,
                    data.examples.len()
                );
            }
            Some(data.split_eval(d.eval_fraction, plan.seed))
        }
        None => None,
    };
    check_eval(eval.as_ref())?;
    let notes = data_notes(&data, eval.as_ref(), tok.as_ref(), d);
    Ok(RecipeData {
        data,
        eval,
        notes,
        tokenizer: tok,
    })
}

/// The eval set has a token to predict.
fn check_eval(eval: Option<&Dataset>) -> Result<()> {
    if let Some(e) = eval {
        if e.examples
            .iter()
            .all(|x| x.labels.iter().skip(1).all(|&l| l == IGNORE))
        {
            bail!("the eval set has no token to predict: every label is -100");
        }
    }
    Ok(())
}

/// A run's training set as [`recipe_data_streaming`] gives it.
pub enum Train {
    /// Prepared whole: read from the cache (or built before the call returned).
    Ready(Box<Dataset>),
    /// Being tokenized on a thread of its own, in file order; the first epoch may read its
    /// examples as they land.
    Streaming(Stream),
}

/// A recipe's data whose training set may stream (see [`recipe_data_streaming`]).
pub struct StreamedData {
    /// The training set, whole or streaming.
    pub train: Train,
    /// The eval set (data.eval; prepared whole before the training set starts).
    pub eval: Option<Dataset>,
    /// The model's tokenizer, when the data or `train.sample_every` needs it.
    pub tokenizer: Option<Arc<TextTokenizer>>,
}

/// Why the data of `d` cannot stream, None when it can: streaming needs an epoch that reads
/// the examples in file order, each once (no shuffle, every mix weight 1), and no eval set
/// held out of the whole training set.
pub fn stream_blocker(d: &DataSection) -> Option<&'static str> {
    if d.shuffle {
        return Some("data.shuffle = true orders an epoch over every example");
    }
    if d.train.files(d.format).iter().any(|f| f.weight != 1.0) {
        return Some("mix weights other than 1 repeat or subsample files");
    }
    if d.eval.is_none() && d.eval_fraction > 0.0 {
        return Some("data.eval_fraction holds out examples of the whole set");
    }
    None
}

/// The training data of `plan` with its eval set and tokenizer, where the training set, when
/// the cache does not hold it, is tokenized on a thread of its own into the cache (as
/// [`recipe_data`] would) while the caller reads its examples as they land. The caller checks
/// [`stream_blocker`] first: the examples land in file order.
pub fn recipe_data_streaming(
    plan: &DataPlan,
    files: &ModelFiles,
    vocab: usize,
    opts: &Options,
) -> Result<StreamedData> {
    let d = plan.data;
    let tok = recipe_tokenizer(plan, files)?.map(Arc::new);
    let eval = match source::eval_entry(d) {
        Some(entry) => Some(load_entries(
            &[entry],
            d,
            tok.as_deref(),
            vocab,
            true,
            opts,
        )?),
        None => None,
    };
    check_eval(eval.as_ref())?;
    let t0 = Instant::now();
    let train = d.train.files(d.format);
    let resolved = train
        .iter()
        .map(|f| Ok((f.clone(), source::files_of(f, d, false)?)))
        .collect::<Result<Vec<(TrainFile, Vec<SourceFile>)>>>()?;
    let entries = resolved
        .iter()
        .map(|(f, sf)| entry_with(f, d, tok.as_deref(), sf.clone()))
        .collect::<Result<Vec<_>>>()?;
    let place = cache::place(&entries, d, tok.as_deref(), vocab, false, opts)?;
    let whole = match (cache::hit(&place, entries.len()), &place) {
        (Some(x), _) => Some(x),
        (None, Place::Memory) => Some(cache::prepare(&place, &entries, d, vocab, opts, None)?),
        (None, _) => None,
    };
    drop(entries);
    let train = match whole {
        Some((ex, c, mut prep)) => {
            prep.secs = t0.elapsed().as_secs_f64();
            Train::Ready(Box::new(dataset(&train, ex, c, prep)))
        }
        None => {
            let (d, tok, mut opts) = (d.clone(), tok.clone(), opts.clone());
            // The steps' bar has the terminal; a log still gets the progress lines.
            opts.progress &= !std::io::stderr().is_terminal();
            Train::Streaming(Stream::spawn(t0, move |tap| {
                let entries = resolved
                    .iter()
                    .map(|(f, sf)| entry_with(f, &d, tok.as_deref(), sf.clone()))
                    .collect::<Result<Vec<_>>>()?;
                let (ex, c, mut prep) =
                    cache::prepare(&place, &entries, &d, vocab, &opts, Some(tap))?;
                prep.secs = t0.elapsed().as_secs_f64();
                crate::errln!(
                    "data prepared behind the steps in {:.1}s: {}",
                    prep.secs,
                    prep.describe()
                );
                Ok(dataset(&train, ex, c, prep))
            })?)
        }
    };
    Ok(StreamedData {
        train,
        eval,
        tokenizer: tok,
    })
}

/// The tokenizer (with the chat template when a format is "chat") that the data formats or
/// `train.sample_every` need; None when nothing needs one.
pub fn recipe_tokenizer(plan: &DataPlan, files: &ModelFiles) -> Result<Option<TextTokenizer>> {
    let dir = &files.dir;
    let d = plan.data;
    let mut formats: Vec<DataFormat> = d
        .train
        .files(d.format)
        .iter()
        .filter_map(|f| f.format)
        .collect();
    if d.eval.is_some() {
        formats.push(d.format);
    }
    // `sample_every` encodes its prompts and decodes the completions whatever the data format.
    let text_format = formats.iter().find(|f| **f != DataFormat::Tokens).copied();
    if text_format.is_none() && plan.sample_every == 0 {
        return Ok(None);
    }
    let t = files.tokenizer.as_ref().with_context(|| {
        let who = match text_format {
            Some(f) => format!("data format \"{}\"", format_name(f)),
            None => "train.sample_every".to_string(),
        };
        format!(
            "{who} needs {}/tokenizer.json, which is missing",
            dir.display()
        )
    })?;
    let mut tok = TextTokenizer::load(t, files.tokenizer_config.as_deref())?;
    let pref =
        |f: &DataFormat| matches!(f, DataFormat::Preference | DataFormat::UnpairedPreference);
    if !formats.contains(&DataFormat::Chat) && formats.iter().any(pref) {
        // conversation rows need it; string and pre-tokenized rows do not
        let choice = d.chat_template.as_deref();
        let specials = tok.specials.clone();
        tok.chat =
            ChatTemplate::load(dir, files.tokenizer_config.as_deref(), choice, specials).ok();
    }
    if formats.contains(&DataFormat::Chat) {
        let choice = d.chat_template.as_deref();
        let tpl = ChatTemplate::load(
            dir,
            files.tokenizer_config.as_deref(),
            choice,
            tok.specials.clone(),
        )
        .map_err(|e| -> RecipeError {
            plan.recipe.invalid(
                "data.chat_template",
                match choice {
                    None => format!("is unset, and {e:#}"),
                    Some(c) => format!("= \"{c}\": {e:#}"),
                },
            )
        })?;
        tok.chat = Some(tpl);
    }
    Ok(Some(tok))
}

/// Reads the entries of a mix (or data.eval, `eval`) through the cache `opts` names.
pub(super) fn load_entries(
    files: &[TrainFile],
    cfg: &DataSection,
    tok: Option<&TextTokenizer>,
    vocab: usize,
    eval: bool,
    opts: &Options,
) -> Result<Dataset> {
    let entries = files
        .iter()
        .map(|f| entry(f, cfg, tok, eval))
        .collect::<Result<Vec<_>>>()?;
    let (examples, c, prep) = cache::examples(&entries, cfg, tok, vocab, eval, opts)?;
    Ok(dataset(files, examples, c, prep))
}

/// The data set of the entries `files`, built (or mapped) as `examples` with counts `c`.
fn dataset(files: &[TrainFile], examples: Examples, c: Counts, prep: Prep) -> Dataset {
    let file_of = c
        .per_entry
        .iter()
        .enumerate()
        .flat_map(|(k, &n)| std::iter::repeat_n(k, n))
        .collect();
    Dataset {
        examples,
        truncated: c.truncated,
        source: files.first().map(|f| f.path.clone()).unwrap_or_default(),
        file_of,
        files: files.iter().map(|f| (f.path.clone(), f.weight)).collect(),
        skipped: c.skipped,
        skipped_first: c.skipped_first,
        no_targets: c.no_targets,
        no_answer: c.no_answer,
        no_answer_first: c.no_answer_first,
        eos_added: c.eos_added,
        turn_ends: c.turn_ends,
        prep,
    }
}

/// One entry resolved: its files (a Hub data set's, fetched as needed), and what its format
/// needs, checked (errors name the entry's first file).
fn entry<'a>(
    f: &TrainFile,
    cfg: &DataSection,
    tok: Option<&'a TextTokenizer>,
    eval: bool,
) -> Result<Entry<'a>> {
    entry_with(f, cfg, tok, source::files_of(f, cfg, eval)?)
}

/// [`entry`] with its files resolved.
fn entry_with<'a>(
    f: &TrainFile,
    cfg: &DataSection,
    tok: Option<&'a TextTokenizer>,
    files: Vec<SourceFile>,
) -> Result<Entry<'a>> {
    let format = f.format.unwrap_or(cfg.format);
    let fmt = format_name(format);
    let name = files
        .first()
        .map_or_else(|| f.path.display().to_string(), |s| s.name.clone());
    let tok = match format {
        DataFormat::Tokens => None,
        _ => Some(tok.with_context(|| {
            format!("format \"{fmt}\" ({name}) needs the model's tokenizer.json")
        })?),
    };
    if matches!(format, DataFormat::Alpaca | DataFormat::Completion)
        && tok.is_some_and(|t| t.eos_token.is_none())
    {
        bail!(
            "format \"{fmt}\" ({name}) ends every completion with the EOS token, but tokenizer_config.json names no eos_token"
        );
    }
    let chat = match (format, tok) {
        (DataFormat::Chat, Some(t)) => Some(
            t.chat
                .as_ref()
                .with_context(|| format!("format \"chat\" ({name}) needs a chat template"))?,
        ),
        _ => None,
    };
    let columns = Columns::new(format, cfg, source::columns_of(f, cfg))
        .map_err(|m| anyhow::anyhow!("data.columns {m}"))?;
    Ok(Entry {
        path: f.path.clone(),
        files,
        format,
        columns,
        completions_only: cfg.train_on_for(format) == TrainOn::Completions,
        tok,
        chat,
    })
}

/// Lines about the data beyond counts: the mix, skipped rows, dropped examples, how chat turns
/// end (and a warning when `generate` would not stop there), the eval set.
pub fn data_notes(
    data: &Dataset,
    eval: Option<&Dataset>,
    tok: Option<&TextTokenizer>,
    d: &DataSection,
) -> Vec<String> {
    let mut notes = Vec::new();
    if data.files.len() > 1 {
        let mix: Vec<String> = data
            .files
            .iter()
            .enumerate()
            .map(|(k, (p, w))| {
                let n = data.file_of.iter().filter(|&&f| f == k).count();
                format!("{} ({n} examples, weight {w})", p.display())
            })
            .collect();
        notes.push(format!("data mix: {}", mix.join(", ")));
    }
    if data.skipped > 0 {
        notes.push(format!(
            "skipped {} bad rows (data.on_bad_row = \"skip\"); first: {}",
            data.skipped,
            data.skipped_first.join("; ")
        ));
    }
    if let Some(first) = &data.no_answer_first {
        notes.push(format!(
            "dropped {} examples with nothing to train on under train_on = \"completions\"; first: {first}",
            data.no_answer
        ));
    }
    if data.no_targets > 0 {
        notes.push(format!(
            "dropped {} examples with no completion token left after truncation to seq_len {}",
            data.no_targets, d.seq_len
        ));
    }
    if data.eos_added > 0 {
        notes.push(format!(
            "appended the EOS token to {} assistant turns that the chat template ends with no stop token",
            data.eos_added
        ));
    }
    if let Some(tok) = tok {
        for (&id, &n) in &data.turn_ends {
            let name = tok.token_text(id).unwrap_or_default();
            notes.push(format!("{n} completions end with {name} (id {id})"));
            if !tok.generate_stop_ids.is_empty() && !tok.generate_stop_ids.contains(&id) {
                notes.push(format!(
                    "warning: {name} (id {id}) ends the assistant turns, but generation_config.json / config.json eos_token_id {:?} does not list it: generation will not stop there unless you add it",
                    tok.generate_stop_ids
                ));
            }
        }
    }
    if let Some(e) = eval {
        let from = match &d.eval {
            Some(p) => p.display().to_string(),
            None => format!(
                "data.eval_fraction {} of the training data",
                d.eval_fraction
            ),
        };
        notes.push(format!(
            "eval: {} examples from {from} ({} truncated, {} bad rows skipped)",
            e.examples.len(),
            e.truncated,
            e.skipped
        ));
    }
    notes
}
