//! `lora-train generate`: text from a base + adapter, a merged model or a recipe's output,
//! streamed as it is written; `--bench` times decoding on random weights instead.

use super::Usage;
use anyhow::{Context, Result};
use clap::{ArgGroup, Args, ValueEnum};
use lora_train::data::TextTokenizer;
use lora_train::generate::prompt::{self, Template};
use lora_train::generate::{self, load, Decoder, Finish, Sampler, Sampling, Weights};
use lora_train::recipe::Recipe;
use std::io::{BufRead, IsTerminal};
use std::path::PathBuf;

#[derive(Args, Clone)]
#[command(
    group(ArgGroup::new("source").args(["model", "adapter", "recipe"]).multiple(true)),
    group(ArgGroup::new("input").args(["prompt", "prompt_ids", "chat"])),
    after_help = "Examples:\n  lora-train generate --adapter adapters/tiny-cpu --prompt 'Once upon a time'\n  lora-train generate --recipe recipes/tiny-cpu-chat.toml --chat\n  lora-train generate --model merged/ --prompt 'Hi' --temperature 0.7 --top-p 0.9 --seed 1\n  lora-train generate --bench --shape llama2-7b --device cuda --prompt-len 128 --max-new-tokens 256"
)]
pub struct GenerateArgs {
    /// A checkpoint directory: the base (with --adapter), or a merged model alone.
    #[arg(long, conflicts_with = "recipe")]
    model: Option<PathBuf>,
    /// A PEFT adapter directory, applied unmerged. Base: --model, else the adapter's
    /// base_model_name_or_path.
    #[arg(long, conflicts_with = "recipe")]
    adapter: Option<PathBuf>,
    /// A recipe: its model, with the adapter in its output directory.
    #[arg(long, short)]
    recipe: Option<PathBuf>,
    /// Override a recipe field (with --recipe), e.g. --set output.dir=runs/a.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE", requires = "recipe")]
    set: Vec<String>,
    /// The text to answer, put in the format the run trained on (data.format of --recipe or
    /// of the adapter's recipe.toml: alpaca, completion, chat); the template applied is printed.
    #[arg(long)]
    prompt: Option<String>,
    /// Send --prompt as it is, without the run's template (BOS added as the tokenizer says).
    #[arg(long, requires = "prompt")]
    raw: bool,
    /// The prompt as token ids, e.g. 1,306,4685 (for checkpoints without a tokenizer: the
    /// new ids are printed).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Vec<u32>,
    /// A conversation: each line of stdin is a user message, rendered with the chat template
    /// (generation prompt added); the reply is streamed and kept for the next turn, until EOF.
    #[arg(long)]
    chat: bool,
    /// With --chat (or a chat run's --prompt): a system message first.
    #[arg(long)]
    system: Option<String>,
    /// With --chat: a .jinja file or a template name of tokenizer_config.json (default: the
    /// model's own; with --recipe, its data.chat_template).
    #[arg(long, requires = "chat")]
    chat_template: Option<String>,
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    max_new_tokens: u32,
    /// 0 = greedy; else sample from softmax(logits / temperature).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Sample from the k most likely tokens only (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sample from the most likely tokens that together reach this probability (1 = all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Seed of the sampling stream: the same seed repeats a run.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Do not stop at EOS or the template's stop tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Default: the recipe's, else cuda in a CUDA build, else cpu.
    #[arg(long, value_enum)]
    device: Option<DeviceArg>,
    /// CUDA ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Weights' dtype. Default: the recipe's, else bf16 on CUDA and f32 on the CPU.
    #[arg(long, value_enum)]
    dtype: Option<DtypeArg>,
    /// Time decoding on random weights of --shape instead (prints JSON; no model is read).
    #[arg(long, conflicts_with_all = ["source", "input"])]
    bench: bool,
    /// --bench: a shape `bench --shape` knows (llama2-7b, llama3-8b, qwen3-8b, gemma2-9b, ...).
    #[arg(long, default_value = "llama2-7b", requires = "bench", value_parser = super::bench::shape)]
    shape: String,
    /// --bench: prompt tokens before the timed steps.
    #[arg(long, default_value_t = 128, requires = "bench", value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    prompt_len: u32,
    /// --bench: timed runs (mean).
    #[arg(long, default_value_t = 3, requires = "bench", value_parser = clap::value_parser!(u32).range(1..=1000))]
    reps: u32,
    /// --bench: LoRA rank of random adapters, applied unmerged (0 = base only).
    #[arg(long, default_value_t = 0, requires = "bench", value_parser = clap::value_parser!(u32).range(0..=4096))]
    rank: u32,
    /// --bench: which linears get adapters.
    #[arg(long, value_enum, default_value_t = super::bench::Targets::All, requires = "bench")]
    targets: super::bench::Targets,
    /// --bench: memory bandwidth in bytes/s for the bandwidth-limit fraction (H200: 4.8e12).
    #[arg(long, default_value_t = 4.8e12, requires = "bench")]
    bandwidth: f64,
    /// --bench: also append the JSON line to this file.
    #[arg(long, requires = "bench")]
    json: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, ValueEnum)]
enum DtypeArg {
    F32,
    Bf16,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    if a.bench {
        return bench(&a);
    }
    let sampling = Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    };
    sampling.check().map_err(|e| Usage(format!("{e:#}")))?;
    if a.prompt.is_none() && a.prompt_ids.is_empty() && !a.chat {
        return Err(Usage(
            "nothing to continue: give --prompt TEXT, --prompt-ids 1,2,3 or --chat".into(),
        )
        .into());
    }
    let recipe = match &a.recipe {
        Some(p) => Some(lora_train::run::load_recipe(p, &a.set)?),
        None => None,
    };
    let (device, dtype) = device_and_dtype(&a, recipe.as_ref())?;
    for (flag, p) in [("--model", &a.model), ("--adapter", &a.adapter)] {
        if let Some(p) = p.as_ref().filter(|p| !p.is_dir()) {
            return Err(Usage(format!("{flag} {}: no such directory", p.display())).into());
        }
    }
    let loaded = match &recipe {
        Some(r) => load::from_recipe(r, &device, dtype)?,
        None if a.model.is_none() && a.adapter.is_none() => {
            return Err(
                Usage("no model: give --model DIR, --adapter DIR or --recipe FILE".into()).into(),
            )
        }
        None => load::from_dirs(a.model.as_deref(), a.adapter.as_deref(), &device, dtype)?,
    };
    let mut sampler = Sampler::new(sampling)?;
    let max_new = a.max_new_tokens as usize;
    if a.chat {
        let choice = a
            .chat_template
            .clone()
            .or_else(|| recipe.as_ref().and_then(|r| r.data.chat_template.clone()));
        return chat(&a, loaded, &mut sampler, max_new, choice.as_deref());
    }
    let tok = loaded.tok.as_ref();
    let mut turn_ends = Vec::new();
    let ids = match (&a.prompt, tok) {
        (Some(p), Some(t)) => {
            let choice = prompt::choose(a.raw, recipe.as_ref(), a.adapter.as_deref());
            lora_train::errln!("{}", choice.line());
            let (ids, ends) = templated(&loaded, t, &choice.template, p, a.system.as_deref())?;
            turn_ends = ends;
            ids
        }
        (Some(_), None) => {
            return Err(Usage(format!(
                "{} has no tokenizer.json: give the prompt as --prompt-ids",
                loaded.files.dir.display()
            ))
            .into())
        }
        (None, _) => a.prompt_ids.clone(),
    };
    let stop = match (a.ignore_eos, tok) {
        (true, _) => Vec::new(),
        (false, Some(t)) => [&t.stop_ids[..], &turn_ends[..]].concat(),
        (false, None) => loaded.model.cfg.eos_token_ids.clone(),
    };
    let mut model = loaded.model;
    let mut dec = Decoder::new(Weights::stacked(&mut model)?, ids.len() + max_new)?;
    let out = run_one(&mut dec, &ids, max_new, &stop, &mut sampler, tok)?;
    if tok.is_none() {
        let s: Vec<String> = out.tokens.iter().map(|t| t.to_string()).collect();
        lora_train::outln!("{}", s.join(" "));
    }
    report_speed(&out, ids.len());
    Ok(())
}

/// The prompt's ids in `template`, and the tokens that end a chat turn (none otherwise).
fn templated(
    loaded: &load::Loaded,
    tok: &TextTokenizer,
    template: &Template,
    text: &str,
    system: Option<&str>,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let choice = match template {
        Template::Raw | Template::Completion => return Ok((tok.encode_prompt(text)?, Vec::new())),
        Template::Alpaca => {
            let p = lora_train::data::alpaca_prompt(text, "");
            return Ok((tok.encode_prompt(&p)?, Vec::new()));
        }
        Template::Chat { choice } => choice.as_deref(),
    };
    let (tpl, ends) = load::chat_template(loaded, tok, choice)?;
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    messages.push(serde_json::json!({"role": "user", "content": text}));
    let msgs: minijinja::Value = serde_json::from_value(serde_json::Value::Array(messages))?;
    let msgs = lora_train::data::chat::normalize_messages(&msgs)?;
    let rendered = tpl.render(&msgs, true).with_context(|| {
        format!(
            "rendering the prompt with the chat template of {}",
            loaded.files.dir.display()
        )
    })?;
    Ok((tok.encode_offsets(&rendered.text)?.0, ends))
}

/// One generation, its text streamed to stdout (nothing without a tokenizer).
fn run_one(
    dec: &mut Decoder,
    ids: &[u32],
    max_new: usize,
    stop: &[u32],
    sampler: &mut Sampler,
    tok: Option<&TextTokenizer>,
) -> Result<generate::Output> {
    // Streamed through util::out: a reader that goes away ends the process quietly.
    let mut stream = tok.map(generate::stream::TextStream::new);
    let out = generate::generate(dec, ids, max_new, stop, sampler, &mut |t| {
        if let Some(s) = stream.as_mut() {
            if let Some(text) = s.push(t)? {
                lora_train::out!("{text}");
            }
        }
        Ok(())
    })?;
    if let Some(s) = stream.as_mut() {
        if let Some(text) = s.finish()? {
            lora_train::out!("{text}");
        }
        lora_train::outln!();
    }
    Ok(out)
}

fn report_speed(out: &generate::Output, prompt: usize) {
    let n = out.tokens.len();
    let s = out.prefill_s + out.decode_s;
    let why = match out.finish {
        Finish::Stop(_) => "stop token",
        Finish::MaxNewTokens => "max_new_tokens",
        Finish::ContextFull => "max_position_embeddings reached",
    };
    // After the first token (the prompt's forward), the rate of decoding alone.
    let decode = match n > 1 && out.decode_s > 0.0 {
        true => format!(", decoding {:.1} tok/s", (n - 1) as f64 / out.decode_s),
        false => String::new(),
    };
    lora_train::errln!(
        "{n} tokens in {s:.2} s ({:.1} tok/s{decode}; prompt {prompt} tokens in {:.2} s; ended by {why})",
        n as f64 / s.max(1e-9),
        out.prefill_s
    );
}

/// `--chat`: user lines from stdin, replies streamed, the conversation kept (and its cached
/// keys and values reused) turn after turn.
fn chat(
    a: &GenerateArgs,
    loaded: load::Loaded,
    sampler: &mut Sampler,
    max_new: usize,
    choice: Option<&str>,
) -> Result<()> {
    let Some(tok) = loaded.tok.as_ref() else {
        return Err(Usage(format!(
            "--chat needs a tokenizer: {} has no tokenizer.json",
            loaded.files.dir.display()
        ))
        .into());
    };
    let (tpl, turn_ends) = load::chat_template(&loaded, tok, choice)?;
    let mut stop = tok.stop_ids.clone();
    stop.extend(turn_ends);
    stop.sort_unstable();
    stop.dedup();
    if a.ignore_eos {
        stop.clear();
    }
    let mut messages: Vec<serde_json::Value> = Vec::new();
    if let Some(s) = &a.system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    let dir = loaded.files.dir.clone();
    let mut model = loaded.model;
    let mut dec = Decoder::new(Weights::stacked(&mut model)?, 1024 + max_new)?;
    let interactive = std::io::stdin().is_terminal();
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if interactive {
            lora_train::util::out::write(lora_train::util::out::Stream::Err, format_args!("> "));
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("cannot read stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        messages.push(serde_json::json!({"role": "user", "content": line}));
        let msgs: minijinja::Value =
            serde_json::from_value(serde_json::Value::Array(messages.clone()))?;
        let msgs = lora_train::data::chat::normalize_messages(&msgs)?;
        let text = tpl
            .render(&msgs, true)
            .with_context(|| {
                format!(
                    "rendering the conversation with the template of {}",
                    dir.display()
                )
            })?
            .text;
        let ids = tok.encode_offsets(&text)?.0;
        let out = run_one(&mut dec, &ids, max_new, &stop, sampler, Some(tok))?;
        report_speed(&out, ids.len());
        let reply = tok.decode(out.text_tokens())?;
        messages.push(serde_json::json!({"role": "assistant", "content": reply}));
    }
    Ok(())
}

/// The device and dtype `generate` runs on: the flags, else the recipe's, else CUDA where
/// the build has it; the dtype as training resolves it (model::device), f16 refused.
fn device_and_dtype(
    a: &GenerateArgs,
    recipe: Option<&Recipe>,
) -> Result<(candle_core::Device, candle_core::DType)> {
    use lora_train::model::device;
    use lora_train::recipe::{DeviceKind, Dtype};
    let kind = match (a.device, recipe) {
        (Some(DeviceArg::Cuda), _) => DeviceKind::Cuda,
        (Some(DeviceArg::Cpu), _) => DeviceKind::Cpu,
        (None, Some(r)) => r.model.device,
        (None, None) if cfg!(feature = "cuda") => DeviceKind::Cuda,
        (None, None) => DeviceKind::Cpu,
    };
    if kind.is_cuda() && !cfg!(feature = "cuda") {
        return Err(Usage(format!("--device cuda: {}", device::DeviceError::NoCuda)).into());
    }
    let dtype = match (a.dtype, recipe.and_then(|r| r.model.dtype)) {
        (Some(DtypeArg::F32), _) => Some(Dtype::F32),
        (Some(DtypeArg::Bf16), _) => Some(Dtype::Bf16),
        (None, Some(Dtype::F16)) => {
            return Err(Usage(
                "model.dtype = \"f16\": generate runs in f32 or bf16 (pass --dtype)".into(),
            )
            .into())
        }
        (None, d) => d,
    };
    Ok((device::open(kind, a.gpu)?, device::dtype(kind, dtype)))
}

fn bench(a: &GenerateArgs) -> Result<()> {
    let (device, dtype) = device_and_dtype(a, None)?;
    if !(a.bandwidth.is_finite() && a.bandwidth > 0.0) {
        return Err(Usage(format!(
            "--bandwidth {} must be a positive number of bytes/s",
            a.bandwidth
        ))
        .into());
    }
    let res = generate::bench::run(&generate::bench::DecodeBench {
        shape: a.shape.clone(),
        prompt_len: a.prompt_len as usize,
        new_tokens: a.max_new_tokens as usize,
        reps: a.reps as usize,
        rank: a.rank as usize,
        targets: a.targets.name().to_string(),
        dtype,
        device,
        bandwidth: a.bandwidth,
    })?;
    lora_train::outln!("{res}");
    if let Some(p) = &a.json {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .with_context(|| format!("cannot open {}", p.display()))?;
        writeln!(f, "{res}")?;
    }
    Ok(())
}
