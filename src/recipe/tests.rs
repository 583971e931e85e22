use super::data::{d_completion_field, d_format, d_on_bad_row, d_prompt_field, d_seq_len};
use super::*;

#[test]
fn activation_checkpointing_reads_bools_and_mlp_and_writes_them_back() {
    #[derive(Deserialize, Serialize)]
    struct T {
        c: Checkpointing,
    }
    for (text, want) in [
        ("c = true", Checkpointing::Full),
        ("c = false", Checkpointing::Off),
        ("c = \"mlp\"", Checkpointing::Mlp),
        ("c = \"full\"", Checkpointing::Full),
    ] {
        let t: T = toml::from_str(text).unwrap();
        assert_eq!(t.c, want, "{text}");
        let back: T = toml::from_str(&toml::to_string(&t).unwrap()).unwrap();
        assert_eq!(back.c, want, "{text}");
    }
    assert_eq!(
        toml::to_string(&T {
            c: Checkpointing::Mlp
        })
        .unwrap()
        .trim(),
        "c = \"mlp\""
    );
    let err = toml::from_str::<T>("c = \"attn\"")
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("expected true, false or \"mlp\""), "{err}");
    assert!(toml::from_str::<T>("c = 1").is_err());
}

#[test]
fn reference_recipe_spells_out_the_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/reference.toml");
    let r = Recipe::load(&path, &[]).unwrap();
    let toml = |v: &dyn erased::Ser| v.to();
    assert_eq!(toml(&r.lora), toml(&LoraSection::default()));
    assert_eq!(toml(&r.train), toml(&TrainSection::default()));
    assert_eq!(toml(&r.parallel), toml(&ParallelSection::default()));
    assert_eq!(toml(&r.output), toml(&OutputSection::default()));
    assert_eq!(r.data.seq_len, d_seq_len());
    assert_eq!(r.data.format, d_format());
    assert_eq!((r.data.shuffle, r.data.pack), (true, false));
    assert_eq!(r.data.train_on, None);
    assert_eq!(r.data.prompt_field, d_prompt_field());
    assert_eq!(r.data.completion_field, d_completion_field());
    assert_eq!((&r.data.chat_template, &r.data.eval), (&None, &None));
    assert_eq!(r.data.eval_fraction, 0.0);
    assert_eq!(r.data.on_bad_row, d_on_bad_row());
    // Every [data] key is in reference.toml (set, or commented out where it has no value).
    let text = std::fs::read_to_string(&path).unwrap();
    let data: toml::Table = toml::from_str(&toml::to_string(&r.data).unwrap()).unwrap();
    let unset = [
        "train_on",
        "chat_template",
        "eval",
        "split",
        "subset",
        "revision",
        "files",
        "eval_split",
    ];
    for key in data.keys().map(String::as_str).chain(unset) {
        assert!(
            text.lines()
                .any(|l| l.trim_start_matches("# ").starts_with(&format!("{key} ="))),
            "recipes/reference.toml lacks data.{key}"
        );
    }
    assert_eq!((r.model.device, r.model.dtype), (DeviceKind::Cpu, None));
    assert_eq!(r.model.quantize, Quantize::None);
    assert!(r.model.double_quant);
    assert!(text.contains("# quantize = \"none\"") && text.contains("# double_quant = true"));
}

/// Serialize any section to TOML text, to compare sections field by field.
mod erased {
    pub(crate) trait Ser {
        fn to(&self) -> String;
    }
    impl<T: serde::Serialize> Ser for T {
        fn to(&self) -> String {
            toml::to_string(self).unwrap()
        }
    }
}

#[test]
fn set_overrides_types_and_paths() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("m")).unwrap();
    std::fs::write(dir.path().join("d.jsonl"), "{}").unwrap();
    let p = dir.path().join("r.toml");
    std::fs::write(&p, "[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\n").unwrap();
    let sets = [
        "train.lr=1e-4",
        "lora.targets=all-linear",
        "train.betas=[0.8, 0.9]",
        "data.pack=true",
    ];
    let r = Recipe::load(&p, &sets.map(String::from)).unwrap();
    assert_eq!(r.train.lr, 1e-4);
    assert_eq!(r.lora.targets, Targets::AllLinear("all-linear".into()));
    assert_eq!(r.train.betas, [0.8, 0.9]);
    assert!(r.data.pack);
    assert_eq!(
        r.model.path.as_deref(),
        Some(dir.path().join("m").as_path())
    );
    assert_eq!(r.target_modules().unwrap().len(), 11);
    let e = Recipe::load(&p, &["lora.rank=0".into()])
        .unwrap_err()
        .to_string();
    assert!(e.ends_with("`lora.rank` must be at least 1"), "{e}");
    let e = Recipe::load(&p, &["model=3".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("the key must be section.key"), "{e}");
    let e = Recipe::load(&p, &["model.path.x=3".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("sits under a value"), "{e}");
}

#[test]
fn train_mix_parses_resolves_validates_and_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("m")).unwrap();
    for f in ["a.jsonl", "b.jsonl"] {
        std::fs::write(dir.path().join(f), "{}").unwrap();
    }
    let p = dir.path().join("r.toml");
    let head = "[model]\npath = \"m\"\n[data]\n";
    std::fs::write(
        &p,
        format!("{head}train = [{{ path = \"a.jsonl\", weight = 2.0 }}, {{ path = \"b.jsonl\", format = \"chat\" }}]\nformat = \"alpaca\"\n"),
    )
    .unwrap();
    let r = Recipe::load(&p, &[]).unwrap();
    let files = r.data.train.files(r.data.format);
    assert_eq!(files.len(), 2);
    assert_eq!(files[0].path, dir.path().join("a.jsonl"));
    assert_eq!(
        (files[0].weight, files[0].format),
        (2.0, Some(DataFormat::Alpaca))
    );
    assert_eq!(
        (files[1].weight, files[1].format),
        (1.0, Some(DataFormat::Chat))
    );
    assert_eq!(r.data.train_on_for(DataFormat::Chat), TrainOn::Completions);
    assert_eq!(r.data.train_on_for(DataFormat::Text), TrainOn::All);
    // The resolved recipe (written beside the adapter) loads back as the same recipe.
    let back = dir.path().join("back.toml");
    std::fs::write(&back, r.to_toml()).unwrap();
    assert_eq!(Recipe::load(&back, &[]).unwrap().data.train, r.data.train);

    let err = |text: &str, sets: &[&str]| {
        std::fs::write(&p, format!("{head}{text}")).unwrap();
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Recipe::load(&p, &sets).unwrap_err().to_string()
    };
    let e = err("train = [{ path = \"a.jsonl\", wieght = 2 }]\n", &[]);
    assert!(
        e.contains("unknown field `wieght`, expected one of `path`, `weight`, `format`"),
        "{e}"
    );
    let e = err("train = [{ path = \"a.jsonl\", weight = 0 }]\n", &[]);
    assert!(
        e.ends_with("must be a positive number (1.0 = each example once per epoch)"),
        "{e}"
    );
    let e = err("train = []\n", &[]);
    assert!(
        e.ends_with("`data.train` is an empty list: name at least one file"),
        "{e}"
    );
    let e = err("train = \"a.jsonl\"\ntrain_on = \"completions\"\n", &[]);
    assert!(
        e.contains("`data.train_on` = \"completions\" needs prompts to mask"),
        "{e}"
    );
    let e = err("train = \"a.jsonl\"\n", &["train.eval_every=5"]);
    assert!(
        e.ends_with(
            "`train.eval_every` needs an eval set: set data.eval (a file) or data.eval_fraction"
        ),
        "{e}"
    );
    let e = err(
        "train = \"a.jsonl\"\neval = \"b.jsonl\"\neval_fraction = 0.1\n",
        &[],
    );
    assert!(
        e.ends_with("`data.eval_fraction` is set together with data.eval: keep one"),
        "{e}"
    );
    let e = err("train = \"a.jsonl\"\neval_fraction = 1.0\n", &[]);
    assert!(e.ends_with("`data.eval_fraction` must be in [0, 1)"), "{e}");
    let e = err("train = \"a.jsonl\"\nchat_template = \"t.jinja\"\n", &[]);
    assert!(
        e.contains("`data.chat_template` file ") && e.ends_with("t.jinja does not exist"),
        "{e}"
    );
    let e = err("train = \"a.jsonl\"\non_bad_row = \"ignore\"\n", &[]);
    assert!(
        e.contains("unknown variant `ignore`, expected `error` or `skip`"),
        "{e}"
    );
}

#[test]
fn resume_takes_a_flag_or_a_checkpoint_path() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("m")).unwrap();
    std::fs::write(dir.path().join("d.jsonl"), "{}").unwrap();
    let ck = dir.path().join("out/checkpoint-3");
    std::fs::create_dir_all(&ck).unwrap();
    std::fs::write(ck.join("trainer_state.json"), "{}").unwrap();
    let p = dir.path().join("r.toml");
    let base = "[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\n";
    std::fs::write(
        &p,
        format!("{base}[train]\nresume = \"out/checkpoint-3\"\n"),
    )
    .unwrap();
    // A path in the recipe is relative to the recipe's directory.
    let r = Recipe::load(&p, &[]).unwrap();
    assert_eq!(r.train.resume, Resume::Path(ck));
    let r = Recipe::load(&p, &["train.resume=true".into()]).unwrap();
    assert_eq!(r.train.resume, Resume::Flag(true));
    let load_err = |set: &str| Recipe::load(&p, &[set.into()]).unwrap_err().to_string();
    let e = load_err("train.resume=no/such/dir");
    assert!(
        e.ends_with("`train.resume` = \"no/such/dir\" is not a checkpoint directory (it has no trainer_state.json); use true for the newest checkpoint in the output directory"),
        "{e}"
    );
    let e = load_err("train.resume=3");
    assert!(
        e.contains("expected true, false or the path of a checkpoint directory"),
        "{e}"
    );
    let e = load_err("output.max_shard_size=5XB");
    assert!(
        e.ends_with("`output.max_shard_size` = \"5XB\" is not a size: write a number with a unit, e.g. \"5GB\", \"500MB\", \"2GiB\""),
        "{e}"
    );
    let e = load_err("output.merge_into=nf4");
    assert!(
        e.contains("unknown variant `nf4`, expected `base` or `dequantized`"),
        "{e}"
    );
    let e = load_err("output.merge_into=dequantized");
    assert!(
        e.ends_with("`output.merge_into` = \"dequantized\" applies to output.merge = true only: set merge = true, or remove it"),
        "{e}"
    );
    let e = Recipe::load(
        &p,
        &[
            "output.merge_into=dequantized".into(),
            "output.merge=true".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.ends_with("`output.merge_into` = \"dequantized\" is for an adapter trained on an NF4 base (model.quantize = \"nf4\"); with quantize = \"none\" it trained on the base's own weights: remove it"),
        "{e}"
    );
    let r = Recipe::load(
        &p,
        &[
            "output.merge_into=dequantized".into(),
            "output.merge=true".into(),
            "model.quantize=nf4".into(),
        ],
    )
    .unwrap();
    assert_eq!(r.output.merge_into, MergeInto::Dequantized);
    let sets = [
        "output.merge=true",
        "output.keep_last=2",
        "train.skip_nonfinite=true",
    ];
    let r = Recipe::load(&p, &sets.map(String::from)).unwrap();
    assert!(r.output.merge && r.train.skip_nonfinite);
    assert_eq!(r.output.keep_last, 2);
}

#[test]
fn report_to_reads_a_name_or_a_list() {
    #[derive(Deserialize)]
    struct T {
        #[serde(deserialize_with = "super::train::de_report_to")]
        r: Vec<Tracker>,
    }
    let read = |s: &str| toml::from_str::<T>(s).map(|t| t.r);
    assert_eq!(read("r = \"mlflow\"").unwrap(), [Tracker::Mlflow]);
    assert_eq!(
        read("r = [\"tensorboard\", \"mlflow\"]").unwrap(),
        [Tracker::Tensorboard, Tracker::Mlflow]
    );
    let err = read("r = [\"wandb\"]").unwrap_err().to_string();
    assert!(err.contains("wandb sync --sync-tensorboard"), "{err}");
    let err = read("r = \"comet\"").unwrap_err().to_string();
    assert!(err.contains("use \"tensorboard\" or \"mlflow\""), "{err}");
}
