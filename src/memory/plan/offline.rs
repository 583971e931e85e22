//! The `plan --shape` line that plans a Hub recipe's run without its config.json (offline).

/// For a recipe of a Hub model: the `plan --shape` line of the same run, where a shape of
/// `bench` is that model (read from the id: `meta-llama/Llama-2-7b-hf` → llama2-7b), else
/// with the shapes listed.
pub fn shape_command(
    r: &crate::recipe::Recipe,
    gpus: usize,
    gpu_mem: Option<u64>,
) -> Option<String> {
    let id = r.model.id.as_deref()?;
    let flat: String = id
        .to_ascii_lowercase()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .collect();
    const KNOWN: [(&str, &str); 9] = [
        ("llama27b", "llama2-7b"),
        ("llama213b", "llama2-13b"),
        ("llama270b", "llama2-70b"),
        ("qwen330ba3b", "qwen3-30b-a3b"),
        ("qwen38b", "qwen3-8b"),
        ("gemma29b", "gemma2-9b"),
        ("gemma312b", "gemma3-12b"),
        ("phi3mini", "phi3-mini"),
        ("llama3", "llama3-8b"),
    ];
    let known = KNOWN
        .iter()
        .find(|(k, s)| flat.contains(k) && (*s != "llama3-8b" || flat.contains("8b")));
    let shape = match known {
        Some((_, s)) => s.to_string(),
        None => format!(
            "NAME (the nearest of {})",
            crate::model::shapes::SHAPES.join(", ")
        ),
    };
    let mut cmd = format!(
        "lora-train plan --shape {shape} --seq {} --micro-batch {} --rank {}",
        r.data.seq_len, r.train.micro_batch, r.lora.rank
    );
    if gpus > 1 {
        cmd.push_str(&format!(" --gpus {gpus}"));
    }
    if r.model.quantize == crate::recipe::Quantize::Nf4 {
        cmd.push_str(" --nf4");
    }
    match r.train.activation_checkpointing {
        crate::recipe::Checkpointing::Full => cmd.push_str(" --ckpt"),
        crate::recipe::Checkpointing::Mlp => cmd.push_str(" --ckpt mlp"),
        crate::recipe::Checkpointing::Off => {}
    }
    match gpu_mem {
        Some(b) if b % (1 << 30) == 0 => cmd.push_str(&format!(" --gpu-mem {}GiB", b >> 30)),
        Some(b) => cmd.push_str(&format!(" --gpu-mem {b}B")),
        None => {}
    }
    Some(cmd)
}
