//! What a merge checks before it writes: the adapter against the base (every tensor it
//! names, shapes, magnitudes, what PEFT features we do not merge).

use super::*;

/// A module's DoRA magnitude (`m` [out]) is there exactly when the config says use_dora.
pub(super) fn check_magnitude(
    adapter: &Path,
    module: &str,
    m: Option<&Tensor>,
    dora: bool,
    out_f: usize,
) -> Result<()> {
    let (path, cfg) = (adapter.join(WEIGHTS), adapter.join(CONFIG));
    match (m, dora) {
        (None, false) => Ok(()),
        (Some(m), true) if m.dims() == [out_f] => Ok(()),
        (Some(m), true) => bail!(
            "{}: `{module}`'s lora_magnitude_vector has shape {:?}, its linear has {out_f} \
             outputs: the adapter is damaged or was trained on another model",
            path.display(),
            m.dims()
        ),
        (None, true) => bail!(
            "{} says use_dora = true, but {} has no lora_magnitude_vector for `{module}`: \
             the adapter is incomplete",
            cfg.display(),
            path.display()
        ),
        (Some(_), false) => bail!(
            "{} has a lora_magnitude_vector for `{module}`, but {} says use_dora = false: \
             set \"use_dora\": true there if this is a DoRA adapter",
            path.display(),
            cfg.display()
        ),
    }
}

/// adapter_config.json settings that change what a merge must do and that we do not do.
pub(super) fn check_unsupported(dir: &Path) -> Result<()> {
    let path = dir.join(CONFIG);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let set = |k: &str| match v.get(k) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    };
    for (k, why) in [
        (
            "fan_in_fan_out",
            "weights stored transposed (Conv1D models)",
        ),
        ("modules_to_save", "fully trained extra modules"),
        ("layers_to_transform", "adapters on some layers only"),
        ("exclude_modules", "modules left out of target_modules"),
        ("layer_replication", "layers duplicated by the adapter"),
        ("lora_bias", "a bias on lora_B"),
        ("trainable_token_indices", "trained embedding rows"),
    ] {
        if set(k) {
            bail!(
                "{}: `{k}` is set ({why}); merging such adapters is not supported",
                path.display()
            );
        }
    }
    Ok(())
}

/// A checked adapter, shaped for its merge (f32).
pub(super) enum Adapter {
    /// A linear's A [r, in], B [out, r] and DoRA's m [out].
    Linear(Tensor, Tensor, Option<Tensor>),
    /// A MoE's expert parameter's A [E, r, in] and B [E, out, r] (`merge_experts`).
    Experts(Tensor, Tensor),
}

/// The adapters by module.
pub(super) type Adapted = HashMap<String, Adapter>;

/// Every adapter module must match a base linear, shapes included; every targeted linear of
/// the base must have its adapter. With the adapters, each item's slot among the experts'
/// adapters (`merge_experts::slot`; None for any other tensor).
pub(super) fn check_adapter(
    adapter: &Path,
    ckpt: &Base,
    info: &crate::export::AdapterInfo,
    pairs: BTreeMap<String, Pair>,
    items: &[Item],
) -> Result<(Adapted, Vec<Option<experts::Slot>>)> {
    let base = ckpt.dir;
    let targets = &info.spec.targets;
    let file = adapter.join(WEIGHTS);
    let slots: Vec<Option<experts::Slot>> = items
        .iter()
        .map(|it| experts::slot(&it.name, &it.shape, targets, ckpt.xw))
        .collect();
    every_target_adapted(&file, base, targets, &pairs, items, &slots)?;
    let index: HashMap<&str, &Item> = items.iter().map(|it| (it.name.as_str(), it)).collect();
    let mut checked = HashMap::new();
    for (module, p) in pairs {
        let (Some(a), Some(b)) = (p.a, p.b) else {
            bail!(
                "{}: `{module}` has only one of lora_A / lora_B",
                file.display()
            );
        };
        if experts::is_module(&module) {
            if p.m.is_some() || info.spec.dora {
                bail!(
                    "{}: `{module}` is an adapter on expert parameters with DoRA's magnitude: \
                     PEFT's adapters on parameters take no DoRA",
                    file.display()
                );
            }
            let into: Vec<(&experts::Slot, &[usize])> = items
                .iter()
                .zip(&slots)
                .filter_map(|(it, s)| s.as_ref().map(|s| (s, it.shape.as_slice())))
                .filter(|(s, _)| s.module == module)
                .collect();
            let (a, b) = experts::shaped(&a, &b, info.spec.rank, &into).with_context(|| {
                format!(
                    "the adapter's `{module}` does not fit the experts of the base model in {}: \
                     the adapter was trained on another model",
                    base.display()
                )
            })?;
            checked.insert(module, Adapter::Experts(a, b));
            continue;
        }
        let wname = format!("{module}.weight");
        let Some(w) = index.get(wname.as_str()) else {
            bail!(
                "the adapter has `{}`, but the base model in {} has no tensor `{wname}`: \
                 the adapter was trained on another model",
                peft_key(&module, 'A'),
                base.display()
            );
        };
        let (r, in_f) = a.dims2()?;
        let (out_f, rb) = b.dims2()?;
        let leaf = module.rsplit('.').next().unwrap_or("");
        if !targets.iter().any(|t| t == leaf) {
            bail!(
                "{}: `{module}` is not among adapter_config.json's target_modules {targets:?}",
                file.display()
            );
        }
        if r != info.spec.rank || rb != r || w.shape != [out_f, in_f] {
            bail!(
                "the adapter's `{module}` (lora_A {:?}, lora_B {:?}, r = {}) does not fit the base \
                 weight `{wname}` {:?} in {}: the adapter was trained on another model",
                a.dims(),
                b.dims(),
                info.spec.rank,
                w.shape,
                base.display()
            );
        }
        check_magnitude(adapter, &module, p.m.as_ref(), info.spec.dora, out_f)?;
        if w.src == Src::Stored && candle_dtype(w.dtype).is_none() {
            bail!(
                "`{wname}` in {} is {}, not a float tensor",
                base.display(),
                w.dtype
            );
        }
        checked.insert(module, Adapter::Linear(a, b, p.m));
    }
    Ok((checked, slots))
}

/// Every base tensor an adapter targets has its lora_A / lora_B in `pairs` (the adapter's
/// `file`): each targeted linear of a decoder layer, and each expert parameter (`slots`,
/// item by item); an error naming the first that has none.
pub(super) fn every_target_adapted(
    file: &Path,
    base: &Path,
    targets: &[String],
    pairs: &BTreeMap<String, Pair>,
    items: &[Item],
    slots: &[Option<experts::Slot>],
) -> Result<()> {
    for (it, slot) in items.iter().zip(slots) {
        let (module, what) = match slot {
            Some(s) => (s.module.as_str(), "the experts"),
            None => {
                let Some(module) = it.name.strip_suffix(".weight") else {
                    continue;
                };
                let leaf = module.rsplit('.').next().unwrap_or("");
                let linear = module.starts_with("model.layers.") && !experts::is_tensor(&it.name);
                if !linear || !targets.iter().any(|t| t == leaf) {
                    continue;
                }
                (module, leaf)
            }
        };
        if !pairs.contains_key(module) {
            bail!(
                "{}: no lora_A/lora_B for `{module}`, although adapter_config.json targets {what}: \
                 the adapter does not match the base model in {}",
                file.display(),
                base.display()
            );
        }
    }
    Ok(())
}
