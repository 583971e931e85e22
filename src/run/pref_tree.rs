//! The prefix-tree pair layout (`data::pref_batch`: [prompt | chosen | rejected], the prompt
//! once) against the two-sequence layout it replaced (prompt + chosen and prompt + rejected,
//! each its own block-diagonal segment): the same loss and adapter gradients on the preference
//! fixtures, in f32 on the CPU, through the objective and the step's forward and backward.

use crate::data::pref_batch::{PrefBatch, PrefLayout};
use crate::data::preference::{load_pairs, PairExample, PrefSpec};
use crate::data::{Batch, Example, IGNORE};
use crate::model::Keep;
use crate::recipe::Recipe;
use crate::train::driver::{self, Par};
use crate::train::objective::ObjectiveKind;
use crate::train::optim::Grads;
use crate::train::Session;
use std::path::PathBuf;
use std::sync::Arc;

fn fixture(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/pref")
        .join(case)
}

/// A session on the fixture's model and init adapter, in f32 on the CPU.
fn session(case: &str, objective: &str, dir: &std::path::Path) -> Session {
    let d = fixture(case);
    let text = format!(
        "[model]\npath = \"{}\"\ndtype = \"f32\"\n[lora]\ninit_adapter = \"{}\"\ndropout = 0.0\n\
         [data]\ntrain = \"{}\"\nformat = \"preference\"\nseq_len = 64\n\
         [train]\nobjective = \"{objective}\"\n[output]\ndir = \"{}\"\n",
        fixture("../../../recipes/assets/tiny-llama").display(),
        d.join("init_adapter").display(),
        d.join("train.jsonl").display(),
        dir.join("out").display(),
    );
    let p = dir.join("recipe.toml");
    std::fs::write(&p, text).unwrap();
    Session::new(Recipe::load(&p, &[]).unwrap()).unwrap()
}

/// The layout before the prefix tree: a pair's chosen and rejected sequences (each prompt +
/// completion, TRL's keep_start cut) side by side in one row, each its own segment.
fn two_sequences(pairs: &[&PairExample], max_len: usize, score_chosen_prompt: bool) -> Batch {
    let mut examples = Vec::new();
    let (mut prompt_len, mut completion_len) = (Vec::new(), Vec::new());
    for x in pairs {
        let p = x.prompt.len().min(max_len);
        for (comp, scored) in [(&x.chosen, score_chosen_prompt), (&x.rejected, false)] {
            let c = comp.len().min(max_len - p);
            let ids: Vec<u32> = x.prompt[..p].iter().chain(&comp[..c]).copied().collect();
            let labels = ids
                .iter()
                .enumerate()
                .map(|(j, &t)| if j >= p || scored { t as i64 } else { IGNORE })
                .collect();
            examples.push(Example { ids, labels });
            prompt_len.push(p);
            completion_len.push(c);
        }
    }
    let rows: Vec<Vec<&Example>> = examples.chunks(2).map(|c| c.iter().collect()).collect();
    let batch = Batch::from_rows(&rows, 0, true);
    let seg = batch.segments.clone().unwrap();
    let (mut target_seq, mut target_completion) = (Vec::new(), Vec::new());
    for &(at, _) in &batch.targets {
        let s = (at / batch.t) * 2 + seg[at] as usize;
        target_seq.push(s as u32);
        target_completion.push(batch.positions[at] as usize + 1 >= prompt_len[s]);
    }
    let layout = PrefLayout {
        prompt_len,
        completion_len,
        target_seq,
        target_completion,
        ..PrefLayout::default()
    };
    Batch {
        pref: Some(Arc::new(layout)),
        ..batch
    }
}

/// One step's loss numerator and adapter gradients over `batches`.
fn step(s: &Session, batches: &[Batch]) -> (f64, Grads) {
    let obj = s.run.objective.objective(None);
    let par = Par::single();
    obj.begin_step(&s.model, &par, batches).unwrap();
    let denom = batches.iter().map(|b| b.targets.len()).sum::<usize>() as f64;
    let (mut grads, mut loss) = (Grads::new(), None);
    for b in batches {
        let c = driver::forward_backward_dev(
            &s.model,
            &par,
            b,
            denom,
            Keep::Acts,
            None,
            &mut grads,
            &*obj,
            &mut |_| Ok(()),
        )
        .unwrap();
        loss = driver::add_ce(loss, c).unwrap();
    }
    obj.end_step(&*s.comm, &s.model).unwrap();
    let loss = loss.unwrap().to_scalar::<f32>().unwrap() as f64;
    (loss, grads)
}

/// Max |a − b| / max |b| over every adapter gradient, and the largest |b|.
fn grad_diff(a: &Grads, b: &Grads) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let (mut diff, mut scale) = (0f64, 0f64);
    for (id, gb) in b {
        let vb: Vec<f32> = gb.flatten_all().unwrap().to_vec1().unwrap();
        let va: Vec<f32> = a[id].flatten_all().unwrap().to_vec1().unwrap();
        for (x, y) in va.iter().zip(&vb) {
            diff = diff.max((x - y).abs() as f64);
            scale = scale.max(y.abs() as f64);
        }
    }
    (diff / scale.max(f64::MIN_POSITIVE), scale)
}

/// DPO (its reference's forward through the tree too) and ORPO (the chosen prompt's tokens
/// scored): every micro-batch of the fixture, a pair a row and two pairs a row.
#[test]
fn a_prefix_tree_gives_the_two_sequences_loss_and_gradients() {
    for (case, objective) in [("dpo_sigmoid", "dpo"), ("orpo", "orpo")] {
        let tmp = tempfile::tempdir().unwrap();
        let s = session(case, objective, tmp.path());
        assert!(matches!(s.run.objective, ObjectiveKind::Pair { .. }));
        let orpo = s.run.objective.scores_chosen_prompt();
        let spec = PrefSpec {
            tok: None,
            max_len: 64,
            max_prompt_len: None,
            vocab_size: s.model.cfg.vocab_size,
        };
        let data = load_pairs(&fixture(case).join("train.jsonl"), &spec).unwrap();
        let pairs: Vec<&PairExample> = data.examples.iter().collect();
        // a short max_len too: truncated completions (keep_start) share the cut prompt
        for max_len in [64, 12] {
            let pairs: Vec<&PairExample> = pairs
                .iter()
                .copied()
                .filter(|p| p.prompt.len() < max_len)
                .collect();
            assert!(pairs.len() >= 4, "{case}: too few pairs under {max_len}");
            let old: Vec<Batch> = pairs
                .chunks(4)
                .map(|c| two_sequences(c, max_len, orpo))
                .collect();
            let (l_old, g_old) = step(&s, &old);
            for per_row in [1, 2] {
                let tree: Vec<Batch> = pairs
                    .chunks(4)
                    .map(|c| PrefBatch::pairs(c, 0, max_len, per_row, orpo).into_batch())
                    .collect();
                let tokens = |v: &[Batch]| v.iter().map(|b| b.tokens).sum::<usize>();
                assert!(tokens(&tree) < tokens(&old), "{case}: the prompt once");
                let (l_tree, g_tree) = step(&s, &tree);
                let dl = (l_tree - l_old).abs() / l_old.abs();
                let (dg, scale) = grad_diff(&g_tree, &g_old);
                crate::errln!(
                    "{case} max_len {max_len} per_row {per_row}: loss {l_tree:.7} vs {l_old:.7} \
                     (rel {dl:.2e}), gradients rel {dg:.2e} of {scale:.3e}"
                );
                assert!(dl <= 1e-6, "{case} {max_len} {per_row}: loss rel {dl:.3e}");
                assert!(
                    dg <= 1e-6,
                    "{case} {max_len} {per_row}: gradients rel {dg:.3e}"
                );
                assert!(scale > 1e-6, "{case}: the gradients are not zero");
            }
        }
    }
}
