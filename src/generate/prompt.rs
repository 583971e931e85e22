//! How `generate --prompt` puts the text to the model: in the format the run trained on
//! (`data.format` of the recipe, or of the `recipe.toml` a run records beside its adapter), so
//! that an Alpaca-tuned adapter is asked in the Alpaca prompt and a chat-tuned one through its
//! chat template; `--raw` sends the text as it is.

use crate::recipe::{format_name, DataFormat, Recipe};
use std::path::Path;

/// The prompt format a generation applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Template {
    /// The text as it is (BOS added as the tokenizer says).
    Raw,
    /// The Alpaca prompt around the text as the instruction ("### Response:\n" last).
    Alpaca,
    /// A completion run's prompt: the text as it is, the completion follows it.
    Completion,
    /// One user turn rendered with the chat template (generation prompt added); `choice` is
    /// the run's data.chat_template (a template name or a .jinja file), if any.
    Chat {
        /// The run's data.chat_template, if it names one.
        choice: Option<String>,
    },
}

/// The template chosen, and why (printed, so the user sees what the model was asked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The format applied.
    pub template: Template,
    /// Where it came from, e.g. `data.format = "alpaca" of recipes/llama7b.toml`.
    pub why: String,
}

impl Template {
    /// Its name as `data.format` spells it ("none" for raw).
    pub fn name(&self) -> &'static str {
        match self {
            Template::Raw => "none",
            Template::Alpaca => "alpaca",
            Template::Completion => "completion",
            Template::Chat { .. } => "chat",
        }
    }
}

impl Choice {
    /// The line `generate` prints before the text.
    pub fn line(&self) -> String {
        let raw = match self.template {
            Template::Raw => String::new(),
            _ => "; --raw sends the prompt as it is".into(),
        };
        format!(
            "prompt template: {} ({}{raw})",
            self.template.name(),
            self.why
        )
    }
}

/// The template for `--prompt`: none with `raw`; else the format `recipe` trained on; else
/// that of the run recorded in `adapter`/recipe.toml; else none.
pub fn choose(raw: bool, recipe: Option<&Recipe>, adapter: Option<&Path>) -> Choice {
    if raw {
        return plain("--raw");
    }
    if let Some(r) = recipe {
        return of_recipe(r, &r.source.display().to_string());
    }
    let Some(dir) = adapter else {
        return plain("no recipe: a model without a run's record");
    };
    let path = dir.join("recipe.toml");
    if !path.is_file() {
        return plain(&format!("{} has no recipe.toml of its run", dir.display()));
    }
    let read = std::fs::read_to_string(&path)
        .map_err(|e| e.to_string())
        .and_then(|t| toml::from_str::<Recipe>(&t).map_err(|e| e.message().to_string()));
    match read {
        Ok(r) => of_recipe(&r, &path.display().to_string()),
        Err(e) => plain(&format!("cannot read {}: {e}", path.display())),
    }
}

fn plain(why: &str) -> Choice {
    Choice {
        template: Template::Raw,
        why: why.to_string(),
    }
}

/// The format `r` trained on: the one format of its data files (a mix of several formats, or
/// tokens / text, gets none).
fn of_recipe(r: &Recipe, source: &str) -> Choice {
    let mut formats: Vec<DataFormat> = Vec::new();
    for f in r.data.train.files(r.data.format) {
        if let Some(f) = f.format.filter(|f| !formats.contains(f)) {
            formats.push(f);
        }
    }
    let name = |f: &DataFormat| format_name(*f);
    let [one] = formats[..] else {
        let names: Vec<&str> = formats.iter().map(name).collect();
        return plain(&format!(
            "{source} mixes formats {}: give the prompt in the one you mean",
            names.join(", ")
        ));
    };
    let template = match one {
        DataFormat::Alpaca => Template::Alpaca,
        DataFormat::Completion => Template::Completion,
        DataFormat::Chat => Template::Chat {
            choice: r.data.chat_template.clone(),
        },
        DataFormat::Text | DataFormat::Tokens => Template::Raw,
        // TRL's prompts are the text as written (strings) or a conversation (use --chat).
        DataFormat::Preference | DataFormat::UnpairedPreference => {
            return plain(&format!(
                "data.format = \"{}\" of {source}: its prompts are used as written \
                 (conversations: --chat)",
                name(&one)
            ))
        }
    };
    Choice {
        template,
        why: format!("data.format = \"{}\" of {source}", name(&one)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recipe(format: &str) -> Recipe {
        let text =
            format!("[model]\npath = \"m\"\n[data]\ntrain = \"t.jsonl\"\nformat = \"{format}\"\n");
        toml::from_str(&text).unwrap()
    }

    #[test]
    fn the_trained_format_is_chosen_and_preference_prompts_go_as_written() {
        let alpaca = choose(false, Some(&recipe("alpaca")), None);
        assert_eq!(alpaca.template, Template::Alpaca);
        assert_eq!(
            choose(true, Some(&recipe("alpaca")), None).template,
            Template::Raw
        );
        for f in ["preference", "unpaired_preference"] {
            let c = choose(false, Some(&recipe(f)), None);
            assert_eq!(c.template, Template::Raw, "{f}");
            assert!(c.why.contains(&format!("\"{f}\"")), "{}", c.why);
            assert!(c.why.contains("--chat"), "{}", c.why);
        }
    }
}
